/* Tests of the planner's replicated plans (DESIGN section 8) and their
 * costs: R replicas on every stage, a replica count per stage (forced, and
 * chosen from the nodes' speeds: the slow stage gets more; a node beside a
 * uniform plan joins the stage where a step is fastest), the step time's
 * model and the link speeds the replicas' all-reduce is costed at.
 * test_planner.c holds the depth-only planner, test_sizing.c the sizer. */
#include <inttypes.h>
#include <stdint.h>

#include "core/model/memory.h"
#include "core/model/model.h"
#include "core/plan/planner.h"
#include "core/plan/sizing.h"
#include "tests/check.h"
#include "tests/planner_harness.h"

/* Replicated plans (DESIGN section 8): every stage's replicas fit the
 * stage, each node holds at most one replica, the fastest nodes are
 * grouped, and R = 1 is the plain plan. */
static void check_replicated(const nl_plan *p, const nl_plan_node *nodes, int n, int R)
{
    int seen[64] = {0};
    for (int s = 0; s < p->n_stages; s++) {
        const nl_plan_stage *g = &p->stages[s];
        CHECK(g->n_replicas == R && g->replicas[0] == g->node_id,
              "stage %d: %d replicas, replica 0 on %d, node %d", s, g->n_replicas, g->replicas[0],
              g->node_id);
        for (int r = 0; r < g->n_replicas; r++) {
            const nl_plan_node *nd = find_node(nodes, n, g->replicas[r]);
            CHECK(nd && g->bytes <= nd->memory_bytes, "stage %d replica %d on node %d fits", s, r,
                  g->replicas[r]);
            CHECK(nd && !seen[nd - nodes]++, "node %d holds one replica", g->replicas[r]);
        }
    }
    for (int i = 0; i < p->n_standby; i++) {
        const nl_plan_node *nd = find_node(nodes, n, p->standby[i]);
        CHECK(nd && !seen[nd - nodes]++, "standby %d holds nothing", p->standby[i]);
    }
    for (int i = 0; i < n; i++)
        CHECK(seen[i] == 1, "node %d is placed once (%d)", nodes[i].id, seen[i]);
}

