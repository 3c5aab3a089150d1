/* Backend-independent helpers: the factory (the one constructor, which
 * loads the CUDA module on demand), destroy, check, and the GEMM
 * throughput probe that nodes report when they join and that benchmarks
 * use as the peak. */
#include "backend.h"
#include "backend_impl.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

/* ---------------------------------------------------------------- factory */

/* "cuda:N" -> N; -1 when device is not of that form. */
static int cuda_index(const char *device)
{
    if (strncmp(device, "cuda:", 5) != 0 || device[5] < '0' || device[5] > '9')
        return -1;
    char *end;
    errno = 0;
    long n = strtol(device + 5, &end, 10);
    if (*end || errno || n > 1024)
        return -1;
    return (int)n;
}

nl_status nl_backend_parse_device(const char *device, nl_error *err)
{
    if (!device || !*device)
        return nl_error_set(err, NL_ERR_INVALID, "device: empty (use cpu, cpu-devsim or cuda:N)");
    if (strcmp(device, "cpu") == 0 || strcmp(device, "cpu-devsim") == 0 || cuda_index(device) >= 0)
        return NL_OK;
    return nl_error_set(err, NL_ERR_INVALID, "device %s: unknown (use cpu, cpu-devsim or cuda:N)",
                        device);
}

/* The CUDA module: found next to the program (../lib or the same folder,
 * as the build tree and an install lay it out), at the build's own path,
 * or where NL_CUDA_LIB says; dlopen's search path last. */
static void *open_cuda_module(char *tried, size_t cap)
{
    char exe[PATH_MAX], path[PATH_MAX + 64];
    const char *env = getenv("NL_CUDA_LIB");
    const char *cands[5];
    int nc = 0;
    if (env && *env)
        cands[nc++] = env;
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    char dir[PATH_MAX] = "";
    if (len > 0) {
        exe[len] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            snprintf(dir, sizeof dir, "%s", exe);
        }
    }
    char c1[PATH_MAX + 64], c2[PATH_MAX + 64];
    if (*dir) {
        snprintf(c1, sizeof c1, "%s/../lib/libnl_cuda.so", dir);
        snprintf(c2, sizeof c2, "%s/libnl_cuda.so", dir);
        cands[nc++] = c1;
        cands[nc++] = c2;
    }
#ifdef NL_CUDA_MODULE_PATH
    cands[nc++] = NL_CUDA_MODULE_PATH;
#endif
    cands[nc++] = "libnl_cuda.so";
    tried[0] = '\0';
    int found = 0;
    for (int i = 0; i < nc; i++) {
        snprintf(path, sizeof path, "%s", cands[i]);
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h)
            return h;
        /* keep the failure of the first candidate that exists (it names a
         * missing cudart or cuBLAS), else the first failure */
        const char *why = dlerror();
        const int exists = strchr(path, '/') && access(path, F_OK) == 0;
        if (!tried[0] || (exists && !found)) {
            found |= exists;
            size_t n = strlen(why ? why : path);
            n = n < cap - 1 ? n : cap - 1;
            memcpy(tried, why ? why : path, n);
            tried[n] = '\0';
        }
    }
    return NULL;
}

static nl_status cuda_new(nl_backend **out, const char *device, int index, const nl_backend_opts *o,
                          nl_error *err)
{
    char why[512];
    void *h = open_cuda_module(why, sizeof why);
    if (!h)
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "%s: no CUDA backend in this build or install (libnl_cuda.so: %s); "
                            "build with the CUDA toolkit (NL_CUDA=ON) or use --device cpu",
                            device, why);
    nl_cuda_module_abi_fn abi = (nl_cuda_module_abi_fn)dlsym(h, "nl_cuda_module_abi");
    nl_cuda_backend_new_fn make = (nl_cuda_backend_new_fn)dlsym(h, "nl_cuda_backend_new");
    if (!abi || !make) {
        dlclose(h);
        return nl_error_set(err, NL_ERR_VERSION, "%s: libnl_cuda.so lacks its entry points",
                            device);
    }
    if (abi() != NL_BACKEND_ABI) {
        int a = abi();
        dlclose(h);
        return nl_error_set(err, NL_ERR_VERSION,
                            "%s: libnl_cuda.so was built for backend ABI %d, this program has %d",
                            device, a, NL_BACKEND_ABI);
    }
    /* the module stays loaded for the life of the process: unloading cudart
     * while the driver holds its threads is not safe */
    return make(out, index, o, err);
}

nl_status nl_backend_new(nl_backend **out, const char *device, const nl_backend_opts *o,
                         nl_error *err)
{
    *out = NULL;
    nl_backend_opts def = {0};
    if (!o)
        o = &def;
    nl_status st = nl_backend_parse_device(device, err);
    if (st != NL_OK)
        return st;
    if (o->threads < 0)
        return nl_error_set(err, NL_ERR_INVALID, "threads: %d is negative", o->threads);
    if (strcmp(device, "cpu") == 0)
        return nl_cpu_backend_new(out, o, err);
    if (strcmp(device, "cpu-devsim") == 0)
        return nl_devsim_backend_new(out, o, err);
    return cuda_new(out, device, cuda_index(device), o, err);
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

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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
    double t0 = now_s(), t = t0;
    do {
        be->gemm(be, 0, 1, M, N, K, 1.0f, A, K, B, K, 0.0f, C, N);
        if (be->sync(be, NULL) != NL_OK)
            goto out;
        reps++;
        t = now_s();
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
