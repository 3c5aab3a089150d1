/* The neuronode event loop: the connection to the coordinator (joining,
 * heartbeats, joining again), the sends every handler uses, and the
 * dispatch of control and data messages (see node.h and docs/cluster.md).
 * The handlers of the messages themselves (assignment, jobs, training, the
 * next stage's socket) are in node_jobs.c, behind node_impl.h. */
#include "node/node.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "core/formats/fileio.h"
#include "kernels/backend.h"
#include "net/handshake.h"
#include "net/transport.h"
#include "node/node_impl.h"
#include "node/stage.h"
#include "node/stage_verify.h"

#define ACCEPT_WAIT_MS 10000 /* for the answer to JOIN */
#define MAX_DRAIN 64         /* messages per socket per turn, so heartbeats keep time */
#define SEND_WAIT_MS 5000    /* for the last output to leave before its buffer is reused */
#define REJOIN_FIRST_MS 250  /* the first pause between JOINs when joining again */
#define REJOIN_MAX_MS 8000   /* ... doubling up to this */

static bool stopping(const node *n)
{
    return n->dismissed || (n->o->stop && *n->o->stop);
}

/* Stop serving: a signal, or the device failed (the stage refuses all work). */
static bool halted(const node *n)
{
    return stopping(n) || (n->stage && nl_stage_device_status(n->stage, NULL) != NL_OK);
}

/* ===================== sending ===================== */

/* Send tx on the control socket; a failure is logged (the caller goes on). */
nl_status node_send_ctl(node *n, const char *what)
{
    nl_error e;
    nl_status st = nl_sock_send(n->ctl, NULL, 0, &n->tx, &e);
    if (st != NL_OK)
        NL_ERROR("cannot send %s to the coordinator: %s", what, e.msg);
    return st;
}

/* ERROR {code, req_type, message} to the coordinator, logged as well. */
void node_send_error(node *n, nl_status code, nl_msg_type req_type, const char *fmt, ...)
{
    char text[1025];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    NL_WARN("%s refused (%s): %s", nl_wire_type_name(req_type), nl_status_str(code), text);
    nl_wire_msg_reset(&n->tx, NL_MSG_ERROR);
    n->tx.u.error.code = code > 0 && code < 1000 ? (uint32_t)code : NL_ERR_INTERNAL;
    n->tx.u.error.req_type = req_type;
    n->tx.u.error.message = text;
    node_send_ctl(n, "ERROR");
}

/* The failure of one job's work here: JOB_STATUS {job, failed, message}
 * to the coordinator, which fails that job and no other. Logged as well. */
void node_fail_job(node *n, uint64_t job, nl_status code, nl_msg_type req_type, const char *fmt,
                   ...)
{
    char text[1025];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (!job) { /* nothing to pin it on */
        node_send_error(n, code, req_type, "%s", text);
        return;
    }
    const char *why = nl_status_str(code);
    n->last_failed_job = job;
    NL_WARN("%s of job %llu refused (%s): %s", nl_wire_type_name(req_type), (unsigned long long)job,
            why, text);
    /* the field holds 1024 bytes: cut the text, on a UTF-8 boundary, to fit the status */
    const size_t keep = nl_wire_utf8_fit(text, 1024 - 3 - strlen(why));
    char msg[1025];
    snprintf(msg, sizeof msg, "%.*s (%s)", (int)keep, text, why);
    nl_wire_msg_reset(&n->tx, NL_MSG_JOB_STATUS);
    n->tx.u.job_status = (nl_msg_job_status){job, NL_JOB_FAILED, 0.0, msg, (uint32_t)req_type};
    node_send_ctl(n, "JOB_STATUS");
}

