/* The layer planner: place a sized model's layers on heterogeneous nodes
 * as contiguous stages, each within its node's memory by the memory model
 * (core/model/memory.h), minimising the slowest stage's time per microbatch.
 *
 * Cost model (one microbatch of micro_rows rows through one stage):
 *   work    = n_layers * layer_flops (+ embed_flops on the first stage)
 *             (+ head_flops on the last), each the forward's matrix FLOPs
 *             (nl_config_forward_flops split by part) times 3 when
 *             training (forward + two backward GEMMs), layers times 4
 *             with recompute (one more forward);
 *   seconds = work / (gflops * 1e9) + hops * hop_seconds, where hops
 *             counts the transfers the stage sends: to the next stage
 *             (all but the last) and, when training, the gradients back
 *             to the previous one (all but the first).
 * Memory of stage s of S: nl_memory_estimate of its layers and tables;
 * when training, 1F1B keeps min(M, S - s) microbatches in flight there,
 * M = mem.in_flight (the microbatches of a step; 0: no cap, S - s).
 *
 * Algorithm. Every stage holds at least one layer, so S <= min(N, L).
 * The smallest bottleneck B is found by bisection over the bit patterns
 * of doubles with a feasibility test "is there a plan whose every stage
 * takes <= B seconds and fits its node". The test walks the pipeline
 * from its end: every layer costs the same, so for a fixed sequence of
 * nodes it is greedy: each stage after the first takes as many layers as
 * its time, its memory and one layer left for the first stage allow, and
 * the first stage must hold the rest. Taking more never hurts the stages
 * in front (their cost and memory only grow with their layer count, and
 * their in-flight count S - s = 1 + stages behind them is fixed by the
 * walk), so the greedy covers [0, L) whenever any split of any sub-
 * sequence of those nodes does. A DP keeps, per number r of stages
 * behind, the most layers covered, which gives every S at once:
 *   - exact (N <= max_exact_nodes, default NL_PLAN_EXACT_MAX = 16): the
 *     DP runs over subsets, best[mask] = most layers the nodes of mask
 *     cover as the last popcount(mask) stages in any order, so every
 *     ordered subset of nodes and every split is covered: the bottleneck
 *     is the optimum of the cost model (within the tie rule below). Cost
 *     O(2^N N) per test, about 130 tests: 0.15 s for 16 nodes, 1.7 s
 *     for 20 (the limit).
 *   - heuristic (more nodes): the same DP along a fixed order in which
 *     nodes may be skipped (left standby), exact for that order, tried
 *     for seven orders (throughput or memory, descending, ascending, or
 *     "heavy ends": the largest first, the next last, ...; and the input
 *     order); then pairs of nodes in the best order are swapped while
 *     that lowers the bottleneck, within a budget of about 4e7 DP cells.
 *     No bound against the optimum is proven; on 5000 random cases of up
 *     to 6 nodes it was optimal in 3944 of 3955 feasible ones, worst
 *     1.054x. Cost O(N min(N, L)) per test and order: 0.5 s for 1024
 *     nodes and 64 layers.
 * The bisection finds the smallest double B that is feasible; the optimum
 * is the time of some stage, a double, so the result is that optimum.
 *
 * Ties: among plans within a relative 1e-9 of the smallest bottleneck the
 * one with the fewest stages (fewest hops) wins, with its own smallest
 * bottleneck; spare nodes then stay standby even when they are fast
 * because adding them does not lower the bottleneck. Further ties go to
 * the first plan the DP meets (exact: lowest node mask, lowest node
 * index; heuristic: the first order). The greedy split puts as many
 * layers as fit the bottleneck on the later stages; the first stage
 * (which keeps the most microbatches in flight) gets the rest.
 *
 * Ownership: nl_plan_layers returns a plan the caller frees with
 * nl_plan_destroy(&p). Everything else is pure. */
#ifndef NL_PLANNER_H
#define NL_PLANNER_H

#include <stddef.h>
#include <stdint.h>

#include "core/model/config.h"
#include "core/model/memory.h"

