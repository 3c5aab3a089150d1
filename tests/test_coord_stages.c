/* The coordinator with a replica count per stage (--replicas 2,1; DESIGN
 * section 8), in-process against three fake nodes:
 *  - the plan has stage 0 on two nodes and stage 1 on one; each ASSIGN
 *    names a neighbour stage with another count whole: stage 0's replicas
 *    the one node of stage 1 as next and previous (the token ring), the
 *    node of stage 1 both replicas of stage 0 as previous and next, keys
 *    and endpoints in replica order, links 0; status lists the counts;
 *  - with a node that accepts no inbound connections the plan is refused
 *    (neighbours with different counts link the default way only), and
 *    the coordinator says why;
 *  - a replica's node lost in a training step: the coordinator keeps its
 *    plan and asks each stage's first live replica (stage 0's replica 1
 *    for its dead replica 0) for a shard of the steps done, in
 *    step-N.resume1; when a stage asked fails, the job resumes from its
 *    source, as without the save, and the plan goes
 *    (test_cluster_replicas: the save that succeeds). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "base/log.h"
#include "coordinator/coord.h"
#include "coordinator/coord_impl.h"
#include "tests/check.h"
#include "tests/coord_fake.h"

static char tmpdir[256];
static fake client;

static void stages_opts(nl_coord_opts *o)
{
    o->min_nodes = 3;
    o->replicas = -1; /* --replicas 2,1 */
    o->stage_replicas[0] = 2;
    o->stage_replicas[1] = 1;
    o->n_stage_replicas = 2;
}

static void start_coord(void)
{
    coord_fake_start("coord_stages", tmpdir, sizeof tmpdir, stages_opts);
}

static void stop_coord(void)
{
    for (int i = 0; i < 3; i++)
        nl_sock_destroy(&nodes[i].sock);
    coord_fake_stop(tmpdir);
}

/* f JOINs with the given JOIN.flags (join() of coord_fake.c sends none). */
static void join_flags(fake *f, uint32_t flags)
{
    nl_wire_msg m;
    nl_rx rx;
    nl_rx_init(&rx);
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){f->key, "cpu", 1ull << 30, 1.0, 1, f->endpoint, flags};
    fake_send(f, &m);
    if (CHECK_PUMP(pump_until(f, NL_MSG_ACCEPT, &rx))) {
        f->id = rx.msg.u.accept.node_id;
        f->beating = 1;
    }
    nl_rx_free(&rx);
}

/* What one fake's ASSIGN said. */
typedef struct got {
    int ok;
    uint32_t stage, replica, replicas, links;
    char prev_key[64], next_key[64], prev_keys[256], next_keys[256], next_eps[256];
} got;

static void take_assign(fake *f, got *g)
{
    nl_rx rx;
    nl_rx_init(&rx);
    memset(g, 0, sizeof *g);
    if (CHECK_PUMP(pump_until(f, NL_MSG_ASSIGN, &rx))) {
        const nl_msg_assign *a = &rx.msg.u.assign;
        g->ok = 1;
        g->stage = a->stage;
        g->replica = a->replica;
        g->replicas = a->replicas;
        g->links = a->links;
        snprintf(g->prev_key, sizeof g->prev_key, "%s", a->prev_key);
        snprintf(g->next_key, sizeof g->next_key, "%s", a->next_key);
        snprintf(g->prev_keys, sizeof g->prev_keys, "%s", a->prev_keys ? a->prev_keys : "");
        snprintf(g->next_keys, sizeof g->next_keys, "%s", a->next_keys ? a->next_keys : "");
        snprintf(g->next_eps, sizeof g->next_eps, "%s", a->next_endpoints ? a->next_endpoints : "");
    }
    nl_rx_free(&rx);
}

