/* Private to neurocoord --http (coord_http.c, coord_http_report.c): the
 * backend's state, shared by the completion threads, the status poller
 * and the coordinator's loop (under mu, as coord_http.c says). */
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
    pthread_mutex_t tok_mu; /* the encoder keeps a cache */
    int64_t vocab;
    int max_seq;
    uint64_t tokens, prompt_tokens, finished, cancelled, failed;
    int active;
    double tps;
    int have_train;
    int64_t train_step;
    double train_loss, eval_loss, train_tps;
    int64_t train_dig_mismatches; /* the job's hops with disagreeing digests */
    int64_t train_verified, train_verify_mismatches; /* redone by a verifier; found wrong */
    /* the poller's own: what the last status showed */
    seen_node seen[MAX_NODES];
    int nseen;
    int64_t epoch;
    char state[256];
};

/* A status node's state ("?" when it has none). */
const char *coord_http_node_state(json_t *n);
/* The backend's status_json and metrics_text (coord_http_report.c). */
char *coord_http_status(void *ctx);
char *coord_http_metrics(void *ctx);

#endif
