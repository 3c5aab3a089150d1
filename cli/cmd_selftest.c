/* neuroctl selftest: every slot of a target backend against the reference
 * backend (the CPU one by default), op by op on random inputs from a fixed
 * seed, then a whole small model (prefill routing, logits, 32 greedy decode
 * steps) through core's public API on both. It is the twin test of the
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
 *     counts the differing bytes or elements.
 * Tolerances: element-wise 1e-6 (swiglu, rope, moe_combine, adamw, the dy
 * of moe_combine_backward); reductions, norms, softmax (plus the CPU
 * reference's own error, see check_softmax), cross-entropy, attention,
 * router probabilities and model logits 1e-5; GEMM 1e-5 sqrt(K). With
 * --tf32: GEMM 2e-3, model logits 1e-2 (a sanity bound only).
 *
 * Exit status: 0 all passed, 1 a check failed, 2 usage error, 3 a backend
 * could not be created (e.g. "cuda:0: no CUDA device"), with its message. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "commands.h"
#include "core/forward.h"
#include "core/layer.h"
#include "core/rng.h"

#define TOL_ELEM 1e-6
#define TOL_RED 1e-5
#define TOL_ATTN 1e-5
#define NEAR_TIE 1e-5 /* two top-k router probabilities closer than this */

#define MAX_LIVE 24

/* One buffer on both backends: d[0] on the reference, d[1] on the target. */
typedef struct pair {
    void *d[2];
    size_t bytes;
} pair;

typedef struct selftest {
    nl_backend *be[2]; /* 0: reference, 1: target */
    nl_rng rng;
    int tf32;
    int passed, failed;
    pair live[MAX_LIVE]; /* this check's device buffers */
    int n_live;
    void *host[2 * MAX_LIVE]; /* this check's host buffers */
    int n_host;
    int oom;
} selftest;

/* Run `call` once per backend, reference first; D(p) is p's pointer there. */
#define BOTH(c, call)                                                                              \
    for (int s_ = 0; s_ < 2; s_++) {                                                               \
        nl_backend *be = (c)->be[s_];                                                              \
        call;                                                                                      \
    }
#define D(p) ((p)->d[s_])

/* ---------------------------------------------------------------- buffers */

static void *hbuf(selftest *c, size_t bytes)
{
    void *p = c->n_host < 2 * MAX_LIVE ? calloc(1, bytes ? bytes : 1) : NULL;
    if (!p) {
        c->oom = 1;
        return NULL;
    }
    c->host[c->n_host++] = p;
    return p;
}

static float *rnd(selftest *c, size_t n, double lo, double hi)
{
    float *x = hbuf(c, n * sizeof *x);
    for (size_t i = 0; x && i < n; i++)
        x[i] = (float)(lo + (hi - lo) * nl_rng_uniform(&c->rng));
    return x;
}

static int32_t *ids(selftest *c, size_t n, int below)
{
    int32_t *x = hbuf(c, n * sizeof *x);
    for (size_t i = 0; x && i < n; i++)
        x[i] = (int32_t)nl_rng_below(&c->rng, (uint64_t)below);
    return x;
}

