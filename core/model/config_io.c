/* Model config I/O: the YAML files users write (libyaml, event parser) and
 * the JSON stored in checkpoint metadata (jansson). Both are untrusted
 * input: every key, type and range is checked, and every error names the
 * key (and, for YAML, the line and file) at fault. */
#include "core/model/config.h"

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

#include "core/formats/fileio.h"

/* Config files are small; anything bigger is not a config. */
#define CONFIG_MAX_BYTES (1u << 20)

/* ---------------------------------------------------------------- keys */

/* K_BOOL is an int 0/1 written true/false; K_ENUM an int whose values
 * are the names in `names`; K_MAP a mapping whose keys are the entries
 * named "<map>.<key>" (sub = 1). Keys with `variant` (DESIGN section 6)
 * are written to JSON only when they differ from the default, so the
 * config of a section 2 model reads as it always did. */
typedef enum { K_INT, K_I64, K_DBL, K_BOOL, K_ENUM, K_MAP } key_kind;

static const char *const ffn_acts[] = {"swiglu", "geglu", NULL};
static const char *const rope_types[] = {"none", "yarn", NULL};
static const char *const objectives[] = {"clm", "mlm", NULL};

#define RS(f) offsetof(nl_config, rope_scaling) + offsetof(nl_rope_scaling, f)
static const struct key {
    const char *name;
    key_kind kind;
    size_t off;
    int variant, sub;
    const char *const *names; /* K_ENUM */
} keys[] = {
    {"vocab_size", K_I64, offsetof(nl_config, vocab_size), 0, 0, NULL},
    {"vocab_chunk", K_I64, offsetof(nl_config, vocab_chunk), 0, 0, NULL},
    {"hidden_dim", K_INT, offsetof(nl_config, hidden_dim), 0, 0, NULL},
    {"num_layers", K_INT, offsetof(nl_config, num_layers), 0, 0, NULL},
    {"num_heads", K_INT, offsetof(nl_config, num_heads), 0, 0, NULL},
    {"num_kv_heads", K_INT, offsetof(nl_config, num_kv_heads), 0, 0, NULL},
    {"ffn_dim", K_INT, offsetof(nl_config, ffn_dim), 0, 0, NULL},
    {"num_experts", K_INT, offsetof(nl_config, num_experts), 0, 0, NULL},
    {"top_k", K_INT, offsetof(nl_config, top_k), 0, 0, NULL},
    {"max_seq_len", K_INT, offsetof(nl_config, max_seq_len), 0, 0, NULL},
    {"rope_base", K_DBL, offsetof(nl_config, rope_base), 0, 0, NULL},
    {"norm_eps", K_DBL, offsetof(nl_config, norm_eps), 0, 0, NULL},
    {"aux_loss_coef", K_DBL, offsetof(nl_config, aux_loss_coef), 0, 0, NULL},
    {"causal", K_BOOL, offsetof(nl_config, causal), 1, 0, NULL},
    {"ffn_act", K_ENUM, offsetof(nl_config, ffn_act), 1, 0, ffn_acts},
    {"attention_window", K_INT, offsetof(nl_config, attention_window), 1, 0, NULL},
    {"global_every", K_INT, offsetof(nl_config, global_every), 1, 0, NULL},
    {"rope_scaling", K_MAP, offsetof(nl_config, rope_scaling), 1, 0, NULL},
    {"rope_scaling.type", K_ENUM, RS(type), 1, 1, rope_types},
    {"rope_scaling.factor", K_DBL, RS(factor), 1, 1, NULL},
    {"rope_scaling.original_max_seq_len", K_INT, RS(original_max_seq_len), 1, 1, NULL},
    {"rope_scaling.beta_fast", K_DBL, RS(beta_fast), 1, 1, NULL},
    {"rope_scaling.beta_slow", K_DBL, RS(beta_slow), 1, 1, NULL},
    {"objective", K_ENUM, offsetof(nl_config, objective), 1, 0, objectives},
    {"mask_prob", K_DBL, offsetof(nl_config, mask_prob), 1, 0, NULL},
    {"num_classes", K_INT, offsetof(nl_config, num_classes), 1, 0, NULL},
};
#undef RS
#define NKEYS (sizeof keys / sizeof keys[0])

/* A top-level key (map = NULL) or a key inside the map named `map`. */
static int find_in(const char *map, const char *name, size_t len)
{
    const size_t ml = map ? strlen(map) + 1 : 0;
    for (size_t i = 0; i < NKEYS; i++) {
        const char *kn = keys[i].name;
        if (keys[i].sub != (map != NULL) || strlen(kn) != ml + len)
            continue;
        if (map && (strncmp(kn, map, ml - 1) != 0 || kn[ml - 1] != '.'))
            continue;
        if (memcmp(kn + ml, name, len) == 0)
            return (int)i;
    }
    return -1;
}

static int find_key(const char *name, size_t len)
{
    return find_in(NULL, name, len);
}

