/* The generate job: a KV-cache session on every stage of the plan. The
 * last stage samples each token and feeds it to the first itself (the
 * token ring); the coordinator relays the tokens to the client. A
 * generation that loses a stage waits for the next plan and resumes there
 * (up to --gen-resumes times), the coordinator replaying its tokens.
 * params.adapter (optional): a LoRA adapter file under --checkpoint-root
 * that every stage applies to the session (node/stage_batch.c runs such a
 * session's hops alone, outside the batch). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "net/genparams.h"

#define GEN_SERVED_MAX 64       /* nodes a generation's record names (its plans' stages) */
#define GEN_DONE_KEPT 64        /* finished generations a conviction may name ... */
#define GEN_DONE_WINDOW_S 600.0 /* ... if they finished this recently */

/* A finished generation: its job and the nodes that served it. */
typedef struct gen_done_one {
    uint64_t job;
    double t_end;
    int n;
    uint32_t served[GEN_SERVED_MAX];
} gen_done_one;

struct cgen_done {
    gen_done_one e[GEN_DONE_KEPT];
    int next; /* the slot the next one takes (the oldest) */
};

typedef struct cgen {
    /* ids holds the prompt, then the tokens produced */
    int32_t *ids;
    int prompt_len, produced;
    int opening, acks;              /* the session is opening: stages that took it */
    uint8_t acked[COORD_MAX_NODES]; /* per stage: took it (each stage counts once) */
    /* a resumed generation: the coordinator feeds each token (the first
     * `produced` from ids, replaying), `seen` of this session's so far */
    int resumes, coord_feeds, seen;
    nl_genparams params; /* the client's, then the session's */
    /* params.adapter resolved under --checkpoint-root, or "" */
    char adapter[PATH_MAX];
    /* the nodes of the stages its sessions were opened on; convicted: one
     * of them was convicted of computing wrong, so its replay withdraws
     * the tokens from the first one the stages left do not give again */
    uint32_t served[GEN_SERVED_MAX];
    int n_served;
    uint32_t convicted;
} cgen;

/* Whether node `id` served a generation (n ids in served). */
static int served_by(const uint32_t *served, int n, uint32_t id)
{
    for (int i = 0; i < n; i++)
        if (served[i] == id)
            return 1;
    return 0;
}

/* The nodes of the plan's stages join g's (inference runs on replica 0). */
static void note_served(nl_coord *c, cgen *g)
{
    for (int st = 0; st < c->plan->n_stages; st++) {
        const cnode *n = coord_stage_node(c, st);
        if (n && !served_by(g->served, g->n_served, n->id) && g->n_served < GEN_SERVED_MAX)
            g->served[g->n_served++] = n->id;
    }
}

/* A finished generation into the record a conviction reads. */
static void note_done(nl_coord *c, const cjob *j)
{
    const cgen *g = j->state;
    if (!c->gen_done && !(c->gen_done = calloc(1, sizeof *c->gen_done)))
        return; /* out of memory: a later conviction cannot name it */
    gen_done_one *e = &c->gen_done->e[c->gen_done->next];
    c->gen_done->next = (c->gen_done->next + 1) % GEN_DONE_KEPT;
    e->job = j->id;
    e->t_end = nl_mono_s();
    e->n = g->n_served;
    memcpy(e->served, g->served, (size_t)g->n_served * sizeof *e->served);
}

void coord_generate_done_free(nl_coord *c)
{
    free(c->gen_done);
    c->gen_done = NULL;
}

/* Tell the client of g's re-run (JOB_STATUS running, a `rerun` report):
 * its tokens from `from` on are withdrawn (none: they stand). */
static void tell_rerun(nl_coord *c, cjob *j, int from, int withdrawn)
{
    const cgen *g = j->state;
    char msg[300];
    if (withdrawn)
        snprintf(msg, sizeof msg,
                 "node %u, which served this generation, was convicted of computing wrong: run "
                 "again without it, its tokens from %d on (%d) are withdrawn and the ones that "
                 "follow replace them",
                 g->convicted, from + 1, withdrawn);
    else
        snprintf(msg, sizeof msg,
                 "node %u, which served this generation, was convicted of computing wrong: run "
                 "again without it, its %d tokens stand",
                 g->convicted, from);
    NL_WARN("job %llu: %s", (unsigned long long)j->id, msg);
    json_t *o = json_pack("{s:s,s:I,s:i,s:i}", "event", "rerun", "node", (json_int_t)g->convicted,
                          "from", from, "withdrawn", withdrawn);
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg, text);
    free(text);
    json_decref(o);
}

