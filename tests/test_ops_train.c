/* The backward and optimizer slots of the backend table against naive
 * reference loops (as test_ops.c does the forward ones), on the backend
 * named by argv[1]; skipped (77) where the backend cannot train
 * (be->can_train unset). The harness is ops_harness.h. */
#include "tests/ops_harness.h"

/* ================================================================ grouped gemm, wgrad */

static void test_gemm_grouped_wgrad(nl_backend *be)
{
    const int a[] = {3, 0, 70, 1}, b[] = {0, 0}, c[] = {130, 1, 0, 17};
    grouped_case(be, 1, 0, a, 4, 33, 37, 0);
    grouped_case(be, 1, 0, b, 2, 5, 5, 0);
    grouped_case(be, 1, 0, c, 4, 65, 70, 0);
}

static void test_moe_router_backward(nl_backend *be, int N, int E, int k)
{
    const size_t np = (size_t)N * E, nk = (size_t)N * k;
    float *p = HF(np), *w = HF(nk), *dw = HF(nk), *frac = HF(E), *got = HF(np);
    double *ref = HD(np), *rw = HD(nk);
    int32_t *ch = HI(nk), *off = HI(E + 1), *perm = HI(nk), *slot = HI(nk);
    float *d_p = dbuf(be, np * 4), *d_w = dbuf(be, nk * 4), *d_dw = dbuf(be, nk * 4);
    float *d_frac = dbuf(be, (size_t)E * 4), *d_dl = dbuf(be, np * 4);
    int32_t *d_ch = dbuf(be, nk * 4);
    const float aux_scale = 0.03f;
    if (!bufs_ok())
        goto done;
    for (int n = 0; n < N; n++) { /* softmax rows */
        double s = 0;
        for (int e = 0; e < E; e++)
            s += p[(size_t)n * E + e] = expf(2.0f * frand());
        for (int e = 0; e < E; e++)
            p[(size_t)n * E + e] = (float)(p[(size_t)n * E + e] / s);
    }
    fill(dw, nk, 1.0f);
    for (int e = 0; e < E; e++)
        frac[e] = 0.5f * (frand() + 1.0f);
    ref_route(ch, rw, off, perm, slot, p, N, E, k);
    for (size_t i = 0; i < nk; i++)
        w[i] = (float)rw[i];
    for (int n = 0; n < N; n++) {
        const float *pr = p + (size_t)n * E;
        double S = 0, wdot = 0, dp[256], dot = 0;
        for (int i = 0; i < k; i++) {
            S += pr[ch[(size_t)n * k + i]];
            wdot += (double)dw[(size_t)n * k + i] * w[(size_t)n * k + i];
        }
        for (int e = 0; e < E; e++)
            dp[e] = (double)aux_scale * frac[e];
        for (int i = 0; i < k; i++)
            dp[ch[(size_t)n * k + i]] += (dw[(size_t)n * k + i] - wdot) / S;
        for (int e = 0; e < E; e++)
            dot += pr[e] * dp[e];
        for (int e = 0; e < E; e++)
            ref[(size_t)n * E + e] = pr[e] * (dp[e] - dot);
    }
    be->upload(be, d_p, p, np * 4);
    be->upload(be, d_w, w, nk * 4);
    be->upload(be, d_dw, dw, nk * 4);
    be->upload(be, d_frac, frac, (size_t)E * 4);
    be->upload(be, d_ch, ch, nk * 4);
    be->moe_router_backward(be, d_dl, d_dw, d_p, d_ch, d_w, d_frac, N, E, k, aux_scale);
    be->download(be, got, d_dl, np * 4);
    synced(be, "moe_router_backward");
    expect(rel_err_rows(got, ref, N, E), TOL_RED, "moe_router_backward N=%d E=%d k=%d", N, E, k);
done:
    release(be);
}

/* ================================================================ backward ops */

