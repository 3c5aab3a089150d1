/* GEMM throughput of oneDNN's dnnl_sgemm against OpenBLAS's cblas_sgemm on
 * the shapes the model runs: square products, the training and prefill
 * shapes (many rows), and single rows (decode); and the CPU backend's
 * row-invariant GEMM (gemm_rows: the dot-product kernel of
 * kernels/cpu/cpu_dot.c) beside them, which a stage's batch runs at every
 * M and a decode at few rows. Prints one JSON line per shape with GFLOP/s
 * of each, so the choice of library rests on a measurement.
 * Run: build/bench/bench_gemm [threads] */
#include "kernels/backend.h"

#include <cblas.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void openblas_set_num_threads(int);

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static nl_backend *be; /* the CPU backend, for its gemm_rows */

/* C[M,N] = A[M,K] B[N,K]^T, as the model's y = x W^T */
static double run(int lib, int M, int N, int K, const float *A, const float *B, float *C)
{
    int reps = 0;
    double t0 = now_s(), t;
    do {
        if (lib == 2)
            be->gemm_rows(be, 1, M, N, K, A, K, B, K, 0, C, N);
        else if (lib == 0)
            dnnl_sgemm('N', 'T', M, N, K, 1.0f, A, K, B, K, 0.0f, C, N);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, A, K, B, K, 0.0f, C,
                        N);
        reps++;
        t = now_s();
    } while (t - t0 < 0.5 || reps < 3);
    return 2.0 * M * N * (double)K * reps / (t - t0) / 1e9;
}

int main(int argc, char **argv)
{
    int threads = argc > 1 ? atoi(argv[1]) : omp_get_num_procs();
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    nl_error err = {0};
    if (nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = threads}, &err) != NL_OK) {
        fprintf(stderr, "bench_gemm: %s\n", err.msg);
        return 1;
    }
    /* bench-large's decode shapes (d 768): QKV, output, experts' gate/up
     * and down, head; at 1 to 4 rows */
    static const int shapes[][3] = {
        {2048, 2048, 2048}, {2048, 384, 256}, {2048, 8192, 256}, {512, 1024, 256}, {512, 256, 512},
        {1, 1024, 256},     {1, 8192, 256},   {1, 256, 512},     {16, 384, 256},   {1, 1280, 768},
        {1, 768, 768},      {1, 4096, 768},   {1, 768, 2048},    {1, 8192, 768},   {2, 1280, 768},
        {4, 1280, 768},     {4, 4096, 768},   {512, 1280, 768}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        int M = shapes[i][0], N = shapes[i][1], K = shapes[i][2];
        float *A = calloc((size_t)M * K, 4), *B = calloc((size_t)N * K, 4),
              *C = calloc((size_t)M * N, 4);
        for (size_t j = 0; j < (size_t)M * K; j++)
            A[j] = (float)(j % 7) * 0.1f;
        for (size_t j = 0; j < (size_t)N * K; j++)
            B[j] = (float)(j % 5) * 0.1f;
        run(0, M, N, K, A, B, C); /* warm-up */
        run(1, M, N, K, A, B, C);
        run(2, M, N, K, A, B, C);
        double g0 = run(0, M, N, K, A, B, C), g1 = run(1, M, N, K, A, B, C);
        double g2 = run(2, M, N, K, A, B, C);
        printf("{\"M\":%d,\"N\":%d,\"K\":%d,\"threads\":%d,\"dnnl_gflops\":%.1f,"
               "\"openblas_gflops\":%.1f,\"ratio\":%.2f,\"rows_gflops\":%.1f,"
               "\"rows_over_dnnl\":%.2f}\n",
               M, N, K, threads, g0, g1, g0 / g1, g2, g2 / g0);
        free(A);
        free(B);
        free(C);
    }
    nl_backend_destroy(&be);
    return 0;
}
