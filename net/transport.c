/* ZeroMQ sockets with CURVE by default, whole-message send and receive,
 * the versioned hello, and the bad-input policy (strike, answer, drop). */
#include "net/transport.h"

#include "net/connguard.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "base/log.h"

#define SOFTWARE "neurollm"

/* Message parts received into an nl_rx and not yet closed, in this process
 * (nl_net_parts_open) */
static atomic_long parts_open;

struct nl_net {
    void *zctx;
    nl_auth *auth;
    nl_wire_limits lim;
    atomic_uint next_domain;
};

struct nl_sock {
    nl_net *net;
    void *zs;
    int type;
    bool server, plaintext, private_domain;
    char name[32];
    char domain[NL_ZAP_DOMAIN_MAX];
    char server_key[NL_KEY_Z85_LEN + 1];
    char endpoint[256];
    uint64_t max_msg;    /* bytes of all parts of one message */
    nl_connguard *guard; /* a control-sized server's: cuts a message that never ends */
    nl_wire_wbuf wbuf;
};

/* ===================== the context ===================== */

nl_net_opts nl_net_opts_default(void)
{
    nl_net_opts o = {
        .limits = nl_wire_limits_default(), .policy = nl_auth_policy_default(), .io_threads = 1};
    return o;
}

nl_status nl_net_new(nl_net **out, const nl_net_opts *opts, nl_error *err)
{
    nl_net_opts o = opts ? *opts : nl_net_opts_default();
    *out = NULL;
    nl_net *n = calloc(1, sizeof *n);
    if (!n)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    n->lim = o.limits;
    n->zctx = zmq_ctx_new();
    if (!n->zctx) {
        free(n);
        return nl_error_set(err, NL_ERR_IO, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    }
    if (o.io_threads > 0)
        zmq_ctx_set(n->zctx, ZMQ_IO_THREADS, o.io_threads);
    nl_status st = nl_auth_new(&n->auth, n->zctx, &o.policy, err);
    if (st != NL_OK) {
        nl_net_destroy(&n);
        return st;
    }
    *out = n;
    return NL_OK;
}

void nl_net_destroy(nl_net **np)
{
    if (!np || !*np)
        return;
    nl_net *n = *np;
    nl_auth_destroy(&n->auth);
    if (n->zctx)
        zmq_ctx_term(n->zctx);
    free(n);
    *np = NULL;
}

long nl_net_parts_open(void)
{
    return atomic_load(&parts_open);
}

bool nl_net_parts_check(const char *who)
{
    const long n = nl_net_parts_open();
    if (n != 0)
        NL_ERROR("%s: %ld received message part(s) never closed (an nl_rx not freed): a leak", who,
                 n);
    return n == 0;
}

nl_auth *nl_net_auth(nl_net *n)
{
    return n->auth;
}

void *nl_net_zmq_context(nl_net *n)
{
    return n->zctx;
}

const nl_wire_limits *nl_net_limits(const nl_net *n)
{
    return &n->lim;
}

/* ===================== sockets ===================== */

static const char *zerr(void)
{
    return zmq_strerror(zmq_errno());
}

static nl_status setopt(nl_sock *s, int opt, const void *v, size_t len, const char *what,
                        nl_error *err)
{
    if (zmq_setsockopt(s->zs, opt, v, len) != 0)
        return nl_error_set(err, NL_ERR_IO, "socket %s: cannot set %s: %s", s->name, what, zerr());
    return NL_OK;
}

static nl_status setint(nl_sock *s, int opt, int v, const char *what, nl_error *err)
{
    return setopt(s, opt, &v, sizeof v, what, err);
}

static nl_status check_opts(const nl_sock_opts *o, const char *name, nl_error *err)
{
    int t = o->type;
    if (t != ZMQ_ROUTER && t != ZMQ_DEALER && t != ZMQ_PUSH && t != ZMQ_PULL && t != ZMQ_PAIR)
        return nl_error_set(err, NL_ERR_INVALID, "socket %s: unsupported zmq type %d", name, t);
    if (o->plaintext)
        return NL_OK;
    if (!o->keys || !nl_wire_z85_key_ok(o->keys->secret_z85, strlen(o->keys->secret_z85)) ||
        !nl_wire_z85_key_ok(o->keys->public_z85, strlen(o->keys->public_z85)))
        return nl_error_set(err, NL_ERR_AUTH, "socket %s: CURVE needs our keypair", name);
    if (!o->curve_server &&
        (!o->server_key || !nl_wire_z85_key_ok(o->server_key, strlen(o->server_key))))
        return nl_error_set(err, NL_ERR_AUTH, "socket %s: a CURVE client needs the server's key",
                            name);
    return NL_OK;
}

static nl_status setup_security(nl_sock *s, const nl_sock_opts *o, nl_error *err)
{
    nl_auth *a = s->net->auth;
    nl_status st = NL_OK;
    if (o->curve_server) {
        if (o->zap_domain) {
            snprintf(s->domain, sizeof s->domain, "%s", o->zap_domain);
        } else {
            snprintf(s->domain, sizeof s->domain, "nl-sock-%u",
                     atomic_fetch_add(&s->net->next_domain, 1));
            s->private_domain = true;
            nl_keylist none = {0};
            st = nl_auth_set_keys(a, s->domain, &none, err);
        }
    }
    if (st == NL_OK && s->server)
        st = setopt(s, ZMQ_ZAP_DOMAIN, s->domain, strlen(s->domain), "ZAP domain", err);
    if (st != NL_OK || o->plaintext) {
        if (st == NL_OK && s->server)
            st = nl_auth_allow_plaintext(a, s->domain, err);
        return st;
    }
    if (o->curve_server) {
        st = setint(s, ZMQ_CURVE_SERVER, 1, "CURVE server", err);
    } else {
        snprintf(s->server_key, sizeof s->server_key, "%s", o->server_key);
        st = setopt(s, ZMQ_CURVE_SERVERKEY, o->server_key, NL_KEY_Z85_LEN + 1, "server key", err);
        if (st == NL_OK)
            st = setopt(s, ZMQ_CURVE_PUBLICKEY, o->keys->public_z85, NL_KEY_Z85_LEN + 1,
                        "public key", err);
    }
    if (st == NL_OK)
        st = setopt(s, ZMQ_CURVE_SECRETKEY, o->keys->secret_z85, NL_KEY_Z85_LEN + 1, "secret key",
                    err);
    return st;
}

nl_status nl_sock_new(nl_sock **out, nl_net *net, const nl_sock_opts *o, nl_error *err)
{
    *out = NULL;
    const char *name = o->name ? o->name : "socket";
    nl_status st = check_opts(o, name, err);
    if (st != NL_OK)
        return st;
    nl_sock *s = calloc(1, sizeof *s);
    if (!s)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    s->net = net;
    s->type = o->type;
    s->server = o->curve_server;
    s->plaintext = o->plaintext;
    snprintf(s->name, sizeof s->name, "%s", name);
    s->zs = zmq_socket(net->zctx, o->type);
    if (!s->zs) {
        st = nl_error_set(err, NL_ERR_IO, "socket %s: %s", name, zerr());
        goto fail;
    }
    const uint64_t bulk = net->lim.max_frame_bytes > net->lim.max_header ? net->lim.max_frame_bytes
                                                                         : net->lim.max_header;
    const bool control = o->kind == NL_SOCK_CONTROL;
    uint64_t part = o->max_part_bytes ? o->max_part_bytes : control ? NL_SOCK_CONTROL_PART : bulk;
    s->max_msg = o->max_msg_bytes ? o->max_msg_bytes : control ? NL_SOCK_CONTROL_MSG : 2 * bulk;
    if (part > INT64_MAX)
        part = INT64_MAX;
    int64_t maxmsg = (int64_t)part;
    int hwm = o->hwm > 0 ? o->hwm : 64;
    int sndtimeo = o->send_timeout_ms == 0 ? 10000 : o->send_timeout_ms;
    st = setopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg, "MAXMSGSIZE", err);
    if (st == NL_OK)
        st = setint(s, ZMQ_LINGER, o->linger_ms >= 0 ? o->linger_ms : 500, "LINGER", err);
    if (st == NL_OK)
        st = setint(s, ZMQ_SNDHWM, hwm, "SNDHWM", err);
    if (st == NL_OK)
        st = setint(s, ZMQ_RCVHWM, hwm, "RCVHWM", err);
    if (st == NL_OK)
        st = setint(s, ZMQ_SNDTIMEO, sndtimeo < 0 ? -1 : sndtimeo, "SNDTIMEO", err);
    if (st == NL_OK)
        st = setint(s, ZMQ_HANDSHAKE_IVL, 10000, "HANDSHAKE_IVL", err);
    if (st == NL_OK && o->type == ZMQ_ROUTER)
        st = setint(s, ZMQ_ROUTER_MANDATORY, 1, "ROUTER_MANDATORY", err);
    if (st == NL_OK)
        st = setup_security(s, o, err);
    /* libzmq buffers a message whole before anyone sees it: on a control
     * socket that peers reach (a server), a connection whose unfinished
     * message outgrows two messages' limit is cut (net/connguard.h) */
    if (st == NL_OK && control && s->server)
        st = nl_connguard_new(&s->guard, net->zctx, s->zs, s->name, 2 * s->max_msg + (64u << 10),
                              err);
    if (st != NL_OK)
        goto fail;
    if (o->plaintext)
        NL_WARN("INSECURE: socket %s is plaintext: no encryption, no authentication", s->name);
    *out = s;
    return NL_OK;
fail:
    nl_sock_destroy(&s);
    return st;
}

