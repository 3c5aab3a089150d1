/* The CPU backend's ops against naive reference loops written here. */
#include "kernels/backend.h"
#include "tests/check.h"

#include <omp.h>
#include <stdint.h>

static uint64_t rng_state = 12345;
static float frand(void)
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) & 0xFFFFFF) / (float)0x1000000 * 2.0f - 1.0f;
}
static void fill(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = frand();
}

static void test_gemm(nl_backend *be)
{
    enum { M = 7, N = 13, K = 29 };
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            float A[M * K], B[N * K], C[M * N], R[M * N];
            fill(A, M * K);
            fill(B, N * K);
            fill(C, M * N);
            for (int i = 0; i < M; i++)
                for (int j = 0; j < N; j++) {
                    double s = 0;
                    for (int p = 0; p < K; p++) {
                        float a = ta ? A[p * M + i] : A[i * K + p];
                        float b = tb ? B[j * K + p] : B[p * N + j];
                        s += (double)a * b;
                    }
                    R[i * N + j] = (float)(0.5 * s + 2.0 * C[i * N + j]);
                }
            be->gemm(be, ta, tb, M, N, K, 0.5f, A, ta ? M : K, B, tb ? K : N, 2.0f, C, N);
            CHECK(check_rel_err(C, R, M * N) < 1e-5, "gemm ta=%d tb=%d err %g", ta, tb,
                  check_rel_err(C, R, M * N));
        }
}

/* naive causal GQA attention with a cache of `past` positions */
static void ref_attention(float *out, const float *q, const float *k, const float *v,
                          nl_attn_shape s)
{
    int qs = s.H * s.hd, ks = s.G * s.hd;
    for (int b = 0; b < s.B; b++)
        for (int t = 0; t < s.T; t++)
            for (int h = 0; h < s.H; h++) {
                int g = h / (s.H / s.G), n = s.past + t + 1;
                double sc[512], m = -1e30, l = 0;
                const float *qr = q + ((size_t)b * s.T + t) * qs + h * s.hd;
                for (int j = 0; j < n; j++) {
                    const float *kr = k + ((size_t)b * s.kv_cap + j) * ks + g * s.hd;
                    double d = 0;
                    for (int c = 0; c < s.hd; c++)
                        d += (double)qr[c] * kr[c];
                    sc[j] = d / sqrt((double)s.hd);
                    m = sc[j] > m ? sc[j] : m;
                }
                for (int j = 0; j < n; j++)
                    l += exp(sc[j] - m);
                float *o = out + ((size_t)b * s.T + t) * qs + h * s.hd;
                for (int c = 0; c < s.hd; c++) {
                    double a = 0;
                    for (int j = 0; j < n; j++)
                        a += exp(sc[j] - m) / l * v[((size_t)b * s.kv_cap + j) * ks + g * s.hd + c];
                    o[c] = (float)a;
                }
            }
}

static void test_attention(nl_backend *be, int B, int T, int past, int H, int G, int hd)
{
    nl_attn_shape s = {
        .B = B, .T = T, .past = past, .kv_cap = past + T + 3, .H = H, .G = G, .hd = hd};
    size_t nq = (size_t)B * T * H * hd, nk = (size_t)B * s.kv_cap * G * hd;
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4);
    float *o = malloc(nq * 4), *r = malloc(nq * 4), *lse = malloc((size_t)B * H * T * 4);
    fill(q, nq);
    fill(k, nk);
    fill(v, nk);
    be->attention_forward(be, o, lse, q, H * hd, k, v, G * hd, s);
    ref_attention(r, q, k, v, s);
    double e = check_rel_err(o, r, nq);
    CHECK(e < 1e-5, "attention B=%d T=%d past=%d H=%d G=%d hd=%d err %g", B, T, past, H, G, hd, e);
    free(q), free(k), free(v), free(o), free(r), free(lse);
}

static void test_rmsnorm_rope(nl_backend *be)
{
    enum { N = 5, C = 12 };
    float x[N * C], w[C], y[N * C], rstd[N];
    fill(x, N * C);
    fill(w, C);
    be->rmsnorm_forward(be, y, rstd, x, w, N, C, 1e-6f);
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int i = 0; i < C; i++)
            ss += (double)x[n * C + i] * x[n * C + i];
        double r = 1.0 / sqrt(ss / C + 1e-6);
        for (int i = 0; i < C; i++)
            CHECK(fabs(y[n * C + i] - x[n * C + i] * r * w[i]) < 1e-5, "rmsnorm n=%d i=%d", n, i);
    }
    /* rope: 2 heads of 6 starting at column 0 of a 12-wide row */
    int32_t pos[N] = {0, 1, 7, 100, 2047};
    memcpy(y, x, sizeof x);
    be->rope_forward(be, y, pos, N, C, 0, 2, 6, 10000.0f);
    for (int n = 0; n < N; n++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 3; i++) {
                double ang = pos[n] * pow(10000.0, -2.0 * i / 6.0);
                float a = x[n * C + h * 6 + 2 * i], b = x[n * C + h * 6 + 2 * i + 1];
                CHECK(fabs(y[n * C + h * 6 + 2 * i] - (a * cos(ang) - b * sin(ang))) < 1e-5 &&
                          fabs(y[n * C + h * 6 + 2 * i + 1] - (a * sin(ang) + b * cos(ang))) < 1e-5,
                      "rope n=%d h=%d i=%d", n, h, i);
            }
}

/* A backend's thread count stays inside it: creating one, a GEMM (whose
 * oneDNN team follows omp_get_max_threads) and a parallel op leave the
 * process's OpenMP setting as it was. */
static void test_threads_private(void)
{
    const int had = omp_get_max_threads();
    nl_error err = {0};
    nl_backend *be = NULL;
    CHECK_OK(nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = had + 3}, &err), &err);
    if (!be)
        return;
    CHECK(omp_get_max_threads() == had, "creating a backend set the team to %d (was %d)",
          omp_get_max_threads(), had);
    float *A = be->alloc(be, 64 * 64 * sizeof(float)), *C = be->alloc(be, 64 * 64 * sizeof(float));
    if (A && C) {
        fill(A, 64 * 64);
        be->gemm(be, 0, 1, 64, 64, 64, 1.0f, A, 64, A, 64, 0.0f, C, 64);
        be->softmax_forward(be, C, 64, 64);
        CHECK(omp_get_max_threads() == had, "gemm and softmax left the team at %d (was %d)",
              omp_get_max_threads(), had);
    }
    be->free(be, A);
    be->free(be, C);
    nl_backend_destroy(&be);
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    CHECK_OK(nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = 2}, &err), &err);
    if (!be)
        return check_done("test_backend");
    test_gemm(be);
    test_rmsnorm_rope(be);
    test_attention(be, 1, 1, 0, 1, 1, 2);
    test_attention(be, 2, 37, 0, 6, 2, 16);
    test_attention(be, 3, 5, 11, 4, 4, 8);
    test_attention(be, 1, 100, 70, 8, 2, 32);
    test_attention(be, 2, 1, 130, 4, 1, 64);
    nl_backend_destroy(&be);
    nl_backend_destroy(&be); /* safe twice */
    test_threads_private();
    return check_done("test_backend");
}
