/* Backward of the grouped-query attention on the CPU (causal, or under a
 * DESIGN section 6 mask: a key block meets only the query tiles whose
 * window reaches it), flash-attention
 * style: probabilities are recomputed block by block from the forward's
 * log-sum-exp, p_ij = exp(scale q_i.k_j - lse_i), so memory grows with T,
 * never with T^2. With D_i = dout_i.out_i:
 *   dv_j += p_ij dout_i,  dp_ij = dout_i.v_j,  ds_ij = p_ij (dp_ij - D_i),
 *   dq_i += scale ds_ij k_j,  dk_j += scale ds_ij q_i.
 *
 * Work is split over (sequence b, kv head g). A task owns dk/dv of its
 * (b, g) and dq of the H/G query heads that read that kv head, so no two
 * threads write the same float. Inside a task the keys are walked in blocks
 * of KT; a block's dk/dv accumulate in transposed stack tiles over every
 * query (of every head of the group) that sees the block, and are written
 * out once. Scaling: at most B*G threads do useful work; with a single
 * sequence and few kv heads (B*G below the thread count) the spare threads
 * idle. Splitting further (by key block, with per-thread dq partials and a
 * reduction) would need scratch from the caller, which this slot's
 * signature does not carry. */
#include "kernels/cpu/cpu_math.h"
#include "kernels/cpu/cpu_ops.h"

#include <math.h>
#include <string.h>

#define QT 16 /* query rows per step */
#define KT 32 /* keys per block: the vector width of the inner loops */
#define HD_MAX NL_BACKEND_MAX_HEAD_DIM

/* Per-task stack tiles: 4 * HD_MAX * KT floats (128 KiB) plus two QT x KT
 * blocks, far below a thread's stack. */
typedef struct bwd_block {
    float kT[HD_MAX][KT];  /* keys of the block, transposed, zero past nk */
    float vT[HD_MAX][KT];  /* values, likewise */
    float dkT[HD_MAX][KT]; /* dk of the block, transposed */
    float dvT[HD_MAX][KT]; /* dv of the block, transposed */
    float P[QT][KT];       /* probabilities of the current query rows */
    float dS[QT][KT];      /* scale * ds of the current query rows */
} bwd_block;

/* Common arguments of one call, read-only inside the tasks. */
typedef struct bwd_args {
    float *dq, *dk, *dv;
    const float *dout, *q, *k, *v, *out, *lse;
    int q_stride, kv_stride;
    nl_attn_shape s;
    nl_attn_mask mask;
    float scale;
} bwd_args;

/* Load keys j0 .. j0+nk-1 of (b, g) transposed into the block, and clear
 * its dk/dv accumulators. */
static void load_block(bwd_block *blk, const bwd_args *a, int b, int g, int j0, int nk)
{
    const int hd = a->s.hd;
    const size_t base = ((size_t)b * a->s.kv_cap + j0) * a->kv_stride + (size_t)g * hd;
    for (int c = 0; c < hd; c++) {
        for (int j = 0; j < nk; j++) {
            blk->kT[c][j] = a->k[base + (size_t)j * a->kv_stride + c];
            blk->vT[c][j] = a->v[base + (size_t)j * a->kv_stride + c];
        }
        for (int j = nk; j < KT; j++)
            blk->kT[c][j] = blk->vT[c][j] = 0.0f;
        memset(blk->dkT[c], 0, sizeof blk->dkT[c]);
        memset(blk->dvT[c], 0, sizeof blk->dvT[c]);
    }
}

/* Query rows t0 .. t0+nq-1 of head h against the block at key j0: fill P
 * and dS, and add this block's share to dq. Unsanitized (NL_HOT), as
 * block_accumulate: each row they read or write is checked. */
