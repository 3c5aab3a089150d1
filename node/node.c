/* The neuronode event loop: joining, heartbeats, and the dispatch of
 * control and data messages to the stage (see node.h and docs/cluster.md). */
#include "node.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../base/log.h"
#include "../core/fileio.h"
#include "../kernels/backend.h"
#include "../net/handshake.h"
#include "../net/transport.h"
#include "node_impl.h"
#include "stage.h"

#define ACCEPT_WAIT_MS 10000 /* for the answer to JOIN */
#define MAX_DRAIN 64         /* messages per socket per turn, so heartbeats keep time */
#define SEND_WAIT_MS 5000    /* for the last output to leave before its buffer is reused */
#define REJOIN_FIRST_MS 250  /* the first pause between JOINs when joining again */
#define REJOIN_MAX_MS 8000   /* ... doubling up to this */

typedef struct node {
    const nl_node_opts *o;
    nl_node_device dev; /* the backends: one per replica (node_device.c) */
    nl_stage *stage;
    nl_net *net;
    nl_sock *ctl, *data, *next;
    void *next_mon; /* PAIR reading the next socket's handshake events */
    int mon_seq;
    /* from ASSIGN; the last stage's next is the first stage (the token
     * ring), "" when the stage is alone */
    char next_ep[257], next_key[NL_KEY_Z85_LEN + 1];
    char prev_ep[257]; /* from ASSIGN, for messages */
    double gflops;
    int threads;
    uint64_t memory;          /* offered: --memory, or a GPU's free memory less the reserve */
    uint64_t last_failed_job; /* the last job fail_job reported */
    char *ckpt_root;          /* --checkpoint-root, resolved; NULL: no checkpoints here */
    uint32_t node_id;
    uint32_t heartbeat_ms, timeout_ms;
    /* joining again: a coordinator that answers "unknown node" (it
     * restarted, or declared this node dead) gets JOIN again, with the
     * same key and data endpoint, every rejoin_wait_ms (doubling to
     * REJOIN_MAX_MS) until it ACCEPTs; no heartbeats meanwhile */
    bool rejoining;
    int64_t rejoin_at_ms;
    int rejoin_wait_ms, rejoins;
    uint64_t hb_seq;
    int64_t next_hb_ms;
    int64_t window_ms; /* start of the load window (since the last heartbeat) */
    double busy_ms;    /* time spent in forwards in that window */
    /* a training job's time on this node, logged when it ends */
    int64_t train_t0;     /* its first message (0: none yet) */
    double train_busy_ms; /* handling its messages: compute and sends */
    double train_send_ms; /* of which handing hops to the transport */
    uint64_t train_hops, train_bytes;
    uint8_t prev_rid[NL_ROUTING_ID_MAX]; /* the previous stage on data: GRADIENTs go there */
    size_t prev_rid_len;
    nl_rx rx;
    nl_wire_msg tx;
} node;

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static bool stopping(const node *n)
{
    return n->o->stop && *n->o->stop;
}

/* Stop serving: a signal, or the device failed (the stage refuses all work). */
static bool halted(const node *n)
{
    return stopping(n) || (n->stage && nl_stage_device_status(n->stage, NULL) != NL_OK);
}

/* ===================== sending ===================== */

/* Send tx on the control socket; a failure is logged (the caller goes on). */
static nl_status send_ctl(node *n, const char *what)
{
    nl_error e;
    nl_status st = nl_sock_send(n->ctl, NULL, 0, &n->tx, &e);
    if (st != NL_OK)
        NL_ERROR("cannot send %s to the coordinator: %s", what, e.msg);
    return st;
}

/* ERROR {code, req_type, message} to the coordinator, logged as well. */
static void send_error(node *n, nl_status code, nl_msg_type req_type, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void send_error(node *n, nl_status code, nl_msg_type req_type, const char *fmt, ...)
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
    send_ctl(n, "ERROR");
}

/* The failure of one job's work here: JOB_STATUS {job, failed, message}
 * to the coordinator, which fails that job and no other. Logged as well. */
static void fail_job(node *n, uint64_t job, nl_status code, nl_msg_type req_type, const char *fmt,
                     ...) __attribute__((format(printf, 5, 6)));

static void fail_job(node *n, uint64_t job, nl_status code, nl_msg_type req_type, const char *fmt,
                     ...)
{
    char text[1025];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (!job) { /* nothing to pin it on */
        send_error(n, code, req_type, "%s", text);
        return;
    }
    const char *why = nl_status_str(code);
    n->last_failed_job = job;
    NL_WARN("%s of job %llu refused (%s): %s", nl_wire_type_name(req_type), (unsigned long long)job,
            why, text);
    /* the field holds 1024 bytes: cut the text, on a UTF-8 boundary, to fit the status */
    size_t keep = strlen(text), room = 1024 - 3 - strlen(why);
    if (keep > room) {
        keep = room;
        while (keep > 0 && ((unsigned char)text[keep] & 0xc0) == 0x80)
            keep--;
    }
    char msg[1025];
    snprintf(msg, sizeof msg, "%.*s (%s)", (int)keep, text, why);
    nl_wire_msg_reset(&n->tx, NL_MSG_JOB_STATUS);
    n->tx.u.job_status = (nl_msg_job_status){job, NL_JOB_FAILED, 0.0, msg};
    send_ctl(n, "JOB_STATUS");
}

