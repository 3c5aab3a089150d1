/* The stage's jobs (the node's counterpart of the coordinator's
 * cjob_ops): one table of kinds, each a stage_job_ops (begin, holds,
 * input, end, free), and the jobs by id, each with its kind's ops and the
 * state it owns. A JOB_SUBMIT finds its kind's ops by kind, a JOB_CANCEL
 * and every training message find their job by id.
 *
 * Training and fine-tuning jobs own their state here: a training job its
 * stage_train (stage_train.c), a fine-tuning job its adapters and its own
 * stage_train (stage_lora.c). The inference kinds keep their jobs in the
 * stores their hot paths walk (the sessions, which the batch runs and
 * evicts by LRU: stage.c, stage_batch.c; the embedding requests, which
 * wait for their one hop: stage_embed.c): their entries here hold no
 * state, and those stores forget the entry when they drop a job by
 * themselves (stage_job_forget). Their hops take the inference path
 * (nl_stage_forward, nl_stage_enqueue), not nl_stage_job_input. Each
 * kind's ops are in its own file: generate in stage_session.c, embed and
 * forward in stage_embed.c, train in stage_train.c, finetune in
 * stage_lora.c. */
#include <stdlib.h>

#include "node/stage_impl.h"

static const stage_job_ops *const kinds[] = {&nl_stage_generate_ops, &nl_stage_embed_ops,
                                             &nl_stage_forward_ops, &nl_stage_train_ops,
                                             &nl_stage_lora_ops};
/* ---------------------------------------------------------------- the table */

stage_job *stage_job_find(const nl_stage *s, uint64_t id)
{
    for (int i = 0; id && i < s->n_jobs; i++)
        if (s->jobs[i].id == id)
            return &s->jobs[i];
    return NULL;
}

stage_job *stage_job_first(const nl_stage *s, int kind)
{
    for (int i = 0; i < s->n_jobs; i++)
        if (s->jobs[i].ops->kind == kind)
            return &s->jobs[i];
    return NULL;
}

int stage_job_count(const nl_stage *s, int kind)
{
    int n = 0;
    for (int i = 0; i < s->n_jobs; i++)
        n += s->jobs[i].ops->kind == kind;
    return n;
}

/* Take job e out of the table (the order of the others is kept). */
static stage_job take(nl_stage *s, stage_job *e)
{
    stage_job j = *e;
    const int i = (int)(e - s->jobs);
    for (int k = i; k + 1 < s->n_jobs; k++)
        s->jobs[k] = s->jobs[k + 1];
    s->n_jobs--;
    return j;
}

static void job_free(nl_stage *s, stage_job *j)
{
    if (j->ops->free)
        j->ops->free(s, j->state);
}

void stage_job_forget(nl_stage *s, uint64_t id)
{
    stage_job *e = stage_job_find(s, id);
    if (e && !e->state) /* a store's job: its state went with the store's entry */
        take(s, e);
}

void stage_job_drop_kind(nl_stage *s, int kind)
{
    stage_job *e;
    while ((e = stage_job_first(s, kind)) != NULL) {
        stage_job j = take(s, e);
        job_free(s, &j);
    }
}

void stage_jobs_free_all(nl_stage *s)
{
    while (s->n_jobs > 0) {
        stage_job j = take(s, &s->jobs[s->n_jobs - 1]);
        job_free(s, &j);
    }
    free(s->jobs);
    s->jobs = NULL;
    s->cap_jobs = 0;
}

/* Room for one more job. */
static nl_status reserve(nl_stage *s, nl_error *err)
{
    if (s->n_jobs < s->cap_jobs)
        return NL_OK;
    const int cap = s->cap_jobs ? 2 * s->cap_jobs : 8;
    stage_job *jobs = realloc(s->jobs, (size_t)cap * sizeof *jobs);
    if (!jobs)
        return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory for jobs");
    s->jobs = jobs;
    s->cap_jobs = cap;
    return NL_OK;
}

nl_status nl_stage_job_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id,
                             const char **status, nl_error *err)
{
    const stage_job_ops *ops = NULL;
    void *state = NULL;
    *job_id = 0;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (kinds[i]->kind == (int)j->kind)
            ops = kinds[i];
    if (!ops)
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "JOB_SUBMIT: a node runs no job of kind %u",
                            j->kind);
    nl_status st = reserve(s, err);
    if (st == NL_OK)
        st = ops->begin(s, j, job_id, &state, err);
    if (st != NL_OK)
        return st;
    stage_job *old = stage_job_find(s, *job_id);
    if (old) { /* begun again (a session opened again): the new one replaces it */
        stage_job o = take(s, old);
        job_free(s, &o);
    }
    s->jobs[s->n_jobs++] = (stage_job){.id = *job_id, .ops = ops, .state = state};
    if (status)
        *status = ops->status;
    return NL_OK;
}

int nl_stage_job_end(nl_stage *s, uint64_t id)
{
    stage_job *e = stage_job_find(s, id);
    if (!e)
        return -1;
    stage_job j = take(s, e); /* first: the kind's store forgets it as it ends */
    if (j.ops->end)
        j.ops->end(s, j.id, j.state);
    job_free(s, &j);
    return j.ops->kind;
}

uint64_t nl_stage_job_of(const nl_wire_msg *m)
{
    return m->type == NL_MSG_STEP         ? m->u.step.job_id
           : m->type == NL_MSG_CKPT_REQ   ? m->u.ckpt_req.job_id
           : m->type == NL_MSG_VERIFY_REQ ? m->u.verify_req.job_id
           : m->type == NL_MSG_REDUCE     ? m->u.reduce.job_id
                                          : m->u.hop.job_id;
}

/* A training hop of another placement: it was in flight when a re-plan
 * restarted its job (the same job id, steps counted again from the
 * resumed one), from a neighbour of the former plan. */
static bool other_epoch(const nl_stage *s, const nl_wire_msg *m)
{
    switch (m->type) {
    case NL_MSG_ACTIVATION:
    case NL_MSG_COUNT:
    case NL_MSG_EVAL:
    case NL_MSG_GRADIENT:
        return m->u.train_hop.epoch && m->u.train_hop.epoch != nl_stage_epoch(s);
    case NL_MSG_REDUCE: /* from a replica of the former plan */
        return m->u.reduce.epoch && m->u.reduce.epoch != nl_stage_epoch(s);
    default:
        return false;
    }
}

bool nl_stage_job_holds(const nl_stage *s, const nl_wire_msg *m)
{
    const stage_job *e = stage_job_find(s, nl_stage_job_of(m));
    return e && e->ops->holds && e->ops->holds(e->state, m) && !other_epoch(s, m);
}

nl_status nl_stage_job_input(nl_stage *s, const nl_wire_msg *m, nl_stage_send_fn send, void *ctx,
                             nl_error *err)
{
    const uint64_t id = nl_stage_job_of(m);
    stage_job *e = stage_job_find(s, id);
    if (!e || !e->ops->holds || !e->ops->holds(e->state, m))
        return nl_error_set(err, NL_ERR_STATE, "%s: job %llu is not training on this stage",
                            nl_wire_type_name(m->type), (unsigned long long)id);
    if (other_epoch(s, m))
        return nl_error_set(
            err, NL_ERR_STATE, "%s of job %llu: epoch %llu, but this stage is in %llu",
            nl_wire_type_name(m->type), (unsigned long long)id,
            (unsigned long long)m->u.train_hop.epoch, (unsigned long long)nl_stage_epoch(s));
    return e->ops->input(s, e->state, m, send, ctx, err);
}
