/* Vectorisable float math for the CPU kernels. nl_expf (the exp that the
 * hot loops call, since gcc does not vectorise loops calling expf without
 * -ffast-math) now lives in kernels/elem.h with the other per-element
 * formulas both backends share; this header remains for the CPU files. */
#ifndef NL_CPU_MATH_H
#define NL_CPU_MATH_H

#include "kernels/elem.h"

#include <stddef.h>

/* NL_HOT marks the innermost loops of the GEMM and of attention (forward
 * and backward). Under AddressSanitizer (the NL_SANITIZE build, the
 * libFuzzer build) the sanitizers would check their every load and store,
 * and keep them from vectorising: half the sanitized tests' time went
 * there. So these functions are left uninstrumented (ASan and UBSan both),
 * and each checks instead, with nl_hot_rows, every row of memory it reads
 * or writes outside its own stack tiles: one check per row where the
 * instrumentation checks every element, reported as ASan reports any bad
 * access. The stack tiles, of fixed size, go unchecked: their indices are
 * bounded by QT, KT and HD_MAX, and the slots refuse a head dimension above
 * HD_MAX. UBSan's checks of their index arithmetic are lost. The inline
 * helpers they call (nl_elem_expf, ...) are not inlined into them in such a
 * build (the sanitizer attributes differ) and stay instrumented. Without
 * ASan both are no-ops. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NL_HOT_CHECKED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define NL_HOT_CHECKED 1
#endif

#ifdef NL_HOT_CHECKED
#include <sanitizer/asan_interface.h>

#define NL_HOT __attribute__((no_sanitize("address", "undefined")))

/* rows rows of `bytes` bytes each, `stride` bytes apart from p, are all
 * addressable; else ASan's report on the first bad byte (is_write: the
 * caller stores there) and the end of the process */
__attribute__((noinline, unused)) static void nl_hot_rows(const void *p, size_t rows, size_t stride,
                                                          size_t bytes, int is_write)
{
    for (size_t r = 0; r < rows; r++) {
        void *row = (char *)(uintptr_t)p + r * stride;
        void *bad = __asan_region_is_poisoned(row, bytes);
        if (bad)
            __asan_report_error(__builtin_return_address(0), __builtin_frame_address(0),
                                __builtin_frame_address(0), bad, is_write, bytes);
    }
}
#else
#define NL_HOT
static inline void nl_hot_rows(const void *p, size_t rows, size_t stride, size_t bytes,
                               int is_write)
{
    (void)p, (void)rows, (void)stride, (void)bytes, (void)is_write;
}
#endif

#endif
