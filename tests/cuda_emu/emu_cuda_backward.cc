/* kernels/cuda/cuda_backward.cu for the emulator (see emu_cuda_ops.cc). */
#include "tests/cuda_emu/cuda_runtime.h"

#include "cuda_backward.cu.cc"
