/* The CPU backend's FP32 GEMM: the gemm slot at NL_CPU_DOT_ROWS rows and
 * more (and whenever B is not transposed, or alpha or beta are not 1/0),
 * and gemm_rows without a transposed B. C = alpha op(A) op(B) + beta C,
 * row-major, where every element of C is one fixed chain of operations:
 *
 *   s = beta == 0 ? 0 : beta == 1 ? C[i][j] : beta * C[i][j]
 *   for k = 0, 1, ..., K - 1:
 *       s = fmaf(a, op(B)[k][j], s),  a = op(A)[i][k] (times alpha,
 *                                      rounded, when alpha is not 1)
 *   C[i][j] = s
 *
 * whatever M, N, the tiling, the number of threads or the vector width
 * are. So a row's bits depend only on that row of A (and of C) and on
 * op(B): the GEMM is row invariant (gemm_rows, the batch's padding,
 * embeddings that do not depend on their batch) and gives the same bits
 * on any thread count (a verifier's single thread redoes a stage's
 * microbatch exactly: docs/security.md). oneDNN's dnnl_sgemm, which this
 * replaced, gives neither on a CPU without AVX-512: its AVX2 path splits
 * K across threads for some shapes and takes other kernels for other M.
 * tests/test_cpu_gemm.c checks every element against the chain on 1, 2
 * and 3 threads, tests/test_batch.c gemm_rows row by row.
 *
 * The loops are the usual blocked ones (B packed in blocks of KC x NC,
 * A in blocks of MC x KC, a 6 x 16 tile of C in 12 AVX2 accumulators);
 * the chain goes on across K blocks through C itself (stored and loaded
 * exactly), and a tile at the edge of C runs the same kernel on a copy
 * padded with zeros; at MS rows or fewer, where there are columns
 * enough, the threads split the columns instead (few_rows). bf16 GEMMs stay oneDNN's (cpu_bf16.c).
 */
#include "kernels/cpu/cpu_math.h"
#include "kernels/cpu/cpu_ops.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NL_MM_AVX2 1
#endif

enum {
    MR = 6,    /* rows of a tile */
    NR = 16,   /* columns of a tile (two AVX2 vectors) */
    KC = 256,  /* depth of a packed block */
    MC = 96,   /* rows of a packed block of A (16 tiles) */
    NC = 2048, /* columns of a packed block of B */
    MS = 192   /* at most this many rows: the few rows' loop (all of A per block of K) */
};

_Static_assert(MS >= MC && MS % MR == 0, "a thread's block of A holds MS rows, MC's too");

/* How a tile's chain starts at the first block of K. */
enum { START_ZERO, START_C, START_BETA_C };

/* C (MR x NR at c, stride ldc) from its start, then kc steps of the chain
 * over a packed panel of A (kc x MR) and of B (kc x NR). Unsanitized
 * (NL_HOT): tile() checks the memory it hands over. */
#ifdef NL_MM_AVX2
NL_HOT static void kernel(int kc, const float *ap, const float *bp, float *c, int ldc, int start,
                          float beta)
{
    __m256 s[MR][2];
    if (start == START_ZERO) {
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++)
            s[r][0] = s[r][1] = _mm256_setzero_ps();
    } else {
        const __m256 b = _mm256_set1_ps(beta);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            s[r][0] = _mm256_loadu_ps(c + (size_t)r * ldc);
            s[r][1] = _mm256_loadu_ps(c + (size_t)r * ldc + 8);
            if (start == START_BETA_C) {
                s[r][0] = _mm256_mul_ps(s[r][0], b);
                s[r][1] = _mm256_mul_ps(s[r][1], b);
            }
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < kc; k++, ap += MR, bp += NR) {
        const __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const __m256 a = _mm256_broadcast_ss(ap + r);
            s[r][0] = _mm256_fmadd_ps(a, b0, s[r][0]);
            s[r][1] = _mm256_fmadd_ps(a, b1, s[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(c + (size_t)r * ldc, s[r][0]);
        _mm256_storeu_ps(c + (size_t)r * ldc + 8, s[r][1]);
    }
}
#else
/* the same chain in portable C (a build without AVX2 and FMA) */
NL_HOT static void kernel(int kc, const float *ap, const float *bp, float *c, int ldc, int start,
                          float beta)
{
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++) {
            float s = start == START_ZERO ? 0.0f : c[(size_t)r * ldc + j];
            if (start == START_BETA_C)
                s *= beta;
            for (int k = 0; k < kc; k++)
                s = fmaf(ap[(size_t)k * MR + r], bp[(size_t)k * NR + j], s);
            c[(size_t)r * ldc + j] = s;
        }
}
#endif

