/* The CUDA backend (libnl_cuda.so, loaded by nl_backend_new for "cuda:N"):
 * the slot table, device memory, errors and the GEMM through cuBLAS. The
 * forward kernels are in cuda_ops.cu and cuda_attention.cu, the backward
 * and optimizer kernels in cuda_backward.cu and cuda_attention_bwd.cu, the
 * routing and grouped expert GEMMs in cuda_moe.cu, the model variants'
 * GeGLU and YaRN RoPE in cuda_family.cu (their masked attention with the
 * attention kernels); every slot runs on the device (can_train = 1). In
 * bf16 mode the attention slots first offer the call to cuDNN's flash
 * attention (cuda_cudnn.h; NL_CUDNN_ATTN=0 turns it off, =force turns it
 * on for FP32 too) and run their own kernels when it declines.
 *
 * One backend = one device, one non-blocking stream, one cuBLAS handle
 * bound to that stream with a workspace allocated at creation, so nothing
 * allocates in the hot path. Every slot queues on the stream in call
 * order; download synchronises the stream before returning (backend.h's
 * ordering contract). An upload of at most NL_CUDA_STAGE_SLOT bytes (the
 * tokens, positions and targets of a step) is copied into a slot of a
 * pinned staging ring and queued without waiting, so the source may be
 * reused at once; the slot's event is waited for only when the ring comes
 * round to it while the device has not yet read it. Larger uploads wait
 * for their copy. So a decode step waits for the host once: its logits. Each entry point first makes the
 * backend's device current on the calling thread.
 *
 * Errors: the first failure (a launch error, a failed asynchronous call,
 * a shape a kernel refuses) is kept, with a message "cuda:N: <op>: <what>";
 * `sync` and `check` return it (NL_ERR_INTERNAL for device faults,
 * NL_ERR_SHAPE for a shape a backward launcher refuses). It stays: a CUDA
 * context that faulted cannot be trusted again.
 *
 * Reduction scratch: one device buffer of NL_CUDA_BWD_SCRATCH_BYTES (8 MiB,
 * cuda_backward.h), allocated at creation and shared by the ops that reduce
 * across blocks: the embedding backward's sort keys (2^20 rows at a time),
 * RMSNorm's weight-gradient partials (32 row groups x 65536 columns at a
 * time), the sum of squares' partials and its result, attention backward's
 * D = rowsum(dout * out) (B H T floats; without room, attention computes
 * it per tile, to the same bits). The one stream orders its users, so they
 * never overlap. No shape is too large for it: larger ones run in pieces
 * whose order leaves the results unchanged. The forward ops need none.
 *
 * runtime_bytes: the device memory that the stream, the cuBLAS handle,
 * its workspace and the reduction scratch took, measured with
 * cudaMemGetInfo just after the CUDA context exists and again after
 * them. The context itself (created by the first runtime call; typically
 * a few hundred MiB) is not included: it exists before the first
 * measurement, and it is already missing from the free memory that
 * mem_info reports. Kernels that cuBLAS loads lazily on first use are not
 * included either. */
extern "C" {
#include "../../base/log.h"
#include "../backend.h"
#include "../backend_impl.h"
}
#include "cuda_attention.h"
#include "cuda_attention_bwd.h"
#include "cuda_backward.h"
#include "cuda_comm.h"
#include "cuda_cudnn.h"
#include "cuda_family.h"
#include "cuda_gemm_plan.h"
#include "cuda_mixed.h"
#include "cuda_moe.h"
#include "cuda_ops.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NL_EXPORT extern "C" __attribute__((visibility("default")))

