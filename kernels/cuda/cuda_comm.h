/* Private to the CUDA module: what its communicator (cuda_comm.cu) needs
 * of a backend made by cuda_backend.cu. */
#ifndef NL_CUDA_COMM_H
#define NL_CUDA_COMM_H

#include <cuda_runtime.h>

#include "kernels/backend.h"

/* The device and the stream of a backend of this module; false (nothing
 * set) when be was not made by this module. */
bool nl_cuda_backend_queue(nl_backend *be, int *device, cudaStream_t *stream);

#endif
