/* Nodes behind NAT, detected (--probe-inbound): when a node joins without
 * saying it accepts no inbound connections, the coordinator opens a TCP
 * connection to its data endpoint. A node whose endpoint does not answer
 * within PROBE_MS, or refuses, is planned as if it had said --no-inbound
 * (JOIN.flags): it dials its previous stage (ASSIGN.links). The connection
 * is non-blocking and finished by the loop's tick, which plans no stage
 * while a probe is out, so a plan never uses a node half known. The probe
 * only opens and closes a TCP connection: it sends nothing, and the
 * node's CURVE socket sees a peer that went away before its handshake.
 * It tells what the coordinator can reach; the other nodes are assumed to
 * see the same (docs/cluster.md, "Nodes behind NAT"). */
#include "coordinator/coord_impl.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/log.h"

#define PROBE_MS 2000 /* a data endpoint that has not answered by then takes no inbound */

/* The probe failed or ran out: the node is planned as one without inbound. */
static void probe_done(nl_coord *c, cnode *n, const char *why)
{
    if (n->probe_fd > 0)
        close(n->probe_fd);
    n->probe_fd = 0;
    c->probes--;
    if (!why) {
        NL_INFO("node %u: its data endpoint %s accepts connections", n->id, n->endpoint);
        return;
    }
    n->no_inbound = true;
    NL_WARN("node %u: its data endpoint %s %s: it is planned as a node that accepts no inbound "
            "connections (it dials its previous stage)",
            n->id, n->endpoint, why);
}

/* Split tcp://HOST:PORT (HOST may be [v6]) into host and port. */
static bool split_endpoint(const char *ep, char *host, size_t hcap, char *port, size_t pcap)
{
    if (strncmp(ep, "tcp://", 6) != 0)
        return false;
    ep += 6;
    const char *colon = strrchr(ep, ':');
    if (!colon || colon == ep || !colon[1] || strchr(colon + 1, '*'))
        return false;
    size_t hl = (size_t)(colon - ep);
    if (ep[0] == '[' && hl >= 2 && ep[hl - 1] == ']') {
        ep++;
        hl -= 2;
    }
    if (hl + 1 > hcap || strlen(colon + 1) + 1 > pcap)
        return false;
    memcpy(host, ep, hl);
    host[hl] = '\0';
    snprintf(port, pcap, "%s", colon + 1);
    return true;
}

void coord_probe_start(nl_coord *c, cnode *n)
{
    char host[257], port[16];
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV},
                    *ai = NULL;
    if (!c->o.probe_inbound || n->no_inbound)
        return;
    if (!split_endpoint(n->endpoint, host, sizeof host, port, sizeof port) ||
        getaddrinfo(host, port, &hints, &ai) != 0) { /* ipc://, or a name: not probed */
        NL_INFO("node %u: data endpoint %s is not a numeric tcp address: not probed", n->id,
                n->endpoint);
        return;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    c->probes++;
    n->probe_until = nl_mono_s() + PROBE_MS / 1e3;
    n->probe_fd = fd;
    if (fd <= 0) { /* 0 is not ours to close: never probed with */
        NL_WARN("node %u: cannot probe its data endpoint: %s", n->id, strerror(errno));
        n->probe_fd = 0;
        c->probes--;
    } else if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
        probe_done(c, n, NULL);
    } else if (errno != EINPROGRESS) {
        char why[160];
        snprintf(why, sizeof why, "cannot be connected to (%s)", strerror(errno));
        probe_done(c, n, why);
    }
    freeaddrinfo(ai);
}

void coord_probe_stop(nl_coord *c, cnode *n)
{
    if (n->probe_fd <= 0)
        return;
    close(n->probe_fd);
    n->probe_fd = 0;
    c->probes--;
}

int coord_probe_tick(nl_coord *c)
{
    const double now = nl_mono_s();
    for (int i = 0; i < c->n_nodes && c->probes > 0; i++) {
        cnode *n = &c->nodes[i];
        if (n->life != NODE_LIVE || n->probe_fd <= 0)
            continue;
        struct pollfd p = {n->probe_fd, POLLOUT, 0};
        if (poll(&p, 1, 0) == 1) {
            int e = 0;
            socklen_t len = sizeof e;
            char why[160];
            if (getsockopt(n->probe_fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0)
                e = errno;
            snprintf(why, sizeof why, "cannot be connected to (%s)", strerror(e));
            probe_done(c, n, e ? why : NULL);
        } else if (now >= n->probe_until) {
            probe_done(c, n, "did not answer a connection within 2 s");
        }
    }
    return c->probes;
}
