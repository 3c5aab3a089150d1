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

/* The nodes as every plan needs them: throughput > 0, times and link
 * speeds >= 0 and finite, ids unique. */
static nl_status check_nodes(const nl_plan_node *nodes, int n_nodes, nl_error *err)
{
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
    return NL_OK;
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
    nl_status st = check_nodes(nodes, n_nodes, err);
    if (st != NL_OK)
        return st;
    if (n_nodes < replicas)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "plan: %d replicas per stage need at least %d nodes, %d joined",
                            replicas, replicas, n_nodes);
    const int G = n_nodes / replicas;
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
    double busy = 0.0, fill = 0.0, reduce = 0.0;
    for (int s = 0; s < p->n_stages; s++) {
        const nl_plan_stage *g = &p->stages[s];
        const int R = g->n_replicas > 1 ? g->n_replicas : 1;
        const double one = g->seconds * R; /* one microbatch on one replica */
        const double b = (double)((M + R - 1) / R) * one;
        busy = b > busy ? b : busy;
        fill = one > fill ? one : fill;
        if (R > 1 && link > 0) {
            const uint64_t w =
                nl_memory_estimate(cfg, g->l1 - g->l0, g->has_embed, g->has_head, &o->mem).weights;
            const double t = 2.0 * (R - 1) / R * (double)w / link;
            reduce = t > reduce ? t : reduce;
        }
    }
    return busy + (double)(p->n_stages > 0 ? p->n_stages - 1 : 0) * fill + reduce;
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

/* A plan nl_plan_choose_replicas does not choose: into rest (room for
 * NL_PLAN_MAX_REPLICAS) when it leaves nodes out and rest is given, for
 * nl_plan_choose_stage_replicas to grow; else freed. */
static void set_aside(nl_plan **p, nl_plan **rest, int *n_rest)
{
    if (rest && (*p)->n_standby > 0) {
        rest[(*n_rest)++] = *p;
        *p = NULL;
    }
    nl_plan_destroy(p);
}

/* nl_plan_choose_replicas, with every placed plan not chosen that leaves
 * nodes out handed to rest (may be NULL), *n_rest of them. */
static nl_status choose_uniform(nl_plan **out, int *replicas, double *step_s,
                                nl_plan_replica_option *tried, int *n_tried, const nl_config *cfg,
                                const nl_plan_node *nodes, int n_nodes, const nl_plan_opts *opts,
                                int microbatches, double link_bytes_per_s, nl_plan **rest,
                                int *n_rest, nl_error *err)
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
            if (*out)
                set_aside(out, rest, n_rest);
            *out = p;
            *replicas = R;
            best = t;
        } else {
            set_aside(&p, rest, n_rest);
        }
    }
    if (!*out)
        return first ? first : nl_error_set(err, NL_ERR_CAPACITY, "plan: nothing places");
    if (step_s)
        *step_s = best;
    return NL_OK;
}

nl_status nl_plan_choose_replicas(nl_plan **out, int *replicas, double *step_s,
                                  nl_plan_replica_option *tried, int *n_tried, const nl_config *cfg,
                                  const nl_plan_node *nodes, int n_nodes, const nl_plan_opts *opts,
                                  int microbatches, double link_bytes_per_s, nl_error *err)
{
    return choose_uniform(out, replicas, step_s, tried, n_tried, cfg, nodes, n_nodes, opts,
                          microbatches, link_bytes_per_s, NULL, NULL, err);
}

/* ===================== a replica count per stage ===================== */

/* Stage s of a plan with its own replica count: its nodes (indices into
 * the input, fastest first) and the one planner node they make (their
 * smallest memory, R times their slowest throughput, their slowest hop). */
typedef struct sgroup {
    int R;
    int idx[NL_PLAN_MAX_REPLICAS];
    nl_plan_node v;
} sgroup;

static void sgroup_fold(sgroup *g, const nl_plan_node *nodes)
{
    g->v = (nl_plan_node){0, UINT64_MAX, 0.0, 0.0, 0.0};
    for (int r = 0; r < g->R; r++) {
        const nl_plan_node *n = &nodes[g->idx[r]];
        if (n->memory_bytes < g->v.memory_bytes)
            g->v.memory_bytes = n->memory_bytes;
        if (r == 0 || n->gflops < g->v.gflops)
            g->v.gflops = n->gflops;
        if (n->hop_seconds > g->v.hop_seconds)
            g->v.hop_seconds = n->hop_seconds;
    }
    g->v.gflops *= g->R;
}

