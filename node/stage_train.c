/* Training on one pipeline stage: the job's trainer, the 1F1B schedule
 * over a step's microbatches, gradients sent upstream, the optimizer step
 * the coordinator decides, evaluation, and the stage's checkpoint shard
 * (see stage.h and docs/cluster.md, "Training").
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
 * written from it. Replicas run one after another on the node's thread:
 * what overlaps on GPUs is what their queues hold between two waits (a
 * hop's download before it is sent). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../base/log.h"
#include "../core/checkpoint.h"
#include "../core/fileio.h"
#include "../core/grow.h"
#include "../core/manifest.h"
#include "../core/memory.h"
#include "../core/train.h"
#include "stage_impl.h"

/* A forward-type hop waiting to run: its frames copied. */
typedef struct hop_in {
    nl_msg_type type; /* COUNT, ACTIVATION or EVAL */
    uint64_t step;
    uint32_t mb;
    double aux;
    void *x;          /* tokens (I32, rows) on the first stage, else hidden (F32, rows x d) */
    int32_t *targets; /* (rows), or NULL (COUNT) */
    size_t bytes;     /* of x and targets */
} hop_in;

/* Bytes the queue of hops from the previous stage may hold (issue 15):
 * at least this, or a step's counting and training hops and 8 more. */
#define QUEUE_MIN_BYTES (64ull << 20)

/* One data-parallel replica of the stage. */
typedef struct replica {
    nl_backend *be; /* borrowed: the stage's rbe[r] */
    nl_model *m;    /* replica 0: the stage's model (borrowed); others: the job's copy (owned) */
    nl_trainer *tr;
    float *x_d; /* device staging of a hidden-state input or gradient frame */
} replica;

typedef struct stage_train {
    uint64_t job;
    replica rep[NL_COMM_MAX];
    int R;      /* replicas */
    int rslots; /* activation slots of each replica: ceil(slots / R) */
    int mbB, T, M, slots, eval_hops;
    size_t rows, d;
    int64_t applied;       /* optimizer steps applied (the step a hop needs is applied + 1) */
    uint64_t begun;        /* the step whose gradients are being accumulated (0: none) */
    int counted, fwd, bwd; /* this step's counting passes, forwards and backwards run */
    int finished;          /* this step's gradients are reported; waiting for STEP */
    double ce, aux;        /* the last stage: this step's cross-entropy sum and aux loss */
    int evals;             /* evaluation hops run (the last stage: and their loss sum) */
    double eval_ce;
    hop_in *q; /* FIFO ring of hops waiting to run */
    int qhead, qlen, qcap;
    size_t qbytes; /* the hops' bytes in the queue */
    nl_host_stage stage; /* host view of an output to send */
    nl_wire_msg tx;
} stage_train;

/* ===================== life ===================== */

static void hop_free(hop_in *h)
{
    free(h->x);
    free(h->targets);
    h->x = NULL;
    h->targets = NULL;
}

void nl_stage_train_free(nl_stage *s)
{
    stage_train *t = s->train;
    if (!t)
        return;
    for (int i = 0; i < t->qlen; i++)
        hop_free(&t->q[(t->qhead + i) % t->qcap]);
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
    free(t);
    s->train = NULL;
}

bool nl_stage_train_running(const nl_stage *s, uint64_t *job_id)
{
    if (s->train && job_id)
        *job_id = s->train->job;
    return s->train != NULL;
}

bool nl_stage_train_end(nl_stage *s, uint64_t job_id)
{
    if (!s->train || s->train->job != job_id)
        return false;
    nl_stage_train_free(s);
    return true;
}

/* An integer job parameter (required unless *v holds a default and
 * required is false), within [lo, hi]. */
static nl_status int_param(const nl_msg_job_submit *j, const char *key, bool required, int64_t lo,
                           int64_t hi, int64_t *v, nl_error *err)
{
    for (uint32_t i = 0; i < j->nparams; i++) {
        const nl_wire_param *p = &j->params[i];
        if (strcmp(p->key, key) != 0)
            continue;
        if (p->kind == NL_WIRE_PARAM_BOOL)
            *v = p->b;
        else if (p->kind == NL_WIRE_PARAM_INT)
            *v = p->i;
        else
            return nl_error_set(err, NL_ERR_PROTO, "train JOB_SUBMIT params.%s: not an integer",
                                key);
        if (*v < lo || *v > hi)
            return nl_error_set(err, NL_ERR_RANGE,
                                "train JOB_SUBMIT params.%s: %lld is outside [%lld, %lld]", key,
                                (long long)*v, (long long)lo, (long long)hi);
        return NL_OK;
    }
    return required ? nl_error_set(err, NL_ERR_PROTO, "train JOB_SUBMIT: no params.%s", key)
                    : NL_OK;
}

