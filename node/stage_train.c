/* Training on one pipeline stage: the job's trainer, the 1F1B schedule
 * over a step's microbatches, gradients sent upstream, the optimizer step
 * the coordinator decides, evaluation, and the stage's checkpoint shard
 * (see stage.h and docs/cluster.md, "Training"). This file holds the
 * job's state and life and the messages it receives (hops queued, STEP,
 * CKPT_REQ); stage_train_make.c makes the job, stage_train_hops.c runs the
 * replicas' jobs and the schedule, behind stage_train_impl.h.
 *
 * Inputs that cannot run yet (a microbatch whose activation slot is still
 * in use, a hop of the next step that overtook the STEP message of this
 * one on another socket) wait in a FIFO; a message only ever makes the
 * stage run what has become runnable, so the schedule follows from the
 * order in which hops arrive.
 *
 * Replicas (a node with several devices, stage.h): each has its own copy
 * of the weights, its trainer and its staging buffer. Microbatch i of a
 * step runs on replica i % R, in activation slot (i / R) % ceil(slots / R)
 * of that replica: the microbatches in flight are a window of at most
 * `slots` consecutive ones, of which at most ceil(slots / R) fall on one
 * replica, with consecutive i / R, so slots never collide. The counting
 * pass is shared the same way and the route counts are added up (exact
 * integers) before any forward uses them. When a step's last backward is
 * done, the communicator all-reduces the flat gradient buffers, so every
 * replica holds the step's sum; its norm is taken on replica 0 and every
 * replica applies the same AdamW to the same bits. (Broadcasting replica
 * 0's weights instead would move as many bytes as the all-reduce did, once
 * more every step; AdamW is elementwise and cheap next to that.)
 * Evaluation runs on replica 0, as inference does, and checkpoints are
 * written from it.
 *
 * Replicas compute at the same time: each has a worker thread (a lane of
 * replica_workers.h) that runs its jobs (begin a step, a counting pass, a
 * forward, a backward, AdamW) in the order the node's thread dispatched
 * them. The node's thread keeps the schedule: it dispatches a hop as soon
 * as the schedule allows it, and takes finished jobs back in the order it
 * dispatched them, so the hops it sends, the losses it adds up and the
 * route counts and gradients it sums come in the same order as if the
 * replicas ran one after another: the results are bit-identical (each
 * replica runs the same ops in the same order either way). Work that
 * needs every replica (adding the route counts, the all-reduce and the
 * norm, an evaluation, a checkpoint) waits for the lanes to be idle. With
 * the stage option train_async the node's thread does not wait: it polls
 * nl_stage_train_fd and sends what finished from nl_stage_train_poll.
 * One replica (or replicas_inline, the tests' sequential reference) runs
 * its jobs on the caller's thread. A job that fails ends the job on this
 * stage: later jobs are skipped, and every later message is refused with
 * its error, which names the replica's device. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/formats/manifest.h"
#include "core/grow/grow.h"
#include "core/model/lora.h"
#include "core/model/memory.h"
#include "core/train/train.h"
#include "net/trainparams.h"
#include "node/replica_workers.h"
#include "node/stage_train_impl.h"

/* ===================== life ===================== */

void stage_train_extra_free(hop_extra *e)
{
    free(e->targets);
    free(e->docs);
    free(e->labels);
    free(e->lengths);
    *e = (hop_extra){0};
}

void stage_train_hop_free(hop_in *h)
{
    free(h->x);
    h->x = NULL;
    stage_train_extra_free(&h->e);
}

void stage_train_free(stage_train *t)
{
    if (!t)
        return;
    nl_workers_destroy(&t->w); /* the jobs running finish; the queued are dropped */
    while (t->jobs) {
        rjob *j = t->jobs;
        t->jobs = j->all_next;
        free(j->x);
        stage_train_extra_free(&j->e);
        free(j->out);
        free(j);
    }
    for (int i = 0; i < t->qlen; i++)
        stage_train_hop_free(&t->q[(t->qhead + i) % t->qcap]);
    free(t->q);
    for (int r = 0; r < t->R; r++) {
        replica *p = &t->rep[r];
        nl_trainer_destroy(&p->tr);
        if (p->be)
            p->be->free(p->be, p->x_d);
        if (r > 0)
            nl_model_destroy(&p->m);
    }
    nl_host_stage_free(&t->stage);
    nl_wire_msg_free(&t->tx);
    stage_train_ring_free(t);
    free(t->dig);
    for (int i = 0; t->gpend && i < t->M; i++)
        free(t->gpend[i]);
    free(t->gpend);
    stage_train_kept_free(t);
    free(t->kept);
    free(t->counts);
    free(t->lie_prev);
    free(t->probs);
    free(t->given);
    free(t);
}

