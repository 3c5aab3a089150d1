/* The CPU backend's dot-product GEMM: C (M, N) = A (M, K) B^T, with B
 * given as (N, K) row-major (the model's y = x W^T), overwriting C or
 * adding to it. Every element of C is one dot product computed the same
 * way whatever M, N, the tiling or the threads are:
 *   eight lanes, lane l the FMA chain over k = l, l + 8, ... below K8
 *   (K rounded down to 8), summed as ((l0+l4) + (l2+l6)) + ((l1+l5) +
 *   (l3+l7)), then the last K - K8 products added one by one with fmaf,
 *   then C's old value added (when accumulating).
 * So a row's result does not depend on how many rows share the call:
 * the row invariance batch invariance rests on (core/model/batch.h), at the
 * speed of a plain GEMM at one to a few rows (decode), where a blocked
 * GEMM (cpu_matmul.c's) wastes most of its tiles. Both the plain gemm
 * slot (for few rows) and gemm_rows (every M) run it, so a session
 * decoded alone (`neuroctl generate`) and one decoded in a stage's batch
 * get the same bits.
 *
 * Tiles of up to 3 rows by 4 columns keep 12 accumulators, 3 rows of A
 * and a row of B in the 16 AVX2 registers; columns go in panels that
 * keep their part of B in L2, and threads take whole panels. Without
 * AVX2 and FMA (a portable build) the same order is computed in C. */
#include "kernels/cpu/cpu_ops.h"

#include <math.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NL_DOT_AVX2 1
#endif

enum { MR = 3, NR = 4, PANEL_BYTES = 128 * 1024 };

/* the tail of K and the store, shared by both paths: r is the lanes' sum */
static inline void finish(float r, int k, int K, const float *a, const float *b, int acc, float *c)
{
    for (; k < K; k++)
        r = fmaf(a[k], b[k], r);
    *c = acc ? *c + r : r;
}

#ifdef NL_DOT_AVX2
static inline float lanes_sum(__m256 v)
{
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s)); /* (s0+s2, s1+s3) */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/* an mr x nr tile (mr <= MR, nr <= NR, constants once inlined) */
static inline __attribute__((always_inline)) void tile(int mr, int nr, int K, const float *A,
                                                       int lda, const float *B, int ldb, int acc,
                                                       float *C, int ldc)
{
    __m256 s[MR][NR];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++)
            s[i][j] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 a[MR];
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++)
            a[i] = _mm256_loadu_ps(A + (size_t)i * lda + k);
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) {
            const __m256 b = _mm256_loadu_ps(B + (size_t)j * ldb + k);
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++)
                s[i][j] = _mm256_fmadd_ps(a[i], b, s[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            finish(lanes_sum(s[i][j]), k, K, A + (size_t)i * lda, B + (size_t)j * ldb, acc,
                   C + (size_t)i * ldc + j);
}
#else
/* the same order in portable C: lanes, their sum, the tail */
static void tile(int mr, int nr, int K, const float *A, int lda, const float *B, int ldb, int acc,
                 float *C, int ldc)
{
    const int K8 = K & ~7;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            const float *a = A + (size_t)i * lda, *b = B + (size_t)j * ldb;
            float l[8] = {0};
            for (int k = 0; k < K8; k += 8)
                for (int q = 0; q < 8; q++)
                    l[q] = fmaf(a[k + q], b[k + q], l[q]);
            const float s0 = l[0] + l[4], s1 = l[1] + l[5], s2 = l[2] + l[6], s3 = l[3] + l[7];
            finish((s0 + s2) + (s1 + s3), K8, K, a, b, acc, C + (size_t)i * ldc + j);
        }
}
#endif

/* each tile shape as a function of its own, its loops unrolled */
typedef void tile_fn(int K, const float *A, int lda, const float *B, int ldb, int acc, float *C,
                     int ldc);
