/* int nl_emu_moe_checks(void); -- call from test_cuda_emu's main:
 *   CHECK(nl_emu_moe_checks() == 0, "routing: see its failures above");
 *
 * kernels/cuda/cuda_moe.cu (routing, the aux loss, the router backward, the
 * grouped expert GEMMs) under the emulator (see cuda_runtime.h) against the
 * CPU backend's slots. One translation unit with its own CHECK counters
 * (like emu_attention_bwd.cc): returns how many of its checks failed.
 *
 * Routing: rows with ties (probabilities drawn from 8 levels), N from 0
 * to 1000 (the table kernel's chunks of one to several entries), E up to
 * 256 and k up to E: choice, offsets, perm and slot must equal the CPU's
 * integers and w its bits. The aux loss: frac and counts exact, the loss
 * within 1e-6 relative (the column sums run in another order). Router
 * backward: 1e-5 norm-wise per row. Grouped GEMMs: empty groups (C must
 * stay untouched), groups of one row, groups of more rows than a tile,
 * odd widths, padded strides with NaN in the padding, a max_rows below
 * the true count (the row-tile loop), rows past offsets[G] left alone:
 * 1e-5 norm-wise per row against the CPU's per-group gemm. */
#include "tests/cuda_emu/cuda_runtime.h"

#include "cuda_moe.cu.cc"

#include "tests/check.h"

extern "C" {
#include "kernels/backend.h"
}
#include "kernels/cuda/cuda_moe.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <vector>

