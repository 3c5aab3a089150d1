/* What the planner's and the sizer's tests share (test_planner.c,
 * test_planner_replicas.c, test_sizing.c): a small model's config,
 * training options, a node, and finding a node by id. Header-only, as
 * check.h is. */
#ifndef NL_TEST_PLANNER_HARNESS_H
#define NL_TEST_PLANNER_HARNESS_H

#include <stdint.h>
#include <string.h>

#include "core/model/config.h"
#include "core/plan/planner.h"

#define MB (1024ULL * 1024ULL)
#define GIB (1024ULL * MB)

/* d=64, one head, 8 experts of F=256, a 256-row table. */
static inline nl_config small_cfg(int L)
{
    nl_config c;
    nl_config_init(&c);
    c.vocab_size = 256;
    c.vocab_chunk = 256;
    c.hidden_dim = 64;
    c.num_layers = L;
    c.max_seq_len = 64;
    nl_config_fill_derived(&c);
    return c;
}

static inline nl_plan_opts train_opts(int micro_rows, int in_flight)
{
    nl_plan_opts o;
    memset(&o, 0, sizeof o);
    o.mem.training = 1;
    o.mem.micro_rows = micro_rows;
    o.mem.in_flight = in_flight;
    o.seq_len = 32;
    return o;
}

static inline nl_plan_node node(int id, uint64_t mem, double gflops, double hop)
{
    nl_plan_node n = {id, mem, gflops, hop, 0.0};
    return n;
}

static inline const nl_plan_node *find_node(const nl_plan_node *nodes, int n, int id)
{
    for (int i = 0; i < n; i++)
        if (nodes[i].id == id)
            return &nodes[i];
    return NULL;
}

#endif
