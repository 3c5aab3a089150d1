/* Integration tests for keys, authentication and the transport, over real
 * sockets on 127.0.0.1 with ephemeral ports. Every wait is bounded.
 *
 *  - key files: neuroctl keygen, modes, loading, nl_keys_ensure, the
 *    authorized_keys parser;
 *  - the authentication matrix: a peer without CURVE, a peer with an
 *    unknown key, a peer whose key was removed (SIGHUP reload), garbage
 *    on the TCP port: each refused, no application message delivered;
 *  - the versioned hello, both directions;
 *  - bad input: typed ERROR replies, strikes, a ban that refuses the key
 *    and then expires; oversized and over-long messages; flat memory;
 *  - a node's per-socket allow-list and zero-copy tensor frames. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "cli/commands.h"
#include "core/formats/fileio.h"
#include "net/transport.h"
#include "tests/check.h"

/* ASan quarantines freed memory, so RSS says nothing about leaks there
 * (LeakSanitizer checks for them at exit instead). The runtime is found by
 * its symbol, since a library may be instrumented when this file is not. */
extern void __asan_init(void) __attribute__((weak));

#define WAIT_OK 3000 /* ms to wait for a message that must arrive */
#define WAIT_NO 400  /* ms to wait for a message that must not arrive */

static char tmpdir[256];

static void sleep_ms(int ms)
{
    nanosleep(&(struct timespec){ms / 1000, (long)(ms % 1000) * 1000000L}, NULL);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* ---- fixtures ---- */

static nl_net *mk_net(int strike_limit, int ban_ms, uint64_t max_frame_bytes)
{
    nl_net_opts o = nl_net_opts_default();
    nl_error err;
    nl_net *n = NULL;
    if (strike_limit)
        o.policy.strike_limit = strike_limit;
    if (ban_ms)
        o.policy.ban_ms = ban_ms;
    if (max_frame_bytes)
        o.limits.max_frame_bytes = max_frame_bytes;
    CHECK_OK(nl_net_new(&n, &o, &err), &err);
    return n;
}

static nl_sock *mk_server(nl_net *net, int type, const nl_keypair *kp, const char *domain)
{
    nl_sock_opts o = {.type = type,
                      .keys = kp,
                      .curve_server = true,
                      .zap_domain = domain,
                      .name = "server",
                      .linger_ms = 0};
    nl_sock *s = NULL;
    nl_error err;
    CHECK_OK(nl_sock_new(&s, net, &o, &err), &err);
    if (s)
        CHECK_OK(nl_sock_bind(s, "tcp://127.0.0.1:*", &err), &err);
    return s;
}

static nl_sock *mk_client(nl_net *net, int type, const nl_keypair *kp, const char *server_key,
                          const char *endpoint)
{
    nl_sock_opts o = {
        .type = type, .keys = kp, .server_key = server_key, .name = "client", .linger_ms = 0};
    nl_sock *s = NULL;
    nl_error err;
    CHECK_OK(nl_sock_new(&s, net, &o, &err), &err);
    if (s)
        CHECK_OK(nl_sock_connect(s, endpoint, &err), &err);
    return s;
}

static nl_status send_heartbeat(nl_sock *s, uint64_t seq)
{
    nl_wire_msg m;
    nl_error err;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_HEARTBEAT;
    m.u.heartbeat = (nl_msg_heartbeat){.node_id = 1, .seq = seq, .state = NL_NODE_READY};
    return nl_sock_send(s, NULL, 0, &m, &err);
}

/* Receive the next good message (skipping nothing): returns its status. */
static nl_status recv_one(nl_sock *s, nl_rx *rx, int ms)
{
    nl_error err;
    return nl_sock_recv(s, rx, ms, &err);
}

/* A socket monitor, to see refused handshakes on the server side. */
static void *mk_monitor(nl_net *net, nl_sock *s, const char *name)
{
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://mon-%s", name);
    zmq_socket_monitor(nl_sock_handle(s), ep,
                       ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                           ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                           ZMQ_EVENT_DISCONNECTED);
    void *mon = zmq_socket(nl_net_zmq_context(net), ZMQ_PAIR);
    int zero = 0;
    zmq_setsockopt(mon, ZMQ_LINGER, &zero, sizeof zero);
    zmq_connect(mon, ep);
    return mon;
}

/* Wait for any event in mask; returns the event or 0 on timeout. */
static int wait_event(void *mon, int mask, int ms)
{
    zmq_pollitem_t it = {mon, 0, ZMQ_POLLIN, 0};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &t1);
        int left = ms - (int)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000);
        if (left <= 0 || zmq_poll(&it, 1, left) <= 0)
            return 0;
        uint8_t ev[6];
        char addr[256];
        int n = zmq_recv(mon, ev, sizeof ev, 0);
        zmq_recv(mon, addr, sizeof addr, 0);
        if (n == 6) {
            int e = ev[0] | ev[1] << 8;
            if (e & mask)
                return e;
        }
    }
}

static void drain_events(void *mon)
{
    wait_event(mon, 0, 100);
}

static void stop_monitor(nl_sock *s, void *mon)
{
    zmq_socket_monitor(nl_sock_handle(s), NULL, 0);
    zmq_close(mon);
}

/* ---- key files ---- */

