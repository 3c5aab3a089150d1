/* The CPU backend's FP32 GEMM (kernels/cpu/cpu_matmul.c): every element of
 * C = alpha op(A) op(B) + beta C is the chain that file defines,
 *   s = beta == 0 ? 0 : beta == 1 ? C : beta * C;  s = fmaf(a, b, s) over k
 * (a times alpha, rounded, when alpha is not 1), bit for bit, for every
 * transpose, alpha and beta, shapes at the edges of its tiles and blocks
 * (K past a block, N past a block of B), padded strides, and 1, 2 and 3
 * threads. So its bits depend on neither M nor the thread count: what a
 * verifier's single thread redoing a stage's microbatch (docs/security.md)
 * and an embedding's independence of its batch rest on. oneDNN's
 * dnnl_sgemm, the GEMM before it, failed both on AVX2 machines (its
 * threads split K for some shapes). The plain gemm takes the dot kernel
 * (another, also row-invariant, chain) for y = x W^T below 16 rows, so
 * those calls are left out here; test_batch checks them. */
#include "check.h"

#include <math.h>
#include <stdint.h>

static uint64_t seed = 42;

static float rnd(void)
{
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(seed >> 40) / (double)(1 << 24) - 0.5);
}

/* the chain of element (i, j), as cpu_matmul.c's header defines it */
static float chain(int ta, int tb, int i, int j, int K, float alpha, const float *A, int lda,
                   const float *B, int ldb, float beta, float c)
{
    float s = beta == 0.0f ? 0.0f : beta == 1.0f ? c : c * beta;
    for (int k = 0; k < K; k++) {
        float a = ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
        if (alpha != 1.0f)
            a = a * alpha;
        const float b = tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
        s = fmaf(a, b, s);
    }
    return s;
}

/* the dot kernel's calls (gemm below 16 rows of y = x W^T) */
static int dot_call(int ta, int tb, int M, float alpha, float beta)
{
    return !ta && tb && alpha == 1.0f && (beta == 0.0f || beta == 1.0f) && M < 16;
}

static void check_shape(nl_backend *const *bes, int nbe, int M, int N, int K)
{
    static const float alphas[] = {1.0f, 0.3f}, betas[] = {0.0f, 1.0f, -0.7f};
    const int pad = 3; /* strides past the widths */
    const size_t na = (size_t)(M > K ? M : K) * (size_t)((M > K ? M : K) + pad);
    const size_t nb = (size_t)(N > K ? N : K) * (size_t)((N > K ? N : K) + pad);
    const int ldc = N + pad;
    const size_t nc = (size_t)M * ldc;
    float *A = malloc(na * sizeof *A), *B = malloc(nb * sizeof *B);
    float *C0 = malloc(nc * sizeof *C0), *C = malloc(nc * sizeof *C);
    CHECK(A && B && C0 && C, "out of memory");
    if (!A || !B || !C0 || !C)
        goto out;
    for (size_t i = 0; i < na; i++)
        A[i] = rnd();
    for (size_t i = 0; i < nb; i++)
        B[i] = rnd();
    for (size_t i = 0; i < nc; i++)
        C0[i] = rnd();
    for (int ta = 0; ta <= 1; ta++)
        for (int tb = 0; tb <= 1; tb++)
            for (size_t ai = 0; ai < sizeof alphas / sizeof alphas[0]; ai++)
                for (size_t bi = 0; bi < sizeof betas / sizeof betas[0]; bi++) {
                    const float alpha = alphas[ai], beta = betas[bi];
                    if (dot_call(ta, tb, M, alpha, beta))
                        continue;
                    const int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad;
                    for (int t = 0; t < nbe; t++) {
                        memcpy(C, C0, nc * sizeof *C);
                        if (beta == 0.0f) /* C is not read: NaN there stays out */
                            for (int i = 0; i < M; i++)
                                for (int j = 0; j < N; j++)
                                    C[(size_t)i * ldc + j] = NAN;
                        bes[t]->gemm(bes[t], ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
                        int wrong = 0, outside = 0;
                        for (int i = 0; i < M; i++) {
                            for (int j = 0; j < N; j++) {
                                const size_t o = (size_t)i * ldc + j;
                                const float want =
                                    chain(ta, tb, i, j, K, alpha, A, lda, B, ldb, beta, C0[o]);
                                wrong += memcmp(&want, &C[o], sizeof want) != 0;
                            }
                            for (int j = N; j < ldc; j++)
                                outside += memcmp(&C[(size_t)i * ldc + j], &C0[(size_t)i * ldc + j],
                                                  sizeof(float)) != 0;
                        }
                        CHECK(!wrong && !outside,
                              "gemm M %d N %d K %d trans %d%d alpha %g beta %g, %d threads: %d "
                              "elements not the chain's bits, %d written past N",
                              M, N, K, ta, tb, alpha, beta, t + 1, wrong, outside);
                    }
                }
out:
    free(A);
    free(B);
    free(C0);
    free(C);
}

int main(void)
{
    nl_backend *bes[3] = {NULL, NULL, NULL};
    nl_error err;
    for (int t = 0; t < 3; t++) {
        nl_backend_opts o;
        memset(&o, 0, sizeof o);
        o.threads = t + 1;
        /* the CPU itself, whatever NL_TEST_DEVICE says: this is its GEMM */
        CHECK_OK(nl_backend_new(&bes[t], "cpu", &o, &err), &err);
        if (!bes[t])
            return check_done("test_cpu_gemm");
    }
    /* (M, N, K): a tile and less, tile edges (6 x 16), K past a block of
     * 256 with a remainder, enough work for a team, a 1-deep product, M
     * below the dot kernel's rows; the few rows' loop (N past 2048 there
     * too) and, past 192 rows, the blocked one with N past a block of
     * 2048 and K past one of 256 */
    static const int shapes[][3] = {{16, 16, 1},    {1, 1, 1},     {5, 7, 3},     {6, 16, 256},
                                    {17, 33, 300},  {40, 50, 513}, {100, 70, 64}, {23, 2100, 20},
                                    {130, 20, 700}, {7, 300, 260}, {64, 64, 64},  {194, 2060, 9},
                                    {200, 40, 300}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        check_shape(bes, 3, shapes[i][0], shapes[i][1], shapes[i][2]);

    /* K = 0: the chain's start alone */
    float c[4] = {1.0f, -2.0f, NAN, 4.0f}, a = 1.0f;
    bes[1]->gemm(bes[1], 0, 0, 1, 2, 0, 1.0f, &a, 1, &a, 2, -0.5f, c, 2);
    CHECK(c[0] == -0.5f && c[1] == 1.0f && isnan(c[2]), "K 0, beta -0.5: %g %g", c[0], c[1]);
    bes[1]->gemm(bes[1], 0, 0, 2, 2, 0, 1.0f, &a, 1, &a, 2, 0.0f, c, 2);
    CHECK(c[0] == 0.0f && c[2] == 0.0f && c[3] == 0.0f, "K 0, beta 0: not zero");
    for (int t = 0; t < 3; t++)
        nl_backend_destroy(&bes[t]);
    return check_done("test_cpu_gemm");
}
