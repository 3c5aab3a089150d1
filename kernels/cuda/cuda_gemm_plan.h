/* Private to kernels/cuda: the pure arithmetic of the bf16 dense GEMM
 * (cuda_backend.cu), apart so that tests/test_cuda_gemm_plan.c checks it
 * on the CPU without cuBLASLt:
 *
 *  - nl_lt_plan_make: the cuBLASLt parameters (operations, matrix layouts,
 *    m, n, k) of backend.h's row-major C[M,N] = alpha op(A) op(B) + beta C.
 *    cuBLASLt is column-major, and a row-major matrix with row stride ld
 *    is, read column-major with leading dimension ld, its transpose. So the
 *    call computes C^T = op(B)^T op(A)^T: cuBLASLt's A is our B and its B
 *    our A, (m, n, k) = (N, M, K), and each layout describes the stored
 *    matrix read column-major (rows = its row length, cols = its row count).
 *  - nl_bf16_chunks: how a GEMM whose FP32 activation operands are
 *    converted into the backend's fixed bf16 scratch is cut so that each
 *    piece's converted operands fit: along M when only A needs scratch,
 *    along N when only B does, along K (beta on the first piece, then 1)
 *    when both do (a weight gradient), then along the others if still too
 *    large.
 *  - nl_cuda_gemm_takes_rows: whether gemm hands a call to the gemm_rows
 *    kernel (cuda_rows.cu) instead of cuBLAS: a decode's few rows of
 *    y = x W^T, the products gemm_rows computes.
 *  - nl_lt_bucket_rows: the row count a per-expert GEMM's cuBLASLt
 *    algorithm is chosen for (NL_CUDA_LT_BUCKET, cuda_gemm.cu).
 *
 * Header-only C (static inline), no CUDA header. */
#ifndef NL_CUDA_GEMM_PLAN_H
#define NL_CUDA_GEMM_PLAN_H

#include <stddef.h>
#include <stdint.h>

/* One matrix as cuBLASLt sees it: column-major rows x cols, leading
 * dimension ld (>= rows), and whether the op transposes it. */
typedef struct nl_lt_matrix {
    int trans;
    uint64_t rows, cols;
    int64_t ld;
} nl_lt_matrix;

typedef struct nl_lt_plan {
    int m, n, k;    /* cuBLASLt's: op(a) is m x k, op(b) k x n, c m x n */
    nl_lt_matrix a; /* our B */
    nl_lt_matrix b; /* our A */
    nl_lt_matrix c; /* our C (and D) */
} nl_lt_plan;

/* Row-major op(A) (M x K), op(B) (K x N), C (M x N), row strides lda,
 * ldb, ldc, as backend.h's gemm. */
static inline nl_lt_plan nl_lt_plan_make(int trans_a, int trans_b, int M, int N, int K, int lda,
                                         int ldb, int ldc)
{
    nl_lt_plan p;
    p.m = N;
    p.n = M;
    p.k = K;
    /* B stored (K, N) row-major reads column-major as (N, K) = B^T = op(B)^T;
     * stored (N, K) (trans_b) reads as (K, N) = B^T, transposed to B */
    p.a.trans = trans_b != 0;
    p.a.rows = (uint64_t)(trans_b ? K : N);
    p.a.cols = (uint64_t)(trans_b ? N : K);
    p.a.ld = ldb;
    /* A stored (M, K) reads as (K, M) = op(A)^T; stored (K, M) (trans_a)
     * reads as (M, K) = A^T, transposed to A = op(A)^T */
    p.b.trans = trans_a != 0;
    p.b.rows = (uint64_t)(trans_a ? M : K);
    p.b.cols = (uint64_t)(trans_a ? K : M);
    p.b.ld = lda;
    p.c.trans = 0;
    p.c.rows = (uint64_t)N;
    p.c.cols = (uint64_t)M;
    p.c.ld = ldc;
    return p;
}

/* Piece sizes (*mc, *nc, *kc, each >= 1 and at most M, N, K) such that the
 * scratch a piece needs, a_conv ? mc kc : 0 plus b_conv ? kc nc : 0 bf16
 * elements, is at most cap (cap >= 2). */
