/* The model config: the keys and defaults of DESIGN.md section 2, read
 * from YAML (libyaml) or from the JSON stored in a checkpoint, validated
 * with errors that name the key at fault. */
#ifndef NL_CONFIG_H
#define NL_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "core/train/objective.h"
#include "kernels/backend.h"

typedef struct nl_config {
    int64_t vocab_size;   /* active vocabulary; default NL_DEFAULT_VOCAB */
    int64_t vocab_chunk;  /* table rows grow in multiples of this; 32768 */
    int hidden_dim;       /* d; 0 = to be sized by the coordinator */
    int num_layers;       /* L; 0 = to be sized by the coordinator */
    int num_heads;        /* H; default d / 64 */
    int num_kv_heads;     /* G; default max(1, H / 4) */
    int ffn_dim;          /* F; default 4 d */
    int num_experts;      /* E; default 8 */
    int top_k;            /* default 2 */
    int max_seq_len;      /* default 2048 */
    double rope_base;     /* default 10000 */
    double norm_eps;      /* default 1e-6 */
    double aux_loss_coef; /* default 0.01 */
    /* The variants of DESIGN.md section 6; the defaults give section 2. */
    int causal;                   /* 1: decoder (default); 0: bidirectional encoder */
    int ffn_act;                  /* NL_FFN_SWIGLU (default) or NL_FFN_GEGLU */
    int attention_window;         /* W > 0: local layers; 0: global (default) */
    int global_every;             /* with a window, layer l is global when l % n == 0; 1;
                                   * 0: no layer is global (Mistral's sliding window) */
    nl_rope_scaling rope_scaling; /* type NL_ROPE_NONE (default) or NL_ROPE_YARN */
    int objective;                /* NL_OBJ_CLM (default) or NL_OBJ_MLM */
    double mask_prob;             /* mlm: share of positions masked; 0.3 */
    int num_classes;              /* K > 0: classifier.weight [K, d] on mean-pooled states; 0 */
} nl_config;

/* The masked-LM mask id: the tokenizer's reserved <|pad|> (258), which
 * encoding never emits (core/tokenizer/tokenizer.h, NL_TOKEN_PAD). */
#define NL_CONFIG_MASK_ID 258

/* ffn_act */
enum { NL_FFN_SWIGLU = 0, NL_FFN_GEGLU = 1 };

/* Dense FFN (DESIGN 6): one expert, no router tensor, no aux loss. */
static inline int nl_config_dense(const nl_config *c)
{
    return c->num_experts == 1;
}

/* Whether layer l attends within the window (DESIGN 6). */
static inline int nl_config_layer_local(const nl_config *c, int l)
{
    return c->attention_window > 0 && (c->global_every == 0 || l % c->global_every != 0);
}

/* Vocabulary used when neither the config nor a tokenizer gives one: the
 * 256 byte values. */
#define NL_DEFAULT_VOCAB 256

/* Hard upper bounds accepted from any file, so that a hostile config
 * cannot ask for absurd allocations. */
#define NL_CONFIG_MAX_DIM 65536
#define NL_CONFIG_MAX_LAYERS 4096
#define NL_CONFIG_MAX_EXPERTS 256
#define NL_CONFIG_MAX_VOCAB (1LL << 26)
#define NL_CONFIG_MAX_SEQ (1 << 20)
#define NL_CONFIG_MAX_HEAD_DIM NL_BACKEND_MAX_HEAD_DIM /* what the kernels support */

/* Every field unset (0); rope_base, norm_eps, aux_loss_coef, vocab_chunk,
 * num_experts, top_k, max_seq_len, causal, global_every get their
 * defaults. */
void nl_config_init(nl_config *cfg);

/* Fill the defaults that derive from other keys (H from d, G from H, F
 * from d, vocab_size) where they are still unset. Needs hidden_dim. */
void nl_config_fill_derived(nl_config *cfg);

/* Check every rule; the message names the key, e.g.
 * "num_kv_heads: 3 does not divide num_heads 8". `require_size` demands
 * hidden_dim and num_layers (a model to build, not one to be sized). */
nl_status nl_config_validate(const nl_config *cfg, int require_size, nl_error *err);

/* Parse YAML text / a YAML file: a flat mapping of the keys above.
 * Unknown keys and wrong types are errors naming the key. Defaults are
 * filled and the result validated (with require_size = 0). */
nl_status nl_config_parse_yaml(nl_config *cfg, const char *text, size_t len, nl_error *err);
nl_status nl_config_load_yaml(nl_config *cfg, const char *path, nl_error *err);

/* JSON form stored in checkpoint metadata. nl_config_to_json returns a
 * malloc'd string the caller frees. */
char *nl_config_to_json(const nl_config *cfg);
nl_status nl_config_from_json(nl_config *cfg, const char *json, nl_error *err);

/* Derived sizes. */
static inline int nl_config_head_dim(const nl_config *c)
{
    return c->hidden_dim / c->num_heads;
}
/* Capacity rows C = ceil(vocab_size / vocab_chunk) * vocab_chunk. */
static inline int64_t nl_config_capacity(const nl_config *c)
{
    return (c->vocab_size + c->vocab_chunk - 1) / c->vocab_chunk * c->vocab_chunk;
}

#endif
