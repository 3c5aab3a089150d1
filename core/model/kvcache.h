/* The KV cache of a stage: keys and values of each of its layers for B
 * sequences of up to cap positions, in device memory, so a generation
 * decodes one position at a time without recomputing its prefix. The
 * layer forward appends the new positions and attends over the cache.
 *
 * Ownership: nl_kvcache_new returns a cache the caller frees with
 * nl_kvcache_destroy(&kv); it borrows the model's backend. */
#ifndef NL_KVCACHE_H
#define NL_KVCACHE_H

#include "core/model/model.h"

/* The element type the cache keeps K and V in. bf16 halves the bytes a
 * decode step reads (rounded to nearest even when written, widened to FP32
 * when read; attention still sums in FP32); FP32 is the default. */
typedef enum nl_kv_dtype {
    NL_KV_FP32 = 0,
    NL_KV_BF16 = 1,
} nl_kv_dtype;

/* The values of a --kv-cache flag, in nl_kv_dtype order (a choice's index
 * is its nl_kv_dtype). */
#define NL_KV_DTYPE_CHOICES "fp32|bf16"

/* "fp32" or "bf16". */
const char *nl_kv_dtype_name(nl_kv_dtype t);
/* Bytes of one cached element: 4 or 2. */
size_t nl_kv_dtype_size(nl_kv_dtype t);

/* k and v are (layers, B, cap, G hd) each, of floats (NL_KV_FP32) or of
 * bf16 bits, uint16_t (NL_KV_BF16). */
typedef struct nl_kvcache {
    nl_backend *be;
    int n_layers, B, cap, kv_dim;
    int len; /* positions filled, the same for every sequence */
    nl_kv_dtype dtype;
    void *k, *v;
} nl_kvcache;

/* A bf16 cache needs the backend's kv_store_bf16 slot: without it,
 * NL_ERR_UNSUPPORTED. */
nl_status nl_kvcache_new(nl_kvcache **out, const nl_model *m, int B, int cap, nl_kv_dtype dtype,
                         nl_error *err);
void nl_kvcache_destroy(nl_kvcache **kv);
/* Bytes a cache of this shape takes. */
size_t nl_kvcache_bytes(const nl_config *cfg, int n_layers, int B, int cap, nl_kv_dtype dtype);

/* Write the keys and values of T new positions (after `past`) of layer
 * `layer` (0-based within the stage) for each of the B sequences: rows of
 * qkv (B*T rows of stride `stride`) hold the keys at column k_col and the
 * values at column v_col. *k and *v get the layer's cache, row stride
 * kv->kv_dim elements, kv->cap rows per sequence: floats, or with a bf16
 * cache its bits, for an attention slot called with s.kv_bf16 =
 * (kv->dtype == NL_KV_BF16). */
void nl_kvcache_append(nl_kvcache *kv, int layer, const float *qkv, int stride, int k_col,
                       int v_col, int B, int T, int past, const void **k, const void **v);
/* Layer `layer`'s cache (0-based within the stage): *k and *v as
 * nl_kvcache_append gives them, without writing anything. */
void nl_kvcache_layer(const nl_kvcache *kv, int layer, const void **k, const void **v);
/* The same with each row's position read on the device from pos (B T,
 * device) when the work runs, through the backend's kv_store slot (or
 * kv_store_bf16; it must exist): the queued call holds no position. */
void nl_kvcache_store(nl_kvcache *kv, int layer, const float *qkv, int stride, int k_col, int v_col,
                      int B, int T, const int32_t *pos, const void **k, const void **v);

#endif
