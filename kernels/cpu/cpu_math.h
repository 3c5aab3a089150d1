/* Vectorisable float math for the CPU kernels. nl_expf (the exp that the
 * hot loops call, since gcc does not vectorise loops calling expf without
 * -ffast-math) now lives in kernels/elem.h with the other per-element
 * formulas both backends share; this header remains for the CPU files. */
#ifndef NL_CPU_MATH_H
#define NL_CPU_MATH_H

#include "kernels/elem.h"

#endif
