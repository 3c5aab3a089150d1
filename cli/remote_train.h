/* neuroctl train and finetune against a cluster, inside: the options
 * (cmd_remote_train.c reads them and submits the job) and what the client
 * knows of its job while it runs, which remote_train_watch.c follows from
 * the coordinator's JOB_STATUS events. Private to cli/. */
#ifndef NL_CLI_REMOTE_TRAIN_H
#define NL_CLI_REMOTE_TRAIN_H

#include <signal.h>
#include <stdint.h>
#include <stdio.h>

#include "cli/remote.h"
#include "cli/train_report.h"

typedef struct rtrain_opts {
    const char *log, *out;
    char *data, *resume, *ckpt_dir; /* absolute paths (malloc'd) */
    nl_train_run r;                 /* the flags local and cluster training share */
    int final_ckpt;
    int make_dir;    /* checkpoints asked for: the client makes the directory first */
    uint64_t attach; /* --attach JOB: follow it instead of submitting */
    int seq_default; /* --seq not given: the coordinator fits it to max_seq_len */
    /* neuroctl finetune: LoRA adapters on the cluster's frozen model */
    int finetune;
    long long lora_rank;
    double lora_alpha;
    const char *lora_targets;
    long long learn_vocab; /* --learn-vocab: ids the cluster's tokenizer learns from the data */
    int objective;         /* --objective (core/train/objective.h), or NL_OBJ_MODEL: the config's */
} rtrain_opts;

/* What the client knows of its job while it runs. */
typedef struct rtrain_watch {
    const rtrain_opts *o;
    FILE *log;
    nl_train_progress prog; /* the progress line on stderr */
    uint64_t job;           /* 0 until the coordinator acknowledges the submit */
    int acked, started;     /* acknowledged; start event seen */
    int64_t steps;          /* the run's last step */
    int64_t start_step;     /* for the ETA */
    double start_time;      /* for the ETA */
    int64_t skipped;        /* steps skipped for non-finite values */
    char *last_ckpt;        /* the last checkpoint announced */
    char *manifest;         /* the final checkpoint's manifest (done event), or NULL */
    char *adapter;          /* finetune: the joined adapter file (done event), or NULL */
    int ended;              /* the job reached DONE, FAILED or CANCELLED */
    int failed;             /* refused, failed or cancelled: err says so as it is */
    int stopped;            /* cancelled with the steps done kept (cancelled event) */
    long long stop_step;    /* the step it stopped at */
    char devices[512];      /* the stages' devices from the start event, "cuda:0,cpu", or "" */
    int replanned;          /* a replan event came: the next start is the same job going on */
} rtrain_watch;

/* Ctrl-C's so far (rtrain_on_sigint counts them): the first cancels the
 * job (which keeps the steps done), a second leaves at once. */
extern volatile sig_atomic_t rtrain_interrupted;
void rtrain_on_sigint(int sig);

/* Follow job w->job (or the one the submit just sent) until it ends:
 * progress on stderr, w->log, Ctrl-C cancels; err says why it failed. */
nl_status rtrain_follow(nl_remote *r, rtrain_watch *w, nl_error *err);

#endif
