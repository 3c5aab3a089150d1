/* Training in one process: microbatch and recompute parity, the
 * non-finite guard, learning a copy task, the memory model against the
 * backend's own allocation count, and the host synchronisations of the
 * trainer's calls (independent of the layer count). Gradients against PyTorch are in
 * test_golden. */
#include <float.h>

#include "core/data/data.h"
#include "core/model/forward.h"
#include "core/model/memory.h"
#include "core/model/rng.h"
#include "core/train/train.h"
#include "tests/check.h"

static nl_config small_config(void)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 48;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.ffn_dim = 40;
    c.num_experts = 4;
    c.vocab_size = 40;
    c.vocab_chunk = 32;
    c.max_seq_len = 64;
    c.aux_loss_coef = 0.05;
    nl_config_fill_derived(&c);
    return c;
}

static nl_model *new_model(nl_backend *be, const nl_config *c, uint64_t seed)
{
    nl_error err = {0};
    nl_model *m = NULL;
    CHECK_OK(nl_model_new(&m, be, c, 0, c->num_layers, 1, 1, &err), &err);
    if (m)
        CHECK_OK(nl_model_init_random(m, seed, &err), &err);
    return m;
}

static void random_batch(nl_rng *r, int n, int V, int32_t *tok, int32_t *tgt)
{
    for (int i = 0; i < n; i++) {
        tok[i] = (int32_t)nl_rng_below(r, (uint64_t)V);
        tgt[i] = (int32_t)nl_rng_below(r, (uint64_t)V);
    }
}

/* Run `steps` steps with M microbatches; return the final parameters. */
static float *train_copy(nl_backend *be, const nl_config *c, int M, int recompute, int steps,
                         double *last_loss)
{
    enum { B = 8, T = 12 };
    nl_error err = {0};
    nl_model *m = new_model(be, c, 5);
    nl_trainer *t = NULL;
    float *out = NULL;
    if (!m)
        return NULL;
    CHECK_OK(nl_trainer_new(&t, m, B / M * T, 1, recompute, &err), &err);
    nl_rng r;
    nl_rng_seed(&r, 99, 0);
    int32_t tok[B * T], tgt[B * T];
    for (int s = 0; t && s < steps; s++) {
        random_batch(&r, B * T, (int)c->vocab_size, tok, tgt);
        nl_step_result res;
        CHECK_OK(nl_trainer_step_local(t, tok, tgt, B, T, M, 1e-2f, 1.0f, nl_adamw_defaults(), &res,
                                       &err),
                 &err);
        CHECK(!res.skipped && isfinite(res.loss), "step %d loss %g", s, res.loss);
        *last_loss = res.loss;
    }
    out = check_download(be, m->params, m->n_params);
    nl_trainer_destroy(&t);
    nl_model_destroy(&m);
    return out;
}

static void test_parity(nl_backend *be)
{
    nl_config c = small_config();
    double l1 = 0, l4 = 0, lr = 0;
    size_t n = (size_t)nl_config_param_count(&c);
    float *w1 = train_copy(be, &c, 1, 0, 10, &l1);
    float *w4 = train_copy(be, &c, 4, 0, 10, &l4);
    float *wr = train_copy(be, &c, 4, 1, 10, &lr);
    if (w1 && w4 && wr) {
        double e4 = check_rel_err(w4, w1, n), er = check_rel_err(wr, w4, n);
        CHECK(e4 < 1e-5, "10 steps, microbatches 4 vs 1: weights rel err %g", e4);
        CHECK(fabs(l4 - l1) <= 1e-5 * fabs(l1), "last loss %g vs %g", l4, l1);
        CHECK(er < 1e-6, "recompute on vs off: weights rel err %g", er);
    }
    free(w1);
    free(w4);
    free(wr);
}

