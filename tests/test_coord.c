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
 *    fail that job alone, revealing nothing; a file in the root makes a
 *    job that begins, and a cancel reloads its stages. */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../base/log.h"
#include "../coordinator/coord.h"
#include "../net/handshake.h"
#include "../net/keys.h"
#include "../net/transport.h"
#include "check.h"

#define WAIT_S 10.0 /* for a message that must arrive */
#define HB_MS 50
#define TIMEOUT_MS 600

static nl_coord *coord;
static nl_net *net;
static char tmpdir[256];

typedef struct fake {
    nl_sock *sock;
    char key[41];      /* what its JOIN calls its key (plaintext: any text) */
    char endpoint[64]; /* its (pretended) data endpoint */
    uint32_t id;       /* from ACCEPT */
    int beating;       /* sends heartbeats while the test pumps */
    double last_beat;
    uint64_t seq;
} fake;

static fake nodes[3], client;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A fake node (with a data endpoint), or a fake client (endpoint ""): on
 * the coordinator's nodes' or clients' socket. */
static void fake_open(fake *f, const char *key, const char *endpoint)
{
    nl_error err = {0};
    memset(f, 0, sizeof *f);
    /* a JOIN names a key of 40 characters (Z85) */
    snprintf(f->key, sizeof f->key, "%s0000000000000000000000000000000000000000", key);
    snprintf(f->endpoint, sizeof f->endpoint, "%s", endpoint);
    nl_sock_opts o = {.type = ZMQ_DEALER, .plaintext = true, .name = "fake", .linger_ms = 0};
    CHECK_OK(nl_sock_new(&f->sock, net, &o, &err), &err);
    CHECK_OK(nl_sock_connect(f->sock,
                             endpoint[0] ? nl_coord_endpoint(coord) : nl_coord_client_endpoint(coord),
                             &err),
             &err);
}

static void fake_send(fake *f, nl_wire_msg *m)
{
    nl_error err = {0};
    CHECK_OK(nl_sock_send(f->sock, NULL, 0, m, &err), &err);
    nl_wire_msg_free(m);
}

static void heartbeats(void)
{
    const double t = now_s();
    for (int i = 0; i < 3; i++) {
        fake *f = &nodes[i];
        if (!f->beating || (t - f->last_beat) * 1e3 < HB_MS)
            continue;
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
        m.u.heartbeat = (nl_msg_heartbeat){.node_id = f->id, .seq = ++f->seq};
        fake_send(f, &m);
        f->last_beat = t;
    }
}

/* Turn the coordinator's loop (and the fake nodes' heartbeats) until f
 * receives a message of type want into rx; other messages to f are
 * skipped. Returns 0 on time out. */
static int pump_until(fake *f, nl_msg_type want, nl_rx *rx)
{
    const double t0 = now_s();
    while (now_s() - t0 < WAIT_S) {
        nl_coord_step(coord, 5);
        heartbeats();
        nl_error err = {0};
        nl_rx_free(rx);
        nl_rx_init(rx);
        if (nl_sock_recv(f->sock, rx, 0, &err) != NL_OK)
            continue;
        if (rx->msg.type == want)
            return 1;
        NL_DEBUG("%s: skipped %s", f->key, nl_wire_type_name(rx->msg.type));
    }
    fprintf(stderr, "%s: no %s within %.0f s (coordinator: %s)\n", f->key, nl_wire_type_name(want),
            WAIT_S, nl_coord_state(coord));
    return 0;
}

/* Turn the loop until the coordinator's state begins with prefix. */
static int pump_state(const char *prefix)
{
    const double t0 = now_s();
    while (now_s() - t0 < WAIT_S) {
        if (strncmp(nl_coord_state(coord), prefix, strlen(prefix)) == 0)
            return 1;
        nl_coord_step(coord, 5);
        heartbeats();
    }
    fprintf(stderr, "state '%s' is not '%s...'\n", nl_coord_state(coord), prefix);
    return 0;
}

/* A pump that must succeed: counted as a check. */
#define CHECK_PUMP(call) check_pump((call), #call)

static int check_pump(int ok, const char *what)
{
    CHECK(ok, "%s", what);
    return ok;
}

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
    o.job_timeout_ms = 2 * TIMEOUT_MS;
    o.plaintext = 1;
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

