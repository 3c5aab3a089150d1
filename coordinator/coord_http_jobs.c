/* neurocoord --http, the /v1 work (coord_http.c has the client
 * connection, the status poller and the lifetime): each completion is a
 * generate job of its own on its own connection to the coordinator, its
 * tokens (and log-probabilities) relayed as they come; each embedding an
 * embed job. These are the nl_http_backend callbacks; libmicrohttpd's
 * connection threads run them. */
#include "coordinator/coord_http_impl.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/tokenizer.h"
#include "net/transport.h"

#define CANCEL_WAIT_S 2.0
#define TAKEN_WAIT_S 30.0 /* the coordinator answers a submit at once, unless it stalls */
#define EMBED_WAIT_S 60   /* an embedding's whole job */

typedef struct gen {
    nl_sock *s;
    uint64_t job;
    int32_t *ids;         /* (max_new) received */
    nl_http_logprob *lps; /* (max_new) their log-probabilities, when asked */
    int logprobs;         /* the request's k, or -1 */
    int n, max_new, consumed;
    int withdraw; /* -1, or the tokens that stand of those handed out (a rerun) */
    int done, failed, counted;
    int cancelled;    /* the coordinator confirmed our JOB_CANCEL */
    nl_status status; /* failed: NL_ERR_LIMIT when refused for want of room, NL_ERR_STATE
                         when the coordinator cannot be reached, else 0 */
    char why[NL_ERROR_MSG_MAX];
} gen;

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
    return nl_http_prompt_in_vocab(out, *P, V, err);
}

static void gen_free(gen *g)
{
    if (!g)
        return;
    nl_sock_destroy(&g->s);
    free(g->ids);
    free(g->lps);
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
    if (!ready && coord_http_open_client(h, &s, &e) == NL_OK &&
        (st = coord_http_query_status(s, &e)) != NULL)
        coord_http_take_status(h, st, 0);
    nl_sock_destroy(&s);
}

/* The adapter file of model k (0: the base, none). */
static const char *adapter_of(const nl_coord_http *h, int k)
{
    return k > 0 && k <= h->n_models ? h->adapters[k - 1] : NULL;
}

static void gen_take(gen *g, const nl_rx *rx);

/* The coordinator's first answer to g's submit: the job is made (its id),
 * or refused: for want of room (the key's --max-jobs-per-key) a 429, else
 * as the job's failure. */
static nl_status await_taken(gen *g, nl_error *err)
{
    nl_rx rx;
    nl_rx_init(&rx);
    const double by = nl_mono_s() + TAKEN_WAIT_S;
    while (!g->job && !g->failed && nl_mono_s() < by) {
        nl_status st = nl_sock_recv(g->s, &rx, 250, err);
        if (st == NL_OK)
            gen_take(g, &rx);
        else if (st == NL_ERR_IO) { /* the socket failed */
            char why[NL_ERROR_MSG_MAX];
            snprintf(why, sizeof why, "%s", err->msg);
            nl_rx_free(&rx);
            return nl_error_set(err, NL_ERR_STATE, "the coordinator cannot be reached: %s", why);
        }
    }
    nl_rx_free(&rx);
    if (g->failed)
        return nl_error_set(err, g->status ? g->status : NL_ERR_INTERNAL, "%s", g->why);
    if (!g->job)
        return nl_error_set(err, NL_ERR_STATE, "the coordinator did not take the job in %.0f s",
                            TAKEN_WAIT_S);
    nl_error_clear(err);
    return NL_OK;
}

