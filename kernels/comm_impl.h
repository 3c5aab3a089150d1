/* Private to kernels/: the communicator's table, which the host
 * implementation (comm.c) and the NCCL one in the CUDA module
 * (cuda/cuda_comm.cu) fill, and the module's entry point for it. Nothing
 * above kernels/ includes this file; it uses comm.h. */
#ifndef NL_COMM_IMPL_H
#define NL_COMM_IMPL_H

#include "kernels/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever struct nl_comm changes: a module built against another
 * version is refused. */
#define NL_COMM_ABI 1

struct nl_comm {
    const char *name;            /* "host", "nccl" */
    int n;                       /* replicas */
    nl_backend *be[NL_COMM_MAX]; /* borrowed */
    void *ctx;                   /* implementation-private */
    /* arguments checked by comm.c: n >= 1 floats, one non-NULL buffer per
     * replica, 0 <= root < n */
    nl_status (*allreduce_sum)(nl_comm *c, float *const *buf, size_t n, nl_error *err);
    nl_status (*broadcast)(nl_comm *c, float *const *buf, size_t n, int root, nl_error *err);
    void (*destroy)(nl_comm *c); /* frees ctx and the table itself */
};

/* kernels/cuda (libnl_cuda.so), looked up with dlsym in the module that
 * made the backends:
 *   int nl_cuda_comm_abi(void);              returns NL_COMM_ABI
 *   nl_status nl_cuda_comm_new(nl_comm **out, nl_backend *const *be, int n,
 *                              nl_error *err);
 * nl_cuda_comm_new fails with NL_ERR_UNSUPPORTED when the module was built
 * without NCCL. */
typedef int (*nl_cuda_comm_abi_fn)(void);
typedef nl_status (*nl_cuda_comm_new_fn)(nl_comm **out, nl_backend *const *be, int n,
                                         nl_error *err);

#ifdef __cplusplus
}
#endif

#endif
