/* The CUDA backend's bf16 GEMM parameters (kernels/cuda/cuda_gemm_plan.h)
 * on the CPU, without cuBLASLt:
 *
 *  - nl_lt_plan_make: a column-major GEMM that follows cuBLASLt's
 *    definition (D = alpha op(A) op(B) + beta C, each matrix rows x cols
 *    with leading dimension ld, op transposing when asked) is run with the
 *    plan's operations, layouts and (m, n, k) on the very bytes of our
 *    row-major operands (cuBLASLt's A is our B, its B our A), and must give
 *    backend.h's row-major C = alpha op(A) op(B) + beta C, for all four
 *    transposes, padded strides and edge shapes. Every layout must also be
 *    one cuBLASLt accepts (ld >= rows; op(a) m x k, op(b) k x n, c m x n).
 *  - nl_bf16_chunks and nl_bf16_for_pieces: every piece's converted
 *    operands fit the scratch, the pieces tile M x N x K exactly once, and
 *    a GEMM run piece by piece (beta on the first piece of K only) equals
 *    the uncut one. Operands are small integers, so every sum is exact and
 *    the comparisons are for equality.
 *  - nl_cuda_gemm_takes_rows: the plain gemm's decode rows (y = x W^T,
 *    alpha 1, beta 0 or 1, below 16 rows) go to the rows kernel, nothing
 *    else does.
 *  - nl_lt_bucket_rows: at least M, less than M + max(64, M / 8), never
 *    decreasing, a bucket its own bucket, few buckets over a step's
 *    expert counts; and a plan at the bucket's rows (or a weight
 *    gradient's depth) differs from the plan at M (K) only in the columns
 *    cuda_gemm.cu sets per call. */
#include "tests/check.h"

#include "kernels/cuda/cuda_gemm_plan.h"

#include <stdint.h>

static uint64_t rs = 12345;
static int irand(int n)
{
    rs = rs * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int)((rs >> 33) % (uint64_t)n);
}

/* backend.h's row-major reference */
static void rowmajor_gemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                          const float *B, int ldb, float beta, float *C, int ldc)
{
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int p = 0; p < K; p++)
                s += (double)(ta ? A[(size_t)p * lda + i] : A[(size_t)i * lda + p]) *
                     (tb ? B[(size_t)j * ldb + p] : B[(size_t)p * ldb + j]);
            C[(size_t)i * ldc + j] = (float)(alpha * s + beta * C[(size_t)i * ldc + j]);
        }
}

/* cuBLASLt's definition, column-major */
static void colmajor_gemm(const nl_lt_plan *p, float alpha, const float *a, const float *b,
                          float beta, float *c)
{
    for (int i = 0; i < p->m; i++)
        for (int j = 0; j < p->n; j++) {
            double s = 0;
            for (int q = 0; q < p->k; q++) {
                const float x =
                    p->a.trans ? a[q + (size_t)i * p->a.ld] : a[i + (size_t)q * p->a.ld];
                const float y =
                    p->b.trans ? b[j + (size_t)q * p->b.ld] : b[q + (size_t)j * p->b.ld];
                s += (double)x * y;
            }
            c[i + (size_t)j * p->c.ld] = (float)(alpha * s + beta * c[i + (size_t)j * p->c.ld]);
        }
}

static int layout_ok(const nl_lt_matrix *x, int rows_op, int cols_op)
{
    const uint64_t r = x->trans ? x->cols : x->rows, c = x->trans ? x->rows : x->cols;
    return r == (uint64_t)rows_op && c == (uint64_t)cols_op && x->ld >= (int64_t)x->rows &&
           x->ld >= 1;
}

