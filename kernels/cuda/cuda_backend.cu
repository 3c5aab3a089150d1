/* The CUDA backend (libnl_cuda.so, loaded by nl_backend_new for "cuda:N"):
 * the context, device memory, errors, creation and the slot table; the
 * GEMM slots are in cuda_gemm.cu, the other slots in cuda_slots.cu, all
 * three sharing the private context (cuda_backend_impl.h). The forward
 * kernels are in cuda_ops.cu and cuda_attention.cu, the backward
 * and optimizer kernels in cuda_backward.cu and cuda_attention_bwd.cu, the
 * routing and grouped expert GEMMs in cuda_moe.cu, the model variants'
 * GeGLU and YaRN RoPE in cuda_family.cu (their masked attention with the
 * attention kernels); every slot runs on the device (can_train = 1). In
 * bf16 mode the attention slots first offer the call to cuDNN's flash
 * attention (cuda_cudnn.h; NL_CUDNN_ATTN=0 turns it off, =force turns it
 * on for FP32 too) and run their own kernels when it declines; with
 * NL_CUDA_EXPERTS=cudnn the expert GEMMs of many rows do the same with
 * cuDNN's MoE grouped matmul (cuda_gemm_dnn.cu).
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
 * for their copy. So a decode step waits for the host once: its logits. Each entry point first
 * makes the backend's device current on the calling thread.
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
#include "base/log.h"
}
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_backward.h"
#include "kernels/cuda/cuda_comm.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NL_EXPORT extern "C" __attribute__((visibility("default")))

namespace nl_cu
{

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
    const double t0 = prof_now();
    cudaStreamSynchronize(c->stream);
    const double t = prof_now();
    if (c->prof_prev) {
        int i = 0;
        while (i < 63 && c->prof[i].name && c->prof[i].name != c->prof_prev)
            i++;
        c->prof[i].name = c->prof_prev;
        c->prof[i].calls++;
        c->prof[i].s += t - c->prof_t;
        c->prof[i].wait_s += t - t0;
        if (t - c->prof_t > c->prof[i].max_s)
            c->prof[i].max_s = t - c->prof_t;
    }
    c->prof_prev = slot;
    c->prof_t = t;
}

/* The profile, largest first, into the log (at destroy). */
void prof_report(cuda_ctx *c)
{
    double total = 0, wait = 0;
    int n = 0;
    for (; n < 64 && c->prof[n].name; n++) {
        total += c->prof[n].s;
        wait += c->prof[n].wait_s;
    }
    nl_log_write(NL_LOG_WARN,
                 "%s: NL_CUDA_PROFILE: %.3f s in %d slots (device and host time "
                 "from each slot's entry to the next's), %.3f s of it waiting for the device",
                 c->name, total, n, wait);
    for (int k = 0; k < n; k++) {
        int best = k;
        for (int i = k + 1; i < n; i++)
            if (c->prof[i].s > c->prof[best].s)
                best = i;
        const auto e = c->prof[best];
        c->prof[best] = c->prof[k];
        c->prof[k] = e;
        nl_log_write(
            NL_LOG_WARN,
            "%s: profile %-24s %8llu calls %9.3f ms %5.1f%% (device wait %9.3f ms %5.1f%%; "
            "longest call %.3f ms)",
            c->name, e.name, (unsigned long long)e.calls, e.s * 1e3,
            total > 0 ? 100.0 * e.s / total : 0.0, e.wait_s * 1e3,
            wait > 0 ? 100.0 * e.wait_s / wait : 0.0, e.max_s * 1e3);
    }
    /* the bf16 GEMMs' descriptor cache: a miss is host time (cuBLASLt's
     * heuristic) inside its slot's share above */
    nl_log_write(NL_LOG_WARN,
                 "%s: profile cuBLASLt cache: %llu hits, %llu misses (%.3f ms on the host), "
                 "%llu bucketed calls refused at their rows",
                 c->name, (unsigned long long)c->lt_hits, (unsigned long long)c->lt_misses,
                 c->lt_miss_s * 1e3, (unsigned long long)c->lt_refits);
    if (c->experts_dnn) /* NL_CUDA_EXPERTS=cudnn: did cuDNN run the experts? */
        nl_log_write(NL_LOG_WARN,
                     "%s: profile cuDNN experts: %llu grouped GEMMs through cuDNN (%llu with a "
                     "bf16 output), %llu declined to the module's path",
                     c->name, (unsigned long long)c->dnn_runs, (unsigned long long)c->dnn_bf16_out,
                     (unsigned long long)c->dnn_declined);
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
bool refused_in_capture(cuda_ctx *c, const char *slot)
{
    if (!c->capturing)
        return false;
    if (!c->refused)
        c->refused = slot;
    return true;
}

/* ---------------------------------------------------------------- memory */

void *cu_alloc(nl_backend *be, size_t bytes)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (refused_in_capture(c, "alloc"))
        return NULL;
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
    if (refused_in_capture(c, "free"))
        return;
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
    route_forget(c, p, bytes);
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
    if (refused_in_capture(c, "upload"))
        return;
    c->off_ptr = NULL; /* it may have written routing offsets */
    route_forget(c, dst, bytes);
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
    if (refused_in_capture(c, "download"))
        return;
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
    route_forget(c, p, bytes);
    if (c->bf16)
        nl_cuda_bf16_mark(&c->w, p, bytes);
    ok(c, "zero", cudaMemsetAsync(p, 0, bytes, c->stream));
}

