/* Data-parallel replicas computing at the same time (node/stage_train.c,
 * node/replica_workers.c), driven in-process as the daemon drives them:
 * two pipeline stages, each with two replicas on their own backends of
 * NL_TEST_DEVICE, every message through the wire codec; in the daemon's
 * mode (train_async) the "node" waits on nl_stage_train_fd with poll() and
 * calls nl_stage_train_poll, so the replicas' threads run while hops are
 * delivered.
 *  - several steps with the threads live give every step's loss and the
 *    final weights of both stages bit-identical to the replicas run one
 *    after another on one thread (replicas_inline), in both the daemon's
 *    mode and the waiting one; and within 1e-6 of one replica per stage;
 *  - a replica whose device fails fails the job with the replica and its
 *    device named, at once (no hang), and every later message of the job
 *    gets that error; ending the job joins the threads. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/model/rng.h"
#include "net/wire.h"
#include "node/stage.h"
#include "node/stage_impl.h" /* stage_train_quiesce */
#include "tests/check.h"
#include "tests/small_config.h"
#define WIRE_FIFO_MAX 1024
#include "tests/wire_fifo.h"

#define NST 2
#define REPS 2
#define HANG_MS 30000

static nl_backend *bes[NST][REPS]; /* each stage its own: the stages' threads run at once */
static nl_config cfg;
static char *cfg_json;
static nl_stage *stages[NST];
static int idx[NST] = {0, 1};

/* ---- messages, stored encoded: one FIFO per stage and the coordinator's ---- */

static fifo q[NST], coord_q;

static nl_status bus_send(void *ctx, nl_stage_dest to, nl_wire_msg *m, nl_error *err)
{
    int s = *(int *)ctx;
    if (to == NL_STAGE_TO_COORD)
        push(&coord_q, m);
    else if (to == NL_STAGE_TO_NEXT && s + 1 < NST)
        push(&q[s + 1], m);
    else if (to == NL_STAGE_TO_PREV && s > 0)
        push(&q[s - 1], m);
    else
        return nl_error_set(err, NL_ERR_STATE, "stage %d has no such neighbour", s);
    return NL_OK;
}

/* ---- the "nodes": deliver, and poll the replicas' descriptors ---- */

/* Wait (up to HANG_MS) for a replica of any stage to finish work and let
 * its stage send what it made. Returns the first error, NL_ERR_TIMEOUT on
 * a hang, NL_ERR_STATE when no stage has work in flight. */
static nl_status wait_replicas(nl_error *err)
{
    struct pollfd pf[NST];
    int who[NST], n = 0;
    for (int s = 0; s < NST; s++) {
        const int fd = nl_stage_train_fd(stages[s]);
        if (fd >= 0) {
            pf[n] = (struct pollfd){fd, POLLIN, 0};
            who[n++] = s;
        }
    }
    if (!n)
        return nl_error_set(err, NL_ERR_STATE, "nothing in flight, nothing to deliver: stalled");
    const int r = poll(pf, (nfds_t)n, HANG_MS);
    if (r <= 0)
        return nl_error_set(err, NL_ERR_TIMEOUT, "no replica finished in %d ms", HANG_MS);
    for (int i = 0; i < n; i++)
        if (pf[i].revents & POLLIN) {
            nl_status st = nl_stage_train_poll(stages[who[i]], bus_send, &idx[who[i]], err);
            if (st != NL_OK)
                return st;
        }
    return NL_OK;
}

/* Deliver one queued message (stages in turn), or wait for the replicas.
 * The first error is returned (and where it came from in *where). */
static nl_status step_bus(int *turn, nl_error *err)
{
    nl_wire_msg m;
    packet p;
    nl_wire_msg_init(&m);
    for (int k = 0; k < NST; k++) {
        const int s = (*turn + k) % NST;
        if (!pop(&q[s], &m, &p))
            continue;
        *turn = s + 1;
        nl_status st = nl_stage_job_input(stages[s], &m, bus_send, &idx[s], err);
        packet_free(&p);
        nl_wire_msg_free(&m);
        return st;
    }
    nl_wire_msg_free(&m);
    return wait_replicas(err);
}

