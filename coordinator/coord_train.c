/* The coordinator's training job: a worker reads and tokenizes the data
 * (and verifies the manifest it resumes from), then the job feeds each
 * step's microbatches to the first stage (the targets ride along to
 * the last), sums the stages' gradient norms, decides every step (apply
 * with the learning rate and clipping scale, or skip on a non-finite
 * value), runs the evaluations, asks every stage for its checkpoint shard
 * and has a worker write the manifest last and verify it. The client sees
 * JOB_STATUS messages with a JSON report per event (docs/cluster.md,
 * "Training"). */
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "coord_impl.h"
#include "core/checkpoint.h"
#include "core/fileio.h"
#include "core/grow.h"
#include "core/train.h"

/* TR_PREPARING: a worker reads the data (and the manifest it resumes);
 * TR_LOADING: the cluster loads */
/* The growth entries a training job sends its stages, at most (the wire
 * takes 64 params; the job's own are 9). */
#define COORD_GROWTH_PARAMS 48

/* TR_GROW: at a checkpoint, a worker grows the model (--grow auto) */
typedef enum {
    TR_PREPARING = 0,
    TR_LOADING,
    TR_BEGIN,
    TR_STEP,
    TR_EVAL,
    TR_CKPT,
    TR_GROW
} tr_phase;

typedef struct ctrain {
    /* the run, as the client asked for it */
    char data[4097], ckpt_dir[1001]; /* CKPT_REQ.dir holds at most 1024 bytes */
    int64_t steps, batch, seq, micro, seed, warmup, eval_every, eval_batches, ckpt_every;
    double lr, min_lr, holdout;
    int recompute, final_ckpt;
    int64_t learn_vocab; /* ids the tokenizer learns from the data first (coord_grow.c), or 0 */
    /* where it is */
    int phase, stages;
    nl_dataset *ds;
    int32_t *tokens, *targets; /* (batch, seq) */
    int64_t start, step;       /* steps done */
    int moments;
    int64_t adam; /* AdamW steps the stages have taken */
    int acks, norms, have_loss;
    int skips;     /* steps skipped in a row (non-finite) */
    int seq_default; /* seq is the client's default, not typed: fit to max_seq_len */
    int bad_stage; /* the stage whose report of this step was not finite, or -1 */
    uint8_t *got; /* per stage: GRAD_NORM (1) or CKPT_DONE (2) in */
    double sumsq, ce, aux, t_step, step_s;
    nl_step_result r;
    double lr_now, eval_loss;
    int has_eval;
    nl_manifest_shard *shards; /* the checkpoint being written */
    char manifest[4096];       /* the last one written (or the one resumed) */
    int64_t manifest_step;
    /* recoveries: a stage lost, the job goes on from the last manifest */
    int resumes;       /* done so far (at most --train-resumes) */
    double t_lost;     /* when the last stage was lost (0: none since the last step) */
    int64_t lost_at;   /* the step it was lost at */
    int mem_replanned; /* the cluster planned again for its training memory */
    /* the plan on which a stage could not reach its neighbour (0: none) */
    uint64_t verdict_epoch;
    json_t *journal;   /* the client's parameters, journaled (coord_journal.c) */
    cft *ft;           /* a fine-tuning job (coord_finetune.c): its adapters; NULL: training */
} ctrain;

static void free_shards(nl_manifest_shard *sh, int n)
{
    for (int i = 0; sh && i < n; i++) {
        free(sh[i].file);
        free(sh[i].path);
        free(sh[i].node);
        free(sh[i].device);
    }
    free(sh);
}

static void train_free(cjob *j)
{
    ctrain *t = j->state;
    if (!t)
        return;
    nl_dataset_destroy(&t->ds);
    free(t->tokens);
    free(t->targets);
    free(t->got);
    free_shards(t->shards, t->stages);
    json_decref(t->journal);
    free(t->ft);
    free(t);
    j->state = NULL;
}

static void train_fail_note(const cjob *j, char *buf, size_t cap)
{
    const ctrain *t = j->state;
    if (!t)
        return;
    if (t->manifest[0])
        snprintf(buf, cap, "; last checkpoint: step %lld (%s)", (long long)t->manifest_step,
                 t->manifest);
    else
        snprintf(buf, cap, "; no checkpoint was written by this job (it began at step %lld)",
                 (long long)t->start);
}

/* ---------------------------------------------------------------- reports */

static json_t *jnum(double x)
{
    return isfinite(x) ? json_real(x) : json_null();
}

/* JOB_STATUS running (or done) to the client with a JSON report; takes
 * the reference to o. */
static void report(nl_coord *c, cjob *j, int state, const char *msg, json_t *o)
{
    const ctrain *t = j->state;
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    const double progress = t->steps > 0 ? (double)t->step / (double)t->steps : 0.0;
    coord_status_to(c, j->rid, j->rid_len, j->id, state, progress > 1 ? 1 : progress, msg, text);
    free(text);
}

static void fail(nl_coord *c, cjob *j, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void fail(nl_coord *c, cjob *j, const char *fmt, ...)
{
    char why[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    coord_job_fail(c, j, why);
}

/* ---------------------------------------------------------------- sending */

/* Send m to every stage; -1 and *lost the stage that cannot be reached. */
static int send_all(nl_coord *c, nl_wire_msg *m, int *lost)
{
    for (int s = 0; s < c->plan->n_stages; s++) {
        cnode *n = coord_stage_node(c, s);
        if (!n || coord_send_node(c, n, m) != NL_OK) {
            *lost = s;
            return -1;
        }
    }
    return 0;
}

/* Stage s cannot be reached. Its node is declared dead at this turn's
 * tick, and the job then resumes on the nodes left (train_stage_lost) if
 * it may; otherwise it fails now, naming the node. */
static void unreachable(nl_coord *c, cjob *j, int s)
{
    cnode *n = coord_stage_node(c, s);
    const nl_plan_stage *ps = &c->plan->stages[s];
    const ctrain *t = j->state;
    if (n && n->unreachable && t->resumes < c->o.train_resumes) {
        NL_INFO("train job %llu: node %u (stage %d) cannot be reached; the job waits for it to "
                "be declared dead, then resumes",
                (unsigned long long)j->id, n->id, s);
        return;
    }
    if (n)
        fail(c, j, "node %u (stage %d, layers [%d, %d), %s) %s", n->id, s, ps->l0, ps->l1,
             n->endpoint, n->why[0] ? n->why : "cannot be reached");
    else
        fail(c, j, "stage %d has no live node", s);
}

/* A hop of `type` with microbatch j of the batch in tokens/targets to
 * stage 0. */
static int send_hop(nl_coord *c, cjob *j, nl_msg_type type, uint64_t step, uint32_t mb,
                    const int32_t *tokens, const int32_t *targets)
{
    const ctrain *t = j->state;
    const int64_t shape[2] = {t->batch / t->micro, t->seq};
    cnode *first = coord_stage_node(c, 0);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, type);
    m.u.hop = (nl_msg_tensor_hop){j->id, step, mb, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], tokens, NL_DTYPE_I32, shape, 2); /* copied by the send */
    m.nframes = 1;
    if (targets) {
        nl_wire_frame_set(&m.frames[1], targets, NL_DTYPE_I32, shape, 2);
        m.nframes = 2;
    }
    int rc = first && coord_send_node(c, first, &m) == NL_OK ? 0 : -1;
    nl_wire_msg_free(&m);
    return rc;
}

/* ---------------------------------------------------------------- the run */

static void start_step(nl_coord *c, cjob *j);

/* The job waits while the cluster plans again and reloads from its
 * source (the last verified manifest, or what the job began from); once
 * ready, begin() continues from the source's step (or the start). */
