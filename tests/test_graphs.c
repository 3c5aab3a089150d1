/* Recorded decode steps (core/model/forward.h; the backend's graph slots): a
 * decode with graphs gives the ids and the logits of one without, over
 * 256 tokens, greedy and seeded sampling, one sequence and a batch of
 * three; a step is recorded once per bucket and replayed for every later
 * token; and it is recorded again after the model grows (same nl_model,
 * new buffers) and after a reload (another model behind the same runstate
 * and cache), where a replay of the old recording would compute with the
 * old weights; weights written in place (same buffers) are read by the
 * replays that follow, without a new recording; keys taking turns stop
 * the recording. On a backend
 * without graph slots (the CPU) the same runs must record nothing. The
 * devsim backend's recording refuses a slot that waits for the device.
 * The batched decoder (core/model/batch.h) likewise: three sessions decoded in
 * one batch give the same ids and logits with and without recordings,
 * one recording per membership (a session leaving records again). All of
 * it in FP32, then on the device's bf16 backend with bf16 caches. Run on
 * cpu and on cpu-devsim (NL_TEST_DEVICE). */
#include "core/grow/grow.h"
#include "core/model/batch.h"
#include "core/model/forward.h"
#include "core/model/model.h"
#include "core/model/sampler.h"
#include "tests/check.h"

#include <stdlib.h>
#include <string.h>

enum { STEPS = 256, PROMPT = 3, AFTER = 64 /* steps decoded after a growth or a reload */ };

/* The suite runs twice: on the FP32 backend with FP32 caches, then on the
 * same device's bf16 backend (GEMMs from the weights' bf16 copies) with
 * bf16 caches. */
static nl_kv_dtype kv_kind = NL_KV_FP32;

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
    c.max_seq_len = STEPS + PROMPT + 8;
    nl_config_fill_derived(&c);
    return c;
}

/* Random weights, the matrices widened so attention and routing are
 * decisive (as test_model does): a stale weight or position changes the
 * ids. */
static void fill_weights(nl_model *m, uint64_t seed)
{
    nl_error err = {0};
    nl_backend *be = m->be;
    CHECK_OK(nl_model_init_random(m, seed, &err), &err);
    for (int i = 0; i < m->n_table; i++) {
        const nl_param *p = &m->table[i];
        const size_t n = nl_param_numel(p);
        float *x = check_download(be, nl_model_param_data(m, p), n);
        if (!x)
            continue;
        for (size_t j = 0; j < n; j++)
            x[j] *= p->kind == NL_PARAM_NORM ? 1.0f : 8.0f;
        be->upload(be, nl_model_param_data(m, p), x, n * sizeof *x);
        free(x);
    }
}

static nl_model *make_model(nl_backend *be, const nl_config *c, uint64_t seed)
{
    nl_error err = {0};
    nl_model *m = NULL;
    CHECK_OK(nl_model_new(&m, be, c, 0, c->num_layers, 1, 1, &err), &err);
    if (m)
        fill_weights(m, seed);
    return m;
}

/* One decode: B sequences, a prompt, then `steps` tokens, each sampled
 * by its own seeded sampler (greedy when t is 0), through rs and kv
 * (kv->len reset first). ids is (steps, B); last gets the last step's
 * logits (B, V) when not NULL. */
typedef struct decode_run {
    int B;
    float t;
    uint64_t seed;
    int graphs;
} decode_run;

static void decode(nl_model *m, nl_runstate *rs, nl_kvcache *kv, const decode_run *r, int steps,
                   int32_t *ids, float *last)
{
    nl_error err = {0};
    nl_backend *be = m->be;
    const int V = (int)m->cfg.vocab_size, B = r->B;
    nl_sampler smp[4];
    int32_t prompt[4 * PROMPT], next[4];
    float *host = malloc((size_t)V * sizeof *host);
    for (int b = 0; b < B; b++) {
        CHECK_OK(nl_sampler_init(&smp[b], V, r->t, 1.0f, r->seed + (uint64_t)b, &err), &err);
        for (int i = 0; i < PROMPT; i++)
            prompt[b * PROMPT + i] = (int32_t)((5 + 37 * b + 101 * i) % V);
    }
    nl_runstate_set_graphs(rs, r->graphs);
    kv->len = 0;
    nl_forward_args a = {.B = B, .T = PROMPT, .tokens = prompt, .kv = kv, .last_only = 1};
    for (int s = 0; host && s < steps; s++) {
        if (nl_forward(m, rs, &a, NULL, &err) != NL_OK) {
            CHECK(0, "decode step %d: %s", s, err.msg);
            break;
        }
        const float *out = nl_runstate_output(rs, NULL);
        for (int b = 0; b < B; b++)
            if (nl_sampler_next(&smp[b], be, out + (size_t)b * V, host, &next[b], &err) != NL_OK)
                CHECK(0, "sample %d of step %d: %s", b, s, err.msg);
        for (int b = 0; b < B; b++)
            ids[(size_t)s * B + b] = next[b];
        if (last && s == steps - 1)
            be->download(be, last, out, (size_t)B * V * sizeof *last);
        a.T = 1;
        a.tokens = next;
    }
    for (int b = 0; b < B; b++)
        nl_sampler_free(&smp[b]);
    free(host);
}

