/* Training on one stage, the running part (see the top of stage_train.c):
 * the hops sent on, the replicas' jobs on their lanes and taken back in
 * order, and the 1F1B schedule that dispatches what has become runnable. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "core/data/labelled.h"
#include "core/plan/planner.h"
#include "core/train/train.h"
#include "node/replica_workers.h"
#include "node/stage_train_impl.h"

/* ===================== sending ===================== */

/* Send a hop (type) of this job with hidden states (rows x d, host) to
 * the next stage or (GRADIENT) the previous; e (NULL for a GRADIENT): the
 * frames that travel on with it (a COUNT's documents only). */
static nl_status send_host(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                           nl_msg_type type, uint64_t step, uint32_t mb, double aux, const float *x,
                           const hop_extra *e, nl_error *err)
{
    const int64_t xs[3] = {t->mbB, t->T, (int64_t)t->d};
    nl_wire_msg_reset(&t->tx, type);
    /* the step's number of the microbatch (an evaluation's are its own) */
    const uint32_t wire_mb = type == NL_MSG_EVAL ? mb : stage_train_mb_wire(t, mb);
    t->tx.u.hop = (nl_msg_tensor_hop){t->job, step, wire_mb, 0, 0, aux};
    t->tx.u.train_hop.epoch = nl_stage_epoch(s);
    /* FP32, or rounded to bf16 (--wire): the receiver widens it */
    nl_status st = nl_stage_hidden_out(s, &t->tx.frames[0], x, xs, 3, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "train job %llu", (unsigned long long)t->job);
    t->tx.nframes = 1;
    if (e) {
        const bool count = type == NL_MSG_COUNT;
        nl_wire_hop_set_extras(&t->tx, t->mbB, t->T, count ? NULL : e->targets, e->docs,
                               count ? NULL : e->labels, count ? NULL : e->lengths);
        t->tx.u.train_hop.loss_rows = e->loss_rows;
    }
    /* the digest for the stage it goes to; the step's own hops are kept */
    const bool grad = type == NL_MSG_GRADIENT;
    uint8_t *keep = (type == NL_MSG_ACTIVATION || grad) && step == t->begun && mb < (uint32_t)t->M
                        ? stage_train_dig(t, mb, grad ? NL_DIGEST_BWD_OUT : NL_DIGEST_FWD_OUT)
                        : NULL;
    nl_hop_digest_set(&t->tx, (uint32_t)(s->stage_idx + (grad ? -1 : 1)), t->dig_hex, keep);
    return send(ctx, type == NL_MSG_GRADIENT ? NL_STAGE_TO_PREV : NL_STAGE_TO_NEXT, &t->tx, err);
}

/* send_host of hidden states in the memory of be. */
static nl_status send_hop(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                          nl_msg_type type, uint64_t step, uint32_t mb, double aux, nl_backend *be,
                          const float *x_dev, const hop_extra *e, nl_error *err)
{
    const float *x =
        nl_backend_read_view(be, &t->stage, x_dev, t->rows * t->d * sizeof(float), err);
    if (!x)
        return nl_error_prefix(err, "train job %llu", (unsigned long long)t->job);
    return send_host(s, t, send, ctx, type, step, mb, aux, x, e, err);
}

/* The step's gradients are all in: the replicas' sum on every replica
 * (this node's, then the stage's on other nodes), then the report. The
 * lanes are idle (every job of the step has been taken back). */
static nl_status finish_step(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                             nl_error *err)
{
    if (t->R > 1) {
        float *grads[NL_COMM_MAX];
        for (int r = 0; r < t->R; r++)
            grads[r] = nl_trainer_grads(t->rep[r].tr);
        nl_status st = nl_comm_allreduce_sum(s->comm, grads, s->model->n_params, err);
        if (st != NL_OK)
            return nl_error_prefix(err, "the gradients of %d replicas", t->R);
    }
    if (t->xR > 1) /* reported when the replicas' sum is in (stage_train_ring.c) */
        return stage_train_reduce_grads(s, t, send, ctx, err);
    return stage_train_report(s, t, send, ctx, err);
}

