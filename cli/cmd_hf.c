/* neuroctl import --hf (a Hugging Face Mixtral, Llama or Mistral directory into
 * one of our checkpoints) and the --format hf half of neuroctl export
 * (core/formats/hf.h does the work; this file parses flags and reports). */
#include <inttypes.h>
#include <stdio.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "core/formats/hf.h"
#include "core/tokenizer/tokenizer.h"

int nl_cmd_import(int argc, char **argv)
{
    nl_flag flags[] = {
        {"hf", 1, "Hugging Face model directory (config.json + safetensors weights)", NULL},
        {"out", 1, "checkpoint to write (safetensors, F32)", NULL},
        NL_CLI_FORCE_FLAG,
        {0}};
    const char *usage =
        "neuroctl import --hf DIR --out MODEL.safetensors [--force]\n"
        "  MixtralForCausalLM, LlamaForCausalLM or MistralForCausalLM (a dense FFN); one\n"
        "  model.safetensors or shards with model.safetensors.index.json; BF16/F16 become F32;\n"
        "  streams tensor by tensor. The tokenizer comes along when DIR has a byte-level BPE\n"
        "  one (tokenizer.json, or vocab.json + merges.txt); another kind (SentencePiece,\n"
        "  e.g. Llama 2's) is named and left out, and the weights import without it";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *dir = nl_args_get(flags, "hf"), *out = nl_args_get(flags, "out");
    if ((rc = nl_cli_require("import", usage, flags, "hf", "out", (const char *)NULL)) ||
        (rc = nl_cli_may_write(flags, "out", out)))
        return rc;
    nl_error err = {0};
    nl_hf_stats s;
    if (nl_hf_import(dir, out, &s, &err) != NL_OK) {
        fprintf(stderr, "neuroctl import: %s (%s)\n", err.msg, nl_status_str(err.status));
        return 1;
    }
    if (s.converted)
        fprintf(stderr,
                "note: %d tensors were %s and are now F32 (exact; the checkpoint is larger)\n",
                s.converted, s.converted_from);
    if (s.tied)
        fprintf(stderr, "note: tie_word_embeddings: lm_head.weight is a copy of the embedding\n");
    fprintf(stderr, "%s: %s\n", s.has_tokenizer ? "tokenizer" : "note", s.tokenizer_note);
    if (s.chat_warning[0])
        fprintf(stderr, "warning: %s\n", s.chat_warning);
    else if (s.chat_family[0])
        fprintf(stderr, "note: chat template: the %s family (docs/serving.md)\n", s.chat_family);
    fprintf(stderr,
            "imported %s into %s: %d tensors from %d file(s), %" PRIu64 " bytes read, %" PRIu64
            " written\n",
            dir, out, s.n_tensors, s.n_files, s.bytes_in, s.bytes_out);
    return 0;
}

int nl_cli_export_hf(const char *src, const char *out, uint64_t shard_bytes, int force)
{
    nl_error err = {0};
    nl_hf_stats s;
    if (nl_hf_export(src, out, shard_bytes, force, &s, &err) != NL_OK) {
        fprintf(stderr, "neuroctl export: %s (%s)\n", err.msg, nl_status_str(err.status));
        return 1;
    }
    fprintf(stderr,
            "exported %s to %s in the Hugging Face layout: %d tensors in %d weight file(s), "
            "%" PRIu64 " bytes",
            src, out, s.n_tensors, s.n_files, s.bytes_out);
    if (s.has_tokenizer)
        fprintf(stderr, "; tokenizer in tokenizer.json, tokenizer_config.json, vocab.json, "
                        "merges.txt, neurollm-tokenizer.txt\n");
    else if (s.vocab_size <= NL_TOKEN_FIRST_MERGE)
        fprintf(stderr, "; no tokenizer in the source: its ids are bytes\n");
    else
        fprintf(stderr,
                "; no tokenizer in the source, so no vocabulary files: its %" PRId64
                " ids are not bytes (a reader needs the tokenizer they were trained with)\n",
                s.vocab_size);
    if (s.tokenizer_note[0])
        fprintf(stderr, "note: %s\n", s.tokenizer_note);
    if (s.chat_written)
        fprintf(stderr, "chat template: the original in tokenizer_config.json\n");
    if (s.replaced || s.kept)
        fprintf(stderr, "--force: replaced %d file(s) in %s; kept %d other(s)%s%s\n", s.replaced,
                out, s.kept, s.kept ? ": " : "", s.kept_names);
    return 0;
}