static void wait_reload(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    t->start = t->step = 0;
    t->moments = 0;
    t->adam = 0;
    t->phase = TR_LOADING;
    j->phase = JOB_WAITING;
    j->last_progress = coord_now();
    (void)c;
}

/* Plans hold the job's training memory from now on; 1 if the current plan
 * does, 0 if the job now waits for a plan that does (or failed). */
static int plan_for_training(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    char why[400];
    c->train_mem = (nl_mem_opts){.training = 1,
                                 .micro_rows = (int)(t->batch / t->micro * t->seq),
                                 .in_flight = (int)t->micro,
                                 .recompute = t->recompute};
    if (coord_plan_holds(c, &c->train_mem, why, sizeof why))
        return 1;
    char none[400];
    if (!coord_plan_possible(c, none, sizeof none)) {
        fail(c, j, "training memory: %s; and no plan over the nodes holds it: %s", why, none);
        return 0;
    }
    if (t->mem_replanned || c->stages_modified) {
        fail(c, j, "training memory: %s%s", why,
             c->stages_modified ? " (the stages hold weights trained since the last checkpoint, "
                                  "so the cluster does not plan again)"
                                : "");
        return 0;
    }
    t->mem_replanned = 1;
    NL_INFO("train job %llu: %s; planning again for training memory", (unsigned long long)j->id,
            why);
    char msg[500];
    snprintf(msg, sizeof msg, "%s; planning again for training memory", why);
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg, NULL);
    wait_reload(c, j);
    coord_reload(c); /* a plan that cannot hold it fails the job with the shortfall */
    return 0;
}

/* The model's growth history for the stages (params growth.N, one entry
 * each: a parameter string holds at most 4096 bytes): their trainers count
 * the AdamW bias correction of what a growth created from its birth, as
 * local training does (node/stage_train.c). Entries born at step 0 change
 * nothing and are left out; of the others the last COORD_GROWTH_PARAMS go.
 * Returns how many params it filled; texts[] are the caller's to free. */
static int growth_params(const nl_coord *c, nl_wire_param *ps, char keys[][24], char **texts)
{
    int n = 0, first = c->n_growth;
    for (int i = c->n_growth - 1; i >= 0 && n < COORD_GROWTH_PARAMS; i--)
        if (c->growth[i].adam_steps > 0) {
            first = i;
            n++;
        }
    n = 0;
    for (int i = first; i < c->n_growth; i++) {
        char *text = c->growth[i].adam_steps > 0 ? nl_growth_to_json(&c->growth[i], 1) : NULL;
        if (!text)
            continue;
        if (strlen(text) > 4096) {
            NL_WARN("growth entry %d is longer than a parameter: its new parameters' AdamW bias "
                    "correction counts from step 1",
                    i);
            free(text);
            continue;
        }
        snprintf(keys[n], sizeof keys[n], "growth.%d", i);
        texts[n] = text;
        ps[n] = (nl_wire_param){.key = keys[n], .kind = NL_WIRE_PARAM_STR, .s = text};
        n++;
    }
    return n;
}

static void begin(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    /* a fine-tuning job keeps no moments of the base: each stage checks
     * that its adapters' job fits, and the plan stays as it is */
    if (!t->ft && !plan_for_training(c, j))
        return;
    free(t->got);
    free_shards(t->shards, t->stages); /* a resumed job's, of its former plan */
    t->stages = c->plan->n_stages;
    t->got = calloc((size_t)t->stages, 1);
    t->shards = calloc((size_t)t->stages, sizeof *t->shards);
    if (!t->got || !t->shards) {
        fail(c, j, "out of memory");
        return;
    }
    j->phase = JOB_RUNNING;
    j->epoch = c->epoch;
    if (c->resumable && !t->ft) { /* the stages hold a manifest's weights and moments */
        t->start = t->step = c->src_step;
        t->moments = 1;
        t->adam = c->src_adam;
        snprintf(t->manifest, sizeof t->manifest, "%s", c->src_path);
        t->manifest_step = c->src_step;
    }
    if (t->start >= t->steps) {
        fail(c, j, "--steps %lld: the cluster's model is already at step %lld", (long long)t->steps,
             (long long)t->start);
        return;
    }
    nl_wire_param ps[9 + COORD_GROWTH_PARAMS + COORD_FT_PARAMS] = {
        {.key = "job", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)j->id},
        {.key = "micro_batch", .kind = NL_WIRE_PARAM_INT, .i = t->batch / t->micro},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = t->seq},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = t->micro},
        {.key = "recompute", .kind = NL_WIRE_PARAM_BOOL, .b = t->recompute != 0},
        {.key = "start_step", .kind = NL_WIRE_PARAM_INT, .i = t->start},
        {.key = "adam_steps", .kind = NL_WIRE_PARAM_INT, .i = t->adam},
        {.key = "moments", .kind = NL_WIRE_PARAM_BOOL, .b = t->moments != 0},
        {.key = "eval_hops",
         .kind = NL_WIRE_PARAM_INT,
         .i = t->eval_every > 0 ? t->eval_batches * t->micro : 0},
    };
    char keys[COORD_GROWTH_PARAMS][24], *texts[COORD_GROWTH_PARAMS] = {NULL};
    int np = 9 + growth_params(c, ps + 9, keys, texts);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    np += t->ft ? coord_finetune_stage_params(t->ft, t->seed, ps + np) : 0;
    m.u.job_submit = (nl_msg_job_submit){t->ft ? NL_JOB_FINETUNE : NL_JOB_TRAIN, (uint32_t)np, ps};
    int lost = 0, rc = send_all(c, &m, &lost);
    nl_wire_msg_free(&m);
    for (int i = 0; i < COORD_GROWTH_PARAMS; i++)
        free(texts[i]);
    if (rc != 0) {
        unreachable(c, j, lost);
        return;
    }
    t->phase = TR_BEGIN;
    t->acks = 0;
    json_t *o = json_pack(
        "{s:s,s:I,s:I,s:I,s:I,s:I,s:i,s:I,s:I,s:I}", "event", "start", "start_step",
        (json_int_t)t->start, "steps", (json_int_t)t->steps, "params",
        (json_int_t)nl_config_param_count(&c->cfg), "tokens", (json_int_t)t->ds->n_train,
        "held_out", (json_int_t)(t->ds->n - t->ds->n_train), "stages", t->stages, "batch",
        (json_int_t)t->batch, "seq", (json_int_t)t->seq, "microbatches", (json_int_t)t->micro);
    json_t *devices = json_array(); /* each stage's device, as its node's JOIN said */
    for (int s = 0; devices && s < t->stages; s++) {
        cnode *n = coord_stage_node(c, s);
        json_array_append_new(devices, n ? json_string(n->device) : json_null());
    }
    json_object_set_new(o, "devices", devices);
    if (t->resumes > 0) { /* the nodes' plan after a loss */
        json_object_set_new(o, "resumes", json_integer(t->resumes));
        json_object_set_new(o, "plan", json_integer((json_int_t)c->epoch));
        json_object_set_new(o, "since_lost_s", jnum(coord_now() - t->t_lost));
        NL_INFO("train job %llu: resumed at step %lld on plan %llu (%d stages), %.2f s after the "
                "loss (resume %d of %d)",
                (unsigned long long)j->id, (long long)t->start, (unsigned long long)c->epoch,
                t->stages, coord_now() - t->t_lost, t->resumes, c->o.train_resumes);
    }
    report(c, j, NL_JOB_RUNNING, t->resumes > 0 ? "resumed" : "starting", o);
    NL_INFO("train job %llu: %lld steps of %lld x %lld in %lld microbatches on %d stages, from "
            "step %lld%s",
            (unsigned long long)j->id, (long long)t->steps, (long long)t->batch, (long long)t->seq,
            (long long)t->micro, t->stages, (long long)t->start,
            t->moments ? " (resumed with the manifest's moments)" : "");
}

