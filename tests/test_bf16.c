/* bf16 compute (nl_backend_opts.bf16): the GEMM against FP32 on random
 * shapes, the weight copies made again after every kind of write, a
 * 20-step training run against FP32, the expert GEMMs of a routed dispatch
 * (forward and input gradient; NL_TEST_EXPECT_NO_SYNC=1 also checks that
 * they never waited for the host: on CUDA with NL_CUDA_EXPERTS=cudnn), and
 * the refusals. Also the CPU's fewer-pass paths in FP32: the fused expert
 * feed-forward (moe_ffn_* slots) and RoPE's per-position table give the
 * bits of the separate calls and of the per-row angles.
 *
 * The bound: bf16 keeps 8 significant bits, so rounding an input to
 * nearest-even changes it by a relative u = 2^-8 at most, and a product
 * of two rounded inputs by at most (2u + u^2). With FP32 accumulation over
 * K terms (at most K 2^-24 relative on the sum of magnitudes) each element
 * obeys |C - C_exact| <= (2u + u^2 + K 2^-23) sum_p |A_ip B_pj|.
 * A second, tighter check proves the inputs were rounded: against the
 * exact product of the rounded inputs only the accumulation term remains.
 *
 * Run as `test_bf16 refuse` with DNNL_MAX_CPU_ISA=AVX512_CORE (CTest does)
 * it checks that a CPU without AVX512-BF16 is refused with a clear message. */
#include "core/model/rng.h"
#include "core/train/train.h"
#include "tests/check.h"

#include <stdint.h>

static uint64_t rng_state = 777;
static float frand(void)
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) & 0xFFFFFF) / (float)0x1000000 * 2.0f - 1.0f;
}

/* the reference rounding: FP32 to bf16 (nearest, ties to even) and back */
static float round_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static nl_backend *bf16_backend(nl_error *err)
{
    nl_backend *be = NULL;
    nl_backend_opts o;
    memset(&o, 0, sizeof o);
    o.threads = 2;
    o.bf16 = 1;
    return nl_backend_new(&be, check_device(), &o, err) == NL_OK ? be : NULL;
}

/* ---------------------------------------------------------------- gemm */

/* C = op(A) op(B) (+ C0 when beta = 1) on be; returns the worst ratio of
 * the error to the bound (and of the error against the rounded inputs to
 * the accumulation bound in *acc_ratio). */
static double gemm_case(nl_backend *be, int ta, int tb, int M, int N, int K, float beta,
                        double *acc_ratio)
{
    const int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 1, ldc = N + 2;
    const size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb;
    const size_t nc = (size_t)M * ldc;
    float *a = malloc(na * sizeof *a), *b = malloc(nb * sizeof *b), *c = malloc(nc * sizeof *c);
    for (size_t i = 0; i < na; i++)
        a[i] = frand() * 4.0f;
    for (size_t i = 0; i < nb; i++)
        b[i] = frand();
    for (size_t i = 0; i < nc; i++)
        c[i] = frand();
    float *da = be->alloc(be, na * 4), *db = be->alloc(be, nb * 4), *dc = be->alloc(be, nc * 4);
    be->upload(be, da, a, na * 4);
    be->upload(be, db, b, nb * 4);
    be->upload(be, dc, c, nc * 4);
    be->gemm(be, ta, tb, M, N, K, 1.0f, da, lda, db, ldb, beta, dc, ldc);
    float *got = check_download(be, dc, nc);
    const double u = 1.0 / 256, acc = K * 0x1p-23;
    double worst = 0.0;
    *acc_ratio = 0.0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double exact = 0.0, rounded = 0.0, mag = 0.0;
            for (int p = 0; p < K; p++) {
                const float x = ta ? a[(size_t)p * lda + i] : a[(size_t)i * lda + p];
                const float y = tb ? b[(size_t)j * ldb + p] : b[(size_t)p * ldb + j];
                exact += (double)x * y;
                rounded += (double)round_bf16(x) * round_bf16(y);
                mag += fabs((double)x * y);
            }
            const double c0 = beta != 0.0f ? c[(size_t)i * ldc + j] : 0.0;
            const double g = got[(size_t)i * ldc + j] - c0;
            const double floor = 1e-30 + fabs(c0) * 0x1p-23; /* the beta term's own rounding */
            const double r1 = fabs(g - exact) / ((2 * u + u * u + acc) * mag + floor);
            const double r2 = fabs(g - rounded) / (acc * mag + floor);
            worst = r1 > worst ? r1 : worst;
            *acc_ratio = r2 > *acc_ratio ? r2 : *acc_ratio;
        }
    be->free(be, da);
    be->free(be, db);
    be->free(be, dc);
    free(a);
    free(b);
    free(c);
    free(got);
    return worst;
}