static void test_embedding_backward(nl_backend *be, int V, int C, int N)
{
    const size_t nt = (size_t)V * C, no = (size_t)N * C;
    float *dtab = HF(nt), *dout = HF(no), *got = HF(nt);
    int32_t *tok = HI(N);
    double *ref = HD(nt);
    float *dd = dbuf(be, nt * 4), *dg = dbuf(be, no * 4);
    int32_t *dtok = dbuf(be, (size_t)N * 4);
    if (!bufs_ok())
        goto done;
    fill(dtab, nt, 1.0f);
    fill(dout, no, 1.0f);
    for (int n = 0; n < N; n++)
        tok[n] = n % 3 == 0 ? 1 : irand(V < 8 ? V : 8); /* token 1 a third of the time */
    for (size_t i = 0; i < nt; i++)
        ref[i] = dtab[i];
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            ref[(size_t)tok[n] * C + c] += dout[(size_t)n * C + c];
    be->upload(be, dd, dtab, nt * 4);
    be->upload(be, dg, dout, no * 4);
    be->upload(be, dtok, tok, (size_t)N * 4);
    be->embedding_backward(be, dd, dg, dtok, N, C);
    be->download(be, got, dd, nt * 4);
    synced(be, "embedding_backward");
    expect(rel_err(got, ref, nt), TOL_RED, "embedding_backward V=%d C=%d N=%d", V, C, N);
done:
    release(be);
}

static void test_rmsnorm_backward(nl_backend *be, int N, int C)
{
    const size_t nx = (size_t)N * C;
    float *x = HF(nx), *w = HF(C), *g = HF(nx), *rstd = HF(N), *dx = HF(nx), *dw = HF(C);
    float *gotx = HF(nx), *gotw = HF(C);
    double *refx = HD(nx), *refw = HD(C);
    float *d_x = dbuf(be, nx * 4), *d_w = dbuf(be, (size_t)C * 4);
    float *d_g = dbuf(be, nx * 4), *d_r = dbuf(be, (size_t)N * 4);
    float *d_dx = dbuf(be, nx * 4), *d_dw = dbuf(be, (size_t)C * 4);
    if (!bufs_ok())
        goto done;
    fill(x, nx, 2.0f);
    fill(w, C, 1.5f);
    fill(g, nx, 1.0f);
    fill(dx, nx, 1.0f); /* both gradients accumulate */
    fill(dw, C, 1.0f);
    for (int c = 0; c < C; c++)
        refw[c] = dw[c];
    for (int n = 0; n < N; n++) {
        const float *xr = x + (size_t)n * C, *gr = g + (size_t)n * C;
        double ss = 0, dot = 0;
        for (int c = 0; c < C; c++)
            ss += (double)xr[c] * xr[c];
        rstd[n] = (float)(1.0 / sqrt(ss / C + 1e-5));
        const double r = rstd[n];
        for (int c = 0; c < C; c++)
            dot += (double)w[c] * gr[c] * xr[c];
        for (int c = 0; c < C; c++) {
            refx[(size_t)n * C + c] =
                dx[(size_t)n * C + c] + (double)w[c] * gr[c] * r - xr[c] * r * r * r / C * dot;
            refw[c] += (double)gr[c] * xr[c] * r;
        }
    }
    be->upload(be, d_x, x, nx * 4);
    be->upload(be, d_w, w, (size_t)C * 4);
    be->upload(be, d_g, g, nx * 4);
    be->upload(be, d_r, rstd, (size_t)N * 4);
    be->upload(be, d_dx, dx, nx * 4);
    be->upload(be, d_dw, dw, (size_t)C * 4);
    be->rmsnorm_backward(be, d_dx, d_dw, d_g, d_x, d_w, d_r, N, C);
    be->download(be, gotx, d_dx, nx * 4);
    be->download(be, gotw, d_dw, (size_t)C * 4);
    synced(be, "rmsnorm_backward");
    expect(rel_err(gotx, refx, nx), TOL_RED, "rmsnorm_backward N=%d C=%d dinp", N, C);
    expect(rel_err(gotw, refw, C), TOL_RED, "rmsnorm_backward N=%d C=%d dw", N, C);
done:
    release(be);
}

/* Backward of attention without a cache (past = 0, kv_cap = T). out and
 * lse come from the double reference, so the backward is checked on its
 * own; dq, dk, dv start as NaN (they are overwritten, padding included
 * in what is never compared). */
