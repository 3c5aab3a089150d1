/* The descriptors the CUDA module hands cuDNN's MoE grouped matmul
 * (kernels/cuda/cudnn_moe_desc.h), checked on the CPU so CI without a GPU
 * sees them: a grouped product computed by indexing through exactly the
 * described dims and strides of Token, Weight, FirstTokenOffset and Output,
 * each row's expert found by cuDNN's rule from the offsets, must give the
 * numbers of the backend's gemm_grouped (NL_TEST_DEVICE, the CPU's by
 * default), with the caller's padded strides, empty experts and both
 * weight layouts; every stride the product depends on, bent by one, must
 * break it (so a wrong stride cannot pass); and the calls cuDNN cannot be
 * given must say so. Operands are small integers, so every order of the
 * sums gives the same FP32 bits and the comparison is exact. Also the
 * host's record of each dispatch's total rows (nl_moe_routes), which
 * sizes Token and Output: known only while the offsets hold what
 * moe_route wrote. */
#include "kernels/cuda/cudnn_moe_desc.h"
#include "tests/check.h"

#include <stdlib.h>

/* One gemm_grouped call's arguments and host operands. */
typedef struct grouped {
    int trans_b, N, K, lda, ldb, ldc, groups, T;
    size_t b_stride;
    const int32_t *offsets; /* groups + 1 */
    float *A, *B;           /* T x lda, groups x b_stride */
    size_t a_len, b_len;
} grouped;

#define SENTINEL (-1000.0f)

/* The grouped product as cuDNN would compute it from the descriptor: each
 * element reached through the described strides, each row's expert by
 * nl_moe_expert_of over the offsets read through FirstTokenOffset's dims
 * and strides. out (out_len floats, SENTINEL first) gets Output's elements
 * where its strides put them. 0 when an index leaves its buffer or a row
 * has no expert: a descriptor that reads or writes out of place. */
static int described_product(const nl_moe_desc *d, const grouped *g, float *out, size_t out_len)
{
    for (size_t i = 0; i < out_len; i++)
        out[i] = SENTINEL;
    const size_t off_len = (size_t)g->groups + 1;
    for (int64_t e = 0; e < d->dim[NL_MOE_OFFSET][0]; e++) {
        const int64_t at = nl_moe_offset(d, NL_MOE_OFFSET, e, 0, 0);
        if (at < 0 || (size_t)at >= off_len)
            return 0;
    }
    for (int64_t r = 0; r < d->dim[NL_MOE_TOKEN][1]; r++) {
        const int64_t e = nl_moe_expert_of(d, g->offsets, r);
        if (e < 0 || e >= d->dim[NL_MOE_WEIGHT][0])
            return 0;
        for (int64_t n = 0; n < d->dim[NL_MOE_OUT][2]; n++) {
            double s = 0;
            for (int64_t k = 0; k < d->dim[NL_MOE_TOKEN][2]; k++) {
                const int64_t ia = nl_moe_offset(d, NL_MOE_TOKEN, 0, r, k);
                const int64_t ib = nl_moe_offset(d, NL_MOE_WEIGHT, e, k, n);
                if (ia < 0 || (size_t)ia >= g->a_len || ib < 0 || (size_t)ib >= g->b_len)
                    return 0;
                s += (double)g->A[ia] * g->B[ib];
            }
            const int64_t io = nl_moe_offset(d, NL_MOE_OUT, 0, r, n);
            if (io < 0 || (size_t)io >= out_len)
                return 0;
            out[io] = (float)s;
        }
    }
    return 1;
}

/* The slot's numbers: the backend's gemm_grouped into a C of T x ldc
 * floats, SENTINEL first (rows of empty groups and the padding keep it). */