static void test_gemm_shapes(nl_backend *be)
{
    static const int shapes[][3] = {{1, 1, 1},    {7, 5, 3},      {33, 65, 17},  {64, 64, 64},
                                    {1, 300, 96}, {130, 10, 513}, {256, 96, 200}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 4; t++) {
            const int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
            double acc = 0.0;
            const double r = gemm_case(be, t & 1, t >> 1, M, N, K, s % 2 ? 1.0f : 0.0f, &acc);
            CHECK(r <= 1.0, "gemm %dx%dx%d ta=%d tb=%d: error %.3g of the bf16 bound", M, N, K,
                  t & 1, t >> 1, r);
            CHECK(acc <= 1.0, "gemm %dx%dx%d ta=%d tb=%d: inputs not rounded to bf16 (%.3g)", M, N,
                  K, t & 1, t >> 1, acc);
        }
}

/* ---------------------------------------------------------------- routed grouped GEMMs */

/* Worst error of C (rows x n, row stride n) over the bound of the product
 * of the rounded operands: FP32 accumulation (K 2^-23) plus one bf16
 * rounding of the result (2^-8), where a device writes it through bf16.
 * b(g, p, j) gives expert g's operand; off the offsets (groups + 1). */
static double grouped_err(const float *got, const float *a, int K, int n, const int32_t *off,
                          int groups, const float *w, size_t b_stride, int trans_b)
{
    double worst = 0.0;
    for (int g = 0; g < groups; g++)
        for (int r = off[g]; r < off[g + 1]; r++)
            for (int j = 0; j < n; j++) {
                double s = 0.0, mag = 0.0;
                for (int p = 0; p < K; p++) {
                    /* trans_b: B_g (n, K) rows of K; else (K, n) rows of n */
                    const float b =
                        w[g * b_stride + (trans_b ? (size_t)j * K + p : (size_t)p * n + j)];
                    const double t = (double)round_bf16(a[(size_t)r * K + p]) * round_bf16(b);
                    s += t;
                    mag += fabs(t);
                }
                const double bound = K * 0x1p-23 * mag + 0x1p-8 * fabs(s) + 1e-30;
                const double e = fabs(got[(size_t)r * n + j] - s) / bound;
                worst = e > worst || e != e ? e : worst;
            }
    return worst;
}

/* The expert GEMMs of a routed dispatch (moe_route's device offsets, two
 * experts never chosen), forward (x W^T) and input gradient (dY W), with
 * enough rows to take a device's many-row path (on CUDA with
 * NL_CUDA_EXPERTS=cudnn, cuDNN's grouped matmul, which must not wait for
 * the host: NL_TEST_EXPECT_NO_SYNC=1 makes that a check). */
