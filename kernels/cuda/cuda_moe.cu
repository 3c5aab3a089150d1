/* The CUDA backend's mixture-of-experts routing kernels: top-k routing
 * and the dispatch tables, the load-balancing loss, the router backward,
 * and the grouped expert GEMMs that size themselves from device offsets.
 * With them a layer's forward and backward queue work without waiting for
 * the host (kernels/backend.h, "routing"). Twins of kernels/cpu/cpu_moe.c:
 * routing and the aux terms are the CPU's arithmetic in the CPU's order
 * (the choices, offsets and tables are the same integers); the grouped
 * GEMM sums in ascending p with fused multiply-adds, like any SGEMM.
 * No atomics, no dynamic shared memory, no allocation. */
#include "kernels/cuda/cuda_moe.h"

#include "kernels/backend.h"
#include "kernels/elem.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace
{

#include "kernels/cuda/cuda_reduce.cuh"

constexpr int ROW_THREADS = 128;   /* route and router backward: one thread per row */
constexpr int TABLE_THREADS = 256; /* the one block of the tables and the aux loss */
constexpr int TM = 64, TN = 64, TK = 16, GEMM_THREADS = 256; /* grouped GEMM tiles */
constexpr unsigned MAX_GRID_YZ = 65535;
/* few-row grouped GEMM (decode): a launch whose max_rows is at most
 * GEMV_MAX_ROWS runs one warp per output column, GEMV_ROWS rows at a time */
constexpr int GEMV_WARPS = 8, GEMV_ROWS = 4, GEMV_MAX_ROWS = NL_CUDA_GROUPED_FEW_ROWS;

unsigned row_grid(int rows)
{
    const unsigned long b = ((unsigned long)rows + ROW_THREADS - 1) / ROW_THREADS;
    return b < MAX_BLOCKS ? (unsigned)b : MAX_BLOCKS;
}

/* ---------------------------------------------------------------- routing */

/* Top-k of each row, ties to the lower index, and the renormalised
 * weights (nl_elem_topk_row, the CPU's rule), one thread per row. */
__global__ void route_rows_kernel(int32_t *choice, float *w, const float *probs, int N, int E,
                                  int k)
{
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t n = (size_t)blockIdx.x * blockDim.x + threadIdx.x; n < (size_t)N; n += step)
        nl_elem_topk_row(choice + n * k, w + n * k, probs + n * E, E, k);
}

/* Exclusive prefix sum of v over the block, in thread order; *total gets
 * the block's sum. Every thread must call it (it synchronises); red is
 * WARP ints of shared memory. */
__device__ int block_exclusive_scan(int v, int *red, int *total)
{
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int nw = blockDim.x / WARP;
    int x = v;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= o)
            x += y;
    }
    __syncthreads(); /* the previous call's readers are done with red */
    if (lane == WARP - 1)
        red[warp] = x;
    __syncthreads();
    int s = lane < nw ? red[lane] : 0; /* each warp scans the warp totals */
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, s, o);
        if (lane >= o)
            s += y;
    }
    const int before = __shfl_sync(FULL_MASK, s, warp > 0 ? warp - 1 : 0);
    *total = __shfl_sync(FULL_MASK, s, nw - 1);
    return (warp > 0 ? before : 0) + x - v;
}

/* Counts, offsets, perm and slot in one block. Thread t owns the entries
 * [lo, hi) of the N k (token, choice) entries; for each expert the block
 * scans the per-thread counts, and each thread numbers its own entries of
 * that expert from its scanned start: the slots of an expert follow the
 * entries' order, which is token order. */
__global__ void route_table_kernel(int32_t *offsets, int32_t *perm, int32_t *slot,
                                   const int32_t *choice, int N, int E, int k)
{
    __shared__ int red[WARP];
    const size_t M = (size_t)N * k, T = blockDim.x;
    const size_t chunk = (M + T - 1) / T;
    const size_t lo = threadIdx.x * chunk < M ? threadIdx.x * chunk : M;
    const size_t hi = lo + chunk < M ? lo + chunk : M;
    int base = 0;
    if (threadIdx.x == 0)
        offsets[0] = 0;
    for (int e = 0; e < E; e++) {
        int c = 0;
        for (size_t i = lo; i < hi; i++)
            c += choice[i] == e;
        int total = 0;
        int s = base + block_exclusive_scan(c, red, &total);
        for (size_t i = lo; i < hi && c > 0; i++)
            if (choice[i] == e) {
                perm[s] = (int32_t)(i / k);
                slot[i] = s++;
            }
        base += total;
        if (threadIdx.x == 0)
            offsets[e + 1] = base;
    }
}

/* ---------------------------------------------------------------- aux loss */

