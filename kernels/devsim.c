/* cpu-devsim: a device simulator that runs anywhere. It is the CPU backend
 * behind tagged pointers: alloc hands out p ^ (1 << 62), a non-canonical
 * address on x86-64 and AArch64, so code above kernels/ that reads or
 * writes device memory on the host (instead of going through upload,
 * download or an op) faults at once, as it would on a GPU. Every slot
 * untags its pointer arguments and calls the CPU backend's slot;
 * host_memory is 0, so core takes its device code paths. The op slots a
 * captured step may queue, and the graph slots that record and replay
 * such steps as a CUDA graph would, are in devsim_graph.c.
 *
 * Callers offset device pointers (slices of one allocation, row offsets):
 * untag(p + off) == untag(p) + off as long as no carry reaches bit 62,
 * which holds for any real allocation. NULL stays NULL both ways. */
#include "kernels/backend.h"
#include "kernels/backend_impl.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/devsim_impl.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define tag nl_ds_tag
#define untag nl_ds_untag
#define UF(p) ((float *)untag(p))
#define UI(p) ((int32_t *)untag(p))

static nl_backend *cpu(nl_backend *be)
{
    return nl_ds_cpu(be);
}

/* A slot that cannot be part of a recorded step (devsim_graph.c) drops
 * its call while one is recorded. */
#define NOT_RECORDED(be, slot)                                                                     \
    do {                                                                                           \
        if (nl_devsim_refused(be, slot))                                                           \
            return;                                                                                \
    } while (0)

/* ---------------------------------------------------------------- memory */

static void *ds_alloc(nl_backend *be, size_t bytes)
{
    if (nl_devsim_refused(be, "alloc"))
        return NULL;
    void *p = cpu(be)->alloc(cpu(be), bytes);
    return tag(p);
}

static void ds_free(nl_backend *be, void *p)
{
    NOT_RECORDED(be, "free");
    cpu(be)->free(cpu(be), untag(p));
}

/* upload, download, sync and sumsq count in this backend's own stats (the
 * wrapped CPU backend keeps its own) */
static void ds_upload(nl_backend *be, void *dst, const void *src, size_t bytes)
{
    NOT_RECORDED(be, "upload");
    if (bytes) {
        be->stats.host_syncs++;
        memcpy(untag(dst), src, bytes);
        cpu(be)->wrote(cpu(be), untag(dst), bytes); /* a bf16 copy of weights may be stale */
    }
}

static void ds_download(nl_backend *be, void *dst, const void *src, size_t bytes)
{
    NOT_RECORDED(be, "download");
    if (bytes) {
        be->stats.host_syncs++;
        memcpy(dst, untag(src), bytes);
    }
}

static nl_status ds_sync(nl_backend *be, nl_error *err)
{
    if (nl_devsim_refused(be, "sync"))
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "cpu-devsim: sync while a step is recorded");
    be->stats.host_syncs++;
    return cpu(be)->sync(cpu(be), err);
}

static nl_status ds_bf16_weights(nl_backend *be, const float *p, size_t n, nl_error *err)
{
    if (nl_devsim_refused(be, "bf16_weights"))
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "cpu-devsim: bf16_weights while recording");
    return cpu(be)->bf16_weights(cpu(be), UF(p), n, err);
}

static void ds_mem_stats(nl_backend *be, size_t *in_use, size_t *peak)
{
    cpu(be)->mem_stats(cpu(be), in_use, peak);
}

/* ---------------------------------------------------------------- ops */

static void ds_embedding_backward(nl_backend *be, float *dtable, const float *dout,
                                  const int32_t *tokens, int N, int C)
{
    NOT_RECORDED(be, "embedding_backward");
    cpu(be)->embedding_backward(cpu(be), UF(dtable), UF(dout), UI(tokens), N, C);
}

static void ds_rmsnorm_backward(nl_backend *be, float *dinp, float *dw, const float *dout,
                                const float *inp, const float *w, const float *rstd, int N, int C)
{
    NOT_RECORDED(be, "rmsnorm_backward");
    cpu(be)->rmsnorm_backward(cpu(be), UF(dinp), UF(dw), UF(dout), UF(inp), UF(w), UF(rstd), N, C);
}

static void ds_attention_backward(nl_backend *be, float *dq, float *dk, float *dv,
                                  const float *dout, const float *q, int q_stride, const float *k,
                                  const float *v, int kv_stride, const float *out, const float *lse,
                                  nl_attn_shape s)
{
    NOT_RECORDED(be, "attention_backward");
    cpu(be)->attention_backward(cpu(be), UF(dq), UF(dk), UF(dv), UF(dout), UF(q), q_stride, UF(k),
                                UF(v), kv_stride, UF(out), UF(lse), s);
}

static void ds_attention_masked_backward(nl_backend *be, float *dq, float *dk, float *dv,
                                         const float *dout, const float *q, int q_stride,
                                         const float *k, const float *v, int kv_stride,
                                         const float *out, const float *lse, nl_attn_shape s,
                                         nl_attn_mask mask)
{
    NOT_RECORDED(be, "attention_masked_backward");
    mask.doc = UI(mask.doc);
    cpu(be)->attention_masked_backward(cpu(be), UF(dq), UF(dk), UF(dv), UF(dout), UF(q), q_stride,
                                       UF(k), UF(v), kv_stride, UF(out), UF(lse), s, mask);
}

