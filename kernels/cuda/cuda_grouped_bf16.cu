/* The grouped expert GEMMs in bf16 on the tensor cores: the gemm_grouped
 * and gemm_grouped_wgrad slots of a bf16 backend, all experts of a layer
 * in one launch per projection, sized from the device offsets (no host
 * sync). See cuda_mixed.h.
 *
 * Why a kernel of our own: cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx)
 * takes each group's m, n, k in host arrays, so the counts would have to
 * come back to the host (a sync per layer, as ggml's fallback does);
 * cuBLASLt batched GEMMs need equal shapes, i.e. every expert padded to
 * the largest count (max_rows is the token count: E / k times the work).
 * Here a block's row tile finds its expert from a tile map that one small
 * kernel computes from the offsets on the device (cuda_mixed.cu, tested in
 * the emulation).
 *
 * Tiles: 128 x 64 outputs per block of 8 warps (4 x 2), each warp 32 x 32
 * (2 x 2 WMMA fragments of 16 x 16, FP32 accumulators), 32-deep slices of
 * A and B through shared memory as bf16. Operands are read as FP32 and
 * rounded to bf16 (nearest even, nl_elem_to_bf16) as they are stored to
 * shared memory, so neither activations nor weights need a converted copy
 * in device memory; the next slice's loads are issued before the current
 * slice's products (register double buffering). Edges: loads past a
 * group's rows or the matrix read 0, stores go through a per-warp staging
 * tile with bounds checks. Not yet tuned or run on a GPU: no cp.async, no
 * wgmma; cuBLASLt's dense kernels are faster per FLOP. */
#include "kernels/cuda/cuda_mixed.cuh"
#include "kernels/cuda/cuda_mixed.h"

#include "kernels/elem.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>
#include <type_traits>

namespace
{

using namespace nvcuda;

constexpr int BM = 128, BN = 64, BK = 32, THREADS = 256;
constexpr int WM = 32, WN = 32;           /* a warp's tile; warps 4 (m) x 2 (n) */
constexpr int FM = WM / 16, FN = WN / 16; /* its fragments */
constexpr int PAD = 8;                    /* bf16 elements of padding per smem row */
constexpr int cmax(int a, int b)
{
    return a > b ? a : b;
}
/* a slice tile in shared memory: BM (or BN) rows of BK, or BK rows of BM (BN), padded */
constexpr int TILE_ELEMS = cmax(cmax(BM, BN) * (BK + PAD), BK *(cmax(BM, BN) + PAD));
constexpr unsigned MAX_GRID_YZ = 65535;

/* A tile of OUTER x INNER floats, INNER the contiguous dimension in global
 * memory (row stride ld), held by the block's threads in registers: thread
 * t has elements t, t + THREADS, ... of the row-major tile, so a warp reads
 * 32 consecutive floats. Elements at outer >= ov or inner >= iv are 0. */
template <int OUTER, int INNER> struct tile_regs {
    static constexpr int N = OUTER * INNER / THREADS;
    static_assert(OUTER * INNER % THREADS == 0, "a tile is a whole number of loads per thread");
    float v[N];

    __device__ __forceinline__ void load(const float *base, int ld, int ov, int iv)
    {
#pragma unroll
        for (int i = 0; i < N; i++) {
            const int l = (int)threadIdx.x + i * THREADS;
            const int o = l / INNER, in = l % INNER;
            v[i] = o < ov && in < iv ? base[(size_t)o * ld + in] : 0.0f;
        }
    }

    /* to shared memory as bf16, row stride INNER + PAD */
    __device__ __forceinline__ void store(__nv_bfloat16 *s) const
    {
#pragma unroll
        for (int i = 0; i < N; i++) {
            const int l = (int)threadIdx.x + i * THREADS;
            const int o = l / INNER, in = l % INNER;
            s[o * (INNER + PAD) + in] = __ushort_as_bfloat16(nl_elem_to_bf16(v[i]));
        }
    }
};

/* One block's BM x BN tile of C = op(A) op(B) over K, C row-major at Cg
 * (ldc) with M x N valid outputs at (m0, n0). AK: A's contiguous dimension
 * is k (A row-major (M, K) at Ag, lda), else m (A^T: (K, M) at Ag). BKC:
 * B's contiguous dimension is k (B row-major (N, K)), else n ((K, N)).
 * ACC: C += the product, else C = the product. */
template <bool AK, bool BKC, bool ACC>
__device__ __forceinline__ void block_tile(int M, int N, int K, int m0, int n0, const float *Ag,
                                           int lda, const float *Bg, int ldb, float *Cg, int ldc,
                                           __nv_bfloat16 *As, __nv_bfloat16 *Bs, float *stage)
{
    using a_layout = typename std::conditional<AK, wmma::row_major, wmma::col_major>::type;
    using b_layout = typename std::conditional<BKC, wmma::col_major, wmma::row_major>::type;
    constexpr int AO = AK ? BM : BK, AI = AK ? BK : BM; /* A tile: outer x inner */
    constexpr int BO = BKC ? BN : BK, BI = BKC ? BK : BN;
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int wm = warp / (BN / WN), wn = warp % (BN / WN);

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++)
            wmma::fill_fragment(acc[i][j], 0.0f);