static int generate_stage_lost(nl_coord *c, cjob *j, const char *why);

void coord_generate_convicted(nl_coord *c, const cnode *n, const char *why)
{
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        cjob *j = &c->jobs[i];
        cgen *g = j->phase != JOB_FREE && j->ops == &coord_generate_ops ? j->state : NULL;
        if (!g || !served_by(g->served, g->n_served, n->id))
            continue;
        /* the node is dropped at the next tick: the session takes no more
         * tokens and resumes on the next plan, whose replay judges the
         * tokens made so far. Its stages drop it now, and it goes on as a
         * job of a new id (its session's): the token ring, alive unlike a
         * dead node's, stops, and what it still has in flight (hops,
         * tokens, a stage's error) names a session and a job that are no
         * more, never the one opened again */
        const uint64_t was = j->id;
        g->convicted = n->id;
        if (j->phase == JOB_RUNNING) {
            coord_close_session(c, j);
            j->id = ++c->next_job;
        }
        NL_WARN("job %llu: node %u served this generation and was convicted (%s): it is run "
                "again without it as job %llu, its %d tokens checked as they are replayed",
                (unsigned long long)was, n->id, why, (unsigned long long)j->id, g->produced);
        if (j->phase == JOB_RUNNING &&
            !generate_stage_lost(c, j, "a node that served it was convicted of computing wrong"))
            coord_job_fail(c, j,
                           "a node that served it was convicted of computing wrong, and it "
                           "has no resume left (--gen-resumes)");
    }
    const double now = nl_mono_s();
    for (int i = 0; c->gen_done && i < GEN_DONE_KEPT; i++) {
        const gen_done_one *e = &c->gen_done->e[i];
        if (!e->job || now - e->t_end > GEN_DONE_WINDOW_S || !served_by(e->served, e->n, n->id))
            continue;
        NL_WARN("job %llu: a generation that finished %.0f s ago was served by node %u, since "
                "convicted of computing wrong (%s): its tokens may be wrong (submit it again for "
                "a result without that node)",
                (unsigned long long)e->job, now - e->t_end, n->id, why);
        if (c->observe) { /* /api/events: generation_suspect */
            json_t *o = json_pack("{s:s,s:I,s:I,s:s,s:f}", "event", "generation_suspect", "job",
                                  (json_int_t)e->job, "node", (json_int_t)n->id, "key", n->key,
                                  "finished_s_ago", now - e->t_end);
            char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
            if (text)
                c->observe(c->observe_ctx, e->job, NL_JOB_DONE, "suspect", text);
            free(text);
            json_decref(o);
        }
    }
}

/* Open the session on every stage of the plan. With limit, the last stage
 * feeds its tokens to the first itself (the token ring) and this
 * coordinator only relays them to the client; a resumed generation
 * (coord_feeds) is fed by the coordinator, which replays its tokens. */
static void open_session(nl_coord *c, cjob *j)
{
    cgen *g = j->state;
    j->phase = JOB_RUNNING;
    j->epoch = c->epoch;
    j->last_progress = nl_mono_s();
    g->opening = 1;
    g->acks = 0;
    memset(g->acked, 0, sizeof g->acked);
    g->seen = 0;
    if (!g->produced) /* nothing to judge again */
        g->convicted = 0;
    note_served(c, g);
    nl_genparams session = g->params;
    session.session = j->id;
    session.limit = g->coord_feeds ? 0 : g->params.limit;
    session.adapter = g->adapter[0] ? g->adapter : NULL;
    nl_wire_param ps[NL_GENPARAMS_SESSION_MAX];
    const uint32_t np = nl_genparams_session_wire(&session, ps);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (int st = 0; st < c->plan->n_stages; st++) {
        nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
        m.u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, np, ps};
        coord_send_node(c, coord_stage_node(c, st), &m);
    }
    nl_wire_msg_free(&m);
}