static void test_assign(void)
{
    start_coord();
    fake_open(&nodes[0], "sa", "tcp://127.0.0.1:1");
    fake_open(&nodes[1], "sb", "tcp://127.0.0.1:2");
    fake_open(&nodes[2], "sc", "tcp://127.0.0.1:3");
    for (int i = 0; i < 3; i++)
        join_flags(&nodes[i], 0);
    got g[3];
    for (int i = 0; i < 3; i++)
        take_assign(&nodes[i], &g[i]);
    CHECK(coord->plan && coord->plan->n_stages == 2 && coord->plan->stages[0].n_replicas == 2 &&
              coord->plan->stages[1].n_replicas == 1,
          "the plan 2,1");
    /* the fakes by their place: stage 0 replicas 0 and 1, stage 1 */
    int r0 = -1, r1 = -1, last = -1;
    for (int i = 0; i < 3; i++) {
        if (!g[i].ok)
            continue;
        if (g[i].stage == 1)
            last = i;
        else if (g[i].replica == 0)
            r0 = i;
        else
            r1 = i;
    }
    if (r0 < 0 || r1 < 0 || last < 0) {
        CHECK(0, "places: %d %d %d", r0, r1, last);
        stop_coord();
        return;
    }
    char both_keys[128], both_eps[128];
    snprintf(both_keys, sizeof both_keys, "%s,%s", nodes[r0].key, nodes[r1].key);
    snprintf(both_eps, sizeof both_eps, "%s,%s", nodes[r0].endpoint, nodes[r1].endpoint);
    for (int k = 0; k < 2; k++) {
        const got *x = &g[k ? r1 : r0];
        CHECK(x->replicas == 2 && x->replica == (uint32_t)k && x->links == 0, "stage 0 replica %d",
              k);
        CHECK(strcmp(x->next_keys, nodes[last].key) == 0 &&
                  strcmp(x->next_eps, nodes[last].endpoint) == 0 &&
                  strcmp(x->prev_keys, nodes[last].key) == 0 &&
                  strcmp(x->next_key, nodes[last].key) == 0,
              "stage 0 replica %d: next %s at %s, prev %s", k, x->next_keys, x->next_eps,
              x->prev_keys);
    }
    const got *y = &g[last];
    CHECK(y->replicas <= 1 && y->links == 0 && strcmp(y->prev_keys, both_keys) == 0 &&
              strcmp(y->next_keys, both_keys) == 0 && strcmp(y->next_eps, both_eps) == 0 &&
              strcmp(y->prev_key, nodes[r0].key) == 0,
          "stage 1: prev %s, next %s at %s", y->prev_keys, y->next_keys, y->next_eps);
    stop_coord();
    printf("ASSIGNs of a plan 2,1: ok\n");
}

static void test_nat_refused(void)
{
    start_coord();
    fake_open(&nodes[0], "na", "tcp://127.0.0.1:1");
    fake_open(&nodes[1], "nb", "tcp://127.0.0.1:2");
    fake_open(&nodes[2], "nc", "tcp://127.0.0.1:3");
    join_flags(&nodes[0], 0);
    join_flags(&nodes[1], 0);
    join_flags(&nodes[2], NL_JOIN_NO_INBOUND);
    CHECK(CHECK_PUMP(pump_state("not enough capacity")) &&
              strstr(coord->state, "accepts no inbound connections") &&
              strstr(coord->state, "2 and 1 replicas"),
          "refused: %s", coord->state);
    CHECK(!coord->plan, "no plan");
    stop_coord();
    printf("a plan 2,1 with a node behind NAT: refused\n");
}

/* The client's next JOB_STATUS whose message holds want (others are
 * skipped): 1, its job in *job and its report (frame 0) in report. */
static int client_hears(const char *want, uint64_t *job, char *report, size_t cap)
{
    nl_rx rx;
    nl_rx_init(&rx);
    int found = 0;
    uint32_t state = NL_JOB_RUNNING;
    while (!found && state == NL_JOB_RUNNING && pump_until(&client, NL_MSG_JOB_STATUS, &rx)) {
        state = rx.msg.u.job_status.state;
        found = strstr(rx.msg.u.job_status.message, want) != NULL;
        *job = rx.msg.u.job_status.job_id;
        if (found && report)
            snprintf(report, cap, "%.*s", rx.msg.nframes ? (int)rx.msg.frames[0].len : 0,
                     rx.msg.nframes ? (const char *)rx.msg.frames[0].t.data : "");
        nl_rx_free(&rx);
        nl_rx_init(&rx);
    }
    nl_rx_free(&rx);
    return found;
}

