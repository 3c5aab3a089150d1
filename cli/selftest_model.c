/* neuroctl selftest's model checks: a small model made in code, on the
 * reference and the target backend through core's API (nl_model_*,
 * nl_forward, nl_kvcache; the layers one by one where the expert choices
 * must be seen). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "cli/selftest.h"
#include "core/model/forward.h"
#include "core/model/layer.h"
#include "core/train/train.h"

/* ---------------------------------------------------------------- model */

/* A small model made here: d 128, 2 layers, 4 heads of 32 over 2 kv
 * heads, 8 experts of 256, top-2, vocabulary 512. The prefill is MB
 * sequences of MT positions; the decode prompt is one sequence of MT. */
#define MB 2
#define MT 17

typedef struct model_side {
    nl_model *m;
    nl_runstate *rs;
    nl_kvcache *kv;
    nl_layer_acts acts; /* the inference set, for the layer-by-layer prefill */
    int32_t *tok_d, *pos_d;
} model_side;

static void model_config(nl_config *cfg)
{
    nl_config_init(cfg);
    cfg->hidden_dim = 128;
    cfg->num_layers = 2;
    cfg->num_heads = 4;
    cfg->num_kv_heads = 2;
    cfg->ffn_dim = 256;
    cfg->num_experts = 8;
    cfg->top_k = 2;
    cfg->vocab_size = 512;
    cfg->vocab_chunk = 512;
    cfg->max_seq_len = 128;
    nl_config_fill_derived(cfg);
}

static nl_status side_new(model_side *ms, nl_backend *be, const nl_config *cfg, uint64_t seed,
                          nl_error *err)
{
    const int N = MB * MT;
    nl_status st;
    memset(ms, 0, sizeof *ms);
    if ((st = nl_config_validate(cfg, 1, err)) != NL_OK ||
        (st = nl_model_new(&ms->m, be, cfg, 0, cfg->num_layers, 1, 1, err)) != NL_OK ||
        (st = nl_model_init_random(ms->m, seed, err)) != NL_OK ||
        (st = nl_runstate_new(&ms->rs, ms->m, N, err)) != NL_OK ||
        (st = nl_kvcache_new(&ms->kv, ms->m, 1, MT + NL_SELFTEST_DECODE, NL_KV_FP32, err)) !=
            NL_OK ||
        (st = nl_layer_acts_alloc(&ms->acts, be, cfg, N, 0, err)) != NL_OK)
        return st;
    ms->tok_d = be->alloc(be, (size_t)N * sizeof(int32_t));
    ms->pos_d = be->alloc(be, (size_t)N * sizeof(int32_t));
    if (!ms->tok_d || !ms->pos_d)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory for the model's inputs",
                            be->name);
    return NL_OK;
}

static void side_free(model_side *ms, nl_backend *be)
{
    nl_layer_acts_free(&ms->acts, be);
    be->free(be, ms->tok_d);
    be->free(be, ms->pos_d);
    nl_kvcache_destroy(&ms->kv);
    nl_runstate_destroy(&ms->rs);
    nl_model_destroy(&ms->m);
}

/* The prefill layer by layer, as nl_forward runs it, keeping each layer's
 * router probabilities (L, N, E) and expert choices (L, N, k) on the host:
 * nl_forward itself does not show them. */
static void prefill_layers(model_side *ms, const int32_t *tok, const int32_t *pos, float *probs,
                           int32_t *choice)
{
    nl_model *m = ms->m;
    nl_backend *be = m->be;
    const nl_config *cfg = &m->cfg;
    const int N = MB * MT, E = cfg->num_experts, k = cfg->top_k;
    be->upload(be, ms->tok_d, tok, (size_t)N * sizeof(int32_t));
    be->upload(be, ms->pos_d, pos, (size_t)N * sizeof(int32_t));
    be->embedding_forward(be, ms->acts.x_in, ms->tok_d, m->tok_embeddings, N, cfg->hidden_dim);
    for (int l = 0; l < cfg->num_layers; l++) {
        nl_layer_forward(m, l, &ms->acts, MB, MT, 0, NULL, ms->pos_d, NULL);
        be->download(be, probs + (size_t)l * N * E, ms->acts.probs, (size_t)N * E * sizeof(float));
        be->download(be, choice + (size_t)l * N * k, ms->acts.choice_d,
                     (size_t)N * k * sizeof(int32_t));
    }
}

