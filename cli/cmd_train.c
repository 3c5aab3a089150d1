/* neuroctl train and finetune (in this process): the command line, the
 * run's outputs and language-model training; classifier training is in
 * cmd_train_classify.c, what both share in cmd_train_impl.h; neuroctl grad
 * is in cmd_grad.c. */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/cmd_train_impl.h"
#include "cli/commands.h"
#include "cli/train_report.h"
#include "core/data/data.h"
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/formats/manifest.h"
#include "core/formats/safetensors.h"
#include "core/model/lora.h"
#include "core/model/memory.h"
#include "core/tokenizer/tokenizer.h"
#include "core/train/train.h"

/* ---------------------------------------------------------------- train */

/* finetune: attach fresh adapters (A drawn from the run's seed) to m. */
nl_status nl_local_attach_lora(nl_lora **lo, nl_model *m, const train_opts *o, int rows,
                               nl_error *err)
{
    if (o->lora_rank <= 0)
        return NL_OK;
    nl_status st =
        nl_lora_new(lo, m, (int)o->lora_rank, (float)o->lora_alpha, o->lora_targets, rows, err);
    if (st == NL_OK)
        st = nl_lora_init_random(*lo, (uint64_t)o->r.seed, err);
    if (st == NL_OK)
        fprintf(stderr,
                "LoRA rank %lld, alpha %g: %zu adapter parameters train, the base is "
                "frozen\n",
                o->lora_rank, o->lora_alpha, (*lo)->n_params);
    return st;
}

/* finetune's output: the adapter file, with the base checkpoint's SHA-256. */
nl_status nl_local_save_adapter(const nl_lora *lo, const train_opts *o, nl_error *err)
{
    char sha[65];
    uint64_t bytes = 0;
    nl_status st = nl_file_sha256(o->model, sha, &bytes, err);
    if (st == NL_OK)
        st = nl_lora_save(lo, o->out, sha, err);
    if (st == NL_OK)
        fprintf(stderr, "wrote adapters %s\n", o->out);
    return st;
}

/* Which objective a run trains (core/train/objective.h): --objective, else the
 * config's, checked against the model (and --pack with it). */
nl_status nl_local_objective(const train_opts *o, const nl_config *c, int *obj, nl_error *err)
{
    *obj = NL_OBJ_MODEL;
    if (o->objective && nl_objective_parse(o->objective, obj, err) != NL_OK)
        return nl_error_prefix(err, "--objective");
    nl_status st = nl_objective_check(c, obj, err);
    return st == NL_OK && o->r.pack ? nl_objective_check_pack(c, *obj, err) : st;
}

nl_status nl_local_eval_loss(nl_trainer *tr, const nl_dataset *ds, const train_opts *o, int obj,
                             const nl_config *c, int32_t *tokens, int32_t *targets, int32_t *doc,
                             double *loss, nl_error *err)
{
    const int B = (int)o->r.batch, T = (int)o->r.seq, mb = (int)(o->r.batch / o->r.micro);
    double ce = 0.0;
    int64_t valid = 0, n = 0;
    nl_status st = NL_OK;
    for (long long i = 0; i < o->r.eval_batches && st == NL_OK; i++) {
        st = nl_objective_batch(ds, obj, c, 1, (uint64_t)o->r.seed, (uint64_t)i, B, T, tokens,
                                targets, doc, &n, err);
        valid += n;
        nl_trainer_begin_step(tr, (int64_t)B * T);
        for (int j = 0; j < o->r.micro && st == NL_OK; j++) {
            const size_t r0 = (size_t)j * mb * T;
            if ((st = nl_trainer_set_docs(tr, doc ? doc + r0 : NULL, mb * T, err)) == NL_OK)
                st = nl_trainer_forward(tr, 0, mb, T, tokens + r0, NULL, targets + r0, &ce, NULL,
                                        err);
        }
    }
    nl_trainer_set_docs(tr, NULL, 0, NULL);
    *loss = ce / (valid > 0 ? (double)valid : 1.0);
    return st;
}

/* The run's options and where it ran (device: the backend's name, which
 * nl_backend_parse_device has limited to "cpu", "cpu-devsim" or "cuda:N",
 * so it needs no escaping). */
