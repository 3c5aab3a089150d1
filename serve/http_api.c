/* The /v1 endpoints in the OpenAI shapes: every field of a request is
 * checked (400 naming the field), generation runs through the backend's
 * callbacks, answers come whole or as server-sent events, one chunk per
 * token, then `data: [DONE]`. Stop strings and UTF-8 are handled here so
 * that every backend behaves the same. */
#include "http_impl.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KEEPALIVE_MS 10000
#define MAX_STOP_LEN 256
#define MAX_EMBED_INPUTS 64

/* ---------------------------------------------------------------- UTF-8 */

/* Length of the valid UTF-8 sequence at s (n bytes available): > 0 valid,
 * 0 incomplete but possibly valid, -1 invalid. */
static int utf8_seq(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    int len = c < 0x80             ? 1
              : (c & 0xE0) == 0xC0 ? 2
              : (c & 0xF0) == 0xE0 ? 3
              : (c & 0xF8) == 0xF0 ? 4
                                   : -1;
    if (len < 0 || (len == 2 && c < 0xC2) || (len == 4 && c > 0xF4))
        return -1;
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n)
            return 0;
        if ((s[i] & 0xC0) != 0x80)
            return -1;
    }
    if (len == 3 && n >= 2) {
        unsigned c1 = s[1];
        if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 >= 0xA0))
            return -1;
    }
    if (len == 4 && n >= 2) {
        unsigned c1 = s[1];
        if ((c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 >= 0x90))
            return -1;
    }
    return len;
}

/* Valid UTF-8 from s[0..n) into out (room for 3n bytes), invalid bytes as
 * U+FFFD. Unless final, an incomplete sequence at the end is left; the
 * return value is how many input bytes were used. */
static size_t utf8_clean(const char *s, size_t n, int final, char *out, size_t *outlen)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, o = 0;
    while (i < n) {
        int l = utf8_seq(u + i, n - i);
        if (l == 0 && !final)
            break;
        if (l <= 0) {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
            continue;
        }
        memcpy(out + o, u + i, (size_t)l);
        o += (size_t)l;
        i += (size_t)l;
    }
    *outlen = o;
    return i;
}

static json_t *json_text(const char *s, size_t n, int final, size_t *used)
{
    char *out = malloc(3 * n + 1);
    if (!out)
        return NULL;
    size_t ol = 0;
    size_t u = utf8_clean(s, n, final, out, &ol);
    if (used)
        *used = u;
    json_t *j = json_stringn(out, ol);
    free(out);
    return j;
}

/* ---------------------------------------------------------------- fields */

typedef struct field_err {
    char param[48];
    char msg[300];
} field_err;

static int bad(field_err *fe, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad(field_err *fe, const char *param, const char *fmt, ...)
{
    snprintf(fe->param, sizeof fe->param, "%s", param);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fe->msg, sizeof fe->msg, fmt, ap);
    va_end(ap);
    return -1;
}

static int get_int(json_t *o, const char *k, long long lo, long long hi, long long *v,
                   field_err *fe)
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j))
        return 0;
    if (!json_is_integer(j))
        return bad(fe, k, "%s: expected an integer", k);
    long long x = json_integer_value(j);
    if (x < lo || x > hi)
        return bad(fe, k, "%s: %lld is outside %lld..%lld", k, x, lo, hi);
    *v = x;
    return 0;
}

static int get_num(json_t *o, const char *k, double lo, double hi, int lo_open, double *v,
                   field_err *fe)
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j))
        return 0;
    if (!json_is_number(j))
        return bad(fe, k, "%s: expected a number", k);
    double x = json_number_value(j);
    if (!(x <= hi) || (lo_open ? !(x > lo) : !(x >= lo)))
        return bad(fe, k, "%s: %g is outside %s%g, %g]", k, x, lo_open ? "(" : "[", lo, hi);
    *v = x;
    return 0;
}

