/* The coordinator's ASSIGN of a plan's stage replica (coord_plan.c plans
 * and loads): its layers, its neighbours and who dials whom (the NAT
 * modes, docs/ARCHITECTURE.md "Nodes behind NAT"), the stage's ring of
 * replicas, and a neighbour stage with another replica count (DESIGN
 * section 8, microbatch i on replica i mod R_s): every replica of it. */
#include "coordinator/coord_impl.h"

#include <stdio.h>
#include <string.h>

#include "base/log.h"

/* The keys (or data endpoints) of a stage's replicas in replica order,
 * comma-separated (ASSIGN.prev_keys, next_keys, next_endpoints). */
static void replica_list(nl_coord *c, int stage, bool endpoints, char *out, size_t cap)
{
    size_t o = 0;
    out[0] = '\0';
    for (int r = 0; r < coord_stage_replicas(c, stage) && o < cap; r++) {
        const cnode *m = coord_stage_replica(c, stage, r);
        const int w = snprintf(out + o, cap - o, "%s%s", r ? "," : "",
                               m ? (endpoints ? m->endpoint : m->key) : "");
        o += w > 0 ? (size_t)w : 0;
    }
}

/* Which side opens the links of node n (ASSIGN.links, net/wire.h): a
 * node that accepts no inbound connection dials its previous stage, and
 * that stage lets it; two such neighbours both dial the relay
 * (coord_relay.c, at relay_port). Without a relay they have no link: said
 * here, and their first hop fails. */
static uint32_t assign_links(const cnode *n, const cnode *prev, const cnode *next, int stage,
                             int relay_port)
{
    uint32_t links = 0;
    if (prev && n->no_inbound) {
        if (!prev->no_inbound)
            links |= NL_LINK_DIAL_PREV;
        else if (relay_port)
            links |= NL_LINK_RELAY_PREV;
        else
            NL_ERROR("stage %d: node %u and the previous stage's node %u both accept no inbound "
                     "connections, and no relay joins them: their hops cannot pass",
                     stage, n->id, prev->id);
    }
    if (next && next->no_inbound)
        links |= !n->no_inbound ? NL_LINK_NEXT_DIALS : relay_port ? NL_LINK_RELAY_NEXT : 0;
    return links;
}

/* Replica r of a stage next to one with as many replicas (or replica 0). */
static cnode *neighbour(nl_coord *c, int stage, int r)
{
    cnode *n = coord_stage_replica(c, stage, r);
    return n ? n : coord_stage_node(c, stage);
}

void coord_send_assign(nl_coord *c, int stage, int r, const char *cfg_json, int relay_port)
{
    const nl_plan_stage *s = &c->plan->stages[stage];
    /* the stages make a ring: the last stage sends the tokens it samples
     * straight to the first (a single stage feeds itself) */
    const int ns = c->plan->n_stages, R = coord_stage_replicas(c, stage);
    const int ps = (stage + ns - 1) % ns, nx = (stage + 1) % ns;
    /* a neighbour with another replica count: all its replicas (a fan) */
    const bool fan_prev = ns > 1 && coord_stage_replicas(c, ps) != R,
               fan_next = ns > 1 && coord_stage_replicas(c, nx) != R;
    cnode *n = coord_stage_replica(c, stage, r),
          *prev = ns > 1 ? neighbour(c, ps, fan_prev ? 0 : r) : NULL,
          *next = ns > 1 ? neighbour(c, nx, fan_next ? 0 : r) : NULL,
          *ring = R > 1 ? coord_stage_replica(c, stage, (r + 1) % R) : NULL,
          *ring_prev = R > 1 ? coord_stage_replica(c, stage, (r + R - 1) % R) : NULL;
    char prev_keys[NL_WIRE_PEER_KEYS_MAX + 1] = "", next_keys[NL_WIRE_PEER_KEYS_MAX + 1] = "",
                                           next_eps[NL_WIRE_PEER_EPS_MAX + 1] = "";
    if (fan_prev)
        replica_list(c, ps, false, prev_keys, sizeof prev_keys);
    if (fan_next) {
        replica_list(c, nx, false, next_keys, sizeof next_keys);
        replica_list(c, nx, true, next_eps, sizeof next_eps);
    }
    if (!n)
        return;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_ASSIGN);
    m.u.assign = (nl_msg_assign){.epoch = c->epoch,
                                 .node_id = n->id,
                                 .stage = (uint32_t)stage,
                                 .num_stages = (uint32_t)c->plan->n_stages,
                                 .layer0 = (uint32_t)s->l0,
                                 .layer1 = (uint32_t)s->l1,
                                 .has_embed = s->has_embed,
                                 .has_head = s->has_head,
                                 .config_json = cfg_json,
                                 .seed = c->o.seed,
                                 .prev_endpoint = prev ? prev->endpoint : "",
                                 .prev_key = prev ? prev->key : "",
                                 .next_endpoint = next ? next->endpoint : "",
                                 .next_key = next ? next->key : "",
                                 .memory_planned = s->bytes,
                                 .wire = (uint32_t)c->o.wire,
                                 .links = assign_links(n, prev, next, stage, relay_port),
                                 .replica = (uint32_t)r,
                                 .replicas = (uint32_t)R,
                                 .ring_endpoint = ring ? ring->endpoint : "",
                                 .ring_key = ring ? ring->key : "",
                                 .ring_prev_key = ring_prev ? ring_prev->key : "",
                                 .prev_keys = prev_keys,
                                 .next_endpoints = next_eps,
                                 .next_keys = next_keys};
    if ((fan_prev || fan_next) && m.u.assign.links) { /* coord_plan_fans refused such a plan */
        NL_ERROR("stage %d replica %d: a neighbour with another replica count and a node that "
                 "accepts no inbound connections: their hops cannot pass",
                 stage, r);
        m.u.assign.links = 0;
        m.u.assign.relay_port = 0;
    }
    if (m.u.assign.links & (NL_LINK_RELAY_PREV | NL_LINK_RELAY_NEXT))
        m.u.assign.relay_port = (uint32_t)relay_port;
    coord_send_node(c, n, &m);
    nl_wire_msg_free(&m);
}
