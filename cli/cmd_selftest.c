/* neuroctl selftest: every slot of a target backend against the reference
 * backend (the CPU one by default), op by op on random inputs from a fixed
 * seed, then a whole small model (prefill routing, logits, 32 greedy decode
 * steps, again with bf16 KV caches) through core's public API on both; where the target can train,
 * also one layer forward and backward (core/model/layer.h) and three local
 * training steps (core/train/train.h) from the same weights and batches. It is the twin test of the
 * CUDA backend: `neuroctl selftest --device cuda:0` on a machine with a GPU.
 *
 * Shapes are the ones that break kernels: one row, odd widths, T not a
 * multiple of a tile (17, 33, 65, 130), decode over a cache of ~1000
 * positions, H/G of 1 and 4, head dims 16, 64 and 128, softmax and
 * cross-entropy over 50,000 columns, NaN in the buffer `zero` clears and
 * inf/nan in the input of `sumsq`. Cache rows past the filled positions
 * hold NaN, so a kernel that reads them fails.
 *
 * How the error of a check is measured (err=, compared with tol=):
 *   - element-wise ops, norms, softmax, attention, cross-entropy, AdamW:
 *     max |target - ref| over the tensor divided by max |ref| over the same
 *     tensor (its scale). An element near zero after cancellation (RoPE,
 *     x + w y) is judged against the scale of its tensor, not its own
 *     magnitude, so the figure is a relative error that cannot blow up.
 *     Any inf or NaN on either side is err = inf: no such check expects one
 *     (cache rows past the filled positions hold NaN, so a reference that
 *     read them would fail too).
 *   - GEMM: max over C of |target - ref| / (|alpha| sum_k |A_ik||B_kj| +
 *     |beta| |C0_ij|), the error relative to |A||B| (accumulation error
 *     grows with that sum, not with the result, which may cancel).
 *   - sumsq: |target - ref| / ref; with a non-finite input the target must
 *     be non-finite (err 0, else inf).
 *   - copies (round trip, zero, embedding, gather, copy_rows): exact, err
 *     counts the differing bytes or elements; mem_info (when the target
 *     has it): err 1 unless 0 < free <= total and 64 MiB allocated show.
 *   - routing (moe_route, moe_aux on rows with tied probabilities): the
 *     choices, offsets and dispatch tables, frac and counts exact (err inf
 *     on any difference), else the weights' error (1e-6) and the aux
 *     loss's |t - r| / r (1e-5); the grouped GEMMs as element-wise ops
 *     against 1e-5 sqrt(K), K being the summed length; router backward 1e-5.
 *   - sample (where both backends have sample_rows): the ids of
 *     eighteen draws (greedy, two temperatures, three uniforms, over every
 *     token and in a top-p 0.6 nucleus) on the same logits, in one call, and the target's each
 * alone again; err counts the differing ids (tol 0).
 *   - the model: expert choices as sets per (layer, token), err counts the
 *     differences away from near-ties (k-th and (k+1)-th probabilities
 *     within 1e-5, reported as notes); greedy ids, err counts differences.
 *   - attention_backward: dq, dk, dv each against its own scale floored at
 *     1/4 of the largest of the three (at T = 1 dq = dk = 0 up to rounding).
 *   - training: a layer's x_out (1e-5), dx and parameter gradients (1e-4)
 *     scaled as element-wise ops; each step's loss |t - r| / |r| (1e-5);
 *     the weights after the third step as the gradient-weighted error of
 *     the update (1e-3; selftest_model.c says why not max |diff| / max |w|).
 * Tolerances: element-wise 1e-6 (swiglu, rope, moe_combine, adamw, the dy
 * of moe_combine_backward); reductions, norms, softmax, cross-entropy, attention,
 * router probabilities and model logits 1e-5; GEMM 1e-5 sqrt(K). These are
 * the FP32 row of nl_selftest_tols (selftest_tols.c); --tf32 takes the
 * TF32 row (GEMM 2e-3, router probabilities 2e-3, logits and the layer and
 * training checks 1e-2, train_weights 0.1, decode logits 0.2 and 2 greedy
 * ids: a decode token may take another of two near-tied experts).
 *
 * Exit status: 0 all passed, 1 a check failed, 2 usage error, 3 a backend
 * could not be created (e.g. "cuda:0: no CUDA device"), with its message. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "cli/commands.h"
#include "cli/selftest.h"
#include "core/model/rng.h"

/* Differing bytes of p on the two backends. */
static double cmp_exact(nl_selftest *c, const pair *p)
{
    const unsigned char *r = nl_selftest_down(c, p, 0), *t = nl_selftest_down(c, p, 1);
    if (c->oom)
        return INFINITY;
    size_t bad = 0;
    for (size_t i = 0; i < p->bytes; i++)
        bad += r[i] != t[i];
    return (double)bad;
}

