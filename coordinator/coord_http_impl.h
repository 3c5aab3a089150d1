/* Private to neurocoord --http (coord_http.c: the client connection, the
 * status poller, lifetime; coord_http_jobs.c: completions and embeddings
 * as jobs; coord_http_events.c: what happens, as events with their times
 * and as the training job's card; coord_http_report.c: /api/status,
 * /metrics): the backend's state, shared by the completion threads, the
 * status poller and the coordinator's loop (under mu, as coord_http.c
 * says). */
#ifndef NL_COORD_HTTP_IMPL_H
#define NL_COORD_HTTP_IMPL_H

#include <jansson.h>
#include <pthread.h>

#include "coordinator/coord_http.h"
#include "core/tokenizer/tokenizer.h"
#include "net/client.h"
#include "net/transport.h"

#define MAX_NODES 256
#define MAX_ADAPTERS 16
#define TOK_KEY_BYTES 32

typedef struct seen_node {
    int64_t id;
    char state[16];
} seen_node;

#define STEP_EVENT_S 0.1 /* train_step events at most this often (the card has every step) */
#define CURVE_POINTS 512 /* a loss curve's points kept: past it, every other one goes */
#define CARD_MARKS 32    /* marks kept on a job's curve: past it, the oldest goes */

/* A loss curve by step, thinned as it grows so that a page opened late
 * still draws the whole run (TensorBoard's curves do the same). */
typedef struct loss_curve {
    int64_t step[CURVE_POINTS];
    float loss[CURVE_POINTS]; /* NAN: a non-finite loss */
    int n, stride;            /* every stride-th point offered is kept */
    int64_t offered;
} loss_curve;

/* Something that changed the run, marked on its curve at a step. */
typedef struct card_mark {
    int64_t step;
    char kind[16]; /* replan, grow, lost, rollback */
    char what[192];
} card_mark;

/* The last training job the coordinator reported on (its reports'
 * "start", "step", "done" ... events): what the dashboard's job card
 * shows, during the run and after it. Times are nl_mono_s()'s. */
typedef struct train_card {
    uint64_t job;       /* 0: no training job seen yet */
    char state[16];     /* running, done, cancelled, failed */
    char started[40];   /* when its start was reported (ISO 8601, UTC) */
    char message[1024]; /* the end's message ("done", "cancelled at step 12; ...") */
    int64_t start_step, step, steps, batch, seq;
    int stages, resumes;
    double loss, eval_loss, tps;         /* NAN: none yet */
    int64_t dig_mismatches;              /* the job's hops with disagreeing digests */
    int64_t verified, verify_mismatches; /* redone by a verifier; found wrong */
    int64_t eval_step;
    double t_start, t_end;  /* the start report, the end (0: running) */
    double t_first, t_last; /* the first step after the (re)start, the last step */
    int64_t first_step;
    loss_curve curve, eval_curve;
    card_mark marks[CARD_MARKS];
    int n_marks;
} train_card;

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
    json_t *status;                 /* the last status, without its tokenizer */
    nl_tokenizer *tok;              /* the cluster's tokenizer now (NULL: none) */
    uint8_t tok_key[TOK_KEY_BYTES]; /* what it was made from (coord_http_take_status) */
    int tok_known;                  /* tok_key holds a status's */
    nl_tokenizer **old_toks;        /* those it replaced: completions may hold them */
    int n_old_toks;
    char *chat;             /* the cluster's chat template (JSON), or NULL: the default */
    char *turn_end;         /* its assistant suffix (nl_chat_turn_end): an answer's end */
    pthread_mutex_t tok_mu; /* the encoder keeps a cache */
    int64_t vocab;
    int max_seq;
    uint64_t tokens, prompt_tokens, finished, cancelled, failed;
    int active;
    double tps;
    uint64_t coord_tokens; /* tokens the cluster generated, any client's (its status) */
    train_card train;
    double step_published; /* when the last train_step event went out (the loop's thread) */
    /* the poller's own: what the last status showed */
    seen_node seen[MAX_NODES];
    int nseen;
    int64_t epoch;
    char state[256];
};

/* A new client connection to the coordinator (the in-memory key;
 * net/client.h speaks the protocol: nl_client_send_ref, nl_mono_s). */
nl_status coord_http_open_client(nl_coord_http *h, nl_sock **out, nl_error *err);
/* The coordinator's status over s (NULL with err set). */
json_t *coord_http_query_status(nl_sock *s, nl_error *err);
/* Keep a status (takes st; its tokenizer when it is another than the
 * one kept, and its chat template); with diff (the poller only), publish
 * what changed. */
void coord_http_take_status(nl_coord_http *h, json_t *st, int diff);
/* Free what coord_http_take_status keeps (at stop): the status, the
 * tokenizers (the one now and those it replaced), the chat template and
 * its turn end. */
void coord_http_free_status(nl_coord_http *h);

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
/* Seconds a training job has left at now, from its mean step time so
 * far (NAN: not known yet, or not running). Under mu. */
double coord_http_train_eta(const train_card *t, double now);
/* Mark the running job's curve at step (no job running: nothing). Under mu. */
void coord_http_mark(train_card *t, int64_t step, const char *kind, const char *what);
/* The plan's stages in pipeline order, from a status's nodes: a new
 * array of {stage, node, id, device, state, layers, layers_text, busy}. */
json_t *coord_http_pipeline(json_t *nodes);

/* Events (coord_http_events.c). Publish an event o (consumed) of a type
 * on /api/events, stamped with the time it is recorded ("time", ISO 8601
 * UTC with milliseconds). Any thread, without mu. */
void coord_http_publish(nl_coord_http *h, const char *type, json_t *o);
/* What changed since the last status (joins, deaths, a new plan, the
 * cluster's state), as events. The poller's thread only. */
void coord_http_diff(nl_coord_http *h, json_t *st);
/* nl_coord_observe's callback: training reports become events and the
 * job card. The coordinator's loop thread. */
void coord_http_on_report(void *ctx, uint64_t job, int state, const char *msg, const char *json);
/* The backend's status_json and metrics_text (coord_http_report.c). */
char *coord_http_status(void *ctx);
char *coord_http_metrics(void *ctx);

#endif