static void test_attention_backward(nl_backend *be, int B, int T, int H, int G, int hd, int pad)
{
    const nl_attn_shape s = {.B = B, .T = T, .past = 0, .kv_cap = T, .H = H, .G = G, .hd = hd};
    const int qs = H * hd + pad, ks = G * hd + 2 * pad;
    const size_t rows = (size_t)B * T, nq = rows * qs, nk = rows * ks;
    const size_t no = rows * H * hd, nkc = rows * G * hd, nl = (size_t)B * H * T;
    float *q = HF(nq), *k = HF(nk), *v = HF(nk), *dout = HF(no), *out = HF(no), *lse = HF(nl);
    float *gq = HF(nq), *gk = HF(nk), *gv = HF(nk), *nan = HF(nq > nk ? nq : nk);
    float *cq = HF(no), *ck = HF(nkc), *cv = HF(nkc);
    double *rq = HD(no), *rk = HD(nkc), *rv = HD(nkc), *p = HD(T), *o = HD(hd);
    float *d_q = dbuf(be, nq * 4), *d_k = dbuf(be, nk * 4);
    float *d_v = dbuf(be, nk * 4), *d_dq = dbuf(be, nq * 4);
    float *d_dk = dbuf(be, nk * 4), *d_dv = dbuf(be, nk * 4);
    float *d_out = dbuf(be, no * 4), *d_dout = dbuf(be, no * 4);
    float *d_lse = dbuf(be, nl * 4);
    if (!bufs_ok())
        goto done;
    attn_inputs(q, qs, k, v, ks, &s);
    fill(dout, no, 1.0f);
    fill_val(nan, nq > nk ? nq : nk, NAN);
    const double scale = 1.0 / sqrt((double)hd);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const int g = h / (H / G);
                const size_t qi = (((size_t)b * T + t) * H + h) * hd; /* compact (B,T,H,hd) */
                const float *qr = q + ((size_t)b * T + t) * qs + (size_t)h * hd;
                lse[((size_t)b * H + h) * T + t] =
                    (float)ref_attn_row(p, o, q, qs, k, v, ks, &s, b, h, t);
                double D = 0;
                for (int c = 0; c < hd; c++) {
                    out[qi + c] = (float)o[c];
                    D += (double)dout[qi + c] * o[c];
                }
                for (int j = 0; j <= t; j++) {
                    const size_t kr = ((size_t)b * T + j) * ks + (size_t)g * hd;
                    const size_t kc = (((size_t)b * T + j) * G + g) * hd; /* compact */
                    double dp = 0;
                    for (int c = 0; c < hd; c++)
                        dp += (double)dout[qi + c] * v[kr + c];
                    const double ds = p[j] * (dp - D);
                    for (int c = 0; c < hd; c++) {
                        rv[kc + c] += p[j] * dout[qi + c];
                        rq[qi + c] += scale * ds * k[kr + c];
                        rk[kc + c] += scale * ds * qr[c];
                    }
                }
            }
    be->upload(be, d_q, q, nq * 4);
    be->upload(be, d_k, k, nk * 4);
    be->upload(be, d_v, v, nk * 4);
    be->upload(be, d_out, out, no * 4);
    be->upload(be, d_dout, dout, no * 4);
    be->upload(be, d_lse, lse, nl * 4);
    be->upload(be, d_dq, nan, nq * 4);
    be->upload(be, d_dk, nan, nk * 4);
    be->upload(be, d_dv, nan, nk * 4);
    be->attention_backward(be, d_dq, d_dk, d_dv, d_dout, d_q, qs, d_k, d_v, ks, d_out, d_lse, s);
    be->download(be, gq, d_dq, nq * 4);
    be->download(be, gk, d_dk, nk * 4);
    be->download(be, gv, d_dv, nk * 4);
    synced(be, "attention_backward");
    compact(cq, gq, rows, H * hd, qs);
    compact(ck, gk, rows, G * hd, ks);
    compact(cv, gv, rows, G * hd, ks);
    expect(rel_err(cq, rq, no), TOL_RED, "attention_backward B=%d T=%d H=%d G=%d hd=%d dq", B, T, H,
           G, hd);
    expect(rel_err(ck, rk, nkc), TOL_RED, "attention_backward B=%d T=%d H=%d G=%d hd=%d dk", B, T,
           H, G, hd);
    expect(rel_err(cv, rv, nkc), TOL_RED, "attention_backward B=%d T=%d H=%d G=%d hd=%d dv", B, T,
           H, G, hd);
