/* Embedding jobs on one pipeline stage (JOB_SUBMIT kind embed,
 * docs/cluster.md "Embeddings"): the coordinator first tells every stage
 * the batch's shape and each text's length, then sends the ids down the
 * pipeline as a forward. Every stage keeps the pads out of an encoder's
 * attention (a document of their own, as local `neuroctl embed` does);
 * the last stage outputs the final-normed states, pools them (core/model/embed.h)
 * and returns [B, d] vectors in the RESULT in place of logits. A request
 * is used by one hop and then forgotten; at most EMBED_MAX wait at once
 * (the oldest goes first). With params.adapter (an adapter file under the
 * node's --checkpoint-root, e.g. one a cluster fine-tuning joined) each
 * stage applies its layers' adapters to that one forward (the file loaded
 * once into the stage's cache, stage_lora.c). A forward job with an
 * adapter takes the same path (JOB_SUBMIT kind forward {job, batch, seq,
 * adapter}): its hop applies the adapter and returns logits, unpooled. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/model/embed.h"
#include "core/model/lora.h"
#include "net/params.h"
#include "node/stage_impl.h"

#define EMBED_MAX 64

struct stage_embed {
    uint64_t job;
    int B, T;
    int32_t *lengths; /* (B) */
    int32_t *doc;     /* (B, T): 1 on the pads (an embed job's) */
    bool pool;        /* an embed job; else a forward job with an adapter (logits out) */
    nl_lora *lo;      /* the adapters the forward applies (not attached between hops), or NULL */
};

static void req_free(nl_stage *s, stage_embed *r)
{
    free(r->lengths);
    free(r->doc);
    stage_adapter_put(s, r->lo); /* the stage's cache keeps it a while */
    r->lo = NULL;
}

static void drop(nl_stage *s, int i)
{
    stage_job_forget(s, s->emb[i].job); /* the stage's jobs by id (stage_jobs.c) */
    req_free(s, &s->emb[i]);
    memmove(&s->emb[i], &s->emb[i + 1], (size_t)(s->n_emb - i - 1) * sizeof *s->emb);
    s->n_emb--;
}

void stage_embed_free_all(nl_stage *s)
{
    while (s->n_emb > 0)
        drop(s, s->n_emb - 1);
    free(s->emb);
    s->emb = NULL;
    free(s->emb_out);
    s->emb_out = NULL;
    s->emb_out_cap = 0;
}

const stage_embed *stage_embed_find(const nl_stage *s, uint64_t job)
{
    for (int i = 0; job && i < s->n_emb; i++)
        if (s->emb[i].job == job)
            return &s->emb[i];
    return NULL;
}

bool nl_stage_embed_end(nl_stage *s, uint64_t job)
{
    for (int i = 0; i < s->n_emb; i++)
        if (s->emb[i].job == job) {
            drop(s, i);
            return true;
        }
    return false;
}

/* A parameter of the request by key, or NULL. */
static const nl_wire_param *param(const nl_msg_job_submit *j, const char *key)
{
    return nl_params_find(j->params, j->nparams, key);
}

