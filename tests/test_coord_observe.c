/* The coordinator's judgement of the stages' observed speeds
 * (coord_observe_speeds, coordinator/coord_plan.c), in-process against two
 * fake nodes of equal probes on a plan of two stages: the busy fractions
 * the test writes into the nodes' heartbeat sums stand for a window of
 * training, so no timing is measured.
 *  - a window that sees a node off by more than --replan-margin changes no
 *    figure and asks for no re-plan: it waits for the next judgement;
 *  - the next window off the other way does not confirm it (a burst of
 *    other work, then another), and becomes the one to confirm;
 *  - the next window off the same way confirms it: each node's figure
 *    becomes the mean of the two windows', and a re-plan is asked for;
 *  - a window within the margin drops what waited, as a new plan does;
 *  - a figure so moved without a re-plan predicts the stage's share from
 *    then on: the same shares again judge the node no slower again.
 * Then on a plan with replicas (--replicas 2,1 on three nodes): every
 * replica's node is judged against its own share, so a replica of stage 0
 * busy twice as long as its sibling is judged at half its speed (replica
 * 0's alone were judged before). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coordinator/coord.h"
#include "coordinator/coord_impl.h"
#include "tests/check.h"
#include "tests/coord_fake.h"

static char tmpdir[256];

/* A window of 4 heartbeats: stage 0's node busy l0, stage 1's l1; judged. */
static void window(double l0, double l1)
{
    cnode *s0 = coord_stage_node(coord, 0), *s1 = coord_stage_node(coord, 1);
    s0->load_sum = 4 * l0;
    s1->load_sum = 4 * l1;
    s0->load_n = s1->load_n = 4;
    coord->replan_wanted = 0;
    coord_observe_speeds(coord);
}

static double figure(int stage)
{
    return coord_stage_node(coord, stage)->seen_gflops;
}

/* Part one: two stages, no replicas. */
static void test_stages(void)
{
    coord_fake_start("coord_observe", tmpdir, sizeof tmpdir, NULL);
    fake_open(&nodes[0], "obsa", "tcp://127.0.0.1:1");
    fake_open(&nodes[1], "obsb", "tcp://127.0.0.1:2");
    join(&nodes[0], 20.0);
    join(&nodes[1], 20.0);
    if (!CHECK_PUMP(fakes_take_plan(2)))
        goto done;
    CHECK(coord->plan && coord->plan->n_stages == 2 && coord_stage_node(coord, 0) &&
              coord_stage_node(coord, 1),
          "a plan of two stages: %d", coord->plan ? coord->plan->n_stages : 0);
    if (!coord->plan || coord->plan->n_stages != 2)
        goto done;
    const double pred0 = coord->plan->stages[0].seconds, pred1 = coord->plan->stages[1].seconds;
    printf("planned %.3f / %.3f ms per microbatch, margin %.2f\n", pred0 * 1e3, pred1 * 1e3,
           coord->o.replan_margin);

    /* stage 0 busy 0.9, stage 1 0.5: each far off its planned share; the
     * first such window only waits */
    window(0.9, 0.5);
    CHECK(figure(0) == 0 && figure(1) == 0, "one window moved the figures: %g %g", figure(0),
          figure(1));
    CHECK(!(coord->replan_wanted & COORD_REPLAN_SPEEDS), "one window asked for a re-plan");
    /* the other way round: no confirmation */
    window(0.5, 0.9);
    CHECK(figure(0) == 0 && figure(1) == 0, "a window the other way confirmed: %g %g", figure(0),
          figure(1));
    CHECK(!(coord->replan_wanted & COORD_REPLAN_SPEEDS), "opposite windows asked for a re-plan");
    /* 0.5 / 0.9 again: confirmed; the figures are the means of the two
     * windows' (here equal): stage s's node at 20 x its planned share of
     * the busy time over its observed share */
    window(0.5, 0.9);
    const double tot = pred0 + pred1, w0 = 20 * (pred0 / tot) / (0.5 / 1.4),
                 w1 = 20 * (pred1 / tot) / (0.9 / 1.4);
    CHECK(fabs(figure(0) / w0 - 1) < 1e-9 && fabs(figure(1) / w1 - 1) < 1e-9,
          "confirmed figures %g %g, want %g %g", figure(0), figure(1), w0, w1);
    CHECK(coord->replan_wanted & COORD_REPLAN_SPEEDS, "two windows the same way asked for none");
    const double f0 = figure(0), f1 = figure(1);

    /* the plan stays (nothing here re-plans): the same shares again are
     * what the figures now predict, not a node slower again */
    window(0.5, 0.9);
    window(0.5, 0.9);
    CHECK(figure(0) == f0 && figure(1) == f1, "judged again for the same shares: %g %g (was %g %g)",
          figure(0), figure(1), f0, f1);

    /* the mean of two windows of one way, each against the shares the
     * figures now predict (the plan's seconds at 20 GFLOP/s, scaled) */
    const double p0 = pred0 * 20 / f0, p1 = pred1 * 20 / f1, sh0 = p0 / (p0 + p1);
    window(0.8, 0.5);
    window(0.9, 0.5);
    const double g_a = f0 * sh0 / (0.8 / 1.3), g_b = f0 * sh0 / (0.9 / 1.4);
    CHECK(fabs(figure(0) / (0.5 * (g_a + g_b)) - 1) < 1e-9, "the mean: %g, want %g", figure(0),
          0.5 * (g_a + g_b));

    /* a window within the margin drops what waited: off, within (the
     * shares the figures predict), off is no confirmation */
    const double h0 = figure(0), h1 = figure(1);
    const double q0 = pred0 * 20 / h0, q1 = pred1 * 20 / h1;
    window(0.9, 0.4);
    window(q0 / (q0 + q1), q1 / (q0 + q1));
    window(0.9, 0.4);
    CHECK(figure(0) == h0 && figure(1) == h1, "confirmed across a quiet window: %g %g (was %g %g)",
          figure(0), figure(1), h0, h1);
    /* and a new plan drops it too: off, a new epoch, off */
    coord->epoch++;
    window(0.9, 0.4);
    CHECK(figure(0) == h0 && figure(1) == h1, "confirmed across plans: %g %g (was %g %g)",
          figure(0), figure(1), h0, h1);
done:
    nl_sock_destroy(&nodes[0].sock);
    nl_sock_destroy(&nodes[1].sock);
    coord_fake_stop(tmpdir);
}