/* The first step where two id sequences differ, or -1. */
static int first_diff(const int32_t *a, const int32_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i])
            return (int)i;
    return -1;
}

/* Decode with and without graphs on fresh runstates and caches: the same
 * ids and the same logits bits; one recording per run, replays after. */
static void test_same_ids(nl_backend *be, nl_model *m)
{
    nl_error err = {0};
    const int V = (int)m->cfg.vocab_size;
    const int has = be->graph_begin != NULL;
    const decode_run modes[] = {
        {1, 0.0f, 1, 1}, {1, 0.8f, 7, 1}, {3, 0.0f, 3, 1}, {3, 1.2f, 11, 1}};
    for (size_t k = 0; k < sizeof modes / sizeof *modes; k++) {
        const int B = modes[k].B;
        int32_t *ids[2] = {calloc((size_t)STEPS * B, sizeof(int32_t)),
                           calloc((size_t)STEPS * B, sizeof(int32_t))};
        float *last[2] = {calloc((size_t)B * V, sizeof(float)),
                          calloc((size_t)B * V, sizeof(float))};
        nl_runstate_graph_stats gs[2] = {{0}};
        for (int g = 0; g < 2; g++) {
            nl_runstate *rs = NULL;
            nl_kvcache *kv = NULL;
            CHECK_OK(nl_runstate_new(&rs, m, B * PROMPT, &err), &err);
            CHECK_OK(nl_kvcache_new(&kv, m, B, STEPS + PROMPT, kv_kind, &err), &err);
            decode_run r = modes[k];
            r.graphs = g == 0;
            if (rs && kv && ids[g] && last[g])
                decode(m, rs, kv, &r, STEPS, ids[g], last[g]);
            if (rs)
                gs[g] = nl_runstate_graphs(rs);
            nl_kvcache_destroy(&kv);
            nl_runstate_destroy(&rs);
        }
        const int d = ids[0] && ids[1] ? first_diff(ids[0], ids[1], (size_t)STEPS * B) : 0;
        CHECK(d < 0, "B %d t %g: ids with graphs differ from step %d", B, modes[k].t,
              d < 0 ? 0 : d / B);
        CHECK(last[0] && last[1] && memcmp(last[0], last[1], (size_t)B * V * sizeof(float)) == 0,
              "B %d t %g: the last logits with graphs are not the same bits", B, modes[k].t);
        /* the prompt is not a decode step; every later step is */
        CHECK(gs[0].captures == (uint64_t)has && gs[0].replays == (uint64_t)(has * (STEPS - 2)) &&
                  gs[0].failed == 0,
              "B %d: %llu recordings, %llu replays, %llu refused (graph slots: %d)", B,
              (unsigned long long)gs[0].captures, (unsigned long long)gs[0].replays,
              (unsigned long long)gs[0].failed, has);
        CHECK(gs[1].captures == 0 && gs[1].replays == 0, "graphs off: %llu recordings",
              (unsigned long long)gs[1].captures);
        for (int g = 0; g < 2; g++) {
            free(ids[g]);
            free(last[g]);
        }
    }
}

/* The reference: a decode of m without graphs on its own runstate. */
static void reference(nl_model *m, const decode_run *r, int steps, int32_t *ids)
{
    nl_error err = {0};
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    CHECK_OK(nl_runstate_new(&rs, m, r->B * PROMPT, &err), &err);
    CHECK_OK(nl_kvcache_new(&kv, m, r->B, STEPS + PROMPT, kv_kind, &err), &err);
    decode_run off = *r;
    off.graphs = 0;
    if (rs && kv)
        decode(m, rs, kv, &off, steps, ids, NULL);
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
}

/* A reload: another model (other weights, its own buffers) behind the
 * runstate and the cache the first one used, as a stage keeps its
 * runstate across a LAYER_LOAD. Its step must be recorded anew. */
