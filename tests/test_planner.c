/* Tests of the layer planner and the sizer: every plan is checked against
 * the memory model and the cost model recomputed here, small random cases
 * against a brute force over every ordered subset of nodes and every
 * split, and the failure messages for their shortfall. test_sizing.c
 * holds the sizer, test_planner_replicas.c the replicated plans. */
#include <inttypes.h>
#include <stdint.h>

#include "core/model/memory.h"
#include "core/model/model.h"
#include "core/plan/planner.h"
#include "tests/check.h"
#include "tests/planner_harness.h"

/* Memory model of a stage with the given in-flight count. */
static uint64_t plain_bytes(const nl_config *c, const nl_plan_opts *o, int n, int embed, int head,
                            int in_flight)
{
    nl_mem_opts m = o->mem;
    m.in_flight = in_flight;
    return nl_memory_estimate(c, n, embed, head, &m).total;
}

/* Every rule a plan must keep, recomputed from the public cost and memory
 * model; returns the bottleneck recomputed (or -1 when broken). */
static double check_plan(const nl_plan *p, const nl_config *c, const nl_plan_node *nodes, int n,
                         const nl_plan_opts *o)
{
    int ok = 1, covered = 0;
    double worst = 0;
    char used[64] = {0};
    const int S = p->n_stages;
    CHECK(S >= 1 && S <= n && S <= c->num_layers, "stages %d", S);
    for (int s = 0; s < S; s++) {
        const nl_plan_stage *g = &p->stages[s];
        const nl_plan_node *nd = find_node(nodes, n, g->node_id);
        if (!nd) {
            CHECK(0, "stage %d: unknown node %d", s, g->node_id);
            return -1;
        }
        const int idx = (int)(nd - nodes), nl = g->l1 - g->l0;
        ok &= !used[idx];
        used[idx] = 1;
        ok &= g->l0 == covered && nl >= 1;
        ok &= g->has_embed == (s == 0) && g->has_head == (s == S - 1);
        nl_mem_opts m = o->mem;
        /* 1F1B's S - s, and the extra on every stage but the last */
        int kept = s == S - 1 ? 1 : S - s + o->mem.in_flight_extra;
        if (o->mem.in_flight > 0 && o->mem.in_flight < kept)
            kept = o->mem.in_flight;
        m.in_flight = o->mem.training ? kept : m.in_flight;
        const uint64_t bytes = nl_memory_estimate(c, nl, s == 0, s == S - 1, &m).total;
        ok &= g->bytes == bytes && bytes <= nd->memory_bytes;
        ok &= !o->mem.training || g->in_flight == kept;
        const double sec = nl_plan_stage_seconds(c, o, nd, nl, s, S);
        ok &= g->seconds == sec;
        if (sec > worst)
            worst = sec;
        covered = g->l1;
    }
    ok &= covered == c->num_layers;
    ok &= p->bottleneck == worst;
    ok &= p->n_standby == n - S;
    for (int i = 0; i < p->n_standby; i++) {
        const nl_plan_node *nd = find_node(nodes, n, p->standby[i]);
        ok &= nd && !used[nd - nodes];
    }
    CHECK(ok, "plan breaks a rule (%d stages, %d standby)", S, p->n_standby);
    return ok ? worst : -1;
}

/* ------------------------------------------------------------ cost model */

