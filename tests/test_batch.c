/* The batched decoder (core/model/batch.c): its logits follow nl_forward's with
 * the KV cache; 16 seeded sampled generations run together (7 where a step
 * of 16 rows leaves gemm_rows: test_alone_vs_together), with chunked
 * prefill interleaved, give the ids each gives alone; a model split in
 * two stages (hidden states from one batch into the next) gives the
 * whole model's logits bit for bit; the embedding is the L2-normalised
 * mean of the final-normed states; bad input is refused without touching
 * the caches. The backend's row-invariant GEMM (gemm_rows), on which the
 * batch's invariance rests, gives every row the same bits for any M; and
 * the invariance holds through padding too, where a backend has none.
 * Consecutive sessions decoding one position make one attention call and
 * one cache write a layer. */
#include "core/model/batch.h"
#include "core/model/forward.h"
#include "core/model/sampler.h"
#include "kernels/cpu/cpu_ops.h"
#include "tests/check.h"

#include <stdint.h>

#define NSEQ 16
#define NEW 40
#define CHUNK 8

static nl_config test_config(void)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 64;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.ffn_dim = 96;
    c.vocab_size = 300;
    c.vocab_chunk = 128;
    c.max_seq_len = 64;
    nl_config_fill_derived(&c);
    return c;
}

/* The caches' type (test_alone_vs_together runs with each). */
static nl_kv_dtype kv_kind = NL_KV_FP32;

/* One sequence's generation state. */
typedef struct gen {
    int32_t prompt[24];
    int P, fed, n;
    int32_t ids[NEW];
    uint64_t bits; /* FNV-1a of every logit it sampled from: bit-identity */
    nl_kvcache *kv;
    nl_sampler smp;
} gen;

static void gen_start(gen *g, nl_model *m, int i, nl_error *err)
{
    memset(g, 0, sizeof *g);
    g->bits = 14695981039346656037ull;
    g->P = 3 + (i * 5) % 19; /* 3 .. 21: several prefill chunks */
    for (int t = 0; t < g->P; t++)
        g->prompt[t] = (int32_t)((i * 31 + t * 7) % 300);
    CHECK_OK(nl_kvcache_new(&g->kv, m, 1, g->P + NEW, kv_kind, err), err);
    CHECK_OK(nl_sampler_init(&g->smp, 300, 0.9f, 0.95f, (uint64_t)(100 + i), err), err);
}

static void gen_end(gen *g)
{
    nl_kvcache_destroy(&g->kv);
    nl_sampler_free(&g->smp);
}

/* The attention calls the steps should have made (a run of two or more
 * consecutive segments decoding one position: one a layer; any other
 * segment: one a layer), and how many steps had such a run. */
static uint64_t attn_expected, multi_steps;

/* Step every unfinished sequence of gs once (a decode step, or the next
 * prefill chunk of at most one sequence still in its prompt, as a server
 * schedules them). Returns how many sequences took part. */
static int step(nl_batch *b, gen **gs, int n, nl_error *err)
{
    nl_batch_seg segs[NSEQ];
    gen *who[NSEQ];
    int ns = 0, prefilling = 0;
    for (int i = 0; i < n; i++) {
        gen *g = gs[i];
        if (g->n == NEW)
            continue;
        if (g->fed < g->P) {
            if (prefilling)
                continue;
            prefilling = 1;
            int T = g->P - g->fed < CHUNK ? g->P - g->fed : CHUNK;
            segs[ns] = (nl_batch_seg){g->kv, g->prompt + g->fed, T, g->fed + T == g->P};
            g->fed += T;
        } else {
            segs[ns] = (nl_batch_seg){g->kv, &g->ids[g->n - 1], 1, 1};
        }
        who[ns++] = g;
    }
    if (ns == 0)
        return 0;
    /* a run of two or more consecutive one-position segments is one call a
     * layer, any other segment one of its own */
    uint64_t groups = 0, runs = 0;
    for (int i = 0; i < ns;) {
        int j = i + 1;
        while (segs[i].T == 1 && j < ns && segs[j].T == 1)
            j++;
        groups++;
        runs += j - i >= 2;
        i = j;
    }
    attn_expected += (uint64_t)gs[0]->kv->n_layers * groups;
    multi_steps += runs > 0;
    nl_status st = nl_batch_forward(b, segs, ns, err);
    CHECK(st == NL_OK, "batch forward: %s", err->msg);
    if (st != NL_OK)
        return 0;
    for (int i = 0; i < ns; i++) {
        if (!segs[i].want_logits)
            continue;
        const float *lg = nl_batch_logits(b, i, err);
        const unsigned char *p = (const unsigned char *)lg;
        for (size_t j = 0; j < 300 * sizeof(float); j++)
            who[i]->bits = (who[i]->bits ^ p[j]) * 1099511628211ull;
        who[i]->ids[who[i]->n++] = nl_sampler_sample(&who[i]->smp, lg);
    }
    return ns;
}