nl_status coord_http_gen_start(void *ctx, const nl_http_completion *rq, void **jobp, int *ptoks,
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
    /* 0 (a chat that names no limit): to the context's end, within the
     * default's bound */
    const int left = ctxlen - P;
    const int max_new = rq->max_tokens > 0                ? rq->max_tokens
                        : left < NL_HTTP_CHAT_MAX_DEFAULT ? left
                                                          : NL_HTTP_CHAT_MAX_DEFAULT;
    if (rq->max_tokens > ctxlen - P) {
        st = nl_error_set(err, NL_ERR_RANGE,
                          "max_tokens: %d is more than the %d positions the context of %d "
                          "leaves after the prompt's %d tokens",
                          rq->max_tokens, ctxlen - P, ctxlen, P);
        goto out;
    }
    if (!(g = calloc(1, sizeof *g)) || !(g->ids = malloc((size_t)max_new * sizeof *g->ids)) ||
        (rq->logprobs >= 0 && !(g->lps = calloc((size_t)max_new, sizeof *g->lps)))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    g->max_new = max_new;
    g->logprobs = rq->logprobs;
    g->withdraw = -1;
    if ((st = coord_http_open_client(h, &g->s, err)) != NL_OK) {
        err->status = st = NL_ERR_STATE; /* 503: the cluster cannot be reached */
        goto out;
    }
    const char *adapter = adapter_of(h, rq->model);
    nl_wire_param ps[6] = {
        {.key = "max_new", .kind = NL_WIRE_PARAM_INT, .i = max_new},
        {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = rq->temperature},
        {.key = "top_p", .kind = NL_WIRE_PARAM_FLOAT, .f = rq->top_p},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)rq->seed},
    };
    uint32_t np = 4;
    if (adapter)
        ps[np++] =
            (nl_wire_param){.key = "adapter", .kind = NL_WIRE_PARAM_STR, .s = (char *)adapter};
    if (rq->logprobs >= 0) /* net/genparams.h: 1 + k */
        ps[np++] =
            (nl_wire_param){.key = "logprobs", .kind = NL_WIRE_PARAM_INT, .i = rq->logprobs + 1};
    st = nl_client_submit(g->s, NL_JOB_GENERATE, ps, (int)np, prompt, 1, P, err);
    if (st != NL_OK)
        goto out;
    if ((st = await_taken(g, err)) != NL_OK)
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

/* The generation was run again without a node convicted of computing
 * wrong (a `rerun` report, docs/security.md): its tokens from `from` on
 * are withdrawn. Those not handed out yet are dropped; if some were, the
 * server is told (NL_HTTP_WITHDRAW), which cuts a response being built
 * (or fails a stream that sent them). The corrected ones follow. */
static void gen_rerun(gen *g, const nl_rx *rx)
{
    if (rx->msg.nframes != 1 || rx->msg.frames[0].t.dtype != NL_DTYPE_U8)
        return;
    json_t *o = json_loadb(rx->msg.frames[0].t.data, rx->msg.frames[0].len, 0, NULL);
    const char *ev = json_string_value(json_object_get(o, "event"));
    const json_int_t from = json_integer_value(json_object_get(o, "from")),
                     withdrawn = json_integer_value(json_object_get(o, "withdrawn"));
    if (ev && strcmp(ev, "rerun") == 0 && withdrawn > 0 && from >= 0 && from < g->n) {
        if (from < g->consumed) { /* handed out: the server is told (NL_HTTP_WITHDRAW) */
            g->withdraw = (int)from;
            g->consumed = (int)from;
        }
        g->n = (int)from;
    }
    json_decref(o);
}

/* Take one message for g: a token, news of the job, or its end. */
static void gen_take(gen *g, const nl_rx *rx)
{
    if (rx->msg.type == NL_MSG_ERROR) {
        g->failed = 1;
        snprintf(g->why, sizeof g->why, "coordinator: %s", rx->msg.u.error.message);
    } else if (rx->msg.type == NL_MSG_JOB_STATUS) {
        const nl_msg_job_status *s = &rx->msg.u.job_status;
        if (s->state == NL_JOB_RUNNING && s->job_id) {
            g->job = s->job_id;
            gen_rerun(g, rx);
        } else if (s->state == NL_JOB_FAILED || s->state == NL_JOB_CANCELLED) {
            nl_error e = {0};
            nl_client_job_failed(rx, &e);
            g->failed = 1;
            g->cancelled = s->state == NL_JOB_CANCELLED;
            g->status = e.status == NL_ERR_LIMIT ? NL_ERR_LIMIT : 0;
            snprintf(g->why, sizeof g->why, "%s", e.msg);
        }
    } else if (rx->msg.type == NL_MSG_TOKEN) {
        const nl_msg_token *t = &rx->msg.u.token;
        g->job = t->job_id;
        if (g->lps && t->ntokens == 1 && g->n < g->max_new) {
            if (rx->msg.nframes != 1 || t->ntop != (uint32_t)g->logprobs) {
                g->failed = 1;
                snprintf(g->why, sizeof g->why, "a token came without its %d log-probabilities",
                         g->logprobs + 1);
                return;
            }
            nl_http_logprob *lp = &g->lps[g->n];
            float v[1 + NL_WIRE_MAX_TOP]; /* the frame's bytes need not be aligned */
            memcpy(v, rx->msg.frames[0].t.data, (t->ntop + 1) * sizeof *v);
            lp->logprob = v[0];
            lp->k = (int)t->ntop;
            for (uint32_t i = 0; i < t->ntop; i++) {
                lp->top_ids[i] = (int32_t)t->top_ids[i];
                lp->top[i] = v[1 + i];
            }
        }
        for (uint32_t i = 0; i < t->ntokens && g->n < g->max_new; i++)
            g->ids[g->n++] = (int32_t)t->tokens[i];
        if (t->done || g->n == g->max_new)
            g->done = 1;
    }
}

