/* The decode figures of bench_cuda (bench_cuda.c has the program, its
 * output and the GEMM and memory-bound parts): where a decode token's time
 * goes (device routing with and without recorded steps, host routing, the
 * separate slots in place of the fused ones, a bf16 KV cache, the copies
 * every token makes, the op slot calls of one token) and batched decode
 * (1, 4 and 16 sessions together, row invariance, gemm's decode rows on
 * cuBLAS beside the gemm_rows kernel), printed as the JSON objects
 * "decode", "decode_bound" (the memory-bound limit and the fraction of it
 * reached) and "batch_decode". */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_cuda.h"
#include "core/model/batch.h"
#include "core/model/config.h"
#include "core/model/forward.h"
#include "core/model/sampler.h"
#include "kernels/backend.h"

/* ---------------------------------------------------------------- decode */

#define DECODE_MODES 8 /* the runs of decode_split */

/* The figures of one decode run. */
typedef struct decode_fig {
    double s_per_tok;  /* seconds per token */
    double syncs;      /* host synchronisations per token */
    uint64_t ids_hash; /* FNV-1a of the ids: runs that must agree compare it */
    uint64_t replays;  /* steps replayed from a recorded graph */
} decode_fig;

/* One decode run: a 64-token prompt, then `tokens` tokens one at a time,
 * each forward followed by greedy sampling (or seeded top-p sampling,
 * temperature 0.8 and top-p 0.95, the defaults of neuroctl generate) as a
 * stage samples
 * (nl_sampler_next: on the device where the backend has a sample_rows slot, so
 * only the id comes back; with NL_HOST_SAMPLING=1 the logits are
 * downloaded and sampled on the host), the token fed back. The runstate
 * is made with NL_HOST_ROUTING set to `host` (core/model/layer.h reads it then)
 * and with recorded steps (CUDA graphs, core/model/forward.h) on or off.
 * Host synchronisations: be->stats.host_syncs, the waits of uploads,
 * downloads and syncs (on CUDA a small upload is staged and does not
 * wait). Returns 0, or -1 with err set. */
/* How a decode run is made: routing on the host (NL_HOST_ROUTING=1),
 * recorded steps, the fused decode slots (off: NL_FUSED=0), the KV
 * cache's element type (--kv-cache), and sampling: 0 greedy, 1 top-p, 2
 * top-p on the host (NL_HOST_SAMPLING=1: the logits downloaded). */
typedef struct decode_mode {
    int host, graphs, fused;
    nl_kv_dtype kv;
    int top_p;
} decode_mode;

/* setenv(name, v) for a runstate's allocation, then the old value back */
static void env_swap(const char *name, const char *v, char *keep, size_t cap, int *had)
{
    if (v) {
        const char *was = getenv(name);
        *had = was != NULL;
        if (was)
            snprintf(keep, cap, "%s", was);
        setenv(name, v, 1);
    } else if (*had) {
        setenv(name, keep, 1);
    } else {
        unsetenv(name);
    }
}

static nl_status runstate_for(nl_runstate **rs, nl_model *m, int rows, const decode_mode *dm,
                              nl_error *err)
{
    char k1[16] = "", k2[16] = "";
    int h1 = 0, h2 = 0;
    env_swap("NL_HOST_ROUTING", dm->host ? "1" : "0", k1, sizeof k1, &h1);
    env_swap("NL_FUSED", dm->fused ? "1" : "0", k2, sizeof k2, &h2);
    const nl_status st = nl_runstate_new(rs, m, rows, err);
    env_swap("NL_HOST_ROUTING", NULL, k1, sizeof k1, &h1);
    env_swap("NL_FUSED", NULL, k2, sizeof k2, &h2);
    if (st == NL_OK)
        nl_runstate_set_graphs(*rs, dm->graphs);
    return st;
}

