/* Private to neuroctl selftest (cli/cmd_selftest.c, the op checks and the
 * command; cli/selftest_family.c, the model variants' slots;
 * cli/selftest_model.c, the small model's checks; cli/selftest_cudnn.c,
 * cuDNN's attention): the harness
 * that holds one buffer on two backends, and the report of each check. */
#ifndef NL_CLI_SELFTEST_H
#define NL_CLI_SELFTEST_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "core/rng.h"
#include "kernels/backend.h"

#define TOL_ELEM 1e-6
#define TOL_RED 1e-5
#define TOL_ATTN 1e-5
#define TOL_TRAIN_LOSS 1e-5 /* a training step's loss, relative */
#define TOL_TRAIN_W 1e-4    /* weights after training steps, gradients of a layer */
#define NEAR_TIE 1e-5       /* two top-k router probabilities closer than this */

#define MAX_LIVE 24

/* One buffer on both backends: d[0] on the reference, d[1] on the target. */
typedef struct pair {
    void *d[2];
    size_t bytes;
} pair;

typedef struct nl_selftest {
    nl_backend *be[2]; /* 0: reference, 1: target */
    nl_rng rng;
    int tf32;
    float lr_scale; /* the target's learning rate in the training checks, times this
                       (1; NL_TEST_SELFTEST_LR_SCALE, a test hook, shows they can fail) */
    int passed, failed;
    pair live[MAX_LIVE]; /* this check's device buffers */
    int n_live;
    void *host[2 * MAX_LIVE]; /* this check's host buffers */
    int n_host;
    int oom;
} nl_selftest;

/* Run `call` once per backend, reference first; D(p) is p's pointer there. */
#define BOTH(c, call)                                                                              \
    for (int s_ = 0; s_ < 2; s_++) {                                                               \
        nl_backend *be = (c)->be[s_];                                                              \
        call;                                                                                      \
    }
#define D(p) ((p)->d[s_])

/* Checks fail where a value is NaN: max2 keeps a NaN. */
static inline double max2(double a, double b)
{
    return a > b || isnan(a) ? a : b;
}

/* A zeroed host buffer freed by nl_selftest_release (NULL, and c->oom set,
 * when out of memory). */
void *nl_selftest_hbuf(nl_selftest *c, size_t bytes);
/* n random ids in [0, below), in such a buffer. */
int32_t *nl_selftest_ids(nl_selftest *c, size_t n, int below);
/* max |t - r| / max |r| over n floats; inf where either is not finite. */
double nl_selftest_err_all(const float *r, const float *t, size_t n);
/* Print one check's line and count it; why (may be NULL) is appended. */
void nl_selftest_line(nl_selftest *c, int ok, const char *check, const char *shape, double err,
                      double tol, const char *why);
/* Close a check: the target's queue must be clean, then err <= tol; the
 * check's buffers are released. */
void nl_selftest_done(nl_selftest *c, const char *check, const char *shape, double err, double tol);
void nl_selftest_release(nl_selftest *c);

/* For the checks outside cmd_selftest.c: a buffer of `bytes` on both
 * backends holding `host` (zeros when NULL; on failure c->oom is set and
 * the pair's pointers are NULL); n uniform floats in [lo, hi) in a host
 * buffer; the reference's bytes of p copied to the target; the scaled max
 * error of columns [col0, col0 + cols) of rows of p on the two backends. */
pair *nl_selftest_dev(nl_selftest *c, const void *host, size_t bytes);
float *nl_selftest_rnd(nl_selftest *c, size_t n, double lo, double hi);
void nl_selftest_mirror(nl_selftest *c, pair *p);
double nl_selftest_cmp_cols(nl_selftest *c, const pair *p, size_t rows, size_t stride,
                            size_t col0, size_t cols);

/* The optional slots of DESIGN section 6's variants (GeGLU, YaRN RoPE,
 * masked attention forward, and where the target can train their
 * backwards), skipped by name where the target leaves them NULL
 * (cli/selftest_family.c). */
void nl_selftest_family(nl_selftest *c);

/* The CUDA module's cuDNN flash attention (kernels/cuda/cuda_cudnn.h) on
 * the device of `device` against the reference, through a second backend
 * made with NL_CUDNN_ATTN=force, on bf16 tolerances; one "skip" line where
 * the device is not CUDA or cuDNN is not in use (cli/selftest_cudnn.c). */
void nl_selftest_cudnn(nl_selftest *c, const char *device, int threads);

/* A small model on both backends: routing, logits, NL_SELFTEST_DECODE
 * greedy decode steps, and where the target can train one layer forward
 * and backward and three local training steps (cli/selftest_model.c). */
#define NL_SELFTEST_DECODE 32
void nl_selftest_model(nl_selftest *c, uint64_t seed);

#endif
