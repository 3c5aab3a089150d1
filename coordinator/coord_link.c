/* The nodes' link speeds as measured (issue 30): each replica of a stage
 * times its gradients' all-reduce (node/stage_train_ring.c) and its
 * heartbeat carries the counters (bytes as the cost model counts them,
 * seconds from its last backward to the sum); the rate between two
 * heartbeats is one measurement, and a node's link speed is the median of
 * its last COORD_LINK_WINDOW. --replicas auto and the hop cost plan with
 * it (coord_plan.c), and a plan costed at a link speed that the
 * measurements have since left by more than --replan-margin asks for a
 * re-plan. A file of its own because it is the one place that turns the
 * nodes' untrusted figures into a speed. */
#include "coordinator/coord_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

/* The range a measurement may take: 1 kB/s to 10 TB/s; outside it, a
 * figure is not believed (ignored, logged). */
#define LINK_MIN_BYTES_S 1e3
#define LINK_MAX_BYTES_S 1e13

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double coord_link_bytes_s(const cnode *n)
{
    double v[COORD_LINK_WINDOW];
    const int k = n->link_n < COORD_LINK_WINDOW ? n->link_n : COORD_LINK_WINDOW;
    if (k == 0)
        return 0.0;
    memcpy(v, n->link_win, (size_t)k * sizeof *v);
    qsort(v, (size_t)k, sizeof *v, cmp_double);
    return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}

double coord_link_or_assumed(const cnode *n, int *measured)
{
    const double v = n ? coord_link_bytes_s(n) : 0.0;
    if (measured)
        *measured = v > 0;
    return v > 0 ? v : COORD_LINK_ASSUMED;
}

/* A measurement moved the current plan's link by more than the margin:
 * --replicas auto asks for a re-plan (at the next checkpoint, or at
 * rest). */
static void judge_plan_link(nl_coord *c)
{
    if (c->o.replicas != 0 || !c->plan || !(c->plan_link_bytes_s > 0) ||
        (c->replan_wanted & COORD_REPLAN_SPEEDS))
        return;
    int meas = 0;
    const double now = coord_link_plan_now(c, &meas);
    if (fabs(now / c->plan_link_bytes_s - 1.0) <= c->o.replan_margin)
        return;
    NL_INFO("the replicas' link measures %.3g GB/s against the %.3g GB/s (%s) the plan was "
            "costed at: a re-plan may pay",
            now / 1e9, c->plan_link_bytes_s / 1e9, c->plan_link_measured ? "measured" : "assumed");
    c->replan_wanted |= COORD_REPLAN_SPEEDS;
}

void coord_link_heartbeat(nl_coord *c, cnode *n, const nl_msg_heartbeat *hb)
{
    const uint64_t b = hb->reduce_bytes;
    const double s = hb->reduce_s;
    if (b == n->link_bytes0 && s == n->link_s0)
        return; /* no all-reduce since the last heartbeat */
    if (b < n->link_bytes0 || s < n->link_s0 || !isfinite(s)) { /* the node started again */
        n->link_bytes0 = b;
        n->link_s0 = isfinite(s) ? s : 0.0;
        return;
    }
    const double db = (double)(b - n->link_bytes0), ds = s - n->link_s0;
    n->link_bytes0 = b;
    n->link_s0 = s;
    const double v = ds > 0 ? db / ds : INFINITY;
    if (!(db > 0) || !(v >= LINK_MIN_BYTES_S && v <= LINK_MAX_BYTES_S)) {
        NL_WARN("node %u: an all-reduce of %.0f bytes in %.3g s (%.3g bytes/s) is not a link "
                "speed (%g to %g): ignored",
                n->id, db, ds, v, LINK_MIN_BYTES_S, LINK_MAX_BYTES_S);
        return;
    }
    n->link_win[n->link_i] = v;
    n->link_i = (n->link_i + 1) % COORD_LINK_WINDOW;
    if (n->link_n < COORD_LINK_WINDOW)
        n->link_n++;
    judge_plan_link(c);
}