/* The split of the layers over the groups, in pipeline order, with the
 * smallest bottleneck: a DP over (stages placed, layers covered); each
 * stage holds at least one layer and fits every one of its nodes. A new
 * plan in *out, or NL_ERR_CAPACITY. */
static nl_status split_groups(nl_plan **out, const nl_config *cfg, const nl_plan_opts *o,
                              const sgroup *g, int S, const nl_plan_node *nodes, int n_nodes,
                              nl_error *err)
{
    const int L = cfg->num_layers;
    *out = NULL;
    if (S < 1 || S > L)
        return nl_error_set(err, NL_ERR_CAPACITY, "plan: %d stages for %d layers", S, L);
    const size_t cells = (size_t)(S + 1) * (size_t)(L + 1);
    double *best = malloc(cells * sizeof *best);
    int *from = malloc(cells * sizeof *from);
    char *used = calloc((size_t)n_nodes, 1);
    nl_plan *p = calloc(1, sizeof *p);
    nl_status st = NL_OK;
    if (!best || !from || !used || !p || !(p->stages = calloc((size_t)S, sizeof *p->stages)) ||
        !(p->standby = calloc((size_t)n_nodes, sizeof *p->standby))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "plan: out of memory");
        goto done;
    }
    for (size_t i = 0; i < cells; i++)
        best[i] = INFINITY;
    best[0] = 0.0;
    for (int s = 0; s < S; s++)
        for (int l = s; l < L; l++) {
            const double before = best[(size_t)s * (L + 1) + l];
            if (!isfinite(before))
                continue;
            for (int n = 1; l + n + (S - 1 - s) <= L; n++) {
                if (nl_plan_stage_bytes(cfg, o, n, s, S) > g[s].v.memory_bytes)
                    break; /* more layers only take more memory */
                const double t = nl_plan_stage_seconds(cfg, o, &g[s].v, n, s, S);
                const double b = t > before ? t : before;
                const size_t k = (size_t)(s + 1) * (L + 1) + (size_t)(l + n);
                if (b < best[k]) {
                    best[k] = b;
                    from[k] = l;
                }
            }
        }
    if (!isfinite(best[(size_t)S * (L + 1) + L])) {
        st = nl_error_set(err, NL_ERR_CAPACITY,
                          "plan: %d stages with their replicas cannot hold the %d layers (a "
                          "stage fits its smallest node's memory)",
                          S, L);
        goto done;
    }
    int l1 = L;
    for (int s = S - 1; s >= 0; s--) {
        const int l0 = from[(size_t)(s + 1) * (L + 1) + l1];
        nl_plan_stage *x = &p->stages[s];
        x->n_replicas = g[s].R;
        for (int r = 0; r < g[s].R; r++)
            x->replicas[r] = nodes[g[s].idx[r]].id;
        x->node_id = x->replicas[0];
        x->l0 = l0;
        x->l1 = l1;
        x->has_embed = s == 0;
        x->has_head = s == S - 1;
        x->in_flight = nl_plan_stage_in_flight(o, s, S);
        x->bytes = nl_plan_stage_bytes(cfg, o, l1 - l0, s, S);
        x->seconds = nl_plan_stage_seconds(cfg, o, &g[s].v, l1 - l0, s, S);
        if (x->seconds > p->bottleneck)
            p->bottleneck = x->seconds;
        l1 = l0;
    }
    p->n_stages = S;
    for (int s = 0; s < S; s++)
        for (int r = 0; r < g[s].R; r++)
            used[g[s].idx[r]] = 1;
    for (int i = 0; i < n_nodes; i++)
        if (!used[i])
            p->standby[p->n_standby++] = nodes[i].id;
    *out = p;
    p = NULL;
done:
    nl_plan_destroy(&p);
    free(best);
    free(from);
    free(used);
    return st;
}

