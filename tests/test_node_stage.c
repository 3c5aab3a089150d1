/* Unit tests of node/stage: the pipeline stage without sockets.
 *
 *  - assignment: config and layer checks, refusal for lack of memory;
 *  - loading by chunks: complete tensors land bit-exact; an incomplete
 *    tensor, a wrong name, shape, dtype, range or an overlap is refused
 *    with a typed error naming it; chunks of an older epoch are ignored;
 *    LOAD_DONE 0 initialises exactly as nl_model_init_random;
 *  - the forward hop: two stages chained equal nl_forward of the whole
 *    model (logits and aux); bad hops are refused; the output buffer is
 *    not overwritten while a send holds it;
 *  - sessions: KV generation through two stages equals a local one;
 *    capacity, budget, LRU eviction order, the evicted-session error,
 *    the sampler on the last stage only;
 *  - the token ring: a session's limit makes the last stage say which
 *    tokens to feed to the first (and where), the last one and a full
 *    cache stop it; closed sessions are remembered; decode steps are
 *    accounted per session.
 * Batched session hops and adapters: test_node_stage_batch.c. */
#include <unistd.h>

#include "tests/stage_harness.h"

/* ---- assignment and loading ---- */

static void test_assign(void)
{
    nl_error err;
    nl_stage_loaded info;
    bool stale = false;
    nl_stage *s = mk_stage(1ULL << 30, 1 << 20);
    CHECK(nl_stage_state(s) == NL_NODE_IDLE && !nl_stage_model(s), "new stage has a model");
    nl_msg_assign a = mk_assign(3, 0, 2, 0, 9);
    CHECK(nl_stage_assign(s, &a, &err) == NL_ERR_RANGE && strstr(err.msg, "[0, 9)"),
          "layers past L: %s", err.msg);
    a = mk_assign(3, 0, 2, 0, cfg.num_layers + 1); /* one past the model's last layer */
    CHECK(nl_stage_assign(s, &a, &err) == NL_ERR_RANGE && strstr(err.msg, "exceed"),
          "layers one past L: %s", err.msg);
    a = mk_assign(3, 0, 2, 0, 2);
    a.has_embed = false;
    CHECK(nl_stage_assign(s, &a, &err) == NL_ERR_RANGE, "stage 0 without embedding: %s", err.msg);
    a = mk_assign(3, 0, 2, 0, 2);
    a.config_json = "{\"hidden_dim\": 30}";
    CHECK(nl_stage_assign(s, &a, &err) != NL_OK && strstr(err.msg, "config_json"), "bad config: %s",
          err.msg);
    /* more weights than --memory: refused; loads of its epoch are dropped */
    nl_stage *tiny = mk_stage(4096, 0);
    a = mk_assign(4, 0, 1, 0, cfg.num_layers);
    CHECK(nl_stage_assign(tiny, &a, &err) == NL_ERR_CAPACITY && strstr(err.msg, "--memory"),
          "over memory: %s", err.msg);
    CHECK(nl_stage_state(tiny) == NL_NODE_IDLE, "refused ASSIGN left a model");
    float z[4] = {0};
    nl_wire_frame f = f32_frame(z, 4);
    nl_param fake = {.name = "norm.weight", .ndim = 1, .shape = {cfg.hidden_dim}};
    nl_msg_layer_load l = mk_load(4, &fake, 0, 0, 1);
    CHECK(nl_stage_load_chunk(tiny, &l, &f, &stale, &err) == NL_OK && stale,
          "chunk for a refused ASSIGN not dropped");
    CHECK(nl_stage_load_done(tiny, 4, 1, &info, &stale, &err) == NL_ERR_STATE &&
              strstr(err.msg, "refused"),
          "LOAD_DONE after a refused ASSIGN: %s", err.msg);
    nl_stage_destroy(&tiny);

    a = mk_assign(3, 0, 2, 0, 2);
    CHECK_OK(nl_stage_assign(s, &a, &err), &err);
    CHECK(nl_stage_state(s) == NL_NODE_LOADING && nl_stage_epoch(s) == 3, "state after ASSIGN");
    const nl_model *m = nl_stage_model(s);
    CHECK(m && m->l0 == 0 && m->l1 == 2 && m->has_embed && !m->has_head, "stage model");
    CHECK(nl_stage_max_rows(s) >= cfg.max_seq_len, "max rows %d", nl_stage_max_rows(s));
    nl_stage_destroy(&s);
    nl_stage_destroy(&s); /* NULL-safe */
}

