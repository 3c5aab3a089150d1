/* The node's links to its neighbours (docs/ARCHITECTURE.md, "Nodes
 * behind NAT"): the next stage's socket, and the link a node that accepts
 * no inbound connection opens to its previous stage.
 *
 * By default a stage connects a DEALER ("next") to the next stage's data
 * ROUTER, which admits only its key: activations go out on it, gradients
 * come back. ASSIGN.links (net/wire.h) flips who dials, and nothing else:
 *  - NL_LINK_DIAL_PREV: this node cannot be reached. It dials the previous
 *    stage's data endpoint with a DEALER ("prev"), a CURVE client pinned
 *    to prev_key whose routing id is this node's public key, says HELLO
 *    on every handshake, and counts the link up at the HELLO_ACK. Its
 *    hops arrive on that DEALER and its gradients go back on it. A refused
 *    handshake (the previous stage has not had its ASSIGN yet) is final in
 *    libzmq: the link is made again after a pause. LOAD_DONE waits for the
 *    link, so the coordinator sends no work before the hops can pass.
 *  - NL_LINK_NEXT_DIALS: the next stage dials this node's data ROUTER,
 *    which admits next_key too; hops for the next stage go out of the
 *    ROUTER to the routing id next_key, and its gradients come back in.
 *  - NL_LINK_RELAY_PREV and NL_LINK_RELAY_NEXT: neither neighbour can be
 *    reached, so both dial the coordinator's relay (coordinator/
 *    coord_relay.c) on the host this node dials for control, at
 *    ASSIGN.relay_port, pinned to the coordinator's key: the previous
 *    stage's next socket at once (routing id "<key>:n"), this node's link
 *    as with DIAL_PREV (routing id "<key>:p"). The relay passes HELLO and
 *    HELLO_ACK between them like the hops.
 * Either way both ends are pinned by the keys ASSIGN names: the side that
 * listens is the CURVE server and admits only its neighbours' keys (the
 * relay: the keys of the pairs it joins), the side that dials is a CURVE
 * client that checks the server's key.
 *
 * A neighbour stage with another replica count (ASSIGN.prev_keys,
 * next_endpoints, next_keys; DESIGN section 8: microbatch i on replica
 * i mod R_s of stage s) is a fan: a DEALER to each of the next stage's
 * replicas, microbatch i's hops to the one that runs it (an evaluation,
 * inference and tokens to replica 0), its gradient back from there on
 * that DEALER; the data ROUTER admits every replica of the previous
 * stage, takes microbatch i only from the one that runs it, and sends
 * its gradient back to that one's routing id. Fans use links 0 only. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "net/transport.h"
#include "node/node_impl.h"

#define DIAL_FIRST_MS 250  /* the first pause before dialing the previous stage again */
#define DIAL_MAX_MS 2000   /* ... doubling up to this */
#define LINK_WAIT_MS 30000 /* LOAD_DONE waits this long for the link before saying so */
#define HELLO_EVERY_MS                                                                             \
    500 /* HELLO again this often until the answer (a relay's other end                            \
         * may not be there yet) */

/* Give socket s the routing id "<this node's key><suffix>". */
static nl_status set_rid(node *n, nl_sock *s, const char *suffix, nl_error *err)
{
    char id[NL_KEY_Z85_LEN + 3];
    snprintf(id, sizeof id, "%s%s", n->o->keys->public_z85, suffix);
    if (zmq_setsockopt(nl_sock_handle(s), ZMQ_ROUTING_ID, id, strlen(id)) != 0)
        return nl_error_set(err, NL_ERR_IO, "ROUTING_ID: %s", zmq_strerror(zmq_errno()));
    return NL_OK;
}

/* A PAIR that reads socket s's handshake events, or NULL (logged). */
static void *watch(node *n, nl_sock *s, const char *name)
{
    char ep[64];
    int zero = 0;
    void *mon = NULL;
    snprintf(ep, sizeof ep, "inproc://neuronode-%s-%d", name, ++n->mon_seq);
    if (zmq_socket_monitor(nl_sock_handle(s), ep,
                           ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_DISCONNECTED) ==
            0 &&
        (mon = zmq_socket(nl_net_zmq_context(n->net), ZMQ_PAIR)) != NULL) {
        zmq_setsockopt(mon, ZMQ_LINGER, &zero, sizeof zero);
        if (zmq_connect(mon, ep) != 0) {
            zmq_close(mon);
            mon = NULL;
        }
    }
    if (!mon)
        NL_WARN("cannot watch the %s socket's handshakes: %s", name, zmq_strerror(zmq_errno()));
    return mon;
}

