/* Every forward slot of the backend table (kernels/backend.h) against a
 * naive reference loop written here (plain C, double accumulation), on the
 * backend named by argv[1]: "cpu" (the default), "cpu-devsim" or "cuda:N".
 * All data goes through upload and download, never through a host
 * dereference of device memory, so the one program checks any device. The
 * experts' slots (routing, grouped GEMMs, the fused decode slots) are
 * test_ops_moe.c's, the backward and optimizer slots test_ops_train.c's;
 * the harness, the tolerances and the shared references are
 * ops_harness.h. */
#include "tests/ops_harness.h"

/* ================================================================ memory */

static void test_memory(nl_backend *be)
{
    const size_t n = (1u << 20) + 13; /* bytes: not a multiple of anything */
    uint8_t *a = hbuf(n), *b = hbuf(n), *got = hbuf(n), *z = hbuf(n);
    float *row = HF(64), *rowb = HF(64), *rowgot = HF(64);
    uint8_t *d1 = dbuf(be, n), *d2 = dbuf(be, n);
    float *r1 = dbuf(be, 64 * 4), *r2 = dbuf(be, 64 * 4);
    if (!bufs_ok())
        goto done;
    for (size_t i = 0; i < n; i++)
        a[i] = (uint8_t)irand(256), b[i] = (uint8_t)irand(256);

    /* alloc zero-fills */
    be->download(be, got, d1, n);
    expect_same(got, z, n, "alloc: %zu bytes not zero", n);

    /* round trip, and the host source is reusable as soon as upload returns */
    memcpy(got, a, n);
    be->upload(be, d1, got, n);
    memcpy(got, b, n);
    be->upload(be, d2, got, n);
    memset(got, 0, n);
    be->download(be, got, d1, n);
    expect_same(got, a, n, "upload/download round trip of %zu bytes", n);
    be->download(be, got, d2, n);
    expect_same(got, b, n, "second upload from a reused host buffer");

    /* at byte offsets, odd lengths */
    be->upload(be, d1 + 7, b + 100, 1001);
    memcpy(a + 7, b + 100, 1001);
    be->download(be, got, d1, n);
    expect_same(got, a, n, "upload of 1001 bytes at offset 7");
    memset(got, 0, 333);
    be->download(be, got, d2 + 5, 333);
    expect_same(got, b + 5, 333, "download of 333 bytes at offset 5");

    /* ordering: an upload into a buffer that a queued op still reads runs
     * after the op */
    fill(row, 64, 1.0f);
    fill(rowb, 64, 1.0f);
    be->upload(be, r1, row, 64 * 4);
    be->copy_rows(be, r2, 64, r1, 64, 1, 64);
    be->upload(be, r1, rowb, 64 * 4);
    be->download(be, rowgot, r2, 64 * 4);
    expect_same(rowgot, row, 64 * 4, "op queued before an upload into its source");
    synced(be, "memory");
done:
    release(be);
}

static void test_zero(nl_backend *be)
{
    const size_t nf = (1u << 20) + 77; /* floats: > 4 MiB, several CPU chunks */
    float *x = HF(nf), *got = HF(nf), *want = HF(nf);
    float *d = dbuf(be, nf * 4);
    if (!bufs_ok())
        goto done;
    fill_val(x, nf, NAN);
    x[5] = INFINITY;
    be->upload(be, d, x, nf * 4);
    /* float-aligned range, then an odd byte range, then nearly all of it */
    const size_t ranges[3][2] = {{3 * 4, 517 * 4}, {2100 * 4 + 1, 13}, {64, nf * 4 - 128}};
    memcpy(want, x, nf * 4);
    for (int i = 0; i < 3; i++) {
        be->zero(be, (char *)d + ranges[i][0], ranges[i][1]);
        memset((char *)want + ranges[i][0], 0, ranges[i][1]);
        be->download(be, got, d, nf * 4);
        expect_same(got, want, nf * 4, "zero %zu bytes at byte %zu of NaN", ranges[i][1],
                    ranges[i][0]);
    }
    synced(be, "zero");
done:
    release(be);
}

/* ================================================================ gemm */

/* C = alpha op(A) op(B) + beta C with row strides `pad` floats longer than
 * needed. Padding of A and B holds NaN (must not be read), padding of C a
 * sentinel (must not be written); beta = 0 puts NaN in C (must not be read). */
