/* The part of CUDA's <cuda_bf16.h> the bf16 kernels use, for the CPU
 * emulation (tests/cuda_emu): the storage type and bit casts. The kernels
 * round with nl_elem_to_bf16 (kernels/elem.h), never with CUDA's
 * conversions, so nothing else is needed. */
#ifndef NL_EMU_CUDA_BF16_H
#define NL_EMU_CUDA_BF16_H

#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    uint16_t x;
};

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u)
{
    __nv_bfloat16 h;
    h.x = u;
    return h;
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h)
{
    return h.x;
}

inline float __bfloat162float(__nv_bfloat16 h)
{
    const uint32_t u = (uint32_t)h.x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