/* Largest node list accepted, and the largest exact search allowed. */
#define NL_PLAN_MAX_NODES 1024
#define NL_PLAN_EXACT_MAX 16
#define NL_PLAN_EXACT_LIMIT 20
/* Most replicas of one stage (DESIGN section 8). */
#define NL_PLAN_MAX_REPLICAS 16

typedef struct nl_plan_node {
    int id;                /* the caller's name for the node; unique */
    uint64_t memory_bytes; /* memory the node offers */
    double gflops;         /* measured GEMM throughput, > 0 */
    double hop_seconds;    /* to ship one microbatch's activations onward, >= 0 */
    double link_bytes_s;   /* its replicas' all-reduce as measured, bytes/s, >= 0;
                              0: not measured (the caller's assumed speed) */
} nl_plan_node;

typedef struct nl_plan_opts {
    nl_mem_opts mem;     /* training or inference, micro_rows, in_flight (M), ... */
    int seq_len;         /* positions per sequence for the attention cost;
                            0: min(micro_rows, max_seq_len) */
    int max_exact_nodes; /* exact search up to this many nodes; 0: NL_PLAN_EXACT_MAX */
} nl_plan_opts;

typedef struct nl_plan_stage {
    int node_id; /* replica 0's node: the one that writes the shard */
    /* DESIGN section 8: the stage's replicas, replica r on node
     * replicas[r] (replicas[0] == node_id); microbatch i of a step runs on
     * replica i mod n_replicas. nl_plan_layers makes n_replicas = 1;
     * nl_plan_layers_staged and nl_plan_choose_stage_replicas may give
     * stages different counts. */
    int n_replicas;
    int replicas[NL_PLAN_MAX_REPLICAS];
    int l0, l1;     /* layers [l0, l1) */
    int has_embed;  /* first stage */
    int has_head;   /* last stage: final norm and head */
    int in_flight;  /* training: microbatches kept (1F1B) */
    uint64_t bytes; /* predicted: nl_memory_estimate total */
    double seconds; /* predicted time per microbatch (with replicas: the
                       slowest replica's over n_replicas) */
} nl_plan_stage;

typedef struct nl_plan {
    int n_stages;
    nl_plan_stage *stages; /* in pipeline order */
    int n_standby;
    int *standby;      /* ids of the nodes left out, in input order */
    double bottleneck; /* seconds per microbatch of the slowest stage */
    int exact;         /* 1: the search was exhaustive (see above) */
} nl_plan;

/* Place cfg (validated with require_size) on the nodes. Errors:
 * NL_ERR_INVALID for a bad node (gflops <= 0, duplicate id, ...) or
 * option; NL_ERR_CAPACITY when nothing fits, with a message saying why
 * and how many bytes more are needed; NL_ERR_NOMEM. */
nl_status nl_plan_layers(nl_plan **out, const nl_config *cfg, const nl_plan_node *nodes,
                         int n_nodes, const nl_plan_opts *opts, nl_error *err);
void nl_plan_destroy(nl_plan **p);

/* A plan whose every stage has `replicas` replicas (core/plan/planner_replicas.c).
 * The nodes are ranked by throughput (then memory, then input order) and
 * cut into groups of `replicas` consecutive ones; each group plans as one
 * node with its smallest memory and `replicas` times its slowest member's
 * throughput (each replica runs 1/replicas of the microbatches), and
 * nl_plan_layers places the groups. A stage on a group gets its nodes as
 * replicas, fastest first; the nodes of unused groups and the n_nodes mod
 * replicas slowest ones stay standby (in input order). The replicas'
 * all-reduce is not in the cost model. replicas = 1 is nl_plan_layers.
 * Errors as nl_plan_layers; NL_ERR_INVALID for replicas outside
 * [1, NL_PLAN_MAX_REPLICAS]; NL_ERR_CAPACITY for fewer nodes than
 * replicas, or groups that cannot hold the model. */
nl_status nl_plan_layers_replicated(nl_plan **out, const nl_config *cfg, const nl_plan_node *nodes,
                                    int n_nodes, const nl_plan_opts *opts, int replicas,
                                    nl_error *err);

