/* A training stage that is one of the stage's R replicas on different
 * nodes (DESIGN section 8, "Replicas"; docs/cluster.md). Replica r of
 * every stage forms one pipeline: microbatch i of a step runs on replica
 * i mod R of each stage, so this node sees microbatches r, r + R, ... and
 * numbers them 0, 1, ... for its 1F1B schedule (stage_train_hops.c),
 * which runs unchanged over them. Two things need the other replicas, and
 * both go round the ring of the stage's replicas over their data sockets
 * (net/allreduce.h: REDUCE messages, added in replica order, the same bits
 * on every replica):
 *   - the counting pass's route counts, summed before any forward uses
 *     them (the batch's expert shares; exact integers, carried as floats
 *     below 2^24);
 *   - the step's gradients (a fine-tuning job's: its adapters', the base
 *     being frozen), once this replica's last backward is done,
 *     with the last stage's loss sums riding at the end (each a double cut
 *     into two floats), before the norm and AdamW. Replica 0 then reports
 *     the step (GRAD_NORM, LOSS) as a stage alone does; a STEP that comes
 *     while a replica still adds up waits for the sum (stage_train.c).
 *     The time from the last backward to the sum, against the bytes the
 *     cost model charges, goes into the stage's figures: the link speed
 *     the coordinator plans with (docs/cluster.md).
 * A file of its own because it is the one part of the training job that
 * talks to the other replicas. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "core/model/lora.h"
#include "net/trainparams.h"
#include "node/stage_train_impl.h"

/* Route counts travel as floats: exact below this. */
#define COUNT_EXACT (1 << 24)

/* The loss sums after the gradients: ce and aux, each as two floats. */
#define LOSS_FLOATS 4

typedef struct ring_ctx {
    nl_stage_send_fn send;
    void *ctx;
    uint64_t epoch;  /* the stage's placement: a replica of another drops it */
    uint64_t *bytes; /* the frame bytes sent, counted */
} ring_ctx;

static nl_status ring_send(void *p, nl_wire_msg *m, nl_error *err)
{
    ring_ctx *r = p;
    m->u.reduce.epoch = r->epoch;
    if (m->nframes > 0)
        *r->bytes += (uint64_t)m->frames[0].t.shape[0] * sizeof(float); /* F32 */
    return r->send(r->ctx, NL_STAGE_TO_RING, m, err);
}

/* What a step trains on this stage, and its gradients (replica 0's
 * trainer): the adapters of a fine-tuning job (the base is frozen), else
 * every weight. */
static size_t trained_n(const nl_model *m)
{
    return m->lora ? m->lora->n_params : m->n_params;
}

static float *trained_grads(const nl_model *m, nl_trainer *tr)
{
    return m->lora ? m->lora->grads : nl_trainer_grads(tr);
}

nl_status stage_train_ring_new(nl_stage *s, stage_train *t, int64_t micro, const nl_trainparams *p,
                               nl_error *err)
{
    t->xr = s->replicas > 1 ? s->replica : 0;
    t->xR = s->replicas > 1 ? s->replicas : 1;
    t->Mg = (int)micro;
    t->M = (int)micro;
    t->H = (int)p->outer_every;
    t->outer_lr = (float)p->outer_lr;
    t->outer_mu = (float)p->outer_momentum;
    if (t->H > 0 && t->xR == 1)
        return nl_error_set(err, NL_ERR_INVALID,
                            "outer_every %d (DiLoCo) needs the stage's replicas on other nodes; "
                            "this stage has none",
                            t->H);
    if (t->H > 0 && s->model->lora)
        return nl_error_set(err, NL_ERR_INVALID,
                            "outer_every %d (DiLoCo): not with fine-tuning, whose replicas add up "
                            "their adapters' gradients at every step",
                            t->H);
    if (t->xR == 1)
        return NL_OK;
    if (s->n_rep > 1)
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "a node with %d devices cannot yet be one of a stage's %d replicas",
                            s->n_rep, t->xR);
    if (micro % t->xR != 0)
        return nl_error_set(err, NL_ERR_INVALID,
                            "%lld microbatches do not divide among the stage's %d replicas",
                            (long long)micro, t->xR);
    t->M = (int)(micro / t->xR);
    const nl_model *m = s->model;
    /* DiLoCo: each group routes by its own counts; the GRADS reducer adds
     * the deltas at a sync */
    const size_t n[NL_REDUCE_KINDS] = {
        [NL_REDUCE_GRADS] = trained_n(m) + LOSS_FLOATS,
        [NL_REDUCE_COUNTS] = t->H > 0 ? 0 : (size_t)(m->l1 - m->l0) * (size_t)m->cfg.num_experts};
    for (int k = 0; k < NL_REDUCE_KINDS; k++) {
        if (n[k] == 0)
            continue;
        nl_status st =
            nl_allreduce_new(&t->red[k], t->job, (uint32_t)k, t->xr, t->xR, n[k], 0, err);
        if (st != NL_OK)
            return st;
        if (!(t->red_buf[k] = malloc(n[k] * sizeof(float))))
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory for the replicas' all-reduce");
    }
    if (t->H > 0 && (!(t->anchor = malloc(m->n_params * sizeof(float))) ||
                     !(t->outer_m = calloc(m->n_params, sizeof(float)))))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory for DiLoCo's outer step");
    return NL_OK;
}

