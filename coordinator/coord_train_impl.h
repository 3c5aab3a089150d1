/* The training job's own state, private to the files of the training and
 * fine-tuning jobs: coord_train.c, the job's state machine, the one owner
 * of its transitions (its states are its own: tr_state); and its leaves,
 * which do a part of the work and hand the result back but decide
 * nothing: coord_train_stages.c (the stages' reports, checked and
 * counted), coord_train_prep.c (the preparation: parameters, paths, the
 * worker that reads the data), coord_train_ckpt.c (the checkpoints:
 * shards, the manifest's worker, --grow auto's, the weights restored
 * when a job ends early), coord_train_wire.c (what
 * goes to the stages: the job, the batches' hops) and coord_train_report.c
 * (what the client is told); and coord_finetune.c (what a fine-tuning job
 * adds). The state machine calls the others, never the other way: a
 * leaf's worker reports to the done the machine gave it, and a stage's
 * report is counted by coord_train_stages.c and then is the machine's
 * event. The rest of the coordinator sees the two jobs through their
 * operations tables (coord_train_ops, coord_finetune_ops). */
#ifndef NL_COORD_TRAIN_IMPL_H
#define NL_COORD_TRAIN_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "coordinator/coord_impl.h"
#include "core/data/data.h"
#include "core/data/labelled.h"
#include "core/train/train.h"

struct json_t;

/* ---------------------------------------------------------------- the state */

/* A fine-tuning job (coord_finetune.c) is a training job whose stages
 * train LoRA adapters on their frozen weights: the same steps,
 * evaluations and decisions; no journal, no plan for training memory, no
 * resume; at the end each stage writes its adapters and a worker joins
 * them into one file for the client. */
typedef struct cft {
    int64_t rank;
    double alpha;
    char targets[40];   /* "wq,wk,wv,wo" or a part of it */
    char base[4096];    /* the weights' source file (its SHA-256 goes into the file), or "" */
    char adapter[1200]; /* the joined adapter file, once written */
} cft;
#define COORD_FT_PARAMS 4 /* parameters coord_finetune_stage_params adds */

/* The growth entries a training job sends its stages, at most (the wire
 * takes 64 params; the job's own are 10). */
#define COORD_GROWTH_PARAMS 48

/* A checkpoint of the job, or what it began from (its base): the step,
 * the file (manifest 1: a manifest, 0: a --model file; NULL: the seed,
 * or with manifest -1 weights no file holds) and whether the job
 * continues it with its moments. */
typedef struct cckpt {
    int64_t step;
    char *path;
    int manifest, cont;
} cckpt;

