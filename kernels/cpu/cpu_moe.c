/* The CPU backend's mixture-of-experts routing slots: top-k routing and
 * the dispatch tables, the load-balancing loss, the router backward, and
 * the grouped expert GEMMs. Their arithmetic is what core/model/layer.c did on
 * the host before routing moved behind the backend, operation for
 * operation, so the CPU's results did not change by a bit. The grouped
 * GEMMs read the device offsets directly (host memory) and make the same
 * per-expert gemm calls in the same order. */
#include "kernels/cpu/cpu_ops.h"

#include "kernels/elem.h"

#include <string.h>

#define PAR_ROWS(n) if ((n) >= 64)

/* ---------------------------------------------------------------- routing */

void nl_cpu_moe_route(nl_backend *be, int32_t *choice, float *w, int32_t *offsets, int32_t *perm,
                      int32_t *slot, const float *probs, int N, int E, int k)
{
    if (E < 1 || E > NL_BACKEND_MAX_EXPERTS || k < 1 || k > E || N < 0)
        return; /* outside the slot's contract (the config refuses such models) */

#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) /* top-k of each row, ties to the lower expert index */
        nl_elem_topk_row(choice + (size_t)n * k, w + (size_t)n * k, probs + (size_t)n * E, E, k);
    /* counts, offsets, and the dispatch in token order */
    int32_t fill[NL_BACKEND_MAX_EXPERTS];
    memset(fill, 0, (size_t)E * sizeof *fill);
    for (size_t i = 0; i < (size_t)N * k; i++)
        fill[choice[i]]++;
    offsets[0] = 0;
    for (int e = 0; e < E; e++) {
        offsets[e + 1] = offsets[e] + fill[e];
        fill[e] = offsets[e];
    }
    for (int n = 0; n < N; n++)
        for (int i = 0; i < k; i++) {
            const int32_t s = fill[choice[(size_t)n * k + i]]++;
            perm[s] = n;
            slot[(size_t)n * k + i] = s;
        }
}

void nl_cpu_moe_aux(nl_backend *be, double *aux, float *frac, int64_t *counts, const float *probs,
                    const int32_t *offsets, const float *global_frac, int N, int E, int k,
                    double aux_rows)
{
    (void)be;
    double a = 0.0;
    for (int e = 0; e < E; e++) {
        const int32_t count = offsets[e + 1] - offsets[e];
        frac[e] = global_frac ? global_frac[e] : (float)((double)count / ((double)N * k));
        if (counts)
            counts[e] += count;
        double psum = 0.0;
        for (int n = 0; n < N; n++)
            psum += probs[(size_t)n * E + e];
        a += (double)frac[e] * psum / aux_rows;
    }
    if (aux)
        *aux += (double)(float)(E * a);
}

void nl_cpu_moe_router_backward(nl_backend *be, float *dl, const float *dw, const float *probs,
                                const int32_t *choice, const float *w, const float *frac, int N,
                                int E, int k, float aux_scale)
{
#pragma omp parallel for NL_CPU_TEAM(be) PAR_ROWS(N)
    for (int n = 0; n < N; n++) {
        const float *p = probs + (size_t)n * E;
        const int32_t *ch = choice + (size_t)n * k;
        const float *wn = w + (size_t)n * k, *dwn = dw + (size_t)n * k;
        float *d = dl + (size_t)n * E;
        double S = 0.0, wdot = 0.0;
        for (int i = 0; i < k; i++) {
            S += p[ch[i]];
            wdot += (double)dwn[i] * wn[i];
        }
        /* dp: aux term on every expert, renormalisation on the chosen */
        for (int e = 0; e < E; e++)
            d[e] = aux_scale * frac[e];
        for (int i = 0; i < k; i++)
            d[ch[i]] += (float)(((double)dwn[i] - wdot) / S);
        /* softmax: dlogit = p * (dp - sum p dp) */
        double dot = 0.0;
        for (int e = 0; e < E; e++)
            dot += (double)p[e] * d[e];
        for (int e = 0; e < E; e++)
            d[e] = p[e] * (float)((double)d[e] - dot);
    }
}

/* ---------------------------------------------------------------- grouped gemm */

void nl_cpu_gemm_grouped(nl_backend *be, int trans_b, int N, int K, const float *A, int lda,
                         const float *B, int ldb, size_t b_stride, float *C, int ldc,
                         const int32_t *offsets, int groups, int max_rows)
{
    (void)max_rows;
    for (int g = 0; g < groups; g++) {
        const int n = offsets[g + 1] - offsets[g], o = offsets[g];
        if (n <= 0)
            continue;
        be->gemm(be, 0, trans_b, n, N, K, 1.0f, A + (size_t)o * lda, lda, B + g * b_stride, ldb,
                 0.0f, C + (size_t)o * ldc, ldc);
    }
}

void nl_cpu_gemm_grouped_wgrad(nl_backend *be, int M, int N, const float *A, int lda,
                               const float *B, int ldb, float *C, int ldc, size_t c_stride,
                               const int32_t *offsets, int groups)
{
    for (int g = 0; g < groups; g++) {
        const int n = offsets[g + 1] - offsets[g], o = offsets[g];
        if (n <= 0)
            continue;
        be->gemm(be, 1, 0, M, N, n, 1.0f, A + (size_t)o * lda, lda, B + (size_t)o * ldb, ldb, 1.0f,
                 C + g * c_stride, ldc);
    }
}

/* ---------------------------------------------------------------- fused expert FFN */

