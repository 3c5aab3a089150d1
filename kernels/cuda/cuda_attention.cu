/* CUDA attention forward: causal grouped-query attention over a KV cache
 * with an online softmax (flash-attention style), the twin of
 * kernels/cpu/cpu_attention.c, which is its test oracle. Scores are never
 * stored whole, accumulation is fp32, and there are no atomics, so a
 * result is the same on every run.
 *
 * Two kernels, both templated on a head-dim bucket HDB (64, 128 or 256,
 * with hd <= HDB) so that a lane keeps HDB / 32 output columns in registers:
 *
 * - prefill (T > DECODE_MAX_T): one block of 4 warps per (sequence, head,
 *   tile of BQ queries). Tiles of 32 keys are staged in shared memory, the
 *   keys first and then the values in the same buffer. Each warp owns BQ / 4
 *   queries of the tile; lane j scores key j of the tile against them, and
 *   lane j keeps output columns j, j + 32, ... of each of them.
 * - decode (T <= DECODE_MAX_T, no packed documents): one block of 8 warps
 *   per (sequence, head, query), so one token over a long cache keeps 256
 *   threads per head busy. Warp w takes the 32-key chunks w, w + 8, w + 16, ...; its lanes
 *   split the head dimension (a warp reduction per score) and read K and V
 *   rows straight from global memory, coalesced. The 8 partial softmax
 *   states are merged in shared memory, in warp order, at the end.
 *
 * Both take a DESIGN section 6 mask (cuda_mask.cuh): a query walks only the
 * key tiles its range reaches (so a local layer costs O(T W)), keys of
 * another document get no weight (prefill only: packed rows have no cache,
 * and a document check in the decode kernel pushed its 256 bucket past
 * ptxas's register budget into spills), and the zeroed mask is the causal
 * one.
 *
 * The online-softmax step and merge are kernels/elem.h's, shared with the
 * CPU backend.
 *
 * Each sequence's keys and values are row b kv_cap of k and v, or, with
 * s.kseq / s.vseq, wherever its own cache lies (a batch's sessions in one
 * call); a block reads only its own sequence's, so its bits are those of
 * the sequence alone.
 *
 * Both are templated on the cache's element type KV as well: float, or the
 * bits of a bf16 cache (uint16_t, s.kv_bf16), widened to FP32 where a key
 * or value is read (kv_ld) - half the bytes a decode step reads; every sum
 * stays FP32, and the FP32 instantiations are the kernels they were. */
#include "kernels/cuda/cuda_attention.h"

#include "kernels/elem.h"

#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>

