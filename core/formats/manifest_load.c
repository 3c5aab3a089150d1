/* Sharded checkpoints, the reading half (see manifest.c): shards read
 * and checked against their hashes, a stage's layers re-cut out of the
 * shards whatever the split they were written with, and the shards joined
 * into one checkpoint (export). */
#include "core/formats/manifest.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/formats/checkpoint.h"
#include "core/formats/manifest_impl.h"
#include "core/formats/safetensors.h"
#include "core/grow/grow.h"
#include "core/model/memory.h"

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
    if (!nl_manifest_sodium_ready())
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

nl_status nl_manifest_check_shard(const nl_manifest *m, int i, nl_error *err)
{
    if (i < 0 || i >= m->n_shards || !m->shards[i].path)
        return nl_error_set(err, NL_ERR_INVALID, "manifest: no shard %d", i);
    const nl_manifest_shard *sh = &m->shards[i];
    nl_st_file *f = NULL;
    nl_status st = nl_st_open(&f, sh->path, err);
    if (st == NL_OK)
        st = check_shard_meta(m, sh, f, 0, err);
    nl_st_close(&f);
    return st == NL_OK ? st : nl_error_prefix(err, "shard %s (stage %d)", sh->file, sh->stage);
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
                           .init_seed = m->init_seed,
                           .chat_template = m->chat_template};
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
