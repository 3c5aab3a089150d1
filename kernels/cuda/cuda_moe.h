/* Private to kernels/cuda: the launchers of the CUDA backend's routing
 * kernels (cuda_moe.cu), called by the backend's slots (cuda_backend.cu)
 * and by tests/cuda_emu. Each queues its kernels on `stream` (a
 * cudaStream_t), allocates nothing, launches nothing for an empty shape,
 * and returns the cudaError_t of its last launch (cudaGetLastError) as an
 * int, 0 on success; cudaErrorInvalidValue, with nothing launched, for a
 * shape outside the slot's contract. Shapes and pointers are those of the
 * slot of the same name in kernels/backend.h; all pointers are device
 * memory. Nothing here synchronises: the counts stay on the device, and
 * the grouped GEMMs read them there. This header includes no CUDA header. */
#ifndef NL_CUDA_MOE_H
#define NL_CUDA_MOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Top-k per row (one thread per row, the CPU's loop), then the counts,
 * offsets and dispatch tables in one block: for each expert, every thread
 * counts it in its contiguous chunk of the (n, i) entries, a block scan
 * gives each chunk its first slot, and the chunk is walked in order, so
 * tokens stay ascending within an expert. No atomics. */
int nl_cuda_moe_route(void *stream, int32_t *choice, float *w, int32_t *offsets, int32_t *perm,
                      int32_t *slot, const float *probs, int N, int E, int k);
/* One block: per expert, the column sum of probs in double (a block
 * reduction in a fixed order), then thread 0 adds the terms in expert
 * order, as the CPU does. */
int nl_cuda_moe_aux(void *stream, double *aux, float *frac, int64_t *counts, const float *probs,
                    const int32_t *offsets, const float *global_frac, int N, int E, int k,
                    double aux_rows);
/* One thread per row, the CPU's arithmetic (double dot products). */
int nl_cuda_moe_router_backward(void *stream, float *dl, const float *dw, const float *probs,
                                const int32_t *choice, const float *w, const float *frac, int N,
                                int E, int k, float aux_scale);
/* Tiled SGEMM over (column tile, row tile, group): 64 x 64 tiles, 16-deep
 * slices through shared memory, 4 x 4 outputs per thread, each summed in
 * ascending p. A block reads its group's row count from offsets and exits
 * at once when its tile lies past it; row tiles past max_rows are walked
 * by the blocks of the grid (so an understated bound costs time, never
 * rows). With trans_b and max_rows <= NL_CUDA_GROUPED_FEW_ROWS (decode) it runs instead one warp
 * per output column, lanes along K: each row summed in the same order
 * whatever the group's row count (a row's bits do not depend on the
 * others), every row correct whatever max_rows says. */
int nl_cuda_gemm_grouped(void *stream, int trans_b, int N, int K, const float *A, int lda,
                         const float *B, int ldb, size_t b_stride, float *C, int ldc,
                         const int32_t *offsets, int groups, int max_rows);
/* The few-row path above with bf16 weights (trans_b): B is the backend's
 * bf16 copy of the expert weights (same strides), each activation rounded
 * to bf16, products summed in FP32: a decode token reads half the bytes.
 * The bf16 backend calls it for max_rows <= NL_CUDA_GROUPED_FEW_ROWS: every
 * grouped product of fewer than NL_BACKEND_FUSED_ROWS rows (16, a decode
 * step's or a short prompt's), as gemm below that many rows runs
 * gemm_rows, so a row's bits are gemm_grouped_rows' whatever the call
 * (cuda_gemm.cu checks the two agree; at 8, a prompt of 9 to 15 rows took
 * the tiles, and its logits were not the batched decoder's: the H200 run
 * of 2026-11-28). */
#define NL_CUDA_GROUPED_FEW_ROWS 15
int nl_cuda_gemm_grouped_few_bf16(void *stream, int N, int K, const float *A, int lda,
                                  const uint16_t *B, int ldb, size_t b_stride, float *C, int ldc,
                                  const int32_t *offsets, int groups);
/* gemm_grouped_rows (trans_b): the few-row kernel above for any row count,
 * each row of C computed as gemm_rows computes it (warp_dot_rows,
 * cuda_reduce.cuh) from FP32 weights; bf16 != 0: with each operand rounded
 * to bf16 (the bits nl_cuda_gemm_grouped_few_bf16 gives from the copy). */
int nl_cuda_gemm_grouped_rows(void *stream, int N, int K, const float *A, int lda, const float *B,
                              int ldb, size_t b_stride, float *C, int ldc, const int32_t *offsets,
                              int groups, int bf16);
/* The same tiles over (M, N) of each group, the group's rows being the
 * summed dimension; C_g += A_g^T B_g. */
int nl_cuda_gemm_grouped_wgrad(void *stream, int M, int N, const float *A, int lda, const float *B,
                               int ldb, float *C, int ldc, size_t c_stride, const int32_t *offsets,
                               int groups);

#ifdef __cplusplus
}
#endif

#endif
