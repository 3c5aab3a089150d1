/* The stages' reports about a training job, a leaf of its state machine
 * (coord_train.c), which says what the job's state awaits: each report
 * is checked (it comes from the stage it claims, of the plan the job runs
 * on, about the step under way, and is not a lie) and counted into the
 * job, and the machine is told whether it completes the awaited event
 * (TAKEN, REPORTED, EVALUATED, SHARDS) or cannot be true (the machine then
 * fails the job). A stage's report of a failure is judged here too. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_train_impl.h"
#include "net/hopdigest.h"

/* A stage's report being taken. */
typedef struct srep {
    nl_coord *c;
    cjob *j;
    ctrain *t;
    const nl_rx *rx;
    int awaits; /* the event the job's state awaits (tr_event), or -1 */
    char *why;  /* a lie's message */
    size_t cap;
} srep;

/* The report cannot be true: why, and -1. */
static int __attribute__((format(printf, 2, 3))) lie(srep *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->why, r->cap, fmt, ap);
    va_end(ap);
    return -1;
}

/* Whether a step's reports come from every replica group (DiLoCo). */
static int lanes(const srep *r)
{
    return r->c->o.outer_every > 0 && !r->t->ft;
}

/* Whether a training report claiming stage `stage` comes from that stage
 * while the job awaits ev, on the current plan; *rep: its replica. */
static int report_ok(srep *r, uint32_t stage, tr_event ev, int *rep)
{
    cnode *n = coord_node_by_rid(r->c, r->rx);
    if (r->awaits != (int)ev || r->j->epoch != r->c->epoch)
        return 0;
    if (!n || n->stage != (int)stage || stage >= (uint32_t)r->t->stages) {
        NL_WARN("a training report for job %llu claims stage %u but comes from %s",
                (unsigned long long)r->j->id, stage, n ? "another stage" : "no stage");
        return 0;
    }
    *rep = n->replica;
    if (n->replica < 0 || n->replica >= NL_PLAN_MAX_REPLICAS ||
        (ev == TE_SHARDS ? n->replica != coord_stage_first_live(r->c, (int)stage)
                         : n->replica != 0 && ev != TE_REPORTED)) {
        /* a stage's replicas report through replica 0, but a step's
         * GRAD_NORM (its digests) and, with DiLoCo, its LOSS: each; the
         * shard comes from the replica asked (coord_train_send_ckpt_req) */
        NL_WARN("a training report for job %llu comes from replica %d of stage %u",
                (unsigned long long)r->j->id, n->replica, stage);
        return 0;
    }
    return 1;
}

/* The GRAD_NORMs of a step: one from each replica of each stage (each
 * with the digests of the microbatches it ran). */
static int norms_per_step(const srep *r)
{
    int n = 0;
    for (int s = 0; s < r->t->stages; s++)
        n += coord_stage_replicas(r->c, s);
    return n;
}

/* A stage's replica took the job (JOB_STATUS running); once every
 * replica of every stage has, TAKEN. */
static int on_ack(srep *r)
{
    cnode *n = coord_node_by_rid(r->c, r->rx);
    ctrain *t = r->t;
    if (r->awaits != TE_TAKEN || !n || n->stage < 0 || n->stage >= t->stages ||
        r->j->epoch != r->c->epoch || n->replica < 0 || n->replica >= NL_PLAN_MAX_REPLICAS ||
        (t->took[n->stage] & (1u << n->replica)))
        return 0;
    t->took[n->stage] |= (uint16_t)(1u << n->replica);
    r->j->last_progress = nl_mono_s();
    int all = 0;
    for (int s = 0; s < t->stages; s++)
        all += coord_stage_replicas(r->c, s);
    return ++t->acks == all;
}

/* The bytes of stage s's digests in the step's table. */
static uint8_t *stage_digests(ctrain *t, int s)
{
    return t->dig + (size_t)s * (size_t)t->micro * NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES;
}

/* A GRAD_NORM's digests into the step's table (none: zero, nothing to
 * compare); a frame of the wrong size is a lie. */