static int decode_run(nl_backend *be, nl_model *m, int tokens, const decode_mode *dm, float *logits,
                      decode_fig *f, nl_error *err)
{
    const int P = 64, V = (int)m->cfg.vocab_size;
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    int32_t prompt[64];
    int rc = -1, cols = 0;
    nl_sampler smp = {0};
    if (nl_sampler_init(&smp, V, dm->top_p ? 0.8f : 0.0f, dm->top_p ? 0.95f : 1.0f, 1, err) !=
        NL_OK)
        return -1;
    char keep[16] = "";
    int had = 0;
    if (dm->top_p == 2)
        env_swap("NL_HOST_SAMPLING", "1", keep, sizeof keep, &had);
    for (int i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 7919) % V);
    if (runstate_for(&rs, m, P, dm, err) != NL_OK ||
        nl_kvcache_new(&kv, m, 1, P + tokens, dm->kv, err) != NL_OK)
        goto out;
    nl_forward_args a = {.B = 1, .T = P, .tokens = prompt, .kv = kv, .last_only = 1};
    if (nl_forward(m, rs, &a, NULL, err) != NL_OK)
        goto out;
    a.T = 1;
    int32_t tok = 0;
    uint64_t h = 1469598103934665603ull;
    /* the prompt's token, outside the count: each of the tokens is a step
     * and a sample (the H200 run counted 65 samples over 64 steps: 1.02) */
    if (nl_sampler_next(&smp, be, nl_runstate_output(rs, &cols), logits, &tok, err) != NL_OK)
        goto out;
    const uint64_t s0 = be->stats.host_syncs;
    const double t0 = now_s();
    for (int t = 0; t < tokens; t++) {
        h = (h ^ (uint64_t)(uint32_t)tok) * 1099511628211ull;
        a.tokens = &tok;
        if (nl_forward(m, rs, &a, NULL, err) != NL_OK ||
            nl_sampler_next(&smp, be, nl_runstate_output(rs, &cols), logits, &tok, err) != NL_OK)
            goto out;
    }
    f->s_per_tok = (now_s() - t0) / tokens;
    f->syncs = (double)(be->stats.host_syncs - s0) / tokens;
    f->ids_hash = h;
    f->replays = nl_runstate_graphs(rs).replays;
    rc = be->sync(be, err) == NL_OK ? 0 : -1;
out:
    if (dm->top_p == 2)
        env_swap("NL_HOST_SAMPLING", NULL, keep, sizeof keep, &had);
    nl_sampler_free(&smp);
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
    return rc;
}

/* ---------------------------------------------------------------- launches */

/* The backend's table with every op slot a decode step reaches counted:
 * the slot calls core makes in one step (each one kernel, or cuBLAS's
 * few); calls a slot makes inside the backend are not counted. `be` must
 * stay the first member. */
typedef struct counting {
    nl_backend be;
    nl_backend *in;
    long calls;
} counting;

#define COUNTED(name, params, ...)                                                                 \
    static void cnt_##name params                                                                  \
    {                                                                                              \
        counting *self_ = (counting *)be;                                                          \
        self_->calls++;                                                                            \
        self_->in->name(self_->in, __VA_ARGS__);                                                   \
    }
COUNTED(zero, (nl_backend * be, void *p, size_t n), p, n)
COUNTED(gemm,
        (nl_backend * be, int ta, int tb, int M, int N, int K, float al, const float *A, int lda,
         const float *B, int ldb, float bt, float *C, int ldc),
        ta, tb, M, N, K, al, A, lda, B, ldb, bt, C, ldc)
COUNTED(embedding_forward,
        (nl_backend * be, float *o, const int32_t *t, const float *tab, int N, int C), o, t, tab, N,
        C)
COUNTED(rmsnorm_forward,
        (nl_backend * be, float *o, float *r, const float *i, const float *w, int N, int C,
         float e),
        o, r, i, w, N, C, e)
