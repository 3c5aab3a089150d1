/* The CUDA backend's kernels (kernels/cuda/cuda_ops.cu, cuda_attention.cu)
 * run on the CPU under the emulator in this folder and compared with the
 * CPU backend, so CI checks their index math, bounds, barriers, shared
 * memory and tiling without a GPU or the CUDA toolkit. The kernels are the
 * real sources, compiled by the host C++ compiler (see cuda_runtime.h for
 * how, and what the emulation cannot see).
 *
 * Shapes are the ones that break kernels: one row, one column, odd
 * widths, rows wider than a block, a 50,000-wide softmax, rows of -inf,
 * RoPE at col0 > 0 and hd up to 256, attention prefill and decode with
 * past > 0, H/G = 1 and 4, odd head dims, padded strides with NaN in the
 * padding and in the cache rows past past + T. Every buffer sits between
 * NaN guards that must survive, and outputs start as NaN.
 *
 * Tolerances (issue 13): copies exact; element-wise 1e-6 relative;
 * reductions, norms and softmax 1e-5 relative; RoPE and the MoE combine,
 * whose terms cancel, 1e-6 norm-wise per row; attention 1e-5 of the
 * output's max-norm, lse 1e-5 relative (absolute below 1). */
#include "tests/check.h"
#include "tests/cuda_emu/cuda_runtime.h"

extern "C" {
#include "kernels/backend.h"
#include "kernels/elem.h"
}
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_backward.h"
#include "kernels/cuda/cuda_ops.h"

#include <stdint.h>
#include <vector>

#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/asan_interface.h>
#endif

/* tests/cuda_emu/emu_attention_bwd.cc: the attention backward's checks (its
 * own translation unit and counters); returns how many failed */
int nl_emu_attention_backward_checks(void);
/* tests/cuda_emu/emu_moe.cc: routing and the grouped GEMMs (cuda_moe.cu),
 * likewise */
int nl_emu_moe_checks(void);
/* tests/cuda_emu/emu_selfcheck.cc: the emulator against kernels wrong on
 * purpose (it must expose each) */
int nl_emu_selfcheck(void);

/* tests/cuda_emu/emu_family.cc: GeGLU, YaRN and the masked attention
 * (DESIGN section 6), likewise */
int nl_emu_family_checks(void);
/* tests/cuda_emu/emu_fused.cc: the fused decode kernels (cuda_fused.cu),
 * likewise */
int nl_emu_fused_checks(void);
/* tests/cuda_emu/emu_kv_bf16.cc: the bf16 KV cache's write and attention,
 * likewise */
int nl_emu_kv_bf16_checks(void);
/* tests/cuda_emu/emu_rows.cc: the row-invariant GEMM (cuda_rows.cu), the
 * fused decode kernels against the separate ones through it, and a batch
 * of sessions on those kernels against each alone, likewise */
int nl_emu_rows_checks(void);

namespace
{

/* ---------------------------------------------------------------- buffers */

uint64_t rng = 0x9e3779b97f4a7c15ull;

float frand(void) /* uniform in [-1, 1) */
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

int irand(int n) /* uniform in [0, n) */
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int)((rng >> 33) % (uint64_t)n);
}

constexpr uint32_t GUARD_BITS = 0x7fc5a5a5u; /* a quiet NaN */
constexpr size_t GUARD = 64;                 /* floats each side */

/* n floats between NaN guards: a kernel that reads past either end gets
 * NaN, one that writes there is caught by intact(). Under ASan the guards
 * are poisoned too, so any access to them is reported where it happens. */
struct buf {
    std::vector<float> mem;
    size_t n;
    explicit buf(size_t n_, float v = NAN) : mem(n_ + 2 * GUARD), n(n_)
    {
        float g;
        memcpy(&g, &GUARD_BITS, sizeof g);
        for (size_t i = 0; i < mem.size(); i++)
            mem[i] = i < GUARD || i >= GUARD + n ? g : v;
        poison(true);
    }
    buf(const buf &o) : n(o.n)
    {
        o.poison(false);
        mem = o.mem;
        o.poison(true);
        poison(true);
    }
    buf &operator=(const buf &) = delete;
    ~buf() { poison(false); }
    float *p() { return mem.data() + GUARD; }
    const float *p() const { return mem.data() + GUARD; }
    float &operator[](size_t i) { return mem[GUARD + i]; }
    void fill(float amp)
    {
        for (size_t i = 0; i < n; i++)
            (*this)[i] = amp * frand();
    }
    void poison(bool on) const
    {
#ifdef __SANITIZE_ADDRESS__
        const float *lo = mem.data(), *hi = mem.data() + GUARD + n;
        if (on) {
            ASAN_POISON_MEMORY_REGION(lo, GUARD * sizeof(float));
            ASAN_POISON_MEMORY_REGION(hi, GUARD * sizeof(float));
        } else {
            ASAN_UNPOISON_MEMORY_REGION(lo, GUARD * sizeof(float));
            ASAN_UNPOISON_MEMORY_REGION(hi, GUARD * sizeof(float));
        }
#else
        (void)on;
#endif
    }
    bool intact() const
    {
        poison(false);
        bool ok = true;
        for (size_t i = 0; i < mem.size(); i++) {
            if (i == GUARD)
                i += n;
            if (i >= mem.size())
                break;
            uint32_t b;
            memcpy(&b, &mem[i], sizeof b);
            ok &= b == GUARD_BITS;
        }
        poison(true);
        return ok;
    }
};

struct ibuf { /* int32 indices, no guards needed: the kernels only read them */
    std::vector<int32_t> v;
    explicit ibuf(size_t n) : v(n ? n : 1) {}
    int32_t *p() { return v.data(); }
};

/* ---------------------------------------------------------------- compare */

/* NL_EMU_VERBOSE=1: one line per comparison with its worst error as a
 * fraction of the tolerance (how much margin the kernels have). */
void report(const char *what, double frac)
{
    static const bool verbose = getenv("NL_EMU_VERBOSE") != nullptr;
    if (verbose)
        printf("%-90s %.3f of tolerance\n", what, frac);
}

bool same_float(float a, float b)
{
    return (a != a && b != b) || a == b;
}

/* |got - ref| <= rtol |ref| + atol everywhere; NaN must meet NaN. */
void check_elem(const char *what, const buf &got, const buf &ref, double rtol, double atol)
{
    size_t bad = 0, first = 0;
    double frac = 0;
    for (size_t i = 0; i < ref.n; i++) {
        const float a = got.p()[i], b = ref.p()[i];
        bool ok = same_float(a, b);
        if (!ok && a == a && b == b) {
            const double e = fabs((double)a - b), tol = rtol * fabs((double)b) + atol;
            ok = e <= tol;
            frac = fmax(frac, tol > 0 ? e / tol : INFINITY);
        }
        if (!ok && bad++ == 0)
            first = i;
    }
    report(what, frac);
    CHECK(bad == 0, "%s: %zu of %zu elements off, first [%zu] got %.9g want %.9g", what, bad, ref.n,
          first, bad ? got.p()[first] : 0.0, bad ? ref.p()[first] : 0.0);
    CHECK(got.intact(), "%s: a write past the buffer's ends", what);
}

/* Rows of width w: ||got - ref|| <= tol ||ref|| per row, NaN meeting NaN. */
void check_rows(const char *what, const buf &got, const buf &ref, size_t w, double tol)
{
    size_t bad = 0, first = 0;
    double worst = 0;
    for (size_t r = 0; r * w < ref.n; r++) {
        double num = 0, den = 0;
        bool nan_ok = true;
        for (size_t c = 0; c < w; c++) {
            const float a = got.p()[r * w + c], b = ref.p()[r * w + c];
            if (a != a || b != b) {
                nan_ok &= a != a && b != b;
                continue;
            }
            num += ((double)a - b) * ((double)a - b);
            den += (double)b * b;
        }
        const double e = sqrt(num) / (den > 0 ? sqrt(den) : 1.0);
        worst = e > worst ? e : worst;
        if ((!nan_ok || !(e <= tol)) && bad++ == 0)
            first = r;
    }
    report(what, worst / tol);
    CHECK(bad == 0, "%s: %zu rows off, first row %zu, worst norm-wise error %.3g", what, bad, first,
          worst);
    CHECK(got.intact(), "%s: a write past the buffer's ends", what);
}

