/* The HTTP interface (issue 17): an OpenAI-shaped API, a status and event
 * feed, Prometheus metrics and a dashboard page, on libmicrohttpd.
 *
 * The server knows no model. It parses and checks every request, enforces
 * the limits (body size, concurrent requests, connections per address,
 * slow clients, a non-streaming completion's deadline, bearer tokens off
 * loopback; without tokens, the Host header and a JSON Content-Type, so a
 * web page cannot drive it) and formats every answer; the work behind the endpoints is
 * a backend's: a table of callbacks that `neuroctl serve` fills from one
 * process's batched decoder and a coordinator can fill from its cluster.
 *
 * Endpoints: POST /v1/completions, POST /v1/chat/completions (messages
 * rendered to a prompt by the model's chat template, core/tokenizer/chat_template.h),
 * POST /v1/embeddings, GET /v1/models,
 * GET /api/status, GET /api/events (server-sent events), GET /metrics,
 * GET / (the dashboard) and GET /static/chart.js (Debian's Chart.js, when
 * installed). docs/serving.md describes them.
 *
 * Threads: libmicrohttpd runs one thread per connection; the backend's
 * callbacks are called from those threads concurrently and must be
 * thread-safe. nl_http_publish may be called from any thread.
 *
 * Ownership: nl_http_start copies the options and the backend table (not
 * what ctx points to, which must outlive the server); nl_http_stop(&h)
 * stops the daemon, waits for its connections and frees it (NULL-safe). */
#ifndef NL_SERVE_HTTP_H
#define NL_SERVE_HTTP_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

#define NL_HTTP_MAX_STOP 4
#define NL_HTTP_MAX_LOGPROBS 20 /* top alternatives a request may ask for */
#define NL_HTTP_MAX_N 16        /* choices of one request */

/* A completion request after the server checked every field. */
/* The most tokens a chat that names no max_tokens may make (its KV cache
 * is sized for them): the context's end where that comes first. */
#define NL_HTTP_CHAT_MAX_DEFAULT 4096

typedef struct nl_http_completion {
    const char *prompt_text; /* UTF-8, or NULL when ids are given */
    size_t prompt_len;
    const int32_t *prompt_ids; /* or NULL when text is given */
    int n_prompt_ids;
    int max_tokens;     /* >= 1, the backend refuses more than the context holds; 0:
                         * to the context's end, at most NL_HTTP_CHAT_MAX_DEFAULT (a chat
                         * that names no limit) */
    double temperature; /* >= 0; 0 is greedy */
    double top_p;       /* (0, 1] (the request's 0 is greedy) */
    uint64_t seed;
    int stream;
    int model;    /* the request's "model": 0 the backend's model_name, k its models[k - 1] */
    int logprobs; /* -1: none; k in 0..NL_HTTP_MAX_LOGPROBS: each token's log-probability and
                     the k most likely ids' (completion_next fills *lp) */
} nl_http_completion;

/* A sampled token's log-probability and the top k alternatives', from the
 * log-softmax of the model's logits (temperature 1, before top-p). */
typedef struct nl_http_logprob {
    float logprob;
    int k;
    int32_t top_ids[NL_HTTP_MAX_LOGPROBS];
    float top[NL_HTTP_MAX_LOGPROBS]; /* descending; ties to the lower id */
} nl_http_logprob;

/* What completion_next reports. */
typedef enum nl_http_next {
    NL_HTTP_TOKEN = 0, /* *id and its bytes are set */
    /* *id (set, with no bytes) ended the model's answer: its end token
     * (nl_chat_ends_answer); the generation is over, finish "stop" */
    NL_HTTP_END,
    NL_HTTP_WAIT,   /* nothing within the timeout; ask again */
    NL_HTTP_DONE,   /* max_tokens or the context reached */
    NL_HTTP_FAILED, /* err says why */
    /* *id: the tokens that stand; those after them are withdrawn (the
     * generation was run again without a node convicted of computing
     * wrong: docs/security.md), and the next ones replace them */
    NL_HTTP_WITHDRAW,
} nl_http_next;

