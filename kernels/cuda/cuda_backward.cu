/* The CUDA backend's backward and optimizer kernels (all but attention's
 * backward, which has its own file): embedding, RMSNorm, SwiGLU, the MoE
 * combine, cross-entropy, the sum of squares and AdamW. Each is the twin of
 * the CPU backend's loop in kernels/cpu/cpu_backward.c, computing the same
 * per-element formula (kernels/elem.h) in the same order where it can.
 *
 * Determinism: no atomics anywhere. Every sum is either one thread's loop
 * in a fixed order or a warp butterfly and a fixed tree over the warps of
 * a block (as cuda_ops.cu), and every partition of work into blocks
 * depends on the shape only, never on timing. So two runs of the same
 * shapes give the same bits.
 *   - embedding: the (token, row) pairs of a piece of rows are sorted in
 *     scratch (a bitonic sort of unique 64-bit keys: one result whatever
 *     the schedule), then the block at the first position of each token
 *     adds that token's rows to dtable in ascending row order. Pieces run
 *     in row order, so every element of dtable receives its rows in
 *     ascending n: the CPU's order, the same bits.
 *   - RMSNorm dw: row groups that depend on N only, each summed by one
 *     thread per column into scratch, then the groups summed in order.
 *   - the sum of squares: a grid that depends on n only, a partial per
 *     block, one block sums the partials.
 *
 * Offsets are size_t (N x V logits pass 2^31). Grids are capped at
 * MAX_BLOCKS; rows past it are strided. No dynamic shared memory. */
#include "kernels/cuda/cuda_backward.h"

#include "kernels/elem.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace
{

#include "kernels/cuda/cuda_reduce.cuh"

constexpr int ELEM_THREADS = 256;
constexpr int SORT_TILE = 2048; /* keys sorted in shared memory (16 KiB) */
constexpr int DW_PARTS = 32;    /* most row groups of RMSNorm's dw */
constexpr int DW_THREADS = 256; /* columns per block of dw's partials */
constexpr int SUMSQ_THREADS = 256;
constexpr int SUMSQ_BLOCKS = 1024;  /* most partials of the sum of squares */
constexpr uint64_t KEY_PAD = ~0ull; /* sorts after every (token, row) key */

static_assert(SUMSQ_BLOCKS * sizeof(double) <= NL_CUDA_BWD_SCRATCH_MIN, "sumsq scratch");
static_assert(DW_PARTS * sizeof(float) <= NL_CUDA_BWD_SCRATCH_MIN, "dw scratch");

unsigned capped_blocks(size_t want)
{
    return want < MAX_BLOCKS ? (unsigned)want : MAX_BLOCKS;
}

/* ---------------------------------------------------------------- embedding */

/* Put the smaller key first when up, the larger when not. */
__device__ __forceinline__ void order(uint64_t *a, uint64_t *b, bool up)
{
    const uint64_t x = *a, y = *b;
    if ((x > y) == up) {
        *a = y;
        *b = x;
    }
}

/* Bitonic steps on tiles of `tile` keys (a power of two <= SORT_TILE) in
 * shared memory, tile b holding keys[b tile ...]: for each k = k_lo, 2 k_lo
 * .. k_hi the steps j = min(k, tile)/2 .. 1, direction from bit k of the
 * global index. With tokens non-NULL the keys are made first: key i is
 * (tokens[i] << 32) | i for i < n, KEY_PAD past it. */
__global__ void __launch_bounds__(SORT_TILE / 2)
    sort_tile_kernel(uint64_t *keys, const int32_t *tokens, int n, int tile, size_t k_lo,
                     size_t k_hi)
{
    __shared__ uint64_t s[SORT_TILE];
    const size_t base = (size_t)blockIdx.x * tile;
    for (int i = threadIdx.x; i < tile; i += blockDim.x) {
        const size_t g = base + i;
        if (tokens)
            s[i] = g < (size_t)n ? (uint64_t)(uint32_t)tokens[g] << 32 | g : KEY_PAD;
        else
            s[i] = keys[g];
    }
    __syncthreads();
    for (size_t k = k_lo; k <= k_hi; k <<= 1)
        for (int j = (int)(k < (size_t)tile ? k : tile) / 2; j > 0; j >>= 1) {
            for (int t = threadIdx.x; t < tile / 2; t += blockDim.x) {
                const int i = 2 * t - (t & (j - 1)); /* the pair (i, i + j) */
                order(&s[i], &s[i + j], ((base + i) & k) == 0);
            }
            __syncthreads();
        }
    for (int i = threadIdx.x; i < tile; i += blockDim.x)
        keys[base + i] = s[i];
}

/* One bitonic step (k, j >= SORT_TILE) over all P keys in global memory. */
__global__ void sort_step_kernel(uint64_t *keys, size_t P, size_t j, size_t k)
{
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < P / 2; t += step) {
        const size_t i = 2 * t - (t & (j - 1));
        order(&keys[i], &keys[i + j], (i & k) == 0);
    }
}

