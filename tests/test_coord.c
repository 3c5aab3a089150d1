/* Unit tests of the coordinator's state machines, in-process: one
 * nl_coord driven turn by turn (nl_coord_step) against fake nodes and a
 * fake client, plain DEALER sockets on loopback that the test scripts.
 *
 *  - join -> plan: two nodes join; once both are in (--min-nodes 2) the
 *    coordinator plans two stages, sends each an ASSIGN (contiguous layers
 *    covering the model, the embedding on the first, the head on the last,
 *    each other's data endpoints as neighbours) and LOAD_DONE {tensors 0}
 *    (the seed); the cluster is ready when both answer LOAD_DONE;
 *  - a forward job routed through the fake stages: the client's tokens go
 *    to stage 0 as an ACTIVATION, a RESULT from a stage that is not the last
 *    is ignored, the last stage's RESULT reaches the client bit for bit,
 *    then JOB_STATUS done; bad submissions fail with a message;
 *  - a generation: the session every stage opens carries the client's
 *    parameters as the shared schema reads them (an integer temperature 0
 *    is 0); the last stage's tokens reach the client, the last one done,
 *    and the session closes; a wrong type fails naming the key;
 *  - a node's death: a node whose heartbeats stop is declared dead after
 *    the timeout, the forward job in flight fails naming it, and the
 *    coordinator re-plans the whole model onto the node left;
 *  - a join at rest: the dead node comes back and the coordinator plans
 *    two stages again within seconds; a slow node's join gains less than
 *    --replan-margin and leaves the plan as it is;
 *  - a training job's paths (issue 15, finding 1): FIFOs, files outside
 *    the roots, links that lead out, "..", files too big and a bad resume
 *    fail that job alone, revealing nothing, as does data past
 *    --max-data-total (issue 31); a file in the root makes a
 *    job that begins, and a cancel reloads its stages; a job cancelled
 *    during a step asks its stages for a checkpoint of it first;
 *  - a verification case's fields (issue 31): one that says other layers
 *    than the plan gave its stage convicts the stage, and goes to no
 *    verifier, while an honest one goes on to its verifier.
 *
 * The fakes are coord_fake.c's; the coordinator's peers (roles under
 * CURVE, its endpoints, the node index) are test_coord_peers.c's. */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord.h"
#include "coordinator/coord_impl.h"
#include "net/handshake.h"
#include "net/hopdigest.h"
#include "net/keys.h"
#include "net/transport.h"
#include "tests/check.h"
#include "tests/coord_fake.h"

static fake client;
static char tmpdir[256];

/* ---------------------------------------------------------------- setup */

static void start_coord(void)
{
    char cfg[512];
    snprintf(tmpdir, sizeof tmpdir, "/tmp/nl_test_coord_XXXXXX");
    CHECK(mkdtemp(tmpdir) != NULL, "mkdtemp");
    snprintf(cfg, sizeof cfg, "%s/cfg.yaml", tmpdir);
    FILE *fp = fopen(cfg, "w");
    CHECK(fp != NULL, "%s", cfg);
    if (!fp)
        exit(1);
    fputs("hidden_dim: 64\nnum_layers: 6\nnum_heads: 4\nnum_kv_heads: 2\nffn_dim: 64\n"
          "num_experts: 4\nvocab_size: 256\nvocab_chunk: 256\nmax_seq_len: 256\n",
          fp);
    fclose(fp);
    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = "tcp://127.0.0.1:*";
    o.state_dir = tmpdir;
    o.config = cfg;
    o.seed = 7;
    o.min_nodes = 2;
    o.heartbeat_ms = HB_MS;
    o.node_timeout_ms = TIMEOUT_MS;
    o.job_timeout_ms = 4 * TIMEOUT_MS; /* a loaded machine stalls the fakes for a second */
    o.plaintext = 1;
    o.max_data_total = 64 << 10; /* issue 31: mid.txt passes it */
    nl_error err = {0};
    CHECK_OK(nl_coord_new(&coord, &o, &err), &err);
    if (!coord)
        exit(1);
    CHECK(strncmp(nl_coord_endpoint(coord), "tcp://127.0.0.1:", 16) == 0, "endpoint %s",
          nl_coord_endpoint(coord));
    CHECK(strncmp(nl_coord_client_endpoint(coord), "tcp://127.0.0.1:", 16) == 0 &&
              strcmp(nl_coord_client_endpoint(coord), nl_coord_endpoint(coord)) != 0,
          "the clients' endpoint %s (the nodes' %s)", nl_coord_client_endpoint(coord),
          nl_coord_endpoint(coord));
}

typedef struct assigned {
    uint64_t epoch;
    uint32_t stage, nstages, l0, l1;
    bool embed, head;
    char prev[64], next[64];
} assigned;

/* f's ASSIGN, then the coordinator's LOAD_DONE (from the seed: no
 * tensors), answered with f's own LOAD_DONE. */
static int take_plan(fake *f, assigned *a)
{
    nl_rx rx;
    nl_rx_init(&rx);
    int ok = pump_until(f, NL_MSG_ASSIGN, &rx);
    if (ok) {
        const nl_msg_assign *s = &rx.msg.u.assign;
        *a = (assigned){.epoch = s->epoch,
                        .stage = s->stage,
                        .nstages = s->num_stages,
                        .l0 = s->layer0,
                        .l1 = s->layer1,
                        .embed = s->has_embed,
                        .head = s->has_head};
        snprintf(a->prev, sizeof a->prev, "%s", s->prev_endpoint);
        snprintf(a->next, sizeof a->next, "%s", s->next_endpoint);
        CHECK(s->node_id == f->id && s->seed == 7, "ASSIGN node %u seed %llu", s->node_id,
              (unsigned long long)s->seed);
    }
    ok = ok && pump_until(f, NL_MSG_LOAD_DONE, &rx);
    if (ok) {
        CHECK(rx.msg.u.load_done.epoch == a->epoch && rx.msg.u.load_done.tensors == 0,
              "LOAD_DONE epoch %llu tensors %u", (unsigned long long)rx.msg.u.load_done.epoch,
              rx.msg.u.load_done.tensors);
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_LOAD_DONE);
        m.u.load_done = (nl_msg_load_done){a->epoch, f->id, 0, 1000};
        fake_send(f, &m);
    }
    nl_rx_free(&rx);
    return ok;
}

/* Which fake node holds stage s of the plan in a[]. */
static fake *stage_of(const assigned *a, uint32_t s)
{
    for (int i = 0; i < 2; i++)
        if (a[i].stage == s)
            return &nodes[i];
    return NULL;
}

static int test_join_plan(assigned *a)
{
    fake_open(&nodes[0], "fakeNodeA", "tcp://127.0.0.1:1");
    fake_open(&nodes[1], "fakeNodeB", "tcp://127.0.0.1:2");
    join(&nodes[0], 0.5);
    /* one node of the two it waits for: no plan yet */
    for (int i = 0; i < 50; i++)
        nl_coord_step(coord, 2);
    CHECK(strstr(nl_coord_state(coord), "1 of 2 joined") != NULL, "state %s",
          nl_coord_state(coord));
    join(&nodes[1], 0.5);
    if (!take_plan(&nodes[0], &a[0]) || !take_plan(&nodes[1], &a[1]))
        return 0;
    CHECK(a[0].epoch == a[1].epoch && a[0].nstages == 2 && a[1].nstages == 2 &&
              a[0].stage != a[1].stage,
          "plan: epochs %llu %llu, stages %u/%u %u/%u", (unsigned long long)a[0].epoch,
          (unsigned long long)a[1].epoch, a[0].stage, a[0].nstages, a[1].stage, a[1].nstages);
    const assigned *s0 = a[0].stage == 0 ? &a[0] : &a[1], *s1 = a[0].stage == 0 ? &a[1] : &a[0];
    const fake *n0 = stage_of(a, 0), *n1 = stage_of(a, 1);
    CHECK(s0->l0 == 0 && s0->l1 == s1->l0 && s1->l1 == 6 && s0->l1 > 0 && s0->l1 < 6,
          "layers [%u, %u) [%u, %u)", s0->l0, s0->l1, s1->l0, s1->l1);
    CHECK(s0->embed && !s0->head && !s1->embed && s1->head, "embed/head on the wrong stage");
    CHECK(n0 && n1 && strcmp(s0->next, n1->endpoint) == 0 && strcmp(s1->prev, n0->endpoint) == 0,
          "neighbours: stage 0 next %s, stage 1 prev %s", s0->next, s1->prev);
    CHECK(pump_state("ready: 2 stages"), "not ready");
    return 1;
}

