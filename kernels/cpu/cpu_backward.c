/* The CPU backend's backward and optimizer ops (all but attention, which
 * has its own file): plain C loops vectorised with `omp simd`, threaded with
 * OpenMP where the work is large enough to pay for the fork. Ops whose
 * output rows may collide (embedding rows of repeated tokens, the rmsnorm
 * weight gradient summed over rows) split the work by column blocks
 * instead of rows, so no two threads write the same float. This file is
 * built with -fno-math-errno so that sqrtf vectorises. */
#include "kernels/cpu/cpu_math.h"
#include "kernels/cpu/cpu_ops.h"

#include <math.h>
#include <string.h>

#define PAR_ROWS(n) if ((n) >= 64)
#define PAR_ELEMS(n) if ((n) >= 65536)
#define CB 64 /* columns per block in the column-parallel ops */

/* ---------------------------------------------------------------- embedding */

void nl_cpu_embedding_backward(nl_backend *be, float *dtable, const float *dout,
                               const int32_t *tokens, int N, int C)
{
    const int nb = (C + CB - 1) / CB;
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ELEMS((long)N *C)
    for (int blk = 0; blk < nb; blk++) {
        const int c0 = blk * CB, cw = C - c0 < CB ? C - c0 : CB;
        for (int n = 0; n < N; n++) {
            float *d = dtable + (size_t)tokens[n] * C + c0;
            const float *g = dout + (size_t)n * C + c0;
#pragma omp simd
            for (int c = 0; c < cw; c++)
                d[c] += g[c];
        }
    }
}

/* ---------------------------------------------------------------- rmsnorm */

void nl_cpu_rmsnorm_backward(nl_backend *be, float *dinp, float *dw, const float *dout,
                             const float *inp, const float *w, const float *rstd, int N, int C)
{
    /* dinp: rows are independent */
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *g = dout + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        const float r = rstd[n];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int c = 0; c < C; c++)
            dot += w[c] * g[c] * x[c];
        const float k = r * r * r / (float)C * dot;
#pragma omp simd
        for (int c = 0; c < C; c++)
            dx[c] += w[c] * g[c] * r - x[c] * k;
    }
    /* dw: a sum over rows, so split by columns */
    const int nb = (C + CB - 1) / CB;
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ELEMS((long)N *C)
    for (int blk = 0; blk < nb; blk++) {
        const int c0 = blk * CB, cw = C - c0 < CB ? C - c0 : CB;
        float acc[CB] = {0};
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C + c0, *g = dout + (size_t)n * C + c0;
            const float r = rstd[n];
#pragma omp simd
            for (int c = 0; c < cw; c++)
                acc[c] += g[c] * x[c] * r;
        }
        for (int c = 0; c < cw; c++)
            dw[c0 + c] += acc[c];
    }
}

/* ---------------------------------------------------------------- swiglu */

void nl_cpu_swiglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                            int F)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F, *u = g + F, *d = dh + (size_t)n * F;
        float *dg = dgu + (size_t)n * 2 * F, *du = dg + F;
        for (int j = 0; j < F; j++)
            nl_elem_swiglu_backward(&dg[j], &du[j], g[j], u[j], d[j]);
    }
}

void nl_cpu_geglu_backward(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                           int F)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F, *u = g + F, *d = dh + (size_t)n * F;
        float *dg = dgu + (size_t)n * 2 * F, *du = dg + F;
        for (int j = 0; j < F; j++)
            nl_elem_geglu_backward(&dg[j], &du[j], g[j], u[j], d[j]);
    }
}

/* ---------------------------------------------------------------- moe */

void nl_cpu_moe_combine_backward(nl_backend *be, float *dy, float *dw, const float *dx,
                                 const float *y, const int32_t *slot, const float *w, int N, int k,
                                 int C)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        const float *g = dx + (size_t)n * C;
        for (int i = 0; i < k; i++) {
            const size_t e = (size_t)n * k + i;
            const float a = w[e];
            const float *yr = y + (size_t)slot[e] * C;
            float *dyr = dy + (size_t)slot[e] * C;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int c = 0; c < C; c++) {
                dyr[c] = a * g[c];
                dot += g[c] * yr[c];
            }
            dw[e] = dot;
        }
    }
}

/* ---------------------------------------------------------------- loss */

void nl_cpu_cross_entropy(nl_backend *be, float *logits, float *losses, const int32_t *targets,
                          int N, int V, float scale)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        float *x = logits + (size_t)n * V;
        const int t = targets[n];
        if (t < 0) { /* an ignored target (DESIGN 6): no loss, no gradient */
            memset(x, 0, (size_t)V * sizeof *x);
            losses[n] = 0.0f;
            continue;
        }
        const float xt = x[t];
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int i = 0; i < V; i++)
            m = x[i] > m ? x[i] : m;
        /* the sum runs in double: V may be large and the terms span decades */
        double sum = 0.0;
        for (int i = 0; i < V; i++) {
            x[i] = nl_elem_expf(x[i] - m);
            sum += x[i];
        }
        losses[n] = (float)((double)m + log(sum) - (double)xt);
        const float a = (float)((double)scale / sum);
#pragma omp simd
        for (int i = 0; i < V; i++)
            x[i] *= a;
        x[t] -= scale;
    }
}

/* ---------------------------------------------------------------- optimizer */

double nl_cpu_sumsq(nl_backend *be, const float *x, size_t n)
{
    double acc = 0.0;
    /* a non-finite element squares to inf or nan, and both survive the sum */
#pragma omp parallel for simd NL_CPU_TEAM(be) reduction(+ : acc) PAR_ELEMS(n)
    for (size_t i = 0; i < n; i++)
        acc += (double)x[i] * (double)x[i];
    return acc;
}

void nl_cpu_adamw(nl_backend *be, float *p, const float *g, float *m, float *v, size_t n, float lr,
                  float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale)
{
#pragma omp parallel for simd NL_CPU_TEAM(be) PAR_ELEMS(n)
    for (size_t i = 0; i < n; i++)
        nl_elem_adamw(&p[i], &m[i], &v[i], g[i], lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
}