static char *train_json(const train_opts *o, const char *device)
{
    char *s = malloc(640);
    if (s)
        snprintf(s, 640,
                 "{\"seed\":%lld,\"steps\":%lld,\"batch\":%lld,\"seq\":%lld,\"microbatches\":%lld,"
                 "\"lr\":%.9g,\"min_lr\":%.9g,\"warmup\":%lld,\"device\":\"%.64s\",\"tf32\":%s,"
                 "\"precision\":\"%s\"}",
                 o->r.seed, o->r.steps, o->r.batch, o->r.seq, o->r.micro, o->r.lr, o->r.min_lr,
                 o->r.warmup, device, o->tf32 ? "true" : "false", o->bf16 ? "bf16" : "fp32");
    return s;
}

static nl_status save_ckpt(nl_model *m, nl_trainer *tr, const train_opts *o, const carried_meta *cm,
                           const char *path, int64_t step, nl_error *err)
{
    char *tj = train_json(o, m->be->name);
    nl_ckpt_extra opt = {.m = nl_trainer_moment(tr, 0),
                         .v = nl_trainer_moment(tr, 1),
                         .adam_steps = nl_trainer_adam_steps(tr),
                         .train_json = tj,
                         .tokenizer = cm->tokenizer,
                         .init_seed = cm->init_seed};
    nl_status st = nl_checkpoint_save(m, path, step, &opt, err);
    free(tj);
    return st;
}

/* Text goes through the model's tokenizer when it has one; a .tok file
 * or a byte-level model reads ids directly. */
static nl_status load_data(nl_dataset **ds, const train_opts *o, const char *model,
                           const char *tok_text, int64_t vocab, nl_error *err)
{
    nl_dataset_info info;
    nl_status st =
        nl_dataset_load_model(ds, o->data, tok_text, vocab, o->r.holdout, model, &info, err);
    if (st == NL_OK && info.tokenized)
        fprintf(stderr, "tokenized %s: %zu bytes -> %zu tokens in %.1f s\n", o->data,
                info.text_bytes, (*ds)->n, info.encode_s);
    return st;
}

/* Ctrl-C: finish the step, keep a checkpoint, exit 130 (a second Ctrl-C
 * kills the process, but never in the middle of writing a file). */
static volatile sig_atomic_t interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    interrupted = 1;
}

/* save_ckpt with SIGINT held off, so that no Ctrl-C leaves a partial
 * temporary file behind. */
nl_status nl_local_save(nl_model *m, nl_trainer *tr, const train_opts *o, const carried_meta *cm,
                        const char *path, int64_t step, nl_error *err)
{
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &old);
    nl_status st = save_ckpt(m, tr, o, cm, path, step, err);
    sigprocmask(SIG_SETMASK, &old, NULL);
    return st;
}

void nl_local_step_path(char *buf, size_t cap, const train_opts *o, int64_t step)
{
    snprintf(buf, cap, "%s/step-%06" PRId64 ".safetensors", o->ckpt_dir, step);
}

/* The checkpoint directory, made and locked (once). */
nl_status nl_local_ckpt_dir(const train_opts *o, run_locks *lk, nl_error *err)
{
    if (lk->dir)
        return NL_OK;
    nl_status st = nl_file_mkdirs(o->ckpt_dir, err);
    return st == NL_OK
               ? nl_cli_lock(&lk->dir, "checkpoint-dir", o->ckpt_dir, "/.neuroctl.lock", err)
               : st;
}

nl_status nl_local_lock(const train_opts *o, run_locks *lk, nl_error *err)
{
    nl_status st = nl_cli_lock(&lk->out, "out", o->out, ".lock", err);
    if (st == NL_OK)
        st = nl_cli_lock(&lk->log, "log", o->log, ".lock", err);
    if (st == NL_OK && (o->r.ckpt_every > 0 || !o->out))
        st = nl_local_ckpt_dir(o, lk, err);
    return st;
}

void nl_local_unlock(run_locks *lk)
{
    nl_file_lock_release(&lk->dir);
    nl_file_lock_release(&lk->out);
    nl_file_lock_release(&lk->log);
}

