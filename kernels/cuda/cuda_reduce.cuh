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

#endif
