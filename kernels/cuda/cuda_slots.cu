/* The CUDA backend's compute slots other than the GEMMs: each checks
 * nothing the launcher does not, queues the launcher's kernel on the
 * backend's stream and keeps its error (the private context:
 * cuda_backend_impl.h; the kernels: cuda_ops.cu, cuda_attention*.cu,
 * cuda_backward.cu, cuda_moe.cu, cuda_family.cu, cuda_fused.cu; in bf16 mode attention
 * first offers the call to cuDNN, cuda_cudnn.h). */
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_attention_bwd.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_backward.h"
#include "kernels/cuda/cuda_family.h"
#include "kernels/cuda/cuda_fused.h"
#include "kernels/cuda/cuda_moe.h"
#include "kernels/cuda/cuda_ops.h"

#include <stdlib.h>

namespace nl_cu
{

/* ---------------------------------------------------------------- forward ops */

void cu_embedding_forward(nl_backend *be, float *out, const int32_t *tokens, const float *table,
                          int N, int C)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "embedding_forward",
             nl_cuda_embedding_forward(c->stream, out, tokens, table, N, C));
}

void cu_rmsnorm_forward(nl_backend *be, float *out, float *rstd, const float *inp, const float *w,
                        int N, int C, float eps)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "rmsnorm_forward",
             nl_cuda_rmsnorm_forward(c->stream, out, rstd, inp, w, N, C, eps));
}

void cu_rope_forward(nl_backend *be, float *x, const int32_t *pos, int N, int row, int col0,
                     int heads, int hd, float base)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "rope_forward",
             nl_cuda_rope_forward(c->stream, x, pos, N, row, col0, heads, hd, base));
}

void cu_attention_forward(nl_backend *be, float *out, float *lse, const float *q, int q_stride,
                          const float *k, const float *v, int kv_stride, nl_attn_shape s)
{
    cuda_ctx *c = enter_slot(be, __func__);
    /* device positions (a captured decode step), a bf16 cache or the
     * sequences' own caches: the module's kernels */
    if (!s.pos && !s.kv_bf16 && !s.kseq &&
        nl_cudnn_attention_forward(c->cudnn, out, lse, q, q_stride, k, v, kv_stride, s, NULL))
        return;
    launched(c, "attention_forward",
             nl_cuda_attention_forward(c->stream, out, lse, q, q_stride, k, v, kv_stride, s));
}

void cu_rope_scaled_forward(nl_backend *be, float *x, const int32_t *pos, int N, int row, int col0,
                            int heads, int hd, float base, nl_rope_scaling sc)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (sc.type != NL_ROPE_YARN) /* as the CPU: no scaling is plain RoPE */
        launched(c, "rope_forward",
                 nl_cuda_rope_forward(c->stream, x, pos, N, row, col0, heads, hd, base));
    else
        launched_shape(
            c, nl_cuda_rope_yarn_forward(c->stream, x, pos, N, row, col0, heads, hd, base, sc),
            "rope_scaled_forward (N %d hd %d factor %g L0 %d)", N, hd, sc.factor,
            sc.original_max_seq_len);
}

void cu_attention_masked_forward(nl_backend *be, float *out, float *lse, const float *q,
                                 int q_stride, const float *k, const float *v, int kv_stride,
                                 nl_attn_shape s, nl_attn_mask mask)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (!s.pos && !s.kv_bf16 && !s.kseq &&
        nl_cudnn_attention_forward(c->cudnn, out, lse, q, q_stride, k, v, kv_stride, s, &mask))
        return;
    launched_shape(c,
                   nl_cuda_attention_masked_forward(c->stream, out, lse, q, q_stride, k, v,
                                                    kv_stride, s, mask),
                   "attention_masked_forward (B %d T %d past %d H %d hd %d bidir %d window %d "
                   "doc %s)",
                   s.B, s.T, s.past, s.H, s.hd, mask.bidir, mask.window, mask.doc ? "yes" : "no");
}

void cu_softmax_forward(nl_backend *be, float *x, int N, int C)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "softmax_forward", nl_cuda_softmax_forward(c->stream, x, N, C));
}