/* Where gemm_rows is fast only at a few rows (gemm_rows_few: CUDA, and
 * cpu-devsim, which models it), a step of NL_BACKEND_FUSED_ROWS rows or
 * more runs gemm, whose bits may depend on the rows (docs/serving.md,
 * "Batching"): there the sequences decode together 7 at a time, so that a
 * step's rows, 6 decoding and a prompt's chunk of 8, stay below 16. */
static void test_alone_vs_together(nl_model *m)
{
    nl_error err = {0};
    nl_batch *b = NULL;
    static gen solo[NSEQ], together[NSEQ];
    const int nseq = m->be->gemm_rows_few ? NL_BACKEND_FUSED_ROWS - CHUNK - 1 : NSEQ;
    CHECK_OK(nl_batch_new(&b, m, NSEQ + CHUNK, &err), &err);
    if (!b)
        return;
    for (int i = 0; i < nseq; i++) {
        gen *g = &solo[i];
        gen_start(g, m, i, &err);
        while (step(b, &g, 1, &err) > 0)
            ;
    }
    gen *all[NSEQ];
    for (int i = 0; i < nseq; i++) {
        gen_start(&together[i], m, i, &err);
        all[i] = &together[i];
    }
    int steps = 0, widest = 0, s;
    const nl_batch_call_stats calls0 = nl_batch_calls(b);
    const uint64_t replays0 = nl_batch_graphs(b).replays;
    attn_expected = multi_steps = 0;
    while ((s = step(b, all, nseq, &err)) > 0) {
        steps++;
        widest = s > widest ? s : widest;
    }
    CHECK(widest == nseq, "all %d decoded in one batch at some step (widest %d)", nseq, widest);
    /* the decoding sessions' attention is one call a layer for each run of
     * them (a replayed recording, whose step is one segment's or one run,
     * queues none: a layer's call less each) */
    const uint64_t replayed = nl_batch_graphs(b).replays - replays0;
    const uint64_t want = attn_expected - replayed * (uint64_t)m->cfg.num_layers;
    const nl_batch_call_stats calls = nl_batch_calls(b);
    CHECK(multi_steps >= NEW / 2 && calls.attention - calls0.attention == want,
          "together: %llu attention calls, %llu expected (%llu decode steps, %llu replayed)",
          (unsigned long long)(calls.attention - calls0.attention), (unsigned long long)want,
          (unsigned long long)multi_steps, (unsigned long long)replayed);
    /* and its cache writes one call a layer, where the backend has kv_store_seq */
    CHECK(!m->be->kv_store_seq || calls.kv_writes - calls0.kv_writes == want,
          "together: %llu cache writes, %llu expected",
          (unsigned long long)(calls.kv_writes - calls0.kv_writes), (unsigned long long)want);
    for (int i = 0; i < nseq; i++) {
        CHECK(together[i].n == NEW, "sequence %d: %d ids", i, together[i].n);
        CHECK(memcmp(solo[i].ids, together[i].ids, sizeof solo[i].ids) == 0,
              "sequence %d: the same ids alone and among %d others", i, nseq - 1);
        CHECK(solo[i].bits == together[i].bits,
              "sequence %d: bit-identical logits alone and among %d others", i, nseq - 1);
        gen_end(&solo[i]);
        gen_end(&together[i]);
    }
    nl_batch_destroy(&b);
    nl_batch_destroy(&b); /* safe twice */
}

