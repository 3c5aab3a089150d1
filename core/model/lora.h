/* Low-rank adapters (DESIGN.md section 6, LoRA) on a frozen model's
 * linear maps: for each target W [out, in] of each layer the stage
 * holds, y = x W^T + (alpha / r) (x A^T) B^T with A [r, in] drawn from a
 * normal of standard deviation 1 / r and B [out, r] zero. The adapters'
 * parameters, gradients and AdamW moments live in one block of their own,
 * so a trainer steps only them and the base stays bit-identical.
 *
 * Targets: wq, wk, wv, wo, and the experts' w_gate, w_up, w_down (each
 * expert of the layer its own adapter; a dense FFN's one expert likewise).
 * Names: "<base name without .weight>.lora_A.weight" and ".lora_B.weight".
 * An expert target's adapters sit at one stride per expert (A_e, B_e
 * adjacent), so the grouped GEMMs of the expert dispatch run them without
 * host counts, as the base experts run.
 *
 * A model with a classification head (num_classes, on this stage) also
 * trains the head with the adapters, as PEFT's sequence classification
 * does (a head left at its random initialisation caps what adapters can
 * learn): the block holds a copy "classifier.weight" [K, d], the model's
 * classifier pointer points at it while the adapters are attached, and the
 * adapter file carries it (a file without it keeps the base's head).
 *
 * Ownership: nl_lora_new borrows the model (which must outlive the
 * adapters); nl_lora_destroy(&lo) frees them and detaches them from the
 * model. */
#ifndef NL_LORA_H
#define NL_LORA_H

#include "core/model/model.h"

enum {
    NL_LORA_WQ = 1,
    NL_LORA_WK = 2,
    NL_LORA_WV = 4,
    NL_LORA_WO = 8,
    NL_LORA_W_GATE = 16,
    NL_LORA_W_UP = 32,
    NL_LORA_W_DOWN = 64,
    NL_LORA_EXPERTS = NL_LORA_W_GATE | NL_LORA_W_UP | NL_LORA_W_DOWN
};
#define NL_LORA_MAX_RANK 1024
#define NL_LORA_MAX_ALPHA 1e6 /* alpha in (0, this]: finite, as a request's params.lora_alpha */

typedef struct nl_lora_map {
    float *A, *B;  /* (r, in), (out, r) device, in the parameter block */
    int in, out;   /* of the base map */
    int col0;      /* wq/wk/wv: first column of its part of the fused qkv row */
    size_t stride; /* experts: floats from expert e's A (and B) to expert e + 1's */
} nl_lora_map;

struct nl_lora {
    nl_model *m;       /* borrowed */
    int rank, targets; /* NL_LORA_* bits */
    float alpha;
    float *params, *grads, *mom[2]; /* device, n_params each */
    size_t n_params;
    nl_param *table; /* n_table named slices of params */
    int n_table;
    nl_lora_map *maps;  /* (l1 - l0) x 4: wq, wk, wv, wo; A NULL when not a target */
    nl_lora_map *emaps; /* (l1 - l0) x 3: expert 0's w_gate, w_up, w_down */
    int max_rows;
    float *u, *du; /* (max_rows, r), (max_rows top_k, r) with expert targets: scratch */
    /* expert targets only, over the max_rows top_k dispatch rows: products
     * (t) and scaled gradients (sg), (rows, max(2F, d)); the identity
     * slots, alpha / r and ones that moe_combine needs to add rows */
    float *t, *sg, *svec, *ones;
    int32_t *iota;
    float *classifier;      /* the trained head in params, or NULL */
    float *base_classifier; /* the model's own head, restored on detach */
};

/* Adapters of rank r for the targets (NL_LORA_* bits) of every layer of m,
 * zeroed, with scratch for max_rows rows; attached to m (m->lora), so
 * every forward and backward of m applies them. */
nl_status nl_lora_new(nl_lora **out, nl_model *m, int rank, float alpha, int targets, int max_rows,
                      nl_error *err);
void nl_lora_destroy(nl_lora **lo);
/* Grow the scratch for forwards of up to rows rows (nothing to do when
 * it holds that many already). */
nl_status nl_lora_reserve(nl_lora *lo, int rows, nl_error *err);

/* A from normal(0, 1/r) per tensor stream (seed, name), B zero. */
nl_status nl_lora_init_random(nl_lora *lo, uint64_t seed, nl_error *err);

