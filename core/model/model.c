/* Parameter layout of a stage, its named table, and initialisation. */
#include "core/model/model.h"

#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/model/memory.h"
#include "core/model/rng.h"

/* ---------------------------------------------------------------- layout */

typedef struct layout {
    nl_param *table;
    int n, cap;
    size_t floats;
} layout;

static nl_param *layout_add(layout *lo, nl_param_kind kind, float std, int64_t rows, int64_t cols,
                            const char *fmt, ...) __attribute__((format(printf, 6, 7)));

static nl_param *layout_add(layout *lo, nl_param_kind kind, float std, int64_t rows, int64_t cols,
                            const char *fmt, ...)
{
    if (lo->n == lo->cap) {
        int cap = lo->cap ? 2 * lo->cap : 64;
        nl_param *t = realloc(lo->table, (size_t)cap * sizeof *t);
        if (!t)
            return NULL;
        lo->table = t;
        lo->cap = cap;
    }
    nl_param *p = &lo->table[lo->n++];
    memset(p, 0, sizeof *p);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->name, sizeof p->name, fmt, ap);
    va_end(ap);
    p->kind = kind;
    p->ndim = cols > 0 ? 2 : 1;
    p->shape[0] = rows;
    p->shape[1] = cols > 0 ? cols : 0;
    p->offset = lo->floats;
    p->init_std = std;
    lo->floats += nl_param_numel(p); /* packed: fused matrices stay adjacent */
    return p;
}

static nl_status build_layout(nl_model *m, layout *lo, nl_error *err)
{
    const nl_config *c = &m->cfg;
    const int64_t d = c->hidden_dim, hd = nl_config_head_dim(c);
    const int64_t H = c->num_heads, G = c->num_kv_heads, F = c->ffn_dim;
    const float std = 0.02f, out_std = 0.02f / sqrtf(2.0f * (float)c->num_layers);
    int ok = 1;
    if (m->has_embed)
        ok &= layout_add(lo, NL_PARAM_TABLE, std, m->capacity, d, "tok_embeddings.weight") != NULL;
    for (int l = m->l0; l < m->l1 && ok; l++) {
        ok &= layout_add(lo, NL_PARAM_NORM, 0, d, 0, "layers.%d.attention_norm.weight", l) != NULL;
        ok &= layout_add(lo, NL_PARAM_MATRIX, std, H * hd, d, "layers.%d.attention.wq.weight", l) !=
              NULL;
        ok &= layout_add(lo, NL_PARAM_MATRIX, std, G * hd, d, "layers.%d.attention.wk.weight", l) !=
              NULL;
        ok &= layout_add(lo, NL_PARAM_MATRIX, std, G * hd, d, "layers.%d.attention.wv.weight", l) !=
              NULL;
        ok &= layout_add(lo, NL_PARAM_MATRIX, out_std, d, H * hd, "layers.%d.attention.wo.weight",
                         l) != NULL;
        ok &= layout_add(lo, NL_PARAM_NORM, 0, d, 0, "layers.%d.ffn_norm.weight", l) != NULL;
        if (!nl_config_dense(c)) /* a dense FFN has no router */
            ok &= layout_add(lo, NL_PARAM_MATRIX, std, c->num_experts, d,
                             "layers.%d.moe.router.weight", l) != NULL;
        for (int e = 0; e < c->num_experts && ok; e++) {
            ok &= layout_add(lo, NL_PARAM_MATRIX, std, F, d,
                             "layers.%d.moe.experts.%d.w_gate.weight", l, e) != NULL;
            ok &= layout_add(lo, NL_PARAM_MATRIX, std, F, d, "layers.%d.moe.experts.%d.w_up.weight",
                             l, e) != NULL;
            ok &= layout_add(lo, NL_PARAM_MATRIX, out_std, d, F,
                             "layers.%d.moe.experts.%d.w_down.weight", l, e) != NULL;
        }
    }
    if (m->has_head && ok) {
        ok &= layout_add(lo, NL_PARAM_NORM, 0, d, 0, "norm.weight") != NULL;
        ok &= layout_add(lo, NL_PARAM_TABLE, std, m->capacity, d, "lm_head.weight") != NULL;
        if (c->num_classes > 0 && ok) /* DESIGN 6: on the mean-pooled final states */
            ok &= layout_add(lo, NL_PARAM_MATRIX, std, c->num_classes, d, "classifier.weight") !=
                  NULL;
    }
    if (!ok)
        return nl_error_set(err, NL_ERR_NOMEM, "model layout: out of memory");
    return NL_OK;
}

/* The fused matrices rely on the packed layout; checked, not assumed. */
static int adjacent(const nl_param *a, const nl_param *b)
{
    return a->offset + nl_param_numel(a) == b->offset;
}