/* Greedy decoding through the batch follows nl_forward's logits (with
 * gemm_rows, bit for bit: the prompt's 11 rows and the decode's 1 are
 * below NL_BACKEND_FUSED_ROWS). The batch reads the prompt in chunks of 6
 * and 5: CUDA runs an attention call of at most 4 new positions on its
 * decode kernel, whose sums go in another order than the prefill
 * kernel's, so a chunk that short would not give the bits of the whole
 * prompt read at once (docs/serving.md). */
static void test_matches_forward(nl_model *m)
{
    nl_error err = {0};
    nl_batch *b = NULL;
    nl_runstate *rs = NULL;
    nl_kvcache *kv1 = NULL, *kv2 = NULL;
    const int V = 300, P = 11;
    int32_t prompt[11] = {5, 17, 250, 3, 3, 99, 140, 7, 1, 42, 8};
    float *ref = malloc(V * sizeof *ref);
    CHECK_OK(nl_batch_new(&b, m, 8, &err), &err);
    CHECK_OK(nl_runstate_new(&rs, m, P, &err), &err);
    CHECK_OK(nl_kvcache_new(&kv1, m, 1, 32, NL_KV_FP32, &err), &err);
    CHECK_OK(nl_kvcache_new(&kv2, m, 1, 32, NL_KV_FP32, &err), &err);
    if (!b || !rs || !kv1 || !kv2 || !ref)
        goto out;
    nl_forward_args a = {.B = 1, .T = P, .tokens = prompt, .kv = kv1, .last_only = 1};
    /* the batch takes the prompt in chunks of 6 and 5 */
    nl_batch_seg s1 = {kv2, prompt, 6, 0}, s2 = {kv2, prompt + 6, 5, 1};
    CHECK_OK(nl_batch_forward(b, &s1, 1, &err), &err);
    int32_t next = 0;
    for (int i = 0; i < 8; i++) {
        CHECK_OK(nl_forward(m, rs, &a, NULL, &err), &err);
        m->be->download(m->be, ref, nl_runstate_output(rs, NULL), V * sizeof(float));
        CHECK_OK(nl_batch_forward(b, &s2, 1, &err), &err);
        const float *got = nl_batch_logits(b, 0, &err);
        if (!got)
            break;
        double e = check_rel_err(got, ref, V);
        CHECK(e < 1e-4, "step %d: logits within 1e-4 of nl_forward (%.2g)", i, e);
        /* a backend with gemm_rows computes a decode's few rows the same
         * way in both (the CPU's dot-product kernel): the same bits, so a
         * stage's batch and `neuroctl generate` give the same ids */
        if (m->be->gemm_rows)
            CHECK(memcmp(got, ref, V * sizeof(float)) == 0,
                  "step %d: logits bit-identical to nl_forward's", i);
        next = 0;
        for (int v = 1; v < V; v++)
            next = ref[v] > ref[next] ? v : next;
        a.T = 1;
        a.tokens = &next;
        s2 = (nl_batch_seg){kv2, &next, 1, 1};
    }
    CHECK(kv1->len == kv2->len, "both caches hold %d positions (%d)", kv1->len, kv2->len);

    /* refusals leave the caches alone */
    int32_t bad = 300;
    nl_batch_seg sb = {kv2, &bad, 1, 1};
    CHECK(nl_batch_forward(b, &sb, 1, &err) == NL_ERR_RANGE, "token 300 refused");
    CHECK(strstr(err.msg, "token 300") != NULL, "message names the token: %s", err.msg);
    int32_t many[9] = {0};
    nl_batch_seg big = {kv2, many, 9, 1};
    CHECK(nl_batch_forward(b, &big, 1, &err) == NL_ERR_SHAPE, "9 rows > 8 refused");
    kv2->len = 30;
    nl_batch_seg full = {kv2, many, 3, 1};
    CHECK(nl_batch_forward(b, &full, 1, &err) == NL_ERR_RANGE, "a full cache refused");
    CHECK(kv2->len == 30, "the cache did not grow (%d)", kv2->len);
out:
    free(ref);
    nl_kvcache_destroy(&kv1);
    nl_kvcache_destroy(&kv2);
    nl_runstate_destroy(&rs);
    nl_batch_destroy(&b);
}

