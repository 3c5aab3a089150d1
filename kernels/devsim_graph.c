/* cpu-devsim's op slots that a captured step may queue, and its model of
 * a CUDA graph: between graph_begin and graph_end each of these slots
 * records its call (the runner and its arguments, untagged) instead of
 * running it; graph_launch runs the recorded calls again in order with
 * the same arguments. So, as on a GPU, a replay reads device memory as it
 * is then, while every host value (a pointer, a size, a position passed
 * by value) is the one of the recording: a step replayed after the model
 * changed under it computes the old shapes on the old buffers, and one
 * that takes positions by value repeats the old positions. Slots that
 * wait for the device or allocate refuse to be recorded (graph_end
 * fails), as a CUDA stream capture does. */
#include "kernels/backend_impl.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/devsim_impl.h"

#include <stdlib.h>
#include <string.h>

#define UF(p) ((float *)nl_ds_untag(p))
#define UI(p) ((int32_t *)nl_ds_untag(p))
#define ARGS_MAX 128

typedef void (*op_runner)(nl_backend *be, const void *args);

typedef struct ds_op {
    op_runner run;
    nl_backend *be; /* the table the op was queued through */
    unsigned char args[ARGS_MAX];
} ds_op;

struct nl_ds_graph {
    ds_op *ops;
    int n, cap;
    int failed; /* out of memory while recording */
};

static nl_ds_ctx *ctx_of(nl_backend *be)
{
    return be->ctx;
}

int nl_devsim_refused(nl_backend *be, const char *slot)
{
    nl_ds_ctx *c = ctx_of(be);
    if (!c->rec)
        return 0;
    if (!c->refused)
        c->refused = slot;
    return 1;
}

/* Run an op now, or append it to the step being recorded. */
static void queue(nl_backend *be, op_runner run, const void *args, size_t size)
{
    nl_ds_graph *g = ctx_of(be)->rec;
    if (!g) {
        run(be, args);
        return;
    }
    if (g->n == g->cap) {
        const int cap = g->cap ? 2 * g->cap : 64;
        ds_op *ops = realloc(g->ops, (size_t)cap * sizeof *ops);
        if (!ops) {
            g->failed = 1;
            return;
        }
        g->ops = ops;
        g->cap = cap;
    }
    ds_op *op = &g->ops[g->n++];
    op->run = run;
    op->be = be;
    memcpy(op->args, args, size);
}

#define QUEUE(be, run, a)                                                                          \
    do {                                                                                           \
        _Static_assert(sizeof(a) <= ARGS_MAX, "devsim: op arguments too large to record");         \
        queue(be, run, &(a), sizeof(a));                                                           \
    } while (0)

/* ---------------------------------------------------------------- ops */

typedef struct {
    void *p;
    size_t bytes;
} zero_args;
static void run_zero(nl_backend *be, const void *p)
{
    const zero_args *a = p;
    nl_ds_cpu(be)->zero(nl_ds_cpu(be), a->p, a->bytes);
}
static void ds_zero(nl_backend *be, void *p, size_t bytes)
{
    zero_args a = {nl_ds_untag(p), bytes};
    QUEUE(be, run_zero, a);
}

typedef struct {
    int ta, tb, M, N, K, lda, ldb, ldc;
    float alpha, beta;
    const float *A, *B;
    float *C;
} gemm_args;
static void run_gemm(nl_backend *be, const void *p)
{
    const gemm_args *a = p;
    nl_ds_cpu(be)->gemm(nl_ds_cpu(be), a->ta, a->tb, a->M, a->N, a->K, a->alpha, a->A, a->lda, a->B,
                        a->ldb, a->beta, a->C, a->ldc);
}
static void ds_gemm(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                    const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    gemm_args a = {trans_a, trans_b, M, N, K, lda, ldb, ldc, alpha, beta, UF(A), UF(B), UF(C)};
    QUEUE(be, run_gemm, a);
}