static void ds_geglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                              int F)
{
    NOT_RECORDED(be, "geglu_backward");
    cpu(be)->geglu_backward(cpu(be), UF(dgu), UF(dh), UF(gu), N, F);
}

static void ds_swiglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                               int F)
{
    NOT_RECORDED(be, "swiglu_backward");
    cpu(be)->swiglu_backward(cpu(be), UF(dgu), UF(dh), UF(gu), N, F);
}

static void ds_moe_combine_backward(nl_backend *be, float *dy, float *dw, const float *dx,
                                    const float *y, const int32_t *slot, const float *w, int N,
                                    int k, int C)
{
    NOT_RECORDED(be, "moe_combine_backward");
    cpu(be)->moe_combine_backward(cpu(be), UF(dy), UF(dw), UF(dx), UF(y), UI(slot), UF(w), N, k, C);
}

static void ds_cross_entropy(nl_backend *be, float *logits, float *losses, const int32_t *targets,
                             int N, int V, float scale)
{
    NOT_RECORDED(be, "cross_entropy");
    cpu(be)->cross_entropy(cpu(be), UF(logits), UF(losses), UI(targets), N, V, scale);
}

/* one wait for all n ids, as a device's single copy of them */
static void ds_sample_rows(nl_backend *be, int32_t *ids, const nl_sample_row *rows, int n, int V)
{
    if (nl_devsim_refused(be, "sample_rows")) {
        for (int i = 0; i < n; i++)
            ids[i] = -1;
        return;
    }
    if (n <= 0)
        return;
    be->stats.host_syncs++;
    for (int i = 0; i < n; i++) { /* each row untagged, sampled by the CPU's slot */
        nl_sample_row r = rows[i];
        r.logits = UF(r.logits);
        cpu(be)->sample_rows(cpu(be), &ids[i], &r, 1, V);
    }
}

static double ds_sumsq(nl_backend *be, const float *x, size_t n)
{
    if (nl_devsim_refused(be, "sumsq"))
        return 0.0;
    be->stats.host_syncs++;
    return cpu(be)->sumsq(cpu(be), UF(x), n);
}

static void ds_adamw(nl_backend *be, float *p, const float *g, float *m, float *v, size_t n,
                     float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                     float grad_scale)
{
    NOT_RECORDED(be, "adamw");
    cpu(be)->adamw(cpu(be), UF(p), UF(g), UF(m), UF(v), n, lr, b1, b2, eps, wd, bc1, bc2,
                   grad_scale);
}

/* ---------------------------------------------------------------- routing */

static void ds_moe_router_backward(nl_backend *be, float *dl, const float *dw, const float *probs,
                                   const int32_t *choice, const float *w, const float *frac, int N,
                                   int E, int k, float aux_scale)
{
    NOT_RECORDED(be, "moe_router_backward");
    cpu(be)->moe_router_backward(cpu(be), UF(dl), UF(dw), UF(probs), UI(choice), UF(w), UF(frac), N,
                                 E, k, aux_scale);
}

static void ds_gemm_grouped_wgrad(nl_backend *be, int M, int N, const float *A, int lda,
                                  const float *B, int ldb, float *C, int ldc, size_t c_stride,
                                  const int32_t *offsets, int groups)
{
    NOT_RECORDED(be, "gemm_grouped_wgrad");
    nl_cpu_gemm_grouped_wgrad(be, M, N, A, lda, B, ldb, C, ldc, c_stride, UI(offsets), groups);
}

static void ds_moe_ffn_backward(nl_backend *be, float *dxe, float *dgu, float *dhs, float *dexperts,
                                const float *dye, const float *xe, const float *gu, const float *hs,
                                const float *experts, size_t expert_stride, int d, int F,
                                const int32_t *offsets, int groups)
{
    NOT_RECORDED(be, "moe_ffn_backward");
    cpu(be)->moe_ffn_backward(cpu(be), UF(dxe), UF(dgu), UF(dhs), UF(dexperts), UF(dye), UF(xe),
                              UF(gu), UF(hs), UF(experts), expert_stride, d, F, UI(offsets),
                              groups);
}

/* ---------------------------------------------------------------- table */

static void ds_destroy(nl_backend *be)
{
    nl_ds_ctx *c = be->ctx;
    nl_backend *inner = c->cpu;
    if (be->graph_free)
        be->graph_free(be, c->rec);
    nl_backend_destroy(&inner);
    free(c);
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
    nl_ds_ctx *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        nl_backend_destroy(&inner);
        return nl_error_set(err, NL_ERR_NOMEM, "cpu-devsim backend: out of memory");
    }
    c->cpu = inner;
    be->name = "cpu-devsim";
    be->ctx = c;
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
    be->mem_stats = ds_mem_stats;
    be->bf16 = inner->bf16;
    be->bf16_weights = inner->bf16_weights ? ds_bf16_weights : NULL;
    be->moe_router_backward = ds_moe_router_backward;
    be->gemm_grouped_wgrad = ds_gemm_grouped_wgrad;
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
    be->sample_rows = ds_sample_rows;
    be->adamw = ds_adamw;
    /* as CUDA's (cuda_gemm.cu): the batch's steps of 16 rows or more run
     * gemm (whose bits on the CPU switch kernel at 16 rows, as cuBLAS's
     * depend on M), so what a GPU's batch may not promise fails here too
     * (test_batch) */
    be->gemm_rows_few = 1;
    nl_devsim_fill_graph_slots(be); /* the op slots a step may record, and the graph slots */
    *out = be;
    return NL_OK;
}
