/* Unit tests of node/stage_train: distributed training on stages in one
 * process, without sockets. Every message a stage sends goes through the
 * real wire codec (encoded, then decoded on delivery) into the queue of the
 * socket it would travel on; a test "coordinator" feeds the microbatches,
 * sums the gradient norms and decides each step as neurocoord does.
 * Deliveries from different sockets are interleaved at random, so hops of
 * the next step overtake the STEP of this one.
 *
 *  - parity: 3 stages with M = 4 microbatches (1F1B, counting pass), with
 *    M = 1, and with recompute, against nl_trainer_step_local on the whole
 *    model: every step's loss and the final weights agree within 1e-5;
 *  - evaluation through the pipeline equals the local held-out loss;
 *  - the guard: a NaN in one stage's gradient skips the step everywhere;
 *  - refusals: hops of a wrong shape, step or job, a GRADIENT out of
 *    order, a CKPT_REQ outside --checkpoint-root;
 *  - a stage whose send to the next stage failed mid-step (its node
 *    died) refuses every later hop, but still writes its shard of the
 *    steps done (the coordinator saves the step under way: docs/cluster.md
 *    "A replica's node dies"), and no other step's;
 *  - neighbours with other replica counts (ASSIGN prev_keys, next_keys):
 *    hops and gradients delivered in any order give the in-order run's
 *    losses and norms to the bit;
 *  - data-parallel replicas (nl_stage_new_replicas, 2 and 3 backends of
 *    NL_TEST_DEVICE per stage, host all-reduce): the same pipeline and
 *    batches give every step's loss and gradient norm within 1e-6 of the
 *    single-replica run (and the local one within 1e-5), with 1F1B, one
 *    microbatch (an idle replica), recompute and the NaN guard;
 *  - hop digests (net/hopdigest.h): every stage reports with its GRAD_NORM
 *    the digests of the step's hops it received and sent; the sender's
 *    and the receiver's agree on every hop, two runs give the same ones,
 *    stage 0's are those of what it was fed, and a hop whose bytes do not
 *    match its digest is refused (NL_ERR_INTEGRITY);
 *  - the lying stage of the test hook (NL_TEST_HOOKS builds): each kind
 *    changes what it sends on some microbatches (its digests there differ
 *    from the honest run's) while its neighbours still agree with it.
 *
 * The harness (the message bus, the stages, digest_run) is
 * stage_train_harness.h's; verification by recompute on these pipelines is
 * test_stage_verify.c's. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "core/model/rng.h"
#include "core/train/train.h"
#include "net/hopdigest.h"
#include "net/wire.h"
#include "node/stage.h"
#include "tests/check.h"
#include "tests/stage_train_harness.h"

/* Train `steps` steps of B x T in M microbatches on NST stages of
 * `replicas` replicas each and on the whole model in one process; compare.
 * inject: 1-based step with a NaN on stage 1 (0: none). The pipeline's
 * loss and gradient norm of each step go to losses[] and norms[] (NaN when
 * skipped; may be NULL). */