/* The launcher returned 0 (and so did the emulation). */
void check_rc(const char *what, int rc)
{
    CHECK(rc == 0, "%s: the launcher returned %d (%s)", what, rc,
          cudaGetErrorString((cudaError_t)rc));
}

/* A sum judged by its terms: |got - ref| <= rtol cond[i], where cond[i] is
 * the sum of the absolute values of the terms that make element i (so an
 * element whose terms cancel is not held to its tiny result). */
void check_cond(const char *what, const buf &got, const buf &ref, const std::vector<double> &cond,
                double rtol)
{
    size_t bad = 0, first = 0;
    double frac = 0;
    for (size_t i = 0; i < ref.n; i++) {
        const float a = got.p()[i], b = ref.p()[i];
        const double e = fabs((double)a - b), tol = rtol * cond[i];
        const bool ok = e <= tol; /* false for NaN */
        frac = fmax(frac, tol > 0 ? e / tol : e > 0 ? INFINITY : 0);
        if (!ok && bad++ == 0)
            first = i;
    }
    report(what, frac);
    CHECK(bad == 0, "%s: %zu of %zu elements off, first [%zu] got %.9g want %.9g (terms %.3g)",
          what, bad, ref.n, first, bad ? got.p()[first] : 0.0, bad ? ref.p()[first] : 0.0,
          bad ? cond[first] : 0.0);
    CHECK(got.intact(), "%s: a write past the buffer's ends", what);
}

/* Bit for bit (NaN meeting NaN). */
void check_same(const char *what, const buf &got, const buf &ref)
{
    check_elem(what, got, ref, 0, 0);
}

/* ---------------------------------------------------------------- ops */

void test_embedding_gather(nl_backend *cpu)
{
    const int shapes[][3] = {{1, 1, 3}, {5, 37, 11}, {3, 300, 4}, {70, 1, 5}, {2, 1000, 7}};
    for (auto &sh : shapes) {
        const int N = sh[0], C = sh[1], V = sh[2];
        char what[96];
        buf table((size_t)V * C);
        table.fill(1);
        ibuf tok(N);
        for (int n = 0; n < N; n++)
            tok.p()[n] = irand(V);
        buf a((size_t)N * C), b((size_t)N * C);
        snprintf(what, sizeof what, "embedding N %d C %d", N, C);
        check_rc(what, nl_cuda_embedding_forward(nullptr, a.p(), tok.p(), table.p(), N, C));
        cpu->embedding_forward(cpu, b.p(), tok.p(), table.p(), N, C);
        check_elem(what, a, b, 0, 0);

        buf c((size_t)N * C), d((size_t)N * C);
        snprintf(what, sizeof what, "gather_rows n %d C %d", N, C);
        check_rc(what, nl_cuda_gather_rows(nullptr, c.p(), table.p(), tok.p(), N, C));
        cpu->gather_rows(cpu, d.p(), table.p(), tok.p(), N, C);
        check_elem(what, c, d, 0, 0);
    }
}

void test_rmsnorm(nl_backend *cpu)
{
    const int shapes[][2] = {{1, 1}, {4, 37}, {2, 1000}, {3, 4096}, {1, 33}, {2, 513}, {5, 2049}};
    for (auto &sh : shapes) {
        const int N = sh[0], C = sh[1];
        char what[96];
        buf x((size_t)N * C), w(C);
        x.fill(3);
        w.fill(1);
        buf a((size_t)N * C), b((size_t)N * C), ra(N), rb(N);
        snprintf(what, sizeof what, "rmsnorm N %d C %d", N, C);
        check_rc(what, nl_cuda_rmsnorm_forward(nullptr, a.p(), ra.p(), x.p(), w.p(), N, C, 1e-5f));
        cpu->rmsnorm_forward(cpu, b.p(), rb.p(), x.p(), w.p(), N, C, 1e-5f);
        check_elem(what, a, b, 1e-5, 0);
        snprintf(what, sizeof what, "rmsnorm rstd N %d C %d", N, C);
        check_elem(what, ra, rb, 1e-5, 0);

        /* in place, rstd NULL */
        buf xi = x;
        snprintf(what, sizeof what, "rmsnorm in place, rstd NULL, N %d C %d", N, C);
        check_rc(what,
                 nl_cuda_rmsnorm_forward(nullptr, xi.p(), nullptr, xi.p(), w.p(), N, C, 1e-5f));
        check_elem(what, xi, b, 1e-5, 0);
    }
}

void test_rope(nl_backend *cpu)
{
    /* N, heads, hd, col0, columns after the heads */
    const int shapes[][5] = {{1, 1, 2, 0, 0},     {3, 2, 8, 5, 3},    {4, 4, 64, 0, 0},
                             {2, 3, 256, 7, 1},   {5, 1, 6, 2, 0},    {3, 2, 130, 1, 2},
                             {1, 1, 128, 64, 64}, {300, 2, 64, 0, 0}, {2, 2, 7, 1, 1}};
    for (auto &sh : shapes) {
        const int N = sh[0], heads = sh[1], hd = sh[2], col0 = sh[3];
        const int row = col0 + heads * hd + sh[4];
        char what[96];
        buf x((size_t)N * row);
        x.fill(2);
        ibuf pos(N);
        for (int n = 0; n < N; n++)
            pos.p()[n] = n * 40009 % 131072 + n;
        buf a = x, b = x;
        snprintf(what, sizeof what, "rope N %d heads %d hd %d col0 %d row %d", N, heads, hd, col0,
                 row);
        check_rc(what,
                 nl_cuda_rope_forward(nullptr, a.p(), pos.p(), N, row, col0, heads, hd, 10000.0f));
        cpu->rope_forward(cpu, b.p(), pos.p(), N, row, col0, heads, hd, 10000.0f);
        check_rows(what, a, b, (size_t)row, 1e-6);
        /* columns outside the heads are untouched */
        size_t moved = 0;
        for (int n = 0; n < N; n++)
            for (int c = 0; c < row; c++)
                if ((c < col0 || c >= col0 + heads * hd) &&
                    !same_float(a[(size_t)n * row + c], x[(size_t)n * row + c]))
                    moved++;
        CHECK(moved == 0, "%s: %zu columns outside the heads changed", what, moved);
    }
}

void test_softmax(nl_backend *cpu)
{
    const int shapes[][2] = {{1, 1}, {3, 37}, {2, 9000}, {1, 50000}, {4, 256}, {2, 257}, {1, 8193}};
    for (auto &sh : shapes) {
        const int N = sh[0], C = sh[1];
        char what[96];
        buf x((size_t)N * C);
        x.fill(20);
        if (C > 3) { /* some -inf entries, and with N > 2 a whole row of them */
            x[1] = -INFINITY;
            x[(size_t)C - 1] = -INFINITY;
            if (N > 2)
                for (int c = 0; c < C; c++)
                    x[(size_t)C + c] = -INFINITY;
        }
        if (N > 1) /* the last row far below 0: exp(x) alone would underflow */
            for (int c = 0; c < C; c++)
                x[(size_t)(N - 1) * C + c] -= 110.0f;
        buf a = x, b = x;
        snprintf(what, sizeof what, "softmax N %d C %d", N, C);
        check_rc(what, nl_cuda_softmax_forward(nullptr, a.p(), N, C));
        cpu->softmax_forward(cpu, b.p(), N, C);
        check_elem(what, a, b, 1e-5, 1e-30);
    }
}

/* One id of the sample kernel: the row alone (n = 1), its top-p weights
 * computed on every pass (no scratch). */
int32_t sample_alone(const nl_sample_row &row, int V)
{
    int32_t id = -2;
    check_rc("sample_rows (alone)", nl_cuda_sample_rows(nullptr, &id, &row, 1, V, nullptr, 0));
    return id;
}

/* The sample kernel (the sample_rows slot's) against the CPU backend's
 * slot (elem.h's sequential rule): the same id, for greedy (with tied
 * maxima and NaN), temperature and top-p sampling (nuclei of one token to
 * most of them) across chunk edges and a 50,000-id vocabulary; every row of a call the id it gives alone, in
 * calls of one row, of 25 rows of one vocabulary's draws, and of 150 rows
 * of their own logits (three launches of NL_CUDA_SAMPLE_LAUNCH_ROWS),
 * mixed greedy and seeded temperatures, with a V no multiple of the
 * block's 256 threads. */
