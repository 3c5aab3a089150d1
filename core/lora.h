/* Low-rank adapters (DESIGN.md section 6, LoRA) on a frozen model's
 * attention maps: for each target W [out, in] of each layer the stage
 * holds, y = x W^T + (alpha / r) (x A^T) B^T with A [r, in] drawn from a
 * normal of standard deviation 1 / r and B [out, r] zero. The adapters'
 * parameters, gradients and AdamW moments live in one block of their own,
 * so a trainer steps only them and the base stays bit-identical.
 *
 * Targets here: wq, wk, wv, wo (the expert matrices are not adapted yet).
 * Names: "<base name without .weight>.lora_A.weight" and ".lora_B.weight".
 *
 * Ownership: nl_lora_new borrows the model (which must outlive the
 * adapters); nl_lora_destroy(&lo) frees them and detaches them from the
 * model. */
#ifndef NL_LORA_H
#define NL_LORA_H

#include "model.h"

enum { NL_LORA_WQ = 1, NL_LORA_WK = 2, NL_LORA_WV = 4, NL_LORA_WO = 8 };
#define NL_LORA_MAX_RANK 1024

typedef struct nl_lora_map {
    float *A, *B; /* (r, in), (out, r) device, in the parameter block */
    int in, out;  /* of the base map */
    int col0;     /* wq/wk/wv: first column of its part of the fused qkv row */
} nl_lora_map;

struct nl_lora {
    nl_model *m;       /* borrowed */
    int rank, targets; /* NL_LORA_* bits */
    float alpha;
    float *params, *grads, *mom[2]; /* device, n_params each */
    size_t n_params;
    nl_param *table; /* n_table named slices of params */
    int n_table;
    nl_lora_map *maps; /* (l1 - l0) x 4: wq, wk, wv, wo; A NULL when not a target */
    int max_rows;
    float *u, *du; /* (max_rows, r) scratch of the forward and backward */
};

/* Adapters of rank r for the targets (NL_LORA_* bits) of every layer of m,
 * zeroed, with scratch for max_rows rows; attached to m (m->lora), so
 * every forward and backward of m applies them. */
nl_status nl_lora_new(nl_lora **out, nl_model *m, int rank, float alpha, int targets, int max_rows,
                      nl_error *err);
void nl_lora_destroy(nl_lora **lo);

/* A from normal(0, 1/r) per tensor stream (seed, name), B zero. */
nl_status nl_lora_init_random(nl_lora *lo, uint64_t seed, nl_error *err);

/* Parse "wq,wk,wv,wo" into NL_LORA_* bits. */
nl_status nl_lora_parse_targets(const char *s, int *targets, nl_error *err);

/* Adapter files: the A and B tensors, metadata format neurollm-lora/1,
 * rank, alpha, targets and base_sha256 (the base checkpoint's SHA-256). */
nl_status nl_lora_save(const nl_lora *lo, const char *path, const char *base_sha256, nl_error *err);
/* Load an adapter file onto m (attached); max_rows as nl_lora_new. */
nl_status nl_lora_load(nl_lora **out, nl_model *m, const char *path, int max_rows, nl_error *err);

/* Fold the adapters into the base weights: W += (alpha / r) B A. */
nl_status nl_lora_merge(nl_lora *lo, nl_error *err);

/* Layer hooks (core/layer.c, layer_backward.c): no-ops without adapters. */
void nl_lora_forward_qkv(const nl_model *m, int li, const float *xn, float *qkv, int N);
void nl_lora_forward_wo(const nl_model *m, int li, const float *att, float *h1, int N);
void nl_lora_backward_qkv(const nl_model *m, int li, const float *xn, const float *dqkv, float *dxn,
                          int N);
void nl_lora_backward_wo(const nl_model *m, int li, const float *att, const float *dh1, float *datt,
                         int N);

#endif
