/* Hugging Face config.json mapping and the RoPE row permutation
 * (core/formats/hf.h): what a Llama, Mistral or Mixtral config means in our
 * config's terms and back, and the reordering of wq/wk rows between their
 * rotate-half layout and our interleaved pairs. The streaming tensor
 * conversion that uses them is core/formats/hf.c. */
#include "core/formats/hf.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/tokenizer/tokenizer.h"

#define FAIL(st, ...) return nl_error_set(err, st, __VA_ARGS__)

/* ------------------------------------------------------------ config.json */

/* An integer key: *out keeps `def` when the key is absent and def >= 0;
 * def < 0 makes it required. */
static nl_status cfg_int(json_t *root, const char *label, const char *key, long long def,
                         long long lo, long long hi, long long *out, nl_error *err)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        if (def < 0)
            FAIL(NL_ERR_FORMAT, "%s: %s: missing", label, key);
        *out = def;
        return NL_OK;
    }
    if (!json_is_integer(v))
        FAIL(NL_ERR_FORMAT, "%s: %s: not an integer", label, key);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        FAIL(NL_ERR_RANGE, "%s: %s: %lld is outside %lld..%lld", label, key, x, lo, hi);
    *out = x;
    return NL_OK;
}

static nl_status cfg_num(json_t *root, const char *label, const char *key, double def, double *out,
                         nl_error *err)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return NL_OK;
    }
    if (!json_is_number(v))
        FAIL(NL_ERR_FORMAT, "%s: %s: not a number", label, key);
    *out = json_number_value(v);
    return NL_OK;
}

/* A key that must be absent, null, false or 0 (a feature we lack). */
static nl_status cfg_absent(json_t *root, const char *label, const char *key, const char *what,
                            nl_error *err)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v) || json_is_false(v) || (json_is_integer(v) && !json_integer_value(v)))
        return NL_OK;
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: %s: %.80s: %s is not supported", label, key,
                 s ? s : "?", what);
    free(s);
    return NL_ERR_UNSUPPORTED;
}

/* The architectures this reads: the name, its model_type, whether its FFN
 * is our dense one (num_experts 1) and whether transformers reads its
 * sliding_window (Llama's config has none). */
static const struct hf_arch {
    const char *name, *model_type;
    int dense, window;
} hf_archs[] = {
    {"MixtralForCausalLM", "mixtral", 0, 1},
    {"LlamaForCausalLM", "llama", 1, 0},
    {"MistralForCausalLM", "mistral", 1, 1},
};

/* The architecture: from architectures[0], else model_type. */
static nl_status cfg_arch(json_t *root, const char *label, const struct hf_arch **out,
                          nl_error *err)
{
    json_t *a = json_object_get(root, "architectures");
    const char *arch = NULL, *key = "architectures";
    if (a && !json_is_null(a)) {
        if (!json_is_array(a) || json_array_size(a) != 1 || !json_is_string(json_array_get(a, 0)))
            FAIL(NL_ERR_FORMAT, "%s: architectures: not a list of one name", label);
        arch = json_string_value(json_array_get(a, 0));
    } else if (json_is_string(json_object_get(root, "model_type"))) {
        arch = json_string_value(json_object_get(root, "model_type"));
        key = "model_type";
    } else {
        FAIL(NL_ERR_FORMAT, "%s: neither architectures nor model_type names the model", label);
    }
    for (size_t i = 0; i < sizeof hf_archs / sizeof hf_archs[0]; i++)
        if (strcmp(arch, hf_archs[i].name) == 0 || strcmp(arch, hf_archs[i].model_type) == 0) {
            *out = &hf_archs[i];
            return NL_OK;
        }
    FAIL(NL_ERR_UNSUPPORTED,
         "%s: %s: %.80s is not supported (MixtralForCausalLM, LlamaForCausalLM and "
         "MistralForCausalLM are)",
         label, key, arch);
}

/* Mistral's and Mixtral's sliding_window W: each query sees the keys
 * j in (i - W, i] on every layer, which is our attention_window W with no
 * global layer (global_every 0). null, absent, or a window at least the
 * context long (it never hides a key): full attention. */