/* ---------------------------------------------------------------- forward */

static void submit_forward(const int32_t *ids, int64_t B, int64_t T)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_FORWARD, 0, NULL};
    const int64_t shape[2] = {B, T};
    nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, shape, 2);
    m.nframes = 1;
    fake_send(&client, &m);
}

/* The client's next JOB_STATUS: its job id, state, and message. */
static int client_status(uint64_t *job, uint32_t *state, char *msg, size_t cap)
{
    nl_rx rx;
    nl_rx_init(&rx);
    int ok = pump_until(&client, NL_MSG_JOB_STATUS, &rx);
    if (ok) {
        *job = rx.msg.u.job_status.job_id;
        *state = rx.msg.u.job_status.state;
        snprintf(msg, cap, "%s", rx.msg.u.job_status.message);
    }
    nl_rx_free(&rx);
    return ok;
}

static void send_result(fake *f, uint64_t job, const float *logits, int64_t n)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_RESULT);
    m.u.hop = (nl_msg_tensor_hop){job, 0, 0, 0, 0, 0.25};
    const int64_t shape[3] = {1, n / 8, 8};
    nl_wire_frame_set(&m.frames[0], logits, NL_DTYPE_F32, shape, 3);
    m.nframes = 1;
    fake_send(f, &m);
}

/* Submit a forward job; stage 0 gets the tokens. Returns the job id. */
static uint64_t start_forward(fake *first, const int32_t *ids, int T)
{
    uint64_t job = 0;
    uint32_t state = 0;
    char msg[256];
    nl_rx rx;
    nl_rx_init(&rx);
    submit_forward(ids, 1, T);
    CHECK(client_status(&job, &state, msg, sizeof msg) && job > 0 && state == NL_JOB_RUNNING,
          "submit: job %llu state %u: %s", (unsigned long long)job, state, msg);
    if (pump_until(first, NL_MSG_ACTIVATION, &rx)) {
        const nl_tensor *t = &rx.msg.frames[0].t;
        CHECK(rx.msg.u.hop.job_id == job && rx.msg.nframes == 1 && t->dtype == NL_DTYPE_I32 &&
                  t->ndim == 2 && t->shape[0] == 1 && t->shape[1] == T &&
                  memcmp(t->data, ids, (size_t)T * 4) == 0,
              "ACTIVATION to stage 0: job %llu, %d frames", (unsigned long long)rx.msg.u.hop.job_id,
              rx.msg.nframes);
    }
    nl_rx_free(&rx);
    return job;
}

static void test_forward(const assigned *a)
{
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
    fake_open(&client, "fakeClient", "");
    const int32_t ids[5] = {1, 2, 3, 250, 4};
    uint64_t job = start_forward(first, ids, 5), j2 = 0;
    float logits[16], other[16];
    for (int i = 0; i < 16; i++) {
        logits[i] = 0.5f * (float)i - 3.0f;
        other[i] = -1.0f;
    }
    send_result(first, job, other, 16); /* not the last stage: ignored */
    send_result(last, job, logits, 16);
    nl_rx rx;
    nl_rx_init(&rx);
    if (pump_until(&client, NL_MSG_RESULT, &rx)) {
        const nl_tensor *t = &rx.msg.frames[0].t;
        CHECK(rx.msg.u.hop.job_id == job && t->dtype == NL_DTYPE_F32 && t->ndim == 3 &&
                  t->shape[2] == 8 && memcmp(t->data, logits, sizeof logits) == 0 &&
                  rx.msg.u.hop.aux == 0.25,
              "RESULT to the client differs from the last stage's");
    }
    nl_rx_free(&rx);
    uint32_t state = 0;
    char msg[256];
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job && state == NL_JOB_DONE,
          "after the result: job %llu state %u: %s", (unsigned long long)j2, state, msg);
    /* a token outside the vocabulary fails at once, naming why */
    const int32_t bad[2] = {1, 256};
    submit_forward(bad, 1, 2);
    CHECK(client_status(&j2, &state, msg, sizeof msg) && state == NL_JOB_FAILED &&
              strstr(msg, "vocabulary"),
          "bad token: state %u: %s", state, msg);
}

/* ---------------------------------------------------------------- generate */

static void node_status(fake *f, uint64_t job, uint32_t state, const char *msg)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
    m.u.job_status = (nl_msg_job_status){job, state, 0.0, msg};
    fake_send(f, &m);
}

static void send_token(fake *f, uint64_t job, uint32_t tok)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_TOKEN);
    m.u.token = (nl_msg_token){job, job, 1, &tok, false, 0, NULL};
    fake_send(f, &m);
}

/* A generation: its parameters as the client sent them, read by the shared
 * schema (an integer temperature 0 is 0 in the session every stage opens),
 * a session on each stage, the prompt to stage 0 once both took it, the
 * last stage's tokens relayed to the client, the last one marked done and
 * the session closed on every stage. A wrong type fails at once, naming
 * the key. */
