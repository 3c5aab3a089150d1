/* The jobs' dispatch: the loop (coord.c) hands it every message about a
 * job and every event of the cluster (a stage lost, a plan ready, the
 * clock); it finds the job and calls its kind's operations (coord_impl.h).
 * Cancel and the cluster's status report are here too. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coord_impl.h"

static const cjob_ops *const kinds[] = {&coord_forward_ops, &coord_generate_ops, &coord_train_ops,
                                        &coord_finetune_ops, &coord_embed_ops, &coord_grow_ops};

static void status_reply(nl_coord *c, const nl_rx *rx, uint64_t job, int state, const char *msg)
{
    coord_status_to(c, rx->rid, rx->rid_len, job, state, 0.0, msg, NULL);
}

void coord_on_submit(nl_coord *c, const nl_rx *rx)
{
    const nl_msg_job_submit *s = &rx->msg.u.job_submit;
    const cjob_ops *ops = NULL;
    char why[700];
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (kinds[i]->kind == (int)s->kind)
            ops = kinds[i];
    if (!ops) {
        snprintf(why, sizeof why, "no job of kind %u", s->kind);
        status_reply(c, rx, 0, NL_JOB_FAILED, why);
        return;
    }
    if (!c->ready && s->kind != NL_JOB_TRAIN) { /* a resumed training job loads first */
        snprintf(why, sizeof why, "the cluster is not ready: %s", c->state);
        status_reply(c, rx, 0, NL_JOB_FAILED, why);
        return;
    }
    ops->submit(c, rx);
}

/* The job a node's message is about. */
static uint64_t job_of(const nl_wire_msg *m)
{
    switch (m->type) {
    case NL_MSG_JOB_STATUS:
        return m->u.job_status.job_id;
    case NL_MSG_TOKEN:
        return m->u.token.job_id;
    case NL_MSG_RESULT:
        return m->u.hop.job_id;
    case NL_MSG_GRAD_NORM:
        return m->u.grad_norm.job_id;
    case NL_MSG_LOSS:
        return m->u.loss.job_id;
    case NL_MSG_CKPT_DONE:
        return m->u.ckpt_done.job_id;
    case NL_MSG_VERIFY_CASE:
        return m->u.verify_case.job_id;
    case NL_MSG_VERIFY_RESULT:
        return m->u.verify_result.job_id;
    default:
        return 0;
    }
}

/* JOB_STATUS from a node reporting that its work for one job failed: that
 * job fails, if the node is one of its stages (a stage of the plan the job
 * runs on); any other node's report is only logged. */
static void on_node_failure(nl_coord *c, const cnode *n, cjob *j, const nl_msg_job_status *s)
{
    char text[1000], why[1200];
    nl_log_escape(text, sizeof text, s->message);
    if (j && (j->phase != JOB_RUNNING || n->stage < 0 || j->epoch != c->epoch)) {
        NL_INFO("job %llu: node %u, not one of its stages, reports a failure: %s",
                (unsigned long long)s->job_id, n->id, text);
        return;
    }
    snprintf(why, sizeof why, "node %u (stage %d): %s", n->id, n->stage, text);
    if (j && j->ops->node_failed && j->ops->node_failed(c, j, why))
        return;
    if (j)
        coord_job_fail(c, j, why);
    else
        NL_INFO("job %llu, already ended: %s", (unsigned long long)s->job_id, why);
}

void coord_on_job_message(nl_coord *c, const nl_rx *rx)
{
    const int type = rx->msg.type;
    cjob *j = coord_job_find(c, job_of(&rx->msg));
    const cnode *n = coord_node_by_rid(c, rx);
    nl_error e = {0};
    char why[200];
    if (!n) { /* only a node that joined (with its key) reports on jobs */
        snprintf(why, sizeof why, "%s comes from a node of this cluster: JOIN first",
                 nl_wire_type_name(type));
        nl_sock_send_error(c->ctl, rx, NL_ERR_STATE, (uint32_t)type, why, &e);
        return;
    }
    /* e.g. a TOKEN naming a forward or training job */
    if (j && !(j->ops->takes & COORD_TAKES(type))) {
        snprintf(why, sizeof why, "job %llu is a %s job: it takes no %s", (unsigned long long)j->id,
                 j->ops->name, nl_wire_type_name(type));
        NL_WARN("node %u: %s", n->id, why);
        nl_sock_send_error(c->ctl, rx, NL_ERR_STATE, (uint32_t)type, why, &e);
        return;
    }
    if (type == NL_MSG_JOB_STATUS && rx->msg.u.job_status.state == NL_JOB_FAILED) {
        on_node_failure(c, n, j, &rx->msg.u.job_status);
        return;
    }
    if (j && j->ops->on_message)
        j->ops->on_message(c, j, rx);
}

