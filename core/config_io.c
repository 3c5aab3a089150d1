/* Model config I/O: the YAML files users write (libyaml, event parser) and
 * the JSON stored in checkpoint metadata (jansson). Both are untrusted
 * input: every key, type and range is checked, and every error names the
 * key (and, for YAML, the line and file) at fault. */
#include "config.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "fileio.h"

/* Config files are small; anything bigger is not a config. */
#define CONFIG_MAX_BYTES (1u << 20)

/* ---------------------------------------------------------------- keys */

typedef enum { K_INT, K_I64, K_DBL } key_kind;

static const struct key {
    const char *name;
    key_kind kind;
    size_t off;
} keys[] = {
    {"vocab_size", K_I64, offsetof(nl_config, vocab_size)},
    {"vocab_chunk", K_I64, offsetof(nl_config, vocab_chunk)},
    {"hidden_dim", K_INT, offsetof(nl_config, hidden_dim)},
    {"num_layers", K_INT, offsetof(nl_config, num_layers)},
    {"num_heads", K_INT, offsetof(nl_config, num_heads)},
    {"num_kv_heads", K_INT, offsetof(nl_config, num_kv_heads)},
    {"ffn_dim", K_INT, offsetof(nl_config, ffn_dim)},
    {"num_experts", K_INT, offsetof(nl_config, num_experts)},
    {"top_k", K_INT, offsetof(nl_config, top_k)},
    {"max_seq_len", K_INT, offsetof(nl_config, max_seq_len)},
    {"rope_base", K_DBL, offsetof(nl_config, rope_base)},
    {"norm_eps", K_DBL, offsetof(nl_config, norm_eps)},
    {"aux_loss_coef", K_DBL, offsetof(nl_config, aux_loss_coef)},
};
#define NKEYS (sizeof keys / sizeof keys[0])

static int find_key(const char *name, size_t len)
{
    for (size_t i = 0; i < NKEYS; i++)
        if (strlen(keys[i].name) == len && memcmp(keys[i].name, name, len) == 0)
            return (int)i;
    return -1;
}

/* Store an integer, refusing what does not fit the field. */
static nl_status set_int(nl_config *cfg, int k, long long v, nl_error *err)
{
    char *field = (char *)cfg + keys[k].off;
    if (keys[k].kind == K_I64) {
        int64_t x = v;
        memcpy(field, &x, sizeof x);
    } else {
        if (v < INT_MIN || v > INT_MAX)
            return nl_error_set(err, NL_ERR_INVALID, "%s: %lld is out of range", keys[k].name, v);
        int x = (int)v;
        memcpy(field, &x, sizeof x);
    }
    return NL_OK;
}

static void set_dbl(nl_config *cfg, int k, double v)
{
    memcpy((char *)cfg + keys[k].off, &v, sizeof v);
}

/* Copy at most 40 bytes of src into dst for an error message, replacing
 * bytes that are not printable ASCII by '?'. */
static void show(char *dst, size_t n, const char *src, size_t len)
{
    size_t max = n - 4 < 40 ? n - 4 : 40, i;
    for (i = 0; i < len && i < max; i++)
        dst[i] = src[i] >= 0x20 && src[i] < 0x7f ? src[i] : '?';
    if (i < len) {
        memcpy(dst + i, "...", 3);
        i += 3;
    }
    dst[i] = '\0';
}

/* ---------------------------------------------------------------- YAML */

/* A decimal integer: [+-]digits, no leading zeros (YAML 1.1 would read
 * 010 as octal), no underscores. 0: ok, -1: not an integer, -2: too big. */
static int parse_int(const char *s, size_t len, long long *out)
{
    char buf[32];
    size_t i = len > 0 && (s[0] == '+' || s[0] == '-');
    if (i == len)
        return -1;
    for (size_t j = i; j < len; j++)
        if (s[j] < '0' || s[j] > '9')
            return -1;
    if (s[i] == '0' && len - i > 1)
        return -1;
    if (len >= sizeof buf)
        return -2;
    memcpy(buf, s, len);
    buf[len] = '\0';
    errno = 0;
    *out = strtoll(buf, NULL, 10);
    return errno == ERANGE ? -2 : 0;
}

/* A decimal real (12, 1e-6, 0.01): digits, '.', exponent; no inf/nan/hex.
 * 0: ok, -1: not a number, -2: overflows or underflows a double. */
