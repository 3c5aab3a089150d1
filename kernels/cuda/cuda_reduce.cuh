/* Warp and block reductions shared by the CUDA kernels (private to
 * kernels/cuda; each .cu includes it inside its own unnamed namespace, so
 * nothing here is an exported symbol). Every reduction has a fixed order:
 * a warp butterfly (lane i adds v_i + v_{i^o}, its partner v_{i^o} + v_i,
 * so every lane ends with the same bits), then one warp over the per-warp
 * partials in shared memory. Block sizes are multiples of 32. */
#ifndef NL_CUDA_REDUCE_CUH
#define NL_CUDA_REDUCE_CUH

constexpr int WARP = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr unsigned MAX_BLOCKS = 1u << 20; /* grid cap; rows past it are strided */

/* Threads for a block that walks rows of width C: C rounded up to a whole
 * warp, between 32 and cap (a multiple of 32). */
inline int row_threads(long C, int cap)
{
    const long t = (C + WARP - 1) / WARP * WARP;
    return t < WARP ? WARP : t > cap ? cap : (int)t;
}

/* The threads of rmsnorm_kernel's and softmax_kernel's blocks for rows of
 * width C, which the fused router's RMSNorm and softmax reproduce (their
 * reductions' order follows the thread count) */
inline int rmsnorm_threads(long C)
{
    return row_threads(C, 512);
}
inline int softmax_threads(long C)
{
    return row_threads(C, C > 8192 ? 1024 : 256); /* a vocabulary: a whole block a row */
}

template <class T> __device__ __forceinline__ T warp_sum(T v)
{
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1)
        v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

/* Sum of v over the block, returned to every thread; red is WARP elements
 * of shared memory. Every thread of the block must call it (it
 * synchronises). */
template <class T> __device__ T block_sum(T v, T *red)
{
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int nw = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads(); /* the previous call's readers are done with red */
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    return warp_sum(lane < nw ? red[lane] : (T)0);
}

/* Max of v over the block (NaN ignored, as the CPU's compare-and-select
 * does), returned to every thread; as block_sum. */
__device__ __forceinline__ float block_max(float v, float *red)
{
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int nw = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    return warp_max(lane < nw ? red[lane] : -INFINITY);
}

/* RMSNorm of the row x[0, C) into y (y == x is fine: every element is
 * read before the row is written), by the block, in two passes like the
 * CPU's: the sum of squares, then y = x * rstd * w. Threads [0, T) take
 * part in the sum (T a multiple of 32, at most blockDim.x; the others add
 * nothing), so a kernel with a wider block gets the bits of a T-thread
 * one. Returns rstd = 1 / sqrt(mean(x^2) + eps) to every thread; as
 * block_sum, every thread calls it. rmsnorm_kernel's rows (T its block)
 * and the fused router's normed row: one function, the same bits. */
__device__ __forceinline__ float block_rmsnorm_row(float *y, const float *x, const float *w, int C,
                                                   float eps, float *red, int T)
{
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C && (int)threadIdx.x < T; c += T)
        ss += x[c] * x[c];
    ss = block_sum(ss, red);
    const float r = nl_elem_rmsnorm_scale(ss, C, eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        y[c] = x[c] * r * w[c];
    return r;
}

/* Softmax of the row r[0, C) in place, by threads [0, T) of the block (T
 * as in block_rmsnorm_row; the others take part in the reductions with
 * nothing), in three passes like the CPU's: the max, then exp(x - max)
 * written back and summed, then a scale by 1 / sum. A thread rereads only
 * the elements it wrote itself, so passes 2 and 3 need no barrier; as
 * block_sum, every thread calls it. softmax_kernel's rows (T its block)
 * and the fused router's probabilities: one function, the same bits. */
__device__ __forceinline__ void block_softmax_row(float *r, int C, float *red, int T)
{
    const bool in = (int)threadIdx.x < T;
    float m = -INFINITY;
    for (int c = threadIdx.x; in && c < C; c += T)
        m = fmaxf(m, r[c]);
    m = block_max(m, red);
    float s = 0.0f;
    for (int c = threadIdx.x; in && c < C; c += T) {
        const float e = nl_elem_expf(r[c] - m);
        r[c] = e;
        s += e;
    }
    s = block_sum(s, red);
    const float inv = 1.0f / s;
    for (int c = threadIdx.x; in && c < C; c += T)
        r[c] *= inv;
}

/* ---------------------------------------------------------------- the row dot
 *
 * The one dot product of the row-invariant products (gemm_rows,
 * kernels/cuda/cuda_rows.cu; the few-row and row-invariant grouped GEMMs,
 * cuda_moe.cu; the fused decode kernels, cuda_fused.cu): one function, so
 * a row gets the same bits from each. One warp computes s[i] = a_i . w
 * over K for the rows i < live (at most R) of a (row stride lda): lane l
 * adds k = l, l + 32, ... in order with fused multiply-adds, then the xor
 * tree of warp_sum; every lane gets every sum. A row's sum depends on
 * that row and w alone, never on live, R or the other rows. Weights W:
 * float, or uint16_t bf16 bits (the bf16 weight copies, widened exactly);
 * with BF16 each activation (and a float weight) is rounded to bf16 first,
 * so a product is bf16 x bf16 summed in FP32 whichever form the weight is
 * read in. */
template <bool BF16> __device__ __forceinline__ float dot_operand(float v)
{
    return BF16 ? nl_elem_from_bf16(nl_elem_to_bf16(v)) : v;
}
template <bool BF16> __device__ __forceinline__ float dot_weight(const float *w, int k)
{
    return dot_operand<BF16>(w[k]);
}
template <bool BF16> __device__ __forceinline__ float dot_weight(const uint16_t *w, int k)
{
    return nl_elem_from_bf16(w[k]);
}

template <typename W, bool BF16, int R>
__device__ __forceinline__ void warp_dot_rows(float (&s)[R], const float *a, size_t lda, int live,
                                              const W *w, int K, int lane)
{
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; i++)
        acc[i] = 0.0f;
#pragma unroll 4
    for (int k = lane; k < K; k += WARP) {
        const float wk = dot_weight<BF16>(w, k);
#pragma unroll
        for (int i = 0; i < R; i++)
            if (i < live)
                acc[i] = fmaf(dot_operand<BF16>(a[(size_t)i * lda + k]), wk, acc[i]);
    }
#pragma unroll
    for (int i = 0; i < R; i++)
        s[i] = warp_sum(acc[i]);
}

/* a . w over n elements (FP32), every lane getting the sum: one row of
 * warp_dot_rows */
__device__ __forceinline__ float warp_dot(const float *a, const float *w, int n, int lane)
{
    float s[1];
    warp_dot_rows<float, false, 1>(s, a, 0, 1, w, n, lane);
    return s[0];
}

#endif
