/* int nl_emu_family_checks(void); -- call from test_cuda_emu's main:
 *   CHECK(nl_emu_family_checks() == 0, "model variants");
 *
 * The CUDA kernels of DESIGN.md section 6's variants under the emulator
 * (see cuda_runtime.h) against the CPU backend: GeGLU forward and backward
 * and YaRN RoPE (kernels/cuda/cuda_family.cu, included here with its
 * launches rewritten, as the other emu_*.cc files do), and the masked
 * attention forward and backward (cuda_attention.cu, cuda_attention_bwd.cu,
 * whose launchers the other translation units hold): bidirectional,
 * windows (causal and bidirectional, prefill and decode over a cache),
 * packed documents, alone and combined, for several head-dim buckets.
 * One translation unit with its own CHECK counters: returns how many
 * failed (each printed); prints nothing else unless NL_EMU_VERBOSE is set.
 *
 * Tolerances as test_cuda_emu's: element-wise 1e-6 relative (GeGLU), RoPE
 * 1e-6 norm-wise per row, attention 1e-5 of the output's max-norm and lse
 * 1e-5 relative, each attention gradient 1e-5 of its max |reference|
 * (floored at 1/4 of the largest, as emu_attention_bwd.cc). Outputs start
 * as NaN between NaN guards that must survive; in the windowed cases the
 * cache rows that no query's window reaches are NaN too, so a kernel that
 * read them would poison its output. */
#include "tests/cuda_emu/cuda_runtime.h"

#include "cuda_family.cu.cc"

#include "tests/check.h"

extern "C" {
#include "kernels/backend.h"
}
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_attention_bwd.h"
#include "kernels/cuda/cuda_family.h"

#include <stdint.h>
#include <stdio.h>
#include <vector>

namespace
{

uint64_t fam_rng = 0x243f6a8885a308d3ull;

float fam_frand(void) /* uniform in [-1, 1) */
{
    fam_rng = fam_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((fam_rng >> 40) & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

constexpr size_t GUARD = 64; /* NaN floats each side of every buffer */

/* n floats between NaN guards, all NaN to begin with. */
struct gbuf {
    std::vector<float> mem;
    size_t n;
    explicit gbuf(size_t n_) : mem(n_ + 2 * GUARD, NAN), n(n_) {}
    float *p() { return mem.data() + GUARD; }
    float &operator[](size_t i) { return mem[GUARD + i]; }
    bool intact() const
    {
        for (size_t i = 0; i < GUARD; i++)
            if (mem[i] == mem[i] || mem[GUARD + n + i] == mem[GUARD + n + i])
                return false;
        return true;
    }
};

void verbose(const char *what, double frac)
{
    if (getenv("NL_EMU_VERBOSE"))
        printf("%-100s %.3f of tolerance\n", what, frac);
}

/* got against ref over n floats: |got - ref| <= tol (per element). */
size_t count_off(const float *got, const float *ref, size_t n, double tol, double *emax)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)got[i] - ref[i]);
        if (!(e <= tol))
            bad++;
        if (!(e <= *emax))
            *emax = e;
    }
    return bad;
}

/* ---------------------------------------------------------------- GeGLU */

