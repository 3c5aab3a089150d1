/* The HTTP server (see http.h): the libmicrohttpd daemon, routing, the
 * limits (body size, concurrent requests, slow clients), bearer tokens,
 * the event feed, metrics, status and the static pages. The /v1 endpoints
 * are in http_api.c. */
#include "serve/http_impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_CHARTJS "/usr/share/javascript/chart.js/chart.min.js"
#define MAX_SUBSCRIBERS 32
#define KEEPALIVE_MS 10000

static const char *ep_names[EP_COUNT] = {"/v1/completions", "/v1/chat/completions",
                                         "/v1/embeddings",  "/v1/models",
                                         "/api/status",     "/api/events",
                                         "/metrics",        "/",
                                         "/static",         "other"};

/* ---------------------------------------------------------------- replies */

void http_count(nl_http *h, int ep, int code)
{
    pthread_mutex_lock(&h->mu);
    for (int i = 0; i < HTTP_CODES; i++)
        if (h->codes[ep][i] == code || h->codes[ep][i] == 0) {
            h->codes[ep][i] = code;
            h->counts[ep][i]++;
            break;
        }
    pthread_mutex_unlock(&h->mu);
}

enum MHD_Result http_reply(nl_http *h, struct MHD_Connection *c, http_req *rq, int code,
                           const char *ctype, char *text, size_t len)
{
    if (!text) { /* out of memory upstream: an empty body, still freeable */
        len = 0;
        if (!(text = malloc(1)))
            return MHD_NO;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    if (code == 401)
        MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)code, r);
    MHD_destroy_response(r);
    http_count(h, rq->ep, code);
    return ok;
}

enum MHD_Result http_error(nl_http *h, struct MHD_Connection *c, http_req *rq, int code,
                           const char *param, const char *fmt, ...)
{
    char msg[NL_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *type = code == 401   ? "authentication_error"
                       : code == 429 ? "rate_limit_error"
                       : code >= 500 ? "server_error"
                                     : "invalid_request_error";
    /* a message or param cut inside a UTF-8 sequence (or holding a
     * client's bytes) is made valid: U+FFFD where it is not */
    json_t *m = http_json_text(msg, strlen(msg), 1, NULL);
    json_t *p = param ? http_json_text(param, strlen(param), 1, NULL) : json_null();
    json_t *j = m && p ? json_pack("{s:{s:O, s:s, s:O, s:n}}", "error", "message", m, "type", type,
                                   "param", p, "code")
                       : NULL;
    json_decref(m);
    json_decref(p);
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!text) /* out of memory */
        return http_reply(h, c, rq, code, "application/json", NULL, 0);
    return http_reply(h, c, rq, code, "application/json", text, text ? strlen(text) : 0);
}

int http_code_of(nl_status st)
{
    switch (st) {
    case NL_ERR_INVALID:
    case NL_ERR_RANGE:
    case NL_ERR_FORMAT:
        return 400;
    case NL_ERR_CAPACITY:
    case NL_ERR_LIMIT:
        return 429;
    case NL_ERR_STATE:
        return 503;
    case NL_ERR_UNSUPPORTED:
        return 501;
    default:
        return 500;
    }
}

int http_hold_jobs(nl_http *h, struct MHD_Connection *c, http_req *rq, int n, enum MHD_Result *res)
{
    pthread_mutex_lock(&h->mu);
    const int running = h->jobs, fits = h->be.max_jobs <= 0 || running + n <= h->be.max_jobs;
    if (fits) {
        h->jobs += n;
        rq->jobs += n;
    }
    pthread_mutex_unlock(&h->mu);
    if (fits)
        return 0;
    *res = http_error(h, c, rq, 429, n > 1 ? "n" : NULL,
                      "%d jobs are being run already: the request's %d would pass the %d the "
                      "backend runs at once",
                      running, n, h->be.max_jobs);
    return -1;
}

/* ---------------------------------------------------------------- tokens */