void node_send_heartbeat(node *n)
{
    int64_t now = nl_mono_ms();
    if (n->rejoining) { /* the coordinator does not know this node: JOIN, not HEARTBEAT */
        n->next_hb_ms = now + n->heartbeat_ms;
        return;
    }
    double span = (double)(now - n->window_ms);
    nl_wire_msg_reset(&n->tx, NL_MSG_HEARTBEAT);
    n->tx.u.heartbeat.node_id = n->node_id;
    n->tx.u.heartbeat.seq = ++n->hb_seq;
    n->tx.u.heartbeat.state = nl_stage_state(n->stage);
    n->tx.u.heartbeat.load = span > 0 ? (n->busy_ms < span ? n->busy_ms / span : 1.0) : 0.0;
    nl_stage_figures f;
    nl_stage_get_figures(n->stage, &f);
    n->tx.u.heartbeat.kv_bytes = nl_stage_kv_used(n->stage);
    n->tx.u.heartbeat.sessions = (uint32_t)nl_stage_session_count(n->stage);
    n->tx.u.heartbeat.hops = f.hops;
    n->tx.u.heartbeat.batches = f.batches;
    n->tx.u.heartbeat.compute_s = f.compute_s;
    n->tx.u.heartbeat.hop_s = f.hop_s;
    n->tx.u.heartbeat.reduce_bytes = f.reduce_bytes;
    n->tx.u.heartbeat.reduce_s = f.reduce_s;
    node_send_ctl(n, "HEARTBEAT");
    n->window_ms = now;
    n->busy_ms = 0;
    n->next_hb_ms = now + n->heartbeat_ms;
}

/* Wait, heartbeating, until the stage's last output has been sent, so
 * that the next forward or assignment may reuse its buffer. A send stuck
 * on a dead peer is given up after SEND_WAIT_MS: the stage then refuses
 * the work with NL_ERR_TIMEOUT, until an ASSIGN closes that socket. */
void node_wait_sent(node *n)
{
    nl_txref *ref = nl_stage_txref(n->stage);
    int64_t end = nl_mono_ms() + SEND_WAIT_MS;
    while (!nl_txref_idle(ref) && nl_mono_ms() < end && !stopping(n)) {
        if (nl_mono_ms() >= n->next_hb_ms)
            node_send_heartbeat(n);
        nanosleep(&(struct timespec){0, 100000}, NULL);
    }
}

/* ===================== joining ===================== */

nl_status node_make_socket(node *n, nl_sock **out, int type, bool server, const char *server_key,
                           const char *name, nl_sock_kind kind, int linger_ms, int send_timeout_ms,
                           nl_error *err)
{
    nl_sock_opts so = {.type = type,
                       .keys = n->o->keys,
                       .curve_server = server,
                       .server_key = server_key,
                       .plaintext = n->o->plaintext,
                       .name = name,
                       .linger_ms = linger_ms,
                       .send_timeout_ms = send_timeout_ms,
                       .kind = kind};
    return nl_sock_new(out, n->net, &so, err);
}

/* Connect control and say hello, retrying with a growing pause until the
 * coordinator answers or connect_timeout_ms has passed. */
static nl_status connect_control(node *n, nl_error *err)
{
    const nl_node_opts *o = n->o;
    int64_t deadline = nl_mono_ms() + o->connect_timeout_ms;
    int wait_ms = 500;
    for (int attempt = 1;; attempt++) {
        nl_handshake *hs = NULL; /* a refused key is said at once, not retried */
        /* what the coordinator sends (weights in 4 MiB chunks, tokens) is
         * control-sized (net/transport.h) */
        nl_status st = node_make_socket(n, &n->ctl, ZMQ_DEALER, false, o->coordinator_key,
                                        "control", NL_SOCK_CONTROL, 1000, 3000, err);
        if (st == NL_OK && !o->plaintext)
            st = nl_handshake_watch(&hs, n->net, n->ctl, err);
        if (st == NL_OK)
            st = nl_sock_connect(n->ctl, o->coordinator, err);
        if (st != NL_OK) {
            nl_handshake_destroy(&hs);
            return st;
        }
        int64_t left = deadline - nl_mono_ms(), t0 = nl_mono_ms();
        int ms = left < wait_ms ? (int)(left > 0 ? left : 1) : wait_ms;
        if (hs)
            st = nl_handshake_wait(hs, o->coordinator, ms, err);
        nl_handshake_destroy(&hs);
        if (st == NL_ERR_IO) { /* connection refused: the coordinator may not be up yet */
            int64_t rest = ms - (nl_mono_ms() - t0);
            if (rest > 0)
                nanosleep(&(struct timespec){rest / 1000, (rest % 1000) * 1000000L}, NULL);
            st = NL_ERR_TIMEOUT;
        } else if (st == NL_OK || st == NL_ERR_TIMEOUT) {
            st = nl_sock_hello(n->ctl, NL_ROLE_NODE, ms, &n->rx, err);
        }
        if (st != NL_ERR_TIMEOUT)
            return st;
        nl_sock_destroy(&n->ctl);
        if (stopping(n))
            return nl_error_set(err, NL_ERR_TIMEOUT, "stopped while connecting to %s",
                                o->coordinator);
        left = deadline - nl_mono_ms();
        if (left <= 0)
            return nl_error_set(err, NL_ERR_TIMEOUT,
                                "no answer from the coordinator at %s within %d ms (is it "
                                "running? is this node's key in its authorized_keys? is "
                                "--coordinator-key its public key?)",
                                o->coordinator, o->connect_timeout_ms);
        NL_INFO("coordinator at %s not answering yet (attempt %d: %s); retrying for %lld s more",
                o->coordinator, attempt, err->msg, (long long)(left + 999) / 1000);
        wait_ms = wait_ms < 2000 ? wait_ms * 2 : 2000;
    }
}

