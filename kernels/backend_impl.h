/* Private to kernels/: the constructors the factory (backend_factory.c)
 * calls, and the entry points a CUDA module (libnl_cuda.so) exports.
 * Nothing above kernels/ includes this file; it uses nl_backend_new. */
#ifndef NL_BACKEND_IMPL_H
#define NL_BACKEND_IMPL_H

#include "kernels/backend.h"

/* kernels/cpu/cpu_backend.c */
nl_status nl_cpu_backend_new(nl_backend **out, const nl_backend_opts *o, nl_error *err);

/* kernels/devsim.c: the CPU backend behind tagged device pointers */
nl_status nl_devsim_backend_new(nl_backend **out, const nl_backend_opts *o, nl_error *err);

/* kernels/cuda (libnl_cuda.so), looked up with dlsym by these names:
 *   int nl_cuda_module_abi(void);            returns NL_BACKEND_ABI
 *   nl_status nl_cuda_backend_new(nl_backend **out, int device,
 *                                 const nl_backend_opts *o, nl_error *err); */
typedef int (*nl_cuda_module_abi_fn)(void);
typedef nl_status (*nl_cuda_backend_new_fn)(nl_backend **out, int device, const nl_backend_opts *o,
                                            nl_error *err);

#endif
