/* The coordinator's planning and loading: the plan over the live nodes
 * (core/plan/sizing, core/plan/planner), its assignments, each stage's tensors
 * streamed in LAYER_LOAD chunks, re-planning at rest or at a training
 * checkpoint when a plan over the nodes now beats the current one. */
#include "coordinator/coord_impl.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "base/log.h"
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/plan/sizing.h"

#define CHUNK_FLOATS (1u << 20) /* 4 MiB per LAYER_LOAD frame */

/* Does source tensor `name` belong to stage s? The optimizer moments
 * (optim.m.<name>, optim.v.<name>) go with their tensor when the source is
 * a manifest, so that training resumes; a checkpoint's stay here. */
static int stage_holds(const nl_coord *c, const nl_plan_stage *s, const char *name)
{
    int l = -1, used = 0;
    if (strncmp(name, "optim.m.", 8) == 0 || strncmp(name, "optim.v.", 8) == 0) {
        if (!c->src_manifest)
            return 0;
        name += 8;
    }
    if (strcmp(name, "tok_embeddings.weight") == 0)
        return s->has_embed;
    if (strcmp(name, "norm.weight") == 0 || strcmp(name, "lm_head.weight") == 0 ||
        strcmp(name, "classifier.weight") == 0) /* the classifier (num_classes) with the head */
        return s->has_head;
    if (sscanf(name, "layers.%d.%n", &l, &used) == 1 && used > 0)
        return l >= s->l0 && l < s->l1;
    return 0; /* optimizer moments and anything else stay here */
}

/* Streaming a stage's tensors runs in steps on the loop (issue 22 item
 * 6): each turn sends chunks (LAYER_LOAD, 4 MiB, pointing into the mapped
 * source: no copy) to the stages that load, round-robin, while fewer than
 * LOAD_WINDOW chunks of the source wait in libzmq's queues. A big model
 * thus never fills a peer's queue (its high-water mark would make a send
 * wait up to the socket's send timeout), heartbeats and clients are served
 * between chunks, and the memory libzmq holds stays bounded. The cursor
 * (cnode.ld) restarts when the source changes and stops with its epoch. */
#define LOAD_WINDOW 64 /* chunks in flight, all stages together: 256 MiB */
#define LOAD_TURN 16   /* chunks one turn sends at most */

/* Send the stage's next chunk: 1 sent, 0 none left, -1 the send failed. */
static int send_next_chunk(nl_coord *c, cnode *n, nl_wire_msg *m)
{
    const nl_plan_stage *s = &c->plan->stages[n->stage];
    cload *ld = &n->ld;
    for (; c->src && ld->file < c->src->n; ld->file++, ld->entry = 0) {
        nl_st_file *f = c->src->files[ld->file];
        for (; ld->entry < nl_st_count(f); ld->entry++, ld->chunk = 0) {
            const nl_st_entry *e = nl_st_entry_at(f, ld->entry);
            if (!stage_holds(c, s, e->name) || e->dtype != NL_DTYPE_F32 ||
                !coord_source_owns(c->src, ld->file, e->name))
                continue;
            const uint64_t numel = e->nbytes / 4;
            uint32_t chunks = (uint32_t)((numel + CHUNK_FLOATS - 1) / CHUNK_FLOATS);
            chunks = chunks ? chunks : 1;
            if (ld->chunk >= chunks)
                continue;
            const char *data = nl_st_tensor_data(f, e);
            const uint64_t off = (uint64_t)ld->chunk * CHUNK_FLOATS;
            const int64_t cnt = (int64_t)(numel - off < CHUNK_FLOATS ? numel - off : CHUNK_FLOATS);
            nl_wire_msg_reset(m, NL_MSG_LAYER_LOAD);
            m->u.layer_load.epoch = c->epoch;
            m->u.layer_load.name = e->name;
            m->u.layer_load.ndim = e->ndim;
            memcpy(m->u.layer_load.shape, e->shape, sizeof e->shape);
            m->u.layer_load.offset = off;
            m->u.layer_load.chunk = ld->chunk;
            m->u.layer_load.chunks = chunks;
            nl_txref_frame(&m->frames[0], &c->src->ref, (void *)(data + off * 4), NL_DTYPE_F32,
                           &cnt, 1);
            m->nframes = 1;
            if (coord_send_node(c, n, m) != NL_OK)
                return -1;
            if (++ld->chunk == chunks) {
                ld->tensors++;
                ld->bytes += e->nbytes;
            }
            return 1;
        }
    }
    return 0;
}

