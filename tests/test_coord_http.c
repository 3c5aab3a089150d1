/* neurocoord --http's own state, in-process (coordinator/coord_http.c):
 * the cluster's tokenizer follows its status. The first status's
 * tokenizer is loaded; the same one again is kept as it is; one that
 * learned ids since (a learn_vocab training job, a reload of another
 * model) replaces it, so the text of the new ids is no longer empty; a
 * status without one (a byte-level model) serves bytes. Every tokenizer
 * it held is freed at the end (ASan's leak check).
 *
 * A coordinator that refuses a completion's job and an embedding's for
 * want of room (the key's --max-jobs-per-key) makes both NL_ERR_LIMIT
 * (429) at once. An embedding whose connection to the coordinator fails
 * after its job went out (a fake coordinator takes the HELLO and the JOB_SUBMIT, then
 * the HTTP side's sockets are shut) ends at once with NL_ERR_STATE (503,
 * "cannot be reached"), not after 60 s of polling a dead socket; one
 * that the coordinator answers with an ERROR ends with its message. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "base/log.h"
#include "coordinator/coord_http_impl.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/check.h"

/* A status as the coordinator's JOB_QUERY 0 has it: the config and
 * (text not NULL) the tokenizer's file text. */
static json_t *status_with(const char *text, int64_t vocab)
{
    json_t *st = json_pack("{s:{s:I,s:I}}", "config", "vocab_size", (json_int_t)vocab,
                           "max_seq_len", (json_int_t)256);
    if (st && text)
        json_object_set_new(st, "tokenizer", json_string(text));
    return st;
}

/* The text the HTTP side gives id (as a completion's token). */
static size_t text_of(nl_coord_http *h, int32_t id, char *buf, size_t cap)
{
    return coord_http_token_bytes(h, id, buf, cap);
}

/* ---------------------------------------------------------------- embedding, socket lost */

typedef struct fake_coord {
    nl_sock *s;
    nl_net *client_net; /* the HTTP side's: shut once its job is in */
    int refuse;         /* refuse that many jobs as a full key does, then stop */
    int answer_error;   /* answer the job with an ERROR, as a coordinator refusing it */
    int submitted;
} fake_coord;

static void *fake_coord_main(void *arg)
{
    fake_coord *f = arg;
    nl_rx rx;
    nl_rx_init(&rx);
    nl_error err = {0};
    const double by = nl_mono_s() + 60.0;
    while (!f->submitted && nl_mono_s() < by) {
        if (nl_sock_recv(f->s, &rx, 100, &err) != NL_OK)
            continue;
        if (rx.msg.type == NL_MSG_HELLO)
            nl_sock_answer_hello(f->s, &rx, NL_ROLE_COORDINATOR, &err);
        else if (rx.msg.type == NL_MSG_JOB_SUBMIT && f->refuse > 0) {
            nl_wire_msg m; /* as coord_job_new answers a key at --max-jobs-per-key */
            nl_wire_msg_init(&m);
            nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
            m.u.job_status = (nl_msg_job_status){0, NL_JOB_FAILED, 0.0,
                                                 NL_CLIENT_TOO_MANY_JOBS
                                                 " of this key at once: 32 (neurocoord "
                                                 "--max-jobs-per-key); try again when one ends",
                                                 0};
            nl_sock_send(f->s, rx.rid, rx.rid_len, &m, &err);
            nl_wire_msg_free(&m);
            f->submitted += --f->refuse == 0;
        } else if (rx.msg.type == NL_MSG_JOB_SUBMIT && f->answer_error) {
            nl_wire_msg m;
            nl_wire_msg_init(&m);
            nl_wire_msg_reset(&m, NL_MSG_ERROR);
            m.u.error = (nl_msg_error){NL_ERR_AUTH, NL_MSG_JOB_SUBMIT, "this key may not embed"};
            nl_sock_send(f->s, rx.rid, rx.rid_len, &m, &err);
            nl_wire_msg_free(&m);
            f->submitted = 1;
        } else if (rx.msg.type == NL_MSG_JOB_SUBMIT) {
            f->submitted = 1;
        }
    }
    nl_rx_free(&rx);
    if (f->submitted && f->client_net) /* every socket of the HTTP side fails from now on */
        zmq_ctx_shutdown(nl_net_zmq_context(f->client_net));
    return NULL;
}

/* The HTTP side's backend (h) against a fake coordinator: refuse, the
 * number of jobs it refuses for a full key (0: it takes one, then the
 * HTTP side's sockets are shut). */
