/* Saving and loading model checkpoints on top of core/safetensors. */
#include "checkpoint.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

nl_status nl_checkpoint_save(const nl_model *m, const char *path, int64_t step, nl_error *err)
{
    nl_status st = NL_OK;
    nl_st_writer *w = NULL;
    char *cfg_json = NULL;
    float *host = malloc(m->n_params * sizeof(float) + 1);
    if (!host)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory for %zu parameters", path,
                            m->n_params);
    m->be->download(m->be, host, m->params, m->n_params * sizeof(float));
    st = nl_st_writer_new(&w, err);
    if (st != NL_OK)
        goto out;
    for (int i = 0; i < m->n_table && st == NL_OK; i++) {
        const nl_param *p = &m->table[i];
        st = nl_st_writer_add(w, p->name, NL_DTYPE_F32, p->ndim, p->shape, host + p->offset, err);
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
    if (st == NL_OK)
        st = nl_st_writer_write(w, path, err);
out:
    nl_st_writer_destroy(&w);
    free(cfg_json);
    free(host);
    return st;
}

static nl_status meta_config(nl_st_file *f, const char *path, nl_config *cfg, int64_t *step,
                             nl_error *err)
{
    const char *fmt = nl_st_metadata(f, "format");
    if (!fmt)
        return nl_error_set(err, NL_ERR_FORMAT, "%s: metadata has no 'format' (not a neurollm checkpoint)",
                            path);
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
    if (step) {
        const char *s = nl_st_metadata(f, "step");
        char *end = NULL;
        errno = 0;
        long long v = s ? strtoll(s, &end, 10) : 0;
        if (!s || errno || end == s || *end || v < 0)
            return nl_error_set(err, NL_ERR_FORMAT, "%s: metadata 'step' is %s%s%s", path,
                                s ? "'" : "missing", s ? s : "", s ? "', not a step number" : "");
        *step = v;
    }
    return NL_OK;
}

nl_status nl_checkpoint_read_config(const char *path, nl_config *cfg, int64_t *step, nl_error *err)
{
    nl_st_file *f = NULL;
    nl_status st = nl_st_open(&f, path, err);
    if (st != NL_OK)
        return st;
    st = meta_config(f, path, cfg, step, err);
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
    float *host = NULL;
    nl_status st = nl_st_open(&f, path, err);
    if (st != NL_OK)
        return st;
    st = meta_config(f, path, &cfg, step, err);
    if (st != NL_OK)
        goto out;
    st = nl_model_new(&m, be, &cfg, l0, l1 < 0 ? cfg.num_layers : l1, has_embed, has_head, err);
    if (st != NL_OK)
        goto out;
    host = malloc(m->n_params * sizeof(float) + 1);
    if (!host) {
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    for (int i = 0; i < m->n_table && st == NL_OK; i++) {
        const nl_param *p = &m->table[i];
        st = nl_st_read(f, p->name, NL_DTYPE_F32, p->ndim, p->shape, host + p->offset, err);
    }
    if (st != NL_OK) {
        nl_error_prefix(err, "%s", path);
        goto out;
    }
    be->upload(be, m->params, host, m->n_params * sizeof(float));
    *out = m;
    m = NULL;
out:
    free(host);
    nl_model_destroy(&m);
    nl_st_close(&f);
    return st;
}