__global__ void aux_kernel(double *aux, float *frac, int64_t *counts, const float *probs,
                           const int32_t *offsets, const float *global_frac, int N, int E, int k,
                           double aux_rows)
{
    __shared__ double red[WARP];
    double a = 0.0;
    for (int e = 0; e < E; e++) {
        double p = 0.0;
        for (size_t n = threadIdx.x; n < (size_t)N; n += blockDim.x)
            p += probs[n * E + e];
        p = block_sum(p, red);
        if (threadIdx.x == 0) {
            const int32_t count = offsets[e + 1] - offsets[e];
            const float f = global_frac ? global_frac[e] : (float)((double)count / ((double)N * k));
            frac[e] = f;
            if (counts)
                counts[e] += count;
            a += (double)f * p / aux_rows;
        }
    }
    if (threadIdx.x == 0 && aux)
        *aux += (double)(float)(E * a);
}

/* ---------------------------------------------------------------- router backward */

__global__ void router_backward_kernel(float *dl, const float *dw, const float *probs,
                                       const int32_t *choice, const float *w, const float *frac,
                                       int N, int E, int k, float aux_scale)
{
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t n = (size_t)blockIdx.x * blockDim.x + threadIdx.x; n < (size_t)N; n += step) {
        const float *p = probs + n * E;
        const int32_t *ch = choice + n * k;
        const float *wn = w + n * k, *dwn = dw + n * k;
        float *d = dl + n * E;
        double S = 0.0, wdot = 0.0;
        for (int i = 0; i < k; i++) {
            S += p[ch[i]];
            wdot += (double)dwn[i] * wn[i];
        }
        for (int e = 0; e < E; e++)
            d[e] = __fmul_rn(aux_scale, frac[e]);
        for (int i = 0; i < k; i++)
            d[ch[i]] += (float)(((double)dwn[i] - wdot) / S);
        double dot = 0.0;
        for (int e = 0; e < E; e++)
            dot += (double)p[e] * d[e];
        for (int e = 0; e < E; e++)
            d[e] = __fmul_rn(p[e], (float)((double)d[e] - dot));
    }
}

/* ---------------------------------------------------------------- grouped gemm */

/* One (TM x TN) tile of group blockIdx.z. WGRAD = 0: the group's rows are
 * the M rows of A and C (A (rows, K) not transposed, B_g = B + g b_stride,
 * (N, K) when TB else (K, N)), C overwritten. WGRAD = 1: the group's rows
 * are the summed dimension: C_g (M, N) += A_g^T B_g with A_g (rows, M) and
 * B_g (rows, N) starting at the group's first row. Thread (ty, tx) of the
 * 16 x 16 grid owns rows ty + 16 i and columns tx + 16 j of the tile. */
template <bool TB, bool WGRAD>
__global__ void __launch_bounds__(GEMM_THREADS)
    grouped_gemm_kernel(int Mfix, int N, int Kfix, const float *A, int lda, const float *B, int ldb,
                        size_t b_stride, float *C, int ldc, size_t c_stride, const int32_t *offsets)
{
    __shared__ float As[TK][TM + 1];
    __shared__ float Bs[TK][TN + 1];
    const int g = blockIdx.z;
    const int r0 = offsets[g], rows = offsets[g + 1] - r0;
    const int M = WGRAD ? Mfix : rows, K = WGRAD ? rows : Kfix;
    if (rows <= 0)
        return; /* an empty group: C untouched, as the CPU skips it */
    const float *Ag = A + (size_t)r0 * lda;
    const float *Bg = WGRAD ? B + (size_t)r0 * ldb : B + g * b_stride;
    float *Cg = WGRAD ? C + g * c_stride : C + (size_t)r0 * ldc;
    const int n0 = blockIdx.x * TN;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int m0 = blockIdx.y * TM; m0 < M; m0 += gridDim.y * TM) { /* uniform in the block */
        float acc[4][4] = {};
        for (int k0 = 0; k0 < K; k0 += TK) {
            for (int l = threadIdx.x; l < TM * TK; l += GEMM_THREADS) {
                /* consecutive threads read consecutive addresses */
                const int i = WGRAD ? l % TM : l / TK, kk = WGRAD ? l / TM : l % TK;
                float v = 0.0f;
                if (m0 + i < M && k0 + kk < K)
                    v = WGRAD ? Ag[(size_t)(k0 + kk) * lda + m0 + i]
                              : Ag[(size_t)(m0 + i) * lda + k0 + kk];
                As[kk][i] = v;
            }
            for (int l = threadIdx.x; l < TK * TN; l += GEMM_THREADS) {
                const int j = TB ? l / TK : l % TN, kk = TB ? l % TK : l / TN;
                float v = 0.0f;
                if (n0 + j < N && k0 + kk < K)
                    v = TB ? Bg[(size_t)(n0 + j) * ldb + k0 + kk]
                           : Bg[(size_t)(k0 + kk) * ldb + n0 + j];
                Bs[kk][j] = v;
            }
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < TK; kk++) {
                float a[4], b[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    a[i] = As[kk][ty + 16 * i];
                    b[i] = Bs[kk][tx + 16 * i];
                }
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int r = m0 + ty + 16 * i, c = n0 + tx + 16 * j;
                if (r < M && c < N) {
                    float *p = Cg + (size_t)r * ldc + c;
                    *p = WGRAD ? *p + acc[i][j] : acc[i][j];
                }
            }
    }
}