static float *slot_product(nl_backend *be, const grouped *g)
{
    const size_t a = g->a_len * 4, b = g->b_len * 4, c = (size_t)g->T * g->ldc * 4;
    const size_t o = ((size_t)g->groups + 1) * 4;
    float *dA = be->alloc(be, a), *dB = be->alloc(be, b), *dC = be->alloc(be, c);
    int32_t *dO = be->alloc(be, o);
    float *hc = malloc(c);
    float *got = NULL;
    if (dA && dB && dC && dO && hc) {
        for (size_t i = 0; i < c / 4; i++)
            hc[i] = SENTINEL;
        be->upload(be, dA, g->A, a);
        be->upload(be, dB, g->B, b);
        be->upload(be, dC, hc, c);
        be->upload(be, dO, g->offsets, o);
        be->gemm_grouped(be, g->trans_b, g->N, g->K, dA, g->lda, dB, g->ldb, g->b_stride, dC,
                         g->ldc, dO, g->groups, g->T);
        got = check_download(be, dC, c / 4);
    }
    free(hc);
    be->free(be, dA);
    be->free(be, dB);
    be->free(be, dC);
    be->free(be, dO);
    return got;
}

/* 1 when the described product (Output row stride out_ld) equals the
 * slot's C element by element over the T x N results, and, for an Output
 * laid over C itself (out_ld == ldc), in the padding too. */
static int matches(const nl_moe_desc *d, const grouped *g, const float *ref, int out_ld)
{
    const size_t out_len = (size_t)g->T * out_ld;
    float *out = malloc(out_len * sizeof *out);
    int ok = out && described_product(d, g, out, out_len);
    for (int r = 0; ok && r < g->T; r++)
        for (int c = 0; ok && c < (out_ld == g->ldc ? g->ldc : g->N); c++)
            ok = out[(size_t)r * out_ld + c] == ref[(size_t)r * g->ldc + c];
    free(out);
    return ok;
}

/* Every stride the product reads or writes, bent by one: the comparison
 * must fail. Returns how many bends went unnoticed. */
static int unnoticed_bends(const nl_moe_desc *d, const grouped *g, const float *ref, int out_ld)
{
    static const int which[] = {NL_MOE_TOKEN, NL_MOE_WEIGHT, NL_MOE_OUT, NL_MOE_OFFSET};
    int missed = 0;
    for (size_t w = 0; w < sizeof which / sizeof *which; w++)
        for (int axis = 0; axis < 3; axis++) {
            if (d->dim[which[w]][axis] < 2)
                continue; /* a stride over one element is never used */
            nl_moe_desc bent = *d;
            bent.stride[which[w]][axis] += 1;
            if (matches(&bent, g, ref, out_ld)) {
                fprintf(stderr, "tensor %d axis %d: a stride off by one still matches\n", which[w],
                        axis);
                missed++;
            }
        }
    return missed;
}

static float small_int(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return (float)((int)((*s >> 16) % 7) - 3);
}

/* One shape: both weight layouts, FP32 Output over C and a packed bf16
 * Output; padded strides (pad elements) and the offsets given. */
static void check_shape(nl_backend *be, int N, int K, int pad, const int32_t *offsets, int groups)
{
    const int T = offsets[groups];
    for (int tb = 0; tb < 2; tb++) {
        grouped g = {tb,   N,    K, K + pad, (tb ? K : N) + pad, N + pad, groups, T, 0, offsets,
                     NULL, NULL, 0, 0};
        const int brows = tb ? N : K;
        g.b_stride = (size_t)brows * g.ldb + (size_t)pad;
        g.a_len = (size_t)(T > 0 ? T : 1) * g.lda;
        g.b_len = (size_t)groups * g.b_stride;
        g.A = malloc(g.a_len * sizeof *g.A);
        g.B = malloc(g.b_len * sizeof *g.B);
        unsigned s = (unsigned)(N * 131 + K * 7 + groups + tb);
        for (size_t i = 0; g.A && i < g.a_len; i++)
            g.A[i] = small_int(&s);
        for (size_t i = 0; g.B && i < g.b_len; i++)
            g.B[i] = small_int(&s);
        float *ref = g.A && g.B ? slot_product(be, &g) : NULL;
        CHECK(ref != NULL, "N %d K %d: the slot's product", N, K);
        for (int ob = 2; ref && ob <= 4; ob += 2) {
            const int out_ld = ob == 4 ? g.ldc : N; /* bf16: a packed scratch */
            nl_moe_desc d;
            nl_moe_describe(&d, tb, N, K, g.lda, g.ldb, g.b_stride, out_ld, groups, groups + 1, T,
                            ob);
            CHECK(d.fallback == NULL, "N %d K %d pad %d trans_b %d out %d: refused: %s", N, K, pad,
                  tb, ob, d.fallback ? d.fallback : "");
            if (d.fallback)
                continue;
            CHECK(matches(&d, &g, ref, out_ld),
                  "N %d K %d pad %d groups %d T %d trans_b %d out %d: the described product "
                  "differs from gemm_grouped",
                  N, K, pad, groups, T, tb, ob);
            CHECK(unnoticed_bends(&d, &g, ref, out_ld) == 0,
                  "N %d K %d trans_b %d out %d: a bent stride went unnoticed", N, K, tb, ob);
            CHECK(d.uid[NL_MOE_TOKEN] == 1 && d.uid[NL_MOE_WEIGHT] == 2 &&
                      d.uid[NL_MOE_OFFSET] == 3 && d.uid[NL_MOE_OUT] == 4,
                  "uids");
        }
        free(ref);
        free(g.A);
        free(g.B);
    }
}