done:
    release(be);
}

static void test_swiglu_backward(nl_backend *be, int N, int F)
{
    const size_t ng = (size_t)N * 2 * F, nh = (size_t)N * F;
    float *gu = HF(ng), *dh = HF(nh), *got = HF(ng), *nan = HF(ng);
    double *ref = HD(ng);
    float *d_gu = dbuf(be, ng * 4), *d_dh = dbuf(be, nh * 4);
    float *d_dgu = dbuf(be, ng * 4);
    if (!bufs_ok())
        goto done;
    fill(gu, ng, 6.0f);
    gu[0] = 30.0f, gu[1] = -30.0f;
    fill(dh, nh, 1.0f);
    fill_val(nan, ng, NAN);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < F; j++) {
            const size_t i = (size_t)n * 2 * F + j;
            const double g = gu[i], u = gu[i + F], d = dh[(size_t)n * F + j];
            const double sig = 1.0 / (1.0 + exp(-g));
            ref[i] = d * u * (sig + g * sig * (1.0 - sig)); /* d silu(g) / dg = sig + g sig' */
            ref[i + F] = d * g * sig;
        }
    be->upload(be, d_gu, gu, ng * 4);
    be->upload(be, d_dh, dh, nh * 4);
    be->upload(be, d_dgu, nan, ng * 4); /* overwritten, not accumulated */
    be->swiglu_backward(be, d_dgu, d_dh, d_gu, N, F);
    be->download(be, got, d_dgu, ng * 4);
    synced(be, "swiglu_backward");
    expect(rel_err(got, ref, ng), TOL_ELEM, "swiglu_backward N=%d F=%d", N, F);
done:
    release(be);
}

static void test_moe_combine_backward(nl_backend *be, int N, int k, int C)
{
    const size_t nx = (size_t)N * C, ny = (size_t)N * k * C, nw = (size_t)N * k;
    float *dx = HF(nx), *y = HF(ny), *w = HF(nw), *goty = HF(ny), *gotw = HF(nw), *nan = HF(ny);
    int32_t *slot = HI(nw);
    double *refy = HD(ny), *refw = HD(nw);
    float *d_dx = dbuf(be, nx * 4), *d_y = dbuf(be, ny * 4);
    float *d_w = dbuf(be, nw * 4), *d_dy = dbuf(be, ny * 4);
    float *d_dw = dbuf(be, nw * 4);
    int32_t *d_s = dbuf(be, nw * 4);
    if (!bufs_ok())
        goto done;
    fill(dx, nx, 1.0f);
    fill(y, ny, 1.0f);
    fill(w, nw, 1.0f);
    fill_val(nan, ny, NAN);
    permute(slot, (int)nw);
    for (int n = 0; n < N; n++)
        for (int i = 0; i < k; i++) {
            const size_t e = (size_t)n * k + i, sr = (size_t)slot[e] * C;
            double dot = 0;
            for (int c = 0; c < C; c++) {
                refy[sr + c] = (double)w[e] * dx[(size_t)n * C + c];
                dot += (double)dx[(size_t)n * C + c] * y[sr + c];
            }
            refw[e] = dot;
        }
    be->upload(be, d_dx, dx, nx * 4);
    be->upload(be, d_y, y, ny * 4);
    be->upload(be, d_w, w, nw * 4);
    be->upload(be, d_s, slot, nw * 4);
    be->upload(be, d_dy, nan, ny * 4); /* every row is overwritten */
    be->upload(be, d_dw, nan, nw * 4);
    be->moe_combine_backward(be, d_dy, d_dw, d_dx, d_y, d_s, d_w, N, k, C);
    be->download(be, goty, d_dy, ny * 4);
    be->download(be, gotw, d_dw, nw * 4);
    synced(be, "moe_combine_backward");
    expect(rel_err(goty, refy, ny), TOL_ELEM, "moe_combine_backward N=%d k=%d C=%d dy", N, k, C);
    expect(rel_err(gotw, refw, nw), TOL_RED, "moe_combine_backward N=%d k=%d C=%d dw", N, k, C);
done:
    release(be);
}