/* A random permutation of 0..n-1 (dispatch slots: each written once). */
static int32_t *perm(selftest *c, int n)
{
    int32_t *x = hbuf(c, (size_t)n * sizeof *x);
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
 * their ops only while c->oom is clear, and done() fails them. */
static pair *dev(selftest *c, const void *host, size_t bytes)
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
static void mirror(selftest *c, pair *p)
{
    void *h = hbuf(c, p->bytes);
    if (!h || c->oom)
        return;
    c->be[0]->download(c->be[0], h, p->d[0], p->bytes);
    c->be[1]->upload(c->be[1], p->d[1], h, p->bytes);
}

static void *down(selftest *c, const pair *p, int side)
{
    void *h = hbuf(c, p->bytes);
    if (h && !c->oom)
        c->be[side]->download(c->be[side], h, p->d[side], p->bytes);
    return h;
}

/* Scaled max error of columns [col0, col0 + cols) of `rows` rows of
 * stride `stride`: max |t - r| / max |r| over those elements. */
static double err_cols(const float *r, const float *t, size_t rows, size_t stride, size_t col0,
                       size_t cols)
{
    double diff = 0.0, scale = 0.0;
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

static double err_all(const float *r, const float *t, size_t n)
{
    return err_cols(r, t, 1, n, 0, n);
}

/* err_cols of p's bytes on the two backends */
static double cmp_cols(selftest *c, const pair *p, size_t rows, size_t stride, size_t col0,
                       size_t cols)
{
    const float *r = down(c, p, 0), *t = down(c, p, 1);
    return c->oom ? INFINITY : err_cols(r, t, rows, stride, col0, cols);
}

static double cmp(selftest *c, const pair *p, size_t n)
{
    return cmp_cols(c, p, 1, n, 0, n);
}

/* Differing bytes of p on the two backends. */
static double cmp_exact(selftest *c, const pair *p)
{
    const unsigned char *r = down(c, p, 0), *t = down(c, p, 1);
    if (c->oom)
        return INFINITY;
    size_t bad = 0;
    for (size_t i = 0; i < p->bytes; i++)
        bad += r[i] != t[i];
    return (double)bad;
}

static double max2(double a, double b)
{
    return a > b || isnan(a) ? a : b;
}

/* ---------------------------------------------------------------- report */

static void release(selftest *c)
{
    for (int i = 0; i < c->n_live; i++)
        for (int s = 0; s < 2; s++)
            c->be[s]->free(c->be[s], c->live[i].d[s]);
    for (int i = 0; i < c->n_host; i++)
        free(c->host[i]);
    c->n_live = c->n_host = 0;
    c->oom = 0;
}

static void line(selftest *c, int ok, const char *check, const char *shape, double err, double tol,
                 const char *why)
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
static void done(selftest *c, const char *check, const char *shape, double err, double tol)
{
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
    line(c, st == NL_OK && !c->oom && err <= tol, check, shape, err, tol, why);
    release(c);
}

/* A forward slot the target leaves NULL fails its check. */
static int has(selftest *c, int present, const char *check, const char *shape)
{
    if (present)
        return 1;
    char why[96];
    snprintf(why, sizeof why, "(not implemented on %s)", c->be[1]->name);
    line(c, 0, check, shape, INFINITY, 0, why);
    release(c);
    return 0;
}

#define NEED(c, slot, shape) has((c), (c)->be[1]->slot != NULL, #slot, (shape))

/* ---------------------------------------------------------------- memory */

/* upload at a byte offset, download back: the same bytes */
static void check_roundtrip(selftest *c, size_t bytes, size_t off)
{
    char shape[64];
    snprintf(shape, sizeof shape, "bytes=%zu off=%zu", bytes, off);
    unsigned char *h = hbuf(c, bytes), *back = hbuf(c, bytes);
    pair *p = dev(c, NULL, bytes + off);
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
    done(c, "upload_download", shape, bad, 0);
}

/* zero [off, off + bytes) of a buffer full of NaN: those bytes become 0,
 * the rest keep their NaN */
static void check_zero(selftest *c, size_t total, size_t off, size_t bytes)
{
    char shape[64];
    snprintf(shape, sizeof shape, "bytes=%zu off=%zu of %zu (NaN)", bytes, off, total);
    float *nan = hbuf(c, total + 4);
    for (size_t i = 0; nan && i < total / 4 + 1; i++)
        nan[i] = NAN;
    pair *p = dev(c, nan, total);
    if (!NEED(c, zero, shape))
        return;
    double bad = INFINITY;
    if (!c->oom) {
        c->be[1]->zero(c->be[1], (char *)p->d[1] + off, bytes);
        const unsigned char *t = down(c, p, 1), *orig = (const unsigned char *)nan;
        bad = 0;
        for (size_t i = 0; t && i < total; i++)
            bad += t[i] != (i >= off && i < off + bytes ? 0 : orig[i]);
    }
    done(c, "zero", shape, bad, 0);
}

/* ---------------------------------------------------------------- gemm */

/* C = alpha op(A) op(B) + beta C with row strides padded by `pad`. */
static void check_gemm(selftest *c, int ta, int tb, int M, int N, int K, float alpha, float beta,
                       int pad)
{
    char shape[80];
    snprintf(shape, sizeof shape, "%c%c M=%d N=%d K=%d a=%g b=%g pad=%d", ta ? 't' : 'n',
             tb ? 't' : 'n', M, N, K, alpha, beta, pad);
    if (!NEED(c, gemm, shape))
        return;
    const int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    const int lda = ac + pad, ldb = bc + pad, ldc = N + pad;
    float *A = rnd(c, (size_t)ar * lda, -1, 1), *B = rnd(c, (size_t)br * ldb, -1, 1);
    float *C0 = rnd(c, (size_t)M * ldc, -1, 1);
    pair *pa = dev(c, A, (size_t)ar * lda * 4), *pb = dev(c, B, (size_t)br * ldb * 4);
    pair *pc = dev(c, C0, (size_t)M * ldc * 4);
    double worst = INFINITY;
    if (!c->oom) {
        BOTH(c, be->gemm(be, ta, tb, M, N, K, alpha, D(pa), lda, D(pb), ldb, beta, D(pc), ldc));
        const float *r = down(c, pc, 0), *t = down(c, pc, 1);
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
    done(c, "gemm", shape, worst, c->tf32 ? 2e-3 : 1e-5 * sqrt((double)K));
}

/* ---------------------------------------------------------------- forward ops */

static void check_embedding(selftest *c, int N, int C, int rows)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d rows=%d", N, C, rows);
    if (!NEED(c, embedding_forward, shape))
        return;
    int32_t *tok = ids(c, (size_t)N, rows);
    if (tok)
        tok[N - 1] = rows - 1; /* the last row of the table */
    pair *pt = dev(c, tok, (size_t)N * 4),
         *tab = dev(c, rnd(c, (size_t)rows * C, -1, 1), (size_t)rows * C * 4);
    pair *out = dev(c, NULL, (size_t)N * C * 4);
    if (!c->oom)
        BOTH(c, be->embedding_forward(be, D(out), D(pt), D(tab), N, C));
    done(c, "embedding_forward", shape, cmp_exact(c, out), 0);
}

static void check_rmsnorm(selftest *c, int N, int C)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d", N, C);
    if (!NEED(c, rmsnorm_forward, shape))
        return;
    pair *x = dev(c, rnd(c, (size_t)N * C, -2, 2), (size_t)N * C * 4);
    pair *w = dev(c, rnd(c, (size_t)C, 0.5, 1.5), (size_t)C * 4);
    pair *out = dev(c, NULL, (size_t)N * C * 4), *rstd = dev(c, NULL, (size_t)N * 4);
    if (!c->oom)
        BOTH(c, be->rmsnorm_forward(be, D(out), D(rstd), D(x), D(w), N, C, 1e-6f));
    done(c, "rmsnorm_forward", shape, max2(cmp(c, out, (size_t)N * C), cmp(c, rstd, (size_t)N)),
         TOL_RED);
}

/* heads of hd at column col0 of rows of width row, positions below maxpos */
static void check_rope(selftest *c, int N, int row, int col0, int heads, int hd, int maxpos)
{
    char shape[80];
    snprintf(shape, sizeof shape, "N=%d row=%d col0=%d heads=%d hd=%d pos<%d", N, row, col0, heads,
             hd, maxpos);
    if (!NEED(c, rope_forward, shape))
        return;
    int32_t *pos = ids(c, (size_t)N, maxpos);
    if (pos)
        pos[0] = maxpos - 1;
    pair *x = dev(c, rnd(c, (size_t)N * row, -1, 1), (size_t)N * row * 4);
    pair *pp = dev(c, pos, (size_t)N * 4);
    if (!c->oom)
        BOTH(c, be->rope_forward(be, D(x), D(pp), N, row, col0, heads, hd, 10000.0f));
    done(c, "rope_forward", shape, cmp(c, x, (size_t)N * row), TOL_ELEM);
}

/* packed: q, k, v in one buffer of rows (H + 2G) hd, as the model's prefill
 * (kv_cap = T, past = 0); else a query buffer and a cache of kv_cap rows
 * per sequence, NaN past the filled positions */
static void check_attention(selftest *c, int B, int T, int past, int kv_cap, int H, int G, int hd)
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
    pair *q = dev(c, rnd(c, nq, -1, 1), nq * 4), *k = q, *v = q;
    if (!packed) {
        float *kh = rnd(c, nkv, -1, 1), *vh = rnd(c, nkv, -1, 1);
        for (int b = 0; kh && vh && b < B; b++)
            for (size_t i = (size_t)(past + T) * ks; i < (size_t)kv_cap * ks; i++)
                kh[(size_t)b * kv_cap * ks + i] = vh[(size_t)b * kv_cap * ks + i] = NAN;
        k = dev(c, kh, nkv * 4);
        v = dev(c, vh, nkv * 4);
    }
    const size_t koff = packed ? (size_t)H * hd : 0, voff = packed ? (size_t)(H + G) * hd : 0;
    pair *out = dev(c, NULL, (size_t)B * T * H * hd * 4),
         *lse = dev(c, NULL, (size_t)B * H * T * 4);
    if (!c->oom)
        BOTH(c, be->attention_forward(be, D(out), D(lse), D(q), qs, (const float *)D(k) + koff,
                                      (const float *)D(v) + voff, ks, s));
    done(c, "attention_forward", shape,
         max2(cmp(c, out, (size_t)B * T * H * hd), cmp(c, lse, (size_t)B * H * T)), TOL_ATTN);
}

