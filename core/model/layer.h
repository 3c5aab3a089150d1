/* One transformer block (attention + mixture of experts) forward and
 * backward, over activation buffers the caller provides. The inference
 * forward (core/model/forward.c) passes one reused set with the residual stream
 * updated in place; training (core/train/train.c) passes one set per layer and
 * microbatch so the backward finds what the forward saved. */
#ifndef NL_LAYER_H
#define NL_LAYER_H

#include "core/model/kvcache.h"
#include "core/model/model.h"

/* Activations of one layer for N = B*T rows. Device pointers unless
 * marked host. In the inference set x_in, h1 and x_out are the same
 * buffer and rstd1, rstd2 and lse are NULL.
 *
 * Routing runs on the device (backend slot moe_route): no layer waits for
 * the host. With NL_HOST_ROUTING=1 in the environment when the set is
 * allocated (host_routing = 1), the forward routes as it did before the
 * routing slots existed, for comparison: it downloads the probabilities,
 * picks the top k on the host (the host arrays below), uploads the tables
 * and sizes each expert's GEMMs from host counts. Both ways give the same
 * bits on the CPU; the aux loss and the backward run on the device in both. */
typedef struct nl_layer_acts {
    float *x_in;  /* (N, d) layer input */
    float *xn1;   /* (N, d) attention_norm(x_in) */
    float *rstd1; /* (N) or NULL */
    float *qkv;   /* (N, (H + 2G) hd), q and k rotated */
    float *att;   /* (N, H hd) attention output */
    float *lse;   /* (B, H, T) or NULL */
    float *h1;    /* (N, d) x_in + att Wo^T */
    float *xn2;   /* (N, d) ffn_norm(h1) */
    float *rstd2; /* (N) or NULL */
    float *probs; /* (N, E) router softmax */
    float *xe;    /* (N k, d) expert inputs in dispatch order */
    float *gu;    /* (N k, 2F) gate | up */
    float *hs;    /* (N k, F) silu(gate) * up */
    float *ye;    /* (N k, d) expert outputs */
    float *x_out; /* (N, d) h1 + sum_i w_i expert_i */
    /* routing tables (backend.h, moe_route) */
    int32_t *choice_d;  /* (N k) expert of each (token, choice) */
    float *w_d;         /* (N k) renormalised weights */
    int32_t *perm_d;    /* (N k) token row of each dispatch slot, grouped by expert */
    int32_t *slot_d;    /* (N k) dispatch slot of each (token, choice) */
    int32_t *offsets_d; /* (E + 1) first slot of each expert */
    float *frac_d;      /* (E) assignment shares the aux loss used */
    double *aux_d;      /* (1) an aux-loss accumulator callers may use */
    int host_routing;   /* NL_HOST_ROUTING=1 at allocation */
    /* 1: with a cache, each sequence's past is read on the device from
     * the positions (pos_d[b T]) by the cache write (kv_store) and the
     * attention, so the queued work holds no position (a recorded step,
     * core/model/forward.c); the backend must have kv_store */
    int dev_past;
    /* 1: a forward of fewer than NL_BACKEND_FUSED_ROWS rows may take the
     * backend's fused decode slots (moe_norm_route, moe_gate_up,
     * moe_down_combine), which make no dispatch tables, no aux loss and no
     * counts: set by inference callers that read none of them */
    int fused;
    int fused_off; /* NL_FUSED=0 at allocation: never the fused slots */
    /* (N) document ids of packed rows (backend.h, nl_attn_mask), or NULL:
     * set by the caller before the forward; the backward reads it too */
    const int32_t *doc_d;
    /* host: the routing of host_routing mode */
    float *probs_h;   /* (N, E) */
    int32_t *choice;  /* (N k) */
    float *w;         /* (N k) */
    int32_t *perm;    /* (N k) */
    int32_t *slot;    /* (N k) */
    int32_t *offsets; /* (E + 1) */
} nl_layer_acts;

/* Floats of device memory one layer's saved activations take for N rows
 * (training layout, with separate residual buffers). */
size_t nl_layer_acts_floats(const nl_config *cfg, int N);

/* Allocate a set for N rows; `training` gives separate residual buffers
 * and the saved statistics, else x_in == h1 == x_out and no rstd/lse. A
 * dense FFN's probs are set to 1 here, once (it has no router).
 * Reads NL_HOST_ROUTING. nl_layer_acts_free releases what _alloc made
 * (NULL-safe fields). */
