/* The CPU backend: FP32 GEMM through its own kernels (cpu_dot.c for a
 * decode's rows, cpu_matmul.c otherwise: bits that depend neither on M nor
 * on the threads), bf16 GEMM through oneDNN's (cpu_bf16.c), the other ops as
 * plain C loops that the compiler vectorises, threaded with OpenMP. */
#include "kernels/backend.h"
#include "kernels/backend_impl.h"
#include "kernels/cpu/cpu_math.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/elem.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef nl_cpu_ctx cpu_ctx;

/* Each block carries its size in a 64-byte header, for the accounting. */
#define HEADER 64

/* ---------------------------------------------------------------- memory */

static void *cpu_alloc(nl_backend *be, size_t bytes)
{
    cpu_ctx *ctx = be->ctx;
    if (bytes > SIZE_MAX - HEADER - 63)
        return NULL; /* rounding up would wrap */
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded == 0)
        rounded = 64;
    char *p = aligned_alloc(64, rounded + HEADER);
    if (!p)
        return NULL;
    memset(p + HEADER, 0, rounded);
    memcpy(p, &rounded, sizeof rounded);
#pragma omp atomic
    ctx->in_use += rounded;
    if (ctx->in_use > ctx->peak)
        ctx->peak = ctx->in_use;
    return p + HEADER;
}

static void cpu_free(nl_backend *be, void *p)
{
    cpu_ctx *ctx = be->ctx;
    if (!p)
        return;
    char *base = (char *)p - HEADER;
    size_t rounded;
    memcpy(&rounded, base, sizeof rounded);
#pragma omp atomic
    ctx->in_use -= rounded;
    free(base);
}

static void cpu_mem_stats(nl_backend *be, size_t *in_use, size_t *peak)
{
    cpu_ctx *ctx = be->ctx;
    if (in_use)
        *in_use = ctx->in_use;
    if (peak)
        *peak = ctx->peak;
}

/* upload and download: a copy, counted as the host wait it is on a device */
static void cpu_copy(nl_backend *be, void *dst, const void *src, size_t bytes)
{
    if (bytes) {
        be->stats.host_syncs++;
        memcpy(dst, src, bytes);
    }
}

/* an upload may land in weights that have a bf16 copy */
static void cpu_upload(nl_backend *be, void *dst, const void *src, size_t bytes)
{
    cpu_copy(be, dst, src, bytes);
    nl_cpu_bf16_wrote(be, dst, bytes);
}

static nl_status cpu_sync(nl_backend *be, nl_error *err)
{
    (void)err;
    be->stats.host_syncs++;
    return NL_OK;
}

static double cpu_sumsq(nl_backend *be, const float *x, size_t n)
{
    be->stats.host_syncs++; /* a result for the host */
    return nl_cpu_sumsq(be, x, n);
}

static void cpu_sample_rows(nl_backend *be, int32_t *ids, const nl_sample_row *rows, int n, int V)
{
    if (n <= 0)
        return;
    be->stats.host_syncs++; /* results for the host, one wait for all */
    /* a sampled row's weights, stored once (elem.h's vectorised pass) for
     * the sums and a top-p row's threshold, in a buffer grown once (the
     * same ids without one: each pass then computes them again) */
    cpu_ctx *ctx = be->ctx;
    float *w = NULL;
    for (int i = 0; i < n; i++)
        if (rows[i].temperature > 0.0f) {
            if (ctx->sample_w_cap < (size_t)V) {
                float *g = realloc(ctx->sample_w, (size_t)V * sizeof *g);
                if (g) {
                    ctx->sample_w = g;
                    ctx->sample_w_cap = (size_t)V;
                }
            }
            w = ctx->sample_w_cap >= (size_t)V ? ctx->sample_w : NULL;
            break;
        }
    for (int i = 0; i < n; i++)
        ids[i] =
            nl_elem_sample_row(rows[i].logits, V, rows[i].temperature, rows[i].top_p, rows[i].u, w);
}

