/* kernels/cuda/cuda_mixed.cu for the emulator (see emu_cuda_ops.cc). */
#include "tests/cuda_emu/cuda_runtime.h"

#include "cuda_mixed.cu.cc"
