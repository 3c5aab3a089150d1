/* Low-rank adapters: their parameter block, the layer hooks (forward and
 * backward as GEMMs around the base maps), files and merging (lora.h). */
#include "lora.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layer.h"
#include "rng.h"
#include "safetensors.h"

static const char *const target_names[4] = {"wq", "wk", "wv", "wo"};

/* ---------------------------------------------------------------- setup */

nl_status nl_lora_parse_targets(const char *s, int *targets, nl_error *err)
{
    *targets = 0;
    while (s && *s) {
        const size_t n = strcspn(s, ",");
        int hit = 0;
        for (int t = 0; t < 4; t++)
            if (n == strlen(target_names[t]) && strncmp(s, target_names[t], n) == 0)
                *targets |= hit = 1 << t;
        if (!hit)
            return nl_error_set(err, NL_ERR_INVALID,
                                "--lora-targets: '%.*s' is not one of wq, wk, wv, wo",
                                (int)(n > 40 ? 40 : n), s);
        s += n + (s[n] == ',');
    }
    if (!*targets)
        return nl_error_set(err, NL_ERR_INVALID, "--lora-targets: none given");
    return NL_OK;
}

/* Shape of target t of the model's layers: in, out and the qkv column. */
static void target_shape(const nl_config *c, int t, int *in, int *out, int *col0)
{
    const int hd = nl_config_head_dim(c), H = c->num_heads, G = c->num_kv_heads;
    const int outs[4] = {H * hd, G * hd, G * hd, c->hidden_dim};
    const int cols[4] = {0, H * hd, (H + G) * hd, 0};
    *in = t == 3 ? H * hd : c->hidden_dim;
    *out = outs[t];
    *col0 = cols[t];
}

nl_status nl_lora_new(nl_lora **out, nl_model *m, int rank, float alpha, int targets, int max_rows,
                      nl_error *err)
{
    *out = NULL;
    if (rank < 1 || rank > NL_LORA_MAX_RANK || !(alpha > 0.0f) || targets <= 0 || targets > 15 ||
        max_rows < 1)
        return nl_error_set(err, NL_ERR_INVALID, "lora: rank %d (1..%d), alpha %g (> 0), %d rows",
                            rank, NL_LORA_MAX_RANK, alpha, max_rows);
    if (m->lora)
        return nl_error_set(err, NL_ERR_STATE, "lora: the model already has adapters");
    nl_backend *be = m->be;
    const int L = m->l1 - m->l0;
    nl_lora *lo = calloc(1, sizeof *lo);
    if (!lo)
        return nl_error_set(err, NL_ERR_NOMEM, "lora: out of memory");
    lo->m = m;
    lo->rank = rank;
    lo->alpha = alpha;
    lo->targets = targets;
    lo->max_rows = max_rows;
    lo->maps = calloc((size_t)L * 4 + 1, sizeof *lo->maps);
    lo->table = calloc((size_t)L * 8 + 1, sizeof *lo->table);
    if (!lo->maps || !lo->table)
        goto nomem;
    for (int l = 0; l < L; l++)
        for (int t = 0; t < 4; t++) {
            if (!(targets & (1 << t)))
                continue;
            int in, o, col0;
            target_shape(&m->cfg, t, &in, &o, &col0);
            const char *part = t == 3 ? "wo" : target_names[t];
            for (int ab = 0; ab < 2; ab++) {
                nl_param *p = &lo->table[lo->n_table++];
                snprintf(p->name, sizeof p->name, "layers.%d.attention.%s.lora_%c.weight",
                         m->l0 + l, part, ab ? 'B' : 'A');
                p->kind = NL_PARAM_MATRIX;
                p->ndim = 2;
                p->shape[0] = ab ? o : rank;
                p->shape[1] = ab ? rank : in;
                p->offset = lo->n_params;
                p->init_std = ab ? 0.0f : 1.0f / (float)rank;
                lo->n_params += nl_param_numel(p);
            }
            nl_lora_map *mp = &lo->maps[l * 4 + t];
            mp->in = in;
            mp->out = o;
            mp->col0 = col0;
        }
    const size_t bytes = (lo->n_params + 1) * sizeof(float), rows = (size_t)max_rows * rank;
    int ok = 1;
    ok &= (lo->params = be->alloc(be, bytes)) != NULL;
    ok &= (lo->grads = be->alloc(be, bytes)) != NULL;
    ok &= (lo->mom[0] = be->alloc(be, bytes)) != NULL;
    ok &= (lo->mom[1] = be->alloc(be, bytes)) != NULL;
    ok &= (lo->u = be->alloc(be, rows * sizeof(float))) != NULL;
    ok &= (lo->du = be->alloc(be, rows * sizeof(float))) != NULL;
    if (!ok)
        goto nomem;
    for (int l = 0, i = 0; l < L; l++)
        for (int t = 0; t < 4; t++)
            if (targets & (1 << t)) {
                lo->maps[l * 4 + t].A = lo->params + lo->table[i++].offset;
                lo->maps[l * 4 + t].B = lo->params + lo->table[i++].offset;
            }
    m->lora = lo;
    *out = lo;
    return NL_OK;
nomem:
    nl_lora_destroy(&lo);
    return nl_error_set(err, NL_ERR_NOMEM, "lora: out of memory");
}

