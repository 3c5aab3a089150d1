/* Vocabulary growth of a stage's tables (see nl_model_grow_vocab). */
#include <stdlib.h>
#include <string.h>

#include "model.h"

/* Copy every parameter of `from` into `to` by name; tables copy their old
 * rows. Works on one buffer laid out like each model's parameters. */
static void copy_by_name(nl_backend *be, const nl_model *from, const float *src,
                         const nl_model *to, float *dst)
{
    for (int i = 0; i < from->n_table; i++) {
        const nl_param *p = &from->table[i];
        const nl_param *q = nl_model_find_param(to, p->name);
        /* same names; a table's old rows are its first rows in both */
        const int rows = p->ndim == 2 ? (int)p->shape[0] : 1;
        const int cols = p->ndim == 2 ? (int)p->shape[1] : (int)p->shape[0];
        be->copy_rows(be, dst + q->offset, cols, src + p->offset, cols, rows, cols);
    }
}

nl_status nl_model_grow_vocab(nl_model *m, int64_t vocab_size, uint64_t seed, float **moments,
                              int n_moments, nl_error *err)
{
    nl_backend *be = m->be;
    nl_config cfg = m->cfg;
    nl_model *g = NULL;
    float **fresh = NULL;
    float *host = NULL;
    nl_status st = NL_OK;
    if (vocab_size < m->cfg.vocab_size)
        return nl_error_set(err, NL_ERR_INVALID, "vocab_size: %lld is below the current %lld",
                            (long long)vocab_size, (long long)m->cfg.vocab_size);
    cfg.vocab_size = vocab_size;
    if ((st = nl_config_validate(&cfg, 1, err)) != NL_OK)
        return st;
    if (nl_config_capacity(&cfg) == m->capacity) { /* rows exist: only the active part grows */
        m->cfg.vocab_size = vocab_size;
        return NL_OK;
    }
    st = nl_model_new(&g, be, &cfg, m->l0, m->l1, m->has_embed, m->has_head, err);
    if (st != NL_OK)
        return st;
    fresh = calloc((size_t)n_moments + 1, sizeof *fresh);
    if (!fresh) {
        st = nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
        goto out;
    }
    for (int i = 0; i < n_moments; i++)
        if (!(fresh[i] = be->alloc(be, g->n_params * sizeof(float)))) { /* zero-filled */
            st = nl_error_set(err, NL_ERR_NOMEM, "grow: cannot allocate optimizer state");
            goto out;
        }
    copy_by_name(be, m, m->params, g, g->params);
    for (int i = 0; i < n_moments; i++)
        copy_by_name(be, m, moments[i], g, fresh[i]);
    /* new table rows, from the same streams a fresh init would use */
    for (int i = 0; i < g->n_table; i++) {
        const nl_param *p = &g->table[i];
        if (p->kind != NL_PARAM_TABLE)
            continue;
        const int64_t old_rows = m->capacity, cols = p->shape[1];
        const size_t n = (size_t)(p->shape[0] - old_rows) * (size_t)cols;
        host = malloc(n * sizeof(float));
        if (!host) {
            st = nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory for %s", p->name);
            goto out;
        }
        nl_model_init_table_rows(p, seed, cfg.vocab_chunk, old_rows, p->shape[0], host);
        be->upload(be, nl_model_param_data(g, p) + old_rows * cols, host, n * sizeof(float));
        free(host);
        host = NULL;
    }
    /* swap the grown block into m */
    nl_model tmp = *m;
    *m = *g;
    *g = tmp;
    for (int i = 0; i < n_moments; i++) {
        be->free(be, moments[i]);
        moments[i] = fresh[i];
        fresh[i] = NULL;
    }
out:
    for (int i = 0; fresh && i < n_moments; i++)
        be->free(be, fresh[i]);
    free(fresh);
    free(host);
    nl_model_destroy(&g);
    return st;
}
