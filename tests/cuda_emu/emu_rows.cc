/* int nl_emu_rows_checks(void); -- call from test_cuda_emu's main:
 *   CHECK(nl_emu_rows_checks() == 0, "row-invariant GEMM: see its failures above");
 *
 * kernels/cuda/cuda_rows.cu (the gemm_rows slot) and what batch invariance
 * on CUDA rests on, under the emulator (see cuda_runtime.h). One
 * translation unit with its own CHECK counters (like emu_fused.cc):
 * returns how many of its checks failed.
 *
 * - gemm_rows: a row computed inside calls of 1, 3, 16 and 40 rows (at
 *   other offsets too) has the same bits, with B transposed or not,
 *   overwriting or accumulating, FP32 and bf16 (the weights read from a
 *   bf16 copy giving the bits of rounding them as read); values within
 *   1e-5 norm-wise per row of a double reference (of the rounded operands
 *   in bf16). gemm_grouped_rows: each row the bits of gemm_rows of that
 *   row against its group's weights.
 * - The fused decode kernels (cuda_fused.cu) against the separate kernels
 *   with the products through gemm_rows and gemm_grouped_rows (rmsnorm,
 *   router, softmax, moe_route, gather_rows, gate/up, swiglu, down,
 *   moe_combine): the same bits, for widths whose RMSNorm block is wider
 *   than 256 threads and expert counts whose softmax block is wider than
 *   the RMSNorm's.
 * - core/model/batch.c on a backend whose GEMM, routing and fused slots
 *   are these CUDA kernels (the rest the CPU's): five sessions decoded
 *   together (a first step of 25 rows through the separate slots, then
 *   5-row steps through the fused ones) give each session the ids and
 *   logits, bit for bit, of decoding it alone (a prompt of 3 to 7 rows and
 *   1-row steps, all fused). Their tokens are sampled through the table's
 *   sample_rows (CUDA's sample kernel), greedy and seeded temperature
 *   mixed: the ids of sampling the host logits, and one host sync per
 *   step for all its sessions' ids. */
#include "tests/cuda_emu/cuda_runtime.h"

#include "cuda_rows.cu.cc"

#include "tests/check.h"

extern "C" {
#include "core/model/batch.h"
#include "core/model/sampler.h"
#include "kernels/backend.h"
#include "kernels/elem.h"
}
#include "kernels/cuda/cuda_fused.h"
#include "kernels/cuda/cuda_moe.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_rows.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <vector>