/* One R that nl_plan_choose_replicas tried: its plan's stages (0: no plan
 * places with R replicas a stage), predicted seconds a step, and the link
 * speed its all-reduce was costed at (nl_plan_link_bytes_s; R = 1: none). */
typedef struct nl_plan_replica_option {
    int replicas, stages;
    double step_s;
    double link_bytes_s; /* bytes/s */
    int link_measured;   /* 1: a node's measurement; 0: the assumed speed */
} nl_plan_replica_option;

/* The replicas per stage that give the most training tokens/s (issue 30;
 * core/plan/planner_replicas.c): for each R = 1 .. min(n_nodes,
 * NL_PLAN_MAX_REPLICAS) that divides `microbatches` (M), the plan of
 * nl_plan_layers_replicated, whose step takes nl_plan_step_seconds, and
 * the R with the fewest seconds per step wins (ties: the fewer replicas).
 * Each plan's all-reduce is costed at its slowest replica's link
 * (nl_plan_link_bytes_s: a node's link_bytes_s where measured, else
 * link_bytes_per_s, the speed assumed for a node never measured).
 * *out gets its plan, *replicas its R, *step_s (may be NULL) its seconds
 * per step; tried (may be NULL; room for NL_PLAN_MAX_REPLICAS) every R
 * tried in order, *n_tried how many (why the choice: neurocoord's status).
 * Errors as nl_plan_layers when no R places. */
nl_status nl_plan_choose_replicas(nl_plan **out, int *replicas, double *step_s,
                                  nl_plan_replica_option *tried, int *n_tried, const nl_config *cfg,
                                  const nl_plan_node *nodes, int n_nodes, const nl_plan_opts *opts,
                                  int microbatches, double link_bytes_per_s, nl_error *err);

/* The seconds of a training step of M microbatches on plan p, R_s =
 * p->stages[s].n_replicas, t_s = p->stages[s].seconds (a stage's time a
 * microbatch over its replicas), so t_s R_s is one microbatch on one
 * replica:
 *   max_s ceil(M / R_s) R_s t_s    (the busiest replica's microbatches)
 *   + (S - 1) max_s R_s t_s        (the pipeline fills once)
 *   + max_s 2 (R_s - 1) / R_s W_s / link_bytes_per_s
 *                                   (each stage's ring all-reduce of its
 *                                    gradients, W_s bytes; 0 link: free)
 * With R replicas on every stage: (ceil(M / R) + S - 1) R bottleneck plus
 * the largest stage's all-reduce. */
double nl_plan_step_seconds(const nl_plan *p, const nl_config *cfg, const nl_plan_opts *opts,
                            int microbatches, double link_bytes_per_s);

/* A plan of n_stages stages, stage s on reps[s] nodes (DESIGN section 8:
 * microbatch i of a step on replica i mod reps[s] of stage s). The nodes
 * are ranked by throughput (then memory, then input order) and handed out
 * in pipeline order, the fastest to stage 0; each stage plans as one node
 * with its smallest memory and reps[s] times its slowest member's
 * throughput, and the layers are split over the stages in that order to
 * the smallest bottleneck (every stage at least one layer; a DP, exact
 * for the fixed order). Nodes left over stay standby (input order).
 * Errors as nl_plan_layers; NL_ERR_INVALID for a count outside [1,
 * NL_PLAN_MAX_REPLICAS]; NL_ERR_CAPACITY for fewer nodes than replicas
 * in all, or stages that cannot hold the model. */
nl_status nl_plan_layers_staged(nl_plan **out, const nl_config *cfg, const nl_plan_node *nodes,
                                int n_nodes, const nl_plan_opts *opts, const int *reps,
                                int n_stages, nl_error *err);

