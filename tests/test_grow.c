/* Growth (core/grow/grow.h). Vocabulary: old rows, old logits and old moments
 * stay bit-identical, new rows equal a fresh init of the larger table, new
 * moments are zero, and a grown model keeps training. Depth: logits
 * bit-identical, new blocks are the identity and train. Width: logits
 * within 1e-5. The history's JSON and regions; a sharded checkpoint grown
 * equals the same growth in memory. */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "core/formats/checkpoint.h"
#include "core/formats/manifest.h"
#include "core/grow/grow.h"
#include "core/model/forward.h"
#include "core/model/memory.h"
#include "core/train/train.h"
#include "tests/check.h"

static nl_config cfg_with(int64_t vocab)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 32;
    c.num_layers = 2;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.ffn_dim = 24;
    c.num_experts = 4;
    c.vocab_size = vocab;
    c.vocab_chunk = 64;
    c.max_seq_len = 32;
    nl_config_fill_derived(&c);
    return c;
}

static void test_vocab(nl_backend *be)
{
    enum { B = 2, T = 7 };
    nl_error err = {0};
    nl_model *m = NULL, *fresh = NULL;
    nl_trainer *tr = NULL;
    nl_runstate *rs = NULL;
    nl_config c = cfg_with(100), big = cfg_with(200);
    CHECK_OK(nl_model_new(&m, be, &c, 0, 2, 1, 1, &err), &err);
    CHECK_OK(nl_model_new(&fresh, be, &big, 0, 2, 1, 1, &err), &err);
    if (!m || !fresh)
        return;
    CHECK_OK(nl_model_init_random(m, 42, &err), &err);
    CHECK_OK(nl_model_init_random(fresh, 42, &err), &err);

    /* train two steps so the moments are non-zero */
    CHECK_OK(nl_trainer_new(&tr, m, B * T, 1, 0, &err), &err);
    int32_t tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++) {
        tok[i] = (i * 7) % 100;
        tgt[i] = (i * 13 + 1) % 100;
    }
    nl_step_result r;
    for (int s = 0; s < 2; s++)
        CHECK_OK(nl_trainer_step_local(tr, tok, tgt, B, T, 1, 1e-2f, 1.0f, nl_adamw_defaults(), &r,
                                       &err),
                 &err);
    const size_t old_n = m->n_params;
    float *old_w = check_download(be, m->params, old_n);
    float *old_m = check_download(be, nl_trainer_moment(tr, 0), old_n);
    float *old_v = check_download(be, nl_trainer_moment(tr, 1), old_n);
    nl_param old_table[64];
    int old_count = m->n_table;
    memcpy(old_table, m->table, (size_t)old_count * sizeof *old_table);

    /* old logits */
    CHECK_OK(nl_runstate_new(&rs, m, B * T, &err), &err);
    nl_forward_args a = {.B = B, .T = T, .tokens = tok};
    CHECK_OK(nl_forward(m, rs, &a, NULL, &err), &err);
    float *old_logits = check_download(be, nl_runstate_output(rs, NULL), (size_t)B * T * 100);
    nl_runstate_destroy(&rs);

    /* grow with the moments moved out of the trainer */
    float *mom[2];
    mom[0] = be->alloc(be, old_n * 4);
    mom[1] = be->alloc(be, old_n * 4);
    be->upload(be, mom[0], old_m, old_n * 4);
    be->upload(be, mom[1], old_v, old_n * 4);
    nl_trainer_destroy(&tr);
    CHECK(nl_model_grow_vocab(m, 50, 42, mom, 2, &err) == NL_ERR_INVALID, "shrinking is refused");
    CHECK_OK(nl_model_grow_vocab(m, 200, 42, mom, 2, &err), &err);
    CHECK(m->capacity == 256 && m->cfg.vocab_size == 200, "capacity %lld", (long long)m->capacity);
    /* host copies of the grown weights and moments and of the fresh init */
    float *new_w = check_download(be, m->params, m->n_params);
    float *new_m = check_download(be, mom[0], m->n_params);
    float *new_v = check_download(be, mom[1], m->n_params);
    float *fresh_w = check_download(be, fresh->params, fresh->n_params);
    for (int i = 0; i < old_count; i++) {
        const nl_param *p = &old_table[i], *q = nl_model_find_param(m, p->name);
        const nl_param *f = nl_model_find_param(fresh, p->name);
        if (!q || !f) {
            CHECK(0, "%s after growth", p->name);
            continue;
        }
        const size_t n = nl_param_numel(p);
        CHECK(memcmp(new_w + q->offset, old_w + p->offset, n * 4) == 0, "%s: old values kept",
              p->name);
        CHECK(memcmp(new_m + q->offset, old_m + p->offset, n * 4) == 0 &&
                  memcmp(new_v + q->offset, old_v + p->offset, n * 4) == 0,
              "%s: old moments kept", p->name);
        if (p->kind != NL_PARAM_TABLE)
            continue;
        const size_t extra = nl_param_numel(q) - n;
        CHECK(memcmp(new_w + q->offset + n, fresh_w + f->offset + n, extra * 4) == 0,
              "%s: new rows equal a fresh init of the larger table", p->name);
        int zero = 1;
        for (size_t j = 0; j < extra; j++)
            zero &= new_m[q->offset + n + j] == 0.0f && new_v[q->offset + n + j] == 0.0f;
        CHECK(zero, "%s: new rows' moments start at zero", p->name);
    }
    /* old logits unchanged */
    CHECK_OK(nl_runstate_new(&rs, m, B * T, &err), &err);
    CHECK_OK(nl_forward(m, rs, &a, NULL, &err), &err);
    float *lg = check_download(be, nl_runstate_output(rs, NULL), (size_t)B * T * 200);
    int same = 1;
    for (int n = 0; n < B * T; n++)
        same &= memcmp(lg + (size_t)n * 200, old_logits + (size_t)n * 100, 100 * 4) == 0;
    CHECK(same, "logits over the old vocabulary are bit-identical");
    free(lg);
    nl_runstate_destroy(&rs);

    /* keeps training, with the new ids */
    CHECK_OK(nl_trainer_new(&tr, m, B * T, 1, 0, &err), &err);
    if (tr) {
        be->upload(be, nl_trainer_moment(tr, 0), new_m, m->n_params * 4);
        be->upload(be, nl_trainer_moment(tr, 1), new_v, m->n_params * 4);
        tgt[0] = 150;
        tok[1] = 199;
        CHECK_OK(nl_trainer_step_local(tr, tok, tgt, B, T, 1, 1e-2f, 1.0f, nl_adamw_defaults(), &r,
                                       &err),
                 &err);
        CHECK(!r.skipped && isfinite(r.loss), "grown model trains: loss %g", r.loss);
    }
    be->free(be, mom[0]);
    be->free(be, mom[1]);
    free(old_w);
    free(old_m);
    free(old_v);
    free(old_logits);
    free(new_w);
    free(new_m);
    free(new_v);
    free(fresh_w);
    nl_trainer_destroy(&tr);
    nl_model_destroy(&m);
    nl_model_destroy(&fresh);
}