namespace
{

uint64_t rw_rng = 0x9e3779b97f4a7c15ull;

float rw_frand(void) /* uniform in [-1, 1) */
{
    rw_rng = rw_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rw_rng >> 40) & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

std::vector<float> rw_vec(size_t n, float amp)
{
    std::vector<float> v(n);
    for (float &x : v)
        x = amp * rw_frand();
    return v;
}

float round_bf16(float v)
{
    return nl_elem_from_bf16(nl_elem_to_bf16(v));
}

bool same_bits(const float *a, const float *b, size_t n)
{
    return memcmp(a, b, n * sizeof(float)) == 0;
}

/* ---------------------------------------------------------------- gemm_rows */

/* One (N, K, trans_b, accumulate, bf16) case: R = 40 rows at once are the
 * reference; the last M rows alone, and M rows starting at row 1, must
 * give its bits. */
void rows_case(int N, int K, int tb, int acc, int bf16)
{
    enum { R = 40 };
    char what[128];
    snprintf(what, sizeof what, "gemm_rows N %d K %d trans_b %d acc %d bf16 %d", N, K, tb, acc,
             bf16);
    const int lda = K + 3, ldb = (tb ? K : N) + 2, ldc = N + 1; /* padded strides */
    const std::vector<float> A = rw_vec((size_t)R * lda, 1.0f);
    const std::vector<float> B = rw_vec((size_t)(tb ? N : K) * ldb, 1.0f);
    const std::vector<float> C0 = rw_vec((size_t)R * ldc, 1.0f);
    std::vector<float> ref = C0;
    CHECK(nl_cuda_gemm_rows(nullptr, tb, R, N, K, A.data(), lda, B.data(), ldb, acc, ref.data(),
                            ldc, bf16) == 0,
          "%s: launcher", what);
    /* values: a double reference of the (rounded) operands */
    double worst = 0;
    for (int i = 0; i < R; i++) {
        double num = 0, den = 0;
        for (int n = 0; n < N; n++) {
            double s = 0;
            for (int k = 0; k < K; k++) {
                float a = A[(size_t)i * lda + k], b = tb ? B[(size_t)n * ldb + k] : B[(size_t)k * ldb + n];
                if (bf16) {
                    a = round_bf16(a);
                    b = round_bf16(b);
                }
                s += (double)a * b;
            }
            if (acc)
                s += C0[(size_t)i * ldc + n];
            const double g = ref[(size_t)i * ldc + n];
            num += (g - s) * (g - s);
            den += s * s;
        }
        const double e = sqrt(num) / (den > 0 ? sqrt(den) : 1.0);
        worst = e > worst ? e : worst;
    }
    CHECK(worst <= 1e-5, "%s: norm-wise error %.3g against a double reference", what, worst);
    /* the padding between rows is untouched */
    bool pad_ok = true;
    for (int i = 0; i < R; i++)
        pad_ok &= ref[(size_t)i * ldc + N] == C0[(size_t)i * ldc + N];
    CHECK(pad_ok, "%s: wrote past N", what);
    static const int ms[] = {1, 3, 16, 40};
    for (int M : ms)
        for (int o : {R - M, M < R ? 1 : 0}) {
            std::vector<float> got = C0;
            CHECK(nl_cuda_gemm_rows(nullptr, tb, M, N, K, A.data() + (size_t)o * lda, lda,
                                    B.data(), ldb, acc, got.data() + (size_t)o * ldc, ldc,
                                    bf16) == 0,
                  "%s: launcher", what);
            CHECK(same_bits(got.data() + (size_t)o * ldc, ref.data() + (size_t)o * ldc,
                            (size_t)M * ldc - 1),
                  "%s: rows %d..%d alone give other bits than inside %d rows", what, o, o + M - 1,
                  R);
        }
    if (bf16 && tb) { /* from a bf16 copy of B: the same bits */
        std::vector<uint16_t> Bh(B.size());
        for (size_t i = 0; i < B.size(); i++)
            Bh[i] = nl_elem_to_bf16(B[i]);
        for (int M : ms) {
            std::vector<float> got = C0;
            CHECK(nl_cuda_gemm_rows_bf16(nullptr, M, N, K, A.data(), lda, Bh.data(), ldb, acc,
                                         got.data(), ldc) == 0,
                  "%s: launcher (copy)", what);
            CHECK(same_bits(got.data(), ref.data(), (size_t)M * ldc - 1),
                  "%s: %d rows from the bf16 copy give other bits", what, M);
        }
    }
}

/* gemm_grouped_rows: groups of 0, 1, 5 and 11 rows; each row the bits of
 * gemm_rows of that row alone against its group's weights */
void grouped_rows_case(int N, int K, int bf16)
{
    const int counts[] = {5, 0, 1, 11};
    const int G = 4, rows = 17;
    const size_t stride = (size_t)N * K + 7;
    const std::vector<float> A = rw_vec((size_t)rows * K, 1.0f);
    const std::vector<float> B = rw_vec(stride * G, 1.0f);
    std::vector<int32_t> off(G + 1, 0);
    for (int g = 0; g < G; g++)
        off[g + 1] = off[g] + counts[g];
    std::vector<float> C((size_t)rows * N, NAN);
    CHECK(nl_cuda_gemm_grouped_rows(nullptr, N, K, A.data(), K, B.data(), K, stride, C.data(), N,
                                    off.data(), G, bf16) == 0,
          "gemm_grouped_rows: launcher");
    int bad = 0;
    for (int g = 0; g < G; g++)
        for (int r = off[g]; r < off[g + 1]; r++) {
            std::vector<float> one(N, NAN);
            nl_cuda_gemm_rows(nullptr, 1, 1, N, K, A.data() + (size_t)r * K, K,
                              B.data() + g * stride, K, 0, one.data(), N, bf16);
            bad += !same_bits(one.data(), C.data() + (size_t)r * N, N);
        }
    CHECK(bad == 0, "gemm_grouped_rows N %d K %d bf16 %d: %d rows differ from gemm_rows", N, K,
          bf16, bad);
    if (bf16) { /* the few-row kernel on the bf16 copy: the same bits */
        std::vector<uint16_t> Bh(B.size());
        for (size_t i = 0; i < B.size(); i++)
            Bh[i] = nl_elem_to_bf16(B[i]);
        std::vector<float> C2((size_t)rows * N, NAN);
        CHECK(nl_cuda_gemm_grouped_few_bf16(nullptr, N, K, A.data(), K, Bh.data(), K, stride,
                                            C2.data(), N, off.data(), G) == 0,
              "gemm_grouped_few_bf16: launcher");
        CHECK(same_bits(C.data(), C2.data(), C.size()),
              "gemm_grouped_rows N %d K %d: the bf16 copy gives other bits", N, K);
    }
}

void launchers(void)
{
    float f = 0;
    CHECK(nl_cuda_gemm_rows(nullptr, 1, 1, 1, 4, &f, 2, &f, 4, 0, &f, 1, 0) ==
              (int)cudaErrorInvalidValue,
          "gemm_rows: lda below K accepted");
    CHECK(nl_cuda_gemm_rows(nullptr, 0, 1, 4, 1, &f, 1, &f, 2, 0, &f, 4, 0) ==
              (int)cudaErrorInvalidValue,
          "gemm_rows: ldb below N accepted");
    CHECK(nl_cuda_gemm_rows(nullptr, 1, -1, 1, 1, &f, 1, &f, 1, 0, &f, 1, 0) ==
              (int)cudaErrorInvalidValue,
          "gemm_rows: negative M accepted");
    CHECK(nl_cuda_gemm_rows(nullptr, 1, 0, 5, 5, &f, 5, &f, 5, 0, &f, 5, 0) == 0,
          "gemm_rows: no rows");
}

/* ---------------------------------------------------------------- fused = separate */

struct moe_out {
    std::vector<float> x, probs;
    std::vector<int32_t> choice;
};

/* The fused kernels, or the separate ones the way core/model/layer.c and
 * batch.c call them on CUDA, over N rows; bf16: the bf16 backend's
 * products (bf16 x bf16 in FP32), the weights from their bf16 copy (copy)
 * or rounded as read */
moe_out run_moe(bool fused, const std::vector<float> &x0, const std::vector<float> &nw,
                const std::vector<float> &router, const std::vector<float> &experts, int N, int d,
                int E, int k, int F, int bf16, bool copy)
{
    const size_t stride = 3 * (size_t)F * d, nk = (size_t)N * k;
    moe_out o;
    o.x = x0;
    o.probs.assign((size_t)N * E, NAN);
    o.choice.assign(nk, -1);
    std::vector<float> xn((size_t)N * d, NAN), w(nk, NAN), hs(nk * F, NAN), gu(nk * 2 * F, NAN);
    std::vector<float> ye(nk * d, NAN), xe(nk * d, NAN);
    std::vector<uint16_t> r16(router.size()), e16(experts.size());
    for (size_t i = 0; copy && i < router.size(); i++)
        r16[i] = nl_elem_to_bf16(router[i]);
    for (size_t i = 0; copy && i < experts.size(); i++)
        e16[i] = nl_elem_to_bf16(experts[i]);
    const uint16_t *rc = copy ? r16.data() : nullptr, *ec = copy ? e16.data() : nullptr;
    const float eps = 1e-5f;
    if (fused) {
        nl_cuda_moe_norm_route(nullptr, xn.data(), o.probs.data(), o.choice.data(), w.data(),
                               o.x.data(), nw.data(), router.data(), rc, bf16, N, d, E, k, eps);
        nl_cuda_moe_gate_up(nullptr, hs.data(), gu.data(), xn.data(), o.choice.data(),
                            experts.data(), ec, bf16, stride, N, k, d, F);
        nl_cuda_moe_down_combine(nullptr, o.x.data(), ye.data(), hs.data(), o.choice.data(),
                                 w.data(), experts.data(), ec, bf16, stride, N, k, d, F);
        return o;
    }
    std::vector<int32_t> off(E + 1), perm(nk), slot(nk);
    nl_cuda_rmsnorm_forward(nullptr, xn.data(), nullptr, o.x.data(), nw.data(), N, d, eps);
    if (rc)
        nl_cuda_gemm_rows_bf16(nullptr, N, E, d, xn.data(), d, rc, d, 0, o.probs.data(), E);
    else
        nl_cuda_gemm_rows(nullptr, 1, N, E, d, xn.data(), d, router.data(), d, 0, o.probs.data(),
                          E, bf16);
    nl_cuda_softmax_forward(nullptr, o.probs.data(), N, E);
    nl_cuda_moe_route(nullptr, o.choice.data(), w.data(), off.data(), perm.data(), slot.data(),
                      o.probs.data(), N, E, k);
    nl_cuda_gather_rows(nullptr, xe.data(), xn.data(), perm.data(), (int)nk, d);
    if (ec)
        nl_cuda_gemm_grouped_few_bf16(nullptr, 2 * F, d, xe.data(), d, ec, d, stride, gu.data(),
                                      2 * F, off.data(), E);
    else
        nl_cuda_gemm_grouped_rows(nullptr, 2 * F, d, xe.data(), d, experts.data(), d, stride,
                                  gu.data(), 2 * F, off.data(), E, bf16);
    nl_cuda_swiglu_forward(nullptr, hs.data(), gu.data(), (int)nk, F);
    if (ec)
        nl_cuda_gemm_grouped_few_bf16(nullptr, d, F, hs.data(), F, ec + 2 * (size_t)F * d, F,
                                      stride, ye.data(), d, off.data(), E);
    else
        nl_cuda_gemm_grouped_rows(nullptr, d, F, hs.data(), F, experts.data() + 2 * (size_t)F * d,
                                  F, stride, ye.data(), d, off.data(), E, bf16);
    nl_cuda_moe_combine(nullptr, o.x.data(), ye.data(), slot.data(), w.data(), N, k, d);
    return o;
}

/* The fused kernels give the separate ones' bits: FP32, and bf16 with the
 * weights from the copy or rounded as read (either against either) */
void fused_vs_separate(int N, int d, int E, int k, int F)
{
    const std::vector<float> x = rw_vec((size_t)N * d, 1.0f), nw = rw_vec((size_t)d, 1.0f);
    const std::vector<float> router = rw_vec((size_t)E * d, 1.0f);
    const std::vector<float> experts = rw_vec((size_t)E * 3 * F * d, 0.1f);
    for (int m = 0; m < 3; m++) { /* FP32; bf16, the fused from the copy; bf16, the separate */
        const int bf16 = m > 0;
        char what[128];
        snprintf(what, sizeof what, "fused = separate%s N %d d %d E %d k %d F %d",
                 m == 0 ? "" : m == 1 ? " (bf16, fused from the copy)" : " (bf16, separate from the copy)",
                 N, d, E, k, F);
        const moe_out f = run_moe(true, x, nw, router, experts, N, d, E, k, F, bf16, m == 1);
        const moe_out s = run_moe(false, x, nw, router, experts, N, d, E, k, F, bf16, m == 2);
        CHECK(f.choice == s.choice, "%s: choices differ", what);
        CHECK(same_bits(f.probs.data(), s.probs.data(), f.probs.size()), "%s: probs differ", what);
        CHECK(same_bits(f.x.data(), s.x.data(), f.x.size()), "%s: the layer's output differs",
              what);
        if (m == 0)
            continue;
        const moe_out f32 = run_moe(true, x, nw, router, experts, N, d, E, k, F, 0, false);
        CHECK(!same_bits(f.x.data(), f32.x.data(), f.x.size()), "%s: no different from FP32",
              what);
    }
}

/* ---------------------------------------------------------------- a batch on CUDA's kernels */

/* The CPU backend's table with the slots a batch's invariance rests on
 * replaced by the CUDA kernels (host memory: the emulator runs them on the
 * CPU). gemm_grouped is CUDA's too, whose many-row tiles sum in another
 * order than gemm_rows: what the batch must not use. */
struct emu_backend {
    nl_backend be;
    nl_backend *cpu;
};

/* calls counted (the slots see the batch's copy of the table, not ours) */
int fused_calls, grouped_rows_calls, many_rows_calls;

#define EMU_OK(call) CHECK((call) == 0, "%s", #call)

void e_gemm_rows(nl_backend *, int tb, int M, int N, int K, const float *A, int lda,
                 const float *B, int ldb, int acc, float *C, int ldc)
{
    many_rows_calls += M >= NL_BACKEND_FUSED_ROWS;
    EMU_OK(nl_cuda_gemm_rows(nullptr, tb, M, N, K, A, lda, B, ldb, acc, C, ldc, 0));
}
void e_gemm_grouped(nl_backend *, int tb, int N, int K, const float *A, int lda, const float *B,
                    int ldb, size_t bs, float *C, int ldc, const int32_t *off, int groups,
                    int max_rows)
{
    EMU_OK(nl_cuda_gemm_grouped(nullptr, tb, N, K, A, lda, B, ldb, bs, C, ldc, off, groups,
                                max_rows));
}
void e_gemm_grouped_rows(nl_backend *, int N, int K, const float *A, int lda, const float *B,
                         int ldb, size_t bs, float *C, int ldc, const int32_t *off, int groups,
                         int max_rows)
{
    grouped_rows_calls++;
    many_rows_calls += max_rows >= NL_BACKEND_FUSED_ROWS;
    EMU_OK(nl_cuda_gemm_grouped_rows(nullptr, N, K, A, lda, B, ldb, bs, C, ldc, off, groups, 0));
}
void e_rmsnorm(nl_backend *, float *out, float *rstd, const float *inp, const float *w, int N,
               int C, float eps)
{
    EMU_OK(nl_cuda_rmsnorm_forward(nullptr, out, rstd, inp, w, N, C, eps));
}
void e_softmax(nl_backend *, float *x, int N, int C)
{
    EMU_OK(nl_cuda_softmax_forward(nullptr, x, N, C));
}
void e_swiglu(nl_backend *, float *out, const float *gu, int N, int F)
{
    EMU_OK(nl_cuda_swiglu_forward(nullptr, out, gu, N, F));
}
void e_gather(nl_backend *, float *out, const float *src, const int32_t *idx, int n, int C)
{
    EMU_OK(nl_cuda_gather_rows(nullptr, out, src, idx, n, C));
}
void e_combine(nl_backend *, float *x, const float *y, const int32_t *slot, const float *w, int N,
               int k, int C)
{
    EMU_OK(nl_cuda_moe_combine(nullptr, x, y, slot, w, N, k, C));
}
void e_route(nl_backend *, int32_t *choice, float *w, int32_t *off, int32_t *perm, int32_t *slot,
             const float *probs, int N, int E, int k)
{
    EMU_OK(nl_cuda_moe_route(nullptr, choice, w, off, perm, slot, probs, N, E, k));
}
void e_norm_route(nl_backend *, float *xn, float *probs, int32_t *choice, float *w,
                  const float *x, const float *nw, const float *router, int N, int d, int E, int k,
                  float eps)
{
    fused_calls++;
    EMU_OK(nl_cuda_moe_norm_route(nullptr, xn, probs, choice, w, x, nw, router, nullptr, 0, N, d,
                                  E, k, eps));
}
void e_gate_up(nl_backend *, float *hs, float *gu, const float *xn, const int32_t *choice,
               const float *ex, size_t es, int N, int k, int d, int F)
{
    EMU_OK(nl_cuda_moe_gate_up(nullptr, hs, gu, xn, choice, ex, nullptr, 0, es, N, k, d, F));
}
void e_down_combine(nl_backend *, float *x, float *ye, const float *hs, const int32_t *choice,
                    const float *w, const float *ex, size_t es, int N, int k, int d, int F)
{
    EMU_OK(
        nl_cuda_moe_down_combine(nullptr, x, ye, hs, choice, w, ex, nullptr, 0, es, N, k, d, F));
}

/* CUDA's slot: the kernel for every row, then one copy of the ids */
void e_sample_rows(nl_backend *be, int32_t *ids, const nl_sample_row *rows, int n, int V)
{
    if (n <= 0)
        return;
    be->stats.host_syncs++;
    EMU_OK(nl_cuda_sample_rows(nullptr, ids, rows, n, V, nullptr, 0));
}

void emu_backend_init(emu_backend *e, nl_backend *cpu)
{
    e->be = *cpu; /* the CPU's ctx: its other slots run as they are */
    e->cpu = cpu;
    nl_backend *be = &e->be;
    be->name = "cuda-emu";
    be->gemm_rows = e_gemm_rows;
    be->gemm_grouped = e_gemm_grouped;
    be->gemm_grouped_rows = e_gemm_grouped_rows;
    be->moe_ffn_forward = nullptr; /* CUDA has none */
    be->rmsnorm_forward = e_rmsnorm;
    be->softmax_forward = e_softmax;
    be->swiglu_forward = e_swiglu;
    be->gather_rows = e_gather;
    be->moe_combine = e_combine;
    be->moe_route = e_route;
    be->moe_norm_route = e_norm_route;
    be->moe_gate_up = e_gate_up;
    be->moe_down_combine = e_down_combine;
    be->sample_rows = e_sample_rows;
}

enum { SESS = 5, NEW = 5, VOCAB = 128 };

struct session {
    int32_t prompt[8];
    int P, n;
    int32_t ids[NEW];
    uint64_t bits;
    nl_kvcache *kv;
    nl_sampler smp, twin; /* on the device; the same draws on the host */
};

int bad_syncs, host_mismatch; /* steps whose ids took other than 1 sync; ids unlike the host's */

/* One step of the listed unfinished sessions: its prompt, or its last id;
 * their next ids sampled together on the device */
void batch_step(nl_backend *be, nl_batch *b, session **ss, int n)
{
    nl_batch_seg segs[SESS];
    nl_sampler *smp[SESS];
    const float *lgd[SESS];
    nl_sample_row rows[SESS];
    int32_t ids[SESS];
    nl_error err = {};
    for (int i = 0; i < n; i++) {
        session *s = ss[i];
        segs[i] = s->n == 0 ? nl_batch_seg{s->kv, s->prompt, s->P, 1}
                            : nl_batch_seg{s->kv, &s->ids[s->n - 1], 1, 1};
    }
    if (nl_batch_forward(b, segs, n, &err) != NL_OK) {
        CHECK(0, "batch step: %s", err.msg);
        for (int i = 0; i < n; i++)
            ss[i]->n = NEW; /* give up */
        return;
    }
    for (int i = 0; i < n; i++) {
        smp[i] = &ss[i]->smp;
        lgd[i] = nl_batch_logits_device(b, i);
    }
    const uint64_t s0 = be->stats.host_syncs;
    CHECK(nl_sampler_next_batch(smp, lgd, n, be, rows, ids, &err) == NL_OK, "sample: %s", err.msg);
    bad_syncs += be->stats.host_syncs - s0 != 1;
    for (int i = 0; i < n; i++) {
        const float *lg = nl_batch_logits(b, i, &err);
        CHECK(lg, "batch logits: %s", err.msg);
        if (!lg)
            continue;
        const unsigned char *p = (const unsigned char *)lg;
        for (size_t j = 0; j < VOCAB * sizeof(float); j++)
            ss[i]->bits = (ss[i]->bits ^ p[j]) * 1099511628211ull;
        host_mismatch += nl_sampler_sample(&ss[i]->twin, lg) != ids[i];
        ss[i]->ids[ss[i]->n++] = ids[i];
    }
}

/* few: the backend says its rows kernel is fast only at a decode's few
 * rows (gemm_rows_few, as CUDA's): the prompts then have 1 to 5 rows, so
 * the first step together (15 rows) stays below NL_BACKEND_FUSED_ROWS, and
 * a step of 25 rows afterwards must not reach the rows kernels. */
void batch_alone_vs_together(nl_backend *cpu, int few)
{
    emu_backend e;
    emu_backend_init(&e, cpu);
    nl_backend *be = &e.be;
    be->gemm_rows_few = few;
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 64;
    c.num_layers = 1;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.ffn_dim = 48;
    c.vocab_size = VOCAB;
    c.vocab_chunk = 64;
    c.max_seq_len = 32;
    nl_config_fill_derived(&c);
    nl_error err = {};
    nl_model *m = nullptr;
    nl_batch *b = nullptr;
    if (nl_model_new(&m, be, &c, 0, c.num_layers, 1, 1, &err) != NL_OK ||
        nl_model_init_random(m, 5, &err) != NL_OK || nl_batch_new(&b, m, 32, &err) != NL_OK) {
        CHECK(0, "batch on CUDA's kernels: %s", err.msg);
        nl_batch_destroy(&b);
        nl_model_destroy(&m);
        return;
    }
    static session alone[SESS], together[SESS];
    for (session *set : {alone, together})
        for (int i = 0; i < SESS; i++) {
            session *s = &set[i];
            *s = session{};
            s->bits = 14695981039346656037ull;
            /* 25 rows in all (15 with few): the first step together has 16
             * or more (fewer) */
            s->P = (few ? 1 : 3) + i;
            for (int t = 0; t < s->P; t++)
                s->prompt[t] = (int32_t)((i * 37 + t * 11 + 1) % VOCAB);
            CHECK(nl_kvcache_new(&s->kv, m, 1, s->P + NEW, NL_KV_FP32, &err) == NL_OK,
                  "cache: %s", err.msg);
            const float t = i % 2 ? 0.6f * (float)i : 0.0f; /* greedy and seeded */
            CHECK(nl_sampler_init(&s->smp, VOCAB, t, 1.0f, 300 + i, &err) == NL_OK &&
                      nl_sampler_init(&s->twin, VOCAB, t, 1.0f, 300 + i, &err) == NL_OK,
                  "sampler: %s", err.msg);
        }
    const int bad_syncs0 = bad_syncs, mismatch0 = host_mismatch;
    const int fused0 = fused_calls, grouped_start = grouped_rows_calls;
    for (int i = 0; i < SESS; i++) {
        session *s = &alone[i];
        while (s->kv && s->n < NEW)
            batch_step(be, b, &s, 1);
    }
    const int grouped0 = grouped_rows_calls;
    CHECK(fused_calls > fused0 && grouped0 == grouped_start,
          "alone: every step through the fused slots (%d fused, %d grouped)",
          fused_calls - fused0, grouped0 - grouped_start);
    session *all[SESS];
    for (int i = 0; i < SESS; i++)
        all[i] = &together[i];
    while (together[0].kv && together[0].n < NEW)
        batch_step(be, b, all, SESS);
    if (!few)
        CHECK(grouped_rows_calls > grouped0,
              "together: the first step's 25 rows through gemm_grouped_rows");
    for (int i = 0; i < SESS; i++) {
        CHECK(memcmp(alone[i].ids, together[i].ids, sizeof alone[i].ids) == 0,
              "session %d: the same ids alone and among %d others", i, SESS - 1);
        CHECK(alone[i].bits == together[i].bits,
              "session %d: bit-identical logits alone and among %d others", i, SESS - 1);
        nl_kvcache_destroy(&alone[i].kv);
        nl_kvcache_destroy(&together[i].kv);
        for (session *s : {&alone[i], &together[i]}) {
            nl_sampler_free(&s->smp);
            nl_sampler_free(&s->twin);
        }
    }
    CHECK(bad_syncs == bad_syncs0,
          "%d steps took other than one host sync for their sessions' ids (sample_rows)",
          bad_syncs - bad_syncs0);
    CHECK(host_mismatch == mismatch0, "%d ids sampled on the device differ from the host's",
          host_mismatch - mismatch0);
    if (few) { /* a prompt's chunk of 25 rows: gemm and gemm_grouped, as alone */
        static const int32_t prompt[25] = {0};
        nl_kvcache *kv = nullptr;
        CHECK(nl_kvcache_new(&kv, m, 1, 25, NL_KV_FP32, &err) == NL_OK, "cache: %s", err.msg);
        const nl_batch_seg seg = {kv, prompt, 25, 1};
        const int many0 = many_rows_calls, fused1 = fused_calls;
        CHECK(kv && nl_batch_forward(b, &seg, 1, &err) == NL_OK, "a 25-row step: %s", err.msg);
        CHECK(many_rows_calls == many0 && fused_calls == fused1,
              "few: a 25-row step reached the rows kernels %d times (fused %d)",
              many_rows_calls - many0, fused_calls - fused1);
        nl_kvcache_destroy(&kv);
    }
    nl_batch_destroy(&b);
    nl_model_destroy(&m);
}

} // namespace