static nl_coord_http *fake_backend(fake_coord *f, nl_net **server_net, int refuse)
{
    nl_error err = {0};
    nl_coord_http *h = calloc(1, sizeof *h);
    pthread_mutex_init(&h->mu, NULL);
    pthread_mutex_init(&h->tok_mu, NULL);
    h->plaintext = 1;
    CHECK_OK(nl_net_new(server_net, NULL, &err), &err);
    CHECK_OK(nl_net_new(&h->net, NULL, &err), &err);
    nl_sock_opts so = {.type = ZMQ_ROUTER, .plaintext = true, .name = "fake-coord", .linger_ms = 0};
    CHECK_OK(nl_sock_new(&f->s, *server_net, &so, &err), &err);
    CHECK_OK(nl_sock_bind(f->s, "tcp://127.0.0.1:*", &err), &err);
    snprintf(h->endpoint, sizeof h->endpoint, "%s", f->s ? nl_sock_endpoint(f->s) : "");
    json_t *st = status_with(NULL, 256);
    json_object_set_new(st, "ready", json_true());
    coord_http_take_status(h, st, 0);
    f->refuse = refuse;
    f->client_net = refuse ? NULL : h->net;
    return h;
}

static void fake_backend_free(nl_coord_http *h, fake_coord *f, nl_net **server_net)
{
    nl_sock_destroy(&f->s);
    nl_net_destroy(server_net);
    nl_net_destroy(&h->net);
    coord_http_free_status(h);
    pthread_mutex_destroy(&h->tok_mu);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

/* A coordinator that refuses a completion's job and an embedding's for
 * the key's --max-jobs-per-key: both are NL_ERR_LIMIT (HTTP 429) at once,
 * the completion's before it is handed to the HTTP server. */
static void test_refused_for_room(void)
{
    nl_error err = {0};
    nl_net *server_net = NULL;
    fake_coord f = {0};
    nl_coord_http *h = fake_backend(&f, &server_net, 2);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, fake_coord_main, &f) == 0, "the fake coordinator's thread");
    const nl_http_completion rq = {
        .prompt_text = "hi", .prompt_len = 2, .max_tokens = 1, .top_p = 1.0, .logprobs = -1};
    void *job = NULL;
    int ptoks = 0;
    nl_status s = coord_http_gen_start(h, &rq, &job, &ptoks, &err);
    CHECK(s == NL_ERR_LIMIT && !job && strstr(err.msg, "--max-jobs-per-key"),
          "a completion refused for the key's jobs: %s: %s", nl_status_str(s), err.msg);
    if (job)
        coord_http_gen_end(h, job);
    float *vec = NULL;
    int dim = 0, toks = 0;
    nl_error e2 = {0};
    s = coord_http_embed(h, 0, "hello", 5, NULL, 0, &vec, &dim, &toks, &e2);
    CHECK(s == NL_ERR_LIMIT && !vec, "an embedding refused for the key's jobs: %s: %s",
          nl_status_str(s), e2.msg);
    pthread_join(th, NULL);
    fake_backend_free(h, &f, &server_net);
}

/* A coordinator that answers an embedding's job with an ERROR: the wait
 * ends with its message (a 500), not with the 60 s deadline. */
static void test_embed_error_answer(void)
{
    nl_error err = {0};
    nl_net *server_net = NULL;
    fake_coord f = {0};
    nl_coord_http *h = fake_backend(&f, &server_net, 0);
    f.client_net = NULL; /* the HTTP side's sockets stay up */
    f.answer_error = 1;
    pthread_t th;
    CHECK(pthread_create(&th, NULL, fake_coord_main, &f) == 0, "the fake coordinator's thread");
    float *vec = NULL;
    int dim = 0, toks = 0;
    nl_status s = coord_http_embed(h, 0, "hello", 5, NULL, 0, &vec, &dim, &toks, &err);
    pthread_join(th, NULL);
    CHECK(f.submitted, "the embed job did not reach the fake coordinator");
    CHECK(s == NL_ERR_INTERNAL && strstr(err.msg, "this key may not embed") && !vec,
          "an embedding answered with an ERROR: %s: %s", nl_status_str(s), err.msg);
    fake_backend_free(h, &f, &server_net);
}