/* ---------------------------------------------------------------- helpers */

enum { B = 2, T = 7 };

static void batch(int32_t *tok, int32_t *tgt, int V, int salt)
{
    for (int i = 0; i < B * T; i++) {
        tok[i] = (i * 7 + salt) % V;
        tgt[i] = (i * 13 + 1 + salt) % V;
    }
}

/* Host logits (B*T rows of the active vocabulary) of a whole model. */
static float *logits_of(nl_model *m, const int32_t *tok)
{
    nl_error err = {0};
    nl_runstate *rs = NULL;
    float *out = NULL;
    CHECK_OK(nl_runstate_new(&rs, m, B * T, &err), &err);
    nl_forward_args a = {.B = B, .T = T, .tokens = tok};
    if (rs && nl_forward(m, rs, &a, NULL, &err) == NL_OK)
        out = check_download(m->be, nl_runstate_output(rs, NULL),
                             (size_t)B * T * (size_t)m->cfg.vocab_size);
    CHECK(out, "forward: %s", err.msg);
    nl_runstate_destroy(&rs);
    return out;
}

/* Train `steps` steps from the moments in mom (updated in place); returns
 * the last loss. */
static double train(nl_model *m, float **mom, int64_t *adam, int steps, int salt)
{
    nl_error err = {0};
    nl_trainer *tr = NULL;
    nl_step_result r = {0};
    int32_t tok[B * T], tgt[B * T];
    const size_t bytes = m->n_params * sizeof(float);
    CHECK_OK(nl_trainer_new(&tr, m, B * T, 1, 0, &err), &err);
    if (!tr)
        return NAN;
    m->be->copy_rows(m->be, nl_trainer_moment(tr, 0), 0, mom[0], 0, 1, (int)(bytes / 4));
    m->be->copy_rows(m->be, nl_trainer_moment(tr, 1), 0, mom[1], 0, 1, (int)(bytes / 4));
    nl_trainer_set_adam_steps(tr, *adam);
    for (int s = 0; s < steps; s++) {
        batch(tok, tgt, (int)m->cfg.vocab_size, salt + s);
        CHECK_OK(nl_trainer_step_local(tr, tok, tgt, B, T, 1, 1e-2f, 1.0f, nl_adamw_defaults(), &r,
                                       &err),
                 &err);
    }
    m->be->copy_rows(m->be, mom[0], 0, nl_trainer_moment(tr, 0), 0, 1, (int)(bytes / 4));
    m->be->copy_rows(m->be, mom[1], 0, nl_trainer_moment(tr, 1), 0, 1, (int)(bytes / 4));
    *adam = nl_trainer_adam_steps(tr);
    nl_trainer_destroy(&tr);
    return r.loss;
}

