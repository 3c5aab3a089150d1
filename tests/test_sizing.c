/* Tests of the sizer (core/plan/sizing.h): the seed rule, the sizing rule
 * against the seed rule and the planner's own fit test, and the
 * hysteresis of a live model's growth. test_planner.c holds the layer
 * planner. */
#include <inttypes.h>
#include <stdint.h>

#include "core/model/memory.h"
#include "core/model/model.h"
#include "core/plan/planner.h"
#include "core/plan/sizing.h"
#include "tests/check.h"
#include "tests/planner_harness.h"

/* -------------------------------------------------------------- sizing */

static void test_seed_rule(void)
{
    nl_config base, s;
    nl_config_init(&base);
    nl_sizing_seed(&s, &base, 10 * GIB);
    CHECK(s.hidden_dim == 256 && s.num_layers == 8 && s.num_heads == 2 && s.num_kv_heads == 1 &&
              s.ffn_dim == 1024 && s.vocab_size == NL_DEFAULT_VOCAB,
          "10 GiB: d=%d L=%d H=%d G=%d", s.hidden_dim, s.num_layers, s.num_heads, s.num_kv_heads);
    /* 100 GiB: 256 sqrt(10) = 809.5 -> 832; 8 log2(11) = 27.7 -> 28; 832 / 128 = 6
     * does not divide 832: 4 and 8 are as near, ties go to more heads */
    nl_sizing_seed(&s, &base, 100 * GIB);
    CHECK(s.hidden_dim == 832 && s.num_layers == 28 && s.num_heads == 8 && s.num_kv_heads == 2,
          "100 GiB: d=%d L=%d H=%d G=%d", s.hidden_dim, s.num_layers, s.num_heads, s.num_kv_heads);
    /* 1000 GiB: 2560, 8 log2(101) = 53.3 -> 53, 20 heads, 5 kv */
    nl_sizing_seed(&s, &base, 1000 * GIB);
    CHECK(s.hidden_dim == 2560 && s.num_layers == 53 && s.num_heads == 20 && s.num_kv_heads == 5,
          "1000 GiB: d=%d L=%d H=%d G=%d", s.hidden_dim, s.num_layers, s.num_heads, s.num_kv_heads);
    /* tiny and huge clamp */
    nl_sizing_seed(&s, &base, 100 * MB);
    CHECK(s.hidden_dim == 64 && s.num_layers == 8 && s.num_heads == 1, "tiny: d=%d L=%d",
          s.hidden_dim, s.num_layers);
    nl_sizing_seed(&s, &base, 1000000 * GIB);
    CHECK(s.num_layers == 64, "huge: L=%d", s.num_layers);
    nl_error err = {0};
    CHECK_OK(nl_config_validate(&s, 1, &err), &err);
}

/* The documented head rule, written out again: d / 128 heads (at least
 * 1) or the nearest count dividing d with an even head_dim <= 256, ties
 * to more heads; kv heads the largest divisor of H <= max(1, H / 4). */
static void rule_heads(nl_config *c)
{
    const int d = c->hidden_dim, want = d / 128 > 0 ? d / 128 : 1;
    int best = 0;
    for (int h = 1; h <= d; h++)
        if (d % h == 0 && (d / h) % 2 == 0 && d / h <= 256 &&
            (!best || abs(h - want) <= abs(best - want)))
            best = h;
    c->num_heads = best;
    c->num_kv_heads = 1;
    for (int g = 1; g <= (best / 4 > 1 ? best / 4 : 1); g++)
        if (best % g == 0)
            c->num_kv_heads = g;
    c->ffn_dim = 4 * d;
}

