/* The CPU backend's backward and optimizer ops against references written
 * here in double precision: analytic naive backwards (tolerance 1e-5) and
 * central differences of naive double forwards (tolerance 1e-4). Sizes are
 * chosen so that both the serial and the OpenMP paths run. */
#include "kernels/backend.h"
#include "tests/check.h"

#include <stdint.h>
#include <time.h>

#define TOL_ANALYTIC 1e-5
#define TOL_FD 1e-4
#define FD_H 1e-4

static uint64_t rng_state = 12345;
static float frand(void) /* uniform in [-1, 1) */
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) & 0xFFFFFF) / (float)0x1000000 * 2.0f - 1.0f;
}
static int irand(int n)
{
    return (int)((frand() + 1.0f) * 0.5f * (float)n) % n;
}
static void fill(float *x, size_t n, float amp)
{
    for (size_t i = 0; i < n; i++)
        x[i] = amp * frand();
}
static void fill_nan(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = NAN;
}
static void to_double(double *d, const float *f, size_t n)
{
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
}

/* Relative norm-wise error of a float result against a double reference.
 * The norm is floored at 1e-3 so that a gradient that is zero in exact
 * arithmetic (attention with T = 1 has dq = dk = 0) is held to an absolute
 * bound instead of dividing rounding noise by zero. */
static double rel_err_d(const float *a, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    if (num != num)
        return INFINITY;
    return sqrt(num) / (den > 1e-6 ? sqrt(den) : 1e-3);
}

/* ================================================================ attention */

/* Where q/k/v (and dq/dk/dv) live: separate padded buffers, or one
 * interleaved qkv row per token as the model's fused projection makes. */
typedef struct attn_case {
    nl_attn_shape s;
    int interleaved;
    int qs, ks;              /* row strides */
    size_t qoff, koff, voff; /* column offsets into their buffers */
} attn_case;

static attn_case attn_case_make(int B, int T, int H, int G, int hd, int interleaved)
{
    attn_case c = {.s = {.B = B, .T = T, .past = 0, .kv_cap = T, .H = H, .G = G, .hd = hd},
                   .interleaved = interleaved};
    if (interleaved) {
        c.qs = c.ks = (H + 2 * G) * hd;
        c.koff = (size_t)H * hd;
        c.voff = (size_t)(H + G) * hd;
    } else { /* padded rows: the kernel must leave the padding alone */
        c.qs = H * hd + 3;
        c.ks = G * hd + 5;
    }
    return c;
}

/* Naive double forward of one (b, h, t): the scores' probabilities into p
 * (t + 1 of them) and the output row into o. Arrays are compact: q (B,T,H,hd),
 * k and v (B,T,G,hd). */
static void ref_attn_row(double *p, double *o, const double *q, const double *k, const double *v,
                         const nl_attn_shape *s, int b, int h, int t)
{
    const int hd = s->hd, g = h / (s->H / s->G);
    const double *qr = q + (((size_t)b * s->T + t) * s->H + h) * hd;
    double m = -INFINITY, l = 0;
    for (int j = 0; j <= t; j++) {
        const double *kr = k + (((size_t)b * s->T + j) * s->G + g) * hd;
        double d = 0;
        for (int c = 0; c < hd; c++)
            d += qr[c] * kr[c];
        p[j] = d / sqrt((double)hd);
        m = p[j] > m ? p[j] : m;
    }
    for (int j = 0; j <= t; j++)
        l += exp(p[j] - m);
    for (int j = 0; j <= t; j++)
        p[j] = exp(p[j] - m) / l;
    for (int c = 0; c < hd; c++) {
        double a = 0;
        for (int j = 0; j <= t; j++)
            a += p[j] * v[(((size_t)b * s->T + j) * s->G + g) * hd + c];
        o[c] = a;
    }
}

/* L = sum(dout * attention(q, k, v)), all in double. */
static double ref_attn_loss(const double *q, const double *k, const double *v, const double *dout,
                            const nl_attn_shape *s, double *p, double *o)
{
    double L = 0;
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < s->H; h++)
            for (int t = 0; t < s->T; t++) {
                ref_attn_row(p, o, q, k, v, s, b, h, t);
                const double *d = dout + (((size_t)b * s->T + t) * s->H + h) * s->hd;
                for (int c = 0; c < s->hd; c++)
                    L += d[c] * o[c];
            }
    return L;
}