namespace
{

#include "kernels/cuda/cuda_reduce.cuh"

#include "kernels/cuda/cuda_mask.cuh"

constexpr int BK = 32;           /* keys per tile or chunk: one per lane */
constexpr int PREFILL_WARPS = 4; /* warps per prefill block */
constexpr int DECODE_WARPS = 8;  /* warps per decode block */
constexpr int DECODE_MAX_T = 4;  /* new positions up to which the decode kernel runs */
/* Decode blocks per SM the register budget of the sequences' own caches
 * must allow (at most 128 registers a thread; 0 below: ptxas's choice) */
constexpr int DECODE_SEQ_MIN_BLOCKS = 2;
/* Prefill blocks per SM the register budget must allow: caps ptxas at 128
 * registers a thread, which every bucket fits without spilling. */
constexpr int PREFILL_MIN_BLOCKS = 4;

/* Sequence b's keys and values from column col: its own cache (SEQ:
 * kseq[b], vseq[b], read here) or row b kv_cap of the shared one (values,
 * not the shape's fields by reference: a kernel parameter's address would
 * move the shape to the stack). */
template <bool SEQ, typename KV>
__device__ __forceinline__ void seq_cache(const KV *&kb, const KV *&vb, const KV *k, const KV *v,
                                          const void *const *kseq, const void *const *vseq,
                                          int kv_cap, int kv_stride, int b, size_t col)
{
    if (SEQ) {
        kb = static_cast<const KV *>(kseq[b]) + col;
        vb = static_cast<const KV *>(vseq[b]) + col;
    } else {
        const size_t kv_off = (size_t)b * kv_cap * (size_t)kv_stride + col;
        kb = k + kv_off;
        vb = v + kv_off;
    }
}

/* A key or value of the cache as FP32: a float, or bf16 bits widened. */
__device__ __forceinline__ float kv_ld(const float *p)
{
    return *p;
}
__device__ __forceinline__ float kv_ld(const uint16_t *p)
{
    return nl_elem_from_bf16(*p);
}

/* ---------------------------------------------------------------- prefill */

/* dst[j][c] = src[(j0 + j) * stride + c] for j < nk and c < hd, else 0, so
 * the kernel never reads a row past the block's last key (nor past kv_cap)
 * and the padding columns are zero. Called by every thread of the block. */
template <int HDB, typename KV>
__device__ __forceinline__ void load_tile(float (*dst)[HDB + 1], const KV *src, int stride, int j0,
                                          int nk, int hd)
{
    for (int e = threadIdx.x; e < BK * HDB; e += PREFILL_WARPS * WARP) {
        const int j = e / HDB, c = e % HDB;
        float x = 0.0f;
        if (j < nk && c < hd)
            x = kv_ld(src + (size_t)(j0 + j) * (size_t)stride + (size_t)c);
        dst[j][c] = x;
    }
}

/* The prefill tile's queries into qs, pre-scaled; columns past hd and
 * rows past nq are 0. */
template <int HDB, int BQ>
__device__ __forceinline__ void load_queries(float (*qs)[HDB], const float *q, int q_stride,
                                             const nl_attn_shape &s, int b, int h, int t0, int nq,
                                             float scale)
{
    for (int e = threadIdx.x; e < BQ * HDB; e += PREFILL_WARPS * WARP) {
        const int i = e / HDB, c = e % HDB;
        float x = 0.0f;
        if (i < nq && c < s.hd)
            x = q[((size_t)b * s.T + (size_t)(t0 + i)) * (size_t)q_stride + (size_t)h * s.hd +
                  (size_t)c] *
                scale;
        qs[i][c] = x;
    }
}

/* Lane j: the scores of key j of the tile in kv against the warp's QPW
 * queries in qs (q and K columns past hd are zero, so the dot product runs
 * to hd4, a multiple of 4, and reads q four columns at a time). */
template <int HDB, int QPW>
__device__ __forceinline__ void tile_scores(float *sc, const float (*kv)[HDB + 1],
                                            const float (*qs)[HDB], int warp, int lane, int hd4)
{
#pragma unroll
    for (int i = 0; i < QPW; i++)
        sc[i] = 0.0f;
#pragma unroll 2
    for (int c = 0; c < hd4; c += 4) {
        const float k0 = kv[lane][c], k1 = kv[lane][c + 1];
        const float k2 = kv[lane][c + 2], k3 = kv[lane][c + 3];
#pragma unroll
        for (int i = 0; i < QPW; i++) {
            const float4 qc = *reinterpret_cast<const float4 *>(&qs[warp * QPW + i][c]);
            sc[i] = fmaf(qc.x, k0, sc[i]);
            sc[i] = fmaf(qc.y, k1, sc[i]);
            sc[i] = fmaf(qc.z, k2, sc[i]);
            sc[i] = fmaf(qc.w, k3, sc[i]);
        }
    }
}

/* A prefill warp's running state: per query, the keys [lo, hi) it sees
 * (empty for a row past T) and its document, the running max and sum, the
 * output columns, and the tile's probabilities (lane j: key j). */
template <int QPW, int R> struct prefill_rows {
    int lo[QPW], hi[QPW], qdoc[QPW];
    float m[QPW], l[QPW], acc[QPW][R], p[QPW];
};

/* The online softmax over the tile's keys j0 .. j0 + nk - 1 (lane j: its
 * key, kdoc its document): p, and m, l and acc rescaled. */
template <int QPW, int R>
__device__ __forceinline__ void tile_softmax(prefill_rows<QPW, R> &w, const float *sc, bool doc,
                                             int kdoc, int j0, int nk, int lane)
{
#pragma unroll
    for (int i = 0; i < QPW; i++) {
        w.p[i] = 0.0f;
        if (j0 < w.hi[i] && j0 + nk > w.lo[i]) { /* warp-uniform: the tile meets the range */
            const int j = j0 + lane;
            const bool vis = j >= w.lo[i] && j < w.hi[i] && (!doc || kdoc == w.qdoc[i]);
            const float sv = vis ? sc[i] : -INFINITY;
            const float bmax = warp_max(sv);
            if (bmax != -INFINITY) { /* warp-uniform: some key of the tile is visible */
                const float corr = nl_elem_online_max(&w.m[i], bmax);
                w.p[i] = vis ? nl_elem_expf(sv - w.m[i]) : 0.0f;
                w.l[i] = w.l[i] * corr + warp_sum(w.p[i]);
#pragma unroll
                for (int r = 0; r < R; r++)
                    w.acc[i][r] *= corr;
            }
        }
    }
}

/* acc += p V over the tile of values in kv, for the keys in each query's
 * range (as the CPU: a key outside it is skipped, not multiplied by 0; a
 * key of another document inside it has p = 0). */
template <int HDB, int QPW, int R>
__device__ __forceinline__ void tile_pv(prefill_rows<QPW, R> &w, const float (*kv)[HDB + 1], int j0,
                                        int nk, int lane)
{
    for (int j = 0; j < nk; j++) {
        float vj[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            vj[r] = kv[j][lane + r * WARP];
#pragma unroll
        for (int i = 0; i < QPW; i++) {
            const float pj = __shfl_sync(FULL_MASK, w.p[i], j);
            if (j0 + j >= w.lo[i] && j0 + j < w.hi[i]) {
#pragma unroll
                for (int r = 0; r < R; r++)
                    w.acc[i][r] = fmaf(pj, vj[r], w.acc[i][r]);
            }
        }
    }
}

/* One block: queries t0 .. t0 + nq - 1 of head h of sequence b. Blocks are
 * numbered tile-major, last tile first, so the longest rows start first.
 * SEQ: the sequences' own caches (s.kseq / s.vseq; an instantiation of
 * its own, so the shared cache's code stays as it was). */
template <int HDB, int BQ, typename KV, bool SEQ>
__global__ void __launch_bounds__(PREFILL_WARPS *WARP, PREFILL_MIN_BLOCKS)
    attn_prefill(float *out, float *lse, const float *q, int q_stride, const KV *k, const KV *v,
                 int kv_stride, nl_attn_shape s, nl_attn_mask mk)
{
    constexpr int R = HDB / WARP;           /* output columns per lane */
    constexpr int QPW = BQ / PREFILL_WARPS; /* queries per warp */
    static_assert(HDB % WARP == 0 && BQ % PREFILL_WARPS == 0, "tile shape");
    /* the tile's queries, pre-scaled; columns past hd and rows past T are 0 */
    __shared__ __align__(16) float qs[BQ][HDB];
    /* a tile of keys, then of values; the +1 makes lane j's walk along row
     * j (keys) free of bank conflicts */
    __shared__ float kv[BK][HDB + 1];

    const int hd = s.hd;
    const int BH = s.B * s.H;
    const int ntiles = (s.T + BQ - 1) / BQ;
    const int bh = (int)(blockIdx.x % (unsigned)BH);
    const int tile = ntiles - 1 - (int)(blockIdx.x / (unsigned)BH);
    const int b = bh / s.H, h = bh % s.H;
    const int g = h / (s.H / s.G);
    const int past = s.pos ? s.pos[(size_t)b * s.T] : s.past; /* device positions: read here */
    const int t0 = tile * BQ;
    const int nq = min(BQ, s.T - t0);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;

    load_queries<HDB, BQ>(qs, q, q_stride, s, b, h, t0, nq, 1.0f / sqrtf((float)hd));
    const KV *kb, *vb;
    seq_cache<SEQ>(kb, vb, k, v, s.kseq, s.vseq, s.kv_cap, kv_stride, b, (size_t)g * hd);

    const int nkeys = past + s.T;
    const int32_t *doc = mk.doc ? mk.doc + (size_t)b * s.T : nullptr;
    prefill_rows<QPW, R> w;
#pragma unroll
    for (int i = 0; i < QPW; i++) {
        const int qi = warp * QPW + i;
        w.lo[i] = w.hi[i] = 0;
        if (qi < nq)
            attn_range(mk, past + t0 + qi, nkeys, w.lo[i], w.hi[i]);
        w.qdoc[i] = doc && qi < nq ? doc[t0 + qi] : 0;
        w.m[i] = -INFINITY;
        w.l[i] = 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++)
            w.acc[i][r] = 0.0f;
    }
    /* the tile's queries see keys kbeg .. kend - 1 (both ends move up with
     * the query; causal: 0 .. past + t0 + nq - 1) */
    int kbeg, kend, unused;
    attn_range(mk, past + t0, nkeys, kbeg, unused);
    attn_range(mk, past + t0 + nq - 1, nkeys, unused, kend);
    const int hd4 = (hd + 3) & ~3;
    for (int j0 = kbeg; j0 < kend; j0 += BK) {
        const int nk = min(BK, kend - j0);
        const int kdoc = doc && lane < nk ? doc[j0 + lane] : 0; /* lane j's key */
        __syncthreads(); /* qs is written; the last value tile is read */
        load_tile<HDB, KV>(kv, kb, kv_stride, j0, nk, hd);
        __syncthreads();
        float sc[QPW];
        tile_scores<HDB, QPW>(sc, kv, qs, warp, lane, hd4);
        tile_softmax<QPW, R>(w, sc, doc != nullptr, kdoc, j0, nk, lane);
        __syncthreads(); /* every warp is done with the keys */
        load_tile<HDB, KV>(kv, vb, kv_stride, j0, nk, hd);
        __syncthreads();
        tile_pv<HDB, QPW, R>(w, kv, j0, nk, lane);
    }

#pragma unroll
    for (int i = 0; i < QPW; i++) {
        if (warp * QPW + i >= nq)
            continue;
        const int t = t0 + warp * QPW + i;
        float *o = out + ((size_t)b * s.T + (size_t)t) * ((size_t)s.H * hd) + (size_t)h * hd;
        const float inv = 1.0f / w.l[i];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int c = lane + r * WARP;
            if (c < hd)
                o[c] = w.acc[i][r] * inv;
        }
        if (lse && lane == 0)
            lse[((size_t)b * s.H + (size_t)h) * s.T + (size_t)t] = w.m[i] + logf(w.l[i]);
    }
}