static void parity(int B, int T, int M, int steps, int64_t inject, bool recompute, int replicas,
                   double *losses, double *norms)
{
    nl_error err;
    const int bounds[NST + 1] = {0, 1, 2, 3};
    const int mbB = B / M, rows = mbB * T;
    const uint64_t job = 42;
    const float lr = 3e-3f;
    nl_rng_seed(&data_rng, 1234, 0);
    make_stages(NST, bounds, inject, 1, replicas);
    begin_job(NST, job, mbB, T, M, M, recompute);
    nl_model *whole = NULL;
    nl_trainer *tr = NULL;
    CHECK_OK(nl_model_new(&whole, be, &cfg, 0, cfg.num_layers, 1, 1, &err), &err);
    CHECK_OK(nl_model_init_random(whole, SEED, &err), &err);
    CHECK_OK(nl_trainer_new(&tr, whole, rows, 1, 0, &err), &err);
    int32_t *tok = malloc((size_t)B * T * sizeof *tok), *tgt = malloc((size_t)B * T * sizeof *tgt);
    double worst = 0.0;
    for (int step = 1; step <= steps && tr; step++) {
        random_batch(tok, tgt, B * T);
        nl_step_result r;
        if (step == inject)
            nl_trainer_inject_nan(tr);
        CHECK_OK(
            nl_trainer_step_local(tr, tok, tgt, B, T, M, lr, 1.0f, nl_adamw_defaults(), &r, &err),
            &err);
        for (int mb = 0; M > 1 && mb < M; mb++)
            feed(job, NL_MSG_COUNT, (uint64_t)step, (uint32_t)mb, tok + mb * rows, NULL, mbB, T);
        for (int mb = 0; mb < M; mb++)
            feed(job, NL_MSG_ACTIVATION, (uint64_t)step, (uint32_t)mb, tok + mb * rows,
                 tgt + mb * rows, mbB, T);
        pump(NST);
        coord_step cs = {0};
        read_reports(&cs, (uint64_t)step);
        CHECK(cs.norms == NST && cs.have_loss, "step %d: %d norms, loss %d", step, cs.norms,
              cs.have_loss);
        const double loss = cs.ce / ((double)B * T) + cfg.aux_loss_coef * cs.aux;
        const int skip = !isfinite(loss) || !isfinite(cs.sumsq);
        if (losses)
            losses[step - 1] = skip ? NAN : loss;
        if (norms)
            norms[step - 1] = skip ? NAN : sqrt(cs.sumsq);
        CHECK(skip == r.skipped, "step %d: skipped %d here, %d locally", step, skip, r.skipped);
        if (!skip) {
            const double rel = fabs(loss - r.loss) / fabs(r.loss);
            worst = rel > worst ? rel : worst;
            CHECK(rel < 1e-5, "step %d: loss %.9g vs local %.9g", step, loss, r.loss);
            CHECK(fabs(sqrt(cs.sumsq) - r.grad_norm) <= 1e-4 * r.grad_norm,
                  "step %d: grad norm %.9g vs %.9g", step, sqrt(cs.sumsq), r.grad_norm);
        }
        const double norm = sqrt(cs.sumsq), clip = 1.0 / (norm + 1e-6);
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_STEP);
        m.u.step =
            (nl_msg_step){job, (uint64_t)step, !skip, skip ? 0.0 : (clip < 1 ? clip : 1), lr};
        for (int s = 0; s < NST; s++)
            push(&stage_q[s][Q_CTL], &m);
        nl_wire_msg_free(&m);
        /* the next step's hops now race the STEP on the later stages */
    }
    pump(NST);
    /* an evaluation through the pipeline equals the local held-out loss */
    random_batch(tok, tgt, B * T);
    double local_ce = 0.0;
    nl_trainer_begin_step(tr, (int64_t)B * T);
    for (int mb = 0; mb < M; mb++)
        CHECK_OK(nl_trainer_forward(tr, 0, mbB, T, tok + mb * rows, NULL, tgt + mb * rows,
                                    &local_ce, NULL, &err),
                 &err);
    for (int mb = 0; mb < M; mb++)
        feed(job, NL_MSG_EVAL, (uint64_t)steps, (uint32_t)mb, tok + mb * rows, tgt + mb * rows, mbB,
             T);
    pump(NST);
    coord_step cs = {0};
    read_reports(&cs, (uint64_t)steps);
    CHECK(cs.have_eval && fabs(cs.eval_ce - local_ce) <= 1e-5 * local_ce,
          "eval ce %.9g vs local %.9g", cs.eval_ce, local_ce);
    /* the weights */
    double wrst = 0.0;
    for (int s = 0; s < NST; s++) {
        const nl_model *m = nl_stage_model(stages[s]);
        for (int i = 0; m && i < m->n_table; i++) {
            const nl_param *p = &m->table[i];
            const nl_param *q = nl_model_find_param(whole, p->name);
            const size_t n = nl_param_numel(p);
            float *got = check_download(be, nl_model_param_data(m, p), n);
            float *want = q ? check_download(be, nl_model_param_data(whole, q), n) : NULL;
            double e = got && want ? check_rel_err(got, want, n) : 1.0;
            free(got);
            free(want);
            wrst = e > wrst ? e : wrst;
            /* one replica adds the microbatches' gradients in the whole
             * model's order: bit for bit (DESIGN 8). Replicas add their
             * sums in replica order, which rounds otherwise, and AdamW
             * amplifies that where a gradient nearly cancels over the
             * steps (its update is lr m / sqrt(v)); the losses, which
             * DESIGN holds within 1e-6, are checked above */
            CHECK(replicas == 1 ? e == 0.0 : e < 3e-5, "%s: relative error %g (%d replicas)",
                  p->name, e, replicas);
        }
    }
    printf("parity M=%d%s%s, %d replica%s: worst loss rel err %.2e, weights %.2e\n", M,
           inject ? " (NaN injected)" : "", recompute ? " (recompute)" : "", replicas,
           replicas == 1 ? "" : "s", worst, wrst);
    free(tok);
    free(tgt);
    nl_trainer_destroy(&tr);
    nl_model_destroy(&whole);
    free_stages(NST);
}