static int token_ok(nl_http *h, struct MHD_Connection *c)
{
    if (h->n_tokens == 0)
        return 1;
    const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!a || strncmp(a, "Bearer ", 7) != 0)
        return 0;
    unsigned char got[32];
    crypto_generichash(got, sizeof got, (const unsigned char *)a + 7, strlen(a + 7), NULL, 0);
    int ok = 0;
    for (int i = 0; i < h->n_tokens; i++) /* every one, constant time each */
        ok |= sodium_memcmp(got, h->tokens[i], sizeof got) == 0;
    return ok;
}

/* The tokens file, open for reading (*out): a regular file that only its
 * owner may read or write (what ssh asks of a secret key). */
static nl_status open_tokens(const char *path, FILE **out, nl_error *err)
{
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY); /* a FIFO: no wait */
    struct stat sb;
    nl_status st = NL_OK;
    *out = NULL;
    if (fd < 0 || fstat(fd, &sb) != 0)
        st = nl_error_set(err, NL_ERR_IO, "--http-tokens %s: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st = nl_error_set(err, NL_ERR_IO, "--http-tokens %s: not a regular file", path);
    else if (sb.st_mode & 077)
        st = nl_error_set(err, NL_ERR_AUTH,
                          "--http-tokens %s: group or others may read or write it (mode %03o): "
                          "chmod 600 it",
                          path, (unsigned)(sb.st_mode & 0777));
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0 || !(*out = fdopen(fd, "r")))
        st = nl_error_set(err, NL_ERR_IO, "--http-tokens %s: %s", path, strerror(errno));
    if (!*out && fd >= 0)
        close(fd);
    return st;
}

static nl_status load_tokens(nl_http *h, const char *path, nl_error *err)
{
    FILE *f = NULL;
    const nl_status opened = open_tokens(path, &f, err);
    if (opened != NL_OK)
        return opened;
    char line[1024];
    nl_status st = NL_OK;
    while (fgets(line, sizeof line, f)) {
        size_t n = strcspn(line, "\r\n");
        line[n] = 0;
        char *s = line;
        while (*s == ' ' || *s == '\t')
            s++;
        n = strlen(s);
        while (n && (s[n - 1] == ' ' || s[n - 1] == '\t'))
            s[--n] = 0;
        if (n == 0 || s[0] == '#')
            continue;
        if (n < 16) {
            st = nl_error_set(err, NL_ERR_FORMAT,
                              "--http-tokens %s: a token of %zu characters; use 16 or more", path,
                              n);
            break;
        }
        void *p = realloc(h->tokens, (size_t)(h->n_tokens + 1) * sizeof *h->tokens);
        if (!p) {
            st = nl_error_set(err, NL_ERR_NOMEM, "--http-tokens: out of memory");
            break;
        }
        h->tokens = p;
        crypto_generichash(h->tokens[h->n_tokens++], 32, (const unsigned char *)s, n, NULL, 0);
        sodium_memzero(line, sizeof line);
    }
    fclose(f);
    if (st == NL_OK && h->n_tokens == 0)
        st = nl_error_set(err, NL_ERR_FORMAT, "--http-tokens %s: no token in the file", path);
    return st;
}

/* ---------------------------------------------------------------- events */

void nl_http_time_now(char *out, size_t cap)
{
    struct timespec ts;
    struct tm tm;
    char day[32];
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(day, sizeof day, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, cap, "%.20s.%03dZ", day, (int)(ts.tv_nsec / 1000000L % 1000));
}

/* The event's JSON with "time" (now) added when it is an object without
 * one; otherwise a copy. The publisher's text is kept as it wrote it. */
static char *stamp_time(const char *json)
{
    json_t *o = json_loads(json, 0, NULL); /* one whole object: its last } closes it */
    const int add = json_is_object(o) && !json_object_get(o, "time");
    const int empty = add && json_object_size(o) == 0;
    json_decref(o);
    const char *end = add ? strrchr(json, '}') : NULL;
    if (!end)
        return strdup(json);
    char t[40];
    nl_http_time_now(t, sizeof t);
    const size_t head = (size_t)(end - json), cap = head + strlen(t) + 16;
    char *s = malloc(cap);
    if (s)
        snprintf(s, cap, "%.*s%s\"time\":\"%s\"}", (int)head, json, empty ? "" : ",", t);
    return s;
}

