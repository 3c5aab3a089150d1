/* The CUDA backend's throughput against the device's spec sheet, as one
 * JSON object on stdout:
 *   - cuBLAS SGEMM (through the backend's gemm slot) at 4096^3 and at the
 *     shapes of a model config (default configs/bench-large.yaml): the fused
 *     QKV projection, Wo, one expert's gate|up and down at N k / E rows (the
 *     rows an expert gets on average), the head; each at N prefill rows and
 *     at one decode row; in FP32 and with TF32 allowed; GFLOP/s and the
 *     fraction of the spec FP32 peak;
 *   - memory-bound kernels (rmsnorm, softmax over the vocabulary, swiglu,
 *     gather_rows, copy_rows, moe_combine) at the same sizes: GB/s of the
 *     bytes each must move, and the fraction of the spec bandwidth;
 *   - the sample_rows slot alone ("sample"): microseconds a call, the ids
 *     back on the host, for 1 and 16 rows of the config's vocabulary and of
 *     131072 ids, greedy, temperature 0.8 and top-p 0.95 (kernels/elem.h's
 *     rule; a top-p row searches its threshold): what sampling adds to a
 *     decode token, and what the top-p search costs over plain sampling;
 *   - where a decode token's time goes: the model (random init) decodes
 *     --decode-tokens tokens after a 64-token prompt, one at a time, with
 *     routing on the device (each step replayed from a recorded CUDA
 *     graph, core/model/forward.h), again without graphs (every op launched;
 *     the ids must be the same), and with NL_HOST_ROUTING=1 (per layer the
 *     router probabilities down and the dispatch tables up, the expert
 *     GEMMs sized on the host): tokens/s and host synchronisations per
 *     token of each; then the copies every token makes (token and position
 *     up, logits down) timed alone; the rest of a device-routed token's
 *     time is the kernels and their launches. Again with and without graphs
 *     with NL_FUSED=0 (the separate slots in place of the fused decode
 *     ones, issue 29), and the op slot calls (launches) of one token each
 *     way, counted by a wrapper of the backend's table;
 *   - the decode against the memory bound ("decode_bound"): the bytes a
 *     token reads at least (its weights once, from their bf16 copies with
 *     --precision bf16; the KV cache at the run's mean context) over the
 *     device's copy bandwidth, measured in the same run (copy_rows over 256
 *     MiB): the limit in tokens/s and the fraction of it the device-routed
 *     decode reaches, with the FP32 and the bf16 KV cache;
 *   - batched decode (core/model/batch.c, a stage's path): 1, 4 and 16
 *     sessions decoded together, aggregate tokens/s, and whether session
 *     0's greedy ids are the same in every batch (row invariance); and
 *     batch-1 decode with gemm's decode rows on cuBLAS (NL_CUDA_ROWS=cublas)
 *     beside the gemm_rows kernel the default runs there.
 * Spec FP32 peak = SMs x clock (cudaDevAttrClockRate) x FP32 lanes per SM
 * (by compute capability: sm_75/sm_80 64, sm_86/89/90 and later 128) x 2;
 * spec bandwidth = memory clock x bus width x 2 (double data rate).
 * The timed work goes through nl_backend_new("cuda:N"); cudart is linked
 * only to read the device attributes. Without a usable device it prints
 * the backend's message and exits 77.
 * Run: build/bench/bench_cuda [--config CFG] [--rows N] [--device cuda:N]
 * [--precision fp32|bf16] [--decode-only] (--device cpu is a dry run of the
 * harness with the spec figures at 0; --precision is the decode's, the
 * GEMM and memory parts stay FP32 and TF32; --decode-only skips them and
 * the batched decode).
 * This file has the device, the GEMM and memory-bound parts and main; the
 * decode split and batched decode are bench_cuda_decode.c's. */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/args.h"
#include "bench/bench_cuda.h"
#include "core/model/config.h"
#include "kernels/backend.h"

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---------------------------------------------------------------- device */

typedef struct spec {
    char name[256];
    int major, minor, sms, lanes, lanes_known;
    double clock_mhz, mem_clock_mhz, bus_bits;
    double fp32_gflops, gbs;
} spec;