/* Fields OpenAI clients send that this server accepts at their no-op value. */
static int ignorable(const char *k, json_t *v)
{
    if (strcmp(k, "model") == 0 || strcmp(k, "user") == 0)
        return json_is_string(v) || json_is_null(v);
    if (strcmp(k, "n") == 0 || strcmp(k, "best_of") == 0)
        return json_is_null(v) || (json_is_integer(v) && json_integer_value(v) == 1);
    if (strcmp(k, "logprobs") == 0 || strcmp(k, "suffix") == 0 || strcmp(k, "logit_bias") == 0)
        return json_is_null(v);
    if (strcmp(k, "echo") == 0)
        return json_is_null(v) || json_is_false(v);
    if (strcmp(k, "presence_penalty") == 0 || strcmp(k, "frequency_penalty") == 0)
        return json_is_null(v) || (json_is_number(v) && json_number_value(v) == 0.0);
    if (strcmp(k, "stream_options") == 0)
        return json_is_null(v) || json_is_object(v);
    return 0;
}

/* Token ids from a JSON array (every element an id in 0..2^31-1). */
static int get_ids(json_t *a, const char *param, int32_t **ids, int *n, field_err *fe)
{
    size_t len = json_array_size(a);
    if (len == 0)
        return bad(fe, param, "%s: empty", param);
    *ids = malloc(len * sizeof **ids);
    if (!*ids)
        return bad(fe, param, "%s: out of memory", param);
    for (size_t i = 0; i < len; i++) {
        json_t *e = json_array_get(a, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > INT32_MAX)
            return bad(fe, param, "%s[%zu]: expected a token id (an integer >= 0)", param, i);
        (*ids)[i] = (int32_t)json_integer_value(e);
    }
    *n = (int)len;
    return 0;
}

/* The request's "model": 0 the backend's model_name, k its models[k - 1];
 * -1 (fe set) when the backend serves several and names none of them. */
static int pick_model(const nl_http *h, json_t *o, field_err *fe)
{
    json_t *j = json_object_get(o, "model");
    const char *name = json_is_string(j) ? json_string_value(j) : NULL;
    if (!name || h->be.n_models == 0 || strcmp(name, h->be.model_name) == 0)
        return 0;
    for (int i = 0; i < h->be.n_models; i++)
        if (strcmp(name, h->be.models[i]) == 0)
            return i + 1;
    bad(fe, "model", "model: '%.200s' is not served here (GET /v1/models lists the %d models)",
        name, h->be.n_models + 1);
    return -1;
}

static const char *model_name(const nl_http *h, int model)
{
    return model > 0 && model <= h->be.n_models ? h->be.models[model - 1] : h->be.model_name;
}

typedef struct comp_req {
    nl_http_completion c;
    int32_t *ids;
    const char *stops[NL_HTTP_MAX_STOP];
    int n_stop;
} comp_req;

static int parse_completion(json_t *o, comp_req *r, field_err *fe)
{
    static const char *known[] = {"prompt", "max_tokens", "temperature", "top_p",
                                  "seed",   "stop",       "stream"};
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v)
    {
        int ok = 0;
        for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
            ok |= strcmp(k, known[i]) == 0;
        if (!ok && !ignorable(k, v))
            return bad(fe, k, "%s: not a field this server takes (or not at its default)", k);
    }
    nl_http_completion *c = &r->c;
    long long max_tokens = 16, seed = 0;
    c->temperature = 1.0;
    c->top_p = 1.0;
    json_t *p = json_object_get(o, "prompt");
    if (!p)
        return bad(fe, "prompt", "prompt: required");
    if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0)))
        p = json_array_get(p, 0); /* ["text"]: one prompt */
    if (json_is_string(p)) {
        c->prompt_text = json_string_value(p);
        c->prompt_len = json_string_length(p);
        if (c->prompt_len == 0)
            return bad(fe, "prompt", "prompt: empty");
    } else if (json_is_array(p)) {
        if (get_ids(p, "prompt", &r->ids, &c->n_prompt_ids, fe))
            return -1;
        c->prompt_ids = r->ids;
    } else {
        return bad(fe, "prompt", "prompt: expected a string or an array of token ids");
    }
    if (get_int(o, "max_tokens", 1, INT32_MAX, &max_tokens, fe) ||
        get_int(o, "seed", 0, INT64_MAX, &seed, fe) ||
        get_num(o, "temperature", 0.0, 100.0, 0, &c->temperature, fe) ||
        get_num(o, "top_p", 0.0, 1.0, 1, &c->top_p, fe))
        return -1;
    c->max_tokens = (int)max_tokens;
    c->seed = (uint64_t)seed;
    json_t *s = json_object_get(o, "stream");
    if (s && !json_is_null(s) && !json_is_boolean(s))
        return bad(fe, "stream", "stream: expected true or false");
    c->stream = s && json_is_true(s);
    json_t *st = json_object_get(o, "stop");
    if (st && !json_is_null(st)) {
        if (json_is_string(st)) {
            r->stops[r->n_stop++] = json_string_value(st);
        } else if (json_is_array(st) && json_array_size(st) <= NL_HTTP_MAX_STOP) {
            for (size_t i = 0; i < json_array_size(st); i++) {
                json_t *e = json_array_get(st, i);
                if (!json_is_string(e))
                    return bad(fe, "stop", "stop[%zu]: expected a string", i);
                r->stops[r->n_stop++] = json_string_value(e);
            }
        } else {
            return bad(fe, "stop", "stop: expected a string or up to %d strings", NL_HTTP_MAX_STOP);
        }
        for (int i = 0; i < r->n_stop; i++)
            if (strlen(r->stops[i]) == 0 || strlen(r->stops[i]) > MAX_STOP_LEN)
                return bad(fe, "stop", "stop: each string must have 1..%d bytes", MAX_STOP_LEN);
    }
    return 0;
}