static void gemm_case(nl_backend *be, int ta, int tb, int M, int N, int K, int pad, float alpha,
                      float beta)
{
    const int aw = ta ? M : K, bw = tb ? K : N; /* stored row widths */
    const int lda = aw + pad, ldb = bw + pad, ldc = N + pad;
    const size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb;
    const size_t nc = (size_t)M * ldc;
    float *A = HF(na), *B = HF(nb), *C = HF(nc), *got = HF(nc);
    double *ref = HD(nc), *bound = HD(nc);
    float *dA = dbuf(be, na * 4), *dB = dbuf(be, nb * 4), *dC = dbuf(be, nc * 4);
    if (!bufs_ok())
        goto done;
    for (size_t i = 0; i < na; i++)
        A[i] = (int)(i % lda) < aw ? frand() : NAN;
    for (size_t i = 0; i < nb; i++)
        B[i] = (int)(i % ldb) < bw ? frand() : NAN;
    for (size_t i = 0; i < nc; i++)
        C[i] = (int)(i % ldc) >= N ? 777.0f : beta == 0.0f ? NAN : frand();
    for (int i = 0; i < M; i++)
        for (int j = 0; j < ldc; j++) {
            const size_t c = (size_t)i * ldc + j;
            if (j >= N) {
                ref[c] = C[c], bound[c] = 0;
                continue;
            }
            double s = 0, sa = 0;
            for (int p = 0; p < K; p++) {
                double a = ta ? A[(size_t)p * lda + i] : A[(size_t)i * lda + p];
                double b = tb ? B[(size_t)j * ldb + p] : B[(size_t)p * ldb + j];
                s += a * b;
                sa += fabs(a * b);
            }
            const double c0 = beta == 0.0f ? 0.0 : (double)beta * C[c];
            ref[c] = (double)alpha * s + c0;
            bound[c] = fabs((double)alpha) * sa + fabs(c0);
        }
    be->upload(be, dA, A, na * 4);
    be->upload(be, dB, B, nb * 4);
    be->upload(be, dC, C, nc * 4);
    be->gemm(be, ta, tb, M, N, K, alpha, dA, lda, dB, ldb, beta, dC, ldc);
    be->download(be, got, dC, nc * 4);
    synced(be, "gemm");
    /* error in units of |alpha| |A||B| + |beta C|, scaled by sqrt(K) */
    const double sk = sqrt(K > 1 ? (double)K : 1.0);
    double e = 0;
    for (size_t c = 0; c < nc; c++) {
        const double d = fabs((double)got[c] - ref[c]);
        const double r = d == 0 ? 0 : bound[c] > 0 ? d / (bound[c] * sk) : INFINITY;
        e = isnan(r) ? INFINITY : r > e ? r : e;
    }
    expect(e, TOL_GEMM, "gemm ta=%d tb=%d M=%d N=%d K=%d pad=%d alpha=%g beta=%g", ta, tb, M, N, K,
           pad, alpha, beta);
done:
    release(be);
}

static void test_gemm(nl_backend *be)
{
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            gemm_case(be, ta, tb, 7, 13, 29, 0, 0.5f, 2.0f);
            gemm_case(be, ta, tb, 33, 17, 65, 3, 1.0f, 0.0f);
            gemm_case(be, ta, tb, 67, 130, 257, 5, -1.5f, 1.0f);
            gemm_case(be, ta, tb, 5, 6, 0, 2, 1.0f, 0.5f); /* K = 0: C = beta C */
            gemm_case(be, ta, tb, 5, 6, 0, 1, 1.0f, 0.0f); /* K = 0, beta = 0: C = 0 */
            gemm_case(be, ta, tb, 1, 40, 37, 1, 1.0f, 1.0f);
            gemm_case(be, ta, tb, 40, 1, 37, 2, 1.0f, 0.0f);
            gemm_case(be, ta, tb, 1, 1, 300, 0, 2.0f, -1.0f);
        }
}

/* ================================================================ forward ops */

