/* neuroctl train --groups R --outer-every H: DiLoCo across R replica
 * groups (DESIGN section 8) in this process, the one-machine reference of
 * neurocoord --outer-every H on a cluster of R replicas per stage.
 *
 * Every step makes the batch local training makes (the cluster's
 * coordinator makes the same), cuts it into --microbatches M and gives
 * microbatch i to group i mod R, as the coordinator routes it to replica
 * i mod R of every stage. Each group is a trainer of its own (its own
 * weights, AdamW moments and step count) that takes its microbatches, in
 * order, as its batch: its expert shares are its own counts, its loss is
 * the mean over its own predictions and it clips by its own gradient
 * norm; a step whose loss or gradient is not finite in any group is
 * skipped by all (the coordinator's one decision). Every H steps the
 * groups' deltas (weights at the last sync minus weights now) are added
 * in group order and nl_diloco_outer applies the outer step, whose
 * result every group starts from again. Evaluations, checkpoints and
 * --out are group 0's, as replica 0 evaluates and writes a cluster's
 * shards. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_io.h"
#include "cli/cmd_train_impl.h"
#include "cli/train_report.h"
#include "core/data/data.h"
#include "core/formats/checkpoint.h"
#include "core/train/objective.h"
#include "core/train/train.h"

typedef struct groups_run {
    nl_error err;
    nl_backend *be;
    nl_dataset *ds;
    int R;
    nl_model **m;                    /* R groups' models */
    nl_trainer **tr;                 /* and trainers */
    float *anchor;                   /* host, n_params: the weights at the last sync */
    float *outer_m;                  /* host, n_params: the outer momentum */
    float *sum, *w;                  /* host, n_params: the deltas' sum, a group's weights */
    int32_t *tokens, *targets, *doc; /* the step's batch (B, T); doc: --pack's */
    int32_t *gtok, *gtgt, *gdoc;     /* one group's rows (B / R, T) */
    double *ce, *aux, *sumsq;        /* per group, of the step */
    int64_t *valid;
    int obj;
    FILE *logf;
    carried_meta cm;
    run_locks lk;
    nl_train_progress prog;
    char path[4096];
} groups_run;

static int groups_open(groups_run *x, const train_opts *o)
{
    nl_error *err = &x->err;
    const int R = x->R, B = (int)o->r.batch, T = (int)o->r.seq, mb = (int)(o->r.batch / o->r.micro);
    nl_config cfg;
    nl_dataset_info info;
    if (nl_cli_backend_new(&x->be, o->device, (int)o->threads, o->tf32, o->bf16, 1, err) != NL_OK ||
        nl_checkpoint_read_config(o->model, &cfg, NULL, err) != NL_OK ||
        nl_checkpoint_meta(o->model, "tokenizer", &x->cm.tokenizer, err) != NL_OK ||
        nl_checkpoint_meta(o->model, "init_seed", &x->cm.init_seed, err) != NL_OK ||
        nl_local_objective(o, &cfg, &x->obj, err) != NL_OK ||
        nl_dataset_load_model(&x->ds, o->data, x->cm.tokenizer, cfg.vocab_size, o->r.holdout,
                              o->model, &info, err) != NL_OK)
        return 1;
    x->m = calloc((size_t)R, sizeof *x->m);
    x->tr = calloc((size_t)R, sizeof *x->tr);
    x->ce = calloc((size_t)R, sizeof *x->ce);
    x->aux = calloc((size_t)R, sizeof *x->aux);
    x->sumsq = calloc((size_t)R, sizeof *x->sumsq);
    x->valid = calloc((size_t)R, sizeof *x->valid);
    if (!x->m || !x->tr || !x->ce || !x->aux || !x->sumsq || !x->valid) {
        nl_error_set(err, NL_ERR_NOMEM, "out of memory for %d replica groups", R);
        return 1;
    }
    int64_t start = 0;
    for (int g = 0; g < R; g++) /* every group from the same weights, moments at zero */
        if (nl_checkpoint_load(&x->m[g], x->be, o->model, 0, -1, 1, 1, &start, err) != NL_OK ||
            nl_trainer_new(&x->tr[g], x->m[g], mb * T, 1, (int)o->r.recompute, err) != NL_OK)
            return 1;
    const size_t n = x->m[0]->n_params, rows = (size_t)B * T;
    x->anchor = malloc(n * sizeof(float));
    x->outer_m = calloc(n, sizeof(float));
    x->sum = malloc(n * sizeof(float));
    x->w = malloc(n * sizeof(float));
    x->tokens = malloc(rows * sizeof *x->tokens);
    x->targets = malloc(rows * sizeof *x->targets);
    x->gtok = malloc(rows / R * sizeof *x->gtok);
    x->gtgt = malloc(rows / R * sizeof *x->gtgt);
    x->doc = o->r.pack ? malloc(rows * sizeof *x->doc) : NULL;
    x->gdoc = o->r.pack ? malloc(rows / R * sizeof *x->gdoc) : NULL;
    if (!x->anchor || !x->outer_m || !x->sum || !x->w || !x->tokens || !x->targets || !x->gtok ||
        !x->gtgt || (o->r.pack && (!x->doc || !x->gdoc))) {
        nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        return 1;
    }
    x->be->download(x->be, x->anchor, x->m[0]->params, n * sizeof(float));
    if (nl_cli_device_check(x->be, err) != NL_OK || nl_local_lock(o, &x->lk, err) != NL_OK)
        return 1;
    if (o->log && !(x->logf = fopen(o->log, "a"))) {
        nl_error_set(err, NL_ERR_IO, "%s: cannot open the log", o->log);
        return 1;
    }
    fprintf(stderr,
            "training %" PRId64 " parameters on %zu tokens (%zu held out): DiLoCo in this process, "
            "%d replica groups of %d x %d a step each (microbatch i to group i mod %d), an outer "
            "step every %lld steps (lr %g, momentum %g), %lld steps on %s\n",
            nl_config_param_count(&x->m[0]->cfg), x->ds->n_train, x->ds->n - x->ds->n_train, R,
            B / R, T, R, o->outer_every, o->outer_lr, o->outer_mu, o->r.steps, x->be->name);
    return 0;
}

