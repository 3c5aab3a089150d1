/* The masks of DESIGN.md section 6 on the device (private to kernels/cuda;
 * included inside a .cu file's unnamed namespace, like cuda_reduce.cuh).
 * attn_range is the twin of nl_cpu_attn_range (kernels/cpu/cpu_ops.h): the
 * CPU and CUDA kernels walk the same key ranges, so a local layer costs
 * O(T W) on both. */
#ifndef NL_CUDA_MASK_CUH
#define NL_CUDA_MASK_CUH

/* Keys [lo, hi) of the first nkeys that the query at absolute position i
 * may see: causal (i - W, i] or 0 .. i, bidirectional abs(i - j) <= W / 2
 * or all. Packed documents narrow this further, key by key (attn_doc_ok). */
__host__ __device__ __forceinline__ void attn_range(const nl_attn_mask &mk, int i, int nkeys,
                                                    int &lo, int &hi)
{
    const int W = mk.window;
    if (!mk.bidir) {
        lo = W > 0 ? i - W + 1 : 0;
        hi = i + 1;
    } else {
        lo = W > 0 ? i - W / 2 : 0;
        hi = W > 0 ? i + W / 2 + 1 : nkeys;
    }
    lo = lo < 0 ? 0 : lo;
    hi = hi > nkeys ? nkeys : hi;
}

/* The inverse without a cache (past == 0, T keys): queries [lo, hi) whose
 * range holds some key of [j0, j1), j0 < j1. */
__host__ __device__ __forceinline__ void attn_query_range(const nl_attn_mask &mk, int j0, int j1,
                                                          int T, int &lo, int &hi)
{
    const int W = mk.window;
    if (!mk.bidir) { /* i - W < j <= i: i in [j, j + W - 1] */
        lo = j0;
        hi = W > 0 ? j1 + W - 1 : T;
    } else { /* abs(i - j) <= W / 2 */
        lo = W > 0 ? j0 - W / 2 : 0;
        hi = W > 0 ? j1 + W / 2 : T;
    }
    lo = lo < 0 ? 0 : lo;
    hi = hi > T ? T : hi;
}

/* A mask the kernels can run: a non-negative window, and documents only
 * without a cache (positions restart per document in one row). */
__host__ __forceinline__ bool attn_mask_ok(const nl_attn_mask &mk, const nl_attn_shape &s)
{
    return mk.window >= 0 && (!mk.doc || s.past == 0);
}

#endif