void test_sample(nl_backend *cpu)
{
    const int vocabs[] = {1, 255, 256, 257, 1000, 50000, 131073}; /* the last: 4 points a pass */
    const float temps[] = {0.0f, 0.05f, 0.7f, 1.3f, 20.0f};
    const double us[] = {0.0, 1e-9, 0.25, 0.5, 0.999999};
    const float top_ps[] = {0.05f, 0.5f, 0.95f};
    enum { NT = sizeof temps / sizeof *temps, NU = sizeof us / sizeof *us, NP = 12 };
    enum { NR = NT * NU + NP };
    int n = 0, bad = 0, apart = 0, past_chunk0 = 0, top_p_apart = 0;
    for (int V : vocabs) {
        buf l((size_t)V);
        /* its own stream: the other tests' inputs stay as they were */
        uint32_t r = 12345u + (uint32_t)V;
        for (int i = 0; i < V; i++) {
            r = r * 1664525u + 1013904223u;
            l[i] = 12.0f * ((float)(r >> 8) / 16777216.0f - 0.5f);
        }
        if (V > 300) { /* a tied maximum, and NaN before it (never sampled) */
            l[7] = 6.5f;
            l[V - 3] = 6.5f;
            l[3] = NAN;
        }
        nl_sample_row rows[NR];
        for (int t = 0; t < NT; t++)
            for (int u = 0; u < NU; u++)
                rows[t * NU + u] = nl_sample_row{l.p(), temps[t], 1.0f, us[u]};
        for (int i = 0; i < NP; i++) /* top-p: a nucleus of one token to most of them */
            rows[NT * NU + i] = nl_sample_row{l.p(), i % 2 ? 20.0f : 0.7f, top_ps[i / 4 % 3],
                                              us[1 + i % 4]};
        int32_t ids[NR + 1];
        ids[NR] = 77; /* past the call: untouched */
        buf ws((size_t)NR * V); /* the rows' top-p weights, stored once */
        check_rc("sample_rows",
                 nl_cuda_sample_rows(nullptr, ids, rows, NR, V, ws.p(), ws.n * sizeof(float)));
        CHECK(ws.intact(), "sample_rows V %d: written past its weights' scratch", V);
        CHECK(ids[NR] == 77, "sample_rows V %d: wrote past its %d ids", V, NR);
        for (int i = 0; i < NR; i++) {
            int32_t want = -1;
            cpu->sample_rows(cpu, &want, &rows[i], 1, V);
            n++;
            past_chunk0 += want >= NL_SAMPLE_CHUNK;
            if (i >= NT * NU) { /* the same draw over every token */
                nl_sample_row all = rows[i];
                all.top_p = 1.0f;
                int32_t wide = -1;
                cpu->sample_rows(cpu, &wide, &all, 1, V);
                top_p_apart += wide != want;
            }
            apart += sample_alone(rows[i], V) != ids[i];
            if (ids[i] != want) {
                bad++;
                fprintf(stderr, "sample V %d t %g top-p %g u %g: %d, the CPU %d\n", V,
                        rows[i].temperature, rows[i].top_p, rows[i].u, ids[i], want);
            }
        }
    }
    CHECK(bad == 0, "sample: %d of %d ids differ from the CPU's", bad, n);
    CHECK(apart == 0, "sample: %d of %d ids in a call of %d differ from the row alone", apart, n,
          NR);
    CHECK(past_chunk0 >= 10, "sample: only %d of %d ids past the first chunk", past_chunk0, n);
    CHECK(top_p_apart >= 3, "sample: top-p changed only %d of its rows' ids", top_p_apart);
    /* a weight that nvcc's fused multiply-adds round another way (nl_expf
     * without NL_MUL: 1.7% of exponents differ by an ulp): tau is a weight,
     * so top-p puts the nucleus's edge on it (the CPU draws 1; a kernel
     * whose exponential fuses draws 0) */
    {
        buf two(2);
        two[0] = 0.0f;
        two[1] = -0.0101345293f;
        const nl_sample_row edge = {two.p(), 1.0f, 0.502533615f, 0.9};
        int32_t want = -1;
        cpu->sample_rows(cpu, &want, &edge, 1, 2);
        CHECK(want == 1 && sample_alone(edge, 2) == want,
              "sample: a nucleus's edge on an exponential's last bit: %d, the CPU %d",
              sample_alone(edge, 2), want);
    }
    /* 150 rows, each its own logits (ties in some), across three launches */
    enum { R = 150, V = 300 };
    static_assert(R > 2 * NL_CUDA_SAMPLE_LAUNCH_ROWS, "three launches");
    buf l((size_t)R * V);
    uint64_t st = 99; /* its own stream, as above */
    for (size_t i = 0; i < (size_t)R * V; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        l[i] = 6.0f * ((float)(st >> 40) / 16777216.0f * 2.0f - 1.0f);
    }
    std::vector<nl_sample_row> rows(R);
    for (int i = 0; i < R; i++) {
        if (i % 7 == 0) /* a tied maximum: the lower id */
            l[(size_t)i * V + 11] = l[(size_t)i * V + 250] = 9.0f;
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        rows[i] = nl_sample_row{l.p() + (size_t)i * V, i % 3 == 0 ? 0.0f : 0.4f * (float)(i % 5 + 1),
                                i % 4 == 1 ? 0.8f : 1.0f, (double)(st >> 11) / 9007199254740992.0};
        if (rows[i].temperature == 0.0f)
            rows[i].u = 0.0;
    }
    std::vector<int32_t> ids(R + 1, 77);
    /* room for one launch's weights: its three launches reuse them */
    buf ws((size_t)NL_CUDA_SAMPLE_LAUNCH_ROWS * V);
    check_rc("sample_rows (150 rows)", nl_cuda_sample_rows(nullptr, ids.data(), rows.data(), R, V,
                                                           ws.p(), ws.n * sizeof(float)));
    CHECK(ws.intact(), "sample_rows (150 rows): written past its weights' scratch");
    int bad2 = 0, apart2 = 0;
    for (int i = 0; i < R; i++) {
        int32_t want = -1;
        cpu->sample_rows(cpu, &want, &rows[i], 1, V);
        bad2 += ids[i] != want;
        apart2 += sample_alone(rows[i], V) != ids[i];
    }
    CHECK(bad2 == 0 && apart2 == 0 && ids[R] == 77,
          "sample_rows of %d rows: %d ids differ from the CPU's, %d from each row alone", R, bad2,
          apart2);
    CHECK(ids[0] == 11 && ids[21] == 11, "sample_rows: a tied maximum gives %d and %d, not 11",
          ids[0], ids[21]);
    CHECK(l.intact(), "sample_rows: the logits' guards were written");
    buf all_nan(300);
    for (int i = 0; i < 300; i++)
        all_nan[i] = NAN;
    int32_t id = -1;
    nl_sample_row nan_row = {all_nan.p(), 0.0f, 1.0f, 0.0};
    check_rc("sample (NaN)", nl_cuda_sample_rows(nullptr, &id, &nan_row, 1, 300, nullptr, 0));
    CHECK(id == 0, "sample: every logit NaN gives %d, not 0", id);
    CHECK(nl_cuda_sample_rows(nullptr, &id, &nan_row, 1, 0, nullptr, 0) != 0, "sample: V 0 accepted");
    CHECK(nl_cuda_sample_rows(nullptr, &id, &nan_row, -1, 300, nullptr, 0) != 0, "sample: n -1 accepted");
    id = 5;
    CHECK(nl_cuda_sample_rows(nullptr, &id, &nan_row, 0, 300, nullptr, 0) == 0 && id == 5,
          "sample: 0 rows is nothing");
    nl_sample_row bad_rows[2] = {{all_nan.p(), 0.0f, 1.0f, 0.0}, {all_nan.p(), 1.0f, 1.0f, 1.0}};
    CHECK(nl_cuda_sample_rows(nullptr, &id, bad_rows, 2, 300, nullptr, 0) != 0, "sample: u 1 accepted");
    bad_rows[1] = nl_sample_row{all_nan.p(), 1.0f, 1.5f, 0.5};
    CHECK(nl_cuda_sample_rows(nullptr, &id, bad_rows, 2, 300, nullptr, 0) != 0, "sample: top-p 1.5 accepted");
    bad_rows[1] = nl_sample_row{all_nan.p(), -1.0f, 1.0f, 0.5};
    CHECK(nl_cuda_sample_rows(nullptr, &id, bad_rows, 2, 300, nullptr, 0) != 0,
          "sample: a temperature below 0 accepted");
    CHECK(id == 5, "sample: a refused call wrote an id");
}