/* The body as a JSON object, or a 400 naming what is wrong. */
static json_t *parse_body(http_req *rq, field_err *fe)
{
    json_error_t je;
    if (!rq->body || rq->len == 0) {
        bad(fe, "", "the request has no body: expected a JSON object");
        return NULL;
    }
    json_t *j = json_loadb(rq->body, rq->len, JSON_REJECT_DUPLICATES, &je);
    if (!j) {
        bad(fe, "", "malformed JSON at line %d, column %d: %s", je.line, je.column, je.text);
        return NULL;
    }
    if (!json_is_object(j)) {
        json_decref(j);
        bad(fe, "", "expected a JSON object");
        return NULL;
    }
    return j;
}

/* ---------------------------------------------------------------- generation */

typedef struct gen_state {
    nl_http *h;
    void *job;
    const char *model; /* the name answers carry */
    char id[40];
    long long created;
    int stream;
    int prompt_tokens, completion_tokens;
    char *stops[NL_HTTP_MAX_STOP];
    int n_stop;
    size_t max_stop;
    char *text; /* generated bytes, cut at a stop string */
    size_t tlen, tcap, sent;
    int32_t *ids;
    int nids, idcap;
    int done, closed;   /* generation over; stream fully formatted */
    const char *finish; /* "length", "stop", "error" */
    nl_error err;
    char *pend; /* stream bytes not yet handed to the socket */
    size_t plen, poff, pcap;
    int waited_ms;
} gen_state;

static void gen_end_job(gen_state *g)
{
    if (g->job) {
        g->h->be.completion_end(g->h->be.ctx, g->job);
        g->job = NULL;
    }
}

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* The earliest stop string that starts at or after `from`: its offset,
 * or -1. */
static long find_stop(const gen_state *g, size_t from)
{
    long best = -1;
    for (int i = 0; i < g->n_stop; i++) {
        size_t sl = strlen(g->stops[i]);
        for (size_t o = from; o + sl <= g->tlen; o++)
            if (memcmp(g->text + o, g->stops[i], sl) == 0) {
                if (best < 0 || (long)o < best)
                    best = (long)o;
                break;
            }
    }
    return best;
}

/* One step: 1 a token, 0 nothing yet, -1 the generation is over. */
static int gen_step(gen_state *g, int timeout_ms)
{
    if (g->done)
        return -1;
    int32_t id = 0;
    const char *t = NULL;
    size_t n = 0;
    nl_http_next r =
        g->h->be.completion_next(g->h->be.ctx, g->job, &id, &t, &n, timeout_ms, &g->err);
    if (r == NL_HTTP_WAIT)
        return 0;
    if (r != NL_HTTP_TOKEN) {
        g->done = 1;
        g->finish = r == NL_HTTP_DONE ? "length" : "error";
        gen_end_job(g);
        return -1;
    }
    size_t icap = (size_t)g->idcap;
    if (grow((void **)&g->ids, &icap, (size_t)g->nids + 1, sizeof *g->ids) ||
        grow((void **)&g->text, &g->tcap, g->tlen + n + 1, 1)) {
        nl_error_set(&g->err, NL_ERR_NOMEM, "out of memory");
        g->done = 1;
        g->finish = "error";
        gen_end_job(g);
        return -1;
    }
    g->idcap = (int)icap;
    g->ids[g->nids++] = id;
    g->completion_tokens++;
    size_t old = g->tlen;
    memcpy(g->text + g->tlen, t, n);
    g->tlen += n;
    if (g->n_stop) {
        size_t from = old + 1 > g->max_stop ? old + 1 - g->max_stop : 0;
        long at = find_stop(g, from);
        if (at >= 0) {
            g->tlen = (size_t)at;
            if (g->sent > g->tlen)
                g->sent = g->tlen;
            g->done = 1;
            g->finish = "stop";
            gen_end_job(g); /* cancels the rest of the generation */
        }
    }
    return 1;
}

