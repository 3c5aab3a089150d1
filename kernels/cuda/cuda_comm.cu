/* The NCCL communicator of a node's data-parallel replicas (comm.h), inside
 * libnl_cuda.so: one process, R GPUs. ncclCommInitAll makes the R ranks at
 * once (no bootstrap over the network); each collective is one NCCL group
 * of R calls issued from one thread, each queued on its replica's own
 * stream, so it runs after the kernels queued before it (the gradients'
 * last backward) and before those queued after it (the norm, AdamW), with
 * no host wait. One thread managing several devices must group its calls
 * (NCCL's "Group Calls": an ungrouped loop could block in the first call
 * waiting for the other ranks). The replicas compute on threads of their
 * own (node/replica_workers.c), but the node calls a collective only while
 * those threads are idle, so no stream is used by two threads at once.
 *
 * Ranks follow the replicas' order. NCCL refuses two ranks on one device
 * ("Duplicate GPU detected"), so the devices must be distinct. Results are
 * the same on every rank (each element is reduced once and then copied),
 * and the order of summation is fixed by the communicator, the count and
 * the algorithm NCCL tunes for them, not by timing.
 *
 * Built without NCCL (NL_NCCL=OFF, or no NCCL found), nl_cuda_comm_new
 * fails with NL_ERR_UNSUPPORTED; nl_comm_new then uses the host's. */
extern "C" {
#include "kernels/backend.h"
#include "kernels/comm_impl.h"
}
#include "kernels/cuda/cuda_comm.h"

#include <cuda_runtime.h>
#if NL_HAVE_NCCL
#include <nccl.h>
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NL_EXPORT extern "C" __attribute__((visibility("default")))

#if NL_HAVE_NCCL
namespace
{

struct nccl_ctx {
    int devices[NL_COMM_MAX];
    cudaStream_t streams[NL_COMM_MAX];
    ncclComm_t comms[NL_COMM_MAX];
    bool made; /* comms exist */
};

nccl_ctx *ctx_of(nl_comm *c)
{
    return (nccl_ctx *)c->ctx;
}

/* A failed NCCL call: its result and NCCL's own last words. */
nl_status failed(nl_comm *c, int r, const char *op, ncclResult_t res, nl_error *err)
{
    nccl_ctx *x = ctx_of(c);
    const char *last = x->made && r >= 0 ? ncclGetLastError(x->comms[r]) : ncclGetLastError(NULL);
    const nl_status st =
        res == ncclInvalidArgument || res == ncclInvalidUsage ? NL_ERR_INVALID : NL_ERR_INTERNAL;
    return nl_error_set(err, st, "nccl %s%s%s: %s%s%s", op, r >= 0 ? " on " : "",
                        r >= 0 ? c->be[r]->name : "", ncclGetErrorString(res),
                        last && *last ? ": " : "", last ? last : "");
}

/* An error an earlier collective left on any rank (none is waited for). */
nl_status async_errors(nl_comm *c, const char *op, nl_error *err)
{
    nccl_ctx *x = ctx_of(c);
    for (int r = 0; r < c->n; r++) {
        ncclResult_t a = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(x->comms[r], &a);
        if (q != ncclSuccess)
            a = q;
        if (a != ncclSuccess && a != ncclInProgress)
            return failed(c, r, op, a, err);
    }
    return NL_OK;
}

nl_status nccl_allreduce(nl_comm *c, float *const *buf, size_t n, nl_error *err)
{
    nccl_ctx *x = ctx_of(c);
    nl_status st = async_errors(c, "all-reduce", err);
    if (st != NL_OK)
        return st;
    ncclResult_t res = ncclGroupStart();
    if (res != ncclSuccess)
        return failed(c, -1, "all-reduce: group start", res, err);
    int bad = -1;
    for (int r = 0; r < c->n && res == ncclSuccess; r++) {
        res = ncclAllReduce(buf[r], buf[r], n, ncclFloat, ncclSum, x->comms[r], x->streams[r]);
        bad = res == ncclSuccess ? -1 : r;
    }
    const ncclResult_t end = ncclGroupEnd(); /* always closes the group it opened */
    if (res != ncclSuccess)
        return failed(c, bad, "all-reduce", res, err);
    if (end != ncclSuccess)
        return failed(c, -1, "all-reduce: group end", end, err);
    return NL_OK;
}

nl_status nccl_broadcast(nl_comm *c, float *const *buf, size_t n, int root, nl_error *err)
{
    nccl_ctx *x = ctx_of(c);
    nl_status st = async_errors(c, "broadcast", err);
    if (st != NL_OK)
        return st;
    ncclResult_t res = ncclGroupStart();
    if (res != ncclSuccess)
        return failed(c, -1, "broadcast: group start", res, err);
    int bad = -1;
    for (int r = 0; r < c->n && res == ncclSuccess; r++) {
        res = ncclBroadcast(buf[r], buf[r], n, ncclFloat, root, x->comms[r], x->streams[r]);
        bad = res == ncclSuccess ? -1 : r;
    }
    const ncclResult_t end = ncclGroupEnd();
    if (res != ncclSuccess)
        return failed(c, bad, "broadcast", res, err);
    if (end != ncclSuccess)
        return failed(c, -1, "broadcast: group end", end, err);
    return NL_OK;
}

void nccl_destroy(nl_comm *c)
{
    nccl_ctx *x = ctx_of(c);
    if (x && x->made) {
        /* what is queued finishes first; then each rank goes */
        for (int r = 0; r < c->n; r++) {
            cudaSetDevice(x->devices[r]);
            cudaStreamSynchronize(x->streams[r]);
        }
        for (int r = 0; r < c->n; r++)
            ncclCommDestroy(x->comms[r]);
        cudaGetLastError(); /* leave no error for a backend's next check */
    }
    free(x);
    free(c);
}

} // namespace
#endif

