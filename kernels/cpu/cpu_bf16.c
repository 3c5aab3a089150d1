/* bf16 compute on the CPU: GEMMs through oneDNN's bf16 GEMM with FP32
 * accumulation, from bf16 copies of the weights that are made again after
 * any write into them (an optimizer step, an upload), and run-time
 * detection of the instructions that make it fast.
 *
 * oneDNN 2.x exports dnnl_gemm_bf16bf16f32 (row-major, like dnnl_sgemm)
 * from libdnnl with C linkage but declares it only in an internal header,
 * so it is declared here; bfloat16_t there is a struct of one uint16_t.
 *
 * Rounding: every operand element goes to bf16 by round-to-nearest-even
 * (relative error at most 2^-8 per element); products and sums are FP32. */
#include "kernels/cpu/cpu_ops.h"

#include "kernels/elem.h"

#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N,
                                    dnnl_dim_t K, float alpha, const uint16_t *A, dnnl_dim_t lda,
                                    const uint16_t *B, dnnl_dim_t ldb, float beta, float *C,
                                    dnnl_dim_t ldc);

/* ---------------------------------------------------------------- detection */

nl_status nl_cpu_bf16_supported(nl_error *err)
{
    /* the ISA oneDNN will use, after DNNL_MAX_CPU_ISA and the CPU's own
     * flags: avx512_core_bf16 and avx512_core_amx both contain its bits */
    const unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
    const unsigned need = (unsigned)dnnl_cpu_isa_avx512_core_bf16;
    if ((isa & need) == need)
        return NL_OK;
    return nl_error_set(err, NL_ERR_UNSUPPORTED,
                        "bf16 compute needs a CPU with AVX512-BF16 or AMX (oneDNN reports ISA "
                        "0x%x here, wants avx512_core_bf16 = 0x%x); use --precision fp32",
                        isa, need);
}

/* ---------------------------------------------------------------- conversion */

/* round to nearest, ties to even; NaN stays a quiet NaN: the rule the
 * CUDA backend's copies use too (kernels/elem.h) */
static uint16_t to_bf16(float f)
{
    return nl_elem_to_bf16(f);
}

/* n floats to bf16 with the CPU's own instruction (rounds the same way);
 * only called once nl_cpu_bf16_supported said yes */
__attribute__((target("avx512f,avx512bf16"))) static void to_bf16_row(uint16_t *dst,
                                                                      const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)v);
    }
    for (; i < n; i++)
        dst[i] = to_bf16(src[i]);
}

void nl_cpu_to_bf16(nl_backend *be, uint16_t *dst, const float *src, int rows, int cols, int ld)
{
#pragma omp parallel for NL_CPU_TEAM(be) if ((size_t)rows * cols >= 65536)
    for (int r = 0; r < rows; r++)
        to_bf16_row(dst + (size_t)r * cols, src + (size_t)r * ld, (size_t)cols);
}

/* ---------------------------------------------------------------- weights */

static nl_cpu_bf16_range *find_range(nl_cpu_ctx *ctx, const void *p, size_t bytes)
{
    const char *c = p;
    for (int i = 0; i < NL_CPU_BF16_RANGES; i++) {
        nl_cpu_bf16_range *r = &ctx->w[i];
        const char *b = (const char *)r->base;
        if (r->copy && c < b + r->n * sizeof(float) && c + bytes > b)
            return r;
    }
    return NULL;
}

nl_status nl_cpu_bf16_weights(nl_backend *be, const float *p, size_t n, nl_error *err)
{
    nl_cpu_ctx *ctx = be->ctx;
    nl_cpu_bf16_range *slot = NULL;
    for (int i = 0; i < NL_CPU_BF16_RANGES && !slot; i++)
        if (ctx->w[i].copy && ctx->w[i].base == p)
            slot = &ctx->w[i];
    if (slot) { /* forget (n == 0) or size again */
        be->free(be, slot->copy);
        memset(slot, 0, sizeof *slot);
    }
    if (n == 0)
        return NL_OK;
    for (int i = 0; i < NL_CPU_BF16_RANGES && !slot; i++)
        if (!ctx->w[i].copy)
            slot = &ctx->w[i];
    if (!slot)
        return nl_error_set(err, NL_ERR_NOMEM, "bf16 weights: more than %d weight ranges",
                            NL_CPU_BF16_RANGES);
    uint16_t *copy = be->alloc(be, n * sizeof *copy); /* counted in mem_stats */
    if (!copy)
        return nl_error_set(err, NL_ERR_NOMEM, "bf16 weights: cannot allocate a copy of %zu", n);
    *slot = (nl_cpu_bf16_range){.base = p, .n = n, .copy = copy, .stale = 1};
    return NL_OK;
}