/* JOIN {key, device, memory, throughput, threads, data endpoint} in tx. */
static void fill_join(node *n)
{
    nl_wire_msg_reset(&n->tx, NL_MSG_JOIN);
    n->tx.u.join.pubkey = n->o->keys->public_z85;
    n->tx.u.join.device = n->dev.be[0]->name; /* replica 0's: the JOIN names one device */
    n->tx.u.join.memory_bytes = nl_stage_plan_memory(n->stage); /* the KV budget kept */
    n->tx.u.join.gemm_gflops = n->gflops;
    n->tx.u.join.threads = (uint32_t)n->threads;
    n->tx.u.join.data_endpoint = nl_sock_endpoint(n->data);
    n->tx.u.join.flags = n->o->no_inbound ? NL_JOIN_NO_INBOUND : 0;
}

static nl_status join(node *n, nl_error *err)
{
    fill_join(n);
    nl_status st = nl_sock_send(n->ctl, NULL, 0, &n->tx, err);
    if (st != NL_OK)
        return st;
    int64_t deadline = nl_mono_ms() + ACCEPT_WAIT_MS;
    while (!stopping(n)) {
        int64_t left = deadline - nl_mono_ms();
        if (left <= 0)
            break;
        st = nl_sock_recv(n->ctl, &n->rx, (int)left, err);
        if (st == NL_ERR_TIMEOUT)
            continue;
        if (st != NL_OK)
            return nl_error_prefix(err, "waiting for ACCEPT");
        const nl_wire_msg *m = &n->rx.msg;
        if (m->type == NL_MSG_ACCEPT) {
            n->node_id = m->u.accept.node_id;
            n->heartbeat_ms = m->u.accept.heartbeat_ms;
            n->timeout_ms = m->u.accept.timeout_ms;
            return NL_OK;
        }
        char text[512];
        if (m->type == NL_MSG_ERROR)
            return nl_error_set(err, NL_ERR_AUTH, "the coordinator refused JOIN: %s (%s)",
                                nl_log_escape(text, sizeof text, m->u.error.message),
                                nl_status_str(m->u.error.code < NL_STATUS_COUNT
                                                  ? (nl_status)m->u.error.code
                                                  : NL_ERR_PROTO));
        NL_DEBUG("ignoring %s while waiting for ACCEPT", nl_wire_type_name(m->type));
    }
    return nl_error_set(err, NL_ERR_TIMEOUT, "no ACCEPT from the coordinator within %d ms",
                        ACCEPT_WAIT_MS);
}

/* ===================== the device ===================== */

/* The backend, its throughput and the memory offered (node_device.c). */
static nl_status open_device(node *n, nl_error *err)
{
    nl_node_device *d = &n->dev; /* freed with the node, whether or not the rest worked */
    nl_status st = node_device_open(d, n->o, err);
    n->gflops = d->gflops;
    n->threads = d->threads;
    n->memory = d->memory;
    return st;
}

/* ===================== starting ===================== */

/* The checkpoint root, made (0700) when missing and resolved. */
static nl_status open_ckpt_root(node *n, nl_error *err)
{
    char real[PATH_MAX];
    const char *root = n->o->ckpt_root;
    if (!root)
        return NL_OK;
    nl_status st = nl_file_mkdirs(root, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "--checkpoint-root");
    if (!realpath(root, real))
        return nl_error_set(err, NL_ERR_IO, "--checkpoint-root %s: %s", root, strerror(errno));
    if (!(n->ckpt_root = strdup(real)))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    NL_INFO("checkpoint shards go under %s", n->ckpt_root);
    return NL_OK;
}

