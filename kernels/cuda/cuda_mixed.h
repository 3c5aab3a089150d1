/* Private to kernels/cuda: bf16 compute on CUDA (be->bf16). The table of
 * weight ranges with bf16 copies and their dirty flags (host code), the
 * conversion and AdamW kernels that make and keep the copies, and the tile
 * map of the grouped expert GEMMs, all in cuda_mixed.cu, which the CPU
 * emulation (tests/cuda_emu) runs; the bf16 grouped GEMM kernels, which use
 * the tensor cores, in cuda_grouped_bf16.cu. The dense GEMM's cuBLASLt call
 * is in cuda_backend.cu, its pure parameter choice in cuda_gemm_plan.h.
 *
 * Launchers queue on `stream` (a cudaStream_t), allocate nothing, and
 * return the cudaError_t of their last launch as an int (0 on success;
 * cudaErrorInvalidValue, nothing launched, for a shape they refuse). This
 * header includes no CUDA header. */
#ifndef NL_CUDA_MIXED_H
#define NL_CUDA_MIXED_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- weight ranges
 *
 * One entry per bf16_weights call: the FP32 range [base, base + n) and its
 * bf16 copy (device memory the backend allocated), stale when the copy no
 * longer matches the floats. Slots that write floats (upload, zero, wrote)
 * mark every range they touch stale; the next GEMM that reads a stale
 * range converts the whole range first (one kernel). AdamW writes the copy
 * itself in the same kernel as the floats when the parameters lie inside a
 * range that is not stale (nl_cuda_bf16_adamw_copy), so an optimizer step
 * needs no conversion pass; otherwise it marks the range stale. */
#define NL_CUDA_BF16_RANGES 64

typedef struct nl_cuda_bf16_range {
    const float *base; /* NULL: a free entry */
    size_t n;          /* floats */
    uint16_t *copy;    /* n bf16 values */
    int stale;         /* 1: copy must be made again before it is read */
} nl_cuda_bf16_range;

/* A captured step (CUDA graph) reads the copies as they are when it is
 * replayed, not when it was recorded: the backend makes every stale copy
 * again before it begins a capture and before each replay
 * (nl_cuda_bf16_refresh), so a write in place between replays (a load, an
 * upload; AdamW keeps a fresh copy fresh itself) is read by the next one.
 * `capturing` is set meanwhile: a read of a stale range then converts
 * nothing (a conversion recorded would run at every replay, and the copy
 * would be marked fresh by work that has not run) and sets
 * `stale_in_capture` instead, which makes the capture fail. `epoch` counts
 * the entries made and forgotten (the backend's bf16_weights): a recording
 * made at another epoch may read a copy that no longer exists, and is not
 * replayed. */
typedef struct nl_cuda_bf16_table {
    nl_cuda_bf16_range r[NL_CUDA_BF16_RANGES];
    int capturing;
    int stale_in_capture;
    unsigned long epoch;
} nl_cuda_bf16_table;

/* The entry whose base is p, or NULL. */
nl_cuda_bf16_range *nl_cuda_bf16_find_base(nl_cuda_bf16_table *t, const float *p);
/* A free entry, or NULL when all NL_CUDA_BF16_RANGES are taken. */
nl_cuda_bf16_range *nl_cuda_bf16_free_entry(nl_cuda_bf16_table *t);
/* The entry that holds all of [p, p + bytes), or NULL. */
nl_cuda_bf16_range *nl_cuda_bf16_inside(nl_cuda_bf16_table *t, const void *p, size_t bytes);
/* Mark stale every entry that overlaps [p, p + bytes) (a write). */
void nl_cuda_bf16_mark(nl_cuda_bf16_table *t, const void *p, size_t bytes);
/* Where AdamW over the n floats at p writes their bf16 values: the copy's
 * part when a fresh entry holds all of them; else NULL, after marking
 * every entry the floats overlap stale (made again on the next GEMM). */
