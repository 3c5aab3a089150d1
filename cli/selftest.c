/* The harness of neuroctl selftest (cli/selftest.h): the tolerance of a
 * GEMM, the buffers a check holds on the reference and the target
 * backend, the errors between them, and the report of each check. The
 * checks (cmd_selftest.c and the selftest_*.c files) are written over it;
 * how each error is measured is in cmd_selftest.c's opening comment. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/selftest.h"
#include "core/model/rng.h"

/* ---------------------------------------------------------------- tolerances */

/* The bound of a GEMM over a summed length K. */
double nl_selftest_tol_gemm(const nl_selftest *c, int K)
{
    return c->tol->gemm * (c->tol->gemm_sqrt_k ? sqrt((double)K) : 1.0);
}

/* ---------------------------------------------------------------- buffers */

void *nl_selftest_hbuf(nl_selftest *c, size_t bytes)
{
    void *p = c->n_host < 2 * MAX_LIVE ? calloc(1, bytes ? bytes : 1) : NULL;
    if (!p) {
        c->oom = 1;
        return NULL;
    }
    c->host[c->n_host++] = p;
    return p;
}

float *nl_selftest_rnd(nl_selftest *c, size_t n, double lo, double hi)
{
    float *x = nl_selftest_hbuf(c, n * sizeof *x);
    for (size_t i = 0; x && i < n; i++)
        x[i] = (float)(lo + (hi - lo) * nl_rng_uniform(&c->rng));
    return x;
}

int32_t *nl_selftest_ids(nl_selftest *c, size_t n, int below)
{
    int32_t *x = nl_selftest_hbuf(c, n * sizeof *x);
    for (size_t i = 0; x && i < n; i++)
        x[i] = (int32_t)nl_rng_below(&c->rng, (uint64_t)below);
    return x;
}

/* A random permutation of 0..n-1 (dispatch slots: each written once). */
int32_t *nl_selftest_perm(nl_selftest *c, int n)
{
    int32_t *x = nl_selftest_hbuf(c, (size_t)n * sizeof *x);
    for (int i = 0; x && i < n; i++)
        x[i] = i;
    for (int i = n - 1; x && i > 0; i--) {
        int j = (int)nl_rng_below(&c->rng, (uint64_t)i + 1);
        int32_t t = x[i];
        x[i] = x[j];
        x[j] = t;
    }
    return x;
}

/* A buffer of `bytes` on both backends holding `host` (zeros when NULL).
 * On failure c->oom is set and a pair of NULLs is returned: checks run
 * their ops only while c->oom is clear, and nl_selftest_done() fails them. */
pair *nl_selftest_dev(nl_selftest *c, const void *host, size_t bytes)
{
    static pair none;
    if (c->oom || c->n_live == MAX_LIVE) {
        c->oom = 1;
        return &none;
    }
    pair *p = &c->live[c->n_live++];
    p->bytes = bytes;
    for (int s = 0; s < 2; s++) {
        p->d[s] = c->be[s]->alloc(c->be[s], bytes ? bytes : 1);
        if (!p->d[s])
            c->oom = 1;
        else if (host && bytes)
            c->be[s]->upload(c->be[s], p->d[s], host, bytes);
    }
    return c->oom ? &none : p;
}

/* The reference's bytes of p also on the target (an input computed by a
 * reference op, e.g. the forward's lse for the attention backward). */
void nl_selftest_mirror(nl_selftest *c, pair *p)
{
    void *h = nl_selftest_hbuf(c, p->bytes);
    if (!h || c->oom)
        return;
    c->be[0]->download(c->be[0], h, p->d[0], p->bytes);
    c->be[1]->upload(c->be[1], p->d[1], h, p->bytes);
}

void *nl_selftest_down(nl_selftest *c, const pair *p, int side)
{
    void *h = nl_selftest_hbuf(c, p->bytes);
    if (h && !c->oom)
        c->be[side]->download(c->be[side], h, p->d[side], p->bytes);
    return h;
}

/* Scaled max error of columns [col0, col0 + cols) of `rows` rows of
 * stride `stride`: max |t - r| / max(max |r|, floor) over those elements
 * (floor 0: the tensor's own scale; see check_attention_backward). */
