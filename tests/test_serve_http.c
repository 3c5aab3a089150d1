/* serve/http in-process, behind a scripted backend (as a coordinator
 * would plug in its own): stop strings across tokens, UTF-8 split across
 * tokens in a stream, a backend failing mid-stream, backend errors mapped
 * to HTTP codes, the event feed, token files and addresses refused at
 * start, and a backend serving several models (a request's "model"
 * selects one; an unknown one is 404), the Host and Content-Type a server
 * without tokens takes, connections per address and the deadline of a
 * non-streaming completion. Requests go over real loopback sockets. */
#include "serve/http.h"
#include "tests/check.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- backend */

static const char *script[] = {"ab", "\xC3", "\xA9", "cd", "ST", "OP", "zz"};
#define NSCRIPT 7

typedef struct fake_job {
    int next, max, fail_at, hang, end_at;
} fake_job;

static int ended;
static int last_model = -1; /* the model the last request asked the backend for */

static nl_status fake_start(void *ctx, const nl_http_completion *rq, void **job, int *ptoks,
                            nl_error *err)
{
    if (rq->prompt_text && strcmp(rq->prompt_text, "busy") == 0)
        return nl_error_set(err, NL_ERR_CAPACITY, "all slots taken");
    if (rq->prompt_text && strcmp(rq->prompt_text, "long") == 0)
        return nl_error_set(err, NL_ERR_RANGE, "max_tokens: too many for the context");
    last_model = rq->model;
    fake_job *j = calloc(1, sizeof *j);
    j->max = rq->max_tokens;
    j->fail_at = rq->prompt_text && strcmp(rq->prompt_text, "midfail") == 0 ? 2 : -1;
    j->hang = rq->prompt_text && strcmp(rq->prompt_text, "hang") == 0; /* a stuck job */
    /* the model's end token as its second token */
    j->end_at = rq->prompt_text && strcmp(rq->prompt_text, "end") == 0 ? 1 : -1;
    *ptoks = rq->prompt_text ? (int)rq->prompt_len : rq->n_prompt_ids;
    *job = j;
    return NL_OK;
}

static nl_http_next fake_next(void *ctx, void *jp, int32_t *id, const char **text, size_t *len,
                              nl_http_logprob *lp, int timeout_ms, nl_error *err)
{
    fake_job *j = jp;
    if (j->hang) {
        usleep((useconds_t)(timeout_ms < 20 ? timeout_ms : 20) * 1000);
        return NL_HTTP_WAIT;
    }
    if (j->next == j->fail_at) {
        nl_error_set(err, NL_ERR_IO, "stage 2 went away");
        return NL_HTTP_FAILED;
    }
    if (j->next >= j->max || j->next >= NSCRIPT)
        return NL_HTTP_DONE;
    if (j->next == j->end_at) {
        *id = 999;
        j->next = NSCRIPT; /* nothing after it */
        return NL_HTTP_END;
    }
    *id = 100 + j->next;
    *text = script[j->next];
    *len = strlen(script[j->next]);
    j->next++;
    return NL_HTTP_TOKEN;
}

static void fake_end(void *ctx, void *jp)
{
    ended++;
    free(jp);
}

static nl_status fake_embed(void *ctx, int model, const char *text, size_t len, const int32_t *ids,
                            int n, float **vec, int *dim, int *tokens, nl_error *err)
{
    last_model = model;
    *vec = calloc(2, sizeof **vec);
    (*vec)[0] = 0.6f;
    (*vec)[1] = 0.8f;
    *dim = 2;
    *tokens = text ? (int)len : n;
    return NL_OK;
}

/* ---------------------------------------------------------------- client */

/* A connection to port from the loopback address `from` (127.0.0.x), or -1.
 * Reads time out after 30 s, so a server that never answers fails the
 * test rather than hanging it. */
static int dial(int port, const char *from)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct sockaddr_in src = {.sin_family = AF_INET};
    struct timeval tv = {30, 0};
    if (s >= 0)
        setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (s < 0 ||
        (from && (inet_pton(AF_INET, from, &src.sin_addr) != 1 ||
                  bind(s, (struct sockaddr *)&src, sizeof src) != 0)) ||
        connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
        if (s >= 0)
            close(s);
        return -1;
    }
    return s;
}

