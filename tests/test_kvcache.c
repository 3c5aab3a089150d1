/* The KV cache in bf16 (--kv-cache bf16) against the FP32 one, on the
 * backend NL_TEST_DEVICE names (cpu, cpu-devsim):
 *   - it takes half the bytes: nl_kvcache_bytes, the backend's own count
 *     of what it allocated (mem_stats), and the memory model's kv_cache;
 *   - what it holds is the FP32 cache's keys and values rounded to nearest
 *     even (nl_elem_to_bf16), bit for bit;
 *   - greedy decoding of DECODE tokens after a prompt on a small random
 *     model gives the FP32 cache's ids, one at a time (the same token fed
 *     to both), with every step's logits within LOGIT_TOL of FP32's.
 *
 * LOGIT_TOL: bf16 keeps 8 significant bits, so each stored key and value
 * is off by at most 2^-9 relative (half a unit in the last place). A score
 * q.k and a weighted sum of values then move by about 2^-9 of their size,
 * and the layers and the head carry that on without cancelling it much
 * (the model's matrices are widened 8x so attention is peaky): 3 layers
 * of a few such errors each stay under 2^-5 = 0.031 of the logits'
 * max-norm, which is also far above FP32's own noise (1e-6), so the test
 * can tell a cache that really holds bf16 from one that does not (the
 * measured error is printed: 0.0083 here).
 *
 * The model is dense (one expert): with 8 experts a near-tie in a router
 * flips one token's expert choice between the two runs at some step
 * (measured: 0.3 of the logits' max-norm at that step, and a different
 * greedy id at another one), a discrete change that no bound on the
 * cache's rounding covers; what this test bounds is the cache's error. */
#include "core/model/forward.h"
#include "core/model/kvcache.h"
#include "core/model/memory.h"
#include "core/model/model.h"
#include "kernels/elem.h"
#include "tests/check.h"

#include <stdint.h>
#include <stdlib.h>

#define PROMPT 6
#define DECODE 40
#define LOGIT_TOL 0.03125 /* 2^-5 of the logits' max-norm (see above) */

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
    c.num_experts = 1; /* dense: no routing flip between the two runs */
    c.top_k = 1;
    nl_config_fill_derived(&c);
    return c;
}

/* init, then widen the matrices so attention and routing are decisive */
static nl_model *make_model(nl_backend *be, const nl_config *c)
{
    nl_error err = {0};
    nl_model *m = NULL;
    CHECK_OK(nl_model_new(&m, be, c, 0, c->num_layers, 1, 1, &err), &err);
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

static void test_bytes(nl_backend *be, nl_model *m)
{
    nl_error err = {0};
    const nl_config *c = &m->cfg;
    const size_t b32 = nl_kvcache_bytes(c, c->num_layers, 2, 40, NL_KV_FP32);
    const size_t b16 = nl_kvcache_bytes(c, c->num_layers, 2, 40, NL_KV_BF16);
    CHECK(b32 == 2 * b16 && b16 == 2 * (size_t)c->num_layers * 2 * 40 * c->num_kv_heads *
                                       nl_config_head_dim(c) * 2,
          "bf16 cache bytes %zu, FP32 %zu", b16, b32);
    nl_kvcache *kv = NULL;
    size_t used0 = 0, used1 = 0, peak = 0;
    be->mem_stats(be, &used0, &peak);
    CHECK_OK(nl_kvcache_new(&kv, m, 2, 40, NL_KV_BF16, &err), &err);
    be->mem_stats(be, &used1, &peak);
    CHECK(kv && kv->dtype == NL_KV_BF16 && used1 - used0 == b16,
          "the backend holds %zu bytes more for a bf16 cache of %zu", used1 - used0, b16);
    nl_kvcache_destroy(&kv);
    nl_mem_opts mo = {.micro_rows = 1, .kv_sessions = 3, .kv_len = 50};
    const uint64_t e32 = nl_memory_estimate(c, c->num_layers, 1, 1, &mo).kv_cache;
    mo.kv_bf16 = 1;
    const uint64_t e16 = nl_memory_estimate(c, c->num_layers, 1, 1, &mo).kv_cache;
    CHECK(e32 == 2 * e16 && e16 == nl_kvcache_bytes(c, c->num_layers, 3, 50, NL_KV_BF16),
          "memory model: bf16 caches %llu bytes, FP32 %llu", (unsigned long long)e16,
          (unsigned long long)e32);
}

/* One decode: a runstate and a cache of `dtype` with the prompt in it. */
typedef struct run {
    nl_runstate *rs;
    nl_kvcache *kv;
    float *logits; /* (V) host */
} run;

static void run_step(nl_model *m, run *r, const int32_t *tokens, int T)
{
    nl_error err = {0};
    nl_forward_args a = {.B = 1, .T = T, .tokens = tokens, .kv = r->kv, .last_only = 1};
    CHECK_OK(nl_forward(m, r->rs, &a, NULL, &err), &err);
    float *x = check_download(m->be, nl_runstate_output(r->rs, NULL), (size_t)m->cfg.vocab_size);
    if (x)
        memcpy(r->logits, x, (size_t)m->cfg.vocab_size * sizeof(float));
    free(x);
}

static int argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        best = x[i] > x[best] ? i : best;
    return best;
}