static void generate_submit(nl_coord *c, const nl_rx *rx)
{
    const nl_msg_job_submit *s = &rx->msg.u.job_submit;
    int B = 0, T = 0;
    const char *bad = coord_check_tokens(c, rx, &B, &T);
    if (bad) {
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, bad, NULL);
        return;
    }
    cjob *j = coord_job_new(c, rx, &coord_generate_ops);
    if (!j)
        return;
    cgen *g = j->state = calloc(1, sizeof *g);
    if (!g) {
        coord_job_free(j);
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, "out of memory", NULL);
        return;
    }
    nl_genparams *gp = &g->params;
    nl_error e = {0};
    const char *why = NULL, *off = NULL;
    char msg[700];
    if (nl_genparams_parse(gp, s->params, s->nparams, NL_GENPARAMS_REQUEST, &e) != NL_OK)
        why = e.msg;
    else if (B != 1 || T >= c->cfg.max_seq_len)
        why = "generate needs one prompt [1, T] shorter than max_seq_len";
    else if (gp->adapter && (off = coord_confine_file(c->ckpt_root, gp->adapter, NULL, 1ull << 34,
                                                      g->adapter, sizeof g->adapter)) != NULL) {
        /* a file the stages read: under the operator's checkpoint root */
        snprintf(msg, sizeof msg, "params.adapter: %s (the coordinator's --checkpoint-root)", off);
        why = msg;
    }
    gp->adapter = NULL; /* the request's, resolved into g->adapter */
    if (why) {
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, why, NULL);
        coord_job_free(j);
        return;
    }
    gp->capacity = T + gp->max_new < c->cfg.max_seq_len ? T + gp->max_new : c->cfg.max_seq_len;
    /* as local generation and the HTTP API: stop at max_new tokens or when
     * the prompt and the tokens made fill the context (T + limit <= max_seq_len) */
    gp->limit = gp->max_new < gp->capacity - T ? gp->max_new : gp->capacity - T;
    g->ids = malloc(((size_t)T + (size_t)gp->limit) * sizeof *g->ids);
    if (!g->ids) {
        coord_job_free(j);
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, "out of memory", NULL);
        return;
    }
    memcpy(g->ids, rx->msg.frames[0].t.data, (size_t)T * sizeof *g->ids);
    g->prompt_len = T;
    if (coord_adapter_check(c, j, g->adapter)) /* it goes on from generate_ready */
        return;
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0,
                    "opening a session on every stage", NULL);
    open_session(c, j);
}

/* A stage took the session; once all have (each counted once), the
 * prompt goes in. */
static void on_ack(nl_coord *c, cjob *j, const nl_rx *rx)
{
    cgen *g = j->state;
    const cnode *n = coord_node_by_rid(c, rx);
    if (!g->opening || j->phase != JOB_RUNNING || j->epoch != c->epoch || !n || n->stage < 0 ||
        n->stage >= COORD_MAX_NODES || g->acked[n->stage])
        return;
    g->acked[n->stage] = 1;
    j->last_progress = nl_mono_s();
    if (++g->acks < c->plan->n_stages)
        return;
    g->opening = 0;
    if (coord_send_tokens(c, j, j->id, 0, g->ids, 1, g->prompt_len) != NL_OK)
        coord_fail_unreachable_first(c, j);
}

/* A token from the last stage: replayed ones are checked and fed, new
 * ones go to the client. */