static void test_replicated(void)
{
    nl_config c = small_cfg(8);
    nl_plan_opts o = train_opts(64, 4);
    nl_error err = {0};
    nl_plan *p = NULL, *q = NULL;

    /* four equal nodes as 2 x 2: the layers split evenly */
    nl_plan_node four[4];
    for (int i = 0; i < 4; i++)
        four[i] = node(10 + i, 1 * GIB, 20, 0);
    CHECK_OK(nl_plan_layers_replicated(&p, &c, four, 4, &o, 2, &err), &err);
    CHECK(p->n_stages == 2 && p->n_standby == 0, "2 x 2: %d stages, %d standby", p->n_stages,
          p->n_standby);
    CHECK(p->stages[0].l1 == 4 && p->stages[1].l0 == 4 && p->stages[1].l1 == 8,
          "2 x 2: layers [0,%d) [%d,%d)", p->stages[0].l1, p->stages[1].l0, p->stages[1].l1);
    for (int s = 0; s < 2; s++)
        CHECK(p->stages[s].replicas[0] % 2 == 0 &&
                  p->stages[s].replicas[1] == p->stages[s].replicas[0] + 1,
              "ties group in input order: %d %d", p->stages[s].replicas[0],
              p->stages[s].replicas[1]);
    check_replicated(p, four, 4, 2);
    /* a replica per stage halves the time per microbatch */
    CHECK_OK(nl_plan_layers(&q, &c, four, 2, &o, &err), &err);
    CHECK(q->n_stages == 2 && fabs(p->bottleneck * 2 - q->bottleneck) <= 1e-12 * q->bottleneck,
          "2 x 2 %.3g s against 2 x 1 %.3g s", p->bottleneck, q->bottleneck);
    nl_plan_destroy(&q);
    nl_plan_destroy(&p);

    /* five mixed nodes: the two fastest hold a stage, the slowest waits */
    nl_plan_node mix[5] = {node(1, 1 * GIB, 10, 0), node(2, 1 * GIB, 40, 0), node(3, 1 * GIB, 5, 0),
                           node(4, 1 * GIB, 40, 0), node(5, 2 * GIB, 10, 0)};
    CHECK_OK(nl_plan_layers_replicated(&p, &c, mix, 5, &o, 2, &err), &err);
    check_replicated(p, mix, 5, 2);
    int slow_waits = 0;
    for (int i = 0; i < p->n_standby; i++)
        slow_waits |= p->standby[i] == 3;
    CHECK(slow_waits, "the slowest node waits");
    int fast = -1;
    for (int s = 0; s < p->n_stages; s++)
        if (p->stages[s].replicas[0] == 2)
            fast = s;
    CHECK(fast >= 0 && p->stages[fast].replicas[1] == 4, "the fastest pair is one stage");
    nl_plan_destroy(&p);

    /* R = 1 is the plain plan, with its one replica named */
    CHECK_OK(nl_plan_layers_replicated(&p, &c, mix, 5, &o, 1, &err), &err);
    CHECK_OK(nl_plan_layers(&q, &c, mix, 5, &o, &err), &err);
    CHECK(p->n_stages == q->n_stages && p->bottleneck == q->bottleneck, "R = 1: the same plan");
    for (int s = 0; s < p->n_stages; s++)
        CHECK(p->stages[s].n_replicas == 1 && p->stages[s].replicas[0] == p->stages[s].node_id,
              "R = 1: stage %d names its node", s);
    nl_plan_destroy(&q);
    nl_plan_destroy(&p);

    /* a group's memory is its smallest member's: a pair with a tiny node
     * cannot hold what the big one alone could */
    nl_plan_node lop[2] = {node(1, 1 * GIB, 20, 0), node(2, 64 * 1024, 20, 0)};
    CHECK(nl_plan_layers_replicated(&p, &c, lop, 2, &o, 2, &err) == NL_ERR_CAPACITY && !p,
          "a tiny replica: %s", err.msg);
    CHECK(strstr(err.msg, "replicas per stage"), "named: %s", err.msg);

    /* the input checked */
    CHECK(nl_plan_layers_replicated(&p, &c, four, 4, &o, 0, &err) == NL_ERR_INVALID, "0 replicas");
    CHECK(nl_plan_layers_replicated(&p, &c, four, 4, &o, NL_PLAN_MAX_REPLICAS + 1, &err) ==
              NL_ERR_INVALID,
          "too many replicas");
    CHECK(nl_plan_layers_replicated(&p, &c, four, 1, &o, 2, &err) == NL_ERR_CAPACITY &&
              strstr(err.msg, "at least 2 nodes"),
          "one node for 2 replicas: %s", err.msg);
    nl_plan_node dup[2] = {node(7, 1 * GIB, 20, 0), node(7, 1 * GIB, 20, 0)};
    CHECK(nl_plan_layers_replicated(&p, &c, dup, 2, &o, 2, &err) == NL_ERR_INVALID,
          "a duplicate id");
    /* the choice of R: four equal nodes, 4 layers, 8 microbatches a step.
     * With a free link, replicas beat depth (fewer stages fill the
     * pipeline faster, the all-reduce costs nothing); a slow link makes
     * the all-reduce cost more than replicas gain: depth alone */
    nl_config c4 = small_cfg(4);
    int R = 0, n_tried = 0;
    double t_free = 0, t_slow = 0;
    nl_plan_replica_option tried[NL_PLAN_MAX_REPLICAS];
    CHECK_OK(
        nl_plan_choose_replicas(&p, &R, &t_free, tried, &n_tried, &c4, four, 4, &o, 8, 0.0, &err),
        &err);
    CHECK(R > 1 && p->stages[0].n_replicas == R, "a free link: %d replicas", R);
    /* every R tried is listed (1, 2, 4 divide 8), the choice the fastest */
    CHECK(n_tried == 3 && tried[0].replicas == 1 && tried[1].replicas == 2 &&
              tried[2].replicas == 4,
          "%d tried", n_tried);
    for (int k = 0; k < n_tried; k++)
        CHECK(tried[k].stages > 0 && tried[k].step_s >= t_free * (1 - 1e-9) &&
                  (tried[k].replicas != R || tried[k].step_s == t_free),
              "R=%d: %d stages, %g s a step (the choice %g)", tried[k].replicas, tried[k].stages,
              tried[k].step_s, t_free);
    CHECK(nl_plan_step_seconds(p, &c4, &o, 8, 0.0) == t_free, "the step's seconds again");
    nl_plan_destroy(&p);
    CHECK_OK(nl_plan_choose_replicas(&p, &R, &t_slow, NULL, NULL, &c4, four, 4, &o, 8, 1e3, &err),
             &err);
    CHECK(R == 1 && p->stages[0].n_replicas == 1, "a 1 kB/s link: %d replicas", R);
    CHECK(t_slow >= t_free, "a slow link is never faster: %g vs %g", t_slow, t_free);
    nl_plan_destroy(&p);
    /* the chosen plan is the best of the R tried, by the model */
    for (int k = 1; k <= 4; k++) {
        if (8 % k != 0 || nl_plan_layers_replicated(&q, &c4, four, 4, &o, k, &err) != NL_OK)
            continue;
        const double t = (8 / k + q->n_stages - 1) * k * q->bottleneck;
        CHECK(t >= t_free * (1 - 1e-9), "R=%d: %g s a step, the choice %g", k, t, t_free);
        nl_plan_destroy(&q);
    }
    CHECK(nl_plan_choose_replicas(&p, &R, NULL, NULL, NULL, &c4, lop, 1, &o, 8, 0.0, &err) ==
                  NL_OK ||
              err.msg[0],
          "one node: a plan or why not");
    nl_plan_destroy(&p);
    CHECK(nl_plan_choose_replicas(&p, &R, NULL, NULL, NULL, &c4, four, 4, &o, 0, 0.0, &err) ==
              NL_ERR_INVALID,
          "0 microbatches");
    /* 3 microbatches do not divide among 2 or 4 replicas: 1 or 3 */
    CHECK_OK(nl_plan_choose_replicas(&p, &R, NULL, NULL, NULL, &c4, four, 4, &o, 3, 0.0, &err),
             &err);
    CHECK(R == 1 || R == 3, "3 microbatches: %d replicas", R);
    nl_plan_destroy(&p);
    printf("replicated plans: ok\n");
}

