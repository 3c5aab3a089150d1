/* The CPU backend's row-invariant GEMM (the gemm_rows slot, backend.h):
 * with B transposed (the model's y = x W^T) the dot-product kernel of
 * cpu_dot.c, which computes every row the same way at every M and, unlike
 * the primitive below, costs what dnnl_sgemm costs at a decode's few rows;
 * otherwise oneDNN's matmul primitive, whose f32 kernel (brgemm on AVX-512 and
 * AVX2) computes every row of C the same way for any number of rows M,
 * where dnnl_sgemm takes other paths (another summation order) for M
 * from 1 to 15 than at M >= 16. tests/test_batch.c checks this row by
 * row for every M from 1 to 20 and more, and core/model/batch.c relies on it
 * for batch invariance.
 *
 * A primitive is made for one shape (M, N, K, strides, accumulate, the
 * thread count), so the context keeps them in a table of CACHE slots,
 * indexed by a hash of the shape (a shape whose slot is taken replaces
 * the one there), and reuses each with new data pointers. A server's
 * batch meets a few hundred shapes (6 or so GEMMs times every row count
 * up to its rows). Building a primitive costs about 150 us the first time
 * and about 5 us again (oneDNN keeps its own cache of 1024). */
#include "kernels/cpu/cpu_ops.h"

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#define CACHE 1024 /* a power of two */

typedef struct mm_key {
    int trans_b, M, N, K, lda, ldb, ldc, accumulate, threads;
} mm_key;

typedef struct mm_entry {
    mm_key key;
    dnnl_primitive_t prim; /* NULL: the slot is free */
    dnnl_memory_t src, wei, dst;
} mm_entry;

struct nl_cpu_matmul {
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    mm_entry e[CACHE];
};

static void entry_clear(mm_entry *x)
{
    if (x->prim)
        dnnl_primitive_destroy(x->prim);
    if (x->src)
        dnnl_memory_destroy(x->src);
    if (x->wei)
        dnnl_memory_destroy(x->wei);
    if (x->dst)
        dnnl_memory_destroy(x->dst);
    memset(x, 0, sizeof *x);
}

void nl_cpu_matmul_free(nl_backend *be)
{
    nl_cpu_ctx *ctx = be->ctx;
    struct nl_cpu_matmul *mm = ctx->matmul;
    if (!mm)
        return;
    for (int i = 0; i < CACHE; i++)
        entry_clear(&mm->e[i]);
    if (mm->stream)
        dnnl_stream_destroy(mm->stream);
    if (mm->engine)
        dnnl_engine_destroy(mm->engine);
    free(mm);
    ctx->matmul = NULL;
}

/* The primitive for key k and its three memory objects (data handles
 * set per call), into x; dnnl_success or the first failure. */
static dnnl_status_t entry_make(struct nl_cpu_matmul *mm, mm_entry *x, const mm_key *k)
{
    dnnl_memory_desc_t src, wei, dst;
    const dnnl_dims_t sd = {k->M, k->K}, wd = {k->K, k->N}, dd = {k->M, k->N};
    const dnnl_dims_t ss = {k->lda, 1}, ds = {k->ldc, 1};
    dnnl_dims_t ws = {k->ldb, 1}; /* B (K, N) row-major */
    if (k->trans_b) {             /* B given as (N, K) row-major: weights (K, N) column-major */
        ws[0] = 1;
        ws[1] = k->ldb;
    }
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_matmul_desc_t md;
    dnnl_status_t s;
    if ((s = dnnl_memory_desc_init_by_strides(&src, 2, sd, dnnl_f32, ss)) ||
        (s = dnnl_memory_desc_init_by_strides(&wei, 2, wd, dnnl_f32, ws)) ||
        (s = dnnl_memory_desc_init_by_strides(&dst, 2, dd, dnnl_f32, ds)) ||
        (s = dnnl_matmul_desc_init(&md, &src, &wei, NULL, &dst)) ||
        (s = dnnl_primitive_attr_create(&attr)))
        return s;
    if (k->accumulate && /* C += A B: the sum post-op adds C's old value */
        ((s = dnnl_post_ops_create(&po)) || (s = dnnl_post_ops_append_sum(po, 1.0f)) ||
         (s = dnnl_primitive_attr_set_post_ops(attr, po))))
        goto out;
    if ((s = dnnl_primitive_desc_create(&pd, &md, attr, mm->engine, NULL)) ||
        (s = dnnl_primitive_create(&x->prim, pd)) ||
        (s = dnnl_memory_create(&x->src, &src, mm->engine, DNNL_MEMORY_NONE)) ||
        (s = dnnl_memory_create(&x->wei, &wei, mm->engine, DNNL_MEMORY_NONE)) ||
        (s = dnnl_memory_create(&x->dst, &dst, mm->engine, DNNL_MEMORY_NONE)))
        goto out;
    x->key = *k;
out:
    if (s != dnnl_success)
        entry_clear(x);
    dnnl_primitive_desc_destroy(pd);
    dnnl_post_ops_destroy(po);
    dnnl_primitive_attr_destroy(attr);
    return s;
}