static void test_cost_model(void)
{
    nl_config c = small_cfg(6);
    const int B = 3, T = 32;
    const double whole = nl_config_forward_flops(&c, B, T, 0);
    const double split =
        c.num_layers * nl_plan_layer_flops(&c, B * T, T) + nl_plan_head_flops(&c, B * T);
    CHECK(fabs(whole - split) <= 1e-12 * whole, "layers + head %g vs forward %g", split, whole);

    nl_plan_opts o = train_opts(B * T, 0);
    nl_plan_node nd = node(1, GIB, 50, 0.25);
    /* middle stage of 3 with 2 layers: 3x forward, two hops (training) */
    double want = 3 * 2 * nl_plan_layer_flops(&c, B * T, T) / 50e9 + 2 * 0.25;
    double got = nl_plan_stage_seconds(&c, &o, &nd, 2, 1, 3);
    CHECK(fabs(got - want) <= 1e-12 * want, "middle stage %g vs %g", got, want);
    /* first stage: embedding, one hop forward and none back */
    want =
        3 * (2 * nl_plan_layer_flops(&c, B * T, T) + nl_plan_embed_flops(&c, B * T)) / 50e9 + 0.25;
    got = nl_plan_stage_seconds(&c, &o, &nd, 2, 0, 3);
    CHECK(fabs(got - want) <= 1e-12 * want, "first stage %g vs %g", got, want);
    /* recompute adds one forward of the layers only */
    o.mem.recompute = 1;
    want = (4 * 2 * nl_plan_layer_flops(&c, B * T, T) + 3 * nl_plan_head_flops(&c, B * T)) / 50e9 +
           0.25;
    got = nl_plan_stage_seconds(&c, &o, &nd, 2, 2, 3);
    CHECK(fabs(got - want) <= 1e-12 * want, "last stage recompute %g vs %g", got, want);
    /* inference: one forward, hop forward only, none for a single stage */
    o.mem.training = 0;
    want = (2 * nl_plan_layer_flops(&c, B * T, T)) / 50e9 + 0.25;
    got = nl_plan_stage_seconds(&c, &o, &nd, 2, 1, 3);
    CHECK(fabs(got - want) <= 1e-12 * want, "inference middle %g vs %g", got, want);
    want = (6 * nl_plan_layer_flops(&c, B * T, T) + nl_plan_embed_flops(&c, B * T) +
            nl_plan_head_flops(&c, B * T)) /
           50e9;
    got = nl_plan_stage_seconds(&c, &o, &nd, 6, 0, 1);
    CHECK(fabs(got - want) <= 1e-12 * want, "inference single %g vs %g", got, want);

    /* in flight: S - s under 1F1B, capped by the microbatches of a step */
    nl_plan_opts t = train_opts(64, 0);
    CHECK(nl_plan_stage_in_flight(&t, 0, 4) == 4 && nl_plan_stage_in_flight(&t, 3, 4) == 1,
          "1F1B in flight");
    t.mem.in_flight = 2;
    CHECK(nl_plan_stage_in_flight(&t, 0, 4) == 2 && nl_plan_stage_in_flight(&t, 3, 4) == 1,
          "capped in flight");
    nl_mem_opts m = t.mem;
    m.in_flight = 2;
    CHECK(nl_plan_stage_bytes(&c, &t, 3, 0, 4) == nl_memory_estimate(&c, 3, 1, 0, &m).total,
          "stage bytes = memory model");
    /* --in-flight-extra 2: two more on every stage but the last, still capped */
    t.mem.in_flight = 0;
    t.mem.in_flight_extra = 2;
    CHECK(nl_plan_stage_in_flight(&t, 0, 4) == 6 && nl_plan_stage_in_flight(&t, 2, 4) == 4 &&
              nl_plan_stage_in_flight(&t, 3, 4) == 1 && nl_plan_stage_in_flight(&t, 0, 1) == 1,
          "extra in flight");
    t.mem.in_flight = 5;
    CHECK(nl_plan_stage_in_flight(&t, 0, 4) == 5 && nl_plan_stage_in_flight(&t, 1, 4) == 5,
          "extra in flight, capped");
    m.in_flight = 5;
    const uint64_t more = nl_plan_stage_bytes(&c, &t, 3, 0, 4);
    t.mem.in_flight_extra = 0;
    CHECK(more == nl_memory_estimate(&c, 3, 1, 0, &m).total &&
              more > nl_plan_stage_bytes(&c, &t, 3, 0, 4),
          "extra in flight: the stage keeps 5 microbatches' activations, not 4");
}

/* ------------------------------------------------------- simple placements */

