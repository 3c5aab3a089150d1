/* Growth of a sharded checkpoint (nl_manifest_grow, core/grow/grow.h): the
 * grown config and history entries, the new plan, each shard that changes
 * built in memory from the old shards and grown, the others reused, and a
 * new manifest written last. */
#include <errno.h>
#include <inttypes.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/formats/manifest.h"
#include "core/grow/grow.h"
#include "core/model/memory.h"

/* The entries a spec makes, in the order vocab, depth, width. */
static nl_status plan_entries(const nl_manifest *m, const nl_grow_spec *spec, nl_growth *e, int *n,
                              nl_error *err)
{
    nl_config c = m->cfg;
    nl_status st = NL_OK;
    *n = 0;
    if (spec->vocab_size && spec->vocab_size != c.vocab_size) {
        nl_config a = c;
        if (spec->vocab_size < c.vocab_size)
            return nl_error_set(err, NL_ERR_INVALID, "vocab_size: %lld is below the current %lld",
                                (long long)spec->vocab_size, (long long)c.vocab_size);
        a.vocab_size = spec->vocab_size;
        if ((st = nl_config_validate(&a, 1, err)) != NL_OK)
            return st;
        e[(*n)++] = (nl_growth){.kind = NL_GROW_VOCAB, .before = c, .after = a};
        c = a;
    }
    if (spec->n_layers && spec->n_layers != c.num_layers) {
        nl_config a = c;
        if (spec->n_layers < c.num_layers)
            return nl_error_set(err, NL_ERR_INVALID, "num_layers: %d is below the current %d",
                                spec->n_layers, c.num_layers);
        a.num_layers = spec->n_layers;
        if ((st = nl_config_validate(&a, 1, err)) != NL_OK)
            return st;
        e[(*n)++] = (nl_growth){.kind = NL_GROW_DEPTH, .before = c, .after = a};
        c = a;
    }
    if ((spec->hidden_dim && spec->hidden_dim != c.hidden_dim) ||
        (spec->ffn_dim && spec->ffn_dim != c.ffn_dim)) {
        nl_config a;
        st = nl_config_widen(&c, spec->hidden_dim ? spec->hidden_dim : c.hidden_dim, spec->ffn_dim,
                             &a, err);
        if (st != NL_OK)
            return st;
        e[(*n)++] = (nl_growth){.kind = NL_GROW_WIDTH, .before = c, .after = a};
    }
    for (int i = 0; i < *n; i++) {
        e[i].step = m->step;
        e[i].adam_steps = m->adam_steps;
    }
    if (*n == 0)
        return nl_error_set(err, NL_ERR_INVALID,
                            "nothing to grow: the spec asks for the manifest's own sizes");
    return NL_OK;
}

/* Build new shard `s` (layers [s->l0, s->l1) of the grown model) from the
 * old manifest, grow it through the entries, and save it at `path`. */
static nl_status build_shard(const nl_manifest *m, const nl_manifest_shard *s, const nl_growth *e,
                             int n_e, const nl_growth *hist, int n_hist, uint64_t seed, int moments,
                             const char *path, nl_error *err)
{
    nl_backend *be = NULL;
    nl_model *stage = NULL;
    float *mom[2] = {NULL, NULL};
    const int L = m->cfg.num_layers, l1 = s->l1 < L ? s->l1 : L;
    nl_status st = nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = 0}, err);
    if (st != NL_OK)
        return st;
    const size_t n = (size_t)nl_stage_param_count(&m->cfg, l1 - s->l0, s->has_embed, s->has_head);
    for (int j = 0; moments && j < 2; j++)
        if (!(mom[j] = be->alloc(be, n * sizeof(float) + 1))) {
            st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory for the moments", path);
            goto out;
        }
    st = nl_manifest_load_stage(&stage, be, m, s->l0, l1, s->has_embed, s->has_head, mom[0], mom[1],
                                err);
    for (int i = 0; i < n_e && st == NL_OK; i++) {
        const nl_config *a = &e[i].after;
        if (e[i].kind == NL_GROW_VOCAB)
            st = nl_model_grow_vocab(stage, a->vocab_size, seed, mom, moments ? 2 : 0, err);
        else if (e[i].kind == NL_GROW_DEPTH)
            st = nl_model_grow_depth(stage, a->num_layers, seed, mom, moments ? 2 : 0, err);
        else
            st = nl_model_grow_width(stage, a->hidden_dim, a->ffn_dim, seed, mom, moments ? 2 : 0,
                                     err);
    }
    if (st == NL_OK && (stage->l0 != s->l0 || stage->l1 != s->l1))
        st = nl_error_set(err, NL_ERR_INTERNAL, "%s: grew to layers [%d, %d), planned [%d, %d)",
                          path, stage->l0, stage->l1, s->l0, s->l1);
    if (st == NL_OK)
        st = nl_model_set_growth(stage, hist, n_hist, err);
    nl_ckpt_extra extra = {.m = mom[0], .v = mom[1], .adam_steps = m->adam_steps};
    if (st == NL_OK)
        st = nl_checkpoint_save(stage, path, m->step, &extra, err);
