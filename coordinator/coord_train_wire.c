/* What a training job sends its stages, a leaf of the job's state
 * machine (coord_train.c), which decides when: the job itself (JOB_SUBMIT,
 * with the model's growth history), each step's batch and each
 * evaluation's held-out batches, made as local training makes them
 * (core/train/objective.h), cut into microbatches and sent as hops (the targets
 * ride along to the last stage). It changes no state of the job but the
 * batch arrays; a stage that cannot be reached is the caller's to judge. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_train_impl.h"
#include "core/grow/grow.h"
#include "core/train/objective.h"
#include "core/train/train.h"
#include "net/hopdigest.h"

/* Send m to every stage (every replica of it, or replica 0 only): 0, or
 * -1 and *lost the stage that cannot be reached. */
static int send_stages(nl_coord *c, nl_wire_msg *m, bool replicas, int *lost)
{
    for (int s = 0; s < c->plan->n_stages; s++)
        for (int r = 0; r < (replicas ? coord_stage_replicas(c, s) : 1); r++) {
            cnode *n = coord_stage_replica(c, s, r);
            if (!n || coord_send_node(c, n, m) != NL_OK) {
                *lost = s;
                return -1;
            }
        }
    return 0;
}

static int send_all(nl_coord *c, nl_wire_msg *m, int *lost)
{
    return send_stages(c, m, true, lost);
}

/* DiLoCo: replica group r's STEP, to replica r of every stage, clips by
 * the group's own gradient norm (its microbatches are its batch: the
 * stages scale its loss by its own rows). */
static int send_lanes(nl_coord *c, const ctrain *t, nl_wire_msg *m, int *lost)
{
    const int R = coord_stage_replicas(c, 0);
    for (int r = 0; r < R; r++) {
        m->u.step.clip_scale =
            t->r.skipped ? 0.0 : nl_step_clip(sqrt(t->lane_sumsq[r]), NL_TRAIN_CLIP_NORM);
        for (int s = 0; s < c->plan->n_stages; s++) {
            cnode *n = coord_stage_replica(c, s, r);
            if (!n || coord_send_node(c, n, m) != NL_OK) {
                *lost = s;
                return -1;
            }
        }
    }
    return 0;
}

int coord_train_send_decision(nl_coord *c, cjob *j, double scale, int *lost)
{
    coord_train_verify_sample(c, j); /* before the STEP changes the weights */
    const ctrain *t = j->state;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_STEP);
    m.u.step = (nl_msg_step){j->id, (uint64_t)t->step + 1, !t->r.skipped, scale, t->lr_now};
    int rc = c->o.outer_every > 0 && !t->ft ? send_lanes(c, t, &m, lost) : send_all(c, &m, lost);
    nl_wire_msg_free(&m);
    return rc;
}

int coord_train_send_ckpt_req(nl_coord *c, cjob *j, const char *dir, int *lost)
{
    const ctrain *t = j->state;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_CKPT_REQ);
    m.u.ckpt_req = (nl_msg_ckpt_req){j->id, (uint64_t)t->step, dir};
    int rc = 0;
    /* the stage's first live replica writes its shard: replica 0, unless
     * its node was lost in the step under way (SALVAGE, coord_train.c) */
    for (int s = 0; s < c->plan->n_stages && !rc; s++) {
        const int r = coord_stage_first_live(c, s);
        cnode *n = r >= 0 ? coord_stage_replica(c, s, r) : NULL;
        if (!n || coord_send_node(c, n, &m) != NL_OK) {
            *lost = s;
            rc = -1;
        }
    }
    nl_wire_msg_free(&m);
    return rc;
}

void coord_train_send_end(nl_coord *c, cjob *j)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
    m.u.job_ref.job_id = j->id;
    int lost = 0;
    send_all(c, &m, &lost); /* one that cannot be reached is declared dead at the tick */
    nl_wire_msg_free(&m);
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