static void test_single_node(void)
{
    nl_config c = small_cfg(8);
    nl_plan_opts o = train_opts(64, 0);
    nl_plan_node nd = node(7, 4 * GIB, 20, 0.5);
    nl_plan *p = NULL;
    nl_error err = {0};
    CHECK_OK(nl_plan_layers(&p, &c, &nd, 1, &o, &err), &err);
    if (!p)
        return;
    check_plan(p, &c, &nd, 1, &o);
    CHECK(p->n_stages == 1 && p->stages[0].l0 == 0 && p->stages[0].l1 == 8, "one stage [0, 8)");
    CHECK(p->stages[0].has_embed && p->stages[0].has_head, "holds both tables");
    CHECK(p->n_standby == 0 && p->exact, "no standby, exact");
    /* no hop: nothing is sent onward */
    const double want = 3 *
                        (8 * nl_plan_layer_flops(&c, 64, 32) + nl_plan_embed_flops(&c, 64) +
                         nl_plan_head_flops(&c, 64)) /
                        20e9;
    CHECK(fabs(p->bottleneck - want) <= 1e-12 * want, "bottleneck %g vs %g", p->bottleneck, want);
    nl_plan_destroy(&p);
    nl_plan_destroy(&p); /* safe twice */
    CHECK(p == NULL, "destroy NULLs");
}

static void test_heterogeneous(void)
{
    nl_config c = small_cfg(16);
    nl_plan_opts o = train_opts(64, 0);
    nl_error err = {0};
    nl_plan *p = NULL;
    /* ample memory, no hops: a node 3x faster takes about 3x the layers */
    nl_plan_node two[2] = {node(1, 4 * GIB, 10, 0), node(2, 4 * GIB, 30, 0)};
    CHECK_OK(nl_plan_layers(&p, &c, two, 2, &o, &err), &err);
    if (p) {
        check_plan(p, &c, two, 2, &o);
        CHECK(p->n_stages == 2, "both used: %d", p->n_stages);
        int fast = 0;
        for (int s = 0; s < p->n_stages; s++)
            if (p->stages[s].node_id == 2)
                fast = p->stages[s].l1 - p->stages[s].l0;
        CHECK(fast >= 11 && fast <= 13, "fast node holds %d of 16 layers", fast);
        /* no split does better: 1 stage on the fast node, or any k / 16 - k */
        double best = nl_plan_stage_seconds(&c, &o, &two[1], 16, 0, 1);
        for (int a = 0; a < 2; a++)
            for (int k = 1; k < 16; k++) {
                double t0 = nl_plan_stage_seconds(&c, &o, &two[a], k, 0, 2);
                double t1 = nl_plan_stage_seconds(&c, &o, &two[1 - a], 16 - k, 1, 2);
                double b = t0 > t1 ? t0 : t1;
                best = b < best ? b : best;
            }
        CHECK(p->bottleneck == best, "bottleneck %g vs best split %g", p->bottleneck, best);
        nl_plan_destroy(&p);
    }
    /* the fast node's memory holds 3 layers at most: the slow ones take the rest */
    const uint64_t three = nl_plan_stage_bytes(&c, &o, 3, 1, 3);
    nl_plan_node mix[3] = {node(10, 4 * GIB, 5, 0.001), node(11, three, 100, 0.001),
                           node(12, 4 * GIB, 8, 0.001)};
    CHECK_OK(nl_plan_layers(&p, &c, mix, 3, &o, &err), &err);
    if (p) {
        check_plan(p, &c, mix, 3, &o);
        for (int s = 0; s < p->n_stages; s++)
            if (p->stages[s].node_id == 11)
                CHECK(p->stages[s].l1 - p->stages[s].l0 <= 3, "fast node over its memory");
        CHECK(p->n_stages == 3, "all three used: %d", p->n_stages);
        nl_plan_destroy(&p);
    }
    /* same input, same plan */
    nl_plan *q = NULL;
    CHECK_OK(nl_plan_layers(&p, &c, mix, 3, &o, &err), &err);
    CHECK_OK(nl_plan_layers(&q, &c, mix, 3, &o, &err), &err);
    if (p && q) {
        int same = p->n_stages == q->n_stages;
        for (int s = 0; same && s < p->n_stages; s++)
            same =
                p->stages[s].node_id == q->stages[s].node_id && p->stages[s].l1 == q->stages[s].l1;
        CHECK(same, "deterministic");
    }
    nl_plan_destroy(&p);
    nl_plan_destroy(&q);
}