/* ---------------------------------------------------------------- memory */

/* upload at a byte offset, download back: the same bytes */
static void check_roundtrip(nl_selftest *c, size_t bytes, size_t off)
{
    char shape[64];
    snprintf(shape, sizeof shape, "bytes=%zu off=%zu", bytes, off);
    unsigned char *h = nl_selftest_hbuf(c, bytes), *back = nl_selftest_hbuf(c, bytes);
    pair *p = nl_selftest_dev(c, NULL, bytes + off);
    double bad = INFINITY;
    if (!c->oom) {
        for (size_t i = 0; i < bytes; i++)
            h[i] = (unsigned char)nl_rng_u64(&c->rng);
        nl_backend *t = c->be[1];
        t->upload(t, (char *)p->d[1] + off, h, bytes);
        t->download(t, back, (char *)p->d[1] + off, bytes);
        bad = 0;
        for (size_t i = 0; i < bytes; i++)
            bad += h[i] != back[i];
    }
    nl_selftest_done(c, "upload_download", shape, bad, 0);
}

/* zero [off, off + bytes) of a buffer full of NaN: those bytes become 0,
 * the rest keep their NaN */
static void check_zero(nl_selftest *c, size_t total, size_t off, size_t bytes)
{
    char shape[64];
    snprintf(shape, sizeof shape, "bytes=%zu off=%zu of %zu (NaN)", bytes, off, total);
    float *nan = nl_selftest_hbuf(c, total + 4);
    for (size_t i = 0; nan && i < total / 4 + 1; i++)
        nan[i] = NAN;
    pair *p = nl_selftest_dev(c, nan, total);
    if (!NEED(c, zero, shape))
        return;
    double bad = INFINITY;
    if (!c->oom) {
        c->be[1]->zero(c->be[1], (char *)p->d[1] + off, bytes);
        const unsigned char *t = nl_selftest_down(c, p, 1), *orig = (const unsigned char *)nan;
        bad = 0;
        for (size_t i = 0; t && i < total; i++)
            bad += t[i] != (i >= off && i < off + bytes ? 0 : orig[i]);
    }
    nl_selftest_done(c, "zero", shape, bad, 0);
}

/* the optional mem_info slot: 0 < free <= total, and an allocation of
 * 64 MiB shows in it (by at least half, allowing for other users) */
static void check_mem_info(nl_selftest *c)
{
    nl_backend *t = c->be[1];
    if (!t->mem_info)
        return; /* host memory: nothing to check */
    size_t free0 = 0, total = 0, free1 = 0;
    nl_error e = {0};
    double bad = INFINITY;
    const size_t big = (size_t)64 << 20;
    void *p = NULL;
    if (t->mem_info(t, &free0, &total, &e) == NL_OK && free0 > 0 && free0 <= total &&
        (p = t->alloc(t, big)) && t->mem_info(t, &free1, &total, &e) == NL_OK)
        bad = free1 + big / 2 <= free0 ? 0 : 1;
    t->free(t, p);
    nl_selftest_done(c, "mem_info", "64 MiB allocation", bad, 0);
}

/* ---------------------------------------------------------------- gemm */