COUNTED(rope_forward,
        (nl_backend * be, float *x, const int32_t *p, int N, int row, int c0, int h, int hd,
         float b),
        x, p, N, row, c0, h, hd, b)
COUNTED(rope_scaled_forward,
        (nl_backend * be, float *x, const int32_t *p, int N, int row, int c0, int h, int hd,
         float b, nl_rope_scaling sc),
        x, p, N, row, c0, h, hd, b, sc)
COUNTED(attention_forward,
        (nl_backend * be, float *o, float *l, const float *q, int qs, const float *k,
         const float *v, int ks, nl_attn_shape sh),
        o, l, q, qs, k, v, ks, sh)
COUNTED(attention_masked_forward,
        (nl_backend * be, float *o, float *l, const float *q, int qs, const float *k,
         const float *v, int ks, nl_attn_shape sh, nl_attn_mask mk),
        o, l, q, qs, k, v, ks, sh, mk)
COUNTED(softmax_forward, (nl_backend * be, float *x, int N, int C), x, N, C)
COUNTED(swiglu_forward, (nl_backend * be, float *o, const float *gu, int N, int F), o, gu, N, F)
COUNTED(geglu_forward, (nl_backend * be, float *o, const float *gu, int N, int F), o, gu, N, F)
COUNTED(gather_rows, (nl_backend * be, float *o, const float *src, const int32_t *i, int n, int C),
        o, src, i, n, C)
COUNTED(copy_rows, (nl_backend * be, float *d, int ds, const float *s, int ss, int r, int c), d, ds,
        s, ss, r, c)
COUNTED(kv_store,
        (nl_backend * be, float *kc, float *vc, const float *qkv, int st, int kc0, int vc0,
         const int32_t *p, int B, int T, int cap, int kvd),
        kc, vc, qkv, st, kc0, vc0, p, B, T, cap, kvd)
COUNTED(kv_store_bf16,
        (nl_backend * be, uint16_t *kc, uint16_t *vc, const float *qkv, int st, int kc0, int vc0,
         const int32_t *p, int past, int B, int T, int cap, int kvd),
        kc, vc, qkv, st, kc0, vc0, p, past, B, T, cap, kvd)
COUNTED(moe_combine,
        (nl_backend * be, float *x, const float *y, const int32_t *sl, const float *w, int N, int k,
         int C),
        x, y, sl, w, N, k, C)
COUNTED(moe_route,
        (nl_backend * be, int32_t *ch, float *w, int32_t *off, int32_t *perm, int32_t *sl,
         const float *p, int N, int E, int k),
        ch, w, off, perm, sl, p, N, E, k)
COUNTED(moe_aux,
        (nl_backend * be, double *aux, float *fr, int64_t *cn, const float *p, const int32_t *off,
         const float *gf, int N, int E, int k, double rows),
        aux, fr, cn, p, off, gf, N, E, k, rows)
COUNTED(gemm_grouped,
        (nl_backend * be, int tb, int N, int K, const float *A, int lda, const float *B, int ldb,
         size_t bs, float *C, int ldc, const int32_t *off, int g, int mr),
        tb, N, K, A, lda, B, ldb, bs, C, ldc, off, g, mr)
COUNTED(moe_ffn_forward,
        (nl_backend * be, float *ye, float *hs, float *gu, const float *xe, const float *ex,
         size_t es, int d, int F, const int32_t *off, int g, int mr),
        ye, hs, gu, xe, ex, es, d, F, off, g, mr)
COUNTED(moe_norm_route,
        (nl_backend * be, float *xn, float *p, int32_t *ch, float *w, const float *x,
         const float *nw, const float *rt, int N, int d, int E, int k, float e),
        xn, p, ch, w, x, nw, rt, N, d, E, k, e)
COUNTED(moe_gate_up,
        (nl_backend * be, float *hs, float *gu, const float *xn, const int32_t *ch, const float *ex,
         size_t es, int N, int k, int d, int F),
        hs, gu, xn, ch, ex, es, N, k, d, F)
