/* Growth of a stage in memory (core/grow/grow.h): vocabulary, depth and width,
 * with the AdamW moments; the history list of a model. The history's JSON
 * and the regions each entry created are in grow_history.c, the growth of a
 * sharded checkpoint in grow_manifest.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/grow/grow.h"

/* Copy every parameter of `from` into `to` by name; tables copy their old
 * rows. Works on one buffer laid out like each model's parameters. */
static void copy_by_name(nl_backend *be, const nl_model *from, const float *src, const nl_model *to,
                         float *dst)
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

/* Swap the grown model g into m (g then holds the old block, for its
 * caller to destroy); the growth history stays with m. The old moments
 * are freed and fresh[] (the grown ones) take their place. */
static void adopt_grown(nl_model *m, nl_model *g, float **moments, float **fresh, int n_moments)
{
    nl_backend *be = m->be;
    nl_model tmp = *m;
    *m = *g;
    *g = tmp;
    m->growth = g->growth;
    m->n_growth = g->n_growth;
    g->growth = NULL;
    g->n_growth = 0;
    for (int i = 0; i < n_moments; i++) {
        be->free(be, moments[i]);
        moments[i] = fresh[i];
        fresh[i] = NULL;
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
        nl_model_changed(m); /* the head's width */
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
    adopt_grown(m, g, moments, fresh, n_moments);
out:
    for (int i = 0; fresh && i < n_moments; i++)
        be->free(be, fresh[i]);
    free(fresh);
    free(host);
    nl_model_destroy(&g);
    return st;
}

/* ---------------------------------------------------------------- depth, width */

static int ends_with(const char *s, const char *tail)
{
    size_t a = strlen(s), b = strlen(tail);
    return a >= b && strcmp(s + a - b, tail) == 0;
}

/* wo and w_down: the tensors whose new entries are all zero, in new
 * layers (depth) and around the old block (width). */
static int is_output_proj(const char *name)
{
    return ends_with(name, ".attention.wo.weight") || ends_with(name, ".w_down.weight");
}

/* Copy the block of p (in src, m's layout) into the top-left corner of q
 * (in dst, g's layout). */
static void copy_block(nl_backend *be, const nl_param *p, const float *src, const nl_param *q,
                       float *dst)
{
    if (p->ndim == 1)
        be->copy_rows(be, dst + q->offset, 0, src + p->offset, 0, 1, (int)p->shape[0]);
    else
        be->copy_rows(be, dst + q->offset, (int)q->shape[1], src + p->offset, (int)p->shape[1],
                      (int)p->shape[0], (int)p->shape[1]);
}

/* Multiply the first n_old floats of the device range by a, the rest up
 * to n by b (host round trip: norm gains are small). */
static nl_status scale_range(nl_backend *be, float *dev, size_t n_old, size_t n, double a, double b,
                             nl_error *err)
{
    float *h = malloc(n * sizeof *h + 1);
    if (!h)
        return nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
    be->download(be, h, dev, n * sizeof *h);
    for (size_t i = 0; i < n; i++)
        h[i] = (float)((double)h[i] * (i < n_old ? a : b));
    be->upload(be, dev, h, n * sizeof *h);
    free(h);
    return NL_OK;
}

/* Build the stage g of config c over [m->l0, l1) from m: g's own init
 * where m has nothing, m's values in the top-left block of every tensor
 * m has, then the rule of the growth `kind`; moments the same way with
 * zeros. On success m holds g (history kept) and moments[] the new
 * buffers. */
static nl_status regrow(nl_model *m, const nl_config *c, int l1, nl_grow_kind kind, uint64_t seed,
                        float **moments, int n_moments, nl_error *err)
{
    nl_backend *be = m->be;
    nl_model *g = NULL;
    float **fresh = NULL;
    const double r = (double)m->cfg.hidden_dim / c->hidden_dim;
    if (m->lora)
        return nl_error_set(err, NL_ERR_STATE, "grow: detach the LoRA adapters first");
    nl_status st = nl_model_new(&g, be, c, m->l0, l1, m->has_embed, m->has_head, err);
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
    if (kind == NL_GROW_WIDTH) /* every tensor gains entries: one whole init */
        st = nl_model_init_random(g, seed, err);
    for (int i = 0; i < g->n_table && st == NL_OK; i++) {
        const nl_param *q = &g->table[i];
        const nl_param *p = nl_model_find_param(m, q->name);
        float *dq = nl_model_param_data(g, q);
        if (!p) { /* a new layer's tensor */
            if (is_output_proj(q->name))
                continue; /* zero: the block is the identity */
            st = nl_model_init_param(g, q, seed, err);
            continue;
        }
        if (kind == NL_GROW_WIDTH &&
            (is_output_proj(q->name) || strcmp(q->name, "tok_embeddings.weight") == 0))
            be->zero(be, dq, nl_param_numel(q) * sizeof(float));
        copy_block(be, p, m->params, q, g->params);
        for (int j = 0; j < n_moments; j++)
            copy_block(be, p, moments[j], q, fresh[j]);
        if (kind != NL_GROW_WIDTH || q->kind != NL_PARAM_NORM)
            continue;
        /* DESIGN 5: gains times sqrt(r); their gradient scales by
         * 1/sqrt(r), so the moments follow */
        const size_t n_old = nl_param_numel(p), n = nl_param_numel(q);
        st = scale_range(be, dq, n_old, n, sqrt(r), sqrt(r), err);
        for (int j = 0; j < n_moments && st == NL_OK && j < 2; j++)
            st = scale_range(be, fresh[j] + q->offset, n_old, n, j ? 1.0 / r : 1.0 / sqrt(r), 0.0,
                             err);
    }
    if (st != NL_OK)
        goto out;
    if (be->wrote) /* copy_rows is not a slot that marks a bf16 copy stale */
        be->wrote(be, g->params, g->n_params * sizeof(float));
    adopt_grown(m, g, moments, fresh, n_moments);
out:
    for (int i = 0; fresh && i < n_moments; i++)
        be->free(be, fresh[i]);
    free(fresh);
    nl_model_destroy(&g);
    return st;
}

nl_status nl_model_grow_depth(nl_model *m, int n_layers, uint64_t seed, float **moments,
                              int n_moments, nl_error *err)
{
    nl_config c = m->cfg;
    if (n_layers < m->cfg.num_layers)
        return nl_error_set(err, NL_ERR_INVALID, "num_layers: %d is below the current %d", n_layers,
                            m->cfg.num_layers);
    if (n_layers == m->cfg.num_layers)
        return NL_OK;
    c.num_layers = n_layers;
    nl_status st = nl_config_validate(&c, 1, err);
    if (st != NL_OK)
        return st;
    if (!m->has_head) { /* no new layer here: only the count changes */
        m->cfg.num_layers = n_layers;
        nl_model_changed(m);
        return NL_OK;
    }
    return regrow(m, &c, n_layers, NL_GROW_DEPTH, seed, moments, n_moments, err);
}

nl_status nl_config_widen(const nl_config *old, int d2, int f2, nl_config *c, nl_error *err)
{
    const int hd = nl_config_head_dim(old);
    *c = *old;
    if (f2 == 0)
        f2 = old->ffn_dim;
    if (d2 < old->hidden_dim || f2 < old->ffn_dim)
        return nl_error_set(err, NL_ERR_INVALID, "%s: %d is below the current %d",
                            d2 < old->hidden_dim ? "hidden_dim" : "ffn_dim",
                            d2 < old->hidden_dim ? d2 : f2,
                            d2 < old->hidden_dim ? old->hidden_dim : old->ffn_dim);
    if (d2 % hd != 0)
        return nl_error_set(err, NL_ERR_INVALID,
                            "hidden_dim: %d is not a multiple of the head dim %d (whole heads)", d2,
                            hd);
    const int h2 = d2 / hd;
    if ((int64_t)old->num_kv_heads * h2 % old->num_heads != 0)
        return nl_error_set(err, NL_ERR_INVALID,
                            "hidden_dim: %d gives %d heads, which cannot keep the ratio of %d "
                            "heads to %d kv heads",
                            d2, h2, old->num_heads, old->num_kv_heads);
    c->hidden_dim = d2;
    c->ffn_dim = f2;
    c->num_heads = h2;
    c->num_kv_heads = (int)((int64_t)old->num_kv_heads * h2 / old->num_heads);
    c->norm_eps = old->norm_eps * ((double)old->hidden_dim / d2);
    return nl_config_validate(c, 1, err);
}

nl_status nl_model_grow_width(nl_model *m, int hidden_dim, int ffn_dim, uint64_t seed,
                              float **moments, int n_moments, nl_error *err)
{
    nl_config c;
    nl_status st = nl_config_widen(&m->cfg, hidden_dim, ffn_dim, &c, err);
    if (st != NL_OK)
        return st;
    if (c.hidden_dim == m->cfg.hidden_dim && c.ffn_dim == m->cfg.ffn_dim)
        return NL_OK;
    return regrow(m, &c, m->l1, NL_GROW_WIDTH, seed, moments, n_moments, err);
}

/* ---------------------------------------------------------------- history */

nl_status nl_model_set_growth(nl_model *m, const nl_growth *h, int n, nl_error *err)
{
    nl_growth *copy = NULL;
    if (n < 0 || n > NL_GROWTH_MAX)
        return nl_error_set(err, NL_ERR_RANGE, "growth history: %d entries", n);
    if (n > 0) {
        if (!(copy = malloc((size_t)n * sizeof *copy)))
            return nl_error_set(err, NL_ERR_NOMEM, "growth history: out of memory");
        memcpy(copy, h, (size_t)n * sizeof *copy);
    }
    free(m->growth);
    m->growth = copy;
    m->n_growth = n;
    return NL_OK;
}

nl_status nl_model_add_growth(nl_model *m, const nl_growth *g, nl_error *err)
{
    if (m->n_growth >= NL_GROWTH_MAX)
        return nl_error_set(err, NL_ERR_RANGE, "growth history: more than %d entries",
                            NL_GROWTH_MAX);
    nl_growth *h = realloc(m->growth, (size_t)(m->n_growth + 1) * sizeof *h);
    if (!h)
        return nl_error_set(err, NL_ERR_NOMEM, "growth history: out of memory");
    h[m->n_growth++] = *g;
    m->growth = h;
    return NL_OK;
}