/* Sort keys[0, P) ascending (P a power of two). */
void sort_keys(cudaStream_t st, uint64_t *keys, const int32_t *tokens, int n, size_t P)
{
    const int tile = (int)(P < (size_t)SORT_TILE ? P : SORT_TILE);
    const unsigned tiles = (unsigned)(P / tile);
    const int threads = row_threads(tile / 2, SORT_TILE / 2);
    sort_tile_kernel<<<tiles, threads, 0, st>>>(keys, tokens, n, tile, 2, tile);
    for (size_t k = 2 * (size_t)tile; k <= P; k <<= 1) {
        for (size_t j = k / 2; j >= (size_t)tile; j >>= 1)
            sort_step_kernel<<<capped_blocks((P / 2 + ELEM_THREADS - 1) / ELEM_THREADS),
                               ELEM_THREADS, 0, st>>>(keys, P, j, k);
        sort_tile_kernel<<<tiles, threads, 0, st>>>(keys, nullptr, n, tile, k, k);
    }
}

/* keys[0, n) sorted (token, row) pairs of the rows n0 .. n0 + n - 1. The
 * block at the first position of a token's run adds the run's rows, in
 * the run's (ascending row) order, to that token's row of dtable; blocks
 * along y split the columns. */
__global__ void embedding_backward_kernel(float *dtable, const float *dout, const uint64_t *keys,
                                          int n0, int n, int C)
{
    for (size_t i = blockIdx.x; i < (size_t)n; i += gridDim.x) {
        const uint32_t tok = (uint32_t)(keys[i] >> 32);
        if (i > 0 && (uint32_t)(keys[i - 1] >> 32) == tok)
            continue; /* not the first row of its token */
        float *d = dtable + (size_t)tok * C;
        const size_t cstep = (size_t)gridDim.y * blockDim.x;
        for (size_t c = (size_t)blockIdx.y * blockDim.x + threadIdx.x; c < (size_t)C; c += cstep) {
            float acc = d[c];
            for (size_t j = i; j < (size_t)n && (uint32_t)(keys[j] >> 32) == tok; j++)
                acc += dout[((size_t)n0 + (uint32_t)keys[j]) * C + c];
            d[c] = acc;
        }
    }
}

/* ---------------------------------------------------------------- rmsnorm */

/* dinp += (w dout) rstd - inp rstd^3 / C sum(w dout inp), one row per
 * block (the CPU's formula and its order of operations). */
__global__ void rmsnorm_dinp_kernel(float *dinp, const float *dout, const float *inp,
                                    const float *w, const float *rstd, int N, int C)
{
    __shared__ float red[WARP];
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *x = inp + n * C, *g = dout + n * C;
        float *dx = dinp + n * C;
        const float r = rstd[n];
        float dot = 0.0f;
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            dot += w[c] * g[c] * x[c];
        dot = block_sum(dot, red);
        const float k = r * r * r / (float)C * dot;
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            dx[c] += w[c] * g[c] * r - x[c] * k;
    }
}

