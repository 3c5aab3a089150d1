/* Private to node/: the node's device (node_device.c), used by the event
 * loop in node.c when it starts; the event loop's state and the functions
 * that node.c (the connection and the dispatch) and node_jobs.c (the
 * handlers of the messages) share. */
#ifndef NL_NODE_IMPL_H
#define NL_NODE_IMPL_H

#include <stdint.h>

#include "base/clock.h"
#include "kernels/backend.h"
#include "kernels/comm.h"
#include "net/locallink.h"
#include "net/transport.h"
#include "node/node.h"
#include "node/stage.h"

typedef struct nl_node_device {
    /* one backend per replica (--device D[,D...]), owned by the caller once
     * set, even when the open failed after: node_device_close */
    nl_backend *be[NL_NODE_MAX_REPLICAS];
    int n;              /* replicas opened */
    nl_comm *comm;      /* over be when n > 1, made and checked before the memory is measured */
    double gflops;      /* GEMM throughput of replica 0 at its probe size (or NL_TEST_GFLOPS) */
    int threads;        /* CPU threads: --threads, or the cores */
    uint64_t memory;    /* offered: the smallest replica's (--memory, or free less the reserve) */
    uint64_t kv_budget; /* of it, for the sessions' KV caches (--kv-budget, or the default) */
    /* the cases this node redoes for other stages run on their own CPU
     * backend of one thread (node/stage_verify.h); NULL on a GPU node,
     * whose cases run on replica 0's */
    nl_backend *verify_be;
} nl_node_device;

/* Open every device of o->device, measure replica 0 and size the offer;
 * logs what it found. */
nl_status node_device_open(nl_node_device *d, const nl_node_opts *o, nl_error *err);
/* Free the backends; safe on a zeroed or closed device. */
void node_device_close(nl_node_device *d);

/* ---- the event loop's state (node.c, node_jobs.c) ---- */

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
    char prev_ep[257]; /* from ASSIGN, for messages, and dialed with NL_LINK_DIAL_PREV */
    /* who dials whom (ASSIGN.links, node_links.c): with NL_LINK_DIAL_PREV
     * this node dials the previous stage (prev_link, CURVE client pinned
     * to prev_key), up once it answered HELLO; LOAD_DONE waits for that */
    uint32_t links;
    nl_sock *prev_link;
    void *prev_mon;
    bool prev_ready;
    int64_t dial_at_ms;
    int dial_wait_ms;
    bool load_pending;
    nl_msg_load_done load_done;
    int64_t load_wait_until;
    int64_t hello_at_ms; /* HELLO again then, until the HELLO_ACK */
    char relay_ep[300];  /* with a RELAY link: the coordinator's host at ASSIGN.relay_port */
    /* one of a stage's replicas (DESIGN section 8): a DEALER to the next
     * replica's data socket, where this one's REDUCE chunks go ("" alone) */
    nl_sock *ring;
    char ring_ep[257], ring_key[NL_KEY_Z85_LEN + 1];
    /* the keys the data socket admits: the previous stage's and the
     * stage's previous replica's (a REDUCE must come from the latter) */
    char prev_key[NL_KEY_Z85_LEN + 1], ring_prev_key[NL_KEY_Z85_LEN + 1];
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
    /* the coordinator sent LEAVE (neuroctl cluster down, neurocoord's
     * SIGUSR2): the node stops as on SIGTERM, and does not rejoin */
    bool dismissed;
    int64_t rejoin_at_ms;
    int rejoin_wait_ms, rejoins;
    uint64_t hb_seq;
    int64_t next_hb_ms;
    int64_t window_ms; /* start of the load window (since the last heartbeat) */
    double busy_ms;    /* time spent in forwards in that window */
    double modelled_s; /* test hook: the stage's compute-model sleeps counted so far */
    /* a training job's time on this node, logged when it ends */
    int64_t train_t0;     /* its first message (0: none yet) */
    double train_busy_ms; /* handling its messages: compute and sends */
    double train_send_ms; /* of which handing hops to the transport */
    uint64_t train_hops, train_bytes;
    uint8_t prev_rid[NL_ROUTING_ID_MAX]; /* the previous stage on data: GRADIENTs go there */
    size_t prev_rid_len;
    /* neighbours with another replica count (ASSIGN.prev_keys,
     * next_endpoints, next_keys; node_links.c): a DEALER to each of the
     * next stage's replicas (made on first use), microbatch i to the
     * i mod n_fan_next'th; the previous stage's replicas' keys and routing
     * ids (learnt from their hops), microbatch i's gradient back to the
     * i mod n_fan_prev'th. 0: the one neighbour above. */
    int n_fan_next, n_fan_prev;
    nl_sock *fan_next[NL_REDUCE_MAX_REPLICAS];
    char fan_next_ep[NL_REDUCE_MAX_REPLICAS][NL_WIRE_PEER_ITEM];
    char fan_next_key[NL_REDUCE_MAX_REPLICAS][NL_WIRE_PEER_ITEM];
    char fan_prev_key[NL_REDUCE_MAX_REPLICAS][NL_WIRE_PEER_ITEM];
    uint8_t fan_prev_rid[NL_REDUCE_MAX_REPLICAS][NL_ROUTING_ID_MAX];
    size_t fan_prev_rid_len[NL_REDUCE_MAX_REPLICAS];
    /* local links with co-located neighbours (node_local.c): this
     * host's text ("" when they are off), the listener offered to the
     * next stage, the links; _tx: hops go on it (after this side's
     * SWITCH), _rx: it is read (after the neighbour's SWITCH) */
    char lk_host[NL_LOCAL_HOST_MAX];
    /* the name of this side's offer to the next stage, and of the offer
     * the link from the previous stage was made for */
    char lk_offer[NL_LOCAL_NAME_MAX], lk_prev_offer[NL_LOCAL_NAME_MAX];
    bool lk_offered; /* this next socket has offered (reset with the socket) */
    nl_local_listener *lk_listen;
    nl_local *lk_next, *lk_prev;
    bool lk_next_tx, lk_next_rx, lk_prev_tx, lk_prev_rx;
    unsigned lk_prev_train_hops; /* taken on the link (the NL_TEST_LOCAL_BREAK_AFTER hook) */
    nl_rx rx;
    nl_wire_msg tx;
} node;