static void test_generate(const assigned *a)
{
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
    const int32_t prompt[3] = {4, 5, 6};
    const int64_t shape[2] = {1, 3};
    nl_wire_param ps[3] = {{.key = "max_new", .kind = NL_WIRE_PARAM_INT, .i = 2},
                           {.key = "temperature", .kind = NL_WIRE_PARAM_INT, .i = 0},
                           {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = 11}};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, 3, ps};
    nl_wire_frame_set(&m.frames[0], prompt, NL_DTYPE_I32, shape, 2);
    m.nframes = 1;
    fake_send(&client, &m);
    uint64_t job = 0, j2 = 0;
    uint32_t state = 0;
    char msg[512];
    CHECK(client_status(&job, &state, msg, sizeof msg) && state == NL_JOB_RUNNING, "generate: %s",
          msg);
    nl_rx rx;
    nl_rx_init(&rx);
    for (int i = 0; i < 2; i++)
        if (CHECK_PUMP(pump_until(&nodes[i], NL_MSG_JOB_SUBMIT, &rx))) {
            nl_msg_job_submit *js = &rx.msg.u.job_submit;
            double t = -1, top = -1;
            int64_t session = -1, cap = -1, lim = -1;
            for (uint32_t k = 0; k < js->nparams; k++) {
                const nl_wire_param *q = &js->params[k];
                if (!strcmp(q->key, "temperature"))
                    t = q->f;
                else if (!strcmp(q->key, "top_p"))
                    top = q->f;
                else if (!strcmp(q->key, "session"))
                    session = q->i;
                else if (!strcmp(q->key, "capacity"))
                    cap = q->i;
                else if (!strcmp(q->key, "limit"))
                    lim = q->i;
            }
            CHECK(js->kind == NL_JOB_GENERATE && t == 0.0 && top == 0.95 &&
                      session == (int64_t)job && cap == 5 && lim == 2,
                  "session on node %d: temperature %g top_p %g session %lld capacity %lld limit "
                  "%lld",
                  i, t, top, (long long)session, (long long)cap, (long long)lim);
        }
    node_status(first, job, NL_JOB_RUNNING, "session open");
    node_status(last, job, NL_JOB_RUNNING, "session open");
    if (pump_until(first, NL_MSG_ACTIVATION, &rx))
        CHECK(rx.msg.u.hop.session_id == job && rx.msg.frames[0].t.shape[1] == 3 &&
                  memcmp(rx.msg.frames[0].t.data, prompt, sizeof prompt) == 0,
              "the prompt to stage 0");
    send_token(first, job, 99); /* not the last stage: ignored */
    send_token(last, job, 17);
    send_token(last, job, 23);
    const uint32_t want[2] = {17, 23};
    for (int k = 0; k < 2; k++)
        if (CHECK_PUMP(pump_until(&client, NL_MSG_TOKEN, &rx)))
            CHECK(rx.msg.u.token.job_id == job && rx.msg.u.token.ntokens == 1 &&
                      rx.msg.u.token.tokens[0] == want[k] && rx.msg.u.token.done == (k == 1),
                  "token %d: %u done %d", k, rx.msg.u.token.tokens[0], rx.msg.u.token.done);
    for (int i = 0; i < 2; i++)
        CHECK(pump_until(&nodes[i], NL_MSG_JOB_CANCEL, &rx) && rx.msg.u.job_ref.job_id == job,
              "the session stays open on node %d", i);
    nl_rx_free(&rx);
    /* a wrong type: a typed error naming the key, not a default */
    ps[1] = (nl_wire_param){.key = "temperature", .kind = NL_WIRE_PARAM_STR, .s = "0"};
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, 3, ps};
    nl_wire_frame_set(&m.frames[0], prompt, NL_DTYPE_I32, shape, 2);
    m.nframes = 1;
    fake_send(&client, &m);
    CHECK(client_status(&j2, &state, msg, sizeof msg) && state == NL_JOB_FAILED &&
              strstr(msg, "temperature"),
          "temperature as text: state %u: %s", state, msg);
}

/* The context bounds a generation (max_seq_len 256 here): a prompt that
 * fills it is refused, naming max_seq_len; a max_new past it is cut to what
 * fits: sessions of capacity 256 that stop after 253 new tokens of a
 * 3-token prompt. The second job is cancelled once its sessions are seen. */
static void submit_generate(const int32_t *prompt, int64_t T, int64_t max_new)
{
    nl_wire_param ps[2] = {{.key = "max_new", .kind = NL_WIRE_PARAM_INT, .i = max_new},
                           {.key = "temperature", .kind = NL_WIRE_PARAM_INT, .i = 0}};
    const int64_t shape[2] = {1, T};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, 2, ps};
    nl_wire_frame_set(&m.frames[0], prompt, NL_DTYPE_I32, shape, 2);
    m.nframes = 1;
    fake_send(&client, &m);
}

static void cancel_job(uint64_t job)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
    m.u.job_ref.job_id = job;
    fake_send(&client, &m);
    uint64_t j2 = 0;
    uint32_t state = 0;
    char msg[512];
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job, "cancel of job %llu: %s",
          (unsigned long long)job, msg);
    nl_rx rx;
    nl_rx_init(&rx);
    for (int i = 0; i < 2; i++)
        pump_until(&nodes[i], NL_MSG_JOB_CANCEL, &rx);
    nl_rx_free(&rx);
}

static void test_generate_bounds(void)
{
    static int32_t prompt[256];
    for (int i = 0; i < 256; i++)
        prompt[i] = 4 + i % 200;
    uint64_t job = 0;
    uint32_t state = 0;
    char msg[512];
    submit_generate(prompt, 256, 1);
    CHECK(client_status(&job, &state, msg, sizeof msg) && state == NL_JOB_FAILED &&
              strstr(msg, "max_seq_len"),
          "a prompt of max_seq_len tokens: state %u: %s", state, msg);
    if (state == NL_JOB_RUNNING)
        cancel_job(job);
    submit_generate(prompt, 3, 300);
    CHECK(client_status(&job, &state, msg, sizeof msg) && state == NL_JOB_RUNNING,
          "3 tokens + 300: %s", msg);
    nl_rx rx;
    nl_rx_init(&rx);
    for (int i = 0; i < 2; i++)
        if (CHECK_PUMP(pump_until(&nodes[i], NL_MSG_JOB_SUBMIT, &rx))) {
            const nl_msg_job_submit *js = &rx.msg.u.job_submit;
            int64_t cap = -1, lim = -1;
            for (uint32_t k = 0; k < js->nparams; k++)
                if (!strcmp(js->params[k].key, "capacity"))
                    cap = js->params[k].i;
                else if (!strcmp(js->params[k].key, "limit"))
                    lim = js->params[k].i;
            CHECK(cap == 256 && lim == 253,
                  "node %d: a session of capacity %lld limit %lld (256, 253: the context's end)", i,
                  (long long)cap, (long long)lim);
        }
    nl_rx_free(&rx);
    if (state == NL_JOB_RUNNING)
        cancel_job(job);
}

/* ---------------------------------------------------------------- slow work */

/* A query to the coordinator is answered (the loop is not blocked). */
static int answers_query(void)
{
    nl_wire_msg m;
    nl_rx rx;
    nl_rx_init(&rx);
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
    m.u.job_ref.job_id = 0;
    fake_send(&client, &m);
    int ok = pump_until(&client, NL_MSG_JOB_STATUS, &rx) && rx.msg.u.job_status.job_id == 0 &&
             rx.msg.nframes == 1;
    nl_rx_free(&rx);
    return ok;
}

static void pump_for(double s);
static void submit_train(const char *data, const char *ckpt, const char *resume);
static void send_grad_norm(fake *f, uint64_t job, uint64_t step, uint32_t stage, double sumsq)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm = (nl_msg_grad_norm){job, step, stage, sumsq};
    fake_send(f, &m);
}

/* Submit the 2-step training job of ok.txt: the client hears "running"
 * and "starting", both stages get its JOB_SUBMIT. Returns its id. */
static uint64_t submit_train_to_stages(void)
{
    uint64_t job = 0, j2 = 0;
    uint32_t state = 0;
    char msg[512];
    submit_train("ok.txt", "ck", NULL);
    CHECK(client_status(&job, &state, msg, sizeof msg) && state == NL_JOB_RUNNING, "train: %s",
          msg);
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job && strcmp(msg, "starting") == 0,
          "train: %s", msg);
    nl_rx rx;
    nl_rx_init(&rx);
    for (int i = 0; i < 2; i++)
        CHECK_PUMP(pump_until(&nodes[i], NL_MSG_JOB_SUBMIT, &rx));
    nl_rx_free(&rx);
    return job;
}

/* Issue 15, finding 9, on a training job: a stage's acknowledgement counts
 * once however often it is sent (step 1 waits for the other stage), and a
 * non-finite gradient norm skips the step on every stage (a stage that
 * keeps sending them fails the job: test_cluster_train); the stages
 * then reload. */
