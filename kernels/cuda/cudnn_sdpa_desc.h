/* What the CUDA module tells cuDNN's scaled-dot-product-attention graph for
 * one attention call, as a pure function of nl_attn_shape and nl_attn_mask:
 * the dims and strides of Q, K, V, O and the statistics (the frontend's
 * BHSD-with-strides convention), the diagonal band that encodes causal,
 * bidirectional and sliding-window masks, the sequence lengths of the KV
 * cache, and the decision to fall back to the module's own kernels.
 *
 * Header-only C (static inline), with no CUDA header: cuda_cudnn.cpp builds
 * its graphs from it, cuda_cudnn_convert.cu packs the FP32 tensors with its
 * index function, and tests/test_cudnn_desc.c checks both against the CPU
 * attention's mask (nl_cpu_attn_range) on machines without a GPU.
 *
 * The bf16 tensors cuDNN reads live in a packed scratch the module owns:
 *   Q, O, dQ, dO: (B, T, H, hd)   row (b, t), head h at column h*hd
 *   K, V, dK, dV: (B, S, G, hd)   S = s_kv rows per sequence
 *   stats:        (B, H, T, 1)    FP32, exactly backend.h's lse (B, H, T)
 * cuDNN's stats are the natural-log log-sum-exp of the scaled scores per
 * (b, h, query): the `lse` of backend.h, so the forward writes them straight
 * into lse and the backward reads the forward's lse.
 *
 * The diagonal band (cuDNN's diagonal_band_mask, with shift = s_kv - s_q
 * under bottom-right alignment, else 0): query row r keeps key column c when
 *   right bound R set:  c <= r + shift + R
 *   left bound L set:   c + L - shift > r
 *   padding:            r < seq_len_q and c < seq_len_kv
 * Our masks (kernels/cpu/cpu_ops.h nl_cpu_attn_range, query at absolute
 * position i = past + r among past + T keys):
 *   causal         R = 0                       (j <= i)
 *   causal window  R = 0, L = W                (i - W < j <= i)
 *   bidir          no band
 *   bidir window   R = W / 2, L = W / 2 + 1    (abs(i - j) <= W / 2)
 * With a cache (past > 0) the queries are the last T of past + T keys:
 * bottom-right alignment, the K/V dims span kv_cap rows (so one graph serves
 * every past of a decode) and the padding mask takes seq_len_q = T and
 * seq_len_kv = past + T from two small device arrays; shift = past. */
#ifndef NL_CUDNN_SDPA_DESC_H
#define NL_CUDNN_SDPA_DESC_H

#include "kernels/backend.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define NL_SDPA_HD __host__ __device__
#else
#define NL_SDPA_HD
#endif

/* the tensors of a forward graph, in the order of their cuDNN uids (1 + index) */
enum { NL_SDPA_Q = 0, NL_SDPA_K, NL_SDPA_V, NL_SDPA_O, NL_SDPA_STATS, NL_SDPA_NTENSORS };

typedef struct nl_sdpa_desc {
    /* NULL: cuDNN can run this call; else why the module's kernels run it */
    const char *fallback;
    int64_t b, h_q, h_kv, s_q, s_kv, d; /* s_kv: rows of K/V per sequence */
    int64_t dim[NL_SDPA_NTENSORS][4];   /* (b, heads, rows, d or 1) */
    int64_t stride[NL_SDPA_NTENSORS][4];
    int has_right, has_left; /* diagonal band bounds set */
    int right_bound, left_bound;
    int bottom_right;          /* 1: bottom-right diagonal alignment */
    int padding;               /* 1: seq_len_q / seq_len_kv arrays (B int32 each) */
    int seq_len_q, seq_len_kv; /* their value for every sequence */
    float scale;               /* 1 / sqrt(hd) */
} nl_sdpa_desc;

