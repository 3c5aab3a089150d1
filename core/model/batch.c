/* Batched decoding of independent sequences (see batch.h): shared GEMMs
 * over every row of the batch, attention per sequence with its own cache
 * (one call over each run of consecutive sequences decoding a position),
 * and every GEMM row-invariant (the backend's gemm_rows and
 * gemm_grouped_rows, with the fused decode slots, which compute a row the
 * same way, below NL_BACKEND_FUSED_ROWS rows; or, where the backend has
 * no gemm_rows, small GEMMs padded to NL_BATCH_MIN_ROWS rows and the
 * separate slots) so that a row's result never depends on the batch
 * around it. Where gemm_rows is fast only at a few rows (gemm_rows_few:
 * CUDA), a step of NL_BACKEND_FUSED_ROWS rows or more (a prompt's chunk)
 * runs gemm, as one prompt alone does: invariance holds for the decode
 * steps, and the prompts keep cuBLAS's speed. */
#include "core/model/batch.h"

#include "core/model/layer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- padded GEMM */

/* The model's backend with one slot changed: gemm computes every row
 * the same way whatever M is. Through the backend's gemm_rows where it
 * has one and the call is a plain product (alpha 1, beta 0 or 1: all but
 * an adapter's scaled one), for every M, since its bits need not equal
 * gemm's; otherwise through gemm with a small M padded to
 * NL_BATCH_MIN_ROWS rows in device scratch. The table is a
 * copy, so every other slot sees the same ctx; `be` must stay the first
 * member. */
typedef struct pad_backend {
    nl_backend be;
    nl_backend *inner;
    float *a_pad, *c_pad; /* (MIN_ROWS, k_max), (MIN_ROWS, n_max) */
    int k_max, n_max;
} pad_backend;

