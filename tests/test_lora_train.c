/* LoRA fine-tuning on a frozen base (core/train/train.h): the backward skips
 * the base's weight gradients. Each case fine-tunes the same adapters
 * twice from the same seeds, once as `neuroctl finetune` does (the skip)
 * and once with the test hook that computes the frozen gradients anyway
 * (the code before the skip), and checks
 *   - the adapters, their gradients, AdamW moments and every step's loss
 *     and gradient norm are the same bit for bit, and the base unchanged;
 *     so are the RMSNorm gains' gradients of the last step (the only part
 *     of the base's gradient buffer a frozen step clears and writes);
 *   - with the skip, no product writes into the base's gradient buffer
 *     (counted on the backend's own slots: gemm, gemm_grouped_wgrad,
 *     moe_ffn_backward, embedding_backward), and its slices of the
 *     matrices stay zero; without it, they are written;
 *   - the GEMM FLOPs (counted on gemm outside the fused expert slot) drop
 *     by exactly the skipped products'.
 * Cases: adapters on attention (the fused CPU expert backward), on the
 * experts too (the grouped GEMMs' path), and a classification head
 * trained with the adapters. */
#include "core/model/lora.h"
#include "core/model/rng.h"
#include "core/train/train.h"
#include "tests/check.h"

/* ---------------------------------------------------------------- counting slots */

static struct {
    nl_backend orig;          /* the backend's own slots */
    const char *lo, *hi;      /* the trainer's gradient buffer */
    unsigned long into_grads; /* products that wrote into it */
    int in_ffn;               /* inside moe_ffn_backward: its products are not counted */
    double flops;             /* 2 M N K of every gemm outside it */
} ct;

static int in_grads(const void *p)
{
    return (const char *)p >= ct.lo && (const char *)p < ct.hi;
}