/* The stage's training job (not a fine-tuning one), or NULL. */
static stage_train *training(const nl_stage *s)
{
    const stage_job *e = stage_job_first(s, NL_JOB_TRAIN);
    return e ? e->state : NULL;
}

bool nl_stage_train_running(const nl_stage *s, uint64_t *job_id)
{
    const stage_train *t = training(s);
    if (t && job_id)
        *job_id = t->job;
    return t != NULL;
}

/* JOB_SUBMIT kind train (stage_job_ops.begin): the job's state, made
 * once its checks pass, replacing any earlier training job. */
static nl_status train_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id,
                             void **state, nl_error *err)
{
    nl_trainparams p;
    stage_train *t = NULL;
    const int n_ft = stage_job_count(s, NL_JOB_FINETUNE);
    *state = NULL;
    nl_status st = stage_train_params(s, j, &p, job_id, err);
    if (st != NL_OK)
        return st;
    if (n_ft > 0) /* before the trainer takes anything (the moments) */
        return nl_error_set(err, NL_ERR_STATE,
                            "train job %llu: %d fine-tuning job%s use this stage's weights frozen",
                            (unsigned long long)p.job, n_ft, n_ft == 1 ? "" : "s");
    if ((st = stage_train_make(s, &p, j, &t, err)) == NL_OK)
        *state = t;
    return st;
}

/* ===================== receiving ===================== */

/* The frames a forward-type hop carries besides its input, checked
 * against the job's shapes: ACTIVATION and EVAL need the targets, or the
 * labels and lengths (classification); of a COUNT only the documents
 * count. */
static nl_status hop_frames(const stage_train *t, const nl_wire_msg *m, const nl_tensor *f[4],
                            size_t *bytes, nl_error *err)
{
    static const char *const name[4] = {"targets", "document ids", "labels", "lengths"};
    const char *what = nl_wire_type_name(m->type);
    *bytes = 0;
    for (int i = 0; i < 4; i++) {
        f[i] = nl_wire_hop_frame(m, 1u << i);
        if (m->type == NL_MSG_COUNT && i != 1)
            f[i] = NULL; /* a counting pass needs the documents at most */
        if (!f[i])
            continue;
        const bool rows = i < 2; /* [mbB, T]; the others [mbB] */
        if (f[i]->dtype != NL_DTYPE_I32 || f[i]->ndim != (rows ? 2 : 1) ||
            f[i]->shape[0] != t->mbB || (rows && f[i]->shape[1] != t->T))
            return rows ? nl_error_set(err, NL_ERR_SHAPE, "%s: the %s must be I32 [%d, %d]", what,
                                       name[i], t->mbB, t->T)
                        : nl_error_set(err, NL_ERR_SHAPE, "%s: the %s must be I32 [%d]", what,
                                       name[i], t->mbB);
        *bytes += (rows ? t->rows : (size_t)t->mbB) * sizeof(int32_t);
    }
    if (m->type != NL_MSG_COUNT && !f[0] && !(f[2] && f[3]))
        return nl_error_set(err, NL_ERR_SHAPE,
                            "%s: frame 1 must be I32 targets [%d, %d] (or, to classify, labels "
                            "and lengths [%d])",
                            what, t->mbB, t->T, t->mbB);
    if (!f[2] != !f[3])
        return nl_error_set(err, NL_ERR_PROTO, "%s: labels and lengths come together", what);
    return NL_OK;
}

