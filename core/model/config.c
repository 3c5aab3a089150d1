/* Model config: defaults, derived keys and validation. YAML and JSON
 * parsing live in config_io.c. */
#include "core/model/config.h"

#include <math.h>
#include <string.h>

void nl_config_init(nl_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->vocab_chunk = 32768;
    cfg->num_experts = 8;
    cfg->top_k = 2;
    cfg->max_seq_len = 2048;
    cfg->rope_base = 10000.0;
    cfg->norm_eps = 1e-6;
    cfg->aux_loss_coef = 0.01;
    cfg->causal = 1;
    cfg->global_every = 1;
    cfg->rope_scaling.beta_fast = 32.0;
    cfg->rope_scaling.beta_slow = 1.0;
    cfg->mask_prob = 0.3;
}

void nl_config_fill_derived(nl_config *cfg)
{
    if (cfg->vocab_size == 0)
        cfg->vocab_size = NL_DEFAULT_VOCAB;
    /* Out of range: left for nl_config_validate to refuse (4 d would
     * overflow an int). */
    if (cfg->hidden_dim <= 0 || cfg->hidden_dim > NL_CONFIG_MAX_DIM)
        return;
    if (cfg->num_heads == 0)
        cfg->num_heads = cfg->hidden_dim / 64 > 0 ? cfg->hidden_dim / 64 : 1;
    if (cfg->num_kv_heads == 0)
        cfg->num_kv_heads = cfg->num_heads / 4 > 0 ? cfg->num_heads / 4 : 1;
    if (cfg->ffn_dim == 0)
        cfg->ffn_dim = 4 * cfg->hidden_dim;
}

#define BAD(...) return nl_error_set(err, NL_ERR_INVALID, __VA_ARGS__)

/* The keys of DESIGN.md section 6. */
static nl_status validate_variants(const nl_config *c, nl_error *err)
{
    if (c->causal != 0 && c->causal != 1)
        BAD("causal: %d must be true or false", c->causal);
    if (c->ffn_act != NL_FFN_SWIGLU && c->ffn_act != NL_FFN_GEGLU)
        BAD("ffn_act: %d is neither swiglu nor geglu", c->ffn_act);
    if (c->num_experts == 1 && c->top_k != 1)
        BAD("top_k: a dense FFN (num_experts 1) takes top_k 1, not %d", c->top_k);
    if (c->attention_window < 0 || c->attention_window > NL_CONFIG_MAX_SEQ)
        BAD("attention_window: %d is outside 0..%d", c->attention_window, NL_CONFIG_MAX_SEQ);
    if (c->global_every < 0 || c->global_every > NL_CONFIG_MAX_LAYERS)
        BAD("global_every: %d is outside 0..%d", c->global_every, NL_CONFIG_MAX_LAYERS);
    if (c->num_classes < 0 || c->num_classes > NL_CONFIG_MAX_DIM)
        BAD("num_classes: %d is outside 0..%d", c->num_classes, NL_CONFIG_MAX_DIM);
    if (c->objective != NL_OBJ_CLM && c->objective != NL_OBJ_MLM)
        BAD("objective: %d is neither clm nor mlm", c->objective);
    if (!(c->mask_prob > 0.0) || !(c->mask_prob <= 1.0))
        BAD("mask_prob: %g must be in (0, 1]", c->mask_prob);
    if (c->objective == NL_OBJ_MLM && c->vocab_size <= NL_CONFIG_MASK_ID)
        BAD("objective: mlm needs vocab_size above the mask id %d (<|pad|>), not %lld",
            NL_CONFIG_MASK_ID, (long long)c->vocab_size);
    const nl_rope_scaling *r = &c->rope_scaling;
    if (r->type == NL_ROPE_NONE) { /* nothing of yarn's: it would be lost unsaid on the way out */
        if (r->factor != 0.0 || r->original_max_seq_len != 0 || r->beta_fast != 32.0 ||
            r->beta_slow != 1.0)
            BAD("rope_scaling: factor, original_max_seq_len, beta_fast and beta_slow apply to "
                "type yarn only, and the type is none");
        return NL_OK;
    }
    if (r->type != NL_ROPE_YARN)
        BAD("rope_scaling: type %d is not yarn", r->type);
    if (!(r->factor >= 1.0) || !(r->factor <= 1e6))
        BAD("rope_scaling: factor %g must be in 1..1e6", r->factor);
    if (r->original_max_seq_len < 1 || r->original_max_seq_len > NL_CONFIG_MAX_SEQ)
        BAD("rope_scaling: original_max_seq_len %d is outside 1..%d", r->original_max_seq_len,
            NL_CONFIG_MAX_SEQ);
    if (!isfinite(r->beta_fast) || !isfinite(r->beta_slow) || !(r->beta_fast > r->beta_slow))
        BAD("rope_scaling: beta_fast %g must be above beta_slow %g", r->beta_fast, r->beta_slow);
    return NL_OK;
}

