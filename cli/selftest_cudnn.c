/* neuroctl selftest's cuDNN attention checks (kernels/cuda/cuda_cudnn.h):
 * a second backend on the target's CUDA device, made with
 * NL_CUDNN_ATTN=force so that its attention runs through cuDNN (bf16
 * inside) although the backend is FP32, against the reference backend
 * (the CPU's), forward and backward, for causal, bidirectional, sliding
 * windows, GQA (H/G 1, 2, 4), head dims 64 and 128, and a KV cache
 * (chunked prefill, a decode step); and two shapes cuDNN is not given
 * (head dim 32, packed documents) that must come back at FP32 precision
 * from the module's own kernels.
 *
 * Tolerances (bf16 inputs, FP32 accumulation and statistics): the forward's
 * err is the larger of out's max |t - r| / max |r| and lse's max |t - r|
 * (absolute: a mask one key off in a window of 32 moves lse by about 3e-2),
 * against 2e-2; the backward's, dq, dk and dv scaled as out, against 5e-2.
 *
 * Which path ran: the error says it. cuDNN's bf16 rounding leaves an error
 * well above 1e-5 on these inputs; the FP32 kernels stay below it. So the
 * first check tells whether cuDNN is in use at all (if not: one "skip" line,
 * e.g. a module built without the frontend, or cudnnCreate failing, whose
 * reason the module logged just before). A later check that comes back at
 * FP32 precision was declined by cuDNN at run time (the module logged
 * cuDNN's reason): its result, from the module's own kernels, is judged at
 * FP32 tolerance and its line says so; a last line counts the shapes that
 * ran on cuDNN. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/selftest.h"

#define TOL_CUDNN_FWD 2e-2
#define TOL_CUDNN_BWD 5e-2
#define FP32_PRECISION 1e-5 /* an error below this: the FP32 kernels ran */

static int declined; /* checks meant for cuDNN that its fallback ran */

typedef struct cudnn_case {
    int B, T, past, kv_cap, H, G, hd, bidir, window;
} cudnn_case;

static double max_abs(nl_selftest *c, const pair *p, size_t n)
{
    /* the scaled error times the reference's scale is the absolute one */
    float *r = nl_selftest_hbuf(c, n * 4), *t = nl_selftest_hbuf(c, n * 4);
    if (!r || !t || c->oom)
        return INFINITY;
    c->be[0]->download(c->be[0], r, p->d[0], n * 4);
    c->be[1]->download(c->be[1], t, p->d[1], n * 4);
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = max2(m, isfinite(r[i]) && isfinite(t[i]) ? fabs((double)t[i] - r[i]) : INFINITY);
    return m;
}

static void describe(char *shape, size_t cap, const cudnn_case *k, const char *extra)
{
    char w[24] = "";
    if (k->window)
        snprintf(w, sizeof w, " W=%d", k->window);
    snprintf(shape, cap, "B=%d T=%d past=%d cap=%d H=%d G=%d hd=%d%s%s%s", k->B, k->T, k->past,
             k->kv_cap, k->H, k->G, k->hd, k->bidir ? " bidir" : "", w, extra ? extra : "");
}

/* Close a check judged on bf16 tolerances, or on FP32 precision when
 * cuDNN is meant to decline the shape (fp32 = 1). A probe (the first
 * check) that comes back at FP32 precision means no cuDNN at all: nothing
 * is counted, the caller prints the skip line. Returns the error. */
static double finish(nl_selftest *c, const char *check, const char *shape, double err, double tol,
                     int fp32, int probe)
{
    if (probe && err < FP32_PRECISION) {
        nl_selftest_release(c);
        return err;
    }
    if (fp32) {
        nl_selftest_done(c, check, shape, err, TOL_ATTN);
        return err;
    }
    if (err < FP32_PRECISION) { /* the module's kernels ran: cuDNN declined it */
        nl_selftest_line(c, err <= TOL_ATTN, check, shape, err, TOL_ATTN,
                         "(cuDNN declined this shape: the FP32 kernels ran; the module's log "
                         "line says why)");
        nl_selftest_release(c);
        declined++;
        return err;
    }
    nl_selftest_done(c, check, shape, err, tol);
    return err;
}

/* Forward through the masked slot (the plain one for a causal global mask,
 * as core calls them). Cache rows past the filled positions hold NaN. */