nl_status nl_plan_layers_staged(nl_plan **out, const nl_config *cfg, const nl_plan_node *nodes,
                                int n_nodes, const nl_plan_opts *opts, const int *reps,
                                int n_stages, nl_error *err)
{
    if (!out)
        return nl_error_set(err, NL_ERR_INVALID, "plan: no output");
    *out = NULL;
    nl_status st = check_nodes(nodes, n_nodes, err);
    if (st != NL_OK)
        return st;
    if (!reps || n_stages < 1 || n_stages > NL_PLAN_MAX_NODES)
        return nl_error_set(err, NL_ERR_INVALID, "plan: %d stages", n_stages);
    int total = 0;
    for (int s = 0; s < n_stages; s++) {
        if (reps[s] < 1 || reps[s] > NL_PLAN_MAX_REPLICAS)
            return nl_error_set(err, NL_ERR_INVALID, "plan: stage %d with %d replicas (1 to %d)", s,
                                reps[s], NL_PLAN_MAX_REPLICAS);
        total += reps[s];
    }
    if (total > n_nodes)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "plan: %d stages with %d replicas in all need at least %d nodes, %d "
                            "joined",
                            n_stages, total, total, n_nodes);
    ranked *rk = malloc((size_t)n_nodes * sizeof *rk);
    sgroup *g = calloc((size_t)n_stages, sizeof *g);
    if (!rk || !g) {
        free(rk);
        free(g);
        return nl_error_set(err, NL_ERR_NOMEM, "plan: out of memory");
    }
    for (int i = 0; i < n_nodes; i++)
        rk[i] = (ranked){&nodes[i], i};
    qsort(rk, (size_t)n_nodes, sizeof *rk, rank_cmp);
    for (int s = 0, k = 0; s < n_stages; s++) { /* the fastest nodes to the first stages */
        g[s].R = reps[s];
        for (int r = 0; r < reps[s]; r++)
            g[s].idx[r] = rk[k++].index;
        sgroup_fold(&g[s], nodes);
    }
    st = split_groups(out, cfg, opts, g, n_stages, nodes, n_nodes, err);
    free(rk);
    free(g);
    return st;
}

/* The seconds a step of plan p takes with its replicas' all-reduce at
 * the slowest link among them. */
static double plan_step(const nl_plan *p, const nl_config *cfg, const nl_plan_opts *o,
                        const nl_plan_node *nodes, int n_nodes, int M, double assumed)
{
    return nl_plan_step_seconds(p, cfg, o, M,
                                nl_plan_link_bytes_s(p, nodes, n_nodes, assumed, NULL));
}

/* The input index of node id. */
static int index_of(const nl_plan_node *nodes, int n_nodes, int id)
{
    for (int i = 0; i < n_nodes; i++)
        if (nodes[i].id == id)
            return i;
    return -1;
}

/* Plan p's stages as groups of the input's nodes (g: room for
 * p->n_stages), each stage's replicas in their order (a plan of
 * nl_plan_layers names its one node as replica 0), in_plan[i] = 1 for
 * every node that holds a stage. NL_ERR_INVALID for a node the input
 * lacks, or one that holds two replicas. */
static nl_status plan_groups(sgroup *g, char *in_plan, const nl_plan *p, const nl_plan_node *nodes,
                             int n_nodes, nl_error *err)
{
    for (int s = 0; s < p->n_stages; s++) {
        const nl_plan_stage *x = &p->stages[s];
        if (x->n_replicas > NL_PLAN_MAX_REPLICAS)
            return nl_error_set(err, NL_ERR_INVALID, "plan: stage %d with %d replicas", s,
                                x->n_replicas);
        g[s].R = x->n_replicas > 1 ? x->n_replicas : 1;
        for (int r = 0; r < g[s].R; r++) {
            const int id = x->n_replicas >= 1 ? x->replicas[r] : x->node_id;
            const int i = index_of(nodes, n_nodes, id);
            if (i < 0 || in_plan[i])
                return nl_error_set(err, NL_ERR_INVALID,
                                    "plan: stage %d's replica %d is on node %d, %s", s, r, id,
                                    i < 0 ? "which is not among the nodes" : "which holds another");
            g[s].idx[r] = i;
            in_plan[i] = 1;
        }
        sgroup_fold(&g[s], nodes);
    }
    return NL_OK;
}

/* Stage b of groups g (S of them) given the next spare nodes from
 * spare[used..n_spare): as many as make its replica count divide M. The
 * plan that makes (the layers split again, split_groups) into *out with
 * its seconds a step *tq and the groups into trial, how many it took in
 * *k; *out NULL when stage b cannot take them (NL_PLAN_MAX_REPLICAS,
 * too few spares, a node too small for the stage). */