static void test_load(const nl_model *ref)
{
    nl_error err;
    nl_stage_loaded info;
    bool stale = false;
    nl_stage *s = mk_stage(1ULL << 30, 1 << 20);
    nl_msg_assign a = mk_assign(7, 0, 2, 0, 2);
    nl_stage_session_params sp = {.id = 1, .capacity = 4, .top_p = 1};
    float buf[CHUNK];
    for (int i = 0; i < CHUNK; i++)
        buf[i] = 99.0f;
    CHECK(nl_stage_load_done(s, 7, 1, &info, &stale, &err) == NL_ERR_STATE,
          "LOAD_DONE before ASSIGN: %s", err.msg);
    CHECK_OK(nl_stage_assign(s, &a, &err), &err);
    const nl_model *m = nl_stage_model(s);
    int hold = 0; /* a tensor left one (partial) chunk short */
    while (hold < m->n_table && (nl_param_numel(&m->table[hold]) <= CHUNK ||
                                 nl_param_numel(&m->table[hold]) % CHUNK == 0))
        hold++;
    CHECK_OK(stream(s, ref, 7, hold, &err), &err);
    CHECK(nl_stage_load_done(s, 7, (uint32_t)m->n_table, &info, &stale, &err) == NL_ERR_NOTFOUND &&
              strstr(err.msg, m->table[hold].name) && strstr(err.msg, "incomplete"),
          "incomplete tensor: %s", err.msg);
    CHECK(nl_stage_state(s) == NL_NODE_LOADING, "incomplete load made the stage ready");

    /* refusals, each naming its fault */
    const nl_param *p = &m->table[hold];
    size_t numel = nl_param_numel(p), last = (numel - 1) / CHUNK * CHUNK;
    nl_wire_frame f = f32_frame(buf, CHUNK);
    nl_msg_layer_load l = mk_load(7, p, 0, 0, 1);
    l.name = "layers.2.attention_norm.weight"; /* a layer of another stage */
    CHECK(nl_stage_load_chunk(s, &l, &f, &stale, &err) == NL_ERR_NOTFOUND &&
              strstr(err.msg, "layers.2.attention_norm.weight"),
          "foreign tensor: %s", err.msg);
    l = mk_load(7, p, 0, 0, 1);
    l.shape[0] += 1;
    CHECK(nl_stage_load_chunk(s, &l, &f, &stale, &err) == NL_ERR_SHAPE && strstr(err.msg, p->name),
          "wrong shape: %s", err.msg);
    l = mk_load(7, p, 0, 0, 1);
    l.ndim = 1;
    l.shape[0] = (int64_t)numel;
    CHECK(nl_stage_load_chunk(s, &l, &f, &stale, &err) == NL_ERR_SHAPE, "flattened shape: %s",
          err.msg);
    l = mk_load(7, p, numel - 1, 0, 1);
    CHECK(nl_stage_load_chunk(s, &l, &f, &stale, &err) == NL_ERR_RANGE, "chunk past the end: %s",
          err.msg);
    l = mk_load(7, p, 0, 0, 1); /* the first chunk again: overlaps */
    CHECK(nl_stage_load_chunk(s, &l, &f, &stale, &err) == NL_ERR_RANGE &&
              strstr(err.msg, "overlapping"),
          "overlap: %s", err.msg);
    nl_wire_frame fi = f;
    fi.t.dtype = NL_DTYPE_I32;
    l = mk_load(7, p, last, 0, 1);
    CHECK(nl_stage_load_chunk(s, &l, &fi, &stale, &err) == NL_ERR_DTYPE, "I32 chunk: %s", err.msg);
    /* an older epoch is ignored (and writes nothing); a newer one is refused */
    l = mk_load(6, p, 0, 0, 1); /* over loaded values: params_equal below sees a write */
    stale = false;
    CHECK(nl_stage_load_chunk(s, &l, &f, &stale, &err) == NL_OK && stale, "stale chunk taken");
    l = mk_load(8, p, last, 0, 1);
    CHECK(nl_stage_load_chunk(s, &l, &f, &stale, &err) == NL_ERR_STATE, "future epoch: %s",
          err.msg);
    CHECK(nl_stage_load_done(s, 6, 0, &info, &stale, &err) == NL_OK && stale,
          "stale LOAD_DONE not ignored");
    CHECK(nl_stage_state(s) == NL_NODE_LOADING, "stale LOAD_DONE changed the state");
    CHECK(nl_stage_open_session(s, &sp, &err) == NL_ERR_STATE, "session before load: %s", err.msg);

    /* the missing chunk completes the load */
    float *src =
        check_download(be, nl_model_param_data(ref, nl_model_find_param(ref, p->name)), numel);
    f = f32_frame(src + last, (int64_t)(numel - last));
    l = mk_load(7, p, last, 0, 1);
    CHECK_OK(nl_stage_load_chunk(s, &l, &f, &stale, &err), &err);
    CHECK(!stale, "current chunk taken as stale");
    free(src);
    CHECK(nl_stage_load_done(s, 7, (uint32_t)m->n_table + 1, &info, &stale, &err) == NL_ERR_PROTO,
          "wrong tensor count: %s", err.msg);
    CHECK_OK(nl_stage_load_done(s, 7, (uint32_t)m->n_table, &info, &stale, &err), &err);
    CHECK(nl_stage_state(s) == NL_NODE_READY, "not READY after LOAD_DONE");
    CHECK(info.tensors == (uint32_t)m->n_table && info.bytes == m->n_params * 4 && !info.from_seed,
          "load info %u %llu", info.tensors, (unsigned long long)info.bytes);
    CHECK(params_equal(m, ref), "streamed parameters differ from the checkpoint's");
    l = mk_load(7, p, 0, 0, 1);
    CHECK(nl_stage_load_chunk(s, &l, &f, &stale, &err) == NL_ERR_STATE, "chunk after load: %s",
          err.msg);

    /* LOAD_DONE 0: the seed's values, as a whole-model init gives them */
    a = mk_assign(9, 1, 2, 2, cfg.num_layers);
    CHECK_OK(nl_stage_assign(s, &a, &err), &err);
    CHECK_OK(nl_stage_load_done(s, 9, 0, &info, &stale, &err), &err);
    CHECK(info.from_seed && nl_stage_state(s) == NL_NODE_READY, "seed init");
    CHECK(params_equal(nl_stage_model(s), ref), "seed init differs from nl_model_init_random");
    nl_stage_destroy(&s);
}

