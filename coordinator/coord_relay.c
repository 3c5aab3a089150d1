/* The relay between two neighbouring stages that both accept no inbound
 * connections (docs/cluster.md, "Nodes behind NAT"). Neither can dial the
 * other, and both can dial the coordinator: so both dial the relay, a
 * ROUTER of the coordinator's (CURVE server, the coordinator's key,
 * `--relay-listen`, by default the host of `--listen` at a free port),
 * which passes each message whole from one to the other. The previous
 * stage's next socket has the routing id "<its key>:n", the next stage's
 * link to its previous stage "<its key>:p"; the relay's table pairs them,
 * and its allow-list admits exactly the keys in the table. A message is
 * passed on only if the key its connection authenticated is the one its
 * routing id names, and the table pairs that id: the relay is a pipe
 * between two pinned ends, it decodes nothing (the receiving node checks
 * every message as on a direct link).
 *
 * The relay runs in a thread of its own that owns the socket once started,
 * so a slow end blocks neither the coordinator's loop nor the other pairs
 * for longer than the socket's send timeout; the loop replaces the table
 * at every plan (under a mutex) and the allow-list through net/auth. The
 * messages pass through the coordinator's memory in the clear: it holds
 * the weights and the data anyway (docs/security.md). */
#include "coordinator/coord_impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

#define RID_LEN (NL_KEY_Z85_LEN + 2) /* a key and ":p" or ":n" */

typedef struct rpair {
    char a[RID_LEN + 1], b[RID_LEN + 1]; /* "<prev key>:n" <-> "<next key>:p" */
} rpair;

struct crelay {
    nl_sock *sock;
    int port;
    pthread_t thread;
    atomic_int stop;
    int plaintext;      /* --plaintext: no keys, the routing ids alone say who is who */
    pthread_mutex_t mu; /* guards pairs, n and the counts */
    rpair *pairs;
    int n, cap;
    uint64_t passed, dropped;
};