/* The link speed the choice of R costs each plan's all-reduce at: the
 * slowest measured link among the plan's replicas, the assumed speed for
 * a node never measured (issue 30: the choice follows measurement). */
static void test_measured_link(void)
{
    nl_config c = small_cfg(4);
    nl_plan_opts o = train_opts(64, 32);
    nl_error err = {0};
    nl_plan *p = NULL;
    nl_plan_replica_option tried[NL_PLAN_MAX_REPLICAS];
    int R = 0, n_tried = 0, meas = -1;
    nl_plan_node eight[8];
    for (int i = 0; i < 8; i++)
        eight[i] = node(1 + i, 1 * GIB, 20, 1e-4);

    /* fast links measured on every node: the widest plan */
    for (int i = 0; i < 8; i++)
        eight[i].link_bytes_s = 10e9;
    CHECK_OK(
        nl_plan_choose_replicas(&p, &R, NULL, tried, &n_tried, &c, eight, 8, &o, 32, 1e9, &err),
        &err);
    const int R_fast = R;
    CHECK(R_fast == 8, "10 GB/s measured: %d replicas", R_fast);
    for (int k = 0; k < n_tried; k++)
        CHECK(tried[k].replicas == 1 ? tried[k].link_measured == 0 && tried[k].link_bytes_s == 1e9
                                     : tried[k].link_measured == 1 && tried[k].link_bytes_s == 10e9,
              "R=%d costed at %g B/s (measured %d)", tried[k].replicas, tried[k].link_bytes_s,
              tried[k].link_measured);
    CHECK(nl_plan_link_bytes_s(p, eight, 8, 1e9, &meas) == 10e9 && meas == 1, "the plan's link");
    nl_plan_destroy(&p);

    /* the same nodes measured slow: fewer replicas */
    for (int i = 0; i < 8; i++)
        eight[i].link_bytes_s = 20e3;
    CHECK_OK(nl_plan_choose_replicas(&p, &R, NULL, NULL, NULL, &c, eight, 8, &o, 32, 1e9, &err),
             &err);
    CHECK(R < R_fast, "20 kB/s measured: %d replicas (fast: %d)", R, R_fast);
    nl_plan_destroy(&p);

    /* one slow node: every plan that makes it a replica pays for it; the
     * others are at the speed measured; unmeasured nodes at the assumed */
    for (int i = 0; i < 8; i++)
        eight[i].link_bytes_s = i == 5 ? 20e3 : 0.0;
    CHECK_OK(
        nl_plan_choose_replicas(&p, &R, NULL, tried, &n_tried, &c, eight, 8, &o, 32, 10e9, &err),
        &err);
    for (int k = 0; k < n_tried; k++)
        if (tried[k].replicas == 8)
            CHECK(tried[k].link_bytes_s == 20e3 && tried[k].link_measured == 1,
                  "8 replicas include node 6: %g B/s", tried[k].link_bytes_s);
    CHECK(R < 8, "one slow node: %d replicas", R);
    const double link = nl_plan_link_bytes_s(p, eight, 8, 10e9, &meas);
    CHECK(R == 1 ? link == 10e9 && meas == 0 : (link == 20e3) == (meas == 1),
          "the chosen plan's link %g (measured %d)", link, meas);
    nl_plan_destroy(&p);
    /* no measurement anywhere: the assumed speed, said as such */
    for (int i = 0; i < 8; i++)
        eight[i].link_bytes_s = 0.0;
    CHECK_OK(nl_plan_layers_replicated(&p, &c, eight, 8, &o, 4, &err), &err);
    CHECK(nl_plan_link_bytes_s(p, eight, 8, 1e9, &meas) == 1e9 && meas == 0, "assumed");
    nl_plan_destroy(&p);

    /* a bad figure is refused, named */
    eight[2].link_bytes_s = -1.0;
    CHECK(nl_plan_choose_replicas(&p, &R, NULL, NULL, NULL, &c, eight, 8, &o, 32, 1e9, &err) ==
                  NL_ERR_INVALID &&
              !p && strstr(err.msg, "link"),
          "a negative link: %s", err.msg);
    eight[2].link_bytes_s = NAN;
    CHECK(nl_plan_layers(&p, &c, eight, 8, &o, &err) == NL_ERR_INVALID && !p, "a NaN link: %s",
          err.msg);
    printf("measured links: ok\n");
}