int coord_train_send_job(nl_coord *c, cjob *j, int *lost)
{
    ctrain *t = j->state;
    t->verify_outputs = !t->ft && coord_train_verify_cross(c);
    nl_wire_param ps[14 + COORD_GROWTH_PARAMS + COORD_FT_PARAMS] = {
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
         .i = t->eval_every > 0 ? coord_train_eval_batches(t) * t->micro : 0},
        {.key = "verify_outputs", .kind = NL_WIRE_PARAM_BOOL, .b = t->verify_outputs != 0},
        {.key = "outer_every", .kind = NL_WIRE_PARAM_INT, .i = t->ft ? 0 : c->o.outer_every},
        {.key = "outer_lr", .kind = NL_WIRE_PARAM_FLOAT, .f = c->o.outer_lr},
        {.key = "outer_momentum", .kind = NL_WIRE_PARAM_FLOAT, .f = c->o.outer_momentum},
        {.key = "in_flight_extra", .kind = NL_WIRE_PARAM_INT, .i = c->o.in_flight_extra},
    };
    char keys[COORD_GROWTH_PARAMS][24], *texts[COORD_GROWTH_PARAMS] = {NULL};
    int np = 14 + growth_params(c, ps + 14, keys, texts);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    np += t->ft ? coord_finetune_stage_params(t->ft, t->seed, ps + np) : 0;
    m.u.job_submit = (nl_msg_job_submit){t->ft ? NL_JOB_FINETUNE : NL_JOB_TRAIN, (uint32_t)np, ps};
    int rc = send_all(c, &m, lost);
    nl_wire_msg_free(&m);
    for (int i = 0; i < COORD_GROWTH_PARAMS; i++)
        free(texts[i]);
    return rc;
}

/* Batch `index` of a split (0: training, 1: held out) of the job's
 * objective into t->tokens and the rest, as local training makes it:
 * the token objectives' batches (core/train/objective.h); classification's
 * examples (the held-out split in order, each once).
 * *valid: the predictions its loss is over (for classification, the
 * sequences; of a held-out batch, the examples in it). */
nl_status coord_train_make_batch(const nl_coord *c, ctrain *t, int split, uint64_t index,
                                 int64_t *valid, nl_error *e)
{
    const int B = (int)t->batch, T = (int)t->seq;
    if (t->lds && split == 0) {
        *valid = B;
        return nl_labelled_batch(t->lds, 0, (uint64_t)t->seed, index, B, T, t->tokens, t->lengths,
                                 t->labels, t->docs, e);
    }
    if (t->lds) {
        int n = 0;
        nl_status st = nl_labelled_eval_batch(t->lds, (size_t)index, B, T, t->tokens, t->lengths,
                                              t->labels, t->docs, &n, e);
        *valid = n;
        return st;
    }
    return nl_objective_batch(t->ds, t->objective, &c->cfg, split, (uint64_t)t->seed, index, B, T,
                              t->tokens, t->targets, t->pack ? t->docs : NULL, valid, e);
}

/* The held-out batches of an evaluation: eval_batches, or (classify) as
 * many as the held-out split fills. */
int64_t coord_train_eval_batches(const ctrain *t)
{
    return t->lds ? (int64_t)nl_labelled_eval_batches(t->lds, (int)t->batch) : t->eval_batches;
}

/* A hop of `type` with microbatch mb of the batch in t->tokens (and the
 * objective's arrays: the targets, or classification's documents, labels
 * and lengths; packed rows' documents; a COUNT takes the documents only)
 * to stage 0: to its replica mb mod R (DESIGN section 8), an evaluation's
 * to replica 0. */
