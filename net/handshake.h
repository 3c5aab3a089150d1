/* Watching a client socket's connection and ZMTP/CURVE handshake through a
 * libzmq socket monitor, so that a refused handshake or a port nobody
 * listens on is reported at once instead of as a silent wait for an
 * answer that cannot come. The mistakes it tells apart:
 *   nothing listens at the endpoint   -> NL_ERR_IO "connection refused"
 *   the server refused our key (ZAP)  -> NL_ERR_AUTH "... not in its authorized_keys"
 *   the server could not decrypt us   -> NL_ERR_AUTH "... not the server's public key"
 * Use: nl_handshake_watch before nl_sock_connect, nl_handshake_wait after
 * it, then say HELLO as usual; nl_handshake_destroy when done. */
#ifndef NL_HANDSHAKE_H
#define NL_HANDSHAKE_H

#include "base/status.h"
#include "net/transport.h"

typedef struct nl_handshake nl_handshake;

/* Start monitoring s (not yet connected). Owns a PAIR socket on net's
 * context; destroy it before the context. */
nl_status nl_handshake_watch(nl_handshake **out, nl_net *net, nl_sock *s, nl_error *err);

/* Wait up to timeout_ms for the outcome of connecting to endpoint:
 * NL_OK once a handshake succeeded; NL_ERR_IO (refused), NL_ERR_AUTH
 * (a key at fault) with a message that says what to check; NL_ERR_TIMEOUT
 * when nothing decisive happened in time (the caller's own wait goes on). */
nl_status nl_handshake_wait(nl_handshake *h, const char *endpoint, int timeout_ms, nl_error *err);

/* Stop monitoring; NULL-safe, safe twice. */
void nl_handshake_destroy(nl_handshake **hp);

#endif