static void test_keys(nl_keypair *node_a)
{
    char prefix[300], path[320];
    nl_error err;
    nl_keypair kp, kp2;
    struct stat sb;
    snprintf(prefix, sizeof prefix, "%s/node-a", tmpdir);
    char *argv1[] = {"keygen", "--out", prefix};
    CHECK(nl_cmd_keygen(3, argv1) == 0, "keygen failed");
    snprintf(path, sizeof path, "%s.key", prefix);
    CHECK(stat(path, &sb) == 0 && (sb.st_mode & 0777) == 0600, "key mode %o", sb.st_mode & 0777);
    CHECK_OK(nl_keys_load_secret(&kp, path, &err), &err);
    *node_a = kp;
    snprintf(path, sizeof path, "%s.pub", prefix);
    char *text = NULL;
    size_t len = 0;
    CHECK_OK(nl_file_read_all(path, 1024, &text, &len, &err), &err);
    CHECK(text && len == 41 && text[40] == '\n' && strncmp(text, kp.public_z85, 40) == 0,
          "pub file '%s'", text ? text : "");
    free(text);
    char pub[NL_KEY_Z85_LEN + 1];
    CHECK_OK(nl_keys_load_public(pub, path, &err), &err);
    CHECK(strcmp(pub, kp.public_z85) == 0, "public key mismatch");
    /* no overwrite without --force; usage errors */
    CHECK(nl_cmd_keygen(3, argv1) == 1, "keygen overwrote a key");
    char *argv2[] = {"keygen", "--out", prefix, "--force"};
    CHECK(nl_cmd_keygen(4, argv2) == 0, "keygen --force failed");
    snprintf(path, sizeof path, "%s.key", prefix);
    CHECK_OK(nl_keys_load_secret(&kp2, path, &err), &err);
    CHECK(strcmp(kp2.public_z85, kp.public_z85) != 0, "--force kept the old key");
    *node_a = kp2;
    char *argv3[] = {"keygen"};
    CHECK(nl_cmd_keygen(1, argv3) == 2, "keygen without --out");
    /* a secret others can read is refused */
    chmod(path, 0644);
    CHECK(nl_keys_load_secret(&kp, path, &err) == NL_ERR_AUTH && strstr(err.msg, "chmod 600"),
          "0644 key: %s", err.msg);
    chmod(path, 0600);
    snprintf(path, sizeof path, "%s/bad.key", tmpdir);
    write_file(path, "# two keys\n"
                     "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7\n"
                     "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7\n");
    chmod(path, 0600);
    CHECK(nl_keys_load_secret(&kp, path, &err) == NL_ERR_FORMAT, "two keys: %s", err.msg);
    CHECK(nl_keys_load_public(pub, "/nonexistent/x.pub", &err) == NL_ERR_NOTFOUND, "missing");

    /* the coordinator's identity: created once, then loaded */
    char state[300];
    bool created = false;
    snprintf(state, sizeof state, "%s/state", tmpdir);
    CHECK_OK(nl_keys_ensure(state, &kp, &created, &err), &err);
    CHECK(created, "first start did not create the key");
    snprintf(path, sizeof path, "%s/coordinator.key", state);
    CHECK(stat(path, &sb) == 0 && (sb.st_mode & 0777) == 0600, "coordinator.key mode");
    CHECK_OK(nl_keys_ensure(state, &kp2, &created, &err), &err);
    CHECK(!created && strcmp(kp.public_z85, kp2.public_z85) == 0, "second start changed key");
    snprintf(path, sizeof path, "%s/coordinator.pub", state);
    CHECK_OK(nl_keys_load_public(pub, path, &err), &err);
    CHECK(strcmp(pub, kp.public_z85) == 0, "coordinator.pub mismatch");
    write_file(path, "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7\n");
    CHECK(nl_keys_ensure(state, &kp2, &created, &err) == NL_ERR_AUTH, "mismatched pub: %s",
          err.msg);
    unlink(path);
    CHECK_OK(nl_keys_ensure(state, &kp2, &created, &err), &err); /* rewrites the .pub */
    CHECK_OK(nl_keys_load_public(pub, path, &err), &err);
    CHECK(strcmp(pub, kp.public_z85) == 0, "rewritten coordinator.pub");

    /* authorized_keys syntax */
    nl_keylist kl = {0};
    const char *good =
        "# cluster nodes\r\n\n  rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7  # laptop\r\n"
        "\t# indented comment\n"
        "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID\n"
        "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7\n";
    CHECK_OK(nl_keylist_parse(&kl, good, strlen(good), "authorized_keys", &err), &err);
    CHECK(kl.n == 2, "%zu keys (duplicates merged)", kl.n);
    const char *bad[] = {"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf\n",        /* 39 */
                         "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7 junk\n",  /* trailing */
                         "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf\"\n",      /* alphabet */
                         "#ok\n%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%\n"}; /* > 2^32 */
    for (int i = 0; i < 4; i++) {
        nl_status st = nl_keylist_parse(&kl, bad[i], strlen(bad[i]), "authorized_keys", &err);
        CHECK(st == NL_ERR_FORMAT && strstr(err.msg, "authorized_keys:"), "bad %d: %s", i, err.msg);
        CHECK(kl.n == 0, "bad %d left %zu keys", i, kl.n);
    }
    CHECK(strstr(err.msg, ":2"), "line number missing: %s", err.msg);
    nl_keylist_free(&kl);
}

/* ---- the coordinator fixture: ROUTER on domain "coord" ---- */

typedef struct coord {
    nl_net *net;
    nl_sock *sock;
    nl_keypair kp;
    char authkeys[400];
} coord;

