/* The planner's replicated plans (DESIGN section 8, "Replicas"): every
 * stage held by R nodes that each run 1/R of a step's microbatches. A
 * file of its own because it only wraps nl_plan_layers: the nodes are cut
 * into groups of R, each group plans as one node, and the plan's stages
 * are handed out to the groups' members (see planner.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/model/memory.h"
#include "core/plan/planner.h"

/* A node of the input and where it stands in the ranking. */
typedef struct ranked {
    const nl_plan_node *n;
    int index; /* in the input */
} ranked;

/* Faster first, then more memory, then the input's order. */
static int rank_cmp(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    if (x->n->gflops != y->n->gflops)
        return x->n->gflops > y->n->gflops ? -1 : 1;
    if (x->n->memory_bytes != y->n->memory_bytes)
        return x->n->memory_bytes > y->n->memory_bytes ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* Group g of R as one node of the planner: its id is g (the link speed
 * is the all-reduce's, which nl_plan_layers does not cost: none). */
static nl_plan_node group_node(const ranked *rk, int g, int R)
{
    nl_plan_node v = {g, UINT64_MAX, 0.0, 0.0, 0.0};
    for (int r = 0; r < R; r++) {
        const nl_plan_node *n = rk[g * R + r].n;
        if (n->memory_bytes < v.memory_bytes)
            v.memory_bytes = n->memory_bytes;
        if (r == 0 || n->gflops < v.gflops)
            v.gflops = n->gflops;
        if (n->hop_seconds > v.hop_seconds)
            v.hop_seconds = n->hop_seconds;
    }
    v.gflops *= R;
    return v;
}

/* Hand the groups' plan out to their members; standby: every node that
 * holds no stage, in input order. */
static void expand(nl_plan *p, const ranked *rk, const nl_plan_node *nodes, int n, int R,
                   char *used)
{
    for (int s = 0; s < p->n_stages; s++) {
        nl_plan_stage *g = &p->stages[s];
        const int grp = g->node_id;
        g->n_replicas = R;
        for (int r = 0; r < R; r++) {
            g->replicas[r] = rk[grp * R + r].n->id;
            used[rk[grp * R + r].index] = 1;
        }
        g->node_id = g->replicas[0];
    }
    p->n_standby = 0;
    for (int i = 0; i < n; i++)
        if (!used[i])
            p->standby[p->n_standby++] = nodes[i].id;
}

nl_status nl_plan_layers_replicated(nl_plan **out, const nl_config *cfg, const nl_plan_node *nodes,
                                    int n_nodes, const nl_plan_opts *opts, int replicas,
                                    nl_error *err)
{
    if (replicas == 1)
        return nl_plan_layers(out, cfg, nodes, n_nodes, opts, err);
    if (!out)
        return nl_error_set(err, NL_ERR_INVALID, "plan: no output");
    *out = NULL;
    if (replicas < 1 || replicas > NL_PLAN_MAX_REPLICAS)
        return nl_error_set(err, NL_ERR_INVALID, "plan: %d replicas per stage (1 to %d)", replicas,
                            NL_PLAN_MAX_REPLICAS);
    if (!nodes || n_nodes < 1 || n_nodes > NL_PLAN_MAX_NODES)
        return nl_error_set(err, NL_ERR_INVALID, "plan: %d nodes (1 to %d)", n_nodes,
                            NL_PLAN_MAX_NODES);
    for (int i = 0; i < n_nodes; i++) {
        if (!(nodes[i].gflops > 0.0) || !(nodes[i].hop_seconds >= 0.0) ||
            !(nodes[i].link_bytes_s >= 0.0) || !isfinite(nodes[i].link_bytes_s))
            return nl_error_set(err, NL_ERR_INVALID,
                                "plan: node %d has throughput %g, hop time %g and link speed %g",
                                nodes[i].id, nodes[i].gflops, nodes[i].hop_seconds,
                                nodes[i].link_bytes_s);
        for (int k = 0; k < i; k++)
            if (nodes[k].id == nodes[i].id)
                return nl_error_set(err, NL_ERR_INVALID, "plan: node id %d appears twice",
                                    nodes[i].id);
    }
    if (n_nodes < replicas)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "plan: %d replicas per stage need at least %d nodes, %d joined",
                            replicas, replicas, n_nodes);
    const int G = n_nodes / replicas;
    nl_status st = NL_OK;
    ranked *rk = malloc((size_t)n_nodes * sizeof *rk);
    nl_plan_node *vn = malloc((size_t)G * sizeof *vn);
    char *used = calloc((size_t)n_nodes, 1);
    if (!rk || !vn || !used) {
        st = nl_error_set(err, NL_ERR_NOMEM, "plan: out of memory");
        goto done;
    }
    for (int i = 0; i < n_nodes; i++)
        rk[i] = (ranked){&nodes[i], i};
    qsort(rk, (size_t)n_nodes, sizeof *rk, rank_cmp);
    for (int g = 0; g < G; g++)
        vn[g] = group_node(rk, g, replicas);
    if ((st = nl_plan_layers(out, cfg, vn, G, opts, err))) {
        nl_error_prefix(err, "plan with %d replicas per stage (%d groups of nodes)", replicas, G);
        goto done;
    }
    /* the groups' standby list is too short for the nodes: make room */
    int *sb = realloc((*out)->standby, (size_t)n_nodes * sizeof *sb);
    if (!sb) {
        nl_plan_destroy(out);
        st = nl_error_set(err, NL_ERR_NOMEM, "plan: out of memory");
        goto done;
    }
    (*out)->standby = sb;
    expand(*out, rk, nodes, n_nodes, replicas, used);
done:
    free(used);
    free(rk);
    free(vn);
    return st;
}

double nl_plan_step_seconds(const nl_plan *p, const nl_config *cfg, const nl_plan_opts *o, int M,
                            double link)
{
    const int R = p->n_stages > 0 && p->stages[0].n_replicas > 1 ? p->stages[0].n_replicas : 1;
    double t = (double)((M + R - 1) / R + p->n_stages - 1) * (p->bottleneck * R);
    if (R > 1 && link > 0) {
        uint64_t w = 0;
        for (int s = 0; s < p->n_stages; s++) {
            const nl_plan_stage *g = &p->stages[s];
            const uint64_t b =
                nl_memory_estimate(cfg, g->l1 - g->l0, g->has_embed, g->has_head, &o->mem).weights;
            w = b > w ? b : w;
        }
        t += 2.0 * (R - 1) / R * (double)w / link;
    }
    return t;
}

double nl_plan_link_bytes_s(const nl_plan *p, const nl_plan_node *nodes, int n_nodes,
                            double assumed, int *measured)
{
    double link = 0.0;
    int seen = 0, meas = 0;
    for (int s = 0; p && s < p->n_stages; s++) {
        const nl_plan_stage *g = &p->stages[s];
        for (int r = 0; g->n_replicas > 1 && r < g->n_replicas; r++) {
            double v = assumed;
            int m = 0;
            for (int i = 0; i < n_nodes; i++)
                if (nodes[i].id == g->replicas[r] && nodes[i].link_bytes_s > 0) {
                    v = nodes[i].link_bytes_s;
                    m = 1;
                    break;
                }
            if (!seen || v < link || (v == link && m && !meas)) {
                link = v;
                meas = m;
            }
            seen = 1;
        }
    }
    if (measured)
        *measured = seen ? meas : 0;
    return seen ? link : assumed;
}

nl_status nl_plan_choose_replicas(nl_plan **out, int *replicas, double *step_s,
                                  nl_plan_replica_option *tried, int *n_tried, const nl_config *cfg,
                                  const nl_plan_node *nodes, int n_nodes, const nl_plan_opts *opts,
                                  int microbatches, double link_bytes_per_s, nl_error *err)
{
    if (!out || !replicas || microbatches < 1 || !(link_bytes_per_s >= 0))
        return nl_error_set(err, NL_ERR_INVALID,
                            "plan: choosing replicas needs an output, microbatches >= 1 (%d) and "
                            "a link speed >= 0",
                            microbatches);
    *out = NULL;
    if (n_tried)
        *n_tried = 0;
    nl_status first = NL_OK;
    double best = 0.0;
    const int top = n_nodes < NL_PLAN_MAX_REPLICAS ? n_nodes : NL_PLAN_MAX_REPLICAS;
    for (int R = 1; R <= top; R++) {
        if (microbatches % R != 0) /* a step's microbatches divide among the replicas */
            continue;
        nl_plan *p = NULL;
        nl_error e = {0};
        nl_status st = nl_plan_layers_replicated(&p, cfg, nodes, n_nodes, opts, R, &e);
        if (st != NL_OK) { /* the first failure explains a cluster where nothing places */
            if (!first) {
                first = st;
                if (err)
                    *err = e;
            }
            if (st != NL_ERR_CAPACITY)
                break;
            if (tried && n_tried)
                tried[(*n_tried)++] = (nl_plan_replica_option){R, 0, 0.0, 0.0, 0};
            continue;
        }
        int meas = 0;
        const double link = nl_plan_link_bytes_s(p, nodes, n_nodes, link_bytes_per_s, &meas);
        const double t = nl_plan_step_seconds(p, cfg, opts, microbatches, link);
        if (tried && n_tried)
            tried[(*n_tried)++] = (nl_plan_replica_option){R, p->n_stages, t, link, meas};
        if (!*out || t < best * (1 - 1e-9)) {
            nl_plan_destroy(out);
            *out = p;
            *replicas = R;
            best = t;
        } else {
            nl_plan_destroy(&p);
        }
    }
    if (!*out)
        return first ? first : nl_error_set(err, NL_ERR_CAPACITY, "plan: nothing places");
    if (step_s)
        *step_s = best;
    return NL_OK;
}
