/* neurocoord --http: an nl_http_backend that is a client of the
 * coordinator it runs beside (see coord_http.h).
 *
 * Threads: libmicrohttpd's connection threads run the completions, each
 * on its own DEALER socket; the poller thread owns one more socket for
 * the status; the coordinator's loop thread calls on_report. Everything
 * they share lives under h->mu. */
#include "coord_http.h"
#include "coord_http_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "core/tokenizer.h"
#include "net/transport.h"

#define HELLO_MS 5000
#define POLL_MS 500
#define CANCEL_WAIT_S 2.0

typedef struct gen {
    nl_sock *s;
    uint64_t job;
    int32_t *ids; /* (max_new) received */
    int n, max_new, consumed;
    int done, failed, counted;
    int cancelled; /* the coordinator confirmed our JOB_CANCEL */
    char why[NL_ERROR_MSG_MAX];
} gen;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---------------------------------------------------------------- client */

static nl_status open_client(nl_coord_http *h, nl_sock **out, nl_error *err)
{
    nl_sock_opts so = {.type = ZMQ_DEALER,
                       .keys = h->plaintext ? NULL : &h->kp,
                       .server_key = h->plaintext ? NULL : h->server_key,
                       .plaintext = h->plaintext,
                       .name = "http-client",
                       .linger_ms = 0,
                       .kind = NL_SOCK_CONTROL};
    nl_rx rx;
    nl_rx_init(&rx);
    nl_status st;
    if ((st = nl_sock_new(out, h->net, &so, err)) != NL_OK ||
        (st = nl_sock_connect(*out, h->endpoint, err)) != NL_OK ||
        (st = nl_sock_hello(*out, NL_ROLE_CLIENT, HELLO_MS, &rx, err)) != NL_OK) {
        nl_error_prefix(err, "coordinator %s", h->endpoint);
        nl_sock_destroy(out);
    }
    nl_rx_free(&rx);
    return st;
}

static nl_status send_ref(nl_sock *s, nl_msg_type type, uint64_t job, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, type);
    m.u.job_ref.job_id = job;
    nl_status st = nl_sock_send(s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    return st;
}

/* The status as JSON (the caller decrefs), or NULL. */
static json_t *query_status(nl_sock *s, nl_error *err)
{
    nl_rx rx;
    nl_rx_init(&rx);
    json_t *out = NULL;
    const double by = now_s() + 5.0;
    if (send_ref(s, NL_MSG_JOB_QUERY, 0, err) != NL_OK)
        return NULL;
    while (!out && now_s() < by) {
        nl_status st = nl_sock_recv(s, &rx, (int)((by - now_s()) * 1e3) + 1, err);
        if (st == NL_ERR_TIMEOUT)
            continue;
        if (st != NL_OK)
            break;
        if (rx.msg.type == NL_MSG_JOB_STATUS && rx.msg.u.job_status.job_id == 0 &&
            rx.msg.nframes == 1) {
            json_error_t je;
            out = json_loadb((const char *)rx.msg.frames[0].t.data, rx.msg.frames[0].len, 0, &je);
            if (!out)
                nl_error_set(err, NL_ERR_PROTO, "status: bad JSON: %s", je.text);
            break;
        }
    }
    nl_rx_free(&rx);
    return out;
}

/* ---------------------------------------------------------------- events */

static void publish(nl_coord_http *h, const char *type, json_t *o)
{
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (s && h->http)
        nl_http_publish(h->http, type, s);
    free(s);
}

const char *coord_http_node_state(json_t *n)
{
    const char *s = json_string_value(json_object_get(n, "state"));
    return s ? s : "?";
}

/* Compare a new status with what the last one showed: joins, deaths,
 * departures, state changes, a new plan. Poller thread only. */