/* ---- the forward hop ---- */

static void test_forward(nl_model *ref)
{
    nl_error err;
    nl_stage_out o1, o2;
    const int B = 2, T = 7, V = (int)cfg.vocab_size;
    int32_t tok[2 * 7];
    for (int i = 0; i < B * T; i++)
        tok[i] = (int32_t)((i * 37 + 11) % V);
    nl_runstate *rs = NULL;
    CHECK_OK(nl_runstate_new(&rs, ref, B * T, &err), &err);
    nl_forward_args fa = {.B = B, .T = T, .tokens = tok};
    float aux_ref = 0;
    CHECK_OK(nl_forward(ref, rs, &fa, &aux_ref, &err), &err);
    float *logits = check_download(be, nl_runstate_output(rs, NULL), (size_t)B * T * V);

    /* one stage holding everything: identical */
    nl_stage *w = loaded_stage(ref, 0, 1, 0, cfg.num_layers, 1 << 20);
    nl_msg_tensor_hop hop = {.job_id = 42};
    nl_wire_frame f = tok_frame(tok, B, T);
    CHECK_OK(nl_stage_forward(w, &hop, &f, &o1, &err), &err);
    CHECK(o1.kind == NL_STAGE_OUT_LOGITS && o1.ndim == 3 && o1.shape[0] == B && o1.shape[1] == T &&
              o1.shape[2] == V,
          "whole-model output kind %d", o1.kind);
    CHECK(check_max_abs_diff(o1.data, logits, (size_t)B * T * V) <= 1e-6, "whole-model logits");
    CHECK(o1.aux == (double)aux_ref, "aux %g vs %g", o1.aux, (double)aux_ref);

    /* two stages chained */
    nl_stage *s0 = loaded_stage(ref, 0, 2, 0, 2, 1 << 20);
    nl_stage *s1 = loaded_stage(ref, 1, 2, 2, cfg.num_layers, 1 << 20);
    hop.aux = 0.5;
    CHECK_OK(nl_stage_forward(s0, &hop, &f, &o1, &err), &err);
    CHECK(o1.kind == NL_STAGE_OUT_HIDDEN && o1.ndim == 3 && o1.shape[2] == cfg.hidden_dim,
          "first stage output");
    nl_msg_tensor_hop hop1 = hop;
    hop1.aux = o1.aux;
    nl_wire_frame h = out_frame(&o1);
    CHECK_OK(nl_stage_forward(s1, &hop1, &h, &o2, &err), &err);
    CHECK(o2.kind == NL_STAGE_OUT_LOGITS, "last stage output kind %d", o2.kind);
    CHECK(check_max_abs_diff(o2.data, logits, (size_t)B * T * V) <= 1e-6, "chained logits: %g",
          check_max_abs_diff(o2.data, logits, (size_t)B * T * V));
    CHECK(fabs(o2.aux - 0.5 - aux_ref) <= 1e-6 * (1 + fabs(aux_ref)), "chained aux %g vs %g",
          o2.aux - 0.5, (double)aux_ref);

    /* a send holding the output blocks the next forward until released */
    nl_wire_frame held;
    nl_txref_frame(&held, nl_stage_txref(s0), o1.data, NL_DTYPE_F32, o1.shape, 3);
    CHECK(nl_stage_forward(s0, &hop, &f, &o1, &err) == NL_ERR_TIMEOUT && strstr(err.msg, "job 42"),
          "forward over a busy output: %s", err.msg);
    held.free_fn(held.t.data, held.hint);
    CHECK_OK(nl_stage_forward(s0, &hop, &f, &o1, &err), &err);

    /* bad hops */
    nl_wire_frame bad = f;
    bad.t.dtype = NL_DTYPE_F32;
    CHECK(nl_stage_forward(s0, &hop, &bad, &o1, &err) == NL_ERR_SHAPE && strstr(err.msg, "job 42"),
          "F32 to the first stage: %s", err.msg);
    CHECK(nl_stage_forward(s1, &hop, &f, &o1, &err) == NL_ERR_SHAPE, "tokens to stage 1: %s",
          err.msg);
    h.t.shape[2] = cfg.hidden_dim + 1;
    CHECK(nl_stage_forward(s1, &hop, &h, &o1, &err) == NL_ERR_SHAPE, "wrong width: %s", err.msg);
    tok[3] = V;
    CHECK(nl_stage_forward(s0, &hop, &f, &o1, &err) == NL_ERR_RANGE && strstr(err.msg, "job 42"),
          "token out of range: %s", err.msg);
    tok[3] = 0;
    hop.pos_offset = 3;
    CHECK(nl_stage_forward(s0, &hop, &f, &o1, &err) == NL_ERR_RANGE, "pos_offset w/o session: %s",
          err.msg);
    hop.pos_offset = 0;
    hop.step = 1;
    CHECK(nl_stage_forward(s0, &hop, &f, &o1, &err) == NL_ERR_INVALID, "training hop: %s", err.msg);
    hop.step = 0;
    hop.session_id = 77;
    CHECK(nl_stage_forward(s0, &hop, &f, &o1, &err) == NL_ERR_NOTFOUND &&
              strstr(err.msg, "session 77 is not open"),
          "unknown session: %s", err.msg);
    hop.session_id = 0;
    nl_stage *empty = mk_stage(1 << 30, 0);
    CHECK(nl_stage_forward(empty, &hop, &f, &o1, &err) == NL_ERR_STATE, "no model: %s", err.msg);
    nl_stage_destroy(&empty);
    /* more rows than the memory allows (1 KiB past the weights and the
     * runtime: the floor of one sequence) */
    uint64_t weights = 4 * (uint64_t)nl_stage_param_count(&cfg, cfg.num_layers, 1, 1);
    nl_stage *small = mk_stage(NL_MEM_RUNTIME_BYTES + weights + 1024, 0);
    nl_msg_assign a = mk_assign(1, 0, 1, 0, cfg.num_layers);
    nl_stage_loaded info;
    bool stale;
    CHECK_OK(nl_stage_assign(small, &a, &err), &err);
    CHECK_OK(nl_stage_load_done(small, 1, 0, &info, &stale, &err), &err);
    CHECK(nl_stage_max_rows(small) == cfg.max_seq_len, "max rows %d", nl_stage_max_rows(small));
    int32_t *big = calloc((size_t)2 * cfg.max_seq_len, sizeof *big);
    nl_wire_frame fb = tok_frame(big, 2, cfg.max_seq_len);
    CHECK(nl_stage_forward(small, &hop, &fb, &o1, &err) == NL_ERR_CAPACITY, "too many rows: %s",
          err.msg);
    fb = tok_frame(big, 1, cfg.max_seq_len);
    CHECK_OK(nl_stage_forward(small, &hop, &fb, &o1, &err), &err);
    free(big);
    nl_stage_destroy(&small);

    /* an ASSIGN while a send holds the output: refused without freeing it */
    CHECK_OK(nl_stage_forward(s0, &hop, &f, &o1, &err), &err);
    nl_txref_frame(&held, nl_stage_txref(s0), o1.data, NL_DTYPE_F32, o1.shape, 3);
    a = mk_assign(8, 0, 2, 0, 2);
    CHECK(nl_stage_assign(s0, &a, &err) == NL_ERR_TIMEOUT, "ASSIGN over a busy output: %s",
          err.msg);
    CHECK(nl_stage_state(s0) == NL_NODE_IDLE && !nl_stage_model(s0), "state after refusal");
    CHECK(nl_stage_forward(s0, &hop, &f, &o2, &err) == NL_ERR_STATE, "forward after refusal: %s",
          err.msg);
    CHECK(nl_stage_load_done(s0, 8, 0, &info, &stale, &err) == NL_ERR_STATE &&
              strstr(err.msg, "still being sent"),
          "LOAD_DONE after refusal: %s", err.msg);
    held.free_fn(held.t.data, held.hint);
    a = mk_assign(9, 0, 2, 0, 2);
    CHECK_OK(nl_stage_assign(s0, &a, &err), &err);
    CHECK(nl_stage_state(s0) == NL_NODE_LOADING, "state after a later ASSIGN");

    nl_stage_destroy(&w);
    nl_stage_destroy(&s0);
    nl_stage_destroy(&s1);
    nl_runstate_destroy(&rs);
    free(logits);
}