typedef struct {
    int tb, M, N, K, lda, ldb, acc, ldc;
    const float *A, *B;
    float *C;
} gemm_rows_args;
static void run_gemm_rows(nl_backend *be, const void *p)
{
    const gemm_rows_args *a = p;
    nl_ds_cpu(be)->gemm_rows(nl_ds_cpu(be), a->tb, a->M, a->N, a->K, a->A, a->lda, a->B, a->ldb,
                             a->acc, a->C, a->ldc);
}
static void ds_gemm_rows(nl_backend *be, int trans_b, int M, int N, int K, const float *A, int lda,
                         const float *B, int ldb, int accumulate, float *C, int ldc)
{
    gemm_rows_args a = {trans_b, M, N, K, lda, ldb, accumulate, ldc, UF(A), UF(B), UF(C)};
    QUEUE(be, run_gemm_rows, a);
}

typedef struct {
    float *out;
    const int32_t *tokens;
    const float *table;
    int N, C;
} embedding_args;
static void run_embedding(nl_backend *be, const void *p)
{
    const embedding_args *a = p;
    nl_ds_cpu(be)->embedding_forward(nl_ds_cpu(be), a->out, a->tokens, a->table, a->N, a->C);
}
static void ds_embedding_forward(nl_backend *be, float *out, const int32_t *tokens,
                                 const float *table, int N, int C)
{
    embedding_args a = {UF(out), UI(tokens), UF(table), N, C};
    QUEUE(be, run_embedding, a);
}

typedef struct {
    float *out, *rstd;
    const float *inp, *w;
    int N, C;
    float eps;
} rmsnorm_args;
static void run_rmsnorm(nl_backend *be, const void *p)
{
    const rmsnorm_args *a = p;
    nl_ds_cpu(be)->rmsnorm_forward(nl_ds_cpu(be), a->out, a->rstd, a->inp, a->w, a->N, a->C,
                                   a->eps);
}
static void ds_rmsnorm_forward(nl_backend *be, float *out, float *rstd, const float *inp,
                               const float *w, int N, int C, float eps)
{
    rmsnorm_args a = {UF(out), UF(rstd), UF(inp), UF(w), N, C, eps};
    QUEUE(be, run_rmsnorm, a);
}

typedef struct {
    float *x;
    const int32_t *pos;
    int N, row, col0, heads, hd, scaled;
    float base;
    nl_rope_scaling sc;
} rope_args;
static void run_rope(nl_backend *be, const void *p)
{
    const rope_args *a = p;
    nl_backend *c = nl_ds_cpu(be);
    if (a->scaled)
        c->rope_scaled_forward(c, a->x, a->pos, a->N, a->row, a->col0, a->heads, a->hd, a->base,
                               a->sc);
    else
        c->rope_forward(c, a->x, a->pos, a->N, a->row, a->col0, a->heads, a->hd, a->base);
}
static void ds_rope_forward(nl_backend *be, float *x, const int32_t *pos, int N, int row, int col0,
                            int heads, int hd, float base)
{
    rope_args a = {UF(x), UI(pos), N, row, col0, heads, hd, 0, base, {0}};
    QUEUE(be, run_rope, a);
}
static void ds_rope_scaled_forward(nl_backend *be, float *x, const int32_t *pos, int N, int row,
                                   int col0, int heads, int hd, float base, nl_rope_scaling sc)
{
    rope_args a = {UF(x), UI(pos), N, row, col0, heads, hd, 1, base, sc};
    QUEUE(be, run_rope, a);
}

