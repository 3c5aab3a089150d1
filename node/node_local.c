/* Local links with co-located neighbours (net/locallink.h; the handshake
 * is LOCAL_LINK in net/wire.h and docs/protocol.md, "Local links").
 *
 * A stage that dials its next stage the default way (no NEXT_DIALS or
 * RELAY_NEXT in ASSIGN.links, a next stage of its replica count) OFFERs it
 * a local link once per next socket, right after the first hop it sends on
 * it (the hop goes first: an offer must not delay it). A next stage on the same host (the same
 * boot id, user and network namespace) connects and says READY; this stage takes the connection and
 * says SWITCH, and from then sends the next stage's hops on the local link; the next stage reads
 * the local link from that SWITCH on, says SWITCH back, and sends its gradients there. Each side
 * reads the other's local bytes only after the other's SWITCH, the last thing it sent on ZeroMQ: no
 * hop overtakes another.
 *
 * A link that breaks (the neighbour died, or a new ASSIGN closed its end)
 * is closed, said in the log, and the hops go on ZeroMQ again; a new
 * ASSIGN drops both ends (node_drop_next, node_drop_prev) and the next
 * first send offers again. */
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "node/node_impl.h"

void node_local_init(node *n)
{
    nl_error e;
    n->lk_host[0] = '\0';
    if (n->o->no_local_link)
        return;
    if (nl_local_host(n->lk_host, sizeof n->lk_host, &e) != NL_OK) {
        n->lk_host[0] = '\0';
        NL_INFO("no local links to co-located stages: %s", e.msg);
    }
}

static const char *peer_name(const node *n, bool next)
{
    const char *k = next ? n->next_key : n->prev_key;
    return k[0] ? k : next ? "plain:next" : "plain:prev";
}

static void log_end(const nl_local *c, const char *who, const char *why)
{
    nl_local_stats s = nl_local_get_stats(c);
    NL_INFO("the local link with the %s stage %s: %llu messages sent (%.1f MiB, %llu waited), "
            "%llu received (%.1f MiB)",
            who, why, (unsigned long long)s.sent, (double)s.bytes_out / (1 << 20),
            (unsigned long long)s.outbox_waits, (unsigned long long)s.received,
            (double)s.bytes_in / (1 << 20));
}

void node_local_drop_next(node *n)
{
    if (n->lk_next)
        log_end(n->lk_next, "next", "closed");
    nl_local_close(&n->lk_next);
    nl_local_listener_close(&n->lk_listen);
    n->lk_next_tx = n->lk_next_rx = false;
}

void node_local_drop_prev(node *n)
{
    if (n->lk_prev)
        log_end(n->lk_prev, "previous", "closed");
    nl_local_close(&n->lk_prev);
    n->lk_prev_tx = n->lk_prev_rx = false;
}

/* Whether the link with the next (previous) stage is the default one: this
 * stage dials the next stage's data socket, and neither is a fan. */
static bool eligible(const node *n, bool next)
{
    if (next)
        return !(n->links & (NL_LINK_NEXT_DIALS | NL_LINK_RELAY_NEXT)) && n->n_fan_next == 0;
    return !(n->links & NL_NODE_DIALS_PREV) && n->n_fan_prev == 0;
}

/* Send a LOCAL_LINK on s (to the sender of rx where it is a reply), in a
 * message of its own (n->tx may hold the hop just sent), without waiting:
 * the link is an optimisation, and a neighbour's queue that is full (or a
 * handshake libzmq refused, which leaves the socket no peer) must not
 * hold the node's loop. */
static nl_status say(nl_sock *s, const nl_rx *to, nl_msg_local_link l, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_LOCAL_LINK);
    m.u.local_link = l;
    nl_status st = to ? nl_sock_send_nowait(s, to->rid, to->rid_len, &m, err)
                      : nl_sock_send_nowait(s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    return st;
}

/* READY, SWITCH or DECLINE about the offer `name`; false (logged) when it
 * could not go. */
static bool answer(nl_sock *s, const nl_rx *to, uint32_t op, const char *name, const char *reason)
{
    nl_error e;
    char why[257]; /* the field's 256 bytes */
    snprintf(why, sizeof why, "%.*s", reason ? (int)nl_wire_utf8_fit(reason, 256) : 0,
             reason ? reason : "");
    if (say(s, to, (nl_msg_local_link){op, "", name, "", why}, &e) == NL_OK)
        return true;
    NL_WARN("LOCAL_LINK to the %s stage: %s", to ? "previous" : "next", e.msg);
    return false;
}