static void test_embedding_forward(nl_backend *be, int V, int C, int N)
{
    float *table = HF((size_t)V * C), *got = HF((size_t)N * C), *want = HF((size_t)N * C);
    int32_t *tok = HI(N);
    float *dt = dbuf(be, (size_t)V * C * 4), *dout = dbuf(be, (size_t)N * C * 4);
    int32_t *dtok = dbuf(be, (size_t)N * 4);
    if (!bufs_ok())
        goto done;
    fill(table, (size_t)V * C, 1.0f);
    for (int n = 0; n < N; n++)
        tok[n] = n == 0 ? V - 1 : n == N - 1 ? 0 : irand(V);
    for (int n = 0; n < N; n++)
        memcpy(want + (size_t)n * C, table + (size_t)tok[n] * C, (size_t)C * 4);
    be->upload(be, dt, table, (size_t)V * C * 4);
    be->upload(be, dtok, tok, (size_t)N * 4);
    be->embedding_forward(be, dout, dtok, dt, N, C);
    be->download(be, got, dout, (size_t)N * C * 4);
    synced(be, "embedding_forward");
    expect_same(got, want, (size_t)N * C * 4, "embedding_forward V=%d C=%d N=%d", V, C, N);
done:
    release(be);
}

static void test_rmsnorm_forward(nl_backend *be, int N, int C)
{
    const size_t nx = (size_t)N * C;
    const float eps = 1e-5f;
    float *x = HF(nx), *w = HF(C), *got = HF(nx), *rstd = HF(N);
    double *ref = HD(nx), *rref = HD(N);
    float *dx = dbuf(be, nx * 4), *dw = dbuf(be, (size_t)C * 4);
    float *dy = dbuf(be, nx * 4), *dy2 = dbuf(be, nx * 4);
    float *dr = dbuf(be, (size_t)N * 4);
    if (!bufs_ok())
        goto done;
    fill(x, nx, 3.0f);
    fill(w, C, 2.0f);
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int i = 0; i < C; i++)
            ss += (double)x[(size_t)n * C + i] * x[(size_t)n * C + i];
        rref[n] = 1.0 / sqrt(ss / C + (double)eps);
        for (int i = 0; i < C; i++)
            ref[(size_t)n * C + i] = x[(size_t)n * C + i] * rref[n] * w[i];
    }
    be->upload(be, dx, x, nx * 4);
    be->upload(be, dw, w, (size_t)C * 4);
    be->rmsnorm_forward(be, dy, dr, dx, dw, N, C, eps);
    be->rmsnorm_forward(be, dy2, NULL, dx, dw, N, C, eps);
    be->download(be, got, dy, nx * 4);
    be->download(be, rstd, dr, (size_t)N * 4);
    synced(be, "rmsnorm_forward");
    expect(rel_err_rows(got, ref, N, C), TOL_RED, "rmsnorm_forward N=%d C=%d out", N, C);
    expect(rel_err(rstd, rref, N), TOL_RED, "rmsnorm_forward N=%d C=%d rstd", N, C);
    be->download(be, got, dy2, nx * 4);
    synced(be, "rmsnorm_forward");
    expect(rel_err_rows(got, ref, N, C), TOL_RED, "rmsnorm_forward N=%d C=%d rstd=NULL", N, C);
done:
    release(be);
}

/* Rotate `heads` heads of hd starting at column col0 of rows of `row`
 * floats; the columns outside them must not change. */
static void test_rope(nl_backend *be, int col0, int heads, int hd, int extra, float base)
{
    enum { N = 7 };
    const int32_t pos[N] = {0, 1, 2, 999, 1001, 4097, 30011};
    const int row = col0 + heads * hd + extra;
    const size_t nx = (size_t)N * row;
    float *x = HF(nx), *got = HF(nx);
    double *ref = HD(nx);
    float *dx = dbuf(be, nx * 4);
    int32_t *dpos = dbuf(be, sizeof pos);
    if (!bufs_ok())
        goto done;
    fill(x, nx, 2.0f);
    for (size_t i = 0; i < nx; i++)
        ref[i] = x[i];
    for (int n = 0; n < N; n++)
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < hd / 2; i++) {
                const size_t c = (size_t)n * row + col0 + (size_t)h * hd + 2 * i;
                const double ang = pos[n] * pow((double)base, -2.0 * i / hd);
                ref[c] = x[c] * cos(ang) - x[c + 1] * sin(ang);
                ref[c + 1] = x[c] * sin(ang) + x[c + 1] * cos(ang);
            }
    be->upload(be, dx, x, nx * 4);
    be->upload(be, dpos, pos, sizeof pos);
    be->rope_forward(be, dx, dpos, N, row, col0, heads, hd, base);
    be->download(be, got, dx, nx * 4);
    synced(be, "rope_forward");
    expect(rel_err(got, ref, nx), TOL_ELEM, "rope_forward col0=%d heads=%d hd=%d base=%g", col0,
           heads, hd, base);
    int moved = 0;
    for (int n = 0; n < N; n++)
        for (int c = 0; c < row; c++)
            if (c < col0 || c >= col0 + heads * hd)
                moved += got[(size_t)n * row + c] != x[(size_t)n * row + c];
    CHECK(moved == 0, "rope_forward col0=%d heads=%d hd=%d: %d floats outside the heads changed",
          col0, heads, hd, moved);
