/* The stages' observed speeds (coordinator/coord_impl.h,
 * coord_observe_speeds): during a training job each stage's busy fraction,
 * from its node's heartbeats, against the plan's predicted stage times
 * gives the node's throughput as the job sees it; a figure that moves past
 * --replan-margin, two judgements in a row, asks for a re-plan
 * (docs/cluster.md, "At a checkpoint" and "The early re-balance"). */
#include "coordinator/coord_impl.h"

#include <math.h>
#include <stdbool.h>

#include "base/log.h"

/* Heartbeats a stage needs since the last checkpoint to be judged. */
#define OBSERVE_MIN_BEATS 3

/* Stage s's predicted seconds per microbatch at its node's figure now: the
 * plan's, scaled by the figure it was made with over the one the node has
 * since a judgement moved it without a re-plan (so a node judged slower
 * and left where it was is not judged slower again for the same share). */
static double predicted_now(const nl_coord *c, int s, const cnode *n)
{
    const double now = n->seen_gflops > 0 ? n->seen_gflops : n->gflops;
    const double at = n->plan_gflops > 0 ? n->plan_gflops : now;
    return now > 0 ? c->plan->stages[s].seconds * at / now : c->plan->stages[s].seconds;
}

void coord_observe_speeds(nl_coord *c)
{
    const int S = c->plan ? c->plan->n_stages : 0;
    double loads = 0, pred = 0;
    int ok = S > 1;
    for (int s = 0; s < S && ok; s++) {
        const cnode *n = coord_stage_node(c, s);
        ok = n && n->load_n >= OBSERVE_MIN_BEATS;
        loads += ok ? n->load_sum / n->load_n : 0;
        pred += ok ? predicted_now(c, s, n) : 0;
    }
    for (int s = 0; s < S && ok && loads > 0.05 * S && pred > 0; s++) {
        /* a stage's share of the busy time against its predicted share:
         * the per-microbatch seconds rescaled to the observed ones */
        cnode *n = coord_stage_node(c, s);
        const double load = n->load_sum / n->load_n;
        const double was = n->seen_gflops > 0 ? n->seen_gflops : n->gflops;
        const double seen_s = load / loads * pred, pred_s = predicted_now(c, s, n);
        const double g = seen_s > 0 ? was * pred_s / seen_s : was;
        if (fabs(g / was - 1.0) <= c->o.replan_margin) {
            n->pend_epoch = 0;
            continue;
        }
        /* a window of a few heartbeats can fall on a burst of other work
         * on a shared machine (20% and more, one window to the next): the
         * figure moves when the judgement before, on this plan, saw it off
         * the same way too, to the mean of the two */
        const bool confirmed = n->pend_epoch == c->epoch && (n->pend_gflops > was) == (g > was);
        NL_INFO("observed: node %u (stage %d) busy %.0f%% over %d heartbeats, %.2f ms per "
                "microbatch against %.2f ms planned: %.1f GFLOP/s instead of %.1f%s",
                n->id, s, 100 * load, n->load_n, seen_s * 1e3, pred_s * 1e3, g, was,
                confirmed ? "" : " (to be confirmed by the next judgement)");
        if (confirmed) {
            n->seen_gflops = 0.5 * (g + n->pend_gflops);
            n->pend_epoch = 0;
            NL_INFO("observed: node %u: %.1f GFLOP/s from now on (the mean of %.1f, the "
                    "judgement before, and %.1f)",
                    n->id, n->seen_gflops, n->pend_gflops, g);
            c->replan_wanted |= COORD_REPLAN_SPEEDS;
        } else {
            n->pend_gflops = g;
            n->pend_epoch = c->epoch;
        }
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
    for (int s = 0; s < S; s++) {
        const cnode *n = coord_stage_node((nl_coord *)c, s);
        if (!n || n->load_n < OBSERVE_MIN_BEATS)
            return 0;
    }
    return S > 1;
}