void nl_http_publish(nl_http *h, const char *type, const char *json)
{
    if (!h)
        return;
    char *t = strdup(type), *j = stamp_time(json);
    if (!t || !j) {
        free(t);
        free(j);
        return;
    }
    pthread_mutex_lock(&h->mu);
    http_event *e = &h->ring[h->next_seq % EVENT_RING];
    free(e->type);
    free(e->json);
    e->seq = h->next_seq++;
    e->type = t;
    e->json = j;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

typedef struct sub_state {
    nl_http *h;
    uint64_t next; /* the next event to send */
    char *pend;    /* formatted, not yet sent */
    size_t len, off;
} sub_state;

/* Format the events from s->next on (under the lock). */
static void sub_format(sub_state *s)
{
    nl_http *h = s->h;
    size_t need = 0;
    if (s->next + EVENT_RING < h->next_seq)
        s->next = h->next_seq - EVENT_RING; /* fell behind: skip what is gone */
    for (uint64_t q = s->next; q < h->next_seq; q++) {
        http_event *e = &h->ring[q % EVENT_RING];
        need += strlen(e->type) + strlen(e->json) + 64;
    }
    free(s->pend);
    s->pend = malloc(need + 1);
    s->len = s->off = 0;
    if (!s->pend)
        return;
    for (; s->next < h->next_seq; s->next++) {
        http_event *e = &h->ring[s->next % EVENT_RING];
        s->len += (size_t)sprintf(s->pend + s->len, "id: %llu\nevent: %s\ndata: %s\n\n",
                                  (unsigned long long)e->seq, e->type, e->json);
    }
}

static ssize_t sub_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    sub_state *s = cls;
    nl_http *h = s->h;
    if (s->off == s->len) {
        pthread_mutex_lock(&h->mu);
        if (s->next == h->next_seq && !h->stopping) {
            struct timespec t;
            clock_gettime(CLOCK_REALTIME, &t);
            t.tv_sec += KEEPALIVE_MS / 1000;
            pthread_cond_timedwait(&h->cv, &h->mu, &t);
        }
        int stop = h->stopping;
        if (!stop && s->next < h->next_seq)
            sub_format(s);
        pthread_mutex_unlock(&h->mu);
        if (stop)
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (s->off == s->len) { /* a comment keeps proxies and the timeout at bay */
            free(s->pend);
            s->pend = strdup(": keep-alive\n\n");
            s->off = 0;
            s->len = s->pend ? strlen(s->pend) : 0;
        }
    }
    size_t n = s->len - s->off < max ? s->len - s->off : max;
    if (n == 0)
        return MHD_CONTENT_READER_END_WITH_ERROR;
    memcpy(buf, s->pend + s->off, n);
    s->off += n;
    return (ssize_t)n;
}

static void sub_free(void *cls)
{
    sub_state *s = cls;
    pthread_mutex_lock(&s->h->mu);
    s->h->subscribers--;
    pthread_mutex_unlock(&s->h->mu);
    free(s->pend);
    free(s);
}

static enum MHD_Result http_events(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    sub_state *s = calloc(1, sizeof *s);
    if (!s)
        return http_error(h, c, rq, 500, NULL, "out of memory");
    pthread_mutex_lock(&h->mu);
    int full = h->subscribers >= MAX_SUBSCRIBERS;
    if (!full) {
        h->subscribers++;
        s->h = h;
        s->next = h->next_seq > 100 ? h->next_seq - 100 : 0; /* recent history first */
        sub_format(s);
    }
    pthread_mutex_unlock(&h->mu);
    if (full) {
        free(s);
        return http_error(h, c, rq, 429, NULL, "%d event streams are open already",
                          MAX_SUBSCRIBERS);
    }
    struct MHD_Response *r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, sub_read, s, sub_free);
    if (!r) {
        sub_free(s);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-store");
    enum MHD_Result ok = MHD_queue_response(c, 200, r);
    MHD_destroy_response(r);
    http_count(h, rq->ep, 200);
    return ok;
}

/* ---------------------------------------------------------------- metrics */

