/* What the CUDA module tells cuDNN's MoE grouped matmul (the frontend's
 * Graph::moe_grouped_matmul, mode NONE) for one bf16 gemm_grouped call, as
 * a pure function of the slot's arguments: the dims, strides and uids of
 * Token, Weight, FirstTokenOffset and Output, and the decision to leave the
 * call to the module's own kernels.
 *
 * Header-only C (static inline), with no CUDA header: cuda_cudnn_moe.cpp
 * builds its graphs from it, cuda_gemm.cu asks it before converting any
 * operand, and tests/test_cudnn_moe_desc.c computes a grouped product by
 * indexing through exactly these dims and strides and the offsets, and
 * checks it against the CPU backend's gemm_grouped on machines without a
 * GPU.
 *
 * The slot (backend.h gemm_grouped): group g has the rows r0 = offsets[g]
 * .. offsets[g + 1] - 1 and C[r0 + i, :N] = A[r0 + i, :K] op(B_g) with
 * B_g = B + g * b_stride, (N, K) with trans_b, else (K, N), row strides
 * lda, ldb, ldc; offsets (groups + 1 int32 on the device) start at 0 and
 * end at the total row count T.
 *
 * cuDNN's op (mode NONE: the tokens already grouped by expert):
 *   Output[0, r, n] = sum_k Token[0, r, k] Weight[e(r), k, n]
 *   Token (1, T, K), Weight (E, K, N), Output (1, T, N), FirstTokenOffset
 *   (E, 1, 1) int32: expert e owns the rows FirstTokenOffset[e] .. the next
 *   expert's first row - 1, the last expert up to T - 1.
 * So E = groups, FirstTokenOffset is the slot's offsets array itself (its
 * first `groups` entries, on the device: no host copy), and T is its last
 * entry, which the host must know to size Token and Output: the CUDA
 * backend knows it from the moe_route call that wrote the offsets (N k
 * rows), and passes a negative total where it does not (then the call
 * falls back). Weight[e, k, n] is B_g[n, k] (trans_b: strides (b_stride,
 * 1, ldb), the frontend's documented column-major layout, the forward's
 * x W^T) or B_g[k, n] (strides (b_stride, ldb, 1): the backward's dgrad
 * dY W over the weights as stored; whether cuDNN builds a graph for this
 * row-major weight is its call, and a refusal falls back).
 *
 * Token and Weight are bf16 (the activations converted, the weights from
 * the backend's bf16 copy); Output is FP32 (written straight into C, row
 * stride ldc) or bf16 (row stride ldc as described, converted into C
 * after), as out_bytes says. Non-unit strides must be 16-byte multiples
 * (the alignment cuDNN's kernels load with): others are not given. */
#ifndef NL_CUDNN_MOE_DESC_H
#define NL_CUDNN_MOE_DESC_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* the tensors of a graph, in the order of their cuDNN uids (1 + index) */
enum { NL_MOE_TOKEN = 0, NL_MOE_WEIGHT, NL_MOE_OFFSET, NL_MOE_OUT, NL_MOE_NTENSORS };

/* bytes of a bf16 element, and the alignment of every non-unit stride */
#define NL_MOE_BF16_BYTES 2
#define NL_MOE_ALIGN_BYTES 16

typedef struct nl_moe_desc {
    /* NULL: cuDNN can be given this call; else why the module's kernels run it */
    const char *fallback;
    int64_t experts, rows, k, n; /* E, T, K, N */
    int out_bytes;               /* 4: FP32 Output, 2: bf16 */
    int64_t uid[NL_MOE_NTENSORS];
    int64_t dim[NL_MOE_NTENSORS][3];
    int64_t stride[NL_MOE_NTENSORS][3];
} nl_moe_desc;

/* 1 when `stride` elements of `bytes` bytes each are a 16-byte multiple */
static inline int nl_moe_aligned(int64_t stride, int bytes)
{
    return (stride * bytes) % NL_MOE_ALIGN_BYTES == 0;
}

/* Why the slot's arguments cannot be given to cuDNN, or NULL. */
static inline const char *nl_moe_refusal(int trans_b, int N, int K, int lda, int ldb,
                                         size_t b_stride, int ldc, int groups, int offsets_len,
                                         int64_t total_rows, int out_bytes)
{
    if (total_rows < 0)
        return "the total row count is not known on the host";
    if (total_rows == 0)
        return "no rows";
    if (total_rows > INT32_MAX)
        return "more rows than int32 offsets hold";
    if (groups < 1)
        return "no experts";
    if (offsets_len != groups + 1)
        return "the offsets are not one per expert plus the total";
    if (N < 1 || K < 1)
        return "an empty product";
    if (out_bytes != 4 && out_bytes != NL_MOE_BF16_BYTES)
        return "an output neither FP32 nor bf16";
    if (lda < K || ldc < N || ldb < (trans_b ? K : N))
        return "a row stride shorter than its row";
    if (b_stride > (size_t)INT64_MAX / NL_MOE_BF16_BYTES)
        return "an expert stride too large";
    if (!nl_moe_aligned(lda, NL_MOE_BF16_BYTES) || !nl_moe_aligned(ldb, NL_MOE_BF16_BYTES) ||
        !nl_moe_aligned(ldc, out_bytes) ||
        (groups > 1 && !nl_moe_aligned((int64_t)b_stride, NL_MOE_BF16_BYTES)))
        return "a stride not a multiple of 16 bytes";
    return NULL;
}