/* ---------------------------------------------------------------- join -> plan */

/* The heartbeat period and timeout an ACCEPT must carry. */
static int join_hb = HB_MS, join_to = TIMEOUT_MS;

static void join(fake *f, double gflops)
{
    nl_wire_msg m;
    nl_rx rx;
    nl_rx_init(&rx);
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    /* slow nodes: compute outweighs the hop, so the planner uses both */
    m.u.join = (nl_msg_join){f->key, "cpu", 1ull << 30, gflops, 1, f->endpoint};
    fake_send(f, &m);
    if (pump_until(f, NL_MSG_ACCEPT, &rx)) {
        f->id = rx.msg.u.accept.node_id;
        CHECK(f->id > 0 && rx.msg.u.accept.heartbeat_ms == (uint32_t)join_hb &&
                  rx.msg.u.accept.timeout_ms == (uint32_t)join_to,
              "ACCEPT %u %u %u", f->id, rx.msg.u.accept.heartbeat_ms, rx.msg.u.accept.timeout_ms);
        f->beating = 1;
    }
    nl_rx_free(&rx);
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
    m.u.token = (nl_msg_token){job, job, 1, &tok, false};
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

/* Issue 15, finding 9, on a training job: a stage's acknowledgement counts
 * once however often it is sent (step 1 waits for the other stage), and a
 * non-finite gradient norm skips the step on every stage (a stage that
 * keeps sending them fails the job: test_cluster_train); the stages
 * then reload. */
static void test_train_reports(assigned *a)
{
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
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

/* Submit a training job of 2 steps with these paths (resume may be NULL). */
static void submit_train(const char *data, const char *ckpt, const char *resume)
{
    nl_wire_param ps[16] = {
        {.key = "steps", .kind = NL_WIRE_PARAM_INT, .i = 2},
        {.key = "batch", .kind = NL_WIRE_PARAM_INT, .i = 2},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 8},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = 1},
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
    /* a forward job in flight while the bad ones fail */
    fake *first = stage_of(a, 0), *last = stage_of(a, 1);
    const int32_t ids[2] = {3, 4};
    uint64_t fwd = start_forward(first, ids, 2), j2 = 0;
    const char *hide[] = {"hashes to", " bytes", "BEGIN", NULL};
    train_refused("data.fifo", "ck", NULL, "not a regular file", hide);
    train_refused(key, "ck", NULL, "must lie under the root", hide);
    train_refused("key.txt", "ck", NULL, "leads outside the root", hide);
    train_refused("big.txt", "ck", NULL, "larger than", hide);
    train_refused("../coordinator.key", "ck", NULL, "'..'", hide);
    train_refused("ok.txt", "/etc", NULL, "checkpoint_dir", hide);
    train_refused("ok.txt", "ck/../../x", NULL, "checkpoint_dir", hide);
    train_refused("ok.txt", "ck", "/nonexistent", "params.resume", hide);
    train_refused("ok.txt", "ck", "nothing-here", "params.resume: no such file", hide);
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

/* ---------------------------------------------------------------- roles (CURVE) */

/* A CURVE client of the coordinator with key kp (and routing id rid, if
 * not NULL), on its nodes' socket or its clients' (client). */
static void curve_open(fake *f, const nl_keypair *kp, const char *server, const char *rid,
                       int on_clients)
{
    nl_error err = {0};
    memset(f, 0, sizeof *f);
    snprintf(f->key, sizeof f->key, "%s", kp->public_z85);
    nl_sock_opts o = {.type = ZMQ_DEALER,
                      .keys = kp,
                      .server_key = server,
                      .name = "curve-fake",
                      .linger_ms = 0};
    CHECK_OK(nl_sock_new(&f->sock, net, &o, &err), &err);
    if (rid)
        zmq_setsockopt(nl_sock_handle(f->sock), ZMQ_ROUTING_ID, rid, strlen(rid));
    CHECK_OK(nl_sock_connect(f->sock,
                             on_clients ? nl_coord_client_endpoint(coord) : nl_coord_endpoint(coord),
                             &err),
             &err);
}

/* f sends m; the coordinator must answer with an ERROR whose message
 * holds want. */
static void refused(fake *f, nl_wire_msg *m, const char *want, const char *what)
{
    nl_rx rx;
    nl_rx_init(&rx);
    fake_send(f, m);
    CHECK(pump_until(f, NL_MSG_ERROR, &rx) && strstr(rx.msg.u.error.message, want),
          "%s: %s", what, rx.msg.type == NL_MSG_ERROR ? rx.msg.u.error.message : "no ERROR");
    nl_rx_free(&rx);
}

/* The status JSON the coordinator answers f's query with (malloc'd). */
static char *status_text(fake *f)
{
    nl_wire_msg m;
    nl_rx rx;
    nl_rx_init(&rx);
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
    m.u.job_ref.job_id = 0;
    fake_send(f, &m);
    char *text = NULL;
    if (pump_until(f, NL_MSG_JOB_STATUS, &rx) && rx.msg.nframes == 1) {
        const size_t n = (size_t)rx.msg.frames[0].t.shape[0];
        if ((text = malloc(n + 1))) {
            memcpy(text, rx.msg.frames[0].t.data, n);
            text[n] = '\0';
        }
    }
    nl_rx_free(&rx);
    return text;
}

/* Does a CURVE connection with key kp to endpoint ep fail its handshake
 * (ZAP refuses the key)? */
static int handshake_refused(const nl_keypair *kp, const char *server, const char *ep)
{
    nl_error err = {0};
    nl_sock *s = NULL;
    nl_handshake *hs = NULL;
    nl_sock_opts o = {.type = ZMQ_DEALER,
                      .keys = kp,
                      .server_key = server,
                      .name = "curve-fake",
                      .linger_ms = 0};
    nl_status st = nl_sock_new(&s, net, &o, &err);
    if (st == NL_OK && (st = nl_handshake_watch(&hs, net, s, &err)) == NL_OK &&
        (st = nl_sock_connect(s, ep, &err)) == NL_OK)
        st = nl_handshake_wait(hs, ep, 5000, &err);
    nl_handshake_destroy(&hs);
    nl_sock_destroy(&s);
    return st == NL_ERR_AUTH && strstr(err.msg, "refused this key");
}

/* Issue 15, finding 8: each socket admits its role's keys alone (ZAP): a
 * client key never reaches the nodes' bulk-sized socket, a node key never
 * the clients'; a key with both roles (no role word) that knocks at the
 * wrong one is told where to go. */
static void roles_by_socket(const nl_keypair *node, const nl_keypair *ckey,
                            const nl_keypair *legacy, const char *server)
{
    CHECK(handshake_refused(ckey, server, nl_coord_endpoint(coord)),
          "a client key's handshake on the nodes' socket is not refused");
    CHECK(handshake_refused(node, server, nl_coord_client_endpoint(coord)),
          "a node key's handshake on the clients' socket is not refused");
    fake on_nodes, on_clients;
    curve_open(&on_nodes, legacy, server, NULL, 0);
    curve_open(&on_clients, legacy, server, NULL, 1);
    char want[400];
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    snprintf(want, sizeof want, "clients connect to %s", nl_coord_client_endpoint(coord));
    for (int i = 0; i < 7; i++) { /* no strikes: a ban (5) would drop the last unanswered */
        nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
        m.u.job_ref.job_id = 0;
        refused(&on_nodes, &m, want, "a JOB_QUERY on the nodes' socket");
    }
    nl_wire_msg_reset(&m, NL_MSG_HELLO);
    m.u.hello = (nl_msg_hello){NL_ROLE_NODE, "test"};
    snprintf(want, sizeof want, "nodes connect to %s", nl_coord_endpoint(coord));
    refused(&on_clients, &m, want, "a node's HELLO on the clients' socket");
    nl_sock_destroy(&on_nodes.sock);
    nl_sock_destroy(&on_clients.sock);
}

/* Issue 15, findings 2 and 7, on a CURVE coordinator whose authorized_keys
 * gives each key a role: a client key cannot JOIN, report LOAD_DONE or
 * GRAD_NORM; a node key cannot submit; a client's status shows no node's
 * key or endpoint, an admin's does; and a connection that takes over a
 * node's routing id with another key is not that node (its HEARTBEAT is
 * refused). */
static void test_roles(void)
{
    nl_coord *plain = coord;
    char dir[256], path[400];
    snprintf(dir, sizeof dir, "/tmp/nl_test_coord_roles_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    nl_keypair node, ckey, admin, other, legacy;
    nl_error err = {0};
    CHECK_OK(nl_keys_generate(&legacy, &err), &err);
    CHECK_OK(nl_keys_generate(&node, &err), &err);
    CHECK_OK(nl_keys_generate(&ckey, &err), &err);
    CHECK_OK(nl_keys_generate(&admin, &err), &err);
    CHECK_OK(nl_keys_generate(&other, &err), &err);
    snprintf(path, sizeof path, "%s/authorized_keys", dir);
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL, "%s", path);
    if (!fp)
        return;
    fprintf(fp, "%s node  # a node\n%s client\n%s admin # the operator\n%s node\n%s\n",
            node.public_z85, ckey.public_z85, admin.public_z85, other.public_z85,
            legacy.public_z85);
    fclose(fp);
    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = "tcp://127.0.0.1:*";
    o.state_dir = dir;
    o.min_nodes = 5; /* no plan: membership and roles only */
    o.node_timeout_ms = 60000;
    coord = NULL;
    CHECK_OK(nl_coord_new(&coord, &o, &err), &err);
    char server[NL_KEY_Z85_LEN + 1];
    snprintf(path, sizeof path, "%s/coordinator.pub", dir);
    if (!coord || nl_keys_load_public(server, path, &err) != NL_OK) {
        nl_coord_destroy(&coord);
        coord = plain;
        return;
    }
    roles_by_socket(&node, &ckey, &legacy, server);
    fake n, cl, ad, spoof;
    curve_open(&n, &node, server, "nodeRID", 0);
    curve_open(&cl, &ckey, server, NULL, 1);
    curve_open(&ad, &admin, server, NULL, 1);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){ckey.public_z85, "cpu", UINT64_MAX, 1e6, 1, "tcp://10.0.0.1:1"};
    refused(&cl, &m, "not for a key of this role", "a client's JOIN");
    nl_wire_msg_reset(&m, NL_MSG_LOAD_DONE);
    m.u.load_done = (nl_msg_load_done){1, 1, 0, 0};
    refused(&cl, &m, "not for a key of this role", "a client's LOAD_DONE");
    nl_wire_msg_reset(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm = (nl_msg_grad_norm){1, 1, 0, 1.0};
    refused(&cl, &m, "not for a key of this role", "a client's GRAD_NORM");
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_FORWARD, 0, NULL};
    refused(&n, &m, "not for a key of this role", "a node's JOB_SUBMIT");
    /* the node joins */
    nl_rx rx;
    nl_rx_init(&rx);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){node.public_z85, "cpu", 1ull << 30, 1.0, 1, "tcp://10.9.8.7:4242"};
    fake_send(&n, &m);
    uint32_t id = 0;
    if (CHECK_PUMP(pump_until(&n, NL_MSG_ACCEPT, &rx)))
        id = rx.msg.u.accept.node_id;
    char *ct = status_text(&cl), *at = status_text(&ad);
    CHECK(ct && strstr(ct, "\"nodes\"") && !strstr(ct, node.public_z85) &&
              !strstr(ct, "10.9.8.7") && !strstr(ct, "\"endpoint\""),
          "a client's status shows nodes' keys or endpoints: %s", ct ? ct : "(none)");
    CHECK(at && strstr(at, node.public_z85) && strstr(at, "10.9.8.7"),
          "an admin's status lacks the nodes: %s", at ? at : "(none)");
    free(ct);
    free(at);
    /* another key takes over the node's routing id once it is gone */
    nl_sock_destroy(&n.sock);
    for (int i = 0; i < 60; i++)
        nl_coord_step(coord, 5);
    curve_open(&spoof, &other, server, "nodeRID", 0);
    nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
    m.u.heartbeat = (nl_msg_heartbeat){.node_id = id, .seq = 1};
    refused(&spoof, &m, "unknown node", "a HEARTBEAT under a node's routing id, another key");
    nl_rx_free(&rx);
    nl_sock_destroy(&spoof.sock);
    nl_sock_destroy(&cl.sock);
    nl_sock_destroy(&ad.sock);
    nl_coord_destroy(&coord);
    coord = plain;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
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
static void test_endpoints(void)
{
    char dir[] = "/tmp/nl_test_coord_ep_XXXXXX", listen[300], want[320], path[400], line[400];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(listen, sizeof listen, "ipc://%s/c.sock", dir);
    snprintf(want, sizeof want, "%s-client", listen);
    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = listen;
    o.state_dir = dir;
    o.plaintext = 1;
    o.min_nodes = 5;
    nl_coord *c = NULL;
    nl_error err = {0};
    CHECK_OK(nl_coord_new(&c, &o, &err), &err);
    if (c) {
        CHECK(strcmp(nl_coord_client_endpoint(c), want) == 0, "clients' endpoint %s for %s",
              nl_coord_client_endpoint(c), listen);
        snprintf(path, sizeof path, "%s/client_endpoint", dir);
        FILE *f = fopen(path, "r");
        CHECK(f && fgets(line, sizeof line, f) && strncmp(line, want, strlen(want)) == 0,
              "%s does not name %s", path, want);
        if (f)
            fclose(f);
    }
    nl_coord_destroy(&c);
    o.listen = "tcp://127.0.0.1:65535";
    nl_status st = nl_coord_new(&c, &o, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "give --client-listen"),
          "--listen at port 65535: %s '%s'", nl_status_str(st), err.msg);
    nl_coord_destroy(&c);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

/* ---------------------------------------------------------------- the node index */

/* The node table's indexes (coordinator/coord_base.c), on a coordinator
 * of its own that never plans (--min-nodes out of reach):
 *  - IX nodes join (the table grows from 16 slots to 512), each with its
 *    own id; every node's heartbeat is taken under its id and refused
 *    under another node's (its routing id finds it and no other);
 *  - a third stop beating: they are declared dead after the timeout and
 *    not before, the others (beating) live; a dead node's heartbeat is
 *    refused;
 *  - the dead join again on the same connections: new ids, in the slots
 *    they left (the table lists IX nodes again, none dead);
 *  - a live node that joins again from a new connection (a restart) is
 *    its new id only;
 *  - a connection that takes over a gone node's routing id with another
 *    key joins, and its heartbeats are its own (the old node is dead). */
#define IX 300
#define IX_BEAT_MS 250
#define IX_TIMEOUT_MS 1500

static fake ix[IX];
static int ix_refused[IX];

static void ix_beat(fake *f, uint32_t id)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
    m.u.heartbeat = (nl_msg_heartbeat){.node_id = id, .seq = ++f->seq};
    fake_send(f, &m);
}