typedef struct ctrain {
    /* the run, as the client asked for it */
    char data[4097], ckpt_dir[1001]; /* CKPT_REQ.dir holds at most 1024 bytes */
    uint64_t data_bytes;             /* the data file's size: it counts against --max-data-total */
    int64_t steps, batch, seq, micro, seed, warmup, eval_every, eval_batches, ckpt_every;
    double lr, min_lr, holdout;
    int recompute, final_ckpt;
    int64_t learn_vocab; /* ids the tokenizer learns from the data first (coord_grow.c), or 0 */
    int objective;       /* core/train/objective.h; NL_OBJ_MODEL: the model's */
    int pack;            /* packed rows: <|end|> ends a document (nl_objective_batch) */
    int64_t pack_ends;   /* packed rows: the <|end|> ids in the data */
    /* where it is */
    int phase; /* tr_state (coord_train.c): the state machine's alone */
    int stages;
    nl_dataset *ds;            /* the token stream (clm, mlm) */
    nl_labelled *lds;          /* the labelled examples (classify) */
    int32_t *tokens, *targets; /* (batch, seq) */
    int32_t *docs;             /* (batch, seq): classify's padding, packed rows' documents */
    int32_t *labels, *lengths; /* classify: (batch) */
    int64_t valid;             /* the predictions this step's loss is over */
    double eval_rows;          /* an evaluation's predictions (mlm: the masked ones) */
    double eval_acc;           /* classify: the last evaluation's accuracy */
    int64_t start, step;       /* steps done */
    /* the job goes on from the source's step with its moments when the
     * stages hold it untouched: its --resume (or the journal's), a source
     * that continues (c->src_continues), or a checkpoint of its own; a
     * job without begins at step 0 from the weights the stages hold */
    int cont;
    int64_t early_plan; /* 1 + the start (step) of the plan judged last; 0: none */
    int early_judged;   /* judgements on that plan (at most EARLY_MAX) */
    int early_n;        /* early re-balances made (at most EARLY_MAX a job) */
    int early_ckpt;     /* the checkpoint being written is an early re-balance's */
    int moments;
    int64_t adam; /* AdamW steps the stages have taken */
    int acks, norms, have_loss;
    int skips;       /* steps skipped in a row (non-finite) */
    int seq_default; /* seq is the client's default, not typed: fit to max_seq_len */
    int bad_stage;   /* the stage whose report of this step was not finite, or -1 */
    uint16_t *got;   /* per stage: GRAD_NORM (1; DiLoCo: bit r, replica r's) or CKPT_DONE (2) in */
    uint16_t *took;  /* per stage: the replicas that took the job (bit r: replica r) */
    /* the step's hop digests as each stage reported them with its
     * GRAD_NORM: [dig_stages][micro][NL_DIGEST_KINDS][32] (coord_train_stages.c) */
    uint8_t *dig;
    int dig_stages;
    int64_t dig_mismatches; /* hops whose sender and receiver disagree, in all */
    /* the digests of the step's ACTIVATIONs into stage 0 as the coordinator
     * sent them, [micro][32] (coord_train_wire.c): stage 0's report of what
     * it received is compared with them, as a neighbour's would be */
    uint8_t *sent;
    /* verification by recompute (coord_train_verify.c): those under way,
     * and (stage, microbatch)s drawn, redone and found wrong so far */
    struct cverify *ver;
    int64_t verify_sampled, verify_done, verify_mismatches, verify_skipped;
    int64_t verify_convicted, verify_outvoted; /* arbitrated: stage wrong, verifier wrong */
    uint32_t verify_guilty;                    /* the node last convicted (0: none) */
    int verify_outputs; /* the stages keep what they send (cases across device classes) */
    /* the first step with a (stage, microbatch) drawn but not verified
     * clean: found wrong, skipped, withheld, unresolved or dropped
     * unanswered (INT64_MAX: none); a checkpoint is all-verified when its
     * step is before it and before every case still pending */
    int64_t verify_taint;
    /* the job's checkpoints, oldest first (coord_train_ckpt.c): the one it
     * began from (its base) and each it wrote since, none deleted; a
     * rollback goes to the newest all-verified one */
    struct cckpt *ckpts;
    int n_ckpts, cap_ckpts;
    int64_t convictions_seen; /* convictions (verify_convicted + outvoted) rolled back for */
    int rollbacks;            /* done: the checkpoints redone after one go to .redoN dirs */
    /* made again from the journal when the coordinator started (no client
     * yet): its checkpoint dir may hold manifests of steps after the one
     * the journal names (the coordinator stopped before it journaled
     * them); the steps it redoes write theirs beside them (.redoN) */
    int recovered;
    int restoring; /* a worker opens the manifest a rollback goes to */
    int rolled;    /* rolled back, not yet begun again: no later manifest resumed */
    int base_ckpt; /* the checkpoint being written is the job's base (step 0) */
    double sumsq, ce, aux, t_step, step_s;
    /* DiLoCo (--outer-every): each replica group's GRAD_NORM sums (over
     * the stages) and last stage's losses of the step, added in group
     * order once all are in (sumsq, ce, aux); the STEP of group r clips by
     * its own norm (coord_train_wire.c) */
    double lane_sumsq[NL_PLAN_MAX_REPLICAS], lane_ce[NL_PLAN_MAX_REPLICAS],
        lane_aux[NL_PLAN_MAX_REPLICAS];
    uint16_t loss_lanes; /* the groups whose LOSS is in */
    nl_step_result r;
    double lr_now, eval_loss;
    int has_eval;
    nl_manifest_shard *shards; /* the checkpoint being written */
    char manifest[4096];       /* the last one written (or the one resumed) */
    int64_t manifest_step;
    /* recoveries: a stage lost, the job goes on from the last manifest */
    int resumes;     /* done so far (at most --train-resumes) */
    double t_lost;   /* when the last stage was lost (0: none since the last step) */
    int64_t lost_at; /* the step it was lost at */
    /* a replica's node lost mid-step (SALVAGE): the loss, reported once
     * the step under way is saved from the survivors (or is not) */
    char salvage_why[512];
    int mem_replanned; /* the cluster planned again for its training memory */
    /* the plan on which a stage could not reach its neighbour (0: none) */
    uint64_t verdict_epoch;
    struct json_t *journal;      /* the client's parameters, journaled (coord_journal.c) */
    struct json_t *journal_from; /* the source it started from (NULL: it resumed a manifest) */
    cft *ft;    /* a fine-tuning job (coord_finetune.c): its adapters; NULL: training */
    int cancel; /* cancelled: the step under way ends, a checkpoint keeps it, then the job ends */
} ctrain;

