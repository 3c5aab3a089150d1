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

/* cpu_attention.c */
void nl_cpu_attention_forward(nl_backend *be, float *out, float *lse, const float *q, int q_stride,
                              const float *k, const float *v, int kv_stride, nl_attn_shape s);

/* cpu_attention_bwd.c */
void nl_cpu_attention_backward(nl_backend *be, float *dq, float *dk, float *dv, const float *dout,
                               const float *q, int q_stride, const float *k, const float *v,
                               int kv_stride, const float *out, const float *lse, nl_attn_shape s);

/* cpu_backward.c: the other backward and optimizer slots (see backend.h) */
void nl_cpu_embedding_backward(nl_backend *be, float *dtable, const float *dout,
                               const int32_t *tokens, int N, int C);
void nl_cpu_rmsnorm_backward(nl_backend *be, float *dinp, float *dw, const float *dout,
                             const float *inp, const float *w, const float *rstd, int N, int C);
void nl_cpu_swiglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                            int F);
void nl_cpu_moe_combine_backward(nl_backend *be, float *dy, float *dw, const float *dx,
                                 const float *y, const int32_t *slot, const float *w, int N, int k,
                                 int C);
void nl_cpu_cross_entropy(nl_backend *be, float *logits, float *losses, const int32_t *targets,
                          int N, int V, float scale);
double nl_cpu_sumsq(nl_backend *be, const float *x, size_t n);
void nl_cpu_adamw(nl_backend *be, float *p, const float *g, float *m, float *v, size_t n, float lr,
                  float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale);

#endif