static void send_heartbeat(node *n)
{
    int64_t now = mono_ms();
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
    send_ctl(n, "HEARTBEAT");
    n->window_ms = now;
    n->busy_ms = 0;
    n->next_hb_ms = now + n->heartbeat_ms;
}

/* Wait, heartbeating, until the stage's last output has been sent, so
 * that the next forward or assignment may reuse its buffer. A send stuck
 * on a dead peer is given up after SEND_WAIT_MS: the stage then refuses
 * the work with NL_ERR_TIMEOUT, until an ASSIGN closes that socket. */
static void wait_sent(node *n)
{
    nl_txref *ref = nl_stage_txref(n->stage);
    int64_t end = mono_ms() + SEND_WAIT_MS;
    while (!nl_txref_idle(ref) && mono_ms() < end && !stopping(n)) {
        if (mono_ms() >= n->next_hb_ms)
            send_heartbeat(n);
        nanosleep(&(struct timespec){0, 100000}, NULL);
    }
}

/* ===================== joining ===================== */

static nl_status make_socket(node *n, nl_sock **out, int type, bool server, const char *server_key,
                             const char *name, nl_sock_kind kind, int linger_ms,
                             int send_timeout_ms, nl_error *err)
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
    int64_t deadline = mono_ms() + o->connect_timeout_ms;
    int wait_ms = 500;
    for (int attempt = 1;; attempt++) {
        nl_handshake *hs = NULL; /* a refused key is said at once, not retried */
        /* what the coordinator sends (weights in 4 MiB chunks, tokens) is
         * control-sized (net/transport.h) */
        nl_status st = make_socket(n, &n->ctl, ZMQ_DEALER, false, o->coordinator_key, "control",
                                   NL_SOCK_CONTROL, 1000, 3000, err);
        if (st == NL_OK && !o->plaintext)
            st = nl_handshake_watch(&hs, n->net, n->ctl, err);
        if (st == NL_OK)
            st = nl_sock_connect(n->ctl, o->coordinator, err);
        if (st != NL_OK) {
            nl_handshake_destroy(&hs);
            return st;
        }
        int64_t left = deadline - mono_ms(), t0 = mono_ms();
        int ms = left < wait_ms ? (int)(left > 0 ? left : 1) : wait_ms;
        if (hs)
            st = nl_handshake_wait(hs, o->coordinator, ms, err);
        nl_handshake_destroy(&hs);
        if (st == NL_ERR_IO) { /* connection refused: the coordinator may not be up yet */
            int64_t rest = ms - (mono_ms() - t0);
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
        left = deadline - mono_ms();
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
    n->tx.u.join.memory_bytes = n->memory;
    n->tx.u.join.gemm_gflops = n->gflops;
    n->tx.u.join.threads = (uint32_t)n->threads;
    n->tx.u.join.data_endpoint = nl_sock_endpoint(n->data);
}

static nl_status join(node *n, nl_error *err)
{
    fill_join(n);
    nl_status st = nl_sock_send(n->ctl, NULL, 0, &n->tx, err);
    if (st != NL_OK)
        return st;
    int64_t deadline = mono_ms() + ACCEPT_WAIT_MS;
    while (!stopping(n)) {
        int64_t left = deadline - mono_ms();
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
    nl_status st = nl_node_device_open(d, n->o, err);
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
    nl_status st = open_ckpt_root(n, err);
    if (st == NL_OK)
        st = open_device(n, err);
    if (st != NL_OK)
        return st;
    nl_stage_opts so = {.memory_bytes = n->memory,
                        .kv_budget = o->kv_budget,
                        .batch_decode = o->batch_decode,
                        .prefill_chunk = o->prefill_chunk,
                        .batch_wait_ms = o->batch_wait_ms,
                        .send_wait_ms = 1, /* wait_sent waited already */
                        .ckpt_root = n->ckpt_root ? n->ckpt_root : "/nonexistent",
                        .inject_nan_step = o->inject_nan_step,
                        .inject_nan_stage = o->inject_nan_stage,
                        .inject_nan_on = o->inject_nan_on,
                        .tf32 = o->tf32,
                        .train_async = 1}; /* replicas report through serve()'s poll */
    if ((st = nl_stage_new_replicas(&n->stage, n->dev.be, n->dev.n, n->dev.comm, &so, err)) !=
            NL_OK ||
        (st = nl_net_new(&n->net, NULL, err)) != NL_OK ||
        (st = make_socket(n, &n->data, ZMQ_ROUTER, true, NULL, "data", NL_SOCK_BULK, 0, 0, err)) !=
            NL_OK ||
        (st = nl_sock_bind(n->data, o->listen, err)) != NL_OK)
        return st;
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
    n->window_ms = mono_ms();
    send_heartbeat(n);
    return NL_OK;
}

/* ===================== the next stage ===================== */

static void drop_next(node *n)
{
    if (n->next_mon) {
        if (n->next)
            zmq_socket_monitor(nl_sock_handle(n->next), NULL, 0);
        zmq_close(n->next_mon);
        n->next_mon = NULL;
    }
    nl_sock_destroy(&n->next); /* linger 0: queued hops are dropped and released */
}

/* Connect the next socket on first use. The coordinator sends work only
 * after every stage answered LOAD_DONE, so the next stage has its ASSIGN
 * (and this node's key in its allow-list) by then: connecting earlier
 * could race it, and a refused CURVE handshake is not retried by libzmq.
 * A monitor reports the handshake's outcome (see on_next_event). */
static nl_status ensure_next(node *n, nl_error *err)
{
    char mon_ep[64];
    if (n->next)
        return NL_OK;
    nl_status st =
        make_socket(n, &n->next, ZMQ_DEALER, false, n->next_key, "next", NL_SOCK_BULK, 0, 0, err);
    if (st != NL_OK)
        return st;
    snprintf(mon_ep, sizeof mon_ep, "inproc://neuronode-next-%d", ++n->mon_seq);
    int zero = 0;
    if (zmq_socket_monitor(nl_sock_handle(n->next), mon_ep,
                           ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_DISCONNECTED) ==
            0 &&
        (n->next_mon = zmq_socket(nl_net_zmq_context(n->net), ZMQ_PAIR)) != NULL) {
        zmq_setsockopt(n->next_mon, ZMQ_LINGER, &zero, sizeof zero);
        if (zmq_connect(n->next_mon, mon_ep) != 0) {
            zmq_close(n->next_mon);
            n->next_mon = NULL;
        }
    }
    if (!n->next_mon)
        NL_WARN("cannot watch the next socket's handshakes: %s", zmq_strerror(zmq_errno()));
    st = nl_sock_connect(n->next, n->next_ep, err);
    if (st != NL_OK)
        drop_next(n);
    return st;
}

/* A handshake event of the next socket. A refused handshake is final in
 * libzmq (no reconnect), and the hops queued for it are lost: tell the
 * coordinator, and start over with a new socket on the next send. */
static void on_next_event(node *n)
{
    uint8_t ev[6];
    char addr[256];
    int len = zmq_recv(n->next_mon, ev, sizeof ev, ZMQ_DONTWAIT);
    int alen = len < 0 ? -1 : zmq_recv(n->next_mon, addr, sizeof addr - 1, 0);
    if (len != 6 || alen < 0) /* [event u16, value u32] + the peer's address */
        return;
    int event = ev[0] | ev[1] << 8;
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
        NL_INFO("connected to the next stage at %s", n->next_ep);
    } else if (event == ZMQ_EVENT_DISCONNECTED) {
        NL_WARN("the next stage at %s disconnected", n->next_ep);
    } else {
        send_error(n, NL_ERR_AUTH, NL_MSG_ASSIGN,
                   "the next stage at %s refused this node's handshake (%s): is ASSIGN's next_key "
                   "its key, and does it admit this node's key as prev_key?",
                   n->next_ep,
                   event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? "not authorised" : "protocol error");
        drop_next(n);
    }
}

/* ===================== assignment and loading ===================== */

static void handle_assign(node *n, const nl_msg_assign *a)
{
    nl_error e;
    if (a->node_id != n->node_id) {
        send_error(n, NL_ERR_INVALID, NL_MSG_ASSIGN, "ASSIGN epoch %llu is for node %u; this is %u",
                   (unsigned long long)a->epoch, a->node_id, n->node_id);
        return;
    }
    drop_next(n); /* drops what was queued for the old next stage */
    n->next_ep[0] = n->next_key[0] = '\0';
    n->prev_rid_len = 0;
    wait_sent(n);
    nl_status st = nl_stage_assign(n->stage, a, &e);
    const char *prev = a->prev_key;
    if (st == NL_OK)
        st = nl_sock_allow(n->data, prev[0] ? &prev : NULL, prev[0] ? 1 : 0, &e);
    if (st != NL_OK) {
        nl_sock_allow(n->data, NULL, 0, NULL);
        send_error(n, st, NL_MSG_ASSIGN, "%s", e.msg);
        return;
    }
    snprintf(n->next_ep, sizeof n->next_ep, "%s", a->next_endpoint);
    snprintf(n->prev_ep, sizeof n->prev_ep, "%s", a->prev_endpoint);
    snprintf(n->next_key, sizeof n->next_key, "%s", a->next_key);
    const nl_model *m = nl_stage_model(n->stage);
    NL_INFO("assigned epoch %llu: stage %u of %u, layers [%u, %u)%s%s, %zu parameters (%.1f MiB, "
            "%.1f MiB planned); prev %s, next %s",
            (unsigned long long)a->epoch, a->stage, a->num_stages, a->layer0, a->layer1,
            a->has_embed ? " + embedding" : "", a->has_head ? " + head" : "", m->n_params,
            (double)m->n_params * 4 / (1 << 20), (double)a->memory_planned / (1 << 20),
            a->prev_endpoint[0] ? a->prev_endpoint : "(coordinator)",
            a->next_endpoint[0] ? a->next_endpoint : "(coordinator)");
}

static void handle_layer_load(node *n, const nl_wire_msg *m)
{
    nl_error e;
    bool stale = false;
    const nl_msg_layer_load *l = &m->u.layer_load;
    nl_status st = nl_stage_load_chunk(n->stage, l, &m->frames[0], &stale, &e);
    if (st != NL_OK)
        send_error(n, st, NL_MSG_LAYER_LOAD, "%s", e.msg);
    else if (stale)
        NL_DEBUG("ignored LAYER_LOAD %s of epoch %llu (current %llu)", l->name,
                 (unsigned long long)l->epoch, (unsigned long long)nl_stage_epoch(n->stage));
}

static void handle_load_done(node *n, const nl_msg_load_done *d)
{
    nl_error e;
    nl_stage_loaded info;
    bool stale = false;
    nl_status st = nl_stage_load_done(n->stage, d->epoch, d->tensors, &info, &stale, &e);
    if (st != NL_OK) {
        send_error(n, st, NL_MSG_LOAD_DONE, "%s", e.msg);
        return;
    }
    if (stale) {
        NL_INFO("ignored LOAD_DONE of epoch %llu (current %llu)", (unsigned long long)d->epoch,
                (unsigned long long)nl_stage_epoch(n->stage));
        return;
    }
    NL_INFO("loaded epoch %llu: %u tensors, %llu bytes in %.2f s%s", (unsigned long long)d->epoch,
            info.tensors, (unsigned long long)info.bytes, info.seconds,
            info.from_seed ? " (initialised from the seed)" : "");
    nl_wire_msg_reset(&n->tx, NL_MSG_LOAD_DONE);
    n->tx.u.load_done = (nl_msg_load_done){d->epoch, n->node_id, info.tensors, info.bytes};
    send_ctl(n, "LOAD_DONE");
}

/* ===================== jobs ===================== */

/* The token ring: the last stage sends the token it sampled straight to
 * the first stage, at the session's next position (the coordinator only
 * relays the token to the client). A stage that is also the first queues
 * it for its next batch. */
static void feed_first(node *n, const nl_msg_tensor_hop *hop, const nl_stage_out *out)
{
    nl_error e;
    const nl_msg_tensor_hop next = {hop->job_id, 0, 0, hop->session_id, (uint64_t)out->feed_pos,
                                    0.0};
    const nl_model *m = nl_stage_model(n->stage);
    if (m && m->has_embed) {
        const int64_t shape[2] = {1, 1};
        nl_wire_frame f = {0};
        nl_wire_frame_set(&f, &out->token, NL_DTYPE_I32, shape, 2);
        nl_status st = nl_stage_enqueue(n->stage, &next, &f, &e);
        if (st != NL_OK)
            fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION, "%s", e.msg);
        return;
    }
    nl_status st = n->next_ep[0] ? ensure_next(n, &e)
                                 : nl_error_set(&e, NL_ERR_STATE, "no first stage to feed");
    if (st == NL_OK) {
        const int64_t shape[2] = {1, 1};
        nl_wire_msg_reset(&n->tx, NL_MSG_ACTIVATION);
        n->tx.u.hop = next;
        nl_wire_frame_set(&n->tx.frames[0], &out->token, NL_DTYPE_I32, shape, 2); /* copied */
        n->tx.nframes = 1;
        st = nl_sock_send(n->next, NULL, 0, &n->tx, &e);
    }
    if (st != NL_OK)
        fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION,
                 "job %llu session %llu: cannot feed the token to the first stage at %s: %s",
                 (unsigned long long)hop->job_id, (unsigned long long)hop->session_id, n->next_ep,
                 e.msg);
}

