/* The harness of the backend-slot tests (test_ops.c: the forward slots;
 * test_ops_train.c: the backward and optimizer slots): random inputs,
 * host and device buffers released after each case, error measures, the
 * naive references both programs use, and the main both run on the backend
 * named by argv[1] ("cpu", the default, "cpu-devsim" or "cuda:N").
 * Header-only, as check.h is: its CHECKs count in the program that
 * includes it.
 *
 * Tolerances (issue 13): element-wise ops exact or 1e-6 relative;
 * reductions, norms, softmax and attention 1e-5; GEMM 1e-5 sqrt(K)
 * relative to |A||B|. "Relative" is max-norm: max |got - ref| / max |ref|.
 * Exit status 77 (CTest: skipped) when the device is not available. */
#ifndef NL_TEST_OPS_HARNESS_H
#define NL_TEST_OPS_HARNESS_H

#include "kernels/backend.h"
#include "tests/check.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>

#define TOL_ELEM 1e-6
#define TOL_RED 1e-5
#define TOL_GEMM 1e-5
/* sumsq promises double precision: a float accumulator is off by ~1e-7 on
 * a million terms, float squares summed in double by ~1e-10 */
#define TOL_SUMSQ 1e-9

/* ================================================================ harness */

static uint64_t rng_state = 12345;
static inline float frand(void) /* uniform in [-1, 1) */
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) & 0xFFFFFF) / (float)0x1000000 * 2.0f - 1.0f;
}
static inline int irand(int n) /* uniform in [0, n) */
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int)((rng_state >> 33) % (uint64_t)n);
}
static inline void fill(float *x, size_t n, float amp)
{
    for (size_t i = 0; i < n; i++)
        x[i] = amp * frand();
}
static inline void fill_val(float *x, size_t n, float v)
{
    for (size_t i = 0; i < n; i++)
        x[i] = v;
}
/* a random permutation of 0 .. n-1 */
static inline void permute(int32_t *p, int n)
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

static inline void *hbuf(size_t bytes)
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
static inline void *dbuf(nl_backend *be, size_t bytes)
{
    void *d = n_dev < MAX_BUFS && !alloc_failed ? be->alloc(be, bytes ? bytes : 64) : NULL;
    if (!d) {
        alloc_failed = 1;
        return NULL;
    }
    return dev_bufs[n_dev++] = d;
}

static inline int bufs_ok(void)
{
    CHECK(!alloc_failed, "allocation failed (%d host, %d device buffers)", n_host, n_dev);
    return !alloc_failed;
}

static inline void release(nl_backend *be)
{
    for (int i = 0; i < n_dev; i++)
        be->free(be, dev_bufs[i]);
    for (int i = 0; i < n_host; i++)
        free(host_bufs[i]);
    n_dev = n_host = alloc_failed = 0;
}

static inline void synced(nl_backend *be, const char *what)
{
    nl_error err = {0};
    nl_status st = be->sync(be, &err);
    CHECK(st == NL_OK, "%s: sync: %s: %s", what, nl_status_str(st), err.msg);
}

/* Max-norm relative error of got against a double reference; infinite
 * when got holds a value the reference does not (NaN, inf). */
static inline double rel_err(const float *got, const double *ref, size_t n)
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
static inline double rel_err_rows(const float *got, const double *ref, int rows, int cols)
{
    double e = 0;
    for (int r = 0; r < rows; r++) {
        double er = rel_err(got + (size_t)r * cols, ref + (size_t)r * cols, (size_t)cols);
        e = er > e ? er : e;
    }
    return e;
}

/* CHECK that error e is within tol; fmt names the case. */
__attribute__((format(printf, 3, 4))) static inline void expect(double e, double tol,
                                                                const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    CHECK(e <= tol, "%s: error %.3g, tolerance %.3g", what, e, tol);
}

/* CHECK that two byte ranges are equal (the exact ops). */
__attribute__((format(printf, 4, 5))) static inline void
expect_same(const void *got, const void *want, size_t bytes, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    CHECK(memcmp(got, want, bytes) == 0, "%s: differs", what);
}

/* dst (rows, cols) <- the first cols of each row of src (rows, stride) */
static inline void compact(float *dst, const float *src, size_t rows, int cols, int stride)
{
    for (size_t r = 0; r < rows; r++)
        memcpy(dst + r * cols, src + r * stride, (size_t)cols * sizeof(float));
}

/* ================================================================ shared references */

/* Naive causal attention of query t of sequence b, head h, in double: the
 * probabilities into p (past + t + 1 of them), the output row into o;
 * returns the log-sum-exp of the scaled scores. q has row stride qs, k and
 * v row stride ks, as the slot takes them. */
static inline double ref_attn_row(double *p, double *o, const float *q, int qs, const float *k,
                                  const float *v, int ks, const nl_attn_shape *s, int b, int h,
                                  int t)
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
static inline void attn_inputs(float *q, int qs, float *k, float *v, int ks, const nl_attn_shape *s)
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

/* The naive routing: row n's experts in order of (probability descending,
 * index ascending), the first k chosen; the dispatch by expert, then
 * token, then choice. */
static inline void ref_route(int32_t *ch, double *w, int32_t *off, int32_t *perm, int32_t *slot,
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

/* gemm_grouped (wgrad = 0) or gemm_grouped_wgrad over the groups of
 * `sizes`; row strides padded by `pad` with NaN in A's and B's padding. */
static inline void grouped_case(nl_backend *be, int wgrad, int trans_b, const int *sizes, int G,
                                int M, int N, int K)
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

/* ================================================================ main */

/* Make the backend named by argv[1], run `slots` on it (with train set,
 * only where be->can_train: else the program reports skipped), and check
 * that the cases freed what they allocated; the exit code. */
static inline int ops_main(int argc, char **argv, const char *name, void (*slots)(nl_backend *),
                           bool train)
{
    const char *device = argc > 1 ? argv[1] : "cpu";
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_status st = nl_backend_new(&be, device, &(nl_backend_opts){.threads = 2}, &err);
    if (st == NL_ERR_UNSUPPORTED) {
        /* NL_REQUIRE_DEVICE=1 (the scripted GPU run): a device that cannot
         * be made is a failure, not a skip */
        const char *req = getenv("NL_REQUIRE_DEVICE");
        printf("%s: %s: %s: %s\n", name, device, req && *req == '1' ? "FAIL" : "skipped", err.msg);
        return req && *req == '1' ? 1 : 77;
    }
    CHECK(st == NL_OK, "nl_backend_new %s: %s: %s", device, nl_status_str(st), err.msg);
    if (!be)
        return check_done(name);
    printf("%s: backend %s\n", name, be->name);
    if (train && !be->can_train) {
        printf("%s: %s: can_train = 0: backward and optimizer slots skipped\n", name, be->name);
        nl_backend_destroy(&be);
        return 77;
    }
    size_t in_use0 = 0, in_use = 0, peak = 0;
    be->mem_stats(be, &in_use0, &peak);

    slots(be);

    synced(be, "end");
    CHECK_OK(nl_backend_check(be, &err), &err);
    be->mem_stats(be, &in_use, &peak);
    CHECK(in_use == in_use0, "mem_stats: %zu bytes in use after the tests, %zu before", in_use,
          in_use0);
    nl_backend_destroy(&be);
    return check_done(name);
}

#endif