/* C = alpha op(A) op(B) + beta C with row strides padded by `pad`. */
static void check_gemm(nl_selftest *c, int ta, int tb, int M, int N, int K, float alpha, float beta,
                       int pad)
{
    char shape[80];
    snprintf(shape, sizeof shape, "%c%c M=%d N=%d K=%d a=%g b=%g pad=%d", ta ? 't' : 'n',
             tb ? 't' : 'n', M, N, K, alpha, beta, pad);
    if (!NEED(c, gemm, shape))
        return;
    const int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    const int lda = ac + pad, ldb = bc + pad, ldc = N + pad;
    float *A = nl_selftest_rnd(c, (size_t)ar * lda, -1, 1),
          *B = nl_selftest_rnd(c, (size_t)br * ldb, -1, 1);
    float *C0 = nl_selftest_rnd(c, (size_t)M * ldc, -1, 1);
    pair *pa = nl_selftest_dev(c, A, (size_t)ar * lda * 4),
         *pb = nl_selftest_dev(c, B, (size_t)br * ldb * 4);
    pair *pc = nl_selftest_dev(c, C0, (size_t)M * ldc * 4);
    double worst = INFINITY;
    if (!c->oom) {
        BOTH(c, be->gemm(be, ta, tb, M, N, K, alpha, D(pa), lda, D(pb), ldb, beta, D(pc), ldc));
        const float *r = nl_selftest_down(c, pc, 0), *t = nl_selftest_down(c, pc, 1);
        worst = c->oom ? INFINITY : 0.0;
        for (int i = 0; !c->oom && i < M; i++)
            for (int j = 0; j < ldc; j++) {
                const size_t o = (size_t)i * ldc + j;
                double den = j < N ? fabs(beta) * fabs(C0[o]) : 0.0;
                for (int k = 0; j < N && k < K; k++) {
                    float a = ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                    float b = tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
                    den += fabs(alpha) * fabs(a) * fabs(b);
                }
                double e = fabs((double)t[o] - (double)r[o]);
                e = den > 0.0 ? e / den : (e > 0.0 || !isfinite(t[o]) ? INFINITY : 0.0);
                worst = max2(worst, isfinite(t[o]) ? e : INFINITY);
            }
    }
    nl_selftest_done(c, "gemm", shape, worst, nl_selftest_tol_gemm(c, K));
}

/* ---------------------------------------------------------------- forward ops */

static void check_embedding(nl_selftest *c, int N, int C, int rows)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d rows=%d", N, C, rows);
    if (!NEED(c, embedding_forward, shape))
        return;
    int32_t *tok = nl_selftest_ids(c, (size_t)N, rows);
    if (tok)
        tok[N - 1] = rows - 1; /* the last row of the table */
    pair *pt = nl_selftest_dev(c, tok, (size_t)N * 4),
         *tab =
             nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)rows * C, -1, 1), (size_t)rows * C * 4);
    pair *out = nl_selftest_dev(c, NULL, (size_t)N * C * 4);
    if (!c->oom)
        BOTH(c, be->embedding_forward(be, D(out), D(pt), D(tab), N, C));
    nl_selftest_done(c, "embedding_forward", shape, cmp_exact(c, out), 0);
}

static void check_rmsnorm(nl_selftest *c, int N, int C)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d", N, C);
    if (!NEED(c, rmsnorm_forward, shape))
        return;
    pair *x = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)N * C, -2, 2), (size_t)N * C * 4);
    pair *w = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)C, 0.5, 1.5), (size_t)C * 4);
    pair *out = nl_selftest_dev(c, NULL, (size_t)N * C * 4),
         *rstd = nl_selftest_dev(c, NULL, (size_t)N * 4);
    if (!c->oom)
        BOTH(c, be->rmsnorm_forward(be, D(out), D(rstd), D(x), D(w), N, C, 1e-6f));
    nl_selftest_done(
        c, "rmsnorm_forward", shape,
        max2(nl_selftest_cmp(c, out, (size_t)N * C), nl_selftest_cmp(c, rstd, (size_t)N)), TOL_RED);
}