/* Give dst (a stage) src's weights, by name. */
static void copy_weights(nl_model *dst, const nl_model *src, nl_backend *be)
{
    for (int i = 0; i < dst->n_table; i++)
        for (int j = 0; j < src->n_table; j++)
            if (strcmp(dst->table[i].name, src->table[j].name) == 0) {
                size_t n = nl_param_numel(&src->table[j]);
                float *x = check_download(be, nl_model_param_data(src, &src->table[j]), n);
                be->upload(be, nl_model_param_data(dst, &dst->table[i]), x, n * 4);
                free(x);
            }
}

/* Two stages (layer 0 with the embedding, layer 1 with the head), the
 * first's hidden states fed to the second, against the whole model: the
 * same logits bit for bit, for a batch of a prompt chunk and decode rows. */
static void test_stages(nl_model *m, nl_backend *be)
{
    nl_error err = {0};
    nl_model *s0 = NULL, *s1 = NULL;
    nl_batch *bw = NULL, *b0 = NULL, *b1 = NULL;
    nl_kvcache *kw[3] = {0}, *k0[3] = {0}, *k1[3] = {0};
    const int V = 300, d = 64;
    CHECK_OK(nl_model_new(&s0, be, &m->cfg, 0, 1, 1, 0, &err), &err);
    CHECK_OK(nl_model_new(&s1, be, &m->cfg, 1, 2, 0, 1, &err), &err);
    if (!s0 || !s1)
        goto out;
    copy_weights(s0, m, be);
    copy_weights(s1, m, be);
    CHECK_OK(nl_batch_new(&bw, m, 16, &err), &err);
    CHECK_OK(nl_batch_new(&b0, s0, 16, &err), &err);
    CHECK_OK(nl_batch_new(&b1, s1, 16, &err), &err);
    for (int i = 0; i < 3; i++) {
        CHECK_OK(nl_kvcache_new(&kw[i], m, 1, 16, NL_KV_FP32, &err), &err);
        CHECK_OK(nl_kvcache_new(&k0[i], s0, 1, 16, NL_KV_FP32, &err), &err);
        CHECK_OK(nl_kvcache_new(&k1[i], s1, 1, 16, NL_KV_FP32, &err), &err);
    }
    if (!bw || !b0 || !b1 || !kw[2] || !k0[2] || !k1[2])
        goto out;
    int32_t toks[3][8] = {{4, 8, 15, 16, 23, 42, 7, 9}, {1, 2, 3, 4, 5, 6, 7, 8}, {299, 0, 5}};
    int T[3] = {8, 3, 2}, bad = 0;
    for (int round = 0; round < 3; round++) {
        nl_batch_seg sw[3], s0g[3], s1g[3];
        const float *x[3];
        for (int i = 0; i < 3; i++) {
            const int t = round ? 1 : T[i]; /* a prompt each, then decode steps */
            const int32_t *p = round ? &toks[i][round] : toks[i];
            sw[i] = (nl_batch_seg){kw[i], p, t, 1};
            s0g[i] = (nl_batch_seg){k0[i], p, t, 0};
            s1g[i] = (nl_batch_seg){k1[i], NULL, t, 1};
        }
        CHECK_OK(nl_batch_forward(bw, sw, 3, &err), &err);
        CHECK_OK(nl_batch_forward(b0, s0g, 3, &err), &err);
        for (int i = 0; i < 3; i++)
            x[i] = nl_batch_hidden(b0, i);
        CHECK(x[0] && x[1] && x[2] && !nl_batch_hidden(b1, 0) && !nl_batch_logits(b0, 0, &err),
              "hidden states from the first stage only, logits from the last only");
        if (!x[0] || !x[1] || !x[2])
            break;
        CHECK(x[1] == x[0] + (size_t)s0g[0].T * d, "segment 1's rows follow segment 0's");
        CHECK_OK(nl_batch_forward_hidden(b1, s1g, x, 3, &err), &err);
        for (int i = 0; i < 3; i++) {
            const float *a = nl_batch_logits(bw, i, &err), *c = nl_batch_logits(b1, i, &err);
            bad += !a || !c || memcmp(a, c, V * sizeof(float)) != 0;
        }
    }
    CHECK(bad == 0, "%d of 9 rows' logits differ between two stages and the whole model", bad);
    CHECK(k1[0]->len == kw[0]->len && k0[0]->len == kw[0]->len, "the stages' caches grew alike");
    nl_batch_seg none = {k1[0], NULL, 1, 1};
    CHECK(nl_batch_forward(b1, &none, 1, &err) == NL_ERR_INVALID && strstr(err.msg, "hidden"),
          "a later stage without hidden states refused: %s", err.msg);
    float e[64];
    int32_t one = 1;
    CHECK(nl_batch_embed(b0, &one, 1, e, &err) == NL_ERR_INVALID, "embed on a stage refused");
out:
    for (int i = 0; i < 3; i++) {
        nl_kvcache_destroy(&kw[i]);
        nl_kvcache_destroy(&k0[i]);
        nl_kvcache_destroy(&k1[i]);
    }
    nl_batch_destroy(&bw);
    nl_batch_destroy(&b0);
    nl_batch_destroy(&b1);
    nl_model_destroy(&s0);
    nl_model_destroy(&s1);
}