namespace
{

/* ---------------------------------------------------------------- allocation table */

/* Device pointer -> bytes, for mem_stats: open addressing with linear
 * probing, key 0 empty, at most half full, deletion by backward shift. */
struct alloc_table {
    uintptr_t *keys;
    size_t *sizes;
    size_t cap; /* a power of two, or 0 */
    size_t count;
};

size_t table_home(uintptr_t key, size_t cap)
{
    /* cudaMalloc pointers are 256-byte aligned: hash the bits above */
    return (size_t)(((key >> 8) * 0x9E3779B97F4A7C15ull) >> 17) & (cap - 1);
}

bool table_insert(alloc_table *t, uintptr_t key, size_t bytes)
{
    if ((t->count + 1) * 2 > t->cap) {
        const size_t ncap = t->cap ? t->cap * 2 : 256;
        uintptr_t *keys = (uintptr_t *)calloc(ncap, sizeof *keys);
        size_t *sizes = (size_t *)calloc(ncap, sizeof *sizes);
        if (!keys || !sizes) {
            free(keys);
            free(sizes);
            return false;
        }
        for (size_t i = 0; i < t->cap; i++) {
            if (!t->keys[i])
                continue;
            size_t j = table_home(t->keys[i], ncap);
            while (keys[j])
                j = (j + 1) & (ncap - 1);
            keys[j] = t->keys[i];
            sizes[j] = t->sizes[i];
        }
        free(t->keys);
        free(t->sizes);
        t->keys = keys;
        t->sizes = sizes;
        t->cap = ncap;
    }
    size_t i = table_home(key, t->cap);
    while (t->keys[i])
        i = (i + 1) & (t->cap - 1);
    t->keys[i] = key;
    t->sizes[i] = bytes;
    t->count++;
    return true;
}

/* Remove key; its size in *bytes. False when key is not in the table. */
bool table_remove(alloc_table *t, uintptr_t key, size_t *bytes)
{
    if (!t->cap)
        return false;
    const size_t mask = t->cap - 1;
    size_t i = table_home(key, t->cap);
    while (t->keys[i] != key) {
        if (!t->keys[i])
            return false;
        i = (i + 1) & mask;
    }
    *bytes = t->sizes[i];
    /* backward shift: move up every later entry of the run whose home
     * does not lie cyclically in (i, j], so no probe path is broken */
    for (size_t j = (i + 1) & mask; t->keys[j]; j = (j + 1) & mask) {
        const size_t h = table_home(t->keys[j], t->cap);
        const bool stays = i < j ? (h > i && h <= j) : (h > i || h <= j);
        if (!stays) {
            t->keys[i] = t->keys[j];
            t->sizes[i] = t->sizes[j];
            i = j;
        }
    }
    t->keys[i] = 0;
    t->count--;
    return true;
}

/* ---------------------------------------------------------------- context and errors */

/* the pinned staging ring of small uploads */
#define NL_CUDA_STAGE_SLOTS 16
#define NL_CUDA_STAGE_SLOT (64u << 10)

/* bf16: the scratch that activation operands are converted into (bf16
 * elements; 64 MiB), the cached cuBLASLt descriptors, and the most groups
 * the grouped GEMMs' tile map holds (gemm_grouped's own grid limit) */
#define NL_CUDA_BF16_CONV_ELEMS ((size_t)32 << 20)
#define NL_CUDA_LT_CACHE 64
#define NL_CUDA_MAX_GROUPS 65535

/* One cached cuBLASLt GEMM: its shape, strides and operand alignments,
 * the descriptors and the heuristic's algorithm for them. */
struct lt_entry {
    bool used;
    int ta, tb, M, N, K, lda, ldb, ldc;
    unsigned align_a, align_b, align_c;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    bool has_algo; /* false: no cuBLASLt algorithm; cublasGemmEx runs it */
};

struct cuda_ctx {
    int device;
    char name[24]; /* "cuda:N", also be->name */
    cudaStream_t stream;
    cublasHandle_t cublas;
    void *workspace; /* cuBLAS workspace */
    size_t workspace_bytes;
    void *scratch; /* reduction scratch of the backward ops */
    size_t scratch_bytes;
    unsigned char *stage;                     /* pinned, NL_CUDA_STAGE_SLOTS slots; NULL: none */
    cudaEvent_t stage_done[NL_CUDA_STAGE_SLOTS]; /* recorded after each slot's copy */
    bool stage_pending[NL_CUDA_STAGE_SLOTS];
    int stage_next;
    pthread_mutex_t lock; /* guards table, in_use, peak, sticky, msg */
    bool lock_ready;
    alloc_table table;
    size_t in_use, peak;
    nl_status sticky; /* the first error, kept */
    char msg[NL_ERROR_MSG_MAX];
    /* bf16 compute (nl_backend_opts.bf16); the field other slots (a bf16
     * attention) test for "bf16 mode" */
    int bf16;
    cublasLtHandle_t lt;
    nl_cuda_bf16_table w; /* the weight ranges and their bf16 copies */
    uint16_t *conv;       /* NL_CUDA_BF16_CONV_ELEMS: converted activations */
    int32_t *tile_start;  /* NL_CUDA_MAX_GROUPS + 1: the grouped GEMMs' tile map */
    lt_entry lt_cache[NL_CUDA_LT_CACHE];
    int lt_next; /* the entry to replace when the cache is full */
    nl_cudnn *cudnn; /* attention through cuDNN (cuda_cudnn.h), or NULL */
    /* the expert groups' row offsets last read to the host (bf16 grouped
     * GEMMs of many rows): valid for off_ptr until a slot that may write
     * offsets runs (upload, zero, moe_route) */
    const int32_t *off_ptr;
    int off_groups;
    int32_t off_host[NL_BACKEND_MAX_EXPERTS + 1];
    int experts_kernel; /* NL_CUDA_EXPERTS=kernel: never per expert (below) */
    /* NL_CUDA_PROFILE=1: each slot's time, the device's and the host's
     * until the next slot, measured by waiting for the stream at every
     * slot's entry (so overlap is gone: a diagnostic, not a speed) */
    int profile;
    const char *prof_prev; /* the slot entered last */
    double prof_t;         /* when it was entered */
    struct {
        const char *name;
        uint64_t calls;
        double s;
    } prof[64];
};

cuda_ctx *ctx_of(nl_backend *be)
{
    return (cuda_ctx *)be->ctx;
}

/* Keep the first error. */
__attribute__((format(printf, 3, 4))) void fail(cuda_ctx *c, nl_status st, const char *fmt, ...)
{
    pthread_mutex_lock(&c->lock);
    if (c->sticky == NL_OK) {
        c->sticky = st;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->msg, sizeof c->msg, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&c->lock);
}

/* Record a CUDA error of `op`; true when there was none. */
bool ok(cuda_ctx *c, const char *op, cudaError_t e)
{
    if (e == cudaSuccess)
        return true;
    fail(c, NL_ERR_INTERNAL, "%s: %s: %s", c->name, op, cudaGetErrorString(e));
    return false;
}

/* After a launcher (which returns cudaGetLastError as an int). */
void launched(cuda_ctx *c, const char *op, int rc)
{
    ok(c, op, (cudaError_t)rc);
}

/* After a backward launcher: a failure names the op and its shape, and a
 * refused shape (cudaErrorInvalidValue, nothing launched) is NL_ERR_SHAPE. */
__attribute__((format(printf, 3, 4))) void launched_shape(cuda_ctx *c, int rc, const char *fmt, ...)
{
    if (rc == 0)
        return;
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    const cudaError_t e = (cudaError_t)rc;
    fail(c, e == cudaErrorInvalidValue ? NL_ERR_SHAPE : NL_ERR_INTERNAL, "%s: %s: %s", c->name,
         what, cudaGetErrorString(e));
}

/* Every slot starts here: the backend's device becomes current on the
 * calling thread (a cheap check when it already is). */
double prof_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* NL_CUDA_PROFILE: the time since the last slot's entry is that slot's. */
void prof_mark(cuda_ctx *c, const char *slot)
{
    cudaStreamSynchronize(c->stream);
    const double t = prof_now();
    if (c->prof_prev) {
        int i = 0;
        while (i < 63 && c->prof[i].name && c->prof[i].name != c->prof_prev)
            i++;
        c->prof[i].name = c->prof_prev;
        c->prof[i].calls++;
        c->prof[i].s += t - c->prof_t;
    }
    c->prof_prev = slot;
    c->prof_t = t;
}

/* The profile, largest first, into the log (at destroy). */
void prof_report(cuda_ctx *c)
{
    double total = 0;
    int n = 0;
    while (n < 64 && c->prof[n].name)
        total += c->prof[n++].s;
    nl_log_write(NL_LOG_WARN, "%s: NL_CUDA_PROFILE: %.3f s in %d slots (device and host time "
                              "from each slot's entry to the next's)", c->name, total, n);
    for (int k = 0; k < n; k++) {
        int best = k;
        for (int i = k + 1; i < n; i++)
            if (c->prof[i].s > c->prof[best].s)
                best = i;
        const auto e = c->prof[best];
        c->prof[best] = c->prof[k];
        c->prof[k] = e;
        nl_log_write(NL_LOG_WARN, "%s: profile %-24s %8llu calls %9.3f ms %5.1f%%", c->name,
                     e.name, (unsigned long long)e.calls, e.s * 1e3,
                     total > 0 ? 100.0 * e.s / total : 0.0);
    }
}

cuda_ctx *enter_slot(nl_backend *be, const char *slot)
{
    cuda_ctx *c = ctx_of(be);
    if (c->profile)
        prof_mark(c, slot);
    ok(c, "set device", cudaSetDevice(c->device));
    /* a launch check reads the thread's last error: drop one left by other
     * code so it is not blamed on this op (a sticky fault comes back anyway) */
    (void)cudaGetLastError();
    return c;
}

nl_status report(cuda_ctx *c, nl_error *err)
{
    pthread_mutex_lock(&c->lock);
    const nl_status st = c->sticky;
    if (st != NL_OK)
        nl_error_set(err, st, "%s", c->msg);
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---------------------------------------------------------------- memory */

void *cu_alloc(nl_backend *be, size_t bytes)
{
    cuda_ctx *c = enter_slot(be, __func__);
    const size_t rounded = bytes == 0 ? 256 : (bytes + 255) & ~(size_t)255;
    if (rounded < bytes)
        return NULL;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, rounded);
    if (e != cudaSuccess) {
        /* out of memory is the caller's to handle (NULL), not a fault;
         * clear it so the next launch check does not report it */
        cudaGetLastError();
        if (e != cudaErrorMemoryAllocation)
            ok(c, "alloc", e);
        return NULL;
    }
    e = cudaMemsetAsync(p, 0, rounded, c->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->stream);
    if (!ok(c, "alloc", e)) {
        cudaFree(p);
        return NULL;
    }
    pthread_mutex_lock(&c->lock);
    const bool kept = table_insert(&c->table, (uintptr_t)p, rounded);
    if (kept) {
        c->in_use += rounded;
        c->peak = c->in_use > c->peak ? c->in_use : c->peak;
    }
    pthread_mutex_unlock(&c->lock);
    if (!kept) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

void cu_free(nl_backend *be, void *p)
{
    if (!p)
        return;
    cuda_ctx *c = enter_slot(be, __func__);
    size_t bytes = 0;
    pthread_mutex_lock(&c->lock);
    const bool found = table_remove(&c->table, (uintptr_t)p, &bytes);
    if (found)
        c->in_use -= bytes;
    pthread_mutex_unlock(&c->lock);
    if (!found) {
        fail(c, NL_ERR_INTERNAL, "%s: free: %p was not allocated by this backend", c->name, p);
        return;
    }
    /* queued ops that still read p finish first */
    ok(c, "free", cudaStreamSynchronize(c->stream));
    ok(c, "free", cudaFree(p));
}

void cu_mem_stats(nl_backend *be, size_t *in_use, size_t *peak)
{
    cuda_ctx *c = ctx_of(be);
    pthread_mutex_lock(&c->lock);
    if (in_use)
        *in_use = c->in_use;
    if (peak)
        *peak = c->peak;
    pthread_mutex_unlock(&c->lock);
}

/* Queue a small upload from a staging slot; false when there is no ring
 * or the bytes do not fit a slot (the caller then copies synchronously). */
bool staged_upload(nl_backend *be, cuda_ctx *c, void *dst, const void *src, size_t bytes)
{
    if (!c->stage || bytes > NL_CUDA_STAGE_SLOT)
        return false;
    const int i = c->stage_next;
    c->stage_next = (i + 1) % NL_CUDA_STAGE_SLOTS;
    if (c->stage_pending[i]) {
        /* the device may still be reading this slot from 16 uploads ago */
        cudaError_t q = cudaEventQuery(c->stage_done[i]);
        if (q == cudaErrorNotReady) {
            be->stats.host_syncs++;
            q = cudaEventSynchronize(c->stage_done[i]);
        }
        if (!ok(c, "upload", q))
            return true; /* the error is kept; nothing is queued */
        c->stage_pending[i] = false;
    }
    unsigned char *slot = c->stage + (size_t)i * NL_CUDA_STAGE_SLOT;
    memcpy(slot, src, bytes);
    cudaError_t e = cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess)
        e = cudaEventRecord(c->stage_done[i], c->stream);
    if (ok(c, "upload", e))
        c->stage_pending[i] = true;
    return true;
}

void cu_upload(nl_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!bytes)
        return;
    cuda_ctx *c = enter_slot(be, __func__);
    c->off_ptr = NULL; /* it may have written routing offsets */
    if (c->bf16) /* into weights: their bf16 copy is made again on next use */
        nl_cuda_bf16_mark(&c->w, dst, bytes);
    if (staged_upload(be, c, dst, src, bytes))
        return;
    be->stats.host_syncs++;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->stream); /* src may be reused on return */
    ok(c, "upload", e);
}

