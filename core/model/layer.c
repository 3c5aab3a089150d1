/* One transformer block's forward pass, and its activation buffers. The
 * backward pass is in core/model/layer_backward.c. */
#include "core/model/layer.h"

#include <stdlib.h>

#include "core/model/lora.h"
#include "kernels/elem.h"

#include <string.h>

/* every expert count the config accepts, the routing slots take */
_Static_assert(NL_CONFIG_MAX_EXPERTS <= NL_BACKEND_MAX_EXPERTS, "routing slots: too few experts");

/* NL_HOST_ROUTING=1: route on the host, as before the routing slots */
static int host_routing_env(void)
{
    const char *v = getenv("NL_HOST_ROUTING");
    return v && strcmp(v, "1") == 0;
}

/* NL_FUSED=0: the separate slots even where the fused decode ones serve */
static int fused_off_env(void)
{
    const char *v = getenv("NL_FUSED");
    return v && strcmp(v, "0") == 0;
}

/* ---------------------------------------------------------------- buffers */

typedef struct acts_dims {
    size_t N, d, qkv, hq, E, k, F;
} acts_dims;

static acts_dims dims_of(const nl_config *c, int N)
{
    const size_t hd = (size_t)nl_config_head_dim(c);
    acts_dims s = {.N = (size_t)N,
                   .d = (size_t)c->hidden_dim,
                   .qkv = ((size_t)c->num_heads + 2 * (size_t)c->num_kv_heads) * hd,
                   .hq = (size_t)c->num_heads * hd,
                   .E = (size_t)c->num_experts,
                   .k = (size_t)c->top_k,
                   .F = (size_t)c->ffn_dim};
    return s;
}

size_t nl_layer_acts_floats(const nl_config *cfg, int N)
{
    acts_dims s = dims_of(cfg, N);
    /* x_in, xn1, h1, xn2, x_out, rstd1, rstd2, qkv, att, lse, probs,
     * xe, gu, hs, ye, the four routing tables of N k, offsets, frac, aux */
    return s.N * (5 * s.d + 2 + s.qkv + s.hq + (size_t)cfg->num_heads + s.E) +
           s.N * s.k * (s.d + 2 * s.F + s.F + s.d + 4) + 2 * s.E + 3;
}

/* A dense FFN's router probabilities: all 1 (N rows of E = 1). */
static int dense_probs(nl_layer_acts *a, nl_backend *be, int N)
{
    float *one = malloc((size_t)N * sizeof *one);
    if (!one)
        return 0;
    for (int n = 0; n < N; n++)
        one[n] = 1.0f;
    be->upload(be, a->probs, one, (size_t)N * sizeof *one);
    free(one);
    return 1;
}

nl_status nl_layer_acts_alloc(nl_layer_acts *a, nl_backend *be, const nl_config *cfg, int N,
                              int training, nl_error *err)
{
    memset(a, 0, sizeof *a);
    acts_dims s = dims_of(cfg, N);
    int ok = 1;
#define DEV(ptr, n) ok &= ((ptr) = be->alloc(be, (n) * sizeof *(ptr))) != NULL
#define HOST(ptr, n) ok &= ((ptr) = calloc((n), sizeof *(ptr))) != NULL
    DEV(a->x_in, s.N * s.d);
    DEV(a->xn1, s.N * s.d);
    DEV(a->qkv, s.N * s.qkv);
    DEV(a->att, s.N * s.hq);
    DEV(a->xn2, s.N * s.d);
    DEV(a->probs, s.N * s.E);
    DEV(a->xe, s.N * s.k * s.d);
    DEV(a->gu, s.N * s.k * 2 * s.F);
    DEV(a->hs, s.N * s.k * s.F);
    DEV(a->ye, s.N * s.k * s.d);
    DEV(a->choice_d, s.N * s.k);
    DEV(a->w_d, s.N * s.k);
    DEV(a->perm_d, s.N * s.k);
    DEV(a->slot_d, s.N * s.k);
    DEV(a->offsets_d, s.E + 1);
    DEV(a->frac_d, s.E);
    DEV(a->aux_d, 1);
    if (training) {
        DEV(a->h1, s.N * s.d);
        DEV(a->x_out, s.N * s.d);
        DEV(a->rstd1, s.N);
        DEV(a->rstd2, s.N);
        DEV(a->lse, s.N * (size_t)cfg->num_heads);
    } else {
        a->h1 = a->x_out = a->x_in;
    }
    HOST(a->probs_h, s.N * s.E);
    HOST(a->choice, s.N * s.k);
    HOST(a->w, s.N * s.k);
    HOST(a->perm, s.N * s.k);
    HOST(a->slot, s.N * s.k);
    HOST(a->offsets, s.E + 1);
    a->host_routing = host_routing_env();
    a->fused_off = fused_off_env();
#undef DEV
#undef HOST
    if (ok && nl_config_dense(cfg)) /* one expert, weight 1: no router */
        ok = dense_probs(a, be, N);
    if (!ok) {
        nl_layer_acts_free(a, be);
        return nl_error_set(err, NL_ERR_NOMEM, "activations: cannot allocate %zu rows", s.N);
    }
    return NL_OK;
}