/* ---------------------------------------------------------------- decode */

/* One block: query t of head h of sequence b (blocks numbered query-major).
 * SEQ: the sequences' own caches (s.kseq / s.vseq), whose two pointers a
 * thread keeps in registers (the shared cache's are the parameters plus
 * one offset): a register budget of its own, so the shared cache's
 * instantiations keep theirs (ptxas's default, 48 to 64 registers) and
 * SEQ's (more than 64 in the 256 bucket) do not spill. */
template <int HDB, typename KV, bool SEQ>
__global__ void __launch_bounds__(DECODE_WARPS *WARP, SEQ ? DECODE_SEQ_MIN_BLOCKS : 0)
    attn_decode(float *out, float *lse, const float *q, int q_stride, const KV *k, const KV *v,
                int kv_stride, nl_attn_shape s, nl_attn_mask mk)
{
    constexpr int R = HDB / WARP; /* columns per lane: c = lane + 32 r */
    constexpr int KU = 8;         /* keys scored at once (independent reductions) */
    static_assert(HDB % WARP == 0 && HDB <= DECODE_WARPS * WARP, "one thread per column");
    __shared__ float part_acc[DECODE_WARPS][HDB];
    __shared__ float part_m[DECODE_WARPS], part_l[DECODE_WARPS];

    const int hd = s.hd;
    const int BH = s.B * s.H;
    const int bh = (int)(blockIdx.x % (unsigned)BH);
    const int t = (int)(blockIdx.x / (unsigned)BH);
    const int b = bh / s.H, h = bh % s.H;
    const int g = h / (s.H / s.G);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const float scale = 1.0f / sqrtf((float)hd);

    const float *qr = q + ((size_t)b * s.T + (size_t)t) * (size_t)q_stride + (size_t)h * hd;
    float qv[R], acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int c = lane + r * WARP;
        qv[r] = c < hd ? qr[c] * scale : 0.0f;
        acc[r] = 0.0f;
    }
    const KV *kb, *vb;
    seq_cache<SEQ>(kb, vb, k, v, s.kseq, s.vseq, s.kv_cap, kv_stride, b, (size_t)g * hd);

    float m = -INFINITY, l = 0.0f;
    int kbeg, kend;                                           /* causal: keys 0 .. past + t */
    const int past = s.pos ? s.pos[(size_t)b * s.T] : s.past; /* device positions: read here */
    attn_range(mk, past + t, past + s.T, kbeg, kend);
    for (int j0 = kbeg + warp * BK; j0 < kend; j0 += DECODE_WARPS * BK) {
        const int nk = min(BK, kend - j0); /* >= 1 */
        float sc = -INFINITY;              /* lane j: score of key j0 + j */
        for (int j = 0; j < nk; j += KU) {
            float d[KU];
#pragma unroll
            for (int u = 0; u < KU; u++) {
                d[u] = 0.0f;
                if (j + u < nk) {
                    const KV *kr = kb + (size_t)(j0 + j + u) * (size_t)kv_stride;
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const int c = lane + r * WARP;
                        if (c < hd)
                            d[u] = fmaf(qv[r], kv_ld(kr + c), d[u]);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < KU; u++) {
                const float du = warp_sum(d[u]);
                if (lane == j + u)
                    sc = du;
            }
        }
        if (lane >= nk)
            sc = -INFINITY;
        const float corr = nl_elem_online_max(&m, warp_max(sc));
        const float p = lane < nk ? nl_elem_expf(sc - m) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[r] *= corr;
#pragma unroll 4
        for (int j = 0; j < nk; j++) {
            const float pj = __shfl_sync(FULL_MASK, p, j);
            const KV *vr = vb + (size_t)(j0 + j) * (size_t)kv_stride;
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int c = lane + r * WARP;
                if (c < hd)
                    acc[r] = fmaf(pj, kv_ld(vr + c), acc[r]);
            }
        }
    }

    /* merge the warps' states in warp order; a warp that saw no key has
     * m = -inf, l = 0, acc = 0 and gets factor 0 */
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
#pragma unroll
    for (int r = 0; r < R; r++)
        part_acc[warp][lane + r * WARP] = acc[r];
    __syncthreads();
    const int c = threadIdx.x; /* this thread's output column */
    float mm = -INFINITY, ll = 0.0f, o = 0.0f;
    for (int w = 0; w < DECODE_WARPS; w++) {
        float bscale;
        const float corr = nl_elem_online_merge(&mm, &ll, part_m[w], part_l[w], &bscale);
        if (c < hd)
            o = o * corr + part_acc[w][c] * bscale;
    }
    if (c < hd)
        out[((size_t)b * s.T + (size_t)t) * ((size_t)s.H * hd) + (size_t)h * hd + (size_t)c] =
            o * (1.0f / ll);
    if (lse && threadIdx.x == 0)
        lse[((size_t)b * s.H + (size_t)h) * s.T + (size_t)t] = mm + logf(ll);
}