static nl_status bind_pointers(nl_model *m, nl_error *err)
{
    const nl_config *c = &m->cfg;
    const nl_param *t = m->table;
    int i = 0;
    if (m->has_embed)
        m->tok_embeddings = m->params + t[i++].offset;
    for (int l = m->l0; l < m->l1; l++) {
        nl_layer_weights *w = &m->layers[l - m->l0];
        w->attention_norm = m->params + t[i].offset;
        w->wqkv = m->params + t[i + 1].offset;
        if (!adjacent(&t[i + 1], &t[i + 2]) || !adjacent(&t[i + 2], &t[i + 3]))
            return nl_error_set(err, NL_ERR_INTERNAL, "layer %d: wq, wk, wv not adjacent", l);
        w->wo = m->params + t[i + 4].offset;
        w->ffn_norm = m->params + t[i + 5].offset;
        const int r = nl_config_dense(c) ? 0 : 1; /* router tensors */
        w->router = r ? m->params + t[i + 6].offset : NULL;
        w->experts = m->params + t[i + 6 + r].offset;
        for (int e = 0; e < c->num_experts; e++) {
            const nl_param *g = &t[i + 6 + r + 3 * e];
            if (!adjacent(g, g + 1) || !adjacent(g + 1, g + 2) || (e > 0 && !adjacent(g - 1, g)))
                return nl_error_set(err, NL_ERR_INTERNAL, "layer %d expert %d: not contiguous", l,
                                    e);
        }
        i += 6 + r + 3 * c->num_experts;
    }
    if (m->has_head) {
        m->norm = m->params + t[i++].offset;
        m->lm_head = m->params + t[i++].offset;
        if (c->num_classes > 0)
            m->classifier = m->params + t[i++].offset;
    }
    return NL_OK;
}

/* The DESIGN section 6 variants need optional backend slots. */
static nl_status backend_supports(const nl_backend *be, const nl_config *c, nl_error *err)
{
    const char *need = NULL;
    if (c->ffn_act == NL_FFN_GEGLU && (!be->geglu_forward || !be->geglu_backward))
        need = "ffn_act geglu";
    else if (c->rope_scaling.type != NL_ROPE_NONE && !be->rope_scaled_forward)
        need = "rope_scaling";
    else if ((!c->causal || c->attention_window > 0) &&
             (!be->attention_masked_forward || !be->attention_masked_backward))
        need = c->causal ? "attention_window" : "causal: false";
    if (need)
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "backend %s does not implement %s", be->name,
                            need);
    return NL_OK;
}

nl_status nl_model_new(nl_model **out, nl_backend *be, const nl_config *cfg, int l0, int l1,
                       int has_embed, int has_head, nl_error *err)
{
    *out = NULL;
    nl_status st = nl_config_validate(cfg, 1, err);
    if (st != NL_OK)
        return st;
    if (l0 < 0 || l1 > cfg->num_layers || l0 > l1)
        return nl_error_set(err, NL_ERR_RANGE, "layer range [%d, %d) is outside [0, %d)", l0, l1,
                            cfg->num_layers);
    if ((st = backend_supports(be, cfg, err)) != NL_OK)
        return st;
    nl_model *m = calloc(1, sizeof *m);
    layout lo = {0};
    if (!m)
        return nl_error_set(err, NL_ERR_NOMEM, "model: out of memory");
    m->cfg = *cfg;
    m->l0 = l0;
    m->l1 = l1;
    m->has_embed = has_embed;
    m->has_head = has_head;
    m->capacity = nl_config_capacity(cfg);
    m->be = be;
    nl_model_changed(m);
    m->layers = calloc((size_t)(l1 - l0) + 1, sizeof *m->layers);
    if (!m->layers) {
        st = nl_error_set(err, NL_ERR_NOMEM, "model: out of memory");
        goto fail;
    }
    st = build_layout(m, &lo, err);
    if (st != NL_OK)
        goto fail;
    m->table = lo.table;
    m->n_table = lo.n;
    m->n_params = lo.floats;
    lo.table = NULL;
    m->params = be->alloc(be, m->n_params * sizeof(float));
    if (!m->params) {
        st = nl_error_set(err, NL_ERR_NOMEM, "model: cannot allocate %zu parameters (%zu bytes)",
                          m->n_params, m->n_params * sizeof(float));
        goto fail;
    }
    st = bind_pointers(m, err);
    /* bf16 compute: the backend keeps a bf16 copy of the weights for its
     * GEMMs, made again after any write into them (an optimizer step) */
    if (st == NL_OK && be->bf16_weights)
        st = be->bf16_weights(be, m->params, m->n_params, err);
    if (st != NL_OK)
        goto fail;
    *out = m;
    return NL_OK;
fail:
    free(lo.table);
    nl_model_destroy(&m);
    return st;
}

void nl_model_changed(nl_model *m)
{
    static atomic_uint_fast64_t next = 1;
    m->generation = (uint64_t)atomic_fetch_add(&next, 1);
}

void nl_model_destroy(nl_model **mp)
{
    if (!mp || !*mp)
        return;
    nl_model *m = *mp;
    if (m->params && m->be->bf16_weights)
        m->be->bf16_weights(m->be, m->params, 0, NULL); /* forget: cannot fail */
    if (m->params)
        m->be->free(m->be, m->params);
    free(m->table);
    free(m->layers);
    free(m->growth);
    free(m);
    *mp = NULL;
}