/* The model's growth history, as the coordinator sends it (params
 * growth.0, growth.1, ..., each a JSON array of entries, core/grow.h):
 * the trainer counts the AdamW bias correction of what a growth created
 * from its birth, as local training does. None: an empty history. */
static nl_status growth_params(nl_model *m, const nl_msg_job_submit *j, nl_error *err)
{
    nl_growth *all = NULL;
    int n = 0;
    nl_status st = NL_OK;
    for (uint32_t i = 0; i < j->nparams && st == NL_OK; i++) {
        const nl_wire_param *p = &j->params[i];
        nl_growth *h = NULL;
        int k = 0;
        if (strncmp(p->key, "growth.", 7) != 0)
            continue;
        if (p->kind != NL_WIRE_PARAM_STR) {
            st =
                nl_error_set(err, NL_ERR_PROTO, "train JOB_SUBMIT params.%s: not a string", p->key);
            break;
        }
        if ((st = nl_growth_from_json(p->s, &h, &k, err)) != NL_OK) {
            nl_error_prefix(err, "train JOB_SUBMIT params.%s", p->key);
            break;
        }
        nl_growth *grown = k ? realloc(all, (size_t)(n + k) * sizeof *all) : all;
        if (!grown) {
            st = nl_error_set(err, NL_ERR_NOMEM, "train JOB_SUBMIT: out of memory");
        } else {
            all = grown;
            memcpy(all + n, h, (size_t)k * sizeof *h);
            n += k;
        }
        free(h);
    }
    if (st == NL_OK)
        st = nl_model_set_growth(m, all, n, err);
    free(all);
    return st;
}

/* Each replica's model (replica 0: the stage's; the others: a copy of its
 * weights, sent by the communicator), trainer and staging buffer. */
static nl_status make_replicas(nl_stage *s, int recompute, nl_error *err)
{
    stage_train *t = s->train;
    const nl_model *m0 = s->model;
    float *params[NL_COMM_MAX];
    nl_status st = NL_OK;
    for (int r = 0; r < t->R && st == NL_OK; r++) {
        replica *p = &t->rep[r];
        p->be = s->rbe[r];
        p->m = s->model;
        if (r > 0) {
            p->m = NULL;
            st = nl_model_new(&p->m, p->be, &m0->cfg, m0->l0, m0->l1, m0->has_embed, m0->has_head,
                              err);
            if (st == NL_OK)
                st = nl_model_set_growth(p->m, m0->growth, m0->n_growth, err);
            if (st == NL_OK && p->m->n_params != m0->n_params)
                st = nl_error_set(err, NL_ERR_STATE,
                                  "replica %d: %zu parameters where replica 0 has %zu", r,
                                  p->m->n_params, m0->n_params);
            if (st != NL_OK)
                return nl_error_prefix(err, "replica %d (%s)", r, p->be->name);
        }
        params[r] = p->m->params;
        st = nl_trainer_new(&p->tr, p->m, (int)t->rows, t->rslots, recompute, err);
        if (st == NL_OK && !(p->x_d = p->be->alloc(p->be, t->rows * t->d * sizeof(float))))
            st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        if (st != NL_OK)
            return t->R > 1 ? nl_error_prefix(err, "replica %d (%s)", r, p->be->name) : st;
    }
    if (t->R > 1)
        st = nl_comm_broadcast(s->comm, params, m0->n_params, 0, err);
    return st;
}