/* The sized shape fits; one layer more, or 64 wider, does not. */
static void check_sized(const nl_sizing *z, const nl_plan_node *nodes, int n,
                        const nl_sizing_opts *o)
{
    nl_plan_node scaled[64];
    for (int i = 0; i < n; i++) {
        scaled[i] = nodes[i];
        scaled[i].memory_bytes = (uint64_t)((double)nodes[i].memory_bytes * (1 - o->headroom));
    }
    nl_error err = {0};
    int fits = 0;
    nl_config c = z->cfg;
    CHECK_OK(nl_config_validate(&c, 1, &err), &err);
    CHECK(c.num_heads % c.num_kv_heads == 0 && nl_config_head_dim(&c) % 2 == 0 &&
              c.ffn_dim == 4 * c.hidden_dim && c.hidden_dim % 64 == 0 && c.num_experts == 8 &&
              c.top_k == 2,
          "shape rules");
    CHECK_OK(nl_plan_fits(&c, scaled, n, &o->plan, &fits, &err), &err);
    CHECK(fits, "sized model fits");
    CHECK(z->need_bytes <= z->usable_bytes && z->stages >= 1, "need %" PRIu64 " of %" PRIu64,
          z->need_bytes, z->usable_bytes);
    if (c.num_layers < z->seed.num_layers) {
        c.num_layers++;
        CHECK_OK(nl_plan_fits(&c, scaled, n, &o->plan, &fits, &err), &err);
        CHECK(!fits, "one layer more would fit (L=%d)", c.num_layers);
    }
    /* depth first: the seed's width is kept whenever it fits at depth 8 */
    c = z->seed;
    c.num_layers = NL_SIZING_MIN_DEPTH;
    CHECK_OK(nl_plan_fits(&c, scaled, n, &o->plan, &fits, &err), &err);
    CHECK(!fits || z->cfg.hidden_dim == z->seed.hidden_dim, "width shrank though %d fits",
          c.hidden_dim);
    if (z->cfg.hidden_dim < z->seed.hidden_dim) {
        c = z->cfg;
        c.hidden_dim += 64;
        c.num_layers = NL_SIZING_MIN_DEPTH;
        rule_heads(&c);
        CHECK_OK(nl_plan_fits(&c, scaled, n, &o->plan, &fits, &err), &err);
        CHECK(!fits, "64 wider would fit (d=%d)", c.hidden_dim);
    }
    c = z->cfg;
    rule_heads(&c);
    CHECK(c.num_heads == z->cfg.num_heads && c.num_kv_heads == z->cfg.num_kv_heads,
          "head rule: H=%d G=%d", z->cfg.num_heads, z->cfg.num_kv_heads);
    CHECK(strstr(z->report, "seed rule"), "report: %s", z->report);
}

static void test_sizing(void)
{
    nl_config base;
    nl_config_init(&base);
    nl_sizing_opts o;
    nl_sizing_opts_init(&o);
    nl_error err = {0};
    nl_sizing z;

    /* ample memory for the seed's shape with experts and optimizer: agree */
    o.plan.mem.micro_rows = 256;
    nl_plan_node ample[4];
    for (int i = 0; i < 4; i++)
        ample[i] = node(i, 4 * GIB, 100, 0);
    CHECK_OK(nl_sizing_choose(&z, &base, ample, 4, &o, &err), &err);
    nl_config seed;
    nl_sizing_seed(&seed, &base, 16 * GIB);
    CHECK(z.cfg.hidden_dim == seed.hidden_dim && z.cfg.num_layers == seed.num_layers &&
              z.cfg.num_heads == seed.num_heads && z.cfg.num_kv_heads == seed.num_kv_heads,
          "ample: d=%d L=%d vs seed d=%d L=%d", z.cfg.hidden_dim, z.cfg.num_layers, seed.hidden_dim,
          seed.num_layers);
    CHECK(strstr(z.report, "kept"), "report: %s", z.report);
    check_sized(&z, ample, 4, &o);
    printf("ample: %s\n", z.report);

    /* long microbatches: activations of 1F1B's in-flight microbatches
     * push the depth down, the width stays */
    o.plan.mem.micro_rows = 8192;
    nl_plan_node tight[8];
    for (int i = 0; i < 8; i++)
        tight[i] = node(i, 8 * GIB, 100, 0);
    CHECK_OK(nl_sizing_choose(&z, &base, tight, 8, &o, &err), &err);
    check_sized(&z, tight, 8, &o);
    CHECK(z.cfg.num_layers < z.seed.num_layers && z.cfg.hidden_dim == z.seed.hidden_dim,
          "tight: depth shrank (%s)", z.report);
    printf("tight: %s\n", z.report);

    /* many small nodes: the seed's width holds no layer anywhere, width shrinks */
    o.plan.mem.micro_rows = 2048;
    nl_plan_node small[48];
    for (int i = 0; i < 48; i++)
        small[i] = node(i, 700 * MB, 50, 0);
    CHECK_OK(nl_sizing_choose(&z, &base, small, 48, &o, &err), &err);
    check_sized(&z, small, 48, &o);
    CHECK(z.cfg.hidden_dim < z.seed.hidden_dim, "small nodes: width kept (%s)", z.report);
    printf("small nodes: %s\n", z.report);

    /* nothing fits */
    nl_plan_node crumbs[2] = {node(1, 20 * MB, 10, 0), node(2, 20 * MB, 10, 0)};
    nl_status st = nl_sizing_choose(&z, &base, crumbs, 2, &o, &err);
    CHECK(st == NL_ERR_CAPACITY && strstr(err.msg, "needs"), "crumbs: %s", err.msg);
    o.headroom = 1.5;
    st = nl_sizing_choose(&z, &base, ample, 4, &o, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "headroom"), "headroom: %s", err.msg);
}

