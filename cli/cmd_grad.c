/* neuroctl grad: one forward and backward of a checkpoint on given token
 * ids, the gradients written as safetensors (no optimizer step). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "core/formats/checkpoint.h"
#include "core/formats/safetensors.h"
#include "core/train/train.h"

int nl_cmd_grad(int argc, char **argv)
{
    nl_flag flags[] = {
        {"model", 1, "checkpoint (safetensors)", NULL},
        {"batch", 1, "input: 'tokens' and 'targets', I32/I64 [B, T]", NULL},
        {"out", 1, "output: every weight's gradient, and loss, ce_loss, aux_loss", NULL},
        {"threads", 1, "worker threads (default: all cores)", NULL},
        NL_CLI_DEVICE_FLAG,
        {0}};
    const char *usage =
        "neuroctl grad --model MODEL --batch IN.safetensors --out GRADS.safetensors "
        "[--threads N] [--device D]";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *model = nl_args_get(flags, "model"), *in = nl_args_get(flags, "batch"),
               *out = nl_args_get(flags, "out"), *device = NULL;
    long long threads = 0;
    int tf32 = 0, bf16 = 0;
    if (!model || !in || !out) {
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if ((rc = nl_cli_not_input("out", out, "batch", in)) ||
        (rc = nl_cli_not_input("out", out, "model", model)) ||
        (rc = nl_args_int(flags, "threads", 0, 1024, &threads)) ||
        (rc = nl_cli_device_flags(flags, &device, &tf32, &bf16)))
        return rc;
    nl_error err = {0};
    nl_st_file *f = NULL;
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_trainer *tr = NULL;
    nl_st_writer *w = NULL;
    int32_t *tokens = NULL, *targets = NULL;
    float *grads = NULL;
    int B = 0, T = 0, B2 = 0, T2 = 0;
    rc = 1;
    if (nl_cli_backend_new(&be, device, (int)threads, 0, 0, 1, &err) != NL_OK ||
        nl_st_open(&f, in, &err) != NL_OK ||
        nl_cli_read_ids(f, in, "tokens", &tokens, &B, &T, &err) != NL_OK ||
        nl_cli_read_ids(f, in, "targets", &targets, &B2, &T2, &err) != NL_OK)
        goto out;
    if (B != B2 || T != T2) {
        nl_error_set(&err, NL_ERR_SHAPE, "%s: tokens [%d, %d] and targets [%d, %d] differ", in, B,
                     T, B2, T2);
        goto out;
    }
    if (nl_checkpoint_load(&m, be, model, 0, -1, 1, 1, NULL, &err) != NL_OK ||
        nl_trainer_new(&tr, m, B * T, 1, 0, &err) != NL_OK)
        goto out;
    double ce = 0.0, aux = 0.0;
    int64_t valid = 0; /* targets below 0 are ignored: the mean is over the others */
    for (int n = 0; n < B * T; n++)
        valid += targets[n] >= 0;
    valid = valid > 0 ? valid : 1;
    nl_trainer_begin_step(tr, (int64_t)B * T);
    nl_trainer_set_loss_rows(tr, valid);
    if (nl_trainer_forward(tr, 0, B, T, tokens, NULL, targets, &ce, &aux, &err) != NL_OK ||
        nl_trainer_backward(tr, 0, NULL, &err) != NL_OK) {
        nl_error_prefix(&err, "%s", in);
        goto out;
    }
    grads = malloc(m->n_params * sizeof(float) + 1);
    if (!grads) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    be->download(be, grads, nl_trainer_grads(tr), m->n_params * sizeof(float));
    if (nl_cli_device_check(be, &err) != NL_OK)
        goto out;
    float ce_loss = (float)(ce / (double)valid), aux_loss = (float)aux;
    float loss = (float)(ce / (double)valid + m->cfg.aux_loss_coef * aux);
    int64_t scalar[1] = {0};
    if (!(w = nl_st_writer_new())) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < m->n_table; i++) {
        const nl_param *p = &m->table[i];
        if (nl_st_writer_add(w, p->name, NL_DTYPE_F32, p->ndim, p->shape, grads + p->offset,
                             &err) != NL_OK)
            goto out;
    }
    if (nl_st_writer_add(w, "loss", NL_DTYPE_F32, 0, scalar, &loss, &err) != NL_OK ||
        nl_st_writer_add(w, "ce_loss", NL_DTYPE_F32, 0, scalar, &ce_loss, &err) != NL_OK ||
        nl_st_writer_add(w, "aux_loss", NL_DTYPE_F32, 0, scalar, &aux_loss, &err) != NL_OK ||
        nl_st_writer_write(w, out, &err) != NL_OK)
        goto out;
    rc = 0;
out:
    nl_st_writer_destroy(&w);
    nl_st_close(&f);
    free(grads);
    free(tokens);
    free(targets);
    nl_trainer_destroy(&tr);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    if (rc)
        fprintf(stderr, "neuroctl grad: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}