/* nl_plan_step_seconds: with R on every stage the uniform formula, and
 * with a count per stage the busiest replica plus one fill. */
static void test_step_seconds(void)
{
    nl_config c = small_cfg(8);
    nl_plan_opts o = train_opts(64, 4);
    nl_error err = {0};
    nl_plan *p = NULL;
    nl_plan_node four[4];
    for (int i = 0; i < 4; i++)
        four[i] = node(1 + i, 1 * GIB, 20 + i, 0);
    CHECK_OK(nl_plan_layers_replicated(&p, &c, four, 4, &o, 2, &err), &err);
    for (int M = 1; p && M <= 9; M++) {
        const double want = (double)((M + 1) / 2 + p->n_stages - 1) * 2 * p->bottleneck;
        const double got = nl_plan_step_seconds(p, &c, &o, M, 0.0);
        CHECK(fabs(got - want) <= 1e-12 * want, "M=%d: %g s, the uniform formula %g", M, got, want);
    }
    nl_plan_destroy(&p);
    /* stage 0: 2 replicas at 1 s a microbatch over them (2 s on one), stage 1:
     * one at 1.5 s; 4 microbatches: the busiest replica 4 x 1.5, one fill 2 */
    nl_plan_stage st[2] = {{.n_replicas = 2, .l0 = 0, .l1 = 4, .has_embed = 1, .seconds = 1.0},
                           {.n_replicas = 1, .l0 = 4, .l1 = 8, .has_head = 1, .seconds = 1.5}};
    nl_plan two = {.n_stages = 2, .stages = st, .bottleneck = 1.5};
    CHECK(nl_plan_step_seconds(&two, &c, &o, 4, 0.0) == 8.0, "2 + 1: %g s",
          nl_plan_step_seconds(&two, &c, &o, 4, 0.0));
    /* the all-reduce: stage 0's alone (stage 1 has one replica) */
    const uint64_t w = nl_memory_estimate(&c, 4, 1, 0, &o.mem).weights;
    const double t = nl_plan_step_seconds(&two, &c, &o, 4, 1e6);
    CHECK(fabs(t - (8.0 + (double)w / 1e6)) < 1e-9 * t, "2 + 1 with a 1 MB/s link: %g s", t);
    printf("step seconds: ok\n");
}

/* Every rule a plan with a count per stage keeps: its stages cover the
 * layers in order, each stage fits every replica's node, each node holds
 * at most one replica, standby is the rest; returns its bottleneck. */