/* Error of the reference's softmax against one computed in double. */
static double softmax_ref_error(selftest *c, const float *in, const pair *x, int N, int C)
{
    const float *r = down(c, x, 0);
    double diff = 0.0, scale = 0.0;
    for (int n = 0; r && n < N; n++) {
        const float *row = in + (size_t)n * C;
        double m = -INFINITY, sum = 0.0;
        for (int i = 0; i < C; i++)
            m = fmax(m, row[i]);
        for (int i = 0; i < C; i++)
            sum += exp((double)row[i] - m);
        for (int i = 0; i < C; i++) {
            const double p = exp((double)row[i] - m) / sum;
            diff = fmax(diff, fabs(r[(size_t)n * C + i] - p));
            scale = fmax(scale, p);
        }
    }
    return r ? diff / scale : INFINITY;
}

/* Rows of C values in [-scale, scale]. The CPU reference sums a row in
 * float, so over 50,000 columns its own error against a softmax in double
 * reaches about 1e-5 (measured: 1e-6 to 9.5e-6 over five seeds); the
 * tolerance is 1e-5 plus that error of the reference, computed here, so
 * that a more accurate target is not failed for the reference's rounding. */
static void check_softmax(selftest *c, int N, int C, double scale)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d |x|<%g", N, C, scale);
    if (!NEED(c, softmax_forward, shape))
        return;
    float *in = rnd(c, (size_t)N * C, -scale, scale);
    pair *x = dev(c, in, (size_t)N * C * 4);
    double tol = TOL_RED;
    if (!c->oom) {
        BOTH(c, be->softmax_forward(be, D(x), N, C));
        tol += softmax_ref_error(c, in, x, N, C);
    }
    done(c, "softmax_forward", shape, cmp(c, x, (size_t)N * C), tol);
}

static void check_swiglu(selftest *c, int N, int F)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d F=%d", N, F);
    if (!NEED(c, swiglu_forward, shape))
        return;
    pair *gu = dev(c, rnd(c, (size_t)N * 2 * F, -8, 8), (size_t)N * 2 * F * 4);
    pair *out = dev(c, NULL, (size_t)N * F * 4);
    if (!c->oom)
        BOTH(c, be->swiglu_forward(be, D(out), D(gu), N, F));
    done(c, "swiglu_forward", shape, cmp(c, out, (size_t)N * F), TOL_ELEM);
}