/* Begin streaming a stage's tensors to its replica r (none without a
 * source: LOAD_DONE {tensors 0} then tells the node to initialise from
 * the seed). */
static void start_load(nl_coord *c, int stage, int r)
{
    cnode *n = coord_stage_replica(c, stage, r);
    if (n)
        n->ld = (cload){.active = 1, .epoch = c->epoch, .src = c->src, .t0 = nl_mono_s()};
}

/* One turn of streaming; returns how many stages still load. */
int coord_stream_loads(nl_coord *c)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    int active = 0, sent = 0, progress = 1;
    while (progress && sent < LOAD_TURN) {
        progress = 0;
        active = 0;
        /* only a stage of the plan loads: not a scan of every node */
        const int S = c->plan ? c->plan->n_stages : 0;
        for (int k = 0; k < S * NL_PLAN_MAX_REPLICAS && sent < LOAD_TURN; k++) {
            cnode *n = coord_stage_replica(c, k / NL_PLAN_MAX_REPLICAS, k % NL_PLAN_MAX_REPLICAS);
            cload *ld = n ? &n->ld : NULL;
            if (!ld || !ld->active)
                continue;
            if (n->life != NODE_LIVE || n->stage < 0 || !c->plan || ld->epoch != c->epoch) {
                ld->active = 0; /* its plan is gone */
                continue;
            }
            if (ld->src != c->src) /* a new source: from the start */
                *ld = (cload){.active = 1, .epoch = c->epoch, .src = c->src, .t0 = ld->t0};
            active++;
            if (c->src && atomic_load(&c->src->ref.pending) >= LOAD_WINDOW)
                continue; /* libzmq holds enough: next turn */
            const int r = send_next_chunk(c, n, &m);
            if (r > 0) {
                sent++;
                progress = 1;
                continue;
            }
            ld->active = 0;
            active--;
            if (r < 0) /* declared dead at this tick */
                continue;
            nl_wire_msg_reset(&m, NL_MSG_LOAD_DONE);
            m.u.load_done = (nl_msg_load_done){c->epoch, n->id, ld->tensors, ld->bytes};
            coord_send_node(c, n, &m);
            if (c->src)
                NL_INFO("stage %d: sent %u tensors (%.1f MiB) to node %u in %.2f s", n->stage,
                        ld->tensors, (double)ld->bytes / (1 << 20), n->id, nl_mono_s() - ld->t0);
        }
    }
    nl_wire_msg_free(&m);
    c->loads_active = active;
    return active;
}

static double hop_seconds(const nl_coord *c, const cnode *n)
{
    /* one request's activations at the node's link speed (measured by its
     * replicas' all-reduce, else assumed: coord_link.c), plus a fixed
     * per-message cost */
    return 1e-4 + (double)c->o.plan_rows * c->cfg.hidden_dim * 4 / coord_link_or_assumed(n, NULL);
}