double nl_selftest_err_cols_floor(const float *r, const float *t, size_t rows, size_t stride,
                                  size_t col0, size_t cols, double floor)
{
    double diff = 0.0, scale = floor;
    for (size_t i = 0; i < rows; i++)
        for (size_t j = col0; j < col0 + cols; j++) {
            const float a = r[i * stride + j], b = t[i * stride + j];
            if (!isfinite(a) || !isfinite(b))
                return INFINITY; /* no check expects inf or NaN here */
            diff = fmax(diff, fabs((double)b - (double)a));
            scale = fmax(scale, fabs((double)a));
        }
    return scale > 0.0 ? diff / scale : diff;
}

static double err_cols(const float *r, const float *t, size_t rows, size_t stride, size_t col0,
                       size_t cols)
{
    return nl_selftest_err_cols_floor(r, t, rows, stride, col0, cols, 0.0);
}

/* max |x| over columns [col0, col0 + cols) of `rows` rows of x */
double nl_selftest_max_abs_cols(const float *x, size_t rows, size_t stride, size_t col0,
                                size_t cols)
{
    double m = 0.0;
    for (size_t i = 0; i < rows; i++)
        for (size_t j = col0; j < col0 + cols; j++)
            m = fmax(m, fabs((double)x[i * stride + j]));
    return m;
}

double nl_selftest_err_all(const float *r, const float *t, size_t n)
{
    return err_cols(r, t, 1, n, 0, n);
}

/* err_cols of p's bytes on the two backends */
double nl_selftest_cmp_cols(nl_selftest *c, const pair *p, size_t rows, size_t stride, size_t col0,
                            size_t cols)
{
    const float *r = nl_selftest_down(c, p, 0), *t = nl_selftest_down(c, p, 1);
    return c->oom ? INFINITY : err_cols(r, t, rows, stride, col0, cols);
}

double nl_selftest_cmp(nl_selftest *c, const pair *p, size_t n)
{
    return nl_selftest_cmp_cols(c, p, 1, n, 0, n);
}

/* ---------------------------------------------------------------- report */

void nl_selftest_release(nl_selftest *c)
{
    for (int i = 0; i < c->n_live; i++)
        for (int s = 0; s < 2; s++)
            c->be[s]->free(c->be[s], c->live[i].d[s]);
    for (int i = 0; i < c->n_host; i++)
        free(c->host[i]);
    c->n_live = c->n_host = 0;
    c->oom = 0;
}

void nl_selftest_line(nl_selftest *c, int ok, const char *check, const char *shape, double err,
                      double tol, const char *why)
{
    printf("%-4s  %-22s  %-46s  err=%.3g tol=%.3g%s%s\n", ok ? "ok" : "FAIL", check, shape, err,
           tol, why ? "  " : "", why ? why : "");
    fflush(stdout);
    if (ok)
        c->passed++;
    else
        c->failed++;
}

/* Close a check: the target's queue must be clean, then err <= tol. */
void nl_selftest_done(nl_selftest *c, const char *check, const char *shape, double err, double tol)
{
    tol = nl_selftest_bf16_tol(c, check, tol);
    nl_error e = {0};
    nl_backend *t = c->be[1];
    nl_status st = t->sync(t, &e);
    if (st == NL_OK)
        st = nl_backend_check(t, &e);
    const char *why = NULL;
    char msg[NL_ERROR_MSG_MAX + 32];
    if (c->oom) {
        why = "(out of memory for the inputs)";
        err = INFINITY;
    } else if (st != NL_OK) {
        snprintf(msg, sizeof msg, "(%s: %s)", nl_status_str(st), e.msg);
        why = msg;
    }
    nl_selftest_line(c, st == NL_OK && !c->oom && err <= tol, check, shape, err, tol, why);
    nl_selftest_release(c);
}

int nl_selftest_has(nl_selftest *c, int present, const char *check, const char *shape)
{
    if (present)
        return 1;
    char why[96];
    snprintf(why, sizeof why, "(not implemented on %s)", c->be[1]->name);
    nl_selftest_line(c, 0, check, shape, INFINITY, 0, why);
    nl_selftest_release(c);
    return 0;
}