/* Issue 15, finding 9: a previous stage that floods hops. Hidden states
 * for a step past the next one are refused; for the next step, with an
 * evaluation of 2^30 hops allowed (the count bound is then no bound), the
 * queue stops at its byte bound (64 MiB) instead of exhausting memory. */
static void flood(void)
{
    nl_error err;
    const int bounds[NST + 1] = {0, 1, 2, 3};
    const uint64_t job = 7;
    make_stages(NST, bounds, 0, -1, 1);
    begin_job(NST, job, 2, 4, 2, 1 << 30, false);
    static float x[2 * 4 * 32];
    static int32_t tgt[8];
    const int64_t xs[3] = {2, 4, cfg.hidden_dim}, ts[2] = {2, 4};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){job, 3, 0, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], x, NL_DTYPE_F32, xs, 3);
    nl_wire_frame_set(&m.frames[1], tgt, NL_DTYPE_I32, ts, 2);
    m.frames[0].len = (size_t)(8 * cfg.hidden_dim) * sizeof(float);
    m.frames[1].len = sizeof tgt;
    m.nframes = 2;
    CHECK(cfg.hidden_dim <= 32, "hidden_dim %d", cfg.hidden_dim);
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_STATE &&
              strstr(err.msg, "ahead"),
          "a hop two steps ahead: %s", err.msg);
    m.u.hop.step = 2; /* the step after the next: may overtake a STEP, and waits */
    x[5] = NAN;
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_RANGE &&
              strstr(err.msg, "non-finite"),
          "a NaN in the hidden states: %s", err.msg);
    x[5] = 0.0f;
    nl_status st = NL_OK;
    int n = 0;
    while (n < 200000 &&
           (st = nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err)) == NL_OK)
        n++;
    CHECK(st == NL_ERR_LIMIT && strstr(err.msg, "bytes") && n > 1000 && n < 70000,
          "a flood of %d hops: %s", n, st == NL_OK ? "accepted" : err.msg);
    nl_wire_msg_free(&m);
    free_stages(NST);
}

