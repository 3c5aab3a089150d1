/* The model and its forward pass: init determinism across stage slices,
 * KV-cache decoding against the full forward, a split pipeline against
 * the whole model, input validation, and the host synchronisations of a
 * decode step (device routing against NL_HOST_ROUTING=1). Numerics
 * against PyTorch are in test_golden. */
#include "core/model/forward.h"
#include "core/model/layer.h"
#include "core/model/model.h"
#include "core/model/sampler.h"
#include "tests/check.h"

#include <stdlib.h>

static nl_config test_config(void)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 64;
    c.num_layers = 3;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.ffn_dim = 96;
    c.vocab_size = 300;
    c.vocab_chunk = 128;
    c.max_seq_len = 64;
    nl_config_fill_derived(&c);
    return c;
}

/* init, then widen the matrices so attention and routing are decisive */
static nl_model *make_model(nl_backend *be, const nl_config *c, int l0, int l1, int embed, int head)
{
    nl_error err = {0};
    nl_model *m = NULL;
    CHECK_OK(nl_model_new(&m, be, c, l0, l1, embed, head, &err), &err);
    if (!m)
        return NULL;
    CHECK_OK(nl_model_init_random(m, 1234, &err), &err);
    for (int i = 0; i < m->n_table; i++) {
        const nl_param *p = &m->table[i];
        const size_t n = nl_param_numel(p);
        float *x = check_download(be, nl_model_param_data(m, p), n);
        if (!x)
            continue;
        for (size_t j = 0; j < n; j++)
            x[j] *= p->kind == NL_PARAM_NORM ? 1.0f : 8.0f;
        be->upload(be, nl_model_param_data(m, p), x, n * sizeof *x);
        free(x);
    }
    return m;
}

static void test_init_slices(nl_backend *be, const nl_config *c)
{
    nl_model *whole = make_model(be, c, 0, c->num_layers, 1, 1);
    nl_model *mid = make_model(be, c, 1, 2, 0, 0);
    nl_model *last = make_model(be, c, 2, 3, 0, 1);
    if (!whole || !mid || !last)
        goto out;
    CHECK(mid->n_table == 7 + 3 * c->num_experts, "middle stage holds one layer: %d tensors",
          mid->n_table);
    CHECK(whole->n_table == 2 + 3 * (7 + 3 * c->num_experts) + 1, "whole model: %d tensors",
          whole->n_table);
    nl_model *parts[] = {mid, last};
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < parts[s]->n_table; i++) {
            const nl_param *p = &parts[s]->table[i];
            const nl_param *q = nl_model_find_param(whole, p->name);
            CHECK(q && nl_param_numel(p) == nl_param_numel(q), "%s in whole model", p->name);
            if (!q)
                continue;
            const size_t n = nl_param_numel(p);
            float *got = check_download(be, nl_model_param_data(parts[s], p), n);
            float *want = check_download(be, nl_model_param_data(whole, q), n);
            CHECK(got && want && memcmp(got, want, n * 4) == 0,
                  "%s: stage init equals whole-model init", p->name);
            free(got);
            free(want);
        }
    const nl_param *emb = nl_model_find_param(whole, "tok_embeddings.weight");
    CHECK(emb && emb->shape[0] == 384 && emb->shape[1] == 64, "capacity rows 384");
    CHECK(nl_model_find_param(whole, "layers.2.moe.experts.7.w_down.weight") != NULL, "names");
out:
    nl_model_destroy(&whole);
    nl_model_destroy(&mid);
    nl_model_destroy(&last);
}