/* Losses, and the gradient in place: the target column (-scale plus a
 * probability) and the other columns (probabilities, checked row by row
 * against their own largest, so a wide row's small ones count) apart. */
static void test_cross_entropy(nl_backend *be, int N, int V, float scale, float offset, float amp)
{
    const size_t nx = (size_t)N * V;
    float *x = HF(nx), *got = HF(nx), *loss = HF(N), *gt = HF(N);
    int32_t *tgt = HI(N);
    double *ref = HD(nx), *lref = HD(N), *tref = HD(N);
    float *d_x = dbuf(be, nx * 4), *d_l = dbuf(be, (size_t)N * 4);
    int32_t *d_t = dbuf(be, (size_t)N * 4);
    if (!bufs_ok())
        goto done;
    for (size_t i = 0; i < nx; i++)
        x[i] = offset + amp * frand();
    for (int n = 0; n < N; n++) {
        tgt[n] = n == 0 ? V - 1 : n == 1 ? 0 : irand(V);
        const float *r = x + (size_t)n * V;
        double m = -INFINITY, l = 0;
        for (int i = 0; i < V; i++)
            m = r[i] > m ? r[i] : m;
        for (int i = 0; i < V; i++)
            l += exp(r[i] - m);
        const double lse = m + log(l);
        lref[n] = lse - r[tgt[n]];
        for (int i = 0; i < V; i++)
            ref[(size_t)n * V + i] = scale * exp(r[i] - lse);
        tref[n] = ref[(size_t)n * V + tgt[n]] - scale;
    }
    be->upload(be, d_x, x, nx * 4);
    be->upload(be, d_t, tgt, (size_t)N * 4);
    be->cross_entropy(be, d_x, d_l, d_t, N, V, scale);
    be->download(be, got, d_x, nx * 4);
    be->download(be, loss, d_l, (size_t)N * 4);
    synced(be, "cross_entropy");
    for (int n = 0; n < N; n++) { /* the target column apart */
        gt[n] = got[(size_t)n * V + tgt[n]];
        got[(size_t)n * V + tgt[n]] = 0.0f;
        ref[(size_t)n * V + tgt[n]] = 0.0;
    }
    expect(rel_err(loss, lref, N), TOL_RED, "cross_entropy N=%d V=%d losses", N, V);
    expect(rel_err(gt, tref, N), TOL_RED, "cross_entropy N=%d V=%d scale=%g target gradient", N, V,
           scale);
    expect(rel_err_rows(got, ref, N, V), TOL_RED, "cross_entropy N=%d V=%d scale=%g gradient", N, V,
           scale);
done:
    release(be);
}

static void test_sumsq(nl_backend *be)
{
    const size_t n = 1000003;
    float *x = HF(n);
    float *d = dbuf(be, n * 4);
    if (!bufs_ok())
        goto done;
    fill(x, n, 1.0f);
    be->upload(be, d, x, n * 4);
    const size_t lens[4] = {0, 1, 7, n};
    for (int c = 0; c < 4; c++) {
        double ref = 0;
        for (size_t i = 0; i < lens[c]; i++)
            ref += (double)x[i] * x[i];
        const double got = be->sumsq(be, d, lens[c]);
        const double e = fabs(got - ref) / (ref > 0 ? ref : 1.0);
        expect(isnan(e) ? INFINITY : e, lens[c] ? TOL_SUMSQ : 0.0, "sumsq n=%zu", lens[c]);
    }
    const float bad[3] = {INFINITY, -INFINITY, NAN};
    for (int c = 0; c < 3; c++) {
        be->upload(be, d + 123457, &bad[c], 4);
        const double got = be->sumsq(be, d, n);
        CHECK(!isfinite(got), "sumsq with %g at 123457: %g, want non-finite", bad[c], got);
        be->upload(be, d + 123457, x + 123457, 4);
    }
    synced(be, "sumsq");
done:
    release(be);
}