static double check_staged(const nl_plan *p, const nl_config *c, const nl_plan_opts *o,
                           const nl_plan_node *nodes, int n)
{
    int seen[64] = {0}, covered = 0, ok = 1;
    double worst = 0.0;
    const int S = p->n_stages;
    for (int s = 0; s < S; s++) {
        const nl_plan_stage *g = &p->stages[s];
        nl_plan_node v = {0, UINT64_MAX, 0.0, 0.0, 0.0};
        ok &= g->l0 == covered && g->l1 > g->l0 && g->replicas[0] == g->node_id;
        ok &= g->has_embed == (s == 0) && g->has_head == (s == S - 1);
        ok &= g->bytes == nl_plan_stage_bytes(c, o, g->l1 - g->l0, s, S);
        for (int r = 0; r < g->n_replicas; r++) {
            const nl_plan_node *nd = find_node(nodes, n, g->replicas[r]);
            ok &= nd && !seen[nd - nodes]++ && g->bytes <= nd->memory_bytes;
            if (nd && (r == 0 || nd->gflops < v.gflops))
                v.gflops = nd->gflops;
            if (nd && nd->hop_seconds > v.hop_seconds)
                v.hop_seconds = nd->hop_seconds;
        }
        v.gflops *= g->n_replicas;
        const double sec = nl_plan_stage_seconds(c, o, &v, g->l1 - g->l0, s, S);
        ok &= g->seconds == sec;
        worst = sec > worst ? sec : worst;
        covered = g->l1;
    }
    ok &= covered == c->num_layers && p->bottleneck == worst;
    for (int i = 0; i < p->n_standby; i++) {
        const nl_plan_node *nd = find_node(nodes, n, p->standby[i]);
        ok &= nd && !seen[nd - nodes]++;
    }
    for (int i = 0; i < n; i++)
        ok &= seen[i] == 1;
    CHECK(ok, "a staged plan breaks a rule (%d stages, %d standby)", S, p->n_standby);
    return worst;
}

/* nl_plan_layers_staged: the counts as given, the fastest nodes first,
 * the split with the smallest bottleneck (against every split of two
 * stages), and its errors. */
static void test_staged(void)
{
    nl_config c = small_cfg(8);
    nl_plan_opts o = train_opts(64, 4);
    nl_error err = {0};
    nl_plan *p = NULL;
    nl_plan_node three[3] = {node(7, 1 * GIB, 10, 0), node(8, 1 * GIB, 30, 0),
                             node(9, 1 * GIB, 20, 0)};
    const int r21[2] = {2, 1}, r12[2] = {1, 2};
    CHECK_OK(nl_plan_layers_staged(&p, &c, three, 3, &o, r21, 2, &err), &err);
    if (p) {
        check_staged(p, &c, &o, three, 3);
        CHECK(p->n_stages == 2 && p->stages[0].n_replicas == 2 && p->stages[1].n_replicas == 1,
              "2 + 1: %d stages", p->n_stages);
        CHECK(p->stages[0].replicas[0] == 8 && p->stages[0].replicas[1] == 9 &&
                  p->stages[1].node_id == 7,
              "the fastest first: %d %d, then %d", p->stages[0].replicas[0],
              p->stages[0].replicas[1], p->stages[1].node_id);
        /* stage 0 runs at 2 x 20, stage 1 at 10: every split of two stages */
        double best = INFINITY;
        nl_plan_node g0 = node(0, 1 * GIB, 40, 0), g1 = node(1, 1 * GIB, 10, 0);
        for (int k = 1; k < 8; k++) {
            const double a = nl_plan_stage_seconds(&c, &o, &g0, k, 0, 2),
                         b = nl_plan_stage_seconds(&c, &o, &g1, 8 - k, 1, 2);
            best = fmin(best, fmax(a, b));
        }
        CHECK(p->bottleneck == best, "the best split: %g s (brute force %g)", p->bottleneck, best);
        CHECK(p->stages[0].l1 - p->stages[0].l0 > p->stages[1].l1 - p->stages[1].l0,
              "the faster pair holds more layers: [%d,%d)", p->stages[0].l0, p->stages[0].l1);
    }
    nl_plan_destroy(&p);
    CHECK_OK(nl_plan_layers_staged(&p, &c, three, 3, &o, r12, 2, &err), &err);
    if (p) {
        check_staged(p, &c, &o, three, 3);
        CHECK(p->stages[0].node_id == 8 && p->stages[1].n_replicas == 2, "1 + 2");
    }
    nl_plan_destroy(&p);
    /* one count over every stage is the uniform plan's shape */
    const int r1[1] = {1};
    CHECK_OK(nl_plan_layers_staged(&p, &c, three, 3, &o, r1, 1, &err), &err);
    CHECK(p && p->n_stages == 1 && p->n_standby == 2 && p->stages[0].node_id == 8,
          "one stage on the fastest node");
    nl_plan_destroy(&p);
    /* errors */
    const int r22[2] = {2, 2}, r0[2] = {0, 1};
    CHECK(nl_plan_layers_staged(&p, &c, three, 3, &o, r22, 2, &err) == NL_ERR_CAPACITY && !p &&
              strstr(err.msg, "at least 4 nodes"),
          "4 replicas on 3 nodes: %s", err.msg);
    CHECK(nl_plan_layers_staged(&p, &c, three, 3, &o, r0, 2, &err) == NL_ERR_INVALID && !p,
          "0 replicas: %s", err.msg);
    nl_plan_node tiny[3] = {node(1, 1 * MB, 10, 0), node(2, 1 * MB, 10, 0), node(3, 1 * MB, 10, 0)};
    CHECK(nl_plan_layers_staged(&p, &c, tiny, 3, &o, r21, 2, &err) == NL_ERR_CAPACITY && !p &&
              strstr(err.msg, "cannot hold"),
          "tiny nodes: %s", err.msg);
    nl_config c1 = small_cfg(1);
    CHECK(nl_plan_layers_staged(&p, &c1, three, 3, &o, r21, 2, &err) == NL_ERR_CAPACITY && !p,
          "2 stages of 1 layer: %s", err.msg);
    printf("staged plans: ok\n");
}