static void test_train_reports(assigned *a)
{
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
    const uint64_t job = submit_train_to_stages();
    uint64_t j2 = 0;
    uint32_t state = 0;
    char msg[512];
    nl_rx rx;
    nl_rx_init(&rx);
    node_status(first, job, NL_JOB_RUNNING, "took it");
    node_status(first, job, NL_JOB_RUNNING, "took it");
    pump_for(0.3);
    nl_error err = {0};
    int early = 0;
    while (nl_sock_recv(first->sock, &rx, 0, &err) == NL_OK)
        early |= rx.msg.type == NL_MSG_ACTIVATION || rx.msg.type == NL_MSG_COUNT;
    CHECK(!early, "step 1 began on one stage's two acknowledgements");
    node_status(last, job, NL_JOB_RUNNING, "took it");
    CHECK(pump_until(first, NL_MSG_ACTIVATION, &rx) && rx.msg.u.hop.job_id == job &&
              rx.msg.u.hop.step == 1,
          "step 1 did not begin once both stages took the job");
    nl_rx_free(&rx);
    /* a stage that cannot reach its neighbour: the job waits for the
     * heartbeat's verdict, and so does a failure that follows from it on
     * the same plan (the soak's: the next stage's protocol error) */
    node_status(last, job, NL_JOB_FAILED,
                "job 1 step 1 microbatch 0: cannot reach the previous stage at tcp://x: gone");
    pump_for(0.2); /* taken in first: the two fakes' sockets keep no order between them */
    node_status(first, job, NL_JOB_FAILED,
                "GRADIENT of microbatch 1, but the next backward is of microbatch 0");
    pump_for(0.3);
    int failed = 0;
    nl_rx_init(&rx);
    while (nl_sock_recv(client.sock, &rx, 0, &err) == NL_OK) {
        failed |= rx.msg.type == NL_MSG_JOB_STATUS && rx.msg.u.job_status.state == NL_JOB_FAILED;
        nl_rx_free(&rx);
        nl_rx_init(&rx);
    }
    CHECK(!failed, "a failure after a stage could not reach its neighbour failed the job");
    send_grad_norm(first, job, 1, 0, 1.0);
    send_grad_norm(last, job, 1, 1, NAN);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_LOSS);
    m.u.loss = (nl_msg_loss){job, 1, false, 100.0, 0.5, 64};
    fake_send(last, &m);
    /* the step is skipped on every stage, as local training skips it */
    for (int i = 0; i < 2; i++) {
        nl_rx_init(&rx);
        CHECK(pump_until(stage_of(a, i), NL_MSG_STEP, &rx) && rx.msg.u.step.job_id == job &&
                  rx.msg.u.step.step == 1 && !rx.msg.u.step.apply,
              "a NaN gradient norm: stage %d got no skipped STEP 1", i);
        nl_rx_free(&rx);
    }
    /* the fakes go no further: the job fails for want of progress */
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job && state == NL_JOB_RUNNING,
          "step 1's report: %s", msg);
    do {
        if (!client_status(&j2, &state, msg, sizeof msg))
            break;
    } while (state == NL_JOB_RUNNING);
    CHECK(j2 == job && state == NL_JOB_FAILED, "the stalled job: state %u: %s", state, msg);
    const uint64_t epoch = a[0].epoch;
    CHECK(take_plan(&nodes[0], &a[0]) && take_plan(&nodes[1], &a[1]) && a[0].epoch > epoch,
          "no reload after the failed job");
    CHECK(pump_state("ready: 2 stages"), "not ready after the reload");
}

/* Ctrl-C of a training job that has begun (JOB_CANCEL): the step under
 * way ends and the coordinator asks every stage for a checkpoint of it
 * before the job ends (a second cancel changes nothing); the fakes write
 * none, so the job then fails for want of progress and the stages reload. */
static void test_train_cancel(assigned *a)
{
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
    const uint64_t job = submit_train_to_stages();
    uint64_t j2 = 0;
    uint32_t state = 0;
    char msg[512];
    nl_rx rx;
    nl_rx_init(&rx);
    node_status(first, job, NL_JOB_RUNNING, "took it");
    node_status(last, job, NL_JOB_RUNNING, "took it");
    CHECK(pump_until(first, NL_MSG_ACTIVATION, &rx) && rx.msg.u.hop.step == 1,
          "cancel: step 1 did not begin");
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (int k = 0; k < 2; k++) { /* the second: already stopping */
        nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
        m.u.job_ref.job_id = job;
        fake_send(&client, &m);
        CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job && state == NL_JOB_RUNNING &&
                  strstr(msg, "stopping after step 1: writing a checkpoint"),
              "cancel %d during step 1: state %u: %s", k + 1, state, msg);
    }
    send_grad_norm(first, job, 1, 0, 1.0);
    send_grad_norm(last, job, 1, 1, 1.0);
    nl_wire_msg_reset(&m, NL_MSG_LOSS);
    m.u.loss = (nl_msg_loss){job, 1, false, 100.0, 0.5, 64};
    fake_send(last, &m);
    for (int i = 0; i < 2; i++) { /* the step ends, then its checkpoint (2 steps, none due) */
        CHECK(pump_until(stage_of(a, i), NL_MSG_STEP, &rx) && rx.msg.u.step.step == 1 &&
                  rx.msg.u.step.apply,
              "cancelled: stage %d got no STEP 1", i);
        CHECK(pump_until(stage_of(a, i), NL_MSG_CKPT_REQ, &rx) && rx.msg.u.ckpt_req.job_id == job &&
                  rx.msg.u.ckpt_req.step == 1 && strstr(rx.msg.u.ckpt_req.dir, "step-000001"),
              "cancelled: stage %d was not asked for the checkpoint of step 1", i);
    }
    nl_error err = {0};
    int step2 = 0;
    pump_for(0.2);
    while (nl_sock_recv(first->sock, &rx, 0, &err) == NL_OK)
        step2 |= rx.msg.type == NL_MSG_ACTIVATION;
    CHECK(!step2, "a cancelled job began step 2");
    nl_rx_free(&rx);
    nl_wire_msg_free(&m);
    do {
        if (!client_status(&j2, &state, msg, sizeof msg))
            break;
    } while (state == NL_JOB_RUNNING);
    CHECK(j2 == job && state == NL_JOB_FAILED, "the stalled checkpoint: state %u: %s", state, msg);
    CHECK(take_plan(&nodes[0], &a[0]) && take_plan(&nodes[1], &a[1]),
          "no reload after the cancelled job failed");
    CHECK(pump_state("ready: 2 stages"), "not ready after the reload");
}

/* The hop into stage 0 is the coordinator's own: stage 0's report of the
 * ACTIVATION it received is compared with the digest the coordinator sent
 * (a stage 0 that says it received other tokens or targets, those it
 * trained on, is a digest mismatch in the step's report, as a pair of
 * stages that disagree are). */