/* Queries per call below which a call with a cache (past > 0, or a cache
 * of more rows than the call's: a short prompt read into a new session's
 * cache) is left to the module's kernels unless cuDNN is forced: a decode
 * step would convert the whole FP32 cache to bf16 for a few queries
 * (bench-large's decode went from 438 to 55 tokens/s on an H100), where
 * the module's kernel reads the cache in place; and a session's first
 * positions then get the module's bits alone as in a batch's call or a
 * recorded step (which read positions on the device, so never cuDNN). The
 * descriptor itself (nl_sdpa_describe) covers them. */
#define NL_SDPA_MIN_CACHED_T 16
static inline int nl_sdpa_worth_it(nl_attn_shape s)
{
    return (s.past == 0 && s.kv_cap == s.T) || s.T >= NL_SDPA_MIN_CACHED_T;
}

/* Head dims the cuDNN path takes; others fall back. */
static inline int nl_sdpa_head_dim_ok(int hd)
{
    return hd == 64 || hd == 128;
}

/* Describe one call: the forward (backward = 0) or the backward (1, which
 * backend.h limits to past == 0, kv_cap == T). Never fails: a shape or mask
 * cuDNN is not given sets d->fallback. `has_doc`: mask.doc != NULL. */
static inline void nl_sdpa_describe(nl_sdpa_desc *d, nl_attn_shape s, int bidir, int window,
                                    int has_doc, int backward)
{
    memset(d, 0, sizeof *d); /* C and C++ alike */
    d->fallback = NULL;
    if (s.B <= 0 || s.T <= 0 || s.H <= 0 || s.past < 0)
        d->fallback = "empty or negative shape";
    else if (s.G < 1 || s.H % s.G != 0)
        d->fallback = "H % G != 0";
    else if (!nl_sdpa_head_dim_ok(s.hd))
        d->fallback = "head dim not 64 or 128";
    else if (s.kv_cap < s.past + s.T)
        d->fallback = "kv_cap < past + T";
    else if (window < 0)
        d->fallback = "negative window";
    else if (has_doc)
        /* packed documents: cuDNN would need per-document ragged offsets
         * computed from the device's doc ids on the host each call */
        d->fallback = "packed documents";
    else if (backward && (s.past != 0 || s.kv_cap != s.T))
        d->fallback = "backward with a cache";
    d->b = s.B;
    d->h_q = s.H;
    d->h_kv = s.G > 0 ? s.G : 1;
    d->s_q = s.T;
    d->padding = s.past > 0;
    d->s_kv = d->padding ? s.kv_cap : s.T;
    d->d = s.hd;
    d->seq_len_q = s.T;
    d->seq_len_kv = s.past + s.T;
    d->bottom_right = s.past > 0;
    d->scale = s.hd > 0 ? 1.0f / sqrtf((float)s.hd) : 1.0f;
    if (!bidir) {
        d->has_right = 1;
        d->right_bound = 0;
        if (window > 0) {
            d->has_left = 1;
            d->left_bound = window;
        }
    } else if (window > 0) {
        d->has_right = 1;
        d->right_bound = window / 2;
        d->has_left = 1;
        d->left_bound = window / 2 + 1;
    }
    const int64_t B = d->b, T = d->s_q, S = d->s_kv, H = d->h_q, G = d->h_kv, D = d->d;
    const int64_t q[4] = {B, H, T, D}, qs[4] = {T * H * D, D, H * D, 1};
    const int64_t k[4] = {B, G, S, D}, ks[4] = {S * G * D, D, G * D, 1};
    const int64_t st[4] = {B, H, T, 1}, sts[4] = {H * T, T, 1, 1};
    for (int i = 0; i < 4; i++) {
        d->dim[NL_SDPA_Q][i] = d->dim[NL_SDPA_O][i] = q[i];
        d->stride[NL_SDPA_Q][i] = d->stride[NL_SDPA_O][i] = qs[i];
        d->dim[NL_SDPA_K][i] = d->dim[NL_SDPA_V][i] = k[i];
        d->stride[NL_SDPA_K][i] = d->stride[NL_SDPA_V][i] = ks[i];
        d->dim[NL_SDPA_STATS][i] = st[i];
        d->stride[NL_SDPA_STATS][i] = sts[i];
    }
}

