/* The /v1 requests in the OpenAI shapes: every field of a request is
 * checked (400 naming the field), a chat's messages are rendered to one
 * prompt by the model's chat template (core/tokenizer/chat_template.h); the
 * completion then runs in http_gen.c. Embeddings (float or base64) and
 * the model list are answered here. */
#include "serve/http_impl.h"

#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/tokenizer/chat_template.h"

#define MAX_STOP_LEN 256
#define MAX_EMBED_INPUTS 64
#define MAX_MESSAGES 1024

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

json_t *http_json_text(const char *s, size_t n, int final, size_t *used)
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
    if (lo_open && !((float)x > (float)lo)) /* the sampler takes a float */
        return bad(fe, k, "%s: %g is outside (%g, %g] as a float (it rounds to %g)", k, x, lo, hi,
                   (double)(float)x);
    *v = x;
    return 0;
}

/* Fields OpenAI clients send that this server accepts at their no-op value. */
static int ignorable(const char *k, json_t *v)
{
    if (strcmp(k, "model") == 0 || strcmp(k, "user") == 0)
        return json_is_string(v) || json_is_null(v);
    if (strcmp(k, "best_of") == 0)
        return json_is_null(v) || (json_is_integer(v) && json_integer_value(v) == 1);
    if (strcmp(k, "suffix") == 0)
        return json_is_null(v);
    if (strcmp(k, "logit_bias") == 0)
        return json_is_null(v) || (json_is_object(v) && json_object_size(v) == 0);
    if (strcmp(k, "response_format") == 0) { /* {"type": "text"}: text, what we answer */
        json_t *t = json_is_object(v) ? json_object_get(v, "type") : NULL;
        return json_is_null(v) || (json_object_size(v) == 1 && json_is_string(t) &&
                                   strcmp(json_string_value(t), "text") == 0);
    }
    if (strcmp(k, "echo") == 0)
        return json_is_null(v) || json_is_false(v);
    if (strcmp(k, "presence_penalty") == 0 || strcmp(k, "frequency_penalty") == 0)
        return json_is_null(v) || (json_is_number(v) && json_number_value(v) == 0.0);
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
    char now[256];
    if (!name || h->be.n_models == 0 || strcmp(name, h->be.model_name) == 0)
        return 0;
    if (h->be.model_name_now) {
        h->be.model_name_now(h->be.ctx, now, sizeof now);
        if (strcmp(name, now) == 0)
            return 0;
    }
    for (int i = 0; i < h->be.n_models; i++)
        if (strcmp(name, h->be.models[i]) == 0)
            return i + 1;
    bad(fe, "model", "model: '%.200s' is not served here (GET /v1/models lists the %d models)",
        name, h->be.n_models + 1);
    return -1;
}

const char *http_model_name(const nl_http *h, int model, char *buf)
{
    if (model > 0 && model <= h->be.n_models)
        return h->be.models[model - 1];
    if (!h->be.model_name_now)
        return h->be.model_name;
    h->be.model_name_now(h->be.ctx, buf, 256);
    return buf;
}

/* Every field of o is one of known[] or ignorable. */
static int check_fields(json_t *o, const char *const *known, size_t n, field_err *fe)
{
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v)
    {
        int ok = 0;
        for (size_t i = 0; i < n; i++)
            ok |= strcmp(k, known[i]) == 0;
        if (!ok && !ignorable(k, v))
            return bad(fe, k, "%s: not a field this server takes (or not at its default)", k);
    }
    return 0;
}

/* The fields completions and chat share: sampling, n, stop, stream and
 * stream_options. max_tokens is read by the caller. */