/* heads of hd at column col0 of rows of width row, positions below maxpos */
static void check_rope(nl_selftest *c, int N, int row, int col0, int heads, int hd, int maxpos)
{
    char shape[80];
    snprintf(shape, sizeof shape, "N=%d row=%d col0=%d heads=%d hd=%d pos<%d", N, row, col0, heads,
             hd, maxpos);
    if (!NEED(c, rope_forward, shape))
        return;
    int32_t *pos = nl_selftest_ids(c, (size_t)N, maxpos);
    if (pos)
        pos[0] = maxpos - 1;
    pair *x = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)N * row, -1, 1), (size_t)N * row * 4);
    pair *pp = nl_selftest_dev(c, pos, (size_t)N * 4);
    if (!c->oom)
        BOTH(c, be->rope_forward(be, D(x), D(pp), N, row, col0, heads, hd, 10000.0f));
    nl_selftest_done(c, "rope_forward", shape, nl_selftest_cmp(c, x, (size_t)N * row), TOL_ELEM);
}

/* packed: q, k, v in one buffer of rows (H + 2G) hd, as the model's prefill
 * (kv_cap = T, past = 0); else a query buffer and a cache of kv_cap rows
 * per sequence, NaN past the filled positions */
static void check_attention(nl_selftest *c, int B, int T, int past, int kv_cap, int H, int G,
                            int hd)
{
    const int packed = kv_cap == 0;
    char shape[96];
    if (packed)
        kv_cap = T;
    snprintf(shape, sizeof shape, "B=%d T=%d past=%d cap=%d H=%d G=%d hd=%d%s", B, T, past, kv_cap,
             H, G, hd, packed ? " packed" : "");
    if (!NEED(c, attention_forward, shape))
        return;
    nl_attn_shape s = {.B = B, .T = T, .past = past, .kv_cap = kv_cap, .H = H, .G = G, .hd = hd};
    const int qs = packed ? (H + 2 * G) * hd : H * hd, ks = packed ? qs : G * hd;
    const size_t nq = (size_t)B * T * qs, nkv = (size_t)B * kv_cap * ks;
    pair *q = nl_selftest_dev(c, nl_selftest_rnd(c, nq, -1, 1), nq * 4), *k = q, *v = q;
    if (!packed) {
        float *kh = nl_selftest_rnd(c, nkv, -1, 1), *vh = nl_selftest_rnd(c, nkv, -1, 1);
        for (int b = 0; kh && vh && b < B; b++)
            for (size_t i = (size_t)(past + T) * ks; i < (size_t)kv_cap * ks; i++)
                kh[(size_t)b * kv_cap * ks + i] = vh[(size_t)b * kv_cap * ks + i] = NAN;
        k = nl_selftest_dev(c, kh, nkv * 4);
        v = nl_selftest_dev(c, vh, nkv * 4);
    }
    const size_t koff = packed ? (size_t)H * hd : 0, voff = packed ? (size_t)(H + G) * hd : 0;
    pair *out = nl_selftest_dev(c, NULL, (size_t)B * T * H * hd * 4),
         *lse = nl_selftest_dev(c, NULL, (size_t)B * H * T * 4);
    if (!c->oom)
        BOTH(c, be->attention_forward(be, D(out), D(lse), D(q), qs, (const float *)D(k) + koff,
                                      (const float *)D(v) + voff, ks, s));
    nl_selftest_done(c, "attention_forward", shape,
                     max2(nl_selftest_cmp(c, out, (size_t)B * T * H * hd),
                          nl_selftest_cmp(c, lse, (size_t)B * H * T)),
                     TOL_ATTN);
}

/* Rows of C values in [-scale, scale]. */
static void check_softmax(nl_selftest *c, int N, int C, double scale)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d |x|<%g", N, C, scale);
    if (!NEED(c, softmax_forward, shape))
        return;
    float *in = nl_selftest_rnd(c, (size_t)N * C, -scale, scale);
    pair *x = nl_selftest_dev(c, in, (size_t)N * C * 4);
    if (!c->oom)
        BOTH(c, be->softmax_forward(be, D(x), N, C));
    nl_selftest_done(c, "softmax_forward", shape, nl_selftest_cmp(c, x, (size_t)N * C), TOL_RED);
}

static void check_swiglu(nl_selftest *c, int N, int F)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d F=%d", N, F);
    if (!NEED(c, swiglu_forward, shape))
        return;
    pair *gu =
        nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)N * 2 * F, -8, 8), (size_t)N * 2 * F * 4);
    pair *out = nl_selftest_dev(c, NULL, (size_t)N * F * 4);
    if (!c->oom)
        BOTH(c, be->swiglu_forward(be, D(out), D(gu), N, F));
    nl_selftest_done(c, "swiglu_forward", shape, nl_selftest_cmp(c, out, (size_t)N * F), TOL_ELEM);
}