/* A local step's progress record (local and classify training alike). */
nl_train_step nl_local_step_record(const train_opts *o, const nl_step_result *r, int64_t step,
                                   int64_t start, double lr, double tokens_per_s, double t_begin,
                                   const char *device)
{
    nl_train_step rep = {.step = step + 1,
                         .steps = o->r.steps,
                         .loss = r->loss,
                         .ce_loss = r->ce_loss,
                         .aux_loss = r->aux_loss,
                         .lr = lr,
                         .grad_norm = r->grad_norm,
                         .skipped = r->skipped,
                         .tokens_per_s = tokens_per_s,
                         .start_step = start,
                         .start_time = t_begin,
                         .device = device,
                         .tf32 = o->tf32};
    rep.has_eval =
        o->r.eval_every > 0 && ((step + 1) % o->r.eval_every == 0 || step + 1 == o->r.steps);
    return rep;
}

/* A local training run's state, from its setup (run_open) to its end
 * (run_close). */
typedef struct train_run {
    nl_error err;
    nl_backend *be;
    nl_model *m;
    nl_trainer *tr;
    nl_dataset *ds;
    nl_lora *lo;
    FILE *logf;
    int32_t *tokens, *targets; /* (batch, seq) */
    int32_t *doc;              /* (batch, seq): --pack's documents, or NULL */
    int64_t start, step;       /* the step it began at, the steps done */
    int obj;
    carried_meta cm;
    run_locks lk;
    nl_train_progress prog;
    char path[4096], hint[8400];
} train_run;

/* The device first (one that cannot train is refused before any work),
 * then the data (its load-time peak does not stack on the model's), the
 * model, the trainer and the run's outputs; the run is announced. 0, or 1
 * when it fails (x->err says why). */
static int run_open(train_run *x, const train_opts *o)
{
    nl_error *err = &x->err;
    const int B = (int)o->r.batch, T = (int)o->r.seq, M = (int)o->r.micro, mb = B / M;
    const char *src = o->resume ? o->resume : o->model;
    nl_config cfg;
    if (nl_cli_backend_new(&x->be, o->device, (int)o->threads, o->tf32, o->bf16, 1, err) != NL_OK ||
        nl_checkpoint_read_config(src, &cfg, NULL, err) != NL_OK ||
        nl_checkpoint_meta(src, "tokenizer", &x->cm.tokenizer, err) != NL_OK ||
        nl_checkpoint_init_seed(src, &x->cm.init_seed, err) != NL_OK ||
        nl_local_objective(o, &cfg, &x->obj, err) != NL_OK ||
        load_data(&x->ds, o, src, x->cm.tokenizer, cfg.vocab_size, err) != NL_OK ||
        nl_checkpoint_load(&x->m, x->be, src, 0, -1, 1, 1, &x->start, err) != NL_OK ||
        nl_local_attach_lora(&x->lo, x->m, o, mb * T, err) != NL_OK ||
        nl_trainer_new(&x->tr, x->m, mb * T, 1, (int)o->r.recompute, err) != NL_OK)
        return 1;
    if (o->resume) {
        int64_t adam = 0;
        if (nl_checkpoint_load_optim(x->m, o->resume, nl_trainer_moment(x->tr, 0),
                                     nl_trainer_moment(x->tr, 1), &adam, NULL, err) != NL_OK)
            return 1;
        nl_trainer_set_adam_steps(x->tr, adam);
        if (x->start >= o->r.steps) {
            nl_error_set(err, NL_ERR_INVALID,
                         "--steps %lld: the checkpoint is already at step %" PRId64, o->r.steps,
                         x->start);
            return 1;
        }
        fprintf(stderr, "resuming %s at step %" PRId64 " (%" PRId64 " optimizer steps)\n",
                o->resume, x->start, adam);
    } else {
        x->start = 0;
    }
    x->tokens = malloc((size_t)B * T * sizeof *x->tokens);
    x->targets = malloc((size_t)B * T * sizeof *x->targets);
    x->doc = o->r.pack ? malloc((size_t)B * T * sizeof *x->doc) : NULL;
    if (!x->tokens || !x->targets || (o->r.pack && !x->doc)) {
        nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        return 1;
    }
    if (nl_local_lock(o, &x->lk, err) != NL_OK)
        return 1;
    if (o->log && !(x->logf = fopen(o->log, "a"))) {
        nl_error_set(err, NL_ERR_IO, "%s: cannot open the log", o->log);
        return 1;
    }
    nl_mem_opts mo = {.training = 1,
                      .micro_rows = mb * T,
                      .in_flight = 1,
                      .recompute = (int)o->r.recompute,
                      .precision = nl_mem_precision(x->be)};
    nl_mem_estimate me = nl_memory_estimate(&x->m->cfg, x->m->cfg.num_layers, 1, 1, &mo);
    if (x->lo) /* finetune: no moments for the frozen base; the adapters' four buffers instead */
        me.total = me.total - me.moments + (uint64_t)x->lo->n_params * 4 * sizeof(float);
    fprintf(stderr,
            "training %" PRId64 " parameters on %zu tokens (%zu held out): %lld steps of %d x %d "
            "in %d microbatches on %s (TF32 %s), GEMMs in %s; memory model: %.1f MiB (+ %.1f MiB "
            "of data)\n",
            nl_config_param_count(&x->m->cfg), x->ds->n_train, x->ds->n - x->ds->n_train,
            o->r.steps, B, T, M, x->be->name, o->tf32 ? "on" : "off", o->bf16 ? "bf16" : "FP32",
            (double)me.total / (1 << 20), (double)x->ds->n * 4 / (1 << 20));
    if (o->r.pack) {
        size_t ends = 0;
        for (size_t i = 0; i < x->ds->n; i++)
            ends += x->ds->ids[i] == NL_TOKEN_END;
        fprintf(stderr, "packed rows: %zu <|end|> ids in the data end documents\n", ends);
    }
    return 0;
}

