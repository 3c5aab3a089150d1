/* Grouped-query attention on the CPU, tiled with an online softmax
 * (flash-attention style): a tile of QT queries meets the keys in blocks of
 * KT, and only a QT x KT score block exists at a time, so memory grows with
 * T, never with T^2. Causal by default; under a DESIGN section 6 mask
 * (bidirectional, local window, packed documents) a tile walks only the
 * keys its window reaches, so a local layer costs O(T W). A bf16 KV cache
 * (s.kv_bf16) is widened a block at a time; the sums are FP32 either way. */
#include "kernels/cpu/cpu_math.h"
#include "kernels/cpu/cpu_ops.h"

#include <math.h>
#include <string.h>

#define QT 16 /* queries per tile */
#define KT 64 /* keys per block */
#define HD_MAX NL_BACKEND_MAX_HEAD_DIM

/* Keys j0 .. j0 + nk - 1 of a bf16 cache widened to FP32 (exact): the
 * keys transposed into kt, the values row by row into vt. */
static void widen_block(float (*kt)[KT], float (*vt)[HD_MAX], const uint16_t *kb,
                        const uint16_t *vb, int kv_stride, int j0, int nk, int hd)
{
    for (int j = 0; j < nk; j++) {
        const uint16_t *kr = kb + (size_t)(j0 + j) * kv_stride;
        const uint16_t *vr = vb + (size_t)(j0 + j) * kv_stride;
        for (int c = 0; c < hd; c++) {
            kt[c][j] = nl_elem_from_bf16(kr[c]);
            vt[j][c] = nl_elem_from_bf16(vr[c]);
        }
    }
}

/* One (sequence, head, query tile): rows t0 .. t0+nq-1 of the new positions.
 * Each key block is transposed into kt so the score loop runs along keys
 * (contiguous, vectorised); the value loop runs along the head dimension.
 * Unsanitized (NL_HOT): every row it reads or writes is checked. */
