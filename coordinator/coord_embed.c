/* The embedding job (JOB_SUBMIT kind embed, docs/cluster.md
 * "Embeddings"): a client's token ids [B, T] and each text's length
 * (params.lengths, core/model/embed.h). Every stage of the plan first takes the
 * request (JOB_SUBMIT kind embed {job, batch, seq, lengths}); once all
 * have, the ids go down the pipeline as a forward, and the last stage
 * returns the pooled, L2-normalised final-normed states F32 [B, d] in its
 * RESULT, which the coordinator relays to the client as a forward's.
 * params.adapter (optional): a LoRA adapter file under --checkpoint-root
 * (for example one a fine-tuning job joined), which every stage applies
 * to its layers for this job.
 *
 * A forward job with params.adapter takes the same road (coord_forward.c
 * hands it here): every stage first takes JOB_SUBMIT kind forward {job,
 * batch, seq, adapter}, then the ids go in, and the last stage's logits
 * come back unpooled. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "core/model/embed.h"

typedef struct cembed {
    int32_t *ids; /* (B, T) */
    int B, T;
    char lengths[NL_EMBED_LENGTHS_MAX + 1];
    char adapter[4096]; /* resolved under --checkpoint-root, or "" */
    int pool;           /* an embed job; 0: a forward job with an adapter */
    int acks;
    uint8_t *acked; /* per stage */
} cembed;

static void embed_free(cjob *j)
{
    cembed *e = j->state;
    if (!e)
        return;
    free(e->ids);
    free(e->acked);
    free(e);
    j->state = NULL;
}

static void refuse(nl_coord *c, const nl_rx *rx, const char *why)
{
    coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, why, NULL);
}

static void submit_to_stages(nl_coord *c, cjob *j);

/* An embed job (pool), or a forward job with an adapter. */
static void request_submit(nl_coord *c, const nl_rx *rx, int pool)
{
    const nl_msg_job_submit *s = &rx->msg.u.job_submit;
    const nl_wire_param *len = coord_param(s, "lengths"), *ad = coord_param(s, "adapter");
    char adapter[PATH_MAX] = "", why[700];
    int B = 0, T = 0;
    nl_error err = {0};
    const char *bad = coord_check_tokens(c, rx, &B, &T);
    if (bad) {
        refuse(c, rx, bad);
        return;
    }
    int32_t *lengths = pool ? malloc((size_t)B * sizeof *lengths) : NULL;
    if (pool && !lengths) {
        refuse(c, rx, "out of memory");
        return;
    }
    if (!pool) {
        /* a forward job: no lengths */
    } else if (!len || len->kind != NL_WIRE_PARAM_STR) {
        nl_error_set(&err, NL_ERR_PROTO, "embed: params.lengths (each text's positions) missing");
        bad = err.msg;
    } else if (nl_embed_parse_lengths(len->s, B, T, lengths, &err) != NL_OK) {
        bad = err.msg;
    }
    free(lengths);
    /* an adapter file the stages read: under the operator's checkpoint root */
    const char *out = !bad && ad ? ad->kind != NL_WIRE_PARAM_STR
                                       ? "not a path"
                                       : coord_confine_file(c->ckpt_root, ad->s, NULL, 1ull << 34,
                                                            adapter, sizeof adapter)
                                 : NULL;
    if (out) {
        snprintf(why, sizeof why, "params.adapter: %s (the coordinator's --checkpoint-root)", out);
        bad = why;
    }
    if (bad) {
        refuse(c, rx, bad);
        return;
    }
    cjob *j = coord_job_new(c, rx, pool ? &coord_embed_ops : &coord_forward_adapted_ops);
    if (!j)
        return;
    cembed *e = j->state = calloc(1, sizeof *e);
    if (e)
        e->ids = malloc((size_t)B * T * sizeof *e->ids);
    if (!e || !e->ids) {
        coord_job_fail(c, j, "out of memory");
        return;
    }
    memcpy(e->ids, rx->msg.frames[0].t.data, (size_t)B * T * sizeof *e->ids);
    e->B = B;
    e->T = T;
    e->pool = pool;
    snprintf(e->lengths, sizeof e->lengths, "%s", pool ? len->s : "");
    snprintf(e->adapter, sizeof e->adapter, "%s", adapter);
    if (!coord_adapter_check(c, j, e->adapter)) /* else it goes on from embed_ready */
        submit_to_stages(c, j);
}

/* The request to every stage of the plan (each answers JOB_STATUS
 * running, then the ids go in: embed_on_message). */