/* part[y, j] = sum over the rows of group y (rows_per rows from y
 * rows_per) of dout inp rstd at column c0 + j, in row order. */
__global__ void rmsnorm_dw_part_kernel(float *part, const float *dout, const float *inp,
                                       const float *rstd, int N, int C, int c0, int cw,
                                       int rows_per)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cw)
        return;
    const long r0 = (long)blockIdx.y * rows_per;
    const long r1 = r0 + rows_per < N ? r0 + rows_per : N;
    float acc = 0.0f;
    for (long n = r0; n < r1; n++) {
        const size_t o = (size_t)n * C + c0 + j;
        acc += dout[o] * inp[o] * rstd[n];
    }
    part[(size_t)blockIdx.y * cw + j] = acc;
}

/* dw[c0 + j] += the sum of part[0 .. parts-1, j] in group order. */
__global__ void rmsnorm_dw_reduce_kernel(float *dw, const float *part, int parts, int c0, int cw)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cw)
        return;
    float s = 0.0f;
    for (int p = 0; p < parts; p++)
        s += part[(size_t)p * cw + j];
    dw[c0 + j] += s;
}

/* ---------------------------------------------------------------- swiglu, moe */

__global__ void swiglu_backward_kernel(float *dgu, const float *dh, const float *gu, int N, int F)
{
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *g = gu + n * 2 * (size_t)F, *u = g + F, *d = dh + n * F;
        float *dg = dgu + n * 2 * (size_t)F, *du = dg + F;
        for (int j = threadIdx.x; j < F; j += blockDim.x)
            nl_elem_swiglu_backward(&dg[j], &du[j], g[j], u[j], d[j]);
    }
}

/* One block per (token, choice) e: dy[slot[e], :] = w[e] dx[n, :] and
 * dw[e] = dot(dx[n, :], y[slot[e], :]). */
__global__ void moe_combine_backward_kernel(float *dy, float *dw, const float *dx, const float *y,
                                            const int32_t *slot, const float *w, size_t S, int k,
                                            int C)
{
    __shared__ float red[WARP];
    for (size_t e = blockIdx.x; e < S; e += gridDim.x) {
        const float a = w[e];
        const float *g = dx + e / k * C, *yr = y + (size_t)slot[e] * C;
        float *dyr = dy + (size_t)slot[e] * C;
        float dot = 0.0f;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            dyr[c] = a * g[c];
            dot += g[c] * yr[c];
        }
        dot = block_sum(dot, red);
        if (threadIdx.x == 0)
            dw[e] = dot;
    }
}

/* ---------------------------------------------------------------- loss */

/* One row per block, the CPU's three passes: the max; exp(x - max) written
 * back and summed in double; the loss, then the scale by scale / sum and
 * scale taken off the target. */
__global__ void __launch_bounds__(1024)
    cross_entropy_kernel(float *logits, float *losses, const int32_t *targets, int N, int V,
                         float scale)
{
    __shared__ float redf[WARP];
    __shared__ double redd[WARP];
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        float *x = logits + n * V;
        const int t = targets[n];
        if (t < 0) { /* an ignored target (DESIGN 6), the same for the whole
                      * block: no loss, no gradient */
            for (int i = threadIdx.x; i < V; i += blockDim.x)
                x[i] = 0.0f;
            if (threadIdx.x == 0)
                losses[n] = 0.0f;
            continue;
        }
        /* read before the barriers of block_max, so before any write */
        const float xt = threadIdx.x == 0 ? x[t] : 0.0f;
        float m = -INFINITY;
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            m = fmaxf(m, x[i]);
        m = block_max(m, redf);
        double sum = 0.0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float e = nl_elem_expf(x[i] - m);
            x[i] = e;
            sum += e;
        }
        sum = block_sum(sum, redd);
        if (threadIdx.x == 0)
            losses[n] = (float)((double)m + log(sum) - (double)xt);
        const float a = (float)((double)scale / sum);
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            /* two roundings as on the CPU, not one fused multiply-add:
             * at the target p - 1 may cancel */
            float g = __fmul_rn(x[i], a);
            if (i == t)
                g -= scale;
            x[i] = g;
        }
    }
}

