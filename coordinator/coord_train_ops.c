/* The training and fine-tuning jobs' face to the rest of the coordinator:
 * their operations tables (cjob_ops) and the ends of the workers their
 * leaves start (cwork.done), each turned into an event of the job's state
 * machine (coord_train_on, coord_train.c), which this file calls and
 * which calls it only by handing those ends to the leaves. */
#include <stdlib.h>

#include "base/log.h"
#include "coordinator/coord_train_impl.h"

static void train_free(cjob *j)
{
    coord_train_state_free(j->state);
    j->state = NULL;
}

/* A stage's report (cjob_ops.on_message): the last one the state awaits
 * is its event. */
static void train_on_message(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const ctrain *t = j->state;
    char why[900];
    const int ev = t ? coord_train_awaits(t) : -1;
    const int rc = coord_train_stage_report(c, j, rx, ev, why, sizeof why);
    if (rc < 0)
        coord_job_fail(c, j, why);
    else if (rc > 0)
        coord_train_on(c, j, (tr_event)ev, NULL);
}

/* A training job (ft NULL) or a fine-tuning one (takes ft). */
static void submit(nl_coord *c, const nl_rx *rx, cft *ft)
{
    char why[900];
    if (coord_train_refusal(c, ft != NULL, why, sizeof why)) {
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, why, NULL);
        free(ft);
        return;
    }
    cjob *j = coord_job_new(c, rx, ft ? &coord_finetune_ops : &coord_train_ops);
    if (!j) {
        free(ft);
        return;
    }
    ctrain *t = j->state = calloc(1, sizeof *t);
    if (!t) {
        free(ft);
        coord_job_fail(c, j, "out of memory");
        return;
    }
    t->ft = ft;
    t->recovered = rx->rid_len == 0; /* from the journal (coord_journal_recover): no client */
    if (coord_train_start(c, j, &rx->msg.u.job_submit, why, sizeof why))
        coord_job_fail(c, j, why);
}

static void train_submit(nl_coord *c, const nl_rx *rx)
{
    submit(c, rx, NULL);
}

static void finetune_submit(nl_coord *c, const nl_rx *rx)
{
    cft *ft = coord_finetune_params(c, rx);
    if (ft)
        submit(c, rx, ft);
}

/* ---------------------------------------------------------------- the workers' ends */

/* A worker's result for the job it worked for (nothing if it has ended). */
static void on_work(nl_coord *c, const cwork *w, tr_event ev, const tr_in *in)
{
    cjob *j = coord_job_find(c, w->job_id);
    if (j && j->state && (j->ops == &coord_train_ops || j->ops == &coord_finetune_ops))
        coord_train_on(c, j, ev, in);
}

void coord_train_done_prepared(nl_coord *c, cwork *w)
{
    const tr_in in = {.task = w};
    on_work(c, w, TE_PREPARED, &in);
}

void coord_train_done_manifest(nl_coord *c, cwork *w)
{
    tr_in in;
    coord_train_manifest_result(c, w, &in);
    on_work(c, w, TE_WRITTEN, &in);
}

void coord_train_done_adapters(nl_coord *c, cwork *w)
{
    tr_in in;
    coord_finetune_result(w, &in);
    on_work(c, w, TE_WRITTEN, &in);
}

void coord_train_done_restored(nl_coord *c, cwork *w)
{
    tr_in in;
    coord_train_restore_result(c, w, &in);
    on_work(c, w, TE_RESTORED, &in);
}

void coord_train_done_grown(nl_coord *c, cwork *w)
{
    const coord_grow_task *k = (const coord_grow_task *)w;
    const tr_in in = {.why = k->st == NL_OK ? NULL : k->err.msg, .task = w};
    on_work(c, w, TE_GROWN, &in);
}

/* ---------------------------------------------------------------- the job kind's ops */

/* A failed or cancelled job: the stages end it, and those whose weights it
 * changed reload them from the source (coord_train_unwind). */
static void train_abort(nl_coord *c, cjob *j)
{
    const ctrain *t = j->state;
    if (t && coord_train_salvaging(t)) /* the plan it kept after a loss goes */
        coord_release_plan(c);
    coord_train_unwind(c, j, t && coord_train_touched(c, t));
}

static int train_stage_lost(nl_coord *c, cjob *j, const char *why)
{
    const tr_in in = {.why = why};
    return j->state ? coord_train_on(c, j, TE_LOST, &in) : 1; /* 2: SALVAGE keeps the plan */
}

static int train_cancel(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const tr_in in = {.rx = rx};
    return j->state && coord_train_on(c, j, TE_CANCEL, &in);
}

static void train_node_gone(nl_coord *c, cjob *j)
{
    if (j->state)
        coord_train_on(c, j, TE_GONE, NULL);
}

static void train_ready(nl_coord *c, cjob *j)
{
    coord_train_on(c, j, TE_READY, NULL);
}

/* A stage failed the job: 1 if it goes on, waiting for the heartbeat
 * verdict on a lost neighbour (coord_train_stage_failed), or (SALVAGE)
 * the loss being handled already. There a stage asked for its shard ends
 * the save (UNSAVED) when the shard is what failed (req CKPT_REQ, or
 * unknown); a failure of its step (a send to the lost node, reported
 * before the request reached it) leaves its weights whole, and the
 * request it has yet to answer is awaited (stage_train.c, on_ckpt). */
static int train_node_failed(nl_coord *c, cjob *j, const cnode *n, uint32_t req, const char *why)
{
    const ctrain *t = j->state;
    if (t && coord_train_salvaging(t)) { /* a loss is being handled: the step is saved, or not */
        const tr_in in = {.why = why};
        if (!coord_train_shard_awaited(c, t, n))
            return 1;
        if (req == 0 || req == NL_MSG_CKPT_REQ)
            coord_train_on(c, j, TE_UNSAVED, &in);
        else
            NL_INFO("train job %llu: %s; its shard of the steps done is awaited",
                    (unsigned long long)j->id, why);
        return 1;
    }
    return t && coord_train_stage_failed(c, j, coord_train_begun(t), why);
}

#define TRAIN_TAKES                                                                                \
    (COORD_TAKES(NL_MSG_JOB_STATUS) | COORD_TAKES(NL_MSG_GRAD_NORM) | COORD_TAKES(NL_MSG_LOSS) |   \
     COORD_TAKES(NL_MSG_CKPT_DONE) | COORD_TAKES(NL_MSG_VERIFY_CASE) |                             \
     COORD_TAKES(NL_MSG_VERIFY_RESULT))

const cjob_ops coord_train_ops = {
    .kind = NL_JOB_TRAIN,
    .name = "train",
    .takes = TRAIN_TAKES,
    .submit = train_submit,
    .on_message = train_on_message,
    .stage_lost = train_stage_lost,
    .node_gone = train_node_gone,
    .node_failed = train_node_failed,
    .ready = train_ready,
    .abort = train_abort,
    .cancel = train_cancel,
    .fail_note = coord_train_fail_note,
    .free = train_free,
};

/* A fine-tuning job is a training job in all but its submission (its
 * adapters' parameters: coord_finetune.c) and its failure note. */
const cjob_ops coord_finetune_ops = {
    .kind = NL_JOB_FINETUNE,
    .name = "finetune",
    .takes = TRAIN_TAKES,
    .submit = finetune_submit,
    .on_message = train_on_message,
    .stage_lost = train_stage_lost,
    .node_gone = train_node_gone,
    .node_failed = train_node_failed,
    .ready = train_ready,
    .abort = train_abort,
    .cancel = train_cancel,
    .fail_note = NULL,
    .free = train_free,
};