/* A GPU node (device memory, a GEMM probe of thousands of GFLOP/s) and two
 * CPU nodes: the GPU gets most of the layers, for inference and training. */
static void test_gpu_and_cpus(void)
{
    nl_config c = small_cfg(24);
    nl_error err = {0};
    const nl_plan_node nodes[3] = {node(1, 4 * GIB, 150, 0.002), node(2, 60 * GIB, 20000, 0.002),
                                   node(3, 4 * GIB, 120, 0.002)};
    nl_plan_opts inf;
    memset(&inf, 0, sizeof inf);
    inf.mem.micro_rows = 64;
    inf.seq_len = 32;
    const nl_plan_opts train = train_opts(64, 0);
    const nl_plan_opts *opts[2] = {&inf, &train};
    for (int i = 0; i < 2; i++) {
        nl_plan *p = NULL;
        CHECK_OK(nl_plan_layers(&p, &c, nodes, 3, opts[i], &err), &err);
        if (!p)
            continue;
        check_plan(p, &c, nodes, 3, opts[i]);
        int gpu = 0;
        for (int s = 0; s < p->n_stages; s++)
            if (p->stages[s].node_id == 2)
                gpu = p->stages[s].l1 - p->stages[s].l0;
        CHECK(gpu * 4 >= c.num_layers * 3, "%s: the GPU node holds %d of %d layers",
              i ? "training" : "inference", gpu, c.num_layers);
        nl_plan_destroy(&p);
    }
}

static void test_standbys(void)
{
    nl_config c = small_cfg(2);
    nl_plan_opts o = train_opts(64, 0);
    nl_error err = {0};
    nl_plan *p = NULL;
    /* more nodes than layers: at most 2 stages, 3 or more standbys */
    nl_plan_node five[5] = {node(1, GIB, 10, 0), node(2, GIB, 11, 0), node(3, GIB, 12, 0),
                            node(4, GIB, 13, 0), node(5, GIB, 14, 0)};
    CHECK_OK(nl_plan_layers(&p, &c, five, 5, &o, &err), &err);
    if (p) {
        check_plan(p, &c, five, 5, &o);
        CHECK(p->n_stages <= 2 && p->n_standby >= 3, "%d stages, %d standby", p->n_stages,
              p->n_standby);
        nl_plan_destroy(&p);
    }
    /* a hop costlier than the work it would save: one stage, fast spares idle */
    c = small_cfg(8);
    nl_plan_node hop[3] = {node(1, 4 * GIB, 50, 10.0), node(2, 4 * GIB, 60, 10.0),
                           node(3, 4 * GIB, 40, 10.0)};
    CHECK_OK(nl_plan_layers(&p, &c, hop, 3, &o, &err), &err);
    if (p) {
        check_plan(p, &c, hop, 3, &o);
        CHECK(p->n_stages == 1 && p->stages[0].node_id == 2, "one stage on the fastest node");
        CHECK(p->n_standby == 2 && p->standby[0] == 1 && p->standby[1] == 3, "standby 1, 3");
        nl_plan_destroy(&p);
    }
    /* a node far slower than the rest never helps */
    nl_plan_node slow[2] = {node(1, 4 * GIB, 1e-3, 0), node(2, 4 * GIB, 100, 0)};
    CHECK_OK(nl_plan_layers(&p, &c, slow, 2, &o, &err), &err);
    if (p) {
        check_plan(p, &c, slow, 2, &o);
        CHECK(p->n_stages == 1 && p->stages[0].node_id == 2 && p->standby[0] == 1,
              "slow node standby");
        nl_plan_destroy(&p);
    }
}

/* ----------------------------------------------------------- infeasible */

static int has_number(const char *msg, uint64_t v)
{
    char num[32];
    snprintf(num, sizeof num, "%" PRIu64, v);
    return strstr(msg, num) != NULL;
}