static void check_gather(nl_selftest *c, int n, int C, int src_rows)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d C=%d src=%d", n, C, src_rows);
    if (!NEED(c, gather_rows, shape))
        return;
    pair *src = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)src_rows * C, -1, 1),
                                (size_t)src_rows * C * 4);
    pair *idx = nl_selftest_dev(c, nl_selftest_ids(c, (size_t)n, src_rows), (size_t)n * 4);
    pair *out = nl_selftest_dev(c, NULL, (size_t)n * C * 4);
    if (!c->oom)
        BOTH(c, be->gather_rows(be, D(out), D(src), D(idx), n, C));
    nl_selftest_done(c, "gather_rows", shape, cmp_exact(c, out), 0);
}

/* the destination is full of random values: its padding must survive */
static void check_copy_rows(nl_selftest *c, int rows, int cols, int dst_stride, int src_stride)
{
    char shape[64];
    snprintf(shape, sizeof shape, "rows=%d cols=%d dst=%d src=%d", rows, cols, dst_stride,
             src_stride);
    if (!NEED(c, copy_rows, shape))
        return;
    pair *src = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)rows * src_stride, -1, 1),
                                (size_t)rows * src_stride * 4);
    pair *dst = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)rows * dst_stride, -1, 1),
                                (size_t)rows * dst_stride * 4);
    if (!c->oom)
        BOTH(c, be->copy_rows(be, D(dst), dst_stride, D(src), src_stride, rows, cols));
    nl_selftest_done(c, "copy_rows", shape, cmp_exact(c, dst), 0);
}

static void check_moe_combine(nl_selftest *c, int N, int k, int C)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d k=%d C=%d", N, k, C);
    if (!NEED(c, moe_combine, shape))
        return;
    const size_t nk = (size_t)N * k;
    pair *x = nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)N * C, -1, 1), (size_t)N * C * 4);
    pair *y = nl_selftest_dev(c, nl_selftest_rnd(c, nk * C, -1, 1), nk * C * 4);
    pair *slot = nl_selftest_dev(c, nl_selftest_perm(c, (int)nk), nk * 4),
         *w = nl_selftest_dev(c, nl_selftest_rnd(c, nk, 0, 1), nk * 4);
    if (!c->oom)
        BOTH(c, be->moe_combine(be, D(x), D(y), D(slot), D(w), N, k, C));
    nl_selftest_done(c, "moe_combine", shape, nl_selftest_cmp(c, x, (size_t)N * C), TOL_ELEM);
}

/* Routing on rows with ties (8 levels): choices, offsets and tables
 * exact, weights 1e-6; then the aux loss of that routing (frac and counts
 * exact, the loss 1e-5) and an expert GEMM grouped by its offsets. */