COUNTED(moe_down_combine,
        (nl_backend * be, float *x, float *ye, const float *hs, const int32_t *ch, const float *w,
         const float *ex, size_t es, int N, int k, int d, int F),
        x, ye, hs, ch, w, ex, es, N, k, d, F)
#undef COUNTED

/* Wrap every non-NULL op slot of `in` */
static void counting_init(counting *c, nl_backend *in)
{
    c->be = *in;
    c->in = in;
    c->calls = 0;
#define WRAP(name)                                                                                 \
    do {                                                                                           \
        if (in->name)                                                                              \
            c->be.name = cnt_##name;                                                               \
    } while (0)
    WRAP(zero);
    WRAP(gemm);
    WRAP(embedding_forward);
    WRAP(rmsnorm_forward);
    WRAP(rope_forward);
    WRAP(rope_scaled_forward);
    WRAP(attention_forward);
    WRAP(attention_masked_forward);
    WRAP(softmax_forward);
    WRAP(swiglu_forward);
    WRAP(geglu_forward);
    WRAP(gather_rows);
    WRAP(copy_rows);
    WRAP(kv_store);
    WRAP(kv_store_bf16);
    WRAP(moe_combine);
    WRAP(moe_route);
    WRAP(moe_aux);
    WRAP(gemm_grouped);
    WRAP(moe_ffn_forward);
    WRAP(moe_norm_route);
    WRAP(moe_gate_up);
    WRAP(moe_down_combine);
#undef WRAP
    c->be.graph_begin = NULL; /* one step, every op launched */
}

/* Op slot calls of one decode token (after a 4-token prompt), fused decode
 * slots on or off: *calls. Returns 0, or -1 with err set. */
static int decode_launches(nl_model *m, int fused, long *calls, nl_error *err)
{
    counting c;
    counting_init(&c, m->be);
    nl_model view = *m;
    view.be = &c.be;
    const decode_mode dm = {0, 0, fused, NL_KV_FP32, 0};
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    int32_t prompt[4] = {1, 2, 3, 4};
    int rc = -1;
    if (runstate_for(&rs, m, 4, &dm, err) != NL_OK ||
        nl_kvcache_new(&kv, m, 1, 8, NL_KV_FP32, err) != NL_OK)
        goto out;
    nl_forward_args a = {.B = 1, .T = 4, .tokens = prompt, .kv = kv, .last_only = 1};
    if (nl_forward(&view, rs, &a, NULL, err) != NL_OK)
        goto out;
    a.T = 1;
    c.calls = 0;
    if (nl_forward(&view, rs, &a, NULL, err) != NL_OK)
        goto out;
    *calls = c.calls;
    rc = m->be->sync(m->be, err) == NL_OK ? 0 : -1;
out:
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
    return rc;
}

/* Where a decode token's time goes: with routing on the device (recorded
 * steps on, then off) and with NL_HOST_ROUTING=1, then the copies every
 * token makes (token and position up, logits down) timed alone. fig:
 * [0] device routing, [1] host routing, [2] device routing without
 * graphs, [3] and [4] as [0] and [2] without the fused decode slots
 * (NL_FUSED=0), [5] as [0] with a bf16 KV cache; launches[2]: op slot
 * calls of one token, fused and not. Returns 0, or -1 with err set. */