/* The steps, until the last or Ctrl-C: each reported, evaluated and
 * checkpointed when due; x->step counts those done. 0, or 1 when one
 * fails (x->err says why). */
static int run_steps(train_run *x, const train_opts *o)
{
    nl_error *err = &x->err;
    const int B = (int)o->r.batch, T = (int)o->r.seq, M = (int)o->r.micro;
    const nl_adamw_opts adam = nl_adamw_defaults();
#ifdef NL_TEST_HOOKS
    const char *inject = getenv("NL_TEST_INJECT_NAN_STEP"); /* test hook (test builds only) */
#else
    const char *inject = NULL;
#endif
    const double t_begin = nl_mono_s();
    int64_t skipped = 0;
    for (x->step = x->start; x->step < o->r.steps && !interrupted; x->step++) {
        const int64_t step = x->step;
        double t0 = nl_mono_s();
        const double lr = nl_lr_at(step, o->r.steps, o->r.warmup, o->r.lr, o->r.min_lr);
        nl_step_result r;
        int64_t valid = 0;
        if (nl_objective_batch(x->ds, x->obj, &x->m->cfg, 0, (uint64_t)o->r.seed, (uint64_t)step, B,
                               T, x->tokens, x->targets, x->doc, &valid, err) != NL_OK)
            return 1;
        if (inject && atoll(inject) == step)
            nl_trainer_inject_nan(x->tr);
        if (nl_trainer_step_packed(x->tr, x->tokens, x->targets, x->doc, B, T, M, (float)lr,
                                   (float)NL_TRAIN_CLIP_NORM, adam, &r, err) != NL_OK ||
            nl_cli_device_check(x->be, err) != NL_OK)
            return 1;
        skipped += r.skipped != 0;
        nl_train_step rep = nl_local_step_record(
            o, &r, step, x->start, lr, (double)B * T / (nl_mono_s() - t0), t_begin, x->be->name);
        if (rep.has_eval && nl_local_eval_loss(x->tr, x->ds, o, x->obj, &x->m->cfg, x->tokens,
                                               x->targets, x->doc, &rep.eval_loss, err) != NL_OK)
            return 1;
        nl_train_report_step(&x->prog, &rep, x->logf);
        if (!x->lo && o->r.ckpt_every > 0 && (step + 1) % o->r.ckpt_every == 0 &&
            step + 1 < o->r.steps) {
            nl_local_step_path(x->path, sizeof x->path, o, step + 1);
            if (nl_local_save(x->m, x->tr, o, &x->cm, x->path, step + 1, err) != NL_OK)
                return 1;
            nl_train_report_checkpoint(&x->prog, x->path);
        }
    }
    nl_train_progress_break(&x->prog);
    nl_train_report_skipped(skipped);
    return 0;
}