/* The cached entry for k, made if need be; NULL when oneDNN fails. */
static mm_entry *entry_get(nl_backend *be, const mm_key *k)
{
    nl_cpu_ctx *ctx = be->ctx;
    struct nl_cpu_matmul *mm = ctx->matmul;
    if (!mm) {
        mm = calloc(1, sizeof *mm);
        if (!mm)
            return NULL;
        if (dnnl_engine_create(&mm->engine, dnnl_cpu, 0) != dnnl_success ||
            dnnl_stream_create(&mm->stream, mm->engine, dnnl_stream_default_flags) !=
                dnnl_success) {
            if (mm->engine)
                dnnl_engine_destroy(mm->engine);
            free(mm);
            return NULL;
        }
        ctx->matmul = mm;
    }
    const int w[] = {k->trans_b, k->M,   k->N,          k->K,      k->lda,
                     k->ldb,     k->ldc, k->accumulate, k->threads};
    uint32_t h = 2166136261u; /* FNV-1a over the key's fields */
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
        h = (h ^ (uint32_t)w[i]) * 16777619u;
    mm_entry *x = &mm->e[h & (CACHE - 1)];
    if (x->prim && !memcmp(&x->key, k, sizeof *k))
        return x;
    entry_clear(x);
    return entry_make(mm, x, k) == dnnl_success ? x : NULL;
}

void nl_cpu_gemm_rows(nl_backend *be, int trans_b, int M, int N, int K, const float *A, int lda,
                      const float *B, int ldb, int accumulate, float *C, int ldc)
{
    if (M <= 0 || N <= 0)
        return;
    if (trans_b) { /* the model's products: the dot-product kernel at every M */
        nl_cpu_gemm_dot(be, M, N, K, A, lda, B, ldb, accumulate, C, ldc);
        return;
    }
    /* as in cpu_gemm: oneDNN sizes its team (and a primitive its
     * blocking) by omp_get_max_threads(); this backend's count, for the
     * call only */
    const int want = nl_cpu_threads(be), had = omp_get_max_threads();
    if (want != had)
        omp_set_num_threads(want);
    const mm_key k = {trans_b != 0, M, N, K, lda, ldb, ldc, accumulate != 0, want};
    mm_entry *x = K > 0 ? entry_get(be, &k) : NULL;
    int done = 0;
    if (x) {
        struct nl_cpu_matmul *mm = ((nl_cpu_ctx *)be->ctx)->matmul;
        dnnl_memory_set_data_handle(x->src, (void *)A);
        dnnl_memory_set_data_handle(x->wei, (void *)B);
        dnnl_memory_set_data_handle(x->dst, C);
        const dnnl_exec_arg_t args[] = {
            {DNNL_ARG_SRC, x->src}, {DNNL_ARG_WEIGHTS, x->wei}, {DNNL_ARG_DST, x->dst}};
        done = dnnl_primitive_execute(x->prim, mm->stream, 3, args) == dnnl_success &&
               dnnl_stream_wait(mm->stream) == dnnl_success;
    }
    if (want != had)
        omp_set_num_threads(had);
    /* K == 0, or oneDNN could not make or run the primitive (out of
     * memory): the ordinary GEMM gives the right values, without the
     * row invariance */
    if (!done)
        be->gemm(be, 0, trans_b, M, N, K, 1.0f, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C, ldc);
}