static json_t *usage_json(const gen_state *g)
{
    return json_pack("{s:i, s:i, s:i}", "prompt_tokens", g->prompt_tokens, "completion_tokens",
                     g->completion_tokens, "total_tokens", g->prompt_tokens + g->completion_tokens);
}

static json_t *ids_json(const int32_t *ids, int n)
{
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++)
        json_array_append_new(a, json_integer(ids[i]));
    return a;
}

static void gen_publish(gen_state *g, const char *finish)
{
    char ev[256];
    snprintf(ev, sizeof ev,
             "{\"endpoint\":\"/v1/completions\",\"id\":\"%s\",\"stream\":%s,\"prompt_tokens\":%d,"
             "\"completion_tokens\":%d,\"finish_reason\":\"%s\"}",
             g->id, g->stream ? "true" : "false", g->prompt_tokens, g->completion_tokens, finish);
    nl_http_publish(g->h, "request", ev);
}

static void gen_free(void *cls)
{
    gen_state *g = cls;
    gen_publish(g, g->done ? g->finish : "cancelled");
    gen_end_job(g);
    for (int i = 0; i < g->n_stop; i++)
        free(g->stops[i]);
    free(g->text);
    free(g->ids);
    free(g->pend);
    free(g);
}

/* Append one SSE data line to the pending stream bytes. */
static int pend_add(gen_state *g, const char *s, size_t n)
{
    if (grow((void **)&g->pend, &g->pcap, g->plen + n, 1))
        return -1;
    memcpy(g->pend + g->plen, s, n);
    g->plen += n;
    return 0;
}

static int pend_chunk(gen_state *g, json_t *text, json_t *ids, const char *finish, int usage)
{
    json_t *ch = json_pack("{s:i, s:o, s:o, s:s?}", "index", 0, "text", text, "token_ids", ids,
                           "finish_reason", finish);
    if (ch && !finish)
        json_object_set_new(ch, "finish_reason", json_null());
    json_t *j = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", g->id, "object", "text_completion",
                          "created", g->created, "model", g->model, "choices", ch);
    if (j && usage)
        json_object_set_new(j, "usage", usage_json(g));
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    int rc = !s || pend_add(g, "data: ", 6) || pend_add(g, s, strlen(s)) || pend_add(g, "\n\n", 2);
    free(s);
    return rc ? -1 : 0;
}

static ssize_t gen_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    gen_state *g = cls;
    while (g->poff == g->plen) {
        if (g->closed || http_stopping(g->h))
            return g->closed ? MHD_CONTENT_READER_END_OF_STREAM : MHD_CONTENT_READER_END_WITH_ERROR;
        g->plen = g->poff = 0;
        int32_t before = g->nids;
        int r = gen_step(g, 1000);
        if (r == 0) {
            g->waited_ms += 1000;
            if (g->waited_ms >= KEEPALIVE_MS) {
                g->waited_ms = 0;
                if (pend_add(g, ": keep-alive\n\n", 14))
                    return MHD_CONTENT_READER_END_WITH_ERROR;
            }
            continue;
        }
        g->waited_ms = 0;
        size_t used = 0;
        int rc = 0;
        if (r == 1 || g->nids > before) { /* the token's chunk (text up to a stop) */
            json_t *t = json_text(g->text + g->sent, g->tlen - g->sent, 0, &used);
            g->sent += used;
            rc |= pend_chunk(g, t, ids_json(&g->ids[before], g->nids - before), NULL, 0);
        }
        if (g->done) {
            if (g->finish && strcmp(g->finish, "error") == 0) {
                json_t *e = json_pack("{s:{s:s, s:s}}", "error", "message", g->err.msg, "type",
                                      "server_error");
                char *s = e ? json_dumps(e, JSON_COMPACT) : NULL;
                json_decref(e);
                rc |= !s || pend_add(g, "data: ", 6) || pend_add(g, s, strlen(s)) ||
                      pend_add(g, "\n\n", 2);
                free(s);
            }
            json_t *t = json_text(g->text + g->sent, g->tlen - g->sent, 1, &used);
            g->sent += used;
            rc |= pend_chunk(g, t, json_array(), g->finish, 1);
            rc |= pend_add(g, "data: [DONE]\n\n", 14);
            g->closed = 1;
        }
        if (rc)
            return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    size_t n = g->plen - g->poff < max ? g->plen - g->poff : max;
    memcpy(buf, g->pend + g->poff, n);
    g->poff += n;
    return (ssize_t)n;
}