/* Ctrl-C ended the run after x->step steps: they are kept for a resume
 * (the adapters in --out, or a checkpoint). Returns the exit code. */
static int run_interrupted(train_run *x, const train_opts *o)
{
    const int64_t step = x->step;
    if (step == x->start) {
        fprintf(stderr, "interrupted before step %" PRId64 " ended: nothing new to keep\n",
                x->start + 1);
        return 130;
    }
    if (x->lo) { /* finetune: the adapters of the steps done, in --out */
        if (nl_local_save_adapter(x->lo, o, &x->err) != NL_OK)
            return 1;
        fprintf(stderr, "interrupted after step %" PRId64 " of %lld: kept the adapters in %s\n",
                step, o->r.steps, o->out);
        return 130;
    }
    nl_local_step_path(x->path, sizeof x->path, o, step);
    const int saved = o->r.ckpt_every > 0 && step % o->r.ckpt_every == 0; /* just now */
    if (!saved && (nl_local_ckpt_dir(o, &x->lk, &x->err) != NL_OK ||
                   nl_local_save(x->m, x->tr, o, &x->cm, x->path, step, &x->err) != NL_OK))
        return 1;
    fprintf(stderr,
            "interrupted after step %" PRId64 " of %lld: kept %s (continue with --resume %s)\n",
            step, o->r.steps, x->path, x->path);
    return 130;
}

/* The run is done: the adapters, or the trained model, kept. Returns the
 * exit code. */