/* FP32 lanes per SM by compute capability (CUDA C programming guide,
 * "arithmetic instructions" throughput table). */
static int fp32_lanes(int major, int minor, int *known)
{
    *known = 1;
    if (major == 7 || (major == 8 && minor == 0))
        return 64;
    if (major == 8 || major == 9 || major == 10 || major == 12)
        return 128;
    *known = 0;
    return 128;
}

static int read_spec(int dev, spec *s)
{
    int clock = 0, mem_clock = 0, bus = 0;
    struct cudaDeviceProp p;
    memset(s, 0, sizeof *s);
    if (cudaGetDeviceProperties(&p, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&s->major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&s->minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&s->sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&clock, cudaDevAttrClockRate, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&mem_clock, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess)
        return -1;
    snprintf(s->name, sizeof s->name, "%s", p.name);
    for (char *c = s->name; *c; c++)
        if (*c == '"' || *c == '\\')
            *c = ' ';
    s->lanes = fp32_lanes(s->major, s->minor, &s->lanes_known);
    s->clock_mhz = clock / 1e3;
    s->mem_clock_mhz = mem_clock / 1e3;
    s->bus_bits = bus;
    s->fp32_gflops = s->sms * s->clock_mhz * 1e6 * s->lanes * 2.0 / 1e9;
    s->gbs = s->mem_clock_mhz * 1e6 * (s->bus_bits / 8.0) * 2.0 / 1e9;
    return 0;
}

/* ---------------------------------------------------------------- timing */

typedef struct job {
    const char *name;
    int kind;          /* 0 gemm, else a memory-bound op */
    int M, N, K;       /* gemm: C[M,N] = A[M,K] B[N,K]^T, as y = x W^T */
    int rows, cols, k; /* memory ops; sample: rows of cols ids at a */
    float *a, *b, *c, *w;
    int32_t *idx;
    double bytes;
    float temperature, top_p; /* sample */
} job;

enum { GEMM, RMSNORM, SOFTMAX, SWIGLU, GATHER, COPY, COMBINE, SAMPLE };

#define SAMPLE_MAX_ROWS 16

static void sample(nl_backend *be, const job *j)
{
    nl_sample_row r[SAMPLE_MAX_ROWS];
    int32_t ids[SAMPLE_MAX_ROWS];
    for (int i = 0; i < j->rows; i++)
        r[i] = (nl_sample_row){.logits = j->a + (size_t)i * j->cols,
                               .temperature = j->temperature,
                               .top_p = j->top_p,
                               .u = j->temperature > 0.0f ? (i + 0.5) / (j->rows + 1.0) : 0.0};
    be->sample_rows(be, ids, r, j->rows, j->cols);
}

static void run(nl_backend *be, const job *j)
{
    switch (j->kind) {
    case GEMM:
        be->gemm(be, 0, 1, j->M, j->N, j->K, 1.0f, j->a, j->K, j->b, j->K, 0.0f, j->c, j->N);
        break;
    case RMSNORM:
        be->rmsnorm_forward(be, j->c, j->w, j->a, j->b, j->rows, j->cols, 1e-6f);
        break;
    case SOFTMAX:
        be->softmax_forward(be, j->a, j->rows, j->cols);
        break;
    case SWIGLU:
        be->swiglu_forward(be, j->c, j->a, j->rows, j->cols);
        break;
    case GATHER:
        be->gather_rows(be, j->c, j->a, j->idx, j->rows, j->cols);
        break;
    case COPY:
        be->copy_rows(be, j->c, j->cols, j->a, j->cols, j->rows, j->cols);
        break;
    case COMBINE:
        be->moe_combine(be, j->c, j->a, j->idx, j->w, j->rows, j->k, j->cols);
        break;
    case SAMPLE:
        sample(be, j);
        break;
    }
}

/* Seconds per call: one warm-up, one timed call to size the loop, then
 * enough calls for about 0.3 s between two syncs. < 0 on a device error. */
static double time_job(nl_backend *be, const job *j, nl_error *err)
{
    run(be, j);
    if (be->sync(be, err) != NL_OK)
        return -1.0;
    double t0 = now_s();
    run(be, j);
    if (be->sync(be, err) != NL_OK)
        return -1.0;
    double one = now_s() - t0;
    int reps = one > 0.0 ? (int)(0.3 / one) : 1000;
    reps = reps < 3 ? 3 : reps > 20000 ? 20000 : reps;
    t0 = now_s();
    for (int i = 0; i < reps; i++)
        run(be, j);
    if (be->sync(be, err) != NL_OK)
        return -1.0;
    return (now_s() - t0) / reps;
}

/* The sample_rows slot alone: SAMPLE_MAX_ROWS rows of V logits (a
 * spread like a model's: a few far above the rest), 1 and all rows of
 * each vocabulary, greedy, temperature and top-p; one JSON member each.
 * 0, or -1 on a device error (the array is closed either way). */
static int sample_report(nl_backend *be, int config_vocab, nl_error *err)
{
    const int vocabs[2] = {config_vocab, 131072};
    const struct {
        const char *name;
        float t, p;
    } modes[3] = {{"greedy", 0.0f, 0.0f}, {"temperature", 0.8f, 1.0f}, {"top_p", 0.8f, 0.95f}};
    int rc = 0, first = 1;
    printf(",\n  \"sample\":[");
    for (int v = 0; v < 2 && rc == 0; v++) {
        const int V = vocabs[v];
        const size_t n = (size_t)SAMPLE_MAX_ROWS * (size_t)V;
        float *h = malloc(n * sizeof *h), *dl = be->alloc(be, n * sizeof *dl);
        if (!h || !dl) {
            free(h);
            be->free(be, dl);
            printf("\n  ]");
            nl_error_set(err, NL_ERR_NOMEM, "sample: %zu logits", n);
            return -1;
        }
        uint64_t x = 0x9E3779B97F4A7C15ull + (uint64_t)V;
        for (size_t i = 0; i < n; i++) { /* xorshift: the sum of 4 uniforms, x 3, a tail */
            float g = 0.0f;
            for (int k = 0; k < 4; k++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                g += (float)(x >> 40) / (float)(1u << 24);
            }
            h[i] = 3.0f * (g - 2.0f) + ((x & 1023) == 0 ? 12.0f : 0.0f);
        }
        be->upload(be, dl, h, n * sizeof *h);
        free(h);
        for (int rows = 1; rows <= SAMPLE_MAX_ROWS && rc == 0; rows *= SAMPLE_MAX_ROWS)
            for (int m = 0; m < 3; m++) {
                const job j = {.name = modes[m].name,
                               .kind = SAMPLE,
                               .rows = rows,
                               .cols = V,
                               .a = dl,
                               .temperature = modes[m].t,
                               .top_p = modes[m].p};
                const double t = time_job(be, &j, err);
                if (t < 0) {
                    rc = -1;
                    break;
                }
                printf("%s\n    {\"mode\":\"%s\",\"rows\":%d,\"vocab\":%d,\"us\":%.1f}",
                       first ? "" : ",", j.name, rows, V, t * 1e6);
                first = 0;
            }
        be->free(be, dl);
    }
    printf("\n  ]");
    return rc;
}

/* ---------------------------------------------------------------- jobs */

/* Device buffers for the largest job, shared by all (contents are zeros
 * or whatever the last job left: the timings do not depend on values,
 * and zeros keep every op finite). */
typedef struct arena {
    float *a, *b, *c, *w;
    int32_t *idx;
} arena;

static int arena_new(nl_backend *be, arena *ar, size_t floats, size_t nidx)
{
    memset(ar, 0, sizeof *ar);
    ar->a = be->alloc(be, floats * 4);
    ar->b = be->alloc(be, floats * 4);
    ar->c = be->alloc(be, floats * 4);
    ar->w = be->alloc(be, floats * 4);
    ar->idx = be->alloc(be, nidx * 4);
    int32_t *h = malloc(nidx * 4);
    if (!ar->a || !ar->b || !ar->c || !ar->w || !ar->idx || !h) {
        free(h);
        return -1;
    }
    for (size_t i = 0; i < nidx; i++)
        h[i] = (int32_t)i; /* identity dispatch: every slot once */
    be->upload(be, ar->idx, h, nidx * 4);
    free(h);
    return 0;
}

static void arena_free(nl_backend *be, arena *ar)
{
    be->free(be, ar->a);
    be->free(be, ar->b);
    be->free(be, ar->c);
    be->free(be, ar->w);
    be->free(be, ar->idx);
}

static job gemm_job(const char *name, int M, int N, int K, const arena *ar)
{
    job j = {
        .name = name, .kind = GEMM, .M = M, .N = N, .K = K, .a = ar->a, .b = ar->b, .c = ar->c};
    return j;
}

/* The model's GEMMs at `rows` tokens; experts at rows k / E. */
static int model_gemms(const nl_config *cf, int rows, const arena *ar, job *out, const char **names)
{
    const int d = cf->hidden_dim, hd = nl_config_head_dim(cf), H = cf->num_heads;
    const int G = cf->num_kv_heads, F = cf->ffn_dim, V = (int)cf->vocab_size;
    int ex = (int)((long long)rows * cf->top_k / cf->num_experts);
    ex = ex < 1 ? 1 : ex;
    out[0] = gemm_job(names[0], rows, (H + 2 * G) * hd, d, ar);
    out[1] = gemm_job(names[1], rows, d, H * hd, ar);
    out[2] = gemm_job(names[2], ex, 2 * F, d, ar);
    out[3] = gemm_job(names[3], ex, d, F, ar);
    out[4] = gemm_job(names[4], rows, V, d, ar);
    return 5;
}

/* A memory-bound op over the arena's buffers: it reads and writes `bytes`. */
static job mem_job(const char *name, int kind, int rows, int cols, double bytes, const arena *ar)
{
    job j = {.name = name, .kind = kind, .rows = rows, .cols = cols, .bytes = bytes};
    j.a = ar->a; /* input */
    j.b = ar->b; /* weights */
    j.c = ar->c; /* output */
    j.w = ar->w; /* rstd, combine weights */
    j.idx = ar->idx;
    return j;
}

/* The model's memory-bound ops at `rows` tokens (rows k expert rows). */
static int memory_jobs(const nl_config *cf, int rows, const arena *ar, job *out)
{
    const double d = cf->hidden_dim, V = (double)cf->vocab_size, F = cf->ffn_dim;
    const int nk = rows * cf->top_k, n = rows;
    out[0] = mem_job("rmsnorm", RMSNORM, n, (int)d, 4 * (2 * n * d + d + n), ar);
    out[1] = mem_job("softmax_vocab", SOFTMAX, n, (int)V, 4 * 2 * n * V, ar);
    out[2] = mem_job("swiglu", SWIGLU, nk, (int)F, 4 * 3 * nk * F, ar);
    out[3] = mem_job("gather_rows", GATHER, nk, (int)d, 4 * (2 * nk * d + nk), ar);
    out[4] = mem_job("copy_rows", COPY, n, (int)d, 4 * 2 * n * d, ar);
    out[5] = mem_job("moe_combine", COMBINE, n, (int)d, 4 * (2 * n * d + nk * d + 2 * nk), ar);
    out[5].k = cf->top_k;
    return 6;
}

/* ---------------------------------------------------------------- main */

static void print_gemm(const job *j, double fp32_s, double tf32_s, const spec *s, int first)
{
    const double flop = 2.0 * j->M * (double)j->N * j->K;
    const double g32 = flop / fp32_s / 1e9, g19 = tf32_s > 0 ? flop / tf32_s / 1e9 : 0.0;
    const double peak = s->fp32_gflops > 0 ? s->fp32_gflops : INFINITY;
    printf("%s\n    {\"name\":\"%s\",\"M\":%d,\"N\":%d,\"K\":%d,\"fp32_gflops\":%.1f,"
           "\"fp32_frac\":%.3f,\"tf32_gflops\":%.1f,\"tf32_over_fp32_peak\":%.3f}",
           first ? "" : ",", j->name, j->M, j->N, j->K, g32, g32 / peak, g19, g19 / peak);
}

int main(int argc, char **argv)
{
    nl_flag flags[] = {
        {"config", 1, "model config (default configs/bench-large.yaml)", NULL},
        {"rows", 1, "prefill tokens N (default 2048: 8 sequences of 256)", NULL},
        {"device", 1, "CUDA device (default cuda:0; cpu: a dry run)", NULL},
        {"square", 1, "size of the square SGEMM (default 4096)", NULL},
        {"decode-tokens", 1, "tokens of the decode split (default 64; 0: skip)", NULL},
        {"precision", 1,
         "the decode's GEMM precision, fp32 (default) or bf16 (the weights' bf16 copies; the "
         "GEMM and memory parts stay FP32/TF32)",
         NULL},
        {"decode-only", 0,
         "the decode split and its memory bound only (no GEMM, memory-bound or batched decode "
         "parts)",
         NULL},
        {"decode-batch", 0, "with --decode-only: the batched decode part too", NULL},
        {0}};
    const char *usage = "bench_cuda [--config CFG.yaml] [--rows N] [--device cuda:N] [--square M] "
                        "[--decode-tokens N] [--precision fp32|bf16] [--decode-only "
                        "[--decode-batch]]";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *cfg_path = nl_args_get(flags, "config"), *device = nl_args_get(flags, "device");
    long long rows = 2048, sq = 4096, dtok = 64;
    if ((rc = nl_args_int(flags, "rows", 1, 1 << 20, &rows)) ||
        (rc = nl_args_int(flags, "square", 1, 32768, &sq)) ||
        (rc = nl_args_int(flags, "decode-tokens", 0, 1 << 16, &dtok)))
        return rc;
    cfg_path = cfg_path ? cfg_path : "configs/bench-large.yaml";
    device = device ? device : "cuda:0";
    const char *prec = nl_args_get(flags, "precision");
    const int decode_only = nl_args_get(flags, "decode-only") != NULL;
    const int decode_batch = !decode_only || nl_args_get(flags, "decode-batch") != NULL;
    if (prec && strcmp(prec, "fp32") != 0 && strcmp(prec, "bf16") != 0) {
        fprintf(stderr, "bench_cuda: --precision %s: not fp32 or bf16\n", prec);
        return 2;
    }
    const nl_backend_opts dec_opts = {.bf16 = prec && strcmp(prec, "bf16") == 0};
    nl_backend *bd = NULL; /* the decode's backend where it is bf16 */
    nl_error err = {0};
    nl_config cf;
    nl_backend *be = NULL, *be32 = NULL;
    arena ar = {0}, ar32 = {0};
    spec s;
    if (nl_backend_new(&be, device, &(nl_backend_opts){.tf32 = 0}, &err) != NL_OK) {
        fprintf(stderr, "bench_cuda: %s (%s)\n", err.msg, nl_status_str(err.status));
        return 77;
    }
    rc = 1;
    memset(&s, 0, sizeof s);
    snprintf(s.name, sizeof s.name, "%s", device);
    if (strncmp(device, "cuda:", 5) == 0 && read_spec(atoi(device + 5), &s) != 0) {
        fprintf(stderr, "bench_cuda: %s: cannot read the device attributes\n", device);
        goto out;
    }
    if (nl_config_load_yaml(&cf, cfg_path, &err) != NL_OK ||
        nl_config_validate(&cf, 1, &err) != NL_OK ||
        nl_backend_new(&be32, device, &(nl_backend_opts){.tf32 = 1}, &err) != NL_OK) {
        fprintf(stderr, "bench_cuda: %s (%s)\n", err.msg, nl_status_str(err.status));
        goto out;
    }
    /* the largest job: 4096^2 per operand, or the model's widest at N rows */
    const size_t V = (size_t)cf.vocab_size, d = (size_t)cf.hidden_dim, F = (size_t)cf.ffn_dim;
    size_t floats = (size_t)sq * (size_t)sq, nk = (size_t)rows * cf.top_k;
    size_t need[] = {
        (size_t)rows * V, V * d,
        nk * 2 * F,       2 * F * d,
        nk * d,           (size_t)rows * (cf.num_heads + 2 * cf.num_kv_heads) * (d / cf.num_heads)};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        floats = need[i] > floats ? need[i] : floats;
    if (!decode_only &&
        (arena_new(be, &ar, floats, nk) != 0 || arena_new(be32, &ar32, floats, nk) != 0)) {
        fprintf(stderr, "bench_cuda: cannot allocate 2 x 5 x %zu floats on %s\n", floats, device);
        goto out;
    }
    static const char *pre[] = {"qkv", "wo", "expert_gate_up", "expert_down", "head"};
    static const char *dec[] = {"qkv_decode", "wo_decode", "expert_gate_up_decode",
                                "expert_down_decode", "head_decode"};
    job g[16], g32[16], mj[8];
    int ng = 0;
    g[ng++] = gemm_job("square", (int)sq, (int)sq, (int)sq, &ar);
    ng += model_gemms(&cf, (int)rows, &ar, g + ng, pre);
    ng += model_gemms(&cf, 1, &ar, g + ng, dec);
    for (int i = 0; i < ng; i++) {
        g32[i] = g[i];
        g32[i].a = ar32.a;
        g32[i].b = ar32.b;
        g32[i].c = ar32.c;
    }
    const int nm = memory_jobs(&cf, (int)rows, &ar, mj);

    printf("{\"device\":\"%s\",\"name\":\"%s\",\"cc\":\"%d.%d\",\"sms\":%d,\"clock_mhz\":%.0f,"
           "\"fp32_lanes_per_sm\":%d%s,\"spec_fp32_gflops\":%.0f,\"mem_clock_mhz\":%.0f,"
           "\"bus_bits\":%.0f,\"spec_gbs\":%.0f,\"config\":\"%s\",\"rows\":%lld,\n  \"gemm\":[",
           device, s.name, s.major, s.minor, s.sms, s.clock_mhz, s.lanes,
           s.lanes_known ? "" : ",\"lanes_guessed\":true", s.fp32_gflops, s.mem_clock_mhz,
           s.bus_bits, s.gbs, cfg_path, rows);
    for (int i = 0; i < ng && !decode_only; i++) {
        double t = time_job(be, &g[i], &err), t19 = t >= 0 ? time_job(be32, &g32[i], &err) : -1;
        if (t < 0 || t19 < 0)
            goto device_error;
        print_gemm(&g[i], t, t19, &s, i == 0);
    }
    printf("\n  ],\n  \"memory\":[");
    for (int i = 0; i < nm && !decode_only; i++) {
        double t = time_job(be, &mj[i], &err);
        if (t < 0)
            goto device_error;
        printf("%s\n    {\"name\":\"%s\",\"rows\":%d,\"cols\":%d,\"mbytes\":%.1f,\"us\":%.1f,"
               "\"gbs\":%.1f,\"frac\":%.3f}",
               i ? "," : "", mj[i].name, mj[i].rows, mj[i].cols, mj[i].bytes / 1e6, t * 1e6,
               mj[i].bytes / t / 1e9, s.gbs > 0 ? mj[i].bytes / t / 1e9 / s.gbs : 0.0);
    }
    printf("\n  ]");
    if (!decode_only && sample_report(be, (int)cf.vocab_size, &err) != 0) {
        printf("\n}\n");
        fprintf(stderr, "bench_cuda: sample: %s (%s)\n", err.msg, nl_status_str(err.status));
        goto out;
    }
    if (dtok > 0) {
        arena_free(be, &ar); /* room for the model */
        arena_free(be32, &ar32);
        memset(&ar, 0, sizeof ar);
        memset(&ar32, 0, sizeof ar32);
        if (dec_opts.bf16 && nl_backend_new(&bd, device, &dec_opts, &err) != NL_OK) {
            printf("\n}\n");
            fprintf(stderr, "bench_cuda: --precision bf16: %s (%s)\n", err.msg,
                    nl_status_str(err.status));
            goto out;
        }
        if (decode_report(bd ? bd : be, device, &dec_opts, &cf, dtok, decode_batch, &err) != 0) {
            printf("\n}\n");
            fprintf(stderr, "bench_cuda: decode: %s (%s)\n", err.msg, nl_status_str(err.status));
            goto out;
        }
    }
    printf("\n}\n");
    rc = 0;
    goto out;
device_error:
    printf("\n  ]\n}\n");
    fprintf(stderr, "bench_cuda: %s (%s)\n", err.msg, nl_status_str(err.status));
out:
    if (be32)
        arena_free(be32, &ar32);
    arena_free(be, &ar);
    nl_backend_destroy(&bd);
    nl_backend_destroy(&be32);
    nl_backend_destroy(&be);
    return rc;
}
