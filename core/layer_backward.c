/* One transformer block's backward pass: through the mixture of experts
 * (combine, grouped expert GEMMs, router softmax and the renormalised
 * top-k weights, the load-balancing loss) and the attention (Wo, tiled
 * flash backward, inverse RoPE, the fused QKV projection), with the two
 * RMSNorms and both residual paths. */
#include "layer.h"

#include <stdlib.h>
#include <string.h>

size_t nl_layer_scratch_floats(const nl_config *c, int N)
{
    const size_t n = (size_t)N, k = (size_t)c->top_k, d = (size_t)c->hidden_dim;
    const size_t hd = (size_t)nl_config_head_dim(c), F = (size_t)c->ffn_dim;
    const size_t qkv = ((size_t)c->num_heads + 2 * (size_t)c->num_kv_heads) * hd;
    return n * (2 * d + qkv + (size_t)c->num_heads * hd + (size_t)c->num_experts + 1) +
           n * k * (d + F + 2 * F + d + 2);
}

nl_status nl_layer_scratch_alloc(nl_layer_grads_scratch *s, nl_backend *be, const nl_config *c,
                                 int N, nl_error *err)
{
    memset(s, 0, sizeof *s);
    const size_t n = (size_t)N, k = (size_t)c->top_k, d = (size_t)c->hidden_dim;
    const size_t hd = (size_t)nl_config_head_dim(c), F = (size_t)c->ffn_dim;
    const size_t qkv = ((size_t)c->num_heads + 2 * (size_t)c->num_kv_heads) * hd;
    const size_t E = (size_t)c->num_experts;
    int ok = 1;
#define DEV(ptr, cnt) ok &= ((ptr) = be->alloc(be, (cnt) * sizeof *(ptr))) != NULL
    DEV(s->dh1, n * d);
    DEV(s->dxn, n * d);
    DEV(s->dqkv, n * qkv);
    DEV(s->datt, n * (size_t)c->num_heads * hd);
    DEV(s->dye, n * k * d);
    DEV(s->dhs, n * k * F);
    DEV(s->dgu, n * k * 2 * F);
    DEV(s->dxe, n * k * d);
    DEV(s->dw, n * k);
    DEV(s->ones, n * k);
    DEV(s->dl, n * E);
    DEV(s->neg_pos_d, n);
#undef DEV
    ok &= (s->dw_h = calloc(n * k, sizeof *s->dw_h)) != NULL;
    ok &= (s->dl_h = calloc(n * E, sizeof *s->dl_h)) != NULL;
    if (ok) {
        float *one = malloc(n * k * sizeof *one);
        ok = one != NULL;
        for (size_t i = 0; ok && i < n * k; i++)
            one[i] = 1.0f;
        if (ok)
            be->upload(be, s->ones, one, n * k * sizeof *one);
        free(one);
    }
    if (!ok) {
        nl_layer_scratch_free(s, be);
        return nl_error_set(err, NL_ERR_NOMEM, "backward scratch: cannot allocate %d rows", N);
    }
    return NL_OK;
}

void nl_layer_scratch_free(nl_layer_grads_scratch *s, nl_backend *be)
{
    void *dev[] = {s->dh1, s->dxn, s->dqkv, s->datt, s->dye, s->dhs,
                   s->dgu, s->dxe, s->dw,   s->ones, s->dl,  s->neg_pos_d};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        be->free(be, dev[i]);
    free(s->dw_h);
    free(s->dl_h);
    memset(s, 0, sizeof *s);
}

/* The gradient slice that matches a weight pointer. */
static float *gslot(const nl_model *m, float *grads, const float *w)
{
    return grads + (w - m->params);
}

/* Router probabilities' gradient on the host: through the renormalised
 * top-k weights w_i = p_ei / S and through the aux loss, then through the
 * softmax. Fills s->dl_h (N, E). */
static void router_backward(const nl_layer_acts *a, nl_layer_grads_scratch *s, int N, int E,
                            int k, float aux_scale)
{
    for (int n = 0; n < N; n++) {
        const float *p = a->probs_h + (size_t)n * E;
        const int32_t *ch = a->choice + (size_t)n * k;
        const float *w = a->w + (size_t)n * k, *dw = s->dw_h + (size_t)n * k;
        float *dl = s->dl_h + (size_t)n * E;
        double S = 0.0, wdot = 0.0;
        for (int i = 0; i < k; i++) {
            S += p[ch[i]];
            wdot += (double)dw[i] * w[i];
        }
        /* dp: aux term on every expert, renormalisation on the chosen */
        for (int e = 0; e < E; e++)
            dl[e] = aux_scale * a->frac[e];
        for (int i = 0; i < k; i++)
            dl[ch[i]] += (float)(((double)dw[i] - wdot) / S);
        /* softmax: dlogit = p * (dp - sum p dp) */
        double dot = 0.0;
        for (int e = 0; e < E; e++)
            dot += (double)p[e] * dl[e];
        for (int e = 0; e < E; e++)
            dl[e] = p[e] * (float)((double)dl[e] - dot);
    }
}