#define TILE(R, Q)                                                                                 \
    static void tile_##R##_##Q(int K, const float *A, int lda, const float *B, int ldb, int acc,   \
                               float *C, int ldc)                                                  \
    {                                                                                              \
        tile(R, Q, K, A, lda, B, ldb, acc, C, ldc);                                                \
    }
TILE(1, 1)
TILE(1, 2)
TILE(1, 3)
TILE(1, 4)
TILE(2, 1)
TILE(2, 2)
TILE(2, 3)
TILE(2, 4)
TILE(3, 1)
TILE(3, 2)
TILE(3, 3)
TILE(3, 4)
#undef TILE
static tile_fn *const tiles[MR][NR] = {{tile_1_1, tile_1_2, tile_1_3, tile_1_4},
                                       {tile_2_1, tile_2_2, tile_2_3, tile_2_4},
                                       {tile_3_1, tile_3_2, tile_3_3, tile_3_4}};

#ifdef NL_DOT_AVX2
/* Where the CPU has AVX-512 (checked at run time: the build targets
 * x86-64-v3), a zmm register holds the eight lanes of two elements, C[i][j]
 * in its low half and C[i][j + 1] in its high half: each half is the same
 * FMA chain as an AVX2 register's, summed the same way (lanes_sum), so the
 * bits do not depend on the CPU's ISA either; 32 registers hold tiles of 4
 * rows by 4 pairs of columns (16 accumulators), reading A and B half as
 * often per product as the AVX2 tiles. */
#define NL_AVX512 __attribute__((target("avx512f,avx512dq"), always_inline))
enum { MR5 = 4, NP5 = 4 };

static inline NL_AVX512 void tile512(int mr, int np, int K, const float *A, int lda, const float *B,
                                     int ldb, int acc, float *C, int ldc)
{
    __m512 s[MR5][NP5];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int p = 0; p < np; p++)
            s[i][p] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m512 a[MR5];
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) /* A's eight in both halves */
            a[i] = _mm512_broadcast_f32x8(_mm256_loadu_ps(A + (size_t)i * lda + k));
#pragma GCC unroll 4
        for (int p = 0; p < np; p++) {
            const float *b = B + (size_t)2 * p * ldb + k;
            const __m512 bb = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(b)),
                                                 _mm256_loadu_ps(b + ldb), 1);
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++)
                s[i][p] = _mm512_fmadd_ps(a[i], bb, s[i][p]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                const __m256 v =
                    h ? _mm512_extractf32x8_ps(s[i][p], 1) : _mm512_castps512_ps256(s[i][p]);
                finish(lanes_sum(v), k, K, A + (size_t)i * lda, B + (size_t)(2 * p + h) * ldb, acc,
                       C + (size_t)i * ldc + 2 * p + h);
            }
}

#define TILE5(R, P)                                                                                \
    __attribute__((target("avx512f,avx512dq"))) static void tile5_##R##_##P(                       \
        int K, const float *A, int lda, const float *B, int ldb, int acc, float *C, int ldc)       \
    {                                                                                              \
        tile512(R, P, K, A, lda, B, ldb, acc, C, ldc);                                             \
    }
TILE5(1, 1)
TILE5(1, 2)
TILE5(1, 3)
TILE5(1, 4)
TILE5(2, 1)
TILE5(2, 2)
TILE5(2, 3)
TILE5(2, 4)
TILE5(3, 1)
TILE5(3, 2)
TILE5(3, 3)
TILE5(3, 4)
TILE5(4, 1)
TILE5(4, 2)
TILE5(4, 3)
TILE5(4, 4)
#undef TILE5
static tile_fn *const tiles5[MR5][NP5] = {{tile5_1_1, tile5_1_2, tile5_1_3, tile5_1_4},
                                          {tile5_2_1, tile5_2_2, tile5_2_3, tile5_2_4},
                                          {tile5_3_1, tile5_3_2, tile5_3_3, tile5_3_4},
                                          {tile5_4_1, tile5_4_2, tile5_4_3, tile5_4_4}};

