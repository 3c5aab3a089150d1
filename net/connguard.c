/* The connection guard (connguard.h): a thread beside one server socket
 * that cuts a TCP connection whose unfinished message outgrows the limit. */
#include "net/connguard.h"

#include <errno.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <zmq.h>

#include "base/log.h"

#define MAX_FD (1 << 20) /* descriptors past this are not guarded (RLIMIT_NOFILE is lower) */

typedef struct conn {
    int active;
    uint64_t base; /* bytes received when its last whole message was seen */
    struct sockaddr_storage peer;
    socklen_t peer_len;
} conn;

struct nl_connguard {
    void *mon; /* PAIR: the socket's monitor events (the thread's) */
    char name[64];
    uint64_t limit;
    pthread_t thread;
    int thread_started;
    atomic_int stop;
    pthread_mutex_t mu;
    conn *conns;  /* by descriptor, cap of them */
    int cap, top; /* top: one past the highest descriptor active */
    uint64_t cuts;
};

/* Bytes the kernel received on TCP socket fd, or UINT64_MAX. */
static uint64_t received(int fd)
{
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 ||
        len < offsetof(struct tcp_info, tcpi_bytes_received) + sizeof ti.tcpi_bytes_received)
        return UINT64_MAX;
    return ti.tcpi_bytes_received;
}

/* Under mu: the slot of fd, growing the table; NULL past MAX_FD or OOM. */
static conn *slot(nl_connguard *g, int fd)
{
    if (fd < 0 || fd >= MAX_FD)
        return NULL;
    if (fd >= g->cap) {
        int cap = g->cap ? g->cap : 64;
        while (cap <= fd)
            cap *= 2;
        conn *p = realloc(g->conns, (size_t)cap * sizeof *p);
        if (!p)
            return NULL;
        memset(p + g->cap, 0, (size_t)(cap - g->cap) * sizeof *p);
        g->conns = p;
        g->cap = cap;
    }
    return &g->conns[fd];
}

static void on_accepted(nl_connguard *g, int fd)
{
    const uint64_t now = received(fd);
    pthread_mutex_lock(&g->mu);
    conn *c = now == UINT64_MAX ? NULL : slot(g, fd); /* not TCP: not guarded */
    if (c) {
        memset(c, 0, sizeof *c);
        c->peer_len = sizeof c->peer;
        if (getpeername(fd, (struct sockaddr *)&c->peer, &c->peer_len) == 0) {
            c->active = 1;
            c->base = now;
            if (fd >= g->top)
                g->top = fd + 1;
        }
    }
    pthread_mutex_unlock(&g->mu);
}

static void on_closed(nl_connguard *g, int fd)
{
    pthread_mutex_lock(&g->mu);
    if (fd >= 0 && fd < g->cap)
        g->conns[fd].active = 0;
    pthread_mutex_unlock(&g->mu);
}

/* The monitor's events: a 6-byte frame (event, value) then the endpoint. */
static void take_events(nl_connguard *g)
{
    for (;;) {
        uint8_t ev[16];
        char ep[256];
        const int n = zmq_recv(g->mon, ev, sizeof ev, ZMQ_DONTWAIT);
        if (n < 0)
            return;
        if (zmq_recv(g->mon, ep, sizeof ep, 0) < 0 || n < 6)
            continue;
        uint16_t what;
        int32_t value;
        memcpy(&what, ev, 2);
        memcpy(&value, ev + 2, 4);
        if (what == ZMQ_EVENT_ACCEPTED)
            on_accepted(g, value);
        else if (what == ZMQ_EVENT_DISCONNECTED || what == ZMQ_EVENT_CLOSED)
            on_closed(g, value);
    }
}

/* Under mu: is fd still the connection accepted as c (not a descriptor
 * reused since by another)? */
static int same_peer(const conn *c, int fd)
{
    struct sockaddr_storage p;
    socklen_t len = sizeof p;
    return getpeername(fd, (struct sockaddr *)&p, &len) == 0 && len == c->peer_len &&
           memcmp(&p, &c->peer, len) == 0;
}

static void check_conns(nl_connguard *g)
{
    pthread_mutex_lock(&g->mu);
    for (int fd = 0; fd < g->top; fd++) {
        conn *c = &g->conns[fd];
        if (!c->active)
            continue;
        const uint64_t now = received(fd);
        if (now == UINT64_MAX || now < c->base || now - c->base <= g->limit)
            continue;
        c->active = 0;
        if (!same_peer(c, fd))
            continue;
        shutdown(fd, SHUT_RDWR); /* libzmq sees the error and drops the connection */
        g->cuts++;
        NL_WARN("socket %s: a peer sent %llu bytes without finishing a message (limit %llu): "
                "its connection is cut",
                g->name, (unsigned long long)(now - c->base), (unsigned long long)g->limit);
    }
    pthread_mutex_unlock(&g->mu);
}

static void *guard_main(void *arg)
{
    nl_connguard *g = arg;
    while (!atomic_load(&g->stop)) {
        zmq_pollitem_t it = {g->mon, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, NL_CONNGUARD_TICK_MS) > 0)
            take_events(g);
        check_conns(g);
    }
    return NULL;
}

nl_status nl_connguard_new(nl_connguard **out, void *zctx, void *zsock, const char *name,
                           uint64_t limit, nl_error *err)
{
    *out = NULL;
    nl_connguard *g = calloc(1, sizeof *g);
    if (!g)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    char ep[96];
    snprintf(ep, sizeof ep, "inproc://nl-connguard-%p", (void *)g);
    snprintf(g->name, sizeof g->name, "%s", name);
    g->limit = limit;
    pthread_mutex_init(&g->mu, NULL);
    const int zero = 0;
    if (zmq_socket_monitor(zsock, ep,
                           ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CLOSED) != 0 ||
        !(g->mon = zmq_socket(zctx, ZMQ_PAIR)) ||
        zmq_setsockopt(g->mon, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_connect(g->mon, ep) != 0) {
        nl_status st = nl_error_set(err, NL_ERR_IO, "socket %s: connection guard: %s", name,
                                    zmq_strerror(zmq_errno()));
        nl_connguard_destroy(&g, zsock);
        return st;
    }
    if (pthread_create(&g->thread, NULL, guard_main, g) != 0) {
        nl_connguard_destroy(&g, zsock);
        return nl_error_set(err, NL_ERR_INTERNAL, "socket %s: connection guard: no thread", name);
    }
    g->thread_started = 1;
    *out = g;
    return NL_OK;
}

void nl_connguard_destroy(nl_connguard **gp, void *zsock)
{
    if (!gp || !*gp)
        return;
    nl_connguard *g = *gp;
    atomic_store(&g->stop, 1);
    if (g->thread_started)
        pthread_join(g->thread, NULL);
    if (zsock)
        zmq_socket_monitor(zsock, NULL, 0); /* the monitor stops */
    if (g->mon)
        zmq_close(g->mon);
    pthread_mutex_destroy(&g->mu);
    free(g->conns);
    free(g);
    *gp = NULL;
}

void nl_connguard_seen(nl_connguard *g, int fd)
{
    if (!g)
        return;
    const uint64_t now = received(fd);
    pthread_mutex_lock(&g->mu);
    if (now != UINT64_MAX && fd >= 0 && fd < g->cap && g->conns[fd].active)
        g->conns[fd].base = now;
    pthread_mutex_unlock(&g->mu);
}

uint64_t nl_connguard_cuts(nl_connguard *g)
{
    pthread_mutex_lock(&g->mu);
    const uint64_t n = g->cuts;
    pthread_mutex_unlock(&g->mu);
    return n;
}
