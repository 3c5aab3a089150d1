/* CPU kernels that live in their own files, shared inside kernels/cpu. */
#ifndef NL_CPU_OPS_H
#define NL_CPU_OPS_H

#include "kernels/backend.h"

#include <stddef.h>
#include <stdint.h>

/* The CPU backend's context (be->ctx of a backend made by
 * nl_cpu_backend_new). */
/* A weight range of bf16 compute (cpu_bf16.c) and its bf16 copy. */
#define NL_CPU_BF16_RANGES 8
typedef struct nl_cpu_bf16_range {
    const float *base; /* the FP32 weights (n floats); NULL: slot unused */
    size_t n;
    uint16_t *copy; /* (n) bf16, valid unless stale */
    int stale;      /* a write since the copy was made */
} nl_cpu_bf16_range;

typedef struct nl_cpu_ctx {
    int threads;         /* the OpenMP team size of every parallel region */
    size_t in_use, peak; /* bytes handed out by its alloc */
    int bf16;            /* GEMMs in bf16 (nl_backend_opts.bf16) */
    nl_cpu_bf16_range w[NL_CPU_BF16_RANGES];
    uint16_t *scratch[2];  /* bf16 forms of GEMM operands A and B, grown on demand */
    size_t scratch_cap[2]; /* elements at scratch[i] */
    float *rope;           /* RoPE (cos, sin) table of one call (malloc'd, grown on demand) */
    size_t rope_cap;       /* floats at rope */
    float *sample_w;       /* a row's weights in sample_rows (malloc'd, grown on demand) */
    size_t sample_w_cap;   /* floats at sample_w */
    float *gemm_buf; /* the GEMM's packing (cpu_matmul.c): nl_cpu_matmul_floats, 64-byte aligned */
} nl_cpu_ctx;

static inline int nl_cpu_threads(const nl_backend *be)
{
    return ((const nl_cpu_ctx *)be->ctx)->threads;
}

/* Every `omp parallel` in kernels/cpu names its team size with this
 * clause, so a backend never changes the process's OpenMP settings and
 * two backends with different thread counts can share a process. */
#define NL_CPU_TEAM(be) num_threads(nl_cpu_threads(be))

/* Keys [*lo, *hi) that a query at absolute position i may see under the
 * mask's causal and window rules (not its documents), of nkeys keys. lo
 * and hi never decrease as i grows. */
static inline void nl_cpu_attn_range(const nl_attn_mask *mk, int i, int nkeys, int *lo, int *hi)
{
    const int W = mk->window;
    if (!mk->bidir) {
        *lo = W > 0 ? i - W + 1 : 0;
        *hi = i + 1;
    } else {
        *lo = W > 0 ? i - W / 2 : 0;
        *hi = W > 0 ? i + W / 2 + 1 : nkeys;
    }
    *lo = *lo < 0 ? 0 : *lo;
    *hi = *hi > nkeys ? nkeys : *hi;
}

/* cpu_dot.c: C (M, N) = A (M, K) B^T (+ C when accumulating), B given as
 * (N, K) row-major, every element computed the same way whatever M is
 * (row invariant), as fast as a plain GEMM at a decode's few rows;
 * gemm_rows takes it for every M, the plain gemm below NL_CPU_DOT_ROWS
 * rows. At NL_CPU_DOT_ROWS and above the plain gemm is the chain GEMM
 * (cpu_matmul.c), whose rows do not depend on M either (the switch at 16
 * is why neuroctl embed pads a small batch to 16 positions). */
#define NL_CPU_DOT_ROWS 16
void nl_cpu_gemm_dot(nl_backend *be, int M, int N, int K, const float *A, int lda, const float *B,
                     int ldb, int accumulate, float *C, int ldc);
/* Whether nl_cpu_gemm_dot runs its AVX-512 tiles (where the CPU has them;
 * the default) or only the AVX2 ones (want 0); returns whether it now runs
 * them. The bits are the same either way (tests/test_batch.c checks); for
 * tests and benchmarks (the first product asks for them by itself). */
int nl_cpu_dot_avx512(int want);

/* cpu_matmul.c: the FP32 GEMM whose every element of C is one fixed chain
 * of FMAs over k (the file says which), so its bits do not depend on M,
 * N, the tiling or the threads; C = alpha op(A) op(B) + beta C, row-major.
 * It packs into ctx->gemm_buf, nl_cpu_matmul_floats(threads) floats made
 * with the backend. */
void nl_cpu_gemm_chain(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                       const float *A, int lda, const float *B, int ldb, float beta, float *C,
                       int ldc);
size_t nl_cpu_matmul_floats(int threads);
/* the gemm_rows slot: the dot kernel with trans_b, else the chain GEMM */
void nl_cpu_gemm_rows(nl_backend *be, int trans_b, int M, int N, int K, const float *A, int lda,
                      const float *B, int ldb, int accumulate, float *C, int ldc);

/* cpu_attention.c */
void nl_cpu_attention_forward(nl_backend *be, float *out, float *lse, const float *q, int q_stride,
                              const float *k, const float *v, int kv_stride, nl_attn_shape s);