static void pad_gemm(nl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                     const float *A, int lda, const float *B, int ldb, float beta, float *C,
                     int ldc)
{
    pad_backend *p = (pad_backend *)be;
    nl_backend *in = p->inner;
    const int R = NL_BATCH_MIN_ROWS;
    const int rows_ok = in->gemm_rows && !(in->gemm_rows_few && M >= NL_BACKEND_FUSED_ROWS);
    if (rows_ok && !trans_a && alpha == 1.0f && (beta == 0.0f || beta == 1.0f)) {
        in->gemm_rows(in, trans_b, M, N, K, A, lda, B, ldb, beta != 0.0f, C, ldc);
        return;
    }
    if (trans_a || M >= R || K > p->k_max || N > p->n_max) {
        in->gemm(in, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    in->copy_rows(in, p->a_pad, K, A, lda, M, K);
    if (beta != 0.0f)
        in->copy_rows(in, p->c_pad, N, C, ldc, M, N);
    in->gemm(in, 0, trans_b, R, N, K, alpha, p->a_pad, K, B, ldb, beta, p->c_pad, N);
    in->copy_rows(in, C, ldc, p->c_pad, N, M, N);
}

/* The expert products of a dispatch: where the backend has a row-invariant
 * grouped GEMM (CUDA), every row through it, as gemm_rows computes it and
 * as the fused decode slots do; the CPU's gemm_grouped comes back through
 * pad_gemm by itself. */
static void pad_grouped(nl_backend *be, int trans_b, int N, int K, const float *A, int lda,
                        const float *B, int ldb, size_t b_stride, float *C, int ldc,
                        const int32_t *offsets, int groups, int max_rows)
{
    nl_backend *in = ((pad_backend *)be)->inner;
    /* max_rows is the dispatch's token count (layer.c): a step's rows */
    if (trans_b && !(in->gemm_rows_few && max_rows >= NL_BACKEND_FUSED_ROWS))
        in->gemm_grouped_rows(in, N, K, A, lda, B, ldb, b_stride, C, ldc, offsets, groups,
                              max_rows);
    else
        in->gemm_grouped(be, trans_b, N, K, A, lda, B, ldb, b_stride, C, ldc, offsets, groups,
                         max_rows);
}

/* ---------------------------------------------------------------- state */

/* A recorded decode step (every segment T 1) and what it holds besides
 * device memory: the model and its generation, the segments' caches (each
 * one's buffers and capacity) in order, which of them want logits. */
typedef struct seg_key {
    const void *kc, *vc;
    int cap, want;
} seg_key;

typedef struct batch_graph {
    void *g; /* the backend's recorded step, or NULL (a free entry) */
    const nl_model *m;
    uint64_t generation;
    int n;        /* segments */
    seg_key *key; /* (max_rows) */
    uint64_t used;
} batch_graph;

#define BATCH_GRAPHS 8  /* recorded steps kept per batch */
#define BATCH_THRASH 16 /* recordings before their replays are judged */

struct nl_batch {
    nl_model *m;
    nl_model view; /* the model computing through `pad` */
    pad_backend pad;
    int max_rows;
    nl_layer_acts acts;        /* inference set: residual in acts.x_in */
    int32_t *tokens_h, *pos_h; /* (max_rows) host */
    int32_t *tokens_d, *pos_d; /* (max_rows) */
    float *last, *xnf;         /* (max_rows, d) */
    float *logits_d;           /* (max_rows, V) */
    float *logits_h;           /* (max_rows, V) host */
    float *hidden_h;           /* (max_rows, d) host: embeddings, a stage's output */
    int *logit_row;            /* (max_rows) segment -> row of logits_h, or -1 */
    int n_segs;                /* segments of the last call */
    int logit_rows;            /* rows of logits_d the last call wrote */
    int logits_down;           /* 1: logits_h holds them (downloaded on first use) */
    int *seg_row;              /* (max_rows) segment -> its first row of hidden_h */
    /* a call with runs of segments decoding one position (multi): each
     * stage layer's caches as arrays of device pointers, (layers, 2, n)
     * for the call's n segments, the keys' then the values' (room for
     * max_rows); the device copy is uploaded when its content changes */
    const void **seq_h;
    void **seq_d;
    int seq_layers;
    int seq_n; /* segments the device copy holds (0: none) */
    int multi; /* this call: one attention call a layer over every segment */
    nl_batch_call_stats calls;
    batch_graph graphs[BATCH_GRAPHS];
    uint64_t tick;
    int graphs_off; /* NL_GRAPHS=0, nl_batch_set_graphs, or a refused recording */
    nl_runstate_graph_stats gs;
};

static int imax(int a, int b)
{
    return a > b ? a : b;
}

nl_status nl_batch_new(nl_batch **out, nl_model *m, int max_rows, nl_error *err)
{
    *out = NULL;
    const nl_config *c = &m->cfg;
    if (m->l0 < 0 || m->l1 < m->l0 || m->l1 > c->num_layers)
        return nl_error_set(err, NL_ERR_INVALID, "batch: layers [%d, %d) of a model of %d", m->l0,
                            m->l1, c->num_layers);
    if (max_rows < 1)
        return nl_error_set(err, NL_ERR_INVALID, "batch: max_rows %d must be positive", max_rows);
    nl_batch *b = calloc(1, sizeof *b);
    if (!b)
        return nl_error_set(err, NL_ERR_NOMEM, "batch: out of memory");
    nl_backend *be = m->be;
    const int hd = nl_config_head_dim(c), d = c->hidden_dim, V = (int)c->vocab_size;
    const int qkv = (c->num_heads + 2 * c->num_kv_heads) * hd, F = c->ffn_dim;
    const size_t N = (size_t)max_rows, R = NL_BATCH_MIN_ROWS;
    b->m = m;
    b->max_rows = max_rows;
    b->pad.be = *be;
    b->pad.be.gemm = pad_gemm;
    /* the fused expert pass would run its GEMMs inside the backend, past
     * pad_gemm: the separate grouped calls come back through it */
    b->pad.be.moe_ffn_forward = NULL;
    if (be->gemm_grouped_rows)
        b->pad.be.gemm_grouped = pad_grouped;
    /* the fused decode slots compute a row as gemm_rows (and
     * gemm_grouped_rows) do where the backend has it (the CPU in FP32,
     * CUDA in FP32 and bf16); elsewhere their bits differ from the padded GEMMs', and a
     * row's would depend on whether the batch has fewer than
     * NL_BACKEND_FUSED_ROWS rows */
    if (!be->gemm_rows) {
        b->pad.be.moe_norm_route = NULL;
        b->pad.be.moe_gate_up = NULL;
        b->pad.be.moe_down_combine = NULL;
    }
    b->pad.inner = be;
    b->pad.k_max = imax(imax(d, c->num_heads * hd), F);
    b->pad.n_max = imax(imax(qkv, d), imax(imax(c->num_experts, 2 * F), m->has_head ? V : 1));
    b->view = *m;
    b->view.be = &b->pad.be;
    nl_status st = nl_layer_acts_alloc(&b->acts, be, c, max_rows, 0, err);
    if (st != NL_OK) {
        free(b);
        return st;
    }
    b->acts.fused = 1; /* nothing reads a batch's aux loss */
    int ok = 1;
    ok &= (b->pad.a_pad = be->alloc(be, R * (size_t)b->pad.k_max * sizeof(float))) != NULL;
    ok &= (b->pad.c_pad = be->alloc(be, R * (size_t)b->pad.n_max * sizeof(float))) != NULL;
    ok &= (b->tokens_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
    ok &= (b->pos_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
    ok &= (b->last = be->alloc(be, N * d * sizeof(float))) != NULL;
    ok &= (b->xnf = be->alloc(be, N * d * sizeof(float))) != NULL;
    if (m->has_head) /* a stage without the head gives hidden states only */
        ok &= (b->logits_d = be->alloc(be, N * V * sizeof(float))) != NULL;
    ok &= (b->tokens_h = calloc(N, sizeof(int32_t))) != NULL;
    ok &= (b->pos_h = calloc(N, sizeof(int32_t))) != NULL;
    if (m->has_head)
        ok &= (b->logits_h = calloc(N * V, sizeof(float))) != NULL;
    ok &= (b->hidden_h = calloc(N * d, sizeof(float))) != NULL;
    ok &= (b->logit_row = calloc(N, sizeof(int))) != NULL;
    ok &= (b->seg_row = calloc(N, sizeof(int))) != NULL;
    b->seq_layers = m->l1 - m->l0;
    if (b->seq_layers > 0 && max_rows > 1) {
        const size_t n_ptr = (size_t)b->seq_layers * 2 * N;
        ok &= (b->seq_h = calloc(n_ptr, sizeof(void *))) != NULL;
        ok &= (b->seq_d = be->alloc(be, n_ptr * sizeof(void *))) != NULL;
    }
    for (int i = 0; i < BATCH_GRAPHS; i++)
        ok &= (b->graphs[i].key = calloc(N, sizeof(seg_key))) != NULL;
    const char *g = getenv("NL_GRAPHS");
    b->graphs_off = g && strcmp(g, "0") == 0;
    if (!ok) {
        nl_batch_destroy(&b);
        return nl_error_set(err, NL_ERR_NOMEM, "batch: cannot allocate activations for %d rows",
                            max_rows);
    }
    *out = b;
    return NL_OK;
}

void nl_batch_destroy(nl_batch **bp)
{
    if (!bp || !*bp)
        return;
    nl_batch *b = *bp;
    nl_backend *be = b->m->be;
    for (int i = 0; i < BATCH_GRAPHS; i++) {
        if (b->graphs[i].g)
            be->graph_free(be, b->graphs[i].g);
        free(b->graphs[i].key);
    }
    nl_layer_acts_free(&b->acts, be);
    void *dev[] = {b->pad.a_pad, b->pad.c_pad, b->tokens_d, b->pos_d,
                   b->last,      b->xnf,       b->logits_d, b->seq_d};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        be->free(be, dev[i]);
    free(b->tokens_h);
    free(b->pos_h);
    free(b->logits_h);
    free(b->hidden_h);
    free(b->logit_row);
    free(b->seg_row);
    free(b->seq_h);
    free(b);
    *bp = NULL;
}

const float *nl_batch_logits(nl_batch *b, int i, nl_error *err)
{
    const size_t V = (size_t)b->m->cfg.vocab_size;
    if (!b->m->has_head || i < 0 || i >= b->n_segs || b->logit_row[i] < 0) {
        nl_error_set(err, NL_ERR_INVALID, "batch: segment %d has no logits", i);
        return NULL;
    }
    if (!b->logits_down) { /* every row of the call in one download */
        nl_backend *be = b->m->be;
        be->download(be, b->logits_h, b->logits_d, (size_t)b->logit_rows * V * sizeof(float));
        if (nl_backend_check(be, err) != NL_OK)
            return NULL;
        b->logits_down = 1;
    }
    return b->logits_h + (size_t)b->logit_row[i] * V;
}

const float *nl_batch_logits_device(const nl_batch *b, int i)
{
    if (!b->m->has_head || i < 0 || i >= b->n_segs || b->logit_row[i] < 0)
        return NULL;
    return b->logits_d + (size_t)b->logit_row[i] * b->m->cfg.vocab_size;
}

const float *nl_batch_hidden(const nl_batch *b, int i)
{
    if (b->m->has_head || i < 0 || i >= b->max_rows)
        return NULL;
    return b->hidden_h + (size_t)b->seg_row[i] * b->m->cfg.hidden_dim;
}

/* ---------------------------------------------------------------- forward */

static nl_status check_segs(const nl_batch *b, const nl_batch_seg *segs, const float *const *x,
                            int n, int *rows, nl_error *err)
{
    const nl_model *m = b->m;
    long N = 0;
    if (n < 1)
        return nl_error_set(err, NL_ERR_INVALID, "batch: no segments");
    for (int i = 0; i < n; i++) {
        const nl_batch_seg *s = &segs[i];
        if (!s->kv || s->T < 1 || (m->has_embed ? !s->tokens : !x || !x[i]))
            return nl_error_set(err, NL_ERR_INVALID, "batch: segment %d has no cache or %s", i,
                                m->has_embed ? "tokens" : "hidden states");
        if (s->kv->B != 1 || s->kv->n_layers != m->l1 - m->l0)
            return nl_error_set(err, NL_ERR_SHAPE,
                                "batch: segment %d's cache holds %d sequences of %d layers", i,
                                s->kv->B, s->kv->n_layers);
        if (s->kv->len + s->T > s->kv->cap)
            return nl_error_set(err, NL_ERR_RANGE,
                                "batch: segment %d: %d cached + %d new positions exceed its %d", i,
                                s->kv->len, s->T, s->kv->cap);
        for (int t = 0; m->has_embed && t < s->T; t++)
            if (s->tokens[t] < 0 || s->tokens[t] >= m->cfg.vocab_size)
                return nl_error_set(err, NL_ERR_RANGE,
                                    "batch: segment %d: token %d is outside the vocabulary 0..%lld",
                                    i, s->tokens[t], (long long)m->cfg.vocab_size - 1);
        N += s->T;
    }
    if (N > b->max_rows)
        return nl_error_set(err, NL_ERR_SHAPE, "batch: %ld rows exceed the batch's %d", N,
                            b->max_rows);
    *rows = (int)N;
    return NL_OK;
}

/* One segment's rows into its cache, then its attention: the calls a
 * lone sequence makes. */
static void attend_one(nl_batch *b, int li, const nl_batch_seg *sg, int row)
{
    nl_backend *be = b->m->be;
    const nl_config *c = &b->m->cfg;
    const int hd = nl_config_head_dim(c), H = c->num_heads, G = c->num_kv_heads;
    const int qkv = (H + 2 * G) * hd;
    nl_kvcache *kv = sg->kv;
    const float *q = b->acts.qkv + (size_t)row * qkv;
    const void *k = NULL, *v = NULL;
    nl_attn_shape s = {.B = 1,
                       .T = sg->T,
                       .past = kv->len,
                       .kv_cap = kv->cap,
                       .H = H,
                       .G = G,
                       .hd = hd,
                       .kv_bf16 = kv->dtype == NL_KV_BF16};
    if (b->acts.dev_past) { /* a recorded step: positions read on the device */
        nl_kvcache_store(kv, li, q, qkv, H * hd, (H + G) * hd, 1, sg->T, b->pos_d + row, &k, &v);
        s.past = 0;
        s.pos = b->pos_d + row;
    } else {
        nl_kvcache_append(kv, li, q, qkv, H * hd, (H + G) * hd, 1, sg->T, kv->len, &k, &v);
    }
    b->calls.kv_writes++;
    be->attention_forward(be, b->acts.att + (size_t)row * H * hd, NULL, q, qkv, k, v, kv->kv_dim,
                          s);
    b->calls.attention++;
}

/* n >= 2 consecutive segments that decode one position each, the first
 * the call's segment i0 at row `row`: their rows into their caches (one
 * kv_store_seq where the backend has it), then one attention call over
 * them, each sequence's cache from the layer's pointer arrays and its
 * past from pos_d (upload_inputs wrote both). */
static void attend_run(nl_batch *b, int li, const nl_batch_seg *segs, int n, int i0, int row)
{
    nl_backend *be = b->m->be;
    const nl_config *c = &b->m->cfg;
    const int hd = nl_config_head_dim(c), H = c->num_heads, G = c->num_kv_heads;
    const int qkv = (H + 2 * G) * hd;
    const size_t R = (size_t)b->seq_n; /* the call's segments (upload_seqs) */
    void **seq = b->seq_d + (size_t)li * 2 * R + i0;
    const int kv_bf16 = segs[0].kv->dtype == NL_KV_BF16, kv_dim = segs[0].kv->kv_dim;
    const float *q = b->acts.qkv + (size_t)row * qkv;
    if (be->kv_store_seq) {
        be->kv_store_seq(be, seq, seq + R, kv_bf16, q, qkv, H * hd, (H + G) * hd, b->pos_d + row, n,
                         1, kv_dim);
        b->calls.kv_writes++;
    }
    int cap = segs[0].kv->cap;
    for (int i = 0; i < n; i++) {
        nl_kvcache *kv = segs[i].kv;
        const void *k, *v;
        const float *qi = q + (size_t)i * qkv;
        cap = kv->cap < cap ? kv->cap : cap;
        if (be->kv_store_seq)
            continue;
        if (b->acts.dev_past)
            nl_kvcache_store(kv, li, qi, qkv, H * hd, (H + G) * hd, 1, 1, b->pos_d + row + i, &k,
                             &v);
        else
            nl_kvcache_append(kv, li, qi, qkv, H * hd, (H + G) * hd, 1, 1, kv->len, &k, &v);
        b->calls.kv_writes++;
    }
    const void *k0, *v0; /* checked non-NULL; the sequences' own are read */
    nl_kvcache_layer(segs[0].kv, li, &k0, &v0);
    const nl_attn_shape s = {.B = n,
                             .T = 1,
                             .kv_cap = cap,
                             .H = H,
                             .G = G,
                             .hd = hd,
                             .pos = b->pos_d + row,
                             .kv_bf16 = kv_bf16,
                             .kseq = (const void *const *)seq,
                             .vseq = (const void *const *)(seq + R)};
    be->attention_forward(be, b->acts.att + (size_t)row * H * hd, NULL, q, qkv, k0, v0, kv_dim, s);
    b->calls.attention++;
}

/* Attention of every segment over its own cache, after the batch's QKV
 * GEMM and RoPE: each run of two or more consecutive segments that
 * decode one position (b->multi: the pointer arrays are uploaded) in one
 * call (attend_run), every other segment alone (attend_one). */
static void attend_segments(nl_batch *b, int li, const nl_batch_seg *segs, int n)
{
    int row = 0;
    for (int i = 0; i < n;) {
        int j = i + 1;
        while (b->multi && segs[i].T == 1 && j < n && segs[j].T == 1)
            j++;
        if (j - i >= 2) {
            attend_run(b, li, segs + i, j - i, i, row);
            row += j - i;
        } else {
            attend_one(b, li, &segs[i], row);
            row += segs[i].T;
        }
        i = j;
    }
}

/* A call with a run of two or more consecutive segments that decode one
 * position, every cache of one type: its runs' attention can be one call
 * each (attend_segments), through the pointer arrays. */
static int multi_step(const nl_batch *b, const nl_batch_seg *segs, int n)
{
    if (n < 2 || !b->seq_d)
        return 0;
    int run = 0, best = 0;
    for (int i = 0; i < n; i++) {
        if (segs[i].kv->dtype != segs[0].kv->dtype)
            return 0;
        run = segs[i].T == 1 ? run + 1 : 0;
        best = run > best ? run : best;
    }
    return best >= 2;
}

/* The layers' pointer arrays for the call's n segments' caches, (layers,
 * 2, n), uploaded when they differ from the device's copy (a session
 * joined or left): at most layers x 2 x n pointers. */
static void upload_seqs(nl_batch *b, const nl_batch_seg *segs, int n)
{
    nl_backend *be = b->m->be;
    const size_t R = (size_t)n;
    int same = b->seq_n == n;
    for (int l = 0; l < b->seq_layers; l++) {
        const void **row = b->seq_h + (size_t)l * 2 * R;
        for (int i = 0; i < n; i++) {
            const void *k, *v;
            nl_kvcache_layer(segs[i].kv, l, &k, &v);
            same &= row[i] == k && row[R + i] == v;
            row[i] = k;
            row[R + i] = v;
        }
    }
    if (!same) {
        be->upload(be, b->seq_d, b->seq_h, (size_t)b->seq_layers * 2 * R * sizeof(void *));
        b->seq_n = n;
    }
}

/* The host part of a call: the rows' tokens and positions (and a later
 * stage's hidden states) uploaded into the batch's buffers. */
static void upload_inputs(nl_batch *b, const nl_batch_seg *segs, const float *const *x, int n,
                          int N)
{
    nl_model *vm = &b->view;
    nl_backend *be = vm->be;
    const int d = vm->cfg.hidden_dim;
    int row = 0;
    for (int i = 0; i < n; i++) {
        b->seg_row[i] = row;
        if (!vm->has_embed) /* a later stage: the previous stage's hidden states */
            be->upload(be, b->acts.x_in + (size_t)row * d, x[i],
                       (size_t)segs[i].T * d * sizeof(float));
        for (int t = 0; t < segs[i].T; t++, row++) {
            b->tokens_h[row] = vm->has_embed ? segs[i].tokens[t] : 0;
            b->pos_h[row] = segs[i].kv->len + t;
        }
    }
    be->upload(be, b->pos_d, b->pos_h, (size_t)N * sizeof(int32_t));
    if (vm->has_embed)
        be->upload(be, b->tokens_d, b->tokens_h, (size_t)N * sizeof(int32_t));
    b->multi = multi_step(b, segs, n);
    if (b->multi)
        upload_seqs(b, segs, n);
}

/* Embedding and every layer over the segments' N rows, after
 * upload_inputs; the residual stream ends in acts.x_in. Queues device
 * work only, so it can be recorded. */
static void queue_layers(nl_batch *b, const nl_batch_seg *segs, int n, int N)
{
    nl_model *vm = &b->view;
    nl_backend *be = vm->be;
    const nl_config *c = &vm->cfg;
    const int d = c->hidden_dim, hd = nl_config_head_dim(c);
    const int H = c->num_heads, G = c->num_kv_heads, qkv = (H + 2 * G) * hd;
    nl_layer_acts *a = &b->acts;
    if (vm->has_embed)
        be->embedding_forward(be, a->x_in, b->tokens_d, vm->tok_embeddings, N, d);
    for (int l = vm->l0; l < vm->l1; l++) {
        const nl_layer_weights *w = &vm->layers[l - vm->l0];
        be->rmsnorm_forward(be, a->xn1, NULL, a->x_in, w->attention_norm, N, d, (float)c->norm_eps);
        be->gemm(be, 0, 1, N, qkv, d, 1.0f, a->xn1, d, w->wqkv, d, 0.0f, a->qkv, qkv);
        be->rope_forward(be, a->qkv, b->pos_d, N, qkv, 0, H + G, hd, (float)c->rope_base);
        attend_segments(b, l - vm->l0, segs, n);
        be->gemm(be, 0, 1, N, d, H * hd, 1.0f, a->att, H * hd, w->wo, H * hd, 1.0f, a->h1, d);
        nl_layer_ffn_forward(vm, l, a, N);
    }
}

/* The head over the last row of each segment that wants logits (the rows
 * numbered by logit_row, `want` of them). */
static void queue_head(nl_batch *b, const nl_batch_seg *segs, int n, int want)
{
    nl_backend *be = b->view.be;
    const nl_config *c = &b->m->cfg;
    const int d = c->hidden_dim, V = (int)c->vocab_size;
    int row = 0;
    for (int i = 0; i < n; i++) {
        row += segs[i].T;
        if (b->logit_row[i] >= 0)
            be->copy_rows(be, b->last + (size_t)b->logit_row[i] * d, d,
                          b->acts.x_in + (size_t)(row - 1) * d, d, 1, d);
    }
    if (want > 0) {
        be->rmsnorm_forward(be, b->xnf, NULL, b->last, b->m->norm, want, d, (float)c->norm_eps);
        be->gemm(be, 0, 1, want, V, d, 1.0f, b->xnf, d, b->m->lm_head, d, 0.0f, b->logits_d, V);
    }
}

/* upload_inputs, queue_layers and queue_head, unrecorded (a prompt, the
 * embedding's chunks). */
static void run_layers(nl_batch *b, const nl_batch_seg *segs, const float *const *x, int n, int N)
{
    upload_inputs(b, segs, x, n, N);
    queue_layers(b, segs, n, N);
}

/* ---------------------------------------------------------------- recorded steps */

void nl_batch_set_graphs(nl_batch *b, int on)
{
    b->graphs_off = !on;
}

nl_runstate_graph_stats nl_batch_graphs(const nl_batch *b)
{
    return b->gs;
}

nl_batch_call_stats nl_batch_calls(const nl_batch *b)
{
    return b->calls;
}

/* A decode call (every segment one position) on a backend with graph
 * slots and kv_store can be recorded: its positions are on the device. */
static int step_recordable(const nl_batch *b, const nl_batch_seg *segs, int n)
{
    const nl_backend *be = b->m->be;
    if (b->graphs_off || !be->graph_begin || !be->kv_store || b->m->lora || b->acts.host_routing)
        return 0;
    for (int i = 0; i < n; i++)
        if (segs[i].T != 1)
            return 0;
    return 1;
}

static int key_matches(const batch_graph *bg, const nl_batch *b, const nl_batch_seg *segs, int n)
{
    if (bg->m != b->m || bg->generation != b->m->generation || bg->n != n)
        return 0;
    for (int i = 0; i < n; i++) {
        const seg_key *k = &bg->key[i];
        if (k->kc != segs[i].kv->k || k->vc != segs[i].kv->v || k->cap != segs[i].kv->cap ||
            k->want != (b->logit_row[i] >= 0))
            return 0;
    }
    return 1;
}

/* The entry to record into: a free one, else the least recently used. */
static batch_graph *graph_slot(nl_batch *b)
{
    nl_backend *be = b->m->be;
    batch_graph *best = &b->graphs[0];
    for (int i = 0; i < BATCH_GRAPHS; i++) {
        batch_graph *bg = &b->graphs[i];
        if (!bg->g)
            return bg;
        if (bg->used < best->used)
            best = bg;
    }
    be->graph_free(be, best->g);
    best->g = NULL;
    return best;
}

/* Replay the recording of this step's key, or record one (dropping the
 * recordings of the model's older generations: a growth or a reload) and
 * run it. A step the backend cannot record runs as it is, and this batch
 * records no more; so does one whose recordings, past BATCH_THRASH, are
 * replayed less than twice each (members changing at every step). */
static void run_recorded(nl_batch *b, const nl_batch_seg *segs, int n, int N, int want)
{
    nl_backend *be = b->m->be;
    b->tick++;
    for (int i = 0; i < BATCH_GRAPHS; i++) {
        batch_graph *bg = &b->graphs[i];
        if (!bg->g)
            continue;
        if (bg->m == b->m && bg->generation != b->m->generation) {
            be->graph_free(be, bg->g); /* the model changed: never valid again */
            bg->g = NULL;
            continue;
        }
        if (!key_matches(bg, b, segs, n))
            continue;
        if (be->graph_launch(be, bg->g) == 0) {
            bg->used = b->tick;
            b->gs.replays++;
            return;
        }
        be->graph_free(be, bg->g); /* the backend invalidated it: record again */
        bg->g = NULL;
    }
    batch_graph *bg = graph_slot(b);
    nl_error e = {0};
    void *g = NULL;
    b->acts.dev_past = 1;
    be->graph_begin(be);
    queue_layers(b, segs, n, N);
    queue_head(b, segs, n, want);
    const nl_status st = be->graph_end(be, &g, &e);
    b->acts.dev_past = 0;
    if (st != NL_OK || be->graph_launch(be, g) != 0) {
        if (g)
            be->graph_free(be, g);
        b->graphs_off = 1;
        b->gs.failed++;
        queue_layers(b, segs, n, N);
        queue_head(b, segs, n, want);
        return;
    }
    bg->g = g;
    bg->m = b->m;
    bg->generation = b->m->generation;
    bg->n = n;
    bg->used = b->tick;
    for (int i = 0; i < n; i++)
        bg->key[i] = (seg_key){.kc = segs[i].kv->k,
                               .vc = segs[i].kv->v,
                               .cap = segs[i].kv->cap,
                               .want = b->logit_row[i] >= 0};
    b->gs.captures++;
    if (b->gs.captures >= BATCH_THRASH && b->gs.replays < 2 * b->gs.captures)
        b->graphs_off = 1;
}

nl_status nl_batch_forward(nl_batch *b, const nl_batch_seg *segs, int n, nl_error *err)
{
    return nl_batch_forward_hidden(b, segs, NULL, n, err);
}

nl_status nl_batch_forward_hidden(nl_batch *b, const nl_batch_seg *segs, const float *const *x,
                                  int n, nl_error *err)
{
    nl_backend *be = b->view.be;
    const int d = b->m->cfg.hidden_dim;
    int N = 0;
    nl_status st = check_segs(b, segs, x, n, &N, err);
    if (st != NL_OK)
        return st;
    int want = 0;
    for (int i = 0; i < n; i++)
        b->logit_row[i] = b->m->has_head && segs[i].want_logits ? want++ : -1;
    upload_inputs(b, segs, x, n, N);
    if (step_recordable(b, segs, n)) {
        run_recorded(b, segs, n, N, want);
    } else {
        queue_layers(b, segs, n, N);
        queue_head(b, segs, n, want);
    }
    for (int i = 0; i < n; i++)
        segs[i].kv->len += segs[i].T;
    b->n_segs = n;
    b->logit_rows = want;
    b->logits_down = 0;
    if (!b->m->has_head) /* a stage's output: every row's hidden state */
        be->download(be, b->hidden_h, b->acts.x_in, (size_t)N * d * sizeof(float));
    return nl_backend_check(b->m->be, err); /* a device's asynchronous error */
}

/* ---------------------------------------------------------------- embeddings */

nl_status nl_batch_embed(nl_batch *b, const int32_t *tokens, int T, float *out, nl_error *err)
{
    nl_backend *be = b->view.be;
    const nl_config *c = &b->m->cfg;
    const int d = c->hidden_dim;
    nl_kvcache *kv = NULL;
    double *sum = calloc((size_t)d, sizeof *sum);
    nl_status st = NL_OK;
    if (!sum)
        return nl_error_set(err, NL_ERR_NOMEM, "embed: out of memory");
    if (!b->m->has_embed || !b->m->has_head || b->m->l0 != 0 || b->m->l1 != c->num_layers) {
        st = nl_error_set(err, NL_ERR_INVALID, "embed: needs a whole model");
        goto out;
    }
    if (T < 1 || T > c->max_seq_len) {
        st = nl_error_set(err, NL_ERR_RANGE, "embed: %d tokens, outside 1..%d", T, c->max_seq_len);
        goto out;
    }
    if ((st = nl_kvcache_new(&kv, b->m, 1, T, NL_KV_FP32, err)) != NL_OK)
        goto out;
    for (int t0 = 0; t0 < T; t0 += b->max_rows) {
        const int n = T - t0 < b->max_rows ? T - t0 : b->max_rows;
        nl_batch_seg s = {.kv = kv, .tokens = tokens + t0, .T = n};
        int N = 0;
        if ((st = check_segs(b, &s, NULL, 1, &N, err)) != NL_OK)
            goto out;
        run_layers(b, &s, NULL, 1, N);
        kv->len += n;
        be->rmsnorm_forward(be, b->xnf, NULL, b->acts.x_in, b->m->norm, n, d, (float)c->norm_eps);
        be->download(be, b->hidden_h, b->xnf, (size_t)n * d * sizeof(float));
        if ((st = nl_backend_check(b->m->be, err)) != NL_OK)
            goto out;
        for (int r = 0; r < n; r++)
            for (int j = 0; j < d; j++)
                sum[j] += b->hidden_h[(size_t)r * d + j];
    }
    double norm = 0.0;
    for (int j = 0; j < d; j++) {
        sum[j] /= T;
        norm += sum[j] * sum[j];
    }
    norm = sqrt(norm);
    for (int j = 0; j < d; j++)
        out[j] = (float)(norm > 0.0 ? sum[j] / norm : 0.0);
out:
    nl_kvcache_destroy(&kv);
    free(sum);
    return st;
}