/* ---- sessions ---- */

static void test_generation(nl_model *ref)
{
    nl_error err;
    enum { P = 5, N = 8 };
    int32_t prompt[P] = {3, 141, 59, 26, 5}, want[N], got[N];
    local_generate(ref, prompt, P, N, want);
    nl_stage *s0 = loaded_stage(ref, 0, 2, 0, 2, 1 << 20);
    nl_stage *s1 = loaded_stage(ref, 1, 2, 2, cfg.num_layers, 1 << 20);
    nl_stage_session_params sp = {.id = 9, .capacity = P + N, .temperature = 0, .top_p = 1};
    CHECK_OK(nl_stage_open_session(s0, &sp, &err), &err);
    CHECK_OK(nl_stage_open_session(s1, &sp, &err), &err);
    nl_stage_session_info i0, i1;
    CHECK(nl_stage_session(s0, 9, &i0) && !i0.has_sampler, "sampler on the first stage");
    CHECK(nl_stage_session(s1, 9, &i1) && i1.has_sampler, "no sampler on the last stage");
    CHECK(i0.capacity == P + N && i0.len == 0, "session info %d %d", i0.capacity, i0.len);
    nl_msg_tensor_hop hop = {.job_id = 9, .session_id = 9};
    nl_stage_out o0, o1;
    int32_t cur = 0;
    nl_wire_frame f = tok_frame(prompt, 1, P);
    for (int i = 0; i < N; i++) {
        CHECK_OK(nl_stage_forward(s0, &hop, &f, &o0, &err), &err);
        nl_wire_frame h = out_frame(&o0);
        CHECK_OK(nl_stage_forward(s1, &hop, &h, &o1, &err), &err);
        CHECK(o1.kind == NL_STAGE_OUT_TOKEN, "last stage of a session gave kind %d", o1.kind);
        got[i] = cur = o1.token;
        hop.pos_offset += (uint64_t)(i == 0 ? P : 1);
        f = tok_frame(&cur, 1, 1);
    }
    CHECK(memcmp(got, want, sizeof want) == 0, "generated ids differ from a local generation");
    CHECK(nl_stage_session(s0, 9, &i0) && i0.len == P + N - 1, "cache length %d", i0.len);
    /* faults: wrong position, batch of 2, overflowing the cache */
    hop.pos_offset = 3;
    CHECK(nl_stage_forward(s0, &hop, &f, &o0, &err) == NL_ERR_RANGE && strstr(err.msg, "session 9"),
          "pos_offset mismatch: %s", err.msg);
    hop.pos_offset = (uint64_t)(P + N - 1);
    int32_t two[4] = {1, 2, 3, 4};
    nl_wire_frame f2 = tok_frame(two, 2, 1);
    CHECK(nl_stage_forward(s0, &hop, &f2, &o0, &err) == NL_ERR_SHAPE, "B = 2 in a session: %s",
          err.msg);
    f2 = tok_frame(two, 1, 2);
    CHECK(nl_stage_forward(s0, &hop, &f2, &o0, &err) == NL_ERR_CAPACITY, "cache overflow: %s",
          err.msg);
    CHECK(nl_stage_session(s0, 9, &i0) && i0.len == P + N - 1, "a refused hop changed the cache");
    /* JOB_CANCEL drops it: then it is unknown, not evicted */
    CHECK(nl_stage_close_session(s0, 9) && !nl_stage_close_session(s0, 9), "close");
    hop.pos_offset = 0;
    CHECK(nl_stage_forward(s0, &hop, &f, &o0, &err) == NL_ERR_NOTFOUND &&
              strstr(err.msg, "not open"),
          "closed session: %s", err.msg);
    nl_stage_destroy(&s0);
    nl_stage_destroy(&s1);
}