static void test_train_first_digest(assigned *a)
{
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
    const uint64_t job = submit_train_to_stages();
    node_status(first, job, NL_JOB_RUNNING, "took it");
    node_status(last, job, NL_JOB_RUNNING, "took it");
    nl_rx rx;
    nl_rx_init(&rx);
    uint8_t dig[1][NL_DIGEST_KINDS][32]; /* one microbatch */
    memset(dig, 0, sizeof dig);
    const char *hex = NULL;
    if (pump_until(first, NL_MSG_ACTIVATION, &rx) && rx.msg.u.hop.step == 1)
        hex = rx.msg.u.train_hop.digest;
    CHECK(hex && strlen(hex) == 64, "step 1's ACTIVATION did not come, or without a digest");
    for (int i = 0; hex && i < 32; i++) {
        unsigned v = 0;
        sscanf(hex + 2 * i, "%2x", &v);
        dig[0][NL_DIGEST_FWD_IN][i] = (uint8_t)v;
    }
    dig[0][NL_DIGEST_FWD_IN][0] ^= 1; /* other inputs than those it was sent */
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm = (nl_msg_grad_norm){job, 1, 0, 1.0};
    const int64_t shape[3] = {1, NL_DIGEST_KINDS, 32};
    nl_wire_frame_set(&m.frames[0], dig, NL_DTYPE_U8, shape, 3);
    m.nframes = 1;
    fake_send(first, &m);
    send_grad_norm(last, job, 1, 1, 1.0);
    nl_wire_msg_reset(&m, NL_MSG_LOSS);
    m.u.loss = (nl_msg_loss){job, 1, false, 100.0, 0.5, 64};
    fake_send(last, &m);
    nl_wire_msg_free(&m);
    char report[2048] = "";
    while (!report[0] && pump_until(&client, NL_MSG_JOB_STATUS, &rx))
        if (strncmp(rx.msg.u.job_status.message, "step 1", 6) == 0 && rx.msg.nframes == 1)
            snprintf(report, sizeof report, "%.*s", (int)rx.msg.frames[0].len,
                     (const char *)rx.msg.frames[0].t.data);
    CHECK(strstr(report, "\"digest_mismatches\":1"),
          "stage 0 reported other inputs than it was sent: step 1's report %s", report);
    /* the fakes go no further: the job fails for want of progress */
    uint64_t j2 = 0;
    uint32_t state = 0;
    char msg[512];
    do {
        if (!client_status(&j2, &state, msg, sizeof msg))
            break;
    } while (state == NL_JOB_RUNNING);
    CHECK(j2 == job && state == NL_JOB_FAILED, "the stalled job: state %u: %s", state, msg);
    CHECK(take_plan(&nodes[0], &a[0]) && take_plan(&nodes[1], &a[1]),
          "no reload after the stalled job failed");
    CHECK(pump_state("ready: 2 stages"), "not ready after the reload");
    nl_rx_free(&rx);
}

/* The objective param submit_train adds (NULL: none, the model's), and
 * its microbatches. */
static const char *train_objective;
static int64_t train_micro = 1;

/* Submit a training job of 2 steps with these paths (resume may be NULL). */
static void submit_train(const char *data, const char *ckpt, const char *resume)
{
    nl_wire_param ps[16] = {
        {.key = "steps", .kind = NL_WIRE_PARAM_INT, .i = 2},
        {.key = "batch", .kind = NL_WIRE_PARAM_INT, .i = 2},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 8},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = train_micro},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "warmup", .kind = NL_WIRE_PARAM_INT, .i = 0},
        {.key = "eval_every", .kind = NL_WIRE_PARAM_INT, .i = 0},
        {.key = "eval_batches", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "checkpoint_every", .kind = NL_WIRE_PARAM_INT, .i = 0},
        {.key = "lr", .kind = NL_WIRE_PARAM_FLOAT, .f = 1e-3},
        {.key = "min_lr", .kind = NL_WIRE_PARAM_FLOAT, .f = 1e-4},
        {.key = "holdout", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.0},
        {.key = "data", .kind = NL_WIRE_PARAM_STR, .s = data},
        {.key = "checkpoint_dir", .kind = NL_WIRE_PARAM_STR, .s = ckpt},
    };
    uint32_t n = 14;
    if (resume)
        ps[n++] = (nl_wire_param){.key = "resume", .kind = NL_WIRE_PARAM_STR, .s = resume};
    if (train_objective)
        ps[n++] =
            (nl_wire_param){.key = "objective", .kind = NL_WIRE_PARAM_STR, .s = train_objective};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_TRAIN, n, ps};
    fake_send(&client, &m);
}

/* A training job that must fail at once; its message holds want and
 * none of the words in hide[] (what it must not reveal). */
static void train_refused(const char *data, const char *ckpt, const char *resume, const char *want,
                          const char *const *hide)
{
    uint64_t job = 0;
    uint32_t state = 0;
    char msg[1024];
    submit_train(data, ckpt, resume);
    /* "running" first (the job exists), then its failure */
    int ok = client_status(&job, &state, msg, sizeof msg);
    if (ok && state == NL_JOB_RUNNING)
        ok = client_status(&job, &state, msg, sizeof msg);
    CHECK(ok && state == NL_JOB_FAILED && strstr(msg, want), "data %s ckpt %s resume %s: %u: %s",
          data, ckpt, resume ? resume : "-", state, msg);
    for (int i = 0; hide && hide[i]; i++)
        CHECK(!strstr(msg, hide[i]), "the refusal reveals '%s': %s", hide[i], msg);
}

/* Issue 15, finding 1: a training job's data, checkpoint_dir and resume
 * are the client's; they stay under the coordinator's --data-root and
 * --checkpoint-root (here the defaults under the state dir), resolved
 * with realpath. A FIFO (which would block a reader for ever), a file
 * outside the root (the coordinator's own key), a link inside the root
 * that leads out, "..", and a resume outside the root are refused at
 * once, by their own job alone: a forward job in flight meanwhile is
 * served. A file in the root (relative) makes a job that begins; it is
 * cancelled, and its stages reload. */
static void test_train_paths(assigned *a)
{
    char path[600], key[600], big[600];
    snprintf(path, sizeof path, "%s/data/data.fifo", tmpdir);
    CHECK(mkfifo(path, 0600) == 0, "mkfifo %s", path);
    snprintf(key, sizeof key, "%s/coordinator.key", tmpdir);
    snprintf(path, sizeof path, "%s/data/key.txt", tmpdir);
    CHECK(symlink(key, path) == 0, "symlink %s", path);
    snprintf(path, sizeof path, "%s/data/ok.txt", tmpdir);
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL, "%s", path);
    for (int i = 0; fp && i < 40; i++)
        fprintf(fp, "the quick brown fox %d jumps over the lazy dog\n", i);
    if (fp)
        fclose(fp);
    snprintf(big, sizeof big, "%s/data/big.txt", tmpdir);
    fp = fopen(big, "w");
    if (fp)
        fclose(fp);
    CHECK(truncate(big, (2ll << 30)) == 0, "truncate %s", big); /* sparse: 2 GiB > 1 GiB */
    snprintf(path, sizeof path, "%s/data/mid.txt", tmpdir);
    if ((fp = fopen(path, "w")))
        fclose(fp);
    CHECK(truncate(path, 128 << 10) == 0, "truncate %s", path); /* > --max-data-total here */
    /* a forward job in flight while the bad ones fail */
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
    const int32_t ids[2] = {3, 4};
    uint64_t fwd = start_forward(first, ids, 2), j2 = 0;
    const char *hide[] = {"hashes to", " bytes", "BEGIN", NULL};
    train_refused("data.fifo", "ck", NULL, "not a regular file", hide);
    train_refused(key, "ck", NULL, "must lie under the root", hide);
    train_refused("key.txt", "ck", NULL, "leads outside the root", hide);
    train_refused("big.txt", "ck", NULL, "larger than", hide);
    train_refused("mid.txt", "ck", NULL, "--max-data-total", hide);
    train_refused("../coordinator.key", "ck", NULL, "'..'", hide);
    train_refused("ok.txt", "/etc", NULL, "checkpoint_dir", hide);
    train_refused("ok.txt", "ck/../../x", NULL, "checkpoint_dir", hide);
    train_refused("ok.txt", "ck", "/nonexistent", "params.resume", hide);
    train_refused("ok.txt", "ck", "nothing-here", "params.resume: no such file", hide);
    /* the objective, checked again by the coordinator whatever the client
     * checked: a name it does not know, and ones the model cannot train
     * (this one's 256 ids hold no mask id, and it has no classifier) */
    train_objective = "next";
    train_refused("ok.txt", "ck", NULL, "params.objective", hide);
    train_objective = "mlm";
    train_refused("ok.txt", "ck", NULL, "does not hold the mask id", hide);
    train_objective = "classify";
    train_refused("ok.txt", "ck", NULL, "has no classifier", hide);
    train_objective = NULL;
    float logits[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    send_result(last, fwd, logits, 8);
    nl_rx rx;
    nl_rx_init(&rx);
    CHECK(pump_until(&client, NL_MSG_RESULT, &rx) && rx.msg.u.hop.job_id == fwd,
          "the forward job in flight was lost to a refused training job");
    uint32_t state = 0;
    char msg[512];
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == fwd && state == NL_JOB_DONE,
          "forward after the refusals: %s", msg);
    /* a good one: relative paths under the roots */
    submit_train("ok.txt", "ck", NULL);
    uint64_t job = 0;
    CHECK(client_status(&job, &state, msg, sizeof msg) && state == NL_JOB_RUNNING, "train: %s",
          msg);
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job && state == NL_JOB_RUNNING &&
              strcmp(msg, "starting") == 0,
          "train after the data: job %llu state %u: %s", (unsigned long long)j2, state, msg);
    snprintf(path, sizeof path, "%s/checkpoints/ck", tmpdir);
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && S_ISDIR(sb.st_mode) && (sb.st_mode & 077) == 0,
          "checkpoint_dir ck is not %s (0700)", path);
    for (int i = 0; i < 2; i++)
        CHECK(pump_until(&nodes[i], NL_MSG_JOB_SUBMIT, &rx) &&
                  rx.msg.u.job_submit.kind == NL_JOB_TRAIN,
              "no training job on node %d", i);
    nl_rx_free(&rx);
    /* cancelled before its first step: it changed no weight, so the plan
     * stays (no reload) and the cluster stays ready */
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
    m.u.job_ref.job_id = job;
    fake_send(&client, &m);
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job && state == NL_JOB_CANCELLED,
          "cancel: job %llu state %u: %s", (unsigned long long)j2, state, msg);
    for (const double t1 = now_s(); now_s() - t1 < 0.2;) { /* a reload would begin here */
        nl_coord_step(coord, 5);
        heartbeats();
    }
    char plan[32];
    snprintf(plan, sizeof plan, "(plan %llu)", (unsigned long long)a[0].epoch);
    CHECK(pump_state("ready: 2 stages") && strstr(nl_coord_state(coord), plan) != NULL,
          "after the cancel: %s (the plan was %s)", nl_coord_state(coord), plan);
    test_train_reports(a);
    test_train_cancel(a);
    test_train_first_digest(a);
}

