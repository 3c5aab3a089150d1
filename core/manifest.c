/* Sharded checkpoints: the manifest (JSON, jansson), the shard hashes
 * (SHA-256, libsodium), verification, re-cutting stages out of the shards
 * and joining them into one checkpoint. */
#include "manifest.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <libgen.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "fileio.h"
#include "grow.h"
#include "memory.h"
#include "safetensors.h"

/* A shard's file name, and a node's free text, are at most this long. */
#define NAME_MAX_BYTES 255
#define NODE_MAX_BYTES 1024

/* ---------------------------------------------------------------- JSON helpers */

/* The fewest significant digits that print every real in the tree so
 * that it parses back to itself (so a manifest reads 1e-06, not
 * 9.9999999999999995e-07, and loses nothing). */
static int real_digits(json_t *v)
{
    int d = 1;
    if (json_is_real(v)) {
        const double x = json_real_value(v);
        char buf[40];
        for (; d < 17; d++) {
            snprintf(buf, sizeof buf, "%.*g", d, x);
            if (strtod(buf, NULL) == x)
                break;
        }
    } else if (json_is_object(v)) {
        const char *key;
        json_t *e;
        json_object_foreach(v, key, e)
        {
            int k = real_digits(e);
            d = k > d ? k : d;
        }
    } else if (json_is_array(v)) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e)
        {
            int k = real_digits(e);
            d = k > d ? k : d;
        }
    }
    return d;
}

static char *dump(json_t *v, size_t flags)
{
    return json_dumps(v, flags | JSON_REAL_PRECISION(real_digits(v)));
}

/* Printable text: no control bytes, so a name cannot forge terminal
 * output when it is shown. */
static int printable(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f)
            return 0;
    return 1;
}

/* Member `key` of object o: NULL when absent (or JSON null, when
 * null_ok). */
static json_t *member(json_t *o, const char *key, int null_ok)
{
    json_t *v = json_object_get(o, key);
    return v && null_ok && json_is_null(v) ? NULL : v;
}

/* An integer member in [lo, hi]. `where` names the object ("" at the top). */
static nl_status get_int(json_t *o, const char *where, const char *key, long long lo, long long hi,
                         long long *out, nl_error *err)
{
    json_t *v = member(o, key, 0);
    if (!v)
        return nl_error_set(err, NL_ERR_FORMAT, "%s%s: missing", where, key);
    if (!json_is_integer(v))
        return nl_error_set(err, NL_ERR_FORMAT, "%s%s: expected an integer", where, key);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return nl_error_set(err, NL_ERR_RANGE, "%s%s: %lld is outside [%lld, %lld]", where, key, x,
                            lo, hi);
    *out = x;
    return NL_OK;
}

/* A string member, copied into *out; NULL when absent or null and
 * optional. */
static nl_status get_str(json_t *o, const char *where, const char *key, int required, char **out,
                         nl_error *err)
{
    json_t *v = member(o, key, !required);
    if (!v && !required)
        return NL_OK;
    if (!v)
        return nl_error_set(err, NL_ERR_FORMAT, "%s%s: missing", where, key);
    if (!json_is_string(v))
        return nl_error_set(err, NL_ERR_FORMAT, "%s%s: expected a string", where, key);
    if (!(*out = strdup(json_string_value(v))))
        return nl_error_set(err, NL_ERR_NOMEM, "%s%s: out of memory", where, key);
    return NL_OK;
}

static nl_status get_bool(json_t *o, const char *where, const char *key, int *out, nl_error *err)
{
    json_t *v = member(o, key, 0);
    if (!v)
        return nl_error_set(err, NL_ERR_FORMAT, "%s%s: missing", where, key);
    if (!json_is_boolean(v))
        return nl_error_set(err, NL_ERR_FORMAT, "%s%s: expected true or false", where, key);
    *out = json_is_true(v);
    return NL_OK;
}

/* ---------------------------------------------------------------- parse */

/* A shard's file name: plain (no directory part), printable, not "." or "..". */
static nl_status check_file_name(const char *f, const char *where, nl_error *err)
{
    size_t n = strlen(f);
    if (n == 0 || n > NAME_MAX_BYTES)
        return nl_error_set(err, NL_ERR_FORMAT, "%sfile: a file name of 1 to %d bytes, not %zu",
                            where, NAME_MAX_BYTES, n);
    if (!printable(f))
        return nl_error_set(err, NL_ERR_FORMAT, "%sfile: has a control character", where);
    if (strchr(f, '/') || strcmp(f, ".") == 0 || strcmp(f, "..") == 0)
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%sfile: '%s' is not a plain file name (shards lie in the "
                            "manifest's directory)",
                            where, f);
    return NL_OK;
}

