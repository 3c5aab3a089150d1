/* bf16 on CUDA under the CPU emulation (see cuda_runtime.h): the kernels
 * and host code of kernels/cuda/cuda_mixed.cu and the tensor-core grouped
 * GEMMs of cuda_grouped_bf16.cu (with the WMMA shim of mma.h), no GPU.
 *
 *  - conversion: special values (signed zeros, ties to even, the rounding
 *    into inf, inf, quiet and signalling NaNs, subnormals) and random bits,
 *    against an independent reference (the two neighbouring bf16 values
 *    compared in double) and against nl_elem_to_bf16; the strided rows form;
 *  - the master-weight refresh: the weight-range table through a sequence
 *    of GEMM reads, uploads, zeroes, AdamW steps and reported writes, the
 *    copy checked against the floats after each read (a stale copy must
 *    never be read, a fresh one never converted again), AdamW writing the
 *    copy itself when fresh;
 *  - the grouped GEMMs' tile map (empty groups, more groups than the map
 *    kernel's block, groups of one row and of several tiles) against the
 *    host's count, and the lookup of every tile;
 *  - the grouped GEMMs themselves: against a double-precision product of
 *    the bf16-rounded operands (1e-5 norm-wise per row), empty groups left
 *    alone, rows past the last group left alone, NaN in the strides'
 *    padding never read, an understated max_rows. */
#include "tests/check.h"
#include "tests/cuda_emu/cuda_runtime.h"

#include "kernels/cuda/cuda_mixed.cuh"
#include "kernels/cuda/cuda_mixed.h"

#include <math.h>
#include <stdint.h>
#include <vector>

namespace
{

uint64_t rng = 0x5851f42d4c957f2dull;

uint32_t next32(void)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 32);
}

float frand(void) /* uniform in [-1, 1) */
{
    return (float)(next32() & 0xffffff) / (float)0x1000000 * 2.0f - 1.0f;
}

int irand(int n)
{
    return (int)(next32() % (uint32_t)n);
}

float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The independent reference: the nearer of the two bf16 neighbours of x
 * (its truncation and the next value away from zero), compared in double,
 * a tie to the one with an even last bit; past the largest finite bf16
 * the rounding of IEEE (a value at least halfway to 2^128 becomes inf). */