void cu_swiglu_forward(nl_backend *be, float *out, const float *gu, int N, int F)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "swiglu_forward", nl_cuda_swiglu_forward(c->stream, out, gu, N, F));
}

void cu_geglu_forward(nl_backend *be, float *out, const float *gu, int N, int F)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched_shape(c, nl_cuda_geglu_forward(c->stream, out, gu, N, F), "geglu_forward (N %d F %d)",
                   N, F);
}

void cu_gather_rows(nl_backend *be, float *out, const float *src, const int32_t *idx, int n, int C)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "gather_rows", nl_cuda_gather_rows(c->stream, out, src, idx, n, C));
}

void cu_copy_rows(nl_backend *be, float *dst, int dst_stride, const float *src, int src_stride,
                  int rows, int cols)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "copy_rows",
             nl_cuda_copy_rows(c->stream, dst, dst_stride, src, src_stride, rows, cols));
}

void cu_kv_store(nl_backend *be, float *kc, float *vc, const float *qkv, int stride, int k_col,
                 int v_col, const int32_t *pos, int B, int T, int cap, int kv_dim)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(
        c, "kv_store",
        nl_cuda_kv_store(c->stream, kc, vc, qkv, stride, k_col, v_col, pos, B, T, cap, kv_dim));
}

void cu_kv_store_seq(nl_backend *be, void *const *kseq, void *const *vseq, int bf16,
                     const float *qkv, int stride, int k_col, int v_col, const int32_t *pos, int B,
                     int T, int kv_dim)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "kv_store_seq",
             nl_cuda_kv_store_seq(c->stream, kseq, vseq, bf16, qkv, stride, k_col, v_col, pos, B, T,
                                  kv_dim));
}

void cu_kv_store_bf16(nl_backend *be, uint16_t *kc, uint16_t *vc, const float *qkv, int stride,
                      int k_col, int v_col, const int32_t *pos, int past, int B, int T, int cap,
                      int kv_dim)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "kv_store_bf16",
             nl_cuda_kv_store_bf16(c->stream, kc, vc, qkv, stride, k_col, v_col, pos, past, B, T,
                                   cap, kv_dim));
}

void cu_moe_combine(nl_backend *be, float *x, const float *y, const int32_t *slot, const float *w,
                    int N, int k, int C)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "moe_combine", nl_cuda_moe_combine(c->stream, x, y, slot, w, N, k, C));
}

/* ---------------------------------------------------------------- fused decode */

/* The fused slots' weights in bf16 mode: their bf16 copy where a range
 * holds them (made again first when stale), else NULL (the kernels round
 * the FP32 weights as read: the same bits). An expert operand is checked
 * for its first expert only (the slots are not told E): every range is a
 * whole model's parameters (core/model/model.c registers nothing else), so
 * a range that holds a layer's first expert holds all of them. */
static const uint16_t *fused_copy(cuda_ctx *c, const float *w, int rows, int cols)
{
    if (!c->bf16)
        return NULL;
    int rc = 0;
    const uint16_t *copy = nl_cuda_bf16_weight_operand(&c->w, c->stream, w, rows, cols, cols, &rc);
    launched(c, "fused decode (bf16): weight copy", rc);
    return copy;
}

void cu_moe_norm_route(nl_backend *be, float *xn, float *probs, int32_t *choice, float *w,
                       const float *x, const float *norm_w, const float *router, int N, int d,
                       int E, int k, float eps)
{
    cuda_ctx *c = enter_slot(be, __func__);
    const uint16_t *r16 = fused_copy(c, router, E, d);
    launched(c, "moe_norm_route",
             nl_cuda_moe_norm_route(c->stream, xn, probs, choice, w, x, norm_w, router, r16,
                                    c->bf16, N, d, E, k, eps));
}

void cu_moe_gate_up(nl_backend *be, float *hs, float *gu, const float *xn, const int32_t *choice,
                    const float *experts, size_t expert_stride, int N, int k, int d, int F)
{
    cuda_ctx *c = enter_slot(be, __func__);
    const uint16_t *e16 =
        expert_stride <= INT32_MAX ? fused_copy(c, experts, 1, (int)expert_stride) : NULL;
    launched(c, "moe_gate_up",
             nl_cuda_moe_gate_up(c->stream, hs, gu, xn, choice, experts, e16, c->bf16,
                                 expert_stride, N, k, d, F));
}