typedef struct {
    float *out, *lse;
    const float *q, *k, *v;
    int q_stride, kv_stride;
    nl_attn_shape s;
    nl_attn_mask mask;
} attention_args;
static void run_attention(nl_backend *be, const void *p)
{
    enum { GROUP = 64 };
    const attention_args *a = p;
    nl_backend *cpu = nl_ds_cpu(be);
    const nl_attn_shape s = a->s;
    if (!s.kseq) {
        cpu->attention_masked_forward(cpu, a->out, a->lse, a->q, a->q_stride, a->k, a->v,
                                      a->kv_stride, s, a->mask);
        return;
    }
    /* the sequences' caches, read now as a kernel reads them (untagged),
     * GROUP sequences a call */
    const void *ks[GROUP], *vs[GROUP];
    for (int b0 = 0; b0 < s.B; b0 += GROUP) {
        nl_attn_shape g = s;
        nl_attn_mask mk = a->mask;
        g.B = s.B - b0 < GROUP ? s.B - b0 : GROUP;
        for (int i = 0; i < g.B; i++) {
            ks[i] = nl_ds_untag(s.kseq[b0 + i]);
            vs[i] = nl_ds_untag(s.vseq[b0 + i]);
        }
        g.kseq = ks;
        g.vseq = vs;
        g.pos = s.pos ? s.pos + (size_t)b0 * s.T : NULL;
        mk.doc = mk.doc ? mk.doc + (size_t)b0 * s.T : NULL;
        cpu->attention_masked_forward(cpu, a->out + (size_t)b0 * s.T * s.H * s.hd,
                                      a->lse ? a->lse + (size_t)b0 * s.H * s.T : NULL,
                                      a->q + (size_t)b0 * s.T * a->q_stride, a->q_stride, a->k,
                                      a->v, a->kv_stride, g, mk);
    }
}
static void ds_attention_masked_forward(nl_backend *be, float *out, float *lse, const float *q,
                                        int q_stride, const float *k, const float *v, int kv_stride,
                                        nl_attn_shape s, nl_attn_mask mask)
{
    s.pos = UI(s.pos);
    s.kseq = nl_ds_untag((void *)s.kseq); /* the arrays; their entries when it runs */
    s.vseq = nl_ds_untag((void *)s.vseq);
    mask.doc = UI(mask.doc);
    attention_args a = {UF(out), UF(lse), UF(q), UF(k), UF(v), q_stride, kv_stride, s, mask};
    QUEUE(be, run_attention, a);
}
static void ds_attention_forward(nl_backend *be, float *out, float *lse, const float *q,
                                 int q_stride, const float *k, const float *v, int kv_stride,
                                 nl_attn_shape s)
{
    const nl_attn_mask causal = {0}; /* the CPU's attention_forward is this call */
    ds_attention_masked_forward(be, out, lse, q, q_stride, k, v, kv_stride, s, causal);
}

typedef struct {
    float *out;
    const float *in;
    int N, C, kind; /* 0 swiglu, 1 geglu, 2 softmax (in place on out) */
} rowwise_args;
static void run_rowwise(nl_backend *be, const void *p)
{
    const rowwise_args *a = p;
    nl_backend *c = nl_ds_cpu(be);
    if (a->kind == 0)
        c->swiglu_forward(c, a->out, a->in, a->N, a->C);
    else if (a->kind == 1)
        c->geglu_forward(c, a->out, a->in, a->N, a->C);
    else
        c->softmax_forward(c, a->out, a->N, a->C);
}
static void ds_swiglu_forward(nl_backend *be, float *out, const float *gu, int N, int F)
{
    rowwise_args a = {UF(out), UF(gu), N, F, 0};
    QUEUE(be, run_rowwise, a);
}
static void ds_geglu_forward(nl_backend *be, float *out, const float *gu, int N, int F)
{
    rowwise_args a = {UF(out), UF(gu), N, F, 1};
    QUEUE(be, run_rowwise, a);
}
static void ds_softmax_forward(nl_backend *be, float *x, int N, int C)
{
    rowwise_args a = {UF(x), NULL, N, C, 2};
    QUEUE(be, run_rowwise, a);
}

