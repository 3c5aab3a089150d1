/* Numerics against PyTorch: golden files written by
 * tests/golden/gen_golden.py (from DESIGN.md section 2, not from this
 * code) hold a model, a batch, the expected logits and aux loss, and the
 * expected loss and gradient of every weight. */
#include "core/formats/checkpoint.h"
#include "core/formats/safetensors.h"
#include "core/model/forward.h"
#include "core/model/lora.h"
#include "core/train/train.h"
#include "tests/check.h"

/* DESIGN section 2, then the section 6 variants alone and combined (see
 * tests/golden/gen_golden.py, FAMILIES) */
static const char *const configs[] = {"odd",    "t1",     "long",   "topk3",   "enc",
                                      "geglu",  "dense",  "window", "encwin",  "yarn",
                                      "packed", "ignore", "combo",  "classify"};

static int read_ints(nl_st_file *f, const char *name, int32_t **out, int *B, int *T)
{
    const nl_st_entry *e = nl_st_find(f, name);
    if (!e || e->dtype != NL_DTYPE_I64 || e->ndim != 2)
        return -1;
    *B = (int)e->shape[0];
    *T = (int)e->shape[1];
    const int64_t *src = nl_st_tensor_data(f, e);
    *out = malloc((size_t)*B * *T * sizeof(int32_t));
    for (int i = 0; i < *B * *T; i++) {
        int64_t v;
        memcpy(&v, src + i, sizeof v);
        (*out)[i] = (int32_t)v;
    }
    return 0;
}

/* An I64 [B] vector as int32 (classification lengths and labels). */
static int read_vec(nl_st_file *f, const char *name, int32_t **out, int B)
{
    const nl_st_entry *e = nl_st_find(f, name);
    if (!e || e->dtype != NL_DTYPE_I64 || e->ndim != 1 || e->shape[0] != B)
        return -1;
    const int64_t *src = nl_st_tensor_data(f, e);
    *out = malloc((size_t)B * sizeof(int32_t));
    for (int i = 0; i < B; i++) {
        int64_t v;
        memcpy(&v, src + i, sizeof v);
        (*out)[i] = (int32_t)v;
    }
    return 0;
}

static float scalar(nl_st_file *f, const char *name)
{
    const nl_st_entry *e = nl_st_find(f, name);
    float v = NAN;
    if (e && e->dtype == NL_DTYPE_F32 && e->ndim == 0)
        memcpy(&v, nl_st_tensor_data(f, e), sizeof v);
    return v;
}