/* Group g's rows of the batch: its microbatches g, g + R, ... in order. */
static void group_rows(groups_run *x, const train_opts *o, int g)
{
    const size_t per = (size_t)(o->r.batch / o->r.micro) * (size_t)o->r.seq;
    size_t k = 0;
    for (long long j = g; j < o->r.micro; j += x->R, k++) {
        memcpy(x->gtok + k * per, x->tokens + (size_t)j * per, per * sizeof *x->gtok);
        memcpy(x->gtgt + k * per, x->targets + (size_t)j * per, per * sizeof *x->gtgt);
        if (x->doc)
            memcpy(x->gdoc + k * per, x->doc + (size_t)j * per, per * sizeof *x->gdoc);
    }
}

/* One step of every group; *r: the step as the coordinator decides it
 * (the loss over the whole batch, the norm over every group's gradients). */
static int groups_step(groups_run *x, const train_opts *o, int64_t step, double lr,
                       nl_step_result *r)
{
    const int R = x->R, T = (int)o->r.seq, Bg = (int)(o->r.batch / R), Mg = (int)(o->r.micro / R);
    int64_t valid = 0;
    if (nl_objective_batch(x->ds, x->obj, &x->m[0]->cfg, 0, (uint64_t)o->r.seed, (uint64_t)step,
                           (int)o->r.batch, T, x->tokens, x->targets, x->doc, &valid,
                           &x->err) != NL_OK)
        return 1;
    double ce = 0.0, aux = 0.0, sumsq = 0.0;
    int64_t rows = 0;
    for (int g = 0; g < R; g++) {
        group_rows(x, o, g);
        if (nl_trainer_grads_packed(x->tr[g], x->gtok, x->gtgt, x->gdoc, Bg, T, Mg, &x->ce[g],
                                    &x->aux[g], &x->valid[g], &x->err) != NL_OK ||
            nl_cli_device_check(x->be, &x->err) != NL_OK)
            return 1;
        x->sumsq[g] = nl_trainer_grad_sumsq(x->tr[g]);
    }
    for (int g = 0; g < R; g++) { /* in group order, as the coordinator adds them */
        ce += x->ce[g];
        aux += x->aux[g];
        sumsq += x->sumsq[g];
        rows += x->valid[g];
    }
    nl_step_decide(r, ce, rows > 0 ? (double)rows : 1.0, aux, x->m[0]->cfg.aux_loss_coef, sumsq,
                   NL_TRAIN_CLIP_NORM);
    for (int g = 0; g < R && !r->skipped; g++) { /* each clips by its own norm */
        const double clip = nl_step_clip(sqrt(x->sumsq[g]), NL_TRAIN_CLIP_NORM);
        nl_trainer_step(x->tr[g], (float)lr, (float)clip, nl_adamw_defaults());
    }
    return nl_cli_device_check(x->be, &x->err) != NL_OK;
}