const nl_param *nl_model_find_param(const nl_model *m, const char *name)
{
    for (int i = 0; i < m->n_table; i++)
        if (strcmp(m->table[i].name, name) == 0)
            return &m->table[i];
    return NULL;
}

int64_t nl_config_param_count(const nl_config *c)
{
    return nl_stage_param_count(c, c->num_layers, 1, 1);
}

double nl_config_forward_flops(const nl_config *c, int B, int T, int past)
{
    const double d = c->hidden_dim, hd = nl_config_head_dim(c), H = c->num_heads;
    const double G = c->num_kv_heads, F = c->ffn_dim, E = c->num_experts, k = c->top_k;
    const double tokens = (double)B * T;
    const double per_token = 2 * d * (H + 2 * G) * hd + 2 * H * hd * d +
                             (nl_config_dense(c) ? 0 : 2 * d * E) + k * (2 * d * 2 * F + 2 * F * d);
    /* keys seen, summed over the new positions: sum_{t} (past + t + 1) */
    const double keys = (double)B * ((double)past * T + (double)T * (T + 1) / 2);
    const double attn = 4 * H * hd * keys;
    return c->num_layers * (tokens * per_token + attn) + tokens * 2 * d * (double)c->vocab_size;
}

/* ---------------------------------------------------------------- init */

void nl_model_init_table_rows(const nl_param *p, uint64_t seed, int64_t vocab_chunk, int64_t row0,
                              int64_t row1, float *dst)
{
    const int64_t cols = p->shape[1];
    const uint64_t base = nl_rng_hash(p->name);
    nl_rng r;
    for (int64_t row = row0; row < row1; row++) {
        if (row == row0 || row % vocab_chunk == 0) {
            /* each block of vocab_chunk rows has its own stream */
            int64_t b = row / vocab_chunk;
            nl_rng_seed(&r, seed, base + 0x9E3779B97F4A7C15ULL * (uint64_t)(b + 1));
            for (int64_t skip = b * vocab_chunk; skip < row; skip++) /* unaligned start */
                for (int64_t j = 0; j < cols; j++)
                    (void)nl_rng_normal(&r);
        }
        for (int64_t j = 0; j < cols; j++)
            dst[(row - row0) * cols + j] = (float)(p->init_std * nl_rng_normal(&r));
    }
}

/* One parameter; host is a scratch buffer of CHUNK floats. */
enum { INIT_CHUNK = 1 << 20 };
static nl_status init_param(nl_model *m, const nl_param *p, uint64_t seed, float *host,
                            nl_error *err)
{
    const size_t n = nl_param_numel(p);
    float *dev = nl_model_param_data(m, p);
    if (p->kind == NL_PARAM_TABLE) {
        /* one block of vocab_chunk rows at a time, so no stream is
         * entered in the middle */
        const int64_t cols = p->shape[1], chunk = m->cfg.vocab_chunk;
        size_t need = (size_t)(chunk < p->shape[0] ? chunk : p->shape[0]) * (size_t)cols;
        float *blk = need <= INIT_CHUNK ? host : malloc(need * sizeof(float));
        if (!blk)
            return nl_error_set(err, NL_ERR_NOMEM, "init: %s: out of memory", p->name);
        for (int64_t r0 = 0; r0 < p->shape[0]; r0 += chunk) {
            int64_t r1 = r0 + chunk < p->shape[0] ? r0 + chunk : p->shape[0];
            nl_model_init_table_rows(p, seed, chunk, r0, r1, blk);
            m->be->upload(m->be, dev + r0 * cols, blk, (size_t)(r1 - r0) * cols * sizeof(float));
        }
        if (blk != host)
            free(blk);
        return NL_OK;
    }
    nl_rng r;
    nl_rng_seed(&r, seed, nl_rng_hash(p->name));
    for (size_t o = 0; o < n; o += INIT_CHUNK) {
        size_t k = n - o < INIT_CHUNK ? n - o : INIT_CHUNK;
        for (size_t j = 0; j < k; j++)
            host[j] = p->kind == NL_PARAM_NORM ? 1.0f : (float)(p->init_std * nl_rng_normal(&r));
        m->be->upload(m->be, dev + o, host, k * sizeof(float));
    }
    return NL_OK;
}

nl_status nl_model_init_param(nl_model *m, const nl_param *p, uint64_t seed, nl_error *err)
{
    float *host = malloc(INIT_CHUNK * sizeof(float));
    if (!host)
        return nl_error_set(err, NL_ERR_NOMEM, "init: out of memory");
    nl_status st = init_param(m, p, seed, host, err);
    free(host);
    return st;
}

nl_status nl_model_init_random(nl_model *m, uint64_t seed, nl_error *err)
{
    float *host = malloc(INIT_CHUNK * sizeof(float));
    nl_status st = NL_OK;
    if (!host)
        return nl_error_set(err, NL_ERR_NOMEM, "init: out of memory");
    for (int i = 0; i < m->n_table && st == NL_OK; i++)
        st = init_param(m, &m->table[i], seed, host, err);
    free(host);
    return st;
}