static void c_gemm(nl_backend *be, int ta, int tb, int M, int N, int K, float alpha, const float *A,
                   int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    if (!ct.in_ffn) /* a CPU slot's own products reach this wrapper; devsim's do not */
        ct.flops += 2.0 * M * N * K;
    ct.into_grads += in_grads(C);
    ct.orig.gemm(be, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

static void c_wgrad(nl_backend *be, int M, int N, const float *A, int lda, const float *B, int ldb,
                    float *C, int ldc, size_t c_stride, const int32_t *offsets, int groups)
{
    ct.into_grads += in_grads(C);
    ct.orig.gemm_grouped_wgrad(be, M, N, A, lda, B, ldb, C, ldc, c_stride, offsets, groups);
}

static void c_ffn_backward(nl_backend *be, float *dxe, float *dgu, float *dhs, float *dexperts,
                           const float *dye, const float *xe, const float *gu, const float *hs,
                           const float *experts, size_t stride, int d, int F,
                           const int32_t *offsets, int groups)
{
    ct.into_grads += dexperts != NULL && in_grads(dexperts);
    ct.in_ffn = 1;
    ct.orig.moe_ffn_backward(be, dxe, dgu, dhs, dexperts, dye, xe, gu, hs, experts, stride, d, F,
                             offsets, groups);
    ct.in_ffn = 0;
}

static void c_embedding_backward(nl_backend *be, float *dtable, const float *dout,
                                 const int32_t *tokens, int N, int C)
{
    ct.into_grads += in_grads(dtable);
    ct.orig.embedding_backward(be, dtable, dout, tokens, N, C);
}

static void count_on(nl_backend *be)
{
    ct.orig = *be;
    be->gemm = c_gemm;
    be->gemm_grouped_wgrad = c_wgrad;
    if (be->moe_ffn_backward)
        be->moe_ffn_backward = c_ffn_backward;
    be->embedding_backward = c_embedding_backward;
}

static void count_off(nl_backend *be)
{
    be->gemm = ct.orig.gemm;
    be->gemm_grouped_wgrad = ct.orig.gemm_grouped_wgrad;
    be->moe_ffn_backward = ct.orig.moe_ffn_backward;
    be->embedding_backward = ct.orig.embedding_backward;
}

/* ---------------------------------------------------------------- one run */

typedef struct lcase {
    const char *name;
    int targets, dense, classes;
} lcase;

enum { B = 4, T = 12, M = 2, STEPS = 3 };

typedef struct run_out {
    float *adapters, *grads, *mom0, *mom1, *base; /* host copies */
    float *norm_grads; /* the base's gradient buffer, its norms' slices only (the rest zeroed) */
    double loss[STEPS], norm[STEPS];
    unsigned long into_grads;
    double flops;
    int matrices_zero; /* the base's matrix gradients all zero after the last step */
    size_t n_adapters, n_params;
} run_out;

static nl_config case_config(const lcase *k)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 32;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.ffn_dim = 24;
    c.num_experts = k->dense ? 1 : 4;
    c.top_k = k->dense ? 1 : 2;
    c.vocab_size = 48;
    c.vocab_chunk = 16;
    c.max_seq_len = 32;
    c.aux_loss_coef = 0.05;
    if (k->dense) {
        c.ffn_act = NL_FFN_GEGLU;
        c.causal = 0;
    }
    c.num_classes = k->classes;
    nl_config_fill_derived(&c);
    return c;
}

/* 1 when every float of the gradients of the base's matrices and tables
 * (all but the RMSNorm gains) is zero. */
static int matrices_zero(nl_backend *be, const nl_model *m, const float *grads)
{
    float *g = check_download(be, grads, m->n_params);
    int zero = g != NULL;
    for (int i = 0; zero && i < m->n_table; i++) {
        const nl_param *p = &m->table[i];
        for (size_t j = 0; p->kind != NL_PARAM_NORM && j < nl_param_numel(p); j++)
            zero &= g[p->offset + j] == 0.0f;
    }
    free(g);
    return zero;
}

static void batch(nl_rng *r, const nl_config *c, int32_t *tok, int32_t *tgt, int32_t *len,
                  int32_t *lab, int32_t *doc)
{
    for (int i = 0; i < B * T; i++) {
        tok[i] = (int32_t)nl_rng_below(r, (uint64_t)c->vocab_size);
        tgt[i] = (int32_t)nl_rng_below(r, (uint64_t)c->vocab_size);
    }
    for (int b = 0; b < B; b++) {
        len[b] = T - b;
        lab[b] = c->num_classes ? (int32_t)nl_rng_below(r, (uint64_t)c->num_classes) : 0;
        for (int t = 0; t < T; t++)
            doc[b * T + t] = t >= len[b];
    }
}

static void run(nl_backend *be, const lcase *k, int skip, run_out *o)
{
    memset(o, 0, sizeof *o);
    const nl_config c = case_config(k);
    nl_error err = {0};
    nl_model *m = NULL;
    nl_lora *lo = NULL;
    nl_trainer *t = NULL;
    CHECK_OK(nl_model_new(&m, be, &c, 0, c.num_layers, 1, 1, &err), &err);
    if (!m)
        return;
    CHECK_OK(nl_model_init_random(m, 11, &err), &err);
    CHECK_OK(nl_lora_new(&lo, m, 4, 8.0f, k->targets, B / M * T, &err), &err);
    if (lo)
        CHECK_OK(nl_lora_init_random(lo, 12, &err), &err);
    if (lo)
        CHECK_OK(nl_trainer_new(&t, m, B / M * T, 1, 0, &err), &err);
    if (!t)
        goto out;
    if (!skip)
        nl_trainer_keep_frozen_grads(t);
    float *base0 = check_download(be, m->params, m->n_params);
    ct.lo = (const char *)nl_trainer_grads(t);
    ct.hi = ct.lo + m->n_params * sizeof(float);
    ct.into_grads = 0;
    ct.flops = 0;
    nl_rng r;
    nl_rng_seed(&r, 13, 0);
    int32_t tok[B * T], tgt[B * T], len[B], lab[B], doc[B * T];
    count_on(be);
    for (int s = 0; s < STEPS; s++) {
        batch(&r, &c, tok, tgt, len, lab, doc);
        nl_step_result res;
        if (k->classes)
            CHECK_OK(nl_trainer_step_classify(t, tok, len, lab, doc, B, T, M, 1e-2f, 1.0f,
                                              nl_adamw_defaults(), &res, &err),
                     &err);
        else
            CHECK_OK(nl_trainer_step_local(t, tok, tgt, B, T, M, 1e-2f, 1.0f, nl_adamw_defaults(),
                                           &res, &err),
                     &err);
        CHECK(!res.skipped && isfinite(res.loss) && res.grad_norm > 0, "%s: step %d: loss %g",
              k->name, s, res.loss);
        o->loss[s] = res.loss;
        o->norm[s] = res.grad_norm;
    }
    count_off(be);
    o->into_grads = ct.into_grads;
    o->flops = ct.flops;
    o->n_adapters = lo->n_params;
    o->n_params = m->n_params;
    o->adapters = check_download(be, lo->params, lo->n_params);
    o->grads = check_download(be, lo->grads, lo->n_params);
    o->mom0 = check_download(be, lo->mom[0], lo->n_params);
    o->mom1 = check_download(be, lo->mom[1], lo->n_params);
    o->base = check_download(be, m->params, m->n_params);
    o->matrices_zero = matrices_zero(be, m, nl_trainer_grads(t));
    o->norm_grads = check_download(be, nl_trainer_grads(t), m->n_params);
    for (int i = 0; o->norm_grads && i < m->n_table; i++)
        if (m->table[i].kind != NL_PARAM_NORM)
            memset(o->norm_grads + m->table[i].offset, 0,
                   nl_param_numel(&m->table[i]) * sizeof(float));
    CHECK(base0 && o->base && memcmp(base0, o->base, m->n_params * sizeof *base0) == 0,
          "%s: the frozen base changed", k->name);
    free(base0);
out:
    nl_trainer_destroy(&t);
    nl_lora_destroy(&lo);
    nl_model_destroy(&m);
}

static void run_free(run_out *o)
{
    free(o->adapters);
    free(o->grads);
    free(o->mom0);
    free(o->mom1);
    free(o->base);
    free(o->norm_grads);
}

static int same(const float *a, const float *b, size_t n)
{
    return a && b && memcmp(a, b, n * sizeof *a) == 0;
}

/* The FLOPs of the weight-gradient products the skip drops in the run's
 * steps (those of the fused expert slot not counted): per microbatch of n
 * rows and layer, wo's, wqkv's and the router's, and the experts' gate|up
 * and down over the n k dispatch rows where their grouped GEMMs run; the
 * LM head's (a classifier trains with the adapters: not skipped). */
static double skipped_flops(const nl_backend *be, const lcase *k)
{
    const nl_config c = case_config(k);
    const double n = (double)B / M * T, d = c.hidden_dim, hd = nl_config_head_dim(&c);
    const double hq = c.num_heads * hd, qkv = (c.num_heads + 2 * c.num_kv_heads) * hd;
    const int fused =
        be->moe_ffn_backward && c.ffn_act != NL_FFN_GEGLU && !(k->targets & NL_LORA_EXPERTS);
    double layer = 2 * n * d * (hq + qkv);
    if (!nl_config_dense(&c))
        layer += 2 * n * d * c.num_experts; /* the router */
    if (!fused)
        layer += 2 * n * c.top_k * 3.0 * c.ffn_dim * d;
    const double head = k->classes ? 0 : 2 * n * (double)c.vocab_size * d;
    return (double)STEPS * M * (c.num_layers * layer + head);
}

static void check_case(nl_backend *be, const lcase *k)
{
    run_out s, f; /* with the skip; the frozen gradients computed (before it) */
    run(be, k, 1, &s);
    run(be, k, 0, &f);
    const size_t n = s.n_adapters;
    CHECK(n > 0 && n == f.n_adapters, "%s: %zu and %zu adapter floats", k->name, n, f.n_adapters);
    CHECK(same(s.adapters, f.adapters, n), "%s: adapters differ from the run without the skip",
          k->name);
    CHECK(same(s.grads, f.grads, n) && same(s.mom0, f.mom0, n) && same(s.mom1, f.mom1, n),
          "%s: adapter gradients or moments differ", k->name);
    CHECK(same(s.base, f.base, s.n_params), "%s: the bases differ", k->name);
    CHECK(same(s.norm_grads, f.norm_grads, s.n_params), "%s: the norm gains' gradients differ",
          k->name);
    for (int i = 0; i < STEPS; i++)
        CHECK(s.loss[i] == f.loss[i] && s.norm[i] == f.norm[i],
              "%s: step %d: loss %.17g vs %.17g, grad norm %.17g vs %.17g", k->name, i, s.loss[i],
              f.loss[i], s.norm[i], f.norm[i]);
    CHECK(s.into_grads == 0, "%s: skip: %lu products into the frozen gradients", k->name,
          s.into_grads);
    CHECK(f.into_grads > 0, "%s: without the skip, nothing wrote the base's gradients", k->name);
    CHECK(s.matrices_zero && !f.matrices_zero,
          "%s: base matrix gradients zero with the skip %d, without %d", k->name, s.matrices_zero,
          f.matrices_zero);
    const double want = skipped_flops(be, k);
    CHECK(f.flops - s.flops == want,
          "%s: GEMM FLOPs %.0f with the skip, %.0f without: %.0f "
          "skipped, want %.0f",
          k->name, s.flops, f.flops, f.flops - s.flops, want);
    printf("%s: adapters bit for bit (%zu floats, %d steps); GEMM FLOPs %.3g -> %.3g (%.2fx); "
           "%lu products into the frozen gradients -> %lu\n",
           k->name, n, STEPS, f.flops, s.flops, f.flops / (s.flops > 0 ? s.flops : 1), f.into_grads,
           s.into_grads);
    run_free(&s);
    run_free(&f);
}

/* --lora-targets (and an adapter file's targets): names from the list,
 * comma-separated; an unknown one, none, or a stray comma refused */
static void test_parse_targets(void)
{
    nl_error err = {0};
    int t = 0;
    CHECK_OK(nl_lora_parse_targets("wq,wv,w_up", &t, &err), &err);
    CHECK(t == (NL_LORA_WQ | NL_LORA_WV | NL_LORA_W_UP), "wq,wv,w_up: %#x", t);
    static const char *const bad[][2] = {{"wz", "'wz' is not one of"},
                                         {"", "none given"},
                                         {"wq,", "ends in a comma"},
                                         {"wq,,wv", "'' is not one of"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        nl_status st = nl_lora_parse_targets(bad[i][0], &t, &err);
        CHECK(st == NL_ERR_INVALID && strstr(err.msg, bad[i][1]), "'%s': %s '%s'", bad[i][0],
              nl_status_str(st), err.msg);
    }
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    test_parse_targets();
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    if (!be)
        return check_done("test_lora_train");
    const int attn = NL_LORA_WQ | NL_LORA_WK | NL_LORA_WV | NL_LORA_WO;
    const lcase cases[] = {
        {"attention adapters (fused expert backward)", attn, 0, 0},
        {"attention and expert adapters (grouped GEMMs)", attn | NL_LORA_EXPERTS, 0, 0},
        {"dense GeGLU classifier with its head", attn | NL_LORA_W_UP, 1, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_case(be, &cases[i]);
    nl_backend_destroy(&be);
    return check_done("test_lora_train");
}
