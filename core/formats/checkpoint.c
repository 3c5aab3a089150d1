/* Saving and loading model checkpoints on top of core/safetensors. */
#include "core/formats/checkpoint.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/manifest.h"
#include "core/formats/safetensors.h"
#include "core/grow/grow.h"
#include "core/model/memory.h"
#include "core/tokenizer/tokenizer.h"

nl_status nl_checkpoint_save(const nl_model *m, const char *path, int64_t step,
                             const nl_ckpt_extra *extra, nl_error *err)
{
    const nl_ckpt_extra *opt = extra && extra->m && extra->v ? extra : NULL;
    nl_status st = NL_OK;
    nl_st_writer *w = NULL;
    char *cfg_json = NULL;
    const size_t n = m->n_params;
    char(*names)[NL_PARAM_NAME_MAX + 8] = NULL;
    /* weights and moments, read through host views (in place on a
     * host-memory backend) */
    nl_host_stage stage[3] = {{0}};
    const float *src[3] = {NULL, NULL, NULL};
    const float *dev[3] = {m->params, opt ? opt->m : NULL, opt ? opt->v : NULL};
    for (int i = 0; i < (opt ? 3 : 1); i++)
        if (!(src[i] = nl_backend_read_view(m->be, &stage[i], dev[i], n * sizeof(float), err))) {
            st = nl_error_prefix(err, "%s", path);
            goto out;
        }
    if (opt) {
        names = calloc(2 * (size_t)m->n_table, sizeof *names);
        if (!names) {
            st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
            goto out;
        }
    }
    if (!(w = nl_st_writer_new())) {
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    for (int i = 0; i < m->n_table && st == NL_OK; i++) {
        const nl_param *p = &m->table[i];
        st = nl_st_writer_add(w, p->name, NL_DTYPE_F32, p->ndim, p->shape, src[0] + p->offset, err);
    }
    for (int i = 0; opt && i < m->n_table && st == NL_OK; i++) {
        const nl_param *p = &m->table[i];
        snprintf(names[2 * i], sizeof names[0], "optim.m.%s", p->name);
        snprintf(names[2 * i + 1], sizeof names[0], "optim.v.%s", p->name);
        st = nl_st_writer_add(w, names[2 * i], NL_DTYPE_F32, p->ndim, p->shape, src[1] + p->offset,
                              err);
        if (st == NL_OK)
            st = nl_st_writer_add(w, names[2 * i + 1], NL_DTYPE_F32, p->ndim, p->shape,
                                  src[2] + p->offset, err);
    }
    if (opt && st == NL_OK) {
        char adam_s[32];
        snprintf(adam_s, sizeof adam_s, "%" PRId64, opt->adam_steps);
        st = nl_st_writer_set_meta(w, "adam_steps", adam_s, err);
        if (st == NL_OK && opt->train_json)
            st = nl_st_writer_set_meta(w, "train", opt->train_json, err);
    }
    cfg_json = nl_config_to_json(&m->cfg);
    char step_s[32];
    snprintf(step_s, sizeof step_s, "%" PRId64, step);
    if (!cfg_json && st == NL_OK)
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: cannot encode config", path);
    if (st == NL_OK)
        st = nl_st_writer_set_meta(w, "format", NL_CHECKPOINT_FORMAT, err);
    if (st == NL_OK)
        st = nl_st_writer_set_meta(w, "config", cfg_json, err);
    if (st == NL_OK)
        st = nl_st_writer_set_meta(w, "step", step_s, err);
    if (st == NL_OK && extra && extra->tokenizer)
        st = nl_st_writer_set_meta(w, "tokenizer", extra->tokenizer, err);
    if (st == NL_OK && extra && extra->init_seed)
        st = nl_st_writer_set_meta(w, "init_seed", extra->init_seed, err);
    if (st == NL_OK && extra && extra->chat_template)
        st = nl_st_writer_set_meta(w, "chat_template", extra->chat_template, err);
    if (st == NL_OK && m->n_growth > 0) {
        char *h = nl_growth_to_json(m->growth, m->n_growth);
        st = h ? nl_st_writer_set_meta(w, "growth", h, err)
               : nl_error_set(err, NL_ERR_NOMEM, "%s: cannot encode the growth history", path);
        free(h);
    }
    /* never over a shard that a manifest beside it names */
    if (st == NL_OK)
        st = nl_manifest_names(path, err);
    if (st == NL_OK)
        st = nl_st_writer_write(w, path, err);
out:
    nl_st_writer_destroy(&w);
    free(cfg_json);
    free(names);
    for (int i = 0; i < 3; i++)
        nl_host_stage_free(&stage[i]);
    return st;
}

/* A non-negative decimal metadata value: NL_ERR_NOTFOUND when absent,
 * NL_ERR_FORMAT when it is not a count. */
static nl_status meta_count(const nl_st_file *f, const char *path, const char *key, int64_t *out,
                            nl_error *err)
{
    const char *s = nl_st_metadata(f, key);
    if (!s)
        return nl_error_set(err, NL_ERR_NOTFOUND, "%s: metadata '%s' is missing", path, key);
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < 0)
        return nl_error_set(err, NL_ERR_FORMAT, "%s: metadata '%s' is '%s', not a count", path, key,
                            s);
    *out = v;
    return NL_OK;
}