void test_geglu(nl_backend *cpu)
{
    const int shapes[][2] = {{1, 1}, {3, 7}, {5, 300}, {2, 1000}, {17, 33}};
    for (const auto &sh : shapes) {
        const int N = sh[0], F = sh[1];
        const size_t ngu = (size_t)N * 2 * F, nh = (size_t)N * F;
        gbuf gu(ngu), dh(nh), h1(nh), h2(nh), d1(ngu), d2(ngu);
        for (size_t i = 0; i < ngu; i++)
            gu[i] = 4.0f * fam_frand(); /* both tails of the GELU */
        for (size_t i = 0; i < nh; i++)
            dh[i] = fam_frand();
        char what[96];
        snprintf(what, sizeof what, "geglu N %d F %d", N, F);
        cpu->geglu_forward(cpu, h1.p(), gu.p(), N, F);
        CHECK(nl_cuda_geglu_forward(nullptr, h2.p(), gu.p(), N, F) == 0, "%s: launch", what);
        size_t bad = 0;
        double worst = 0;
        for (size_t i = 0; i < nh; i++) {
            const double e = fabs((double)h2[i] - h1[i]) / (1e-6 * fmax(1e-3, fabs((double)h1[i])));
            bad += !(e <= 1);
            worst = fmax(worst, e);
        }
        verbose(what, worst);
        CHECK(bad == 0 && h2.intact(), "%s: %zu of %zu off (worst %.3g of tolerance)", what, bad,
              nh, worst);

        snprintf(what, sizeof what, "geglu_backward N %d F %d", N, F);
        cpu->geglu_backward(cpu, d1.p(), dh.p(), gu.p(), N, F);
        CHECK(nl_cuda_geglu_backward(nullptr, d2.p(), dh.p(), gu.p(), N, F) == 0, "%s: launch",
              what);
        /* dg = dh u (Phi(g) + g phi(g)) cancels for negative g: judge it by
         * its terms, as test_cuda_emu judges SwiGLU's; du = dh gelu(g) is a
         * product */
        bad = 0;
        worst = 0;
        for (int n = 0; n < N; n++)
            for (int j = 0; j < F; j++) {
                const size_t i = (size_t)n * 2 * F + j;
                const double g = gu[i], u = gu[i + F], d = dh[(size_t)n * F + j];
                const double cdf = 0.5 * (1.0 + erf(g / sqrt(2.0)));
                const double pdf = exp(-0.5 * g * g) / sqrt(2.0 * M_PI);
                const double cond[2] = {fabs(d * u) * (cdf + fabs(g * pdf)), fabs(d * g * cdf)};
                for (int h = 0; h < 2; h++) {
                    const size_t e_at = i + (size_t)h * F;
                    const double e = fabs((double)d2[e_at] - d1[e_at]) / (1e-6 * fmax(1e-30, cond[h]));
                    bad += !(e <= 1);
                    worst = fmax(worst, e);
                }
            }
        verbose(what, worst);
        CHECK(bad == 0 && d2.intact(), "%s: %zu of %zu off (worst %.3g of tolerance)", what, bad,
              ngu, worst);
    }
    gbuf f(8);
    CHECK(nl_cuda_geglu_forward(nullptr, f.p(), f.p(), 0, 4) == 0, "geglu N 0");
    CHECK(nl_cuda_geglu_forward(nullptr, f.p(), f.p(), -1, 4) == cudaErrorInvalidValue,
          "geglu N < 0 accepted");
    CHECK(nl_cuda_geglu_backward(nullptr, f.p(), f.p(), f.p(), 2, -1) == cudaErrorInvalidValue,
          "geglu_backward F < 0 accepted");
}

/* ---------------------------------------------------------------- YaRN */