void nl_cpu_bf16_wrote(nl_backend *be, const void *p, size_t bytes)
{
    nl_cpu_ctx *ctx = be->ctx;
    const char *c = p;
    for (int i = 0; bytes && i < NL_CPU_BF16_RANGES; i++) {
        nl_cpu_bf16_range *r = &ctx->w[i];
        const char *b = (const char *)r->base;
        if (r->copy && c < b + r->n * sizeof(float) && c + bytes > b)
            r->stale = 1;
    }
}

void nl_cpu_bf16_free(nl_backend *be)
{
    nl_cpu_ctx *ctx = be->ctx;
    for (int i = 0; i < NL_CPU_BF16_RANGES; i++)
        be->free(be, ctx->w[i].copy);
    for (int i = 0; i < 2; i++)
        be->free(be, ctx->scratch[i]);
    memset(ctx->w, 0, sizeof ctx->w);
}

/* ---------------------------------------------------------------- gemm */

/* The bf16 form of one operand stored as `rows` rows of `cols` floats with
 * row stride ld: from a weight copy (same stride, made again first if a
 * write made it stale), else converted into scratch `which` (stride cols).
 * NULL when scratch cannot grow. */
static const uint16_t *operand(nl_backend *be, int which, const float *x, int rows, int cols,
                               int ld, int *ld_out)
{
    nl_cpu_ctx *ctx = be->ctx;
    const size_t extent = ((size_t)(rows - 1) * ld + (size_t)cols) * sizeof(float);
    nl_cpu_bf16_range *r = find_range(ctx, x, extent);
    if (r && x >= r->base && (const char *)x + extent <= (const char *)(r->base + r->n)) {
        if (r->stale) {
            /* the whole range at once, in rows of 64 Ki floats */
            const size_t chunk = 65536, full = r->n / chunk;
            if (full)
                nl_cpu_to_bf16(be, r->copy, r->base, (int)full, (int)chunk, (int)chunk);
            to_bf16_row(r->copy + full * chunk, r->base + full * chunk, r->n - full * chunk);
            r->stale = 0;
        }
        *ld_out = ld;
        return r->copy + (x - r->base);
    }
    const size_t need = (size_t)rows * cols;
    if (need > ctx->scratch_cap[which]) {
        be->free(be, ctx->scratch[which]);
        ctx->scratch[which] = be->alloc(be, need * sizeof(uint16_t));
        ctx->scratch_cap[which] = ctx->scratch[which] ? need : 0;
        if (!ctx->scratch[which])
            return NULL;
    }
    nl_cpu_to_bf16(be, ctx->scratch[which], x, rows, cols, ld);
    *ld_out = cols;
    return ctx->scratch[which];
}

int nl_cpu_gemm_bf16(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                     const float *A, int lda, const float *B, int ldb, float beta, float *C,
                     int ldc)
{
    int la = 0, lb = 0;
    const uint16_t *a =
        trans_a ? operand(be, 0, A, K, M, lda, &la) : operand(be, 0, A, M, K, lda, &la);
    const uint16_t *b =
        trans_b ? operand(be, 1, B, N, K, ldb, &lb) : operand(be, 1, B, K, N, ldb, &lb);
    if (!a || !b)
        return 0; /* no scratch: the caller runs the FP32 GEMM */
    dnnl_gemm_bf16bf16f32(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, a, la, b, lb,
                          beta, C, ldc);
    return 1;
}