void stage_train_ring_free(stage_train *t)
{
    if (t->xR > 1)
        NL_INFO("train job %llu: replica %d sent %llu bytes of REDUCE frames to the next replica; "
                "adding up the gradients took %.3f s a step (%d steps, from this replica's last "
                "backward to the sum)",
                (unsigned long long)t->job, t->xr, (unsigned long long)t->ring_bytes,
                t->reduce_n ? t->reduce_s / t->reduce_n : 0.0, t->reduce_n);
    free(t->anchor);
    free(t->outer_m);
    free(t->held_dir);
    t->anchor = t->outer_m = NULL;
    t->held_dir = NULL;
    for (int k = 0; k < NL_REDUCE_KINDS; k++) {
        nl_allreduce_destroy(&t->red[k]);
        free(t->red_buf[k]);
        t->red_buf[k] = NULL;
    }
}

nl_status stage_train_mb_here(const stage_train *t, const char *what, uint32_t wire, uint32_t *mb,
                              nl_error *err)
{
    if (wire % (uint32_t)t->xR != (uint32_t)t->xr)
        return nl_error_set(err, NL_ERR_STATE,
                            "%s of microbatch %u, which replica %u of the stage's %d runs; this "
                            "is replica %d",
                            what, wire, wire % (uint32_t)t->xR, t->xR, t->xr);
    *mb = wire / (uint32_t)t->xR;
    return NL_OK;
}

/* ---- the gradients ---- */

/* A double as two floats whose sum is it to about 2^-48, and back. */
static void put_double(float *f, double v)
{
    f[0] = (float)v;
    f[1] = (float)(v - (double)f[0]);
}

static double get_double(const float *f)
{
    return (double)f[0] + (double)f[1];
}

/* The sum is in: back into the gradients (replica 0's trainer), the loss
 * sums taken, the step reported. */
static nl_status grads_done(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                            nl_error *err)
{
    const size_t n = trained_n(s->model);
    const float *buf = t->red_buf[NL_REDUCE_GRADS];
    nl_backend *be = t->rep[0].be;
    be->upload(be, trained_grads(s->model, t->rep[0].tr), buf, n * sizeof(float));
    nl_status st = nl_backend_check(be, err);
    if (st != NL_OK)
        return st;
    t->ce = get_double(buf + n);
    t->aux = get_double(buf + n + 2);
    if (t->ce < 0 || t->aux < 0) /* sums of losses (NaN: a diverged one, reported) */
        return nl_error_set(err, NL_ERR_PROTO,
                            "REDUCE of job %llu: the replicas' loss sums add up to %g "
                            "(cross-entropy) and %g (balance), below 0 (a replica sent a wrong "
                            "sum)",
                            (unsigned long long)t->job, t->ce, t->aux);
    t->reducing = false;
    const double dt = nl_mono_s() - t->reduce_t0;
    t->reduce_s += dt;
    t->reduce_n++;
    /* the link speed the coordinator plans with: the bytes the cost model
     * charges a ring all-reduce (nl_plan_step_seconds: 2 (R - 1) / R of
     * them) over the time from the last backward to the sum, a wait for
     * a slower replica's backward included, as the step pays it too */
    const double moved = 2.0 * (t->xR - 1) / t->xR * (double)((n + LOSS_FLOATS) * sizeof(float));
    const double link = s->o.inject_link_bytes_s;
    s->fig.reduce_bytes += (uint64_t)moved;
    s->fig.reduce_s += link > 0 ? moved / link : dt;
    return stage_train_report(s, t, send, ctx, err);
}