done:
    release(be);
}

static void test_attention_forward(nl_backend *be, int B, int T, int past, int H, int G, int hd,
                                   int pad, int want_lse)
{
    const nl_attn_shape s = {
        .B = B, .T = T, .past = past, .kv_cap = past + T + 5, .H = H, .G = G, .hd = hd};
    const int qs = H * hd + pad, ks = G * hd + 2 * pad;
    const size_t nq = (size_t)B * T * qs, nk = (size_t)B * s.kv_cap * ks;
    const size_t no = (size_t)B * T * H * hd, nl = (size_t)B * H * T;
    float *q = HF(nq), *k = HF(nk), *v = HF(nk), *got = HF(no), *lse = HF(nl);
    double *ref = HD(no), *lref = HD(nl), *p = HD(s.kv_cap);
    float *dq = dbuf(be, nq * 4), *dk = dbuf(be, nk * 4), *dv = dbuf(be, nk * 4);
    float *dout = dbuf(be, no * 4), *dl = dbuf(be, nl * 4);
    if (!bufs_ok())
        goto done;
    attn_inputs(q, qs, k, v, ks, &s);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++)
                lref[((size_t)b * H + h) * T + t] = ref_attn_row(
                    p, ref + (((size_t)b * T + t) * H + h) * hd, q, qs, k, v, ks, &s, b, h, t);
    be->upload(be, dq, q, nq * 4);
    be->upload(be, dk, k, nk * 4);
    be->upload(be, dv, v, nk * 4);
    be->attention_forward(be, dout, want_lse ? dl : NULL, dq, qs, dk, dv, ks, s);
    be->download(be, got, dout, no * 4);
    be->download(be, lse, dl, nl * 4);
    synced(be, "attention_forward");
    expect(rel_err(got, ref, no), TOL_RED,
           "attention_forward B=%d T=%d past=%d kv_cap=%d H=%d G=%d hd=%d lse=%s", B, T, past,
           s.kv_cap, H, G, hd, want_lse ? "yes" : "NULL");
    if (want_lse)
        expect(rel_err(lse, lref, nl), TOL_RED,
               "attention_forward B=%d T=%d past=%d H=%d G=%d "
               "hd=%d lse",
               B, T, past, H, G, hd);
done:
    release(be);
}

/* Whether query t (absolute i = past + t) of sequence b sees key j under
 * a DESIGN section 6 mask, written from the definition (a masked global
 * reference, no ranges). */
static int ref_visible(const nl_attn_mask *mk, const int32_t *doc, const nl_attn_shape *s, int b,
                       int t, int j)
{
    const int i = s->past + t, W = mk->window;
    if (j >= s->past + s->T || (!mk->bidir && j > i))
        return 0;
    if (W > 0 && !mk->bidir && j <= i - W)
        return 0;
    if (W > 0 && mk->bidir && abs(i - j) > W / 2)
        return 0;
    return !doc || doc[b * s->T + t] == doc[b * s->T + j];
}

/* attention_masked_forward against the masked global reference: causal
 * or bidirectional, with or without a window, with or without packed
 * documents (past 0 then). */
