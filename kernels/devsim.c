/* cpu-devsim: a device simulator that runs anywhere. It is the CPU backend
 * behind tagged pointers: alloc hands out p ^ (1 << 62), a non-canonical
 * address on x86-64 and AArch64, so code above kernels/ that reads or
 * writes device memory on the host (instead of going through upload,
 * download or an op) faults at once, as it would on a GPU. Every slot
 * untags its pointer arguments and calls the CPU backend's slot;
 * host_memory is 0, so core takes its device code paths.
 *
 * Callers offset device pointers (slices of one allocation, row offsets):
 * untag(p + off) == untag(p) + off as long as no carry reaches bit 62,
 * which holds for any real allocation. NULL stays NULL both ways. */
#include "backend.h"
#include "backend_impl.h"
#include "cpu/cpu_ops.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TAG ((uintptr_t)1 << 62)

/* Tag a host pointer from the CPU backend; untag a device pointer. */
static void *tag(void *p)
{
    return p ? (void *)((uintptr_t)p ^ TAG) : NULL;
}

static void *untag(const void *p)
{
    return p ? (void *)((uintptr_t)p ^ TAG) : NULL;
}

#define UF(p) ((float *)untag(p))
#define UI(p) ((int32_t *)untag(p))

/* The CPU backend this one wraps. */
static nl_backend *cpu(nl_backend *be)
{
    return be->ctx;
}

/* ---------------------------------------------------------------- memory */

static void *ds_alloc(nl_backend *be, size_t bytes)
{
    void *p = cpu(be)->alloc(cpu(be), bytes);
    return tag(p);
}

static void ds_free(nl_backend *be, void *p)
{
    cpu(be)->free(cpu(be), untag(p));
}

/* upload, download, sync and sumsq count in this backend's own stats (the
 * wrapped CPU backend keeps its own) */
static void ds_upload(nl_backend *be, void *dst, const void *src, size_t bytes)
{
    if (bytes) {
        be->stats.host_syncs++;
        memcpy(untag(dst), src, bytes);
        cpu(be)->wrote(cpu(be), untag(dst), bytes); /* a bf16 copy of weights may be stale */
    }
}

static void ds_download(nl_backend *be, void *dst, const void *src, size_t bytes)
{
    if (bytes) {
        be->stats.host_syncs++;
        memcpy(dst, untag(src), bytes);
    }
}

static nl_status ds_sync(nl_backend *be, nl_error *err)
{
    be->stats.host_syncs++;
    return cpu(be)->sync(cpu(be), err);
}

static nl_status ds_bf16_weights(nl_backend *be, const float *p, size_t n, nl_error *err)
{
    return cpu(be)->bf16_weights(cpu(be), UF(p), n, err);
}

static void ds_zero(nl_backend *be, void *p, size_t bytes)
{
    cpu(be)->zero(cpu(be), untag(p), bytes);
}

static void ds_mem_stats(nl_backend *be, size_t *in_use, size_t *peak)
{
    cpu(be)->mem_stats(cpu(be), in_use, peak);
}

/* ---------------------------------------------------------------- ops */

static void ds_gemm(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                    const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    cpu(be)->gemm(cpu(be), trans_a, trans_b, M, N, K, alpha, UF(A), lda, UF(B), ldb, beta, UF(C),
                  ldc);
}

static void ds_gemm_rows(nl_backend *be, int trans_b, int M, int N, int K, const float *A, int lda,
                         const float *B, int ldb, int accumulate, float *C, int ldc)
{
    cpu(be)->gemm_rows(cpu(be), trans_b, M, N, K, UF(A), lda, UF(B), ldb, accumulate, UF(C), ldc);
}

static void ds_embedding_forward(nl_backend *be, float *out, const int32_t *tokens,
                                 const float *table, int N, int C)
{
    cpu(be)->embedding_forward(cpu(be), UF(out), UI(tokens), UF(table), N, C);
}

static void ds_rmsnorm_forward(nl_backend *be, float *out, float *rstd, const float *inp,
                               const float *w, int N, int C, float eps)
{
    cpu(be)->rmsnorm_forward(cpu(be), UF(out), UF(rstd), UF(inp), UF(w), N, C, eps);
}

