/* Private to kernels/cuda: the launchers of the CUDA backend's hand-written
 * forward kernels (cuda_ops.cu), called by the backend's slots
 * (cuda_backend.cu). Each queues its kernel on `stream` (a cudaStream_t),
 * allocates nothing, launches nothing for an empty shape, and returns the
 * cudaError_t of the launch (cudaGetLastError) as an int, 0 on success.
 * Shapes and pointers are those of the slot of the same name in
 * kernels/backend.h; all pointers are device memory (but the sample
 * launcher's row table, host memory). This header includes no CUDA
 * header. */
#ifndef NL_CUDA_OPS_H
#define NL_CUDA_OPS_H

#include <stdint.h>

#include "kernels/backend.h" /* nl_sample_row */

#ifdef __cplusplus
extern "C" {
#endif

int nl_cuda_embedding_forward(void *stream, float *out, const int32_t *tokens, const float *table,
                              int N, int C);
int nl_cuda_rmsnorm_forward(void *stream, float *out, float *rstd, const float *inp, const float *w,
                            int N, int C, float eps);
int nl_cuda_rope_forward(void *stream, float *x, const int32_t *pos, int N, int row, int col0,
                         int heads, int hd, float base);
int nl_cuda_softmax_forward(void *stream, float *x, int N, int C);
/* The rows one sample launch takes (its row table is the kernel's
 * argument); a call of more makes several launches. */
#define NL_CUDA_SAMPLE_LAUNCH_ROWS 64
/* The sample_rows slot's kernel: the next token of each of n rows of V
 * logits into ids[0, n) (device), row i by elem.h's nl_elem_sample_row
 * from rows[i] (host: its device logits, temperature, top-p and u); one
 * block a row, each reading its own row only. w: device scratch of
 * w_bytes (NULL, 0: none) where a top-p row stores its weights once for
 * its threshold's 31 passes, when a launch's rows fit (V floats each);
 * else each pass computes them again: the same ids either way. Refuses V
 * outside [1, NL_SAMPLE_MAX_VOCAB], n < 0, and any row with a temperature
 * below 0, top-p outside [0, 1] or u outside [0, 1) (nothing launched). */
int nl_cuda_sample_rows(void *stream, int32_t *ids, const nl_sample_row *rows, int n, int V,
                        float *w, size_t w_bytes);
int nl_cuda_swiglu_forward(void *stream, float *out, const float *gu, int N, int F);
int nl_cuda_gather_rows(void *stream, float *out, const float *src, const int32_t *idx, int n,
                        int C);
int nl_cuda_copy_rows(void *stream, float *dst, int dst_stride, const float *src, int src_stride,
                      int rows, int cols);
int nl_cuda_kv_store(void *stream, float *kc, float *vc, const float *qkv, int stride, int k_col,
                     int v_col, const int32_t *pos, int B, int T, int cap, int kv_dim);
/* The kv_store_bf16 slot: as nl_cuda_kv_store into a cache of bf16 bits
 * (nl_elem_to_bf16), with pos NULL the rows at past + t. */
int nl_cuda_kv_store_bf16(void *stream, uint16_t *kc, uint16_t *vc, const float *qkv, int stride,
                          int k_col, int v_col, const int32_t *pos, int past, int B, int T, int cap,
                          int kv_dim);
/* The kv_store_seq slot: row n = b T + t of qkv into row pos[n] of
 * sequence b's own cache (kseq[b], vseq[b], device arrays of device
 * pointers), floats, or with bf16 bf16 bits as nl_cuda_kv_store_bf16. */
int nl_cuda_kv_store_seq(void *stream, void *const *kseq, void *const *vseq, int bf16,
                         const float *qkv, int stride, int k_col, int v_col, const int32_t *pos,
                         int B, int T, int kv_dim);
int nl_cuda_moe_combine(void *stream, float *x, const float *y, const int32_t *slot, const float *w,
                        int N, int k, int C);
/* C[r, 0:cols] = beta == 0 ? 0 : beta * C[r, 0:cols] for r < rows, row
 * stride ldc: the GEMM with K == 0 (an empty product). */
int nl_cuda_scale_rows(void *stream, float *C, int ldc, int rows, int cols, float beta);

#ifdef __cplusplus
}
#endif

#endif