void nl_sock_destroy(nl_sock **sp)
{
    if (!sp || !*sp)
        return;
    nl_sock *s = *sp;
    nl_connguard_destroy(&s->guard, s->zs);
    if (s->zs)
        zmq_close(s->zs);
    if (s->private_domain)
        nl_auth_drop_domain(s->net->auth, s->domain);
    nl_wire_wbuf_free(&s->wbuf);
    free(s);
    *sp = NULL;
}

nl_status nl_sock_bind(nl_sock *s, const char *endpoint, nl_error *err)
{
    size_t len = sizeof s->endpoint;
    if (zmq_bind(s->zs, endpoint) != 0)
        return nl_error_set(err, NL_ERR_IO, "socket %s: cannot bind %s: %s", s->name, endpoint,
                            zerr());
    if (zmq_getsockopt(s->zs, ZMQ_LAST_ENDPOINT, s->endpoint, &len) != 0)
        snprintf(s->endpoint, sizeof s->endpoint, "%s", endpoint);
    return NL_OK;
}

const char *nl_sock_endpoint(const nl_sock *s)
{
    return s->endpoint;
}

nl_status nl_sock_connect(nl_sock *s, const char *endpoint, nl_error *err)
{
    if (zmq_connect(s->zs, endpoint) != 0)
        return nl_error_set(err, NL_ERR_IO, "socket %s: cannot connect to %s: %s", s->name,
                            endpoint, zerr());
    return NL_OK;
}

