/* The coordinator's training job: a worker reads and tokenizes the data
 * (and verifies the manifest it resumes from), then the job feeds each
 * step's microbatches to the first stage (the targets ride along to
 * the last), sums the stages' gradient norms, decides every step (apply
 * with the learning rate and clipping scale, or skip on a non-finite
 * value), runs the evaluations, asks every stage for its checkpoint shard
 * and has a worker write the manifest last and verify it. The client sees
 * JOB_STATUS messages with a JSON report per event (docs/cluster.md,
 * "Training"). This file runs the steps, the stages' reports and the
 * recoveries; coord_train_prep.c prepares the job (parameters, paths,
 * data), coord_train_ckpt.c writes its checkpoints. */
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

void coord_train_free_shards(nl_manifest_shard *sh, int n)
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
    nl_labelled_destroy(&t->lds);
    free(t->tokens);
    free(t->targets);
    free(t->docs);
    free(t->labels);
    free(t->lengths);
    free(t->got);
    coord_train_free_shards(t->shards, t->stages);
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
void coord_train_report(nl_coord *c, cjob *j, int state, const char *msg, json_t *o)
{
    const ctrain *t = j->state;
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    const double progress = t->steps > 0 ? (double)t->step / (double)t->steps : 0.0;
    coord_status_to(c, j->rid, j->rid_len, j->id, state, progress > 1 ? 1 : progress, msg, text);
    free(text);
}

void coord_train_fail(nl_coord *c, cjob *j, const char *fmt, ...)
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
        coord_train_fail(c, j, "node %u (stage %d, layers [%d, %d), %s) %s", n->id, s, ps->l0,
                         ps->l1, n->endpoint, n->why[0] ? n->why : "cannot be reached");
    else
        coord_train_fail(c, j, "stage %d has no live node", s);
}

/* A hop of `type` with microbatch mb of the batch in t->tokens (and the
 * objective's arrays: the targets, or classification's documents, labels
 * and lengths; a COUNT takes the documents only) to stage 0. */
static int send_hop(nl_coord *c, cjob *j, nl_msg_type type, uint64_t step, uint32_t mb,
                    int64_t loss_rows)
{
    const ctrain *t = j->state;
    const int64_t B = t->batch / t->micro, shape[2] = {B, t->seq};
    const size_t rows = (size_t)B * (size_t)t->seq, m0 = mb % (uint32_t)t->micro;
    const bool count = type == NL_MSG_COUNT, classify = t->lds != NULL;
    cnode *first = coord_stage_node(c, 0);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, type);
    m.u.hop = (nl_msg_tensor_hop){j->id, step, mb, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], t->tokens + m0 * rows, NL_DTYPE_I32, shape, 2); /* copied */
    m.nframes = 1;
    nl_wire_hop_set_extras(&m, B, t->seq, count || classify ? NULL : t->targets + m0 * rows,
                           classify ? t->docs + m0 * rows : NULL,
                           classify && !count ? t->labels + m0 * B : NULL,
                           classify && !count ? t->lengths + m0 * B : NULL);
    m.u.train_hop.loss_rows = loss_rows > 0 ? (uint64_t)loss_rows : 0;
    int rc = first && coord_send_node(c, first, &m) == NL_OK ? 0 : -1;
    nl_wire_msg_free(&m);
    return rc;
}

/* Batch `index` of a split (0: training, 1: held out) of the job's
 * objective into t->tokens and the rest, as local training makes it
 * (cli/cmd_train.c): next-token windows; mlm's masked tokens (DESIGN 6);
 * classification's examples (the held-out split in order, each once).
 * *valid: the predictions its loss is over (for classification, the
 * sequences; of a held-out batch, the examples in it). */