/* Send what a hop gave: a token to the coordinator (and the first
 * stage), logits to the coordinator, hidden states to the next stage. */
static void send_output(node *n, const nl_msg_tensor_hop *hop, const nl_stage_out *o)
{
    nl_error e;
    nl_status st;
    const nl_stage_out out = *o;
    nl_txref *ref = nl_stage_txref(n->stage);
    if (out.kind == NL_STAGE_OUT_TOKEN) {
        if (out.feed) /* first: it is the next token's critical path */
            feed_first(n, hop, &out);
        uint32_t id = (uint32_t)out.token;
        nl_wire_msg_reset(&n->tx, NL_MSG_TOKEN);
        n->tx.u.token = (nl_msg_token){hop->job_id, hop->session_id, 1, &id, out.last};
        send_ctl(n, "TOKEN");
        return;
    }
    if (out.kind == NL_STAGE_OUT_LOGITS) {
        nl_wire_msg_reset(&n->tx, NL_MSG_RESULT);
        n->tx.u.hop = (nl_msg_tensor_hop){hop->job_id, 0, 0, 0, hop->pos_offset, out.aux};
        nl_txref_frame(&n->tx.frames[0], ref, out.data, NL_DTYPE_F32, out.shape, out.ndim);
        n->tx.nframes = 1;
        send_ctl(n, "RESULT");
        return;
    }
    if (!n->next_ep[0]) {
        fail_job(n, hop->job_id, NL_ERR_STATE, NL_MSG_ACTIVATION,
                 "job %llu: this stage has no next stage to send its hidden states to",
                 (unsigned long long)hop->job_id);
        return;
    }
    if ((st = ensure_next(n, &e)) != NL_OK) {
        fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION, "job %llu: %s",
                 (unsigned long long)hop->job_id, e.msg);
        return;
    }
    nl_wire_msg_reset(&n->tx, NL_MSG_ACTIVATION);
    n->tx.u.hop = (nl_msg_tensor_hop){hop->job_id, 0, 0, hop->session_id, hop->pos_offset, out.aux};
    nl_txref_frame(&n->tx.frames[0], ref, out.data, NL_DTYPE_F32, out.shape, out.ndim);
    n->tx.nframes = 1;
    st = nl_sock_send(n->next, NULL, 0, &n->tx, &e);
    if (st != NL_OK)
        fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION,
                 "job %llu: cannot send to the next stage: %s", (unsigned long long)hop->job_id,
                 e.msg);
}

