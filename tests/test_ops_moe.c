/* The experts' forward slots of the backend table (kernels/backend.h):
 * moe_route and moe_aux against ref_route, the grouped GEMMs against naive
 * loops, and the fused decode slots against the separate calls they
 * replace (in FP32, and on the same device's bf16 backend where it has
 * one), on the backend named by argv[1] as test_ops.c's forward slots:
 * "cpu" (the default), "cpu-devsim" or "cuda:N". The harness, the
 * tolerances and the shared references are ops_harness.h. */
#include "tests/ops_harness.h"

/* ================================================================ routing */

/* Router probabilities from 8 levels, so rows have ties. */
static void tied_probs(float *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (float)(irand(8) + 1) / 8.0f;
}

static void test_moe_route(nl_backend *be, int N, int E, int k)
{
    const size_t np = (size_t)N * E, nk = (size_t)N * k;
    float *p = HF(np), *gw = HF(nk);
    double *rw = HD(nk), *raux = HD(1);
    int32_t *rch = HI(nk), *roff = HI(E + 1), *rperm = HI(nk), *rslot = HI(nk);
    int32_t *gch = HI(nk), *goff = HI(E + 1), *gperm = HI(nk), *gslot = HI(nk);
    float *gfrac = HF(E);
    int64_t *gcnt = hbuf((size_t)E * 8);
    double gaux = 0;
    float *d_p = dbuf(be, np * 4), *d_w = dbuf(be, nk * 4), *d_frac = dbuf(be, (size_t)E * 4);
    int32_t *d_ch = dbuf(be, nk * 4), *d_off = dbuf(be, (size_t)(E + 1) * 4);
    int32_t *d_perm = dbuf(be, nk * 4), *d_slot = dbuf(be, nk * 4);
    int64_t *d_cnt = dbuf(be, (size_t)E * 8);
    double *d_aux = dbuf(be, 8);
    if (!bufs_ok())
        goto done;
    tied_probs(p, np);
    ref_route(rch, rw, roff, rperm, rslot, p, N, E, k);
    be->upload(be, d_p, p, np * 4);
    be->moe_route(be, d_ch, d_w, d_off, d_perm, d_slot, d_p, N, E, k);
    be->download(be, gch, d_ch, nk * 4);
    be->download(be, gw, d_w, nk * 4);
    be->download(be, goff, d_off, (size_t)(E + 1) * 4);
    be->download(be, gperm, d_perm, nk * 4);
    be->download(be, gslot, d_slot, nk * 4);
    synced(be, "moe_route");
    expect_same(gch, rch, nk * 4, "moe_route N=%d E=%d k=%d choice", N, E, k);
    expect_same(goff, roff, (size_t)(E + 1) * 4, "moe_route N=%d E=%d k=%d offsets", N, E, k);
    expect_same(gperm, rperm, nk * 4, "moe_route N=%d E=%d k=%d perm", N, E, k);
    expect_same(gslot, rslot, nk * 4, "moe_route N=%d E=%d k=%d slot", N, E, k);
    expect(rel_err(gw, rw, nk), TOL_ELEM, "moe_route N=%d E=%d k=%d w", N, E, k);

    /* the aux loss of that routing, counts added to 5 each, onto aux 0.5 */
    raux[0] = 0;
    for (int e = 0; e < E; e++) {
        double ps = 0;
        for (int n = 0; n < N; n++)
            ps += p[(size_t)n * E + e];
        const double cnt = roff[e + 1] - roff[e];
        raux[0] += cnt / ((double)N * k) * ps / (2.0 * N);
        gcnt[e] = 5;
    }
    raux[0] = 0.5 + E * raux[0];
    gaux = 0.5;
    be->upload(be, d_aux, &gaux, 8);
    be->upload(be, d_cnt, gcnt, (size_t)E * 8);
    be->moe_aux(be, d_aux, d_frac, d_cnt, d_p, d_off, NULL, N, E, k, 2.0 * N);
    be->download(be, &gaux, d_aux, 8);
    be->download(be, gfrac, d_frac, (size_t)E * 4);
    be->download(be, gcnt, d_cnt, (size_t)E * 8);
    synced(be, "moe_aux");
    expect(fabs(gaux - raux[0]) / raux[0], TOL_RED, "moe_aux N=%d E=%d k=%d aux", N, E, k);
    int frac_ok = 1;
    for (int e = 0; e < E; e++)
        frac_ok &= gfrac[e] == (float)((double)(roff[e + 1] - roff[e]) / ((double)N * k)) &&
                   gcnt[e] == 5 + roff[e + 1] - roff[e];
    CHECK(frac_ok, "moe_aux N=%d E=%d k=%d: frac or counts differ", N, E, k);
done:
    release(be);
}