/* Copy the frames hop_frames found into e; 0 or out of memory. */
static int copy_extra(hop_extra *e, const nl_tensor *f[4], uint64_t loss_rows)
{
    int32_t **dst[4] = {&e->targets, &e->docs, &e->labels, &e->lengths};
    e->loss_rows = loss_rows;
    for (int i = 0; i < 4; i++) {
        if (!f[i])
            continue;
        const size_t n = (size_t)nl_shape_numel(f[i]->shape, f[i]->ndim) * sizeof(int32_t);
        if (!(*dst[i] = malloc(n)))
            return -1;
        memcpy(*dst[i], f[i]->data, n);
    }
    return 0;
}

/* Check a forward-type hop's frames against the job and copy it into the
 * queue. */
static nl_status enqueue(nl_stage *s, stage_train *t, const nl_wire_msg *m, nl_error *err)
{
    const nl_msg_tensor_hop *hop = &m->u.hop;
    const char *what = nl_wire_type_name(m->type);
    const bool first = s->model->has_embed;
    const nl_tensor *x = &m->frames[0].t;
    const uint64_t limit = m->type == NL_MSG_EVAL ? (uint64_t)t->eval_hops : (uint64_t)t->Mg;
    if (hop->microbatch >= limit)
        return nl_error_set(err, NL_ERR_RANGE, "%s: microbatch %u of %llu", what, hop->microbatch,
                            (unsigned long long)limit);
    if (m->type == NL_MSG_EVAL ? hop->step < (uint64_t)t->applied
                               : hop->step <= (uint64_t)t->applied)
        return nl_error_set(err, NL_ERR_STATE, "%s: step %llu, but %lld steps are applied", what,
                            (unsigned long long)hop->step, (long long)t->applied);
    bool ok = first
                  ? x->dtype == NL_DTYPE_I32 && x->ndim == 2
                  : nl_wire_dtype_hidden(x->dtype) && x->ndim == 3 && x->shape[2] == (int64_t)t->d;
    ok = ok && x->shape[0] == t->mbB && x->shape[1] == t->T;
    if (!ok)
        return nl_error_set(err, NL_ERR_SHAPE,
                            "%s: frame 0 must be %s [%d, %d%s] for this job's microbatches", what,
                            first ? "I32 token ids" : "F32 or BF16 hidden states", t->mbB, t->T,
                            first ? "" : ", d");
    const nl_tensor *f[4];
    size_t extra_bytes = 0;
    uint8_t digest[NL_HOP_DIGEST_BYTES];
    nl_status st = hop_frames(t, m, f, &extra_bytes, err);
    if (st == NL_OK)
        st = nl_hop_digest_check(m, (uint32_t)s->stage_idx, digest, err);
    if (st != NL_OK)
        return st;
    /* at most a step's counting and training hops and an evaluation can be
     * ahead of this stage; more is a peer that does not follow the schedule.
     * The next step's hops can come before this stage has applied the
     * step before it (its STEP travels another socket), never later ones */
    if (t->qlen >= 2 * t->M + t->eval_hops + 8)
        return nl_error_set(err, NL_ERR_LIMIT, "%s: %d hops are waiting already", what, t->qlen);
    if (hop->step > (uint64_t)t->applied + 2)
        return nl_error_set(err, NL_ERR_STATE,
                            "%s: step %llu, but %lld steps are applied: ahead "
                            "of the schedule",
                            what, (unsigned long long)hop->step, (long long)t->applied);
    const size_t hop_bytes = m->frames[0].len + extra_bytes;
    const uint64_t cap_bytes = (uint64_t)(2 * t->M + 8) * hop_bytes > QUEUE_MIN_BYTES
                                   ? (uint64_t)(2 * t->M + 8) * hop_bytes
                                   : QUEUE_MIN_BYTES;
    if (!first &&
        t->qbytes + hop_bytes > cap_bytes) /* the first stage's come from the coordinator */
        return nl_error_set(err, NL_ERR_LIMIT,
                            "%s: %zu bytes of hops are waiting already (at most %llu): the "
                            "previous stage is too far ahead",
                            what, t->qbytes, (unsigned long long)cap_bytes);
    if (t->qlen == t->qcap) {
        int cap = t->qcap ? 2 * t->qcap : 8;
        hop_in *q = calloc((size_t)cap, sizeof *q);
        if (!q)
            return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", what);
        for (int i = 0; i < t->qlen; i++)
            q[i] = t->q[(t->qhead + i) % t->qcap];
        free(t->q);
        t->q = q;
        t->qcap = cap;
        t->qhead = 0;
    }
    hop_in h = {.type = m->type, .step = hop->step, .mb = hop->microbatch, .aux = hop->aux};
    if (m->type != NL_MSG_EVAL &&
        (st = stage_train_mb_here(t, what, hop->microbatch, &h.mb, err)) != NL_OK)
        return st;
    /* token ids as they came; hidden states as FP32 (widened from bf16) */
    const size_t xbytes = first ? m->frames[0].len : t->rows * t->d * sizeof(float);
    if (!(h.x = malloc(xbytes)) || copy_extra(&h.e, f, m->u.train_hop.loss_rows) != 0) {
        stage_train_hop_free(&h);
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", what);
    }
    if (first)
        memcpy(h.x, x->data, xbytes);
    else
        nl_wire_frame_widen(&m->frames[0], h.x, t->rows * t->d);
    memcpy(h.digest, digest, sizeof digest);
    if (!first) { /* hidden states from the previous stage: finite, or refused (issue 15) */
        const float *v = h.x;
        float acc = 0.0f; /* NaN or infinity anywhere makes the sum non-finite */
        for (size_t i = 0; i < xbytes / sizeof(float); i++)
            acc += v[i] * 0.0f;
        if (acc != 0.0f) {
            stage_train_hop_free(&h);
            return nl_error_set(err, NL_ERR_RANGE,
                                "%s: the previous stage's hidden states hold non-finite values",
                                what);
        }
    }
    h.bytes = hop_bytes;
    t->qbytes += hop_bytes;
    t->q[(t->qhead + t->qlen++) % t->qcap] = h;
    return NL_OK;
}