static void moments_new(nl_backend *be, const nl_model *m, float **mom)
{
    mom[0] = be->alloc(be, m->n_params * 4);
    mom[1] = be->alloc(be, m->n_params * 4);
}

static int all_zero(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (x[i] != 0.0f)
            return 0;
    return 1;
}

static int is_out_proj(const char *name)
{
    return strstr(name, "attention.wo.") || strstr(name, "w_down.");
}

/* ---------------------------------------------------------------- depth */

static void test_depth(nl_backend *be)
{
    nl_error err = {0};
    nl_model *m = NULL, *fresh = NULL, *old = NULL;
    float *mom[2];
    int64_t adam = 0;
    int32_t tok[B * T], tgt[B * T];
    nl_config c = cfg_with(100), deep = cfg_with(100);
    deep.num_layers = 4;
    CHECK_OK(nl_model_new(&m, be, &c, 0, 2, 1, 1, &err), &err);
    CHECK_OK(nl_model_new(&old, be, &c, 0, 2, 1, 1, &err), &err);
    CHECK_OK(nl_model_new(&fresh, be, &deep, 0, 4, 1, 1, &err), &err);
    if (!m || !old || !fresh)
        return;
    CHECK_OK(nl_model_init_random(m, 42, &err), &err);
    CHECK_OK(nl_model_init_random(fresh, 42, &err), &err);
    moments_new(be, m, mom);
    train(m, mom, &adam, 2, 0);
    be->copy_rows(be, old->params, 0, m->params, 0, 1, (int)m->n_params);
    float *old_m = check_download(be, mom[0], m->n_params);
    batch(tok, tgt, 100, 5);
    float *before = logits_of(m, tok);

    CHECK(nl_model_grow_depth(m, 1, 42, mom, 2, &err) == NL_ERR_INVALID, "shrinking is refused");
    CHECK_OK(nl_model_grow_depth(m, 4, 42, mom, 2, &err), &err);
    CHECK(m->cfg.num_layers == 4 && m->l0 == 0 && m->l1 == 4, "layers [%d, %d) of %d", m->l0, m->l1,
          m->cfg.num_layers);
    float *w = check_download(be, m->params, m->n_params);
    float *mm = check_download(be, mom[0], m->n_params);
    float *fw = check_download(be, fresh->params, fresh->n_params);
    float *ow = check_download(be, old->params, old->n_params);
    int kept = 1, ident = 1, drawn = 1, zero_m = 1;
    for (int i = 0; i < m->n_table; i++) {
        const nl_param *q = &m->table[i], *p = nl_model_find_param(old, q->name);
        const nl_param *f = nl_model_find_param(fresh, q->name);
        const size_t n = nl_param_numel(q);
        if (p) {
            kept &= memcmp(w + q->offset, ow + p->offset, n * 4) == 0 &&
                    memcmp(mm + q->offset, old_m + p->offset, n * 4) == 0;
            continue;
        }
        zero_m &= all_zero(mm + q->offset, n);
        if (is_out_proj(q->name))
            ident &= all_zero(w + q->offset, n);
        else
            drawn &= f && memcmp(w + q->offset, fw + f->offset, n * 4) == 0;
    }
    CHECK(kept, "old tensors and moments bit-identical");
    CHECK(ident, "new wo and w_down are zero");
    CHECK(drawn, "the other new tensors equal a fresh init of the deeper model");
    CHECK(zero_m, "new tensors' moments start at zero");
    float *after = logits_of(m, tok);
    CHECK(before && after && memcmp(before, after, (size_t)B * T * 100 * 4) == 0,
          "depth growth: logits bit-identical");

    /* the new blocks train: wo of a new layer leaves zero */
    double loss = train(m, mom, &adam, 3, 9);
    CHECK(isfinite(loss) && adam == 5, "trains after depth growth: loss %g, adam %lld", loss,
          (long long)adam);
    const nl_param *wo3 = nl_model_find_param(m, "layers.3.attention.wo.weight");
    const nl_param *wd2 = nl_model_find_param(m, "layers.2.moe.experts.0.w_down.weight");
    float *w2 = check_download(be, m->params, m->n_params);
    CHECK(wo3 && wd2 && !all_zero(w2 + wo3->offset, nl_param_numel(wo3)) &&
              !all_zero(w2 + wd2->offset, nl_param_numel(wd2)),
          "new layers' wo and w_down move after training");
    free(w2);
    free(w);
    free(mm);
    free(fw);
    free(ow);
    free(old_m);
    free(before);
    free(after);
    be->free(be, mom[0]);
    be->free(be, mom[1]);
    nl_model_destroy(&m);
    nl_model_destroy(&old);
    nl_model_destroy(&fresh);
}

/* ---------------------------------------------------------------- width */