static void cpu_zero(nl_backend *be, void *p, size_t bytes)
{
    nl_cpu_bf16_wrote(be, p, bytes);
    char *c = p;
    const size_t chunk = 1 << 20;
    const long n = (long)((bytes + chunk - 1) / chunk);
#pragma omp parallel for NL_CPU_TEAM(be) if (n > 1)
    for (long i = 0; i < n; i++) {
        size_t o = (size_t)i * chunk;
        memset(c + o, 0, bytes - o < chunk ? bytes - o : chunk);
    }
}

/* ---------------------------------------------------------------- gemm */

static void cpu_gemm(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                     const float *A, int lda, const float *B, int ldb, float beta, float *C,
                     int ldc)
{
    if (M <= 0 || N <= 0)
        return;
    /* a decode's few rows of y = x W^T: the row-invariant dot-product
     * kernel, as fast as a plain GEMM there and giving the bits a stage's
     * batch gives (gemm_rows) */
    if (!be->bf16 && !trans_a && trans_b && alpha == 1.0f && (beta == 0.0f || beta == 1.0f) &&
        M < NL_CPU_DOT_ROWS && K > 0) {
        nl_cpu_gemm_dot(be, M, N, K, A, lda, B, ldb, beta != 0.0f, C, ldc);
        return;
    }
    if (be->bf16 && K > 0) {
        /* oneDNN's OpenMP runtime sizes its team by omp_get_max_threads():
         * this backend's count for the call only, then the caller's again */
        const int want = nl_cpu_threads(be), had = omp_get_max_threads();
        if (want != had)
            omp_set_num_threads(want);
        const int done =
            nl_cpu_gemm_bf16(be, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        if (want != had)
            omp_set_num_threads(had);
        if (done)
            return;
    }
    /* every element one chain of FMAs: its bits depend on neither M nor
     * the threads (cpu_matmul.c) */
    nl_cpu_gemm_chain(be, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* ---------------------------------------------------------------- elementwise */

#define PAR_ROWS(n) if ((n) >= 64)

static void cpu_embedding_forward(nl_backend *be, float *out, const int32_t *tokens,
                                  const float *table, int N, int C)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++)
        memcpy(out + (size_t)n * C, table + (size_t)tokens[n] * C, (size_t)C * sizeof(float));
}

static void cpu_rmsnorm_forward(nl_backend *be, float *out, float *rstd, const float *inp,
                                const float *w, int N, int C, float eps)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *y = out + (size_t)n * C;
        float ss = 0.0f;
        for (int i = 0; i < C; i++)
            ss += x[i] * x[i];
        const float r = nl_elem_rmsnorm_scale(ss, C, eps);
        for (int i = 0; i < C; i++)
            y[i] = x[i] * r * w[i];
        if (rstd)
            rstd[n] = r;
    }
}

/* The (cos, sin) pairs of positions lo .. lo + span - 1, for every pair i
 * of a head: one trigonometric pair per distinct position instead of one
 * per row (a training batch repeats each position B times). The values are
 * the ones the row loop computed, so results do not change by a bit.
 * Returns NULL when the positions are too spread out to be worth it or the
 * table cannot grow (the caller computes per row then). */
static const float *rope_table(nl_backend *be, const int32_t *pos, int N, int half,
                               const double *freq, int32_t *lo_out)
{
    nl_cpu_ctx *ctx = be->ctx;
    int32_t lo = pos[0], hi = pos[0];
    for (int n = 1; n < N; n++) {
        lo = pos[n] < lo ? pos[n] : lo;
        hi = pos[n] > hi ? pos[n] : hi;
    }
    const int64_t span = (int64_t)hi - lo + 1;
    if (span > N)
        return NULL;
    const size_t need = (size_t)span * half * 2;
    if (need > ctx->rope_cap) { /* grows to the largest call, then stays */
        free(ctx->rope);
        ctx->rope = malloc(need * sizeof *ctx->rope);
        ctx->rope_cap = ctx->rope ? need : 0;
        if (!ctx->rope)
            return NULL;
    }
    float *t = ctx->rope;
#pragma omp parallel for NL_CPU_TEAM(be) if (span >= 64)
    for (int64_t p = 0; p < span; p++)
        for (int i = 0; i < half; i++) {
            const double ang = (double)(lo + p) * freq[i];
            t[(p * half + i) * 2] = (float)cos(ang);
            t[(p * half + i) * 2 + 1] = (float)sin(ang);
        }
    *lo_out = lo;
    return t;
}