/* The backward of microbatch mb (this node's number) with its gradient
 * dy (F32, taken), on its replica's lane. */
static nl_status run_backward(nl_stage *s, stage_train *t, uint64_t step, uint32_t mb, float *dy,
                              nl_stage_send_fn send, void *ctx, nl_error *err)
{
    rjob *j = stage_train_job_get(t, JOB_BACKWARD, stage_train_replica_of(t, mb), err);
    if (!j) {
        free(dy);
        return NL_ERR_NOMEM;
    }
    j->x = dy;
    j->step = step;
    j->mb = mb;
    j->slot = stage_train_slot_of(t, mb);
    j->last = ++t->bwd == t->M;
    return stage_train_dispatch(s, t, j, send, ctx, err);
}

static nl_status on_gradient(nl_stage *s, stage_train *t, const nl_wire_msg *m,
                             nl_stage_send_fn send, void *ctx, nl_error *err)
{
    nl_msg_tensor_hop here = m->u.hop; /* with this node's number of the microbatch */
    const nl_msg_tensor_hop *hop = &here;
    const nl_tensor *g = &m->frames[0].t;
    if (s->model->has_head)
        return nl_error_set(err, NL_ERR_STATE, "GRADIENT: the last stage starts from its loss");
    nl_status st = stage_train_mb_here(t, "GRADIENT", m->u.hop.microbatch, &here.microbatch, err);
    if (st != NL_OK)
        return st;
    if (hop->step != t->begun || hop->step != (uint64_t)t->applied + 1 || t->finished)
        return nl_error_set(err, NL_ERR_STATE,
                            "GRADIENT of step %llu, but this stage is at step %llu",
                            (unsigned long long)hop->step, (unsigned long long)t->applied + 1);
    /* the next stage's replicas send theirs as they finish: one may come
     * before its turn, and waits; otherwise they come in order */
    const bool early = s->fan_next && hop->microbatch > (uint32_t)t->bwd &&
                       hop->microbatch < (uint32_t)t->fwd && t->gpend && !t->gpend[hop->microbatch];
    if (!early && (hop->microbatch != (uint32_t)t->bwd || t->bwd >= t->fwd))
        return nl_error_set(err, NL_ERR_STATE,
                            "GRADIENT of microbatch %u, but the next backward is of microbatch %d "
                            "(%d forwards run)",
                            hop->microbatch, t->bwd, t->fwd);
    if (!nl_wire_dtype_hidden(g->dtype) || g->ndim != 3 || g->shape[0] != t->mbB ||
        g->shape[1] != t->T || g->shape[2] != (int64_t)t->d)
        return nl_error_set(err, NL_ERR_SHAPE,
                            "GRADIENT: the frame must be F32 or BF16 [%d, %d, %zu]", t->mbB, t->T,
                            t->d);
    st = nl_hop_digest_check(m, (uint32_t)s->stage_idx,
                             stage_train_dig(t, hop->microbatch, NL_DIGEST_BWD_IN), err);
    if (st != NL_OK)
        return st;
    /* a copy of the frame for the replica's lane (the message goes when
     * this returns) */
    float *dy = malloc(t->rows * t->d * sizeof(float));
    if (!dy)
        return nl_error_set(err, NL_ERR_NOMEM, "GRADIENT: out of memory");
    nl_wire_frame_widen(&m->frames[0], dy, t->rows * t->d); /* F32, or bf16 widened */
    if (early) {
        t->gpend[hop->microbatch] = dy;
        return NL_OK;
    }
    st = run_backward(s, t, hop->step, hop->microbatch, dy, send, ctx, err);
    while (st == NL_OK && t->gpend && t->bwd < t->fwd && t->gpend[t->bwd]) { /* their turn */
        dy = t->gpend[t->bwd];
        t->gpend[t->bwd] = NULL;
        st = run_backward(s, t, hop->step, (uint32_t)t->bwd, dy, send, ctx, err);
    }
    return st;
}