static void start_step(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    nl_error e = {0};
    const uint64_t k = (uint64_t)t->step + 1;
    const size_t rows = (size_t)(t->batch / t->micro) * (size_t)t->seq;
    if (nl_dataset_batch(t->ds, 0, (uint64_t)t->seed, (uint64_t)t->step, (int)t->batch, (int)t->seq,
                         t->tokens, t->targets, &e) != NL_OK) {
        fail(c, j, "%s", e.msg);
        return;
    }
    t->t_step = coord_now();
    t->phase = TR_STEP;
    /* until a checkpoint of these weights is the source (fine-tuning
     * leaves the weights as they are) */
    if (!t->ft)
        c->stages_modified = 1;
    t->norms = t->have_loss = 0;
    t->sumsq = t->ce = t->aux = 0.0;
    memset(t->got, 0, (size_t)t->stages);
    /* the batch's expert shares first (DESIGN: frac_e over the whole batch) */
    for (int64_t mb = 0; t->micro > 1 && mb < t->micro; mb++)
        if (send_hop(c, j, NL_MSG_COUNT, k, (uint32_t)mb, t->tokens + mb * rows, NULL) != 0)
            goto unreachable;
    for (int64_t mb = 0; mb < t->micro; mb++)
        if (send_hop(c, j, NL_MSG_ACTIVATION, k, (uint32_t)mb, t->tokens + mb * rows,
                     t->targets + mb * rows) != 0)
            goto unreachable;
    return;
unreachable:
    unreachable(c, j, 0);
}

static int due(int64_t step, int64_t every)
{
    return every > 0 && step % every == 0;
}

static void after_step(nl_coord *c, cjob *j);

/* Every stage has reported: decide the step and tell them. */
static void decide(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    nl_step_result *r = &t->r;
    /* the decision local training makes too (core/train.h) */
    const double scale = nl_step_decide(r, t->ce, (double)t->batch * (double)t->seq, t->aux,
                                        c->cfg.aux_loss_coef, t->sumsq, NL_TRAIN_CLIP_NORM);
    if (!r->skipped) {
        t->skips = 0;
    } else if (++t->skips >= NL_TRAIN_MAX_SKIPS) {
        fail(c, j, "stage %d reported a non-finite %s for %d steps in a row (to step %lld): refused",
             t->bad_stage, isfinite(r->loss) ? "gradient" : "loss", t->skips,
             (long long)t->step + 1);
        return;
    }
    t->bad_stage = -1;
    t->lr_now = nl_lr_at(t->step, t->steps, t->warmup, t->lr, t->min_lr);
    t->step_s = coord_now() - t->t_step;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_STEP);
    m.u.step = (nl_msg_step){j->id, (uint64_t)t->step + 1, !r->skipped, scale, t->lr_now};
    int lost = 0, rc = send_all(c, &m, &lost);
    nl_wire_msg_free(&m);
    if (rc != 0) {
        unreachable(c, j, lost);
        return;
    }
    t->step++;
    t->adam += !r->skipped;
    j->last_progress = coord_now();
    t->has_eval = 0;
    if (t->eval_every > 0 && (due(t->step, t->eval_every) || t->step == t->steps)) {
        /* the held-out batches, as local evaluation draws them */
        const size_t rows_mb = (size_t)(t->batch / t->micro) * (size_t)t->seq;
        nl_error e = {0};
        t->phase = TR_EVAL;
        for (int64_t i = 0; i < t->eval_batches; i++) {
            if (nl_dataset_batch(t->ds, 1, (uint64_t)t->seed, (uint64_t)i, (int)t->batch,
                                 (int)t->seq, t->tokens, t->targets, &e) != NL_OK) {
                fail(c, j, "evaluation: %s", e.msg);
                return;
            }
            for (int64_t mb = 0; mb < t->micro; mb++)
                if (send_hop(c, j, NL_MSG_EVAL, (uint64_t)t->step, (uint32_t)(i * t->micro + mb),
                             t->tokens + mb * rows_mb, t->targets + mb * rows_mb) != 0) {
                    unreachable(c, j, 0);
                    return;
                }
        }
        return;
    }
    after_step(c, j);
}

static void finish(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    json_t *o = json_pack("{s:s,s:I}", "event", "done", "step", (json_int_t)t->step);
    if (t->manifest[0] && t->manifest_step == t->step)
        json_object_set_new(o, "manifest", json_string(t->manifest));
    if (t->ft && t->ft->adapter[0])
        json_object_set_new(o, "adapter", json_string(t->ft->adapter));
    NL_INFO("%s job %llu: done at step %lld", j->ops->name, (unsigned long long)j->id,
            (long long)t->step);
    report(c, j, NL_JOB_DONE, "done", o);
    if (!t->ft) {
        memset(&c->train_mem, 0, sizeof c->train_mem); /* plans are for inference again */
        coord_journal_clear(c);
    }
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL); /* the stages free their trainers */
    m.u.job_ref.job_id = j->id;
    int lost = 0;
    send_all(c, &m, &lost); /* one that cannot be reached is declared dead at the tick */
    nl_wire_msg_free(&m);
    coord_job_free(j);
}

/* Where the stages write this step's shards: DIR/step-NNNNNN, or (a
 * fine-tuning job's adapters) DIR/lora-job<ID>. */
static void ckpt_dir_of(const cjob *j, char *buf, size_t cap)
{
    const ctrain *t = j->state;
    if (t->ft)
        snprintf(buf, cap, "%s/lora-job%llu", t->ckpt_dir, (unsigned long long)j->id);
    else
        snprintf(buf, cap, "%s/step-%06lld", t->ckpt_dir, (long long)t->step);
}

/* The step (and its evaluation) is done: report it, then checkpoint, go
 * on, or finish. */
static void after_step(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    const nl_step_result *r = &t->r;
    /* JSON has no NaN or infinity: a non-finite value is null */
    json_t *o = json_pack(
        "{s:s,s:I,s:I,s:o,s:o,s:o,s:o,s:o,s:o,s:b}", "event", "step", "step", (json_int_t)t->step,
        "steps", (json_int_t)t->steps, "loss", jnum(r->loss), "ce_loss", jnum(r->ce_loss),
        "aux_loss", jnum(r->aux_loss), "lr", jnum(t->lr_now), "grad_norm", jnum(r->grad_norm),
        "tokens_per_s", jnum((double)t->batch * (double)t->seq / t->step_s), "skipped", r->skipped);
    if (o && t->has_eval)
        json_object_set_new(o, "eval_loss", jnum(t->eval_loss));
    char msg[64];
    snprintf(msg, sizeof msg, "step %lld of %lld", (long long)t->step, (long long)t->steps);
    report(c, j, NL_JOB_RUNNING, msg, o);
    if (t->t_lost > 0) {
        NL_INFO("train job %llu: step %lld, the first after the resume, done %.2f s after the "
                "stage was lost at step %lld",
                (unsigned long long)j->id, (long long)t->step, coord_now() - t->t_lost,
                (long long)t->lost_at);
        t->t_lost = 0;
    }
    if (r->skipped)
        NL_WARN("train job %llu: step %lld skipped: non-finite %s", (unsigned long long)j->id,
                (long long)t->step, isfinite(r->loss) ? "gradient" : "loss");
    /* a fine-tuning job writes its adapters once, at the end */
    const int ckpt = t->ft ? t->step == t->steps
                           : (due(t->step, t->ckpt_every) && t->step < t->steps) ||
                                 (t->step == t->steps && t->final_ckpt);
    if (!ckpt) {
        if (t->step == t->steps)
            finish(c, j);
        else
            start_step(c, j);
        return;
    }
    char dir[1100];
    ckpt_dir_of(j, dir, sizeof dir);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_CKPT_REQ);
    m.u.ckpt_req = (nl_msg_ckpt_req){j->id, (uint64_t)t->step, dir};
    int lost = -1, rc = strlen(dir) <= 1024 ? send_all(c, &m, &lost) : -1;
    nl_wire_msg_free(&m);
    if (rc != 0) {
        if (lost >= 0)
            unreachable(c, j, lost);
        else
            fail(c, j, "checkpoint directory %s is longer than 1024 bytes", dir);
        return;
    }
    t->phase = TR_CKPT;
    memset(t->got, 0, (size_t)t->stages);
    t->acks = 0;
}