/* ---------------------------------------------------------------- death */

static void test_death(const assigned *a)
{
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
    const int32_t ids[3] = {5, 6, 7};
    uint64_t job = start_forward(first, ids, 3), j2 = 0;
    last->beating = 0; /* the last stage dies with the job in flight */
    const double t0 = now_s();
    uint32_t state = 0;
    char msg[512], want[32];
    snprintf(want, sizeof want, "node %u", last->id);
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job && state == NL_JOB_FAILED &&
              strstr(msg, want) && strstr(msg, "heartbeat"),
          "job on a dead node: job %llu state %u: %s", (unsigned long long)j2, state, msg);
    const double took = now_s() - t0;
    CHECK(took > TIMEOUT_MS * 1e-3 * 0.8 && took < 5.0, "noticed after %.2f s", took);
    /* the whole model goes to the node left */
    assigned b;
    if (take_plan(first, &b))
        CHECK(b.epoch > a[0].epoch && b.nstages == 1 && b.stage == 0 && b.l0 == 0 && b.l1 == 6 &&
                  b.embed && b.head,
              "re-plan: epoch %llu, %u stages, layers [%u, %u)", (unsigned long long)b.epoch,
              b.nstages, b.l0, b.l1);
    CHECK(pump_state("ready: 1 stages"), "not ready after the re-plan");
    /* a forward job runs on the new plan */
    job = start_forward(first, ids, 3);
    float logits[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    send_result(first, job, logits, 8);
    nl_rx rx;
    nl_rx_init(&rx);
    CHECK(pump_until(&client, NL_MSG_RESULT, &rx) && rx.msg.u.hop.job_id == job,
          "no result on the new plan");
    nl_rx_free(&rx);
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job && state == NL_JOB_DONE,
          "after the result: %s", msg);
}

/* ---------------------------------------------------------------- joins at rest */

/* The node left runs the whole model; the dead one comes back (a new
 * JOIN) and, the cluster being at rest, the coordinator plans two stages
 * again and both load them. A third, very slow node joins: the planner
 * gains nothing from it beyond the margin, so the plan stays. */
static void test_join_at_rest(assigned *a)
{
    fake *first = stage_of(a, 0);
    fake *back = first == &nodes[0] ? &nodes[1] : &nodes[0];
    const double t0 = now_s();
    join(back, 0.5);
    assigned b[2];
    if (!take_plan(&nodes[0], &b[0]) || !take_plan(&nodes[1], &b[1]))
        return;
    CHECK(b[0].nstages == 2 && b[1].nstages == 2 && b[0].epoch == b[1].epoch &&
              b[0].stage != b[1].stage,
          "after the join: %u and %u stages", b[0].nstages, b[1].nstages);
    CHECK(pump_state("ready: 2 stages"), "not ready after the join");
    CHECK(now_s() - t0 < 5.0, "the join took %.1f s to be used", now_s() - t0);
    const int32_t ids[2] = {9, 10};
    uint64_t job = start_forward(stage_of(b, 0), ids, 2);
    float logits[8] = {0};
    send_result(stage_of(b, 1), job, logits, 8);
    nl_rx rx;
    nl_rx_init(&rx);
    CHECK(pump_until(&client, NL_MSG_RESULT, &rx) && rx.msg.u.hop.job_id == job,
          "no result on the plan after the join");
    uint64_t j2 = 0;
    uint32_t state = 0;
    char msg[256];
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == job && state == NL_JOB_DONE,
          "after the result: %s", msg);
    fake_open(&nodes[2], "fakeNodeC", "tcp://127.0.0.1:3");
    join(&nodes[2], 1e-4);
    const double t1 = now_s();
    int assigned_again = 0;
    while (now_s() - t1 < 1.0) {
        nl_coord_step(coord, 5);
        heartbeats();
        for (int i = 0; i < 3; i++) {
            nl_error err = {0};
            nl_rx_free(&rx);
            nl_rx_init(&rx);
            if (nl_sock_recv(nodes[i].sock, &rx, 0, &err) == NL_OK && rx.msg.type == NL_MSG_ASSIGN)
                assigned_again = 1;
        }
    }
    nl_rx_free(&rx);
    CHECK(!assigned_again && strncmp(nl_coord_state(coord), "ready: 2 stages", 15) == 0,
          "a slow node's join changed the plan: %s", nl_coord_state(coord));
    a[0] = b[0];
    a[1] = b[1];
}

/* ---------------------------------------------------------------- hostile peers */

/* Turn the loop for s seconds. */
static void pump_for(double s)
{
    const double t0 = now_s();
    while (now_s() - t0 < s) {
        nl_coord_step(coord, 5);
        heartbeats();
    }
}

static void node_error(fake *f, const char *msg)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_ERROR);
    m.u.error = (nl_msg_error){NL_ERR_IO, NL_MSG_ACTIVATION, msg};
    fake_send(f, &m);
}

/* Issue 15, findings 3, 9 and 10, with a forward job in flight on the two
 * stages and a third node on standby:
 *  - the last stage's TOKEN naming the forward job is refused (an ERROR
 *    to it; it used to write through a NULL pointer);
 *  - the standby's JOB_STATUS failure naming the job, and its ERROR, fail
 *    nothing: it serves no job;
 *  - free text with newlines and control characters (ERROR, JOB_STATUS,
 *    LEAVE) reaches the log escaped: no forged line, no raw escape byte;
 *  - the job then completes. */
