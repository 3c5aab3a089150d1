/* Every slot of the backend table (kernels/backend.h) against a naive
 * reference loop written here (plain C, double accumulation), on the
 * backend named by argv[1]: "cpu" (the default), "cpu-devsim" or "cuda:N".
 * All data goes through upload and download, never through a host
 * dereference of device memory, so the one program checks any device. The
 * backward and optimizer slots run only where be->can_train is set.
 *
 * Tolerances (issue 13): element-wise ops exact or 1e-6 relative;
 * reductions, norms, softmax and attention 1e-5; GEMM 1e-5 sqrt(K)
 * relative to |A||B|. "Relative" is max-norm: max |got - ref| / max |ref|.
 * Exit status 77 (CTest: skipped) when the device is not available. */
#include "check.h"
#include "kernels/backend.h"

#include <stdarg.h>
#include <stdint.h>

#define TOL_ELEM 1e-6
#define TOL_RED 1e-5
#define TOL_GEMM 1e-5
/* sumsq promises double precision: a float accumulator is off by ~1e-7 on
 * a million terms, float squares summed in double by ~1e-10 */
#define TOL_SUMSQ 1e-9

/* ================================================================ harness */

static uint64_t rng_state = 12345;
static float frand(void) /* uniform in [-1, 1) */
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) & 0xFFFFFF) / (float)0x1000000 * 2.0f - 1.0f;
}
static int irand(int n) /* uniform in [0, n) */
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int)((rng_state >> 33) % (uint64_t)n);
}
static void fill(float *x, size_t n, float amp)
{
    for (size_t i = 0; i < n; i++)
        x[i] = amp * frand();
}
static void fill_val(float *x, size_t n, float v)
{
    for (size_t i = 0; i < n; i++)
        x[i] = v;
}
/* a random permutation of 0 .. n-1 */
static void permute(int32_t *p, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = irand(i + 1);
        int32_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
}

/* Buffers of the running case, host and device, all freed by release().
 * A case allocates everything first and gives up when bufs_ok() is 0. */
#define MAX_BUFS 64
static void *host_bufs[MAX_BUFS], *dev_bufs[MAX_BUFS];
static int n_host, n_dev, alloc_failed;

static void *hbuf(size_t bytes)
{
    void *p = n_host < MAX_BUFS ? calloc(1, bytes ? bytes : 1) : NULL;
    if (!p) {
        alloc_failed = 1;
        return NULL;
    }
    return host_bufs[n_host++] = p;
}
#define HF(n) ((float *)hbuf((size_t)(n) * sizeof(float)))
#define HD(n) ((double *)hbuf((size_t)(n) * sizeof(double)))
#define HI(n) ((int32_t *)hbuf((size_t)(n) * sizeof(int32_t)))

/* A zero-filled device buffer of `bytes` (at least 64, so that an empty
 * operand is still a valid pointer). */
static void *dbuf(nl_backend *be, size_t bytes)
{
    void *d = n_dev < MAX_BUFS && !alloc_failed ? be->alloc(be, bytes ? bytes : 64) : NULL;
    if (!d) {
        alloc_failed = 1;
        return NULL;
    }
    return dev_bufs[n_dev++] = d;
}

static int bufs_ok(void)
{
    CHECK(!alloc_failed, "allocation failed (%d host, %d device buffers)", n_host, n_dev);
    return !alloc_failed;
}

static void release(nl_backend *be)
{
    for (int i = 0; i < n_dev; i++)
        be->free(be, dev_bufs[i]);
    for (int i = 0; i < n_host; i++)
        free(host_bufs[i]);
    n_dev = n_host = alloc_failed = 0;
}

static void synced(nl_backend *be, const char *what)
{
    nl_error err = {0};
    nl_status st = be->sync(be, &err);
    CHECK(st == NL_OK, "%s: sync: %s: %s", what, nl_status_str(st), err.msg);
}

/* Max-norm relative error of got against a double reference; infinite
 * when got holds a value the reference does not (NaN, inf). */
