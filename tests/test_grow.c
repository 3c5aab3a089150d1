/* Vocabulary growth: old rows, old logits and old moments stay
 * bit-identical, new rows equal a fresh init of the larger table, new
 * moments are zero, and a grown model keeps training. */
#include "check.h"
#include "core/forward.h"
#include "core/train.h"

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

int main(void)
{
    enum { B = 2, T = 7 };
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL, *fresh = NULL;
    nl_trainer *tr = NULL;
    nl_runstate *rs = NULL;
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    nl_config c = cfg_with(100), big = cfg_with(200);
    CHECK_OK(nl_model_new(&m, be, &c, 0, 2, 1, 1, &err), &err);
    CHECK_OK(nl_model_new(&fresh, be, &big, 0, 2, 1, 1, &err), &err);
    if (!m || !fresh)
        return check_done("test_grow");
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
    nl_backend_destroy(&be);
    return check_done("test_grow");
}