uint16_t ref_bf16(float x)
{
    const uint32_t u = bits(x);
    if (isnan(x))
        return (uint16_t)((u >> 16) | 0x40);
    const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    if (isinf(x))
        return (uint16_t)(u >> 16);
    const double dl = fabs((double)x - (double)from_bits(lo));
    /* hi may be inf (0x7f800000): its distance is to 2^128 */
    const double hv =
        (hi & 0x7fffffffu) == 0x7f800000u ? ldexp(x < 0 ? -1.0 : 1.0, 128) : (double)from_bits(hi);
    const double dh = fabs((double)x - hv);
    if (dl < dh)
        return (uint16_t)(lo >> 16);
    if (dh < dl)
        return (uint16_t)(hi >> 16);
    return (uint16_t)(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
}

/* ---------------------------------------------------------------- conversion */

void test_conversion(void)
{
    std::vector<float> x = {0.0f,
                            -0.0f,
                            1.0f,
                            -1.0f,
                            3.14159265f,
                            65504.0f,
                            1e-40f,
                            -1e-45f,
                            from_bits(0x3f808000u), /* 1 + 2^-8: a tie, stays 1 (even) */
                            from_bits(0x3f818000u), /* a tie, rounds up to the even 0x3f82 */
                            from_bits(0x3f808001u), /* just past a tie: up */
                            from_bits(0x3f807fffu), /* just below: down */
                            from_bits(0x7f7fffffu), /* FLT_MAX: rounds to inf */
                            from_bits(0x7f7f7fffu), /* below the halfway point: finite */
                            from_bits(0x7f7f8000u), /* the halfway point, odd: up to inf */
                            from_bits(0xff7fffffu),
                            INFINITY,
                            -INFINITY,
                            from_bits(0x7fc00000u), /* quiet NaN */
                            from_bits(0x7f800001u), /* signalling NaN: must stay a NaN */
                            from_bits(0xffffffffu),
                            from_bits(0x807fffffu),
                            from_bits(0x00008000u)};
    for (int i = 0; i < 20000; i++)
        x.push_back(from_bits(next32()));
    const size_t n = x.size();
    std::vector<uint16_t> got(n + 2, 0xdead);
    CHECK(nl_cuda_to_bf16(nullptr, got.data() + 1, x.data(), n) == 0, "to_bf16 launch");
    size_t bad = 0, bad_nan = 0;
    for (size_t i = 0; i < n; i++) {
        const uint16_t r = ref_bf16(x[i]);
        if (got[i + 1] != r || nl_elem_to_bf16(x[i]) != r) {
            if (bad++ < 5)
                fprintf(stderr,
                        "to_bf16(%a = 0x%08x): kernel 0x%04x, elem 0x%04x, reference 0x%04x\n",
                        (double)x[i], bits(x[i]), got[i + 1], nl_elem_to_bf16(x[i]), r);
        }
        if (isnan(x[i]) != isnan(nl_elem_from_bf16(got[i + 1])))
            bad_nan++;
    }
    CHECK(bad == 0, "to_bf16: %zu of %zu differ from the reference", bad, n);
    CHECK(bad_nan == 0, "to_bf16: %zu NaNs lost or made", bad_nan);
    CHECK(got[0] == 0xdead && got[n + 1] == 0xdead, "to_bf16 wrote outside its range");
    CHECK(got[1 + 12] == 0x7f80 && got[1 + 13] == 0x7f7f && got[1 + 14] == 0x7f80 &&
              got[1 + 8] == 0x3f80 && got[1 + 9] == 0x3f82,
          "to_bf16: ties or overflow");
    /* the exact values survive the round trip */
    for (int i = -100; i <= 100; i++)
        CHECK(nl_elem_from_bf16(nl_elem_to_bf16((float)i)) == (float)i, "round trip of %d", i);

    /* strided rows: 7 rows of 13 from a source of stride 16 into stride 15 */
    const int R = 7, Cc = 13, ls = 16, ld = 15;
    std::vector<float> src((size_t)R * ls, NAN);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < Cc; c++)
            src[(size_t)r * ls + c] = frand() * 100.0f;
    std::vector<uint16_t> dst((size_t)R * ld, 0xbeef);
    CHECK(nl_cuda_to_bf16_rows(nullptr, dst.data(), ld, src.data(), ls, R, Cc) == 0, "rows launch");
    bool same = true, pad = true;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < ld; c++) {
            if (c < Cc)
                same &= dst[(size_t)r * ld + c] == ref_bf16(src[(size_t)r * ls + c]);
            else
                pad &= dst[(size_t)r * ld + c] == 0xbeef;
        }
    CHECK(same && pad, "to_bf16_rows: values %d, padding untouched %d", same, pad);
    CHECK(nl_cuda_to_bf16_rows(nullptr, dst.data(), 3, src.data(), ls, R, Cc) ==
              (int)cudaErrorInvalidValue,
          "to_bf16_rows: a stride below the width is refused");
}

/* ---------------------------------------------------------------- the refresh */

/* copy[i] == bf16(p[i]) for i in [lo, hi) */
bool copy_matches(const nl_cuda_bf16_range *r, size_t lo, size_t hi)
{
    for (size_t i = lo; i < hi; i++)
        if (r->copy[i] != ref_bf16(r->base[i]))
            return false;
    return true;
}