static void diff_status(nl_coord_http *h, json_t *st)
{
    json_t *nodes = json_object_get(st, "nodes"), *n;
    size_t i;
    json_array_foreach(nodes, i, n)
    {
        int64_t id = json_integer_value(json_object_get(n, "id"));
        const char *state = coord_http_node_state(n);
        seen_node *s = NULL;
        for (int k = 0; k < h->nseen; k++)
            if (h->seen[k].id == id)
                s = &h->seen[k];
        if (!s && h->nseen < MAX_NODES) {
            s = &h->seen[h->nseen++];
            s->id = id;
            s->state[0] = '\0';
            char name[32];
            snprintf(name, sizeof name, "node-%lld", (long long)id);
            publish(h, "join",
                    json_pack("{s:s,s:I,s:O,s:O}", "node", name, "id", (json_int_t)id, "device",
                              json_object_get(n, "device"), "memory",
                              json_object_get(n, "memory")));
        }
        if (s && strcmp(s->state, state) != 0) {
            const char *type = strcmp(state, "dead") == 0   ? "death"
                               : strcmp(state, "left") == 0 ? "leave"
                                                            : "node";
            if (s->state[0] || strcmp(type, "node") != 0)
                publish(h, type,
                        json_pack("{s:I,s:s,s:s}", "id", (json_int_t)id, "state", state, "was",
                                  s->state[0] ? s->state : "new"));
            snprintf(s->state, sizeof s->state, "%s", state);
        }
    }
    int64_t epoch = json_integer_value(json_object_get(st, "plan_epoch"));
    if (epoch != h->epoch) {
        json_t *stages = json_array();
        json_array_foreach(nodes, i, n)
        {
            json_t *l = json_object_get(n, "layers");
            if (l)
                json_array_append_new(stages,
                                      json_pack("{s:O,s:O,s:O}", "id", json_object_get(n, "id"),
                                                "stage", json_object_get(n, "stage"), "layers", l));
        }
        publish(h, "plan", json_pack("{s:I,s:o}", "epoch", (json_int_t)epoch, "stages", stages));
        h->epoch = epoch;
    }
    const char *cs = json_string_value(json_object_get(st, "state"));
    if (cs && strcmp(cs, h->state) != 0) {
        publish(h, "cluster", json_pack("{s:s}", "state", cs));
        snprintf(h->state, sizeof h->state, "%s", cs);
    }
}

/* Keep the status (and the tokenizer, once); with diff (the poller's
 * thread only), say what changed. */
static void take_status(nl_coord_http *h, json_t *st, int diff)
{
    nl_tokenizer *tok = NULL;
    json_t *t = json_object_get(st, "tokenizer"), *cfg = json_object_get(st, "config");
    int64_t vocab = json_integer_value(json_object_get(cfg, "vocab_size"));
    pthread_mutex_lock(&h->mu);
    int need_tok = !h->tok;
    pthread_mutex_unlock(&h->mu);
    nl_error e = {0};
    if (need_tok && json_is_string(t) &&
        nl_tokenizer_load_buffer(&tok, json_string_value(t), json_string_length(t), &e) != NL_OK)
        NL_WARN("http: the cluster's tokenizer: %s", e.msg);
    else if (need_tok && !json_is_string(t) && vocab > 0 && vocab <= 256)
        nl_tokenizer_new_bytes(&tok, &e);
    json_object_del(st, "tokenizer");
    if (diff)
        diff_status(h, st);
    pthread_mutex_lock(&h->mu);
    json_decref(h->status);
    h->status = st;
    h->vocab = vocab;
    h->max_seq = (int)json_integer_value(json_object_get(cfg, "max_seq_len"));
    if (tok && !h->tok) {
        h->tok = tok;
        tok = NULL;
    }
    pthread_mutex_unlock(&h->mu);
    nl_tokenizer_destroy(&tok);
}

