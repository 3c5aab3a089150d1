/* Following a training or fine-tuning job on a cluster (neuroctl train
 * and finetune, cmd_remote_train.c): the coordinator's JOB_STATUS
 * messages, whose JSON frame carries the events (start, step, checkpoint,
 * node lost, growth, done), become the progress line, the log and what
 * the command keeps (the final manifest, the adapter file); Ctrl-C
 * cancels the job. The protocol is in docs/training.md ("On a cluster"). */
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/remote_train.h"

#define CANCEL_WAIT_S 5.0 /* after Ctrl-C, how long to wait for the submit's answer */
#define POLL_S 0.2        /* receive in slices this long to notice Ctrl-C */

/* Ctrl-C's so far: the first cancels the job (which keeps the steps
 * done), a second leaves at once */
volatile sig_atomic_t rtrain_interrupted;

void rtrain_on_sigint(int sig)
{
    (void)sig;
    if (rtrain_interrupted < 2)
        rtrain_interrupted++;
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

/* Text from the cluster made safe for a terminal: every control or
 * non-ASCII byte becomes '?'. */
static void printable(char *s)
{
    for (char *p = s; *p; p++)
        if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f)
            *p = '?';
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
    printable(buf); /* a node's text */
}

/* The job lost a stage and goes on by itself: say so, and log it (a
 * record with "event" and no "step", so that step records stay keyed by
 * step). */
