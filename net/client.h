/* The client side of a coordinator's clients' endpoint (docs/protocol.md):
 * connecting (a DEALER socket, CURVE or plaintext, HELLO), submitting and
 * cancelling jobs, asking for the cluster's status, and receiving a job's
 * messages with a deadline. Written once for neuroctl's cluster commands
 * (cli/remote.c) and neurocoord --http's handlers (coordinator/coord_http*.c).
 *
 * Ownership: nl_client_connect returns a socket the caller destroys with
 * nl_sock_destroy; the options' strings and keys are borrowed for the
 * call. */
#ifndef NL_CLIENT_H
#define NL_CLIENT_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/clock.h"
#include "base/status.h"
#include "net/transport.h"

typedef struct nl_client_opts {
    const char *endpoint;   /* the coordinator's clients' endpoint */
    const nl_keypair *keys; /* ours; NULL with plaintext */
    const char *server_key; /* the coordinator's Z85 public key; NULL with plaintext */
    bool plaintext;         /* INSECURE: no CURVE */
    const char *name;       /* the socket's name in logs and errors */
    nl_sock_kind kind;      /* NL_SOCK_CONTROL when only control-sized messages pass */
    int timeout_ms;         /* the connection and HELLO within */
    /* watch the handshake (a monitor socket, net/handshake.h): a refused
     * connection or a key at fault is told at once, by what to check */
    bool watch_handshake;
} nl_client_opts;

/* Connect and say HELLO within o->timeout_ms. On failure *out is NULL
 * and err names the coordinator (or, watched, what to check). */
nl_status nl_client_connect(nl_sock **out, nl_net *net, const nl_client_opts *o, nl_error *err);

/* Send a message whose body is a job id: NL_MSG_JOB_CANCEL, or
 * NL_MSG_JOB_QUERY (job 0: the cluster's status). */
nl_status nl_client_send_ref(nl_sock *s, nl_msg_type type, uint64_t job_id, nl_error *err);

/* Send JOB_SUBMIT: kind, np params (borrowed), and ids as one I32 [B, T]
 * frame, or no frame when ids is NULL. */
nl_status nl_client_submit(nl_sock *s, nl_job_kind kind, const nl_wire_param *ps, int np,
                           const int32_t *ids, int B, int T, nl_error *err);

/* Wait until deadline (nl_mono_s() seconds) for the next message
 * into rx; passing the deadline is NL_ERR_TIMEOUT, an ERROR from the
 * coordinator an error with its code and message. */
nl_status nl_client_recv(nl_sock *s, nl_rx *rx, double deadline, nl_error *err);

/* Ask for the cluster's status and wait until deadline for it: *out is
 * its JSON (the caller decrefs); a malformed answer is NL_ERR_PROTO. */
nl_status nl_client_status(nl_sock *s, double deadline, json_t **out, nl_error *err);

/* How a coordinator's refusal of a job for want of room begins (a
 * JOB_STATUS failed of job 0: the job was never made): the key holds
 * --max-jobs-per-key jobs, or the job table is full. */
#define NL_CLIENT_TOO_MANY_JOBS "too many jobs"
/* Whether rx is a JOB_STATUS that ends a job as failed or cancelled; if
 * so, err gets "job N failed: MESSAGE" (or "was cancelled"), with the
 * status NL_ERR_LIMIT for a refusal for want of room
 * (NL_CLIENT_TOO_MANY_JOBS), else NL_ERR_STATE. */
int nl_client_job_failed(const nl_rx *rx, nl_error *err);

/* What a job that answers with one RESULT (forward, embed) hands over: a
 * RESULT of one frame, valid during the call. Return NL_OK to take it,
 * or an error (a frame of the wrong shape) that ends the wait. */
typedef nl_status (*nl_client_result_fn)(void *ctx, const nl_wire_msg *result, nl_error *err);

/* Follow the job just submitted on s until it ends, or until deadline:
 * its first RESULT of one frame goes to take, its DONE after that ends
 * the wait (NL_OK); a failed or cancelled end is NL_ERR_STATE ("job N
 * failed: ..."), the deadline NL_ERR_TIMEOUT. */
nl_status nl_client_await_result(nl_sock *s, double deadline, nl_client_result_fn take, void *ctx,
                                 nl_error *err);

#endif
