/* The forward pass of a stage: embedding, pre-norm blocks of GQA attention
 * with RoPE and a top-k mixture of SwiGLU experts, final norm and head. */
#include "forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- state */

struct nl_runstate {
    nl_backend *be;
    int max_rows;
    int out_cols;
    const float *out;
    /* device (rows = N = B*T unless noted) */
    int32_t *tokens_d; /* (N) */
    int32_t *pos_d;    /* (N) */
    float *x;          /* (N, d) residual stream */
    float *xn;         /* (N, d) normed */
    float *qkv;        /* (N, (H + 2G) hd) */
    float *att;        /* (N, H hd) */
    float *probs;      /* (N, E) router probabilities */
    int32_t *perm_d;   /* (N k) token row of each dispatch slot, grouped by expert */
    int32_t *slot_d;   /* (N k) dispatch slot of each (token, choice) */
    float *w_d;        /* (N k) renormalised weight of each (token, choice) */
    float *xe;         /* (N k, d) gathered expert inputs */
    float *gu;         /* (N k, 2F) gate and up projections */
    float *hs;         /* (N k, F) silu(gate) * up */
    float *ye;         /* (N k, d) expert outputs */
    float *last;       /* (B, d) last rows for last_only */
    float *logits;     /* (N, V) */
    /* host */
    int32_t *pos_h, *perm_h, *slot_h, *choice_h;
    float *probs_h, *w_h;
    int *counts, *offsets; /* (E), (E + 1) */
};

nl_status nl_runstate_new(nl_runstate **out, const nl_model *m, int max_rows, nl_error *err)
{
    *out = NULL;
    const nl_config *c = &m->cfg;
    const size_t N = (size_t)max_rows, d = (size_t)c->hidden_dim, k = (size_t)c->top_k;
    const size_t hd = (size_t)nl_config_head_dim(c), E = (size_t)c->num_experts;
    const size_t qkv = ((size_t)c->num_heads + 2 * (size_t)c->num_kv_heads) * hd;
    const size_t F = (size_t)c->ffn_dim;
    if (max_rows < 1)
        return nl_error_set(err, NL_ERR_INVALID, "runstate: max_rows %d must be positive", max_rows);
    nl_runstate *rs = calloc(1, sizeof *rs);
    if (!rs)
        return nl_error_set(err, NL_ERR_NOMEM, "runstate: out of memory");
    nl_backend *be = m->be;
    rs->be = be;
    rs->max_rows = max_rows;
    int ok = 1;
#define DEV(ptr, n) ok &= ((ptr) = be->alloc(be, (n) * sizeof *(ptr))) != NULL
#define HOST(ptr, n) ok &= ((ptr) = calloc((n), sizeof *(ptr))) != NULL
    DEV(rs->tokens_d, N);
    DEV(rs->pos_d, N);
    DEV(rs->x, N * d);
    DEV(rs->xn, N * d);
    DEV(rs->qkv, N * qkv);
    DEV(rs->att, N * (size_t)c->num_heads * hd);
    DEV(rs->probs, N * E);
    DEV(rs->perm_d, N * k);
    DEV(rs->slot_d, N * k);
    DEV(rs->w_d, N * k);
    DEV(rs->xe, N * k * d);
    DEV(rs->gu, N * k * 2 * F);
    DEV(rs->hs, N * k * F);
    DEV(rs->ye, N * k * d);
    DEV(rs->last, N * d);
    if (m->has_head)
        DEV(rs->logits, N * (size_t)c->vocab_size);
    HOST(rs->pos_h, N);
    HOST(rs->perm_h, N * k);
    HOST(rs->slot_h, N * k);
    HOST(rs->choice_h, N * k);
    HOST(rs->probs_h, N * E);
    HOST(rs->w_h, N * k);
    HOST(rs->counts, E);
    HOST(rs->offsets, E + 1);
#undef DEV
#undef HOST
    if (!ok) {
        nl_runstate_destroy(&rs);
        return nl_error_set(err, NL_ERR_NOMEM, "runstate: cannot allocate activations for %d rows",
                            max_rows);
    }
    *out = rs;
    return NL_OK;
}

