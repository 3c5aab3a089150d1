/* bf16 compute on CUDA, the part the CPU emulation (tests/cuda_emu) runs:
 * the table of weight ranges with bf16 copies and their dirty flags, the
 * conversion kernels, AdamW writing the copy in the same pass as the
 * weights, and the tile map of the grouped expert GEMMs (cuda_mixed.h says
 * what each does). The tensor-core grouped GEMMs are in
 * cuda_grouped_bf16.cu, the dense GEMM's cuBLASLt call in cuda_backend.cu.
 *
 * Rounding: nl_elem_to_bf16 (kernels/elem.h), the CPU's rule, so a copy
 * made here holds the bits cpu_bf16.c makes. No atomics, no dynamic shared
 * memory, no allocation. */
#include "kernels/cuda/cuda_mixed.cuh"
#include "kernels/cuda/cuda_mixed.h"

#include "kernels/elem.h"

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

namespace
{

constexpr int CONV_THREADS = 256;
constexpr int MAP_THREADS = 256;
constexpr unsigned CONV_BLOCKS = 1u << 16; /* grid cap; the rest is strided */

unsigned conv_blocks(size_t n)
{
    const size_t want = (n + CONV_THREADS - 1) / CONV_THREADS;
    return want < CONV_BLOCKS ? (unsigned)(want ? want : 1) : CONV_BLOCKS;
}

__global__ void to_bf16_kernel(uint16_t *dst, const float *src, size_t n)
{
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        dst[i] = nl_elem_to_bf16(src[i]);
}

/* one row per blockIdx.y (strided), columns across the threads */
__global__ void to_bf16_rows_kernel(uint16_t *dst, int ld_dst, const float *src, int ld_src,
                                    int rows, int cols)
{
    for (size_t r = blockIdx.y; r < (size_t)rows; r += gridDim.y)
        for (int c = (int)(blockIdx.x * blockDim.x + threadIdx.x); c < cols;
             c += (int)(gridDim.x * blockDim.x))
            dst[r * ld_dst + c] = nl_elem_to_bf16(src[r * ld_src + c]);
}

__global__ void adamw_bf16_kernel(float *p, uint16_t *copy, const float *g, float *m, float *v,
                                  size_t n, float lr, float b1, float b2, float eps, float wd,
                                  float bc1, float bc2, float grad_scale)
{
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        nl_elem_adamw(&p[i], &m[i], &v[i], g[i], lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
        if (copy)
            copy[i] = nl_elem_to_bf16(p[i]);
    }
}

/* tile_start from offsets in one block: chunks of MAP_THREADS groups, each
 * an inclusive scan (Hillis-Steele in shared memory) added to the carry */
__global__ void tile_map_kernel(int32_t *tile_start, const int32_t *offsets, int groups,
                                int tile_rows)
{
    __shared__ int32_t s[MAP_THREADS];
    int32_t carry = 0;
    if (threadIdx.x == 0)
        tile_start[0] = 0;
    for (int base = 0; base < groups; base += MAP_THREADS) {
        const int g = base + (int)threadIdx.x;
        int32_t t = 0;
        if (g < groups) {
            const int32_t rows = offsets[g + 1] - offsets[g];
            t = rows > 0 ? (rows + tile_rows - 1) / tile_rows : 0;
        }
        s[threadIdx.x] = t;
        __syncthreads();
        for (int o = 1; o < MAP_THREADS; o <<= 1) {
            const int32_t add = (int)threadIdx.x >= o ? s[threadIdx.x - o] : 0;
            __syncthreads();
            s[threadIdx.x] += add;
            __syncthreads();
        }
        if (g < groups)
            tile_start[g + 1] = carry + s[threadIdx.x];
        carry += s[MAP_THREADS - 1];
        __syncthreads(); /* every thread read the total before s is refilled */
    }
}

int launched(void)
{
    return (int)cudaGetLastError();
}

bool overlaps(const nl_cuda_bf16_range *r, const void *p, size_t bytes)
{
    const char *c = (const char *)p, *b = (const char *)r->base;
    return r->base && bytes && c < b + r->n * sizeof(float) && c + bytes > b;
}

bool holds(const nl_cuda_bf16_range *r, const void *p, size_t bytes)
{
    const char *c = (const char *)p, *b = (const char *)r->base;
    return r->base && c >= b && c + bytes <= b + r->n * sizeof(float);
}

} // namespace

/* ---------------------------------------------------------------- the table */

extern "C" nl_cuda_bf16_range *nl_cuda_bf16_find_base(nl_cuda_bf16_table *t, const float *p)
{
    for (int i = 0; i < NL_CUDA_BF16_RANGES; i++)
        if (t->r[i].base && t->r[i].base == p)
            return &t->r[i];
    return NULL;
}

extern "C" nl_cuda_bf16_range *nl_cuda_bf16_free_entry(nl_cuda_bf16_table *t)
{
    for (int i = 0; i < NL_CUDA_BF16_RANGES; i++)
        if (!t->r[i].base)
            return &t->r[i];
    return NULL;
}

extern "C" nl_cuda_bf16_range *nl_cuda_bf16_inside(nl_cuda_bf16_table *t, const void *p,
                                                   size_t bytes)
{
    for (int i = 0; i < NL_CUDA_BF16_RANGES; i++)
        if (holds(&t->r[i], p, bytes))
            return &t->r[i];
    return NULL;
}