/* ---------------------------------------------------------------- entry points */

NL_EXPORT int nl_cuda_comm_abi(void)
{
    return NL_COMM_ABI;
}

NL_EXPORT nl_status nl_cuda_comm_new(nl_comm **out, nl_backend *const *be, int n, nl_error *err)
{
    *out = NULL;
#if !NL_HAVE_NCCL
    (void)be;
    (void)n;
    return nl_error_set(err, NL_ERR_UNSUPPORTED,
                        "nccl: libnl_cuda.so was built without NCCL (NL_NCCL=OFF or not found)");
#else
    if (n < 1 || n > NL_COMM_MAX)
        return nl_error_set(err, NL_ERR_INVALID, "nccl: %d replicas (1 to %d)", n, NL_COMM_MAX);
    nl_comm *c = (nl_comm *)calloc(1, sizeof *c);
    nccl_ctx *x = (nccl_ctx *)calloc(1, sizeof *x);
    if (!c || !x) {
        free(c);
        free(x);
        return nl_error_set(err, NL_ERR_NOMEM, "nccl: out of memory");
    }
    c->name = "nccl";
    c->n = n;
    c->ctx = x;
    c->allreduce_sum = nccl_allreduce;
    c->broadcast = nccl_broadcast;
    c->destroy = nccl_destroy;
    for (int r = 0; r < n; r++) {
        c->be[r] = be[r];
        if (!nl_cuda_backend_queue(be[r], &x->devices[r], &x->streams[r])) {
            nccl_destroy(c);
            return nl_error_set(err, NL_ERR_INVALID,
                                "nccl: replica %d (%s) is not a backend of this CUDA module", r,
                                be[r]->name);
        }
        for (int q = 0; q < r; q++)
            if (x->devices[q] == x->devices[r]) {
                nccl_destroy(c);
                return nl_error_set(err, NL_ERR_INVALID,
                                    "nccl: replicas %d and %d are both on %s (NCCL takes one rank "
                                    "per device)",
                                    q, r, be[r]->name);
            }
    }
    const ncclResult_t res = ncclCommInitAll(x->comms, n, x->devices);
    if (res != ncclSuccess) {
        nl_status st = failed(c, -1, "init (ncclCommInitAll)", res, err);
        nccl_destroy(c);
        cudaGetLastError();
        return st;
    }
    x->made = true;
    *out = c;
    return NL_OK;
#endif
}