/* Faster first, then more memory, then the lower id. */
static int faster_first(const void *a, const void *b)
{
    const nl_plan_node *x = a, *y = b;
    if (x->gflops != y->gflops)
        return x->gflops > y->gflops ? -1 : 1;
    if (x->memory_bytes != y->memory_bytes)
        return x->memory_bytes > y->memory_bytes ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The planner's time grows as N min(N, L) (core/plan/planner.h), and a plan
 * has at most L stages: over many nodes it is offered the fastest
 * plan_offer() of them first, and all (at most NL_PLAN_MAX_NODES) only
 * when those cannot hold the model (plan_layers). */
static int plan_offer(const nl_coord *c)
{
    const int k = 4 * c->cfg.num_layers;
    return k < 64 ? 64 : k;
}

/* The live nodes as the planner sees them; returns how many, and their
 * memory in all. Beyond plan_offer() nodes they are sorted fastest first;
 * at most NL_PLAN_MAX_NODES of them are returned (the others stay
 * standbys). */
static int plan_nodes(const nl_coord *c, nl_plan_node *pn, uint64_t *total)
{
    int n = 0;
    *total = 0;
    for (int i = 0; i < c->n_nodes; i++)
        if (c->nodes[i].life == NODE_LIVE) {
            const double g =
                c->nodes[i].seen_gflops > 0 ? c->nodes[i].seen_gflops : c->nodes[i].gflops;
            pn[n] = (nl_plan_node){(int)c->nodes[i].id, c->nodes[i].memory, g > 0 ? g : 1.0,
                                   hop_seconds(c, &c->nodes[i]), coord_link_bytes_s(&c->nodes[i])};
            *total += c->nodes[i].memory;
            n++;
        }
    if (n > plan_offer(c))
        qsort(pn, (size_t)n, sizeof *pn, faster_first);
    return n < NL_PLAN_MAX_NODES ? n : NL_PLAN_MAX_NODES;
}

/* The microbatches of a step that plans with replicas are for: the
 * training job's while one runs, else --plan-microbatches. */
static int plan_micro(const nl_coord *c)
{
    return c->train_mem.training && c->train_mem.in_flight > 0 ? c->train_mem.in_flight
                                                               : c->o.plan_microbatches;
}

/* Why --replicas auto chose plan p (t seconds a step) of the options
 * tried (every stage R replicas) and the plans grown at their bottleneck
 * (nl_plan_choose_stage_replicas), into why. */
static void auto_why(const nl_coord *c, const nl_plan *p, double t,
                     const nl_plan_replica_option *tried, int n, char *why, size_t cap)
{
    int R = p->stages[0].n_replicas, uneven = 0;
    for (int s = 1; s < p->n_stages; s++)
        uneven |= p->stages[s].n_replicas != R;
    int o = snprintf(why, cap,
                     "neurocoord --replicas auto: the most training tokens/s by the cost model "
                     "for steps of %d microbatches, each replica's pipeline filling once, the "
                     "replicas' all-reduce at the slowest link of a plan's replicas (measured, or "
                     "assumed %.0f GB/s where not); seconds a step (stages x replicas):",
                     plan_micro(c), COORD_LINK_ASSUMED / 1e9);
    for (int k = 0; k < n && o > 0 && (size_t)o < cap; k++) {
        const nl_plan_replica_option *x = &tried[k];
        const char *chosen = !uneven && x->replicas == R ? " (chosen)" : "";
        if (x->stages > 0 && x->replicas > 1)
            o += snprintf(why + o, cap - (size_t)o, " %d x %d %.3f (link %.3g GB/s %s)%s",
                          x->stages, x->replicas, x->step_s, x->link_bytes_s / 1e9,
                          x->link_measured ? "measured" : "assumed", chosen);
        else if (x->stages > 0)
            o += snprintf(why + o, cap - (size_t)o, " %d x %d %.3f%s", x->stages, x->replicas,
                          x->step_s, chosen);
        else
            o += snprintf(why + o, cap - (size_t)o, " R=%d does not place", x->replicas);
        if (k + 1 < n && o > 0 && (size_t)o < cap)
            o += snprintf(why + o, cap - (size_t)o, ",");
    }
    if (uneven && o > 0 && (size_t)o < cap) { /* the slow stages' extra replicas won */
        o += snprintf(why + o, cap - (size_t)o,
                      "; a plan with the nodes it left out given where a step is fastest, "
                      "replicas per stage");
        for (int s = 0; s < p->n_stages && o > 0 && (size_t)o < cap; s++)
            o += snprintf(why + o, cap - (size_t)o, "%s%d", s ? "," : " ", p->stages[s].n_replicas);
        if (o > 0 && (size_t)o < cap)
            snprintf(why + o, cap - (size_t)o, ": %.3f (chosen)", t);
    }
}

/* A plan whose neighbouring stages have different replica counts links
 * them the default way only (ASSIGN.prev_keys, next_endpoints): none of
 * their nodes may accept no inbound connections (the NAT modes pair one
 * replica with one). NL_ERR_UNSUPPORTED naming the node if one does. */
static nl_status fans_reachable(const nl_coord *c, const nl_plan *p, nl_error *err)
{
    const int S = p->n_stages;
    for (int s = 0; S > 1 && s < S; s++) {
        const nl_plan_stage *a = &p->stages[s], *b = &p->stages[(s + 1) % S];
        if (a->n_replicas == b->n_replicas)
            continue;
        for (int k = 0; k < a->n_replicas + b->n_replicas; k++) {
            const int id = k < a->n_replicas ? a->replicas[k] : b->replicas[k - a->n_replicas];
            const cnode *m = coord_node_by_id((nl_coord *)c, (uint32_t)id);
            if (m && m->no_inbound)
                return nl_error_set(err, NL_ERR_UNSUPPORTED,
                                    "plan: stages %d and %d have %d and %d replicas, and node %d "
                                    "accepts no inbound connections: neighbours with different "
                                    "replica counts link the default way only",
                                    s, (s + 1) % S, a->n_replicas, b->n_replicas, id);
        }
    }
    return NL_OK;
}

/* nl_plan_layers over the fastest plan_offer() of pn[0, n) (sorted by
 * plan_nodes), then, if they cannot hold the model, over all n. With
 * replicas, why (may be NULL) says why the plan has them. */
static nl_status plan_layers(const nl_coord *c, nl_plan **out, const nl_plan_node *pn, int n,
                             const nl_plan_opts *po, char *why, size_t cap, nl_error *err)
{
    const int k = plan_offer(c);
    if (why && cap)
        why[0] = '\0';
    if (c->o.replicas > 1) { /* the nodes are grouped by speed: all of them */
        if (why)
            snprintf(why, cap,
                     "neurocoord --replicas %d: the nodes ranked by speed, grouped that many to "
                     "a stage (microbatch i on replica i mod R)",
                     c->o.replicas);
        return nl_plan_layers_replicated(out, &c->cfg, pn, n, po, c->o.replicas, err);
    }
    if (c->o.n_stage_replicas > 0) { /* a count per stage, as given */
        if (why)
            snprintf(why, cap,
                     "neurocoord --replicas with a count per stage: the nodes ranked by speed, "
                     "the fastest to stage 0 (microbatch i on replica i mod R_s of stage s)");
        nl_status st = nl_plan_layers_staged(out, &c->cfg, pn, n, po, c->o.stage_replicas,
                                             c->o.n_stage_replicas, err);
        if (st == NL_OK && (st = fans_reachable(c, *out, err)) != NL_OK)
            nl_plan_destroy(out);
        return st;
    }
    if (c->o.replicas == 0) { /* auto: the cost model's choice (at the measured links) */
        int R = 1, nt = 0;
        nl_plan_replica_option tried[NL_PLAN_MAX_REPLICAS];
        double t = 0.0;
        /* DiLoCo's replica groups need as many replicas on every stage */
        nl_status st = c->o.outer_every > 0
                           ? nl_plan_choose_replicas(out, &R, &t, tried, &nt, &c->cfg, pn, n, po,
                                                     plan_micro(c), COORD_LINK_ASSUMED, err)
                           : nl_plan_choose_stage_replicas(out, &t, tried, &nt, &c->cfg, pn, n, po,
                                                           plan_micro(c), COORD_LINK_ASSUMED, err);
        nl_error e = {0};
        if (st == NL_OK && fans_reachable(c, *out, &e) != NL_OK) { /* as many on every stage */
            NL_WARN("--replicas auto: %s; planning as many replicas on every stage", e.msg);
            nl_plan_destroy(out);
            st = nl_plan_choose_replicas(out, &R, &t, tried, &nt, &c->cfg, pn, n, po, plan_micro(c),
                                         COORD_LINK_ASSUMED, err);
        }
        if (st == NL_OK && why)
            auto_why(c, *out, t, tried, nt, why, cap);
        return st;
    }
    if (n > k && nl_plan_layers(out, &c->cfg, pn, k, po, err) == NL_OK)
        return NL_OK;
    return nl_plan_layers(out, &c->cfg, pn, n, po, err);
}

/* Plans are for inference memory, but while a training job runs for its
 * training memory (c->train_mem: weights, gradients, moments and the
 * microbatches in flight, core/model/memory.h). */
static nl_plan_opts request_opts(const nl_coord *c)
{
    return (nl_plan_opts){.mem = {.training = 0, .micro_rows = c->o.plan_rows, .in_flight = 1}};
}

static nl_plan_opts plan_opts(const nl_coord *c)
{
    if (c->train_mem.training)
        return (nl_plan_opts){.mem = c->train_mem};
    return request_opts(c);
}

double coord_stage_request_s(nl_coord *c, int s)
{
    const nl_plan_stage *ps = &c->plan->stages[s];
    const cnode *n = coord_stage_node(c, s);
    const double g = !n ? 0 : n->seen_gflops > 0 ? n->seen_gflops : n->gflops;
    if (g <= 0)
        return ps->seconds;
    const nl_plan_opts po = request_opts(c);
    const nl_plan_node nd = {(int)n->id, n->memory, g, hop_seconds(c, n), coord_link_bytes_s(n)};
    return nl_plan_stage_seconds(&c->cfg, &po, &nd, ps->l1 - ps->l0, s, c->plan->n_stages);
}

double coord_plan_request_s(nl_coord *c)
{
    double worst = 0;
    for (int s = 0; c->plan && s < c->plan->n_stages; s++) {
        const double t = coord_stage_request_s(c, s);
        worst = t > worst ? t : worst;
    }
    return worst;
}

int coord_plan_holds(const nl_coord *c, const nl_mem_opts *mo, char *why, size_t cap)
{
    const int S = c->plan ? c->plan->n_stages : 0;
    for (int s = 0; s < S; s++) {
        const nl_plan_stage *ps = &c->plan->stages[s];
        const cnode *n = coord_stage_node((nl_coord *)c, s);
        nl_mem_opts o = *mo;
        /* the microbatches the node keeps in flight (o.in_flight: a step's) */
        if (o.training)
            o.in_flight = nl_mem_train_slots(S - 1 - s, o.in_flight, o.in_flight_extra);
        const nl_mem_estimate me =
            nl_memory_estimate(&c->cfg, ps->l1 - ps->l0, ps->has_embed, ps->has_head, &o);
        if (n && me.total > n->memory) {
            snprintf(why, cap,
                     "stage %d (node %u, layers [%d, %d)) needs %llu bytes for training but the "
                     "node offers %llu: %llu bytes short",
                     s, n->id, ps->l0, ps->l1, (unsigned long long)me.total,
                     (unsigned long long)n->memory, (unsigned long long)(me.total - n->memory));
            return 0;
        }
    }
    return 1;
}

/* Log a plan, each stage and standby, as `what` (its epoch, or "old"). */
static void log_plan(const nl_coord *c, const nl_plan *plan, const char *what)
{
    for (int s = 0; s < plan->n_stages; s++) {
        const nl_plan_stage *g = &plan->stages[s];
        char reps[16 * NL_PLAN_MAX_REPLICAS] = "";
        for (int r = 1, o = 0; r < g->n_replicas && o < (int)sizeof reps; r++)
            o += snprintf(reps + o, sizeof reps - (size_t)o, "%s%d",
                          r > 1 ? ", " : " (replicas on ", g->replicas[r]);
        NL_INFO("plan %s: stage %d on node %d%s%s: layers [%d, %d)%s%s, %.1f MiB, %.2f ms", what, s,
                g->node_id, reps, reps[0] ? ")" : "", g->l0, g->l1, g->has_embed ? " +embed" : "",
                g->has_head ? " +head" : "", (double)g->bytes / (1 << 20), g->seconds * 1e3);
    }
    for (int i = 0; i < plan->n_standby; i++)
        NL_INFO("plan %s: node %d is a standby", what, plan->standby[i]);
    (void)c;
}

/* The live nodes as the planner sees them, in a new array (NULL: out of
 * memory); *n how many, *total their memory. */
static nl_plan_node *plan_nodes_new(const nl_coord *c, int *n, uint64_t *total)
{
    nl_plan_node *pn = malloc((size_t)(c->n_nodes ? c->n_nodes : 1) * sizeof *pn);
    *n = pn ? plan_nodes(c, pn, total) : 0;
    return pn;
}

double coord_link_plan_now(nl_coord *c, int *measured)
{
    int n = 0;
    uint64_t total = 0;
    nl_plan_node *pn = plan_nodes_new(c, &n, &total); /* NULL: every link assumed */
    const double link = nl_plan_link_bytes_s(c->plan, pn, n, COORD_LINK_ASSUMED, measured);
    free(pn);
    return link;
}

static void plan_over(nl_coord *c, nl_plan_node *pn, int n, uint64_t total);

void coord_try_plan(nl_coord *c)
{
    int n = 0;
    uint64_t total = 0;
    nl_plan_node *pn = plan_nodes_new(c, &n, &total);
    if (!pn)
        coord_set_state(c, "planning: out of memory");
    else
        plan_over(c, pn, n, total);
    free(pn);
}

static void plan_over(nl_coord *c, nl_plan_node *pn, int n, uint64_t total)
{
    nl_error e = {0};
    c->last_plan_try = nl_mono_s();
    /* the minimums gate the first plan; later plans use whoever is left */
    const int live = c->n_live;
    if (!c->planned_once && (live < c->o.min_nodes || total < c->o.min_memory)) {
        coord_set_state(c, "waiting for nodes: %d of %d joined, %.2f of %.2f GiB offered", live,
                        c->o.min_nodes, (double)total / (1 << 30),
                        (double)c->o.min_memory / (1 << 30));
        return;
    }
    nl_plan_opts po = plan_opts(c);
    if (!c->have_cfg) {
        nl_sizing_opts so;
        nl_sizing_opts_init(&so);
        so.plan = po;
        nl_sizing sz;
        if (nl_sizing_choose(&sz, &c->base, pn, n, &so, &e) != NL_OK) {
            coord_set_state(c, "not enough capacity to size a model: %s", e.msg);
            coord_fail_waiting(c, c->state);
            return;
        }
        c->cfg = sz.cfg;
        c->have_cfg = 1;
        NL_INFO("sized the model from %.2f GiB: d=%d L=%d H=%d G=%d F=%d (%s)",
                (double)total / (1 << 30), c->cfg.hidden_dim, c->cfg.num_layers, c->cfg.num_heads,
                c->cfg.num_kv_heads, c->cfg.ffn_dim, sz.report);
    }
    nl_plan *plan = NULL;
    struct timespec cpu0, cpu1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu0);
    const double t0 = nl_mono_s();
    if (plan_layers(c, &plan, pn, n, &po, c->plan_why, sizeof c->plan_why, &e) != NL_OK) {
        coord_set_state(c, "not enough capacity: %s", e.msg);
        coord_fail_waiting(c, c->state);
        return;
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu1);
    NL_INFO("planned over %d live nodes (%d offered to the planner) in %.3f s (%.3f s of CPU)",
            c->n_live, n > plan_offer(c) ? plan_offer(c) : n, nl_mono_s() - t0,
            (double)(cpu1.tv_sec - cpu0.tv_sec) + 1e-9 * (double)(cpu1.tv_nsec - cpu0.tv_nsec));
    c->plan = plan;
    c->plan_link_bytes_s =
        nl_plan_link_bytes_s(plan, pn, n, COORD_LINK_ASSUMED, &c->plan_link_measured);
    c->plan_training = po.mem.training;
    c->planned_once = 1;
    c->replan_wanted = 0; /* this plan saw every node there is */
    c->epoch++;
    char *cfg_json = nl_config_to_json(&c->cfg), epoch[32];
    for (int s = 0; s < plan->n_stages; s++)
        for (int r = 0; r < coord_stage_replicas(c, s); r++) {
            cnode *node = coord_stage_replica(c, s, r);
            node->stage = s;
            node->replica = r;
            node->loaded = 0;
            node->plan_gflops = node->seen_gflops > 0 ? node->seen_gflops : node->gflops;
        }
    snprintf(epoch, sizeof epoch, "%llu", (unsigned long long)c->epoch);
    log_plan(c, plan, epoch);
    const int relay_port = coord_relay_plan(c); /* before the ASSIGNs: it admits their keys */
    for (int s = 0; s < plan->n_stages && cfg_json; s++)
        for (int r = 0; r < coord_stage_replicas(c, s); r++)
            coord_send_assign(c, s, r, cfg_json, relay_port);
    for (int s = 0; s < plan->n_stages && cfg_json; s++)
        for (int r = 0; r < coord_stage_replicas(c, s); r++)
            start_load(c, s, r);
    coord_stream_loads(c);
    free(cfg_json);
    coord_set_state(c, "loading %d stages (plan %llu)", plan->n_stages,
                    (unsigned long long)c->epoch);
}