static int take_digests(srep *r, uint32_t stage, int rep)
{
    ctrain *t = r->t;
    const nl_wire_msg *m = &r->rx->msg;
    const size_t per = (size_t)t->micro * NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES;
    if (t->dig_stages != t->stages) {
        free(t->dig);
        if (!(t->dig = calloc((size_t)t->stages, per)))
            return lie(r, "out of memory for the digests of %d stages", t->stages);
        t->dig_stages = t->stages;
    }
    uint8_t *d = stage_digests(t, (int)stage);
    if (m->nframes == 0) {
        memset(d, 0, per);
        return 0;
    }
    if (m->frames[0].t.shape[0] != t->micro)
        return lie(r,
                   "stage %u reported the digests of %lld microbatches for step %lld, but the "
                   "step has %lld: refused",
                   stage, (long long)m->frames[0].t.shape[0], (long long)t->step + 1,
                   (long long)t->micro);
    const int R = coord_stage_replicas(r->c, (int)stage);
    if (R <= 1) {
        memcpy(d, m->frames[0].t.data, per);
        return 0;
    }
    /* each replica reports the microbatches it ran (i mod R) */
    const size_t one = NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES;
    for (int64_t mb = rep; mb < t->micro; mb += R)
        memcpy(d + (size_t)mb * one, (const uint8_t *)m->frames[0].t.data + (size_t)mb * one, one);
    return 0;
}

/* DiLoCo: every group's reports are in; the step's sums in group order. */
static void add_lanes(srep *r)
{
    ctrain *t = r->t;
    t->sumsq = t->ce = t->aux = 0.0;
    for (int k = 0; k < coord_stage_replicas(r->c, 0); k++) {
        t->sumsq += t->lane_sumsq[k];
        t->ce += t->lane_ce[k];
        t->aux += t->lane_aux[k];
    }
}

/* Whether the step's reports are all in: every stage's GRAD_NORM and the
 * last stage's LOSS (DiLoCo: of every replica group). */
static int step_in(srep *r)
{
    ctrain *t = r->t;
    const int R = lanes(r) ? coord_stage_replicas(r->c, 0) : 1;
    if (t->norms != norms_per_step(r) || t->have_loss != R)
        return 0;
    if (R > 1)
        add_lanes(r);
    return 1;
}

/* Every stage's digests of the step are in: each hop as its sender and its
 * receiver saw it. A disagreement means one of the two reports what it did
 * not send or receive (the wire's own check refuses a hop altered on the
 * way); it is counted and logged (which of the two is at fault takes a
 * recompute to tell). */
static void compare_digests(srep *r)
{
    ctrain *t = r->t;
    static const char *const dir[2] = {"ACTIVATION", "GRADIENT"};
    for (int64_t mb = 0; t->sent && mb < t->micro; mb++) { /* ours into stage 0 */
        const uint8_t *ours = t->sent + (size_t)mb * NL_HOP_DIGEST_BYTES,
                      *got = stage_digests(t, 0) +
                             (size_t)mb * NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES +
                             NL_DIGEST_FWD_IN * NL_HOP_DIGEST_BYTES;
        if (nl_hop_digest_none(ours) || nl_hop_digest_none(got) ||
            memcmp(ours, got, NL_HOP_DIGEST_BYTES) == 0)
            continue;
        t->dig_mismatches++;
        NL_WARN("train job %llu step %lld microbatch %lld: stage 0 reports receiving another "
                "ACTIVATION than the coordinator sent it",
                (unsigned long long)r->j->id, (long long)t->step + 1, (long long)mb);
    }
    for (int s = 0; s + 1 < t->stages; s++) {
        const uint8_t *a = stage_digests(t, s), *b = stage_digests(t, s + 1);
        for (int64_t mb = 0; mb < t->micro; mb++) {
            const size_t o = (size_t)mb * NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES;
            /* forward: s's FWD_OUT is s+1's FWD_IN; backward: s+1's BWD_OUT is s's BWD_IN */
            const uint8_t *pair[2][2] = {{a + o + NL_DIGEST_FWD_OUT * NL_HOP_DIGEST_BYTES,
                                          b + o + NL_DIGEST_FWD_IN * NL_HOP_DIGEST_BYTES},
                                         {b + o + NL_DIGEST_BWD_OUT * NL_HOP_DIGEST_BYTES,
                                          a + o + NL_DIGEST_BWD_IN * NL_HOP_DIGEST_BYTES}};
            for (int k = 0; k < 2; k++) {
                if (nl_hop_digest_none(pair[k][0]) || nl_hop_digest_none(pair[k][1]) ||
                    memcmp(pair[k][0], pair[k][1], NL_HOP_DIGEST_BYTES) == 0)
                    continue;
                t->dig_mismatches++;
                NL_WARN("train job %llu step %lld microbatch %lld: the %s from stage %d to stage "
                        "%d has one digest at its sender and another at its receiver",
                        (unsigned long long)r->j->id, (long long)t->step + 1, (long long)mb, dir[k],
                        k ? s + 1 : s, k ? s : s + 1);
            }
        }
    }
}