void cu_moe_down_combine(nl_backend *be, float *x, float *ye, const float *hs,
                         const int32_t *choice, const float *w, const float *experts,
                         size_t expert_stride, int N, int k, int d, int F)
{
    cuda_ctx *c = enter_slot(be, __func__);
    const uint16_t *e16 =
        expert_stride <= INT32_MAX ? fused_copy(c, experts, 1, (int)expert_stride) : NULL;
    launched(c, "moe_down_combine",
             nl_cuda_moe_down_combine(c->stream, x, ye, hs, choice, w, experts, e16, c->bf16,
                                      expert_stride, N, k, d, F));
}

/* ---------------------------------------------------------------- routing */

void cu_moe_route(nl_backend *be, int32_t *choice, float *w, int32_t *offsets, int32_t *perm,
                  int32_t *slot, const float *probs, int N, int E, int k)
{
    cuda_ctx *c = enter_slot(be, __func__);
    c->off_ptr = NULL;
    launched_shape(c, nl_cuda_moe_route(c->stream, choice, w, offsets, perm, slot, probs, N, E, k),
                   "moe_route (N %d E %d k %d)", N, E, k);
    route_note(c, offsets, E, (int64_t)N * k); /* offsets[E]: every (token, choice) */
}

void cu_moe_aux(nl_backend *be, double *aux, float *frac, int64_t *counts, const float *probs,
                const int32_t *offsets, const float *global_frac, int N, int E, int k,
                double aux_rows)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched_shape(c,
                   nl_cuda_moe_aux(c->stream, aux, frac, counts, probs, offsets, global_frac, N, E,
                                   k, aux_rows),
                   "moe_aux (N %d E %d k %d)", N, E, k);
}

void cu_moe_router_backward(nl_backend *be, float *dl, const float *dw, const float *probs,
                            const int32_t *choice, const float *w, const float *frac, int N, int E,
                            int k, float aux_scale)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched_shape(
        c,
        nl_cuda_moe_router_backward(c->stream, dl, dw, probs, choice, w, frac, N, E, k, aux_scale),
        "moe_router_backward (N %d E %d k %d)", N, E, k);
}

/* ---------------------------------------------------------------- backward ops */

void cu_embedding_backward(nl_backend *be, float *dtable, const float *dout, const int32_t *tokens,
                           int N, int C)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched_shape(c,
                   nl_cuda_embedding_backward(c->stream, dtable, dout, tokens, N, C, c->scratch,
                                              c->scratch_bytes),
                   "embedding_backward (N %d C %d)", N, C);
}

void cu_rmsnorm_backward(nl_backend *be, float *dinp, float *dw, const float *dout,
                         const float *inp, const float *w, const float *rstd, int N, int C)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched_shape(c,
                   nl_cuda_rmsnorm_backward(c->stream, dinp, dw, dout, inp, w, rstd, N, C,
                                            c->scratch, c->scratch_bytes),
                   "rmsnorm_backward (N %d C %d)", N, C);
}

void cu_attention_backward(nl_backend *be, float *dq, float *dk, float *dv, const float *dout,
                           const float *q, int q_stride, const float *k, const float *v,
                           int kv_stride, const float *out, const float *lse, nl_attn_shape s)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (nl_cudnn_attention_backward(c->cudnn, dq, dk, dv, dout, q, q_stride, k, v, kv_stride, out,
                                    lse, s, NULL))
        return;
    /* the row sums D in scratch when they fit, else per tile (same bits) */
    const size_t need = nl_cuda_attention_backward_scratch(s);
    float *scratch = need > 0 && need <= c->scratch_bytes ? (float *)c->scratch : NULL;
    launched_shape(c,
                   nl_cuda_attention_backward(c->stream, dq, dk, dv, dout, q, q_stride, k, v,
                                              kv_stride, out, lse, scratch, s),
                   "attention_backward (B %d T %d past %d kv_cap %d H %d G %d hd %d q_stride %d "
                   "kv_stride %d)",
                   s.B, s.T, s.past, s.kv_cap, s.H, s.G, s.hd, q_stride, kv_stride);
}

