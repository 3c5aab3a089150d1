/* neuroctl selftest, the model variants of DESIGN.md section 6: the
 * optional slots geglu_forward, rope_scaled_forward (YaRN) and
 * attention_masked_forward, and where the target can train geglu_backward
 * and attention_masked_backward, against the reference backend on random
 * inputs. Masks: bidirectional (an encoder), local windows (causal and
 * bidirectional, over T a few times the window, and a windowed decode
 * step over a cache), packed rows of several documents, and windows with
 * documents. A target that leaves a slot NULL gets a "skip" line naming it
 * (core refuses the variant by name at model creation there).
 * Tolerances and error measure as cmd_selftest.c's: element-wise 1e-6,
 * attention 1e-5 of each tensor's max |ref|. */
#include <stdio.h>
#include <stdlib.h>

#include "cli/selftest.h"

#define DEV nl_selftest_dev
#define RND nl_selftest_rnd

/* 1 when the target has the slot, else a skip line. */
static int present(nl_selftest *c, const void *slot, const char *check, const char *shape)
{
    if (slot)
        return 1;
    printf("skip  %-22s  %-46s  (not on %s)\n", check, shape, c->be[1]->name);
    return 0;
}

static double cmp_all(nl_selftest *c, const pair *p, size_t n)
{
    return nl_selftest_cmp_cols(c, p, 1, n, 0, n);
}

static void check_geglu(nl_selftest *c, int N, int F)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d F=%d", N, F);
    if (!present(c, (const void *)c->be[1]->geglu_forward, "geglu_forward", shape))
        return;
    const size_t n = (size_t)N * F;
    pair *gu = DEV(c, RND(c, 2 * n, -6, 6), 2 * n * 4), *out = DEV(c, NULL, n * 4);
    if (!c->oom)
        BOTH(c, be->geglu_forward(be, D(out), D(gu), N, F));
    nl_selftest_done(c, "geglu_forward", shape, cmp_all(c, out, n), TOL_ELEM);
}

static void check_geglu_backward(nl_selftest *c, int N, int F)
{
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d F=%d", N, F);
    if (!present(c, (const void *)c->be[1]->geglu_backward, "geglu_backward", shape))
        return;
    const size_t n = (size_t)N * F;
    pair *gu = DEV(c, RND(c, 2 * n, -6, 6), 2 * n * 4), *dh = DEV(c, RND(c, n, -1, 1), n * 4);
    pair *dgu = DEV(c, RND(c, 2 * n, -1, 1), 2 * n * 4);
    if (!c->oom)
        BOTH(c, be->geglu_backward(be, D(dgu), D(dh), D(gu), N, F));
    nl_selftest_done(c, "geglu_backward", shape, cmp_all(c, dgu, 2 * n), TOL_ELEM);
}

static void check_rope_yarn(nl_selftest *c, int N, int heads, int hd, double factor, int L0,
                            int maxpos)
{
    char shape[96];
    snprintf(shape, sizeof shape, "N=%d heads=%d hd=%d yarn s=%g L0=%d pos<%d", N, heads, hd,
             factor, L0, maxpos);
    if (!present(c, (const void *)c->be[1]->rope_scaled_forward, "rope_scaled_forward", shape))
        return;
    const int row = heads * hd;
    int32_t *pos = nl_selftest_ids(c, (size_t)N, maxpos);
    if (pos)
        pos[0] = maxpos - 1;
    pair *x = DEV(c, RND(c, (size_t)N * row, -1, 1), (size_t)N * row * 4);
    pair *pp = DEV(c, pos, (size_t)N * 4);
    const nl_rope_scaling sc = {.type = NL_ROPE_YARN,
                                .original_max_seq_len = L0,
                                .factor = factor,
                                .beta_fast = 32,
                                .beta_slow = 1};
    if (!c->oom)
        BOTH(c, be->rope_scaled_forward(be, D(x), D(pp), N, row, 0, heads, hd, 10000.0f, sc));
    nl_selftest_done(c, "rope_scaled_forward", shape, cmp_all(c, x, (size_t)N * row), TOL_ELEM);
}

/* docs > 0: that many documents per sequence, of uneven lengths. */
static int32_t *doc_ids(nl_selftest *c, int B, int T, int docs)
{
    int32_t *d = nl_selftest_hbuf(c, (size_t)B * T * sizeof *d);
    for (int b = 0; d && b < B; b++)
        for (int t = 0, id = 0; t < T; t++) {
            while (id + 1 < docs && t >= T * (id + 2) / (docs + 3))
                id++;
            d[(size_t)b * T + t] = id;
        }
    return d;
}

/* q, k, v as column slices of one (B T, (H + 2G) hd) buffer without a cache
 * (past 0), or with past > 0 a query buffer and a cache of past + T rows
 * per sequence (no documents then) */