static nl_status start(node *n, nl_error *err)
{
    const nl_node_opts *o = n->o;
    node_local_init(n);
    nl_status st = open_ckpt_root(n, err);
    if (st == NL_OK)
        st = open_device(n, err);
    if (st != NL_OK)
        return st;
    nl_stage_opts so = {.memory_bytes = n->memory,
                        .kv_budget = n->dev.kv_budget,
                        .kv_cache = o->kv_cache,
                        .batch_decode = o->batch_decode,
                        .prefill_chunk = o->prefill_chunk,
                        .batch_wait_ms = o->batch_wait_ms,
                        .send_wait_ms = 1, /* node_wait_sent waited already */
                        .ckpt_root = n->ckpt_root ? n->ckpt_root : "/nonexistent",
                        .inject_nan_step = o->inject_nan_step,
                        .inject_nan_stage = o->inject_nan_stage,
                        .inject_nan_on = o->inject_nan_on,
                        .inject_no_compute = o->inject_compute_gflops > 0,
                        .inject_compute_gflops = o->inject_compute_gflops,
                        .inject_link_bytes_s = o->inject_link_bytes_s,
                        .lie = {(nl_lie_kind)o->inject_lie_kind, o->inject_lie_rate,
                                o->inject_lie_seed, o->inject_lie_from, o->inject_lie_gen},
                        .tf32 = o->tf32,
                        .verify_be = n->dev.verify_be, /* cases redone off this thread */
                        .train_async = 1};             /* replicas report through serve()'s poll */
    if ((st = nl_stage_new_replicas(&n->stage, n->dev.be, n->dev.n, n->dev.comm, &so, err)) !=
            NL_OK ||
        (st = nl_net_new(&n->net, NULL, err)) != NL_OK ||
        (st = node_make_socket(n, &n->data, ZMQ_ROUTER, true, NULL, "data", NL_SOCK_BULK, 0, 0,
                               err)) != NL_OK ||
        (st = nl_sock_bind(n->data, o->listen, err)) != NL_OK)
        return st;
    /* a next stage behind NAT that dials again (its link dropped) takes its
     * routing id over from the connection that is gone (node_links.c) */
    int one = 1;
    if (zmq_setsockopt(nl_sock_handle(n->data), ZMQ_ROUTER_HANDOVER, &one, sizeof one) != 0)
        return nl_error_set(err, NL_ERR_IO, "data socket: ROUTER_HANDOVER: %s",
                            zmq_strerror(zmq_errno()));
    if (strncmp(nl_sock_endpoint(n->data), "tcp://0.0.0.0:", 14) == 0)
        NL_WARN("data endpoint %s is a wildcard: other stages cannot reach it by that address; "
                "listen on a routable address",
                nl_sock_endpoint(n->data));
    if ((st = connect_control(n, err)) != NL_OK || (st = join(n, err)) != NL_OK)
        return st;
    if (!o->name) {
        char name[32];
        snprintf(name, sizeof name, "node-%u", n->node_id);
        nl_log_set_name(name);
    }
    NL_INFO("joined %s as node %u (data %s, heartbeat %u ms, timeout %u ms)", o->coordinator,
            n->node_id, nl_sock_endpoint(n->data), n->heartbeat_ms, n->timeout_ms);
    n->window_ms = nl_mono_ms();
    node_send_heartbeat(n);
    return NL_OK;
}

/* ===================== joining again ===================== */

/* The coordinator refused a heartbeat: it does not know this node (it
 * restarted, or gave this node up). Whatever it had this node do is gone
 * with its state: a training job ends here; then JOIN again. */
static void start_rejoin(node *n, const char *why)
{
    char text[300];
    uint64_t job = 0;
    if (n->rejoining)
        return;
    NL_WARN("the coordinator does not know this node (%s): joining again",
            nl_log_escape(text, sizeof text, why));
    if (nl_stage_train_running(n->stage, &job))
        node_end_job(n, job);
    n->rejoining = true;
    n->rejoin_at_ms = nl_mono_ms();
    n->rejoin_wait_ms = REJOIN_FIRST_MS;
}

/* While joining again: JOIN when its time has come, then wait longer. */
static void rejoin_tick(node *n)
{
    const int64_t now = nl_mono_ms();
    if (!n->rejoining || now < n->rejoin_at_ms)
        return;
    fill_join(n);
    node_send_ctl(n, "JOIN");
    n->rejoins++;
    n->rejoin_at_ms = now + n->rejoin_wait_ms;
    n->rejoin_wait_ms =
        n->rejoin_wait_ms * 2 < REJOIN_MAX_MS ? n->rejoin_wait_ms * 2 : REJOIN_MAX_MS;
}