typedef struct {
    float *dst;
    const float *src;
    const int32_t *idx; /* gather_rows; NULL: copy_rows */
    int dst_stride, src_stride, rows, cols;
} rows_args;
static void run_rows(nl_backend *be, const void *p)
{
    const rows_args *a = p;
    nl_backend *c = nl_ds_cpu(be);
    if (a->idx)
        c->gather_rows(c, a->dst, a->src, a->idx, a->rows, a->cols);
    else
        c->copy_rows(c, a->dst, a->dst_stride, a->src, a->src_stride, a->rows, a->cols);
}
static void ds_gather_rows(nl_backend *be, float *out, const float *src, const int32_t *idx, int n,
                           int C)
{
    rows_args a = {UF(out), UF(src), UI(idx), C, C, n, C};
    QUEUE(be, run_rows, a);
}
static void ds_copy_rows(nl_backend *be, float *dst, int dst_stride, const float *src,
                         int src_stride, int rows, int cols)
{
    rows_args a = {UF(dst), UF(src), NULL, dst_stride, src_stride, rows, cols};
    QUEUE(be, run_rows, a);
}

typedef struct {
    float *kc, *vc;
    const float *qkv;
    const int32_t *pos;
    int stride, k_col, v_col, B, T, cap, kv_dim;
} kv_store_args;
static void run_kv_store(nl_backend *be, const void *p)
{
    const kv_store_args *a = p;
    nl_ds_cpu(be)->kv_store(nl_ds_cpu(be), a->kc, a->vc, a->qkv, a->stride, a->k_col, a->v_col,
                            a->pos, a->B, a->T, a->cap, a->kv_dim);
}
static void ds_kv_store(nl_backend *be, float *kc, float *vc, const float *qkv, int stride,
                        int k_col, int v_col, const int32_t *pos, int B, int T, int cap, int kv_dim)
{
    kv_store_args a = {UF(kc), UF(vc), UF(qkv), UI(pos), stride, k_col, v_col, B, T, cap, kv_dim};
    QUEUE(be, run_kv_store, a);
}

typedef struct {
    void *const *kseq, *const *vseq; /* the arrays, untagged; their entries tagged */
    const float *qkv;
    const int32_t *pos;
    int bf16, stride, k_col, v_col, B, T, kv_dim;
} kv_store_seq_args;
static void run_kv_store_seq(nl_backend *be, const void *p)
{
    enum { GROUP = 64 };
    const kv_store_seq_args *a = p;
    nl_backend *cpu = nl_ds_cpu(be);
    void *ks[GROUP], *vs[GROUP]; /* the sequences' caches, read now: untagged */
    for (int b0 = 0; b0 < a->B; b0 += GROUP) {
        const int nb = a->B - b0 < GROUP ? a->B - b0 : GROUP;
        for (int i = 0; i < nb; i++) {
            ks[i] = nl_ds_untag(a->kseq[b0 + i]);
            vs[i] = nl_ds_untag(a->vseq[b0 + i]);
        }
        const size_t row0 = (size_t)b0 * a->T;
        cpu->kv_store_seq(cpu, ks, vs, a->bf16, a->qkv + row0 * a->stride, a->stride, a->k_col,
                          a->v_col, a->pos + row0, nb, a->T, a->kv_dim);
    }
}
static void ds_kv_store_seq(nl_backend *be, void *const *kseq, void *const *vseq, int bf16,
                            const float *qkv, int stride, int k_col, int v_col, const int32_t *pos,
                            int B, int T, int kv_dim)
{
    kv_store_seq_args a = {nl_ds_untag(kseq),
                           nl_ds_untag(vseq),
                           UF(qkv),
                           UI(pos),
                           bf16,
                           stride,
                           k_col,
                           v_col,
                           B,
                           T,
                           kv_dim};
    QUEUE(be, run_kv_store_seq, a);
}