static inline void nl_moe_set(nl_moe_desc *d, int which, int64_t d0, int64_t d1, int64_t d2,
                              int64_t s0, int64_t s1, int64_t s2)
{
    d->uid[which] = 1 + which;
    d->dim[which][0] = d0;
    d->dim[which][1] = d1;
    d->dim[which][2] = d2;
    d->stride[which][0] = s0;
    d->stride[which][1] = s1;
    d->stride[which][2] = s2;
}

/* Describe one call (arguments as gemm_grouped's, lda and ldc those of the
 * operands cuDNN reads and writes: the converted Token's, the Output's;
 * offsets_len the entries of the offsets array; total_rows its last entry
 * when known, else negative). Never fails: a call cuDNN is not given sets
 * d->fallback (the rest then describes nothing useful). */
static inline void nl_moe_describe(nl_moe_desc *d, int trans_b, int N, int K, int lda, int ldb,
                                   size_t b_stride, int ldc, int groups, int offsets_len,
                                   int64_t total_rows, int out_bytes)
{
    memset(d, 0, sizeof *d); /* C and C++ alike */
    d->fallback = nl_moe_refusal(trans_b, N, K, lda, ldb, b_stride, ldc, groups, offsets_len,
                                 total_rows, out_bytes);
    if (d->fallback)
        return;
    const int64_t E = groups, T = total_rows, bs = (int64_t)b_stride;
    d->experts = E;
    d->rows = T;
    d->k = K;
    d->n = N;
    d->out_bytes = out_bytes;
    nl_moe_set(d, NL_MOE_TOKEN, 1, T, K, T * lda, lda, 1);
    if (trans_b) /* B_g (N, K): Weight[e, k, n] = B[e bs + n ldb + k] */
        nl_moe_set(d, NL_MOE_WEIGHT, E, K, N, bs, 1, ldb);
    else /* B_g (K, N): Weight[e, k, n] = B[e bs + k ldb + n] */
        nl_moe_set(d, NL_MOE_WEIGHT, E, K, N, bs, ldb, 1);
    nl_moe_set(d, NL_MOE_OFFSET, E, 1, 1, 1, 1, 1);
    nl_moe_set(d, NL_MOE_OUT, 1, T, N, T * ldc, ldc, 1);
}

/* Offset in elements of element (i0, i1, i2) of tensor `which` */
static inline int64_t nl_moe_offset(const nl_moe_desc *d, int which, int64_t i0, int64_t i1,
                                    int64_t i2)
{
    const int64_t *st = d->stride[which];
    return i0 * st[0] + i1 * st[1] + i2 * st[2];
}

/* The expert that owns row r (0 .. T - 1) under cuDNN's rule, given the
 * FirstTokenOffset tensor's values at fto (read through its stride): the
 * last e whose first row is at or before r (an empty expert shares its
 * first row with the next and so owns none). -1 before the first. */
static inline int64_t nl_moe_expert_of(const nl_moe_desc *d, const int32_t *fto, int64_t r)
{
    int64_t owner = -1;
    for (int64_t e = 0; e < d->dim[NL_MOE_OFFSET][0]; e++)
        if (fto[nl_moe_offset(d, NL_MOE_OFFSET, e, 0, 0)] <= r)
            owner = e;
    return owner;
}

/* ---------------------------------------------------------------- total rows
 *
 * The host's record of each dispatch's total rows (offsets[groups], which
 * the description needs and which lives on the device): moe_route notes
 * N k for the offsets array it writes, and any other write over the array
 * (an upload, a zero, a free) forgets it, so a total is known only while
 * the array holds what moe_route wrote. A full table replaces its entries
 * in turn (a forgotten total only sends a call to the fallback). */
#define NL_MOE_ROUTES 256

typedef struct nl_moe_route {
    const int32_t *offsets; /* NULL: a free entry */
    int groups;             /* the array holds groups + 1 entries */
    int64_t rows;           /* its last entry */
} nl_moe_route;

typedef struct nl_moe_routes {
    nl_moe_route e[NL_MOE_ROUTES];
    int next; /* the entry replaced next when none is free */
} nl_moe_routes;

static inline void nl_moe_routes_note(nl_moe_routes *t, const int32_t *offsets, int groups,
                                      int64_t rows)
{
    nl_moe_route *slot = NULL;
    for (int i = 0; i < NL_MOE_ROUTES && !slot; i++)
        if (t->e[i].offsets == offsets)
            slot = &t->e[i];
    for (int i = 0; i < NL_MOE_ROUTES && !slot; i++)
        if (!t->e[i].offsets)
            slot = &t->e[i];
    if (!slot) {
        slot = &t->e[t->next];
        t->next = (t->next + 1) % NL_MOE_ROUTES;
    }
    slot->offsets = offsets;
    slot->groups = groups;
    slot->rows = rows;
}

/* The `bytes` bytes at p were written or freed: forget every array they touch. */
static inline void nl_moe_routes_forget(nl_moe_routes *t, const void *p, size_t bytes)
{
    const uintptr_t lo = (uintptr_t)p, hi = lo + bytes;
    for (int i = 0; i < NL_MOE_ROUTES; i++) {
        const uintptr_t o = (uintptr_t)t->e[i].offsets;
        const uintptr_t end = o + ((size_t)t->e[i].groups + 1) * sizeof(int32_t);
        if (o && o < hi && lo < end)
            memset(&t->e[i], 0, sizeof t->e[i]);
    }
}

/* offsets[groups] as noted, or -1 when not known (never noted, noted with
 * other groups, or forgotten) */
static inline int64_t nl_moe_routes_total(const nl_moe_routes *t, const int32_t *offsets,
                                          int groups)
{
    for (int i = 0; i < NL_MOE_ROUTES; i++)
        if (t->e[i].offsets == offsets && t->e[i].groups == groups)
            return t->e[i].rows;
    return -1;
}

#endif