static void test_width(nl_backend *be)
{
    nl_error err = {0};
    nl_model *m = NULL;
    float *mom[2];
    int64_t adam = 0;
    int32_t tok[B * T], tgt[B * T];
    nl_config c = cfg_with(100), w;
    CHECK(nl_config_widen(&c, 40, 0, &w, &err) == NL_ERR_INVALID, "40 is not whole heads of 16");
    CHECK(nl_config_widen(&c, 48, 0, &w, &err) == NL_ERR_INVALID,
          "3 heads cannot keep 2 heads : 1 kv head: %s", err.msg);
    CHECK(nl_config_widen(&c, 16, 0, &w, &err) == NL_ERR_INVALID, "narrowing is refused");
    CHECK_OK(nl_config_widen(&c, 64, 40, &w, &err), &err);
    CHECK(w.num_heads == 4 && w.num_kv_heads == 2 && w.ffn_dim == 40 &&
              w.norm_eps == c.norm_eps * 0.5,
          "widened config: H %d G %d F %d eps %g", w.num_heads, w.num_kv_heads, w.ffn_dim,
          w.norm_eps);
    CHECK_OK(nl_model_new(&m, be, &c, 0, 2, 1, 1, &err), &err);
    if (!m)
        return;
    CHECK_OK(nl_model_init_random(m, 42, &err), &err);
    moments_new(be, m, mom);
    double loss0 = train(m, mom, &adam, 3, 0);
    batch(tok, tgt, 100, 5);
    float *before = logits_of(m, tok);
    CHECK_OK(nl_model_grow_width(m, 64, 40, 42, mom, 2, &err), &err);
    CHECK(m->cfg.hidden_dim == 64 && m->cfg.ffn_dim == 40, "d %d F %d", m->cfg.hidden_dim,
          m->cfg.ffn_dim);
    float *after = logits_of(m, tok);
    const size_t n = (size_t)B * T * 100;
    double rel = before && after ? check_rel_err(after, before, n) : 1.0;
    double worst = 0, scale = 0;
    for (size_t i = 0; before && after && i < n; i++) {
        worst = fmax(worst, fabs((double)after[i] - before[i]));
        scale = fmax(scale, fabs((double)before[i]));
    }
    CHECK(rel < 1e-5 && worst <= 1e-5 * scale, "width growth: logits within 1e-5 (rel %g, max %g)",
          rel, worst / scale);
    /* new moments zero, old embedding rows' new columns zero */
    const nl_param *e = nl_model_find_param(m, "tok_embeddings.weight");
    float *hw = check_download(be, m->params, m->n_params);
    int zero = 1;
    for (int64_t r = 0; e && r < e->shape[0]; r++)
        zero &= all_zero(hw + e->offset + r * 64 + 32, 32);
    CHECK(zero, "tok_embeddings' new columns are zero");
    double loss1 = train(m, mom, &adam, 3, 3);
    CHECK(isfinite(loss1) && loss1 < loss0 * 1.5, "keeps training after widening: %g then %g",
          loss0, loss1);
    free(hw);
    free(before);
    free(after);
    be->free(be, mom[0]);
    be->free(be, mom[1]);
    nl_model_destroy(&m);
}

/* ---------------------------------------------------------------- history */