/* Stop watching s and close the monitor's PAIR. */
static void unwatch(nl_sock *s, void **mon)
{
    if (!*mon)
        return;
    if (s)
        zmq_socket_monitor(nl_sock_handle(s), NULL, 0);
    zmq_close(*mon);
    *mon = NULL;
}

/* One event from a monitor: its number, or -1 if none could be read. */
static int read_event(void *mon)
{
    uint8_t ev[6];
    char addr[256];
    int len = zmq_recv(mon, ev, sizeof ev, ZMQ_DONTWAIT);
    int alen = len < 0 ? -1 : zmq_recv(mon, addr, sizeof addr - 1, 0);
    if (len != 6 || alen < 0) /* [event u16, value u32] + the peer's address */
        return -1;
    return ev[0] | ev[1] << 8;
}

/* ===================== the next stage ===================== */

void node_drop_next(node *n)
{
    node_local_drop_next(n);
    n->lk_offered = false; /* the next socket offers again */
    unwatch(n->next, &n->next_mon);
    nl_sock_destroy(&n->next); /* linger 0: queued hops are dropped and released */
}

/* Connect the next socket on first use. The coordinator sends work only
 * after every stage answered LOAD_DONE, so the next stage has its ASSIGN
 * (and this node's key in its allow-list) by then: connecting earlier
 * could race it, and a refused CURVE handshake is not retried by libzmq.
 * A monitor reports the handshake's outcome (see node_on_next_event). */
static nl_status ensure_next(node *n, nl_error *err)
{
    if (n->next)
        return NL_OK;
    const bool relay = n->links & NL_LINK_RELAY_NEXT; /* through the coordinator's relay */
    nl_status st = node_make_socket(n, &n->next, ZMQ_DEALER, false,
                                    relay ? n->o->coordinator_key : n->next_key, "next",
                                    NL_SOCK_BULK, 0, 0, err);
    if (st == NL_OK && relay)
        st = set_rid(n, n->next, ":n", err);
    if (st != NL_OK) {
        nl_sock_destroy(&n->next);
        return st;
    }
    n->next_mon = watch(n, n->next, "next");
    st = nl_sock_connect(n->next, relay ? n->relay_ep : n->next_ep, err);
    if (st != NL_OK)
        node_drop_next(n);
    return st;
}

/* A handshake event of the next socket. A refused handshake is final in
 * libzmq (no reconnect), and the hops queued for it are lost: tell the
 * coordinator, and start over with a new socket on the next send. */
void node_on_next_event(node *n)
{
    int event = read_event(n->next_mon);
    if (event < 0)
        return;
    if (n->links & NL_LINK_RELAY_NEXT) { /* the coordinator's relay, which admitted us first */
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED)
            NL_INFO("connected to the relay at %s for the next stage", n->relay_ep);
        else if (event == ZMQ_EVENT_DISCONNECTED)
            NL_WARN("the relay at %s disconnected", n->relay_ep);
        else
            node_send_error(n, NL_ERR_AUTH, NL_MSG_ASSIGN,
                            "the relay at %s refused this node's handshake: is "
                            "--coordinator-key the coordinator's key?",
                            n->relay_ep);
        if (event != ZMQ_EVENT_HANDSHAKE_SUCCEEDED && event != ZMQ_EVENT_DISCONNECTED)
            node_drop_next(n);
        return;
    }
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
        NL_INFO("connected to the next stage at %s", n->next_ep);
    } else if (event == ZMQ_EVENT_DISCONNECTED) {
        NL_WARN("the next stage at %s disconnected", n->next_ep);
    } else {
        node_send_error(
            n, NL_ERR_AUTH, NL_MSG_ASSIGN,
            "the next stage at %s refused this node's handshake (%s): is ASSIGN's next_key "
            "its key, and does it admit this node's key as prev_key?",
            n->next_ep,
            event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? "not authorised" : "protocol error");
        node_drop_next(n);
    }
}

/* Free the frames of a message that is not sent (nl_sock_send would). */
static void release(nl_wire_msg *m)
{
    nl_wire_release_frames(m, 0);
    m->nframes = 0;
}