/* Analytic naive backward in double: dq, dk, dv compact, overwritten. */
static void ref_attn_backward(double *dq, double *dk, double *dv, const double *q, const double *k,
                              const double *v, const double *dout, const nl_attn_shape *s,
                              double *p, double *o)
{
    const int hd = s->hd;
    const double scale = 1.0 / sqrt((double)hd);
    memset(dq, 0, (size_t)s->B * s->T * s->H * hd * sizeof(double));
    memset(dk, 0, (size_t)s->B * s->T * s->G * hd * sizeof(double));
    memset(dv, 0, (size_t)s->B * s->T * s->G * hd * sizeof(double));
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < s->H; h++)
            for (int t = 0; t < s->T; t++) {
                const int g = h / (s->H / s->G);
                const size_t qi = (((size_t)b * s->T + t) * s->H + h) * hd;
                ref_attn_row(p, o, q, k, v, s, b, h, t);
                double D = 0;
                for (int c = 0; c < hd; c++)
                    D += dout[qi + c] * o[c];
                for (int j = 0; j <= t; j++) {
                    const size_t kj = (((size_t)b * s->T + j) * s->G + g) * hd;
                    double dp = 0;
                    for (int c = 0; c < hd; c++) {
                        dv[kj + c] += p[j] * dout[qi + c];
                        dp += dout[qi + c] * v[kj + c];
                    }
                    const double ds = p[j] * (dp - D);
                    for (int c = 0; c < hd; c++) {
                        dq[qi + c] += scale * ds * k[kj + c];
                        dk[kj + c] += scale * ds * q[qi + c];
                    }
                }
            }
}

/* Buffers of one attention case: the kernel's strided ones and compact
 * double copies. */
typedef struct attn_bufs {
    float *qb, *kb, *vb, *dqb, *dkb, *dvb; /* strided; kb/vb alias qb when interleaved */
    float *out, *lse, *dout;
    double *q, *k, *v, *dq, *dk, *dv, *doutd, *p, *o;
    size_t nq, nk, nrows;
} attn_bufs;

static void attn_bufs_free(attn_bufs *a)
{
    free(a->qb);
    free(a->dqb);
    if (a->kb != a->qb) {
        free(a->kb);
        free(a->vb);
        free(a->dkb);
        free(a->dvb);
    }
    free(a->out), free(a->lse), free(a->dout);
    free(a->q), free(a->k), free(a->v), free(a->dq), free(a->dk), free(a->dv);
    free(a->doutd), free(a->p), free(a->o);
}

/* Element c of query head h of row r (r = b*T + t) in the strided buffers. */
static size_t q_at(const attn_case *ac, size_t r, int h, int c)
{
    return r * ac->qs + ac->qoff + (size_t)h * ac->s.hd + c;
}
static size_t kv_at(const attn_case *ac, size_t r, int g, int c, size_t off)
{
    return r * ac->ks + off + (size_t)g * ac->s.hd + c;
}