static nl_status parse_sha256(json_t *o, const char *where, char hex[65], nl_error *err)
{
    json_t *v = member(o, "sha256", 0);
    if (!v)
        return nl_error_set(err, NL_ERR_FORMAT, "%ssha256: missing", where);
    const char *s = json_is_string(v) ? json_string_value(v) : NULL;
    int ok = s && strlen(s) == 64;
    for (int i = 0; ok && i < 64; i++)
        ok = (s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f');
    if (!ok)
        return nl_error_set(err, NL_ERR_FORMAT, "%ssha256: expected 64 lowercase hex digits",
                            where);
    memcpy(hex, s, 65);
    return NL_OK;
}

/* The fields of one entry of "shards" (`where` is "shards[i]."). */
static nl_status parse_shard(nl_manifest_shard *s, int L, json_t *o, const char *where,
                             nl_error *err)
{
    long long stage = 0, bytes = 0;
    nl_status st;
    if (!json_is_object(o))
        return nl_error_set(err, NL_ERR_FORMAT, "%.*s: expected an object", (int)strlen(where) - 1,
                            where);
    if ((st = get_int(o, where, "stage", 0, NL_MANIFEST_MAX_SHARDS - 1, &stage, err)) ||
        (st = get_bool(o, where, "embed", &s->has_embed, err)) ||
        (st = get_bool(o, where, "head", &s->has_head, err)) ||
        (st = get_str(o, where, "file", 1, &s->file, err)) ||
        (st = check_file_name(s->file, where, err)) ||
        (st = parse_sha256(o, where, s->sha256, err)) ||
        (st = get_int(o, where, "bytes", 0, INT64_MAX, &bytes, err)) ||
        (st = get_str(o, where, "node", 0, &s->node, err)) ||
        (st = get_str(o, where, "device", 0, &s->device, err)))
        return st;
    s->stage = (int)stage;
    s->bytes = (uint64_t)bytes;
    if (s->node && (strlen(s->node) > NODE_MAX_BYTES || !printable(s->node)))
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%snode: at most %d bytes of text without control characters", where,
                            NODE_MAX_BYTES);
    if (s->device && (strlen(s->device) > 64 || !printable(s->device)))
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%sdevice: at most 64 bytes of text without control characters", where);
    s->tf32 = NL_MANIFEST_TF32_UNKNOWN;
    if (member(o, "tf32", 0)) {
        int on = 0;
        if ((st = get_bool(o, where, "tf32", &on, err)))
            return st;
        s->tf32 = on ? NL_MANIFEST_TF32_ON : NL_MANIFEST_TF32_OFF;
    }
    json_t *ly = member(o, "layers", 0);
    if (!ly || !json_is_array(ly) || json_array_size(ly) != 2 ||
        !json_is_integer(json_array_get(ly, 0)) || !json_is_integer(json_array_get(ly, 1)))
        return nl_error_set(err, NL_ERR_FORMAT, "%slayers: expected [first, end] (two integers)",
                            where);
    long long l0 = json_integer_value(json_array_get(ly, 0));
    long long l1 = json_integer_value(json_array_get(ly, 1));
    if (l0 < 0 || l1 <= l0 || l1 > L)
        return nl_error_set(err, NL_ERR_RANGE,
                            "%slayers: [%lld, %lld) is not a non-empty range of the model's %d "
                            "layers",
                            where, l0, l1, L);
    s->l0 = (int)l0;
    s->l1 = (int)l1;
    return NL_OK;
}

/* Shard i's place in the plan, and its resolved path. */
static nl_status place_shard(nl_manifest *m, int i, const char *where, const char *dir,
                             nl_error *err)
{
    nl_manifest_shard *s = &m->shards[i];
    const int L = m->cfg.num_layers, last = i == m->n_shards - 1;
    if (s->stage != i)
        return nl_error_set(err, NL_ERR_FORMAT, "%sstage: %d, expected %d (shards in stage order)",
                            where, s->stage, i);
    if (i == 0 && s->l0 != 0)
        return nl_error_set(err, NL_ERR_FORMAT, "%slayers: stage 0 starts at layer %d, not 0",
                            where, s->l0);
    if (i > 0 && s->l0 != m->shards[i - 1].l1)
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%slayers: starts at layer %d, but shards[%d] ends at %d (the layers "
                            "must be contiguous)",
                            where, s->l0, i - 1, m->shards[i - 1].l1);
    if (last && s->l1 != L)
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%slayers: the last stage ends at layer %d, but the model has %d",
                            where, s->l1, L);
    if (s->has_embed != (i == 0))
        return nl_error_set(err, NL_ERR_FORMAT, "%sembed: the embedding belongs on stage 0 only",
                            where);
    if (s->has_head != last)
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%shead: the head belongs on the last stage (%d) only", where,
                            m->n_shards - 1);
    for (int j = 0; j < i; j++)
        if (strcmp(m->shards[j].file, s->file) == 0)
            return nl_error_set(err, NL_ERR_FORMAT, "%sfile: '%s' is also shards[%d]'s file", where,
                                s->file, j);
    /* resolved path */
    const int has_dir = dir && dir[0];
    const size_t dl = has_dir ? strlen(dir) : 0, fl = strlen(s->file);
    const int slash = has_dir && dir[dl - 1] != '/';
    if (!(s->path = malloc(dl + (size_t)slash + fl + 1)))
        return nl_error_set(err, NL_ERR_NOMEM, "%sfile: out of memory", where);
    if (has_dir)
        memcpy(s->path, dir, dl);
    if (slash)
        s->path[dl] = '/';
    memcpy(s->path + dl + (size_t)slash, s->file, fl + 1);
    return NL_OK;
}