void test_yarn(nl_backend *cpu)
{
    struct yarn_case {
        int N, heads, hd, col0, row;
        double factor;
        int L0;
    } cases[] = {
        {5, 2, 16, 0, 32, 4.0, 32},       /* the golden test's factor */
        {40, 3, 64, 8, 200, 8.0, 2048},   /* col0 > 0, padded row */
        {9, 1, 256, 0, 256, 2.0, 100},    /* the largest head */
        {3, 4, 6, 2, 30, 16.0, 4},        /* tiny head, every pair ramped */
        {70, 2, 128, 0, 256, 1.0, 4096},  /* factor 1: m = 1, theta' = theta */
    };
    for (const yarn_case &c : cases) {
        const size_t n = (size_t)c.N * c.row;
        gbuf a(n), b(n);
        std::vector<int32_t> pos(c.N);
        for (int i = 0; i < c.N; i++)
            pos[i] = (i * 977) % 20000; /* positions past L0 */
        for (size_t i = 0; i < n; i++)
            a[i] = b[i] = fam_frand();
        const nl_rope_scaling sc = {NL_ROPE_YARN, c.L0, c.factor, 32.0, 1.0};
        char what[128];
        snprintf(what, sizeof what, "rope yarn N %d heads %d hd %d col0 %d factor %g L0 %d", c.N,
                 c.heads, c.hd, c.col0, c.factor, c.L0);
        cpu->rope_scaled_forward(cpu, a.p(), pos.data(), c.N, c.row, c.col0, c.heads, c.hd,
                                 10000.0f, sc);
        CHECK(nl_cuda_rope_yarn_forward(nullptr, b.p(), pos.data(), c.N, c.row, c.col0, c.heads,
                                        c.hd, 10000.0f, sc) == 0,
              "%s: launch", what);
        size_t bad = 0;
        double worst = 0;
        for (int r = 0; r < c.N; r++) { /* norm-wise per row */
            double nrm = 0, err = 0;
            for (int j = 0; j < c.row; j++) {
                const double x = a[(size_t)r * c.row + j], y = b[(size_t)r * c.row + j];
                nrm += x * x;
                err += (x - y) * (x - y);
            }
            const double e = sqrt(err) / (1e-6 * fmax(1e-30, sqrt(nrm)));
            bad += !(e <= 1);
            worst = fmax(worst, e);
        }
        verbose(what, worst);
        CHECK(bad == 0 && b.intact(), "%s: %zu rows off (worst %.3g of tolerance)", what, bad,
              worst);
    }
    gbuf f(64);
    int32_t p0[2] = {0, 1};
    nl_rope_scaling sc = {NL_ROPE_YARN, 0, 4.0, 32.0, 1.0};
    CHECK(nl_cuda_rope_yarn_forward(nullptr, f.p(), p0, 2, 8, 0, 1, 8, 1e4f, sc) ==
              cudaErrorInvalidValue,
          "yarn L0 0 accepted");
    sc = {NL_ROPE_YARN, 16, 0.0, 32.0, 1.0};
    CHECK(nl_cuda_rope_yarn_forward(nullptr, f.p(), p0, 2, 8, 0, 1, 8, 1e4f, sc) ==
              cudaErrorInvalidValue,
          "yarn factor 0 accepted");
    sc = {NL_ROPE_YARN, 16, 4.0, 32.0, 32.0};
    CHECK(nl_cuda_rope_yarn_forward(nullptr, f.p(), p0, 2, 8, 0, 1, 8, 1e4f, sc) ==
              cudaErrorInvalidValue,
          "yarn beta_fast == beta_slow accepted");
}

/* ---------------------------------------------------------------- masked attention */

struct mask_case {
    int B, T, past, H, G, hd;
    int bidir, window;
    int docs; /* > 0: that many documents per row (uneven lengths) */
    float amp;
};

/* Document ids of a (B, T) packed batch: `docs` runs of uneven lengths in
 * row 0, one document fewer in each next row (at least one). */
std::vector<int32_t> make_docs(int B, int T, int docs)
{
    std::vector<int32_t> d((size_t)B * T);
    for (int b = 0; b < B; b++) {
        const int nd = docs - b > 1 ? docs - b : 1;
        int id = 0;
        for (int t = 0; t < T; t++) {
            /* boundaries at 2/7, 3/7, ... of the row, so lengths differ */
            while (id + 1 < nd && t >= (T * (id + 2)) / (nd + 4))
                id++;
            d[(size_t)b * T + t] = id;
        }
    }
    return d;
}

/* Key j of sequence b is visible to some query of the call (the union of
 * the ranges): the others may be NaN. */
bool key_reached(const mask_case &c, int j)
{
    const int lo_q = c.past, hi_q = c.past + c.T - 1, W = c.window;
    if (W <= 0)
        return true;
    if (!c.bidir)
        return j > lo_q - W && j <= hi_q;
    return j >= lo_q - W / 2 && j <= hi_q + W / 2;
}

