/* The stages' observed speeds (coordinator/coord_impl.h,
 * coord_observe_speeds): during a training job each stage's busy fraction,
 * from its node's heartbeats, against the plan's predicted stage times
 * gives the node's throughput as the job sees it, every replica's node
 * judged; a figure that moves past --replan-margin, two judgements in a
 * row, asks for a re-plan
 * (docs/cluster.md, "At a checkpoint" and "The early re-balance"). */
#include "coordinator/coord_impl.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>

#include "base/log.h"

/* Heartbeats a stage's node needs since the last checkpoint to be judged. */
#define OBSERVE_MIN_BEATS 3

/* The figure node n plans by now. */
static double figure_now(const cnode *n)
{
    return n->seen_gflops > 0 ? n->seen_gflops : n->gflops;
}

/* Stage s's replica r, when it is there to be judged: live, and heard at
 * least OBSERVE_MIN_BEATS times (*short_of set when it is live but was
 * not); NULL for a replica that is gone or unreachable (the stage goes on
 * without it). */
static cnode *judged_replica(nl_coord *c, int s, int r, int *short_of)
{
    cnode *n = coord_stage_replica(c, s, r);
    if (!n || n->unreachable)
        return NULL;
    if (n->load_n < OBSERVE_MIN_BEATS) {
        *short_of = 1;
        return NULL;
    }
    return n;
}

/* Stage s's predicted seconds per microbatch on its replica n, at n's
 * figure now. The plan's stage time is its slowest replica's over the
 * replicas (each runs 1/R of the microbatches at its own speed, so a
 * faster one is busy that much less): scaled by the figure the slowest
 * was planned with over n's now (so a node judged slower and left where
 * it was is not judged slower again for the same share). */
static double predicted_now(nl_coord *c, int s, const cnode *n)
{
    double slowest = 0;
    for (int r = 0; r < coord_stage_replicas(c, s); r++) {
        const cnode *m = coord_stage_replica(c, s, r);
        const double at = !m ? 0 : m->plan_gflops > 0 ? m->plan_gflops : figure_now(m);
        slowest = at > 0 && (slowest == 0 || at < slowest) ? at : slowest;
    }
    const double now = figure_now(n);
    return now > 0 && slowest > 0 ? c->plan->stages[s].seconds * slowest / now
                                  : c->plan->stages[s].seconds;
}

/* Node n (stage s, replica r of R) against its predicted share: its
 * figure moves when this judgement and the one before on this plan see
 * it off by --replan-margin the same way. */
static void judge(nl_coord *c, cnode *n, int s, int r, int R, double loads, double pred)
{
    const double load = n->load_sum / n->load_n, was = figure_now(n);
    if (!(was > 0)) /* a node of no figure: nothing to scale */
        return;
    /* the node's share of the busy time against its predicted share: the
     * per-microbatch seconds rescaled to the observed ones */
    const double seen_s = load / loads * pred, pred_s = predicted_now(c, s, n);
    const double g = seen_s > 0 ? was * pred_s / seen_s : was;
    if (fabs(g / was - 1.0) <= c->o.replan_margin) {
        n->pend_epoch = 0;
        return;
    }
    /* a window of a few heartbeats can fall on a burst of other work on a
     * shared machine (20% and more, one window to the next): the figure
     * moves when the judgement before, on this plan, saw it off the same
     * way too, to the mean of the two */
    const bool confirmed = n->pend_epoch == c->epoch && (n->pend_gflops > was) == (g > was);
    char where[48];
    if (R > 1)
        snprintf(where, sizeof where, "stage %d, replica %d", s, r);
    else
        snprintf(where, sizeof where, "stage %d", s);
    NL_INFO("observed: node %u (%s) busy %.0f%% over %d heartbeats, %.2f ms per microbatch "
            "against %.2f ms planned: %.1f GFLOP/s instead of %.1f%s",
            n->id, where, 100 * load, n->load_n, seen_s * 1e3, pred_s * 1e3, g, was,
            confirmed ? "" : " (to be confirmed by the next judgement)");
    if (confirmed) {
        n->seen_gflops = 0.5 * (g + n->pend_gflops);
        n->pend_epoch = 0;
        NL_INFO("observed: node %u: %.1f GFLOP/s from now on (the mean of %.1f, the judgement "
                "before, and %.1f)",
                n->id, n->seen_gflops, n->pend_gflops, g);
        c->replan_wanted |= COORD_REPLAN_SPEEDS;
    } else {
        n->pend_gflops = g;
        n->pend_epoch = c->epoch;
    }
}

void coord_observe_speeds(nl_coord *c)
{
    const int S = c->plan ? c->plan->n_stages : 0;
    /* the busy fractions and predicted times summed over the stages, each
     * the mean over its replicas judged (so the stages weigh the same
     * whatever their replicas) */
    double loads = 0, pred = 0;
    int ok = S > 1, short_of = 0;
    for (int s = 0; s < S && ok; s++) {
        double l = 0, p = 0;
        int k = 0;
        for (int r = 0; r < coord_stage_replicas(c, s); r++) {
            const cnode *n = judged_replica(c, s, r, &short_of);
            if (n) {
                l += n->load_sum / n->load_n;
                p += predicted_now(c, s, n);
                k++;
            }
        }
        ok = k > 0 && !short_of;
        loads += ok ? l / k : 0;
        pred += ok ? p / k : 0;
    }
    for (int s = 0; s < S && ok && loads > 0.05 * S && pred > 0; s++)
        for (int r = 0; r < coord_stage_replicas(c, s); r++) {
            cnode *n = judged_replica(c, s, r, &short_of);
            if (n)
                judge(c, n, s, r, coord_stage_replicas(c, s), loads, pred);
        }
    coord_observe_restart(c);
}

void coord_observe_restart(nl_coord *c)
{
    for (int i = 0; i < c->n_nodes; i++) {
        c->nodes[i].load_sum = 0;
        c->nodes[i].load_n = 0;
    }
}

int coord_observe_ready(const nl_coord *c)
{
    const int S = c->plan ? c->plan->n_stages : 0;
    int short_of = 0;
    for (int s = 0; s < S; s++) {
        int k = 0;
        for (int r = 0; r < coord_stage_replicas(c, s); r++)
            k += judged_replica((nl_coord *)c, s, r, &short_of) != NULL;
        if (!k || short_of)
            return 0;
    }
    return S > 1;
}