static void coord_start(coord *c, const char *const *keys, int nkeys, int strike_limit, int ban_ms)
{
    nl_error err;
    char state[300], text[4096] = "# authorized node keys\n";
    memset(c, 0, sizeof *c);
    snprintf(state, sizeof state, "%s/state", tmpdir);
    CHECK_OK(nl_keys_ensure(state, &c->kp, NULL, &err), &err);
    snprintf(c->authkeys, sizeof c->authkeys, "%s/authorized_keys", state);
    for (int i = 0; i < nkeys; i++)
        snprintf(text + strlen(text), sizeof text - strlen(text), "%s\n", keys[i]);
    write_file(c->authkeys, text);
    c->net = mk_net(strike_limit, ban_ms, 1 << 20);
    CHECK_OK(nl_auth_watch_file(nl_net_auth(c->net), "coord", c->authkeys, &err), &err);
    c->sock = mk_server(c->net, ZMQ_ROUTER, &c->kp, "coord");
}

static void coord_stop(coord *c)
{
    nl_sock_destroy(&c->sock);
    nl_net_destroy(&c->net);
}

/* Serve one request: answer HELLO, echo HEARTBEAT as ACCEPT. */
static nl_status coord_serve(coord *c, nl_rx *rx, int ms)
{
    nl_error err;
    nl_status st = nl_sock_recv(c->sock, rx, ms, &err);
    if (st != NL_OK)
        return st;
    if (rx->msg.type == NL_MSG_HELLO)
        return nl_sock_answer_hello(c->sock, rx, NL_ROLE_COORDINATOR, &err);
    if (rx->msg.type == NL_MSG_HEARTBEAT) {
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        m.type = NL_MSG_ACCEPT;
        m.u.accept = (nl_msg_accept){(uint32_t)rx->msg.u.heartbeat.seq, 1000, 5000};
        return nl_sock_reply(c->sock, rx, &m, &err);
    }
    return NL_OK;
}

/* A node says hello (served by the coordinator on this thread). */
static nl_status node_hello(coord *c, nl_sock *node, nl_rx *crx, nl_rx *nrx)
{
    nl_wire_msg m;
    nl_error err;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_HELLO;
    m.u.hello = (nl_msg_hello){NL_ROLE_NODE, "test"};
    nl_status st = nl_sock_send(node, NULL, 0, &m, &err);
    if (st == NL_OK)
        st = coord_serve(c, crx, WAIT_OK);
    if (st == NL_OK)
        st = recv_one(node, nrx, WAIT_OK);
    if (st == NL_OK && nrx->msg.type != NL_MSG_HELLO_ACK)
        st = NL_ERR_PROTO;
    return st;
}

typedef struct serve_arg {
    coord *c;
    nl_status st;
} serve_arg;

static void *serve_thread(void *p)
{
    serve_arg *sa = p;
    nl_rx rx;
    nl_rx_init(&rx);
    sa->st = coord_serve(sa->c, &rx, WAIT_OK);
    nl_rx_free(&rx);
    return NULL;
}