/* strdup of s, or NULL for NULL; *oom set when the copy failed. */
static inline char *coord_train_dup(const char *s, int *oom)
{
    char *d = s ? strdup(s) : NULL;
    *oom |= s && !d;
    return d;
}

/* ---------------------------------------------------------------- coord_train_verify.c */

/* The step's reports are in and its STEP is about to go: VERIFY_REQ to the
 * stages of the (stage, microbatch)s drawn (--verify-rate). */
void coord_train_verify_sample(nl_coord *c, cjob *j);
/* A VERIFY_CASE (on to a verifier) or VERIFY_RESULT (compared). */
void coord_train_verify_msg(nl_coord *c, cjob *j, const nl_rx *rx);
void coord_train_verify_free(ctrain *t);
/* Whether some node's cases would go across device classes (no other
 * node of its class, one of another): the stages are then asked to keep
 * what they send (JOB_SUBMIT verify_outputs). */
int coord_train_verify_cross(nl_coord *c);
/* The last step through which every (stage, microbatch) drawn was
 * verified clean: a checkpoint at or before it is all-verified
 * (INT64_MAX when verification is off). */
int64_t coord_train_verified_through(const nl_coord *c, const ctrain *t);
/* The job goes on from step `step` (a resume, a rollback): the cases of
 * later steps, which are redone, are dropped, and so is what they found. */
void coord_train_verify_resume(ctrain *t, int64_t step);
/* The verifications under way. */
int coord_train_verify_pending(const ctrain *t);
/* The job's last step is done: a case not handed over is withheld
 * (convicted) when its stage has answered since (answered: the final
 * checkpoint's CKPT_DONE came after), else unverified, as one whose
 * verifier is gone; how many are still awaited. */
int coord_train_verify_settle(nl_coord *c, cjob *j, int answered);

/* ---------------------------------------------------------------- coord_train.c */

/* What moves a training job on: the stages' reports, counted (TAKEN,
 * REPORTED, EVALUATED, SHARDS), the leaves' workers (PREPARED, WRITTEN,
 * GROWN), the cluster (READY, LOST) and the client (CANCEL). The state
 * machine decides what each means in the state the job is in; no leaf
 * calls it: it calls them, and their workers report to the done it
 * gave them. */