static void test_reload(nl_backend *be, const nl_config *c, nl_model *a)
{
    nl_error err = {0};
    const int has = be->graph_begin != NULL;
    const decode_run r = {1, 0.0f, 5, 1};
    nl_model *b = make_model(be, c, 99);
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    int32_t ids_a[16], ids_b[AFTER], ref_b[AFTER];
    CHECK_OK(nl_runstate_new(&rs, a, PROMPT, &err), &err);
    CHECK_OK(nl_kvcache_new(&kv, a, 1, STEPS + PROMPT, kv_kind, &err), &err);
    if (!b || !rs || !kv)
        goto out;
    decode(a, rs, kv, &r, 16, ids_a, NULL);
    const nl_runstate_graph_stats before = nl_runstate_graphs(rs);
    decode(b, rs, kv, &r, AFTER, ids_b, NULL);
    const nl_runstate_graph_stats after = nl_runstate_graphs(rs);
    reference(b, &r, AFTER, ref_b);
    const int d = first_diff(ids_b, ref_b, AFTER);
    CHECK(d < 0, "reload: ids differ from a decode without graphs from step %d", d);
    CHECK(first_diff(ids_a, ref_b, 16) >= 0, "reload: the two models give the same ids");
    CHECK(after.captures == before.captures + (uint64_t)has,
          "reload: %llu recordings before, %llu after (graph slots: %d)",
          (unsigned long long)before.captures, (unsigned long long)after.captures, has);
out:
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
    nl_model_destroy(&b);
}

/* Weights written in place (the same buffers and generation: a load into
 * a model's buffers, as a stage's LAYER_LOAD of the same shapes): the
 * recording is replayed, not made again, and reads the new weights (in
 * bf16 mode their copies, which the backend makes again before the
 * replay: a replay that read the old copies gives the old ids). */
static void test_in_place(nl_backend *be, const nl_config *c)
{
    nl_error err = {0};
    const int has = be->graph_begin != NULL;
    const decode_run r = {1, 0.0f, 5, 1};
    nl_model *m = make_model(be, c, 2468);
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    int32_t ids_a[16], ids_b[AFTER], ref_b[AFTER];
    if (m) {
        CHECK_OK(nl_runstate_new(&rs, m, PROMPT, &err), &err);
        CHECK_OK(nl_kvcache_new(&kv, m, 1, STEPS + PROMPT, kv_kind, &err), &err);
    }
    if (!m || !rs || !kv)
        goto out;
    decode(m, rs, kv, &r, 16, ids_a, NULL);
    const nl_runstate_graph_stats before = nl_runstate_graphs(rs);
    const uint64_t gen = m->generation;
    fill_weights(m, 1357);
    CHECK(m->generation == gen, "new weights in place change the generation");
    decode(m, rs, kv, &r, AFTER, ids_b, NULL);
    const nl_runstate_graph_stats after = nl_runstate_graphs(rs);
    reference(m, &r, AFTER, ref_b);
    const int d = first_diff(ids_b, ref_b, AFTER);
    CHECK(d < 0, "in place: ids differ from a decode without graphs from step %d", d);
    CHECK(first_diff(ids_a, ref_b, 16) >= 0, "in place: the two weights give the same ids");
    CHECK(after.captures == before.captures &&
              after.replays == before.replays + (uint64_t)(has * (AFTER - 1)),
          "in place: recordings %llu then %llu, replays %llu then %llu (graph slots: %d)",
          (unsigned long long)before.captures, (unsigned long long)after.captures,
          (unsigned long long)before.replays, (unsigned long long)after.replays, has);
out:
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
    nl_model_destroy(&m);
}

/* Growth in place: the same nl_model gains a layer (new buffers, new
 * generation); the runstate stays (its sizes do not depend on depth), the
 * cache is made for the new depth. */