static void *poller_main(void *arg)
{
    nl_coord_http *h = arg;
    nl_sock *s = NULL;
    nl_error e = {0};
    double last_tick = now_s(), last_stats = 0.0;
    uint64_t last_tokens = 0;
    pthread_mutex_lock(&h->mu);
    while (!h->stop) {
        pthread_mutex_unlock(&h->mu);
        if (!s && open_client(h, &s, &e) != NL_OK)
            NL_WARN("http: status: %s", e.msg);
        json_t *st = s ? query_status(s, &e) : NULL;
        if (st)
            take_status(h, st, 1);
        else if (s) { /* the connection may be stale: open another next time */
            NL_WARN("http: status: %s", e.msg);
            nl_sock_destroy(&s);
        }
        pthread_mutex_lock(&h->mu);
        const double t = now_s();
        if (t - last_tick >= 1.0) {
            h->tps = (double)(h->tokens - last_tokens) / (t - last_tick);
            last_tokens = h->tokens;
            last_tick = t;
        }
        const int busy = h->active > 0 || h->tps > 0;
        if (t - last_stats >= (busy ? 1.0 : 10.0)) {
            json_t *o = json_pack("{s:f,s:i,s:I}", "tokens_per_s", h->tps, "active", h->active,
                                  "tokens", (json_int_t)h->tokens);
            pthread_mutex_unlock(&h->mu);
            publish(h, "stats", o);
            pthread_mutex_lock(&h->mu);
            last_stats = t;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += POLL_MS * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        if (!h->stop)
            pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    }
    pthread_mutex_unlock(&h->mu);
    nl_sock_destroy(&s);
    return NULL;
}

/* The coordinator's loop thread: a JOB_STATUS to some client. Training
 * reports become events and figures; the rest is not ours. */
static void on_report(void *ctx, uint64_t job, int state, const char *msg, const char *json)
{
    nl_coord_http *h = ctx;
    (void)state;
    (void)msg;
    json_t *o = json ? json_loads(json, 0, NULL) : NULL;
    const char *ev = json_string_value(json_object_get(o, "event"));
    if (!ev) {
        json_decref(o);
        return;
    }
    const int64_t step = json_integer_value(json_object_get(o, "step"));
    if (strcmp(ev, "step") == 0) {
        json_t *loss = json_object_get(o, "loss"), *eval = json_object_get(o, "eval_loss");
        pthread_mutex_lock(&h->mu);
        h->have_train = 1;
        h->train_step = step;
        h->train_loss = json_is_number(loss) ? json_number_value(loss) : NAN;
        h->train_tps = json_number_value(json_object_get(o, "tokens_per_s"));
        h->train_dig_mismatches = json_integer_value(json_object_get(o, "digest_mismatches"));
        h->train_verified = json_integer_value(json_object_get(o, "verified"));
        h->train_verify_mismatches = json_integer_value(json_object_get(o, "verify_mismatches"));
        if (json_is_number(eval))
            h->eval_loss = json_number_value(eval);
        pthread_mutex_unlock(&h->mu);
        publish(h, "train_step",
                json_pack("{s:I,s:I,s:O,s:O}", "job", (json_int_t)job, "step", (json_int_t)step,
                          "loss", loss ? loss : json_null(), "tokens_per_s",
                          json_object_get(o, "tokens_per_s")));
        if (json_is_number(eval))
            publish(h, "eval",
                    json_pack("{s:I,s:I,s:O}", "job", (json_int_t)job, "step", (json_int_t)step,
                              "loss", eval));
    } else {
        char type[64];
        snprintf(type, sizeof type, "train_%s", ev);
        json_object_set_new(o, "job", json_integer((json_int_t)job));
        publish(h, type, json_incref(o));
    }
    json_decref(o);
}

/* ---------------------------------------------------------------- completions */

/* The prompt as ids within the vocabulary, and the model's context. */
static nl_status prompt_ids(nl_coord_http *h, const nl_http_completion *rq, int32_t **out, int *P,
                            nl_error *err)
{
    pthread_mutex_lock(&h->mu);
    const int64_t V = h->vocab;
    nl_tokenizer *tok = h->tok;
    const int known = h->status != NULL;
    pthread_mutex_unlock(&h->mu);
    if (!known || V <= 0)
        return nl_error_set(err, NL_ERR_STATE, "the cluster's model is not known yet (%s)",
                            known ? "it is sized once nodes join" : "no status yet");
    if (rq->prompt_text) {
        if (!tok)
            return nl_error_set(err, NL_ERR_INVALID,
                                "prompt: the cluster's model has no tokenizer: give token ids");
        size_t n = 0;
        pthread_mutex_lock(&h->tok_mu);
        nl_status st = nl_tokenizer_encode(tok, rq->prompt_text, rq->prompt_len, out, &n, err);
        pthread_mutex_unlock(&h->tok_mu);
        if (st != NL_OK)
            return st;
        *P = (int)n;
    } else {
        *out = malloc(((size_t)rq->n_prompt_ids + 1) * sizeof **out);
        if (!*out)
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        memcpy(*out, rq->prompt_ids, (size_t)rq->n_prompt_ids * sizeof **out);
        *P = rq->n_prompt_ids;
    }
    for (int i = 0; i < *P; i++)
        if ((*out)[i] < 0 || (*out)[i] >= V) {
            free(*out);
            *out = NULL;
            return nl_error_set(err, NL_ERR_RANGE, "prompt: token %d at %d is outside 0..%lld", i,
                                i, (long long)V - 1);
        }
    return NL_OK;
}

static void gen_free(gen *g)
{
    if (!g)
        return;
    nl_sock_destroy(&g->s);
    free(g->ids);
    free(g);
}

/* The poller's status may be up to POLL_MS old: before a request is
 * refused as "not ready", ask the coordinator afresh. */
static void refresh_if_not_ready(nl_coord_http *h)
{
    pthread_mutex_lock(&h->mu);
    const int ready = json_is_true(json_object_get(h->status, "ready"));
    pthread_mutex_unlock(&h->mu);
    nl_sock *s = NULL;
    nl_error e = {0};
    json_t *st = NULL;
    if (!ready && open_client(h, &s, &e) == NL_OK && (st = query_status(s, &e)) != NULL)
        take_status(h, st, 0);
    nl_sock_destroy(&s);
}

/* The adapter file of model k (0: the base, none). */
static const char *adapter_of(const nl_coord_http *h, int k)
{
    return k > 0 && k <= h->n_models ? h->adapters[k - 1] : NULL;
}

static nl_status be_start(void *ctx, const nl_http_completion *rq, void **jobp, int *ptoks,
                          nl_error *err)
{
    nl_coord_http *h = ctx;
    int32_t *prompt = NULL;
    int P = 0;
    gen *g = NULL;
    refresh_if_not_ready(h);
    nl_status st = prompt_ids(h, rq, &prompt, &P, err);
    if (st != NL_OK)
        return st;
    pthread_mutex_lock(&h->mu);
    const int ctxlen = h->max_seq;
    const int ready = json_is_true(json_object_get(h->status, "ready"));
    const char *cs = json_string_value(json_object_get(h->status, "state"));
    char state[256];
    snprintf(state, sizeof state, "%s", cs ? cs : "unknown");
    pthread_mutex_unlock(&h->mu);
    if (!ready) { /* as the coordinator would answer the job, but as a 503 */
        st = nl_error_set(err, NL_ERR_STATE, "the cluster is not ready: %s", state);
        goto out;
    }
    if (P == 0) {
        st = nl_error_set(err, NL_ERR_INVALID, "prompt: no tokens");
        goto out;
    }
    if (P >= ctxlen) {
        st =
            nl_error_set(err, NL_ERR_RANGE,
                         "prompt: %d tokens leave no room in the model's context of %d", P, ctxlen);
        goto out;
    }
    if (rq->max_tokens > ctxlen - P) {
        st = nl_error_set(err, NL_ERR_RANGE,
                          "max_tokens: %d is more than the %d positions the context of %d "
                          "leaves after the prompt's %d tokens",
                          rq->max_tokens, ctxlen - P, ctxlen, P);
        goto out;
    }
    if (!(g = calloc(1, sizeof *g)) ||
        !(g->ids = malloc((size_t)rq->max_tokens * sizeof *g->ids))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    g->max_new = rq->max_tokens;
    if ((st = open_client(h, &g->s, err)) != NL_OK) {
        err->status = st = NL_ERR_STATE; /* 503: the cluster cannot be reached */
        goto out;
    }
    const char *adapter = adapter_of(h, rq->model);
    nl_wire_param ps[5] = {
        {.key = "max_new", .kind = NL_WIRE_PARAM_INT, .i = rq->max_tokens},
        {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = rq->temperature},
        {.key = "top_p", .kind = NL_WIRE_PARAM_FLOAT, .f = rq->top_p},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)rq->seed},
        {.key = "adapter", .kind = NL_WIRE_PARAM_STR, .s = (char *)adapter},
    };
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, adapter ? 5 : 4, ps};
    const int64_t shape[2] = {1, P};
    nl_wire_frame_set(&m.frames[0], prompt, NL_DTYPE_I32, shape, 2);
    m.nframes = 1;
    st = nl_sock_send(g->s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    if (st != NL_OK)
        goto out;
    pthread_mutex_lock(&h->mu);
    h->active++;
    h->prompt_tokens += (uint64_t)P;
    pthread_mutex_unlock(&h->mu);
    g->counted = 1;
    *ptoks = P;
    *jobp = g;
    g = NULL;
out:
    gen_free(g);
    free(prompt);
    return st;
}