void nl_cpu_attention_masked_forward(nl_backend *be, float *out, float *lse, const float *q,
                                     int q_stride, const float *k, const float *v, int kv_stride,
                                     nl_attn_shape s, nl_attn_mask mask);

/* cpu_attention_bwd.c */
void nl_cpu_attention_backward(nl_backend *be, float *dq, float *dk, float *dv, const float *dout,
                               const float *q, int q_stride, const float *k, const float *v,
                               int kv_stride, const float *out, const float *lse, nl_attn_shape s);
void nl_cpu_attention_masked_backward(nl_backend *be, float *dq, float *dk, float *dv,
                                      const float *dout, const float *q, int q_stride,
                                      const float *k, const float *v, int kv_stride,
                                      const float *out, const float *lse, nl_attn_shape s,
                                      nl_attn_mask mask);

/* cpu_backward.c: the other backward and optimizer slots (see backend.h) */
void nl_cpu_embedding_backward(nl_backend *be, float *dtable, const float *dout,
                               const int32_t *tokens, int N, int C);
void nl_cpu_rmsnorm_backward(nl_backend *be, float *dinp, float *dw, const float *dout,
                             const float *inp, const float *w, const float *rstd, int N, int C);
void nl_cpu_swiglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                            int F);
void nl_cpu_geglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                           int F);
void nl_cpu_moe_combine_backward(nl_backend *be, float *dy, float *dw, const float *dx,
                                 const float *y, const int32_t *slot, const float *w, int N, int k,
                                 int C);
void nl_cpu_cross_entropy(nl_backend *be, float *logits, float *losses, const int32_t *targets,
                          int N, int V, float scale);
double nl_cpu_sumsq(nl_backend *be, const float *x, size_t n);
void nl_cpu_adamw(nl_backend *be, float *p, const float *g, float *m, float *v, size_t n, float lr,
                  float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale);

/* cpu_bf16.c: bf16 GEMMs. nl_cpu_gemm_bf16 returns 0 (computing nothing)
 * when its operand scratch cannot grow; the caller then runs the FP32 GEMM. */
nl_status nl_cpu_bf16_supported(nl_error *err);
nl_status nl_cpu_bf16_weights(nl_backend *be, const float *p, size_t n, nl_error *err);
void nl_cpu_bf16_wrote(nl_backend *be, const void *p, size_t bytes);
void nl_cpu_bf16_free(nl_backend *be);
void nl_cpu_to_bf16(nl_backend *be, uint16_t *dst, const float *src, int rows, int cols, int ld);
int nl_cpu_gemm_bf16(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                     const float *A, int lda, const float *B, int ldb, float beta, float *C,
                     int ldc);

/* cpu_moe.c: routing and the grouped expert GEMMs (see backend.h) */
void nl_cpu_moe_route(nl_backend *be, int32_t *choice, float *w, int32_t *offsets, int32_t *perm,
                      int32_t *slot, const float *probs, int N, int E, int k);
void nl_cpu_moe_aux(nl_backend *be, double *aux, float *frac, int64_t *counts, const float *probs,
                    const int32_t *offsets, const float *global_frac, int N, int E, int k,
                    double aux_rows);
void nl_cpu_moe_router_backward(nl_backend *be, float *dl, const float *dw, const float *probs,
                                const int32_t *choice, const float *w, const float *frac, int N,
                                int E, int k, float aux_scale);
void nl_cpu_gemm_grouped(nl_backend *be, int trans_b, int N, int K, const float *A, int lda,
                         const float *B, int ldb, size_t b_stride, float *C, int ldc,
                         const int32_t *offsets, int groups, int max_rows);
void nl_cpu_gemm_grouped_wgrad(nl_backend *be, int M, int N, const float *A, int lda,
                               const float *B, int ldb, float *C, int ldc, size_t c_stride,
                               const int32_t *offsets, int groups);

/* the fused decode slots (backend.h), the separate slots' arithmetic */
void nl_cpu_moe_norm_route(nl_backend *be, float *xn, float *probs, int32_t *choice, float *w,
                           const float *x, const float *norm_w, const float *router, int N, int d,
                           int E, int k, float eps);
void nl_cpu_moe_gate_up(nl_backend *be, float *hs, float *gu, const float *xn,
                        const int32_t *choice, const float *experts, size_t expert_stride, int N,
                        int k, int d, int F);
void nl_cpu_moe_down_combine(nl_backend *be, float *x, float *ye, const float *hs,
                             const int32_t *choice, const float *w, const float *experts,
                             size_t expert_stride, int N, int k, int d, int F);

void nl_cpu_moe_ffn_forward(nl_backend *be, float *ye, float *hs, float *gu, const float *xe,
                            const float *experts, size_t expert_stride, int d, int F,
                            const int32_t *offsets, int groups, int max_rows);
void nl_cpu_moe_ffn_backward(nl_backend *be, float *dxe, float *dgu, float *dhs, float *dexperts,
                             const float *dye, const float *xe, const float *gu, const float *hs,
                             const float *experts, size_t expert_stride, int d, int F,
                             const int32_t *offsets, int groups);

#endif