static int on_grad_norm(srep *r)
{
    const nl_msg_grad_norm *g = &r->rx->msg.u.grad_norm;
    ctrain *t = r->t;
    int rep = 0;
    if (!report_ok(r, g->stage, TE_REPORTED, &rep) || g->step != (uint64_t)t->step + 1 ||
        (t->got[g->stage] & (1u << rep)))
        return 0;
    if (g->sumsq < 0) /* no sum of squares is negative: a lie */
        return lie(r, "stage %u reported a gradient sum of squares of %g for step %lld: refused",
                   g->stage, g->sumsq, (long long)t->step + 1);
    const int counted = rep == 0 || lanes(r); /* replica 0's norm is of the replicas' sum */
    if (counted && !isfinite(g->sumsq) && t->bad_stage < 0) /* the step is skipped (decide) */
        t->bad_stage = (int)g->stage;
    if (take_digests(r, g->stage, rep) != 0)
        return -1;
    r->j->last_progress = nl_mono_s();
    t->got[g->stage] |= (uint16_t)(1u << rep);
    if (counted) { /* DiLoCo: each group's own */
        t->sumsq += g->sumsq;
        t->lane_sumsq[rep] += g->sumsq;
    }
    if (++t->norms == norms_per_step(r))
        compare_digests(r);
    return step_in(r);
}

/* The evaluation's loss: the mean over the predictions (every position
 * of clm, the masked ones of mlm, the held-out examples of classify). */
static int on_eval_loss(srep *r)
{
    const nl_msg_loss *l = &r->rx->msg.u.loss;
    const uint64_t correct = r->rx->msg.u.train_loss.correct;
    ctrain *t = r->t;
    const uint32_t last = (uint32_t)(t->stages - 1);
    int rep = 0;
    if (!report_ok(r, last, TE_EVALUATED, &rep) || l->step != (uint64_t)t->step)
        return 0;
    if (!isfinite(l->ce_sum) || l->ce_sum < 0)
        return lie(r, "stage %u (the last) reported an evaluation loss of %g at step %lld: refused",
                   last, l->ce_sum, (long long)t->step);
    if (t->lds && (l->rows != (uint64_t)t->eval_rows || correct > l->rows))
        return lie(r,
                   "stage %u (the last) scored %llu held-out examples (%llu right) at step %lld, "
                   "but %.0f were sent: refused",
                   last, (unsigned long long)l->rows, (unsigned long long)correct,
                   (long long)t->step, t->eval_rows);
    r->j->last_progress = nl_mono_s();
    t->eval_loss = l->ce_sum / (t->eval_rows > 0 ? t->eval_rows : 1.0);
    t->eval_acc = t->lds && l->rows ? (double)correct / (double)l->rows : 0.0;
    t->has_eval = 1;
    return 1;
}

static int on_loss(srep *r)
{
    const nl_msg_loss *l = &r->rx->msg.u.loss;
    ctrain *t = r->t;
    const uint32_t last = (uint32_t)(t->stages - 1);
    if (l->eval)
        return on_eval_loss(r);
    int rep = 0;
    if (!report_ok(r, last, TE_REPORTED, &rep) || l->step != (uint64_t)t->step + 1)
        return 0;
    if (rep != 0 && !lanes(r)) { /* replica 0 reports the replicas' losses */
        NL_WARN("a training loss for job %llu comes from replica %d of stage %u",
                (unsigned long long)r->j->id, rep, last);
        return 0;
    }
    const int R = lanes(r) ? coord_stage_replicas(r->c, (int)last) : 1;
    if (R > 1 ? (t->loss_lanes & (1u << rep)) != 0 : t->have_loss != 0)
        return 0;
    if (l->ce_sum < 0) /* a cross-entropy is never negative: a lie */
        return lie(r, "stage %u (the last) reported a loss of %g (aux %g) for step %lld: refused",
                   last, l->ce_sum, l->aux, (long long)t->step + 1);
    if ((!isfinite(l->ce_sum) || !isfinite(l->aux)) && t->bad_stage < 0)
        t->bad_stage = (int)last; /* the step is skipped (decide) */
    r->j->last_progress = nl_mono_s();
    t->ce = l->ce_sum;
    t->aux = l->aux;
    t->lane_ce[rep] = l->ce_sum;
    t->lane_aux[rep] = l->aux;
    t->loss_lanes |= (uint16_t)(1u << rep);
    t->have_loss++;
    return step_in(r);
}