static void test_guard(nl_backend *be)
{
    enum { B = 2, T = 5 };
    nl_config c = small_config();
    nl_error err = {0};
    nl_model *m = new_model(be, &c, 7);
    nl_trainer *t = NULL;
    if (!m)
        return;
    CHECK_OK(nl_trainer_new(&t, m, B * T, 1, 0, &err), &err);
    float *before = check_download(be, m->params, m->n_params);
    nl_rng r;
    nl_rng_seed(&r, 3, 0);
    int32_t tok[B * T], tgt[B * T];
    random_batch(&r, B * T, (int)c.vocab_size, tok, tgt);
    nl_trainer_inject_nan(t);
    nl_step_result res;
    CHECK_OK(
        nl_trainer_step_local(t, tok, tgt, B, T, 1, 1e-2f, 1.0f, nl_adamw_defaults(), &res, &err),
        &err);
    CHECK(res.skipped, "a NaN gradient skips the step");
    float *after = check_download(be, m->params, m->n_params);
    CHECK(before && after && memcmp(before, after, m->n_params * sizeof(float)) == 0,
          "weights unchanged");
    free(after);
    CHECK(nl_trainer_adam_steps(t) == 0, "no optimizer step counted");
    CHECK_OK(
        nl_trainer_step_local(t, tok, tgt, B, T, 1, 1e-2f, 1.0f, nl_adamw_defaults(), &res, &err),
        &err);
    CHECK(!res.skipped && nl_trainer_adam_steps(t) == 1, "the next step applies");
    after = check_download(be, m->params, m->n_params);
    int finite = after != NULL;
    for (size_t i = 0; after && i < m->n_params; i++)
        finite &= isfinite(after[i]);
    CHECK(finite, "weights stay finite");
    free(after);
    tgt[3] = (int32_t)c.vocab_size;
    CHECK(nl_trainer_step_local(t, tok, tgt, B, T, 1, 1e-2f, 1.0f, nl_adamw_defaults(), &res,
                                &err) == NL_ERR_RANGE,
          "an out-of-vocabulary target is refused: %s", err.msg);
    free(before);
    nl_trainer_destroy(&t);
    nl_model_destroy(&m);
}

/* Copy task: 6 random symbols from {0..3}, separator 4, the same 6 again,
 * then 5. Learned when the loss on the copied half is near zero. */
static void test_learning(nl_backend *be)
{
    enum { B = 16, T = 13, L = 6 };
    nl_config c = small_config();
    c.vocab_size = 8;
    c.vocab_chunk = 8;
    c.num_experts = 4;
    c.aux_loss_coef = 0.01;
    nl_error err = {0};
    nl_model *m = new_model(be, &c, 11);
    nl_trainer *t = NULL;
    if (!m)
        return;
    CHECK_OK(nl_trainer_new(&t, m, B * T, 1, 0, &err), &err);
    nl_rng r;
    nl_rng_seed(&r, 17, 0);
    int32_t tok[B * T], tgt[B * T];
    double copy_loss = 99;
    const int steps = 400;
    for (int s = 0; t && s < steps; s++) {
        for (int b = 0; b < B; b++) {
            int32_t seq[T + 1];
            for (int i = 0; i < L; i++)
                seq[i] = seq[L + 1 + i] = (int32_t)nl_rng_below(&r, 4);
            seq[L] = 4;
            seq[T] = 5;
            for (int i = 0; i < T; i++) {
                tok[b * T + i] = seq[i];
                tgt[b * T + i] = seq[i + 1];
            }
        }
        nl_step_result res;
        float lr = (float)nl_lr_at(s, steps, 20, 3e-3, 3e-4);
        CHECK_OK(
            nl_trainer_step_local(t, tok, tgt, B, T, 1, lr, 1.0f, nl_adamw_defaults(), &res, &err),
            &err);
    }
    /* loss on the copied positions: targets L+1 .. 2L, predicted at L .. 2L-1 */
    if (t) {
        /* the copied half must be predicted exactly, with a low loss */
        nl_forward_args fa = {.B = B, .T = T, .tokens = tok};
        nl_runstate *rs = NULL;
        CHECK_OK(nl_runstate_new(&rs, m, B * T, &err), &err);
        CHECK_OK(nl_forward(m, rs, &fa, NULL, &err), &err);
        float *lg = check_download(be, nl_runstate_output(rs, NULL), (size_t)B * T * c.vocab_size);
        int right = 0, total = 0;
        double nll = 0;
        for (int b = 0; b < B; b++)
            for (int i = L; i < 2 * L; i++) {
                const float *row = lg + ((size_t)b * T + i) * c.vocab_size;
                int best = 0;
                double mx = row[0], z = 0;
                for (int v = 1; v < c.vocab_size; v++)
                    if (row[v] > row[best])
                        best = v;
                mx = row[best];
                for (int v = 0; v < c.vocab_size; v++)
                    z += exp(row[v] - mx);
                int want = tok[b * T + i + 1];
                nll += log(z) - (row[want] - mx);
                right += best == want;
                total++;
            }
        copy_loss = nll / total;
        CHECK(right == total, "copy task: %d of %d copied symbols predicted", right, total);
        CHECK(copy_loss < 0.05, "copy task: loss on the copied half %g", copy_loss);
        printf("copy task after %d steps: loss on copied half %.4f, %d/%d right\n", steps,
               copy_loss, right, total);
        free(lg);
        nl_runstate_destroy(&rs);
    }
    nl_trainer_destroy(&t);
    nl_model_destroy(&m);
}