/* Whether the shard at path was trained with TF32 allowed, as its node
 * recorded it in the shard's "train" metadata (no wire message carries a
 * node's --tf32). A shard that does not say, or cannot be read, leaves it
 * unknown; the manifest's hashes and the reload judge the file itself. */
static int shard_tf32(const char *path)
{
    char *meta = NULL;
    nl_error e = {0};
    int tf32 = NL_MANIFEST_TF32_UNKNOWN;
    if (nl_checkpoint_meta(path, "train", &meta, &e) == NL_OK && meta) {
        json_t *o = json_loads(meta, 0, NULL), *v = json_object_get(o, "tf32");
        if (json_is_boolean(v))
            tf32 = json_is_true(v) ? NL_MANIFEST_TF32_ON : NL_MANIFEST_TF32_OFF;
        json_decref(o);
    }
    free(meta);
    return tf32;
}

/* Writing a checkpoint's manifest, off the loop: the shards' TF32 flags
 * read from their files, the manifest written last, then read back and
 * every shard's hash checked, to become the source the cluster reloads
 * from after a failure (so the checkpoint directory must be shared with
 * the nodes). The task owns copies of everything it writes. */
typedef struct ckpt_task {
    cwork w;
    nl_manifest mf; /* its strings and shards are the task's */
    char path[1100];
    char root[4096]; /* the checkpoint root its shards must lie under */
    nl_status st;
    nl_error err;
    cmanifest out;
} ckpt_task;

static void ckpt_run(cwork *w)
{
    ckpt_task *k = (ckpt_task *)w;
    for (int i = 0; i < k->mf.n_shards; i++)
        k->mf.shards[i].tf32 = shard_tf32(k->mf.shards[i].path);
    k->st = nl_manifest_write(k->path, &k->mf, &k->err);
    if (k->st == NL_OK)
        k->st = coord_manifest_open(&k->out, k->path, k->root, &k->err);
}

static void ckpt_free(cwork *w)
{
    ckpt_task *k = (ckpt_task *)w;
    free_shards(k->mf.shards, k->mf.n_shards);
    free((char *)k->mf.config_json);
    free((char *)k->mf.train_json);
    free((char *)k->mf.tokenizer);
    free((char *)k->mf.init_seed);
    free(k->mf.growth);
    coord_manifest_release(&k->out);
    free(k);
}

/* --grow auto at a checkpoint (issue 16): the model deepens when the
 * nodes now hold more layers (coord_grow_auto_depth); a worker writes the
 * grown manifest, then the stages reload it on a new plan (joining nodes
 * take the new layers) and the job goes on from its step. */
typedef struct grow_task {
    cwork w;
    coord_grow_work g;
    nl_status st;
    nl_error err;
    double t0;
} grow_task;

static void grow_run(cwork *w)
{
    grow_task *k = (grow_task *)w;
    k->st = coord_grow_run(&k->g, &k->err);
}

static void grow_free(cwork *w)
{
    grow_task *k = (grow_task *)w;
    coord_grow_release(&k->g);
    free(k);
}

static void grow_done(nl_coord *c, cwork *w)
{
    grow_task *k = (grow_task *)w;
    cjob *j = coord_job_find(c, w->job_id);
    ctrain *t = j ? j->state : NULL;
    if (!t || t->phase != TR_GROW)
        return;
    if (k->st != NL_OK) { /* the job goes on at the size it has */
        NL_WARN("train job %llu: --grow auto at step %lld: %s", (unsigned long long)j->id,
                (long long)t->step, k->err.msg);
        start_step(c, j);
        return;
    }
    coord_grow_install(c, &k->g, coord_now() - k->t0);
    report(c, j, NL_JOB_RUNNING, "the model grew", coord_grow_event(c, &k->g));
    coord_close_session(c, j);
    wait_reload(c, j);
}

static int grow_at_checkpoint(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    nl_error e = {0};
    const int depth = coord_grow_auto_depth(c);
    grow_task *k = depth ? calloc(1, sizeof *k) : NULL;
    if (!k)
        return 0;
    if (coord_grow_prepare(c, &k->g, NULL, 0, depth, 0, 0, &e) != NL_OK) {
        NL_WARN("train job %llu: --grow auto: %s", (unsigned long long)j->id, e.msg);
        free(k);
        return 0;
    }
    k->w = (cwork){.run = grow_run, .done = grow_done, .free = grow_free, .job_id = j->id};
    k->t0 = coord_now();
    if (coord_work_start(c, &k->w, &e) != NL_OK) {
        NL_WARN("train job %llu: --grow auto: %s", (unsigned long long)j->id, e.msg);
        return 0;
    }
    t->phase = TR_GROW;
    return 1;
}

/* The manifest is written and verified: it becomes the source; report it
 * and go on. A job that ended meanwhile leaves the source as it was (its
 * stages reload from there). */
static void ckpt_done(nl_coord *c, cwork *w)
{
    ckpt_task *k = (ckpt_task *)w;
    cjob *j = coord_job_find(c, w->job_id);
    ctrain *t = j ? j->state : NULL;
    if (!t || t->phase != TR_CKPT || t->step != k->mf.step)
        return;
    if (k->st != NL_OK) {
        fail(c, j, "checkpoint of step %lld: %s", (long long)t->step, k->err.msg);
        return;
    }
    coord_manifest_install(c, &k->out, 0);
    c->stages_modified = 0; /* the source holds the stages' weights */
    coord_journal_train(c, j->id, t->journal, k->path);
    snprintf(t->manifest, sizeof t->manifest, "%s", k->path);
    t->manifest_step = t->step;
    NL_INFO("train job %llu: checkpoint of step %lld: %s", (unsigned long long)j->id,
            (long long)t->step, k->path);
    json_t *o = json_pack("{s:s,s:I,s:s}", "event", "checkpoint", "step", (json_int_t)t->step,
                          "manifest", k->path);
    report(c, j, NL_JOB_RUNNING, "checkpoint", o);
    if (t->step < t->steps)
        coord_observe_speeds(c); /* a stage slower or faster than planned asks for a re-plan */
    if (t->step == t->steps) {
        finish(c, j);
    } else if (grow_at_checkpoint(c, j)) {
        /* --grow auto: the nodes hold a deeper model; a worker grows the
         * manifest, then the job goes on from it on a new plan */
    } else if (coord_replan_gain(c, "at the checkpoint")) {
        /* a node joined, or the stages' observed speeds call for another
         * split: the job goes on from this manifest on the new plan */
        json_t *r = json_pack("{s:s,s:I,s:s}", "event", "replan", "step", (json_int_t)t->step,
                              "manifest", k->path);
        report(c, j, NL_JOB_RUNNING, "re-planning at the checkpoint", r);
        coord_close_session(c, j);
        wait_reload(c, j);
        coord_reload(c);
    } else {
        start_step(c, j);
    }
}

