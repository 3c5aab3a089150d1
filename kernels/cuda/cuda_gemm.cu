/* The CUDA backend's GEMM slots (the private context: cuda_backend_impl.h):
 * the FP32/TF32 GEMM through cuBLAS, the bf16 GEMM through cuBLASLt with
 * its descriptor cache and the bf16 weight copies, and the grouped expert
 * GEMMs (one-launch kernels, per expert through cuBLASLt for the
 * forward's many rows, or through cuDNN's MoE grouped matmul). */
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_gemm_plan.h"
#include "kernels/cuda/cuda_moe.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_rows.h"

#include <string.h>

static_assert(NL_CUDA_ROWS_GEMM == NL_BACKEND_FUSED_ROWS,
              "a decode's rows: gemm's rows kernel where the fused slots serve");
static_assert(NL_CUDA_GROUPED_FEW_ROWS == NL_CUDA_ROWS_GEMM - 1,
              "the grouped GEMMs' rows kernel below as many rows as gemm's");

namespace nl_cu
{

/* ---------------------------------------------------------------- gemm */

void gemm_bf16(cuda_ctx *c, int ta, int tb, int M, int N, int K, float alpha, const float *A,
               int lda, const float *B, int ldb, float beta, float *C, int ldc, bool bucket);

/* ---------------------------------------------------------------- gemm_rows
 *
 * The row-invariant GEMM (cuda_rows.h). In bf16 mode its products are
 * bf16 x bf16 in FP32 as gemm's are: with trans_b, a B inside a weight
 * range is read from its bf16 copy (half the bytes; made again first when
 * stale), any other operand rounded as it is read; the bits are the same
 * either way. */
void rows_product(cuda_ctx *c, int trans_b, int M, int N, int K, const float *A, int lda,
                  const float *B, int ldb, int accumulate, float *C, int ldc)
{
    if (c->bf16 && trans_b && M > 0 && N > 0 && K > 0) {
        int rc = 0;
        const uint16_t *w = nl_cuda_bf16_weight_operand(&c->w, c->stream, B, N, K, ldb, &rc);
        launched(c, "gemm_rows (bf16): weight copy", rc);
        if (w) {
            launched_shape(
                c, nl_cuda_gemm_rows_bf16(c->stream, M, N, K, A, lda, w, ldb, accumulate, C, ldc),
                "gemm_rows (bf16) (M %d N %d K %d)", M, N, K);
            return;
        }
    }
    launched_shape(
        c,
        nl_cuda_gemm_rows(c->stream, trans_b, M, N, K, A, lda, B, ldb, accumulate, C, ldc, c->bf16),
        "gemm_rows (M %d N %d K %d trans_b %d lda %d ldb %d ldc %d)", M, N, K, trans_b, lda, ldb,
        ldc);
}

void cu_gemm_rows(nl_backend *be, int trans_b, int M, int N, int K, const float *A, int lda,
                  const float *B, int ldb, int accumulate, float *C, int ldc)
{
    rows_product(enter_slot(be, __func__), trans_b, M, N, K, A, lda, B, ldb, accumulate, C, ldc);
}

/* Row-major C = alpha op(A) op(B) + beta C. cuBLAS is column-major, and a
 * row-major matrix with row stride ld is its transpose in column-major
 * with leading dimension ld, so compute C^T = op(B)^T op(A)^T: cuBLAS's
 * (m, n, k) = (N, M, K) with B first. */
void gemm_in_slot(cuda_ctx *c, int trans_a, int trans_b, int M, int N, int K, float alpha,
                  const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc,
                  bool bucket)
{
    if (M <= 0 || N <= 0)
        return;
    /* a decode's few rows of y = x W^T: gemm_rows' kernel, faster than
     * cuBLAS at one to a few rows and row invariant, so `neuroctl
     * generate` gets the bits of a stage's batch (whose products all run
     * through gemm_rows) */
    if (nl_cuda_gemm_takes_rows(trans_a, trans_b, M, K, alpha, beta) && !c->rows_off) {
        rows_product(c, 1, M, N, K, A, lda, B, ldb, beta != 0.0f, C, ldc);
        return;
    }
    if (K <= 0) {
        /* an empty product: only scale C, 0 for beta == 0 even over NaN */
        launched(c, "gemm", nl_cuda_scale_rows(c->stream, C, ldc, M, N, beta));
        return;
    }
    if (c->bf16) {
        gemm_bf16(c, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bucket);
        return;
    }
    const cublasStatus_t s = cublasSgemm(c->cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B,
                                         ldb, A, lda, &beta, C, ldc);
    if (s != CUBLAS_STATUS_SUCCESS)
        fail(c, NL_ERR_INTERNAL, "%s: gemm: cublasSgemm (M %d N %d K %d lda %d ldb %d ldc %d): %s",
             c->name, M, N, K, lda, ldb, ldc, cublasGetStatusString(s));
}

void cu_gemm(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
             const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    gemm_in_slot(enter_slot(be, __func__), trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta,
                 C, ldc, false);
}

/* ---------------------------------------------------------------- bf16 gemm
 *
 * be->bf16: C (FP32) = alpha op(A) op(B) + beta C with A and B in bf16 and
 * FP32 accumulation, through cuBLASLt (CUBLAS_COMPUTE_32F, bf16 A/B, FP32
 * C/D). An operand inside a weight range is read from its bf16 copy (made
 * again first when stale); any other is converted into the backend's
 * scratch, the GEMM cut into pieces that fit it (cuda_gemm_plan.h). The
 * descriptors, layouts and the heuristic's algorithm are cached per shape,
 * strides and operand alignment; cuBLASLt uses the backend's cuBLAS
 * workspace (the one stream orders the two libraries' use of it). Where
 * cuBLASLt offers no algorithm, cublasGemmEx computes the same thing. */

/* The alignment of p in bytes for cuBLASLt's preference, at most 16 (its
 * kernels' widest vector access): the preference is a guaranteed minimum,
 * and capping it keeps the cache's keys few (operands at different offsets
 * of the weights share an entry). */
unsigned align_of(const void *p)
{
    const uintptr_t u = (uintptr_t)p;
    unsigned a = 1;
    while (a < 16 && !(u & a))
        a <<= 1;
    return a;
}

void lt_entry_free(lt_entry *e)
{
    if (!e->used)
        return;
    if (e->la)
        cublasLtMatrixLayoutDestroy(e->la);
    if (e->lb)
        cublasLtMatrixLayoutDestroy(e->lb);
    if (e->lc)
        cublasLtMatrixLayoutDestroy(e->lc);
    if (e->op)
        cublasLtMatmulDescDestroy(e->op);
    memset(e, 0, sizeof *e);
}

/* The entry to make a new one in: a free one, else the least recently
 * used (a step's dense shapes stay while per-expert shapes come and go). */
lt_entry *lt_victim(cuda_ctx *c)
{
    lt_entry *v = &c->lt_cache[0];
    for (int i = 0; i < NL_CUDA_LT_CACHE; i++) {
        lt_entry *e = &c->lt_cache[i];
        if (!e->used)
            return e;
        if (e->last_use < v->last_use)
            v = e;
    }
    return v;
}

lt_entry *lt_make(cuda_ctx *c, int ta, int tb, int M, int N, int K, int lda, int ldb, int ldc,
                  unsigned aa, unsigned ab, unsigned ac, bool bucket);

/* The cached entry for this call, made (descriptors and heuristic) on a
 * miss; NULL with the error kept when cuBLASLt fails. bucket: the entry
 * of a bucket of row counts, M the bucket's (lt_gemm). */
lt_entry *lt_lookup(cuda_ctx *c, int ta, int tb, int M, int N, int K, int lda, int ldb, int ldc,
                    unsigned aa, unsigned ab, unsigned ac, bool bucket)
{
    c->lt_clock++;
    for (int i = 0; i < NL_CUDA_LT_CACHE; i++) {
        lt_entry *e = &c->lt_cache[i];
        if (e->used && e->ta == ta && e->tb == tb && e->M == M && e->N == N && e->K == K &&
            e->lda == lda && e->ldb == ldb && e->ldc == ldc && e->align_a == aa &&
            e->align_b == ab && e->align_c == ac && e->bucket == bucket) {
            e->last_use = c->lt_clock;
            c->lt_hits++;
            return e;
        }
    }
    const double t0 = prof_now();
    lt_entry *e = lt_make(c, ta, tb, M, N, K, lda, ldb, ldc, aa, ab, ac, bucket);
    c->lt_misses++;
    c->lt_miss_s += prof_now() - t0;
    return e;
}

/* A new entry for the key (lt_lookup's), its descriptors and cuBLASLt's
 * choice of algorithm. */
lt_entry *lt_make(cuda_ctx *c, int ta, int tb, int M, int N, int K, int lda, int ldb, int ldc,
                  unsigned aa, unsigned ab, unsigned ac, bool bucket)
{
    lt_entry *e = lt_victim(c);
    lt_entry_free(e);
    e->used = true;
    e->bucket = bucket;
    e->last_use = c->lt_clock;
    e->ta = ta;
    e->tb = tb;
    e->M = M;
    e->N = N;
    e->K = K;
    e->lda = lda;
    e->ldb = ldb;
    e->ldc = ldc;
    e->align_a = aa;
    e->align_b = ab;
    e->align_c = ac;
    const nl_lt_plan p = nl_lt_plan_make(ta, tb, M, N, K, lda, ldb, ldc);
    const cublasOperation_t opa = p.a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t opb = p.b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulPreference_t pref = NULL;
    const uint64_t ws = c->workspace_bytes;
    /* cuBLASLt's A is our B and its B our A (cuda_gemm_plan.h) */
    const uint32_t al_a = ab, al_b = aa, al_c = ac;
    cublasLtMatmulHeuristicResult_t h;
    memset(&h, 0, sizeof h);
    int found = 0;
    cublasStatus_t s = cublasLtMatmulDescCreate(&e->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&e->la, CUDA_R_16BF, p.a.rows, p.a.cols, p.a.ld);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&e->lb, CUDA_R_16BF, p.b.rows, p.b.cols, p.b.ld);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&e->lc, CUDA_R_32F, p.c.rows, p.c.cols, p.c.ld);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceCreate(&pref);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                 &al_a, sizeof al_a);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                 &al_b, sizeof al_b);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                 &al_c, sizeof al_c);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                 &al_c, sizeof al_c);
    if (s == CUBLAS_STATUS_SUCCESS) {
        /* no algorithm is not an error: cublasGemmEx takes the call */
        const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(c->lt, e->op, e->la, e->lb, e->lc,
                                                                 e->lc, pref, 1, &h, &found);
        e->has_algo = hs == CUBLAS_STATUS_SUCCESS && found > 0;
        if (e->has_algo)
            e->algo = h.algo;
    }
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS) {
        lt_entry_free(e);
        fail(c, NL_ERR_INTERNAL, "%s: gemm (bf16): cuBLASLt descriptors (M %d N %d K %d): %s",
             c->name, M, N, K, cublasGetStatusString(s));
        return NULL;
    }
    return e;
}