int coord_plan_possible(nl_coord *c, char *why, size_t cap)
{
    uint64_t total = 0;
    nl_error e = {0};
    int n = 0;
    nl_plan_node *pn = plan_nodes_new(c, &n, &total);
    nl_plan_opts po = plan_opts(c);
    nl_plan *p = NULL;
    const nl_status st = pn ? plan_layers(c, &p, pn, n, &po, NULL, 0, &e)
                            : nl_error_set(&e, NL_ERR_NOMEM, "out of memory");
    nl_plan_destroy(&p);
    free(pn);
    if (st != NL_OK)
        snprintf(why, cap, "%s", e.msg);
    return st == NL_OK;
}

const char *coord_replan_reason(int why)
{
    static const char *const words[8] = {
        "no change",
        "a node joined",
        "a standby node left",
        "nodes joined and left",
        "the stages' measured speeds differ from the plan's",
        "a node joined and the stages' measured speeds differ from the plan's",
        "a standby node left and the stages' measured speeds differ from the plan's",
        "nodes joined and left and the stages' measured speeds differ from the plan's"};
    return words[why & 7];
}

/* What a re-plan compares: without replicas the bottleneck (seconds per
 * microbatch); with them (--replicas R or auto) the seconds of a training
 * step (nl_plan_step_seconds: the pipelines' fill and the all-reduce at
 * the plan's measured link, nl_plan_link_bytes_s), so
 * that plans of different depths and replica counts compare by tokens/s. */