nl_status cu_sync(nl_backend *be, nl_error *err)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (refused_in_capture(c, "sync"))
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: sync while a step is captured", c->name);
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
               cudaEventCreateWithFlags(&c->stage_done[made], cudaEventDisableTiming) ==
                   cudaSuccess)
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
    be->bf16 = ctx_of(be)->bf16;
    fill_gemm_slots(be);
    fill_op_slots(be);
}

} // namespace nl_cu

using namespace nl_cu;

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
    /* the expert GEMMs (cuda_gemm.cu): per expert through cuBLASLt, forward
     * and backward, bucketed, unless NL_CUDA_EXPERTS names another choice
     * (kernel, forward, cudnn) or NL_CUDA_LT_BUCKET=0 */
    const char *ex = getenv("NL_CUDA_EXPERTS");
    if (ex && strcmp(ex, "kernel") != 0 && strcmp(ex, "forward") != 0 &&
        strcmp(ex, "cublaslt") != 0 && strcmp(ex, "cudnn") != 0) {
        cu_destroy(be);
        return nl_error_set(err, NL_ERR_INVALID,
                            "%s: NL_CUDA_EXPERTS=%s: expected cublaslt (the default), forward, "
                            "kernel or cudnn",
                            name, ex);
    }
    c->experts_kernel = ex && strcmp(ex, "kernel") == 0;
    c->experts_dnn = c->bf16 && ex && strcmp(ex, "cudnn") == 0;
    c->experts_lt = !ex || strcmp(ex, "cublaslt") == 0;
    const char *hr = getenv("NL_CUDA_GROUPED_HOST_ROWS");
    char *hr_end = NULL;
    const long hrv = hr ? strtol(hr, &hr_end, 10) : NL_CUDA_GROUPED_HOST_ROWS;
    if (hr && (hr_end == hr || *hr_end || hrv < 1 || hrv > (1L << 30))) {
        cu_destroy(be);
        return nl_error_set(err, NL_ERR_INVALID,
                            "%s: NL_CUDA_GROUPED_HOST_ROWS=%.40s: expected a row count from 1 to "
                            "%ld",
                            name, hr, 1L << 30);
    }
    c->host_rows = (int)hrv;
    const char *lb = getenv("NL_CUDA_LT_BUCKET");
    c->lt_bucket = !lb || strcmp(lb, "0") != 0;
    const char *ro = getenv("NL_CUDA_ROWS");
    c->rows_off = ro && strcmp(ro, "cublas") == 0;
    const char *pr = getenv("NL_CUDA_PROFILE");
    c->profile = pr && strcmp(pr, "1") == 0;
    c->cudnn = nl_cudnn_new(device, c->stream, c->bf16, c->experts_dnn); /* NULL: off */
    fill_table(be);
    *out = be;
    return NL_OK;
}
