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
 * read before the row is written), by the whole block, in two passes like
 * the CPU's: the sum of squares, then y = x * rstd * w. Returns rstd =
 * 1 / sqrt(mean(x^2) + eps) to every thread; as block_sum, every thread
 * calls it. rmsnorm_kernel's rows and the fused router's normed row: one
 * function, the same bits. */
__device__ __forceinline__ float block_rmsnorm_row(float *y, const float *x, const float *w, int C,
                                                   float eps, float *red)
{
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        ss += x[c] * x[c];
    ss = block_sum(ss, red);
    const float r = nl_elem_rmsnorm_scale(ss, C, eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        y[c] = x[c] * r * w[c];
    return r;
}

/* Softmax of the row r[0, C) in place, by the whole block, in three passes
 * like the CPU's: the max, then exp(x - max) written back and summed, then
 * a scale by 1 / sum. A thread rereads only the elements it wrote itself,
 * so passes 2 and 3 need no barrier; as block_sum, every thread calls it.
 * softmax_kernel's rows and the fused router's probabilities: one
 * function, the same bits. */
__device__ __forceinline__ void block_softmax_row(float *r, int C, float *red)
{
    float m = -INFINITY;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        m = fmaxf(m, r[c]);
    m = block_max(m, red);
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float e = nl_elem_expf(r[c] - m);
        r[c] = e;
        s += e;
    }
    s = block_sum(s, red);
    const float inv = 1.0f / s;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        r[c] *= inv;
}

#endif