static int run_save(train_run *x, const train_opts *o)
{
    if (x->lo) /* finetune: the adapters, in --out (the base stays as it was) */
        return nl_local_save_adapter(x->lo, o, &x->err) != NL_OK;
    /* the last step is always kept: in --out, or as the last checkpoint */
    char *path = x->path;
    const size_t cap = sizeof x->path;
    if (!o->out)
        nl_local_step_path(path, cap, o, o->r.steps);
    if (nl_local_save(x->m, x->tr, o, &x->cm, o->out ? o->out : path, o->r.steps, &x->err) !=
        NL_OK) {
        /* the disk filled, or the place went away, after the check at the
         * start: the trained model goes to the checkpoint directory, or
         * the temporary one, and the message says where */
        nl_error kept = {0};
        const char *dirs[] = {o->ckpt_dir, getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp"};
        for (int i = 0; o->out && i < 2; i++) {
            if (i == 0)
                nl_local_step_path(path, cap, o, o->r.steps);
            else
                snprintf(path, cap, "%s/neuroctl-train-%ld-step-%06lld.safetensors", dirs[1],
                         (long)getpid(), o->r.steps);
            if ((i == 1 || nl_local_ckpt_dir(o, &x->lk, &kept) == NL_OK) &&
                nl_local_save(x->m, x->tr, o, &x->cm, path, o->r.steps, &kept) == NL_OK) {
                snprintf(x->hint, sizeof x->hint, "kept the trained model in %s instead", path);
                return 1;
            }
        }
        return 1;
    }
    fprintf(stderr, "wrote %s (step %lld)\n", o->out ? o->out : path, o->r.steps);
    return 0;
}

/* Frees the run and, when it failed (rc 1), says why and what was kept. */
static void run_close(train_run *x, const train_opts *o, int rc)
{
    const int64_t step = x->step;
    if (rc == 1 && !x->hint[0] && x->err.status == NL_ERR_IO && step > x->start &&
        o->r.ckpt_every > 0) {
        /* a write failed mid-run (a full disk): the last checkpoint kept */
        char last[4096];
        nl_local_step_path(last, sizeof last, o, step / o->r.ckpt_every * o->r.ckpt_every);
        if (step >= o->r.ckpt_every && access(last, R_OK) == 0)
            snprintf(x->hint, sizeof x->hint,
                     "the last checkpoint is %s (continue with --resume %s)", last, last);
    }
    free(x->cm.tokenizer);
    free(x->cm.init_seed);
    if (x->logf)
        fclose(x->logf);
    nl_local_unlock(&x->lk);
    free(x->tokens);
    free(x->targets);
    free(x->doc);
    nl_dataset_destroy(&x->ds);
    nl_trainer_destroy(&x->tr);
    nl_lora_destroy(&x->lo);
    nl_model_destroy(&x->m);
    nl_backend_destroy(&x->be);
    if (rc == 1) {
        nl_train_progress_break(&x->prog);
        fprintf(stderr, "neuroctl train: %s (%s)\n", x->err.msg, nl_status_str(x->err.status));
        if (x->hint[0])
            fprintf(stderr, "%s\n", x->hint);
    }
}

static int run_train(const train_opts *o)
{
    train_run run = {.obj = NL_OBJ_CLM}, *x = &run;
    struct sigaction sa = {.sa_handler = on_sigint, .sa_flags = SA_RESETHAND}, old_sa;
    int rc = 1;
    nl_train_progress_init(&x->prog, o->r.progress_s);
    sigemptyset(&sa.sa_mask);
    interrupted = 0;
    const int handler = sigaction(SIGINT, &sa, &old_sa) == 0;
    if (run_open(x, o) == 0 && run_steps(x, o) == 0)
        rc = interrupted && x->step < o->r.steps ? run_interrupted(x, o) : run_save(x, o);
    if (handler)
        sigaction(SIGINT, &old_sa, NULL);
    run_close(x, o, rc);
    return rc;
}

/* The flags against the model, before any work: --seq within its
 * max_seq_len (the default 256 shrinks to it), the inputs are files, and
 * --out may be written. Returns 0 or the exit code after saying why. */
static int check_against_model(const nl_flag *flags, train_opts *o)
{
    const char *src = o->resume ? o->resume : o->model;
    const char *src_flag = o->resume ? "resume" : "model";
    nl_error err = {0};
    nl_config cfg;
    int rc;
    if ((rc = nl_cli_input_file(src_flag, src)) || (rc = nl_cli_input_file("data", o->data)) ||
        (rc = nl_cli_may_write(flags, "out", o->out)))
        return rc;
    if (nl_checkpoint_read_config(src, &cfg, NULL, &err) != NL_OK) {
        fprintf(stderr, "--%s: %s (%s)\n", src_flag, err.msg, nl_status_str(err.status));
        return 1;
    }
    if (!nl_args_get(flags, "seq") && o->r.seq > cfg.max_seq_len) {
        o->r.seq = cfg.max_seq_len;
    } else if (o->r.seq > cfg.max_seq_len) {
        fprintf(stderr, "--seq %lld: the model's max_seq_len is %d (%s)\n", o->r.seq,
                cfg.max_seq_len, src);
        return 2;
    }
    return 0;
}

/* --groups R --outer-every H [--outer-lr X] [--outer-momentum M], with
 * what a cluster's DiLoCo refuses refused alike. 0, or the exit code after
 * saying why. */
static int groups_flags(const nl_flag *flags, int finetune, train_opts *o)
{
    o->outer_lr = NL_DILOCO_OUTER_LR;
    o->outer_mu = NL_DILOCO_OUTER_MOMENTUM;
    int rc;
    if ((rc = nl_args_int(flags, "groups", 2, 16, &o->groups)) ||
        (rc = nl_args_int(flags, "outer-every", 1, INT32_MAX, &o->outer_every)) ||
        (rc = nl_args_double(flags, "outer-lr", 0.0, 10.0, &o->outer_lr)) ||
        (rc = nl_args_double(flags, "outer-momentum", 0.0, 0.999, &o->outer_mu)))
        return rc;
    const int outer = nl_args_get(flags, "outer-every") || nl_args_get(flags, "outer-lr") ||
                      nl_args_get(flags, "outer-momentum");
    const long long H = o->outer_every;
    if (!o->groups && !outer)
        return 0;
    if (!o->groups || !H)
        fprintf(stderr, "--groups and --outer-every go together\n");
    else if (finetune || o->resume || !o->model)
        fprintf(stderr, "--groups: give --model (not --resume, nor finetune: DiLoCo's outer "
                        "state is not checkpointed)\n");
    else if (o->objective && strcmp(o->objective, "classify") == 0)
        fprintf(stderr, "--groups: not with --objective classify\n");
    else if (o->r.micro % o->groups != 0)
        fprintf(stderr, "--microbatches %lld: not a multiple of --groups %lld\n", o->r.micro,
                o->groups);
    else if (o->r.steps % H != 0)
        fprintf(stderr, "--steps %lld: not a multiple of --outer-every %lld\n", o->r.steps, H);
    else if (o->r.ckpt_every % H != 0)
        fprintf(stderr, "--checkpoint-every %lld: not a multiple of --outer-every %lld\n",
                o->r.ckpt_every, H);
    else
        return 0;
    return 2;
}

/* The flags of the one-process DiLoCo reference (groups_flags reads them). */
#define NL_TRAIN_GROUPS_FLAGS                                                                      \
    {"groups", 1,                                                                                  \
     "R: DiLoCo across R replica groups in this process (with --outer-every), the "                \
     "one-machine reference of a cluster's neurocoord --replicas R --outer-every H: "              \
     "microbatch i of every batch goes to group i mod R (--microbatches a multiple of R), "        \
     "each group an AdamW trainer of its own (loss over its own rows, clipped by its own "         \
     "norm), an outer step every H steps; group 0's weights and moments are written",              \
     NULL},                                                                                        \
        {"outer-every", 1,                                                                         \
         "H: with --groups, the outer step every H steps (--steps and "                            \
         "--checkpoint-every multiples of H)",                                                     \
         NULL},                                                                                    \
        {"outer-lr", 1, "with --groups: the outer step's learning rate (default 0.7)", NULL},      \
    {                                                                                              \
        "outer-momentum", 1, "with --groups: the outer step's Nesterov momentum (default 0.9)",    \
            NULL                                                                                   \
    }

/* train and finetune: the same run; finetune adds the LoRA flags, writes
 * the adapters and leaves the base as it was. */
static int train_main(int argc, char **argv, int finetune)
{
    nl_flag flags[] = {
        {"model", 1, "checkpoint to start from (safetensors)", NULL},
        {"data", 1,
         "training text (through the model's tokenizer; without one, bytes are ids) or a .tok "
         "file of little-endian uint32 ids",
         NULL},
        NL_TRAIN_RUN_FLAGS,
        {"checkpoint-dir", 1,
         "where checkpoints go (default: checkpoints); without --out the last step is saved "
         "there too, and Ctrl-C keeps the steps done there",
         NULL},
        {"out", 1,
         "final checkpoint (weights and optimizer state); finetune: the adapter file (the "
         "adapters, and the classifier head when the model has one)",
         NULL},
        NL_CLI_FORCE_FLAG,
        {"resume", 1, "continue from this checkpoint (weights, moments, step)", NULL},
        {"threads", 1, "worker threads (default: all cores)", NULL},
        {"device", 1,
         "D: where to train: cpu (default), cpu-devsim or cuda:N (a device whose backend cannot "
         "train is refused before any work)",
         NULL},
        NL_CLI_TF32_FLAG,
        {"objective", 1,
         "clm (next token), mlm (masked tokens, DESIGN 6: mask_prob of the positions, mask id "
         "<|pad|>) or classify (DATA: one label<TAB>text example per line; the model needs "
         "num_classes; each evaluation scores the whole held-out split, each example once); "
         "default: the config's objective. The same on a cluster (--cluster: the coordinator "
         "checks it against the cluster's model)",
         NULL},
        {"lora-rank", 1, "finetune: rank r of the adapters (default 8)", NULL},
        {"lora-alpha", 1, "finetune: alpha; the adapters add (alpha / r) x A^T B^T (default 16)",
         NULL},
        {"lora-targets", 1,
         "finetune: the maps adapted, of wq,wk,wv,wo,w_gate,w_up,w_down (the last three: every "
         "expert's; default wq,wk,wv,wo)",
         NULL},
        NL_CLI_PRECISION_FLAG,
        NL_TRAIN_GROUPS_FLAGS,
        {0}};
    const char *usage =
        "neuroctl train --model MODEL --data DATA --steps N [--batch B] [--seq T] "
        "[--microbatches M] [--lr X] [--warmup W] [--seed S] [--eval-every K] "
        "[--checkpoint-every K] [--log LOG.jsonl] [--out FINAL.safetensors [--force]] "
        "[--resume CKPT] [--threads N] [--device D] [--tf32] [--precision fp32|bf16] "
        "[--progress-every S] [--objective clm|mlm|classify] [--pack] "
        "[--groups R --outer-every H [--outer-lr X] [--outer-momentum M]]" NL_CLI_CLUSTER_USAGE(
            "train");
    const char *ft_usage =
        "neuroctl finetune --model BASE --data DATA --steps N --out ADAPTER.safetensors "
        "[--lora-rank R] [--lora-alpha A] [--lora-targets wq,wk,wv,wo] [--objective "
        "clm|mlm|classify] [train's flags]";
    if (finetune)
        usage = ft_usage;
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    train_opts o = {0};
    o.model = nl_args_get(flags, "model");
    o.data = nl_args_get(flags, "data");
    o.log = nl_args_get(flags, "log");
    o.out = nl_args_get(flags, "out");
    o.resume = nl_args_get(flags, "resume");
    o.ckpt_dir = nl_args_get(flags, "checkpoint-dir");
    o.objective = nl_args_get(flags, "objective");
    if (!o.model && !o.resume) {
        fprintf(stderr, "neuroctl train: missing --model (or --resume)\n\n");
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if (o.model && o.resume && !finetune) { /* the checkpoint's own model goes on, not --model's */
        fprintf(stderr,
                "neuroctl train: give --model or --resume, not both (--resume %s continues "
                "that checkpoint's model)\n",
                o.resume);
        return 2;
    }
    if ((rc = nl_cli_require("train", usage, flags, "data", "steps", (const char *)NULL)))
        return rc;
    if ((rc = nl_train_run_read(flags, &o.r)) ||
        (rc = nl_args_int(flags, "threads", 0, 1024, &o.threads)) ||
        (rc = nl_cli_device_flags(flags, &o.device, &o.tf32, &o.bf16)))
        return rc;
    if ((rc = check_against_model(flags, &o)))
        return rc;
    const char *lr_rank = nl_args_get(flags, "lora-rank"),
               *lr_alpha = nl_args_get(flags, "lora-alpha"),
               *lr_targets = nl_args_get(flags, "lora-targets");
    if (!finetune && (lr_rank || lr_alpha || lr_targets)) {
        fprintf(stderr, "--lora-*: use neuroctl finetune\n");
        return 2;
    }
    if (finetune) {
        const char *text = NULL;
        if ((rc = nl_train_lora_read(flags, &o.lora_rank, &o.lora_alpha, &text, &o.lora_targets)))
            return rc;
        if (!o.out || o.resume || !o.model) {
            fprintf(stderr, "neuroctl finetune: give --model and --out (no --resume)\n");
            return 2;
        }
    }
    if ((rc = groups_flags(flags, finetune, &o)))
        return rc;
    if (!o.ckpt_dir)
        o.ckpt_dir = "checkpoints";
    /* every output is tried before the first step: a run must not learn
     * at its end that it has nowhere to go (the checkpoint directory is
     * made once the run starts, so that a run refused first leaves none) */
    if (((o.r.ckpt_every > 0 || !o.out) && nl_cli_can_write("checkpoint-dir", o.ckpt_dir, 1)) ||
        nl_cli_can_write("out", o.out, 0) || nl_cli_can_write("log", o.log, 0))
        return 1;
    if (o.objective && strcmp(o.objective, "classify") == 0) {
        if (o.resume || !o.model) {
            fprintf(stderr, "--objective classify: give --model (--resume is for clm and mlm)\n");
            return 2;
        }
        return nl_local_classify(&o);
    }
    return o.groups > 0 ? nl_local_groups(&o) : run_train(&o);
}

int nl_cmd_train(int argc, char **argv)
{
    return train_main(argc, argv, 0);
}

int nl_cmd_finetune(int argc, char **argv)
{
    return train_main(argc, argv, 1);
}
