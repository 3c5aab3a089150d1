/* The coordinator's jobs: forward (tokens in, logits out through the
 * pipeline), generate (a KV-cache session on every stage; the last samples
 * and feeds each token to the first itself, the coordinator relays it to
 * the client), status, cancel, and failure. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coord_impl.h"

void coord_status_to(nl_coord *c, const uint8_t *rid, size_t rid_len, uint64_t job, int state,
                     double progress, const char *msg, const char *json)
{
    nl_wire_msg m;
    nl_error e = {0};
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
    m.u.job_status = (nl_msg_job_status){job, (uint32_t)state, progress, msg};
    if (json) {
        const int64_t len = (int64_t)strlen(json);
        nl_wire_frame_set(&m.frames[0], json, NL_DTYPE_U8, &len, 1);
        m.nframes = 1;
    }
    if (nl_sock_send(c->ctl, rid, rid_len, &m, &e) != NL_OK)
        NL_WARN("JOB_STATUS to a client: %s", e.msg);
    nl_wire_msg_free(&m);
}

static void status_to(nl_coord *c, const uint8_t *rid, size_t rid_len, uint64_t job, int state,
                      double progress, const char *msg)
{
    coord_status_to(c, rid, rid_len, job, state, progress, msg, NULL);
}

static void status_reply(nl_coord *c, const nl_rx *rx, uint64_t job, int state, const char *msg)
{
    status_to(c, rx->rid, rx->rid_len, job, state, 0.0, msg);
}

cjob *coord_job_find(nl_coord *c, uint64_t id)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE && c->jobs[i].id == id)
            return &c->jobs[i];
    return NULL;
}

void coord_job_free(cjob *j)
{
    free(j->ids);
    coord_train_free(j);
    memset(j, 0, sizeof *j);
}

/* A free job slot for a client's request, or NULL (answered already). */
cjob *coord_job_new(nl_coord *c, const nl_rx *rx, int kind)
{
    cjob *j = NULL;
    for (int i = 0; i < COORD_MAX_JOBS && !j; i++)
        if (c->jobs[i].phase == JOB_FREE)
            j = &c->jobs[i];
    if (!j) {
        status_reply(c, rx, 0, NL_JOB_FAILED, "too many jobs at once; try again");
        return NULL;
    }
    memset(j, 0, sizeof *j);
    j->id = ++c->next_job;
    j->kind = kind;
    memcpy(j->rid, rx->rid, rx->rid_len);
    j->rid_len = rx->rid_len;
    j->epoch = c->epoch;
    j->last_progress = coord_now();
    return j;
}

/* Tell every stage to drop a generation session or end a training job. */
static void close_session(nl_coord *c, cjob *j)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (int s = 0; c->plan && j->epoch == c->epoch && s < c->plan->n_stages; s++) {
        cnode *n = coord_stage_node(c, s);
        if (!n)
            continue;
        nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
        m.u.job_ref.job_id = j->id;
        coord_send_node(c, n, &m);
    }
    nl_wire_msg_free(&m);
}

void coord_fail_job(nl_coord *c, cjob *j, const char *why)
{
    char text[1024];
    snprintf(text, sizeof text, "%s", why);
    if (j->kind == NL_JOB_TRAIN)
        coord_train_fail_note(j, text + strlen(text), sizeof text - strlen(text));
    NL_WARN("job %llu failed: %s", (unsigned long long)j->id, text);
    status_to(c, j->rid, j->rid_len, j->id, NL_JOB_FAILED, 0.0, text);
    if (j->kind == NL_JOB_GENERATE || j->kind == NL_JOB_TRAIN)
        close_session(c, j);
    if (j->kind == NL_JOB_TRAIN)
        coord_train_abandon(c, j);
    coord_job_free(j);
}

void coord_fail_jobs(nl_coord *c, const char *why)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE)
            coord_fail_job(c, &c->jobs[i], why);
}

