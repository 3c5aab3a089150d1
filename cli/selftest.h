/* Private to neuroctl selftest: the harness that holds one buffer on two
 * backends, and the report of each check (cli/selftest.c), which the
 * checks are written over: cli/cmd_selftest.c, the op checks and the
 * command; cli/selftest_family.c, the model variants' slots;
 * cli/selftest_model.c, the small model's checks; cli/selftest_cudnn.c,
 * cuDNN's attention. */
#ifndef NL_CLI_SELFTEST_H
#define NL_CLI_SELFTEST_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "core/model/rng.h"
#include "kernels/backend.h"

/* The tolerance of every check, one row per precision of the target
 * (the rows are in selftest_tols.c; how each err is measured is in
 * cmd_selftest.c's opening comment, the table is also in docs/BENCHMARKS.md).
 * TF32 rounds the GEMMs' inputs to 10 mantissa bits (relative 2^-11, about
 * 5e-4): a check that does not run a GEMM keeps its FP32 bound, one
 * downstream of a GEMM gets a bound of a few TF32 roundings. */
typedef struct nl_selftest_tols {
    const char *name;     /* "FP32", "TF32" */
    double elem;          /* element-wise ops (swiglu, rope, moe_combine, adamw, weights) */
    double red;           /* reductions, norms, softmax, cross-entropy, aux, router backward */
    double attn;          /* attention forward and backward (no GEMM on the CUDA path) */
    double gemm;          /* gemm: error relative to |A||B|, times sqrt(K) when gemm_sqrt_k */
    int gemm_sqrt_k;      /* times sqrt(K): FP32 sums grow so, TF32 input rounding not */
    double router_probs;  /* the model's router probabilities and aux loss (after a GEMM) */
    double logits;        /* the model's prefill logits */
    double decode_logits; /* its decode logits (a decode token's routing is not seen) */
    double greedy_differ; /* greedy ids that may differ away from near-ties */
    double near_tie;      /* top-k probabilities or logits closer than this: a tie, not judged */
    double layer_x;       /* one layer's x_out */
    double layer_grad;    /* one layer's dx and parameter gradients */
    double train_loss;    /* a training step's loss, relative */
    double train_weights; /* the weights' gradient-weighted update error (selftest_model.c) */
} nl_selftest_tols;

extern const nl_selftest_tols nl_selftest_tols_fp32, nl_selftest_tols_tf32;

/* The target's row in the op checks, each of which holds its nl_selftest *c */
#define TOL_ELEM (c->tol->elem)
#define TOL_RED (c->tol->red)
#define TOL_ATTN (c->tol->attn)

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
    int bf16;       /* --precision bf16: the target's GEMMs in bf16 (selftest_bf16.c) */
    float lr_scale; /* the target's learning rate in the training checks, times this
                       (1; NL_TEST_SELFTEST_LR_SCALE, a test hook, shows they can fail) */
    const nl_selftest_tols *tol; /* the target's precision's row */
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
/* A check's tolerance for the target's precision: tol, or with c->bf16 the
 * check's bf16 tolerance where cli/selftest_bf16.c has one (the larger). */
double nl_selftest_bf16_tol(const nl_selftest *c, const char *check, double tol);

/* The harness the op checks share (cli/cmd_selftest.c): a buffer of
 * `bytes` on both backends holding `host` (zeros when NULL; on failure
 * c->oom is set and the pair's pointers are NULL); n uniform floats in
 * [lo, hi) and a random permutation of 0..n-1 in host buffers; the
 * reference's bytes of p copied to the target; one side's bytes of p in a
 * host buffer; the scaled max error of p on the two backends (all n
 * floats, or columns [col0, col0 + cols) of rows), of two host tensors'
 * columns with a floor under the scale, and max |x| over such columns; the
 * GEMM tolerance for an inner size K. */
pair *nl_selftest_dev(nl_selftest *c, const void *host, size_t bytes);
float *nl_selftest_rnd(nl_selftest *c, size_t n, double lo, double hi);
int32_t *nl_selftest_perm(nl_selftest *c, int n);
void nl_selftest_mirror(nl_selftest *c, pair *p);
void *nl_selftest_down(nl_selftest *c, const pair *p, int side);
double nl_selftest_cmp(nl_selftest *c, const pair *p, size_t n);
double nl_selftest_cmp_cols(nl_selftest *c, const pair *p, size_t rows, size_t stride, size_t col0,
                            size_t cols);
double nl_selftest_err_cols_floor(const float *r, const float *t, size_t rows, size_t stride,
                                  size_t col0, size_t cols, double floor);
double nl_selftest_max_abs_cols(const float *x, size_t rows, size_t stride, size_t col0,
                                size_t cols);
double nl_selftest_tol_gemm(const nl_selftest *c, int K);

/* A slot the target leaves NULL fails its check (one line, "not
 * implemented on <target>"): 0 then, 1 when the slot is there. */
int nl_selftest_has(nl_selftest *c, int present, const char *check, const char *shape);
#define NEED(c, slot, shape) nl_selftest_has((c), (c)->be[1]->slot != NULL, #slot, (shape))

/* The backward and optimizer slots' checks (cli/selftest_backward.c). */
void nl_selftest_backward_ops(nl_selftest *c);
/* The sample_rows slot's: the target's ids equal the reference's, and a
 * row's id alone its id among others (skipped where either has none;
 * cli/selftest_sample.c). */
void nl_selftest_sample(nl_selftest *c);

/* The optional slots of DESIGN section 6's variants (GeGLU, YaRN RoPE,
 * masked attention forward, and where the target can train their
 * backwards), skipped by name where the target leaves them NULL
 * (cli/selftest_family.c). */
void nl_selftest_family(nl_selftest *c);
/* The fused decode slots, chained as a decode layer runs them; skipped
 * where the target leaves them NULL and in a bf16 run
 * (cli/selftest_fused.c). */
void nl_selftest_fused(nl_selftest *c);

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