static void test_grouped_routed(nl_backend *be)
{
    nl_error err = {0};
    const int N = 96, E = 8, k = 2, K = 64, F = 48, R = N * k;
    const size_t bs = (size_t)F * K + 8; /* expert stride, padded */
    float *probs = malloc((size_t)N * E * 4), *w = malloc(E * bs * 4);
    float *x = malloc((size_t)R * K * 4), *dy = malloc((size_t)R * F * 4);
    for (int i = 0; i < N * E; i++)
        probs[i] = (i % E == 2 || i % E == 7) ? 0.0f : frand() + 1.5f;
    for (size_t i = 0; i < E * bs; i++)
        w[i] = frand();
    for (int i = 0; i < R * K; i++)
        x[i] = frand() * 4.0f;
    for (int i = 0; i < R * F; i++)
        dy[i] = frand();
    float *dp = be->alloc(be, (size_t)N * E * 4), *dw = be->alloc(be, E * bs * 4);
    float *dwt = be->alloc(be, (size_t)R * 4), *dx = be->alloc(be, (size_t)R * K * 4);
    float *ddy = be->alloc(be, (size_t)R * F * 4), *dc = be->alloc(be, (size_t)R * F * 4);
    float *ddx = be->alloc(be, (size_t)R * K * 4);
    int32_t *ch = be->alloc(be, (size_t)R * 4), *perm = be->alloc(be, (size_t)R * 4);
    int32_t *slot = be->alloc(be, (size_t)R * 4), *doff = be->alloc(be, (E + 1) * 4);
    be->upload(be, dp, probs, (size_t)N * E * 4);
    be->upload(be, dw, w, E * bs * 4);
    be->upload(be, dx, x, (size_t)R * K * 4);
    be->upload(be, ddy, dy, (size_t)R * F * 4);
    CHECK_OK(be->bf16_weights(be, dw, E * bs, &err), &err);
    be->moe_route(be, ch, dwt, doff, perm, slot, dp, N, E, k);
    const uint64_t syncs = be->stats.host_syncs;
    be->gemm_grouped(be, 1, F, K, dx, K, dw, K, bs, dc, F, doff, E, N);
    /* dY W: B_g (F, K) as stored is the (K', N') = (F, K) operand */
    be->gemm_grouped(be, 0, K, F, ddy, F, dw, K, bs, ddx, K, doff, E, N);
    const uint64_t waited = be->stats.host_syncs - syncs;
    int32_t off[9];
    be->download(be, off, doff, sizeof off);
    float *c = check_download(be, dc, (size_t)R * F), *gx = check_download(be, ddx, (size_t)R * K);
    CHECK(off[0] == 0 && off[E] == R && off[3] == off[2] && off[8] == off[7],
          "routing: offsets %d..%d, experts 2 and 7 not empty", off[0], off[E]);
    const double ef = grouped_err(c, x, K, F, off, E, w, bs, 1);
    const double eb = grouped_err(gx, dy, F, K, off, E, w, bs, 0);
    CHECK(ef <= 1.0, "routed gemm_grouped x W^T: error %.3g of the bf16 bound", ef);
    CHECK(eb <= 1.0, "routed gemm_grouped dY W: error %.3g of the bf16 bound", eb);
    const char *ns = getenv("NL_TEST_EXPECT_NO_SYNC");
    printf("test_bf16: routed grouped GEMMs (%d rows): %llu host waits\n", R,
           (unsigned long long)waited);
    if (ns && strcmp(ns, "1") == 0)
        CHECK(waited == 0, "routed grouped GEMMs waited for the host %llu times",
              (unsigned long long)waited);
    CHECK_OK(be->bf16_weights(be, dw, 0, &err), &err);
    free(c);
    free(gx);
    free(probs);
    free(w);
    free(x);
    free(dy);
    void *bufs[] = {dp, dw, dwt, dx, ddy, dc, ddx, ch, perm, slot, doff};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        be->free(be, bufs[i]);
}