nl_status node_send_next(node *n, nl_wire_msg *m, nl_error *err)
{
    nl_status st;
    if (n->n_fan_next > 0)
        return node_fan_send_next(n, m, err);
    if (!n->next_ep[0]) {
        release(m);
        return nl_error_set(err, NL_ERR_STATE, "this stage has no next stage");
    }
    if (node_local_send(n, true, m, &st, err)) { /* on the local link */
    } else if (n->links & NL_LINK_NEXT_DIALS) /* the next stage dialed in: out of the data ROUTER */
        st = nl_sock_send(n->data, (const uint8_t *)n->next_key, strlen(n->next_key), m, err);
    else if ((st = ensure_next(n, err)) == NL_OK) {
        st = nl_sock_send(n->next, NULL, 0, m, err);
        if (st == NL_OK) /* a co-located next stage takes the next ones on a local link */
            node_local_offer(n);
    } else {
        release(m);
    }
    return st == NL_OK ? st : nl_error_prefix(err, "cannot reach the next stage at %s", n->next_ep);
}

/* ===================== the link to the previous stage ===================== */

void node_drop_prev(node *n)
{
    node_local_drop_prev(n);
    unwatch(n->prev_link, &n->prev_mon);
    nl_sock_destroy(&n->prev_link);
    n->prev_ready = false;
    n->hello_at_ms = 0; /* HELLO once the next handshake succeeds */
}

/* Dial the previous stage's data endpoint (or the relay); on a failure,
 * try again later. */
static void dial_prev(node *n)
{
    nl_error e;
    const bool relay = n->links & NL_LINK_RELAY_PREV;
    /* the routing id the previous stage (the relay) sends to */
    nl_status st = node_make_socket(n, &n->prev_link, ZMQ_DEALER, false,
                                    relay ? n->o->coordinator_key : n->prev_key, "prev",
                                    NL_SOCK_BULK, 0, 0, &e);
    if (st == NL_OK)
        st = set_rid(n, n->prev_link, relay ? ":p" : "", &e);
    if (st == NL_OK) {
        n->prev_mon = watch(n, n->prev_link, "prev");
        st = nl_sock_connect(n->prev_link, relay ? n->relay_ep : n->prev_ep, &e);
    }
    if (st != NL_OK) {
        NL_WARN("cannot dial the previous stage at %s: %s", n->prev_ep, e.msg);
        node_drop_prev(n);
    }
    n->dial_at_ms = nl_mono_ms() + n->dial_wait_ms;
    n->dial_wait_ms = n->dial_wait_ms * 2 < DIAL_MAX_MS ? n->dial_wait_ms * 2 : DIAL_MAX_MS;
}

/* The relay's endpoint: the host of the coordinator's endpoint, at port. */
static void relay_endpoint(node *n, uint32_t port)
{
    const char *ep = n->o->coordinator, *colon = strrchr(ep, ':');
    n->relay_ep[0] = '\0';
    if (strncmp(ep, "tcp://", 6) == 0 && colon && colon - ep < 250)
        snprintf(n->relay_ep, sizeof n->relay_ep, "%.*s:%u", (int)(colon - ep), ep, port);
    else
        NL_ERROR("the coordinator's relay is at port %u of its host, but %s is no tcp:// endpoint",
                 port, ep);
}

void node_links_assign(node *n, const nl_msg_assign *a)
{
    nl_error e;
    node_drop_prev(n);
    n->links = a->links;
    n->load_pending = false;
    snprintf(n->prev_key, sizeof n->prev_key, "%s", a->prev_key);
    if (n->links & (NL_LINK_RELAY_PREV | NL_LINK_RELAY_NEXT))
        relay_endpoint(n, a->relay_port);
    if (n->links & NL_LINK_RELAY_NEXT) { /* at once: the next stage's HELLO comes through it */
        NL_INFO("the next stage accepts no inbound connections either: its hops go through the "
                "relay at %s",
                n->relay_ep);
        if (ensure_next(n, &e) != NL_OK)
            NL_WARN("cannot dial the relay at %s: %s", n->relay_ep, e.msg);
    }
    if (!(n->links & NL_NODE_DIALS_PREV))
        return;
    if (n->links & NL_LINK_RELAY_PREV)
        NL_INFO("this node accepts no inbound connections, nor does the previous stage at %s: "
                "it dials the relay at %s",
                n->prev_ep, n->relay_ep);
    else
        NL_INFO("this node accepts no inbound connections: it dials the previous stage at %s",
                n->prev_ep);
    n->dial_wait_ms = DIAL_FIRST_MS;
    dial_prev(n);
}

