/* Low-rank adapters: their parameter block, the layer hooks (forward and
 * backward as GEMMs around the base maps), files and merging (lora.h). */
#include "core/model/lora.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "core/formats/manifest.h"
#include "core/formats/safetensors.h"
#include "core/model/layer.h"
#include "core/model/rng.h"

#define N_TARGETS 7 /* wq, wk, wv, wo, then the experts' w_gate, w_up, w_down */
static const char *const target_names[N_TARGETS] = {"wq",     "wk",   "wv",    "wo",
                                                    "w_gate", "w_up", "w_down"};

/* ---------------------------------------------------------------- setup */

nl_status nl_lora_parse_targets(const char *s, int *targets, nl_error *err)
{
    *targets = 0;
    if (s && *s && s[strlen(s) - 1] == ',')
        return nl_error_set(err, NL_ERR_INVALID, "--lora-targets: '%.40s' ends in a comma", s);
    while (s && *s) {
        const size_t n = strcspn(s, ",");
        int hit = 0;
        for (int t = 0; t < N_TARGETS; t++)
            if (n == strlen(target_names[t]) && strncmp(s, target_names[t], n) == 0)
                *targets |= hit = 1 << t;
        if (!hit)
            return nl_error_set(err, NL_ERR_INVALID,
                                "--lora-targets: '%.*s' is not one of wq, wk, wv, wo, w_gate, "
                                "w_up, w_down",
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
    const int d = c->hidden_dim, F = c->ffn_dim;
    const int ins[N_TARGETS] = {d, d, d, H * hd, d, d, F};
    const int outs[N_TARGETS] = {H * hd, G * hd, G * hd, d, F, F, d};
    const int cols[N_TARGETS] = {0, H * hd, (H + G) * hd, 0, 0, F, 0};
    *in = ins[t];
    *out = outs[t];
    *col0 = cols[t];
}

/* Add the table entries of target t of layer l (one pair, or one per
 * expert at a uniform stride) and fill its map. */
static void add_target(nl_lora *lo, int l, int t)
{
    const nl_config *c = &lo->m->cfg;
    const int E = t >= 4 ? c->num_experts : 1;
    int in, o, col0;
    target_shape(c, t, &in, &o, &col0);
    nl_lora_map *mp = t >= 4 ? &lo->emaps[l * 3 + t - 4] : &lo->maps[l * 4 + t];
    mp->in = in;
    mp->out = o;
    mp->col0 = col0;
    mp->stride = (size_t)lo->rank * in + (size_t)o * lo->rank;
    for (int e = 0; e < E; e++)
        for (int ab = 0; ab < 2; ab++) {
            nl_param *p = &lo->table[lo->n_table++];
            if (t >= 4)
                snprintf(p->name, sizeof p->name, "layers.%d.moe.experts.%d.%s.lora_%c.weight",
                         lo->m->l0 + l, e, target_names[t], ab ? 'B' : 'A');
            else
                snprintf(p->name, sizeof p->name, "layers.%d.attention.%s.lora_%c.weight",
                         lo->m->l0 + l, target_names[t], ab ? 'B' : 'A');
            p->kind = NL_PARAM_MATRIX;
            p->ndim = 2;
            p->shape[0] = ab ? o : lo->rank;
            p->shape[1] = ab ? lo->rank : in;
            p->offset = lo->n_params;
            p->init_std = ab ? 0.0f : 1.0f / (float)lo->rank;
            lo->n_params += nl_param_numel(p);
        }
}

/* The scratch for max_rows rows (for expert targets sized by the max_rows
 * top_k dispatch rows, with the identity slots, alpha / r and ones that
 * adding rows through moe_combine needs, uploaded once). */
static nl_status alloc_scratch(nl_lora *lo)
{
    nl_backend *be = lo->m->be;
    const nl_config *c = &lo->m->cfg;
    const int experts = (lo->targets & NL_LORA_EXPERTS) != 0;
    const size_t er = (size_t)lo->max_rows * (size_t)c->top_k; /* dispatch rows */
    const size_t rows = experts && er > (size_t)lo->max_rows ? er : (size_t)lo->max_rows;
    const size_t w = 2 * (size_t)c->ffn_dim > (size_t)c->hidden_dim ? 2 * (size_t)c->ffn_dim
                                                                    : (size_t)c->hidden_dim;
    int ok = 1;
    ok &= (lo->u = be->alloc(be, rows * lo->rank * sizeof(float))) != NULL;
    ok &= (lo->du = be->alloc(be, rows * lo->rank * sizeof(float))) != NULL;
    if (!ok || !experts)
        return ok ? NL_OK : NL_ERR_NOMEM;
    ok &= (lo->t = be->alloc(be, er * w * sizeof(float))) != NULL;
    ok &= (lo->sg = be->alloc(be, er * w * sizeof(float))) != NULL;
    ok &= (lo->svec = be->alloc(be, er * sizeof(float))) != NULL;
    ok &= (lo->ones = be->alloc(be, er * sizeof(float))) != NULL;
    ok &= (lo->iota = be->alloc(be, er * sizeof(int32_t))) != NULL;
    float *h = malloc(er * sizeof *h);
    int32_t *hi = malloc(er * sizeof *hi);
    ok &= h && hi;
    if (ok) {
        for (size_t i = 0; i < er; i++)
            hi[i] = (int32_t)i;
        be->upload(be, lo->iota, hi, er * sizeof *hi);
        for (size_t i = 0; i < er; i++)
            h[i] = lo->alpha / (float)lo->rank;
        be->upload(be, lo->svec, h, er * sizeof *h);
        for (size_t i = 0; i < er; i++)
            h[i] = 1.0f;
        be->upload(be, lo->ones, h, er * sizeof *h);
    }
    free(h);
    free(hi);
    return ok ? NL_OK : NL_ERR_NOMEM;
}

static void free_scratch(nl_lora *lo)
{
    nl_backend *be = lo->m->be;
    void **dev[] = {(void **)&lo->u,    (void **)&lo->du,   (void **)&lo->t,   (void **)&lo->sg,
                    (void **)&lo->svec, (void **)&lo->ones, (void **)&lo->iota};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) {
        be->free(be, *dev[i]);
        *dev[i] = NULL;
    }
}

/* The device blocks: parameters, gradients, moments, and the scratch. */
static nl_status alloc_blocks(nl_lora *lo)
{
    nl_backend *be = lo->m->be;
    const size_t bytes = (lo->n_params + 1) * sizeof(float);
    int ok = 1;
    ok &= (lo->params = be->alloc(be, bytes)) != NULL;
    ok &= (lo->grads = be->alloc(be, bytes)) != NULL;
    ok &= (lo->mom[0] = be->alloc(be, bytes)) != NULL;
    ok &= (lo->mom[1] = be->alloc(be, bytes)) != NULL;
    return ok ? alloc_scratch(lo) : NL_ERR_NOMEM;
}

nl_status nl_lora_reserve(nl_lora *lo, int rows, nl_error *err)
{
    if (rows <= lo->max_rows && lo->u)
        return NL_OK;
    const int had = lo->max_rows;
    free_scratch(lo);
    lo->max_rows = rows > had ? rows : had;
    if (alloc_scratch(lo) != NL_OK) {
        free_scratch(lo);
        lo->max_rows = 0; /* unusable until a reserve succeeds */
        return nl_error_set(err, NL_ERR_NOMEM, "lora: out of memory for %d rows of scratch", rows);
    }
    return NL_OK;
}

/* The trained head starts as the base's. */
static void copy_head(nl_lora *lo)
{
    const nl_config *c = &lo->m->cfg;
    if (lo->classifier)
        lo->m->be->copy_rows(lo->m->be, lo->classifier, c->hidden_dim, lo->base_classifier,
                             c->hidden_dim, c->num_classes, c->hidden_dim);
}

float *nl_lora_grad_of(const nl_model *m, const float *w)
{
    const nl_lora *lo = m->lora;
    if (!lo || w < lo->params || w >= lo->params + lo->n_params)
        return NULL;
    return lo->grads + (w - lo->params);
}

nl_status nl_lora_new(nl_lora **out, nl_model *m, int rank, float alpha, int targets, int max_rows,
                      nl_error *err)
{
    *out = NULL;
    /* an adapter file is untrusted: alpha inf or 1e38 would make every
     * adapted output infinite (NaN down the line) */
    if (rank < 1 || rank > NL_LORA_MAX_RANK || !(alpha > 0.0f) || !(alpha <= NL_LORA_MAX_ALPHA) ||
        targets <= 0 || targets >= 1 << N_TARGETS || max_rows < 1)
        return nl_error_set(err, NL_ERR_INVALID,
                            "lora: rank %d (1..%d), alpha %g (0 < alpha <= %g), %d rows", rank,
                            NL_LORA_MAX_RANK, alpha, NL_LORA_MAX_ALPHA, max_rows);
    if (m->lora)
        return nl_error_set(err, NL_ERR_STATE, "lora: the model already has adapters");
    const int L = m->l1 - m->l0;
    nl_lora *lo = calloc(1, sizeof *lo);
    if (!lo)
        return nl_error_set(err, NL_ERR_NOMEM, "lora: out of memory");
    lo->m = m;
    lo->rank = rank;
    lo->alpha = alpha;
    lo->targets = targets;
    lo->max_rows = max_rows;
    const int E = m->cfg.num_experts;
    lo->maps = calloc((size_t)L * 4 + 1, sizeof *lo->maps);
    lo->emaps = calloc((size_t)L * 3 + 1, sizeof *lo->emaps);
    lo->table = calloc((size_t)L * (8 + 6 * (size_t)E) + 1, sizeof *lo->table);
    if (!lo->maps || !lo->emaps || !lo->table)
        goto nomem;
    for (int l = 0; l < L; l++)
        for (int t = 0; t < N_TARGETS; t++)
            if (targets & (1 << t))
                add_target(lo, l, t);
    nl_param *head = NULL;
    if (m->classifier) { /* trained with the adapters: last in the table */
        head = &lo->table[lo->n_table++];
        snprintf(head->name, sizeof head->name, "classifier.weight");
        head->kind = NL_PARAM_MATRIX;
        head->ndim = 2;
        head->shape[0] = m->cfg.num_classes;
        head->shape[1] = m->cfg.hidden_dim;
        head->offset = lo->n_params;
        lo->n_params += nl_param_numel(head);
    }
    if (alloc_blocks(lo) != NL_OK)
        goto nomem;
    for (int l = 0, i = 0; l < L; l++)
        for (int t = 0; t < N_TARGETS; t++)
            if (targets & (1 << t)) {
                nl_lora_map *mp = t >= 4 ? &lo->emaps[l * 3 + t - 4] : &lo->maps[l * 4 + t];
                mp->A = lo->params + lo->table[i].offset;
                mp->B = lo->params + lo->table[i + 1].offset;
                i += t >= 4 ? 2 * E : 2;
            }
    if (head) {
        lo->classifier = lo->params + head->offset;
        lo->base_classifier = m->classifier;
        copy_head(lo);
        m->classifier = lo->classifier;
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
    if (lo->classifier && lo->m->classifier == lo->classifier)
        lo->m->classifier = lo->base_classifier;
    void *dev[] = {lo->params, lo->grads, lo->mom[0], lo->mom[1]};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        be->free(be, dev[i]);
    free_scratch(lo);
    free(lo->maps);
    free(lo->emaps);
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
    copy_head(lo);
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

/* ---------------------------------------------------------------- expert hooks */

/* Over a grouped dispatch (offsets of moe_route; n_g <= N rows per expert,
 * N top_k rows in all): products with expert g's adapter through
 * gemm_grouped, and row sums through moe_combine with identity slots
 * (x += w y, w = alpha / r or 1), so the host never needs the counts. */

static const nl_lora_map *emap_of(const nl_model *m, int li, int t)
{
    const nl_lora *lo = m->lora;
    const nl_lora_map *mp = lo && lo->emaps ? &lo->emaps[(li - m->l0) * 3 + t] : NULL;
    return mp && mp->A ? mp : NULL;
}

int nl_lora_on_experts(const nl_model *m)
{
    return m->lora && (m->lora->targets & NL_LORA_EXPERTS) != 0;
}

/* y[:, 0:out] (row stride ldy) = (x A_g^T) B_g^T per group, u kept. */
static void egemm_fwd(const nl_model *m, const nl_lora_map *mp, const float *x, int ldx, float *y,
                      int ldy, const int32_t *offsets, int N)
{
    nl_backend *be = m->be;
    const nl_lora *lo = m->lora;
    const int r = lo->rank, E = m->cfg.num_experts;
    be->gemm_grouped(be, 1, r, mp->in, x, ldx, mp->A, mp->in, mp->stride, lo->u, r, offsets, E, N);
    be->gemm_grouped(be, 1, mp->out, r, lo->u, r, mp->B, r, mp->stride, y, ldy, offsets, E, N);
}

/* x (rows, C) += w y with w = alpha / r (scaled) or 1 */
static void add_rows(const nl_model *m, float *x, const float *y, int rows, int C, int scaled)
{
    const nl_lora *lo = m->lora;
    m->be->moe_combine(m->be, x, y, lo->iota, scaled ? lo->svec : lo->ones, rows, 1, C);
}

void nl_lora_forward_gu(const nl_model *m, int li, const float *xe, float *gu,
                        const int32_t *offsets, int N)
{
    const nl_lora_map *g = emap_of(m, li, 0), *u = emap_of(m, li, 1);
    if (!g && !u)
        return;
    const int F = m->cfg.ffn_dim, rows = N * m->cfg.top_k;
    const nl_lora *lo = m->lora;
    if (!g || !u) /* the other half adds zeros */
        m->be->zero(m->be, lo->t, (size_t)rows * 2 * F * sizeof(float));
    if (g)
        egemm_fwd(m, g, xe, g->in, lo->t, 2 * F, offsets, N);
    if (u)
        egemm_fwd(m, u, xe, u->in, lo->t + F, 2 * F, offsets, N);
    add_rows(m, gu, lo->t, rows, 2 * F, 1);
}

void nl_lora_forward_down(const nl_model *m, int li, const float *hs, float *ye,
                          const int32_t *offsets, int N)
{
    const nl_lora_map *mp = emap_of(m, li, 2);
    if (!mp)
        return;
    const int rows = N * m->cfg.top_k;
    egemm_fwd(m, mp, hs, mp->in, m->lora->t, mp->out, offsets, N);
    add_rows(m, ye, m->lora->t, rows, mp->out, 1);
}

void nl_lora_forward_expert(const nl_model *m, int li, int e, const float *x, float *y, int n,
                            int down)
{
    const int F = m->cfg.ffn_dim;
    for (int t = down ? 2 : 0; t < (down ? 3 : 2); t++) {
        const nl_lora_map *mp = emap_of(m, li, t);
        if (!mp)
            continue;
        nl_lora_map one = *mp; /* expert e's pair as a plain map */
        one.A += e * mp->stride;
        one.B += e * mp->stride;
        lora_fwd(m, &one, x, mp->in, y + (t == 1 ? F : 0), down ? mp->out : 2 * F, n);
    }
}

/* The backward of y_g = s (x A_g^T) B_g^T given sdy = s dy (ld lds): the
 * adapters' gradients, and dx += du A_g. */
static void egemm_bwd(const nl_model *m, const nl_lora_map *mp, const float *x, int ldx,
                      const float *sdy, int lds, float *dx, const int32_t *offsets, int N)
{
    nl_backend *be = m->be;
    const nl_lora *lo = m->lora;
    const int r = lo->rank, E = m->cfg.num_experts, rows = N * m->cfg.top_k;
    float *dA = lo->grads + (mp->A - lo->params), *dB = lo->grads + (mp->B - lo->params);
    be->gemm_grouped(be, 1, r, mp->in, x, ldx, mp->A, mp->in, mp->stride, lo->u, r, offsets, E, N);
    be->gemm_grouped_wgrad(be, mp->out, r, sdy, lds, lo->u, r, dB, r, mp->stride, offsets, E);
    be->gemm_grouped(be, 0, r, mp->out, sdy, lds, mp->B, r, mp->stride, lo->du, r, offsets, E, N);
    be->gemm_grouped_wgrad(be, r, mp->in, lo->du, r, x, ldx, dA, mp->in, mp->stride, offsets, E);
    be->gemm_grouped(be, 0, mp->in, r, lo->du, r, mp->A, mp->in, mp->stride, lo->t, mp->in, offsets,
                     E, N);
    add_rows(m, dx, lo->t, rows, mp->in, 0);
}

/* sg (rows, C) = s dy */
static void scaled_copy(const nl_model *m, const float *dy, int rows, int C)
{
    const nl_lora *lo = m->lora;
    m->be->zero(m->be, lo->sg, (size_t)rows * C * sizeof(float));
    add_rows(m, lo->sg, dy, rows, C, 1);
}

void nl_lora_backward_down(const nl_model *m, int li, const float *hs, const float *dye, float *dhs,
                           const int32_t *offsets, int N)
{
    const nl_lora_map *mp = emap_of(m, li, 2);
    if (!mp)
        return;
    scaled_copy(m, dye, N * m->cfg.top_k, mp->out);
    egemm_bwd(m, mp, hs, mp->in, m->lora->sg, mp->out, dhs, offsets, N);
}

void nl_lora_backward_gu(const nl_model *m, int li, const float *xe, const float *dgu, float *dxe,
                         const int32_t *offsets, int N)
{
    const nl_lora_map *g = emap_of(m, li, 0), *u = emap_of(m, li, 1);
    if (!g && !u)
        return;
    const int F = m->cfg.ffn_dim, d = m->cfg.hidden_dim;
    scaled_copy(m, dgu, N * m->cfg.top_k, 2 * F);
    if (g)
        egemm_bwd(m, g, xe, d, m->lora->sg, 2 * F, dxe, offsets, N);
    if (u)
        egemm_bwd(m, u, xe, d, m->lora->sg + F, 2 * F, dxe, offsets, N);
}

/* ---------------------------------------------------------------- files */

nl_status nl_lora_save(const nl_lora *lo, const char *path, const char *base_sha256, nl_error *err)
{
    nl_backend *be = lo->m->be;
    float *h = malloc((lo->n_params + 1) * sizeof *h);
    nl_st_writer *w = nl_st_writer_new();
    nl_status st = h && w ? NL_OK : nl_error_set(err, NL_ERR_NOMEM, "lora: out of memory");
    char num[64], tg[64] = "";
    if (st == NL_OK) {
        be->download(be, h, lo->params, lo->n_params * sizeof *h);
        st = nl_backend_check(be, err);
    }
    for (int i = 0; st == NL_OK && i < lo->n_table; i++) {
        const nl_param *p = &lo->table[i];
        st = nl_st_writer_add(w, p->name, NL_DTYPE_F32, 2, p->shape, h + p->offset, err);
    }
    for (int t = 0; t < N_TARGETS; t++)
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

/* path's base_sha256 into want (64 hex digits), or "" where it names none */
static nl_status base_named(const char *path, char want[65], nl_error *err)
{
    nl_st_file *f = NULL;
    want[0] = '\0';
    nl_status st = nl_st_open(&f, path, err);
    if (st != NL_OK)
        return st;
    const char *w = nl_st_metadata(f, "base_sha256");
    size_t n = w ? strlen(w) : 0;
    for (size_t i = 0; w && i < n; i++)
        n = isxdigit((unsigned char)w[i]) ? n : 0;
    if (w && n != 64)
        st = nl_error_set(err, NL_ERR_FORMAT,
                          "%s: metadata base_sha256 '%.70s' is not a SHA-256 (64 hex digits)", path,
                          w);
    else if (w)
        memcpy(want, w, 65);
    nl_st_close(&f);
    return st;
}

nl_status nl_lora_check_bases(const char *const *paths, int n, const char *base_path, nl_error *err)
{
    char hex[65] = "";
    return nl_lora_check_bases_hex(paths, n, base_path, hex, err);
}

nl_status nl_lora_check_bases_hex(const char *const *paths, int n, const char *base_path,
                                  char hex[65], nl_error *err)
{
    struct stat sb;
    const int file = base_path && stat(base_path, &sb) == 0 && S_ISREG(sb.st_mode);
    for (int i = 0; i < n; i++) {
        char want[65];
        nl_status st = base_named(paths[i], want, err);
        if (st != NL_OK)
            return st;
        if (!want[0] || !file)
            continue;
        uint64_t bytes = 0; /* the base is hashed once, when an adapter names one */
        if (!hex[0] && (st = nl_file_sha256(base_path, hex, &bytes, err)) != NL_OK)
            return st;
        if (strcasecmp(hex, want) != 0)
            return nl_error_set(err, NL_ERR_INTEGRITY,
                                "%s: an adapter of the checkpoint with SHA-256 %.12s..., not of %s "
                                "(SHA-256 %.12s...): apply it to the checkpoint it was trained on",
                                paths[i], want, base_path, hex);
    }
    return NL_OK;
}

nl_status nl_lora_check_base(const char *path, const char *base_path, nl_error *err)
{
    return nl_lora_check_bases(&path, 1, base_path, err);
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
    char *rend = NULL, *aend = NULL;
    const long r = strtol(rank, &rend, 10);
    const double a = strtod(alpha, &aend);
    if (rend == rank || *rend || r < 1 || r > NL_LORA_MAX_RANK) {
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: metadata rank '%.40s' is not a rank in 1..%d",
                          path, rank, NL_LORA_MAX_RANK);
        goto out;
    }
    if (aend == alpha || *aend || !isfinite(a)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: metadata alpha '%.40s' is not a number", path,
                          alpha);
        goto out;
    }
    if ((st = nl_lora_parse_targets(tg, &targets, err)) != NL_OK) {
        /* the message names the flag the same parser reads; here the file said it */
        const char *why = strncmp(err->msg, "--lora-targets: ", 16) == 0 ? err->msg + 16 : err->msg;
        char copy[sizeof err->msg];
        snprintf(copy, sizeof copy, "%s", why);
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: metadata targets: %s", path, copy);
        goto out;
    }
    if ((st = nl_lora_new(&lo, m, (int)r, (float)a, targets, max_rows, err)) != NL_OK) {
        nl_error_prefix(err, "%s", path);
        goto out;
    }
    if (!(h = calloc(lo->n_params + 1, sizeof *h))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "lora: out of memory");
        goto out;
    }
    int has_head = 0;
    for (int i = 0; i < lo->n_table; i++) {
        const nl_param *p = &lo->table[i];
        const nl_st_entry *e = nl_st_find(f, p->name);
        if (!e && lo->params + p->offset == lo->classifier)
            continue; /* an adapter without a head: the base's stays */
        has_head |= lo->params + p->offset == lo->classifier;
        if (!e || e->dtype != NL_DTYPE_F32 || e->ndim != 2 || e->shape[0] != p->shape[0] ||
            e->shape[1] != p->shape[1]) {
            st = nl_error_set(err, NL_ERR_SHAPE, "%s: %s missing or not F32 [%lld, %lld]", path,
                              p->name, (long long)p->shape[0], (long long)p->shape[1]);
            goto out;
        }
        memcpy(h + p->offset, nl_st_tensor_data(f, e), nl_param_numel(p) * sizeof *h);
    }
    m->be->upload(m->be, lo->params, h, lo->n_params * sizeof *h);
    if (!has_head)
        copy_head(lo);
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
    /* expert e's w_gate, w_up, w_down at rows 0, F, 2F of its (3F, d) block */
    const int F = m->cfg.ffn_dim, E = m->cfg.num_experts;
    const size_t ef = 3 * (size_t)F * d;
    for (int l = 0; l < L; l++)
        for (int t = 0; t < 3; t++) {
            const nl_lora_map *mp = &lo->emaps[l * 3 + t];
            for (int e = 0; mp->A && e < E; e++)
                be->gemm(be, 0, 0, mp->out, mp->in, r, lo->alpha / (float)r, mp->B + e * mp->stride,
                         r, mp->A + e * mp->stride, mp->in, 1.0f,
                         m->layers[l].experts + e * ef + (size_t)t * F * d, mp->in);
        }
    (void)w;
    if (lo->classifier) { /* the base's head becomes the trained one */
        be->copy_rows(be, lo->base_classifier, d, lo->classifier, d, m->cfg.num_classes, d);
        m->classifier = lo->base_classifier;
    }
    be->zero(be, lo->params, lo->n_params * sizeof(float));
    if (be->wrote) /* the GEMMs above wrote the weights: any bf16 copy of them is stale */
        be->wrote(be, m->params, m->n_params * sizeof(float));
    return nl_backend_check(be, err);
}