/* The weight copy follows every write: upload, zero, adamw, write_back. */
static void test_weight_copy(nl_backend *be)
{
    enum { R = 24, C = 40, N = 9 };
    nl_error err = {0};
    float *w = be->alloc(be, R * C * 4), *x = be->alloc(be, N * C * 4);
    float *y = be->alloc(be, N * R * 4), *g = be->alloc(be, R * C * 4);
    float *m = be->alloc(be, R * C * 4), *v = be->alloc(be, R * C * 4);
    float hw[R * C], hx[N * C], hg[R * C];
    for (int i = 0; i < R * C; i++) {
        hw[i] = frand();
        hg[i] = frand();
    }
    for (int i = 0; i < N * C; i++)
        hx[i] = frand();
    be->upload(be, x, hx, sizeof hx);
    be->upload(be, g, hg, sizeof hg);
    be->upload(be, w, hw, sizeof hw);
    CHECK_OK(be->bf16_weights(be, w, R * C, &err), &err);
    for (int round = 0; round < 4; round++) {
        if (round == 1) { /* an upload of new weights */
            for (int i = 0; i < R * C; i++)
                hw[i] = frand();
            be->upload(be, w, hw, sizeof hw);
        } else if (round == 2) { /* an optimizer step */
            be->adamw(be, w, g, m, v, R * C, 0.1f, 0.9f, 0.95f, 1e-8f, 0.0f, 0.1f, 0.05f, 1.0f);
            be->download(be, hw, w, sizeof hw);
        } else if (round == 3) { /* host code writing through a write view */
            nl_host_stage st = {0};
            float *view = nl_backend_write_view(be, &st, w, sizeof hw, &err);
            for (int i = 0; view && i < R * C; i++)
                view[i] = hw[i] = frand();
            if (view)
                nl_backend_write_back(be, w, view, sizeof hw);
            nl_host_stage_free(&st);
        }
        be->gemm(be, 0, 1, N, R, C, 1.0f, x, C, w, C, 0.0f, y, R);
        float *got = check_download(be, y, N * R);
        double worst = 0.0;
        for (int n = 0; n < N; n++)
            for (int r = 0; r < R; r++) {
                double want = 0.0, mag = 0.0;
                for (int k = 0; k < C; k++) {
                    want += (double)round_bf16(hx[n * C + k]) * round_bf16(hw[r * C + k]);
                    mag += fabs((double)hx[n * C + k] * hw[r * C + k]);
                }
                const double e = fabs(got[n * R + r] - want) / (C * 0x1p-23 * mag + 1e-30);
                worst = e > worst ? e : worst;
            }
        CHECK(worst <= 1.0, "round %d: the bf16 copy of the weights is stale (%.3g)", round, worst);
        free(got);
    }
    CHECK_OK(be->bf16_weights(be, w, 0, &err), &err);
    void *dev[] = {w, x, y, g, m, v};
    for (int i = 0; i < 6; i++)
        be->free(be, dev[i]);
}

/* ---------------------------------------------------------------- training */

static nl_config small_config(void)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = 64;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.ffn_dim = 48;
    c.num_experts = 4;
    c.vocab_size = 64;
    c.vocab_chunk = 64;
    c.max_seq_len = 64;
    c.aux_loss_coef = 0.01;
    nl_config_fill_derived(&c);
    return c;
}

/* 20 steps of a copy-like task (target = next token of a repeating
 * sequence) from the same seed; losses into loss[]. */
static void train20(nl_backend *be, double *loss)
{
    enum { B = 4, T = 32, STEPS = 20 };
    nl_config c = small_config();
    nl_error err = {0};
    nl_model *m = NULL;
    nl_trainer *t = NULL;
    CHECK_OK(nl_model_new(&m, be, &c, 0, c.num_layers, 1, 1, &err), &err);
    if (m)
        CHECK_OK(nl_model_init_random(m, 11, &err), &err);
    if (m)
        CHECK_OK(nl_trainer_new(&t, m, B * T, 1, 0, &err), &err);
    nl_rng r;
    nl_rng_seed(&r, 3, 0);
    int32_t tok[B * T + 1];
    for (int s = 0; t && s < STEPS; s++) {
        for (int i = 0; i <= B * T; i++)
            tok[i] = (int32_t)((i * 7 + nl_rng_below(&r, 3)) % c.vocab_size);
        nl_step_result res;
        CHECK_OK(nl_trainer_step_local(t, tok, tok + 1, B, T, 1, 3e-3f, 1.0f, nl_adamw_defaults(),
                                       &res, &err),
                 &err);
        loss[s] = res.loss;
    }
    nl_trainer_destroy(&t);
    nl_model_destroy(&m);
}

