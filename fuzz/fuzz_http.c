/* Fuzz target for the HTTP interface (serve/: libmicrohttpd and our
 * handlers behind it): the input is one connection's bytes, sent to a
 * server in this process over loopback, as a client anywhere could.
 *
 * Two servers are started on the first input, each on 127.0.0.1 at a port
 * the kernel picks, with the same backend: one without tokens (the rules
 * for loopback: a Host header that names this machine, a JSON Content-Type
 * on a POST) and one with a bearer token file (token "fuzz-token-0123456789"). The
 * input's first byte picks the server ('1': the one with tokens, anything
 * else the other); the rest is written to a fresh connection (from 127.0.0.2 to .251 in turn),
 * whose writing side is then shut, and the answer is read until the server closes it, or 300 ms
 * pass without a byte (an event stream, a keep-alive), or 1 MiB came.
 *
 * The backend answers at once, from nothing but the request: a generation
 * of up to 6 tokens (bytes "t0", "t1", ...; the logprobs it was asked for),
 * which withdraws its second token once when the seed is odd; prompt ids
 * outside a vocabulary of 256 refused as a backend refuses them; an
 * embedding of 4 floats; two models ("fuzz", "fuzz-lora"), the second with
 * a chat template of its own; a status object and a metrics line.
 *
 * Property: no crash and no sanitizer report; every answer begins with an
 * HTTP status line; and the server goes on answering: every 8th input is
 * followed by a GET /v1/models that must be answered 200 (with the token,
 * which the server without tokens ignores), and a connection refused for
 * a second fails the input. With
 * NL_FUZZ_HTTP_SHOW set, each answer's size and status line go to stderr
 * (what the seeds reach). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "serve/http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct fjob {
    int left, made, withdraw, logprobs;
    char text[16];
} fjob;

static nl_status f_start(void *ctx, const nl_http_completion *req, void **job, int *prompt_tokens,
                         nl_error *err)
{
    (void)ctx;
    for (int i = 0; req->prompt_ids && i < req->n_prompt_ids; i++)
        if (req->prompt_ids[i] < 0 || req->prompt_ids[i] >= 256)
            return nl_error_set(err, NL_ERR_RANGE, "prompt: id %d is outside the vocabulary (256)",
                                (int)req->prompt_ids[i]);
    fjob *j = calloc(1, sizeof *j);
    if (!j)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    j->left = req->max_tokens < 6 ? req->max_tokens : 6;
    j->withdraw = (int)(req->seed & 1);
    j->logprobs = req->logprobs;
    *prompt_tokens = req->prompt_ids ? req->n_prompt_ids : (int)(req->prompt_len / 2) + 1;
    *job = j;
    return NL_OK;
}

static nl_http_next f_next(void *ctx, void *job, int32_t *id, const char **text, size_t *len,
                           nl_http_logprob *lp, int timeout_ms, nl_error *err)
{
    (void)ctx, (void)timeout_ms, (void)err;
    fjob *j = job;
    if (j->withdraw && j->made == 2) { /* the second token is withdrawn: one stands */
        j->withdraw = 0;
        j->made = 1;
        *id = 1;
        return NL_HTTP_WITHDRAW;
    }
    if (j->made >= j->left)
        return NL_HTTP_DONE;
    *id = j->made;
    snprintf(j->text, sizeof j->text, "t%d", j->made);
    *text = j->text;
    *len = strlen(j->text);
    if (j->logprobs >= 0 && lp) {
        lp->logprob = -0.5f;
        lp->k = j->logprobs;
        for (int i = 0; i < lp->k; i++) {
            lp->top_ids[i] = i;
            lp->top[i] = -0.5f - (float)i;
        }
    }
    j->made++;
    return NL_HTTP_TOKEN;
}

static void f_end(void *ctx, void *job)
{
    (void)ctx;
    free(job);
}

static nl_status f_embed(void *ctx, int model, const char *text, size_t len, const int32_t *ids,
                         int n, float **vec, int *dim, int *tokens, nl_error *err)
{
    (void)ctx, (void)model, (void)text;
    for (int i = 0; ids && i < n; i++)
        if (ids[i] < 0 || ids[i] >= 256)
            return nl_error_set(err, NL_ERR_RANGE, "input: id %d is outside the vocabulary (256)",
                                (int)ids[i]);
    if (!(*vec = malloc(4 * sizeof(float))))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    for (int i = 0; i < 4; i++)
        (*vec)[i] = 0.25f * (float)i;
    *dim = 4;
    *tokens = ids ? n : (int)(len / 2) + 1;
    return NL_OK;
}

static char *f_template(void *ctx, int model)
{
    (void)ctx;
    if (model != 1)
        return NULL; /* the default */
    return strdup("{\"format\": \"neurollm-chat/1\", \"family\": \"llama2\", \"bos\": \"<s>\", "
                  "\"roles\": {\"system\": {\"prefix\": \"<<SYS>>\\n\", \"suffix\": "
                  "\"\\n<</SYS>>\\n\\n\"}, \"user\": {\"prefix\": \"[INST] \", \"suffix\": "
                  "\" [/INST]\"}, \"assistant\": {\"prefix\": \" \", \"suffix\": \" </s>\"}}, "
                  "\"generation\": \"\", \"system_in_user\": true}");
}