/* Make random inputs, run forward and backward on the backend. */
static void attn_run(nl_backend *be, const attn_case *ac, attn_bufs *a)
{
    const nl_attn_shape *s = &ac->s;
    const int hd = s->hd;
    a->nrows = (size_t)s->B * s->T;
    a->nq = a->nrows * s->H * hd;
    a->nk = a->nrows * s->G * hd;
    const size_t qlen = a->nrows * ac->qs, klen = a->nrows * ac->ks;
    a->qb = malloc(qlen * 4);
    a->dqb = malloc(qlen * 4);
    if (ac->interleaved) {
        a->kb = a->vb = a->qb;
        a->dkb = a->dvb = a->dqb;
    } else {
        a->kb = malloc(klen * 4), a->vb = malloc(klen * 4);
        a->dkb = malloc(klen * 4), a->dvb = malloc(klen * 4);
    }
    a->out = malloc(a->nq * 4), a->dout = malloc(a->nq * 4);
    a->lse = malloc((size_t)s->B * s->H * s->T * 4);
    a->q = malloc(a->nq * 8), a->dq = malloc(a->nq * 8), a->doutd = malloc(a->nq * 8);
    a->k = malloc(a->nk * 8), a->v = malloc(a->nk * 8);
    a->dk = malloc(a->nk * 8), a->dv = malloc(a->nk * 8);
    a->p = malloc((size_t)s->T * 8), a->o = malloc((size_t)hd * 8);

    /* NaN everywhere first: padding must stay NaN, gradients must not read it */
    fill_nan(a->qb, qlen);
    fill_nan(a->dqb, qlen);
    if (!ac->interleaved) {
        fill_nan(a->kb, klen), fill_nan(a->vb, klen);
        fill_nan(a->dkb, klen), fill_nan(a->dvb, klen);
    }
    for (size_t r = 0; r < a->nrows; r++) {
        for (int h = 0; h < s->H; h++)
            for (int c = 0; c < hd; c++) {
                a->qb[q_at(ac, r, h, c)] = 1.5f * frand();
                a->q[(r * s->H + h) * hd + c] = a->qb[q_at(ac, r, h, c)];
            }
        for (int g = 0; g < s->G; g++)
            for (int c = 0; c < hd; c++) {
                a->kb[kv_at(ac, r, g, c, ac->koff)] = 1.5f * frand();
                a->vb[kv_at(ac, r, g, c, ac->voff)] = frand();
                a->k[(r * s->G + g) * hd + c] = a->kb[kv_at(ac, r, g, c, ac->koff)];
                a->v[(r * s->G + g) * hd + c] = a->vb[kv_at(ac, r, g, c, ac->voff)];
            }
    }
    fill(a->dout, a->nq, 1.0f);
    to_double(a->doutd, a->dout, a->nq);
    const float *q = a->qb + ac->qoff, *k = a->kb + ac->koff, *v = a->vb + ac->voff;
    be->attention_forward(be, a->out, a->lse, q, ac->qs, k, v, ac->ks, *s);
    be->attention_backward(be, a->dqb + ac->qoff, a->dkb + ac->koff, a->dvb + ac->voff, a->dout, q,
                           ac->qs, k, v, ac->ks, a->out, a->lse, *s);
}

/* The kernel's gradients in compact layout; also checks that the padding
 * columns of separate buffers are untouched. */
static void attn_compact(const attn_case *ac, const attn_bufs *a, float *dq, float *dk, float *dv)
{
    const nl_attn_shape *s = &ac->s;
    for (size_t r = 0; r < a->nrows; r++) {
        for (int h = 0; h < s->H; h++)
            for (int c = 0; c < s->hd; c++)
                dq[(r * s->H + h) * s->hd + c] = a->dqb[q_at(ac, r, h, c)];
        for (int g = 0; g < s->G; g++)
            for (int c = 0; c < s->hd; c++) {
                dk[(r * s->G + g) * s->hd + c] = a->dkb[kv_at(ac, r, g, c, ac->koff)];
                dv[(r * s->G + g) * s->hd + c] = a->dvb[kv_at(ac, r, g, c, ac->voff)];
            }
    }
    if (ac->interleaved)
        return;
    int bad = 0;
    for (size_t r = 0; r < a->nrows; r++) {
        for (int c = s->H * s->hd; c < ac->qs; c++)
            bad += !isnan(a->dqb[r * ac->qs + c]);
        for (int c = s->G * s->hd; c < ac->ks; c++)
            bad += !isnan(a->dkb[r * ac->ks + c]) + !isnan(a->dvb[r * ac->ks + c]);
    }
    CHECK(bad == 0, "attention backward wrote %d padding floats", bad);
}

static void test_attention_analytic(nl_backend *be, int B, int T, int H, int G, int hd, int il)
{
    attn_case ac = attn_case_make(B, T, H, G, hd, il);
    attn_bufs a = {0};
    attn_run(be, &ac, &a);
    ref_attn_backward(a.dq, a.dk, a.dv, a.q, a.k, a.v, a.doutd, &ac.s, a.p, a.o);
    float *dq = malloc(a.nq * 4), *dk = malloc(a.nk * 4), *dv = malloc(a.nk * 4);
    attn_compact(&ac, &a, dq, dk, dv);
    double eq = rel_err_d(dq, a.dq, a.nq), ek = rel_err_d(dk, a.dk, a.nk),
           ev = rel_err_d(dv, a.dv, a.nk);
    CHECK(eq <= TOL_ANALYTIC && ek <= TOL_ANALYTIC && ev <= TOL_ANALYTIC,
          "attention B=%d T=%d H=%d G=%d hd=%d interleaved=%d: dq %.2e dk %.2e dv %.2e", B, T, H, G,
          hd, il, eq, ek, ev);
    printf("attention analytic B=%d T=%d H=%d G=%d hd=%d il=%d: dq %.2e dk %.2e dv %.2e\n", B, T, H,
           G, hd, il, eq, ek, ev);
    free(dq), free(dk), free(dv);
    attn_bufs_free(&a);
}