void run_masked_forward(nl_backend *cpu, const mask_case &c)
{
    const int cap = c.past + c.T + 3;
    const nl_attn_shape s = {c.B, c.T, c.past, cap, c.H, c.G, c.hd, nullptr, 0, nullptr, nullptr};
    const int qs = c.H * c.hd + 2, ks = c.G * c.hd + 1;
    const size_t nq = (size_t)c.B * c.T * qs, nk = (size_t)c.B * cap * ks;
    const size_t no = (size_t)c.B * c.T * c.H * c.hd, nl = (size_t)c.B * c.H * c.T;
    gbuf q(nq), k(nk), v(nk), o1(no), o2(no), l1(nl), l2(nl);
    for (size_t i = 0; i < nq; i++)
        q[i] = (int)(i % qs) < c.H * c.hd ? c.amp * fam_frand() : NAN;
    for (size_t i = 0; i < nk; i++) {
        const int j = (int)(i / ks % cap);
        const bool live = j < c.past + c.T && (int)(i % ks) < c.G * c.hd && key_reached(c, j);
        k[i] = live ? c.amp * fam_frand() : NAN;
        v[i] = live ? fam_frand() : NAN;
    }
    std::vector<int32_t> docs;
    nl_attn_mask mk = {c.bidir, c.window, nullptr};
    if (c.docs > 0) {
        docs = make_docs(c.B, c.T, c.docs);
        mk.doc = docs.data();
    }
    char what[180];
    snprintf(what, sizeof what,
             "masked attention B %d T %d past %d H %d G %d hd %d bidir %d window %d docs %d", c.B,
             c.T, c.past, c.H, c.G, c.hd, c.bidir, c.window, c.docs);
    cpu->attention_masked_forward(cpu, o1.p(), l1.p(), q.p(), qs, k.p(), v.p(), ks, s, mk);
    const int rc = nl_cuda_attention_masked_forward(nullptr, o2.p(), l2.p(), q.p(), qs, k.p(),
                                                    v.p(), ks, s, mk);
    CHECK(rc == 0, "%s: launch returned %d", what, rc);
    double omax = 0, emax = 0;
    for (size_t i = 0; i < no; i++)
        omax = fmax(omax, fabs((double)o1[i]));
    const size_t bad = count_off(o2.p(), o1.p(), no, 1e-5 * omax, &emax);
    verbose(what, emax / (1e-5 * omax));
    CHECK(bad == 0 && omax > 0, "%s: %zu of %zu outputs off, max error %.3g of max |out| %.3g",
          what, bad, no, emax, omax);
    size_t lbad = 0;
    for (size_t i = 0; i < nl; i++)
        lbad += !(fabs((double)l2[i] - l1[i]) <= 1e-5 * fmax(1.0, fabs((double)l1[i])));
    CHECK(lbad == 0, "%s: %zu of %zu lse values off", what, lbad, nl);
    CHECK(o2.intact() && l2.intact(), "%s: a write past out or lse", what);
}