static nl_status make_batch(const nl_coord *c, ctrain *t, int split, uint64_t index, int64_t *valid,
                            nl_error *e)
{
    const int B = (int)t->batch, T = (int)t->seq;
    nl_status st;
    if (t->lds && split == 0) {
        *valid = B;
        return nl_labelled_batch(t->lds, 0, (uint64_t)t->seed, index, B, T, t->tokens, t->lengths,
                                 t->labels, t->docs, e);
    }
    if (t->lds) {
        int n = 0;
        st = nl_labelled_eval_batch(t->lds, (size_t)index, B, T, t->tokens, t->lengths, t->labels,
                                    t->docs, &n, e);
        *valid = n;
        return st;
    }
    st = nl_dataset_batch(t->ds, split, (uint64_t)t->seed, index, B, T, t->tokens, t->targets, e);
    *valid = (int64_t)B * T;
    if (st == NL_OK && t->objective == NL_OBJ_MLM)
        *valid =
            (int64_t)nl_mlm_mask(t->tokens, t->targets, (size_t)B * T, c->cfg.mask_prob,
                                 c->cfg.vocab_size, (uint64_t)t->seed + (uint64_t)split, index);
    return st;
}

/* The held-out batches of an evaluation: eval_batches, or (classify) as
 * many as the held-out split fills. */
static int64_t eval_batches(const ctrain *t)
{
    return t->lds ? (int64_t)nl_labelled_eval_batches(t->lds, (int)t->batch) : t->eval_batches;
}

/* ---------------------------------------------------------------- the run */

/* The job waits while the cluster plans again and reloads from its
 * source (the last verified manifest, or what the job began from); once
 * ready, coord_train_begin() continues from the source's step (or the start). */