void cu_download(nl_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!bytes)
        return;
    cuda_ctx *c = enter_slot(be, __func__);
    be->stats.host_syncs++;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->stream); /* the bytes are on the host on return */
    ok(c, "download", e); /* on failure dst holds no result: sync and check say so */
}

void cu_zero(nl_backend *be, void *p, size_t bytes)
{
    if (!bytes)
        return;
    cuda_ctx *c = enter_slot(be, __func__);
    c->off_ptr = NULL;
    if (c->bf16)
        nl_cuda_bf16_mark(&c->w, p, bytes);
    ok(c, "zero", cudaMemsetAsync(p, 0, bytes, c->stream));
}

nl_status cu_sync(nl_backend *be, nl_error *err)
{
    cuda_ctx *c = enter_slot(be, __func__);
    be->stats.host_syncs++;
    ok(c, "sync", cudaStreamSynchronize(c->stream));
    ok(c, "sync", cudaGetLastError());
    return report(c, err);
}

nl_status cu_check(nl_backend *be, nl_error *err)
{
    cuda_ctx *c = enter_slot(be, __func__);
    ok(c, "check", cudaGetLastError());
    /* a fault of finished work shows without waiting for the rest */
    const cudaError_t e = cudaStreamQuery(c->stream);
    if (e == cudaErrorNotReady)
        cudaGetLastError(); /* not an error: work is still queued */
    else
        ok(c, "check", e);
    return report(c, err);
}

