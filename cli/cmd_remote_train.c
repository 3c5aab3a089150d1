/* neuroctl train against a cluster (--coordinator ... or --cluster DIR):
 * the same flags, progress line and log as local training, but the job
 * runs on the cluster's model. The client checks the flags, sends one
 * JOB_SUBMIT (kind train, no frames, the options as parameters), then
 * follows the job's JOB_STATUS messages, whose JSON frame carries the
 * events (start, step, checkpoint, done); it writes the log itself and,
 * with --out, joins the final checkpoint's shards into one file. Ctrl-C
 * cancels the job, which keeps the steps done in a checkpoint as local
 * training does. The protocol is in docs/training.md ("On a cluster"). */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/args.h"
#include "cli_io.h"
#include "commands.h"
#include "core/fileio.h"
#include "core/lora.h"
#include "core/manifest.h"
#include "core/objective.h"
#include "net/trainparams.h"
#include "remote.h"
#include "train_report.h"

#define PARAM_STR_MAX 4096 /* the wire's limit on a parameter string (trainparams: data) */
#define CANCEL_WAIT_S 5.0  /* after Ctrl-C, how long to wait for the submit's answer */
#define POLL_S 0.2         /* receive in slices this long to notice Ctrl-C */

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
    int objective;         /* --objective (core/objective.h), or NL_OBJ_MODEL: the config's */
} rtrain_opts;

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

/* --out's directory must be writable before hours of training. */
static int out_writable(const char *out)
{
    char *copy = strdup(out);
    const char *dir = copy ? dirname(copy) : ".";
    int rc = access(dir, W_OK);
    if (rc != 0)
        fprintf(stderr, "--out: cannot write into %s: %s\n", dir, strerror(errno));
    free(copy);
    return rc;
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
        (o->out && out_writable(o->out) != 0) || nl_cli_may_write(flags, "out", o->out))
        return 1;
    return 0;
}

/* ---------------------------------------------------------------- watching the job */

/* What the client knows of its job while it runs. */
typedef struct watch {
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
} watch;

/* Ctrl-C's so far: the first cancels the job (which keeps the steps
 * done), a second leaves at once */
static volatile sig_atomic_t interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    if (interrupted < 2)
        interrupted++;
}

static double num(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : NAN; /* a non-finite loss comes as null */
}

static long long integer(const json_t *o, const char *key, long long dflt)
{
    const json_t *v = json_object_get(o, key);
    return json_is_integer(v) ? (long long)json_integer_value(v) : dflt;
}

/* The stages' devices of a start event, joined by ',' in stage order
 * ("cuda:0,cpu"; "?" for a stage whose node the coordinator did not
 * name), or empty when the coordinator sent none. */
static void stage_devices(char *buf, size_t cap, const json_t *ev)
{
    const json_t *a = json_object_get(ev, "devices");
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; json_is_array(a) && i < json_array_size(a); i++) {
        const json_t *v = json_array_get(a, i);
        const char *d = json_is_string(v) ? json_string_value(v) : "?";
        int n = snprintf(buf + used, cap - used, "%s%.64s", i ? "," : "", d);
        if (n < 0 || (size_t)n >= cap - used) {
            buf[used] = '\0'; /* too many to name: the ones that fit */
            break;
        }
        used += (size_t)n;
    }
    for (char *p = buf; *p; p++) /* a node's text: nothing that drives a terminal */
        if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f)
            *p = '?';
}

/* The job lost a stage and goes on by itself: say so, and log it (a
 * record with "event" and no "step", so that step records stay keyed by
 * step). */
static void on_node_lost(watch *w, const json_t *ev)
{
    const char *why = json_string_value(json_object_get(ev, "why"));
    char safe[600];
    snprintf(safe, sizeof safe, "%s", why ? why : "a stage is lost");
    for (char *p = safe; *p; p++) /* a node's text: nothing that drives a terminal */
        if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f)
            *p = '?';
    nl_train_progress_break(&w->prog);
    fprintf(stderr, "%s at step %lld; resuming from step %lld (resume %lld of %lld)\n", safe,
            integer(ev, "lost_step", -1), integer(ev, "resume_step", -1), integer(ev, "resume", 0),
            integer(ev, "max_resumes", 0));
    if (w->log) {
        char *text = json_dumps(ev, JSON_COMPACT);
        if (text)
            fprintf(w->log, "%s\n", text);
        free(text);
        fflush(w->log);
    }
}

/* The model grew (issue 16): say so, and log it as a record with "event"
 * (its step as "grow_step": step records stay keyed by step). */
