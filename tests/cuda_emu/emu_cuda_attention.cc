/* kernels/cuda/cuda_attention.cu for the emulator (see emu_cuda_ops.cc). */
#include "cuda_runtime.h"

#include "cuda_attention.cu.cc"