nl_http_next coord_http_gen_next(void *ctx, void *jp, int32_t *id, const char **text, size_t *len,
                                 nl_http_logprob *lp, int timeout_ms, nl_error *err)
{
    nl_coord_http *h = ctx;
    gen *g = jp;
    nl_rx rx;
    nl_rx_init(&rx);
    const double by = nl_mono_s() + timeout_ms / 1e3;
    *text = "";
    *len = 0;
    while (g->consumed == g->n && !g->done && !g->failed && g->withdraw < 0) {
        pthread_mutex_lock(&h->mu);
        const int stop = h->stop;
        pthread_mutex_unlock(&h->mu);
        const double left = by - nl_mono_s();
        if (stop) {
            g->failed = 1;
            g->status = NL_ERR_STATE; /* 503 */
            snprintf(g->why, sizeof g->why, "the coordinator is stopping");
            break;
        }
        if (left <= 0)
            break;
        nl_status st = nl_sock_recv(g->s, &rx, left > 0.25 ? 250 : (int)(left * 1e3) + 1, err);
        if (st == NL_OK) {
            gen_take(g, &rx);
        } else if (st == NL_ERR_IO) { /* the socket failed: no token will come */
            g->failed = 1;
            g->status = NL_ERR_STATE;
            snprintf(g->why, sizeof g->why, "the coordinator cannot be reached: %.400s", err->msg);
        }
    }
    nl_rx_free(&rx);
    if (g->withdraw >= 0) { /* a rerun withdrew tokens handed out: first that */
        *id = g->withdraw;
        g->withdraw = -1;
        return NL_HTTP_WITHDRAW;
    }
    if (g->consumed < g->n) {
        if (g->lps)
            *lp = g->lps[g->consumed];
        *id = g->ids[g->consumed++];
        pthread_mutex_lock(&h->mu);
        h->tokens++;
        nl_tokenizer *tok = h->tok;
        const int end = nl_chat_ends_answer(tok, h->turn_end, *id);
        pthread_mutex_unlock(&h->mu);
        if (end) /* the model's end token: the answer is over */
            return NL_HTTP_END;
        const uint8_t *p = NULL;
        size_t n = 0;
        if (tok && !nl_tokenizer_is_special(tok, *id) &&
            nl_tokenizer_token_bytes(tok, *id, &p, &n) == NL_OK) {
            *text = (const char *)p;
            *len = n;
        }
        return NL_HTTP_TOKEN;
    }
    if (g->failed) {
        nl_error_set(err, g->status ? g->status : NL_ERR_INTERNAL, "generation failed: %s", g->why);
        return NL_HTTP_FAILED;
    }
    return g->done ? NL_HTTP_DONE : NL_HTTP_WAIT;
}

/* The client is done with g: a generation still running is cancelled
 * (the coordinator tells every stage to drop its session and KV cache),
 * and its end awaited briefly so that the cancel is not lost. */
void coord_http_gen_end(void *ctx, void *jp)
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
        const double by = nl_mono_s() + CANCEL_WAIT_S;
        /* the coordinator names the job in its first answer */
        while (!g->job && !g->failed && nl_mono_s() < by)
            if (nl_sock_recv(g->s, &rx, 100, &e) == NL_OK)
                gen_take(g, &rx);
        if (g->job && !g->failed &&
            nl_client_send_ref(g->s, NL_MSG_JOB_CANCEL, g->job, &e) == NL_OK)
            while (!g->failed && nl_mono_s() < by)
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