static size_t f_bytes(void *ctx, int32_t id, char *buf, size_t cap)
{
    (void)ctx;
    int n = snprintf(buf, cap, "t%d", (int)id);
    return n < 0 ? 0 : (size_t)n < cap ? (size_t)n : cap;
}

static char *f_status(void *ctx)
{
    (void)ctx;
    return strdup("{\"state\": \"ready\", \"nodes\": 0}");
}

static char *f_metrics(void *ctx)
{
    (void)ctx;
    return strdup("fuzz_backend_up 1\n");
}

static const char *const models[] = {"fuzz-lora"};

static nl_http *servers[2];
static int ports[2];

static void start_servers(void)
{
    nl_http_backend b = {
        .model_name = "fuzz",
        .models = models,
        .n_models = 1,
        .max_jobs = 8,
        .completion_start = f_start,
        .completion_next = f_next,
        .completion_end = f_end,
        .embed = f_embed,
        .chat_template = f_template,
        .token_bytes = f_bytes,
        .status_json = f_status,
        .metrics_text = f_metrics,
    };
    static char tokens[] = "/tmp/nl_fuzz_http_tokens_XXXXXX";
    int fd = mkstemp(tokens);
    if (fd < 0 || write(fd, "fuzz-token-0123456789\n", 22) != 22) {
        fprintf(stderr, "fuzz_http: cannot write a tokens file\n");
        abort();
    }
    close(fd);
    for (int s = 0; s < 2; s++) {
        nl_http_opts o = {.addr = "127.0.0.1:0",
                          .tokens_path = s ? tokens : NULL,
                          .max_body = 64 << 10,
                          .timeout_s = 2,
                          .deadline_s = 5};
        nl_error err = {0};
        if (nl_http_start(&servers[s], &o, &b, &err) != NL_OK) {
            fprintf(stderr, "fuzz_http: %s\n", err.msg);
            abort();
        }
        ports[s] = nl_http_port(servers[s]);
    }
    unlink(tokens); /* read at the start */
}

/* One connection to server s: the bytes sent, the writing side shut, the
 * answer read as the header says; its first bytes into head (16), its
 * size returned. */
static size_t exchange(int s, const uint8_t *data, size_t size, char *head)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)ports[s])};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    /* from 127.0.0.2 to 127.0.0.251 in turn: the connection this side
     * shuts first stays in TIME_WAIT for a minute, and one address's
     * 28K ports would run out in a long run (some 300 connections a
     * second) */
    static unsigned turn;
    struct sockaddr_in me = {.sin_family = AF_INET};
    me.sin_addr.s_addr = htonl(INADDR_LOOPBACK + 1 + turn++ % 250);
    int fd = -1;
    for (int tries = 0; fd < 0; tries++) { /* a second of refusals: the server stopped */
        if ((fd = socket(AF_INET, SOCK_STREAM, 0)) < 0 ||
            bind(fd, (struct sockaddr *)&me, sizeof me) != 0 ||
            connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
            if (tries == 50) {
                fprintf(stderr, "fuzz_http: the server accepts no connection: %s\n",
                        strerror(errno));
                abort();
            }
            if (fd >= 0)
                close(fd);
            fd = -1;
            usleep(20000);
        }
    }
    for (size_t off = 0; off < size;) { /* the server may answer and close before the end */
        ssize_t w = send(fd, data + off, size - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) /* libFuzzer's timer */
            continue;
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    shutdown(fd, SHUT_WR);
    char buf[4096];
    size_t got = 0;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    for (;;) {
        const int ready = poll(&p, 1, 300);
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready != 1 || got >= (1u << 20))
            break;
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        if (got < 16)
            memcpy(head + got, buf, (size_t)r < 16 - got ? (size_t)r : 16 - got);
        got += (size_t)r;
    }
    close(fd);
    return got;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static unsigned inputs;
    if (!servers[0])
        start_servers();
    const int s = size > 0 && data[0] == '1';
    if (size > 0)
        data++, size--;
    char head[16] = {0};
    const size_t got = exchange(s, data, size, head);
    if (getenv("NL_FUZZ_HTTP_SHOW")) /* to see what seeds reach */
        fprintf(stderr, "fuzz_http: %zu bytes: %.*s\n", got, (int)(got < 12 ? got : 12), head);
    if (got > 0 && (got < 9 || memcmp(head, "HTTP/1.", 7) != 0)) {
        fprintf(stderr, "fuzz_http: an answer that is not HTTP (%zu bytes)\n", got);
        abort();
    }
    /* every 8th input, the server that took it still answers a plain
     * request (a connection alone the kernel accepts for a hung server) */
    if (inputs++ % 8 == 0) {
        static const char ok[] = "GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                                 "Authorization: Bearer fuzz-token-0123456789\r\n\r\n";
        char h2[16] = {0};
        if (exchange(s, (const uint8_t *)ok, sizeof ok - 1, h2) < 12 ||
            memcmp(h2, "HTTP/1.1 200", 12) != 0) {
            fprintf(stderr, "fuzz_http: the server no longer answers GET /v1/models\n");
            abort();
        }
    }
    return 0;
}
