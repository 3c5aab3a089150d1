/* The per-step report of a training run (progress line, skipped-step
 * message, checkpoint line, JSONL log record), one copy for local and
 * cluster training: see train_report.h. */
#include "cli/train_report.h"

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "core/model/lora.h"
#include "net/trainparams.h"

static void fmt_eta(char *buf, size_t n, double s)
{
    if (!(s >= 0) || s > 1e7)
        snprintf(buf, n, "?");
    else if (s >= 3600)
        snprintf(buf, n, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
    else if (s >= 60)
        snprintf(buf, n, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    else
        snprintf(buf, n, "%.0fs", s);
}

/* A number for the JSONL log: JSON has no NaN or infinity, so null. */
static void log_num(FILE *log, const char *key, double v)
{
    if (isfinite(v))
        fprintf(log, ",\"%s\":%.9g", key, v);
    else
        fprintf(log, ",\"%s\":null", key);
}

/* A JSON string (device names hold no quote or control character; any
 * other byte is escaped anyway), or null. */
static void log_str(FILE *log, const char *v)
{
    if (!v) {
        fprintf(log, "null");
        return;
    }
    fputc('"', log);
    for (const unsigned char *p = (const unsigned char *)v; *p; p++)
        if (*p == '"' || *p == '\\' || *p < 0x20)
            fprintf(log, "\\u%04x", *p);
        else
            fputc(*p, log);
    fputc('"', log);
}

static void log_record(const nl_train_step *s, FILE *log)
{
    fprintf(log, "{\"step\":%" PRId64, s->step);
    log_num(log, "loss", s->loss);
    log_num(log, "ce_loss", s->ce_loss);
    log_num(log, "aux_loss", s->aux_loss);
    log_num(log, "lr", s->lr);
    log_num(log, "grad_norm", s->grad_norm);
    fprintf(log, ",\"tokens_per_s\":%.1f,\"skipped\":%s", s->tokens_per_s,
            s->skipped ? "true" : "false");
    if (s->has_eval)
        log_num(log, "eval_loss", s->eval_loss);
    fprintf(log, ",\"device\":");
    log_str(log, s->device);
    fprintf(log, ",\"tf32\":%s", s->tf32 < 0 ? "null" : s->tf32 ? "true" : "false");
    if (s->has_checks)
        fprintf(log,
                ",\"digest_mismatches\":%" PRId64 ",\"verified\":%" PRId64
                ",\"verify_mismatches\":%" PRId64 ",\"verify_convicted\":%" PRId64
                ",\"verify_outvoted\":%" PRId64,
                s->digest_mismatches, s->verified, s->verify_mismatches, s->verify_convicted,
                s->verify_outvoted);
    fprintf(log, "}\n");
    fflush(log);
}

/* The terminal's width: the tty's, else $COLUMNS, else 80. */
static int term_width(void)
{
    struct winsize ws;
    if (ioctl(2, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0)
        return ws.ws_col;
    const char *c = getenv("COLUMNS");
    const int n = c ? atoi(c) : 0;
    return n > 0 ? n : 80;
}

void nl_train_progress_init(nl_train_progress *p, double every_s)
{
    *p = (nl_train_progress){.tty = isatty(2), .every_s = every_s};
}

void nl_train_progress_break(nl_train_progress *p)
{
    if (p->open)
        fputc('\n', stderr);
    p->open = 0;
}

/* Is a line due into a file or pipe for step s? */
static int line_due(const nl_train_progress *p, const nl_train_step *s, double now)
{
    return p->last_print == 0 || s->step >= s->steps || s->has_eval ||
           now - p->last_print >= p->every_s;
}

void nl_train_report_step(nl_train_progress *p, const nl_train_step *s, FILE *log)
{
    if (s->skipped) {
        nl_train_progress_break(p);
        fprintf(stderr, "step %" PRId64 ": non-finite %s; step skipped, weights unchanged\n",
                s->step, isfinite(s->loss) ? "gradient" : "loss");
    }
    if (log)
        log_record(s, log);
    const double now = nl_mono_s();
    if (!p->tty && !line_due(p, s, now))
        return;
    char eta[32], line[256];
    const double per = (now - s->start_time) / (double)(s->step - s->start_step);
    fmt_eta(eta, sizeof eta, per * (double)(s->steps - s->step));
    int n = snprintf(line, sizeof line,
                     "step %" PRId64 "/%" PRId64 " | loss %.4f | %.0f tok/s | lr %.2e | eta %s",
                     s->step, s->steps, s->loss, s->tokens_per_s, s->lr, eta);
    if (s->has_eval && n > 0 && (size_t)n < sizeof line)
        snprintf(line + n, sizeof line - (size_t)n, " | eval %.4f", s->eval_loss);
    p->last_print = now;
    if (!p->tty) {
        fprintf(stderr, "%s\n", line);
        return;
    }
    /* in place: cut to the width (a wrapped line cannot be redrawn) and
     * clear what a longer line left; an eval loss stays on screen */
    const int w = term_width() - 1;
    fprintf(stderr, "\r%.*s\033[K", w > 0 ? w : 1, line);
    p->open = 1;
    if (s->has_eval)
        nl_train_progress_break(p);
    fflush(stderr);
}

void nl_train_report_checkpoint(nl_train_progress *p, const char *path)
{
    nl_train_progress_break(p);
    fprintf(stderr, "checkpoint %s\n", path);
}

void nl_train_report_skipped(int64_t skipped)
{
    if (skipped)
        fprintf(stderr, "%" PRId64 " step(s) skipped for non-finite values\n", skipped);
}

/* An integer or number flag in its key's range (net/trainparams.h; the
 * flag is the key with '-' for '_'). */
static int int_flag(const nl_flag *flags, const char *flag, const char *key, long long *v)
{
    double lo = 0, hi = 0;
    nl_trainparams_range(key, &lo, &hi);
    return nl_args_int(flags, flag, (long long)lo, hi >= 9.2e18 ? INT64_MAX : (long long)hi, v);
}

static int num_flag(const nl_flag *flags, const char *flag, const char *key, double *v)
{
    double lo = 0, hi = 0;
    nl_trainparams_range(key, &lo, &hi);
    return nl_args_double(flags, flag, lo, hi, v);
}

int nl_train_run_read(const nl_flag *flags, nl_train_run *r)
{
    int rc;
    nl_trainparams d; /* the schema's defaults */
    nl_error err = {0};
    nl_trainparams_defaults(&d);
    *r = (nl_train_run){.batch = d.batch,
                        .seq = d.seq,
                        .micro = d.micro,
                        .seed = d.seed,
                        .eval_every = d.eval_every,
                        .eval_batches = d.eval_batches,
                        .ckpt_every = d.ckpt_every,
                        .lr = d.lr,
                        .holdout = d.holdout,
                        .progress_s = 10.0,
                        .warmup = -1,
                        .min_lr = -1};
    r->recompute = nl_args_get(flags, "recompute") != NULL;
    r->pack = nl_args_get(flags, "pack") != NULL;
    if ((rc = int_flag(flags, "steps", "steps", &r->steps)) ||
        (rc = int_flag(flags, "batch", "batch", &r->batch)) ||
        (rc = int_flag(flags, "seq", "seq", &r->seq)) ||
        (rc = int_flag(flags, "microbatches", "microbatches", &r->micro)) ||
        (rc = int_flag(flags, "seed", "seed", &r->seed)) ||
        (rc = int_flag(flags, "warmup", "warmup", &r->warmup)) ||
        (rc = int_flag(flags, "eval-every", "eval_every", &r->eval_every)) ||
        (rc = int_flag(flags, "eval-batches", "eval_batches", &r->eval_batches)) ||
        (rc = int_flag(flags, "checkpoint-every", "checkpoint_every", &r->ckpt_every)) ||
        (rc = num_flag(flags, "lr", "lr", &r->lr)) ||
        (rc = num_flag(flags, "min-lr", "min_lr", &r->min_lr)) ||
        (rc = num_flag(flags, "holdout", "holdout", &r->holdout)) ||
        (rc = nl_args_double(flags, "progress-every", 0.0, 86400.0, &r->progress_s)))
        return rc;
    nl_train_run_params(r, &d);
    if (nl_trainparams_check_batch(&d, "--", &err) != NL_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 2;
    }
    if (r->warmup < 0)
        r->warmup = r->steps / 10;
    if (r->min_lr < 0)
        r->min_lr = r->lr / 10;
    return 0;
}

void nl_train_run_params(const nl_train_run *r, nl_trainparams *p)
{
    p->steps = r->steps;
    p->batch = r->batch;
    p->seq = r->seq;
    p->micro = r->micro;
    p->seed = r->seed;
    p->warmup = r->warmup;
    p->eval_every = r->eval_every;
    p->eval_batches = r->eval_batches;
    p->ckpt_every = r->ckpt_every;
    p->lr = r->lr;
    p->min_lr = r->min_lr;
    p->holdout = r->holdout;
    p->recompute = r->recompute;
    p->pack = r->pack;
}

int nl_train_lora_read(const nl_flag *flags, long long *rank, double *alpha, const char **targets,
                       int *bits)
{
    nl_trainparams d;
    nl_error err = {0};
    double lo = 0, hi = 0, alo = 0, ahi = 0;
    int rc;
    nl_trainparams_defaults(&d);
    nl_trainparams_range("lora_rank", &lo, &hi);
    nl_trainparams_range("lora_alpha", &alo, &ahi);
    *rank = d.lora_rank;
    *alpha = d.lora_alpha;
    *targets =
        nl_args_get(flags, "lora-targets") ? nl_args_get(flags, "lora-targets") : d.lora_targets;
    if ((rc = nl_args_int(flags, "lora-rank", (long long)lo, (long long)hi, rank)) ||
        (rc = nl_args_double(flags, "lora-alpha", 1e-6, ahi, alpha))) /* alpha > 0 */
        return rc;
    if (nl_lora_parse_targets(*targets, bits, &err) != NL_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 2;
    }
    return 0;
}
