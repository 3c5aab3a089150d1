/* int nl_emu_selfcheck(void); -- call from test_cuda_emu's main:
 *   CHECK(nl_emu_selfcheck() == 0, "the emulator's own checks");
 *
 * The emulator (emu.cc) against kernels that are wrong on purpose, in the
 * ways a GPU shows and a kind emulator hides: each check passes only when
 * the emulation exposes the bug. They are the reproduction asked for by
 * issue 28 (make the emulation catch the class of bug the first H100 run
 * was suspected of; that failure itself was the selftest's check, see
 * emu_attention_bwd.cc's T = 1 case):
 *   - shared memory never written, read through fmaxf: NaN poison alone
 *     hides it (fmaxf drops the NaN and the answer looks right), so some
 *     blocks must get a finite poison and a wrong answer;
 *   - a missing __syncthreads: warp 0 reads what warp 1 writes; the result
 *     must differ between blocks (the warp order varies);
 *   - a partial warp (48 threads): a shuffle from a lane that does not
 *     exist must give NaN, not the caller's own value. */
#include "tests/cuda_emu/cuda_runtime.h"

/* kernels written here, so launched in the form chevrons.cmake gives the
 * real sources' k<<<grid, block>>>(args): k | emu_cfg(grid, block)(args) */

#include "tests/check.h"

#include <math.h>
#include <vector>

namespace
{

constexpr int SC_BLOCKS = 32;

/* max of 32 inputs, but the loop runs over 64 shared floats of which the
 * block writes 32 */
__global__ void sc_unwritten_max(float *out, const float *x)
{
    __shared__ float s[64];
    if (threadIdx.x < 32)
        s[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = -INFINITY;
        for (int i = 0; i < 64; i++)
            m = fmaxf(m, s[i]);
        out[blockIdx.x] = m;
    }
}

/* warp 1 writes a flag that warp 0 reads, no barrier between */
__global__ void sc_race(float *out)
{
    __shared__ float flag;
    if (threadIdx.x == 32)
        flag = 1.0f;
    if (threadIdx.x == 0) {
        out[blockIdx.x] = flag == 1.0f ? 1.0f : 0.0f;
    }
    __syncthreads();
}

/* 48 threads: lane l of warp 1 (16 lanes) reads lane l ^ 16, which is not
 * there */
__global__ void sc_partial_warp(float *out)
{
    const float v = (float)threadIdx.x;
    const float u = __shfl_xor_sync(0xffffffffu, v, 16);
    out[threadIdx.x] = u;
}

} // namespace

int nl_emu_selfcheck(void)
{
    /* shared memory never written */
    std::vector<float> x(32), out(SC_BLOCKS);
    for (int i = 0; i < 32; i++)
        x[i] = (float)(i % 7) - 3.0f; /* max 3 */
    sc_unwritten_max | emu_cfg(SC_BLOCKS, 64)(out.data(), x.data());
    CHECK(cudaGetLastError() == cudaSuccess, "sc_unwritten_max launch");
    int wrong = 0, right = 0;
    for (float m : out)
        m == 3.0f ? right++ : wrong++;
    CHECK(wrong > 0,
          "a read of unwritten shared memory through fmaxf went unnoticed in %d blocks "
          "(poison is NaN only?)",
          right);

    /* a missing barrier */
    sc_race | emu_cfg(SC_BLOCKS, 64)(out.data());
    CHECK(cudaGetLastError() == cudaSuccess, "sc_race launch");
    int seen = 0;
    for (float f : out)
        seen += f == 1.0f;
    CHECK(seen > 0 && seen < SC_BLOCKS,
          "a missing __syncthreads gave the same answer in every block (%d of %d saw the write): "
          "the warp order does not vary",
          seen, SC_BLOCKS);

    /* a partial warp */
    std::vector<float> pw(48, 0.0f);
    sc_partial_warp | emu_cfg(1, 48)(pw.data());
    CHECK(cudaGetLastError() == cudaSuccess, "sc_partial_warp launch");
    int nan_lanes = 0, own = 0;
    for (int t = 32; t < 48; t++) {
        nan_lanes += isnan(pw[t]);
        own += pw[t] == (float)t;
    }
    CHECK(nan_lanes == 16,
          "a shuffle from a missing lane of a partial warp: %d of 16 NaN, %d read "
          "their own value",
          nan_lanes, own);
    bool full_ok = true;
    for (int t = 0; t < 32; t++)
        full_ok &= pw[t] == (float)(t ^ 16);
    CHECK(full_ok, "the full warp of the 48-thread block shuffled wrong");
    return check_fail_count;
}