static enum MHD_Result http_metrics(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    size_t cap = 4096 + (size_t)EP_COUNT * HTTP_CODES * 96;
    char *t = malloc(cap), *extra = h->be.metrics_text ? h->be.metrics_text(h->be.ctx) : NULL;
    if (!t) {
        free(extra);
        return http_error(h, c, rq, 500, NULL, "out of memory");
    }
    size_t n = 0;
    pthread_mutex_lock(&h->mu);
    n += (size_t)snprintf(t + n, cap - n,
                          "# HELP neurollm_http_requests_total HTTP requests answered, by "
                          "endpoint and status code.\n"
                          "# TYPE neurollm_http_requests_total counter\n");
    for (int e = 0; e < EP_COUNT; e++)
        for (int i = 0; i < HTTP_CODES && h->codes[e][i]; i++)
            n += (size_t)snprintf(t + n, cap - n,
                                  "neurollm_http_requests_total{endpoint=\"%s\",code=\"%d\"} "
                                  "%llu\n",
                                  ep_names[e], h->codes[e][i], (unsigned long long)h->counts[e][i]);
    n += (size_t)snprintf(t + n, cap - n,
                          "# HELP neurollm_http_requests_in_flight /v1 requests being answered.\n"
                          "# TYPE neurollm_http_requests_in_flight gauge\n"
                          "neurollm_http_requests_in_flight %d\n"
                          "# HELP neurollm_http_event_streams Open /api/events streams.\n"
                          "# TYPE neurollm_http_event_streams gauge\n"
                          "neurollm_http_event_streams %d\n",
                          h->in_flight, h->subscribers);
    pthread_mutex_unlock(&h->mu);
    size_t el = extra ? strlen(extra) : 0;
    char *all = malloc(n + el + 1);
    if (all) {
        memcpy(all, t, n);
        if (el)
            memcpy(all + n, extra, el);
        all[n + el] = 0;
    }
    free(t);
    free(extra);
    if (!all)
        return http_error(h, c, rq, 500, NULL, "out of memory");
    return http_reply(h, c, rq, 200, "text/plain; version=0.0.4; charset=utf-8", all, n + el);
}

/* ---------------------------------------------------------------- origin */

/* Whether the request's Host names this server in a way a page of another
 * site cannot make a browser send: an IP literal, localhost, or a name the
 * operator allowed (--http-allow-host). With DNS rebinding a page's own
 * name resolves to 127.0.0.1, and its requests carry that name. */
static int host_ok(const nl_http *h, struct MHD_Connection *c)
{
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host");
    char name[256];
    if (!v) /* HTTP/1.0 without Host: no browser sends that */
        return 1;
    const char *end = v[0] == '[' ? strchr(v, ']') : strchr(v, ':');
    const size_t n = v[0] == '[' ? (end ? (size_t)(end - v - 1) : 0)
                     : end       ? (size_t)(end - v)
                                 : strlen(v);
    if (n == 0 || n >= sizeof name)
        return 0;
    memcpy(name, v[0] == '[' ? v + 1 : v, n);
    name[n] = 0;
    for (size_t i = 0; i < n; i++)
        name[i] = (char)(name[i] >= 'A' && name[i] <= 'Z' ? name[i] + 32 : name[i]);
    unsigned char addr[16];
    if (inet_pton(AF_INET, name, addr) == 1 || inet_pton(AF_INET6, name, addr) == 1 ||
        strcmp(name, "localhost") == 0)
        return 1;
    for (const char *a = h->o.allow_hosts; a && *a;) {
        const char *comma = strchr(a, ',');
        const size_t len = comma ? (size_t)(comma - a) : strlen(a);
        if (len == n && strncasecmp(a, name, n) == 0)
            return 1;
        a = comma ? comma + 1 : a + len;
    }
    return 0;
}

/* Whether a POST says its body is JSON (a form or text/plain, what a page
 * may send another site without asking, is not). */
static int json_body(struct MHD_Connection *c)
{
    const char *t = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Type");
    const size_t n = strlen("application/json");
    return t && strncasecmp(t, "application/json", n) == 0 &&
           (t[n] == 0 || t[n] == ';' || t[n] == ' ');
}