static int parse_dbl(const char *s, size_t len, double *out)
{
    char buf[64];
    if (len == 0 || len >= sizeof buf)
        return -1;
    memcpy(buf, s, len);
    buf[len] = '\0';
    if (strspn(buf, "+-.eE0123456789") != len || strpbrk(buf, "0123456789") == NULL)
        return -1;
    char *end;
    errno = 0;
    *out = strtod(buf, &end);
    if (end != buf + len)
        return -1;
    return errno == ERANGE || !isfinite(*out) ? -2 : 0;
}

/* Apply `key: value` from a YAML scalar. The message names the key; the
 * caller adds where it is. */
static nl_status yaml_set(nl_config *cfg, int k, const yaml_event_t *ev, nl_error *err)
{
    const char *name = keys[k].name;
    const char *s = (const char *)ev->data.scalar.value;
    size_t len = ev->data.scalar.length;
    char shown[48];
    show(shown, sizeof shown, s, len);
    const char *want = keys[k].kind == K_DBL ? "a number" : "an integer";
    if (!ev->data.scalar.plain_implicit || ev->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return nl_error_set(err, NL_ERR_INVALID, "%s: expected %s, got a quoted or tagged '%s'",
                            name, want, shown);
    if (keys[k].kind == K_DBL) {
        double v;
        int r = parse_dbl(s, len, &v);
        if (r == -1)
            return nl_error_set(err, NL_ERR_INVALID, "%s: expected a number, got '%s'", name,
                                shown);
        if (r == -2)
            return nl_error_set(err, NL_ERR_INVALID, "%s: %s is out of range", name, shown);
        set_dbl(cfg, k, v);
        return NL_OK;
    }
    long long v;
    int r = parse_int(s, len, &v);
    if (r == -1)
        return nl_error_set(err, NL_ERR_INVALID, "%s: expected an integer, got '%s'", name, shown);
    if (r == -2)
        return nl_error_set(err, NL_ERR_INVALID, "%s: %s is out of range", name, shown);
    if (v < 1)
        return nl_error_set(err, NL_ERR_INVALID,
                            "%s: %lld must be at least 1 (leave the key out for the default)", name,
                            v);
    return set_int(cfg, k, v, err);
}

typedef struct yaml_ctx {
    yaml_parser_t parser;
    yaml_event_t ev;
    bool have_ev;
    const char *path; /* NULL for text */
    int line[NKEYS];  /* 1-based line of each key seen, 0 if absent */
} yaml_ctx;

/* Prefix err with the place: "path:line" or "line N". */
static nl_status at(const yaml_ctx *c, size_t line0, nl_error *err)
{
    if (c->path)
        return nl_error_prefix(err, "%s:%zu", c->path, line0 + 1);
    return nl_error_prefix(err, "line %zu", line0 + 1);
}

static nl_status next_event(yaml_ctx *c, nl_error *err)
{
    if (c->have_ev)
        yaml_event_delete(&c->ev);
    c->have_ev = false;
    if (!yaml_parser_parse(&c->parser, &c->ev)) {
        if (c->parser.error == YAML_MEMORY_ERROR)
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory parsing YAML");
        nl_error_set(err, NL_ERR_INVALID, "YAML syntax error: %s%s%s",
                     c->parser.problem ? c->parser.problem : "unknown problem",
                     c->parser.context ? " " : "", c->parser.context ? c->parser.context : "");
        return at(c, c->parser.problem_mark.line, err);
    }
    c->have_ev = true;
    return NL_OK;
}

static const char *event_what(yaml_event_type_t t)
{
    switch (t) {
    case YAML_SCALAR_EVENT:
        return "a scalar";
    case YAML_SEQUENCE_START_EVENT:
        return "a sequence";
    case YAML_MAPPING_START_EVENT:
        return "a mapping";
    case YAML_ALIAS_EVENT:
        return "an alias";
    default:
        return "nothing";
    }
}

/* One `key: value` pair; the key event is current. */
static nl_status yaml_pair(yaml_ctx *c, nl_config *cfg, nl_error *err)
{
    size_t line0 = c->ev.start_mark.line;
    if (c->ev.type != YAML_SCALAR_EVENT) {
        nl_error_set(err, NL_ERR_INVALID, "expected a key name, got %s", event_what(c->ev.type));
        return at(c, line0, err);
    }
    char shown[48];
    show(shown, sizeof shown, (const char *)c->ev.data.scalar.value, c->ev.data.scalar.length);
    int k = find_key((const char *)c->ev.data.scalar.value, c->ev.data.scalar.length);
    if (k < 0) {
        nl_error_set(err, NL_ERR_INVALID, "unknown key '%s'", shown);
        return at(c, line0, err);
    }
    if (c->line[k]) {
        nl_error_set(err, NL_ERR_INVALID, "%s: duplicate key (first given on line %d)",
                     keys[k].name, c->line[k]);
        return at(c, line0, err);
    }
    c->line[k] = (int)(line0 + 1 > INT_MAX ? INT_MAX : line0 + 1);
    nl_status st = next_event(c, err);
    if (st != NL_OK)
        return st;
    if (c->ev.type != YAML_SCALAR_EVENT) {
        nl_error_set(err, NL_ERR_INVALID, "%s: expected %s, got %s", keys[k].name,
                     keys[k].kind == K_DBL ? "a number" : "an integer", event_what(c->ev.type));
        return at(c, c->ev.start_mark.line, err);
    }
    st = yaml_set(cfg, k, &c->ev, err);
    if (st != NL_OK)
        return at(c, c->ev.start_mark.line, err);
    return NL_OK;
}

/* Stream -> one document -> one flat mapping of scalars -> end. */
static nl_status yaml_walk(yaml_ctx *c, nl_config *cfg, nl_error *err)
{
    nl_status st;
    if ((st = next_event(c, err)) != NL_OK) /* stream start */
        return st;
    if ((st = next_event(c, err)) != NL_OK)
        return st;
    if (c->ev.type != YAML_DOCUMENT_START_EVENT) {
        nl_error_set(err, NL_ERR_INVALID, "the config is empty: expected a mapping of keys");
        return at(c, c->ev.start_mark.line, err);
    }
    if ((st = next_event(c, err)) != NL_OK)
        return st;
    if (c->ev.type != YAML_MAPPING_START_EVENT) {
        nl_error_set(err, NL_ERR_INVALID, "the config must be a mapping of keys, not %s",
                     event_what(c->ev.type));
        return at(c, c->ev.start_mark.line, err);
    }
    for (;;) {
        if ((st = next_event(c, err)) != NL_OK)
            return st;
        if (c->ev.type == YAML_MAPPING_END_EVENT)
            break;
        if ((st = yaml_pair(c, cfg, err)) != NL_OK)
            return st;
    }
    if ((st = next_event(c, err)) != NL_OK) /* document end */
        return st;
    if ((st = next_event(c, err)) != NL_OK)
        return st;
    if (c->ev.type != YAML_STREAM_END_EVENT) {
        nl_error_set(err, NL_ERR_INVALID, "more than one YAML document; a config is one mapping");
        return at(c, c->ev.start_mark.line, err);
    }
    return NL_OK;
}

/* Fill defaults and validate; a failure is placed on the line of the key
 * the message starts with, where that key was given. */
static nl_status finish_yaml(yaml_ctx *c, nl_config *cfg, nl_error *err)
{
    nl_config_fill_derived(cfg);
    nl_status st = nl_config_validate(cfg, 0, err);
    if (st == NL_OK || !err)
        return st;
    size_t n = strcspn(err->msg, ":");
    int k = find_key(err->msg, n);
    if (k >= 0 && c->line[k])
        return at(c, (size_t)c->line[k] - 1, err);
    if (c->path)
        return nl_error_prefix(err, "%s", c->path);
    return st;
}

static nl_status parse_yaml(nl_config *cfg, const char *text, size_t len, const char *path,
                            nl_error *err)
{
    yaml_ctx *c = calloc(1, sizeof *c);
    nl_status st = NL_OK;
    nl_config_init(cfg);
    if (!c)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory parsing YAML");
    c->path = path;
    if (len > CONFIG_MAX_BYTES) {
        st = nl_error_set(err, NL_ERR_LIMIT, "%s: %zu bytes is above the config limit of %u",
                          path ? path : "config", len, CONFIG_MAX_BYTES);
        goto out_free;
    }
    if (!yaml_parser_initialize(&c->parser)) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory parsing YAML");
        goto out_free;
    }
    yaml_parser_set_input_string(&c->parser, (const unsigned char *)text, len);
    st = yaml_walk(c, cfg, err);
    if (st == NL_OK)
        st = finish_yaml(c, cfg, err);
    if (c->have_ev)
        yaml_event_delete(&c->ev);
    yaml_parser_delete(&c->parser);
out_free:
    free(c);
    return st;
}