static inline void nl_bf16_chunks(int M, int N, int K, int a_conv, int b_conv, size_t cap, int *mc,
                                  int *nc, int *kc)
{
    size_t m = (size_t)M, n = (size_t)N, k = (size_t)K;
    if (a_conv && b_conv) {
        /* a weight gradient: the summed dimension (pieces of K add into
         * C); M and N only when one row of each does not fit */
        if (m + n > cap) {
            if (n <= cap / 2)
                m = cap - n;
            else if (m <= cap / 2)
                n = cap - m;
            else {
                m = cap / 2;
                n = cap - m;
            }
        }
        if ((m + n) * k > cap)
            k = cap / (m + n); /* >= 1: m + n <= cap */
    } else if (a_conv) {
        if (m * k > cap) {
            m = cap / k;
            if (m < 1) {
                m = 1;
                k = cap;
            }
        }
    } else if (b_conv) {
        if (n * k > cap) {
            n = cap / k;
            if (n < 1) {
                n = 1;
                k = cap;
            }
        }
    }
    *mc = (int)m;
    *nc = (int)n;
    *kc = (int)k;
}

/* One piece of a cut GEMM: rows m0 .. m0 + m of C, columns n0 .. n0 + n,
 * the summed range k0 .. k0 + k; first_k: the first piece of K (it applies
 * beta; later ones add with beta 1); new_a: the first piece of this (m0,
 * k0), where A's part changes (a converted A is converted then, and kept
 * for the pieces of N that follow). */
typedef struct nl_bf16_piece {
    int m0, n0, k0, m, n, k;
    int first_k, new_a;
} nl_bf16_piece;

/* Call fn for each piece of the (mc, nc, kc) cut of an M x N x K GEMM, K
 * outermost, then M, then N: the order the backend queues them. */
static inline void nl_bf16_for_pieces(int M, int N, int K, int mc, int nc, int kc,
                                      void (*fn)(void *arg, const nl_bf16_piece *pc), void *arg)
{
    for (int k0 = 0; k0 < K; k0 += kc)
        for (int m0 = 0; m0 < M; m0 += mc)
            for (int n0 = 0; n0 < N; n0 += nc) {
                nl_bf16_piece pc;
                pc.m0 = m0;
                pc.n0 = n0;
                pc.k0 = k0;
                pc.m = M - m0 < mc ? M - m0 : mc;
                pc.n = N - n0 < nc ? N - n0 : nc;
                pc.k = K - k0 < kc ? K - k0 : kc;
                pc.first_k = k0 == 0;
                pc.new_a = n0 == 0;
                fn(arg, &pc);
            }
}

/* gemm below this many rows runs the gemm_rows kernel: NL_BACKEND_FUSED_ROWS
 * (cuda_gemm.cu checks they agree), so a decode step's every product is
 * row invariant, as the CPU's are below its NL_CPU_DOT_ROWS (also 16) */
#define NL_CUDA_ROWS_GEMM 16

/* 1 when gemm's C = alpha A op(B) + beta C is gemm_rows' product: B
 * transposed, A not, alpha 1, beta 0 or 1 (accumulate), 1 to
 * NL_CUDA_ROWS_GEMM - 1 rows, a K to sum over */
static inline int nl_cuda_gemm_takes_rows(int trans_a, int trans_b, int M, int K, float alpha,
                                          float beta)
{
    return M > 0 && M < NL_CUDA_ROWS_GEMM && !trans_a && trans_b && K > 0 && alpha == 1.0f &&
           (beta == 0.0f || beta == 1.0f);
}

/* The rows M (> 0) of a per-expert GEMM (A not transposed) rounded up to
 * a multiple of an eighth of M's power of two, at least 64: the M for
 * which cuBLASLt's heuristic chooses the algorithm that the GEMM of M rows
 * then runs. A routing gives every expert a new row count each step of
 * training, and each new (M, N, K) is a new cuBLASLt problem (its
 * heuristic, a host call, again); with the counts of a bucket sharing one
 * choice, a few keys per projection serve every step. The bucket is at
 * least M and less than M + max(64, M / 8). A weight gradient per expert
 * (trans_a 1, trans_b 0) buckets its depth K the same way. Either only
 * sets columns of the plan's layouts (b's and c's for M, a's and b's for
 * K), which cuBLASLt's leading dimensions do not bound. */
static inline int nl_lt_bucket_rows(int M)
{
    if (M <= 64)
        return 64;
    int64_t p = 1;
    while (p * 2 <= (int64_t)M)
        p *= 2;
    const int64_t step = p / 8 > 64 ? p / 8 : 64;
    const int64_t b = ((int64_t)M + step - 1) / step * step;
    return b <= INT32_MAX ? (int)b : M;
}

#endif