static void test_auth_matrix(const nl_keypair *node_a)
{
    nl_error err;
    nl_keypair node_b, node_c;
    nl_rx crx, nrx;
    nl_rx_init(&crx);
    nl_rx_init(&nrx);
    CHECK_OK(nl_keys_generate(&node_b, &err), &err);
    CHECK_OK(nl_keys_generate(&node_c, &err), &err);
    const char *keys[] = {node_a->public_z85, node_c.public_z85};
    coord c;
    coord_start(&c, keys, 2, 100, 1000);
    const char *ep = nl_sock_endpoint(c.sock);
    CHECK(strncmp(ep, "tcp://127.0.0.1:", 16) == 0, "endpoint %s", ep);
    void *mon = mk_monitor(c.net, c.sock, "coord");
    nl_net *cnet = mk_net(0, 0, 0);
    nl_auth_stats s0, s1;

    /* an authorised node: hello, then a heartbeat attributed to its key */
    nl_sock *a = mk_client(cnet, ZMQ_DEALER, node_a, c.kp.public_z85, ep);
    CHECK_OK(node_hello(&c, a, &crx, &nrx), &err);
    CHECK(strcmp(crx.peer, node_a->public_z85) == 0, "peer '%s'", crx.peer);
    CHECK(nrx.msg.u.hello.role == NL_ROLE_COORDINATOR, "role %u", nrx.msg.u.hello.role);
    CHECK_OK(send_heartbeat(a, 41), &err);
    CHECK(coord_serve(&c, &crx, WAIT_OK) == NL_OK && crx.msg.type == NL_MSG_HEARTBEAT &&
              crx.msg.u.heartbeat.seq == 41,
          "heartbeat not delivered");
    CHECK(recv_one(a, &nrx, WAIT_OK) == NL_OK && nrx.msg.type == NL_MSG_ACCEPT &&
              nrx.msg.u.accept.node_id == 41,
          "no ACCEPT");
    /* the client-side hello helper, with the coordinator served by a thread */
    nl_status st;
    nl_sock *a2 = mk_client(cnet, ZMQ_DEALER, node_a, c.kp.public_z85, ep);
    serve_arg sa = {&c, NL_ERR_INTERNAL};
    pthread_t th;
    pthread_create(&th, NULL, serve_thread, &sa);
    st = nl_sock_hello(a2, NL_ROLE_NODE, WAIT_OK, &nrx, &err);
    pthread_join(th, NULL);
    CHECK(st == NL_OK && sa.st == NL_OK && nrx.msg.type == NL_MSG_HELLO_ACK, "nl_sock_hello: %s %s",
          nl_status_str(st), err.msg);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_HELLO;
    drain_events(mon);

    /* 1. a peer without CURVE */
    nl_auth_get_stats(nl_net_auth(c.net), &s0);
    void *plain = zmq_socket(nl_net_zmq_context(cnet), ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(plain, ZMQ_LINGER, &zero, sizeof zero);
    zmq_connect(plain, ep);
    nl_wire_wbuf wb = {0};
    m.u.hello = (nl_msg_hello){NL_ROLE_NODE, "plain"};
    nl_wire_encode(&m, &wb, NULL, &err);
    zmq_send(plain, wb.data, wb.len, ZMQ_DONTWAIT);
    int ev = wait_event(
        mon, ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL, WAIT_OK);
    CHECK(ev != 0, "no handshake failure seen for a plaintext peer");
    st = recv_one(c.sock, &crx, WAIT_NO);
    CHECK(st == NL_ERR_TIMEOUT, "plaintext peer delivered: %s", nl_status_str(st));
    zmq_close(plain);

    /* 2. a peer with an unknown key */
    nl_sock *b = mk_client(cnet, ZMQ_DEALER, &node_b, c.kp.public_z85, ep);
    CHECK_OK(send_heartbeat(b, 2), &err);
    ev = wait_event(mon, ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, WAIT_OK);
    CHECK(ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, "unknown key: event %d", ev);
    st = recv_one(c.sock, &crx, WAIT_NO);
    CHECK(st == NL_ERR_TIMEOUT, "unknown key delivered: %s", nl_status_str(st));
    nl_auth_get_stats(nl_net_auth(c.net), &s1);
    CHECK(s1.denied > s0.denied, "ZAP denied %llu -> %llu", (unsigned long long)s0.denied,
          (unsigned long long)s1.denied);
    nl_sock_destroy(&b);
    drain_events(mon);

    /* 3. a removed key: C works, authorized_keys loses C, SIGHUP, reload */
    nl_sock *cc = mk_client(cnet, ZMQ_DEALER, &node_c, c.kp.public_z85, ep);
    CHECK_OK(node_hello(&c, cc, &crx, &nrx), &err);
    CHECK(strcmp(crx.peer, node_c.public_z85) == 0, "C peer '%s'", crx.peer);
    char text[256];
    snprintf(text, sizeof text, "# C removed\n%s\n", node_a->public_z85);
    write_file(c.authkeys, text);
    CHECK_OK(nl_auth_hup_install(&err), &err);
    CHECK(!nl_auth_hup_take(), "flag set before the signal");
    raise(SIGHUP);
    CHECK(nl_auth_hup_take(), "SIGHUP did not raise the flag");
    CHECK(!nl_auth_hup_take(), "flag not cleared");
    CHECK_OK(nl_auth_reload(nl_net_auth(c.net), &err), &err);
    /* C's open connection: its messages are dropped now */
    CHECK_OK(send_heartbeat(cc, 3), &err);
    st = recv_one(c.sock, &crx, WAIT_OK);
    CHECK(st == NL_ERR_AUTH, "removed key's message: %s", nl_status_str(st));
    /* C reconnecting: refused at the handshake */
    nl_sock_destroy(&cc);
    cc = mk_client(cnet, ZMQ_DEALER, &node_c, c.kp.public_z85, ep);
    CHECK_OK(send_heartbeat(cc, 4), &err);
    ev = wait_event(mon, ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, WAIT_OK);
    CHECK(ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, "removed key reconnect: event %d", ev);
    st = recv_one(c.sock, &crx, WAIT_NO);
    CHECK(st == NL_ERR_TIMEOUT, "removed key delivered: %s", nl_status_str(st));
    nl_sock_destroy(&cc);
    drain_events(mon);
    /* a reload of a broken file keeps the old list */
    write_file(c.authkeys, "not a key\n");
    CHECK(nl_auth_reload(nl_net_auth(c.net), &err) == NL_ERR_FORMAT, "broken reload: %s", err.msg);
    CHECK(nl_auth_allowed(nl_net_auth(c.net), "coord", node_a->public_z85), "A lost");

    /* 4. garbage on the TCP port */
    int port = atoi(strrchr(ep, ':') + 1);
    /* an HTTP request; a CURVE greeting cut short; a full ZMTP 3.0 CURVE
     * greeting followed by a HELLO command full of garbage */
    static const char http[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    uint8_t greet[64 + 2 + 255];
    memset(greet, 0, sizeof greet);
    greet[0] = 0xff;
    greet[8] = 0x01;
    greet[9] = 0x7f;
    greet[10] = 3;
    memcpy(greet + 12, "CURVE", 5);
    greet[64] = 0x04; /* a command frame */
    greet[65] = 0xff;
    greet[66] = 5;
    memcpy(greet + 67, "HELLO", 5);
    for (int k = 72; k < (int)sizeof greet; k++)
        greet[k] = (uint8_t)(k * 37);
    const void *junk[] = {http, greet, greet};
    size_t junk_len[] = {sizeof http - 1, 17, sizeof greet};
    for (int i = 0; i < 3; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        CHECK(connect(fd, (struct sockaddr *)&sin, sizeof sin) == 0, "tcp connect");
        CHECK(write(fd, junk[i], junk_len[i]) == (ssize_t)junk_len[i], "tcp write");
        uint8_t noise[4096];
        for (size_t k = 0; k < sizeof noise; k++)
            noise[k] = (uint8_t)(k * 131 + 7);
        (void)!write(fd, noise, sizeof noise);
        st = recv_one(c.sock, &crx, 150);
        CHECK(st == NL_ERR_TIMEOUT, "garbage %d delivered: %s", i, nl_status_str(st));
        close(fd);
    }
    /* and the server is still up for A */
    CHECK_OK(send_heartbeat(a, 42), &err);
    CHECK(coord_serve(&c, &crx, WAIT_OK) == NL_OK && crx.msg.u.heartbeat.seq == 42,
          "A after garbage");
    recv_one(a, &nrx, WAIT_OK);

    nl_wire_wbuf_free(&wb);
    nl_sock_destroy(&a2);
    nl_sock_destroy(&a);
    stop_monitor(c.sock, mon);
    nl_net_destroy(&cnet);
    coord_stop(&c);
    nl_rx_free(&crx);
    nl_rx_free(&nrx);
}

/* ---- versions ---- */

static void test_versions(const nl_keypair *node_a)
{
    nl_error err;
    nl_rx crx, nrx;
    nl_rx_init(&crx);
    nl_rx_init(&nrx);
    const char *keys[] = {node_a->public_z85};
    coord c;
    coord_start(&c, keys, 1, 100, 1000);
    nl_net *cnet = mk_net(0, 0, 0);
    nl_sock *a = mk_client(cnet, ZMQ_DEALER, node_a, c.kp.public_z85, nl_sock_endpoint(c.sock));

    /* a HELLO from protocol version 2: the coordinator answers ERROR */
    nl_wire_msg m;
    nl_wire_wbuf wb = {0};
    nl_wire_msg_init(&m);
    m.type = NL_MSG_HELLO;
    m.u.hello = (nl_msg_hello){NL_ROLE_NODE, "future"};
    CHECK_OK(nl_wire_encode(&m, &wb, NULL, &err), &err);
    CHECK(wb.data[3] == NL_WIRE_VERSION, "layout");
    wb.data[3] = 2;
    zmq_send(nl_sock_handle(a), wb.data, wb.len, 0);
    nl_status st = nl_sock_recv(c.sock, &crx, WAIT_OK, &err);
    CHECK(st == NL_ERR_VERSION, "v2 hello: %s %s", nl_status_str(st), err.msg);
    st = recv_one(a, &nrx, WAIT_OK);
    CHECK(st == NL_OK && nrx.msg.type == NL_MSG_ERROR && nrx.msg.u.error.code == NL_ERR_VERSION &&
              nrx.msg.u.error.req_type == NL_MSG_HELLO,
          "no typed version error: %s", nl_status_str(st));
    if (st == NL_OK && nrx.msg.type == NL_MSG_ERROR)
        CHECK(strstr(nrx.msg.u.error.message, "version 2") &&
                  strstr(nrx.msg.u.error.message, "version 1"),
              "message '%s'", nrx.msg.u.error.message);
    /* a v1 hello works on the same connection */
    CHECK_OK(node_hello(&c, a, &crx, &nrx), &err);

    /* the client side: a (fake) coordinator that speaks version 2 */
    nl_keypair fk;
    CHECK_OK(nl_keys_generate(&fk, &err), &err);
    void *fctx = zmq_ctx_new();
    void *fake = zmq_socket(fctx, ZMQ_ROUTER);
    int one = 1, zero = 0;
    zmq_setsockopt(fake, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(fake, ZMQ_CURVE_SERVER, &one, sizeof one);
    zmq_setsockopt(fake, ZMQ_CURVE_SECRETKEY, fk.secret_z85, 41);
    zmq_bind(fake, "tcp://127.0.0.1:*");
    char fep[256];
    size_t flen = sizeof fep;
    zmq_getsockopt(fake, ZMQ_LAST_ENDPOINT, fep, &flen);
    nl_sock *a3 = mk_client(cnet, ZMQ_DEALER, node_a, fk.public_z85, fep);
    /* serve the fake's side from this thread: answer the HELLO in advance */
    nl_wire_msg_reset(&m, NL_MSG_ERROR);
    m.u.error = (nl_msg_error){NL_ERR_VERSION, NL_MSG_HELLO,
                               "peer speaks protocol version 1; this build speaks version 2"};
    CHECK_OK(nl_wire_encode(&m, &wb, NULL, &err), &err);
    wb.data[3] = 2;
    nl_wire_msg_reset(&m, NL_MSG_HELLO);
    m.u.hello = (nl_msg_hello){NL_ROLE_NODE, "x"};
    CHECK_OK(nl_sock_send(a3, NULL, 0, &m, &err), &err);
    zmq_pollitem_t it = {fake, 0, ZMQ_POLLIN, 0};
    CHECK(zmq_poll(&it, 1, WAIT_OK) == 1, "fake got nothing");
    uint8_t rid[256], junk[512];
    int rlen = zmq_recv(fake, rid, sizeof rid, 0);
    zmq_recv(fake, junk, sizeof junk, 0);
    zmq_send(fake, rid, (size_t)rlen, ZMQ_SNDMORE);
    zmq_send(fake, wb.data, wb.len, 0);
    /* nl_sock_hello sends a second HELLO and reads the queued ERROR */
    st = nl_sock_hello(a3, NL_ROLE_NODE, WAIT_OK, &nrx, &err);
    CHECK(st == NL_ERR_VERSION && strstr(err.msg, "version 2"), "client hello: %s %s",
          nl_status_str(st), err.msg);
    nl_sock_destroy(&a3);
    zmq_close(fake);
    zmq_ctx_term(fctx);

    nl_wire_wbuf_free(&wb);
    nl_sock_destroy(&a);
    nl_net_destroy(&cnet);
    coord_stop(&c);
    nl_rx_free(&crx);
    nl_rx_free(&nrx);
}

/* ---- bad input: errors, strikes, bans, limits, memory ---- */

static long rss_kib(void)
{
    long pages = 0, rss = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &rss) != 2)
            rss = 0;
        fclose(f);
    }
    return rss * (sysconf(_SC_PAGESIZE) / 1024);
}

