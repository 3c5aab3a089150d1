/* Private to kernels/cuda: the device half of the grouped GEMMs' tile map
 * (cuda_mixed.h). Included by cuda_mixed.cu and cuda_grouped_bf16.cu, and
 * compiled on the host by the tests (NL_HD). */
#ifndef NL_CUDA_MIXED_CUH
#define NL_CUDA_MIXED_CUH

#include "kernels/elem.h"

#include <stdint.h>

/* The group of row tile t (0 <= t < tile_start[groups]): the largest g <
 * groups with tile_start[g] <= t. tile_start never decreases, and an empty
 * group's number equals the next one's, so the search passes over it. */
NL_HD int nl_cuda_tile_lookup(const int32_t *tile_start, int groups, int t)
{
    int lo = 0, hi = groups - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

#endif