static void check_moe_route(nl_selftest *c, int N, int E, int k, int K, int F)
{
    char shape[80];
    snprintf(shape, sizeof shape, "N=%d E=%d k=%d", N, E, k);
    if (!NEED(c, moe_route, shape) || !NEED(c, moe_aux, shape) || !NEED(c, gemm_grouped, shape))
        return;
    const size_t nk = (size_t)N * k, np = (size_t)N * E;
    float *ph = nl_selftest_rnd(c, np, 0, 8);
    for (size_t i = 0; ph && i < np; i++)
        ph[i] = (1.0f + floorf(ph[i])) / 8.0f;
    pair *p = nl_selftest_dev(c, ph, np * 4), *ch = nl_selftest_dev(c, NULL, nk * 4),
         *w = nl_selftest_dev(c, NULL, nk * 4);
    pair *off = nl_selftest_dev(c, NULL, (size_t)(E + 1) * 4),
         *perm_ = nl_selftest_dev(c, NULL, nk * 4);
    pair *slot = nl_selftest_dev(c, NULL, nk * 4), *frac = nl_selftest_dev(c, NULL, (size_t)E * 4);
    pair *cnt = nl_selftest_dev(c, NULL, (size_t)E * 8), *aux = nl_selftest_dev(c, NULL, 8);
    pair *a = nl_selftest_dev(c, nl_selftest_rnd(c, nk * K, -1, 1), nk * K * 4);
    pair *b =
        nl_selftest_dev(c, nl_selftest_rnd(c, (size_t)E * F * K, -1, 1), (size_t)E * F * K * 4);
    pair *out = nl_selftest_dev(c, NULL, nk * F * 4);
    double e_tab = INFINITY, e_aux = INFINITY, e_gemm = INFINITY;
    if (!c->oom) {
        BOTH(c, be->moe_route(be, D(ch), D(w), D(off), D(perm_), D(slot), D(p), N, E, k));
        BOTH(c, be->moe_aux(be, D(aux), D(frac), D(cnt), D(p), D(off), NULL, N, E, k, (double)N));
        BOTH(c, be->gemm_grouped(be, 1, F, K, D(a), K, D(b), K, (size_t)F * K, D(out), F, D(off), E,
                                 N));
        e_tab = cmp_exact(c, ch) + cmp_exact(c, off) + cmp_exact(c, perm_) + cmp_exact(c, slot);
        const double ew = nl_selftest_cmp(c, w, nk);
        e_tab = e_tab > 0 ? INFINITY : ew;
        const double *ar = nl_selftest_down(c, aux, 0), *at = nl_selftest_down(c, aux, 1);
        e_aux = cmp_exact(c, frac) + cmp_exact(c, cnt) > 0 || !ar || !at ? INFINITY
                                                                         : fabs(*at - *ar) / *ar;
        e_gemm = nl_selftest_cmp(c, out, nk * F);
    }
    char more[112];
    nl_selftest_line(c, !c->oom && e_tab <= TOL_ELEM, "moe_route", shape, e_tab, TOL_ELEM, NULL);
    snprintf(more, sizeof more, "%s (its routing)", shape);
    nl_selftest_line(c, !c->oom && e_aux <= TOL_RED, "moe_aux", more, e_aux, TOL_RED, NULL);
    snprintf(more, sizeof more, "%s K=%d cols=%d", shape, K, F);
    nl_selftest_done(c, "gemm_grouped", more, e_gemm, nl_selftest_tol_gemm(c, K));
}

static void forward_ops(nl_selftest *c)
{
    check_mem_info(c);
    check_roundtrip(c, 1, 0);
    check_roundtrip(c, 4099, 1);
    check_roundtrip(c, (1u << 22) + 7, 64);
    check_zero(c, 4096, 0, 4096);
    check_zero(c, 40000, 4, 4 * 4999);
    check_zero(c, 4003, 1, 13);
    check_gemm(c, 0, 1, 1, 129, 257, 1, 0, 0);   /* decode row, odd widths */
    check_gemm(c, 0, 1, 17, 384, 128, 1, 0, 0);  /* QKV of 17 rows */
    check_gemm(c, 0, 1, 33, 128, 256, 1, 1, 0);  /* Wo into the residual */
    check_gemm(c, 0, 0, 33, 77, 65, 0.5f, 0, 3); /* padded strides */
    check_gemm(c, 1, 0, 128, 257, 33, 1, 1, 0);  /* dW = dY^T X */
    check_gemm(c, 1, 1, 17, 33, 65, 1, 0.5f, 1);
    check_gemm(c, 0, 1, 64, 64, 4096, 1, 0, 0);  /* long K */
    check_gemm(c, 0, 1, 5, 50000, 128, 1, 0, 0); /* a head over V = 50,000 */
    check_embedding(c, 17, 129, 1000);
    check_embedding(c, 1, 64, 3);
    check_rmsnorm(c, 1, 4096);
    check_rmsnorm(c, 17, 127);
    check_rmsnorm(c, 33, 1000);
    check_rope(c, 17, (4 + 2) * 64, 0, 5, 64, 2048); /* q and k heads of a packed qkv */
    check_rope(c, 33, 4 * 128 + 7, 7, 4, 128, 8192); /* odd row, col0 > 0 */
    check_rope(c, 1, 2 * 16, 0, 2, 16, 1001);
    check_attention(c, 2, 17, 0, 0, 4, 1, 64);  /* packed, H/G = 4 */
    check_attention(c, 1, 33, 0, 0, 4, 4, 128); /* H/G = 1 */
    check_attention(c, 3, 1, 0, 0, 2, 2, 16);
    check_attention(c, 1, 130, 0, 0, 2, 1, 64);
    check_attention(c, 1, 1, 1000, 1024, 4, 1, 64); /* decode over a cache */
    check_attention(c, 2, 1, 999, 1001, 8, 2, 128);
    check_attention(c, 2, 17, 33, 64, 4, 4, 16); /* chunked prefill */
    check_softmax(c, 3, 50000, 4);
    check_softmax(c, 17, 8, 2);
    check_softmax(c, 1, 1, 1);
    check_softmax(c, 5, 1001, 50);
    check_swiglu(c, 17, 343);
    check_swiglu(c, 1, 1);
    check_swiglu(c, 64, 1024);
    check_gather(c, 33, 77, 20);
    check_gather(c, 1, 128, 5);
    check_copy_rows(c, 17, 63, 100, 70);
    check_copy_rows(c, 1, 1, 1, 1);
    check_copy_rows(c, 33, 256, 256, 384);
    check_moe_combine(c, 17, 2, 129);
    check_moe_combine(c, 1, 1, 64);
    check_moe_combine(c, 64, 4, 256);
    check_moe_route(c, 1, 8, 2, 64, 96);
    check_moe_route(c, 65, 8, 2, 128, 257);
    check_moe_route(c, 300, 16, 4, 33, 64);
}