nl_status nl_sock_allow(nl_sock *s, const char *const *keys, size_t n, nl_error *err)
{
    if (!s->server || !s->domain[0])
        return nl_error_set(err, NL_ERR_INVALID, "socket %s does not accept peers", s->name);
    return nl_auth_set_keys_z85(s->net->auth, s->domain, keys, n, err);
}

const char *nl_sock_domain(const nl_sock *s)
{
    return s->domain;
}

void *nl_sock_handle(nl_sock *s)
{
    return s->zs;
}

/* ===================== sending ===================== */

static nl_status send_failed(nl_sock *s, const char *what, nl_error *err)
{
    int e = zmq_errno();
    nl_status st = e == EAGAIN ? NL_ERR_TIMEOUT : e == EHOSTUNREACH ? NL_ERR_NOTFOUND : NL_ERR_IO;
    return nl_error_set(err, st, "socket %s: sending %s: %s", s->name, what,
                        e == EAGAIN         ? "timed out (peer not reading?)"
                        : e == EHOSTUNREACH ? "peer is gone"
                                            : zmq_strerror(e));
}

static nl_status send_msg(nl_sock *s, const uint8_t *to, size_t to_len, nl_wire_msg *m, int flags,
                          nl_error *err)
{
    nl_status st = nl_wire_encode(m, &s->wbuf, &s->net->lim, err);
    int sent = 0; /* frames handed to libzmq */
    if (st != NL_OK)
        goto out;
    if (s->type == ZMQ_ROUTER) {
        if (!to || to_len == 0 || to_len > NL_ROUTING_ID_MAX) {
            st =
                nl_error_set(err, NL_ERR_INVALID, "socket %s: a ROUTER send needs a peer", s->name);
            goto out;
        }
        if (zmq_send(s->zs, to, to_len, flags | ZMQ_SNDMORE) < 0) {
            st = send_failed(s, "routing id", err);
            goto out;
        }
    }
    if (zmq_send(s->zs, s->wbuf.data, s->wbuf.len, flags | (m->nframes ? ZMQ_SNDMORE : 0)) < 0) {
        st = send_failed(s, "header", err);
        goto out;
    }
    for (; sent < m->nframes; sent++) {
        nl_wire_frame *f = &m->frames[sent];
        zmq_msg_t zm;
        int rc = f->free_fn ? zmq_msg_init_data(&zm, f->t.data, f->len, f->free_fn, f->hint)
                            : zmq_msg_init_size(&zm, f->len);
        if (rc != 0) {
            st = nl_error_set(err, NL_ERR_NOMEM, "socket %s: frame of %zu bytes", s->name, f->len);
            goto out;
        }
        if (!f->free_fn)
            memcpy(zmq_msg_data(&zm), f->t.data, f->len);
        bool last = sent + 1 == m->nframes;
        if (zmq_msg_send(&zm, s->zs, flags | (last ? 0 : ZMQ_SNDMORE)) < 0) {
            st = send_failed(s, "frame", err);
            zmq_msg_close(&zm); /* calls free_fn */
            sent++;
            goto out;
        }
    }
out:
    nl_wire_release_frames(m, sent);
    return st;
}

