/* The compute backend interface: one table of function pointers plus a
 * context, filled by the CPU backend (kernels/cpu), the device simulator
 * (kernels/devsim.c) and the CUDA backend (kernels/cuda, a module loaded at
 * run time). Model code above this layer calls only these slots, so it
 * never knows which device runs it.
 *
 * Conventions (after llm.c): outputs first, then inputs and weights, then
 * sizes. Pointers are device pointers of this backend. A weight W of shape
 * [out, in] maps y = x W^T. Rows are contiguous; N is the number of rows
 * (tokens), C the row width. Ops never allocate in the hot path; scratch
 * comes from the caller, and reduction scratch a device needs is owned by
 * the backend, sized when it is created. Optional slots may be NULL.
 *
 * Ordering (one in-order queue per backend, e.g. one CUDA stream):
 *   - ops, upload, download and zero run in submission order;
 *   - upload returns when the source may be reused;
 *   - download returns when the bytes are on the host.
 * So a caller may reuse a host buffer as soon as upload returns, and may
 * upload into a device buffer that queued ops still read: the upload runs
 * after them.
 *
 * Errors: ops return void. A device reports an asynchronous failure (or a
 * slot it does not implement) through a sticky error that `sync` and
 * `check` return as an nl_status; callers check after each forward, each
 * training step and each download they act on.
 *
 * Ownership: nl_backend_new returns a backend the caller owns and frees
 * with nl_backend_destroy(&be). */
#ifndef NL_BACKEND_H
#define NL_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