void run_masked_backward(nl_backend *cpu, const mask_case &c)
{
    const nl_attn_shape s = {c.B, c.T, 0, c.T, c.H, c.G, c.hd, nullptr, 0, nullptr, nullptr};
    /* q, k, v as column slices of one buffer (core's qkv), padded */
    const int w = (c.H + 2 * c.G) * c.hd + 3;
    const size_t rows = (size_t)c.B * c.T, n = rows * w;
    const size_t offs[3] = {0, (size_t)c.H * c.hd, (size_t)(c.H + c.G) * c.hd};
    const int width[3] = {c.H * c.hd, c.G * c.hd, c.G * c.hd};
    gbuf x(n), g1(n), g2(n);
    for (size_t r = 0; r < rows; r++)
        for (int col = 0; col < w - 3; col++)
            x[r * w + col] = (col < c.H * c.hd + c.G * c.hd ? c.amp : 1.0f) * fam_frand();
    const size_t no = rows * c.H * c.hd, nl = (size_t)c.B * c.H * c.T;
    gbuf out(no), lse(nl), dout(no);
    for (size_t i = 0; i < no; i++)
        dout[i] = fam_frand();
    std::vector<int32_t> docs;
    nl_attn_mask mk = {c.bidir, c.window, nullptr};
    if (c.docs > 0) {
        docs = make_docs(c.B, c.T, c.docs);
        mk.doc = docs.data();
    }
    float *xq = x.p(), *xk = x.p() + offs[1], *xv = x.p() + offs[2];
    cpu->attention_masked_forward(cpu, out.p(), lse.p(), xq, w, xk, xv, w, s, mk);
    cpu->attention_masked_backward(cpu, g1.p(), g1.p() + offs[1], g1.p() + offs[2], dout.p(), xq,
                                   w, xk, xv, w, out.p(), lse.p(), s, mk);
    gbuf scratch(nl_cuda_attention_backward_scratch(s) / sizeof(float));
    char what[180];
    snprintf(what, sizeof what,
             "masked attention_backward B %d T %d H %d G %d hd %d bidir %d window %d docs %d", c.B,
             c.T, c.H, c.G, c.hd, c.bidir, c.window, c.docs);
    const int rc = nl_cuda_attention_masked_backward(nullptr, g2.p(), g2.p() + offs[1],
                                                     g2.p() + offs[2], dout.p(), xq, w, xk, xv, w,
                                                     out.p(), lse.p(), scratch.p(), s, mk);
    CHECK(rc == 0, "%s: launch returned %d", what, rc);
    const char *names[3] = {"dq", "dk", "dv"};
    double rmax[3] = {0, 0, 0}, rall = 0;
    for (int t = 0; t < 3; t++) {
        for (size_t r = 0; r < rows; r++)
            for (int col = 0; col < width[t]; col++)
                rmax[t] = fmax(rmax[t], fabs((double)g1[r * w + offs[t] + col]));
        rall = fmax(rall, rmax[t]);
    }
    for (int t = 0; t < 3; t++) {
        const double tol = 1e-5 * fmax(rmax[t], 0.25 * rall);
        size_t bad = 0;
        double emax = 0;
        for (size_t r = 0; r < rows; r++)
            bad += count_off(&g2[r * w + offs[t]], &g1[r * w + offs[t]], width[t], tol, &emax);
        char line[200];
        snprintf(line, sizeof line, "%s %s", what, names[t]);
        verbose(line, emax / tol);
        CHECK(bad == 0 && rall > 0, "%s: %zu of %zu off, max error %.3g (tolerance %.3g)", line,
              bad, rows * width[t], emax, tol);
    }
    size_t pad = 0; /* the padding columns stay NaN */
    for (size_t r = 0; r < rows; r++)
        for (int col = w - 3; col < w; col++)
            pad += g2[r * w + col] == g2[r * w + col];
    CHECK(pad == 0 && g2.intact() && scratch.intact(), "%s: %zu padding floats written", what,
          pad);
}