static void test_kv_decode(nl_backend *be, const nl_config *c)
{
    enum { B = 2, T = 13, P = 5 };
    nl_error err = {0};
    nl_model *m = make_model(be, c, 0, c->num_layers, 1, 1);
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    int32_t tokens[B * T];
    for (int i = 0; i < B * T; i++)
        tokens[i] = (i * 37 + 11) % (int)c->vocab_size;
    const int V = (int)c->vocab_size;
    float *full = NULL, *out = NULL;
    if (!m)
        goto out;
    CHECK_OK(nl_runstate_new(&rs, m, B * T, &err), &err);
    nl_forward_args a = {.B = B, .T = T, .tokens = tokens};
    float aux = 0;
    CHECK_OK(nl_forward(m, rs, &a, &aux, &err), &err);
    full = check_download(be, nl_runstate_output(rs, NULL), (size_t)B * T * V);
    CHECK(aux > 0.5f * c->num_layers, "aux loss %g is near num_layers (E * sum frac p)", aux);

    /* prefill P positions, then one at a time */
    CHECK_OK(nl_kvcache_new(&kv, m, B, T, NL_KV_FP32, &err), &err);
    int32_t step[B * P];
    for (int b = 0; b < B; b++)
        memcpy(step + b * P, tokens + b * T, P * sizeof(int32_t));
    nl_forward_args pre = {.B = B, .T = P, .tokens = step, .kv = kv};
    CHECK_OK(nl_forward(m, rs, &pre, NULL, &err), &err);
    out = check_download(be, nl_runstate_output(rs, NULL), (size_t)B * P * V);
    for (int b = 0; b < B; b++) {
        double e = check_rel_err(out + (size_t)b * P * V, full + (size_t)b * T * V, (size_t)P * V);
        CHECK(e < 1e-5, "prefill logits of sequence %d: rel err %g", b, e);
    }
    for (int t = P; t < T; t++) {
        int32_t one[B] = {tokens[t], tokens[T + t]};
        nl_forward_args dec = {.B = B, .T = 1, .tokens = one, .kv = kv};
        CHECK_OK(nl_forward(m, rs, &dec, NULL, &err), &err);
        free(out);
        out = check_download(be, nl_runstate_output(rs, NULL), (size_t)B * V);
        for (int b = 0; b < B; b++) {
            double e = check_rel_err(out + (size_t)b * V, full + ((size_t)b * T + t) * V, V);
            CHECK(e < 1e-5, "decode step %d sequence %d: rel err %g", t, b, e);
        }
    }
    CHECK(kv->len == T, "cache holds %d positions", kv->len);
    int32_t more[B] = {1, 2};
    nl_forward_args over = {.B = B, .T = 1, .tokens = more, .kv = kv};
    CHECK(nl_forward(m, rs, &over, NULL, &err) == NL_ERR_RANGE, "full cache refused");
out:
    free(full);
    free(out);
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
    nl_model_destroy(&m);
}

static void test_split(nl_backend *be, const nl_config *c)
{
    enum { B = 3, T = 9 };
    nl_error err = {0};
    nl_model *whole = make_model(be, c, 0, 3, 1, 1);
    nl_model *s0 = make_model(be, c, 0, 1, 1, 0);
    nl_model *s1 = make_model(be, c, 1, 3, 0, 1);
    nl_runstate *r = NULL, *r0 = NULL, *r1 = NULL;
    int32_t tokens[B * T];
    for (int i = 0; i < B * T; i++)
        tokens[i] = (i * 91 + 3) % (int)c->vocab_size;
    if (!whole || !s0 || !s1)
        goto out;
    CHECK_OK(nl_runstate_new(&r, whole, B * T, &err), &err);
    CHECK_OK(nl_runstate_new(&r0, s0, B * T, &err), &err);
    CHECK_OK(nl_runstate_new(&r1, s1, B * T, &err), &err);
    float aux = 0, aux0 = 0, aux1 = 0;
    nl_forward_args a = {.B = B, .T = T, .tokens = tokens};
    CHECK_OK(nl_forward(whole, r, &a, &aux, &err), &err);
    CHECK_OK(nl_forward(s0, r0, &a, &aux0, &err), &err);
    int cols = 0;
    nl_forward_args b = {.B = B, .T = T, .x_in = nl_runstate_output(r0, &cols)};
    CHECK(cols == c->hidden_dim, "first stage emits hidden states (%d cols)", cols);
    CHECK_OK(nl_forward(s1, r1, &b, &aux1, &err), &err);
    size_t n = (size_t)B * T * c->vocab_size;
    float *got1 = check_download(be, nl_runstate_output(r1, NULL), n);
    float *keep = check_download(be, nl_runstate_output(r, NULL), n);
    double d = check_max_abs_diff(got1, keep, n);
    free(got1);
    CHECK(d < 1e-6, "[0,1) then [1,3) equals [0,3): max diff %g", d);
    CHECK(fabsf(aux0 + aux1 - aux) < 1e-6f, "aux loss splits: %g + %g vs %g", aux0, aux1, aux);

    /* last_only gives the last row of each sequence */
    nl_forward_args lo = {.B = B, .T = T, .tokens = tokens, .last_only = 1};
    CHECK_OK(nl_forward(whole, r, &lo, NULL, &err), &err);
    float *last = check_download(be, nl_runstate_output(r, NULL), (size_t)B * c->vocab_size);
    for (int s = 0; s < B; s++) {
        const float *got = last + (size_t)s * c->vocab_size;
        const float *want = keep + ((size_t)s * T + T - 1) * c->vocab_size;
        CHECK(check_max_abs_diff(got, want, (size_t)c->vocab_size) < 1e-5, "last_only row %d", s);
    }
    free(keep);
    free(last);

    /* bad input */
    int32_t bad[B * T];
    memcpy(bad, tokens, sizeof bad);
    bad[5] = (int32_t)c->vocab_size;
    nl_forward_args ba = {.B = B, .T = T, .tokens = bad};
    CHECK(nl_forward(whole, r, &ba, NULL, &err) == NL_ERR_RANGE && strstr(err.msg, "token 300"),
          "out-of-vocabulary token refused: %s", err.msg);
    nl_forward_args big = {.B = B, .T = T + 1, .tokens = tokens};
    CHECK(nl_forward(whole, r, &big, NULL, &err) == NL_ERR_SHAPE, "too many rows refused");
out:
    nl_runstate_destroy(&r);
    nl_runstate_destroy(&r0);
    nl_runstate_destroy(&r1);
    nl_model_destroy(&whole);
    nl_model_destroy(&s0);
    nl_model_destroy(&s1);
}