static void test_plan(void)
{
    for (int it = 0; it < 400; it++) {
        const int ta = it & 1, tb = (it >> 1) & 1;
        const int M = 1 + irand(9), N = 1 + irand(9), K = 1 + irand(9);
        const int lda = (ta ? M : K) + irand(3), ldb = (tb ? K : N) + irand(3), ldc = N + irand(3);
        const float alpha = (float)(1 + irand(3)), beta = (float)irand(3);
        const size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb,
                     nc = (size_t)M * ldc;
        float *A = malloc(na * sizeof *A), *B = malloc(nb * sizeof *B);
        float *C1 = malloc(nc * sizeof *C1), *C2 = malloc(nc * sizeof *C2);
        for (size_t i = 0; i < na; i++)
            A[i] = (float)(irand(7) - 3);
        for (size_t i = 0; i < nb; i++)
            B[i] = (float)(irand(7) - 3);
        for (size_t i = 0; i < nc; i++)
            C1[i] = C2[i] = (float)(irand(7) - 3);
        const nl_lt_plan p = nl_lt_plan_make(ta, tb, M, N, K, lda, ldb, ldc);
        CHECK(p.m == N && p.n == M && p.k == K && layout_ok(&p.a, p.m, p.k) &&
                  layout_ok(&p.b, p.k, p.n) && layout_ok(&p.c, p.m, p.n) && !p.c.trans,
              "plan %d %d (M %d N %d K %d): layouts cuBLASLt would refuse", ta, tb, M, N, K);
        rowmajor_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C1, ldc);
        colmajor_gemm(&p, alpha, B, A, beta, C2); /* its A is our B */
        CHECK(memcmp(C1, C2, nc * sizeof *C1) == 0,
              "plan trans %d %d M %d N %d K %d lda %d ldb %d ldc %d: not backend.h's product", ta,
              tb, M, N, K, lda, ldb, ldc);
        free(A);
        free(B);
        free(C1);
        free(C2);
    }
}

/* ---------------------------------------------------------------- pieces */

struct run {
    int ta, tb, lda, ldb, ldc, a_conv, b_conv;
    size_t cap;
    float alpha, beta;
    const float *A, *B;
    float *C;
    int *hits; /* M x N x K: times each (i, j, p) was covered */
    int M, N, K;
    int bad_fit, bad_first;
};

static void one_piece(void *arg, const nl_bf16_piece *pc)
{
    struct run *r = arg;
    /* A's converted piece padded to 128 elements, then B's: the backend's layout */
    const size_t need = (r->a_conv ? ((size_t)pc->m * pc->k + 127) / 128 * 128 : 0) +
                        (r->b_conv ? (size_t)pc->k * pc->n : 0);
    r->bad_fit += need > r->cap + 128;
    r->bad_first += pc->first_k != (pc->k0 == 0);
    for (int i = 0; i < pc->m; i++)
        for (int j = 0; j < pc->n; j++)
            for (int p = 0; p < pc->k; p++)
                r->hits[((size_t)(pc->m0 + i) * r->N + pc->n0 + j) * r->K + pc->k0 + p]++;
    const float *a =
        r->ta ? r->A + (size_t)pc->k0 * r->lda + pc->m0 : r->A + (size_t)pc->m0 * r->lda + pc->k0;
    const float *b =
        r->tb ? r->B + (size_t)pc->n0 * r->ldb + pc->k0 : r->B + (size_t)pc->k0 * r->ldb + pc->n0;
    rowmajor_gemm(r->ta, r->tb, pc->m, pc->n, pc->k, r->alpha, a, r->lda, b, r->ldb,
                  pc->first_k ? r->beta : 1.0f, r->C + (size_t)pc->m0 * r->ldc + pc->n0, r->ldc);
}

