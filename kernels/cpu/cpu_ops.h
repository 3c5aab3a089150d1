/* CPU kernels that live in their own files, shared inside kernels/cpu. */
#ifndef NL_CPU_OPS_H
#define NL_CPU_OPS_H

#include "../backend.h"

void nl_cpu_attention_forward(nl_backend *be, float *out, float *lse, const float *q, int q_stride,
                              const float *k, const float *v, int kv_stride, nl_attn_shape s);

#endif