static void on_grow(watch *w, const json_t *ev)
{
    const json_t *from = json_object_get(ev, "from"), *to = json_object_get(ev, "to");
    const char *kind = json_string_value(json_object_get(ev, "kind"));
    const char *keys[] = {"vocab_size", "num_layers", "hidden_dim", "ffn_dim"};
    char what[256] = "";
    size_t at = 0;
    for (int i = 0; i < 4; i++) {
        const long long a = integer(from, keys[i], 0), b = integer(to, keys[i], 0);
        if (a != b && at < sizeof what)
            at += (size_t)snprintf(what + at, sizeof what - at, "%s%s %lld -> %lld", at ? ", " : "",
                                   keys[i], a, b);
    }
    nl_train_progress_break(&w->prog);
    fprintf(stderr, "the model grew (%s) at step %lld: %s\n", kind ? kind : "?",
            integer(ev, "step", -1), what[0] ? what : "the tokenizer only");
    if (w->log) {
        json_t *rec = json_deep_copy(ev);
        json_object_set_new(rec, "grow_step", json_integer(integer(ev, "step", -1)));
        json_object_del(rec, "step");
        char *text = rec ? json_dumps(rec, JSON_COMPACT) : NULL;
        if (text)
            fprintf(w->log, "%s\n", text);
        free(text);
        json_decref(rec);
        fflush(w->log);
    }
}

static void on_start(watch *w, const json_t *ev)
{
    const long long S = integer(ev, "start_step", 0);
    stage_devices(w->devices, sizeof w->devices, ev);
    w->steps = integer(ev, "steps", w->o->r.steps);
    w->start_step = S;
    w->start_time = nl_train_clock();
    w->started = 1;
    if (integer(ev, "resumes", 0) > 0) {
        fprintf(stderr, "resumed at step %lld on plan %lld, %.2f s after the loss\n", S,
                integer(ev, "plan", 0), num(ev, "since_lost_s"));
        if (w->log) {
            fprintf(w->log,
                    "{\"event\":\"resumed\",\"resume_step\":%lld,\"plan\":%lld,\"stages\":%lld,"
                    "\"since_lost_s\":%.3f}\n",
                    S, integer(ev, "plan", 0), integer(ev, "stages", 0),
                    isfinite(num(ev, "since_lost_s")) ? num(ev, "since_lost_s") : -1.0);
            fflush(w->log);
        }
    } else if (S > 0) {
        fprintf(stderr, "resuming at step %lld\n", S);
    }
    const int classify = json_object_get(ev, "examples") != NULL;
    const char *obj = json_string_value(json_object_get(ev, "objective"));
    char what[96], objective[48] = ""; /* next-token says nothing (as before objectives) */
    if (classify)
        snprintf(what, sizeof what, "%lld examples into %lld classes", integer(ev, "examples", 0),
                 integer(ev, "classes", 0));
    else
        snprintf(what, sizeof what, "%lld tokens", integer(ev, "tokens", 0));
    if (obj && strcmp(obj, "clm") != 0) /* a coordinator's word: letters only, or "?" */
        snprintf(objective, sizeof objective, " (objective %s)",
                 strlen(obj) < 16 && strspn(obj, "abcdefghijklmnopqrstuvwxyz") == strlen(obj)
                     ? obj
                     : "?");
    char lead[200]; /* what trains: the model, or adapters on it (it stays frozen) */
    if (w->o->finetune)
        snprintf(lead, sizeof lead, "fine-tuning rank-%lld adapters (%.60s) beside %lld frozen",
                 w->o->lora_rank, w->o->lora_targets, integer(ev, "params", 0));
    else
        snprintf(lead, sizeof lead, "training %lld", integer(ev, "params", 0));
    fprintf(stderr,
            "%s parameters on %s (%lld held out): %" PRId64 " steps of %lld x "
            "%lld in %lld microbatches on %lld pipeline stages%s%s%s%s\n",
            lead, what, integer(ev, "held_out", 0), w->steps, integer(ev, "batch", w->o->r.batch),
            integer(ev, "seq", w->o->r.seq), integer(ev, "microbatches", w->o->r.micro),
            integer(ev, "stages", 0), w->devices[0] ? " (devices " : "", w->devices,
            w->devices[0] ? ")" : "", objective);
}