static void test_history(nl_backend *be)
{
    nl_error err = {0};
    nl_config a = cfg_with(100), b = cfg_with(200), c = b, d;
    c.num_layers = 4;
    CHECK_OK(nl_config_widen(&c, 64, 0, &d, &err), &err);
    nl_growth h[3] = {
        {.step = 10, .kind = NL_GROW_VOCAB, .before = a, .after = b, .adam_steps = 9},
        {.step = 10, .kind = NL_GROW_DEPTH, .before = b, .after = c, .adam_steps = 9},
        {.step = 30, .kind = NL_GROW_WIDTH, .before = c, .after = d, .adam_steps = 28}};
    char *json = nl_growth_to_json(h, 3);
    nl_growth *back = NULL;
    int n = 0;
    CHECK(json != NULL, "history to JSON");
    CHECK_OK(nl_growth_from_json(json, &back, &n, &err), &err);
    CHECK(n == 3 && back && back[2].kind == NL_GROW_WIDTH && back[2].step == 30 &&
              back[2].adam_steps == 28 && back[2].after.hidden_dim == 64 &&
              back[1].after.num_layers == 4 && back[0].before.vocab_size == 100,
          "history JSON round trip");
    free(back);
    back = NULL;
    /* untrusted: a broken chain, a bad kind, not an array */
    nl_growth bad[2] = {h[0], h[2]};
    char *chain = nl_growth_to_json(bad, 2);
    CHECK(nl_growth_from_json(chain, &back, &n, &err) == NL_ERR_FORMAT &&
              strstr(err.msg, "growth[1]"),
          "a broken chain is refused: %s", err.msg);
    char *kind = strdup(json);
    char *k = strstr(kind, "\"depth\"");
    if (k)
        memcpy(k, "\"deep\" ", 7);
    CHECK(nl_growth_from_json(kind, &back, &n, &err) == NL_ERR_FORMAT && strstr(err.msg, "kind"),
          "a bad kind is refused: %s", err.msg);
    CHECK(nl_growth_from_json("{}", &back, &n, &err) == NL_ERR_FORMAT, "not an array");
    char line[256];
    nl_growth_describe(&h[1], line, sizeof line);
    CHECK(!strcmp(line, "depth 2 -> 4 layers at step 10"), "describe: %s", line);
    nl_growth_describe(&h[0], line, sizeof line);
    CHECK(!strcmp(line, "vocab 100 -> 200 (table rows 128 -> 256) at step 10"), "describe: %s",
          line);
    CHECK(nl_growth_from_json("[{\"step\":-1}]", &back, &n, &err) == NL_ERR_FORMAT,
          "a negative step");
    free(json);
    free(chain);
    free(kind);

    /* regions, in the coordinates of the grown tensors */
    nl_grow_rect r[2];
    CHECK(nl_growth_regions(&h[0], "lm_head.weight", r) == 1 && r[0].r0 == 128 && r[0].r1 == 256 &&
              r[0].c0 == 0 && r[0].c1 == 32,
          "vocab: the new table rows");
    CHECK(nl_growth_regions(&h[0], "layers.0.attention.wq.weight", r) == 0, "vocab: no wq");
    CHECK(nl_growth_regions(&h[1], "layers.3.attention.wq.weight", r) == 1 && r[0].r0 == 0 &&
              r[0].r1 == 32 && r[0].c1 == 32,
          "depth: a new layer whole");
    CHECK(nl_growth_regions(&h[1], "layers.1.attention.wq.weight", r) == 0, "depth: old layer");
    CHECK(nl_growth_regions(&h[2], "layers.1.attention.wq.weight", r) == 2 && r[0].r0 == 32 &&
              r[0].r1 == 64 && r[0].c1 == 64 && r[1].r0 == 0 && r[1].r1 == 32 && r[1].c0 == 32 &&
              r[1].c1 == 64,
          "width: new rows, and new columns of the old rows");
    CHECK(nl_growth_regions(&h[2], "norm.weight", r) == 1 && r[0].r0 == 32 && r[0].r1 == 64 &&
              r[0].c1 == 1,
          "width: a gain's new entries");

    /* shapes by name agree with the model's layout */
    nl_model *m = NULL;
    CHECK_OK(nl_model_new(&m, be, &d, 0, 4, 1, 1, &err), &err);
    int same = m != NULL;
    for (int i = 0; m && i < m->n_table; i++) {
        int64_t s[2];
        const nl_param *p = &m->table[i];
        same &= nl_config_param_shape(&d, p->name, s) == p->ndim && s[0] == p->shape[0] &&
                (p->ndim == 1 || s[1] == p->shape[1]);
    }
    CHECK(same, "nl_config_param_shape matches the layout");
    int64_t s[2];
    CHECK(nl_config_param_shape(&d, "layers.4.attention.wq.weight", s) == 0 &&
              nl_config_param_shape(&d, "layers.0.moe.experts.4.w_up.weight", s) == 0 &&
              nl_config_param_shape(&d, "bogus", s) == 0,
          "no such parameter");
    nl_model_destroy(&m);
}

/* ---------------------------------------------------------------- AdamW */

/* One step of model `a` (with its history) and of `b` (the same weights
 * and moments, no history). Elements outside every region must get the
 * same bits; those inside must follow AdamW with the corrections of their
 * birth at `born`. Returns the number of region elements checked. */