static double plan_cost(const nl_coord *c, const nl_plan *p, const nl_plan_opts *po,
                        const nl_plan_node *pn, int n)
{
    if (c->o.replicas == 1)
        return p->bottleneck;
    const double link = nl_plan_link_bytes_s(p, pn, n, COORD_LINK_ASSUMED, NULL);
    return nl_plan_step_seconds(p, &c->cfg, po, plan_micro(c), link);
}

/* The planner's best plan over the live nodes now (*cand, the caller's)
 * and its cost (*now), and the current split's cost at the nodes' figures
 * now (*was) by the same cost model (the plan may have been made for
 * inference; observed speeds may have changed the figures):
 * nl_plan_stage_seconds, the planner's formula, a stage's slowest replica
 * over its replicas. 0 with why set to the best plan's reason (with
 * replicas; else empty), or -1 with why saying why there is no plan. */
static int best_and_current(nl_coord *c, nl_plan **cand, double *now, double *was, int *nodes,
                            char *why, size_t cap)
{
    uint64_t total = 0;
    nl_error e = {0};
    int n = 0;
    nl_plan_node *pn = plan_nodes_new(c, &n, &total);
    nl_plan_opts po = plan_opts(c);
    *nodes = n;
    *cand = NULL;
    if (!pn || plan_layers(c, cand, pn, n, &po, why, cap, &e) != NL_OK) {
        snprintf(why, cap, "%s", pn ? e.msg : "out of memory");
        free(pn);
        return -1;
    }
    /* the current plan at the figures now: each stage's time and the worst */
    nl_plan cur = *c->plan;
    if (!(cur.stages = malloc((size_t)cur.n_stages * sizeof *cur.stages))) {
        snprintf(why, cap, "out of memory");
        nl_plan_destroy(cand);
        free(pn);
        return -1;
    }
    memcpy(cur.stages, c->plan->stages, (size_t)cur.n_stages * sizeof *cur.stages);
    double worst = 0;
    for (int s = 0; s < c->plan->n_stages; s++) {
        const nl_plan_stage *ps = &c->plan->stages[s];
        const int R = ps->n_replicas > 1 ? ps->n_replicas : 1;
        double t = 0;
        for (int r = 0; r < R; r++) {
            const int id = R > 1 ? ps->replicas[r] : ps->node_id;
            const nl_plan_node *nd = NULL;
            for (int i = 0; i < n && !nd; i++)
                if (pn[i].id == id)
                    nd = &pn[i];
            const double tr = nd ? nl_plan_stage_seconds(&c->cfg, &po, nd, ps->l1 - ps->l0, s,
                                                         c->plan->n_stages) /
                                       R
                                 : ps->seconds;
            t = tr > t ? tr : t;
        }
        cur.stages[s].seconds = t;
        worst = t > worst ? t : worst;
    }
    cur.bottleneck = worst;
    *was = plan_cost(c, &cur, &po, pn, n);
    *now = plan_cost(c, *cand, &po, pn, n);
    free(cur.stages);
    free(pn);
    return 0;
}