static void handle_activation(node *n, const nl_wire_msg *m)
{
    nl_error e;
    nl_stage_out out;
    const nl_msg_tensor_hop *hop = &m->u.hop;
    if (hop->session_id && nl_stage_session_closed(n->stage, hop->session_id)) {
        NL_DEBUG("dropped a hop of closed session %llu", (unsigned long long)hop->session_id);
        return; /* in flight when its job ended or was cancelled */
    }
    nl_status st;
    if (hop->session_id) { /* queued: run in the next batch (run_batch) */
        if ((st = nl_stage_enqueue(n->stage, hop, &m->frames[0], &e)) != NL_OK)
            fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION, "%s", e.msg);
        return;
    }
    wait_sent(n);
    int64_t t0 = mono_ms();
    st = nl_stage_forward(n->stage, hop, &m->frames[0], &out, &e);
    n->busy_ms += (double)(mono_ms() - t0);
    if (st != NL_OK) {
        fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION, "%s", e.msg);
        return;
    }
    send_output(n, hop, &out);
}

/* Run one batch of the queued session hops and send what finished. */
static void run_batch(node *n)
{
    nl_error e;
    const nl_stage_result *r = NULL;
    int k = 0;
    wait_sent(n);
    int64_t t0 = mono_ms();
    nl_status st = nl_stage_run_batch(n->stage, &r, &k, &e);
    n->busy_ms += (double)(mono_ms() - t0);
    for (int i = 0; i < k; i++) {
        const nl_msg_tensor_hop hop = {r[i].job_id,     0,           0, r[i].session_id,
                                       r[i].pos_offset, r[i].out.aux};
        if (r[i].st != NL_OK)
            fail_job(n, r[i].job_id, r[i].st, NL_MSG_ACTIVATION, "%s", r[i].msg);
        else
            send_output(n, &hop, &r[i].out);
    }
    if (st != NL_OK) /* the device: the loop stops, and the node leaves */
        NL_ERROR("a batch of sessions: %s", e.msg);
}

