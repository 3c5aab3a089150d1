/* Unit tests of the rules the coordinator and the nodes (or the local
 * tool) apply alike, each written once:
 *
 *  - net/genparams: a generation's parameters. Defaults; an integer where
 *    a number is expected is that number (`temperature: 0` is 0, not the
 *    default); a wrong type or a value out of range is NL_ERR_RANGE naming
 *    the key; a missing required key NL_ERR_PROTO naming it; keys of the
 *    other use are ignored; the session's wire params read back equal,
 *    with the adapter when there is one;
 *  - net/trainparams: a training job's parameters. What the client writes
 *    the coordinator reads back equal (train and finetune), and so a
 *    stage its own; a missing key is NL_ERR_PROTO, a bad one NL_ERR_RANGE
 *    naming it; the rules across keys (the batch rule, named as flags or
 *    as params; fine-tuning without resume, learn_vocab or moments; a
 *    microbatch of at most 2^24 rows on a stage);
 *  - core/train/objective: names, the default (the model's), and the check
 *    against a model (mlm needs the mask id, classify a classifier);
 *    packed rows: the documents counted from <|end|> ids, clm's targets
 *    across a document's end ignored (mlm's documents read before the
 *    mask), the loss rows, and the refusals (classify, no <|end|> id);
 *  - core/train nl_step_decide: the loss composition, the gradient norm,
 *    the clipping factor (1 below the clip norm) and the non-finite
 *    guard. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/data/data.h"
#include "core/model/config.h"
#include "core/model/lora.h"
#include "core/tokenizer/tokenizer.h"
#include "core/train/objective.h"
#include "core/train/train.h"
#include "net/genparams.h"
#include "net/params.h"
#include "net/trainparams.h"
#include "tests/check.h"

#define P_INT(k, v) ((nl_wire_param){.key = (k), .kind = NL_WIRE_PARAM_INT, .i = (v)})
#define P_FLT(k, v) ((nl_wire_param){.key = (k), .kind = NL_WIRE_PARAM_FLOAT, .f = (v)})
#define P_STR(k, v) ((nl_wire_param){.key = (k), .kind = NL_WIRE_PARAM_STR, .s = (v)})
#define P_BOOL(k, v) ((nl_wire_param){.key = (k), .kind = NL_WIRE_PARAM_BOOL, .b = (v)})

static nl_status parse1(nl_genparams *g, nl_wire_param p, nl_genparams_use use, nl_error *err)
{
    return nl_genparams_parse(g, &p, 1, use, err);
}

/* p alone in a request must fail with NL_ERR_RANGE naming its key. */
static void refused(nl_wire_param p, const char *why)
{
    nl_genparams g;
    nl_error err = {0};
    nl_status st = parse1(&g, p, NL_GENPARAMS_REQUEST, &err);
    CHECK(st == NL_ERR_RANGE && strstr(err.msg, p.key), "%s: %s (%s)", why, nl_status_str(st),
          err.msg);
}

