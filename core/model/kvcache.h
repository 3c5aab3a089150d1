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

/* k and v are (layers, B, cap, G hd) each. */
typedef struct nl_kvcache {
    nl_backend *be;
    int n_layers, B, cap, kv_dim;
    int len; /* positions filled, the same for every sequence */
    float *k, *v;
} nl_kvcache;

nl_status nl_kvcache_new(nl_kvcache **out, const nl_model *m, int B, int cap, nl_error *err);
void nl_kvcache_destroy(nl_kvcache **kv);
/* Bytes a cache of this shape takes. */
size_t nl_kvcache_bytes(const nl_config *cfg, int n_layers, int B, int cap);

/* Write the keys and values of T new positions (after `past`) of layer
 * `layer` (0-based within the stage) for each of the B sequences: rows of
 * qkv (B*T rows of stride `stride`) hold the keys at column k_col and the
 * values at column v_col. *k and *v get the layer's cache, row stride
 * kv->kv_dim, kv->cap rows per sequence. */
void nl_kvcache_append(nl_kvcache *kv, int layer, const float *qkv, int stride, int k_col,
                       int v_col, int B, int T, int past, const float **k, const float **v);
/* The same with each row's position read on the device from pos (B T,
 * device) when the work runs, through the backend's kv_store slot (which
 * must exist): the queued call holds no position. */
void nl_kvcache_store(nl_kvcache *kv, int layer, const float *qkv, int stride, int k_col, int v_col,
                      int B, int T, const int32_t *pos, const float **k, const float **v);

#endif
