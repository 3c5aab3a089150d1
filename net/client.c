/* The client side of the clients' endpoint: see client.h. */
#include "net/client.h"

#include <inttypes.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "net/handshake.h"

nl_status nl_client_connect(nl_sock **out, nl_net *net, const nl_client_opts *o, nl_error *err)
{
    nl_sock_opts so = {.type = ZMQ_DEALER,
                       .keys = o->plaintext ? NULL : o->keys,
                       .server_key = o->plaintext ? NULL : o->server_key,
                       .plaintext = o->plaintext,
                       .name = o->name,
                       .linger_ms = 0,
                       .kind = o->kind};
    nl_rx rx;
    nl_rx_init(&rx);
    nl_handshake *hs = NULL;
    const double start = nl_mono_s();
    int left = o->timeout_ms;
    nl_status st;
    *out = NULL;
    if ((st = nl_sock_new(out, net, &so, err)) != NL_OK ||
        (o->watch_handshake && (st = nl_handshake_watch(&hs, net, *out, err)) != NL_OK) ||
        (st = nl_sock_connect(*out, o->endpoint, err)) != NL_OK)
        goto out;
    if (hs) { /* the monitor tells a refused connection or handshake at once */
        st = nl_handshake_wait(hs, o->endpoint, o->timeout_ms, err);
        /* a CURVE coordinator drops a plaintext peer: say which side is plain */
        if (st == NL_ERR_AUTH && o->plaintext && !strstr(err->msg, "refused this key"))
            st = nl_error_set(err, NL_ERR_AUTH,
                              "%s ended the handshake: it expects CURVE keys, and this client "
                              "is --plaintext",
                              o->endpoint);
        if (st != NL_OK && st != NL_ERR_TIMEOUT)
            goto out;
        left = o->timeout_ms - (int)((nl_mono_s() - start) * 1000);
        left = left > 100 ? left : 100; /* HELLO gets what is left */
    }
    st = nl_sock_hello(*out, NL_ROLE_CLIENT, left, &rx, err);
    if (st == NL_ERR_TIMEOUT) /* the whole wait, handshake and HELLO, not HELLO's share */
        st = nl_error_set(err, NL_ERR_TIMEOUT, "no answer within %.1f s (--timeout %.1f s)",
                          nl_mono_s() - start, o->timeout_ms / 1000.0);
out:
    nl_handshake_destroy(&hs);
    if (st != NL_OK) {
        /* a watched refusal or key fault names the endpoint already */
        if (!o->watch_handshake || (st != NL_ERR_IO && st != NL_ERR_AUTH))
            nl_error_prefix(err, "coordinator %s", o->endpoint);
        nl_sock_destroy(out);
    }
    nl_rx_free(&rx);
    return st;
}

nl_status nl_client_send_ref(nl_sock *s, nl_msg_type type, uint64_t job_id, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, type);
    m.u.job_ref.job_id = job_id;
    nl_status st = nl_sock_send(s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    return st;
}

nl_status nl_client_submit(nl_sock *s, nl_job_kind kind, const nl_wire_param *ps, int np,
                           const int32_t *ids, int B, int T, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){(uint32_t)kind, (uint32_t)np, (nl_wire_param *)ps};
    if (ids) {
        const int64_t shape[2] = {B, T};
        nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, shape, 2);
        m.nframes = 1;
    }
    nl_status st = nl_sock_send(s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    return st;
}

nl_status nl_client_recv(nl_sock *s, nl_rx *rx, double deadline, nl_error *err)
{
    for (;;) {
        double left = deadline - nl_mono_s();
        if (left <= 0)
            return nl_error_set(err, NL_ERR_TIMEOUT, "no answer from the coordinator in time");
        nl_rx_free(rx);
        nl_rx_init(rx);
        nl_status st = nl_sock_recv(s, rx, (int)(left * 1000) + 1, err);
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

nl_status nl_client_status(nl_sock *s, double deadline, json_t **out, nl_error *err)
{
    nl_rx rx;
    nl_rx_init(&rx);
    *out = NULL;
    nl_status st = nl_client_send_ref(s, NL_MSG_JOB_QUERY, 0, err);
    while (st == NL_OK && (st = nl_client_recv(s, &rx, deadline, err)) == NL_OK) {
        if (rx.msg.type != NL_MSG_JOB_STATUS || rx.msg.u.job_status.job_id != 0 ||
            rx.msg.nframes != 1)
            continue; /* another job's news */
        json_error_t je;
        *out = json_loadb((const char *)rx.msg.frames[0].t.data, rx.msg.frames[0].len, 0, &je);
        if (!*out)
            st = nl_error_set(err, NL_ERR_PROTO, "status: bad JSON: %s", je.text);
        break;
    }
    nl_rx_free(&rx);
    return st;
}

int nl_client_job_failed(const nl_rx *rx, nl_error *err)
{
    const nl_msg_job_status *s = &rx->msg.u.job_status;
    if (rx->msg.type != NL_MSG_JOB_STATUS ||
        (s->state != NL_JOB_FAILED && s->state != NL_JOB_CANCELLED))
        return 0;
    const char *what = s->state == NL_JOB_FAILED ? "failed" : "was cancelled";
    const char *msg = s->message ? s->message : "";
    const nl_status st =
        s->state == NL_JOB_FAILED && s->job_id == 0 &&
                strncmp(msg, NL_CLIENT_TOO_MANY_JOBS, strlen(NL_CLIENT_TOO_MANY_JOBS)) == 0
            ? NL_ERR_LIMIT
            : NL_ERR_STATE;
    /* a message that only repeats the state adds nothing; job 0 is a
     * submission refused before it was given an id */
    const int bare = !msg[0] || strcmp(msg, "cancelled") == 0 || strcmp(msg, "failed") == 0;
    if (s->job_id == 0 && s->state == NL_JOB_FAILED)
        nl_error_set(err, st, "the coordinator refused the job%s%s", bare ? "" : ": ",
                     bare ? "" : msg);
    else if (bare)
        nl_error_set(err, st, "job %" PRIu64 " %s", s->job_id, what);
    else
        nl_error_set(err, st, "job %" PRIu64 " %s: %s", s->job_id, what, msg);
    return 1;
}

nl_status nl_client_await_result(nl_sock *s, double deadline, nl_client_result_fn take, void *ctx,
                                 nl_error *err)
{
    nl_rx rx;
    nl_rx_init(&rx);
    int got = 0;
    nl_status st;
    while ((st = nl_client_recv(s, &rx, deadline, err)) == NL_OK) {
        if (nl_client_job_failed(&rx, err)) {
            st = err->status;
            break;
        }
        if (!got && rx.msg.type == NL_MSG_RESULT && rx.msg.nframes == 1) {
            if ((st = take(ctx, &rx.msg, err)) != NL_OK)
                break;
            got = 1;
        } else if (got && rx.msg.type == NL_MSG_JOB_STATUS &&
                   rx.msg.u.job_status.state == NL_JOB_DONE) {
            break;
        }
    }
    nl_rx_free(&rx);
    return st;
}