static void test_request(void)
{
    nl_genparams g;
    nl_error err = {0};
    CHECK_OK(nl_genparams_parse(&g, NULL, 0, NL_GENPARAMS_REQUEST, &err), &err);
    CHECK(g.max_new == 32 && g.temperature == 0.8 && g.top_p == 0.95 && g.seed == 0,
          "defaults %d %g %g %lld", g.max_new, g.temperature, g.top_p, (long long)g.seed);
    CHECK_OK(parse1(&g, P_INT("temperature", 0), NL_GENPARAMS_REQUEST, &err), &err);
    CHECK(g.temperature == 0.0, "temperature: 0 as an integer gave %g", g.temperature);
    CHECK_OK(parse1(&g, P_INT("top_p", 1), NL_GENPARAMS_REQUEST, &err), &err);
    CHECK(g.top_p == 1.0, "top_p 1 gave %g", g.top_p);
    nl_wire_param all[] = {
        P_INT("max_new", 7), P_FLT("temperature", 0.25),        P_FLT("top_p", 0.5),
        P_INT("seed", 99),   P_STR("capacity", "ignored here"), P_STR("unknown", "ignored")};
    CHECK_OK(nl_genparams_parse(&g, all, 6, NL_GENPARAMS_REQUEST, &err), &err);
    CHECK(g.max_new == 7 && g.temperature == 0.25 && g.top_p == 0.5 && g.seed == 99,
          "read %d %g %g %lld", g.max_new, g.temperature, g.top_p, (long long)g.seed);
    refused(P_STR("temperature", "0.5"), "temperature as text");
    refused(P_BOOL("temperature", true), "temperature as a boolean");
    refused(P_FLT("temperature", -0.1), "temperature < 0");
    refused(P_FLT("temperature", NAN), "temperature NaN");
    refused(P_FLT("top_p", 0.0), "top_p 0");
    refused(P_FLT("top_p", 1.5), "top_p 1.5");
    refused(P_FLT("max_new", 2.5), "max_new as a float");
    refused(P_INT("max_new", 0), "max_new 0");
    refused(P_INT("max_new", (1 << 20) + 1), "max_new 2^20 + 1");
    refused(P_INT("seed", -1), "seed -1");
    refused(P_FLT("seed", 3.0), "seed as a float");
}

static void test_session(void)
{
    nl_genparams g, h;
    nl_error err = {0};
    nl_wire_param ps[] = {P_INT("session", 12), P_INT("capacity", 40), P_INT("max_new", -5)};
    CHECK_OK(nl_genparams_parse(&g, ps, 3, NL_GENPARAMS_SESSION, &err), &err);
    CHECK(g.session == 12 && g.capacity == 40 && g.limit == 0 && g.temperature == 0.8,
          "session %llu capacity %d limit %d", (unsigned long long)g.session, g.capacity, g.limit);
    CHECK(nl_genparams_parse(&g, ps, 1, NL_GENPARAMS_SESSION, &err) == NL_ERR_PROTO &&
              strstr(err.msg, "capacity"),
          "missing capacity: %s", err.msg);
    CHECK(nl_genparams_parse(&g, ps + 1, 1, NL_GENPARAMS_SESSION, &err) == NL_ERR_PROTO &&
              strstr(err.msg, "session"),
          "missing session: %s", err.msg);
    nl_wire_param bad[] = {P_INT("session", 5), P_STR("capacity", "40")};
    CHECK(nl_genparams_parse(&g, bad, 2, NL_GENPARAMS_SESSION, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "capacity") && g.session == 5,
          "capacity as text: %s (session %llu)", err.msg, (unsigned long long)g.session);
    g = (nl_genparams){.max_new = 3,
                       .temperature = 0.0,
                       .top_p = 0.75,
                       .seed = 4,
                       .session = 77,
                       .capacity = 9,
                       .limit = 3};
    nl_wire_param w[NL_GENPARAMS_SESSION_KEYS];
    nl_genparams_session_wire(&g, w);
    CHECK_OK(nl_genparams_parse(&h, w, NL_GENPARAMS_SESSION_KEYS, NL_GENPARAMS_SESSION, &err),
             &err);
    CHECK(h.session == 77 && h.capacity == 9 && h.limit == 3 && h.temperature == 0.0 &&
              h.top_p == 0.75 && h.seed == 4,
          "the session's wire params read back differently");
    g.adapter = "/ck/a.safetensors";
    nl_wire_param wa[NL_GENPARAMS_SESSION_MAX];
    const uint32_t n = nl_genparams_session_wire(&g, wa);
    CHECK(n == NL_GENPARAMS_SESSION_KEYS + 1, "an adapter: %u params", n);
    CHECK_OK(nl_genparams_parse(&h, wa, n, NL_GENPARAMS_SESSION, &err), &err);
    CHECK(h.adapter && strcmp(h.adapter, g.adapter) == 0, "the adapter read back differently");
    g.logprobs = 3; /* log-probabilities and the top 2 */
    CHECK(nl_genparams_session_wire(&g, wa) == NL_GENPARAMS_SESSION_MAX, "logprobs: 8 params");
    CHECK_OK(nl_genparams_parse(&h, wa, NL_GENPARAMS_SESSION_MAX, NL_GENPARAMS_SESSION, &err),
             &err);
    CHECK(h.logprobs == 3, "logprobs read back as %d", h.logprobs);
    nl_wire_param lp[] = {P_INT("session", 5), P_INT("capacity", 9), P_INT("logprobs", 22)};
    CHECK(nl_genparams_parse(&h, lp, 3, NL_GENPARAMS_SESSION, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "logprobs"),
          "logprobs 22 refused: %s", err.msg);
    nl_wire_param noad[] = {P_INT("session", 5), P_INT("capacity", 9), P_INT("adapter", 3)};
    CHECK(nl_genparams_parse(&h, noad, 3, NL_GENPARAMS_SESSION, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "params.adapter"),
          "an adapter that is no path: %s", err.msg);
}