static void test_hostile_nodes(const assigned *a)
{
    fake *first = stage_of(a, 0), *last = stage_of(a, 1), *standby = &nodes[2];
    const int32_t ids[2] = {7, 8};
    uint64_t fwd = start_forward(first, ids, 2), j2 = 0;
    send_token(last, fwd, 5);
    nl_rx rx;
    nl_rx_init(&rx);
    CHECK(pump_until(last, NL_MSG_ERROR, &rx) && strstr(rx.msg.u.error.message, "takes no TOKEN"),
          "a TOKEN for a forward job: %s",
          rx.msg.type == NL_MSG_ERROR ? rx.msg.u.error.message : "no ERROR");
    /* the log, captured */
    char logf[300];
    snprintf(logf, sizeof logf, "%s/stderr.log", tmpdir);
    fflush(stderr);
    const int saved = dup(2), fd = open(logf, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(saved >= 0 && fd >= 0 && dup2(fd, 2) == 2, "capture stderr");
    nl_log_set_level(NL_LOG_INFO);
    const char *forged = "oops\n13:00:00.000 ERROR [coord] forged line\x1b[2J";
    node_status(standby, fwd, NL_JOB_FAILED, forged);
    node_error(standby, forged);
    pump_for(0.3);
    /* a stage's ERROR escaped too (it fails the job: after the check) */
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_LEAVE);
    m.u.leave = (nl_msg_leave){standby->id, forged};
    fake_send(standby, &m);
    standby->beating = 0;
    pump_for(0.3);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_WARN);
    char *text = NULL;
    size_t len = 0;
    FILE *fp = fopen(logf, "r");
    if (fp) {
        text = calloc(1, 1 << 20);
        len = text ? fread(text, 1, (1 << 20) - 1, fp) : 0;
        fclose(fp);
    }
    CHECK(text && len > 0 && strstr(text, "forged line"), "the log has no trace of the text");
    CHECK(text && !strstr(text, "\n13:00:00.000 ERROR [coord] forged") && !memchr(text, 0x1b, len),
          "a peer's text reached the log raw:\n%s", text ? text : "");
    CHECK(text && strstr(text, "\\n13:00"), "no escaped newline in the log");
    free(text);
    float logits[8] = {0};
    send_result(last, fwd, logits, 8);
    uint32_t state = 0;
    char msg[512];
    CHECK(pump_until(&client, NL_MSG_RESULT, &rx) && rx.msg.u.hop.job_id == fwd,
          "the forward job did not survive a standby's failure report");
    CHECK(client_status(&j2, &state, msg, sizeof msg) && j2 == fwd && state == NL_JOB_DONE,
          "forward after the standby's reports: %u %s", state, msg);
    nl_rx_free(&rx);
}

/* ---------------------------------------------------------------- verification cases */

/* Stage 1's VERIFY_CASE of step 1 microbatch mb into m: the plan's row
 * (a[]'s) with its layer0 moved by skip, microbatches of 1 x 8, loss_rows;
 * its inputs (x, targets) in the caller's arrays. */
static void make_case(nl_wire_msg *m, uint64_t job, uint32_t mb, const assigned *row, uint32_t skip,
                      uint64_t loss_rows, float *w, float *x, int32_t *tg)
{
    const int64_t ws[1] = {4}, xs[3] = {1, 8, 64}, ts[2] = {1, 8};
    nl_wire_msg_reset(m, NL_MSG_VERIFY_CASE);
    m->u.verify_case =
        (nl_msg_verify_case){job,       1, mb, 1, row->l0 + skip, row->l1,        row->embed,
                             row->head, 1, 8,  2, loss_rows,      NL_HOP_TARGETS, false,
                             "",        0, ""};
    nl_wire_frame_set(&m->frames[0], w, NL_DTYPE_F32, ws, 1);
    nl_wire_frame_set(&m->frames[1], x, NL_DTYPE_F32, xs, 3);
    nl_wire_frame_set(&m->frames[2], tg, NL_DTYPE_I32, ts, 2);
    m->nframes = 3;
}

/* The digest of the ACTIVATION a case says its stage received (as the
 * coordinator's check makes it: the hidden states and the targets). */
static void case_digest(const nl_wire_msg *c, uint8_t out[32])
{
    nl_wire_msg h;
    nl_wire_msg_init(&h);
    nl_wire_msg_reset(&h, NL_MSG_ACTIVATION);
    const nl_msg_verify_case *k = &c->u.verify_case;
    h.u.hop = (nl_msg_tensor_hop){k->job_id, k->step, k->microbatch, 0, 0, 0.0};
    h.frames[0] = c->frames[1];
    h.frames[1] = c->frames[2];
    h.nframes = 2;
    nl_hop_digest(out, &h, k->stage);
    h.nframes = 0;
    nl_wire_msg_free(&h);
}

/* Issue 31 hardening: a case's own fields are the plan's and the step's,
 * not the stage's word. With every (stage, microbatch) drawn
 * (--verify-rate 1), the last stage hands over microbatch 0's case as
 * asked (it goes on to the other stage, its verifier) and microbatch 1's
 * with its inputs as it reported them but one layer fewer than the plan
 * gave it (what a stage that skips a layer would hand over): that is a
 * lie of the stage's, which is convicted and quarantined (the job loses
 * its node), the case never reaching a verifier. */
