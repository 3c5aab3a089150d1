/* CPU kernels that live in their own files, shared inside kernels/cpu. */
#ifndef NL_CPU_OPS_H
#define NL_CPU_OPS_H

#include "../backend.h"

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