/* A client's request as neuroctl train writes it. */
static nl_trainparams request(void)
{
    nl_trainparams p;
    nl_trainparams_defaults(&p);
    p.data = "/d/data.txt";
    p.checkpoint_dir = "/ck";
    p.steps = 6;
    p.batch = 4;
    p.seq = 16;
    p.micro = 2;
    p.seed = 5;
    p.warmup = 1;
    p.eval_every = 3;
    p.lr = 1e-3;
    p.min_lr = 1e-4;
    p.final_ckpt = 1;
    return p;
}

static void test_train_request(void)
{
    nl_trainparams p = request(), q;
    nl_error err = {0};
    nl_wire_param w[NL_TRAINPARAMS_MAX_KEYS];
    uint32_t n = nl_trainparams_wire(&p, NL_TRAINPARAMS_TRAIN, w);
    CHECK_OK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_TRAIN, &err), &err);
    CHECK(q.steps == 6 && q.batch == 4 && q.seq == 16 && q.micro == 2 && q.seed == 5 &&
              q.warmup == 1 && q.eval_every == 3 && q.eval_batches == 4 && q.lr == 1e-3 &&
              q.min_lr == 1e-4 && q.holdout == 0.1 && q.final_ckpt && !q.recompute &&
              q.objective == NL_OBJ_MODEL && !q.resume && q.learn_vocab == 0 &&
              strcmp(q.data, "/d/data.txt") == 0 && strcmp(q.checkpoint_dir, "/ck") == 0,
          "the request read back differently");
    CHECK(!nl_params_find(w, n, "resume") && !nl_params_find(w, n, "objective") &&
              !nl_params_find(w, n, "lora_rank") && nl_params_find(w, n, "recompute"),
          "written: unset optional keys left out, booleans in, other uses' keys out");
    p.objective = NL_OBJ_MLM;
    p.resume = "/ck/step-3";
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_TRAIN, w);
    CHECK_OK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_TRAIN, &err), &err);
    CHECK(q.objective == NL_OBJ_MLM && q.resume && strcmp(q.resume, "/ck/step-3") == 0,
          "objective and resume read back differently");
    /* a missing key, a bad one, an unknown objective */
    CHECK(nl_trainparams_parse(&q, w + 1, n - 1, NL_TRAINPARAMS_TRAIN, &err) == NL_ERR_PROTO &&
              strstr(err.msg, w[0].key),
          "missing %s: %s", w[0].key, err.msg);
    nl_wire_param bad[NL_TRAINPARAMS_MAX_KEYS + 1];
    memcpy(bad, w, n * sizeof *w);
    for (uint32_t i = 0; i < n; i++)
        if (strcmp(bad[i].key, "objective") == 0)
            bad[i].s = "next";
    CHECK(nl_trainparams_parse(&q, bad, n, NL_TRAINPARAMS_TRAIN, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "params.objective") && strstr(err.msg, "'next'"),
          "objective next: %s", err.msg);
    /* the batch rule, as params and as flags */
    p = request();
    p.micro = 3;
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_TRAIN, w);
    CHECK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_TRAIN, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "params.microbatches: 3 does not divide params.batch 4"),
          "microbatches 3 of 4: %s", err.msg);
    CHECK(nl_trainparams_check_batch(&p, "--", &err) == NL_ERR_RANGE &&
              strcmp(err.msg, "--microbatches: 3 does not divide --batch 4") == 0,
          "as flags: %s", err.msg);
    p = request();
    p.holdout = 0.0;
    CHECK(nl_trainparams_check_batch(&p, "--", &err) == NL_ERR_RANGE &&
              strcmp(err.msg, "--eval-every needs held-out data (--holdout > 0)") == 0,
          "eval without held-out data: %s", err.msg);
    p = request();
    p.batch = 65536;
    p.micro = 1;
    p.seq = 1024;
    CHECK(nl_trainparams_check_batch(&p, "params.", &err) == NL_ERR_RANGE &&
              strstr(err.msg, "2^24"),
          "a microbatch of 2^26 rows: %s", err.msg);
    p = request();
    p.objective = NL_OBJ_CLASSIFY;
    p.learn_vocab = 100;
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_TRAIN, w);
    CHECK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_TRAIN, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "params.learn_vocab"),
          "classify with learn_vocab: %s", err.msg);
    p = request();
    p.pack = 1;
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_TRAIN, w);
    CHECK_OK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_TRAIN, &err), &err);
    CHECK(q.pack == 1, "pack read back as %d", q.pack);
    p.objective = NL_OBJ_CLASSIFY;
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_TRAIN, w);
    CHECK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_TRAIN, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "params.pack"),
          "classify with pack: %s", err.msg);
}