static void ds_rope_forward(nl_backend *be, float *x, const int32_t *pos, int N, int row, int col0,
                            int heads, int hd, float base)
{
    cpu(be)->rope_forward(cpu(be), UF(x), UI(pos), N, row, col0, heads, hd, base);
}

static void ds_attention_forward(nl_backend *be, float *out, float *lse, const float *q,
                                 int q_stride, const float *k, const float *v, int kv_stride,
                                 nl_attn_shape s)
{
    cpu(be)->attention_forward(cpu(be), UF(out), UF(lse), UF(q), q_stride, UF(k), UF(v), kv_stride,
                               s);
}

static void ds_rope_scaled_forward(nl_backend *be, float *x, const int32_t *pos, int N, int row,
                                   int col0, int heads, int hd, float base, nl_rope_scaling sc)
{
    cpu(be)->rope_scaled_forward(cpu(be), UF(x), UI(pos), N, row, col0, heads, hd, base, sc);
}

static void ds_attention_masked_forward(nl_backend *be, float *out, float *lse, const float *q,
                                        int q_stride, const float *k, const float *v,
                                        int kv_stride, nl_attn_shape s, nl_attn_mask mask)
{
    mask.doc = UI(mask.doc);
    cpu(be)->attention_masked_forward(cpu(be), UF(out), UF(lse), UF(q), q_stride, UF(k), UF(v),
                                      kv_stride, s, mask);
}

static void ds_geglu_forward(nl_backend *be, float *out, const float *gu, int N, int F)
{
    cpu(be)->geglu_forward(cpu(be), UF(out), UF(gu), N, F);
}

static void ds_softmax_forward(nl_backend *be, float *x, int N, int C)
{
    cpu(be)->softmax_forward(cpu(be), UF(x), N, C);
}

static void ds_swiglu_forward(nl_backend *be, float *out, const float *gu, int N, int F)
{
    cpu(be)->swiglu_forward(cpu(be), UF(out), UF(gu), N, F);
}

static void ds_gather_rows(nl_backend *be, float *out, const float *src, const int32_t *idx, int n,
                           int C)
{
    cpu(be)->gather_rows(cpu(be), UF(out), UF(src), UI(idx), n, C);
}

static void ds_copy_rows(nl_backend *be, float *dst, int dst_stride, const float *src,
                         int src_stride, int rows, int cols)
{
    cpu(be)->copy_rows(cpu(be), UF(dst), dst_stride, UF(src), src_stride, rows, cols);
}

static void ds_moe_combine(nl_backend *be, float *x, const float *y, const int32_t *slot,
                           const float *w, int N, int k, int C)
{
    cpu(be)->moe_combine(cpu(be), UF(x), UF(y), UI(slot), UF(w), N, k, C);
}

static void ds_embedding_backward(nl_backend *be, float *dtable, const float *dout,
                                  const int32_t *tokens, int N, int C)
{
    cpu(be)->embedding_backward(cpu(be), UF(dtable), UF(dout), UI(tokens), N, C);
}

static void ds_rmsnorm_backward(nl_backend *be, float *dinp, float *dw, const float *dout,
                                const float *inp, const float *w, const float *rstd, int N, int C)
{
    cpu(be)->rmsnorm_backward(cpu(be), UF(dinp), UF(dw), UF(dout), UF(inp), UF(w), UF(rstd), N, C);
}

static void ds_attention_backward(nl_backend *be, float *dq, float *dk, float *dv,
                                  const float *dout, const float *q, int q_stride, const float *k,
                                  const float *v, int kv_stride, const float *out, const float *lse,
                                  nl_attn_shape s)
{
    cpu(be)->attention_backward(cpu(be), UF(dq), UF(dk), UF(dv), UF(dout), UF(q), q_stride, UF(k),
                                UF(v), kv_stride, UF(out), UF(lse), s);
}

static void ds_attention_masked_backward(nl_backend *be, float *dq, float *dk, float *dv,
                                         const float *dout, const float *q, int q_stride,
                                         const float *k, const float *v, int kv_stride,
                                         const float *out, const float *lse, nl_attn_shape s,
                                         nl_attn_mask mask)
{
    mask.doc = UI(mask.doc);
    cpu(be)->attention_masked_backward(cpu(be), UF(dq), UF(dk), UF(dv), UF(dout), UF(q), q_stride,
                                       UF(k), UF(v), kv_stride, UF(out), UF(lse), s, mask);
}