NL_HOT static void attend_tile(float *out, float *lse, const float *q, int q_stride, const float *k,
                               const float *v, int kv_stride, const nl_attn_shape *s,
                               const nl_attn_mask *mk, int b, int h, int t0, int nq)
{
    const int hd = s->hd;
    const int g = h / (s->H / s->G);
    const float scale = 1.0f / sqrtf((float)hd);
    float acc[QT][HD_MAX];
    float m[QT], l[QT];
    float sc[QT][KT];
    float kt[HD_MAX][KT];
    float qs[QT][HD_MAX];
    float vt[KT][HD_MAX]; /* a bf16 cache's value block, widened */

    for (int i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(acc[i], 0, (size_t)hd * sizeof(float));
        const float *qr = q + ((size_t)b * s->T + t0 + i) * q_stride + (size_t)h * hd;
        nl_hot_rows(qr, 1, 0, (size_t)hd * sizeof(float), 0);
        for (int c = 0; c < hd; c++)
            qs[i][c] = qr[c] * scale;
    }
    /* sequence b's cache: its own (kseq, vseq) or row b kv_cap of k, v */
    const size_t kv_off = (s->kseq ? 0 : (size_t)b * s->kv_cap * kv_stride) + (size_t)g * hd;
    if (s->kseq) {
        nl_hot_rows(s->kseq + b, 1, 0, sizeof *s->kseq, 0);
        nl_hot_rows(s->vseq + b, 1, 0, sizeof *s->vseq, 0);
    }
    const void *ks = s->kseq ? s->kseq[b] : (const void *)k;
    const void *vs = s->kseq ? s->vseq[b] : (const void *)v;
    const float *kb = s->kv_bf16 ? NULL : (const float *)ks + kv_off;
    const float *vb = s->kv_bf16 ? NULL : (const float *)vs + kv_off;
    const uint16_t *kb16 = s->kv_bf16 ? (const uint16_t *)ks + kv_off : NULL;
    const uint16_t *vb16 = s->kv_bf16 ? (const uint16_t *)vs + kv_off : NULL;
    /* keys [kbeg, kend) reach some query of the tile (the causal case:
     * 0 .. past + t0 + nq - 1) */
    const int nkeys = s->past + s->T;
    const int32_t *doc = mk->doc ? mk->doc + (size_t)b * s->T : NULL;
    int kbeg, kend, unused;
    nl_cpu_attn_range(mk, s->past + t0, nkeys, &kbeg, &unused);
    nl_cpu_attn_range(mk, s->past + t0 + nq - 1, nkeys, &unused, &kend);
    if (doc)
        nl_hot_rows(doc + t0, 1, 0, (size_t)nq * sizeof *doc, 0);
    for (int j0 = kbeg; j0 < kend; j0 += KT) {
        const int nk = kend - j0 < KT ? kend - j0 : KT;
        /* the block's key and value rows, and its keys' documents */
        const size_t elem = kb16 ? sizeof *kb16 : sizeof *kb;
        const size_t row = (size_t)kv_stride * elem;
        nl_hot_rows(kb16 ? (const void *)(kb16 + (size_t)j0 * kv_stride)
                         : (const void *)(kb + (size_t)j0 * kv_stride),
                    (size_t)nk, row, (size_t)hd * elem, 0);
        nl_hot_rows(vb16 ? (const void *)(vb16 + (size_t)j0 * kv_stride)
                         : (const void *)(vb + (size_t)j0 * kv_stride),
                    (size_t)nk, row, (size_t)hd * elem, 0);
        if (doc)
            nl_hot_rows(doc + j0, 1, 0, (size_t)nk * sizeof *doc, 0);
        if (kb16) /* a bf16 cache: the block's keys and values widened */
            widen_block(kt, vt, kb16, vb16, kv_stride, j0, nk, hd);
        else
            for (int j = 0; j < nk; j++) {
                const float *kr = kb + (size_t)(j0 + j) * kv_stride;
                for (int c = 0; c < hd; c++)
                    kt[c][j] = kr[c];
            }
        for (int i = 0; i < nq; i++) {
            /* keys [j0 + jl, j0 + nv) of the block are in this row's range */
            int lo, hi;
            nl_cpu_attn_range(mk, s->past + t0 + i, nkeys, &lo, &hi);
            const int jl = lo - j0 > 0 ? lo - j0 : 0;
            const int nv = hi - j0 < nk ? hi - j0 : nk;
            if (nv <= jl)
                continue; /* whole block outside this row's range */
            float *srow = sc[i];
            for (int j = 0; j < KT; j++)
                srow[j] = 0.0f;
            for (int c = 0; c < hd; c++) {
                const float qc = qs[i][c];
                const float *kc = kt[c];
                for (int j = 0; j < KT; j++)
                    srow[j] += qc * kc[j];
            }
            if (doc) /* packed rows: only keys of the query's document */
                for (int j = jl; j < nv; j++)
                    if (doc[j0 + j] != doc[t0 + i])
                        srow[j] = -INFINITY;
            float bmax = -INFINITY;
            for (int j = jl; j < nv; j++)
                bmax = srow[j] > bmax ? srow[j] : bmax;
            if (bmax == -INFINITY)
                continue; /* no key of the block in this row's document */
            const float corr = nl_elem_online_max(&m[i], bmax);
            const float mnew = m[i];
            float psum = 0.0f;
            for (int j = jl; j < nv; j++) {
                srow[j] = nl_elem_expf(srow[j] - mnew);
                psum += srow[j];
            }
            l[i] = l[i] * corr + psum;
            float *ai = acc[i];
            for (int c = 0; c < hd; c++)
                ai[c] *= corr;
            for (int j = jl; j < nv; j++) {
                const float p = srow[j];
                const float *vr = kb16 ? vt[j] : vb + (size_t)(j0 + j) * kv_stride;
                for (int c = 0; c < hd; c++)
                    ai[c] += p * vr[c];
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        float *o = out + ((size_t)b * s->T + t0 + i) * ((size_t)s->H * hd) + (size_t)h * hd;
        nl_hot_rows(o, 1, 0, (size_t)hd * sizeof(float), 1);
        const float inv = 1.0f / l[i];
        for (int c = 0; c < hd; c++)
            o[c] = acc[i][c] * inv;
        if (lse) {
            float *li = lse + ((size_t)b * s->H + h) * s->T + t0 + i;
            nl_hot_rows(li, 1, 0, sizeof *li, 1);
            *li = m[i] + logf(l[i]);
        }
    }
}

void nl_cpu_attention_forward(nl_backend *be, float *out, float *lse, const float *q, int q_stride,
                              const float *k, const float *v, int kv_stride, nl_attn_shape s)
{
    const nl_attn_mask causal = {0};
    nl_cpu_attention_masked_forward(be, out, lse, q, q_stride, k, v, kv_stride, s, causal);
}

void nl_cpu_attention_masked_forward(nl_backend *be, float *out, float *lse, const float *q,
                                     int q_stride, const float *k, const float *v, int kv_stride,
                                     nl_attn_shape s, nl_attn_mask mask)
{
    /* the model's config check bounds hd; never run off the stack tiles
     * (attend_tile's, unchecked in a sanitized build: NL_HOT) */
    if (s.B <= 0 || s.T <= 0 || s.G <= 0 || s.H % s.G != 0 || s.hd <= 0 || s.hd > HD_MAX)
        return;
    const int tiles = (s.T + QT - 1) / QT;
    const long work = (long)s.B * s.H * tiles;
#pragma omp parallel for NL_CPU_TEAM(be) schedule(dynamic, 1) if (work > 1)
    for (long w = 0; w < work; w++) {
        /* walk tiles from the end so the longest rows start first */
        const int tile = tiles - 1 - (int)(w % tiles);
        const int h = (int)((w / tiles) % s.H);
        const int b = (int)(w / tiles / s.H);
        const int t0 = tile * QT;
        const int nq = s.T - t0 < QT ? s.T - t0 : QT;
        nl_attn_shape sb = s; /* device positions: the sequence's past, read now */
        if (s.pos)
            sb.past = s.pos[(size_t)b * s.T];
        attend_tile(out, lse, q, q_stride, k, v, kv_stride, &sb, &mask, b, h, t0, nq);
    }
}
