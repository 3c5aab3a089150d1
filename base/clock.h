/* The monotonic clock in milliseconds, for deadlines and timeouts. */
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

/* The same clock with the fraction of a millisecond, for timing work. */
static inline double nl_mono_ms_f(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#endif