void test_masked_attention(nl_backend *cpu)
{
    const mask_case fwd[] = {
        /* B  T   past H  G  hd  bidir window docs amp */
        {2, 100, 0, 2, 1, 16, 1, 16, 0, 2},   /* the encoder: windows of 16 over 100 */
        {2, 100, 0, 2, 1, 16, 0, 16, 0, 2},   /* causal window */
        {1, 70, 0, 4, 2, 64, 1, 0, 0, 2},     /* bidirectional, global */
        {2, 100, 0, 2, 2, 16, 1, 0, 3, 2},    /* packed rows of 3 documents, encoder */
        {2, 90, 0, 2, 1, 32, 0, 0, 3, 2},     /* packed, causal */
        {2, 100, 0, 2, 1, 16, 1, 16, 3, 3},   /* packed and windowed */
        {1, 3, 0, 2, 1, 16, 1, 0, 2, 2},      /* the decode kernel, documents */
        {1, 40, 200, 2, 1, 64, 0, 24, 0, 2},  /* causal window over a cache, prefill */
        {2, 1, 500, 4, 1, 128, 0, 64, 0, 2},  /* one token, window of 64 over a long cache */
        {1, 4, 300, 2, 2, 37, 0, 100, 0, 2},  /* decode T 4, odd hd, window past a chunk */
        {1, 33, 0, 2, 1, 256, 1, 7, 0, 1},    /* the 256 bucket, odd window */
        {1, 50, 0, 2, 1, 100, 0, 1, 0, 2},    /* window 1: each query sees itself only */
        {1, 60, 0, 2, 1, 8, 1, 500, 0, 2},    /* a window wider than the row */
    };
    for (const mask_case &c : fwd)
        run_masked_forward(cpu, c);
    const mask_case bwd[] = {
        {2, 100, 0, 2, 1, 16, 1, 16, 0, 2},  /* encoder, windows of 16 */
        {2, 100, 0, 2, 1, 16, 0, 16, 0, 2},  /* causal window */
        {1, 70, 0, 4, 2, 64, 1, 0, 0, 2},    /* bidirectional, global */
        {2, 100, 0, 2, 2, 16, 1, 0, 3, 2},   /* packed encoder rows */
        {2, 90, 0, 2, 1, 32, 0, 0, 3, 2},    /* packed, causal */
        {2, 100, 0, 2, 1, 16, 1, 16, 3, 3},  /* packed and windowed */
        {1, 40, 0, 2, 1, 128, 1, 9, 0, 2},   /* 128 bucket, odd window */
        {1, 20, 0, 2, 1, 200, 0, 5, 2, 1},   /* 256 bucket */
        {1, 50, 0, 2, 1, 8, 0, 1, 0, 2},     /* window 1 */
        /* window 2 over tiles of 32 (hd 16): key 31's last query, 32, is
         * the first of the next query tile, so a key tile that stopped one
         * query short would miss that tile */
        {1, 100, 0, 2, 1, 16, 0, 2, 0, 2},
        {1, 100, 0, 2, 1, 16, 1, 2, 0, 2},
    };
    for (const mask_case &c : bwd)
        run_masked_backward(cpu, c);

    /* a zeroed mask is the causal kernel, to the bit */
    {
        const nl_attn_shape s = {1, 37, 5, 42, 2, 1, 16, nullptr, 0, nullptr, nullptr};
        const size_t nq = 37 * 32, nk = 42 * 16, no = 37 * 32;
        gbuf q(nq), k(nk), v(nk), a(no), b(no);
        for (size_t i = 0; i < nq; i++)
            q[i] = fam_frand();
        for (size_t i = 0; i < nk; i++) {
            k[i] = fam_frand();
            v[i] = fam_frand();
        }
        const nl_attn_mask zero = {};
        CHECK(nl_cuda_attention_forward(nullptr, a.p(), nullptr, q.p(), 32, k.p(), v.p(), 16, s) ==
                      0 &&
                  nl_cuda_attention_masked_forward(nullptr, b.p(), nullptr, q.p(), 32, k.p(),
                                                   v.p(), 16, s, zero) == 0,
              "zeroed mask: launch");
        CHECK(memcmp(a.p(), b.p(), no * sizeof(float)) == 0, "zeroed mask differs from causal");
    }
    /* refused masks launch nothing */
    gbuf f(4096);
    float *p = f.p();
    int32_t d[8] = {0};
    const long before = emu_launch_count();
    nl_attn_shape s = {1, 3, 2, 5, 2, 1, 8, nullptr, 0, nullptr, nullptr};
    nl_attn_mask bad = {0, 0, d}; /* documents over a cache */
    CHECK(nl_cuda_attention_masked_forward(nullptr, p, p, p, 16, p, p, 8, s, bad) ==
              cudaErrorInvalidValue,
          "documents with past > 0 accepted");
    s = {1, 3, 0, 3, 2, 1, 8, nullptr, 0, nullptr, nullptr};
    bad = {1, -2, nullptr};
    CHECK(nl_cuda_attention_masked_forward(nullptr, p, p, p, 16, p, p, 8, s, bad) ==
              cudaErrorInvalidValue,
          "negative window accepted (forward)");
    CHECK(nl_cuda_attention_masked_backward(nullptr, p, p, p, p, p, 16, p, p, 8, p, p, nullptr, s,
                                            bad) == cudaErrorInvalidValue,
          "negative window accepted (backward)");
    CHECK(emu_launch_count() == before, "%ld launches for refused masks",
          emu_launch_count() - before);
}

} // namespace

int nl_emu_family_checks(void)
{
    nl_error err = {};
    nl_backend *cpu = nullptr;
    nl_backend_opts opts = {};
    opts.threads = 1;
    if (nl_backend_new(&cpu, "cpu", &opts, &err) != NL_OK) {
        fprintf(stderr, "model variant checks: no CPU backend: %s\n", err.msg);
        return 1;
    }
    test_geglu(cpu);
    test_yarn(cpu);
    test_masked_attention(cpu);
    nl_backend_destroy(&cpu);
    if (getenv("NL_EMU_VERBOSE"))
        printf("model variants: %d passed, %d failed\n", check_pass_count, check_fail_count);
    return check_fail_count;
}