nl_status stage_train_report(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                             nl_error *err)
{
    t->finished = 1;
    /* every replica reports the digests of the microbatches it ran (a
     * verification case names the replica that ran it); replica 0's norm
     * and losses are the stage's (DiLoCo: each replica group's own) */
    const double sumsq = nl_trainer_grad_sumsq(t->rep[0].tr);
    nl_wire_msg_reset(&t->tx, NL_MSG_GRAD_NORM);
    t->tx.u.grad_norm = (nl_msg_grad_norm){t->job, t->begun, (uint32_t)s->stage_idx,
                                           isnan(sumsq) || sumsq >= 0 ? sumsq : NAN};
    /* the step's hop digests ride along (copied by the send) */
    const int64_t dshape[3] = {t->Mg, NL_DIGEST_KINDS, NL_HOP_DIGEST_BYTES};
    nl_wire_frame_set(&t->tx.frames[0], t->dig, NL_DTYPE_U8, dshape, 3);
    t->tx.nframes = 1;
    nl_status st = send(ctx, NL_STAGE_TO_COORD, &t->tx, err);
    if (st != NL_OK || !s->model->has_head || (t->xr != 0 && t->H == 0))
        return st;
    nl_wire_msg_reset(&t->tx, NL_MSG_LOSS);
    const uint64_t rows = (uint64_t)(t->H > 0 ? t->M : t->Mg) * t->rows;
    t->tx.u.loss = (nl_msg_loss){t->job, t->begun, false, t->ce, t->aux, rows};
    return send(ctx, NL_STAGE_TO_COORD, &t->tx, err);
}

/* ===================== the replicas' jobs ===================== */

/* A job to fill (from the free list, or a new one). */
rjob *stage_train_job_get(stage_train *t, job_kind kind, int lane, nl_error *err)
{
    rjob *j = t->free_jobs;
    if (j) {
        t->free_jobs = j->free_next;
    } else {
        j = calloc(1, sizeof *j);
        /* an output to send: a counting pass or forward that goes on, a gradient that goes back */
        if (j && (!t->has_head || !t->has_embed))
            j->out = malloc(t->rows * t->d * sizeof(float));
        if (!j || ((!t->has_head || !t->has_embed) && !j->out)) {
            free(j);
            nl_error_set(err, NL_ERR_NOMEM, "train job %llu: out of memory",
                         (unsigned long long)t->job);
            return NULL;
        }
        j->all_next = t->jobs;
        t->jobs = j;
    }
    float *out = j->out;
    rjob *all = j->all_next;
    memset(j, 0, sizeof *j);
    j->out = out;
    j->all_next = all;
    j->kind = kind;
    j->w.lane = lane;
    return j;
}

void stage_train_job_put(stage_train *t, rjob *j)
{
    stage_train_keep(t, j); /* this step's inputs, for verification */
    free(j->x);
    j->x = NULL;
    stage_train_extra_free(&j->e);
    j->free_next = t->free_jobs;
    t->free_jobs = j;
}

/* Copy a device output of the job's replica into j->out, to be sent. */
static nl_status take_output(nl_backend *be, rjob *j, nl_msg_type type, const float *dev,
                             size_t floats)
{
    be->download(be, j->out, dev, floats * sizeof(float));
    j->out_type = type;
    return nl_backend_check(be, &j->err);
}

/* The backward of a job's microbatch (dy in the replica's memory; NULL:
 * from the loss) and the gradient to send upstream. */
static nl_status job_backward(stage_train *t, replica *p, rjob *j, const float *dy)
{
    nl_status st = nl_trainer_backward(p->tr, j->slot, dy, &j->err);
    if (st == NL_OK && !t->has_embed)
        st = take_output(p->be, j, NL_MSG_GRADIENT, nl_trainer_input_grad(p->tr), t->rows * t->d);
    return st;
}

void stage_train_model_init(nl_stage *s, stage_train *t)
{
    const nl_model *m = s->model;
    t->no_compute = s->o.inject_no_compute != 0;
    t->modelled_us = &s->modelled_us;
    if (!t->no_compute || !(s->o.inject_compute_gflops > 0))
        return;
    const int rows = (int)t->rows; /* the planner's cost model (core/plan/planner.h) */
    double f = (m->l1 - m->l0) * nl_plan_layer_flops(&m->cfg, rows, t->T);
    f += m->has_head ? nl_plan_head_flops(&m->cfg, rows) : 0.0;
    f += m->has_embed ? nl_plan_embed_flops(&m->cfg, rows) : 0.0;
    t->model_fwd_s = f / (s->o.inject_compute_gflops * 1e9);
}