static void test_training(nl_backend *be16)
{
    nl_error err = {0};
    nl_backend *be32 = NULL;
    CHECK_OK(check_backend_new(&be32, 2, &err), &err);
    if (!be32)
        return;
    double l32[20] = {0}, l16[20] = {0}, worst = 0.0;
    train20(be32, l32);
    train20(be16, l16);
    for (int s = 0; s < 20; s++) {
        const double rel = fabs(l16[s] - l32[s]) / fabs(l32[s]);
        worst = rel > worst ? rel : worst;
        CHECK(rel <= 1e-2, "step %d: bf16 loss %.6f, fp32 %.6f (%.2g relative)", s, l16[s], l32[s],
              rel);
    }
    CHECK(l32[19] < l32[0] - 0.1, "fp32 did not learn: %.4f -> %.4f", l32[0], l32[19]);
    CHECK(worst > 0.0, "bf16 losses equal fp32's to the bit: bf16 not in use?");
    printf("20 steps: fp32 %.4f -> %.4f, bf16 %.4f -> %.4f, worst relative %.2g\n", l32[0], l32[19],
           l16[0], l16[19], worst);
    nl_backend_destroy(&be32);
}

/* ---------------------------------------------------------------- fused paths */

/* 3 training steps with the fused expert slots and without: the same bits
 * in every parameter (forward, backward and optimizer all went through). */
static void test_fused_experts(void)
{
    enum { B = 3, T = 20 };
    nl_error err = {0};
    nl_backend *be[2] = {NULL, NULL};
    float *params[2] = {NULL, NULL};
    size_t n = 0;
    nl_config c = small_config();
    c.top_k = 2;
    for (int v = 0; v < 2; v++) {
        CHECK_OK(check_backend_new(&be[v], 2, &err), &err);
        if (!be[v])
            return;
        if (v == 0 && !(be[0]->moe_ffn_forward && be[0]->moe_ffn_backward)) {
            /* optional slots (the CUDA backend has none): nothing to compare */
            printf("fused expert slots: %s has none, skipped\n", be[0]->name);
            nl_backend_destroy(&be[0]);
            return;
        }
        if (v == 1) { /* the separate calls */
            be[v]->moe_ffn_forward = NULL;
            be[v]->moe_ffn_backward = NULL;
        }
        nl_model *m = NULL;
        nl_trainer *t = NULL;
        CHECK_OK(nl_model_new(&m, be[v], &c, 0, c.num_layers, 1, 1, &err), &err);
        if (m)
            CHECK_OK(nl_model_init_random(m, 21, &err), &err);
        if (m)
            CHECK_OK(nl_trainer_new(&t, m, B * T, 1, 0, &err), &err);
        nl_rng r;
        nl_rng_seed(&r, 8, 0);
        int32_t tok[B * T + 1];
        for (int s = 0; t && s < 3; s++) {
            for (int i = 0; i <= B * T; i++)
                tok[i] = (int32_t)nl_rng_below(&r, (uint64_t)c.vocab_size);
            nl_step_result res;
            CHECK_OK(nl_trainer_step_local(t, tok, tok + 1, B, T, 1, 1e-2f, 1.0f,
                                           nl_adamw_defaults(), &res, &err),
                     &err);
        }
        if (m) {
            n = m->n_params;
            params[v] = check_download(be[v], m->params, n);
        }
        nl_trainer_destroy(&t);
        nl_model_destroy(&m);
    }
    CHECK(params[0] && params[1] && memcmp(params[0], params[1], n * sizeof(float)) == 0,
          "fused expert feed-forward: parameters after 3 steps differ from the separate calls'");
    for (int v = 0; v < 2; v++) {
        free(params[v]);
        nl_backend_destroy(&be[v]);
    }
}