static void check_config(nl_backend *be, const char *name)
{
    char path[4][1024];
    const char *kinds[4] = {"model", "batch", "forward", "grads"};
    for (int i = 0; i < 4; i++)
        snprintf(path[i], sizeof path[i], "%s/tests/golden/data/%s.%s.safetensors",
                 check_source_dir(), name, kinds[i]);
    nl_error err = {0};
    nl_model *m = NULL;
    nl_st_file *fb = NULL, *ff = NULL, *fg = NULL;
    nl_runstate *rs = NULL;
    nl_trainer *tr = NULL;
    int32_t *tok = NULL, *tgt = NULL, *doc = NULL, *labels = NULL, *lengths = NULL;
    float *g = NULL; /* host copy of the gradients */
    int B = 0, T = 0, B2 = 0, T2 = 0;
    CHECK_OK(nl_checkpoint_load(&m, be, path[0], 0, -1, 1, 1, NULL, &err), &err);
    CHECK_OK(nl_st_open(&fb, path[1], &err), &err);
    CHECK_OK(nl_st_open(&ff, path[2], &err), &err);
    CHECK_OK(nl_st_open(&fg, path[3], &err), &err);
    if (!m || !fb || !ff || !fg)
        goto out;
    CHECK(read_ints(fb, "tokens", &tok, &B, &T) == 0, "%s: batch", name);
    if (nl_st_find(fb, "labels")) /* classification: one label per sequence */
        CHECK(read_vec(fb, "labels", &labels, B) == 0 && read_vec(fb, "lengths", &lengths, B) == 0,
              "%s: labels", name);
    else
        CHECK(read_ints(fb, "targets", &tgt, &B2, &T2) == 0, "%s: targets", name);
    if (!tok || (!tgt && !labels))
        goto out;
    int B3 = 0, T3 = 0; /* packed rows: their documents */
    if (nl_st_find(fb, "doc"))
        CHECK(read_ints(fb, "doc", &doc, &B3, &T3) == 0 && B3 == B && T3 == T, "%s: doc", name);
    const int V = (int)m->cfg.vocab_size;
    int valid = labels ? B : 0; /* targets below 0 are ignored */
    for (int i = 0; tgt && i < B * T; i++)
        valid += tgt[i] >= 0;

    /* forward */
    CHECK_OK(nl_runstate_new(&rs, m, B * T, &err), &err);
    float aux = 0;
    nl_forward_args a = {.B = B, .T = T, .tokens = tok, .doc = doc};
    CHECK_OK(nl_forward(m, rs, &a, &aux, &err), &err);
    const nl_st_entry *el = nl_st_find(ff, "logits");
    CHECK(el && el->ndim == 3 && el->shape[0] == B && el->shape[1] == T && el->shape[2] == V,
          "%s: golden logits shape", name);
    if (el) {
        float *lg = check_download(be, nl_runstate_output(rs, NULL), (size_t)B * T * V);
        double e = lg ? check_rel_err(lg, nl_st_tensor_data(ff, el), (size_t)B * T * V) : 1.0;
        free(lg);
        CHECK(e < 1e-4, "%s: logits rel err %g", name, e);
        printf("%s: logits rel err %.3g\n", name, e);
    }
    float want_aux = scalar(ff, "aux_loss");
    CHECK(fabsf(aux - want_aux) <= 1e-5f * fabsf(want_aux), "%s: aux_loss %.8g vs %.8g", name, aux,
          want_aux);

    /* loss and gradients */
    CHECK_OK(nl_trainer_new(&tr, m, B * T, 1, 0, &err), &err);
    if (!tr)
        goto out;
    double ce = 0, aux2 = 0;
    nl_trainer_begin_step(tr, (int64_t)B * T);
    nl_trainer_set_loss_rows(tr, valid);
    CHECK_OK(nl_trainer_set_docs(tr, doc, B * T, &err), &err);
    CHECK_OK(nl_trainer_set_labels(tr, labels, lengths, B, T, &err), &err);
    CHECK_OK(nl_trainer_forward(tr, 0, B, T, tok, NULL, tgt, &ce, &aux2, &err), &err);
    CHECK_OK(nl_trainer_backward(tr, 0, NULL, &err), &err);
    const double ce_loss = ce / valid, loss = ce_loss + m->cfg.aux_loss_coef * aux2;
    const double w_loss = scalar(fg, "loss"), w_ce = scalar(fg, "ce_loss"),
                 w_aux = scalar(fg, "aux_loss");
    CHECK(fabs(loss - w_loss) <= 1e-5 * fabs(w_loss), "%s: loss %.8g vs %.8g", name, loss, w_loss);
    CHECK(fabs(ce_loss - w_ce) <= 1e-5 * fabs(w_ce), "%s: ce_loss %.8g vs %.8g", name, ce_loss,
          w_ce);
    CHECK(fabs(aux2 - w_aux) <= 1e-5 * fabs(w_aux), "%s: aux_loss %.8g vs %.8g", name, aux2, w_aux);
    g = check_download(be, nl_trainer_grads(tr), m->n_params);
    if (!g)
        goto out;
    double worst = 0;
    const char *worst_name = "";
    for (int i = 0; i < m->n_table; i++) {
        const nl_param *p = &m->table[i];
        const nl_st_entry *e = nl_st_find(fg, p->name);
        CHECK(e && e->dtype == NL_DTYPE_F32 && (size_t)(e->nbytes / 4) == nl_param_numel(p),
              "%s: golden gradient %s", name, p->name);
        if (!e)
            continue;
        const float *want = nl_st_tensor_data(fg, e);
        const size_t n = nl_param_numel(p);
        double ref = 0.0, got = 0.0;
        for (size_t j = 0; j < n; j++) {
            ref += (double)want[j] * want[j];
            got += (double)g[p->offset + j] * g[p->offset + j];
        }
        if (sqrt(ref) < 1e-9) {
            /* an exactly-zero gradient (q and k when T = 1): ours must be
             * zero up to float rounding (1e-5 absolute; the others are O(1)) */
            CHECK(sqrt(got) < 1e-5, "%s: gradient of %s should vanish, norm %g", name, p->name,
                  sqrt(got));
            continue;
        }
        double r = check_rel_err(g + p->offset, want, n);
        CHECK(r < 1e-3, "%s: gradient of %s rel err %g", name, p->name, r);
        if (r > worst) {
            worst = r;
            worst_name = p->name;
        }
    }
    printf("%s: loss %.6f (golden %.6f), worst gradient rel err %.3g (%s)\n", name, loss, w_loss,
           worst, worst_name);
out:
    free(g);
    free(tok);
    free(tgt);
    free(doc);
    free(labels);
    free(lengths);
    nl_trainer_destroy(&tr);
    nl_runstate_destroy(&rs);
    nl_st_close(&fb);
    nl_st_close(&ff);
    nl_st_close(&fg);
    nl_model_destroy(&m);
}

/* LoRA (DESIGN 6): adapted logits and the adapters' gradients against
 * nlref; a step changes the adapters only (the base stays bit for bit);
 * merged weights give the adapted logits within 1e-5. */