void test_refresh(void)
{
    const size_t n = 3000;
    std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f), other(500);
    std::vector<uint16_t> copy(n, 0), copy2(500, 0);
    for (size_t i = 0; i < n; i++) {
        p[i] = frand() * 0.05f;
        g[i] = frand() * 1e-3f;
    }
    for (auto &o : other)
        o = frand();
    nl_cuda_bf16_table t;
    memset(&t, 0, sizeof t);
    nl_cuda_bf16_range *r = nl_cuda_bf16_free_entry(&t);
    *r = nl_cuda_bf16_range{p.data(), n, copy.data(), 1};
    nl_cuda_bf16_range *r2 = nl_cuda_bf16_free_entry(&t);
    CHECK(r2 && r2 != r, "a second free entry");
    *r2 = nl_cuda_bf16_range{other.data(), other.size(), copy2.data(), 1};
    CHECK(nl_cuda_bf16_find_base(&t, p.data()) == r && !nl_cuda_bf16_find_base(&t, p.data() + 1),
          "find_base");

    /* a GEMM reads a 10 x 20 operand (stride 100) at p + 700: the range is
     * converted whole, the operand points into the copy */
    const long launches0 = emu_launch_count();
    int rc = -1;
    const uint16_t *w = nl_cuda_bf16_weight_operand(&t, nullptr, p.data() + 700, 10, 20, 100, &rc);
    CHECK(rc == 0 && w == copy.data() + 700 && !r->stale && copy_matches(r, 0, n),
          "first read: converted whole");
    CHECK(r2->stale, "the other range is not touched by a read of the first");
    /* a second read converts nothing */
    const long launches1 = emu_launch_count();
    w = nl_cuda_bf16_weight_operand(&t, nullptr, p.data(), 30, 100, 100, &rc);
    CHECK(w == copy.data() && emu_launch_count() == launches1 && launches1 == launches0 + 1,
          "a fresh range is not converted again (%ld launches)", emu_launch_count() - launches0);
    /* an operand reaching past the range is not a weight: NULL */
    CHECK(!nl_cuda_bf16_weight_operand(&t, nullptr, p.data() + n - 50, 2, 60, 60, &rc),
          "an operand past the range's end is converted as an activation");
    CHECK(!nl_cuda_bf16_weight_operand(&t, nullptr, g.data(), 2, 2, 2, &rc),
          "memory in no range is no weight");

    /* AdamW on a part of a fresh range writes the copy itself */
    uint16_t *ac = nl_cuda_bf16_adamw_copy(&t, p.data() + 1000, 1000);
    CHECK(ac == copy.data() + 1000 && !r->stale, "adamw on a fresh range: its copy");
    CHECK(nl_cuda_adamw_bf16(nullptr, p.data() + 1000, ac, g.data() + 1000, m.data() + 1000,
                             v.data() + 1000, 1000, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f,
                             1.0f) == 0,
          "adamw launch");
    CHECK(copy_matches(r, 0, n), "after adamw: the copy is the updated weights' (no pass)");
    /* the floats match nl_elem_adamw on the host (the FP32 path's formula) */
    {
        bool close = true;
        for (int i = 0; i < 3; i++) {
            float pp = 0.5f, mm = 0, vv = 0;
            float pk = 0.5f, mk = 0, vk = 0;
            nl_elem_adamw(&pp, &mm, &vv, 1e-3f * (i + 1), 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f,
                          0.05f, 1.0f);
            float gk = 1e-3f * (i + 1);
            uint16_t ck = 0;
            nl_cuda_adamw_bf16(nullptr, &pk, &ck, &gk, &mk, &vk, 1, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f,
                               0.1f, 0.05f, 1.0f);
            close &= fabsf(pk - pp) <= 1e-6f * fabsf(pp) && ck == ref_bf16(pk);
        }
        CHECK(close, "adamw_bf16: the FP32 update of nl_elem_adamw and its bf16");
    }
    /* an upload (a write the table is told of) into the range: stale, and
     * AdamW then leaves the copy to the next read */
    for (size_t i = 2000; i < 2100; i++)
        p[i] = frand();
    nl_cuda_bf16_mark(&t, p.data() + 2000, 100 * sizeof(float));
    CHECK(r->stale && r2->stale, "upload marks its range stale");
    CHECK(!nl_cuda_bf16_adamw_copy(&t, p.data(), 10) && r->stale,
          "adamw on a stale range: no copy, stays stale");
    nl_cuda_adamw_bf16(nullptr, p.data(), nullptr, g.data(), m.data(), v.data(), 10, 1e-2f, 0.9f,
                       0.95f, 1e-8f, 0.1f, 0.1f, 0.05f, 1.0f);
    w = nl_cuda_bf16_weight_operand(&t, nullptr, p.data() + 5, 1, 5, 5, &rc);
    CHECK(w == copy.data() + 5 && !r->stale && copy_matches(r, 0, n),
          "the read after an upload and adamw converts again");
    /* zero (a write of 0 bytes marks nothing; of some, everything it touches) */
    nl_cuda_bf16_mark(&t, p.data() + 10, 0);
    CHECK(!r->stale, "an empty write marks nothing");
    for (size_t i = 2990; i < n; i++)
        p[i] = 0.0f;
    nl_cuda_bf16_mark(&t, p.data() + 2990, 10 * sizeof(float));
    CHECK(r->stale, "zero marks stale");
    nl_cuda_bf16_weight_operand(&t, nullptr, p.data(), 1, 1, 1, &rc);
    CHECK(copy_matches(r, 0, n) && copy[2995] == 0, "the read after zero");
    /* a write reported by host code (wrote) just before the range: nothing;
     * overlapping its last float: stale */
    std::vector<float> big(4);
    nl_cuda_bf16_mark(&t, big.data(), sizeof(float));
    CHECK(!r->stale, "a write elsewhere marks nothing");
    nl_cuda_bf16_mark(&t, (const char *)(p.data() + n) - 1, 1);
    CHECK(r->stale, "a write of the range's last byte marks it");
    nl_cuda_bf16_weight_operand(&t, nullptr, p.data(), 1, 1, 1, &rc);
    /* AdamW over floats that are not all in one range: no copy, all marked */
    CHECK(!nl_cuda_bf16_adamw_copy(&t, p.data() + n - 10, 20) && r->stale,
          "adamw past a range's end marks it stale");
    /* forgetting: find_base, then the entry is free for another range */
    memset(r, 0, sizeof *r);
    CHECK(!nl_cuda_bf16_find_base(&t, p.data()) && nl_cuda_bf16_free_entry(&t) == r,
          "a forgotten range's entry is reused");
    int taken = 0;
    while (nl_cuda_bf16_range *e = nl_cuda_bf16_free_entry(&t)) {
        *e = nl_cuda_bf16_range{g.data() + taken, 1, copy.data(), 0};
        taken++;
    }
    CHECK(taken == NL_CUDA_BF16_RANGES - 1, "table capacity: %d more", taken);
}

