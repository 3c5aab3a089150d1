/* CPU kernels that live in their own files, shared inside kernels/cpu. */
#ifndef NL_CPU_OPS_H
#define NL_CPU_OPS_H

#include "../backend.h"

#include <stddef.h>

/* The CPU backend's context (be->ctx of a backend made by
 * nl_cpu_backend_new). */
typedef struct nl_cpu_ctx {
    int threads;         /* the OpenMP team size of every parallel region */
    size_t in_use, peak; /* bytes handed out by its alloc */
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

#endif