int nl_emu_rows_checks(void)
{
    launchers();
    for (int bf16 = 0; bf16 <= 1; bf16++)
        for (int tb = 0; tb <= 1; tb++)
            for (int acc = 0; acc <= 1; acc++) {
                rows_case(37, 77, tb, acc, bf16);
                rows_case(5, 3, tb, acc, bf16);
            }
    rows_case(130, 300, 1, 0, 0); /* K past the unrolled lane loop's 128 */
    grouped_rows_case(19, 70, 0);
    grouped_rows_case(19, 70, 1);
    fused_vs_separate(1, 64, 8, 2, 96);
    fused_vs_separate(15, 300, 8, 2, 40);  /* RMSNorm block 320 threads */
    fused_vs_separate(15, 96, 40, 3, 33);  /* softmax block 64 threads */
    fused_vs_separate(2, 40, 256, 4, 17);  /* softmax block wider than the RMSNorm's */
    fused_vs_separate(40, 33, 5, 2, 21);   /* more rows than a decode's */
    nl_error err = {};
    nl_backend *cpu = nullptr;
    nl_backend_opts opts = {};
    opts.threads = 1;
    if (nl_backend_new(&cpu, "cpu", &opts, &err) != NL_OK) {
        fprintf(stderr, "emu_rows: no CPU backend: %s\n", err.msg);
        return check_fail_count + 1;
    }
    batch_alone_vs_together(cpu, 0); /* a rows kernel fast at any M */
    batch_alone_vs_together(cpu, 1); /* fast at few rows only: CUDA's */
    nl_backend_destroy(&cpu);
    return check_fail_count;
}