nl_status cu_mem_info(nl_backend *be, size_t *free_bytes, size_t *total_bytes, nl_error *err)
{
    cuda_ctx *c = enter_slot(be, __func__);
    size_t f = 0, t = 0;
    const cudaError_t e = cudaMemGetInfo(&f, &t);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return nl_error_set(err, NL_ERR_INTERNAL, "%s: mem_info: %s", c->name,
                            cudaGetErrorString(e));
    }
    if (free_bytes)
        *free_bytes = f;
    if (total_bytes)
        *total_bytes = t;
    return NL_OK;
}

/* ---------------------------------------------------------------- gemm */

void gemm_bf16(cuda_ctx *c, int ta, int tb, int M, int N, int K, float alpha, const float *A,
               int lda, const float *B, int ldb, float beta, float *C, int ldc);

/* Row-major C = alpha op(A) op(B) + beta C. cuBLAS is column-major, and a
 * row-major matrix with row stride ld is its transpose in column-major
 * with leading dimension ld, so compute C^T = op(B)^T op(A)^T: cuBLAS's
 * (m, n, k) = (N, M, K) with B first. */
void cu_gemm(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
             const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (M <= 0 || N <= 0)
        return;
    if (K <= 0) {
        /* an empty product: only scale C, 0 for beta == 0 even over NaN */
        launched(c, "gemm", nl_cuda_scale_rows(c->stream, C, ldc, M, N, beta));
        return;
    }
    if (c->bf16) {
        gemm_bf16(c, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    const cublasStatus_t s = cublasSgemm(c->cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B,
                                         ldb, A, lda, &beta, C, ldc);
    if (s != CUBLAS_STATUS_SUCCESS)
        fail(c, NL_ERR_INTERNAL, "%s: gemm: cublasSgemm (M %d N %d K %d lda %d ldb %d ldc %d): %s",
             c->name, M, N, K, lda, ldb, ldc, cublasGetStatusString(s));
}

/* ---------------------------------------------------------------- bf16 gemm
 *
 * be->bf16: C (FP32) = alpha op(A) op(B) + beta C with A and B in bf16 and
 * FP32 accumulation, through cuBLASLt (CUBLAS_COMPUTE_32F, bf16 A/B, FP32
 * C/D). An operand inside a weight range is read from its bf16 copy (made
 * again first when stale); any other is converted into the backend's
 * scratch, the GEMM cut into pieces that fit it (cuda_gemm_plan.h). The
 * descriptors, layouts and the heuristic's algorithm are cached per shape,
 * strides and operand alignment; cuBLASLt uses the backend's cuBLAS
 * workspace (the one stream orders the two libraries' use of it). Where
 * cuBLASLt offers no algorithm, cublasGemmEx computes the same thing. */

/* The alignment of p in bytes for cuBLASLt's preference, at most 16 (its
 * kernels' widest vector access): the preference is a guaranteed minimum,
 * and capping it keeps the cache's keys few (operands at different offsets
 * of the weights share an entry). */
unsigned align_of(const void *p)
{
    const uintptr_t u = (uintptr_t)p;
    unsigned a = 1;
    while (a < 16 && !(u & a))
        a <<= 1;
    return a;
}

void lt_entry_free(lt_entry *e)
{
    if (!e->used)
        return;
    if (e->la)
        cublasLtMatrixLayoutDestroy(e->la);
    if (e->lb)
        cublasLtMatrixLayoutDestroy(e->lb);
    if (e->lc)
        cublasLtMatrixLayoutDestroy(e->lc);
    if (e->op)
        cublasLtMatmulDescDestroy(e->op);
    memset(e, 0, sizeof *e);
}

/* The cached entry for this call, made (descriptors and heuristic) on a
 * miss; NULL with the error kept when cuBLASLt fails. */
lt_entry *lt_lookup(cuda_ctx *c, int ta, int tb, int M, int N, int K, int lda, int ldb, int ldc,
                    unsigned aa, unsigned ab, unsigned ac)
{
    for (int i = 0; i < NL_CUDA_LT_CACHE; i++) {
        lt_entry *e = &c->lt_cache[i];
        if (e->used && e->ta == ta && e->tb == tb && e->M == M && e->N == N && e->K == K &&
            e->lda == lda && e->ldb == ldb && e->ldc == ldc && e->align_a == aa &&
            e->align_b == ab && e->align_c == ac)
            return e;
    }
    lt_entry *e = &c->lt_cache[c->lt_next];
    c->lt_next = (c->lt_next + 1) % NL_CUDA_LT_CACHE;
    lt_entry_free(e);
    e->used = true;
    e->ta = ta;
    e->tb = tb;
    e->M = M;
    e->N = N;
    e->K = K;
    e->lda = lda;
    e->ldb = ldb;
    e->ldc = ldc;
    e->align_a = aa;
    e->align_b = ab;
    e->align_c = ac;
    const nl_lt_plan p = nl_lt_plan_make(ta, tb, M, N, K, lda, ldb, ldc);
    const cublasOperation_t opa = p.a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t opb = p.b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulPreference_t pref = NULL;
    const uint64_t ws = c->workspace_bytes;
    /* cuBLASLt's A is our B and its B our A (cuda_gemm_plan.h) */
    const uint32_t al_a = ab, al_b = aa, al_c = ac;
    cublasLtMatmulHeuristicResult_t h;
    memset(&h, 0, sizeof h);
    int found = 0;
    cublasStatus_t s = cublasLtMatmulDescCreate(&e->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&e->la, CUDA_R_16BF, p.a.rows, p.a.cols, p.a.ld);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&e->lb, CUDA_R_16BF, p.b.rows, p.b.cols, p.b.ld);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&e->lc, CUDA_R_32F, p.c.rows, p.c.cols, p.c.ld);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceCreate(&pref);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                 &al_a, sizeof al_a);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                 &al_b, sizeof al_b);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                 &al_c, sizeof al_c);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                 &al_c, sizeof al_c);
    if (s == CUBLAS_STATUS_SUCCESS) {
        /* no algorithm is not an error: cublasGemmEx takes the call */
        const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(c->lt, e->op, e->la, e->lb, e->lc,
                                                                 e->lc, pref, 1, &h, &found);
        e->has_algo = hs == CUBLAS_STATUS_SUCCESS && found > 0;
        if (e->has_algo)
            e->algo = h.algo;
    }
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS) {
        lt_entry_free(e);
        fail(c, NL_ERR_INTERNAL, "%s: gemm (bf16): cuBLASLt descriptors (M %d N %d K %d): %s",
             c->name, M, N, K, cublasGetStatusString(s));
        return NULL;
    }
    return e;
}