static void accepted_again(node *n, const nl_msg_accept *a)
{
    n->rejoining = false;
    n->node_id = a->node_id;
    n->heartbeat_ms = a->heartbeat_ms;
    n->timeout_ms = a->timeout_ms;
    if (!n->o->name) {
        char name[32];
        snprintf(name, sizeof name, "node-%u", n->node_id);
        nl_log_set_name(name);
    }
    NL_INFO("joined again as node %u after %d JOIN(s) (heartbeat %u ms)", n->node_id, n->rejoins,
            n->heartbeat_ms);
    n->rejoins = 0;
    node_send_heartbeat(n);
}

/* ===================== dispatch ===================== */

/* The answers of the VERIFY_CASEs redone since (node/stage_verify.h):
 * VERIFY_RESULT, or an ERROR that says why a case could not be redone. */
static void verify_answers(node *n)
{
    char hex[3][NL_HOP_DIGEST_HEX + 1];
    nl_error e;
    nl_status st;
    while (nl_stage_verify_pop(n->stage, false, &n->tx, hex, &st, &e)) {
        if (st != NL_OK)
            node_send_error(n, st, NL_MSG_VERIFY_CASE, "%s", e.msg);
        else
            node_send_ctl(n, "VERIFY_RESULT");
    }
}

/* A VERIFY_CASE: this node redoes another stage's microbatch, off this
 * thread where it has a verifier's backend (the answer goes out from
 * verify_answers when it is done), else at once. */
static void verify(node *n, const nl_wire_msg *m)
{
    nl_error e;
    nl_status st = nl_stage_verify_push(n->stage, m, &e);
    if (st != NL_OK)
        node_send_error(n, st, NL_MSG_VERIFY_CASE, "%s", e.msg);
    else if (nl_stage_verify_fd(n->stage) < 0) /* done on this thread */
        verify_answers(n);
}

static void on_control(node *n)
{
    const nl_wire_msg *m = &n->rx.msg;
    char text[1100]; /* a peer's free text, escaped for the log */
    switch (m->type) {
    case NL_MSG_ASSIGN:
        node_handle_assign(n, &m->u.assign);
        break;
    case NL_MSG_LAYER_LOAD:
        node_handle_layer_load(n, m);
        break;
    case NL_MSG_LOAD_DONE:
        node_handle_load_done(n, &m->u.load_done);
        break;
    case NL_MSG_ACTIVATION:
    case NL_MSG_COUNT:
    case NL_MSG_EVAL:
        if (node_is_train_hop(m))
            node_handle_train(n, m);
        else
            node_handle_activation(n, m);
        break;
    case NL_MSG_STEP:
    case NL_MSG_CKPT_REQ:
    case NL_MSG_VERIFY_REQ:
        node_handle_train(n, m);
        break;
    case NL_MSG_VERIFY_CASE:
        verify(n, m);
        break;
    case NL_MSG_JOB_SUBMIT:
        node_handle_job_submit(n, &m->u.job_submit);
        break;
    case NL_MSG_JOB_CANCEL:
        node_end_job(n, m->u.job_ref.job_id);
        break;
    case NL_MSG_ERROR:
        if (m->u.error.req_type == NL_MSG_HEARTBEAT && m->u.error.code == NL_ERR_STATE) {
            start_rejoin(n, m->u.error.message);
            break;
        }
        NL_WARN("the coordinator reports an error about %s: %s (%s)",
                nl_wire_type_name(m->u.error.req_type) ? nl_wire_type_name(m->u.error.req_type)
                                                       : "a message",
                nl_log_escape(text, sizeof text, m->u.error.message),
                nl_status_str(m->u.error.code < NL_STATUS_COUNT ? (nl_status)m->u.error.code
                                                                : NL_ERR_PROTO));
        break;
    case NL_MSG_LEAVE: /* the coordinator takes the cluster down: stop, do not rejoin */
        NL_INFO("the coordinator asks this node to leave (%s): stopping",
                nl_log_escape(text, sizeof text, m->u.leave.reason ? m->u.leave.reason : ""));
        n->dismissed = true;
        break;
    case NL_MSG_ACCEPT:
        if (n->rejoining) {
            accepted_again(n, &m->u.accept);
            break;
        }
        NL_DEBUG("ignoring a late %s", nl_wire_type_name(m->type));
        break;
    case NL_MSG_HELLO_ACK:
        NL_DEBUG("ignoring a late %s", nl_wire_type_name(m->type));
        break;
    default:
        node_send_error(n, NL_ERR_UNSUPPORTED, m->type, "a node does not handle %s on control",
                        nl_wire_type_name(m->type));
    }
}

