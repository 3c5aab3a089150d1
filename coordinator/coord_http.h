/* neurocoord --http: the HTTP interface (serve/http.h) in front of a
 * cluster. Its handlers are a client of the coordinator: each completion
 * opens its own CURVE connection to the clients' endpoint with a key pair
 * made at start and admitted in memory (nl_coord_admit_key), submits a
 * generate job and relays its tokens; a poller thread asks for the
 * cluster's status twice a second for /api/status, /metrics and the join,
 * death and plan events; training reports reach /api/events through
 * nl_coord_observe. The coordinator's loop runs as before, in its thread.
 *
 * Ownership: nl_coord_http_start borrows c, which must outlive the
 * server; nl_coord_http_stop(&h) stops it (NULL-safe) and must come
 * before nl_coord_destroy. */
#ifndef NL_COORD_HTTP_H
#define NL_COORD_HTTP_H

#include "base/status.h"
#include "coordinator/coord.h"
#include "serve/http.h"

typedef struct nl_coord_http nl_coord_http;

/* Serve ho (its address, tokens and limits) for the coordinator c, whose
 * public key is state_dir/coordinator.pub (unless plaintext); name is
 * what /v1/models lists first (copied). adapters (NULL: none) is
 * --http-adapter's "NAME=FILE[,NAME=FILE...]": each NAME is a model of its
 * own in /v1/models, the cluster's weights with the LoRA adapter FILE
 * (under the coordinator's and the nodes' --checkpoint-root) applied by
 * every stage; a request's "model" selects it, an unknown name is 404. */
nl_status nl_coord_http_start(nl_coord_http **out, nl_coord *c, const char *name,
                              const char *adapters, const char *state_dir, int plaintext,
                              const nl_http_opts *ho, nl_error *err);
void nl_coord_http_stop(nl_coord_http **h);
int nl_coord_http_port(const nl_coord_http *h);

#endif