/* The embedding against the final-normed states of a plain forward. */
static void test_embed(nl_model *m, nl_backend *be)
{
    nl_error err = {0};
    nl_batch *b = NULL;
    const int T = 11, d = 64;
    int32_t toks[11] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    float e[64], e2[64];
    CHECK_OK(nl_batch_new(&b, m, 4, &err), &err); /* 11 tokens: three chunks */
    if (!b)
        return;
    CHECK_OK(nl_batch_embed(b, toks, T, e, &err), &err);
    double n2 = 0;
    for (int j = 0; j < d; j++)
        n2 += (double)e[j] * e[j];
    CHECK(fabs(n2 - 1.0) < 1e-5, "unit length (%g)", n2);
    /* reference: hidden states of a stage without the head, normed here */
    nl_model *body = NULL;
    nl_runstate *rs = NULL;
    CHECK_OK(nl_model_new(&body, be, &m->cfg, 0, m->cfg.num_layers, 1, 0, &err), &err);
    if (body) {
        copy_weights(body, m, be); /* the same weights, by name */
        CHECK_OK(nl_runstate_new(&rs, body, T, &err), &err);
        nl_forward_args a = {.B = 1, .T = T, .tokens = toks};
        CHECK_OK(nl_forward(body, rs, &a, NULL, &err), &err);
        float *h = check_download(be, nl_runstate_output(rs, NULL), (size_t)T * d);
        float *w = check_download(be, m->norm, d);
        double mean[64] = {0}, nn = 0;
        for (int t = 0; t < T; t++) {
            double ss = 0;
            for (int j = 0; j < d; j++)
                ss += (double)h[t * d + j] * h[t * d + j];
            double r = 1.0 / sqrt(ss / d + m->cfg.norm_eps);
            for (int j = 0; j < d; j++)
                mean[j] += h[t * d + j] * r * w[j] / T;
        }
        for (int j = 0; j < d; j++)
            nn += mean[j] * mean[j];
        for (int j = 0; j < d; j++)
            e2[j] = (float)(mean[j] / sqrt(nn));
        CHECK(check_rel_err(e, e2, d) < 1e-4, "embedding matches the reference (%.2g)",
              check_rel_err(e, e2, d));
        free(h);
        free(w);
    }
    CHECK(nl_batch_embed(b, toks, 0, e, &err) == NL_ERR_RANGE, "no tokens refused");
    nl_runstate_destroy(&rs);
    nl_model_destroy(&body);
    nl_batch_destroy(&b);
}