void nl_runstate_destroy(nl_runstate **rsp)
{
    if (!rsp || !*rsp)
        return;
    nl_runstate *rs = *rsp;
    nl_backend *be = rs->be;
    void *dev[] = {rs->tokens_d, rs->pos_d, rs->x,  rs->xn, rs->qkv, rs->att,
                   rs->probs,    rs->perm_d, rs->slot_d, rs->w_d, rs->xe, rs->gu,
                   rs->hs,       rs->ye,     rs->last,   rs->logits};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        be->free(be, dev[i]);
    free(rs->pos_h);
    free(rs->perm_h);
    free(rs->slot_h);
    free(rs->choice_h);
    free(rs->probs_h);
    free(rs->w_h);
    free(rs->counts);
    free(rs->offsets);
    free(rs);
    *rsp = NULL;
}

const float *nl_runstate_output(const nl_runstate *rs, int *cols)
{
    if (cols)
        *cols = rs->out_cols;
    return rs->out;
}

/* ---------------------------------------------------------------- kv cache */

size_t nl_kvcache_bytes(const nl_config *cfg, int n_layers, int B, int cap)
{
    return 2 * (size_t)n_layers * (size_t)B * (size_t)cap * (size_t)cfg->num_kv_heads *
           (size_t)nl_config_head_dim(cfg) * sizeof(float);
}

nl_status nl_kvcache_new(nl_kvcache **out, const nl_model *m, int B, int cap, nl_error *err)
{
    *out = NULL;
    if (B < 1 || cap < 1 || cap > m->cfg.max_seq_len)
        return nl_error_set(err, NL_ERR_RANGE,
                            "kv cache: %d sequences of %d positions (max_seq_len %d)", B, cap,
                            m->cfg.max_seq_len);
    nl_kvcache *kv = calloc(1, sizeof *kv);
    if (!kv)
        return nl_error_set(err, NL_ERR_NOMEM, "kv cache: out of memory");
    kv->be = m->be;
    kv->n_layers = m->l1 - m->l0;
    kv->B = B;
    kv->cap = cap;
    kv->kv_dim = m->cfg.num_kv_heads * nl_config_head_dim(&m->cfg);
    size_t bytes = nl_kvcache_bytes(&m->cfg, kv->n_layers, B, cap) / 2;
    kv->k = m->be->alloc(m->be, bytes ? bytes : 1);
    kv->v = m->be->alloc(m->be, bytes ? bytes : 1);
    if (!kv->k || !kv->v) {
        nl_kvcache_destroy(&kv);
        return nl_error_set(err, NL_ERR_NOMEM, "kv cache: cannot allocate %zu bytes", 2 * bytes);
    }
    *out = kv;
    return NL_OK;
}

void nl_kvcache_destroy(nl_kvcache **kvp)
{
    if (!kvp || !*kvp)
        return;
    nl_kvcache *kv = *kvp;
    kv->be->free(kv->be, kv->k);
    kv->be->free(kv->be, kv->v);
    free(kv);
    *kvp = NULL;
}

/* ---------------------------------------------------------------- router */

/* Top-k of each row of probs (host), ties to the lower expert index; fill
 * the dispatch tables grouped by expert and return this layer's
 * load-balancing loss E * sum_e frac_e * mean_p_e. */
static float route(nl_runstate *rs, int N, int E, int k)
{
    const float *p = rs->probs_h;
    int *counts = rs->counts, *off = rs->offsets;
    memset(counts, 0, (size_t)E * sizeof *counts);
    for (int n = 0; n < N; n++) {
        const float *row = p + (size_t)n * E;
        float sum = 0.0f;
        for (int i = 0; i < k; i++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int j = 0; j < i; j++)
                    taken |= rs->choice_h[(size_t)n * k + j] == e;
                if (!taken && (best < 0 || row[e] > row[best]))
                    best = e;
            }
            rs->choice_h[(size_t)n * k + i] = best;
            sum += row[best];
            counts[best]++;
        }
        for (int i = 0; i < k; i++)
            rs->w_h[(size_t)n * k + i] = row[rs->choice_h[(size_t)n * k + i]] / sum;
    }
    off[0] = 0;
    for (int e = 0; e < E; e++)
        off[e + 1] = off[e] + counts[e];
    /* counting sort: token order within each expert, so slots are stable */
    int fill[NL_CONFIG_MAX_EXPERTS];
    memcpy(fill, off, (size_t)E * sizeof *fill);
    for (int n = 0; n < N; n++)
        for (int i = 0; i < k; i++) {
            int e = rs->choice_h[(size_t)n * k + i];
            int s = fill[e]++;
            rs->perm_h[s] = n;
            rs->slot_h[(size_t)n * k + i] = s;
        }
    /* aux loss, accumulated in double for a stable sum */
    double aux = 0.0;
    for (int e = 0; e < E; e++) {
        double mp = 0.0;
        for (int n = 0; n < N; n++)
            mp += p[(size_t)n * E + e];
        mp /= N;
        aux += (double)counts[e] / ((double)N * k) * mp;
    }
    return (float)(E * aux);
}

