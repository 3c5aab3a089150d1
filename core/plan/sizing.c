/* Sizing: the seed rule, the shrink loop against the memory model and
 * the planner, and the hysteresis rule. See sizing.h. */
#include "core/plan/sizing.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/model/model.h"

#define GIB (1024.0 * 1024.0 * 1024.0)
#define DEFAULT_FACTOR 1.3

void nl_sizing_opts_init(nl_sizing_opts *o)
{
    memset(o, 0, sizeof *o);
    o->plan.mem.training = 1;
    o->plan.mem.micro_rows = 2048;
    o->headroom = 0.10;
    o->factor = DEFAULT_FACTOR;
}

/* Heads for width d: d / 128 (at least 1) if it divides d with an even
 * head_dim of at most 256, else the nearest count that does (ties to
 * more heads). d is a multiple of 64, so d / 64 heads always qualify. */
static int pick_heads(int d)
{
    const int want = d / 128 > 0 ? d / 128 : 1;
    int best = 0;
    for (int h = 1; h <= d; h++) {
        if (d % h || (d / h) % 2 || d / h > NL_CONFIG_MAX_HEAD_DIM)
            continue;
        if (!best || abs(h - want) <= abs(best - want))
            best = h;
        if (h > want && best)
            break; /* counts only move away from here */
    }
    return best;
}

/* Largest divisor of H that is at most max(1, H / 4). */
static int pick_kv(int H)
{
    for (int g = H / 4 > 1 ? H / 4 : 1; g > 1; g--)
        if (H % g == 0)
            return g;
    return 1;
}

static void set_shape(nl_config *c, int d, int L)
{
    c->hidden_dim = d;
    c->num_layers = L;
    c->num_heads = pick_heads(d);
    c->num_kv_heads = pick_kv(c->num_heads);
    c->ffn_dim = 4 * d;
}

static int seed_depth(uint64_t total_bytes)
{
    const double gb = (double)total_bytes / GIB;
    const double L = floor(8 * log2(gb / 10 + 1) + 0.5);
    return L < NL_SIZING_MIN_DEPTH   ? NL_SIZING_MIN_DEPTH
           : L > NL_SIZING_MAX_DEPTH ? NL_SIZING_MAX_DEPTH
                                     : (int)L;
}

void nl_sizing_seed(nl_config *out, const nl_config *base, uint64_t total_bytes)
{
    const double gb = (double)total_bytes / GIB;
    double w = floor(256 * sqrt(gb / 10) / 64 + 0.5) * 64;
    w = w < 64 ? 64 : w > NL_CONFIG_MAX_DIM ? NL_CONFIG_MAX_DIM : w;
    *out = *base;
    if (out->vocab_size == 0)
        out->vocab_size = NL_DEFAULT_VOCAB;
    set_shape(out, (int)w, seed_depth(total_bytes));
}

/* ---------------------------------------------------------------- fit */

typedef struct size_ctx {
    nl_plan_node *nodes; /* memory less the headroom */
    int n;
    const nl_plan_opts *po;
    uint64_t total, usable;
} size_ctx;

static nl_status ctx_open(size_ctx *s, const nl_plan_node *nodes, int n, const nl_sizing_opts *o,
                          nl_error *err)
{
    memset(s, 0, sizeof *s);
    if (!nodes || n < 1)
        return nl_error_set(err, NL_ERR_CAPACITY, "sizing: no nodes to size the model for");
    if (n > NL_PLAN_MAX_NODES)
        return nl_error_set(err, NL_ERR_LIMIT, "sizing: %d nodes is above the supported %d", n,
                            NL_PLAN_MAX_NODES);
    if (!(o->headroom >= 0 && o->headroom < 1))
        return nl_error_set(err, NL_ERR_INVALID, "sizing: headroom %g must be in [0, 1)",
                            o->headroom);
    if (!(s->nodes = malloc((size_t)n * sizeof *s->nodes)))
        return nl_error_set(err, NL_ERR_NOMEM, "sizing: out of memory");
    s->n = n;
    s->po = &o->plan;
    for (int i = 0; i < n; i++) {
        s->nodes[i] = nodes[i];
        s->nodes[i].memory_bytes = (uint64_t)((double)nodes[i].memory_bytes * (1 - o->headroom));
        s->total += nodes[i].memory_bytes;
        s->usable += s->nodes[i].memory_bytes;
    }
    return NL_OK;
}

static nl_status fits(const size_ctx *s, const nl_config *c, int *ok, nl_error *err)
{
    return nl_plan_fits(c, s->nodes, s->n, s->po, ok, err);
}

