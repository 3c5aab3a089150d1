/* The WMMA subset of CUDA's <mma.h> that cuda_grouped_bf16.cu uses, for
 * the CPU emulation (tests/cuda_emu): fragments of 16 x 16 x 16 with bf16
 * (or float) inputs and float accumulators, fill, load, store and
 * multiply-accumulate.
 *
 * On a GPU a fragment's elements are spread over the warp's lanes in a
 * layout CUDA leaves unspecified; a kernel that only loads, multiplies and
 * stores whole fragments (as ours does) cannot tell. Here every lane holds
 * the whole tile and does the whole product, so each lane's result is the
 * warp's. What this checks: the kernel's tiling, its shared-memory layouts
 * and leading dimensions, its row-major/col-major choices, its bounds and
 * barriers, and WMMA's alignment rules (load and store pointers 32-byte
 * aligned, ldm a multiple of 16 bytes: checked on every call). What it
 * cannot: the tensor cores' own rounding
 * (products of bf16 are exact in float; the sum here is sequential FMAs in
 * k order). */
#ifndef NL_EMU_MMA_H
#define NL_EMU_MMA_H

#include "tests/cuda_emu/cuda_bf16.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <type_traits>

namespace nvcuda
{
namespace wmma
{

struct row_major {
};
struct col_major {
};
struct matrix_a {
};
struct matrix_b {
};
struct accumulator {
};
enum layout_t { mem_row_major, mem_col_major };

inline float emu_value(float v)
{
    return v;
}
inline float emu_value(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}

template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
    static constexpr int R = std::is_same<Use, matrix_b>::value ? K : M;
    static constexpr int C = std::is_same<Use, matrix_a>::value ? K : N;
    static constexpr int num_elements = R * C;
    float x[R * C]; /* (r, c) at x[r * C + c], as float */
};

template <class Use, int M, int N, int K, class T, class L>
inline void fill_fragment(fragment<Use, M, N, K, T, L> &f, float v)
{
    for (int i = 0; i < f.num_elements; i++)
        f.x[i] = v;
}

/* WMMA's rules, checked in every build (not an assert: tests run with
 * NDEBUG): a broken one ends the test with a message. */
inline void emu_check_ptr(const void *p, unsigned ldm, size_t elem)
{
    if (((uintptr_t)p & 31) != 0 || (ldm * elem) % 16 != 0) {
        fprintf(stderr,
                "cuda_emu: wmma: pointer %p (must be 32-byte aligned) or ldm %u (must "
                "be a multiple of 16 bytes) breaks WMMA's rules\n",
                p, ldm);
        abort();
    }
}

template <class Use, int M, int N, int K, class T, class L, class P>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L> &f, const P *p, unsigned ldm)
{
    emu_check_ptr(p, ldm, sizeof(P));
    typedef fragment<Use, M, N, K, T, L> F;
    for (int r = 0; r < F::R; r++)
        for (int c = 0; c < F::C; c++)
            f.x[r * F::C + c] =
                emu_value(std::is_same<L, row_major>::value ? p[(size_t)r * ldm + c]
                                                            : p[r + (size_t)c * ldm]);
}

template <int M, int N, int K>
inline void store_matrix_sync(float *p, const fragment<accumulator, M, N, K, float, void> &f,
                              unsigned ldm, layout_t layout)
{
    emu_check_ptr(p, ldm, sizeof(float));
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++)
            (layout == mem_row_major ? p[(size_t)r * ldm + c] : p[r + (size_t)c * ldm]) =
                f.x[r * N + c];
}

template <int M, int N, int K, class TA, class LA, class TB, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float, void> &d,
                     const fragment<matrix_a, M, N, K, TA, LA> &a,
                     const fragment<matrix_b, M, N, K, TB, LB> &b,
                     const fragment<accumulator, M, N, K, float, void> &c)
{
    float out[M * N];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float s = c.x[i * N + j];
            for (int k = 0; k < K; k++)
                s = fmaf(a.x[i * K + k], b.x[k * N + j], s);
            out[i * N + j] = s;
        }
    for (int i = 0; i < M * N; i++)
        d.x[i] = out[i];
}

} // namespace wmma
} // namespace nvcuda

#endif