nl_status nl_config_parse_yaml(nl_config *cfg, const char *text, size_t len, nl_error *err)
{
    return parse_yaml(cfg, text, len, NULL, err);
}

nl_status nl_config_load_yaml(nl_config *cfg, const char *path, nl_error *err)
{
    char *text = NULL;
    size_t len = 0;
    nl_config_init(cfg);
    nl_status st = nl_file_read_all(path, CONFIG_MAX_BYTES, &text, &len, err);
    if (st != NL_OK)
        return st;
    st = parse_yaml(cfg, text, len, path, err);
    free(text);
    return st;
}

/* ---------------------------------------------------------------- JSON */

/* The fewest significant digits, at least 6, that print x so that it
 * parses back to exactly x (17 always do). */
static int round_trip_digits(double x)
{
    char buf[48];
    for (int p = 6; p < 17; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, x);
        if (strtod(buf, NULL) == x)
            return p;
    }
    return 17;
}

char *nl_config_to_json(const nl_config *cfg)
{
    json_t *o = json_object();
    char *s = NULL;
    int digits = 6;
    if (!o)
        return NULL;
    for (size_t k = 0; k < NKEYS; k++) {
        const char *field = (const char *)cfg + keys[k].off;
        json_t *v = NULL;
        if (keys[k].kind == K_I64) {
            int64_t x;
            memcpy(&x, field, sizeof x);
            v = json_integer(x);
        } else if (keys[k].kind == K_INT) {
            int x;
            memcpy(&x, field, sizeof x);
            v = json_integer(x);
        } else {
            double x;
            memcpy(&x, field, sizeof x);
            v = json_real(x); /* NULL for inf/nan: refused below */
            if (round_trip_digits(x) > digits)
                digits = round_trip_digits(x);
        }
        if (json_object_set_new(o, keys[k].name, v) != 0)
            goto out;
    }
    /* Enough digits for every double to parse back to itself. */
    s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(digits));