void coord_on_cancel(nl_coord *c, const nl_rx *rx)
{
    cjob *j = coord_job_find(c, rx->msg.u.job_ref.job_id);
    const bool admin = (c->roles & NL_KEY_ROLE_ADMIN) != 0; /* may cancel any job */
    if (!j ||
        (!admin && (j->rid_len != rx->rid_len || memcmp(j->rid, rx->rid, rx->rid_len) != 0))) {
        status_reply(c, rx, rx->msg.u.job_ref.job_id, NL_JOB_FAILED, "no such job of yours");
        return;
    }
    if (j->ops->cancel && j->ops->cancel(c, j, rx))
        return; /* it winds down: the steps done are kept, then it ends */
    if (j->ops->abort)
        j->ops->abort(c, j);
    NL_INFO("job %llu cancelled by %s", (unsigned long long)j->id,
            j->rid_len == rx->rid_len && memcmp(j->rid, rx->rid, rx->rid_len) == 0 ? "its client"
                                                                                   : "an admin");
    if (j->rid_len != rx->rid_len || memcmp(j->rid, rx->rid, rx->rid_len) != 0)
        coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_CANCELLED, 0.0,
                        "cancelled by an admin", NULL);
    status_reply(c, rx, j->id, NL_JOB_CANCELLED, "cancelled");
    coord_job_free(j);
}

void coord_fail_jobs(nl_coord *c, const char *why)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE)
            coord_job_fail(c, &c->jobs[i], why);
}

void coord_fail_stage_jobs(nl_coord *c, const char *why)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase == JOB_RUNNING && c->jobs[i].epoch == c->epoch)
            coord_job_fail(c, &c->jobs[i], why);
}

void coord_jobs_stage_lost(nl_coord *c, const char *why)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        cjob *j = &c->jobs[i];
        if (j->phase == JOB_FREE || (j->ops->stage_lost && j->ops->stage_lost(c, j, why)))
            continue;
        char msg[900];
        snprintf(msg, sizeof msg, "%s; the job failed", why);
        coord_job_fail(c, j, msg);
    }
}

void coord_jobs_touch(nl_coord *c)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase == JOB_WAITING)
            c->jobs[i].last_progress = coord_now();
}

void coord_jobs_ready(nl_coord *c)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase == JOB_WAITING && c->jobs[i].ops->ready)
            c->jobs[i].ops->ready(c, &c->jobs[i]);
}

void coord_fail_waiting(nl_coord *c, const char *why)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase == JOB_WAITING)
            coord_job_fail(c, &c->jobs[i], why);
}

void coord_check_jobs(nl_coord *c, double now)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        cjob *j = &c->jobs[i];
        if (j->phase == JOB_FREE)
            continue;
        if (j->working) { /* a worker's task for it is progress */
            j->last_progress = now;
            continue;
        }
        if ((now - j->last_progress) * 1e3 > c->o.job_timeout_ms) {
            char why[128];
            snprintf(why, sizeof why, "no progress for %.0f s", now - j->last_progress);
            coord_job_fail(c, j, why);
        }
    }
}

/* ---------------------------------------------------------------- status */

/* The cluster's status; full (every node's key and endpoint) when full is
 * set (an admin), else what a client needs: the state, the config and
 * each node's device, memory and stage. */