nl_status nl_stage_train_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id,
                               nl_error *err)
{
    int64_t job = 0, mbB = 0, T = 0, M = 0, recompute = 0, start = 0, adam = 0, moments = 0,
            eval_hops = 0;
    nl_status st;
    *job_id = 0;
    if ((st = int_param(j, "job", true, 1, INT64_MAX, &job, err)) != NL_OK)
        return st;
    *job_id = (uint64_t)job;
    for (int r = 0; r < s->n_rep; r++)
        if (!s->rbe[r]->can_train)
            return nl_error_set(err, NL_ERR_UNSUPPORTED,
                                "%s: training on this device is not available yet (train job %lld)",
                                s->rbe[r]->name, (long long)job);
    if ((st = nl_stage_device_status(s, err)) != NL_OK)
        return st;
    if (!s->ready)
        return nl_error_set(err, NL_ERR_STATE, "train job %lld: this stage has no model loaded",
                            (long long)job);
    nl_model *m = s->model;
    if ((st = int_param(j, "micro_batch", true, 1, 1 << 20, &mbB, err)) != NL_OK ||
        (st = int_param(j, "seq", true, 1, m->cfg.max_seq_len, &T, err)) != NL_OK ||
        (st = int_param(j, "microbatches", true, 1, 65536, &M, err)) != NL_OK ||
        (st = int_param(j, "recompute", false, 0, 1, &recompute, err)) != NL_OK ||
        (st = int_param(j, "start_step", false, 0, INT64_MAX / 2, &start, err)) != NL_OK ||
        (st = int_param(j, "adam_steps", false, 0, INT64_MAX / 2, &adam, err)) != NL_OK ||
        (st = int_param(j, "moments", false, 0, 1, &moments, err)) != NL_OK ||
        (st = int_param(j, "eval_hops", false, 0, 1 << 30, &eval_hops, err)) != NL_OK ||
        (st = growth_params(m, j, err)) != NL_OK)
        return st;
    if (mbB * T > (1 << 24))
        return nl_error_set(err, NL_ERR_RANGE, "train job %lld: microbatch %lld x %lld is too big",
                            (long long)job, (long long)mbB, (long long)T);
    if (moments && !s->have_moments)
        return nl_error_set(err, NL_ERR_STATE,
                            "train job %lld: resuming needs the optimizer moments, but none came "
                            "with this stage's weights",
                            (long long)job);
    /* 1F1B: a stage keeps the activations of at most as many microbatches
     * as there are stages from it to the last */
    int slots = s->num_stages - s->stage_idx;
    if (slots > M)
        slots = (int)M;
    /* each replica keeps its share of the microbatches in flight */
    const int rslots = (slots + s->n_rep - 1) / s->n_rep;
    nl_mem_opts mo = {.training = 1,
                      .micro_rows = (int)(mbB * T),
                      .in_flight = rslots,
                      .recompute = (int)recompute};
    nl_mem_estimate me = nl_memory_estimate(&m->cfg, m->l1 - m->l0, m->has_embed, m->has_head, &mo);
    if (me.total > s->o.memory_bytes)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "train job %lld: layers [%d, %d) with %d microbatches of %lld x %lld "
                            "in flight need %llu bytes (memory model), but this node offers %llu "
                            "(--memory)%s",
                            (long long)job, m->l0, m->l1, rslots, (long long)mbB, (long long)T,
                            (unsigned long long)me.total, (unsigned long long)s->o.memory_bytes,
                            s->n_rep > 1 ? " on each replica" : "");
    nl_stage_train_free(s);
    stage_train *t = calloc(1, sizeof *t);
    if (!t)
        return nl_error_set(err, NL_ERR_NOMEM, "train job %lld: out of memory", (long long)job);
    s->train = t;
    nl_wire_msg_init(&t->tx);
    t->job = (uint64_t)job;
    t->mbB = (int)mbB;
    t->T = (int)T;
    t->M = (int)M;
    t->slots = slots;
    t->eval_hops = (int)eval_hops;
    t->rows = (size_t)(mbB * T);
    t->d = (size_t)m->cfg.hidden_dim;
    t->applied = start;
    t->R = s->n_rep;
    t->rslots = rslots;
    st = make_replicas(s, (int)recompute, err);
    if (st != NL_OK) {
        nl_stage_train_free(s);
        return nl_error_prefix(err, "train job %lld", (long long)job);
    }
    if (moments) { /* the resumed run's moments: into every trainer, then freed here */
        for (int i = 0; i < 2; i++) {
            for (int r = 0; r < t->R; r++)
                t->rep[r].be->upload(t->rep[r].be, nl_trainer_moment(t->rep[r].tr, i), s->mom_h[i],
                                     m->n_params * sizeof(float));
            free(s->mom_h[i]);
            s->mom_h[i] = NULL;
        }
        s->have_moments = false;
        for (int r = 0; r < t->R; r++)
            nl_trainer_set_adam_steps(t->rep[r].tr, adam);
    }
    NL_INFO("train job %llu: stage %d of %d, %d microbatches of %d x %d, %d in flight%s, from "
            "step %lld%s",
            (unsigned long long)t->job, s->stage_idx, s->num_stages, t->M, t->mbB, t->T, slots,
            recompute ? " (recompute)" : "", (long long)start,
            moments ? " with the checkpoint's moments" : "");
    if (t->R > 1)
        NL_INFO("train job %llu: %d data-parallel replicas (%s all-reduce), %d microbatch%s in "
                "flight on each%s",
                (unsigned long long)t->job, t->R, nl_comm_name(s->comm), rslots,
                rslots == 1 ? "" : "es",
                t->M < t->R ? "; fewer microbatches than replicas leave some idle" : "");
    return NL_OK;
}

