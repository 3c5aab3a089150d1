/* neuroctl train against a cluster (--coordinator ... or --cluster DIR):
 * the same flags, progress line and log as local training, but the job
 * runs on the cluster's model. The client checks the flags, sends one
 * JOB_SUBMIT (kind train, no frames, the options as parameters, written
 * by net/trainparams.h), then follows the job (remote_train_watch.c: its
 * JOB_STATUS events, the progress line, the log) and, with --out, joins
 * the final checkpoint's shards into one file. Ctrl-C
 * cancels the job, which keeps the steps done in a checkpoint as local
 * training does. The protocol is in docs/training.md ("On a cluster"). */
#include <errno.h>
#include <inttypes.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "cli/remote.h"
#include "cli/remote_train.h"
#include "cli/train_report.h"
#include "core/formats/fileio.h"
#include "core/formats/manifest.h"
#include "core/model/lora.h"
#include "core/train/objective.h"
#include "net/trainparams.h"

#define PARAM_STR_MAX 4096 /* the wire's limit on a parameter string (trainparams: data) */

/* ---------------------------------------------------------------- flags */

/* --model, --threads and --device belong to local training; say why they
 * are refused. */
static int refuse_local_flags(int argc, char **argv, const nl_flag *flags)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--model") == 0) {
            fprintf(stderr, "--model: a cluster trains its own model (start the coordinator "
                            "with --model)\n");
            return 2;
        }
        if (nl_remote_refuse_node_flag(argv[i]))
            return 2;
        for (const nl_flag *fl = flags; fl->name; fl++)
            if (strncmp(argv[i], "--", 2) == 0 && strcmp(argv[i] + 2, fl->name) == 0 &&
                fl->takes_value)
                i++; /* skip its value */
    }
    return 0;
}

/* The absolute path of an existing file or directory, as the coordinator
 * will open it; prints the fault (naming the flag) and returns NULL. */
static char *abs_existing(const char *flag, const char *path)
{
    char *a = realpath(path, NULL);
    if (!a) {
        fprintf(stderr, "--%s: %s: %s\n", flag, path, strerror(errno));
        return NULL;
    }
    if (strlen(a) > PARAM_STR_MAX) {
        fprintf(stderr, "--%s: %s: the absolute path is longer than %d bytes\n", flag, path,
                PARAM_STR_MAX);
        free(a);
        return NULL;
    }
    return a;
}

/* --checkpoint-dir, absolute; not created yet (run() makes it once the
 * cluster answers), so that a run that never starts leaves no directory. */
static char *abs_ckpt_dir(const char *dir)
{
    if (access(dir, F_OK) == 0)
        return abs_existing("checkpoint-dir", dir);
    char cwd[PATH_MAX];
    const char *base = dir[0] == '/' ? "" : getcwd(cwd, sizeof cwd);
    char *a = base ? malloc(strlen(base) + strlen(dir) + 2) : NULL;
    if (!a || strlen(base) + 1 + strlen(dir) > PARAM_STR_MAX) {
        fprintf(stderr, "--checkpoint-dir: %s: cannot make the path absolute\n", dir);
        free(a);
        return NULL;
    }
    sprintf(a, "%s%s%s", base, base[0] ? "/" : "", dir);
    return a;
}

/* Local training's defaults and checks, then the paths the cluster needs.
 * Returns 0, 1 (a path is at fault) or 2 (usage). */