static nl_status cfg_window(json_t *root, const char *label, const struct hf_arch *arch,
                            int64_t max_pos, nl_config *cfg, nl_error *err)
{
    json_t *sw = json_object_get(root, "sliding_window");
    if (!arch->window || !sw || json_is_null(sw))
        return NL_OK; /* transformers' Llama does not read the key */
    if (!json_is_integer(sw))
        FAIL(NL_ERR_FORMAT, "%s: sliding_window: not an integer or null", label);
    json_int_t w = json_integer_value(sw);
    if (w < 1)
        FAIL(NL_ERR_RANGE, "%s: sliding_window: %lld is not a positive window", label,
             (long long)w);
    if (w < max_pos) {
        cfg->attention_window = (int)w;
        cfg->global_every = 0;
    }
    return NL_OK;
}

static nl_status cfg_features(json_t *root, const char *label, nl_error *err)
{
    nl_status st;
    /* transformers' ACT2FN: "swish" is the same function as "silu" */
    json_t *act = json_object_get(root, "hidden_act");
    const char *a = json_string_value(act);
    if (act && (!a || (strcmp(a, "silu") != 0 && strcmp(a, "swish") != 0)))
        FAIL(NL_ERR_UNSUPPORTED,
             "%s: hidden_act: only silu (or swish, the same function: SwiGLU) is supported", label);
    if ((st = cfg_absent(root, label, "rope_scaling", "RoPE scaling", err)) ||
        (st = cfg_absent(root, label, "attention_bias", "a bias", err)) ||
        (st = cfg_absent(root, label, "mlp_bias", "a bias", err)))
        return st;
    return NL_OK;
}

nl_status nl_hf_config_parse(nl_config *cfg, int *tied, const char *json, size_t len,
                             const char *label, char arch_name[NL_HF_ARCH_MAX], nl_error *err)
{
    const struct hf_arch *arch = NULL;
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    nl_status st = NL_OK;
    long long V = 0, d = 0, F = 0, L = 0, H = 0, G = 0, E = 1, k = 1, S = 0;
    int dense = 0;
    if (arch_name)
        arch_name[0] = '\0';
    if (!root || !json_is_object(root)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: not a JSON object (line %d: %s)", label, je.line,
                          root ? "top level" : je.text);
        goto out;
    }
    if ((st = cfg_arch(root, label, &arch, err)))
        goto out;
    dense = arch->dense;
    if (arch_name)
        snprintf(arch_name, NL_HF_ARCH_MAX, "%s", arch->name);
    if ((st = cfg_int(root, label, "vocab_size", -1, 1, NL_CONFIG_MAX_VOCAB, &V, err)) ||
        (st = cfg_int(root, label, "hidden_size", -1, 1, NL_CONFIG_MAX_DIM, &d, err)) ||
        (st = cfg_int(root, label, "intermediate_size", -1, 1, 16 * NL_CONFIG_MAX_DIM, &F, err)) ||
        (st = cfg_int(root, label, "num_hidden_layers", -1, 1, NL_CONFIG_MAX_LAYERS, &L, err)) ||
        (st = cfg_int(root, label, "num_attention_heads", -1, 1, NL_CONFIG_MAX_DIM, &H, err)) ||
        (st = cfg_int(root, label, "num_key_value_heads", H, 1, H, &G, err)) ||
        (!dense &&
         (st = cfg_int(root, label, "num_local_experts", 8, 1, NL_CONFIG_MAX_EXPERTS, &E, err))) ||
        (!dense && (st = cfg_int(root, label, "num_experts_per_tok", 2, 1, E, &k, err))) ||
        (st = cfg_int(root, label, "max_position_embeddings", 131072, 1, NL_CONFIG_MAX_SEQ, &S,
                      err)))
        goto out;
    if ((st = cfg_features(root, label, err)))
        goto out;
    json_t *hd = json_object_get(root, "head_dim");
    if (hd && !json_is_null(hd) &&
        (!json_is_integer(hd) || json_integer_value(hd) * H != d || d % H != 0)) {
        st = nl_error_set(err, NL_ERR_UNSUPPORTED,
                          "%s: head_dim: only hidden_size / num_attention_heads (%lld / %lld) is "
                          "supported",
                          label, d, H);
        goto out;
    }
    json_t *tie = json_object_get(root, "tie_word_embeddings");
    if (tie && !json_is_boolean(tie)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: tie_word_embeddings: not true or false", label);
        goto out;
    }
    *tied = tie && json_is_true(tie);
    nl_config_init(cfg);
    cfg->vocab_size = V;
    cfg->vocab_chunk = V;
    cfg->hidden_dim = (int)d;
    cfg->ffn_dim = (int)F;
    cfg->num_layers = (int)L;
    cfg->num_heads = (int)H;
    cfg->num_kv_heads = (int)G;
    cfg->num_experts = (int)E;
    cfg->top_k = (int)k;
    cfg->max_seq_len = (int)S;
    /* transformers' defaults: 1e6 for Mixtral, 1e4 for Llama and Mistral */
    if ((st = cfg_num(root, label, "rope_theta", dense ? 1e4 : 1e6, &cfg->rope_base, err)) ||
        (st = cfg_num(root, label, "rms_norm_eps", 1e-5, &cfg->norm_eps, err)) ||
        (st = cfg_num(root, label, "router_aux_loss_coef", 0.001, &cfg->aux_loss_coef, err)) ||
        (st = cfg_window(root, label, arch, S, cfg, err)))
        goto out;
    if ((st = nl_config_validate(cfg, 1, err)))
        nl_error_prefix(err, "%s: as our config", label);