/* ---------------------------------------------------------------- captured steps */

/* A captured step (CUDA graph) reads the copies when it is replayed: the
 * backend's graph_begin and graph_launch make every stale copy first
 * (nl_cuda_bf16_refresh); while capturing a read of a stale range queues
 * nothing, marks nothing fresh and makes the capture fail. */
void test_capture(void)
{
    const size_t n = 1000;
    std::vector<float> p(n), q(200);
    std::vector<uint16_t> copy(n, 0), copy2(200, 0);
    for (auto &x : p)
        x = frand();
    for (auto &x : q)
        x = frand();
    nl_cuda_bf16_table t;
    memset(&t, 0, sizeof t);
    nl_cuda_bf16_range *r = nl_cuda_bf16_free_entry(&t);
    *r = nl_cuda_bf16_range{p.data(), n, copy.data(), 1};
    nl_cuda_bf16_range *r2 = nl_cuda_bf16_free_entry(&t);
    *r2 = nl_cuda_bf16_range{q.data(), q.size(), copy2.data(), 1};

    /* refresh: every stale range, one conversion each */
    long l0 = emu_launch_count();
    CHECK(nl_cuda_bf16_refresh(&t, nullptr) == 0 && !r->stale && !r2->stale &&
              copy_matches(r, 0, n) && copy_matches(r2, 0, q.size()) &&
              emu_launch_count() == l0 + 2,
          "refresh: both stale ranges made (%ld launches)", emu_launch_count() - l0);
    l0 = emu_launch_count();
    CHECK(nl_cuda_bf16_refresh(&t, nullptr) == 0 && emu_launch_count() == l0,
          "refresh of fresh ranges: nothing queued");

    /* a write in place between replays: the next refresh makes that range
     * only, and the read after it converts nothing */
    p[10] = 123.0f;
    nl_cuda_bf16_mark(&t, p.data() + 10, sizeof(float));
    CHECK(r->stale && !r2->stale, "a write marks its range only");
    l0 = emu_launch_count();
    CHECK(nl_cuda_bf16_refresh(&t, nullptr) == 0 && !r->stale && copy_matches(r, 0, n) &&
              emu_launch_count() == l0 + 1,
          "refresh after a write: the written range, made again");

    /* capturing: a stale read converts nothing and fails the capture */
    p[20] = -7.0f;
    nl_cuda_bf16_mark(&t, p.data() + 20, sizeof(float));
    t.capturing = 1;
    int rc = -1;
    l0 = emu_launch_count();
    const uint16_t *w = nl_cuda_bf16_weight_operand(&t, nullptr, p.data() + 4, 2, 8, 10, &rc);
    CHECK(rc == 0 && w == copy.data() + 4 && r->stale && t.stale_in_capture &&
              emu_launch_count() == l0 && copy[20] != ref_bf16(-7.0f),
          "a stale read while capturing: %ld launches, stale %d, flagged %d",
          emu_launch_count() - l0, r->stale, t.stale_in_capture);
    CHECK(nl_cuda_bf16_refresh(&t, nullptr) == (int)cudaErrorStreamCaptureUnsupported && r->stale,
          "no refresh while capturing");
    /* a fresh read while capturing is no failure */
    t.stale_in_capture = 0;
    w = nl_cuda_bf16_weight_operand(&t, nullptr, q.data(), 1, 5, 5, &rc);
    CHECK(w == copy2.data() && !t.stale_in_capture, "a fresh read while capturing");
    t.capturing = 0;
    CHECK(nl_cuda_bf16_refresh(&t, nullptr) == 0 && !r->stale && copy_matches(r, 0, n),
          "after the capture: refreshed");
}