/* Central difference of L over element i of x. */
static double fd_attn(double *x, size_t i, const attn_bufs *a, const nl_attn_shape *s)
{
    const double x0 = x[i];
    x[i] = x0 + FD_H;
    double lp = ref_attn_loss(a->q, a->k, a->v, a->doutd, s, a->p, a->o);
    x[i] = x0 - FD_H;
    double lm = ref_attn_loss(a->q, a->k, a->v, a->doutd, s, a->p, a->o);
    x[i] = x0;
    return (lp - lm) / (2 * FD_H);
}

static void test_attention_fd(nl_backend *be, int B, int T, int H, int G, int hd, int il)
{
    attn_case ac = attn_case_make(B, T, H, G, hd, il);
    attn_bufs a = {0};
    attn_run(be, &ac, &a);
    for (size_t i = 0; i < a.nq; i++)
        a.dq[i] = fd_attn(a.q, i, &a, &ac.s);
    for (size_t i = 0; i < a.nk; i++) {
        a.dk[i] = fd_attn(a.k, i, &a, &ac.s);
        a.dv[i] = fd_attn(a.v, i, &a, &ac.s);
    }
    float *dq = malloc(a.nq * 4), *dk = malloc(a.nk * 4), *dv = malloc(a.nk * 4);
    attn_compact(&ac, &a, dq, dk, dv);
    double eq = rel_err_d(dq, a.dq, a.nq), ek = rel_err_d(dk, a.dk, a.nk),
           ev = rel_err_d(dv, a.dv, a.nk);
    CHECK(eq <= TOL_FD && ek <= TOL_FD && ev <= TOL_FD,
          "attention fd B=%d T=%d H=%d G=%d hd=%d: dq %.2e dk %.2e dv %.2e", B, T, H, G, hd, eq, ek,
          ev);
    printf("attention finite-diff B=%d T=%d H=%d G=%d hd=%d il=%d: dq %.2e dk %.2e dv %.2e\n", B, T,
           H, G, hd, il, eq, ek, ev);
    free(dq), free(dk), free(dv);
    attn_bufs_free(&a);
}

/* ================================================================ rmsnorm */

/* L = sum(dout * rmsnorm(x, w)) in double */
static double ref_rmsnorm_loss(const double *x, const double *w, const double *dout, int N, int C,
                               double eps)
{
    double L = 0;
    for (int n = 0; n < N; n++) {
        const double *r = x + (size_t)n * C;
        double ss = 0;
        for (int c = 0; c < C; c++)
            ss += r[c] * r[c];
        const double rs = 1.0 / sqrt(ss / C + eps);
        for (int c = 0; c < C; c++)
            L += dout[(size_t)n * C + c] * r[c] * rs * w[c];
    }
    return L;
}

/* The analytic reference (formula of backend.h, in double, with the accumulators' initial
 * values) and, for small sizes, central differences of the forward. */