/* Take one message for g: a token, news of the job, or its end. */
static void gen_take(gen *g, const nl_rx *rx)
{
    if (rx->msg.type == NL_MSG_ERROR) {
        g->failed = 1;
        snprintf(g->why, sizeof g->why, "coordinator: %s", rx->msg.u.error.message);
    } else if (rx->msg.type == NL_MSG_JOB_STATUS) {
        const nl_msg_job_status *s = &rx->msg.u.job_status;
        if (s->state == NL_JOB_RUNNING && s->job_id)
            g->job = s->job_id;
        else if (s->state == NL_JOB_FAILED || s->state == NL_JOB_CANCELLED) {
            g->failed = 1;
            g->cancelled = s->state == NL_JOB_CANCELLED;
            snprintf(g->why, sizeof g->why, "job %" PRIu64 " %s: %s", s->job_id,
                     s->state == NL_JOB_FAILED ? "failed" : "was cancelled", s->message);
        }
    } else if (rx->msg.type == NL_MSG_TOKEN) {
        const nl_msg_token *t = &rx->msg.u.token;
        g->job = t->job_id;
        for (uint32_t i = 0; i < t->ntokens && g->n < g->max_new; i++)
            g->ids[g->n++] = (int32_t)t->tokens[i];
        if (t->done || g->n == g->max_new)
            g->done = 1;
    }
}