/* ---------------------------------------------------------------- tile map */

void test_tile_map(void)
{
    const int cases[][2] = {{1, 1},   {8, 0},    {8, 5},      {8, 300}, {3, 129},
                            {300, 7}, {700, 40}, {256, 1000}, {257, 3}};
    for (const auto &cs : cases) {
        const int G = cs[0], scale = cs[1];
        std::vector<int32_t> off(G + 1, 0);
        for (int gi = 0; gi < G; gi++) {
            const int kind = irand(4); /* empty, one row, a tile's worth, random */
            const int rows = scale == 0  ? 0
                             : kind == 0 ? 0
                             : kind == 1 ? 1
                             : kind == 2 ? 128 * (1 + irand(2))
                                         : irand(scale + 1);
            off[gi + 1] = off[gi] + rows;
        }
        for (int TR : {128, 64, 1}) {
            std::vector<int32_t> ts(G + 3, -7);
            CHECK(nl_cuda_tile_map(nullptr, ts.data() + 1, off.data(), G, TR) == 0, "map launch");
            bool ok = ts[0] == -7 && ts[G + 2] == -7 && ts[1] == 0;
            int max_rows = 0;
            for (int gi = 0; gi < G; gi++) {
                const int rows = off[gi + 1] - off[gi];
                max_rows = rows > max_rows ? rows : max_rows;
                ok &= ts[gi + 2] - ts[gi + 1] == (rows + TR - 1) / TR;
            }
            CHECK(ok, "tile map G %d tile %d: counts", G, TR);
            /* every tile's lookup lands in a group that has it */
            const int32_t *map = ts.data() + 1;
            const int total = map[G];
            bool found = true;
            for (int tt = 0; tt < total; tt++) {
                const int gi = nl_cuda_tile_lookup(map, G, tt);
                const int row0 = (tt - map[gi]) * TR;
                found &= gi >= 0 && gi < G && map[gi] <= tt && tt < map[gi + 1] &&
                         row0 < off[gi + 1] - off[gi];
            }
            CHECK(found, "tile map G %d tile %d: lookup", G, TR);
            CHECK(nl_cuda_tile_bound(G, max_rows, -1, TR) >= total &&
                      nl_cuda_tile_bound(G, max_rows, off[G], TR) >= total,
                  "tile bound G %d: %ld, %ld < %d tiles", G,
                  nl_cuda_tile_bound(G, max_rows, -1, TR),
                  nl_cuda_tile_bound(G, max_rows, off[G], TR), total);
        }
    }
    CHECK(nl_cuda_tile_map(nullptr, nullptr, nullptr, -1, 128) == (int)cudaErrorInvalidValue &&
              nl_cuda_tile_map(nullptr, nullptr, nullptr, 4, 0) == (int)cudaErrorInvalidValue,
          "tile map: bad shapes refused");
}