static void check_gather(selftest *c, int n, int C, int src_rows)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d C=%d src=%d", n, C, src_rows);
    if (!NEED(c, gather_rows, shape))
        return;
    pair *src = dev(c, rnd(c, (size_t)src_rows * C, -1, 1), (size_t)src_rows * C * 4);
    pair *idx = dev(c, ids(c, (size_t)n, src_rows), (size_t)n * 4);
    pair *out = dev(c, NULL, (size_t)n * C * 4);
    if (!c->oom)
        BOTH(c, be->gather_rows(be, D(out), D(src), D(idx), n, C));
    done(c, "gather_rows", shape, cmp_exact(c, out), 0);
}

/* the destination is full of random values: its padding must survive */
static void check_copy_rows(selftest *c, int rows, int cols, int dst_stride, int src_stride)
{
    char shape[64];
    snprintf(shape, sizeof shape, "rows=%d cols=%d dst=%d src=%d", rows, cols, dst_stride,
             src_stride);
    if (!NEED(c, copy_rows, shape))
        return;
    pair *src = dev(c, rnd(c, (size_t)rows * src_stride, -1, 1), (size_t)rows * src_stride * 4);
    pair *dst = dev(c, rnd(c, (size_t)rows * dst_stride, -1, 1), (size_t)rows * dst_stride * 4);
    if (!c->oom)
        BOTH(c, be->copy_rows(be, D(dst), dst_stride, D(src), src_stride, rows, cols));
    done(c, "copy_rows", shape, cmp_exact(c, dst), 0);
}

static void check_moe_combine(selftest *c, int N, int k, int C)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d k=%d C=%d", N, k, C);
    if (!NEED(c, moe_combine, shape))
        return;
    const size_t nk = (size_t)N * k;
    pair *x = dev(c, rnd(c, (size_t)N * C, -1, 1), (size_t)N * C * 4);
    pair *y = dev(c, rnd(c, nk * C, -1, 1), nk * C * 4);
    pair *slot = dev(c, perm(c, (int)nk), nk * 4), *w = dev(c, rnd(c, nk, 0, 1), nk * 4);
    if (!c->oom)
        BOTH(c, be->moe_combine(be, D(x), D(y), D(slot), D(w), N, k, C));
    done(c, "moe_combine", shape, cmp(c, x, (size_t)N * C), TOL_ELEM);
}

static void forward_ops(selftest *c)
{
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
}

/* ---------------------------------------------------------------- backward ops */

static void check_embedding_backward(selftest *c, int N, int C, int rows)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d rows=%d (repeats)", N, C, rows);
    if (!NEED(c, embedding_backward, shape))
        return;
    pair *dt = dev(c, rnd(c, (size_t)rows * C, -1, 1), (size_t)rows * C * 4);
    pair *dout = dev(c, rnd(c, (size_t)N * C, -1, 1), (size_t)N * C * 4);
    pair *tok = dev(c, ids(c, (size_t)N, rows), (size_t)N * 4);
    if (!c->oom)
        BOTH(c, be->embedding_backward(be, D(dt), D(dout), D(tok), N, C));
    done(c, "embedding_backward", shape, cmp(c, dt, (size_t)rows * C), TOL_RED);
}

/* dinp and dw accumulate into random values */
static void check_rmsnorm_backward(selftest *c, int N, int C)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d", N, C);
    if (!NEED(c, rmsnorm_backward, shape))
        return;
    const size_t n = (size_t)N * C;
    pair *x = dev(c, rnd(c, n, -2, 2), n * 4), *w = dev(c, rnd(c, (size_t)C, 0.5, 1.5), C * 4);
    pair *out = dev(c, NULL, n * 4), *rstd = dev(c, NULL, (size_t)N * 4);
    pair *dout = dev(c, rnd(c, n, -1, 1), n * 4), *dx = dev(c, rnd(c, n, -1, 1), n * 4);
    pair *dw = dev(c, rnd(c, (size_t)C, -1, 1), (size_t)C * 4);
    if (!c->oom) {
        nl_backend *r = c->be[0];
        r->rmsnorm_forward(r, out->d[0], rstd->d[0], x->d[0], w->d[0], N, C, 1e-6f);
        mirror(c, rstd);
        BOTH(c, be->rmsnorm_backward(be, D(dx), D(dw), D(dout), D(x), D(w), D(rstd), N, C));
    }
    done(c, "rmsnorm_backward", shape, max2(cmp(c, dx, n), cmp(c, dw, (size_t)C)), TOL_RED);
}

/* packed q | k | v rows as in training; out and lse from the reference's
 * forward; dq, dk, dv each judged against its own scale */
