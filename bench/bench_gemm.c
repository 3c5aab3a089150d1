/* GEMM throughput of oneDNN's dnnl_sgemm against OpenBLAS's cblas_sgemm on
 * the shapes the model runs: square products, the training and prefill
 * shapes (many rows), and single rows (decode). Prints one JSON line per
 * shape with GFLOP/s of each, so the choice of library rests on a
 * measurement. Run: build/bench/bench_gemm [threads] */
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
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

/* C[M,N] = A[M,K] B[N,K]^T, as the model's y = x W^T */
static double run(int lib, int M, int N, int K, const float *A, const float *B, float *C)
{
    int reps = 0;
    double t0 = now_s(), t;
    do {
        if (lib == 0)
            dnnl_sgemm('N', 'T', M, N, K, 1.0f, A, K, B, K, 0.0f, C, N);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, A, K, B, K, 0.0f,
                        C, N);
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
    static const int shapes[][3] = {{2048, 2048, 2048}, {2048, 384, 256}, {2048, 8192, 256},
                                    {512, 1024, 256},   {512, 256, 512},  {1, 1024, 256},
                                    {1, 8192, 256},     {1, 256, 512},    {16, 384, 256}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        int M = shapes[i][0], N = shapes[i][1], K = shapes[i][2];
        float *A = calloc((size_t)M * K, 4), *B = calloc((size_t)N * K, 4), *C = calloc((size_t)M * N, 4);
        for (size_t j = 0; j < (size_t)M * K; j++)
            A[j] = (float)(j % 7) * 0.1f;
        for (size_t j = 0; j < (size_t)N * K; j++)
            B[j] = (float)(j % 5) * 0.1f;
        run(0, M, N, K, A, B, C); /* warm-up */
        run(1, M, N, K, A, B, C);
        double g0 = run(0, M, N, K, A, B, C), g1 = run(1, M, N, K, A, B, C);
        printf("{\"M\":%d,\"N\":%d,\"K\":%d,\"threads\":%d,\"dnnl_gflops\":%.1f,"
               "\"openblas_gflops\":%.1f,\"ratio\":%.2f}\n",
               M, N, K, threads, g0, g1, g0 / g1);
        free(A);
        free(B);
        free(C);
    }
    return 0;
}