static nl_http_next be_next(void *ctx, void *jp, int32_t *id, const char **text, size_t *len,
                            int timeout_ms, nl_error *err)
{
    nl_coord_http *h = ctx;
    gen *g = jp;
    nl_rx rx;
    nl_rx_init(&rx);
    const double by = now_s() + timeout_ms / 1e3;
    *text = "";
    *len = 0;
    while (g->consumed == g->n && !g->done && !g->failed) {
        pthread_mutex_lock(&h->mu);
        const int stop = h->stop;
        pthread_mutex_unlock(&h->mu);
        const double left = by - now_s();
        if (stop) {
            g->failed = 1;
            snprintf(g->why, sizeof g->why, "the coordinator is stopping");
            break;
        }
        if (left <= 0)
            break;
        nl_status st = nl_sock_recv(g->s, &rx, left > 0.25 ? 250 : (int)(left * 1e3) + 1, err);
        if (st == NL_OK)
            gen_take(g, &rx);
    }
    nl_rx_free(&rx);
    if (g->consumed < g->n) {
        *id = g->ids[g->consumed++];
        pthread_mutex_lock(&h->mu);
        h->tokens++;
        nl_tokenizer *tok = h->tok;
        pthread_mutex_unlock(&h->mu);
        const uint8_t *p = NULL;
        size_t n = 0;
        if (tok && !nl_tokenizer_is_special(*id) &&
            nl_tokenizer_token_bytes(tok, *id, &p, &n) == NL_OK) {
            *text = (const char *)p;
            *len = n;
        }
        return NL_HTTP_TOKEN;
    }
    if (g->failed) {
        nl_error_set(err, NL_ERR_INTERNAL, "generation failed: %s", g->why);
        return NL_HTTP_FAILED;
    }
    return g->done ? NL_HTTP_DONE : NL_HTTP_WAIT;
}

