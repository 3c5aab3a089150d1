/* Sharded checkpoints, the writing half (see manifest.c): the manifest
 * encoded as JSON and written beside its shards, the names it may use, and
 * the shards' hashes (SHA-256, libsodium) and their verification. */
#include "core/formats/manifest.h"

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

#include "core/formats/fileio.h"
#include "core/formats/manifest_impl.h"
#include "core/grow/grow.h"

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
        (st = put_str(root, "", "init_seed", m->init_seed, err)) ||
        (st = put_str(root, "", "chat_template", m->chat_template, err)))
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
    char *body = nl_manifest_json_dump(root, JSON_INDENT(2));
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
    st = nl_atomic_open(&af, path, err); /* 0600, as its shards (issue 31) */
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

bool nl_manifest_sodium_ready(void)
{
    pthread_once(&sodium_once, sodium_start);
    return sodium_ready;
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
    if (!nl_manifest_sodium_ready())
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