void nl_layer_acts_free(nl_layer_acts *a, nl_backend *be)
{
    if (a->h1 != a->x_in)
        be->free(be, a->h1);
    if (a->x_out != a->x_in)
        be->free(be, a->x_out);
    void *dev[] = {a->x_in,  a->xn1,    a->rstd1,  a->qkv,       a->att,    a->lse,  a->xn2,
                   a->rstd2, a->probs,  a->xe,     a->gu,        a->hs,     a->ye,   a->choice_d,
                   a->w_d,   a->perm_d, a->slot_d, a->offsets_d, a->frac_d, a->aux_d};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        be->free(be, dev[i]);
    free(a->probs_h);
    free(a->choice);
    free(a->w);
    free(a->perm);
    free(a->slot);
    free(a->offsets);
    memset(a, 0, sizeof *a);
}

/* ---------------------------------------------------------------- router */

/* h = act(gate) * up over rows of gu (N, 2F): SwiGLU or GeGLU. */
static void ffn_act_forward(nl_backend *be, const nl_config *c, float *h, const float *gu, int n)
{
    if (c->ffn_act == NL_FFN_GEGLU)
        be->geglu_forward(be, h, gu, n, c->ffn_dim);
    else
        be->swiglu_forward(be, h, gu, n, c->ffn_dim);
}

/* host_routing mode: top-k of each row of probs_h (nl_elem_topk_row,
 * the backends' rule), and the dispatch tables grouped by expert (token
 * order within an expert): the CPU backend's moe_route, which this was. */
static void route(nl_layer_acts *a, int N, int E, int k)
{
    const float *p = a->probs_h;
    int counts[NL_CONFIG_MAX_EXPERTS] = {0};
    for (int n = 0; n < N; n++) {
        int32_t *ch = a->choice + (size_t)n * k;
        nl_elem_topk_row(ch, a->w + (size_t)n * k, p + (size_t)n * E, E, k);
        for (int i = 0; i < k; i++)
            counts[ch[i]]++;
    }
    a->offsets[0] = 0;
    for (int e = 0; e < E; e++)
        a->offsets[e + 1] = a->offsets[e] + counts[e];
    int fill[NL_CONFIG_MAX_EXPERTS];
    memcpy(fill, a->offsets, (size_t)E * sizeof *fill);
    for (int n = 0; n < N; n++)
        for (int i = 0; i < k; i++) {
            int s = fill[a->choice[(size_t)n * k + i]]++;
            a->perm[s] = n;
            a->slot[(size_t)n * k + i] = s;
        }
}

/* The host_routing forward of the experts: download, route, upload the
 * tables, and one pair of GEMMs per expert sized by the host counts. */
static void experts_host_routed(const nl_model *m, int li, nl_layer_acts *a, int N)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const nl_layer_weights *w = &m->layers[li - m->l0];
    const int d = c->hidden_dim, E = c->num_experts, k = c->top_k, F = c->ffn_dim;
    const size_t nk = (size_t)N * k;
    be->download(be, a->probs_h, a->probs, (size_t)N * E * sizeof(float));
    route(a, N, E, k);
    be->upload(be, a->choice_d, a->choice, nk * sizeof(int32_t));
    be->upload(be, a->w_d, a->w, nk * sizeof(float));
    be->upload(be, a->perm_d, a->perm, nk * sizeof(int32_t));
    be->upload(be, a->slot_d, a->slot, nk * sizeof(int32_t));
    be->upload(be, a->offsets_d, a->offsets, (size_t)(E + 1) * sizeof(int32_t));
    be->gather_rows(be, a->xe, a->xn2, a->perm_d, N * k, d);
    const size_t expert_floats = 3 * (size_t)F * d;
    for (int e = 0; e < E; e++) {
        const int n = a->offsets[e + 1] - a->offsets[e], o = a->offsets[e];
        if (n == 0)
            continue;
        const float *wgu = w->experts + e * expert_floats; /* (2F, d) */
        const float *wdown = wgu + 2 * (size_t)F * d;      /* (d, F) */
        float *gu = a->gu + (size_t)o * 2 * F, *hs = a->hs + (size_t)o * F;
        be->gemm(be, 0, 1, n, 2 * F, d, 1.0f, a->xe + (size_t)o * d, d, wgu, d, 0.0f, gu, 2 * F);
        nl_lora_forward_expert(m, li, e, a->xe + (size_t)o * d, gu, n, 0); /* adapters, if any */
        ffn_act_forward(be, c, hs, gu, n);
        be->gemm(be, 0, 1, n, d, F, 1.0f, hs, F, wdown, F, 0.0f, a->ye + (size_t)o * d, d);
        nl_lora_forward_expert(m, li, e, hs, a->ye + (size_t)o * d, n, 1);
    }
}

