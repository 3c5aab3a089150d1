/* The KV cache of a stage (see kvcache.h). */
#include "core/model/kvcache.h"

#include <stdlib.h>

const char *nl_kv_dtype_name(nl_kv_dtype t)
{
    return t == NL_KV_BF16 ? "bf16" : "fp32";
}

size_t nl_kv_dtype_size(nl_kv_dtype t)
{
    return t == NL_KV_BF16 ? sizeof(uint16_t) : sizeof(float);
}

size_t nl_kvcache_bytes(const nl_config *cfg, int n_layers, int B, int cap, nl_kv_dtype dtype)
{
    return 2 * (size_t)n_layers * (size_t)B * (size_t)cap * (size_t)cfg->num_kv_heads *
           (size_t)nl_config_head_dim(cfg) * nl_kv_dtype_size(dtype);
}

nl_status nl_kvcache_new(nl_kvcache **out, const nl_model *m, int B, int cap, nl_kv_dtype dtype,
                         nl_error *err)
{
    *out = NULL;
    if (B < 1 || cap < 1 || cap > m->cfg.max_seq_len)
        return nl_error_set(err, NL_ERR_RANGE,
                            "kv cache: %d sequences of %d positions (max_seq_len %d)", B, cap,
                            m->cfg.max_seq_len);
    if (dtype != NL_KV_FP32 && dtype != NL_KV_BF16)
        return nl_error_set(err, NL_ERR_INVALID,
                            "kv cache: element type %d is not one of " NL_KV_DTYPE_CHOICES,
                            (int)dtype);
    if (dtype == NL_KV_BF16 && !m->be->kv_store_bf16)
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "kv cache: the %s backend has no bf16 KV cache (use fp32)",
                            m->be->name);
    nl_kvcache *kv = calloc(1, sizeof *kv);
    if (!kv)
        return nl_error_set(err, NL_ERR_NOMEM, "kv cache: out of memory");
    kv->be = m->be;
    kv->n_layers = m->l1 - m->l0;
    kv->B = B;
    kv->cap = cap;
    kv->kv_dim = m->cfg.num_kv_heads * nl_config_head_dim(&m->cfg);
    kv->dtype = dtype;
    size_t bytes = nl_kvcache_bytes(&m->cfg, kv->n_layers, B, cap, dtype) / 2;
    kv->k = m->be->alloc(m->be, bytes ? bytes : 1);
    kv->v = m->be->alloc(m->be, bytes ? bytes : 1);
    if (!kv->k || !kv->v) {
        nl_kvcache_destroy(&kv);
        return nl_error_set(err, NL_ERR_NOMEM, "kv cache: cannot allocate %zu bytes", 2 * bytes);
    }
    *out = kv;
    return NL_OK;
}

void nl_kvcache_destroy(nl_kvcache **kvp)
{
    if (!kvp || !*kvp)
        return;
    nl_kvcache *kv = *kvp;
    kv->be->free(kv->be, kv->k);
    kv->be->free(kv->be, kv->v);
    free(kv);
    *kvp = NULL;
}

/* Layer `layer`'s slice of the cache in k and v (bytes offset by dtype). */
static void layer_slice(const nl_kvcache *kv, int layer, void **k, void **v)
{
    const size_t off = (size_t)layer * kv->B * kv->cap * kv->kv_dim * nl_kv_dtype_size(kv->dtype);
    *k = (char *)kv->k + off;
    *v = (char *)kv->v + off;
}

void nl_kvcache_layer(const nl_kvcache *kv, int layer, const void **k, const void **v)
{
    void *kc, *vc;
    layer_slice(kv, layer, &kc, &vc);
    *k = kc;
    *v = vc;
}

void nl_kvcache_append(nl_kvcache *kv, int layer, const float *qkv, int stride, int k_col,
                       int v_col, int B, int T, int past, const void **k, const void **v)
{
    nl_backend *be = kv->be;
    void *kc, *vc;
    layer_slice(kv, layer, &kc, &vc);
    if (kv->dtype == NL_KV_BF16) {
        be->kv_store_bf16(be, kc, vc, qkv, stride, k_col, v_col, NULL, past, B, T, kv->cap,
                          kv->kv_dim);
    } else {
        for (int b = 0; b < B; b++) {
            const size_t dst = ((size_t)b * kv->cap + past) * kv->kv_dim;
            const float *src = qkv + (size_t)b * T * stride;
            be->copy_rows(be, (float *)kc + dst, kv->kv_dim, src + k_col, stride, T, kv->kv_dim);
            be->copy_rows(be, (float *)vc + dst, kv->kv_dim, src + v_col, stride, T, kv->kv_dim);
        }
    }
    *k = kc;
    *v = vc;
}

void nl_kvcache_store(nl_kvcache *kv, int layer, const float *qkv, int stride, int k_col, int v_col,
                      int B, int T, const int32_t *pos, const void **k, const void **v)
{
    nl_backend *be = kv->be;
    void *kc, *vc;
    layer_slice(kv, layer, &kc, &vc);
    if (kv->dtype == NL_KV_BF16)
        be->kv_store_bf16(be, kc, vc, qkv, stride, k_col, v_col, pos, 0, B, T, kv->cap, kv->kv_dim);
    else
        be->kv_store(be, kc, vc, qkv, stride, k_col, v_col, pos, B, T, kv->cap, kv->kv_dim);
    *k = kc;
    *v = vc;
}
