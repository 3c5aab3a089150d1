/* neuroctl train --objective classify (and finetune's): a classifier
 * trained in this process on label<TAB>text lines, evaluated on its
 * held-out split against the majority-class baseline. The command line and
 * what it shares with language-model training are in cmd_train.c. */
#include <stdio.h>
#include <stdlib.h>

#include "cli/cli_io.h"
#include "cli/cmd_train_impl.h"
#include "core/data/labelled.h"
#include "core/formats/checkpoint.h"
#include "core/train/objective.h"

/* Held-out loss and accuracy of the classifier over the whole held-out
 * split, in order, each example once (the last batch is partial: its
 * other rows are scored out), in microbatches as a cluster evaluates. */
static nl_status eval_classify(nl_trainer *tr, const nl_labelled *ds, const train_opts *o, int K,
                               int32_t *tokens, int32_t *lengths, int32_t *labels, int32_t *doc,
                               float *probs, double *loss, double *acc, nl_error *err)
{
    const int B = (int)o->r.batch, T = (int)o->r.seq, M = (int)o->r.micro, mb = B / M;
    const size_t batches = nl_labelled_eval_batches(ds, B);
    double ce = 0.0, ignored = 0.0;
    int64_t right = 0, n = 0;
    int32_t *given = malloc((size_t)mb * sizeof *given);
    nl_status st = given ? NL_OK : nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < batches && st == NL_OK; i++) {
        if ((st = nl_labelled_eval_batch(ds, i, B, T, tokens, lengths, labels, doc, NULL, err)) !=
            NL_OK)
            break;
        nl_trainer_begin_step(tr, (int64_t)B * T);
        nl_trainer_set_loss_rows(tr, B);
        for (int j = 0; j < M && st == NL_OK; j++) {
            const size_t r0 = (size_t)j * mb * T;
            for (int b = 0; b < mb; b++) /* the rows past the split: any class, scored out */
                given[b] = labels[j * mb + b] < 0 ? 0 : labels[j * mb + b];
            if ((st = nl_trainer_set_docs(tr, doc + r0, mb * T, err)) != NL_OK ||
                (st = nl_trainer_set_labels(tr, given, lengths + j * mb, mb, T, err)) != NL_OK ||
                (st = nl_trainer_forward(tr, 0, mb, T, tokens + r0, NULL, NULL, &ignored, NULL,
                                         err)) != NL_OK ||
                (st = nl_trainer_class_probs(tr, 0, probs, err)) != NL_OK)
                break;
            nl_labelled_score(probs, labels + j * mb, mb, K, &ce, &right, &n);
        }
    }
    nl_trainer_set_labels(tr, NULL, NULL, 0, 0, NULL);
    nl_trainer_set_docs(tr, NULL, 0, NULL);
    free(given);
    *loss = n ? ce / (double)n : 0.0;
    *acc = n ? (double)right / (double)n : 0.0;
    return st;
}

/* The most frequent class of the training split and its share of the
 * held-out one: the majority-class baseline. */
static double majority_share(const nl_labelled *ds, int *cls)
{
    int64_t *count = calloc((size_t)ds->n_classes, sizeof *count);
    int best = 0;
    int64_t held = 0, total = 0;
    for (size_t i = 0; count && i < ds->n_train; i++)
        count[ds->label[i]]++;
    for (int k = 1; count && k < ds->n_classes; k++)
        best = count[k] > count[best] ? k : best;
    for (size_t i = ds->n_train; i < ds->n; i++, total++)
        held += ds->label[i] == best;
    free(count);
    *cls = best;
    return total ? (double)held / (double)total : 0.0;
}

/* The run announced: its examples, its classes and the majority-class
 * baseline, whose share of the held-out split it returns. */
static double announce(const nl_labelled *ds)
{
    int major = 0;
    const double base = majority_share(ds, &major);
    fprintf(stderr,
            "classifying %zu examples (%zu held out) into %d classes; majority class '%s' is "
            "%.1f%% of the held-out split\n",
            ds->n, ds->n - ds->n_train, ds->n_classes, ds->names[major], 100.0 * base);
    for (int k = 0; k < ds->n_classes; k++)
        fprintf(stderr, "  class %d: %s\n", k, ds->names[k]);
    return base;
}