/* One bf16 product on the stream: row-major C (M x N, FP32) = alpha op(A)
 * op(B) + beta C with A, B bf16 (row strides lda, ldb). */
void lt_gemm(cuda_ctx *c, int ta, int tb, int M, int N, int K, float alpha, const uint16_t *A,
             int lda, const uint16_t *B, int ldb, float beta, float *C, int ldc)
{
    lt_entry *e =
        lt_lookup(c, ta, tb, M, N, K, lda, ldb, ldc, align_of(A), align_of(B), align_of(C));
    if (!e)
        return;
    cublasStatus_t s;
    if (e->has_algo)
        s = cublasLtMatmul(c->lt, e->op, &alpha, B, e->la, A, e->lb, &beta, C, e->lc, C, e->lc,
                           &e->algo, c->workspace, c->workspace_bytes, c->stream);
    else
        s = cublasGemmEx(c->cublas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                         N, M, K, &alpha, B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C,
                         CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        fail(c, NL_ERR_INTERNAL,
             "%s: gemm (bf16): %s (M %d N %d K %d lda %d ldb %d ldc %d trans %d %d): %s", c->name,
             e->has_algo ? "cublasLtMatmul" : "cublasGemmEx", M, N, K, lda, ldb, ldc, ta, tb,
             cublasGetStatusString(s));
}

/* The bf16 form of the piece of an operand stored as rows x cols floats
 * at x (row stride ld): in a weight copy (*ld_out = ld) or converted into
 * the scratch at conv (*ld_out = cols). */
const uint16_t *bf16_piece(cuda_ctx *c, const uint16_t *weight, const float *base, const float *x,
                           int rows, int cols, int ld, uint16_t *conv, int *ld_out)
{
    if (weight) {
        *ld_out = ld;
        return weight + (x - base);
    }
    launched_shape(c, nl_cuda_to_bf16_rows(c->stream, conv, cols, x, ld, rows, cols),
                   "gemm (bf16): convert %d x %d (ld %d)", rows, cols, ld);
    *ld_out = cols;
    return conv;
}

/* what the pieces of one bf16 GEMM share */
struct bf16_call {
    cuda_ctx *c;
    int ta, tb, lda, ldb, ldc;
    float alpha, beta;
    const float *A, *B;
    float *C;
    const uint16_t *aw, *bw; /* weight copies at A, B; NULL: converted */
    const uint16_t *ap;      /* the current piece of A */
    int la;
};

/* B's converted piece starts this many elements (256 bytes) aligned after A's */
#define NL_CUDA_BF16_SLACK 128

void bf16_piece_gemm(void *arg, const nl_bf16_piece *pc)
{
    bf16_call *g = (bf16_call *)arg;
    cuda_ctx *c = g->c;
    if (pc->new_a) {
        const float *ax = g->ta ? g->A + (size_t)pc->k0 * g->lda + pc->m0
                                : g->A + (size_t)pc->m0 * g->lda + pc->k0;
        g->ap = bf16_piece(c, g->aw, g->A, ax, g->ta ? pc->k : pc->m, g->ta ? pc->m : pc->k, g->lda,
                           c->conv, &g->la);
    }
    const size_t a_used = g->aw ? 0
                                : ((size_t)pc->m * pc->k + NL_CUDA_BF16_SLACK - 1) /
                                      NL_CUDA_BF16_SLACK * NL_CUDA_BF16_SLACK;
    const float *bx =
        g->tb ? g->B + (size_t)pc->n0 * g->ldb + pc->k0 : g->B + (size_t)pc->k0 * g->ldb + pc->n0;
    int lb = 0;
    const uint16_t *bp = bf16_piece(c, g->bw, g->B, bx, g->tb ? pc->n : pc->k,
                                    g->tb ? pc->k : pc->n, g->ldb, c->conv + a_used, &lb);
    lt_gemm(c, g->ta, g->tb, pc->m, pc->n, pc->k, g->alpha, g->ap, g->la, bp, lb,
            pc->first_k ? g->beta : 1.0f, g->C + (size_t)pc->m0 * g->ldc + pc->n0, g->ldc);
}

void gemm_bf16(cuda_ctx *c, int ta, int tb, int M, int N, int K, float alpha, const float *A,
               int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    int rc = 0;
    bf16_call g = {c, ta, tb, lda, ldb, ldc, alpha, beta, A, B, C, NULL, NULL, NULL, 0};
    g.aw = nl_cuda_bf16_weight_operand(&c->w, c->stream, A, ta ? K : M, ta ? M : K, lda, &rc);
    launched(c, "gemm (bf16): weight copy", rc);
    g.bw = nl_cuda_bf16_weight_operand(&c->w, c->stream, B, tb ? N : K, tb ? K : N, ldb, &rc);
    launched(c, "gemm (bf16): weight copy", rc);
    int mc, nc, kc;
    nl_bf16_chunks(M, N, K, !g.aw, !g.bw, NL_CUDA_BF16_CONV_ELEMS - NL_CUDA_BF16_SLACK, &mc, &nc,
                   &kc);
    nl_bf16_for_pieces(M, N, K, mc, nc, kc, bf16_piece_gemm, &g);
}

/* bf16_weights: one range per call (core/model.c registers a model's
 * parameters as one); the copy is counted in mem_stats like any alloc. */
nl_status cu_bf16_weights(nl_backend *be, const float *p, size_t n, nl_error *err)
{
    cuda_ctx *c = enter_slot(be, __func__);
    nl_cuda_bf16_range *r = nl_cuda_bf16_find_base(&c->w, p);
    if (r) { /* forget (n == 0) or size again */
        be->free(be, r->copy);
        memset(r, 0, sizeof *r);
    }
    if (n == 0 || !p)
        return NL_OK;
    r = nl_cuda_bf16_free_entry(&c->w);
    if (!r)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: bf16 weights: more than %d weight ranges",
                            c->name, NL_CUDA_BF16_RANGES);
    uint16_t *copy = (uint16_t *)be->alloc(be, n * sizeof *copy);
    if (!copy)
        return nl_error_set(err, NL_ERR_NOMEM,
                            "%s: bf16 weights: cannot allocate a copy of %zu weights (%.1f MiB)",
                            c->name, n, (double)(n * sizeof *copy) / (1 << 20));
    *r = (nl_cuda_bf16_range){p, n, copy, 1};
    return NL_OK;
}

