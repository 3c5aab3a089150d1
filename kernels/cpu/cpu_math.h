/* Vectorisable float math for the CPU kernels. GCC does not vectorise
 * loops that call expf() without -ffast-math, so the hot loops use this
 * exp: range reduction by ln 2 in two parts and a degree-6 polynomial
 * (Cephes coefficients), accurate to about 2 ulp over [-87, 88], with
 * exp(-inf) = 0 and large inputs clamped. */
#ifndef NL_CPU_MATH_H
#define NL_CPU_MATH_H

#include <stdint.h>
#include <string.h>

static inline float nl_expf(float x)
{
    /* branch-free so that loops calling it vectorise: clamp by selects,
     * round to nearest with the 1.5 * 2^23 shifter */
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23 */
    float t = x * 1.44269504088896341f + shifter;
    int32_t tb;
    memcpy(&tb, &t, sizeof tb);
    const int32_t n = tb - 0x4B400000; /* the bits of the shifter */
    const float fn = t - shifter;
    float r = x - fn * 0.693359375f;
    r -= fn * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
