/* A local link: the data path between two neighbour stages on one host,
 * without ZeroMQ's I/O threads (issue 29; docs/ARCHITECTURE.md,
 * "Co-located stages").
 *
 * Over ZeroMQ a hop is three threads in turn: the sender's I/O thread
 * (CURVE, the TCP send), the receiver's I/O thread (read, decrypt, the
 * hand-off to the socket's pipe), then the receiver's own thread: about
 * 0.1 ms a hop on a small VM, more than a d 256 stage computes. A local
 * link is an AF_UNIX stream socket in the abstract namespace whose both
 * ends are read and written by the stages' own threads: a hop is one
 * write and one wake-up.
 *
 * Who may connect: the upstream stage listens on a fresh random name and
 * draws a random token; it tells both to the downstream stage in a
 * LOCAL_LINK OFFER over their CURVE link (net/wire.h), so only the peer
 * that CURVE authenticated learns them. The downstream stage connects and
 * writes the token first; the listener takes only a connection from its
 * own user id (SO_PEERCRED) whose first bytes are the token, and the
 * connecting side takes only a listener of its own user id. The abstract
 * name is bound before it is told, and names are unique in a network
 * namespace, so the connecting side reaches the stage that offered it.
 * The kernel carries the bytes between two processes of one user, who
 * could read each other's memory anyway: there is no encryption.
 *
 * Records: [u32 parts][u64 length of each part][the parts], little
 * endian; the parts are a wire message's header and tensor frames, as in
 * a ZeroMQ multipart (DESIGN section 3). The receiving side decodes them
 * with the same codec and limits as its ZeroMQ sockets. Both ends are
 * non-blocking: what the socket does not take at once waits in the link's
 * outbox, which the caller flushes when the descriptor is writable. */
#ifndef NL_LOCALLINK_H
#define NL_LOCALLINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "net/transport.h"
#include "net/wire.h"

#define NL_LOCAL_NAME_MAX 64    /* an abstract socket's name, with its NUL */
#define NL_LOCAL_TOKEN_HEX 64   /* the token: 32 random bytes, as lowercase hex */
#define NL_LOCAL_HOST_MAX 128   /* nl_local_host's text, with its NUL */
#define NL_LOCAL_ACCEPT_MS 1000 /* nl_local_accept waits this long for the token */
/* A send finds more than NL_LOCAL_OUTBOX_MAX bytes waiting (its own
 * included): it waits for the peer to read, as a ZeroMQ send at its
 * high-water mark does, up to NL_LOCAL_SEND_TIMEOUT_MS, then fails with
 * NL_ERR_TIMEOUT (the message is not sent; the link stays). */
#define NL_LOCAL_OUTBOX_MAX (1ull << 30)
#define NL_LOCAL_SEND_TIMEOUT_MS 10000

typedef struct nl_local_listener nl_local_listener;
typedef struct nl_local nl_local;

/* This host as a local link sees it: "<boot id>/<uid>/<network namespace>".
 * Two processes with equal texts can reach each other's abstract sockets
 * and run as one user. */
nl_status nl_local_host(char *out, size_t size, nl_error *err);

/* Listen on a fresh random abstract name; *name gets it and *token a
 * fresh token (NUL-terminated, NL_LOCAL_NAME_MAX and NL_LOCAL_TOKEN_HEX + 1
 * bytes). */
nl_status nl_local_listen(nl_local_listener **out, char *name, char *token, nl_error *err);
void nl_local_listener_close(nl_local_listener **lp);

/* Take the connection that presents the listener's token: waits up to
 * NL_LOCAL_ACCEPT_MS for it to be connected and for its token. Refused
 * connections (another user, a wrong or short token) are closed and
 * skipped. NL_ERR_TIMEOUT when none came; NL_ERR_AUTH when only refused
 * ones did. lim: the codec's limits for what it receives (NULL: the
 * defaults); max_part and max_msg: a part's and a message's bytes (0: as a
 * bulk ZeroMQ socket's, the codec's frame limit and twice that). who names
 * the peer in errors and logs, and is the received messages' rx->peer. */
nl_status nl_local_accept(nl_local_listener *l, const nl_wire_limits *lim, uint64_t max_part,
                          uint64_t max_msg, const char *who, nl_local **out, nl_error *err);

/* Connect to name and present token (hex, as OFFER carried it), without
 * waiting: a listener whose queue is full (another user may fill it) is
 * NL_ERR_IO at once. */
nl_status nl_local_connect(const char *name, const char *token, const nl_wire_limits *lim,
                           uint64_t max_part, uint64_t max_msg, const char *who, nl_local **out,
                           nl_error *err);

void nl_local_close(nl_local **cp);
int nl_local_fd(const nl_local *c);

/* Send m: encoded, written as far as the socket takes it, the rest copied
 * into the outbox; every frame's free_fn is called before it returns,
 * whatever happens. NL_ERR_IO when the link is broken (then closed for
 * good: every later call says so); NL_ERR_TIMEOUT when the outbox stayed
 * full (above). */
nl_status nl_local_send(nl_local *c, nl_wire_msg *m, nl_error *err);
/* The outbox's bound and the wait at it (default NL_LOCAL_OUTBOX_MAX and
 * NL_LOCAL_SEND_TIMEOUT_MS). */
void nl_local_set_outbox(nl_local *c, size_t max_bytes, int timeout_ms);
/* Bytes waiting in the outbox (poll for POLLOUT while > 0), and write them
 * as far as the socket takes them. */
size_t nl_local_pending(const nl_local *c);
nl_status nl_local_flush(nl_local *c, nl_error *err);

/* Read what the socket holds and decode the next whole message into rx
 * (rx->peer = who): NL_OK, or NL_ERR_TIMEOUT when no whole message is
 * there yet (call again when the descriptor is readable). NL_ERR_IO: the
 * peer closed the link or it broke; a record over the limits: NL_ERR_LIMIT,
 * and the link is broken for good (a stream cannot skip a record it will
 * not read). A message the codec refuses: the codec's error, its record
 * consumed, and the link stays (nl_local_broken tells the two apart). */
nl_status nl_local_recv(nl_local *c, nl_rx *rx, nl_error *err);
/* Whether the link is broken for good (closed by the peer, a failed read
 * or write, a record over the limits): every later call says NL_ERR_IO.
 * A message the codec refused leaves it whole. */
bool nl_local_broken(const nl_local *c);
/* Whether the rest of a record is already read ahead, so nl_local_recv
 * has a message (or an error) without the descriptor becoming readable
 * again: poll without waiting while it says so. */
bool nl_local_ready(const nl_local *c);
/* The counts since the link was made (for the node's log). */
typedef struct nl_local_stats {
    uint64_t sent, received, bytes_out, bytes_in, outbox_waits;
} nl_local_stats;
nl_local_stats nl_local_get_stats(const nl_local *c);

#endif
