/* CUDA attention forward: the launcher behind the CUDA backend's
 * attention_forward slot. Implemented in cuda_attention.cu (nvcc); this
 * header includes no CUDA header, so C and C++ callers alike can use it. */
#ifndef NL_CUDA_ATTENTION_H
#define NL_CUDA_ATTENTION_H

#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/backend.h"

/* Causal grouped-query attention with an online softmax, the twin of
 * nl_cpu_attention_forward (see the attention_forward slot in backend.h):
 * query head h reads kv head h / (H / G); query t of sequence b sits at
 * absolute position past + t and attends keys 0 .. past + t.
 *   q:   (B, T, q_stride) with head h at column h*hd, q_stride >= H*hd
 *   k,v: (B, kv_cap, kv_stride) with kv head g at column g*hd, kv_stride >= G*hd;
 *        or, with s.kseq and s.vseq (device arrays of B device pointers),
 *        sequence b's (kv_cap, kv_stride) at kseq[b] and vseq[b]
 *   out: (B, T, H*hd); lse: (B, H, T) = m + log(l) of the scaled scores,
 *        written only when lse != NULL.
 * All pointers are device memory; the work is queued on `stream` (a
 * cudaStream_t; NULL is the legacy default stream) and nothing is
 * allocated. Any head dimension 1 <= hd <= NL_BACKEND_MAX_HEAD_DIM works.
 *
 * Returns the cudaError_t of the launch as an int (0 on success). A shape
 * it cannot run (hd out of range, G < 1, H % G != 0, negative sizes,
 * kv_cap < past + T, a stride narrower than the heads it holds, a NULL
 * out/q/k/v, only one of kseq and vseq, more than 2^31 - 1 blocks) launches nothing and returns
 * cudaErrorInvalidValue (1). An empty problem (B, T or H zero) launches
 * nothing and returns 0. */
int nl_cuda_attention_forward(void *stream, float *out, float *lse, const float *q, int q_stride,
                              const float *k, const float *v, int kv_stride, nl_attn_shape s);

/* The same under a DESIGN section 6 mask (the attention_masked_forward
 * slot, twin of nl_cpu_attention_masked_forward): query t sits at absolute
 * position i = past + t and sees the keys of its window (causal (i - W, i],
 * bidirectional abs(i - j) <= W / 2; all of 0 .. past + T - 1 for a global
 * bidirectional mask), and with mask.doc (B, T) device document ids only
 * the keys of its own document. Key tiles outside a query tile's window are
 * not visited. A negative window, or documents with past > 0, launch
 * nothing and return cudaErrorInvalidValue; a zeroed mask is
 * nl_cuda_attention_forward. */
int nl_cuda_attention_masked_forward(void *stream, float *out, float *lse, const float *q,
                                     int q_stride, const float *k, const float *v, int kv_stride,
                                     nl_attn_shape s, nl_attn_mask mask);

#ifdef __cplusplus
}
#endif

#endif