static void refusals(void)
{
    nl_error err;
    const int bounds[NST + 1] = {0, 1, 2, 3};
    const uint64_t job = 5;
    make_stages(NST, bounds, 0, -1, 1);
    begin_job(NST, job, 2, 4, 2, 0, false);
    int32_t tok[12] = {0}, tgt[12] = {0};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    const int64_t bad[2] = {3, 4}, ok[2] = {2, 4};
    /* wrong shape */
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){job, 1, 0, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], tok, NL_DTYPE_I32, bad, 2);
    nl_wire_frame_set(&m.frames[1], tgt, NL_DTYPE_I32, bad, 2);
    m.nframes = 2;
    m.frames[0].len = m.frames[1].len = 3 * 4 * sizeof(int32_t); /* tok and tgt are big enough */
    CHECK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_SHAPE,
          "wrong shape: %s", err.msg);
    /* another job */
    nl_wire_frame_set(&m.frames[0], tok, NL_DTYPE_I32, ok, 2);
    nl_wire_frame_set(&m.frames[1], tgt, NL_DTYPE_I32, ok, 2);
    m.frames[0].len = m.frames[1].len = 8 * sizeof(int32_t);
    m.u.hop.job_id = 6;
    CHECK(!nl_stage_job_holds(stages[0], &m) &&
              nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_STATE &&
              strstr(err.msg, "job 6"),
          "another job (stale): %s", err.msg);
    /* this job's hop from a former plan (epoch 0 of make_stages' 1 is an
     * unstamped hop, taken): not held, so the node drops it */
    m.u.hop.job_id = job;
    m.u.train_hop.epoch = 2;
    CHECK(!nl_stage_job_holds(stages[0], &m) &&
              nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_STATE &&
              strstr(err.msg, "epoch 2"),
          "a former plan's hop: %s", err.msg);
    m.u.train_hop.epoch = 1;
    CHECK(nl_stage_job_holds(stages[0], &m), "this plan's hop is held");
    m.u.train_hop.epoch = 0;
    /* microbatch out of range */
    m.u.hop.job_id = job;
    m.u.hop.step = 1;
    m.u.hop.microbatch = 2;
    CHECK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_RANGE,
          "microbatch 2 of 2: %s", err.msg);
    /* the counting pass of microbatch 1 before 0: refused */
    m.type = NL_MSG_COUNT;
    m.u.hop.microbatch = 1;
    CHECK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_STATE &&
              strstr(err.msg, "next is 0"),
          "out of order: %s", err.msg);
    m.type = NL_MSG_ACTIVATION;
    /* a GRADIENT before any forward */
    float g[2 * 4 * 32] = {0};
    const int64_t gs[3] = {2, 4, 32};
    nl_wire_msg_reset(&m, NL_MSG_GRADIENT);
    m.u.hop = (nl_msg_tensor_hop){job, 1, 0, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], g, NL_DTYPE_F32, gs, 3);
    m.frames[0].len = sizeof g;
    m.nframes = 1;
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_STATE,
          "early GRADIENT: %s", err.msg);
    /* a STEP before the gradients */
    nl_wire_msg_reset(&m, NL_MSG_STEP);
    m.u.step = (nl_msg_step){job, 1, true, 1.0, 1e-3};
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_STATE,
          "early STEP: %s", err.msg);
    /* checkpoints outside --checkpoint-root, or with .. */
    nl_wire_msg_reset(&m, NL_MSG_CKPT_REQ);
    m.u.ckpt_req = (nl_msg_ckpt_req){job, 0, "/tmp/elsewhere"};
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_AUTH &&
              strstr(err.msg, "checkpoint-root"),
          "outside the root: %s", err.msg);
    m.u.ckpt_req.dir = "/nonexistent-root/../etc";
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_INVALID,
          "dot-dot: %s", err.msg);
    /* moments asked for but none loaded */
    nl_wire_param ps[5] = {
        {.key = "job", .kind = NL_WIRE_PARAM_INT, .i = 9},
        {.key = "micro_batch", .kind = NL_WIRE_PARAM_INT, .i = 2},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 4},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "moments", .kind = NL_WIRE_PARAM_BOOL, .b = true},
    };
    nl_msg_job_submit j = {NL_JOB_TRAIN, 5, ps};
    uint64_t id = 0;
    CHECK(nl_stage_job_begin(stages[0], &j, &id, NULL, &err) == NL_ERR_STATE && id == 9,
          "moments without any: %s", err.msg);
    ps[4].key = "seq";
    ps[4].kind = NL_WIRE_PARAM_INT;
    ps[4].i = cfg.max_seq_len + 1;
    j.nparams = 4;
    ps[2] = ps[4];
    CHECK(nl_stage_job_begin(stages[0], &j, &id, NULL, &err) == NL_ERR_RANGE, "seq past max: %s",
          err.msg);
    CHECK(nl_stage_job_end(stages[0], job) >= 0, "a refused begin dropped the running job");
    CHECK(nl_stage_job_end(stages[1], job) >= 0 && !nl_stage_train_running(stages[1], NULL),
          "end of the job");
    nl_wire_msg_free(&m);
    free_stages(NST);
    flood();
}

/* Hops and gradients from neighbours with other replica counts come in
 * any order: each stage runs them in microbatch order (a gradient before
 * its turn waits), so every step's loss and gradient norm are those of
 * the run in order, to the bit. */