static int read_opts(rtrain_opts *o, const nl_flag *flags)
{
    int rc;
    o->log = nl_args_get(flags, "log");
    o->out = nl_args_get(flags, "out");
    if ((rc = nl_train_run_read(flags, &o->r)))
        return rc;
    o->seq_default = !nl_args_get(flags, "seq");
    /* the coordinator checks it against the model (mask id, classifier) */
    nl_error err = {0};
    const char *obj = nl_args_get(flags, "objective");
    o->objective = NL_OBJ_MODEL;
    if (obj && nl_objective_parse(obj, &o->objective, &err) != NL_OK) {
        fprintf(stderr, "--objective: %s\n", err.msg);
        return 2;
    }
    double lo = 0, hi = 0;
    nl_trainparams_range("learn_vocab", &lo, &hi);
    if (nl_args_get(flags, "learn-vocab") &&
        (rc = nl_args_int(flags, "learn-vocab", 1, (long long)hi, &o->learn_vocab)))
        return rc;
    o->final_ckpt = 1; /* the last step is always kept: joined into --out, or as a checkpoint */
    /* else the nodes make it when they write the last step: a job refused
     * at once leaves no empty directory behind */
    o->make_dir = o->out || o->r.ckpt_every > 0 || nl_args_get(flags, "checkpoint-dir");
    const char *dir = nl_args_get(flags, "checkpoint-dir"), *resume = nl_args_get(flags, "resume");
    if (nl_cli_input_file("data", nl_args_get(flags, "data")) ||
        !(o->data = abs_existing("data", nl_args_get(flags, "data"))) ||
        (resume && !(o->resume = abs_existing("resume", resume))) ||
        !(o->ckpt_dir = abs_ckpt_dir(dir ? dir : "checkpoints")) ||
        nl_cli_can_write("out", o->out, 0) || nl_cli_can_write("log", o->log, 0) ||
        nl_cli_may_write(flags, "out", o->out))
        return 1;
    return 0;
}

/* ---------------------------------------------------------------- the command */

/* The request, written by the schema the coordinator reads it with
 * (net/trainparams.h). */
static nl_status submit(nl_remote *r, const rtrain_opts *o, nl_error *err)
{
    nl_trainparams p;
    nl_wire_param ps[NL_TRAINPARAMS_MAX_KEYS];
    nl_trainparams_defaults(&p);
    p.data = o->data;
    p.checkpoint_dir = o->ckpt_dir;
    p.resume = o->resume; /* finetune has none: the adapters start afresh */
    nl_train_run_params(&o->r, &p);
    p.final_ckpt = o->final_ckpt;
    p.seq_default = o->seq_default;
    p.learn_vocab = o->learn_vocab;
    p.objective = o->objective; /* fine-tuning too: the adapters learn any objective */
    p.lora_rank = o->lora_rank;
    p.lora_alpha = o->lora_alpha;
    p.lora_targets = o->lora_targets;
    const uint32_t n =
        nl_trainparams_wire(&p, o->finetune ? NL_TRAINPARAMS_FINETUNE : NL_TRAINPARAMS_TRAIN, ps);
    return nl_remote_submit(r, o->finetune ? NL_JOB_FINETUNE : NL_JOB_TRAIN, ps, n, NULL, 0, 0,
                            err);
}

/* --out: join the final checkpoint's shards into one file. */
static nl_status export_out(const rtrain_watch *w, const char *out, nl_error *err)
{
    if (!w->manifest)
        return nl_error_set(err, NL_ERR_NOTFOUND,
                            "job %" PRIu64 " ended without a final checkpoint: nothing to write "
                            "to --out %s",
                            w->job, out);
    nl_manifest *m = NULL;
    nl_status st = nl_manifest_load(&m, w->manifest, err);
    if (st == NL_OK)
        st = nl_manifest_export(m, out, err);
    nl_manifest_destroy(&m);
    if (st == NL_OK)
        fprintf(stderr, "wrote %s\n", out);
    return st;
}

/* finetune --out: a copy of the adapter file the cluster joined. */
static nl_status adapter_out(const rtrain_watch *w, const char *out, nl_error *err)
{
    char *buf = NULL;
    size_t len = 0;
    if (!w->adapter)
        return nl_error_set(err, NL_ERR_NOTFOUND,
                            "job %" PRIu64 " ended without an adapter file: nothing to write to "
                            "--out %s",
                            w->job, out);
    nl_status st = nl_file_read_all(w->adapter, (size_t)1 << 34, &buf, &len, err);
    if (st == NL_OK)
        st = nl_file_write_atomic(out, buf, len, err);
    free(buf);
    if (st == NL_OK)
        fprintf(stderr, "wrote adapters %s (joined by the cluster in %s)\n", out, w->adapter);
    return st;
}