/* Test hook (NL_TEST_COMPUTE_GFLOPS): the device's time for a piece of
 * work, slept where the work runs, so that the node's loop goes on with
 * what needs no device meanwhile as it does while a device computes (a
 * hop that waits for its step's STEP, the replicas' all-reduce). */
static void model_sleep(stage_train *t, double s)
{
    if (!(s > 0))
        return;
    const double whole = (double)(time_t)s;
    nanosleep(&(struct timespec){(time_t)whole, (long)((s - whole) * 1e9)}, NULL);
    atomic_fetch_add(t->modelled_us, (uint_least64_t)(s * 1e6));
}

/* Runs on the replica's lane (replica_workers.h). */
void stage_train_run_job(void *ctx, nl_wjob *w)
{
    stage_train *t = ctx;
    rjob *j = (rjob *)w;
    replica *p = &t->rep[w->lane];
    const size_t n = t->rows * t->d;
    const int32_t *tokens = t->has_embed ? j->x : NULL;
    const float *x = NULL;
    nl_status st = NL_OK;
    if (atomic_load(&t->failed)) {
        j->st = nl_error_set(&j->err, NL_ERR_STATE, "skipped: an earlier job failed");
        return;
    }
    if (t->no_compute && j->kind != JOB_BEGIN && j->kind != JOB_STEP) {
        /* test hook: the compute model sleeps for this work now that it
         * runs (a forward, twice that for a backward, a training forward
         * and backward together on the last stage); what goes on is zero
         * (a pass on the last stage, a forward on the first, has nothing
         * to send) */
        model_sleep(t, (j->kind == JOB_BACKWARD                 ? 2.0
                        : j->kind == JOB_FORWARD && t->has_head ? 3.0
                                                                : 1.0) *
                           t->model_fwd_s);
        const bool out = j->kind == JOB_BACKWARD                 ? !t->has_embed
                         : j->kind == JOB_FORWARD && t->has_head ? !t->has_embed
                                                                 : !t->has_head;
        if (out)
            memset(j->out, 0, n * sizeof(float));
        j->out_type = !out                                     ? 0
                      : j->kind == JOB_COUNT                   ? NL_MSG_COUNT
                      : j->kind == JOB_FORWARD && !t->has_head ? NL_MSG_ACTIVATION
                                                               : NL_MSG_GRADIENT;
        j->st = NL_OK;
        return;
    }
    if (!t->has_embed && (j->kind == JOB_COUNT || j->kind == JOB_FORWARD))
        x = nl_backend_device_view(p->be, p->x_d, j->x, n * sizeof(float));
    switch (j->kind) {
    case JOB_BEGIN:
        /* the step's rows (DiLoCo: the group's own, its batch) */
        nl_trainer_begin_step(p->tr, (int64_t)(t->H > 0 ? t->M : t->Mg) * (int64_t)t->rows);
        if (j->e.loss_rows > 0) /* the masked positions, or the sequences */
            nl_trainer_set_loss_rows(p->tr, (int64_t)j->e.loss_rows);
        break;
    case JOB_STEP:
        nl_trainer_step(p->tr, j->lr, j->clip, nl_adamw_defaults());
        st = nl_backend_check(p->be, &j->err);
        break;
    case JOB_COUNT:
        st = nl_trainer_set_docs(p->tr, j->e.docs, (int)t->rows, &j->err);
        if (st == NL_OK)
            st = nl_trainer_count_routes(p->tr, t->mbB, t->T, tokens, x, &j->err);
        if (st == NL_OK && !t->has_head)
            st = take_output(p->be, j, NL_MSG_COUNT, nl_trainer_count_output(p->tr), n);
        break;
    case JOB_FORWARD:
        if (j->inject_nan)
            nl_trainer_inject_nan(p->tr);
        /* the documents on every stage; the labels on the last (classification) */
        st = nl_trainer_set_docs(p->tr, j->e.docs, (int)t->rows, &j->err);
        if (st == NL_OK && t->has_head)
            st = nl_trainer_set_labels(p->tr, j->e.labels, j->e.lengths, t->mbB, t->T, &j->err);
        if (st == NL_OK)
            st = nl_trainer_forward(p->tr, j->slot, t->mbB, t->T, tokens, x,
                                    t->has_head ? j->e.targets : NULL, &j->ce, &j->a, &j->err);
        if (st == NL_OK && !t->has_head)
            st = take_output(p->be, j, NL_MSG_ACTIVATION, nl_trainer_output(p->tr, j->slot), n);
        else if (st == NL_OK) /* the last stage's backward starts from its loss */
            st = job_backward(t, p, j, NULL);
        break;
    case JOB_BACKWARD:
        st = job_backward(t, p, j, nl_backend_device_view(p->be, p->x_d, j->x, n * sizeof(float)));
        break;
    }
    j->st = st;
    if (st != NL_OK)
        atomic_store(&t->failed, 1);
}