/* ---------------------------------------------------------------- grouped GEMM */

float rb(float x) /* round to bf16 and back */
{
    return nl_elem_from_bf16(ref_bf16(x));
}

/* ||got - ref|| <= tol ||ref|| (or tol absolute for a zero row) per row */
bool rows_close(const float *got, const double *ref, int rows, int cols, int ldg, double tol,
                const char *what)
{
    for (int r = 0; r < rows; r++) {
        double num = 0, den = 0;
        for (int c = 0; c < cols; c++) {
            const double d = got[(size_t)r * ldg + c] - ref[(size_t)r * cols + c];
            num += d * d;
            den += ref[(size_t)r * cols + c] * ref[(size_t)r * cols + c];
        }
        if (!(sqrt(num) <= tol * (den > 0 ? sqrt(den) : 1.0))) {
            fprintf(stderr, "%s: row %d: error %.3g of %.3g\n", what, r, sqrt(num), sqrt(den));
            return false;
        }
    }
    return true;
}

void grouped_case(int trans_b, int N, int K, const std::vector<int> &counts, int max_rows_given)
{
    const int G = (int)counts.size();
    std::vector<int32_t> off(G + 1, 0);
    for (int gi = 0; gi < G; gi++)
        off[gi + 1] = off[gi] + counts[gi];
    const int rows = off[G], extra = 3; /* rows past the last group: left alone */
    const int lda = K + 2, ldb = (trans_b ? K : N) + 3, ldc = N + 1;
    const size_t b_stride = (size_t)(trans_b ? N : K) * ldb + 5;
    std::vector<float> A((size_t)(rows + extra) * lda, NAN), B(b_stride * G, NAN);
    std::vector<float> C((size_t)(rows + extra) * ldc, NAN);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < K; c++)
            A[(size_t)r * lda + c] = frand();
    for (int gi = 0; gi < G; gi++)
        for (int i = 0; i < (trans_b ? N : K); i++)
            for (int j = 0; j < (trans_b ? K : N); j++)
                B[gi * b_stride + (size_t)i * ldb + j] = frand() * 0.1f;
    std::vector<int32_t> ts(G + 1);
    int max_rows = 0;
    for (int c : counts)
        max_rows = c > max_rows ? c : max_rows;
    const int given = max_rows_given > 0 ? max_rows_given : max_rows;
    CHECK(nl_cuda_gemm_grouped_bf16(nullptr, trans_b, N, K, A.data(), lda, B.data(), ldb, b_stride,
                                    C.data(), ldc, off.data(), G, given, ts.data()) == 0,
          "grouped launch");
    std::vector<double> ref((size_t)(rows > 0 ? rows : 1) * N, 0.0);
    for (int gi = 0; gi < G; gi++)
        for (int r = off[gi]; r < off[gi + 1]; r++)
            for (int j = 0; j < N; j++) {
                double s = 0;
                for (int p = 0; p < K; p++) {
                    const float bv = trans_b ? B[gi * b_stride + (size_t)j * ldb + p]
                                             : B[gi * b_stride + (size_t)p * ldb + j];
                    s += (double)rb(A[(size_t)r * lda + p]) * rb(bv);
                }
                ref[(size_t)r * N + j] = s;
            }
    char what[96];
    snprintf(what, sizeof what, "grouped trans_b %d N %d K %d G %d max_rows %d", trans_b, N, K, G,
             given);
    CHECK(rows_close(C.data(), ref.data(), rows, N, ldc, 1e-5, what), "%s", what);
    bool alone = true;
    for (int r = 0; r < rows + extra; r++)
        for (int c = r < rows ? N : 0; c < ldc; c++)
            alone &= isnan(C[(size_t)r * ldc + c]);
    CHECK(alone, "%s: wrote padding or rows past the groups", what);
}