void coord_train_finetuned(nl_coord *c, uint64_t job, const char *adapter, const char *why)
{
    cjob *j = coord_job_find(c, job);
    ctrain *t = j ? j->state : NULL;
    if (!t || !t->ft || t->phase != TR_CKPT)
        return; /* it ended meanwhile */
    if (why) {
        fail(c, j, "the adapters of step %lld: %s", (long long)t->step, why);
        return;
    }
    snprintf(t->ft->adapter, sizeof t->ft->adapter, "%s", adapter);
    NL_INFO("finetune job %llu: adapters of step %lld in %s", (unsigned long long)j->id,
            (long long)t->step, adapter);
    finish(c, j);
}

static char *dup_or_null(const char *s, int *oom)
{
    char *d = s ? strdup(s) : NULL;
    *oom |= s && !d;
    return d;
}

/* Every shard is in: a worker writes the manifest (ckpt_task). The job
 * hands it this checkpoint's shards and takes a fresh table. */
static void write_manifest(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    nl_error e = {0};
    ckpt_task *k = calloc(1, sizeof *k);
    nl_manifest_shard *fresh = calloc((size_t)t->stages, sizeof *fresh);
    if (!k || !fresh) {
        free(k);
        free(fresh);
        fail(c, j, "out of memory");
        return;
    }
    json_t *tj = json_pack("{s:I,s:I,s:I,s:I,s:I,s:f,s:f,s:I}", "seed", (json_int_t)t->seed,
                           "steps", (json_int_t)t->steps, "batch", (json_int_t)t->batch, "seq",
                           (json_int_t)t->seq, "microbatches", (json_int_t)t->micro, "lr", t->lr,
                           "min_lr", t->min_lr, "warmup", (json_int_t)t->warmup);
    int oom = 0;
    k->w = (cwork){.run = ckpt_run, .done = ckpt_done, .free = ckpt_free, .job_id = j->id};
    k->mf = (nl_manifest){.step = t->step,
                          .adam_steps = t->adam, /* the stages step together */
                          .cfg = c->cfg,
                          .config_json = nl_config_to_json(&c->cfg),
                          .train_json = tj ? json_dumps(tj, JSON_COMPACT) : NULL,
                          .tokenizer = dup_or_null(c->tok_text, &oom),
                          .init_seed = dup_or_null(c->init_seed, &oom),
                          .growth =
                              c->n_growth ? malloc((size_t)c->n_growth * sizeof *c->growth) : NULL,
                          .n_growth = c->n_growth,
                          .n_shards = t->stages,
                          .shards = t->shards};
    json_decref(tj);
    oom |= c->n_growth && !k->mf.growth;
    if (k->mf.growth) /* the model's growth history goes on (core/grow.h) */
        memcpy(k->mf.growth, c->growth, (size_t)c->n_growth * sizeof *c->growth);
    t->shards = fresh;
    snprintf(k->path, sizeof k->path, "%s/step-%06lld/manifest.json", t->ckpt_dir,
             (long long)t->step);
    snprintf(k->root, sizeof k->root, "%s", c->ckpt_root);
    if (oom || !k->mf.config_json || !k->mf.train_json) {
        ckpt_free(&k->w);
        fail(c, j, "checkpoint of step %lld: out of memory", (long long)t->step);
        return;
    }
    if (coord_work_start(c, &k->w, &e) != NL_OK)
        fail(c, j, "checkpoint of step %lld: %s", (long long)t->step, e.msg);
}

/* ---------------------------------------------------------------- messages */

/* Read the run's parameters; NULL or the name of the one at fault. */
static const char *read_params(ctrain *t, const nl_msg_job_submit *s, const char **resume)
{
    static const char *const ints[] = {"steps",        "batch",        "seq",
                                       "microbatches", "seed",         "warmup",
                                       "eval_every",   "eval_batches", "checkpoint_every"};
    int64_t *iv[] = {&t->steps,  &t->batch,      &t->seq,          &t->micro,     &t->seed,
                     &t->warmup, &t->eval_every, &t->eval_batches, &t->ckpt_every};
    static const int64_t lo[] = {1, 1, 1, 1, 0, 0, 0, 1, 0};
    static const int64_t hi[] = {INT32_MAX, 65536,     1 << 20, 65536,    INT64_MAX,
                                 INT32_MAX, INT32_MAX, 1 << 20, INT32_MAX};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        const nl_wire_param *p = coord_param(s, ints[i]);
        if (!p || p->kind != NL_WIRE_PARAM_INT || p->i < lo[i] || p->i > hi[i])
            return ints[i];
        *iv[i] = p->i;
    }
    const nl_wire_param *sd = coord_param(s, "seq_default");
    t->seq_default = sd && sd->kind == NL_WIRE_PARAM_BOOL && sd->b;
    static const char *const fl[] = {"lr", "min_lr", "holdout"};
    double *fv[] = {&t->lr, &t->min_lr, &t->holdout};
    static const double fhi[] = {10.0, 10.0, 0.5};
    for (size_t i = 0; i < 3; i++) {
        const nl_wire_param *p = coord_param(s, fl[i]);
        double v = !p                               ? NAN
                   : p->kind == NL_WIRE_PARAM_FLOAT ? p->f
                   : p->kind == NL_WIRE_PARAM_INT   ? (double)p->i
                                                    : NAN;
        if (!(v >= 0.0 && v <= fhi[i]))
            return fl[i];
        *fv[i] = v;
    }
    const nl_wire_param *p;
    if (!(p = coord_param(s, "data")) || p->kind != NL_WIRE_PARAM_STR || !p->s[0])
        return "data";
    snprintf(t->data, sizeof t->data, "%s", p->s);
    if (!(p = coord_param(s, "checkpoint_dir")) || p->kind != NL_WIRE_PARAM_STR || !p->s[0] ||
        strlen(p->s) >= sizeof t->ckpt_dir)
        return "checkpoint_dir (a path of at most 1000 bytes)";
    snprintf(t->ckpt_dir, sizeof t->ckpt_dir, "%s", p->s);
    if ((p = coord_param(s, "recompute")))
        t->recompute = p->kind == NL_WIRE_PARAM_BOOL && p->b;
    if ((p = coord_param(s, "final_checkpoint")))
        t->final_ckpt = p->kind == NL_WIRE_PARAM_BOOL && p->b;
    if ((p = coord_param(s, "learn_vocab"))) {
        if (p->kind != NL_WIRE_PARAM_INT || p->i < 0 || p->i > (1 << 24))
            return "learn_vocab (0 to 2^24 ids)";
        t->learn_vocab = p->i;
    }
    *resume = (p = coord_param(s, "resume")) && p->kind == NL_WIRE_PARAM_STR ? p->s : NULL;
    if (t->batch % t->micro != 0)
        return "microbatches (must divide batch)";
    if ((t->batch / t->micro) * t->seq > (1 << 24) || t->eval_batches * t->micro > (1 << 30))
        return "batch (a microbatch of at most 2^24 rows; eval_batches x microbatches <= 2^30)";
    if (t->eval_every > 0 && t->holdout <= 0.0)
        return "eval_every (needs holdout > 0)";
    return NULL;
}

/* Preparing a job, off the loop: the manifest it resumes from verified
 * and opened, then its data read (and tokenized, with the tokenizer of
 * the model it trains). */