/* ---- training runs ---- */

static void make_stages(int reps, bool async, bool inline_reps)
{
    nl_error err;
    const int bounds[NST + 1] = {0, 1, 2};
    for (int s = 0; s < NST; s++) {
        nl_stage_opts o = {.memory_bytes = 1ULL << 30,
                           .kv_budget = 1 << 20,
                           .send_wait_ms = 100,
                           .ckpt_root = "/nonexistent-root",
                           .train_async = async,
                           .replicas_inline = inline_reps};
        CHECK_OK(nl_stage_new_replicas(&stages[s], bes[s], reps, NULL, &o, &err), &err);
        nl_msg_assign a = {.epoch = 1,
                           .node_id = 1,
                           .stage = (uint32_t)s,
                           .num_stages = NST,
                           .layer0 = (uint32_t)bounds[s],
                           .layer1 = (uint32_t)bounds[s + 1],
                           .has_embed = s == 0,
                           .has_head = s + 1 == NST,
                           .config_json = cfg_json,
                           .seed = 5,
                           .prev_endpoint = "",
                           .prev_key = "",
                           .next_endpoint = "",
                           .next_key = ""};
        nl_stage_loaded info;
        bool stale;
        CHECK_OK(nl_stage_assign(stages[s], &a, &err), &err);
        CHECK_OK(nl_stage_load_done(stages[s], 1, 0, &info, &stale, &err), &err);
    }
}

static void begin_job(uint64_t job, int mbB, int T, int M)
{
    nl_wire_param ps[4] = {
        {.key = "job", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)job},
        {.key = "micro_batch", .kind = NL_WIRE_PARAM_INT, .i = mbB},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = T},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = M},
    };
    nl_msg_job_submit j = {NL_JOB_TRAIN, 4, ps};
    for (int s = 0; s < NST; s++) {
        uint64_t id = 0;
        nl_error err;
        CHECK_OK(nl_stage_job_begin(stages[s], &j, &id, NULL, &err), &err);
    }
}

/* The coordinator's hops of one step to stage 0: the counting pass, then
 * the forwards, as neurocoord sends them. */
static void feed_step(uint64_t job, uint64_t step, int M, int mbB, int T, nl_rng *data)
{
    const int n = mbB * T;
    int32_t *tok = malloc((size_t)n * M * sizeof *tok), *tgt = malloc((size_t)n * M * sizeof *tgt);
    for (int i = 0; i < n * M; i++) {
        tok[i] = (int32_t)nl_rng_below(data, 40); /* a rule to learn: the next id */
        tgt[i] = tok[i] + 1;
    }
    const int64_t sh[2] = {mbB, T};
    for (int pass = 0; pass < 2; pass++)
        for (int mb = 0; mb < M; mb++) {
            nl_wire_msg m;
            nl_wire_msg_init(&m);
            nl_wire_msg_reset(&m, pass ? NL_MSG_ACTIVATION : NL_MSG_COUNT);
            m.u.hop = (nl_msg_tensor_hop){job, step, (uint32_t)mb, 0, 0, 0.0};
            nl_wire_frame_set(&m.frames[0], tok + (size_t)mb * n, NL_DTYPE_I32, sh, 2);
            m.nframes = 1;
            if (pass) {
                nl_wire_frame_set(&m.frames[1], tgt + (size_t)mb * n, NL_DTYPE_I32, sh, 2);
                m.nframes = 2;
            }
            push(&q[0], &m);
            nl_wire_msg_free(&m);
        }
    free(tok);
    free(tgt);
}

typedef struct run_result {
    double loss[8], norm[8];
    float *w[NST]; /* final weights (host) */
    size_t nw[NST];
} run_result;