static void test_rmsnorm(nl_backend *be, int N, int C, int fd)
{
    const float eps = 1e-5f;
    size_t n = (size_t)N * C;
    float *x = malloc(n * 4), *w = malloc(C * 4), *g = malloc(n * 4), *y = malloc(n * 4);
    float *rstd = malloc(N * 4), *dx = malloc(n * 4), *dw = malloc(C * 4);
    double *xd = malloc(n * 8), *wd = malloc(C * 8), *gd = malloc(n * 8);
    double *rdx = malloc(n * 8), *rdw = malloc(C * 8);
    fill(x, n, 2.0f), fill(w, C, 1.5f), fill(g, n, 1.0f);
    fill(dx, n, fd ? 0.0f : 1.0f), fill(dw, C, fd ? 0.0f : 1.0f);
    to_double(xd, x, n), to_double(wd, w, C), to_double(gd, g, n);
    be->rmsnorm_forward(be, y, rstd, x, w, N, C, eps);
    if (fd) {
        for (size_t i = 0; i < n; i++) {
            const double x0 = xd[i];
            xd[i] = x0 + FD_H;
            double lp = ref_rmsnorm_loss(xd, wd, gd, N, C, eps);
            xd[i] = x0 - FD_H;
            double lm = ref_rmsnorm_loss(xd, wd, gd, N, C, eps);
            xd[i] = x0;
            rdx[i] = (lp - lm) / (2 * FD_H);
        }
        for (int c = 0; c < C; c++) {
            const double w0 = wd[c];
            wd[c] = w0 + FD_H;
            double lp = ref_rmsnorm_loss(xd, wd, gd, N, C, eps);
            wd[c] = w0 - FD_H;
            double lm = ref_rmsnorm_loss(xd, wd, gd, N, C, eps);
            wd[c] = w0;
            rdw[c] = (lp - lm) / (2 * FD_H);
        }
    } else {
        to_double(rdx, dx, n), to_double(rdw, dw, C);
        for (int r = 0; r < N; r++) {
            const double *xr = xd + (size_t)r * C, *gr = gd + (size_t)r * C;
            double ss = 0, dot = 0;
            for (int c = 0; c < C; c++) {
                ss += xr[c] * xr[c];
                dot += wd[c] * gr[c] * xr[c];
            }
            const double rs = 1.0 / sqrt(ss / C + eps);
            for (int c = 0; c < C; c++) {
                rdx[(size_t)r * C + c] += wd[c] * gr[c] * rs - xr[c] * rs * rs * rs / C * dot;
                rdw[c] += gr[c] * xr[c] * rs;
            }
        }
    }
    be->rmsnorm_backward(be, dx, dw, g, x, w, rstd, N, C);
    double ex = rel_err_d(dx, rdx, n), ew = rel_err_d(dw, rdw, C);
    double tol = fd ? TOL_FD : TOL_ANALYTIC;
    CHECK(ex <= tol && ew <= tol, "rmsnorm N=%d C=%d fd=%d: dinp %.2e dw %.2e", N, C, fd, ex, ew);
    printf("rmsnorm %s N=%d C=%d: dinp %.2e dw %.2e\n", fd ? "finite-diff" : "analytic", N, C, ex,
           ew);
    free(x), free(w), free(g), free(y), free(rstd), free(dx), free(dw);
    free(xd), free(wd), free(gd), free(rdx), free(rdw);
}

/* ================================================================ swiglu */

static double silu_d(double g)
{
    return g / (1.0 + exp(-g));
}

static void test_swiglu(nl_backend *be, int N, int F, int fd)
{
    size_t n = (size_t)N * F;
    float *gu = malloc(2 * n * 4), *dh = malloc(n * 4), *dgu = malloc(2 * n * 4);
    double *ref = malloc(2 * n * 8);
    fill(gu, 2 * n, 6.0f), fill(dh, n, 1.0f);
    if (!fd) { /* saturated gates both ways */
        gu[0] = 40.0f, gu[1] = -40.0f, gu[2] = 90.0f, gu[3] = -90.0f;
    }
    fill_nan(dgu, 2 * n); /* overwritten, never read */
    for (int r = 0; r < N; r++)
        for (int j = 0; j < F; j++) {
            const size_t gi = (size_t)r * 2 * F + j, ui = gi + F;
            const double g = gu[gi], u = gu[ui], d = dh[(size_t)r * F + j];
            if (fd) { /* d/dg and d/du of d * silu(g) * u */
                ref[gi] = d * u * (silu_d(g + FD_H) - silu_d(g - FD_H)) / (2 * FD_H);
                ref[ui] = d * silu_d(g) * ((u + FD_H) - (u - FD_H)) / (2 * FD_H);
            } else {
                const double sg = 1.0 / (1.0 + exp(-g));
                ref[gi] = d * u * sg * (1 + g * (1 - sg));
                ref[ui] = d * g * sg;
            }
        }
    be->swiglu_backward(be, dgu, dh, gu, N, F);
    double e = rel_err_d(dgu, ref, 2 * n);
    CHECK(e <= (fd ? TOL_FD : TOL_ANALYTIC), "swiglu N=%d F=%d fd=%d: %.2e", N, F, fd, e);
    printf("swiglu %s N=%d F=%d: dgu %.2e\n", fd ? "finite-diff" : "analytic", N, F, e);
    free(gu), free(dh), free(dgu), free(ref);
}

/* ================================================================ moe combine */