/* ===================== sending ===================== */

/* Send a hop (type) of this job with hidden states (rows x d, in the
 * memory of be) and optionally the targets, to the next stage or
 * (GRADIENT) the previous. */
static nl_status send_hop(nl_stage *s, nl_stage_send_fn send, void *ctx, nl_msg_type type,
                          uint64_t step, uint32_t mb, double aux, nl_backend *be,
                          const float *x_dev, const int32_t *targets, nl_error *err)
{
    stage_train *t = s->train;
    const int64_t xs[3] = {t->mbB, t->T, (int64_t)t->d}, ts[2] = {t->mbB, t->T};
    const float *x =
        nl_backend_read_view(be, &t->stage, x_dev, t->rows * t->d * sizeof(float), err);
    if (!x)
        return nl_error_prefix(err, "train job %llu", (unsigned long long)t->job);
    nl_wire_msg_reset(&t->tx, type);
    t->tx.u.hop = (nl_msg_tensor_hop){t->job, step, mb, 0, 0, aux};
    nl_wire_frame_set(&t->tx.frames[0], x, NL_DTYPE_F32, xs, 3);
    t->tx.nframes = 1;
    if (targets) {
        nl_wire_frame_set(&t->tx.frames[1], targets, NL_DTYPE_I32, ts, 2);
        t->tx.nframes = 2;
    }
    return send(ctx, type == NL_MSG_GRADIENT ? NL_STAGE_TO_PREV : NL_STAGE_TO_NEXT, &t->tx, err);
}

/* The step's gradients are all in: the replicas' sum on every replica,
 * then this stage's share of the norm, and on the last stage the losses. */
static nl_status finish_step(nl_stage *s, nl_stage_send_fn send, void *ctx, nl_error *err)
{
    stage_train *t = s->train;
    if (t->R > 1) {
        float *grads[NL_COMM_MAX];
        for (int r = 0; r < t->R; r++)
            grads[r] = nl_trainer_grads(t->rep[r].tr);
        nl_status st = nl_comm_allreduce_sum(s->comm, grads, s->model->n_params, err);
        if (st != NL_OK)
            return nl_error_prefix(err, "the gradients of %d replicas", t->R);
    }
    const double sumsq = nl_trainer_grad_sumsq(t->rep[0].tr);
    t->finished = 1;
    nl_wire_msg_reset(&t->tx, NL_MSG_GRAD_NORM);
    t->tx.u.grad_norm = (nl_msg_grad_norm){t->job, t->begun, (uint32_t)s->stage_idx,
                                           isnan(sumsq) || sumsq >= 0 ? sumsq : NAN};
    nl_status st = send(ctx, NL_STAGE_TO_COORD, &t->tx, err);
    if (st != NL_OK || !s->model->has_head)
        return st;
    nl_wire_msg_reset(&t->tx, NL_MSG_LOSS);
    t->tx.u.loss = (nl_msg_loss){t->job, t->begun, false, t->ce, t->aux, (uint64_t)t->M * t->rows};
    return send(ctx, NL_STAGE_TO_COORD, &t->tx, err);
}

/* ===================== running a hop ===================== */

/* The replica that runs microbatch mb, and its activation slot there. */
static replica *replica_of(stage_train *t, uint32_t mb)
{
    return &t->rep[mb % (uint32_t)t->R];
}

static int slot_of(const stage_train *t, uint32_t mb)
{
    return (int)(mb / (uint32_t)t->R % (uint32_t)t->rslots);
}

static void begin(stage_train *t, uint64_t step)
{
    for (int r = 0; r < t->R; r++)
        nl_trainer_begin_step(t->rep[r].tr, (int64_t)t->M * (int64_t)t->rows);
    t->begun = step;
    t->counted = t->fwd = t->bwd = 0;
    t->finished = 0;
    t->ce = t->aux = 0.0;
}