/* node.c: the sends and the coordinator's socket (the clock: nl_mono_ms) */
/* Send tx on the control socket; a failure is logged (the caller goes on). */
nl_status node_send_ctl(node *n, const char *what);
/* ERROR {code, req_type, message} to the coordinator, logged as well. */
void node_send_error(node *n, nl_status code, nl_msg_type req_type, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The failure of one job's work here: JOB_STATUS {job, failed, message}
 * to the coordinator, which fails that job and no other. Logged as well. */
void node_fail_job(node *n, uint64_t job, nl_status code, nl_msg_type req_type, const char *fmt,
                   ...) __attribute__((format(printf, 5, 6)));
void node_send_heartbeat(node *n);
/* Wait, heartbeating, until the stage's last output has been sent. */
void node_wait_sent(node *n);
nl_status node_make_socket(node *n, nl_sock **out, int type, bool server, const char *server_key,
                           const char *name, nl_sock_kind kind, int linger_ms, int send_timeout_ms,
                           nl_error *err);

/* node_local.c: local links with co-located neighbours (net/locallink.h) */
void node_local_init(node *n);
/* OFFER one to the next stage, once per next socket (after its first hop) */
void node_local_offer(node *n);
/* a LOCAL_LINK in n->rx: on the data socket, on the next socket */
void node_local_on_prev_msg(node *n);
void node_local_on_next_msg(node *n);
void node_local_drop_next(node *n);
void node_local_drop_prev(node *n);
/* Send m on the link to the next (or previous) stage if hops go on one:
 * true, with *st its outcome (frames freed); false: use ZeroMQ. */
bool node_local_send(node *n, bool next, nl_wire_msg *m, nl_status *st, nl_error *err);
/* The links' poll items (at most 2; *ready: a link holds a whole message
 * already read, so the poll must not wait), and their events after the
 * poll: messages go to from_prev / from_next as if from the ZeroMQ links. */
int node_local_items(node *n, zmq_pollitem_t *it, bool *ready);
void node_local_events(node *n, const zmq_pollitem_t *it, int count, void (*from_prev)(node *),
                       void (*from_next)(node *));

/* node_links.c: the links to the neighbours. The previous stage's hops
 * come on prev_link, which this node dialed, with either of these links. */
#define NL_NODE_DIALS_PREV (NL_LINK_DIAL_PREV | NL_LINK_RELAY_PREV)
void node_drop_next(node *n);
/* Neighbours with another replica count (node_links.c): take ASSIGN's
 * lists (dropping the last ones' sockets), drop them, send a hop to the
 * next stage's replica of its microbatch or a GRADIENT back to the
 * previous stage's, and admit a hop from the previous stage: false (said
 * in the log) when its sender is not the replica of its microbatch. */
void node_fan_assign(node *n, const nl_msg_assign *a);
void node_fan_drop(node *n);
nl_status node_fan_send_next(node *n, nl_wire_msg *m, nl_error *err);
nl_status node_fan_send_prev(node *n, nl_wire_msg *m, nl_error *err);
bool node_fan_from_prev(node *n, const nl_wire_msg *m);
void node_drop_ring(node *n);
void node_on_next_event(node *n);
/* Send m to the next stage, however its link was made (frames freed
 * whatever happens); errors name the next stage's endpoint. */
nl_status node_send_next(node *n, nl_wire_msg *m, nl_error *err);
/* A new ASSIGN: its links; dials the previous stage where it says so. */
void node_links_assign(node *n, const nl_msg_assign *a);
void node_drop_prev(node *n);
void node_on_prev_event(node *n);
/* The previous stage answered HELLO on prev_link: a held LOAD_DONE goes. */
void node_on_prev_ready(node *n);
/* LOAD_DONE d held until the link to the previous stage is up: true if held. */
bool node_hold_load_done(node *n, const nl_msg_load_done *d);
/* Dial again when it is time; say once when the link is slow to come. */
void node_links_tick(node *n);
/* Is what rx holds on the data socket from a next stage that dialed in? */
bool node_from_next(const node *n);
/* node_jobs.c: the handlers of the messages */
void node_handle_assign(node *n, const nl_msg_assign *a);
void node_handle_layer_load(node *n, const nl_wire_msg *m);
void node_handle_load_done(node *n, const nl_msg_load_done *d);
void node_handle_activation(node *n, const nl_wire_msg *m);
void node_run_batch(node *n);
/* JOB_SUBMIT and JOB_CANCEL of every kind: the stage's job table. */
void node_handle_job_submit(node *n, const nl_msg_job_submit *j);
void node_end_job(node *n, uint64_t job);
void node_handle_train(node *n, const nl_wire_msg *m);
/* Log a training job's time on this node when it ends. */
void node_train_summary(node *n, uint64_t job);
bool node_is_train_hop(const nl_wire_msg *m);
void node_train_poll(node *n);

#endif