    tile_regs<AO, AI> ra;
    tile_regs<BO, BI> rb;
    /* the slice at k0: base pointers and valid extents of both tiles */
    auto load = [&](int k0) {
        if (AK)
            ra.load(Ag + (size_t)m0 * lda + k0, lda, M - m0, K - k0);
        else
            ra.load(Ag + (size_t)k0 * lda + m0, lda, K - k0, M - m0);
        if (BKC)
            rb.load(Bg + (size_t)n0 * ldb + k0, ldb, N - n0, K - k0);
        else
            rb.load(Bg + (size_t)k0 * ldb + n0, ldb, K - k0, N - n0);
    };
    load(0);
    for (int k0 = 0; k0 < K; k0 += BK) {
        ra.store(As);
        rb.store(Bs);
        __syncthreads();
        if (k0 + BK < K)
            load(k0 + BK); /* in flight during the products below */
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, a_layout> fa[FM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, b_layout> fb[FN];
#pragma unroll
            for (int i = 0; i < FM; i++) {
                const int m = wm * WM + i * 16;
                if (AK)
                    wmma::load_matrix_sync(fa[i], As + m * (BK + PAD) + kk, BK + PAD);
                else
                    wmma::load_matrix_sync(fa[i], As + kk * (BM + PAD) + m, BM + PAD);
            }
#pragma unroll
            for (int j = 0; j < FN; j++) {
                const int n = wn * WN + j * 16;
                if (BKC)
                    wmma::load_matrix_sync(fb[j], Bs + n * (BK + PAD) + kk, BK + PAD);
                else
                    wmma::load_matrix_sync(fb[j], Bs + kk * (BN + PAD) + n, BN + PAD);
            }
#pragma unroll
            for (int i = 0; i < FM; i++)
#pragma unroll
                for (int j = 0; j < FN; j++)
                    wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads(); /* all warps are done with this slice */
    }

    /* the edges: each fragment through the warp's 16 x 16 staging tile */
    float *st = stage + warp * 256;
#pragma unroll
    for (int i = 0; i < FM; i++)
#pragma unroll
        for (int j = 0; j < FN; j++) {
            wmma::store_matrix_sync(st, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const int r = m0 + wm * WM + i * 16 + e / 16;
                const int c = n0 + wn * WN + j * 16 + e % 16;
                if (r < M && c < N) {
                    float *p = Cg + (size_t)r * ldc + c;
                    *p = ACC ? *p + st[e] : st[e];
                }
            }
            __syncwarp();
        }
}

/* gemm_grouped: row tile t (of the map) of column tile blockIdx.x; the
 * grid's rows walk the map's tiles. */
template <bool TB>
__global__ void __launch_bounds__(THREADS)
    grouped_kernel(int N, int K, const float *A, int lda, const float *B, int ldb, size_t b_stride,
                   float *C, int ldc, const int32_t *offsets, const int32_t *tile_start, int groups)
{
    __shared__ __align__(32) __nv_bfloat16 As[TILE_ELEMS];
    __shared__ __align__(32) __nv_bfloat16 Bs[TILE_ELEMS];
    __shared__ __align__(32) float stage[THREADS / 32 * 256];
    const int tiles = tile_start[groups];
    const int n0 = (int)blockIdx.x * BN;
    for (int t = (int)blockIdx.y; t < tiles; t += (int)gridDim.y) { /* uniform in the block */
        const int g = nl_cuda_tile_lookup(tile_start, groups, t);
        const int r0 = offsets[g], rows = offsets[g + 1] - r0;
        const int m0 = (t - tile_start[g]) * BM;
        block_tile<true, TB, false>(rows, N, K, m0, n0, A + (size_t)r0 * lda, lda,
                                    B + (size_t)g * b_stride, ldb, C + (size_t)r0 * ldc, ldc, As,
                                    Bs, stage);
    }
}

/* gemm_grouped_wgrad: C_g (M, N) += A_g^T B_g, the group's rows summed */
__global__ void __launch_bounds__(THREADS)
    grouped_wgrad_kernel(int M, int N, const float *A, int lda, const float *B, int ldb, float *C,
                         int ldc, size_t c_stride, const int32_t *offsets)
{
    __shared__ __align__(32) __nv_bfloat16 As[TILE_ELEMS];
    __shared__ __align__(32) __nv_bfloat16 Bs[TILE_ELEMS];
    __shared__ __align__(32) float stage[THREADS / 32 * 256];
    const int g = (int)blockIdx.z;
    const int r0 = offsets[g], rows = offsets[g + 1] - r0;
    if (rows <= 0)
        return; /* C_g untouched, as the CPU skips the group */
    const int n0 = (int)blockIdx.x * BN;
    for (int m0 = (int)blockIdx.y * BM; m0 < M; m0 += (int)gridDim.y * BM)
        block_tile<false, false, true>(M, N, rows, m0, n0, A + (size_t)r0 * lda, lda,
                                       B + (size_t)r0 * ldb, ldb, C + (size_t)g * c_stride, ldc, As,
                                       Bs, stage);
}

unsigned tiles_of(long n, int t)
{
    return (unsigned)((n + t - 1) / t);
}

} // namespace