void nl_lora_destroy(nl_lora **lop)
{
    if (!lop || !*lop)
        return;
    nl_lora *lo = *lop;
    nl_backend *be = lo->m->be;
    if (lo->m->lora == lo)
        lo->m->lora = NULL;
    void *dev[] = {lo->params, lo->grads, lo->mom[0], lo->mom[1], lo->u, lo->du};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        be->free(be, dev[i]);
    free(lo->maps);
    free(lo->table);
    free(lo);
    *lop = NULL;
}

nl_status nl_lora_init_random(nl_lora *lo, uint64_t seed, nl_error *err)
{
    float *h = calloc(lo->n_params + 1, sizeof *h);
    if (!h)
        return nl_error_set(err, NL_ERR_NOMEM, "lora: out of memory");
    for (int i = 0; i < lo->n_table; i++) {
        const nl_param *p = &lo->table[i];
        nl_rng r;
        nl_rng_seed(&r, seed, nl_rng_hash(p->name));
        for (size_t j = 0; p->init_std > 0.0f && j < nl_param_numel(p); j++)
            h[p->offset + j] = (float)(nl_rng_normal(&r) * p->init_std);
    }
    lo->m->be->upload(lo->m->be, lo->params, h, lo->n_params * sizeof *h);
    free(h);
    return nl_backend_check(lo->m->be, err);
}

/* ---------------------------------------------------------------- layer hooks */

static const nl_lora_map *map_of(const nl_model *m, int li, int t)
{
    const nl_lora *lo = m->lora;
    const nl_lora_map *mp = lo ? &lo->maps[(li - m->l0) * 4 + t] : NULL;
    return mp && mp->A ? mp : NULL;
}

/* y[:, 0:out] (row stride ldy) += s (x A^T) B^T, keeping u = x A^T. */
static void lora_fwd(const nl_model *m, const nl_lora_map *mp, const float *x, int ldx, float *y,
                     int ldy, int N)
{
    nl_backend *be = m->be;
    const nl_lora *lo = m->lora;
    const int r = lo->rank;
    be->gemm(be, 0, 1, N, r, mp->in, 1.0f, x, ldx, mp->A, mp->in, 0.0f, lo->u, r);
    be->gemm(be, 0, 1, N, mp->out, r, lo->alpha / (float)r, lo->u, r, mp->B, r, 1.0f, y, ldy);
}

/* The backward of lora_fwd given dy: dB += s dy^T u, du = s dy B,
 * dA += du^T x, dx += du A (u recomputed from x). */