void coord_check_jobs(nl_coord *c, double now)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        cjob *j = &c->jobs[i];
        if (j->phase != JOB_FREE && j->kind == NL_JOB_TRAIN)
            coord_train_tick(c, j);
        if (j->phase != JOB_FREE && (now - j->last_progress) * 1e3 > c->o.job_timeout_ms) {
            char why[128];
            snprintf(why, sizeof why, "no progress for %.0f s", now - j->last_progress);
            coord_fail_job(c, j, why);
        }
    }
}

/* Send ids (host, [B, T]) to the first stage as an ACTIVATION. */
static nl_status send_tokens(nl_coord *c, cjob *j, uint64_t session, uint64_t pos,
                             const int32_t *ids, int B, int T)
{
    cnode *first = coord_stage_node(c, 0);
    if (!first)
        return NL_ERR_STATE;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){j->id, 0, 0, session, pos, 0.0};
    const int64_t shape[2] = {B, T};
    nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, shape, 2); /* copied by the send */
    m.nframes = 1;
    nl_status st = coord_send_node(c, first, &m);
    nl_wire_msg_free(&m);
    return st;
}

static void unreachable_first(nl_coord *c, cjob *j)
{
    cnode *first = coord_stage_node(c, 0);
    char why[1000];
    snprintf(why, sizeof why, "node %u (stage 0, %s) %s", first ? first->id : 0,
             first ? first->endpoint : "?", first ? first->why : "is gone");
    coord_fail_job(c, j, why);
}

const nl_wire_param *coord_param(const nl_msg_job_submit *s, const char *key)
{
    for (uint32_t i = 0; i < s->nparams; i++)
        if (strcmp(s->params[i].key, key) == 0)
            return &s->params[i];
    return NULL;
}

/* Token ids of frame 0: I32 [B, T] within the vocabulary. */
static const char *check_tokens(const nl_coord *c, const nl_rx *rx, int *B, int *T)
{
    if (rx->msg.nframes != 1)
        return "a job needs one frame of token ids";
    const nl_tensor *t = &rx->msg.frames[0].t;
    if (t->dtype != NL_DTYPE_I32 || t->ndim != 2 || t->shape[0] < 1 || t->shape[1] < 1)
        return "token ids must be I32 [B, T]";
    if (t->shape[0] * t->shape[1] > COORD_MAX_TOKENS)
        return "too many tokens in one job";
    if (t->shape[1] > c->cfg.max_seq_len)
        return "more positions than max_seq_len";
    const int32_t *ids = t->data;
    for (int64_t i = 0; i < t->shape[0] * t->shape[1]; i++) {
        int32_t v;
        memcpy(&v, ids + i, sizeof v);
        if (v < 0 || v >= c->cfg.vocab_size)
            return "a token id is outside the model's vocabulary";
    }
    *B = (int)t->shape[0];
    *T = (int)t->shape[1];
    return NULL;
}

/* Open generation j's session on every stage of the plan. With limit, the
 * last stage feeds its tokens to the first itself (the token ring) and
 * this coordinator only relays them to the client; a resumed generation
 * (coord_feeds) is fed by the coordinator, which replays its tokens. */
static void open_session(nl_coord *c, cjob *j)
{
    j->phase = JOB_OPENING;
    j->epoch = c->epoch;
    j->acks = 0;
    j->seen = 0;
    j->last_progress = coord_now();
    nl_wire_param ps[6] = {
        {.key = "session", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)j->id},
        {.key = "capacity", .kind = NL_WIRE_PARAM_INT, .i = j->capacity},
        {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = j->temperature},
        {.key = "top_p", .kind = NL_WIRE_PARAM_FLOAT, .f = j->top_p},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = j->seed},
        {.key = "limit", .kind = NL_WIRE_PARAM_INT, .i = j->coord_feeds ? 0 : j->limit},
    };
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (int st = 0; st < c->plan->n_stages; st++) {
        nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
        m.u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, 6, ps};
        coord_send_node(c, coord_stage_node(c, st), &m);
    }
    nl_wire_msg_free(&m);
}

