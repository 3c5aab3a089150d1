/* The per-element formulas of kernels/elem.h (shared by the CPU and CUDA
 * backends), each against a double-precision reference over many inputs,
 * edges included. Tolerances are stated per function; FLT_EPSILON is
 * 1.19e-7, so "3e-7 relative" means about 2.5 ulp. On the CPU these run
 * with the host exp (nl_expf); the CUDA build uses the device's expf in
 * the same expressions. */
#include "kernels/elem.h"
#include "tests/check.h"

#include <float.h>
#include <stdint.h>

/* splitmix64: a fixed-seed generator, so every run sees the same inputs */
static uint64_t rng_state = 0x5eed1234abcdULL;

static double uniform(double lo, double hi)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return lo + (hi - lo) * (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

/* |got - ref| <= rel |ref| + abs, NaN never passes */
static int close_to(double got, double ref, double rel, double abs_tol)
{
    return fabs(got - ref) <= rel * fabs(ref) + abs_tol;
}

/* ---------------------------------------------------------------- exp */

/* 3e-7 relative over the whole accurate range [-87.3, 88.3]; exact at 0;
 * 0 below -87.3 and at -inf (true value < 1.2e-38); a finite value near
 * exp(88.3) above 88.3; NaN for NaN. */
static void test_exp(void)
{
    double worst = 0;
    int bad = 0;
    for (int i = 0; i < 400000; i++) {
        const float x = i < 200000 ? (float)uniform(-87.3, 88.3) : (float)uniform(-2, 2);
        const double ref = exp((double)x);
        const double e = fabs(nl_expf(x) - ref) / ref;
        worst = e > worst ? e : worst;
        bad += !(e <= 3e-7);
    }
    CHECK(bad == 0, "nl_expf: %d inputs beyond 3e-7 relative (worst %.3g)", bad, worst);
    printf("nl_expf: worst relative error %.3g over [-87.3, 88.3]\n", worst);
    CHECK(nl_expf(0.0f) == 1.0f, "exp(0) = %.9g", nl_expf(0.0f));
    CHECK(nl_expf(-0.0f) == 1.0f, "exp(-0) = %.9g", nl_expf(-0.0f));
    CHECK(nl_expf(-INFINITY) == 0.0f, "exp(-inf) = %g", nl_expf(-INFINITY));
    CHECK(nl_expf(-88.0f) == 0.0f, "exp(-88) = %g (flushed below -87.3)", nl_expf(-88.0f));
    CHECK(nl_expf(-1e30f) == 0.0f, "exp(-1e30) = %g", nl_expf(-1e30f));
    CHECK(close_to(nl_expf(-87.3f), exp((double)-87.3f), 3e-7, 0), "exp(-87.3) = %g",
          nl_expf(-87.3f));
    CHECK(close_to(nl_expf(88.3f), exp((double)88.3f), 3e-7, 0), "exp(88.3) = %g", nl_expf(88.3f));
    CHECK(isfinite(nl_expf(INFINITY)) && nl_expf(INFINITY) > 2e38f, "exp(inf) = %g",
          nl_expf(INFINITY));
    CHECK(isfinite(nl_expf(1e30f)) && nl_expf(1e30f) == nl_expf(88.3f), "exp(1e30) = %g",
          nl_expf(1e30f));
    CHECK(isnan(nl_expf(NAN)), "exp(nan) = %g", nl_expf(NAN));
    CHECK(nl_elem_expf(1.5f) == nl_expf(1.5f), "the host nl_elem_expf is nl_expf");
}

/* ---------------------------------------------------------------- SiLU, SwiGLU */

static double ref_sigmoid(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

/* sigmoid, silu: 5e-7 relative plus 1e-36 absolute (above 88.3 the host
 * exp clamps: silu(-100) is -4.5e-37 instead of -3.7e-42). silu': its value
 * is in [-0.1, 1.1] and crosses zero (x = -2.3994), and for x > 10 the
 * float 1 - sigmoid(x) keeps few bits, so 2e-6 absolute. */
static void test_silu(void)
{
    int bad_sig = 0, bad_silu = 0, bad_grad = 0;
    double wsig = 0, wsilu = 0, wgrad = 0;
    for (int i = 0; i < 200000; i++) {
        const float x = i % 3 == 0 ? (float)uniform(-100, 100) : (float)uniform(-10, 10);
        const double s = ref_sigmoid(x);
        const double sl = x * s, gr = s * (1.0 + x * (1.0 - s));
        const double es = fabs(nl_elem_sigmoid(x) - s), el = fabs(nl_elem_silu(x) - sl);
        const double eg = fabs(nl_elem_silu_grad(x) - gr);
        bad_sig += !(es <= 5e-7 * s + 1e-36);
        bad_silu += !(el <= 5e-7 * fabs(sl) + 1e-36);
        bad_grad += !(eg <= 2e-6);
        if (fabsf(x) < 80.0f) { /* the worst errors outside the clamp */
            wsig = es / s > wsig ? es / s : wsig;
            wsilu = x != 0.0f && el / fabs(sl) > wsilu ? el / fabs(sl) : wsilu;
        }
        wgrad = eg > wgrad ? eg : wgrad;
    }
    CHECK(bad_sig == 0, "sigmoid: %d beyond tolerance (worst rel %.3g)", bad_sig, wsig);
    CHECK(bad_silu == 0, "silu: %d beyond tolerance (worst rel %.3g)", bad_silu, wsilu);
    CHECK(bad_grad == 0, "silu': %d beyond 2e-6 absolute (worst %.3g)", bad_grad, wgrad);
    printf("|x| < 80: silu worst relative %.3g, sigmoid %.3g; silu' worst absolute %.3g\n", wsilu,
           wsig, wgrad);
    /* edges */
    CHECK(nl_elem_silu(0.0f) == 0.0f, "silu(0) = %g", nl_elem_silu(0.0f));
    CHECK(nl_elem_silu_grad(0.0f) == 0.5f, "silu'(0) = %g", nl_elem_silu_grad(0.0f));
    CHECK(nl_elem_silu(1e4f) == 1e4f, "silu(1e4) = %g", nl_elem_silu(1e4f));
    CHECK(nl_elem_silu_grad(1e4f) == 1.0f, "silu'(1e4) = %g", nl_elem_silu_grad(1e4f));
    CHECK(fabsf(nl_elem_silu(-1e4f)) <= 1e-30f, "silu(-1e4) = %g", nl_elem_silu(-1e4f));
    CHECK(fabsf(nl_elem_silu_grad(-1e4f)) <= 1e-30f, "silu'(-1e4) = %g", nl_elem_silu_grad(-1e4f));
    CHECK(nl_elem_sigmoid(-INFINITY) <= 1e-38f && nl_elem_sigmoid(INFINITY) == 1.0f,
          "sigmoid(-inf, inf) = %g, %g", nl_elem_sigmoid(-INFINITY), nl_elem_sigmoid(INFINITY));
}

/* swiglu h = silu(g) u: 5e-7 relative (plus 1e-35 absolute, the clamp
 * above). Backward: du = dh silu(g) 5e-7 relative; dg = dh u silu'(g)
 * within 2e-6 |dh u| (silu' as above). */
static void test_swiglu(void)
{
    int bad_h = 0, bad_dg = 0, bad_du = 0;
    for (int i = 0; i < 200000; i++) {
        const float g = i % 4 == 0 ? (float)uniform(-100, 100) : (float)uniform(-8, 8);
        const float u = (float)uniform(-5, 5), dh = (float)uniform(-3, 3);
        const double s = ref_sigmoid(g);
        const double h = g * s * u;
        const double du = (double)dh * g * s, dg = (double)dh * u * s * (1.0 + g * (1.0 - s));
        bad_h += !close_to(nl_elem_swiglu(g, u), h, 5e-7, 1e-35);
        float dgf, duf;
        nl_elem_swiglu_backward(&dgf, &duf, g, u, dh);
        bad_du += !close_to(duf, du, 5e-7, 1e-35);
        bad_dg += !(fabs(dgf - dg) <= 2e-6 * fabs((double)dh * u) + 1e-35);
    }
    CHECK(bad_h == 0, "swiglu: %d values beyond 5e-7 relative", bad_h);
    CHECK(bad_du == 0, "swiglu backward du: %d beyond 5e-7 relative", bad_du);
    CHECK(bad_dg == 0, "swiglu backward dg: %d beyond 2e-6 |dh u|", bad_dg);
    float dg, du;
    nl_elem_swiglu_backward(&dg, &du, 0.0f, 3.0f, 2.0f);
    CHECK(dg == 3.0f && du == 0.0f, "swiglu backward at g = 0: dg %g (3), du %g (0)", dg, du);
    CHECK(nl_elem_swiglu(0.0f, 7.0f) == 0.0f, "swiglu(0, u) = %g", nl_elem_swiglu(0.0f, 7.0f));
    CHECK(nl_elem_swiglu(50.0f, 2.0f) == 100.0f, "swiglu(50, 2) = %g", nl_elem_swiglu(50.0f, 2.0f));
}

/* ---------------------------------------------------------------- RoPE */

/* freq = base^(-2i/hd) to 4e-15 relative of exp(-2i/hd ln base) (whose
 * own argument carries up to 14 * 1.1e-16 of rounding); angle =
 * pos freq exactly as that product; the rotation of a float pair by float
 * (c, s) within 3e-7 of the pair's norm (a double-rounded product pair). */
static void test_rope(void)
{
    int bad_f = 0, bad_r = 0;
    const int hds[] = {2, 8, 64, 96, 128, 256};
    const float bases[] = {10000.0f, 500000.0f, 1e6f};
    for (int a = 0; a < 6; a++)
        for (int b = 0; b < 3; b++)
            for (int i = 0; i < hds[a] / 2; i++) {
                const double f = nl_elem_rope_freq(i, hds[a], bases[b]);
                const double ref = exp(-2.0 * i / hds[a] * log((double)bases[b]));
                bad_f += !close_to(f, ref, 4e-15, 0);
                const int pos = (int)uniform(0, 1 << 20);
                bad_f += nl_elem_rope_angle(pos, i, hds[a], bases[b]) != (double)pos * f;
            }
    CHECK(bad_f == 0, "rope freq/angle: %d mismatches", bad_f);
    CHECK(nl_elem_rope_freq(0, 64, 10000.0f) == 1.0, "freq of pair 0 is 1");
    CHECK(nl_elem_rope_angle(0, 5, 64, 10000.0f) == 0.0, "angle at position 0 is 0");
    for (int i = 0; i < 200000; i++) {
        const double ang = uniform(-1e4, 1e4);
        const float c = (float)cos(ang), s = (float)sin(ang);
        float x = (float)uniform(-10, 10), y = (float)uniform(-10, 10);
        const double rx = (double)x * c - (double)y * s, ry = (double)x * s + (double)y * c;
        const double norm = hypot(x, y);
        nl_elem_rope_rotate(&x, &y, c, s);
        bad_r += !(fabs(x - rx) <= 3e-7 * norm && fabs(y - ry) <= 3e-7 * norm);
    }
    CHECK(bad_r == 0, "rope rotate: %d pairs beyond 3e-7 of their norm", bad_r);
    float x = 1.25f, y = -3.5f;
    nl_elem_rope_rotate(&x, &y, 1.0f, 0.0f);
    CHECK(x == 1.25f && y == -3.5f, "rotation by 0 is the identity: %g %g", x, y);
    nl_elem_rope_rotate(&x, &y, 0.0f, 1.0f);
    CHECK(x == 3.5f && y == 1.25f, "rotation by pi/2: %g %g", x, y);
}

/* ---------------------------------------------------------------- online softmax */

/* A row of n scores in blocks of bs, folded into (m, l) with the step form
 * (exp(s - m) terms added after each rescale) and with the merge form
 * (each block's own max and sum). Both give lse = m + log l, and the
 * softmax-weighted mean of a value per score, within 1e-6 relative of the
 * double reference. */
static void fold_row(const float *sc, const float *val, int n, int bs, double *lse_step,
                     double *mean_step, double *lse_merge, double *mean_merge)
{
    float m = -INFINITY, l = 0.0f, acc = 0.0f;
    float m2 = -INFINITY, l2 = 0.0f, acc2 = 0.0f;
    for (int j0 = 0; j0 < n; j0 += bs) {
        const int nb = n - j0 < bs ? n - j0 : bs;
        float bmax = -INFINITY;
        for (int j = 0; j < nb; j++)
            bmax = sc[j0 + j] > bmax ? sc[j0 + j] : bmax;
        /* step form */
        const float corr = nl_elem_online_max(&m, bmax);
        l *= corr;
        acc *= corr;
        if (m != -INFINITY)
            for (int j = 0; j < nb; j++) {
                const float p = nl_elem_expf(sc[j0 + j] - m);
                l += p;
                acc += p * val[j0 + j];
            }
        /* merge form */
        float bl = 0.0f, bacc = 0.0f, bscale;
        if (bmax != -INFINITY)
            for (int j = 0; j < nb; j++) {
                const float p = nl_elem_expf(sc[j0 + j] - bmax);
                bl += p;
                bacc += p * val[j0 + j];
            }
        const float c2 = nl_elem_online_merge(&m2, &l2, bmax, bl, &bscale);
        acc2 = acc2 * c2 + bacc * bscale;
    }
    *lse_step = (double)m + log((double)l);
    *mean_step = (double)acc / (double)l;
    *lse_merge = (double)m2 + log((double)l2);
    *mean_merge = (double)acc2 / (double)l2;
}

static void test_online_softmax(void)
{
    enum { NMAX = 700 };
    float sc[NMAX], val[NMAX];
    int bad = 0;
    for (int row = 0; row < 3000; row++) {
        const int n = 1 + (int)uniform(0, NMAX - 1);
        const int bs = 1 + (int)uniform(0, 80);
        const double spread = row % 3 == 0 ? 80.0 : row % 3 == 1 ? 8.0 : 0.5;
        const double shift = uniform(-1000, 1000);
        for (int j = 0; j < n; j++) {
            /* some rows rise, so the max moves from block to block */
            sc[j] = (float)(shift + uniform(-spread, spread) + (row % 2 ? 0.05 * j : 0.0));
            val[j] = (float)uniform(-1, 1);
            if (row % 7 == 0 && j % 5 == 1)
                sc[j] = -INFINITY; /* masked scores */
        }
        if (row % 11 == 0)
            for (int j = 0; j < n && j < 2 * bs; j++)
                sc[j] = -INFINITY; /* leading blocks wholly masked */
        double mx = -INFINITY;
        for (int j = 0; j < n; j++)
            mx = sc[j] > mx ? sc[j] : mx;
        if (mx == -INFINITY)
            continue;
        double sum = 0, wsum = 0;
        for (int j = 0; j < n; j++) {
            const double p = exp((double)sc[j] - mx);
            sum += p;
            wsum += p * val[j];
        }
        const double lse = mx + log(sum), mean = wsum / sum;
        double ls, ms, lm, mm;
        fold_row(sc, val, n, bs, &ls, &ms, &lm, &mm);
        /* lse: 1e-6 relative to max(1, |lse|) (an absolute error in lse is a
         * relative one in the probabilities); mean: 1e-5 of the value scale */
        const double tl = 1e-6 * (fabs(lse) > 1 ? fabs(lse) : 1);
        if (!(fabs(ls - lse) <= tl && fabs(lm - lse) <= tl && fabs(ms - mean) <= 1e-5 &&
              fabs(mm - mean) <= 1e-5)) {
            if (bad++ < 5)
                fprintf(stderr,
                        "row %d n %d bs %d: lse %.9g step %.9g merge %.9g; mean %.9g "
                        "step %.9g merge %.9g\n",
                        row, n, bs, lse, ls, lm, mean, ms, mm);
        }
    }
    CHECK(bad == 0, "online softmax: %d rows beyond tolerance", bad);
    /* edges: the first block gives factor 0; an empty block leaves the state */
    float m = -INFINITY, l = 0.0f;
    CHECK(nl_elem_online_max(&m, 3.0f) == 0.0f && m == 3.0f, "first block: m %g", m);
    CHECK(nl_elem_online_max(&m, -INFINITY) == 1.0f && m == 3.0f, "empty block: m %g", m);
    CHECK(nl_elem_online_max(&m, 5.0f) == nl_elem_expf(-2.0f) && m == 5.0f, "higher block: m %g",
          m);
    m = -INFINITY;
    float bscale = -1.0f;
    float corr = nl_elem_online_merge(&m, &l, -INFINITY, 0.0f, &bscale);
    CHECK(corr == 0.0f && bscale == 0.0f && m == -INFINITY && l == 0.0f,
          "merging two empty states: corr %g bscale %g m %g l %g", corr, bscale, m, l);
    corr = nl_elem_online_merge(&m, &l, 2.0f, 4.0f, &bscale);
    CHECK(corr == 0.0f && bscale == 1.0f && m == 2.0f && l == 4.0f,
          "into an empty state: corr %g bscale %g m %g l %g", corr, bscale, m, l);
    corr = nl_elem_online_merge(&m, &l, -INFINITY, 0.0f, NULL);
    CHECK(corr == 1.0f && m == 2.0f && l == 4.0f, "an empty block: corr %g m %g l %g", corr, m, l);
    corr = nl_elem_online_merge(&m, &l, 2.0f, 1.0f, &bscale);
    CHECK(corr == 1.0f && bscale == 1.0f && l == 5.0f, "an equal max: l %g", l);
}

/* ---------------------------------------------------------------- RMSNorm */

/* 1 / sqrt(ss / C + eps) within 3e-7 relative (a division, a sum, a square
 * root and a division, each correctly rounded). */
static void test_rmsnorm_scale(void)
{
    int bad = 0;
    for (int i = 0; i < 200000; i++) {
        const int C = 1 + (int)uniform(0, 16384);
        const float ss = (float)(C * exp(uniform(-20, 20)));
        const float eps = i % 2 ? 1e-5f : 1e-6f;
        const double ref = 1.0 / sqrt((double)ss / C + eps);
        bad += !close_to(nl_elem_rmsnorm_scale(ss, C, eps), ref, 3e-7, 0);
    }
    CHECK(bad == 0, "rmsnorm scale: %d beyond 3e-7 relative", bad);
    CHECK(close_to(nl_elem_rmsnorm_scale(0.0f, 7, 1e-5f), 1.0 / sqrt((double)1e-5f), 3e-7, 0),
          "zero row: %g", nl_elem_rmsnorm_scale(0.0f, 7, 1e-5f));
    CHECK(nl_elem_rmsnorm_scale(4.0f, 1, 0.0f) == 0.5f, "C = 1: %g",
          nl_elem_rmsnorm_scale(4.0f, 1, 0.0f));
    CHECK(nl_elem_rmsnorm_scale(INFINITY, 4, 1e-5f) == 0.0f, "inf row: %g",
          nl_elem_rmsnorm_scale(INFINITY, 4, 1e-5f));
}

/* ---------------------------------------------------------------- AdamW */

/* Ten steps of one parameter against the same recurrence in double, with
 * the bias corrections of each step: v within 1e-6 relative; m within 1e-6
 * of the same average of |g| (its terms may cancel); p within half an ulp
 * per step (10 steps: 6e-7 relative) plus 1e-5 of the total update. */
static void test_adamw(void)
{
    int bad = 0;
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    for (int i = 0; i < 20000; i++) {
        float p = (float)uniform(-2, 2), m = 0.0f, v = 0.0f;
        double pd = p, md = 0, vd = 0, mabs = 0, moved = 0;
        const float wd = i % 2 ? 0.1f : 0.0f;
        const float gs = i % 3 ? 1.0f : (float)uniform(0.01, 1);
        const double gmag = exp(uniform(-15, 3));
        for (int t = 1; t <= 10; t++) {
            const float g = (float)(gmag * uniform(-1, 1));
            const float bc1 = 1.0f - powf(b1, (float)t), bc2 = 1.0f - powf(b2, (float)t);
            nl_elem_adamw(&p, &m, &v, g, lr, b1, b2, eps, wd, bc1, bc2, gs);
            const double gd = (double)g * gs;
            md = (double)b1 * md + (1.0 - (double)b1) * gd;
            mabs = (double)b1 * mabs + (1.0 - (double)b1) * fabs(gd);
            vd = (double)b2 * vd + (1.0 - (double)b2) * gd * gd;
            const double step = (double)lr * (md / bc1 / (sqrt(vd / bc2) + eps) + (double)wd * pd);
            pd -= step;
            moved += fabs(step);
        }
        if (!(fabs(m - md) <= 1e-6 * mabs && close_to(v, vd, 1e-6, 1e-38) &&
              fabs(p - pd) <= 6e-7 * fabs(pd) + 1e-5 * moved)) {
            if (bad++ < 5)
                fprintf(stderr, "adamw case %d: p %.9g (%.9g) m %.9g (%.9g) v %.9g (%.9g)\n", i, p,
                        pd, m, md, v, vd);
        }
    }
    CHECK(bad == 0, "adamw: %d cases beyond tolerance", bad);
    /* a zero gradient without decay leaves p; decay alone shrinks it */
    float p = 1.5f, m = 0.0f, v = 0.0f;
    nl_elem_adamw(&p, &m, &v, 0.0f, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f, 0.1f, 0.001f, 1.0f);
    CHECK(p == 1.5f && m == 0.0f && v == 0.0f, "zero gradient: p %g", p);
    nl_elem_adamw(&p, &m, &v, 0.0f, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.5f, 0.1f, 0.001f, 1.0f);
    CHECK(p == 1.5f - 1e-2f * 0.5f * 1.5f, "decay only: p %.9g", p);
    /* the first step moves p by about lr, whatever the gradient's size */
    p = 0.0f, m = 0.0f, v = 0.0f;
    nl_elem_adamw(&p, &m, &v, 1e-3f, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f, 0.1f, 0.001f, 1.0f);
    CHECK(close_to(p, -1e-2, 1e-4, 0), "first step: p %.9g (-0.01)", p);
    /* a non-finite gradient reaches p (the caller's sumsq check catches it) */
    p = 1.0f, m = 0.0f, v = 0.0f;
    nl_elem_adamw(&p, &m, &v, NAN, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f, 0.1f, 0.001f, 1.0f);
    CHECK(isnan(p), "nan gradient: p %g", p);
}

/* The sampling rule's greedy pick (kernels/elem.h): the largest logit, ties
 * to the lower id (every backend's sample_rows slot and the CUDA reduction use
 * this comparison, so the ops tests, which compare a slot with these
 * functions, cannot see a reversed tie-break), a NaN never chosen, 0 when
 * every logit is NaN; at temperature 0 the row's pick is the greedy id. */
static void test_sample_greedy(void)
{
    CHECK(nl_elem_sample_better(3.0f, 1, 3.0f, 2), "a tie goes to the lower id");
    CHECK(!nl_elem_sample_better(3.0f, 2, 3.0f, 1), "a tie never goes to the higher id");
    CHECK(nl_elem_sample_better(4.0f, 9, 3.0f, 1), "a larger logit wins whatever its id");
    CHECK(!nl_elem_sample_better(NAN, 0, 3.0f, 1), "a NaN never wins");
    const float tie[] = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f};
    CHECK(nl_elem_sample_argmax(tie, 5) == 1, "argmax of a three-way tie: %d (1)",
          nl_elem_sample_argmax(tie, 5));
    const float with_nan[] = {NAN, 2.0f, NAN, 2.0f};
    CHECK(nl_elem_sample_argmax(with_nan, 4) == 1, "argmax past NaNs: %d (1)",
          nl_elem_sample_argmax(with_nan, 4));
    const float all_nan[] = {NAN, NAN, NAN};
    CHECK(nl_elem_sample_argmax(all_nan, 3) == 0, "argmax of NaNs: %d (0)",
          nl_elem_sample_argmax(all_nan, 3));
    const float flat[] = {-INFINITY, 0.5f, 0.5f};
    CHECK(nl_elem_sample_row(flat, 3, 0.0f, 1.0f, 0.99, NULL) == 1, "greedy row of a tie: %d (1)",
          nl_elem_sample_row(flat, 3, 0.0f, 1.0f, 0.99, NULL));
    CHECK(nl_elem_sample_row(flat, 3, 0.0f, 0.5f, 0.99, NULL) == 1,
          "greedy row of a tie with top-p: %d (1)",
          nl_elem_sample_row(flat, 3, 0.0f, 0.5f, 0.99, NULL));
}

/* Temperature sampling over every token as the rule was before top-p
 * joined it (chunk sums in id order, then the chunks in order): top-p 1
 * and 0 must keep its ids */
static int plain_rule(const float *l, int V, float t, double u)
{
    const int best = nl_elem_sample_argmax(l, V);
    const float lmax = l[best];
    double total = 0.0;
    for (int i0 = 0; i0 < V; i0 += NL_SAMPLE_CHUNK) {
        double s = 0.0;
        for (int i = i0; i < i0 + NL_SAMPLE_CHUNK && i < V; i++)
            s += nl_elem_sample_weight(l[i], lmax, t);
        total += s;
    }
    const double target = u * total;
    double acc = 0.0;
    for (int i = 0; i < V; i++) {
        acc += nl_elem_sample_weight(l[i], lmax, t);
        if (acc > target)
            return i;
    }
    return best;
}

/* Top-p (kernels/elem.h): the nucleus is the most likely tokens down to
 * the first weight that brings their mass to top_p, a tie at that weight
 * kept whole; the draw is the plain rule's inside it. Checked against a
 * reference that sorts the weights (what the host did before), with the
 * weights stored or computed (the same ids), over vocabularies across the
 * chunks' edges; the host's guess of the threshold is the bisection's
 * where it is proven (nearly always); top-p 0 and 1 give plain temperature
 * sampling's ids. */
static void test_sample_top_p(void)
{
    /* four tokens of weights 1, 0.6, 0.3, 0.1 (about): top-p 0.7 keeps the
     * first two (1.6 of 2.0; the first alone is 1.0 < 1.4) */
    const float four[] = {0.0f, logf(0.6f), logf(0.3f), logf(0.1f)};
    float w[4];
    const double total4 = nl_elem_sample_mass(four, NULL, 4, 0.0f, 1.0f, 0.0f);
    const float tau4 = nl_elem_sample_threshold(four, NULL, 4, 0.0f, 1.0f, 0.7f, total4);
    CHECK(tau4 == nl_elem_sample_weight(four[1], 0.0f, 1.0f), "tau of 1, .6, .3, .1 at 0.7: %g",
          (double)tau4);
    int seen[4] = {0};
    for (int k = 0; k < 1000; k++)
        seen[nl_elem_sample_row(four, 4, 1.0f, 0.7f, (k + 0.5) / 1000, w)]++;
    /* the draw's shares: 1 / 1.6 and 0.6 / 1.6 */
    CHECK(seen[2] == 0 && seen[3] == 0 && abs(seen[0] - 625) <= 1 && abs(seen[1] - 375) <= 1,
          "draws inside the nucleus of two: %d %d %d %d", seen[0], seen[1], seen[2], seen[3]);
    /* a tie at the edge is kept whole: weights 1, .5, .5, .5 at top-p 0.5
     * (2.5 in all; 1 + .5 reaches 1.25): every .5 stays */
    const float tie[] = {0.0f, logf(0.5f), logf(0.5f), logf(0.5f)};
    memset(seen, 0, sizeof seen);
    for (int k = 0; k < 1000; k++)
        seen[nl_elem_sample_row(tie, 4, 1.0f, 0.5f, (k + 0.5) / 1000, NULL)]++;
    CHECK(seen[0] && seen[1] && seen[2] && seen[3], "a tie at the edge: %d %d %d %d", seen[0],
          seen[1], seen[2], seen[3]);

    enum { VMAX = 1100 };
    static float l[VMAX], ws[VMAX], sorted[VMAX];
    const int vocabs[] = {1, 2, 255, 257, 1024, 1025, VMAX};
    const float top_ps[] = {1e-4f, 0.3f, 0.9f, 0.999f};
    const float temps[] = {0.5f, 1.0f, 4.0f};
    uint32_t r = 777;
    int bad_tau = 0, bad_size = 0, bad_id = 0, outside = 0, differ_plain = 0, cases = 0;
    int bad_guess = 0, guessed = 0, thresholds = 0, bad_plain = 0, bad_weight = 0;
    /* logits of every kind among them: NaN, infinities, far below the
     * best (weights 0) and around exp's clamps */
    const float odd[] = {NAN, -INFINITY, -1e30f, -200.0f, -87.0f, -70.1f, 3.0f, 4.999f};
    for (size_t v = 0; v < sizeof vocabs / sizeof *vocabs; v++) {
        const int V = vocabs[v];
        for (int i = 0; i < V; i++) {
            r = r * 1664525u + 1013904223u;
            l[i] = 10.0f * ((float)(r >> 8) / 16777216.0f - 0.5f);
        }
        for (int i = 0; V >= 255 && i < (int)(sizeof odd / sizeof *odd); i++)
            l[(i * 37 + 11) % V] = odd[i];
        const int best = nl_elem_sample_argmax(l, V);
        for (size_t ti = 0; ti < sizeof temps / sizeof *temps; ti++)
            for (size_t pi = 0; pi < sizeof top_ps / sizeof *top_ps; pi++) {
                const float t = temps[ti], p = top_ps[pi], lmax = l[best];
                const double total = nl_elem_sample_mass(l, NULL, V, lmax, t, 0.0f);
                const float tau = nl_elem_sample_threshold(l, NULL, V, lmax, t, p, total);
                /* the largest tau whose mass reaches p * total */
                const double want = (double)p * total;
                bad_tau +=
                    !(nl_elem_sample_mass(l, NULL, V, lmax, t, tau) >= want) ||
                    !(nl_elem_sample_mass(l, NULL, V, lmax, t, nextafterf(tau, INFINITY)) < want);
                /* the reference: the weights sorted, summed from the largest
                 * until p * total; every weight >= the last one taken */
                for (int i = 0; i < V; i++)
                    sorted[i] = nl_elem_sample_weight(l[i], lmax, t);
                for (int i = 1; i < V; i++) /* insertion sort, descending */
                    for (int j = i; j > 0 && sorted[j] > sorted[j - 1]; j--) {
                        const float x = sorted[j];
                        sorted[j] = sorted[j - 1];
                        sorted[j - 1] = x;
                    }
                double acc = 0.0;
                int n = 0;
                while (n < V && acc < want)
                    acc += sorted[n++];
                int in_ref = 0, in_tau = 0;
                for (int i = 0; i < V; i++) {
                    const float wi = nl_elem_sample_weight(l[i], lmax, t);
                    in_ref += wi >= sorted[n - 1];
                    in_tau += wi >= tau;
                }
                bad_size += in_ref != in_tau;
                /* the host's shortcut: the bisection's tau, or -1; the
                 * weights by the vectorised pass, each the scalar's bits */
                nl_elem_sample_weights(l, ws, V, lmax, t);
                for (int i = 0; i < V; i++)
                    bad_weight += memcmp(&(float){nl_elem_sample_weight(l[i], lmax, t)}, &ws[i],
                                         sizeof(float)) != 0;
                const float g = nl_elem_sample_guess(ws, V, want);
                bad_guess += g >= 0.0f && g != tau;
                guessed += g == tau;
                thresholds++;
                for (int k = 0; k < 7; k++) {
                    const double u = (k + 0.37) / 7;
                    const int a = nl_elem_sample_row(l, V, t, p, u, ws);
                    const int b = nl_elem_sample_row(l, V, t, p, u, NULL);
                    bad_id += a != b;
                    outside += !(nl_elem_sample_weight(l[a], lmax, t) >= tau);
                    differ_plain += a != nl_elem_sample_row(l, V, t, 1.0f, u, NULL);
                    const int plain = plain_rule(l, V, t, u);
                    bad_plain += nl_elem_sample_row(l, V, t, 1.0f, u, ws) != plain ||
                                 nl_elem_sample_row(l, V, t, 0.0f, u, NULL) != plain;
                    cases++;
                }
            }
    }
    CHECK(bad_tau == 0, "top-p: %d thresholds not the largest whose mass reaches top-p", bad_tau);
    CHECK(bad_size == 0, "top-p: %d nuclei of another size than the sorted reference's", bad_size);
    CHECK(bad_guess == 0 && guessed >= thresholds * 9 / 10,
          "top-p: the guess was proven and wrong %d times, right %d of %d", bad_guess, guessed,
          thresholds);
    CHECK(bad_weight == 0, "%d weights of the vectorised pass differ from the scalar's",
          bad_weight);
    CHECK(bad_id == 0, "top-p: %d of %d ids differ between stored and computed weights", bad_id,
          cases);
    CHECK(outside == 0, "top-p: %d of %d ids outside the nucleus", outside, cases);
    CHECK(bad_plain == 0, "top-p 1 and 0: %d of %d ids differ from plain temperature sampling",
          bad_plain, cases);
    CHECK(differ_plain > cases / 4, "top-p: only %d of %d ids differ from sampling every token",
          differ_plain, cases);
}

/* bf16 rounding keeps the infinities infinite (only a NaN is made quiet) */
static void test_bf16_inf(void)
{
    CHECK(nl_elem_to_bf16(INFINITY) == 0x7f80u, "bf16(inf) = %#x (0x7f80)",
          (unsigned)nl_elem_to_bf16(INFINITY));
    CHECK(nl_elem_to_bf16(-INFINITY) == 0xff80u, "bf16(-inf) = %#x (0xff80)",
          (unsigned)nl_elem_to_bf16(-INFINITY));
    CHECK((nl_elem_to_bf16(NAN) & 0x7fc0u) == 0x7fc0u, "bf16(nan) = %#x, a quiet NaN",
          (unsigned)nl_elem_to_bf16(NAN));
}

/* top-k routing: the k largest in descending order, ties to the lower
 * expert index, weights renormalised over the chosen */
static void test_topk(void)
{
    const float row[] = {0.1f, 0.3f, 0.05f, 0.3f, 0.25f};
    int32_t ch[3];
    float w[3];
    nl_elem_topk_row(ch, w, row, 5, 3);
    CHECK(ch[0] == 1 && ch[1] == 3 && ch[2] == 4, "top-3: %d %d %d (1 3 4)", ch[0], ch[1], ch[2]);
    const float sum = 0.3f + 0.3f + 0.25f;
    CHECK(w[0] == 0.3f / sum && w[1] == 0.3f / sum && w[2] == 0.25f / sum, "top-3 weights %g %g %g",
          w[0], w[1], w[2]);
    const float flat[] = {0.25f, 0.25f, 0.25f, 0.25f};
    nl_elem_topk_row(ch, w, flat, 4, 2);
    CHECK(ch[0] == 0 && ch[1] == 1 && w[0] == 0.5f && w[1] == 0.5f,
          "top-2 of a flat row: %d %d (0 1), %g %g", ch[0], ch[1], w[0], w[1]);
    nl_elem_topk_row(ch, w, row, 5, 1);
    CHECK(ch[0] == 1 && w[0] == 1.0f, "top-1: %d (1), weight %g", ch[0], w[0]);
}

int main(void)
{
    test_exp();
    test_silu();
    test_swiglu();
    test_rope();
    test_online_softmax();
    test_rmsnorm_scale();
    test_adamw();
    test_sample_greedy();
    test_sample_top_p();
    test_bf16_inf();
    test_topk();
    return check_done("test_elem");
}