/* HELLO to the previous stage, which answers HELLO_ACK once it knows this
 * node's routing id. */
static void say_hello(node *n)
{
    nl_error e;
    n->hello_at_ms = nl_mono_ms() + HELLO_EVERY_MS;
    nl_wire_msg_reset(&n->tx, NL_MSG_HELLO);
    n->tx.u.hello = (nl_msg_hello){NL_ROLE_NODE, "neuronode"};
    if (nl_sock_send(n->prev_link, NULL, 0, &n->tx, &e) != NL_OK)
        NL_WARN("HELLO to the previous stage at %s: %s", n->prev_ep, e.msg);
}

void node_on_prev_event(node *n)
{
    int event = read_event(n->prev_mon);
    if (event < 0)
        return;
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
        NL_INFO("dialed the previous stage at %s", n->prev_ep);
        n->dial_wait_ms = DIAL_FIRST_MS;
        say_hello(n);
    } else if (event == ZMQ_EVENT_DISCONNECTED) {
        NL_WARN("the previous stage at %s disconnected (libzmq dials again)", n->prev_ep);
    } else { /* refused: it may not admit this node's key yet (its ASSIGN is on the way) */
        NL_INFO("the previous stage at %s refused the handshake (%s): dialing again in %d ms",
                n->prev_ep,
                event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? "not authorised" : "protocol",
                n->dial_wait_ms);
        node_drop_prev(n);
    }
}

void node_on_prev_ready(node *n)
{
    if (!n->prev_ready)
        NL_INFO("the link to the previous stage at %s is up", n->prev_ep);
    n->prev_ready = true;
    if (n->load_pending) {
        n->load_pending = false;
        nl_wire_msg_reset(&n->tx, NL_MSG_LOAD_DONE);
        n->tx.u.load_done = n->load_done;
        node_send_ctl(n, "LOAD_DONE");
    }
}

bool node_hold_load_done(node *n, const nl_msg_load_done *d)
{
    if (!(n->links & NL_NODE_DIALS_PREV) || n->prev_ready)
        return false;
    n->load_done = *d;
    n->load_pending = true;
    n->load_wait_until = nl_mono_ms() + LINK_WAIT_MS;
    NL_INFO("loaded; LOAD_DONE waits for the link to the previous stage at %s", n->prev_ep);
    return true;
}

void node_links_tick(node *n)
{
    if (!(n->links & NL_NODE_DIALS_PREV))
        return;
    const int64_t now = nl_mono_ms();
    if (!n->prev_link && now >= n->dial_at_ms)
        dial_prev(n);
    else if (n->prev_link && !n->prev_ready && n->hello_at_ms && now >= n->hello_at_ms)
        say_hello(n); /* through a relay the other end may have come since */
    if (n->load_pending && n->load_wait_until && now >= n->load_wait_until) {
        n->load_wait_until = 0; /* said once; the dialing goes on */
        node_send_error(n, NL_ERR_TIMEOUT, NL_MSG_ASSIGN,
                        "this node accepts no inbound connections and cannot reach the "
                        "previous stage at %s within %d ms: is that endpoint reachable from "
                        "here, and does it accept inbound connections?",
                        n->prev_ep, LINK_WAIT_MS);
    }
}

bool node_from_next(const node *n)
{
    if (!(n->links & NL_LINK_NEXT_DIALS))
        return false;
    if (!n->o->plaintext) /* the key the handshake authenticated */
        return strcmp(n->rx.peer, n->next_key) == 0;
    size_t len = strlen(n->next_key); /* plaintext: only the routing id says who it is */
    return n->rx.rid_len == len && memcmp(n->rx.rid, n->next_key, len) == 0;
}

/* ===================== neighbours with another replica count ===================== */

void node_fan_drop(node *n)
{
    for (int k = 0; k < NL_REDUCE_MAX_REPLICAS; k++) {
        nl_sock_destroy(&n->fan_next[k]); /* linger 0: queued hops are dropped */
        n->fan_prev_rid_len[k] = 0;
    }
    n->n_fan_next = n->n_fan_prev = 0;
}

