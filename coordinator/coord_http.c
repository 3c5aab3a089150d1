/* neurocoord --http: an nl_http_backend that is a client of the
 * coordinator it runs beside (see coord_http.h).
 *
 * Threads: libmicrohttpd's connection threads run the completions, each
 * on its own DEALER socket; the poller thread owns one more socket for
 * the status; the coordinator's loop thread calls coord_http_on_report. Everything
 * they share lives under h->mu. */
#include "coordinator/coord_http.h"
#include "coordinator/coord_http_impl.h"
#include "core/model/lora.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/tokenizer.h"
#include "net/transport.h"

#define HELLO_MS 5000
#define POLL_MS 500

/* ---------------------------------------------------------------- client */

/* A connection of this server to the coordinator's clients' endpoint
 * (net/client.h): control-sized, its own key admitted in memory. */
nl_status coord_http_open_client(nl_coord_http *h, nl_sock **out, nl_error *err)
{
    const nl_client_opts co = {.endpoint = h->endpoint,
                               .keys = &h->kp,
                               .server_key = h->server_key,
                               .plaintext = h->plaintext,
                               .name = "http-client",
                               .kind = NL_SOCK_CONTROL,
                               .timeout_ms = HELLO_MS};
    return nl_client_connect(out, h->net, &co, err);
}

/* The status as JSON (the caller decrefs), or NULL. */
json_t *coord_http_query_status(nl_sock *s, nl_error *err)
{
    json_t *out = NULL;
    nl_client_status(s, nl_mono_s() + 5.0, &out, err);
    return out;
}

/* What identifies the cluster's tokenizer in a status: a BLAKE2b of its
 * text, or (none: a byte-level model) of the vocabulary's size. */
static void tokenizer_key(uint8_t key[TOK_KEY_BYTES], const json_t *t, int64_t vocab)
{
    if (json_is_string(t)) {
        crypto_generichash(key, TOK_KEY_BYTES, (const unsigned char *)json_string_value(t),
                           json_string_length(t), (const unsigned char *)"text", 4);
    } else {
        const unsigned char v[8] = {(unsigned char)vocab, (unsigned char)(vocab >> 8),
                                    (unsigned char)(vocab >> 16), (unsigned char)(vocab >> 24)};
        crypto_generichash(key, TOK_KEY_BYTES, v, sizeof v, (const unsigned char *)"none", 4);
    }
}

/* Keep the status, and the tokenizer when it is another than the one
 * kept (the first status, a learn_vocab job, a reload of another model):
 * the one it replaces is retired, not freed, as completion threads may
 * still hold it; with diff (the poller's thread only), say what changed. */
void coord_http_take_status(nl_coord_http *h, json_t *st, int diff)
{
    nl_tokenizer *tok = NULL;
    json_t *t = json_object_get(st, "tokenizer"), *cfg = json_object_get(st, "config");
    int64_t vocab = json_integer_value(json_object_get(cfg, "vocab_size"));
    uint8_t key[TOK_KEY_BYTES];
    tokenizer_key(key, t, vocab);
    pthread_mutex_lock(&h->mu);
    const int need_tok = !h->tok_known || memcmp(key, h->tok_key, sizeof key) != 0;
    pthread_mutex_unlock(&h->mu);
    nl_error e = {0};
    if (need_tok && json_is_string(t) &&
        nl_tokenizer_load_buffer(&tok, json_string_value(t), json_string_length(t), &e) != NL_OK)
        NL_WARN("http: the cluster's tokenizer: %s", e.msg);
    else if (need_tok && !json_is_string(t) && vocab > 0 && vocab <= 256)
        nl_tokenizer_new_bytes(&tok, &e);
    json_object_del(st, "tokenizer");
    const char *ct = json_string_value(json_object_get(st, "chat_template"));
    char *chat = ct ? strdup(ct) : NULL;
    char *turn_end = nl_chat_turn_end(ct); /* NULL (out of memory): no end token */
    json_object_del(st, "chat_template");
    if (diff)
        coord_http_diff(h, st);
    pthread_mutex_lock(&h->mu);
    json_decref(h->status);
    h->status = st;
    h->vocab = vocab;
    h->max_seq = (int)json_integer_value(json_object_get(cfg, "max_seq_len"));
    const json_int_t made = json_integer_value(json_object_get(st, "tokens_generated"));
    if (made > 0 && (uint64_t)made > h->coord_tokens)
        h->coord_tokens = (uint64_t)made;
    if (need_tok && (!h->tok_known || memcmp(key, h->tok_key, sizeof key) != 0)) {
        nl_tokenizer **old = h->old_toks;
        if (h->tok && !(old = realloc(old, (size_t)(h->n_old_toks + 1) * sizeof *old))) {
            NL_WARN("http: out of memory for the cluster's new tokenizer (the next status "
                    "tries again)");
        } else {
            h->old_toks = old;
            if (h->tok)
                h->old_toks[h->n_old_toks++] = h->tok;
            if (h->tok_known)
                NL_INFO("http: the cluster's tokenizer changed: %d ids",
                        tok ? (int)nl_tokenizer_vocab_size(tok) : 0);
            h->tok = tok; /* NULL: a tokenizer that does not load serves no text */
            tok = NULL;
            memcpy(h->tok_key, key, sizeof key);
            h->tok_known = 1;
        }
    }
    free(h->chat);
    h->chat = chat;
    free(h->turn_end);
    h->turn_end = turn_end;
    pthread_mutex_unlock(&h->mu);
    nl_tokenizer_destroy(&tok);
}

