/* Flash attention through cuDNN (cuda_cudnn.cpp, C++17 over cuDNN's
 * header-only frontend; cuda_cudnn_convert.cu for the bf16 packing): the
 * CUDA backend's attention slots ask here first, and run their own kernels
 * when the answer is 0. C-callable; includes no CUDA or cuDNN header.
 *
 * Who uses it: a backend in bf16 mode (nl_backend_opts.bf16), unless the
 * environment says NL_CUDNN_ATTN=0; NL_CUDNN_ATTN=force routes an FP32
 * backend's attention through it too (bf16 inside), for tests. Without the
 * frontend headers at build time (NL_CUDNN=OFF, or not found) every entry
 * point is a stub: nl_cudnn_new returns NULL.
 *
 * What it runs: SDPA forward and backward with bf16 Q, K, V, O (packed
 * copies in a scratch it owns, converted from and to the caller's FP32
 * tensors on the backend's stream) and FP32 statistics (the lse of
 * backend.h), causal or bidirectional, GQA, head dims 64 and 128, sliding
 * windows, the KV cache (past > 0); cudnn_sdpa_desc.h says how each case is
 * described and which fall back (packed documents, other head dims). One
 * graph per shape key, built on first use and cached (at most
 * NL_CUDNN_MAX_GRAPHS; a key that fails to build is remembered and falls
 * back, with one log line naming cuDNN's error).
 *
 * The same handle serves the experts' grouped GEMMs (cuda_cudnn_moe.cpp,
 * NL_CUDA_EXPERTS=cudnn; the entry points at the end of this header). */
#ifndef NL_CUDA_CUDNN_H
#define NL_CUDA_CUDNN_H

#include "kernels/backend.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NL_CUDNN_MAX_GRAPHS 64

typedef struct nl_cudnn nl_cudnn;

/* The state of one backend's cuDNN attention and expert GEMMs, or NULL
 * when both are off: attention is off with NL_CUDNN_ATTN=0 or in an FP32
 * backend (bf16 == 0) without NL_CUDNN_ATTN=force, the experts unless
 * `experts` (NL_CUDA_EXPERTS=cudnn) in a bf16 backend; NULL too in a
 * module built without cuDNN, libcudnn.so.9 not found (it is dlopen'ed,
 * never linked) or cudnnCreate failing (the last two logged).
 * stream is the backend's cudaStream_t; device its ordinal. */
nl_cudnn *nl_cudnn_new(int device, void *stream, int bf16, int experts);
/* Free the graphs, the handle and the scratch; safe on NULL, sets *p NULL.
 * The caller has synchronised the stream. */
void nl_cudnn_destroy(nl_cudnn **p);

/* The attention_masked_forward slot's contract (backend.h); mask NULL is
 * causal. Returns 1 when the work is queued through cuDNN, 0 when the
 * caller must run its own kernel (nothing of the result written). */
int nl_cudnn_attention_forward(nl_cudnn *cd, float *out, float *lse, const float *q, int q_stride,
                               const float *k, const float *v, int kv_stride, nl_attn_shape s,
                               const nl_attn_mask *mask);
/* The attention_masked_backward slot's contract; returns as the forward. */
int nl_cudnn_attention_backward(nl_cudnn *cd, float *dq, float *dk, float *dv, const float *dout,
                                const float *q, int q_stride, const float *k, const float *v,
                                int kv_stride, const float *out, const float *lse, nl_attn_shape s,
                                const nl_attn_mask *mask);

/* ---- the experts' grouped GEMMs through cuDNN's MoE grouped matmul
 * (cuda_cudnn_moe.cpp; NL_CUDA_EXPERTS=cudnn, off by default): bf16
 * gemm_grouped calls described by cudnn_moe_desc.h, the offsets read by
 * cuDNN on the device. Needs cuDNN 9.18 or newer at run time (checked
 * once, logged). One graph per description (E, T, K, N, strides, Output
 * type), built on first use and cached (at most NL_CUDNN_MAX_GRAPHS); a
 * description cuDNN refuses is remembered and falls back, logged once. */
struct nl_moe_desc;

/* Which graph takes a call: the Output's bytes, 4 for the FP32-output
 * graph of f32, else 2 for the bf16-output graph of bf16 (NULL: none
 * offered), built and cached on first use; 0 when the call falls back
 * (cuDNN off, too old, or refusing both; nothing queued). May drain the
 * stream (a graph built, the workspace grown): never inside a capture. */
int nl_cudnn_moe_plan(nl_cudnn *cd, const struct nl_moe_desc *f32, const struct nl_moe_desc *bf16);
/* Queue the product of the graph nl_cudnn_moe_plan chose for d: token
 * (bf16, d's Token layout), weight (bf16, Weight), offsets (the device's
 * int32 array, its first E entries read) into out (d's Output layout and
 * type). 1 when queued; 0 when cuDNN's execute failed (logged; d falls
 * back from then on; out may hold part of a result). */
int nl_cudnn_moe_run(nl_cudnn *cd, const struct nl_moe_desc *d, const uint16_t *token,
                     const uint16_t *weight, const int32_t *offsets, void *out);

/* ---- inside the module: the packing kernels of cuda_cudnn_convert.cu.
 * Rows r of nseq * rows: source row nl_sdpa_strided_row(r, rows, src_cap,
 * src_stride), destination row nl_sdpa_strided_row(r, rows, dst_cap,
 * dst_stride), `width` elements each. Return the launch's cudaError_t. */
int nl_cuda_pack_bf16(void *stream, uint16_t *dst, int dst_cap, int dst_stride, const float *src,
                      int src_cap, int src_stride, int nseq, int rows, int width);
int nl_cuda_unpack_bf16(void *stream, float *dst, int dst_cap, int dst_stride, const uint16_t *src,
                        int src_cap, int src_stride, int nseq, int rows, int width);
/* dst[0 .. n) = value */
int nl_cuda_fill_i32(void *stream, int32_t *dst, int n, int value);

#ifdef __cplusplus
}
#endif

#endif