static void test_bad_input(const nl_keypair *node_a)
{
    nl_error err;
    nl_rx crx, nrx;
    nl_rx_init(&crx);
    nl_rx_init(&nrx);
    const char *keys[] = {node_a->public_z85};
    coord c;
    coord_start(&c, keys, 1, 3, 1200);
    const char *ep = nl_sock_endpoint(c.sock);
    void *mon = mk_monitor(c.net, c.sock, "bad");
    nl_net *cnet = mk_net(0, 0, 0);
    nl_sock *a = mk_client(cnet, ZMQ_DEALER, node_a, c.kp.public_z85, ep);
    CHECK_OK(node_hello(&c, a, &crx, &nrx), &err);
    void *za = nl_sock_handle(a);

    /* malformed, unknown type, over-long: typed ERROR replies */
    const uint8_t garbage[] = {0x93, 0x01, 0x02};
    const uint8_t unknown[] = {0x82, 0xa1, 'v', 0x01, 0xa1, 't', 0x3f};
    zmq_send(za, garbage, sizeof garbage, 0);
    nl_status st = nl_sock_recv(c.sock, &crx, WAIT_OK, &err);
    CHECK(st == NL_ERR_PROTO && strstr(err.msg, node_a->public_z85), "garbage: %s", err.msg);
    st = recv_one(a, &nrx, WAIT_OK);
    CHECK(st == NL_OK && nrx.msg.type == NL_MSG_ERROR && nrx.msg.u.error.code == NL_ERR_PROTO,
          "garbage reply: %s", nl_status_str(st));
    zmq_send(za, unknown, sizeof unknown, 0);
    st = nl_sock_recv(c.sock, &crx, WAIT_OK, &err);
    CHECK(st == NL_ERR_PROTO && strstr(err.msg, "unknown message type 63"), "unknown: %s", err.msg);
    st = recv_one(a, &nrx, WAIT_OK);
    CHECK(st == NL_OK && nrx.msg.type == NL_MSG_ERROR && nrx.msg.u.error.req_type == 0 &&
              strstr(nrx.msg.u.error.message, "unknown message type"),
          "unknown reply");
    /* strike 3: banned. Later messages on the open connection are dropped */
    for (int i = 0; i < NL_RX_MAX_PARTS + 1; i++)
        zmq_send(za, garbage, sizeof garbage, i < NL_RX_MAX_PARTS ? ZMQ_SNDMORE : 0);
    st = nl_sock_recv(c.sock, &crx, WAIT_OK, &err);
    CHECK(st == NL_ERR_LIMIT, "too many parts: %s %s", nl_status_str(st), err.msg);
    CHECK(nl_auth_banned(nl_net_auth(c.net), node_a->public_z85), "not banned after 3 strikes");
    CHECK_OK(send_heartbeat(a, 7), &err);
    st = recv_one(c.sock, &crx, WAIT_OK);
    CHECK(st == NL_ERR_AUTH, "banned peer's message: %s", nl_status_str(st));
    /* a new connection with the banned key is refused at the handshake */
    nl_sock *a2 = mk_client(cnet, ZMQ_DEALER, node_a, c.kp.public_z85, ep);
    CHECK_OK(send_heartbeat(a2, 8), &err);
    int ev = wait_event(mon, ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, WAIT_OK);
    CHECK(ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, "banned reconnect: event %d", ev);
    CHECK(recv_one(c.sock, &crx, WAIT_NO) == NL_ERR_TIMEOUT, "banned reconnect delivered");
    nl_sock_destroy(&a2);
    drain_events(mon);
    /* the ban expires */
    sleep_ms(1300);
    CHECK(!nl_auth_banned(nl_net_auth(c.net), node_a->public_z85), "ban did not expire");
    nl_sock_destroy(&a);
    while (recv_one(c.sock, &crx, 50) != NL_ERR_TIMEOUT) {
    }
    a = mk_client(cnet, ZMQ_DEALER, node_a, c.kp.public_z85, ep);
    CHECK_OK(node_hello(&c, a, &crx, &nrx), &err);

    /* the strike table stays bounded and keeps a ban over plain strikes */
    nl_auth *auth = nl_net_auth(c.net);
    for (int i = 0; i < 3; i++)
        nl_auth_strike(auth, "victim", "test");
    CHECK(nl_auth_banned(auth, "victim"), "victim not banned");
    for (int i = 0; i < 5000; i++) {
        char id[32];
        snprintf(id, sizeof id, "peer-%d", i);
        nl_auth_strike(auth, id, "test");
    }
    CHECK(nl_auth_tracked_peers(auth) <= nl_auth_policy_default().max_peers, "%d peers tracked",
          nl_auth_tracked_peers(auth));
    CHECK(nl_auth_banned(auth, "victim"), "ban evicted by plain strikes");

    stop_monitor(c.sock, mon);
    nl_sock_destroy(&a);
    nl_net_destroy(&cnet);
    coord_stop(&c);

    /* oversized frames: libzmq drops the connection (MAXMSGSIZE = 1 MiB here) */
    coord_start(&c, keys, 1, 1000, 1000);
    ep = nl_sock_endpoint(c.sock);
    mon = mk_monitor(c.net, c.sock, "big");
    cnet = mk_net(0, 0, 0);
    a = mk_client(cnet, ZMQ_DEALER, node_a, c.kp.public_z85, ep);
    CHECK_OK(node_hello(&c, a, &crx, &nrx), &err);
    size_t bign = (2u << 20);
    char *bigbuf = calloc(bign, 1);
    zmq_send(nl_sock_handle(a), bigbuf, bign, 0);
    ev = wait_event(mon, ZMQ_EVENT_DISCONNECTED, WAIT_OK);
    CHECK(ev == ZMQ_EVENT_DISCONNECTED, "oversized part: event %d", ev);
    CHECK(recv_one(c.sock, &crx, WAIT_NO) == NL_ERR_TIMEOUT, "oversized part delivered");
    free(bigbuf);
    stop_monitor(c.sock, mon);

    /* memory stays flat under a stream of bad messages (limit 1000 strikes) */
    nl_sock_destroy(&a);
    a = mk_client(cnet, ZMQ_DEALER, node_a, c.kp.public_z85, ep);
    CHECK_OK(node_hello(&c, a, &crx, &nrx), &err);
    uint8_t bad[512];
    memset(bad, 0x91, sizeof bad);
    long before = 0;
    int answered = 0;
    for (int i = 0; i < 900; i++) {
        zmq_send(nl_sock_handle(a), bad, sizeof bad, 0);
        st = nl_sock_recv(c.sock, &crx, WAIT_OK, &err);
        answered += st == NL_ERR_PROTO;
        while (recv_one(a, &nrx, 0) == NL_OK) {
        }
        if (i == 100)
            before = rss_kib();
    }
    long after = rss_kib();
    CHECK(answered == 900, "%d of 900 bad messages answered", answered);
    if (!__asan_init)
        CHECK(after - before < 2048, "RSS grew %ld KiB over 800 bad messages", after - before);
    CHECK(crx.msg.arena_cap < 4096, "rx arena grew to %zu", crx.msg.arena_cap);
    nl_sock_destroy(&a);
    nl_net_destroy(&cnet);
    coord_stop(&c);
    nl_rx_free(&crx);
    nl_rx_free(&nrx);
}

