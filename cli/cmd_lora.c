/* neuroctl lora merge: fold an adapter file into a full checkpoint
 * (W += (alpha / r) B A), written as an ordinary neurollm/1 checkpoint. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "core/formats/checkpoint.h"
#include "core/model/lora.h"

int nl_cmd_lora(int argc, char **argv)
{
    nl_flag flags[] = {{"model", 1, "base checkpoint (safetensors)", NULL},
                       {"adapter", 1, "adapter file (neuroctl finetune --out)", NULL},
                       {"out", 1, "merged checkpoint to write", NULL},
                       {0}};
    const char *usage = "neuroctl lora merge --model BASE --adapter ADAPTER --out MERGED";
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        nl_args_help(stdout, usage, flags);
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "merge") != 0) {
        fprintf(stderr, "usage: %s\n", usage);
        return 2;
    }
    int rc = nl_args_parse(argc - 1, argv + 1, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *model = nl_args_get(flags, "model"), *adapter = nl_args_get(flags, "adapter"),
               *out = nl_args_get(flags, "out");
    if (!model || !adapter || !out) {
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_lora *lo = NULL;
    int64_t step = 0;
    char *tok = NULL;
    rc = 1;
    if (nl_cli_backend_new(&be, "cpu", 0, 0, 0, 0, &err) != NL_OK ||
        nl_checkpoint_load(&m, be, model, 0, -1, 1, 1, &step, &err) != NL_OK ||
        nl_checkpoint_meta(model, "tokenizer", &tok, &err) != NL_OK ||
        nl_lora_check_base(adapter, model, &err) != NL_OK ||
        nl_lora_load(&lo, m, adapter, 1, &err) != NL_OK || nl_lora_merge(lo, &err) != NL_OK)
        goto out;
    nl_lora_destroy(&lo);
    const nl_ckpt_extra extra = {.tokenizer = tok}; /* the base's tokenizer goes along */
    if (nl_checkpoint_save(m, out, step, &extra, &err) != NL_OK)
        goto out;
    fprintf(stderr, "wrote %s: %s merged into %s\n", out, adapter, model);
    rc = 0;
out:
    free(tok);
    nl_lora_destroy(&lo);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    if (rc)
        fprintf(stderr, "neuroctl lora merge: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}