static void test_moe_combine(nl_backend *be, int N, int k, int C)
{
    const size_t ns = (size_t)N * k;
    float *y = malloc(ns * C * 4), *dy = malloc(ns * C * 4), *dx = malloc((size_t)N * C * 4);
    float *w = malloc(ns * 4), *dw = malloc(ns * 4);
    int32_t *slot = malloc(ns * 4);
    double *rdy = malloc(ns * C * 8), *rdw = malloc(ns * 8);
    fill(y, ns * C, 1.0f), fill(dx, (size_t)N * C, 1.0f), fill(w, ns, 1.0f);
    fill_nan(dy, ns * C), fill_nan(dw, ns);
    for (size_t i = 0; i < ns; i++) /* random permutation (Fisher-Yates) */
        slot[i] = (int32_t)i;
    for (size_t i = ns - 1; i > 0; i--) {
        size_t j = (size_t)irand((int)i + 1);
        int32_t t = slot[i];
        slot[i] = slot[j], slot[j] = t;
    }
    for (int n = 0; n < N; n++)
        for (int i = 0; i < k; i++) {
            const size_t e = (size_t)n * k + i, s = (size_t)slot[e];
            double dot = 0;
            for (int c = 0; c < C; c++) {
                rdy[s * C + c] = (double)w[e] * dx[(size_t)n * C + c];
                dot += (double)dx[(size_t)n * C + c] * y[s * C + c];
            }
            rdw[e] = dot;
        }
    be->moe_combine_backward(be, dy, dw, dx, y, slot, w, N, k, C);
    double ey = rel_err_d(dy, rdy, ns * C), ew = rel_err_d(dw, rdw, ns);
    CHECK(ey <= TOL_ANALYTIC && ew <= TOL_ANALYTIC, "moe N=%d k=%d C=%d: dy %.2e dw %.2e", N, k, C,
          ey, ew);
    printf("moe_combine N=%d k=%d C=%d: dy %.2e dw %.2e\n", N, k, C, ey, ew);
    free(y), free(dy), free(dx), free(w), free(dw), free(slot), free(rdy), free(rdw);
}

/* ================================================================ cross-entropy */

/* scale * sum over rows of (logsumexp - target logit), in double */
static double ref_ce_loss(double *loss, const double *x, const int32_t *t, int N, int V,
                          double scale)
{
    double L = 0;
    for (int n = 0; n < N; n++) {
        const double *r = x + (size_t)n * V;
        double m = -INFINITY, s = 0;
        for (int i = 0; i < V; i++)
            m = r[i] > m ? r[i] : m;
        for (int i = 0; i < V; i++)
            s += exp(r[i] - m);
        loss[n] = m + log(s) - r[t[n]];
        L += scale * loss[n];
    }
    return L;
}

static void test_cross_entropy(nl_backend *be, int N, int V, float amp, int fd)
{
    const float scale = 0.37f;
    size_t n = (size_t)N * V;
    float *x = malloc(n * 4), *loss = malloc(N * 4);
    int32_t *t = malloc(N * 4);
    double *xd = malloc(n * 8), *rg = malloc(n * 8), *rl = malloc(N * 8), *tmp = malloc(N * 8);
    fill(x, n, amp);
    for (int r = 0; r < N; r++)
        t[r] = irand(V);
    x[0] = amp, x[1] = -amp; /* the extremes themselves */
    if (N > 1)
        x[V + t[1]] = amp; /* a row whose target is its maximum */
    to_double(xd, x, n);
    ref_ce_loss(rl, xd, t, N, V, scale);
    if (fd) {
        for (size_t i = 0; i < n; i++) {
            const double x0 = xd[i];
            xd[i] = x0 + FD_H;
            double lp = ref_ce_loss(tmp, xd, t, N, V, scale);
            xd[i] = x0 - FD_H;
            double lm = ref_ce_loss(tmp, xd, t, N, V, scale);
            xd[i] = x0;
            rg[i] = (lp - lm) / (2 * FD_H);
        }
    } else {
        for (int r = 0; r < N; r++) {
            const double lse = rl[r] + xd[(size_t)r * V + t[r]];
            for (int i = 0; i < V; i++)
                rg[(size_t)r * V + i] = scale * (exp(xd[(size_t)r * V + i] - lse) - (i == t[r]));
        }
    }
    be->cross_entropy(be, x, loss, t, N, V, scale);
    double el = rel_err_d(loss, rl, N), eg = rel_err_d(x, rg, n);
    double tol = fd ? TOL_FD : TOL_ANALYTIC;
    CHECK(el <= TOL_ANALYTIC && eg <= tol, "cross_entropy N=%d V=%d amp=%g: loss %.2e grad %.2e", N,
          V, amp, el, eg);
    printf("cross_entropy %s N=%d V=%d logits +-%g: loss %.2e grad %.2e\n",
           fd ? "finite-diff" : "analytic", N, V, amp, el, eg);
    free(x), free(loss), free(t), free(xd), free(rg), free(rl), free(tmp);
}