typedef enum {
    TE_PREPARED,  /* the preparation's worker is done (in: its result) */
    TE_READY,     /* the cluster is loaded with a plan */
    TE_TAKEN,     /* every stage took the job (JOB_STATUS running) */
    TE_REPORTED,  /* the step's GRAD_NORMs and the last stage's LOSS are in */
    TE_EVALUATED, /* the evaluation's LOSS is in */
    TE_SHARDS,    /* every stage's CKPT_DONE is in */
    TE_SETTLED,   /* the last verification under way is answered */
    TE_WRITTEN,   /* the manifest's (or the adapters') worker is done (in) */
    TE_GROWN,     /* --grow auto's worker is done (in) */
    TE_RESTORED,  /* a rollback's manifest is opened (in) */
    TE_LOST,      /* a stage of the plan is lost (in->why) */
    TE_UNSAVED,   /* SALVAGE: a stage asked for its shard failed (in->why) */
    TE_GONE,      /* a node that held no stage is gone (a verifier, perhaps) */
    TE_CANCEL     /* a JOB_CANCEL (in->rx) */
} tr_event;

/* What an event brings (a worker's result, filled by its leaf); borrowed
 * for the call. */
typedef struct tr_in {
    const char *why;  /* a worker's failure (NULL: it succeeded), or the stage lost */
    int64_t step;     /* the step a checkpoint was of */
    const char *path; /* the file written: a manifest, the adapter file */
    void *task;       /* the leaf's task: what it made (coord_train_prepared takes it) */
    const nl_rx *rx;  /* TE_CANCEL: the request */
} tr_in;

/* A worker's end (cwork.done): the state machine's, given to the leaf
 * that starts the worker. */
typedef void (*tr_done)(nl_coord *c, cwork *w);

/* The transition function: what event ev (with in) does to job j in the
 * state it is in; every transition starts here. For LOST and CANCEL, 1 if
 * the job goes on, 0 if it ends now (cjob_ops). */
int coord_train_on(nl_coord *c, cjob *j, tr_event ev, const tr_in *in);
/* The leaves' workers report to the state machine through these
 * (cwork.done, coord_train_ops.c): the preparation, a manifest, the
 * adapter file, a rollback's checkpoint opened, the growth. */
void coord_train_done_prepared(nl_coord *c, cwork *w);
void coord_train_done_manifest(nl_coord *c, cwork *w);
void coord_train_done_adapters(nl_coord *c, cwork *w);
void coord_train_done_restored(nl_coord *c, cwork *w);
void coord_train_done_grown(nl_coord *c, cwork *w);
/* The event the stages' reports make in the job's state (-1: none). */
int coord_train_awaits(const ctrain *t);
/* Whether the job has begun (its stages were sent it). */
int coord_train_begun(const ctrain *t);
/* Whether the job changed the stages' weights (or the moments they took). */
int coord_train_touched(const nl_coord *c, const ctrain *t);
/* Whether the job saves the step under way after a replica's loss
 * (SALVAGE): the cluster keeps its plan until it is done. */
int coord_train_salvaging(const ctrain *t);
/* A submitted job (t made, t->ft set) begins: its preparation (NULL), or
 * why it fails. */
const char *coord_train_start(nl_coord *c, cjob *j, const nl_msg_job_submit *s, char *why,
                              size_t cap);

/* ---------------------------------------------------------------- coord_train_prep.c */

/* Why no training job (finetune 0) or fine-tuning job may begin now
 * (another runs: one training job at a time, none beside fine-tuning,
 * which needs the weights frozen), in why; or NULL. */
const char *coord_train_refusal(const nl_coord *c, int finetune, char *why, size_t cap);
/* The client's parameters read and checked into t, its paths confined
 * under the roots, the job journaled, and the worker started that verifies
 * the manifest it resumes from, grows the vocabulary (--learn-vocab) and
 * reads the data (then done: TE_PREPARED, in->task the worker's task).
 * NULL, or why the job fails (in why). */