void node_fan_assign(node *n, const nl_msg_assign *a)
{
    node_fan_drop(n);
    /* the wire checked the lists (nl_wire_check_assign) */
    const int np = nl_wire_peer_list(a->prev_keys, n->fan_prev_key, NL_REDUCE_MAX_REPLICAS),
              nn = nl_wire_peer_list(a->next_endpoints, n->fan_next_ep, NL_REDUCE_MAX_REPLICAS),
              nk = nl_wire_peer_list(a->next_keys, n->fan_next_key, NL_REDUCE_MAX_REPLICAS);
    n->n_fan_prev = np > 0 ? np : 0;
    n->n_fan_next = nn > 0 && nk == nn ? nn : 0;
    if (n->n_fan_prev || n->n_fan_next)
        NL_INFO("replica %u of %u: the previous stage has %d replicas, the next %d (microbatch i "
                "on replica i mod their number)",
                a->replica, a->replicas ? a->replicas : 1,
                n->n_fan_prev ? n->n_fan_prev : (a->replicas ? (int)a->replicas : 1),
                n->n_fan_next ? n->n_fan_next : (a->replicas ? (int)a->replicas : 1));
}

/* Which replica of a fan of `count` a message goes to or comes from: a
 * training hop's microbatch's, anything else replica 0's. */
static int fan_index(const nl_wire_msg *m, int count)
{
    const bool by_mb = m->type == NL_MSG_COUNT || m->type == NL_MSG_GRADIENT ||
                       (m->type == NL_MSG_ACTIVATION && m->u.hop.step != 0);
    return by_mb ? (int)(m->u.hop.microbatch % (uint32_t)count) : 0;
}

/* A send that fails says "cannot reach the ...": the coordinator reads a
 * stage's failure so worded as a neighbour most likely dead, and waits for
 * the heartbeat timeout's verdict to resume the job rather than fail it
 * (coord_train_stage_failed). */
nl_status node_fan_send_next(node *n, nl_wire_msg *m, nl_error *err)
{
    const int k = fan_index(m, n->n_fan_next);
    nl_status st = NL_OK;
    if (!n->fan_next[k]) { /* on first use, as ensure_next */
        st = node_make_socket(n, &n->fan_next[k], ZMQ_DEALER, false, n->fan_next_key[k], "next",
                              NL_SOCK_BULK, 0, 0, err);
        if (st == NL_OK && (st = nl_sock_connect(n->fan_next[k], n->fan_next_ep[k], err)) != NL_OK)
            nl_sock_destroy(&n->fan_next[k]);
    }
    if (st == NL_OK)
        st = nl_sock_send(n->fan_next[k], NULL, 0, m, err);
    else
        release(m);
    return st == NL_OK ? st
                       : nl_error_prefix(err, "cannot reach the next stage's replica %d at %s", k,
                                         n->fan_next_ep[k]);
}

nl_status node_fan_send_prev(node *n, nl_wire_msg *m, nl_error *err)
{
    const int k = fan_index(m, n->n_fan_prev);
    if (!n->fan_prev_rid_len[k]) {
        release(m);
        return nl_error_set(err, NL_ERR_STATE,
                            "replica %d of the previous stage has sent nothing to this one", k);
    }
    const nl_status st = nl_sock_send(n->data, n->fan_prev_rid[k], n->fan_prev_rid_len[k], m, err);
    return st == NL_OK ? st
                       : nl_error_prefix(err, "cannot reach the previous stage's replica %d", k);
}

bool node_fan_from_prev(node *n, const nl_wire_msg *m)
{
    const int k = fan_index(m, n->n_fan_prev);
    const bool plain = strncmp(n->rx.peer, "plain:", 6) == 0; /* --plaintext: no keys */
    if (!plain && strcmp(n->rx.peer, n->fan_prev_key[k]) != 0) {
        NL_WARN("dropped a %s of microbatch %u from %.48s, which is not replica %d of the "
                "previous stage",
                nl_wire_type_name(m->type), m->u.hop.microbatch, n->rx.peer, k);
        return false;
    }
    memcpy(n->fan_prev_rid[k], n->rx.rid, n->rx.rid_len);
    n->fan_prev_rid_len[k] = n->rx.rid_len;
    return true;
}