/* ---------------------------------------------------------------- layers */

static void attention_block(nl_model *m, nl_runstate *rs, const nl_layer_weights *w, int li,
                            int B, int T, int past, nl_kvcache *kv)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const int N = B * T, d = c->hidden_dim, hd = nl_config_head_dim(c);
    const int H = c->num_heads, G = c->num_kv_heads, qkv = (H + 2 * G) * hd;

    be->rmsnorm_forward(be, rs->xn, NULL, rs->x, w->attention_norm, N, d, (float)c->norm_eps);
    be->gemm(be, 0, 1, N, qkv, d, 1.0f, rs->xn, d, w->wqkv, d, 0.0f, rs->qkv, qkv);
    /* rotate q and k heads together: they are adjacent columns */
    be->rope_forward(be, rs->qkv, rs->pos_d, N, qkv, 0, H + G, hd, (float)c->rope_base);

    nl_attn_shape s = {.B = B, .T = T, .past = past, .kv_cap = T, .H = H, .G = G, .hd = hd};
    const float *k = rs->qkv + H * hd, *v = rs->qkv + (H + G) * hd;
    int kv_stride = qkv;
    if (kv) {
        const size_t layer = (size_t)(li - m->l0) * kv->B * kv->cap * kv->kv_dim;
        float *kc = kv->k + layer, *vc = kv->v + layer;
        for (int b = 0; b < B; b++) {
            const size_t dst = ((size_t)b * kv->cap + past) * kv->kv_dim;
            const float *src = rs->qkv + (size_t)b * T * qkv;
            be->copy_rows(be, kc + dst, kv->kv_dim, src + H * hd, qkv, T, G * hd);
            be->copy_rows(be, vc + dst, kv->kv_dim, src + (H + G) * hd, qkv, T, G * hd);
        }
        k = kc;
        v = vc;
        kv_stride = kv->kv_dim;
        s.kv_cap = kv->cap;
    }
    be->attention_forward(be, rs->att, NULL, rs->qkv, qkv, k, v, kv_stride, s);
    /* h1 = x + att Wo^T, in place on the residual stream */
    be->gemm(be, 0, 1, N, d, H * hd, 1.0f, rs->att, H * hd, w->wo, H * hd, 1.0f, rs->x, d);
}

static float moe_block(nl_model *m, nl_runstate *rs, const nl_layer_weights *w, int N)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const int d = c->hidden_dim, E = c->num_experts, k = c->top_k, F = c->ffn_dim;

    be->rmsnorm_forward(be, rs->xn, NULL, rs->x, w->ffn_norm, N, d, (float)c->norm_eps);
    be->gemm(be, 0, 1, N, E, d, 1.0f, rs->xn, d, w->router, d, 0.0f, rs->probs, E);
    be->softmax_forward(be, rs->probs, N, E);
    be->download(be, rs->probs_h, rs->probs, (size_t)N * E * sizeof(float));
    float aux = route(rs, N, E, k);
    be->upload(be, rs->perm_d, rs->perm_h, (size_t)N * k * sizeof(int32_t));
    be->upload(be, rs->slot_d, rs->slot_h, (size_t)N * k * sizeof(int32_t));
    be->upload(be, rs->w_d, rs->w_h, (size_t)N * k * sizeof(float));

    /* grouped dispatch: each expert runs only on the rows routed to it */
    be->gather_rows(be, rs->xe, rs->xn, rs->perm_d, N * k, d);
    const size_t expert_floats = 3 * (size_t)F * d;
    for (int e = 0; e < E; e++) {
        const int n = rs->counts[e], o = rs->offsets[e];
        if (n == 0)
            continue;
        const float *wgu = w->experts + e * expert_floats; /* (2F, d) */
        const float *wdown = wgu + 2 * (size_t)F * d;      /* (d, F) */
        float *gu = rs->gu + (size_t)o * 2 * F, *hs = rs->hs + (size_t)o * F;
        be->gemm(be, 0, 1, n, 2 * F, d, 1.0f, rs->xe + (size_t)o * d, d, wgu, d, 0.0f, gu, 2 * F);
        be->swiglu_forward(be, hs, gu, n, F);
        be->gemm(be, 0, 1, n, d, F, 1.0f, hs, F, wdown, F, 0.0f, rs->ye + (size_t)o * d, d);
    }
    be->moe_combine(be, rs->x, rs->ye, rs->slot_d, rs->w_d, N, k, d);
    return aux;
}