/* --attach: JOB_QUERY for the job makes this client the one it reports to. */
static nl_status attach(nl_remote *r, uint64_t job, nl_error *err)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
    m.u.job_ref.job_id = job;
    nl_status st = nl_sock_send(r->s, NULL, 0, &m, err);
    nl_wire_msg_free(&m);
    if (st == NL_OK)
        fprintf(stderr, "following job %" PRIu64 "\n", job);
    return st;
}

static int run(const nl_flag *flags, const rtrain_opts *o)
{
    nl_error err = {0};
    nl_remote r = {0};
    rtrain_watch w = {.o = o, .steps = o->r.steps};
    nl_file_lock *lk_out = NULL, *lk_log = NULL; /* as local training: one run at a time */
    struct sigaction sa = {.sa_handler = rtrain_on_sigint}, old;
    int rc = 1, handler = 0;
    nl_train_progress_init(&w.prog, o->r.progress_s);
    if (nl_cli_lock(&lk_out, "out", o->out, ".lock", &err) != NL_OK ||
        nl_cli_lock(&lk_log, "log", o->log, ".lock", &err) != NL_OK ||
        nl_remote_open(&r, flags, 600, &err) != NL_OK)
        goto out;
    /* made once the cluster answers */
    if (o->make_dir && (nl_file_mkdirs(o->ckpt_dir, &err) != NL_OK ||
                        nl_file_can_create(o->ckpt_dir, &err) != NL_OK)) {
        char why[sizeof err.msg];
        snprintf(why, sizeof why, "%s", err.msg);
        nl_error_set(&err, NL_ERR_IO, "--checkpoint-dir %s: %s", o->ckpt_dir, why);
        goto out;
    }
    if (o->log && !(w.log = fopen(o->log, "a"))) {
        nl_error_set(&err, NL_ERR_IO, "%s: cannot open the log", o->log);
        goto out;
    }
    /* from here Ctrl-C cancels the job; a second one leaves at once */
    sigemptyset(&sa.sa_mask);
    rtrain_interrupted = 0;
    handler = sigaction(SIGINT, &sa, &old) == 0;
    if ((o->attach ? attach(&r, o->attach, &err) : submit(&r, o, &err)) != NL_OK ||
        rtrain_follow(&r, &w, &err) != NL_OK)
        goto out;
    nl_error_clear(&err); /* the job was followed to its end: nothing before this is an error */
    nl_train_progress_break(&w.prog);
    nl_train_report_skipped(w.skipped);
    if (w.stopped) { /* cancelled: the steps done are kept, as local training keeps them */
        rc = 130;
        if (o->finetune && o->out && adapter_out(&w, o->out, &err) != NL_OK) {
            rc = 1;
            goto out;
        }
        if (o->finetune && o->out)
            fprintf(stderr, "interrupted after step %lld of %lld: kept the adapters in %s\n",
                    w.stop_step, (long long)w.steps, o->out);
        else if (w.manifest)
            fprintf(stderr,
                    "interrupted after step %lld of %lld: kept %s (continue with --resume %s)\n",
                    w.stop_step, (long long)w.steps, w.manifest, w.manifest);
        goto out;
    }
    /* a job that reached its last step while Ctrl-C was pressed is done,
     * as a local one is: --out is written and the exit is 0 */
    if (o->out &&
        (o->finetune ? adapter_out(&w, o->out, &err) : export_out(&w, o->out, &err)) != NL_OK)
        goto out;
    /* the last line says where the last step is kept */
    if (!o->out && w.manifest)
        fprintf(stderr, "wrote the final checkpoint %s\n", w.manifest);
    rc = 0;
out:
    if (handler)
        sigaction(SIGINT, &old, NULL);
    if (rtrain_interrupted && rc == 1)
        rc = 130;
    nl_train_progress_break(&w.prog);
    /* (a job stopped by Ctrl-C has no error: the lines above say where its steps are) */
    if (rc && err.status != NL_OK && w.failed) /* the coordinator's message names the node and
                                                   the last checkpoint */
        fprintf(stderr, "neuroctl train: %s\n", err.msg);
    else if (rc && err.status != NL_OK)
        fprintf(stderr, "neuroctl train: %s (%s)\n", err.msg, nl_status_str(err.status));
    nl_remote_close(&r);
    if (w.log)
        fclose(w.log);
    nl_file_lock_release(&lk_log);
    nl_file_lock_release(&lk_out);
    free(w.last_ckpt);
    free(w.manifest);
    free(w.adapter);
    return rc;
}