/* The size of an optimizer step. At step 1, Adam's bias-corrected moments
 * are m = g and v = g^2, so every weight with a gradient well above eps
 * moves by lr (lr * g / (|g| + eps)); a weight the batch did not touch
 * (an embedding row of a token that is not in it) moves by its decay
 * alone, lr * wd * p. With the same batch again, the second step's
 * corrected moments are again about g and g^2: another step of about lr.
 * A bias correction off by one step moves 0.74 lr (beta2 0.95). */
static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void test_step_size(nl_backend *be)
{
    enum { B = 2, T = 6 };
    const float lr = 1e-5f; /* small: the second step's gradient is nearly the first's */
    nl_config c = small_config();
    nl_error err = {0};
    nl_model *m = new_model(be, &c, 21);
    nl_trainer *t = NULL;
    if (!m)
        return;
    CHECK_OK(nl_trainer_new(&t, m, B * T, 1, 0, &err), &err);
    const nl_param *emb = nl_model_find_param(m, "tok_embeddings.weight");
    CHECK(emb != NULL, "the embedding table is a parameter");
    int32_t tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++) { /* tokens 0..5 only: rows 6.. get no gradient */
        tok[i] = (int32_t)(i % 6);
        tgt[i] = (int32_t)((i + 1) % 6);
    }
    nl_adamw_opts o = nl_adamw_defaults();
    float *p0 = check_download(be, m->params, m->n_params);
    for (int step = 1; t && emb && step <= 2; step++) {
        nl_step_result res;
        CHECK_OK(nl_trainer_step_local(t, tok, tgt, B, T, 1, lr, 1e9f, o, &res, &err), &err);
        float *p1 = check_download(be, m->params, m->n_params);
        /* the moved weights outside the embedding's untouched rows:
         * |dp| less the decay's share, over lr */
        double *r = malloc(m->n_params * sizeof *r);
        size_t n = 0, untouched = 0, decay_bad = 0;
        const size_t e0 = emb->offset + 6 * (size_t)c.hidden_dim,
                     e1 = emb->offset + nl_param_numel(emb);
        for (size_t i = 0; r && i < m->n_params; i++) {
            const double d = (double)p1[i] - p0[i];
            if (i >= e0 && i < e1) { /* no gradient: decay alone */
                const double want = -(double)lr * o.weight_decay * p0[i];
                decay_bad += fabs(d - want) > 1e-2 * fabs(want) + 2 * FLT_EPSILON * fabs(p0[i]);
                untouched++;
            } else if (d != 0) {
                r[n++] = fabs(d) / lr;
            }
        }
        if (r && n) {
            qsort(r, n, sizeof *r, cmp_double);
            const double med = r[n / 2];
            /* the decay adds at most lr * wd * |p| (|p| < 1 here): 10% */
            CHECK(med > 0.98 && med < 1.1, "step %d: median move %.4f lr, expected about 1 lr",
                  step, med);
            printf("AdamW step %d: median move %.4f lr over %zu weights; %zu untouched weights "
                   "decayed by lr wd p\n",
                   step, med, n, untouched);
        }
        CHECK(untouched > 0 && decay_bad == 0,
              "step %d: %zu of %zu untouched weights did not "
              "move by lr wd p alone",
              step, decay_bad, untouched);
        /* norm weights (about 1) are not decayed: they move by lr, where a
         * decay would add or take lr * wd * p = 0.1 lr */
        size_t nn = 0;
        for (int k = 0; r && k < m->n_table; k++) {
            const nl_param *q = &m->table[k];
            for (size_t i = 0; q->kind == NL_PARAM_NORM && i < nl_param_numel(q); i++) {
                const double d = (double)p1[q->offset + i] - p0[q->offset + i];
                if (d != 0)
                    r[nn++] = fabs(d) / lr;
            }
        }
        if (r && nn) {
            qsort(r, nn, sizeof *r, cmp_double);
            CHECK(r[nn / 2] > 0.97 && r[nn / 2] < 1.03,
                  "step %d: norm weights' median move %.4f lr, expected 1 lr (no decay)", step,
                  r[nn / 2]);
        }
        CHECK(nn > 0, "step %d: no norm weight moved", step);
        free(r);
        free(p0);
        p0 = p1;
    }
    free(p0);
    nl_trainer_destroy(&t);
    nl_model_destroy(&m);
}