void node_local_offer(node *n)
{
    nl_error e;
    char token[NL_LOCAL_TOKEN_HEX + 1];
    if (n->lk_offered || !n->lk_host[0] || !eligible(n, true) || !n->next)
        return;
    n->lk_offered = true; /* once per next socket */
    if (nl_local_listen(&n->lk_listen, n->lk_offer, token, &e) != NL_OK) {
        NL_WARN("no local link offered to the next stage: %s", e.msg);
        return;
    }
    if (say(n->next, NULL, (nl_msg_local_link){NL_LOCAL_OFFER, n->lk_host, n->lk_offer, token, ""},
            &e) != NL_OK) {
        NL_WARN("LOCAL_LINK OFFER to the next stage: %s", e.msg);
        nl_local_listener_close(&n->lk_listen);
    }
}

/* A LOCAL_LINK on the data socket: from the previous stage, this the
 * downstream side. Answers name the offer; a SWITCH or DECLINE about
 * another offer than the one this side connected for (an earlier one, in
 * flight when a new ASSIGN replaced it) is ignored. */
void node_local_on_prev_msg(node *n)
{
    const nl_msg_local_link *l = &n->rx.msg.u.local_link;
    nl_error e;
    const bool from_prev =
        n->o->plaintext ? n->prev_ep[0] != '\0' : strcmp(n->rx.peer, n->prev_key) == 0;
    if (!from_prev) {
        NL_WARN("dropped a LOCAL_LINK from %.48s, which is not the previous stage", n->rx.peer);
        return;
    }
    const bool ours = n->lk_prev && strcmp(l->name, n->lk_prev_offer) == 0;
    if (l->op == NL_LOCAL_OFFER) {
        node_local_drop_prev(n); /* an offer replaces an earlier link */
        const char *why = !n->lk_host[0] ? "local links are off here"
                          : !eligible(n, false)
                              ? "the link with the previous stage is not the default"
                          : strcmp(l->host, n->lk_host) != 0 ? "another host"
                                                             : NULL;
        if (!why && nl_local_connect(l->name, l->token, nl_net_limits(n->net), 0, 0,
                                     peer_name(n, false), &n->lk_prev, &e) != NL_OK)
            why = e.msg;
        snprintf(n->lk_prev_offer, sizeof n->lk_prev_offer, "%s", l->name);
        if (!answer(n->data, &n->rx, why ? NL_LOCAL_DECLINE : NL_LOCAL_READY, l->name, why))
            node_local_drop_prev(n);
        else if (why)
            NL_INFO("the previous stage's hops stay on ZeroMQ: %s", why);
    } else if (l->op == NL_LOCAL_SWITCH && ours && !n->lk_prev_rx) {
        n->lk_prev_rx = true; /* what follows its SWITCH comes on the link */
        /* the previous stage's own socket, the last of its messages on
         * ZeroMQ: GRADIENTs go back there if the link breaks (training hops
         * taken on the link set no routing id) */
        memcpy(n->prev_rid, n->rx.rid, n->rx.rid_len);
        n->prev_rid_len = n->rx.rid_len;
        /* ours goes back; only then may this side's own hops take the link */
        n->lk_prev_tx = answer(n->data, &n->rx, NL_LOCAL_SWITCH, l->name, NULL);
        NL_INFO("the previous stage's hops come on a local link%s",
                n->lk_prev_tx ? "" : " (this stage's go back on ZeroMQ)");
    } else if (l->op == NL_LOCAL_DECLINE && ours) {
        NL_INFO("the previous stage declined the local link: %s", l->reason);
        node_local_drop_prev(n);
    } else if (l->op != NL_LOCAL_OFFER) {
        NL_DEBUG("ignored a LOCAL_LINK op %u about offer %s", l->op, l->name);
    }
}

/* A LOCAL_LINK on the next socket: from the next stage, this the upstream
 * side; only answers about this side's offer count. */
void node_local_on_next_msg(node *n)
{
    const nl_msg_local_link *l = &n->rx.msg.u.local_link;
    nl_error e;
    const bool ours = (n->lk_listen || n->lk_next) && strcmp(l->name, n->lk_offer) == 0;
    if (!ours) {
        NL_DEBUG("ignored a LOCAL_LINK op %u about offer %s", l->op, l->name);
    } else if (l->op == NL_LOCAL_READY && n->lk_listen && !n->lk_next) {
        const nl_wire_limits *lim = nl_net_limits(n->net);
        nl_status st =
            nl_local_accept(n->lk_listen, lim, 0, 0, peer_name(n, true), &n->lk_next, &e);
        nl_local_listener_close(&n->lk_listen);
        if (st != NL_OK) {
            NL_WARN("the next stage's hops stay on ZeroMQ: %s", e.msg);
            answer(n->next, NULL, NL_LOCAL_DECLINE, l->name, e.msg);
            return;
        }
        if (!answer(n->next, NULL, NL_LOCAL_SWITCH, l->name, NULL)) { /* it would never read it */
            node_local_drop_next(n);
            return;
        }
        n->lk_next_tx = true;
        NL_INFO("the next stage's hops go on a local link");
    } else if (l->op == NL_LOCAL_SWITCH && n->lk_next) {
        n->lk_next_rx = true;
    } else if (l->op == NL_LOCAL_DECLINE) {
        NL_INFO("the next stage declined the local link: %s", l->reason);
        node_local_drop_next(n);
    }
}

