/* CUDA attention backward: the gradient of the causal grouped-query
 * attention of cuda_attention.cu without a cache, the twin of
 * kernels/cpu/cpu_attention_bwd.c, which is its test oracle. With
 * p_ij = exp(scale q_i.k_j - lse_i) recomputed from the forward's
 * log-sum-exp and D_i = dout_i.out_i:
 *   dv_j = sum_i p_ij dout_i,  ds_ij = scale p_ij (dout_i.v_j - D_i),
 *   dk_j = sum_i ds_ij q_i,    dq_i  = sum_j ds_ij k_j.
 * Scores are never stored whole, accumulation is fp32, and there are no
 * atomics: every output float is written by one thread after a loop in a
 * fixed order, so a result is the same on every run.
 *
 * Three kernels:
 * - rowdot: D into the caller's scratch, one thread per (b, h, t).
 * - dkdv: one block of 4 warps per (sequence, kv head, tile of BK keys).
 *   It loops over the H/G query heads of the group and the query tiles
 *   that see the keys (causal: from the key tile's first key on). Warp w
 *   owns keys w*KPW .. of the tile, lane l its columns l, l + 32, ..., and
 *   keeps their dk and dv in registers.
 * - dq: one block of 4 warps per (sequence, head, tile of BQ queries),
 *   looping over the key tiles its queries see; warp w owns queries
 *   w*QPW .., lane l their columns l, l + 32, ....
 * Both tile kernels share the step that stages q/dout rows and k/v rows in
 * shared memory and fills the BQ x BK tiles P and dS (score_tile). All are
 * templated on the forward's head-dim buckets HDB (64, 128, 256; hd <= HDB)
 * with tiles that keep the static shared memory under 48 KiB.
 *
 * Under a DESIGN section 6 mask (cuda_mask.cuh) a key tile visits only the
 * query tiles whose windows reach it and a query tile only the key tiles
 * its window reaches, so a local layer's backward also costs O(T W); a pair
 * the mask hides (another document) gets p = dS = 0.
 *
 * elem.h's exponential is the one the forward and the CPU backend use. */
#include "kernels/cuda/cuda_attention_bwd.h"

#include "kernels/elem.h"

#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>