static void test_memory_model(nl_backend *be)
{
    nl_config c = small_config();
    nl_error err = {0};
    const int rows = 3 * 17;
    for (int recompute = 0; recompute < 2; recompute++) {
        size_t before = 0, after = 0;
        be->mem_stats(be, &before, NULL);
        nl_model *m = NULL;
        nl_trainer *t = NULL;
        CHECK_OK(nl_model_new(&m, be, &c, 0, c.num_layers, 1, 1, &err), &err);
        CHECK_OK(nl_trainer_new(&t, m, rows, 2, recompute, &err), &err);
        be->mem_stats(be, &after, NULL);
        nl_mem_opts o = {.training = 1, .micro_rows = rows, .in_flight = 2, .recompute = recompute};
        nl_mem_estimate e = nl_memory_estimate(&c, c.num_layers, 1, 1, &o);
        /* the model counts host-side routing arrays too; compare device bytes */
        double dev_pred = (double)(e.total - e.runtime);
        double got = (double)(after - before);
        CHECK(fabs(dev_pred - got) / got < 0.05,
              "memory model (recompute %d): predicted %.0f bytes, allocated %.0f", recompute,
              dev_pred, got);
        nl_trainer_destroy(&t);
        nl_model_destroy(&m);
    }
}

/* The trainer's host synchronisations do not grow with the layers: the
 * routing, the aux loss and the counts stay on the device (core/model/layer.h).
 * Counted on this backend's stats for 2 and 4 layers. */