/* A stage's job: the microbatches in flight beyond 1F1B's come across,
 * within their range, and are 0 where a coordinator sends none. */
static void test_stage_in_flight(void)
{
    nl_trainparams p, q;
    nl_trainparams_defaults(&p);
    p.job = 3;
    p.micro_batch = 2;
    p.seq = 32;
    p.micro = 4;
    p.in_flight_extra = 5;
    nl_error err = {0};
    nl_wire_param w[NL_TRAINPARAMS_MAX_KEYS];
    uint32_t n = nl_trainparams_wire(&p, NL_TRAINPARAMS_STAGE, w);
    CHECK_OK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_STAGE, &err), &err);
    CHECK(q.in_flight_extra == 5, "in_flight_extra read back as %lld",
          (long long)q.in_flight_extra);
    p.in_flight_extra = 65537;
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_STAGE, w);
    CHECK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_STAGE, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "params.in_flight_extra"),
          "65537 extra in flight: %s", err.msg);
    p.in_flight_extra = 0; /* the default is not written */
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_STAGE, w);
    for (uint32_t i = 0; i < n; i++)
        CHECK(strcmp(w[i].key, "in_flight_extra") != 0, "in_flight_extra 0 written");
    q.in_flight_extra = 9;
    CHECK_OK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_STAGE, &err), &err);
    CHECK(q.in_flight_extra == 0, "absent: %lld", (long long)q.in_flight_extra);
}