const char *coord_train_prepare(nl_coord *c, cjob *j, const nl_msg_job_submit *s, tr_done done,
                                char *why, size_t cap);
/* TE_PREPARED: what the worker made goes into the cluster (a resumed
 * manifest, a grown vocabulary: the stages reload) and the job (the data,
 * the batches' buffers), checked against the model. NULL, or why the job
 * fails (in why). */
const char *coord_train_prepared(nl_coord *c, cjob *j, const tr_in *in, char *why, size_t cap);

/* As the job begins: plans hold its training memory from now on
 * (c->train_mem). 1 if the current plan does; 0 if the cluster must plan
 * again (the client is told; once: a second time, or with weights trained
 * since the last checkpoint, is -1); -1 and why when no plan can. */
int coord_train_memory(nl_coord *c, cjob *j, char *why, size_t cap);
/* Why a training job cannot run with neurocoord --outer-every (DiLoCo):
 * a resume, steps or a checkpoint interval that are not multiples of H;
 * NULL when it can. */
const char *coord_train_diloco_refusal(const nl_coord *c, const ctrain *t, int resume, char *why,
                                       size_t cap);
/* Why the plan's replicas cannot run the job (microbatches that do not
 * divide among a stage's, DiLoCo without replica groups), in why; or
 * NULL. */
const char *coord_train_replicas_refusal(const nl_coord *c, const ctrain *t, char *why, size_t cap);
/* The job takes the ready plan (its tables sized to the stages, its
 * epoch), at the source's step with its moments when it continues it
 * (t->cont), else at step 0; NULL, or why it cannot begin (in why). */
const char *coord_train_take_plan(nl_coord *c, cjob *j, char *why, size_t cap);
/* Frees the job's state (NULL-safe). */
void coord_train_state_free(ctrain *t);

/* ---------------------------------------------------------------- coord_train_ckpt.c */

/* Where the stages write this step's shards: DIR/step-NNNNNN, or (a
 * fine-tuning job's adapters) DIR/lora-job<ID>; the steps redone after a
 * rollback: DIR/step-NNNNNN.redoN; the step saved when a replica was lost
 * (SALVAGE) before resume N: DIR/step-NNNNNN.resumeN. */
void coord_train_ckpt_dir(const cjob *j, char *buf, size_t cap);
/* Whether the step under way can be saved from the survivors now that a
 * node was lost in it (the state machine checks that a step is under
 * way): a training job (not DiLoCo, whose replica groups differ between
 * outer steps) with steps done since its source, no conviction to roll
 * back for, and a live replica on every stage. */
int coord_train_salvage_can(nl_coord *c, const ctrain *t);
/* After a step: 1 if the early re-balance (--rebalance-after) finds the
 * stages' measured speeds call for another plan, so that the job takes a
 * checkpoint now and re-plans at it (judged at most a few times a job). */
int coord_train_early_ckpt(nl_coord *c, cjob *j);
/* A stage's CKPT_DONE (from node n, checked as the step's) into the job's
 * table of shards; NULL, or why the job fails (in why). */
const char *coord_train_shard(nl_coord *c, cjob *j, const cnode *n, const nl_msg_ckpt_done *d,
                              char *why, size_t cap);
/* Frees n shards' strings and the table. */
void coord_train_free_shards(nl_manifest_shard *sh, int n);
/* Every shard is in: a worker writes the manifest last and verifies it
 * (then done); NULL, or why the job fails (in why). Its result, on the
 * loop (the manifest no longer counts as being written), for TE_WRITTEN. */
const char *coord_train_write_manifest(nl_coord *c, cjob *j, tr_done done, char *why, size_t cap);
void coord_train_manifest_result(nl_coord *c, cwork *w, tr_in *in);
/* TE_WRITTEN of a manifest: it becomes the source (the stages hold its
 * weights), journaled, the job's last checkpoint. */