void coord_train_wait_reload(nl_coord *c, cjob *j)
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
        coord_train_fail(c, j, "training memory: %s; and no plan over the nodes holds it: %s", why,
                         none);
        return 0;
    }
    if (t->mem_replanned || c->stages_modified) {
        coord_train_fail(c, j, "training memory: %s%s", why,
                         c->stages_modified
                             ? " (the stages hold weights trained since the last checkpoint, "
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
    coord_train_wait_reload(c, j);
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

void coord_train_begin(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    /* a fine-tuning job keeps no moments of the base: each stage checks
     * that its adapters' job fits, and the plan stays as it is */
    if (!t->ft && !plan_for_training(c, j))
        return;
    free(t->got);
    coord_train_free_shards(t->shards, t->stages); /* a resumed job's, of its former plan */
    t->stages = c->plan->n_stages;
    t->got = calloc((size_t)t->stages, 1);
    t->shards = calloc((size_t)t->stages, sizeof *t->shards);
    if (!t->got || !t->shards) {
        coord_train_fail(c, j, "out of memory");
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
        coord_train_fail(c, j, "--steps %lld: the cluster's model is already at step %lld",
                         (long long)t->steps, (long long)t->start);
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
         .i = t->eval_every > 0 ? eval_batches(t) * t->micro : 0},
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
    static const char *const obj_names[] = {"clm", "mlm", "classify"};
    const size_t n_all = t->lds ? t->lds->n : t->ds->n,
                 n_train = t->lds ? t->lds->n_train : t->ds->n_train;
    json_t *o =
        json_pack("{s:s,s:I,s:I,s:I,s:I,s:I,s:i,s:I,s:I,s:I,s:s}", "event", "start", "start_step",
                  (json_int_t)t->start, "steps", (json_int_t)t->steps, "params",
                  (json_int_t)nl_config_param_count(&c->cfg), t->lds ? "examples" : "tokens",
                  (json_int_t)n_train, "held_out", (json_int_t)(n_all - n_train), "stages",
                  t->stages, "batch", (json_int_t)t->batch, "seq", (json_int_t)t->seq,
                  "microbatches", (json_int_t)t->micro, "objective", obj_names[t->objective]);
    if (o && t->lds)
        json_object_set_new(o, "classes", json_integer(t->lds->n_classes));
    json_t *devices = json_array(); /* each stage's device, as its node's JOIN said */
    for (int s = 0; devices && s < t->stages; s++) {
        cnode *n = coord_stage_node(c, s);
        json_array_append_new(devices, n ? json_string(n->device) : json_null());
    }
    json_object_set_new(o, "devices", devices);
    if (t->resumes > 0 && t->t_lost > 0) { /* the nodes' plan after a loss (not a re-plan at a
                                                checkpoint that follows one) */
        json_object_set_new(o, "resumes", json_integer(t->resumes));
        json_object_set_new(o, "plan", json_integer((json_int_t)c->epoch));
        json_object_set_new(o, "since_lost_s", jnum(coord_now() - t->t_lost));
        NL_INFO("train job %llu: resumed at step %lld on plan %llu (%d stages), %.2f s after the "
                "loss (resume %d of %d)",
                (unsigned long long)j->id, (long long)t->start, (unsigned long long)c->epoch,
                t->stages, coord_now() - t->t_lost, t->resumes, c->o.train_resumes);
    }
    coord_train_report(c, j, NL_JOB_RUNNING, t->resumes > 0 && t->t_lost > 0 ? "resumed" : "starting",
                       o);
    NL_INFO("train job %llu: %lld steps of %lld x %lld in %lld microbatches on %d stages, from "
            "step %lld%s",
            (unsigned long long)j->id, (long long)t->steps, (long long)t->batch, (long long)t->seq,
            (long long)t->micro, t->stages, (long long)t->start,
            t->moments ? " (resumed with the manifest's moments)" : "");
}

void coord_train_start_step(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    nl_error e = {0};
    const uint64_t k = (uint64_t)t->step + 1;
    if (make_batch(c, t, 0, (uint64_t)t->step, &t->valid, &e) != NL_OK) {
        coord_train_fail(c, j, "%s", e.msg);
        return;
    }
    /* the loss rows the last stage's gradient is scaled by: every position
     * of clm (0 says so), the masked ones of mlm, the sequences of classify */
    const int64_t loss_rows = t->objective == NL_OBJ_CLM ? 0 : t->valid;
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
        if (send_hop(c, j, NL_MSG_COUNT, k, (uint32_t)mb, loss_rows) != 0)
            goto unreachable;
    for (int64_t mb = 0; mb < t->micro; mb++)
        if (send_hop(c, j, NL_MSG_ACTIVATION, k, (uint32_t)mb, loss_rows) != 0)
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
    const double scale = nl_step_decide(r, t->ce, t->valid > 0 ? (double)t->valid : 1.0, t->aux,
                                        c->cfg.aux_loss_coef, t->sumsq, NL_TRAIN_CLIP_NORM);
    if (!r->skipped) {
        t->skips = 0;
    } else if (++t->skips >= NL_TRAIN_MAX_SKIPS) {
        coord_train_fail(
            c, j, "stage %d reported a non-finite %s for %d steps in a row (to step %lld): refused",
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
        /* the held-out batches, as local evaluation makes them */
        nl_error e = {0};
        t->phase = TR_EVAL;
        t->eval_rows = 0.0;
        for (int64_t i = 0; i < eval_batches(t); i++) {
            int64_t n = 0;
            if (make_batch(c, t, 1, (uint64_t)i, &n, &e) != NL_OK) {
                coord_train_fail(c, j, "evaluation: %s", e.msg);
                return;
            }
            t->eval_rows += (double)n;
            for (int64_t mb = 0; mb < t->micro; mb++)
                if (send_hop(c, j, NL_MSG_EVAL, (uint64_t)t->step, (uint32_t)(i * t->micro + mb),
                             t->lds ? t->batch : 0) != 0) {
                    unreachable(c, j, 0);
                    return;
                }
        }
        return;
    }
    after_step(c, j);
}

/* The job ends, done or (cancelled) with the steps done kept: the client
 * is told where they are, and the stages free their trainers. Either way
 * the stages hold the weights of the last checkpoint (or of a done run),
 * so nothing is reloaded. */
static void train_end(nl_coord *c, cjob *j, int cancelled)
{
    ctrain *t = j->state;
    const int kept = t->manifest[0] && t->manifest_step == t->step;
    const char *adapter = t->ft && t->ft->adapter[0] ? t->ft->adapter : NULL;
    json_t *o = json_pack("{s:s,s:I}", "event", cancelled ? "cancelled" : "done", "step",
                          (json_int_t)t->step);
    if (kept)
        json_object_set_new(o, "manifest", json_string(t->manifest));
    if (adapter)
        json_object_set_new(o, "adapter", json_string(adapter));
    char msg[8400] = "done";
    if (cancelled && adapter)
        snprintf(msg, sizeof msg, "cancelled at step %lld; kept the adapters in %s",
                 (long long)t->step, adapter);
    else if (cancelled && kept)
        snprintf(msg, sizeof msg, "cancelled at step %lld; kept %s (continue with --resume %s)",
                 (long long)t->step, t->manifest, t->manifest);
    else if (cancelled)
        snprintf(msg, sizeof msg, "cancelled at step %lld; no step of this job to keep",
                 (long long)t->step);
    if (cancelled)
        NL_INFO("%s job %llu: %s", j->ops->name, (unsigned long long)j->id, msg);
    else
        NL_INFO("%s job %llu: done at step %lld", j->ops->name, (unsigned long long)j->id,
                (long long)t->step);
    coord_train_report(c, j, cancelled ? NL_JOB_CANCELLED : NL_JOB_DONE, msg, o);
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

void coord_train_finish(nl_coord *c, cjob *j)
{
    train_end(c, j, 0);
}

void coord_train_cancelled(nl_coord *c, cjob *j)
{
    train_end(c, j, 1);
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
    if (o && t->has_eval && t->lds)
        json_object_set_new(o, "eval_accuracy", jnum(t->eval_acc));
    char msg[64];
    snprintf(msg, sizeof msg, "step %lld of %lld", (long long)t->step, (long long)t->steps);
    coord_train_report(c, j, NL_JOB_RUNNING, msg, o);
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
    /* a fine-tuning job writes its adapters once, at the end (or when
     * cancelled); a cancelled training job keeps the steps done */
    const int ckpt = t->ft ? t->step == t->steps || t->cancel
                           : ((due(t->step, t->ckpt_every) || t->cancel) && t->step < t->steps) ||
                                 (t->step == t->steps && t->final_ckpt);
    if (!ckpt) {
        if (t->step == t->steps)
            coord_train_finish(c, j);
        else
            coord_train_start_step(c, j);
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
            coord_train_fail(c, j, "checkpoint directory %s is longer than 1024 bytes", dir);
        return;
    }
    t->phase = TR_CKPT;
    memset(t->got, 0, (size_t)t->stages);
    t->acks = 0;
}

/* ---------------------------------------------------------------- messages */

static void train_submit(nl_coord *c, const nl_rx *rx)
{
    coord_train_submit(c, rx, NULL);
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

/* JOB_CANCEL of a job that has begun: the step under way ends (or the
 * checkpoint being written is finished), a checkpoint keeps the steps
 * done (after_step asks for it; ckpt_done and coord_train_finetuned then
 * end the job as cancelled), as local training does on Ctrl-C. A job
 * preparing, loading or not yet at its first step has nothing to keep: it
 * ends now (0). A second cancel changes nothing: the checkpoint under way
 * is not lost. A stage lost meanwhile: the ordinary rules, then the job
 * ends at the manifest it resumed from (train_ready). */
static int train_cancel(nl_coord *c, cjob *j, const nl_rx *rx)
{
    ctrain *t = j->state;
    if (!t || t->phase <= TR_BEGIN)
        return 0;
    const int64_t k = t->phase == TR_STEP ? t->step + 1 : t->step;
    char msg[200];
    snprintf(msg, sizeof msg, "stopping after step %lld: writing a checkpoint", (long long)k);
    const int own = j->rid_len == rx->rid_len && memcmp(j->rid, rx->rid, rx->rid_len) == 0;
    if (!t->cancel)
        NL_INFO("%s job %llu cancelled by %s at step %lld: %s", j->ops->name,
                (unsigned long long)j->id, own ? "its client" : "an admin", (long long)t->step,
                msg);
    t->cancel = 1;
    json_t *o = json_pack("{s:s,s:I}", "event", "stopping", "step", (json_int_t)k);
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    coord_status_to(c, rx->rid, rx->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg, text);
    if (!own) /* an admin's: the job's client learns it too */
        coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg, text);
    free(text);
    return 1;
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
    coord_train_start_step(c, j);
}

static void on_grad_norm(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const nl_msg_grad_norm *g = &rx->msg.u.grad_norm;
    ctrain *t = j->state;
    if (!report_ok(c, j, rx, g->stage, TR_STEP) || g->step != (uint64_t)t->step + 1 ||
        t->got[g->stage])
        return;
    if (g->sumsq < 0) { /* no sum of squares is negative: a lie */
        coord_train_fail(c, j,
                         "stage %u reported a gradient sum of squares of %g for step %lld: refused",
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
            coord_train_fail(
                c, j, "stage %u (the last) reported a loss of %g (aux %g) for step %lld: refused",
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
        coord_train_fail(
            c, j, "stage %u (the last) reported an evaluation loss of %g at step %lld: refused",
            last, l->ce_sum, (long long)t->step);
        return;
    }
    if (t->lds && (l->rows != (uint64_t)t->eval_rows || rx->msg.u.train_loss.correct > l->rows)) {
        coord_train_fail(c, j,
                         "stage %u (the last) scored %llu held-out examples (%llu right) at step "
                         "%lld, but %.0f were sent: refused",
                         last, (unsigned long long)l->rows,
                         (unsigned long long)rx->msg.u.train_loss.correct, (long long)t->step,
                         t->eval_rows);
        return;
    }
    j->last_progress = coord_now();
    /* the mean over the predictions: every position (clm), the masked ones
     * (mlm), the held-out examples (classify) */
    t->eval_loss = l->ce_sum / (t->eval_rows > 0 ? t->eval_rows : 1.0);
    t->eval_acc = t->lds && l->rows ? (double)rx->msg.u.train_loss.correct / (double)l->rows : 0.0;
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
        coord_train_fail(c, j, "stage %u wrote its shard to %s, not %s", d->stage, d->path, want);
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
                              .tf32 = coord_train_shard_tf32(d->path)};
    snprintf(sh->sha256, sizeof sh->sha256, "%s", d->sha256);
    if (!sh->file || !sh->path || !sh->node || !sh->device) {
        coord_train_fail(c, j, "out of memory");
        return;
    }
    t->got[d->stage] = 2;
    if (++t->acks < t->stages)
        return;
    if (!t->ft) {
        coord_train_write_manifest(c, j);
        return;
    }
    nl_error e = {0}; /* fine-tuning: a worker joins the adapters into one file */
    if (coord_finetune_gather(c, j->id, t->ft, t->shards, t->stages, dir, &e) != NL_OK)
        coord_train_fail(c, j, "the adapters of step %lld: %s", (long long)t->step, e.msg);
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
 * from; once loaded, coord_train_begin() continues from the source's step. Every batch
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
    coord_train_wait_reload(c, j);
    const int64_t from = c->src_manifest ? c->src_step : 0;
    NL_WARN("train job %llu: %s at step %lld; resuming from step %lld (%s) on the nodes left "
            "(resume %d of %d)",
            (unsigned long long)j->id, why, (long long)t->lost_at, (long long)from,
            c->src_path[0] ? c->src_path : "the seed", t->resumes, c->o.train_resumes);
    json_t *o = json_pack("{s:s,s:s,s:I,s:I,s:s,s:i,s:i}", "event", "node_lost", "why", why,
                          "lost_step", (json_int_t)t->lost_at, "resume_step", (json_int_t)from,
                          "source", c->src_path[0] ? c->src_path : "the seed", "resume", t->resumes,
                          "max_resumes", c->o.train_resumes);
    coord_train_report(c, j, NL_JOB_RUNNING, "node lost; resuming", o);
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
    ctrain *t = j->state;
    if (t->phase != TR_LOADING)
        return;
    if (t->cancel && !t->ft) { /* cancelled, then a stage lost: the source keeps the steps */
        if (c->src_manifest) {
            snprintf(t->manifest, sizeof t->manifest, "%s", c->src_path);
            t->manifest_step = t->step = c->src_step;
        }
        coord_train_cancelled(c, j);
        return;
    }
    coord_train_begin(c, j);
}

const cjob_ops coord_train_ops = {
    .kind = NL_JOB_TRAIN,
    .name = "train",
    .takes = COORD_TAKES(NL_MSG_JOB_STATUS) | COORD_TAKES(NL_MSG_GRAD_NORM) |
             COORD_TAKES(NL_MSG_LOSS) | COORD_TAKES(NL_MSG_CKPT_DONE),
    .submit = train_submit,
    .on_message = train_on_message,
    .stage_lost = train_stage_lost,
    .node_failed = train_node_failed,
    .ready = train_ready,
    .abort = train_abort,
    .cancel = train_cancel,
    .fail_note = train_fail_note,
    .free = train_free,
};