static nl_status on_step(watch *w, const json_t *ev, nl_error *err)
{
    const long long k = integer(ev, "step", -1);
    if (k < 1)
        return nl_error_set(err, NL_ERR_PROTO, "job %" PRIu64 ": a step event without a step",
                            w->job);
    if (!w->started) { /* no start event: time from the first step seen */
        w->start_step = k - 1;
        w->start_time = nl_train_clock();
        w->started = 1;
    }
    w->steps = integer(ev, "steps", w->steps); /* an attached client learns it here */
    const json_t *ev_loss = json_object_get(ev, "eval_loss");
    nl_train_step s = {.step = k,
                       .steps = w->steps,
                       .loss = num(ev, "loss"),
                       .ce_loss = num(ev, "ce_loss"),
                       .aux_loss = num(ev, "aux_loss"),
                       .lr = num(ev, "lr"),
                       .grad_norm = num(ev, "grad_norm"),
                       .tokens_per_s = num(ev, "tokens_per_s"),
                       .skipped = json_is_true(json_object_get(ev, "skipped")),
                       .has_eval = ev_loss != NULL,
                       .eval_loss = num(ev, "eval_loss"),
                       .start_step = w->start_step,
                       .start_time = w->start_time,
                       .device = w->devices[0] ? w->devices : NULL,
                       .tf32 = -1 /* the nodes' --tf32 is not sent: the manifest records it */};
    /* a step event that names them (a coordinator that knows) says best */
    const json_t *dev = json_object_get(ev, "device"), *tf32 = json_object_get(ev, "tf32");
    if (json_is_string(dev))
        s.device = json_string_value(dev);
    if (json_is_boolean(tf32))
        s.tf32 = json_is_true(tf32);
    w->skipped += s.skipped;
    nl_train_report_step(&w->prog, &s, w->log);
    if (json_object_get(ev, "eval_accuracy")) { /* classify: over the whole held-out split */
        nl_train_progress_break(&w->prog);
        fprintf(stderr, "held-out accuracy %.4f\n", num(ev, "eval_accuracy"));
    }
    return NL_OK;
}

/* Keep a copy of a path (key) from an event. */
static nl_status keep_key(char **dst, const json_t *ev, const char *key, nl_error *err)
{
    const char *p = json_string_value(json_object_get(ev, key));
    if (!p)
        return NL_OK;
    free(*dst);
    if (!(*dst = strdup(p)))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    return NL_OK;
}

static nl_status keep_path(char **dst, const json_t *ev, nl_error *err)
{
    return keep_key(dst, ev, "manifest", err);
}

/* The status JSON frame, if the message has one (*ev NULL if not). */
static nl_status status_json(const watch *w, const nl_rx *rx, json_t **ev, nl_error *err)
{
    *ev = NULL;
    if (rx->msg.nframes != 1 || rx->msg.frames[0].t.dtype != NL_DTYPE_U8)
        return NL_OK;
    json_error_t je;
    *ev = json_loadb(rx->msg.frames[0].t.data, rx->msg.frames[0].len, 0, &je);
    if (!*ev || !json_is_object(*ev)) {
        json_decref(*ev);
        *ev = NULL;
        return nl_error_set(err, NL_ERR_PROTO, "job %" PRIu64 ": status JSON: %s", w->job,
                            je.text[0] ? je.text : "not an object");
    }
    return NL_OK;
}

/* One JOB_STATUS of this job. Sets w->ended when the job is over; a
 * failed or cancelled job is an error that carries the coordinator's
 * message (which names the node and the last checkpoint). */
static nl_status on_status(watch *w, const nl_rx *rx, nl_error *err)
{
    const nl_msg_job_status *s = &rx->msg.u.job_status;
    const int first = !w->acked;
    if (first) {
        w->acked = 1;
        w->job = s->job_id;
        if (s->job_id == 0) { /* refused: no job was made */
            w->ended = w->failed = 1;
            return nl_error_set(err, NL_ERR_STATE, "the coordinator refused the job: %s",
                                s->message);
        }
    } else if (s->job_id != w->job) {
        return NL_OK;
    }
    json_t *ev = NULL;
    nl_status st = status_json(w, rx, &ev, err);
    const char *event = json_string_value(json_object_get(ev, "event"));
    if (st == NL_OK && s->state == NL_JOB_CANCELLED && event && strcmp(event, "cancelled") == 0) {
        /* cancelled, the steps done kept: where (run() says so) */
        w->ended = w->stopped = 1;
        w->stop_step = integer(ev, "step", -1);
        st = keep_path(&w->manifest, ev, err);
        if (st == NL_OK)
            st = keep_key(&w->adapter, ev, "adapter", err);
        if (st == NL_OK && !w->manifest && !w->adapter) {
            nl_train_progress_break(&w->prog);
            fprintf(stderr, "%s\n", s->message);
        }
        json_decref(ev);
        return st;
    }
    if (nl_remote_job_failed(rx, err)) {
        json_decref(ev);
        w->ended = w->failed = 1;
        return err->status;
    }
    if (st != NL_OK)
        return st;
    if (s->state == NL_JOB_DONE) {
        w->ended = 1;
        st = keep_path(&w->manifest, ev, err);
        if (st == NL_OK)
            st = keep_key(&w->adapter, ev, "adapter", err);
    } else if (!ev) {
        if (s->message[0] && !(first && strcmp(s->message, "running") == 0)) {
            nl_train_progress_break(&w->prog);
            fprintf(stderr, "%s\n", s->message);
        }
    } else if (event && strcmp(event, "stopping") == 0) { /* the answer to our JOB_CANCEL */
        nl_train_progress_break(&w->prog);
        fprintf(stderr,
                "stopping after step %lld: writing a checkpoint (Ctrl-C again to leave; the "
                "coordinator finishes it)\n",
                integer(ev, "step", -1));
    } else if (event && strcmp(event, "start") == 0) {
        on_start(w, ev);
    } else if (event && strcmp(event, "node_lost") == 0) {
        on_node_lost(w, ev);
    } else if (event && strcmp(event, "replan") == 0) {
        nl_train_progress_break(&w->prog);
        fprintf(stderr,
                "nodes joined: the job goes on from the checkpoint of step %lld on a new "
                "plan\n",
                integer(ev, "step", -1));
        if (w->log)
            fprintf(w->log, "{\"event\":\"replan\",\"resume_step\":%lld}\n",
                    integer(ev, "step", -1));
    } else if (event && strcmp(event, "grow") == 0) {
        on_grow(w, ev);
    } else if (event && strcmp(event, "step") == 0) {
        st = on_step(w, ev, err);
    } else if (event && strcmp(event, "checkpoint") == 0) {
        if ((st = keep_path(&w->last_ckpt, ev, err)) == NL_OK && w->last_ckpt)
            nl_train_report_checkpoint(&w->prog, w->last_ckpt);
    } /* other events: from a newer coordinator; nothing to show */
    json_decref(ev);
    return st;
}

static nl_status gave_up(const watch *w, const nl_remote *r, nl_error *err)
{
    if (interrupted && !w->acked)
        return nl_error_set(err, NL_ERR_TIMEOUT,
                            "interrupted before the coordinator acknowledged the job");
    if (interrupted)
        return nl_error_set(err, NL_ERR_TIMEOUT,
                            "interrupted; no message from the coordinator in %d s (--timeout): "
                            "job %" PRIu64 " may still be writing its checkpoint (neuroctl status)",
                            r->timeout_ms / 1000, w->job);
    if (!w->acked)
        return nl_error_set(err, NL_ERR_TIMEOUT,
                            "no answer from the coordinator to the submit in %d s (--timeout)",
                            r->timeout_ms / 1000);
    return nl_error_set(err, NL_ERR_TIMEOUT,
                        "no message from the coordinator in %d s (--timeout); job %" PRIu64
                        " may still be running (neuroctl status)",
                        r->timeout_ms / 1000, w->job);
}

/* Read until the job ends. The timeout counts from the last message. After
 * Ctrl-C the job is cancelled once: it ends after the step under way and
 * a checkpoint of it (while messages come, there is no other limit); a
 * job not yet acknowledged is given CANCEL_WAIT_S. A second Ctrl-C leaves
 * at once: the coordinator still finishes the checkpoint. */