/* ---- a node's data socket: neighbours only, zero-copy frames ---- */

static void test_node_data(void)
{
    nl_error err;
    nl_keypair node, prev, stranger;
    nl_rx rx;
    nl_rx_init(&rx);
    CHECK_OK(nl_keys_generate(&node, &err), &err);
    CHECK_OK(nl_keys_generate(&prev, &err), &err);
    CHECK_OK(nl_keys_generate(&stranger, &err), &err);
    nl_net *nnet = mk_net(0, 0, 0), *pnet = mk_net(0, 0, 0);
    nl_sock *data = mk_server(nnet, ZMQ_PULL, &node, NULL);
    const char *ep = nl_sock_endpoint(data);
    const char *allow[] = {prev.public_z85};
    CHECK_OK(nl_sock_allow(data, allow, 1, &err), &err);
    CHECK(strncmp(nl_sock_domain(data), "nl-sock-", 8) == 0, "domain %s", nl_sock_domain(data));

    nl_sock *p = mk_client(pnet, ZMQ_PUSH, &prev, node.public_z85, ep);
    nl_sock *s = mk_client(pnet, ZMQ_PUSH, &stranger, node.public_z85, ep);
    static float act[4 * 256];
    for (int i = 0; i < 4 * 256; i++)
        act[i] = (float)i * 0.5f;
    nl_txref ref = {0}, ref_s = {0};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_ACTIVATION;
    m.u.hop = (nl_msg_tensor_hop){5, 6, 1, 0, 0, 0.0};
    int64_t shape[2] = {4, 256};
    nl_txref_frame(&m.frames[0], &ref, act, NL_DTYPE_F32, shape, 2);
    m.nframes = 1;
    CHECK(!nl_txref_idle(&ref), "reference not taken");
    CHECK_OK(nl_sock_send(p, NULL, 0, &m, &err), &err);
    nl_txref_frame(&m.frames[0], &ref_s, act, NL_DTYPE_F32, shape, 2);
    CHECK_OK(nl_sock_send(s, NULL, 0, &m, &err), &err); /* the stranger's stays queued */
    nl_status st = nl_sock_recv(data, &rx, WAIT_OK, &err);
    CHECK(st == NL_OK && rx.msg.type == NL_MSG_ACTIVATION && rx.msg.u.hop.job_id == 5 &&
              strcmp(rx.peer, prev.public_z85) == 0,
          "neighbour's activation: %s %s", nl_status_str(st), err.msg);
    if (st == NL_OK)
        CHECK(rx.msg.frames[0].len == sizeof act &&
                  memcmp(rx.msg.frames[0].t.data, act, sizeof act) == 0,
              "activation bytes differ");
    CHECK_OK(nl_txref_wait(&ref, WAIT_OK, &err), &err);
    CHECK(recv_one(data, &rx, WAIT_NO) == NL_ERR_TIMEOUT, "stranger delivered");
    /* a frame whose encode fails is still released */
    nl_txref_frame(&m.frames[0], &ref, act, NL_DTYPE_I8, shape, 2);
    CHECK(nl_sock_send(p, NULL, 0, &m, &err) == NL_ERR_DTYPE, "I8 activation sent");
    CHECK(nl_txref_idle(&ref), "reference leaked on a failed send");
    /* new assignment without prev: its messages are dropped from now on */
    CHECK_OK(nl_sock_allow(data, NULL, 0, &err), &err);
    nl_txref_frame(&m.frames[0], &ref, act, NL_DTYPE_F32, shape, 2);
    CHECK_OK(nl_sock_send(p, NULL, 0, &m, &err), &err);
    CHECK(recv_one(data, &rx, WAIT_OK) == NL_ERR_AUTH, "dropped neighbour delivered");
    CHECK_OK(nl_txref_wait(&ref, WAIT_OK, &err), &err);

    /* plaintext mode exists only behind the flag */
    nl_sock_opts po = {.type = ZMQ_PULL,
                       .curve_server = true,
                       .plaintext = true,
                       .name = "plain-server",
                       .linger_ms = 0};
    nl_sock *ps = NULL, *pc = NULL;
    CHECK_OK(nl_sock_new(&ps, nnet, &po, &err), &err);
    CHECK_OK(nl_sock_bind(ps, "tcp://127.0.0.1:*", &err), &err);
    nl_sock_opts co = {.type = ZMQ_PUSH, .plaintext = true, .name = "plain-client", .linger_ms = 0};
    CHECK_OK(nl_sock_new(&pc, pnet, &co, &err), &err);
    CHECK_OK(nl_sock_connect(pc, nl_sock_endpoint(ps), &err), &err);
    nl_txref_frame(&m.frames[0], &ref, act, NL_DTYPE_F32, shape, 2);
    CHECK_OK(nl_sock_send(pc, NULL, 0, &m, &err), &err);
    st = nl_sock_recv(ps, &rx, WAIT_OK, &err);
    CHECK(st == NL_OK && strncmp(rx.peer, "plain:127.0.0.1", 15) == 0, "plaintext: %s '%s'",
          nl_status_str(st), rx.peer);
    nl_sock_opts missing = {.type = ZMQ_DEALER, .name = "no-keys"};
    nl_sock *bad = NULL;
    CHECK(nl_sock_new(&bad, pnet, &missing, &err) == NL_ERR_AUTH, "socket without keys");
    CHECK_OK(nl_txref_wait(&ref, WAIT_OK, &err), &err);

    nl_sock_destroy(&pc);
    nl_sock_destroy(&ps);
    nl_sock_destroy(&p);
    nl_sock_destroy(&s);
    CHECK_OK(nl_txref_wait(&ref_s, WAIT_OK, &err), &err); /* released with the socket */
    nl_sock_destroy(&data);
    nl_net_destroy(&pnet);
    nl_net_destroy(&nnet);
    nl_rx_free(&rx);
}

