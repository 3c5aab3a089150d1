/* The forward pass of a stage: embedding, pre-norm blocks of GQA attention
 * with RoPE and a top-k mixture of SwiGLU experts, final norm and head. */
#include "core/model/forward.h"

#include "core/model/lora.h"

#include "core/model/layer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- state */

/* Everything a recorded decode step depends on besides device memory:
 * the model's buffers and shapes (its generation), the batch-size bucket
 * B, the cache's buffers and capacity, the input and the head's mode. */
typedef struct step_key {
    const nl_model *m;
    uint64_t generation;
    int B, last_only, states, cap, fused;
    const float *x_in;
    const void *kc, *vc;
} step_key;

typedef struct step_graph {
    void *g; /* the backend's recorded step, or NULL (a free entry) */
    step_key key;
    uint64_t used; /* for replacing the least recently used */
    const float *out;
    int out_cols;
} step_graph;

#define RS_GRAPHS 8  /* recorded steps kept per runstate */
#define RS_THRASH 16 /* recordings before their replays are judged */

struct nl_runstate {
    nl_backend *be;
    int max_rows;
    int out_cols;
    const float *out;
    int32_t *tokens_d;  /* (N) */
    int32_t *pos_d;     /* (N) */
    int32_t *pos_h;     /* (N) host */
    int32_t *doc_d;     /* (N) packed rows' documents */
    nl_layer_acts acts; /* one set, reused by every layer; residual in acts.x_in */
    float *last;        /* (B, d) last rows for last_only */
    float *xnf;         /* (N, d) final norm */
    float *logits;      /* (N, V) */
    step_graph graphs[RS_GRAPHS];
    uint64_t tick;
    int graphs_off; /* NL_GRAPHS=0, nl_runstate_set_graphs, or a failed recording */
    nl_runstate_graph_stats gs;
};

static int graphs_env_off(void)
{
    const char *v = getenv("NL_GRAPHS");
    return v && strcmp(v, "0") == 0;
}