static void on_node_lost(rtrain_watch *w, const json_t *ev)
{
    const char *why = json_string_value(json_object_get(ev, "why"));
    char safe[600];
    snprintf(safe, sizeof safe, "%s", why ? why : "a stage is lost");
    printable(safe); /* a node's text */
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

/* A node was convicted of computing wrong (issue 31): the job rolls back
 * to its last checkpoint whose steps were all verified; say so, and log
 * it as a record with "event" and no "step". */
static void on_rollback(rtrain_watch *w, const json_t *ev)
{
    const char *to = json_string_value(json_object_get(ev, "checkpoint"));
    char safe[600];
    snprintf(safe, sizeof safe, "%s", to ? to : "?");
    printable(safe); /* the coordinator's path */
    nl_train_progress_break(&w->prog);
    fprintf(stderr,
            "a node was convicted of computing wrong at step %lld: rolling back to step %lld "
            "(%s), the last checkpoint whose steps were all verified; %zu later checkpoint(s) "
            "set aside\n",
            integer(ev, "from_step", -1), integer(ev, "to_step", -1), safe,
            json_array_size(json_object_get(ev, "unverified")));
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
static void on_grow(rtrain_watch *w, const json_t *ev)
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

/* A new job on trained weights (weights_step > 0, start_step 0): where
 * the weights came from, and how to continue that job instead. */
static void say_fresh_start(const json_t *ev)
{
    const long long ws = integer(ev, "weights_step", 0), wj = integer(ev, "weights_job", 0);
    const char *ck = json_string_value(json_object_get(ev, "weights_checkpoint"));
    char job[40] = "";
    if (wj > 0)
        snprintf(job, sizeof job, " of job %lld", wj);
    if (ck && wj > 0)
        fprintf(stderr,
                "starting at step 0 from the cluster's current weights (loaded from checkpoint "
                "step %lld%s); --resume %.1000s continues that job's steps instead\n",
                ws, job, ck);
    else if (ck)
        fprintf(stderr,
                "starting at step 0 from the cluster's current weights (loaded from step %lld of "
                "%.1000s)\n",
                ws, ck);
    else
        fprintf(stderr,
                "starting at step 0 from the cluster's current weights (trained to step %lld%s, "
                "not checkpointed)\n",
                ws, job);
}

static void on_start(rtrain_watch *w, const json_t *ev)
{
    const long long S = integer(ev, "start_step", 0);
    stage_devices(w->devices, sizeof w->devices, ev);
    w->steps = integer(ev, "steps", w->o->r.steps);
    w->start_step = S;
    w->start_time = nl_mono_s();
    w->started = 1;
    if (w->replanned && S > 0) { /* the same job on a new plan: what changed, not the header */
        w->replanned = 0;
        fprintf(stderr, "resuming at step %lld on %lld pipeline stages%s%s%s\n", S,
                integer(ev, "stages", 0), w->devices[0] ? " (devices " : "", w->devices,
                w->devices[0] ? ")" : "");
        return;
    }
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
    } else if (integer(ev, "weights_step", 0) > 0 && !w->o->finetune) {
        say_fresh_start(ev);
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
    if (json_object_get(ev, "pack_ends")) /* as local training says it */
        fprintf(stderr, "packed rows: %lld <|end|> ids in the data end documents\n",
                integer(ev, "pack_ends", 0));
}

/* A re-plan at a checkpoint: why (a node joined, or the stages' measured
 * speeds), in the coordinator's words where they are plain text. */
static void on_replan(rtrain_watch *w, const json_t *ev)
{
    const char *why = json_string_value(json_object_get(ev, "reason"));
    if (!why || strlen(why) > 120 || strspn(why, "abcdefghijklmnopqrstuvwxyz' ") != strlen(why))
        why = "the cluster changed"; /* an older coordinator, or words not to print */
    nl_train_progress_break(&w->prog);
    fprintf(stderr, "re-planning at the checkpoint of step %lld (%s): the job goes on from it\n",
            integer(ev, "step", -1), why);
    w->replanned = 1;
    if (w->log) {
        fprintf(w->log, "{\"event\":\"replan\",\"resume_step\":%lld,\"reason\":\"%s\"}\n",
                integer(ev, "step", -1), why);
        fflush(w->log);
    }
}

static nl_status on_step(rtrain_watch *w, const json_t *ev, nl_error *err)
{
    const long long k = integer(ev, "step", -1);
    if (k < 1)
        return nl_error_set(err, NL_ERR_PROTO, "job %" PRIu64 ": a step event without a step",
                            w->job);
    if (!w->started) { /* no start event: time from the first step seen */
        w->start_step = k - 1;
        w->start_time = nl_mono_s();
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
    s.has_checks = json_object_get(ev, "verified") != NULL;
    s.digest_mismatches = integer(ev, "digest_mismatches", 0);
    s.verified = integer(ev, "verified", 0);
    s.verify_mismatches = integer(ev, "verify_mismatches", 0);
    s.verify_convicted = integer(ev, "verify_convicted", 0);
    s.verify_outvoted = integer(ev, "verify_outvoted", 0);
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
static nl_status status_json(const rtrain_watch *w, const nl_rx *rx, json_t **ev, nl_error *err)
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
static nl_status on_status(rtrain_watch *w, const nl_rx *rx, nl_error *err)
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
    if (nl_client_job_failed(rx, err)) {
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
    } else if (event && strcmp(event, "rollback") == 0) {
        on_rollback(w, ev);
    } else if (event && strcmp(event, "replan") == 0) {
        on_replan(w, ev);
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

static nl_status gave_up(const rtrain_watch *w, const nl_remote *r, nl_error *err)
{
    if (rtrain_interrupted && !w->acked)
        return nl_error_set(err, NL_ERR_TIMEOUT,
                            "interrupted before the coordinator acknowledged the job");
    if (rtrain_interrupted)
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
nl_status rtrain_follow(nl_remote *r, rtrain_watch *w, nl_error *err)
{
    nl_rx rx;
    nl_rx_init(&rx);
    nl_status st = NL_OK;
    double last = nl_mono_s(), cancel_by = 0;
    int cancelled = 0;
    while (!w->ended && st == NL_OK) {
        const double now = nl_mono_s();
        if (rtrain_interrupted && !cancel_by)
            cancel_by = now + CANCEL_WAIT_S;
        if (rtrain_interrupted > 1) {
            st = nl_error_set(err, NL_ERR_STATE,
                              w->acked ? "interrupted again: left job %" PRIu64
                                         " (the coordinator finishes its checkpoint; neuroctl "
                                         "status)"
                                       : "interrupted before the coordinator acknowledged the job",
                              w->job);
            break;
        }
        if (rtrain_interrupted && !cancelled && w->acked) {
            nl_train_progress_break(&w->prog);
            fprintf(stderr, "interrupted: cancelling job %" PRIu64 "\n", w->job);
            cancelled = 1;
            if ((st = nl_remote_cancel(r, w->job, err)) != NL_OK)
                break;
        }
        const double limit =
            rtrain_interrupted && !w->acked ? cancel_by : last + r->timeout_ms / 1e3;
        if (now >= limit) {
            st = gave_up(w, r, err);
            break;
        }
        st = nl_remote_recv(r, &rx, now + POLL_S < limit ? now + POLL_S : limit, err);
        if (st == NL_ERR_TIMEOUT) {
            st = NL_OK;          /* a slice passed: look at the clock and Ctrl-C again */
            nl_error_clear(err); /* not an error: a job that ends well must not report it */
            continue;
        }
        last = nl_mono_s();
        if (st == NL_OK && rx.msg.type == NL_MSG_JOB_STATUS)
            st = on_status(w, &rx, err);
    }
    nl_rx_free(&rx);
    return st;
}
