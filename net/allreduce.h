/* The all-reduce of a stage's replicas on different nodes (DESIGN section
 * 8, "Replicas"): R replicas, each holding its sum of a step's gradients
 * in a host buffer of n floats, end with the sum of all of them, added in
 * replica order ((g0 + g1) + g2) + ... for every element, so the result
 * never depends on timing and equals the in-process communicator's host
 * sum (kernels/comm.h) bit for bit.
 *
 * The ring: replica r sends only to replica (r + 1) mod R and receives
 * only from (r - 1) mod R, one REDUCE message (net/wire.h) per chunk of
 * `chunk` elements. Phase SUM runs every chunk from replica 0 along the
 * ring: replica r adds its own values to the partial sum of 0..r-1 it
 * received and passes it on, so replica R-1 makes the total; phase RESULT
 * carries the total from R-1 on round the ring to R-2. Chunks are
 * independent: a chunk moves on as soon as it arrived and this replica's
 * gradients are final (nl_allreduce_begin), so the chunks pipeline along
 * the ring and a replica can take its predecessor's chunks while its own
 * backward still runs. Each link carries the buffer about twice in a step,
 * as a ring all-reduce does; the order of every element's sum is fixed.
 *
 * A state machine over messages, with no sockets: the caller delivers what
 * came from the predecessor (nl_allreduce_input) and sends what it is
 * given through a callback (the node's data socket to the next replica,
 * under CURVE). Everything received is checked: the job and step, the
 * sender, the phase this replica can receive, the chunk's bounds and
 * length, duplicates (NL_ERR_PROTO / NL_ERR_SHAPE naming the field). A
 * chunk that comes before begin is staged and taken when begin comes; one
 * of the step after a finished reduce starts that step's staging.
 *
 * Ownership: nl_allreduce_new returns a reducer freed with
 * nl_allreduce_destroy(&a) (NULL-safe, twice-safe); begin borrows the
 * buffer until the reduce is done (or the reducer is reset or freed). */
#ifndef NL_ALLREDUCE_H
#define NL_ALLREDUCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "net/wire.h"

/* Default elements per REDUCE: 1 MiB of floats. */
#define NL_ALLREDUCE_CHUNK (256u * 1024u)

typedef struct nl_allreduce nl_allreduce;

/* Send m (a REDUCE with its frame set) to the next replica; the frame's
 * bytes are the reducer's and stay valid only until the call returns. */
typedef nl_status (*nl_allreduce_send_fn)(void *ctx, nl_wire_msg *m, nl_error *err);

/* A reducer for replica `replica` of `replicas` (2 to
 * NL_REDUCE_MAX_REPLICAS) of job `job` over buffers of n floats, in
 * chunks of `chunk` elements (0: NL_ALLREDUCE_CHUNK); `what` (NL_REDUCE_*)
 * tells its messages from another reducer's of the same replicas. */
nl_status nl_allreduce_new(nl_allreduce **out, uint64_t job, uint32_t what, int replica,
                           int replicas, size_t n, size_t chunk, nl_error *err);
void nl_allreduce_destroy(nl_allreduce **a);

/* This replica's sum of step `step` is final in buf (n floats, host):
 * start (replica 0) or go on with the chunks that came. *done: buf holds
 * the sum of every replica. NL_ERR_STATE if a reduce is under way. */
nl_status nl_allreduce_begin(nl_allreduce *a, uint64_t step, float *buf, nl_allreduce_send_fn send,
                             void *ctx, bool *done, nl_error *err);

/* A REDUCE from the previous replica (decoded, frame checked by the
 * schema). *done as for begin. After an error the reducer refuses
 * everything until nl_allreduce_reset. */
nl_status nl_allreduce_input(nl_allreduce *a, const nl_wire_msg *m, nl_allreduce_send_fn send,
                             void *ctx, bool *done, nl_error *err);

/* Forget the reduce under way and what was staged (a step redone). */
void nl_allreduce_reset(nl_allreduce *a);

/* Whether step `step`'s reduce has finished on this replica. */
bool nl_allreduce_done(const nl_allreduce *a, uint64_t step);

#endif