static nl_status grow_stage(nl_plan **out, double *tq, int *k, sgroup *trial, const sgroup *g,
                            int S, int b, const ranked *spare, int used, int n_spare,
                            const nl_config *cfg, const nl_plan_opts *o, const nl_plan_node *nodes,
                            int n_nodes, int M, double link, nl_error *err)
{
    *out = NULL;
    int n = 1;
    while (g[b].R + n <= NL_PLAN_MAX_REPLICAS && M % (g[b].R + n) != 0)
        n++;
    if (g[b].R + n > NL_PLAN_MAX_REPLICAS || used + n > n_spare)
        return NL_OK;
    memcpy(trial, g, (size_t)S * sizeof *g);
    for (int r = 0; r < n; r++)
        trial[b].idx[trial[b].R++] = spare[used + r].index;
    sgroup_fold(&trial[b], nodes);
    nl_error e = {0};
    nl_status st = split_groups(out, cfg, o, trial, S, nodes, n_nodes, &e);
    if (st == NL_ERR_CAPACITY) /* a smaller node cannot hold the stage */
        return NL_OK;
    if (st != NL_OK) {
        if (err)
            *err = e;
        return st;
    }
    *tq = plan_step(*out, cfg, o, nodes, n_nodes, M, link);
    *k = n;
    return NL_OK;
}

/* From plan p (any replica counts: a depth-only plan, one of R replicas a
 * stage, ...), give the nodes it leaves out, fastest first, to the stage
 * where they make the step fastest (as many at a time as make its
 * replica count divide M; the layers split again over the stages,
 * split_groups), while the step gets faster. Every stage is tried, its
 * bottleneck first, which keeps a tie: the stage that is the bottleneck
 * now need not be the one a re-split makes best to grow (five equal
 * nodes on 8 layers in steps of 6: 3 + 2 beats 2 + 3). *out: the plan
 * reached (NULL when no node was given), *t_out its seconds a step. */
static nl_status grow_spares(nl_plan **out, double *t_out, const nl_plan *p, const nl_config *cfg,
                             const nl_plan_opts *o, const nl_plan_node *nodes, int n_nodes, int M,
                             double link, nl_error *err)
{
    *out = NULL;
    const int S = p->n_stages;
    ranked *spare = malloc((size_t)n_nodes * sizeof *spare);
    sgroup *g = calloc((size_t)S, sizeof *g), *trial = calloc((size_t)S, sizeof *trial);
    sgroup *pick = calloc((size_t)S, sizeof *pick);
    char *in_plan = calloc((size_t)n_nodes, 1);
    nl_status st = NL_OK;
    if (!spare || !g || !trial || !pick || !in_plan) {
        st = nl_error_set(err, NL_ERR_NOMEM, "plan: out of memory");
        goto done;
    }
    if ((st = plan_groups(g, in_plan, p, nodes, n_nodes, err)) != NL_OK)
        goto done;
    int n_spare = 0; /* every node p leaves out (its standby, or the nodes it was not given) */
    for (int i = 0; i < n_nodes; i++)
        if (!in_plan[i])
            spare[n_spare++] = (ranked){&nodes[i], i};
    qsort(spare, (size_t)n_spare, sizeof *spare, rank_cmp);
    const nl_plan *cur = p;
    double t = plan_step(p, cfg, o, nodes, n_nodes, M, link);
    for (int used = 0; st == NL_OK;) {
        int b = 0;
        for (int s = 1; s < S; s++)
            if (cur->stages[s].seconds > cur->stages[b].seconds)
                b = s;
        nl_plan *best = NULL;
        double tb = 0.0;
        int kb = 0;
        for (int i = 0; i < S && st == NL_OK; i++) {
            const int s = i == 0 ? b : i <= b ? i - 1 : i; /* the bottleneck, then the rest */
            nl_plan *q = NULL;
            double tq = 0.0;
            int k = 0;
            st = grow_stage(&q, &tq, &k, trial, g, S, s, spare, used, n_spare, cfg, o, nodes,
                            n_nodes, M, link, err);
            if (q && (!best || tq < tb * (1 - 1e-9))) {
                nl_plan_destroy(&best);
                best = q;
                tb = tq;
                kb = k;
                memcpy(pick, trial, (size_t)S * sizeof *g);
            } else {
                nl_plan_destroy(&q);
            }
        }
        if (st != NL_OK || !best || !(tb < t * (1 - 1e-9))) {
            nl_plan_destroy(&best);
            break;
        }
        nl_plan_destroy(out);
        *out = best;
        cur = best;
        t = tb;
        used += kb;
        memcpy(g, pick, (size_t)S * sizeof *g);
    }
    *t_out = t;
done:
    if (st != NL_OK)
        nl_plan_destroy(out);
    free(spare);
    free(g);
    free(trial);
    free(pick);
    free(in_plan);
    return st;
}

