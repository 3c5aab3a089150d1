/* The CUDA backend's row-invariant GEMM (cuda_rows.h; the gemm_rows slot,
 * which the plain gemm also takes below NL_CUDA_ROWS_GEMM rows): cuBLAS
 * picks its algorithm (tiles, split-K) by M, so a row's bits from it
 * depend on how many rows share the call; here every output element is
 * one sum in a fixed order whatever M is, so a session decoded alone and
 * in a stage's batch get the same bits (core/model/batch.c). Decode sizes
 * are memory-bound: a warp reads its weight row once for up to ROWS rows
 * of A, consecutive lanes at consecutive addresses. No atomics, no shared
 * memory, no allocation. */
#include "kernels/cuda/cuda_rows.h"

#include "kernels/elem.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace
{

#include "kernels/cuda/cuda_reduce.cuh"

constexpr int WARPS = 8;       /* trans_b: a warp per output column, 8 columns a block */
constexpr int ROWS = 8;        /* rows of A a warp's pass over its weight row serves */
constexpr int SPAN = 8 * ROWS; /* rows of A a block walks (grid y: M / SPAN blocks) */
constexpr int TB_THREADS = WARPS * WARP;
constexpr int COL_THREADS = 128; /* without trans_b: a thread per output column */
constexpr unsigned MAX_GRID_Y = 65535;

unsigned blocks(long n, long per)
{
    return (unsigned)((n + per - 1) / per);
}

/* C[i, n] for the rows i of this block's span, warp per column n; R rows
 * per pass (1 for a single row, the decode's usual case, else ROWS) */
template <typename W, bool BF16, int R>
__global__ void __launch_bounds__(TB_THREADS)
    rows_tb_kernel(int M, int N, int K, const float *A, int lda, const W *B, int ldb,
                   int accumulate, float *C, int ldc)
{
    const int n = blockIdx.x * WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (n >= N)
        return; /* uniform in the warp */
    const W *w = B + (size_t)n * ldb;
    for (long r0 = (long)blockIdx.y * SPAN; r0 < M; r0 += (long)gridDim.y * SPAN) {
        const long end = r0 + SPAN < M ? r0 + SPAN : M;
        for (long i0 = r0; i0 < end; i0 += R) {
            const int live = end - i0 < R ? (int)(end - i0) : R;
            float s[R];
            warp_dot_rows<W, BF16, R>(s, A + (size_t)i0 * lda, (size_t)lda, live, w, K, lane);
#pragma unroll
            for (int i = 0; i < R; i++)
                if (lane == 0 && i < live) {
                    float *c = C + (size_t)(i0 + i) * ldc + n;
                    *c = accumulate ? *c + s[i] : s[i];
                }
        }
    }
}

/* without trans_b (B is (K, N)): thread per column n, ROWS rows at a time,
 * k ascending */
template <bool BF16>
__global__ void __launch_bounds__(COL_THREADS)
    rows_n_kernel(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                  int accumulate, float *C, int ldc)
{
    const long n = (long)blockIdx.x * COL_THREADS + threadIdx.x;
    if (n >= N)
        return;
    for (long i0 = (long)blockIdx.y * ROWS; i0 < M; i0 += (long)gridDim.y * ROWS) {
        const int live = M - i0 < ROWS ? (int)(M - i0) : ROWS;
        float acc[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; i++)
            acc[i] = 0.0f;
        for (int k = 0; k < K; k++) {
            const float b = dot_operand<BF16>(B[(size_t)k * ldb + n]);
#pragma unroll
            for (int i = 0; i < ROWS; i++)
                if (i < live)
                    acc[i] = fmaf(dot_operand<BF16>(A[(size_t)(i0 + i) * lda + k]), b, acc[i]);
        }
#pragma unroll
        for (int i = 0; i < ROWS; i++)
            if (i < live) { /* acc stays in registers: constant indices */
                float *c = C + (size_t)(i0 + i) * ldc + n;
                *c = accumulate ? *c + acc[i] : acc[i];
            }
    }
}

template <typename W, bool BF16>
void launch_tb(cudaStream_t s, int M, int N, int K, const float *A, int lda, const W *B, int ldb,
               int acc, float *C, int ldc)
{
    const unsigned gy = blocks(M, SPAN);
    const dim3 grid(blocks(N, WARPS), gy < MAX_GRID_Y ? gy : MAX_GRID_Y);
    if (M == 1)
        rows_tb_kernel<W, BF16, 1>
            <<<grid, TB_THREADS, 0, s>>>(M, N, K, A, lda, B, ldb, acc, C, ldc);
    else
        rows_tb_kernel<W, BF16, ROWS>
            <<<grid, TB_THREADS, 0, s>>>(M, N, K, A, lda, B, ldb, acc, C, ldc);
}

bool bad_shape(int M, int N, int K, int lda, int ldb, int ldc, int trans_b)
{
    return M < 0 || N < 0 || K < 0 || lda < K || ldc < N || (trans_b ? ldb < K : ldb < N);
}

int launched(void)
{
    return (int)cudaGetLastError();
}

} // namespace

extern "C" int nl_cuda_gemm_rows(void *stream, int trans_b, int M, int N, int K, const float *A,
                                 int lda, const float *B, int ldb, int accumulate, float *C,
                                 int ldc, int bf16)
{
    if (bad_shape(M, N, K, lda, ldb, ldc, trans_b))
        return (int)cudaErrorInvalidValue;
    if (M == 0 || N == 0)
        return 0;
    cudaStream_t s = (cudaStream_t)stream;
    if (trans_b) {
        if (bf16)
            launch_tb<float, true>(s, M, N, K, A, lda, B, ldb, accumulate, C, ldc);
        else
            launch_tb<float, false>(s, M, N, K, A, lda, B, ldb, accumulate, C, ldc);
        return launched();
    }
    const unsigned gy = blocks(M, ROWS);
    const dim3 grid(blocks(N, COL_THREADS), gy < MAX_GRID_Y ? gy : MAX_GRID_Y);
    if (bf16)
        rows_n_kernel<true>
            <<<grid, COL_THREADS, 0, s>>>(M, N, K, A, lda, B, ldb, accumulate, C, ldc);
    else
        rows_n_kernel<false>
            <<<grid, COL_THREADS, 0, s>>>(M, N, K, A, lda, B, ldb, accumulate, C, ldc);
    return launched();
}

extern "C" int nl_cuda_gemm_rows_bf16(void *stream, int M, int N, int K, const float *A, int lda,
                                      const uint16_t *B, int ldb, int accumulate, float *C, int ldc)
{
    if (bad_shape(M, N, K, lda, ldb, ldc, 1))
        return (int)cudaErrorInvalidValue;
    if (M == 0 || N == 0)
        return 0;
    launch_tb<uint16_t, true>((cudaStream_t)stream, M, N, K, A, lda, B, ldb, accumulate, C, ldc);
    return launched();
}