/* Train `steps` steps of M microbatches on NST stages of `reps` replicas. */
static void train(int reps, bool async, bool inline_reps, int steps, run_result *r)
{
    nl_error err;
    const uint64_t job = 3;
    const int mbB = 2, T = 8, M = 4;
    nl_rng data;
    nl_rng_seed(&data, 77, 0);
    memset(r, 0, sizeof *r);
    make_stages(reps, async, inline_reps);
    begin_job(job, mbB, T, M);
    int turn = 0;
    for (int step = 1; step <= steps; step++) {
        feed_step(job, (uint64_t)step, M, mbB, T, &data);
        int norms = 0, loss = 0;
        r->norm[step - 1] = 0.0;
        while (norms < NST || !loss) {
            nl_status st = step_bus(&turn, &err);
            CHECK(st == NL_OK, "step %d (%d replicas%s): %s", step, reps, async ? ", async" : "",
                  err.msg);
            if (st != NL_OK)
                goto out;
            nl_wire_msg m;
            packet p;
            nl_wire_msg_init(&m);
            while (pop(&coord_q, &m, &p)) {
                if (m.type == NL_MSG_GRAD_NORM) {
                    r->norm[step - 1] += m.u.grad_norm.sumsq;
                    norms++;
                } else if (m.type == NL_MSG_LOSS) {
                    r->loss[step - 1] = m.u.loss.ce_sum / (double)m.u.loss.rows;
                    loss = 1;
                }
                packet_free(&p);
            }
            nl_wire_msg_free(&m);
        }
        for (int s = 0; s < NST; s++) { /* the coordinator's STEP */
            nl_wire_msg m;
            nl_wire_msg_init(&m);
            nl_wire_msg_reset(&m, NL_MSG_STEP);
            m.u.step = (nl_msg_step){job, (uint64_t)step, true, 1.0, 3e-3};
            push(&q[s], &m);
            nl_wire_msg_free(&m);
        }
    }
    /* the last STEPs delivered; the weights read once the lanes are idle */
    while (q[0].len || q[1].len)
        if (step_bus(&turn, &err) != NL_OK) {
            CHECK(0, "the last STEP: %s", err.msg);
            break;
        }
    for (int s = 0; s < NST; s++) {
        stage_train_quiesce(stages[s]); /* AdamW done (ending drops queued work) */
        CHECK(nl_stage_job_end(stages[s], job) >= 0, "stage %d: the job ended", s);
        const nl_model *m = nl_stage_model(stages[s]);
        r->w[s] = check_download(bes[s][0], m->params, m->n_params);
        r->nw[s] = m->n_params;
    }
out:
    for (int s = 0; s < NST; s++) {
        nl_stage_destroy(&stages[s]);
        fifo_clear(&q[s]);
    }
    fifo_clear(&coord_q);
}

static void free_result(run_result *r)
{
    for (int s = 0; s < NST; s++)
        free(r->w[s]);
}

static bool same_bits(const run_result *a, const run_result *b, int steps)
{
    if (memcmp(a->loss, b->loss, (size_t)steps * sizeof a->loss[0]) != 0 ||
        memcmp(a->norm, b->norm, (size_t)steps * sizeof a->norm[0]) != 0)
        return false;
    for (int s = 0; s < NST; s++)
        if (!a->w[s] || !b->w[s] || a->nw[s] != b->nw[s] ||
            memcmp(a->w[s], b->w[s], a->nw[s] * sizeof(float)) != 0)
            return false;
    return true;
}

