/* The coordinator's training job, and its fine-tuning job (what that adds
 * is coord_finetune.c), as one state machine. A worker reads and
 * tokenizes the data (and verifies the manifest it resumes from); the job
 * then feeds each step's microbatches to the first stage (the targets ride
 * along to the last), sums the stages' gradient norms, decides every step
 * (apply with the learning rate and clipping scale, or skip on a
 * non-finite value), runs the evaluations, asks every stage for its
 * checkpoint shard and has a worker write the manifest last and verify
 * it; a lost stage makes it resume from the last manifest. The client sees
 * JOB_STATUS messages with a JSON report per event (docs/cluster.md,
 * "Training").
 *
 * This file alone decides the job's transitions: the states (tr_state),
 * the events (tr_event, coord_train_impl.h) and coord_train_on, the
 * transition function, through which every event goes: the stages'
 * reports, the leaves' workers, the cluster (ready, a stage lost, a
 * standby gone) and the client (cancel), the last three through
 * coord_train_ops.c, the job's operations table, which turns each
 * operation into an event. It calls its leaves, which do a part of the
 * work and hand the result back without deciding anything, and none of
 * them calls it (a
 * worker reports to the done this file gave it): coord_train_stages.c
 * (the stages' reports, checked and counted), coord_train_prep.c (the
 * preparation), coord_train_ckpt.c (the checkpoints, and the rollback
 * to the last all-verified one after a conviction), coord_train_verify.c
 * (verification by recompute), coord_train_wire.c (what goes to the
 * stages) and coord_train_report.c (what the client is told). */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_train_impl.h"
#include "core/train/train.h"

/* ---------------------------------------------------------------- the states
 *
 *   PREPARING -PREPARED-> LOADING -READY-> BEGIN -TAKEN-> STEP <-------------+
 *                           ^  ^                          | REPORTED (decide) |
 *                           |  |          EVAL <-[eval due]+                   |
 *                           |  |           | EVALUATED     v                   |
 *                           |  |           +--------> the step is done -[go on]+
 *                           |  |                [ckpt due] |      | [the last] |
 *                           |  |                           v      v            |
 *                           |  |    WRITE <-SHARDS------ CKPT   SETTLE -SETTLED-> DONE
 *                           |  |      | WRITTEN -------------------[go on]-----+
 *                           |  |      +--> SETTLE, CANCELLED
 *                           |  +-[re-plan]-+
 *                           +--GROWN-- GROW <-[--grow auto]
 *
 *  state        event [condition]                     next state
 *  PREPARING    PREPARED                              LOADING, then as READY if ready
 *  LOADING      READY [cancelled]                     CANCELLED (the source keeps its steps)
 *               READY [the plan lacks its memory]     LOADING (the cluster plans again)
 *               READY                                 BEGIN (at the source's step when the
 *                                                     job continues it, else at step 0)
 *               WRITTEN [past the source's step, no   LOADING (resumes from that manifest)
 *                        conviction since]
 *               RESTORED                              LOADING (the rollback's checkpoint is
 *                                                     the source: the cluster plans again)
 *  BEGIN        TAKEN                                 STEP
 *  STEP         REPORTED [an evaluation due]          EVAL
 *  STEP, EVAL   REPORTED, EVALUATED: the step is done:
 *                 [a checkpoint due, or cancelled]    CKPT
 *                 [the last step]                     SETTLE
 *                 else                                STEP
 *  CKPT         SHARDS                                WRITE
 *  WRITE        WRITTEN [the last step]               SETTLE
 *               WRITTEN [cancelled]                   CANCELLED
 *               WRITTEN [--grow auto deepens]         GROW
 *               WRITTEN [a re-plan gains]             LOADING
 *               WRITTEN                               STEP
 *  GROW         GROWN [cancelled]                     CANCELLED
 *               GROWN [grown]                         LOADING
 *               GROWN [failed]                        STEP
 *  SETTLE       (entered) [no verification under way]  DONE
 *               SETTLED (the last one answered)       DONE
 *               GONE (a standby) [none left]          DONE (its cases: unverified)
 *  STEP         LOST [resumes left, a replica's node: SALVAGE (the survivors write the
 *                every stage has a live one]          steps done; the plan is kept)
 *  BEGIN..SETTLE LOST [resumes left]                  LOADING (else the job fails); after a
 *                                                     conviction, rolled back (roll_back)
 *  SALVAGE      SHARDS                                (a worker writes the manifest)
 *               WRITTEN (the source now, or not),     LOADING (the cluster plans again)
 *               UNSAVED (a stage asked failed), LOST
 *               CANCEL                                the same, marked cancelled
 *  the others   LOST: the same (the next plan; LOADING: rolled back after a
 *               conviction); CANCEL: the job ends now
 *  any          an error                              failed (coord_job_fail; train_abort
 *                                                     undoes what the state had changed)
 *
 * A fine-tuning job has no journal, no GROW, no LOADING after BEGIN (a
 * lost stage fails it), no verification (so no SETTLE) and one
 * checkpoint, at the end (or when cancelled), whose WRITE joins the
 * adapters: then DONE or CANCELLED. */
