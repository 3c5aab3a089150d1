/* neuroctl selftest, the fused decode slots (kernels/backend.h):
 * moe_norm_route (RMSNorm + router logits + softmax + top-k), moe_gate_up
 * (gate/up + SwiGLU) and moe_down_combine (down projection + weighted
 * combine + residual add), chained as a decode layer runs them, on the
 * target against the reference backend over decode shapes (1 to 15 rows,
 * odd widths, up to 256 experts). The choices must be equal; xn and the
 * weights are judged as norms and softmax (1e-5), the products as GEMMs
 * of their inner size. A target that leaves the slots NULL (CUDA in bf16
 * mode) gets a skip line, as does a bf16 run (its products are bf16 GEMMs:
 * the model checks judge them). */
#include <stdio.h>

#include "cli/selftest.h"

static double err_i32(nl_selftest *c, const pair *p, size_t n)
{
    const int32_t *r = nl_selftest_down(c, p, 0), *t = nl_selftest_down(c, p, 1);
    if (!r || !t)
        return INFINITY;
    for (size_t i = 0; i < n; i++)
        if (r[i] != t[i])
            return INFINITY;
    return 0.0;
}

static void check_fused(nl_selftest *c, int N, int d, int E, int k, int F)
{
    char shape[80];
    snprintf(shape, sizeof shape, "N=%d d=%d E=%d k=%d F=%d", N, d, E, k, F);
    const size_t nk = (size_t)N * k, stride = 3 * (size_t)F * d;
    pair *x = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)N * d, -1, 1), (size_t)N * d * 4);
    pair *nw = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)d, 0.5, 1.5), (size_t)d * 4);
    pair *rt = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)E * d, -1, 1), (size_t)E * d * 4);
    pair *ex = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)E * stride, -0.1, 0.1),
                               (size_t)E * stride * 4);
    pair *xn = nl_selftest_dev(c, NULL, (size_t)N * d * 4);
    pair *p = nl_selftest_dev(c, NULL, (size_t)N * E * 4), *ch = nl_selftest_dev(c, NULL, nk * 4);
    pair *w = nl_selftest_dev(c, NULL, nk * 4), *gu = nl_selftest_dev(c, NULL, nk * 2 * F * 4);
    pair *hs = nl_selftest_dev(c, NULL, nk * F * 4), *ye = nl_selftest_dev(c, NULL, nk * d * 4);
    double e_route = INFINITY, e_hs = INFINITY;
    if (!c->oom) {
        BOTH(c, be->moe_norm_route(be, D(xn), D(p), D(ch), D(w), D(x), D(nw), D(rt), N, d, E, k,
                                   1e-5f));
        BOTH(c, be->moe_gate_up(be, D(hs), D(gu), D(xn), D(ch), D(ex), stride, N, k, d, F));
        BOTH(c,
             be->moe_down_combine(be, D(x), D(ye), D(hs), D(ch), D(w), D(ex), stride, N, k, d, F));
        e_route = max2(err_i32(c, ch, nk),
                       max2(nl_selftest_cmp(c, xn, (size_t)N * d), nl_selftest_cmp(c, w, nk)));
        e_hs = nl_selftest_cmp(c, hs, nk * F);
    }
    nl_selftest_line(c, !c->oom && e_route <= TOL_RED, "moe_norm_route", shape, e_route, TOL_RED,
                     NULL);
    nl_selftest_line(c, !c->oom && e_hs <= nl_selftest_tol_gemm(c, d), "moe_gate_up", shape, e_hs,
                     nl_selftest_tol_gemm(c, d), NULL);
    nl_selftest_done(c, "moe_down_combine", shape,
                     c->oom ? INFINITY : nl_selftest_cmp(c, x, (size_t)N * d),
                     nl_selftest_tol_gemm(c, F));
}

void nl_selftest_fused(nl_selftest *c)
{
    if (!c->be[1]->moe_norm_route || !c->be[0]->moe_norm_route || c->bf16) {
        printf("skip  %-22s  %-46s  (%s)\n", "fused decode slots", "",
               c->bf16 ? "a bf16 run" : "not on the target");
        return;
    }
    check_fused(c, 1, 128, 8, 2, 96);
    check_fused(c, 3, 67, 5, 3, 33);
    check_fused(c, 15, 256, 16, 4, 300);
    check_fused(c, 2, 64, 256, 2, 40);
}