typedef struct {
    uint16_t *kc, *vc;
    const float *qkv;
    const int32_t *pos;
    int stride, k_col, v_col, past, B, T, cap, kv_dim;
} kv_store_bf16_args;
static void run_kv_store_bf16(nl_backend *be, const void *p)
{
    const kv_store_bf16_args *a = p;
    nl_ds_cpu(be)->kv_store_bf16(nl_ds_cpu(be), a->kc, a->vc, a->qkv, a->stride, a->k_col, a->v_col,
                                 a->pos, a->past, a->B, a->T, a->cap, a->kv_dim);
}
static void ds_kv_store_bf16(nl_backend *be, uint16_t *kc, uint16_t *vc, const float *qkv,
                             int stride, int k_col, int v_col, const int32_t *pos, int past, int B,
                             int T, int cap, int kv_dim)
{
    kv_store_bf16_args a = {nl_ds_untag(kc),
                            nl_ds_untag(vc),
                            UF(qkv),
                            pos ? UI(pos) : NULL,
                            stride,
                            k_col,
                            v_col,
                            past,
                            B,
                            T,
                            cap,
                            kv_dim};
    QUEUE(be, run_kv_store_bf16, a);
}

/* ---------------------------------------------------------------- experts */

typedef struct {
    float *x;
    const float *y, *w;
    const int32_t *slot;
    int N, k, C;
} combine_args;
static void run_combine(nl_backend *be, const void *p)
{
    const combine_args *a = p;
    nl_ds_cpu(be)->moe_combine(nl_ds_cpu(be), a->x, a->y, a->slot, a->w, a->N, a->k, a->C);
}
static void ds_moe_combine(nl_backend *be, float *x, const float *y, const int32_t *slot,
                           const float *w, int N, int k, int C)
{
    combine_args a = {UF(x), UF(y), UF(w), UI(slot), N, k, C};
    QUEUE(be, run_combine, a);
}

typedef struct {
    int32_t *choice, *offsets, *perm, *slot;
    float *w;
    const float *probs;
    int N, E, k;
} route_args;
static void run_route(nl_backend *be, const void *p)
{
    const route_args *a = p;
    nl_ds_cpu(be)->moe_route(nl_ds_cpu(be), a->choice, a->w, a->offsets, a->perm, a->slot, a->probs,
                             a->N, a->E, a->k);
}
static void ds_moe_route(nl_backend *be, int32_t *choice, float *w, int32_t *offsets, int32_t *perm,
                         int32_t *slot, const float *probs, int N, int E, int k)
{
    route_args a = {UI(choice), UI(offsets), UI(perm), UI(slot), UF(w), UF(probs), N, E, k};
    QUEUE(be, run_route, a);
}

typedef struct {
    double *aux, rows;
    float *frac;
    int64_t *counts;
    const float *probs, *global_frac;
    const int32_t *offsets;
    int N, E, k;
} aux_args;
static void run_aux(nl_backend *be, const void *p)
{
    const aux_args *a = p;
    nl_ds_cpu(be)->moe_aux(nl_ds_cpu(be), a->aux, a->frac, a->counts, a->probs, a->offsets,
                           a->global_frac, a->N, a->E, a->k, a->rows);
}
static void ds_moe_aux(nl_backend *be, double *aux, float *frac, int64_t *counts,
                       const float *probs, const int32_t *offsets, const float *global_frac, int N,
                       int E, int k, double aux_rows)
{
    aux_args a = {nl_ds_untag(aux),
                  aux_rows,
                  UF(frac),
                  nl_ds_untag(counts),
                  UF(probs),
                  UF(global_frac),
                  UI(offsets),
                  N,
                  E,
                  k};
    QUEUE(be, run_aux, a);
}