static size_t step_pair(nl_backend *be, nl_model *a, nl_model *b, float **mom, int64_t adam,
                        int64_t born, int expect_live)
{
    nl_error err = {0};
    nl_trainer *ta = NULL, *tb = NULL;
    nl_step_result r;
    int32_t tok[B * T], tgt[B * T];
    const size_t n = a->n_params;
    const nl_adamw_opts o = nl_adamw_defaults();
    const float lr = 1e-2f;
    size_t checked = 0;
    CHECK_OK(nl_trainer_new(&ta, a, B * T, 1, 0, &err), &err);
    CHECK_OK(nl_trainer_new(&tb, b, B * T, 1, 0, &err), &err);
    if (!ta || !tb)
        goto out;
    nl_trainer *both[2] = {ta, tb};
    for (int k = 0; k < 2; k++) {
        be->copy_rows(be, nl_trainer_moment(both[k], 0), 0, mom[0], 0, 1, (int)n);
        be->copy_rows(be, nl_trainer_moment(both[k], 1), 0, mom[1], 0, 1, (int)n);
        nl_trainer_set_adam_steps(both[k], adam);
    }
    float *p0 = check_download(be, a->params, n);
    batch(tok, tgt, (int)a->cfg.vocab_size, 4);
    /* no clipping: grad_scale 1 */
    CHECK_OK(nl_trainer_step_local(ta, tok, tgt, B, T, 1, lr, 1e9f, o, &r, &err), &err);
    CHECK_OK(nl_trainer_step_local(tb, tok, tgt, B, T, 1, lr, 1e9f, o, &r, &err), &err);
    float *pa = check_download(be, a->params, n), *pb = check_download(be, b->params, n);
    float *g = check_download(be, nl_trainer_grads(ta), n);
    float *m0 = check_download(be, mom[0], n), *v0 = check_download(be, mom[1], n);
    const double k = (double)(adam + 1 - born);
    const float bc1 = (float)(1.0 - pow(o.beta1, k)), bc2 = (float)(1.0 - pow(o.beta2, k));
    int outside = 1, inside = 1, differs = 0;
    for (int i = 0; i < a->n_table; i++) {
        const nl_param *p = &a->table[i];
        const int64_t C = p->ndim == 2 ? p->shape[1] : 1;
        for (size_t e = 0; e < nl_param_numel(p); e++) {
            const int64_t row = (int64_t)e / C, col = (int64_t)e % C;
            int in = 0;
            for (int h = 0; h < a->n_growth && !in; h++) {
                nl_grow_rect rr[2];
                const int nr = nl_growth_regions(&a->growth[h], p->name, rr);
                for (int q = 0; q < nr; q++)
                    in |= row >= rr[q].r0 && row < rr[q].r1 && col >= rr[q].c0 && col < rr[q].c1;
            }
            const size_t j = p->offset + e;
            if (!in || !expect_live) {
                outside &= memcmp(&pa[j], &pb[j], 4) == 0;
                continue;
            }
            const float wd = p->kind == NL_PARAM_NORM ? 0.0f : o.weight_decay;
            const float mi = o.beta1 * m0[j] + (1.0f - o.beta1) * g[j];
            const float vi = o.beta2 * v0[j] + (1.0f - o.beta2) * g[j] * g[j];
            const float want = p0[j] - lr * (mi / bc1 / (sqrtf(vi / bc2) + o.eps) + wd * p0[j]);
            inside &= fabsf(pa[j] - want) <= 1e-6f * fmaxf(1.0f, fabsf(want));
            differs |= pa[j] != pb[j];
            checked++;
        }
    }
    CHECK(outside, "old elements: the same bits as without growth regions");
    if (expect_live) {
        CHECK(inside, "new elements: bias correction counted from their birth");
        CHECK(differs, "and that differs from counting from step 1");
    }
    free(p0);
    free(pa);
    free(pb);
    free(g);
    free(m0);
    free(v0);
out:
    nl_trainer_destroy(&ta);
    nl_trainer_destroy(&tb);
    return checked;
}

static void test_adamw(nl_backend *be)
{
    nl_error err = {0};
    nl_model *a = NULL, *b = NULL;
    float *mom[2];
    int64_t adam = 0;
    nl_config c = cfg_with(100);
    CHECK_OK(nl_model_new(&a, be, &c, 0, 2, 1, 1, &err), &err);
    if (!a)
        return;
    CHECK_OK(nl_model_init_random(a, 42, &err), &err);
    moments_new(be, a, mom);
    train(a, mom, &adam, 3, 0);
    /* all three kinds at step 3 */
    nl_config c0 = a->cfg;
    CHECK_OK(nl_model_grow_vocab(a, 200, 42, mom, 2, &err), &err);
    nl_config c1 = a->cfg;
    CHECK_OK(nl_model_grow_depth(a, 3, 42, mom, 2, &err), &err);
    nl_config c2 = a->cfg;
    CHECK_OK(nl_model_grow_width(a, 64, 40, 42, mom, 2, &err), &err);
    nl_growth h[3] = {{3, NL_GROW_VOCAB, c0, c1, adam},
                      {3, NL_GROW_DEPTH, c1, c2, adam},
                      {3, NL_GROW_WIDTH, c2, a->cfg, adam}};
    CHECK_OK(nl_model_set_growth(a, h, 3, &err), &err);
    CHECK_OK(nl_model_new(&b, be, &a->cfg, 0, 3, 1, 1, &err), &err);
    if (b) {
        be->copy_rows(be, b->params, 0, a->params, 0, 1, (int)a->n_params);
        size_t n = step_pair(be, a, b, mom, adam, adam, 1);
        CHECK(n > a->n_params / 2, "%zu new elements checked", n);
        /* 400 steps after birth the corrections agree in float: no region is live */
        be->copy_rows(be, b->params, 0, a->params, 0, 1, (int)a->n_params);
        step_pair(be, a, b, mom, adam + 400, adam, 0);
    }
    be->free(be, mom[0]);
    be->free(be, mom[1]);
    nl_model_destroy(&a);
    nl_model_destroy(&b);
}