static void check_attention_backward(selftest *c, int B, int T, int H, int G, int hd)
{
    char shape[80];
    snprintf(shape, sizeof shape, "B=%d T=%d H=%d G=%d hd=%d packed", B, T, H, G, hd);
    if (!NEED(c, attention_backward, shape))
        return;
    nl_attn_shape s = {.B = B, .T = T, .past = 0, .kv_cap = T, .H = H, .G = G, .hd = hd};
    const int qs = (H + 2 * G) * hd, ko = H * hd, vo = (H + G) * hd;
    const size_t N = (size_t)B * T, nq = N * qs, no = N * H * hd;
    pair *qkv = dev(c, rnd(c, nq, -1, 1), nq * 4), *dqkv = dev(c, rnd(c, nq, -1, 1), nq * 4);
    pair *out = dev(c, NULL, no * 4), *lse = dev(c, NULL, (size_t)B * H * T * 4);
    pair *dout = dev(c, rnd(c, no, -1, 1), no * 4);
    if (!c->oom) {
        nl_backend *r = c->be[0];
        const float *q = qkv->d[0];
        r->attention_forward(r, out->d[0], lse->d[0], q, qs, q + ko, q + vo, qs, s);
        mirror(c, out);
        mirror(c, lse);
        BOTH(c, be->attention_backward(be, D(dqkv), (float *)D(dqkv) + ko, (float *)D(dqkv) + vo,
                                       D(dout), D(qkv), qs, (const float *)D(qkv) + ko,
                                       (const float *)D(qkv) + vo, qs, D(out), D(lse), s));
    }
    double e = cmp_cols(c, dqkv, N, qs, 0, ko);
    e = max2(e, cmp_cols(c, dqkv, N, qs, ko, vo - ko));
    e = max2(e, cmp_cols(c, dqkv, N, qs, vo, qs - vo));
    done(c, "attention_backward", shape, e, TOL_ATTN);
}

static void check_swiglu_backward(selftest *c, int N, int F)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d F=%d", N, F);
    if (!NEED(c, swiglu_backward, shape))
        return;
    const size_t n = (size_t)N * F;
    pair *gu = dev(c, rnd(c, 2 * n, -8, 8), 2 * n * 4), *dh = dev(c, rnd(c, n, -1, 1), n * 4);
    pair *dgu = dev(c, rnd(c, 2 * n, -1, 1), 2 * n * 4);
    if (!c->oom)
        BOTH(c, be->swiglu_backward(be, D(dgu), D(dh), D(gu), N, F));
    done(c, "swiglu_backward", shape, cmp(c, dgu, 2 * n), TOL_ELEM);
}

/* dy is element-wise (1e-6); dw is a dot product per (token, choice) */
static void check_moe_combine_backward(selftest *c, int N, int k, int C)
{
    char shape[80];
    snprintf(shape, sizeof shape, "N=%d k=%d C=%d", N, k, C);
    if (!NEED(c, moe_combine_backward, shape))
        return;
    const size_t nk = (size_t)N * k;
    pair *dy = dev(c, rnd(c, nk * C, -1, 1), nk * C * 4), *dw = dev(c, rnd(c, nk, -1, 1), nk * 4);
    pair *dx = dev(c, rnd(c, (size_t)N * C, -1, 1), (size_t)N * C * 4);
    pair *y = dev(c, rnd(c, nk * C, -1, 1), nk * C * 4);
    pair *slot = dev(c, perm(c, (int)nk), nk * 4), *w = dev(c, rnd(c, nk, 0, 1), nk * 4);
    if (!c->oom)
        BOTH(c, be->moe_combine_backward(be, D(dy), D(dw), D(dx), D(y), D(slot), D(w), N, k, C));
    const double edy = cmp(c, dy, nk * C), edw = cmp(c, dw, nk);
    char dy_shape[96];
    snprintf(dy_shape, sizeof dy_shape, "%s dy", shape);
    line(c, !c->oom && edy <= TOL_ELEM, "moe_combine_backward", dy_shape, edy, TOL_ELEM, NULL);
    strcat(shape, " dw");
    done(c, "moe_combine_backward", shape, edw, TOL_RED);
}

static void check_cross_entropy(selftest *c, int N, int V)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d V=%d", N, V);
    if (!NEED(c, cross_entropy, shape))
        return;
    pair *x = dev(c, rnd(c, (size_t)N * V, -6, 6), (size_t)N * V * 4);
    pair *loss = dev(c, NULL, (size_t)N * 4), *tgt = dev(c, ids(c, (size_t)N, V), (size_t)N * 4);
    if (!c->oom)
        BOTH(c, be->cross_entropy(be, D(x), D(loss), D(tgt), N, V, 1.0f / (float)N));
    done(c, "cross_entropy", shape, max2(cmp(c, loss, (size_t)N), cmp(c, x, (size_t)N * V)),
         TOL_RED);
}

/* bad: 0 all finite, 1 one +inf and one -inf, 2 one NaN */
static void check_sumsq(selftest *c, size_t n, int bad)
{
    static const char *what[] = {"finite", "inf", "nan"};
    char shape[64];
    snprintf(shape, sizeof shape, "n=%zu %s", n, what[bad]);
    if (!NEED(c, sumsq, shape))
        return;
    float *h = rnd(c, n, -3, 3);
    if (h && bad == 1) {
        h[n / 3] = INFINITY;
        h[n - 1] = -INFINITY;
    } else if (h && bad == 2) {
        h[n / 2] = NAN;
    }
    pair *x = dev(c, h, n * 4);
    double e = INFINITY;
    if (!c->oom) {
        const double r = c->be[0]->sumsq(c->be[0], x->d[0], n);
        const double t = c->be[1]->sumsq(c->be[1], x->d[1], n);
        if (bad)
            e = isfinite(t) ? INFINITY : 0.0;
        else
            e = isfinite(t) ? fabs(t - r) / r : INFINITY;
    }
    done(c, "sumsq", shape, e, TOL_RED);
}