static void test_products(nl_backend *be)
{
    static const int32_t four[] = {0, 3, 3, 10, 12};           /* an empty expert inside */
    static const int32_t ends[] = {0, 0, 5, 5, 9, 9};          /* empty first and last */
    static const int32_t one[] = {0, 7};                       /* a single expert */
    static const int32_t lone[] = {0, 0, 0, 13, 13, 13, 13};   /* every row in one */
    static const int32_t many[] = {0, 1, 2, 4, 8, 16, 17, 33}; /* growing groups */
    check_shape(be, 24, 16, 8, four, 4);
    check_shape(be, 16, 40, 0, ends, 5);
    check_shape(be, 8, 8, 16, one, 1);
    check_shape(be, 32, 24, 8, lone, 6);
    check_shape(be, 16, 32, 8, many, 7);
}

/* Calls cuDNN is not given: each names its reason, none describes. */
static void test_refusals(void)
{
    static const struct {
        int tb, N, K, lda, ldb, ldc, groups, offsets_len, out_bytes;
        size_t b_stride;
        int64_t T;
        const char *why; /* a word of the reason */
    } c[] = {
        {1, 16, 16, 16, 16, 16, 4, 5, 4, 256, -1, "not known"},
        {1, 16, 16, 16, 16, 16, 4, 5, 4, 256, 0, "no rows"},
        {1, 16, 16, 16, 16, 16, 4, 5, 4, 256, (int64_t)INT32_MAX + 1, "int32"},
        {1, 16, 16, 16, 16, 16, 0, 1, 4, 256, 10, "no experts"},
        {1, 16, 16, 16, 16, 16, 4, 4, 4, 256, 10, "one per expert"},
        {1, 0, 16, 16, 16, 16, 4, 5, 4, 256, 10, "empty"},
        {1, 16, 16, 16, 16, 16, 4, 5, 3, 256, 10, "FP32 nor bf16"},
        {1, 16, 16, 8, 16, 16, 4, 5, 4, 256, 10, "shorter"},   /* lda < K */
        {1, 16, 24, 24, 16, 16, 4, 5, 4, 384, 10, "shorter"},  /* trans_b: ldb < K */
        {0, 24, 16, 16, 16, 24, 4, 5, 4, 384, 10, "shorter"},  /* ldb < N */
        {1, 16, 16, 16, 16, 8, 4, 5, 4, 256, 10, "shorter"},   /* ldc < N */
        {1, 16, 12, 12, 12, 16, 4, 5, 4, 192, 10, "16 bytes"}, /* K 12: 24-byte rows */
        {1, 16, 16, 16, 16, 18, 4, 5, 2, 256, 10, "16 bytes"}, /* bf16 Output, ldc 18 */
        {1, 16, 16, 16, 16, 17, 4, 5, 4, 256, 10, "16 bytes"}, /* FP32 Output, ldc 17 */
        {1, 16, 16, 16, 16, 16, 4, 5, 4, 260, 10, "16 bytes"}, /* the expert stride */
    };
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        nl_moe_desc d;
        nl_moe_describe(&d, c[i].tb, c[i].N, c[i].K, c[i].lda, c[i].ldb, c[i].b_stride, c[i].ldc,
                        c[i].groups, c[i].offsets_len, c[i].T, c[i].out_bytes);
        CHECK(d.fallback && strstr(d.fallback, c[i].why),
              "case %zu: expected a refusal (%s), got %s", i, c[i].why,
              d.fallback ? d.fallback : "none");
    }
    /* a single expert's stride is never used: any is given */
    nl_moe_desc d;
    nl_moe_describe(&d, 1, 16, 16, 16, 16, 260, 16, 1, 2, 10, 4);
    CHECK(d.fallback == NULL, "one expert, odd stride: %s", d.fallback ? d.fallback : "");
    /* the FP32 Output takes an ldc of 4 floats' multiple, bf16 of 8 */
    nl_moe_describe(&d, 1, 16, 16, 16, 16, 256, 20, 4, 5, 10, 4);
    CHECK(d.fallback == NULL, "FP32 Output at ldc 20: %s", d.fallback ? d.fallback : "");
}