nl_status stage_train_reduce_grads(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                                   nl_error *err)
{
    if (t->H > 0) /* DiLoCo: each group steps with its own gradients */
        return stage_train_report(s, t, send, ctx, err);
    const size_t n = trained_n(s->model);
    float *buf = t->red_buf[NL_REDUCE_GRADS];
    nl_backend *be = t->rep[0].be;
    be->download(be, buf, trained_grads(s->model, t->rep[0].tr), n * sizeof(float));
    nl_status st = nl_backend_check(be, err);
    if (st != NL_OK)
        return st;
    put_double(buf + n, t->ce);
    put_double(buf + n + 2, t->aux);
    t->reducing = true;
    t->reduce_t0 = nl_mono_s();
    ring_ctx rc = {send, ctx, nl_stage_epoch(s), &t->ring_bytes};
    bool done = false;
    st = nl_allreduce_begin(t->red[NL_REDUCE_GRADS], t->begun, buf, ring_send, &rc, &done, err);
    if (st == NL_OK && done)
        st = grads_done(s, t, send, ctx, err);
    return st;
}

/* ---- DiLoCo's outer step ---- */

nl_status stage_train_outer_anchor(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                                   nl_error *err)
{
    if (t->H == 0 || t->applied_anchor)
        return NL_OK;
    nl_status st = stage_train_take_done(s, t, true, send, ctx, err);
    if (st != NL_OK)
        return st;
    nl_backend *be = t->rep[0].be;
    be->download(be, t->anchor, t->rep[0].m->params, s->model->n_params * sizeof(float));
    t->applied_anchor = true;
    return nl_backend_check(be, err);
}

/* The groups' deltas are added up: the outer step, the same on every
 * replica, into the weights. */
static nl_status outer_done(nl_stage *s, stage_train *t, nl_error *err)
{
    const size_t n = s->model->n_params;
    float *buf = t->red_buf[NL_REDUCE_GRADS];
    nl_diloco_outer(buf, t->anchor, t->outer_m, buf, n, t->xR, t->outer_lr, t->outer_mu);
    nl_backend *be = t->rep[0].be;
    be->upload(be, t->rep[0].m->params, buf, n * sizeof(float));
    t->syncing = false;
    NL_INFO("train job %llu step %lld: outer step of %d replica groups; replica %d has sent %llu "
            "bytes of REDUCE frames",
            (unsigned long long)t->job, (long long)t->applied, t->xR, t->xr,
            (unsigned long long)t->ring_bytes);
    return nl_backend_check(be, err);
}

nl_status stage_train_outer(nl_stage *s, stage_train *t, uint64_t step, nl_stage_send_fn send,
                            void *ctx, nl_error *err)
{
    if (t->H == 0 || step % (uint64_t)t->H != 0)
        return NL_OK;
    nl_status st = stage_train_take_done(s, t, true, send, ctx, err); /* AdamW applied */
    if (st != NL_OK)
        return st;
    const size_t n = s->model->n_params;
    float *buf = t->red_buf[NL_REDUCE_GRADS];
    nl_backend *be = t->rep[0].be;
    be->download(be, buf, t->rep[0].m->params, n * sizeof(float));
    if ((st = nl_backend_check(be, err)) != NL_OK)
        return st;
    for (size_t i = 0; i < n; i++)
        buf[i] = t->anchor[i] - buf[i];
    memset(buf + n, 0, LOSS_FLOATS * sizeof(float));
    t->syncing = true;
    ring_ctx rc = {send, ctx, nl_stage_epoch(s), &t->ring_bytes};
    bool done = false;
    st = nl_allreduce_begin(t->red[NL_REDUCE_GRADS], step, buf, ring_send, &rc, &done, err);
    if (st == NL_OK && done)
        st = outer_done(s, t, err);
    return st;
}