/* The client is done with g: a generation still running is cancelled
 * (the coordinator tells every stage to drop its session and KV cache),
 * and its end awaited briefly so that the cancel is not lost. */
static void be_end(void *ctx, void *jp)
{
    nl_coord_http *h = ctx;
    gen *g = jp;
    nl_rx rx;
    nl_rx_init(&rx);
    nl_error e = {0};
    /* what already came: the job may have ended meanwhile */
    while (!g->done && !g->failed && nl_sock_recv(g->s, &rx, 0, &e) == NL_OK)
        gen_take(g, &rx);
    if (!g->done && !g->failed) {
        const double by = now_s() + CANCEL_WAIT_S;
        /* the coordinator names the job in its first answer */
        while (!g->job && !g->failed && now_s() < by)
            if (nl_sock_recv(g->s, &rx, 100, &e) == NL_OK)
                gen_take(g, &rx);
        if (g->job && !g->failed && send_ref(g->s, NL_MSG_JOB_CANCEL, g->job, &e) == NL_OK)
            while (!g->failed && now_s() < by)
                if (nl_sock_recv(g->s, &rx, 100, &e) == NL_OK)
                    gen_take(g, &rx);
        if (g->cancelled)
            NL_INFO("http: job %" PRIu64 " cancelled: its client went away", g->job);
        else if (g->failed)
            NL_INFO("http: job %" PRIu64 " ended before its client went away: %s", g->job, g->why);
        else
            NL_WARN("http: job %" PRIu64 ": no answer to its cancel", g->job);
    }
    nl_rx_free(&rx);
    pthread_mutex_lock(&h->mu);
    if (g->counted)
        h->active--;
    h->finished++;
    h->cancelled += (uint64_t)g->cancelled;
    pthread_mutex_unlock(&h->mu);
    gen_free(g);
}

/* One input through the cluster's embed job (coord_embed.c): the last
 * stage pools; a RESULT F32 [1, d] comes back. */