static nl_msg_job_submit mk_submit(nl_wire_param *ps, uint32_t n)
{
    nl_msg_job_submit j = {.kind = NL_JOB_GENERATE, .nparams = n, .params = ps};
    return j;
}

static void test_session_params(void)
{
    nl_error err;
    nl_stage_session_params p;
    nl_wire_param ps[5] = {
        {.key = "session", .kind = NL_WIRE_PARAM_INT, .i = 12},
        {.key = "capacity", .kind = NL_WIRE_PARAM_INT, .i = 40},
        {.key = "temperature", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "top_p", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.9},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = 77},
    };
    nl_msg_job_submit j = mk_submit(ps, 5);
    CHECK_OK(nl_stage_parse_session(&j, &p, &err), &err);
    CHECK(p.id == 12 && p.capacity == 40 && p.temperature == 1.0f && p.top_p == 0.9f &&
              p.seed == 77,
          "parsed %llu %d %g %g", (unsigned long long)p.id, p.capacity, p.temperature, p.top_p);
    j = mk_submit(ps, 1);
    CHECK(nl_stage_parse_session(&j, &p, &err) == NL_ERR_PROTO && strstr(err.msg, "capacity"),
          "missing capacity: %s", err.msg);
    j = mk_submit(ps + 1, 4);
    CHECK(nl_stage_parse_session(&j, &p, &err) == NL_ERR_PROTO && strstr(err.msg, "session"),
          "missing session: %s", err.msg);
    ps[3].f = 0.0;
    j = mk_submit(ps, 5);
    CHECK(nl_stage_parse_session(&j, &p, &err) == NL_ERR_RANGE && strstr(err.msg, "top_p"),
          "top_p 0: %s", err.msg);
    ps[3].f = 1.0;
    ps[1].kind = NL_WIRE_PARAM_STR;
    ps[1].s = "40";
    CHECK(nl_stage_parse_session(&j, &p, &err) == NL_ERR_RANGE, "capacity as text: %s", err.msg);
    j.kind = NL_JOB_FORWARD;
    CHECK(nl_stage_parse_session(&j, &p, &err) == NL_ERR_UNSUPPORTED, "forward kind: %s", err.msg);
    /* limit: a count >= 0, 0 when absent */
    ps[1] = (nl_wire_param){.key = "capacity", .kind = NL_WIRE_PARAM_INT, .i = 40};
    nl_wire_param lim[6];
    memcpy(lim, ps, sizeof ps);
    lim[5] = (nl_wire_param){.key = "limit", .kind = NL_WIRE_PARAM_INT, .i = 9};
    j = mk_submit(lim, 6);
    CHECK_OK(nl_stage_parse_session(&j, &p, &err), &err);
    CHECK(p.limit == 9, "limit %d", p.limit);
    j = mk_submit(lim, 5);
    CHECK(nl_stage_parse_session(&j, &p, &err) == NL_OK && p.limit == 0, "no limit: %d", p.limit);
    lim[5].i = -1;
    j = mk_submit(lim, 6);
    CHECK(nl_stage_parse_session(&j, &p, &err) == NL_ERR_RANGE && strstr(err.msg, "limit"),
          "limit -1: %s", err.msg);
    lim[5] = (nl_wire_param){.key = "limit", .kind = NL_WIRE_PARAM_FLOAT, .f = 2.5};
    CHECK(nl_stage_parse_session(&j, &p, &err) == NL_ERR_RANGE && strstr(err.msg, "limit"),
          "limit 2.5: %s", err.msg);
}