/* The input of a hop on replica p: host tokens (first stage) or hidden
 * states in p's memory. */
static void hop_input(nl_stage *s, replica *p, const hop_in *h, const int32_t **tokens,
                      const float **x)
{
    stage_train *t = s->train;
    *tokens = NULL;
    *x = NULL;
    if (s->model->has_embed)
        *tokens = h->x;
    else
        *x = nl_backend_device_view(p->be, p->x_d, h->x, t->rows * t->d * sizeof(float));
}

/* Backward of microbatch mb (dy in the memory of its replica) and its
 * gradient upstream. */
static nl_status backward(nl_stage *s, const float *dy, uint64_t step, uint32_t mb,
                          nl_stage_send_fn send, void *ctx, nl_error *err)
{
    stage_train *t = s->train;
    replica *p = replica_of(t, mb);
    nl_status st = nl_trainer_backward(p->tr, slot_of(t, mb), dy, err);
    if (st == NL_OK && !s->model->has_embed)
        st = send_hop(s, send, ctx, NL_MSG_GRADIENT, step, mb, 0.0, p->be,
                      nl_trainer_input_grad(p->tr), NULL, err);
    if (st != NL_OK)
        return st;
    t->bwd++;
    return t->bwd == t->M ? finish_step(s, send, ctx, err) : NL_OK;
}

static bool runnable(const stage_train *t, const hop_in *h)
{
    if (h->type == NL_MSG_EVAL)
        return h->step == (uint64_t)t->applied && t->fwd == t->bwd;
    if (h->step != (uint64_t)t->applied + 1 || t->finished)
        return false;
    if (h->type == NL_MSG_COUNT)
        return t->counted < t->M && t->fwd == 0;
    return (t->M == 1 || t->counted == t->M) && t->fwd - t->bwd < t->slots && t->fwd < t->M;
}

/* The counting pass is complete: the replicas' route counts added up
 * (exact integers), and every replica uses the batch's shares. */
static void use_counts(nl_stage *s)
{
    stage_train *t = s->train;
    const size_t n = (size_t)(s->model->l1 - s->model->l0) * (size_t)s->model->cfg.num_experts;
    int64_t *sum = nl_trainer_route_counts(t->rep[0].tr);
    for (int r = 1; r < t->R; r++) {
        const int64_t *c = nl_trainer_route_counts(t->rep[r].tr);
        for (size_t i = 0; i < n; i++)
            sum[i] += c[i];
    }
    for (int r = 0; r < t->R; r++)
        nl_trainer_use_counts(t->rep[r].tr, sum);
}

/* An evaluation hop: a forward on replica 0, as inference. */
static nl_status run_eval(nl_stage *s, const hop_in *h, nl_stage_send_fn send, void *ctx,
                          nl_error *err)
{
    stage_train *t = s->train;
    replica *p = &t->rep[0];
    const int32_t *tokens;
    const float *x;
    double ce = 0.0;
    hop_input(s, p, h, &tokens, &x);
    if (h->mb % (uint32_t)t->M == 0) { /* a new held-out batch, as local evaluation */
        nl_trainer_begin_step(p->tr, (int64_t)t->M * (int64_t)t->rows);
        t->begun = 0;
    }
    nl_status st =
        nl_trainer_forward(p->tr, 0, t->mbB, t->T, tokens, x, h->targets, &ce, NULL, err);
    if (st == NL_OK && !s->model->has_head)
        st = send_hop(s, send, ctx, NL_MSG_EVAL, h->step, h->mb, 0.0, p->be,
                      nl_trainer_output(p->tr, 0), h->targets, err);
    if (st != NL_OK)
        return st;
    t->eval_ce += ce;
    if (++t->evals < t->eval_hops)
        return NL_OK;
    if (!s->model->has_head) {
        t->evals = 0;
        return NL_OK;
    }
    nl_wire_msg_reset(&t->tx, NL_MSG_LOSS);
    t->tx.u.loss =
        (nl_msg_loss){t->job, h->step, true, t->eval_ce, 0.0, (uint64_t)t->evals * t->rows};
    t->evals = 0;
    t->eval_ce = 0.0;
    return send(ctx, NL_STAGE_TO_COORD, &t->tx, err);
}