static void moe_backward(nl_model *m, int li, const nl_layer_acts *a, nl_layer_grads_scratch *s,
                         float *grads, const float *dy, int N, float aux_scale)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const nl_layer_weights *w = &m->layers[li - m->l0];
    const int d = c->hidden_dim, E = c->num_experts, k = c->top_k, F = c->ffn_dim;
    const size_t expert_floats = 3 * (size_t)F * d;

    be->moe_combine_backward(be, s->dye, s->dw, dy, a->ye, a->slot_d, a->w_d, N, k, d);
    for (int e = 0; e < E; e++) {
        const int n = a->counts[e], o = a->offsets[e];
        if (n == 0)
            continue;
        const float *wgu = w->experts + e * expert_floats, *wdown = wgu + 2 * (size_t)F * d;
        float *dwgu = gslot(m, grads, wgu), *dwdown = gslot(m, grads, wdown);
        const float *dye = s->dye + (size_t)o * d, *hs = a->hs + (size_t)o * F;
        float *dhs = s->dhs + (size_t)o * F, *dgu = s->dgu + (size_t)o * 2 * F;
        be->gemm(be, 0, 0, n, F, d, 1.0f, dye, d, wdown, F, 0.0f, dhs, F);
        be->gemm(be, 1, 0, d, F, n, 1.0f, dye, d, hs, F, 1.0f, dwdown, F);
        be->swiglu_backward(be, dgu, dhs, a->gu + (size_t)o * 2 * F, n, F);
        be->gemm(be, 1, 0, 2 * F, d, n, 1.0f, dgu, 2 * F, a->xe + (size_t)o * d, d, 1.0f, dwgu, d);
        be->gemm(be, 0, 0, n, d, 2 * F, 1.0f, dgu, 2 * F, wgu, d, 0.0f, s->dxe + (size_t)o * d, d);
    }
    /* each token's input gradient is the sum over its k dispatch slots */
    be->zero(be, s->dxn, (size_t)N * d * sizeof(float));
    be->moe_combine(be, s->dxn, s->dxe, a->slot_d, s->ones, N, k, d);

    be->download(be, s->dw_h, s->dw, (size_t)N * k * sizeof(float));
    router_backward(a, s, N, E, k, aux_scale);
    be->upload(be, s->dl, s->dl_h, (size_t)N * E * sizeof(float));
    be->gemm(be, 1, 0, E, d, N, 1.0f, s->dl, E, a->xn2, d, 1.0f, gslot(m, grads, w->router), d);
    be->gemm(be, 0, 0, N, d, E, 1.0f, s->dl, E, w->router, d, 1.0f, s->dxn, d);

    /* dh1 = dy (residual) + ffn_norm backward */
    be->copy_rows(be, s->dh1, d, dy, d, N, d);
    be->rmsnorm_backward(be, s->dh1, gslot(m, grads, w->ffn_norm), s->dxn, a->h1, w->ffn_norm,
                         a->rstd2, N, d);
}

static void attention_backward(nl_model *m, int li, const nl_layer_acts *a,
                               nl_layer_grads_scratch *s, float *grads, float *dx, int B, int T)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const nl_layer_weights *w = &m->layers[li - m->l0];
    const int N = B * T, d = c->hidden_dim, hd = nl_config_head_dim(c);
    const int H = c->num_heads, G = c->num_kv_heads, qkv = (H + 2 * G) * hd, hq = H * hd;

    be->copy_rows(be, dx, d, s->dh1, d, N, d); /* residual */
    be->gemm(be, 1, 0, d, hq, N, 1.0f, s->dh1, d, a->att, hq, 1.0f, gslot(m, grads, w->wo), hq);
    be->gemm(be, 0, 0, N, hq, d, 1.0f, s->dh1, d, w->wo, hq, 0.0f, s->datt, hq);
    nl_attn_shape sh = {.B = B, .T = T, .past = 0, .kv_cap = T, .H = H, .G = G, .hd = hd};
    be->attention_backward(be, s->dqkv, s->dqkv + hq, s->dqkv + (H + G) * hd, s->datt, a->qkv,
                           qkv, a->qkv + hq, a->qkv + (H + G) * hd, qkv, a->att, a->lse, sh);
    /* RoPE is a rotation: its backward rotates by the negated angle */
    be->rope_forward(be, s->dqkv, s->neg_pos_d, N, qkv, 0, H + G, hd, (float)c->rope_base);
    be->gemm(be, 1, 0, qkv, d, N, 1.0f, s->dqkv, qkv, a->xn1, d, 1.0f, gslot(m, grads, w->wqkv), d);
    be->gemm(be, 0, 0, N, d, qkv, 1.0f, s->dqkv, qkv, w->wqkv, d, 0.0f, s->dxn, d);
    be->rmsnorm_backward(be, dx, gslot(m, grads, w->attention_norm), s->dxn, a->x_in,
                         w->attention_norm, a->rstd1, N, d);
}

void nl_layer_backward(nl_model *m, int li, const nl_layer_acts *a, nl_layer_grads_scratch *s,
                       float *grads, const float *dy, float *dx, int B, int T, float aux_scale)
{
    moe_backward(m, li, a, s, grads, dy, B * T, aux_scale);
    attention_backward(m, li, a, s, grads, dx, B, T);
}
