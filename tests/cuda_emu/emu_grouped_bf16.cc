/* kernels/cuda/cuda_grouped_bf16.cu for the emulator, its <mma.h> and
 * <cuda_bf16.h> the shims in this folder (see mma.h). */
#include "tests/cuda_emu/cuda_runtime.h"

#include "cuda_grouped_bf16.cu.cc"
