/* Authentication: the ZAP handler, per-domain allow-lists, strikes and
 * bans.
 *
 * One nl_auth per zmq context: it binds inproc://zeromq.zap.01 and answers
 * every CURVE handshake on that context's server sockets from a thread of
 * its own. Each server socket names a ZAP domain; a domain holds the
 * public keys it admits (a list set by the program, e.g. a node's
 * neighbours, or a watched authorized_keys file, re-read on reload).
 * Unknown domains and keys are refused: deny by default. An admitted
 * CURVE peer's User-Id is its Z85 public key; a plaintext peer's (only on
 * domains opened with nl_auth_allow_plaintext) is "plain:<address>".
 *
 * Strikes: the transport counts every bad message against the peer id.
 * A peer with strike_limit strikes inside strike_window_ms is banned for
 * ban_ms: the ZAP handler refuses its handshakes and the transport drops
 * its messages. The strike table has max_peers entries, so memory stays
 * bounded whatever the peers do.
 *
 * All functions are thread-safe. */
#ifndef NL_AUTH_H
#define NL_AUTH_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"
#include "net/keys.h"

#define NL_PEER_ID_MAX 72    /* "plain:" + an address, or a Z85 key, + NUL */
#define NL_ZAP_DOMAIN_MAX 64 /* domain names are shorter than this */

typedef struct nl_auth nl_auth;

typedef struct nl_auth_policy {
    int strike_limit;     /* default 5 */
    int strike_window_ms; /* default 60000 */
    int ban_ms;           /* default 300000 */
    int max_peers;        /* strike table size, default 1024 */
} nl_auth_policy;

typedef struct nl_auth_stats {
    uint64_t allowed, denied; /* ZAP decisions */
    uint64_t strikes, bans;
    uint64_t dropped; /* messages dropped at receive (see nl_auth_note_drop) */
} nl_auth_stats;

nl_auth_policy nl_auth_policy_default(void);

/* Start the handler on zctx. Fails if the context already has one. */
nl_status nl_auth_new(nl_auth **out, void *zctx, const nl_auth_policy *policy, nl_error *err);
/* Stop the thread and free; NULL-safe. Call before zmq_ctx_term. */
void nl_auth_destroy(nl_auth **ap);

/* Replace a domain's allow-list (the domain is created if new). */
nl_status nl_auth_set_keys(nl_auth *a, const char *domain, const nl_keylist *keys, nl_error *err);
nl_status nl_auth_set_keys_z85(nl_auth *a, const char *domain, const char *const *keys, size_t n,
                               nl_error *err);
/* Bind a domain to an authorized_keys file: load it now (failure leaves
 * the domain unchanged) and again on every nl_auth_reload. */
nl_status nl_auth_watch_file(nl_auth *a, const char *domain, const char *path, nl_error *err);
/* Re-read every watched file. A file that fails to parse keeps its old
 * list (and the error names it); the others are still reloaded. */
nl_status nl_auth_reload(nl_auth *a, nl_error *err);
/* Admit one more key on a domain, with these roles (NL_KEY_ROLE_* bits),
 * for the life of the process, kept through nl_auth_watch_file,
 * nl_auth_reload and nl_auth_set_keys (e.g. a daemon's own in-process
 * client, whose key is made at start). */
nl_status nl_auth_pin_key(nl_auth *a, const char *domain, const char *z85, int roles,
                          nl_error *err);
/* INSECURE: admit NULL-mechanism (plaintext) peers on a domain. Logged. */
nl_status nl_auth_allow_plaintext(nl_auth *a, const char *domain, nl_error *err);
/* Forget a domain (its sockets are gone). */
void nl_auth_drop_domain(nl_auth *a, const char *domain);

/* Admit on the domain only keys that have one of these roles
 * (NL_KEY_ROLE_* bits; 0, the default: any listed key), e.g. a socket for
 * nodes alone and one for clients alone that watch one authorized_keys
 * file: a key of another role fails the handshake (ZAP), and its
 * messages on connections already open are dropped. nl_auth_roles then
 * reports a peer's roles within the mask. Plaintext peers (on a plaintext
 * domain) have every role, so the mask's. */
nl_status nl_auth_set_domain_roles(nl_auth *a, const char *domain, int roles, nl_error *err);

/* Is this peer id admitted on the domain now (listed with a role the
 * domain takes, and not banned)? */
bool nl_auth_allowed(nl_auth *a, const char *domain, const char *peer);
/* The roles (NL_KEY_ROLE_* bits, net/keys.h) the peer has on the domain
 * now: its authorized_keys line's, every role for a plaintext peer on a
 * plaintext domain and for a key set without roles, all within the
 * domain's role mask (nl_auth_set_domain_roles); 0 when the peer is not
 * admitted (unlisted, banned, or none of the domain's roles). */
int nl_auth_roles(nl_auth *a, const char *domain, const char *peer);
/* Count a strike; returns true when the peer is (now) banned. */
bool nl_auth_strike(nl_auth *a, const char *peer, const char *why);
bool nl_auth_banned(nl_auth *a, const char *peer);
void nl_auth_note_drop(nl_auth *a);
void nl_auth_get_stats(nl_auth *a, nl_auth_stats *out);
/* Peers currently in the strike table (bounded by max_peers). */
int nl_auth_tracked_peers(nl_auth *a);

/* The daemon's signal path: nl_auth_hup_install sets a SIGHUP handler that
 * only raises a flag; the event loop calls nl_auth_hup_take() and, when it
 * returns true, nl_auth_reload(). */
nl_status nl_auth_hup_install(nl_error *err);
bool nl_auth_hup_take(void);

#endif
