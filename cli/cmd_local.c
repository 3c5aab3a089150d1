/* neuroctl's local single-process tools: init, forward, generate, bench. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "core/formats/checkpoint.h"
#include "core/formats/safetensors.h"
#include "core/model/forward.h"
#include "core/model/lora.h"
#include "core/model/sampler.h"
#include "core/tokenizer/tokenizer.h"

static int fail(const char *cmd, const nl_error *err)
{
    fprintf(stderr, "neuroctl %s: %s (%s)\n", cmd, err->msg, nl_status_str(err->status));
    return 1;
}

static int threads_flag(const nl_flag *flags, int *threads)
{
    long long t = 0;
    int rc = nl_args_int(flags, "threads", 0, 1024, &t);
    *threads = (int)t;
    return rc;
}

/* ---------------------------------------------------------------- init */

int nl_cmd_init(int argc, char **argv)
{
    nl_flag flags[] = {
        {"config", 1, "model config (YAML); hidden_dim and num_layers are required", NULL},
        {"out", 1, "checkpoint to write (safetensors)", NULL},
        {"seed", 1, "initialisation seed (default 0)", NULL},
        {"tokenizer", 1, "attach this tokenizer: vocab_size becomes its size", NULL},
        NL_CLI_FORCE_FLAG,
        {0}};
    const char *usage = "neuroctl init --config CFG.yaml --out MODEL.safetensors [--seed N] "
                        "[--tokenizer TOK] [--force]";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *cfg_path = nl_args_get(flags, "config"), *out = nl_args_get(flags, "out");
    long long seed = 0;
    if ((rc = nl_cli_require("init", usage, flags, "config", "out", (const char *)NULL)) ||
        (rc = nl_args_int(flags, "seed", 0, INT64_MAX, &seed)) ||
        (rc = nl_cli_may_write(flags, "out", out)))
        return rc;
    nl_error err = {0};
    nl_config cfg;
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_tokenizer *tok = NULL;
    char *tok_text = NULL, seed_s[32];
    size_t tok_len = 0;
    const char *tok_path = nl_args_get(flags, "tokenizer");
    rc = 1;
    if (nl_config_load_yaml(&cfg, cfg_path, &err) != NL_OK)
        goto out;
    if (tok_path) {
        if (nl_tokenizer_load(&tok, tok_path, &err) != NL_OK ||
            nl_tokenizer_save_buffer(tok, &tok_text, &tok_len, &err) != NL_OK)
            goto out;
        cfg.vocab_size = nl_tokenizer_vocab_size(tok);
    }
    if (nl_config_validate(&cfg, 1, &err) != NL_OK) {
        nl_error_prefix(&err, "%s", cfg_path);
        goto out;
    }
    if (nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = 0}, &err) != NL_OK ||
        nl_model_new(&m, be, &cfg, 0, cfg.num_layers, 1, 1, &err) != NL_OK ||
        nl_model_init_random(m, (uint64_t)seed, &err) != NL_OK)
        goto out;
    snprintf(seed_s, sizeof seed_s, "%lld", seed);
    nl_ckpt_extra extra = {.tokenizer = tok_text, .init_seed = seed_s};
    if (nl_checkpoint_save(m, out, 0, &extra, &err) != NL_OK)
        goto out;
    printf("wrote %s: %" PRId64 " parameters (d=%d, L=%d, H=%d, G=%d, F=%d, E=%d, vocab %" PRId64
           ", capacity %" PRId64 ")\n",
           out, nl_config_param_count(&cfg), cfg.hidden_dim, cfg.num_layers, cfg.num_heads,
           cfg.num_kv_heads, cfg.ffn_dim, cfg.num_experts, cfg.vocab_size, m->capacity);
    rc = 0;
out:
    free(tok_text);
    nl_tokenizer_destroy(&tok);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    return rc ? fail("init", &err) : 0;
}

/* ---------------------------------------------------------------- forward */

