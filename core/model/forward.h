/* The forward pass of one stage (layers [l0, l1) of an nl_model), with an
 * optional KV cache (core/model/kvcache.h) for incremental decoding.
 *
 * A stage that holds the embedding takes token ids; any other stage takes
 * the hidden states (B*T, d) of the stage before it. A stage that holds
 * the head produces logits over the active vocabulary; any other produces
 * hidden states. Activations live in an nl_runstate allocated once for a
 * maximum number of rows; nothing is allocated per call.
 *
 * Ownership: runstates and caches are created by *_new and freed by
 * *_destroy(&p); they borrow the model's backend. */
#ifndef NL_FORWARD_H
#define NL_FORWARD_H

#include "core/model/kvcache.h"
#include "core/model/model.h"

typedef struct nl_runstate nl_runstate;

/* Activations for up to max_rows = B*T rows through the stage. */
nl_status nl_runstate_new(nl_runstate **out, const nl_model *m, int max_rows, nl_error *err);
void nl_runstate_destroy(nl_runstate **rs);

typedef struct nl_forward_args {
    int B, T;
    const int32_t *tokens; /* host (B*T), for a stage with the embedding */
    const float *x_in;     /* device (B*T, d), for any other stage */
    nl_kvcache *kv;        /* NULL: no cache, positions start at 0 */
    int last_only;         /* head: logits for the last position of each sequence only */
    /* host (B*T) document ids of packed rows (DESIGN 6), or NULL; no kv:
     * attention stays inside a document, positions restart for each */
    const int32_t *doc;
    /* head: output the final-normed states (rows, d) instead of logits
     * (embeddings, DESIGN 7) */
    int states;
} nl_forward_args;

/* Run the stage. On success the output is at nl_runstate_output: logits
 * (B*T or B rows with last_only, vocab_size columns) for a stage with the
 * head, else hidden states (B*T, d). *aux_loss (may be NULL) gets the sum
 * over this stage's layers of the load-balancing loss. With a cache, the
 * new positions are appended and kv->len grows by T. */
nl_status nl_forward(nl_model *m, nl_runstate *rs, const nl_forward_args *a, float *aux_loss,
                     nl_error *err);

/* Recorded decode steps (DESIGN: CUDA graphs). On a backend with the
 * graph slots (kernels/backend.h: CUDA, cpu-devsim), a decode step (T 1,
 * with a cache, no adapters, no host routing) is recorded once per key
 * and replayed for every later token: the key is the batch-size bucket
 * B, the cache's buffers and capacity, the input buffer, the head's mode
 * and the model's generation (nl_model), so a growth or a reload (a new
 * model behind the same runstate) records it again. Positions and cache
 * lengths are device values, uploaded before each replay. On by default;
 * NL_GRAPHS=0 or nl_runstate_set_graphs(rs, 0) turns it off (every op
 * queued each step, as on the CPU). A step the backend fails to record
 * runs unrecorded, and the runstate records no more; so does one whose
 * recordings, after 16, were replayed less than twice each on average
 * (keys taking turns: more sessions' caches than the 8 entries kept). */
typedef struct nl_runstate_graph_stats {
    uint64_t captures; /* steps recorded */
    uint64_t replays;  /* steps run from a recording */
    uint64_t failed;   /* recordings the backend refused */
} nl_runstate_graph_stats;

void nl_runstate_set_graphs(nl_runstate *rs, int on);
nl_runstate_graph_stats nl_runstate_graphs(const nl_runstate *rs);

/* Device pointer to the last forward's output and its row width. */
const float *nl_runstate_output(const nl_runstate *rs, int *cols);

#endif
