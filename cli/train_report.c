/* The per-step report of a training run (progress line, skipped-step
 * message, checkpoint line, JSONL log record), one copy for local and
 * cluster training: see train_report.h. */
#include "train_report.h"

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

double nl_train_clock(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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
    fprintf(log, ",\"tf32\":%s}\n", s->tf32 < 0 ? "null" : s->tf32 ? "true" : "false");
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
    const double now = nl_train_clock();
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

int nl_train_run_read(const nl_flag *flags, nl_train_run *r)
{
    int rc;
    *r = (nl_train_run){.batch = 8,
                        .seq = 256,
                        .micro = 1,
                        .eval_batches = 4,
                        .lr = 3e-4,
                        .holdout = 0.1,
                        .progress_s = 10.0,
                        .warmup = -1,
                        .min_lr = -1};
    r->recompute = nl_args_get(flags, "recompute") != NULL;
    if ((rc = nl_args_int(flags, "steps", 1, INT32_MAX, &r->steps)) ||
        (rc = nl_args_int(flags, "batch", 1, 65536, &r->batch)) ||
        (rc = nl_args_int(flags, "seq", 1, 1 << 20, &r->seq)) ||
        (rc = nl_args_int(flags, "microbatches", 1, 65536, &r->micro)) ||
        (rc = nl_args_int(flags, "seed", 0, INT64_MAX, &r->seed)) ||
        (rc = nl_args_int(flags, "warmup", 0, INT32_MAX, &r->warmup)) ||
        (rc = nl_args_int(flags, "eval-every", 0, INT32_MAX, &r->eval_every)) ||
        (rc = nl_args_int(flags, "eval-batches", 1, 1 << 20, &r->eval_batches)) ||
        (rc = nl_args_int(flags, "checkpoint-every", 0, INT32_MAX, &r->ckpt_every)) ||
        (rc = nl_args_double(flags, "lr", 0.0, 10.0, &r->lr)) ||
        (rc = nl_args_double(flags, "min-lr", 0.0, 10.0, &r->min_lr)) ||
        (rc = nl_args_double(flags, "holdout", 0.0, 0.5, &r->holdout)) ||
        (rc = nl_args_double(flags, "progress-every", 0.0, 86400.0, &r->progress_s)))
        return rc;
    if (r->batch % r->micro != 0) {
        fprintf(stderr, "--microbatches: %lld does not divide --batch %lld\n", r->micro, r->batch);
        return 2;
    }
    if (r->eval_every > 0 && r->holdout <= 0.0) {
        fprintf(stderr, "--eval-every needs held-out data (--holdout > 0)\n");
        return 2;
    }
    if (r->warmup < 0)
        r->warmup = r->steps / 10;
    if (r->min_lr < 0)
        r->min_lr = r->lr / 10;
    return 0;
}
