/* A guard on a server socket's TCP connections against one message that
 * never ends (issue 31, item 6).
 *
 * libzmq hands a multipart message over only once its last part is in,
 * and its high-water marks count whole messages: until then it buffers
 * every part a peer sends, each up to ZMQ_MAXMSGSIZE, with no bound on
 * their number, and nothing above libzmq can see them. The guard bounds
 * that from beside libzmq: a thread follows the socket's connections
 * (libzmq's monitor: accepted, disconnected) and reads the kernel's count
 * of bytes received on each (TCP_INFO); the transport tells it when a
 * whole message came from a connection (ZMQ_SRCFD). A connection that has
 * received more than `limit` bytes since its last whole message is shut
 * down (shutdown(2)): libzmq then drops it with its unfinished message.
 * What one connection can make the process hold is so about limit plus
 * what arrives in one tick of the thread (NL_CONNGUARD_TICK_MS).
 *
 * Only TCP connections are guarded (ipc and inproc peers are local).
 * Ownership: nl_connguard_new takes nothing; nl_connguard_destroy stops
 * the thread (NULL-safe, call it on the socket's thread before closing
 * the socket). nl_connguard_seen is called on the socket's thread. */
#ifndef NL_NET_CONNGUARD_H
#define NL_NET_CONNGUARD_H

#include <stdint.h>

#include "base/status.h"

#define NL_CONNGUARD_TICK_MS 5

typedef struct nl_connguard nl_connguard;

/* Guard the connections of zsock (a socket of context zctx, before it
 * binds); name is for the log. */
nl_status nl_connguard_new(nl_connguard **out, void *zctx, void *zsock, const char *name,
                           uint64_t limit, nl_error *err);
void nl_connguard_destroy(nl_connguard **g, void *zsock);
/* A whole message came from the connection with descriptor fd. */
void nl_connguard_seen(nl_connguard *g, int fd);
/* Connections cut so far. */
uint64_t nl_connguard_cuts(nl_connguard *g);

#endif
