/* The CUDA backend's private context (C++; seen only by its sources):
 * cuda_backend.cu owns the context, its errors and profile, device memory,
 * creation and destruction; cuda_gemm.cu the GEMM slots (cuBLAS, the bf16
 * path through cuBLASLt and its descriptor cache, the grouped expert
 * GEMMs), cuda_gemm_dnn.cu their cuDNN form; cuda_slots.cu the other
 * slots, thin wrappers over the kernels' launchers. cuda_backend.cu's
 * opening comment is the backend's contract. */
#pragma once

extern "C" {
#include "kernels/backend.h"
#include "kernels/backend_impl.h"
}
#include "kernels/cuda/cuda_cudnn.h"
#include "kernels/cuda/cuda_mixed.h"
#include "kernels/cuda/cudnn_moe_desc.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

namespace nl_cu
{

/* Device pointer -> bytes, for mem_stats: open addressing with linear
 * probing, key 0 empty, at most half full, deletion by backward shift. */
struct alloc_table {
    uintptr_t *keys;
    size_t *sizes;
    size_t cap; /* a power of two, or 0 */
    size_t count;
};

/* the pinned staging ring of small uploads */
#define NL_CUDA_STAGE_SLOTS 16
#define NL_CUDA_STAGE_SLOT (64u << 10)

/* bf16: the scratch that activation operands are converted into (bf16
 * elements; 64 MiB), the cached cuBLASLt descriptors, and the most groups
 * the grouped GEMMs' tile map holds (gemm_grouped's own grid limit) */
#define NL_CUDA_BF16_CONV_ELEMS ((size_t)32 << 20)
#define NL_CUDA_LT_CACHE 256
#define NL_CUDA_MAX_GROUPS 65535

/* the fallback reasons of cuDNN's grouped GEMMs, logged once each */
#define NL_CUDA_DNN_REASONS 16

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
    /* the algorithm of a bucket of row counts (NL_CUDA_LT_BUCKET): M is
     * the bucket's, the layouts are sized to each call's M */
    bool bucket;
    uint64_t last_use; /* the least recently used entry is replaced */
};

/* host_rows' default (cuda_gemm.cu, "The bf16 grouped GEMMs of many rows") */
#define NL_CUDA_GROUPED_HOST_ROWS 256

struct cuda_ctx {
    int device;
    char name[24]; /* "cuda:N", also be->name */
    cudaStream_t stream;
    cublasHandle_t cublas;
    void *workspace; /* cuBLAS workspace */
    size_t workspace_bytes;
    void *scratch; /* reduction scratch of the backward ops */
    size_t scratch_bytes;
    unsigned char *stage;                        /* pinned, NL_CUDA_STAGE_SLOTS slots; NULL: none */
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
    uint64_t lt_clock; /* lookups so far: the entries' last_use */
    /* the cache's record for NL_CUDA_PROFILE's report: hits, misses (new
     * descriptors and cuBLASLt's heuristic), the host time of the misses,
     * and bucketed calls whose algorithm cuBLASLt refused at their M */
    uint64_t lt_hits, lt_misses, lt_refits;
    double lt_miss_s;
    /* the per-expert GEMMs take the algorithm of their row count's bucket
     * (nl_lt_bucket_rows); NL_CUDA_LT_BUCKET=0: of their exact rows */
    int lt_bucket;
    nl_cudnn *cudnn; /* attention and experts through cuDNN (cuda_cudnn.h), or NULL */
    /* the expert groups' row offsets last read to the host (bf16 grouped
     * GEMMs of many rows): valid for off_ptr until a slot that may write
     * offsets runs (upload, zero, moe_route) */
    const int32_t *off_ptr;
    int off_groups;
    int32_t off_host[NL_BACKEND_MAX_EXPERTS + 1];
    int experts_kernel; /* NL_CUDA_EXPERTS=kernel: never per expert (below) */
    int experts_lt;     /* the backward's per expert too (the default; NL_CUDA_EXPERTS=
                         * forward: the forward's only, kernel: none) */
    /* the dispatch's rows (max_rows) from which a bf16 grouped GEMM goes
     * per expert after reading the offsets on the host, or through cuDNN
     * (env NL_CUDA_GROUPED_HOST_ROWS, default the macro's; cuda_gemm.cu) */
    int host_rows;
    /* NL_CUDA_EXPERTS=cudnn: the grouped GEMMs of many rows (the forward's
     * and the backward's dgrad) through cuDNN's MoE grouped matmul
     * (cuda_gemm_dnn.cu dnn_grouped), which needs each dispatch's total
     * rows on the host: moe_route notes them per offsets array, and an
     * upload, zero or free over the array forgets them (route_note,
     * route_forget). The
     * calls cuDNN ran (dnn_bf16_out of them with a bf16 Output widened
     * after) and declined, for NL_CUDA_PROFILE; each reason logged once. */
    int experts_dnn;
    nl_moe_routes routes;
    uint64_t dnn_runs, dnn_bf16_out, dnn_declined;
    const char *dnn_said[NL_CUDA_DNN_REASONS];
    /* NL_CUDA_ROWS=cublas: gemm takes cuBLAS(Lt) at every M, not the
     * gemm_rows kernel below NL_CUDA_ROWS_GEMM rows (a decode's bits then
     * differ from a stage batch's; for comparing the two in bench_cuda) */
    int rows_off;
    /* graph_begin .. graph_end: the stream is being captured; a slot that
     * would wait for it or allocate (refused_in_capture) is dropped and
     * named here, and graph_end then fails without touching the sticky
     * error */
    bool capturing;
    const char *refused;
    /* NL_CUDA_PROFILE=1: each slot's time, the device's and the host's
     * until the next slot, measured by waiting for the stream at every
     * slot's entry (so overlap is gone: a diagnostic, not a speed); of it,
     * the wait at the next entry (the slot's device work still running)
     * apart from the host's time before it (its launch and whatever the
     * caller did next: a host-side initialisation shows there) */
    int profile;
    const char *prof_prev; /* the slot entered last */
    double prof_t;         /* when its wait for the stream ended */
    struct {
        const char *name;
        uint64_t calls;
        double s;      /* host and wait */
        double wait_s; /* of it, waiting for the stream */
        double max_s;  /* its longest call (a graph or plan built at a new shape) */
    } prof[64];
};

