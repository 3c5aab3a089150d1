/* A minimal test harness: CHECK records a failure and goes on, so one run
 * reports every broken case; check_done prints "N passed, N failed" and
 * returns the exit code. Paths: NL_SOURCE_DIR and NL_BUILD_DIR come from
 * CTest's environment. Backend: check_backend_new makes the one named by
 * NL_TEST_DEVICE ("cpu" unless set; "cpu-devsim" makes any host read of
 * device memory fault), and tests read device memory only through
 * check_download. */
#ifndef NL_TEST_CHECK_H
#define NL_TEST_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"

static int check_pass_count, check_fail_count;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            check_pass_count++;                                                                    \
        } else {                                                                                   \
            check_fail_count++;                                                                    \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

/* CHECK that an nl_status call returned NL_OK, printing the error. */
#define CHECK_OK(call, errp)                                                                       \
    do {                                                                                           \
        nl_status st_ = (call);                                                                    \
        CHECK(st_ == NL_OK, "%s: %s", nl_status_str(st_), (errp)->msg);                            \
    } while (0)

static inline int check_done(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, check_pass_count, check_fail_count);
    return check_fail_count ? 1 : 0;
}

static inline const char *check_source_dir(void)
{
    const char *d = getenv("NL_SOURCE_DIR");
    return d ? d : ".";
}

static inline const char *check_build_dir(void)
{
    const char *d = getenv("NL_BUILD_DIR");
    return d ? d : ".";
}

/* The device the tests run on: env NL_TEST_DEVICE, "cpu" when unset. */
static inline const char *check_device(void)
{
    const char *d = getenv("NL_TEST_DEVICE");
    return d && *d ? d : "cpu";
}

/* Create the backend named by NL_TEST_DEVICE with `threads` threads. */
static inline nl_status check_backend_new(nl_backend **be, int threads, nl_error *err)
{
    nl_backend_opts o; /* no compound literal: C++ tests include this too */
    memset(&o, 0, sizeof o);
    o.threads = threads;
    return nl_backend_new(be, check_device(), &o, err);
}

/* A malloc'd host copy of n floats of device memory (NULL when out of
 * memory, or when dev is NULL); the caller frees it. */
static inline float *check_download(nl_backend *be, const float *dev, size_t n)
{
    float *h = dev ? (float *)malloc((n ? n : 1) * sizeof *h) : NULL;
    if (h)
        be->download(be, h, dev, n * sizeof *h);
    return h;
}

/* Relative norm-wise error ||a - b|| / max(||b||, tiny). */
static inline double check_rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return sqrt(num) / (den > 1e-30 ? sqrt(den) : 1e-15);
}

static inline double check_max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > m || d != d)
            m = d;
    }
    return m;
}

#endif