static void check_adamw(selftest *c, size_t n)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%zu t=3", n);
    if (!NEED(c, adamw, shape))
        return;
    pair *p = dev(c, rnd(c, n, -0.1, 0.1), n * 4), *g = dev(c, rnd(c, n, -1, 1), n * 4);
    pair *m = dev(c, rnd(c, n, -0.1, 0.1), n * 4), *v = dev(c, rnd(c, n, 0, 0.01), n * 4);
    const float b1 = 0.9f, b2 = 0.95f, bc1 = 1.0f - b1 * b1 * b1, bc2 = 1.0f - b2 * b2 * b2;
    if (!c->oom)
        BOTH(c,
             be->adamw(be, D(p), D(g), D(m), D(v), n, 1e-3f, b1, b2, 1e-8f, 0.1f, bc1, bc2, 0.5f));
    done(c, "adamw", shape, max2(cmp(c, p, n), max2(cmp(c, m, n), cmp(c, v, n))), TOL_ELEM);
}

static void backward_ops(selftest *c)
{
    check_embedding_backward(c, 33, 129, 10);
    check_embedding_backward(c, 1, 64, 3);
    check_rmsnorm_backward(c, 1, 4096);
    check_rmsnorm_backward(c, 17, 127);
    check_rmsnorm_backward(c, 64, 1024);
    check_attention_backward(c, 2, 17, 4, 1, 64);
    check_attention_backward(c, 1, 33, 4, 4, 128);
    check_attention_backward(c, 3, 1, 2, 2, 16);
    check_attention_backward(c, 1, 65, 2, 1, 64);
    check_swiglu_backward(c, 17, 343);
    check_swiglu_backward(c, 1, 1);
    check_moe_combine_backward(c, 17, 2, 129);
    check_moe_combine_backward(c, 1, 1, 64);
    check_cross_entropy(c, 5, 50000);
    check_cross_entropy(c, 17, 512);
    check_cross_entropy(c, 1, 7);
    check_sumsq(c, 1000003, 0);
    check_sumsq(c, 1, 0);
    check_sumsq(c, 4099, 1);
    check_sumsq(c, 4099, 2);
    check_adamw(c, 100003);
    check_adamw(c, 1);
}

/* ---------------------------------------------------------------- model */

/* A small model made here: d 128, 2 layers, 4 heads of 32 over 2 kv
 * heads, 8 experts of 256, top-2, vocabulary 512. The prefill is MB
 * sequences of MT positions; the decode prompt is one sequence of MT. */
#define MB 2
#define MT 17
#define DECODE 32

typedef struct model_side {
    nl_model *m;
    nl_runstate *rs;
    nl_kvcache *kv;
    nl_layer_acts acts; /* the inference set, for the layer-by-layer prefill */
    int32_t *tok_d, *pos_d;
} model_side;

static void model_config(nl_config *cfg)
{
    nl_config_init(cfg);
    cfg->hidden_dim = 128;
    cfg->num_layers = 2;
    cfg->num_heads = 4;
    cfg->num_kv_heads = 2;
    cfg->ffn_dim = 256;
    cfg->num_experts = 8;
    cfg->top_k = 2;
    cfg->vocab_size = 512;
    cfg->vocab_chunk = 512;
    cfg->max_seq_len = 128;
    nl_config_fill_derived(cfg);
}

static nl_status side_new(model_side *ms, nl_backend *be, const nl_config *cfg, uint64_t seed,
                          nl_error *err)
{
    const int N = MB * MT;
    nl_status st;
    memset(ms, 0, sizeof *ms);
    if ((st = nl_config_validate(cfg, 1, err)) != NL_OK ||
        (st = nl_model_new(&ms->m, be, cfg, 0, cfg->num_layers, 1, 1, err)) != NL_OK ||
        (st = nl_model_init_random(ms->m, seed, err)) != NL_OK ||
        (st = nl_runstate_new(&ms->rs, ms->m, N, err)) != NL_OK ||
        (st = nl_kvcache_new(&ms->kv, ms->m, 1, MT + DECODE, err)) != NL_OK ||
        (st = nl_layer_acts_alloc(&ms->acts, be, cfg, N, 0, err)) != NL_OK)
        return st;
    ms->tok_d = be->alloc(be, (size_t)N * sizeof(int32_t));
    ms->pos_d = be->alloc(be, (size_t)N * sizeof(int32_t));
    if (!ms->tok_d || !ms->pos_d)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory for the model's inputs",
                            be->name);
    return NL_OK;
}

static void side_free(model_side *ms, nl_backend *be)
{
    nl_layer_acts_free(&ms->acts, be);
    be->free(be, ms->tok_d);
    be->free(be, ms->pos_d);
    nl_kvcache_destroy(&ms->kv);
    nl_runstate_destroy(&ms->rs);
    nl_model_destroy(&ms->m);
}

/* The prefill layer by layer, as nl_forward runs it, keeping each layer's
 * router probabilities (L, N, E) and expert choices (L, N, k) on the host:
 * nl_forward itself does not show them. */