/* The token ring on the stage: with a limit the last stage says which
 * tokens to feed to the first (and at which position) and which is the
 * last; the cache's end stops it too; a closed session is remembered, and
 * each session accounts its decode steps. */
static void test_ring(nl_model *ref)
{
    nl_error err;
    enum { P = 4, N = 6 };
    int32_t prompt[P] = {9, 8, 7, 6}, want[N], got[N];
    local_generate(ref, prompt, P, N, want);
    nl_stage *s0 = loaded_stage(ref, 0, 2, 0, 2, 1 << 20);
    nl_stage *s1 = loaded_stage(ref, 1, 2, 2, cfg.num_layers, 1 << 20);
    nl_stage_session_params sp = {.id = 5, .capacity = P + N, .top_p = 1, .limit = P + N + 1};
    CHECK(nl_stage_open_session(s1, &sp, &err) == NL_ERR_RANGE && strstr(err.msg, "limit"),
          "limit over the capacity: %s", err.msg);
    sp.limit = N;
    CHECK_OK(nl_stage_open_session(s0, &sp, &err), &err);
    CHECK_OK(nl_stage_open_session(s1, &sp, &err), &err);
    nl_msg_tensor_hop hop = {.job_id = 5, .session_id = 5};
    nl_stage_out o0, o1 = {0};
    nl_wire_frame f = tok_frame(prompt, 1, P);
    int i = 0;
    for (; i < N; i++) { /* the test plays the wire: it feeds what the stage says */
        CHECK_OK(nl_stage_forward(s0, &hop, &f, &o0, &err), &err);
        nl_wire_frame h = out_frame(&o0);
        CHECK_OK(nl_stage_forward(s1, &hop, &h, &o1, &err), &err);
        got[i] = o1.token;
        CHECK(o1.last == (i == N - 1) && o1.feed == (i < N - 1), "token %d: last %d feed %d", i,
              o1.last, o1.feed);
        CHECK(!o1.feed || o1.feed_pos == (int64_t)hop.pos_offset + (i == 0 ? P : 1),
              "token %d fed at %lld", i, (long long)o1.feed_pos);
        if (!o1.feed)
            break;
        hop.pos_offset = (uint64_t)o1.feed_pos;
        f = tok_frame(&o1.token, 1, 1);
    }
    CHECK(i == N - 1 && memcmp(got, want, sizeof want) == 0, "ring: %d tokens, ids differ", i + 1);
    nl_stage_session_info in;
    CHECK(nl_stage_session(s1, 5, &in) && in.steps == N - 1 && in.step_s > 0 && in.prefill_s > 0,
          "accounting: %d steps, %g s, prefill %g s", in.steps, in.step_s, in.prefill_s);
    /* without a limit nothing is fed; a full cache stops feeding */
    nl_stage_session_params sq = {.id = 6, .capacity = P + 1, .top_p = 1, .limit = P + 1};
    CHECK_OK(nl_stage_open_session(s0, &sq, &err), &err);
    CHECK_OK(nl_stage_open_session(s1, &sq, &err), &err);
    hop = (nl_msg_tensor_hop){.job_id = 6, .session_id = 6};
    f = tok_frame(prompt, 1, P);
    CHECK_OK(nl_stage_forward(s0, &hop, &f, &o0, &err), &err);
    nl_wire_frame h = out_frame(&o0);
    CHECK_OK(nl_stage_forward(s1, &hop, &h, &o1, &err), &err);
    CHECK(o1.feed && !o1.last, "first token: feed %d last %d", o1.feed, o1.last);
    hop.pos_offset = P;
    f = tok_frame(&o1.token, 1, 1);
    CHECK_OK(nl_stage_forward(s0, &hop, &f, &o0, &err), &err);
    h = out_frame(&o0);
    CHECK_OK(nl_stage_forward(s1, &hop, &h, &o1, &err), &err);
    CHECK(!o1.feed, "fed past a full cache");
    /* closed: remembered (its hops are stale), until opened again */
    CHECK(nl_stage_close_session(s0, 5) && nl_stage_session_closed(s0, 5) &&
              !nl_stage_session_closed(s0, 6) && !nl_stage_session_evicted(s0, 5),
          "closed memory");
    CHECK_OK(nl_stage_open_session(s0, &sp, &err), &err);
    CHECK(!nl_stage_session_closed(s0, 5), "reopened session still closed");
    nl_stage_destroy(&s0);
    nl_stage_destroy(&s1);
}