static void check_lora(nl_backend *be, const char *name)
{
    char path[5][1024];
    const char *kinds[5] = {"model", "batch", "forward", "grads", "adapter"};
    for (int i = 0; i < 5; i++)
        snprintf(path[i], sizeof path[i], "%s/tests/golden/data/%s.%s.safetensors",
                 check_source_dir(), name, kinds[i]);
    nl_error err = {0};
    nl_model *m = NULL;
    nl_lora *lo = NULL;
    nl_st_file *fb = NULL, *ff = NULL, *fg = NULL;
    nl_runstate *rs = NULL;
    nl_trainer *tr = NULL;
    int32_t *tok = NULL, *tgt = NULL;
    float *g = NULL, *adapted = NULL, *base0 = NULL, *base1 = NULL, *merged = NULL;
    int B = 0, T = 0, B2 = 0, T2 = 0;
    CHECK_OK(nl_checkpoint_load(&m, be, path[0], 0, -1, 1, 1, NULL, &err), &err);
    CHECK_OK(nl_st_open(&fb, path[1], &err), &err);
    CHECK_OK(nl_st_open(&ff, path[2], &err), &err);
    CHECK_OK(nl_st_open(&fg, path[3], &err), &err);
    if (!m || !fb || !ff || !fg || read_ints(fb, "tokens", &tok, &B, &T) != 0 ||
        read_ints(fb, "targets", &tgt, &B2, &T2) != 0)
        goto out;
    CHECK_OK(nl_lora_load(&lo, m, path[4], B * T, &err), &err);
    if (!lo)
        goto out;
    const int V = (int)m->cfg.vocab_size;
    const size_t nlog = (size_t)B * T * V;
    CHECK_OK(nl_runstate_new(&rs, m, B * T, &err), &err);
    nl_forward_args a = {.B = B, .T = T, .tokens = tok};
    CHECK_OK(nl_forward(m, rs, &a, NULL, &err), &err);
    adapted = check_download(be, nl_runstate_output(rs, NULL), nlog);
    const nl_st_entry *el = nl_st_find(ff, "logits");
    double e = adapted && el ? check_rel_err(adapted, nl_st_tensor_data(ff, el), nlog) : 1.0;
    CHECK(e < 1e-4, "%s: adapted logits rel err %g", name, e);
    printf("%s: adapted logits rel err %.3g\n", name, e);

    CHECK_OK(nl_trainer_new(&tr, m, B * T, 1, 0, &err), &err);
    if (!tr)
        goto out;
    double ce = 0, aux = 0;
    nl_trainer_begin_step(tr, (int64_t)B * T);
    CHECK_OK(nl_trainer_forward(tr, 0, B, T, tok, NULL, tgt, &ce, &aux, &err), &err);
    CHECK_OK(nl_trainer_backward(tr, 0, NULL, &err), &err);
    g = check_download(be, lo->grads, lo->n_params);
    double worst = 0;
    for (int i = 0; g && i < lo->n_table; i++) {
        const nl_param *p = &lo->table[i];
        const nl_st_entry *ge = nl_st_find(fg, p->name);
        CHECK(ge && (size_t)(ge->nbytes / 4) == nl_param_numel(p), "%s: golden %s", name, p->name);
        if (!ge)
            continue;
        const double r = check_rel_err(g + p->offset, nl_st_tensor_data(fg, ge), nl_param_numel(p));
        CHECK(r < 1e-3, "%s: gradient of %s rel err %g", name, p->name, r);
        worst = r > worst ? r : worst;
    }
    printf("%s: %d adapter gradients, worst rel err %.3g\n", name, lo->n_table, worst);

    /* a step moves the adapters only */
    base0 = check_download(be, m->params, m->n_params);
    nl_trainer_step(tr, 1e-2f, 1.0f, nl_adamw_defaults());
    base1 = check_download(be, m->params, m->n_params);
    CHECK(base0 && base1 && memcmp(base0, base1, m->n_params * sizeof *base0) == 0,
          "%s: the frozen base changed in a step", name);

    /* merged = base + adapter */
    CHECK_OK(nl_forward(m, rs, &a, NULL, &err), &err);
    free(adapted);
    adapted = check_download(be, nl_runstate_output(rs, NULL), nlog);
    CHECK_OK(nl_lora_merge(lo, &err), &err);
    nl_lora_destroy(&lo);
    CHECK_OK(nl_forward(m, rs, &a, NULL, &err), &err);
    merged = check_download(be, nl_runstate_output(rs, NULL), nlog);
    e = adapted && merged ? check_rel_err(merged, adapted, nlog) : 1.0;
    CHECK(e < 1e-5, "%s: merged logits differ from base + adapter by %g", name, e);
    printf("%s: merged vs base + adapter rel err %.3g\n", name, e);
out:
    free(g);
    free(adapted);
    free(merged);
    free(base0);
    free(base1);
    free(tok);
    free(tgt);
    nl_trainer_destroy(&tr);
    nl_runstate_destroy(&rs);
    nl_lora_destroy(&lo);
    nl_st_close(&fb);
    nl_st_close(&ff);
    nl_st_close(&fg);
    nl_model_destroy(&m);
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    if (!be)
        return check_done("test_golden");
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++)
        check_config(be, configs[i]);
    check_lora(be, "lora");
    check_lora(be, "lora_moe");   /* the experts' w_gate, w_up, w_down too */
    check_lora(be, "lora_dense"); /* a dense GeGLU encoder's one expert */
    nl_backend_destroy(&be);
    return check_done("test_golden");
}