int coord_replan_worth(nl_coord *c)
{
    if (!c->replan_wanted || !c->plan || !c->have_cfg)
        return 0;
    nl_plan *cand = NULL;
    double was = 0, now = 0;
    int n = 0;
    char why[sizeof c->plan_why];
    const int worth = best_and_current(c, &cand, &now, &was, &n, why, sizeof why) == 0 &&
                      now < was * (1.0 - c->o.replan_margin);
    nl_plan_destroy(&cand);
    return worth;
}

/* --replicas auto judged the plan again (with the links measured since,
 * coord_link.c) and it stays: the status says so, with the costs as they
 * are now, the best of them marked "best", not "chosen". */
static void stays_why(nl_coord *c, const char *best, double was, double now)
{
    char *at = strstr(best, " (chosen)");
    if (c->o.replicas != 0 || !c->plan || !at)
        return;
    snprintf(c->plan_why, sizeof c->plan_why,
             "%.*s (best)%s; re-judged at the links measured since: the plan stays %d x %d, "
             "%.3f s a step against the best's %.3f, not better by --replan-margin %.2f",
             (int)(at - best), best, at + strlen(" (chosen)"), c->plan->n_stages,
             coord_stage_replicas(c, 0), was, now, c->o.replan_margin);
}

int coord_replan_gain(nl_coord *c, const char *when)
{
    if (!c->replan_wanted || !c->plan || !c->have_cfg)
        return 0;
    c->replan_why = c->replan_wanted;
    c->replan_wanted = 0;
    nl_plan *cand = NULL;
    double was = 0, now = 0;
    int n = 0, gain = 0;
    char why[sizeof c->plan_why];
    if (best_and_current(c, &cand, &now, &was, &n, why, sizeof why) != 0) {
        NL_INFO("re-plan %s: no plan over the %d nodes: %s", when, n, why);
        return 0;
    }
    /* with replicas the cost is a training step's time (plan_cost) */
    const char *what = c->o.replicas == 1 ? "bottleneck" : "training step";
    if (!(now < was * (1.0 - c->o.replan_margin))) {
        NL_INFO("re-plan %s: the plan stays (%s %.2f ms; %d nodes would give %.2f ms, "
                "not better by --replan-margin %.2f)",
                when, what, was * 1e3, n, now * 1e3, c->o.replan_margin);
        stays_why(c, why, was, now);
        /* the links as judged: a later measurement is weighed against them */
        c->plan_link_bytes_s = coord_link_plan_now(c, &c->plan_link_measured);
    } else if (c->stages_modified) {
        NL_WARN("re-plan %s: %d nodes would give a %s of %.2f ms instead of %.2f ms, "
                "but the stages hold weights trained since the last checkpoint; the plan stays",
                when, n, what, now * 1e3, was * 1e3);
    } else {
        NL_INFO("re-plan %s: %s %.2f ms -> %.2f ms over %d nodes (--replan-margin "
                "%.2f); the stages reload from %s",
                when, what, was * 1e3, now * 1e3, n, c->o.replan_margin,
                c->src_path[0] ? c->src_path : "the seed");
        log_plan(c, c->plan, "old");
        log_plan(c, cand, "new");
        gain = 1;
    }
    nl_plan_destroy(&cand);
    return gain;
}