/* The top-level fields before the shards. */
static nl_status parse_head(nl_manifest *m, json_t *root, nl_error *err)
{
    long long step = 0, adam = 0;
    nl_status st;
    json_t *f = member(root, "format", 0);
    if (!f)
        return nl_error_set(err, NL_ERR_FORMAT, "format: missing (not a neurollm manifest)");
    if (!json_is_string(f))
        return nl_error_set(err, NL_ERR_FORMAT, "format: expected a string");
    if (strcmp(json_string_value(f), NL_MANIFEST_FORMAT) != 0)
        return nl_error_set(err, NL_ERR_VERSION, "format: '%.64s' is not %s",
                            printable(json_string_value(f)) ? json_string_value(f) : "?",
                            NL_MANIFEST_FORMAT);
    if ((st = get_int(root, "", "step", 0, INT64_MAX, &step, err)) ||
        (st = get_int(root, "", "adam_steps", 0, INT64_MAX, &adam, err)))
        return st;
    m->step = step;
    m->adam_steps = adam;
    json_t *c = member(root, "config", 0);
    if (!c || !json_is_object(c))
        return nl_error_set(err, NL_ERR_FORMAT, "config: %s", c ? "expected an object" : "missing");
    if (!(m->config_json = dump(c, JSON_COMPACT)))
        return nl_error_set(err, NL_ERR_NOMEM, "config: out of memory");
    if ((st = nl_config_from_json(&m->cfg, m->config_json, err)) != NL_OK)
        return st; /* the message starts with "config JSON" */
    if ((st = nl_config_validate(&m->cfg, 1, err)) != NL_OK)
        return nl_error_prefix(err, "config");
    json_t *t = member(root, "train", 1);
    if (t && !json_is_object(t))
        return nl_error_set(err, NL_ERR_FORMAT, "train: expected an object");
    if (t && !(m->train_json = dump(t, JSON_COMPACT)))
        return nl_error_set(err, NL_ERR_NOMEM, "train: out of memory");
    if ((st = get_str(root, "", "tokenizer", 0, &m->tokenizer, err)) ||
        (st = get_str(root, "", "init_seed", 0, &m->init_seed, err)))
        return st;
    json_t *g = member(root, "growth", 1);
    if (g && !json_is_array(g))
        return nl_error_set(err, NL_ERR_FORMAT, "growth: expected an array");
    if (g) {
        char *text = dump(g, JSON_COMPACT);
        if (!text)
            return nl_error_set(err, NL_ERR_NOMEM, "growth: out of memory");
        st = nl_growth_from_json(text, &m->growth, &m->n_growth, err);
        free(text);
        if (st != NL_OK)
            return st; /* the message starts with "growth" */
    }
    if (m->init_seed) { /* decimal, fitting 64 bits */
        const char *s = m->init_seed;
        char *end = NULL;
        errno = 0;
        (void)strtoull(s, &end, 10);
        if (!s[0] || s[0] < '0' || s[0] > '9' || errno || *end)
            return nl_error_set(err, NL_ERR_FORMAT,
                                "init_seed: expected a decimal seed of 64 bits");
    }
    return NL_OK;
}

nl_status nl_manifest_parse(nl_manifest **out, const char *json, size_t len, const char *dir,
                            nl_error *err)
{
    *out = NULL;
    json_error_t je;
    nl_status st = NL_OK;
    nl_manifest *m = calloc(1, sizeof *m);
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!m) {
        st = nl_error_set(err, NL_ERR_NOMEM, "manifest: out of memory");
        goto out;
    }
    if (!root) {
        st = nl_error_set(err, NL_ERR_FORMAT, "line %d column %d: %s", je.line, je.column, je.text);
        goto out;
    }
    if (!json_is_object(root)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "not a JSON object");
        goto out;
    }
    if ((st = parse_head(m, root, err)) != NL_OK)
        goto out;
    json_t *sh = member(root, "shards", 0);
    if (!sh || !json_is_array(sh)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "shards: %s", sh ? "expected an array" : "missing");
        goto out;
    }
    size_t n = json_array_size(sh);
    if (n == 0 || n > NL_MANIFEST_MAX_SHARDS) {
        st = nl_error_set(err, n ? NL_ERR_LIMIT : NL_ERR_FORMAT,
                          "shards: %zu shards; a manifest has 1 to %d", n, NL_MANIFEST_MAX_SHARDS);
        goto out;
    }
    if (!(m->shards = calloc(n, sizeof *m->shards))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "shards: out of memory");
        goto out;
    }
    m->n_shards = (int)n;
    for (int i = 0; i < m->n_shards && st == NL_OK; i++) {
        char where[32];
        snprintf(where, sizeof where, "shards[%d].", i);
        st = parse_shard(&m->shards[i], m->cfg.num_layers, json_array_get(sh, (size_t)i), where,
                         err);
        if (st == NL_OK)
            st = place_shard(m, i, where, dir, err);
    }
    if (st == NL_OK) {
        *out = m;
        m = NULL;
    }
out:
    json_decref(root);
    nl_manifest_destroy(&m);
    return st;
}

void nl_manifest_destroy(nl_manifest **mp)
{
    if (!mp || !*mp)
        return;
    nl_manifest *m = *mp;
    for (int i = 0; m->shards && i < m->n_shards; i++) {
        free(m->shards[i].file);
        free(m->shards[i].path);
        free(m->shards[i].node);
        free(m->shards[i].device);
    }
    free(m->shards);
    free(m->config_json);
    free(m->train_json);
    free(m->tokenizer);
    free(m->init_seed);
    free(m->growth);
    free(m);
    *mp = NULL;
}

