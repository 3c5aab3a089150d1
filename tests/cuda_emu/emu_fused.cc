/* int nl_emu_fused_checks(void); -- call from test_cuda_emu's main:
 *   CHECK(nl_emu_fused_checks() == 0, "fused decode: see its failures above");
 *
 * kernels/cuda/cuda_fused.cu (the fused decode slots: RMSNorm + router +
 * softmax + top-k; gate/up + SwiGLU; down projection + weighted combine +
 * residual) under the emulator (see cuda_runtime.h) against the CPU
 * backend's slots of the same name, whose arithmetic is the separate
 * slots'. One translation unit with its own CHECK counters (like
 * emu_moe.cc): returns how many of its checks failed.
 *
 * Shapes: one row, odd widths (d and F not multiples of a warp, d below
 * one), E = 1, 3, 8 and 256 (the most), k = 1 .. 4, 15 rows (the decode's
 * largest) and 40 (more than a decode's, still any N). Every output starts
 * as NaN, the scratch the kernels must not need stays NaN. Tolerances:
 * choices equal; xn and probs 1e-5 norm-wise per row (a reduction's other
 * order); hs and x 1e-5 norm-wise per row (dots in another order, FMA).
 * Rows computed alone give the bits of the rows computed together. */
#include "tests/cuda_emu/cuda_runtime.h"

#include "cuda_fused.cu.cc"

#include "tests/check.h"

extern "C" {
#include "kernels/backend.h"
}
#include "kernels/cuda/cuda_fused.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <vector>

