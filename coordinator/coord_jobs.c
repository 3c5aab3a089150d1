/* The jobs' table and dispatch: the loop (coord.c) hands it every message
 * about a job and every event of the cluster (a stage lost, a plan ready,
 * the clock); it finds the job and calls its kind's operations
 * (coord_impl.h). Each job belongs to the key that submitted it: query,
 * follow and cancel check that (coord_job_mine). Cancel and the cluster's
 * status report are here too. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "net/client.h"

static const cjob_ops *const kinds[] = {&coord_forward_ops,  &coord_generate_ops, &coord_train_ops,
                                        &coord_finetune_ops, &coord_embed_ops,    &coord_grow_ops};

/* ---------------------------------------------------------------- the table */

cjob *coord_job_find(nl_coord *c, uint64_t id)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE && c->jobs[i].id == id)
            return &c->jobs[i];
    return NULL;
}

void coord_job_free(cjob *j)
{
    if (j->ops && j->ops->free)
        j->ops->free(j);
    memset(j, 0, sizeof *j);
}

cjob *coord_job_new(nl_coord *c, const nl_rx *rx, const cjob_ops *ops)
{
    cjob *j = NULL;
    int held = 0;
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        if (c->jobs[i].phase == JOB_FREE && !j)
            j = &c->jobs[i];
        else if (c->jobs[i].phase != JOB_FREE && rx->peer[0] &&
                 strcmp(c->jobs[i].owner, rx->peer) == 0)
            held++;
    }
    const int cap = c->o.max_jobs_per_key > 0 ? c->o.max_jobs_per_key : COORD_MAX_JOBS;
    if (!j || held >= cap) { /* one key must not fill the table for everyone */
        char why[200];
        if (j)
            snprintf(why, sizeof why,
                     NL_CLIENT_TOO_MANY_JOBS
                     " of this key at once: %d (neurocoord --max-jobs-per-key); "
                     "try again when one ends",
                     held);
        else
            snprintf(why, sizeof why, NL_CLIENT_TOO_MANY_JOBS " at once; try again");
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, why, NULL);
        return NULL;
    }
    memset(j, 0, sizeof *j);
    j->phase = JOB_RUNNING;
    j->id = ++c->next_job;
    j->ops = ops;
    memcpy(j->rid, rx->rid, rx->rid_len);
    j->rid_len = rx->rid_len;
    snprintf(j->owner, sizeof j->owner, "%s", rx->peer);
    j->epoch = c->epoch;
    j->last_progress = nl_mono_s();
    return j;
}

bool coord_job_mine(const nl_coord *c, const cjob *j, const nl_rx *rx)
{
    if (c->roles & NL_KEY_ROLE_ADMIN)
        return true;
    return j->owner[0] && strcmp(j->owner, rx->peer) == 0;
}

/* ---------------------------------------------------------------- dispatch */

static void status_reply(nl_coord *c, const nl_rx *rx, uint64_t job, int state, const char *msg)
{
    coord_status_to(c, rx->rid, rx->rid_len, job, state, 0.0, msg, NULL);
}

/* Whether a submission reloads the cluster, failing every job in flight:
 * a growth, a training job that resumes a manifest or learns a vocabulary. */
static bool reloads_cluster(const nl_msg_job_submit *s)
{
    if (s->kind == NL_JOB_GROW)
        return true;
    if (s->kind != NL_JOB_TRAIN)
        return false;
    const nl_wire_param *lv = coord_param(s, "learn_vocab");
    return coord_param(s, "resume") || (lv && lv->kind == NL_WIRE_PARAM_INT && lv->i > 0);
}

/* What the submitting key's role forbids (issue 31): growing the model is
 * an admin's; a job that reloads the cluster is a client's only while no
 * other key's job runs (it would fail them). NULL: allowed. */