static int decode_split(nl_backend *be, const nl_config *cf, int tokens,
                        decode_fig fig[DECODE_MODES], long launches[2], double *copy_s,
                        nl_error *err)
{
    const int L = cf->num_layers, V = (int)cf->vocab_size;
    nl_model *m = NULL;
    int rc = -1;
    int32_t i32[64];
    float *host = malloc((size_t)V * sizeof(float));
    float *dev = NULL;
    if (!host || nl_model_new(&m, be, cf, 0, L, 1, 1, err) != NL_OK ||
        nl_model_init_random(m, 1, err) != NL_OK ||
        !(dev = be->alloc(be, (size_t)(V > 64 ? V : 64) * sizeof(float)))) {
        if (err->status == NL_OK)
            nl_error_set(err, NL_ERR_NOMEM, "decode: out of memory");
        goto out;
    }
    static const decode_mode modes[DECODE_MODES] = {
        {0, 1, 1, NL_KV_FP32, 0}, {1, 1, 1, NL_KV_FP32, 0}, {0, 0, 1, NL_KV_FP32, 0},
        {0, 1, 0, NL_KV_FP32, 0}, {0, 0, 0, NL_KV_FP32, 0}, {0, 1, 1, NL_KV_BF16, 0},
        {0, 1, 1, NL_KV_FP32, 1}, {0, 1, 1, NL_KV_FP32, 2}};
    for (int k = 0; k < DECODE_MODES; k++)
        if (decode_run(be, m, tokens, &modes[k], host, &fig[k], err) != 0)
            goto out;
    if (decode_launches(m, 1, &launches[0], err) != 0 ||
        decode_launches(m, 0, &launches[1], err) != 0)
        goto out;
    memset(i32, 0, sizeof i32);
    const double t0 = now_s();
    for (int t = 0; t < tokens; t++) {
        be->upload(be, dev, i32, sizeof(int32_t)); /* the token */
        be->upload(be, dev, i32, sizeof(int32_t)); /* its position */
        be->download(be, host, dev, (size_t)V * sizeof(float));
    }
    *copy_s = (now_s() - t0) / tokens;
    rc = be->sync(be, err) == NL_OK ? 0 : -1;
out:
    if (dev)
        be->free(be, dev);
    nl_model_destroy(&m);
    free(host);
    return rc;
}

/* The decode split as the JSON object "decode" (after a comma). Returns
 * 0, or -1 with err set (nothing printed). */
static int batch_report(nl_backend *be, const char *device, const nl_backend_opts *o,
                        const nl_config *cf, int tokens, const decode_fig *fwd, nl_error *err);

/* The bytes a batch-1 decode token must read at least (issue 29's memory
 * bound): each weight it uses once (the attention projections, the router,
 * its top_k experts' three matrices, the head; wbytes an element: 4, or 2
 * where bf16 GEMMs read the weights' bf16 copy), the norm weights and its
 * embedding row in FP32, and the KV cache of ctx positions (kvbytes an
 * element). */
static double decode_bytes_per_token(const nl_config *c, int wbytes, int kvbytes, double ctx)
{
    const double d = c->hidden_dim, hd = nl_config_head_dim(c), H = c->num_heads;
    const double G = c->num_kv_heads, F = c->ffn_dim, E = c->num_experts, k = c->top_k;
    const double L = c->num_layers;
    const double layer =
        d * (H + 2 * G) * hd + H * hd * d + (nl_config_dense(c) ? 0 : E * d) + k * 3 * F * d;
    const double weights = wbytes * (L * layer + (double)c->vocab_size * d);
    const double vectors = 4 * (L * 2 * d + d + d); /* norms, the final norm, the embedding row */
    return weights + vectors + L * 2 * G * hd * ctx * kvbytes;
}

/* The device's copy bandwidth, measured: copy_rows over two 256 MiB buffers
 * (a read and a write of each byte), the best of 5 after a warm-up, in
 * bytes per second. 0 when the buffers cannot be had (no figure then). */