/* Deepest L in [lo, hi] at which c (depth aside) fits, given that lo fits:
 * it fits and L + 1 (when <= hi) does not. */
static nl_status deepest(const size_ctx *s, nl_config *c, int lo, int hi, nl_error *err)
{
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2, ok;
        c->num_layers = mid;
        nl_status st = fits(s, c, &ok, err);
        if (st)
            return st;
        if (ok)
            lo = mid;
        else
            hi = mid - 1;
    }
    c->num_layers = lo;
    return NL_OK;
}

/* Fill need_bytes and stages from the chosen config's plan. */
static nl_status plan_total(const size_ctx *s, nl_sizing *out, nl_error *err)
{
    nl_plan *p = NULL;
    nl_status st = nl_plan_layers(&p, &out->cfg, s->nodes, s->n, s->po, err);
    if (st)
        return st;
    out->need_bytes = 0;
    for (int i = 0; i < p->n_stages; i++)
        out->need_bytes += p->stages[i].bytes;
    out->stages = p->n_stages;
    nl_plan_destroy(&p);
    return NL_OK;
}

/* Least the memory model asks of a shape: one stage holding it all. */
static uint64_t least_bytes(const nl_config *c, const nl_plan_opts *po)
{
    return nl_plan_stage_bytes(c, po, c->num_layers, 0, 1);
}

static void report(nl_sizing *out, const size_ctx *s, double headroom, int seed_fits)
{
    const nl_config *a = &out->seed, *b = &out->cfg;
    int k =
        snprintf(out->report, sizeof out->report, "seed rule for %.1f GiB: d=%d L=%d H=%d G=%d; ",
                 (double)out->total_bytes / GIB, a->hidden_dim, a->num_layers, a->num_heads,
                 a->num_kv_heads);
    if (k < 0 || (size_t)k >= sizeof out->report)
        return;
    char *r = out->report + k;
    const size_t left = sizeof out->report - (size_t)k;
    const double seed_gib = (double)least_bytes(a, s->po) / GIB;
    const double use_gib = (double)s->usable / GIB;
    if (seed_fits) {
        snprintf(r, left,
                 "kept: it fits (%d stages, %.2f GiB of %.2f GiB usable after %.0f%% headroom)",
                 out->stages, (double)out->need_bytes / GIB, use_gib, headroom * 100);
        return;
    }
    char why[300];
    const int rows = s->po->mem.micro_rows;
    if (seed_gib > use_gib) {
        snprintf(why, sizeof why,
                 "needs at least %.2f GiB (%d-expert FFNs, gradients, AdamW moments, activations "
                 "of %d-row microbatches) but %.2f GiB are usable after %.0f%% headroom",
                 seed_gib, a->num_experts, rows, use_gib, headroom * 100);
    } else {
        /* enough in all: a stage of it outgrows a node */
        uint64_t largest = 0;
        for (int i = 0; i < s->n; i++)
            largest = s->nodes[i].memory_bytes > largest ? s->nodes[i].memory_bytes : largest;
        nl_plan_opts one = *s->po;
        one.mem.in_flight = 1;
        const double layer = (double)nl_plan_stage_bytes(a, &one, 1, 1, 3) / GIB;
        snprintf(why, sizeof why,
                 "does not place on these nodes: one layer with the activations of a %d-row "
                 "microbatch needs %.2f GiB, the largest node has %.2f GiB usable after %.0f%% "
                 "headroom, and 1F1B keeps S - s microbatches on stage s",
                 rows, layer, (double)largest / GIB, headroom * 100);
    }
    snprintf(
        r, left,
        "chosen d=%d L=%d H=%d G=%d: the seed shape %s; %s; the choice uses %.2f GiB in %d stages",
        b->hidden_dim, b->num_layers, b->num_heads, b->num_kv_heads, why,
        b->hidden_dim == a->hidden_dim ? "depth shrank" : "depth shrank to 8, then width",
        (double)out->need_bytes / GIB, out->stages);
}

static nl_status check_base(const nl_config *base, const nl_sizing_opts *o, nl_error *err)
{
    if (!base || !o)
        return nl_error_set(err, NL_ERR_INVALID, "sizing: missing config or options");
    if (!o->plan.mem.training)
        return nl_error_set(err, NL_ERR_INVALID, "sizing: sizes for training (mem.training = 1)");
    return NL_OK;
}