static double check_fwd(nl_selftest *c, const cudnn_case *k, int doc, int fp32, int probe)
{
    char shape[128];
    describe(shape, sizeof shape, k, doc ? " doc" : NULL);
    const nl_attn_shape s = {k->B,  k->T, k->past, k->kv_cap, k->H, k->G,
                             k->hd, NULL, 0,       NULL,      NULL};
    const int qs = k->H * k->hd + 8, ks = k->G * k->hd + 4; /* strides wider than the heads */
    const size_t nq = (size_t)k->B * k->T * qs, nkv = (size_t)k->B * k->kv_cap * ks;
    const size_t no = (size_t)k->B * k->T * k->H * k->hd, nl = (size_t)k->B * k->H * k->T;
    float *kh = nl_selftest_rnd(c, nkv, -1, 1), *vh = nl_selftest_rnd(c, nkv, -1, 1);
    for (int b = 0; kh && vh && b < k->B; b++)
        for (size_t i = (size_t)(k->past + k->T) * ks; i < (size_t)k->kv_cap * ks; i++)
            kh[(size_t)b * k->kv_cap * ks + i] = vh[(size_t)b * k->kv_cap * ks + i] = NAN;
    int32_t *dh = nl_selftest_hbuf(c, (size_t)k->B * k->T * 4);
    for (int i = 0; dh && i < k->B * k->T; i++)
        dh[i] = i % k->T < k->T / 3 ? 0 : 1; /* two documents per row */
    pair *q = nl_selftest_dev(c, nl_selftest_rnd(c, nq, -1, 1), nq * 4);
    pair *kk = nl_selftest_dev(c, kh, nkv * 4), *v = nl_selftest_dev(c, vh, nkv * 4);
    pair *docs = nl_selftest_dev(c, dh, (size_t)k->B * k->T * 4);
    pair *out = nl_selftest_dev(c, NULL, no * 4), *lse = nl_selftest_dev(c, NULL, nl * 4);
    for (int side = 0; side < 2 && !c->oom; side++) {
        nl_backend *be = c->be[side];
        const nl_attn_mask m = {k->bidir, k->window, doc ? (const int32_t *)docs->d[side] : NULL};
        if (!k->bidir && !k->window && !doc)
            be->attention_forward(be, out->d[side], lse->d[side], q->d[side], qs, kk->d[side],
                                  v->d[side], ks, s);
        else
            be->attention_masked_forward(be, out->d[side], lse->d[side], q->d[side], qs,
                                         kk->d[side], v->d[side], ks, s, m);
    }
    const double eo = nl_selftest_cmp_cols(c, out, (size_t)k->B * k->T, (size_t)k->H * k->hd, 0,
                                           (size_t)k->H * k->hd);
    const double el = max_abs(c, lse, nl);
    return finish(c, "cudnn_attention_fwd", shape, max2(eo, el), TOL_CUDNN_FWD, fp32, probe);
}

/* Backward (past 0) from the reference's forward, as check_attention_backward. */
static void check_bwd(nl_selftest *c, const cudnn_case *k)
{
    char shape[128];
    describe(shape, sizeof shape, k, NULL);
    const nl_attn_shape s = {k->B, k->T, 0, k->T, k->H, k->G, k->hd, NULL, 0, NULL, NULL};
    const int qs = (k->H + 2 * k->G) * k->hd, ko = k->H * k->hd, vo = (k->H + k->G) * k->hd;
    const size_t N = (size_t)k->B * k->T, nq = N * qs, no = N * k->H * k->hd;
    pair *qkv = nl_selftest_dev(c, nl_selftest_rnd(c, nq, -1, 1), nq * 4);
    pair *dqkv = nl_selftest_dev(c, nl_selftest_rnd(c, nq, -1, 1), nq * 4);
    pair *out = nl_selftest_dev(c, NULL, no * 4);
    pair *lse = nl_selftest_dev(c, NULL, (size_t)k->B * k->H * k->T * 4);
    pair *dout = nl_selftest_dev(c, nl_selftest_rnd(c, no, -1, 1), no * 4);
    const nl_attn_mask m = {k->bidir, k->window, NULL};
    if (!c->oom) {
        nl_backend *r = c->be[0];
        const float *q = qkv->d[0];
        r->attention_masked_forward(r, out->d[0], lse->d[0], q, qs, q + ko, q + vo, qs, s, m);
        nl_selftest_mirror(c, out);
        nl_selftest_mirror(c, lse);
        BOTH(c,
             be->attention_masked_backward(
                 be, D(dqkv), (float *)D(dqkv) + ko, (float *)D(dqkv) + vo, D(dout), D(qkv), qs,
                 (const float *)D(qkv) + ko, (const float *)D(qkv) + vo, qs, D(out), D(lse), s, m));
    }
    double e = nl_selftest_cmp_cols(c, dqkv, N, qs, 0, ko);
    e = max2(e, nl_selftest_cmp_cols(c, dqkv, N, qs, ko, vo - ko));
    e = max2(e, nl_selftest_cmp_cols(c, dqkv, N, qs, vo, qs - vo));
    finish(c, "cudnn_attention_bwd", shape, e, TOL_CUDNN_BWD, 0, 0);
}