static double copy_bandwidth(nl_backend *be, nl_error *err)
{
    enum { COLS = 4096, ROWS = 16384 }; /* 64 Mi floats */
    const size_t bytes = (size_t)COLS * ROWS * sizeof(float);
    float *a = be->alloc(be, bytes), *b = a ? be->alloc(be, bytes) : NULL;
    double best = 0;
    if (a && b) {
        be->zero(be, a, bytes);
        for (int r = 0; r < 6; r++) {
            const double t0 = now_s();
            be->copy_rows(be, b, COLS, a, COLS, ROWS, COLS);
            if (be->sync(be, err) != NL_OK)
                break;
            const double t = now_s() - t0;
            if (r > 0 && (best == 0 || t < best))
                best = t;
        }
    }
    if (b)
        be->free(be, b);
    if (a)
        be->free(be, a);
    return best > 0 ? 2.0 * (double)bytes / best : 0.0;
}

int decode_report(nl_backend *be, const char *device, const nl_backend_opts *o, const nl_config *cf,
                  long long tokens, int batch, nl_error *err)
{
    decode_fig f[DECODE_MODES] = {{0}};
    long launches[2] = {0};
    double copy = 0;
    if (decode_split(be, cf, (int)tokens, f, launches, &copy, err) != 0)
        return -1;
    const double bw = copy_bandwidth(be, err);
    if (err->status != NL_OK)
        return -1;
    printf(",\n  \"decode\":{\"tokens\":%lld,\"prompt\":64,", tokens);
    static const char *names[DECODE_MODES] = {
        "device_routing",     "host_routing",  "no_graphs",    "no_fused",
        "no_fused_no_graphs", "bf16_kv_cache", "top_p_device", "top_p_host"};
    printf("\"launches_per_token\":{\"fused\":%ld,\"unfused\":%ld},\"fused_same_ids\":%s,",
           launches[0], launches[1], f[0].ids_hash == f[3].ids_hash ? "true" : "false");
    for (int k = 0; k < DECODE_MODES; k++)
        printf("\"%s\":{\"ms_per_token\":%.3f,\"tokens_s\":%.1f,"
               "\"host_syncs_per_token\":%.2f,\"graph_replays\":%" PRIu64 "},",
               names[k], f[k].s_per_tok * 1e3, 1.0 / f[k].s_per_tok, f[k].syncs, f[k].replays);
    printf("\"top_p_same_ids\":%s,", f[6].ids_hash == f[7].ids_hash ? "true" : "false");
    printf("\"graphs_same_ids\":%s,\"bf16_kv_same_ids\":%s,\"copies_ms\":%.3f,"
           "\"kernels_and_launches_ms\":%.3f}",
           f[0].ids_hash == f[2].ids_hash ? "true" : "false",
           f[0].ids_hash == f[5].ids_hash ? "true" : "false", copy * 1e3,
           (f[0].s_per_tok - copy) * 1e3);
    /* the memory bound: the mean context of the run's tokens (the prompt, then
     * half of them), the device-routed run (FP32 cache) and the bf16 cache's */
    const double ctx = 64 + tokens / 2.0;
    const int wb = be->bf16 ? 2 : 4;
    const double b32 = decode_bytes_per_token(cf, wb, 4, ctx),
                 b16 = decode_bytes_per_token(cf, wb, 2, ctx);
    printf(",\n  \"decode_bound\":{\"precision\":\"%s\",\"copy_gbs\":%.1f,\"mean_context\":%.0f,"
           "\"bytes_per_token\":%.0f,\"limit_tokens_s\":%.1f,\"tokens_s\":%.1f,\"frac\":%.4f,"
           "\"bf16_kv_bytes_per_token\":%.0f,\"bf16_kv_limit_tokens_s\":%.1f,"
           "\"bf16_kv_tokens_s\":%.1f,\"bf16_kv_frac\":%.4f}",
           be->bf16 ? "bf16" : "fp32", bw / 1e9, ctx, b32, bw / b32, 1.0 / f[0].s_per_tok,
           bw > 0 ? b32 / f[0].s_per_tok / bw : 0.0, b16, bw / b16, 1.0 / f[5].s_per_tok,
           bw > 0 ? b16 / f[5].s_per_tok / bw : 0.0);
    return batch ? batch_report(be, device, o, cf, (int)tokens, &f[0], err) : 0;
}