/* The host's record of the dispatches' total rows: known while the offsets
 * hold what moe_route wrote, forgotten by any write or free that touches
 * them (and only those), updated by a new route over the same array. */
static void test_routes(void)
{
    static nl_moe_routes t; /* zeroed: empty */
    static int32_t buf[64], many[NL_MOE_ROUTES + 8][2];
    int32_t *a = buf + 8, *b = buf + 40; /* apart: a write beside one misses the other */
    CHECK(nl_moe_routes_total(&t, a, 8) == -1, "never noted");
    nl_moe_routes_note(&t, a, 8, 100);
    nl_moe_routes_note(&t, b, 8, 7);
    CHECK(nl_moe_routes_total(&t, a, 8) == 100 && nl_moe_routes_total(&t, b, 8) == 7, "noted");
    CHECK(nl_moe_routes_total(&t, a, 4) == -1, "other groups are another array");
    nl_moe_routes_note(&t, a, 8, 64); /* a new route over the same array */
    CHECK(nl_moe_routes_total(&t, a, 8) == 64, "updated: %lld",
          (long long)nl_moe_routes_total(&t, a, 8));
    nl_moe_routes_forget(&t, a + 9, 4);               /* just past a's 9 entries */
    nl_moe_routes_forget(&t, (const char *)a - 4, 4); /* just before */
    CHECK(nl_moe_routes_total(&t, a, 8) == 64, "a write beside the array keeps it");
    nl_moe_routes_forget(&t, (const char *)a + 35, 1); /* a's last byte */
    CHECK(nl_moe_routes_total(&t, a, 8) == -1, "a write over the last entry forgets it");
    CHECK(nl_moe_routes_total(&t, b, 8) == 7, "and nothing else");
    nl_moe_routes_forget(&t, (const char *)b - 100, 101); /* ends at b's first byte */
    CHECK(nl_moe_routes_total(&t, b, 8) == -1, "a write over the first byte forgets it");
    /* more arrays than entries: the oldest replaced in turn, the newest known */
    for (int i = 0; i < NL_MOE_ROUTES + 8; i++)
        nl_moe_routes_note(&t, many[i], 1, i);
    int known = 0;
    for (int i = 0; i < NL_MOE_ROUTES + 8; i++) {
        const int64_t r = nl_moe_routes_total(&t, many[i], 1);
        CHECK(r == -1 || r == i, "array %d: total %lld", i, (long long)r);
        known += r == i;
    }
    CHECK(known == NL_MOE_ROUTES, "%d of %d arrays known", known, NL_MOE_ROUTES);
    CHECK(nl_moe_routes_total(&t, many[NL_MOE_ROUTES + 7], 1) == NL_MOE_ROUTES + 7,
          "the newest is known");
}

int main(void)
{
    nl_backend *be = NULL;
    nl_error err = {0};
    CHECK_OK(check_backend_new(&be, 1, &err), &err);
    if (be)
        test_products(be);
    test_refusals();
    test_routes();
    if (be)
        be->destroy(be);
    return check_done("test_cudnn_moe_desc");
}