/* Gap between the k-th and (k+1)-th largest of row[0..E). */
static double topk_gap(const float *row, int E, int k)
{
    float v[NL_CONFIG_MAX_EXPERTS];
    memcpy(v, row, (size_t)E * sizeof *v);
    for (int i = 0; i <= k && i < E; i++)
        for (int j = i + 1; j < E; j++)
            if (v[j] > v[i]) {
                float t = v[i];
                v[i] = v[j];
                v[j] = t;
            }
    return k < E ? (double)v[k - 1] - (double)v[k] : INFINITY;
}

/* Expert choices first: the same set of experts for every (layer, token),
 * except where the reference's k-th and (k+1)-th probabilities are a
 * near-tie (reported, not failed); then the router probabilities. */
static void check_routing(nl_selftest *c, model_side ms[2], const int32_t *tok, const int32_t *pos,
                          double tie)
{
    const nl_config *cfg = &ms[0].m->cfg;
    const int N = MB * MT, L = cfg->num_layers, E = cfg->num_experts, k = cfg->top_k;
    float *probs[2];
    int32_t *ch[2];
    for (int s = 0; s < 2; s++) {
        probs[s] = nl_selftest_hbuf(c, (size_t)L * N * E * sizeof(float));
        ch[s] = nl_selftest_hbuf(c, (size_t)L * N * k * sizeof(int32_t));
    }
    char shape[80];
    snprintf(shape, sizeof shape, "L=%d N=%d E=%d k=%d", L, N, E, k);
    if (c->oom) {
        nl_selftest_done(c, "model_routing", shape, INFINITY, 0);
        return;
    }
    for (int s = 0; s < 2; s++)
        prefill_layers(&ms[s], tok, pos, probs[s], ch[s]);
    int differ = 0, ties = 0;
    for (int l = 0; l < L; l++)
        for (int n = 0; n < N; n++) {
            const size_t o = ((size_t)l * N + n) * k;
            int same = 1;
            for (int i = 0; i < k; i++) {
                int found = 0;
                for (int j = 0; j < k; j++)
                    found |= ch[1][o + i] == ch[0][o + j];
                same &= found;
            }
            const double gap = topk_gap(probs[0] + ((size_t)l * N + n) * E, E, k);
            if (gap < tie) {
                ties++;
                printf("note  model_routing  layer %d token %d: top-%d probabilities %.3g apart "
                       "(near-tie)%s\n",
                       l, n, k, gap, same ? "" : ", the backends chose differently");
            } else if (!same && ++differ <= 8) { /* the first few name where */
                printf("note  model_routing  layer %d token %d: experts differ (gap %.3g)\n", l, n,
                       gap);
            }
        }
    char tshape[112];
    snprintf(tshape, sizeof tshape, "%s near-ties=%d", shape, ties);
    nl_selftest_line(c, differ == 0, "model_routing", tshape, differ, 0, NULL);
    nl_selftest_done(c, "model_router_probs", shape,
                     nl_selftest_err_all(probs[0], probs[1], (size_t)L * N * E),
                     c->tol->router_probs);
}