/* ---------------------------------------------------------------- gemm_rows */

/* The backend's row-invariant GEMM, which the batch relies on: for every
 * M from 1 to 17 (the sizes of a decode batch's expert groups) and a few
 * larger, rows o .. o + M - 1 of a product give the bits those rows have
 * inside one 80-row product, for this test's shapes and bench-small's
 * (experts, QKV, router, head; K 64 .. 512, K not a multiple of 8 too),
 * with B transposed (overwriting or accumulating) or not; and the values
 * are the product (against gemm). With B transposed, the plain gemm at
 * up to 15 rows gives those bits too (the CPU runs both through one
 * kernel, kernels/cpu/cpu_dot.c): what makes a stage's batch decode as
 * `neuroctl generate` does; and that kernel gives the same bits through
 * its AVX2 tiles alone as through its AVX-512 ones. */
static void test_gemm_rows(nl_backend *be)
{
    if (!be->gemm_rows) {
        printf("test_batch: %s has no gemm_rows (the batch pads instead)\n", be->name);
        return;
    }
    enum { R = 80 };
    static const int shapes[][2] = {/* N, K */
                                    {192, 64}, {64, 96},    {128, 64},  {300, 64},
                                    {8, 64},   {1024, 256}, {256, 512}, {384, 256},
                                    {8, 256},  {8192, 256}, {37, 77},   {5, 3}};
    static const int ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 20, 33, 64};
    uint64_t seed = 12345;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int N = shapes[si][0], K = shapes[si][1];
        const size_t na = (size_t)R * K, nb = (size_t)N * K, nc = (size_t)R * N;
        float *h = malloc((na + nb + nc) * sizeof *h);
        float *A = be->alloc(be, na * 4), *B = be->alloc(be, nb * 4);
        float *C0 = be->alloc(be, nc * 4), *C = be->alloc(be, nc * 4), *G = be->alloc(be, nc * 4);
        CHECK(h && A && B && C0 && C && G, "out of memory");
        for (size_t i = 0; h && i < na + nb + nc; i++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            h[i] = (float)((double)(seed >> 40) / (double)(1 << 24) - 0.5);
        }
        if (h && A && B && C0 && C && G) {
            be->upload(be, A, h, na * 4);
            be->upload(be, B, h + na, nb * 4);
            be->upload(be, C0, h + na + nb, nc * 4);
            for (int tb = 0; tb <= 1; tb++)
                for (int acc = 0; acc <= tb; acc++) { /* the batch accumulates with trans_b */
                    const int ldb = tb ? K : N;
                    /* the reference: one product of all R rows */
                    be->copy_rows(be, G, N, C0, N, R, N);
                    be->gemm_rows(be, tb, R, N, K, A, K, B, ldb, acc, G, N);
                    float *ref = check_download(be, G, nc);
                    be->copy_rows(be, C, N, C0, N, R, N);
                    be->gemm(be, 0, tb, R, N, K, 1.0f, A, K, B, ldb, acc ? 1.0f : 0.0f, C, N);
                    float *plain = check_download(be, C, nc);
                    CHECK(ref && plain && check_rel_err(ref, plain, nc) < 1e-5,
                          "gemm_rows N %d K %d trans_b %d acc %d: rel err %g against gemm", N, K,
                          tb, acc, ref && plain ? check_rel_err(ref, plain, nc) : -1.0);
                    int bad = 0;
                    for (size_t mi = 0; ref && mi < sizeof ms / sizeof ms[0]; mi++) {
                        const int M = ms[mi], o = R - M; /* the last M rows: other alignments */
                        be->copy_rows(be, C, N, C0, N, R, N);
                        be->gemm_rows(be, tb, M, N, K, A + (size_t)o * K, K, B, ldb, acc,
                                      C + (size_t)o * N, N);
                        float *got = check_download(be, C, nc);
                        if (!got || memcmp(got + (size_t)o * N, ref + (size_t)o * N,
                                           (size_t)M * N * sizeof(float)) != 0) {
                            CHECK(0,
                                  "gemm_rows N %d K %d trans_b %d acc %d: %d rows give other "
                                  "bits than inside %d rows",
                                  N, K, tb, acc, M, R);
                            bad = 1;
                        }
                        free(got);
                        if (!tb || M >= 16 || bad)
                            continue;
                        /* the plain gemm at a decode's few rows: the same bits */
                        be->copy_rows(be, C, N, C0, N, R, N);
                        be->gemm(be, 0, 1, M, N, K, 1.0f, A + (size_t)o * K, K, B, ldb,
                                 acc ? 1.0f : 0.0f, C + (size_t)o * N, N);
                        got = check_download(be, C, nc);
                        if (!got || memcmp(got + (size_t)o * N, ref + (size_t)o * N,
                                           (size_t)M * N * sizeof(float)) != 0) {
                            CHECK(0,
                                  "gemm N %d K %d acc %d: %d rows give other bits than "
                                  "gemm_rows",
                                  N, K, acc, M);
                            bad = 1;
                        }
                        free(got);
                    }
                    CHECK(!bad, "gemm_rows N %d K %d trans_b %d acc %d: row invariant", N, K, tb,
                          acc);
                    if (tb && ref) { /* the AVX2 tiles alone: the same bits as with AVX-512's */
                        const int had = nl_cpu_dot_avx512(0);
                        be->copy_rows(be, C, N, C0, N, R, N);
                        be->gemm_rows(be, 1, R, N, K, A, K, B, ldb, acc, C, N);
                        nl_cpu_dot_avx512(1);
                        float *got = check_download(be, C, nc);
                        CHECK(got && memcmp(got, ref, nc * sizeof(float)) == 0,
                              "gemm_rows N %d K %d acc %d: the same bits with AVX2 only as with "
                              "AVX-512 (%s here)",
                              N, K, acc, had ? "present" : "absent");
                        free(got);
                    }
                    free(ref);
                    free(plain);
                }
        }
        free(h);
        void *dev[] = {A, B, C0, C, G};
        for (size_t i = 0; i < 5; i++)
            be->free(be, dev[i]);
    }
}