static void test_chunks(void)
{
    for (int it = 0; it < 600; it++) {
        struct run r = {0};
        r.ta = irand(2);
        r.tb = irand(2);
        r.a_conv = irand(2);
        r.b_conv = irand(2);
        r.M = 1 + irand(20);
        r.N = 1 + irand(20);
        r.K = 1 + irand(20);
        r.cap = 2 + (size_t)irand(it % 3 == 0 ? 12 : 300);
        r.lda = (r.ta ? r.M : r.K) + irand(2);
        r.ldb = (r.tb ? r.K : r.N) + irand(2);
        r.ldc = r.N + irand(2);
        r.alpha = (float)(1 + irand(2));
        r.beta = (float)irand(3);
        int mc, nc, kc;
        nl_bf16_chunks(r.M, r.N, r.K, r.a_conv, r.b_conv, r.cap, &mc, &nc, &kc);
        CHECK(mc >= 1 && mc <= r.M && nc >= 1 && nc <= r.N && kc >= 1 && kc <= r.K,
              "chunks M %d N %d K %d cap %zu: %d %d %d", r.M, r.N, r.K, r.cap, mc, nc, kc);
        if (!r.a_conv && !r.b_conv)
            CHECK(mc == r.M && nc == r.N && kc == r.K, "weights only: cut %d %d %d", mc, nc, kc);
        const size_t na = (size_t)(r.ta ? r.K : r.M) * r.lda,
                     nb = (size_t)(r.tb ? r.N : r.K) * r.ldb, ncn = (size_t)r.M * r.ldc;
        float *A = malloc(na * sizeof *A), *B = malloc(nb * sizeof *B);
        float *C1 = malloc(ncn * sizeof *C1), *C2 = malloc(ncn * sizeof *C2);
        r.hits = calloc((size_t)r.M * r.N * r.K, sizeof *r.hits);
        for (size_t i = 0; i < na; i++)
            A[i] = (float)(irand(5) - 2);
        for (size_t i = 0; i < nb; i++)
            B[i] = (float)(irand(5) - 2);
        for (size_t i = 0; i < ncn; i++)
            C1[i] = C2[i] = (float)(irand(5) - 2);
        r.A = A;
        r.B = B;
        r.C = C2;
        rowmajor_gemm(r.ta, r.tb, r.M, r.N, r.K, r.alpha, A, r.lda, B, r.ldb, r.beta, C1, r.ldc);
        nl_bf16_for_pieces(r.M, r.N, r.K, mc, nc, kc, one_piece, &r);
        int once = 1;
        for (size_t i = 0; i < (size_t)r.M * r.N * r.K; i++)
            once &= r.hits[i] == 1;
        CHECK(once, "pieces (%d %d %d of %d %d %d) do not cover each product once", mc, nc, kc, r.M,
              r.N, r.K);
        CHECK(r.bad_fit == 0, "%d pieces overflow a scratch of %zu (a %d b %d; %d %d %d)",
              r.bad_fit, r.cap, r.a_conv, r.b_conv, mc, nc, kc);
        CHECK(r.bad_first == 0, "first_k wrong");
        CHECK(memcmp(C1, C2, ncn * sizeof *C1) == 0,
              "cut GEMM (%d %d %d of %d %d %d, beta %g) differs from the whole", mc, nc, kc, r.M,
              r.N, r.K, r.beta);
        free(A);
        free(B);
        free(C1);
        free(C2);
        free(r.hits);
    }
    /* the shapes of a model: a head's input gradient (dlogits 8192 x 32768
     * against the head) and its weight gradient fit 32 Mi elements */
    int mc, nc, kc;
    nl_bf16_chunks(8192, 768, 32768, 1, 0, (size_t)32 << 20, &mc, &nc, &kc);
    CHECK(mc == 1024 && nc == 768 && kc == 32768, "head dx: %d %d %d", mc, nc, kc);
    nl_bf16_chunks(32768, 768, 8192, 1, 1, (size_t)32 << 20, &mc, &nc, &kc);
    CHECK(mc == 32768 && nc == 768 && kc == (32 << 20) / (32768 + 768), "head dW: %d %d %d", mc, nc,
          kc);
}

/* which GEMMs the plain gemm hands to the rows kernel: a decode's y = x W^T */
static void test_takes_rows(void)
{
    for (int M = 1; M < NL_CUDA_ROWS_GEMM; M++) {
        CHECK(nl_cuda_gemm_takes_rows(0, 1, M, 64, 1.0f, 0.0f), "M %d overwriting", M);
        CHECK(nl_cuda_gemm_takes_rows(0, 1, M, 64, 1.0f, 1.0f), "M %d accumulating", M);
    }
    CHECK(!nl_cuda_gemm_takes_rows(0, 1, NL_CUDA_ROWS_GEMM, 64, 1.0f, 0.0f), "16 rows: cuBLAS");
    CHECK(!nl_cuda_gemm_takes_rows(0, 1, 0, 64, 1.0f, 0.0f), "no rows");
    CHECK(!nl_cuda_gemm_takes_rows(1, 1, 1, 64, 1.0f, 0.0f), "A transposed: cuBLAS");
    CHECK(!nl_cuda_gemm_takes_rows(0, 0, 1, 64, 1.0f, 0.0f), "B as stored (K, N): cuBLAS");
    CHECK(!nl_cuda_gemm_takes_rows(0, 1, 1, 0, 1.0f, 0.0f), "K 0: only C scaled");
    CHECK(!nl_cuda_gemm_takes_rows(0, 1, 1, 64, 0.5f, 0.0f), "alpha 0.5 (an adapter): cuBLAS");
    CHECK(!nl_cuda_gemm_takes_rows(0, 1, 1, 64, 1.0f, 0.5f), "beta 0.5: cuBLAS");
}