nl_status nl_manifest_load(nl_manifest **out, const char *path, nl_error *err)
{
    *out = NULL;
    char *file = NULL, *dir = NULL, *text = NULL;
    size_t len = 0;
    nl_status st = NL_OK;
    struct stat sb;
    const int is_dir = stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
    const size_t n = strlen(path);
    if (n == 0)
        return nl_error_set(err, NL_ERR_INVALID, "manifest: empty path");
    /* room for "<path>/manifest.json", and for dirname's "." */
    if (!(file = malloc(n + sizeof NL_MANIFEST_FILE + 1)) || !(dir = malloc(n + 2))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    memcpy(dir, path, n + 1);
    if (is_dir) {
        snprintf(file, n + sizeof NL_MANIFEST_FILE + 1, "%s/%s", path, NL_MANIFEST_FILE);
    } else {
        memcpy(file, path, n + 1);
        char *d = dirname(dir); /* points into dir, or at a static "." or "/" */
        memmove(dir, d, strlen(d) + 1);
    }
    if (stat(file, &sb) != 0 && errno == ENOENT) {
        st = nl_error_set(err, NL_ERR_NOTFOUND, "%s: no such file", file);
        goto out;
    }
    if ((st = nl_file_read_all(file, NL_MANIFEST_MAX_BYTES, &text, &len, err)) != NL_OK)
        goto out;
    if ((st = nl_manifest_parse(out, text, len, dir, err)) != NL_OK)
        nl_error_prefix(err, "%s", file);
out:
    free(text);
    free(dir);
    free(file);
    return st;
}

/* ---------------------------------------------------------------- write */

static int put(json_t *o, const char *key, json_t *v)
{
    return v && json_object_set_new(o, key, v) == 0;
}

/* An object member from JSON text (config, train). */
static nl_status put_json(json_t *o, const char *key, const char *text, nl_error *err)
{
    json_error_t je;
    json_t *v = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (!v || !json_is_object(v)) {
        json_decref(v);
        return nl_error_set(err, NL_ERR_INVALID, "%s: not a JSON object", key);
    }
    return put(o, key, v) ? NL_OK : nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", key);
}

/* A string member; NULL values are left out. json_string refuses text
 * that is not UTF-8. */
static nl_status put_str(json_t *o, const char *where, const char *key, const char *s,
                         nl_error *err)
{
    if (!s || put(o, key, json_string(s)))
        return NL_OK;
    return nl_error_set(err, NL_ERR_INVALID, "%s%s: not UTF-8 text (or out of memory)", where, key);
}

static nl_status shard_json(json_t *arr, const nl_manifest_shard *s, int i, nl_error *err)
{
    char where[32];
    snprintf(where, sizeof where, "shards[%d].", i);
    json_t *o = json_object();
    nl_status st = NL_OK;
    if (!o || json_array_append_new(arr, o) != 0)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", where);
    if (!s->file)
        return nl_error_set(err, NL_ERR_INVALID, "%sfile: missing", where);
    if (s->bytes > INT64_MAX)
        return nl_error_set(err, NL_ERR_RANGE, "%sbytes: %" PRIu64 " is too large", where,
                            s->bytes);
    if (!put(o, "stage", json_integer(s->stage)) ||
        !put(o, "layers", json_pack("[ii]", s->l0, s->l1)) ||
        !put(o, "embed", json_boolean(s->has_embed)) || !put(o, "head", json_boolean(s->has_head)))
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", where);
    if ((st = put_str(o, where, "file", s->file, err)) ||
        (st = put_str(o, where, "sha256", s->sha256, err)))
        return st;
    if (!put(o, "bytes", json_integer((json_int_t)s->bytes)))
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", where);
    if ((st = put_str(o, where, "node", s->node, err)) ||
        (st = put_str(o, where, "device", s->device, err)))
        return st;
    if (s->tf32 != NL_MANIFEST_TF32_UNKNOWN &&
        !put(o, "tf32", json_boolean(s->tf32 == NL_MANIFEST_TF32_ON)))
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", where);
    return NL_OK;
}

nl_status nl_manifest_to_json(const nl_manifest *m, char **out, nl_error *err)
{
    nl_status st = NL_OK;
    nl_manifest *check = NULL;
    char *cfg = nl_config_to_json(&m->cfg), *text = NULL;
    json_t *root = json_object(), *arr = json_array();
    *out = NULL;
    if (!cfg || !root || !arr || !put(root, "format", json_string(NL_MANIFEST_FORMAT)) ||
        !put(root, "step", json_integer(m->step)) ||
        !put(root, "adam_steps", json_integer(m->adam_steps))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    if ((st = put_json(root, "config", cfg, err)) ||
        (m->train_json && (st = put_json(root, "train", m->train_json, err))) ||
        (st = put_str(root, "", "tokenizer", m->tokenizer, err)) ||
        (st = put_str(root, "", "init_seed", m->init_seed, err)))
        goto out;
    if (m->n_growth > 0) {
        char *h = nl_growth_to_json(m->growth, m->n_growth);
        json_t *v = h ? json_loads(h, 0, NULL) : NULL;
        free(h);
        if (!put(root, "growth", v)) {
            st = nl_error_set(err, NL_ERR_NOMEM, "growth: out of memory");
            goto out;
        }
    }
    if (m->n_shards < 0 || m->n_shards > NL_MANIFEST_MAX_SHARDS || (m->n_shards && !m->shards)) {
        st = nl_error_set(err, NL_ERR_INVALID, "shards: %d shards", m->n_shards);
        goto out;
    }
    for (int i = 0; i < m->n_shards && st == NL_OK; i++)
        st = shard_json(arr, &m->shards[i], i, err);
    if (st != NL_OK)
        goto out;
    if (!put(root, "shards", arr)) {
        arr = NULL; /* json_object_set_new took it either way */
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    arr = NULL;
    char *body = dump(root, JSON_INDENT(2));
    size_t n = body ? strlen(body) : 0;
    if (body && (text = malloc(n + 2))) { /* the text ends with a newline */
        memcpy(text, body, n);
        memcpy(text + n, "\n", 2);
    }
    free(body);
    if (!text) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    /* what is written must load: the same checks as a reader's */
    if ((st = nl_manifest_parse(&check, text, n + 1, NULL, err)) != NL_OK)
        goto out;
    *out = text;
    text = NULL;
out:
    nl_manifest_destroy(&check);
    json_decref(arr);
    json_decref(root);
    free(text);
    free(cfg);
    return st;
}

/* Every shard m names, beside the manifest at `path`, has the size and
 * hash m gives it. */
static nl_status verify_beside(const char *path, const nl_manifest *m, nl_error *err)
{
    char *copy = strdup(path), full[4200], hex[65];
    if (!copy)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
    const char *dir = dirname(copy);
    nl_status st = NL_OK;
    for (int i = 0; i < m->n_shards && st == NL_OK; i++) {
        const nl_manifest_shard *s = &m->shards[i];
        uint64_t n = 0;
        snprintf(full, sizeof full, "%s/%s", dir, s->file);
        st = nl_file_sha256(full, hex, &n, err);
        if (st != NL_OK)
            nl_error_prefix(err, "shard %s (stage %d)", s->file, s->stage);
        else if (n != s->bytes || strcmp(hex, s->sha256) != 0)
            st = nl_error_set(err, NL_ERR_INTEGRITY,
                              "shard %s (stage %d): the file (%" PRIu64 " bytes, sha256 %.16s...) "
                              "is not the one reported (%" PRIu64 " bytes, %.16s...)",
                              s->file, s->stage, n, hex, s->bytes, s->sha256);
    }
    free(copy);
    return st;
}

nl_status nl_manifest_write(const char *path, const nl_manifest *m, nl_error *err)
{
    char *text = NULL;
    nl_atomic_file *af = NULL;
    nl_status st = nl_manifest_to_json(m, &text, err);
    if (st == NL_OK)
        st = verify_beside(path, m, err);
    if (st != NL_OK) {
        free(text);
        return nl_error_prefix(err, "%s", path);
    }
    st = nl_atomic_open_mode(&af, path, 0644, err);
    if (st == NL_OK)
        st = nl_atomic_write(af, text, strlen(text), err);
    if (st == NL_OK)
        st = nl_atomic_commit_new(&af, err); /* a manifest is never replaced */
    nl_atomic_abort(&af);
    free(text);
    return st;
}

nl_status nl_manifest_names(const char *path, nl_error *err)
{
    char *copy = strdup(path), *copy2 = strdup(path);
    nl_manifest *m = NULL;
    nl_status st = NL_OK;
    if (!copy || !copy2) {
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    const char *dir = dirname(copy), *base = basename(copy2);
    nl_error ignored;
    if (nl_manifest_load(&m, dir, &ignored) != NL_OK) /* none, or one that names nothing */
        goto out;
    for (int i = 0; i < m->n_shards && st == NL_OK; i++)
        if (strcmp(m->shards[i].file, base) == 0)
            st = nl_error_set(err, NL_ERR_STATE,
                              "%s is shard %d of the checkpoint %s/%s (step %lld); refusing to "
                              "replace it",
                              path, i, dir, NL_MANIFEST_FILE, (long long)m->step);
out:
    nl_manifest_destroy(&m);
    free(copy);
    free(copy2);
    return st;
}

/* ---------------------------------------------------------------- hashes */

static pthread_once_t sodium_once = PTHREAD_ONCE_INIT;
static int sodium_ready;

static void sodium_start(void)
{
    sodium_ready = sodium_init() >= 0;
}

nl_status nl_file_sha256(const char *path, char hex[65], uint64_t *bytes, nl_error *err)
{
    enum { CHUNK = 1 << 20 };
    nl_status st = NL_OK;
    unsigned char *buf = NULL, digest[crypto_hash_sha256_BYTES];
    crypto_hash_sha256_state h;
    uint64_t total = 0;
    struct stat sb;
    hex[0] = '\0';
    pthread_once(&sodium_once, sodium_start);
    if (!sodium_ready)
        return nl_error_set(err, NL_ERR_INTERNAL, "libsodium failed to initialise");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return nl_error_set(err, errno == ENOENT ? NL_ERR_NOTFOUND : NL_ERR_IO, "%s: %s", path,
                            errno == ENOENT ? "no such file" : strerror(errno));
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = nl_error_set(err, NL_ERR_IO, "%s: not a regular file", path);
        goto out;
    }
    if (!(buf = malloc(CHUNK))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    crypto_hash_sha256_init(&h);
    for (;;) {
        ssize_t r = read(fd, buf, CHUNK);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            st = nl_error_set(err, NL_ERR_IO, "%s: read failed: %s", path, strerror(errno));
            goto out;
        }
        if (r == 0)
            break;
        crypto_hash_sha256_update(&h, buf, (unsigned long long)r);
        total += (uint64_t)r;
    }
    crypto_hash_sha256_final(&h, digest);
    sodium_bin2hex(hex, 65, digest, sizeof digest);
    if (bytes)
        *bytes = total;
out:
    free(buf);
    close(fd);
    return st;
}

nl_status nl_manifest_verify(const nl_manifest *m, nl_error *err)
{
    for (int i = 0; i < m->n_shards; i++) {
        const nl_manifest_shard *s = &m->shards[i];
        char hex[65];
        uint64_t n = 0;
        struct stat sb;
        if (stat(s->path, &sb) != 0)
            return nl_error_set(err, errno == ENOENT ? NL_ERR_NOTFOUND : NL_ERR_IO,
                                "shard %s (stage %d): %s: %s; refusing it", s->file, s->stage,
                                s->path, errno == ENOENT ? "no such file" : strerror(errno));
        /* the size first: cheap, and it spares hashing a file that cannot match */
        if (S_ISREG(sb.st_mode) && (uint64_t)sb.st_size != s->bytes)
            return nl_error_set(err, NL_ERR_INTEGRITY,
                                "shard %s (stage %d): size mismatch: the manifest says %" PRIu64
                                " bytes, the file has %lld; refusing it",
                                s->file, s->stage, s->bytes, (long long)sb.st_size);
        nl_status st = nl_file_sha256(s->path, hex, &n, err);
        if (st != NL_OK)
            return nl_error_prefix(err, "shard %s (stage %d)", s->file, s->stage);
        if (n != s->bytes)
            return nl_error_set(err, NL_ERR_INTEGRITY,
                                "shard %s (stage %d): size mismatch: the manifest says %" PRIu64
                                " bytes, %" PRIu64 " were read; refusing it",
                                s->file, s->stage, s->bytes, n);
        if (strcmp(hex, s->sha256) != 0)
            return nl_error_set(err, NL_ERR_INTEGRITY,
                                "shard %s (stage %d): sha256 mismatch: the manifest says %.16s..., "
                                "the file hashes to %.16s...; refusing it",
                                s->file, s->stage, s->sha256, hex);
    }
    return NL_OK;
}

/* Read shard i whole into memory, hashing the very bytes read, and check
 * its size and hash against the manifest: the copy is what was verified. */
static nl_status read_verified(const nl_manifest_shard *s, uint8_t **out, nl_error *err)
{
    enum { CHUNK = 1 << 20 };
    uint8_t *buf = NULL, digest[crypto_hash_sha256_BYTES];
    char hex[65];
    crypto_hash_sha256_state h;
    struct stat sb;
    nl_status st = NL_OK;
    uint64_t got = 0;
    *out = NULL;
    pthread_once(&sodium_once, sodium_start);
    if (!sodium_ready)
        return nl_error_set(err, NL_ERR_INTERNAL, "libsodium failed to initialise");
    int fd = open(s->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return nl_error_set(err, errno == ENOENT ? NL_ERR_NOTFOUND : NL_ERR_IO,
                            "shard %s (stage %d): %s: %s; refusing it", s->file, s->stage, s->path,
                            errno == ENOENT ? "no such file" : strerror(errno));
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = nl_error_set(err, NL_ERR_IO, "shard %s (stage %d): %s: not a regular file", s->file,
                          s->stage, s->path);
        goto out;
    }
    if ((uint64_t)sb.st_size != s->bytes || s->bytes > SIZE_MAX - 1) {
        st = nl_error_set(err, NL_ERR_INTEGRITY,
                          "shard %s (stage %d): size mismatch: the manifest says %" PRIu64
                          " bytes, the file has %lld; refusing it",
                          s->file, s->stage, s->bytes, (long long)sb.st_size);
        goto out;
    }
    if (!(buf = malloc(s->bytes ? (size_t)s->bytes : 1))) {
        st = nl_error_set(err, NL_ERR_NOMEM,
                          "shard %s (stage %d): out of memory for %" PRIu64 " bytes", s->file,
                          s->stage, s->bytes);
        goto out;
    }
    crypto_hash_sha256_init(&h);
    /* one byte more than expected may come: a file that grew is refused */
    for (;;) {
        size_t want =
            got < s->bytes ? (size_t)(s->bytes - got < CHUNK ? s->bytes - got : CHUNK) : 0;
        uint8_t extra;
        ssize_t r = want ? read(fd, buf + got, want) : read(fd, &extra, 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            st = nl_error_set(err, NL_ERR_IO, "shard %s (stage %d): read failed: %s", s->file,
                              s->stage, strerror(errno));
            goto out;
        }
        if (r == 0 || !want) {
            if (r > 0 || got != s->bytes) {
                st = nl_error_set(err, NL_ERR_INTEGRITY,
                                  "shard %s (stage %d): size mismatch: the manifest says %" PRIu64
                                  " bytes, %s were read; refusing it",
                                  s->file, s->stage, s->bytes, r > 0 ? "more" : "fewer");
                goto out;
            }
            break;
        }
        crypto_hash_sha256_update(&h, buf + got, (unsigned long long)r);
        got += (uint64_t)r;
    }
    crypto_hash_sha256_final(&h, digest);
    sodium_bin2hex(hex, sizeof hex, digest, sizeof digest);
    if (strcmp(hex, s->sha256) != 0) {
        st = nl_error_set(err, NL_ERR_INTEGRITY,
                          "shard %s (stage %d): sha256 mismatch: the manifest says %.16s..., "
                          "the file hashes to %.16s...; refusing it",
                          s->file, s->stage, s->sha256, hex);
        goto out;
    }
    *out = buf;
    buf = NULL;
out:
    free(buf);
    close(fd);
    return st;
}

nl_status nl_manifest_open_shard(const nl_manifest *m, int i, nl_st_file **out, nl_error *err)
{
    uint8_t *buf = NULL;
    *out = NULL;
    if (i < 0 || i >= m->n_shards || !m->shards[i].path)
        return nl_error_set(err, NL_ERR_INVALID, "manifest: no shard %d", i);
    nl_status st = read_verified(&m->shards[i], &buf, err);
    if (st != NL_OK)
        return st;
    st = nl_st_open_owned(out, buf, (size_t)m->shards[i].bytes, m->shards[i].path, err);
    return st == NL_OK
               ? st
               : nl_error_prefix(err, "shard %s (stage %d)", m->shards[i].file, m->shards[i].stage);
}

nl_status nl_manifest_open_shards(const nl_manifest *m, nl_st_file **files, nl_error *err)
{
    nl_status st = NL_OK;
    for (int i = 0; i < m->n_shards; i++)
        files[i] = NULL;
    for (int i = 0; i < m->n_shards && st == NL_OK; i++)
        st = nl_manifest_open_shard(m, i, &files[i], err);
    for (int i = 0; st != NL_OK && i < m->n_shards; i++)
        nl_st_close(&files[i]);
    return st;
}

/* ---------------------------------------------------------------- stages */

/* The shard that holds parameter `name` under the manifest's plan. */
static int owner(const nl_manifest *m, const char *name)
{
    if (strncmp(name, "layers.", 7) == 0) {
        const long l = strtol(name + 7, NULL, 10);
        int lo = 0, hi = m->n_shards - 1; /* shards are contiguous: bisect */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (m->shards[mid].l0 <= l)
                lo = mid;
            else
                hi = mid - 1;
        }
        return l >= m->shards[lo].l0 && l < m->shards[lo].l1 ? lo : -1;
    }
    if (strcmp(name, "tok_embeddings.weight") == 0)
        return 0;
    return m->n_shards - 1; /* norm.weight, lm_head.weight */
}

/* A shard must be of the manifest's model, step and optimizer step. */
static nl_status check_shard_meta(const nl_manifest *m, const nl_manifest_shard *s,
                                  const nl_st_file *f, int moments, nl_error *err)
{
    nl_config cfg;
    int64_t step = 0, adam = -1;
    nl_status st = nl_checkpoint_check_meta(f, s->path, &cfg, &step, moments ? &adam : NULL, err);
    if (st != NL_OK)
        return st;
    /* growth changes num_layers and vocab_size without rewriting the
     * shards whose tensors it leaves alone; every tensor read is checked
     * against the manifest's shapes */
    nl_config mine = m->cfg;
    mine.num_layers = cfg.num_layers;
    mine.vocab_size = cfg.vocab_size;
    char *a = nl_config_to_json(&cfg), *b = nl_config_to_json(&mine);
    int same = a && b && strcmp(a, b) == 0;
    free(a);
    free(b);
    if (!a || !b)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", s->path);
    if (!same)
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%s: its config is not the manifest's (beyond num_layers and "
                            "vocab_size)",
                            s->path);
    if (step != m->step)
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%s: step %" PRId64 ", but the manifest says %" PRId64, s->path, step,
                            m->step);
    if (moments && adam < 0)
        return nl_error_set(err, NL_ERR_NOTFOUND, "%s: no optimizer state (metadata 'adam_steps')",
                            s->path);
    if (moments && adam != m->adam_steps)
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%s: adam_steps %" PRId64 ", but the manifest says %" PRId64, s->path,
                            adam, m->adam_steps);
    return NL_OK;
}