/* ---------------------------------------------------------------- optimizer */

__global__ void sumsq_part_kernel(double *part, const float *x, size_t n)
{
    __shared__ double red[WARP];
    const size_t step = (size_t)gridDim.x * blockDim.x;
    double acc = 0.0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const double v = x[i];
        acc += v * v; /* exact: a float's square fits a double */
    }
    acc = block_sum(acc, red);
    if (threadIdx.x == 0)
        part[blockIdx.x] = acc;
}

__global__ void sumsq_final_kernel(double *out, const double *part, int parts)
{
    __shared__ double red[WARP];
    double acc = 0.0;
    for (int i = threadIdx.x; i < parts; i += blockDim.x)
        acc += part[i];
    acc = block_sum(acc, red);
    if (threadIdx.x == 0)
        *out = acc;
}

__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, size_t n, float lr,
                             float b1, float b2, float eps, float wd, float bc1, float bc2,
                             float grad_scale)
{
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        nl_elem_adamw(&p[i], &m[i], &v[i], g[i], lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
}

int launched(void)
{
    return (int)cudaGetLastError();
}

} // namespace

/* ---------------------------------------------------------------- launchers */

extern "C" int nl_cuda_embedding_backward(void *stream, float *dtable, const float *dout,
                                          const int32_t *tokens, int N, int C, void *scratch,
                                          size_t scratch_bytes)
{
    if (N < 0 || C < 0 || scratch_bytes < NL_CUDA_BWD_SCRATCH_MIN)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || C == 0)
        return 0;
    cudaStream_t st = (cudaStream_t)stream;
    uint64_t *keys = (uint64_t *)scratch;
    /* rows per piece: the largest power of two of keys the scratch holds */
    size_t cap = 1;
    while (cap * 2 * sizeof(uint64_t) <= scratch_bytes && cap * 2 <= (size_t)1 << 30)
        cap *= 2;
    const int threads = row_threads(C, 256);
    const size_t ctiles = ((size_t)C + threads - 1) / threads;
    int rc = 0;
    for (long n0 = 0; n0 < N && rc == 0; n0 += (long)cap) {
        const int n = (int)(N - n0 < (long)cap ? N - n0 : (long)cap);
        size_t P = 1;
        while (P < (size_t)n)
            P *= 2;
        sort_keys(st, keys, tokens + n0, n, P);
        const dim3 grid(capped_blocks((size_t)n), ctiles < 65535 ? (unsigned)ctiles : 65535u);
        embedding_backward_kernel<<<grid, threads, 0, st>>>(dtable, dout, keys, (int)n0, n, C);
        rc = launched();
    }
    return rc;
}