static nl_status run_hop(nl_stage *s, const hop_in *h, nl_stage_send_fn send, void *ctx,
                         nl_error *err)
{
    stage_train *t = s->train;
    nl_model *m = s->model;
    if (h->type == NL_MSG_EVAL)
        return run_eval(s, h, send, ctx, err);
    replica *p = replica_of(t, h->mb);
    const int32_t *tokens;
    const float *x;
    nl_status st = NL_OK;
    hop_input(s, p, h, &tokens, &x);
    if (h->type == NL_MSG_COUNT) {
        if (t->begun != h->step)
            begin(t, h->step);
        st = nl_trainer_count_routes(p->tr, t->mbB, t->T, tokens, x, err);
        if (st == NL_OK && !m->has_head)
            st = send_hop(s, send, ctx, NL_MSG_COUNT, h->step, h->mb, 0.0, p->be,
                          nl_trainer_count_output(p->tr), NULL, err);
        if (st == NL_OK && ++t->counted == t->M)
            use_counts(s);
        return st;
    }
    /* a training forward */
    if (t->begun != h->step)
        begin(t, h->step);
    const int slot = slot_of(t, h->mb);
    double ce = 0.0, a = 0.0;
    if (s->o.inject_nan_step > 0 &&
        (h->step == (uint64_t)s->o.inject_nan_step ||
         (s->o.inject_nan_on && h->step > (uint64_t)s->o.inject_nan_step)) &&
        t->fwd == 0 &&
        (s->o.inject_nan_stage < 0 || s->o.inject_nan_stage == s->stage_idx)) {
        NL_WARN("test hook: a NaN goes into this stage's gradient at step %llu",
                (unsigned long long)h->step);
        nl_trainer_inject_nan(p->tr);
    }
    st = nl_trainer_forward(p->tr, slot, t->mbB, t->T, tokens, x, m->has_head ? h->targets : NULL,
                            &ce, &a, err);
    if (st != NL_OK)
        return st;
    t->fwd++;
    if (!m->has_head)
        return send_hop(s, send, ctx, NL_MSG_ACTIVATION, h->step, h->mb, h->aux + a, p->be,
                        nl_trainer_output(p->tr, slot), h->targets, err);
    t->ce += ce;
    t->aux += h->aux + a;
    return backward(s, NULL, h->step, h->mb, send, ctx, err);
}

/* Run the queued hops that can run now, in order. */
static nl_status drain(nl_stage *s, nl_stage_send_fn send, void *ctx, nl_error *err)
{
    stage_train *t = s->train;
    while (t->qlen > 0) {
        hop_in *h = &t->q[t->qhead];
        if (!runnable(t, h))
            return NL_OK;
        /* microbatches run in order: a duplicated or reordered hop would
         * overwrite an activation slot in flight */
        const uint32_t want = h->type == NL_MSG_COUNT        ? (uint32_t)t->counted
                              : h->type == NL_MSG_ACTIVATION ? (uint32_t)t->fwd
                                                             : (uint32_t)t->evals;
        nl_status st = h->mb == want ? run_hop(s, h, send, ctx, err)
                                     : nl_error_set(err, NL_ERR_STATE,
                                                    "%s of microbatch %u, but the next is %u",
                                                    nl_wire_type_name(h->type), h->mb, want);
        t->qbytes -= h->bytes;
        hop_free(h);
        t->qhead = (t->qhead + 1) % t->qcap;
        t->qlen--;
        if (st != NL_OK)
            return nl_error_prefix(err, "job %llu step %llu microbatch %u",
                                   (unsigned long long)t->job, (unsigned long long)h->step, h->mb);
    }
    return NL_OK;
}

/* ===================== receiving ===================== */

/* Check a forward-type hop's frames against the job and copy it into the
 * queue. */
