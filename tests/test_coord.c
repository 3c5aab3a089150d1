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
 *  - hostile peers: a TOKEN for a forward job refused, a standby's
 *    failure reports failing nothing, a peer's text reaching the log
 *    escaped; a client that floods queries stalls no one; 300 nodes join,
 *    each with its own id.
 *
 * The fakes are coord_fake.c's, the two-stage cluster coord_harness.h's;
 * the training jobs on that cluster are test_coord_train.c's; the
 * coordinator's peers (roles under CURVE, its endpoints, the node index)
 * are test_coord_peers.c's. */
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
#include "tests/coord_harness.h"

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
    nl_rx rx;
    nl_rx_init(&rx);
    int ok =
        fake_query_status(&client, &rx) && rx.msg.u.job_status.job_id == 0 && rx.msg.nframes == 1;
    nl_rx_free(&rx);
    return ok;
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
        test_death(a);
        test_join_at_rest(a);
        test_flood();
        test_hostile_nodes(a);
        test_many_joins();
    }
    stop_coord();
    coord_fake_add_counts(&check_pass_count, &check_fail_count);
    return check_done("test_coord");
}