static void test_budget(nl_model *ref)
{
    nl_error err;
    const int cap = 8;
    size_t one = nl_kvcache_bytes(&cfg, 2, 1, cap, NL_KV_FP32);
    nl_stage *s = loaded_stage(ref, 0, 2, 0, 2, one * 5 / 2); /* room for 2.5 sessions */
    nl_stage_session_params sp = {.capacity = cap, .top_p = 1};
    for (uint64_t id = 1; id <= 2; id++) {
        sp.id = id;
        CHECK_OK(nl_stage_open_session(s, &sp, &err), &err);
    }
    CHECK(nl_stage_session_count(s) == 2 && nl_stage_kv_used(s) == 2 * one, "two sessions");
    /* use session 1: session 2 becomes the least recently used */
    int32_t tok[3] = {1, 2, 3};
    nl_wire_frame f = tok_frame(tok, 1, 3);
    nl_msg_tensor_hop hop = {.job_id = 1, .session_id = 1};
    nl_stage_out o;
    CHECK_OK(nl_stage_forward(s, &hop, &f, &o, &err), &err);
    CHECK(o.kind == NL_STAGE_OUT_HIDDEN && o.shape[1] == 3, "session hidden output");
    sp.id = 3;
    CHECK_OK(nl_stage_open_session(s, &sp, &err), &err);
    CHECK(nl_stage_session(s, 1, NULL) && !nl_stage_session(s, 2, NULL) &&
              nl_stage_session(s, 3, NULL),
          "LRU evicted the wrong session");
    CHECK(nl_stage_session_evicted(s, 2) && !nl_stage_session_evicted(s, 1), "evicted flags");
    CHECK(nl_stage_kv_used(s) == 2 * one, "budget accounting %zu", nl_stage_kv_used(s));
    hop = (nl_msg_tensor_hop){.job_id = 2, .session_id = 2};
    CHECK(nl_stage_forward(s, &hop, &f, &o, &err) == NL_ERR_NOTFOUND &&
              strstr(err.msg, "session 2 was evicted"),
          "evicted session: %s", err.msg);
    /* a session of twice the size evicts both others, oldest first */
    sp.id = 4;
    sp.capacity = 2 * cap;
    CHECK_OK(nl_stage_open_session(s, &sp, &err), &err);
    CHECK(nl_stage_session_count(s) == 1 && nl_stage_session_evicted(s, 1) &&
              nl_stage_session_evicted(s, 3) && nl_stage_kv_used(s) == 2 * one,
          "big session: %d sessions, %zu bytes", nl_stage_session_count(s), nl_stage_kv_used(s));
    /* re-opening an evicted id makes it a live session again */
    sp.id = 2;
    sp.capacity = cap;
    CHECK_OK(nl_stage_open_session(s, &sp, &err), &err);
    CHECK(!nl_stage_session_evicted(s, 2) && nl_stage_session(s, 2, NULL), "reopened session");
    /* one that cannot fit alone, and one longer than the context */
    sp.id = 5;
    sp.capacity = 3 * cap;
    CHECK(nl_stage_open_session(s, &sp, &err) == NL_ERR_CAPACITY && strstr(err.msg, "session 5") &&
              strstr(err.msg, "--kv-budget"),
          "oversized session: %s", err.msg);
    CHECK(nl_stage_session(s, 2, NULL), "a refused session evicted others");
    sp.capacity = cfg.max_seq_len + 1;
    CHECK(nl_stage_open_session(s, &sp, &err) == NL_ERR_RANGE, "capacity past max_seq_len: %s",
          err.msg);
    /* a new assignment drops every session */
    nl_msg_assign a = mk_assign(6, 0, 2, 0, 2);
    CHECK_OK(nl_stage_assign(s, &a, &err), &err);
    CHECK(nl_stage_session_count(s) == 0 && nl_stage_kv_used(s) == 0, "sessions survived ASSIGN");
    nl_stage_destroy(&s);
}