enum MHD_Result http_completions(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    field_err fe = {{0}, {0}};
    comp_req r;
    memset(&r, 0, sizeof r);
    json_t *body = parse_body(rq, &fe);
    gen_state *g = NULL;
    enum MHD_Result res;
    if (!body || parse_completion(body, &r, &fe)) {
        res = http_error(h, c, rq, 400, fe.param[0] ? fe.param : NULL, "%s", fe.msg);
        goto out;
    }
    if ((r.c.model = pick_model(h, body, &fe)) < 0) {
        res = http_error(h, c, rq, 404, "model", "%s", fe.msg);
        goto out;
    }
    if (!(g = calloc(1, sizeof *g))) {
        res = http_error(h, c, rq, 500, NULL, "out of memory");
        goto out;
    }
    g->h = h;
    g->model = model_name(h, r.c.model);
    g->stream = r.c.stream;
    g->created = (long long)time(NULL);
    pthread_mutex_lock(&h->mu);
    snprintf(g->id, sizeof g->id, "cmpl-%" PRIu64, ++h->created_id);
    pthread_mutex_unlock(&h->mu);
    for (int i = 0; i < r.n_stop; i++) {
        g->stops[g->n_stop++] = strdup(r.stops[i]);
        size_t l = strlen(r.stops[i]);
        g->max_stop = l > g->max_stop ? l : g->max_stop;
    }
    nl_error err = {0};
    nl_status st = h->be.completion_start(h->be.ctx, &r.c, &g->job, &g->prompt_tokens, &err);
    if (st != NL_OK) {
        int code = http_code_of(st);
        const char *param = strncmp(err.msg, "max_tokens", 10) == 0 ? "max_tokens"
                            : strncmp(err.msg, "prompt", 6) == 0    ? "prompt"
                                                                    : NULL;
        res = http_error(h, c, rq, code, param, "%s", err.msg);
        g->done = 1;
        g->finish = "rejected";
        gen_free(g);
        goto out;
    }
    if (g->stream) {
        struct MHD_Response *resp =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, gen_read, g, gen_free);
        if (!resp) {
            gen_free(g);
            res = MHD_NO;
            goto out;
        }
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-store");
        res = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        http_count(h, rq->ep, 200);
        goto out;
    }
    const double t0 = http_clock();
    while (gen_step(g, 1000) >= 0 && !http_stopping(h) && !http_past_deadline(h, t0))
        ;
    if (!g->done && !http_stopping(h)) { /* gen_free cancels the generation */
        res = http_error(h, c, rq, 504, NULL,
                         "no answer within the deadline of %d s (--http-deadline): the "
                         "generation is cancelled",
                         h->o.deadline_s);
        gen_free(g);
        goto out;
    }
    if (!g->done || strcmp(g->finish, "error") == 0) {
        res =
            http_error(h, c, rq, 500, NULL, "%s", g->done ? g->err.msg : "the server is stopping");
        gen_free(g);
        goto out;
    }
    json_t *ch = json_pack("{s:i, s:o, s:o, s:s, s:n}", "index", 0, "text",
                           json_text(g->text, g->tlen, 1, NULL), "token_ids",
                           ids_json(g->ids, g->nids), "finish_reason", g->finish, "logprobs");
    json_t *j =
        json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", g->id, "object", "text_completion",
                  "created", g->created, "model", g->model, "choices", ch, "usage", usage_json(g));
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    gen_free(g);
    res = s ? http_reply(h, c, rq, 200, "application/json", s, strlen(s))
            : http_error(h, c, rq, 500, NULL, "out of memory");
out:
    free(r.ids);
    json_decref(body);
    return res;
}

/* ---------------------------------------------------------------- embeddings */