static void prefill_layers(model_side *ms, const int32_t *tok, const int32_t *pos, float *probs,
                           int32_t *choice)
{
    nl_model *m = ms->m;
    nl_backend *be = m->be;
    const nl_config *cfg = &m->cfg;
    const int N = MB * MT, E = cfg->num_experts, k = cfg->top_k;
    be->upload(be, ms->tok_d, tok, (size_t)N * sizeof(int32_t));
    be->upload(be, ms->pos_d, pos, (size_t)N * sizeof(int32_t));
    be->embedding_forward(be, ms->acts.x_in, ms->tok_d, m->tok_embeddings, N, cfg->hidden_dim);
    for (int l = 0; l < cfg->num_layers; l++) {
        nl_layer_forward(m, l, &ms->acts, MB, MT, 0, NULL, ms->pos_d, NULL, (double)N);
        memcpy(probs + (size_t)l * N * E, ms->acts.probs_h, (size_t)N * E * sizeof(float));
        memcpy(choice + (size_t)l * N * k, ms->acts.choice, (size_t)N * k * sizeof(int32_t));
    }
}

/* Gap between the k-th and (k+1)-th largest of row[0..E). */
static double topk_gap(const float *row, int E, int k)
{
    float v[NL_CONFIG_MAX_EXPERTS];
    memcpy(v, row, (size_t)E * sizeof *v);
    for (int i = 0; i <= k && i < E; i++)
        for (int j = i + 1; j < E; j++)
            if (v[j] > v[i]) {
                float t = v[i];
                v[i] = v[j];
                v[j] = t;
            }
    return k < E ? (double)v[k - 1] - (double)v[k] : INFINITY;
}

/* Expert choices first: the same set of experts for every (layer, token),
 * except where the reference's k-th and (k+1)-th probabilities are a
 * near-tie (reported, not failed); then the router probabilities. */
static void check_routing(selftest *c, model_side ms[2], const int32_t *tok, const int32_t *pos,
                          double tie)
{
    const nl_config *cfg = &ms[0].m->cfg;
    const int N = MB * MT, L = cfg->num_layers, E = cfg->num_experts, k = cfg->top_k;
    float *probs[2];
    int32_t *ch[2];
    for (int s = 0; s < 2; s++) {
        probs[s] = hbuf(c, (size_t)L * N * E * sizeof(float));
        ch[s] = hbuf(c, (size_t)L * N * k * sizeof(int32_t));
    }
    char shape[80];
    snprintf(shape, sizeof shape, "L=%d N=%d E=%d k=%d", L, N, E, k);
    if (c->oom) {
        done(c, "model_routing", shape, INFINITY, 0);
        return;
    }
    for (int s = 0; s < 2; s++)
        prefill_layers(&ms[s], tok, pos, probs[s], ch[s]);
    int differ = 0, ties = 0;
    for (int l = 0; l < L; l++)
        for (int n = 0; n < N; n++) {
            const size_t o = ((size_t)l * N + n) * k;
            int same = 1;
            for (int i = 0; i < k; i++) {
                int found = 0;
                for (int j = 0; j < k; j++)
                    found |= ch[1][o + i] == ch[0][o + j];
                same &= found;
            }
            const double gap = topk_gap(probs[0] + ((size_t)l * N + n) * E, E, k);
            if (gap < tie) {
                ties++;
                printf("note  model_routing  layer %d token %d: top-%d probabilities %.3g apart "
                       "(near-tie)%s\n",
                       l, n, k, gap, same ? "" : ", the backends chose differently");
            } else if (!same) {
                differ++;
                printf("note  model_routing  layer %d token %d: experts differ (gap %.3g)\n", l, n,
                       gap);
            }
        }
    char tshape[112];
    snprintf(tshape, sizeof tshape, "%s near-ties=%d", shape, ties);
    line(c, differ == 0, "model_routing", tshape, differ, 0, NULL);
    done(c, "model_router_probs", shape, err_all(probs[0], probs[1], (size_t)L * N * E), TOL_RED);
}

/* nl_forward of the whole prefill on both: logits and the aux loss. */
static void check_logits(selftest *c, model_side ms[2], const int32_t *tok, double tol)
{
    const int N = MB * MT, V = (int)ms[0].m->cfg.vocab_size;
    float aux[2], *lg[2];
    nl_error e = {0};
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d T=%d V=%d", MB, MT, V);
    for (int s = 0; s < 2; s++) {
        nl_forward_args a = {.B = MB, .T = MT, .tokens = tok};
        nl_backend *be = c->be[s];
        if (nl_forward(ms[s].m, ms[s].rs, &a, &aux[s], &e) != NL_OK ||
            !(lg[s] = hbuf(c, (size_t)N * V * sizeof(float)))) {
            line(c, 0, "model_logits", shape, INFINITY, tol, e.msg);
            release(c);
            return;
        }
        be->download(be, lg[s], nl_runstate_output(ms[s].rs, NULL), (size_t)N * V * sizeof(float));
    }
    line(c, err_all(lg[0], lg[1], (size_t)N * V) <= tol, "model_logits", shape,
         err_all(lg[0], lg[1], (size_t)N * V), tol, NULL);
    done(c, "model_aux_loss", shape, fabs((double)aux[1] - aux[0]) / fabs((double)aux[0]), TOL_RED);
}

static int argmax(const float *x, int n, double *gap)
{
    int best = 0, second = -1;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) {
            second = best;
            best = i;
        } else if (second < 0 || x[i] > x[second]) {
            second = i;
        }
    *gap = second < 0 ? INFINITY : (double)x[best] - (double)x[second];
    return best;
}

/* Prefill a prompt with the cache, then DECODE greedy steps; both sides
 * are fed the reference's choice so the logits stay comparable. */
