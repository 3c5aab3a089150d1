/* What local training (neuroctl train in this process) and a cluster's
 * training watched by the client share, so that both take the same flags
 * with the same defaults and checks, print the same progress line and
 * write the same JSONL log record for the same values. */
#ifndef NL_CLI_TRAIN_REPORT_H
#define NL_CLI_TRAIN_REPORT_H

#include <stdint.h>
#include <stdio.h>

#include "base/args.h"
#include "base/clock.h"

/* The run's options: the same flags, defaults and checks everywhere (the
 * ranges, defaults and batch rule of net/trainparams.h). */
typedef struct nl_train_run {
    long long steps, batch, seq, micro, seed, warmup, eval_every, eval_batches, ckpt_every;
    double lr, min_lr, holdout;
    double progress_s; /* --progress-every: seconds between progress lines into a file or pipe */
    int recompute;
    int pack; /* --pack: packed rows, <|end|> ends a document (core/train/objective.h) */
} nl_train_run;

/* The flags nl_train_run_read reads (in an nl_flag table). */
#define NL_TRAIN_RUN_FLAGS                                                                         \
    {"steps", 1, "optimizer steps in all (a resumed run continues to this step)", NULL},           \
        {"batch", 1, "sequences per step (default 8)", NULL},                                      \
        {"seq", 1, "positions per sequence (default 256)", NULL},                                  \
        {"microbatches", 1, "split each batch into M microbatches (default 1)", NULL},             \
        {"lr", 1, "peak learning rate (default 3e-4)", NULL},                                      \
        {"min-lr", 1, "learning rate at the end of the cosine decay (default lr / 10)", NULL},     \
        {"warmup", 1, "linear warm-up steps (default steps / 10)", NULL},                          \
        {"seed", 1, "data-order seed (default 0)", NULL},                                          \
        {"holdout", 1, "share of the data held out for evaluation (default 0.1)", NULL},           \
        {"eval-every", 1, "evaluate held-out loss every K steps (default 0: never)", NULL},        \
        {"eval-batches", 1, "held-out batches per evaluation (default 4)", NULL},                  \
        {"checkpoint-every", 1, "write a checkpoint every K steps (default 0: never)", NULL},      \
        {"log", 1, "append one JSON object per step to this file", NULL},                          \
        {"progress-every", 1,                                                                      \
         "S: into a file or pipe, a progress line every S seconds (default 10; 0: every step; "    \
         "a terminal redraws one line in place)",                                                  \
         NULL},                                                                                    \
        {"recompute", 0, "recompute each layer's activations in the backward pass", NULL},         \
    {                                                                                              \
        "pack", 0,                                                                                 \
            "packed rows: <|end|> (id 257, placed in a .tok file) ends a document; attention "     \
            "stays inside one and positions restart after it, and no prediction crosses it "       \
            "(not with classify)",                                                                 \
            NULL                                                                                   \
    }

/* Read the run's options (--steps must be there: check it first) with
 * their defaults, ranges and cross-checks. 0, or the exit code after the
 * fault is printed (2: usage). */
int nl_train_run_read(const nl_flag *flags, nl_train_run *r);

/* neuroctl finetune's adapter flags (--lora-rank, --lora-alpha,
 * --lora-targets), local or on a cluster, with the defaults and ranges of
 * net/trainparams.h: *targets is the flag's or the default's text, *bits
 * it parsed (core/model/lora.h). 0, or the exit code after the fault is printed
 * (2: usage). */
int nl_train_lora_read(const nl_flag *flags, long long *rank, double *alpha, const char **targets,
                       int *bits);

/* The run's options into their keys of a training request (the other
 * fields of p are left as they are). */
struct nl_trainparams;
void nl_train_run_params(const nl_train_run *r, struct nl_trainparams *p);

/* One finished step and the run it belongs to. */
typedef struct nl_train_step {
    int64_t step;  /* 1-based: the step just finished */
    int64_t steps; /* the step the run ends at */
    double loss, ce_loss, aux_loss, lr, grad_norm, tokens_per_s;
    int skipped;        /* non-finite loss or gradient: the weights did not change */
    int has_eval;       /* eval_loss is set */
    double eval_loss;   /* mean held-out cross-entropy */
    int64_t start_step; /* steps done before this run began (0, or a resume's step) */
    double start_time;  /* nl_mono_s() when this run's first step began (for the ETA) */
    const char *device; /* where it computes: "cpu", "cuda:0"; a cluster's stages joined by
                           ',' in stage order ("cuda:0,cpu"); NULL: not known */
    int tf32;           /* 1: TF32 GEMMs allowed, 0: FP32, -1: not known (a cluster) */
    /* a cluster's checks so far (docs/security.md): hops whose two ends
     * reported other digests, (stage, microbatch)s redone by a verifier,
     * and of those found wrong; has_checks: they came */
    int has_checks;
    int64_t digest_mismatches, verified, verify_mismatches;
    int64_t verify_convicted, verify_outvoted; /* arbitrated: a stage wrong, a verifier wrong */
} nl_train_step;

/* Where the progress goes and what is on screen. On a terminal one line
 * is redrawn in place, cut to the terminal's width; into a file or pipe a
 * line is printed for the first and last steps, a step with an eval loss,
 * and otherwise at most every progress_s seconds. */
typedef struct nl_train_progress {
    int tty;           /* stderr is a terminal */
    double every_s;    /* not a tty: seconds between lines (0: every step) */
    double last_print; /* nl_mono_s() of the last line printed; 0: none yet */
    int open;          /* a redrawn line is on the terminal without its newline */
} nl_train_progress;

/* Look at stderr; every_s is --progress-every. */
void nl_train_progress_init(nl_train_progress *p, double every_s);

/* End the redrawn line, if one is open, so that a message can follow on
 * a line of its own (call before printing anything else to stderr). */
void nl_train_progress_break(nl_train_progress *p);

/* Report step s: on stderr, for a skipped step the "non-finite" message,
 * then the progress line (when due) with the ETA from start_step,
 * start_time and now, and the eval loss when there is one; to log (may be
 * NULL), one JSON object per step and a flush: {"step", "loss",
 * "ce_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "skipped",
 * "eval_loss"|absent, "device": str|null, "tf32": bool|null, and on a
 * cluster "digest_mismatches", "verified", "verify_mismatches",
 * "verify_convicted", "verify_outvoted"}. */
void nl_train_report_step(nl_train_progress *p, const nl_train_step *s, FILE *log);

/* "checkpoint PATH" on stderr, on a line of its own. */
void nl_train_report_checkpoint(nl_train_progress *p, const char *path);

/* At the end of a run: how many steps were skipped, if any. */
void nl_train_report_skipped(int64_t skipped);

#endif