out:
    for (int j = 0; j < 2; j++)
        if (mom[j])
            be->free(be, mom[j]);
    nl_model_destroy(&stage);
    nl_backend_destroy(&be);
    return st;
}

/* Copy a file that cannot be linked (another file system). */
static nl_status copy_file(const char *from, const char *to, nl_error *err)
{
    char *buf = NULL;
    size_t len = 0;
    nl_status st = nl_file_read_all(from, (size_t)1 << 40, &buf, &len, err);
    if (st == NL_OK)
        st = nl_file_write_atomic(to, buf, len, err);
    free(buf);
    return st;
}

/* Make the old shard's file appear in out_dir under the same name. */
static nl_status reuse_shard(const nl_manifest_shard *s, const char *out_dir, int same_dir,
                             nl_error *err)
{
    char to[4200];
    if (same_dir)
        return NL_OK;
    snprintf(to, sizeof to, "%s/%s", out_dir, s->file);
    if (access(to, F_OK) == 0)
        return nl_error_set(err, NL_ERR_STATE, "%s exists; refusing to replace it", to);
    if (link(s->path, to) == 0)
        return NL_OK;
    if (errno != EXDEV && errno != EPERM)
        return nl_error_set(err, NL_ERR_IO, "%s: cannot link %s: %s", to, s->path, strerror(errno));
    return copy_file(s->path, to, err);
}