/* A node joined or a standby left (replan_wanted) and the cluster is at
 * rest (ready, no job): plan again over the nodes there are now when the
 * planner predicts a bottleneck better by --replan-margin (hysteresis);
 * the stages then reload from the source (the checkpoint or the last
 * manifest). Not while the stages hold trained weights that no checkpoint
 * has: a reload would lose them. (During a training job the job asks at
 * its next checkpoint: coord_train.c.) */
void coord_replan_at_rest(nl_coord *c)
{
    if (!c->replan_wanted || !c->ready || !c->plan || !c->have_cfg)
        return;
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE)
            return; /* at the end of the job */
    if (coord_replan_gain(c, "at rest"))
        coord_reload(c);
}

void coord_on_load_done(nl_coord *c, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid(c, rx);
    if (!n || rx->msg.u.load_done.epoch != c->epoch || n->stage < 0)
        return; /* a stale plan's answer */
    n->loaded = 1;
    coord_jobs_touch(c);
    NL_INFO("node %u loaded stage %d: %u tensors, %.1f MiB", n->id, n->stage,
            rx->msg.u.load_done.tensors, (double)rx->msg.u.load_done.bytes / (1 << 20));
    for (int s = 0; s < c->plan->n_stages; s++)
        for (int r = 0; r < coord_stage_replicas(c, s); r++) {
            cnode *m = coord_stage_replica(c, s, r);
            if (!m || !m->loaded)
                return;
        }
    c->ready = 1;
    coord_observe_restart(c);       /* what the nodes did on another plan says nothing */
    c->stages_modified = 0;         /* they hold the source's weights */
    c->resumable = c->src_manifest; /* the stages hold the manifest's weights and moments */
    c->weights_job = c->src_job;
    c->weights_step = c->src_step;
    coord_set_state(c, "ready: %d stages, bottleneck %.2f ms per request (plan %llu)",
                    c->plan->n_stages, coord_plan_request_s(c) * 1e3, (unsigned long long)c->epoch);
    coord_jobs_ready(c);
}
