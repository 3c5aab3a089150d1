/* The CUDA backend's fused decode kernels (kernels/backend.h, "fused
 * decode"): a decode step's expert layer in three launches. Each row gets
 * the bits of the separate slots with their products through gemm_rows
 * (rmsnorm_forward, gemm_rows of the router, softmax_forward, moe_route,
 * gather_rows, gemm_grouped_rows, swiglu_forward, gemm_grouped_rows,
 * moe_combine: core/model/batch.c runs those for a batch of many rows and
 * these below NL_BACKEND_FUSED_ROWS, so a row's bits do not depend on the
 * batch): the RMSNorm and the softmax are cuda_reduce.cuh's row functions
 * with the separate kernels' thread counts, every product is warp_dot
 * (cuda_reduce.cuh's row dot, that of gemm_rows), the top-k
 * nl_elem_topk_row (moe_route's rule) and the combine one fused
 * multiply-add a term in order of i (moe_combine's). Nothing depends on
 * the other rows of the call. No atomics, no dynamic shared memory, no
 * allocation. In bf16 mode (bf16 != 0) every product is bf16 x bf16 in
 * FP32 as the separate slots' are there (warp_dot_rows<W, true>: each
 * activation rounded to bf16 as read, the weights read from their bf16
 * copy when one is given, else rounded as read: the same bits), and the
 * rest FP32 as before. */
#include "kernels/cuda/cuda_fused.h"

#include "kernels/backend.h"
#include "kernels/elem.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace
{

#include "kernels/cuda/cuda_reduce.cuh"

constexpr int ROUTE_THREADS = 512; /* one block per row: rmsnorm_threads(d), at least
                                    * softmax_threads(E) */
constexpr int DOT_WARPS = 8;       /* gate/up and down: a warp per output column */
constexpr int DOT_THREADS = DOT_WARPS * WARP;
constexpr unsigned MAX_GRID_Y = 65535;

unsigned capped(long n, unsigned cap)
{
    return n < (long)cap ? (unsigned)n : cap;
}

/* ---------------------------------------------------------------- norm + router + top-k */

/* Threads [0, Tn) compute the RMSNorm as rmsnorm_kernel's block of Tn
 * does, threads [0, Ts) the softmax as softmax_kernel's block of Ts does;
 * the block has the larger of the two. */
template <typename W, bool BF16>
__global__ void __launch_bounds__(ROUTE_THREADS)
    norm_route_kernel(float *xn, float *probs, int32_t *choice, float *w, const float *x,
                      const float *norm_w, const W *router, int N, int d, int E, int k, float eps,
                      int Tn, int Ts)
{
    __shared__ float red[WARP];
    __shared__ float p[NL_BACKEND_MAX_EXPERTS];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nw = blockDim.x / WARP;
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *xr = x + n * d;
        float *y = xn + n * d;
        block_rmsnorm_row(y, xr, norm_w, d, eps, red, Tn);
        __syncthreads(); /* the normed row, written by the whole block, read by every warp */
        for (int e = warp; e < E; e += nw) {
            float s[1];
            warp_dot_rows<W, BF16, 1>(s, y, 0, 1, router + (size_t)e * d, d, lane);
            if (lane == 0)
                p[e] = s[0];
        }
        __syncthreads();
        block_softmax_row(p, E, red, Ts);
        for (int e = threadIdx.x; (int)threadIdx.x < Ts && e < E; e += Ts) /* its own writes */
            probs[n * E + e] = p[e];
        __syncthreads();
        if (threadIdx.x == 0) /* moe_route's top-k, ties to the lower index */
            nl_elem_topk_row(choice + n * k, w + n * k, p, E, k);
        __syncthreads(); /* p is the next row's */
    }
}

/* ---------------------------------------------------------------- gate/up + SwiGLU */

template <typename W, bool BF16>
__global__ void __launch_bounds__(DOT_THREADS)
    gate_up_kernel(float *hs, const float *xn, const int32_t *choice, const W *experts,
                   size_t expert_stride, int N, int k, int d, int F)
{
    const int j = blockIdx.x * DOT_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (j >= F)
        return; /* uniform in the warp */
    for (size_t r = blockIdx.y; r < (size_t)N * k; r += gridDim.y) {
        const float *a = xn + r / k * d;
        const W *wg = experts + (size_t)choice[r] * expert_stride + (size_t)j * d;
        float g[1], u[1];
        warp_dot_rows<W, BF16, 1>(g, a, 0, 1, wg, d, lane);
        warp_dot_rows<W, BF16, 1>(u, a, 0, 1, wg + (size_t)F * d, d, lane);
        if (lane == 0)
            hs[r * F + j] = nl_elem_swiglu(g[0], u[0]);
    }
}

/* ---------------------------------------------------------------- down + combine + residual */