static void test_embed_socket_lost(void)
{
    nl_error err = {0};
    nl_net *server_net = NULL;
    fake_coord f = {0};
    nl_coord_http *h = fake_backend(&f, &server_net, 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, fake_coord_main, &f) == 0, "the fake coordinator's thread");
    float *vec = NULL;
    int dim = 0, toks = 0;
    const double t0 = nl_mono_s();
    nl_status s = coord_http_embed(h, 0, "hello", 5, NULL, 0, &vec, &dim, &toks, &err);
    const double took = nl_mono_s() - t0;
    pthread_join(th, NULL);
    CHECK(f.submitted, "the embed job did not reach the fake coordinator");
    CHECK(s == NL_ERR_STATE && strstr(err.msg, "cannot be reached") && !vec,
          "an embedding whose socket failed: %s: %s (after %.1f s)", nl_status_str(s), err.msg,
          took);
    fake_backend_free(h, &f, &server_net);
}

int main(void)
{
    nl_log_set_level(NL_LOG_WARN);
    nl_error err = {0};
    nl_tokenizer *a = NULL, *b = NULL;
    char *ta = NULL, *tb = NULL;
    size_t la = 0, lb = 0;
    static const char corpus[] = "the cat sat on the mat; the cat ate the rat; the mat sat flat";
    const nl_tokenizer_train_opts to = nl_tokenizer_train_opts_default();
    CHECK_OK(nl_tokenizer_new_bytes(&a, &err), &err);
    CHECK_OK(nl_tokenizer_new_bytes(&b, &err), &err);
    if (!a || !b)
        return check_done("test_coord_http");
    CHECK_OK(nl_tokenizer_learn(b, corpus, sizeof corpus - 1, 8, &to, &err), &err);
    CHECK_OK(nl_tokenizer_save_buffer(a, &ta, &la, &err), &err);
    CHECK_OK(nl_tokenizer_save_buffer(b, &tb, &lb, &err), &err);
    const int32_t va = nl_tokenizer_vocab_size(a), vb = nl_tokenizer_vocab_size(b);
    CHECK(vb > va, "the tokenizer learned no ids (%d, %d)", va, vb);
    const uint8_t *want = NULL;
    size_t wn = 0;
    CHECK(nl_tokenizer_token_bytes(b, va, &want, &wn) == NL_OK, "id %d of the learned one", va);

    nl_coord_http *h = calloc(1, sizeof *h);
    pthread_mutex_init(&h->mu, NULL);
    pthread_mutex_init(&h->tok_mu, NULL);
    char buf[64];
    coord_http_take_status(h, status_with(ta, va), 0);
    const nl_tokenizer *first = h->tok;
    CHECK(first && nl_tokenizer_vocab_size(first) == va, "the first status's tokenizer");
    CHECK(text_of(h, va, buf, sizeof buf) == 0, "an id the tokenizer does not have yet has text");
    coord_http_take_status(h, status_with(ta, va), 0);
    CHECK(h->tok == first && h->n_old_toks == 0, "the same tokenizer was loaded again");
    /* the cluster learned ids (learn_vocab): the new ids have text */
    coord_http_take_status(h, status_with(tb, vb), 0);
    CHECK(h->tok && nl_tokenizer_vocab_size(h->tok) == vb,
          "the learned tokenizer was not taken: %d", h->tok ? nl_tokenizer_vocab_size(h->tok) : -1);
    const size_t n = text_of(h, va, buf, sizeof buf);
    CHECK(n == wn && want && memcmp(buf, want, n) == 0,
          "id %d after learn_vocab: %zu bytes '%.*s' (want '%.*s')", va, n, (int)n, buf, (int)wn,
          want ? (const char *)want : "");
    CHECK(h->n_old_toks == 1, "the replaced tokenizer is kept for the completions that hold it");
    /* a byte-level model: no tokenizer text, bytes */
    coord_http_take_status(h, status_with(NULL, 256), 0);
    CHECK(h->tok && nl_tokenizer_vocab_size(h->tok) == va && text_of(h, va, buf, sizeof buf) == 0,
          "a byte-level model after the learned one");
    CHECK(text_of(h, 'x', buf, sizeof buf) == 1 && buf[0] == 'x', "a byte's text");

    coord_http_free_status(h);
    pthread_mutex_destroy(&h->tok_mu);
    pthread_mutex_destroy(&h->mu);
    free(h);
    nl_tokenizer_destroy(&a);
    nl_tokenizer_destroy(&b);
    free(ta);
    free(tb);
    test_refused_for_room();
    test_embed_socket_lost();
    test_embed_error_answer();
    return check_done("test_coord_http");
}