/* A pinned key (nl_auth_pin_key: a daemon's in-process client) is
 * admitted besides the watched file, through reloads and set_keys. */
static void test_pinned(void)
{
    nl_error err;
    nl_net *net = NULL;
    nl_keypair a, b, p;
    char path[320], text[200];
    nl_net_opts no = nl_net_opts_default();
    CHECK_OK(nl_net_new(&net, &no, &err), &err);
    CHECK_OK(nl_keys_generate(&a, &err), &err);
    CHECK_OK(nl_keys_generate(&b, &err), &err);
    CHECK_OK(nl_keys_generate(&p, &err), &err);
    nl_auth *au = nl_net_auth(net);
    snprintf(path, sizeof path, "%s/pinned_keys", tmpdir);
    int n = snprintf(text, sizeof text, "%s\n", a.public_z85);
    CHECK_OK(nl_file_write_atomic(path, text, (size_t)n, &err), &err);
    CHECK_OK(nl_auth_watch_file(au, "pin", path, &err), &err);
    CHECK(!nl_auth_allowed(au, "pin", p.public_z85), "admitted before it was pinned");
    CHECK_OK(nl_auth_pin_key(au, "pin", p.public_z85, NL_KEY_ROLE_CLIENT, &err), &err);
    CHECK(nl_auth_allowed(au, "pin", p.public_z85) && nl_auth_allowed(au, "pin", a.public_z85),
          "pinned or file key refused");
    CHECK(nl_auth_roles(au, "pin", p.public_z85) == NL_KEY_ROLE_CLIENT,
          "the pinned key has roles 0x%x, not client alone",
          nl_auth_roles(au, "pin", p.public_z85));
    n = snprintf(text, sizeof text, "%s\n", b.public_z85);
    CHECK_OK(nl_file_write_atomic(path, text, (size_t)n, &err), &err);
    CHECK_OK(nl_auth_reload(au, &err), &err);
    CHECK(nl_auth_allowed(au, "pin", p.public_z85), "a reload dropped the pinned key");
    CHECK(nl_auth_roles(au, "pin", p.public_z85) == NL_KEY_ROLE_CLIENT,
          "a reload gave the pinned key roles 0x%x", nl_auth_roles(au, "pin", p.public_z85));
    CHECK(nl_auth_allowed(au, "pin", b.public_z85) && !nl_auth_allowed(au, "pin", a.public_z85),
          "the reload did not replace the file's keys");
    CHECK_OK(nl_auth_set_keys_z85(au, "pin", NULL, 0, &err), &err);
    CHECK(nl_auth_allowed(au, "pin", p.public_z85) && !nl_auth_allowed(au, "pin", b.public_z85),
          "set_keys: the pinned key is kept, the rest replaced");
    CHECK(nl_auth_pin_key(au, "pin", "not a key", NL_KEY_ROLE_CLIENT, &err) != NL_OK,
          "a bad key pinned");
    CHECK(!nl_auth_allowed(au, "other", p.public_z85), "pinned on another domain");
    nl_net_destroy(&net);
}

int main(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/test_net_auth.XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    nl_log_set_name("test_net_auth");
    alarm(120); /* a hang is a failure, not a stuck CI job */
    nl_keypair node_a;
    test_keys(&node_a);
    test_auth_matrix(&node_a);
    test_versions(&node_a);
    test_bad_input(&node_a);
    test_node_data();
    test_pinned();
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", tmpdir);
    return check_done("test_net_auth");
}