/* ---------------------------------------------------------------- batched decode */

/* Batched decode (core/model/batch.c: a stage's step and `neuroctl serve`'s,
 * with every product row invariant: gemm_rows, gemm_grouped_rows and the
 * fused decode slots): S sessions, session i with decode_run's prompt
 * shifted by i, each prefilled alone, then `tokens` steps of all S at
 * once, greedy, each row sampled where it lies, all S in one call
 * (nl_sampler_next_batch: one host sync for their ids). Gives the time per step,
 * host synchronisations per step and a hash of session 0's ids, which
 * batch invariance makes the same for every S. Returns 0, or -1 with err
 * set. */
#define BATCH_MAX_SESSIONS 16
typedef struct batch_fig {
    double s_per_step, syncs;
    uint64_t ids0;
} batch_fig;

static int batch_run(nl_backend *be, nl_model *m, int S, int tokens, float *host, batch_fig *f,
                     nl_error *err)
{
    const int P = 64, V = (int)m->cfg.vocab_size;
    nl_batch *b = NULL;
    nl_kvcache *kv[BATCH_MAX_SESSIONS] = {0};
    nl_sampler smp[BATCH_MAX_SESSIONS];
    nl_batch_seg segs[BATCH_MAX_SESSIONS];
    int32_t prompt[64], next[BATCH_MAX_SESSIONS];
    nl_sampler *sp[BATCH_MAX_SESSIONS];
    const float *lg[BATCH_MAX_SESSIONS];
    nl_sample_row rows[BATCH_MAX_SESSIONS];
    int rc = -1, made = 0;
    if (nl_batch_new(&b, m, P > S ? P : S, err) != NL_OK)
        goto out;
    for (int i = 0; i < S; i++, made++) {
        if (nl_sampler_init(&smp[i], V, 0.0f, 1.0f, 1, err) != NL_OK)
            goto out;
        if (nl_kvcache_new(&kv[i], m, 1, P + tokens + 1, NL_KV_FP32, err) != NL_OK)
            goto out;
        for (int t = 0; t < P; t++)
            prompt[t] = (int32_t)(((t + i) * 7919) % V);
        segs[i] = (nl_batch_seg){kv[i], prompt, P, 1};
        if (nl_batch_forward(b, &segs[i], 1, err) != NL_OK ||
            nl_sampler_next(&smp[i], be, nl_batch_logits_device(b, 0), host, &next[i], err) !=
                NL_OK)
            goto out;
    }
    uint64_t h = 1469598103934665603ull;
    const uint64_t s0 = be->stats.host_syncs;
    const double t0 = now_s();
    for (int t = 0; t < tokens; t++) {
        h = (h ^ (uint64_t)(uint32_t)next[0]) * 1099511628211ull;
        for (int i = 0; i < S; i++)
            segs[i] = (nl_batch_seg){kv[i], &next[i], 1, 1};
        if (nl_batch_forward(b, segs, S, err) != NL_OK)
            goto out;
        for (int i = 0; i < S; i++) /* all S ids in one sample_rows call: one host sync */
            sp[i] = &smp[i], lg[i] = nl_batch_logits_device(b, i);
        if (nl_sampler_next_batch(sp, lg, S, be, rows, next, err) != NL_OK)
            goto out;
        for (int i = 0; i < S; i++) /* -1: on the host (NL_HOST_SAMPLING=1) */
            if (next[i] < 0 && nl_sampler_next(&smp[i], be, lg[i], host, &next[i], err) != NL_OK)
                goto out;
    }
    f->s_per_step = (now_s() - t0) / tokens;
    f->syncs = (double)(be->stats.host_syncs - s0) / tokens;
    f->ids0 = h;
    rc = be->sync(be, err) == NL_OK ? 0 : -1;
out:
    for (int i = 0; i < S; i++) {
        if (i < made)
            nl_sampler_free(&smp[i]);
        nl_kvcache_destroy(&kv[i]);
    }
    nl_batch_destroy(&b);
    return rc;
}