static void handle_job_submit(node *n, const nl_msg_job_submit *j)
{
    nl_error e;
    nl_stage_session_params p;
    nl_status st = nl_stage_parse_session(j, &p, &e);
    if (st == NL_OK)
        st = nl_stage_open_session(n->stage, &p, &e);
    if (st != NL_OK) { /* p.id is 0 if the request named no session */
        fail_job(n, p.id, st, NL_MSG_JOB_SUBMIT, "%s", e.msg);
        return;
    }
    NL_INFO("session %llu open: %d positions, KV %zu of %llu bytes in use, %d sessions",
            (unsigned long long)p.id, p.capacity, nl_stage_kv_used(n->stage),
            (unsigned long long)n->o->kv_budget, nl_stage_session_count(n->stage));
    nl_wire_msg_reset(&n->tx, NL_MSG_JOB_STATUS);
    n->tx.u.job_status = (nl_msg_job_status){p.id, NL_JOB_RUNNING, 0.0, "session open"};
    send_ctl(n, "JOB_STATUS");
}

/* An embedding job's request (node/stage_embed.c): the hop that follows
 * keeps its pads apart and, on the last stage, is pooled. */
static void handle_embed_submit(node *n, const nl_msg_job_submit *j)
{
    nl_error e;
    uint64_t job = 0;
    nl_status st = nl_stage_embed_begin(n->stage, j, &job, &e);
    if (st != NL_OK) {
        fail_job(n, job, st, NL_MSG_JOB_SUBMIT, "%s", e.msg);
        return;
    }
    nl_wire_msg_reset(&n->tx, NL_MSG_JOB_STATUS);
    n->tx.u.job_status = (nl_msg_job_status){job, NL_JOB_RUNNING, 0.0, "embedding"};
    send_ctl(n, "JOB_STATUS");
}