/* The few-row grouped GEMM with trans_b (decode: one or a few tokens per
 * expert). The tile kernel above gives such a launch one block per 64
 * columns, of which one or two rows are live and most of the block idles
 * through K / 16 barriers; here warp w of block (x, g) owns column
 * n = x GEMV_WARPS + w of group g and reads the weight row B_g[n, :] once
 * per GEMV_ROWS rows, its lanes striding along K (consecutive lanes,
 * consecutive addresses), so the launch reads each live expert's weights
 * at the memory's pace. Every row's sum is warp_dot_rows (cuda_reduce.cuh:
 * gemm_rows' dot), whatever the group's row count: a row gives the same
 * bits alone or among others, and those of gemm_rows. Any row count is
 * correct (rows beyond GEMV_ROWS take more passes), so a max_rows below a
 * group's count costs time only. W float: the FP32 weights (BF16: each
 * operand rounded to bf16, the bf16 GEMM's products); uint16_t: the
 * backend's bf16 copy of them, the same products. */
template <typename W, bool BF16>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    grouped_gemv_kernel(int N, int K, const float *A, int lda, const W *B, int ldb, size_t b_stride,
                        float *C, int ldc, const int32_t *offsets)
{
    const int g = blockIdx.y;
    const int r0 = offsets[g], rows = offsets[g + 1] - r0;
    const int n = blockIdx.x * GEMV_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (rows <= 0 || n >= N)
        return; /* uniform in the warp: no shuffle below is left waiting */
    const W *w = B + g * b_stride + (size_t)n * ldb;
    for (int i0 = 0; i0 < rows; i0 += GEMV_ROWS) {
        const int live = rows - i0 < GEMV_ROWS ? rows - i0 : GEMV_ROWS;
        float s[GEMV_ROWS];
        warp_dot_rows<W, BF16, GEMV_ROWS>(s, A + (size_t)(r0 + i0) * lda, (size_t)lda, live, w, K,
                                          lane);
#pragma unroll
        for (int i = 0; i < GEMV_ROWS; i++)
            if (lane == 0 && i < live)
                C[(size_t)(r0 + i0 + i) * ldc + n] = s[i];
    }
}

unsigned tiles(long n, int t)
{
    return (unsigned)((n + t - 1) / t);
}

int launched(void)
{
    return (int)cudaGetLastError();
}

/* the grouped GEMMs' shared argument check: sizes, strides, the grid's z */
bool grouped_bad(int M, int N, int groups, int lda, int ldb, int ldc)
{
    return M < 0 || N < 0 || groups < 0 || lda < 0 || ldb < 0 || ldc < 0 ||
           (unsigned)groups > MAX_GRID_YZ;
}

} // namespace

/* ---------------------------------------------------------------- launchers */

extern "C" int nl_cuda_moe_route(void *stream, int32_t *choice, float *w, int32_t *offsets,
                                 int32_t *perm, int32_t *slot, const float *probs, int N, int E,
                                 int k)
{
    if (N < 0 || E < 1 || E > NL_BACKEND_MAX_EXPERTS || k < 1 || k > E ||
        (long long)N * k > INT32_MAX)
        return (int)cudaErrorInvalidValue;
    cudaStream_t s = (cudaStream_t)stream;
    if (N > 0)
        route_rows_kernel<<<row_grid(N), ROW_THREADS, 0, s>>>(choice, w, probs, N, E, k);
    /* the offsets even for N = 0 (all zero), so a grouped GEMM skips every group */
    route_table_kernel<<<1, TABLE_THREADS, 0, s>>>(offsets, perm, slot, choice, N, E, k);
    return launched();
}

extern "C" int nl_cuda_moe_aux(void *stream, double *aux, float *frac, int64_t *counts,
                               const float *probs, const int32_t *offsets, const float *global_frac,
                               int N, int E, int k, double aux_rows)
{
    if (N < 0 || E < 1 || E > NL_BACKEND_MAX_EXPERTS || k < 1)
        return (int)cudaErrorInvalidValue;
    aux_kernel<<<1, TABLE_THREADS, 0, (cudaStream_t)stream>>>(aux, frac, counts, probs, offsets,
                                                              global_frac, N, E, k, aux_rows);
    return launched();
}