typedef struct prep_task {
    cwork w;
    char *resume; /* a manifest (resolved under root), or NULL */
    char root[4096]; /* the checkpoint root its shards must lie under */
    char *data, *tok;
    int64_t vocab;
    double holdout;
    nl_status st;
    nl_error err;
    int resume_failed;
    cmanifest mf;
    nl_dataset *ds;
    nl_dataset_info info;
    int grow; /* --learn-vocab: v learns from the data and grows the model first */
    coord_grow_work v;
    double grow_s;
} prep_task;

static void prep_run(cwork *w)
{
    prep_task *p = (prep_task *)w;
    if (p->resume &&
        (p->st = coord_manifest_open(&p->mf, p->resume, p->root, &p->err)) != NL_OK) {
        p->resume_failed = 1;
        return;
    }
    if (p->grow) { /* the data teaches the tokenizer first; it is then tokenized with it */
        const double t0 = coord_now();
        if ((p->st = coord_grow_run(&p->v, &p->err)) != NL_OK) {
            nl_error_prefix(&p->err, "--learn-vocab");
            return;
        }
        p->grow_s = coord_now() - t0;
    }
    const char *tok = p->resume ? p->mf.tok : p->grow ? p->v.new_tok : p->tok;
    const int64_t vocab = p->resume ? p->mf.cfg.vocab_size
                          : p->grow ? p->v.grown.vocab_size
                                    : p->vocab;
    p->st = nl_dataset_load_model(&p->ds, p->data, tok, vocab, p->holdout, "the cluster's model",
                                  &p->info, &p->err);
}

static void prep_free(cwork *w)
{
    prep_task *p = (prep_task *)w;
    free(p->resume);
    free(p->data);
    free(p->tok);
    coord_manifest_release(&p->mf);
    coord_grow_release(&p->v);
    nl_dataset_destroy(&p->ds);
    free(p);
}

/* --learn-vocab: the grown model becomes the source and the stages reload
 * (the job begins once they have); the client is told. 0: the job failed. */
static int install_growth(nl_coord *c, cjob *j, prep_task *p)
{
    char why[700];
    if (coord_grow_refusal(c, why, sizeof why)) { /* it changed while the worker ran */
        fail(c, j, "--learn-vocab: %s", why);
        return 0;
    }
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE && &c->jobs[i] != j)
            coord_job_fail(c, &c->jobs[i], "the cluster reloads: its model grows");
    coord_grow_install(c, &p->v, p->grow_s);
    report(c, j, NL_JOB_RUNNING, "vocabulary grown", coord_grow_event(c, &p->v));
    return 1;
}

/* The job is prepared: a resumed one reloads the cluster from its
 * manifest; it begins once the cluster is ready. */
static void prep_done(nl_coord *c, cwork *w)
{
    prep_task *p = (prep_task *)w;
    cjob *j = coord_job_find(c, w->job_id);
    ctrain *t = j ? j->state : NULL;
    char why[700];
    if (!t || t->phase != TR_PREPARING)
        return;
    if (p->resume_failed) {
        fail(c, j, "--resume: %s", p->err.msg);
        return;
    }
    if (p->resume) {
        /* other jobs lose their stages to the reload */
        for (int i = 0; i < COORD_MAX_JOBS; i++)
            if (c->jobs[i].phase != JOB_FREE && &c->jobs[i] != j)
                coord_job_fail(c, &c->jobs[i], "the cluster reloads to resume a training job");
        coord_manifest_install(c, &p->mf, 1);
        snprintf(why, sizeof why, "verified %s; loading it onto the nodes", p->resume);
        coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, why, NULL);
    }
    if (t->seq > c->cfg.max_seq_len && t->seq_default) {
        t->seq = c->cfg.max_seq_len; /* the client's default, not a typed --seq: fit it */
    } else if (t->seq > c->cfg.max_seq_len) {
        fail(c, j, "--seq %lld: the model's max_seq_len is %d", (long long)t->seq,
             c->cfg.max_seq_len);
        return;
    }
    if (p->st != NL_OK) {
        fail(c, j, "%s", p->err.msg);
        return;
    }
    if (p->grow && !install_growth(c, j, p))
        return;
    t->ds = p->ds;
    p->ds = NULL;
    if (p->info.tokenized)
        NL_INFO("train job %llu: tokenized %s: %zu bytes -> %zu tokens in %.1f s",
                (unsigned long long)j->id, t->data, p->info.text_bytes, t->ds->n, p->info.encode_s);
    const size_t n = (size_t)t->batch * (size_t)t->seq;
    if (!(t->tokens = malloc(n * sizeof *t->tokens)) ||
        !(t->targets = malloc(n * sizeof *t->targets))) {
        fail(c, j, "out of memory");
        return;
    }
    /* it begins once the cluster is ready (at once unless it reloads) */
    t->phase = TR_LOADING;
    j->phase = JOB_WAITING;
    j->last_progress = coord_now();
    if (c->ready)
        begin(c, j);
}

/* The job's client-chosen paths kept under the operator's roots (issue
 * 15): data under --data-root (a regular file of at most
 * --max-data-bytes), checkpoint_dir (made) and resume under
 * --checkpoint-root, each resolved with realpath (a link inside a root
 * that leads out is refused). t->data, t->ckpt_dir and *resume become the
 * resolved paths. NULL, or what is wrong (in why): nothing about files
 * outside the roots. */
static const char *confine_paths(nl_coord *c, ctrain *t, const char **resume, char *resume_real,
                                 size_t cap, char *why, size_t wcap)
{
    char real[PATH_MAX], joined[PATH_MAX];
    const char *bad = coord_confine_file(c->data_root, t->data, NULL, c->o.max_data_bytes, real,
                                         sizeof real);
    if (bad || strlen(real) >= sizeof t->data) {
        snprintf(why, wcap, "params.data: %s (the coordinator's --data-root)",
                 bad ? bad : "too long");
        return why;
    }
    snprintf(t->data, sizeof t->data, "%s", real);
    if (*resume) {
        if ((bad = coord_confine_file(c->ckpt_root, *resume, "manifest.json", 64u << 20,
                                      resume_real, cap))) {
            snprintf(why, wcap, "params.resume: %s (the coordinator's --checkpoint-root)", bad);
            return why;
        }
        *resume = resume_real;
    }
    char *dir = NULL;
    nl_error e = {0};
    if ((bad = coord_join_path(c->ckpt_root, t->ckpt_dir, joined, sizeof joined)) ||
        nl_path_confine(c->ckpt_root, joined, &dir, &e) != NL_OK ||
        strlen(dir) >= sizeof t->ckpt_dir) {
        snprintf(why, wcap, "params.checkpoint_dir: %.400s (the coordinator's --checkpoint-root)",
                 bad                          ? bad
                 : dir                        ? "too long"
                 : e.status == NL_ERR_AUTH    ? "leads outside the root (a symbolic link)"
                                              : e.msg);
        free(dir);
        return why;
    }
    snprintf(t->ckpt_dir, sizeof t->ckpt_dir, "%s", dir);
    free(dir);
    return NULL;
}

/* --learn-vocab: the growth the job's worker runs before it reads the
 * data (from the data itself); 0 and why when it cannot. */