static void test_finetune(void)
{
    nl_trainparams p = request(), q;
    nl_error err = {0};
    nl_wire_param w[NL_TRAINPARAMS_MAX_KEYS];
    p.lora_rank = 4;
    p.lora_targets = "wq,wo";
    uint32_t n = nl_trainparams_wire(&p, NL_TRAINPARAMS_FINETUNE, w);
    CHECK_OK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_FINETUNE, &err), &err);
    CHECK(q.lora_rank == 4 && q.lora_alpha == 16.0 && strcmp(q.lora_targets, "wq,wo") == 0 &&
              q.lora_bits != 0 && q.steps == 6,
          "the finetune request read back differently");
    p.resume = "/ck/step-3";
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_FINETUNE, w);
    CHECK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_FINETUNE, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "params.resume"),
          "finetune with resume: %s", err.msg);
    p.resume = NULL;
    p.lora_targets = "wq,bogus";
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_FINETUNE, w);
    CHECK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_FINETUNE, &err) != NL_OK &&
              strstr(err.msg, "params.lora_targets"),
          "bad targets: %s", err.msg);
    p.lora_targets = "wq";
    p.lora_alpha = 0.0;
    n = nl_trainparams_wire(&p, NL_TRAINPARAMS_FINETUNE, w);
    CHECK(nl_trainparams_parse(&q, w, n, NL_TRAINPARAMS_FINETUNE, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "params.lora_alpha"),
          "alpha 0: %s", err.msg);
    /* issue 31: an adapter file's alpha is held to the same range (its
     * arguments are checked before the model is looked at) */
    nl_lora *lo = NULL;
    static const float bad[] = {INFINITY, 1e38f, NAN, -1.0f, 0.0f};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK(nl_lora_new(&lo, NULL, 4, bad[i], NL_LORA_WQ, 8, &err) == NL_ERR_INVALID && !lo &&
                  strstr(err.msg, "alpha"),
              "an adapter with alpha %g: %s", (double)bad[i], err.msg);
}

static void test_train_stage(void)
{
    nl_trainparams q;
    nl_error err = {0};
    nl_wire_param st[] = {P_INT("job", 9),
                          P_INT("micro_batch", 2),
                          P_INT("seq", 4),
                          P_INT("microbatches", 3),
                          P_INT("recompute", 1),
                          P_BOOL("moments", true),
                          P_STR("data", "not a stage's: ignored")};
    CHECK_OK(nl_trainparams_parse(&q, st, 7, NL_TRAINPARAMS_STAGE, &err), &err);
    CHECK(q.job == 9 && q.micro_batch == 2 && q.seq == 4 && q.micro == 3 && q.recompute &&
              q.moments && q.start_step == 0 && q.eval_hops == 0,
          "a stage's job read differently");
    CHECK(nl_trainparams_parse(&q, st, 2, NL_TRAINPARAMS_STAGE, &err) == NL_ERR_PROTO &&
              strstr(err.msg, "params.seq") && q.job == 9,
          "no seq: %s", err.msg);
    /* fine-tuning: its adapters' keys, and no moments */
    nl_wire_param ft[] = {P_INT("job", 9),
                          P_INT("micro_batch", 2),
                          P_INT("seq", 4),
                          P_INT("microbatches", 3),
                          P_INT("lora_rank", 2),
                          P_FLT("lora_alpha", 4),
                          P_STR("lora_targets", "wq"),
                          P_INT("lora_seed", 7),
                          P_BOOL("moments", true)};
    CHECK(nl_trainparams_parse(&q, ft, 9, NL_TRAINPARAMS_STAGE_FT, &err) == NL_ERR_INVALID &&
              strstr(err.msg, "params.moments"),
          "fine-tuning with moments: %s", err.msg);
    CHECK_OK(nl_trainparams_parse(&q, ft, 8, NL_TRAINPARAMS_STAGE_FT, &err), &err);
    CHECK(q.lora_rank == 2 && q.lora_alpha == 4.0 && q.lora_seed == 7, "a stage's adapters");
    nl_wire_param big[] = {P_INT("job", 9), P_INT("micro_batch", 1 << 20), P_INT("seq", 32),
                           P_INT("microbatches", 1)};
    CHECK(nl_trainparams_parse(&q, big, 4, NL_TRAINPARAMS_STAGE, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "2^24"),
          "a microbatch of 2^25 rows: %s", err.msg);
}