/* The index of a name in a NULL-terminated list, or -1. */
static int enum_index(const char *const *names, const char *s, size_t len)
{
    for (int i = 0; names[i]; i++)
        if (strlen(names[i]) == len && memcmp(names[i], s, len) == 0)
            return i;
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

/* What a key's value must be, for messages. */
static const char *key_want(int k)
{
    switch (keys[k].kind) {
    case K_DBL:
        return "a number";
    case K_BOOL:
        return "true or false";
    case K_ENUM:
        return keys[k].names == ffn_acts     ? "swiglu or geglu"
               : keys[k].names == objectives ? "clm or mlm"
                                             : "yarn";
    case K_MAP:
        return "a mapping";
    default:
        return "an integer";
    }
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
    const char *want = key_want(k);
    if (!ev->data.scalar.plain_implicit || ev->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return nl_error_set(err, NL_ERR_INVALID, "%s: expected %s, got a quoted or tagged '%s'",
                            name, want, shown);
    if (keys[k].kind == K_BOOL || keys[k].kind == K_ENUM) {
        static const char *const bools[] = {"false", "true", NULL};
        int v = enum_index(keys[k].kind == K_BOOL ? bools : keys[k].names, s, len);
        if (v < 0)
            return nl_error_set(err, NL_ERR_INVALID, "%s: expected %s, got '%s'", name, want,
                                shown);
        memcpy((char *)cfg + keys[k].off, &v, sizeof v);
        return NL_OK;
    }
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
    /* 0 means "the default" to a user, so it is refused, except where it
     * is a value of its own: global_every 0 (no global layer), and the
     * default itself where 0 turns a variant off (attention_window 0:
     * global attention; num_classes 0: no classifier) */
    const int zero_ok = keys[k].off == offsetof(nl_config, global_every) ||
                        keys[k].off == offsetof(nl_config, attention_window) ||
                        keys[k].off == offsetof(nl_config, num_classes);
    if (v < 0 && zero_ok)
        return nl_error_set(err, NL_ERR_INVALID, "%s: %lld must be 0 or more", name, v);
    if (v < 1 && !zero_ok)
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

/* libyaml's structural problems, all of which a line indented unlike
 * its neighbours causes (a tab, or a key one column off). */
static bool indentation_problem(const char *problem)
{
    static const char *const known[] = {
        "did not find expected key", "mapping values are not allowed",
        "did not find expected <document start>", "did not find expected '-' indicator"};
    for (size_t i = 0; problem && i < sizeof known / sizeof known[0]; i++)
        if (strstr(problem, known[i]))
            return true;
    return false;
}

static nl_status next_event(yaml_ctx *c, nl_error *err)
{
    if (c->have_ev)
        yaml_event_delete(&c->ev);
    c->have_ev = false;
    if (!yaml_parser_parse(&c->parser, &c->ev)) {
        if (c->parser.error == YAML_MEMORY_ERROR)
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory parsing YAML");
        /* the problem's mark is the line at fault; the context's is
         * where the enclosing mapping began, named only as context */
        nl_error_set(err, NL_ERR_INVALID, "YAML syntax error: %s%s%s%s",
                     c->parser.problem ? c->parser.problem : "unknown problem",
                     c->parser.context ? " " : "", c->parser.context ? c->parser.context : "",
                     indentation_problem(c->parser.problem)
                         ? " (check this line's indentation: every key of a mapping starts in "
                           "the same column, with spaces, not tabs)"
                         : "");
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

static nl_status yaml_pair(yaml_ctx *c, nl_config *cfg, const char *map, nl_error *err);

/* The pairs of a nested mapping (rope_scaling); its start event is current. */
static nl_status yaml_map(yaml_ctx *c, nl_config *cfg, const char *map, nl_error *err)
{
    for (;;) {
        nl_status st = next_event(c, err);
        if (st != NL_OK)
            return st;
        if (c->ev.type == YAML_MAPPING_END_EVENT)
            return NL_OK;
        if ((st = yaml_pair(c, cfg, map, err)) != NL_OK)
            return st;
    }
}

/* One `key: value` pair at the top level (map NULL) or inside the mapping
 * named map; the key event is current. */
static nl_status yaml_pair(yaml_ctx *c, nl_config *cfg, const char *map, nl_error *err)
{
    size_t line0 = c->ev.start_mark.line;
    if (c->ev.type != YAML_SCALAR_EVENT) {
        nl_error_set(err, NL_ERR_INVALID, "expected a key name, got %s", event_what(c->ev.type));
        return at(c, line0, err);
    }
    char shown[48];
    show(shown, sizeof shown, (const char *)c->ev.data.scalar.value, c->ev.data.scalar.length);
    int k = find_in(map, (const char *)c->ev.data.scalar.value, c->ev.data.scalar.length);
    if (k < 0) {
        nl_error_set(err, NL_ERR_INVALID, "unknown key '%s%s%s'", map ? map : "", map ? "." : "",
                     shown);
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
    const yaml_event_type_t want =
        keys[k].kind == K_MAP ? YAML_MAPPING_START_EVENT : YAML_SCALAR_EVENT;
    if (c->ev.type != want) {
        nl_error_set(err, NL_ERR_INVALID, "%s: expected %s, got %s", keys[k].name, key_want(k),
                     event_what(c->ev.type));
        return at(c, c->ev.start_mark.line, err);
    }
    if (keys[k].kind == K_MAP)
        return yaml_map(c, cfg, keys[k].name, err);
    st = yaml_set(cfg, k, &c->ev, err);
    if (st != NL_OK && c->ev.data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
        c->ev.end_mark.line > c->ev.start_mark.line) {
        /* a line indented deeper than the keys continues the value above
         * it ("2 num_heads"): the line at fault is the one it ran into */
        const size_t last = c->ev.end_mark.line + (c->ev.end_mark.column == 0 ? 0 : 1);
        char msg[NL_ERROR_MSG_MAX + 256];
        snprintf(msg, sizeof msg,
                 "%s (line %zu is indented deeper than the key %.40s on line %zu, "
                 "so YAML reads it as the rest of that key's value: start it in the key's column)",
                 err->msg, last, keys[k].name, line0 + 1);
        nl_error_set(err, st, "%s", msg);
        return at(c, last - 1, err);
    }
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
        if ((st = yaml_pair(c, cfg, NULL, err)) != NL_OK)
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

/* The JSON value of key k in cfg; NULL for inf/nan (refused). */
static json_t *json_value(const nl_config *cfg, int k, int *digits)
{
    const char *field = (const char *)cfg + keys[k].off;
    int x;
    switch (keys[k].kind) {
    case K_I64: {
        int64_t v;
        memcpy(&v, field, sizeof v);
        return json_integer(v);
    }
    case K_DBL: {
        double v;
        memcpy(&v, field, sizeof v);
        if (round_trip_digits(v) > *digits)
            *digits = round_trip_digits(v);
        return json_real(v);
    }
    case K_BOOL:
        memcpy(&x, field, sizeof x);
        return json_boolean(x);
    case K_ENUM:
        memcpy(&x, field, sizeof x);
        return json_string(keys[k].names[x]);
    case K_MAP: { /* rope_scaling: its sub keys */
        json_t *o = json_object();
        for (size_t j = 0; o && j < NKEYS; j++)
            if (keys[j].sub && json_object_set_new(o, keys[j].name + strlen(keys[k].name) + 1,
                                                   json_value(cfg, (int)j, digits)) != 0) {
                json_decref(o);
                o = NULL;
            }
        return o;
    }
    default:
        memcpy(&x, field, sizeof x);
        return json_integer(x);
    }
}

/* Whether a section 6 key holds its default (then it is not written). */
static int is_default(const nl_config *cfg, int k)
{
    nl_config def;
    nl_config_init(&def);
    if (keys[k].kind == K_MAP)
        return cfg->rope_scaling.type == NL_ROPE_NONE;
    const size_t n = keys[k].kind == K_DBL || keys[k].kind == K_I64 ? 8 : sizeof(int);
    return memcmp((const char *)cfg + keys[k].off, (const char *)&def + keys[k].off, n) == 0;
}

char *nl_config_to_json(const nl_config *cfg)
{
    json_t *o = json_object();
    char *s = NULL;
    int digits = 6;
    if (!o)
        return NULL;
    for (size_t k = 0; k < NKEYS; k++) {
        if (keys[k].sub || (keys[k].variant && is_default(cfg, (int)k)))
            continue;
        if (json_object_set_new(o, keys[k].name, json_value(cfg, (int)k, &digits)) != 0)
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
    char *field = (char *)cfg + keys[k].off;
    int x;
    switch (keys[k].kind) {
    case K_DBL:
        if (!json_is_number(v))
            return nl_error_set(err, NL_ERR_INVALID, "%s: expected a number", name);
        set_dbl(cfg, k, json_number_value(v));
        return NL_OK;
    case K_BOOL:
        if (!json_is_boolean(v))
            return nl_error_set(err, NL_ERR_INVALID, "%s: expected true or false", name);
        x = json_is_true(v);
        memcpy(field, &x, sizeof x);
        return NL_OK;
    case K_ENUM:
        x = json_is_string(v)
                ? enum_index(keys[k].names, json_string_value(v), json_string_length(v))
                : -1;
        if (x < 0)
            return nl_error_set(err, NL_ERR_INVALID, "%s: expected %s", name, key_want(k));
        memcpy(field, &x, sizeof x);
        return NL_OK;
    case K_MAP: {
        const char *sub;
        json_t *sv;
        if (!json_is_object(v))
            return nl_error_set(err, NL_ERR_INVALID, "%s: expected an object", name);
        json_object_foreach(v, sub, sv)
        {
            int j = find_in(name, sub, strlen(sub));
            if (j < 0) {
                char shown[48];
                show(shown, sizeof shown, sub, strlen(sub));
                return nl_error_set(err, NL_ERR_INVALID, "unknown key '%s.%s'", name, shown);
            }
            nl_status st = json_set(cfg, j, sv, err);
            if (st != NL_OK)
                return st;
        }
        return NL_OK;
    }
    default:
        if (!json_is_integer(v))
            return nl_error_set(err, NL_ERR_INVALID, "%s: expected an integer", name);
        return set_int(cfg, k, json_integer_value(v), err);
    }
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
