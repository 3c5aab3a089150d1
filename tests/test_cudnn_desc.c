/* The descriptors the CUDA module hands cuDNN's flash attention
 * (kernels/cuda/cudnn_sdpa_desc.h), checked on the CPU against what the CPU
 * attention computes, so CI without a GPU sees them:
 *   - the mask: cuDNN's diagonal band and padding, evaluated element by
 *     element as the frontend's diagonal_band_mask does, against
 *     nl_cpu_attn_range (the CPU kernel's, twin of cuda_mask.cuh's
 *     attn_range), for causal, bidirectional, windows, GQA and a KV cache;
 *   - the layouts: FP32 tensors with padded strides packed by
 *     nl_sdpa_pack_of + nl_sdpa_strided_row (what the packing kernels run)
 *     and read back through the BHSD dims and strides cuDNN is given; the
 *     statistics' strides against backend.h's lse (B, H, T);
 *   - the fallback decision (head dims, documents, a backward with a cache). */
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cuda/cudnn_sdpa_desc.h"
#include "tests/check.h"

#include <stdlib.h>

static nl_attn_shape shape(int B, int T, int past, int kv_cap, int H, int G, int hd)
{
    nl_attn_shape s = {B, T, past, kv_cap, H, G, hd, NULL, 0, NULL, NULL};
    return s;
}

/* Every (query, key) of one shape and mask: the descriptor's mask equals
 * the CPU's; keys past the cache's fill are never seen. */
static int mask_matches(nl_attn_shape s, int bidir, int window)
{
    nl_sdpa_desc d;
    nl_sdpa_describe(&d, s, bidir, window, 0, 0);
    if (d.fallback) {
        fprintf(stderr, "unexpected fallback: %s\n", d.fallback);
        return 0;
    }
    const nl_attn_mask mk = {bidir, window, NULL};
    const int nkeys = s.past + s.T;
    for (int t = 0; t < s.T; t++) {
        int lo, hi;
        nl_cpu_attn_range(&mk, s.past + t, nkeys, &lo, &hi);
        for (int j = 0; j < d.s_kv; j++) {
            const int cpu = j >= lo && j < hi;
            const int dnn = nl_sdpa_desc_sees(&d, t, j);
            if (cpu != dnn) {
                fprintf(stderr,
                        "mask differs: T %d past %d kv_cap %d bidir %d window %d: query %d key %d: "
                        "CPU %d, cuDNN descriptors %d\n",
                        s.T, s.past, s.kv_cap, bidir, window, t, j, cpu, dnn);
                return 0;
            }
        }
    }
    return 1;
}

static void test_masks(void)
{
    static const int Ts[] = {1, 2, 5, 17, 64, 77};
    static const int pasts[] = {0, 1, 3, 40};
    static const int windows[] = {0, 1, 2, 3, 4, 7, 16, 33, 100};
    int cases = 0, bad = 0;
    for (size_t a = 0; a < sizeof Ts / sizeof *Ts; a++)
        for (size_t b = 0; b < sizeof pasts / sizeof *pasts; b++)
            for (int extra = 0; extra <= 9; extra += 9) /* kv_cap exactly full, or roomier */
                for (int bidir = 0; bidir <= 1; bidir++)
                    for (size_t w = 0; w < sizeof windows / sizeof *windows; w++) {
                        const int T = Ts[a], past = pasts[b];
                        const nl_attn_shape s = shape(2, T, past, past + T + extra, 4, 2, 64);
                        bad += !mask_matches(s, bidir, windows[w]);
                        cases++;
                    }
    CHECK(bad == 0, "cuDNN mask descriptors: %d of %d cases differ from the CPU mask", bad, cases);
    printf("masks: %d shapes x masks equal to the CPU attention's, element by element\n", cases);
}

/* The bounds and alignment themselves, for the record. */
static void test_bounds(void)
{
    nl_sdpa_desc d;
    nl_sdpa_describe(&d, shape(1, 8, 0, 8, 2, 2, 64), 0, 0, 0, 0);
    CHECK(d.has_right && d.right_bound == 0 && !d.has_left && !d.bottom_right && !d.padding,
          "causal: right bound 0, top-left, no padding");
    nl_sdpa_describe(&d, shape(1, 8, 0, 8, 2, 2, 64), 0, 4, 0, 0);
    CHECK(d.has_right && d.right_bound == 0 && d.has_left && d.left_bound == 4,
          "causal window 4: right 0, left 4");
    nl_sdpa_describe(&d, shape(1, 8, 0, 8, 2, 2, 64), 1, 0, 0, 0);
    CHECK(!d.has_right && !d.has_left, "bidirectional: no band");
    nl_sdpa_describe(&d, shape(1, 8, 0, 8, 2, 2, 64), 1, 6, 0, 0);
    CHECK(d.has_right && d.right_bound == 3 && d.has_left && d.left_bound == 4,
          "bidirectional window 6: right 3, left 4");
    nl_sdpa_describe(&d, shape(3, 5, 11, 32, 2, 2, 128), 0, 0, 0, 0);
    CHECK(d.bottom_right && d.padding && d.s_q == 5 && d.s_kv == 32 && d.seq_len_q == 5 &&
              d.seq_len_kv == 16,
          "a cache: bottom-right, s_kv = kv_cap 32, seq_len_q 5, seq_len_kv 16 (got %d %d %lld "
          "%d %d)",
          d.bottom_right, d.padding, (long long)d.s_kv, d.seq_len_q, d.seq_len_kv);
    CHECK(d.scale == 1.0f / sqrtf(128.0f), "scale 1/sqrt(hd)");
}

