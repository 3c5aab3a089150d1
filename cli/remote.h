/* neuroctl's connection to a coordinator: the flags that name one
 * (--coordinator/--key/--coordinator-key or --cluster DIR) and the
 * connection they open; receiving with a deadline, submitting and
 * cancelling jobs and the cluster status go through net/client.h (the
 * protocol's client side, shared with neurocoord --http) with the
 * connection's --timeout. Shared by the cluster commands (forward,
 * generate, status, train). */
#ifndef NL_CLI_REMOTE_H
#define NL_CLI_REMOTE_H

#include <jansson.h>
#include <stdint.h>

#include "base/args.h"
#include "net/client.h"
#include "net/transport.h"

/* The flags of a command that talks to a cluster, to put in its nl_flag
 * table; NL_REMOTE_FLAGS_TIMEOUT names what --timeout means for it (and
 * its default, which the command passes to nl_remote_open). */
/* clang-format off */
#define NL_REMOTE_FLAGS_TIMEOUT(timeout_help)                                                      \
    {"coordinator", 1, "the coordinator's client endpoint (neurocoord --client-listen, by default " \
                       "its --listen port + 1), e.g. tcp://host:7001", NULL},                      \
    {"key", 1, "this client's secret key file (neuroctl keygen)", NULL},                           \
    {"coordinator-key", 1, "file with the coordinator's Z85 public key", NULL},                    \
    {"cluster", 1, "a local cluster's directory (cluster up): sets the three above", NULL},        \
    {"timeout", 1, timeout_help, NULL},                                                            \
    {"plaintext", 0, "INSECURE: no CURVE (only against a --plaintext coordinator)", NULL}
/* clang-format on */
#define NL_REMOTE_FLAGS NL_REMOTE_FLAGS_TIMEOUT("seconds to wait for an answer (default 60)")

/* A command sent to a cluster computes on the nodes: --device, --tf32 and
 * --threads are each node's (neuronode join, neuroctl cluster up). Returns
 * 2 after saying so on stderr when arg is one of them, else 0. */
int nl_remote_refuse_node_flag(const char *arg);

/* An open connection. Owns its context, socket and key pair. */
typedef struct nl_remote {
    nl_net *net;
    nl_sock *s;
    nl_keypair kp;
    int timeout_ms; /* --timeout */
} nl_remote;

/* Connect as the flags say (--timeout, default default_timeout_s) and
 * exchange HELLO within the timeout. On failure the error names the flag
 * or the coordinator at fault; call nl_remote_close either way. */
nl_status nl_remote_open(nl_remote *r, const nl_flag *flags, int default_timeout_s, nl_error *err);
/* Close and wipe the keys; safe on a zeroed or closed nl_remote. */
void nl_remote_close(nl_remote *r);

/* Wait until deadline (nl_mono_s() seconds) for the next message into
 * rx; passing the deadline is NL_ERR_TIMEOUT, an ERROR from the
 * coordinator becomes an error with its code and message. */
nl_status nl_remote_recv(nl_remote *r, nl_rx *rx, double deadline, nl_error *err);

/* Fetch the cluster status JSON; the caller frees it with json_decref. */
nl_status nl_remote_status(nl_remote *r, json_t **out, nl_error *err);
/* Open a connection as the flags say, fetch the status and close: the
 * status and NL_OK, or the error (nothing printed). */
nl_status nl_remote_status_once(const nl_flag *flags, json_t **out, nl_error *err);

/* Send JOB_SUBMIT: kind, np params (borrowed), and ids as one I32 [B, T]
 * frame, or no frame when ids is NULL. */
nl_status nl_remote_submit(nl_remote *r, nl_job_kind kind, const nl_wire_param *ps, int np,
                           const int32_t *ids, int B, int T, nl_error *err);

/* Send JOB_CANCEL for job_id. */
nl_status nl_remote_cancel(nl_remote *r, uint64_t job_id, nl_error *err);

#endif