/* The outer step: the groups' deltas added in group order, the outer
 * step's weights into every group. */
static int groups_outer(groups_run *x, const train_opts *o)
{
    const size_t n = x->m[0]->n_params;
    for (int g = 0; g < x->R; g++) {
        x->be->download(x->be, x->w, x->m[g]->params, n * sizeof(float));
        for (size_t i = 0; i < n; i++) {
            const float d = x->anchor[i] - x->w[i];
            x->sum[i] = g == 0 ? d : x->sum[i] + d;
        }
    }
    nl_diloco_outer(x->sum, x->anchor, x->outer_m, x->sum, n, x->R, (float)o->outer_lr,
                    (float)o->outer_mu);
    for (int g = 0; g < x->R; g++)
        x->be->upload(x->be, x->m[g]->params, x->sum, n * sizeof(float));
    return nl_cli_device_check(x->be, &x->err) != NL_OK;
}

static int groups_steps(groups_run *x, const train_opts *o)
{
    const double t_begin = nl_mono_s();
    int64_t skipped = 0;
    for (int64_t step = 0; step < o->r.steps; step++) {
        const double t0 = nl_mono_s();
        const double lr = nl_lr_at(step, o->r.steps, o->r.warmup, o->r.lr, o->r.min_lr);
        nl_step_result r;
        if (groups_step(x, o, step, lr, &r) != 0 ||
            ((step + 1) % o->outer_every == 0 && groups_outer(x, o) != 0))
            return 1;
        skipped += r.skipped != 0;
        nl_train_step rep = nl_local_step_record(o, &r, step, 0, lr,
                                                 (double)o->r.batch * o->r.seq / (nl_mono_s() - t0),
                                                 t_begin, x->be->name);
        if (rep.has_eval &&
            nl_local_eval_loss(x->tr[0], x->ds, o, x->obj, &x->m[0]->cfg, x->tokens, x->targets,
                               x->doc, &rep.eval_loss, &x->err) != NL_OK)
            return 1;
        nl_train_report_step(&x->prog, &rep, x->logf);
        if (o->r.ckpt_every > 0 && (step + 1) % o->r.ckpt_every == 0 && step + 1 < o->r.steps) {
            nl_local_step_path(x->path, sizeof x->path, o, step + 1);
            if (nl_local_save(x->m[0], x->tr[0], o, &x->cm, x->path, step + 1, &x->err) != NL_OK)
                return 1;
            nl_train_report_checkpoint(&x->prog, x->path);
        }
    }
    nl_train_progress_break(&x->prog);
    nl_train_report_skipped(skipped);
    const char *out = o->out;
    if (!out)
        nl_local_step_path(x->path, sizeof x->path, o, o->r.steps);
    if (nl_local_save(x->m[0], x->tr[0], o, &x->cm, out ? out : x->path, o->r.steps, &x->err) !=
        NL_OK)
        return 1;
    fprintf(stderr, "wrote %s (step %lld; replica group 0's moments)\n", out ? out : x->path,
            o->r.steps);
    return 0;
}

static void groups_close(groups_run *x, int rc)
{
    for (int g = 0; g < x->R; g++) {
        if (x->tr)
            nl_trainer_destroy(&x->tr[g]);
        if (x->m)
            nl_model_destroy(&x->m[g]);
    }
    free(x->m);
    free(x->tr);
    free(x->ce);
    free(x->aux);
    free(x->sumsq);
    free(x->valid);
    free(x->anchor);
    free(x->outer_m);
    free(x->sum);
    free(x->w);
    free(x->tokens);
    free(x->targets);
    free(x->doc);
    free(x->gtok);
    free(x->gtgt);
    free(x->gdoc);
    free(x->cm.tokenizer);
    free(x->cm.init_seed);
    if (x->logf)
        fclose(x->logf);
    nl_local_unlock(&x->lk);
    nl_dataset_destroy(&x->ds);
    nl_backend_destroy(&x->be);
    if (rc) {
        nl_train_progress_break(&x->prog);
        fprintf(stderr, "neuroctl train: %s (%s)\n", x->err.msg, nl_status_str(x->err.status));
    }
}

int nl_local_groups(const train_opts *o)
{
    groups_run run = {.R = (int)o->groups}, *x = &run;
    nl_train_progress_init(&x->prog, o->r.progress_s);
    int rc = groups_open(x, o) != 0 || groups_steps(x, o) != 0;
    groups_close(x, rc);
    return rc;
}
