/* The two-stage cluster of the coordinator's in-process tests (test_coord.c:
 * membership, plans, forward jobs and generations; test_coord_train.c:
 * training jobs): a coordinator of a 6-layer model (--min-nodes 2) in a
 * temporary state dir, two fake nodes that join and load a plan of two
 * stages, a fake client, and the forward jobs and statuses both scripts
 * use. Header-only, as check.h is: its CHECKs count in the program that
 * includes it (the fakes' own in coord_fake.c). */
#ifndef NL_TEST_COORD_HARNESS_H
#define NL_TEST_COORD_HARNESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coordinator/coord.h"
#include "net/transport.h"
#include "tests/check.h"
#include "tests/coord_fake.h"

static fake client;
static char tmpdir[256];

/* ---------------------------------------------------------------- setup */

static inline void harness_opts(nl_coord_opts *o)
{
    o->job_timeout_ms = 4 * TIMEOUT_MS; /* a loaded machine stalls the fakes for a second */
    o->max_data_total = 64 << 10;       /* issue 31: mid.txt passes it */
}

static inline void start_coord(void)
{
    coord_fake_start("coord", tmpdir, sizeof tmpdir, harness_opts);
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
static inline int take_plan(fake *f, assigned *a)
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
static inline fake *stage_of(const assigned *a, uint32_t s)
{
    for (int i = 0; i < 2; i++)
        if (a[i].stage == s)
            return &nodes[i];
    return NULL;
}

static inline int test_join_plan(assigned *a)
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

static inline void submit_forward(const int32_t *ids, int64_t B, int64_t T)
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
static inline int client_status(uint64_t *job, uint32_t *state, char *msg, size_t cap)
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

static inline void send_result(fake *f, uint64_t job, const float *logits, int64_t n)
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
static inline uint64_t start_forward(fake *first, const int32_t *ids, int T)
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

/* ---------------------------------------------------------------- statuses */

static inline void node_status(fake *f, uint64_t job, uint32_t state, const char *msg)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
    m.u.job_status = (nl_msg_job_status){job, state, 0.0, msg, 0};
    fake_send(f, &m);
}

/* Turn the loop for s seconds. */
static inline void pump_for(double s)
{
    const double t0 = now_s();
    while (now_s() - t0 < s) {
        nl_coord_step(coord, 5);
        heartbeats();
    }
}

/* Close the fakes' sockets, the coordinator and the context, and remove
 * the state dir. */
static inline void stop_coord(void)
{
    nl_sock_destroy(&client.sock);
    nl_sock_destroy(&nodes[0].sock);
    nl_sock_destroy(&nodes[1].sock);
    nl_sock_destroy(&nodes[2].sock);
    coord_fake_stop(tmpdir);
    nl_net_destroy(&net);
}

#endif
