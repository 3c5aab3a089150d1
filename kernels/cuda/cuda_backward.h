/* Private to kernels/cuda: the launchers of the CUDA backend's backward and
 * optimizer kernels (cuda_backward.cu; attention's backward has its own
 * file), called by the backend's slots (cuda_backend.cu) and by
 * tests/cuda_emu. Each queues its kernels on `stream` (a cudaStream_t),
 * allocates nothing, launches nothing for an empty shape, and returns the
 * cudaError_t of its last launch (cudaGetLastError) as an int, 0 on
 * success; cudaErrorInvalidValue, with nothing launched, for a negative
 * size or a scratch smaller than NL_CUDA_BWD_SCRATCH_MIN. Shapes and
 * pointers are those of the slot of the same name in kernels/backend.h;
 * all pointers are device memory. This header includes no CUDA header.
 *
 * Scratch: the ops that reduce across blocks (the embedding's sort, the
 * RMSNorm weight gradient, the sum of squares) take the backend's
 * reduction scratch, `scratch_bytes` bytes of device memory that no other
 * queued work uses meanwhile (the backend's one stream orders it). No
 * shape is too large for it: an op whose data would not fit works in
 * pieces (rows for the embedding, columns for RMSNorm) in an order that
 * makes its results independent of the piece size, so a smaller scratch
 * costs launches, never bits. */
#ifndef NL_CUDA_BACKWARD_H
#define NL_CUDA_BACKWARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The scratch the backend allocates when it is created: 8 MiB holds the
 * sort keys of 2^20 rows of the embedding at once, and RMSNorm's 32 row
 * groups of up to 65536 columns (NL_CONFIG_MAX_DIM) in one piece. */
#define NL_CUDA_BWD_SCRATCH_BYTES ((size_t)8 << 20)
/* The least scratch the launchers accept (the sum of squares' partials). */
#define NL_CUDA_BWD_SCRATCH_MIN ((size_t)16384)

/* dtable[tokens[n], :] += dout[n, :] for n ascending, each element of a
 * row of dtable summed in that order (the CPU backend's, so the results
 * are the same bits): the (token, n) pairs are sorted in scratch, then one
 * block per distinct token adds its rows. No atomics. */
int nl_cuda_embedding_backward(void *stream, float *dtable, const float *dout,
                               const int32_t *tokens, int N, int C, void *scratch,
                               size_t scratch_bytes);
/* dinp per row; dw through per-row-group partial sums in scratch reduced
 * in a fixed order (the groups depend on N only). */
int nl_cuda_rmsnorm_backward(void *stream, float *dinp, float *dw, const float *dout,
                             const float *inp, const float *w, const float *rstd, int N, int C,
                             void *scratch, size_t scratch_bytes);
int nl_cuda_swiglu_backward(void *stream, float *dgu, const float *dh, const float *gu, int N,
                            int F);
int nl_cuda_moe_combine_backward(void *stream, float *dy, float *dw, const float *dx,
                                 const float *y, const int32_t *slot, const float *w, int N, int k,
                                 int C);
int nl_cuda_cross_entropy(void *stream, float *logits, float *losses, const int32_t *targets, int N,
                          int V, float scale);
/* *out (device memory, one double) = the sum of x[i]^2 in double: per
 * block partials in scratch, then one block sums them in a fixed order
 * (the partition depends on n only). n == 0 launches nothing and leaves
 * *out alone: the sum is 0. */
int nl_cuda_sumsq(void *stream, double *out, const float *x, size_t n, void *scratch,
                  size_t scratch_bytes);
int nl_cuda_adamw(void *stream, float *p, const float *g, float *m, float *v, size_t n, float lr,
                  float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale);

#ifdef __cplusplus
}
#endif

#endif
