/* CUDA attention backward: the launcher behind the CUDA backend's
 * attention_backward slot. Implemented in cuda_attention_bwd.cu (nvcc);
 * this header includes no CUDA header, so C and C++ callers alike can use
 * it. */
#ifndef NL_CUDA_ATTENTION_BWD_H
#define NL_CUDA_ATTENTION_BWD_H

#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/backend.h"

#include <stddef.h>

/* Bytes of scratch nl_cuda_attention_backward can use for a shape: one
 * float per (sequence, query head, position), B * H * T * 4 (0 for an
 * empty or negative shape). */
size_t nl_cuda_attention_backward_scratch(nl_attn_shape s);

/* Backward of nl_cuda_attention_forward without a cache (s.past == 0,
 * s.kv_cap == s.T), the twin of nl_cpu_attention_backward (see the
 * attention_backward slot in backend.h). Causal grouped-query attention:
 * query head h reads kv head h / (H / G).
 *   q, dq:        (B, T, q_stride) with head h at column h*hd, q_stride >= H*hd
 *   k, v, dk, dv: (B, T, kv_stride) with kv head g at column g*hd, kv_stride >= G*hd
 *   out, dout:    (B, T, H*hd), the forward's output and its gradient
 *   lse:          (B, H, T), the forward's log-sum-exp
 *   scratch:      nl_cuda_attention_backward_scratch(s) bytes of device
 *                 memory, or NULL (see below); clobbered.
 * dq, dk and dv are overwritten, only in their heads' columns (so the three
 * may be column slices of one buffer); padding columns are not touched.
 *
 * Scores are recomputed tile by tile from lse, never stored whole, and no
 * float is accumulated by atomics, so a result is the same on every run.
 * Three passes: D = rowsum(dout * out) per (b, h, t) into scratch, then
 * dk/dv per key tile, then dq per query tile. With scratch NULL the first
 * pass is skipped and each tile computes D of its queries itself, in the
 * same order (the results are bit-identical); that reads out once more per
 * key tile, so give scratch when the backend has it.
 *
 * All pointers are device memory; the work is queued on `stream` (a
 * cudaStream_t; NULL is the legacy default stream) and nothing is
 * allocated. Any head dimension 1 <= hd <= NL_BACKEND_MAX_HEAD_DIM works.
 *
 * Returns the cudaError_t of the launches as an int (0 on success). A shape
 * it cannot run (past != 0, kv_cap != T, hd out of range, G < 1, H % G != 0,
 * negative sizes, a stride narrower than the heads it holds, a NULL pointer
 * other than scratch, more than 2^31 - 1 blocks) launches nothing and
 * returns cudaErrorInvalidValue (1). An empty problem (B, T or H zero)
 * launches nothing and returns 0. */
int nl_cuda_attention_backward(void *stream, float *dq, float *dk, float *dv, const float *dout,
                               const float *q, int q_stride, const float *k, const float *v,
                               int kv_stride, const float *out, const float *lse, float *scratch,
                               nl_attn_shape s);

/* The same under the DESIGN section 6 mask of the forward (the
 * attention_masked_backward slot, twin of
 * nl_cpu_attention_masked_backward; see nl_cuda_attention_masked_forward):
 * tiles outside each other's windows are not visited, pairs of different
 * documents get no gradient. A negative window launches nothing and
 * returns cudaErrorInvalidValue; a zeroed mask is
 * nl_cuda_attention_backward. */
int nl_cuda_attention_masked_backward(void *stream, float *dq, float *dk, float *dv,
                                      const float *dout, const float *q, int q_stride,
                                      const float *k, const float *v, int kv_stride,
                                      const float *out, const float *lse, float *scratch,
                                      nl_attn_shape s, nl_attn_mask mask);

#ifdef __cplusplus
}
#endif

#endif