void coord_http_free_status(nl_coord_http *h)
{
    json_decref(h->status);
    h->status = NULL;
    free(h->chat);
    h->chat = NULL;
    free(h->turn_end);
    h->turn_end = NULL;
    nl_tokenizer_destroy(&h->tok);
    for (int i = 0; i < h->n_old_toks; i++)
        nl_tokenizer_destroy(&h->old_toks[i]);
    free(h->old_toks);
    h->old_toks = NULL;
    h->n_old_toks = 0;
    h->tok_known = 0;
}

static void *poller_main(void *arg)
{
    nl_coord_http *h = arg;
    nl_sock *s = NULL;
    nl_error e = {0};
    double last_tick = nl_mono_s(), last_stats = 0.0;
    uint64_t last_tokens = UINT64_MAX; /* the cluster's count at last_tick */
    pthread_mutex_lock(&h->mu);
    while (!h->stop) {
        pthread_mutex_unlock(&h->mu);
        if (!s && coord_http_open_client(h, &s, &e) != NL_OK)
            NL_WARN("http: status: %s", e.msg);
        json_t *st = s ? coord_http_query_status(s, &e) : NULL;
        if (st)
            coord_http_take_status(h, st, 1);
        else if (s) { /* the connection may be stale: open another next time */
            NL_WARN("http: status: %s", e.msg);
            nl_sock_destroy(&s);
        }
        pthread_mutex_lock(&h->mu);
        const double t = nl_mono_s();
        /* tokens/s of every generation on the cluster, HTTP's and other
         * clients' (neuroctl generate), from the coordinator's count */
        if (last_tokens == UINT64_MAX) {
            last_tokens = h->coord_tokens;
            last_tick = t;
        } else if (t - last_tick >= 1.0) {
            h->tps = (double)(h->coord_tokens - last_tokens) / (t - last_tick);
            last_tokens = h->coord_tokens;
            last_tick = t;
        }
        const int training = h->train.job && strcmp(h->train.state, "running") == 0;
        const int busy = h->active > 0 || h->tps > 0 || training;
        if (t - last_stats >= (busy ? 1.0 : 10.0)) {
            json_t *o = json_pack("{s:f,s:i,s:I,s:I}", "tokens_per_s", h->tps, "active", h->active,
                                  "tokens", (json_int_t)h->coord_tokens, "http_tokens",
                                  (json_int_t)h->tokens);
            if (o && training && isfinite(h->train.tps)) /* the training job's, once a second */
                json_object_set_new(o, "train_tokens_per_s", json_real(h->train.tps));
            pthread_mutex_unlock(&h->mu);
            coord_http_publish(h, "stats", o);
            pthread_mutex_lock(&h->mu);
            last_stats = t;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += POLL_MS * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        if (!h->stop)
            pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    }
    pthread_mutex_unlock(&h->mu);
    nl_sock_destroy(&s);
    return NULL;
}

/* ---------------------------------------------------------------- start, stop */

/* The clients' endpoint as a client on this host reaches it. */
static void local_endpoint(char *out, size_t cap, const char *ep)
{
    const char *host = strstr(ep, "://");
    const char *colon = strrchr(ep, ':');
    host = host ? host + 3 : ep;
    if (colon && colon > host && (strncmp(host, "0.0.0.0:", 8) == 0 || strncmp(host, "*:", 2) == 0))
        snprintf(out, cap, "tcp://127.0.0.1%s", colon);
    else
        snprintf(out, cap, "%s", ep);
}

/* --http-adapter NAME=FILE[,NAME=FILE...]: each name unique and not the
 * base's, each file there (made absolute: the coordinator confines it to
 * its --checkpoint-root at each request, the nodes to theirs). */
static nl_status parse_adapters(nl_coord_http *h, const char *spec, nl_error *err)
{
    if (!spec || !*spec)
        return NL_OK;
    if (!(h->spec = strdup(spec)))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    char *save = NULL;
    for (char *item = strtok_r(h->spec, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq || eq == item || !eq[1])
            return nl_error_set(err, NL_ERR_INVALID, "--http-adapter: '%.200s' is not NAME=FILE",
                                item);
        *eq = '\0';
        if (h->n_models == MAX_ADAPTERS)
            return nl_error_set(err, NL_ERR_INVALID, "--http-adapter: more than %d adapters",
                                MAX_ADAPTERS);
        int dup = strcmp(item, h->name) == 0;
        for (int i = 0; i < h->n_models; i++)
            dup |= strcmp(item, h->models[i]) == 0;
        if (dup)
            return nl_error_set(err, NL_ERR_INVALID, "--http-adapter: the name '%.200s' is taken",
                                item);
        char *path = realpath(eq + 1, NULL);
        if (!path)
            return nl_error_set(err, NL_ERR_IO, "--http-adapter %s: %.300s: %s", item, eq + 1,
                                strerror(errno));
        h->models[h->n_models] = item;
        h->adapters[h->n_models++] = path;
    }
    return NL_OK;
}

nl_status nl_coord_http_start(nl_coord_http **out, nl_coord *c, const char *name,
                              const char *adapters, const char *state_dir, int plaintext,
                              const nl_http_opts *ho, nl_error *err)
{
    *out = NULL;
    nl_coord_http *h = calloc(1, sizeof *h);
    if (!h)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    h->coord = c;
    snprintf(h->name, sizeof h->name, "%s", name);
    h->plaintext = plaintext;
    h->train.loss = h->train.eval_loss = h->train.tps = NAN;
    h->epoch = -1;
    pthread_mutex_init(&h->mu, NULL);
    pthread_mutex_init(&h->tok_mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    local_endpoint(h->endpoint, sizeof h->endpoint, nl_coord_client_endpoint(c));
    nl_net_opts no = nl_net_opts_default();
    char path[4096];
    snprintf(path, sizeof path, "%s/coordinator.pub", state_dir);
    nl_status st;
    if ((st = parse_adapters(h, adapters, err)) != NL_OK)
        goto fail;
    /* each adapter against the checkpoint the cluster serves, hashed once
     * (and kept for the jobs that name them) */
    const char *base = nl_coord_model_file(c);
    char hex[65] = "";
    if (h->n_models && base &&
        (st = nl_lora_check_bases_hex((const char *const *)h->adapters, h->n_models, base, hex,
                                      err)) != NL_OK) {
        nl_error_prefix(err, "--http-adapter");
        goto fail;
    }
    if (hex[0])
        nl_coord_model_hashed(c, hex);
    if (!plaintext && ((st = nl_keys_load_public(h->server_key, path, err)) != NL_OK ||
                       (st = nl_keys_generate(&h->kp, err)) != NL_OK ||
                       (st = nl_coord_admit_key(c, h->kp.public_z85, err)) != NL_OK))
        goto fail;
    if ((st = nl_net_new(&h->net, &no, err)) != NL_OK)
        goto fail;
    nl_http_backend b = {.ctx = h,
                         .model_name = h->name,
                         .model_name_now = coord_http_model_name,
                         .models = h->models,
                         .n_models = h->n_models,
                         .max_jobs = nl_coord_max_jobs_per_key(c),
                         .completion_start = coord_http_gen_start,
                         .completion_next = coord_http_gen_next,
                         .completion_end = coord_http_gen_end,
                         .embed = coord_http_embed,
                         .chat_template = coord_http_chat_template,
                         .token_bytes = coord_http_token_bytes,
                         .status_json = coord_http_status,
                         .metrics_text = coord_http_metrics};
    if ((st = nl_http_start(&h->http, ho, &b, err)) != NL_OK)
        goto fail;
    nl_coord_observe(c, coord_http_on_report, h);
    if (pthread_create(&h->poller, NULL, poller_main, h) != 0) {
        st = nl_error_set(err, NL_ERR_INTERNAL, "cannot start the status poller");
        goto fail;
    }
    h->poller_started = 1;
    *out = h;
    return NL_OK;
fail:
    nl_error_prefix(err, "--http");
    nl_coord_http_stop(&h);
    return st;
}

void nl_coord_http_stop(nl_coord_http **hp)
{
    nl_coord_http *h = *hp;
    if (!h)
        return;
    *hp = NULL;
    nl_coord_observe(h->coord, NULL, NULL);
    pthread_mutex_lock(&h->mu);
    h->stop = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    if (h->poller_started)
        pthread_join(h->poller, NULL);
    nl_http_stop(&h->http); /* waits for the connections, which end their jobs */
    nl_net_destroy(&h->net);
    nl_keys_wipe(&h->kp);
    coord_http_free_status(h);
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->tok_mu);
    pthread_mutex_destroy(&h->mu);
    for (int i = 0; i < h->n_models; i++)
        free(h->adapters[i]);
    free(h->spec);
    free(h);
}

int nl_coord_http_port(const nl_coord_http *h)
{
    return nl_http_port(h->http);
}
