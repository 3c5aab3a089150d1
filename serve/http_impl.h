/* Private to serve/: the server's state, shared by http.c (the daemon,
 * routing, limits, tokens, events, metrics, static pages), http_api.c
 * (the /v1 requests: fields, chat rendering, embeddings, models) and
 * http_gen.c (running a completion's choices and formatting the answer or
 * the event stream). Split by concern to keep each file short. */
#ifndef NL_SERVE_HTTP_IMPL_H
#define NL_SERVE_HTTP_IMPL_H

#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>

#include "base/clock.h"
#include "serve/http.h"

enum {
    EP_COMPLETIONS,
    EP_CHAT,
    EP_EMBEDDINGS,
    EP_MODELS,
    EP_STATUS,
    EP_EVENTS,
    EP_METRICS,
    EP_DASHBOARD,
    EP_STATIC,
    EP_OTHER,
    EP_COUNT
};
#define HTTP_CODES 10 /* distinct status codes counted per endpoint */
#define EVENT_RING 512

typedef struct http_event {
    uint64_t seq;
    char *type, *json;
} http_event;

struct nl_http {
    struct MHD_Daemon *d;
    nl_http_backend be;
    nl_http_opts o;
    int port;
    unsigned char (*tokens)[32]; /* BLAKE2b of each bearer token */
    int n_tokens;
    char *chartjs; /* the file, or NULL */
    size_t chartjs_len;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* events published, or stopping */
    int stopping;
    int in_flight;   /* /v1 requests being answered */
    int jobs;        /* the backend's jobs they hold (be.max_jobs) */
    int subscribers; /* /api/events streams open */
    uint64_t next_seq;
    http_event ring[EVENT_RING];
    int codes[EP_COUNT][HTTP_CODES];
    uint64_t counts[EP_COUNT][HTTP_CODES];
    uint64_t created_id; /* completion ids */
};

/* One request as it arrives. */
typedef struct http_req {
    int ep;
    int counted; /* holds a slot of in_flight */
    int jobs;    /* ... and this many of the backend's jobs (http_hold_jobs) */
    char *body;
    size_t len, cap;
    int too_large;
    char *model_id; /* GET /v1/models/{model_id} (malloc'd), else NULL */
} http_req;

/* Queue a JSON (or other) reply, count it; takes ownership of text. */
enum MHD_Result http_reply(nl_http *h, struct MHD_Connection *c, http_req *rq, int code,
                           const char *ctype, char *text, size_t len);
/* {"error": {"message", "type", "param", "code"}} with the given code
 * (message and param as valid UTF-8; code null). */
enum MHD_Result http_error(nl_http *h, struct MHD_Connection *c, http_req *rq, int code,
                           const char *param, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
void http_count(nl_http *h, int ep, int code);
/* The HTTP code of a backend's status. */
int http_code_of(nl_status st);
/* Hold n of the backend's jobs for rq until it ends (be.max_jobs): 0, or
 * -1 when they would not fit, the 429 answer queued in *res. */
int http_hold_jobs(nl_http *h, struct MHD_Connection *c, http_req *rq, int n, enum MHD_Result *res);

/* Whether nl_http_stop has begun (streams end). */
int http_stopping(nl_http *h);
/* Whether a non-streaming completion begun at t0 (nl_mono_s) is past
 * its deadline (nl_http_opts.deadline_s). */
int http_past_deadline(const nl_http *h, double t0);

/* A completion or chat request after its fields were checked. */
typedef struct gen_req {
    nl_http_completion c; /* c.seed is choice 0's; choice i uses seed + i (mod 2^63) */
    int32_t *ids;         /* owned: prompt ids */
    char *rendered;       /* owned: a chat's prompt text */
    const char *stops[NL_HTTP_MAX_STOP];
    int n_stop;
    int n;             /* choices, 1..NL_HTTP_MAX_N */
    int chat;          /* answer in the chat.completion shapes */
    int include_usage; /* stream_options.include_usage */
} gen_req;

/* Run req's choices and answer (whole, or as server-sent events); req
 * stays the caller's. */
enum MHD_Result http_generate(nl_http *h, struct MHD_Connection *c, http_req *rq,
                              const gen_req *req);
/* The name answers carry for model k; the backend's own (0) may be
 * written into buf (256 bytes). */
const char *http_model_name(const nl_http *h, int model, char *buf);
/* Valid UTF-8 of s[0..n) as a JSON string (invalid bytes U+FFFD); unless
 * final an incomplete sequence at the end is left out (*used: bytes
 * taken; may be NULL). */
json_t *http_json_text(const char *s, size_t n, int final, size_t *used);

/* /v1 endpoints (http_api.c). */
enum MHD_Result http_completions(nl_http *h, struct MHD_Connection *c, http_req *rq);
enum MHD_Result http_chat(nl_http *h, struct MHD_Connection *c, http_req *rq);
enum MHD_Result http_embeddings(nl_http *h, struct MHD_Connection *c, http_req *rq);
enum MHD_Result http_models(nl_http *h, struct MHD_Connection *c, http_req *rq);

/* The dashboard page (dashboard.c). */
extern const char nl_http_dashboard_html[];

#endif
