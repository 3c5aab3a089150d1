/* The transport: ZeroMQ sockets that are CURVE-secured by default, with
 * ZMQ_MAXMSGSIZE matching the codec's limits, sending and receiving whole
 * wire messages (tensor frames without copies), the versioned hello, and
 * the bad-input policy.
 *
 * One nl_net per process: the zmq context, its ZAP handler (net/auth.h)
 * and the limits. Sockets are nl_sock; like zmq sockets each is used by
 * one thread at a time.
 *
 * Security: every socket is CURVE unless opts.plaintext is set, and every
 * plaintext socket is logged as a warning when created. A CURVE server
 * socket admits only the keys of its ZAP domain: a private domain per
 * socket unless opts.zap_domain names a shared one (e.g. the coordinator's
 * authorized_keys). Its allow-list starts empty: nothing is admitted until
 * nl_sock_allow or nl_auth_watch_file fills it.
 *
 * Receiving: nl_sock_recv returns one decoded message or an error. A bad
 * message (malformed, truncated, oversized, wrong type or version,
 * unknown) is counted against the peer's key, answered with an ERROR
 * where the socket can reply (ROUTER, DEALER, PAIR) and the bad message
 * was not itself an ERROR, and reported to the caller, which just calls
 * again. Messages from peers that are banned or no longer allowed (a key
 * removed on reload) are dropped unanswered (NL_ERR_AUTH). */
#ifndef NL_TRANSPORT_H
#define NL_TRANSPORT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <zmq.h>

#include "base/status.h"
#include "net/auth.h"
#include "net/keys.h"
#include "net/txref.h"
#include "net/wire.h"

#define NL_RX_MAX_PARTS (NL_WIRE_MAX_FRAMES + 2) /* routing id + header + frames */
#define NL_ROUTING_ID_MAX 256

typedef struct nl_net nl_net;
typedef struct nl_sock nl_sock;

typedef struct nl_net_opts {
    nl_wire_limits limits;
    nl_auth_policy policy;
    int io_threads; /* default 1 */
} nl_net_opts;

nl_net_opts nl_net_opts_default(void);
nl_status nl_net_new(nl_net **out, const nl_net_opts *opts, nl_error *err);
/* Close the context; every nl_sock must be destroyed first. NULL-safe. */
void nl_net_destroy(nl_net **np);
/* The message parts received into an nl_rx (nl_sock_recv) and not yet
 * closed (the next receive into it, or nl_rx_free), in this process. A
 * daemon calls nl_net_parts_check(its name) last: a count other than 0 is
 * a leak of ours, logged as an error and returned false. (LeakSanitizer
 * cannot tell that leak from one inside libzmq, whose allocations it
 * would report the same; tests/lsan.supp.) */
long nl_net_parts_open(void);
bool nl_net_parts_check(const char *who);
nl_auth *nl_net_auth(nl_net *n);
void *nl_net_zmq_context(nl_net *n);
const nl_wire_limits *nl_net_limits(const nl_net *n);

/* What a socket's traffic needs, and so what it accepts (issue 15). The
 * part limit is ZMQ_MAXMSGSIZE: libzmq drops the connection of a peer
 * that announces a bigger part before buffering it, so it bounds memory.
 * The message limit (all parts together) is checked by the transport once
 * libzmq hands the message over (it buffers a whole multipart message
 * first, whatever its part count): such a message is refused and counted
 * against the peer, but the memory was spent meanwhile. A small part
 * limit is therefore the real bound: give every socket the smallest kind
 * its traffic allows.
 *  - NL_SOCK_BULK (the default): tensors (activations, gradients, results,
 *    weights): a part up to the codec's frame limit (1 GiB), a message up
 *    to twice that.
 *  - NL_SOCK_CONTROL: control traffic with at most small tensors (tokens,
 *    4 MiB weight chunks of LAYER_LOAD): a part up to NL_SOCK_CONTROL_PART
 *    (16 MiB), a message up to NL_SOCK_CONTROL_MSG (64 MiB). For what
 *    clients send a coordinator, and what a coordinator sends a node. */
typedef enum nl_sock_kind { NL_SOCK_BULK = 0, NL_SOCK_CONTROL = 1 } nl_sock_kind;
#define NL_SOCK_CONTROL_PART (16ull << 20)
#define NL_SOCK_CONTROL_MSG (64ull << 20)

typedef struct nl_sock_opts {
    int type;                /* ZMQ_ROUTER, ZMQ_DEALER, ZMQ_PUSH, ZMQ_PULL, ZMQ_PAIR */
    const nl_keypair *keys;  /* ours; required unless plaintext */
    bool curve_server;       /* accept peers (ZAP-checked); else a CURVE client */
    const char *server_key;  /* client: the server's Z85 public key */
    const char *zap_domain;  /* server: shared allow-list domain; NULL = private */
    bool plaintext;          /* INSECURE: no CURVE at all; logged */
    const char *name;        /* for log lines and errors, e.g. "coord" */
    int hwm;                 /* send and receive high-water marks; 0 = 64 */
    int linger_ms;           /* on close; -1 = default 500 */
    int send_timeout_ms;     /* 0 = 10000, -1 = forever */
    nl_sock_kind kind;       /* the limits below, by traffic (default NL_SOCK_BULK) */
    uint64_t max_part_bytes; /* ZMQ_MAXMSGSIZE; 0 = the kind's */
    uint64_t max_msg_bytes;  /* all parts of one message; 0 = the kind's */
} nl_sock_opts;