/* nl_plan_choose_stage_replicas: the slow stage gets the spare node; on
 * equal nodes the choice is nl_plan_choose_replicas's. */
static void test_choose_stages(void)
{
    nl_config c = small_cfg(2);
    nl_plan_opts o = train_opts(64, 4);
    nl_error err = {0};
    nl_plan *p = NULL, *u = NULL;
    nl_plan_replica_option tried[NL_PLAN_MAX_REPLICAS];
    int n_tried = 0, R = 0;
    double t = 0.0, tu = 0.0;
    /* two layers on three nodes: two stages at most, one node spare; room
     * for one layer and a table, not the model */
    uint64_t mem = nl_plan_stage_bytes(&c, &o, 1, 0, 2);
    if (nl_plan_stage_bytes(&c, &o, 1, 1, 2) > mem)
        mem = nl_plan_stage_bytes(&c, &o, 1, 1, 2);
    CHECK(nl_plan_stage_bytes(&c, &o, 2, 0, 1) > mem, "the model does not fit one node");
    nl_plan_node three[3] = {node(1, mem, 40, 0), node(2, mem, 20, 0), node(3, mem, 20, 0)};
    CHECK_OK(nl_plan_choose_stage_replicas(&p, &t, tried, &n_tried, &c, three, 3, &o, 4, 0.0, &err),
             &err);
    if (p) {
        check_staged(p, &c, &o, three, 3);
        CHECK(p->n_stages == 2 && p->n_standby == 0, "2 stages, every node: %d, %d standby",
              p->n_stages, p->n_standby);
        for (int s = 0; s < p->n_stages; s++) {
            const nl_plan_stage *g = &p->stages[s];
            CHECK(g->node_id == 1 ? g->n_replicas == 1 : g->n_replicas == 2,
                  "stage %d on node %d: %d replicas (the slow nodes pair up)", s, g->node_id,
                  g->n_replicas);
        }
        CHECK(t == nl_plan_step_seconds(p, &c, &o, 4, 0.0), "its step: %g", t);
        for (int k = 0; k < n_tried; k++)
            CHECK(tried[k].stages == 0 || t < tried[k].step_s,
                  "faster than %d on every stage: %g s against %g", tried[k].replicas, t,
                  tried[k].step_s);
    }
    nl_plan_destroy(&p);
    /* 3 microbatches do not divide between 2 replicas: no growth */
    CHECK_OK(nl_plan_choose_stage_replicas(&p, &t, NULL, NULL, &c, three, 3, &o, 3, 0.0, &err),
             &err);
    CHECK(p && p->stages[0].n_replicas == 1 && p->stages[p->n_stages - 1].n_replicas == 1,
          "3 microbatches: one replica a stage");
    nl_plan_destroy(&p);
    /* a slow link makes the pair's all-reduce cost more than it gains */
    CHECK_OK(nl_plan_choose_stage_replicas(&p, &t, NULL, NULL, &c, three, 3, &o, 4, 1.0, &err),
             &err);
    CHECK(p && p->n_standby == 1, "a 1 B/s link: the spare node stays standby");
    nl_plan_destroy(&p);

    /* equal nodes: the uniform choice, whatever the link */
    nl_config c4 = small_cfg(4);
    nl_plan_opts o4 = train_opts(64, 32);
    nl_plan_node eight[8];
    for (int i = 0; i < 8; i++)
        eight[i] = node(1 + i, 1 * GIB, 20, 1e-4);
    const double links[3] = {0.0, 1e9, 1e3};
    for (int k = 0; k < 3; k++) {
        CHECK_OK(nl_plan_choose_stage_replicas(&p, &t, NULL, NULL, &c4, eight, 8, &o4, 32, links[k],
                                               &err),
                 &err);
        CHECK_OK(nl_plan_choose_replicas(&u, &R, &tu, NULL, NULL, &c4, eight, 8, &o4, 32, links[k],
                                         &err),
                 &err);
        CHECK(p && u && t == tu && p->n_stages == u->n_stages, "link %g: %g s as uniform %g s",
              links[k], t, tu);
        for (int s = 0; p && u && s < p->n_stages; s++)
            CHECK(p->stages[s].n_replicas == R && p->stages[s].l0 == u->stages[s].l0,
                  "link %g stage %d: %d replicas (uniform %d)", links[k], s,
                  p->stages[s].n_replicas, R);
        nl_plan_destroy(&p);
        nl_plan_destroy(&u);
    }
    printf("chosen counts per stage: ok\n");
}