static void cpu_rope_forward(nl_backend *be, float *x, const int32_t *pos, int N, int row, int col0,
                             int heads, int hd, float base)
{
    const int half = hd / 2;
    double freq[NL_BACKEND_MAX_HEAD_DIM / 2];
    for (int i = 0; i < half; i++)
        freq[i] = nl_elem_rope_freq(i, hd, base);
    if (N <= 0)
        return;
    int32_t lo = 0;
    const float *tab = rope_table(be, pos, N, half, freq, &lo);
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        float *r = x + (size_t)n * row + col0;
        const float *cs = tab ? tab + (size_t)(pos[n] - lo) * half * 2 : NULL;
        for (int i = 0; i < half; i++) {
            float c, s;
            if (cs) {
                c = cs[2 * i];
                s = cs[2 * i + 1];
            } else {
                const double ang = (double)pos[n] * freq[i];
                c = (float)cos(ang);
                s = (float)sin(ang);
            }
            for (int h = 0; h < heads; h++) {
                float *p = r + (size_t)h * hd + 2 * i;
                nl_elem_rope_rotate(&p[0], &p[1], c, s);
            }
        }
    }
}

static void cpu_rope_scaled_forward(nl_backend *be, float *x, const int32_t *pos, int N, int row,
                                    int col0, int heads, int hd, float base, nl_rope_scaling sc)
{
    if (sc.type != NL_ROPE_YARN) {
        cpu_rope_forward(be, x, pos, N, row, col0, heads, hd, base);
        return;
    }
    const int half = hd / 2;
    double freq[NL_BACKEND_MAX_HEAD_DIM / 2];
    const double m = nl_elem_yarn_mscale(sc.factor);
    for (int i = 0; i < half; i++)
        freq[i] = nl_elem_yarn_freq(i, hd, base, sc.factor, sc.original_max_seq_len, sc.beta_fast,
                                    sc.beta_slow);
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        float *r = x + (size_t)n * row + col0;
        for (int i = 0; i < half; i++) {
            const double ang = (double)pos[n] * freq[i];
            const float c = (float)(cos(ang) * m), s = (float)(sin(ang) * m);
            for (int h = 0; h < heads; h++) {
                float *p = r + (size_t)h * hd + 2 * i;
                nl_elem_rope_rotate(&p[0], &p[1], c, s);
            }
        }
    }
}

static void cpu_softmax_forward(nl_backend *be, float *x, int N, int C)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        float *r = x + (size_t)n * C;
        float m = -INFINITY;
        for (int i = 0; i < C; i++)
            m = r[i] > m ? r[i] : m;
        double s = 0.0; /* in double: a vocabulary-wide row stays within 1e-6 */
        for (int i = 0; i < C; i++) {
            r[i] = nl_elem_expf(r[i] - m);
            s += r[i];
        }
        const float inv = (float)(1.0 / s);
        for (int i = 0; i < C; i++)
            r[i] *= inv;
    }
}

static void cpu_swiglu_forward(nl_backend *be, float *out, const float *gu, int N, int F)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F;
        const float *u = g + F;
        float *o = out + (size_t)n * F;
        for (int j = 0; j < F; j++)
            o[j] = nl_elem_swiglu(g[j], u[j]);
    }
}

static void cpu_geglu_forward(nl_backend *be, float *out, const float *gu, int N, int F)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F;
        const float *u = g + F;
        float *o = out + (size_t)n * F;
        for (int j = 0; j < F; j++)
            o[j] = nl_elem_geglu(g[j], u[j]);
    }
}

static void cpu_gather_rows(nl_backend *be, float *out, const float *src, const int32_t *idx, int n,
                            int C)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(n)
    for (int i = 0; i < n; i++)
        memcpy(out + (size_t)i * C, src + (size_t)idx[i] * C, (size_t)C * sizeof(float));
}