/* The bf16 cache's layer 0 keys and values after the prompt are the FP32
 * cache's rounded, bit for bit. */
static void check_contents(nl_model *m, const run *r32, const run *r16, int n)
{
    const size_t e = (size_t)n * r32->kv->kv_dim; /* sequence 0's first n rows of layer 0 */
    for (int kv = 0; kv < 2; kv++) {
        float *f = check_download(m->be, kv ? r32->kv->v : r32->kv->k, e);
        uint16_t *h = NULL;
        float *raw = check_download(m->be, kv ? r16->kv->v : r16->kv->k, (e + 1) / 2);
        if (raw)
            h = (uint16_t *)raw;
        size_t bad = 0;
        for (size_t i = 0; f && h && i < e; i++)
            bad += h[i] != nl_elem_to_bf16(f[i]);
        CHECK(f && h && bad == 0, "%s: %zu of %zu cached values not the FP32 ones rounded",
              kv ? "values" : "keys", bad, e);
        free(f);
        free(raw);
    }
}

static void test_decode(nl_backend *be, nl_model *m)
{
    nl_error err = {0};
    const int V = (int)m->cfg.vocab_size;
    run r[2] = {{0}};
    const nl_kv_dtype types[2] = {NL_KV_FP32, NL_KV_BF16};
    for (int i = 0; i < 2; i++) {
        CHECK_OK(nl_runstate_new(&r[i].rs, m, PROMPT, &err), &err);
        CHECK_OK(nl_kvcache_new(&r[i].kv, m, 1, PROMPT + DECODE, types[i], &err), &err);
        r[i].logits = malloc((size_t)V * sizeof(float));
        if (!r[i].rs || !r[i].kv || !r[i].logits)
            goto out;
    }
    const int32_t prompt[PROMPT] = {5, 17, 200, 3, 99, 42};
    int same = 0;
    double worst = 0;
    int32_t next[2] = {0, 0};
    for (int t = 0; t <= DECODE - 1; t++) {
        for (int i = 0; i < 2; i++)
            run_step(m, &r[i], t ? &next[0] : prompt, t ? 1 : PROMPT);
        if (t == 0)
            check_contents(m, &r[0], &r[1], PROMPT);
        double num = 0, den = 0;
        for (int j = 0; j < V; j++) {
            num = fmax(num, fabs((double)r[1].logits[j] - r[0].logits[j]));
            den = fmax(den, fabs((double)r[0].logits[j]));
        }
        worst = fmax(worst, num / den);
        next[0] = argmax(r[0].logits, V);
        next[1] = argmax(r[1].logits, V);
        same += next[0] == next[1];
    }
    printf("bf16 cache: %d of %d greedy ids equal, logits within %.3g of the max-norm\n", same,
           DECODE, worst);
    CHECK(same == DECODE, "greedy ids: %d of %d equal to the FP32 cache's", same, DECODE);
    CHECK(worst <= LOGIT_TOL && worst > 0, "logits within %.3g of FP32's, tolerance %g", worst,
          LOGIT_TOL);
    CHECK(r[1].kv->len == PROMPT + DECODE - 1, "the bf16 cache holds %d positions", r[1].kv->len);
out:
    for (int i = 0; i < 2; i++) {
        free(r[i].logits);
        nl_kvcache_destroy(&r[i].kv);
        nl_runstate_destroy(&r[i].rs);
    }
    (void)be;
}

int main(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    if (!be)
        return check_done("test_kvcache");
    nl_config c = test_config();
    CHECK_OK(nl_config_validate(&c, 1, &err), &err);
    nl_model *m = make_model(be, &c);
    if (m) {
        test_bytes(be, m);
        test_decode(be, m);
    }
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    return check_done("test_kvcache");
}
