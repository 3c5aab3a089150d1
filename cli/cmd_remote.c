/* neuroctl's cluster commands: forward, generate and status through a
 * coordinator (--coordinator ENDPOINT --key CLIENT.key --coordinator-key
 * COORD.pub, or --cluster DIR for a local cluster made by `cluster up`). */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/args.h"
#include "cli_io.h"
#include "commands.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "core/tokenizer.h"
#include "net/transport.h"

#define REMOTE_FLAGS                                                                               \
    {"coordinator", 1, "coordinator endpoint, e.g. tcp://host:7000", NULL},                      \
        {"key", 1, "this client's secret key file (neuroctl keygen)", NULL},                     \
        {"coordinator-key", 1, "file with the coordinator's Z85 public key", NULL},              \
        {"cluster", 1, "a local cluster's directory (cluster up): sets the three above", NULL},  \
        {"timeout", 1, "seconds to wait for an answer (default 60)", NULL},                      \
        {"plaintext", 0, "INSECURE: no CURVE (only against a --plaintext coordinator)", NULL}

typedef struct remote {
    nl_net *net;
    nl_sock *s;
    nl_keypair kp;
    int timeout_ms;
} remote;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void remote_close(remote *r)
{
    nl_sock_destroy(&r->s);
    nl_net_destroy(&r->net);
    nl_keys_wipe(&r->kp);
}

/* Read a one-line file (the endpoint a coordinator wrote). */
static nl_status read_line(const char *path, char *out, size_t cap, nl_error *err)
{
    char *buf = NULL;
    size_t n = 0;
    nl_status st = nl_file_read_all(path, 4096, &buf, &n, err);
    if (st != NL_OK)
        return st;
    while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' '))
        buf[--n] = '\0';
    if (n == 0 || n >= cap)
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: expected one line", path);
    else
        memcpy(out, buf, n + 1);
    free(buf);
    return st;
}

static nl_status remote_open(remote *r, const nl_flag *flags, nl_error *err)
{
    memset(r, 0, sizeof *r);
    char ep[512], keyp[4096], coordp[4096], coord_key[NL_KEY_Z85_LEN + 1];
    const char *dir = nl_args_get(flags, "cluster");
    const char *e = nl_args_get(flags, "coordinator"), *k = nl_args_get(flags, "key"),
               *ck = nl_args_get(flags, "coordinator-key");
    const int plain = nl_args_get(flags, "plaintext") != NULL;
    long long t = 60;
    if (nl_args_int(flags, "timeout", 1, 86400, &t))
        return nl_error_set(err, NL_ERR_INVALID, "--timeout: bad value");
    r->timeout_ms = (int)(t * 1000);
    nl_status st = NL_OK;
    if (dir) {
        char p[4096];
        snprintf(p, sizeof p, "%s/coord/endpoint", dir);
        if ((st = read_line(p, ep, sizeof ep, err)) != NL_OK)
            return nl_error_prefix(err, "--cluster %s (is it up?)", dir);
        snprintf(keyp, sizeof keyp, "%s/client.key", dir);
        snprintf(coordp, sizeof coordp, "%s/coord/coordinator.pub", dir);
        e = ep;
        k = keyp;
        ck = coordp;
    }
    if (!e || (!plain && (!k || !ck)))
        return nl_error_set(err, NL_ERR_INVALID,
                            "give --coordinator, --key and --coordinator-key (or --cluster DIR)");
    if (!plain && ((st = nl_keys_load_secret(&r->kp, k, err)) != NL_OK ||
                   (st = nl_keys_load_public(coord_key, ck, err)) != NL_OK))
        return st;
    if (plain)
        fprintf(stderr, "warning: --plaintext: nothing is encrypted or authenticated\n");
    nl_net_opts no = nl_net_opts_default();
    nl_sock_opts so = {.type = ZMQ_DEALER,
                       .keys = plain ? NULL : &r->kp,
                       .server_key = plain ? NULL : coord_key,
                       .plaintext = plain,
                       .name = "client",
                       .linger_ms = 0};
    nl_rx rx;
    nl_rx_init(&rx);
    if ((st = nl_net_new(&r->net, &no, err)) != NL_OK ||
        (st = nl_sock_new(&r->s, r->net, &so, err)) != NL_OK ||
        (st = nl_sock_connect(r->s, e, err)) != NL_OK ||
        (st = nl_sock_hello(r->s, NL_ROLE_CLIENT, r->timeout_ms, &rx, err)) != NL_OK)
        nl_error_prefix(err, "coordinator %s", e);
    nl_rx_free(&rx);
    return st;
}