void test_swiglu(nl_backend *cpu)
{
    const int shapes[][2] = {{1, 1}, {3, 37}, {2, 700}, {1, 257}};
    for (auto &sh : shapes) {
        const int N = sh[0], F = sh[1];
        char what[96];
        buf gu((size_t)N * 2 * F);
        gu.fill(8);
        buf a((size_t)N * F), b((size_t)N * F);
        snprintf(what, sizeof what, "swiglu N %d F %d", N, F);
        check_rc(what, nl_cuda_swiglu_forward(nullptr, a.p(), gu.p(), N, F));
        cpu->swiglu_forward(cpu, b.p(), gu.p(), N, F);
        check_elem(what, a, b, 1e-6, 0);
    }
}

void test_copy_rows(nl_backend *cpu)
{
    /* rows, cols, dst stride, src stride */
    const int shapes[][4] = {{1, 1, 1, 1}, {5, 33, 40, 50}, {3, 300, 300, 301},
                             {4, 7, 7, 9}, {1, 5, 0, 0},    {6, 257, 260, 257}};
    for (auto &sh : shapes) {
        const int rows = sh[0], cols = sh[1], ds = sh[2], ss = sh[3];
        const size_t dn = (size_t)(rows - 1) * ds + cols, sn = (size_t)(rows - 1) * ss + cols;
        char what[96];
        buf src(sn), a(dn, 9.0f), b(dn, 9.0f); /* the gaps between rows must stay 9 */
        src.fill(1);
        snprintf(what, sizeof what, "copy_rows %d x %d strides %d %d", rows, cols, ds, ss);
        check_rc(what, nl_cuda_copy_rows(nullptr, a.p(), ds, src.p(), ss, rows, cols));
        cpu->copy_rows(cpu, b.p(), ds, src.p(), ss, rows, cols);
        check_elem(what, a, b, 0, 0);
    }
}

/* The cache write at device positions against the CPU's, with rows of
 * qkv wider than the keys and values, and positions out of order. */
void test_kv_store(nl_backend *cpu)
{
    /* B, T, cap, kv_dim, stride (k at column 3, v after the keys) */
    const int shapes[][5] = {{1, 1, 4, 8, 20}, {3, 1, 9, 33, 80}, {2, 3, 7, 16, 40}};
    for (auto &sh : shapes) {
        const int B = sh[0], T = sh[1], cap = sh[2], kvd = sh[3], stride = sh[4];
        const int k_col = 3, v_col = 3 + kvd;
        std::vector<int32_t> pos((size_t)B * T);
        for (size_t i = 0; i < pos.size(); i++)
            pos[i] = (int32_t)((5 * i + 2) % (size_t)cap);
        buf qkv((size_t)B * T * stride), ka((size_t)B * cap * kvd, 9.0f), va(ka), kb(ka), vb(ka);
        qkv.fill(1);
        char what[96];
        snprintf(what, sizeof what, "kv_store B %d T %d cap %d kv_dim %d", B, T, cap, kvd);
        check_rc(what, nl_cuda_kv_store(nullptr, ka.p(), va.p(), qkv.p(), stride, k_col, v_col,
                                        pos.data(), B, T, cap, kvd));
        cpu->kv_store(cpu, kb.p(), vb.p(), qkv.p(), stride, k_col, v_col, pos.data(), B, T, cap,
                      kvd);
        check_elem(what, ka, kb, 0, 0);
        check_elem(what, va, vb, 0, 0);
        /* each sequence in a cache of its own (kv_store_seq), in reverse
         * order in memory: the same rows; and in bf16, kv_store_bf16's bits */
        for (int bf16 = 0; bf16 < 2; bf16++) {
            const size_t per = (size_t)cap * kvd;
            std::vector<std::vector<float>> ko(B, std::vector<float>(per, 9.0f)), vo(ko);
            std::vector<std::vector<uint16_t>> k16(B, std::vector<uint16_t>(per, 7)), v16(k16);
            std::vector<void *> kseq(B), vseq(B);
            for (int b = 0; b < B; b++) {
                kseq[b] = bf16 ? (void *)k16[B - 1 - b].data() : (void *)ko[B - 1 - b].data();
                vseq[b] = bf16 ? (void *)v16[B - 1 - b].data() : (void *)vo[B - 1 - b].data();
            }
            check_rc(what, nl_cuda_kv_store_seq(nullptr, kseq.data(), vseq.data(), bf16, qkv.p(),
                                                stride, k_col, v_col, pos.data(), B, T, kvd));
            std::vector<uint16_t> kr((size_t)B * per, 7), vr(kr);
            if (bf16)
                check_rc(what, nl_cuda_kv_store_bf16(nullptr, kr.data(), vr.data(), qkv.p(), stride,
                                                     k_col, v_col, pos.data(), 0, B, T, cap, kvd));
            bool same = true;
            for (int b = 0; b < B; b++)
                for (size_t i = 0; i < per; i++) {
                    const size_t at = (size_t)b * per + i;
                    if (bf16)
                        same &= k16[B - 1 - b][i] == kr[at] && v16[B - 1 - b][i] == vr[at];
                    else
                        same &= memcmp(&ko[B - 1 - b][i], &kb[at], sizeof(float)) == 0 &&
                                memcmp(&vo[B - 1 - b][i], &vb[at], sizeof(float)) == 0;
                }
            CHECK(same, "%s: the sequences' own caches (%s): other rows", what,
                  bf16 ? "bf16" : "FP32");
        }
    }
    int32_t p0 = 0;
    float f[4] = {0};
    CHECK(nl_cuda_kv_store_seq(nullptr, nullptr, nullptr, 0, f, 4, 0, 0, &p0, 1, 1, 1) ==
              cudaErrorInvalidValue,
          "kv_store_seq without the caches' arrays accepted");
}

void test_moe_combine(nl_backend *cpu)
{
    const int shapes[][3] = {{1, 1, 1}, {6, 2, 37}, {3, 4, 300}, {5, 3, 1}, {2, 4, 513}};
    for (auto &sh : shapes) {
        const int N = sh[0], k = sh[1], C = sh[2], S = N * k;
        char what[96];
        buf y((size_t)S * C), w(S), x((size_t)N * C);
        y.fill(2);
        w.fill(1);
        x.fill(2);
        ibuf slot(S);
        for (int i = 0; i < S; i++)
            slot.p()[i] = (i * 7 + 3) % S;
        buf a = x, b = x;
        snprintf(what, sizeof what, "moe_combine N %d k %d C %d", N, k, C);
        check_rc(what, nl_cuda_moe_combine(nullptr, a.p(), y.p(), slot.p(), w.p(), N, k, C));
        cpu->moe_combine(cpu, b.p(), y.p(), slot.p(), w.p(), N, k, C);
        check_rows(what, a, b, (size_t)C, 1e-6);
    }
}

/* The GEMM's K == 0 case: the CPU's gemm with K = 0 is the reference. */
void test_scale_rows(nl_backend *cpu)
{
    const float betas[] = {0.0f, 0.5f, 1.0f};
    const int shapes[][3] = {{1, 1, 1}, {3, 5, 7}, {4, 300, 301}};
    for (auto &sh : shapes)
        for (float beta : betas) {
            const int M = sh[0], N = sh[1], ldc = sh[2];
            const size_t n = (size_t)(M - 1) * ldc + N;
            char what[96];
            buf c(n);
            c.fill(3);
            c[0] = NAN; /* beta == 0 clears it */
            buf a = c, b = c;
            snprintf(what, sizeof what, "scale_rows %d x %d ldc %d beta %g", M, N, ldc, beta);
            check_rc(what, nl_cuda_scale_rows(nullptr, a.p(), ldc, M, N, beta));
            cpu->gemm(cpu, 0, 0, M, N, 0, 1.0f, nullptr, 1, nullptr, 1, beta, b.p(), ldc);
            check_elem(what, a, b, 0, 0);
        }
}

/* Empty shapes launch nothing and succeed; bad ones launch nothing and
 * return cudaErrorInvalidValue. */