nl_status nl_sock_send(nl_sock *s, const uint8_t *to, size_t to_len, nl_wire_msg *m, nl_error *err)
{
    return send_msg(s, to, to_len, m, 0, err);
}

nl_status nl_sock_send_nowait(nl_sock *s, const uint8_t *to, size_t to_len, nl_wire_msg *m,
                              nl_error *err)
{
    /* libzmq checks the high-water mark at a message's first part; the
     * others of a message begun always go */
    return send_msg(s, to, to_len, m, ZMQ_DONTWAIT, err);
}

nl_status nl_sock_reply(nl_sock *s, const nl_rx *rx, nl_wire_msg *m, nl_error *err)
{
    return send_msg(s, rx->rid, rx->rid_len, m, 0, err);
}

nl_status nl_sock_send_error(nl_sock *s, const nl_rx *rx, nl_status code, uint32_t req_type,
                             const char *message, nl_error *err)
{
    nl_wire_msg m;
    char text[1025];
    const size_t n = nl_wire_utf8_fit(message, 1024); /* the field's limit */
    memcpy(text, message, n);
    text[n] = '\0';
    nl_wire_msg_init(&m);
    m.type = NL_MSG_ERROR;
    m.u.error.code = code > 0 && code < 1000 ? (uint32_t)code : NL_ERR_INTERNAL;
    m.u.error.req_type = nl_wire_type_name(req_type) ? req_type : 0;
    m.u.error.message = text;
    return send_msg(s, rx->rid, rx->rid_len, &m, ZMQ_DONTWAIT, err);
}