static void test_infeasible(void)
{
    nl_config c = small_cfg(8);
    nl_plan_opts o = train_opts(64, 0);
    nl_error err = {0};
    nl_plan *p = NULL;
    /* too little in total: the shortfall is what one stage needs less the total */
    const uint64_t whole = nl_plan_stage_bytes(&c, &o, 8, 0, 1);
    nl_plan_node few[2] = {node(1, whole / 3, 10, 0), node(2, whole / 3, 10, 0)};
    nl_status st = nl_plan_layers(&p, &c, few, 2, &o, &err);
    CHECK(st == NL_ERR_CAPACITY && !p, "too small: %s", nl_status_str(st));
    CHECK(strstr(err.msg, "needs") && has_number(err.msg, whole - 2 * (whole / 3)),
          "shortfall in the message: %s", err.msg);

    /* enough in total, but one layer fits no node */
    const uint64_t one = plain_bytes(&c, &o, 1, 0, 0, 1);
    nl_plan_node crumbs[40];
    for (int i = 0; i < 40; i++)
        crumbs[i] = node(100 + i, one - 1000, 10, 0);
    nl_error_clear(&err);
    st = nl_plan_layers(&p, &c, crumbs, 40, &o, &err);
    CHECK(st == NL_ERR_CAPACITY, "crumbs: %s", nl_status_str(st));
    CHECK(strstr(err.msg, "single layer") && has_number(err.msg, 1000), "layer message: %s",
          err.msg);

    /* the first stage fits, but no node holds the head with a layer */
    nl_config big = small_cfg(2);
    big.vocab_size = big.vocab_chunk = 65536;
    const uint64_t first = nl_plan_stage_bytes(&big, &o, 1, 0, 2);
    const uint64_t head1 = plain_bytes(&big, &o, 1, 0, 1, 1);
    CHECK(head1 > first, "head stage heavier than the first");
    nl_plan_node nohead[8];
    for (int i = 0; i < 8; i++)
        nohead[i] = node(i, first, 10, 0);
    nl_error_clear(&err);
    st = nl_plan_layers(&p, &big, nohead, 8, &o, &err);
    CHECK(st == NL_ERR_CAPACITY && strstr(err.msg, "last stage") &&
              has_number(err.msg, head1 - first),
          "head message: %s", err.msg);

    /* fragmentation: each node holds one layer (a middle stage), not two */
    nl_plan_node frag[3];
    const uint64_t f1 = nl_plan_stage_bytes(&c, &o, 1, 0, 1);
    for (int i = 0; i < 3; i++)
        frag[i] = node(i, f1 + 1000, 10, 0);
    nl_error_clear(&err);
    st = nl_plan_layers(&p, &c, frag, 3, &o, &err);
    CHECK(st == NL_ERR_CAPACITY && strstr(err.msg, "of 8 layers fit") && strstr(err.msg, "needs"),
          "fragmented: %s", err.msg);
    int fits = 1;
    CHECK_OK(nl_plan_fits(&c, frag, 3, &o, &fits, &err), &err);
    CHECK(!fits, "fits says no");

    /* bad input */
    nl_plan_node bad[2] = {node(1, GIB, 10, 0), node(1, GIB, 10, 0)};
    st = nl_plan_layers(&p, &c, bad, 2, &o, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "twice"), "duplicate id: %s", err.msg);
    bad[1] = node(2, GIB, 0, 0);
    st = nl_plan_layers(&p, &c, bad, 2, &o, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "node 2"), "zero gflops: %s", err.msg);
    bad[1] = node(2, GIB, 10, -1);
    st = nl_plan_layers(&p, &c, bad, 2, &o, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "hop"), "negative hop: %s", err.msg);
    st = nl_plan_layers(&p, &c, bad, 0, &o, &err);
    CHECK(st == NL_ERR_CAPACITY && strstr(err.msg, "no nodes"), "no nodes: %s", err.msg);
    nl_config unsized = small_cfg(0);
    st = nl_plan_layers(&p, &unsized, few, 2, &o, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "num_layers"), "unsized: %s", err.msg);
}