void test_launchers(void)
{
    float f[4] = {0, 0, 0, 0};
    int32_t i[4] = {0, 0, 0, 0};
    const long before = emu_launch_count();
    CHECK(nl_cuda_embedding_forward(nullptr, f, i, f, 0, 4) == 0, "embedding N 0");
    CHECK(nl_cuda_rmsnorm_forward(nullptr, f, f, f, f, 2, 0, 1e-5f) == 0, "rmsnorm C 0");
    CHECK(nl_cuda_rope_forward(nullptr, f, i, 2, 4, 0, 0, 2, 1e4f) == 0, "rope heads 0");
    CHECK(nl_cuda_rope_forward(nullptr, f, i, 2, 4, 0, 1, 1, 1e4f) == 0, "rope hd 1");
    CHECK(nl_cuda_softmax_forward(nullptr, f, 0, 4) == 0, "softmax N 0");
    CHECK(nl_cuda_swiglu_forward(nullptr, f, f, 1, 0) == 0, "swiglu F 0");
    CHECK(nl_cuda_gather_rows(nullptr, f, f, i, 0, 4) == 0, "gather n 0");
    CHECK(nl_cuda_copy_rows(nullptr, f, 1, f, 1, 0, 1) == 0, "copy_rows rows 0");
    CHECK(nl_cuda_moe_combine(nullptr, f, f, i, f, 1, 0, 4) == 0, "moe_combine k 0");
    CHECK(nl_cuda_scale_rows(nullptr, f, 1, 1, 0, 0.0f) == 0, "scale_rows cols 0");
    nl_attn_shape s = {0, 1, 0, 1, 1, 1, 4, nullptr, 0, nullptr, nullptr};
    CHECK(nl_cuda_attention_forward(nullptr, f, f, f, 4, f, f, 4, s) == 0, "attention B 0");
    CHECK(emu_launch_count() == before, "an empty shape launched %ld kernels",
          emu_launch_count() - before);

    CHECK(nl_cuda_rope_forward(nullptr, f, i, 1, 600, 0, 1, NL_BACKEND_MAX_HEAD_DIM + 2, 1e4f) ==
              cudaErrorInvalidValue,
          "rope hd past the maximum");
    CHECK(nl_cuda_copy_rows(nullptr, f, -1, f, 1, 1, 1) == cudaErrorInvalidValue,
          "copy_rows negative stride");
    CHECK(nl_cuda_scale_rows(nullptr, f, -1, 1, 1, 1.0f) == cudaErrorInvalidValue,
          "scale_rows negative ldc");
    const nl_attn_shape bad[] = {
        {1, 1, 0, 1, 1, 1, 0, nullptr, 0, nullptr, nullptr},   /* hd 0 */
        {1, 1, 0, 1, 1, 1, 257, nullptr, 0, nullptr, nullptr}, /* hd past the maximum */
        {1, 1, 0, 1, 2, 0, 4, nullptr, 0, nullptr, nullptr},   /* G 0 */
        {1, 1, 0, 1, 3, 2, 4, nullptr, 0, nullptr, nullptr},   /* H % G != 0 */
        {1, 2, 3, 4, 1, 1, 4, nullptr, 0, nullptr, nullptr},   /* kv_cap < past + T */
        {1, 1, -1, 1, 1, 1, 4, nullptr, 0, nullptr, nullptr},  /* past < 0 */
    };
    for (const nl_attn_shape &b : bad)
        CHECK(nl_cuda_attention_forward(nullptr, f, f, f, 4, f, f, 4, b) == cudaErrorInvalidValue,
              "attention shape B %d T %d past %d cap %d H %d G %d hd %d accepted", b.B, b.T, b.past,
              b.kv_cap, b.H, b.G, b.hd);
    s = {1, 1, 0, 1, 1, 1, 4, nullptr, 0, nullptr, nullptr};
    CHECK(nl_cuda_attention_forward(nullptr, f, f, f, 3, f, f, 4, s) == cudaErrorInvalidValue,
          "attention q_stride < H hd accepted");
    CHECK(nl_cuda_attention_forward(nullptr, f, f, f, 4, f, f, 3, s) == cudaErrorInvalidValue,
          "attention kv_stride < G hd accepted");
    CHECK(nl_cuda_attention_forward(nullptr, nullptr, f, f, 4, f, f, 4, s) == cudaErrorInvalidValue,
          "attention NULL out accepted");
    CHECK(emu_launch_count() == before, "a rejected shape launched a kernel");
}

/* The backward launchers: empty shapes launch nothing, negative sizes and
 * a scratch under the minimum are refused. */
void test_backward_launchers(void)
{
    float f[4] = {0, 0, 0, 0};
    int32_t i[4] = {0, 0, 0, 0};
    double d = 5.0;
    std::vector<char> sc(NL_CUDA_BWD_SCRATCH_MIN);
    const size_t sb = sc.size(), small = sb - 1;
    const long before = emu_launch_count();
    CHECK(nl_cuda_embedding_backward(nullptr, f, f, i, 0, 4, sc.data(), sb) == 0, "emb N 0");
    CHECK(nl_cuda_embedding_backward(nullptr, f, f, i, 2, 0, sc.data(), sb) == 0, "emb C 0");
    CHECK(nl_cuda_rmsnorm_backward(nullptr, f, f, f, f, f, f, 0, 4, sc.data(), sb) == 0,
          "rmsnorm_backward N 0");
    CHECK(nl_cuda_swiglu_backward(nullptr, f, f, f, 1, 0) == 0, "swiglu_backward F 0");
    CHECK(nl_cuda_moe_combine_backward(nullptr, f, f, f, f, i, f, 1, 0, 4) == 0, "moe_bwd k 0");
    CHECK(nl_cuda_cross_entropy(nullptr, f, f, i, 0, 4, 1.0f) == 0, "cross_entropy N 0");
    CHECK(nl_cuda_sumsq(nullptr, &d, f, 0, sc.data(), sb) == 0 && d == 5.0, "sumsq n 0");
    CHECK(nl_cuda_adamw(nullptr, f, f, f, f, 0, 1, 0.9f, 0.9f, 1, 0, 1, 1, 1) == 0, "adamw n 0");
    CHECK(emu_launch_count() == before, "an empty backward shape launched %ld kernels",
          emu_launch_count() - before);

    const int bad = cudaErrorInvalidValue;
    CHECK(nl_cuda_embedding_backward(nullptr, f, f, i, 2, 2, sc.data(), small) == bad,
          "embedding_backward scratch under the minimum");
    CHECK(nl_cuda_embedding_backward(nullptr, f, f, i, -1, 2, sc.data(), sb) == bad, "emb N < 0");
    CHECK(nl_cuda_rmsnorm_backward(nullptr, f, f, f, f, f, f, 2, 2, sc.data(), small) == bad,
          "rmsnorm_backward scratch under the minimum");
    CHECK(nl_cuda_rmsnorm_backward(nullptr, f, f, f, f, f, f, 2, -2, sc.data(), sb) == bad,
          "rmsnorm_backward C < 0");
    CHECK(nl_cuda_sumsq(nullptr, &d, f, 4, sc.data(), small) == bad, "sumsq small scratch");
    CHECK(nl_cuda_swiglu_backward(nullptr, f, f, f, -1, 2) == bad, "swiglu_backward N < 0");
    CHECK(nl_cuda_moe_combine_backward(nullptr, f, f, f, f, i, f, 1, -1, 4) == bad, "moe k < 0");
    CHECK(nl_cuda_cross_entropy(nullptr, f, f, i, 1, -4, 1.0f) == bad, "cross_entropy V < 0");
    CHECK(emu_launch_count() == before, "a rejected backward shape launched a kernel");
}

/* ---------------------------------------------------------------- attention */

struct attn_case {
    int B, T, past, extra_cap, H, G, hd, qpad, kvpad, lse;
    float amp; /* scale of q and k: larger gives peakier softmax rows */
};