/* nl_forward of the whole prefill on both: logits and the aux loss. */
static void check_logits(nl_selftest *c, model_side ms[2], const int32_t *tok, double tol)
{
    const int N = MB * MT, V = (int)ms[0].m->cfg.vocab_size;
    float aux[2], *lg[2];
    nl_error e = {0};
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d T=%d V=%d", MB, MT, V);
    for (int s = 0; s < 2; s++) {
        nl_forward_args a = {.B = MB, .T = MT, .tokens = tok};
        nl_backend *be = c->be[s];
        if (nl_forward(ms[s].m, ms[s].rs, &a, &aux[s], &e) != NL_OK ||
            !(lg[s] = nl_selftest_hbuf(c, (size_t)N * V * sizeof(float)))) {
            nl_selftest_line(c, 0, "model_logits", shape, INFINITY, tol, e.msg);
            nl_selftest_release(c);
            return;
        }
        be->download(be, lg[s], nl_runstate_output(ms[s].rs, NULL), (size_t)N * V * sizeof(float));
    }
    nl_selftest_line(c, nl_selftest_err_all(lg[0], lg[1], (size_t)N * V) <= tol, "model_logits",
                     shape, nl_selftest_err_all(lg[0], lg[1], (size_t)N * V), tol, NULL);
    nl_selftest_done(c, "model_aux_loss", shape,
                     fabs((double)aux[1] - aux[0]) / fabs((double)aux[0]), c->tol->router_probs);
}

static int argmax(const float *x, int n, double *gap)
{
    int best = 0, second = -1;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) {
            second = best;
            best = i;
        } else if (second < 0 || x[i] > x[second]) {
            second = i;
        }
    *gap = second < 0 ? INFINITY : (double)x[best] - (double)x[second];
    return best;
}

/* Prefill a prompt with the cache, then NL_SELFTEST_DECODE greedy steps; both sides
 * are fed the reference's choice so the logits stay comparable. Lines
 * `logits_check` and `ids_check`. */
static void check_decode(nl_selftest *c, model_side ms[2], const int32_t *prompt, double tol,
                         double tie, const char *logits_check, const char *ids_check)
{
    const int V = (int)ms[0].m->cfg.vocab_size;
    float *lg[2] = {nl_selftest_hbuf(c, (size_t)V * sizeof(float)),
                    nl_selftest_hbuf(c, (size_t)V * sizeof(float))};
    nl_error e = {0};
    char shape[64];
    snprintf(shape, sizeof shape, "prompt=%d steps=%d V=%d", MT, NL_SELFTEST_DECODE, V);
    int32_t next = 0;
    int differ = 0;
    double worst = c->oom ? INFINITY : 0.0;
    for (int step = 0; !c->oom && step <= NL_SELFTEST_DECODE; step++) {
        int id[2];
        double gap = 0.0;
        for (int s = 0; s < 2; s++) {
            nl_forward_args a = {.B = 1,
                                 .T = step ? 1 : MT,
                                 .tokens = step ? &next : prompt,
                                 .kv = ms[s].kv,
                                 .last_only = 1};
            nl_backend *be = c->be[s];
            if (nl_forward(ms[s].m, ms[s].rs, &a, NULL, &e) != NL_OK) {
                nl_selftest_line(c, 0, logits_check, shape, INFINITY, tol, e.msg);
                nl_selftest_release(c);
                return;
            }
            be->download(be, lg[s], nl_runstate_output(ms[s].rs, NULL), (size_t)V * sizeof(float));
            double g;
            id[s] = argmax(lg[s], V, &g);
            if (s == 0)
                gap = g;
        }
        worst = max2(worst, nl_selftest_err_all(lg[0], lg[1], (size_t)V));
        const double scale = fabs(lg[0][id[0]]) > 1e-30 ? fabs(lg[0][id[0]]) : 1.0;
        if (gap < tie * scale)
            printf("note  %s  step %d: top-2 logits %.3g apart (near-tie)%s\n", ids_check, step,
                   gap, id[0] == id[1] ? "" : ", the backends chose differently");
        else if (id[0] != id[1] && ++differ <= 8)
            printf("note  %s  step %d: %d against %d\n", ids_check, step, id[1], id[0]);
        next = id[0];
    }
    nl_selftest_line(c, worst <= tol, logits_check, shape, worst, tol, NULL);
    nl_selftest_done(c, ids_check, shape, differ, c->tol->greedy_differ);
}

/* The decode again with both sides' caches in bf16 (--kv-cache bf16): the
 * target's kv_store_bf16 and attention over bf16 bits against the
 * reference's. Tolerance: the precision's decode bound, at least 1e-2: a
 * key or value whose FP32 value differs between the sides in its last
 * bits (sums in another order) may round to the neighbouring bf16, one
 * unit of 2^-8 relative, and a few such flips move the logits by far more
 * than FP32's 1e-5. */