nl_status nl_checkpoint_check_meta(const nl_st_file *f, const char *path, nl_config *cfg,
                                   int64_t *step, int64_t *adam_steps, nl_error *err)
{
    const char *fmt = nl_st_metadata(f, "format");
    if (!fmt)
        return nl_error_set(err, NL_ERR_FORMAT,
                            "%s: metadata has no 'format' (not a neurollm checkpoint)", path);
    if (strcmp(fmt, NL_CHECKPOINT_FORMAT) != 0)
        return nl_error_set(err, NL_ERR_VERSION, "%s: format '%s' is not %s", path, fmt,
                            NL_CHECKPOINT_FORMAT);
    const char *json = nl_st_metadata(f, "config");
    if (!json)
        return nl_error_set(err, NL_ERR_FORMAT, "%s: metadata has no 'config'", path);
    nl_status st = nl_config_from_json(cfg, json, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "%s: config", path);
    st = nl_config_validate(cfg, 1, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "%s: config", path);
    /* the step is checked even when the caller does not want it */
    int64_t v = 0;
    st = meta_count(f, path, "step", &v, err);
    if (st == NL_ERR_NOTFOUND)
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: metadata 'step' is missing", path);
    if (st != NL_OK)
        return st;
    if (step)
        *step = v;
    if (adam_steps) {
        st = meta_count(f, path, "adam_steps", adam_steps, err);
        if (st == NL_ERR_NOTFOUND) {
            *adam_steps = -1;
            st = NL_OK;
        }
    }
    return st;
}

/* A tensor just read must be finite: a NaN or an infinity in a weight (or
 * a moment) would make every output NaN, or greedy decode id 0 forever,
 * and no later step says why. NL_ERR_FORMAT naming the tensor, its count
 * of such values and the first. */
static nl_status check_finite(const char *name, const float *x, size_t n, nl_error *err)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += !(x[i] - x[i] == 0.0f); /* NaN for a NaN or an infinity */
    if (!bad)
        return NL_OK;
    size_t first = 0;
    while (x[first] - x[first] == 0.0f)
        first++;
    return nl_error_set(err, NL_ERR_FORMAT,
                        "tensor %s: %zu of its %zu values are not finite (the first at %zu: %g)",
                        name, bad, n, first, (double)x[first]);
}

nl_status nl_checkpoint_read_tensors(const nl_model *m, const nl_st_file *f,
                                     const unsigned char *pick, float *w, float *mm, float *vv,
                                     nl_error *err)
{
    char name[NL_PARAM_NAME_MAX + 8];
    nl_status st = NL_OK;
    for (int i = 0; i < m->n_table && st == NL_OK; i++) {
        const nl_param *p = &m->table[i];
        const size_t n = (size_t)p->shape[0] * (size_t)(p->ndim == 2 ? p->shape[1] : 1);
        if (pick && !pick[i])
            continue;
        if (w && (st = nl_st_read(f, p->name, NL_DTYPE_F32, p->ndim, p->shape, w + p->offset,
                                  err)) == NL_OK)
            st = check_finite(p->name, w + p->offset, n, err);
        for (int j = 0; j < 2 && st == NL_OK; j++) {
            float *dst = j ? vv : mm;
            if (!dst)
                continue;
            snprintf(name, sizeof name, "optim.%c.%s", j ? 'v' : 'm', p->name);
            if ((st = nl_st_read(f, name, NL_DTYPE_F32, p->ndim, p->shape, dst + p->offset, err)) ==
                NL_OK)
                st = check_finite(name, dst + p->offset, n, err);
        }
    }
    return st;
}