namespace
{

constexpr int WARP = 32;

#include "kernels/cuda/cuda_mask.cuh"

constexpr int TILE_WARPS = 4; /* warps per dkdv or dq block */
constexpr int NT = TILE_WARPS * WARP;
constexpr int ROW_THREADS = 256; /* rows per rowdot block */

/* dot(a, b) over hd columns by one thread, in column order: rowdot and
 * the tiles' own D (scratch NULL) agree to the bit. One thread a row and
 * no shuffles: the pass reads B T H hd floats twice, small next to the
 * tiles' work, and each thread's row stays in L1 across its loads. */
__device__ __forceinline__ float row_dot(const float *a, const float *b, int hd)
{
    float acc = 0.0f;
    for (int c = 0; c < hd; c++)
        acc = fmaf(a[c], b[c], acc);
    return acc;
}

/* D[(b*H + h)*T + t] = dout_t.out_t for head h of sequence b; one thread per row. */
__global__ void __launch_bounds__(ROW_THREADS)
    attn_bwd_rowdot(float *D, const float *dout, const float *out, nl_attn_shape s)
{
    const size_t row = (size_t)blockIdx.x * ROW_THREADS + threadIdx.x;
    const size_t rows = (size_t)s.B * s.H * s.T;
    if (row >= rows)
        return;
    const size_t t = row % (size_t)s.T, bh = row / (size_t)s.T;
    const size_t b = bh / (size_t)s.H, h = bh % (size_t)s.H;
    const size_t o = (b * s.T + t) * ((size_t)s.H * s.hd) + h * s.hd;
    D[row] = row_dot(dout + o, out + o, s.hd);
}

/* ---------------------------------------------------------------- tiles */

/* Shared memory of one tile block. Every row carries a +1 against bank
 * conflicts: the score step reads k and v one row per lane, and q and dout
 * up to four rows per warp (score_tile). */
template <int HDB, int BQ, int BK> struct tile_smem {
    float qs[BQ][HDB + 1];  /* queries, unscaled; 0 past hd and past the last row */
    float dos[BQ][HDB + 1]; /* dout of those queries, likewise */
    float ks[BK][HDB + 1];  /* keys; 0 past hd and past the last key */
    float vs[BK][HDB + 1];  /* values, likewise */
    float P[BQ][BK];        /* probabilities (dkdv only) */
    float dS[BQ][BK];       /* scale p (dp - D) */
    float lse[BQ], D[BQ];   /* per query row; 0 past the last row */
};

/* Stage queries t0 .. t0 + nq - 1 of head h of sequence b: q, dout, lse and
 * D (from Dg, or computed here from out when Dg is NULL). Called by every
 * thread of the block. */
template <int HDB, int BQ, int BK>
__device__ void load_queries(tile_smem<HDB, BQ, BK> &sm, const float *q, int q_stride,
                             const float *dout, const float *out, const float *lse, const float *Dg,
                             const nl_attn_shape &s, int b, int h, int t0, int nq)
{
    const int hd = s.hd;
    const size_t ostride = (size_t)s.H * hd;
#pragma unroll 4
    for (int e = threadIdx.x; e < BQ * HDB; e += NT) {
        const int i = e / HDB, c = e % HDB;
        float x = 0.0f, d = 0.0f;
        if (i < nq && c < hd) {
            const size_t row = (size_t)b * s.T + (size_t)(t0 + i);
            x = q[row * (size_t)q_stride + (size_t)h * hd + (size_t)c];
            d = dout[row * ostride + (size_t)h * hd + (size_t)c];
        }
        sm.qs[i][c] = x;
        sm.dos[i][c] = d;
    }
    const size_t lrow = ((size_t)b * s.H + (size_t)h) * s.T + (size_t)t0;
    for (int i = threadIdx.x; i < BQ; i += NT) {
        float l = 0.0f, d = 0.0f;
        if (i < nq) {
            const size_t o = ((size_t)b * s.T + (size_t)(t0 + i)) * ostride + (size_t)h * hd;
            l = lse[lrow + i];
            d = Dg ? Dg[lrow + i] : row_dot(dout + o, out + o, hd);
        }
        sm.lse[i] = l;
        sm.D[i] = d;
    }
}

/* Stage keys and values j0 .. j0 + nk - 1 from kb/vb (row stride kv_stride,
 * already offset to the sequence and kv head). Called by every thread. */
template <int HDB, int BQ, int BK>
__device__ void load_keys(tile_smem<HDB, BQ, BK> &sm, const float *kb, const float *vb,
                          int kv_stride, int j0, int nk, int hd)
{
#pragma unroll 4
    for (int e = threadIdx.x; e < BK * HDB; e += NT) {
        const int j = e / HDB, c = e % HDB;
        float x = 0.0f, y = 0.0f;
        if (j < nk && c < hd) {
            const size_t off = (size_t)(j0 + j) * (size_t)kv_stride + (size_t)c;
            x = kb[off];
            y = vb[off];
        }
        sm.ks[j][c] = x;
        sm.vs[j][c] = y;
    }
}

/* P and dS of the staged query rows (first at t0, nq of them) against the
 * staged keys (first at j0, nk of them). Query t sees key j when j is in
 * its mask's range (causal: j <= t) and, with doc (the sequence's document
 * ids), in its document; an unseen pair, and a row past nq or a key past
 * nk, gets exactly 0. Called by every thread.
 *
 * Thread x takes key j = x % BK against rows x / BK + m * (NT / BK), so it
 * reads k_j and v_j once a column for all its rows (the rows of a warp's
 * lanes differ only where BK < 32, and the +1 of qs and dos puts them in
 * different banks). */
template <int HDB, int BQ, int BK>
__device__ void score_tile(tile_smem<HDB, BQ, BK> &sm, bool want_p, int t0, int nq, int j0, int nk,
                           int hd, float scale, const nl_attn_mask &mk, const int32_t *doc, int T)
{
    constexpr int STEP = NT / BK;              /* rows between a thread's rows */
    constexpr int MI = (BQ + STEP - 1) / STEP; /* rows per thread */
    static_assert(NT % BK == 0, "tile shape");
    const int j = threadIdx.x % BK, i0 = threadIdx.x / BK;
    if (i0 >= BQ) /* BQ * BK < NT: this thread has no row */
        return;
    float sc[MI], dp[MI];
#pragma unroll
    for (int m = 0; m < MI; m++)
        sc[m] = dp[m] = 0.0f;
#pragma unroll 2
    for (int c = 0; c < hd; c++) {
        const float kc = sm.ks[j][c], vc = sm.vs[j][c];
#pragma unroll
        for (int m = 0; m < MI; m++) {
            const int i = i0 + m * STEP;
            if (BQ % STEP == 0 || i < BQ) {
                sc[m] = fmaf(sm.qs[i][c], kc, sc[m]);
                dp[m] = fmaf(sm.dos[i][c], vc, dp[m]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MI; m++) {
        const int i = i0 + m * STEP;
        if (BQ % STEP != 0 && i >= BQ)
            continue;
        float p = 0.0f, ds = 0.0f;
        bool vis = i < nq && j < nk;
        if (vis) {
            int lo, hi;
            attn_range(mk, t0 + i, T, lo, hi);
            vis = j0 + j >= lo && j0 + j < hi && (!doc || doc[j0 + j] == doc[t0 + i]);
        }
        if (vis) {
            p = nl_elem_expf(scale * sc[m] - sm.lse[i]);
            ds = scale * p * (dp[m] - sm.D[i]);
        }
        if (want_p)
            sm.P[i][j] = p;
        sm.dS[i][j] = ds;
    }
}

/* One block: dk and dv of keys j0 .. j0 + nk - 1 of kv head g of sequence
 * b. Blocks are numbered tile-major, first tile first: the first keys are
 * seen by the most queries. */
template <int HDB, int BQ, int BK>
__global__ void __launch_bounds__(NT)
    attn_bwd_dkdv(float *dk, float *dv, const float *dout, const float *q, int q_stride,
                  const float *k, const float *v, int kv_stride, const float *out, const float *lse,
                  const float *Dg, nl_attn_shape s, nl_attn_mask mk)
{
    constexpr int R = HDB / WARP;        /* columns per lane */
    constexpr int KPW = BK / TILE_WARPS; /* keys per warp */
    static_assert(HDB % WARP == 0 && BK % TILE_WARPS == 0, "tile shape");
    __shared__ __align__(16) tile_smem<HDB, BQ, BK> sm;

    const int hd = s.hd;
    const int BG = s.B * s.G;
    const int bg = (int)(blockIdx.x % (unsigned)BG);
    const int j0 = (int)(blockIdx.x / (unsigned)BG) * BK;
    const int b = bg / s.G, g = bg % s.G;
    const int per = s.H / s.G;
    const int nk = min(BK, s.T - j0);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const float scale = 1.0f / sqrtf((float)hd);
    const size_t kv_off = (size_t)b * s.T * (size_t)kv_stride + (size_t)g * hd;

    load_keys(sm, k + kv_off, v + kv_off, kv_stride, j0, nk, hd);
    float dka[KPW][R], dva[KPW][R];
#pragma unroll
    for (int u = 0; u < KPW; u++)
#pragma unroll
        for (int r = 0; r < R; r++)
            dka[u][r] = dva[u][r] = 0.0f;

    /* only queries [qlo, qhi) see keys of the tile (causal: from j0 on) */
    const int32_t *doc = mk.doc ? mk.doc + (size_t)b * s.T : nullptr;
    int qlo, qhi;
    attn_query_range(mk, j0, j0 + nk, s.T, qlo, qhi);
    for (int h = g * per; h < (g + 1) * per; h++) {
        for (int t0 = qlo / BQ * BQ; t0 < qhi; t0 += BQ) {
            const int nq = min(BQ, s.T - t0);
            __syncthreads(); /* the keys are staged; the last rows are read */
            load_queries(sm, q, q_stride, dout, out, lse, Dg, s, b, h, t0, nq);
            __syncthreads();
            score_tile(sm, true, t0, nq, j0, nk, hd, scale, mk, doc, s.T);
            __syncthreads();
            for (int i = 0; i < nq; i++) {
                float dc[R], qc[R];
#pragma unroll
                for (int r = 0; r < R; r++) {
                    dc[r] = sm.dos[i][lane + r * WARP];
                    qc[r] = sm.qs[i][lane + r * WARP];
                }
#pragma unroll
                for (int u = 0; u < KPW; u++) {
                    const float p = sm.P[i][warp * KPW + u], ds = sm.dS[i][warp * KPW + u];
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        dva[u][r] = fmaf(p, dc[r], dva[u][r]);
                        dka[u][r] = fmaf(ds, qc[r], dka[u][r]);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int u = 0; u < KPW; u++) {
        const int j = warp * KPW + u;
        if (j >= nk)
            continue;
        const size_t row = kv_off + (size_t)(j0 + j) * (size_t)kv_stride;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int c = lane + r * WARP;
            if (c < hd) {
                dk[row + (size_t)c] = dka[u][r];
                dv[row + (size_t)c] = dva[u][r];
            }
        }
    }
}

/* One block: dq of queries t0 .. t0 + nq - 1 of head h of sequence b.
 * Blocks are numbered tile-major, last tile first, so the longest rows
 * start first. */
template <int HDB, int BQ, int BK>
__global__ void __launch_bounds__(NT)
    attn_bwd_dq(float *dq, const float *dout, const float *q, int q_stride, const float *k,
                const float *v, int kv_stride, const float *out, const float *lse, const float *Dg,
                nl_attn_shape s, nl_attn_mask mk)
{
    constexpr int R = HDB / WARP;        /* columns per lane */
    constexpr int QPW = BQ / TILE_WARPS; /* queries per warp */
    static_assert(HDB % WARP == 0 && BQ % TILE_WARPS == 0, "tile shape");
    __shared__ __align__(16) tile_smem<HDB, BQ, BK> sm;

    const int hd = s.hd;
    const int BH = s.B * s.H;
    const int ntiles = (s.T + BQ - 1) / BQ;
    const int bh = (int)(blockIdx.x % (unsigned)BH);
    const int t0 = (ntiles - 1 - (int)(blockIdx.x / (unsigned)BH)) * BQ;
    const int b = bh / s.H, h = bh % s.H;
    const int g = h / (s.H / s.G);
    const int nq = min(BQ, s.T - t0);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const float scale = 1.0f / sqrtf((float)hd);
    const size_t kv_off = (size_t)b * s.T * (size_t)kv_stride + (size_t)g * hd;

    load_queries(sm, q, q_stride, dout, out, lse, Dg, s, b, h, t0, nq);
    float acc[QPW][R];
#pragma unroll
    for (int u = 0; u < QPW; u++)
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[u][r] = 0.0f;

    /* the tile's queries see keys kbeg .. kend - 1 (causal: 0 .. t0 + nq - 1) */
    const int32_t *doc = mk.doc ? mk.doc + (size_t)b * s.T : nullptr;
    int kbeg, kend, unused;
    attn_range(mk, t0, s.T, kbeg, unused);
    attn_range(mk, t0 + nq - 1, s.T, unused, kend);
    for (int j0 = kbeg; j0 < kend; j0 += BK) {
        const int nk = min(BK, kend - j0);
        __syncthreads(); /* the queries are staged; the last keys are read */
        load_keys(sm, k + kv_off, v + kv_off, kv_stride, j0, nk, hd);
        __syncthreads();
        score_tile(sm, false, t0, nq, j0, nk, hd, scale, mk, doc, s.T);
        __syncthreads();
        for (int j = 0; j < nk; j++) {
            float kc[R];
#pragma unroll
            for (int r = 0; r < R; r++)
                kc[r] = sm.ks[j][lane + r * WARP];
#pragma unroll
            for (int u = 0; u < QPW; u++) {
                const float ds = sm.dS[warp * QPW + u][j];
#pragma unroll
                for (int r = 0; r < R; r++)
                    acc[u][r] = fmaf(ds, kc[r], acc[u][r]);
            }
        }
    }

#pragma unroll
    for (int u = 0; u < QPW; u++) {
        const int i = warp * QPW + u;
        if (i >= nq)
            continue;
        float *o = dq + ((size_t)b * s.T + (size_t)(t0 + i)) * (size_t)q_stride + (size_t)h * hd;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int c = lane + r * WARP;
            if (c < hd)
                o[c] = acc[u][r];
        }
    }
}

/* ---------------------------------------------------------------- launch */

/* Tiles per head-dim bucket, BQ = BK (static shared memory 41728 / 35200 /
 * 33472 bytes; dk/dv accumulators 32 a lane, dq 16). */
constexpr int TILE64 = 32, TILE128 = 16, TILE256 = 8;

struct bwd_args {
    float *dq, *dk, *dv;
    const float *dout, *q, *k, *v, *out, *lse, *D;
    int q_stride, kv_stride;
    nl_attn_shape s;
    nl_attn_mask mk;
};

template <int HDB, int TILE> void launch_tiles(cudaStream_t st, const bwd_args &a)
{
    const unsigned ntiles = (unsigned)((a.s.T + TILE - 1) / TILE);
    attn_bwd_dkdv<HDB, TILE, TILE><<<(unsigned)(a.s.B * a.s.G) * ntiles, NT, 0, st>>>(
        a.dk, a.dv, a.dout, a.q, a.q_stride, a.k, a.v, a.kv_stride, a.out, a.lse, a.D, a.s, a.mk);
    attn_bwd_dq<HDB, TILE, TILE><<<(unsigned)(a.s.B * a.s.H) * ntiles, NT, 0, st>>>(
        a.dq, a.dout, a.q, a.q_stride, a.k, a.v, a.kv_stride, a.out, a.lse, a.D, a.s, a.mk);
}

bool shape_ok(const bwd_args &a)
{
    const nl_attn_shape &s = a.s;
    if (!a.dq || !a.dk || !a.dv || !a.dout || !a.q || !a.k || !a.v || !a.out || !a.lse)
        return false;
    if (s.B < 0 || s.T < 0 || s.H < 0 || s.G < 1 || s.H % s.G != 0)
        return false;
    if (s.hd < 1 || s.hd > NL_BACKEND_MAX_HEAD_DIM)
        return false;
    /* no cache; the kernels step positions by up to a tile past T in int */
    if (s.past != 0 || s.kv_cap != s.T || s.T > INT_MAX - 64)
        return false;
    /* windows step positions by W past T in int too */
    if (!attn_mask_ok(a.mk, s) || a.mk.window > INT_MAX - 64 - s.T)
        return false;
    if ((long long)a.q_stride < (long long)s.H * s.hd ||
        (long long)a.kv_stride < (long long)s.G * s.hd)
        return false;
    /* every grid within the x limit, and B*H, B*G in int */
    const long long tiles = (s.T + 7) / 8; /* the smallest tile */
    const long long rows = (long long)s.B * s.H * s.T;
    return (long long)s.B * s.H * tiles <= INT_MAX &&
           (rows + ROW_THREADS - 1) / ROW_THREADS <= INT_MAX;
}

} // namespace

extern "C" size_t nl_cuda_attention_backward_scratch(nl_attn_shape s)
{
    if (s.B <= 0 || s.H <= 0 || s.T <= 0)
        return 0;
    return (size_t)s.B * (size_t)s.H * (size_t)s.T * sizeof(float);
}

extern "C" int nl_cuda_attention_backward(void *stream, float *dq, float *dk, float *dv,
                                          const float *dout, const float *q, int q_stride,
                                          const float *k, const float *v, int kv_stride,
                                          const float *out, const float *lse, float *scratch,
                                          nl_attn_shape s)
{
    const nl_attn_mask causal = {};
    return nl_cuda_attention_masked_backward(stream, dq, dk, dv, dout, q, q_stride, k, v, kv_stride,
                                             out, lse, scratch, s, causal);
}

extern "C" int nl_cuda_attention_masked_backward(void *stream, float *dq, float *dk, float *dv,
                                                 const float *dout, const float *q, int q_stride,
                                                 const float *k, const float *v, int kv_stride,
                                                 const float *out, const float *lse, float *scratch,
                                                 nl_attn_shape s, nl_attn_mask mk)
{
    static_assert(NL_BACKEND_MAX_HEAD_DIM <= 256, "add a head-dim bucket");
    if (s.B == 0 || s.T == 0 || s.H == 0)
        return s.B < 0 || s.T < 0 || s.H < 0 ? (int)cudaErrorInvalidValue : (int)cudaSuccess;
    const bwd_args a = {dq, dk, dv, dout, q, k, v, out, lse, scratch, q_stride, kv_stride, s, mk};
    if (!shape_ok(a))
        return (int)cudaErrorInvalidValue;
    cudaStream_t st = (cudaStream_t)stream;
    if (scratch) {
        const long long rows = (long long)s.B * s.H * s.T;
        attn_bwd_rowdot<<<(unsigned)((rows + ROW_THREADS - 1) / ROW_THREADS), ROW_THREADS, 0, st>>>(
            scratch, dout, out, s);
    }
    if (s.hd <= 64)
        launch_tiles<64, TILE64>(st, a);
    else if (s.hd <= 128)
        launch_tiles<128, TILE128>(st, a);
    else
        launch_tiles<256, TILE256>(st, a);
    return (int)cudaGetLastError();
}