static nl_status on_step(nl_stage *s, stage_train *t, const nl_msg_step *p, nl_stage_send_fn send,
                         void *ctx, nl_error *err)
{
    if (t->reducing && !t->step_held && p->step == t->begun) { /* after the replicas' sum */
        t->held = *p;
        t->step_held = true;
        return NL_OK;
    }
    if (p->step != (uint64_t)t->applied + 1 || !t->finished || t->begun != p->step)
        return nl_error_set(err, NL_ERR_STATE, "STEP %llu, but this stage %s step %llu",
                            (unsigned long long)p->step,
                            t->finished ? "has finished" : "has not finished",
                            (unsigned long long)t->applied + 1);
    /* every replica: the same update of the same weights with the same
     * gradients, each on its lane (DiLoCo: this group's own) */
    nl_status st = p->apply ? stage_train_outer_anchor(s, t, send, ctx, err) : NL_OK;
    for (int r = 0; p->apply && r < t->R && st == NL_OK; r++) {
        rjob *j = stage_train_job_get(t, JOB_STEP, r, err);
        if (!j)
            return NL_ERR_NOMEM;
        j->step = p->step;
        j->lr = (float)p->lr;
        j->clip = (float)p->clip_scale;
        st = stage_train_dispatch(s, t, j, send, ctx, err);
    }
    t->adam_want += p->apply;
    t->applied = (int64_t)p->step;
    t->finished = 0;
    t->counted = t->fwd = t->bwd = 0;
    t->counts_ready = false;
    return st != NL_OK ? st : stage_train_outer(s, t, p->step, send, ctx, err);
}

/* CKPT_REQ.dir: an absolute path with no ".." component, under the
 * node's --checkpoint-root when it has one. */
static nl_status check_ckpt_dir(const nl_stage *s, const char *dir, nl_error *err)
{
    const char *root = s->o.ckpt_root;
    bool dotdot = false;
    for (const char *p = dir; *p; p++)
        dotdot |= p[0] == '.' && p[1] == '.' && (p == dir || p[-1] == '/') &&
                  (p[2] == '/' || p[2] == '\0');
    if (dir[0] != '/' || dotdot)
        return nl_error_set(err, NL_ERR_INVALID,
                            "CKPT_REQ: '%s' is not an absolute path without '..'", dir);
    size_t n = root ? strlen(root) : 0;
    while (n > 0 && root[n - 1] == '/')
        n--;
    if (n > 0 && (strncmp(dir, root, n) != 0 || (dir[n] != '/' && dir[n] != '\0')))
        return nl_error_set(err, NL_ERR_AUTH,
                            "CKPT_REQ: '%s' is outside this node's --checkpoint-root %s", dir,
                            root);
    return NL_OK;
}