static nl_status be_embed(void *ctx, int model, const char *text, size_t len, const int32_t *ids,
                          int n, float **vec, int *dim, int *tokens, nl_error *err)
{
    nl_coord_http *h = ctx;
    const nl_http_completion rq = {
        .prompt_text = ids ? NULL : text, .prompt_len = len, .prompt_ids = ids, .n_prompt_ids = n};
    int32_t *p = NULL;
    int P = 0;
    nl_sock *s = NULL;
    nl_rx rx;
    nl_rx_init(&rx);
    refresh_if_not_ready(h);
    nl_status st = prompt_ids(h, &rq, &p, &P, err);
    pthread_mutex_lock(&h->mu);
    const int ctxlen = h->max_seq;
    pthread_mutex_unlock(&h->mu);
    if (st == NL_OK && (P < 1 || P > ctxlen))
        st = nl_error_set(err, NL_ERR_RANGE, "%d tokens, outside 1..%d (the model's context)", P,
                          ctxlen);
    char lengths[24];
    snprintf(lengths, sizeof lengths, "%d", P);
    const char *adapter = adapter_of(h, model);
    const nl_wire_param ps[2] = {
        {.key = "lengths", .kind = NL_WIRE_PARAM_STR, .s = lengths},
        {.key = "adapter", .kind = NL_WIRE_PARAM_STR, .s = (char *)adapter}};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_EMBED, adapter ? 2 : 1, (nl_wire_param *)ps};
    const int64_t shape[2] = {1, P};
    nl_wire_frame_set(&m.frames[0], p, NL_DTYPE_I32, shape, 2);
    m.nframes = 1;
    if (st == NL_OK && (st = open_client(h, &s, err)) == NL_OK)
        st = nl_sock_send(s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    const double by = now_s() + 60.0;
    *vec = NULL;
    while (st == NL_OK && now_s() < by) {
        if (nl_sock_recv(s, &rx, 250, err) != NL_OK)
            continue;
        const nl_msg_job_status *js = &rx.msg.u.job_status;
        if (rx.msg.type == NL_MSG_JOB_STATUS && js->state >= NL_JOB_FAILED) {
            st = nl_error_set(err, NL_ERR_INTERNAL, "embedding failed: %s", js->message);
        } else if (rx.msg.type == NL_MSG_RESULT && rx.msg.nframes == 1 && !*vec) {
            const nl_tensor *t = &rx.msg.frames[0].t;
            if (t->dtype != NL_DTYPE_F32 || t->ndim != 2 || t->shape[0] != 1 || t->shape[1] < 1)
                st = nl_error_set(err, NL_ERR_INTERNAL, "embedding: a result of the wrong shape");
            else if (!(*vec = malloc(rx.msg.frames[0].len)))
                st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
            if (*vec) {
                memcpy(*vec, t->data, rx.msg.frames[0].len);
                *dim = (int)t->shape[1];
                *tokens = P;
            }
        } else if (rx.msg.type == NL_MSG_JOB_STATUS && js->state == NL_JOB_DONE && *vec) {
            break;
        }
    }
    if (st == NL_OK && !*vec)
        st = nl_error_set(err, NL_ERR_TIMEOUT, "embedding: no answer from the cluster in 60 s");
    if (st != NL_OK) {
        free(*vec);
        *vec = NULL;
    }
    nl_rx_free(&rx);
    nl_sock_destroy(&s);
    free(p);
    return st;
}

/* ---------------------------------------------------------------- start, stop */

/* The clients' endpoint as a client on this host reaches it. */
static void local_endpoint(char *out, size_t cap, const char *ep)
{
    const char *host = strstr(ep, "://");
    const char *colon = strrchr(ep, ':');
    host = host ? host + 3 : ep;
    if (colon && colon > host && (strncmp(host, "0.0.0.0:", 8) == 0 || strncmp(host, "*:", 2) == 0))
        snprintf(out, cap, "tcp://127.0.0.1%s", colon);
    else
        snprintf(out, cap, "%s", ep);
}

/* --http-adapter NAME=FILE[,NAME=FILE...]: each name unique and not the
 * base's, each file there (made absolute: the coordinator confines it to
 * its --checkpoint-root at each request, the nodes to theirs). */