/* ===================== receiving ===================== */

void nl_rx_init(nl_rx *rx)
{
    memset(rx, 0, sizeof *rx);
    nl_wire_msg_init(&rx->msg);
}

static void rx_release(nl_rx *rx)
{
    for (int i = 0; i < rx->nparts; i++)
        zmq_msg_close(&rx->parts[i]);
    atomic_fetch_sub(&parts_open, rx->nparts);
    rx->nparts = 0;
    rx->rid_len = 0;
    rx->peer[0] = '\0';
}

void nl_rx_free(nl_rx *rx)
{
    if (!rx)
        return;
    rx_release(rx);
    nl_wire_msg_free(&rx->msg);
}

static void free_part(void *data, void *hint)
{
    (void)hint;
    free(data);
}

nl_status nl_rx_adopt(nl_rx *rx, void *const *bufs, const size_t *lens, int n, const char *peer,
                      const nl_wire_limits *lim, nl_error *err)
{
    rx_release(rx);
    snprintf(rx->peer, sizeof rx->peer, "%s", peer ? peer : "");
    nl_wire_part wp[NL_RX_MAX_PARTS];
    for (int i = 0; i < n; i++) {
        if (i >= NL_RX_MAX_PARTS ||
            zmq_msg_init_data(&rx->parts[i], bufs[i], lens[i], free_part, NULL) != 0) {
            for (int j = i; j < n; j++)
                free(bufs[j]);
            return nl_error_set(err, i >= NL_RX_MAX_PARTS ? NL_ERR_LIMIT : NL_ERR_NOMEM,
                                "a message of %d parts from %.48s", n, rx->peer);
        }
        rx->nparts = i + 1;
        atomic_fetch_add(&parts_open, 1);
        wp[i] = (nl_wire_part){bufs[i], lens[i]};
    }
    return nl_wire_decode(&rx->msg, wp, n, lim, err);
}

static bool can_reply(const nl_sock *s)
{
    return s->type == ZMQ_ROUTER || s->type == ZMQ_DEALER || s->type == ZMQ_PAIR;
}

/* A bad message: count it, answer it where possible, report it. */
static nl_status bad_message(nl_sock *s, nl_rx *rx, int hdr, nl_status st, nl_error *e,
                             nl_error *err)
{
    uint32_t v = 0, t = 0;
    if (hdr < rx->nparts)
        nl_wire_peek(zmq_msg_data(&rx->parts[hdr]), zmq_msg_size(&rx->parts[hdr]), &v, &t);
    nl_auth_strike(s->net->auth, rx->peer, e->msg);
    if (can_reply(s) && t != NL_MSG_ERROR && (s->type != ZMQ_ROUTER || rx->rid_len > 0))
        nl_sock_send_error(s, rx, st, t, e->msg, NULL);
    NL_DEBUG("socket %s: bad message from %.48s: %s", s->name, rx->peer, e->msg);
    return nl_error_set(err, st, "socket %s: bad message from %.48s: %s", s->name, rx->peer,
                        e->msg);
}

static void find_peer(nl_sock *s, nl_rx *rx, int hdr)
{
    const char *uid = NULL;
    if (rx->nparts > 0)
        uid = zmq_msg_gets(&rx->parts[hdr < rx->nparts ? hdr : 0], "User-Id");
    if (s->server)
        snprintf(rx->peer, sizeof rx->peer, "%s", uid ? uid : "");
    else if (s->plaintext)
        snprintf(rx->peer, sizeof rx->peer, "plain:server");
    else
        snprintf(rx->peer, sizeof rx->peer, "%s", s->server_key);
}