static nl_status on_ckpt(nl_stage *s, stage_train *t, const nl_msg_ckpt_req *r,
                         nl_stage_send_fn send, void *ctx, nl_error *err)
{
    char path[1200], hex[65];
    uint64_t bytes = 0;
    bool held = false; /* DiLoCo: after the outer step */
    nl_status st = stage_train_outer_hold(t, r, &held, err);
    if (st == NL_OK && !held) /* the lanes idle: AdamW applied */
        st = stage_train_take_done(s, t, true, send, ctx, err);
    /* a stage whose send to a neighbour failed (the neighbour's node lost
     * in the step under way) still holds whole weights and moments: its
     * shard of the steps done is written, once every STEP's AdamW ran */
    if (st != NL_OK && t->poison && t->poison_whole &&
        nl_trainer_adam_steps(t->rep[0].tr) == t->adam_want)
        st = NL_OK;
    if (st != NL_OK || held)
        return st;
    /* microbatches of the next step may be in flight: a replica's node
     * was lost in it and the coordinator saves the steps done from the
     * survivors (docs/cluster.md); nothing changes the weights or the
     * moments before that step's STEP */
    if (r->step != (uint64_t)t->applied)
        return nl_error_set(err, NL_ERR_STATE, "CKPT_REQ of step %llu, but %lld steps are applied",
                            (unsigned long long)r->step, (long long)t->applied);
    st = check_ckpt_dir(s, r->dir, err);
    if (st == NL_OK)
        st = nl_file_mkdirs(r->dir, err);
    if (st != NL_OK)
        return st;
    snprintf(path, sizeof path, "%s/stage-%d.safetensors", r->dir, s->stage_idx);
    /* where this shard was trained; the coordinator copies it into the
     * manifest (the backend's name is "cpu", "cpu-devsim" or "cuda:N") */
    char where[160], reps[32] = "";
    if (t->R > 1) /* data-parallel replicas round the gradients' sum differently */
        snprintf(reps, sizeof reps, ",\"replicas\":%d", t->R);
    snprintf(where, sizeof where, "{\"device\":\"%.64s\",\"tf32\":%s%s}", s->be->name,
             s->o.tf32 ? "true" : "false", reps);
    nl_ckpt_extra ex = {.m = nl_trainer_moment(t->rep[0].tr, 0),
                        .v = nl_trainer_moment(t->rep[0].tr, 1),
                        .adam_steps = nl_trainer_adam_steps(t->rep[0].tr),
                        .train_json = where};
    /* a fine-tuning job's shard holds its adapters (the base never changes) */
    st = s->model->lora ? nl_lora_save(s->model->lora, path, NULL, err)
                        : nl_checkpoint_save(s->model, path, (int64_t)r->step, &ex, err);
    if (st != NL_OK)
        return st == NL_ERR_NOTFOUND ? nl_error_set(err, NL_ERR_IO, "%s", err->msg) : st;
    if ((st = nl_file_sha256(path, hex, &bytes, err)) != NL_OK)
        return nl_error_set(err, NL_ERR_IO, "%s", err->msg);
    NL_INFO("job %llu: wrote %s (%.1f MiB) for step %llu", (unsigned long long)t->job, path,
            (double)bytes / (1 << 20), (unsigned long long)r->step);
    nl_wire_msg_reset(&t->tx, NL_MSG_CKPT_DONE);
    t->tx.u.ckpt_done =
        (nl_msg_ckpt_done){t->job, r->step, (uint32_t)s->stage_idx, path, hex, bytes};
    return send(ctx, NL_STAGE_TO_COORD, &t->tx, err);
}

bool stage_train_takes(const nl_wire_msg *m)
{
    switch (m->type) {
    case NL_MSG_COUNT:
    case NL_MSG_EVAL:
    case NL_MSG_GRADIENT:
    case NL_MSG_STEP:
    case NL_MSG_CKPT_REQ:
    case NL_MSG_VERIFY_REQ:
    case NL_MSG_REDUCE:
        return true;
    case NL_MSG_ACTIVATION:
        return m->u.hop.step != 0; /* step 0: an inference hop */
    default:
        return false;
    }
}