static void test_attention_masked(nl_backend *be, int B, int T, int past, int H, int G, int hd,
                                  int bidir, int window, int docs)
{
    if (!be->attention_masked_forward) {
        printf("attention_masked_forward: not on %s (refused at model creation)\n", be->name);
        return;
    }
    const nl_attn_shape s = {
        .B = B, .T = T, .past = past, .kv_cap = past + T + 3, .H = H, .G = G, .hd = hd};
    const int qs = H * hd, ks = G * hd;
    const size_t nq = (size_t)B * T * qs, nk = (size_t)B * s.kv_cap * ks;
    const size_t no = (size_t)B * T * H * hd, nl = (size_t)B * H * T;
    float *q = HF(nq), *k = HF(nk), *v = HF(nk), *got = HF(no), *lse = HF(nl);
    int32_t *doc = docs ? hbuf((size_t)B * T * 4) : NULL;
    double *ref = HD(no), *lref = HD(nl), *p = HD(s.kv_cap);
    float *dq = dbuf(be, nq * 4), *dk = dbuf(be, nk * 4), *dv = dbuf(be, nk * 4);
    float *dout = dbuf(be, no * 4), *dl = dbuf(be, nl * 4);
    int32_t *ddoc = docs ? dbuf(be, (size_t)B * T * 4) : NULL;
    if (!bufs_ok())
        goto done;
    attn_inputs(q, qs, k, v, ks, &s);
    for (int b = 0; b < B; b++) /* runs of 1 .. 2T/docs positions */
        for (int t = 0, id = 0; docs && t < T; t++) {
            id += t > 0 && irand(T / docs) == 0;
            doc[b * T + t] = id;
        }
    nl_attn_mask mk = {.bidir = bidir, .window = window, .doc = ddoc};
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                const int g = h / (H / G);
                const float *qr = q + ((size_t)b * T + t) * qs + (size_t)h * hd;
                double m = -INFINITY, l = 0;
                for (int j = 0; j < s.kv_cap; j++) {
                    p[j] = -INFINITY;
                    if (!ref_visible(&mk, doc, &s, b, t, j))
                        continue;
                    double d = 0;
                    for (int c = 0; c < hd; c++)
                        d += (double)qr[c] * k[((size_t)b * s.kv_cap + j) * ks + g * hd + c];
                    p[j] = d / sqrt((double)hd);
                    m = p[j] > m ? p[j] : m;
                }
                for (int j = 0; j < s.kv_cap; j++)
                    l += p[j] = exp(p[j] - m);
                double *o = ref + (((size_t)b * T + t) * H + h) * hd;
                for (int c = 0; c < hd; c++) {
                    double a = 0;
                    for (int j = 0; j < s.kv_cap; j++)
                        a += p[j] / l * v[((size_t)b * s.kv_cap + j) * ks + g * hd + c];
                    o[c] = a;
                }
                lref[((size_t)b * H + h) * T + t] = m + log(l);
            }
    be->upload(be, dq, q, nq * 4);
    be->upload(be, dk, k, nk * 4);
    be->upload(be, dv, v, nk * 4);
    if (docs)
        be->upload(be, ddoc, doc, (size_t)B * T * 4);
    be->attention_masked_forward(be, dout, dl, dq, qs, dk, dv, ks, s, mk);
    be->download(be, got, dout, no * 4);
    be->download(be, lse, dl, nl * 4);
    synced(be, "attention_masked_forward");
    expect(rel_err(got, ref, no), TOL_RED,
           "attention_masked_forward B=%d T=%d past=%d H=%d G=%d hd=%d bidir=%d window=%d docs=%d",
           B, T, past, H, G, hd, bidir, window, docs);
    expect(rel_err(lse, lref, nl), TOL_RED, "attention_masked_forward lse T=%d bidir=%d window=%d",
           T, bidir, window);
done:
    release(be);
}

static void test_softmax(nl_backend *be, int N, int C, float offset, float amp)
{
    const size_t nx = (size_t)N * C;
    float *x = HF(nx), *got = HF(nx);
    double *ref = HD(nx);
    float *dx = dbuf(be, nx * 4);
    if (!bufs_ok())
        goto done;
    for (size_t i = 0; i < nx; i++)
        x[i] = offset + amp * frand();
    for (int n = 0; n < N; n++) {
        const float *r = x + (size_t)n * C;
        double m = -INFINITY, l = 0;
        for (int i = 0; i < C; i++)
            m = r[i] > m ? r[i] : m;
        for (int i = 0; i < C; i++)
            l += exp(r[i] - m);
        for (int i = 0; i < C; i++)
            ref[(size_t)n * C + i] = exp(r[i] - m) / l;
    }
    be->upload(be, dx, x, nx * 4);
    be->softmax_forward(be, dx, N, C);
    be->download(be, got, dx, nx * 4);
    synced(be, "softmax_forward");
    expect(rel_err_rows(got, ref, N, C), TOL_RED, "softmax_forward N=%d C=%d values %g +- %g", N, C,
           offset, amp);
done:
    release(be);
}