nl_status nl_runstate_new(nl_runstate **out, const nl_model *m, int max_rows, nl_error *err)
{
    *out = NULL;
    const nl_config *c = &m->cfg;
    const size_t N = (size_t)max_rows, d = (size_t)c->hidden_dim;
    if (max_rows < 1)
        return nl_error_set(err, NL_ERR_INVALID, "runstate: max_rows %d must be positive",
                            max_rows);
    nl_runstate *rs = calloc(1, sizeof *rs);
    if (!rs)
        return nl_error_set(err, NL_ERR_NOMEM, "runstate: out of memory");
    nl_backend *be = m->be;
    rs->be = be;
    rs->max_rows = max_rows;
    rs->graphs_off = graphs_env_off();
    nl_status st = nl_layer_acts_alloc(&rs->acts, be, c, max_rows, 0, err);
    if (st != NL_OK) {
        free(rs);
        return st;
    }
    int ok = 1;
    ok &= (rs->tokens_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
    ok &= (rs->pos_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
    ok &= (rs->doc_d = be->alloc(be, N * sizeof(int32_t))) != NULL;
    ok &= (rs->pos_h = calloc(N, sizeof(int32_t))) != NULL;
    ok &= (rs->last = be->alloc(be, N * d * sizeof(float))) != NULL;
    ok &= (rs->xnf = be->alloc(be, N * d * sizeof(float))) != NULL;
    if (m->has_head)
        ok &= (rs->logits = be->alloc(be, N * (size_t)c->vocab_size * sizeof(float))) != NULL;
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
    for (int i = 0; i < RS_GRAPHS; i++)
        if (rs->graphs[i].g)
            be->graph_free(be, rs->graphs[i].g);
    nl_layer_acts_free(&rs->acts, be);
    be->free(be, rs->tokens_d);
    be->free(be, rs->pos_d);
    be->free(be, rs->doc_d);
    be->free(be, rs->last);
    be->free(be, rs->xnf);
    be->free(be, rs->logits);
    free(rs->pos_h);
    free(rs);
    *rsp = NULL;
}

const float *nl_runstate_output(const nl_runstate *rs, int *cols)
{
    if (cols)
        *cols = rs->out_cols;
    return rs->out;
}

void nl_runstate_set_graphs(nl_runstate *rs, int on)
{
    rs->graphs_off = !on;
}

nl_runstate_graph_stats nl_runstate_graphs(const nl_runstate *rs)
{
    return rs->gs;
}

/* ---------------------------------------------------------------- forward */

/* The device work of a forward, after its inputs are uploaded: the
 * embedding (or the input copy), every layer, the head. Queues only, so it
 * can be recorded; sets rs->out. */
static void queue_step(nl_model *m, nl_runstate *rs, const nl_forward_args *a, int past)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const int B = a->B, T = a->T, d = c->hidden_dim, N = B * T;
    float *x = rs->acts.x_in; /* the residual stream, updated in place */
    if (m->has_embed)
        be->embedding_forward(be, x, rs->tokens_d, m->tok_embeddings, N, d);
    else
        be->copy_rows(be, x, d, a->x_in, d, N, d);
    /* the layers queue device work only; their aux losses add up in
     * acts.aux_d, read (one download) only when the caller asks */
    be->zero(be, rs->acts.aux_d, sizeof(double));
    for (int l = m->l0; l < m->l1; l++)
        nl_layer_forward(m, l, &rs->acts, B, T, past, a->kv, rs->pos_d, NULL);
    rs->out = x;
    rs->out_cols = d;
    if (!m->has_head)
        return;
    const float *h = x;
    int rows = N;
    if (a->last_only) {
        be->copy_rows(be, rs->last, d, x + (size_t)(T - 1) * d, T * d, B, d);
        h = rs->last;
        rows = B;
    }
    const int V = (int)c->vocab_size;
    be->rmsnorm_forward(be, rs->xnf, NULL, h, m->norm, rows, d, (float)c->norm_eps);
    if (a->states) { /* the final-normed states, for embeddings */
        rs->out = rs->xnf;
        return;
    }
    be->gemm(be, 0, 1, rows, V, d, 1.0f, rs->xnf, d, m->lm_head, d, 0.0f, rs->logits, V);
    rs->out = rs->logits;
    rs->out_cols = V;
}

/* A decode step (one new position per sequence, with a cache) can be
 * recorded once and replayed: its positions are on the device. */
static int step_recordable(const nl_model *m, const nl_runstate *rs, const nl_forward_args *a)
{
    const nl_backend *be = m->be;
    return !rs->graphs_off && be->graph_begin && be->kv_store && a->kv && a->T == 1 && !a->doc &&
           !m->lora && !rs->acts.host_routing;
}

/* The entry to record into: a free one, else the least recently used. */
static step_graph *graph_slot(nl_runstate *rs)
{
    step_graph *best = &rs->graphs[0];
    for (int i = 0; i < RS_GRAPHS; i++) {
        step_graph *sg = &rs->graphs[i];
        if (!sg->g)
            return sg;
        if (sg->used < best->used)
            best = sg;
    }
    rs->be->graph_free(rs->be, best->g);
    best->g = NULL;
    return best;
}

/* Run a recordable step: replay its graph for this key, or record one
 * (after dropping the graphs of the model's older generations) and run
 * it. A step the backend cannot record runs as it is, and this runstate
 * records no more. */
static void run_recorded(nl_model *m, nl_runstate *rs, const nl_forward_args *a, int past)
{
    nl_backend *be = m->be;
    step_key key;
    memset(&key, 0, sizeof key); /* compared whole, padding included */
    key.m = m;
    key.generation = m->generation;
    key.B = a->B;
    key.last_only = a->last_only;
    key.states = a->states;
    key.cap = a->kv->cap;
    key.fused = rs->acts.fused;
    key.x_in = m->has_embed ? NULL : a->x_in;
    key.kc = a->kv->k;
    key.vc = a->kv->v;
    rs->tick++;
    for (int i = 0; i < RS_GRAPHS; i++) {
        step_graph *sg = &rs->graphs[i];
        if (!sg->g)
            continue;
        if (sg->key.m == m && sg->key.generation != m->generation) {
            be->graph_free(be, sg->g); /* the model changed: never valid again */
            sg->g = NULL;
            continue;
        }
        if (memcmp(&sg->key, &key, sizeof key) != 0)
            continue;
        if (be->graph_launch(be, sg->g) == 0) {
            sg->used = rs->tick;
            rs->out = sg->out;
            rs->out_cols = sg->out_cols;
            rs->gs.replays++;
            return;
        }
        be->graph_free(be, sg->g); /* the backend invalidated it: record again */
        sg->g = NULL;
    }
    step_graph *sg = graph_slot(rs);
    nl_error e = {0};
    void *g = NULL;
    rs->acts.dev_past = 1;
    be->graph_begin(be);
    queue_step(m, rs, a, 0);
    const nl_status st = be->graph_end(be, &g, &e);
    rs->acts.dev_past = 0;
    if (st != NL_OK || be->graph_launch(be, g) != 0) {
        if (g)
            be->graph_free(be, g);
        rs->graphs_off = 1;
        rs->gs.failed++;
        queue_step(m, rs, a, past);
        return;
    }
    *sg = (step_graph){
        .g = g, .key = key, .used = rs->tick, .out = rs->out, .out_cols = rs->out_cols};
    rs->gs.captures++;
    /* keys that keep changing (more sessions' caches than entries, taking
     * turns) would record at every step: past RS_THRASH recordings, one
     * replayed less than twice on average turns recording off */
    if (rs->gs.captures >= RS_THRASH && rs->gs.replays < 2 * rs->gs.captures)
        rs->graphs_off = 1;
}

nl_status nl_forward(nl_model *m, nl_runstate *rs, const nl_forward_args *a, float *aux_loss,
                     nl_error *err)
{
    nl_backend *be = m->be;
    const nl_config *c = &m->cfg;
    const int B = a->B, T = a->T;
    const long N = (long)B * T;
    int past = 0;
    if (B < 1 || T < 1 || N > rs->max_rows)
        return nl_error_set(err, NL_ERR_SHAPE, "forward: batch %d x %d is outside 1..%d rows", B, T,
                            rs->max_rows);
    if (m->lora && N > m->lora->max_rows)
        return nl_error_set(err, NL_ERR_SHAPE, "forward: %ld rows exceed the adapters' %d", N,
                            m->lora->max_rows);
    if (a->kv && !c->causal)
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "forward: an encoder (causal: false) has no kv cache");
    if (a->doc && (a->kv || !be->attention_masked_forward))
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            a->kv ? "forward: packed rows (doc) take no kv cache"
                                  : "forward: backend %s has no masked attention for packed rows",
                            be->name);
    if (a->kv) {
        if (a->kv->B != B || a->kv->n_layers != m->l1 - m->l0)
            return nl_error_set(err, NL_ERR_SHAPE,
                                "forward: kv cache holds %d sequences of %d layers, got %d",
                                a->kv->B, a->kv->n_layers, B);
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
                return nl_error_set(
                    err, NL_ERR_RANGE,
                    "forward: token %d at [%ld, %ld] is outside the vocabulary 0..%lld",
                    a->tokens[n], n / T, n % T, (long long)c->vocab_size - 1);
        be->upload(be, rs->tokens_d, a->tokens, (size_t)N * sizeof(int32_t));
    } else if (!a->x_in) {
        return nl_error_set(err, NL_ERR_INVALID, "forward: stage needs hidden states");
    }
    for (long n = 0; n < N; n++) /* packed rows: from 0 in each document */
        rs->pos_h[n] = n % T == 0 || (a->doc && a->doc[n] != a->doc[n - 1]) ? (int32_t)past
                                                                            : rs->pos_h[n - 1] + 1;
    be->upload(be, rs->pos_d, rs->pos_h, (size_t)N * sizeof(int32_t));
    rs->acts.doc_d = NULL;
    if (a->doc) {
        be->upload(be, rs->doc_d, a->doc, (size_t)N * sizeof(int32_t));
        rs->acts.doc_d = rs->doc_d;
    }
    rs->acts.fused = aux_loss == NULL; /* the fused decode slots make no aux loss */
    if (step_recordable(m, rs, a))
        run_recorded(m, rs, a, past);
    else
        queue_step(m, rs, a, past);
    if (a->kv)
        a->kv->len += T;
    if (aux_loss) {
        double aux = 0.0;
        if (m->l1 > m->l0)
            be->download(be, &aux, rs->acts.aux_d, sizeof aux);
        *aux_loss = (float)aux;
    }
    return nl_backend_check(be, err); /* a device's asynchronous error */
}
