/* The CUDA kernels of the model variants of DESIGN.md section 6 other than
 * the masked attention (which lives with the attention kernels): GeGLU
 * forward and backward and RoPE with YaRN's scaled frequencies. Each is the
 * twin of the CPU backend's loop (kernels/cpu/cpu_backend.c,
 * cpu_backward.c), computing the same per-element formula (kernels/elem.h):
 * - GeGLU: row kernels as SwiGLU's in cuda_ops.cu (a block walks whole
 *   rows, every gridDim.x-th one; threads stride along the row);
 * - YaRN: RoPE's kernel with a frequency table built by the block in
 *   double (nl_elem_yarn_freq) and cos and sin scaled by m in double before
 *   the rounding to float, as the CPU does.
 * No atomics, no dynamic shared memory, no allocation. */
#include "kernels/cuda/cuda_family.h"

#include "kernels/elem.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace
{

#include "kernels/cuda/cuda_reduce.cuh"

constexpr int ROPE_THREADS = 128;

unsigned row_blocks(int rows)
{
    return (unsigned)rows < MAX_BLOCKS ? (unsigned)rows : MAX_BLOCKS;
}

/* out[n, j] = gelu(gu[n, j]) * gu[n, F + j] */
__global__ void geglu_kernel(float *out, const float *gu, int N, int F)
{
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *g = gu + n * 2 * (size_t)F;
        const float *u = g + F;
        float *o = out + n * F;
        for (int j = threadIdx.x; j < F; j += blockDim.x)
            o[j] = nl_elem_geglu(g[j], u[j]);
    }
}

/* dgu = [dh u gelu'(g) | dh gelu(g)] */
__global__ void geglu_backward_kernel(float *dgu, const float *dh, const float *gu, int N, int F)
{
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *g = gu + n * 2 * (size_t)F, *u = g + F, *d = dh + n * F;
        float *dg = dgu + n * 2 * (size_t)F, *du = dg + F;
        for (int j = threadIdx.x; j < F; j += blockDim.x)
            nl_elem_geglu_backward(&dg[j], &du[j], g[j], u[j], d[j]);
    }
}

/* One thread per (row, pair i): angle pos * theta'_i in double, cos and sin
 * times YaRN's m in double, then the pair i of every head. */
__global__ void rope_yarn_kernel(float *x, const int32_t *pos, int N, int row, int col0, int heads,
                                 int hd, float base, nl_rope_scaling sc)
{
    __shared__ double freq[NL_BACKEND_MAX_HEAD_DIM / 2];
    const int half = hd / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        freq[i] = nl_elem_yarn_freq(i, hd, base, sc.factor, sc.original_max_seq_len, sc.beta_fast,
                                    sc.beta_slow);
    __syncthreads();
    const double m = nl_elem_yarn_mscale(sc.factor);
    const size_t total = (size_t)N * half;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
        const size_t n = e / half;
        const int i = (int)(e % half);
        double s, c;
        sincos((double)pos[n] * freq[i], &s, &c);
        const float cf = (float)(c * m), sf = (float)(s * m);
        float *p = x + n * row + col0 + 2 * i;
        for (int h = 0; h < heads; h++)
            nl_elem_rope_rotate(&p[(size_t)h * hd], &p[(size_t)h * hd + 1], cf, sf);
    }
}

int launched(void)
{
    return (int)cudaGetLastError();
}

} // namespace

/* ---------------------------------------------------------------- launchers */

extern "C" int nl_cuda_geglu_forward(void *stream, float *out, const float *gu, int N, int F)
{
    if (N < 0 || F < 0)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || F == 0)
        return 0;
    geglu_kernel<<<row_blocks(N), row_threads(F, 256), 0, (cudaStream_t)stream>>>(out, gu, N, F);
    return launched();
}

extern "C" int nl_cuda_geglu_backward(void *stream, float *dgu, const float *dh, const float *gu,
                                      int N, int F)
{
    if (N < 0 || F < 0)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || F == 0)
        return 0;
    geglu_backward_kernel<<<row_blocks(N), row_threads(F, 256), 0, (cudaStream_t)stream>>>(
        dgu, dh, gu, N, F);
    return launched();
}

extern "C" int nl_cuda_rope_yarn_forward(void *stream, float *x, const int32_t *pos, int N, int row,
                                         int col0, int heads, int hd, float base,
                                         nl_rope_scaling sc)
{
    if (hd > NL_BACKEND_MAX_HEAD_DIM || row < 0 || col0 < 0 || heads < 0 || N < 0)
        return (int)cudaErrorInvalidValue;
    /* the formula's domain: a factor above 0 (ln), distinct betas, L0 > 0 */
    if (!(sc.factor > 0.0) || !(sc.beta_fast != sc.beta_slow) || sc.original_max_seq_len <= 0)
        return (int)cudaErrorInvalidValue;
    const int half = hd / 2;
    if (N == 0 || half <= 0 || heads == 0)
        return 0;
    const size_t total = (size_t)N * half;
    const size_t want = (total + ROPE_THREADS - 1) / ROPE_THREADS;
    const unsigned blocks = want < MAX_BLOCKS ? (unsigned)want : MAX_BLOCKS;
    rope_yarn_kernel<<<blocks, ROPE_THREADS, 0, (cudaStream_t)stream>>>(x, pos, N, row, col0, heads,
                                                                        hd, base, sc);
    return launched();
}
