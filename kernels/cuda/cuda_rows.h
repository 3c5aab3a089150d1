/* Private to kernels/cuda: the launchers of the CUDA backend's row-invariant
 * GEMM (the gemm_rows slot, kernels/backend.h; cuda_rows.cu), called by the
 * backend's GEMM slots (cuda_gemm.cu) and by tests/cuda_emu. Each queues
 * its kernel on `stream` (a cudaStream_t), allocates nothing, launches
 * nothing for an empty shape, and returns the cudaError_t of its launch
 * (cudaGetLastError) as an int, 0 on success; cudaErrorInvalidValue, with
 * nothing launched, for a bad shape or stride. All pointers are device
 * memory. This header includes no CUDA header.
 *
 * C[M, N] = A op(B), or C += A op(B) with accumulate (the old value added
 * to the finished sum), row-major with row strides lda, ldb, ldc. Row i of
 * C depends only on row i of A (and of C), bit for bit, for any M: every
 * element is one sum in a fixed order. With trans_b (B is (N, K): the
 * model's y = x W^T) it is warp_dot_rows (cuda_reduce.cuh), the dot of the
 * few-row grouped GEMMs and of the fused decode kernels: a warp per output
 * column, lanes along K, reading the weight row once for up to 8 rows of
 * A; without, a thread per output column summing k in ascending order with
 * fused multiply-adds. bf16 != 0: each operand rounded to bf16 first, FP32
 * sums (the bf16 GEMM's products); nl_cuda_gemm_rows_bf16 reads the
 * weights from the backend's bf16 copy (trans_b), giving the same bits. */
#ifndef NL_CUDA_ROWS_H
#define NL_CUDA_ROWS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

int nl_cuda_gemm_rows(void *stream, int trans_b, int M, int N, int K, const float *A, int lda,
                      const float *B, int ldb, int accumulate, float *C, int ldc, int bf16);
int nl_cuda_gemm_rows_bf16(void *stream, int M, int N, int K, const float *A, int lda,
                           const uint16_t *B, int ldb, int accumulate, float *C, int ldc);

#ifdef __cplusplus
}
#endif

#endif