static double rel_err(const float *got, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (!isfinite(d))
            return INFINITY;
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return den > 0 ? num / den : num;
}

/* The worst row of rel_err over (rows, cols). */
static double rel_err_rows(const float *got, const double *ref, int rows, int cols)
{
    double e = 0;
    for (int r = 0; r < rows; r++) {
        double er = rel_err(got + (size_t)r * cols, ref + (size_t)r * cols, (size_t)cols);
        e = er > e ? er : e;
    }
    return e;
}

/* CHECK that error e is within tol; fmt names the case. */
__attribute__((format(printf, 3, 4))) static void expect(double e, double tol, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    CHECK(e <= tol, "%s: error %.3g, tolerance %.3g", what, e, tol);
}

/* CHECK that two byte ranges are equal (the exact ops). */
__attribute__((format(printf, 4, 5))) static void expect_same(const void *got, const void *want,
                                                              size_t bytes, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    CHECK(memcmp(got, want, bytes) == 0, "%s: differs", what);
}

/* dst (rows, cols) <- the first cols of each row of src (rows, stride) */
static void compact(float *dst, const float *src, size_t rows, int cols, int stride)
{
    for (size_t r = 0; r < rows; r++)
        memcpy(dst + r * cols, src + r * stride, (size_t)cols * sizeof(float));
}

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

/* Naive causal attention of query t of sequence b, head h, in double: the
 * probabilities into p (past + t + 1 of them), the output row into o;
 * returns the log-sum-exp of the scaled scores. q has row stride qs, k and
 * v row stride ks, as the slot takes them. */
static double ref_attn_row(double *p, double *o, const float *q, int qs, const float *k,
                           const float *v, int ks, const nl_attn_shape *s, int b, int h, int t)
{
    const int g = h / (s->H / s->G), n = s->past + t + 1;
    const float *qr = q + ((size_t)b * s->T + t) * qs + (size_t)h * s->hd;
    double m = -INFINITY, l = 0;
    for (int j = 0; j < n; j++) {
        const float *kr = k + ((size_t)b * s->kv_cap + j) * ks + (size_t)g * s->hd;
        double d = 0;
        for (int c = 0; c < s->hd; c++)
            d += (double)qr[c] * kr[c];
        p[j] = d / sqrt((double)s->hd);
        m = p[j] > m ? p[j] : m;
    }
    for (int j = 0; j < n; j++)
        l += p[j] = exp(p[j] - m);
    for (int j = 0; j < n; j++)
        p[j] /= l;
    for (int c = 0; c < s->hd; c++) {
        double a = 0;
        for (int j = 0; j < n; j++)
            a += p[j] * v[((size_t)b * s->kv_cap + j) * ks + (size_t)g * s->hd + c];
        o[c] = a;
    }
    return m + log(l);
}

/* Random q, k, v in strided buffers (padding NaN; cache rows past
 * past + T hold large finite values that no query may see). */