/* One request on a fresh connection with these headers (NULL: Host
 * 127.0.0.1, and a JSON Content-Type with a body); the whole answer
 * (headers and body) into a malloc'd string. */
static char *request_with(int port, const char *method, const char *path, const char *body,
                          const char *headers)
{
    int s = dial(port, NULL);
    if (s < 0)
        return NULL;
    char head[1024], std[128];
    snprintf(std, sizeof std, "Host: 127.0.0.1:%d\r\n%s", port,
             body ? "Content-Type: application/json\r\n" : "");
    int n = snprintf(head, sizeof head,
                     "%s %s HTTP/1.1\r\n%sConnection: close\r\nContent-Length: %zu\r\n\r\n", method,
                     path, headers ? headers : std, body ? strlen(body) : 0);
    if (write(s, head, (size_t)n) != n || (body && write(s, body, strlen(body)) < 0)) {
        close(s);
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *out = malloc(cap);
    ssize_t r;
    while (out && (r = read(s, out + len, cap - len - 1)) > 0)
        len += (size_t)r;
    close(s);
    if (out)
        out[len] = 0;
    return out;
}

/* The same with the standard headers and `extra` ones. */
static char *request(int port, const char *method, const char *path, const char *body,
                     const char *extra)
{
    char h[600];
    snprintf(h, sizeof h, "Host: 127.0.0.1:%d\r\n%s%s", port,
             body ? "Content-Type: application/json\r\n" : "", extra ? extra : "");
    return request_with(port, method, path, body, h);
}

static void expect(const char *got, const char *want, const char *what)
{
    CHECK(got && strstr(got, want), "%s: wanted %s in %s", what, want, got ? got : "(nothing)");
}

/* ---------------------------------------------------------------- tests */

static void test_api(int port, nl_http *h)
{
    char *r;
    /* a stop string split over two tokens; UTF-8 split over two tokens */
    r = request(port, "POST", "/v1/completions",
                "{\"prompt\": \"x\", \"max_tokens\": 7, \"stop\": [\"TOP\", \"q\"]}", NULL);
    expect(r, "HTTP/1.1 200", "completion");
    expect(r,
           "\"text\":\"ab\xC3\xA9"
           "cdS\"",
           "text cut before the stop string");
    expect(r, "\"token_ids\":[100,101,102,103,104,105]", "ids up to the stopping token");
    expect(r, "\"finish_reason\":\"stop\"", "finish stop");
    expect(r, "\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":6", "usage");
    free(r);
    r = request(port, "POST", "/v1/completions",
                "{\"prompt\": [5, 6], \"max_tokens\": 4, \"stream\": true}", NULL);
    expect(r, "text/event-stream", "stream");
    expect(r, "\"text\":\"\",\"token_ids\":[101]", "an incomplete UTF-8 byte is held");
    expect(r, "\"text\":\"\xC3\xA9\",\"token_ids\":[102]", "and sent with its continuation");
    expect(r, "\"finish_reason\":\"length\"", "finish length");
    expect(r, "data: [DONE]", "done");
    free(r);
    /* the model's end token ends the answer: finish stop, counted, no text */
    r = request(port, "POST", "/v1/completions", "{\"prompt\": \"end\", \"max_tokens\": 5}", NULL);
    expect(r, "\"text\":\"ab\",\"token_ids\":[100,999]", "the text before the end token");
    expect(r, "\"finish_reason\":\"stop\"", "an end token: finish stop");
    expect(r, "\"completion_tokens\":2", "the end token counted");
    free(r);
    r = request(port, "POST", "/v1/completions",
                "{\"prompt\": \"end\", \"max_tokens\": 5, \"stream\": true}", NULL);
    expect(r, "\"finish_reason\":\"stop\"", "a stream's end token: finish stop");
    expect(r, "data: [DONE]", "and the stream ends");
    free(r);
    r = request(port, "POST", "/v1/completions",
                "{\"prompt\": \"midfail\", \"max_tokens\": 5, \"stream\": true}", NULL);
    expect(r, "\"token_ids\":[101]", "tokens before the failure");
    expect(r, "stage 2 went away", "the failure in the stream");
    expect(r, "\"finish_reason\":\"error\"", "finish error");
    expect(r, "data: [DONE]", "the failed stream still ends");
    free(r);
    r = request(port, "POST", "/v1/completions", "{\"prompt\": \"midfail\", \"max_tokens\": 5}",
                NULL);
    expect(r, "HTTP/1.1 500", "a failed completion");
    expect(r, "stage 2 went away", "its message");
    free(r);
    r = request(port, "POST", "/v1/completions", "{\"prompt\": \"busy\"}", NULL);
    expect(r, "HTTP/1.1 429", "backend capacity -> 429");
    free(r);
    r = request(port, "POST", "/v1/completions", "{\"prompt\": \"long\"}", NULL);
    expect(r, "HTTP/1.1 400", "backend range -> 400");
    expect(r, "\"param\":\"max_tokens\"", "naming max_tokens");
    free(r);
    r = request(port, "POST", "/v1/embeddings", "{\"input\": [\"abc\", [1, 2]]}", NULL);
    expect(r, "\"index\":1", "two embeddings");
    expect(r, "\"prompt_tokens\":5", "their tokens");
    free(r);
    /* base64: the little-endian float32 bytes of 0.6f, 0.8f */
    r = request(port, "POST", "/v1/embeddings",
                "{\"input\": \"a\", \"encoding_format\": \"base64\"}", NULL);
    expect(r, "\"embedding\":\"mpkZP83MTD8=\"", "base64 embedding");
    free(r);
    r = request(port, "POST", "/v1/embeddings", "{\"input\": \"a\", \"encoding_format\": \"int8\"}",
                NULL);
    expect(r, "\"param\":\"encoding_format\"", "int8 refused");
    free(r);
    /* chat and the new fields: refusals name the field */
    static const char *const refused[][2] = {
        {"{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}", "messages"},
        {"{\"messages\": []}", "messages"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"bogus\": 1}]}", "messages"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"top_logprobs\": 2}",
         "top_logprobs"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"n\": 17}", "n"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
         "\"stream_options\": {\"include_usage\": true}}",
         "stream_options"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stream\": true, "
         "\"stream_options\": {\"other\": 1}}",
         "stream_options"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"functions\": []}",
         "functions"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        char want[64];
        snprintf(want, sizeof want, "\"param\":\"%s\"", refused[i][1]);
        r = request(port, "POST", "/v1/chat/completions", refused[i][0], NULL);
        expect(r, "HTTP/1.1 400", refused[i][0]);
        expect(r, want, refused[i][0]);
        free(r);
    }
    /* integer bounds are inclusive at both ends: logprobs 20 is taken (the
     * fake backend starts it), 21 refused with the field named */
    r = request(port, "POST", "/v1/completions",
                "{\"prompt\": \"x\", \"max_tokens\": 1, \"logprobs\": 20}", NULL);
    CHECK(r && !strstr(r, "\"param\":\"logprobs\""), "logprobs 20 refused: %.300s",
          r ? r : "(no answer)");
    free(r);
    r = request(port, "POST", "/v1/completions",
                "{\"prompt\": \"x\", \"max_tokens\": 1, \"logprobs\": 21}", NULL);
    expect(r, "HTTP/1.1 400", "logprobs 21");
    expect(r, "\"param\":\"logprobs\"", "logprobs 21 names the field");
    free(r);
    /* a chat through the (fake) backend: the default template's prompt */
    r = request(port, "POST", "/v1/chat/completions",
                "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", "
                "\"text\": \"hi\"}]}], \"max_completion_tokens\": 2}",
                NULL);
    expect(r, "\"object\":\"chat.completion\"", "a chat completion");
    expect(r, "\"role\":\"assistant\"", "the assistant's message");
    expect(r, "\"completion_tokens\":2", "max_completion_tokens");
    free(r);
    nl_http_publish(h, "train_step", "{\"step\":3,\"loss\":2.5}");
    nl_http_publish(h, "stamped", "{\"time\":\"when it happened\"}");
    nl_http_publish(h, "empty", "{}");
    nl_http_publish(h, "last", "{\"n\":1}");
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    char buf[8192] = {0};
    size_t len = 0;
    if (connect(s, (struct sockaddr *)&a, sizeof a) == 0) {
        const char *q = "GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
        if (write(s, q, strlen(q)) > 0)
            while (!(strstr(buf, "event: last") && strstr(strstr(buf, "event: last"), "}\n\n")) &&
                   len < sizeof buf - 1) {
                ssize_t n = read(s, buf + len, sizeof buf - 1 - len);
                if (n <= 0)
                    break;
                len += (size_t)n;
            }
    }
    close(s);
    /* each event carries the time it was published, unless it has its own */
    expect(buf, "event: train_step\ndata: {\"step\":3,\"loss\":2.5,\"time\":\"",
           "a published event");
    expect(buf, "event: stamped\ndata: {\"time\":\"when it happened\"}\n", "an event's own time");
    expect(buf, "event: empty\ndata: {\"time\":\"", "an empty object's time");
    const char *t = strstr(buf, "\"loss\":2.5,\"time\":\"");
    int y = 0, mo = 0, d = 0, hh = 0, mm = 0, ss = 0, ms = 0, n = 0;
    CHECK(t &&
              sscanf(t + 19, "%4d-%2d-%2dT%2d:%2d:%2d.%3dZ\"}%n", &y, &mo, &d, &hh, &mm, &ss, &ms,
                     &n) == 7 &&
              n == 26 && y >= 2024,
          "the time is ISO 8601 UTC with milliseconds: %.40s", t ? t + 19 : "(none)");
    expect(buf, "event: request", "the completions' events");
    r = request(port, "GET", "/metrics", NULL, NULL);
    expect(r, "neurollm_http_requests_total{endpoint=\"/v1/completions\",code=\"429\"} 1",
           "429 counted");
    free(r);
    CHECK(ended == 8, "every started job ended (%d)", ended); /* 7 completions, a chat */
}

/* A backend with two more models: "model" picks one, by name. */
static void test_models(const nl_http_backend *base)
{
    static const char *const more[] = {"ad1", "ad2"};
    nl_http_backend b = *base;
    b.models = more;
    b.n_models = 2;
    nl_error err = {0};
    nl_http *h = NULL;
    nl_http_opts o = {.addr = "127.0.0.1:0"};
    CHECK_OK(nl_http_start(&h, &o, &b, &err), &err);
    if (!h)
        return;
    const int port = nl_http_port(h);
    char *r = request(port, "GET", "/v1/models", NULL, NULL);
    expect(r, "\"data\":[{\"id\":\"fake\"", "the base first");
    expect(r, "{\"id\":\"ad1\"", "then ad1");
    expect(r, "{\"id\":\"ad2\"", "and ad2");
    free(r);
    const struct {
        const char *body;
        int model;
        const char *name;
    } cases[] = {
        {"{\"prompt\": \"x\", \"max_tokens\": 1, \"model\": \"ad2\"}", 2, "ad2"},
        {"{\"prompt\": \"x\", \"max_tokens\": 1, \"model\": \"fake\"}", 0, "fake"},
        {"{\"prompt\": \"x\", \"max_tokens\": 1}", 0, "fake"},
        {"{\"prompt\": \"x\", \"max_tokens\": 1, \"model\": \"ad1\", \"stream\": true}", 1, "ad1"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        last_model = -1;
        r = request(port, "POST", "/v1/completions", cases[i].body, NULL);
        char want[64];
        snprintf(want, sizeof want, "\"model\":\"%s\"", cases[i].name);
        expect(r, "HTTP/1.1 200", cases[i].body);
        expect(r, want, "the answer names the model");
        CHECK(last_model == cases[i].model, "%s: the backend got model %d, not %d", cases[i].body,
              last_model, cases[i].model);
        free(r);
    }
    last_model = -1;
    r = request(port, "POST", "/v1/completions", "{\"prompt\": \"x\", \"model\": \"gpt-4\"}", NULL);
    expect(r, "HTTP/1.1 404", "an unknown model");
    expect(r, "'gpt-4' is not served here", "named in the message");
    expect(r, "\"param\":\"model\"", "the field");
    CHECK(last_model == -1, "the backend was not asked");
    free(r);
    r = request(port, "POST", "/v1/embeddings", "{\"input\": \"a\", \"model\": \"ad1\"}", NULL);
    expect(r, "\"model\":\"ad1\"", "an embedding by ad1");
    CHECK(last_model == 1, "the backend embedded with model %d, not 1", last_model);
    free(r);
    r = request(port, "POST", "/v1/embeddings", "{\"input\": \"a\", \"model\": \"x\"}", NULL);
    expect(r, "HTTP/1.1 404", "an embedding by an unknown model");
    free(r);
    nl_http_stop(&h);
}

/* Issue 31, item 6: a page of another site cannot drive a server without
 * tokens (its Host is refused unless allowed; a POST must say JSON, which
 * a page cannot send another site unasked); one address cannot take every
 * connection (a flood of idle ones from 127.0.0.2 leaves 127.0.0.1
 * served); a non-streaming completion that gets no answer is cancelled at
 * its deadline and answered 504. */
static void test_origin_and_limits(const nl_http_backend *b)
{
    nl_error err = {0};
    nl_http *h = NULL;
    nl_http_opts o = {.addr = "127.0.0.1:0",
                      .max_requests = 4,
                      .per_ip = 8,
                      .deadline_s = 1,
                      .allow_hosts = "neuro.lan,Box"};
    CHECK_OK(nl_http_start(&h, &o, b, &err), &err);
    if (!h)
        return;
    const int port = nl_http_port(h);
    const char *body = "{\"prompt\": \"x\", \"max_tokens\": 1}";
    char *r = request_with(port, "POST", "/v1/completions", body,
                           "Host: evil.example:8080\r\nContent-Type: application/json\r\n");
    expect(r, "HTTP/1.1 403", "a Host of another site");
    expect(r, "--http-allow-host", "the refusal names the flag");
    free(r);
    const char *good[] = {"Host: localhost:1\r\n", "Host: [::1]:8080\r\n", "Host: 10.0.0.7\r\n",
                          "Host: NEURO.lan:80\r\n", "Host: box\r\n"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        char hd[200];
        snprintf(hd, sizeof hd, "%sContent-Type: application/json\r\n", good[i]);
        r = request_with(port, "POST", "/v1/completions", body, hd);
        expect(r, "HTTP/1.1 200", good[i]);
        free(r);
    }
    r = request_with(port, "POST", "/v1/completions", body,
                     "Host: 127.0.0.1\r\nContent-Type: text/plain\r\n");
    expect(r, "HTTP/1.1 415", "a text/plain POST");
    expect(r, "application/json", "the refusal says what it takes");
    free(r);
    r = request_with(port, "POST", "/v1/completions", body, "Host: 127.0.0.1\r\n");
    expect(r, "HTTP/1.1 415", "a POST without a Content-Type");
    free(r);
    r = request_with(port, "POST", "/v1/completions", body,
                     "Host: 127.0.0.1\r\nContent-Type: application/json; charset=utf-8\r\n");
    expect(r, "HTTP/1.1 200", "JSON with a charset");
    free(r);
    /* more idle connections from one address than the server holds in all */
    enum { FLOOD = 80 };
    int fl[FLOOD], open_ = 0;
    for (int i = 0; i < FLOOD; i++)
        if ((fl[i] = dial(port, "127.0.0.2")) >= 0)
            open_++;
    CHECK(open_ > 0, "no connection from 127.0.0.2");
    r = request(port, "GET", "/v1/models", NULL, NULL);
    expect(r, "HTTP/1.1 200", "127.0.0.1 served while 127.0.0.2 holds idle connections");
    free(r);
    for (int i = 0; i < FLOOD; i++)
        if (fl[i] >= 0)
            close(fl[i]);
    /* a stuck generation */
    const int before = ended;
    r = request(port, "POST", "/v1/completions", "{\"prompt\": \"hang\", \"max_tokens\": 4}", NULL);
    expect(r, "HTTP/1.1 504", "a completion past its deadline");
    expect(r, "--http-deadline", "the answer names the flag");
    free(r);
    CHECK(ended == before + 1, "the stuck generation was not ended (%d)", ended - before);
    nl_http_stop(&h);
}

static void test_start_refusals(const nl_http_backend *b)
{
    nl_error err = {0};
    nl_http *h = NULL;
    nl_http_opts o = {.addr = "10.1.2.3:0"};
    CHECK(nl_http_start(&h, &o, b, &err) == NL_ERR_AUTH, "off loopback without tokens");
    expect(err.msg, "--http-tokens", "the refusal names the flag");
    o.addr = "127.0.0.1";
    CHECK(nl_http_start(&h, &o, b, &err) == NL_ERR_INVALID, "no port");
    o.addr = "127.0.0.1:99999";
    CHECK(nl_http_start(&h, &o, b, &err) == NL_ERR_INVALID, "port out of range");
    o.addr = "127.0.0.1:0";
    o.tokens_path = "/nonexistent/tokens";
    CHECK(nl_http_start(&h, &o, b, &err) == NL_ERR_IO, "a missing tokens file");
    char path[] = "/tmp/nl_tokens_XXXXXX";
    int fd = mkstemp(path);
    if (fd >= 0) {
        CHECK(write(fd, "# none\nshort\n", 13) == 13, "write tokens");
        close(fd);
        o.tokens_path = path;
        CHECK(nl_http_start(&h, &o, b, &err) == NL_ERR_FORMAT, "a short token refused");
        expect(err.msg, "16 or more", "the message says why");
        chmod(path, 0644); /* issue 31: others may read it */
        CHECK(nl_http_start(&h, &o, b, &err) == NL_ERR_AUTH, "a world-readable tokens file");
        expect(err.msg, "chmod 600", "the message says what to do");
        unlink(path);
        CHECK(mkfifo(path, 0600) == 0, "mkfifo");
        CHECK(nl_http_start(&h, &o, b, &err) == NL_ERR_IO, "a FIFO as the tokens file");
        expect(err.msg, "not a regular file", "the message says why");
        unlink(path);
    }
    o.tokens_path = NULL;
    o.addr = "[::1]:0";
    nl_status st = nl_http_start(&h, &o, b, &err);
    CHECK(st == NL_OK || st == NL_ERR_IO, "IPv6 loopback: %s", err.msg); /* IO: no IPv6 here */
    if (h)
        CHECK(nl_http_port(h) > 0, "bound to a port");
    nl_http_stop(&h);
    nl_http_stop(&h); /* safe twice */
}

/* A streamed completion with logprobs: each chunk's text_offset is the
 * text before its token, kept as the chunks go (the offsets were summed
 * afresh from the first token for every chunk: n^2 / 2 token look-ups,
 * each under the cluster tokenizer's lock on neurocoord --http). */
static int bytes_calls;

static nl_http_next one_byte_next(void *ctx, void *jp, int32_t *id, const char **text, size_t *len,
                                  nl_http_logprob *lp, int timeout_ms, nl_error *err)
{
    fake_job *j = jp;
    if (j->next >= j->max)
        return NL_HTTP_DONE;
    *id = 7;
    *text = "t";
    *len = 1;
    lp->logprob = -0.5f;
    lp->k = 0;
    j->next++;
    return NL_HTTP_TOKEN;
}

static size_t one_byte(void *ctx, int32_t id, char *buf, size_t cap)
{
    __atomic_add_fetch(&bytes_calls, 1, __ATOMIC_RELAXED);
    buf[0] = 't';
    return 1;
}

static void test_stream_offsets(const nl_http_backend *base)
{
    nl_http_backend b = *base;
    b.completion_next = one_byte_next;
    b.token_bytes = one_byte;
    nl_error err = {0};
    nl_http *h = NULL;
    nl_http_opts o = {.addr = "127.0.0.1:0"};
    CHECK_OK(nl_http_start(&h, &o, &b, &err), &err);
    if (!h)
        return;
    char *r = request(nl_http_port(h), "POST", "/v1/completions",
                      "{\"prompt\": \"x\", \"max_tokens\": 150, \"logprobs\": 0, \"stream\": true}",
                      NULL);
    expect(r, "\"text_offset\":[0]", "the first chunk's offset");
    expect(r, "\"text_offset\":[149]", "the last token's offset");
    expect(r, "data: [DONE]", "the stream's end");
    const int calls = __atomic_load_n(&bytes_calls, __ATOMIC_RELAXED);
    CHECK(calls <= 2 * 150, "150 tokens streamed with logprobs looked up %d token texts", calls);
    free(r);
    nl_http_stop(&h);
}

/* A backend that runs at most 3 jobs at once (neurocoord --http:
 * --max-jobs-per-key): each choice of a completion is one, so a request
 * of n = 4 is answered 429 before the backend is asked, while n = 3 is
 * served, again and again (its jobs are given back when it ends), and an
 * embedding (one job) too. */
static void test_job_bound(const nl_http_backend *base)
{
    nl_http_backend b = *base;
    b.max_jobs = 3;
    nl_error err = {0};
    nl_http *h = NULL;
    nl_http_opts o = {.addr = "127.0.0.1:0"};
    CHECK_OK(nl_http_start(&h, &o, &b, &err), &err);
    if (!h)
        return;
    const int port = nl_http_port(h);
    const int before = ended;
    char *r = request(port, "POST", "/v1/completions",
                      "{\"prompt\": \"x\", \"max_tokens\": 1, \"n\": 4}", NULL);
    expect(r, "HTTP/1.1 429", "4 choices of a backend that runs 3 jobs");
    expect(r, "\"type\":\"rate_limit_error\"", "a rate limit");
    expect(r, "would pass the 3", "the message says the bound");
    expect(r, "\"param\":\"n\"", "naming n");
    CHECK(ended == before, "the backend was asked for %d jobs", ended - before);
    free(r);
    for (int i = 0; i < 2; i++) {
        r = request(port, "POST", "/v1/completions",
                    "{\"prompt\": \"x\", \"max_tokens\": 1, \"n\": 3}", NULL);
        expect(r, "HTTP/1.1 200", "3 choices fit, each time");
        free(r);
    }
    r = request(port, "POST", "/v1/embeddings", "{\"input\": \"a\"}", NULL);
    expect(r, "HTTP/1.1 200", "an embedding within the bound");
    free(r);
    nl_http_stop(&h);
}

int main(void)
{
    nl_http_backend b = {.model_name = "fake",
                         .completion_start = fake_start,
                         .completion_next = fake_next,
                         .completion_end = fake_end,
                         .embed = fake_embed};
    nl_error err = {0};
    nl_http *h = NULL;
    nl_http_opts o = {.addr = "127.0.0.1:0"};
    CHECK_OK(nl_http_start(&h, &o, &b, &err), &err);
    if (h) {
        test_api(nl_http_port(h), h);
        /* one model: "model" is not checked (clients send a fixed name) */
        char *r = request(nl_http_port(h), "POST", "/v1/completions",
                          "{\"prompt\": \"x\", \"max_tokens\": 1, \"model\": \"gpt-4\"}", NULL);
        expect(r, "HTTP/1.1 200", "any model name with one model served");
        expect(r, "\"model\":\"fake\"", "answered by it");
        free(r);
        nl_http_stop(&h);
    }
    test_models(&b);
    test_job_bound(&b);
    test_origin_and_limits(&b);
    test_start_refusals(&b);
    test_stream_offsets(&b);
    return check_done("test_serve_http");
}
