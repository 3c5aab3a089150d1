/* One transformer block's backward pass: through the mixture of experts
 * (combine, grouped expert GEMMs, router softmax and the renormalised
 * top-k weights, the load-balancing loss) and the attention (Wo, tiled
 * flash backward, inverse RoPE, the fused QKV projection), with the two
 * RMSNorms and both residual paths. Everything is queued on the device:
 * the expert GEMMs are grouped by the forward's device offsets and the
 * router's gradient is a backend slot, so no step waits for the host.
 * Under a frozen base (LoRA) the matrices' weight-gradient products are
 * skipped: only the input gradients and the adapters' remain. */
#include "core/model/layer.h"

#include <stdlib.h>

#include "core/model/lora.h"
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
    memset(s, 0, sizeof *s);
}

/* The gradient slice that matches a weight pointer. */
static float *gslot(const nl_model *m, float *grads, const float *w)
{
    return grads + (w - m->params);
}

static void moe_backward(nl_model *m, int li, const nl_layer_acts *a, nl_layer_grads_scratch *s,
                         float *grads, const float *dy, int N, float aux_scale, int frozen)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const nl_layer_weights *w = &m->layers[li - m->l0];
    const int d = c->hidden_dim, E = c->num_experts, k = c->top_k, F = c->ffn_dim;
    const size_t expert_floats = 3 * (size_t)F * d;

    be->moe_combine_backward(be, s->dye, s->dw, dy, a->ye, a->slot_d, a->w_d, N, k, d);
    /* the experts, grouped by the device offsets: no host counts */
    const float *wdown0 = w->experts + 2 * (size_t)F * d;
    if (be->moe_ffn_backward && c->ffn_act != NL_FFN_GEGLU &&
        !nl_lora_on_experts(m)) { /* group by group, each SwiGLU backward while in cache */
        /* dexperts NULL: the input gradients only */
        be->moe_ffn_backward(be, s->dxe, s->dgu, s->dhs,
                             frozen ? NULL : gslot(m, grads, w->experts), s->dye, a->xe, a->gu,
                             a->hs, w->experts, expert_floats, d, F, a->offsets_d, E);
    } else {
        be->gemm_grouped(be, 0, F, d, s->dye, d, wdown0, F, expert_floats, s->dhs, F, a->offsets_d,
                         E, N);
        if (!frozen)
            be->gemm_grouped_wgrad(be, d, F, s->dye, d, a->hs, F, gslot(m, grads, wdown0), F,
                                   expert_floats, a->offsets_d, E);
        nl_lora_backward_down(m, li, a->hs, s->dye, s->dhs, a->offsets_d, N); /* adapters */
        if (c->ffn_act == NL_FFN_GEGLU) /* row-wise: all groups */
            be->geglu_backward(be, s->dgu, s->dhs, a->gu, N * k, F);
        else
            be->swiglu_backward(be, s->dgu, s->dhs, a->gu, N * k, F);
        if (!frozen)
            be->gemm_grouped_wgrad(be, 2 * F, d, s->dgu, 2 * F, a->xe, d,
                                   gslot(m, grads, w->experts), d, expert_floats, a->offsets_d, E);
        be->gemm_grouped(be, 0, d, 2 * F, s->dgu, 2 * F, w->experts, d, expert_floats, s->dxe, d,
                         a->offsets_d, E, N);
        nl_lora_backward_gu(m, li, a->xe, s->dgu, s->dxe, a->offsets_d, N);
    }
    /* each token's input gradient is the sum over its k dispatch slots */
    be->zero(be, s->dxn, (size_t)N * d * sizeof(float));
    be->moe_combine(be, s->dxn, s->dxe, a->slot_d, s->ones, N, k, d);

    /* the router: through the renormalised weights and the aux loss (a
     * dense FFN has neither) */
    if (w->router) {
        be->moe_router_backward(be, s->dl, s->dw, a->probs, a->choice_d, a->w_d, a->frac_d, N, E, k,
                                aux_scale);
        if (!frozen)
            be->gemm(be, 1, 0, E, d, N, 1.0f, s->dl, E, a->xn2, d, 1.0f, gslot(m, grads, w->router),
                     d);
        be->gemm(be, 0, 0, N, d, E, 1.0f, s->dl, E, w->router, d, 1.0f, s->dxn, d);
    }

    /* dh1 = dy (residual) + ffn_norm backward */
    be->copy_rows(be, s->dh1, d, dy, d, N, d);
    be->rmsnorm_backward(be, s->dh1, gslot(m, grads, w->ffn_norm), s->dxn, a->h1, w->ffn_norm,
                         a->rstd2, N, d);
}

static void attention_backward(nl_model *m, int li, const nl_layer_acts *a,
                               nl_layer_grads_scratch *s, float *grads, float *dx, int B, int T,
                               int frozen)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const nl_layer_weights *w = &m->layers[li - m->l0];
    const int N = B * T, d = c->hidden_dim, hd = nl_config_head_dim(c);
    const int H = c->num_heads, G = c->num_kv_heads, qkv = (H + 2 * G) * hd, hq = H * hd;

    be->copy_rows(be, dx, d, s->dh1, d, N, d); /* residual */
    if (!frozen)
        be->gemm(be, 1, 0, d, hq, N, 1.0f, s->dh1, d, a->att, hq, 1.0f, gslot(m, grads, w->wo), hq);
    be->gemm(be, 0, 0, N, hq, d, 1.0f, s->dh1, d, w->wo, hq, 0.0f, s->datt, hq);
    nl_lora_backward_wo(m, li, a->att, s->dh1, s->datt, N); /* adapters, if any */
    nl_attn_shape sh = {.B = B, .T = T, .past = 0, .kv_cap = T, .H = H, .G = G, .hd = hd};
    const nl_attn_mask mk = nl_layer_mask(c, li, a->doc_d);
    float *dq = s->dqkv, *dk = s->dqkv + hq, *dv = s->dqkv + (H + G) * hd;
    const float *k = a->qkv + hq, *v = a->qkv + (H + G) * hd;
    if (mk.bidir || mk.window || mk.doc)
        be->attention_masked_backward(be, dq, dk, dv, s->datt, a->qkv, qkv, k, v, qkv, a->att,
                                      a->lse, sh, mk);
    else
        be->attention_backward(be, dq, dk, dv, s->datt, a->qkv, qkv, k, v, qkv, a->att, a->lse, sh);
    /* RoPE is a rotation (YaRN: times a scale): its backward rotates by
     * the negated angle */
    nl_layer_rope(be, c, s->dqkv, s->neg_pos_d, N);
    if (!frozen)
        be->gemm(be, 1, 0, qkv, d, N, 1.0f, s->dqkv, qkv, a->xn1, d, 1.0f, gslot(m, grads, w->wqkv),
                 d);
    be->gemm(be, 0, 0, N, d, qkv, 1.0f, s->dqkv, qkv, w->wqkv, d, 0.0f, s->dxn, d);
    nl_lora_backward_qkv(m, li, a->xn1, s->dqkv, s->dxn, N);
    be->rmsnorm_backward(be, dx, gslot(m, grads, w->attention_norm), s->dxn, a->x_in,
                         w->attention_norm, a->rstd1, N, d);
}

void nl_layer_backward(nl_model *m, int li, const nl_layer_acts *a, nl_layer_grads_scratch *s,
                       float *grads, const float *dy, float *dx, int B, int T, float aux_scale,
                       int frozen)
{
    moe_backward(m, li, a, s, grads, dy, B * T, aux_scale, frozen);
    attention_backward(m, li, a, s, grads, dx, B, T, frozen);
}