/* ================================================================ embedding */

static void test_embedding(nl_backend *be, int Vt, int N, int C)
{
    float *dt = malloc((size_t)Vt * C * 4), *g = malloc((size_t)N * C * 4);
    double *ref = malloc((size_t)Vt * C * 8);
    int32_t *tok = malloc(N * 4);
    fill(dt, (size_t)Vt * C, 1.0f), fill(g, (size_t)N * C, 1.0f);
    to_double(ref, dt, (size_t)Vt * C);
    for (int n = 0; n < N; n++)
        tok[n] = irand(Vt);
    tok[0] = tok[N - 1]; /* at least one repeat even for tiny N */
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            ref[(size_t)tok[n] * C + c] += g[(size_t)n * C + c];
    be->embedding_backward(be, dt, g, tok, N, C);
    double e = rel_err_d(dt, ref, (size_t)Vt * C);
    CHECK(e <= TOL_ANALYTIC, "embedding V=%d N=%d C=%d: %.2e", Vt, N, C, e);
    printf("embedding V=%d N=%d C=%d: dtable %.2e\n", Vt, N, C, e);
    free(dt), free(g), free(ref), free(tok);
}

/* ================================================================ sumsq */

static void test_sumsq(nl_backend *be, size_t n)
{
    float *x = calloc(n ? n : 1, 4);
    fill(x, n, 10.0f);
    double ref = 0;
    for (size_t i = 0; i < n; i++)
        ref += (double)x[i] * x[i];
    double got = be->sumsq(be, x, n);
    CHECK(fabs(got - ref) <= 1e-12 * (ref > 0 ? ref : 1), "sumsq n=%zu: %.17g vs %.17g", n, got,
          ref);
    if (n >= 3) {
        const float bad[] = {NAN, INFINITY, -INFINITY};
        for (int b = 0; b < 3; b++) {
            const size_t at = (size_t)(b + 1) * n / 4;
            const float keep = x[at];
            x[at] = bad[b];
            got = be->sumsq(be, x, n);
            CHECK(!isfinite(got), "sumsq n=%zu with %g at %zu gave %g", n, bad[b], at, got);
            CHECK(b == 0 || isinf(got), "sumsq n=%zu with %g gave %g, not inf", n, bad[b], got);
            x[at] = keep;
        }
        x[0] = NAN, x[n - 1] = INFINITY; /* both at once */
        got = be->sumsq(be, x, n);
        CHECK(!isfinite(got), "sumsq n=%zu with nan and inf gave %g", n, got);
    }
    free(x);
}

/* ================================================================ adamw */

static void test_adamw(nl_backend *be, size_t n)
{
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
    float *p = malloc(n * 4), *p0 = malloc(n * 4), *g = malloc(n * 4);
    float *m = calloc(n, 4), *v = calloc(n, 4), *dp = malloc(n * 4);
    double *rp = malloc(n * 8), *rm = calloc(n, 8), *rv = calloc(n, 8), *rdp = malloc(n * 8);
    fill(p, n, 1.0f);
    memcpy(p0, p, n * 4);
    to_double(rp, p, n);
    for (int step = 1; step <= 3; step++) {
        fill(g, n, 2.0f);
        g[step] = 0.0f; /* v stays tiny: eps matters there */
        const double bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
        for (size_t i = 0; i < n; i++) {
            const double gi = (double)g[i] * gs;
            rm[i] = b1 * rm[i] + (1 - (double)b1) * gi;
            rv[i] = b2 * rv[i] + (1 - (double)b2) * gi * gi;
            rp[i] -= lr * (rm[i] / bc1 / (sqrt(rv[i] / bc2) + eps) + wd * rp[i]);
        }
        be->adamw(be, p, g, m, v, n, lr, b1, b2, eps, wd, (float)bc1, (float)bc2, gs);
    }
    for (size_t i = 0; i < n; i++) { /* the update alone, so p's size hides nothing */
        dp[i] = p[i] - p0[i];
        rdp[i] = rp[i] - p0[i];
    }
    double ep = rel_err_d(p, rp, n), ed = rel_err_d(dp, rdp, n), em = rel_err_d(m, rm, n),
           ev = rel_err_d(v, rv, n);
    CHECK(ep <= TOL_ANALYTIC && ed <= TOL_ANALYTIC && em <= TOL_ANALYTIC && ev <= TOL_ANALYTIC,
          "adamw n=%zu: p %.2e delta %.2e m %.2e v %.2e", n, ep, ed, em, ev);
    printf("adamw n=%zu 3 steps: p %.2e update %.2e m %.2e v %.2e\n", n, ep, ed, em, ev);
    free(p), free(p0), free(g), free(m), free(v), free(dp);
    free(rp), free(rm), free(rv), free(rdp);
}