out:
    json_decref(root);
    return st;
}

const char *nl_hf_arch_of(const nl_config *c)
{
    return !nl_config_dense(c) ? "MixtralForCausalLM"
           : nl_hf_window(c)   ? "MistralForCausalLM"
                               : "LlamaForCausalLM";
}

int nl_hf_window(const nl_config *c)
{
    return c->attention_window > 0 && c->global_every == 0 ? c->attention_window : 0;
}

char *nl_hf_config_to_json(const nl_config *c, int with_tokenizer)
{
    json_t *r = json_object();
    if (!r)
        return NULL;
    const int dense = nl_config_dense(c), window = nl_hf_window(c);
    const char *name = nl_hf_arch_of(c);
    json_t *arch = json_array();
    json_array_append_new(arch, json_string(name));
    json_object_set_new(r, "architectures", arch);
    json_object_set_new(r, "model_type",
                        json_string(!dense   ? "mixtral"
                                    : window ? "mistral"
                                             : "llama"));
    json_object_set_new(r, "vocab_size", json_integer(c->vocab_size));
    json_object_set_new(r, "hidden_size", json_integer(c->hidden_dim));
    json_object_set_new(r, "intermediate_size", json_integer(c->ffn_dim));
    json_object_set_new(r, "num_hidden_layers", json_integer(c->num_layers));
    json_object_set_new(r, "num_attention_heads", json_integer(c->num_heads));
    json_object_set_new(r, "num_key_value_heads", json_integer(c->num_kv_heads));
    if (!dense) {
        json_object_set_new(r, "num_local_experts", json_integer(c->num_experts));
        json_object_set_new(r, "num_experts_per_tok", json_integer(c->top_k));
        json_object_set_new(r, "router_aux_loss_coef", json_real(c->aux_loss_coef));
        json_object_set_new(r, "output_router_logits", json_false());
    } else if (!window) {
        json_object_set_new(r, "attention_bias", json_false());
        json_object_set_new(r, "mlp_bias", json_false());
    }
    json_object_set_new(r, "max_position_embeddings", json_integer(c->max_seq_len));
    json_object_set_new(r, "rope_theta", json_real(c->rope_base));
    json_object_set_new(r, "rms_norm_eps", json_real(c->norm_eps));
    json_object_set_new(r, "hidden_act", json_string("silu"));
    json_object_set_new(r, "tie_word_embeddings", json_false());
    json_object_set_new(r, "sliding_window", window ? json_integer(window) : json_null());
    json_object_set_new(r, "rope_scaling", json_null());
    json_object_set_new(r, "attention_dropout", json_real(0.0));
    json_object_set_new(r, "initializer_range", json_real(0.02));
    json_object_set_new(r, "use_cache", json_true());
    json_object_set_new(r, "torch_dtype", json_string("float32"));
    json_object_set_new(r, "bos_token_id",
                        with_tokenizer ? json_integer(NL_TOKEN_BEGIN) : json_null());
    json_object_set_new(r, "eos_token_id",
                        with_tokenizer ? json_integer(NL_TOKEN_END) : json_null());
    char *s = json_dumps(r, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
    json_decref(r);
    return s;
}

/* ------------------------------------------------------------------ RoPE */

void nl_hf_rope_permute(float *dst, const float *src, int heads, int head_dim, int64_t cols,
                        int to_ours)
{
    int half = head_dim / 2;
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < half; i++)
            for (int j = 0; j < 2; j++) {
                int64_t ours = (int64_t)h * head_dim + 2 * i + j;
                int64_t hf = (int64_t)h * head_dim + j * half + i;
                int64_t to = to_ours ? ours : hf, from = to_ours ? hf : ours;
                memcpy(dst + to * cols, src + from * cols, (size_t)cols * sizeof *dst);
            }
}