/* A node's --kv-cache bf16: its sessions' caches take half the bytes of
 * the budget (two bf16 sessions where one FP32 one fits), and a hop runs
 * through them. */
static void test_budget_bf16(nl_model *ref)
{
    nl_error err;
    const int cap = 8;
    const size_t one = nl_kvcache_bytes(&cfg, 2, 1, cap, NL_KV_FP32);
    CHECK(nl_kvcache_bytes(&cfg, 2, 1, cap, NL_KV_BF16) * 2 == one, "bf16 bytes");
    kv_cache = NL_KV_BF16;
    nl_stage *s = loaded_stage(ref, 0, 2, 0, 2, one); /* one FP32 session, two bf16 ones */
    kv_cache = NL_KV_FP32;
    nl_stage_session_params sp = {.capacity = cap, .top_p = 1};
    for (uint64_t id = 1; id <= 2; id++) {
        sp.id = id;
        CHECK_OK(nl_stage_open_session(s, &sp, &err), &err);
    }
    CHECK(nl_stage_session_count(s) == 2 && nl_stage_kv_used(s) == one &&
              !nl_stage_session_evicted(s, 1),
          "two bf16 sessions in one FP32 session's budget: %d sessions, %zu bytes",
          nl_stage_session_count(s), nl_stage_kv_used(s));
    int32_t tok[3] = {1, 2, 3};
    nl_wire_frame f = tok_frame(tok, 1, 3);
    nl_msg_tensor_hop hop = {.job_id = 1, .session_id = 1};
    nl_stage_out o;
    CHECK_OK(nl_stage_forward(s, &hop, &f, &o, &err), &err);
    CHECK(o.kind == NL_STAGE_OUT_HIDDEN && o.shape[1] == 3, "a hop through a bf16 cache");
    nl_stage_destroy(&s);
}

int main(void)
{
    nl_model *ref = NULL;
    if (stage_harness_start("test_node_stage", &ref)) {
        test_assign();
        test_load(ref);
        test_forward(ref);
        test_generation(ref);
        test_ring(ref);
        test_session_params();
        test_budget(ref);
        test_budget_bf16(ref);
    }
    return stage_harness_end("test_node_stage", &ref);
}