enum MHD_Result http_embeddings(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    field_err fe = {{0}, {0}};
    json_t *body = parse_body(rq, &fe), *data = NULL, *out = NULL;
    enum MHD_Result res;
    int32_t *ids = NULL;
    if (!body)
        goto bad_req;
    const char *k;
    json_t *v;
    json_object_foreach(body, k, v)
    {
        if (strcmp(k, "input") == 0)
            continue;
        if (strcmp(k, "encoding_format") == 0) {
            if (!json_is_null(v) &&
                !(json_is_string(v) && strcmp(json_string_value(v), "float") == 0)) {
                bad(&fe, k, "encoding_format: only \"float\" is served");
                goto bad_req;
            }
            continue;
        }
        if (!ignorable(k, v)) {
            bad(&fe, k, "%s: not a field this server takes", k);
            goto bad_req;
        }
    }
    const int model = pick_model(h, body, &fe);
    if (model < 0) {
        res = http_error(h, c, rq, 404, "model", "%s", fe.msg);
        goto out;
    }
    json_t *in = json_object_get(body, "input");
    if (!in) {
        bad(&fe, "input", "input: required");
        goto bad_req;
    }
    /* one input (a string or ids) or a list of them */
    int many = json_is_array(in) && json_array_size(in) > 0 &&
               (json_is_string(json_array_get(in, 0)) || json_is_array(json_array_get(in, 0)));
    size_t n_in = many ? json_array_size(in) : 1;
    if (n_in > MAX_EMBED_INPUTS) {
        bad(&fe, "input", "input: %zu inputs, at most %d", n_in, MAX_EMBED_INPUTS);
        goto bad_req;
    }
    data = json_array();
    int total = 0;
    for (size_t i = 0; i < n_in; i++) {
        json_t *e = many ? json_array_get(in, i) : in;
        const char *text = NULL;
        size_t len = 0;
        int n = 0;
        free(ids);
        ids = NULL;
        if (json_is_string(e)) {
            text = json_string_value(e);
            len = json_string_length(e);
            if (len == 0) {
                bad(&fe, "input", "input[%zu]: empty", i);
                goto bad_req;
            }
        } else if (json_is_array(e)) {
            if (get_ids(e, "input", &ids, &n, &fe))
                goto bad_req;
        } else {
            bad(&fe, "input", "input[%zu]: expected a string or an array of token ids", i);
            goto bad_req;
        }
        float *vec = NULL;
        int dim = 0, toks = 0;
        nl_error err = {0};
        nl_status st = h->be.embed(h->be.ctx, model, text, len, ids, n, &vec, &dim, &toks, &err);
        if (st != NL_OK) {
            res = http_error(h, c, rq, http_code_of(st), "input", "input[%zu]: %s", i, err.msg);
            goto out;
        }
        json_t *a = json_array();
        for (int j = 0; a && j < dim; j++)
            json_array_append_new(a, json_real(vec[j]));
        free(vec);
        json_array_append_new(data, json_pack("{s:s, s:I, s:o}", "object", "embedding", "index",
                                              (json_int_t)i, "embedding", a));
        total += toks;
    }
    out = json_pack("{s:s, s:O, s:s, s:{s:i, s:i}}", "object", "list", "data", data, "model",
                    model_name(h, model), "usage", "prompt_tokens", total, "total_tokens", total);
    char *s = out ? json_dumps(out, JSON_COMPACT) : NULL;
    res = s ? http_reply(h, c, rq, 200, "application/json", s, strlen(s))
            : http_error(h, c, rq, 500, NULL, "out of memory");
    goto out;
bad_req:
    res = http_error(h, c, rq, 400, fe.param[0] ? fe.param : NULL, "%s", fe.msg);
out:
    free(ids);
    json_decref(out);
    json_decref(data);
    json_decref(body);
    return res;
}

enum MHD_Result http_models(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    json_t *data = json_array(), *j = NULL;
    for (int i = 0; data && i <= h->be.n_models; i++)
        json_array_append_new(data,
                              json_pack("{s:s, s:s, s:i, s:s}", "id", model_name(h, i), "object",
                                        "model", "created", 0, "owned_by", "neurollm"));
    if (data)
        j = json_pack("{s:s, s:o}", "object", "list", "data", data);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!s)
        return http_error(h, c, rq, 500, NULL, "out of memory");
    return http_reply(h, c, rq, 200, "application/json", s, strlen(s));
}