void cu_wrote(nl_backend *be, const void *p, size_t bytes)
{
    cuda_ctx *c = ctx_of(be);
    if (c->bf16)
        nl_cuda_bf16_mark(&c->w, p, bytes);
}

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
    if (nl_cudnn_attention_forward(c->cudnn, out, lse, q, q_stride, k, v, kv_stride, s, NULL))
        return;
    launched(c, "attention_forward",
             nl_cuda_attention_forward(c->stream, out, lse, q, q_stride, k, v, kv_stride, s));
}

void cu_rope_scaled_forward(nl_backend *be, float *x, const int32_t *pos, int N, int row,
                            int col0, int heads, int hd, float base, nl_rope_scaling sc)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (sc.type != NL_ROPE_YARN) /* as the CPU: no scaling is plain RoPE */
        launched(c, "rope_forward",
                 nl_cuda_rope_forward(c->stream, x, pos, N, row, col0, heads, hd, base));
    else
        launched_shape(c,
                       nl_cuda_rope_yarn_forward(c->stream, x, pos, N, row, col0, heads, hd, base,
                                                 sc),
                       "rope_scaled_forward (N %d hd %d factor %g L0 %d)", N, hd, sc.factor,
                       sc.original_max_seq_len);
}

void cu_attention_masked_forward(nl_backend *be, float *out, float *lse, const float *q,
                                 int q_stride, const float *k, const float *v, int kv_stride,
                                 nl_attn_shape s, nl_attn_mask mask)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (nl_cudnn_attention_forward(c->cudnn, out, lse, q, q_stride, k, v, kv_stride, s, &mask))
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

void cu_moe_combine(nl_backend *be, float *x, const float *y, const int32_t *slot, const float *w,
                    int N, int k, int C)
{
    cuda_ctx *c = enter_slot(be, __func__);
    launched(c, "moe_combine", nl_cuda_moe_combine(c->stream, x, y, slot, w, N, k, C));
}

/* ---------------------------------------------------------------- routing */

void cu_moe_route(nl_backend *be, int32_t *choice, float *w, int32_t *offsets, int32_t *perm,
                  int32_t *slot, const float *probs, int N, int E, int k)
{
    cuda_ctx *c = enter_slot(be, __func__);
    c->off_ptr = NULL;
    launched_shape(c, nl_cuda_moe_route(c->stream, choice, w, offsets, perm, slot, probs, N, E, k),
                   "moe_route (N %d E %d k %d)", N, E, k);
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

/* The forward's bf16 grouped GEMMs of many rows (prefill, training's
 * forward: trans_b, the weights as stored) run as one cuBLASLt GEMM per
 * expert, sized by the offsets read to the host once per routing (one wait
 * per layer's dispatch, shared by its two calls): on an H100 this took
 * bench-large's forward at T 1024 from 241K to 647K tokens/s (issue 28).
 * Fewer rows (decode) keep the one-launch tensor-core kernel: no host wait
 * per token. So does the backward (dgrad and wgrad): per expert through
 * cuBLASLt it made training at T 256 slower on the same GPU (22K against
 * 49K tokens/s; not yet profiled). Training as a whole measured slower
 * with the forward per expert too (42K against 68K tokens/s at T 1024,
 * other runs): NL_CUDA_EXPERTS=kernel keeps the one-launch kernel for every
 * call, the faster choice for training until a profile says why. */
#define NL_CUDA_GROUPED_HOST_ROWS 64

/* The offsets at dev on the host (checked: 0 first, never decreasing,
 * each group at most max_rows), or NULL after a failure (sticky). */
const int32_t *host_offsets(nl_backend *be, cuda_ctx *c, const int32_t *dev, int groups,
                            int max_rows)
{
    if (groups < 1 || groups > NL_BACKEND_MAX_EXPERTS) {
        fail(c, NL_ERR_INTERNAL, "%s: grouped gemm: %d groups", c->name, groups);
        return NULL;
    }
    if (c->off_ptr != dev || c->off_groups != groups) {
        cu_download(be, c->off_host, dev, (size_t)(groups + 1) * sizeof(int32_t));
        if (c->sticky != NL_OK)
            return NULL;
        c->off_ptr = dev;
        c->off_groups = groups;
    }
    const int32_t *o = c->off_host;
    for (int g = 0; g < groups; g++)
        if (o[0] != 0 || o[g + 1] < o[g] || o[g + 1] - o[g] > max_rows) {
            c->off_ptr = NULL;
            fail(c, NL_ERR_INTERNAL, "%s: grouped gemm: group %d has rows %d..%d (at most %d)",
                 c->name, g, o[g], o[g + 1], max_rows);
            return NULL;
        }
    return o;
}

void cu_gemm_grouped(nl_backend *be, int trans_b, int N, int K, const float *A, int lda,
                     const float *B, int ldb, size_t b_stride, float *C, int ldc,
                     const int32_t *offsets, int groups, int max_rows)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (c->bf16 && trans_b && max_rows >= NL_CUDA_GROUPED_HOST_ROWS && !c->experts_kernel) {
        const int32_t *o = host_offsets(be, c, offsets, groups, max_rows);
        for (int g = 0; o && g < groups; g++)
            if (o[g + 1] > o[g])
                cu_gemm(be, 0, trans_b, o[g + 1] - o[g], N, K, 1.0f, A + (size_t)o[g] * lda, lda,
                        B + g * b_stride, ldb, 0.0f, C + (size_t)o[g] * ldc, ldc);
        return;
    }
    if (c->bf16 && groups <= NL_CUDA_MAX_GROUPS) { /* tensor cores, one launch */
        launched_shape(c,
                       nl_cuda_gemm_grouped_bf16(c->stream, trans_b, N, K, A, lda, B, ldb, b_stride,
                                                 C, ldc, offsets, groups, max_rows, c->tile_start),
                       "gemm_grouped (bf16) (N %d K %d groups %d max_rows %d)", N, K, groups,
                       max_rows);
        return;
    }
    launched_shape(c,
                   nl_cuda_gemm_grouped(c->stream, trans_b, N, K, A, lda, B, ldb, b_stride, C, ldc,
                                        offsets, groups, max_rows),
                   "gemm_grouped (N %d K %d groups %d max_rows %d)", N, K, groups, max_rows);
}