nl_status nl_sock_new(nl_sock **out, nl_net *net, const nl_sock_opts *opts, nl_error *err);
void nl_sock_destroy(nl_sock **sp);
/* Bind; "tcp://127.0.0.1:*" picks a port, read back by nl_sock_endpoint. */
nl_status nl_sock_bind(nl_sock *s, const char *endpoint, nl_error *err);
const char *nl_sock_endpoint(const nl_sock *s);
nl_status nl_sock_connect(nl_sock *s, const char *endpoint, nl_error *err);
/* Replace the keys a server socket admits (on its private domain, e.g. a
 * node's neighbours from its ASSIGN). Effective for new handshakes and for
 * messages on connections already open. */
nl_status nl_sock_allow(nl_sock *s, const char *const *z85_keys, size_t n, nl_error *err);
const char *nl_sock_domain(const nl_sock *s);
/* The zmq socket, for zmq_poll or socket monitors. */
void *nl_sock_handle(nl_sock *s);

/* A received message. msg's frames point into parts: valid until the next
 * nl_sock_recv into this rx, or nl_rx_free. */
typedef struct nl_rx {
    nl_wire_msg msg;
    char peer[NL_PEER_ID_MAX];      /* Z85 key, "plain:<addr>", or the server's key */
    uint8_t rid[NL_ROUTING_ID_MAX]; /* ROUTER only: who sent it */
    size_t rid_len;
    int nparts;
    zmq_msg_t parts[NL_RX_MAX_PARTS];
} nl_rx;

void nl_rx_init(nl_rx *rx);
void nl_rx_free(nl_rx *rx);

/* For a link of our own beside ZeroMQ (net/locallink.h): make rx hold the
 * n malloc'd parts (header, then frames) of one message from peer, and
 * decode them with lim as nl_sock_recv would. rx owns the buffers from
 * the call on, whatever it returns (they are freed with rx's parts). */
nl_status nl_rx_adopt(nl_rx *rx, void *const *bufs, const size_t *lens, int n, const char *peer,
                      const nl_wire_limits *lim, nl_error *err);

/* Wait up to timeout_ms (-1 forever, 0 poll) for one message. Returns
 * NL_OK with rx filled, NL_ERR_TIMEOUT (also when a signal interrupts the
 * wait: check your flags and call again), NL_ERR_AUTH (dropped), or the
 * decode error of a bad message (already answered and counted). */
nl_status nl_sock_recv(nl_sock *s, nl_rx *rx, int timeout_ms, nl_error *err);
/* Send m (fills frame lengths). On a ROUTER, to is the routing id (from an
 * nl_rx). Every frame's free_fn is called exactly once, whatever happens. */
nl_status nl_sock_send(nl_sock *s, const uint8_t *to, size_t to_len, nl_wire_msg *m, nl_error *err);
/* The same without waiting: a peer whose queue is full (or, on a ROUTER
 * with ROUTER_MANDATORY, that is gone) gets nothing and the call returns
 * NL_ERR_TIMEOUT (NL_ERR_NOTFOUND) at once; frames are freed either way.
 * For replies to peers that may stop reading (a coordinator's clients). */
nl_status nl_sock_send_nowait(nl_sock *s, const uint8_t *to, size_t to_len, nl_wire_msg *m,
                              nl_error *err);
/* Send m to the sender of rx. */
nl_status nl_sock_reply(nl_sock *s, const nl_rx *rx, nl_wire_msg *m, nl_error *err);
/* Answer rx with an ERROR (never blocks: dropped if it cannot go now). */
nl_status nl_sock_send_error(nl_sock *s, const nl_rx *rx, nl_status code, uint32_t req_type,
                             const char *message, nl_error *err);

/* The versioned hello, client side: send HELLO and wait for HELLO_ACK. A
 * peer on another protocol version answers ERROR, returned as
 * NL_ERR_VERSION with its message. rx receives the answer. */
nl_status nl_sock_hello(nl_sock *s, nl_role role, int timeout_ms, nl_rx *rx, nl_error *err);
/* Server side: answer a HELLO received in rx with HELLO_ACK. */
nl_status nl_sock_answer_hello(nl_sock *s, const nl_rx *rx, nl_role role, nl_error *err);

/* Wait until one of the sockets is readable. readable[i] says which.
 * Returns NL_OK, or NL_ERR_TIMEOUT. */
nl_status nl_sock_poll(nl_sock *const *socks, bool *readable, int n, int timeout_ms, nl_error *err);

#endif