nl_status stage_train_input(nl_stage *s, stage_train *t, const nl_wire_msg *m,
                            nl_stage_send_fn send, void *ctx, nl_error *err)
{
    nl_status st = nl_stage_device_status(s, err);
    if (st != NL_OK)
        return st;
    /* a job failed here: this stage's part of it has ended (but for the
     * shard of the steps done, while its weights are whole: on_ckpt) */
    if (t->poison && !(m->type == NL_MSG_CKPT_REQ && t->poison_whole))
        return nl_error_set(err, t->poison, "%s", t->poison_msg);
    switch (m->type) {
    case NL_MSG_COUNT:
    case NL_MSG_ACTIVATION:
    case NL_MSG_EVAL:
        st = enqueue(s, t, m, err);
        break;
    case NL_MSG_GRADIENT:
        st = on_gradient(s, t, m, send, ctx, err);
        break;
    case NL_MSG_STEP:
        st = on_step(s, t, &m->u.step, send, ctx, err);
        break;
    case NL_MSG_CKPT_REQ:
        st = on_ckpt(s, t, &m->u.ckpt_req, send, ctx, err);
        break;
    case NL_MSG_VERIFY_REQ: /* stage_verify.c */
        st = stage_train_verify_req(s, t, &m->u.verify_req, send, ctx, err);
        break;
    case NL_MSG_REDUCE: /* stage_train_ring.c; a STEP held for the sum goes on */
        st = stage_train_ring_input(s, t, m, send, ctx, err);
        if (st == NL_OK && t->step_held && !t->reducing) {
            t->step_held = false;
            st = on_step(s, t, &t->held, send, ctx, err);
        }
        if (st == NL_OK && t->ckpt_held && !t->syncing) /* a CKPT_REQ held for it too */
            st = on_ckpt(s, t, &t->held_ckpt, send, ctx, err);
        break;
    default:
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s is not a training message",
                            nl_wire_type_name(m->type));
    }
    if (st == NL_OK && !t->poison) /* poisoned: only a shard was written */
        st = stage_train_advance(s, t, send, ctx, err);
    /* the device's error comes first: it also explains a failed step */
    nl_status dst = stage_check_device(s, err);
    return dst != NL_OK ? dst : st;
}

/* ---- the training kind's operations (stage_jobs.c) ---- */

static bool train_holds(const void *state, const nl_wire_msg *m)
{
    (void)state;
    return stage_train_takes(m);
}

static nl_status train_input(nl_stage *s, void *state, const nl_wire_msg *m, nl_stage_send_fn send,
                             void *ctx, nl_error *err)
{
    return stage_train_input(s, state, m, send, ctx, err);
}

static void train_free(nl_stage *s, void *state)
{
    stage_train_free(state);
    stage_verify_forget(s); /* the job's end: the builds kept to check its stages go */
}

const stage_job_ops nl_stage_train_ops = {.kind = NL_JOB_TRAIN,
                                          .name = "train",
                                          .status = "training",
                                          .begin = train_begin,
                                          .holds = train_holds,
                                          .input = train_input,
                                          .free = train_free};

/* ---- the replicas' threads (one training job at a time has them) ---- */

int nl_stage_train_fd(const nl_stage *s)
{
    const stage_train *t = training(s);
    return t && t->async ? nl_workers_fd(t->w) : -1;
}

nl_status nl_stage_train_poll(nl_stage *s, nl_stage_send_fn send, void *ctx, nl_error *err)
{
    stage_train *t = training(s);
    if (!t)
        return NL_OK;
    nl_workers_clear_fd(t->w);
    if (t->poison) /* said once already, when it happened */
        return NL_OK;
    nl_status st = stage_train_advance(s, t, send, ctx, err);
    nl_status dst = stage_check_device(s, err);
    return dst != NL_OK ? dst : st;
}

void stage_train_quiesce(nl_stage *s)
{
    const stage_train *t = training(s);
    if (t)
        nl_workers_wait_all(t->w);
}
