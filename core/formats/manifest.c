/* Sharded checkpoints: the manifest (JSON, jansson), parsed, validated
 * and loaded from a file. The manifest is one module in three files behind
 * manifest_impl.h: this one reads it; manifest_write.c writes it and hashes
 * and verifies the shards (SHA-256, libsodium); manifest_load.c reads
 * verified shards, re-cuts stages out of them and joins them into one
 * checkpoint. */
#include "core/formats/manifest.h"

#include <errno.h>
#include <jansson.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/formats/manifest_impl.h"
#include "core/grow/grow.h"
#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/tokenizer.h"

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

char *nl_manifest_json_dump(json_t *v, size_t flags)
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
    if (!(m->config_json = nl_manifest_json_dump(c, JSON_COMPACT)))
        return nl_error_set(err, NL_ERR_NOMEM, "config: out of memory");
    if ((st = nl_config_from_json(&m->cfg, m->config_json, err)) != NL_OK)
        return st; /* the message starts with "config JSON" */
    if ((st = nl_config_validate(&m->cfg, 1, err)) != NL_OK)
        return nl_error_prefix(err, "config");
    json_t *t = member(root, "train", 1);
    if (t && !json_is_object(t))
        return nl_error_set(err, NL_ERR_FORMAT, "train: expected an object");
    if (t && !(m->train_json = nl_manifest_json_dump(t, JSON_COMPACT)))
        return nl_error_set(err, NL_ERR_NOMEM, "train: out of memory");
    if ((st = get_str(root, "", "tokenizer", 0, &m->tokenizer, err)) ||
        (st = get_str(root, "", "init_seed", 0, &m->init_seed, err)) ||
        (st = get_str(root, "", "chat_template", 0, &m->chat_template, err)) ||
        (st = nl_chat_template_check(m->chat_template, "chat_template", err)))
        return st;
    if (m->tokenizer) { /* what a checkpoint joined from the shards will carry: loadable */
        nl_tokenizer *tk = NULL;
        st = nl_tokenizer_load_buffer(&tk, m->tokenizer, strlen(m->tokenizer), err);
        nl_tokenizer_destroy(&tk);
        if (st != NL_OK)
            return nl_error_prefix(err, "tokenizer");
    }
    json_t *g = member(root, "growth", 1);
    if (g && !json_is_array(g))
        return nl_error_set(err, NL_ERR_FORMAT, "growth: expected an array");
    if (g) {
        char *text = nl_manifest_json_dump(g, JSON_COMPACT);
        if (!text)
            return nl_error_set(err, NL_ERR_NOMEM, "growth: out of memory");
        st = nl_growth_from_json(text, &m->growth, &m->n_growth, err);
        free(text);
        if (st != NL_OK)
            return st; /* the message starts with "growth" */
    }
    return nl_checkpoint_seed_check(m->init_seed, "init_seed", err);
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
    free(m->chat_template);
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