void run_attention(nl_backend *cpu, const attn_case &c)
{
    nl_attn_shape s = {c.B, c.T, c.past, c.past + c.T + c.extra_cap, c.H, c.G, c.hd, nullptr, 0, nullptr, nullptr};
    const int qs = c.H * c.hd + c.qpad, ks = c.G * c.hd + c.kvpad;
    const size_t nq = (size_t)c.B * c.T * qs, nk = (size_t)c.B * s.kv_cap * ks;
    const size_t no = (size_t)c.B * c.T * c.H * c.hd, nl = (size_t)c.B * c.H * c.T;
    buf q(nq), k(nk), v(nk);
    /* NaN in the padding columns and in the cache rows past past + T: a
     * kernel that reads them poisons its output */
    for (size_t i = 0; i < nq; i++)
        q[i] = (int)(i % qs) < c.H * c.hd ? c.amp * frand() : NAN;
    for (size_t i = 0; i < nk; i++) {
        const bool live = (int)(i / ks % s.kv_cap) < c.past + c.T && (int)(i % ks) < c.G * c.hd;
        k[i] = live ? c.amp * frand() : NAN;
        v[i] = live ? frand() : NAN;
    }
    buf o1(no), o2(no), l1(nl), l2(nl);
    char what[160];
    snprintf(what, sizeof what,
             "attention B %d T %d past %d cap %d H %d G %d hd %d q_stride %d kv_stride %d lse %s",
             c.B, c.T, c.past, s.kv_cap, c.H, c.G, c.hd, qs, ks, c.lse ? "yes" : "NULL");
    cpu->attention_forward(cpu, o1.p(), l1.p(), q.p(), qs, k.p(), v.p(), ks, s);
    check_rc(what, nl_cuda_attention_forward(nullptr, o2.p(), c.lse ? l2.p() : nullptr, q.p(), qs,
                                             k.p(), v.p(), ks, s));
    double omax = 0, emax = 0;
    size_t bad = 0;
    for (size_t i = 0; i < no; i++)
        omax = fmax(omax, fabs((double)o1[i]));
    for (size_t i = 0; i < no; i++) {
        const double e = fabs((double)o2[i] - o1[i]);
        if (!(e <= 1e-5 * omax))
            bad++;
        if (!(e <= emax))
            emax = e;
    }
    report(what, emax / (1e-5 * omax));
    CHECK(bad == 0 && omax > 0, "%s: %zu of %zu outputs off, max error %.3g of max |out| %.3g",
          what, bad, no, emax, omax);
    CHECK(o2.intact(), "%s: a write past out", what);
    /* the past read on the device (a recorded decode step): pos[b T] */
    std::vector<int32_t> pos((size_t)c.B * c.T);
    for (size_t i = 0; i < pos.size(); i++)
        pos[i] = c.past + (int)(i % c.T);
    nl_attn_shape sd = s;
    sd.past = 0;
    sd.pos = pos.data();
    buf o3(no);
    check_rc(what, nl_cuda_attention_forward(nullptr, o3.p(), nullptr, q.p(), qs, k.p(), v.p(), ks,
                                             sd));
    CHECK(memcmp(o3.p(), o2.p(), no * sizeof(float)) == 0 && o3.intact(),
          "%s: with the past read from pos, other outputs", what);
    /* each sequence in a cache of its own (s.kseq / s.vseq: a batch's
     * sessions), in reverse order in memory, the shared cache NaN: the
     * same bits, with the past given and read from pos */
    {
        const size_t per = (size_t)s.kv_cap * ks;
        std::vector<buf> kown, vown;
        std::vector<const void *> kseq(c.B), vseq(c.B);
        kown.reserve(c.B);
        vown.reserve(c.B);
        for (int b = 0; b < c.B; b++) {
            kown.emplace_back(per);
            vown.emplace_back(per);
        }
        for (int b = 0; b < c.B; b++) {
            buf &kb = kown[c.B - 1 - b], &vb = vown[c.B - 1 - b];
            memcpy(kb.p(), k.p() + b * per, per * sizeof(float));
            memcpy(vb.p(), v.p() + b * per, per * sizeof(float));
            kseq[b] = kb.p();
            vseq[b] = vb.p();
        }
        buf nan_k(per), nan_v(per); /* NaN: the shared cache is not read */
        for (int dev = 0; dev < 2; dev++) {
            nl_attn_shape so = dev ? sd : s;
            so.kseq = kseq.data();
            so.vseq = vseq.data();
            buf o4(no);
            check_rc(what, nl_cuda_attention_forward(nullptr, o4.p(), nullptr, q.p(), qs, nan_k.p(),
                                                     nan_v.p(), ks, so));
            CHECK(memcmp(o4.p(), o2.p(), no * sizeof(float)) == 0 && o4.intact(),
                  "%s: the sequences' own caches (past %s), other outputs", what,
                  dev ? "from pos" : "given");
        }
        nl_attn_shape half = s;
        half.kseq = kseq.data();
        CHECK(nl_cuda_attention_forward(nullptr, o3.p(), nullptr, q.p(), qs, k.p(), v.p(), ks,
                                        half) == cudaErrorInvalidValue,
              "%s: kseq without vseq accepted", what);
    }
    if (c.lse) {
        size_t lbad = 0;
        double lfrac = 0;
        for (size_t i = 0; i < nl; i++) {
            const double e = fabs((double)l2[i] - l1[i]) / (1e-5 * fmax(1.0, fabs((double)l1[i])));
            if (!(e <= 1))
                lbad++;
            lfrac = fmax(lfrac, e);
        }
        report("  lse", lfrac);
        CHECK(lbad == 0, "%s: %zu of %zu lse values off", what, lbad, nl);
        CHECK(l2.intact(), "%s: a write past lse", what);
    }
}

void test_attention(nl_backend *cpu)
{
    const int hds[] = {16, 64, 128, 37, 256, 1};
    for (int hd : hds) {
        const attn_case cases[] = {
            /* B  T  past cap+ H  G  hd  qpad kvpad lse amp */
            {1, 1, 0, 0, 1, 1, hd, 0, 0, 1, 1},   /* one key */
            {2, 1, 37, 3, 4, 1, hd, 1, 2, 1, 3},  /* decode, H/G 4, padded */
            {1, 3, 70, 0, 2, 2, hd, 0, 0, 1, 3},  /* decode T 3, H/G 1 */
            {1, 4, 0, 1, 2, 1, hd, 0, 0, 0, 3},   /* decode path at past 0, lse NULL */
            {1, 5, 0, 0, 2, 2, hd, 0, 0, 1, 3},   /* the smallest prefill */
            {2, 17, 0, 2, 4, 1, hd, 3, 0, 1, 3},  /* one past a query tile, H/G 4 */
            {1, 33, 45, 0, 2, 1, hd, 0, 1, 0, 2}, /* prefill over a past, lse NULL */
        };
        for (const attn_case &c : cases)
            run_attention(cpu, c);
    }
    const attn_case more[] = {
        {1, 1, 3000, 5, 4, 1, 128, 4, 4, 1, 1}, /* one token over a long cache */
        {1, 2, 1000, 0, 4, 4, 64, 0, 2, 1, 2},  /* decode, H/G 1 */
        {1, 70, 300, 9, 4, 1, 64, 2, 6, 1, 2},  /* prefill, several key tiles */
        {1, 40, 100, 0, 2, 2, 128, 0, 0, 1, 4}, /* peaky rows */
        {1, 24, 33, 0, 4, 1, 256, 8, 0, 1, 1},  /* the 256 bucket, three query tiles */
        {2, 9, 31, 1, 4, 2, 100, 1, 3, 1, 3},   /* odd hd in the 128 bucket */
        {3, 4, 2000, 2, 8, 2, 64, 0, 0, 1, 2},  /* decode T 4 over a long cache, B 3 */
        {1, 3, 500, 0, 4, 1, 256, 0, 4, 1, 2},  /* decode in the 256 bucket */
        {1, 1, 255, 0, 2, 1, 37, 1, 1, 0, 2},   /* 256 keys: every decode warp busy */
        {1, 96, 1000, 0, 2, 1, 64, 0, 0, 1, 2}, /* prefill over a long cache */
    };
    for (const attn_case &c : more)
        run_attention(cpu, c);
}

/* ---------------------------------------------------------------- backward */

/* The backend's reduction scratch (NL_CUDA_BWD_SCRATCH_BYTES) between NaN
 * guards, made once; a kernel that writes past it is caught. */
buf &scratch(void)
{
    static buf s(NL_CUDA_BWD_SCRATCH_BYTES / sizeof(float));
    return s;
}

/* Tokens may repeat, and do: V rows for N tokens. The results must be the
 * CPU's bits (same order of additions), with the whole scratch and with
 * the least one (the rows then go in pieces), and the rows of dtable no
 * token names must stay as they were. */