/* Turn the loop for s seconds: the beating nodes beat every IX_BEAT_MS;
 * every ERROR a node gets is counted in ix_refused. */
static void ix_pump(double s)
{
    const double t0 = now_s();
    nl_rx rx;
    nl_rx_init(&rx);
    while (now_s() - t0 < s) {
        for (int k = 0; k < 50; k++)
            nl_coord_step(coord, 0);
        const double t = now_s();
        for (int i = 0; i < IX; i++) {
            fake *f = &ix[i];
            if (f->beating && (t - f->last_beat) * 1e3 >= IX_BEAT_MS) {
                ix_beat(f, f->id);
                f->last_beat = t;
            }
            nl_error err = {0};
            while (nl_sock_recv(f->sock, &rx, 0, &err) == NL_OK) {
                if (rx.msg.type == NL_MSG_ERROR && strstr(rx.msg.u.error.message, "unknown node"))
                    ix_refused[i]++;
                if (rx.msg.type == NL_MSG_ACCEPT && !f->id) { /* it beats from now on */
                    f->id = rx.msg.u.accept.node_id;
                    f->beating = 1;
                    f->last_beat = t;
                }
                nl_rx_free(&rx);
                nl_rx_init(&rx);
            }
        }
        usleep(1000);
    }
    nl_rx_free(&rx);
}