static void shard_after_lost_neighbour(void)
{
    const int bounds[NST + 1] = {0, 1, 2, 3}, mbB = 2, T = 4, M = 2, rows = mbB * T;
    const uint64_t job = 7;
    char root[] = "/tmp/nl_test_stage_ckpt_XXXXXX", dir[128], path[200];
    nl_error err;
    if (!mkdtemp(root)) {
        CHECK(0, "mkdtemp");
        return;
    }
    ckpt_root = root;
    nl_rng_seed(&data_rng, 77, 0);
    make_stages(NST, bounds, 0, -1, 1);
    begin_job(NST, job, mbB, T, M, 0, false);
    int32_t tok[2 * 2 * 4], tgt[2 * 2 * 4];
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (uint64_t step = 1; step <= 2; step++) {
        random_batch(tok, tgt, M * rows);
        for (int mb = 0; mb < M; mb++)
            feed(job, NL_MSG_COUNT, step, (uint32_t)mb, tok + mb * rows, NULL, mbB, T);
        for (int mb = 0; mb < M; mb++)
            feed(job, NL_MSG_ACTIVATION, step, (uint32_t)mb, tok + mb * rows, tgt + mb * rows, mbB,
                 T);
        if (step == 2)
            break;
        pump(NST);
        coord_step cs = {0};
        read_reports(&cs, step);
        nl_wire_msg_reset(&m, NL_MSG_STEP);
        m.u.step = (nl_msg_step){job, step, true, 1.0, 1e-3};
        for (int s = 0; s < NST; s++)
            push(&stage_q[s][Q_CTL], &m);
        pump(NST);
    }
    /* step 2: stage 0's first send to the next stage fails */
    next_gone = 0;
    nl_status first = NL_OK, st;
    packet p;
    while (pop(&stage_q[0][Q_CTL], &m, &p)) {
        st = nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err);
        if (first == NL_OK && st != NL_OK) {
            first = st;
            CHECK(strstr(err.msg, "peer is gone"), "the failed send: %s", err.msg);
        } else if (first != NL_OK) {
            CHECK(st != NL_OK && strstr(err.msg, "peer is gone"),
                  "a hop after the failed send was taken: %s", err.msg);
        }
        packet_free(&p);
    }
    CHECK(first != NL_OK, "no send failed");
    next_gone = -1;
    /* the shard of step 1 is written all the same; one of step 2 is not */
    snprintf(dir, sizeof dir, "%s/step-000001.resume1", root);
    nl_wire_msg_reset(&m, NL_MSG_CKPT_REQ);
    m.u.ckpt_req = (nl_msg_ckpt_req){job, 1, dir};
    CHECK_OK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err), &err);
    snprintf(path, sizeof path, "%s/stage-0.safetensors", dir);
    CHECK(access(path, R_OK) == 0, "no shard at %s", path);
    int done = 0;
    while (pop(&coord_q, &m, &p)) {
        done += m.type == NL_MSG_CKPT_DONE && m.u.ckpt_done.step == 1 && m.u.ckpt_done.stage == 0 &&
                strcmp(m.u.ckpt_done.path, path) == 0;
        packet_free(&p);
    }
    CHECK(done == 1, "CKPT_DONE of step 1: %d", done);
    nl_wire_msg_reset(&m, NL_MSG_CKPT_REQ);
    m.u.ckpt_req = (nl_msg_ckpt_req){job, 2, dir};
    CHECK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_STATE &&
              strstr(err.msg, "1 steps are applied"),
          "a shard of step 2: %s", err.msg);
    nl_wire_msg_free(&m);
    for (int s = 0; s < NST; s++) /* what the others sent meanwhile */
        for (int k = 0; k < Q_KINDS; k++)
            fifo_clear(&stage_q[s][k]);
    free_stages(NST);
    ckpt_root = "/nonexistent-root";
    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    CHECK(system(cmd) == 0, "%s", cmd);
}

static void fans_in_any_order(int B, int T, int M, int steps)
{
    double l0[8], n0[8], l1[8], n1[8];
    parity(B, T, M, steps, 0, false, 1, l0, n0);
    fans = true;
    parity(B, T, M, steps, 0, false, 1, l1, n1);
    fans = false;
    int same = 1;
    for (int k = 0; k < steps; k++)
        same &= l0[k] == l1[k] && n0[k] == n1[k];
    CHECK(same, "hops in any order changed a loss or norm");
    printf("hops and gradients in any order, M=%d: every step's loss the same bits\n", M);
}

/* The same pipeline and batches on 1 and on `replicas` replicas per stage:
 * every step's loss and gradient norm within 1e-6 (relative). */