static void replica_opts(nl_coord_opts *o)
{
    o->min_nodes = 3;
    o->replicas = -1; /* --replicas 2,1 */
    o->stage_replicas[0] = 2;
    o->stage_replicas[1] = 1;
    o->n_stage_replicas = 2;
}

/* The figure the judgement gives a node busy `load` of a window whose
 * stages' mean busy fractions sum to `loads`, on a stage predicted `pred`
 * of the plan's `tot` seconds a microbatch (every node planned at 20 and
 * not moved since); 0 when that is within the margin (the figure stays). */
static double judged(double load, double loads, double pred, double tot)
{
    const double g = 20 * pred / (load / loads * tot);
    return fabs(g / 20 - 1) <= coord->o.replan_margin ? 0 : g;
}

/* Part two: --replicas 2,1. */
static void test_replicas(void)
{
    coord_fake_start("coord_observe_r", tmpdir, sizeof tmpdir, replica_opts);
    fake_open(&nodes[0], "oba", "tcp://127.0.0.1:1");
    fake_open(&nodes[1], "obb", "tcp://127.0.0.1:2");
    fake_open(&nodes[2], "obc", "tcp://127.0.0.1:3");
    for (int i = 0; i < 3; i++)
        join(&nodes[i], 20.0);
    if (!CHECK_PUMP(fakes_take_plan(3)))
        goto done;
    cnode *a = coord_stage_replica(coord, 0, 0), *b = coord_stage_replica(coord, 0, 1),
          *z = coord_stage_node(coord, 1);
    CHECK(coord->plan && coord->plan->n_stages == 2 && a && b && z,
          "a plan of two stages, the first of two replicas");
    if (!(coord->plan && coord->plan->n_stages == 2 && a && b && z))
        goto done;
    const double p0 = coord->plan->stages[0].seconds, p1 = coord->plan->stages[1].seconds;
    printf("replicas: planned %.3f (2 replicas) / %.3f ms per microbatch\n", p0 * 1e3, p1 * 1e3);
    /* replica 1 busy twice as long as replica 0, twice: judged at half
     * its sibling's figure (each against the stage's share: the stages
     * weigh their replicas' mean) */
    const double la = 0.4, lb = 0.8, lz = 0.45, loads = 0.5 * (la + lb) + lz;
    for (int w = 0; w < 2; w++) {
        a->load_sum = 4 * la;
        b->load_sum = 4 * lb;
        z->load_sum = 4 * lz;
        a->load_n = b->load_n = z->load_n = 4;
        coord->replan_wanted = 0;
        coord_observe_speeds(coord);
    }
    const double ga = judged(la, loads, p0, p0 + p1), gb = judged(lb, loads, p0, p0 + p1),
                 gz = judged(lz, loads, p1, p0 + p1);
    CHECK(gb > 0 && fabs(b->seen_gflops / gb - 1) < 1e-9, "replica 1: %g, want %g", b->seen_gflops,
          gb);
    CHECK(ga == 0 ? a->seen_gflops == 0 : fabs(a->seen_gflops / ga - 1) < 1e-9,
          "replica 0: %g, want %g", a->seen_gflops, ga);
    CHECK(gz == 0 ? z->seen_gflops == 0 : fabs(z->seen_gflops / gz - 1) < 1e-9,
          "stage 1: %g, want %g", z->seen_gflops, gz);
    const double fa = a->seen_gflops > 0 ? a->seen_gflops : 20;
    CHECK(fabs(b->seen_gflops / fa - la / lb) < 0.1,
          "replica 1 at %g of replica 0's figure, want %g", b->seen_gflops / fa, la / lb);
    CHECK(coord->replan_wanted & COORD_REPLAN_SPEEDS, "a slow replica asked for no re-plan");
done:
    for (int i = 0; i < 3; i++)
        nl_sock_destroy(&nodes[i].sock);
    coord_fake_stop(tmpdir);
}

int main(void)
{
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_WARN);
    nl_error err = {0};
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    test_stages();
    test_replicas();
    nl_net_destroy(&net);
    coord_fake_add_counts(&check_pass_count, &check_fail_count);
    return check_done("test_coord_observe");
}