nl_status nl_checkpoint_read_growth(const nl_st_file *f, nl_model *m, nl_error *err)
{
    const char *json = nl_st_metadata(f, "growth");
    nl_growth *h = NULL;
    int n = 0;
    if (!json)
        return nl_model_set_growth(m, NULL, 0, err);
    nl_status st = nl_growth_from_json(json, &h, &n, err);
    if (st == NL_OK)
        st = nl_model_set_growth(m, h, n, err);
    free(h);
    return st == NL_OK ? NL_OK : nl_error_prefix(err, "metadata 'growth'");
}

nl_status nl_checkpoint_read_config(const char *path, nl_config *cfg, int64_t *step, nl_error *err)
{
    nl_st_file *f = NULL;
    nl_status st = nl_st_open(&f, path, err);
    if (st != NL_OK)
        return st;
    st = nl_checkpoint_check_meta(f, path, cfg, step, NULL, err);
    nl_st_close(&f);
    return st;
}

nl_status nl_checkpoint_load(nl_model **out, nl_backend *be, const char *path, int l0, int l1,
                             int has_embed, int has_head, int64_t *step, nl_error *err)
{
    *out = NULL;
    nl_st_file *f = NULL;
    nl_model *m = NULL;
    nl_config cfg;
    nl_host_stage stage = {0};
    nl_status st = nl_st_open(&f, path, err);
    if (st != NL_OK)
        return st;
    st = nl_checkpoint_check_meta(f, path, &cfg, step, NULL, err);
    if (st != NL_OK)
        goto out;
    if (l1 < 0)
        l1 = cfg.num_layers;
    /* a layer past the config's (its weights or moments): the config was
     * edited, or the file joined from another model's; loading would drop
     * those layers without a word */
    for (size_t i = 0; i < nl_st_count(f); i++) {
        const char *name = nl_st_entry_at(f, i)->name;
        if (strncmp(name, "optim.", 6) == 0 && strlen(name) > 8)
            name += 8; /* optim.m. and optim.v. */
        char *end = NULL;
        const long l = strncmp(name, "layers.", 7) == 0 ? strtol(name + 7, &end, 10) : -1;
        if (l >= cfg.num_layers && end && *end == '.') {
            st = nl_error_set(err, NL_ERR_FORMAT,
                              "%s: tensor %s is of layer %ld, past its config's num_layers %d",
                              path, nl_st_entry_at(f, i)->name, l, cfg.num_layers);
            goto out;
        }
    }
    /* a config that asks for more parameters than the file holds is
     * refused before anything that size is allocated */
    uint64_t have = 0;
    for (size_t i = 0; i < nl_st_count(f); i++)
        have += nl_st_entry_at(f, i)->nbytes;
    const int64_t need = nl_stage_param_count(&cfg, l1 - l0 > 0 ? l1 - l0 : 0, has_embed, has_head);
    if (l0 >= 0 && l1 <= cfg.num_layers && (uint64_t)need * 4 > have) {
        st = nl_error_set(err, NL_ERR_SHAPE,
                          "%s: the config needs %lld parameters (%llu bytes) but the file holds "
                          "only %llu bytes of tensors",
                          path, (long long)need, (unsigned long long)need * 4,
                          (unsigned long long)have);
        goto out;
    }
    st = nl_model_new(&m, be, &cfg, l0, l1, has_embed, has_head, err);
    if (st != NL_OK)
        goto out;
    const size_t bytes = m->n_params * sizeof(float);
    float *dst = nl_backend_write_view(be, &stage, m->params, bytes, err);
    if (!dst) {
        st = nl_error_prefix(err, "%s", path);
        goto out;
    }
    st = nl_checkpoint_read_tensors(m, f, NULL, dst, NULL, NULL, err);
    if (st == NL_OK)
        st = nl_checkpoint_read_growth(f, m, err);
    if (st != NL_OK) {
        nl_error_prefix(err, "%s", path);
        goto out;
    }
    nl_backend_write_back(be, m->params, dst, bytes);
    *out = m;
    m = NULL;
out:
    nl_host_stage_free(&stage);
    nl_model_destroy(&m);
    nl_st_close(&f);
    return st;
}