void cu_gemm_grouped_wgrad(nl_backend *be, int M, int N, const float *A, int lda, const float *B,
                           int ldb, float *C, int ldc, size_t c_stride, const int32_t *offsets,
                           int groups)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (c->bf16) {
        launched_shape(c,
                       nl_cuda_gemm_grouped_wgrad_bf16(c->stream, M, N, A, lda, B, ldb, C, ldc,
                                                       c_stride, offsets, groups),
                       "gemm_grouped_wgrad (bf16) (M %d N %d groups %d)", M, N, groups);
        return;
    }
    launched_shape(c,
                   nl_cuda_gemm_grouped_wgrad(c->stream, M, N, A, lda, B, ldb, C, ldc, c_stride,
                                              offsets, groups),
                   "gemm_grouped_wgrad (M %d N %d groups %d)", M, N, groups);
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
                                  const float *v, int kv_stride, const float *out,
                                  const float *lse, nl_attn_shape s, nl_attn_mask mask)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (nl_cudnn_attention_backward(c->cudnn, dq, dk, dv, dout, q, q_stride, k, v, kv_stride, out,
                                    lse, s, &mask))
        return;
    const size_t need = nl_cuda_attention_backward_scratch(s);
    float *scratch = need > 0 && need <= c->scratch_bytes ? (float *)c->scratch : NULL;
    launched_shape(c,
                   nl_cuda_attention_masked_backward(c->stream, dq, dk, dv, dout, q, q_stride, k,
                                                     v, kv_stride, out, lse, scratch, s, mask),
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

/* ---------------------------------------------------------------- create, destroy */

void cu_destroy(nl_backend *be)
{
    cuda_ctx *c = ctx_of(be);
    if (c) {
        cudaSetDevice(c->device);
        if (c->stream)
            cudaStreamSynchronize(c->stream);
        if (c->profile && c->stream) {
            prof_mark(c, NULL);
            prof_report(c);
        }
        nl_cudnn_destroy(&c->cudnn);
        /* what the caller did not free goes with the backend */
        for (size_t i = 0; i < c->table.cap; i++)
            if (c->table.keys[i])
                cudaFree((void *)c->table.keys[i]);
        for (int i = 0; i < NL_CUDA_LT_CACHE; i++)
            lt_entry_free(&c->lt_cache[i]);
        if (c->lt)
            cublasLtDestroy(c->lt);
        if (c->cublas)
            cublasDestroy(c->cublas);
        if (c->workspace)
            cudaFree(c->workspace);
        if (c->scratch)
            cudaFree(c->scratch);
        if (c->conv)
            cudaFree(c->conv);
        if (c->tile_start)
            cudaFree(c->tile_start);
        if (c->stage) {
            for (int i = 0; i < NL_CUDA_STAGE_SLOTS; i++)
                cudaEventDestroy(c->stage_done[i]);
            cudaFreeHost(c->stage);
        }
        if (c->stream)
            cudaStreamDestroy(c->stream);
        cudaGetLastError(); /* leave no error for another backend's next check */
        free(c->table.keys);
        free(c->table.sizes);
        if (c->lock_ready)
            pthread_mutex_destroy(&c->lock);
        free(c);
    }
    free(be);
}

/* bf16 compute: cuBLASLt, the activation scratch and the tile map, made
 * with the rest of the runtime (so runtime_bytes counts them). WMMA bf16
 * needs compute capability 8.0. */
nl_status setup_bf16(cuda_ctx *c, int major, nl_error *err)
{
    if (major < 8)
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "%s: bf16 compute needs compute capability 8.0 (Ampere) or newer, this "
                            "device has %d.x; use --precision fp32",
                            c->name, major);
    const cublasStatus_t s = cublasLtCreate(&c->lt);
    if (s != CUBLAS_STATUS_SUCCESS) {
        c->lt = NULL;
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: cuBLASLt: cublasLtCreate: %s", c->name,
                            cublasGetStatusString(s));
    }
    cudaError_t e = cudaMalloc(&c->conv, NL_CUDA_BF16_CONV_ELEMS * sizeof(uint16_t));
    if (e == cudaSuccess)
        e = cudaMalloc(&c->tile_start, (NL_CUDA_MAX_GROUPS + 1) * sizeof(int32_t));
    if (e != cudaSuccess) {
        cudaGetLastError();
        return nl_error_set(err, NL_ERR_NOMEM, "%s: bf16 scratch (%zu MiB): %s", c->name,
                            (NL_CUDA_BF16_CONV_ELEMS * sizeof(uint16_t)) >> 20,
                            cudaGetErrorString(e));
    }
    c->bf16 = 1;
    return NL_OK;
}

/* The context, the stream, cuBLAS and its workspace, the reduction
 * scratch, and for bf16 cuBLASLt and its scratch; *runtime gets the device
 * memory they took after the context existed. */
nl_status setup(cuda_ctx *c, const nl_backend_opts *o, size_t *runtime, nl_error *err)
{
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess)
        e = cudaFree(0); /* creates the primary context now */
    if (e != cudaSuccess) {
        cudaGetLastError();
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: cannot create a CUDA context: %s (%s)",
                            c->name, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    size_t free0 = 0, free1 = 0, total = 0;
    e = cudaMemGetInfo(&free0, &total);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        c->stream = NULL;
        cudaGetLastError();
        return nl_error_set(err, NL_ERR_INTERNAL, "%s: stream: %s", c->name, cudaGetErrorString(e));
    }
    cublasStatus_t s = cublasCreate(&c->cublas);
    if (s != CUBLAS_STATUS_SUCCESS) {
        c->cublas = NULL;
        cudaGetLastError();
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: cuBLAS: cublasCreate: %s", c->name,
                            cublasGetStatusString(s));
    }
    /* cuBLAS's advice: 32 MiB of workspace on Hopper, 4 MiB before it */
    int major = 0;
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->device);
    if (e != cudaSuccess)
        cudaGetLastError(); /* the smaller workspace then; leave no error behind */
    c->workspace_bytes = (size_t)(e == cudaSuccess && major >= 9 ? 32 : 4) << 20;
    e = cudaMalloc(&c->workspace, c->workspace_bytes);
    if (e != cudaSuccess) {
        c->workspace = NULL;
        cudaGetLastError();
        return nl_error_set(err, NL_ERR_NOMEM, "%s: cuBLAS workspace (%zu MiB): %s", c->name,
                            c->workspace_bytes >> 20, cudaGetErrorString(e));
    }
    /* the stream first: cublasSetStream resets the workspace */
    s = cublasSetStream(c->cublas, c->stream);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasSetWorkspace(c->cublas, c->workspace, c->workspace_bytes);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasSetMathMode(c->cublas,
                              o->tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH);
    if (s != CUBLAS_STATUS_SUCCESS)
        return nl_error_set(err, NL_ERR_INTERNAL, "%s: cuBLAS setup: %s", c->name,
                            cublasGetStatusString(s));
    if (o->bf16) {
        const nl_status st = setup_bf16(c, major, err); /* 0 when unknown */
        if (st != NL_OK)
            return st;
    }
    c->scratch_bytes = NL_CUDA_BWD_SCRATCH_BYTES;
    e = cudaMalloc(&c->scratch, c->scratch_bytes);
    if (e != cudaSuccess) {
        c->scratch = NULL;
        cudaGetLastError();
        return nl_error_set(err, NL_ERR_NOMEM, "%s: reduction scratch (%zu MiB): %s", c->name,
                            c->scratch_bytes >> 20, cudaGetErrorString(e));
    }
    /* the staging ring is host memory: without it uploads wait instead */
    if (cudaHostAlloc((void **)&c->stage, (size_t)NL_CUDA_STAGE_SLOTS * NL_CUDA_STAGE_SLOT,
                      cudaHostAllocDefault) == cudaSuccess) {
        int made = 0;
        while (made < NL_CUDA_STAGE_SLOTS &&
               cudaEventCreateWithFlags(&c->stage_done[made], cudaEventDisableTiming) == cudaSuccess)
            made++;
        if (made < NL_CUDA_STAGE_SLOTS) {
            while (made > 0)
                cudaEventDestroy(c->stage_done[--made]);
            cudaFreeHost(c->stage);
            c->stage = NULL;
        }
    } else {
        c->stage = NULL;
    }
    cudaGetLastError();
    e = cudaDeviceSynchronize();
    if (e == cudaSuccess)
        e = cudaMemGetInfo(&free1, &total);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return nl_error_set(err, NL_ERR_INTERNAL, "%s: setup: %s", c->name, cudaGetErrorString(e));
    }
    *runtime = free0 > free1 ? free0 - free1 : 0;
    return NL_OK;
}