template <typename W, bool BF16>
__global__ void __launch_bounds__(DOT_THREADS)
    down_combine_kernel(float *x, const float *hs, const int32_t *choice, const float *w,
                        const W *experts, size_t expert_stride, int N, int k, int d, int F)
{
    const int c = blockIdx.x * DOT_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (c >= d)
        return;
    for (size_t n = blockIdx.y; n < (size_t)N; n += gridDim.y) {
        float acc = x[n * d + c];
        for (int i = 0; i < k; i++) { /* moe_combine's order */
            const size_t r = n * k + i;
            const W *wd =
                experts + (size_t)choice[r] * expert_stride + 2 * (size_t)F * d + (size_t)c * F;
            float s[1];
            warp_dot_rows<W, BF16, 1>(s, hs + r * F, 0, 1, wd, F, lane);
            acc = fmaf(w[r], s[0], acc);
        }
        if (lane == 0)
            x[n * d + c] = acc;
    }
}

int launched(void)
{
    return (int)cudaGetLastError();
}

} // namespace

/* ---------------------------------------------------------------- launchers */

extern "C" int nl_cuda_moe_norm_route(void *stream, float *xn, float *probs, int32_t *choice,
                                      float *w, const float *x, const float *norm_w,
                                      const float *router, const uint16_t *router16, int bf16,
                                      int N, int d, int E, int k, float eps)
{
    if (E < 1 || E > NL_BACKEND_MAX_EXPERTS || k < 1 || k > E || N < 0 || d < 0)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || d == 0)
        return 0;
    const int Tn = rmsnorm_threads(d), Ts = softmax_threads(E), threads = Tn > Ts ? Tn : Ts;
    const unsigned blocks = capped(N, MAX_BLOCKS);
    cudaStream_t st = (cudaStream_t)stream;
    if (bf16 && router16)
        norm_route_kernel<uint16_t, true><<<blocks, threads, 0, st>>>(
            xn, probs, choice, w, x, norm_w, router16, N, d, E, k, eps, Tn, Ts);
    else if (bf16)
        norm_route_kernel<float, true><<<blocks, threads, 0, st>>>(xn, probs, choice, w, x, norm_w,
                                                                   router, N, d, E, k, eps, Tn, Ts);
    else
        norm_route_kernel<float, false><<<blocks, threads, 0, st>>>(
            xn, probs, choice, w, x, norm_w, router, N, d, E, k, eps, Tn, Ts);
    return launched();
}

extern "C" int nl_cuda_moe_gate_up(void *stream, float *hs, float *gu, const float *xn,
                                   const int32_t *choice, const float *experts,
                                   const uint16_t *experts16, int bf16, size_t expert_stride, int N,
                                   int k, int d, int F)
{
    (void)gu;
    if (N < 0 || k < 1 || d < 0 || F < 0)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || F == 0)
        return 0;
    const dim3 grid((unsigned)((F + DOT_WARPS - 1) / DOT_WARPS), capped((long)N * k, MAX_GRID_Y));
    cudaStream_t st = (cudaStream_t)stream;
    if (bf16 && experts16)
        gate_up_kernel<uint16_t, true>
            <<<grid, DOT_THREADS, 0, st>>>(hs, xn, choice, experts16, expert_stride, N, k, d, F);
    else if (bf16)
        gate_up_kernel<float, true>
            <<<grid, DOT_THREADS, 0, st>>>(hs, xn, choice, experts, expert_stride, N, k, d, F);
    else
        gate_up_kernel<float, false>
            <<<grid, DOT_THREADS, 0, st>>>(hs, xn, choice, experts, expert_stride, N, k, d, F);
    return launched();
}

extern "C" int nl_cuda_moe_down_combine(void *stream, float *x, float *ye, const float *hs,
                                        const int32_t *choice, const float *w, const float *experts,
                                        const uint16_t *experts16, int bf16, size_t expert_stride,
                                        int N, int k, int d, int F)
{
    (void)ye;
    if (N < 0 || k < 1 || d < 0 || F < 0)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || d == 0)
        return 0;
    const dim3 grid((unsigned)((d + DOT_WARPS - 1) / DOT_WARPS), capped(N, MAX_GRID_Y));
    cudaStream_t st = (cudaStream_t)stream;
    if (bf16 && experts16)
        down_combine_kernel<uint16_t, true>
            <<<grid, DOT_THREADS, 0, st>>>(x, hs, choice, w, experts16, expert_stride, N, k, d, F);
    else if (bf16)
        down_combine_kernel<float, true>
            <<<grid, DOT_THREADS, 0, st>>>(x, hs, choice, w, experts, expert_stride, N, k, d, F);
    else
        down_combine_kernel<float, false>
            <<<grid, DOT_THREADS, 0, st>>>(x, hs, choice, w, experts, expert_stride, N, k, d, F);
    return launched();
}
