/* neuroctl export: join a sharded checkpoint (the manifest and the stage
 * shards that distributed training writes) into one ordinary checkpoint,
 * after checking every shard's size and SHA-256 against the manifest.
 * The result is what a one-process save of the same weights writes: the
 * local tools, PyTorch and `neuroctl train --resume` read it. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "core/formats/manifest.h"

int nl_cmd_export(int argc, char **argv)
{
    nl_flag flags[] = {
        {"manifest", 1, "the manifest (JSON), or the directory holding manifest.json", NULL},
        {"out", 1, "checkpoint to write (safetensors); a directory with --format hf", NULL},
        {"format", 1, "neurollm (default: one checkpoint) or hf (a Hugging Face directory)", NULL},
        {"model", 1, "with --format hf: a checkpoint to export instead of a manifest", NULL},
        {"shard-size", 1, "with --format hf: start a new weight file past this (default 5G)", NULL},
        NL_CLI_FORCE_FLAG,
        {0}};
    const char *usage = "neuroctl export --manifest MANIFEST.json|DIR --out MODEL.safetensors "
                        "[--force]\n"
                        "  verifies every shard (size, sha256) and joins them with their "
                        "optimizer state\n"
                        "neuroctl export --format hf --manifest M|--model CKPT --out DIR "
                        "[--force]\n"
                        "  writes config.json (MixtralForCausalLM; a dense model: "
                        "LlamaForCausalLM, MistralForCausalLM with a sliding window),\n  the "
                        "weights in Hugging Face names and RoPE order, and the tokenizer\n  "
                        "(tokenizer.json + tokenizer_config.json for AutoTokenizer, vocab.json, "
                        "merges.txt,\n  neurollm-tokenizer.txt); DIR must be new or empty, or "
                        "with --force those files are\n  replaced and others kept";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *path = nl_args_get(flags, "manifest"), *out = nl_args_get(flags, "out");
    const char *format = nl_args_get(flags, "format"), *model = nl_args_get(flags, "model");
    if (format && strcmp(format, "hf") == 0) {
        uint64_t shard = 0;
        if (nl_args_size(flags, "shard-size", &shard))
            return 2;
        if (!out || !path == !model) {
            nl_args_help(stderr, usage, flags);
            return 2;
        }
        return nl_cli_export_hf(model ? model : path, out, shard,
                                nl_args_get(flags, "force") != NULL);
    }
    if (format && strcmp(format, "neurollm") != 0) {
        fprintf(stderr, "--format: '%s' is neither neurollm nor hf\n", format);
        return 2;
    }
    if (model) {
        fprintf(stderr,
                "neuroctl export: --model goes with --format hf; this format joins a --manifest\n");
        return 2;
    }
    if ((rc = nl_cli_require("export", usage, flags, "manifest", "out", (const char *)NULL)) ||
        (rc = nl_cli_may_write(flags, "out", out)))
        return rc;
    nl_error err = {0};
    nl_manifest *m = NULL;
    nl_manifest_export_stats stats = {0};
    rc = 1;
    if (nl_manifest_load(&m, path, &err) != NL_OK ||
        nl_manifest_export_ex(m, out, &stats, &err) != NL_OK)
        goto out;
    for (int i = 0; i < m->n_shards; i++) {
        const nl_manifest_shard *s = &m->shards[i];
        fprintf(stderr,
                "  stage %d: layers [%d, %d)%s%s  %s  %" PRIu64 " bytes  sha256 %.16s...%s%s\n",
                s->stage, s->l0, s->l1, s->has_embed ? " +embed" : "", s->has_head ? " +head" : "",
                s->file, s->bytes, s->sha256, s->node ? "  from " : "", s->node ? s->node : "");
    }
    fprintf(stderr,
            "joined %d shards at step %" PRId64 " (%" PRId64
            " optimizer steps) into %s: %d tensors "
            "and their moments, %zu parameters, %" PRIu64 " bytes\n",
            m->n_shards, m->step, m->adam_steps, out, stats.n_tensors, stats.n_params, stats.bytes);
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "neuroctl export: %s (%s)\n", err.msg, nl_status_str(err.status));
    nl_manifest_destroy(&m);
    return rc;
}