static void cpu_copy_rows(nl_backend *be, float *dst, int dst_stride, const float *src,
                          int src_stride, int rows, int cols)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(rows)
    for (int r = 0; r < rows; r++)
        memcpy(dst + (size_t)r * dst_stride, src + (size_t)r * src_stride,
               (size_t)cols * sizeof(float));
}

static void cpu_kv_store(nl_backend *be, float *kc, float *vc, const float *qkv, int stride,
                         int k_col, int v_col, const int32_t *pos, int B, int T, int cap,
                         int kv_dim)
{
    (void)be;
    for (int n = 0; n < B * T; n++) {
        const size_t dst = ((size_t)(n / T) * cap + (size_t)pos[n]) * kv_dim;
        const float *src = qkv + (size_t)n * stride;
        memcpy(kc + dst, src + k_col, (size_t)kv_dim * sizeof(float));
        memcpy(vc + dst, src + v_col, (size_t)kv_dim * sizeof(float));
    }
}

static void cpu_kv_store_bf16(nl_backend *be, uint16_t *kc, uint16_t *vc, const float *qkv,
                              int stride, int k_col, int v_col, const int32_t *pos, int past, int B,
                              int T, int cap, int kv_dim)
{
    const int rows = B * T;
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(rows)
    for (int n = 0; n < rows; n++) {
        const int at = pos ? pos[n] : past + n % T;
        const size_t dst = ((size_t)(n / T) * cap + (size_t)at) * kv_dim;
        const float *src = qkv + (size_t)n * stride;
        for (int j = 0; j < kv_dim; j++) {
            kc[dst + j] = nl_elem_to_bf16(src[k_col + j]);
            vc[dst + j] = nl_elem_to_bf16(src[v_col + j]);
        }
    }
}

static void cpu_kv_store_seq(nl_backend *be, void *const *kseq, void *const *vseq, int bf16,
                             const float *qkv, int stride, int k_col, int v_col, const int32_t *pos,
                             int B, int T, int kv_dim)
{
    const int rows = B * T;
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(rows)
    for (int n = 0; n < rows; n++) {
        const size_t dst = (size_t)pos[n] * kv_dim;
        const float *src = qkv + (size_t)n * stride;
        if (bf16) {
            uint16_t *k = (uint16_t *)kseq[n / T] + dst, *v = (uint16_t *)vseq[n / T] + dst;
            for (int j = 0; j < kv_dim; j++) {
                k[j] = nl_elem_to_bf16(src[k_col + j]);
                v[j] = nl_elem_to_bf16(src[v_col + j]);
            }
        } else {
            memcpy((float *)kseq[n / T] + dst, src + k_col, (size_t)kv_dim * sizeof(float));
            memcpy((float *)vseq[n / T] + dst, src + v_col, (size_t)kv_dim * sizeof(float));
        }
    }
}

static void cpu_moe_combine(nl_backend *be, float *x, const float *y, const int32_t *slot,
                            const float *w, int N, int k, int C)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        float *xr = x + (size_t)n * C;
        for (int i = 0; i < k; i++) {
            const float a = w[(size_t)n * k + i];
            const float *yr = y + (size_t)slot[(size_t)n * k + i] * C;
            for (int j = 0; j < C; j++)
                xr[j] += a * yr[j];
        }
    }
}