/* Several AdamW steps against the formula in backend.h, a fresh gradient
 * each step. */
static void test_adamw(nl_backend *be, size_t n)
{
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
    float *p = HF(n), *g = HF(n), *gotp = HF(n), *gotm = HF(n), *gotv = HF(n);
    double *rp = HD(n), *rm = HD(n), *rv = HD(n);
    float *d_p = dbuf(be, n * 4), *d_g = dbuf(be, n * 4);
    float *d_m = dbuf(be, n * 4), *d_v = dbuf(be, n * 4);
    if (!bufs_ok())
        goto done;
    fill(p, n, 1.0f);
    for (size_t i = 0; i < n; i++)
        rp[i] = p[i];
    be->upload(be, d_p, p, n * 4); /* m and v start at zero (alloc zero-fills) */
    for (int t = 1; t <= 5; t++) {
        fill(g, n, t == 3 ? 1e-3f : 2.0f);
        g[0] = 0.0f;
        const float bc1 = (float)(1.0 - pow(b1, t)), bc2 = (float)(1.0 - pow(b2, t));
        for (size_t i = 0; i < n; i++) {
            const double gi = (double)g[i] * gs;
            rm[i] = b1 * rm[i] + (1.0 - b1) * gi;
            rv[i] = b2 * rv[i] + (1.0 - b2) * gi * gi;
            rp[i] -= lr * (rm[i] / bc1 / (sqrt(rv[i] / bc2) + eps) + wd * rp[i]);
        }
        be->upload(be, d_g, g, n * 4); /* reuses g while the last step may still run */
        be->adamw(be, d_p, d_g, d_m, d_v, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
    }
    be->download(be, gotp, d_p, n * 4);
    be->download(be, gotm, d_m, n * 4);
    be->download(be, gotv, d_v, n * 4);
    synced(be, "adamw");
    expect(rel_err(gotp, rp, n), TOL_ELEM, "adamw n=%zu 5 steps p", n);
    expect(rel_err(gotm, rm, n), TOL_ELEM, "adamw n=%zu 5 steps m", n);
    expect(rel_err(gotv, rv, n), TOL_ELEM, "adamw n=%zu 5 steps v", n);
done:
    release(be);
}

/* ================================================================ main */

static void training_slots(nl_backend *be)
{
    test_embedding_backward(be, 30, 70, 50);
    test_embedding_backward(be, 40, 200, 400); /* N C > 65536: the threaded path */
    test_rmsnorm_backward(be, 5, 37);
    test_rmsnorm_backward(be, 70, 1000);
    /* attention backward: B, T, H, G, hd, row padding */
    test_attention_backward(be, 2, 19, 4, 4, 16, 0);
    test_attention_backward(be, 2, 37, 8, 2, 64, 4);
    test_attention_backward(be, 2, 21, 4, 1, 64, 8);
    test_attention_backward(be, 1, 1, 2, 1, 16, 0);
    test_swiglu_backward(be, 5, 37);
    test_swiglu_backward(be, 70, 9);
    test_moe_combine_backward(be, 6, 2, 35);
    test_moe_combine_backward(be, 70, 2, 64);
    test_moe_router_backward(be, 1, 8, 2);
    test_moe_router_backward(be, 70, 8, 2);
    test_moe_router_backward(be, 30, 16, 4);
    test_gemm_grouped_wgrad(be);
    test_cross_entropy(be, 5, 7, 0.2f, 0.0f, 2.0f);
    test_cross_entropy(be, 3, 50000, 1.0f, 0.0f, 20.0f);
    test_cross_entropy(be, 70, 33, 0.5f, 1000.0f, 30.0f);
    test_sumsq(be);
    test_adamw(be, 1001);
    test_adamw(be, 70001);
}

int main(int argc, char **argv)
{
    return ops_main(argc, argv, "test_ops_train", training_slots, true);
}