uint16_t *nl_cuda_bf16_adamw_copy(nl_cuda_bf16_table *t, float *p, size_t n);
/* The bf16 form of an operand of `rows` rows of `cols` floats with row
 * stride ld at x, when a range holds it: its place in the copy (same
 * stride), after queueing the range's conversion when it was stale (then
 * no longer; while capturing, nothing is queued and stale_in_capture is
 * set). NULL when no range holds it. *rc gets the launch result. */
const uint16_t *nl_cuda_bf16_weight_operand(nl_cuda_bf16_table *t, void *stream, const float *x,
                                            int rows, int cols, int ld, int *rc);
/* Queue the conversion of every stale range (then no longer stale); the
 * launch result of the first that failed (that range stays stale), else
 * 0. Not while capturing (cudaErrorStreamCaptureUnsupported, nothing
 * queued). */
int nl_cuda_bf16_refresh(nl_cuda_bf16_table *t, void *stream);

/* ---------------------------------------------------------------- kernels */

/* dst[i] = nl_elem_to_bf16(src[i]) for i < n (round to nearest even; NaN
 * stays NaN, inf stays inf). */
int nl_cuda_to_bf16(void *stream, uint16_t *dst, const float *src, size_t n);
/* dst[r * ld_dst + c] = bf16(src[r * ld_src + c]) for r < rows, c < cols. */
int nl_cuda_to_bf16_rows(void *stream, uint16_t *dst, int ld_dst, const float *src, int ld_src,
                         int rows, int cols);
/* The adamw slot (nl_elem_adamw per element, the FP32 path's bits), and,
 * when copy is not NULL, copy[i] = bf16 of the updated p[i]. */
int nl_cuda_adamw_bf16(void *stream, float *p, uint16_t *copy, const float *g, float *m, float *v,
                       size_t n, float lr, float b1, float b2, float eps, float wd, float bc1,
                       float bc2, float grad_scale);

/* ---------------------------------------------------------------- grouped GEMM tile map
 *
 * The bf16 grouped GEMM (gemm_grouped) covers only the row tiles that
 * exist: group g has n_g = offsets[g + 1] - offsets[g] rows, hence
 * ceil(n_g / tile_rows) row tiles, and tile_start (groups + 1 ints, device)
 * numbers them consecutively: tile_start[0] = 0, tile_start[g + 1] =
 * tile_start[g] + ceil(n_g / tile_rows) (0 for an empty or, defensively,
 * a negative count). One block of the map kernel computes it from the
 * device offsets, so the host never needs the counts; a GEMM block with
 * row-tile number t finds its group by binary search
 * (nl_cuda_tile_lookup, cuda_mixed.cuh) and exits when t >=
 * tile_start[groups]. */
int nl_cuda_tile_map(void *stream, int32_t *tile_start, const int32_t *offsets, int groups,
                     int tile_rows);

/* Most row tiles a grouped GEMM of `groups` groups of at most max_rows
 * rows each, total rows at most total_rows (< 0: unknown), can have: the
 * grid's row dimension. */
long nl_cuda_tile_bound(int groups, int max_rows, long total_rows, int tile_rows);

/* ---------------------------------------------------------------- grouped GEMM (tensor cores)
 *
 * cuda_grouped_bf16.cu: the gemm_grouped and gemm_grouped_wgrad slots with
 * bf16 operands (each FP32 element rounded to nearest even as it is
 * loaded) and FP32 accumulation, on the tensor cores (WMMA 16x16x16).
 * tile_start: scratch of groups + 1 ints for the map (device). */
int nl_cuda_gemm_grouped_bf16(void *stream, int trans_b, int N, int K, const float *A, int lda,
                              const float *B, int ldb, size_t b_stride, float *C, int ldc,
                              const int32_t *offsets, int groups, int max_rows,
                              int32_t *tile_start);
int nl_cuda_gemm_grouped_wgrad_bf16(void *stream, int M, int N, const float *A, int lda,
                                    const float *B, int ldb, float *C, int ldc, size_t c_stride,
                                    const int32_t *offsets, int groups);

#ifdef __cplusplus
}
#endif

#endif