void coord_on_submit(nl_coord *c, const nl_rx *rx)
{
    const nl_msg_job_submit *s = &rx->msg.u.job_submit;
    char why[700];
    if (!c->ready && s->kind != NL_JOB_TRAIN) { /* a resumed training job loads first */
        snprintf(why, sizeof why, "the cluster is not ready: %s", c->state);
        status_reply(c, rx, 0, NL_JOB_FAILED, why);
        return;
    }
    if (s->kind == NL_JOB_TRAIN) {
        coord_train_submit(c, rx);
        return;
    }
    int B = 0, T = 0;
    const char *bad = check_tokens(c, rx, &B, &T);
    if (bad) {
        status_reply(c, rx, 0, NL_JOB_FAILED, bad);
        return;
    }
    cjob *j = coord_job_new(c, rx, (int)s->kind);
    if (!j)
        return;
    const int32_t *ids = rx->msg.frames[0].t.data;
    if (s->kind == NL_JOB_FORWARD) {
        j->phase = JOB_RUNNING;
        status_reply(c, rx, j->id, NL_JOB_RUNNING, "running");
        if (send_tokens(c, j, 0, 0, ids, B, T) != NL_OK)
            unreachable_first(c, j);
        return;
    }
    /* generate: open a session on every stage first */
    const nl_wire_param *p;
    j->max_new = (p = coord_param(s, "max_new")) && p->kind == NL_WIRE_PARAM_INT ? (int)p->i : 32;
    j->temperature =
        (p = coord_param(s, "temperature")) && p->kind == NL_WIRE_PARAM_FLOAT ? p->f : 0.8;
    j->top_p = (p = coord_param(s, "top_p")) && p->kind == NL_WIRE_PARAM_FLOAT ? p->f : 0.95;
    j->seed = (p = coord_param(s, "seed")) && p->kind == NL_WIRE_PARAM_INT ? p->i : 0;
    if (B != 1 || j->max_new < 1 || j->max_new > (1 << 20) || !(j->temperature >= 0) ||
        !(j->top_p > 0 && j->top_p <= 1) || j->seed < 0 || T >= c->cfg.max_seq_len) {
        coord_job_free(j);
        status_reply(c, rx, 0, NL_JOB_FAILED,
                     "generate needs one prompt [1, T] shorter than max_seq_len, max_new >= 1, "
                     "temperature >= 0, top_p in (0, 1], seed >= 0");
        return;
    }
    j->capacity = T + j->max_new < c->cfg.max_seq_len ? T + j->max_new : c->cfg.max_seq_len;
    /* as local generation: stop at max_new tokens or a full cache */
    j->limit = j->max_new < j->capacity - T + 1 ? j->max_new : j->capacity - T + 1;
    j->ids = malloc(((size_t)T + (size_t)j->limit) * sizeof *j->ids);
    if (!j->ids) {
        coord_job_free(j);
        status_reply(c, rx, 0, NL_JOB_FAILED, "out of memory");
        return;
    }
    memcpy(j->ids, ids, (size_t)T * sizeof *j->ids);
    j->prompt_len = T;
    status_reply(c, rx, j->id, NL_JOB_RUNNING, "opening a session on every stage");
    open_session(c, j);
}

/* JOB_STATUS from a node: a stage took a job (a session opened, training
 * began), or its work for one job failed, which fails that job only. */
void coord_on_node_status(nl_coord *c, const nl_rx *rx)
{
    const nl_msg_job_status *s = &rx->msg.u.job_status;
    const cnode *n = coord_node_by_rid(c, rx);
    nl_error e = {0};
    if (!n) {
        nl_sock_send_error(c->ctl, rx, NL_ERR_STATE, NL_MSG_JOB_STATUS,
                           "JOB_STATUS comes from nodes, not clients", &e);
        return;
    }
    cjob *j = coord_job_find(c, s->job_id);
    if (s->state == NL_JOB_FAILED && j && (j->phase == JOB_WAITING || n->stage < 0)) {
        NL_INFO("job %llu: node %u, no longer one of its stages, reports a failure: %s",
                (unsigned long long)s->job_id, n->id, s->message);
        return;
    }
    if (s->state == NL_JOB_FAILED) {
        char why[1200];
        snprintf(why, sizeof why, "node %u (stage %d): %s", n->id, n->stage, s->message);
        if (j)
            coord_fail_job(c, j, why);
        else
            NL_INFO("job %llu, already ended: %s", (unsigned long long)s->job_id, why);
        return;
    }
    if (j && j->kind == NL_JOB_TRAIN) {
        coord_train_on_ack(c, j, rx);
        return;
    }
    if (!j || j->phase != JOB_OPENING || j->epoch != c->epoch)
        return;
    j->last_progress = coord_now();
    if (++j->acks < c->plan->n_stages)
        return;
    j->phase = JOB_RUNNING;
    if (send_tokens(c, j, j->id, 0, j->ids, 1, j->prompt_len) != NL_OK)
        unreachable_first(c, j);
}

