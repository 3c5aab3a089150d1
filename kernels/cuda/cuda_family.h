/* CUDA kernels of the model variants of DESIGN.md section 6 (GeGLU, YaRN
 * RoPE): the launchers behind the CUDA backend's geglu_forward,
 * geglu_backward and rope_scaled_forward slots. Implemented in
 * cuda_family.cu (nvcc); this header includes no CUDA header. The masked
 * attention's launchers are in cuda_attention.h and cuda_attention_bwd.h.
 *
 * All pointers are device memory; the work is queued on `stream` (a
 * cudaStream_t; NULL is the legacy default stream) and nothing is
 * allocated. Each returns the cudaError_t of its launch as an int (0 on
 * success); an empty problem launches nothing and returns 0; a shape or
 * parameter it cannot run launches nothing and returns
 * cudaErrorInvalidValue (1). */
#ifndef NL_CUDA_FAMILY_H
#define NL_CUDA_FAMILY_H

#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/backend.h"

#include <stdint.h>

/* out[n, j] = gelu(gu[n, j]) * gu[n, F + j] with the exact (erf) GELU; gu
 * is (N, 2F), out (N, F). Twin of the CPU's geglu_forward. */
int nl_cuda_geglu_forward(void *stream, float *out, const float *gu, int N, int F);

/* dgu[:, :F] = dh * u * gelu'(g), dgu[:, F:] = dh * gelu(g) (overwrites);
 * twin of nl_cpu_geglu_backward. Negative N or F: cudaErrorInvalidValue. */
int nl_cuda_geglu_backward(void *stream, float *dgu, const float *dh, const float *gu, int N,
                           int F);

/* RoPE of rope_forward (nl_cuda_rope_forward) with YaRN's frequencies and
 * scale (nl_rope_scaling, sc.type NL_ROPE_YARN; the backend calls the
 * plain launcher for NL_ROPE_NONE). Refuses hd > NL_BACKEND_MAX_HEAD_DIM,
 * negative sizes, factor <= 0, beta_fast == beta_slow and L0 <= 0. */
int nl_cuda_rope_yarn_forward(void *stream, float *x, const int32_t *pos, int N, int row, int col0,
                              int heads, int hd, float base, nl_rope_scaling sc);

#ifdef __cplusplus
}
#endif

#endif