static void lora_bwd(const nl_model *m, const nl_lora_map *mp, const float *x, int ldx,
                     const float *dy, int ldy, float *dx, int lddx, int N)
{
    nl_backend *be = m->be;
    const nl_lora *lo = m->lora;
    const int r = lo->rank;
    const float s = lo->alpha / (float)r;
    float *dA = lo->grads + (mp->A - lo->params), *dB = lo->grads + (mp->B - lo->params);
    be->gemm(be, 0, 1, N, r, mp->in, 1.0f, x, ldx, mp->A, mp->in, 0.0f, lo->u, r);
    be->gemm(be, 1, 0, mp->out, r, N, s, dy, ldy, lo->u, r, 1.0f, dB, r);
    be->gemm(be, 0, 0, N, r, mp->out, s, dy, ldy, mp->B, r, 0.0f, lo->du, r);
    be->gemm(be, 1, 0, r, mp->in, N, 1.0f, lo->du, r, x, ldx, 1.0f, dA, mp->in);
    be->gemm(be, 0, 0, N, mp->in, r, 1.0f, lo->du, r, mp->A, mp->in, 1.0f, dx, lddx);
}

static int qkv_width(const nl_config *c)
{
    return (c->num_heads + 2 * c->num_kv_heads) * nl_config_head_dim(c);
}

void nl_lora_forward_qkv(const nl_model *m, int li, const float *xn, float *qkv, int N)
{
    const int d = m->cfg.hidden_dim, w = qkv_width(&m->cfg);
    for (int t = 0; t < 3; t++) {
        const nl_lora_map *mp = map_of(m, li, t);
        if (mp)
            lora_fwd(m, mp, xn, d, qkv + mp->col0, w, N);
    }
}

void nl_lora_forward_wo(const nl_model *m, int li, const float *att, float *h1, int N)
{
    const nl_lora_map *mp = map_of(m, li, 3);
    if (mp)
        lora_fwd(m, mp, att, mp->in, h1, m->cfg.hidden_dim, N);
}

void nl_lora_backward_qkv(const nl_model *m, int li, const float *xn, const float *dqkv, float *dxn,
                          int N)
{
    const int d = m->cfg.hidden_dim, w = qkv_width(&m->cfg);
    for (int t = 0; t < 3; t++) {
        const nl_lora_map *mp = map_of(m, li, t);
        if (mp)
            lora_bwd(m, mp, xn, d, dqkv + mp->col0, w, dxn, d, N);
    }
}

void nl_lora_backward_wo(const nl_model *m, int li, const float *att, const float *dh1, float *datt,
                         int N)
{
    const nl_lora_map *mp = map_of(m, li, 3);
    if (mp)
        lora_bwd(m, mp, att, mp->in, dh1, m->cfg.hidden_dim, datt, mp->in, N);
}

/* ---------------------------------------------------------------- files */

nl_status nl_lora_save(const nl_lora *lo, const char *path, const char *base_sha256, nl_error *err)
{
    nl_backend *be = lo->m->be;
    float *h = malloc((lo->n_params + 1) * sizeof *h);
    nl_st_writer *w = nl_st_writer_new();
    nl_status st = h && w ? NL_OK : nl_error_set(err, NL_ERR_NOMEM, "lora: out of memory");
    char num[64], tg[32] = "";
    if (st == NL_OK) {
        be->download(be, h, lo->params, lo->n_params * sizeof *h);
        st = nl_backend_check(be, err);
    }
    for (int i = 0; st == NL_OK && i < lo->n_table; i++) {
        const nl_param *p = &lo->table[i];
        st = nl_st_writer_add(w, p->name, NL_DTYPE_F32, 2, p->shape, h + p->offset, err);
    }
    for (int t = 0; t < 4; t++)
        if (lo->targets & (1 << t))
            snprintf(tg + strlen(tg), sizeof tg - strlen(tg), "%s%s", tg[0] ? "," : "",
                     target_names[t]);
    if (st == NL_OK)
        st = nl_st_writer_set_meta(w, "format", "neurollm-lora/1", err);
    snprintf(num, sizeof num, "%d", lo->rank);
    if (st == NL_OK)
        st = nl_st_writer_set_meta(w, "rank", num, err);
    snprintf(num, sizeof num, "%.9g", (double)lo->alpha);
    if (st == NL_OK)
        st = nl_st_writer_set_meta(w, "alpha", num, err);
    if (st == NL_OK)
        st = nl_st_writer_set_meta(w, "targets", tg, err);
    if (st == NL_OK && base_sha256)
        st = nl_st_writer_set_meta(w, "base_sha256", base_sha256, err);
    if (st == NL_OK)
        st = nl_st_writer_write(w, path, err);
    nl_st_writer_destroy(&w);
    free(h);
    return st;
}