nl_status nl_config_validate(const nl_config *c, int require_size, nl_error *err)
{
    if (c->vocab_size < 1 || c->vocab_size > NL_CONFIG_MAX_VOCAB)
        BAD("vocab_size: %lld is outside 1..%lld", (long long)c->vocab_size,
            (long long)NL_CONFIG_MAX_VOCAB);
    if (c->vocab_chunk < 1 || c->vocab_chunk > NL_CONFIG_MAX_VOCAB)
        BAD("vocab_chunk: %lld is outside 1..%lld", (long long)c->vocab_chunk,
            (long long)NL_CONFIG_MAX_VOCAB);
    if (c->num_experts < 1 || c->num_experts > NL_CONFIG_MAX_EXPERTS)
        BAD("num_experts: %d is outside 1..%d", c->num_experts, NL_CONFIG_MAX_EXPERTS);
    if (c->top_k < 1 || c->top_k > c->num_experts)
        BAD("top_k: %d must be in 1..num_experts (%d)", c->top_k, c->num_experts);
    if (c->max_seq_len < 1 || c->max_seq_len > NL_CONFIG_MAX_SEQ)
        BAD("max_seq_len: %d is outside 1..%d", c->max_seq_len, NL_CONFIG_MAX_SEQ);
    if (!(c->rope_base > 1.0) || !isfinite(c->rope_base))
        BAD("rope_base: %g must be a finite number above 1", c->rope_base);
    if (!(c->norm_eps > 0.0) || !(c->norm_eps < 1.0))
        BAD("norm_eps: %g must be in (0, 1)", c->norm_eps);
    if (!(c->aux_loss_coef >= 0.0) || !isfinite(c->aux_loss_coef))
        BAD("aux_loss_coef: %g must be a finite number >= 0", c->aux_loss_coef);
    nl_status st = validate_variants(c, err);
    if (st != NL_OK)
        return st;
    /* 0 means "derive from hidden_dim"; a negative value is never valid,
     * even in a config still to be sized. */
    if (c->num_heads < 0)
        BAD("num_heads: %d must not be negative", c->num_heads);
    if (c->num_kv_heads < 0)
        BAD("num_kv_heads: %d must not be negative", c->num_kv_heads);
    if (c->ffn_dim < 0)
        BAD("ffn_dim: %d must not be negative", c->ffn_dim);
    if (c->hidden_dim == 0 && c->num_layers == 0 && !require_size)
        return NL_OK;                             /* to be sized by the coordinator */
    if (c->hidden_dim == 0 || c->num_layers == 0) /* not given (YAML refuses an explicit 0) */
        BAD("%s: missing: the model's size is needed here (hidden_dim and num_layers; a "
            "coordinator sizes a config without them)",
            c->hidden_dim == 0 ? "hidden_dim" : "num_layers");
    if (c->hidden_dim < 1 || c->hidden_dim > NL_CONFIG_MAX_DIM)
        BAD("hidden_dim: %d is outside 1..%d", c->hidden_dim, NL_CONFIG_MAX_DIM);
    if (c->num_layers < 1 || c->num_layers > NL_CONFIG_MAX_LAYERS)
        BAD("num_layers: %d is outside 1..%d", c->num_layers, NL_CONFIG_MAX_LAYERS);
    if (c->num_heads < 1 || c->num_heads > c->hidden_dim)
        BAD("num_heads: %d is outside 1..hidden_dim (%d)", c->num_heads, c->hidden_dim);
    if (c->hidden_dim % c->num_heads != 0)
        BAD("num_heads: %d does not divide hidden_dim %d", c->num_heads, c->hidden_dim);
    int hd = c->hidden_dim / c->num_heads;
    if (hd % 2 != 0)
        BAD("num_heads: head_dim = hidden_dim / num_heads = %d must be even (RoPE rotates pairs)",
            hd);
    if (hd > NL_CONFIG_MAX_HEAD_DIM)
        BAD("num_heads: head_dim = %d is above the supported %d", hd, NL_CONFIG_MAX_HEAD_DIM);
    if (c->num_kv_heads < 1 || c->num_kv_heads > c->num_heads)
        BAD("num_kv_heads: %d is outside 1..num_heads (%d)", c->num_kv_heads, c->num_heads);
    if (c->num_heads % c->num_kv_heads != 0)
        BAD("num_kv_heads: %d does not divide num_heads %d", c->num_kv_heads, c->num_heads);
    if (c->ffn_dim < 1 || c->ffn_dim > 16 * NL_CONFIG_MAX_DIM)
        BAD("ffn_dim: %d is outside 1..%d", c->ffn_dim, 16 * NL_CONFIG_MAX_DIM);
    return NL_OK;
}
