/* The model of one pipeline stage: the parameters of layers [l0, l1), plus
 * the embedding when the stage is first and the final norm and head when
 * it is last. A whole model is the stage [0, L) with both.
 *
 * Parameters live in one backend allocation, handed out as slices. The
 * named table maps each checkpoint name of DESIGN.md section 2 to its
 * slice. In memory, a layer's wq, wk and wv are adjacent (one fused
 * (H + 2G) hd x d matrix) and each expert's w_gate and w_up are adjacent
 * (one 2F x d matrix), so each is one GEMM; the names still address the
 * parts.
 *
 * Ownership: nl_model_new returns a model the caller frees with
 * nl_model_destroy(&m); the backend is borrowed and must outlive it. */
#ifndef NL_MODEL_H
#define NL_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "core/model/config.h"
#include "kernels/backend.h"

#define NL_PARAM_NAME_MAX 96

typedef enum nl_param_kind {
    NL_PARAM_MATRIX = 0, /* weight decay applies */
    NL_PARAM_NORM,       /* RMSNorm gain: init 1, no decay */
    NL_PARAM_TABLE,      /* vocabulary table: rows grow with the vocabulary */
} nl_param_kind;

typedef struct nl_param {
    char name[NL_PARAM_NAME_MAX];
    nl_param_kind kind;
    int ndim;         /* 1 or 2 */
    int64_t shape[2]; /* [out, in] or [d] */
    size_t offset;    /* in floats from the start of the block */
    float init_std;   /* matrices and tables: normal(0, init_std) */
} nl_param;

typedef struct nl_layer_weights {
    float *attention_norm; /* (d) */
    float *wqkv;           /* ((H + 2G) hd, d): wq rows, then wk, then wv */
    float *wo;             /* (d, H hd) */
    float *ffn_norm;       /* (d) */
    float *router;         /* (E, d) */
    float *experts;        /* E blocks of [w_gate (F, d); w_up (F, d); w_down (d, F)] */
} nl_layer_weights;

typedef struct nl_lora nl_lora;     /* core/model/lora.h */
typedef struct nl_growth nl_growth; /* core/grow/grow.h */

typedef struct nl_model {
    nl_config cfg;
    int l0, l1;       /* layers held: [l0, l1) */
    int has_embed;    /* holds tok_embeddings (first stage) */
    int has_head;     /* holds norm and lm_head (last stage) */
    int64_t capacity; /* table rows C */
    nl_backend *be;   /* borrowed */
    float *params;    /* one device allocation of n_params floats */
    size_t n_params;
    nl_param *table; /* n_table named slices, in checkpoint order */
    int n_table;
    float *tok_embeddings;    /* (C, d) or NULL */
    nl_layer_weights *layers; /* l1 - l0 entries */
    float *norm;              /* (d) or NULL */
    float *lm_head;           /* (C, d) or NULL */
    float *classifier;        /* (num_classes, d) with the head when num_classes > 0, or NULL */
    nl_lora *lora;            /* attached adapters (core/model/lora.h, which owns them), or NULL */
    nl_growth *growth;        /* growth history, oldest first (core/grow/grow.h), owned; or NULL */
    int n_growth;
    /* Unique in the process, new whenever the buffers or shapes the
     * forward reads change (nl_model_new, growth): a step recorded for the
     * model (core/model/forward.c's graphs) is recorded again when it moved.
     * Writes into the weights (a load, an optimizer step) keep it: a
     * recorded step reads them when it runs. */
    uint64_t generation;
} nl_model;

/* Give m a new generation (after a change of its buffers or shapes made
 * in place). */
void nl_model_changed(nl_model *m);

/* Build the stage [l0, l1) with zeroed parameters. The config must pass
 * nl_config_validate with require_size. */
nl_status nl_model_new(nl_model **out, nl_backend *be, const nl_config *cfg, int l0, int l1,
                       int has_embed, int has_head, nl_error *err);
void nl_model_destroy(nl_model **m);

/* Initialise every parameter as DESIGN.md section 2 says: normal(0, 0.02)
 * for matrices and tables, wo and w_down scaled by 1/sqrt(2L), norms 1.
 * Each tensor draws from its own stream (seed, name), and tables from one
 * stream per vocab_chunk block of rows, so a stage or a grown table gets
 * exactly the values a whole-model init with the same seed gives. */
nl_status nl_model_init_random(nl_model *m, uint64_t seed, nl_error *err);

/* Initialise one parameter of the table as nl_model_init_random does. */
nl_status nl_model_init_param(nl_model *m, const nl_param *p, uint64_t seed, nl_error *err);

/* Fill rows [row0, row1) of a table parameter from its per-block streams
 * (used by init and by vocabulary growth). dst is host memory for those
 * rows. */
void nl_model_init_table_rows(const nl_param *p, uint64_t seed, int64_t vocab_chunk, int64_t row0,
                              int64_t row1, float *dst);

/* The named slice, or NULL. */
const nl_param *nl_model_find_param(const nl_model *m, const char *name);
/* Device pointer of a named slice. */
static inline float *nl_model_param_data(const nl_model *m, const nl_param *p)
{
    return m->params + p->offset;
}
static inline size_t nl_param_numel(const nl_param *p)
{
    return (size_t)p->shape[0] * (size_t)(p->ndim == 2 ? p->shape[1] : 1);
}

/* Parameter count of a whole model with this config (all layers, both
 * tables, norm). */
int64_t nl_config_param_count(const nl_config *cfg);

/* Grow the active vocabulary of a stage to vocab_size (>= the current).
 * When it passes the capacity C, tok_embeddings and lm_head grow to the
 * next multiple of vocab_chunk: old rows stay bit-identical, new rows are
 * drawn from their per-block streams of `seed` as nl_model_init_random
 * would, and every buffer in `moments` (device, n_moments of them, laid
 * out like the parameters; may be NULL) is re-laid out the same way with
 * zeros in the new rows. Other parameters are untouched, so logits over
 * the old vocabulary do not change. The model's parameter block (and the
 * moment buffers) are replaced; pointers into the old ones are stale. */
nl_status nl_model_grow_vocab(nl_model *m, int64_t vocab_size, uint64_t seed, float **moments,
                              int n_moments, nl_error *err);

/* Matrix FLOPs of a forward pass of a whole model over B sequences of T
 * new positions after `past` cached ones: projections, routed experts
 * (top_k per token), router, attention scores and values (causal), and
 * the head over the active vocabulary. */
double nl_config_forward_flops(const nl_config *cfg, int B, int T, int past);

#endif