/* A bucketed entry's layouts sized to this call (made at the bucket's
 * rows or depth: only columns differ, cuda_gemm_plan.h). */
cublasStatus_t lt_size(const lt_entry *e, const nl_lt_plan *p)
{
    const cublasLtMatrixLayout_t l[3] = {e->la, e->lb, e->lc};
    const nl_lt_matrix *m[3] = {&p->a, &p->b, &p->c};
    cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
    for (int i = 0; i < 3 && s == CUBLAS_STATUS_SUCCESS; i++) {
        s = cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_ROWS, &m[i]->rows,
                                             sizeof m[i]->rows);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_COLS, &m[i]->cols,
                                                 sizeof m[i]->cols);
    }
    return s;
}

/* The product with entry e: its cuBLASLt algorithm, or cublasGemmEx
 * where cuBLASLt offered none. */
cublasStatus_t lt_run(cuda_ctx *c, const lt_entry *e, int ta, int tb, int M, int N, int K,
                      float alpha, const uint16_t *A, int lda, const uint16_t *B, int ldb,
                      float beta, float *C, int ldc)
{
    if (e->has_algo)
        return cublasLtMatmul(c->lt, e->op, &alpha, B, e->la, A, e->lb, &beta, C, e->lc, C, e->lc,
                              &e->algo, c->workspace, c->workspace_bytes, c->stream);
    return cublasGemmEx(c->cublas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                        N, M, K, &alpha, B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C,
                        CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

/* One bf16 product on the stream: row-major C (M x N, FP32) = alpha op(A)
 * op(B) + beta C with A, B bf16 (row strides lda, ldb). bucket: with the
 * algorithm cuBLASLt chose for the bucket (nl_lt_bucket_rows) of the
 * expert's dimension, M where A is not transposed, K for a weight
 * gradient (A transposed, B not); where the bucket has no algorithm or
 * cuBLASLt refuses it for this call (before launching anything), with the
 * one it chooses for this call. */
void lt_gemm(cuda_ctx *c, int ta, int tb, int M, int N, int K, float alpha, const uint16_t *A,
             int lda, const uint16_t *B, int ldb, float beta, float *C, int ldc, bool bucket)
{
    const bool bm = bucket && !ta, bk = bucket && ta && !tb;
    const unsigned aa = align_of(A), ab = align_of(B), ac = align_of(C);
    lt_entry *e = lt_lookup(c, ta, tb, bm ? nl_lt_bucket_rows(M) : M, N,
                            bk ? nl_lt_bucket_rows(K) : K, lda, ldb, ldc, aa, ab, ac, bm || bk);
    if (!e)
        return;
    cublasStatus_t s = CUBLAS_STATUS_NOT_SUPPORTED;
    if (e->bucket) {
        const nl_lt_plan p = nl_lt_plan_make(ta, tb, M, N, K, lda, ldb, ldc);
        if (e->has_algo && (s = lt_size(e, &p)) == CUBLAS_STATUS_SUCCESS)
            s = lt_run(c, e, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        if (s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_INVALID_VALUE) {
            c->lt_refits++;
            if (!(e = lt_lookup(c, ta, tb, M, N, K, lda, ldb, ldc, aa, ab, ac, false)))
                return;
            s = lt_run(c, e, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        }
    } else {
        s = lt_run(c, e, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    }
    if (s != CUBLAS_STATUS_SUCCESS)
        fail(c, NL_ERR_INTERNAL,
             "%s: gemm (bf16): %s (M %d N %d K %d lda %d ldb %d ldc %d trans %d %d): %s", c->name,
             e->has_algo ? "cublasLtMatmul" : "cublasGemmEx", M, N, K, lda, ldb, ldc, ta, tb,
             cublasGetStatusString(s));
}

/* The bf16 form of the piece of an operand stored as rows x cols floats
 * at x (row stride ld): in a weight copy (*ld_out = ld) or converted into
 * the scratch at conv (*ld_out = cols). */
const uint16_t *bf16_piece(cuda_ctx *c, const uint16_t *weight, const float *base, const float *x,
                           int rows, int cols, int ld, uint16_t *conv, int *ld_out)
{
    if (weight) {
        *ld_out = ld;
        return weight + (x - base);
    }
    launched_shape(c, nl_cuda_to_bf16_rows(c->stream, conv, cols, x, ld, rows, cols),
                   "gemm (bf16): convert %d x %d (ld %d)", rows, cols, ld);
    *ld_out = cols;
    return conv;
}

/* what the pieces of one bf16 GEMM share */
struct bf16_call {
    cuda_ctx *c;
    int ta, tb, lda, ldb, ldc;
    float alpha, beta;
    const float *A, *B;
    float *C;
    const uint16_t *aw, *bw; /* weight copies at A, B; NULL: converted */
    const uint16_t *ap;      /* the current piece of A */
    int la;
    bool bucket; /* lt_gemm's */
};

/* B's converted piece starts this many elements (256 bytes) aligned after A's */
#define NL_CUDA_BF16_SLACK 128

void bf16_piece_gemm(void *arg, const nl_bf16_piece *pc)
{
    bf16_call *g = (bf16_call *)arg;
    cuda_ctx *c = g->c;
    if (pc->new_a) {
        const float *ax = g->ta ? g->A + (size_t)pc->k0 * g->lda + pc->m0
                                : g->A + (size_t)pc->m0 * g->lda + pc->k0;
        g->ap = bf16_piece(c, g->aw, g->A, ax, g->ta ? pc->k : pc->m, g->ta ? pc->m : pc->k, g->lda,
                           c->conv, &g->la);
    }
    const size_t a_used = g->aw ? 0
                                : ((size_t)pc->m * pc->k + NL_CUDA_BF16_SLACK - 1) /
                                      NL_CUDA_BF16_SLACK * NL_CUDA_BF16_SLACK;
    const float *bx =
        g->tb ? g->B + (size_t)pc->n0 * g->ldb + pc->k0 : g->B + (size_t)pc->k0 * g->ldb + pc->n0;
    int lb = 0;
    const uint16_t *bp = bf16_piece(c, g->bw, g->B, bx, g->tb ? pc->n : pc->k,
                                    g->tb ? pc->k : pc->n, g->ldb, c->conv + a_used, &lb);
    lt_gemm(c, g->ta, g->tb, pc->m, pc->n, pc->k, g->alpha, g->ap, g->la, bp, lb,
            pc->first_k ? g->beta : 1.0f, g->C + (size_t)pc->m0 * g->ldc + pc->n0, g->ldc,
            g->bucket);
}

void gemm_bf16(cuda_ctx *c, int ta, int tb, int M, int N, int K, float alpha, const float *A,
               int lda, const float *B, int ldb, float beta, float *C, int ldc, bool bucket)
{
    int rc = 0;
    bf16_call g = {c, ta, tb, lda, ldb, ldc, alpha, beta, A, B, C, NULL, NULL, NULL, 0, bucket};
    g.aw = nl_cuda_bf16_weight_operand(&c->w, c->stream, A, ta ? K : M, ta ? M : K, lda, &rc);
    launched(c, "gemm (bf16): weight copy", rc);
    g.bw = nl_cuda_bf16_weight_operand(&c->w, c->stream, B, tb ? N : K, tb ? K : N, ldb, &rc);
    launched(c, "gemm (bf16): weight copy", rc);
    int mc, nc, kc;
    nl_bf16_chunks(M, N, K, !g.aw, !g.bw, NL_CUDA_BF16_CONV_ELEMS - NL_CUDA_BF16_SLACK, &mc, &nc,
                   &kc);
    nl_bf16_for_pieces(M, N, K, mc, nc, kc, bf16_piece_gemm, &g);
}

/* bf16_weights: one range per call (core/model/model.c registers a model's
 * parameters as one); the copy is counted in mem_stats like any alloc. */
nl_status cu_bf16_weights(nl_backend *be, const float *p, size_t n, nl_error *err)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (refused_in_capture(c, "bf16_weights"))
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: bf16 weights while capturing", c->name);
    nl_cuda_bf16_range *r = nl_cuda_bf16_find_base(&c->w, p);
    c->w.epoch++; /* recordings that read the old copies are not replayed */
    if (r) {      /* forget (n == 0) or size again */
        be->free(be, r->copy);
        memset(r, 0, sizeof *r);
    }
    if (n == 0 || !p)
        return NL_OK;
    r = nl_cuda_bf16_free_entry(&c->w);
    if (!r)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: bf16 weights: more than %d weight ranges",
                            c->name, NL_CUDA_BF16_RANGES);
    uint16_t *copy = (uint16_t *)be->alloc(be, n * sizeof *copy);
    if (!copy)
        return nl_error_set(err, NL_ERR_NOMEM,
                            "%s: bf16 weights: cannot allocate a copy of %zu weights (%.1f MiB)",
                            c->name, n, (double)(n * sizeof *copy) / (1 << 20));
    *r = (nl_cuda_bf16_range){p, n, copy, 1};
    return NL_OK;
}

void cu_wrote(nl_backend *be, const void *p, size_t bytes)
{
    cuda_ctx *c = ctx_of(be);
    if (c->bf16)
        nl_cuda_bf16_mark(&c->w, p, bytes);
}

/* The bf16 grouped GEMMs of many rows (prefill, training) run as one
 * cuBLASLt GEMM per expert, sized by the offsets read to the host once per
 * routing (one wait per layer's dispatch, shared by its calls), forward
 * (trans_b, the weights as stored), dgrad and wgrad alike, each expert's
 * rows taking the algorithm of their bucket (nl_lt_bucket_rows): a
 * routing gives every expert a new row count each step of training, and
 * without buckets each was a new problem whose heuristic ran on the host
 * with the device idle. On an H200 (bench-large, T 1024, training
 * tokens/s; bench/gpu_check.sh's train_ab, 2026-11-28): this 165.8K;
 * the forward alone per expert, bucketed 79.4K, not 56.4K
 * (NL_CUDA_EXPERTS=forward, the default until then; NL_CUDA_LT_BUCKET=0);
 * the one-launch kernel for every call 68.4K (NL_CUDA_EXPERTS=kernel,
 * whose forward is 245K tokens/s against 702K); cuDNN's MoE grouped
 * matmul 75.6K (NL_CUDA_EXPERTS=cudnn: the many-row calls, forward and
 * dgrad, offered to cuDNN, which reads the offsets on the device,
 * cuda_gemm_dnn.cu; what it declines takes the one-launch kernel, never
 * a host wait). Dispatches of fewer rows than c->host_rows (decode, a
 * serve step of many sessions, a short prompt chunk) keep the one-launch
 * kernels: no host wait, so the step can be captured in a CUDA graph. The
 * default, 256 rows (NL_CUDA_GROUPED_HOST_ROWS; 64 until 2026-11-28, when
 * a serve step of 64 sessions or of a 64-row prompt chunk took the host's
 * wait at every layer and ran uncaptured), leaves each expert under 64
 * rows on average (top-2 of 8) below it, where a per-expert GEMM is a
 * launch of little work; not yet measured on a GPU. */

/* The offsets at dev on the host (checked: 0 first, never decreasing,
 * each group at most max_rows), or NULL after a failure (sticky) or
 * while the stream is captured (graph_end then fails). */
const int32_t *host_offsets(nl_backend *be, cuda_ctx *c, const int32_t *dev, int groups,
                            int max_rows)
{
    if (refused_in_capture(c, "grouped gemm's host offsets")) /* a read waits for the stream */
        return NULL;
    if (groups < 1 || groups > NL_BACKEND_MAX_EXPERTS) {
        fail(c, NL_ERR_INTERNAL, "%s: grouped gemm: %d groups", c->name, groups);
        return NULL;
    }
    if (c->off_ptr != dev || c->off_groups != groups) {
        cu_download(be, c->off_host, dev, (size_t)(groups + 1) * sizeof(int32_t));
        if (c->sticky != NL_OK)
            return NULL;
        c->off_ptr = dev;
        c->off_groups = groups;
    }
    const int32_t *o = c->off_host;
    for (int g = 0; g < groups; g++)
        if (o[0] != 0 || o[g + 1] < o[g] || o[g + 1] - o[g] > max_rows) {
            c->off_ptr = NULL;
            fail(c, NL_ERR_INTERNAL, "%s: grouped gemm: group %d has rows %d..%d (at most %d)",
                 c->name, g, o[g], o[g + 1], max_rows);
            return NULL;
        }
    return o;
}

/* bf16 decode (few rows per expert): one warp per output column reading
 * the experts' bf16 copy, half the bytes of the FP32 weights the
 * tensor-core kernel reads (cuda_moe.h). False, nothing queued, where no
 * copy holds every group's weights (the caller's kernel then runs). */
bool few_rows_bf16(cuda_ctx *c, int N, int K, const float *A, int lda, const float *B, int ldb,
                   size_t b_stride, float *C, int ldc, const int32_t *offsets, int groups)
{
    if (groups < 1 || ldb < 1 || b_stride % (size_t)ldb != 0)
        return false;
    /* the groups' weights as one operand: rows of ldb floats from B */
    const size_t rows = (size_t)(groups - 1) * (b_stride / (size_t)ldb) + (size_t)N;
    if (rows > INT32_MAX)
        return false;
    int rc = 0;
    const uint16_t *w = nl_cuda_bf16_weight_operand(&c->w, c->stream, B, (int)rows, K, ldb, &rc);
    launched_shape(c, rc, "gemm_grouped (bf16): convert the weights (%zu rows of %d)", rows, K);
    if (!w)
        return false;
    launched_shape(c,
                   nl_cuda_gemm_grouped_few_bf16(c->stream, N, K, A, lda, w, ldb, b_stride, C, ldc,
                                                 offsets, groups),
                   "gemm_grouped (bf16, few rows) (N %d K %d groups %d)", N, K, groups);
    return true;
}

void cu_gemm_grouped(nl_backend *be, int trans_b, int N, int K, const float *A, int lda,
                     const float *B, int ldb, size_t b_stride, float *C, int ldc,
                     const int32_t *offsets, int groups, int max_rows)
{
    cuda_ctx *c = enter_slot(be, __func__);
    /* NL_CUDA_EXPERTS=cudnn: one cuDNN call (cuda_gemm_dnn.cu), else as below */
    if (c->bf16 && c->experts_dnn && max_rows >= c->host_rows &&
        dnn_grouped(c, trans_b, N, K, A, lda, B, ldb, b_stride, C, ldc, offsets, groups))
        return;
    /* what cuDNN declines takes the one-launch kernel: no host wait */
    if (c->bf16 && (trans_b || c->experts_lt) && max_rows >= c->host_rows && !c->experts_kernel &&
        !c->experts_dnn) {
        /* inside this slot (NL_CUDA_PROFILE counts them here, apart from
         * the dense GEMMs) */
        const int32_t *o = host_offsets(be, c, offsets, groups, max_rows);
        for (int g = 0; o && g < groups; g++)
            if (o[g + 1] > o[g])
                gemm_in_slot(c, 0, trans_b, o[g + 1] - o[g], N, K, 1.0f, A + (size_t)o[g] * lda,
                             lda, B + g * b_stride, ldb, 0.0f, C + (size_t)o[g] * ldc, ldc,
                             c->lt_bucket);
        return;
    }
    if (c->bf16 && trans_b && max_rows <= NL_CUDA_GROUPED_FEW_ROWS &&
        few_rows_bf16(c, N, K, A, lda, B, ldb, b_stride, C, ldc, offsets, groups))
        return;
    if (c->bf16 && groups <= NL_CUDA_MAX_GROUPS) { /* tensor cores, one launch */
        launched_shape(c,
                       nl_cuda_gemm_grouped_bf16(c->stream, trans_b, N, K, A, lda, B, ldb, b_stride,
                                                 C, ldc, offsets, groups, max_rows, c->tile_start),
                       "gemm_grouped (bf16) (N %d K %d groups %d max_rows %d)", N, K, groups,
                       max_rows);
        return;
    }
    launched_shape(c,
                   nl_cuda_gemm_grouped(c->stream, trans_b, N, K, A, lda, B, ldb, b_stride, C, ldc,
                                        offsets, groups, max_rows),
                   "gemm_grouped (N %d K %d groups %d max_rows %d)", N, K, groups, max_rows);
}

/* gemm_grouped_rows: every row as gemm_rows computes it, whatever
 * max_rows says (the few-row kernel, rows past its pass taking more); in
 * bf16 mode from the experts' copy where one holds them, else rounding
 * the FP32 weights as read: the same bits. */
void cu_gemm_grouped_rows(nl_backend *be, int N, int K, const float *A, int lda, const float *B,
                          int ldb, size_t b_stride, float *C, int ldc, const int32_t *offsets,
                          int groups, int max_rows)
{
    cuda_ctx *c = enter_slot(be, __func__);
    (void)max_rows;
    if (c->bf16 && few_rows_bf16(c, N, K, A, lda, B, ldb, b_stride, C, ldc, offsets, groups))
        return;
    launched_shape(c,
                   nl_cuda_gemm_grouped_rows(c->stream, N, K, A, lda, B, ldb, b_stride, C, ldc,
                                             offsets, groups, c->bf16),
                   "gemm_grouped_rows (N %d K %d groups %d)", N, K, groups);
}

void cu_gemm_grouped_wgrad(nl_backend *be, int M, int N, const float *A, int lda, const float *B,
                           int ldb, float *C, int ldc, size_t c_stride, const int32_t *offsets,
                           int groups)
{
    cuda_ctx *c = enter_slot(be, __func__);
    if (c->bf16 && c->experts_lt) { /* per expert (the default), C_g += A_g^T B_g */
        const int32_t *o = host_offsets(be, c, offsets, groups, INT32_MAX);
        for (int g = 0; o && g < groups; g++)
            if (o[g + 1] > o[g])
                gemm_in_slot(c, 1, 0, M, N, o[g + 1] - o[g], 1.0f, A + (size_t)o[g] * lda, lda,
                             B + (size_t)o[g] * ldb, ldb, 1.0f, C + g * c_stride, ldc,
                             c->lt_bucket);
        return;
    }
    if (c->bf16) {
        launched_shape(c,
                       nl_cuda_gemm_grouped_wgrad_bf16(c->stream, M, N, A, lda, B, ldb, C, ldc,
                                                       c_stride, offsets, groups),
                       "gemm_grouped_wgrad (bf16) (M %d N %d groups %d)", M, N, groups);
        return;
    }
    launched_shape(c,
                   nl_cuda_gemm_grouped_wgrad(c->stream, M, N, A, lda, B, ldb, C, ldc, c_stride,
                                              offsets, groups),
                   "gemm_grouped_wgrad (M %d N %d groups %d)", M, N, groups);
}

void fill_gemm_slots(nl_backend *be)
{
    be->gemm = cu_gemm;
    be->bf16_weights = be->bf16 ? cu_bf16_weights : NULL;
    be->wrote = be->bf16 ? cu_wrote : NULL;
    be->gemm_grouped = cu_gemm_grouped;
    be->gemm_grouped_wgrad = cu_gemm_grouped_wgrad;
    be->gemm_rows = cu_gemm_rows;
    be->gemm_rows_few = 1; /* a warp per column: a prompt's rows belong to cuBLAS */
    be->gemm_grouped_rows = cu_gemm_grouped_rows;
}

} // namespace nl_cu