/* Read every part of the next message; parts past the cap are freed as
 * they come. *total gets the bytes of all parts. Returns the number of
 * parts, -1 when nothing was there. */
static int read_parts(nl_sock *s, nl_rx *rx, bool *over, uint64_t *total)
{
    zmq_msg_t extra;
    int n = 0;
    bool more = true;
    *over = false;
    *total = 0;
    while (more) {
        zmq_msg_t *m = n < NL_RX_MAX_PARTS ? &rx->parts[n] : &extra;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, s->zs, n == 0 && !*over ? ZMQ_DONTWAIT : 0) < 0) {
            zmq_msg_close(m);
            return n == 0 ? -1 : n;
        }
        more = zmq_msg_more(m);
        *total += zmq_msg_size(m);
        if (m == &extra) {
            *over = true;
            zmq_msg_close(m);
        } else {
            rx->nparts = ++n;
            atomic_fetch_add(&parts_open, 1);
        }
    }
    return n;
}

/* Wait for the next message's parts. zmq_poll can report a socket readable
 * when no whole message is there yet; then wait again, to the deadline. */
static nl_status wait_parts(nl_sock *s, nl_rx *rx, int timeout_ms, bool *over, uint64_t *total,
                            nl_error *err)
{
    int64_t deadline = nl_mono_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    for (;;) {
        int left = timeout_ms < 0 ? -1 : (int)(deadline - nl_mono_ms());
        zmq_pollitem_t it = {s->zs, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, left < 0 && timeout_ms >= 0 ? 0 : left);
        if (rc < 0 && zmq_errno() != EINTR)
            return nl_error_set(err, NL_ERR_IO, "socket %s: poll: %s", s->name, zerr());
        if (rc <= 0)
            return nl_error_set(err, NL_ERR_TIMEOUT, "socket %s: no message within %d ms", s->name,
                                timeout_ms);
        if (read_parts(s, rx, over, total) >= 0)
            return NL_OK;
        if (zmq_errno() != EAGAIN)
            return nl_error_set(err, NL_ERR_IO, "socket %s: receive: %s", s->name, zerr());
        if (timeout_ms >= 0 && nl_mono_ms() >= deadline)
            return nl_error_set(err, NL_ERR_TIMEOUT, "socket %s: no message within %d ms", s->name,
                                timeout_ms);
    }
}

nl_status nl_sock_recv(nl_sock *s, nl_rx *rx, int timeout_ms, nl_error *err)
{
    nl_error e;
    bool over = false; /* set on NL_OK; gcc -O3 cannot see it */
    uint64_t total = 0;
    rx_release(rx);
    nl_status st = wait_parts(s, rx, timeout_ms, &over, &total, err);
    if (st != NL_OK)
        return st;
    int n = rx->nparts;
    int hdr = s->type == ZMQ_ROUTER ? 1 : 0;
    if (s->guard) /* a whole message came from this connection (the routing id
                   * part carries no metadata: the header's does) */
        nl_connguard_seen(s->guard, zmq_msg_get(&rx->parts[hdr < n ? hdr : 0], ZMQ_SRCFD));
    find_peer(s, rx, hdr);
    if (s->type == ZMQ_ROUTER && n >= 1) {
        rx->rid_len = zmq_msg_size(&rx->parts[0]);
        if (rx->rid_len > NL_ROUTING_ID_MAX)
            rx->rid_len = 0;
        memcpy(rx->rid, zmq_msg_data(&rx->parts[0]), rx->rid_len);
    }
    if (s->server && !nl_auth_allowed(s->net->auth, s->domain, rx->peer)) {
        nl_auth_note_drop(s->net->auth);
        return nl_error_set(err, NL_ERR_AUTH,
                            "socket %s: dropped a message from %.48s: not admitted (removed, "
                            "banned or unknown)",
                            s->name, rx->peer[0] ? rx->peer : "an unidentified peer");
    }
    if (over) {
        nl_error_set(&e, NL_ERR_LIMIT, "message of more than %d parts", NL_RX_MAX_PARTS);
        return bad_message(s, rx, hdr, NL_ERR_LIMIT, &e, err);
    }
    if (total > s->max_msg) {
        nl_error_set(&e, NL_ERR_LIMIT, "message of %llu bytes, limit %llu on this socket",
                     (unsigned long long)total, (unsigned long long)s->max_msg);
        return bad_message(s, rx, hdr, NL_ERR_LIMIT, &e, err);
    }
    nl_wire_part wp[NL_RX_MAX_PARTS];
    for (int i = hdr; i < n; i++) {
        wp[i - hdr].data = zmq_msg_data(&rx->parts[i]);
        wp[i - hdr].len = zmq_msg_size(&rx->parts[i]);
    }
    st = nl_wire_decode(&rx->msg, wp, n - hdr, &s->net->lim, &e);
    if (st != NL_OK)
        return bad_message(s, rx, hdr, st, &e, err);
    return NL_OK;
}