static int prepare_growth(nl_coord *c, ctrain *t, prep_task *p, const char *resume, char *why,
                          size_t cap)
{
    nl_error e = {0};
    const size_t n = strlen(t->data);
    if (resume) {
        snprintf(why, cap,
                 "not with --resume (the vocabulary grows on the model the cluster "
                 "holds)");
        return 0;
    }
    if (n >= 4 && strcmp(t->data + n - 4, ".tok") == 0) {
        snprintf(why, cap, "%s holds token ids; the tokenizer learns from text", t->data);
        return 0;
    }
    if (coord_grow_refusal(c, why, cap))
        return 0;
    if (coord_grow_prepare(c, &p->v, t->data, t->learn_vocab, 0, 0, 0, &e) != NL_OK) {
        snprintf(why, cap, "%s", e.msg);
        return 0;
    }
    p->grow = 1;
    return 1;
}

static void train_submit(nl_coord *c, const nl_rx *rx)
{
    coord_train_submit(c, rx, NULL);
}

void coord_train_submit(nl_coord *c, const nl_rx *rx, cft *ft)
{
    const nl_msg_job_submit *s = &rx->msg.u.job_submit;
    nl_error e = {0};
    char why[700];
    /* one training job at a time, and none beside fine-tuning (which
     * needs the weights frozen); fine-tuning jobs may run together */
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        const cjob *o = &c->jobs[i];
        if (o->phase == JOB_FREE || (o->ops != &coord_train_ops && o->ops != &coord_finetune_ops) ||
            (ft && o->ops == &coord_finetune_ops))
            continue;
        snprintf(why, sizeof why, "job %llu is %s already; %s", (unsigned long long)o->id,
                 o->ops == &coord_train_ops ? "training" : "fine-tuning",
                 ft ? "fine-tuning needs the weights frozen" : "one at a time");
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
    prep_task *p = calloc(1, sizeof *p);
    if (!t || !p) {
        free(p);
        free(ft);
        fail(c, j, "out of memory");
        return;
    }
    t->ft = ft;
    t->bad_stage = -1;
    const char *resume = NULL, *bad = read_params(t, s, &resume);
    if (!bad && ft && resume)
        bad = "resume (a fine-tuning job starts its adapters afresh)";
    if (bad) {
        free(p);
        fail(c, j, "%s: params.%s is missing or out of range", j->ops->name, bad);
        return;
    }
    char resume_real[PATH_MAX];
    if ((bad = confine_paths(c, t, &resume, resume_real, sizeof resume_real, why, sizeof why))) {
        free(p);
        fail(c, j, "train: %s", bad);
        return;
    }
    snprintf(p->root, sizeof p->root, "%s", c->ckpt_root);
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, "running", NULL);
    /* a job recovered from the journal (no client yet) waits for the nodes */
    if (!resume && !c->ready && rx->rid_len > 0) {
        free(p);
        fail(c, j, "the cluster is not ready: %s", c->state);
        return;
    }
    p->w = (cwork){.run = prep_run, .done = prep_done, .free = prep_free, .job_id = j->id};
    p->vocab = c->cfg.vocab_size;
    p->holdout = t->holdout;
    int oom = 0;
    p->resume = dup_or_null(resume, &oom);
    p->data = dup_or_null(t->data, &oom);
    p->tok = dup_or_null(resume ? NULL : c->tok_text, &oom);
    if (oom) {
        prep_free(&p->w);
        fail(c, j, "out of memory");
        return;
    }
    if (t->learn_vocab > 0 && !prepare_growth(c, t, p, resume, why, sizeof why)) {
        prep_free(&p->w);
        fail(c, j, "train: --learn-vocab: %s", why);
        return;
    }
    t->phase = TR_PREPARING;
    if (!ft && !(t->journal = coord_journal_params(s))) {
        prep_free(&p->w);
        fail(c, j, "out of memory");
        return;
    }
    if (!ft) /* a fine-tuning job is not journaled: it ends with the coordinator */
        coord_journal_train(c, j->id, t->journal, resume);
    if (coord_work_start(c, &p->w, &e) != NL_OK)
        fail(c, j, "%s", e.msg);
}

/* A failed or cancelled job: the stages end it, and those whose weights it
 * changed reload them from the source (the last manifest, or the
 * checkpoint). */
static void train_abort(nl_coord *c, cjob *j)
{
    const ctrain *t = j->state;
    coord_close_session(c, j);
    if (t && t->ft) /* the base is untouched: its stages just drop the adapters */
        return;
    memset(&c->train_mem, 0, sizeof c->train_mem); /* plans are for inference again */
    coord_journal_clear(c);
    /* before its first step a job has changed no weight; only moments the
     * stages took from a manifest (resumable) may be gone with their trainers */
    const int touched = t && (t->phase > TR_BEGIN || (t->phase == TR_BEGIN && c->resumable));
    if (touched && j->epoch == c->epoch) {
        NL_INFO("train job %llu ended early: the stages reload their weights from %s",
                (unsigned long long)j->id, c->src_path[0] ? c->src_path : "the seed");
        coord_reload(c);
    }
}

/* Whether a training report about j, claiming stage `stage`, comes from
 * that stage while the job is in `phase` on the current plan. */
static int report_ok(nl_coord *c, cjob *j, const nl_rx *rx, uint32_t stage, int phase)
{
    const ctrain *t = j->state;
    cnode *n = coord_node_by_rid(c, rx);
    if (!t || t->phase != phase || j->epoch != c->epoch)
        return 0;
    if (!n || n->stage != (int)stage || stage >= (uint32_t)t->stages) {
        NL_WARN("a training report for job %llu claims stage %u but comes from %s",
                (unsigned long long)j->id, stage, n ? "another stage" : "no stage");
        return 0;
    }
    return 1;
}

/* A stage took the job (JOB_STATUS running); once all have, step 1. */
static void on_ack(nl_coord *c, cjob *j, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid(c, rx);
    ctrain *t = j->state;
    if (t->phase != TR_BEGIN || !n || n->stage < 0 || j->epoch != c->epoch || t->got[n->stage])
        return;
    t->got[n->stage] = 1;
    j->last_progress = coord_now();
    if (++t->acks < t->stages)
        return;
    if (!t->ft)
        c->resumable = 0; /* the stages took the moments; the weights are about to move */
    start_step(c, j);
}

static void on_grad_norm(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const nl_msg_grad_norm *g = &rx->msg.u.grad_norm;
    ctrain *t = j->state;
    if (!report_ok(c, j, rx, g->stage, TR_STEP) || g->step != (uint64_t)t->step + 1 ||
        t->got[g->stage])
        return;
    if (g->sumsq < 0) { /* no sum of squares is negative: a lie */
        fail(c, j, "stage %u reported a gradient sum of squares of %g for step %lld: refused",
             g->stage, g->sumsq, (long long)t->step + 1);
        return;
    }
    if (!isfinite(g->sumsq) && t->bad_stage < 0) /* the step is skipped (decide) */
        t->bad_stage = (int)g->stage;
    j->last_progress = coord_now();
    t->got[g->stage] = 1;
    t->sumsq += g->sumsq;
    if (++t->norms == t->stages && t->have_loss)
        decide(c, j);
}

static void on_loss(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const nl_msg_loss *l = &rx->msg.u.loss;
    ctrain *t = j->state;
    const uint32_t last = (uint32_t)(t->stages - 1);
    if (!l->eval) {
        if (!report_ok(c, j, rx, last, TR_STEP) || l->step != (uint64_t)t->step + 1 || t->have_loss)
            return;
        if (l->ce_sum < 0) { /* a cross-entropy is never negative: a lie */
            fail(c, j, "stage %u (the last) reported a loss of %g (aux %g) for step %lld: refused",
                 last, l->ce_sum, l->aux, (long long)t->step + 1);
            return;
        }
        if ((!isfinite(l->ce_sum) || !isfinite(l->aux)) && t->bad_stage < 0)
            t->bad_stage = (int)last; /* the step is skipped (decide) */
        j->last_progress = coord_now();
        t->ce = l->ce_sum;
        t->aux = l->aux;
        t->have_loss = 1;
        if (t->norms == t->stages)
            decide(c, j);
        return;
    }
    if (!report_ok(c, j, rx, last, TR_EVAL) || l->step != (uint64_t)t->step)
        return;
    if (!isfinite(l->ce_sum) || l->ce_sum < 0) {
        fail(c, j, "stage %u (the last) reported an evaluation loss of %g at step %lld: refused",
             last, l->ce_sum, (long long)t->step);
        return;
    }
    j->last_progress = coord_now();
    t->eval_loss = l->ce_sum / ((double)t->eval_batches * (double)t->batch * (double)t->seq);
    t->has_eval = 1;
    after_step(c, j);
}