/* The plan with a replica count per stage that gives the most training
 * tokens/s by nl_plan_step_seconds (issue 30): the best plan of
 * nl_plan_choose_replicas (every stage R replicas; tried and n_tried as
 * there), against plans grown from others: every plan nl_plan_choose_
 * replicas placed (the chosen one first; R = 1 is nl_plan_layers over all
 * the nodes), then nl_plan_layers over the k fastest (k < n_nodes, k <=
 * NL_PLAN_EXACT_MAX), each grown the same way: the nodes the plan leaves
 * out, fastest first, go to the stage where they make a step fastest
 * (every stage tried, its bottleneck first, which keeps a tie; as many at
 * a time as make that stage's count divide M; at most
 * NL_PLAN_MAX_REPLICAS), the layers split again over the stages in their
 * order (nl_plan_layers_staged's DP; every replica holds its stage in its
 * memory, so a node too small for the stage cannot join it), while a step
 * gets faster. So a node beside 2 stages x 2 replicas becomes a third
 * replica of one stage, that stage taking more layers, when M is a
 * multiple of 3 and the step gets faster: the slower stage on 10 layers
 * (2 + 3), the first on 8 (3 + 2: the split the extra replica allows
 * there is 2.7% faster). A grown plan wins only when some stages' counts
 * differ and it is faster by more than a relative 1e-9; ties keep the
 * uniform plan. *step_s (may be NULL): the chosen plan's seconds a step. */
nl_status nl_plan_choose_stage_replicas(nl_plan **out, double *step_s,
                                        nl_plan_replica_option *tried, int *n_tried,
                                        const nl_config *cfg, const nl_plan_node *nodes,
                                        int n_nodes, const nl_plan_opts *opts, int microbatches,
                                        double link_bytes_per_s, nl_error *err);

/* The link speed plan p's all-reduce runs at: the slowest link among the
 * nodes that are replicas of its stages (nodes[i].link_bytes_s, or
 * `assumed` for a node with none; a node the list lacks counts as
 * assumed). *measured (may be NULL) = 1 when that slowest figure is a
 * measurement. A plan without replicas: `assumed`, *measured = 0. */
double nl_plan_link_bytes_s(const nl_plan *p, const nl_plan_node *nodes, int n_nodes,
                            double assumed, int *measured);

/* Whether some plan fits the nodes' memory (time ignored): *fits = 1/0.
 * Exact up to max_exact_nodes; above, the heuristic orders (no swap
 * search) may miss a plan that exists, never report one that does not,
 * and agree with nl_plan_layers. Errors only for bad input or NOMEM. */
nl_status nl_plan_fits(const nl_config *cfg, const nl_plan_node *nodes, int n_nodes,
                       const nl_plan_opts *opts, int *fits, nl_error *err);

/* The cost model, as the planner uses it. FLOPs of one forward over
 * `rows` rows in sequences of seq_len positions (no cache): one layer,
 * the final norm and head, the embedding gather (rows * d, a nominal
 * figure for the lookup). L * layer + head == nl_config_forward_flops. */
double nl_plan_layer_flops(const nl_config *cfg, int rows, int seq_len);
double nl_plan_head_flops(const nl_config *cfg, int rows);
double nl_plan_embed_flops(const nl_config *cfg, int rows);

/* Microbatches stage s of S keeps in flight under opts (1 for inference). */
int nl_plan_stage_in_flight(const nl_plan_opts *opts, int stage, int n_stages);
/* Predicted bytes and seconds of stage s of S holding n_layers. */
uint64_t nl_plan_stage_bytes(const nl_config *cfg, const nl_plan_opts *opts, int n_layers,
                             int stage, int n_stages);
double nl_plan_stage_seconds(const nl_config *cfg, const nl_plan_opts *opts,
                             const nl_plan_node *node, int n_layers, int stage, int n_stages);

/* A stage's share of the model as people read it (neuroctl status, the
 * dashboard): "[l0,l1)" for layers l0..l1-1, then "+e" when it holds the
 * token embedding and "+h" the output head, e.g. "[0,3)+e". The one
 * formatter of it: out gets at most cap bytes, NUL included. */
void nl_plan_range_str(char *out, size_t cap, int l0, int l1, int embed, int head);

#endif