/* RoPE: positions repeated (the table path) against the same rows with
 * positions spread too far for a table (the per-row path): same bits. */
static void test_rope_table(void)
{
    enum { N = 48, HD = 32, HEADS = 3, ROW = HEADS * HD + 5 };
    nl_error err = {0};
    nl_backend *be = NULL;
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    if (!be)
        return;
    float hx[N * ROW];
    int32_t pos[N], far[2];
    for (int i = 0; i < N * ROW; i++)
        hx[i] = frand();
    for (int n = 0; n < N; n++)
        pos[n] = 1000 + n % 7; /* 7 distinct positions in 48 rows */
    float *x = be->alloc(be, sizeof hx), *y = be->alloc(be, 2 * ROW * sizeof(float));
    int32_t *pd = be->alloc(be, sizeof pos), *fd = be->alloc(be, sizeof far);
    be->upload(be, x, hx, sizeof hx);
    be->upload(be, pd, pos, sizeof pos);
    be->rope_forward(be, x, pd, N, ROW, 2, HEADS, HD, 10000.0f);
    float *tab = check_download(be, x, N * ROW);
    int same = 1;
    for (int n = 0; n < N; n++) { /* row n next to a row at position 0: no table */
        far[0] = pos[n];
        far[1] = 0;
        be->upload(be, fd, far, sizeof far);
        be->upload(be, y, hx + (size_t)n * ROW, ROW * sizeof(float));
        be->upload(be, y + ROW, hx, ROW * sizeof(float));
        be->rope_forward(be, y, fd, 2, ROW, 2, HEADS, HD, 10000.0f);
        float *row = check_download(be, y, ROW);
        same &= memcmp(row, tab + (size_t)n * ROW, ROW * sizeof(float)) == 0;
        free(row);
    }
    CHECK(same, "RoPE: the per-position table changed some bits");
    free(tab);
    void *dev[] = {x, y, pd, fd};
    for (int i = 0; i < 4; i++)
        be->free(be, dev[i]);
    nl_backend_destroy(&be);
}

/* ---------------------------------------------------------------- refusals */

/* bf16 on cuda:0 is refused only for want of a device (or of compute
 * capability 8.0), never as unimplemented; with one it computes in bf16 */
static void test_refusals(void)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_backend_opts o = {.bf16 = 1};
    nl_status st = nl_backend_new(&be, "cuda:0", &o, &err);
    CHECK(st == NL_OK ? be->bf16 == 1 && be->bf16_weights && be->wrote
                      : st == NL_ERR_UNSUPPORTED && !strstr(err.msg, "not implemented"),
          "cuda:0 bf16: %s: %s", nl_status_str(st), err.msg);
    nl_backend_destroy(&be);
}

int main(int argc, char **argv)
{
    nl_error err = {0};
    test_refusals();
    test_fused_experts();
    test_rope_table();
    if (argc > 1 && strcmp(argv[1], "refuse") == 0) {
        /* DNNL_MAX_CPU_ISA=AVX512_CORE: oneDNN reports no bf16 */
        nl_backend *be = bf16_backend(&err);
        CHECK(!be && err.status == NL_ERR_UNSUPPORTED && strstr(err.msg, "AVX512-BF16"),
              "refusal: %s", err.msg);
        nl_backend_destroy(&be);
        return check_done("test_bf16 refuse");
    }
    nl_backend *be = bf16_backend(&err);
    if (!be && err.status == NL_ERR_UNSUPPORTED) {
        printf("test_bf16: skipped (%s)\n", err.msg);
        return 77;
    }
    CHECK(be != NULL, "%s", err.msg);
    if (!be)
        return check_done("test_bf16");
    CHECK(be->bf16 == 1 && be->bf16_weights != NULL, "bf16 backend without its slots");
    test_gemm_shapes(be);
    test_grouped_routed(be);
    test_weight_copy(be);
    test_training(be);
    nl_backend_destroy(&be);
    return check_done("test_bf16");
}