static json_t *status_json(nl_coord *c, bool full)
{
    json_t *root = json_object(), *nodes = json_array();
    const double now = coord_now();
    json_object_set_new(root, "state", json_string(c->state));
    json_object_set_new(root, "ready", json_boolean(c->ready));
    if (full)
        json_object_set_new(root, "endpoint", json_string(c->endpoint));
    json_object_set_new(root, "plan_epoch", json_integer((json_int_t)c->epoch));
    if (c->have_cfg) {
        char *cj = nl_config_to_json(&c->cfg);
        json_t *cfg = cj ? json_loads(cj, 0, NULL) : NULL;
        if (cfg)
            json_object_set_new(root, "config", cfg);
        free(cj);
    }
    if (c->plan)
        json_object_set_new(root, "bottleneck_s", json_real(c->plan->bottleneck));
    for (int i = 0; i < c->n_nodes; i++) {
        const cnode *n = &c->nodes[i];
        if (n->life == NODE_FREE)
            continue;
        json_t *o = json_object();
        json_object_set_new(o, "id", json_integer(n->id));
        if (full)
            json_object_set_new(o, "key", json_string(n->key));
        json_object_set_new(o, "device", json_string(n->device));
        json_object_set_new(o, "memory", json_integer((json_int_t)n->memory));
        json_object_set_new(o, "gflops", json_real(n->gflops));
        json_object_set_new(o, "threads", json_integer(n->threads));
        if (full)
            json_object_set_new(o, "endpoint", json_string(n->endpoint));
        json_object_set_new(o, "heartbeat_age_s", json_real(now - n->last_seen));
        /* what its last heartbeat said (docs/protocol.md): KV caches, and
         * its batched session hops as counters */
        json_object_set_new(o, "load", json_real(n->hb.load));
        json_object_set_new(o, "sessions", json_integer(n->hb.sessions));
        json_object_set_new(o, "kv_bytes", json_integer((json_int_t)n->hb.kv_bytes));
        json_object_set_new(o, "hops", json_integer((json_int_t)n->hb.hops));
        json_object_set_new(o, "batches", json_integer((json_int_t)n->hb.batches));
        json_object_set_new(o, "compute_s", json_real(n->hb.compute_s));
        json_object_set_new(o, "hop_s", json_real(n->hb.hop_s));
        const char *state = n->life == NODE_DEAD   ? "dead"
                            : n->life == NODE_LEFT ? "left"
                            : n->stage >= 0        ? (n->loaded ? "serving" : "loading")
                            : c->plan              ? "standby"
                                                   : "joined";
        json_object_set_new(o, "state", json_string(state));
        if (n->stage >= 0 && c->plan) {
            const nl_plan_stage *s = &c->plan->stages[n->stage];
            json_object_set_new(o, "stage", json_integer(n->stage));
            json_object_set_new(o, "layers", json_pack("[ii]", s->l0, s->l1));
            json_object_set_new(o, "embed", json_boolean(s->has_embed));
            json_object_set_new(o, "head", json_boolean(s->has_head));
            json_object_set_new(o, "memory_planned", json_integer((json_int_t)s->bytes));
            json_object_set_new(o, "predicted_s", json_real(s->seconds));
        }
        json_array_append_new(nodes, o);
    }
    json_object_set_new(root, "nodes", nodes);
    json_t *jobs = json_array();
    for (int i = 0; jobs && i < COORD_MAX_JOBS; i++) {
        const cjob *j = &c->jobs[i];
        if (j->phase != JOB_FREE)
            json_array_append_new(jobs, json_pack("{s:I,s:s,s:s,s:b}", "id", (json_int_t)j->id,
                                                  "kind", j->ops->name, "state",
                                                  j->phase == JOB_WAITING ? "waiting" : "running",
                                                  "followed", j->rid_len > 0));
    }
    json_object_set_new(root, "jobs", jobs);
    if (c->growths > 0) { /* issue 16: the last growth, and how many */
        json_t *g = coord_growth_json(&c->last_growth);
        if (g)
            json_object_set_new(g, "count", json_integer(c->growths));
        json_object_set_new(root, "growth", g ? g : json_null());
    }
    if (c->tok_text)
        json_object_set_new(root, "tokenizer", json_string(c->tok_text));
    return root;
}

void coord_on_query(nl_coord *c, const nl_rx *rx)
{
    const uint64_t id = rx->msg.u.job_ref.job_id;
    nl_error e = {0};
    if (id != 0) {
        cjob *j = coord_job_find(c, id);
        if (j) { /* the asking client follows the job from now on (neuroctl train --attach) */
            memcpy(j->rid, rx->rid, rx->rid_len);
            j->rid_len = rx->rid_len;
        }
        status_reply(c, rx, id, j ? NL_JOB_RUNNING : NL_JOB_FAILED, j ? "running" : "no such job");
        return;
    }
    json_t *root = status_json(c, (c->roles & NL_KEY_ROLE_ADMIN) != 0);
    char *text = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (!text) {
        nl_sock_send_error(c->cli, rx, NL_ERR_NOMEM, NL_MSG_JOB_QUERY, "out of memory", &e);
        return;
    }
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
    m.u.job_status = (nl_msg_job_status){0, c->ready ? NL_JOB_RUNNING : NL_JOB_QUEUED, 0.0,
                                         c->ready ? "ready" : "not ready"};
    const int64_t len = (int64_t)strlen(text);
    nl_wire_frame_set(&m.frames[0], text, NL_DTYPE_U8, &len, 1);
    m.nframes = 1;
    coord_send_client(c, rx->rid, rx->rid_len, &m);
    nl_wire_msg_free(&m);
    free(text);
}
