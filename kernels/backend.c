/* Backend-independent helpers: destroy, check, the host staging views,
 * and the GEMM throughput probe that nodes report when they join and that
 * benchmarks use as the peak. The factory, which picks and builds a
 * backend, is kernels/backend_factory.c. */
#include "kernels/backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"

void nl_backend_destroy(nl_backend **be)
{
    if (!be || !*be)
        return;
    (*be)->destroy(*be);
    *be = NULL;
}

nl_status nl_backend_check(nl_backend *be, nl_error *err)
{
    return be->check ? be->check(be, err) : NL_OK;
}

/* ---------------------------------------------------------------- host staging */

static void *stage_reserve(nl_host_stage *st, size_t bytes, nl_error *err)
{
    if (bytes > st->cap || !st->p) {
        void *p = malloc(bytes ? bytes : 1);
        if (!p) {
            nl_error_set(err, NL_ERR_NOMEM, "out of memory for a host copy of %zu bytes", bytes);
            return NULL;
        }
        free(st->p);
        st->p = p;
        st->cap = bytes;
    }
    return st->p;
}

const void *nl_backend_read_view(nl_backend *be, nl_host_stage *st, const void *dev, size_t bytes,
                                 nl_error *err)
{
    if (be->host_memory)
        return dev;
    void *h = stage_reserve(st, bytes, err);
    if (!h)
        return NULL;
    be->download(be, h, dev, bytes);
    return nl_backend_check(be, err) == NL_OK ? h : NULL;
}

void *nl_backend_write_view(nl_backend *be, nl_host_stage *st, void *dev, size_t bytes,
                            nl_error *err)
{
    return be->host_memory ? dev : stage_reserve(st, bytes, err);
}

void nl_backend_write_back(nl_backend *be, void *dev, const void *view, size_t bytes)
{
    if (view != dev)
        be->upload(be, dev, view, bytes);
    else if (be->wrote)
        be->wrote(be, dev, bytes); /* written in place: no upload saw it */
}

const void *nl_backend_device_view(nl_backend *be, void *dev_stage, const void *src, size_t bytes)
{
    if (be->host_memory && (uintptr_t)src % sizeof(float) == 0)
        return src;
    be->upload(be, dev_stage, src, bytes);
    return dev_stage;
}

void nl_host_stage_free(nl_host_stage *st)
{
    if (!st)
        return;
    free(st->p);
    st->p = NULL;
    st->cap = 0;
}

/* ---------------------------------------------------------------- probe */

/* The process's CPU time (every thread's) over `threads`, in seconds. */
static double cpu_s(int threads)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ((double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec) / threads;
}

/* threads 0: timed by the wall clock; else by cpu_s(threads) */
static double gemm_gflops(nl_backend *be, int M, int N, int K, double seconds, int threads)
{
    float *A = be->alloc(be, (size_t)M * K * sizeof(float));
    float *B = be->alloc(be, (size_t)N * K * sizeof(float));
    float *C = be->alloc(be, (size_t)M * N * sizeof(float));
    double gflops = 0.0;
    if (!A || !B || !C)
        goto out;
    /* one warm-up call, then as many as fit in `seconds` */
    be->gemm(be, 0, 1, M, N, K, 1.0f, A, K, B, K, 0.0f, C, N);
    if (be->sync(be, NULL) != NL_OK)
        goto out;
    /* the round lasts `seconds` by the wall clock either way (a node on a
     * busy machine starts no later); with threads the reps are timed by
     * the CPU time they took */
    int reps = 0;
    const double c0 = threads ? cpu_s(threads) : 0.0;
    double t0 = nl_mono_s(), t = t0;
    do {
        be->gemm(be, 0, 1, M, N, K, 1.0f, A, K, B, K, 0.0f, C, N);
        if (be->sync(be, NULL) != NL_OK)
            goto out;
        reps++;
        t = nl_mono_s();
    } while (t - t0 < seconds);
    const double spent = threads ? cpu_s(threads) - c0 : t - t0;
    if (spent > 0)
        gflops = 2.0 * M * N * (double)K * reps / spent / 1e9;
out:
    be->free(be, A);
    be->free(be, B);
    be->free(be, C);
    return gflops;
}

double nl_backend_gemm_gflops(nl_backend *be, int M, int N, int K, double seconds)
{
    return gemm_gflops(be, M, N, K, seconds, 0);
}

double nl_backend_gemm_gflops_cpu(nl_backend *be, int M, int N, int K, double seconds, int threads)
{
    return gemm_gflops(be, M, N, K, seconds, threads > 0 ? threads : 1);
}