nl_status nl_checkpoint_load_optim(const nl_model *m, const char *path, float *mom_m, float *mom_v,
                                   int64_t *adam_steps, char **train_json, nl_error *err)
{
    nl_st_file *f = NULL;
    nl_host_stage stage[2] = {{0}};
    if (train_json)
        *train_json = NULL;
    nl_status st = nl_st_open(&f, path, err);
    if (st != NL_OK)
        return st;
    int64_t t = 0;
    st = meta_count(f, path, "adam_steps", &t, err);
    if (st == NL_ERR_NOTFOUND)
        st = nl_error_set(err, NL_ERR_NOTFOUND, "%s: no optimizer state (metadata 'adam_steps')",
                          path);
    if (st != NL_OK)
        goto out;
    const size_t bytes = m->n_params * sizeof(float);
    float *dst[2] = {nl_backend_write_view(m->be, &stage[0], mom_m, bytes, err),
                     nl_backend_write_view(m->be, &stage[1], mom_v, bytes, err)};
    if (!dst[0] || !dst[1]) {
        st = nl_error_prefix(err, "%s", path);
        goto out;
    }
    st = nl_checkpoint_read_tensors(m, f, NULL, NULL, dst[0], dst[1], err);
    if (st != NL_OK) {
        nl_error_prefix(err, "%s", path);
        goto out;
    }
    nl_backend_write_back(m->be, mom_m, dst[0], bytes);
    nl_backend_write_back(m->be, mom_v, dst[1], bytes);
    *adam_steps = t;
    const char *tj = nl_st_metadata(f, "train");
    if (train_json && tj && !(*train_json = strdup(tj)))
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
out:
    nl_host_stage_free(&stage[0]);
    nl_host_stage_free(&stage[1]);
    nl_st_close(&f);
    return st;
}

nl_status nl_checkpoint_meta(const char *path, const char *key, char **out, nl_error *err)
{
    nl_st_file *f = NULL;
    *out = NULL;
    nl_status st = nl_st_open(&f, path, err);
    if (st != NL_OK)
        return st;
    const char *v = nl_st_metadata(f, key);
    if (v && !(*out = strdup(v)))
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
    nl_st_close(&f);
    return st;
}

nl_status nl_checkpoint_seed_check(const char *s, const char *what, nl_error *err)
{
    if (!s)
        return NL_OK;
    char *end = NULL;
    errno = 0;
    (void)strtoull(s, &end, 10);
    if (!s[0] || s[0] < '0' || s[0] > '9' || errno || *end)
        return nl_error_set(err, NL_ERR_FORMAT, "%s: expected a decimal seed of 64 bits", what);
    return NL_OK;
}

nl_status nl_checkpoint_init_seed(const char *path, char **out, nl_error *err)
{
    nl_status st = nl_checkpoint_meta(path, "init_seed", out, err);
    if (st == NL_OK &&
        (st = nl_checkpoint_seed_check(*out, "metadata 'init_seed'", err)) != NL_OK) {
        free(*out);
        *out = NULL;
        nl_error_prefix(err, "%s", path);
    }
    return st;
}

nl_status nl_checkpoint_tokenizer(const char *path, nl_tokenizer **out, nl_error *err)
{
    char *text = NULL;
    *out = NULL;
    nl_status st = nl_checkpoint_meta(path, "tokenizer", &text, err);
    if (st == NL_OK && text) {
        st = nl_tokenizer_load_buffer(out, text, strlen(text), err);
        if (st != NL_OK)
            nl_error_prefix(err, "%s: metadata 'tokenizer'", path);
    }
    free(text);
    return st;
}