/* The counting pass is complete: the replicas' route counts added up
 * (exact integers: this node's, then the stage's on other nodes), and
 * every replica uses the batch's shares. The lanes are idle. */
static nl_status sum_counts(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                            nl_error *err)
{
    const size_t n = (size_t)(s->model->l1 - s->model->l0) * (size_t)s->model->cfg.num_experts;
    int64_t *sum = nl_trainer_route_counts(t->rep[0].tr);
    for (int r = 1; r < t->R; r++) {
        const int64_t *c = nl_trainer_route_counts(t->rep[r].tr);
        for (size_t i = 0; i < n; i++)
            sum[i] += c[i];
    }
    if (t->xR > 1)
        return stage_train_reduce_counts(s, t, sum, n, send, ctx, err);
    stage_train_use_counts(s, t, sum, n);
    return NL_OK;
}

void stage_train_use_counts(nl_stage *s, stage_train *t, const int64_t *sum, size_t n)
{
    (void)s;
    for (int r = 0; r < t->R; r++)
        nl_trainer_use_counts(t->rep[r].tr, sum);
    t->counts_ready = true;
    /* kept for verification (stage_verify.h): the step's shares come from them */
    int64_t *keep = t->n_counts == n ? t->counts : realloc(t->counts, n * sizeof *keep);
    if (keep) {
        memcpy(keep, sum, n * sizeof *keep);
        t->counts = keep;
        t->n_counts = n;
    }
}

/* A finished job, on the node's thread in the order of dispatch: its
 * output sent, its loss added, and what completes a pass. */
static nl_status take_back(nl_stage *s, stage_train *t, rjob *j, nl_stage_send_fn send, void *ctx,
                           nl_error *err)
{
    nl_status st = j->st;
    if (st != NL_OK) {
        nl_error_set(err, st, "%s", j->err.msg);
        if (t->R > 1)
            nl_error_prefix(err, "replica %d (%s)", j->w.lane, t->rep[j->w.lane].be->name);
    }
    if (st == NL_OK && j->kind == JOB_FORWARD && t->has_head) {
        t->ce += j->ce;
        t->aux += j->aux + j->a;
    }
    if (st == NL_OK && j->out_type) {
        stage_train_lie(s, t, j);   /* a test hook; nothing in other builds */
        stage_train_keep_out(t, j); /* what it sends, for verification */
        st = send_host(s, t, send, ctx, j->out_type, j->step, j->mb,
                       j->out_type == NL_MSG_ACTIVATION ? j->aux + j->a : 0.0, j->out,
                       j->out_type == NL_MSG_GRADIENT ? NULL : &j->e, err);
    }
    if (st == NL_OK && j->last && j->kind == JOB_COUNT)
        st = sum_counts(s, t, send, ctx, err);
    else if (st == NL_OK && j->last)
        st = finish_step(s, t, send, ctx, err);
    if (st != NL_OK && j->kind != JOB_BEGIN && j->kind != JOB_STEP)
        return nl_error_prefix(err, "job %llu step %llu microbatch %u", (unsigned long long)t->job,
                               (unsigned long long)j->step, j->mb);
    return st;
}

/* Take back the finished jobs in order (wait: every job dispatched, once
 * finished). The first error ends the job on this stage (poison). */