void cu_attention_masked_backward(nl_backend *be, float *dq, float *dk, float *dv,
                                  const float *dout, const float *q, int q_stride, const float *k,
                                  const float *v, int kv_stride, const float *out, const float *lse,
                                  nl_attn_shape s, nl_attn_mask mask)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (nl_cudnn_attention_backward(c->cudnn, dq, dk, dv, dout, q, q_stride, k, v, kv_stride, out,
                                    lse, s, &mask))
        return;
    const size_t need = nl_cuda_attention_backward_scratch(s);
    float *scratch = need > 0 && need <= c->scratch_bytes ? (float *)c->scratch : NULL;
    launched_shape(c,
                   nl_cuda_attention_masked_backward(c->stream, dq, dk, dv, dout, q, q_stride, k, v,
                                                     kv_stride, out, lse, scratch, s, mask),
                   "attention_masked_backward (B %d T %d past %d kv_cap %d H %d G %d hd %d "
                   "bidir %d window %d doc %s)",
                   s.B, s.T, s.past, s.kv_cap, s.H, s.G, s.hd, mask.bidir, mask.window,
                   mask.doc ? "yes" : "no");
}

void cu_geglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N, int F)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched_shape(c, nl_cuda_geglu_backward(c->stream, dgu, dh, gu, N, F),
                   "geglu_backward (N %d F %d)", N, F);
}

void cu_swiglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N, int F)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched_shape(c, nl_cuda_swiglu_backward(c->stream, dgu, dh, gu, N, F),
                   "swiglu_backward (N %d F %d)", N, F);
}

void cu_moe_combine_backward(nl_backend *be, float *dy, float *dw, const float *dx, const float *y,
                             const int32_t *slot, const float *w, int N, int k, int C)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched_shape(c, nl_cuda_moe_combine_backward(c->stream, dy, dw, dx, y, slot, w, N, k, C),
                   "moe_combine_backward (N %d k %d C %d)", N, k, C);
}

void cu_cross_entropy(nl_backend *be, float *logits, float *losses, const int32_t *targets, int N,
                      int V, float scale)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched_shape(c, nl_cuda_cross_entropy(c->stream, logits, losses, targets, N, V, scale),
                   "cross_entropy (N %d V %d)", N, V);
}

/* Queues the two reduction kernels, then waits for the one double: the
 * slot returns a value, so it synchronises the stream. NaN when the
 * backend has failed (now or before): never a plausible norm from a
 * device that cannot be trusted. */
double cu_sumsq(nl_backend *be, const float *x, size_t n)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (refused_in_capture(c, "sumsq"))
        return NAN;
    be->stats.host_syncs++;
    if (n == 0)
        return report(c, NULL) == NL_OK ? 0.0 : NAN;
    /* the result in the scratch's first 256 bytes, the partials after them */
    double *res = (double *)c->scratch;
    launched_shape(
        c, nl_cuda_sumsq(c->stream, res, x, n, (char *)c->scratch + 256, c->scratch_bytes - 256),
        "sumsq (n %zu)", n);
    double h = NAN;
    cudaError_t e = cudaMemcpyAsync(&h, res, sizeof h, cudaMemcpyDeviceToHost, c->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->stream);
    ok(c, "sumsq", e);
    return report(c, NULL) == NL_OK ? h : NAN;
}

/* All n rows' kernels queued, then their ids in one copy and one wait:
 * a batch's step costs one host sync for its tokens, whatever n. */