static void check_decode_kv_bf16(nl_selftest *c, model_side ms[2], const int32_t *prompt,
                                 double tie)
{
    nl_error e = {0};
    for (int s = 0; s < 2; s++) {
        nl_kvcache_destroy(&ms[s].kv);
        if (nl_kvcache_new(&ms[s].kv, ms[s].m, 1, MT + NL_SELFTEST_DECODE, NL_KV_BF16, &e) !=
            NL_OK) {
            nl_selftest_line(c, 0, "model_kv_bf16_logits", "bf16 KV cache", INFINITY, 0, e.msg);
            return;
        }
    }
    const double tol = nl_selftest_bf16_tol(c, "model_decode_logits", c->tol->decode_logits);
    check_decode(c, ms, prompt, tol > 1e-2 ? tol : 1e-2, tie, "model_kv_bf16_logits",
                 "model_kv_bf16_ids");
}

/* ---------------------------------------------------------------- training */

/* Scaled error of n floats at d on the two backends (downloaded). */
static double cmp_dev(nl_selftest *c, float *const d[2], size_t n)
{
    float *h[2];
    for (int s = 0; s < 2; s++) {
        h[s] = nl_selftest_hbuf(c, n * sizeof(float));
        if (h[s] && !c->oom)
            c->be[s]->download(c->be[s], h[s], d[s], n * sizeof(float));
    }
    return c->oom ? INFINITY : nl_selftest_err_all(h[0], h[1], n);
}

/* One layer forward and backward (core/model/layer.h) on the same weights,
 * input, positions and output gradient: x_out, then dx and the parameter
 * gradients. Where the two backends route a token to different experts the
 * outputs cannot agree; the count is reported. */