/* Whether rx came from the current plan's last stage (TOKEN and RESULT
 * are taken from it alone). */
static bool from_last_stage(nl_coord *c, const nl_rx *rx)
{
    const cnode *last = c->plan ? coord_stage_node(c, c->plan->n_stages - 1) : NULL;
    return last && last->rid_len == rx->rid_len && memcmp(last->rid, rx->rid, rx->rid_len) == 0;
}

void coord_on_token(nl_coord *c, const nl_rx *rx)
{
    const nl_msg_token *t = &rx->msg.u.token;
    cjob *j = coord_job_find(c, t->job_id);
    if (!j || j->phase != JOB_RUNNING || t->ntokens != 1 || !from_last_stage(c, rx))
        return;
    j->last_progress = coord_now();
    const int32_t tok = (int32_t)t->tokens[0];
    const int k = j->seen++; /* the session's token k (0-based) */
    if (k < j->produced) {   /* a resumed session replays what the client has */
        const int32_t had = j->ids[j->prompt_len + k];
        if (tok != had)
            NL_WARN("job %llu: the replay gave token %d at position %d, where %d was sent; going "
                    "on with %d",
                    (unsigned long long)j->id, tok, j->prompt_len + k, had, had);
        if (k + 1 == j->produced)
            NL_INFO("job %llu: replayed %d tokens; resumed", (unsigned long long)j->id, k + 1);
        if (send_tokens(c, j, j->id, (uint64_t)(j->prompt_len + k), &had, 1, 1) != NL_OK)
            unreachable_first(c, j);
        return;
    }
    j->ids[j->prompt_len + j->produced++] = tok;
    const int done = j->produced >= j->limit;
    nl_wire_msg m;
    nl_error e = {0};
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_TOKEN);
    m.u.token = (nl_msg_token){j->id, j->id, 1, t->tokens, done};
    if (nl_sock_send(c->ctl, j->rid, j->rid_len, &m, &e) != NL_OK)
        NL_WARN("TOKEN to the client of job %llu: %s", (unsigned long long)j->id, e.msg);
    nl_wire_msg_free(&m);
    if (done) { /* the last stage fed nothing more */
        close_session(c, j);
        coord_job_free(j);
    } else if (j->coord_feeds &&
               send_tokens(c, j, j->id, (uint64_t)(j->prompt_len + k), &tok, 1, 1) != NL_OK) {
        unreachable_first(c, j);
    }
}

void coord_jobs_stage_lost(nl_coord *c, const char *why)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        cjob *j = &c->jobs[i];
        if (j->phase == JOB_FREE || j->phase == JOB_WAITING)
            continue;
        char msg[900];
        if (j->kind != NL_JOB_GENERATE || j->resumes >= c->o.gen_resumes) {
            snprintf(msg, sizeof msg, "%s; the job failed", why);
            coord_fail_job(c, j, msg);
            continue;
        }
        j->resumes++;
        j->coord_feeds = 1;
        j->phase = JOB_WAITING;
        j->last_progress = coord_now();
        snprintf(msg, sizeof msg,
                 "%s; resuming at token %d once the cluster is planned again (resume %d of %d)",
                 why, j->produced + 1, j->resumes, c->o.gen_resumes);
        NL_WARN("job %llu: %s", (unsigned long long)j->id, msg);
        status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg);
    }
}

