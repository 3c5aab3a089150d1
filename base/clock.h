/* The monotonic clock, the one the project times and waits by: in
 * milliseconds for deadlines and timeouts, with the fraction of a
 * millisecond for timing work, and in seconds. */
#ifndef NL_CLOCK_H
#define NL_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline int64_t nl_mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline double nl_mono_ms_f(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static inline double nl_mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif
