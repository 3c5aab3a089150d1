/* neuroctl generate (local) and neuroctl bench. */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "core/formats/checkpoint.h"
#include "core/model/forward.h"
#include "core/model/lora.h"
#include "core/model/sampler.h"
#include "core/tokenizer/tokenizer.h"
#include "core/train/train.h"

/* Generate up to max_new tokens after the prompt with the KV cache,
 * calling emit for each; the prompt and the tokens made fill at most the
 * context (P + made <= max_seq_len), as the HTTP API's max_tokens.
 * warmup: run the prompt and one decode step once first (kernels
 * compiled, buffers touched), then start the clock. kv_dtype: the
 * cache's element type (--kv-cache). */
static nl_status generate(nl_model *m, const int32_t *prompt, int P, int max_new,
                          nl_kv_dtype kv_dtype, nl_sampler *smp, bool warmup, nl_gen_clock *clock,
                          void (*emit)(int32_t, void *), void *ctx, nl_error *err)
{
    nl_backend *be = m->be;
    const int V = (int)m->cfg.vocab_size;
    if (max_new > m->cfg.max_seq_len - P)
        max_new = m->cfg.max_seq_len - P;
    int cap = P + max_new;
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    float *logits = malloc((size_t)V * sizeof(float));
    nl_status st = NL_OK;
    if (cap > m->cfg.max_seq_len)
        cap = m->cfg.max_seq_len;
    if (!logits)
        return nl_error_set(err, NL_ERR_NOMEM, "generate: out of memory");
    if (P >= cap) {
        st = nl_error_set(err, NL_ERR_RANGE,
                          "generate: prompt of %d tokens leaves no room in "
                          "max_seq_len %d",
                          P, m->cfg.max_seq_len);
        goto out;
    }
    if ((st = nl_runstate_new(&rs, m, P, err)) != NL_OK ||
        (st = nl_kvcache_new(&kv, m, 1, cap, kv_dtype, err)) != NL_OK)
        goto out;
    nl_forward_args a = {.B = 1, .T = P, .tokens = prompt, .kv = kv, .last_only = 1};
    int32_t next = 0; /* read by the next forward */
    if (warmup) {
        nl_forward_args w = {.B = 1, .T = 1, .tokens = prompt, .kv = kv, .last_only = 1};
        if ((st = nl_forward(m, rs, &a, NULL, err)) != NL_OK ||
            (kv->len < cap && (st = nl_forward(m, rs, &w, NULL, err)) != NL_OK))
            goto out;
        kv->len = 0; /* the cache starts over */
    }
    nl_gen_clock_start(clock);
    for (int i = 0; i < max_new && kv->len < cap; i++) {
        if ((st = nl_forward(m, rs, &a, NULL, err)) != NL_OK)
            goto out;
        if ((st = nl_sampler_next(smp, be, nl_runstate_output(rs, NULL), logits, &next, err)) !=
            NL_OK) {
            nl_error_prefix(err, "device %s", be->name);
            goto out;
        }
        emit(next, ctx);
        a.T = 1;
        a.tokens = &next;
    }
out:
    free(logits);
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
    return st;
}

typedef struct emit_ctx {
    int count;
    int32_t *ids;            /* every generated id, for the text line */
    const nl_tokenizer *tok; /* NULL: no text */
    int as_text;             /* stream text instead of ids */
    nl_gen_clock clock;
} emit_ctx;

static void emit_token(int32_t id, void *ctx)
{
    emit_ctx *e = ctx;
    nl_gen_clock_tick(&e->clock);
    e->ids[e->count++] = id;
    if (e->as_text) {
        const uint8_t *p = NULL;
        size_t n = 0;
        if (nl_tokenizer_token_bytes(e->tok, id, &p, &n) == NL_OK &&
            !nl_tokenizer_is_special(e->tok, id))
            fwrite(p, 1, n, stdout);
    } else {
        printf("%s%d", e->count > 1 ? " " : "", id);
    }
    fflush(stdout);
}

/* neuroctl generate's command line. */
typedef struct gen_args {
    const char *model, *ptoks, *ptext, *adapter;
    int max_new, threads;
    double temp, top_p;
    long long seed;
    bool warmup;
    nl_cli_device dev;
} gen_args;