static void attn_inputs(float *q, int qs, float *k, float *v, int ks, const nl_attn_shape *s)
{
    for (size_t r = 0; r < (size_t)s->B * s->T; r++)
        for (int c = 0; c < qs; c++)
            q[r * qs + c] = c < s->H * s->hd ? 1.5f * frand() : NAN;
    for (int b = 0; b < s->B; b++)
        for (int j = 0; j < s->kv_cap; j++)
            for (int c = 0; c < ks; c++) {
                const size_t i = ((size_t)b * s->kv_cap + j) * ks + c;
                const int live = j < s->past + s->T;
                k[i] = c >= s->G * s->hd ? NAN : live ? 1.5f * frand() : 300.0f;
                v[i] = c >= s->G * s->hd ? NAN : live ? frand() : 1000.0f;
            }
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

/* ================================================================ routing */

/* Router probabilities from 8 levels, so rows have ties. */
static void tied_probs(float *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (float)(irand(8) + 1) / 8.0f;
}

/* The naive routing: row n's experts in order of (probability descending,
 * index ascending), the first k chosen; the dispatch by expert, then
 * token, then choice. */
static void ref_route(int32_t *ch, double *w, int32_t *off, int32_t *perm, int32_t *slot,
                      const float *p, int N, int E, int k)
{
    for (int n = 0; n < N; n++) {
        const float *row = p + (size_t)n * E;
        double sum = 0;
        for (int i = 0; i < k; i++) {
            /* the i-th: the expert with exactly i others ranked before it */
            for (int e = 0; e < E; e++) {
                int before = 0;
                for (int f = 0; f < E; f++)
                    before += row[f] > row[e] || (row[f] == row[e] && f < e);
                if (before == i)
                    ch[(size_t)n * k + i] = e;
            }
            sum += row[ch[(size_t)n * k + i]];
        }
        for (int i = 0; i < k; i++)
            w[(size_t)n * k + i] = row[ch[(size_t)n * k + i]] / sum;
    }
    int s = 0;
    off[0] = 0;
    for (int e = 0; e < E; e++) {
        for (int n = 0; n < N; n++)
            for (int i = 0; i < k; i++)
                if (ch[(size_t)n * k + i] == e) {
                    perm[s] = n;
                    slot[(size_t)n * k + i] = s++;
                }
        off[e + 1] = s;
    }
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

/* gemm_grouped (wgrad = 0) or gemm_grouped_wgrad over the groups of
 * `sizes`; row strides padded by `pad` with NaN in A's and B's padding. */
static void grouped_case(nl_backend *be, int wgrad, int trans_b, const int *sizes, int G, int M,
                         int N, int K)
{
    const int pad = 3;
    int32_t off[17];
    off[0] = 0;
    for (int g = 0; g < G; g++)
        off[g + 1] = off[g] + sizes[g];
    const int R = off[G], max_rows = R > 0 ? R : 1;
    /* rows mode: A (R, K), B_g (N, K) or (K, N), C (R, N);
     * wgrad: A (R, M), B (R, N), C_g (M, N) */
    const int aw = wgrad ? M : K, bw = wgrad ? N : trans_b ? K : N;
    const int lda = aw + pad, ldb = bw + pad, ldc = N + pad;
    const size_t b_rows = wgrad ? (size_t)R : (size_t)(trans_b ? N : K);
    const size_t b_stride = b_rows * ldb, c_rows = wgrad ? (size_t)M : (size_t)R;
    const size_t c_stride = c_rows * ldc;
    const size_t na = (size_t)R * lda + 1, nb = b_stride * (wgrad ? 1 : G) + 1;
    const size_t nc = c_stride * (wgrad ? G : 1) + 1;
    float *A = HF(na), *B = HF(nb), *C = HF(nc), *got = HF(nc);
    double *ref = HD(nc);
    float *dA = dbuf(be, na * 4), *dB = dbuf(be, nb * 4), *dC = dbuf(be, nc * 4);
    int32_t *doff = dbuf(be, (size_t)(G + 1) * 4);
    if (!bufs_ok())
        goto done;
    for (size_t i = 0; i < na; i++)
        A[i] = (int)(i % lda) < aw ? frand() : NAN;
    for (size_t i = 0; i < nb; i++)
        B[i] = (int)(i % ldb) < bw ? frand() : NAN;
    for (size_t i = 0; i < nc; i++)
        C[i] = (int)(i % ldc) < N && i + 1 < nc ? frand() : 777.0f;
    for (size_t i = 0; i < nc; i++)
        ref[i] = C[i];
    for (int g = 0; g < G; g++) {
        const int n = sizes[g], r0 = off[g];
        if (n == 0)
            continue;
        const int rows = wgrad ? M : n, inner = wgrad ? n : K;
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < N; j++) {
                double acc = 0;
                for (int q = 0; q < inner; q++) {
                    const double a =
                        wgrad ? A[(size_t)(r0 + q) * lda + i] : A[(size_t)(r0 + i) * lda + q];
                    const double b = wgrad     ? B[(size_t)(r0 + q) * ldb + j]
                                     : trans_b ? B[g * b_stride + (size_t)j * ldb + q]
                                               : B[g * b_stride + (size_t)q * ldb + j];
                    acc += a * b;
                }
                const size_t c =
                    wgrad ? g * c_stride + (size_t)i * ldc + j : (size_t)(r0 + i) * ldc + j;
                ref[c] = wgrad ? ref[c] + acc : acc;
            }
    }
    be->upload(be, dA, A, na * 4);
    be->upload(be, dB, B, nb * 4);
    be->upload(be, dC, C, nc * 4);
    be->upload(be, doff, off, (size_t)(G + 1) * 4);
    if (wgrad)
        be->gemm_grouped_wgrad(be, M, N, dA, lda, dB, ldb, dC, ldc, c_stride, doff, G);
    else
        be->gemm_grouped(be, trans_b, N, K, dA, lda, dB, ldb, b_stride, dC, ldc, doff, G, max_rows);
    be->download(be, got, dC, nc * 4);
    synced(be, "gemm_grouped");
    expect(rel_err(got, ref, nc), TOL_GEMM * sqrt((double)(wgrad ? R : K) + 1),
           "gemm_grouped%s trans_b=%d G=%d rows=%d M=%d N=%d K=%d", wgrad ? "_wgrad" : "", trans_b,
           G, R, M, N, K);
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
    test_attention_masked(be, 1, 300, 0, 2, 1, 16, 0, 64, 0);  /* causal window */
    test_attention_masked(be, 1, 300, 0, 2, 1, 16, 1, 64, 0);  /* bidirectional window */
    test_attention_masked(be, 2, 77, 0, 4, 2, 8, 1, 0, 0);     /* encoder */
    test_attention_masked(be, 2, 90, 0, 4, 2, 8, 1, 0, 3);     /* packed encoder */
    test_attention_masked(be, 2, 90, 0, 4, 2, 8, 0, 20, 3);    /* packed local decoder */
    test_attention_masked(be, 2, 5, 40, 4, 2, 8, 0, 16, 0);    /* windowed decode with a cache */
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
    test_moe_route(be, 1, 8, 2);
    test_moe_route(be, 70, 8, 2);
    test_moe_route(be, 300, 16, 4);
    test_moe_route(be, 5, 3, 3);
    test_moe_route(be, 33, 256, 2);
    test_gemm_grouped(be);
}

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
    const char *device = argc > 1 ? argv[1] : "cpu";
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_status st = nl_backend_new(&be, device, &(nl_backend_opts){.threads = 2}, &err);
    if (st == NL_ERR_UNSUPPORTED) {
        /* NL_REQUIRE_DEVICE=1 (the scripted GPU run): a device that cannot
         * be made is a failure, not a skip */
        const char *req = getenv("NL_REQUIRE_DEVICE");
        printf("test_ops: %s: %s: %s\n", device, req && *req == '1' ? "FAIL" : "skipped", err.msg);
        return req && *req == '1' ? 1 : 77;
    }
    CHECK(st == NL_OK, "nl_backend_new %s: %s: %s", device, nl_status_str(st), err.msg);
    if (!be)
        return check_done("test_ops");
    printf("test_ops: backend %s\n", be->name);
    size_t in_use0 = 0, in_use = 0, peak = 0;
    be->mem_stats(be, &in_use0, &peak);

    forward_slots(be);
    if (be->can_train)
        training_slots(be);
    else
        printf("test_ops: %s: can_train = 0: backward and optimizer slots skipped\n", be->name);

    synced(be, "end");
    CHECK_OK(nl_backend_check(be, &err), &err);
    be->mem_stats(be, &in_use, &peak);
    CHECK(in_use == in_use0, "mem_stats: %zu bytes in use after the tests, %zu before", in_use,
          in_use0);
    nl_backend_destroy(&be);
    return check_done("test_ops");
}
