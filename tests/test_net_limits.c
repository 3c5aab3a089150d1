/* net/transport: per-socket message limits (issue 15, finding 8).
 *
 *  - a peer sends one message of 64 parts of 64 MiB to a control-kind
 *    socket: libzmq drops the connection at the first part, so resident
 *    memory stays bounded (with one limit for every socket, 1 GiB a part,
 *    libzmq would buffer all 4 GiB before the transport saw a byte);
 *  - the cap on a whole message: parts each within the part limit but
 *    over the total are refused (NL_ERR_LIMIT, an ERROR to the sender);
 *  - ordinary control traffic still passes. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "base/log.h"
#include "check.h"
#include "net/transport.h"

#define PART (64u << 20)
#define PARTS 64
#define BOUND_KIB (512L << 10) /* resident growth allowed: far below 4 GiB */

static long rss_kib(void)
{
    char line[256];
    long kib = -1;
    FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0)
            kib = atol(line + 6);
    if (f)
        fclose(f);
    return kib;
}

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void no_free(void *data, void *hint)
{
    (void)data;
    (void)hint;
}

static nl_sock *server(nl_net *net, uint64_t max_msg)
{
    nl_error err;
    nl_sock *s = NULL;
    nl_sock_opts o = {.type = ZMQ_ROUTER,
                      .curve_server = true,
                      .plaintext = true,
                      .name = "control",
                      .linger_ms = 0,
                      .kind = NL_SOCK_CONTROL,
                      .max_msg_bytes = max_msg};
    CHECK_OK(nl_sock_new(&s, net, &o, &err), &err);
    if (s)
        CHECK_OK(nl_sock_bind(s, "tcp://127.0.0.1:*", &err), &err);
    return s;
}

/* A raw DEALER (not our transport: it sends whatever it is told). */
static void *raw_dealer(void *zctx, const char *ep)
{
    void *d = zmq_socket(zctx, ZMQ_DEALER);
    int zero = 0, to = 2000;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(d, ZMQ_SNDTIMEO, &to, sizeof to);
    CHECK(zmq_connect(d, ep) == 0, "connect %s", ep);
    return d;
}

static void test_many_big_parts(nl_net *net, void *zctx)
{
    nl_error err;
    nl_rx rx;
    nl_rx_init(&rx);
    nl_sock *s = server(net, 0);
    if (!s)
        return;
    char *buf = malloc(PART);
    if (!buf)
        return;
    memset(buf, 0x5a, PART); /* resident now, before the baseline */
    void *d = raw_dealer(zctx, nl_sock_endpoint(s));
    nanosleep(&(struct timespec){0, 200000000}, NULL);
    const long base = rss_kib();
    int sent = 0;
    for (int i = 0; i < PARTS; i++) {
        zmq_msg_t m;
        zmq_msg_init_data(&m, buf, PART, no_free, NULL); /* no copy on this side */
        if (zmq_msg_send(&m, d, i + 1 < PARTS ? ZMQ_SNDMORE : 0) < 0) {
            zmq_msg_close(&m);
            break;
        }
        sent++;
    }
    CHECK(sent == PARTS, "%d of %d parts handed to libzmq", sent, PARTS);
    long peak = base;
    int delivered = 0;
    const int64_t end = mono_ms() + 4000;
    while (mono_ms() < end) {
        nl_status st = nl_sock_recv(s, &rx, 50, &err);
        delivered += st != NL_ERR_TIMEOUT;
        long r = rss_kib();
        peak = r > peak ? r : peak;
        if (peak - base > BOUND_KIB) /* failing: stop before the machine does */
            break;
    }
    CHECK(peak - base <= BOUND_KIB, "resident memory grew %ld MiB for a %d x %u MiB message",
          (peak - base) >> 10, PARTS, PART >> 20);
    CHECK(delivered == 0, "%d messages delivered", delivered);
    printf("64 x 64 MiB message: resident growth %ld MiB (bound %ld MiB)\n", (peak - base) >> 10,
           BOUND_KIB >> 10);
    zmq_close(d); /* linger 0: its queued parts are dropped */
    nl_sock_destroy(&s);
    nl_rx_free(&rx);
    free(buf);
}

static void test_total_cap(nl_net *net, void *zctx)
{
    nl_error err;
    nl_rx rx;
    nl_rx_init(&rx);
    nl_sock *s = server(net, 1u << 20); /* 1 MiB a message here */
    if (!s)
        return;
    void *d = raw_dealer(zctx, nl_sock_endpoint(s));
    static char part[512 << 10];
    for (int i = 0; i < 3; i++)
        CHECK(zmq_send(d, part, sizeof part, i < 2 ? ZMQ_SNDMORE : 0) == (int)sizeof part,
              "send part %d", i);
    nl_status st = nl_sock_recv(s, &rx, 4000, &err);
    CHECK(st == NL_ERR_LIMIT && strstr(err.msg, "limit 1048576"), "3 x 512 KiB: %s '%s'",
          nl_status_str(st), err.msg);
    /* the sender is told (an ERROR), and ordinary traffic passes */
    char reply[2048];
    int n = 0, more = 0;
    size_t ml = sizeof more;
    int to = 4000;
    zmq_setsockopt(d, ZMQ_RCVTIMEO, &to, sizeof to);
    n = zmq_recv(d, reply, sizeof reply, 0);
    zmq_getsockopt(d, ZMQ_RCVMORE, &more, &ml);
    CHECK(n > 0 && !more, "an ERROR answered the oversized message (%d bytes)", n);
    nl_sock *c = NULL;
    nl_sock_opts co = {.type = ZMQ_DEALER, .plaintext = true, .name = "client", .linger_ms = 0};
    CHECK_OK(nl_sock_new(&c, net, &co, &err), &err);
    if (c) {
        CHECK_OK(nl_sock_connect(c, nl_sock_endpoint(s), &err), &err);
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
        m.u.heartbeat.node_id = 3;
        m.u.heartbeat.seq = 1;
        CHECK_OK(nl_sock_send(c, NULL, 0, &m, &err), &err);
        st = nl_sock_recv(s, &rx, 4000, &err);
        CHECK(st == NL_OK && rx.msg.type == NL_MSG_HEARTBEAT && rx.msg.u.heartbeat.node_id == 3,
              "an ordinary message: %s '%s'", nl_status_str(st), err.msg);
        nl_wire_msg_free(&m);
    }
    nl_sock_destroy(&c);
    zmq_close(d);
    nl_sock_destroy(&s);
    nl_rx_free(&rx);
}

int main(void)
{
    nl_error err;
    nl_net *net = NULL;
    nl_log_set_level(NL_LOG_ERROR); /* plaintext sockets warn */
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    void *zctx = zmq_ctx_new();
    if (net && zctx) {
        test_total_cap(net, zctx);
        test_many_big_parts(net, zctx);
    }
    if (zctx)
        zmq_ctx_term(zctx);
    nl_net_destroy(&net);
    return check_done("test_net_limits");
}