nl_status nl_sizing_choose(nl_sizing *out, const nl_config *base, const nl_plan_node *nodes,
                           int n_nodes, const nl_sizing_opts *o, nl_error *err)
{
    nl_status st = check_base(base, o, err);
    if (st)
        return st;
    size_ctx s;
    if ((st = ctx_open(&s, nodes, n_nodes, o, err)))
        return st;
    memset(out, 0, sizeof *out);
    out->total_bytes = s.total;
    out->usable_bytes = s.usable;
    nl_sizing_seed(&out->seed, base, s.total);
    const int seedL = out->seed.num_layers;
    int found = 0, seed_fits = 0;
    for (int d = out->seed.hidden_dim; d >= 64 && !found; d -= 64) {
        const int floor_l = d > 64 ? NL_SIZING_MIN_DEPTH : 1;
        nl_config c = out->seed;
        set_shape(&c, d, floor_l);
        if ((st = fits(&s, &c, &found, err)))
            goto done;
        if (!found)
            continue;
        if ((st = deepest(&s, &c, floor_l, seedL, err)))
            goto done;
        out->cfg = c;
        seed_fits = d == out->seed.hidden_dim && c.num_layers == seedL;
    }
    if (!found) {
        /* the smallest shape: let the planner say what is missing */
        nl_config c = out->seed;
        set_shape(&c, 64, 1);
        nl_plan *p = NULL;
        st = nl_plan_layers(&p, &c, s.nodes, s.n, s.po, err);
        nl_plan_destroy(&p);
        if (st == NL_OK)
            st = nl_error_set(err, NL_ERR_INTERNAL,
                              "sizing: the planner places d=64 L=1 but nl_plan_fits refused it");
        nl_error_prefix(err, "sizing: not even d=64 L=1 fits after %.0f%% headroom",
                        o->headroom * 100);
        goto done;
    }
    if ((st = plan_total(&s, out, err)))
        goto done;
    report(out, &s, o->headroom, seed_fits);
done:
    free(s.nodes);
    return st;
}

nl_status nl_sizing_propose_depth(nl_sizing *out, const nl_config *current,
                                  const nl_plan_node *nodes, int n_nodes, const nl_sizing_opts *o,
                                  nl_error *err)
{
    nl_status st = check_base(current, o, err);
    if (st)
        return st;
    if ((st = nl_config_validate(current, 1, err)))
        return nl_error_prefix(err, "sizing: current config");
    size_ctx s;
    if ((st = ctx_open(&s, nodes, n_nodes, o, err)))
        return st;
    memset(out, 0, sizeof *out);
    out->total_bytes = s.total;
    out->usable_bytes = s.usable;
    nl_sizing_seed(&out->seed, current, s.total);
    int top =
        out->seed.num_layers > current->num_layers ? out->seed.num_layers : current->num_layers;
    nl_config c = *current;
    int ok;
    c.num_layers = 1;
    if ((st = fits(&s, &c, &ok, err)))
        goto done;
    if (!ok) {
        nl_plan *p = NULL;
        st = nl_plan_layers(&p, &c, s.nodes, s.n, s.po, err);
        nl_plan_destroy(&p);
        if (st == NL_OK)
            st = nl_error_set(err, NL_ERR_INTERNAL,
                              "sizing: the planner places one layer but nl_plan_fits refused it");
        nl_error_prefix(err, "sizing: width %d: not even one layer fits", current->hidden_dim);
        goto done;
    }
    if ((st = deepest(&s, &c, 1, top, err)))
        goto done;
    out->cfg = c;
    if ((st = plan_total(&s, out, err)))
        goto done;
    snprintf(out->report, sizeof out->report,
             "width %d fixed: depth %d -> %d (seed depth %d for %.1f GiB; deepest that fits "
             "%.2f GiB usable, at most max(seed, current))",
             c.hidden_dim, current->num_layers, c.num_layers, out->seed.num_layers,
             (double)s.total / GIB, (double)s.usable / GIB);
done:
    free(s.nodes);
    return st;
}

int nl_sizing_should_change(const nl_config *current, const nl_config *proposed, double factor)
{
    if (!current || current->hidden_dim <= 0 || current->num_layers <= 0)
        return 1;
    if (!(factor > 1))
        factor = DEFAULT_FACTOR;
    nl_config p = *proposed;
    p.vocab_size = current->vocab_size;
    p.vocab_chunk = current->vocab_chunk;
    const double a = (double)nl_config_param_count(current), b = (double)nl_config_param_count(&p);
    return b > a * factor || a > b * factor;
}