typedef struct {
    int tb, N, K, lda, ldb, ldc, groups, max_rows;
    size_t b_stride;
    const float *A, *B; /* tagged: the run goes through the table's gemm */
    float *C;
    const int32_t *offsets;
} grouped_args;
static void run_grouped(nl_backend *be, const void *p)
{
    const grouped_args *a = p;
    /* the CPU backend's per-group calls, through the queuing table's gemm
     * (so a caller that wraps gemm, as core/model/batch.c does, sees every
     * call); the offsets are read now, as the device itself would */
    nl_cpu_gemm_grouped(be, a->tb, a->N, a->K, a->A, a->lda, a->B, a->ldb, a->b_stride, a->C,
                        a->ldc, a->offsets, a->groups, a->max_rows);
}
static void ds_gemm_grouped(nl_backend *be, int trans_b, int N, int K, const float *A, int lda,
                            const float *B, int ldb, size_t b_stride, float *C, int ldc,
                            const int32_t *offsets, int groups, int max_rows)
{
    grouped_args a = {trans_b,  N,        K, lda, ldb, ldc,        groups,
                      max_rows, b_stride, A, B,   C,   UI(offsets)};
    QUEUE(be, run_grouped, a);
}

typedef struct {
    float *ye, *hs, *gu;
    const float *xe, *experts;
    const int32_t *offsets;
    size_t expert_stride;
    int d, F, groups, max_rows;
} ffn_args;
static void run_ffn(nl_backend *be, const void *p)
{
    const ffn_args *a = p;
    nl_ds_cpu(be)->moe_ffn_forward(nl_ds_cpu(be), a->ye, a->hs, a->gu, a->xe, a->experts,
                                   a->expert_stride, a->d, a->F, a->offsets, a->groups,
                                   a->max_rows);
}
static void ds_moe_ffn_forward(nl_backend *be, float *ye, float *hs, float *gu, const float *xe,
                               const float *experts, size_t expert_stride, int d, int F,
                               const int32_t *offsets, int groups, int max_rows)
{
    ffn_args a = {UF(ye),        UF(hs), UF(gu), UF(xe), UF(experts), UI(offsets),
                  expert_stride, d,      F,      groups, max_rows};
    QUEUE(be, run_ffn, a);
}

/* ---------------------------------------------------------------- fused decode */

typedef struct {
    float *xn, *probs, *w;
    int32_t *choice;
    const float *x, *norm_w, *router;
    int N, d, E, k;
    float eps;
} norm_route_args;
static void run_norm_route(nl_backend *be, const void *p)
{
    const norm_route_args *a = p;
    nl_ds_cpu(be)->moe_norm_route(nl_ds_cpu(be), a->xn, a->probs, a->choice, a->w, a->x, a->norm_w,
                                  a->router, a->N, a->d, a->E, a->k, a->eps);
}
static void ds_moe_norm_route(nl_backend *be, float *xn, float *probs, int32_t *choice, float *w,
                              const float *x, const float *norm_w, const float *router, int N,
                              int d, int E, int k, float eps)
{
    norm_route_args a = {UF(xn),     UF(probs), UF(w), UI(choice), UF(x), UF(norm_w),
                         UF(router), N,         d,     E,          k,     eps};
    QUEUE(be, run_norm_route, a);
}

typedef struct {
    float *hs, *gu;
    const float *xn, *experts;
    const int32_t *choice;
    size_t expert_stride;
    int N, k, d, F;
} gate_up_args;
static void run_gate_up(nl_backend *be, const void *p)
{
    const gate_up_args *a = p;
    nl_ds_cpu(be)->moe_gate_up(nl_ds_cpu(be), a->hs, a->gu, a->xn, a->choice, a->experts,
                               a->expert_stride, a->N, a->k, a->d, a->F);
}
static void ds_moe_gate_up(nl_backend *be, float *hs, float *gu, const float *xn,
                           const int32_t *choice, const float *experts, size_t expert_stride, int N,
                           int k, int d, int F)
{
    gate_up_args a = {UF(hs), UF(gu), UF(xn), UF(experts), UI(choice), expert_stride, N, k, d, F};
    QUEUE(be, run_gate_up, a);
}