static void test_syncs(nl_backend *be)
{
    enum { B = 2, T = 8 };
    uint64_t n[2][5];
    const char *was = getenv("NL_HOST_ROUTING"); /* device routing, whatever the caller set */
    char keep[16] = "";
    if (was)
        snprintf(keep, sizeof keep, "%s", was);
    unsetenv("NL_HOST_ROUTING");
    for (int v = 0; v < 2; v++) {
        nl_config c = small_config();
        c.num_layers = 2 + 2 * v;
        nl_error err = {0};
        nl_model *m = new_model(be, &c, 3);
        nl_trainer *t = NULL;
        if (!m)
            return;
        CHECK_OK(nl_trainer_new(&t, m, B * T, 1, 0, &err), &err);
        int32_t tok[B * T], tgt[B * T];
        nl_rng r;
        nl_rng_seed(&r, 7, 0);
        random_batch(&r, B * T, (int)c.vocab_size, tok, tgt);
        double ce = 0, aux = 0;
        uint64_t s = be->stats.host_syncs;
#define COUNTED(i, call)                                                                           \
    do {                                                                                           \
        call;                                                                                      \
        n[v][i] = be->stats.host_syncs - s;                                                        \
        s = be->stats.host_syncs;                                                                  \
    } while (0)
        if (t) {
            nl_trainer_begin_step(t, 2 * B * T);
            s = be->stats.host_syncs;
            COUNTED(0, CHECK_OK(nl_trainer_count_routes(t, B, T, tok, NULL, &err), &err));
            COUNTED(1, nl_trainer_use_counts(t, NULL));
            COUNTED(
                2, CHECK_OK(nl_trainer_forward(t, 0, B, T, tok, NULL, tgt, &ce, &aux, &err), &err));
            COUNTED(
                3, CHECK_OK(nl_trainer_forward(t, 0, B, T, tok, NULL, tgt, &ce, NULL, &err), &err));
            COUNTED(4, CHECK_OK(nl_trainer_backward(t, 0, NULL, &err), &err));
            CHECK(aux > 0 && ce > 0, "losses: ce %g aux %g", ce, aux);
        }
#undef COUNTED
        nl_trainer_destroy(&t);
        nl_model_destroy(&m);
    }
    if (was)
        setenv("NL_HOST_ROUTING", keep, 1);
    /* tokens + 2 positions; counts down + shares up; + aux down, targets
     * up, losses down; the same without aux; 2 positions */
    const uint64_t want[5] = {3, 2, 6, 5, 2};
    static const char *what[5] = {"count_routes", "use_counts", "forward", "forward (no aux)",
                                  "backward"};
    for (int i = 0; i < 5; i++)
        CHECK(n[0][i] == want[i] && n[1][i] == want[i],
              "%s: %llu host syncs with 2 layers, %llu with 4, want %llu", what[i],
              (unsigned long long)n[0][i], (unsigned long long)n[1][i],
              (unsigned long long)want[i]);
}

/* DESIGN 6's masking rule: the shares chosen and among them masked,
 * random and kept; other targets ignored; the same stream, the same mask. */
static void test_mlm_mask(void)
{
    enum { n = 200000 };
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    int32_t *tok2 = malloc(n * sizeof *tok2), *tgt2 = malloc(n * sizeof *tgt2);
    if (!tok || !tgt || !tok2 || !tgt2)
        goto out;
    for (int i = 0; i < n; i++)
        tok[i] = tok2[i] = i % 250;
    const size_t chosen = nl_mlm_mask(tok, tgt, n, 0.3, 1000, 7, 3);
    size_t masked = 0, kept = 0, other = 0, ignored = 0;
    for (int i = 0; i < n; i++) {
        if (tgt[i] < 0) {
            ignored += tgt[i] == -1 && tok[i] == i % 250;
            continue;
        }
        CHECK(tgt[i] == i % 250, "a chosen target is the original token");
        masked += tok[i] == NL_CONFIG_MASK_ID;
        kept += tok[i] == tgt[i];
        other += tok[i] != tgt[i] && tok[i] != NL_CONFIG_MASK_ID;
    }
    CHECK(fabs((double)chosen / n - 0.3) < 0.005 && chosen + ignored == n, "chosen %zu of %d",
          chosen, n);
    CHECK(fabs((double)masked / chosen - 0.8) < 0.01 && fabs((double)kept / chosen - 0.1) < 0.01 &&
              fabs((double)other / chosen - 0.1) < 0.01,
          "80/10/10: %zu %zu %zu of %zu", masked, other, kept, chosen);
    nl_mlm_mask(tok2, tgt2, n, 0.3, 1000, 7, 3);
    CHECK(memcmp(tok, tok2, n * sizeof *tok) == 0 && memcmp(tgt, tgt2, n * sizeof *tgt) == 0,
          "the same stream masks the same way");
    for (int i = 0; i < n; i++)
        tok2[i] = i % 250;
    nl_mlm_mask(tok2, tgt2, n, 0.3, 1000, 7, 4);
    CHECK(memcmp(tgt, tgt2, n * sizeof *tgt) != 0, "another batch index, another mask");
out:
    free(tok);
    free(tgt);
    free(tok2);
    free(tgt2);
}