nl_status nl_lora_load(nl_lora **out, nl_model *m, const char *path, int max_rows, nl_error *err)
{
    *out = NULL;
    nl_st_file *f = NULL;
    nl_lora *lo = NULL;
    float *h = NULL;
    int targets = 0;
    nl_status st = nl_st_open(&f, path, err);
    if (st != NL_OK)
        return st;
    const char *fmt = nl_st_metadata(f, "format"), *rank = nl_st_metadata(f, "rank");
    const char *alpha = nl_st_metadata(f, "alpha"), *tg = nl_st_metadata(f, "targets");
    if (!fmt || strcmp(fmt, "neurollm-lora/1") != 0 || !rank || !alpha || !tg) {
        st = nl_error_set(err, NL_ERR_FORMAT,
                          "%s: not an adapter file (format neurollm-lora/1 with rank, alpha, "
                          "targets)",
                          path);
        goto out;
    }
    if ((st = nl_lora_parse_targets(tg, &targets, err)) != NL_OK ||
        (st = nl_lora_new(&lo, m, atoi(rank), (float)atof(alpha), targets, max_rows, err)) !=
            NL_OK) {
        nl_error_prefix(err, "%s", path);
        goto out;
    }
    if (!(h = calloc(lo->n_params + 1, sizeof *h))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "lora: out of memory");
        goto out;
    }
    for (int i = 0; i < lo->n_table; i++) {
        const nl_param *p = &lo->table[i];
        const nl_st_entry *e = nl_st_find(f, p->name);
        if (!e || e->dtype != NL_DTYPE_F32 || e->ndim != 2 || e->shape[0] != p->shape[0] ||
            e->shape[1] != p->shape[1]) {
            st = nl_error_set(err, NL_ERR_SHAPE, "%s: %s missing or not F32 [%lld, %lld]", path,
                              p->name, (long long)p->shape[0], (long long)p->shape[1]);
            goto out;
        }
        memcpy(h + p->offset, nl_st_tensor_data(f, e), nl_param_numel(p) * sizeof *h);
    }
    m->be->upload(m->be, lo->params, h, lo->n_params * sizeof *h);
    st = nl_backend_check(m->be, err);
out:
    free(h);
    nl_st_close(&f);
    if (st != NL_OK)
        nl_lora_destroy(&lo);
    *out = lo;
    return st;
}

nl_status nl_lora_merge(nl_lora *lo, nl_error *err)
{
    nl_model *m = lo->m;
    nl_backend *be = m->be;
    const int L = m->l1 - m->l0, r = lo->rank, d = m->cfg.hidden_dim, w = qkv_width(&m->cfg);
    for (int l = 0; l < L; l++)
        for (int t = 0; t < 4; t++) {
            const nl_lora_map *mp = &lo->maps[l * 4 + t];
            if (!mp->A)
                continue;
            const nl_layer_weights *lw = &m->layers[l];
            /* W (out, in) += s B A: the rows of W inside wqkv start at col0 */
            float *W = t == 3 ? lw->wo : lw->wqkv + (size_t)mp->col0 * d;
            be->gemm(be, 0, 0, mp->out, mp->in, r, lo->alpha / (float)r, mp->B, r, mp->A, mp->in,
                     1.0f, W, mp->in);
        }
    (void)w;
    be->zero(be, lo->params, lo->n_params * sizeof(float));
    return nl_backend_check(be, err);
}