/* Read from shard s every entry of `model` that the plan puts there. */
static nl_status read_shard(const nl_manifest *m, int s, nl_model *model, const int *own,
                            unsigned char *pick, float *w, float *mm, float *vv, nl_error *err)
{
    const nl_manifest_shard *sh = &m->shards[s];
    nl_st_file *f = NULL;
    int any = 0;
    for (int i = 0; i < model->n_table; i++) {
        pick[i] = own[i] == s;
        any |= pick[i];
    }
    if (!any)
        return NL_OK;
    /* the bytes read are the bytes hashed: a shard changed or truncated
     * since the manifest was verified is refused, never served */
    nl_status st = nl_manifest_open_shard(m, s, &f, err);
    if (st != NL_OK)
        return st;
    st = check_shard_meta(m, sh, f, mm != NULL, err);
    if (st == NL_OK && (st = nl_checkpoint_read_tensors(model, f, pick, w, mm, vv, err)) != NL_OK)
        nl_error_prefix(err, "%s", sh->path);
    if (st != NL_OK)
        nl_error_prefix(err, "shard %s (stage %d)", sh->file, sh->stage);
    nl_st_close(&f);
    return st;
}

nl_status nl_manifest_load_stage(nl_model **out, nl_backend *be, const nl_manifest *m, int l0,
                                 int l1, int has_embed, int has_head, float *mom_m, float *mom_v,
                                 nl_error *err)
{
    *out = NULL;
    nl_model *model = NULL;
    int *own = NULL;
    unsigned char *pick = NULL;
    nl_host_stage stage[3] = {{0}};
    if (!mom_m != !mom_v)
        return nl_error_set(err, NL_ERR_INVALID, "moments: give both buffers or neither");
    if (m->n_shards < 1 || !m->shards)
        return nl_error_set(err, NL_ERR_INVALID, "manifest: no shards");
    if (l1 < 0)
        l1 = m->cfg.num_layers;
    nl_status st = nl_model_new(&model, be, &m->cfg, l0, l1, has_embed, has_head, err);
    if (st != NL_OK)
        return st;
    const size_t n = model->n_params;
    const size_t bytes = n * sizeof(float);
    float *w = nl_backend_write_view(be, &stage[0], model->params, bytes, err);
    float *mm = mom_m ? nl_backend_write_view(be, &stage[1], mom_m, bytes, err) : NULL;
    float *vv = mom_v ? nl_backend_write_view(be, &stage[2], mom_v, bytes, err) : NULL;
    own = malloc((size_t)model->n_table * sizeof *own + 1);
    pick = malloc((size_t)model->n_table + 1);
    if (!own || !pick || !w || (mom_m && (!mm || !vv))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "stage [%d, %d): out of memory", l0, l1);
        goto out;
    }
    for (int i = 0; i < model->n_table; i++)
        if ((own[i] = owner(m, model->table[i].name)) < 0) {
            st = nl_error_set(err, NL_ERR_INTERNAL, "%s: no shard holds it", model->table[i].name);
            goto out;
        }
    for (int s = 0; s < m->n_shards && st == NL_OK; s++)
        st = read_shard(m, s, model, own, pick, w, mm, vv, err);
    if (st != NL_OK)
        goto out;
    if ((st = nl_model_set_growth(model, m->growth, m->n_growth, err)) != NL_OK)
        goto out;
    nl_backend_write_back(be, model->params, w, bytes);
    if (mom_m) {
        nl_backend_write_back(be, mom_m, mm, bytes);
        nl_backend_write_back(be, mom_v, vv, bytes);
    }
    *out = model;
    model = NULL;