NL_HOT static void block_rows(bwd_block *blk, const bwd_args *a, int b, int h, int t0, int nq,
                              int j0)
{
    const int hd = a->s.hd;
    const size_t ostride = (size_t)a->s.H * hd;
    for (int i = 0; i < nq; i++) {
        const int t = t0 + i;
        const float *qi = a->q + ((size_t)b * a->s.T + t) * a->q_stride + (size_t)h * hd;
        const float *oi = a->out + ((size_t)b * a->s.T + t) * ostride + (size_t)h * hd;
        const float *doi = a->dout + ((size_t)b * a->s.T + t) * ostride + (size_t)h * hd;
        const float *lsei = a->lse + ((size_t)b * a->s.H + h) * a->s.T + t;
        nl_hot_rows(qi, 1, 0, (size_t)hd * sizeof(float), 0);
        nl_hot_rows(oi, 1, 0, (size_t)hd * sizeof(float), 0);
        nl_hot_rows(doi, 1, 0, (size_t)hd * sizeof(float), 0);
        nl_hot_rows(lsei, 1, 0, sizeof *lsei, 0);
        const float lse = *lsei;
        float D = 0.0f;
#pragma omp simd reduction(+ : D)
        for (int c = 0; c < hd; c++)
            D += doi[c] * oi[c];
        /* scores and dp for the whole block, accumulated over c */
        float sc[KT] = {0}, dp[KT] = {0};
        for (int c = 0; c < hd; c++) {
            const float qc = qi[c], dc = doi[c];
#pragma omp simd
            for (int j = 0; j < KT; j++) {
                sc[j] += qc * blk->kT[c][j];
                dp[j] += dc * blk->vT[c][j];
            }
        }
        /* keys [j0 + jl, j0 + jh) of the block are in this row's range */
        int lo, hi;
        nl_cpu_attn_range(&a->mask, t, a->s.T, &lo, &hi);
        const int jl = lo - j0, jh = hi - j0;
        const int32_t *doc = a->mask.doc ? a->mask.doc + (size_t)b * a->s.T : NULL;
        if (doc) { /* the query's document, the block's keys' (those before T) */
            nl_hot_rows(doc + t, 1, 0, sizeof *doc, 0);
            nl_hot_rows(doc + j0, 1, 0, (size_t)(a->s.T - j0 < KT ? a->s.T - j0 : KT) * sizeof *doc,
                        0);
        }
        for (int j = 0; j < KT; j++) {
            const int vis = j >= jl && j < jh && j0 + j < a->s.T && (!doc || doc[j0 + j] == doc[t]);
            const float p = vis ? nl_elem_expf(a->scale * sc[j] - lse) : 0.0f;
            blk->P[i][j] = p;
            blk->dS[i][j] = a->scale * p * (dp[j] - D);
        }
        float *dqi = a->dq + ((size_t)b * a->s.T + t) * a->q_stride + (size_t)h * hd;
        nl_hot_rows(dqi, 1, 0, (size_t)hd * sizeof(float), 1);
        for (int c = 0; c < hd; c++) {
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int j = 0; j < KT; j++)
                acc += blk->dS[i][j] * blk->kT[c][j];
            dqi[c] += acc;
        }
    }
}

/* dv^T[c, :] += sum_i dout_i[c] P[i, :];  dk^T[c, :] += sum_i q_i[c] dS[i, :] */
NL_HOT static void block_accumulate(bwd_block *blk, const bwd_args *a, int b, int h, int t0, int nq)
{
    const int hd = a->s.hd;
    const size_t ostride = (size_t)a->s.H * hd;
    const float *qrow[QT], *drow[QT];
    for (int i = 0; i < nq; i++) {
        qrow[i] = a->q + ((size_t)b * a->s.T + t0 + i) * a->q_stride + (size_t)h * hd;
        drow[i] = a->dout + ((size_t)b * a->s.T + t0 + i) * ostride + (size_t)h * hd;
        nl_hot_rows(qrow[i], 1, 0, (size_t)hd * sizeof(float), 0);
        nl_hot_rows(drow[i], 1, 0, (size_t)hd * sizeof(float), 0);
    }
    for (int c = 0; c < hd; c++) {
        float dv[KT], dk[KT];
        memcpy(dv, blk->dvT[c], sizeof dv);
        memcpy(dk, blk->dkT[c], sizeof dk);
        for (int i = 0; i < nq; i++) {
            const float dc = drow[i][c], qc = qrow[i][c];
#pragma omp simd
            for (int j = 0; j < KT; j++) {
                dv[j] += dc * blk->P[i][j];
                dk[j] += qc * blk->dS[i][j];
            }
        }
        memcpy(blk->dvT[c], dv, sizeof dv);
        memcpy(blk->dkT[c], dk, sizeof dk);
    }
}

