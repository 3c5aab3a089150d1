/* kernels/cuda/cuda_ops.cu for the emulator: the shim first (it defines
 * __CUDA_ARCH__, so kernels/elem.h takes its device branch), then the
 * kernel source with its launches rewritten at build time
 * (chevrons.cmake). */
#include "tests/cuda_emu/cuda_runtime.h"

#include "cuda_ops.cu.cc"