/* Whether some stage of p has another replica count than stage 0. */
static int uneven(const nl_plan *p)
{
    for (int s = 1; s < p->n_stages; s++)
        if (p->stages[s].n_replicas != p->stages[0].n_replicas)
            return 1;
    return 0;
}

/* Grow plan p (grow_spares) when it leaves nodes out; the plan it
 * reaches replaces *best (p may be *best), *t its seconds a step, when
 * some stages' counts differ and it is faster than *t by more than a
 * relative 1e-9. */
static nl_status try_grown(nl_plan **best, double *t, const nl_plan *p, const nl_config *cfg,
                           const nl_plan_opts *o, const nl_plan_node *nodes, int n_nodes, int M,
                           double link, nl_error *err)
{
    int held = 0;
    for (int s = 0; s < p->n_stages; s++)
        held += p->stages[s].n_replicas > 1 ? p->stages[s].n_replicas : 1;
    if (held >= n_nodes)
        return NL_OK;
    nl_plan *grown = NULL;
    double tg = 0.0;
    const nl_status st = grow_spares(&grown, &tg, p, cfg, o, nodes, n_nodes, M, link, err);
    if (st == NL_OK && grown && uneven(grown) && tg < *t * (1 - 1e-9)) {
        nl_plan_destroy(best);
        *best = grown;
        grown = NULL;
        *t = tg;
    }
    nl_plan_destroy(&grown);
    return st;
}

nl_status nl_plan_choose_stage_replicas(nl_plan **out, double *step_s,
                                        nl_plan_replica_option *tried, int *n_tried,
                                        const nl_config *cfg, const nl_plan_node *nodes,
                                        int n_nodes, const nl_plan_opts *opts, int microbatches,
                                        double link_bytes_per_s, nl_error *err)
{
    int R = 0, n_rest = 0;
    double t = 0.0;
    nl_plan *rest[NL_PLAN_MAX_REPLICAS];
    nl_status st = choose_uniform(out, &R, &t, tried, n_tried, cfg, nodes, n_nodes, opts,
                                  microbatches, link_bytes_per_s, rest, &n_rest, err);
    if (st != NL_OK)
        return st;
    /* the uniform plans grown with the nodes each leaves out: the chosen
     * one, then every other R tried (R = 1: the depth-only plan over all
     * the nodes) */
    st = try_grown(out, &t, *out, cfg, opts, nodes, n_nodes, microbatches, link_bytes_per_s, err);
    for (int i = 0; i < n_rest; i++) {
        if (st == NL_OK)
            st = try_grown(out, &t, rest[i], cfg, opts, nodes, n_nodes, microbatches,
                           link_bytes_per_s, err);
        nl_plan_destroy(&rest[i]);
    }
    /* the depth-only plans over the k fastest (k < n, at most
     * NL_PLAN_EXACT_MAX), each grown with the rest */
    ranked *rk = malloc((size_t)n_nodes * sizeof *rk);
    nl_plan_node *sub = malloc((size_t)n_nodes * sizeof *sub);
    if (st == NL_OK && (!rk || !sub))
        st = nl_error_set(err, NL_ERR_NOMEM, "plan: out of memory");
    for (int i = 0; st == NL_OK && i < n_nodes; i++)
        rk[i] = (ranked){&nodes[i], i};
    if (st == NL_OK)
        qsort(rk, (size_t)n_nodes, sizeof *rk, rank_cmp);
    for (int i = 0; st == NL_OK && i < n_nodes; i++)
        sub[i] = *rk[i].n;
    const int kmax = n_nodes - 1 < NL_PLAN_EXACT_MAX ? n_nodes - 1 : NL_PLAN_EXACT_MAX;
    for (int k = 1; k <= kmax && st == NL_OK; k++) {
        nl_plan *depth = NULL;
        nl_error e = {0};
        if (nl_plan_layers(&depth, cfg, sub, k, opts, &e) == NL_OK)
            st = try_grown(out, &t, depth, cfg, opts, nodes, n_nodes, microbatches,
                           link_bytes_per_s, err);
        nl_plan_destroy(&depth);
    }
    free(rk);
    free(sub);
    if (st != NL_OK) {
        nl_plan_destroy(out);
        return st;
    }
    if (step_s)
        *step_s = t;
    return NL_OK;
}
