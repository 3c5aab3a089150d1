/* A training run's per-step report, shared by local training (neuroctl
 * train in this process) and a cluster's training watched by the client,
 * so that both print the same progress line and write the same JSONL log
 * record for the same values. */
#ifndef NL_CLI_TRAIN_REPORT_H
#define NL_CLI_TRAIN_REPORT_H

#include <stdint.h>
#include <stdio.h>

/* One finished step and the run it belongs to. */
typedef struct nl_train_step {
    int64_t step;  /* 1-based: the step just finished */
    int64_t steps; /* the step the run ends at */
    double loss, ce_loss, aux_loss, lr, grad_norm, tokens_per_s;
    int skipped;        /* non-finite loss or gradient: the weights did not change */
    int has_eval;       /* eval_loss is set */
    double eval_loss;   /* mean held-out cross-entropy */
    int64_t start_step; /* steps done before this run began (0, or a resume's step) */
    double start_time;  /* nl_train_clock() when this run's first step began (for the ETA) */
} nl_train_step;

/* Monotonic seconds. */
double nl_train_clock(void);

/* Report step s: on stderr, for a skipped step the "non-finite" message,
 * then the progress line ("\r"-refreshed when tty, else one line per
 * step) with the ETA from start_step, start_time and now, and the eval
 * loss when there is one; to log (may be NULL), one JSON object and a
 * flush. */
void nl_train_report_step(const nl_train_step *s, int tty, FILE *log);

/* "checkpoint PATH" on stderr, on a line of its own. */
void nl_train_report_checkpoint(const char *path, int tty);

/* At the end of a run: how many steps were skipped, if any. */
void nl_train_report_skipped(int64_t skipped);

#endif