static nl_status enqueue(nl_stage *s, const nl_wire_msg *m, nl_error *err)
{
    stage_train *t = s->train;
    const nl_msg_tensor_hop *hop = &m->u.hop;
    const char *what = nl_wire_type_name(m->type);
    const bool first = s->model->has_embed, want_targets = m->type != NL_MSG_COUNT;
    const nl_tensor *x = &m->frames[0].t;
    const uint64_t limit = m->type == NL_MSG_EVAL ? (uint64_t)t->eval_hops : (uint64_t)t->M;
    if (hop->microbatch >= limit)
        return nl_error_set(err, NL_ERR_RANGE, "%s: microbatch %u of %llu", what, hop->microbatch,
                            (unsigned long long)limit);
    if (m->type == NL_MSG_EVAL ? hop->step < (uint64_t)t->applied
                               : hop->step <= (uint64_t)t->applied)
        return nl_error_set(err, NL_ERR_STATE, "%s: step %llu, but %lld steps are applied", what,
                            (unsigned long long)hop->step, (long long)t->applied);
    bool ok = first ? x->dtype == NL_DTYPE_I32 && x->ndim == 2
                    : x->dtype == NL_DTYPE_F32 && x->ndim == 3 && x->shape[2] == (int64_t)t->d;
    ok = ok && x->shape[0] == t->mbB && x->shape[1] == t->T;
    if (!ok)
        return nl_error_set(
            err, NL_ERR_SHAPE, "%s: frame 0 must be %s [%d, %d%s] for this job's microbatches",
            what, first ? "I32 token ids" : "F32 hidden states", t->mbB, t->T, first ? "" : ", d");
    const nl_tensor *y = m->nframes > 1 ? &m->frames[1].t : NULL;
    if (want_targets && (!y || y->ndim != 2 || y->shape[0] != t->mbB || y->shape[1] != t->T))
        return nl_error_set(err, NL_ERR_SHAPE, "%s: frame 1 must be I32 targets [%d, %d]", what,
                            t->mbB, t->T);
    /* at most a step's counting and training hops and an evaluation can be
     * ahead of this stage; more is a peer that does not follow the schedule.
     * The next step's hops can come before this stage has applied the
     * step before it (its STEP travels another socket), never later ones */
    if (t->qlen >= 2 * t->M + t->eval_hops + 8)
        return nl_error_set(err, NL_ERR_LIMIT, "%s: %d hops are waiting already", what, t->qlen);
    if (hop->step > (uint64_t)t->applied + 2)
        return nl_error_set(err, NL_ERR_STATE, "%s: step %llu, but %lld steps are applied: ahead "
                            "of the schedule", what, (unsigned long long)hop->step,
                            (long long)t->applied);
    const size_t hop_bytes = m->frames[0].len + (want_targets ? t->rows * sizeof(int32_t) : 0);
    const uint64_t cap_bytes = (uint64_t)(2 * t->M + 8) * hop_bytes > QUEUE_MIN_BYTES
                                   ? (uint64_t)(2 * t->M + 8) * hop_bytes
                                   : QUEUE_MIN_BYTES;
    if (!first && t->qbytes + hop_bytes > cap_bytes) /* the first stage's come from the coordinator */
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
    hop_in h = {m->type, hop->step, hop->microbatch, hop->aux, NULL, NULL, 0};
    const size_t xbytes = m->frames[0].len, ybytes = t->rows * sizeof(int32_t);
    if (!(h.x = malloc(xbytes)) || (want_targets && !(h.targets = malloc(ybytes)))) {
        hop_free(&h);
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", what);
    }
    memcpy(h.x, x->data, xbytes);
    if (!first) { /* hidden states from the previous stage: finite, or refused (issue 15) */
        const float *v = h.x;
        float acc = 0.0f; /* NaN or infinity anywhere makes the sum non-finite */
        for (size_t i = 0; i < xbytes / sizeof(float); i++)
            acc += v[i] * 0.0f;
        if (acc != 0.0f) {
            hop_free(&h);
            return nl_error_set(err, NL_ERR_RANGE,
                                "%s: the previous stage's hidden states hold non-finite values",
                                what);
        }
    }
    if (want_targets)
        memcpy(h.targets, y->data, ybytes);
    h.bytes = hop_bytes;
    t->qbytes += hop_bytes;
    t->q[(t->qhead + t->qlen++) % t->qcap] = h;
    return NL_OK;
}