/* A decode step on cpu-devsim (device memory the host cannot read): with
 * routing on the device its layers make no host synchronisation at all,
 * and nl_forward only its two input uploads (tokens, positions) plus the
 * aux loss's one download when asked; NL_HOST_ROUTING=1 costs a download
 * and five uploads per layer and gives the same bits. */
static void test_decode_syncs(const nl_config *c)
{
    enum { B = 2, P = 4 };
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_runstate *rs[2] = {NULL, NULL};
    nl_kvcache *kv[2] = {NULL, NULL};
    nl_layer_acts la[2];
    memset(la, 0, sizeof la);
    float *x = NULL, *xd = NULL, *out[2] = {NULL, NULL};
    int32_t *pos_d = NULL;
    const int L = c->num_layers, V = (int)c->vocab_size, d = c->hidden_dim;
    nl_backend_opts o = {.threads = 2};
    CHECK_OK(nl_backend_new(&be, "cpu-devsim", &o, &err), &err);
    if (!be || !(m = make_model(be, c, 0, L, 1, 1)))
        goto out;
    /* [0] routes on the device, [1] on the host (read when allocated) */
    for (int h = 0; h < 2; h++) {
        if (h)
            setenv("NL_HOST_ROUTING", "1", 1);
        else
            unsetenv("NL_HOST_ROUTING");
        CHECK_OK(nl_runstate_new(&rs[h], m, B * P, &err), &err);
        CHECK_OK(nl_kvcache_new(&kv[h], m, B, P + 1, NL_KV_FP32, &err), &err);
        CHECK_OK(nl_layer_acts_alloc(&la[h], be, c, B, 0, &err), &err);
        unsetenv("NL_HOST_ROUTING");
    }
    if (!rs[0] || !rs[1] || !kv[0] || !kv[1] || !la[0].x_in || !la[1].x_in)
        goto out;
    CHECK(!la[0].host_routing && la[1].host_routing, "NL_HOST_ROUTING read at allocation");
    int32_t pre[B * P], one[B] = {7, 9};
    for (int i = 0; i < B * P; i++)
        pre[i] = (i * 31 + 5) % V;
    for (int h = 0; h < 2; h++) {
        nl_forward_args a = {.B = B, .T = P, .tokens = pre, .kv = kv[h]};
        CHECK_OK(nl_forward(m, rs[h], &a, NULL, &err), &err);
        const uint64_t s0 = be->stats.host_syncs;
        nl_forward_args dec = {.B = B, .T = 1, .tokens = one, .kv = kv[h]};
        CHECK_OK(nl_forward(m, rs[h], &dec, NULL, &err), &err);
        const uint64_t n = be->stats.host_syncs - s0, want = 2 + (h ? 6 * (uint64_t)L : 0);
        CHECK(n == want, "decode step, %s routing: %llu host syncs, want %llu (2 input uploads%s)",
              h ? "host" : "device", (unsigned long long)n, (unsigned long long)want,
              h ? " + 6 per layer" : "");
        out[h] = check_download(be, nl_runstate_output(rs[h], NULL), (size_t)B * V);
    }
    CHECK(out[0] && out[1] && memcmp(out[0], out[1], (size_t)B * V * sizeof(float)) == 0,
          "decode logits: device routing and host routing give the same bits");

    /* the layers alone: zero syncs with device routing */
    x = malloc((size_t)B * d * sizeof *x);
    pos_d = be->alloc(be, B * sizeof *pos_d);
    if (!x || !pos_d)
        goto out;
    for (int i = 0; i < B * d; i++)
        x[i] = (float)((i * 13) % 17) / 17.0f - 0.5f;
    const int32_t pos[B] = {3, 3};
    be->upload(be, pos_d, pos, sizeof pos);
    for (int h = 0; h < 2; h++) {
        be->upload(be, la[h].x_in, x, (size_t)B * d * sizeof *x);
        const uint64_t s0 = be->stats.host_syncs;
        for (int l = 0; l < L; l++)
            nl_layer_forward(m, l, &la[h], B, 1, 0, NULL, pos_d, NULL);
        const uint64_t n = be->stats.host_syncs - s0;
        CHECK(n == (h ? 6 * (uint64_t)L : 0), "%d layers, %s routing: %llu host syncs", L,
              h ? "host" : "device", (unsigned long long)n);
    }
    xd = check_download(be, la[0].x_out, (size_t)B * d);
    free(x);
    x = check_download(be, la[1].x_out, (size_t)B * d);
    CHECK(x && xd && memcmp(x, xd, (size_t)B * d * sizeof *x) == 0,
          "layers: device routing and host routing give the same bits");

    /* the aux loss costs one download, and only when asked */
    const uint64_t s0 = be->stats.host_syncs;
    float aux = 0;
    nl_forward_args dec = {.B = B, .T = 1, .tokens = one};
    CHECK_OK(nl_forward(m, rs[0], &dec, &aux, &err), &err);
    CHECK(be->stats.host_syncs - s0 == 3, "forward with its aux loss: %llu host syncs, want 3",
          (unsigned long long)(be->stats.host_syncs - s0));
    CHECK(aux > 0.0f, "aux loss %g", aux);
out:
    free(x);
    free(xd);
    free(out[0]);
    free(out[1]);
    if (be) {
        be->free(be, pos_d);
        for (int h = 0; h < 2; h++)
            if (la[h].x_in)
                nl_layer_acts_free(&la[h], be);
    }
    for (int h = 0; h < 2; h++) {
        nl_kvcache_destroy(&kv[h]);
        nl_runstate_destroy(&rs[h]);
    }
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
}