static void test_growth(nl_backend *be, const nl_config *c)
{
    nl_error err = {0};
    const int has = be->graph_begin != NULL;
    const decode_run r = {2, 0.7f, 21, 1};
    nl_model *m = make_model(be, c, 4321);
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    int32_t ids[2 * AFTER], ref[2 * AFTER];
    CHECK_OK(nl_runstate_new(&rs, m, 2 * PROMPT, &err), &err);
    CHECK_OK(nl_kvcache_new(&kv, m, 2, STEPS + PROMPT, kv_kind, &err), &err);
    if (!m || !rs || !kv)
        goto out;
    decode(m, rs, kv, &r, 16, ids, NULL);
    const nl_runstate_graph_stats before = nl_runstate_graphs(rs);
    const uint64_t gen = m->generation;
    CHECK_OK(nl_model_grow_depth(m, c->num_layers + 1, 77, NULL, 0, &err), &err);
    CHECK(m->generation != gen, "growth keeps the generation %llu", (unsigned long long)gen);
    /* new weights in the grown buffers (a grown layer starts as an
     * identity, DESIGN 5): a replay of the old recording would read the
     * old buffers and give other ids */
    fill_weights(m, 8765);
    nl_kvcache_destroy(&kv);
    CHECK_OK(nl_kvcache_new(&kv, m, 2, STEPS + PROMPT, kv_kind, &err), &err);
    if (!kv)
        goto out;
    decode(m, rs, kv, &r, AFTER, ids, NULL);
    const nl_runstate_graph_stats after = nl_runstate_graphs(rs);
    reference(m, &r, AFTER, ref);
    const int d = first_diff(ids, ref, 2 * (size_t)AFTER);
    CHECK(d < 0, "growth: ids differ from a decode without graphs from step %d", d / 2);
    CHECK(after.captures == before.captures + (uint64_t)has,
          "growth: %llu recordings before, %llu after (graph slots: %d)",
          (unsigned long long)before.captures, (unsigned long long)after.captures, has);
out:
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
    nl_model_destroy(&m);
}

/* Keys taking turns (more sessions' caches than the runstate keeps
 * recordings of) would record at every step: after 16 recordings that
 * were never replayed, recording stops and steps run unrecorded. */
static void test_thrash(nl_backend *be, nl_model *m)
{
    enum { CACHES = 9, ROUNDS = 4 };
    nl_error err = {0};
    const int has = be->graph_begin != NULL;
    nl_runstate *rs = NULL;
    nl_kvcache *kv[CACHES] = {0};
    int32_t tok[PROMPT] = {5, 17, 200};
    CHECK_OK(nl_runstate_new(&rs, m, PROMPT, &err), &err);
    for (int i = 0; i < CACHES; i++)
        CHECK_OK(nl_kvcache_new(&kv[i], m, 1, PROMPT + ROUNDS, kv_kind, &err), &err);
    for (int r = -1; rs && r < ROUNDS; r++)
        for (int i = 0; i < CACHES && kv[i]; i++) {
            nl_forward_args a = {.B = 1, .T = r < 0 ? PROMPT : 1, .tokens = tok, .kv = kv[i]};
            CHECK_OK(nl_forward(m, rs, &a, NULL, &err), &err);
        }
    const nl_runstate_graph_stats gs = rs ? nl_runstate_graphs(rs) : (nl_runstate_graph_stats){0};
    CHECK(gs.captures == (uint64_t)(has * 16) && gs.replays == 0,
          "%d caches in turn: %llu recordings, %llu replays (graph slots: %d)", CACHES,
          (unsigned long long)gs.captures, (unsigned long long)gs.replays, has);
    for (int i = 0; i < CACHES; i++)
        nl_kvcache_destroy(&kv[i]);
    nl_runstate_destroy(&rs);
}

/* A slot that waits for the device cannot be recorded: graph_end fails
 * and names it, and the backend keeps no error. */
static void test_refused(nl_backend *be)
{
    if (!be->graph_begin)
        return;
    nl_error err = {0};
    float *d = be->alloc(be, 64);
    float h[16] = {0};
    void *g = (void *)1;
    be->graph_begin(be);
    be->zero(be, d, 64);
    be->upload(be, d, h, sizeof h);
    const nl_status st = be->graph_end(be, &g, &err);
    CHECK(st != NL_OK && !g && strstr(err.msg, "upload"),
          "an upload while recording: %s, graph %p (%s)", nl_status_str(st), g, err.msg);
    CHECK_OK(nl_backend_check(be, &err), &err);
    be->free(be, d);
}

/* Sessions decoded in one batch, greedily, for `steps` tokens after a
 * prompt; the third leaves after half of them. ids is (steps, 3) (-1 where
 * a session has left); last gets the last step's logits of session 0. */