/* The learning-rate schedule's warmup: step 0 already moves (lr / warmup,
 * not 0), the last warmup step reaches lr, then it decays to min_lr. */
static void test_lr_schedule(void)
{
    CHECK(fabs(nl_lr_at(0, 100, 10, 1.0, 0.1) - 0.1) < 1e-12, "lr at step 0: %g (0.1)",
          nl_lr_at(0, 100, 10, 1.0, 0.1));
    CHECK(fabs(nl_lr_at(9, 100, 10, 1.0, 0.1) - 1.0) < 1e-12, "lr at the last warmup step: %g (1)",
          nl_lr_at(9, 100, 10, 1.0, 0.1));
    CHECK(fabs(nl_lr_at(99, 100, 10, 1.0, 0.1) - 0.1) < 1e-9, "lr at the last step: %g (0.1)",
          nl_lr_at(99, 100, 10, 1.0, 0.1));
}

/* DiLoCo's outer step (DESIGN section 8) against the formula worked by
 * hand: three groups, two syncs, the momentum carried from the first. */
static void test_diloco_outer(void)
{
    float anchor[2] = {1.0f, -2.0f}, m[2] = {0.0f, 0.5f}, w[2];
    const float sum1[2] = {0.3f, -0.6f}; /* delta = (0.1, -0.2) */
    const float lr = NL_DILOCO_OUTER_LR, mu = NL_DILOCO_OUTER_MOMENTUM;
    nl_diloco_outer(w, anchor, m, sum1, 2, 3, lr, mu);
    /* m = (0.1, 0.9 * 0.5 - 0.2 = 0.25); w = anchor - 0.7 (delta + 0.9 m) */
    const double want1[2] = {1.0 - 0.7 * (0.1 + 0.09), -2.0 - 0.7 * (-0.2 + 0.225)};
    for (int i = 0; i < 2; i++) {
        CHECK(fabs(w[i] - want1[i]) < 1e-6, "outer step 1 [%d]: %.9g (%.9g)", i, w[i], want1[i]);
        CHECK(anchor[i] == w[i], "outer step 1 [%d]: the last sync's weights are the new ones", i);
    }
    CHECK(fabs(m[0] - 0.1) < 1e-7 && fabs(m[1] - 0.25) < 1e-7, "outer momentum: %g %g (0.1 0.25)",
          m[0], m[1]);
    float sum2[2] = {0.3f, 0.0f}; /* delta = (0.1, 0); w may alias the sum */
    nl_diloco_outer(sum2, anchor, m, sum2, 2, 3, lr, mu);
    const double m2[2] = {0.9 * 0.1 + 0.1, 0.9 * 0.25};
    const double want2[2] = {want1[0] - 0.7 * (0.1 + 0.9 * m2[0]), want1[1] - 0.7 * (0.9 * m2[1])};
    for (int i = 0; i < 2; i++)
        CHECK(fabs(sum2[i] - want2[i]) < 1e-6, "outer step 2 [%d]: %.9g (%.9g)", i, sum2[i],
              want2[i]);
}

int main(void)
{
    test_diloco_outer();
    test_mlm_mask();
    test_lr_schedule();
    nl_error err = {0};
    nl_backend *be = NULL;
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    if (!be)
        return check_done("test_train");
    test_parity(be);
    test_guard(be);
    test_step_size(be);
    test_memory_model(be);
    test_syncs(be);
    test_learning(be);
    nl_backend_destroy(&be);
    return check_done("test_train");
}
