/* Backend-independent helpers: destroy, and the GEMM throughput probe
 * that nodes report when they join and that benchmarks use as the peak. */
#include "backend.h"

#include <stdlib.h>
#include <time.h>

void nl_backend_destroy(nl_backend **be)
{
    if (!be || !*be)
        return;
    (*be)->destroy(*be);
    *be = NULL;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double nl_backend_gemm_gflops(nl_backend *be, int M, int N, int K, double seconds)
{
    float *A = be->alloc(be, (size_t)M * K * sizeof(float));
    float *B = be->alloc(be, (size_t)N * K * sizeof(float));
    float *C = be->alloc(be, (size_t)M * N * sizeof(float));
    double gflops = 0.0;
    if (!A || !B || !C)
        goto out;
    /* one warm-up call, then as many as fit in `seconds` */
    be->gemm(be, 0, 1, M, N, K, 1.0f, A, K, B, K, 0.0f, C, N);
    be->sync(be);
    int reps = 0;
    double t0 = now_s(), t = t0;
    do {
        be->gemm(be, 0, 1, M, N, K, 1.0f, A, K, B, K, 0.0f, C, N);
        be->sync(be);
        reps++;
        t = now_s();
    } while (t - t0 < seconds);
    gflops = 2.0 * M * N * (double)K * reps / (t - t0) / 1e9;
out:
    be->free(be, A);
    be->free(be, B);
    be->free(be, C);
    return gflops;
}