static void test_hysteresis(void)
{
    nl_config cur = small_cfg(10), p = cur;
    CHECK(!nl_sizing_should_change(&cur, &p, 0), "same config");
    p.vocab_size = 4096; /* vocabulary grows live; never an architecture change */
    CHECK(!nl_sizing_should_change(&cur, &p, 0), "vocabulary only");
    for (int L = 1; L <= 30; L++) {
        p = cur;
        p.num_layers = L;
        const double a = (double)nl_config_param_count(&cur), b = (double)nl_config_param_count(&p);
        const int want = b > 1.3 * a || a > 1.3 * b;
        CHECK(nl_sizing_should_change(&cur, &p, 0) == want, "L=%d ratio %.3f", L, b / a);
        CHECK(nl_sizing_should_change(&cur, &p, 2.0) == (b > 2 * a || a > 2 * b), "factor 2");
    }
    p = cur;
    p.num_layers = 12; /* 1.2x: stays */
    CHECK(!nl_sizing_should_change(&cur, &p, 0), "1.2x stays");
    p.num_layers = 14; /* 1.4x: changes */
    CHECK(nl_sizing_should_change(&cur, &p, 0), "1.4x changes");
    nl_config none;
    nl_config_init(&none);
    CHECK(nl_sizing_should_change(&none, &cur, 0), "no model yet");

    /* depth only, width fixed */
    nl_sizing_opts o;
    nl_sizing_opts_init(&o);
    o.plan.mem.micro_rows = 256;
    nl_error err = {0};
    nl_sizing z;
    nl_config live = small_cfg(2);
    live.vocab_chunk = 32768;
    nl_plan_node ample[2] = {node(1, 8 * GIB, 50, 0), node(2, 8 * GIB, 50, 0)};
    CHECK_OK(nl_sizing_propose_depth(&z, &live, ample, 2, &o, &err), &err);
    CHECK(z.cfg.hidden_dim == live.hidden_dim && z.cfg.num_heads == live.num_heads &&
              z.cfg.num_kv_heads == live.num_kv_heads && z.cfg.ffn_dim == live.ffn_dim &&
              z.cfg.vocab_size == live.vocab_size,
          "width and the rest kept");
    CHECK(z.cfg.num_layers == z.seed.num_layers && z.cfg.num_layers > 2, "grows to seed depth %d",
          z.cfg.num_layers);
    CHECK(nl_sizing_should_change(&live, &z.cfg, 0), "2 -> %d layers is a change",
          z.cfg.num_layers);
    /* a deeper model than the seed's is not cut while it fits */
    live.num_layers = 40;
    CHECK_OK(nl_sizing_propose_depth(&z, &live, ample, 2, &o, &err), &err);
    CHECK(z.cfg.num_layers >= 40, "kept deep: %d", z.cfg.num_layers);
    /* on too little memory, the deepest that fits, and no deeper */
    const uint64_t few = nl_plan_stage_bytes(&live, &o.plan, 10, 0, 1);
    nl_plan_node one = node(1, (uint64_t)((double)few / 0.9) + 1, 50, 0);
    CHECK_OK(nl_sizing_propose_depth(&z, &live, &one, 1, &o, &err), &err);
    CHECK(z.cfg.num_layers == 10, "one node: %d layers (%s)", z.cfg.num_layers, z.report);
    printf("depth: %s\n", z.report);
}

int main(void)
{
    test_seed_rule();
    test_sizing();
    test_hysteresis();
    return check_done("test_sizing");
}
