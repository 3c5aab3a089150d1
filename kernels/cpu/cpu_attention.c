/* Causal grouped-query attention on the CPU, tiled with an online softmax
 * (flash-attention style): a tile of QT queries meets the keys in blocks of
 * KT, and only a QT x KT score block exists at a time, so memory grows with
 * T, never with T^2. */
#include "cpu_math.h"
#include "cpu_ops.h"

#include <math.h>
#include <string.h>

#define QT 16 /* queries per tile */
#define KT 64 /* keys per block */
#define HD_MAX NL_BACKEND_MAX_HEAD_DIM

/* One (sequence, head, query tile): rows t0 .. t0+nq-1 of the new positions.
 * Each key block is transposed into kt so the score loop runs along keys
 * (contiguous, vectorised); the value loop runs along the head dimension. */
static void attend_tile(float *out, float *lse, const float *q, int q_stride, const float *k,
                        const float *v, int kv_stride, const nl_attn_shape *s, int b, int h, int t0,
                        int nq)
{
    const int hd = s->hd;
    const int g = h / (s->H / s->G);
    const float scale = 1.0f / sqrtf((float)hd);
    float acc[QT][HD_MAX];
    float m[QT], l[QT];
    float sc[QT][KT];
    float kt[HD_MAX][KT];
    float qs[QT][HD_MAX];

    for (int i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(acc[i], 0, (size_t)hd * sizeof(float));
        const float *qr = q + ((size_t)b * s->T + t0 + i) * q_stride + (size_t)h * hd;
        for (int c = 0; c < hd; c++)
            qs[i][c] = qr[c] * scale;
    }
    const float *kb = k + (size_t)b * s->kv_cap * kv_stride + (size_t)g * hd;
    const float *vb = v + (size_t)b * s->kv_cap * kv_stride + (size_t)g * hd;
    /* the last query of the tile sees keys 0 .. past + t0 + nq - 1 */
    const int kend = s->past + t0 + nq;
    for (int j0 = 0; j0 < kend; j0 += KT) {
        const int nk = kend - j0 < KT ? kend - j0 : KT;
        for (int j = 0; j < nk; j++) {
            const float *kr = kb + (size_t)(j0 + j) * kv_stride;
            for (int c = 0; c < hd; c++)
                kt[c][j] = kr[c];
        }
        for (int i = 0; i < nq; i++) {
            const int lim = s->past + t0 + i - j0; /* last key (in block) this query sees */
            if (lim < 0)
                continue; /* whole block in this row's future */
            const int nv = lim + 1 < nk ? lim + 1 : nk;
            float *srow = sc[i];
            for (int j = 0; j < KT; j++)
                srow[j] = 0.0f;
            for (int c = 0; c < hd; c++) {
                const float qc = qs[i][c];
                const float *kc = kt[c];
                for (int j = 0; j < KT; j++)
                    srow[j] += qc * kc[j];
            }
            float bmax = -INFINITY;
            for (int j = 0; j < nv; j++)
                bmax = srow[j] > bmax ? srow[j] : bmax;
            const float corr = nl_elem_online_max(&m[i], bmax);
            const float mnew = m[i];
            float psum = 0.0f;
            for (int j = 0; j < nv; j++) {
                srow[j] = nl_elem_expf(srow[j] - mnew);
                psum += srow[j];
            }
            l[i] = l[i] * corr + psum;
            float *ai = acc[i];
            for (int c = 0; c < hd; c++)
                ai[c] *= corr;
            for (int j = 0; j < nv; j++) {
                const float p = srow[j];
                const float *vr = vb + (size_t)(j0 + j) * kv_stride;
                for (int c = 0; c < hd; c++)
                    ai[c] += p * vr[c];
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        float *o = out + ((size_t)b * s->T + t0 + i) * ((size_t)s->H * hd) + (size_t)h * hd;
        const float inv = 1.0f / l[i];
        for (int c = 0; c < hd; c++)
            o[c] = acc[i][c] * inv;
        if (lse)
            lse[((size_t)b * s->H + h) * s->T + t0 + i] = m[i] + logf(l[i]);
    }
}

void nl_cpu_attention_forward(nl_backend *be, float *out, float *lse, const float *q, int q_stride,
                              const float *k, const float *v, int kv_stride, nl_attn_shape s)
{
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
        attend_tile(out, lse, q, q_stride, k, v, kv_stride, &s, b, h, t0, nq);
    }
}