/* Write the block's dk/dv (keys j0 .. j0+nk-1) back to their rows. */
static void store_block(const bwd_block *blk, const bwd_args *a, int b, int g, int j0, int nk)
{
    const int hd = a->s.hd;
    const size_t base = ((size_t)b * a->s.kv_cap + j0) * a->kv_stride + (size_t)g * hd;
    for (int j = 0; j < nk; j++) {
        float *dkr = a->dk + base + (size_t)j * a->kv_stride;
        float *dvr = a->dv + base + (size_t)j * a->kv_stride;
        for (int c = 0; c < hd; c++) {
            dkr[c] = blk->dkT[c][j];
            dvr[c] = blk->dvT[c][j];
        }
    }
}

/* Queries [*tbeg, *tend) of T whose key range can meet keys j0 .. j0 +
 * nk - 1 (the inverse of nl_cpu_attn_range, no past). */
static void query_span(const nl_attn_mask *mk, int j0, int nk, int T, int *tbeg, int *tend)
{
    const int W = mk->window, jl = j0 + nk - 1;
    if (!mk->bidir) {
        *tbeg = j0;
        *tend = W > 0 ? jl + W : T;
    } else {
        *tbeg = W > 0 ? j0 - W / 2 : 0;
        *tend = W > 0 ? jl + W / 2 + 1 : T;
    }
    *tbeg = *tbeg < 0 ? 0 : *tbeg;
    *tend = *tend > T ? T : *tend;
}

/* Everything of one (sequence, kv head). */
static void backward_task(const bwd_args *a, int b, int g)
{
    const nl_attn_shape *s = &a->s;
    const int per = s->H / s->G; /* query heads per kv head */
    bwd_block blk;

    /* dq of this task's heads: columns g*per*hd .. (g+1)*per*hd of each row */
    for (int t = 0; t < s->T; t++)
        memset(a->dq + ((size_t)b * s->T + t) * a->q_stride + (size_t)g * per * s->hd, 0,
               (size_t)per * s->hd * sizeof(float));
    for (int j0 = 0; j0 < s->T; j0 += KT) {
        const int nk = s->T - j0 < KT ? s->T - j0 : KT;
        load_block(&blk, a, b, g, j0, nk);
        /* the queries whose range reaches the block (causal: from j0 on) */
        int tbeg, tend;
        query_span(&a->mask, j0, nk, s->T, &tbeg, &tend);
        for (int h = g * per; h < (g + 1) * per; h++)
            for (int t0 = tbeg; t0 < tend; t0 += QT) {
                const int nq = tend - t0 < QT ? tend - t0 : QT;
                block_rows(&blk, a, b, h, t0, nq, j0);
                block_accumulate(&blk, a, b, h, t0, nq);
            }
        store_block(&blk, a, b, g, j0, nk);
    }
}

void nl_cpu_attention_backward(nl_backend *be, float *dq, float *dk, float *dv, const float *dout,
                               const float *q, int q_stride, const float *k, const float *v,
                               int kv_stride, const float *out, const float *lse, nl_attn_shape s)
{
    const nl_attn_mask causal = {0};
    nl_cpu_attention_masked_backward(be, dq, dk, dv, dout, q, q_stride, k, v, kv_stride, out, lse,
                                     s, causal);
}

void nl_cpu_attention_masked_backward(nl_backend *be, float *dq, float *dk, float *dv,
                                      const float *dout, const float *q, int q_stride,
                                      const float *k, const float *v, int kv_stride,
                                      const float *out, const float *lse, nl_attn_shape s,
                                      nl_attn_mask mask)
{
    /* the model's config check bounds hd; never run off the stack tiles */
    if (s.B <= 0 || s.T <= 0 || s.G <= 0 || s.H % s.G != 0 || s.hd <= 0 || s.hd > HD_MAX)
        return;
    const bwd_args a = {.dq = dq,
                        .dk = dk,
                        .dv = dv,
                        .dout = dout,
                        .q = q,
                        .k = k,
                        .v = v,
                        .out = out,
                        .lse = lse,
                        .q_stride = q_stride,
                        .kv_stride = kv_stride,
                        .s = s,
                        .mask = mask,
                        .scale = 1.0f / sqrtf((float)s.hd)};
    const int work = s.B * s.G;
#pragma omp parallel for NL_CPU_TEAM(be)                                                           \
    schedule(dynamic, 1) if (work > 1 && (long)s.T * s.H * s.hd >= 4096)
    for (int w = 0; w < work; w++)
        backward_task(&a, w / s.G, w % s.G);
}