void fill_table(nl_backend *be)
{
    be->host_memory = 0;
    be->can_train = 1;
    be->gemm_probe = 2048;
    be->alloc = cu_alloc;
    be->free = cu_free;
    be->upload = cu_upload;
    be->download = cu_download;
    be->sync = cu_sync;
    be->check = cu_check;
    be->mem_info = cu_mem_info;
    be->zero = cu_zero;
    be->mem_stats = cu_mem_stats;
    be->gemm = cu_gemm;
    be->bf16 = ctx_of(be)->bf16;
    be->bf16_weights = be->bf16 ? cu_bf16_weights : NULL;
    be->wrote = be->bf16 ? cu_wrote : NULL;
    be->embedding_forward = cu_embedding_forward;
    be->rmsnorm_forward = cu_rmsnorm_forward;
    be->rope_forward = cu_rope_forward;
    be->rope_scaled_forward = cu_rope_scaled_forward;
    be->attention_forward = cu_attention_forward;
    be->attention_masked_forward = cu_attention_masked_forward;
    be->softmax_forward = cu_softmax_forward;
    be->swiglu_forward = cu_swiglu_forward;
    be->geglu_forward = cu_geglu_forward;
    be->gather_rows = cu_gather_rows;
    be->copy_rows = cu_copy_rows;
    be->moe_combine = cu_moe_combine;
    be->moe_route = cu_moe_route;
    be->moe_aux = cu_moe_aux;
    be->moe_router_backward = cu_moe_router_backward;
    be->gemm_grouped = cu_gemm_grouped;
    be->gemm_grouped_wgrad = cu_gemm_grouped_wgrad;
    be->embedding_backward = cu_embedding_backward;
    be->rmsnorm_backward = cu_rmsnorm_backward;
    be->attention_backward = cu_attention_backward;
    be->attention_masked_backward = cu_attention_masked_backward;
    be->swiglu_backward = cu_swiglu_backward;
    be->geglu_backward = cu_geglu_backward;
    be->moe_combine_backward = cu_moe_combine_backward;
    be->cross_entropy = cu_cross_entropy;
    be->sumsq = cu_sumsq;
    be->adamw = cu_adamw;
}

} // namespace

/* ---------------------------------------------------------------- inside the module */

bool nl_cuda_backend_queue(nl_backend *be, int *device, cudaStream_t *stream)
{
    if (!be || be->destroy != cu_destroy)
        return false;
    const cuda_ctx *c = ctx_of(be);
    *device = c->device;
    *stream = c->stream;
    return true;
}

/* ---------------------------------------------------------------- entry points */

NL_EXPORT int nl_cuda_module_abi(void)
{
    return NL_BACKEND_ABI;
}

NL_EXPORT nl_status nl_cuda_backend_new(nl_backend **out, int device, const nl_backend_opts *o,
                                        nl_error *err)
{
    *out = NULL;
    const nl_backend_opts def = {0, 0, 0};
    if (!o)
        o = &def;
    char name[24];
    snprintf(name, sizeof name, "cuda:%d", device);
    /* test the error, not the count: without a driver the count is untouched */
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: no CUDA device: %s (%s)", name,
                            cudaGetErrorString(e), cudaGetErrorName(e));
    }
    if (device < 0 || device >= count)
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: no such device (%d device%s)", name,
                            count, count == 1 ? "" : "s");
    nl_backend *be = (nl_backend *)calloc(1, sizeof *be);
    cuda_ctx *c = (cuda_ctx *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", name);
    }
    c->device = device;
    memcpy(c->name, name, sizeof name);
    be->ctx = c;
    be->name = c->name;
    be->destroy = cu_destroy;
    if (pthread_mutex_init(&c->lock, NULL) != 0) {
        cu_destroy(be);
        return nl_error_set(err, NL_ERR_NOMEM, "%s: cannot create a mutex", name);
    }
    c->lock_ready = true;
    size_t runtime = 0;
    const nl_status st = setup(c, o, &runtime, err);
    if (st != NL_OK) {
        cu_destroy(be);
        return st;
    }
    be->runtime_bytes = runtime;
    const char *ex = getenv("NL_CUDA_EXPERTS");
    c->experts_kernel = ex && strcmp(ex, "kernel") == 0;
    const char *pr = getenv("NL_CUDA_PROFILE");
    c->profile = pr && strcmp(pr, "1") == 0;
    c->cudnn = nl_cudnn_new(device, c->stream, c->bf16); /* NULL: off or unavailable */
    fill_table(be);
    *out = be;
    return NL_OK;
}