void test_embedding_backward(nl_backend *cpu)
{
    /* N, C, V, rows per piece in the small-scratch run's terms */
    const int shapes[][3] = {{1, 1, 1},      {1, 5, 3},   {7, 1, 2},    {37, 33, 5},
                             {300, 257, 40}, {64, 70, 1}, {5000, 2, 50}};
    for (auto &sh : shapes) {
        const int N = sh[0], C = sh[1], V = sh[2];
        char what[96];
        buf table((size_t)V * C), dout((size_t)N * C);
        table.fill(1);
        dout.fill(1);
        ibuf tok(N);
        for (int n = 0; n < N; n++) /* runs and repeats, the last row unused */
            tok.p()[n] = n % 3 == 1 ? tok.p()[n - 1] : irand(V > 1 ? V - 1 : 1);
        buf ref = table;
        cpu->embedding_backward(cpu, ref.p(), dout.p(), tok.p(), N, C);
        buf a = table;
        snprintf(what, sizeof what, "embedding_backward N %d C %d V %d", N, C, V);
        check_rc(what, nl_cuda_embedding_backward(nullptr, a.p(), dout.p(), tok.p(), N, C,
                                                  scratch().p(), NL_CUDA_BWD_SCRATCH_BYTES));
        check_same(what, a, ref);
        CHECK(scratch().intact(), "%s: a write past the scratch", what);
        if (N > 300) {
            buf b = table;
            snprintf(what, sizeof what, "embedding_backward N %d C %d V %d, scratch %zu", N, C, V,
                     NL_CUDA_BWD_SCRATCH_MIN);
            check_rc(what, nl_cuda_embedding_backward(nullptr, b.p(), dout.p(), tok.p(), N, C,
                                                      scratch().p(), NL_CUDA_BWD_SCRATCH_MIN));
            check_same(what, b, ref);
        }
    }
}

void test_rmsnorm_backward(nl_backend *cpu)
{
    const int shapes[][2] = {{1, 1}, {1, 7}, {5, 1}, {4, 37}, {33, 513}, {70, 300}, {3, 4096}};
    for (auto &sh : shapes) {
        const int N = sh[0], C = sh[1];
        const size_t n = (size_t)N * C;
        char what[96];
        buf x(n), w(C), out(n), rstd(N), dout(n), dx0(n), dw0(C);
        x.fill(2);
        w.fill(1);
        dout.fill(1);
        dx0.fill(1);
        dw0.fill(1);
        cpu->rmsnorm_forward(cpu, out.p(), rstd.p(), x.p(), w.p(), N, C, 1e-6f);
        buf rdx = dx0, rdw = dw0;
        cpu->rmsnorm_backward(cpu, rdx.p(), rdw.p(), dout.p(), x.p(), w.p(), rstd.p(), N, C);
        buf adx = dx0, adw = dw0;
        snprintf(what, sizeof what, "rmsnorm_backward dinp N %d C %d", N, C);
        check_rc(what, nl_cuda_rmsnorm_backward(nullptr, adx.p(), adw.p(), dout.p(), x.p(), w.p(),
                                                rstd.p(), N, C, scratch().p(),
                                                NL_CUDA_BWD_SCRATCH_BYTES));
        /* the terms of each element, for the tolerance */
        std::vector<double> cdx(n), cdw(C);
        for (int c = 0; c < C; c++)
            cdw[c] = fabs((double)dw0[c]);
        for (int r = 0; r < N; r++) {
            const double rs = rstd[r];
            double dot = 0;
            for (int c = 0; c < C; c++) {
                const size_t i = (size_t)r * C + c;
                dot += fabs((double)w[c] * dout[i] * x[i]);
                cdw[c] += fabs((double)dout[i] * x[i] * rs);
            }
            for (int c = 0; c < C; c++) {
                const size_t i = (size_t)r * C + c;
                cdx[i] = fabs((double)dx0[i]) + fabs((double)w[c] * dout[i] * rs) +
                         fabs((double)x[i]) * rs * rs * rs / C * dot;
            }
        }
        check_cond(what, adx, rdx, cdx, 1e-5);
        snprintf(what, sizeof what, "rmsnorm_backward dw N %d C %d", N, C);
        check_cond(what, adw, rdw, cdw, 1e-5);
        CHECK(scratch().intact(), "%s: a write past the scratch", what);
        /* the least scratch: dw in column pieces, the same bits */
        buf bdx = dx0, bdw = dw0;
        snprintf(what, sizeof what, "rmsnorm_backward N %d C %d, scratch %zu", N, C,
                 NL_CUDA_BWD_SCRATCH_MIN);
        check_rc(what,
                 nl_cuda_rmsnorm_backward(nullptr, bdx.p(), bdw.p(), dout.p(), x.p(), w.p(),
                                          rstd.p(), N, C, scratch().p(), NL_CUDA_BWD_SCRATCH_MIN));
        check_same(what, bdw, adw);
    }
}

void test_swiglu_backward(nl_backend *cpu)
{
    const int shapes[][2] = {{1, 1}, {3, 37}, {2, 700}, {1, 257}};
    for (auto &sh : shapes) {
        const int N = sh[0], F = sh[1];
        char what[96];
        buf gu((size_t)N * 2 * F), dh((size_t)N * F);
        gu.fill(8);
        dh.fill(1);
        buf a((size_t)N * 2 * F), b((size_t)N * 2 * F); /* NaN: every element is written */
        snprintf(what, sizeof what, "swiglu_backward N %d F %d", N, F);
        check_rc(what, nl_cuda_swiglu_backward(nullptr, a.p(), dh.p(), gu.p(), N, F));
        cpu->swiglu_backward(cpu, b.p(), dh.p(), gu.p(), N, F);
        /* dg = dh u sig (1 + g (1 - sig)) cancels near g = -1.28: judge it
         * by its terms; du = dh silu(g) is a product */
        std::vector<double> cond((size_t)N * 2 * F);
        for (int n = 0; n < N; n++)
            for (int j = 0; j < F; j++) {
                const size_t i = (size_t)n * 2 * F + j;
                const double g = gu[i], u = gu[i + F], d = dh[(size_t)n * F + j];
                const double sig = 1.0 / (1.0 + exp(-g));
                cond[i] = fabs(d * u * sig) * (1.0 + fabs(g * (1.0 - sig)));
                cond[i + F] = fabs(d * g * sig);
            }
        check_cond(what, a, b, cond, 1e-6);
    }
}

void test_moe_combine_backward(nl_backend *cpu)
{
    const int shapes[][3] = {{1, 1, 1}, {6, 2, 37}, {3, 4, 300}, {5, 3, 1}, {2, 4, 513}};
    for (auto &sh : shapes) {
        const int N = sh[0], k = sh[1], C = sh[2], S = N * k;
        char what[96];
        buf y((size_t)S * C), w(S), dx((size_t)N * C);
        y.fill(2);
        w.fill(1);
        dx.fill(2);
        ibuf slot(S);
        for (int i = 0; i < S; i++)
            slot.p()[i] = (i * 7 + 3) % S;
        buf ady((size_t)S * C), bdy((size_t)S * C), adw(S), bdw(S);
        snprintf(what, sizeof what, "moe_combine_backward dy N %d k %d C %d", N, k, C);
        check_rc(what, nl_cuda_moe_combine_backward(nullptr, ady.p(), adw.p(), dx.p(), y.p(),
                                                    slot.p(), w.p(), N, k, C));
        cpu->moe_combine_backward(cpu, bdy.p(), bdw.p(), dx.p(), y.p(), slot.p(), w.p(), N, k, C);
        check_same(what, ady, bdy); /* one product each */
        std::vector<double> cond(S, 0.0);
        for (int e = 0; e < S; e++)
            for (int c = 0; c < C; c++)
                cond[e] +=
                    fabs((double)dx[(size_t)(e / k) * C + c] * y[(size_t)slot.p()[e] * C + c]);
        snprintf(what, sizeof what, "moe_combine_backward dw N %d k %d C %d", N, k, C);
        check_cond(what, adw, bdw, cond, 1e-5);
    }
}

/* Losses 1e-5 relative; gradients 1e-5 relative (an ignored target's row
 * exactly 0), at the target of its terms scale p and scale (near p = 1
 * the gradient scale (p - 1) cancels, and p itself is only known to an ulp or two). */