static void test_objective(void)
{
    nl_error err = {0};
    int obj = -5;
    for (int i = NL_OBJ_CLM; i <= NL_OBJ_CLASSIFY; i++) {
        CHECK_OK(nl_objective_parse(nl_objective_name(i), &obj, &err), &err);
        CHECK(obj == i, "%s read back as %d", nl_objective_name(i), obj);
    }
    CHECK(nl_objective_parse("next", &obj, &err) == NL_ERR_INVALID &&
              strcmp(err.msg, "'next' is not clm, mlm or classify") == 0,
          "next: %s", err.msg);
    nl_config c = {.vocab_size = 256, .objective = NL_OBJ_CLM};
    obj = NL_OBJ_MODEL;
    CHECK_OK(nl_objective_check(&c, &obj, &err), &err);
    CHECK(obj == NL_OBJ_CLM, "the model's objective: %d", obj);
    obj = NL_OBJ_MLM;
    CHECK(nl_objective_check(&c, &obj, &err) == NL_ERR_INVALID &&
              strstr(err.msg, "does not hold the mask id"),
          "mlm on 256 ids: %s", err.msg);
    obj = NL_OBJ_CLASSIFY;
    CHECK(nl_objective_check(&c, &obj, &err) == NL_ERR_INVALID &&
              strstr(err.msg, "has no classifier"),
          "classify without classes: %s", err.msg);
    c.vocab_size = 300;
    c.num_classes = 3;
    obj = NL_OBJ_MLM;
    CHECK_OK(nl_objective_check(&c, &obj, &err), &err);
    obj = NL_OBJ_CLASSIFY;
    CHECK_OK(nl_objective_check(&c, &obj, &err), &err);
    CHECK(nl_objective_loss_rows(NL_OBJ_CLM, 7, 7) == 0 &&
              nl_objective_loss_rows(NL_OBJ_CLM, 6, 7) == 6 &&
              nl_objective_loss_rows(NL_OBJ_MLM, 7, 7) == 7,
          "loss rows");
}

/* Packed rows: a stream of documents ended by <|end|>, batched with and
 * without documents. */