void wgrad_case(int M, int N, const std::vector<int> &counts)
{
    const int G = (int)counts.size();
    std::vector<int32_t> off(G + 1, 0);
    for (int gi = 0; gi < G; gi++)
        off[gi + 1] = off[gi] + counts[gi];
    const int rows = off[G];
    const int lda = M + 1, ldb = N + 2, ldc = N + 3;
    const size_t c_stride = (size_t)M * ldc + 7;
    std::vector<float> A((size_t)(rows > 0 ? rows : 1) * lda, NAN),
        B((size_t)(rows > 0 ? rows : 1) * ldb, NAN), C(c_stride * G, NAN);
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < M; c++)
            A[(size_t)r * lda + c] = frand();
        for (int c = 0; c < N; c++)
            B[(size_t)r * ldb + c] = frand();
    }
    for (int gi = 0; gi < G; gi++)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++)
                C[gi * c_stride + (size_t)i * ldc + j] = frand(); /* += onto these */
    std::vector<float> C0(C);
    CHECK(nl_cuda_gemm_grouped_wgrad_bf16(nullptr, M, N, A.data(), lda, B.data(), ldb, C.data(),
                                          ldc, c_stride, off.data(), G) == 0,
          "wgrad launch");
    char what[96];
    for (int gi = 0; gi < G; gi++) {
        std::vector<double> ref((size_t)M * N);
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                double s = C0[gi * c_stride + (size_t)i * ldc + j];
                for (int r = off[gi]; r < off[gi + 1]; r++)
                    s += (double)rb(A[(size_t)r * lda + i]) * rb(B[(size_t)r * ldb + j]);
                ref[(size_t)i * N + j] = s;
            }
        snprintf(what, sizeof what, "wgrad M %d N %d group %d of %d (%d rows)", M, N, gi, G,
                 counts[gi]);
        if (counts[gi] == 0)
            CHECK(memcmp(&C[gi * c_stride], &C0[gi * c_stride], (size_t)M * ldc * sizeof(float)) ==
                      0,
                  "%s: an empty group's C changed", what);
        else
            CHECK(rows_close(&C[gi * c_stride], ref.data(), M, N, ldc, 1e-5, what), "%s", what);
        bool pad = true;
        for (int i = 0; i < M; i++)
            for (int j = N; j < ldc; j++)
                pad &= isnan(C[gi * c_stride + (size_t)i * ldc + j]);
        CHECK(pad, "%s: wrote the padding", what);
    }
}

void test_grouped(void)
{
    grouped_case(1, 40, 48, {0, 1, 130, 7, 0, 64}, 0); /* empty, one row, > one tile */
    grouped_case(0, 70, 33, {5, 0, 129, 2}, 0);        /* odd widths, a 2-tile group */
    grouped_case(1, 16, 16, {200, 3}, 60);             /* max_rows below the truth */
    grouped_case(1, 8, 5, {0, 0, 0}, 4);               /* every group empty */
    wgrad_case(40, 70, {0, 1, 37, 150});               /* empty, one row, > a slice */
    wgrad_case(130, 33, {9, 0});                       /* M past one tile */
    /* bad shapes are refused, nothing launched */
    const long before = emu_launch_count();
    CHECK(nl_cuda_gemm_grouped_bf16(nullptr, 1, -1, 4, nullptr, 4, nullptr, 4, 0, nullptr, 4,
                                    nullptr, 1, 1, nullptr) == (int)cudaErrorInvalidValue &&
              nl_cuda_gemm_grouped_wgrad_bf16(nullptr, 4, 4, nullptr, 4, nullptr, 4, nullptr, 4, 0,
                                              nullptr, 70000) == (int)cudaErrorInvalidValue &&
              emu_launch_count() == before,
          "grouped: bad shapes refused");
}

} // namespace

int main(void)
{
    test_conversion();
    test_refresh();
    test_capture();
    test_tile_map();
    test_grouped();
    return check_done("test_cuda_emu_bf16");
}