/* neuroctl finetune's adapters (the schema's defaults and ranges, as
 * local finetune's), and the flags it refuses. 0, or 2 (usage). */
static int read_lora_opts(rtrain_opts *o, const nl_flag *flags)
{
    int bits = 0, rc;
    o->finetune = 1;
    if ((rc = nl_train_lora_read(flags, &o->lora_rank, &o->lora_alpha, &o->lora_targets, &bits)))
        return rc;
    if (!nl_args_get(flags, "out") || nl_args_get(flags, "resume") ||
        nl_args_get(flags, "attach") || nl_args_get(flags, "checkpoint-every") ||
        nl_args_get(flags, "learn-vocab")) {
        fprintf(stderr, "neuroctl finetune: give --out (no --resume, --attach, "
                        "--checkpoint-every or --learn-vocab: the adapters are written once, "
                        "at the end, on the base as it is)\n");
        return 2;
    }
    return 0;
}

static int remote_main(int argc, char **argv, int finetune)
{
    nl_flag flags[] = {
        {"data", 1, "training text or .tok file, on a filesystem the coordinator shares", NULL},
        NL_TRAIN_RUN_FLAGS,
        {"checkpoint-dir", 1, "where the cluster writes checkpoints (default: checkpoints)", NULL},
        {"out", 1, "join the final checkpoint's shards into this file (safetensors)", NULL},
        NL_CLI_FORCE_FLAG,
        {"resume", 1, "continue from this checkpoint manifest (or its directory)", NULL},
        {"learn-vocab", 1,
         "before training, the cluster's tokenizer learns up to N ids from --data (text) and the "
         "model's tables grow past their capacity (docs/cluster.md, \"Growth\")",
         NULL},
        {"objective", 1,
         "clm (next token), mlm (masked tokens) or classify (DATA: label<TAB>text lines; the "
         "model needs num_classes); default: the cluster model's config's objective; the "
         "coordinator checks it against the model",
         NULL},
        {"attach", 1,
         "follow training job JOB that runs already (after the client or the coordinator "
         "restarted; neuroctl jobs lists them): its progress, --log and --out",
         NULL},
        NL_REMOTE_FLAGS_TIMEOUT(
            "seconds without any message from the coordinator before giving up (default 600)"),
        {"lora-rank", 1, "finetune: rank r of the adapters (default 8)", NULL},
        {"lora-alpha", 1, "finetune: alpha; the adapters add (alpha / r) x A^T B^T (default 16)",
         NULL},
        {"lora-targets", 1,
         "finetune: the maps adapted, of wq,wk,wv,wo,w_gate,w_up,w_down (the last three: every "
         "expert's; default wq,wk,wv,wo)",
         NULL},
        {0}};
    if (finetune) { /* finetune's own words for the flags that differ */
        for (nl_flag *fl = flags; fl->name; fl++)
            if (strcmp(fl->name, "out") == 0)
                fl->help = "the adapter file (required): the cluster joins it from its stages' "
                           "shards, and the client copies it here";
            else if (strcmp(fl->name, "checkpoint-dir") == 0)
                fl->help = "where the stages write their adapter shards and the cluster joins "
                           "them (DIR/lora-job<ID>; default: checkpoints)";
            else if (strcmp(fl->name, "objective") == 0)
                fl->help = "what the adapters learn: clm (next token), mlm (masked tokens) or "
                           "classify (DATA: label<TAB>text lines; the model needs num_classes); "
                           "default: the cluster model's config's objective. With a "
                           "classification head (num_classes) the last stage trains a copy of "
                           "classifier.weight with the adapters and the adapter file carries it, "
                           "as local finetune's does";
            else if (strcmp(fl->name, "resume") == 0 || strcmp(fl->name, "learn-vocab") == 0 ||
                     strcmp(fl->name, "attach") == 0 || strcmp(fl->name, "checkpoint-every") == 0)
                fl->help = "train only (refused by finetune: the adapters start afresh on the "
                           "base as it is and are written once, at the end)";
    }
    const char *usage = "neuroctl train (--coordinator EP --key K --coordinator-key P | --cluster "
                        "DIR) --data DATA --steps N [--batch B] [--seq T] [--microbatches M] "
                        "[--lr X] [--warmup W] [--seed S] [--eval-every K] [--checkpoint-every K] "
                        "[--log LOG.jsonl] [--out FINAL.safetensors [--force]] "
                        "[--resume MANIFEST] [--learn-vocab N] [--objective clm|mlm|classify] "
                        "[--pack] | "
                        "--attach JOB [--log LOG.jsonl] "
                        "[--out FINAL.safetensors [--force]]";
    if (finetune)
        usage =
            "neuroctl finetune (--coordinator EP --key K --coordinator-key P | --cluster DIR) "
            "--data DATA --steps N --out ADAPTER.safetensors [--lora-rank R] [--lora-alpha A] "
            "[--lora-targets wq,wk,wv,wo[,w_gate,w_up,w_down]] [--objective clm|mlm|classify] "
            "[--pack] [--batch B] [--seq T] [--microbatches M] [--lr X] [--warmup W] [--seed S] "
            "[--eval-every K] [--log LOG.jsonl] [--checkpoint-dir D] [--force]";
    int rc = refuse_local_flags(argc, argv, flags);
    if (rc || (rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL)))
        return rc == 1 ? 0 : rc;
    rtrain_opts o = {0};
    const char *lr_rank = nl_args_get(flags, "lora-rank"),
               *lr_alpha = nl_args_get(flags, "lora-alpha");
    o.lora_targets = nl_args_get(flags, "lora-targets");
    if (!finetune && (lr_rank || lr_alpha || o.lora_targets)) {
        fprintf(stderr, "--lora-*: use neuroctl finetune\n");
        return 2;
    }
    if (finetune && (rc = read_lora_opts(&o, flags)))
        return rc;
    if (nl_args_get(flags, "attach")) {
        long long job = 0;
        if ((rc = nl_args_int(flags, "attach", 1, INT64_MAX, &job)))
            return rc;
        o.attach = (uint64_t)job;
        o.log = nl_args_get(flags, "log");
        o.out = nl_args_get(flags, "out");
        return nl_cli_can_write("out", o.out, 0) || nl_cli_can_write("log", o.log, 0)
                   ? 1
                   : run(flags, &o);
    }
    if (!nl_args_get(flags, "data") || !nl_args_get(flags, "steps")) {
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if ((rc = read_opts(&o, flags)) == 0)
        rc = run(flags, &o);
    free(o.data);
    free(o.resume);
    free(o.ckpt_dir);
    return rc;
}

int nl_cmd_remote_train(int argc, char **argv)
{
    return remote_main(argc, argv, 0);
}

int nl_cmd_remote_finetune(int argc, char **argv)
{
    return remote_main(argc, argv, 1);
}