static nl_status on_gradient(nl_stage *s, const nl_wire_msg *m, nl_stage_send_fn send, void *ctx,
                             nl_error *err)
{
    stage_train *t = s->train;
    const nl_msg_tensor_hop *hop = &m->u.hop;
    const nl_tensor *g = &m->frames[0].t;
    if (s->model->has_head)
        return nl_error_set(err, NL_ERR_STATE, "GRADIENT: the last stage starts from its loss");
    if (hop->step != t->begun || hop->step != (uint64_t)t->applied + 1 || t->finished)
        return nl_error_set(err, NL_ERR_STATE,
                            "GRADIENT of step %llu, but this stage is at step %llu",
                            (unsigned long long)hop->step, (unsigned long long)t->applied + 1);
    if (hop->microbatch != (uint32_t)t->bwd || t->bwd >= t->fwd)
        return nl_error_set(err, NL_ERR_STATE,
                            "GRADIENT of microbatch %u, but the next backward is of microbatch %d "
                            "(%d forwards run)",
                            hop->microbatch, t->bwd, t->fwd);
    if (g->dtype != NL_DTYPE_F32 || g->ndim != 3 || g->shape[0] != t->mbB || g->shape[1] != t->T ||
        g->shape[2] != (int64_t)t->d)
        return nl_error_set(err, NL_ERR_SHAPE, "GRADIENT: the frame must be F32 [%d, %d, %zu]",
                            t->mbB, t->T, t->d);
    /* frames need not be aligned: the view copies those into x_d */
    replica *p = replica_of(t, hop->microbatch);
    const float *dy = nl_backend_device_view(p->be, p->x_d, g->data, m->frames[0].len);
    nl_status st = backward(s, dy, hop->step, hop->microbatch, send, ctx, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "job %llu step %llu microbatch %u", (unsigned long long)t->job,
                               (unsigned long long)hop->step, hop->microbatch);
    return drain(s, send, ctx, err);
}

static nl_status on_step(nl_stage *s, const nl_msg_step *p, nl_stage_send_fn send, void *ctx,
                         nl_error *err)
{
    stage_train *t = s->train;
    if (p->step != (uint64_t)t->applied + 1 || !t->finished || t->begun != p->step)
        return nl_error_set(err, NL_ERR_STATE, "STEP %llu, but this stage %s step %llu",
                            (unsigned long long)p->step,
                            t->finished ? "has finished" : "has not finished",
                            (unsigned long long)t->applied + 1);
    /* every replica: the same update of the same weights with the same gradients */
    for (int r = 0; p->apply && r < t->R; r++)
        nl_trainer_step(t->rep[r].tr, (float)p->lr, (float)p->clip_scale, nl_adamw_defaults());
    t->applied = (int64_t)p->step;
    t->finished = 0;
    t->counted = t->fwd = t->bwd = 0;
    return drain(s, send, ctx, err);
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

static nl_status on_ckpt(nl_stage *s, const nl_msg_ckpt_req *r, nl_stage_send_fn send, void *ctx,
                         nl_error *err)
{
    stage_train *t = s->train;
    char path[1200], hex[65];
    uint64_t bytes = 0;
    if (r->step != (uint64_t)t->applied || t->fwd != t->bwd)
        return nl_error_set(err, NL_ERR_STATE, "CKPT_REQ of step %llu, but %lld steps are applied",
                            (unsigned long long)r->step, (long long)t->applied);
    nl_status st = check_ckpt_dir(s, r->dir, err);
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
    if ((st = nl_checkpoint_save(s->model, path, (int64_t)r->step, &ex, err)) != NL_OK)
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

static uint64_t msg_job(const nl_wire_msg *m)
{
    return m->type == NL_MSG_STEP       ? m->u.step.job_id
           : m->type == NL_MSG_CKPT_REQ ? m->u.ckpt_req.job_id
                                        : m->u.hop.job_id;
}

bool nl_stage_train_holds(const nl_stage *s, const nl_wire_msg *m)
{
    return s->train && s->train->job == msg_job(m);
}

nl_status nl_stage_train_input(nl_stage *s, const nl_wire_msg *m, nl_stage_send_fn send, void *ctx,
                               nl_error *err)
{
    if (!nl_stage_train_holds(s, m))
        return nl_error_set(err, NL_ERR_STATE, "%s: job %llu is not training on this stage",
                            nl_wire_type_name(m->type), (unsigned long long)msg_job(m));
    nl_status st = nl_stage_device_status(s, err);
    if (st != NL_OK)
        return st;
    switch (m->type) {
    case NL_MSG_COUNT:
    case NL_MSG_ACTIVATION:
    case NL_MSG_EVAL:
        st = enqueue(s, m, err);
        if (st == NL_OK)
            st = drain(s, send, ctx, err);
        break;
    case NL_MSG_GRADIENT:
        st = on_gradient(s, m, send, ctx, err);
        break;
    case NL_MSG_STEP:
        st = on_step(s, &m->u.step, send, ctx, err);
        break;
    case NL_MSG_CKPT_REQ:
        st = on_ckpt(s, &m->u.ckpt_req, send, ctx, err);
        break;
    default:
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s is not a training message",
                            nl_wire_type_name(m->type));
    }
    /* the device's error comes first: it also explains a failed step */
    nl_status dst = nl_stage_check_device(s, err);
    return dst != NL_OK ? dst : st;
}