typedef struct {
    float *x, *ye;
    const float *hs, *w, *experts;
    const int32_t *choice;
    size_t expert_stride;
    int N, k, d, F;
} down_args;
static void run_down(nl_backend *be, const void *p)
{
    const down_args *a = p;
    nl_ds_cpu(be)->moe_down_combine(nl_ds_cpu(be), a->x, a->ye, a->hs, a->choice, a->w, a->experts,
                                    a->expert_stride, a->N, a->k, a->d, a->F);
}
static void ds_moe_down_combine(nl_backend *be, float *x, float *ye, const float *hs,
                                const int32_t *choice, const float *w, const float *experts,
                                size_t expert_stride, int N, int k, int d, int F)
{
    down_args a = {UF(x), UF(ye), UF(hs), UF(w), UF(experts), UI(choice), expert_stride,
                   N,     k,      d,      F};
    QUEUE(be, run_down, a);
}

/* ---------------------------------------------------------------- graphs */

static void ds_graph_free(nl_backend *be, void *graph)
{
    (void)be;
    nl_ds_graph *g = graph;
    if (g) {
        free(g->ops);
        free(g);
    }
}

static void ds_graph_begin(nl_backend *be)
{
    nl_ds_ctx *c = ctx_of(be);
    ds_graph_free(be, c->rec);
    c->rec = calloc(1, sizeof *c->rec);
    c->refused = NULL;
    if (!c->rec)
        c->refused = "graph_begin (out of memory)";
}

static nl_status ds_graph_end(nl_backend *be, void **graph, nl_error *err)
{
    nl_ds_ctx *c = ctx_of(be);
    nl_ds_graph *g = c->rec;
    const char *refused = c->refused;
    c->rec = NULL;
    c->refused = NULL;
    *graph = NULL;
    if (!g || g->failed || refused) {
        ds_graph_free(be, g);
        return nl_error_set(err, refused || !g ? NL_ERR_UNSUPPORTED : NL_ERR_NOMEM,
                            "cpu-devsim: step not recorded (%s)",
                            refused ? refused : "out of memory");
    }
    *graph = g;
    return NL_OK;
}

static int ds_graph_launch(nl_backend *be, void *graph)
{
    (void)be;
    const nl_ds_graph *g = graph;
    for (int i = 0; i < g->n; i++)
        g->ops[i].run(g->ops[i].be, g->ops[i].args);
    return 0;
}

void nl_devsim_fill_graph_slots(nl_backend *be)
{
    nl_backend *in = nl_ds_cpu(be);
    be->zero = ds_zero;
    be->gemm = ds_gemm;
    be->gemm_rows = in->gemm_rows ? ds_gemm_rows : NULL;
    be->embedding_forward = ds_embedding_forward;
    be->rmsnorm_forward = ds_rmsnorm_forward;
    be->rope_forward = ds_rope_forward;
    be->rope_scaled_forward = ds_rope_scaled_forward;
    be->attention_forward = ds_attention_forward;
    be->attention_masked_forward = ds_attention_masked_forward;
    be->geglu_forward = ds_geglu_forward;
    be->softmax_forward = ds_softmax_forward;
    be->swiglu_forward = ds_swiglu_forward;
    be->gather_rows = ds_gather_rows;
    be->copy_rows = ds_copy_rows;
    be->kv_store = ds_kv_store;
    be->kv_store_seq = in->kv_store_seq ? ds_kv_store_seq : NULL;
    be->kv_store_bf16 = ds_kv_store_bf16;
    be->moe_combine = ds_moe_combine;
    be->moe_route = ds_moe_route;
    be->moe_aux = ds_moe_aux;
    be->gemm_grouped = ds_gemm_grouped;
    be->moe_ffn_forward = ds_moe_ffn_forward;
    if (in->moe_norm_route) {
        be->moe_norm_route = ds_moe_norm_route;
        be->moe_gate_up = ds_moe_gate_up;
        be->moe_down_combine = ds_moe_down_combine;
    }
    be->graph_begin = ds_graph_begin;
    be->graph_end = ds_graph_end;
    be->graph_launch = ds_graph_launch;
    be->graph_free = ds_graph_free;
}