namespace
{

uint64_t fz_rng = 0x2545f4914f6cdd1dull;

float fz_frand(void) /* uniform in [-1, 1) */
{
    fz_rng = fz_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((fz_rng >> 40) & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

std::vector<float> random_vec(size_t n, float amp)
{
    std::vector<float> v(n);
    for (float &x : v)
        x = amp * fz_frand();
    return v;
}

/* ||got - ref|| <= tol ||ref|| for each row of width w */
void close_rows(const char *what, const float *got, const float *ref, size_t rows, size_t w,
                double tol)
{
    size_t bad = 0, first = 0;
    double worst = 0;
    for (size_t r = 0; r < rows; r++) {
        double num = 0, den = 0;
        bool finite = true;
        for (size_t c = 0; c < w; c++) {
            const double a = got[r * w + c], b = ref[r * w + c];
            finite &= isfinite(a);
            num += (a - b) * (a - b);
            den += b * b;
        }
        const double e = sqrt(num) / (den > 0 ? sqrt(den) : 1.0);
        worst = e > worst ? e : worst;
        if ((!finite || !(e <= tol)) && bad++ == 0)
            first = r;
    }
    CHECK(bad == 0, "%s: %zu rows off, first row %zu, worst norm-wise error %.3g", what, bad, first,
          worst);
}

struct outs {
    std::vector<float> xn, probs, w, hs, x;
    std::vector<int32_t> choice;
};

/* The three fused ops over rows [n0, n0 + rows) of x. */
void run_fused(nl_backend *cpu, outs &o, const std::vector<float> &x, const std::vector<float> &nw,
               const std::vector<float> &router, const std::vector<float> &experts, int n0,
               int rows, int d, int E, int k, int F)
{
    const size_t stride = 3 * (size_t)F * d, nk = (size_t)rows * k;
    o.xn.assign((size_t)rows * d, NAN);
    o.probs.assign((size_t)rows * E, NAN);
    o.w.assign(nk, NAN);
    o.hs.assign(nk * F, NAN);
    o.choice.assign(nk, -7);
    o.x.assign(x.begin() + (size_t)n0 * d, x.begin() + (size_t)(n0 + rows) * d);
    std::vector<float> gu(nk * 2 * F, NAN), ye(nk * d, NAN);
    if (cpu) {
        cpu->moe_norm_route(cpu, o.xn.data(), o.probs.data(), o.choice.data(), o.w.data(),
                            o.x.data(), nw.data(), router.data(), rows, d, E, k, 1e-5f);
        cpu->moe_gate_up(cpu, o.hs.data(), gu.data(), o.xn.data(), o.choice.data(),
                         experts.data(), stride, rows, k, d, F);
        cpu->moe_down_combine(cpu, o.x.data(), ye.data(), o.hs.data(), o.choice.data(),
                              o.w.data(), experts.data(), stride, rows, k, d, F);
        return;
    }
    CHECK(nl_cuda_moe_norm_route(nullptr, o.xn.data(), o.probs.data(), o.choice.data(),
                                 o.w.data(), o.x.data(), nw.data(), router.data(), nullptr, 0,
                                 rows, d, E, k, 1e-5f) == 0,
          "moe_norm_route: launcher");
    CHECK(nl_cuda_moe_gate_up(nullptr, o.hs.data(), gu.data(), o.xn.data(), o.choice.data(),
                              experts.data(), nullptr, 0, stride, rows, k, d, F) == 0,
          "moe_gate_up: launcher");
    CHECK(nl_cuda_moe_down_combine(nullptr, o.x.data(), ye.data(), o.hs.data(), o.choice.data(),
                                   o.w.data(), experts.data(), nullptr, 0, stride, rows, k, d,
                                   F) == 0,
          "moe_down_combine: launcher");
    bool untouched = true; /* the scratch the kernels do not need */
    for (float v : gu)
        untouched &= v != v;
    for (float v : ye)
        untouched &= v != v;
    CHECK(untouched, "fused decode: the kernels wrote their unused scratch");
}

void fused_case(nl_backend *cpu, int N, int d, int E, int k, int F)
{
    char what[128];
    snprintf(what, sizeof what, "fused decode N %d d %d E %d k %d F %d", N, d, E, k, F);
    const std::vector<float> x = random_vec((size_t)N * d, 1.0f), nw = random_vec((size_t)d, 1.0f);
    const std::vector<float> router = random_vec((size_t)E * d, 1.0f);
    const std::vector<float> experts = random_vec((size_t)E * 3 * F * d, 0.1f);
    outs gpu, ref;
    run_fused(nullptr, gpu, x, nw, router, experts, 0, N, d, E, k, F);
    run_fused(cpu, ref, x, nw, router, experts, 0, N, d, E, k, F);
    CHECK(gpu.choice == ref.choice, "%s: choices differ", what);
    char sub[160];
    snprintf(sub, sizeof sub, "%s: xn", what);
    close_rows(sub, gpu.xn.data(), ref.xn.data(), N, d, 1e-5);
    snprintf(sub, sizeof sub, "%s: probs", what);
    close_rows(sub, gpu.probs.data(), ref.probs.data(), N, E, 1e-5);
    snprintf(sub, sizeof sub, "%s: w", what);
    close_rows(sub, gpu.w.data(), ref.w.data(), N, k, 1e-5);
    snprintf(sub, sizeof sub, "%s: hs", what);
    close_rows(sub, gpu.hs.data(), ref.hs.data(), (size_t)N * k, F, 1e-5);
    snprintf(sub, sizeof sub, "%s: x", what);
    close_rows(sub, gpu.x.data(), ref.x.data(), N, d, 1e-5);
    for (int n = 0; n < N; n += N > 4 ? N / 3 : 1) { /* a row alone: the same bits */
        outs one;
        run_fused(nullptr, one, x, nw, router, experts, n, 1, d, E, k, F);
        CHECK(memcmp(one.x.data(), gpu.x.data() + (size_t)n * d, (size_t)d * sizeof(float)) == 0,
              "%s: row %d alone differs", what, n);
    }
}

void launchers(void)
{
    float f = 0;
    int32_t i = 0;
    CHECK(nl_cuda_moe_norm_route(nullptr, &f, &f, &i, &f, &f, &f, &f, nullptr, 0, 1, 1, 0, 1,
                                 1e-5f) == (int)cudaErrorInvalidValue,
          "moe_norm_route: E 0 accepted");
    CHECK(nl_cuda_moe_norm_route(nullptr, &f, &f, &i, &f, &f, &f, &f, nullptr, 1, 1, 1,
                                 NL_BACKEND_MAX_EXPERTS + 1, 1, 1e-5f) ==
              (int)cudaErrorInvalidValue,
          "moe_norm_route: too many experts accepted");
    CHECK(nl_cuda_moe_norm_route(nullptr, &f, &f, &i, &f, &f, &f, &f, nullptr, 0, 1, 1, 2, 3,
                                 1e-5f) == (int)cudaErrorInvalidValue,
          "moe_norm_route: k > E accepted");
    CHECK(nl_cuda_moe_gate_up(nullptr, &f, &f, &f, &i, &f, nullptr, 1, 0, 0, 1, 1, 1) == 0,
          "moe_gate_up: no rows");
    CHECK(nl_cuda_moe_down_combine(nullptr, &f, &f, &f, &i, &f, &f, nullptr, 0, 0, 1, 0, 1, 1) ==
              (int)cudaErrorInvalidValue,
          "moe_down_combine: k 0 accepted");
}

} // namespace

int nl_emu_fused_checks(void)
{
    nl_error err = {};
    nl_backend *cpu = nullptr;
    nl_backend_opts opts = {};
    opts.threads = 1;
    if (nl_backend_new(&cpu, "cpu", &opts, &err) != NL_OK) {
        fprintf(stderr, "emu_fused: no CPU backend: %s\n", err.msg);
        return 1;
    }
    launchers();
    fused_case(cpu, 1, 64, 8, 2, 96);
    fused_case(cpu, 3, 37, 5, 3, 19);
    fused_case(cpu, 2, 1, 3, 1, 1);
    fused_case(cpu, 1, 70, 1, 1, 33); /* one expert */
    fused_case(cpu, 15, 96, 16, 4, 70);
    fused_case(cpu, 2, 130, 256, 2, 40); /* the most experts */
    fused_case(cpu, 40, 33, 8, 2, 17);   /* more rows than a decode's */
    nl_backend_destroy(&cpu);
    return check_fail_count;
}