/* On data, from a next stage that dialed in (ASSIGN.links NEXT_DIALS):
 * its HELLO, its gradients, its errors. */
static void on_data_from_next(node *n)
{
    const nl_wire_msg *m = &n->rx.msg;
    nl_error e;
    char text[1100];
    if (m->type == NL_MSG_HELLO) {
        NL_INFO("the next stage dialed in (it accepts no inbound connections)");
        if (nl_sock_answer_hello(n->data, &n->rx, NL_ROLE_NODE, &e) != NL_OK)
            NL_WARN("HELLO_ACK to the next stage: %s", e.msg);
    } else if (m->type == NL_MSG_GRADIENT) {
        node_handle_train(n, m);
    } else if (m->type == NL_MSG_ERROR) {
        NL_WARN("the next stage reports an error about %s: %s",
                nl_wire_type_name(m->u.error.req_type) ? nl_wire_type_name(m->u.error.req_type)
                                                       : "a message",
                nl_log_escape(text, sizeof text, m->u.error.message));
    } else {
        nl_sock_send_error(n->data, &n->rx, NL_ERR_UNSUPPORTED, m->type,
                           "the next stage sends HELLO and GRADIENT only", NULL);
    }
}

static void on_data(node *n)
{
    const nl_wire_msg *m = &n->rx.msg;
    if (node_from_next(n)) {
        on_data_from_next(n);
        return;
    }
    if (m->type == NL_MSG_LOCAL_LINK) {
        node_local_on_prev_msg(n);
        return;
    }
    /* one of a stage's replicas admits two peers: each sends what it may */
    const bool plain = strncmp(n->rx.peer, "plain:", 6) == 0; /* --plaintext: no keys */
    if (m->type == NL_MSG_REDUCE) { /* from the stage's previous replica */
        if (plain || (n->ring_prev_key[0] && strcmp(n->rx.peer, n->ring_prev_key) == 0))
            node_handle_train(n, m);
        else
            NL_WARN("dropped a REDUCE from %.48s, which is not this stage's previous replica",
                    n->rx.peer);
        return;
    }
    if (n->n_fan_prev > 0 && (node_is_train_hop(m) || m->type == NL_MSG_ACTIVATION)) {
        if (node_fan_from_prev(n, m)) /* from the replica of its microbatch */
            node_is_train_hop(m) ? node_handle_train(n, m) : node_handle_activation(n, m);
        return;
    }
    if (node_is_train_hop(m) && n->ring_prev_key[0] && !plain &&
        strcmp(n->rx.peer, n->prev_key) != 0) {
        NL_WARN("dropped a %s from %.48s, which is not the previous stage",
                nl_wire_type_name(m->type), n->rx.peer);
        return;
    }
    if (node_is_train_hop(m)) { /* from the previous stage, which takes the gradients */
        memcpy(n->prev_rid, n->rx.rid, n->rx.rid_len);
        n->prev_rid_len = n->rx.rid_len;
        node_handle_train(n, m);
        return;
    }
    if (m->type == NL_MSG_ACTIVATION) {
        node_handle_activation(n, m);
        return;
    }
    NL_WARN("unexpected %s on data from %.48s", nl_wire_type_name(m->type), n->rx.peer);
    if (m->type != NL_MSG_ERROR)
        nl_sock_send_error(n->data, &n->rx, NL_ERR_UNSUPPORTED, m->type,
                           "a node's data socket takes ACTIVATION, COUNT and EVAL only", NULL);
}

/* On the link this node dialed to the previous stage (ASSIGN.links
 * DIAL_PREV): what a data socket would take, and the HELLO_ACK. */