typedef enum {
    TR_PREPARING = 0, /* a worker reads the data (and the manifest it resumes) */
    TR_LOADING,       /* the cluster plans and loads: the job waits for it */
    TR_BEGIN,         /* the stages were sent the job: their JOB_STATUS running */
    TR_STEP,          /* a step's batch is in the pipeline: GRAD_NORMs and LOSS */
    TR_EVAL,          /* the held-out batches are: the evaluation's LOSS */
    TR_CKPT,          /* the stages write their shards: their CKPT_DONEs */
    TR_WRITE,         /* a worker writes the manifest (or joins the adapters) */
    TR_GROW,          /* --grow auto at the checkpoint: a worker grows the model */
    TR_SETTLE,        /* the last step is done: the verifications under way are awaited */
    TR_SALVAGE,       /* a replica lost mid-step: the survivors write the steps done */
    TR_DONE,          /* the ends: the job is freed as it enters them */
    TR_CANCELLED
} tr_state;

static void to(nl_coord *c, cjob *j, tr_state s);
static void enter_settle(nl_coord *c, cjob *j);
static void resume(nl_coord *c, cjob *j, const char *why);

/* The job fails with the formatted reason. */
static void __attribute__((format(printf, 3, 4)))
train_fail(nl_coord *c, cjob *j, const char *fmt, ...)
{
    char why[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    coord_job_fail(c, j, why);
}

/* ---------------------------------------------------------------- entering a state */

/* LOADING: the job waits while the cluster plans again and reloads from
 * its source (the last verified manifest, or what the job began from);
 * READY then begins it from the source's step (or the start). */
static void enter_loading(cjob *j)
{
    ctrain *t = j->state;
    t->start = t->step = 0;
    t->moments = 0;
    t->adam = 0;
    j->phase = JOB_WAITING;
    j->last_progress = nl_mono_s();
}

/* BEGIN: every stage is sent the job (JOB_SUBMIT: its shapes, where it
 * starts, the growth history, a fine-tuning job's adapters). */
static void enter_begin(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    int lost = 0;
    t->acks = 0;
    if (coord_train_send_job(c, j, &lost) != 0) {
        coord_train_unreachable(c, j, lost);
        return;
    }
    coord_train_report_start(c, j);
}

/* STEP: the step's batch (made) goes to the first stage. */
static void enter_step(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    t->t_step = nl_mono_s();
    /* until a checkpoint of these weights is the source (fine-tuning
     * leaves the weights as they are) */
    if (!t->ft)
        c->stages_modified = 1;
    t->norms = t->have_loss = 0;
    t->sumsq = t->ce = t->aux = 0.0;
    memset(t->lane_sumsq, 0, sizeof t->lane_sumsq);
    t->loss_lanes = 0;
    memset(t->got, 0, (size_t)t->stages * sizeof *t->got);
    if (coord_train_send_step(c, j) != 0)
        coord_train_unreachable(c, j, 0);
}

/* EVAL: the held-out batches, as local evaluation makes them. */
static void enter_eval(nl_coord *c, cjob *j)
{
    nl_error e = {0};
    const int rc = coord_train_send_eval(c, j, &e);
    if (rc < 0)
        train_fail(c, j, "evaluation: %s", e.msg);
    else if (rc > 0)
        coord_train_unreachable(c, j, 0);
}

/* CKPT: every stage is asked for its shard (CKPT_REQ). */
static void enter_ckpt(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    char dir[1100];
    coord_train_ckpt_dir(j, dir, sizeof dir);
    int lost = -1;
    if ((strlen(dir) > 1024 ? -1 : coord_train_send_ckpt_req(c, j, dir, &lost)) != 0) {
        if (lost >= 0)
            coord_train_unreachable(c, j, lost);
        else
            train_fail(c, j, "checkpoint directory %s is longer than 1024 bytes", dir);
        return;
    }
    memset(t->got, 0, (size_t)t->stages * sizeof *t->got);
    t->acks = 0;
}

/* SALVAGE: a node was lost in the step under way, but each stage has a
 * live replica, holding the weights and moments of the steps done (no
 * stage applies a step before the coordinator's STEP, which this step
 * has not had): its first live replica writes the stage's shard at once
 * (CKPT_REQ), so the job resumes from the step under way rather than
 * from its last checkpoint. The cluster keeps its plan until then
 * (coord_release_plan). Requests that cannot be sent: it resumes now. */
static void enter_salvage(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    char dir[1100];
    coord_train_ckpt_dir(j, dir, sizeof dir);
    int lost = -1;
    if (strlen(dir) > 1024 || coord_train_send_ckpt_req(c, j, dir, &lost) != 0) {
        NL_WARN("train job %llu: the step under way cannot be saved (no request reached stage "
                "%d)",
                (unsigned long long)j->id, lost);
        resume(c, j, t->salvage_why);
        return;
    }
    memset(t->got, 0, (size_t)t->stages * sizeof *t->got);
    t->acks = 0;
    NL_INFO("train job %llu: %s; each stage's first live replica writes step %lld to %s, then "
            "the cluster plans again",
            (unsigned long long)j->id, t->salvage_why, (long long)t->step, dir);
}

/* SALVAGE ends: the step's manifest written (the source now), or why not
 * (failed). The job resumes from the source as after any loss, and the
 * cluster plans again. */
static void salvage_end(nl_coord *c, cjob *j, const char *failed)
{
    ctrain *t = j->state;
    char why[sizeof t->salvage_why];
    memcpy(why, t->salvage_why, sizeof why);
    if (failed)
        NL_WARN("train job %llu: step %lld is not saved (%s): the job resumes from its last "
                "checkpoint",
                (unsigned long long)j->id, (long long)t->step, failed);
    resume(c, j, why); /* j may be gone (a rollback that failed) */
    coord_release_plan(c);
}

/* WRITE: a worker writes the manifest, or joins a fine-tuning job's
 * adapters into one file. */
static void enter_write(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    char why[900], dir[1100];
    nl_error e = {0};
    if (!t->ft) {
        if (coord_train_write_manifest(c, j, coord_train_done_manifest, why, sizeof why))
            train_fail(c, j, "%s", why);
        return;
    }
    coord_train_ckpt_dir(j, dir, sizeof dir);
    if (coord_finetune_gather(c, j->id, t->ft, t->shards, t->stages, dir, coord_train_done_adapters,
                              &e) != NL_OK)
        train_fail(c, j, "the adapters of step %lld: %s", (long long)t->step, e.msg);
}

/* SETTLE: the last step is done, and its weights are not the job's
 * result until every verification under way has been answered: a
 * conviction now rolls the job back as during the run (LOST); none left
 * (SETTLED): DONE. */
static void enter_settle(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    /* with a checkpoint of the last step, every stage answered after its
     * last case was asked for */
    const int n = coord_train_verify_settle(c, j, t->manifest[0] && t->manifest_step == t->step);
    if (!n) {
        to(c, j, TR_DONE);
        return;
    }
    NL_INFO("train job %llu: the last step is done; %d verification(s) under way are awaited",
            (unsigned long long)j->id, n);
}

/* DONE, CANCELLED: the job ends, done or (cancelled) with the steps done
 * kept: the client is told where they are, and the stages free their
 * trainers. Either way the stages hold the weights of the last checkpoint
 * (or of a done run), so nothing is reloaded. */
static void enter_end(nl_coord *c, cjob *j, int cancelled)
{
    const ctrain *t = j->state;
    coord_train_report_end(c, j, cancelled);
    if (!t->ft) {
        memset(&c->train_mem, 0, sizeof c->train_mem); /* plans are for inference again */
        coord_journal_clear(c);
    }
    coord_train_send_end(c, j); /* the stages free their trainers */
    coord_job_free(j);
}

/* The one place a job changes state: t->phase = s, then what s does on
 * entry. An entry that fails ends the job (coord_job_fail), as DONE and
 * CANCELLED do: the caller returns at once, for j may be gone. PREPARING
 * and GROW do nothing: the leaf's worker was started on the way. */
static void to(nl_coord *c, cjob *j, tr_state s)
{
    ctrain *t = j->state;
    t->phase = (int)s;
    switch (s) {
    case TR_LOADING:
        enter_loading(j);
        break;
    case TR_BEGIN:
        enter_begin(c, j);
        break;
    case TR_STEP:
        enter_step(c, j);
        break;
    case TR_EVAL:
        enter_eval(c, j);
        break;
    case TR_CKPT:
        enter_ckpt(c, j);
        break;
    case TR_WRITE:
        enter_write(c, j);
        break;
    case TR_DONE:
    case TR_CANCELLED:
        enter_end(c, j, s == TR_CANCELLED);
        break;
    case TR_SETTLE:
        enter_settle(c, j);
        break;
    case TR_SALVAGE:
        enter_salvage(c, j);
        break;
    case TR_PREPARING:
    case TR_GROW:
        break;
    }
}

/* ---------------------------------------------------------------- the transitions */

/* LOADING, the cluster ready: the run begins on its plan, at the
 * source's step with its moments when the job continues it (t->cont),
 * else at step 0 with fresh moments from the weights the stages hold. */
static void begin(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    char why[900];
    /* a fine-tuning job keeps no moments of the base: each stage checks
     * that its adapters' job fits, and the plan stays as it is */
    const int held = t->ft ? 1 : coord_train_memory(c, j, why, sizeof why);
    if (coord_train_replicas_refusal(c, t, why, sizeof why)) {
        train_fail(c, j, "%s", why);
        return;
    }
    if (held < 0) {
        train_fail(c, j, "%s", why);
        return;
    }
    if (held == 0) { /* the cluster plans again for the training memory */
        to(c, j, TR_LOADING);
        coord_reload(c); /* a plan that cannot hold it fails the job with the shortfall */
        return;
    }
    if (coord_train_take_plan(c, j, why, sizeof why)) {
        train_fail(c, j, "%s", why);
        return;
    }
    to(c, j, TR_BEGIN);
}

/* The next step's batch is made; STEP sends it. */
static void next_step(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    nl_error e = {0};
    if (coord_train_make_batch(c, t, 0, (uint64_t)t->step, &t->valid, &e) != NL_OK) {
        train_fail(c, j, "%s", e.msg);
        return;
    }
    to(c, j, TR_STEP);
}

static int due(int64_t step, int64_t every)
{
    return every > 0 && step % every == 0;
}

/* The step (and its evaluation) is done: report it, then CKPT, DONE or
 * the next step. */
static void after_step(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    coord_train_report_step(c, j);
    /* a fine-tuning job writes its adapters once, at the end (or when
     * cancelled); a cancelled training job keeps the steps done */
    const int ckpt = t->ft ? t->step == t->steps || t->cancel
                           : ((due(t->step, t->ckpt_every) || t->cancel) && t->step < t->steps) ||
                                 (t->step == t->steps && t->final_ckpt);
    if (ckpt || coord_train_early_ckpt(c, j))
        to(c, j, TR_CKPT);
    else if (t->step == t->steps)
        to(c, j, t->ft ? TR_DONE : TR_SETTLE);
    else
        next_step(c, j);
}

/* STEP, REPORTED: decide the step and tell the stages; then EVAL when one
 * is due, else the step is done. */
static void decide(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    nl_step_result *r = &t->r;
    /* the decision local training makes too (core/train/train.h) */
    const double scale = nl_step_decide(r, t->ce, t->valid > 0 ? (double)t->valid : 1.0, t->aux,
                                        c->cfg.aux_loss_coef, t->sumsq, NL_TRAIN_CLIP_NORM);
    if (!r->skipped) {
        t->skips = 0;
    } else if (++t->skips >= NL_TRAIN_MAX_SKIPS) {
        train_fail(c, j,
                   "stage %d reported a non-finite %s for %d steps in a row (to step %lld): "
                   "refused",
                   t->bad_stage, isfinite(r->loss) ? "gradient" : "loss", t->skips,
                   (long long)t->step + 1);
        return;
    }
    t->bad_stage = -1;
    t->lr_now = nl_lr_at(t->step, t->steps, t->warmup, t->lr, t->min_lr);
    t->step_s = nl_mono_s() - t->t_step;
    int lost = 0;
    if (coord_train_send_decision(c, j, scale, &lost) != 0) {
        coord_train_unreachable(c, j, lost);
        return;
    }
    t->step++;
    t->adam += !r->skipped;
    if (!t->ft) { /* the weights the stages hold now */
        c->weights_job = j->id;
        c->weights_step = t->step;
    }
    j->last_progress = nl_mono_s();
    t->has_eval = 0;
    if (t->eval_every > 0 && (due(t->step, t->eval_every) || t->step == t->steps))
        to(c, j, TR_EVAL);
    else
        after_step(c, j);
}

/* WRITE (or LOADING), WRITTEN. A manifest written and verified becomes
 * the source; then DONE, CANCELLED, GROW, LOADING (a re-plan) or the next
 * step. One written while a stage was lost (LOADING: every shard was in,
 * and re-planning waited for the worker, coord.c) is resumed from rather
 * than the one before: less work is redone, and the replay never meets
 * the checkpoint's files, which a stage refuses to overwrite. A job that
 * ended meanwhile left the source as it was. A fine-tuning job's adapter
 * file: DONE or CANCELLED. */
static void written(nl_coord *c, cjob *j, const tr_in *in)
{
    ctrain *t = j->state;
    if (t->ft) {
        if (t->phase != TR_WRITE)
            return; /* it ended meanwhile */
        if (in->why) {
            train_fail(c, j, "the adapters of step %lld: %s", (long long)t->step, in->why);
            return;
        }
        snprintf(t->ft->adapter, sizeof t->ft->adapter, "%s", in->path);
        NL_INFO("finetune job %llu: adapters of step %lld in %s", (unsigned long long)j->id,
                (long long)t->step, in->path);
        to(c, j, t->cancel && t->step < t->steps ? TR_CANCELLED : TR_DONE);
        return;
    }
    if (t->phase == TR_SALVAGE) {
        if (!in->why) {
            coord_train_keep(c, j, in);
            NL_INFO("train job %llu: checkpoint of step %lld: %s (the step under way when a node "
                    "was lost: the job resumes from it)",
                    (unsigned long long)j->id, (long long)in->step, in->path);
            coord_train_report_ckpt(c, j, in->step, in->path);
        }
        salvage_end(c, j, in->why);
        return;
    }
    /* the source is this job's, of an earlier step (another job's steps
     * count from its own start) */
    if (t->phase == TR_LOADING && !in->why &&
        (c->src_job != j->id || !c->src_manifest || in->step > c->src_step) && !t->rolled &&
        t->verify_convicted + t->verify_outvoted == t->convictions_seen) {
        coord_train_keep(c, j, in);
        NL_INFO("train job %llu: checkpoint of step %lld: %s (written while a stage was lost: the "
                "job %s)",
                (unsigned long long)j->id, (long long)in->step, in->path,
                in->step >= t->steps ? "is done" : "resumes from it");
        coord_train_report_ckpt(c, j, in->step, in->path);
        return;
    }
    if (t->phase != TR_WRITE || t->step != in->step)
        return;
    if (in->why) {
        train_fail(c, j, "checkpoint of step %lld: %s", (long long)t->step, in->why);
        return;
    }
    coord_train_keep(c, j, in);
    NL_INFO("train job %llu: checkpoint of step %lld: %s", (unsigned long long)j->id,
            (long long)t->step, in->path);
    coord_train_report_ckpt(c, j, t->step, in->path);
    if (t->step < t->steps && !t->cancel && !t->early_ckpt) /* an early one: judged already */
        coord_observe_speeds(c); /* a stage slower or faster than planned asks for a re-plan */
    t->early_ckpt = 0;
    if (t->step == t->steps) {
        to(c, j, TR_SETTLE);
    } else if (t->cancel) {
        to(c, j, TR_CANCELLED); /* the steps done are kept: the job ends */
    } else if (coord_train_grow(c, j, coord_train_done_grown)) {
        /* --grow auto: the nodes hold a deeper model; a worker grows the
         * manifest, then the job goes on from it on a new plan */
        to(c, j, TR_GROW);
    } else if (coord_replan_gain(c, "at the checkpoint")) {
        /* a node joined, or the stages' observed speeds call for another
         * split: the job goes on from this manifest on the new plan */
        json_t *o = json_pack("{s:s,s:I,s:s,s:s}", "event", "replan", "step", (json_int_t)t->step,
                              "manifest", in->path, "reason", coord_replan_reason(c->replan_why));
        coord_train_report(c, j, NL_JOB_RUNNING, "re-planning at the checkpoint", o);
        coord_close_session(c, j);
        to(c, j, TR_LOADING);
        coord_reload(c);
    } else {
        next_step(c, j);
    }
}

/* GROW, GROWN: the grown model becomes the source and the stages reload
 * it on a new plan (LOADING); a growth that failed leaves the model as it
 * is and the job goes on; a cancelled job ends with its checkpoint. */
static void on_grown(nl_coord *c, cjob *j, const tr_in *in)
{
    ctrain *t = j->state;
    coord_grow_task *k = in->task;
    if (t->phase != TR_GROW)
        return;
    if (t->cancel) { /* the model stays as the checkpoint has it */
        to(c, j, TR_CANCELLED);
        return;
    }
    if (in->why) { /* the job goes on at the size it has */
        NL_WARN("train job %llu: --grow auto at step %lld: %s", (unsigned long long)j->id,
                (long long)t->step, in->why);
        next_step(c, j);
        return;
    }
    coord_grow_install(c, &k->g, nl_mono_s() - k->t0);
    coord_train_report(c, j, NL_JOB_RUNNING, "the model grew", coord_grow_event(c, &k->g));
    coord_close_session(c, j);
    to(c, j, TR_LOADING);
}

/* LOADING after a conviction (the convicted node is dropped as a dead
 * one: LOST): the job goes back to its newest checkpoint whose steps were
 * all verified (coord_train_rollback). 1: the job waits for the worker
 * that opens it (RESTORED); 0: it goes on from the source; -1: it failed. */
static int roll_back(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    char why[900];
    const int64_t convictions = t->verify_convicted + t->verify_outvoted;
    if (t->ft || t->restoring || convictions == t->convictions_seen || !t->n_ckpts)
        return t->restoring;
    t->convictions_seen = convictions;
    const int rc = coord_train_rollback(c, j, coord_train_done_restored, why, sizeof why);
    if (rc < 0)
        train_fail(c, j, "%s", why);
    return rc;
}

/* LOST: a stage of the plan is lost. A job that has begun goes on by
 * itself, up to --train-resumes times: its stages drop it, the cluster
 * plans again over the nodes left (coord.c) and reloads from the source,
 * which is the last verified manifest (WRITTEN installs each) or what the
 * job began from; READY then continues from the source's step. Every
 * batch is a function of the seed and the step, so the run ends as an
 * undisturbed one would. A job still preparing or loading just waits for
 * the next plan. 0: the job fails (coord_jobs.c says why). */
static int lost(nl_coord *c, cjob *j, const char *why)
{
    ctrain *t = j->state;
    if (t->ft && t->phase >= TR_BEGIN) /* adapters live on their stages: lost with one */
        return 0;
    if (t->phase < TR_BEGIN) {
        if (t->phase == TR_LOADING)
            roll_back(c, j); /* failed: it has ended */
        return 1;
    }
    if (t->resumes >= c->o.train_resumes) {
        NL_WARN("train job %llu: a stage is lost and the job has resumed %d times already "
                "(--train-resumes %d)",
                (unsigned long long)j->id, t->resumes, c->o.train_resumes);
        return 0;
    }
    if (t->phase == TR_SALVAGE) { /* another loss before the step was saved */
        salvage_end(c, j, why);
        return 1;
    }
    if (t->phase == TR_STEP && coord_train_salvage_can(c, t)) {
        snprintf(t->salvage_why, sizeof t->salvage_why, "%s", why);
        to(c, j, TR_SALVAGE); /* LOADING at once if it cannot ask the stages */
        return j->state == t && t->phase == TR_SALVAGE ? 2 : 1;
    }
    resume(c, j, why);
    return 1;
}

/* The job resumes after a loss (LOADING): its stages drop it, and the
 * cluster plans again over the nodes left and reloads from the source. */
static void resume(nl_coord *c, cjob *j, const char *why)
{
    ctrain *t = j->state;
    coord_close_session(c, j); /* the stages left drop the job */
    t->resumes++;
    t->t_lost = nl_mono_s();
    t->lost_at = t->step;
    to(c, j, TR_LOADING);
    if (roll_back(c, j) >= 0) /* else it failed and has ended */
        coord_train_report_lost(c, j, why);
}

/* CANCEL (JOB_CANCEL) of a job that has begun: the step under way ends
 * (or the checkpoint being written is finished), a checkpoint keeps the
 * steps done (after_step asks for it; WRITTEN then ends the job as
 * cancelled), as local training does on Ctrl-C. A job preparing, loading
 * or not yet at its first step has nothing to keep: it ends now (0). A
 * second cancel changes nothing: the checkpoint under way is not lost. A
 * stage lost meanwhile: the ordinary rules, then the job ends at the
 * manifest it resumed from (READY). */
static int cancel(nl_coord *c, cjob *j, const nl_rx *rx)
{
    ctrain *t = j->state;
    if (t->phase <= TR_BEGIN)
        return 0;
    /* the step under way, or the one done */
    coord_train_report_stopping(c, j, rx, t->phase == TR_STEP ? t->step + 1 : t->step, !t->cancel);
    t->cancel = 1;
    return 1;
}

/* The event the stages' reports make in state `phase` (-1: none). */
static int awaited(int phase)
{
    return phase == TR_BEGIN                         ? TE_TAKEN
           : phase == TR_STEP                        ? TE_REPORTED
           : phase == TR_EVAL                        ? TE_EVALUATED
           : phase == TR_CKPT || phase == TR_SALVAGE ? TE_SHARDS
           : phase == TR_SETTLE                      ? TE_SETTLED
                                                     : -1;
}

/* The transition function: what event ev (with in) does to job j in the
 * state it is in (the diagram above); every transition starts here. For
 * LOST and CANCEL, 1 if the job goes on, 0 if it ends now (cjob_ops). */
int coord_train_on(nl_coord *c, cjob *j, tr_event ev, const tr_in *in)
{
    ctrain *t = j->state;
    char why[900];
    if ((ev == TE_TAKEN || ev == TE_REPORTED || ev == TE_EVALUATED || ev == TE_SHARDS ||
         ev == TE_SETTLED) &&
        awaited(t->phase) != (int)ev)
        return 1; /* the stages' reports make an event in one state only */
    switch (ev) {
    case TE_PREPARED:
        if (t->phase != TR_PREPARING)
            return 1;
        if (coord_train_prepared(c, j, in, why, sizeof why)) {
            train_fail(c, j, "%s", why);
            return 1;
        }
        to(c, j, TR_LOADING); /* it begins once the cluster is ready (at once unless it reloads) */
        if (c->ready)
            begin(c, j);
        return 1;
    case TE_READY:
        if (t->phase != TR_LOADING)
            return 1;
        if (t->cancel && !t->ft) { /* cancelled, then a stage lost: the source keeps the steps */
            if (c->src_manifest && c->src_job == j->id) {
                snprintf(t->manifest, sizeof t->manifest, "%s", c->src_path);
                t->manifest_step = t->step = c->src_step;
            }
            to(c, j, TR_CANCELLED);
            return 1;
        }
        if (roll_back(c, j) != 0) /* a conviction since the loss: the source may change */
            return 1;
        if (!t->ft && c->src_manifest && c->src_job == j->id && c->src_step >= t->steps) {
            /* its last checkpoint was written while a stage was lost (or
             * before the loss in SETTLE): every step is done and kept */
            snprintf(t->manifest, sizeof t->manifest, "%s", c->src_path);
            t->manifest_step = t->step = c->src_step;
            to(c, j, TR_SETTLE);
            return 1;
        }
        begin(c, j);
        return 1;
    case TE_TAKEN: /* BEGIN: step 1 */
        if (!t->ft) {
            /* the stages took the moments and the weights are about to
             * move; a resume is taken once: later jobs start at step 0 */
            c->resumable = 0;
            c->src_continues = 0;
        }
        next_step(c, j);
        return 1;
    case TE_REPORTED:
        decide(c, j);
        return 1;
    case TE_EVALUATED:
        after_step(c, j);
        return 1;
    case TE_SHARDS:
        if (t->phase != TR_SALVAGE)
            to(c, j, TR_WRITE);
        else if (coord_train_write_manifest(c, j, coord_train_done_manifest, why, sizeof why))
            salvage_end(c, j, why);
        return 1;
    case TE_UNSAVED:
        if (t->phase == TR_SALVAGE)
            salvage_end(c, j, in->why);
        return 1;
    case TE_SETTLED:
        to(c, j, TR_DONE);
        return 1;
    case TE_WRITTEN:
        written(c, j, in);
        return 1;
    case TE_GROWN:
        on_grown(c, j, in);
        return 1;
    case TE_RESTORED:
        if (t->phase != TR_LOADING || !t->restoring)
            return 1;
        t->restoring = 0;
        if (in->why)
            train_fail(c, j, "the rollback to %s: %s", in->path, in->why);
        else /* the plan is made again from it: READY */
            coord_train_restore(c, j, in);
        return 1;
    case TE_LOST:
        return lost(c, j, in->why);
    case TE_GONE: /* SETTLE: its verifications are not awaited any more */
        if (t->phase == TR_SETTLE)
            enter_settle(c, j);
        return 1;
    case TE_CANCEL:
        return cancel(c, j, in->rx);
    }
    return 1;
}

int coord_train_awaits(const ctrain *t)
{
    return awaited(t->phase);
}

int coord_train_begun(const ctrain *t)
{
    return t->phase >= TR_BEGIN;
}

int coord_train_salvaging(const ctrain *t)
{
    return t->phase == TR_SALVAGE;
}

/* Before its first step a job has changed no weight; only moments the
 * stages took from a manifest (resumable) may be gone with their
 * trainers. */
int coord_train_touched(const nl_coord *c, const ctrain *t)
{
    return t->phase > TR_BEGIN || (t->phase == TR_BEGIN && c->resumable);
}

const char *coord_train_start(nl_coord *c, cjob *j, const nl_msg_job_submit *s, char *why,
                              size_t cap)
{
    ctrain *t = j->state;
    t->bad_stage = -1;
    t->verify_taint = INT64_MAX;
    if (coord_train_prepare(c, j, s, coord_train_done_prepared, why, cap))
        return why;
    to(c, j, TR_PREPARING);
    return NULL;
}