static int send_hop(nl_coord *c, cjob *j, nl_msg_type type, uint64_t step, uint32_t mb,
                    int64_t loss_rows)
{
    ctrain *t = j->state;
    const int64_t B = t->batch / t->micro, shape[2] = {B, t->seq};
    const size_t rows = (size_t)B * (size_t)t->seq, m0 = mb % (uint32_t)t->micro;
    const bool count = type == NL_MSG_COUNT, classify = t->lds != NULL, docs = classify || t->pack;
    const int R = coord_stage_replicas(c, 0);
    cnode *first = coord_stage_replica(c, 0, type == NL_MSG_EVAL ? 0 : (int)(mb % (uint32_t)R));
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, type);
    m.u.hop = (nl_msg_tensor_hop){j->id, step, mb, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], t->tokens + m0 * rows, NL_DTYPE_I32, shape, 2); /* copied */
    m.nframes = 1;
    nl_wire_hop_set_extras(&m, B, t->seq, count || classify ? NULL : t->targets + m0 * rows,
                           docs ? t->docs + m0 * rows : NULL,
                           classify && !count ? t->labels + m0 * B : NULL,
                           classify && !count ? t->lengths + m0 * B : NULL);
    m.u.train_hop.loss_rows = loss_rows > 0 ? (uint64_t)loss_rows : 0;
    m.u.train_hop.epoch = c->epoch;
    char digest[NL_HOP_DIGEST_HEX + 1];                    /* stage 0 checks what it receives */
    const bool act = type == NL_MSG_ACTIVATION && t->sent; /* kept: stage 0 reports it */
    nl_hop_digest_set(&m, 0, digest, act ? t->sent + (size_t)m0 * NL_HOP_DIGEST_BYTES : NULL);
    int rc = first && coord_send_node(c, first, &m) == NL_OK ? 0 : -1;
    nl_wire_msg_free(&m);
    return rc;
}

/* The loss rows the last stage's gradient of microbatch mb is scaled by:
 * every position of clm (0 says so), the masked ones of mlm, the
 * sequences of classify; those not ignored at packed rows' document ends.
 * Every-step sync: the batch's. DiLoCo: those of mb's replica group (its
 * microbatches mb mod R are its batch, DESIGN section 8), as the group's
 * own rows scale its gradient where every target counts. */
static int64_t hop_loss_rows(const nl_coord *c, const ctrain *t, int64_t mb)
{
    const int R = coord_stage_replicas(c, 0);
    if (c->o.outer_every == 0 || t->ft || R <= 1)
        return nl_objective_loss_rows(t->objective, t->valid, t->batch * t->seq);
    const int64_t rows = t->batch / t->micro * t->seq, group = t->micro / R;
    int64_t valid = 0;
    if (t->lds) /* classify: one prediction per sequence */
        valid = t->batch / R;
    for (int64_t i = mb % R; !t->lds && i < t->micro; i += R)
        for (int64_t n = i * rows; n < (i + 1) * rows; n++)
            valid += t->targets[n] >= 0;
    return nl_objective_loss_rows(t->objective, valid, group * rows);
}

int coord_train_send_step(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    if (!t->sent) /* out of memory: stage 0's inputs go unchecked, as an older peer's */
        t->sent = calloc((size_t)t->micro, NL_HOP_DIGEST_BYTES);
    const uint64_t k = (uint64_t)t->step + 1;
    /* the batch's expert shares first (DESIGN: frac_e over the whole batch;
     * DiLoCo: over the replica group's microbatches) */
    for (int64_t mb = 0; t->micro > 1 && mb < t->micro; mb++)
        if (send_hop(c, j, NL_MSG_COUNT, k, (uint32_t)mb, hop_loss_rows(c, t, mb)) != 0)
            return -1;
    for (int64_t mb = 0; mb < t->micro; mb++)
        if (send_hop(c, j, NL_MSG_ACTIVATION, k, (uint32_t)mb, hop_loss_rows(c, t, mb)) != 0)
            return -1;
    return 0;
}

int coord_train_send_eval(nl_coord *c, cjob *j, nl_error *e)
{
    ctrain *t = j->state;
    t->eval_rows = 0.0;
    for (int64_t i = 0; i < coord_train_eval_batches(t); i++) {
        int64_t n = 0;
        if (coord_train_make_batch(c, t, 1, (uint64_t)i, &n, e) != NL_OK)
            return -1;
        t->eval_rows += (double)n;
        for (int64_t mb = 0; mb < t->micro; mb++)
            if (send_hop(c, j, NL_MSG_EVAL, (uint64_t)t->step, (uint32_t)(i * t->micro + mb),
                         t->lds ? t->batch : 0) != 0)
                return 1;
    }
    return 0;
}