static void test_fallback(void)
{
    nl_sdpa_desc d;
    static const int hds[] = {8, 16, 32, 63, 64, 96, 128, 256};
    for (size_t i = 0; i < sizeof hds / sizeof *hds; i++) {
        nl_sdpa_describe(&d, shape(1, 4, 0, 4, 4, 2, hds[i]), 0, 0, 0, 0);
        const int want = hds[i] == 64 || hds[i] == 128;
        CHECK((d.fallback == NULL) == want, "hd %d: cuDNN %s", hds[i], d.fallback ? "no" : "yes");
    }
    nl_sdpa_describe(&d, shape(1, 4, 0, 4, 4, 2, 64), 0, 0, 1, 0);
    CHECK(d.fallback != NULL, "packed documents fall back");
    nl_sdpa_describe(&d, shape(1, 4, 0, 4, 4, 2, 64), 0, -1, 0, 0);
    CHECK(d.fallback != NULL, "a negative window falls back");
    nl_sdpa_describe(&d, shape(1, 4, 0, 4, 6, 4, 64), 0, 0, 0, 0);
    CHECK(d.fallback != NULL, "H %% G != 0 falls back");
    nl_sdpa_describe(&d, shape(1, 4, 3, 8, 4, 2, 64), 0, 0, 0, 1);
    CHECK(d.fallback != NULL, "a backward with a cache falls back");
    nl_sdpa_describe(&d, shape(1, 4, 3, 8, 4, 2, 64), 0, 0, 0, 0);
    CHECK(d.fallback == NULL, "a forward with a cache runs on cuDNN");
    nl_sdpa_describe(&d, shape(1, 4, 3, 6, 4, 2, 64), 0, 0, 0, 0);
    CHECK(d.fallback != NULL, "kv_cap < past + T falls back");
    nl_sdpa_describe(&d, shape(0, 4, 0, 4, 4, 2, 64), 0, 0, 0, 0);
    CHECK(d.fallback != NULL, "an empty shape falls back (the kernels do nothing)");
    nl_sdpa_describe(&d, shape(2, 4, 0, 4, 4, 4, 128), 1, 0, 0, 1);
    CHECK(d.fallback == NULL, "a bidirectional backward runs on cuDNN");
}

/* value of FP32 element (b, row, col) of a tensor: distinct per element */
static float tag(int b, int row, int col)
{
    return (float)(b * 1000000 + row * 1000 + col);
}

/* Pack one tensor on the host the way the kernel does (FP32 kept, so the
 * check is exact), then read each BHSD element through the descriptor. */
static int layout_matches(nl_attn_shape s, int q_stride, int kv_stride, int which)
{
    nl_sdpa_desc d;
    nl_sdpa_describe(&d, s, 0, 0, 0, 0);
    const nl_sdpa_pack p = nl_sdpa_pack_of(&d, which, s, q_stride, kv_stride);
    const int kv = which == NL_SDPA_K || which == NL_SDPA_V;
    const int heads = kv ? s.G : s.H;
    const int src_rows = kv ? s.kv_cap : s.T;
    const int src_stride = which == NL_SDPA_Q ? q_stride : kv ? kv_stride : s.H * s.hd;
    float *src = calloc((size_t)s.B * src_rows * src_stride, sizeof *src);
    float *dst = calloc((size_t)s.B * p.dst_cap * p.dst_stride, sizeof *dst);
    for (int b = 0; b < s.B; b++)
        for (int r = 0; r < src_rows; r++)
            for (int c = 0; c < src_stride; c++)
                src[((size_t)b * src_rows + r) * src_stride + c] = tag(b, r, c);
    CHECK(p.src_cap == src_rows && p.src_stride == src_stride && p.width == heads * s.hd,
          "pack %d: FP32 side cap %d stride %d width %d", which, p.src_cap, p.src_stride, p.width);
    for (int64_t r = 0; r < (int64_t)p.nseq * p.rows; r++)
        for (int c = 0; c < p.width; c++)
            dst[nl_sdpa_strided_row(r, p.rows, p.dst_cap, p.dst_stride) + c] =
                src[nl_sdpa_strided_row(r, p.rows, p.src_cap, p.src_stride) + c];
    int bad = 0;
    const int rows = kv ? s.past + s.T : s.T;
    for (int b = 0; b < s.B; b++)
        for (int h = 0; h < heads; h++)
            for (int r = 0; r < rows; r++)
                for (int e = 0; e < s.hd; e++) {
                    const int64_t off = nl_sdpa_desc_offset(&d, which, b, h, r, e);
                    bad += dst[off] != tag(b, r, h * s.hd + e);
                }
    /* the dims cover the packed buffer exactly */
    const int64_t *dim = d.dim[which];
    bad += dim[0] != s.B || dim[1] != heads || dim[3] != s.hd || dim[2] != (kv ? d.s_kv : s.T) ||
           dim[2] * dim[1] * dim[3] != (int64_t)p.dst_cap * p.dst_stride;
    free(src);
    free(dst);
    return bad == 0;
}