/* Parse "wq,wk,wv,wo,w_gate,w_up,w_down" (any of them) into NL_LORA_* bits. */
nl_status nl_lora_parse_targets(const char *s, int *targets, nl_error *err);

/* Adapter files: the A and B tensors, metadata format neurollm-lora/1,
 * rank, alpha, targets and base_sha256 (the base checkpoint's SHA-256). */
nl_status nl_lora_save(const nl_lora *lo, const char *path, const char *base_sha256, nl_error *err);
/* Whether the adapter file at path may be applied to the checkpoint at
 * base_path: NL_OK when its base_sha256 is that file's SHA-256, or when it
 * names no base (an adapter written without one) or base_path is not a
 * regular file (a checkpoint directory: nothing to compare);
 * NL_ERR_INTEGRITY naming both hashes when it names another checkpoint;
 * NL_ERR_FORMAT when base_sha256 is not 64 hex digits; a read error of
 * either file otherwise. */
nl_status nl_lora_check_base(const char *path, const char *base_path, nl_error *err);
/* The same for n adapter files, the base hashed at most once (when one of
 * them names a base); the first that fails is named. */
nl_status nl_lora_check_bases(const char *const *paths, int n, const char *base_path,
                              nl_error *err);
/* The same, with the base's SHA-256 in hex (lower case) where it is
 * known; "" there: hashed here when an adapter names a base, and left in
 * hex (to keep for the next check of the same file). */
nl_status nl_lora_check_bases_hex(const char *const *paths, int n, const char *base_path,
                                  char hex[65], nl_error *err);
/* Load an adapter file onto m (attached); max_rows as nl_lora_new. */
nl_status nl_lora_load(nl_lora **out, nl_model *m, const char *path, int max_rows, nl_error *err);

/* Fold the adapters into the base weights: W += (alpha / r) B A (every
 * expert's own for expert targets); the head, if any, becomes the trained
 * one. */
nl_status nl_lora_merge(nl_lora *lo, nl_error *err);

/* The gradient of a weight w inside the adapters' block (the trained head),
 * or NULL when w is not there (a base weight). */
float *nl_lora_grad_of(const nl_model *m, const float *w);

/* Layer hooks (core/model/layer.c, layer_backward.c): no-ops without adapters. */
void nl_lora_forward_qkv(const nl_model *m, int li, const float *xn, float *qkv, int N);
void nl_lora_forward_wo(const nl_model *m, int li, const float *att, float *h1, int N);
void nl_lora_backward_qkv(const nl_model *m, int li, const float *xn, const float *dqkv, float *dxn,
                          int N);
void nl_lora_backward_wo(const nl_model *m, int li, const float *att, const float *dh1, float *datt,
                         int N);

/* Expert hooks over a grouped dispatch of N tokens (N top_k rows, grouped
 * by the device offsets of moe_route): xe, gu, hs, ye and their gradients
 * as in core/model/layer.c. 1 when m has expert adapters (the layer then takes
 * the unfused expert path, where these hooks sit). */
int nl_lora_on_experts(const nl_model *m);
/* gu += s [xe A_gate^T B_gate^T | xe A_up^T B_up^T], before the activation */
void nl_lora_forward_gu(const nl_model *m, int li, const float *xe, float *gu,
                        const int32_t *offsets, int N);
/* ye += s hs A_down^T B_down^T */
void nl_lora_forward_down(const nl_model *m, int li, const float *hs, float *ye,
                          const int32_t *offsets, int N);
/* One expert e's n rows in a host-routed layer, as the two above: with
 * down 0, y (n, 2F) = gu gets the w_gate and w_up terms of x = xe; with
 * down 1, y (n, d) = ye gets w_down's of x = hs. */
void nl_lora_forward_expert(const nl_model *m, int li, int e, const float *x, float *y, int n,
                            int down);
/* Given dye: the adapters' gradients of w_down, and dhs += its share (before
 * the activation's backward). */
void nl_lora_backward_down(const nl_model *m, int li, const float *hs, const float *dye, float *dhs,
                           const int32_t *offsets, int N);
/* Given dgu: the gradients of w_gate's and w_up's adapters, and dxe += their
 * share (after dxe = dgu W_gu). */
void nl_lora_backward_gu(const nl_model *m, int li, const float *xe, const float *dgu, float *dxe,
                         const int32_t *offsets, int N);

#endif