static void check_layer(nl_selftest *c, model_side ms[2], uint64_t seed)
{
    const nl_config *cfg = &ms[0].m->cfg;
    const int N = MB * MT, d = cfg->hidden_dim, k = cfg->top_k;
    const size_t nd = (size_t)N * d, np = ms[0].m->n_params;
    const double tol_x = nl_selftest_bf16_tol(c, "layer_forward", c->tol->layer_x),
                 tol_g = nl_selftest_bf16_tol(c, "layer_backward_dx", c->tol->layer_grad);
    char shape[80];
    snprintf(shape, sizeof shape, "B=%d T=%d d=%d E=%d k=%d", MB, MT, d, cfg->num_experts, k);
    nl_layer_acts a[2] = {{0}};
    nl_layer_grads_scratch sc[2] = {{0}};
    float *grads[2] = {0}, *dy[2] = {0}, *dx[2] = {0};
    nl_error e = {0};
    nl_rng rng;
    nl_rng_seed(&rng, seed, 7);
    float *x = nl_selftest_hbuf(c, nd * sizeof(float)),
          *g = nl_selftest_hbuf(c, nd * sizeof(float));
    int32_t *pos = nl_selftest_hbuf(c, (size_t)N * sizeof(int32_t)),
            *neg = nl_selftest_hbuf(c, (size_t)N * sizeof(int32_t));
    for (size_t i = 0; x && g && i < nd; i++) {
        x[i] = (float)(2.0 * nl_rng_uniform(&rng) - 1.0);
        g[i] = (float)((2.0 * nl_rng_uniform(&rng) - 1.0) / (double)N);
    }
    for (int n = 0; pos && neg && n < N; n++) {
        pos[n] = n % MT;
        neg[n] = -(n % MT);
    }
    int ok = !c->oom;
    for (int s = 0; s < 2 && ok; s++) {
        nl_backend *be = c->be[s];
        ok = nl_layer_acts_alloc(&a[s], be, cfg, N, 1, &e) == NL_OK &&
             nl_layer_scratch_alloc(&sc[s], be, cfg, N, &e) == NL_OK &&
             (grads[s] = be->alloc(be, np * sizeof(float))) && (dy[s] = be->alloc(be, nd * 4)) &&
             (dx[s] = be->alloc(be, nd * 4));
        if (!ok)
            break;
        be->upload(be, a[s].x_in, x, nd * sizeof(float));
        be->upload(be, dy[s], g, nd * sizeof(float));
        be->upload(be, ms[s].pos_d, pos, (size_t)N * sizeof(int32_t));
        be->upload(be, sc[s].neg_pos_d, neg, (size_t)N * sizeof(int32_t));
    }
    double ex = INFINITY, edx = INFINITY, egr = INFINITY;
    int differ = 0;
    if (ok) {
        for (int s = 0; s < 2; s++) {
            nl_layer_forward(ms[s].m, 0, &a[s], MB, MT, 0, NULL, ms[s].pos_d, NULL);
            c->be[s]->download(c->be[s], a[s].choice, a[s].choice_d,
                               (size_t)N * k * sizeof(int32_t));
        }
        for (int i = 0; i < N * k; i++)
            differ += a[0].choice[i] != a[1].choice[i];
        ex = cmp_dev(c, (float *const[2]){a[0].x_out, a[1].x_out}, nd);
        for (int s = 0; s < 2; s++)
            nl_layer_backward(ms[s].m, 0, &a[s], &sc[s], grads[s], dy[s], dx[s], MB, MT,
                              (float)(cfg->aux_loss_coef * cfg->num_experts / (double)N), 0);
        edx = cmp_dev(c, dx, nd);
        egr = cmp_dev(c, grads, np);
    }
    char why[96];
    snprintf(why, sizeof why, "(%d expert choices differ)", differ);
    const char *note = differ ? why : NULL;
    nl_selftest_line(c, ok && !c->oom && ex <= tol_x, "layer_forward", shape, ex, tol_x,
                     ok ? note : e.msg);
    nl_selftest_line(c, ok && !c->oom && edx <= tol_g, "layer_backward_dx", shape, edx, tol_g,
                     NULL);
    for (int s = 0; s < 2; s++) {
        nl_backend *be = c->be[s];
        if (a[s].x_in)
            nl_layer_acts_free(&a[s], be);
        if (sc[s].dh1)
            nl_layer_scratch_free(&sc[s], be);
        be->free(be, grads[s]);
        be->free(be, dy[s]);
        be->free(be, dx[s]);
    }
    nl_selftest_done(c, "layer_backward_grads", shape, egr, tol_g);
}

/* The weights after training, judged by what the loss sees of them.
 * AdamW's first steps move a weight by about lr sign(g) whatever |g| is
 * (m / sqrt(v) is g / |g| at step 1): where g is rounding noise (a sum
 * that cancels, a gradient many orders below the tensor's largest) the
 * two backends' signs are a coin toss, and that weight differs by up to
 * 2 lr a step. Judged as max |diff| / max |w| this failed the first H100
 * run (2.84e-4 against 1e-4, FP32; 0.0129 against 0.01, TF32) though
 * every gradient, every loss and AdamW itself agreed. Such weights do not
 * matter: the loss changes by g dw, about 0 for them. So the error is the
 * weights' difference weighted by the reference's gradients, as a
 * fraction of the update weighted the same way:
 *   err = sum_e G_e |w_t,e - w_r,e| / sum_e G_e |w_r,e - w0_e|,
 *   G_e = sum over the steps of |g_e| (the reference's gradients),
 * a bound on the first-order loss change of the difference relative to
 * that of the update. A learning rate 1% off gives err 0.01; a wrong
 * gradient of a tensor gives its share of the weighted update; a coin-toss
 * sign on a noise-level gradient adds 2 steps times its tiny G_e. The
 * note line gives the plain max |diff| in units of lr, and how many
 * weights differ by more than half a step, with the largest G_e among
 * them relative to the largest G_e (tiny when they are the noise). */
typedef struct train_weights_err {
    double err;       /* the weighted error above */
    double max_steps; /* max |w_t - w_r| / lr */
    size_t far;       /* weights more than lr / 2 apart */
    double far_g;     /* the largest G_e among those, over the largest G_e */
} train_weights_err;