nl_status stage_train_take_done(nl_stage *s, stage_train *t, bool wait, nl_stage_send_fn send,
                                void *ctx, nl_error *err)
{
    nl_wjob *w;
    while ((w = nl_workers_pop_done(t->w, wait))) {
        rjob *j = (rjob *)w;
        const bool computed = j->st == NL_OK;
        nl_status st = t->poison ? NL_OK : take_back(s, t, j, send, ctx, err);
        stage_train_job_put(t, j);
        if (st != NL_OK) {
            t->poison = st;
            t->poison_whole = computed;
            snprintf(t->poison_msg, sizeof t->poison_msg, "%s", err->msg);
            atomic_store(&t->failed, 1);
        }
    }
    return t->poison ? nl_error_set(err, t->poison, "%s", t->poison_msg) : NL_OK;
}

/* Queue a job on its replica's lane (inline: run it now), then take back
 * what has finished. */
nl_status stage_train_dispatch(nl_stage *s, stage_train *t, rjob *j, nl_stage_send_fn send,
                               void *ctx, nl_error *err)
{
    nl_workers_push(t->w, &j->w);
    return stage_train_take_done(s, t, false, send, ctx, err);
}

/* ===================== running a hop ===================== */

/* The replica that runs microbatch mb, and its activation slot there. */
int stage_train_replica_of(const stage_train *t, uint32_t mb)
{
    return (int)(mb % (uint32_t)t->R);
}

int stage_train_slot_of(const stage_train *t, uint32_t mb)
{
    return (int)(mb / (uint32_t)t->R % (uint32_t)t->rslots);
}

/* A new step: every replica zeroes its gradients, in its lane's order
 * (after the previous step's AdamW). */
static nl_status begin(nl_stage *s, stage_train *t, uint64_t step, uint64_t loss_rows,
                       nl_stage_send_fn send, void *ctx, nl_error *err)
{
    nl_status st = NL_OK;
    for (int r = 0; r < t->R && st == NL_OK; r++) {
        rjob *j = stage_train_job_get(t, JOB_BEGIN, r, err);
        if (j)
            j->e.loss_rows = loss_rows;
        st = j ? stage_train_dispatch(s, t, j, send, ctx, err) : NL_ERR_NOMEM;
    }
    t->begun = step;
    for (int i = 0; t->gpend && i < t->M; i++) { /* none wait past a step; in case */
        free(t->gpend[i]);
        t->gpend[i] = NULL;
    }
    memset(t->dig, 0, (size_t)t->Mg * NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES);
    stage_train_kept_free(t);
    t->counted = t->fwd = t->bwd = 0;
    t->finished = 0;
    t->counts_ready = false;
    t->ce = t->aux = 0.0;
    return st;
}

/* The input of a hop on replica p: host tokens (first stage) or hidden
 * states in p's memory. */
static void hop_input(nl_stage *s, stage_train *t, replica *p, const hop_in *h,
                      const int32_t **tokens, const float **x)
{
    *tokens = NULL;
    *x = NULL;
    if (s->model->has_embed)
        *tokens = h->x;
    else
        *x = nl_backend_device_view(p->be, p->x_d, h->x, t->rows * t->d * sizeof(float));
}

static bool runnable(const stage_train *t, const hop_in *h)
{
    if (t->syncing) /* DiLoCo: the outer step first */
        return false;
    if (h->type == NL_MSG_EVAL)
        return h->step == (uint64_t)t->applied && t->fwd == t->bwd;
    if (h->step != (uint64_t)t->applied + 1 || t->finished)
        return false;
    if (h->type == NL_MSG_COUNT)
        return t->counted < t->M && t->fwd == 0;
    /* one microbatch needs no counting pass; one that came is summed first */
    return (t->counts_ready || (t->Mg == 1 && t->counted == 0)) && t->fwd - t->bwd < t->slots &&
           t->fwd < t->M;
}

/* The last stage's evaluation of classification: score the microbatch's
 * class probabilities (rows labelled -1, past the held-out split, are
 * scored out; the trainer is given class 0 for them). */
static nl_status eval_labels(nl_stage *s, stage_train *t, replica *p, const hop_in *h,
                             nl_error *err)
{
    const int K = s->model->cfg.num_classes;
    if (K <= 0)
        return nl_error_set(err, NL_ERR_INVALID,
                            "EVAL: labels, but the model has no classifier (num_classes)");
    if ((!t->probs && !(t->probs = malloc((size_t)t->mbB * K * sizeof *t->probs))) ||
        (!t->given && !(t->given = malloc((size_t)t->mbB * sizeof *t->given))))
        return nl_error_set(err, NL_ERR_NOMEM, "EVAL: out of memory");
    for (int b = 0; b < t->mbB; b++)
        t->given[b] = h->e.labels[b] < 0 ? 0 : h->e.labels[b];
    t->eval_classify = true;
    return nl_trainer_set_labels(p->tr, t->given, h->e.lengths, t->mbB, t->T, err);
}

