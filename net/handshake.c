/* A client socket's connection and handshake, watched through a libzmq
 * socket monitor (see handshake.h). */
#include "net/handshake.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "base/clock.h"

struct nl_handshake {
    void *zsock;     /* the monitored socket (borrowed) */
    void *pair;      /* receives the monitor's events */
    int connected;   /* a TCP/IPC connection was made at least once */
    int disconnects; /* connections closed before any handshake succeeded */
};

#define EVENTS                                                                                     \
    (ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_DISCONNECTED |                    \
     ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |                        \
     ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

nl_status nl_handshake_watch(nl_handshake **out, nl_net *net, nl_sock *s, nl_error *err)
{
    char ep[64];
    nl_handshake *h = calloc(1, sizeof *h);
    *out = NULL;
    if (!h)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    h->zsock = nl_sock_handle(s);
    snprintf(ep, sizeof ep, "inproc://nl-handshake-%p", (void *)h);
    if (zmq_socket_monitor(h->zsock, ep, EVENTS) != 0 ||
        !(h->pair = zmq_socket(nl_net_zmq_context(net), ZMQ_PAIR)) ||
        zmq_connect(h->pair, ep) != 0) {
        nl_status st =
            nl_error_set(err, NL_ERR_IO, "socket monitor: %s", zmq_strerror(zmq_errno()));
        nl_handshake_destroy(&h);
        return st;
    }
    *out = h;
    return NL_OK;
}

/* One event: its number and value, or -1 when none came in timeout_ms. */
static int next_event(nl_handshake *h, int timeout_ms, uint32_t *value)
{
    zmq_pollitem_t it = {h->pair, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, timeout_ms) <= 0)
        return -1;
    zmq_msg_t m;
    int event = -1;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, h->pair, ZMQ_DONTWAIT) >= 0 && zmq_msg_size(&m) >= 6) {
        const uint8_t *d = zmq_msg_data(&m);
        uint16_t ev;
        memcpy(&ev, d, 2);
        memcpy(value, d + 2, 4);
        event = ev;
    }
    while (zmq_msg_more(&m)) /* the endpoint frame */
        if (zmq_msg_recv(&m, h->pair, ZMQ_DONTWAIT) < 0)
            break;
    zmq_msg_close(&m);
    return event;
}

nl_status nl_handshake_wait(nl_handshake *h, const char *endpoint, int timeout_ms, nl_error *err)
{
    const int64_t deadline = nl_mono_ms() + timeout_ms;
    for (;;) {
        int64_t left = deadline - nl_mono_ms();
        uint32_t value = 0;
        int ev = next_event(h, left > 0 ? (int)left : 0, &value);
        switch (ev) {
        case -1:
            if (nl_mono_ms() >= deadline)
                return nl_error_set(err, NL_ERR_TIMEOUT, "%s: no handshake in %d ms", endpoint,
                                    timeout_ms);
            continue;
        case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
            return NL_OK;
        case ZMQ_EVENT_CONNECTED:
            h->connected = 1;
            continue;
        case ZMQ_EVENT_CONNECT_RETRIED:
            if (!h->connected)
                return nl_error_set(err, NL_ERR_IO,
                                    "%s: connection refused: nothing listens there (is the "
                                    "coordinator running, at this address and port?)",
                                    endpoint);
            continue;
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
            return nl_error_set(err, NL_ERR_AUTH,
                                "%s refused this key (ZAP status %u): add its public key (the "
                                ".pub beside --key) to the coordinator's authorized_keys with "
                                "its role; a node connects to the coordinator's --listen, a "
                                "client to its --client-listen",
                                endpoint, (unsigned)value);
        case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
        case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        case ZMQ_EVENT_DISCONNECTED:
            if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL &&
                value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
                return nl_error_set(err, NL_ERR_AUTH,
                                    "%s: one side is --plaintext and the other CURVE: give "
                                    "--plaintext to both or to neither",
                                    endpoint);
            /* the server drops a client whose CURVE hello it cannot decrypt:
             * the client encrypted to a key that is not the server's */
            if (ev == ZMQ_EVENT_DISCONNECTED && ++h->disconnects < 2)
                continue;
            return nl_error_set(err, NL_ERR_AUTH,
                                "%s closed the connection during the handshake: "
                                "--coordinator-key is not its public key (the coordinator's "
                                "coordinator.pub), or one side is --plaintext",
                                endpoint);
        default:
            continue;
        }
    }
}

void nl_handshake_destroy(nl_handshake **hp)
{
    nl_handshake *h = hp ? *hp : NULL;
    if (!h)
        return;
    if (h->zsock)
        zmq_socket_monitor(h->zsock, NULL, 0);
    if (h->pair) {
        int zero = 0;
        zmq_setsockopt(h->pair, ZMQ_LINGER, &zero, sizeof zero);
        zmq_close(h->pair);
    }
    free(h);
    *hp = NULL;
}