/* ---------------------------------------------------------------- TF32 on the CPU */

/* Test hook NL_TEST_SELFTEST_TF32_ROUND=1: on a target whose memory is the
 * host's (cpu), its gemm takes copies of A and B rounded as TF32 (10
 * mantissa bits, to nearest, ties away as cvt.rna.tf32), and the TF32 row
 * of tolerances applies: CI checks that row against TF32's rounding
 * without a GPU (tests/test_selftest.sh tf32). The grouped expert GEMMs
 * stay FP32, as on the CUDA backend. */
static void (*fp32_gemm)(nl_backend *, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);

static float *tf32_copy(const float *x, size_t n)
{
    float *y = malloc(n * sizeof *y);
    for (size_t i = 0; y && i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        if ((u & 0x7f800000u) != 0x7f800000u) /* inf and NaN stay */
            u = (u + 0x1000u) & ~0x1fffu;
        memcpy(&y[i], &u, sizeof u);
    }
    return y;
}

static void tf32_gemm(nl_backend *be, int ta, int tb, int M, int N, int K, float alpha,
                      const float *A, int lda, const float *B, int ldb, float beta, float *C,
                      int ldc)
{
    float *a = NULL, *b = NULL;
    if (M > 0 && N > 0 && K > 0) {
        a = tf32_copy(A, ta ? (size_t)(K - 1) * lda + M : (size_t)(M - 1) * lda + K);
        b = tf32_copy(B, tb ? (size_t)(N - 1) * ldb + K : (size_t)(K - 1) * ldb + N);
    }
    fp32_gemm(be, ta, tb, M, N, K, alpha, a ? a : A, lda, b ? b : B, ldb, beta, C, ldc);
    free(a);
    free(b);
}

/* ---------------------------------------------------------------- command */

