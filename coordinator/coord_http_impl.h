/* Private to neurocoord --http (coord_http.c: the client connection, the
 * status poller, lifetime; coord_http_jobs.c: completions and embeddings
 * as jobs; coord_http_report.c: status and metrics): the backend's state,
 * shared by the completion threads, the status poller and the
 * coordinator's loop (under mu, as coord_http.c says). */
#ifndef NL_COORD_HTTP_IMPL_H
#define NL_COORD_HTTP_IMPL_H

#include <jansson.h>
#include <pthread.h>

#include "coord_http.h"
#include "core/tokenizer.h"
#include "net/transport.h"

#define MAX_NODES 256
#define MAX_ADAPTERS 16

typedef struct seen_node {
    int64_t id;
    char state[16];
} seen_node;

struct nl_coord_http {
    nl_coord *coord;
    char name[256];
    /* --http-adapter: models of their own, each the cluster's weights with
     * an adapter file that every stage applies (params.adapter) */
    char *spec;                       /* the flag's copy, cut into names */
    const char *models[MAX_ADAPTERS]; /* names, after name */
    char *adapters[MAX_ADAPTERS];     /* absolute paths */
    int n_models;
    nl_net *net;
    nl_keypair kp;
    char endpoint[256];
    char server_key[NL_KEY_Z85_LEN + 1];
    int plaintext;
    nl_http *http;
    pthread_t poller;
    int poller_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    /* under mu */
    json_t *status; /* the last status, without its tokenizer */
    nl_tokenizer *tok;
    char *chat;             /* the cluster's chat template (JSON), or NULL: the default */
    pthread_mutex_t tok_mu; /* the encoder keeps a cache */
    int64_t vocab;
    int max_seq;
    uint64_t tokens, prompt_tokens, finished, cancelled, failed;
    int active;
    double tps;
    int have_train;
    int64_t train_step;
    double train_loss, eval_loss, train_tps;
    /* the poller's own: what the last status showed */
    seen_node seen[MAX_NODES];
    int nseen;
    int64_t epoch;
    char state[256];
};

/* Monotonic seconds. */
double coord_http_now(void);
/* A new client connection to the coordinator (the in-memory key). */
nl_status coord_http_open_client(nl_coord_http *h, nl_sock **out, nl_error *err);
/* Send JOB_CANCEL / JOB_QUERY {job}. */
nl_status coord_http_send_ref(nl_sock *s, nl_msg_type type, uint64_t job, nl_error *err);
/* The coordinator's status over s (NULL with err set). */
json_t *coord_http_query_status(nl_sock *s, nl_error *err);
/* Keep a status (takes st; its tokenizer and chat template once); with
 * diff (the poller only), publish what changed. */
void coord_http_take_status(nl_coord_http *h, json_t *st, int diff);

/* The nl_http_backend callbacks of the /v1 work (coord_http_jobs.c; see
 * serve/http.h for each one's contract). */
nl_status coord_http_gen_start(void *ctx, const nl_http_completion *rq, void **jobp, int *ptoks,
                               nl_error *err);
nl_http_next coord_http_gen_next(void *ctx, void *jp, int32_t *id, const char **text, size_t *len,
                                 nl_http_logprob *lp, int timeout_ms, nl_error *err);
void coord_http_gen_end(void *ctx, void *jp);
nl_status coord_http_embed(void *ctx, int model, const char *text, size_t len, const int32_t *ids,
                           int n, float **vec, int *dim, int *tokens, nl_error *err);
size_t coord_http_token_bytes(void *ctx, int32_t id, char *buf, size_t cap);
char *coord_http_chat_template(void *ctx, int model);

/* A status node's state ("?" when it has none). */
const char *coord_http_node_state(json_t *n);
/* The name of the weights served now (the backend's model_name_now). */
void coord_http_model_name(void *ctx, char *buf, size_t cap);
/* The backend's status_json and metrics_text (coord_http_report.c). */
char *coord_http_status(void *ctx);
char *coord_http_metrics(void *ctx);

#endif
