/* A CUDA runtime shim for running the CUDA backend's kernels on the CPU
 * (tests/cuda_emu): the subset of CUDA that kernels/cuda/cuda_ops.cu and
 * cuda_attention.cu use, compiled by the host C++ compiler.
 *
 * How it works (emu.cc has the runtime):
 * - A launch runs its blocks one after another. The threads of a block
 *   are coroutines on one OS thread, each with its own stack; a thread runs
 *   until it reaches a barrier (__syncthreads, a shuffle, __syncwarp) or
 *   returns, then the next runnable thread of the block runs.
 * - __syncthreads is a real block barrier and a shuffle a real warp
 *   barrier: a thread waits there until every thread of its block (warp)
 *   has arrived at the same call site. A barrier some threads never reach
 *   (divergence, an early return) is reported as a launch failure.
 * - Scheduling is warp-greedy: a warp runs until all its lanes wait at a
 *   __syncthreads or have returned, then the next warp runs. Every block
 *   draws its own order from the seed (NL_EMU_SEED, default 1, or
 *   emu_set_seed), the launch count and its index: the warps forwards,
 *   backwards (a quarter of the blocks each) or shuffled (half), the lanes
 *   of a warp upwards or downwards. So a missing __syncthreads lets one
 *   warp overwrite or read shared memory before the others are done, as it
 *   can on a GPU, and a result that depends on the order differs between
 *   blocks and between seeds (CTest runs the test with two seeds).
 * - __shared__ variables are statics in one linker section that is filled
 *   before every block with one of three poison bytes, drawn like the
 *   order: 0xff (NaN), 0x7f (3.39e38, finite) or 0xc7 (-1.0e5): reading
 *   shared memory no thread of the block wrote gives garbage, never the
 *   previous block's data or zeros, and not only NaN (which fmaxf, a
 *   compare or a select can silently drop).
 * - Partial warps (a block size not a multiple of 32) are modelled: the
 *   missing lanes never arrive, a shuffle whose source lane is missing
 *   returns all-ones bits (NaN as a float; undefined on a GPU), and a
 *   lane that returned before a shuffle its warp makes is a deadlock.
 * - Locals: test_cuda_emu is compiled with -ftrivial-auto-var-init=pattern
 *   where the compiler has it, so a kernel's uninitialised local starts as
 *   0xfe bytes (-1.69e38), not whatever the reused coroutine stack held.
 * - __CUDA_ARCH__ is defined, so kernels/elem.h takes its device branch
 *   (expf, not the CPU's polynomial).
 * - The launch syntax k<<<grid, block, smem, stream>>>(args) is rewritten
 *   at build time (chevrons.cmake) to k | emu_cfg(grid, block, smem,
 *   stream)(args), which the operator| below turns into a launch.
 *
 * Kernels run synchronously; cudaGetLastError reports a bad launch
 * configuration or an emulation failure (deadlock, barrier divergence).
 * Not emulated: streams, events, memory copies, dynamic shared memory,
 * atomics (no kernel here uses them: the backward kernels are
 * deterministic by design). */
#ifndef NL_CUDA_EMU_RUNTIME_H
#define NL_CUDA_EMU_RUNTIME_H

#include <algorithm>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <tuple>
#include <type_traits>
#include <utility>

#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
/* every __shared__ variable of every kernel lives in this section (the
 * linker's __start_/__stop_ symbols bound it); see the header comment */
#define __shared__ static __attribute__((section("nl_emu_shared")))

using std::max;
using std::min;

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
    unsigned x, y, z;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};

typedef struct CUstream_st *cudaStream_t;
enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorLaunchFailure = 719,
    cudaErrorStreamCaptureUnsupported = 900,
};

/* The current thread's coordinates, set by the scheduler on every switch. */
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
constexpr int warpSize = 32;

cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t e);

/* ---------------------------------------------------------------- barriers */

/* line: the call site, to check that a barrier's threads meet at one */
void emu_syncthreads(int line);
void emu_syncwarp(unsigned mask, int line);
/* Publish 8 bytes for the warp and wait for every lane: returns the bytes
 * lane src published (src outside the warp: the caller's own). */
uint64_t emu_warp_exchange(unsigned mask, uint64_t mine, int src, int line);
unsigned emu_lane(void);

#define __syncthreads() emu_syncthreads(__LINE__)
#define __syncwarp(...) emu_syncwarp(emu_mask_or_full(__VA_ARGS__), __LINE__)
inline unsigned emu_mask_or_full(unsigned m = 0xffffffffu)
{
    return m;
}

template <class T> inline uint64_t emu_bits(T v)
{
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}

