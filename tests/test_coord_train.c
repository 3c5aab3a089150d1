/* Unit tests of the coordinator's training jobs, in-process: one nl_coord
 * driven turn by turn (nl_coord_step) against the two fake stages of
 * coord_harness.h (two nodes joined, a plan of two stages loaded) and a
 * fake client.
 *
 *  - a training job's paths (issue 15, finding 1): FIFOs, files outside
 *    the roots, links that lead out, "..", files too big and a bad resume
 *    fail that job alone, revealing nothing, as does data past
 *    --max-data-total (issue 31); a file in the root makes a
 *    job that begins, and a cancel reloads its stages; a job cancelled
 *    during a step asks its stages for a checkpoint of it first;
 *  - a stage's reports: an acknowledgement counts once, a non-finite
 *    gradient norm skips the step on every stage, and stage 0's digest of
 *    what it was fed is compared with the coordinator's own;
 *  - a verification case's fields (issue 31): one that says other layers
 *    than the plan gave its stage convicts the stage, and goes to no
 *    verifier, while an honest one goes on to its verifier;
 *  - the journal a coordinator starts with, in any state: its job ids go on
 *    where they are ids, and what it does not read it says.
 *
 * Membership, forward jobs and generations on the same cluster are
 * test_coord.c's. */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord.h"
#include "coordinator/coord_impl.h"
#include "coordinator/coord_train_impl.h"
#include "core/formats/fileio.h"
#include "net/hopdigest.h"
#include "net/transport.h"
#include "tests/check.h"
#include "tests/coord_fake.h"
#include "tests/coord_harness.h"

/* ---------------------------------------------------------------- training jobs */

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
    nl_wire_param ps[16];
    uint32_t n = coord_fake_train_params(ps, data, ckpt, 2, train_micro);
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
    char name[NL_HOP_DIGEST_HEX + 1] = "";
    if (rx.msg.type == NL_MSG_VERIFY_CASE && rx.msg.u.verify_case.weights)
        snprintf(name, sizeof name, "%s", rx.msg.u.verify_case.weights);
    /* an answer naming other weights (to the case of this step before a
     * rollback, say) is not this case's: it does not count, and the case
     * is still awaited (taken, it would stay unresolved: no third node) */
    static const char other[] = "0000000000000000000000000000000000000000000000000000000000000000";
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_VERIFY_RESULT);
    m.u.verify_result = (nl_msg_verify_result){job, 1, 0, 1, other, other, 0, other};
    fake_send(first, &m);
    /* a verifier that no longer holds them asks: the case again, with them */
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_VERIFY_RESULT);
    m.u.verify_result = (nl_msg_verify_result){job, 1, 0, 1, "", "", 1, name};
    fake_send(first, &m);
    CHECK(pump_until(first, NL_MSG_VERIFY_CASE, &rx) && rx.msg.u.verify_case.microbatch == 0 &&
              rx.msg.frames[0].t.shape[0] == 4,
          "verify: a verifier that asked for the weights was not sent the case again with them");
    const cjob *vj = coord_job_find(coord, job);
    const ctrain *vt = vj ? vj->state : NULL;
    CHECK(vt && vt->verify_mismatches == 0 && vt->verify_done == 0,
          "verify: an answer naming other weights was taken for the case's (%lld mismatches)",
          vt ? (long long)vt->verify_mismatches : -1LL);
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

/* ---------------------------------------------------------------- the journal */

static const char *journal_text; /* what the next coordinator finds in its journal.json */

static void write_journal(nl_coord_opts *o)
{
    char path[600];
    snprintf(path, sizeof path, "%s/journal.json", o->state_dir);
    FILE *f = fopen(path, "w");
    CHECK(f && fputs(journal_text, f) >= 0 && fclose(f) == 0, "write %s", path);
}

/* A coordinator that starts with journal `text`: its first job id after
 * (the journal's next, or 1) into *next, and whether its log said
 * `warning` (NULL: that it said nothing of its journal). */
static void start_with_journal(const char *text, uint64_t *next, const char *warning)
{
    char dir[256], log[300];
    journal_text = text;
    snprintf(log, sizeof log, "/tmp/nl_test_journal_log_%d", (int)getpid());
    fflush(stderr);
    const int saved = dup(2), fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(saved >= 0 && fd >= 0 && dup2(fd, 2) == 2, "stderr to %s", log);
    coord_fake_start("journal", dir, sizeof dir, write_journal);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    *next = coord->next_job + 1;
    coord_fake_stop(dir);
    char *said = NULL;
    size_t len = 0;
    nl_error err = {0};
    CHECK_OK(nl_file_read_all(log, 1 << 20, &said, &len, &err), &err);
    unlink(log);
    if (said) {
        CHECK(warning ? strstr(said, warning) != NULL : strstr(said, "journal.json") == NULL,
              "journal %.40s: log %s", text, said);
        free(said);
    }
}

/* A journal a crash, a disk or a hand left in any state: the coordinator
 * starts, goes on from its job ids where they are ids (up to 2^53, what a
 * client's JSON holds exactly) and says what it did not read. */
static void test_journal_states(void)
{
    uint64_t next = 0;
    start_with_journal("{\"next_job\":41,\"train\":null}", &next, NULL);
    CHECK(next == 42, "after a journal's next_job 41: job %llu", (unsigned long long)next);
    start_with_journal("{\"next_job\":41,\"train\":{\"id\":3,\"par", &next,
                       "premature end of input near '\"par' (line 1): not read");
    CHECK(next == 1, "after a truncated journal: job %llu", (unsigned long long)next);
    start_with_journal("[41]", &next, "not a JSON object: not read");
    start_with_journal("{\"next_job\":9007199254740993,\"train\":null}", &next,
                       "\"next_job\" is not a count of ids in 0..2^53-1: job ids start "
                       "again at 1");
    CHECK(next == 1, "after a next_job past 2^53: job %llu", (unsigned long long)next);
    start_with_journal("{\"next_job\":0,\"train\":null}", &next, NULL); /* none given out yet */
    CHECK(next == 1, "after a journal's next_job 0: job %llu", (unsigned long long)next);
    start_with_journal("{\"next_job\":9,\"train\":{\"id\":9007199254740993,\"params\":{}}}", &next,
                       "\"train\" is not a job (an id in 1..2^53 and its parameters)");
    CHECK(next == 10, "after a job id past 2^53: job %llu", (unsigned long long)next);
}

int main(void)
{
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_WARN);
    nl_error err = {0};
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    test_journal_states();
    start_coord();
    assigned a[2];
    if (test_join_plan(a)) {
        fake_open(&client, "fakeClient", "");
        test_train_paths(a);
        test_train_verify_case(a);
    }
    stop_coord();
    coord_fake_add_counts(&check_pass_count, &check_fail_count);
    return check_done("test_coord_train");
}