/* How many times needle occurs in the status JSON f is answered. */
static int status_count(fake *f, const char *needle)
{
    char *t = status_text(f);
    int n = t ? 0 : -1;
    for (const char *p = t; p && (p = strstr(p, needle)); p++)
        n++;
    free(t);
    return n;
}

/* Nodes from, from + step, ... JOIN (again) and the loop turns until
 * each is ACCEPTed (beating from then on); returns how many were. */
static int ix_join(int from, int step)
{
    int want = 0, got = 0;
    for (int i = from; i < IX; i += step, want++) {
        ix[i].id = 0;
        ix[i].beating = 0;
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_JOIN);
        m.u.join = (nl_msg_join){ix[i].key, "cpu", 1ull << 30, 1.0, 1, ix[i].endpoint};
        fake_send(&ix[i], &m);
    }
    for (const double t0 = now_s(); got < want && now_s() - t0 < WAIT_S;) {
        ix_pump(0.05);
        got = 0;
        for (int i = from; i < IX; i += step)
            got += ix[i].id > 0;
    }
    return got;
}

static int ix_refusals(int from, int step)
{
    int n = 0;
    for (int i = from; i < IX; i += step)
        n += ix_refused[i];
    return n;
}

static void test_node_index(void)
{
    nl_coord *saved = coord;
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/nl_test_coord_index_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = "tcp://127.0.0.1:*";
    o.state_dir = dir;
    o.min_nodes = 1 << 30; /* membership only */
    o.heartbeat_ms = IX_BEAT_MS;
    o.node_timeout_ms = IX_TIMEOUT_MS;
    o.plaintext = 1;
    nl_error err = {0};
    coord = NULL;
    CHECK_OK(nl_coord_new(&coord, &o, &err), &err);
    if (!coord) {
        coord = saved;
        return;
    }
    join_hb = IX_BEAT_MS;
    join_to = IX_TIMEOUT_MS;
    fake cl;
    fake_open(&cl, "ixclient", "");
    /* IX nodes join, each with its own id */
    uint32_t max_id = 0;
    for (int i = 0; i < IX; i++) {
        char key[16], ep[64];
        snprintf(key, sizeof key, "ix%04d", i);
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", 40000 + i);
        fake_open(&ix[i], key, ep);
    }
    const int accepted = ix_join(0, 1);
    for (int i = 0; i < IX; i++)
        max_id = ix[i].id > max_id ? ix[i].id : max_id;
    CHECK(accepted == IX && max_id == IX, "%d of %d joined, ids up to %u", accepted, IX, max_id);
    /* heartbeats under their own ids taken, under a neighbour's refused */
    for (int i = 0; i < IX; i++)
        ix_beat(&ix[i], ix[(i + 1) % IX].id);
    ix_pump(1.0);
    int once = 0;
    for (int i = 0; i < IX; i++)
        once += ix_refused[i] == 1;
    CHECK(once == IX, "%d of %d nodes had exactly their one wrong heartbeat refused", once, IX);
    CHECK(status_count(&cl, "\"state\":\"joined\"") == IX, "the status lists %d joined nodes",
          status_count(&cl, "\"state\":\"joined\""));
    /* a third stop: dead after the timeout, not before; the others live */
    memset(ix_refused, 0, sizeof ix_refused);
    for (int i = 0; i < IX; i += 3)
        ix[i].beating = 0;
    ix_pump(IX_TIMEOUT_MS * 1e-3 - 0.5);
    CHECK(status_count(&cl, "\"state\":\"dead\"") == 0, "%d nodes dead before the timeout",
          status_count(&cl, "\"state\":\"dead\""));
    ix_pump(1.0);
    CHECK(status_count(&cl, "\"state\":\"dead\"") == IX / 3, "%d of the %d silent nodes dead",
          status_count(&cl, "\"state\":\"dead\""), IX / 3);
    for (int i = 0; i < IX; i += 3)
        ix_beat(&ix[i], ix[i].id);
    ix_pump(0.3);
    CHECK(ix_refusals(0, 3) == IX / 3 && ix_refusals(1, 3) + ix_refusals(2, 3) == 0,
          "heartbeats refused: %d of the dead (%d sent), %d of the live", ix_refusals(0, 3),
          IX / 3, ix_refusals(1, 3) + ix_refusals(2, 3));
    /* the dead join again: new ids in the slots they left */
    memset(ix_refused, 0, sizeof ix_refused);
    int fresh = 0;
    ix_join(0, 3);
    for (int i = 0; i < IX; i += 3)
        fresh += ix[i].id > max_id;
    CHECK(fresh == IX / 3, "%d of %d joined again with new ids", fresh, IX / 3);
    ix_pump(0.6);
    CHECK(ix_refusals(0, 1) == 0, "%d heartbeats refused after the re-joins", ix_refusals(0, 1));
    CHECK(status_count(&cl, "\"id\":") == IX && status_count(&cl, "\"state\":\"dead\"") == 0,
          "after the re-joins the status lists %d nodes (%d dead), not %d",
          status_count(&cl, "\"id\":"), status_count(&cl, "\"state\":\"dead\""), IX);
    /* a live node restarts: a new connection, the same key */
    const uint32_t was = ix[1].id;
    nl_sock_destroy(&ix[1].sock);
    fake_open(&ix[1], "ix0001", "tcp://127.0.0.1:40001");
    ix_join(1, IX);
    ix_beat(&ix[1], was);
    ix_pump(0.5);
    CHECK(ix[1].id != was && ix_refused[1] == 1 && ix_refusals(0, 1) == 1,
          "restart: id %u (was %u), %d refusals of the old id, %d in all", ix[1].id, was,
          ix_refused[1], ix_refusals(0, 1));
    /* a gone node's routing id taken over by another key */
    fake a, b;
    fake_open(&a, "ixA", "tcp://127.0.0.1:49998");
    nl_sock_destroy(&a.sock);
    nl_sock_opts so = {.type = ZMQ_DEALER, .plaintext = true, .name = "fake", .linger_ms = 0};
    CHECK_OK(nl_sock_new(&a.sock, net, &so, &err), &err);
    zmq_setsockopt(nl_sock_handle(a.sock), ZMQ_ROUTING_ID, "ixRID", 5);
    CHECK_OK(nl_sock_connect(a.sock, nl_coord_endpoint(coord), &err), &err);
    join(&a, 1.0);
    nl_sock_destroy(&a.sock);
    for (int i = 0; i < 60; i++)
        nl_coord_step(coord, 5);
    fake_open(&b, "ixB", "tcp://127.0.0.1:49999");
    nl_sock_destroy(&b.sock);
    CHECK_OK(nl_sock_new(&b.sock, net, &so, &err), &err);
    zmq_setsockopt(nl_sock_handle(b.sock), ZMQ_ROUTING_ID, "ixRID", 5);
    CHECK_OK(nl_sock_connect(b.sock, nl_coord_endpoint(coord), &err), &err);
    join(&b, 1.0);
    CHECK(a.id > 0 && b.id > 0 && b.id != a.id, "takeover: ids %u and %u", a.id, b.id);
    nl_rx rx;
    nl_rx_init(&rx);
    ix_beat(&b, b.id);
    ix_beat(&b, 0);
    CHECK(pump_until(&b, NL_MSG_ERROR, &rx) && rx.msg.u.error.req_type == NL_MSG_HEARTBEAT,
          "takeover: a heartbeat under no node's id is refused");
    nl_rx_free(&rx);
    nl_rx_init(&rx);
    nl_error e2 = {0};
    int more = 0;
    for (int i = 0; i < 20; i++) {
        nl_coord_step(coord, 5);
        if (nl_sock_recv(b.sock, &rx, 0, &e2) == NL_OK)
            more++;
        nl_rx_free(&rx);
        nl_rx_init(&rx);
    }
    CHECK(more == 0, "takeover: the new node's own heartbeat was refused");
    nl_rx_free(&rx);
    nl_sock_destroy(&b.sock);
    for (int i = 0; i < IX; i++)
        nl_sock_destroy(&ix[i].sock);
    nl_sock_destroy(&cl.sock);
    nl_coord_destroy(&coord);
    coord = saved;
    join_hb = HB_MS;
    join_to = TIMEOUT_MS;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

int main(void)
{
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_WARN);
    nl_error err = {0};
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    test_endpoints();
    test_roles();
    test_node_index();
    start_coord();
    assigned a[2];
    if (test_join_plan(a)) {
        test_forward(a);
        test_generate(a);
        test_train_paths(a);
        test_death(a);
        test_join_at_rest(a);
        test_flood();
        test_hostile_nodes(a);
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
    return check_done("test_coord");
}
