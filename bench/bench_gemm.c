/* GEMM throughput of the CPU backend's own GEMMs against oneDNN's
 * dnnl_sgemm and OpenBLAS's cblas_sgemm on the shapes the model runs:
 * square products, the training and prefill shapes (many rows), single
 * rows (decode) and the backward's transposes. The backend's gemm
 * (kernels/cpu/cpu_matmul.c's chain GEMM, the dot-product kernel of
 * cpu_dot.c below 16 rows) and its gemm_rows (the dot kernel at every M
 * with B transposed, which a stage's batch runs) beside them. Prints one
 * JSON line per shape with GFLOP/s of each, so the choice rests on a
 * measurement.
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

static nl_backend *be; /* the CPU backend, for its gemm and gemm_rows */

/* C[M,N] = op(A) op(B): lib 0 dnnl_sgemm, 1 OpenBLAS, 2 the backend's
 * gemm_rows (without trans_a), 3 the backend's gemm. A is (M, K), or
 * (K, M) with ta; B is (N, K) with tb, else (K, N). */
static double run(int lib, int ta, int tb, int M, int N, int K, const float *A, const float *B,
                  float *C)
{
    const int lda = ta ? M : K, ldb = tb ? K : N;
    int reps = 0;
    double t0 = now_s(), t;
    do {
        if (lib == 3)
            be->gemm(be, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N);
        else if (lib == 2)
            be->gemm_rows(be, tb, M, N, K, A, lda, B, ldb, 0, C, N);
        else if (lib == 0)
            dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N);
        else
            cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                        tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N);
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
    /* (ta, tb, M, N, K): the model's y = x W^T (0, 1), square and
     * training/prefill rows, then bench-large's decode shapes (d 768: QKV,
     * output, experts' gate/up and down, head) at 1 to 4 rows, and its
     * forward at batch 2 x 256 (QKV, an expert's 128 rows, head); then the
     * backward's dX = dY W (0, 0) and dW = dY^T X (1, 0) at training
     * rows */
    static const int shapes[][5] = {
        {0, 1, 2048, 2048, 2048}, {0, 1, 2048, 384, 256}, {0, 1, 2048, 8192, 256},
        {0, 1, 512, 1024, 256},   {0, 1, 512, 256, 512},  {0, 1, 1, 1024, 256},
        {0, 1, 1, 8192, 256},     {0, 1, 1, 256, 512},    {0, 1, 16, 384, 256},
        {0, 1, 1, 1280, 768},     {0, 1, 1, 768, 768},    {0, 1, 1, 4096, 768},
        {0, 1, 1, 768, 2048},     {0, 1, 1, 8192, 768},   {0, 1, 2, 1280, 768},
        {0, 1, 4, 1280, 768},     {0, 1, 4, 4096, 768},   {0, 1, 512, 1280, 768},
        {0, 1, 128, 4096, 768},   {0, 1, 128, 768, 2048}, {0, 1, 512, 8192, 768},
        {0, 0, 2048, 768, 2304},  {0, 0, 2048, 256, 384}, {0, 0, 512, 768, 2048},
        {1, 0, 2304, 768, 2048},  {1, 0, 384, 256, 2048}, {1, 0, 2048, 768, 512}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int ta = shapes[i][0], tb = shapes[i][1];
        const int M = shapes[i][2], N = shapes[i][3], K = shapes[i][4];
        float *A = calloc((size_t)M * K, 4), *B = calloc((size_t)N * K, 4),
              *C = calloc((size_t)M * N, 4);
        for (size_t j = 0; j < (size_t)M * K; j++)
            A[j] = (float)(j % 7) * 0.1f;
        for (size_t j = 0; j < (size_t)N * K; j++)
            B[j] = (float)(j % 5) * 0.1f;
        run(0, ta, tb, M, N, K, A, B, C); /* warm-up */
        run(1, ta, tb, M, N, K, A, B, C);
        run(3, ta, tb, M, N, K, A, B, C);
        double g0 = run(0, ta, tb, M, N, K, A, B, C), g1 = run(1, ta, tb, M, N, K, A, B, C);
        double g3 = run(3, ta, tb, M, N, K, A, B, C);
        double g2 = ta ? 0.0 : run(2, ta, tb, M, N, K, A, B, C);
        printf("{\"ta\":%d,\"tb\":%d,\"M\":%d,\"N\":%d,\"K\":%d,\"threads\":%d,"
               "\"dnnl_gflops\":%.1f,\"openblas_gflops\":%.1f,\"ratio\":%.2f,"
               "\"gemm_gflops\":%.1f,\"gemm_over_dnnl\":%.2f,\"rows_gflops\":%.1f,"
               "\"rows_over_dnnl\":%.2f}\n",
               ta, tb, M, N, K, threads, g0, g1, g0 / g1, g3, g3 / g0, g2, g2 / g0);
        fflush(stdout);
        free(A);
        free(B);
        free(C);
    }
    nl_backend_destroy(&be);
    return 0;
}