/* Sampling through the backend's sample_rows slot (only the id comes back)
 * gives the ids of sampling the downloaded logits on the host
 * (NL_HOST_SAMPLING=1), over 256 decode steps: greedy, seeded temperature
 * sampling, and top-p (its nucleus found on the device too). */
static void gen_ids(nl_model *m, float temperature, float top_p, uint64_t seed, int32_t *ids, int n,
                    int *on_device)
{
    nl_error err = {0};
    nl_backend *be = m->be;
    const int V = (int)m->cfg.vocab_size;
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    nl_sampler smp = {0};
    float *host = malloc((size_t)V * sizeof *host);
    int32_t prompt[3] = {5, 17, 200}, next = 0;
    CHECK_OK(nl_runstate_new(&rs, m, 3, &err), &err);
    CHECK_OK(nl_kvcache_new(&kv, m, 1, n + 3, NL_KV_FP32, &err), &err);
    CHECK_OK(nl_sampler_init(&smp, V, temperature, top_p, seed, &err), &err);
    *on_device = nl_sampler_device(&smp, be);
    nl_forward_args a = {.B = 1, .T = 3, .tokens = prompt, .kv = kv, .last_only = 1};
    for (int i = 0; rs && kv && host && i < n; i++) {
        if (nl_forward(m, rs, &a, NULL, &err) != NL_OK ||
            nl_sampler_next(&smp, be, nl_runstate_output(rs, NULL), host, &next, &err) != NL_OK) {
            CHECK(0, "decode step %d: %s", i, err.msg);
            break;
        }
        ids[i] = next;
        a.T = 1;
        a.tokens = &next;
    }
    nl_sampler_free(&smp);
    free(host);
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
}