static nl_status follow(nl_remote *r, watch *w, nl_error *err)
{
    nl_rx rx;
    nl_rx_init(&rx);
    nl_status st = NL_OK;
    double last = nl_remote_now(), cancel_by = 0;
    int cancelled = 0;
    while (!w->ended && st == NL_OK) {
        const double now = nl_remote_now();
        if (interrupted && !cancel_by)
            cancel_by = now + CANCEL_WAIT_S;
        if (interrupted > 1) {
            st = nl_error_set(err, NL_ERR_STATE,
                              w->acked ? "interrupted again: left job %" PRIu64
                                         " (the coordinator finishes its checkpoint; neuroctl "
                                         "status)"
                                       : "interrupted before the coordinator acknowledged the job",
                              w->job);
            break;
        }
        if (interrupted && !cancelled && w->acked) {
            nl_train_progress_break(&w->prog);
            fprintf(stderr, "interrupted: cancelling job %" PRIu64 "\n", w->job);
            cancelled = 1;
            if ((st = nl_remote_cancel(r, w->job, err)) != NL_OK)
                break;
        }
        const double limit = interrupted && !w->acked ? cancel_by : last + r->timeout_ms / 1e3;
        if (now >= limit) {
            st = gave_up(w, r, err);
            break;
        }
        st = nl_remote_recv(r, &rx, now + POLL_S < limit ? now + POLL_S : limit, err);
        if (st == NL_ERR_TIMEOUT) {
            st = NL_OK; /* a slice passed: look at the clock and Ctrl-C again */
            continue;
        }
        last = nl_remote_now();
        if (st == NL_OK && rx.msg.type == NL_MSG_JOB_STATUS)
            st = on_status(w, &rx, err);
    }
    nl_rx_free(&rx);
    return st;
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
static nl_status export_out(const watch *w, const char *out, nl_error *err)
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
static nl_status adapter_out(const watch *w, const char *out, nl_error *err)
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
    watch w = {.o = o, .steps = o->r.steps};
    struct sigaction sa = {.sa_handler = on_sigint}, old;
    int rc = 1, handler = 0;
    nl_train_progress_init(&w.prog, o->r.progress_s);
    if (nl_remote_open(&r, flags, 600, &err) != NL_OK)
        goto out;
    /* made once the cluster answers */
    if (o->make_dir &&
        (nl_file_mkdirs(o->ckpt_dir, &err) != NL_OK || access(o->ckpt_dir, W_OK) != 0)) {
        nl_error_set(&err, NL_ERR_IO, "--checkpoint-dir: cannot create or write %s", o->ckpt_dir);
        goto out;
    }
    if (o->log && !(w.log = fopen(o->log, o->resume || o->attach ? "a" : "w"))) {
        nl_error_set(&err, NL_ERR_IO, "%s: cannot open the log", o->log);
        goto out;
    }
    /* from here Ctrl-C cancels the job; a second one leaves at once */
    sigemptyset(&sa.sa_mask);
    interrupted = 0;
    handler = sigaction(SIGINT, &sa, &old) == 0;
    if ((o->attach ? attach(&r, o->attach, &err) : submit(&r, o, &err)) != NL_OK ||
        follow(&r, &w, &err) != NL_OK)
        goto out;
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
    if (interrupted && rc == 1)
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
    free(w.last_ckpt);
    free(w.manifest);
    free(w.adapter);
    return rc;
}

/* neuroctl finetune's adapters: the schema's defaults and ranges
 * (net/trainparams.h), and the flags it refuses. 0, or 2 (usage). */
static int read_lora_opts(rtrain_opts *o, const nl_flag *flags)
{
    nl_error err = {0};
    nl_trainparams d;
    double lo = 0, hi = 0, alo = 0, ahi = 0;
    int bits = 0, rc;
    nl_trainparams_defaults(&d);
    nl_trainparams_range("lora_rank", &lo, &hi);
    nl_trainparams_range("lora_alpha", &alo, &ahi);
    o->finetune = 1;
    o->lora_rank = d.lora_rank;
    o->lora_alpha = d.lora_alpha;
    if (!o->lora_targets)
        o->lora_targets = d.lora_targets;
    if ((rc = nl_args_int(flags, "lora-rank", (long long)lo, (long long)hi, &o->lora_rank)) ||
        (rc = nl_args_double(flags, "lora-alpha", 1e-6, ahi, &o->lora_alpha))) /* > 0 */
        return rc;
    if (nl_lora_parse_targets(o->lora_targets, &bits, &err) != NL_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 2;
    }
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
                        "[--resume MANIFEST] [--learn-vocab N] [--objective clm|mlm|classify] | "
                        "--attach JOB [--log LOG.jsonl] "
                        "[--out FINAL.safetensors [--force]]";
    if (finetune)
        usage = "neuroctl finetune (--coordinator EP --key K --coordinator-key P | --cluster DIR) "
                "--data DATA --steps N --out ADAPTER.safetensors [--lora-rank R] [--lora-alpha A] "
                "[--lora-targets wq,wk,wv,wo[,w_gate,w_up,w_down]] [--objective clm|mlm|classify] "
                "[--batch B] [--seq T] [--microbatches M] [--lr X] [--warmup W] [--seed S] "
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
        return o.out && out_writable(o.out) != 0 ? 1 : run(flags, &o);
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