int nl_cmd_forward(int argc, char **argv)
{
    nl_flag flags[] = {{"model", 1, "checkpoint (safetensors)", NULL},
                       {"tokens", 1, "input: safetensors with 'tokens' I32/I64 [B, T]", NULL},
                       {"out", 1, "output: 'logits' F32 [B, T, vocab] and 'aux_loss' F32 []", NULL},
                       {"adapter", 1, "LoRA adapter file to apply (neuroctl finetune --out)", NULL},
                       {"threads", 1, "worker threads (default: all cores)", NULL},
                       NL_CLI_DEVICE_FLAG,
                       NL_CLI_TF32_FLAG,
                       NL_CLI_PRECISION_FLAG,
                       {0}};
    const char *usage =
        "neuroctl forward --model MODEL --tokens IN.safetensors --out "
        "OUT.safetensors [--adapter A] [--threads N] [--device D] [--tf32] [--precision "
        "fp32|bf16]" NL_CLI_CLUSTER_USAGE("forward");
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL), threads = 0, tf32 = 0,
        bf16 = 0;
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *model = nl_args_get(flags, "model"), *in = nl_args_get(flags, "tokens"),
               *out = nl_args_get(flags, "out"), *device = NULL;
    if ((rc = nl_cli_require("forward", usage, flags, "model", "tokens", "out",
                             (const char *)NULL)) ||
        (rc = nl_cli_not_input("out", out, "tokens", in)) ||
        (rc = nl_cli_not_input("out", out, "model", model)) ||
        (rc = nl_cli_not_input("out", out, "adapter", nl_args_get(flags, "adapter"))) ||
        (rc = threads_flag(flags, &threads)) ||
        (rc = nl_cli_device_flags(flags, &device, &tf32, &bf16)))
        return rc;
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_runstate *rs = NULL;
    nl_lora *lo = NULL;
    nl_st_writer *w = NULL;
    int32_t *tokens = NULL;
    float *logits = NULL;
    int B = 0, T = 0;
    const char *adapter = nl_args_get(flags, "adapter");
    rc = 1;
    if (nl_cli_read_ids_file(in, "tokens", &tokens, &B, &T, &err) != NL_OK ||
        nl_cli_backend_new(&be, device, threads, tf32, bf16, 0, &err) != NL_OK ||
        nl_checkpoint_load(&m, be, model, 0, -1, 1, 1, NULL, &err) != NL_OK ||
        (adapter && (nl_lora_check_base(adapter, model, &err) != NL_OK ||
                     nl_lora_load(&lo, m, adapter, B * T, &err) != NL_OK)) ||
        nl_runstate_new(&rs, m, B * T, &err) != NL_OK)
        goto out;
    float aux = 0.0f;
    nl_forward_args a = {.B = B, .T = T, .tokens = tokens};
    if (nl_forward(m, rs, &a, &aux, &err) != NL_OK) {
        nl_error_prefix(&err, "%s", in);
        goto out;
    }
    const size_t n = (size_t)B * T * m->cfg.vocab_size;
    logits = malloc(n * sizeof(float));
    if (!logits) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory for logits");
        goto out;
    }
    be->download(be, logits, nl_runstate_output(rs, NULL), n * sizeof(float));
    if (nl_cli_device_check(be, &err) != NL_OK)
        goto out;
    int64_t shape[3] = {B, T, m->cfg.vocab_size};
    if (!(w = nl_st_writer_new())) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (nl_st_writer_add(w, "logits", NL_DTYPE_F32, 3, shape, logits, &err) != NL_OK ||
        nl_st_writer_add(w, "aux_loss", NL_DTYPE_F32, 0, shape, &aux, &err) != NL_OK ||
        nl_st_writer_write(w, out, &err) != NL_OK)
        goto out;
    rc = 0;
out:
    nl_st_writer_destroy(&w);
    free(logits);
    free(tokens);
    nl_runstate_destroy(&rs);
    nl_lora_destroy(&lo);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    return rc ? fail("forward", &err) : 0;
}