static void ds_geglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                              int F)
{
    cpu(be)->geglu_backward(cpu(be), UF(dgu), UF(dh), UF(gu), N, F);
}

static void ds_swiglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                               int F)
{
    cpu(be)->swiglu_backward(cpu(be), UF(dgu), UF(dh), UF(gu), N, F);
}

static void ds_moe_combine_backward(nl_backend *be, float *dy, float *dw, const float *dx,
                                    const float *y, const int32_t *slot, const float *w, int N,
                                    int k, int C)
{
    cpu(be)->moe_combine_backward(cpu(be), UF(dy), UF(dw), UF(dx), UF(y), UI(slot), UF(w), N, k, C);
}

static void ds_cross_entropy(nl_backend *be, float *logits, float *losses, const int32_t *targets,
                             int N, int V, float scale)
{
    cpu(be)->cross_entropy(cpu(be), UF(logits), UF(losses), UI(targets), N, V, scale);
}

static int32_t ds_sample(nl_backend *be, const float *logits, int V, float temperature, double u)
{
    be->stats.host_syncs++;
    return cpu(be)->sample(cpu(be), UF(logits), V, temperature, u);
}

static double ds_sumsq(nl_backend *be, const float *x, size_t n)
{
    be->stats.host_syncs++;
    return cpu(be)->sumsq(cpu(be), UF(x), n);
}

static void ds_adamw(nl_backend *be, float *p, const float *g, float *m, float *v, size_t n,
                     float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                     float grad_scale)
{
    cpu(be)->adamw(cpu(be), UF(p), UF(g), UF(m), UF(v), n, lr, b1, b2, eps, wd, bc1, bc2,
                   grad_scale);
}

/* ---------------------------------------------------------------- routing */

static void ds_moe_route(nl_backend *be, int32_t *choice, float *w, int32_t *offsets, int32_t *perm,
                         int32_t *slot, const float *probs, int N, int E, int k)
{
    cpu(be)->moe_route(cpu(be), UI(choice), UF(w), UI(offsets), UI(perm), UI(slot), UF(probs), N, E,
                       k);
}

static void ds_moe_aux(nl_backend *be, double *aux, float *frac, int64_t *counts,
                       const float *probs, const int32_t *offsets, const float *global_frac, int N,
                       int E, int k, double aux_rows)
{
    cpu(be)->moe_aux(cpu(be), (double *)untag(aux), UF(frac), (int64_t *)untag(counts), UF(probs),
                     UI(offsets), UF(global_frac), N, E, k, aux_rows);
}

static void ds_moe_router_backward(nl_backend *be, float *dl, const float *dw, const float *probs,
                                   const int32_t *choice, const float *w, const float *frac, int N,
                                   int E, int k, float aux_scale)
{
    cpu(be)->moe_router_backward(cpu(be), UF(dl), UF(dw), UF(probs), UI(choice), UF(w), UF(frac), N,
                                 E, k, aux_scale);
}

static void ds_gemm_grouped(nl_backend *be, int trans_b, int N, int K, const float *A, int lda,
                            const float *B, int ldb, size_t b_stride, float *C, int ldc,
                            const int32_t *offsets, int groups, int max_rows)
{
    /* the CPU backend's per-group calls, through this table's gemm (so a
     * caller that wraps gemm, as core/batch.c does, sees every call); the
     * offsets are read here, as the device itself would */
    nl_cpu_gemm_grouped(be, trans_b, N, K, A, lda, B, ldb, b_stride, C, ldc, UI(offsets), groups,
                        max_rows);
}

static void ds_gemm_grouped_wgrad(nl_backend *be, int M, int N, const float *A, int lda,
                                  const float *B, int ldb, float *C, int ldc, size_t c_stride,
                                  const int32_t *offsets, int groups)
{
    nl_cpu_gemm_grouped_wgrad(be, M, N, A, lda, B, ldb, C, ldc, c_stride, UI(offsets), groups);
}