static void test_pack(void)
{
    enum { N = 400, B = 3, T = 24 };
    nl_error err = {0};
    uint32_t *ids = malloc(N * sizeof *ids);
    CHECK(ids != NULL, "out of memory");
    for (int i = 0; i < N; i++) /* documents of 1..9 ids, each ended by <|end|> */
        ids[i] = i % 7 == 6 || i % 11 == 10 ? NL_TOKEN_END : (uint32_t)(i * 31 % 256);
    nl_dataset *ds = NULL;
    CHECK_OK(nl_dataset_from_ids(&ds, ids, N, 0.1, &err), &err);
    nl_config c = {.vocab_size = 300, .mask_prob = 0.3};
    int32_t tok[B * T], tgt[B * T], doc[B * T], ptok[B * T], ptgt[B * T];
    int64_t valid = 0, pvalid = 0;
    CHECK_OK(nl_objective_batch(ds, NL_OBJ_CLM, &c, 0, 5, 2, B, T, tok, tgt, NULL, &valid, &err),
             &err);
    CHECK_OK(nl_objective_batch(ds, NL_OBJ_CLM, &c, 0, 5, 2, B, T, ptok, ptgt, doc, &pvalid, &err),
             &err);
    CHECK(valid == B * T && memcmp(tok, ptok, sizeof tok) == 0, "packing changed the ids");
    int64_t ends = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const int i = b * T + t;
            int32_t d = 0;
            for (int u = 0; u < t; u++)
                d += tok[b * T + u] == NL_TOKEN_END;
            CHECK(doc[i] == d, "row %d position %d: document %d, not %d", b, t, doc[i], d);
            ends += tok[i] == NL_TOKEN_END;
            CHECK(ptgt[i] == (tok[i] == NL_TOKEN_END ? -1 : tgt[i]),
                  "row %d position %d: target %d (id %d, unpacked %d)", b, t, ptgt[i], tok[i],
                  tgt[i]);
        }
    CHECK(ends > 0 && pvalid == B * T - ends, "%lld ends: %lld valid", (long long)ends,
          (long long)pvalid);
    CHECK(nl_objective_loss_rows(NL_OBJ_CLM, pvalid, B * T) == pvalid, "packed clm's loss rows");
    /* mlm: the same mask as unpacked, the documents of the ids before it */
    int32_t mdoc[B * T];
    CHECK_OK(nl_objective_batch(ds, NL_OBJ_MLM, &c, 1, 5, 3, B, T, tok, tgt, NULL, &valid, &err),
             &err);
    CHECK_OK(nl_objective_batch(ds, NL_OBJ_MLM, &c, 1, 5, 3, B, T, ptok, ptgt, mdoc, &pvalid, &err),
             &err);
    CHECK(valid == pvalid && memcmp(tok, ptok, sizeof tok) == 0 &&
              memcmp(tgt, ptgt, sizeof tgt) == 0,
          "packing changed mlm's batch");
    CHECK_OK(nl_objective_batch(ds, NL_OBJ_CLM, &c, 1, 5, 3, B, T, ptok, ptgt, doc, &pvalid, &err),
             &err);
    CHECK(memcmp(doc, mdoc, sizeof doc) == 0, "mlm's documents are not those of its ids");
    /* the refusals */
    CHECK_OK(nl_objective_check_pack(&c, NL_OBJ_MLM, &err), &err);
    CHECK(nl_objective_check_pack(&c, NL_OBJ_CLASSIFY, &err) == NL_ERR_INVALID &&
              strstr(err.msg, "--pack: not with --objective classify"),
          "pack with classify: %s", err.msg);
    c.vocab_size = 257;
    CHECK(nl_objective_check_pack(&c, NL_OBJ_CLM, &err) == NL_ERR_INVALID &&
              strstr(err.msg, "does not hold <|end|>"),
          "pack on 257 ids: %s", err.msg);
    nl_dataset_destroy(&ds);
}

static void test_step_decide(void)
{
    nl_step_result r;
    double s = nl_step_decide(&r, 10.0, 4.0, 0.5, 0.01, 16.0, NL_TRAIN_CLIP_NORM);
    CHECK(r.ce_loss == 2.5 && r.aux_loss == 0.5 && r.loss == 2.5 + 0.01 * 0.5 &&
              r.grad_norm == 4.0 && !r.skipped && s == 1.0 / (4.0 + 1e-6),
          "decide: loss %g norm %g scale %g", r.loss, r.grad_norm, s);
    s = nl_step_decide(&r, 1.0, 1.0, 0.0, 0.01, 0.25, NL_TRAIN_CLIP_NORM);
    CHECK(s == 1.0 && r.grad_norm == 0.5, "below the clip norm: scale %g", s);
    s = nl_step_decide(&r, NAN, 1.0, 0.0, 0.01, 0.25, NL_TRAIN_CLIP_NORM);
    CHECK(r.skipped && s == 0.0, "NaN loss: skipped %d scale %g", r.skipped, s);
    s = nl_step_decide(&r, 1.0, 1.0, 0.0, 0.01, INFINITY, NL_TRAIN_CLIP_NORM);
    CHECK(r.skipped && s == 0.0 && isinf(r.grad_norm), "inf gradient: skipped %d", r.skipped);
    s = nl_step_decide(&r, 1.0, 1.0, INFINITY, 0.01, 1.0, NL_TRAIN_CLIP_NORM);
    CHECK(r.skipped && s == 0.0, "inf aux loss: skipped %d", r.skipped);
}

int main(void)
{
    test_request();
    test_session();
    test_train_request();
    test_stage_in_flight();
    test_finetune();
    test_train_stage();
    test_objective();
    test_pack();
    test_step_decide();
    return check_done("test_policy");
}
