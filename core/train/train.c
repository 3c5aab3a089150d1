/* The stage trainer: saved activations per microbatch slot, the forward
 * and the backward pass through head, layers and embedding, and the local
 * steps. AdamW, the learning-rate schedule and the step's decision are in
 * train_adamw.c; the state both share is in train_impl.h. */
#include "core/train/train_impl.h"

#include "core/model/lora.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- setup */

static nl_status slot_alloc(nl_trainer *t, train_slot *s, nl_error *err)
{
    nl_backend *be = t->be;
    const nl_config *c = &t->m->cfg;
    const size_t N = (size_t)t->max_rows, d = (size_t)c->hidden_dim;
    nl_status st = NL_OK;
    int ok = 1;
    if (!t->recompute) {
        s->acts = calloc((size_t)t->n_layers, sizeof *s->acts);
        ok &= s->acts != NULL;
        for (int l = 0; ok && l < t->n_layers; l++) {
            st = nl_layer_acts_alloc(&s->acts[l], be, c, t->max_rows, 1, err);
            if (st != NL_OK)
                return st;
            if (l > 0) { /* this layer's input is the previous layer's output */
                be->free(be, s->acts[l].x_in);
                s->acts[l].x_in = s->acts[l - 1].x_out;
            }
        }
        if (ok)
            s->x_final = t->n_layers ? s->acts[t->n_layers - 1].x_out : NULL;
    } else {
        s->x_in = calloc((size_t)t->n_layers, sizeof *s->x_in);
        ok &= s->x_in != NULL;
        for (int l = 0; ok && l < t->n_layers; l++)
            ok &= (s->x_in[l] = be->alloc(be, N * d * sizeof(float))) != NULL;
    }
    if (ok && (t->recompute || t->n_layers == 0))
        ok &= (s->x_final = be->alloc(be, N * d * sizeof(float))) != NULL;
    ok &= (s->tokens_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
    ok &= (s->doc_h = calloc(N, sizeof(int32_t))) != NULL;
    if (t->m->has_head) {
        ok &= (s->xnf = be->alloc(be, N * d * sizeof(float))) != NULL;
        ok &= (s->rstdf = be->alloc(be, N * sizeof(float))) != NULL;
        ok &= (s->logits = be->alloc(be, N * (size_t)c->vocab_size * sizeof(float))) != NULL;
        if (c->num_classes > 0) {
            ok &= (s->lengths_h = calloc(N, sizeof(int32_t))) != NULL;
            ok &= (s->pooled = be->alloc(be, N * d * sizeof(float))) != NULL;
            ok &= (s->clogits = be->alloc(be, N * (size_t)c->num_classes * sizeof(float))) != NULL;
            ok &= (s->labels_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
        }
    }
    if (!ok)
        return nl_error_set(err, NL_ERR_NOMEM, "trainer: cannot allocate activations for %d rows",
                            t->max_rows);
    return NL_OK;
}

static void slot_free(nl_trainer *t, train_slot *s)
{
    nl_backend *be = t->be;
    int owns_final = t->recompute || t->n_layers == 0;
    if (s->acts) {
        for (int l = t->n_layers - 1; l >= 0; l--) {
            if (l > 0)
                s->acts[l].x_in = NULL; /* owned by layer l - 1 */
            if (s->acts[l].x_in || s->acts[l].x_out)
                nl_layer_acts_free(&s->acts[l], be);
        }
        free(s->acts);
    }
    if (s->x_in) {
        for (int l = 0; l < t->n_layers; l++)
            be->free(be, s->x_in[l]);
        free(s->x_in);
    }
    if (owns_final)
        be->free(be, s->x_final);
    be->free(be, s->tokens_d);
    free(s->doc_h);
    free(s->lengths_h);
    be->free(be, s->pooled);
    be->free(be, s->clogits);
    be->free(be, s->labels_d);
    be->free(be, s->xnf);
    be->free(be, s->rstdf);
    be->free(be, s->logits);
}

nl_status nl_trainer_new(nl_trainer **out, nl_model *m, int max_rows, int slots, int recompute,
                         nl_error *err)
{
    *out = NULL;
    if (max_rows < 1 || slots < 1 || slots > 1024)
        return nl_error_set(err, NL_ERR_INVALID, "trainer: %d rows in %d slots", max_rows, slots);
    nl_trainer *t = calloc(1, sizeof *t);
    if (!t)
        return nl_error_set(err, NL_ERR_NOMEM, "trainer: out of memory");
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const size_t N = (size_t)max_rows, d = (size_t)c->hidden_dim, E = (size_t)c->num_experts;
    nl_status st = NL_OK;
    t->m = m;
    t->be = be;
    t->max_rows = max_rows;
    t->n_slots = slots;
    t->recompute = recompute;
    t->n_layers = m->l1 - m->l0;
    t->frozen = m->lora != NULL;
    int ok = 1;
    ok &= (t->grads = be->alloc(be, m->n_params * sizeof(float))) != NULL;
    if (!m->lora) { /* a frozen base with adapters has no moments (its adapters hold theirs) */
        ok &= (t->mom[0] = be->alloc(be, m->n_params * sizeof(float))) != NULL;
        ok &= (t->mom[1] = be->alloc(be, m->n_params * sizeof(float))) != NULL;
    }
    ok &= (t->dbuf[0] = be->alloc(be, N * d * sizeof(float))) != NULL;
    ok &= (t->dbuf[1] = be->alloc(be, N * d * sizeof(float))) != NULL;
    ok &= (t->pos_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
    ok &= (t->doc_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
    ok &= (t->doc_h = calloc(N, sizeof(int32_t))) != NULL;
    if (m->has_head && c->num_classes > 0) {
        ok &= (t->labels_h = calloc(N, sizeof(int32_t))) != NULL;
        ok &= (t->lengths_h = calloc(N, sizeof(int32_t))) != NULL;
        ok &= (t->dpooled = be->alloc(be, N * d * sizeof(float))) != NULL;
    }
    ok &= (t->targets_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
    ok &= (t->losses_d = be->alloc(be, N * sizeof(float))) != NULL;
    ok &= (t->pos_h = calloc(N, sizeof(int32_t))) != NULL;
    ok &= (t->neg_pos_h = calloc(N, sizeof(int32_t))) != NULL;
    ok &= (t->targets_h = calloc(N, sizeof(int32_t))) != NULL;
    ok &= (t->losses_h = calloc(N, sizeof(float))) != NULL;
    ok &= (t->counts = calloc((size_t)t->n_layers * E + 1, sizeof(int64_t))) != NULL;
    ok &= (t->global_frac = calloc((size_t)t->n_layers * E + 1, sizeof(float))) != NULL;
    ok &= (t->counts_d = be->alloc(be, ((size_t)t->n_layers * E + 1) * sizeof(int64_t))) != NULL;
    ok &= (t->global_frac_d = be->alloc(be, ((size_t)t->n_layers * E + 1) * sizeof(float))) != NULL;
    ok &= (t->aux_d = be->alloc(be, sizeof(double))) != NULL;
    ok &= (t->slots = calloc((size_t)slots, sizeof *t->slots)) != NULL;
    if (!ok) {
        st = nl_error_set(err, NL_ERR_NOMEM, "trainer: cannot allocate %zu parameters' state",
                          m->n_params);
        goto fail;
    }
    if (!m->lora && (st = nl_trainer_born_regions(t, err)) != NL_OK)
        goto fail;
    if ((st = nl_layer_acts_alloc(&t->work, be, c, max_rows, 1, err)) != NL_OK ||
        (st = nl_layer_scratch_alloc(&t->sc, be, c, max_rows, err)) != NL_OK)
        goto fail;
    for (int i = 0; i < slots; i++)
        if ((st = slot_alloc(t, &t->slots[i], err)) != NL_OK)
            goto fail;
    *out = t;
    return NL_OK;
fail:
    nl_trainer_destroy(&t);
    return st;
}

void nl_trainer_destroy(nl_trainer **tp)
{
    if (!tp || !*tp)
        return;
    nl_trainer *t = *tp;
    nl_backend *be = t->be;
    for (int i = 0; t->slots && i < t->n_slots; i++)
        slot_free(t, &t->slots[i]);
    free(t->slots);
    if (t->work.x_in)
        nl_layer_acts_free(&t->work, be);
    if (t->sc.dh1)
        nl_layer_scratch_free(&t->sc, be);
    void *dev[] = {t->grads, t->mom[0],    t->mom[1],   t->dbuf[0],  t->dbuf[1],
                   t->pos_d, t->targets_d, t->losses_d, t->counts_d, t->global_frac_d,
                   t->aux_d, t->doc_d,     t->dpooled,  t->born_buf};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        be->free(be, dev[i]);
    free(t->pos_h);
    free(t->doc_h);
    free(t->labels_h);
    free(t->lengths_h);
    free(t->neg_pos_h);
    free(t->targets_h);
    free(t->losses_h);
    free(t->counts);
    free(t->global_frac);
    free(t->born);
    free(t);
    *tp = NULL;
}

/* ---------------------------------------------------------------- steps */

void nl_trainer_begin_step(nl_trainer *t, int64_t batch_rows)
{
    t->batch_rows = batch_rows;
    t->loss_rows = batch_rows;
    t->use_global = 0;
    if (t->frozen) { /* only the norms' gains get gradients (the rest stays zero) */
        for (int i = 0; i < t->m->n_table; i++) {
            const nl_param *p = &t->m->table[i];
            if (p->kind == NL_PARAM_NORM)
                t->be->zero(t->be, t->grads + p->offset, nl_param_numel(p) * sizeof(float));
        }
    } else {
        t->be->zero(t->be, t->grads, t->m->n_params * sizeof(float));
    }
    if (t->m->lora)
        t->be->zero(t->be, t->m->lora->grads, t->m->lora->n_params * sizeof(float));
    t->be->zero(t->be, t->counts_d,
                (size_t)t->n_layers * t->m->cfg.num_experts * sizeof *t->counts_d);
}

static nl_status check_rows(nl_trainer *t, int B, int T, nl_error *err)
{
    if (B < 1 || T < 1 || (long)B * T > t->max_rows)
        return nl_error_set(err, NL_ERR_SHAPE, "trainer: microbatch %d x %d is outside 1..%d rows",
                            B, T, t->max_rows);
    if (T > t->m->cfg.max_seq_len)
        return nl_error_set(err, NL_ERR_RANGE, "trainer: %d positions exceed max_seq_len %d", T,
                            t->m->cfg.max_seq_len);
    if (t->m->lora && B * T > t->m->lora->max_rows)
        return nl_error_set(err, NL_ERR_SHAPE, "trainer: %d rows exceed the adapters' %d", B * T,
                            t->m->lora->max_rows);
    if (t->batch_rows < (int64_t)B * T)
        return nl_error_set(err, NL_ERR_STATE, "trainer: no step begun for %d rows", B * T);
    return NL_OK;
}

void nl_trainer_set_loss_rows(nl_trainer *t, int64_t rows)
{
    t->loss_rows = rows > 0 ? rows : 1;
}

nl_status nl_trainer_set_docs(nl_trainer *t, const int32_t *doc, int rows, nl_error *err)
{
    t->has_doc = 0;
    if (!doc)
        return NL_OK;
    if (rows < 1 || rows > t->max_rows)
        return nl_error_set(err, NL_ERR_SHAPE, "trainer: %d document ids for %d rows", rows,
                            t->max_rows);
    memcpy(t->doc_h, doc, (size_t)rows * sizeof *doc);
    t->has_doc = 1;
    return NL_OK;
}

nl_status nl_trainer_set_labels(nl_trainer *t, const int32_t *labels, const int32_t *lengths, int B,
                                int T, nl_error *err)
{
    const int K = t->m->cfg.num_classes;
    t->has_labels = 0;
    if (!labels)
        return NL_OK;
    if (!t->m->has_head || K <= 0)
        return nl_error_set(err, NL_ERR_INVALID,
                            "trainer: labels need the last stage of a model with num_classes");
    if (B < 1 || T < 1 || (long)B * T > t->max_rows)
        return nl_error_set(err, NL_ERR_SHAPE, "trainer: labels for %d x %d rows", B, T);
    for (int b = 0; b < B; b++) {
        if (labels[b] < 0 || labels[b] >= K)
            return nl_error_set(err, NL_ERR_RANGE, "label %d of sequence %d is outside 0..%d",
                                labels[b], b, K - 1);
        if (!lengths || lengths[b] < 1 || lengths[b] > T)
            return nl_error_set(err, NL_ERR_RANGE, "sequence %d: length %d is outside 1..%d", b,
                                lengths ? lengths[b] : 0, T);
    }
    memcpy(t->labels_h, labels, (size_t)B * sizeof *labels);
    memcpy(t->lengths_h, lengths, (size_t)B * sizeof *lengths);
    t->has_labels = 1;
    return NL_OK;
}

/* The classifier's forward and loss over the final-normed states of slot s
 * (DESIGN 6): pooled[b] = mean of xnf over its lengths[b] first positions
 * (one GEMM with a row of ones each), logits = pooled W^T, cross-entropy
 * with the labels; the logits become their gradient. */
static void classify_forward(nl_trainer *t, train_slot *s, int B, int T)
{
    nl_backend *be = t->be;
    const nl_model *m = t->m;
    const int d = m->cfg.hidden_dim, K = m->cfg.num_classes;
    for (int b = 0; b < B; b++) {
        const int n = s->lengths_h[b];
        be->gemm(be, 0, 0, 1, d, n, 1.0f / (float)n, t->sc.ones, n, s->xnf + (size_t)b * T * d, d,
                 0.0f, s->pooled + (size_t)b * d, d);
    }
    be->gemm(be, 0, 1, B, K, d, 1.0f, s->pooled, d, m->classifier, d, 0.0f, s->clogits, K);
    be->upload(be, s->labels_d, t->labels_h, (size_t)B * sizeof(int32_t));
    be->cross_entropy(be, s->clogits, t->losses_d, s->labels_d, B, K, 1.0f / (float)t->loss_rows);
}

/* Its backward into dxn (N, d): the classifier's gradient, and each
 * pooled gradient spread evenly over the positions it averaged. */
static void classify_backward(nl_trainer *t, train_slot *s, float *dxn, int B, int T)
{
    nl_backend *be = t->be;
    const nl_model *m = t->m;
    const int d = m->cfg.hidden_dim, K = m->cfg.num_classes;
    float *dw = nl_lora_grad_of(m, m->classifier); /* a head trained with adapters */
    if (dw || !t->frozen)
        be->gemm(be, 1, 0, K, d, B, 1.0f, s->clogits, K, s->pooled, d, 1.0f,
                 dw ? dw : t->grads + (m->classifier - m->params), d);
    be->gemm(be, 0, 0, B, d, K, 1.0f, s->clogits, K, m->classifier, d, 0.0f, t->dpooled, d);
    be->zero(be, dxn, (size_t)B * T * d * sizeof(float));
    for (int b = 0; b < B; b++) {
        const int n = s->lengths_h[b];
        be->gemm(be, 1, 0, n, d, 1, 1.0f / (float)n, t->sc.ones, n, t->dpooled + (size_t)b * d, d,
                 0.0f, dxn + (size_t)b * T * d, d);
    }
}

/* Positions (restarting at each new document of packed rows, doc not
 * NULL) and their negation, and the documents, onto the device; returns
 * the device documents or NULL. */
static const int32_t *set_positions_docs(nl_trainer *t, int B, int T, const int32_t *doc)
{
    for (int n = 0; n < B * T; n++) {
        const int restart = n % T == 0 || (doc && doc[n] != doc[n - 1]);
        t->pos_h[n] = restart ? 0 : t->pos_h[n - 1] + 1;
        t->neg_pos_h[n] = -t->pos_h[n];
    }
    t->be->upload(t->be, t->pos_d, t->pos_h, (size_t)B * T * sizeof(int32_t));
    t->be->upload(t->be, t->sc.neg_pos_d, t->neg_pos_h, (size_t)B * T * sizeof(int32_t));
    if (!doc)
        return NULL;
    t->be->upload(t->be, t->doc_d, doc, (size_t)B * T * sizeof(int32_t));
    return t->doc_d;
}

/* Embed tokens (checked) or copy hidden states into dst. */
static nl_status stage_input(nl_trainer *t, float *dst, int32_t *tokens_d, int N,
                             const int32_t *tokens, const float *x_in, nl_error *err)
{
    nl_model *m = t->m;
    const int d = m->cfg.hidden_dim;
    if (m->has_embed) {
        if (!tokens)
            return nl_error_set(err, NL_ERR_INVALID, "trainer: first stage needs tokens");
        for (int n = 0; n < N; n++)
            if (tokens[n] < 0 || tokens[n] >= m->cfg.vocab_size)
                return nl_error_set(err, NL_ERR_RANGE, "token %d at row %d is outside 0..%lld",
                                    tokens[n], n, (long long)m->cfg.vocab_size - 1);
        t->be->upload(t->be, tokens_d, tokens, (size_t)N * sizeof(int32_t));
        t->be->embedding_forward(t->be, dst, tokens_d, m->tok_embeddings, N, d);
        return NL_OK;
    }
    if (!x_in)
        return nl_error_set(err, NL_ERR_INVALID, "trainer: stage needs hidden states");
    t->be->copy_rows(t->be, dst, d, x_in, d, N, d);
    return NL_OK;
}

nl_status nl_trainer_count_routes(nl_trainer *t, int B, int T, const int32_t *tokens,
                                  const float *x_in, nl_error *err)
{
    nl_status st = check_rows(t, B, T, err);
    if (st != NL_OK)
        return st;
    const int N = B * T, d = t->m->cfg.hidden_dim, E = t->m->cfg.num_experts;
    nl_layer_acts *w = &t->work;
    if ((st = stage_input(t, w->x_in, t->slots[0].tokens_d, N, tokens, x_in, err)) != NL_OK)
        return st;
    w->doc_d = set_positions_docs(t, B, T, t->has_doc ? t->doc_h : NULL);
    for (int l = 0; l < t->n_layers; l++) {
        /* the counts add up on the device; nl_trainer_use_counts reads them */
        const nl_layer_aux aux = {.rows = (double)N, .counts = t->counts_d + (size_t)l * E};
        nl_layer_forward(t->m, t->m->l0 + l, w, B, T, 0, NULL, t->pos_d, &aux);
        t->be->copy_rows(t->be, w->x_in, d, w->x_out, d, N, d);
    }
    return NL_OK;
}

int64_t *nl_trainer_route_counts(nl_trainer *t)
{
    const size_t n = (size_t)t->n_layers * t->m->cfg.num_experts;
    t->be->download(t->be, t->counts, t->counts_d, n * sizeof *t->counts);
    return t->counts;
}

void nl_trainer_use_counts(nl_trainer *t, const int64_t *counts)
{
    const int E = t->m->cfg.num_experts, k = t->m->cfg.top_k;
    const size_t n = (size_t)t->n_layers * E;
    /* one download per step: every layer's counts of every microbatch */
    if (!counts)
        counts = nl_trainer_route_counts(t);
    for (size_t i = 0; i < n; i++)
        t->global_frac[i] = (float)((double)counts[i] / ((double)t->batch_rows * k));
    t->be->upload(t->be, t->global_frac_d, t->global_frac, n * sizeof *t->global_frac);
    t->use_global = 1;
}

const float *nl_trainer_count_output(const nl_trainer *t)
{
    return t->work.x_in;
}

/* Add the first n row losses to *ce_sum (one download). */
static nl_status add_losses(nl_trainer *t, int n, double *ce_sum, nl_error *err)
{
    t->be->download(t->be, t->losses_h, t->losses_d, (size_t)n * sizeof(float));
    double sum = 0.0;
    for (int i = 0; i < n; i++)
        sum += t->losses_h[i];
    if (ce_sum)
        *ce_sum += sum;
    return nl_backend_check(t->be, err); /* a device's asynchronous error */
}

nl_status nl_trainer_forward(nl_trainer *t, int slot, int B, int T, const int32_t *tokens,
                             const float *x_in, const int32_t *targets, double *ce_sum, double *aux,
                             nl_error *err)
{
    nl_model *m = t->m;
    nl_backend *be = t->be;
    const nl_config *c = &m->cfg;
    const int N = B * T, d = c->hidden_dim, E = c->num_experts;
    nl_status st = check_rows(t, B, T, err);
    if (st != NL_OK)
        return st;
    if (slot < 0 || slot >= t->n_slots)
        return nl_error_set(err, NL_ERR_RANGE, "trainer: slot %d of %d", slot, t->n_slots);
    train_slot *s = &t->slots[slot];
    s->B = B;
    s->T = T;
    float *first = t->recompute ? (t->n_layers ? s->x_in[0] : s->x_final)
                                : (t->n_layers ? s->acts[0].x_in : s->x_final);
    if ((st = stage_input(t, first, s->tokens_d, N, tokens, x_in, err)) != NL_OK)
        return st;
    s->has_doc = t->has_doc;
    if (s->has_doc)
        memcpy(s->doc_h, t->doc_h, (size_t)N * sizeof *s->doc_h);
    const int32_t *doc_d = set_positions_docs(t, B, T, s->has_doc ? s->doc_h : NULL);
    be->zero(be, t->aux_d, sizeof(double));
    for (int l = 0; l < t->n_layers; l++) {
        const nl_layer_aux la_aux = {.global_frac =
                                         t->use_global ? t->global_frac_d + (size_t)l * E : NULL,
                                     .rows = (double)t->batch_rows,
                                     .sum = t->aux_d};
        nl_layer_acts *la = t->recompute ? &t->work : &s->acts[l];
        if (t->recompute)
            be->copy_rows(be, la->x_in, d, s->x_in[l], d, N, d);
        la->doc_d = doc_d;
        nl_layer_forward(m, m->l0 + l, la, B, T, 0, NULL, t->pos_d, &la_aux);
        if (t->recompute)
            be->copy_rows(be, l + 1 < t->n_layers ? s->x_in[l + 1] : s->x_final, d, la->x_out, d, N,
                          d);
    }
    if (aux && t->n_layers) { /* the layers' aux losses, summed on the device: one download */
        double a = 0.0;
        be->download(be, &a, t->aux_d, sizeof a);
        *aux += a;
    }
    if (!m->has_head)
        return nl_backend_check(be, err); /* a device's asynchronous error */
    s->classify = t->has_labels;
    if (s->classify) { /* the classifier on mean-pooled states, not the LM head */
        memcpy(s->lengths_h, t->lengths_h, (size_t)B * sizeof *s->lengths_h);
        be->rmsnorm_forward(be, s->xnf, s->rstdf, s->x_final, m->norm, N, d, (float)c->norm_eps);
        classify_forward(t, s, B, T);
        return add_losses(t, B, ce_sum, err);
    }
    /* head and loss: the logits become their gradient in place */
    if (!targets)
        return nl_error_set(err, NL_ERR_INVALID, "trainer: last stage needs targets");
    const int V = (int)c->vocab_size;
    for (int n = 0; n < N; n++) /* below 0: ignored (DESIGN 6) */
        if (targets[n] >= V)
            return nl_error_set(err, NL_ERR_RANGE, "target %d at row %d is outside 0..%d",
                                targets[n], n, V - 1);
    be->upload(be, t->targets_d, targets, (size_t)N * sizeof(int32_t));
    be->rmsnorm_forward(be, s->xnf, s->rstdf, s->x_final, m->norm, N, d, (float)c->norm_eps);
    be->gemm(be, 0, 1, N, V, d, 1.0f, s->xnf, d, m->lm_head, d, 0.0f, s->logits, V);
    be->cross_entropy(be, s->logits, t->losses_d, t->targets_d, N, V, 1.0f / (float)t->loss_rows);
    return add_losses(t, N, ce_sum, err);
}

const float *nl_trainer_output(const nl_trainer *t, int slot)
{
    return t->slots[slot].x_final;
}

nl_status nl_trainer_backward(nl_trainer *t, int slot, const float *dy, nl_error *err)
{
    nl_model *m = t->m;
    nl_backend *be = t->be;
    const nl_config *c = &m->cfg;
    if (slot < 0 || slot >= t->n_slots || t->slots[slot].B == 0)
        return nl_error_set(err, NL_ERR_STATE, "trainer: no forward in slot %d", slot);
    train_slot *s = &t->slots[slot];
    const int B = s->B, T = s->T, N = B * T, d = c->hidden_dim, E = c->num_experts;
    int cur = 0;
    if (m->has_head && s->classify) {
        classify_backward(t, s, t->sc.dxn, B, T);
        be->zero(be, t->dbuf[0], (size_t)N * d * sizeof(float));
        be->rmsnorm_backward(be, t->dbuf[0], t->grads + (m->norm - m->params), t->sc.dxn,
                             s->x_final, m->norm, s->rstdf, N, d);
    } else if (m->has_head) {
        const int V = (int)c->vocab_size;
        float *dlm = t->grads + (m->lm_head - m->params);
        if (!t->frozen) /* a frozen head has no weight gradient to take */
            be->gemm(be, 1, 0, V, d, N, 1.0f, s->logits, V, s->xnf, d, 1.0f, dlm, d);
        be->gemm(be, 0, 0, N, d, V, 1.0f, s->logits, V, m->lm_head, d, 0.0f, t->sc.dxn, d);
        be->zero(be, t->dbuf[0], (size_t)N * d * sizeof(float));
        be->rmsnorm_backward(be, t->dbuf[0], t->grads + (m->norm - m->params), t->sc.dxn,
                             s->x_final, m->norm, s->rstdf, N, d);
    } else {
        if (!dy)
            return nl_error_set(err, NL_ERR_INVALID, "trainer: stage backward needs dy");
        be->copy_rows(be, t->dbuf[0], d, dy, d, N, d);
    }
    const int32_t *doc_d = set_positions_docs(t, B, T, s->has_doc ? s->doc_h : NULL);
    const float aux_scale = (float)(c->aux_loss_coef * E / (double)t->batch_rows);
    for (int l = t->n_layers - 1; l >= 0; l--) {
        /* with recompute the slot keeps no activations (s->acts is NULL) */
        const nl_layer_acts *la = t->recompute ? &t->work : &s->acts[l];
        if (t->recompute) {
            const nl_layer_aux la_aux = {
                .global_frac = t->use_global ? t->global_frac_d + (size_t)l * E : NULL,
                .rows = (double)t->batch_rows};
            be->copy_rows(be, t->work.x_in, d, s->x_in[l], d, N, d);
            t->work.doc_d = doc_d;
            nl_layer_forward(m, m->l0 + l, &t->work, B, T, 0, NULL, t->pos_d, &la_aux);
        }
        nl_layer_backward(m, m->l0 + l, la, &t->sc, t->grads, t->dbuf[cur], t->dbuf[1 - cur], B, T,
                          aux_scale, t->frozen);
        cur = 1 - cur;
    }
    if (m->has_embed && !t->frozen)
        be->embedding_backward(be, t->grads + (m->tok_embeddings - m->params), t->dbuf[cur],
                               s->tokens_d, N, d);
    t->input_grad = t->dbuf[cur];
    if (t->inject_nan) {
        float nan = NAN;
        be->upload(be, t->grads, &nan, sizeof nan);
        t->inject_nan = 0;
    }
    return nl_backend_check(be, err); /* a device's asynchronous error */
}

const float *nl_trainer_input_grad(const nl_trainer *t)
{
    return t->input_grad;
}

double nl_trainer_grad_sumsq(const nl_trainer *t)
{
    if (t->m->lora) /* the base is frozen: only the adapters' gradients count */
        return t->be->sumsq(t->be, t->m->lora->grads, t->m->lora->n_params);
    return t->be->sumsq(t->be, t->grads, t->m->n_params);
}

/* Bias corrections of a region born at `born`, at step t (float, as the
 * slot takes them). */

float *nl_trainer_grads(const nl_trainer *t)
{
    return t->grads;
}
void nl_trainer_inject_nan(nl_trainer *t)
{
    t->inject_nan = 1;
}
void nl_trainer_keep_frozen_grads(nl_trainer *t)
{
    t->frozen = 0;
}

nl_status nl_trainer_step_local(nl_trainer *t, const int32_t *tokens, const int32_t *targets, int B,
                                int T, int M, float lr, float clip_norm, nl_adamw_opts o,
                                nl_step_result *res, nl_error *err)
{
    return nl_trainer_step_packed(t, tokens, targets, NULL, B, T, M, lr, clip_norm, o, res, err);
}

nl_status nl_trainer_grads_packed(nl_trainer *t, const int32_t *tokens, const int32_t *targets,
                                  const int32_t *doc, int B, int T, int M, double *ce, double *aux,
                                  int64_t *valid, nl_error *err)
{
    *ce = *aux = 0.0;
    *valid = 0;
    if (M < 1 || B % M != 0)
        return nl_error_set(err, NL_ERR_INVALID, "microbatches: %d does not divide batch %d", M, B);
    if (!t->m->has_embed || !t->m->has_head)
        return nl_error_set(err, NL_ERR_STATE, "local step needs the whole model");
    const int mb = B / M;
    const size_t rows = (size_t)mb * T;
    nl_status st = NL_OK;
    nl_trainer_begin_step(t, (int64_t)B * T);
    for (size_t n = 0; n < (size_t)B * T; n++) /* targets below 0 are ignored */
        *valid += targets[n] >= 0;
    nl_trainer_set_loss_rows(t, *valid);
    if (M > 1) { /* the batch's expert shares, so the split does not change the loss */
        for (int j = 0; j < M && st == NL_OK; j++)
            if ((st = nl_trainer_set_docs(t, doc ? doc + j * rows : NULL, (int)rows, err)) == NL_OK)
                st = nl_trainer_count_routes(t, mb, T, tokens + j * rows, NULL, err);
        if (st != NL_OK)
            return st;
        nl_trainer_use_counts(t, NULL);
    }
    for (int j = 0; j < M && st == NL_OK; j++) {
        if ((st = nl_trainer_set_docs(t, doc ? doc + j * rows : NULL, (int)rows, err)) == NL_OK)
            st = nl_trainer_forward(t, 0, mb, T, tokens + j * rows, NULL, targets + j * rows, ce,
                                    aux, err);
        if (st == NL_OK)
            st = nl_trainer_backward(t, 0, NULL, err);
    }
    nl_trainer_set_docs(t, NULL, 0, NULL);
    return st;
}

nl_status nl_trainer_step_packed(nl_trainer *t, const int32_t *tokens, const int32_t *targets,
                                 const int32_t *doc, int B, int T, int M, float lr, float clip_norm,
                                 nl_adamw_opts o, nl_step_result *res, nl_error *err)
{
    memset(res, 0, sizeof *res);
    double ce = 0.0, aux = 0.0;
    int64_t valid = 0;
    nl_status st =
        nl_trainer_grads_packed(t, tokens, targets, doc, B, T, M, &ce, &aux, &valid, err);
    if (st != NL_OK)
        return st;
    const double scale =
        nl_step_decide(res, ce, valid > 0 ? (double)valid : 1.0, aux, t->m->cfg.aux_loss_coef,
                       nl_trainer_grad_sumsq(t), clip_norm);
    if (!res->skipped)
        nl_trainer_step(t, lr, (float)scale, o);
    return NL_OK;
}

nl_status nl_trainer_step_classify(nl_trainer *t, const int32_t *tokens, const int32_t *lengths,
                                   const int32_t *labels, const int32_t *doc, int B, int T, int M,
                                   float lr, float clip_norm, nl_adamw_opts o, nl_step_result *res,
                                   nl_error *err)
{
    memset(res, 0, sizeof *res);
    if (M < 1 || B % M != 0)
        return nl_error_set(err, NL_ERR_INVALID, "microbatches: %d does not divide batch %d", M, B);
    if (!t->m->has_embed || !t->m->has_head)
        return nl_error_set(err, NL_ERR_STATE, "local step needs the whole model");
    const int mb = B / M;
    const size_t rows = (size_t)mb * T;
    nl_status st = NL_OK;
    double ce = 0.0, aux = 0.0;
    nl_trainer_begin_step(t, (int64_t)B * T);
    nl_trainer_set_loss_rows(t, B); /* one prediction per sequence */
    for (int j = 0; M > 1 && j < M && st == NL_OK; j++) {
        if ((st = nl_trainer_set_docs(t, doc + j * rows, (int)rows, err)) == NL_OK)
            st = nl_trainer_count_routes(t, mb, T, tokens + j * rows, NULL, err);
    }
    if (st != NL_OK)
        return st;
    if (M > 1)
        nl_trainer_use_counts(t, NULL);
    for (int j = 0; j < M && st == NL_OK; j++) {
        if ((st = nl_trainer_set_docs(t, doc + j * rows, (int)rows, err)) != NL_OK ||
            (st = nl_trainer_set_labels(t, labels + j * mb, lengths + j * mb, mb, T, err)) != NL_OK)
            break;
        st = nl_trainer_forward(t, 0, mb, T, tokens + j * rows, NULL, NULL, &ce, &aux, err);
        if (st == NL_OK)
            st = nl_trainer_backward(t, 0, NULL, err);
    }
    nl_trainer_set_labels(t, NULL, NULL, 0, 0, NULL);
    nl_trainer_set_docs(t, NULL, 0, NULL);
    if (st != NL_OK)
        return st;
    const double scale = nl_step_decide(res, ce, (double)B, aux, t->m->cfg.aux_loss_coef,
                                        nl_trainer_grad_sumsq(t), clip_norm);
    if (!res->skipped)
        nl_trainer_step(t, lr, (float)scale, o);
    return NL_OK;
}

nl_status nl_trainer_class_probs(const nl_trainer *t, int slot, float *probs, nl_error *err)
{
    const train_slot *s = slot >= 0 && slot < t->n_slots ? &t->slots[slot] : NULL;
    if (!s || !s->classify)
        return nl_error_set(err, NL_ERR_STATE, "trainer: no classification forward in slot %d",
                            slot);
    const int B = s->B, K = t->m->cfg.num_classes;
    t->be->download(t->be, probs, s->clogits, (size_t)B * K * sizeof *probs);
    /* the gradient is (p - onehot(label)) / loss_rows */
    const float inv = (float)t->loss_rows;
    for (int b = 0; b < B; b++)
        for (int k = 0; k < K; k++)
            probs[(size_t)b * K + k] =
                probs[(size_t)b * K + k] * inv + (k == t->labels_h[b] ? 1.0f : 0.0f);
    return nl_backend_check(t->be, err);
}
