/* A training job's making on one pipeline stage: its parameters read from
 * the JOB_SUBMIT (stage_train_params), and its state built from them
 * (stage_train_make): the model's growth history, the trainer, and
 * the replicas with their own weights, trainers and worker lanes. The
 * job's life and messages are in stage_train.c (its opening comment says
 * how replicas share a step), the schedule in stage_train_hops.c; the
 * LoRA kind (stage_lora.c) makes its job here too. */
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

/* The model's growth history, as the coordinator sends it (params
 * growth.0, growth.1, ..., each a JSON array of entries, core/grow/grow.h):
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
static nl_status make_replicas(nl_stage *s, stage_train *t, int recompute, nl_error *err)
{
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

nl_status stage_train_params(nl_stage *s, const nl_msg_job_submit *j, nl_trainparams *p,
                             uint64_t *job_id, nl_error *err)
{
    const bool ft = j->kind == NL_JOB_FINETUNE;
    const char *what = ft ? "finetune" : "train";
    /* the schema the coordinator writes them by (net/trainparams.h) */
    nl_status st = nl_trainparams_parse(p, j->params, j->nparams,
                                        ft ? NL_TRAINPARAMS_STAGE_FT : NL_TRAINPARAMS_STAGE, err);
    *job_id = p->job; /* read first: known unless it is the fault */
    if (st != NL_OK)
        return st;
    if (!s->ready)
        return nl_error_set(err, NL_ERR_STATE, "%s job %llu: this stage has no model loaded", what,
                            (unsigned long long)p->job);
    if (p->seq > s->model->cfg.max_seq_len)
        return nl_error_set(
            err, NL_ERR_RANGE, "%s job %llu: params.seq %lld is above the model's max_seq_len %d",
            what, (unsigned long long)p->job, (long long)p->seq, s->model->cfg.max_seq_len);
    return NL_OK;
}

/* Whether the job fits the memory this node offers (--memory), by the
 * memory model: rslots microbatches of mbB x T in flight on each of R
 * replicas; NL_ERR_CAPACITY with the figures if not. */
static nl_status check_memory(const nl_stage *s, long long job, int64_t mbB, int64_t T, int rslots,
                              int recompute, int R, nl_error *err)
{
    const nl_model *m = s->model;
    nl_mem_opts mo = {.training = 1,
                      .micro_rows = (int)(mbB * T),
                      .in_flight = rslots,
                      .recompute = recompute,
                      .precision = nl_mem_precision(s->be)};
    nl_mem_estimate me = nl_memory_estimate(&m->cfg, m->l1 - m->l0, m->has_embed, m->has_head, &mo);
    if (m->lora) /* fine-tuning: no moments for the frozen base (the adapters' are small) */
        me.total -= me.moments;
    const uint64_t offer = nl_stage_plan_memory(s);
    if (me.total > offer)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "train job %lld: layers [%d, %d) with %d microbatches of %lld x %lld "
                            "in flight need %llu bytes (memory model), but this node offers %llu "
                            "(--memory less --kv-budget)%s",
                            job, m->l0, m->l1, rslots, (long long)mbB, (long long)T,
                            (unsigned long long)me.total, (unsigned long long)offer,
                            R > 1 ? " on each replica" : "");
    return NL_OK;
}

