/* Causal grouped-query attention on the CPU, tiled with an online softmax
 * (flash-attention style): a tile of QT queries meets the keys in blocks of
 * KT, and only a QT x KT score block exists at a time, so memory grows with
 * T, never with T^2. */
#include "cpu_ops.h"

#include <math.h>
#include <string.h>

#define QT 16  /* queries per tile */
#define KT 64  /* keys per block */
#define HD_MAX 256

/* One (sequence, head, query tile): rows t0 .. t0+nq-1 of the new positions. */
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
    const float *qrow[QT];

    for (int i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(acc[i], 0, (size_t)hd * sizeof(float));
        qrow[i] = q + ((size_t)b * s->T + t0 + i) * q_stride + (size_t)h * hd;
    }
    const float *kb = k + (size_t)b * s->kv_cap * kv_stride + (size_t)g * hd;
    const float *vb = v + (size_t)b * s->kv_cap * kv_stride + (size_t)g * hd;
    /* the last query of the tile sees keys 0 .. past + t0 + nq - 1 */
    const int kend = s->past + t0 + nq;
    for (int j0 = 0; j0 < kend; j0 += KT) {
        const int nk = kend - j0 < KT ? kend - j0 : KT;
        for (int i = 0; i < nq; i++) {
            const int lim = s->past + t0 + i; /* last key this query may see */
            float bmax = -INFINITY;
            for (int j = 0; j < nk; j++) {
                if (j0 + j > lim) {
                    sc[i][j] = -INFINITY;
                    continue;
                }
                const float *kr = kb + (size_t)(j0 + j) * kv_stride;
                float d = 0.0f;
                for (int c = 0; c < hd; c++)
                    d += qrow[i][c] * kr[c];
                d *= scale;
                sc[i][j] = d;
                bmax = d > bmax ? d : bmax;
            }
            if (bmax == -INFINITY)
                continue; /* whole block masked for this row */
            const float mnew = bmax > m[i] ? bmax : m[i];
            const float corr = expf(m[i] - mnew); /* 0 when m was -inf */
            l[i] *= corr;
            for (int c = 0; c < hd; c++)
                acc[i][c] *= corr;
            for (int j = 0; j < nk; j++) {
                if (sc[i][j] == -INFINITY)
                    continue;
                const float p = expf(sc[i][j] - mnew);
                l[i] += p;
                const float *vr = vb + (size_t)(j0 + j) * kv_stride;
                for (int c = 0; c < hd; c++)
                    acc[i][c] += p * vr[c];
            }
            m[i] = mnew;
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
    (void)be;
    const int tiles = (s.T + QT - 1) / QT;
    const long work = (long)s.B * s.H * tiles;
#pragma omp parallel for schedule(dynamic, 1) if (work > 1)
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