/* ---------------------------------------------------------------- manifest */

static char dir[256];

static const char *at(const char *name)
{
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

/* A 3-layer model trained 2 steps, cut into 3 shards with a manifest. */
static void write_sharded(nl_backend *be, nl_model *m, float **mom, int64_t adam)
{
    static const struct {
        int l0, l1, embed, head;
    } cut[3] = {{0, 1, 1, 0}, {1, 2, 0, 0}, {2, 3, 0, 1}};
    static char names[3][32];
    nl_error err = {0};
    nl_manifest_shard sh[3];
    nl_ckpt_extra whole = {.m = mom[0], .v = mom[1], .adam_steps = adam};
    CHECK_OK(nl_checkpoint_save(m, at("whole.safetensors"), 2, &whole, &err), &err);
    for (int i = 0; i < 3; i++) {
        nl_model *s = NULL;
        int64_t a = 0;
        snprintf(names[i], sizeof names[i], "stage-%d.safetensors", i);
        CHECK_OK(nl_checkpoint_load(&s, be, at("whole.safetensors"), cut[i].l0, cut[i].l1,
                                    cut[i].embed, cut[i].head, NULL, &err),
                 &err);
        if (!s)
            return;
        float *mm = be->alloc(be, s->n_params * 4), *vv = be->alloc(be, s->n_params * 4);
        CHECK_OK(nl_checkpoint_load_optim(s, at("whole.safetensors"), mm, vv, &a, NULL, &err),
                 &err);
        nl_ckpt_extra extra = {.m = mm, .v = vv, .adam_steps = a};
        CHECK_OK(nl_checkpoint_save(s, at(names[i]), 2, &extra, &err), &err);
        be->free(be, mm);
        be->free(be, vv);
        nl_model_destroy(&s);
        sh[i] = (nl_manifest_shard){.stage = i,
                                    .l0 = cut[i].l0,
                                    .l1 = cut[i].l1,
                                    .has_embed = cut[i].embed,
                                    .has_head = cut[i].head,
                                    .file = names[i]};
        CHECK_OK(nl_file_sha256(at(names[i]), sh[i].sha256, &sh[i].bytes, &err), &err);
    }
    nl_manifest mf = {.step = 2,
                      .adam_steps = adam,
                      .cfg = m->cfg,
                      .init_seed = "42",
                      .n_shards = 3,
                      .shards = sh};
    CHECK_OK(nl_manifest_write(at("manifest.json"), &mf, &err), &err);
}

/* The whole model and its moments from a manifest. */
static nl_model *load_whole(nl_backend *be, const char *path, float **mom, nl_manifest **out)
{
    nl_error err = {0};
    nl_manifest *mf = NULL;
    nl_model *m = NULL;
    CHECK_OK(nl_manifest_load(&mf, path, &err), &err);
    if (!mf)
        return NULL;
    const size_t n = (size_t)nl_stage_param_count(&mf->cfg, mf->cfg.num_layers, 1, 1);
    mom[0] = be->alloc(be, n * 4);
    mom[1] = be->alloc(be, n * 4);
    CHECK_OK(nl_manifest_load_stage(&m, be, mf, 0, -1, 1, 1, mom[0], mom[1], &err), &err);
    *out = mf;
    return m;
}

static int same_device(nl_backend *be, const float *a, const float *b, size_t n)
{
    float *x = check_download(be, a, n), *y = check_download(be, b, n);
    int same = x && y && memcmp(x, y, n * 4) == 0;
    free(x);
    free(y);
    return same;
}

static void test_manifest(nl_backend *be)
{
    nl_error err = {0};
    nl_model *m = NULL, *g = NULL, *w = NULL, *e = NULL;
    nl_manifest *mf = NULL, *mf2 = NULL;
    float *mom[2], *gm[2] = {NULL, NULL}, *wm[2] = {NULL, NULL};
    int64_t adam = 0;
    int32_t tok[B * T], tgt[B * T];
    char *path = NULL, *path2 = NULL;
    snprintf(dir, sizeof dir, "%s/test_grow.XXXXXX", P_tmpdir);
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    nl_config c = cfg_with(100);
    c.num_layers = 3;
    CHECK_OK(nl_model_new(&m, be, &c, 0, 3, 1, 1, &err), &err);
    if (!m)
        return;
    CHECK_OK(nl_model_init_random(m, 42, &err), &err);
    moments_new(be, m, mom);
    train(m, mom, &adam, 2, 0);
    write_sharded(be, m, mom, adam);

    /* vocabulary past the capacity and depth, into the same directory */
    nl_grow_spec spec = {.vocab_size = 200, .n_layers = 5};
    /* a growth that fails half-way leaves nothing behind: it can be retried */
    FILE *block = fopen(at("grow2-stage-3.safetensors"), "w");
    if (block)
        fclose(block);
    CHECK(nl_manifest_grow(at("manifest.json"), &spec, UINT64_MAX, dir, &path, &err) ==
                  NL_ERR_STATE &&
              access(at("grow2-stage-0.safetensors"), F_OK) != 0 &&
              access(at("manifest-grow2.json"), F_OK) != 0,
          "a failed growth removes the shards it wrote: %s", err.msg);
    unlink(at("grow2-stage-3.safetensors"));
    CHECK_OK(nl_manifest_grow(at("manifest.json"), &spec, UINT64_MAX, dir, &path, &err), &err);
    CHECK(path && strstr(path, "/manifest-grow2.json"), "grown manifest %s",
          path ? path : "(none)");
    CHECK(nl_manifest_grow(at("manifest.json"), &spec, UINT64_MAX, dir, NULL, &err) ==
                  NL_ERR_STATE &&
              strstr(err.msg, "grow2-stage-0"),
          "a second growth into the same files is refused: %s", err.msg);
    CHECK(nl_manifest_grow(at("manifest.json"), &(nl_grow_spec){.n_layers = 3}, 1, dir, NULL,
                           &err) == NL_ERR_INVALID,
          "nothing to grow");
    g = path ? load_whole(be, path, gm, &mf) : NULL;
    if (g && mf) {
        CHECK(mf->n_shards == 4 && !strcmp(mf->shards[1].file, "stage-1.safetensors") &&
                  !strcmp(mf->shards[2].file, "stage-2.safetensors") && !mf->shards[2].has_head &&
                  mf->shards[3].l0 == 3 && mf->shards[3].l1 == 5 && mf->shards[3].has_head &&
                  strcmp(mf->shards[0].file, "stage-0.safetensors") != 0,
              "plan: middle shards reused, a new shard of the new layers and the head");
        CHECK(mf->n_growth == 2 && mf->growth[0].kind == NL_GROW_VOCAB &&
                  mf->growth[1].kind == NL_GROW_DEPTH && mf->growth[1].step == 2 &&
                  mf->growth[1].adam_steps == adam && mf->growth[1].after.num_layers == 5 &&
                  mf->growth[0].after.vocab_size == 200,
              "manifest history: vocab then depth");
        CHECK(g->n_growth == 2, "a stage loaded from it carries the history");
        /* the same growth in memory */
        CHECK_OK(nl_model_grow_vocab(m, 200, 42, mom, 2, &err), &err);
        CHECK_OK(nl_model_grow_depth(m, 5, 42, mom, 2, &err), &err);
        CHECK(m->n_params == g->n_params && same_device(be, m->params, g->params, m->n_params) &&
                  same_device(be, mom[0], gm[0], m->n_params) &&
                  same_device(be, mom[1], gm[1], m->n_params),
              "grown shards equal the growth in memory, weights and moments");
        /* export keeps the history */
        CHECK_OK(nl_manifest_export(mf, at("joined.safetensors"), &err), &err);
        CHECK_OK(nl_checkpoint_load(&e, be, at("joined.safetensors"), 0, -1, 1, 1, NULL, &err),
                 &err);
        CHECK(e && e->n_growth == 2 && e->growth[1].kind == NL_GROW_DEPTH,
              "export and load keep the history");
        /* width on top, into another directory: reused shards are links */
        char other[300];
        snprintf(other, sizeof other, "%s/wide", dir);
        spec = (nl_grow_spec){.hidden_dim = 64};
        CHECK_OK(nl_manifest_grow(path, &spec, UINT64_MAX, other, &path2, &err), &err);
        w = path2 ? load_whole(be, path2, wm, &mf2) : NULL;
        CHECK(w && w->n_growth == 3 && w->growth[2].kind == NL_GROW_WIDTH &&
                  w->cfg.hidden_dim == 64 && mf2->n_shards == 4,
              "width on a grown manifest: history of 3");
        batch(tok, tgt, 100, 1);
        float *a = logits_of(g, tok), *b = w ? logits_of(w, tok) : NULL;
        CHECK(a && b && check_rel_err(b, a, (size_t)B * T * 200) < 1e-5,
              "widened shards: logits within 1e-5");
        free(a);
        free(b);
    }
    for (int j = 0; j < 2; j++) {
        be->free(be, mom[j]);
        be->free(be, gm[j]);
        be->free(be, wm[j]);
    }
    free(path);
    free(path2);
    nl_manifest_destroy(&mf);
    nl_manifest_destroy(&mf2);
    nl_model_destroy(&m);
    nl_model_destroy(&g);
    nl_model_destroy(&w);
    nl_model_destroy(&e);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "clean up %s", dir);
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    if (!be)
        return check_done("test_grow");
    test_vocab(be);
    test_depth(be);
    test_width(be);
    test_history(be);
    test_adamw(be);
    test_manifest(be);
    nl_backend_destroy(&be);
    return check_done("test_grow");
}