namespace
{

uint64_t moe_rng = 0x853c49e6748fea9bull;

uint32_t moe_next(void)
{
    moe_rng = moe_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(moe_rng >> 33);
}

float moe_frand(void) /* uniform in [-1, 1) */
{
    return (float)(moe_next() & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

int moe_irand(int n)
{
    return (int)(moe_next() % (uint32_t)n);
}

bool same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

/* ||got - ref|| <= tol ||ref|| for each row of width w; NaN must meet NaN. */
void rows_close(const char *what, const std::vector<float> &got, const std::vector<float> &ref,
                size_t w, double tol)
{
    size_t bad = 0, first = 0;
    double worst = 0;
    for (size_t r = 0; r * w < ref.size(); r++) {
        double num = 0, den = 0;
        bool nan_ok = true;
        for (size_t c = 0; c < w && r * w + c < ref.size(); c++) {
            const float a = got[r * w + c], b = ref[r * w + c];
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
    CHECK(bad == 0, "%s: %zu rows off, first row %zu, worst norm-wise error %.3g", what, bad, first,
          worst);
}

/* Router probabilities from 8 levels, so rows have ties. */
std::vector<float> tied_probs(int N, int E)
{
    std::vector<float> p((size_t)N * E);
    for (float &x : p)
        x = (float)(moe_irand(8) + 1) / 8.0f;
    return p;
}

/* ---------------------------------------------------------------- routing */

void route_case(nl_backend *cpu, int N, int E, int k)
{
    char what[96];
    snprintf(what, sizeof what, "moe_route N %d E %d k %d", N, E, k);
    const size_t nk = (size_t)N * k + 1;
    std::vector<float> probs = tied_probs(N, E), w[2];
    std::vector<int32_t> ch[2], off[2], perm[2], slot[2];
    for (int s = 0; s < 2; s++) {
        w[s].assign(nk, NAN);
        ch[s].assign(nk, -7);
        perm[s].assign(nk, -7);
        slot[s].assign(nk, -7);
        off[s].assign((size_t)E + 1, -7);
    }
    const int rc = nl_cuda_moe_route(nullptr, ch[0].data(), w[0].data(), off[0].data(),
                                     perm[0].data(), slot[0].data(), probs.data(), N, E, k);
    CHECK(rc == 0, "%s: the launcher returned %d", what, rc);
    cpu->moe_route(cpu, ch[1].data(), w[1].data(), off[1].data(), perm[1].data(), slot[1].data(),
                   probs.data(), N, E, k);
    CHECK(ch[0] == ch[1], "%s: choices differ", what);
    CHECK(off[0] == off[1], "%s: offsets differ", what);
    CHECK(perm[0] == perm[1], "%s: perm differs", what);
    CHECK(slot[0] == slot[1], "%s: slot differs", what);
    bool wsame = true;
    for (size_t i = 0; i < nk; i++)
        wsame &= same_bits(w[0][i], w[1][i]);
    CHECK(wsame, "%s: weights differ", what);
    /* the tables are a dispatch: perm[slot[n k + i]] == n */
    bool inverse = true;
    for (int n = 0; n < N; n++)
        for (int i = 0; i < k; i++)
            inverse &= perm[0][slot[0][(size_t)n * k + i]] == n;
    CHECK(inverse && off[0][E] == N * k, "%s: not a dispatch", what);
}

void aux_case(nl_backend *cpu, int N, int E, int k, bool global)
{
    char what[96];
    snprintf(what, sizeof what, "moe_aux N %d E %d k %d global %d", N, E, k, global);
    const size_t nk = (size_t)N * k + 1;
    std::vector<float> probs((size_t)N * E), w(nk), gf(E), frac[2];
    for (float &x : probs)
        x = 0.5f * (moe_frand() + 1.0f);
    for (float &x : gf)
        x = 0.5f * (moe_frand() + 1.0f);
    std::vector<int32_t> ch(nk), perm(nk), slot(nk), off((size_t)E + 1);
    cpu->moe_route(cpu, ch.data(), w.data(), off.data(), perm.data(), slot.data(), probs.data(), N,
                   E, k);
    std::vector<int64_t> counts[2];
    double aux[2] = {0.25, 0.25};
    for (int s = 0; s < 2; s++) {
        frac[s].assign(E, NAN);
        counts[s].assign(E, 3);
    }
    const int rc = nl_cuda_moe_aux(nullptr, &aux[0], frac[0].data(), counts[0].data(), probs.data(),
                                   off.data(), global ? gf.data() : nullptr, N, E, k, 3.0 * N);
    CHECK(rc == 0, "%s: the launcher returned %d", what, rc);
    cpu->moe_aux(cpu, &aux[1], frac[1].data(), counts[1].data(), probs.data(), off.data(),
                 global ? gf.data() : nullptr, N, E, k, 3.0 * N);
    CHECK(frac[0] == frac[1], "%s: frac differs", what);
    CHECK(counts[0] == counts[1], "%s: counts differ", what);
    CHECK(fabs(aux[0] - aux[1]) <= 1e-6 * fabs(aux[1]), "%s: aux %.9g, want %.9g", what, aux[0],
          aux[1]);
    /* aux NULL and counts NULL are allowed */
    CHECK(nl_cuda_moe_aux(nullptr, nullptr, frac[0].data(), nullptr, probs.data(), off.data(),
                          nullptr, N, E, k, 1.0) == 0,
          "%s: NULL aux and counts", what);
}

void router_backward_case(nl_backend *cpu, int N, int E, int k)
{
    char what[96];
    snprintf(what, sizeof what, "moe_router_backward N %d E %d k %d", N, E, k);
    const size_t nk = (size_t)N * k;
    std::vector<float> probs((size_t)N * E), w(nk), dw(nk), frac(E), dl[2];
    for (int n = 0; n < N; n++) { /* softmax rows */
        double s = 0;
        for (int e = 0; e < E; e++)
            s += probs[(size_t)n * E + e] = expf(2.0f * moe_frand());
        for (int e = 0; e < E; e++)
            probs[(size_t)n * E + e] = (float)(probs[(size_t)n * E + e] / s);
    }
    for (float &x : dw)
        x = moe_frand();
    for (float &x : frac)
        x = 0.5f * (moe_frand() + 1.0f);
    std::vector<int32_t> ch(nk), perm(nk), slot(nk), off((size_t)E + 1);
    cpu->moe_route(cpu, ch.data(), w.data(), off.data(), perm.data(), slot.data(), probs.data(), N,
                   E, k);
    for (int s = 0; s < 2; s++)
        dl[s].assign((size_t)N * E, NAN);
    const int rc = nl_cuda_moe_router_backward(nullptr, dl[0].data(), dw.data(), probs.data(),
                                               ch.data(), w.data(), frac.data(), N, E, k, 0.03f);
    CHECK(rc == 0, "%s: the launcher returned %d", what, rc);
    cpu->moe_router_backward(cpu, dl[1].data(), dw.data(), probs.data(), ch.data(), w.data(),
                             frac.data(), N, E, k, 0.03f);
    rows_close(what, dl[0], dl[1], (size_t)E, 1e-5);
}

/* ---------------------------------------------------------------- grouped gemm */

/* Group sizes from `sizes` (G of them), rows total R plus `tail` rows past
 * offsets[G] that no group owns. */
struct groups {
    std::vector<int32_t> off;
    int rows;
};

groups make_groups(const std::vector<int> &sizes)
{
    groups g;
    g.off.push_back(0);
    for (int s : sizes)
        g.off.push_back(g.off.back() + s);
    g.rows = g.off.back();
    return g;
}

/* The few-row path (trans_b, max_rows <= NL_CUDA_GROUPED_FEW_ROWS: every
 * call below NL_BACKEND_FUSED_ROWS rows) sums each row in an order of its
 * own: a group's rows computed together give the bits each gives alone,
 * and the bits of gemm_grouped_rows (gemm_rows' products, which the
 * batched decoder and the fused decode slots compute), so a short
 * prompt's products are those of the same rows decoded in a batch. */
void gemv_rows_case(int rows, int N, int K)
{
    char what[96];
    snprintf(what, sizeof what, "gemm_grouped few rows: %d rows together and alone, N %d K %d",
             rows, N, K);
    std::vector<float> A((size_t)rows * K), B((size_t)N * K), C((size_t)rows * N, NAN),
        one((size_t)N, NAN);
    for (float &v : A)
        v = moe_frand();
    for (float &v : B)
        v = moe_frand();
    const int32_t all[2] = {0, rows};
    CHECK(nl_cuda_gemm_grouped(nullptr, 1, N, K, A.data(), K, B.data(), K, 0, C.data(), N, all, 1,
                               rows) == 0,
          "%s: launcher", what);
    std::vector<float> R((size_t)rows * N, NAN);
    CHECK(nl_cuda_gemm_grouped_rows(nullptr, N, K, A.data(), K, B.data(), K, 0, R.data(), N, all,
                                    1, 0) == 0,
          "%s: launcher", what);
    CHECK(memcmp(R.data(), C.data(), R.size() * sizeof(float)) == 0,
          "%s: the bits of gemm_grouped_rows", what);
    for (int r = 0; r < rows; r++) {
        const int32_t alone[2] = {0, 1};
        CHECK(nl_cuda_gemm_grouped(nullptr, 1, N, K, A.data() + (size_t)r * K, K, B.data(), K, 0,
                                   one.data(), N, alone, 1, 1) == 0,
              "%s: launcher", what);
        CHECK(memcmp(one.data(), C.data() + (size_t)r * N, N * sizeof(float)) == 0,
              "%s: row %d differs", what, r);
    }
}

/* The few-row path with bf16 weights: against sums in double of the
 * bf16-rounded products (activation and weight both rounded), within
 * 1e-5 of sum |a b|; rows alone give the bits they give together. */
void gemv_bf16_case(const std::vector<int> &sizes, int N, int K, int pad)
{
    char what[128];
    const groups g = make_groups(sizes);
    const int G = (int)sizes.size();
    snprintf(what, sizeof what, "gemm_grouped_few_bf16 G %d rows %d N %d K %d pad %d", G, g.rows, N,
             K, pad);
    const int lda = K + pad, ldb = K + pad, ldc = N + pad;
    const size_t b_stride = (size_t)N * ldb + 3 * ldb;
    std::vector<float> A((size_t)(g.rows + 1) * lda), C((size_t)(g.rows + 1) * ldc, 777.0f),
        one((size_t)ldc, 777.0f);
    std::vector<uint16_t> B(b_stride * G);
    for (float &v : A)
        v = moe_frand();
    for (uint16_t &v : B)
        v = nl_elem_to_bf16(moe_frand());
    CHECK(nl_cuda_gemm_grouped_few_bf16(nullptr, N, K, A.data(), lda, B.data(), ldb, b_stride,
                                        C.data(), ldc, g.off.data(), G) == 0,
          "%s: launcher", what);
    double worst = 0.0;
    int bad_rows = 0;
    for (int gi = 0; gi < G; gi++)
        for (int r = g.off[gi]; r < g.off[gi + 1]; r++) {
            for (int n = 0; n < N; n++) {
                double sum = 0.0, mag = 0.0;
                for (int k = 0; k < K; k++) {
                    const double a = nl_elem_from_bf16(nl_elem_to_bf16(A[(size_t)r * lda + k]));
                    const double b = nl_elem_from_bf16(B[gi * b_stride + (size_t)n * ldb + k]);
                    sum += a * b;
                    mag += fabs(a * b);
                }
                const double e = fabs(C[(size_t)r * ldc + n] - sum) / (mag > 0 ? mag : 1.0);
                worst = e > worst ? e : worst;
            }
            for (int n = N; n < ldc; n++)
                bad_rows += C[(size_t)r * ldc + n] != 777.0f; /* padding stays */
            /* the same row alone, through the same group's weights */
            const int32_t alone[2] = {0, 1};
            nl_cuda_gemm_grouped_few_bf16(nullptr, N, K, A.data() + (size_t)r * lda, lda,
                                          B.data() + gi * b_stride, ldb, b_stride, one.data(), ldc,
                                          alone, 1);
            bad_rows += memcmp(one.data(), C.data() + (size_t)r * ldc, N * sizeof(float)) != 0;
        }
    CHECK(worst <= 1e-5, "%s: error %.3g", what, worst);
    CHECK(bad_rows == 0, "%s: %d rows differ alone or wrote padding", what, bad_rows);
    for (int n = 0; n < ldc; n++)
        CHECK(C[(size_t)g.rows * ldc + n] == 777.0f, "%s: a row past the groups written", what);
}

void grouped_case(nl_backend *cpu, const std::vector<int> &sizes, int trans_b, int N, int K,
                  int max_rows, int pad)
{
    char what[128];
    const groups g = make_groups(sizes);
    const int G = (int)sizes.size(), R = g.rows + 2; /* two rows past offsets[G] */
    snprintf(what, sizeof what, "gemm_grouped G %d rows %d trans_b %d N %d K %d max_rows %d pad %d",
             G, g.rows, trans_b, N, K, max_rows, pad);
    const int lda = K + pad, ldb = (trans_b ? K : N) + pad, ldc = N + pad;
    const size_t b_rows = (size_t)(trans_b ? N : K), b_stride = b_rows * ldb + 5;
    std::vector<float> A((size_t)R * lda), B(b_stride * G), C[2];
    for (size_t i = 0; i < A.size(); i++)
        A[i] = (int)(i % lda) < K ? moe_frand() : NAN;
    for (size_t i = 0; i < B.size(); i++)
        B[i] = i % b_stride < b_rows * ldb && (int)(i % b_stride % ldb) < ldb - pad ? moe_frand()
                                                                                    : NAN;
    for (int s = 0; s < 2; s++) {
        C[s].assign((size_t)R * ldc, NAN);
        for (size_t i = 0; i < C[s].size(); i++)
            if ((int)(i % ldc) >= N || i >= (size_t)g.rows * ldc)
                C[s][i] = 777.0f; /* padding and unowned rows: must stay */
    }
    const int rc = nl_cuda_gemm_grouped(nullptr, trans_b, N, K, A.data(), lda, B.data(), ldb,
                                        b_stride, C[0].data(), ldc, g.off.data(), G, max_rows);
    CHECK(rc == 0, "%s: the launcher returned %d", what, rc);
    cpu->gemm_grouped(cpu, trans_b, N, K, A.data(), lda, B.data(), ldb, b_stride, C[1].data(), ldc,
                      g.off.data(), G, max_rows);
    rows_close(what, C[0], C[1], (size_t)ldc, 1e-5);
}

void wgrad_case(nl_backend *cpu, const std::vector<int> &sizes, int M, int N, int pad)
{
    char what[128];
    const groups g = make_groups(sizes);
    const int G = (int)sizes.size(), R = g.rows + 1;
    snprintf(what, sizeof what, "gemm_grouped_wgrad G %d rows %d M %d N %d pad %d", G, g.rows, M, N,
             pad);
    const int lda = M + pad, ldb = N + pad, ldc = N + pad;
    const size_t c_stride = (size_t)M * ldc + 3;
    std::vector<float> A((size_t)R * lda), B((size_t)R * ldb), C[2];
    for (size_t i = 0; i < A.size(); i++)
        A[i] = (int)(i % lda) < M ? moe_frand() : NAN;
    for (size_t i = 0; i < B.size(); i++)
        B[i] = (int)(i % ldb) < N ? moe_frand() : NAN;
    C[0].resize(c_stride * G);
    for (size_t i = 0; i < C[0].size(); i++)
        C[0][i] =
            i % c_stride < (size_t)M * ldc && (int)(i % c_stride % ldc) < N ? moe_frand() : 777.0f;
    C[1] = C[0];
    const int rc = nl_cuda_gemm_grouped_wgrad(nullptr, M, N, A.data(), lda, B.data(), ldb,
                                              C[0].data(), ldc, c_stride, g.off.data(), G);
    CHECK(rc == 0, "%s: the launcher returned %d", what, rc);
    cpu->gemm_grouped_wgrad(cpu, M, N, A.data(), lda, B.data(), ldb, C[1].data(), ldc, c_stride,
                            g.off.data(), G);
    rows_close(what, C[0], C[1], (size_t)ldc, 1e-5);
    /* an empty group's C is untouched to the bit */
    bool kept = true;
    for (int gi = 0; gi < G; gi++)
        if (sizes[gi] == 0)
            for (size_t i = 0; i < c_stride && gi * c_stride + i < C[0].size(); i++)
                kept &= same_bits(C[0][gi * c_stride + i], C[1][gi * c_stride + i]);
    CHECK(kept, "%s: an empty group's C changed", what);
}

void launchers(void)
{
    float f[4] = {0, 0, 0, 0};
    int32_t i[4] = {0, 0, 0, 0};
    double d = 0;
    const long before = emu_launch_count();
    CHECK(nl_cuda_moe_router_backward(nullptr, f, f, f, i, f, f, 0, 2, 1, 1.0f) == 0,
          "router_backward N 0");
    CHECK(nl_cuda_gemm_grouped(nullptr, 0, 0, 4, f, 4, f, 4, 0, f, 4, i, 1, 4) == 0,
          "gemm_grouped N 0");
    CHECK(nl_cuda_gemm_grouped(nullptr, 0, 4, 4, f, 4, f, 4, 0, f, 4, i, 0, 4) == 0,
          "gemm_grouped no groups");
    CHECK(nl_cuda_gemm_grouped_wgrad(nullptr, 0, 4, f, 4, f, 4, f, 4, 0, i, 1) == 0,
          "gemm_grouped_wgrad M 0");
    CHECK(emu_launch_count() == before, "an empty shape launched %ld kernels",
          emu_launch_count() - before);
    CHECK(nl_cuda_moe_route(nullptr, i, f, i, i, i, f, 1, 2, 3) == cudaErrorInvalidValue,
          "route k > E accepted");
    CHECK(nl_cuda_moe_route(nullptr, i, f, i, i, i, f, 1, NL_BACKEND_MAX_EXPERTS + 1, 1) ==
              cudaErrorInvalidValue,
          "route E past the maximum accepted");
    CHECK(nl_cuda_moe_aux(nullptr, &d, f, nullptr, f, i, nullptr, -1, 2, 1, 1.0) ==
              cudaErrorInvalidValue,
          "aux N < 0 accepted");
    CHECK(nl_cuda_gemm_grouped(nullptr, 0, 4, 4, f, -1, f, 4, 0, f, 4, i, 1, 4) ==
              cudaErrorInvalidValue,
          "gemm_grouped lda < 0 accepted");
    CHECK(emu_launch_count() == before, "a rejected shape launched a kernel");
}

} // namespace

int nl_emu_moe_checks(void)
{
    nl_error err = {};
    nl_backend *cpu = nullptr;
    nl_backend_opts opts = {};
    opts.threads = 1;
    if (nl_backend_new(&cpu, "cpu", &opts, &err) != NL_OK) {
        fprintf(stderr, "emu_moe: no CPU backend: %s\n", err.msg);
        return 1;
    }
    launchers();
    const int routes[][3] = {{1, 8, 2}, {0, 8, 2},    {70, 8, 2},    {1000, 8, 2}, {300, 16, 4},
                             {5, 3, 3}, {33, 256, 2}, {4, 256, 256}, {257, 2, 1}};
    for (auto &r : routes)
        route_case(cpu, r[0], r[1], r[2]);
    aux_case(cpu, 1, 8, 2, false);
    aux_case(cpu, 70, 8, 2, false);
    aux_case(cpu, 600, 16, 4, true);
    aux_case(cpu, 33, 256, 2, false);
    router_backward_case(cpu, 1, 8, 2);
    router_backward_case(cpu, 300, 16, 4);
    router_backward_case(cpu, 5, 3, 3);
    for (int tb = 0; tb < 2; tb++) {
        grouped_case(cpu, {3, 0, 70, 1}, tb, 33, 37, 70, 0);
        grouped_case(cpu, {1, 1}, tb, 1, 1, 1, 2);
        grouped_case(cpu, {0, 130, 0}, tb, 65, 17, 2, 3); /* max_rows below the count */
        grouped_case(cpu, {5, 9, 2, 0, 4, 6, 1, 3}, tb, 100, 70, 9, 1);
        /* decode: a token's two experts among eight; a few tokens */
        grouped_case(cpu, {1, 0, 0, 1, 0, 0, 0, 0}, tb, 257, 769, 1, 0);
        grouped_case(cpu, {2, 3, 0, 8, 1}, tb, 70, 33, 8, 2);
        grouped_case(cpu, {5, 0}, tb, 9, 1, 8, 0);
    }
    gemv_rows_case(7, 65, 300);
    gemv_rows_case(15, 33, 96); /* a prompt of 15 rows */
    gemv_bf16_case({1, 0, 0, 1, 0, 0, 0, 0}, 257, 769, 0);
    gemv_bf16_case({2, 3, 0, 8, 1}, 70, 33, 2);
    gemv_bf16_case({0, 0}, 5, 5, 0);
    wgrad_case(cpu, {3, 0, 70, 1}, 33, 37, 0);
    wgrad_case(cpu, {0, 0}, 5, 5, 1);
    wgrad_case(cpu, {130, 1, 0, 17}, 65, 70, 3);
    nl_backend_destroy(&cpu);
    return check_fail_count;
}