static void on_ckpt_done(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const nl_msg_ckpt_done *d = &rx->msg.u.ckpt_done;
    ctrain *t = j->state;
    if (!report_ok(c, j, rx, d->stage, TR_CKPT) || d->step != (uint64_t)t->step || t->got[d->stage])
        return;
    cnode *n = coord_node_by_rid(c, rx);
    nl_manifest_shard *sh = &t->shards[d->stage];
    const nl_plan_stage *ps = &c->plan->stages[d->stage];
    char want[1200], node[128];
    /* the shard must be exactly where it was asked to be */
    char dir[1100];
    ckpt_dir_of(j, dir, sizeof dir);
    snprintf(want, sizeof want, "%s/stage-%u.safetensors", dir, d->stage);
    if (strcmp(d->path, want) != 0) {
        fail(c, j, "stage %u wrote its shard to %s, not %s", d->stage, d->path, want);
        return;
    }
    const char *file = strrchr(d->path, '/') + 1;
    j->last_progress = coord_now();
    free(sh->file);
    free(sh->path);
    free(sh->node);
    free(sh->device);
    snprintf(node, sizeof node, "node %u %s", n->id, n->key);
    *sh = (nl_manifest_shard){.stage = (int)d->stage,
                              .l0 = ps->l0,
                              .l1 = ps->l1,
                              .has_embed = ps->has_embed,
                              .has_head = ps->has_head,
                              .file = strdup(file),
                              .path = strdup(d->path),
                              .bytes = d->bytes,
                              .node = strdup(node),
                              .device = strdup(n->device), /* as its JOIN said */
                              .tf32 = shard_tf32(d->path)};
    snprintf(sh->sha256, sizeof sh->sha256, "%s", d->sha256);
    if (!sh->file || !sh->path || !sh->node || !sh->device) {
        fail(c, j, "out of memory");
        return;
    }
    t->got[d->stage] = 2;
    if (++t->acks < t->stages)
        return;
    if (!t->ft) {
        write_manifest(c, j);
        return;
    }
    nl_error e = {0}; /* fine-tuning: a worker joins the adapters into one file */
    if (coord_finetune_gather(c, j->id, t->ft, t->shards, t->stages, dir, &e) != NL_OK)
        fail(c, j, "the adapters of step %lld: %s", (long long)t->step, e.msg);
}

static void train_on_message(nl_coord *c, cjob *j, const nl_rx *rx)
{
    switch (rx->msg.type) {
    case NL_MSG_JOB_STATUS:
        on_ack(c, j, rx);
        break;
    case NL_MSG_GRAD_NORM:
        on_grad_norm(c, j, rx);
        break;
    case NL_MSG_LOSS:
        on_loss(c, j, rx);
        break;
    case NL_MSG_CKPT_DONE:
        on_ckpt_done(c, j, rx);
        break;
    default:
        break;
    }
}

/* A stage of the plan is lost. A job that has begun goes on by itself,
 * up to --train-resumes times: its stages drop it, the cluster plans again
 * over the nodes left (coord.c) and reloads from the source, which is the
 * last verified manifest (ckpt_done installs each) or what the job began
 * from; once loaded, begin() continues from the source's step. Every batch
 * is a function of the seed and the step, so the run ends as an
 * undisturbed one would. A job still preparing or loading just waits for
 * the next plan. 0: the job fails (coord_jobs.c says why). */
static int train_stage_lost(nl_coord *c, cjob *j, const char *why)
{
    ctrain *t = j->state;
    if (t && t->ft && t->phase >= TR_BEGIN) /* adapters live on their stages: lost with one */
        return 0;
    if (!t || t->phase < TR_BEGIN)
        return 1;
    if (t->resumes >= c->o.train_resumes) {
        NL_WARN("train job %llu: a stage is lost and the job has resumed %d times already "
                "(--train-resumes %d)",
                (unsigned long long)j->id, t->resumes, c->o.train_resumes);
        return 0;
    }
    coord_close_session(c, j); /* the stages left drop the job */
    t->resumes++;
    t->t_lost = coord_now();
    t->lost_at = t->step;
    wait_reload(c, j);
    const int64_t from = c->src_manifest ? c->src_step : 0;
    NL_WARN("train job %llu: %s at step %lld; resuming from step %lld (%s) on the nodes left "
            "(resume %d of %d)",
            (unsigned long long)j->id, why, (long long)t->lost_at, (long long)from,
            c->src_path[0] ? c->src_path : "the seed", t->resumes, c->o.train_resumes);
    json_t *o = json_pack("{s:s,s:s,s:I,s:I,s:s,s:i,s:i}", "event", "node_lost", "why", why,
                          "lost_step", (json_int_t)t->lost_at, "resume_step", (json_int_t)from,
                          "source", c->src_path[0] ? c->src_path : "the seed", "resume", t->resumes,
                          "max_resumes", c->o.train_resumes);
    report(c, j, NL_JOB_RUNNING, "node lost; resuming", o);
    return 1;
}

/* A stage failed the job. When it cannot reach a neighbour (node.c says
 * "cannot reach the previous/next stage"; JOB_STATUS carries no code),
 * the neighbour has most likely died and the heartbeat timeout will say
 * so: with resumes left the job waits for that verdict (train_stage_lost
 * then resumes it); a neighbour that lives on leaves the job to
 * --job-timeout-ms. So does any failure after that one on the same plan:
 * the other stages' protocol errors follow from the lost hop (the soak
 * saw "GRADIENT of microbatch 1, but the next backward is of microbatch
 * 0" from the stage whose gradient could not be sent). Any other failure
 * (the device, the data) fails it. */
static int train_node_failed(nl_coord *c, cjob *j, const char *why)
{
    ctrain *t = j->state;
    if (!t || t->ft || t->phase < TR_BEGIN || t->resumes >= c->o.train_resumes)
        return 0;
    const int cut = strstr(why, "cannot reach the ") != NULL;
    if (!cut && t->verdict_epoch != c->epoch)
        return 0;
    if (cut)
        t->verdict_epoch = c->epoch;
    NL_WARN("train job %llu: %s; waiting for the heartbeat timeout to tell whether a node died "
            "(then the job resumes)%s",
            (unsigned long long)j->id, why,
            cut ? "" : " (after a stage could not reach its neighbour on this plan)");
    return 1;
}

/* The cluster is ready: a job that waited for it to load begins. */
static void train_ready(nl_coord *c, cjob *j)
{
    if (((ctrain *)j->state)->phase == TR_LOADING)
        begin(c, j);
}

const cjob_ops coord_train_ops = {
    .kind = NL_JOB_TRAIN,
    .name = "train",
    .submit = train_submit,
    .on_message = train_on_message,
    .stage_lost = train_stage_lost,
    .node_failed = train_node_failed,
    .ready = train_ready,
    .abort = train_abort,
    .fail_note = train_fail_note,
    .free = train_free,
};