typedef struct nl_http_backend {
    void *ctx;
    const char *model_name; /* what /v1/models lists first */
    /* Optional, where the weights change under the server (a cluster that
     * trains): the name of what is served now, written into buf; requests
     * may still give model_name. NULL: model_name is always the name. */
    void (*model_name_now)(void *ctx, char *buf, size_t cap);
    /* More models the backend serves (e.g. adapters on the same weights),
     * listed after model_name: a request selects one by its "model" field
     * (nl_http_completion.model, embed's model). With none, "model" is
     * not checked (any name is the one model, as OpenAI clients send a
     * fixed name); with some, a name that is neither model_name nor one of
     * them is answered 404. The array and strings must outlive the
     * server. */
    const char *const *models;
    int n_models;
    /* The jobs the backend runs at once for this server (each choice of a
     * completion one, an embeddings request one while it runs), or 0: no
     * bound. A request whose jobs would not fit is answered 429 before
     * the backend is asked (neurocoord --http: --max-jobs-per-key). */
    int max_jobs;
    /* Start a generation: *job for the calls below, *prompt_tokens the
     * prompt's length in tokens. Errors: NL_ERR_INVALID or NL_ERR_RANGE
     * (400; the message names the field), NL_ERR_CAPACITY (429),
     * NL_ERR_STATE (503), NL_ERR_UNSUPPORTED (501: e.g. logprobs where the
     * backend has none), others 500. */
    nl_status (*completion_start)(void *ctx, const nl_http_completion *req, void **job,
                                  int *prompt_tokens, nl_error *err);
    /* The next token within timeout_ms. Its bytes (*text, *len) stay valid
     * until the next call on the job; *lp is filled when the request asked
     * for logprobs. */
    nl_http_next (*completion_next)(void *ctx, void *job, int32_t *id, const char **text,
                                    size_t *len, nl_http_logprob *lp, int timeout_ms,
                                    nl_error *err);
    /* Cancel the generation if it still runs and free the job (a client
     * that went away ends here). */
    void (*completion_end)(void *ctx, void *job);
    /* The embedding of one input (text or ids) by model (as
     * nl_http_completion.model) into a malloc'd vector of *dim floats the
     * caller frees; *tokens its length in tokens. Same error mapping as
     * completion_start, and NL_ERR_UNSUPPORTED: 501. */
    nl_status (*embed)(void *ctx, int model, const char *text, size_t len, const int32_t *ids,
                       int n, float **vec, int *dim, int *tokens, nl_error *err);
    /* The chat template of model (as nl_http_completion.model) as malloc'd
     * JSON text (core/tokenizer/chat_template.h), or NULL for the default. May be
     * NULL itself: the default. */
    char *(*chat_template)(void *ctx, int model);
    /* The bytes of token id copied into buf (at most cap), for the text of
     * top_logprobs alternatives; returns the length (0: none). May be NULL
     * for a backend without logprobs. */
    size_t (*token_bytes)(void *ctx, int32_t id, char *buf, size_t cap);
    /* A malloc'd JSON object for /api/status (NULL: out of memory). */
    char *(*status_json)(void *ctx);
    /* Malloc'd Prometheus text appended to the server's own metrics. */
    char *(*metrics_text)(void *ctx);
} nl_http_backend;

typedef struct nl_http_opts {
    const char *addr;         /* "HOST:PORT" (port 0: any free port); IPv6 as [HOST]:PORT */
    const char *tokens_path;  /* bearer tokens, one a line; NULL: none (loopback only) */
    size_t max_body;          /* bytes; 0: 1 MiB */
    int max_requests;         /* concurrent /v1 requests before 429; 0: 64 */
    int timeout_s;            /* idle connection timeout; 0: 30 */
    const char *chartjs_path; /* NULL: /usr/share/javascript/chart.js/chart.min.js */
    int per_ip;               /* connections from one address at once; 0: 32 */
    int deadline_s;           /* a non-streaming completion's answer within; 0: 600 */
    /* Host names besides localhost and IP literals that requests may name
     * in their Host header when there are no tokens (comma-separated), or
     * NULL: a page of another site (DNS rebinding) is refused */
    const char *allow_hosts;
} nl_http_opts;

typedef struct nl_http nl_http;

/* Bind and start serving. A non-loopback address without tokens is
 * refused (NL_ERR_AUTH); a tokens file that cannot be read or holds no
 * token fails (NL_ERR_IO, NL_ERR_FORMAT). */
nl_status nl_http_start(nl_http **out, const nl_http_opts *o, const nl_http_backend *b,
                        nl_error *err);
void nl_http_stop(nl_http **h);
/* The bound port (the kernel's pick when the address said 0). */
int nl_http_port(const nl_http *h);

/* Append an event for /api/events: type (e.g. "request", "stats") and a
 * JSON object as text (copied). The last 512 are kept for new clients.
 * An object without a "time" gets one: when it was published, as
 * nl_http_time_now writes it. */
void nl_http_publish(nl_http *h, const char *type, const char *json);
/* The wall-clock time now, as events carry it: ISO 8601 in UTC with
 * milliseconds ("2026-01-31T12:00:00.123Z", 24 bytes and the NUL). */
void nl_http_time_now(char *out, size_t cap);

/* A backend's check of a prompt's n ids (*ids, malloc'd): NL_OK, or
 * NL_ERR_RANGE naming the first id outside the vocabulary 0..vocab-1
 * (400), with *ids freed and NULL. */
nl_status nl_http_prompt_in_vocab(int32_t **ids, int n, int64_t vocab, nl_error *err);

#endif