void coord_train_keep(nl_coord *c, cjob *j, const tr_in *in);
/* The job's checkpoints: one more (path copied; the last one again is
 * not added), -1 out of memory; the base (what the job begins
 * from, as it first begins: the source, or nothing restorable when the
 * stages hold weights no file has); the newest all-verified one
 * (coord_train_verified_through), or NULL; those after it forgotten (a
 * rollback: their files stay); and whether the source is k. */
int coord_train_ckpt_add(ctrain *t, int64_t step, const char *path, int manifest, int cont);
int coord_train_ckpt_base(const nl_coord *c, ctrain *t);
int coord_train_ckpt_is_source(const nl_coord *c, const cckpt *k);
const cckpt *coord_train_ckpt_verified(const nl_coord *c, const ctrain *t);
void coord_train_ckpt_forget_after(ctrain *t, int64_t step);
void coord_train_ckpts_free(ctrain *t);
/* A rollback's checkpoint k (a manifest, or a --model file) opened and
 * checked by a worker (then done); its result, on the loop, for
 * TE_RESTORED (in->task: the task, whose source coord_train_restore
 * installs, and the job continues it or begins from it). NULL, or why the
 * job fails. */
const char *coord_train_open_ckpt(nl_coord *c, cjob *j, const cckpt *k, tr_done done, char *why,
                                  size_t cap);
void coord_train_restore_result(nl_coord *c, cwork *w, tr_in *in);
/* A conviction: the job goes back to its newest all-verified checkpoint
 * (reported; the later ones forgotten, the verification of their steps
 * dropped, the checkpoints redone written to .redoN directories): 1 when
 * a worker opens it (coord_train_open_ckpt, then done), 0 when the job
 * goes on from the source, -1 and why when the job fails (none, or one
 * that cannot be restored). */
int coord_train_rollback(nl_coord *c, cjob *j, tr_done done, char *why, size_t cap);
void coord_train_restore(nl_coord *c, cjob *j, const tr_in *in);
/* --grow auto at a checkpoint: 1 when a worker grows the model (then
 * done, w a coord_grow_task), 0 when it does not grow. */
int coord_train_grow(nl_coord *c, cjob *j, tr_done done);
/* A failed or cancelled job ends (cjob_ops.abort): the stages end it and,
 * when it changed their weights (touched: the machine judges from its
 * state), reload them from the source. */
void coord_train_unwind(nl_coord *c, cjob *j, int touched);

/* ---------------------------------------------------------------- coord_train_stages.c */

/* A stage's report (JOB_STATUS running, GRAD_NORM, LOSS, CKPT_DONE),
 * checked and counted into the job whose state awaits event `awaits`
 * (-1: none): 1 when it completes that event, 0 when not (or it is not
 * taken), -1 when it cannot be true (why: the job fails). */
int coord_train_stage_report(nl_coord *c, cjob *j, const nl_rx *rx, int awaits, char *why,
                             size_t cap);
/* A stage reports that it failed the job (why names it) that has begun
 * (or not): 1 if the job waits for the heartbeat verdict on a lost
 * neighbour (cjob_ops.node_failed), 0 if it fails. */
int coord_train_stage_failed(nl_coord *c, cjob *j, int begun, const char *why);
/* Whether node n was asked for its stage's shard of the checkpoint under
 * way and has not sent it. */
int coord_train_shard_awaited(nl_coord *c, const ctrain *t, const cnode *n);
/* Stage s cannot be reached: the job waits for its node to be declared
 * dead (then LOST resumes it) if it may resume, else it fails now. */
void coord_train_unreachable(nl_coord *c, cjob *j, int s);

/* ---------------------------------------------------------------- coord_train_wire.c */

/* To every stage, each 0, or -1 and *lost the stage that cannot be
 * reached: JOB_SUBMIT (the job's shapes, where it starts, the model's
 * growth history, a fine-tuning job's adapters); STEP (step t->step + 1
 * applied unless t->r skipped it, with scale and t->lr_now); CKPT_REQ
 * (step t->step's shards into dir); JOB_CANCEL (the job ended: the
 * stages free their trainers; one that cannot be reached is declared
 * dead at the tick). */