/* An evaluation hop: a forward on replica 0, as inference, once every
 * job dispatched before it has been taken back. */
static nl_status run_eval(nl_stage *s, stage_train *t, const hop_in *h, nl_stage_send_fn send,
                          void *ctx, nl_error *err)
{
    replica *p = &t->rep[0];
    const int32_t *tokens;
    const float *x;
    double ce = 0.0;
    nl_status st = stage_train_take_done(s, t, true, send, ctx, err);
    if (st != NL_OK)
        return st;
    hop_input(s, t, p, h, &tokens, &x);
    if (h->mb % (uint32_t)t->Mg == 0) { /* a new held-out batch, as local evaluation */
        nl_trainer_begin_step(p->tr, (int64_t)(t->H > 0 ? t->M : t->Mg) * (int64_t)t->rows);
        if (h->e.loss_rows > 0)
            nl_trainer_set_loss_rows(p->tr, (int64_t)h->e.loss_rows);
        t->begun = 0;
    }
    const bool classify = s->model->has_head && h->e.labels;
    st = nl_trainer_set_docs(p->tr, h->e.docs, (int)t->rows, err);
    if (st == NL_OK && classify)
        st = eval_labels(s, t, p, h, err);
    if (st == NL_OK)
        st = nl_trainer_forward(p->tr, 0, t->mbB, t->T, tokens, x, h->e.targets, &ce, NULL, err);
    if (st == NL_OK && classify && (st = nl_trainer_class_probs(p->tr, 0, t->probs, err)) == NL_OK)
        nl_labelled_score(t->probs, h->e.labels, t->mbB, s->model->cfg.num_classes, &t->eval_ce,
                          &t->eval_right, &t->eval_n);
    nl_trainer_set_labels(p->tr, NULL, NULL, 0, 0, NULL);
    nl_trainer_set_docs(p->tr, NULL, 0, NULL);
    if (st == NL_OK && !s->model->has_head)
        st = send_hop(s, t, send, ctx, NL_MSG_EVAL, h->step, h->mb, 0.0, p->be,
                      nl_trainer_output(p->tr, 0), &h->e, err);
    if (st != NL_OK)
        return st;
    if (!classify)
        t->eval_ce += ce;
    if (++t->evals < t->eval_hops)
        return NL_OK;
    if (!s->model->has_head) {
        t->evals = 0;
        return NL_OK;
    }
    nl_wire_msg_reset(&t->tx, NL_MSG_LOSS);
    t->tx.u.loss = (nl_msg_loss){
        t->job,     h->step, true,
        t->eval_ce, 0.0,     t->eval_classify ? (uint64_t)t->eval_n : (uint64_t)t->evals * t->rows};
    t->tx.u.train_loss.correct = t->eval_classify ? (uint64_t)t->eval_right : 0;
    t->evals = 0;
    t->eval_ce = 0.0;
    t->eval_n = t->eval_right = 0;
    t->eval_classify = false;
    return send(ctx, NL_STAGE_TO_COORD, &t->tx, err);
}

/* Dispatch a counting pass or a training forward to its replica: the job
 * takes the hop's buffers. */