static void ds_moe_ffn_forward(nl_backend *be, float *ye, float *hs, float *gu, const float *xe,
                               const float *experts, size_t expert_stride, int d, int F,
                               const int32_t *offsets, int groups, int max_rows)
{
    cpu(be)->moe_ffn_forward(cpu(be), UF(ye), UF(hs), UF(gu), UF(xe), UF(experts), expert_stride,
                             d, F, UI(offsets), groups, max_rows);
}

static void ds_moe_ffn_backward(nl_backend *be, float *dxe, float *dgu, float *dhs,
                                float *dexperts, const float *dye, const float *xe,
                                const float *gu, const float *hs, const float *experts,
                                size_t expert_stride, int d, int F, const int32_t *offsets,
                                int groups)
{
    cpu(be)->moe_ffn_backward(cpu(be), UF(dxe), UF(dgu), UF(dhs), UF(dexperts), UF(dye), UF(xe),
                              UF(gu), UF(hs), UF(experts), expert_stride, d, F, UI(offsets),
                              groups);
}

/* ---------------------------------------------------------------- table */

static void ds_destroy(nl_backend *be)
{
    nl_backend *inner = cpu(be);
    nl_backend_destroy(&inner);
    free(be);
}

nl_status nl_devsim_backend_new(nl_backend **out, const nl_backend_opts *o, nl_error *err)
{
    *out = NULL;
    nl_backend *inner = NULL;
    nl_status st = nl_cpu_backend_new(&inner, o, err);
    if (st != NL_OK)
        return st;
    nl_backend *be = calloc(1, sizeof *be);
    if (!be) {
        nl_backend_destroy(&inner);
        return nl_error_set(err, NL_ERR_NOMEM, "cpu-devsim backend: out of memory");
    }
    be->name = "cpu-devsim";
    be->ctx = inner;
    be->destroy = ds_destroy;
    be->host_memory = 0;
    be->can_train = 1;
    be->gemm_probe = inner->gemm_probe;
    be->runtime_bytes = 0;
    be->alloc = ds_alloc;
    be->free = ds_free;
    be->upload = ds_upload;
    be->download = ds_download;
    be->sync = ds_sync;
    be->check = NULL;
    be->mem_info = NULL;
    be->zero = ds_zero;
    be->mem_stats = ds_mem_stats;
    be->gemm = ds_gemm;
    be->gemm_rows = inner->gemm_rows ? ds_gemm_rows : NULL;
    be->bf16 = inner->bf16;
    be->bf16_weights = inner->bf16_weights ? ds_bf16_weights : NULL;
    be->embedding_forward = ds_embedding_forward;
    be->rmsnorm_forward = ds_rmsnorm_forward;
    be->rope_forward = ds_rope_forward;
    be->rope_scaled_forward = ds_rope_scaled_forward;
    be->attention_forward = ds_attention_forward;
    be->attention_masked_forward = ds_attention_masked_forward;
    be->geglu_forward = ds_geglu_forward;
    be->softmax_forward = ds_softmax_forward;
    be->swiglu_forward = ds_swiglu_forward;
    be->gather_rows = ds_gather_rows;
    be->copy_rows = ds_copy_rows;
    be->moe_combine = ds_moe_combine;
    be->moe_route = ds_moe_route;
    be->moe_aux = ds_moe_aux;
    be->moe_router_backward = ds_moe_router_backward;
    be->gemm_grouped = ds_gemm_grouped;
    be->gemm_grouped_wgrad = ds_gemm_grouped_wgrad;
    be->moe_ffn_forward = ds_moe_ffn_forward;
    be->moe_ffn_backward = ds_moe_ffn_backward;
    be->embedding_backward = ds_embedding_backward;
    be->rmsnorm_backward = ds_rmsnorm_backward;
    be->attention_backward = ds_attention_backward;
    be->attention_masked_backward = ds_attention_masked_backward;
    be->geglu_backward = ds_geglu_backward;
    be->swiglu_backward = ds_swiglu_backward;
    be->moe_combine_backward = ds_moe_combine_backward;
    be->cross_entropy = ds_cross_entropy;
    be->sumsq = ds_sumsq;
    be->sample = ds_sample;
    be->adamw = ds_adamw;
    *out = be;
    return NL_OK;
}
