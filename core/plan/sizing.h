/* Sizing: choose the model's architecture from the memory the nodes offer.
 *
 * The seed rule (DESIGN.md section 3) is the anchor: for GB = the nodes'
 * total memory in GiB, width d = 256 sqrt(GB / 10) rounded to a multiple
 * of 64 (at least 64), depth L = 8 log2(GB / 10 + 1) rounded and clamped
 * to [8, 64], heads H = d / 128 (at least 1; moved to the nearest count
 * that divides d with an even head_dim <= 256), kv heads G = the largest
 * divisor of H that is <= max(1, H / 4). It ignores the experts and the
 * optimizer state.
 *
 * nl_sizing_choose starts from the seed's shape and shrinks it until the
 * memory model places it: some plan (core/plan/planner.h, training with the
 * options' micro rows and in-flight microbatches) fits every node's
 * memory less a headroom fraction. Depth shrinks first (down to 8), then
 * width in steps of 64 with the depth back at the seed's; at width 64 the
 * depth may go down to 1. F = 4 d; E, top_k, the vocabulary and the rest
 * come from the base config. The result is the largest shape in that
 * order that fits: one layer more (or, when the width shrank, 64 wider at
 * depth 8) does not.
 *
 * Hysteresis: architecture changes only when the parameter count moves
 * by more than a factor (1.3 by default); once a model exists its width
 * is fixed and only depth (nl_sizing_propose_depth) and the vocabulary
 * change live. All functions are pure. */
#ifndef NL_SIZING_H
#define NL_SIZING_H

#include <stdint.h>

#include "core/model/config.h"
#include "core/plan/planner.h"

#define NL_SIZING_MIN_DEPTH 8
#define NL_SIZING_MAX_DEPTH 64

typedef struct nl_sizing_opts {
    nl_plan_opts plan; /* memory model options: training, micro_rows, in_flight, recompute */
    double headroom;   /* fraction of each node's memory left free, in [0, 1) */
    double factor;     /* hysteresis factor on parameter counts, > 1 */
} nl_sizing_opts;

/* Training, micro_rows 2048, in_flight 0 (1F1B: S - s), no recompute,
 * headroom 0.10, factor 1.3. */
void nl_sizing_opts_init(nl_sizing_opts *o);

typedef struct nl_sizing {
    nl_config cfg;         /* the chosen architecture */
    nl_config seed;        /* the seed rule's for the same total memory */
    uint64_t total_bytes;  /* offered by the nodes */
    uint64_t usable_bytes; /* after the headroom */
    uint64_t need_bytes;   /* chosen: the memory model summed over its plan */
    int stages;            /* stages of that plan */
    char report[768];      /* where and why the choice differs from the seed */
} nl_sizing;

/* The seed rule's shape for total_bytes, other keys from base. */
void nl_sizing_seed(nl_config *out, const nl_config *base, uint64_t total_bytes);

/* Size a new model for these nodes. base gives the vocabulary, experts,
 * top_k, max_seq_len and the other unsized keys (nl_config_init defaults
 * where unset). NL_ERR_CAPACITY with the shortfall when not even width
 * 64 with one layer fits. */
nl_status nl_sizing_choose(nl_sizing *out, const nl_config *base, const nl_plan_node *nodes,
                           int n_nodes, const nl_sizing_opts *o, nl_error *err);

/* For an existing model: the same config with only the depth changed to
 * the deepest that fits, at most max(the seed depth, the current depth);
 * shallower than now only when the current depth no longer fits. */
nl_status nl_sizing_propose_depth(nl_sizing *out, const nl_config *current,
                                  const nl_plan_node *nodes, int n_nodes, const nl_sizing_opts *o,
                                  nl_error *err);

/* 1 when proposed should replace current: their parameter counts (both at
 * current's vocabulary, so vocabulary growth never counts) differ by more
 * than `factor` (<= 1: the default 1.3) either way, or current is unsized. */
int nl_sizing_should_change(const nl_config *current, const nl_config *proposed, double factor);

#endif