cuda_ctx *ctx_of(nl_backend *be);

/* Keep the first error. */
__attribute__((format(printf, 3, 4))) void fail(cuda_ctx *c, nl_status st, const char *fmt, ...);

/* Record a CUDA error of `op`; true when there was none. */
bool ok(cuda_ctx *c, const char *op, cudaError_t e);

/* After a launcher (which returns cudaGetLastError as an int). */
void launched(cuda_ctx *c, const char *op, int rc);

/* After a backward launcher: a failure names the op and its shape, and a
 * refused shape (cudaErrorInvalidValue, nothing launched) is NL_ERR_SHAPE. */
__attribute__((format(printf, 3, 4))) void launched_shape(cuda_ctx *c, int rc, const char *fmt,
                                                          ...);

/* Every slot starts here: the backend's device becomes current on the
 * calling thread; with NL_CUDA_PROFILE the previous slot's time is taken. */
cuda_ctx *enter_slot(nl_backend *be, const char *slot);

/* Monotonic seconds (NL_CUDA_PROFILE's clock). */
double prof_now(void);

/* While the stream is captured: note `slot` (the capture then fails at
 * graph_end) and return true, so the caller drops the call. */
bool refused_in_capture(cuda_ctx *c, const char *slot);

/* The kept error into err (NL_OK when none). */
nl_status report(cuda_ctx *c, nl_error *err);

/* The download slot (waits for the stream), for slots that read a few
 * values back. */
void cu_download(nl_backend *be, void *dst, const void *src, size_t bytes);

/* cuda_gemm.cu: frees one cached cuBLASLt entry (at destroy); fills the
 * table's GEMM slots (gemm, gemm_grouped, gemm_grouped_wgrad, and in bf16
 * mode bf16_weights and wrote). */
void lt_entry_free(lt_entry *e);
void fill_gemm_slots(nl_backend *be);
/* cuda_gemm_dnn.cu, NL_CUDA_EXPERTS=cudnn only (else route_* do nothing):
 * moe_route wrote `rows` rows' offsets (groups + 1 entries) at offsets;
 * the bytes at p were written (upload, zero) or freed; dnn_grouped runs a
 * bf16 gemm_grouped call through cuDNN, false (nothing queued, the reason
 * counted and logged once) when the caller's path must run it. */
void route_note(cuda_ctx *c, const int32_t *offsets, int groups, int64_t rows);
void route_forget(cuda_ctx *c, const void *p, size_t bytes);
bool dnn_grouped(cuda_ctx *c, int trans_b, int N, int K, const float *A, int lda, const float *B,
                 int ldb, size_t b_stride, float *C, int ldc, const int32_t *offsets, int groups);

/* cuda_slots.cu: fills the other compute slots. */
void fill_op_slots(nl_backend *be);

} // namespace nl_cu