/* neuroctl train --objective classify: label<TAB>text lines. */
int nl_local_classify(const train_opts *o)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_trainer *tr = NULL;
    nl_labelled *ds = NULL;
    nl_lora *lo = NULL;
    FILE *logf = NULL;
    int32_t *tokens = NULL, *lengths = NULL, *labels = NULL, *doc = NULL;
    float *probs = NULL;
    int rc = 1, obj = NL_OBJ_CLASSIFY;
    const int B = (int)o->r.batch, T = (int)o->r.seq, M = (int)o->r.micro;
    nl_config cfg;
    carried_meta cm = {0};
    run_locks lk = {0};
    if (nl_cli_backend_new(&be, o->device, (int)o->threads, o->tf32, o->bf16, 1, &err) != NL_OK ||
        nl_checkpoint_read_config(o->model, &cfg, NULL, &err) != NL_OK ||
        nl_local_objective(o, &cfg, &obj, &err) != NL_OK ||
        nl_checkpoint_meta(o->model, "tokenizer", &cm.tokenizer, &err) != NL_OK ||
        nl_checkpoint_meta(o->model, "init_seed", &cm.init_seed, &err) != NL_OK ||
        nl_labelled_load(&ds, o->data, cm.tokenizer, cfg.vocab_size, o->r.holdout,
                         (uint64_t)o->r.seed, &err) != NL_OK)
        goto out;
    if (o->r.eval_every > 0 && ds->n == ds->n_train) {
        nl_error_set(&err, NL_ERR_INVALID,
                     "%s: holdout %g of %zu examples holds none out to evaluate", o->data,
                     o->r.holdout, ds->n);
        goto out;
    }
    if (ds->n_classes > cfg.num_classes) {
        nl_error_set(&err, NL_ERR_SHAPE, "%s: %d classes, but the model's num_classes is %d",
                     o->data, ds->n_classes, cfg.num_classes);
        goto out;
    }
    if (nl_checkpoint_load(&m, be, o->model, 0, -1, 1, 1, NULL, &err) != NL_OK ||
        nl_local_attach_lora(&lo, m, o, B * T, &err) != NL_OK ||
        nl_trainer_new(&tr, m, B * T, 1, (int)o->r.recompute, &err) != NL_OK)
        goto out;
    tokens = malloc((size_t)B * T * sizeof *tokens);
    doc = malloc((size_t)B * T * sizeof *doc);
    lengths = malloc((size_t)B * sizeof *lengths);
    labels = malloc((size_t)B * sizeof *labels);
    probs = malloc((size_t)B * cfg.num_classes * sizeof *probs);
    if (!tokens || !doc || !lengths || !labels || !probs) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (nl_local_lock(o, &lk, &err) != NL_OK)
        goto out;
    if (o->log && !(logf = fopen(o->log, "a"))) {
        nl_error_set(&err, NL_ERR_IO, "%s: cannot open the log", o->log);
        goto out;
    }
    const double base = announce(ds);
    const nl_adamw_opts adam = nl_adamw_defaults();
    nl_train_progress prog;
    nl_train_progress_init(&prog, o->r.progress_s);
    const double t_begin = nl_mono_s();
    for (int64_t step = 0; step < o->r.steps; step++) {
        const double t0 = nl_mono_s();
        const double lr = nl_lr_at(step, o->r.steps, o->r.warmup, o->r.lr, o->r.min_lr);
        nl_step_result r;
        if (nl_labelled_batch(ds, 0, (uint64_t)o->r.seed, (uint64_t)step, B, T, tokens, lengths,
                              labels, doc, &err) != NL_OK ||
            nl_trainer_step_classify(tr, tokens, lengths, labels, doc, B, T, M, (float)lr,
                                     (float)NL_TRAIN_CLIP_NORM, adam, &r, &err) != NL_OK ||
            nl_cli_device_check(be, &err) != NL_OK)
            goto out;
        nl_train_step rep = nl_local_step_record(
            o, &r, step, 0, lr, (double)B * T / (nl_mono_s() - t0), t_begin, be->name);
        double acc = 0.0;
        if (rep.has_eval && eval_classify(tr, ds, o, cfg.num_classes, tokens, lengths, labels, doc,
                                          probs, &rep.eval_loss, &acc, &err) != NL_OK)
            goto out;
        nl_train_report_step(&prog, &rep, logf);
        if (rep.has_eval) {
            nl_train_progress_break(&prog);
            fprintf(stderr, "held-out accuracy %.4f (majority class %.4f)\n", acc, base);
        }
    }
    nl_train_progress_break(&prog);
    if (lo) { /* finetune: the adapters in --out */
        if (nl_local_save_adapter(lo, o, &err) != NL_OK)
            goto out;
    } else { /* the last step is always kept: in --out, or as the last checkpoint */
        char path[4096];
        if (!o->out)
            nl_local_step_path(path, sizeof path, o, o->r.steps);
        if ((!o->out && nl_local_ckpt_dir(o, &lk, &err) != NL_OK) ||
            nl_local_save(m, tr, o, &cm, o->out ? o->out : path, o->r.steps, &err) != NL_OK)
            goto out;
        fprintf(stderr, "wrote %s (step %lld)\n", o->out ? o->out : path, o->r.steps);
    }
    rc = 0;
out:
    free(cm.tokenizer);
    free(cm.init_seed);
    if (logf)
        fclose(logf);
    nl_local_unlock(&lk);
    nl_trainer_destroy(&tr);
    nl_lora_destroy(&lo);
    free(tokens);
    free(doc);
    free(lengths);
    free(labels);
    free(probs);
    nl_labelled_destroy(&ds);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    if (rc)
        fprintf(stderr, "neuroctl train: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}