static const char *submit_refusal(const nl_coord *c, const nl_rx *rx, char *why, size_t cap)
{
    const nl_msg_job_submit *s = &rx->msg.u.job_submit;
    if (c->roles & NL_KEY_ROLE_ADMIN)
        return NULL;
    if (s->kind == NL_JOB_GROW)
        return "growing the model takes the admin role (authorized_keys)";
    if (!reloads_cluster(s))
        return NULL;
    int others = 0;
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        others += c->jobs[i].phase != JOB_FREE && strcmp(c->jobs[i].owner, rx->peer) != 0;
    if (others == 0)
        return NULL;
    snprintf(why, cap,
             "a training job with resume or learn_vocab reloads the cluster and would fail the %d "
             "job(s) of other clients running: try again when they end, or ask an admin",
             others);
    return why;
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
    const char *no = submit_refusal(c, rx, why, sizeof why);
    if (no) {
        status_reply(c, rx, 0, NL_JOB_FAILED, no);
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
    if (j && j->ops->node_failed && j->ops->node_failed(c, j, n, s->req_type, why))
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

static bool same_rid(const cjob *j, const nl_rx *rx)
{
    return j->rid_len == rx->rid_len && memcmp(j->rid, rx->rid, rx->rid_len) == 0;
}

/* A JOB_CANCEL: only the job's key or an admin may; any other key is told
 * what it would be told of a job that does not exist. */
void coord_on_cancel(nl_coord *c, const nl_rx *rx)
{
    cjob *j = coord_job_find(c, rx->msg.u.job_ref.job_id);
    if (!j || !coord_job_mine(c, j, rx)) {
        status_reply(c, rx, rx->msg.u.job_ref.job_id, NL_JOB_FAILED, "no such job of yours");
        return;
    }
    if (j->ops->cancel && j->ops->cancel(c, j, rx))
        return; /* it winds down: the steps done are kept, then it ends */
    if (j->ops->abort)
        j->ops->abort(c, j);
    const bool owner = j->owner[0] && strcmp(j->owner, rx->peer) == 0;
    NL_INFO("job %llu cancelled by %s", (unsigned long long)j->id,
            owner ? "its client" : "an admin");
    if (!same_rid(j, rx)) /* the connection that follows it is told too */
        coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_CANCELLED, 0.0,
                        owner ? "cancelled by its client" : "cancelled by an admin", NULL);
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

int coord_jobs_stage_lost(nl_coord *c, const char *why)
{
    int held = 0;
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        cjob *j = &c->jobs[i];
        const int rc = j->phase == JOB_FREE ? 1
                       : j->ops->stage_lost ? j->ops->stage_lost(c, j, why)
                                            : 0;
        held |= rc == 2;
        if (rc)
            continue;
        char msg[900];
        snprintf(msg, sizeof msg, "%s; the job failed", why);
        coord_job_fail(c, j, msg);
    }
    return held;
}

void coord_jobs_touch(nl_coord *c)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase == JOB_WAITING)
            c->jobs[i].last_progress = nl_mono_s();
}

