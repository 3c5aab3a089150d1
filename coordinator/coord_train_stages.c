/* The stages' reports about a training job, the inputs of its state
 * machine (coord_train.c): each is checked (it comes from the stage it
 * claims, of the plan the job runs on, about the step under way, and is
 * not a lie) and counted; the last one expected becomes an event (TAKEN,
 * REPORTED, EVALUATED, SHARDS) for the state machine, which awaits it in
 * one state (coord_train_awaits) and decides what follows. A report that
 * cannot be true fails the job. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#include "base/log.h"
#include "coord_train_impl.h"

/* The job fails: a stage's report cannot be true. */
static void __attribute__((format(printf, 3, 4)))
report_fail(nl_coord *c, cjob *j, const char *fmt, ...)
{
    char why[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    coord_job_fail(c, j, why);
}

/* Whether a training report about j, claiming stage `stage`, comes from
 * that stage while the job awaits reports that make `ev`, on the current
 * plan. */
static int report_ok(nl_coord *c, cjob *j, const nl_rx *rx, uint32_t stage, tr_event ev)
{
    const ctrain *t = j->state;
    cnode *n = coord_node_by_rid(c, rx);
    if (!t || !coord_train_awaits(j, ev) || j->epoch != c->epoch)
        return 0;
    if (!n || n->stage != (int)stage || stage >= (uint32_t)t->stages) {
        NL_WARN("a training report for job %llu claims stage %u but comes from %s",
                (unsigned long long)j->id, stage, n ? "another stage" : "no stage");
        return 0;
    }
    return 1;
}

/* A stage took the job (JOB_STATUS running); once all have, TAKEN. */
static void on_ack(nl_coord *c, cjob *j, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid(c, rx);
    ctrain *t = j->state;
    if (!coord_train_awaits(j, TE_TAKEN) || !n || n->stage < 0 || j->epoch != c->epoch ||
        t->got[n->stage])
        return;
    t->got[n->stage] = 1;
    j->last_progress = coord_now();
    if (++t->acks == t->stages)
        coord_train_event(c, j->id, TE_TAKEN, NULL);
}

static void on_grad_norm(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const nl_msg_grad_norm *g = &rx->msg.u.grad_norm;
    ctrain *t = j->state;
    if (!report_ok(c, j, rx, g->stage, TE_REPORTED) || g->step != (uint64_t)t->step + 1 ||
        t->got[g->stage])
        return;
    if (g->sumsq < 0) { /* no sum of squares is negative: a lie */
        report_fail(c, j,
                    "stage %u reported a gradient sum of squares of %g for step %lld: refused",
                    g->stage, g->sumsq, (long long)t->step + 1);
        return;
    }
    if (!isfinite(g->sumsq) && t->bad_stage < 0) /* the step is skipped (decide) */
        t->bad_stage = (int)g->stage;
    j->last_progress = coord_now();
    t->got[g->stage] = 1;
    t->sumsq += g->sumsq;
    if (++t->norms == t->stages && t->have_loss)
        coord_train_event(c, j->id, TE_REPORTED, NULL);
}

/* The evaluation's loss: the mean over the predictions (every position
 * of clm, the masked ones of mlm, the held-out examples of classify). */
static void on_eval_loss(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const nl_msg_loss *l = &rx->msg.u.loss;
    ctrain *t = j->state;
    const uint32_t last = (uint32_t)(t->stages - 1);
    if (!report_ok(c, j, rx, last, TE_EVALUATED) || l->step != (uint64_t)t->step)
        return;
    if (!isfinite(l->ce_sum) || l->ce_sum < 0) {
        report_fail(c, j,
                    "stage %u (the last) reported an evaluation loss of %g at step %lld: refused",
                    last, l->ce_sum, (long long)t->step);
        return;
    }
    if (t->lds && (l->rows != (uint64_t)t->eval_rows || rx->msg.u.train_loss.correct > l->rows)) {
        report_fail(c, j,
                    "stage %u (the last) scored %llu held-out examples (%llu right) at step %lld, "
                    "but %.0f were sent: refused",
                    last, (unsigned long long)l->rows,
                    (unsigned long long)rx->msg.u.train_loss.correct, (long long)t->step,
                    t->eval_rows);
        return;
    }
    j->last_progress = coord_now();
    t->eval_loss = l->ce_sum / (t->eval_rows > 0 ? t->eval_rows : 1.0);
    t->eval_acc = t->lds && l->rows ? (double)rx->msg.u.train_loss.correct / (double)l->rows : 0.0;
    t->has_eval = 1;
    coord_train_event(c, j->id, TE_EVALUATED, NULL);
}

static void on_loss(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const nl_msg_loss *l = &rx->msg.u.loss;
    ctrain *t = j->state;
    const uint32_t last = (uint32_t)(t->stages - 1);
    if (l->eval) {
        on_eval_loss(c, j, rx);
        return;
    }
    if (!report_ok(c, j, rx, last, TE_REPORTED) || l->step != (uint64_t)t->step + 1 || t->have_loss)
        return;
    if (l->ce_sum < 0) { /* a cross-entropy is never negative: a lie */
        report_fail(c, j,
                    "stage %u (the last) reported a loss of %g (aux %g) for step %lld: refused",
                    last, l->ce_sum, l->aux, (long long)t->step + 1);
        return;
    }
    if ((!isfinite(l->ce_sum) || !isfinite(l->aux)) && t->bad_stage < 0)
        t->bad_stage = (int)last; /* the step is skipped (decide) */
    j->last_progress = coord_now();
    t->ce = l->ce_sum;
    t->aux = l->aux;
    t->have_loss = 1;
    if (t->norms == t->stages)
        coord_train_event(c, j->id, TE_REPORTED, NULL);
}

static void on_ckpt_done(nl_coord *c, cjob *j, const nl_rx *rx)
{
    const nl_msg_ckpt_done *d = &rx->msg.u.ckpt_done;
    ctrain *t = j->state;
    char why[1300];
    if (!report_ok(c, j, rx, d->stage, TE_SHARDS) || d->step != (uint64_t)t->step ||
        t->got[d->stage])
        return;
    if (coord_train_shard(c, j, coord_node_by_rid(c, rx), d, why, sizeof why)) {
        report_fail(c, j, "%s", why);
        return;
    }
    j->last_progress = coord_now();
    t->got[d->stage] = 2;
    if (++t->acks == t->stages)
        coord_train_event(c, j->id, TE_SHARDS, NULL);
}

void coord_train_on_message(nl_coord *c, cjob *j, const nl_rx *rx)
{
    switch (rx->msg.type) {
    case NL_MSG_JOB_STATUS:
        on_ack(c, j, rx);
        break;
    case NL_MSG_GRAD_NORM:
        on_grad_norm(c, j, rx);
        break;
    case NL_MSG_LOSS:
        on_loss(c, j, rx);
        break;
    case NL_MSG_CKPT_DONE:
        on_ckpt_done(c, j, rx);
        break;
    default:
        break;
    }
}