/* ---------------------------------------------------------- brute force */

typedef struct brute {
    const nl_config *c;
    const nl_plan_node *nodes;
    int n;
    const nl_plan_opts *o;
    int seq[8], cnt[8];
    char used[8];
    double best;
    int best_S; /* fewest stages among plans at exactly the best */
} brute;

static void brute_split(brute *b, int S, int s, int left)
{
    if (s == S - 1) {
        b->cnt[s] = left;
        double worst = 0;
        for (int i = 0; i < S; i++) {
            const nl_plan_node *nd = &b->nodes[b->seq[i]];
            if (nl_plan_stage_bytes(b->c, b->o, b->cnt[i], i, S) > nd->memory_bytes)
                return;
            double t = nl_plan_stage_seconds(b->c, b->o, nd, b->cnt[i], i, S);
            worst = t > worst ? t : worst;
        }
        if (worst < b->best || (worst == b->best && S < b->best_S)) {
            b->best = worst;
            b->best_S = S;
        }
        return;
    }
    for (int k = 1; k <= left - (S - 1 - s); k++) {
        b->cnt[s] = k;
        brute_split(b, S, s + 1, left - k);
    }
}

static void brute_order(brute *b, int S, int s)
{
    if (s == S) {
        brute_split(b, S, 0, b->c->num_layers);
        return;
    }
    for (int j = 0; j < b->n; j++) {
        if (b->used[j])
            continue;
        b->used[j] = 1;
        b->seq[s] = j;
        brute_order(b, S, s + 1);
        b->used[j] = 0;
    }
}