/* A tile of mr x nr (at most MR x NR) of C: in place when whole, else
 * through a zero-padded copy, so its elements see the same operations. */
static void tile(int mr, int nr, int kc, const float *ap, const float *bp, float *c, int ldc,
                 int start, float beta)
{
    nl_hot_rows(ap, 1, 0, (size_t)kc * MR * sizeof(float), 0);
    nl_hot_rows(bp, 1, 0, (size_t)kc * NR * sizeof(float), 0);
    if (mr == MR && nr == NR) {
        nl_hot_rows(c, MR, (size_t)ldc * sizeof(float), NR * sizeof(float), 1);
        kernel(kc, ap, bp, c, ldc, start, beta);
        return;
    }
    float t[MR * NR] __attribute__((aligned(32))) = {0};
    if (start != START_ZERO)
        for (int r = 0; r < mr; r++)
            memcpy(t + r * NR, c + (size_t)r * ldc, (size_t)nr * sizeof(float));
    kernel(kc, ap, bp, t, NR, start, beta);
    for (int r = 0; r < mr; r++)
        memcpy(c + (size_t)r * ldc, t + r * NR, (size_t)nr * sizeof(float));
}

#ifdef NL_MM_AVX2
/* dst[q * ldd + r] = src[r * lds + q] for r, q < 8 */
static inline void transpose8(const float *src, int lds, float *dst, int ldd)
{
    __m256 r[8], t[8], u[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        r[i] = _mm256_loadu_ps(src + (size_t)i * lds);
#pragma GCC unroll 4
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
#pragma GCC unroll 2
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + (size_t)i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (size_t)(i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}
#endif

/* Panel p of NR columns (from column j0) of op(B)'s rows k0 .. k0+kc-1,
 * as kc rows of NR floats, zero past column N. */
static void pack_b(float *dst, int trans_b, const float *B, int ldb, int k0, int kc, int j0, int N)
{
    const int nr = N - j0 < NR ? N - j0 : NR;
    if (!trans_b) {
        for (int k = 0; k < kc; k++, dst += NR) {
            memcpy(dst, B + (size_t)(k0 + k) * ldb + j0, (size_t)nr * sizeof(float));
            for (int j = nr; j < NR; j++)
                dst[j] = 0.0f;
        }
        return;
    }
    /* B's rows are the columns here: read each along k */
    int k = 0;
#ifdef NL_MM_AVX2
    if (nr == NR) /* 8 x 8 blocks transposed in registers */
        for (; k + 8 <= kc; k += 8)
            for (int h = 0; h < NR; h += 8) {
                const float *b = B + (size_t)(j0 + h) * ldb + k0 + k;
                transpose8(b, ldb, dst + (size_t)k * NR + h, NR);
            }
#endif
    for (int j = 0; j < NR; j++) {
        if (j >= nr) { /* past N: zeros (no pointer to a column that is not there) */
            for (int kk = k; kk < kc; kk++)
                dst[(size_t)kk * NR + j] = 0.0f;
            continue;
        }
        const float *b = B + (size_t)(j0 + j) * ldb + k0;
        for (int kk = k; kk < kc; kk++)
            dst[(size_t)kk * NR + j] = b[kk];
    }
}

/* Rows i0 .. i0+mc-1 of op(A), columns k0 .. k0+kc-1, as panels of MR
 * rows (each kc steps of MR floats), times alpha when it is not 1, zero
 * past row M. */
static void pack_a(float *dst, int trans_a, const float *A, int lda, int i0, int mc, int M, int k0,
                   int kc, float alpha)
{
    for (int p = 0; p < mc; p += MR, dst += (size_t)kc * MR) {
        const int i = i0 + p, mr = M - i < MR ? M - i : MR;
        if (trans_a) { /* A's rows are k: MR consecutive floats each */
            for (int k = 0; k < kc; k++) {
                const float *a = A + (size_t)(k0 + k) * lda + i;
                for (int r = 0; r < MR; r++)
                    dst[(size_t)k * MR + r] = r < mr ? (alpha == 1.0f ? a[r] : a[r] * alpha) : 0.0f;
            }
            continue;
        }
        for (int r = 0; r < MR; r++) {
            if (r >= mr) { /* past M: zeros (no pointer to a row that is not there) */
                for (int k = 0; k < kc; k++)
                    dst[(size_t)k * MR + r] = 0.0f;
                continue;
            }
            const float *a = A + (size_t)(i + r) * lda + k0;
            for (int k = 0; k < kc; k++)
                dst[(size_t)k * MR + r] = alpha == 1.0f ? a[k] : a[k] * alpha;
        }
    }
}

/* Each thread's part of the buffer: a block of A (MS rows, which holds
 * MC's too) and a panel of B (the few rows' loop). */
#define THREAD_FLOATS ((size_t)MS * KC + (size_t)KC * NR)

size_t nl_cpu_matmul_floats(int threads)
{
    return (size_t)KC * NC + THREAD_FLOATS * (size_t)(threads > 0 ? threads : 1);
}

/* Few rows (M <= MS): the team splits B's panels, each thread packs all
 * of A's rows once per block of K and each of its panels of B just
 * before it runs them (in L1 while all of M's tiles use it), with no
 * shared buffer and no barrier: B, read once from memory, is most of the
 * work's traffic. The same chains as the blocked loop. */
static void few_rows(nl_backend *be, int team, int trans_a, int trans_b, int M, int N, int K,
                     float alpha, const float *A, int lda, const float *B, int ldb, int s0,
                     float beta, float *C, int ldc)
{
    float *buf = ((nl_cpu_ctx *)be->ctx)->gemm_buf + (size_t)KC * NC;
    const int panels = (N + NR - 1) / NR;
#pragma omp parallel num_threads(team) if (team > 1)
    {
        const int me = omp_get_thread_num(), n = omp_get_num_threads();
        float *ap = buf + THREAD_FLOATS * (size_t)me, *bpan = ap + (size_t)MS * KC;
        const int p0 = (int)((int64_t)panels * me / n), p1 = (int)((int64_t)panels * (me + 1) / n);
        for (int pc = 0; pc < K && p0 < p1; pc += KC) {
            const int kc = K - pc < KC ? K - pc : KC;
            const int start = pc == 0 ? s0 : START_C;
            pack_a(ap, trans_a, A, lda, 0, M, M, pc, kc, alpha);
            for (int p = p0; p < p1; p++) {
                const int j0 = p * NR, nr = N - j0 < NR ? N - j0 : NR;
                pack_b(bpan, trans_b, B, ldb, pc, kc, j0, N);
                for (int q = 0; q < M; q += MR)
                    tile(M - q < MR ? M - q : MR, nr, kc, ap + (size_t)q * kc, bpan,
                         C + (size_t)q * ldc + j0, ldc, start, beta);
            }
        }
    }
}

void nl_cpu_gemm_chain(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                       const float *A, int lda, const float *B, int ldb, float beta, float *C,
                       int ldc)
{
    if (M <= 0 || N <= 0)
        return;
    const int s0 = beta == 0.0f ? START_ZERO : beta == 1.0f ? START_C : START_BETA_C;
    if (K <= 0) { /* the chain's start alone */
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                float *c = C + (size_t)i * ldc + j;
                *c = s0 == START_ZERO ? 0.0f : s0 == START_C ? *c : *c * beta;
            }
        return;
    }
    const int tiles = (M + MR - 1) / MR;
    /* a team only where each thread gets real work */
    const int threads = nl_cpu_threads(be);
    const int team = threads > 1 && (double)M * N * K >= 2.5e5 ? threads : 1;
    if (M <= MS && (N + NR - 1) / NR >= 2 * team) {
        few_rows(be, team, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, s0, beta, C, ldc);
        return;
    }
    /* blocks of A of at most MC rows, their tiles shared out evenly, as
     * many as a multiple of the team where there are tiles enough for it
     * (else the team splits B's panels too) */
    int m_blocks = (tiles * MR + MC - 1) / MC;
    if (tiles >= 4 * team)
        m_blocks = (m_blocks + team - 1) / team * team;
    float *bp = ((nl_cpu_ctx *)be->ctx)->gemm_buf;
#pragma omp parallel num_threads(team) if (team > 1)
    {
        const int me = omp_get_thread_num();
        float *ap = bp + (size_t)KC * NC + THREAD_FLOATS * (size_t)me;
        for (int jc = 0; jc < N; jc += NC) {
            const int nc = N - jc < NC ? N - jc : NC;
            const int panels = (nc + NR - 1) / NR;
            /* enough tasks for the team: blocks of A times groups of B's panels */
            int groups = m_blocks >= team ? 1 : (team + m_blocks - 1) / m_blocks;
            groups = groups > panels ? panels : groups;
            const int per_group = (panels + groups - 1) / groups;
            for (int pc = 0; pc < K; pc += KC) {
                const int kc = K - pc < KC ? K - pc : KC;
                const int start = pc == 0 ? s0 : START_C;
#pragma omp for schedule(static)
                for (int p = 0; p < panels; p++)
                    pack_b(bp + (size_t)p * kc * NR, trans_b, B, ldb, pc, kc, jc + p * NR, N);
#pragma omp for schedule(static) collapse(2)
                for (int mb = 0; mb < m_blocks; mb++)
                    for (int g = 0; g < groups; g++) {
                        const int ic = (int)((int64_t)mb * tiles / m_blocks) * MR;
                        const int i1 = (int)((int64_t)(mb + 1) * tiles / m_blocks) * MR;
                        const int mc = (i1 < M ? i1 : M) - ic;
                        const int p0 = g * per_group;
                        const int p1 = p0 + per_group < panels ? p0 + per_group : panels;
                        if (p0 >= p1)
                            continue;
                        pack_a(ap, trans_a, A, lda, ic, mc, M, pc, kc, alpha);
                        for (int p = p0; p < p1; p++) {
                            const int j0 = jc + p * NR, nr = N - j0 < NR ? N - j0 : NR;
                            for (int q = 0; q < mc; q += MR) {
                                const int mr = mc - q < MR ? mc - q : MR;
                                tile(mr, nr, kc, ap + (size_t)q * kc, bp + (size_t)p * kc * NR,
                                     C + (size_t)(ic + q) * ldc + j0, ldc, start, beta);
                            }
                        }
                    }
            }
        }
    }
}

void nl_cpu_gemm_rows(nl_backend *be, int trans_b, int M, int N, int K, const float *A, int lda,
                      const float *B, int ldb, int accumulate, float *C, int ldc)
{
    if (M <= 0 || N <= 0)
        return;
    if (trans_b) { /* the model's products: the dot-product kernel at every M */
        nl_cpu_gemm_dot(be, M, N, K, A, lda, B, ldb, accumulate, C, ldc);
        return;
    }
    nl_cpu_gemm_chain(be, 0, 0, M, N, K, 1.0f, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C, ldc);
}