extern "C" int nl_cuda_moe_router_backward(void *stream, float *dl, const float *dw,
                                           const float *probs, const int32_t *choice,
                                           const float *w, const float *frac, int N, int E, int k,
                                           float aux_scale)
{
    if (N < 0 || E < 1 || E > NL_BACKEND_MAX_EXPERTS || k < 1 || k > E)
        return (int)cudaErrorInvalidValue;
    if (N == 0)
        return 0;
    router_backward_kernel<<<row_grid(N), ROW_THREADS, 0, (cudaStream_t)stream>>>(
        dl, dw, probs, choice, w, frac, N, E, k, aux_scale);
    return launched();
}

extern "C" int nl_cuda_gemm_grouped(void *stream, int trans_b, int N, int K, const float *A,
                                    int lda, const float *B, int ldb, size_t b_stride, float *C,
                                    int ldc, const int32_t *offsets, int groups, int max_rows)
{
    if (grouped_bad(N, K, groups, lda, ldb, ldc) || max_rows < 0)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || groups == 0 || max_rows == 0)
        return 0;
    cudaStream_t s = (cudaStream_t)stream;
    if (trans_b && max_rows <= GEMV_MAX_ROWS) {
        const dim3 grid(tiles(N, GEMV_WARPS), (unsigned)groups);
        grouped_gemv_kernel<float, false>
            <<<grid, GEMV_WARPS * 32, 0, s>>>(N, K, A, lda, B, ldb, b_stride, C, ldc, offsets);
        return launched();
    }
    const unsigned ty = tiles(max_rows, TM);
    const dim3 grid(tiles(N, TN), ty < MAX_GRID_YZ ? ty : MAX_GRID_YZ, (unsigned)groups);
    if (trans_b)
        grouped_gemm_kernel<true, false>
            <<<grid, GEMM_THREADS, 0, s>>>(0, N, K, A, lda, B, ldb, b_stride, C, ldc, 0, offsets);
    else
        grouped_gemm_kernel<false, false>
            <<<grid, GEMM_THREADS, 0, s>>>(0, N, K, A, lda, B, ldb, b_stride, C, ldc, 0, offsets);
    return launched();
}

extern "C" int nl_cuda_gemm_grouped_few_bf16(void *stream, int N, int K, const float *A, int lda,
                                             const uint16_t *B, int ldb, size_t b_stride, float *C,
                                             int ldc, const int32_t *offsets, int groups)
{
    if (grouped_bad(N, K, groups, lda, ldb, ldc))
        return (int)cudaErrorInvalidValue;
    if (N == 0 || groups == 0)
        return 0;
    const dim3 grid(tiles(N, GEMV_WARPS), (unsigned)groups);
    grouped_gemv_kernel<uint16_t, true><<<grid, GEMV_WARPS * 32, 0, (cudaStream_t)stream>>>(
        N, K, A, lda, B, ldb, b_stride, C, ldc, offsets);
    return launched();
}

extern "C" int nl_cuda_gemm_grouped_rows(void *stream, int N, int K, const float *A, int lda,
                                         const float *B, int ldb, size_t b_stride, float *C,
                                         int ldc, const int32_t *offsets, int groups, int bf16)
{
    if (grouped_bad(N, K, groups, lda, ldb, ldc))
        return (int)cudaErrorInvalidValue;
    if (N == 0 || groups == 0)
        return 0;
    const dim3 grid(tiles(N, GEMV_WARPS), (unsigned)groups);
    cudaStream_t s = (cudaStream_t)stream;
    if (bf16)
        grouped_gemv_kernel<float, true>
            <<<grid, GEMV_WARPS * 32, 0, s>>>(N, K, A, lda, B, ldb, b_stride, C, ldc, offsets);
    else
        grouped_gemv_kernel<float, false>
            <<<grid, GEMV_WARPS * 32, 0, s>>>(N, K, A, lda, B, ldb, b_stride, C, ldc, offsets);
    return launched();
}

extern "C" int nl_cuda_gemm_grouped_wgrad(void *stream, int M, int N, const float *A, int lda,
                                          const float *B, int ldb, float *C, int ldc,
                                          size_t c_stride, const int32_t *offsets, int groups)
{
    if (grouped_bad(M, N, groups, lda, ldb, ldc))
        return (int)cudaErrorInvalidValue;
    if (M == 0 || N == 0 || groups == 0)
        return 0;
    const unsigned ty = tiles(M, TM);
    const dim3 grid(tiles(N, TN), ty < MAX_GRID_YZ ? ty : MAX_GRID_YZ, (unsigned)groups);
    grouped_gemm_kernel<false, true><<<grid, GEMM_THREADS, 0, (cudaStream_t)stream>>>(
        M, N, 0, A, lda, B, ldb, 0, C, ldc, c_stride, offsets);
    return launched();
}