static int parse_common(json_t *o, gen_req *r, field_err *fe)
{
    nl_http_completion *c = &r->c;
    /* no seed: a fresh one (as OpenAI, repeated requests sample afresh;
     * a request names one to repeat itself) */
    long long seed = 0, n = 1;
    randombytes_buf(&seed, sizeof seed);
    c->temperature = 1.0;
    c->top_p = 1.0;
    if (get_int(o, "seed", INT64_MIN, INT64_MAX, &seed, fe) ||
        get_int(o, "n", 1, NL_HTTP_MAX_N, &n, fe) ||
        get_num(o, "temperature", 0.0, 100.0, 0, &c->temperature, fe) ||
        get_num(o, "top_p", 0.0, 1.0, 0, &c->top_p, fe))
        return -1;
    if ((float)c->top_p == 0.0f) /* the smallest set of ids with the mass: the most likely one */
        c->temperature = 0.0, c->top_p = 1.0;
    c->seed = (uint64_t)seed; /* taken mod 2^63 with each choice's i (http_gen.c) */
    r->n = (int)n;
    json_t *s = json_object_get(o, "stream");
    if (s && !json_is_null(s) && !json_is_boolean(s))
        return bad(fe, "stream", "stream: expected true or false");
    c->stream = s && json_is_true(s);
    json_t *so = json_object_get(o, "stream_options");
    if (so && !json_is_null(so)) {
        const char *k;
        json_t *v;
        if (!json_is_object(so))
            return bad(fe, "stream_options", "stream_options: expected an object");
        json_object_foreach(so, k, v)
        {
            if (strcmp(k, "include_usage") != 0)
                return bad(fe, "stream_options", "stream_options.%s: not a field this server takes",
                           k);
            if (!json_is_boolean(v) && !json_is_null(v))
                return bad(fe, "stream_options",
                           "stream_options.include_usage: expected true or false");
            r->include_usage = json_is_true(v);
        }
        if (!c->stream)
            return bad(fe, "stream_options", "stream_options: only with \"stream\": true");
    }
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

static int parse_completion(json_t *o, gen_req *r, field_err *fe)
{
    static const char *const known[] = {"prompt",   "max_tokens",    "temperature", "top_p",
                                        "seed",     "stop",          "stream",      "n",
                                        "logprobs", "stream_options"};
    nl_http_completion *c = &r->c;
    long long max_tokens = 16, logprobs = -1;
    if (check_fields(o, known, sizeof known / sizeof known[0], fe))
        return -1;
    json_t *p = json_object_get(o, "prompt");
    if (!p)
        return bad(fe, "prompt", "prompt: required");
    if (json_is_array(p) && json_array_size(p) == 1 &&
        (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        p = json_array_get(p, 0); /* ["text"] or [[ids]]: one prompt */
    if (json_is_string(p)) {
        c->prompt_text = json_string_value(p);
        c->prompt_len = json_string_length(p);
        if (c->prompt_len == 0)
            return bad(fe, "prompt", "prompt: empty");
    } else if (json_is_array(p)) {
        json_t *e0 = json_array_get(p, 0);
        if (json_is_string(e0) || json_is_array(e0)) /* OpenAI's batch of prompts */
            return bad(fe, "prompt",
                       "prompt: a list of %zu prompts (a batch) is not taken here: send one "
                       "prompt (a string, or an array of token ids) a request",
                       json_array_size(p));
        if (get_ids(p, "prompt", &r->ids, &c->n_prompt_ids, fe))
            return -1;
        c->prompt_ids = r->ids;
    } else {
        return bad(fe, "prompt", "prompt: expected a string or an array of token ids");
    }
    if (get_int(o, "max_tokens", 1, INT32_MAX, &max_tokens, fe) ||
        get_int(o, "logprobs", 0, NL_HTTP_MAX_LOGPROBS, &logprobs, fe) || parse_common(o, r, fe))
        return -1;
    c->max_tokens = (int)max_tokens;
    c->logprobs = (int)logprobs;
    return 0;
}

/* A message's content: a string, or an array of {"type": "text", "text"}
 * parts (joined). *owned is set when the text was joined. */
static int message_text(json_t *m, size_t i, const char **text, size_t *len, char **owned,
                        field_err *fe)
{
    json_t *ct = json_object_get(m, "content");
    if (json_is_string(ct)) {
        *text = json_string_value(ct);
        *len = json_string_length(ct);
        return 0;
    }
    if (json_is_null(ct) || !ct) {
        *text = "";
        *len = 0;
        return 0;
    }
    if (!json_is_array(ct))
        return bad(fe, "messages", "messages[%zu].content: expected a string or text parts", i);
    size_t n = 0, k;
    json_t *part;
    json_array_foreach(ct, k, part)
    {
        json_t *ty = json_object_get(part, "type"), *tx = json_object_get(part, "text");
        if (!json_is_string(ty) || strcmp(json_string_value(ty), "text") != 0 ||
            !json_is_string(tx))
            return bad(fe, "messages",
                       "messages[%zu].content[%zu]: only {\"type\": \"text\", \"text\": ...} "
                       "parts are served",
                       i, k);
        n += json_string_length(tx);
    }
    if (!(*owned = malloc(n + 1)))
        return bad(fe, "messages", "out of memory");
    n = 0;
    json_array_foreach(ct, k, part)
    {
        json_t *tx = json_object_get(part, "text");
        memcpy(*owned + n, json_string_value(tx), json_string_length(tx));
        n += json_string_length(tx);
    }
    (*owned)[n] = 0;
    *text = *owned;
    *len = n;
    return 0;
}

/* messages rendered by the model's chat template into r->rendered. */
static int render_messages(nl_http *h, json_t *msgs, gen_req *r, field_err *fe)
{
    static const char *const mkeys[] = {"role", "content", "name"};
    size_t n = json_array_size(msgs);
    if (!json_is_array(msgs) || n == 0 || n > MAX_MESSAGES)
        return bad(fe, "messages", "messages: expected an array of 1..%d messages", MAX_MESSAGES);
    nl_chat_msg *cm = calloc(n, sizeof *cm);
    char **owned = calloc(n, sizeof *owned);
    char *tjson = h->be.chat_template ? h->be.chat_template(h->be.ctx, r->c.model) : NULL;
    nl_chat_template *t = NULL;
    nl_error err = {0};
    int rc = -1;
    if (!cm || !owned) {
        bad(fe, "messages", "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(msgs, i), *role = json_object_get(m, "role");
        if (!json_is_object(m)) {
            bad(fe, "messages", "messages[%zu]: expected an object", i);
            goto out;
        }
        const char *k;
        json_t *v;
        json_object_foreach(m, k, v)
        {
            int ok = 0;
            for (size_t j = 0; j < sizeof mkeys / sizeof mkeys[0]; j++)
                ok |= strcmp(k, mkeys[j]) == 0;
            if (!ok) {
                bad(fe, "messages", "messages[%zu].%s: not a field this server takes", i, k);
                goto out;
            }
        }
        int ro = json_is_string(role) ? nl_chat_role_of(json_string_value(role)) : -1;
        if (ro < 0) {
            bad(fe, "messages", "messages[%zu].role: expected system, developer, user or assistant",
                i);
            goto out;
        }
        cm[i].role = (nl_chat_role)ro;
        if (message_text(m, i, &cm[i].content, &cm[i].len, &owned[i], fe))
            goto out;
    }
    nl_status st = tjson ? nl_chat_template_parse(&t, tjson, strlen(tjson), &err)
                         : nl_chat_template_default(&t, &err);
    if (st == NL_OK)
        st = nl_chat_template_render(t, cm, (int)n, 1, &r->rendered, &r->c.prompt_len, &err);
    if (st != NL_OK) {
        bad(fe, "", "the model's chat template: %s", err.msg);
        goto out;
    }
    r->c.prompt_text = r->rendered;
    rc = 0;
out:
    for (size_t i = 0; owned && i < n; i++)
        free(owned[i]);
    free(owned);
    free(cm);
    free(tjson);
    nl_chat_template_destroy(&t);
    return rc;
}

static int parse_chat(nl_http *h, json_t *o, gen_req *r, field_err *fe)
{
    static const char *const known[] = {"messages",    "max_tokens",   "max_completion_tokens",
                                        "temperature", "top_p",        "seed",
                                        "stop",        "stream",       "n",
                                        "logprobs",    "top_logprobs", "stream_options"};
    nl_http_completion *c = &r->c;
    long long max_tokens = 0, mct = -1, top = -1; /* 0: to the context's end */
    if (check_fields(o, known, sizeof known / sizeof known[0], fe) || parse_common(o, r, fe) ||
        get_int(o, "max_tokens", 1, INT32_MAX, &max_tokens, fe) ||
        get_int(o, "max_completion_tokens", 1, INT32_MAX, &mct, fe) ||
        get_int(o, "top_logprobs", 0, NL_HTTP_MAX_LOGPROBS, &top, fe))
        return -1;
    json_t *lp = json_object_get(o, "logprobs");
    if (lp && !json_is_null(lp) && !json_is_boolean(lp))
        return bad(fe, "logprobs", "logprobs: expected true or false");
    c->logprobs = json_is_true(lp) ? (top >= 0 ? (int)top : 0) : -1;
    if (top >= 0 && c->logprobs < 0)
        return bad(fe, "top_logprobs", "top_logprobs: only with \"logprobs\": true");
    c->max_tokens = (int)(mct > 0 ? mct : max_tokens);
    json_t *msgs = json_object_get(o, "messages");
    if (!msgs)
        return bad(fe, "messages", "messages: required");
    r->chat = 1;
    return render_messages(h, msgs, r, fe);
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

/* ---------------------------------------------------------------- completions */

/* POST /v1/completions and /v1/chat/completions: check, then run. */
static enum MHD_Result completions(nl_http *h, struct MHD_Connection *c, http_req *rq, int chat)
{
    field_err fe = {{0}, {0}};
    gen_req r;
    memset(&r, 0, sizeof r);
    json_t *body = parse_body(rq, &fe);
    enum MHD_Result res;
    int model = body ? pick_model(h, body, &fe) : 0;
    if (model < 0) {
        res = http_error(h, c, rq, 404, "model", "%s", fe.msg);
        goto out;
    }
    r.c.model = model;
    if (!body || (chat ? parse_chat(h, body, &r, &fe) : parse_completion(body, &r, &fe))) {
        res = http_error(h, c, rq, 400, fe.param[0] ? fe.param : NULL, "%s", fe.msg);
        goto out;
    }
    res = http_generate(h, c, rq, &r);
out:
    free(r.ids);
    free(r.rendered);
    json_decref(body);
    return res;
}

enum MHD_Result http_completions(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    return completions(h, c, rq, 0);
}

enum MHD_Result http_chat(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    return completions(h, c, rq, 1);
}

/* ---------------------------------------------------------------- embeddings */

/* The floats as OpenAI's encoding_format "base64" has them: the
 * little-endian float32 bytes, base64 (libsodium's, original variant). */
static json_t *base64_floats(const float *v, int dim)
{
    size_t nb = (size_t)dim * 4;
    unsigned char *b = malloc(nb ? nb : 1);
    size_t cap = sodium_base64_ENCODED_LEN(nb, sodium_base64_VARIANT_ORIGINAL);
    char *s = malloc(cap);
    json_t *j = NULL;
    if (b && s) {
        for (int i = 0; i < dim; i++) {
            uint32_t u;
            memcpy(&u, &v[i], 4);
            for (int k = 0; k < 4; k++)
                b[4 * i + k] = (unsigned char)(u >> (8 * k));
        }
        sodium_bin2base64(s, cap, b, nb, sodium_base64_VARIANT_ORIGINAL);
        j = json_string(s);
    }
    free(b);
    free(s);
    return j;
}

enum MHD_Result http_embeddings(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    char name_buf[256];
    field_err fe = {{0}, {0}};
    json_t *body = parse_body(rq, &fe), *data = NULL, *out = NULL;
    enum MHD_Result res;
    int32_t *ids = NULL;
    int b64 = 0;
    if (!body)
        goto bad_req;
    const char *k;
    json_t *v;
    json_object_foreach(body, k, v)
    {
        if (strcmp(k, "input") == 0)
            continue;
        if (strcmp(k, "encoding_format") == 0) {
            const char *f = json_string_value(v);
            if (!json_is_null(v) && !(f && (strcmp(f, "float") == 0 || strcmp(f, "base64") == 0))) {
                bad(&fe, k, "encoding_format: \"float\" or \"base64\"");
                goto bad_req;
            }
            b64 = f && strcmp(f, "base64") == 0;
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
    if (http_hold_jobs(h, c, rq, 1, &res) != 0) /* one input at a time */
        goto out;
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
        json_t *a = b64 ? base64_floats(vec, dim) : json_array();
        for (int j = 0; !b64 && a && j < dim; j++)
            json_array_append_new(a, json_real(vec[j]));
        free(vec);
        json_array_append_new(data, json_pack("{s:s, s:I, s:o}", "object", "embedding", "index",
                                              (json_int_t)i, "embedding", a));
        total += toks;
    }
    out = json_pack("{s:s, s:O, s:s, s:{s:i, s:i}}", "object", "list", "data", data, "model",
                    http_model_name(h, model, name_buf), "usage", "prompt_tokens", total,
                    "total_tokens", total);
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

static json_t *model_json(const char *name)
{
    return json_pack("{s:s, s:s, s:i, s:s}", "id", name, "object", "model", "created", 0,
                     "owned_by", "neurollm");
}

/* GET /v1/models: the list; GET /v1/models/{id}: that one, or 404. */
enum MHD_Result http_models(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    char name_buf[256];
    json_t *data = json_array(), *j = NULL;
    for (int i = 0; data && i <= h->be.n_models; i++) {
        const char *name = http_model_name(h, i, name_buf);
        if (!rq->model_id) {
            json_array_append_new(data, model_json(name));
        } else if (strcmp(name, rq->model_id) == 0) {
            json_decref(data);
            data = NULL;
            j = model_json(name);
            break;
        }
    }
    if (rq->model_id && data) {
        json_decref(data);
        return http_error(h, c, rq, 404, "model",
                          "model '%.200s' is not served here (GET /v1/models lists the %d models)",
                          rq->model_id, h->be.n_models + 1);
    }
    if (data)
        j = json_pack("{s:s, s:o}", "object", "list", "data", data);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!s)
        return http_error(h, c, rq, 500, NULL, "out of memory");
    return http_reply(h, c, rq, 200, "application/json", s, strlen(s));
}