static void on_prev(node *n)
{
    const nl_wire_msg *m = &n->rx.msg;
    char text[1100];
    if (node_is_train_hop(m))
        node_handle_train(n, m);
    else if (m->type == NL_MSG_ACTIVATION)
        node_handle_activation(n, m);
    else if (m->type == NL_MSG_HELLO_ACK)
        node_on_prev_ready(n);
    else if (m->type == NL_MSG_ERROR)
        NL_WARN("the previous stage reports an error about %s: %s",
                nl_wire_type_name(m->u.error.req_type) ? nl_wire_type_name(m->u.error.req_type)
                                                       : "a message",
                nl_log_escape(text, sizeof text, m->u.error.message));
    else
        NL_DEBUG("ignoring %s from the previous stage", nl_wire_type_name(m->type));
}

static void on_next(node *n)
{
    const nl_wire_msg *m = &n->rx.msg;
    char text[1100];
    nl_error e;
    if (m->type == NL_MSG_GRADIENT)
        node_handle_train(n, m);
    else if (m->type == NL_MSG_LOCAL_LINK)
        node_local_on_next_msg(n);
    else if (m->type == NL_MSG_HELLO) { /* a next stage behind NAT, through the relay */
        if (nl_sock_answer_hello(n->next, &n->rx, NL_ROLE_NODE, &e) != NL_OK)
            NL_WARN("HELLO_ACK to the next stage through the relay: %s", e.msg);
    } else if (m->type == NL_MSG_ERROR)
        NL_WARN("the next stage reports an error about %s: %s",
                nl_wire_type_name(m->u.error.req_type) ? nl_wire_type_name(m->u.error.req_type)
                                                       : "a message",
                nl_log_escape(text, sizeof text, m->u.error.message));
    else
        NL_DEBUG("ignoring %s from the next stage", nl_wire_type_name(m->type));
}

/* Receive and handle what is waiting on one socket (bounded). */
static void drain(node *n, nl_sock *s, void (*handle)(node *))
{
    nl_error e;
    for (int i = 0; i < MAX_DRAIN && !halted(n); i++) {
        nl_status st = nl_sock_recv(s, &n->rx, 0, &e);
        if (st == NL_ERR_TIMEOUT)
            return;
        if (st == NL_OK)
            handle(n);
        else if (st == NL_ERR_AUTH) /* a peer not (or no longer) admitted */
            NL_DEBUG("%s", e.msg);
        else /* a bad message, already answered and counted by the transport */
            NL_WARN("%s", e.msg);
        if (nl_mono_ms() >= n->next_hb_ms)
            node_send_heartbeat(n);
    }
}

/* One of the next stage's replicas' sockets (node_links.c), if it is
 * still one of them. */
static void drain_fan(node *n, void *sock)
{
    for (int k = 0; k < n->n_fan_next; k++)
        if (n->fan_next[k] && nl_sock_handle(n->fan_next[k]) == sock) {
            drain(n, n->fan_next[k], on_next);
            return;
        }
}