/* ---------------------------------------------------------------- launch */

template <int HDB, int BQ, typename KV>
void launch_prefill(cudaStream_t st, unsigned blocks, float *out, float *lse, const float *q,
                    int q_stride, const KV *k, const KV *v, int kv_stride, nl_attn_shape s,
                    nl_attn_mask mk)
{
    if (s.kseq)
        attn_prefill<HDB, BQ, KV, true><<<blocks, PREFILL_WARPS * WARP, 0, st>>>(
            out, lse, q, q_stride, k, v, kv_stride, s, mk);
    else
        attn_prefill<HDB, BQ, KV, false><<<blocks, PREFILL_WARPS * WARP, 0, st>>>(
            out, lse, q, q_stride, k, v, kv_stride, s, mk);
}

template <int HDB, typename KV>
void launch_decode(cudaStream_t st, unsigned blocks, float *out, float *lse, const float *q,
                   int q_stride, const KV *k, const KV *v, int kv_stride, nl_attn_shape s,
                   nl_attn_mask mk)
{
    if (s.kseq)
        attn_decode<HDB, KV, true>
            <<<blocks, DECODE_WARPS * WARP, 0, st>>>(out, lse, q, q_stride, k, v, kv_stride, s, mk);
    else
        attn_decode<HDB, KV, false>
            <<<blocks, DECODE_WARPS * WARP, 0, st>>>(out, lse, q, q_stride, k, v, kv_stride, s, mk);
}