int coord_train_send_job(nl_coord *c, cjob *j, int *lost);
int coord_train_send_decision(nl_coord *c, cjob *j, double scale, int *lost);
int coord_train_send_ckpt_req(nl_coord *c, cjob *j, const char *dir, int *lost);
void coord_train_send_end(nl_coord *c, cjob *j);

/* Batch `index` of a split (0: training, 1: held out) into t->tokens and
 * the objective's arrays; *valid: the predictions its loss is over. */
nl_status coord_train_make_batch(const nl_coord *c, ctrain *t, int split, uint64_t index,
                                 int64_t *valid, nl_error *e);
/* The held-out batches of an evaluation. */
int64_t coord_train_eval_batches(const ctrain *t);
/* Step t->step + 1's batch (made) to the first stage, its expert counts
 * first: 0, or -1 when the first stage cannot be reached. */
int coord_train_send_step(nl_coord *c, cjob *j);
/* An evaluation's held-out batches to the first stage: 0; -1 and e when a
 * batch cannot be made; 1 when the first stage cannot be reached. */
int coord_train_send_eval(nl_coord *c, cjob *j, nl_error *e);

/* ---------------------------------------------------------------- coord_train_report.c */

/* JOB_STATUS `state` to the client with a JSON report; takes the
 * reference to o. */
void coord_train_report(nl_coord *c, cjob *j, int state, const char *msg, struct json_t *o);
/* The run begins (or resumes): its figures, each stage's device. */
void coord_train_report_start(nl_coord *c, cjob *j);
/* The step (and its evaluation) is done. */
void coord_train_report_step(nl_coord *c, cjob *j);
/* A checkpoint is kept (its step and manifest). */
void coord_train_report_ckpt(nl_coord *c, cjob *j, int64_t step, const char *manifest);
/* The job ends, done or cancelled with its steps kept: the client is told
 * where they are. */
void coord_train_report_end(nl_coord *c, cjob *j, int cancelled);
/* A JOB_CANCEL (rx) is taken: the job stops after step k (first: the
 * first cancel, logged). */
void coord_train_report_stopping(nl_coord *c, cjob *j, const nl_rx *rx, int64_t k, int first);
/* A conviction: the job rolls back from step `from` to the checkpoint k,
 * the newest all-verified one. */
void coord_train_report_rollback(nl_coord *c, cjob *j, int64_t from, const cckpt *k);
/* A stage was lost (why) at t->lost_at: the job resumes from the source. */
void coord_train_report_lost(nl_coord *c, cjob *j, const char *why);
/* The tail of a failure message: the last checkpoint (cjob_ops.fail_note). */
void coord_train_fail_note(const cjob *j, char *buf, size_t cap);

/* ---------------------------------------------------------------- coord_finetune.c */

/* A client's JOB_SUBMIT of kind finetune: the adapters' parameters
 * checked; NULL when they are refused (the client is answered). */
cft *coord_finetune_params(nl_coord *c, const nl_rx *rx);
/* The stages' JOB_SUBMIT parameters of the adapters (into ps, at most
 * COORD_FT_PARAMS; borrowed from ft): how many. */
int coord_finetune_stage_params(const cft *ft, int64_t seed, nl_wire_param *ps);
/* Every stage's adapter shard (sh[0..n), in dir) is in: a worker checks
 * their hashes and joins them into dir/adapter.safetensors (then done).
 * Its result, for TE_WRITTEN (in->path: the file). */
nl_status coord_finetune_gather(nl_coord *c, uint64_t job, const cft *ft,
                                const nl_manifest_shard *sh, int n, const char *dir, tr_done done,
                                nl_error *err);
void coord_finetune_result(cwork *w, tr_in *in);

#endif