static void test_gemm_grouped(nl_backend *be)
{
    const int a[] = {3, 0, 70, 1}, b[] = {0, 0}, c[] = {5, 9, 2, 0, 4, 6, 1, 3}, d[] = {130};
    for (int tb = 0; tb < 2; tb++) {
        grouped_case(be, 0, tb, a, 4, 0, 33, 37);
        grouped_case(be, 0, tb, b, 2, 0, 5, 5);
        grouped_case(be, 0, tb, c, 8, 0, 100, 70);
        grouped_case(be, 0, tb, d, 1, 0, 65, 17);
    }
}

/* ================================================================ fused decode */

/* rel_err against a float reference */
static double rel_err_f(const float *got, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)got[i] - ref[i]);
        if (!isfinite(d))
            return INFINITY;
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return den > 0 ? num / den : num;
}

/* The fused decode slots against the separate calls they replace
 * (rmsnorm, router GEMM, softmax, moe_route, gather, grouped GEMMs,
 * SwiGLU, moe_combine) on the same inputs: equal choices, the rest within
 * the GEMM tolerance, and the same bits where the backend computes its
 * few-row products as gemm_rows does (a backend with gemm_rows: the CPU
 * in FP32, CUDA in FP32 and in bf16, there with the weights read from
 * their bf16 copies). With gemm_rows, the rows computed alone give the
 * bits of the rows computed together. */
static void test_fused_decode(nl_backend *be, int N, int d, int E, int k, int F)
{
    const size_t nd = (size_t)N * d, nk = (size_t)N * k, ne = (size_t)N * E;
    const size_t stride = 3 * (size_t)F * d, nx = (size_t)E * stride;
    float *x = HF(nd), *nw = HF(d), *rt = HF((size_t)E * d), *ex = HF(nx);
    float *ux = HF(nd), *uxn = HF(nd), *up = HF(ne), *uw = HF(nk), *fx = HF(nd), *fxn = HF(nd);
    float *fp = HF(ne), *fw = HF(nk), *ax = HF(nd);
    int32_t *uch = HI(nk), *fch = HI(nk);
    float *d_x = dbuf(be, nd * 4), *d_nw = dbuf(be, (size_t)d * 4),
          *d_rt = dbuf(be, (size_t)E * d * 4);
    float *d_ex = dbuf(be, nx * 4), *d_xn = dbuf(be, nd * 4), *d_p = dbuf(be, ne * 4);
    float *d_w = dbuf(be, nk * 4), *d_xe = dbuf(be, nk * d * 4), *d_gu = dbuf(be, nk * 2 * F * 4);
    float *d_hs = dbuf(be, nk * F * 4), *d_ye = dbuf(be, nk * d * 4);
    int32_t *d_ch = dbuf(be, nk * 4), *d_off = dbuf(be, (size_t)(E + 1) * 4);
    int32_t *d_perm = dbuf(be, nk * 4), *d_slot = dbuf(be, nk * 4);
    if (!bufs_ok())
        goto done;
    fill(x, nd, 1.0f);
    fill(nw, (size_t)d, 1.0f);
    fill(rt, (size_t)E * d, 1.0f);
    fill(ex, nx, 0.1f);
    be->upload(be, d_nw, nw, (size_t)d * 4);
    be->upload(be, d_rt, rt, (size_t)E * d * 4);
    be->upload(be, d_ex, ex, nx * 4);
    /* a bf16 backend reads them from their bf16 copies, as a model's */
    nl_error werr = {0};
    const int copies = be->bf16 && be->bf16_weights;
    if (copies) {
        CHECK_OK(be->bf16_weights(be, d_rt, (size_t)E * d, &werr), &werr);
        CHECK_OK(be->bf16_weights(be, d_ex, nx, &werr), &werr);
    }
    /* the separate calls */
    be->upload(be, d_x, x, nd * 4);
    be->rmsnorm_forward(be, d_xn, NULL, d_x, d_nw, N, d, 1e-5f);
    be->gemm(be, 0, 1, N, E, d, 1.0f, d_xn, d, d_rt, d, 0.0f, d_p, E);
    be->softmax_forward(be, d_p, N, E);
    be->moe_route(be, d_ch, d_w, d_off, d_perm, d_slot, d_p, N, E, k);
    be->gather_rows(be, d_xe, d_xn, d_perm, N * k, d);
    be->gemm_grouped(be, 1, 2 * F, d, d_xe, d, d_ex, d, stride, d_gu, 2 * F, d_off, E, N);
    be->swiglu_forward(be, d_hs, d_gu, N * k, F);
    be->gemm_grouped(be, 1, d, F, d_hs, F, d_ex + 2 * (size_t)F * d, F, stride, d_ye, d, d_off, E,
                     N);
    be->moe_combine(be, d_x, d_ye, d_slot, d_w, N, k, d);
    be->download(be, ux, d_x, nd * 4);
    be->download(be, uxn, d_xn, nd * 4);
    be->download(be, up, d_p, ne * 4);
    be->download(be, uw, d_w, nk * 4);
    be->download(be, uch, d_ch, nk * 4);
    /* the fused ones, all rows, then each row alone */
    for (int alone = -1; alone < N; alone++) {
        const int n0 = alone < 0 ? 0 : alone, rows = alone < 0 ? N : 1;
        be->upload(be, d_x, x + (size_t)n0 * d, (size_t)rows * d * 4);
        be->moe_norm_route(be, d_xn, d_p, d_ch, d_w, d_x, d_nw, d_rt, rows, d, E, k, 1e-5f);
        be->moe_gate_up(be, d_hs, d_gu, d_xn, d_ch, d_ex, stride, rows, k, d, F);
        be->moe_down_combine(be, d_x, d_ye, d_hs, d_ch, d_w, d_ex, stride, rows, k, d, F);
        be->download(be, (alone < 0 ? fx : ax) + (size_t)n0 * d, d_x, (size_t)rows * d * 4);
        if (alone >= 0)
            continue;
        be->download(be, fxn, d_xn, nd * 4);
        be->download(be, fp, d_p, ne * 4);
        be->download(be, fw, d_w, nk * 4);
        be->download(be, fch, d_ch, nk * 4);
    }
    synced(be, "fused decode");
    expect_same(fch, uch, nk * 4, "fused decode N=%d d=%d E=%d k=%d F=%d choice", N, d, E, k, F);
    /* a backend without gemm_rows (the CPU in bf16) computes a few rows
     * through gemm, whose bits depend on M: the batch pads them there */
    if (be->gemm_rows)
        expect_same(ax, fx, nd * 4, "fused decode N=%d d=%d E=%d k=%d F=%d: rows alone", N, d, E, k,
                    F);
    if (be->gemm_rows && N < NL_BACKEND_FUSED_ROWS) {
        expect_same(fx, ux, nd * 4, "fused decode N=%d d=%d E=%d k=%d F=%d: bits", N, d, E, k, F);
        expect_same(fp, up, ne * 4, "fused decode N=%d d=%d E=%d k=%d F=%d: probs bits", N, d, E, k,
                    F);
    }
    expect(rel_err_f(fxn, uxn, nd), TOL_RED, "fused decode N=%d d=%d: xn", N, d);
    expect(rel_err_f(fp, up, ne), TOL_GEMM * sqrt((double)d), "fused decode N=%d E=%d: probs", N,
           E);
    expect(rel_err_f(fw, uw, nk), TOL_GEMM * sqrt((double)d), "fused decode N=%d k=%d: w", N, k);
    expect(rel_err_f(fx, ux, nd), TOL_GEMM * sqrt((double)(d + F)), "fused decode N=%d F=%d: x", N,
           F);
    if (copies) {
        be->bf16_weights(be, d_rt, 0, NULL);
        be->bf16_weights(be, d_ex, 0, NULL);
    }
done:
    release(be);
}

