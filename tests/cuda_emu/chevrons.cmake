# Build-time step of test_cuda_emu: copy a CUDA source with its kernel
# launches made plain C++ for the host compiler and the shim
# (cuda_runtime.h):  k<<<grid, block, smem, stream>>>(args)  becomes
# k | emu_cfg(grid, block, smem, stream)(args). Nothing else changes, and
# a #line directive keeps the original file name and line numbers in
# compiler messages, sanitizer reports and the emulator's barrier lines.
#   cmake -DIN=<file.cu> -DOUT=<file> -P chevrons.cmake
file(READ "${IN}" src)
string(REGEX MATCHALL "<<<" opens "${src}")
string(REGEX MATCHALL ">>>" closes "${src}")
list(LENGTH opens n_open)
list(LENGTH closes n_close)
if(n_open EQUAL 0 OR NOT n_open EQUAL n_close)
  message(FATAL_ERROR "${IN}: ${n_open} '<<<' and ${n_close} '>>>': not a set of kernel launches")
endif()
string(REPLACE "<<<" "| emu_cfg(" src "${src}")
string(REPLACE ">>>" ")" src "${src}")
file(WRITE "${OUT}.tmp" "#line 1 \"${IN}\"\n${src}")
file(RENAME "${OUT}.tmp" "${OUT}")