/* rows [0, M) of columns [j0, j1) in AVX-512 tiles; an odd last column in
 * AVX2's */
static void panel512(int M, int j0, int j1, int K, const float *A, int lda, const float *B, int ldb,
                     int acc, float *C, int ldc)
{
    const int pairs_end = j0 + (j1 - j0) / 2 * 2;
    for (int i = 0; i < M; i += MR5) {
        const int mr = M - i < MR5 ? M - i : MR5;
        for (int j = j0; j < pairs_end; j += 2 * NP5) {
            const int np = (pairs_end - j) / 2 < NP5 ? (pairs_end - j) / 2 : NP5;
            tiles5[mr - 1][np - 1](K, A + (size_t)i * lda, lda, B + (size_t)j * ldb, ldb, acc,
                                   C + (size_t)i * ldc + j, ldc);
        }
        for (int r = 0; pairs_end < j1 && r < mr; r += MR) {
            const int m3 = mr - r < MR ? mr - r : MR;
            tiles[m3 - 1][0](K, A + (size_t)(i + r) * lda, lda, B + (size_t)pairs_end * ldb, ldb,
                             acc, C + (size_t)(i + r) * ldc + pairs_end, ldc);
        }
    }
}
#endif

/* rows [0, M) of columns [j0, j1) */
static void panel(int M, int j0, int j1, int K, const float *A, int lda, const float *B, int ldb,
                  int acc, float *C, int ldc)
{
    for (int i = 0; i < M; i += MR) {
        const int mr = M - i < MR ? M - i : MR;
        for (int j = j0; j < j1; j += NR) {
            const int nr = j1 - j < NR ? j1 - j : NR;
            tiles[mr - 1][nr - 1](K, A + (size_t)i * lda, lda, B + (size_t)j * ldb, ldb, acc,
                                  C + (size_t)i * ldc + j, ldc);
        }
    }
}

/* -1: not yet asked; then whether the AVX-512 tiles run (atomic: backends
 * on several threads may make their first product at once) */
static int use_avx512 = -1;

int nl_cpu_dot_avx512(int want)
{
    int on = 0;
#ifdef NL_DOT_AVX2
    __builtin_cpu_init();
    on = want && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
#else
    (void)want;
#endif
    __atomic_store_n(&use_avx512, on, __ATOMIC_RELAXED);
    return on;
}

void nl_cpu_gemm_dot(nl_backend *be, int M, int N, int K, const float *A, int lda, const float *B,
                     int ldb, int accumulate, float *C, int ldc)
{
    if (M <= 0 || N <= 0)
        return;
    const size_t row_bytes = (size_t)(K > 0 ? K : 1) * sizeof(float);
    int cols = (int)(PANEL_BYTES / row_bytes) / NR * NR;
    cols = cols < NR ? NR : cols;
    const int threads = nl_cpu_threads(be);
    /* a team only where each thread gets real work (at one row, 128 KB of
     * weights or more): a decode step's router (N = experts) is not worth
     * the wake-up; then panels small enough that every thread has one */
    const int team = threads > 1 && N >= 2 * 8 && (double)M * N * K >= 3.2e4;
    if (team) {
        const int share = ((N + threads - 1) / threads + 7) / 8 * 8;
        cols = share < cols ? share : cols;
    }
    const int panels = (N + cols - 1) / cols;
    void (*run)(int, int, int, int, const float *, int, const float *, int, int, float *, int) =
        panel;
#ifdef NL_DOT_AVX2
    int on = __atomic_load_n(&use_avx512, __ATOMIC_RELAXED);
    if (on < 0)
        on = nl_cpu_dot_avx512(1);
    if (on)
        run = panel512;
#endif
#pragma omp parallel for NL_CPU_TEAM(be) schedule(static) if (team)
    for (int p = 0; p < panels; p++) {
        const int j0 = p * cols, j1 = N - j0 < cols ? N : j0 + cols;
        run(M, j0, j1, K, A, lda, B, ldb, accumulate != 0, C, ldc);
    }
}