void test_cross_entropy(nl_backend *cpu)
{
    const int shapes[][2] = {{1, 1}, {3, 37}, {2, 50000}, {4, 257}, {1, 8193}, {5, 2}};
    for (auto &sh : shapes) {
        const int N = sh[0], V = sh[1];
        const float scale = 1.0f / (float)N;
        char what[96];
        buf x((size_t)N * V);
        x.fill(6);
        ibuf tgt(N);
        for (int n = 0; n < N; n++)
            tgt.p()[n] = n == 0 ? V - 1 : irand(V);
        if (N > 2) /* a row sure of its target, one sure of another */
            x[(size_t)V + tgt.p()[1]] = 30.0f;
        if (N > 2)
            x[(size_t)2 * V + (tgt.p()[2] + 1) % V] = 30.0f;
        if (N == 4) /* an ignored target: loss 0, gradient row 0 */
            tgt.p()[3] = -1;
        buf a = x, b = x, la(N), lb(N);
        snprintf(what, sizeof what, "cross_entropy grad N %d V %d", N, V);
        check_rc(what, nl_cuda_cross_entropy(nullptr, a.p(), la.p(), tgt.p(), N, V, scale));
        cpu->cross_entropy(cpu, b.p(), lb.p(), tgt.p(), N, V, scale);
        std::vector<double> cond((size_t)N * V);
        for (int n = 0; n < N; n++)
            for (int i = 0; i < V; i++) {
                const size_t e = (size_t)n * V + i;
                cond[e] = i == tgt.p()[n] ? fabs((double)b[e] + scale) + scale : fabs((double)b[e]);
            }
        check_cond(what, a, b, cond, 1e-5);
        snprintf(what, sizeof what, "cross_entropy loss N %d V %d", N, V);
        check_elem(what, la, lb, 1e-5, 0);
    }
}

/* Relative 1e-9 of a double sum in index order, and of the CPU's; any
 * infinity gives +inf, any NaN gives NaN. */
void test_sumsq(nl_backend *cpu)
{
    double *out = (double *)scratch().p(); /* the backend's layout: result first */
    void *sc = scratch().p() + 64;
    const size_t sb = NL_CUDA_BWD_SCRATCH_BYTES - 64 * sizeof(float);
    /* n, bad (0 finite, 1 infinities, 2 a NaN and an infinity); 262149
     * elements make more than the most partials, so threads stride */
    const struct {
        size_t n;
        int bad;
    } cases[] = {{1, 0}, {7, 0}, {1000, 0}, {1000, 1}, {1000, 2}, {70001, 2}, {262149, 0}};
    for (const auto &cs : cases) {
        const size_t n = cs.n;
        const int bad = cs.bad;
        char what[96];
        buf x(n);
        x.fill(3);
        if (bad == 1) {
            x[n / 3] = INFINITY;
            x[n - 1] = -INFINITY;
        } else if (bad == 2) {
            x[n / 2] = NAN;
            x[n / 5] = INFINITY;
        }
        double ref = 0;
        for (size_t i = 0; i < n; i++)
            ref += (double)x[i] * x[i];
        *out = -1.0;
        snprintf(what, sizeof what, "sumsq n %zu %s", n,
                 bad == 0   ? "finite"
                 : bad == 1 ? "inf"
                            : "nan");
        check_rc(what, nl_cuda_sumsq(nullptr, out, x.p(), n, sc, sb));
        const double got = *out, cpu_sum = cpu->sumsq(cpu, x.p(), n);
        if (bad == 0) {
            report(what, fabs(got - ref) / (1e-9 * ref));
            CHECK(fabs(got - ref) <= 1e-9 * ref && fabs(got - cpu_sum) <= 1e-9 * cpu_sum,
                  "%s: %.17g, a double sum gives %.17g, the CPU %.17g", what, got, ref, cpu_sum);
        } else if (bad == 1) {
            CHECK(isinf(got) && got > 0 && isinf(cpu_sum), "%s: %g, the CPU %g", what, got,
                  cpu_sum);
        } else {
            CHECK(isnan(got) && isnan(cpu_sum), "%s: %g, the CPU %g", what, got, cpu_sum);
        }
    }
    CHECK(scratch().intact(), "sumsq: a write past the scratch");
}

/* Several steps, each with its own gradient, gradient scale and bias
 * corrections. Each step starts both sides from the CPU's state, so it is
 * judged alone: v (a sum of positive terms) element-wise, m and p by their
 * terms, b1 |m| + (1 - b1) |g'| and |p| + lr (that over bc1 (sqrt(v/bc2) +
 * eps) + wd |p|): nvcc fuses the multiply-adds the CPU rounds twice, which
 * differs where the terms cancel. */
void test_adamw(nl_backend *cpu)
{
    const size_t sizes[] = {1, 1000, 70001};
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    for (size_t n : sizes) {
        buf p(n), m(n), v(n);
        p.fill(0.1f);
        m.fill(0.1f);
        for (size_t i = 0; i < n; i++)
            v[i] = 0.01f * fabsf(frand());
        for (int t = 1; t <= 4; t++) {
            buf g(n);
            g.fill(t == 3 ? 100.0f : 1.0f);
            const float bc1 = 1.0f - powf(b1, (float)t), bc2 = 1.0f - powf(b2, (float)t);
            const float gs = t == 2 ? 0.25f : 1.0f;
            buf pa = p, ma = m, va = v;
            char what[96];
            snprintf(what, sizeof what, "adamw n %zu step %d", n, t);
            check_rc(what, nl_cuda_adamw(nullptr, pa.p(), g.p(), ma.p(), va.p(), n, lr, b1, b2, eps,
                                         wd, bc1, bc2, gs));
            std::vector<double> cm(n), cp(n);
            for (size_t i = 0; i < n; i++) {
                const double gi = (double)g[i] * gs;
                const double vi = b2 * (double)v[i] + (1.0 - b2) * gi * gi;
                cm[i] = b1 * fabs((double)m[i]) + (1.0 - b1) * fabs(gi);
                cp[i] = fabs((double)p[i]) +
                        lr * (cm[i] / bc1 / (sqrt(vi / bc2) + eps) + wd * fabs((double)p[i]));
            }
            cpu->adamw(cpu, p.p(), g.p(), m.p(), v.p(), n, lr, b1, b2, eps, wd, bc1, bc2, gs);
            check_cond(what, pa, p, cp, 1e-6);
            snprintf(what, sizeof what, "adamw m n %zu step %d", n, t);
            check_cond(what, ma, m, cm, 1e-6);
            snprintf(what, sizeof what, "adamw v n %zu step %d", n, t);
            check_elem(what, va, v, 1e-6, 0);
        }
    }
}

} // namespace

int main(void)
{
    nl_error err = {};
    nl_backend *cpu = nullptr;
    nl_backend_opts opts = {};
    opts.threads = 1;
    if (nl_backend_new(&cpu, "cpu", &opts, &err) != NL_OK) {
        fprintf(stderr, "test_cuda_emu: no CPU backend: %s\n", err.msg);
        return 1;
    }
    CHECK(nl_emu_selfcheck() == 0, "the emulator's own checks: see their failures above");
    test_launchers();
    test_embedding_gather(cpu);
    test_rmsnorm(cpu);
    test_rope(cpu);
    test_softmax(cpu);
    test_sample(cpu);
    test_swiglu(cpu);
    test_copy_rows(cpu);
    test_kv_store(cpu);
    test_moe_combine(cpu);
    test_scale_rows(cpu);
    test_attention(cpu);
    test_backward_launchers();
    test_embedding_backward(cpu);
    test_rmsnorm_backward(cpu);
    test_swiglu_backward(cpu);
    test_moe_combine_backward(cpu);
    test_cross_entropy(cpu);
    test_sumsq(cpu);
    test_adamw(cpu);
    CHECK(nl_emu_attention_backward_checks() == 0, "attention backward: see its failures above");
    CHECK(nl_emu_moe_checks() == 0, "routing: see its failures above");
    CHECK(nl_emu_family_checks() == 0, "model variants: see their failures above");
    CHECK(nl_emu_fused_checks() == 0, "fused decode: see its failures above");
    CHECK(nl_emu_kv_bf16_checks() == 0, "bf16 KV cache: see its failures above");
    CHECK(nl_emu_rows_checks() == 0, "row-invariant GEMM: see its failures above");
    nl_backend_destroy(&cpu);
    return check_done("test_cuda_emu");
}