static void check_masked(nl_selftest *c, int B, int T, int past, int H, int G, int hd, int bidir,
                         int window, int docs)
{
    char shape[112];
    snprintf(shape, sizeof shape, "B=%d T=%d past=%d H=%d G=%d hd=%d bidir=%d W=%d docs=%d", B, T,
             past, H, G, hd, bidir, window, docs);
    if (!present(c, (const void *)c->be[1]->attention_masked_forward, "attention_masked_forward",
                 shape))
        return;
    const int cap = past + T, packed = past == 0;
    nl_attn_shape s = {.B = B, .T = T, .past = past, .kv_cap = cap, .H = H, .G = G, .hd = hd};
    const int qs = packed ? (H + 2 * G) * hd : H * hd, ks = packed ? qs : G * hd;
    const size_t nq = (size_t)B * T * qs, nkv = (size_t)B * cap * ks;
    pair *q = DEV(c, RND(c, nq, -1, 1), nq * 4), *k = q, *v = q;
    if (!packed) {
        k = DEV(c, RND(c, nkv, -1, 1), nkv * 4);
        v = DEV(c, RND(c, nkv, -1, 1), nkv * 4);
    }
    const size_t koff = packed ? (size_t)H * hd : 0, voff = packed ? (size_t)(H + G) * hd : 0;
    pair *out = DEV(c, NULL, (size_t)B * T * H * hd * 4),
         *lse = DEV(c, NULL, (size_t)B * H * T * 4);
    pair *dp = docs > 0 ? DEV(c, doc_ids(c, B, T, docs), (size_t)B * T * 4) : NULL;
    if (!c->oom)
        BOTH(c,
             be->attention_masked_forward(
                 be, D(out), D(lse), D(q), qs, (const float *)D(k) + koff,
                 (const float *)D(v) + voff, ks, s,
                 (nl_attn_mask){
                     .bidir = bidir, .window = window, .doc = dp ? (const int32_t *)D(dp) : NULL}));
    nl_selftest_done(
        c, "attention_masked_forward", shape,
        max2(cmp_all(c, out, (size_t)B * T * H * hd), cmp_all(c, lse, (size_t)B * H * T)),
        TOL_ATTN);
}

static void check_masked_backward(nl_selftest *c, int B, int T, int H, int G, int hd, int bidir,
                                  int window, int docs)
{
    char shape[112];
    snprintf(shape, sizeof shape, "B=%d T=%d H=%d G=%d hd=%d bidir=%d W=%d docs=%d packed", B, T, H,
             G, hd, bidir, window, docs);
    if (!present(c, (const void *)c->be[1]->attention_masked_backward, "attention_masked_backward",
                 shape))
        return;
    nl_attn_shape s = {.B = B, .T = T, .past = 0, .kv_cap = T, .H = H, .G = G, .hd = hd};
    const int qs = (H + 2 * G) * hd, ko = H * hd, vo = (H + G) * hd;
    const size_t N = (size_t)B * T, nq = N * qs, no = N * H * hd;
    pair *qkv = DEV(c, RND(c, nq, -1, 1), nq * 4), *dqkv = DEV(c, RND(c, nq, -1, 1), nq * 4);
    pair *out = DEV(c, NULL, no * 4), *lse = DEV(c, NULL, (size_t)B * H * T * 4);
    pair *dout = DEV(c, RND(c, no, -1, 1), no * 4);
    pair *dp = docs > 0 ? DEV(c, doc_ids(c, B, T, docs), N * 4) : NULL;
    if (!c->oom) {
        nl_backend *r = c->be[0];
        const float *q = qkv->d[0];
        const nl_attn_mask mk = {
            .bidir = bidir, .window = window, .doc = dp ? (const int32_t *)dp->d[0] : NULL};
        r->attention_masked_forward(r, out->d[0], lse->d[0], q, qs, q + ko, q + vo, qs, s, mk);
        nl_selftest_mirror(c, out);
        nl_selftest_mirror(c, lse);
        BOTH(c,
             be->attention_masked_backward(
                 be, D(dqkv), (float *)D(dqkv) + ko, (float *)D(dqkv) + vo, D(dout), D(qkv), qs,
                 (const float *)D(qkv) + ko, (const float *)D(qkv) + vo, qs, D(out), D(lse), s,
                 (nl_attn_mask){
                     .bidir = bidir, .window = window, .doc = dp ? (const int32_t *)D(dp) : NULL}));
    }
    double e = nl_selftest_cmp_cols(c, dqkv, N, qs, 0, ko);
    e = max2(e, nl_selftest_cmp_cols(c, dqkv, N, qs, ko, vo - ko));
    e = max2(e, nl_selftest_cmp_cols(c, dqkv, N, qs, vo, qs - vo));
    nl_selftest_done(c, "attention_masked_backward", shape, e, TOL_ATTN);
}

void nl_selftest_family(nl_selftest *c)
{
    check_geglu(c, 17, 343);
    check_geglu(c, 1, 1);
    check_rope_yarn(c, 17, 6, 64, 4.0, 512, 8192);
    check_rope_yarn(c, 5, 2, 128, 8.0, 4096, 32768);
    /* B T past H G hd bidir window docs */
    check_masked(c, 2, 100, 0, 4, 2, 16, 1, 16, 0);   /* the encoder windows */
    check_masked(c, 1, 300, 0, 4, 1, 64, 0, 64, 0);   /* causal window */
    check_masked(c, 2, 130, 0, 4, 4, 128, 1, 0, 0);   /* global encoder */
    check_masked(c, 2, 100, 0, 2, 1, 64, 1, 0, 3);    /* packed rows of 3 documents */
    check_masked(c, 2, 90, 0, 4, 2, 32, 0, 20, 3);    /* packed local decoder */
    check_masked(c, 2, 1, 999, 4, 1, 64, 0, 64, 0);   /* windowed decode over a cache */
    check_masked(c, 1, 37, 200, 2, 1, 128, 0, 50, 0); /* windowed prefill over a cache */
    if (!c->be[1]->can_train)
        return;
    check_geglu_backward(c, 17, 343);
    check_geglu_backward(c, 1, 1);
    check_masked_backward(c, 2, 100, 2, 1, 16, 1, 16, 0);
    check_masked_backward(c, 1, 130, 4, 2, 64, 0, 32, 0);
    check_masked_backward(c, 2, 77, 4, 4, 128, 1, 0, 0);
    check_masked_backward(c, 2, 100, 2, 1, 64, 1, 16, 3);
    check_masked_backward(c, 2, 90, 4, 2, 32, 0, 0, 3);
}