static void replicas_agree(int B, int T, int M, int steps, int64_t inject, bool recompute,
                           int replicas)
{
    double l1[8], n1[8], lr[8], nr[8];
    parity(B, T, M, steps, inject, recompute, 1, l1, n1);
    parity(B, T, M, steps, inject, recompute, replicas, lr, nr);
    double worst = 0.0;
    for (int i = 0; i < steps; i++) {
        CHECK(isnan(l1[i]) == isnan(lr[i]), "step %d: skipped with 1 replica %d, with %d %d", i + 1,
              isnan(l1[i]), replicas, isnan(lr[i]));
        if (isnan(l1[i]) || isnan(lr[i]))
            continue;
        const double el = fabs(lr[i] - l1[i]) / fabs(l1[i]), en = fabs(nr[i] - n1[i]) / n1[i];
        worst = el > worst ? el : worst;
        worst = en > worst ? en : worst;
        CHECK(el <= 1e-6, "step %d, %d replicas: loss %.9g vs %.9g with one (%.2e)", i + 1,
              replicas, lr[i], l1[i], el);
        CHECK(en <= 1e-6, "step %d, %d replicas: gradient norm %.9g vs %.9g with one (%.2e)", i + 1,
              replicas, nr[i], n1[i], en);
    }
    printf("replicas M=%d%s%s: %d replicas against 1, worst relative difference %.2e\n", M,
           inject ? " (NaN injected)" : "", recompute ? " (recompute)" : "", replicas, worst);
}

/* The reports of one step agree: each hop's digest at its sender is the
 * one at its receiver, those that exist are set and the others zero;
 * stage 0's inputs are what was fed. */
static void digests_agree(const uint8_t *d, const uint8_t *fed, int M, int step)
{
    static const uint8_t zero[NL_HOP_DIGEST_BYTES];
    for (int mb = 0; mb < M; mb++) {
        for (int s = 0; s < NST; s++) {
            const uint8_t *g = d + (size_t)s * sizeof dig_got[0];
            const bool first = s == 0, last = s == NST - 1;
            CHECK(!nl_hop_digest_none(dig_at(g, mb, NL_DIGEST_FWD_IN)) &&
                      nl_hop_digest_none(dig_at(g, mb, NL_DIGEST_FWD_OUT)) == last &&
                      nl_hop_digest_none(dig_at(g, mb, NL_DIGEST_BWD_IN)) == last &&
                      nl_hop_digest_none(dig_at(g, mb, NL_DIGEST_BWD_OUT)) == first,
                  "step %d stage %d microbatch %d: digests missing or where no hop was", step, s,
                  mb);
            if (last)
                continue;
            const uint8_t *h = g + sizeof dig_got[0];
            CHECK(memcmp(dig_at(g, mb, NL_DIGEST_FWD_OUT), dig_at(h, mb, NL_DIGEST_FWD_IN), 32) ==
                          0 &&
                      memcmp(dig_at(h, mb, NL_DIGEST_BWD_OUT), dig_at(g, mb, NL_DIGEST_BWD_IN),
                             32) == 0,
                  "step %d microbatch %d: stages %d and %d report other digests of their hops",
                  step, mb, s, s + 1);
        }
        CHECK(memcmp(dig_at(d, mb, NL_DIGEST_FWD_IN), fed + (size_t)mb * 32, 32) == 0 &&
                  memcmp(zero, fed + (size_t)mb * 32, 32) != 0,
              "step %d microbatch %d: stage 0's input digest is not that of what it was fed", step,
              mb);
    }
}

static void digests(void)
{
    enum { STEPS = 3, M = 4 };
    const size_t per = sizeof dig_got, fper = (size_t)M * NL_HOP_DIGEST_BYTES;
    uint8_t *a = calloc(STEPS, per), *b = calloc(STEPS, per), *fa = calloc(STEPS, fper),
            *fb = calloc(STEPS, fper);
    if (!a || !b || !fa || !fb) {
        CHECK(0, "out of memory");
        goto out;
    }
    lie_stage = -1;
    digest_run(STEPS, M, a, fa);
    digest_run(STEPS, M, b, fb);
    for (int st = 0; st < STEPS; st++)
        digests_agree(a + st * per, fa + st * fper, M, st + 1);
    CHECK(memcmp(a, b, STEPS * per) == 0, "two runs of the same steps report other digests");
    /* a hop whose bytes are not those its digest was made over */
    {
        const int bounds[NST + 1] = {0, 1, 2, 3};
        int32_t tok[16] = {0}, tgt[16] = {0};
        char hex[NL_HOP_DIGEST_HEX + 1];
        nl_error err;
        make_stages(NST, bounds, 0, -1, 1);
        begin_job(NST, 78, 2, 8, 1, 0, false);
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
        m.u.hop = (nl_msg_tensor_hop){78, 1, 0, 0, 0, 0.0};
        const int64_t sh[2] = {2, 8};
        nl_wire_frame_set(&m.frames[0], tok, NL_DTYPE_I32, sh, 2);
        nl_wire_frame_set(&m.frames[1], tgt, NL_DTYPE_I32, sh, 2);
        m.nframes = 2;
        nl_hop_digest_set(&m, 0, hex, NULL);
        tok[3] = 1;
        CHECK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_INTEGRITY,
              "a hop that does not match its digest: %s", err.msg);
        nl_wire_msg_free(&m);
        free_stages(NST);
    }