/* Query tile per head-dim bucket (shared memory: queries BQ x HDB plus one
 * 32 x (HDB + 1) key/value tile, 12.1 / 24.1 / 40.1 KiB; 8 / 16 / 16
 * accumulators per lane). */
constexpr int BQ64 = 16, BQ128 = 16, BQ256 = 8;

/* The decode kernel runs short calls without packed documents (which come
 * only without a cache, where the prefill kernel serves any T). */
bool use_decode(const nl_attn_shape &s, const nl_attn_mask &mk)
{
    return s.T <= DECODE_MAX_T && !mk.doc;
}

/* Blocks the chosen kernel needs, or 0 if that passes the grid's x limit. */
unsigned count_blocks(const nl_attn_shape &s, const nl_attn_mask &mk, int hdb)
{
    const long long bh = (long long)s.B * s.H;
    long long per = s.T; /* decode: one block per query */
    if (!use_decode(s, mk)) {
        const int bq = hdb == 64 ? BQ64 : hdb == 128 ? BQ128 : BQ256;
        per = (s.T + bq - 1) / bq;
    }
    const long long n = bh * per;
    return n > INT_MAX ? 0u : (unsigned)n;
}

/* The kernel for the shape (decode or prefill) and head-dim bucket hdb,
 * over a cache of KV. */