void cu_sample_rows(nl_backend *be, int32_t *ids, const nl_sample_row *rows, int n, int V)
{
    cuda_ctx *c = enter_slot(be, __func__);
    for (int i = 0; i < n; i++)
        ids[i] = -1;
    if (refused_in_capture(c, "sample_rows") || n <= 0)
        return;
    /* the ids in the reduction scratch's first bytes (the stream orders its users) */
    if ((size_t)n * sizeof(int32_t) > c->scratch_bytes) {
        launched_shape(c, (int)cudaErrorInvalidValue, "sample_rows (n %d: more than the scratch)",
                       n);
        return;
    }
    be->stats.host_syncs++;
    int32_t *res = (int32_t *)c->scratch;
    /* the rest of the scratch, from 256 bytes past the ids, for top-p
     * rows' weights (where they fit; else computed again, the same ids) */
    const size_t at = ((size_t)n * sizeof(int32_t) + 255) / 256 * 256;
    float *w = at < c->scratch_bytes ? (float *)((char *)c->scratch + at) : NULL;
    launched_shape(
        c, nl_cuda_sample_rows(c->stream, res, rows, n, V, w, w ? c->scratch_bytes - at : 0),
        "sample_rows (n %d V %d)", n, V);
    if (report(c, NULL) != NL_OK)
        return;
    cudaError_t e =
        cudaMemcpyAsync(ids, res, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost, c->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->stream);
    ok(c, "sample_rows", e);
    if (report(c, NULL) != NL_OK)
        for (int i = 0; i < n; i++)
            ids[i] = -1;
}

void cu_adamw(nl_backend *be, float *p, const float *g, float *m, float *v, size_t n, float lr,
              float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale)
{
    cuda_ctx *c = enter_slot(be, __func__);
    /* bf16: the copy of these weights is written in the same pass (or,
     * when it is stale anyway, made again on the next GEMM) */
    uint16_t *copy = c->bf16 ? nl_cuda_bf16_adamw_copy(&c->w, p, n) : NULL;
    if (copy) {
        launched_shape(c,
                       nl_cuda_adamw_bf16(c->stream, p, copy, g, m, v, n, lr, b1, b2, eps, wd, bc1,
                                          bc2, grad_scale),
                       "adamw (bf16) (n %zu)", n);
        return;
    }
    launched_shape(
        c, nl_cuda_adamw(c->stream, p, g, m, v, n, lr, b1, b2, eps, wd, bc1, bc2, grad_scale),
        "adamw (n %zu)", n);
}

/* ---------------------------------------------------------------- graphs */

/* A decode step captured from the stream (cudaStreamBeginCapture) and
 * instantiated once, then launched per token: one launch in place of a
 * few hundred. Thread-local capture mode: other threads' CUDA calls are
 * not affected; this thread's calls that would wait for the stream are
 * refused by the slots (refused_in_capture) before CUDA sees them.
 *
 * bf16 mode: a captured GEMM reads a weight range's bf16 copy by address,
 * so every stale copy is made again (outside the graph, on the stream)
 * before the capture begins and before every replay; a recording made
 * when other ranges existed (the table's epoch) is invalidated (1 from
 * graph_launch: the caller records again). */
struct cu_graph {
    cudaGraphExec_t exec;
    unsigned long epoch; /* the bf16 table's when recorded */
};

/* bf16: queue the conversion of every stale weight copy (0, or the
 * launch's error kept) */
static int refresh_copies(cuda_ctx *c)
{
    if (!c->bf16)
        return 0;
    const int rc = nl_cuda_bf16_refresh(&c->w, c->stream);
    launched(c, "graph: bf16 weight copies", rc);
    return rc;
}

void cu_graph_begin(nl_backend *be)
{
    cuda_ctx *c = enter_slot(be, __func__);
    c->refused = NULL;
    if (refresh_copies(c) != 0) {
        c->refused = "the bf16 weight copies could not be made";
        return;
    }
    const cudaError_t e = cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* not a device fault: graph_end reports it */
        c->refused = "cudaStreamBeginCapture failed";
        return;
    }
    c->capturing = true;
    c->w.capturing = 1;
    c->w.stale_in_capture = 0;
}