static void batch_decode(nl_model *m, int graphs, int steps, int32_t *ids, float *last,
                         nl_runstate_graph_stats *gs)
{
    enum { S = 3 };
    nl_error err = {0};
    const int V = (int)m->cfg.vocab_size;
    nl_batch *b = NULL;
    nl_kvcache *kv[S] = {0};
    int32_t prompt[S][PROMPT], next[S];
    nl_batch_seg segs[S];
    CHECK_OK(nl_batch_new(&b, m, S * PROMPT, &err), &err);
    for (int i = 0; i < S; i++)
        CHECK_OK(nl_kvcache_new(&kv[i], m, 1, steps + PROMPT, kv_kind, &err), &err);
    if (!b || !kv[S - 1])
        goto out;
    nl_batch_set_graphs(b, graphs);
    for (int i = 0; i < S; i++) {
        for (int t = 0; t < PROMPT; t++)
            prompt[i][t] = (int32_t)((7 + 53 * i + 91 * t) % V);
        segs[i] = (nl_batch_seg){.kv = kv[i], .tokens = prompt[i], .T = PROMPT, .want_logits = 1};
    }
    for (int s = 0; s < steps; s++) {
        const int n = s < steps / 2 ? S : S - 1;
        if (nl_batch_forward(b, segs, n, &err) != NL_OK) {
            CHECK(0, "batch step %d: %s", s, err.msg);
            break;
        }
        for (int i = 0; i < S; i++) {
            ids[(size_t)s * S + i] = -1;
            const float *lg = i < n ? nl_batch_logits(b, i, &err) : NULL;
            if (!lg)
                continue;
            int best = 0;
            for (int v = 1; v < V; v++)
                best = lg[v] > lg[best] ? v : best;
            ids[(size_t)s * S + i] = next[i] = best;
            if (i == 0 && s == steps - 1)
                memcpy(last, lg, (size_t)V * sizeof *last);
            segs[i].tokens = &next[i];
            segs[i].T = 1;
        }
    }
    *gs = nl_batch_graphs(b);
out:
    for (int i = 0; i < S; i++)
        nl_kvcache_destroy(&kv[i]);
    nl_batch_destroy(&b);
}

static void test_batch_graphs(nl_backend *be, nl_model *m)
{
    enum { BSTEPS = 48 };
    const int has = be->graph_begin != NULL, V = (int)m->cfg.vocab_size;
    int32_t ids[2][BSTEPS * 3];
    float *last[2] = {calloc((size_t)V, sizeof(float)), calloc((size_t)V, sizeof(float))};
    nl_runstate_graph_stats gs[2] = {{0}};
    if (!last[0] || !last[1])
        goto out;
    batch_decode(m, 1, BSTEPS, ids[0], last[0], &gs[0]);
    batch_decode(m, 0, BSTEPS, ids[1], last[1], &gs[1]);
    const int d = first_diff(ids[0], ids[1], 3 * (size_t)BSTEPS);
    CHECK(d < 0, "batch: ids with graphs differ from step %d", d / 3);
    CHECK(memcmp(last[0], last[1], (size_t)V * sizeof(float)) == 0,
          "batch: the last logits with graphs differ");
    /* the prompt step is not recorded; 3 sessions, then 2: two recordings */
    const uint64_t want_rep = (uint64_t)has * (BSTEPS - 1 - 2);
    CHECK(gs[0].captures == (uint64_t)has * 2 && gs[0].replays == want_rep && gs[0].failed == 0,
          "batch: %llu recordings, %llu replays, %llu refused (graph slots: %d)",
          (unsigned long long)gs[0].captures, (unsigned long long)gs[0].replays,
          (unsigned long long)gs[0].failed, has);
    CHECK(gs[1].captures == 0 && gs[1].replays == 0, "batch: graphs off, yet %llu recordings",
          (unsigned long long)gs[1].captures);
out:
    free(last[0]);
    free(last[1]);
}

static void suite(nl_backend *be)
{
    printf("test_graphs: %s, %s, %s caches, graph slots: %s\n", be->name,
           be->bf16 ? "bf16" : "FP32", kv_kind == NL_KV_BF16 ? "bf16" : "FP32",
           be->graph_begin ? "yes" : "no");
    const nl_config c = test_config();
    nl_model *m = make_model(be, &c, 1234);
    if (m) {
        test_same_ids(be, m);
        test_reload(be, &c, m);
        test_thrash(be, m);
        test_batch_graphs(be, m);
    }
    test_in_place(be, &c);
    test_growth(be, &c);
    test_refused(be);
    nl_model_destroy(&m);
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    if (!be)
        return check_done("test_graphs");
    suite(be);
    nl_backend_destroy(&be);
    /* the same device in bf16, where it computes in bf16 (the CPU needs
     * AVX512-BF16 or AMX, CUDA compute capability 8.0) */
    nl_backend *b16 = NULL;
    const nl_status st =
        nl_backend_new(&b16, check_device(), &(nl_backend_opts){.threads = 2, .bf16 = 1}, &err);
    if (st == NL_ERR_UNSUPPORTED) {
        printf("test_graphs: %s has no bf16 mode (%s): the bf16 suite did not run\n",
               check_device(), err.msg);
    } else {
        CHECK_OK(st, &err);
        kv_kind = NL_KV_BF16;
        if (b16)
            suite(b16);
        nl_backend_destroy(&b16);
    }
    return check_done("test_graphs");
}