#ifdef __cplusplus
extern "C" { /* the CUDA module and C++ tests include this */
#endif

typedef struct nl_backend nl_backend;

/* Shape of one attention call. Queries are the T newest positions of each
 * sequence; keys and values live in a cache of capacity kv_cap rows per
 * sequence that already holds `past` positions and now also the T new
 * ones (written by the caller before the call). Query t of a sequence sits
 * at absolute position past + t and attends keys 0 .. past + t. */
typedef struct nl_attn_shape {
    int B;      /* sequences */
    int T;      /* new positions per sequence */
    int past;   /* positions already in the cache */
    int kv_cap; /* cache rows per sequence (>= past + T) */
    int H;      /* query heads */
    int G;      /* key/value heads, H % G == 0 */
    int hd;     /* head dimension */
    /* Optional (NULL: `past` holds): device (B T) positions of the
     * queries; sequence b's past is read from pos[b T] when the kernel
     * runs, and `past` must be 0. A captured step (graph_begin) is then
     * valid for any position. The forward slots only. */
    const int32_t *pos;
    /* 1: k and v hold bf16 bits (uint16_t, strides in elements), as a
     * bf16 KV cache keeps them (kv_store_bf16); each is widened to FP32
     * when read and every sum stays FP32. The forward slots only. */
    int kv_bf16;
    /* Optional (NULL: sequence b's keys and values start at k and v
     * + b kv_cap kv_stride): device arrays of B device pointers, both
     * set or both NULL; sequence b's keys start at kseq[b] and its values
     * at vseq[b] (each sequence in a cache of its own: a batch of
     * sessions decoded in one call), read when the kernel runs. kv_cap
     * is then the least capacity of them; k and v are only checked to
     * be non-NULL. A sequence's results are the bits a call of that
     * sequence alone gives. The forward slots only. */
    const void *const *kseq;
    const void *const *vseq;
} nl_attn_shape;

/* The masks of DESIGN.md section 6, for the attention_masked_* slots (a
 * zeroed mask is the causal one of attention_forward). Query t sits at
 * absolute position i = past + t:
 *   bidir   1: every key 0 .. past + T - 1 (an encoder);
 *   window  W > 0: causal keys j in (i - W, i], bidirectional abs(i - j)
 *           <= W / 2; kernels skip key tiles outside it, so a local layer
 *           costs O(T W);
 *   doc     (B, T) device array of document ids, or NULL: with past == 0,
 *           query t sees key j only when doc[b, t] == doc[b, j] (packed
 *           rows; the caller restarts positions per document). */
typedef struct nl_attn_mask {
    int bidir;          /* 1: no causal mask */
    int window;         /* W > 0: local attention; 0: global */
    const int32_t *doc; /* (B, T) device document ids, or NULL */
} nl_attn_mask;

/* RoPE frequency scaling (DESIGN.md section 6). For pair i with theta_i =
 * base^(-2i/hd) and r_i = L0 theta_i / (2 pi), gamma_i = clamp((r_i -
 * beta_slow) / (beta_fast - beta_slow), 0, 1), theta'_i = (1 - gamma_i)
 * theta_i / factor + gamma_i theta_i, and cos and sin are both multiplied
 * by m = 0.1 ln(factor) + 1. */
enum { NL_ROPE_NONE = 0, NL_ROPE_YARN = 1 };
typedef struct nl_rope_scaling {
    int type;                 /* NL_ROPE_NONE or NL_ROPE_YARN */
    int original_max_seq_len; /* L0 */
    double factor;            /* s */
    double beta_fast;         /* default 32 */
    double beta_slow;         /* default 1 */
} nl_rope_scaling;

/* One row of a sample_rows call: the caller's host array of them names
 * each row's logits in device memory, its temperature and its draw. */
typedef struct nl_sample_row {
    const float *logits; /* device (V) */
    float temperature;   /* 0: greedy */
    float top_p;         /* the nucleus's mass in (0, 1); 0 or 1: every token */
    double u;            /* uniform in [0, 1) the caller drew (0 when greedy) */
} nl_sample_row;

/* Bumped whenever struct nl_backend, nl_backend_opts, nl_attn_shape,
 * nl_attn_mask, nl_rope_scaling, nl_sample_row or nl_error changes: a
 * backend module built against another version is refused when it is
 * loaded. */
#define NL_BACKEND_ABI 13

/* the largest vocabulary the sample_rows slot takes (a GPU keeps one block's
 * chunk sums, NL_SAMPLE_CHUNK ids each, in shared memory) */
#define NL_SAMPLE_MAX_VOCAB (1024 * 256)

/* Largest head dimension any backend's attention and RoPE support. */
#define NL_BACKEND_MAX_HEAD_DIM 256

/* The fused decode slots (moe_norm_route, moe_gate_up, moe_down_combine)
 * serve forward calls of fewer rows than this (a decode step's). */
#define NL_BACKEND_FUSED_ROWS 16

/* Most experts the routing slots support (the config's limit too). */
#define NL_BACKEND_MAX_EXPERTS 256

/* Counters a backend keeps as it runs (plain counters: read them from the
 * thread that drives the backend). */
typedef struct nl_backend_stats {
    /* Calls that make the host wait for the device's queue: upload and
     * download of at least one byte, sync, and sumsq (a result returned to
     * the host). CUDA stages small uploads in pinned memory and counts one
     * only when it has to wait for a staging slot. alloc and free, which a
     * device may also synchronise, are not hot-path calls and are not
     * counted. */
    uint64_t host_syncs;
} nl_backend_stats;

struct nl_backend {
    const char *name;                /* "cpu", "cpu-devsim", "cuda:0" */
    void *ctx;                       /* backend-private state */
    void (*destroy)(nl_backend *be); /* frees ctx and the table itself */
    int host_memory;                 /* 1 when device pointers are ordinary host memory */
    int can_train;                   /* 1 when every backward and optimizer slot is implemented */
    int gemm_probe; /* M = N = K of the throughput probe that reflects this device */
    int bf16;       /* 1 when gemm computes in bf16 (nl_backend_opts.bf16) */
    /* Device memory the backend itself holds (context, library workspaces,
     * its reduction scratch), measured when it was created; 0 on the CPU,
     * whose process overhead the memory model counts (NL_MEM_RUNTIME_BYTES). */
    size_t runtime_bytes;
    nl_backend_stats stats; /* kept by the backend's own slots */

    /* ---- memory (device) ---- */
    void *(*alloc)(nl_backend *be,
                   size_t bytes);          /* zero-filled, 64-byte aligned; NULL on failure */
    void (*free)(nl_backend *be, void *p); /* p may be NULL */
    void (*upload)(nl_backend *be, void *dst, const void *src, size_t bytes);
    void (*download)(nl_backend *be, void *dst, const void *src, size_t bytes);
    /* Wait for queued work; returns the first asynchronous error, if any. */
    nl_status (*sync)(nl_backend *be, nl_error *err);
    /* Optional: return a sticky error without waiting (NULL: never fails). */
    nl_status (*check)(nl_backend *be, nl_error *err);
    /* Optional: free and total memory of the device (NULL: host memory). */
    nl_status (*mem_info)(nl_backend *be, size_t *free_bytes, size_t *total_bytes, nl_error *err);
    /* Set `bytes` bytes at p to zero (unlike scaling by 0, this clears NaN). */
    void (*zero)(nl_backend *be, void *p, size_t bytes);
    /* Bytes allocated through this backend now and at most so far. */
    void (*mem_stats)(nl_backend *be, size_t *in_use, size_t *peak);

    /* ---- linear algebra ----
     * C[M,N] = alpha * op(A) op(B) + beta * C, row-major, where op(X) is X
     * or X^T as trans_a / trans_b say; lda, ldb, ldc are row strides. */
    void (*gemm)(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);
    /* Optional (NULL: no such GEMM; a caller that needs the invariance
     * pads small M instead, as core/model/batch.c does): C[M,N] = A op(B), or
     * C += A op(B) with accumulate, where row i of C depends only on row
     * i of A (and of C), bit for bit, for any M: a batch's row gives the
     * same bits alone or among others. row-major, strides as in gemm. On
     * the CPU: with trans_b its own dot-product kernel (kernels/cpu/
     * cpu_dot.c), which gemm also runs below 16 rows, so the two agree bit
     * for bit there (a decode's rows); without, its chain GEMM
     * (kernels/cpu/cpu_matmul.c, gemm's too at 16 rows and more, whose
     * every element is one fixed chain of FMAs); NULL there with bf16. On CUDA
     * (kernels/cuda/cuda_rows.cu) a GEMV-style kernel with a fixed order,
     * which gemm also runs below 16 rows with trans_b, alpha 1 and beta 0
     * or 1; in bf16 mode with bf16 products (the weights read from their
     * bf16 copy where one holds them), as gemm's. A backend with gemm_rows
     * has gemm_grouped_rows too unless its gemm_grouped calls be->gemm. */
    void (*gemm_rows)(nl_backend *be, int trans_b, int M, int N, int K, const float *A, int lda,
                      const float *B, int ldb, int accumulate, float *C, int ldc);
    /* 1 where gemm_rows (and gemm_grouped_rows) is fast only at a decode's
     * few rows (fewer than NL_BACKEND_FUSED_ROWS) and far slower than gemm
     * above (CUDA: a GEMV-style kernel against cuBLAS's tensor-core tiles):
     * core/model/batch.c then runs a step of that many rows or more (a
     * prompt's chunk) through gemm, whose rows may depend on M; 0 where it
     * is fast enough at any M (the CPU: its chain GEMM without a
     * transposed B; with one, its dot kernel, about half a blocked GEMM's
     * speed at many rows, which a batch's prompt chunks pay). */
    int gemm_rows_few;
    /* bf16 compute (be->bf16): gemm rounds A and B to bf16 and accumulates
     * in FP32 into C, which stays FP32 like every other buffer. Operands
     * inside a range given to bf16_weights are read from its bf16 copy;
     * others are converted at each call.
     * bf16_weights (optional, NULL when be->bf16 is 0): the n floats at p
     * are weights (a model's parameters) that many GEMMs read between
     * changes. The backend keeps a bf16 copy, made again on the next GEMM
     * after any slot writes into the range (upload, zero, adamw) or host
     * code reports a write (wrote). n == 0 forgets the range at p. Fails
     * only when out of memory.
     * wrote (optional): host code wrote `bytes` bytes at p by a way no
     * slot saw (a write view of a host-memory backend): any copy of them
     * is stale. */
    nl_status (*bf16_weights)(nl_backend *be, const float *p, size_t n, nl_error *err);
    void (*wrote)(nl_backend *be, const void *p, size_t bytes);

    /* ---- forward ops ---- */
    /* out[n, :] = table[tokens[n], :]; (N, C). Tokens are checked by the caller. */
    void (*embedding_forward)(nl_backend *be, float *out, const int32_t *tokens, const float *table,
                              int N, int C);
    /* out = inp * rsqrt(mean(inp^2) + eps) * w; rstd (N) may be NULL. (N, C) */
    void (*rmsnorm_forward)(nl_backend *be, float *out, float *rstd, const float *inp,
                            const float *w, int N, int C, float eps);
    /* Rotate pairs (2i, 2i+1) of every head of x in place. x is (N, row)
     * with `heads` heads of hd starting at column col0 of each row; row n
     * sits at position pos[n]. */
    void (*rope_forward)(nl_backend *be, float *x, const int32_t *pos, int N, int row, int col0,
                         int heads, int hd, float base);
    /* Optional: rope_forward with the frequencies and scale of `sc`
     * (YaRN). Its own inverse with negated positions, as rope_forward. */
    void (*rope_scaled_forward)(nl_backend *be, float *x, const int32_t *pos, int N, int row,
                                int col0, int heads, int hd, float base, nl_rope_scaling sc);
    /* Tiled causal attention with online softmax.
     * q:   (B, T, q_stride) with head h at column h*hd
     * k,v: (B, kv_cap, kv_stride) with kv head g at column g*hd
     * out: (B, T, H*hd); lse: (B, H, T) log-sum-exp of the scaled scores,
     * kept for the backward pass (may be NULL). */
    void (*attention_forward)(nl_backend *be, float *out, float *lse, const float *q, int q_stride,
                              const float *k, const float *v, int kv_stride, nl_attn_shape s);
    /* Optional: attention_forward under a DESIGN section 6 mask. */
    void (*attention_masked_forward)(nl_backend *be, float *out, float *lse, const float *q,
                                     int q_stride, const float *k, const float *v, int kv_stride,
                                     nl_attn_shape s, nl_attn_mask mask);
    /* Row-wise softmax in place. (N, C) */
    void (*softmax_forward)(nl_backend *be, float *x, int N, int C);
    /* out[n, j] = silu(gu[n, j]) * gu[n, F + j]: gu is (N, 2F) with the gate
     * in the first F columns and the up projection in the last F. */
    void (*swiglu_forward)(nl_backend *be, float *out, const float *gu, int N, int F);
    /* Optional: as swiglu_forward with the exact (erf) GELU for silu:
     * out[n, j] = gelu(gu[n, j]) * gu[n, F + j]. */
    void (*geglu_forward)(nl_backend *be, float *out, const float *gu, int N, int F);
    /* out[i, :] = src[idx[i], :]; (n, C) */
    void (*gather_rows)(nl_backend *be, float *out, const float *src, const int32_t *idx, int n,
                        int C);
    /* dst[r, 0:cols] = src[r, 0:cols] for r < rows, with row strides (floats). */
    void (*copy_rows)(nl_backend *be, float *dst, int dst_stride, const float *src, int src_stride,
                      int rows, int cols);
    /* Optional (NULL: the caller copies rows at host-known positions):
     * write B T new rows into a KV cache of `cap` rows per sequence at
     * positions read on the device: for row n = b T + t and j < kv_dim,
     *   kc[(b cap + pos[n]) kv_dim + j] = qkv[n stride + k_col + j],
     *   vc[(b cap + pos[n]) kv_dim + j] = qkv[n stride + v_col + j].
     * Positions are checked by the caller (0 <= pos[n] < cap). */
    void (*kv_store)(nl_backend *be, float *kc, float *vc, const float *qkv, int stride, int k_col,
                     int v_col, const int32_t *pos, int B, int T, int cap, int kv_dim);
    /* Optional (NULL: no bf16 KV cache on this backend): kv_store into a
     * cache of bf16 bits, each value rounded to nearest even
     * (nl_elem_to_bf16); with pos NULL, row n = b T + t goes to position
     * past + t (host-known positions), else to pos[n] read on the device
     * (past must be 0). */
    void (*kv_store_bf16)(nl_backend *be, uint16_t *kc, uint16_t *vc, const float *qkv, int stride,
                          int k_col, int v_col, const int32_t *pos, int past, int B, int T, int cap,
                          int kv_dim);
    /* Optional (NULL: the caller stores each sequence's rows itself):
     * kv_store for B sequences each in a cache of its own, of floats, or
     * with bf16 of bf16 bits rounded as kv_store_bf16 rounds. kseq and
     * vseq are device arrays of B device pointers, read when it runs; row
     * n = b T + t goes to row pos[n] of sequence b's cache: for j < kv_dim,
     *   ((float *)kseq[b])[pos[n] kv_dim + j] = qkv[n stride + k_col + j],
     *   ((float *)vseq[b])[pos[n] kv_dim + j] = qkv[n stride + v_col + j].
     * Positions are checked by the caller. */
    void (*kv_store_seq)(nl_backend *be, void *const *kseq, void *const *vseq, int bf16,
                         const float *qkv, int stride, int k_col, int v_col, const int32_t *pos,
                         int B, int T, int kv_dim);
    /* Mixture-of-experts combine: for each token n and each of its k
     * choices i (in order), x[n, :] += w[n*k + i] * y[slot[n*k + i], :].
     * y holds the expert outputs in dispatch order. (N, C) */
    void (*moe_combine)(nl_backend *be, float *x, const float *y, const int32_t *slot,
                        const float *w, int N, int k, int C);

    /* ---- mixture-of-experts routing, all on the device (no host sync) ----
     * Top-k routing of N rows of router probabilities probs (N, E), with
     * k <= E <= NL_BACKEND_MAX_EXPERTS:
     *   choice[n k + i]  the i-th largest entry of row n, ties to the lower
     *                    expert index (a NaN is never larger);
     *   w[n k + i]       probs[n, choice] / (sum of the row's k chosen, in
     *                    float, in choice order);
     *   offsets (E + 1)  offsets[0] = 0, offsets[e + 1] - offsets[e] = the
     *                    assignments to expert e;
     *   perm (N k)       the token row of each dispatch slot, grouped by
     *                    expert, tokens ascending within an expert;
     *   slot[n k + i]    the dispatch slot of (n, i): perm[slot[n k + i]] == n. */
    void (*moe_route)(nl_backend *be, int32_t *choice, float *w, int32_t *offsets, int32_t *perm,
                      int32_t *slot, const float *probs, int N, int E, int k);
    /* One layer's load-balancing loss from its routing (offsets as made by
     * moe_route over the same N rows):
     *   frac[e] = global_frac ? global_frac[e] : (float)(count_e / (N k));
     *   *aux += (double)(float)(E * sum_e frac[e] * P_e / aux_rows), where
     *           P_e = sum_n probs[n, e], both sums in double (aux may be NULL);
     *   counts[e] += count_e when counts is not NULL.
     * global_frac (E) is a device array or NULL. */
    void (*moe_aux)(nl_backend *be, double *aux, float *frac, int64_t *counts, const float *probs,
                    const int32_t *offsets, const float *global_frac, int N, int E, int k,
                    double aux_rows);
    /* Router backward (N rows): given dw = dLoss/dw (N k) for the weights
     * w = p_choice / S of moe_route and the aux term's dLoss/dp_e =
     * aux_scale * frac[e], write the router logits' gradient
     *   dp_e = aux_scale frac[e] + [e chosen as i] (dw_i - sum_j dw_j w_j) / S
     *   dl[n, e] = p_e (dp_e - sum_e' p_e' dp_e')  (dot products in double).
     * dl (N, E) is overwritten. */
    void (*moe_router_backward)(nl_backend *be, float *dl, const float *dw, const float *probs,
                                const int32_t *choice, const float *w, const float *frac, int N,
                                int E, int k, float aux_scale);
    /* Grouped GEMMs over the expert groups of a dispatch: group g has the
     * rows r0 = offsets[g] .. offsets[g + 1] - 1 (n_g rows; offsets is the
     * device array of moe_route, groups + 1 entries) and is skipped when
     * n_g == 0, so the host never needs the counts.
     * gemm_grouped: C[r0 + i, :N] = sum_p A[r0 + i, p] op(B_g)[p, :] for
     *   i < n_g, K columns of A, where B_g = B + g * b_stride is (N, K)
     *   with trans_b, else (K, N); overwrites. max_rows bounds every n_g
     *   (a device may size its launch by it).
     * gemm_grouped_wgrad: C_g += A_g^T B_g with A_g = rows r0.. of A
     *   (n_g, M) and B_g = rows r0.. of B (n_g, N), C_g = C + g * c_stride
     *   (M, N): the weight gradient of each group.
     * lda, ldb, ldc are row strides. On the CPU both are the per-group
     * gemm calls in group order. */
    void (*gemm_grouped)(nl_backend *be, int trans_b, int N, int K, const float *A, int lda,
                         const float *B, int ldb, size_t b_stride, float *C, int ldc,
                         const int32_t *offsets, int groups, int max_rows);
    void (*gemm_grouped_wgrad)(nl_backend *be, int M, int N, const float *A, int lda,
                               const float *B, int ldb, float *C, int ldc, size_t c_stride,
                               const int32_t *offsets, int groups);
    /* Optional (NULL where gemm_grouped computes through be->gemm, as the
     * CPU's does, or where there is no gemm_rows): gemm_grouped with
     * trans_b whose every row is computed as gemm_rows computes it (trans_b,
     * overwriting), bit for bit, for any max_rows and group sizes: what
     * core/model/batch.c runs a batch's expert products through, so that
     * they give the fused decode slots' bits. Arguments as gemm_grouped's. */
    void (*gemm_grouped_rows)(nl_backend *be, int N, int K, const float *A, int lda, const float *B,
                              int ldb, size_t b_stride, float *C, int ldc, const int32_t *offsets,
                              int groups, int max_rows);

    /* Optional (NULL: the caller makes the separate calls): the experts'
     * feed-forward of a dispatch, group by group, with each group's
     * element-wise pass done right after its product, while the rows are
     * in cache. Expert g's weights are W_g = experts + g * expert_stride:
     * gate|up (2F, d) then down (d, F), as in the model's layout; groups
     * and offsets as in gemm_grouped.
     * moe_ffn_forward: gu = xe W_gu^T, hs = swiglu(gu), ye = hs W_down^T,
     *   equal to gemm_grouped + swiglu_forward + gemm_grouped.
     * moe_ffn_backward: given dye, dhs = dye W_down, dW_down += dye^T hs,
     *   dgu = swiglu_backward(dhs, gu), dW_gu += dgu^T xe, dxe = dgu W_gu,
     *   with dW_g = dexperts + g * expert_stride; equal to the separate
     *   calls of core/model/layer_backward.c. dexperts NULL (a frozen base, LoRA):
     *   no weight gradients, the rest as with them, bit for bit. */
    void (*moe_ffn_forward)(nl_backend *be, float *ye, float *hs, float *gu, const float *xe,
                            const float *experts, size_t expert_stride, int d, int F,
                            const int32_t *offsets, int groups, int max_rows);
    void (*moe_ffn_backward)(nl_backend *be, float *dxe, float *dgu, float *dhs, float *dexperts,
                             const float *dye, const float *xe, const float *gu, const float *hs,
                             const float *experts, size_t expert_stride, int d, int F,
                             const int32_t *offsets, int groups);

    /* Optional, all three or none (NULL: the caller makes the separate
     * calls): a decode step's expert layer in three launches in place of
     * rmsnorm, router GEMM, softmax, moe_route, gather_rows, the expert
     * GEMMs, SwiGLU and moe_combine. Meant for a few rows (core/model/layer.c
     * takes them below NL_BACKEND_FUSED_ROWS): no dispatch, each (token,
     * choice) reads its expert's weights directly. Each row's result
     * depends on that row alone, for any N. Where the backend has
     * gemm_rows (the CPU with FP32 GEMMs, CUDA in FP32 and bf16) they give
     * the separate calls' bits with the products through gemm_rows and
     * gemm_grouped_rows, the way core/model/batch.c makes them (CUDA in
     * bf16: bf16 x bf16 products from the weights' bf16 copies, as there).
     * moe_norm_route: xn = rmsnorm(x, norm_w, eps) (N, d), probs =
     *   softmax(xn router^T) (N, E), and choice, w (N k) as moe_route
     *   writes them (no dispatch tables, no aux loss). E <=
     *   NL_BACKEND_MAX_EXPERTS.
     * moe_gate_up: hs[r, :] = swiglu(g, u) for r = n k + i, where [g | u]
     *   = xn[n, :] W^T with W = experts + choice[r] * expert_stride (2F,
     *   d), the gate|up of the model's layout. gu (N k, 2F) is scratch
     *   the backend may use.
     * moe_down_combine: x[n, :] += sum_i w[r] * (hs[r, :] Wd^T) for r = n
     *   k + i in order of i (moe_combine's), Wd = experts + choice[r] *
     *   expert_stride + 2 F d (d, F): the down projection, the weighted
     *   combine and the residual add. ye (N k, d) is scratch likewise. */
    void (*moe_norm_route)(nl_backend *be, float *xn, float *probs, int32_t *choice, float *w,
                           const float *x, const float *norm_w, const float *router, int N, int d,
                           int E, int k, float eps);
    void (*moe_gate_up)(nl_backend *be, float *hs, float *gu, const float *xn,
                        const int32_t *choice, const float *experts, size_t expert_stride, int N,
                        int k, int d, int F);
    void (*moe_down_combine)(nl_backend *be, float *x, float *ye, const float *hs,
                             const int32_t *choice, const float *w, const float *experts,
                             size_t expert_stride, int N, int k, int d, int F);

    /* ---- backward ops ----
     * Gradients named d<x>. "+=" means the op accumulates into the output
     * (callers zero it first when they want a plain result). */
    /* dtable[tokens[n], :] += dout[n, :]; tokens may repeat. (N, C) */
    void (*embedding_backward)(nl_backend *be, float *dtable, const float *dout,
                               const int32_t *tokens, int N, int C);
    /* Given out = inp * rstd * w (rstd saved by the forward):
     * dinp += (w * dout) * rstd - inp * rstd^3 / C * sum(w * dout * inp)
     * dw   += sum over rows of dout * inp * rstd. (N, C) */
    void (*rmsnorm_backward)(nl_backend *be, float *dinp, float *dw, const float *dout,
                             const float *inp, const float *w, const float *rstd, int N, int C);
    /* Flash-attention backward for the forward of the same shape (no
     * cache: past == 0, kv_cap == T). q/k/v/dq/dk/dv share the layout of
     * the forward's q/k/v (row strides q_stride, kv_stride); out and dout
     * are (B, T, H hd); lse is the forward's (B, H, T). Scores are
     * recomputed tile by tile from lse, never stored whole.
     * dq, dk, dv are overwritten (not accumulated). */
    void (*attention_backward)(nl_backend *be, float *dq, float *dk, float *dv, const float *dout,
                               const float *q, int q_stride, const float *k, const float *v,
                               int kv_stride, const float *out, const float *lse, nl_attn_shape s);
    /* Optional: attention_backward under a DESIGN section 6 mask (the
     * mask of the forward). */
    void (*attention_masked_backward)(nl_backend *be, float *dq, float *dk, float *dv,
                                      const float *dout, const float *q, int q_stride,
                                      const float *k, const float *v, int kv_stride,
                                      const float *out, const float *lse, nl_attn_shape s,
                                      nl_attn_mask mask);
    /* gu = [g | u] (N, 2F), h = silu(g) * u:
     * dgu[:, :F] = dh * u * silu'(g), dgu[:, F:] = dh * silu(g). Overwrites dgu. */
    void (*swiglu_backward)(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                            int F);
    /* Optional: as swiglu_backward for geglu_forward. */
    void (*geglu_backward)(nl_backend *be, float *dgu, const float *dh, const float *gu, int N,
                           int F);
    /* Backward of moe_combine: dy[slot[n*k+i], :] = w[n*k+i] * dx[n, :]
     * (overwrites, each slot is written once) and
     * dw[n*k+i] = dot(dx[n, :], y[slot[n*k+i], :]). (N, C) */
    void (*moe_combine_backward)(nl_backend *be, float *dy, float *dw, const float *dx,
                                 const float *y, const int32_t *slot, const float *w, int N, int k,
                                 int C);
    /* Cross-entropy over rows of logits (N, V) with targets[n] in [0, V):
     * losses[n] = logsumexp(logits[n]) - logits[n, targets[n]], and the
     * logits are overwritten in place by their gradient
     * scale * (softmax(logits[n]) - onehot(targets[n])). A target below 0
     * is ignored: losses[n] = 0 and the row's gradient is 0. */
    void (*cross_entropy)(nl_backend *be, float *logits, float *losses, const int32_t *targets,
                          int N, int V, float scale);
    /* Sum of squares of x in double precision (inf or nan if any element
     * is not finite). */
    double (*sumsq)(nl_backend *be, const float *x, size_t n);
    /* Optional (NULL: the caller downloads the logits and samples on the
     * host): the next token of each of n rows of V logits into ids[i]
     * (host), rows[i] (a host array) naming the row, by the rule of
     * elem.h's nl_elem_sample_row: greedy when its temperature is 0, else
     * at that temperature with the uniform u in [0, 1) the caller drew,
     * inside the nucleus of its top_p where that is in (0, 1).
     * Each row is sampled by itself, so its id is the one it gives alone
     * (n = 1), bit for bit, beside any others. The n ids come to the host
     * in one copy: the call waits once (one host sync, as sumsq), whatever
     * n; n == 0 does nothing. Rows are checked by the caller (temperature
     * >= 0, top_p in [0, 1], u in [0, 1)); V is at most NL_SAMPLE_MAX_VOCAB. On a device
     * failure every id is -1, and the error is kept for check. */
    void (*sample_rows)(nl_backend *be, int32_t *ids, const nl_sample_row *rows, int n, int V);
    /* One AdamW update of n parameters with gradient g * grad_scale:
     *   m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2
     *   p -= lr * (m / bc1 / (sqrt(v / bc2) + eps) + wd * p)
     * where bc1 = 1 - b1^t and bc2 = 1 - b2^t are given by the caller. */
    void (*adamw)(nl_backend *be, float *p, const float *g, float *m, float *v, size_t n, float lr,
                  float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale);

    /* ---- captured steps (optional, all four or none; NULL: the caller
     * queues every op each time) ----
     * graph_begin: the ops queued from now until graph_end are recorded,
     *   not run (a CUDA stream capture). Only op slots may be called in
     *   between: upload, download, sync, alloc, free, sumsq and sample_rows
     *   make graph_end fail.
     * graph_end: ends the recording; *graph gets the recorded step, or
     *   NULL with err set when it could not be recorded (the step was not
     *   run either; the caller runs it without a graph).
     * graph_launch: queue the recorded ops again, with the arguments they
     *   were recorded with (host values are frozen; device memory is read
     *   when they run, so positions and lengths must live there: the
     *   attention's pos, kv_store). Returns 0 when queued, 1 when the
     *   backend has invalidated the graph (a bf16 weight copy it read was
     *   remade): the caller frees it and records again.
     * graph_free: NULL is allowed. */
    void (*graph_begin)(nl_backend *be);
    nl_status (*graph_end)(nl_backend *be, void **graph, nl_error *err);
    int (*graph_launch)(nl_backend *be, void *graph);
    void (*graph_free)(nl_backend *be, void *graph);
};

/* Options of nl_backend_new; a zeroed struct (or NULL) gives the defaults. */
typedef struct nl_backend_opts {
    int threads; /* CPU worker threads (0: all cores) */
    int tf32;    /* CUDA: allow TF32 tensor-core math in GEMM (default: FP32) */
    /* GEMMs in bf16 with FP32 accumulation (default: FP32). On the CPU
     * only where it has AVX512-BF16 or AMX (oneDNN's ISA query); on CUDA
     * from compute capability 8.0 (cuBLASLt and tensor-core grouped GEMMs,
     * kernels/cuda/cuda_mixed.h): nl_backend_new refuses it elsewhere with
     * NL_ERR_UNSUPPORTED. */
    int bf16;
} nl_backend_opts;

/* The one constructor. device is "cpu", "cpu-devsim" (the CPU backend
 * behind tagged pointers: any host dereference of device memory faults) or
 * "cuda:N" (loads the CUDA module; fails with NL_ERR_UNSUPPORTED and a
 * message naming what is missing when the module, driver or device is not
 * there). */
nl_status nl_backend_new(nl_backend **out, const char *device, const nl_backend_opts *o,
                         nl_error *err);

/* Check a device name without creating anything: NL_OK for "cpu",
 * "cpu-devsim" and "cuda:N" (N a non-negative integer). */
nl_status nl_backend_parse_device(const char *device, nl_error *err);

/* Free a backend made by any nl_backend_*_new and set *be to NULL. Safe
 * on NULL and on an already-destroyed pointer. */
void nl_backend_destroy(nl_backend **be);

/* be->check when the backend has one, else NL_OK. */
nl_status nl_backend_check(nl_backend *be, nl_error *err);

/* ---- host staging: the one rule for host code that reads or writes
 * tensors of a backend whose memory may not be the host's (checkpoints,
 * wire frames, samplers). A host-memory backend lends its device pointers;
 * any other copies through a host buffer the caller owns, grown on demand
 * and kept, so a hot path allocates only the first time. ---- */
typedef struct nl_host_stage {
    void *p;    /* malloc'd staging, NULL until needed */
    size_t cap; /* bytes at p */
} nl_host_stage;

/* Host pointer holding `bytes` bytes of device memory at dev: dev itself on
 * a host-memory backend, else the stage after a download (and a check of
 * the backend's sticky error). NULL with err set when out of memory or the
 * device failed. */
const void *nl_backend_read_view(nl_backend *be, nl_host_stage *st, const void *dev, size_t bytes,
                                 nl_error *err);
/* Host pointer to fill with `bytes` bytes bound for dev: dev itself on a
 * host-memory backend, else the stage; then nl_backend_write_back. */
void *nl_backend_write_view(nl_backend *be, nl_host_stage *st, void *dev, size_t bytes,
                            nl_error *err);
/* Upload what was written into a write view (nothing when view == dev). */
void nl_backend_write_back(nl_backend *be, void *dev, const void *view, size_t bytes);
/* Device pointer holding the `bytes` bytes of host data at src, which may
 * be unaligned (a wire frame): src itself on a host-memory backend when it
 * is float-aligned, else dev_stage (a device buffer of at least `bytes`)
 * after an upload. */
const void *nl_backend_device_view(nl_backend *be, void *dev_stage, const void *src, size_t bytes);
/* Free the stage's buffer; safe on a zeroed or already-freed stage. */
void nl_host_stage_free(nl_host_stage *st);

/* Measure this backend's sgemm throughput in GFLOP/s on an M x N x K
 * product, repeated for about `seconds`. */
double nl_backend_gemm_gflops(nl_backend *be, int M, int N, int K, double seconds);
/* The same, for a backend that computes on this process's CPU threads:
 * the products of about `seconds` (wall clock) are timed by the process's
 * CPU time over `threads` (its compute threads), so that other processes
 * sharing the cores (a busy machine) do not lower the figure: it is the
 * speed of the node's own computing, as if its threads had their cores. */
double nl_backend_gemm_gflops_cpu(nl_backend *be, int M, int N, int K, double seconds, int threads);

#ifdef __cplusplus
}
#endif

#endif