nl_status cu_graph_end(nl_backend *be, void **graph, nl_error *err)
{
    cuda_ctx *c = enter_slot(be, __func__);
    *graph = nullptr;
    cudaGraph_t g = nullptr;
    cudaError_t e = cudaSuccess;
    if (c->capturing)
        e = cudaStreamEndCapture(c->stream, &g);
    const char *refused = c->refused;
    if (!refused && c->w.stale_in_capture)
        refused = "a bf16 weight copy written while recording";
    c->capturing = false;
    c->refused = nullptr;
    c->w.capturing = 0;
    c->w.stale_in_capture = 0;
    cudaGraphExec_t x = nullptr;
    if (!refused && e == cudaSuccess && g)
        e = cudaGraphInstantiate(&x, g, 0);
    if (g)
        cudaGraphDestroy(g);
    cu_graph *cg = nullptr;
    if (!refused && e == cudaSuccess && x) {
        cg = (cu_graph *)malloc(sizeof *cg);
        if (!cg)
            refused = "out of host memory";
    }
    if (refused || e != cudaSuccess || !x || !cg) {
        if (x)
            cudaGraphExecDestroy(x);
        cudaGetLastError(); /* a failed capture leaves the stream usable */
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: step not captured (%s)", c->name,
                            refused ? refused : cudaGetErrorString(e));
    }
    *cg = cu_graph{x, c->w.epoch};
    *graph = (void *)cg;
    return NL_OK;
}

int cu_graph_launch(nl_backend *be, void *graph)
{
    cuda_ctx *c = enter_slot(be, __func__);
    const cu_graph *cg = (const cu_graph *)graph;
    if (c->bf16 && cg->epoch != c->w.epoch)
        return 1; /* a copy it reads may be gone: record again */
    if (refresh_copies(c) != 0)
        return 0; /* the error is kept (sticky): the caller's check reports it */
    ok(c, "graph_launch", cudaGraphLaunch(cg->exec, c->stream));
    return 0;
}

void cu_graph_free(nl_backend *be, void *graph)
{
    if (!graph)
        return;
    cuda_ctx *c = enter_slot(be, __func__);
    cu_graph *cg = (cu_graph *)graph;
    ok(c, "graph_free", cudaGraphExecDestroy(cg->exec));
    free(cg);
}

void fill_op_slots(nl_backend *be)
{
    be->embedding_forward = cu_embedding_forward;
    be->rmsnorm_forward = cu_rmsnorm_forward;
    be->rope_forward = cu_rope_forward;
    be->attention_forward = cu_attention_forward;
    be->rope_scaled_forward = cu_rope_scaled_forward;
    be->attention_masked_forward = cu_attention_masked_forward;
    be->softmax_forward = cu_softmax_forward;
    be->swiglu_forward = cu_swiglu_forward;
    be->geglu_forward = cu_geglu_forward;
    be->gather_rows = cu_gather_rows;
    be->copy_rows = cu_copy_rows;
    be->kv_store = cu_kv_store;
    be->kv_store_bf16 = cu_kv_store_bf16;
    be->kv_store_seq = cu_kv_store_seq;
    be->moe_combine = cu_moe_combine;
    be->moe_route = cu_moe_route;
    be->moe_aux = cu_moe_aux;
    be->moe_router_backward = cu_moe_router_backward;
    be->embedding_backward = cu_embedding_backward;
    be->rmsnorm_backward = cu_rmsnorm_backward;
    be->attention_backward = cu_attention_backward;
    be->attention_masked_backward = cu_attention_masked_backward;
    be->geglu_backward = cu_geglu_backward;
    be->swiglu_backward = cu_swiglu_backward;
    be->moe_combine_backward = cu_moe_combine_backward;
    be->cross_entropy = cu_cross_entropy;
    be->sumsq = cu_sumsq;
    be->sample_rows = cu_sample_rows;
    be->adamw = cu_adamw;
    /* the fused decode slots, in bf16 mode too (reading the weights' bf16
     * copies, with the separate slots' bf16 products) */
    be->moe_norm_route = cu_moe_norm_route;
    be->moe_gate_up = cu_moe_gate_up;
    be->moe_down_combine = cu_moe_down_combine;
    /* graphs in FP32 and bf16 (cu_graph: the weight copies are made
     * before a capture and a replay; a step whose many-row expert GEMMs
     * read offsets on the host is not captured), not under
     * NL_CUDA_PROFILE (which waits for the stream at every slot) */
    if (!ctx_of(be)->profile) {
        be->graph_begin = cu_graph_begin;
        be->graph_end = cu_graph_end;
        be->graph_launch = cu_graph_launch;
        be->graph_free = cu_graph_free;
    }
}

} // namespace nl_cu