void coord_jobs_ready(nl_coord *c)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase == JOB_WAITING && !c->jobs[i].checking && c->jobs[i].ops->ready)
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
        if (j->working || j->checking) { /* a worker's task for it (or another's) is progress */
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

/* One node of status_json: what it offers, its last heartbeat, and its
 * stage (and replica) in the plan; key and endpoint when full. */
static json_t *node_json(nl_coord *c, const cnode *n, bool full, double now)
{
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
    /* as a verifier of other stages' work (coord_train_verify.c): cases it
     * answered, answers that disagreed with the stage, seconds from each
     * case's send to its answer (summed), bytes of cases sent to it */
    json_object_set_new(o, "verify_cases", json_integer((json_int_t)n->ver_cases));
    json_object_set_new(o, "verify_mismatches", json_integer((json_int_t)n->ver_mismatches));
    json_object_set_new(o, "verify_s", json_real(n->ver_s));
    json_object_set_new(o, "verify_bytes", json_integer((json_int_t)n->ver_bytes));
    /* its link speed as its replicas' all-reduces measured it (null: none) */
    const double link = coord_link_bytes_s(n);
    json_object_set_new(o, "link_bytes_s", link > 0 ? json_real(link) : json_null());
    const char *state = n->life == NODE_DEAD   ? "dead"
                        : n->life == NODE_LEFT ? "left"
                        : n->stage >= 0        ? (n->loaded ? "serving" : "loading")
                        : c->plan              ? "standby"
                                               : "joined";
    json_object_set_new(o, "state", json_string(state));
    if (n->stage >= 0 && c->plan) {
        const nl_plan_stage *s = &c->plan->stages[n->stage];
        json_object_set_new(o, "stage", json_integer(n->stage));
        char text[96];
        const int R = coord_stage_replicas(c, n->stage);
        nl_plan_range_str(text, sizeof text, s->l0, s->l1, s->has_embed, s->has_head);
        if (R > 1) { /* DESIGN section 8: the stage runs on R nodes */
            const size_t used = strlen(text);
            snprintf(text + used, sizeof text - used, ", replica %d of %d", n->replica, R);
            json_object_set_new(o, "replica", json_integer(n->replica));
            json_object_set_new(o, "replicas", json_integer(R));
        }
        json_object_set_new(o, "layers", json_pack("[ii]", s->l0, s->l1));
        json_object_set_new(o, "layers_text", json_string(text));
        json_object_set_new(o, "embed", json_boolean(s->has_embed));
        json_object_set_new(o, "head", json_boolean(s->has_head));
        json_object_set_new(o, "memory_planned", json_integer((json_int_t)s->bytes));
        json_object_set_new(o, "predicted_s", json_real(coord_stage_request_s(c, n->stage)));
    }
    return o;
}

/* The cluster's status; full (every node's key and endpoint, every job)
 * when full is set (an admin), else what a client needs: the state, the
 * config, each node's device, memory and stage, its own jobs and how many
 * jobs others hold. */
static json_t *status_json(nl_coord *c, const nl_rx *rx, bool full)
{
    json_t *root = json_object(), *nodes = json_array();
    const double now = nl_mono_s();
    json_object_set_new(root, "state", json_string(c->state));
    json_object_set_new(root, "ready", json_boolean(c->ready));
    if (full)
        json_object_set_new(root, "endpoint", json_string(c->endpoint));
    json_object_set_new(root, "plan_epoch", json_integer((json_int_t)c->epoch));
    json_object_set_new(root, "tokens_generated", json_integer((json_int_t)c->tokens_generated));
    if (c->have_cfg) {
        char *cj = nl_config_to_json(&c->cfg);
        json_t *cfg = cj ? json_loads(cj, 0, NULL) : NULL;
        if (cfg)
            json_object_set_new(root, "config", cfg);
        free(cj);
    }
    if (c->plan) { /* per request; a plan made for training also has its microbatches' */
        json_object_set_new(root, "bottleneck_s", json_real(coord_plan_request_s(c)));
        if (c->plan_training)
            json_object_set_new(root, "train_bottleneck_s", json_real(c->plan->bottleneck));
    }
    if (c->plan && c->o.replicas != 1) { /* why the stages have replicas (or none) */
        json_t *counts = json_array();   /* R_s, stage by stage (per_stage: stage 0's) */
        for (int s = 0; s < c->plan->n_stages; s++)
            json_array_append_new(counts, json_integer(coord_stage_replicas(c, s)));
        json_object_set_new(root, "replicas",
                            json_pack("{s:i,s:o,s:s}", "per_stage", coord_stage_replicas(c, 0),
                                      "stages", counts, "why", c->plan_why));
    }
    /* the weights the stages hold: job 0 step 0 are the files they started from */
    json_object_set_new(root, "weights",
                        json_pack("{s:I,s:I}", "job", (json_int_t)c->weights_job, "step",
                                  (json_int_t)c->weights_step));
    for (int i = 0; i < c->n_nodes; i++)
        if (c->nodes[i].life != NODE_FREE)
            json_array_append_new(nodes, node_json(c, &c->nodes[i], full, now));
    json_object_set_new(root, "nodes", nodes);
    json_t *jobs = json_array();
    int others = 0;
    for (int i = 0; jobs && i < COORD_MAX_JOBS; i++) {
        const cjob *j = &c->jobs[i];
        if (j->phase == JOB_FREE)
            continue;
        if (!full && !(j->owner[0] && strcmp(j->owner, rx->peer) == 0)) {
            others++; /* another key's: neither its id nor its kind */
            continue;
        }
        json_array_append_new(jobs, json_pack("{s:I,s:s,s:s,s:b}", "id", (json_int_t)j->id, "kind",
                                              j->ops->name, "state",
                                              j->phase == JOB_WAITING ? "waiting" : "running",
                                              "followed", j->rid_len > 0));
    }
    if (!full)
        json_object_set_new(root, "jobs_of_others", json_integer(others));
    json_object_set_new(root, "jobs", jobs);
    if (c->growths > 0) { /* issue 16: the last growth, and how many */
        json_t *g = coord_growth_json(&c->last_growth);
        if (g)
            json_object_set_new(g, "count", json_integer(c->growths));
        json_object_set_new(root, "growth", g ? g : json_null());
    }
    /* the keys banned for computing wrong (authorized_keys), to every
     * client: a banned key admits nothing, and /api/events published it
     * (train_quarantine) as it was banned */
    json_object_set_new(root, "banned_keys", json_integer(c->n_bans));
    json_t *bans = json_array();
    for (int i = 0; bans && i < c->n_bans; i++)
        json_array_append_new(bans,
                              json_pack("{s:s,s:s}", "key", c->bans[i].key, "why", c->bans[i].why));
    json_object_set_new(root, "banned", bans ? bans : json_null());
    if (c->tok_text)
        json_object_set_new(root, "tokenizer", json_string(c->tok_text));
    if (c->chat_text)
        json_object_set_new(root, "chat_template", json_string(c->chat_text));
    return root;
}

/* A JOB_QUERY of one job: its key (from any connection: neuroctl train
 * --attach) follows it from now on; an admin sees its state, and follows
 * it only when no connection does (a job recovered from the journal), so a
 * job's reports go to the connection its key chose and to no other. Any
 * other key is told "no such job", as of one that does not exist. */
static void query_job(nl_coord *c, const nl_rx *rx, uint64_t id)
{
    cjob *j = coord_job_find(c, id);
    if (j && !coord_job_mine(c, j, rx))
        j = NULL;
    if (j && ((j->owner[0] && strcmp(j->owner, rx->peer) == 0) || j->rid_len == 0)) {
        memcpy(j->rid, rx->rid, rx->rid_len);
        j->rid_len = rx->rid_len;
    }
    status_reply(c, rx, id, j ? NL_JOB_RUNNING : NL_JOB_FAILED, j ? "running" : "no such job");
}

void coord_on_query(nl_coord *c, const nl_rx *rx)
{
    const uint64_t id = rx->msg.u.job_ref.job_id;
    nl_error e = {0};
    if (id != 0) {
        query_job(c, rx, id);
        return;
    }
    json_t *root = status_json(c, rx, (c->roles & NL_KEY_ROLE_ADMIN) != 0);
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
                                         c->ready ? "ready" : "not ready", 0};
    const int64_t len = (int64_t)strlen(text);
    nl_wire_frame_set(&m.frames[0], text, NL_DTYPE_U8, &len, 1);
    m.nframes = 1;
    coord_send_client(c, rx->rid, rx->rid_len, &m);
    nl_wire_msg_free(&m);
    free(text);
}