int nl_cmd_selftest(int argc, char **argv)
{
    nl_flag flags[] = {
        {"device", 1, "backend to test: cpu-devsim, cuda:N, cpu", NULL},
        {"ref", 1, "reference backend (default cpu)", NULL},
        {"threads", 1, "CPU worker threads of both backends (default: all cores)", NULL},
        {"seed", 1, "seed of the random inputs and the model (default 1)", NULL},
        {"tf32", 0, "allow TF32 in the target's GEMM (looser GEMM and model tolerances)", NULL},
        {"precision", 1,
         "P: the target's GEMM precision, fp32 (default) or bf16 (bf16 tolerances, "
         "cli/selftest_bf16.c)",
         NULL},
        {0}};
    const char *usage =
        "neuroctl selftest --device D [--ref cpu] [--threads N] [--seed S] [--tf32] "
        "[--precision fp32|bf16]";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc == 1)
        printf("\nEvery slot of D against the reference on random inputs, then a small model's\n"
               "prefill, logits and %d greedy decode steps, and where D can train one layer\n"
               "forward/backward and three local training steps. One line per check, then\n"
               "'selftest: N passed, N failed'. Exit status: 0 all passed, 1 a check failed,\n"
               "2 usage error, 3 a backend could not be created (e.g. no CUDA device).\n",
               NL_SELFTEST_DECODE);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *device = nl_args_get(flags, "device"), *ref = nl_args_get(flags, "ref");
    long long threads = 0, seed = 1;
    nl_error err = {0};
    if (!device) {
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if (!ref)
        ref = "cpu";
    if ((rc = nl_args_int(flags, "threads", 0, 1024, &threads)) ||
        (rc = nl_args_int(flags, "seed", 0, INT64_MAX, &seed)))
        return rc;
    if (nl_backend_parse_device(device, &err) != NL_OK ||
        nl_backend_parse_device(ref, &err) != NL_OK) {
        fprintf(stderr, "neuroctl selftest: %s\n", err.msg);
        return 2;
    }
    const char *prec = nl_args_get(flags, "precision");
    if (prec && strcmp(prec, "fp32") != 0 && strcmp(prec, "bf16") != 0) {
        fprintf(stderr, "neuroctl selftest: --precision %s: not fp32 or bf16\n", prec);
        return 2;
    }
    nl_selftest c = {.tf32 = nl_args_get(flags, "tf32") != NULL,
                     .bf16 = prec && strcmp(prec, "bf16") == 0,
                     .lr_scale = 1.0f};
    /* the precision's row; bf16 widens it check by check (selftest_bf16.c) */
    c.tol = c.tf32 ? &nl_selftest_tols_tf32 : &nl_selftest_tols_fp32;
#ifdef NL_TEST_HOOKS
    const char *lr_scale = getenv("NL_TEST_SELFTEST_LR_SCALE"); /* test hook (test builds only) */
    if (lr_scale)
        c.lr_scale = (float)atof(lr_scale);
#endif
    nl_rng_seed(&c.rng, (uint64_t)seed, 0);
    if (nl_backend_new(&c.be[0], ref, &(nl_backend_opts){.threads = (int)threads}, &err) != NL_OK ||
        nl_backend_new(&c.be[1], device,
                       &(nl_backend_opts){.threads = (int)threads, .tf32 = c.tf32, .bf16 = c.bf16},
                       &err) != NL_OK) {
        fprintf(stderr, "neuroctl selftest: %s (%s)\n", err.msg, nl_status_str(err.status));
        nl_backend_destroy(&c.be[0]);
        return 3;
    }
#ifdef NL_TEST_HOOKS
    const int tf32_round = getenv("NL_TEST_SELFTEST_TF32_ROUND") != NULL; /* test hook */
#else
    const int tf32_round = 0;
#endif
    if (tf32_round && c.be[1]->host_memory) {
        c.tol = &nl_selftest_tols_tf32;
        fp32_gemm = c.be[1]->gemm;
        c.be[1]->gemm = tf32_gemm;
    }
    printf("selftest: %s against %s, seed %lld%s%s\n", c.be[1]->name, c.be[0]->name, seed,
           c.tf32      ? ", TF32"
           : fp32_gemm ? ", TF32 rounding emulated in its gemm (test hook)"
                       : "",
           c.bf16 ? ", bf16 GEMMs" : "");
    forward_ops(&c);
    nl_selftest_sample(&c);
    if (c.be[1]->can_train)
        nl_selftest_backward_ops(&c);
    else
        printf("skip  backward and optimizer slots, layer backward, training steps: %s cannot "
               "train\n",
               c.be[1]->name);
    nl_selftest_family(&c);
    nl_selftest_cudnn(&c, device, (int)threads);
    nl_selftest_model(&c, (uint64_t)seed);
    nl_selftest_fused(&c);
    printf("selftest: %d passed, %d failed\n", c.passed, c.failed);
    nl_backend_destroy(&c.be[1]);
    nl_backend_destroy(&c.be[0]);
    return c.failed ? 1 : 0;
}