static void test_device_sampling(nl_backend *be, const nl_config *base)
{
    enum { N = 256 };
    nl_config c = *base;
    c.max_seq_len = N + 8;
    nl_config_fill_derived(&c);
    nl_model *m = make_model(be, &c, 0, c.num_layers, 1, 1);
    if (!m)
        return;
    const struct {
        float t, top_p;
        uint64_t seed;
    } modes[] = {
        {0.0f, 1.0f, 1}, {0.8f, 1.0f, 7}, {1.5f, 1.0f, 9}, {0.9f, 0.9f, 3}, {1.2f, 0.5f, 4}};
    for (size_t k = 0; k < sizeof modes / sizeof *modes; k++) {
        int32_t dev[N], host[N];
        int on_dev = 0, on_host = 0;
        gen_ids(m, modes[k].t, modes[k].top_p, modes[k].seed, dev, N, &on_dev);
        setenv("NL_HOST_SAMPLING", "1", 1);
        gen_ids(m, modes[k].t, modes[k].top_p, modes[k].seed, host, N, &on_host);
        unsetenv("NL_HOST_SAMPLING");
        CHECK(on_dev == (be->sample_rows != NULL) && !on_host,
              "temperature %g top-p %g: sampled on the device %d, with NL_HOST_SAMPLING %d",
              modes[k].t, modes[k].top_p, on_dev, on_host);
        int first = -1, distinct = 0;
        for (int i = 0; i < N; i++) {
            if (first < 0 && dev[i] != host[i])
                first = i;
            distinct += i > 0 && dev[i] != dev[i - 1];
        }
        CHECK(first < 0, "temperature %g top-p %g: ids differ from step %d (%d vs %d)", modes[k].t,
              modes[k].top_p, first, first < 0 ? 0 : dev[first], first < 0 ? 0 : host[first]);
        CHECK(modes[k].t == 0.0f || distinct > N / 4,
              "temperature %g: only %d changes of id in %d steps (is it sampling?)", modes[k].t,
              distinct, N);
    }
    nl_model_destroy(&m);
}

/* The edges: a cache holds at most the context (one more position is
 * refused, not allocated); the sampler refuses top_p 0, and top-p keeps the
 * smallest set of ids whose mass reaches top_p (two tied ids at top_p 0.5:
 * only the first, whatever the draw). */
static void test_bounds(nl_backend *be, const nl_config *c)
{
    nl_error err = {0};
    nl_model *m = make_model(be, c, 0, c->num_layers, 1, 1);
    nl_kvcache *kv = NULL;
    CHECK(nl_kvcache_new(&kv, m, 1, c->max_seq_len + 1, NL_KV_FP32, &err) == NL_ERR_RANGE && !kv,
          "a cache of max_seq_len + 1 = %d positions is refused", c->max_seq_len + 1);
    CHECK_OK(nl_kvcache_new(&kv, m, 1, c->max_seq_len, NL_KV_FP32, &err), &err);
    nl_kvcache_destroy(&kv);
    nl_model_destroy(&m);

    nl_sampler s;
    CHECK(nl_sampler_init(&s, 4, 1.0f, 0.0f, 1, &err) == NL_ERR_INVALID, "top_p 0 is refused");
    CHECK(nl_sampler_init(&s, 4, 1.0f, 1.5f, 1, &err) == NL_ERR_INVALID, "top_p 1.5 is refused");
    CHECK_OK(nl_sampler_init(&s, 4, 1.0f, 0.5f, 7, &err), &err);
    /* the nucleus keeps a tie at its edge whole (kernels/elem.h): both
     * tied ids are drawn, never the others */
    const float logits[4] = {0.0f, 0.0f, -INFINITY, -INFINITY};
    int seen[4] = {0};
    for (int i = 0; i < 200; i++)
        seen[nl_sampler_sample(&s, logits)]++;
    CHECK(seen[0] > 50 && seen[1] > 50 && seen[2] == 0 && seen[3] == 0,
          "top_p 0.5 of two tied ids: drawn %d, %d, %d, %d times", seen[0], seen[1], seen[2],
          seen[3]);
    /* and stops at the first weight that brings it to top_p */
    const float three[4] = {1.0f, 0.0f, -0.5f, -INFINITY};
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < 200; i++)
        seen[nl_sampler_sample(&s, three)]++;
    CHECK(seen[0] == 200, "top_p 0.5 of weights 1, .37, .22: drawn %d, %d, %d, %d times", seen[0],
          seen[1], seen[2], seen[3]);
    nl_sampler_free(&s);
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    if (!be)
        return check_done("test_model");
    nl_config c = test_config();
    CHECK_OK(nl_config_validate(&c, 1, &err), &err);
    test_init_slices(be, &c);
    test_kv_decode(be, &c);
    test_split(be, &c);
    test_decode_syncs(&c);
    test_device_sampling(be, &c);
    test_bounds(be, &c);
    nl_backend_destroy(&be);
    return check_done("test_model");
}