/* Wait for the next message; a timeout or an ERROR becomes an error. */
static nl_status remote_recv(remote *r, nl_rx *rx, double deadline, nl_error *err)
{
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0)
            return nl_error_set(err, NL_ERR_TIMEOUT, "no answer from the coordinator in time");
        nl_rx_free(rx);
        nl_rx_init(rx);
        nl_status st = nl_sock_recv(r->s, rx, (int)(left * 1000) + 1, err);
        if (st == NL_ERR_TIMEOUT)
            continue;
        if (st != NL_OK)
            return st;
        if (rx->msg.type == NL_MSG_ERROR)
            return nl_error_set(err, (nl_status)rx->msg.u.error.code, "coordinator: %s",
                                rx->msg.u.error.message);
        return NL_OK;
    }
}

/* Fetch the cluster status JSON (the caller frees it with json_decref). */
static nl_status remote_status(remote *r, json_t **out, nl_error *err)
{
    nl_wire_msg m;
    nl_rx rx;
    nl_wire_msg_init(&m);
    nl_rx_init(&rx);
    nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
    m.u.job_ref.job_id = 0;
    nl_status st = nl_sock_send(r->s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    double deadline = now_s() + r->timeout_ms / 1e3;
    while (st == NL_OK && (st = remote_recv(r, &rx, deadline, err)) == NL_OK) {
        if (rx.msg.type != NL_MSG_JOB_STATUS || rx.msg.u.job_status.job_id != 0 ||
            rx.msg.nframes != 1)
            continue;
        json_error_t je;
        *out = json_loadb(rx.msg.frames[0].t.data, rx.msg.frames[0].len, 0, &je);
        if (!*out)
            st = nl_error_set(err, NL_ERR_PROTO, "status: bad JSON: %s", je.text);
        break;
    }
    nl_rx_free(&rx);
    return st;
}

static nl_status submit(remote *r, nl_job_kind kind, const nl_wire_param *ps, int np,
                        const int32_t *ids, int B, int T, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){(uint32_t)kind, (uint32_t)np, ps};
    const int64_t shape[2] = {B, T};
    nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, shape, 2);
    m.nframes = 1;
    nl_status st = nl_sock_send(r->s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    return st;
}

/* A JOB_STATUS that ends the job: failed or cancelled. */
static int job_failed(const nl_rx *rx, nl_error *err)
{
    const nl_msg_job_status *s = &rx->msg.u.job_status;
    if (rx->msg.type != NL_MSG_JOB_STATUS ||
        (s->state != NL_JOB_FAILED && s->state != NL_JOB_CANCELLED))
        return 0;
    nl_error_set(err, NL_ERR_STATE, "job %" PRIu64 " %s: %s", s->job_id,
                 s->state == NL_JOB_FAILED ? "failed" : "was cancelled", s->message);
    return 1;
}

/* ---------------------------------------------------------------- forward */