static train_weights_err weights_err(const float *w0, const float *wr, const float *wt,
                                     const float *G, size_t n, double lr)
{
    train_weights_err r = {0};
    double num = 0.0, den = 0.0, gmax = 0.0, gfar = 0.0;
    for (size_t e = 0; e < n; e++) {
        const double d = fabs((double)wt[e] - (double)wr[e]);
        if (!isfinite(d)) {
            r.err = INFINITY;
            return r;
        }
        num += (double)G[e] * d;
        den += (double)G[e] * fabs((double)wr[e] - (double)w0[e]);
        gmax = fmax(gmax, G[e]);
        r.max_steps = fmax(r.max_steps, d / lr);
        if (d > 0.5 * lr) {
            r.far++;
            gfar = fmax(gfar, G[e]);
        }
    }
    r.err = den > 0.0 ? num / den : (num > 0.0 ? INFINITY : 0.0);
    r.far_g = gmax > 0.0 ? gfar / gmax : 0.0;
    return r;
}

/* Download n floats of the device buffer d on side s into h (NULL: none). */
static void fetch(nl_selftest *c, int s, float *h, const float *d, size_t n)
{
    if (h && !c->oom)
        c->be[s]->download(c->be[s], h, d, n * sizeof(float));
}

/* Three local training steps (core/train/train.h, two microbatches each, so the
 * counting pass runs too) from the same weights on the same batches: the
 * loss of each step within tol->train_loss relative, the weights after the
 * last by weights_err within tol->train_weights. c->lr_scale (a test
 * hook) perturbs the target's learning rate so the check can be seen to
 * fail. */
static void check_train_steps(nl_selftest *c, model_side ms[2], uint64_t seed)
{
    enum { STEPS = 3, B = 4, T = 16, M = 2 };
    const float lr = 3e-3f;
    const nl_config *cfg = &ms[0].m->cfg;
    const size_t np = ms[0].m->n_params;
    const double tol_l = nl_selftest_bf16_tol(c, "train_loss", c->tol->train_loss),
                 tol_w = c->tol->train_weights; /* train_weights: nl_selftest_done's */
    char shape[80];
    snprintf(shape, sizeof shape, "steps=%d B=%d T=%d M=%d L=%d", STEPS, B, T, M, cfg->num_layers);
    nl_trainer *tr[2] = {0};
    nl_error e = {0};
    nl_status st = NL_OK;
    double eloss = 0.0;
    train_weights_err ew = {.err = INFINITY};
    float *w0 = nl_selftest_hbuf(c, np * sizeof(float)),
          *g = nl_selftest_hbuf(c, np * sizeof(float));
    float *G = nl_selftest_hbuf(c, np * sizeof(float)); /* zeroed */
    if (c->oom)
        st = nl_error_set(&e, NL_ERR_NOMEM, "out of memory");
    for (int s = 0; s < 2 && st == NL_OK; s++) /* fresh weights: earlier checks left none changed */
        if ((st = nl_model_init_random(ms[s].m, seed + 1, &e)) == NL_OK)
            st = nl_trainer_new(&tr[s], ms[s].m, B / M * T, 1, 0, &e);
    if (st == NL_OK)
        fetch(c, 0, w0, ms[0].m->params, np);
    for (int step = 0; step < STEPS && st == NL_OK; step++) {
        int32_t *tok = nl_selftest_ids(c, (size_t)B * T + 1, (int)cfg->vocab_size);
        if (!tok) {
            st = nl_error_set(&e, NL_ERR_NOMEM, "out of memory");
            break;
        }
        double loss[2] = {0};
        for (int s = 0; s < 2 && st == NL_OK; s++) {
            nl_step_result r;
            st = nl_trainer_step_local(tr[s], tok, tok + 1, B, T, M, lr * (s ? c->lr_scale : 1.0f),
                                       1.0f, nl_adamw_defaults(), &r, &e);
            if (st == NL_OK && (st = c->be[s]->sync(c->be[s], &e)) == NL_OK)
                loss[s] = r.skipped ? NAN : r.loss;
        }
        if (st == NL_OK) { /* G += |the reference's gradients| */
            fetch(c, 0, g, nl_trainer_grads(tr[0]), np);
            for (size_t i = 0; !c->oom && i < np; i++)
                G[i] += fabsf(g[i]);
        }
        const double rel = fabs(loss[1] - loss[0]) / fabs(loss[0]);
        eloss = max2(eloss, isfinite(loss[0]) && isfinite(loss[1]) ? rel : INFINITY);
        if (st == NL_OK)
            printf("note  train_loss  step %d: %.9g against %.9g\n", step + 1, loss[1], loss[0]);
    }
    float *wr = nl_selftest_hbuf(c, np * sizeof(float)),
          *wt = nl_selftest_hbuf(c, np * sizeof(float));
    if (st == NL_OK && !c->oom) {
        fetch(c, 0, wr, ms[0].m->params, np);
        fetch(c, 1, wt, ms[1].m->params, np);
        ew = weights_err(w0, wr, wt, G, np, lr);
        printf("note  train_weights  max |diff| %.3g lr; %zu of %zu weights more than lr/2 apart, "
               "their gradients at most %.3g of the largest\n",
               ew.max_steps, ew.far, np, ew.far_g);
    }
    for (int s = 0; s < 2; s++)
        nl_trainer_destroy(&tr[s]);
    nl_selftest_line(c, st == NL_OK && eloss <= tol_l, "train_loss", shape,
                     st == NL_OK ? eloss : INFINITY, tol_l, st == NL_OK ? NULL : e.msg);
    nl_selftest_done(c, "train_weights", shape, c->oom ? INFINITY : ew.err, tol_w);
}