#define GEN_USAGE                                                                                  \
    "neuroctl generate --model MODEL (--prompt-tokens 1,2,3 | --prompt TEXT) [--max-new N] "       \
    "[--temperature X] [--top-p P] [--seed S] [--threads N] [--warmup] [--adapter A] "             \
    "[--device D] [--tf32] [--precision fp32|bf16] [--kv-cache fp32|bf16]" NL_CLI_CLUSTER_USAGE(   \
        "generate")

/* The flags into a: 0 to run, -1 after --help, else the exit code (said). */
static int gen_flags(gen_args *a, int argc, char **argv)
{
    *a = (gen_args){0};
    nl_opt flags[] = {
        NL_OPT_STR("model", &a->model, "checkpoint (safetensors)"),
        NL_OPT_STR("prompt-tokens", &a->ptoks, "prompt as comma-separated token ids, e.g. 1,2,3"),
        NL_OPT_STR("prompt", &a->ptext,
                   "prompt as text, through the model's tokenizer; prints text"),
        NL_OPT_INT("max-new", &a->max_new, 1, 1 << 20, "32",
                   "tokens to generate; the prompt and they fill at most max_seq_len (as the "
                   "HTTP API's max_tokens): past it generation stops there and says so"),
        NL_OPT_DOUBLE("temperature", &a->temp, 0.0, 100.0, "0.8",
                      "sampling temperature; 0 is greedy"),
        NL_OPT_DOUBLE("top-p", &a->top_p, 1e-6, 1.0, "0.95", "nucleus sampling mass in (0, 1]"),
        NL_OPT_LLONG("seed", &a->seed, 0, INT64_MAX, "0", "sampling seed"),
        NL_OPT_STR("adapter", &a->adapter, "LoRA adapter file to apply (neuroctl finetune --out)"),
        NL_OPT_INT("threads", &a->threads, 0, 1024, NULL, "worker threads (default: all cores)"),
        NL_OPT_SWITCH("warmup", &a->warmup,
                      "run the prompt once before the timed generation (warm figures in the "
                      "report on stderr, for benchmarks)"),
        NL_CLI_DEVICE_OPT(&a->dev),
        NL_CLI_TF32_OPT(&a->dev),
        NL_CLI_PRECISION_OPT(&a->dev),
        NL_CLI_KV_CACHE_OPT(&a->dev),
        NL_OPT_END};
    int rc = nl_opts_parse(argc, argv, flags, GEN_USAGE, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? -1 : rc;
    if ((rc = nl_opts_require("neuroctl generate", GEN_USAGE, flags, "model", (const char *)NULL)))
        return rc;
    if (!a->ptoks == !a->ptext) {
        fprintf(stderr, "neuroctl generate: give one of --prompt-tokens and --prompt\n\n");
        nl_opts_help(stderr, GEN_USAGE, flags);
        return 2;
    }
    return nl_cli_device_opts(&a->dev);
}

int nl_cmd_generate(int argc, char **argv)
{
    gen_args a;
    int rc = gen_flags(&a, argc, argv);
    if (rc)
        return rc < 0 ? 0 : rc;
    const char *model = a.model, *ptoks = a.ptoks, *ptext = a.ptext;
    const long long max_new = a.max_new;
    int32_t *prompt = NULL;
    int P = 0;
    if (ptoks && (P = nl_cli_parse_ids(ptoks, &prompt)) < 0)
        return 2;
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_sampler smp = {0};
    nl_tokenizer *tok = NULL;
    nl_lora *lo = NULL;
    const char *adapter = a.adapter;
    emit_ctx ec = {.as_text = ptext != NULL};
    rc = 1;
    if (nl_checkpoint_tokenizer(model, &tok, &err) != NL_OK)
        goto out;
    if (!tok && nl_tokenizer_new_bytes(&tok, &err) != NL_OK) /* a byte-level model */
        goto out;
    if (nl_cli_backend_new(&be, a.dev.device, a.threads, a.dev.tf32, a.dev.bf16, 0, &err) !=
            NL_OK ||
        nl_checkpoint_load(&m, be, model, 0, -1, 1, 1, NULL, &err) != NL_OK)
        goto out;
    /* a prompt's prefill is the most rows a forward takes here */
    if (adapter && (nl_lora_check_base(adapter, model, &err) != NL_OK ||
                    nl_lora_load(&lo, m, adapter, m->cfg.max_seq_len, &err) != NL_OK))
        goto out;
    if (nl_tokenizer_vocab_size(tok) < m->cfg.vocab_size && !ptoks) {
        nl_error_set(&err, NL_ERR_NOTFOUND,
                     "%s carries no tokenizer for its %lld ids: use --prompt-tokens", model,
                     (long long)m->cfg.vocab_size);
        goto out;
    }
    if (ptext) {
        size_t n = 0;
        if (nl_tokenizer_encode(tok, ptext, strlen(ptext), &prompt, &n, &err) != NL_OK)
            goto out;
        P = (int)n;
        if (P == 0) {
            nl_error_set(&err, NL_ERR_INVALID, "--prompt: empty");
            goto out;
        }
        fputs(ptext, stdout);
    }
    ec.tok = tok;
    ec.ids = malloc((size_t)max_new * sizeof *ec.ids);
    if (!ec.ids) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (nl_sampler_init(&smp, (int)m->cfg.vocab_size, (float)a.temp, (float)a.top_p,
                        (uint64_t)a.seed, &err) != NL_OK)
        goto out;
    if (generate(m, prompt, P, (int)max_new, (nl_kv_dtype)a.dev.kv_cache, &smp, a.warmup, &ec.clock,
                 emit_token, &ec, &err) != NL_OK)
        goto out;
    printf("\n");
    fflush(stdout);
    if (ec.count < max_new)
        fprintf(stderr,
                "generate: stopped after %d of --max-new %lld tokens: with the prompt's %d they "
                "reach the model's max_seq_len %d\n",
                ec.count, max_new, P, m->cfg.max_seq_len);
    nl_gen_clock_report(&ec.clock);
    /* ids given: the text follows on its own line where the ids can be decoded */
    char *text = NULL;
    size_t tlen = 0;
    if (!ptext && nl_tokenizer_vocab_size(tok) >= m->cfg.vocab_size &&
        nl_tokenizer_decode(tok, ec.ids, (size_t)ec.count, &text, &tlen, &err) == NL_OK) {
        fwrite(text, 1, tlen, stdout);
        printf("\n");
    }
    free(text);
    rc = 0;
out:
    if (rc && ec.count)
        printf("\n");
    free(ec.ids);
    nl_tokenizer_destroy(&tok);
    nl_sampler_free(&smp);
    nl_lora_destroy(&lo);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    free(prompt);
    if (rc)
        fprintf(stderr, "neuroctl generate: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}

/* ---------------------------------------------------------------- bench */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The flags of neuroctl bench (a copy of which nl_args_parse fills
 * in). */
static const nl_flag bench_flags[] = {
    {"config", 1, "model config (YAML), e.g. configs/bench-small.yaml", NULL},
    {"batch", 1, "sequences per forward (default 8)", NULL},
    {"seq", 1, "positions per sequence (default 256)", NULL},
    {"threads", 1, "worker threads (default: all cores)", NULL},
    {"decode-tokens", 1, "tokens timed in the decode run (default 128)", NULL},
    {"repeats", 1, "timed forward passes; the median is reported (default 5)", NULL},
    NL_CLI_DEVICE_FLAG,
    NL_CLI_TF32_FLAG,
    NL_CLI_PRECISION_FLAG,
    {"kv-cache", 1, NL_CLI_KV_CACHE_HELP " (the decode run)", NULL},
    {0}};

/* Decode at batch 1: P tokens prefilled, then *ndec single steps (fewer
 * when they would pass max_seq_len) timed into *dec_s, each next token
 * the argmax of the last logits. rs1 and kv are the caller's to free. 0,
 * or 1 when it fails (err says why). */
static int bench_decode(nl_model *m, const int32_t *tokens, float *logits, int P, long long *ndec,
                        nl_kv_dtype kv_dtype, nl_runstate **rs1, nl_kvcache **kv, double *dec_s,
                        nl_error *err)
{
    nl_backend *be = m->be;
    const nl_config *cfg = &m->cfg;
    if (cfg->max_seq_len - P < 1) {
        nl_error_set(err, NL_ERR_INVALID,
                     "decode: max_seq_len %d leaves no room to decode after the %d-token prompt",
                     cfg->max_seq_len, P);
        return 1;
    }
    if (P + *ndec > cfg->max_seq_len) {
        fprintf(stderr,
                "neuroctl bench: --decode-tokens %lld: %d fit after the %d-token prompt in "
                "max_seq_len %d; timing those (decode_tokens in the JSON)\n",
                *ndec, cfg->max_seq_len - P, P, cfg->max_seq_len);
        *ndec = cfg->max_seq_len - P;
    }
    if (nl_runstate_new(rs1, m, P, err) != NL_OK ||
        nl_kvcache_new(kv, m, 1, (int)(P + *ndec), kv_dtype, err) != NL_OK)
        return 1;
    nl_forward_args pre = {.B = 1, .T = P, .tokens = tokens, .kv = *kv, .last_only = 1};
    if (nl_forward(m, *rs1, &pre, NULL, err) != NL_OK)
        return 1;
    int32_t next = tokens[P];
    nl_forward_args dec = {.B = 1, .T = 1, .tokens = &next, .kv = *kv, .last_only = 1};
    double t0 = nl_mono_s();
    for (long long i = 0; i < *ndec; i++) {
        if (nl_forward(m, *rs1, &dec, NULL, err) != NL_OK)
            return 1;
        be->download(be, logits, nl_runstate_output(*rs1, NULL), (size_t)cfg->vocab_size * 4);
        if (nl_cli_device_check(be, err) != NL_OK)
            return 1;
        int32_t best = 0;
        for (int v = 1; v < cfg->vocab_size; v++)
            best = logits[v] > logits[best] ? v : best;
        next = best;
    }
    *dec_s = nl_mono_s() - t0;
    return 0;
}

/* Training at B x T: one warm-up step, then the median of `reps` whole
 * steps (times: reps scratch), as JSON fields into json (on a device that
 * cannot train it is left as it is, and said). *tr is the caller's to
 * free. 0, or 1 when it fails (err says why). */
static int bench_train(nl_model *m, nl_trainer **tr, int32_t *tokens, long long B, long long T,
                       long long reps, double *times, double fwd_flops, double peak, char *json,
                       size_t cap, nl_error *err)
{
    nl_backend *be = m->be;
    if (!be->can_train) {
        fprintf(stderr, "neuroctl bench: %s cannot train yet: no training figures\n", be->name);
        return 0;
    }
    if (nl_trainer_new(tr, m, (int)(B * T), 1, 0, err) != NL_OK)
        return 1;
    int32_t *targets = tokens; /* any valid ids serve for timing */
    nl_step_result sr;
    for (long long i = 0; i <= reps; i++) {
        double ts = nl_mono_s();
        if (nl_trainer_step_local(*tr, tokens, targets, (int)B, (int)T, 1, 1e-4f, 1.0f,
                                  nl_adamw_defaults(), &sr, err) != NL_OK ||
            nl_cli_device_check(be, err) != NL_OK)
            return 1;
        if (i > 0)
            times[i - 1] = nl_mono_s() - ts;
    }
    qsort(times, (size_t)reps, sizeof *times, cmp_double);
    const double train_s = times[reps / 2];
    snprintf(json, cap, "\"train_tok_s\":%.1f,\"train_gflops\":%.1f,\"train_peak_frac\":%.3f",
             (double)(B * T) / train_s, 3 * fwd_flops / train_s / 1e9,
             3 * fwd_flops / train_s / 1e9 / peak);
    return 0;
}

int nl_cmd_bench(int argc, char **argv)
{
    nl_flag flags[sizeof bench_flags / sizeof *bench_flags];
    memcpy(flags, bench_flags, sizeof flags);
    const char *usage = "neuroctl bench --config CFG.yaml [--batch B] [--seq T] [--threads N] "
                        "[--device D] [--tf32] [--precision fp32|bf16] [--kv-cache fp32|bf16]";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *cfg_path = nl_args_get(flags, "config"), *device = NULL;
    long long B = 8, T = 256, threads = 0, ndec = 128, reps = 5;
    int tf32 = 0, bf16 = 0;
    if (!cfg_path) {
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if ((rc = nl_args_int(flags, "batch", 1, 4096, &B)) ||
        (rc = nl_args_int(flags, "seq", 1, 1 << 20, &T)) ||
        (rc = nl_args_int(flags, "threads", 0, 1024, &threads)) ||
        (rc = nl_args_int(flags, "decode-tokens", 1, 1 << 16, &ndec)) ||
        (rc = nl_args_int(flags, "repeats", 1, 1000, &reps)) ||
        (rc = nl_cli_device_flags(flags, &device, &tf32, &bf16)))
        return rc;
    const char *kvs = nl_args_get(flags, "kv-cache");
    const nl_kv_dtype kv_dtype = kvs && strcmp(kvs, "bf16") == 0 ? NL_KV_BF16 : NL_KV_FP32;
    if (kvs && kv_dtype == NL_KV_FP32 && strcmp(kvs, "fp32") != 0) {
        fprintf(stderr, "--kv-cache %s: not fp32 or bf16\n", kvs);
        return 2;
    }
    nl_error err = {0};
    nl_config cfg;
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_runstate *rs = NULL, *rs1 = NULL;
    nl_kvcache *kv = NULL;
    nl_trainer *tr = NULL;
    int32_t *tokens = NULL;
    double *times = calloc((size_t)reps, sizeof *times);
    float *logits = NULL;
    rc = 1;
    if (!times || nl_config_load_yaml(&cfg, cfg_path, &err) != NL_OK ||
        nl_config_validate(&cfg, 1, &err) != NL_OK ||
        nl_cli_backend_new(&be, device, (int)threads, tf32, bf16, 0, &err) != NL_OK ||
        nl_model_new(&m, be, &cfg, 0, cfg.num_layers, 1, 1, &err) != NL_OK ||
        nl_model_init_random(m, 1, &err) != NL_OK ||
        nl_runstate_new(&rs, m, (int)(B * T), &err) != NL_OK)
        goto out;
    const int P = 16; /* decode prompt */
    const size_t ntok = (size_t)(B * T) > (size_t)P + 1 ? (size_t)(B * T) : (size_t)P + 1;
    tokens = malloc(ntok * sizeof *tokens);
    logits = malloc((size_t)cfg.vocab_size * sizeof *logits);
    if (!tokens || !logits) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    nl_rng r;
    nl_rng_seed(&r, 7, 0);
    for (size_t i = 0; i < ntok; i++)
        tokens[i] = (int32_t)nl_rng_below(&r, (uint64_t)cfg.vocab_size);
    double peak = nl_backend_gemm_gflops(be, 2048, 2048, 2048, 1.5);
    if (nl_cli_device_check(be, &err) != NL_OK)
        goto out;

    /* forward: one warm-up, then the median of `reps` */
    nl_forward_args a = {.B = (int)B, .T = (int)T, .tokens = tokens};
    if (nl_forward(m, rs, &a, NULL, &err) != NL_OK)
        goto out;
    for (long long i = 0; i < reps; i++) {
        double t0 = nl_mono_s();
        if (nl_forward(m, rs, &a, NULL, &err) != NL_OK)
            goto out;
        if (be->sync(be, &err) != NL_OK) {
            nl_error_prefix(&err, "device %s", be->name);
            goto out;
        }
        times[i] = nl_mono_s() - t0;
    }
    qsort(times, (size_t)reps, sizeof *times, cmp_double);
    const double fwd_s = times[reps / 2];
    const double fwd_flops = nl_config_forward_flops(&cfg, (int)B, (int)T, 0);

    /* decode at batch 1: prefill P tokens, then time ndec single steps */
    double dec_s = 0.0;
    if (bench_decode(m, tokens, logits, P, &ndec, kv_dtype, &rs1, &kv, &dec_s, &err))
        goto out;

    /* training: one warm-up step, then the median of `reps` whole steps
     * (on a device that can train; else the training figures are null) */
    char train_json[160] = "\"train_tok_s\":null,\"train_gflops\":null,\"train_peak_frac\":null";
    if (bench_train(m, &tr, tokens, B, T, reps, times, fwd_flops, peak, train_json,
                    sizeof train_json, &err))
        goto out;

    printf("{\"config\":\"%s\",\"device\":\"%s\",\"batch\":%lld,\"seq\":%lld,\"threads\":%d,"
           "\"params\":%" PRId64 ",\"forward_tok_s\":%.1f,\"forward_gflops\":%.1f,"
           "\"forward_ms\":%.2f,\"decode_tok_s\":%.1f,\"decode_tokens\":%lld,"
           "\"gemm_peak_gflops\":%.1f,"
           "\"forward_peak_frac\":%.3f,%s,\"precision\":\"%s\",\"kv_cache\":\"%s\"}\n",
           cfg_path, be->name, B, T, threads ? (int)threads : 0, nl_config_param_count(&cfg),
           (double)(B * T) / fwd_s, fwd_flops / fwd_s / 1e9, fwd_s * 1e3, (double)ndec / dec_s,
           ndec, peak, fwd_flops / fwd_s / 1e9 / peak, train_json, be->bf16 ? "bf16" : "fp32",
           nl_kv_dtype_name(kv_dtype));
    rc = 0;
out:
    free(times);
    free(tokens);
    free(logits);
    nl_trainer_destroy(&tr);
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
    nl_runstate_destroy(&rs1);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    if (rc)
        fprintf(stderr, "neuroctl bench: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}
