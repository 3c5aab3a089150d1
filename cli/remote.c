/* neuroctl's connection to a coordinator: open (flags, keys, HELLO),
 * receive with a deadline, submit, cancel, status. See remote.h. */
#include "remote.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/fileio.h"
#include "net/handshake.h"

double nl_remote_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void nl_remote_close(nl_remote *r)
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

/* Is the coordinator of the local cluster in dir (cluster up) alive? Its
 * pid file names it; cluster down removes the file. */
static int cluster_running(const char *dir)
{
    char p[4096], *buf = NULL;
    size_t n = 0;
    nl_error err = {0};
    snprintf(p, sizeof p, "%s/coord.pid", dir);
    if (nl_file_read_all(p, 64, &buf, &n, &err) != NL_OK)
        return 0;
    const long pid = strtol(buf, NULL, 10);
    free(buf);
    return pid > 1 && (kill((pid_t)pid, 0) == 0 || errno == EPERM);
}

nl_status nl_remote_open(nl_remote *r, const nl_flag *flags, int default_timeout_s, nl_error *err)
{
    memset(r, 0, sizeof *r);
    char ep[512], keyp[4096], coordp[4096], coord_key[NL_KEY_Z85_LEN + 1];
    const char *dir = nl_args_get(flags, "cluster");
    const char *e = nl_args_get(flags, "coordinator"), *k = nl_args_get(flags, "key"),
               *ck = nl_args_get(flags, "coordinator-key");
    const int plain = nl_args_get(flags, "plaintext") != NULL;
    long long t = default_timeout_s;
    if (nl_args_int(flags, "timeout", 1, 86400, &t))
        return nl_error_set(err, NL_ERR_INVALID, "--timeout: bad value");
    r->timeout_ms = (int)(t * 1000);
    nl_status st = NL_OK;
    if (dir) {
        char p[4096];
        if (!cluster_running(dir))
            return nl_error_set(err, NL_ERR_STATE,
                                "the cluster in %s is not running (neuroctl cluster up --dir %s)",
                                dir, dir);
        snprintf(p, sizeof p, "%s/coord/client_endpoint", dir);
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
    if (!strstr(e, "://"))
        return nl_error_set(err, NL_ERR_INVALID,
                            "--coordinator %s: give a ZeroMQ endpoint, e.g. tcp://%s", e, e);
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
    nl_handshake *hs = NULL;
    const double start = nl_remote_now();
    /* the socket monitor tells a refused connection or handshake at once;
     * HELLO then gets what is left of the timeout */
    if ((st = nl_net_new(&r->net, &no, err)) != NL_OK ||
        (st = nl_sock_new(&r->s, r->net, &so, err)) != NL_OK ||
        (st = nl_handshake_watch(&hs, r->net, r->s, err)) != NL_OK ||
        (st = nl_sock_connect(r->s, e, err)) != NL_OK)
        goto out;
    st = nl_handshake_wait(hs, e, r->timeout_ms, err);
    /* a CURVE coordinator drops a plaintext peer: say which side is plain */
    if (st == NL_ERR_AUTH && plain && err && !strstr(err->msg, "refused this key"))
        st = nl_error_set(err, NL_ERR_AUTH,
                          "%s ended the handshake: it expects CURVE keys, and this client is "
                          "--plaintext",
                          e);
    if (st == NL_ERR_TIMEOUT || st == NL_OK) {
        int left = r->timeout_ms - (int)((nl_remote_now() - start) * 1000);
        st = nl_sock_hello(r->s, NL_ROLE_CLIENT, left > 100 ? left : 100, &rx, err);
    }
out:
    nl_handshake_destroy(&hs);
    if (st != NL_OK && st != NL_ERR_IO && st != NL_ERR_AUTH)
        nl_error_prefix(err, "coordinator %s", e);
    nl_rx_free(&rx);
    return st;
}

nl_status nl_remote_recv(nl_remote *r, nl_rx *rx, double deadline, nl_error *err)
{
    for (;;) {
        double left = deadline - nl_remote_now();
        if (left <= 0)
            return nl_error_set(err, NL_ERR_TIMEOUT, "no answer from the coordinator in time");
        nl_rx_free(rx);
        nl_rx_init(rx);
        nl_status st = nl_sock_recv(r->s, rx, (int)(left * 1000) + 1, err);
        if (st == NL_ERR_TIMEOUT) {
            nl_error_clear(err); /* not yet: the deadline decides */
            continue;
        }
        if (st != NL_OK)
            return st;
        if (rx->msg.type == NL_MSG_ERROR)
            return nl_error_set(err, (nl_status)rx->msg.u.error.code, "coordinator: %s",
                                rx->msg.u.error.message);
        return NL_OK;
    }
}

nl_status nl_remote_status(nl_remote *r, json_t **out, nl_error *err)
{
    nl_wire_msg m;
    nl_rx rx;
    nl_wire_msg_init(&m);
    nl_rx_init(&rx);
    nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
    m.u.job_ref.job_id = 0;
    nl_status st = nl_sock_send(r->s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    double deadline = nl_remote_now() + r->timeout_ms / 1e3;
    while (st == NL_OK && (st = nl_remote_recv(r, &rx, deadline, err)) == NL_OK) {
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

nl_status nl_remote_submit(nl_remote *r, nl_job_kind kind, const nl_wire_param *ps, int np,
                           const int32_t *ids, int B, int T, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){(uint32_t)kind, (uint32_t)np, ps};
    if (ids) {
        const int64_t shape[2] = {B, T};
        nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, shape, 2);
        m.nframes = 1;
    }
    nl_status st = nl_sock_send(r->s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    return st;
}

nl_status nl_remote_cancel(nl_remote *r, uint64_t job_id, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
    m.u.job_ref.job_id = job_id;
    nl_status st = nl_sock_send(r->s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    return st;
}

int nl_remote_job_failed(const nl_rx *rx, nl_error *err)
{
    const nl_msg_job_status *s = &rx->msg.u.job_status;
    if (rx->msg.type != NL_MSG_JOB_STATUS ||
        (s->state != NL_JOB_FAILED && s->state != NL_JOB_CANCELLED))
        return 0;
    const char *what = s->state == NL_JOB_FAILED ? "failed" : "was cancelled";
    /* a message that only repeats the state adds nothing */
    if (!s->message[0] || strcmp(s->message, "cancelled") == 0 || strcmp(s->message, "failed") == 0)
        nl_error_set(err, NL_ERR_STATE, "job %" PRIu64 " %s", s->job_id, what);
    else
        nl_error_set(err, NL_ERR_STATE, "job %" PRIu64 " %s: %s", s->job_id, what, s->message);
    return 1;
}

int nl_remote_refuse_node_flag(const char *arg)
{
    static const char *const node_flags[] = {"--device", "--tf32", "--threads"};
    for (size_t k = 0; k < sizeof node_flags / sizeof node_flags[0]; k++)
        if (strcmp(arg, node_flags[k]) == 0) {
            fprintf(stderr,
                    "%s: each node has its own %s (neuronode join %s, neuroctl cluster up %s)\n",
                    arg, arg, arg, arg);
            return 2;
        }
    return 0;
}
