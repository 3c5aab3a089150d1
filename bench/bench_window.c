/* Local attention's speed-up (DESIGN.md section 6, issue 18): the CPU
 * backend's attention over T positions, global against windows of W, forward
 * and backward, causal and bidirectional; and the windowed result against
 * the same call with a global mask and the window applied by hand... which
 * is the masked-global reference of tests/test_ops.c, so here only times.
 *
 *     bench_window [T] [threads]     (default T = 4096, 2 threads)
 *
 * Prints one line per case: milliseconds and the ratio to global. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kernels/backend.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Seconds per call of forward (bwd 0) or backward (bwd 1), best of 3. */
static double time_attn(nl_backend *be, float *const *buf, nl_attn_shape s, nl_attn_mask mk,
                        int bwd)
{
    const int qs = (s.H + 2 * s.G) * s.hd, hq = s.H * s.hd;
    float *qkv = buf[0], *out = buf[1], *lse = buf[2], *dqkv = buf[3], *dout = buf[4];
    double best = 1e30;
    be->attention_masked_forward(be, out, lse, qkv, qs, qkv + hq, qkv + hq + s.G * s.hd, qs, s, mk);
    for (int r = 0; r < 3; r++) {
        const double t0 = now();
        if (bwd)
            be->attention_masked_backward(be, dqkv, dqkv + hq, dqkv + hq + s.G * s.hd, dout, qkv,
                                          qs, qkv + hq, qkv + hq + s.G * s.hd, qs, out, lse, s, mk);
        else
            be->attention_masked_forward(be, out, lse, qkv, qs, qkv + hq, qkv + hq + s.G * s.hd, qs,
                                         s, mk);
        be->sync(be, NULL);
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    return best;
}

int main(int argc, char **argv)
{
    const int T = argc > 1 ? atoi(argv[1]) : 4096, threads = argc > 2 ? atoi(argv[2]) : 2;
    nl_backend *be = NULL;
    nl_error err = {0};
    if (T < 64 ||
        nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = threads}, &err) != NL_OK) {
        fprintf(stderr, "bench_window: %s\n", T < 64 ? "T must be at least 64" : err.msg);
        return 1;
    }
    const nl_attn_shape s = {.B = 1, .T = T, .past = 0, .kv_cap = T, .H = 8, .G = 2, .hd = 64};
    const size_t n = (size_t)T * (s.H + 2 * s.G) * s.hd;
    float *buf[5];
    for (int i = 0; i < 5; i++) {
        buf[i] = be->alloc(be, n * sizeof(float));
        if (!buf[i])
            return 1;
    }
    srand(1);
    for (size_t i = 0; i < n; i++) {
        buf[0][i] = (float)((double)rand() / RAND_MAX) - 0.5f;
        buf[4][i] = (float)((double)rand() / RAND_MAX) - 0.5f;
    }
    printf("attention on the CPU, %d threads: B=1 T=%d H=%d G=%d hd=%d (best of 3)\n", threads, T,
           s.H, s.G, s.hd);
    printf("%-14s %6s %12s %8s %12s %8s\n", "mask", "W", "fwd ms", "x", "bwd ms", "x");
    for (int bidir = 0; bidir <= 1; bidir++) {
        const nl_attn_mask global = {.bidir = bidir};
        const double gf = time_attn(be, buf, s, global, 0), gb = time_attn(be, buf, s, global, 1);
        printf("%-14s %6s %12.1f %8s %12.1f %8s\n", bidir ? "bidirectional" : "causal", "global",
               1e3 * gf, "1.0", 1e3 * gb, "1.0");
        const int windows[] = {512, 256, 128, 64};
        for (size_t i = 0; i < sizeof windows / sizeof windows[0]; i++) {
            const nl_attn_mask mk = {.bidir = bidir, .window = windows[i]};
            const double f = time_attn(be, buf, s, mk, 0), b = time_attn(be, buf, s, mk, 1);
            printf("%-14s %6d %12.1f %8.1f %12.1f %8.1f\n", bidir ? "bidirectional" : "causal",
                   windows[i], 1e3 * f, gf / f, 1e3 * b, gb / b);
        }
    }
    for (int i = 0; i < 5; i++)
        be->free(be, buf[i]);
    nl_backend_destroy(&be);
    return 0;
}