static void threads_agree(void)
{
    const int steps = 5;
    run_result seq, thr, wait, one;
    train(REPS, false, true, steps, &seq);   /* one after another on this thread */
    train(REPS, true, false, steps, &thr);   /* the daemon's mode: threads, poll */
    train(REPS, false, false, steps, &wait); /* threads, each input waits for them */
    train(1, false, false, steps, &one);
    CHECK(same_bits(&thr, &seq, steps),
          "threads (async) against one after another: not bit-identical");
    CHECK(same_bits(&wait, &seq, steps),
          "threads (waiting) against one after another: not bit-identical");
    double worst = 0.0;
    for (int i = 0; i < steps; i++) {
        const double e = fabs(thr.loss[i] - one.loss[i]) / fmax(fabs(one.loss[i]), 1e-30);
        worst = fmax(worst, e);
        CHECK(e <= 1e-6, "step %d: loss %.9g with %d replicas, %.9g with one", i + 1, thr.loss[i],
              REPS, one.loss[i]);
        const double en = fabs(thr.norm[i] - one.norm[i]) / fmax(fabs(one.norm[i]), 1e-30);
        worst = fmax(worst, en);
        CHECK(en <= 1e-6, "step %d: gradient norm %.9g with %d replicas, %.9g with one", i + 1,
              thr.norm[i], REPS, one.norm[i]);
    }
    CHECK(thr.loss[steps - 1] < thr.loss[0], "the loss did not fall: %g to %g", thr.loss[0],
          thr.loss[steps - 1]);
    printf("%d stages x %d replicas on threads, %d steps: bit-identical to one thread; loss %.6f "
           "to %.6f, worst relative difference from one replica %.2e\n",
           NST, REPS, steps, thr.loss[0], thr.loss[steps - 1], worst);
    free_result(&seq);
    free_result(&thr);
    free_result(&wait);
    free_result(&one);
}

/* ---- a replica's device fails ---- */

static nl_status broken_check(nl_backend *be, nl_error *err)
{
    return nl_error_set(err, NL_ERR_INTERNAL, "%s: injected fault", be->name);
}

static void replica_fails(void)
{
    nl_error err;
    const uint64_t job = 4;
    nl_rng data;
    nl_rng_seed(&data, 1, 0);
    make_stages(REPS, true, false);
    begin_job(job, 2, 8, 4);
    nl_backend *bad = bes[1][1];
    nl_status (*check)(nl_backend *, nl_error *) = bad->check;
    bad->check = broken_check;
    feed_step(job, 1, 4, 2, 8, &data);
    nl_status st = NL_OK;
    int turn = 0, rounds = 0;
    while (st == NL_OK && rounds++ < 10000)
        st = step_bus(&turn, &err);
    CHECK(st == NL_ERR_INTERNAL && strstr(err.msg, "replica 1") && strstr(err.msg, bad->name) &&
              strstr(err.msg, "injected fault"),
          "a failed replica: %s (%s)", err.msg, nl_status_str(st));
    printf("a failed replica: %s\n", err.msg);
    /* the job's next message on that stage gets the same error */
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_STEP);
    m.u.step = (nl_msg_step){job, 1, true, 1.0, 1e-3};
    nl_error e2;
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &idx[1], &e2) != NL_OK &&
              strstr(e2.msg, "replica 1"),
          "after the failure: %s", e2.msg);
    nl_wire_msg_free(&m);
    bad->check = check;
    for (int s = 0; s < NST; s++) {
        CHECK(nl_stage_job_end(stages[s], job) >= 0, "stage %d: the job ended", s);
        nl_stage_destroy(&stages[s]);
        fifo_clear(&q[s]);
    }
    fifo_clear(&coord_q);
}

int main(void)
{
    nl_error err;
    nl_log_set_name("test_replica_threads");
    nl_log_set_level(NL_LOG_OFF);
    check_small_config(&cfg, 2);
    CHECK_OK(nl_config_validate(&cfg, 1, &err), &err);
    cfg_json = nl_config_to_json(&cfg);
    bool ok = cfg_json != NULL;
    for (int s = 0; s < NST; s++)
        for (int r = 0; r < REPS; r++) {
            CHECK_OK(check_backend_new(&bes[s][r], 1, &err), &err);
            ok = ok && bes[s][r];
        }
    if (ok) {
        threads_agree();
        replica_fails();
    }
    for (int s = 0; s < NST; s++)
        for (int r = 0; r < REPS; r++)
            nl_backend_destroy(&bes[s][r]);
    free(cfg_json);
    return check_done("test_replica_threads");
}