static void test_fused(nl_backend *be)
{
    if (!be->moe_norm_route) {
        printf("test_ops_moe: %s has no fused decode slots\n", be->name);
        return;
    }
    test_fused_decode(be, 1, 64, 8, 2, 96);
    test_fused_decode(be, 3, 37, 5, 3, 19); /* odd widths */
    test_fused_decode(be, 15, 128, 16, 4, 200);
    test_fused_decode(be, 2, 300, 256, 2, 33); /* the most experts */
    test_fused_decode(be, 20, 64, 8, 2, 64);   /* past the decode's rows */
    /* and the same device's bf16 backend, where it has one */
    nl_backend *b16 = NULL;
    nl_error err = {0};
    if (nl_backend_new(&b16, be->name, &(nl_backend_opts){.threads = 2, .bf16 = 1}, &err) !=
        NL_OK) {
        printf("test_ops_moe: %s in bf16: %s: fused decode in bf16 skipped\n", be->name, err.msg);
        return;
    }
    if (b16->moe_norm_route) {
        test_fused_decode(b16, 1, 64, 8, 2, 96);
        test_fused_decode(b16, 15, 128, 16, 4, 200);
        test_fused_decode(b16, 20, 64, 8, 2, 64);
    } else {
        printf("test_ops_moe: %s in bf16 has no fused decode slots\n", b16->name);
    }
    nl_backend_destroy(&b16);
}

static void moe_slots(nl_backend *be)
{
    test_moe_route(be, 1, 8, 2);
    test_moe_route(be, 70, 8, 2);
    test_moe_route(be, 300, 16, 4);
    test_moe_route(be, 5, 3, 3);
    test_moe_route(be, 33, 256, 2);
    test_gemm_grouped(be);
    test_fused(be);
}

int main(int argc, char **argv)
{
    return ops_main(argc, argv, "test_ops_moe", moe_slots, false);
}