extern "C" int nl_cuda_rmsnorm_backward(void *stream, float *dinp, float *dw, const float *dout,
                                        const float *inp, const float *w, const float *rstd, int N,
                                        int C, void *scratch, size_t scratch_bytes)
{
    if (N < 0 || C < 0 || scratch_bytes < NL_CUDA_BWD_SCRATCH_MIN)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || C == 0)
        return 0;
    cudaStream_t st = (cudaStream_t)stream;
    rmsnorm_dinp_kernel<<<capped_blocks((size_t)N), row_threads(C, 512), 0, st>>>(dinp, dout, inp,
                                                                                  w, rstd, N, C);
    int rc = launched();
    /* row groups from N alone; columns in pieces the scratch holds */
    const int rows_per = (N + DW_PARTS - 1) / DW_PARTS;
    const int parts = (N + rows_per - 1) / rows_per;
    const size_t cap = scratch_bytes / sizeof(float) / (size_t)parts;
    const int cw_max = cap < (size_t)C ? (int)cap : C;
    float *part = (float *)scratch;
    for (int c0 = 0; c0 < C && rc == 0; c0 += cw_max) {
        const int cw = C - c0 < cw_max ? C - c0 : cw_max;
        const unsigned bx = (unsigned)((cw + DW_THREADS - 1) / DW_THREADS);
        rmsnorm_dw_part_kernel<<<dim3(bx, (unsigned)parts), DW_THREADS, 0, st>>>(
            part, dout, inp, rstd, N, C, c0, cw, rows_per);
        rmsnorm_dw_reduce_kernel<<<bx, DW_THREADS, 0, st>>>(dw, part, parts, c0, cw);
        rc = launched();
    }
    return rc;
}

extern "C" int nl_cuda_swiglu_backward(void *stream, float *dgu, const float *dh, const float *gu,
                                       int N, int F)
{
    if (N < 0 || F < 0)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || F == 0)
        return 0;
    swiglu_backward_kernel<<<capped_blocks((size_t)N), row_threads(F, 256), 0,
                             (cudaStream_t)stream>>>(dgu, dh, gu, N, F);
    return launched();
}

extern "C" int nl_cuda_moe_combine_backward(void *stream, float *dy, float *dw, const float *dx,
                                            const float *y, const int32_t *slot, const float *w,
                                            int N, int k, int C)
{
    if (N < 0 || k < 0 || C < 0)
        return (int)cudaErrorInvalidValue;
    const size_t S = (size_t)N * k;
    if (S == 0 || C == 0)
        return 0;
    moe_combine_backward_kernel<<<capped_blocks(S), row_threads(C, 256), 0, (cudaStream_t)stream>>>(
        dy, dw, dx, y, slot, w, S, k, C);
    return launched();
}

extern "C" int nl_cuda_cross_entropy(void *stream, float *logits, float *losses,
                                     const int32_t *targets, int N, int V, float scale)
{
    if (N < 0 || V < 0)
        return (int)cudaErrorInvalidValue;
    if (N == 0 || V == 0)
        return 0;
    /* a vocabulary row gets a whole 1024-thread block */
    cross_entropy_kernel<<<capped_blocks((size_t)N), row_threads(V, V > 8192 ? 1024 : 256), 0,
                           (cudaStream_t)stream>>>(logits, losses, targets, N, V, scale);
    return launched();
}

extern "C" int nl_cuda_sumsq(void *stream, double *out, const float *x, size_t n, void *scratch,
                             size_t scratch_bytes)
{
    if (scratch_bytes < NL_CUDA_BWD_SCRATCH_MIN)
        return (int)cudaErrorInvalidValue;
    if (n == 0)
        return 0;
    cudaStream_t st = (cudaStream_t)stream;
    const size_t want = (n + SUMSQ_THREADS - 1) / SUMSQ_THREADS;
    const int parts = want < (size_t)SUMSQ_BLOCKS ? (int)want : SUMSQ_BLOCKS;
    double *part = (double *)scratch;
    sumsq_part_kernel<<<parts, SUMSQ_THREADS, 0, st>>>(part, x, n);
    sumsq_final_kernel<<<1, SUMSQ_THREADS, 0, st>>>(out, part, parts);
    return launched();
}

extern "C" int nl_cuda_adamw(void *stream, float *p, const float *g, float *m, float *v, size_t n,
                             float lr, float b1, float b2, float eps, float wd, float bc1,
                             float bc2, float grad_scale)
{
    if (n == 0)
        return 0;
    const size_t want = (n + ELEM_THREADS - 1) / ELEM_THREADS;
    adamw_kernel<<<capped_blocks(want), ELEM_THREADS, 0, (cudaStream_t)stream>>>(
        p, g, m, v, n, lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
    return launched();
}