static int on_ckpt_done(srep *r)
{
    const nl_msg_ckpt_done *d = &r->rx->msg.u.ckpt_done;
    ctrain *t = r->t;
    int rep = 0;
    if (!report_ok(r, d->stage, TE_SHARDS, &rep) || d->step != (uint64_t)t->step ||
        t->got[d->stage])
        return 0;
    if (coord_train_shard(r->c, r->j, coord_node_by_rid(r->c, r->rx), d, r->why, r->cap))
        return -1;
    r->j->last_progress = nl_mono_s();
    t->got[d->stage] = 2;
    return ++t->acks == t->stages;
}

int coord_train_stage_report(nl_coord *c, cjob *j, const nl_rx *rx, int awaits, char *why,
                             size_t cap)
{
    srep r = {c, j, j->state, rx, awaits, why, cap};
    if (!r.t)
        return 0;
    switch (rx->msg.type) {
    case NL_MSG_JOB_STATUS:
        return on_ack(&r);
    case NL_MSG_GRAD_NORM:
        return on_grad_norm(&r);
    case NL_MSG_LOSS:
        return on_loss(&r);
    case NL_MSG_CKPT_DONE:
        return on_ckpt_done(&r);
    case NL_MSG_VERIFY_CASE:
    case NL_MSG_VERIFY_RESULT:
        coord_train_verify_msg(c, j, rx); /* the last one awaited at the end: SETTLED */
        return awaits == TE_SETTLED && !coord_train_verify_pending(j->state);
    default:
        return 0;
    }
}

/* A stage failed the job. When it cannot reach a neighbour (node.c says
 * "cannot reach the previous/next stage"; JOB_STATUS carries no code),
 * the neighbour has most likely died and the heartbeat timeout will say
 * so: with resumes left the job waits for that verdict (the state
 * machine's LOST then resumes it); a neighbour that lives on leaves the
 * job to --job-timeout-ms. So does any failure after that one on the same
 * plan: the other stages' protocol errors follow from the lost hop (the
 * soak saw "GRADIENT of microbatch 1, but the next backward is of
 * microbatch 0" from the stage whose gradient could not be sent). Any
 * other failure (the device, the data) fails it. */
int coord_train_shard_awaited(nl_coord *c, const ctrain *t, const cnode *n)
{
    return n->stage >= 0 && n->stage < t->stages && !t->got[n->stage] &&
           n->replica == coord_stage_first_live(c, n->stage);
}

int coord_train_stage_failed(nl_coord *c, cjob *j, int begun, const char *why)
{
    ctrain *t = j->state;
    if (t->ft || !begun || t->resumes >= c->o.train_resumes)
        return 0;
    const int cut = strstr(why, "cannot reach the ") != NULL;
    if (!cut && t->verdict_epoch != c->epoch)
        return 0;
    if (cut)
        t->verdict_epoch = c->epoch;
    NL_WARN("train job %llu: %s; waiting for the heartbeat timeout to tell whether a node died "
            "(then the job resumes)%s",
            (unsigned long long)j->id, why,
            cut ? "" : " (after a stage could not reach its neighbour on this plan)");
    return 1;
}

/* Stage s cannot be reached. Its node is declared dead at this turn's
 * tick, and the job then resumes on the nodes left (LOST) if it may;
 * otherwise it fails now, naming the node. */
void coord_train_unreachable(nl_coord *c, cjob *j, int s)
{
    cnode *n = coord_stage_unreached(c, s);
    const nl_plan_stage *ps = &c->plan->stages[s];
    const ctrain *t = j->state;
    char why[900];
    if (n && n->unreachable && t->resumes < c->o.train_resumes) {
        NL_INFO("train job %llu: node %u (stage %d) cannot be reached; the job waits for it to "
                "be declared dead, then resumes",
                (unsigned long long)j->id, n->id, s);
        return;
    }
    if (n)
        snprintf(why, sizeof why, "node %u (stage %d, layers [%d, %d), %s) %s", n->id, s, ps->l0,
                 ps->l1, n->endpoint, n->why[0] ? n->why : "cannot be reached");
    else
        snprintf(why, sizeof why, "stage %d has no live node", s);
    coord_job_fail(c, j, why);
}