int nl_cmd_remote_forward(int argc, char **argv)
{
    nl_flag flags[] = {{"tokens", 1, "input: safetensors with 'tokens' I32/I64 [B, T]", NULL},
                       {"out", 1, "output: 'logits' F32 [B, T, vocab] and 'aux_loss' F32 []", NULL},
                       REMOTE_FLAGS,
                       {0}};
    const char *usage = "neuroctl forward --coordinator EP --key K --coordinator-key P --tokens "
                        "IN.safetensors --out OUT.safetensors";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *in = nl_args_get(flags, "tokens"), *out = nl_args_get(flags, "out");
    if (!in || !out) {
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    nl_error err = {0};
    remote r = {0};
    nl_rx rx;
    nl_rx_init(&rx);
    int32_t *ids = NULL;
    float *logits = NULL, aux = 0.0f;
    int B = 0, T = 0, got = 0;
    int64_t shape[3] = {0, 0, 0};
    nl_st_writer *w = NULL;
    rc = 1;
    if (nl_cli_read_ids_file(in, "tokens", &ids, &B, &T, &err) != NL_OK ||
        remote_open(&r, flags, &err) != NL_OK ||
        submit(&r, NL_JOB_FORWARD, NULL, 0, ids, B, T, &err) != NL_OK)
        goto out;
    const double deadline = now_s() + r.timeout_ms / 1e3;
    while (remote_recv(&r, &rx, deadline, &err) == NL_OK) {
        if (job_failed(&rx, &err))
            goto out;
        if (rx.msg.type == NL_MSG_RESULT && rx.msg.nframes == 1) {
            const nl_tensor *t = &rx.msg.frames[0].t;
            if (t->dtype != NL_DTYPE_F32 || t->ndim != 3 || t->shape[0] != B || t->shape[1] != T) {
                nl_error_set(&err, NL_ERR_SHAPE, "result: logits of an unexpected shape");
                goto out;
            }
            memcpy(shape, t->shape, sizeof shape);
            logits = malloc(rx.msg.frames[0].len + 1);
            if (!logits) {
                nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
                goto out;
            }
            memcpy(logits, t->data, rx.msg.frames[0].len);
            aux = (float)rx.msg.u.hop.aux;
            got = 1;
        }
        if (rx.msg.type == NL_MSG_JOB_STATUS && rx.msg.u.job_status.state == NL_JOB_DONE && got)
            break;
    }
    if (!got)
        goto out;
    int64_t scalar[1] = {0};
    if (!(w = nl_st_writer_new())) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (nl_st_writer_add(w, "logits", NL_DTYPE_F32, 3, shape, logits, &err) != NL_OK ||
        nl_st_writer_add(w, "aux_loss", NL_DTYPE_F32, 0, scalar, &aux, &err) != NL_OK ||
        nl_st_writer_write(w, out, &err) != NL_OK)
        goto out;
    rc = 0;
out:
    nl_st_writer_destroy(&w);
    nl_rx_free(&rx);
    remote_close(&r);
    free(ids);
    free(logits);
    if (rc)
        fprintf(stderr, "neuroctl forward: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}

/* ---------------------------------------------------------------- generate */

/* The cluster's tokenizer, from its status; a byte tokenizer for a
 * byte-level model; NULL (and NL_OK) when neither applies. */
static nl_status remote_tokenizer(remote *r, nl_tokenizer **out, int64_t *vocab, nl_error *err)
{
    json_t *st = NULL;
    *out = NULL;
    nl_status s = remote_status(r, &st, err);
    if (s != NL_OK)
        return s;
    json_t *tok = json_object_get(st, "tokenizer");
    json_t *cfg = json_object_get(st, "config");
    *vocab = json_integer_value(json_object_get(cfg, "vocab_size"));
    if (json_is_string(tok))
        s = nl_tokenizer_load_buffer(out, json_string_value(tok), json_string_length(tok), err);
    else if (*vocab > 0 && *vocab <= 256)
        s = nl_tokenizer_new_bytes(out, err);
    json_decref(st);
    return s;
}

int nl_cmd_remote_generate(int argc, char **argv)
{
    nl_flag flags[] = {{"prompt-tokens", 1, "prompt as comma-separated token ids", NULL},
                       {"prompt", 1, "prompt as text, through the cluster's tokenizer", NULL},
                       {"max-new", 1, "tokens to generate (default 32)", NULL},
                       {"temperature", 1, "sampling temperature; 0 is greedy (default 0.8)", NULL},
                       {"top-p", 1, "nucleus sampling mass in (0, 1] (default 0.95)", NULL},
                       {"seed", 1, "sampling seed (default 0)", NULL},
                       REMOTE_FLAGS,
                       {0}};
    const char *usage = "neuroctl generate --coordinator EP --key K --coordinator-key P "
                        "(--prompt-tokens 1,2,3 | --prompt TEXT) [--max-new N] ...";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *ptoks = nl_args_get(flags, "prompt-tokens"), *ptext = nl_args_get(flags, "prompt");
    long long max_new = 32, seed = 0;
    double temp = 0.8, top_p = 0.95;
    if (!ptoks == !ptext) {
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if ((rc = nl_args_int(flags, "max-new", 1, 1 << 20, &max_new)) ||
        (rc = nl_args_int(flags, "seed", 0, INT64_MAX, &seed)) ||
        (rc = nl_args_double(flags, "temperature", 0.0, 100.0, &temp)) ||
        (rc = nl_args_double(flags, "top-p", 1e-6, 1.0, &top_p)))
        return rc;
    nl_error err = {0};
    remote r = {0};
    nl_rx rx;
    nl_rx_init(&rx);
    nl_tokenizer *tok = NULL;
    int32_t *prompt = NULL, *ids = NULL;
    size_t P = 0;
    int64_t vocab = 0;
    int count = 0;
    rc = 1;
    if (remote_open(&r, flags, &err) != NL_OK || remote_tokenizer(&r, &tok, &vocab, &err) != NL_OK)
        goto out;
    if (ptext) {
        if (!tok) {
            nl_error_set(&err, NL_ERR_NOTFOUND, "the cluster's model has no tokenizer: use "
                                                "--prompt-tokens");
            goto out;
        }
        if (nl_tokenizer_encode(tok, ptext, strlen(ptext), &prompt, &P, &err) != NL_OK)
            goto out;
        fputs(ptext, stdout);
    } else {
        int n = nl_cli_parse_ids(ptoks, &prompt);
        if (n < 0) {
            rc = 2;
            goto out;
        }
        P = (size_t)n;
    }
    if (P == 0) {
        nl_error_set(&err, NL_ERR_INVALID, "empty prompt");
        goto out;
    }
    ids = malloc((size_t)max_new * sizeof *ids);
    nl_wire_param ps[4] = {
        {.key = "max_new", .kind = NL_WIRE_PARAM_INT, .i = max_new},
        {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = temp},
        {.key = "top_p", .kind = NL_WIRE_PARAM_FLOAT, .f = top_p},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = seed},
    };
    if (!ids || submit(&r, NL_JOB_GENERATE, ps, 4, prompt, 1, (int)P, &err) != NL_OK)
        goto out;
    double deadline = now_s() + r.timeout_ms / 1e3;
    for (;;) {
        if (remote_recv(&r, &rx, deadline, &err) != NL_OK || job_failed(&rx, &err))
            goto out;
        if (rx.msg.type != NL_MSG_TOKEN)
            continue;
        deadline = now_s() + r.timeout_ms / 1e3; /* progress */
        for (uint32_t i = 0; i < rx.msg.u.token.ntokens && count < max_new; i++) {
            const int32_t id = (int32_t)rx.msg.u.token.tokens[i];
            ids[count++] = id;
            const uint8_t *p = NULL;
            size_t n = 0;
            if (!ptext)
                printf("%s%d", count > 1 ? " " : "", id);
            else if (nl_tokenizer_token_bytes(tok, id, &p, &n) == NL_OK &&
                     !nl_tokenizer_is_special(id))
                fwrite(p, 1, n, stdout);
            fflush(stdout);
        }
        if (rx.msg.u.token.done)
            break;
    }
    printf("\n");
    char *text = NULL;
    size_t tlen = 0;
    if (!ptext && tok && nl_tokenizer_vocab_size(tok) >= vocab &&
        nl_tokenizer_decode(tok, ids, (size_t)count, &text, &tlen, &err) == NL_OK) {
        fwrite(text, 1, tlen, stdout);
        printf("\n");
    }
    free(text);
    rc = 0;
out:
    if (rc && count)
        printf("\n");
    nl_rx_free(&rx);
    remote_close(&r);
    nl_tokenizer_destroy(&tok);
    free(prompt);
    free(ids);
    if (rc == 1)
        fprintf(stderr, "neuroctl generate: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}

/* ---------------------------------------------------------------- status */

int nl_cmd_status(int argc, char **argv)
{
    nl_flag flags[] = {{"json", 0, "print the coordinator's JSON as it is", NULL}, REMOTE_FLAGS,
                       {0}};
    const char *usage = "neuroctl status --coordinator EP --key K --coordinator-key P [--json]";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    nl_error err = {0};
    remote r = {0};
    json_t *st = NULL;
    if (remote_open(&r, flags, &err) != NL_OK || remote_status(&r, &st, &err) != NL_OK) {
        remote_close(&r);
        fprintf(stderr, "neuroctl status: %s (%s)\n", err.msg, nl_status_str(err.status));
        return 1;
    }
    remote_close(&r);
    if (nl_args_get(flags, "json")) {
        json_object_del(st, "tokenizer");
        char *s = json_dumps(st, JSON_INDENT(2));
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(st);
        return 0;
    }
    printf("cluster: %s\n", json_string_value(json_object_get(st, "state")));
    json_t *cfg = json_object_get(st, "config");
    if (cfg)
        printf("model: d=%lld L=%lld H=%lld G=%lld F=%lld E=%lld vocab %lld\n",
               json_integer_value(json_object_get(cfg, "hidden_dim")),
               json_integer_value(json_object_get(cfg, "num_layers")),
               json_integer_value(json_object_get(cfg, "num_heads")),
               json_integer_value(json_object_get(cfg, "num_kv_heads")),
               json_integer_value(json_object_get(cfg, "ffn_dim")),
               json_integer_value(json_object_get(cfg, "num_experts")),
               json_integer_value(json_object_get(cfg, "vocab_size")));
    printf("%-4s %-8s %-7s %9s %9s %-9s %8s %10s %9s\n", "node", "state", "device", "memory",
           "planned", "layers", "GFLOP/s", "stage ms", "heartbeat");
    size_t i;
    json_t *n;
    json_array_foreach(json_object_get(st, "nodes"), i, n)
    {
        char layers[32] = "-", planned[32] = "-", pred[32] = "-";
        json_t *l = json_object_get(n, "layers");
        if (json_is_array(l))
            snprintf(layers, sizeof layers, "[%lld,%lld)%s%s",
                     json_integer_value(json_array_get(l, 0)),
                     json_integer_value(json_array_get(l, 1)),
                     json_is_true(json_object_get(n, "embed")) ? "e" : "",
                     json_is_true(json_object_get(n, "head")) ? "h" : "");
        if (json_object_get(n, "memory_planned"))
            snprintf(planned, sizeof planned, "%.0fM",
                     (double)json_integer_value(json_object_get(n, "memory_planned")) / (1 << 20));
        if (json_object_get(n, "predicted_s"))
            snprintf(pred, sizeof pred, "%.2f",
                     json_real_value(json_object_get(n, "predicted_s")) * 1e3);
        printf("%-4lld %-8s %-7s %8.0fM %9s %-9s %8.1f %10s %8.1fs\n",
               json_integer_value(json_object_get(n, "id")),
               json_string_value(json_object_get(n, "state")),
               json_string_value(json_object_get(n, "device")),
               (double)json_integer_value(json_object_get(n, "memory")) / (1 << 20), planned,
               layers, json_real_value(json_object_get(n, "gflops")), pred,
               json_real_value(json_object_get(n, "heartbeat_age_s")));
    }
    json_t *b = json_object_get(st, "bottleneck_s");
    if (b)
        printf("predicted bottleneck: %.2f ms per request\n", json_real_value(b) * 1e3);
    json_decref(st);
    return 0;
}

/* ---------------------------------------------------------------- readiness */

int nl_remote_wait_ready(const char *dir, int timeout_s, char *state, size_t cap)
{
    const double deadline = now_s() + timeout_s;
    nl_flag flags[] = {{"cluster", 1, "", dir}, {"timeout", 1, "", "5"}, REMOTE_FLAGS, {0}};
    while (now_s() < deadline) {
        remote r = {0};
        json_t *st = NULL;
        nl_error err = {0};
        if (remote_open(&r, flags, &err) == NL_OK && remote_status(&r, &st, &err) == NL_OK) {
            snprintf(state, cap, "%s", json_string_value(json_object_get(st, "state")));
            int ready = json_is_true(json_object_get(st, "ready"));
            json_decref(st);
            remote_close(&r);
            if (ready)
                return 0;
        } else {
            snprintf(state, cap, "%s", err.msg);
            remote_close(&r);
        }
        struct timespec ts = {0, 200000000L};
        nanosleep(&ts, NULL);
    }
    return -1;
}