out:
    json_decref(o);
    return s;
}

static nl_status json_set(nl_config *cfg, int k, json_t *v, nl_error *err)
{
    const char *name = keys[k].name;
    if (keys[k].kind == K_DBL) {
        if (!json_is_number(v))
            return nl_error_set(err, NL_ERR_INVALID, "%s: expected a number", name);
        set_dbl(cfg, k, json_number_value(v));
        return NL_OK;
    }
    if (!json_is_integer(v))
        return nl_error_set(err, NL_ERR_INVALID, "%s: expected an integer", name);
    return set_int(cfg, k, json_integer_value(v), err);
}

nl_status nl_config_from_json(nl_config *cfg, const char *json, nl_error *err)
{
    json_error_t jerr;
    nl_config_init(cfg);
    json_t *o = json_loads(json, JSON_REJECT_DUPLICATES, &jerr);
    nl_status st = NL_OK;
    const char *key;
    json_t *v;
    if (!o)
        return nl_error_set(err, NL_ERR_FORMAT, "config JSON: line %d column %d: %s", jerr.line,
                            jerr.column, jerr.text);
    if (!json_is_object(o)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "config JSON: not an object");
        goto out;
    }
    json_object_foreach(o, key, v)
    {
        char shown[48];
        int k = find_key(key, strlen(key));
        if (k < 0) {
            show(shown, sizeof shown, key, strlen(key));
            st = nl_error_set(err, NL_ERR_INVALID, "unknown key '%s'", shown);
            goto out;
        }
        if ((st = json_set(cfg, k, v, err)) != NL_OK)
            goto out;
    }
    nl_config_fill_derived(cfg);
    st = nl_config_validate(cfg, 0, err);
out:
    if (st != NL_OK && err && strncmp(err->msg, "config JSON", 11) != 0)
        nl_error_prefix(err, "config JSON");
    json_decref(o);
    return st;
}