static void test_layouts(void)
{
    const nl_attn_shape shapes[] = {
        shape(2, 5, 0, 5, 4, 2, 64),   /* GQA 2 */
        shape(3, 7, 0, 7, 2, 2, 128),  /* MHA */
        shape(2, 3, 9, 16, 8, 1, 64),  /* MQA with a cache, roomy kv_cap */
        shape(1, 1, 30, 31, 4, 4, 128) /* a decode step */
    };
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        const nl_attn_shape s = shapes[i];
        /* fused QKV rows: q_stride and kv_stride wider than the heads */
        const int q_stride = (s.H + 2 * s.G) * s.hd, kv_stride = q_stride + 3;
        CHECK(layout_matches(s, q_stride, kv_stride, NL_SDPA_Q), "shape %zu: Q layout", i);
        CHECK(layout_matches(s, q_stride, kv_stride, NL_SDPA_K), "shape %zu: K layout", i);
        CHECK(layout_matches(s, q_stride, kv_stride, NL_SDPA_V), "shape %zu: V layout", i);
        CHECK(layout_matches(s, q_stride, kv_stride, NL_SDPA_O), "shape %zu: O layout", i);
        nl_sdpa_desc d;
        nl_sdpa_describe(&d, s, 0, 0, 0, 0);
        int bad = 0;
        for (int b = 0; b < s.B; b++)
            for (int h = 0; h < s.H; h++)
                for (int t = 0; t < s.T; t++)
                    bad += nl_sdpa_desc_offset(&d, NL_SDPA_STATS, b, h, t, 0) !=
                           ((int64_t)b * s.H + h) * s.T + t;
        CHECK(bad == 0, "shape %zu: stats (B, H, T, 1) is backend.h's lse (B, H, T)", i);
    }
    printf("layouts: Q, K, V, O packed and read back through the cuDNN dims/strides\n");
}

/* Decode steps (a few queries over a cache) are left to the module's
 * kernels; prefill, chunks of 16 or more and the backward go to cuDNN. */
static void test_worth_it(void)
{
    CHECK(!nl_sdpa_worth_it(shape(4, 1, 500, 1024, 8, 2, 64)), "a decode step goes to cuDNN");
    CHECK(!nl_sdpa_worth_it(shape(1, 15, 40, 64, 8, 2, 64)), "15 queries over a cache go to cuDNN");
    CHECK(nl_sdpa_worth_it(shape(1, 16, 40, 64, 8, 2, 64)), "a chunk of 16 does not go to cuDNN");
    CHECK(nl_sdpa_worth_it(shape(8, 1, 0, 1, 8, 2, 64)), "a cacheless call does not go to cuDNN");
    CHECK(!nl_sdpa_worth_it(shape(1, 1, 0, 64, 8, 2, 64)),
          "a one-token prompt into a new session's cache goes to cuDNN");
    CHECK(!nl_sdpa_worth_it(shape(2, 15, 0, 64, 8, 2, 64)),
          "a 15-token prompt into a new cache goes to cuDNN");
    CHECK(nl_sdpa_worth_it(shape(2, 16, 0, 64, 8, 2, 64)),
          "a 16-token prompt into a new cache does not go to cuDNN");
    CHECK(nl_sdpa_worth_it(shape(2, 5, 0, 5, 8, 2, 64)),
          "a 5-token cacheless call does not go to cuDNN");
}

int main(void)
{
    test_worth_it();
    test_masks();
    test_bounds();
    test_fallback();
    test_layouts();
    return check_done("test_cudnn_desc");
}