/* JOB_CANCEL of a generation: drop the session, saying what it cost here. */
static void close_session(node *n, uint64_t id)
{
    nl_stage_session_info i;
    if (!nl_stage_session(n->stage, id, &i))
        return;
    nl_stage_close_session(n->stage, id);
    NL_INFO("session %llu closed: %d positions; prefill %.2f ms, %d decode steps of %.3f ms each "
            "(this stage's compute)",
            (unsigned long long)id, i.len, i.prefill_s * 1e3, i.steps,
            i.steps ? i.step_s * 1e3 / i.steps : 0.0);
}

/* ===================== training ===================== */

/* Where the stage's training messages go (nl_stage_send_fn). */
static nl_status train_send_to(node *n, nl_stage_dest to, nl_wire_msg *m, nl_error *err);

/* Sends, timed: what hops cost the stage (bench/bench_pipeline.sh reads
 * the summary logged at the job's end). */
static nl_status train_send(void *ctx, nl_stage_dest to, nl_wire_msg *m, nl_error *err)
{
    node *n = ctx;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    nl_status st = train_send_to(n, to, m, err);
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (mono_ms() >= n->next_hb_ms) /* a long run of queued hops keeps the heartbeat */
        send_heartbeat(n);
    n->train_send_ms += (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
    n->train_hops++;
    for (int i = 0; i < m->nframes; i++)
        n->train_bytes += m->frames[i].len;
    return st;
}

static nl_status train_send_to(node *n, nl_stage_dest to, nl_wire_msg *m, nl_error *err)
{
    if (to == NL_STAGE_TO_COORD)
        return nl_sock_send(n->ctl, NULL, 0, m, err);
    nl_status st;
    if (to == NL_STAGE_TO_PREV) {
        if (!n->prev_rid_len)
            return nl_error_set(err, NL_ERR_STATE, "no previous stage has sent to this one");
        st = nl_sock_send(n->data, n->prev_rid, n->prev_rid_len, m, err);
        /* the coordinator names the node behind the endpoint */
        return st == NL_OK
                   ? st
                   : nl_error_prefix(err, "cannot reach the previous stage at %s", n->prev_ep);
    }
    if (!n->next_ep[0])
        return nl_error_set(err, NL_ERR_STATE, "this stage has no next stage");
    st = ensure_next(n, err);
    if (st == NL_OK)
        st = nl_sock_send(n->next, NULL, 0, m, err);
    return st == NL_OK ? st : nl_error_prefix(err, "cannot reach the next stage at %s", n->next_ep);
}

/* CKPT_REQ.dir confined to the node's checkpoint root (resolved, links
 * followed, missing directories made 0700): *out is the real directory,
 * malloc'd. Without a root the node writes no checkpoints. */
static nl_status ckpt_dir(node *n, const char *dir, char **out, nl_error *err)
{
    *out = NULL;
    if (!n->ckpt_root)
        return nl_error_set(err, NL_ERR_AUTH,
                            "CKPT_REQ: this node has no --checkpoint-root (nor --state-dir): it "
                            "writes no checkpoints");
    nl_status st = nl_path_confine(n->ckpt_root, dir, out, err);
    return st == NL_OK ? st : nl_error_prefix(err, "CKPT_REQ under --checkpoint-root");
}

/* A training message from any socket: the stage runs what it can. */
static void handle_train(node *n, const nl_wire_msg *m)
{
    if (m->type == NL_MSG_CKPT_REQ) /* writing a shard takes a while: be heard first */
        send_heartbeat(n);
    nl_error e;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    if (!n->train_t0)
        n->train_t0 = mono_ms();
    if (!nl_stage_train_holds(n->stage, m)) { /* in flight when its job ended */
        NL_DEBUG("dropped a %s of a job this stage does not train", nl_wire_type_name(m->type));
        return;
    }
    const uint64_t job = nl_stage_train_job_of(m); /* a training or fine-tuning job */
    char *real = NULL;
    nl_status st = NL_OK;
    if (m->type == NL_MSG_CKPT_REQ && (st = ckpt_dir(n, m->u.ckpt_req.dir, &real, &e)) == NL_OK) {
        nl_wire_msg req = *m; /* the stage writes into the real directory */
        req.u.ckpt_req.dir = real;
        st = nl_stage_train_input(n->stage, &req, train_send, n, &e);
    } else if (st == NL_OK) {
        st = nl_stage_train_input(n->stage, m, train_send, n, &e);
    }
    free(real);
    if (n->o->inject_slow_ms > 0 && m->type != NL_MSG_CKPT_REQ) {
        const long long ns = (long long)(n->o->inject_slow_ms * 1e6);
        struct timespec d = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
        nanosleep(&d, NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    const double ms = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
    n->busy_ms += ms;
    n->train_busy_ms += ms;
    if (st != NL_OK)
        fail_job(n, job, st, m->type, "%s", e.msg);
}

static void handle_train_submit(node *n, const nl_msg_job_submit *j)
{
    nl_error e;
    uint64_t job = 0;
    nl_status st = nl_stage_train_begin(n->stage, j, &job, &e);
    if (st != NL_OK) { /* job is 0 if the request named none */
        fail_job(n, job, st, NL_MSG_JOB_SUBMIT, "%s", e.msg);
        return;
    }
    nl_wire_msg_reset(&n->tx, NL_MSG_JOB_STATUS);
    n->tx.u.job_status = (nl_msg_job_status){job, NL_JOB_RUNNING, 0.0, "training"};
    send_ctl(n, "JOB_STATUS");
}

/* How the ended job's time went on this node. */
static void train_summary(node *n, uint64_t job)
{
    const double wall = n->train_t0 ? (double)(mono_ms() - n->train_t0) : 0.0;
    const double compute = n->train_busy_ms - n->train_send_ms;
    NL_INFO("train job %llu ended: %.1f s, of which computing %.1f s (%.0f%%), sending %llu "
            "messages (%.1f MiB) %.3f s (%.1f%%), waiting %.1f s (%.0f%%)",
            (unsigned long long)job, wall / 1e3, compute / 1e3,
            wall > 0 ? 100 * compute / wall : 0.0, (unsigned long long)n->train_hops,
            (double)n->train_bytes / (1 << 20), n->train_send_ms / 1e3,
            wall > 0 ? 100 * n->train_send_ms / wall : 0.0, (wall - n->train_busy_ms) / 1e3,
            wall > 0 ? 100 * (wall - n->train_busy_ms) / wall : 0.0);
    n->train_t0 = 0;
    n->train_busy_ms = n->train_send_ms = 0;
    n->train_hops = n->train_bytes = 0;
}

static bool is_train_hop(const nl_wire_msg *m)
{
    return m->type == NL_MSG_COUNT || m->type == NL_MSG_EVAL ||
           (m->type == NL_MSG_ACTIVATION && m->u.hop.step != 0);
}

/* The training job's replicas finished some work: send what it made. */
static void train_poll(node *n)
{
    nl_error e;
    uint64_t job = 0;
    nl_stage_train_running(n->stage, &job);
    nl_status st = nl_stage_train_poll(n->stage, train_send, n, &e);
    if (st != NL_OK)
        fail_job(n, job, st, NL_MSG_STEP, "%s", e.msg);
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
    if (nl_stage_train_running(n->stage, &job) && nl_stage_train_end(n->stage, job))
        train_summary(n, job);
    n->rejoining = true;
    n->rejoin_at_ms = mono_ms();
    n->rejoin_wait_ms = REJOIN_FIRST_MS;
}

/* While joining again: JOIN when its time has come, then wait longer. */
static void rejoin_tick(node *n)
{
    const int64_t now = mono_ms();
    if (!n->rejoining || now < n->rejoin_at_ms)
        return;
    fill_join(n);
    send_ctl(n, "JOIN");
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
    send_heartbeat(n);
}

/* ===================== dispatch ===================== */

static void on_control(node *n)
{
    const nl_wire_msg *m = &n->rx.msg;
    char text[1100]; /* a peer's free text, escaped for the log */
    switch (m->type) {
    case NL_MSG_ASSIGN:
        handle_assign(n, &m->u.assign);
        break;
    case NL_MSG_LAYER_LOAD:
        handle_layer_load(n, m);
        break;
    case NL_MSG_LOAD_DONE:
        handle_load_done(n, &m->u.load_done);
        break;
    case NL_MSG_ACTIVATION:
    case NL_MSG_COUNT:
    case NL_MSG_EVAL:
        if (is_train_hop(m))
            handle_train(n, m);
        else
            handle_activation(n, m);
        break;
    case NL_MSG_STEP:
    case NL_MSG_CKPT_REQ:
        handle_train(n, m);
        break;
    case NL_MSG_JOB_SUBMIT:
        if (m->u.job_submit.kind == NL_JOB_TRAIN || m->u.job_submit.kind == NL_JOB_FINETUNE)
            handle_train_submit(n, &m->u.job_submit);
        else if (m->u.job_submit.kind == NL_JOB_EMBED)
            handle_embed_submit(n, &m->u.job_submit);
        else
            handle_job_submit(n, &m->u.job_submit);
        break;
    case NL_MSG_JOB_CANCEL:
        close_session(n, m->u.job_ref.job_id);
        nl_stage_embed_end(n->stage, m->u.job_ref.job_id);
        if (nl_stage_train_end(n->stage, m->u.job_ref.job_id))
            train_summary(n, m->u.job_ref.job_id);
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
        send_error(n, NL_ERR_UNSUPPORTED, m->type, "a node does not handle %s on control",
                   nl_wire_type_name(m->type));
    }
}

static void on_data(node *n)
{
    const nl_wire_msg *m = &n->rx.msg;
    if (is_train_hop(m)) { /* from the previous stage, which takes the gradients */
        memcpy(n->prev_rid, n->rx.rid, n->rx.rid_len);
        n->prev_rid_len = n->rx.rid_len;
        handle_train(n, m);
        return;
    }
    if (m->type == NL_MSG_ACTIVATION) {
        handle_activation(n, m);
        return;
    }
    NL_WARN("unexpected %s on data from %.48s", nl_wire_type_name(m->type), n->rx.peer);
    if (m->type != NL_MSG_ERROR)
        nl_sock_send_error(n->data, &n->rx, NL_ERR_UNSUPPORTED, m->type,
                           "a node's data socket takes ACTIVATION, COUNT and EVAL only", NULL);
}

static void on_next(node *n)
{
    const nl_wire_msg *m = &n->rx.msg;
    char text[1100];
    if (m->type == NL_MSG_GRADIENT)
        handle_train(n, m);
    else if (m->type == NL_MSG_ERROR)
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
        if (mono_ms() >= n->next_hb_ms)
            send_heartbeat(n);
    }
}

static void serve(node *n)
{
    while (!halted(n)) {
        double due = nl_stage_batch_due(n->stage);
        if (due == 0.0) /* what the sockets brought, when the batch is due */
            run_batch(n);
        rejoin_tick(n);
        int64_t now = mono_ms();
        if (now >= n->next_hb_ms)
            send_heartbeat(n);
        int64_t wait = n->next_hb_ms - now;
        int half = (int)(n->heartbeat_ms / 2 > 0 ? n->heartbeat_ms / 2 : 1);
        zmq_pollitem_t it[5] = {{nl_sock_handle(n->ctl), 0, ZMQ_POLLIN, 0},
                                {nl_sock_handle(n->data), 0, ZMQ_POLLIN, 0}};
        int count = 2;
        const int train_fd = nl_stage_train_fd(n->stage); /* the replicas' threads */
        if (train_fd >= 0)
            it[count++] = (zmq_pollitem_t){NULL, train_fd, ZMQ_POLLIN, 0};
        if (n->next)
            it[count++] = (zmq_pollitem_t){nl_sock_handle(n->next), 0, ZMQ_POLLIN, 0};
        if (n->next_mon)
            it[count++] = (zmq_pollitem_t){n->next_mon, 0, ZMQ_POLLIN, 0};
        if ((due = nl_stage_batch_due(n->stage)) >= 0.0) /* hops wait: until they are due */
            wait = wait < (int64_t)(due * 1e3) + 1 ? wait : (int64_t)(due * 1e3) + (due > 0.0);
        if (zmq_poll(it, count, wait < half ? (wait > 0 ? wait : 0) : half) <= 0)
            continue; /* timeout, or a signal: check the flag */
        if (it[0].revents & ZMQ_POLLIN)
            drain(n, n->ctl, on_control);
        if (it[1].revents & ZMQ_POLLIN)
            drain(n, n->data, on_data);
        /* handlers may have replaced the next socket: use it[] only if unchanged */
        for (int i = 2; i < count; i++) {
            if (!(it[i].revents & ZMQ_POLLIN))
                continue;
            if (!it[i].socket) /* the replicas' descriptor: its job may have ended meanwhile */
                train_poll(n);
            else if (n->next && it[i].socket == nl_sock_handle(n->next))
                drain(n, n->next, on_next);
            else if (n->next_mon && it[i].socket == n->next_mon)
                on_next_event(n);
        }
    }
}

static void leave(node *n, const char *reason)
{
    NL_INFO("leaving: %s", reason);
    nl_wire_msg_reset(&n->tx, NL_MSG_LEAVE);
    n->tx.u.leave = (nl_msg_leave){n->node_id, reason};
    send_ctl(n, "LEAVE");
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
            leave(&n, "stopped by a signal");
        } else { /* the job that met the error has failed with it; a training job dies too */
            uint64_t job = 0;
            if (nl_stage_train_running(n.stage, &job) && job != n.last_failed_job)
                fail_job(&n, job, st, NL_MSG_STEP, "%s", err->msg);
            NL_ERROR("%s: leaving the cluster", err->msg);
            leave(&n, err->msg);
        }
    }
    /* sockets first (their queued frames reference the stage's buffers),
     * then the context, which waits for the LEAVE to go out */
    nl_rx_free(&n.rx);
    drop_next(&n);
    nl_sock_destroy(&n.data);
    nl_sock_destroy(&n.ctl);
    nl_net_destroy(&n.net);
    nl_stage_destroy(&n.stage);
    nl_node_device_close(&n.dev);
    nl_wire_msg_free(&n.tx);
    free(n.ckpt_root);
    return st;
}