nl_status stage_train_outer_hold(stage_train *t, const nl_msg_ckpt_req *r, bool *held,
                                 nl_error *err)
{
    *held = false;
    if (r == &t->held_ckpt) { /* the held one, now taken */
        t->ckpt_held = false;
        return NL_OK;
    }
    if (!t->syncing)
        return NL_OK;
    if (t->ckpt_held)
        return nl_error_set(err, NL_ERR_STATE, "CKPT_REQ of step %llu while one waits already",
                            (unsigned long long)r->step);
    char *dir = strdup(r->dir);
    if (!dir)
        return nl_error_set(err, NL_ERR_NOMEM, "CKPT_REQ: out of memory");
    free(t->held_dir);
    t->held_dir = dir;
    t->held_ckpt = *r;
    t->held_ckpt.dir = dir;
    t->ckpt_held = *held = true;
    return NL_OK;
}

/* ---- the route counts ---- */

/* The counts' sum is in: each a count (the other replicas' parts came
 * over the wire: a wrong one is refused, never cast as it is). */
static nl_status counts_done(nl_stage *s, stage_train *t, nl_error *err)
{
    const nl_model *m = s->model;
    const size_t n = (size_t)(m->l1 - m->l0) * (size_t)m->cfg.num_experts;
    int64_t *sum = nl_trainer_route_counts(t->rep[0].tr);
    const float *buf = t->red_buf[NL_REDUCE_COUNTS];
    for (size_t i = 0; i < n; i++) {
        if (!(buf[i] >= 0.0f && buf[i] <= (float)COUNT_EXACT) || buf[i] != floorf(buf[i]))
            return nl_error_set(err, NL_ERR_PROTO,
                                "REDUCE of job %llu: the replicas' route count %zu adds up to "
                                "%g, not a count in 0..%d (a replica sent a wrong sum)",
                                (unsigned long long)t->job, i, (double)buf[i], COUNT_EXACT);
        sum[i] = (int64_t)buf[i];
    }
    stage_train_use_counts(s, t, sum, n);
    return NL_OK;
}

nl_status stage_train_reduce_counts(nl_stage *s, stage_train *t, const int64_t *sum, size_t n,
                                    nl_stage_send_fn send, void *ctx, nl_error *err)
{
    float *buf = t->red_buf[NL_REDUCE_COUNTS];
    if (!t->red[NL_REDUCE_COUNTS]) { /* no experts: nothing to add up */
        stage_train_use_counts(s, t, sum, n);
        return NL_OK;
    }
    for (size_t i = 0; i < n; i++) {
        if (sum[i] < 0 || sum[i] > COUNT_EXACT / t->xR)
            return nl_error_set(err, NL_ERR_RANGE,
                                "a route count of %lld is past what the replicas' all-reduce "
                                "adds exactly (%d)",
                                (long long)sum[i], COUNT_EXACT / t->xR);
        buf[i] = (float)sum[i];
    }
    ring_ctx rc = {send, ctx, nl_stage_epoch(s), &t->ring_bytes};
    bool done = false;
    nl_status st =
        nl_allreduce_begin(t->red[NL_REDUCE_COUNTS], t->begun, buf, ring_send, &rc, &done, err);
    if (st == NL_OK && done)
        st = counts_done(s, t, err);
    return st;
}

/* ---- what the previous replica sends ---- */

nl_status stage_train_ring_input(nl_stage *s, stage_train *t, const nl_wire_msg *m,
                                 nl_stage_send_fn send, void *ctx, nl_error *err)
{
    const uint32_t what = m->u.reduce.what;
    nl_allreduce *a = what < NL_REDUCE_KINDS ? t->red[what] : NULL;
    if (!a)
        return nl_error_set(err, NL_ERR_STATE,
                            "REDUCE of job %llu: this stage has no other replica to add up with",
                            (unsigned long long)t->job);
    ring_ctx rc = {send, ctx, nl_stage_epoch(s), &t->ring_bytes};
    bool done = false;
    nl_status st = nl_allreduce_input(a, m, ring_send, &rc, &done, err);
    if (st != NL_OK || !done)
        return st;
    if (what == NL_REDUCE_GRADS)
        return t->H > 0 ? outer_done(s, t, err) : grads_done(s, t, send, ctx, err);
    return counts_done(s, t, err);
}