static void check_decode(selftest *c, model_side ms[2], const int32_t *prompt, double tol,
                         double tie)
{
    const int V = (int)ms[0].m->cfg.vocab_size;
    float *lg[2] = {hbuf(c, (size_t)V * sizeof(float)), hbuf(c, (size_t)V * sizeof(float))};
    nl_error e = {0};
    char shape[64];
    snprintf(shape, sizeof shape, "prompt=%d steps=%d V=%d", MT, DECODE, V);
    int32_t next = 0;
    int differ = 0;
    double worst = c->oom ? INFINITY : 0.0;
    for (int step = 0; !c->oom && step <= DECODE; step++) {
        int id[2];
        double gap = 0.0;
        for (int s = 0; s < 2; s++) {
            nl_forward_args a = {.B = 1,
                                 .T = step ? 1 : MT,
                                 .tokens = step ? &next : prompt,
                                 .kv = ms[s].kv,
                                 .last_only = 1};
            nl_backend *be = c->be[s];
            if (nl_forward(ms[s].m, ms[s].rs, &a, NULL, &e) != NL_OK) {
                line(c, 0, "model_decode_logits", shape, INFINITY, tol, e.msg);
                release(c);
                return;
            }
            be->download(be, lg[s], nl_runstate_output(ms[s].rs, NULL), (size_t)V * sizeof(float));
            double g;
            id[s] = argmax(lg[s], V, &g);
            if (s == 0)
                gap = g;
        }
        worst = max2(worst, err_all(lg[0], lg[1], (size_t)V));
        const double scale = fabs(lg[0][id[0]]) > 1e-30 ? fabs(lg[0][id[0]]) : 1.0;
        if (gap < tie * scale)
            printf("note  model_greedy_ids  step %d: top-2 logits %.3g apart (near-tie)%s\n", step,
                   gap, id[0] == id[1] ? "" : ", the backends chose differently");
        else if (id[0] != id[1])
            differ++;
        next = id[0];
    }
    line(c, worst <= tol, "model_decode_logits", shape, worst, tol, NULL);
    done(c, "model_greedy_ids", shape, differ, 0);
}

static void model_checks(selftest *c, uint64_t seed)
{
    nl_config cfg;
    model_config(&cfg);
    model_side ms[2];
    nl_error e = {0};
    const double tol = c->tf32 ? 1e-2 : 1e-5, tie = c->tf32 ? 1e-3 : NEAR_TIE;
    int ok = 1;
    for (int s = 0; s < 2 && ok; s++)
        ok = side_new(&ms[s], c->be[s], &cfg, seed, &e) == NL_OK;
    if (!ok) {
        line(c, 0, "model_setup", "d=128 L=2 H=4 G=2 E=8 k=2 V=512", INFINITY, 0, e.msg);
    } else {
        const int N = MB * MT;
        int32_t *tok = ids(c, (size_t)N, (int)cfg.vocab_size), *pos = hbuf(c, N * sizeof *pos);
        for (int n = 0; pos && n < N; n++)
            pos[n] = n % MT;
        if (tok && pos)
            check_routing(c, ms, tok, pos, tie);
        tok = ids(c, (size_t)N, (int)cfg.vocab_size);
        if (tok)
            check_logits(c, ms, tok, tol);
        tok = ids(c, MT, (int)cfg.vocab_size);
        if (tok)
            check_decode(c, ms, tok, tol, tie);
    }
    release(c);
    for (int s = 0; s < 2; s++)
        side_free(&ms[s], c->be[s]);
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
        {0}};
    const char *usage =
        "neuroctl selftest --device D [--ref cpu] [--threads N] [--seed S] [--tf32]";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc == 1)
        printf("\nEvery slot of D against the reference on random inputs, then a small model's\n"
               "prefill, logits and %d greedy decode steps. One line per check, then\n"
               "'selftest: N passed, N failed'. Exit status: 0 all passed, 1 a check failed,\n"
               "2 usage error, 3 a backend could not be created (e.g. no CUDA device).\n",
               DECODE);
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
    selftest c = {.tf32 = nl_args_get(flags, "tf32") != NULL};
    nl_rng_seed(&c.rng, (uint64_t)seed, 0);
    if (nl_backend_new(&c.be[0], ref, &(nl_backend_opts){.threads = (int)threads}, &err) != NL_OK ||
        nl_backend_new(&c.be[1], device,
                       &(nl_backend_opts){.threads = (int)threads, .tf32 = c.tf32},
                       &err) != NL_OK) {
        fprintf(stderr, "neuroctl selftest: %s (%s)\n", err.msg, nl_status_str(err.status));
        nl_backend_destroy(&c.be[0]);
        return 3;
    }
    printf("selftest: %s against %s, seed %lld%s\n", c.be[1]->name, c.be[0]->name, seed,
           c.tf32 ? ", TF32" : "");
    forward_ops(&c);
    if (c.be[1]->can_train)
        backward_ops(&c);
    else
        printf("skip  backward and optimizer slots: %s cannot train\n", c.be[1]->name);
    model_checks(&c, (uint64_t)seed);
    printf("selftest: %d passed, %d failed\n", c.passed, c.failed);
    nl_backend_destroy(&c.be[1]);
    nl_backend_destroy(&c.be[0]);
    return c.failed ? 1 : 0;
}