/* AdamW writes the weights: their bf16 copy is made again on next use */
static void cpu_adamw(nl_backend *be, float *p, const float *g, float *m, float *v, size_t n,
                      float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                      float grad_scale)
{
    nl_cpu_bf16_wrote(be, p, n * sizeof *p);
    nl_cpu_adamw(be, p, g, m, v, n, lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
}

/* ---------------------------------------------------------------- table */

static void cpu_destroy(nl_backend *be)
{
    nl_cpu_bf16_free(be);
    free(((cpu_ctx *)be->ctx)->gemm_buf);
    free(((cpu_ctx *)be->ctx)->rope);
    free(((cpu_ctx *)be->ctx)->sample_w);
    free(be->ctx);
    free(be);
}

nl_status nl_cpu_backend_new(nl_backend **out, const nl_backend_opts *o, nl_error *err)
{
    *out = NULL;
    const int threads = o->threads;
    if (o->bf16) {
        nl_status st = nl_cpu_bf16_supported(err);
        if (st != NL_OK)
            return st;
    }
    nl_backend *be = calloc(1, sizeof *be);
    cpu_ctx *ctx = calloc(1, sizeof *ctx);
    /* no omp_set_num_threads here: the count goes with every parallel
     * region (NL_CPU_TEAM) and around oneDNN's bf16 GEMM, not into the
     * process */
    const int team = threads > 0 ? threads : omp_get_num_procs();
    /* the GEMM's packing, made once (a few MiB): no call can run out */
    float *gb = aligned_alloc(64, nl_cpu_matmul_floats(team) * sizeof(float));
    if (!be || !ctx || !gb) {
        free(be);
        free(ctx);
        free(gb);
        return nl_error_set(err, NL_ERR_NOMEM, "cpu backend: out of memory");
    }
    ctx->threads = team;
    ctx->gemm_buf = gb;
    be->name = "cpu";
    be->ctx = ctx;
    be->destroy = cpu_destroy;
    be->alloc = cpu_alloc;
    be->free = cpu_free;
    be->upload = cpu_upload;
    be->download = cpu_copy;
    be->sync = cpu_sync;
    be->mem_stats = cpu_mem_stats;
    be->zero = cpu_zero;
    be->host_memory = 1;
    be->can_train = 1;
    be->gemm_probe = 512;
    be->gemm = cpu_gemm;
    be->gemm_rows = o->bf16 ? NULL : nl_cpu_gemm_rows; /* bf16 GEMMs: gemm only */
    ctx->bf16 = be->bf16 = o->bf16 != 0;
    be->bf16_weights = o->bf16 ? nl_cpu_bf16_weights : NULL;
    be->wrote = nl_cpu_bf16_wrote;
    be->embedding_forward = cpu_embedding_forward;
    be->rmsnorm_forward = cpu_rmsnorm_forward;
    be->rope_forward = cpu_rope_forward;
    be->rope_scaled_forward = cpu_rope_scaled_forward;
    be->attention_forward = nl_cpu_attention_forward;
    be->attention_masked_forward = nl_cpu_attention_masked_forward;
    be->geglu_forward = cpu_geglu_forward;
    be->softmax_forward = cpu_softmax_forward;
    be->swiglu_forward = cpu_swiglu_forward;
    be->gather_rows = cpu_gather_rows;
    be->copy_rows = cpu_copy_rows;
    be->kv_store = cpu_kv_store;
    be->kv_store_seq = cpu_kv_store_seq;
    be->kv_store_bf16 = cpu_kv_store_bf16;
    be->moe_combine = cpu_moe_combine;
    be->moe_route = nl_cpu_moe_route;
    be->moe_aux = nl_cpu_moe_aux;
    be->moe_router_backward = nl_cpu_moe_router_backward;
    be->gemm_grouped = nl_cpu_gemm_grouped;
    be->gemm_grouped_wgrad = nl_cpu_gemm_grouped_wgrad;
    be->moe_ffn_forward = nl_cpu_moe_ffn_forward;
    be->moe_ffn_backward = nl_cpu_moe_ffn_backward;
    be->moe_norm_route = nl_cpu_moe_norm_route;
    be->moe_gate_up = nl_cpu_moe_gate_up;
    be->moe_down_combine = nl_cpu_moe_down_combine;
    be->embedding_backward = nl_cpu_embedding_backward;
    be->rmsnorm_backward = nl_cpu_rmsnorm_backward;
    be->attention_backward = nl_cpu_attention_backward;
    be->attention_masked_backward = nl_cpu_attention_masked_backward;
    be->geglu_backward = nl_cpu_geglu_backward;
    be->swiglu_backward = nl_cpu_swiglu_backward;
    be->moe_combine_backward = nl_cpu_moe_combine_backward;
    be->cross_entropy = nl_cpu_cross_entropy;
    be->sumsq = cpu_sumsq;
    be->sample_rows = cpu_sample_rows;
    be->adamw = cpu_adamw;
    *out = be;
    return NL_OK;
}