static void on_token(nl_coord *c, cjob *j, const nl_rx *rx)
{
    cgen *g = j->state;
    const nl_msg_token *t = &rx->msg.u.token;
    if (j->phase != JOB_RUNNING || g->opening || t->ntokens != 1 || !coord_from_last_stage(c, rx))
        return;
    if ((int64_t)t->tokens[0] >= (int64_t)c->cfg.vocab_size) {
        char why[160];
        snprintf(why, sizeof why, "the last stage sent token %u, outside the vocabulary (%lld)",
                 t->tokens[0], (long long)c->cfg.vocab_size);
        coord_job_fail(c, j, why);
        return;
    }
    j->last_progress = nl_mono_s();
    const int32_t tok = (int32_t)t->tokens[0];
    const int k = g->seen++; /* the session's token k (0-based) */
    if (k < g->produced && g->convicted && tok != g->ids[g->prompt_len + k]) {
        /* re-run without a convicted node: the stages left give another
         * token here, so this one and those after it are withdrawn */
        tell_rerun(c, j, k, g->produced - k);
        g->produced = k;
        g->convicted = 0;
    } else if (k < g->produced) { /* a resumed session replays what the client has */
        const int32_t had = g->ids[g->prompt_len + k];
        if (tok != had)
            NL_WARN("job %llu: the replay gave token %d at position %d, where %d was sent; going "
                    "on with %d",
                    (unsigned long long)j->id, tok, g->prompt_len + k, had, had);
        if (k + 1 == g->produced)
            NL_INFO("job %llu: replayed %d tokens; resumed", (unsigned long long)j->id, k + 1);
        if (k + 1 == g->produced && g->convicted) {
            tell_rerun(c, j, k + 1, 0);
            g->convicted = 0;
        }
        if (coord_send_tokens(c, j, j->id, (uint64_t)(g->prompt_len + k), &had, 1, 1) != NL_OK)
            coord_fail_unreachable_first(c, j);
        return;
    }
    g->ids[g->prompt_len + g->produced++] = tok;
    c->tokens_generated++;
    const int done = g->produced >= g->params.limit;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_TOKEN);
    m.u.token = (nl_msg_token){j->id, j->id, 1, t->tokens, done, 0, NULL};
    if (g->params.logprobs > 0 && rx->msg.nframes == 1 && /* relayed as they came (checked) */
        t->ntop == (uint32_t)g->params.logprobs - 1) {
        const nl_tensor *f = &rx->msg.frames[0].t;
        m.u.token.ntop = t->ntop;
        m.u.token.top_ids = t->top_ids;
        nl_wire_frame_set(&m.frames[0], f->data, NL_DTYPE_F32, f->shape, 1);
        m.nframes = 1;
    }
    coord_send_client(c, j->rid, j->rid_len, &m);
    nl_wire_msg_free(&m);
    if (done) { /* the last stage fed nothing more */
        note_done(c, j);
        coord_close_session(c, j);
        coord_job_free(j);
    } else if (g->coord_feeds &&
               coord_send_tokens(c, j, j->id, (uint64_t)(g->prompt_len + k), &tok, 1, 1) != NL_OK) {
        coord_fail_unreachable_first(c, j);
    }
}

static void generate_on_message(nl_coord *c, cjob *j, const nl_rx *rx)
{
    if (rx->msg.type == NL_MSG_JOB_STATUS)
        on_ack(c, j, rx);
    else if (rx->msg.type == NL_MSG_TOKEN)
        on_token(c, j, rx);
}

/* A stage is lost: wait for the next plan, resuming at the next token,
 * unless it has resumed --gen-resumes times already. */
static int generate_stage_lost(nl_coord *c, cjob *j, const char *why)
{
    cgen *g = j->state;
    if (j->phase == JOB_WAITING)
        return 1;
    if (g->resumes >= c->o.gen_resumes)
        return 0;
    g->resumes++;
    g->coord_feeds = 1;
    j->phase = JOB_WAITING;
    j->last_progress = nl_mono_s();
    char msg[900];
    snprintf(msg, sizeof msg,
             "%s; resuming at token %d once the cluster is planned again (resume %d of %d)", why,
             g->produced + 1, g->resumes, c->o.gen_resumes);
    NL_WARN("job %llu: %s", (unsigned long long)j->id, msg);
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg, NULL);
    return 1;
}

/* The plan is ready again, or (a new job) its adapter was checked. */
static void generate_ready(nl_coord *c, cjob *j)
{
    const cgen *g = j->state;
    if (g->coord_feeds)
        NL_INFO("job %llu: reopening its session on plan %llu, to replay %d tokens",
                (unsigned long long)j->id, (unsigned long long)c->epoch, g->produced);
    else
        coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0,
                        "opening a session on every stage", NULL);
    open_session(c, j);
}

static void generate_free(cjob *j)
{
    cgen *g = j->state;
    if (g)
        free(g->ids);
    free(g);
    j->state = NULL;
}

const cjob_ops coord_generate_ops = {
    .kind = NL_JOB_GENERATE,
    .name = "generate",
    .takes = COORD_TAKES(NL_MSG_TOKEN) | COORD_TAKES(NL_MSG_JOB_STATUS),
    .submit = generate_submit,
    .on_message = generate_on_message,
    .stage_lost = generate_stage_lost,
    .ready = generate_ready,
    .abort = coord_close_session,
    .free = generate_free,
};