/* Sampling each segment's row where it lies (nl_batch_logits_device,
 * the backend's sample_rows slot where it has one: serve and a stage's
 * batch) gives the ids of sampling the host logits, greedy, seeded and
 * top-p, one session at a time (nl_sampler_next) on even steps and all at
 * once (nl_sampler_next_batch) on odd ones, where the step's device ids
 * cost one host sync and a session left out (NULL) gets -1; the step
 * downloads no logits until nl_batch_logits asks, then all its rows at
 * once. */
static void test_device_sampling(nl_model *m)
{
    enum { SEQS = 4, STEPS = 24 };
    nl_error err = {0};
    nl_backend *be = m->be;
    const int V = (int)m->cfg.vocab_size;
    nl_batch *b = NULL;
    nl_kvcache *kv[SEQS] = {0};
    nl_sampler sd[SEQS], sh[SEQS];
    int32_t prompt[SEQS][3], next[SEQS];
    float *host = malloc((size_t)V * sizeof *host);
    CHECK_OK(nl_batch_new(&b, m, 16, &err), &err);
    for (int i = 0; i < SEQS; i++) {
        CHECK_OK(nl_kvcache_new(&kv[i], m, 1, 3 + STEPS, NL_KV_FP32, &err), &err);
        const float t = i == 0 ? 0.0f : 0.7f * (float)i, top_p = i == 3 ? 0.9f : 1.0f;
        CHECK_OK(nl_sampler_init(&sd[i], V, t, top_p, (uint64_t)(40 + i), &err), &err);
        CHECK_OK(nl_sampler_init(&sh[i], V, t, top_p, (uint64_t)(40 + i), &err), &err);
        for (int t2 = 0; t2 < 3; t2++)
            prompt[i][t2] = (int32_t)((11 * i + 5 * t2 + 1) % V);
    }
    const int dev = nl_sampler_device(&sd[0], be);
    int bad = 0, lazy = 1, together = 0;
    for (int s = 0; b && host && kv[SEQS - 1] && s < STEPS; s++) {
        nl_batch_seg segs[SEQS];
        for (int i = 0; i < SEQS; i++)
            segs[i] = (nl_batch_seg){kv[i], s ? &next[i] : prompt[i], s ? 1 : 3, 1};
        if (nl_batch_forward(b, segs, SEQS, &err) != NL_OK) {
            CHECK(0, "step %d: %s", s, err.msg);
            break;
        }
        int32_t ids[SEQS];
        int on_host = (1 << SEQS) - 1; /* sessions left to nl_sampler_next */
        if (s % 2) {
            nl_sampler *sp[SEQS];
            const float *lg[SEQS];
            nl_sample_row rows[SEQS];
            for (int i = 0; i < SEQS; i++) {
                sp[i] = i == 1 ? NULL : &sd[i]; /* 1: the caller's own */
                lg[i] = nl_batch_logits_device(b, i);
            }
            const uint64_t s0 = be->stats.host_syncs;
            CHECK_OK(nl_sampler_next_batch(sp, lg, SEQS, be, rows, ids, &err), &err);
            together += be->stats.host_syncs - s0 == (uint64_t)dev;
            on_host = 0;
            for (int i = 0; i < SEQS; i++) {
                const int here = dev && i != 1;
                bad += here ? ids[i] < 0 : ids[i] != -1;
                on_host |= (!here) << i;
            }
        }
        for (int i = 0; i < SEQS; i++) {
            if (on_host >> i & 1)
                CHECK_OK(
                    nl_sampler_next(&sd[i], be, nl_batch_logits_device(b, i), host, &ids[i], &err),
                    &err);
            const uint64_t s0 = be->stats.host_syncs;
            const float *lg = nl_batch_logits(b, i, &err);
            const uint64_t got = be->stats.host_syncs - s0;
            /* one download for the step's rows, on the first ask only */
            lazy &= got == (uint64_t)(i == 0);
            bad += !lg || nl_sampler_sample(&sh[i], lg) != ids[i];
            next[i] = ids[i];
        }
    }
    CHECK(together == STEPS / 2,
          "%d of %d steps sampled their sessions' device ids with %d host sync%s", together,
          STEPS / 2, dev, dev ? "" : "s");
    CHECK(bad == 0, "%d of %d ids sampled on the device differ from the host's", bad, SEQS * STEPS);
    CHECK(lazy, "a step's logits were not downloaded once, on the first ask");
    CHECK(nl_batch_logits_device(b, SEQS) == NULL, "a segment past the call has no logits");
    for (int i = 0; i < SEQS; i++) {
        nl_sampler_free(&sd[i]);
        nl_sampler_free(&sh[i]);
        nl_kvcache_destroy(&kv[i]);
    }
    free(host);
    nl_batch_destroy(&b);
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_config c = test_config();
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    if (!be)
        return check_done("test_batch");
    CHECK_OK(nl_model_new(&m, be, &c, 0, c.num_layers, 1, 1, &err), &err);
    if (m) {
        CHECK_OK(nl_model_init_random(m, 77, &err), &err);
        test_gemm_rows(be);
        test_matches_forward(m);
        test_alone_vs_together(m);
        if (be->kv_store_bf16) { /* with bf16 caches (their own cache writes) */
            kv_kind = NL_KV_BF16;
            test_alone_vs_together(m);
            kv_kind = NL_KV_FP32;
        }
        /* and through padding, as on a backend without gemm_rows: on the
         * CPU, whose gemm computes a row alike for any M >= 16 (cuBLAS,
         * run here by bench/gpu_check.sh, picks algorithms by M) */
        if (be->gemm_rows && strncmp(be->name, "cpu", 3) == 0) {
            void (*rows)(nl_backend *, int, int, int, int, const float *, int, const float *, int,
                         int, float *, int) = be->gemm_rows;
            be->gemm_rows = NULL;
            test_alone_vs_together(m);
            be->gemm_rows = rows;
        }
        test_stages(m, be);
        test_embed(m, be);
        test_device_sampling(m);
    }
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    return check_done("test_batch");
}