static void run_checks(nl_selftest *c)
{
    static const cudnn_case fwd[] = {
        {2, 130, 0, 130, 4, 2, 64, 0, 0},  /* causal, GQA 2 (the first: is cuDNN in use?) */
        {2, 65, 0, 65, 4, 4, 128, 0, 0},   /* causal, MHA, hd 128 */
        {2, 130, 0, 130, 4, 1, 64, 1, 0},  /* bidirectional, MQA */
        {2, 130, 0, 130, 4, 2, 64, 0, 32}, /* causal sliding window */
        {1, 97, 0, 97, 4, 2, 128, 1, 16},  /* bidirectional window */
        {2, 33, 100, 160, 4, 2, 64, 0, 0}, /* chunked prefill over a cache */
        {2, 17, 40, 64, 4, 2, 128, 0, 24}, /* a window over a cache */
        {3, 1, 517, 600, 8, 2, 128, 0, 0}, /* a decode step */
        {2, 5, 60, 80, 4, 4, 64, 1, 0},    /* bidirectional over a cache */
    };
    static const cudnn_case bwd[] = {
        {2, 130, 0, 130, 4, 2, 64, 0, 0}, {2, 65, 0, 65, 4, 4, 128, 0, 0},
        {2, 130, 0, 130, 4, 1, 64, 1, 0}, {2, 130, 0, 130, 4, 2, 128, 0, 32},
        {1, 97, 0, 97, 4, 2, 64, 1, 16},
    };
    declined = 0;
    if (check_fwd(c, &fwd[0], 0, 0, 1) < FP32_PRECISION) {
        printf("skip  cuDNN attention checks: the attention of %s ran its own FP32 kernels "
               "with NL_CUDNN_ATTN=force (module built without cuDNN, or cuDNN unavailable: "
               "see the module's log line above)\n",
               c->be[1]->name);
        return;
    }
    for (size_t i = 1; i < sizeof fwd / sizeof *fwd; i++)
        check_fwd(c, &fwd[i], 0, 0, 0);
    for (size_t i = 0; i < sizeof bwd / sizeof *bwd; i++)
        check_bwd(c, &bwd[i]);
    /* shapes cuDNN is not given: the module's kernels at FP32 precision */
    const cudnn_case hd32 = {2, 40, 0, 40, 4, 2, 32, 0, 0}, docs = {2, 40, 0, 40, 4, 2, 64, 0, 0};
    check_fwd(c, &hd32, 0, 1, 0);
    check_fwd(c, &docs, 1, 1, 0);
    const int meant = (int)(sizeof fwd / sizeof *fwd + sizeof bwd / sizeof *bwd);
    printf("note  cuDNN attention: %d of %d shapes ran on cuDNN%s\n", meant - declined, meant,
           declined ? " (see the module's log lines for the others)" : "");
}

void nl_selftest_cudnn(nl_selftest *c, const char *device, int threads)
{
    if (strncmp(device, "cuda:", 5) != 0) {
        printf("skip  cuDNN attention checks: %s is not a CUDA device\n", device);
        return;
    }
    const char *was = getenv("NL_CUDNN_ATTN");
    if (was && strcmp(was, "0") == 0) {
        printf("skip  cuDNN attention checks: NL_CUDNN_ATTN=0\n");
        return;
    }
    char *saved = was ? strdup(was) : NULL;
    setenv("NL_CUDNN_ATTN", "force", 1);
    nl_backend *forced = NULL, *target = c->be[1];
    nl_error err = {0};
    const nl_status st =
        nl_backend_new(&forced, device, &(nl_backend_opts){.threads = threads}, &err);
    if (saved)
        setenv("NL_CUDNN_ATTN", saved, 1);
    else
        unsetenv("NL_CUDNN_ATTN");
    free(saved);
    if (st != NL_OK) {
        nl_selftest_line(c, 0, "cudnn_attention", device, INFINITY, 0, err.msg);
        return;
    }
    c->be[1] = forced;
    run_checks(c);
    c->be[1] = target;
    nl_backend_destroy(&forced);
}