/* A link that failed: closed, and the hops go on ZeroMQ again. */
static void broke(node *n, bool next, const char *why)
{
    nl_local *c = next ? n->lk_next : n->lk_prev;
    if (c)
        log_end(c, next ? "next" : "previous", "broke");
    NL_WARN("the local link with the %s stage: %s; its hops go on ZeroMQ again",
            next ? "next" : "previous", why);
    if (next) {
        nl_local_close(&n->lk_next);
        n->lk_next_tx = n->lk_next_rx = false;
    } else {
        nl_local_close(&n->lk_prev);
        n->lk_prev_tx = n->lk_prev_rx = false;
    }
}

bool node_local_send(node *n, bool next, nl_wire_msg *m, nl_status *st, nl_error *err)
{
    nl_local *c = next ? n->lk_next : n->lk_prev;
    if (!c || !(next ? n->lk_next_tx : n->lk_prev_tx))
        return false;
    *st = nl_local_send(c, m, err);
    if (*st != NL_OK && nl_local_broken(c))
        broke(n, next, err->msg);
    return true;
}

int node_local_items(node *n, zmq_pollitem_t *it, bool *ready)
{
    int k = 0;
    *ready = (n->lk_prev_rx && nl_local_ready(n->lk_prev)) ||
             (n->lk_next_rx && nl_local_ready(n->lk_next));
    nl_local *c[2] = {n->lk_prev, n->lk_next};
    const bool rx[2] = {n->lk_prev_rx, n->lk_next_rx};
    for (int i = 0; i < 2; i++) {
        short ev = (short)((rx[i] ? ZMQ_POLLIN : 0) | (nl_local_pending(c[i]) ? ZMQ_POLLOUT : 0));
        if (c[i] && ev)
            it[k++] = (zmq_pollitem_t){NULL, nl_local_fd(c[i]), ev, 0};
    }
    return k;
}

/* Receive and handle what waits on one link (bounded, as drain()). */
static void drain_link(node *n, bool next, void (*handle)(node *))
{
    nl_error e;
    for (int i = 0; i < 64; i++) {
        nl_local *c = next ? n->lk_next : n->lk_prev;
        if (!c || !(next ? n->lk_next_rx : n->lk_prev_rx))
            return;
        nl_status st = nl_local_recv(c, &n->rx, &e);
        if (st == NL_ERR_TIMEOUT)
            return;
        if (st == NL_OK) {
#ifdef NL_TEST_HOOKS
            const bool train = !next && node_is_train_hop(&n->rx.msg);
#endif
            handle(n);
#ifdef NL_TEST_HOOKS
            if (train && n->o->inject_local_break && n->lk_prev &&
                ++n->lk_prev_train_hops == n->o->inject_local_break)
                broke(n, false, "ended by NL_TEST_LOCAL_BREAK_AFTER");
#endif
        } else if (nl_local_broken(c)) /* closed, or a record over the limits */
            broke(n, next, e.msg);
        else
            NL_WARN("%s", e.msg); /* one bad message: its record is consumed */
        if (nl_mono_ms() >= n->next_hb_ms)
            node_send_heartbeat(n);
    }
}

void node_local_events(node *n, const zmq_pollitem_t *it, int count, void (*from_prev)(node *),
                       void (*from_next)(node *))
{
    nl_error e;
    for (int i = 0; i < count; i++) {
        const bool next = n->lk_next && it[i].fd == nl_local_fd(n->lk_next);
        nl_local *c = next ? n->lk_next : n->lk_prev;
        if (!c || it[i].fd != nl_local_fd(c))
            continue; /* closed meanwhile */
        if ((it[i].revents & ZMQ_POLLOUT) && nl_local_flush(c, &e) != NL_OK) {
            broke(n, next, e.msg);
            continue;
        }
        if ((it[i].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) || nl_local_ready(c))
            drain_link(n, next, next ? from_next : from_prev);
    }
}