static nl_status run_hop(nl_stage *s, stage_train *t, hop_in *h, nl_stage_send_fn send, void *ctx,
                         nl_error *err)
{
    if (h->type == NL_MSG_EVAL)
        return run_eval(s, t, h, send, ctx, err);
    nl_status st = NL_OK;
    if (t->begun != h->step && (st = begin(s, t, h->step, h->e.loss_rows, send, ctx, err)) != NL_OK)
        return st;
    rjob *j = stage_train_job_get(t, h->type == NL_MSG_COUNT ? JOB_COUNT : JOB_FORWARD,
                                  stage_train_replica_of(t, h->mb), err);
    if (!j)
        return NL_ERR_NOMEM;
    j->step = h->step;
    j->mb = h->mb;
    j->aux = h->aux;
    j->x = h->x;
    if (h->type == NL_MSG_ACTIVATION)
        memcpy(stage_train_dig(t, h->mb, NL_DIGEST_FWD_IN), h->digest, NL_HOP_DIGEST_BYTES);
    j->e = h->e;
    h->x = NULL;
    h->e = (hop_extra){0};
    if (h->type == NL_MSG_COUNT) {
        j->last = ++t->counted == t->M;
        return stage_train_dispatch(s, t, j, send, ctx, err);
    }
    j->slot = stage_train_slot_of(t, h->mb);
    if (s->o.inject_nan_step > 0 &&
        (h->step == (uint64_t)s->o.inject_nan_step ||
         (s->o.inject_nan_on && h->step > (uint64_t)s->o.inject_nan_step)) &&
        t->fwd == 0 && (s->o.inject_nan_stage < 0 || s->o.inject_nan_stage == s->stage_idx)) {
        NL_WARN("test hook: a NaN goes into this stage's gradient at step %llu",
                (unsigned long long)h->step);
        j->inject_nan = true;
    }
    t->fwd++;
    if (t->has_head) /* the last stage's backward follows its forward in the same job */
        j->last = ++t->bwd == t->M;
    return stage_train_dispatch(s, t, j, send, ctx, err);
}

/* The microbatch a queued hop's kind runs next. */
static uint32_t want_of(const stage_train *t, const hop_in *h)
{
    return h->type == NL_MSG_COUNT        ? (uint32_t)t->counted
           : h->type == NL_MSG_ACTIVATION ? (uint32_t)t->fwd
                                          : (uint32_t)t->evals;
}

/* The queued hop to run next: the first (in queue order) that can run;
 * with a previous stage of another replica count (s->fan_prev), whose
 * replicas send as they finish, the first that can run and is its kind's
 * next microbatch (or one run already: refused). -1: none. */
static int next_hop(const nl_stage *s, const stage_train *t)
{
    for (int i = 0; i < t->qlen; i++) {
        const hop_in *h = &t->q[(t->qhead + i) % t->qcap];
        if (!runnable(t, h)) {
            if (!s->fan_prev)
                return -1;
            continue;
        }
        if (!s->fan_prev || h->mb <= want_of(t, h))
            return i;
    }
    return -1;
}

/* Take queued hop i out of the queue (the ones behind it move up). */
static void unqueue(stage_train *t, int i)
{
    hop_in *h = &t->q[(t->qhead + i) % t->qcap];
    t->qbytes -= h->bytes;
    stage_train_hop_free(h);
    for (int k = i; k > 0; k--)
        t->q[(t->qhead + k) % t->qcap] = t->q[(t->qhead + k - 1) % t->qcap];
    t->qhead = (t->qhead + 1) % t->qcap;
    t->qlen--;
}

/* Run the queued hops that can run now, in order. */
static nl_status drain(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx, nl_error *err)
{
    for (int i; (i = next_hop(s, t)) >= 0;) {
        hop_in *h = &t->q[(t->qhead + i) % t->qcap];
        /* microbatches run in order: a duplicated or reordered hop would
         * overwrite an activation slot in flight */
        const uint32_t want = want_of(t, h);
        const uint64_t step = h->step;
        const uint32_t mb = h->mb;
        nl_status st = h->mb == want ? run_hop(s, t, h, send, ctx, err)
                                     : nl_error_set(err, NL_ERR_STATE,
                                                    "%s of microbatch %u, but the next is %u",
                                                    nl_wire_type_name(h->type), h->mb, want);
        unqueue(t, i);
        if (st != NL_OK && t->poison) /* a job's error says where it was */
            return st;
        if (st != NL_OK)
            return nl_error_prefix(err, "job %llu step %llu microbatch %u",
                                   (unsigned long long)t->job, (unsigned long long)step, mb);
    }
    return NL_OK;
}

/* Take back what finished and dispatch what became runnable; without
 * train_async, until every job dispatched has been taken back. */
nl_status stage_train_advance(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                              nl_error *err)
{
    for (;;) {
        nl_status st = stage_train_take_done(s, t, !t->async, send, ctx, err);
        if (st == NL_OK)
            st = drain(s, t, send, ctx, err);
        if (st != NL_OK || t->async || nl_workers_pending(t->w) == 0)
            return st;
    }
}