/* ---------------------------------------------------------------- forward */

nl_status nl_forward(nl_model *m, nl_runstate *rs, const nl_forward_args *a, float *aux_loss,
                     nl_error *err)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const int B = a->B, T = a->T, d = c->hidden_dim;
    const long N = (long)B * T;
    int past = 0;
    if (B < 1 || T < 1 || N > rs->max_rows)
        return nl_error_set(err, NL_ERR_SHAPE, "forward: batch %d x %d is outside 1..%d rows", B,
                            T, rs->max_rows);
    if (a->kv) {
        if (a->kv->B != B || a->kv->n_layers != m->l1 - m->l0)
            return nl_error_set(err, NL_ERR_SHAPE,
                                "forward: kv cache holds %d sequences of %d layers, got %d", a->kv->B,
                                a->kv->n_layers, B);
        past = a->kv->len;
        if (past + T > a->kv->cap)
            return nl_error_set(err, NL_ERR_RANGE,
                                "forward: %d cached + %d new positions exceed the cache's %d", past,
                                T, a->kv->cap);
    } else if (T > c->max_seq_len) {
        return nl_error_set(err, NL_ERR_RANGE, "forward: %d positions exceed max_seq_len %d", T,
                            c->max_seq_len);
    }
    if (m->has_embed) {
        if (!a->tokens)
            return nl_error_set(err, NL_ERR_INVALID, "forward: first stage needs tokens");
        for (long n = 0; n < N; n++)
            if (a->tokens[n] < 0 || a->tokens[n] >= c->vocab_size)
                return nl_error_set(err, NL_ERR_RANGE,
                                    "forward: token %d at [%ld, %ld] is outside the vocabulary 0..%lld",
                                    a->tokens[n], n / T, n % T, (long long)c->vocab_size - 1);
        be->upload(be, rs->tokens_d, a->tokens, (size_t)N * sizeof(int32_t));
        be->embedding_forward(be, rs->x, rs->tokens_d, m->tok_embeddings, (int)N, d);
    } else {
        if (!a->x_in)
            return nl_error_set(err, NL_ERR_INVALID, "forward: stage needs hidden states");
        be->copy_rows(be, rs->x, d, a->x_in, d, (int)N, d);
    }
    for (long n = 0; n < N; n++)
        rs->pos_h[n] = (int32_t)(past + n % T);
    be->upload(be, rs->pos_d, rs->pos_h, (size_t)N * sizeof(int32_t));

    double aux = 0.0;
    for (int l = m->l0; l < m->l1; l++) {
        const nl_layer_weights *w = &m->layers[l - m->l0];
        attention_block(m, rs, w, l, B, T, past, a->kv);
        aux += moe_block(m, rs, w, (int)N);
    }
    if (a->kv)
        a->kv->len += T;
    if (aux_loss)
        *aux_loss = (float)aux;

    if (!m->has_head) {
        rs->out = rs->x;
        rs->out_cols = d;
        return NL_OK;
    }
    const float *x = rs->x;
    int rows = (int)N;
    if (a->last_only) {
        be->copy_rows(be, rs->last, d, rs->x + (size_t)(T - 1) * d, T * d, B, d);
        x = rs->last;
        rows = B;
    }
    const int V = (int)c->vocab_size;
    be->rmsnorm_forward(be, rs->xn, NULL, x, m->norm, rows, d, (float)c->norm_eps);
    be->gemm(be, 0, 1, rows, V, d, 1.0f, rs->xn, d, m->lm_head, d, 0.0f, rs->logits, V);
    rs->out = rs->logits;
    rs->out_cols = V;
    return NL_OK;
}