nl_status stage_train_make(nl_stage *s, const nl_trainparams *p, const nl_msg_job_submit *j,
                           stage_train **out, nl_error *err)
{
    const long long job = (long long)p->job;
    *out = NULL;
    const int64_t mbB = p->micro_batch, T = p->seq, M = p->micro, start = p->start_step;
    const int recompute = p->recompute, moments = p->moments;
    /* fine-tuning runs on replica 0 alone: its adapters are attached to
     * the stage's model (replica 0's) for each of its messages, and the
     * other replicas' copies of the base would need theirs */
    const int R = s->model && s->model->lora ? 1 : s->n_rep;
    nl_status st;
    for (int r = 0; r < R; r++)
        if (!s->rbe[r]->can_train)
            return nl_error_set(err, NL_ERR_UNSUPPORTED,
                                "%s: training on this device is not available yet (train job %lld)",
                                s->rbe[r]->name, job);
    if ((st = nl_stage_device_status(s, err)) != NL_OK)
        return st;
    nl_model *m = s->model;
    if ((st = growth_params(m, j, err)) != NL_OK)
        return st;
    if (moments && !s->have_moments)
        return nl_error_set(err, NL_ERR_STATE,
                            "train job %lld: resuming needs the optimizer moments, but none came "
                            "with this stage's weights",
                            (long long)job);
    /* 1F1B: a stage keeps the activations of at most as many microbatches
     * as there are stages from it to the last, and --in-flight-extra more
     * but on the last (core/model/memory.h; of those this node runs: 1 / R
     * of them on one of R replicas, stage_train_ring.c) */
    const int64_t Mh = s->replicas > 1 && M % s->replicas == 0 ? M / s->replicas : M;
    const int slots =
        nl_mem_train_slots(s->num_stages - 1 - s->stage_idx, Mh > INT32_MAX ? INT32_MAX : (int)Mh,
                           (int)p->in_flight_extra);
    /* each replica keeps its share of the microbatches in flight */
    const int rslots = (slots + R - 1) / R;
    if ((st = check_memory(s, job, mbB, T, rslots, recompute, R, err)) != NL_OK)
        return st;
    stage_job_drop_kind(s, NL_JOB_TRAIN); /* the earlier job's memory first */
    stage_train *t = calloc(1, sizeof *t);
    if (!t)
        return nl_error_set(err, NL_ERR_NOMEM, "train job %lld: out of memory", job);
    nl_wire_msg_init(&t->tx);
    t->job = p->job;
    t->mbB = (int)mbB;
    t->T = (int)T;
    if ((st = stage_train_ring_new(s, t, M, p, err)) != NL_OK) {
        stage_train_free(t);
        return nl_error_prefix(err, "train job %lld", job);
    }
    if (!(t->dig = calloc((size_t)M, NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES)) ||
        !(t->kept = calloc((size_t)t->M, sizeof *t->kept)) ||
        (s->fan_next && !(t->gpend = calloc((size_t)t->M, sizeof *t->gpend)))) {
        stage_train_free(t);
        return nl_error_set(err, NL_ERR_NOMEM, "train job %lld: out of memory", job);
    }
    t->slots = slots;
    t->eval_hops = (int)p->eval_hops;
    t->keep_out = p->verify_outputs != 0;
    t->rows = (size_t)(mbB * T);
    t->d = (size_t)m->cfg.hidden_dim;
    t->applied = start;
    t->R = R;
    t->rslots = rslots;
    t->has_embed = m->has_embed;
    t->has_head = m->has_head;
    stage_train_model_init(s, t); /* test hook: the compute model */
    const bool threads = t->R > 1 && !s->o.replicas_inline;
    t->async = threads && s->o.train_async;
    st = make_replicas(s, t, (int)recompute, err);
    if (st == NL_OK)
        st = nl_workers_new(&t->w, t->R, threads, stage_train_run_job, t, err);
    if (st != NL_OK) {
        stage_train_free(t);
        return nl_error_prefix(err, "train job %lld", job);
    }
    if (moments) { /* the resumed run's moments: into every trainer */
        for (int i = 0; i < 2; i++)
            for (int r = 0; r < t->R; r++)
                t->rep[r].be->upload(t->rep[r].be, nl_trainer_moment(t->rep[r].tr, i), s->mom_h[i],
                                     m->n_params * sizeof(float));
        for (int r = 0; r < t->R; r++)
            nl_trainer_set_adam_steps(t->rep[r].tr, p->adam_steps);
    }
    t->adam_want = nl_trainer_adam_steps(t->rep[0].tr);
    /* the checkpoint's moments are freed here: taken by a resumed job, or
     * dropped by a new one, which starts with zero moments at AdamW step 0 */
    for (int i = 0; i < 2; i++) {
        free(s->mom_h[i]);
        s->mom_h[i] = NULL;
    }
    s->have_moments = false;
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
    else if (s->n_rep > 1)
        NL_INFO("train job %llu: fine-tuning runs on replica 0 (%s) alone, not on the stage's %d "
                "data-parallel replicas",
                (unsigned long long)t->job, s->rbe[0]->name, s->n_rep);
    if (t->xR > 1)
        NL_INFO("train job %llu: replica %d of the stage's %d: microbatches %d, %d + %d, ... of "
                "each step",
                (unsigned long long)t->job, t->xr, t->xR, t->xr, t->xr, t->xR);
    *out = t;
    return NL_OK;
}
