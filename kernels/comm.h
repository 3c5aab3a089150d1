/* The communicator of a node's data-parallel replicas: R backends in one
 * process (one per replica, each holding a whole copy of the stage), and
 * the two collectives the replicas need on a flat float buffer that lives
 * in each replica's own memory: all-reduce (sum), for the gradients before
 * their norm and AdamW, and broadcast, for the weights a training job
 * starts from.
 *
 * Two implementations behind one table:
 *   - host: works on every backend. It copies each replica's buffer to the
 *     host in pieces (download), adds the replicas in the order 0, 1, ...,
 *     R - 1, and copies the sum back to every replica (upload). On a
 *     host-memory backend (cpu) the copies are memcpy; on cpu-devsim and
 *     CUDA they are real transfers.
 *   - nccl: CUDA backends only, inside libnl_cuda.so (kernels/cuda/
 *     cuda_comm.cu): ncclCommInitAll over the replicas' devices, the
 *     collectives queued on each replica's own stream, so they run in order
 *     with its kernels. The module must have been built with NCCL.
 *
 * Determinism: the result never depends on timing. The host sum has one
 * fixed order; NCCL's ring and tree reductions have an order fixed by the
 * communicator, the buffer size and the algorithm NCCL picks for them
 * (pin it with NCCL_ALGO for runs compared across machines). Every replica
 * receives the same bits, so replicas that apply the same AdamW stay equal.
 *
 * Ordering: a collective is queued after the work already queued on each
 * backend and before the work queued after it (backend.h's contract); the
 * host one has finished when it returns. Errors: typed, naming the replica
 * and its device.
 *
 * Ownership: nl_comm_new borrows the backends (they must outlive the
 * communicator) and returns a communicator freed with nl_comm_destroy(&c). */
#ifndef NL_COMM_H
#define NL_COMM_H

#include <stddef.h>

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nl_comm nl_comm;

/* Most replicas one communicator takes. */
#define NL_COMM_MAX 16

typedef enum nl_comm_kind {
    NL_COMM_AUTO = 0, /* nccl when every backend is CUDA, else host */
    NL_COMM_HOST,
    NL_COMM_NCCL,
} nl_comm_kind;

/* A communicator over be[0..n-1] (1 <= n <= NL_COMM_MAX, distinct
 * backends). NCCL needs CUDA backends on distinct devices and a module
 * built with NCCL; asked for explicitly without them it fails with
 * NL_ERR_UNSUPPORTED saying which. AUTO takes NCCL where it can and the
 * host otherwise (nl_comm_name says which it took). */
nl_status nl_comm_new(nl_comm **out, nl_backend *const *be, int n, nl_comm_kind kind,
                      nl_error *err);
void nl_comm_destroy(nl_comm **c);

int nl_comm_size(const nl_comm *c);
const char *nl_comm_name(const nl_comm *c); /* "host" or "nccl" */

/* buf[r] (n floats in the memory of replica r's backend) becomes, on every
 * replica, the sum over replicas of buf[0..R-1], added in a fixed order. */
nl_status nl_comm_allreduce_sum(nl_comm *c, float *const *buf, size_t n, nl_error *err);

/* buf[r] becomes buf[root] on every replica r. */
nl_status nl_comm_broadcast(nl_comm *c, float *const *buf, size_t n, int root, nl_error *err);

#ifdef __cplusplus
}
#endif

#endif