static nl_status parse_adapters(nl_coord_http *h, const char *spec, nl_error *err)
{
    if (!spec || !*spec)
        return NL_OK;
    if (!(h->spec = strdup(spec)))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    char *save = NULL;
    for (char *item = strtok_r(h->spec, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq || eq == item || !eq[1])
            return nl_error_set(err, NL_ERR_INVALID, "--http-adapter: '%.200s' is not NAME=FILE",
                                item);
        *eq = '\0';
        if (h->n_models == MAX_ADAPTERS)
            return nl_error_set(err, NL_ERR_INVALID, "--http-adapter: more than %d adapters",
                                MAX_ADAPTERS);
        int dup = strcmp(item, h->name) == 0;
        for (int i = 0; i < h->n_models; i++)
            dup |= strcmp(item, h->models[i]) == 0;
        if (dup)
            return nl_error_set(err, NL_ERR_INVALID, "--http-adapter: the name '%.200s' is taken",
                                item);
        char *path = realpath(eq + 1, NULL);
        if (!path)
            return nl_error_set(err, NL_ERR_IO, "--http-adapter %s: %.300s: %s", item, eq + 1,
                                strerror(errno));
        h->models[h->n_models] = item;
        h->adapters[h->n_models++] = path;
    }
    return NL_OK;
}

nl_status nl_coord_http_start(nl_coord_http **out, nl_coord *c, const char *name,
                              const char *adapters, const char *state_dir, int plaintext,
                              const nl_http_opts *ho, nl_error *err)
{
    *out = NULL;
    nl_coord_http *h = calloc(1, sizeof *h);
    if (!h)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    h->coord = c;
    snprintf(h->name, sizeof h->name, "%s", name);
    h->plaintext = plaintext;
    h->eval_loss = NAN;
    h->epoch = -1;
    pthread_mutex_init(&h->mu, NULL);
    pthread_mutex_init(&h->tok_mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    local_endpoint(h->endpoint, sizeof h->endpoint, nl_coord_client_endpoint(c));
    nl_net_opts no = nl_net_opts_default();
    char path[4096];
    snprintf(path, sizeof path, "%s/coordinator.pub", state_dir);
    nl_status st;
    if ((st = parse_adapters(h, adapters, err)) != NL_OK)
        goto fail;
    if (!plaintext && ((st = nl_keys_load_public(h->server_key, path, err)) != NL_OK ||
                       (st = nl_keys_generate(&h->kp, err)) != NL_OK ||
                       (st = nl_coord_admit_key(c, h->kp.public_z85, err)) != NL_OK))
        goto fail;
    if ((st = nl_net_new(&h->net, &no, err)) != NL_OK)
        goto fail;
    nl_http_backend b = {.ctx = h,
                         .model_name = h->name,
                         .models = h->models,
                         .n_models = h->n_models,
                         .completion_start = be_start,
                         .completion_next = be_next,
                         .completion_end = be_end,
                         .embed = be_embed,
                         .status_json = coord_http_status,
                         .metrics_text = coord_http_metrics};
    if ((st = nl_http_start(&h->http, ho, &b, err)) != NL_OK)
        goto fail;
    nl_coord_observe(c, on_report, h);
    if (pthread_create(&h->poller, NULL, poller_main, h) != 0) {
        st = nl_error_set(err, NL_ERR_INTERNAL, "cannot start the status poller");
        goto fail;
    }
    h->poller_started = 1;
    *out = h;
    return NL_OK;
fail:
    nl_error_prefix(err, "--http");
    nl_coord_http_stop(&h);
    return st;
}

void nl_coord_http_stop(nl_coord_http **hp)
{
    nl_coord_http *h = *hp;
    if (!h)
        return;
    *hp = NULL;
    nl_coord_observe(h->coord, NULL, NULL);
    pthread_mutex_lock(&h->mu);
    h->stop = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    if (h->poller_started)
        pthread_join(h->poller, NULL);
    nl_http_stop(&h->http); /* waits for the connections, which end their jobs */
    nl_net_destroy(&h->net);
    nl_keys_wipe(&h->kp);
    json_decref(h->status);
    nl_tokenizer_destroy(&h->tok);
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->tok_mu);
    pthread_mutex_destroy(&h->mu);
    for (int i = 0; i < h->n_models; i++)
        free(h->adapters[i]);
    free(h->spec);
    free(h);
}

int nl_coord_http_port(const nl_coord_http *h)
{
    return nl_http_port(h->http);
}