/* ================================================================ timing */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Opt-in (NL_BENCH_ATTN=1): best of 10 forward and backward calls on the
 * interleaved layout at B=8 T=256 H=8 G=2 hd=32. Prints only; checks
 * nothing, so it is not part of the test's verdict. */
static void bench_attention(nl_backend *be)
{
    const nl_attn_shape s = {.B = 8, .T = 256, .kv_cap = 256, .H = 8, .G = 2, .hd = 32};
    const int qs = (s.H + 2 * s.G) * s.hd;
    const size_t n = (size_t)s.B * s.T * qs, no = (size_t)s.B * s.T * s.H * s.hd;
    float *qkv = malloc(n * 4), *dqkv = malloc(n * 4), *out = malloc(no * 4);
    float *dout = malloc(no * 4), *lse = malloc((size_t)s.B * s.H * s.T * 4);
    fill(qkv, n, 1.0f), fill(dout, no, 1.0f);
    const float *k = qkv + s.H * s.hd, *v = qkv + (s.H + s.G) * s.hd;
    double fwd = 1e9, bwd = 1e9;
    for (int r = 0; r < 10; r++) {
        double t0 = now_s();
        be->attention_forward(be, out, lse, qkv, qs, k, v, qs, s);
        double t1 = now_s();
        be->attention_backward(be, dqkv, dqkv + s.H * s.hd, dqkv + (s.H + s.G) * s.hd, dout, qkv,
                               qs, k, v, qs, out, lse, s);
        double t2 = now_s();
        fwd = t1 - t0 < fwd ? t1 - t0 : fwd;
        bwd = t2 - t1 < bwd ? t2 - t1 : bwd;
    }
    printf("bench attention B=8 T=256 H=8 G=2 hd=32: forward %.1f ms, backward %.1f ms\n",
           fwd * 1e3, bwd * 1e3);
    free(qkv), free(dqkv), free(out), free(dout), free(lse);
}

/* ================================================================ main */

int main(void)
{
    nl_backend *be = NULL;
    nl_error err = {0};
    CHECK_OK(nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = 0}, &err), &err);
    if (!be)
        return check_done("test_backward_kernels");

    /* B, T, H, G, hd, interleaved */
    test_attention_analytic(be, 1, 1, 1, 1, 2, 0);
    test_attention_analytic(be, 1, 1, 6, 2, 8, 1);
    test_attention_analytic(be, 2, 100, 6, 2, 16, 0);
    test_attention_analytic(be, 2, 100, 6, 3, 8, 1);
    test_attention_analytic(be, 1, 37, 4, 4, 2, 0);
    test_attention_analytic(be, 3, 65, 2, 1, 32, 1);
    test_attention_analytic(be, 1, 20, 2, 1, 256, 0);
    test_attention_fd(be, 1, 20, 6, 2, 4, 0);
    test_attention_fd(be, 2, 9, 6, 3, 2, 1);
    test_attention_fd(be, 1, 70, 2, 1, 3, 1);

    test_rmsnorm(be, 97, 700, 0); /* both loops threaded */
    test_rmsnorm(be, 3, 70, 0);
    test_rmsnorm(be, 5, 40, 1);

    test_swiglu(be, 70, 300, 0);
    test_swiglu(be, 4, 33, 1);

    test_moe_combine(be, 70, 2, 130);
    test_moe_combine(be, 70, 3, 130);
    test_moe_combine(be, 5, 3, 7);

    test_cross_entropy(be, 70, 1000, 80.0f, 0);
    test_cross_entropy(be, 3, 7, 80.0f, 1);
    test_cross_entropy(be, 4, 50, 2.0f, 1);

    test_embedding(be, 5, 300, 250); /* threaded over column blocks */
    test_embedding(be, 3, 7, 10);

    test_sumsq(be, 100003);
    test_sumsq(be, 10);
    test_sumsq(be, 0);

    test_adamw(be, 70001);
    test_adamw(be, 7);

    const char *bench = getenv("NL_BENCH_ATTN");
    if (bench && *bench == '1')
        bench_attention(be);

    nl_backend_destroy(&be);
    return check_done("test_backward_kernels");
}