/* A token's bytes, for logprobs' alternatives. */
size_t coord_http_token_bytes(void *ctx, int32_t id, char *buf, size_t cap)
{
    nl_coord_http *h = ctx;
    const uint8_t *p = NULL;
    size_t n = 0;
    pthread_mutex_lock(&h->mu);
    nl_tokenizer *tok = h->tok;
    pthread_mutex_unlock(&h->mu);
    if (!tok || nl_tokenizer_token_bytes(tok, id, &p, &n) != NL_OK)
        return 0;
    n = n < cap ? n : cap;
    memcpy(buf, p, n);
    return n;
}

/* The cluster's chat template (the same for its adapters). */
char *coord_http_chat_template(void *ctx, int model)
{
    nl_coord_http *h = ctx;
    (void)model;
    pthread_mutex_lock(&h->mu);
    char *s = h->chat ? strdup(h->chat) : NULL;
    pthread_mutex_unlock(&h->mu);
    return s;
}

/* An embed job's RESULT, F32 [1, d], taken into a copy. */
typedef struct embed_take {
    float *vec;
    int dim;
} embed_take;

static nl_status take_embedding(void *ctx, const nl_wire_msg *m, nl_error *err)
{
    embed_take *t = ctx;
    const nl_tensor *r = &m->frames[0].t;
    if (r->dtype != NL_DTYPE_F32 || r->ndim != 2 || r->shape[0] != 1 || r->shape[1] < 1)
        return nl_error_set(err, NL_ERR_INTERNAL, "a result of the wrong shape");
    if (!(t->vec = malloc(m->frames[0].len)))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    memcpy(t->vec, r->data, m->frames[0].len);
    t->dim = (int)r->shape[1];
    return NL_OK;
}

/* The wait's end as the HTTP side answers it: a lost connection is 503
 * (the cluster cannot be reached), a refusal for want of room 429, any
 * other failure of the job 500. */
static nl_status embed_failed(nl_status st, nl_error *err)
{
    char why[NL_ERROR_MSG_MAX];
    snprintf(why, sizeof why, "%s", err->msg);
    switch (st) {
    case NL_ERR_IO:
        return nl_error_set(err, NL_ERR_STATE, "embedding: the coordinator cannot be reached: %s",
                            why);
    case NL_ERR_TIMEOUT:
        return nl_error_set(err, NL_ERR_TIMEOUT, "embedding: no answer from the cluster in %d s",
                            EMBED_WAIT_S);
    case NL_ERR_LIMIT:
    case NL_ERR_INTERNAL:
    case NL_ERR_NOMEM:
        return nl_error_set(err, st, "embedding failed: %s", why);
    default:
        return nl_error_set(err, NL_ERR_INTERNAL, "embedding failed: %s", why);
    }
}

/* One input through the cluster's embed job (coord_embed.c): the last
 * stage pools; a RESULT F32 [1, d] comes back, awaited as every client's
 * (nl_client_await_result). */
nl_status coord_http_embed(void *ctx, int model, const char *text, size_t len, const int32_t *ids,
                           int n, float **vec, int *dim, int *tokens, nl_error *err)
{
    nl_coord_http *h = ctx;
    const nl_http_completion rq = {
        .prompt_text = ids ? NULL : text, .prompt_len = len, .prompt_ids = ids, .n_prompt_ids = n};
    int32_t *p = NULL;
    int P = 0;
    nl_sock *s = NULL;
    embed_take t = {0};
    *vec = NULL;
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
    if (st == NL_OK && (st = coord_http_open_client(h, &s, err)) != NL_OK)
        err->status = st = NL_ERR_STATE; /* 503: the cluster cannot be reached */
    if (st == NL_OK)
        st = nl_client_submit(s, NL_JOB_EMBED, ps, adapter ? 2 : 1, p, 1, P, err);
    if (st == NL_OK) {
        st = nl_client_await_result(s, nl_mono_s() + EMBED_WAIT_S, take_embedding, &t, err);
        if (st != NL_OK)
            st = embed_failed(st, err);
    }
    if (st == NL_OK) {
        *vec = t.vec;
        *dim = t.dim;
        *tokens = P;
    } else {
        free(t.vec);
    }
    nl_sock_destroy(&s);
    free(p);
    return st;
}