out:
    for (int i = 0; i < 3; i++)
        nl_host_stage_free(&stage[i]);
    free(pick);
    free(own);
    nl_model_destroy(&model);
    return st;
}

/* ---------------------------------------------------------------- export */

/* Refuse to write the joined file over one of its own shards. */
static nl_status check_out(const nl_manifest *m, const char *out, nl_error *err)
{
    struct stat o, s;
    if (stat(out, &o) != 0)
        return NL_OK;
    for (int i = 0; i < m->n_shards; i++)
        if (stat(m->shards[i].path, &s) == 0 && s.st_dev == o.st_dev && s.st_ino == o.st_ino)
            return nl_error_set(err, NL_ERR_INVALID,
                                "%s is shard %s (stage %d) of the manifest; refusing to replace it",
                                out, m->shards[i].file, m->shards[i].stage);
    return NL_OK;
}

/* The run's options as the export writes them. The manifest holds them as
 * a JSON object, which jansson prints in its own way ("3e-5" where the run
 * wrote "3e-05"); the shards carry the text the run wrote. When the first
 * shard's text says the same as the manifest (json_equal: same keys, same
 * values), that text is kept, so the joined file is byte for byte what a
 * one-process save writes; otherwise the manifest's. *out is malloc'd, or
 * NULL when the manifest has none. */