nl_status nl_stage_embed_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id,
                               nl_error *err)
{
    const nl_wire_param *job = param(j, "job"), *B = param(j, "batch"), *T = param(j, "seq"),
                        *len = param(j, "lengths"), *ad = param(j, "adapter");
    const bool pool = j->kind != NL_JOB_FORWARD;
    const char *what = pool ? "embed" : "forward";
    *job_id = job && job->kind == NL_WIRE_PARAM_INT && job->i > 0 ? (uint64_t)job->i : 0;
    if (!*job_id)
        return nl_error_set(err, NL_ERR_PROTO, "%s JOB_SUBMIT: no params.job", what);
    if (!s->ready)
        return nl_error_set(err, NL_ERR_STATE, "%s job %llu: this stage has no model loaded", what,
                            (unsigned long long)*job_id);
    const nl_model *m = s->model;
    if (!B || B->kind != NL_WIRE_PARAM_INT || !T || T->kind != NL_WIRE_PARAM_INT || B->i < 1 ||
        T->i < 1 || T->i > m->cfg.max_seq_len || B->i * T->i > s->max_rows)
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s job %llu: params.batch and params.seq must be integers with "
                            "seq in 1..%d and batch x seq in 1..%d",
                            what, (unsigned long long)*job_id, m->cfg.max_seq_len, s->max_rows);
    if (pool && (!len || len->kind != NL_WIRE_PARAM_STR))
        return nl_error_set(err, NL_ERR_PROTO, "embed job %llu: no params.lengths",
                            (unsigned long long)*job_id);
    if (stage_embed_find(s, *job_id))
        return nl_error_set(err, NL_ERR_STATE, "%s job %llu: already open on this stage", what,
                            (unsigned long long)*job_id);
    stage_embed r = {.job = *job_id, .B = (int)B->i, .T = (int)T->i, .pool = pool};
    nl_status st = NL_OK;
    if (pool) {
        r.lengths = malloc((size_t)r.B * sizeof *r.lengths);
        r.doc = malloc((size_t)r.B * r.T * sizeof *r.doc);
        st = r.lengths && r.doc ? NL_OK : nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        if (st == NL_OK)
            st = nl_embed_parse_lengths(len->s, r.B, r.T, r.lengths, err);
    }
    if (st == NL_OK && ad && ad->kind != NL_WIRE_PARAM_STR)
        st = nl_error_set(err, NL_ERR_PROTO, "params.adapter: not a path");
    if (st == NL_OK && ad)
        st = stage_adapter_get(s, ad->s, &r.lo, err);
    if (st == NL_OK && !s->emb && !(s->emb = calloc(EMBED_MAX, sizeof *s->emb)))
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if (st != NL_OK) {
        req_free(s, &r);
        return nl_error_prefix(err, "%s job %llu", what, (unsigned long long)*job_id);
    }
    if (pool)
        nl_embed_doc(r.doc, r.lengths, r.B, r.T);
    if (s->n_emb == EMBED_MAX) {
        NL_WARN("embed: %d requests wait; job %llu's is dropped", EMBED_MAX,
                (unsigned long long)s->emb[0].job);
        drop(s, 0);
    }
    s->emb[s->n_emb++] = r;
    return NL_OK;
}

nl_status stage_embed_check(const stage_embed *r, int B, int T, nl_error *err)
{
    if (B != r->B || T != r->T)
        return nl_error_set(err, NL_ERR_SHAPE, "%s job %llu: a batch of %d x %d, not %d x %d",
                            r->pool ? "embed" : "forward", (unsigned long long)r->job, B, T, r->B,
                            r->T);
    return NL_OK;
}

const int32_t *stage_embed_doc(const stage_embed *r)
{
    return r->doc;
}

nl_lora *stage_embed_adapter(const stage_embed *r)
{
    return r->lo;
}

bool stage_embed_pools(const stage_embed *r)
{
    return r->pool;
}

nl_status stage_embed_pool(nl_stage *s, const stage_embed *r, const float *states,
                           nl_stage_out *out, nl_error *err)
{
    const int d = s->model->cfg.hidden_dim;
    const size_t n = (size_t)r->B * d;
    if (n > s->emb_out_cap) {
        float *p = realloc(s->emb_out, n * sizeof *p);
        if (!p)
            return nl_error_set(err, NL_ERR_NOMEM, "embed job %llu: out of memory",
                                (unsigned long long)r->job);
        s->emb_out = p;
        s->emb_out_cap = n;
    }
    for (int b = 0; b < r->B; b++)
        nl_embed_pool(s->emb_out + (size_t)b * d, states + (size_t)b * r->T * d, r->lengths[b], d);
    out->kind = NL_STAGE_OUT_LOGITS; /* the RESULT's frame: [B, d] vectors */
    out->data = s->emb_out;
    out->ndim = 2;
    out->shape[0] = r->B;
    out->shape[1] = d;
    out->shape[2] = 0;
    return NL_OK;
}

/* ---- the embed and forward kinds of the stage's jobs (stage_jobs.c) ---- */

static nl_status embed_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id,
                             void **state, nl_error *err)
{
    *state = NULL;
    return nl_stage_embed_begin(s, j, job_id, err);
}

static void embed_end(nl_stage *s, uint64_t job, void *state)
{
    (void)state;
    nl_stage_embed_end(s, job);
}

/* an embedding job's request: its hop keeps its pads apart and, on the
 * last stage, is pooled; a forward job's comes with an adapter only */
const stage_job_ops nl_stage_embed_ops = {.kind = NL_JOB_EMBED,
                                          .name = "embed",
                                          .status = "embedding",
                                          .begin = embed_begin,
                                          .end = embed_end};
const stage_job_ops nl_stage_forward_ops = {.kind = NL_JOB_FORWARD,
                                            .name = "forward",
                                            .status = "embedding",
                                            .begin = embed_begin,
                                            .end = embed_end};