static void test_swiglu_forward(nl_backend *be, int N, int F)
{
    const size_t ng = (size_t)N * 2 * F, no = (size_t)N * F;
    float *gu = HF(ng), *got = HF(no);
    double *ref = HD(no);
    float *dgu = dbuf(be, ng * 4), *dout = dbuf(be, no * 4);
    if (!bufs_ok())
        goto done;
    fill(gu, ng, 6.0f);
    gu[0] = 30.0f, gu[1] = -30.0f, gu[2] = -100.0f; /* saturated gates */
    for (int n = 0; n < N; n++)
        for (int j = 0; j < F; j++) {
            const double g = gu[(size_t)n * 2 * F + j], u = gu[(size_t)n * 2 * F + F + j];
            ref[(size_t)n * F + j] = g / (1.0 + exp(-g)) * u;
        }
    be->upload(be, dgu, gu, ng * 4);
    be->swiglu_forward(be, dout, dgu, N, F);
    be->download(be, got, dout, no * 4);
    synced(be, "swiglu_forward");
    expect(rel_err(got, ref, no), TOL_ELEM, "swiglu_forward N=%d F=%d", N, F);
done:
    release(be);
}

static void test_gather_rows(nl_backend *be, int R, int C, int n)
{
    float *src = HF((size_t)R * C), *got = HF((size_t)n * C), *want = HF((size_t)n * C);
    int32_t *idx = HI(n);
    float *ds = dbuf(be, (size_t)R * C * 4), *dout = dbuf(be, (size_t)n * C * 4);
    int32_t *di = dbuf(be, (size_t)n * 4);
    if (!bufs_ok())
        goto done;
    fill(src, (size_t)R * C, 1.0f);
    for (int i = 0; i < n; i++) {
        idx[i] = i == 0 ? R - 1 : irand(R);
        memcpy(want + (size_t)i * C, src + (size_t)idx[i] * C, (size_t)C * 4);
    }
    be->upload(be, ds, src, (size_t)R * C * 4);
    be->upload(be, di, idx, (size_t)n * 4);
    be->gather_rows(be, dout, ds, di, n, C);
    be->download(be, got, dout, (size_t)n * C * 4);
    synced(be, "gather_rows");
    expect_same(got, want, (size_t)n * C * 4, "gather_rows R=%d C=%d n=%d", R, C, n);
done:
    release(be);
}

static void test_copy_rows(nl_backend *be, int rows, int cols, int dst_stride, int src_stride)
{
    const size_t nd = (size_t)rows * dst_stride, ns = (size_t)rows * src_stride;
    float *src = HF(ns), *dst = HF(nd), *got = HF(nd);
    float *ddst = dbuf(be, nd * 4), *dsrc = dbuf(be, ns * 4);
    if (!bufs_ok())
        goto done;
    fill(src, ns, 1.0f);
    fill_val(dst, nd, -7.0f);
    be->upload(be, dsrc, src, ns * 4);
    be->upload(be, ddst, dst, nd * 4);
    for (int r = 0; r < rows; r++)
        memcpy(dst + (size_t)r * dst_stride, src + (size_t)r * src_stride, (size_t)cols * 4);
    be->copy_rows(be, ddst, dst_stride, dsrc, src_stride, rows, cols);
    be->download(be, got, ddst, nd * 4);
    synced(be, "copy_rows");
    expect_same(got, dst, nd * 4, "copy_rows rows=%d cols=%d dst_stride=%d src_stride=%d", rows,
                cols, dst_stride, src_stride);
done:
    release(be);
}