extern "C" int nl_cuda_gemm_grouped_bf16(void *stream, int trans_b, int N, int K, const float *A,
                                         int lda, const float *B, int ldb, size_t b_stride,
                                         float *C, int ldc, const int32_t *offsets, int groups,
                                         int max_rows, int32_t *tile_start)
{
    if (N < 0 || K < 0 || groups < 0 || max_rows < 0 || lda < 0 || ldb < 0 || ldc < 0)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || groups == 0 || max_rows == 0)
        return 0;
    cudaStream_t s = (cudaStream_t)stream;
    int rc = nl_cuda_tile_map(stream, tile_start, offsets, groups, BM);
    if (rc != 0)
        return rc;
    const long bound = nl_cuda_tile_bound(groups, max_rows, -1, BM);
    const dim3 grid(tiles_of(N, BN), bound < (long)MAX_GRID_YZ ? (unsigned)bound : MAX_GRID_YZ);
    if (trans_b)
        grouped_kernel<true><<<grid, THREADS, 0, s>>>(N, K, A, lda, B, ldb, b_stride, C, ldc,
                                                      offsets, tile_start, groups);
    else
        grouped_kernel<false><<<grid, THREADS, 0, s>>>(N, K, A, lda, B, ldb, b_stride, C, ldc,
                                                       offsets, tile_start, groups);
    return (int)cudaGetLastError();
}

extern "C" int nl_cuda_gemm_grouped_wgrad_bf16(void *stream, int M, int N, const float *A, int lda,
                                               const float *B, int ldb, float *C, int ldc,
                                               size_t c_stride, const int32_t *offsets, int groups)
{
    if (M < 0 || N < 0 || groups < 0 || lda < 0 || ldb < 0 || ldc < 0 ||
        (unsigned)groups > MAX_GRID_YZ)
        return (int)cudaErrorInvalidValue;
    if (M == 0 || N == 0 || groups == 0)
        return 0;
    const unsigned ty = tiles_of(M, BM);
    const dim3 grid(tiles_of(N, BN), ty < MAX_GRID_YZ ? ty : MAX_GRID_YZ, (unsigned)groups);
    grouped_wgrad_kernel<<<grid, THREADS, 0, (cudaStream_t)stream>>>(M, N, A, lda, B, ldb, C, ldc,
                                                                     c_stride, offsets);
    return (int)cudaGetLastError();
}