static void submit_to_stages(nl_coord *c, cjob *j)
{
    cembed *e = j->state;
    const int B = e->B, T = e->T, pool = e->pool;
    free(e->acked); /* the plan's stages (one may have come while its adapter was checked) */
    e->acks = 0;
    if (!(e->acked = calloc((size_t)c->plan->n_stages, 1))) {
        coord_job_fail(c, j, "out of memory");
        return;
    }
    j->phase = JOB_RUNNING;
    j->epoch = c->epoch;
    j->last_progress = nl_mono_s();
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, "running", NULL);
    nl_wire_param ps[5] = {
        {.key = "job", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)j->id},
        {.key = "batch", .kind = NL_WIRE_PARAM_INT, .i = B},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = T},
        {.key = "adapter", .kind = NL_WIRE_PARAM_STR, .s = e->adapter},
        {.key = "lengths", .kind = NL_WIRE_PARAM_STR, .s = e->lengths},
    };
    const uint32_t np = 3 + (e->adapter[0] != 0) + (uint32_t)pool; /* lengths last */
    if (pool && !e->adapter[0])
        ps[3] = ps[4];
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (int st = 0; st < c->plan->n_stages; st++) {
        cnode *n = coord_stage_node(c, st);
        nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
        m.u.job_submit = (nl_msg_job_submit){pool ? NL_JOB_EMBED : NL_JOB_FORWARD, np, ps};
        if (!n || coord_send_node(c, n, &m) != NL_OK) {
            nl_wire_msg_free(&m);
            coord_job_fail(c, j, "a stage of the plan cannot be reached");
            return;
        }
    }
    nl_wire_msg_free(&m);
}

/* A stage took the request (JOB_STATUS running); once all have, the ids
 * go in. The last stage's RESULT: to the client, and the job is done. */
static void embed_on_message(nl_coord *c, cjob *j, const nl_rx *rx)
{
    cembed *e = j->state;
    if (j->epoch != c->epoch || j->phase != JOB_RUNNING || !e->acked)
        return; /* another plan's, or not sent yet (its adapter being checked) */
    if (rx->msg.type == NL_MSG_JOB_STATUS) {
        const cnode *n = coord_node_by_rid(c, rx);
        if (!n || n->stage < 0 || n->stage >= c->plan->n_stages || e->acked[n->stage])
            return;
        e->acked[n->stage] = 1;
        j->last_progress = nl_mono_s();
        if (++e->acks == c->plan->n_stages &&
            coord_send_tokens(c, j, 0, 0, e->ids, e->B, e->T) != NL_OK)
            coord_fail_unreachable_first(c, j);
        return;
    }
    if (rx->msg.type != NL_MSG_RESULT || !coord_from_last_stage(c, rx) ||
        e->acks < c->plan->n_stages)
        return;
    const nl_tensor *t = &rx->msg.frames[0].t;
    if (!e->pool && (rx->msg.nframes != 1 || t->dtype != NL_DTYPE_F32)) {
        coord_job_fail(c, j, "the last stage's RESULT is not one F32 frame of logits");
        return;
    }
    if (e->pool && (rx->msg.nframes != 1 || t->dtype != NL_DTYPE_F32 || t->ndim != 2 ||
                    t->shape[0] != e->B || t->shape[1] != c->cfg.hidden_dim)) {
        coord_job_fail(c, j, "the last stage's RESULT is not F32 [batch, hidden_dim] embeddings");
        return;
    }
    coord_finish_with_result(c, j, rx);
}

/* A failed job: the stages forget its request. */
static void embed_abort(nl_coord *c, cjob *j)
{
    coord_close_session(c, j);
}

/* Its adapter was checked, and the plan is ready. */
static void embed_ready(nl_coord *c, cjob *j)
{
    submit_to_stages(c, j);
}

static void embed_submit(nl_coord *c, const nl_rx *rx)
{
    request_submit(c, rx, 1);
}

void coord_forward_adapted_submit(nl_coord *c, const nl_rx *rx)
{
    request_submit(c, rx, 0);
}

const cjob_ops coord_embed_ops = {
    .kind = NL_JOB_EMBED,
    .name = "embed",
    .takes = COORD_TAKES(NL_MSG_RESULT) | COORD_TAKES(NL_MSG_JOB_STATUS),
    .submit = embed_submit,
    .on_message = embed_on_message,
    .ready = embed_ready,
    .abort = embed_abort,
    .free = embed_free,
};

/* A forward job with an adapter (made by coord_forward_adapted_submit). */
const cjob_ops coord_forward_adapted_ops = {
    .kind = NL_JOB_FORWARD,
    .name = "forward",
    .takes = COORD_TAKES(NL_MSG_RESULT) | COORD_TAKES(NL_MSG_JOB_STATUS),
    .submit = coord_forward_adapted_submit,
    .on_message = embed_on_message,
    .ready = embed_ready,
    .abort = embed_abort,
    .free = embed_free,
};