/* f loads its stage: the coordinator's LOAD_DONE (from the seed: no
 * tensors), answered with f's own. */
static void load_done(fake *f)
{
    nl_rx rx;
    nl_rx_init(&rx);
    if (CHECK_PUMP(pump_until(f, NL_MSG_LOAD_DONE, &rx))) {
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_LOAD_DONE);
        m.u.load_done = (nl_msg_load_done){rx.msg.u.load_done.epoch, f->id, 0, 1000};
        fake_send(f, &m);
    }
    nl_rx_free(&rx);
}

static void send_train(fake *f, nl_msg_type type, uint64_t job, uint32_t stage)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, type);
    if (type == NL_MSG_GRAD_NORM)
        m.u.grad_norm = (nl_msg_grad_norm){job, 1, stage, 1.0};
    else
        m.u.loss = (nl_msg_loss){job, 1, false, 10.0, 0.5, 32};
    fake_send(f, &m);
}

/* The salvage of the step under way that fails (the checkpoint's path it
 * asked for: want). */
static void test_salvage_fails(void)
{
    start_coord();
    fake_open(&nodes[0], "va", "tcp://127.0.0.1:1");
    fake_open(&nodes[1], "vb", "tcp://127.0.0.1:2");
    fake_open(&nodes[2], "vc", "tcp://127.0.0.1:3");
    fake_open(&client, "vclient", "");
    for (int i = 0; i < 3; i++)
        join_flags(&nodes[i], 0);
    got g[3];
    int r0 = -1, r1 = -1, last = -1;
    for (int i = 0; i < 3; i++) {
        take_assign(&nodes[i], &g[i]);
        r0 = g[i].ok && g[i].stage == 0 && g[i].replica == 0 ? i : r0;
        r1 = g[i].ok && g[i].stage == 0 && g[i].replica == 1 ? i : r1;
        last = g[i].ok && g[i].stage == 1 ? i : last;
    }
    for (int i = 0; i < 3; i++)
        load_done(&nodes[i]);
    char path[600];
    snprintf(path, sizeof path, "%s/data/ok.txt", tmpdir);
    FILE *fp = fopen(path, "w");
    for (int i = 0; fp && i < 40; i++)
        fprintf(fp, "the quick brown fox %d jumps over the lazy dog\n", i);
    if (fp)
        fclose(fp);
    if (!CHECK_PUMP(pump_state("ready")) || r0 < 0 || r1 < 0 || last < 0 || !fp) {
        CHECK(0, "places: %d %d %d", r0, r1, last);
        nl_sock_destroy(&client.sock);
        stop_coord();
        return;
    }
    nl_wire_param ps[14];
    const uint32_t np = coord_fake_train_params(ps, "ok.txt", "ck", 3, 2);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_TRAIN, np, ps};
    fake_send(&client, &m);
    uint64_t job = 0, j2 = 0;
    CHECK(client_hears("starting", &job, NULL, 0), "salvage: the job did not start");
    nl_rx rx;
    nl_rx_init(&rx);
    for (int i = 0; i < 3; i++)
        CHECK_PUMP(pump_until(&nodes[i], NL_MSG_JOB_SUBMIT, &rx));
    for (int i = 0; i < 3; i++) {
        nl_wire_msg st;
        nl_wire_msg_init(&st);
        nl_wire_msg_reset(&st, NL_MSG_JOB_STATUS);
        st.u.job_status = (nl_msg_job_status){job, NL_JOB_RUNNING, 0.0, "took it", 0};
        fake_send(&nodes[i], &st);
    }
    /* step 1 begins once all took it: a microbatch to each replica of
     * stage 0; then done: each replica's GRAD_NORM, the last stage's LOSS */
    CHECK(pump_until(&nodes[r0], NL_MSG_ACTIVATION, &rx) && rx.msg.u.hop.step == 1 &&
              pump_until(&nodes[r1], NL_MSG_ACTIVATION, &rx) && rx.msg.u.hop.step == 1,
          "salvage: step 1 did not begin on both replicas of stage 0");
    send_train(&nodes[r0], NL_MSG_GRAD_NORM, job, 0);
    send_train(&nodes[r1], NL_MSG_GRAD_NORM, job, 0);
    send_train(&nodes[last], NL_MSG_GRAD_NORM, job, 1);
    send_train(&nodes[last], NL_MSG_LOSS, job, 1);
    for (int i = 0; i < 3; i++)
        CHECK(pump_until(&nodes[i], NL_MSG_STEP, &rx) && rx.msg.u.step.step == 1,
              "salvage: fake %d got no STEP 1", i);
    /* in step 2, stage 0's replica 0 falls silent */
    const uint64_t epoch = coord->epoch;
    nodes[r0].beating = 0;
    CHECK(CHECK_PUMP(pump_state("saving the step under way")) && coord->plan && !coord->ready,
          "salvage: the plan was not kept: %s", coord->state);
    const int asked[2] = {r1, last};
    for (int k = 0; k < 2; k++) {
        const int ok = pump_until(&nodes[asked[k]], NL_MSG_CKPT_REQ, &rx);
        const char *dir = ok ? rx.msg.u.ckpt_req.dir : "";
        const char *want = "/ck/step-000001.resume1";
        const size_t n = strlen(dir), w = strlen(want);
        CHECK(ok && rx.msg.u.ckpt_req.step == 1 && n > w && strcmp(dir + n - w, want) == 0,
              "salvage: %s was asked for step %llu in '%s'", k ? "stage 1" : "replica 1",
              ok ? (unsigned long long)rx.msg.u.ckpt_req.step : 0ull, dir);
    }
    /* stage 1's send of step 2 to the lost replica failed, reported
     * before the request reached it: its weights are whole, its shard is
     * still awaited */
    nl_wire_msg st;
    nl_wire_msg_init(&st);
    nl_wire_msg_reset(&st, NL_MSG_JOB_STATUS);
    st.u.job_status = (nl_msg_job_status){
        job, NL_JOB_FAILED, 0.0, "job 1 step 2: cannot reach the previous stage", NL_MSG_GRADIENT};
    fake_send(&nodes[last], &st);
    for (const double t0 = now_s(); now_s() - t0 < 0.3;) { /* the coordinator reads it */
        nl_coord_step(coord, 5);
        heartbeats();
    }
    CHECK(strncmp(coord->state, "saving", 6) == 0 && coord->plan_held,
          "salvage: a failure of the step, not of the shard, ended the save: %s", coord->state);
    /* then it cannot write it: the job resumes from step 0, the plan goes */
    nl_wire_msg_init(&st);
    nl_wire_msg_reset(&st, NL_MSG_JOB_STATUS);
    st.u.job_status =
        (nl_msg_job_status){job, NL_JOB_FAILED, 0.0, "CKPT_REQ: disk full (io)", NL_MSG_CKPT_REQ};
    fake_send(&nodes[last], &st);
    char report[2048] = "";
    CHECK(client_hears("node lost", &j2, report, sizeof report) && j2 == job,
          "salvage: no loss reported");
    json_t *o = json_loads(report, 0, NULL);
    CHECK(json_integer_value(json_object_get(o, "lost_step")) == 1 &&
              json_is_integer(json_object_get(o, "resume_step")) &&
              json_integer_value(json_object_get(o, "resume_step")) == 0,
          "salvage: the job did not resume from step 0: %s", report);
    json_decref(o);
    CHECK(!coord->plan_held && coord->epoch > epoch && strncmp(coord->state, "saving", 6) != 0,
          "salvage: the plan stayed: %s", coord->state);
    nl_rx_free(&rx);
    nl_sock_destroy(&client.sock);
    stop_coord();
    printf("a replica lost mid-step, its step not saved: resumed from the source\n");
}

int main(void)
{
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_ERROR);
    nl_error err = {0};
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    test_assign();
    test_nat_refused();
    test_salvage_fails();
    nl_net_destroy(&net);
    coord_fake_add_counts(&check_pass_count, &check_fail_count);
    return check_done("test_coord_stages");
}