/* ===================== hello ===================== */

nl_status nl_sock_hello(nl_sock *s, nl_role role, int timeout_ms, nl_rx *rx, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_HELLO;
    m.u.hello.role = role;
    m.u.hello.software = SOFTWARE;
    nl_status st = nl_sock_send(s, NULL, 0, &m, err);
    if (st != NL_OK)
        return st;
    int64_t deadline = nl_mono_ms() + timeout_ms;
    for (;;) {
        int64_t left = deadline - nl_mono_ms();
        if (left <= 0)
            return nl_error_set(err, NL_ERR_TIMEOUT, "socket %s: no answer to HELLO in %d ms",
                                s->name, timeout_ms);
        st = nl_sock_recv(s, rx, (int)left, err);
        if (st == NL_ERR_TIMEOUT)
            continue;
        if (st != NL_OK)
            return st;
        if (rx->msg.type == NL_MSG_HELLO_ACK)
            return NL_OK;
        if (rx->msg.type == NL_MSG_ERROR) {
            uint32_t c = rx->msg.u.error.code;
            char text[400];
            return nl_error_set(err, c > 0 && c < NL_STATUS_COUNT ? (nl_status)c : NL_ERR_PROTO,
                                "socket %s: peer refused HELLO: %s", s->name,
                                nl_log_escape(text, sizeof text, rx->msg.u.error.message));
        }
        NL_DEBUG("socket %s: ignoring %s while waiting for HELLO_ACK", s->name,
                 nl_wire_type_name(rx->msg.type));
    }
}

nl_status nl_sock_answer_hello(nl_sock *s, const nl_rx *rx, nl_role role, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_HELLO_ACK;
    m.u.hello.role = role;
    m.u.hello.software = SOFTWARE;
    return nl_sock_reply(s, rx, &m, err);
}

/* ===================== polling, zero-copy references ===================== */

nl_status nl_sock_poll(nl_sock *const *socks, bool *readable, int n, int timeout_ms, nl_error *err)
{
    zmq_pollitem_t items[64];
    if (n < 1 || n > 64)
        return nl_error_set(err, NL_ERR_INVALID, "poll: %d sockets (1 to 64)", n);
    for (int i = 0; i < n; i++)
        items[i] = (zmq_pollitem_t){socks[i]->zs, 0, ZMQ_POLLIN, 0};
    int rc = zmq_poll(items, n, timeout_ms);
    for (int i = 0; i < n; i++)
        readable[i] = rc > 0 && (items[i].revents & ZMQ_POLLIN);
    if (rc < 0 && zmq_errno() != EINTR)
        return nl_error_set(err, NL_ERR_IO, "poll: %s", zerr());
    if (rc <= 0)
        return nl_error_set(err, NL_ERR_TIMEOUT, "poll: nothing within %d ms", timeout_ms);
    return NL_OK;
}