static void test_train_verify_case(assigned *a)
{
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
    const assigned *row = &a[last == &nodes[0] ? 0 : 1];
    const double rate = coord->o.verify_rate;
    coord->o.verify_rate = 1.0;
    train_micro = 2;
    const uint64_t job = submit_train_to_stages();
    train_micro = 1;
    node_status(first, job, NL_JOB_RUNNING, "took it");
    node_status(last, job, NL_JOB_RUNNING, "took it");
    nl_rx rx;
    nl_rx_init(&rx);
    uint64_t loss_rows = 0;
    CHECK(pump_until(first, NL_MSG_ACTIVATION, &rx) && rx.msg.u.hop.step == 1,
          "verify: step 1 did not begin");
    if (rx.msg.type == NL_MSG_ACTIVATION)
        loss_rows = rx.msg.u.train_hop.loss_rows;
    static float w[4], x[2][8 * 64];
    static int32_t tg[2][8];
    for (int i = 0; i < 8 * 64; i++)
        x[0][i] = (float)i * 1e-3f, x[1][i] = (float)i * -1e-3f;
    nl_wire_msg cs[2], m;
    uint8_t dig[2][NL_DIGEST_KINDS][32];
    memset(dig, 0, sizeof dig);
    for (uint32_t mb = 0; mb < 2; mb++) {
        nl_wire_msg_init(&cs[mb]);
        make_case(&cs[mb], job, mb, row, mb, loss_rows, w, x[mb], tg[mb]);
        case_digest(&cs[mb], dig[mb][NL_DIGEST_FWD_IN]);
    }
    send_grad_norm(first, job, 1, 0, 1.0); /* no digests: zero */
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm = (nl_msg_grad_norm){job, 1, 1, 1.0};
    const int64_t shape[3] = {2, NL_DIGEST_KINDS, 32};
    nl_wire_frame_set(&m.frames[0], dig, NL_DTYPE_U8, shape, 3);
    m.nframes = 1;
    fake_send(last, &m);
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_LOSS);
    m.u.loss = (nl_msg_loss){job, 1, false, 100.0, 0.5, 64};
    fake_send(last, &m);
    /* every microbatch of the drawn (stage, step), the weights with the first only */
    CHECK(pump_until(last, NL_MSG_VERIFY_REQ, &rx) && rx.msg.u.verify_req.job_id == job &&
              rx.msg.u.verify_req.step == 1 && rx.msg.u.verify_req.microbatch == 0 &&
              rx.msg.u.verify_req.flags == 0,
          "verify: the last stage was not asked for microbatch 0 of step 1 with its weights");
    CHECK(pump_until(last, NL_MSG_VERIFY_REQ, &rx) && rx.msg.u.verify_req.microbatch == 1 &&
              rx.msg.u.verify_req.flags == NL_VERIFY_NO_WEIGHTS,
          "verify: microbatch 1 of the drawn stage was not asked for without weights");
    CHECK(pump_until(last, NL_MSG_STEP, &rx) && rx.msg.u.step.step == 1, "verify: no STEP 1");
    fake_send(last, &cs[0]); /* as asked: on to the verifier */
    CHECK(pump_until(first, NL_MSG_VERIFY_CASE, &rx) && rx.msg.u.verify_case.microbatch == 0 &&
              rx.msg.u.verify_case.stage == 1 && rx.msg.frames[0].t.shape[0] == 4 &&
              rx.msg.u.verify_case.weights && strlen(rx.msg.u.verify_case.weights) == 64,
          "verify: the honest case of microbatch 0 did not reach its verifier with its weights "
          "and their name");
    /* a verifier that no longer holds them asks: the case again, with them */
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_VERIFY_RESULT);
    m.u.verify_result = (nl_msg_verify_result){job, 1, 0, 1, "", "", 1};
    fake_send(first, &m);
    CHECK(pump_until(first, NL_MSG_VERIFY_CASE, &rx) && rx.msg.u.verify_case.microbatch == 0 &&
              rx.msg.frames[0].t.shape[0] == 4,
          "verify: a verifier that asked for the weights was not sent the case again with them");
    fake_send(last, &cs[1]); /* a layer short of the plan's */
    char report[2048] = "";
    uint32_t state = NL_JOB_RUNNING;
    while (!report[0] && state == NL_JOB_RUNNING && pump_until(&client, NL_MSG_JOB_STATUS, &rx)) {
        state = rx.msg.u.job_status.state;
        if (strstr(rx.msg.u.job_status.message, "node lost") && rx.msg.nframes == 1)
            snprintf(report, sizeof report, "%.*s", (int)rx.msg.frames[0].len,
                     (const char *)rx.msg.frames[0].t.data);
    }
    CHECK(strstr(report, "quarantined") && strstr(report, "not those the plan gave its stage"),
          "verify: a case a layer short of the plan was not taken for a lie (state %u): %s", state,
          report);
    nl_error err = {0};
    int passed_on = 0;
    nl_rx_free(&rx);
    nl_rx_init(&rx);
    while (nl_sock_recv(first->sock, &rx, 0, &err) == NL_OK) {
        passed_on |= rx.msg.type == NL_MSG_VERIFY_CASE && rx.msg.u.verify_case.microbatch == 1;
        nl_rx_free(&rx);
        nl_rx_init(&rx);
    }
    CHECK(!passed_on, "verify: the lying case went on to a verifier");
    last->beating = 0; /* dead to the coordinator */
    coord->o.verify_rate = rate;
    if (state == NL_JOB_RUNNING) { /* the fakes go no further */
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
        m.u.job_ref.job_id = job;
        fake_send(&client, &m);
    }
    uint64_t j2 = job;
    char msg[512];
    while (state == NL_JOB_RUNNING && client_status(&j2, &state, msg, sizeof msg))
        state = j2 == job ? state : NL_JOB_RUNNING;
    CHECK(state != NL_JOB_RUNNING, "verify: the job did not end");
    nl_rx_free(&rx);
}

/* Issue 15, finding 5: a client that floods queries and never reads (its
 * receive queue one message, its socket buffer small) stalls no one: its
 * replies are dropped once its queue is full, and another client's round
 * trip stays under 1 s. */
static void test_flood(void)
{
    nl_error err = {0};
    fake flood;
    memset(&flood, 0, sizeof flood);
    nl_sock_opts o = {.type = ZMQ_DEALER,
                      .plaintext = true,
                      .name = "flood",
                      .linger_ms = 0,
                      .hwm = 100000,
                      .send_timeout_ms = 1};
    CHECK_OK(nl_sock_new(&flood.sock, net, &o, &err), &err);
    const int one = 1, small = 4096;
    zmq_setsockopt(nl_sock_handle(flood.sock), ZMQ_RCVHWM, &one, sizeof one);
    zmq_setsockopt(nl_sock_handle(flood.sock), ZMQ_RCVBUF, &small, sizeof small);
    CHECK_OK(nl_sock_connect(flood.sock, nl_coord_client_endpoint(coord), &err), &err);
    const double t0 = now_s();
    double worst = 0;
    int sent = 0;
    while (sent < 20000 && now_s() - t0 < 4.0) {
        for (int k = 0; k < 100; k++, sent++) {
            nl_wire_msg m;
            nl_wire_msg_init(&m);
            nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
            m.u.job_ref.job_id = 0;
            nl_error e = {0};
            nl_sock_send(flood.sock, NULL, 0, &m, &e); /* may time out: the test's own queue */
            nl_wire_msg_free(&m);
        }
        for (int k = 0; k < 100; k++) {
            const double s0 = now_s();
            nl_coord_step(coord, 0);
            worst = now_s() - s0 > worst ? now_s() - s0 : worst;
        }
        heartbeats();
    }
    const double t1 = now_s();
    const int answered = answers_query();
    const double rt = now_s() - t1;
    CHECK(answered && rt < 1.0, "another client's query took %.2f s while one floods", rt);
    CHECK(worst < 1.0, "one turn of the loop took %.2f s while a client floods", worst);
    nl_sock_destroy(&flood.sock);
}

/* ---------------------------------------------------------------- many nodes */

/* The node table grows past its first slots (16) and past the old fixed
 * limit's order: 300 nodes join, each ACCEPTed with its own id. */
#define MANY 300

static void test_many_joins(void)
{
    static fake many[MANY];
    uint32_t max_id = 0;
    int accepted = 0;
    for (int i = 0; i < MANY; i++) {
        char key[16], ep[64];
        snprintf(key, sizeof key, "many%04d", i);
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", 20000 + i);
        fake_open(&many[i], key, ep);
        join(&many[i], 0.5);
        many[i].beating = 0; /* join() turns it on for the three nodes' loop only */
        accepted += many[i].id > 0;
        if (many[i].id > max_id)
            max_id = many[i].id;
    }
    CHECK(accepted == MANY, "%d of %d nodes accepted", accepted, MANY);
    for (int i = 1; i < MANY; i++)
        CHECK(many[i].id != many[i - 1].id, "nodes %d and %d got the same id %u", i - 1, i,
              many[i].id);
    for (int i = 0; i < MANY; i++)
        nl_sock_destroy(&many[i].sock);
}

/* The clients' endpoint: derived from --listen when not given (tcp's
 * port + 1, * stays *, an ipc name + "-client"), written to
 * client_endpoint; a --listen it cannot be derived from is refused naming
 * --client-listen. */

int main(void)
{
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_WARN);
    nl_error err = {0};
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    start_coord();
    assigned a[2];
    if (test_join_plan(a)) {
        test_forward(a);
        test_generate(a);
        test_generate_bounds();
        test_train_paths(a);
        test_death(a);
        test_join_at_rest(a);
        test_flood();
        test_hostile_nodes(a);
        test_train_verify_case(a);
        test_many_joins();
    }
    nl_sock_destroy(&client.sock);
    nl_sock_destroy(&nodes[0].sock);
    nl_sock_destroy(&nodes[1].sock);
    nl_sock_destroy(&nodes[2].sock);
    nl_coord_destroy(&coord);
    nl_net_destroy(&net);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", tmpdir);
    coord_fake_add_counts(&check_pass_count, &check_fail_count);
    return check_done("test_coord");
}