#ifdef NL_TEST_HOOKS
    /* each lie on stage 1: what it sends differs on some microbatches,
     * its neighbours agree with it (the wire cannot tell: a recompute can) */
    static const char *const kinds[] = {"bitflip", "noise", "stale", "skip", "backward"};
    for (int k = 0; k < 5; k++) {
        test_lie = (nl_stage_lie){(nl_lie_kind)nl_stage_lie_kind(kinds[k]), 0.5, 3, 0, false};
        lie_stage = 1;
        digest_run(STEPS, M, b, fb);
        int fwd_diff = 0, bwd_diff = 0;
        for (int st = 0; st < STEPS; st++) {
            digests_agree(b + st * per, fb + st * fper, M, st + 1);
            const uint8_t *ha = a + st * per + sizeof dig_got[0],
                          *hb = b + st * per + sizeof dig_got[0];
            for (int mb = 0; mb < M; mb++) {
                fwd_diff += memcmp(dig_at(ha, mb, NL_DIGEST_FWD_OUT),
                                   dig_at(hb, mb, NL_DIGEST_FWD_OUT), 32) != 0;
                bwd_diff += memcmp(dig_at(ha, mb, NL_DIGEST_BWD_OUT),
                                   dig_at(hb, mb, NL_DIGEST_BWD_OUT), 32) != 0;
            }
        }
        const bool backward = test_lie.kind == NL_LIE_BACKWARD;
        /* step 1's forwards of a backward liar are honest */
        int fwd1 = 0;
        for (int mb = 0; mb < M; mb++)
            fwd1 += memcmp(dig_at(a + sizeof dig_got[0], mb, NL_DIGEST_FWD_OUT),
                           dig_at(b + sizeof dig_got[0], mb, NL_DIGEST_FWD_OUT), 32) != 0;
        CHECK((backward ? bwd_diff : fwd_diff) > 0 && (!backward || fwd1 == 0),
              "lie %s: %d forwards and %d backwards differ from the honest run (step 1's "
              "forwards: %d)",
              kinds[k], fwd_diff, bwd_diff, fwd1);
        printf("lie %s at q=0.5: %d of %d forwards and %d backwards of stage 1 differ\n", kinds[k],
               fwd_diff, STEPS * M, bwd_diff);
    }
    lie_stage = -1;
#endif
    printf("digests: %d steps of %d microbatches agree at both ends of every hop, run to run\n",
           STEPS, M);
out:
    free(a);
    free(b);
    free(fa);
    free(fb);
}

int main(void)
{
    nl_log_set_name("test_stage_train");
    nl_log_set_level(NL_LOG_ERROR);
    if (pipeline_begin()) {
        parity(8, 8, 4, 5, 0, false, 1, NULL, NULL);
        parity(4, 8, 1, 3, 0, false, 1, NULL, NULL);
        parity(8, 8, 4, 3, 0, true, 1, NULL, NULL);  /* per-layer recompute on every stage */
        parity(8, 8, 4, 4, 2, false, 1, NULL, NULL); /* the guard */
        refusals();
        shard_after_lost_neighbour();
        digests();
        fans_in_any_order(8, 8, 4, 5);
        replicas_agree(8, 8, 4, 5, 0, false, 2);
        replicas_agree(12, 8, 6, 4, 0, false, 3); /* uneven shares: 2, 2, 2 of 6; slots 3 of 3 */
        replicas_agree(8, 8, 4, 3, 0, true, 3);   /* 2, 1, 1 of 4 with recompute */
        replicas_agree(4, 8, 1, 3, 0, false, 2);  /* one microbatch: replica 1 idle */
        replicas_agree(8, 8, 4, 4, 2, false, 2);  /* the guard on a replica's gradients */
    }
    pipeline_end();
    return check_done("test_stage_train");
}
