/* The batched decoder alone (core/model/batch.c, issue 17): the time of one
 * nl_batch_forward decode step of N rows (N sequences, one token each,
 * PAST cached positions each) on a model of CONFIG, best of REPS, the row
 * counts interleaved; and where the time goes, by GEMM shape (the
 * backend's gemm slot, timed around each call).
 *   bench_batch CONFIG [THREADS [REPS [PAST]]]     (default 1 40 16)
 * env: ROWS (row counts, default "1 2 4 8 16 32"), NO_GEMM_ROWS (set: the
 * padded sgemm path of a backend without gemm_rows). */
#include "core/model/batch.h"
#include "core/model/config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAXN 32
#define SHAPES 64

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* time per GEMM shape (M, N, K) inside the timed steps */
static struct {
    int M, N, K;
    long calls;
    double s;
} shape[SHAPES];
static int timing;
static void (*inner_gemm)(nl_backend *, int, int, int, int, int, float, const float *, int,
                          const float *, int, float, float *, int);

static void (*inner_rows)(nl_backend *, int, int, int, int, const float *, int, const float *, int,
                          int, float *, int);

static void count(int M, int N, int K, double t0)
{
    if (!timing)
        return;
    int i = 0;
    while (i < SHAPES && shape[i].calls && !(shape[i].M == M && shape[i].N == N && shape[i].K == K))
        i++;
    if (i == SHAPES)
        return;
    shape[i].M = M, shape[i].N = N, shape[i].K = K;
    shape[i].calls++;
    shape[i].s += now() - t0;
}

static void timed_rows(nl_backend *be, int tb, int M, int N, int K, const float *A, int lda,
                       const float *B, int ldb, int acc, float *C, int ldc)
{
    const double t0 = timing ? now() : 0.0;
    inner_rows(be, tb, M, N, K, A, lda, B, ldb, acc, C, ldc);
    count(M, N, K, t0);
}

static void timed_gemm(nl_backend *be, int ta, int tb, int M, int N, int K, float alpha,
                       const float *A, int lda, const float *B, int ldb, float beta, float *C,
                       int ldc)
{
    const double t0 = timing ? now() : 0.0;
    inner_gemm(be, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    count(M, N, K, t0);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench_batch CONFIG [THREADS [REPS [PAST]]]\n");
        return 2;
    }
    const int threads = argc > 2 ? atoi(argv[2]) : 1, reps = argc > 3 ? atoi(argv[3]) : 40;
    const int past = argc > 4 ? atoi(argv[4]) : 16;
    int ns[6] = {1, 2, 4, 8, 16, 32}, nn = 6;
    if (getenv("ROWS")) { /* ROWS="1 16": only those row counts (up to 6, each 1 .. 32) */
        char *p = getenv("ROWS"), *end;
        nn = 0;
        for (long v; nn < 6 && (v = strtol(p, &end, 10)) > 0 && v <= MAXN && end != p; p = end)
            ns[nn++] = (int)v;
        if (nn == 0)
            ns[nn++] = 1;
    }
    nl_error err = {0};
    nl_config c;
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_batch *b = NULL;
    nl_kvcache *kv[MAXN] = {0};
    int rc = 1;
    if (nl_config_load_yaml(&c, argv[1], &err) != NL_OK ||
        nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = threads}, &err) != NL_OK)
        goto out;
    inner_gemm = be->gemm;
    be->gemm = timed_gemm; /* before nl_batch_new, which copies the table */
    inner_rows = be->gemm_rows;
    if (getenv("NO_GEMM_ROWS")) /* the padded sgemm path, as on a backend without gemm_rows */
        inner_rows = NULL;
    be->gemm_rows = inner_rows ? timed_rows : NULL;
    if (nl_model_new(&m, be, &c, 0, c.num_layers, 1, 1, &err) != NL_OK ||
        nl_model_init_random(m, 1, &err) != NL_OK || nl_batch_new(&b, m, MAXN, &err) != NL_OK)
        goto out;
    int32_t tok[MAXN];
    for (int i = 0; i < MAXN; i++)
        if (nl_kvcache_new(&kv[i], m, 1, past + reps + 8, NL_KV_FP32, &err) != NL_OK)
            goto out;
    double best[6];
    for (int j = 0; j < nn; j++)
        best[j] = 1e9;
    for (int r = -1; r < reps; r++) { /* r = -1: warm-up */
        for (int j = 0; j < nn; j++) {
            nl_batch_seg segs[MAXN];
            for (int i = 0; i < ns[j]; i++) {
                kv[i]->len = past; /* decode at the same position every time */
                tok[i] = (int32_t)((i * 37 + r * 11 + 5) % c.vocab_size);
                if (tok[i] < 0)
                    tok[i] += (int32_t)c.vocab_size;
                segs[i] = (nl_batch_seg){kv[i], &tok[i], 1, 1};
            }
            timing = r >= 0 && ns[j] == ns[nn - 1];
            const double t0 = now();
            if (nl_batch_forward(b, segs, ns[j], &err) != NL_OK)
                goto out;
            const double t = now() - t0;
            timing = 0;
            if (r >= 0 && t < best[j])
                best[j] = t;
        }
    }
    printf("config %s, threads %d, best of %d, past %d\n", argv[1], threads, reps, past);
    for (int j = 0; j < nn; j++)
        printf("rows %2d: %7.3f ms/step  %7.1f rows/s  %.2fx one row\n", ns[j], 1e3 * best[j],
               ns[j] / best[j], ns[j] / best[j] * best[0]);
    printf("%d-row steps, gemm time by shape (M N K: calls per step, ms per step):\n", ns[nn - 1]);
    double tot = 0.0;
    for (int i = 0; i < SHAPES && shape[i].calls; i++)
        tot += shape[i].s / reps;
    printf("  all: %.3f ms per step\n", 1e3 * tot);
    for (int i = 0; i < SHAPES && shape[i].calls; i++)
        printf("  %4d %5d %4d: %6.1f %7.3f\n", shape[i].M, shape[i].N, shape[i].K,
               (double)shape[i].calls / reps, 1e3 * shape[i].s / reps);
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "bench_batch: %s\n", err.msg);
    for (int i = 0; i < MAXN; i++)
        nl_kvcache_destroy(&kv[i]);
    nl_batch_destroy(&b);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    return rc;
}