/* "batch_decode" (after a comma): 1, 4 and 16 sessions through the batch,
 * and batch-1 decode (decode_run, routing on the device) on a backend made
 * with NL_CUDA_ROWS=cublas, whose gemm keeps cuBLAS at a decode's rows,
 * beside the default's (fwd: the default's figure, ids as decode_run
 * hashes them). Returns 0, or -1 with err set (nothing printed). */
static int batch_report(nl_backend *be, const char *device, const nl_backend_opts *o,
                        const nl_config *cf, int tokens, const decode_fig *fwd, nl_error *err)
{
    static const int sessions[] = {1, 4, BATCH_MAX_SESSIONS};
    enum { NS = sizeof sessions / sizeof sessions[0] };
    batch_fig bf[NS];
    decode_fig cb = {0};
    nl_model *m = NULL, *mc = NULL;
    nl_backend *bc = NULL;
    int rc = -1;
    float *host = malloc((size_t)cf->vocab_size * sizeof(float));
    if (!host || nl_model_new(&m, be, cf, 0, cf->num_layers, 1, 1, err) != NL_OK ||
        nl_model_init_random(m, 1, err) != NL_OK) {
        if (err->status == NL_OK)
            nl_error_set(err, NL_ERR_NOMEM, "batch decode: out of memory");
        goto out;
    }
    for (int k = 0; k < NS; k++)
        if (batch_run(be, m, sessions[k], tokens, host, &bf[k], err) != 0)
            goto out;
    nl_model_destroy(&m); /* room for the cuBLAS backend's model */
    char keep[16] = "";
    int had = 0;
    env_swap("NL_CUDA_ROWS", "cublas", keep, sizeof keep, &had);
    const nl_status st = nl_backend_new(&bc, device, o, err);
    env_swap("NL_CUDA_ROWS", NULL, keep, sizeof keep, &had);
    static const decode_mode dev_routing = {0, 1, 1, NL_KV_FP32, 0};
    if (st != NL_OK || nl_model_new(&mc, bc, cf, 0, cf->num_layers, 1, 1, err) != NL_OK ||
        nl_model_init_random(mc, 1, err) != NL_OK ||
        decode_run(bc, mc, tokens, &dev_routing, host, &cb, err) != 0)
        goto out;
    printf(",\n  \"batch_decode\":{\"tokens\":%d,\"prompt\":64,\"runs\":[", tokens);
    for (int k = 0; k < NS; k++)
        printf("%s{\"sessions\":%d,\"ms_per_step\":%.3f,\"tokens_s\":%.1f,\"x_one\":%.2f,"
               "\"host_syncs_per_step\":%.2f}",
               k ? "," : "", sessions[k], bf[k].s_per_step * 1e3, sessions[k] / bf[k].s_per_step,
               bf[0].s_per_step * sessions[k] / bf[k].s_per_step, bf[k].syncs);
    int same = 1;
    for (int k = 1; k < NS; k++)
        same &= bf[k].ids0 == bf[0].ids0;
    printf("],\"same_ids_every_batch\":%s,\"same_ids_as_forward\":%s,"
           "\"rows_kernel_tokens_s\":%.1f,\"cublas_tokens_s\":%.1f,\"cublas_same_ids\":%s}",
           same ? "true" : "false", bf[0].ids0 == fwd->ids_hash ? "true" : "false",
           1.0 / fwd->s_per_tok, 1.0 / cb.s_per_tok,
           cb.ids_hash == fwd->ids_hash ? "true" : "false");
    rc = 0;
out:
    nl_model_destroy(&mc);
    nl_backend_destroy(&bc);
    nl_model_destroy(&m);
    free(host);
    return rc;
}