static int same_directory(const char *a, const char *b)
{
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

/* The new plan: the old shards (the last losing the head when depth
 * grows), then one shard of the new layers and the head. rewrite[i]: the
 * shard's tensors change. */
static nl_status new_plan(const nl_manifest *m, const nl_config *c, int n_hist,
                          nl_manifest_shard *sh, int *n, int *rewrite, nl_error *err)
{
    const int depth = c->num_layers > m->cfg.num_layers;
    const int width = c->hidden_dim != m->cfg.hidden_dim || c->ffn_dim != m->cfg.ffn_dim;
    const int tables = nl_config_capacity(c) != nl_config_capacity(&m->cfg);
    *n = m->n_shards + depth;
    for (int i = 0; i < *n; i++) {
        nl_manifest_shard *s = &sh[i];
        const nl_manifest_shard *o = i < m->n_shards ? &m->shards[i] : NULL;
        memset(s, 0, sizeof *s);
        s->stage = i;
        if (o) {
            s->l0 = o->l0;
            s->l1 = o->l1;
            s->has_embed = o->has_embed;
            s->has_head = o->has_head && !depth;
        } else {
            s->l0 = m->cfg.num_layers;
            s->l1 = c->num_layers;
            s->has_head = 1;
        }
        rewrite[i] = !o || width || (tables && (s->has_embed || s->has_head));
        char name[64];
        if (rewrite[i])
            snprintf(name, sizeof name, "grow%d-stage-%d.safetensors", n_hist, i);
        s->file = strdup(rewrite[i] ? name : o->file);
        if (!s->file)
            return nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
        if (o) { /* who wrote it and where: kept for a reused shard */
            s->node = o->node && !rewrite[i] ? strdup(o->node) : NULL;
            s->device = o->device && !rewrite[i] ? strdup(o->device) : NULL;
            s->tf32 = rewrite[i] ? NL_MANIFEST_TF32_UNKNOWN : o->tf32;
        }
    }
    return NL_OK;
}

nl_status nl_manifest_grow(const char *manifest_path, const nl_grow_spec *spec, uint64_t seed,
                           const char *out_dir, char **out_manifest_path, nl_error *err)
{
    nl_manifest *m = NULL;
    nl_manifest grown = {0};
    nl_manifest_shard *sh = NULL;
    nl_growth e[3], *hist = NULL;
    int n_e = 0, n_sh = 0, *rewrite = NULL, *made = NULL;
    char *has_adam = NULL, *src_dir = NULL, path[4200];
    if (out_manifest_path)
        *out_manifest_path = NULL;
    nl_status st = nl_manifest_load(&m, manifest_path, err);
    if (st == NL_OK)
        st = nl_manifest_verify(m, err);
    if (st == NL_OK)
        st = plan_entries(m, spec, e, &n_e, err);
    if (st == NL_OK && m->n_growth + n_e > NL_GROWTH_MAX)
        st = nl_error_set(err, NL_ERR_RANGE, "growth history: more than %d entries", NL_GROWTH_MAX);
    if (st != NL_OK)
        goto out;
    if (seed == UINT64_MAX)
        seed = m->init_seed ? strtoull(m->init_seed, NULL, 10) : 0;
    const int n_hist = m->n_growth + n_e;
    hist = malloc((size_t)n_hist * sizeof *hist);
    sh = calloc((size_t)m->n_shards + 1, sizeof *sh);
    rewrite = calloc((size_t)m->n_shards + 1, sizeof *rewrite);
    made = calloc((size_t)m->n_shards + 1, sizeof *made);
    src_dir = strdup(m->shards[0].path);
    if (!hist || !sh || !rewrite || !made || !src_dir) {
        st = nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
        goto out;
    }
    if (m->n_growth)
        memcpy(hist, m->growth, (size_t)m->n_growth * sizeof *hist);
    memcpy(hist + m->n_growth, e, (size_t)n_e * sizeof *e);
    const nl_config *c = &e[n_e - 1].after;
    if ((st = new_plan(m, c, n_hist, sh, &n_sh, rewrite, err)) != NL_OK ||
        (st = nl_checkpoint_meta(m->shards[0].path, "adam_steps", &has_adam, err)) != NL_OK ||
        (st = nl_file_mkdirs(out_dir, err)) != NL_OK)
        goto out;
    const int same_dir = same_directory(dirname(src_dir), out_dir);
    /* every file first, the manifest last: nothing names a half-grown set */
    for (int i = 0; i < n_sh && st == NL_OK; i++) {
        snprintf(path, sizeof path, "%s/%s", out_dir, sh[i].file);
        if (!rewrite[i]) {
            if ((st = reuse_shard(&m->shards[i], out_dir, same_dir, err)) == NL_OK)
                made[i] = !same_dir;
            continue;
        }
        if (access(path, F_OK) == 0) {
            st = nl_error_set(err, NL_ERR_STATE, "%s exists; refusing to replace it", path);
            break;
        }
        made[i] = 1; /* even half-written: removed on failure */
        st = build_shard(m, &sh[i], e, n_e, hist, n_hist, seed, has_adam != NULL, path, err);
    }
    for (int i = 0; i < n_sh && st == NL_OK; i++) {
        snprintf(path, sizeof path, "%s/%s", out_dir, sh[i].file);
        st = nl_file_sha256(path, sh[i].sha256, &sh[i].bytes, err);
    }
    if (st != NL_OK)
        goto out;
    grown = (nl_manifest){.step = m->step,
                          .adam_steps = m->adam_steps,
                          .cfg = *c,
                          .train_json = m->train_json,
                          .tokenizer = spec->tokenizer ? (char *)spec->tokenizer : m->tokenizer,
                          .init_seed = m->init_seed,
                          .growth = hist,
                          .n_growth = n_hist,
                          .n_shards = n_sh,
                          .shards = sh};
    snprintf(path, sizeof path, "%s/%s", out_dir, NL_MANIFEST_FILE);
    if (access(path, F_OK) == 0)
        snprintf(path, sizeof path, "%s/manifest-grow%d.json", out_dir, n_hist);
    char *written = strdup(path);
    if (!written) {
        st = nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
        goto out;
    }
    if ((st = nl_manifest_write(path, &grown, err)) != NL_OK || !out_manifest_path)
        free(written);
    else
        *out_manifest_path = written;
out:
    /* a failed growth leaves no file behind, so that it can be retried */
    for (int i = 0; st != NL_OK && made && i < n_sh; i++)
        if (made[i]) {
            snprintf(path, sizeof path, "%s/%s", out_dir, sh[i].file);
            unlink(path);
        }
    for (int i = 0; sh && i < n_sh; i++) {
        free(sh[i].file);
        free(sh[i].node);
        free(sh[i].device);
    }
    free(sh);
    free(rewrite);
    free(made);
    free(hist);
    free(has_adam);
    free(src_dir);
    nl_manifest_destroy(&m);
    return st;
}