void nl_cpu_moe_ffn_forward(nl_backend *be, float *ye, float *hs, float *gu, const float *xe,
                            const float *experts, size_t expert_stride, int d, int F,
                            const int32_t *offsets, int groups, int max_rows)
{
    (void)max_rows;
    for (int g = 0; g < groups; g++) {
        const int n = offsets[g + 1] - offsets[g], o = offsets[g];
        if (n <= 0)
            continue;
        const float *wgu = experts + g * expert_stride, *wdown = wgu + 2 * (size_t)F * d;
        float *gug = gu + (size_t)o * 2 * F, *hsg = hs + (size_t)o * F;
        be->gemm(be, 0, 1, n, 2 * F, d, 1.0f, xe + (size_t)o * d, d, wgu, d, 0.0f, gug, 2 * F);
        be->swiglu_forward(be, hsg, gug, n, F); /* this group's rows, still in cache */
        be->gemm(be, 0, 1, n, d, F, 1.0f, hsg, F, wdown, F, 0.0f, ye + (size_t)o * d, d);
    }
}

void nl_cpu_moe_ffn_backward(nl_backend *be, float *dxe, float *dgu, float *dhs, float *dexperts,
                             const float *dye, const float *xe, const float *gu, const float *hs,
                             const float *experts, size_t expert_stride, int d, int F,
                             const int32_t *offsets, int groups)
{
    for (int g = 0; g < groups; g++) {
        const int n = offsets[g + 1] - offsets[g], o = offsets[g];
        if (n <= 0)
            continue;
        const size_t down = 2 * (size_t)F * d;
        const float *wgu = experts + g * expert_stride;
        float *dwgu = dexperts ? dexperts + g * expert_stride : NULL; /* NULL: a frozen base */
        const float *dyg = dye + (size_t)o * d, *xeg = xe + (size_t)o * d;
        const float *gug = gu + (size_t)o * 2 * F, *hsg = hs + (size_t)o * F;
        float *dhsg = dhs + (size_t)o * F, *dgug = dgu + (size_t)o * 2 * F;
        be->gemm(be, 0, 0, n, F, d, 1.0f, dyg, d, wgu + down, F, 0.0f, dhsg, F);
        if (dwgu)
            be->gemm(be, 1, 0, d, F, n, 1.0f, dyg, d, hsg, F, 1.0f, dwgu + down, F);
        be->swiglu_backward(be, dgug, dhsg, gug, n, F);
        if (dwgu)
            be->gemm(be, 1, 0, 2 * F, d, n, 1.0f, dgug, 2 * F, xeg, d, 1.0f, dwgu, d);
        be->gemm(be, 0, 0, n, d, 2 * F, 1.0f, dgug, 2 * F, wgu, d, 0.0f, dxe + (size_t)o * d, d);
    }
}

/* ---------------------------------------------------------------- fused decode */

/* The fused decode slots' reference: the separate slots' arithmetic in
 * their order, one (token, choice) at a time, with every product through
 * gemm_rows (the dot kernel, whose rows do not depend on M, as the
 * separate gemm's are below NL_CPU_DOT_ROWS rows) or, with bf16 GEMMs,
 * through gemm. So a decode step's bits do not change when core takes
 * the fused path. */
static void rows_product(nl_backend *be, int M, int N, int K, const float *A, int lda,
                         const float *B, int ldb, float *C, int ldc)
{
    if (be->gemm_rows)
        be->gemm_rows(be, 1, M, N, K, A, lda, B, ldb, 0, C, ldc);
    else
        be->gemm(be, 0, 1, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
}

void nl_cpu_moe_norm_route(nl_backend *be, float *xn, float *probs, int32_t *choice, float *w,
                           const float *x, const float *norm_w, const float *router, int N, int d,
                           int E, int k, float eps)
{
    if (E < 1 || E > NL_BACKEND_MAX_EXPERTS || k < 1 || k > E || N <= 0)
        return; /* outside the slot's contract */
    be->rmsnorm_forward(be, xn, NULL, x, norm_w, N, d, eps);
    rows_product(be, N, E, d, xn, d, router, d, probs, E);
    be->softmax_forward(be, probs, N, E);
    for (int n = 0; n < N; n++)
        nl_elem_topk_row(choice + (size_t)n * k, w + (size_t)n * k, probs + (size_t)n * E, E, k);
}

void nl_cpu_moe_gate_up(nl_backend *be, float *hs, float *gu, const float *xn,
                        const int32_t *choice, const float *experts, size_t expert_stride, int N,
                        int k, int d, int F)
{
    for (size_t r = 0; r < (size_t)N * k; r++) {
        const float *wgu = experts + (size_t)choice[r] * expert_stride; /* (2F, d) */
        float *gur = gu + r * 2 * F;
        rows_product(be, 1, 2 * F, d, xn + r / k * d, d, wgu, d, gur, 2 * F);
        be->swiglu_forward(be, hs + r * F, gur, 1, F);
    }
}

void nl_cpu_moe_down_combine(nl_backend *be, float *x, float *ye, const float *hs,
                             const int32_t *choice, const float *w, const float *experts,
                             size_t expert_stride, int N, int k, int d, int F)
{
    for (size_t r = 0; r < (size_t)N * k; r++) {
        const float *wd = experts + (size_t)choice[r] * expert_stride + 2 * (size_t)F * d;
        rows_product(be, 1, d, F, hs + r * F, F, wd, F, ye + r * d, d);
    }
    for (int n = 0; n < N; n++) { /* moe_combine's loop, slot n k + i */
        float *xr = x + (size_t)n * d;
        for (int i = 0; i < k; i++) {
            const float a = w[(size_t)n * k + i];
            const float *yr = ye + ((size_t)n * k + i) * d;
            for (int j = 0; j < d; j++)
                xr[j] += a * yr[j];
        }
    }
}