static void serve(node *n)
{
    while (!halted(n)) {
        double due = nl_stage_batch_due(n->stage);
        if (due == 0.0) /* what the sockets brought, when the batch is due */
            node_run_batch(n);
        rejoin_tick(n);
        node_links_tick(n);
        int64_t now = nl_mono_ms();
        if (now >= n->next_hb_ms)
            node_send_heartbeat(n);
        int64_t wait = n->next_hb_ms - now;
        int half = (int)(n->heartbeat_ms / 2 > 0 ? n->heartbeat_ms / 2 : 1);
        zmq_pollitem_t it[10 + NL_REDUCE_MAX_REPLICAS] = {
            {nl_sock_handle(n->ctl), 0, ZMQ_POLLIN, 0},
            {nl_sock_handle(n->data), 0, ZMQ_POLLIN, 0}};
        int count = 2;
        const int train_fd = nl_stage_train_fd(n->stage); /* the replicas' threads */
        if (train_fd >= 0)
            it[count++] = (zmq_pollitem_t){NULL, train_fd, ZMQ_POLLIN, 0};
        const int verify_fd = nl_stage_verify_fd(n->stage); /* the verifier's thread */
        if (verify_fd >= 0)
            it[count++] = (zmq_pollitem_t){NULL, verify_fd, ZMQ_POLLIN, 0};
        if (n->next)
            it[count++] = (zmq_pollitem_t){nl_sock_handle(n->next), 0, ZMQ_POLLIN, 0};
        if (n->next_mon)
            it[count++] = (zmq_pollitem_t){n->next_mon, 0, ZMQ_POLLIN, 0};
        if (n->prev_link)
            it[count++] = (zmq_pollitem_t){nl_sock_handle(n->prev_link), 0, ZMQ_POLLIN, 0};
        if (n->prev_mon)
            it[count++] = (zmq_pollitem_t){n->prev_mon, 0, ZMQ_POLLIN, 0};
        for (int k = 0; k < n->n_fan_next; k++) /* the next stage's replicas' gradients */
            if (n->fan_next[k])
                it[count++] = (zmq_pollitem_t){nl_sock_handle(n->fan_next[k]), 0, ZMQ_POLLIN, 0};
        const int local = count; /* the local links' descriptors */
        bool local_ready = false;
        count += node_local_items(n, it + count, &local_ready);
        if (local_ready) /* a message already read ahead: no wait */
            wait = 0;
        if ((due = nl_stage_batch_due(n->stage)) >= 0.0) /* hops wait: until they are due */
            wait = wait < (int64_t)(due * 1e3) + 1 ? wait : (int64_t)(due * 1e3) + (due > 0.0);
        if (zmq_poll(it, count, wait < half ? (wait > 0 ? wait : 0) : half) <= 0) {
            if (!local_ready)
                continue;                   /* timeout, or a signal: check the flag */
            for (int i = 0; i < count; i++) /* only what the links read ahead */
                it[i].revents = 0;
        }
        if (it[0].revents & ZMQ_POLLIN)
            drain(n, n->ctl, on_control);
        if (it[1].revents & ZMQ_POLLIN)
            drain(n, n->data, on_data);
        node_local_events(n, it + local, count - local, on_prev, on_next);
        /* handlers may have replaced the links' sockets: use it[] only if unchanged */
        for (int i = 2; i < local; i++) {
            if (!(it[i].revents & ZMQ_POLLIN))
                continue;
            if (!it[i].socket && it[i].fd == verify_fd)
                verify_answers(n);
            else if (!it[i].socket) /* the replicas' descriptor: its job may have ended meanwhile */
                node_train_poll(n);
            else if (n->next && it[i].socket == nl_sock_handle(n->next))
                drain(n, n->next, on_next);
            else if (n->next_mon && it[i].socket == n->next_mon)
                node_on_next_event(n);
            else if (n->prev_link && it[i].socket == nl_sock_handle(n->prev_link))
                drain(n, n->prev_link, on_prev);
            else if (n->prev_mon && it[i].socket == n->prev_mon)
                node_on_prev_event(n);
            else
                drain_fan(n, it[i].socket);
        }
    }
}

static void leave(node *n, const char *reason)
{
    NL_INFO("leaving: %s", reason);
    nl_wire_msg_reset(&n->tx, NL_MSG_LEAVE);
    n->tx.u.leave = (nl_msg_leave){n->node_id, reason};
    node_send_ctl(n, "LEAVE");
}

nl_status nl_node_run(const nl_node_opts *o, nl_error *err)
{
    node n = {.o = o};
    nl_rx_init(&n.rx);
    nl_wire_msg_init(&n.tx);
    if (!o->listen)
        return nl_error_set(err, NL_ERR_INVALID, "node: no --listen endpoint");
    nl_status st = start(&n, err);
    if (st == NL_OK) {
        serve(&n);
        st = nl_stage_device_status(n.stage, err);
        if (st == NL_OK) {
            leave(&n, n.dismissed ? "asked to leave by the coordinator" : "stopped by a signal");
        } else { /* the job that met the error has failed with it; a training job dies too */
            uint64_t job = 0;
            if (nl_stage_train_running(n.stage, &job) && job != n.last_failed_job)
                node_fail_job(&n, job, st, NL_MSG_STEP, "%s", err->msg);
            NL_ERROR("%s: leaving the cluster", err->msg);
            leave(&n, err->msg);
        }
    }
    /* sockets first (their queued frames reference the stage's buffers),
     * then the context, which waits for the LEAVE to go out */
    nl_rx_free(&n.rx);
    node_drop_next(&n);
    node_fan_drop(&n);
    node_drop_prev(&n);
    node_drop_ring(&n);
    nl_sock_destroy(&n.data);
    nl_sock_destroy(&n.ctl);
    nl_net_destroy(&n.net);
    nl_stage_destroy(&n.stage);
    node_device_close(&n.dev);
    nl_wire_msg_free(&n.tx);
    free(n.ckpt_root);
    return st;
}