template <class T> inline T emu_from_bits(uint64_t u)
{
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The shuffles of CUDA's programming guide, width a power of two <= 32:
 * the lanes are split into groups of `width`. */
template <class T> inline T emu_shfl(unsigned mask, T v, int src, int line)
{
    return emu_from_bits<T>(emu_warp_exchange(mask, emu_bits(v), src, line));
}

#define __shfl_sync(mask, v, ...) emu_shfl_idx(mask, v, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(mask, v, ...) emu_shfl_xor(mask, v, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(mask, v, ...) emu_shfl_up(mask, v, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(mask, v, ...) emu_shfl_down(mask, v, __LINE__, __VA_ARGS__)

template <class T> inline T emu_shfl_idx(unsigned mask, T v, int line, int src, int width = 32)
{
    const int lane = (int)emu_lane();
    return emu_shfl(mask, v, (lane & ~(width - 1)) + (src & (width - 1)), line);
}

template <class T> inline T emu_shfl_xor(unsigned mask, T v, int line, int lm, int width = 32)
{
    const int lane = (int)emu_lane();
    const int src = lane ^ lm;
    /* a source past the lane's group reads the lane's own value */
    return emu_shfl(mask, v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane, line);
}

template <class T> inline T emu_shfl_up(unsigned mask, T v, int line, unsigned d, int width = 32)
{
    const int lane = (int)emu_lane();
    const int src = lane - (int)d;
    return emu_shfl(mask, v, src >= (lane & ~(width - 1)) ? src : lane, line);
}

template <class T> inline T emu_shfl_down(unsigned mask, T v, int line, unsigned d, int width = 32)
{
    const int lane = (int)emu_lane();
    const int src = lane + (int)d;
    return emu_shfl(mask, v, src < (lane & ~(width - 1)) + width ? src : lane, line);
}

/* Vote functions: a warp exchange of the predicate, then the reduction. */
unsigned emu_ballot(unsigned mask, int pred, int line);
#define __ballot_sync(mask, pred) emu_ballot(mask, (pred) != 0, __LINE__)
#define __any_sync(mask, pred) (emu_ballot(mask, (pred) != 0, __LINE__) != 0u)
#define __all_sync(mask, pred) (emu_ballot(mask, !(pred), __LINE__) == 0u)

/* ---------------------------------------------------------------- math */

/* The device's integer and float min/max come from std (above) and
 * <math.h>; fmaf, expf, logf, sqrtf, sincos are the host's. */
inline float __fdividef(float a, float b)
{
    return a / b;
}
inline float __expf(float x)
{
    return expf(x);
}
inline float __logf(float x)
{
    return logf(x);
}
inline float rsqrtf(float x)
{
    return 1.0f / sqrtf(x);
}
/* A product rounded on its own, never fused into a following add (nvcc's
 * __fmul_rn): the volatile hides the value from the compiler's FMA
 * contraction (test_cuda_emu is built with -ffp-contract=fast where the
 * target has FMA). */
inline float __fmul_rn(float a, float b)
{
    volatile float r = a * b;
    return r;
}

/* ---------------------------------------------------------------- launch */

/* Run body() once for every thread of every block of the grid. Sets the
 * error cudaGetLastError returns when the configuration is bad or a block
 * fails (the message goes to stderr). */
void emu_run(dim3 grid, dim3 block, size_t shmem, void (*body)(void *), void *arg);

/* How many launches were made (the test checks that an empty shape
 * launches nothing). */
long emu_launch_count(void);
/* The seed of the blocks' schedules and poison bytes (else NL_EMU_SEED). */
void emu_set_seed(uint64_t s);

/* k<<<grid, block, shmem, stream>>>(args...) is rewritten to
 * k | emu_cfg(grid, block, shmem, stream)(args...): the config object
 * captures the arguments, and operator| with the kernel launches. */
template <class... A> struct emu_pending {
    dim3 grid, block;
    size_t shmem;
    std::tuple<A...> args;
};

struct emu_cfg {
    dim3 grid, block;
    size_t shmem;
    emu_cfg(dim3 g, dim3 b, size_t s = 0, cudaStream_t = nullptr) : grid(g), block(b), shmem(s) {}
    template <class... A> emu_pending<std::decay_t<A>...> operator()(A &&...a) const
    {
        return {grid, block, shmem, std::tuple<std::decay_t<A>...>(std::forward<A>(a)...)};
    }
};

template <class... P, class... A> void operator|(void (*kernel)(P...), emu_pending<A...> &&p)
{
    static_assert(sizeof...(P) == sizeof...(A), "kernel argument count");
    struct call {
        void (*kernel)(P...);
        std::tuple<A...> *args;
        static void run(void *c)
        {
            call *self = static_cast<call *>(c);
            std::apply([self](A &...a) { self->kernel(a...); }, *self->args);
        }
    } c = {kernel, &p.args};
    emu_run(p.grid, p.block, p.shmem, &call::run, &c);
}

#endif