/* ---------------------------------------------------------------- blocks */

void nl_layer_rope(nl_backend *be, const nl_config *c, float *qkv, const int32_t *pos_d, int N)
{
    const int hd = nl_config_head_dim(c), H = c->num_heads, G = c->num_kv_heads;
    const int row = (H + 2 * G) * hd;
    if (c->rope_scaling.type != NL_ROPE_NONE)
        be->rope_scaled_forward(be, qkv, pos_d, N, row, 0, H + G, hd, (float)c->rope_base,
                                c->rope_scaling);
    else
        be->rope_forward(be, qkv, pos_d, N, row, 0, H + G, hd, (float)c->rope_base);
}

nl_attn_mask nl_layer_mask(const nl_config *c, int li, const int32_t *doc_d)
{
    const nl_attn_mask mk = {.bidir = !c->causal,
                             .window = nl_config_layer_local(c, li) ? c->attention_window : 0,
                             .doc = doc_d};
    return mk;
}

static void attention_block(nl_model *m, int li, nl_layer_acts *a, int B, int T, int past,
                            nl_kvcache *kv, const int32_t *pos_d)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const nl_layer_weights *w = &m->layers[li - m->l0];
    const int N = B * T, d = c->hidden_dim, hd = nl_config_head_dim(c);
    const int H = c->num_heads, G = c->num_kv_heads, qkv = (H + 2 * G) * hd;

    be->rmsnorm_forward(be, a->xn1, a->rstd1, a->x_in, w->attention_norm, N, d, (float)c->norm_eps);
    be->gemm(be, 0, 1, N, qkv, d, 1.0f, a->xn1, d, w->wqkv, d, 0.0f, a->qkv, qkv);
    nl_lora_forward_qkv(m, li, a->xn1, a->qkv, N); /* adapters, if any */
    /* q and k heads are adjacent columns: rotate them in one call */
    nl_layer_rope(be, c, a->qkv, pos_d, N);

    nl_attn_shape s = {.B = B, .T = T, .past = past, .kv_cap = T, .H = H, .G = G, .hd = hd};
    const void *k = a->qkv + H * hd, *v = a->qkv + (H + G) * hd;
    int kv_stride = qkv;
    if (kv && a->dev_past) { /* positions on the device: nothing here knows past */
        nl_kvcache_store(kv, li - m->l0, a->qkv, qkv, H * hd, (H + G) * hd, B, T, pos_d, &k, &v);
        s.past = 0;
        s.pos = pos_d;
    } else if (kv) {
        nl_kvcache_append(kv, li - m->l0, a->qkv, qkv, H * hd, (H + G) * hd, B, T, past, &k, &v);
    }
    if (kv) {
        kv_stride = kv->kv_dim;
        s.kv_cap = kv->cap;
        s.kv_bf16 = kv->dtype == NL_KV_BF16;
    }
    const nl_attn_mask mk = nl_layer_mask(c, li, a->doc_d);
    if (mk.bidir || mk.window || mk.doc)
        be->attention_masked_forward(be, a->att, a->lse, a->qkv, qkv, k, v, kv_stride, s, mk);
    else
        be->attention_forward(be, a->att, a->lse, a->qkv, qkv, k, v, kv_stride, s);
    if (a->h1 != a->x_in)
        be->copy_rows(be, a->h1, d, a->x_in, d, N, d);
    be->gemm(be, 0, 1, N, d, H * hd, 1.0f, a->att, H * hd, w->wo, H * hd, 1.0f, a->h1, d);
    nl_lora_forward_wo(m, li, a->att, a->h1, N);
}

/* A decode's few rows through the fused slots: three launches in place
 * of eight (ten on CUDA), no dispatch (each token's experts read directly), the
 * residual added in place. Only where nothing reads what they skip: the
 * dispatch tables, the aux loss, the counts, the adapters. */