void coord_resume_jobs(nl_coord *c)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        cjob *j = &c->jobs[i];
        if (j->phase != JOB_WAITING)
            continue;
        NL_INFO("job %llu: reopening its session on plan %llu, to replay %d tokens",
                (unsigned long long)j->id, (unsigned long long)c->epoch, j->produced);
        open_session(c, j);
    }
}

void coord_fail_waiting(nl_coord *c, const char *why)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase == JOB_WAITING)
            coord_fail_job(c, &c->jobs[i], why);
}

void coord_on_result(nl_coord *c, const nl_rx *rx)
{
    cjob *j = coord_job_find(c, rx->msg.u.hop.job_id);
    if (!j || j->kind != NL_JOB_FORWARD || !from_last_stage(c, rx))
        return;
    nl_wire_msg m;
    nl_error e = {0};
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_RESULT);
    m.u.hop = rx->msg.u.hop;
    m.frames[0] = rx->msg.frames[0];
    m.frames[0].free_fn = NULL; /* copied by the send */
    m.nframes = 1;
    if (nl_sock_send(c->ctl, j->rid, j->rid_len, &m, &e) != NL_OK)
        NL_WARN("RESULT to the client of job %llu: %s", (unsigned long long)j->id, e.msg);
    nl_wire_msg_free(&m);
    status_to(c, j->rid, j->rid_len, j->id, NL_JOB_DONE, 1.0, "done");
    coord_job_free(j);
}

void coord_on_cancel(nl_coord *c, const nl_rx *rx)
{
    cjob *j = coord_job_find(c, rx->msg.u.job_ref.job_id);
    if (!j || j->rid_len != rx->rid_len || memcmp(j->rid, rx->rid, rx->rid_len) != 0) {
        status_reply(c, rx, rx->msg.u.job_ref.job_id, NL_JOB_FAILED, "no such job of yours");
        return;
    }
    if (j->kind == NL_JOB_GENERATE || j->kind == NL_JOB_TRAIN)
        close_session(c, j);
    if (j->kind == NL_JOB_TRAIN)
        coord_train_abandon(c, j);
    NL_INFO("job %llu cancelled by its client", (unsigned long long)j->id);
    status_reply(c, rx, j->id, NL_JOB_CANCELLED, "cancelled");
    coord_job_free(j);
}

/* ---------------------------------------------------------------- status */

static json_t *status_json(nl_coord *c)
{
    json_t *root = json_object(), *nodes = json_array();
    const double now = coord_now();
    json_object_set_new(root, "state", json_string(c->state));
    json_object_set_new(root, "ready", json_boolean(c->ready));
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
    for (int i = 0; i < COORD_MAX_NODES; i++) {
        const cnode *n = &c->nodes[i];
        if (n->life == NODE_FREE)
            continue;
        json_t *o = json_object();
        json_object_set_new(o, "id", json_integer(n->id));
        json_object_set_new(o, "key", json_string(n->key));
        json_object_set_new(o, "device", json_string(n->device));
        json_object_set_new(o, "memory", json_integer((json_int_t)n->memory));
        json_object_set_new(o, "gflops", json_real(n->gflops));
        json_object_set_new(o, "threads", json_integer(n->threads));
        json_object_set_new(o, "endpoint", json_string(n->endpoint));
        json_object_set_new(o, "heartbeat_age_s", json_real(now - n->last_seen));
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
        status_reply(c, rx, id, j ? NL_JOB_RUNNING : NL_JOB_FAILED, j ? "running" : "no such job");
        return;
    }
    json_t *root = status_json(c);
    char *text = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (!text) {
        nl_sock_send_error(c->ctl, rx, NL_ERR_NOMEM, NL_MSG_JOB_QUERY, "out of memory", &e);
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
    if (nl_sock_reply(c->ctl, rx, &m, &e) != NL_OK)
        NL_WARN("status reply: %s", e.msg);
    nl_wire_msg_free(&m);
    free(text);
}