template <typename KV>
void launch(cudaStream_t st, unsigned blocks, int hdb, float *out, float *lse, const float *q,
            int q_stride, const KV *k, const KV *v, int kv_stride, const nl_attn_shape &s,
            const nl_attn_mask &mk)
{
    if (use_decode(s, mk)) {
        if (hdb == 64)
            launch_decode<64>(st, blocks, out, lse, q, q_stride, k, v, kv_stride, s, mk);
        else if (hdb == 128)
            launch_decode<128>(st, blocks, out, lse, q, q_stride, k, v, kv_stride, s, mk);
        else
            launch_decode<256>(st, blocks, out, lse, q, q_stride, k, v, kv_stride, s, mk);
    } else {
        if (hdb == 64)
            launch_prefill<64, BQ64>(st, blocks, out, lse, q, q_stride, k, v, kv_stride, s, mk);
        else if (hdb == 128)
            launch_prefill<128, BQ128>(st, blocks, out, lse, q, q_stride, k, v, kv_stride, s, mk);
        else
            launch_prefill<256, BQ256>(st, blocks, out, lse, q, q_stride, k, v, kv_stride, s, mk);
    }
}

bool shape_ok(const float *out, const float *q, int q_stride, const float *k, const float *v,
              int kv_stride, const nl_attn_shape &s)
{
    if (!out || !q || !k || !v)
        return false;
    if (s.B < 0 || s.T < 0 || s.H < 0 || s.past < 0 || s.G < 1 || s.H % s.G != 0)
        return false;
    if (s.pos && s.past != 0) /* device positions: past comes from pos */
        return false;
    if (!s.kseq != !s.vseq) /* the sequences' caches: both arrays or neither */
        return false;
    if (s.hd < 1 || s.hd > NL_BACKEND_MAX_HEAD_DIM)
        return false;
    /* the kernels step key indices by up to 256 past the last key in int */
    if ((long long)s.kv_cap < (long long)s.past + s.T || s.kv_cap > INT_MAX - 256)
        return false;
    return (long long)q_stride >= (long long)s.H * s.hd &&
           (long long)kv_stride >= (long long)s.G * s.hd;
}

} // namespace

extern "C" int nl_cuda_attention_forward(void *stream, float *out, float *lse, const float *q,
                                         int q_stride, const float *k, const float *v,
                                         int kv_stride, nl_attn_shape s)
{
    const nl_attn_mask causal = {};
    return nl_cuda_attention_masked_forward(stream, out, lse, q, q_stride, k, v, kv_stride, s,
                                            causal);
}

extern "C" int nl_cuda_attention_masked_forward(void *stream, float *out, float *lse,
                                                const float *q, int q_stride, const float *k,
                                                const float *v, int kv_stride, nl_attn_shape s,
                                                nl_attn_mask mk)
{
    static_assert(NL_BACKEND_MAX_HEAD_DIM <= 256, "add a head-dim bucket");
    if (s.B == 0 || s.T == 0 || s.H == 0)
        return s.B < 0 || s.T < 0 || s.H < 0 ? (int)cudaErrorInvalidValue : (int)cudaSuccess;
    if (!shape_ok(out, q, q_stride, k, v, kv_stride, s) || !attn_mask_ok(mk, s))
        return (int)cudaErrorInvalidValue;
    const int hdb = s.hd <= 64 ? 64 : s.hd <= 128 ? 128 : 256;
    const unsigned blocks = count_blocks(s, mk, hdb);
    if (blocks == 0)
        return (int)cudaErrorInvalidValue;
    cudaStream_t st = (cudaStream_t)stream;
    if (s.kv_bf16) /* a bf16 cache: its bits */
        launch(st, blocks, hdb, out, lse, q, q_stride, reinterpret_cast<const uint16_t *>(k),
               reinterpret_cast<const uint16_t *>(v), kv_stride, s, mk);
    else
        launch(st, blocks, hdb, out, lse, q, q_stride, k, v, kv_stride, s, mk);
    return (int)cudaGetLastError();
}