static int fused_decode(const nl_model *m, const nl_layer_acts *a, const nl_layer_weights *w, int N,
                        const nl_layer_aux *aux)
{
    return a->fused && !a->fused_off && m->be->moe_norm_route && N < NL_BACKEND_FUSED_ROWS &&
           w->router && !aux && !a->host_routing && m->cfg.ffn_act != NL_FFN_GEGLU && !m->lora &&
           a->x_out == a->h1;
}

static void moe_block(nl_model *m, int li, nl_layer_acts *a, int N, const nl_layer_aux *aux)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const nl_layer_weights *w = &m->layers[li - m->l0];
    const int d = c->hidden_dim, E = c->num_experts, k = c->top_k, F = c->ffn_dim;
    const size_t expert_floats = 3 * (size_t)F * d;

    if (fused_decode(m, a, w, N, aux)) {
        be->moe_norm_route(be, a->xn2, a->probs, a->choice_d, a->w_d, a->h1, w->ffn_norm, w->router,
                           N, d, E, k, (float)c->norm_eps);
        be->moe_gate_up(be, a->hs, a->gu, a->xn2, a->choice_d, w->experts, expert_floats, N, k, d,
                        F);
        be->moe_down_combine(be, a->x_out, a->ye, a->hs, a->choice_d, a->w_d, w->experts,
                             expert_floats, N, k, d, F);
        return;
    }
    be->rmsnorm_forward(be, a->xn2, a->rstd2, a->h1, w->ffn_norm, N, d, (float)c->norm_eps);
    if (w->router) { /* a dense FFN's probs stay 1 (nl_layer_acts_alloc) */
        be->gemm(be, 0, 1, N, E, d, 1.0f, a->xn2, d, w->router, d, 0.0f, a->probs, E);
        be->softmax_forward(be, a->probs, N, E);
    }
    if (a->host_routing) {
        experts_host_routed(m, li, a, N);
    } else {
        /* grouped dispatch: each expert runs only on the rows routed to it,
         * sized on the device by the offsets (a token takes an expert at
         * most once, so no expert has more than N rows) */
        be->moe_route(be, a->choice_d, a->w_d, a->offsets_d, a->perm_d, a->slot_d, a->probs, N, E,
                      k);
        be->gather_rows(be, a->xe, a->xn2, a->perm_d, N * k, d);
        if (be->moe_ffn_forward && c->ffn_act != NL_FFN_GEGLU &&
            !nl_lora_on_experts(m)) { /* one pass: each group's SwiGLU while it is in cache */
            be->moe_ffn_forward(be, a->ye, a->hs, a->gu, a->xe, w->experts, expert_floats, d, F,
                                a->offsets_d, E, N);
        } else {
            be->gemm_grouped(be, 1, 2 * F, d, a->xe, d, w->experts, d, expert_floats, a->gu, 2 * F,
                             a->offsets_d, E, N);
            nl_lora_forward_gu(m, li, a->xe, a->gu, a->offsets_d, N); /* adapters, if any */
            ffn_act_forward(be, c, a->hs, a->gu, N * k); /* row-wise: all groups at once */
            be->gemm_grouped(be, 1, d, F, a->hs, F, w->experts + 2 * (size_t)F * d, F,
                             expert_floats, a->ye, d, a->offsets_d, E, N);
            nl_lora_forward_down(m, li, a->hs, a->ye, a->offsets_d, N);
        }
    }
    if (a->x_out != a->h1)
        be->copy_rows(be, a->x_out, d, a->h1, d, N, d);
    be->moe_combine(be, a->x_out, a->ye, a->slot_d, a->w_d, N, k, d);

    /* load-balancing loss: E * sum_e frac_e * mean_p_e, in double; a
     * dense FFN has none (its counts are still kept) */
    const nl_layer_aux own = {.global_frac = NULL, .rows = (double)N, .sum = a->aux_d};
    if (!aux)
        aux = &own;
    be->moe_aux(be, w->router ? aux->sum : NULL, a->frac_d, aux->counts, a->probs, a->offsets_d,
                aux->global_frac, N, E, k, aux->rows);
}

void nl_layer_forward(nl_model *m, int li, nl_layer_acts *a, int B, int T, int past, nl_kvcache *kv,
                      const int32_t *pos_d, const nl_layer_aux *aux)
{
    attention_block(m, li, a, B, T, past, kv, pos_d);
    moe_block(m, li, a, B * T, aux);
}

void nl_layer_ffn_forward(nl_model *m, int li, nl_layer_acts *a, int N)
{
    moe_block(m, li, a, N, NULL);
}