/* the per-expert GEMMs' algorithm buckets (NL_CUDA_LT_BUCKET) */
static void test_bucket_rows(void)
{
    int prev = 0, buckets = 0;
    for (int M = 1; M <= 65536; M++) {
        const int b = nl_lt_bucket_rows(M);
        const int slack = M / 8 > 64 ? M / 8 : 64;
        CHECK(b >= M && b < M + slack, "M %d: bucket %d (slack %d)", M, b, slack);
        CHECK(b >= prev, "M %d: bucket %d after %d", M, b, prev);
        CHECK(nl_lt_bucket_rows(b) == b, "M %d: bucket %d is not its own", M, b);
        buckets += M <= 8192 && b != prev;
        prev = b;
    }
    /* bench-large's 8192 tokens top-2 over 8 experts: any count 1..8192 */
    CHECK(buckets <= 48, "%d buckets for 1..8192 rows", buckets);
    CHECK(nl_lt_bucket_rows(2048) == 2048 && nl_lt_bucket_rows(2049) == 2304 &&
              nl_lt_bucket_rows(1900) == 1920 && nl_lt_bucket_rows(7) == 64,
          "buckets of 2048, 2049, 1900, 7: %d %d %d %d", nl_lt_bucket_rows(2048),
          nl_lt_bucket_rows(2049), nl_lt_bucket_rows(1900), nl_lt_bucket_rows(7));
    CHECK(nl_lt_bucket_rows(INT32_MAX) == INT32_MAX, "the largest M: %d",
          nl_lt_bucket_rows(INT32_MAX));
    /* a bucketed entry's layouts are made at the bucket's rows and sized
     * to M per call: only b's and c's columns (and n) may differ */
    for (int tb = 0; tb < 2; tb++) {
        const int M = 1900, N = 4096, K = 768, ldb = tb ? K : N;
        const nl_lt_plan r = nl_lt_plan_make(0, tb, M, N, K, K, ldb, N);
        const nl_lt_plan q = nl_lt_plan_make(0, tb, nl_lt_bucket_rows(M), N, K, K, ldb, N);
        CHECK(r.m == q.m && r.k == q.k && r.a.trans == q.a.trans && r.a.rows == q.a.rows &&
                  r.a.cols == q.a.cols && r.a.ld == q.a.ld && r.b.trans == q.b.trans &&
                  r.b.rows == q.b.rows && r.b.ld == q.b.ld && r.c.rows == q.c.rows &&
                  r.c.ld == q.c.ld,
              "tb %d: the bucket's plan differs beyond the columns", tb);
        CHECK(r.n == M && r.b.cols == (uint64_t)M && r.c.cols == (uint64_t)M,
              "tb %d: M is n, b's and c's columns", tb);
    }
    /* a per-expert weight gradient (A transposed, B not): its depth K */
    {
        const int M = 4096, N = 768, K = 1900;
        const nl_lt_plan r = nl_lt_plan_make(1, 0, M, N, K, M, N, N);
        const nl_lt_plan q = nl_lt_plan_make(1, 0, M, N, nl_lt_bucket_rows(K), M, N, N);
        CHECK(r.m == q.m && r.n == q.n && r.a.trans == q.a.trans && r.a.rows == q.a.rows &&
                  r.a.ld == q.a.ld && r.b.trans == q.b.trans && r.b.rows == q.b.rows &&
                  r.b.ld == q.b.ld && r.c.rows == q.c.rows && r.c.cols == q.c.cols &&
                  r.c.ld == q.c.ld,
              "wgrad: the bucket's plan differs beyond the columns");
        CHECK(r.k == K && r.a.cols == (uint64_t)K && r.b.cols == (uint64_t)K,
              "wgrad: K is k, a's and b's columns");
    }
}

int main(void)
{
    test_plan();
    test_chunks();
    test_takes_rows();
    test_bucket_rows();
    return check_done("test_cuda_gemm_plan");
}