extern "C" void nl_cuda_bf16_mark(nl_cuda_bf16_table *t, const void *p, size_t bytes)
{
    for (int i = 0; i < NL_CUDA_BF16_RANGES; i++)
        if (overlaps(&t->r[i], p, bytes))
            t->r[i].stale = 1;
}

extern "C" uint16_t *nl_cuda_bf16_adamw_copy(nl_cuda_bf16_table *t, float *p, size_t n)
{
    const size_t bytes = n * sizeof(float);
    nl_cuda_bf16_range *r = nl_cuda_bf16_inside(t, p, bytes);
    if (r && !r->stale) {
        /* ranges may overlap (bf16_weights does not forbid it): any other
         * that these floats touch is stale now */
        for (int i = 0; i < NL_CUDA_BF16_RANGES; i++)
            if (&t->r[i] != r && overlaps(&t->r[i], p, bytes))
                t->r[i].stale = 1;
        return r->copy + (p - r->base);
    }
    nl_cuda_bf16_mark(t, p, bytes);
    return NULL;
}

extern "C" const uint16_t *nl_cuda_bf16_weight_operand(nl_cuda_bf16_table *t, void *stream,
                                                       const float *x, int rows, int cols, int ld,
                                                       int *rc)
{
    *rc = 0;
    if (rows <= 0 || cols <= 0)
        return NULL;
    const size_t extent = ((size_t)(rows - 1) * (size_t)ld + (size_t)cols) * sizeof(float);
    nl_cuda_bf16_range *r = nl_cuda_bf16_inside(t, x, extent);
    if (!r)
        return NULL;
    if (r->stale && t->capturing) {
        t->stale_in_capture = 1; /* the capture fails; the range stays stale */
    } else if (r->stale) {
        *rc = nl_cuda_to_bf16(stream, r->copy, r->base, r->n);
        if (*rc != 0)
            return NULL;
        r->stale = 0;
    }
    return r->copy + (x - r->base);
}

extern "C" int nl_cuda_bf16_refresh(nl_cuda_bf16_table *t, void *stream)
{
    if (t->capturing)
        return (int)cudaErrorStreamCaptureUnsupported;
    for (int i = 0; i < NL_CUDA_BF16_RANGES; i++) {
        nl_cuda_bf16_range *r = &t->r[i];
        if (!r->base || !r->stale)
            continue;
        const int rc = nl_cuda_to_bf16(stream, r->copy, r->base, r->n);
        if (rc != 0)
            return rc;
        r->stale = 0;
    }
    return 0;
}

/* ---------------------------------------------------------------- launchers */

extern "C" int nl_cuda_to_bf16(void *stream, uint16_t *dst, const float *src, size_t n)
{
    if (n == 0)
        return 0;
    to_bf16_kernel<<<conv_blocks(n), CONV_THREADS, 0, (cudaStream_t)stream>>>(dst, src, n);
    return launched();
}

extern "C" int nl_cuda_to_bf16_rows(void *stream, uint16_t *dst, int ld_dst, const float *src,
                                    int ld_src, int rows, int cols)
{
    if (rows < 0 || cols < 0 || ld_dst < cols || ld_src < cols)
        return (int)cudaErrorInvalidValue;
    if (rows == 0 || cols == 0)
        return 0;
    const unsigned cx = (unsigned)((cols + CONV_THREADS - 1) / CONV_THREADS);
    const dim3 grid(cx < 64 ? cx : 64, rows < 65535 ? (unsigned)rows : 65535u);
    to_bf16_rows_kernel<<<grid, CONV_THREADS, 0, (cudaStream_t)stream>>>(dst, ld_dst, src, ld_src,
                                                                         rows, cols);
    return launched();
}

extern "C" int nl_cuda_adamw_bf16(void *stream, float *p, uint16_t *copy, const float *g, float *m,
                                  float *v, size_t n, float lr, float b1, float b2, float eps,
                                  float wd, float bc1, float bc2, float grad_scale)
{
    if (n == 0)
        return 0;
    adamw_bf16_kernel<<<conv_blocks(n), CONV_THREADS, 0, (cudaStream_t)stream>>>(
        p, copy, g, m, v, n, lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
    return launched();
}

extern "C" int nl_cuda_tile_map(void *stream, int32_t *tile_start, const int32_t *offsets,
                                int groups, int tile_rows)
{
    if (groups < 0 || tile_rows < 1)
        return (int)cudaErrorInvalidValue;
    tile_map_kernel<<<1, MAP_THREADS, 0, (cudaStream_t)stream>>>(tile_start, offsets, groups,
                                                                 tile_rows);
    return launched();
}

extern "C" long nl_cuda_tile_bound(int groups, int max_rows, long total_rows, int tile_rows)
{
    if (groups <= 0 || max_rows <= 0 || tile_rows < 1)
        return 0;
    const long per = ((long)max_rows + tile_rows - 1) / tile_rows;
    long bound = per * groups;
    /* sum_g ceil(n_g / T) <= sum_g (n_g + T - 1) / T <= total / T + groups */
    if (total_rows >= 0) {
        const long by_total = (total_rows + tile_rows - 1) / tile_rows + groups;
        bound = by_total < bound ? by_total : bound;
    }
    return bound;
}