static void test_moe_combine(nl_backend *be, int N, int k, int C)
{
    const size_t nx = (size_t)N * C, ny = (size_t)N * k * C, nw = (size_t)N * k;
    float *x = HF(nx), *y = HF(ny), *w = HF(nw), *got = HF(nx);
    int32_t *slot = HI(nw);
    double *ref = HD(nx);
    float *dx = dbuf(be, nx * 4), *dy = dbuf(be, ny * 4), *dw = dbuf(be, nw * 4);
    int32_t *ds = dbuf(be, nw * 4);
    if (!bufs_ok())
        goto done;
    fill(x, nx, 1.0f);
    fill(y, ny, 1.0f);
    fill(w, nw, 1.0f);
    permute(slot, (int)nw);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            double a = x[(size_t)n * C + c];
            for (int i = 0; i < k; i++)
                a += (double)w[(size_t)n * k + i] * y[(size_t)slot[(size_t)n * k + i] * C + c];
            ref[(size_t)n * C + c] = a;
        }
    be->upload(be, dx, x, nx * 4);
    be->upload(be, dy, y, ny * 4);
    be->upload(be, dw, w, nw * 4);
    be->upload(be, ds, slot, nw * 4);
    be->moe_combine(be, dx, dy, ds, dw, N, k, C);
    be->download(be, got, dx, nx * 4);
    synced(be, "moe_combine");
    expect(rel_err(got, ref, nx), TOL_ELEM, "moe_combine N=%d k=%d C=%d", N, k, C);
done:
    release(be);
}

static void forward_slots(nl_backend *be)
{
    test_memory(be);
    test_zero(be);
    test_gemm(be);
    test_embedding_forward(be, 50, 37, 23);
    test_embedding_forward(be, 3, 8, 1);
    test_embedding_forward(be, 1000, 64, 130);
    test_rmsnorm_forward(be, 1, 1);
    test_rmsnorm_forward(be, 5, 37);
    test_rmsnorm_forward(be, 70, 1000);
    test_rope(be, 0, 1, 16, 0, 10000.0f);
    test_rope(be, 2 * 64 + 8, 3, 64, 4, 10000.0f); /* the k heads of a fused qkv row */
    test_rope(be, 64, 2, 128, 0, 500000.0f);
    /* attention: B, T, past, H, G, hd, row padding, lse */
    test_attention_forward(be, 2, 19, 0, 4, 4, 16, 0, 1);
    test_attention_masked(be, 1, 300, 0, 2, 1, 16, 0, 64, 0); /* causal window */
    test_attention_masked(be, 1, 300, 0, 2, 1, 16, 1, 64, 0); /* bidirectional window */
    test_attention_masked(be, 2, 77, 0, 4, 2, 8, 1, 0, 0);    /* encoder */
    test_attention_masked(be, 2, 90, 0, 4, 2, 8, 1, 0, 3);    /* packed encoder */
    test_attention_masked(be, 2, 90, 0, 4, 2, 8, 0, 20, 3);   /* packed local decoder */
    test_attention_masked(be, 2, 5, 40, 4, 2, 8, 0, 16, 0);   /* windowed decode with a cache */
    test_attention_forward(be, 2, 37, 45, 8, 2, 64, 4, 1);
    test_attention_forward(be, 2, 21, 3, 4, 1, 16, 8, 0);
    test_attention_forward(be, 2, 1, 1030, 4, 1, 64, 4, 1); /* a decode step */
    test_attention_forward(be, 2, 3, 1030, 8, 2, 64, 0, 0);
    test_attention_forward(be, 1, 70, 0, 2, 2, 64, 0, 1);
    test_attention_forward(be, 2, 5, 17, 4, 1, 128, 4, 1);
    test_softmax(be, 1, 1, 0.0f, 1.0f);
    test_softmax(be, 70, 33, 0.0f, 3.0f);
    test_softmax(be, 3, 1000, 0.0f, 100.0f);
    /* rows wider than any thread block (up to a vocabulary), values whose
     * exp overflows unless the row's max is subtracted */
    test_softmax(be, 2, 8192, 1000.0f, 30.0f);
    test_softmax(be, 2, 50000, 0.0f, 30.0f);
    test_softmax(be, 3, 4099, -500.0f, 60.0f);
    test_swiglu_forward(be, 5, 37);
    test_swiglu_forward(be, 70, 9);
    test_gather_rows(be, 20, 33, 25);
    test_gather_rows(be, 5, 7, 1);
    test_gather_rows(be, 300, 64, 200);
    test_copy_rows(be, 9, 13, 21, 17);
    test_copy_rows(be, 70, 100, 128, 101);
    test_copy_rows(be, 1, 5, 5, 5);
    test_moe_combine(be, 6, 2, 35);
    test_moe_combine(be, 70, 2, 64);
    test_moe_combine(be, 1, 1, 3);
}

int main(int argc, char **argv)
{
    return ops_main(argc, argv, "test_ops", forward_slots, false);
}
