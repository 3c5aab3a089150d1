/* The per-step report of a training run (progress line, skipped-step
 * message, checkpoint line, JSONL log record), one copy for local and
 * cluster training: see train_report.h. */
#include "train_report.h"

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <time.h>

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

void nl_train_report_step(const nl_train_step *s, int tty, FILE *log)
{
    if (s->skipped)
        fprintf(stderr, "%sstep %" PRId64 ": non-finite %s; step skipped, weights unchanged\n",
                tty ? "\n" : "", s->step, isfinite(s->loss) ? "gradient" : "loss");
    char eta[32];
    const double per = (nl_train_clock() - s->start_time) / (double)(s->step - s->start_step);
    fmt_eta(eta, sizeof eta, per * (double)(s->steps - s->step));
    fprintf(stderr, "%sstep %" PRId64 "/%" PRId64 " | loss %.4f | %.0f tok/s | lr %.2e | eta %s",
            tty ? "\r" : "", s->step, s->steps, s->loss, s->tokens_per_s, s->lr, eta);
    if (s->has_eval)
        fprintf(stderr, " | eval %.4f", s->eval_loss);
    fprintf(stderr, "%s", tty && !s->has_eval ? "   " : "\n");
    if (log)
        log_record(s, log);
}

void nl_train_report_checkpoint(const char *path, int tty)
{
    fprintf(stderr, "%scheckpoint %s\n", tty ? "\n" : "", path);
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
        (rc = nl_args_double(flags, "holdout", 0.0, 0.5, &r->holdout)))
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