int http_past_deadline(const nl_http *h, double t0)
{
    return nl_mono_s() - t0 > (double)h->o.deadline_s;
}

/* ---------------------------------------------------------------- routing */

static int route(const char *url, const char *method, int *ep, int *post)
{
    static const struct {
        const char *url;
        int ep, post;
    } r[] = {{"/v1/completions", EP_COMPLETIONS, 1},
             {"/v1/chat/completions", EP_CHAT, 1},
             {"/v1/embeddings", EP_EMBEDDINGS, 1},
             {"/v1/models", EP_MODELS, 0},
             {"/api/status", EP_STATUS, 0},
             {"/api/events", EP_EVENTS, 0},
             {"/metrics", EP_METRICS, 0},
             {"/", EP_DASHBOARD, 0},
             {"/static/chart.js", EP_STATIC, 0}};
    for (size_t i = 0; i < sizeof r / sizeof r[0]; i++)
        if (strcmp(url, r[i].url) == 0 ||
            (r[i].ep == EP_MODELS && strncmp(url, "/v1/models/", 11) == 0 && url[11])) {
            *ep = r[i].ep;
            *post = r[i].post;
            return strcmp(method, r[i].post ? "POST" : "GET") == 0 ||
                   (!r[i].post && strcmp(method, "HEAD") == 0);
        }
    *ep = EP_OTHER;
    *post = 0;
    return 0;
}