nl_status nl_layer_acts_alloc(nl_layer_acts *a, nl_backend *be, const nl_config *cfg, int N,
                              int training, nl_error *err);
void nl_layer_acts_free(nl_layer_acts *a, nl_backend *be);

/* Where a layer's forward puts its load-balancing loss; device pointers. */
typedef struct nl_layer_aux {
    /* (E) batch-level assignment shares the aux loss uses instead of this
     * call's own, or NULL */
    const float *global_frac;
    /* rows the loss is averaged over: N for a plain forward, the batch's
     * rows when this is one microbatch of many */
    double rows;
    /* (1) += this layer's aux loss E * sum_e frac_e * sum_n p[n, e] / rows,
     * or NULL */
    double *sum;
    /* (E) += tokens routed to each expert, or NULL */
    int64_t *counts;
} nl_layer_aux;

/* Forward one layer `li` of the model over a->x_in, writing a->x_out.
 * pos_d: (N) device positions (restarting per document in packed rows).
 * kv may be NULL. aux NULL: this call's own shares over N rows, the loss
 * added to a->aux_d. Queues device work only
 * (no host synchronisation unless a->host_routing). */
void nl_layer_forward(nl_model *m, int li, nl_layer_acts *a, int B, int T, int past, nl_kvcache *kv,
                      const int32_t *pos_d, const nl_layer_aux *aux);

/* The feed-forward half alone (ffn_norm, router, experts, combine) over
 * a->h1 for N rows, writing a->x_out (its aux loss goes to a->aux_d, unread).
 * The batched decoder (core/model/batch.c) runs its own attention (per
 * sequence, or one call over each run of decoding sequences) and then this
 * over the whole batch. */
void nl_layer_ffn_forward(nl_model *m, int li, nl_layer_acts *a, int N);

/* RoPE on the q and k heads of qkv (N, (H + 2G) hd) at positions pos_d,
 * with the config's scaling (YaRN) if any; negated positions invert it. */
void nl_layer_rope(nl_backend *be, const nl_config *c, float *qkv, const int32_t *pos_d, int N);

/* The attention mask of layer li (DESIGN section 6): bidirectional when
 * not causal, the window when the layer is local, and the documents. */
nl_attn_mask nl_layer_mask(const nl_config *c, int li, const int32_t *doc_d);

/* Scratch for the backward pass of one layer over N rows (device unless
 * marked host), shared by every layer of a stage. */
typedef struct nl_layer_grads_scratch {
    float *dh1;         /* (N, d) */
    float *dxn;         /* (N, d) */
    float *dqkv;        /* (N, (H + 2G) hd) */
    float *datt;        /* (N, H hd) */
    float *dye;         /* (N k, d) */
    float *dhs;         /* (N k, F) */
    float *dgu;         /* (N k, 2F) */
    float *dxe;         /* (N k, d) */
    float *dw;          /* (N k) */
    float *ones;        /* (N k) all 1 */
    float *dl;          /* (N, E) router logits gradient */
    int32_t *neg_pos_d; /* (N) negated positions: RoPE's inverse rotation */
} nl_layer_grads_scratch;

nl_status nl_layer_scratch_alloc(nl_layer_grads_scratch *s, nl_backend *be, const nl_config *cfg,
                                 int N, nl_error *err);
void nl_layer_scratch_free(nl_layer_grads_scratch *s, nl_backend *be);
size_t nl_layer_scratch_floats(const nl_config *cfg, int N);

/* Backward of layer li over the activations its forward saved in a:
 * given dy = dLoss/dx_out (N, d), write dx = dLoss/dx_in (N, d) (dx must
 * not alias dy) and add the parameter gradients into `grads` (same layout
 * as m->params). neg_pos_d in the scratch must hold -position of each row.
 * aux_scale = aux_loss_coef * E / (rows in the whole batch): the gradient
 * of the loss with respect to each router probability through the aux
 * term is aux_scale * frac_e.
 * frozen 1 (a LoRA fine-tune: the base weights do not train): the weight
 * gradients of the base's matrices (wqkv, wo, the router, every expert's
 * gate|up and down: dW = dY^T X) are not computed and their slices of
 * grads are left as they were; dx, the adapters' gradients (m->lora) and
 * the RMSNorm gains' (fused into the norms' backward, O(N d)) are as with
 * frozen 0, bit for bit. */
void nl_layer_backward(nl_model *m, int li, const nl_layer_acts *a, nl_layer_grads_scratch *s,
                       float *grads, const float *dy, float *dx, int B, int T, float aux_scale,
                       int frozen);
#endif