static double brute_force(const nl_config *c, const nl_plan_node *nodes, int n,
                          const nl_plan_opts *o, int *best_S)
{
    brute b = {.c = c, .nodes = nodes, .n = n, .o = o, .best = INFINITY, .best_S = 0};
    for (int S = 1; S <= n && S <= c->num_layers; S++)
        brute_order(&b, S, 0);
    *best_S = b.best_S;
    return b.best;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static double urand(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static void test_brute_force(void)
{
    int cases = 0, infeasible = 0, heur_equal = 0, heur_cases = 0;
    double heur_worst = 1;
    for (int t = 0; t < 300; t++) {
        const int L = 1 + (int)(urand() * 8), n = 1 + (int)(urand() * 5);
        nl_config c = small_cfg(L);
        nl_plan_opts o = train_opts(32 + 32 * (int)(urand() * 3), (int)(urand() * 3));
        o.mem.training = urand() < 0.75;
        o.mem.recompute = urand() < 0.3;
        o.mem.in_flight_extra = urand() < 0.3 ? 1 + (int)(urand() * 3) : 0;
        o.mem.kv_sessions = o.mem.training ? 0 : 2;
        o.mem.kv_len = 64;
        const uint64_t lay =
            nl_plan_stage_bytes(&c, &o, 2, 1, 3) - nl_plan_stage_bytes(&c, &o, 1, 1, 3);
        const uint64_t base = nl_plan_stage_bytes(&c, &o, 0, 0, 1);
        nl_plan_node nodes[5];
        for (int i = 0; i < n; i++)
            nodes[i] = node(10 * i + 3, base + (uint64_t)(urand() * (L + 1) * 1.3 * (double)lay),
                            1 + urand() * 99, urand() < 0.4 ? 0 : urand() * 2e-4);
        int best_S, fits = -1;
        const double want = brute_force(&c, nodes, n, &o, &best_S);
        nl_error ferr = {0};
        CHECK_OK(nl_plan_fits(&c, nodes, n, &o, &fits, &ferr), &ferr);
        CHECK(fits == (want < INFINITY), "case %d: fits %d, brute force %g", t, fits, want);
        nl_plan *p = NULL;
        nl_error err = {0};
        nl_status st = nl_plan_layers(&p, &c, nodes, n, &o, &err);
        cases++;
        if (want == INFINITY) {
            infeasible++;
            CHECK(st == NL_ERR_CAPACITY && strstr(err.msg, "needs"),
                  "case %d: brute force finds none, planner: %s %s", t, nl_status_str(st), err.msg);
            nl_plan_destroy(&p);
            continue;
        }
        CHECK(st == NL_OK && p, "case %d: brute force %g, planner %s %s", t, want,
              nl_status_str(st), err.msg);
        if (!p)
            continue;
        const double got = check_plan(p, &c, nodes, n, &o);
        CHECK(p->exact && fabs(got - want) <= 1e-9 * want, "case %d: planner %.17g brute %.17g", t,
              got, want);
        CHECK(p->n_stages <= best_S, "case %d: %d stages, brute force ties at %d", t, p->n_stages,
              best_S);
        nl_plan_destroy(&p);

        /* the heuristic on the same case: valid, never better than the optimum */
        if (n >= 2) {
            o.max_exact_nodes = 1;
            st = nl_plan_layers(&p, &c, nodes, n, &o, &err);
            CHECK(st == NL_OK && p && !p->exact, "case %d heuristic: %s", t, err.msg);
            if (p) {
                const double h = check_plan(p, &c, nodes, n, &o);
                CHECK(h >= want * (1 - 1e-12), "case %d: heuristic %g below optimum %g", t, h,
                      want);
                heur_cases++;
                heur_equal += h <= want * (1 + 1e-9);
                heur_worst = h / want > heur_worst ? h / want : heur_worst;
            }
            nl_plan_destroy(&p);
        }
    }
    printf(
        "brute force: %d cases (%d infeasible); heuristic optimal in %d of %d, worst ratio %.3f\n",
        cases, infeasible, heur_equal, heur_cases, heur_worst);
    CHECK(infeasible > 10 && infeasible < cases - 100, "mix of cases: %d infeasible", infeasible);
}

/* Many nodes: the heuristic against the exact search on 14 nodes. */
static void test_many_nodes(void)
{
    nl_config c = small_cfg(32);
    nl_plan_opts o = train_opts(64, 4);
    const uint64_t lay =
        nl_plan_stage_bytes(&c, &o, 2, 1, 3) - nl_plan_stage_bytes(&c, &o, 1, 1, 3);
    const uint64_t base = nl_plan_stage_bytes(&c, &o, 0, 0, 1);
    nl_plan_node nodes[40];
    for (int i = 0; i < 40; i++)
        nodes[i] =
            node(i, base + (uint64_t)(urand() * 8 * (double)lay), 5 + urand() * 50, urand() * 1e-4);
    nl_error err = {0};
    nl_plan *ex = NULL, *he = NULL;
    CHECK_OK(nl_plan_layers(&ex, &c, nodes, 14, &o, &err), &err); /* exact up to 16 */
    o.max_exact_nodes = 1;
    CHECK_OK(nl_plan_layers(&he, &c, nodes, 14, &o, &err), &err);
    o.max_exact_nodes = 0;
    if (ex && he) {
        const double a = check_plan(ex, &c, nodes, 14, &o), b = check_plan(he, &c, nodes, 14, &o);
        CHECK(ex->exact && !he->exact && b >= a * (1 - 1e-12), "heuristic %g vs exact %g", b, a);
        printf("14 nodes, 32 layers: exact %.4g s in %d stages, heuristic %.4g s (x%.3f)\n", a,
               ex->n_stages, b, b / a);
    }
    nl_plan_destroy(&ex);
    nl_plan_destroy(&he);
    CHECK_OK(nl_plan_layers(&he, &c, nodes, 40, &o, &err), &err);
    if (he) {
        check_plan(he, &c, nodes, 40, &o);
        CHECK(he->n_stages + he->n_standby == 40, "40 nodes accounted for");
    }
    nl_plan_destroy(&he);
}

int main(void)
{
    test_cost_model();
    test_single_node();
    test_heterogeneous();
    test_gpu_and_cpus();
    test_standbys();
    test_infeasible();
    test_brute_force();
    test_many_nodes();
    return check_done("test_planner");
}