/* 1 when query row r (0 .. s_q - 1) of a sequence may see key column c
 * (0 .. s_kv - 1) under the mask the descriptor gives cuDNN: its diagonal
 * band and padding, evaluated as the frontend's diagonal_band_mask does
 * (see the top of this file). The test's oracle twin of the graph. */
static inline int nl_sdpa_desc_sees(const nl_sdpa_desc *d, int64_t r, int64_t c)
{
    if (d->padding && (r >= d->seq_len_q || c >= d->seq_len_kv))
        return 0;
    const int64_t sq = d->padding ? d->seq_len_q : d->s_q;
    const int64_t skv = d->padding ? d->seq_len_kv : d->s_kv;
    const int64_t shift = d->bottom_right ? skv - sq : 0;
    if (d->has_right && !(r + shift + d->right_bound >= c))
        return 0;
    if (d->has_left && !(c + d->left_bound - shift > r))
        return 0;
    return 1;
}

/* Offset in elements of element (b, h, row, e) of tensor `which` in its
 * packed bf16 scratch (or, for the stats, in lse). */
static inline int64_t nl_sdpa_desc_offset(const nl_sdpa_desc *d, int which, int64_t b, int64_t h,
                                          int64_t row, int64_t e)
{
    const int64_t *st = d->stride[which];
    return b * st[0] + h * st[1] + row * st[2] + e * st[3];
}

/* The FP32 <-> bf16 packing: packed row r (of nseq * rows sequences' rows,
 * each sequence `rows` long) sits in the strided FP32 tensor at row
 * (r / rows) * cap + r % rows, each row `stride` floats apart: for Q and O
 * cap = rows = T; for a K/V cache cap = kv_cap and rows = past + T. */
NL_SDPA_HD static inline int64_t nl_sdpa_strided_row(int64_t r, int rows, int cap, int stride)
{
    return ((r / rows) * cap + r % rows) * (int64_t)stride;
}

/* How tensor `which` (NL_SDPA_Q for Q and dQ, NL_SDPA_K / NL_SDPA_V for
 * K, V, dK, dV, NL_SDPA_O for O and dO) moves between the caller's FP32
 * layout (backend.h: q rows q_stride apart, the K/V cache kv_cap rows per
 * sequence kv_stride apart, out and dout packed) and its packed bf16
 * scratch: `rows` rows of `width` elements for each of nseq sequences; the
 * packed side is (dst_cap, dst_stride), the FP32 side (src_cap,
 * src_stride), both for nl_sdpa_strided_row. Packing reads FP32 and writes
 * bf16; unpacking (O, dQ, dK, dV) the reverse, with the same numbers. */
typedef struct nl_sdpa_pack {
    int nseq, rows, width;
    int dst_cap, dst_stride; /* the packed bf16 side */
    int src_cap, src_stride; /* the caller's FP32 side */
} nl_sdpa_pack;

static inline nl_sdpa_pack nl_sdpa_pack_of(const nl_sdpa_desc *d, int which, nl_attn_shape s,
                                           int q_stride, int kv_stride)
{
    nl_sdpa_pack p;
    const int HD = s.H * s.hd, GD = s.G * s.hd;
    p.nseq = s.B;
    if (which == NL_SDPA_K || which == NL_SDPA_V) {
        p.rows = s.past + s.T;
        p.width = GD;
        p.dst_cap = (int)d->s_kv;
        p.dst_stride = GD;
        p.src_cap = s.kv_cap;
        p.src_stride = kv_stride;
    } else {
        p.rows = s.T;
        p.width = HD;
        p.dst_cap = s.T;
        p.dst_stride = HD;
        p.src_cap = s.T;
        p.src_stride = which == NL_SDPA_Q ? q_stride : HD;
    }
    return p;
}

#endif