/* The stage of p with n replicas, or -1. */
static int stage_with(const nl_plan *p, int n)
{
    for (int s = 0; s < p->n_stages; s++)
        if (p->stages[s].n_replicas == n)
            return s;
    return -1;
}

/* Issue 30: a node beside a uniform plan becomes a replica of the stage
 * where the step is fastest, the layers split again, when that makes a
 * step faster. Five equal nodes, 10 layers, 6 microbatches a step, a 10 GB/s
 * link: the best uniform plan is 2 stages x 2 replicas with the fifth
 * node standby (3 replicas of 1 stage or 5 stages are slower); the grown
 * plan 2 + 3 with more layers on the 3 replicas beats it. */
static void test_grow_uniform(void)
{
    nl_config c = small_cfg(10);
    nl_plan_opts o = train_opts(64, 6);
    nl_error err = {0};
    nl_plan *p = NULL, *u = NULL;
    nl_plan_replica_option tried[NL_PLAN_MAX_REPLICAS];
    int n_tried = 0, R = 0;
    double t = 0.0, tu = 0.0;
    nl_plan_node five[5];
    for (int i = 0; i < 5; i++)
        five[i] = node(1 + i, 1 * GIB, 20, 0);
    CHECK_OK(nl_plan_choose_replicas(&u, &R, &tu, NULL, NULL, &c, five, 5, &o, 6, 1e10, &err),
             &err);
    CHECK(u && R == 2 && u->n_stages == 2 && u->n_standby == 1, "uniform: %d x %d, %d standby",
          u ? u->n_stages : 0, R, u ? u->n_standby : 0);
    const int half = u ? u->stages[0].l1 : 0;
    CHECK_OK(nl_plan_choose_stage_replicas(&p, &t, tried, &n_tried, &c, five, 5, &o, 6, 1e10, &err),
             &err);
    if (p) {
        check_staged(p, &c, &o, five, 5);
        const int s3 = stage_with(p, 3), s2 = stage_with(p, 2);
        CHECK(p->n_stages == 2 && p->n_standby == 0 && s3 >= 0 && s2 >= 0,
              "5 nodes: 2 + 3 or 3 + 2, every node (%d stages, %d standby)", p->n_stages,
              p->n_standby);
        CHECK(s3 >= 0 && s2 >= 0 &&
                  p->stages[s3].l1 - p->stages[s3].l0 > p->stages[s2].l1 - p->stages[s2].l0 &&
                  p->stages[0].l1 != half,
              "the layers split again: [0,%d) [%d,%d) (uniform at %d)", p->stages[0].l1,
              p->stages[1].l0, p->stages[1].l1, half);
        CHECK(t == nl_plan_step_seconds(p, &c, &o, 6, 1e10) && t < tu * (1 - 1e-9),
              "grown %g s a step against 2 x 2's %g", t, tu);
        CHECK(n_tried == 3 && tried[1].replicas == 2 && tried[1].step_s == tu, "%d R tried",
              n_tried);
    }
    nl_plan_destroy(&p);
    nl_plan_destroy(&u);

    /* 4 microbatches: 3 replicas do not divide them (and 4 on one stage
     * would need a sixth node), so the plan stays the uniform one */
    CHECK_OK(nl_plan_choose_replicas(&u, &R, &tu, NULL, NULL, &c, five, 5, &o, 4, 1e10, &err),
             &err);
    CHECK_OK(nl_plan_choose_stage_replicas(&p, &t, NULL, NULL, &c, five, 5, &o, 4, 1e10, &err),
             &err);
    CHECK(p && u && t == tu && p->n_stages == u->n_stages && p->n_standby == 1 &&
              stage_with(p, 3) < 0,
          "4 microbatches: %d stages, %d standby, %g s as uniform %g s", p ? p->n_stages : 0,
          p ? p->n_standby : 0, t, tu);
    for (int s = 0; p && u && s < p->n_stages; s++)
        CHECK(p->stages[s].n_replicas == R && p->stages[s].l0 == u->stages[s].l0,
              "4 microbatches: stage %d as uniform", s);
    nl_plan_destroy(&p);
    nl_plan_destroy(&u);

    /* the same five with a fifth node at 15 GFLOP/s: 3 replicas run at 3 x
     * 15, hardly faster than 2 x 20, and the step would not be: it waits */
    nl_plan_node slow[5];
    memcpy(slow, five, sizeof slow);
    slow[4].gflops = 15;
    CHECK_OK(nl_plan_choose_replicas(&u, &R, &tu, NULL, NULL, &c, slow, 5, &o, 6, 1e10, &err),
             &err);
    CHECK_OK(nl_plan_choose_stage_replicas(&p, &t, NULL, NULL, &c, slow, 5, &o, 6, 1e10, &err),
             &err);
    CHECK(p && u && t == tu && p->n_standby == 1 && p->standby[0] == 5 && stage_with(p, 3) < 0,
          "a slow fifth node waits: %d standby, %g s as uniform %g s", p ? p->n_standby : 0, t, tu);
    nl_plan_destroy(&p);
    nl_plan_destroy(&u);

    /* a fifth node with room for 5 layers of the last stage: the 3
     * replicas hold 5 (not 6), still faster; with room for 4 it cannot
     * join the 5-layer stage without slowing the other: it waits */
    nl_plan_node small[5];
    memcpy(small, five, sizeof small);
    for (int k = 5; k >= 4; k--) {
        small[4].memory_bytes = nl_plan_stage_bytes(&c, &o, k, 1, 2);
        CHECK_OK(nl_plan_choose_stage_replicas(&p, &t, NULL, NULL, &c, small, 5, &o, 6, 1e10, &err),
                 &err);
        if (!p)
            continue;
        check_staged(p, &c, &o, small, 5);
        const int s3 = stage_with(p, 3);
        CHECK(k == 5 ? s3 >= 0 && p->stages[s3].l1 - p->stages[s3].l0 == 5 && p->n_standby == 0
                     : s3 < 0 && p->n_standby == 1 && p->standby[0] == 5,
              "room for %d layers: %d standby", k, p->n_standby);
        nl_plan_destroy(&p);
    }
    /* which stage takes the fifth node is judged by the step each choice
     * makes after the layers split again, not by which stage is the
     * bottleneck now: on 8 and 10 layers the plan is at least as fast as
     * the better of 2 + 3 and 3 + 2 (nl_plan_layers_staged) */
    for (int L = 8; L <= 10; L += 2) {
        nl_config cl = small_cfg(L);
        double want = 0.0;
        for (int first = 2; first <= 3; first++) {
            const int reps[2] = {first, 5 - first};
            nl_plan *q = NULL;
            CHECK_OK(nl_plan_layers_staged(&q, &cl, five, 5, &o, reps, 2, &err), &err);
            const double tq = q ? nl_plan_step_seconds(q, &cl, &o, 6, 1e10) : 0.0;
            want = first == 2 || tq < want ? tq : want;
            nl_plan_destroy(&q);
        }
        CHECK_OK(nl_plan_choose_stage_replicas(&p, &t, NULL, NULL, &cl, five, 5, &o, 6, 1e10, &err),
                 &err);
        CHECK(p && p->n_standby == 0 && want > 0 && t <= want * (1 + 1e-9),
              "%d layers: %g s a step, the better of 2 + 3 and 3 + 2 %g", L, t, want);
        nl_plan_destroy(&p);
    }
    printf("uniform plans grown: ok\n");
}

int main(void)
{
    test_replicated();
    test_measured_link();
    test_step_seconds();
    test_staged();
    test_choose_stages();
    test_grow_uniform();
    return check_done("test_planner_replicas");
}