static nl_status train_text(const nl_manifest *m, char **out, nl_error *err)
{
    char *shard = NULL;
    *out = NULL;
    if (!m->train_json)
        return NL_OK;
    nl_status st = nl_checkpoint_meta(m->shards[0].path, "train", &shard, err);
    if (st != NL_OK)
        return st;
    json_t *a = shard ? json_loads(shard, JSON_REJECT_DUPLICATES, NULL) : NULL;
    json_t *b = json_loads(m->train_json, JSON_REJECT_DUPLICATES, NULL);
    if (a && b && json_equal(a, b)) {
        *out = shard;
        shard = NULL;
    } else if (!(*out = strdup(m->train_json))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "train: out of memory");
    }
    json_decref(a);
    json_decref(b);
    free(shard);
    return st;
}

nl_status nl_manifest_export_ex(const nl_manifest *m, const char *out,
                                nl_manifest_export_stats *stats, nl_error *err)
{
    nl_backend *be = NULL;
    nl_model *model = NULL;
    float *mom[2] = {NULL, NULL};
    char *train = NULL;
    const int L = m->cfg.num_layers;
    /* no separate verification: nl_manifest_load_stage below reads every
     * shard through nl_manifest_open_shard, which checks each hash on the
     * bytes it uses */
    nl_status st = check_out(m, out, err);
    if (st == NL_OK)
        st = train_text(m, &train, err);
    if (st == NL_OK)
        st = nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = 0}, err);
    if (st != NL_OK)
        goto out;
    const size_t n = (size_t)nl_stage_param_count(&m->cfg, L, 1, 1);
    for (int j = 0; j < 2; j++)
        if (!(mom[j] = be->alloc(be, n * sizeof(float) + 1))) {
            st = nl_error_set(err, NL_ERR_NOMEM,
                              "%s: out of memory for the moments of %zu "
                              "parameters",
                              out, n);
            goto out;
        }
    st = nl_manifest_load_stage(&model, be, m, 0, L, 1, 1, mom[0], mom[1], err);
    if (st == NL_OK && model->n_params != n)
        st = nl_error_set(err, NL_ERR_INTERNAL, "%zu parameters, expected %zu", model->n_params, n);
    if (st != NL_OK)
        goto out;
    nl_ckpt_extra extra = {.m = mom[0],
                           .v = mom[1],
                           .adam_steps = m->adam_steps,
                           .train_json = train,
                           .tokenizer = m->tokenizer,
                           .init_seed = m->init_seed};
    if ((st = nl_checkpoint_save(model, out, m->step, &extra, err)) != NL_OK)
        goto out;
    if (stats) {
        struct stat sb;
        stats->n_tensors = model->n_table;
        stats->n_params = model->n_params;
        stats->bytes = stat(out, &sb) == 0 ? (uint64_t)sb.st_size : 0;
    }
out:
    for (int j = 0; j < 2 && be; j++)
        if (mom[j])
            be->free(be, mom[j]);
    nl_model_destroy(&model);
    nl_backend_destroy(&be);
    free(train);
    return st;
}

nl_status nl_manifest_export(const nl_manifest *m, const char *out, nl_error *err)
{
    return nl_manifest_export_ex(m, out, NULL, err);
}