void nl_selftest_model(nl_selftest *c, uint64_t seed)
{
    nl_config cfg;
    model_config(&cfg);
    model_side ms[2];
    nl_error e = {0};
    const double tol = nl_selftest_bf16_tol(c, "model_logits", c->tol->logits),
                 tie = nl_selftest_bf16_tol(c, "near_tie", c->tol->near_tie);
    int ok = 1;
    /* a stream of its own: the model's inputs do not depend on how many
     * draws the checks before it made (a near-tie in the routing is a
     * matter of the tokens drawn, and one check more moved them onto one) */
    nl_rng_seed(&c->rng, seed, 1);
    for (int s = 0; s < 2 && ok; s++)
        ok = side_new(&ms[s], c->be[s], &cfg, seed, &e) == NL_OK;
    if (!ok) {
        nl_selftest_line(c, 0, "model_setup", "d=128 L=2 H=4 G=2 E=8 k=2 V=512", INFINITY, 0,
                         e.msg);
    } else {
        const int N = MB * MT;
        int32_t *tok = nl_selftest_ids(c, (size_t)N, (int)cfg.vocab_size),
                *pos = nl_selftest_hbuf(c, N * sizeof *pos);
        for (int n = 0; pos && n < N; n++)
            pos[n] = n % MT;
        if (tok && pos)
            check_routing(c, ms, tok, pos, tie);
        tok = nl_selftest_ids(c, (size_t)N, (int)cfg.vocab_size);
        if (tok)
            check_logits(c, ms, tok, tol);
        tok = nl_selftest_ids(c, MT, (int)cfg.vocab_size);
        int32_t prompt[MT]; /* kept: the checks' host buffers are given back */
        if (tok) {
            memcpy(prompt, tok, sizeof prompt);
            check_decode(c, ms, prompt,
                         nl_selftest_bf16_tol(c, "model_decode_logits", c->tol->decode_logits), tie,
                         "model_decode_logits", "model_greedy_ids");
            check_decode_kv_bf16(c, ms, prompt, tie);
        }
        nl_selftest_release(c);
        if (c->be[1]->can_train) {
            check_layer(c, ms, seed);
            check_train_steps(c, ms, seed);
        }
    }
    nl_selftest_release(c);
    for (int s = 0; s < 2; s++)
        side_free(&ms[s], c->be[s]);
}