static enum MHD_Result dispatch(nl_http *h, struct MHD_Connection *c, http_req *rq)
{
    if (rq->too_large)
        return http_error(h, c, rq, 413, NULL, "request body over the %zu-byte limit",
                          h->o.max_body);
    switch (rq->ep) {
    case EP_COMPLETIONS:
        return http_completions(h, c, rq);
    case EP_CHAT:
        return http_chat(h, c, rq);
    case EP_EMBEDDINGS:
        return http_embeddings(h, c, rq);
    case EP_MODELS:
        return http_models(h, c, rq);
    case EP_EVENTS:
        return http_events(h, c, rq);
    case EP_METRICS:
        return http_metrics(h, c, rq);
    case EP_STATUS: {
        char *s = h->be.status_json ? h->be.status_json(h->be.ctx) : strdup("{}");
        if (!s)
            return http_error(h, c, rq, 500, NULL, "out of memory");
        return http_reply(h, c, rq, 200, "application/json", s, strlen(s));
    }
    case EP_DASHBOARD: {
        char *s = strdup(nl_http_dashboard_html);
        if (!s)
            return http_error(h, c, rq, 500, NULL, "out of memory");
        return http_reply(h, c, rq, 200, "text/html; charset=utf-8", s, strlen(s));
    }
    case EP_STATIC: {
        if (!h->chartjs)
            return http_error(h, c, rq, 404, NULL,
                              "Chart.js is not installed (Debian: libjs-chart.js)");
        char *s = malloc(h->chartjs_len ? h->chartjs_len : 1);
        if (!s)
            return http_error(h, c, rq, 500, NULL, "out of memory");
        memcpy(s, h->chartjs, h->chartjs_len);
        return http_reply(h, c, rq, 200, "application/javascript", s, h->chartjs_len);
    }
    default:
        return http_error(h, c, rq, 404, NULL, "no such endpoint");
    }
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls)
{
    nl_http *h = cls;
    http_req *rq = *con_cls;
    if (!rq) { /* the headers are in: decide what can be decided now */
        if (!(rq = calloc(1, sizeof *rq)))
            return MHD_NO;
        *con_cls = rq;
        int post = 0;
        const int routed = route(url, method, &rq->ep, &post);
        if (rq->ep == EP_MODELS && url[10] == '/' && !(rq->model_id = strdup(url + 11)))
            return MHD_NO;
        if (!routed) {
            if (rq->ep == EP_OTHER)
                return http_error(h, c, rq, 404, NULL, "no such endpoint: %s %s", method, url);
            return http_error(h, c, rq, 405, NULL, "%s takes %s", url, post ? "POST" : "GET");
        }
        /* without tokens any page a browser shows could call us: only our own names */
        if (h->n_tokens == 0 && !host_ok(h, c))
            return http_error(h, c, rq, 403, NULL,
                              "Host '%.100s' is not a name of this server (localhost, an address, "
                              "or --http-allow-host)",
                              MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host"));
        /* the page and Chart.js hold no data: a browser may load them to ask for a token */
        if (rq->ep != EP_DASHBOARD && rq->ep != EP_STATIC && !token_ok(h, c))
            return http_error(h, c, rq, 401, NULL, "a valid bearer token is required");
        if (post && !json_body(c))
            return http_error(h, c, rq, 415, NULL,
                              "a POST to %s takes Content-Type: application/json", url);
        if (rq->ep == EP_COMPLETIONS || rq->ep == EP_CHAT || rq->ep == EP_EMBEDDINGS) {
            pthread_mutex_lock(&h->mu);
            int busy = h->in_flight >= h->o.max_requests;
            if (!busy) {
                h->in_flight++;
                rq->counted = 1;
            }
            pthread_mutex_unlock(&h->mu);
            if (busy)
                return http_error(h, c, rq, 429, NULL, "%d requests are being answered already",
                                  h->o.max_requests);
        }
        return MHD_YES;
    }
    if (*upload_size) { /* body: keep up to the limit, drain the rest */
        size_t n = *upload_size;
        if (rq->too_large || rq->len + n > h->o.max_body) {
            rq->too_large = 1;
        } else {
            if (rq->len + n + 1 > rq->cap) {
                size_t cap = (rq->len + n + 1) * 2;
                cap = cap > h->o.max_body + 1 ? h->o.max_body + 1 : cap;
                char *p = realloc(rq->body, cap);
                if (!p)
                    return MHD_NO;
                rq->body = p;
                rq->cap = cap;
            }
            memcpy(rq->body + rq->len, upload_data, n);
            rq->len += n;
            rq->body[rq->len] = 0;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    return dispatch(h, c, rq);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode why)
{
    nl_http *h = cls;
    http_req *rq = *con_cls;
    if (!rq)
        return;
    if (rq->counted || rq->jobs) {
        pthread_mutex_lock(&h->mu);
        h->in_flight -= rq->counted;
        h->jobs -= rq->jobs;
        pthread_mutex_unlock(&h->mu);
    }
    free(rq->body);
    free(rq->model_id);
    free(rq);
    *con_cls = NULL;
}

/* ---------------------------------------------------------------- lifetime */

/* "HOST:PORT" or "[HOST]:PORT" into a socket address; *loopback says
 * whether it is 127.0.0.0/8 or ::1. */
static nl_status parse_addr(const char *addr, struct sockaddr_storage *ss, int *loopback,
                            nl_error *err)
{
    char host[128];
    const char *colon = strrchr(addr, ':');
    if (!colon || (size_t)(colon - addr) >= sizeof host || colon == addr)
        return nl_error_set(err, NL_ERR_INVALID, "--http %s: expected HOST:PORT", addr);
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = 0;
    char *end = NULL;
    long port = strtol(colon + 1, &end, 10);
    if (!*(colon + 1) || *end || port < 0 || port > 65535)
        return nl_error_set(err, NL_ERR_INVALID, "--http %s: port must be 0..65535", addr);
    memset(ss, 0, sizeof *ss);
    if (strcmp(host, "localhost") == 0)
        strcpy(host, "127.0.0.1");
    size_t hl = strlen(host);
    if (host[0] == '[' && hl > 2 && host[hl - 1] == ']') {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
        host[hl - 1] = 0;
        if (inet_pton(AF_INET6, host + 1, &a->sin6_addr) != 1)
            return nl_error_set(err, NL_ERR_INVALID, "--http %s: bad IPv6 address", addr);
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
        *loopback = IN6_IS_ADDR_LOOPBACK(&a->sin6_addr);
        return NL_OK;
    }
    struct sockaddr_in *a = (struct sockaddr_in *)ss;
    if (inet_pton(AF_INET, host, &a->sin_addr) != 1)
        return nl_error_set(err, NL_ERR_INVALID, "--http %s: bad IPv4 address", addr);
    a->sin_family = AF_INET;
    a->sin_port = htons((uint16_t)port);
    *loopback = (ntohl(a->sin_addr.s_addr) >> 24) == 127;
    return NL_OK;
}

static void load_chartjs(nl_http *h)
{
    const char *p = h->o.chartjs_path ? h->o.chartjs_path : DEFAULT_CHARTJS;
    FILE *f = fopen(p, "rb");
    if (!f)
        return;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n > 0 && n < (64L << 20) && fseek(f, 0, SEEK_SET) == 0 &&
            (h->chartjs = malloc((size_t)n)) != NULL) {
            if (fread(h->chartjs, 1, (size_t)n, f) == (size_t)n) {
                h->chartjs_len = (size_t)n;
            } else {
                free(h->chartjs);
                h->chartjs = NULL;
            }
        }
    }
    fclose(f);
}

nl_status nl_http_start(nl_http **out, const nl_http_opts *o, const nl_http_backend *b,
                        nl_error *err)
{
    *out = NULL;
    struct sockaddr_storage ss;
    int loopback = 0;
    nl_status st = parse_addr(o->addr, &ss, &loopback, err);
    if (st != NL_OK)
        return st;
    if (!loopback && !o->tokens_path)
        return nl_error_set(err, NL_ERR_AUTH,
                            "--http %s is not a loopback address: it needs --http-tokens FILE",
                            o->addr);
    if (sodium_init() < 0)
        return nl_error_set(err, NL_ERR_INTERNAL, "libsodium failed to initialise");
    nl_http *h = calloc(1, sizeof *h);
    if (!h)
        return nl_error_set(err, NL_ERR_NOMEM, "http: out of memory");
    h->be = *b;
    h->o = *o;
    h->o.max_body = o->max_body ? o->max_body : (size_t)1 << 20;
    h->o.max_requests = o->max_requests > 0 ? o->max_requests : 64;
    h->o.timeout_s = o->timeout_s > 0 ? o->timeout_s : 30;
    h->o.per_ip = o->per_ip > 0 ? o->per_ip : 32;
    h->o.deadline_s = o->deadline_s > 0 ? o->deadline_s : 600;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    if (o->tokens_path && (st = load_tokens(h, o->tokens_path, err)) != NL_OK) {
        nl_http_stop(&h);
        return st;
    }
    load_chartjs(h);
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                     MHD_USE_POLL | (ss.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0);
    h->d = MHD_start_daemon(
        flags, 0, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)h->o.timeout_s, MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)(h->o.max_requests + MAX_SUBSCRIBERS + 32), MHD_OPTION_NOTIFY_COMPLETED,
        on_completed, h, MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)256 << 10,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)h->o.per_ip, MHD_OPTION_END);
    if (!h->d) {
        int e = errno;
        nl_http_stop(&h);
        return nl_error_set(err, NL_ERR_IO, "--http %s: cannot listen: %s", o->addr, strerror(e));
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_LISTEN_FD);
    struct sockaddr_storage bound;
    socklen_t bl = sizeof bound;
    if (di && getsockname(di->listen_fd, (struct sockaddr *)&bound, &bl) == 0)
        h->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                    : ((struct sockaddr_in *)&bound)->sin_port);
    *out = h;
    return NL_OK;
}

int nl_http_port(const nl_http *h)
{
    return h->port;
}

void nl_http_stop(nl_http **hp)
{
    if (!hp || !*hp)
        return;
    nl_http *h = *hp;
    pthread_mutex_lock(&h->mu);
    h->stopping = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    if (h->d)
        MHD_stop_daemon(h->d);
    for (int i = 0; i < EVENT_RING; i++) {
        free(h->ring[i].type);
        free(h->ring[i].json);
    }
    if (h->tokens)
        sodium_memzero(h->tokens, (size_t)h->n_tokens * sizeof *h->tokens);
    free(h->tokens);
    free(h->chartjs);
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    free(h);
    *hp = NULL;
}

int http_stopping(nl_http *h)
{
    pthread_mutex_lock(&h->mu);
    int s = h->stopping;
    pthread_mutex_unlock(&h->mu);
    return s;
}