/* The partner of routing id rid (len bytes) in the table: 1 and *out, or 0. */
static int partner(struct crelay *r, const uint8_t *rid, size_t len, char *out)
{
    int found = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n && !found; i++) {
        const char *other = NULL;
        if (len == strlen(r->pairs[i].a) && memcmp(rid, r->pairs[i].a, len) == 0)
            other = r->pairs[i].b;
        else if (len == strlen(r->pairs[i].b) && memcmp(rid, r->pairs[i].b, len) == 0)
            other = r->pairs[i].a;
        if (other) {
            memcpy(out, other, strlen(other) + 1);
            found = 1;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return found;
}

/* Receive one message (its parts) and pass it on, or drop it. */
static void pass_one(struct crelay *r, void *zs, int plaintext)
{
    zmq_msg_t parts[NL_RX_MAX_PARTS];
    int np = 0, more = 1, ok = 1;
    char to[RID_LEN + 1];
    while (more) {
        zmq_msg_t *p = &parts[np < NL_RX_MAX_PARTS ? np : NL_RX_MAX_PARTS - 1];
        if (np >= NL_RX_MAX_PARTS) { /* too many parts: read the rest into the last, drop */
            zmq_msg_close(p);
            ok = 0;
            np--;
        }
        zmq_msg_init(p);
        if (zmq_msg_recv(p, zs, 0) < 0) {
            zmq_msg_close(p);
            ok = 0;
            break;
        }
        np++;
        more = zmq_msg_more(p);
    }
    /* the routing id names a key: the one this connection authenticated */
    const uint8_t *rid = np > 0 ? zmq_msg_data(&parts[0]) : NULL;
    const size_t rlen = np > 0 ? zmq_msg_size(&parts[0]) : 0;
    const char *uid = np > 1 ? zmq_msg_gets(&parts[1], "User-Id") : NULL;
    ok = ok && np >= 2 && rlen == RID_LEN &&
         (plaintext ||
          (uid && strlen(uid) == NL_KEY_Z85_LEN && memcmp(uid, rid, NL_KEY_Z85_LEN) == 0)) &&
         partner(r, rid, rlen, to);
    int i = 1;
    if (ok && zmq_send(zs, to, strlen(to), ZMQ_SNDMORE) < 0)
        ok = 0;
    for (; ok && i < np; i++)
        if (zmq_msg_send(&parts[i], zs, i + 1 < np ? ZMQ_SNDMORE : 0) < 0)
            ok = 0;              /* the parts sent are empty now: closing them below is harmless */
    for (int k = 0; k < np; k++) /* the sender's routing id; the rest when not passed on */
        if (k == 0 || !ok)
            zmq_msg_close(&parts[k]);
    pthread_mutex_lock(&r->mu);
    if (ok)
        r->passed++;
    else
        r->dropped++;
    pthread_mutex_unlock(&r->mu);
    if (!ok)
        NL_DEBUG("relay: dropped a message of %d parts from %.*s", np, (int)rlen,
                 rid ? (const char *)rid : "");
}

static void *relay_main(void *arg)
{
    struct crelay *r = arg;
    void *zs = nl_sock_handle(r->sock);
    while (!atomic_load(&r->stop)) {
        zmq_pollitem_t it = {zs, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0 || !(it.revents & ZMQ_POLLIN))
            continue;
        for (int k = 0; k < 64; k++) {
            int ev = 0;
            size_t len = sizeof ev;
            if (zmq_getsockopt(zs, ZMQ_EVENTS, &ev, &len) != 0 || !(ev & ZMQ_POLLIN))
                break;
            pass_one(r, zs, r->plaintext);
        }
    }
    return NULL;
}

/* Bind the relay (--relay-listen, or --listen's host at a free port) and
 * start its thread. */
static nl_status relay_start(nl_coord *c, nl_error *err)
{
    char ep[300];
    const char *colon = strrchr(c->endpoint, ':');
    if (c->o.relay_listen)
        snprintf(ep, sizeof ep, "%s", c->o.relay_listen);
    else if (strncmp(c->endpoint, "tcp://", 6) == 0 && colon)
        snprintf(ep, sizeof ep, "%.*s:*", (int)(colon - c->endpoint), c->endpoint);
    else
        return nl_error_set(err, NL_ERR_INVALID,
                            "the relay needs a tcp:// --listen or a --relay-listen (listening "
                            "on %s)",
                            c->endpoint);
    struct crelay *r = calloc(1, sizeof *r);
    if (!r)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory for the relay");
    pthread_mutex_init(&r->mu, NULL);
    r->plaintext = c->o.plaintext;
    nl_sock_opts so = {.type = ZMQ_ROUTER,
                       .keys = &c->keys,
                       .curve_server = true,
                       .plaintext = c->o.plaintext,
                       .name = "relay",
                       .linger_ms = 0,
                       .kind = NL_SOCK_BULK};
    int one = 1, port = 0;
    nl_status st = nl_sock_new(&r->sock, c->net, &so, err);
    /* a node that dials again (its link dropped) takes its routing id over */
    if (st == NL_OK &&
        zmq_setsockopt(nl_sock_handle(r->sock), ZMQ_ROUTER_HANDOVER, &one, sizeof one) != 0)
        st = nl_error_set(err, NL_ERR_IO, "relay: ROUTER_HANDOVER: %s", zmq_strerror(zmq_errno()));
    if (st == NL_OK)
        st = nl_sock_bind(r->sock, ep, err);
    const char *bound = st == NL_OK ? strrchr(nl_sock_endpoint(r->sock), ':') : NULL;
    if (st == NL_OK && (!bound || sscanf(bound + 1, "%d", &port) != 1 || port < 1 || port > 65535))
        st = nl_error_set(err, NL_ERR_INVALID, "relay: %s has no port", nl_sock_endpoint(r->sock));
    r->port = port;
    if (st == NL_OK && pthread_create(&r->thread, NULL, relay_main, r) != 0)
        st = nl_error_set(err, NL_ERR_INTERNAL, "relay: cannot start its thread");
    if (st != NL_OK) {
        nl_sock_destroy(&r->sock);
        pthread_mutex_destroy(&r->mu);
        free(r);
        return nl_error_prefix(err, "--relay-listen %s", ep);
    }
    NL_INFO("relay listening on %s (port %d) for stages that accept no inbound connections",
            nl_sock_endpoint(r->sock), port);
    c->relay = r;
    return NL_OK;
}

void coord_relay_stop(nl_coord *c)
{
    struct crelay *r = c->relay;
    if (!r)
        return;
    atomic_store(&r->stop, 1);
    pthread_join(r->thread, NULL);
    NL_INFO("relay: passed %llu messages, dropped %llu", (unsigned long long)r->passed,
            (unsigned long long)r->dropped);
    nl_sock_destroy(&r->sock);
    pthread_mutex_destroy(&r->mu);
    free(r->pairs);
    free(r);
    c->relay = NULL;
}

int coord_relay_plan(nl_coord *c)
{
    const int ns = c->plan ? c->plan->n_stages : 0;
    rpair *pairs = ns > 1 ? calloc((size_t)ns, sizeof *pairs) : NULL;
    const char **keys = ns > 1 ? calloc((size_t)ns * 2, sizeof *keys) : NULL;
    int n = 0, nk = 0;
    nl_error e = {0};
    for (int s = 0; pairs && keys && s < ns; s++) {
        const cnode *x = coord_stage_node(c, s), *p = coord_stage_node(c, (s + ns - 1) % ns);
        if (!x || !p || !x->no_inbound || !p->no_inbound)
            continue;
        snprintf(pairs[n].a, sizeof pairs[n].a, "%s:n", p->key);
        snprintf(pairs[n].b, sizeof pairs[n].b, "%s:p", x->key);
        keys[nk++] = p->key;
        keys[nk++] = x->key;
        n++;
    }
    if (n > 0 && !c->relay && relay_start(c, &e) != NL_OK)
        NL_ERROR("stages that accept no inbound connections are neighbours, and the relay "
                 "that would join them cannot start: %s",
                 e.msg);
    struct crelay *r = c->relay;
    int port = 0;
    if (r) { /* the old pairs go, the new ones come: the table, then who may connect */
        pthread_mutex_lock(&r->mu);
        free(r->pairs);
        r->pairs = pairs;
        r->n = n;
        pthread_mutex_unlock(&r->mu);
        pairs = NULL;
        if (!c->o.plaintext && nl_sock_allow(r->sock, nk ? keys : NULL, (size_t)nk, &e) != NL_OK)
            NL_ERROR("relay: %s", e.msg);
        else if (n > 0)
            port = r->port;
        if (n > 0)
            NL_INFO("relay: %d pair(s) of neighbouring stages pass through it", n);
    }
    free(pairs);
    free(keys);
    return port;
}
