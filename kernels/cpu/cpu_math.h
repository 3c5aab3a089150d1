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
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    /* n = round(x / ln2), r = x - n ln2 */
    float fn = x * 1.44269504088896341f + (x >= 0.0f ? 0.5f : -0.5f);
    int32_t n = (int32_t)fn;
    float r = x - (float)n * 0.693359375f;
    r -= (float)n * -2.12194440e-4f;
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
