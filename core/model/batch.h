/* Batched decoding: many independent sequences, each with its own KV
 * cache and position, through one forward pass of a model: a whole one
 * (`neuroctl serve`) or one pipeline stage's layers (node/stage.c), which
 * take hidden states when they lack the embedding and give hidden states
 * when they lack the head.
 *
 * One call takes a list of segments: each is a sequence's next T tokens
 * (T = 1 for a decode step, T = a prefill chunk for a prompt). The rows
 * of every segment share the GEMMs (QKV, output projection, router,
 * experts, head); attention runs per segment with that sequence's cache
 * and `past`, through the backend's ordinary attention slot, except for
 * a run of two or more consecutive segments that decode one position
 * each (T 1; every cache of the call of one type), whose attention is one
 * call over the run (s.kseq / s.vseq: each sequence read from its own
 * cache, its position from the device), one launch a layer in place of
 * one a session, and whose cache writes are one kv_store_seq a layer
 * where the backend has it; a sequence's bits are those of its own
 * calls.
 *
 * Batch invariance: a row's result must not depend on which other rows
 * share its GEMMs, or a seeded generation would give other tokens when
 * others run beside it. The batch runs its GEMMs through the backend's
 * gemm_rows (kernels/backend.h), whose rows come out the same for any M
 * (the CPU: its dot-product kernel, kernels/cpu/cpu_dot.c; CUDA: a
 * GEMV-style kernel, kernels/cuda/cuda_rows.cu), its expert products
 * through gemm_grouped_rows where the backend has one (CUDA; the CPU's
 * grouped GEMM calls gemm), and below NL_BACKEND_FUSED_ROWS rows through
 * the fused decode slots, which compute each row exactly so; an expert
 * group of 1 to 15 rows costs only its own rows (CUDA in bf16 mode has no
 * fused slots: the separate ones, through the same row-invariant
 * products in bf16). A backend without gemm_rows (the CPU in bf16 mode)
 * runs gemm, whose small-M paths are not invariant (oneDNN's bf16 GEMM,
 * assumed, not shown, to compute a row alike for any M >= 16, as its
 * sgemm did on AVX-512; cuBLAS picks algorithms by M), with every GEMM of fewer than
 * NL_BATCH_MIN_ROWS rows padded to that many and the separate slots. Where
 * gemm_rows is fast only at few rows (gemm_rows_few: CUDA), a call of
 * NL_BACKEND_FUSED_ROWS rows or more (a prompt's chunk, or many sessions'
 * decode steps at once) runs gemm and the grouped GEMM instead, at
 * cuBLAS's speed and with rows that may depend on M. Sequences decoded
 * here therefore give the same ids alone or among others (on CUDA: while
 * their steps share calls of fewer than 16 rows). On the CPU and on
 * CUDA nl_forward's gemm runs the gemm_rows kernel below 16 rows, so a
 * decode step (and a prompt of fewer than 16 positions) gives
 * nl_forward's bits here; a longer prompt, which nl_forward reads through
 * the CPU's chain GEMM or cuBLAS, may differ in the last bits.
 *
 * Ownership: nl_batch_new borrows the model (which must outlive the
 * batch) and its backend; caches passed in segments stay the caller's.
 * Not thread-safe: one thread drives a batch. */
#ifndef NL_BATCH_H
#define NL_BATCH_H

#include "core/model/forward.h"
#include "core/model/kvcache.h"
#include "core/model/model.h"

/* the M a small GEMM is padded to on a backend without gemm_rows (and the
 * number of sessions a stage does not wait beyond, node/stage_batch.c) */
#define NL_BATCH_MIN_ROWS 16

typedef struct nl_batch nl_batch;

/* Activations for up to max_rows rows per call (decode rows plus one
 * prefill chunk). The model may be a stage: any layer range, with or
 * without the embedding and the head. */
nl_status nl_batch_new(nl_batch **out, nl_model *m, int max_rows, nl_error *err);
void nl_batch_destroy(nl_batch **b);

/* One sequence's part of a batched forward. kv must be a B = 1 cache of
 * this model; its len is the sequence's past and grows by T. */
typedef struct nl_batch_seg {
    nl_kvcache *kv;
    const int32_t *tokens; /* host (T); NULL for a model without the embedding */
    int T;
    int want_logits; /* logits of the segment's last position (a model with the head) */
} nl_batch_seg;

/* Run the segments as one batch. For each segment with want_logits the
 * logits of its last position are in device memory afterwards at
 * nl_batch_logits_device(b, i) (i: the segment's index in this call), a
 * row a caller may sample on the device (core/model/sampler.h's
 * nl_sampler_next), and on the host at nl_batch_logits(b, i), which
 * downloads every such row of the call the first time it is asked (so a
 * step whose tokens are all sampled on the device moves only ids). Checks
 * every token and that every cache has room; on error no cache grew. */
nl_status nl_batch_forward(nl_batch *b, const nl_batch_seg *segs, int n, nl_error *err);
/* The same for a model without the embedding (a later stage): x[i] is
 * segment i's input, host (T_i, d) hidden states. */
nl_status nl_batch_forward_hidden(nl_batch *b, const nl_batch_seg *segs, const float *const *x,
                                  int n, nl_error *err);
/* Recorded decode steps (CUDA graphs; core/model/forward.h has the single
 * sequence's): a call whose segments all decode one position, on a
 * backend with graph slots, is recorded once and replayed for every later
 * call with the same key: the model and its generation (a growth or a
 * reload records again), the number of segments, each one's cache
 * (buffers and capacity) in order and whether it wants logits. A batch's
 * members changing (a session joining or leaving) is a new key. Up to 8
 * recordings are kept; a refused recording, or more than 16 replayed less
 * than twice each, turns recording off. NL_GRAPHS=0 at nl_batch_new, or
 * nl_batch_set_graphs(b, 0), turns it off; nl_batch_graphs counts. */
void nl_batch_set_graphs(nl_batch *b, int on);
nl_runstate_graph_stats nl_batch_graphs(const nl_batch *b);
/* The per-layer calls this batch has queued (a recorded step's counted
 * when recorded, not when replayed): attention slot calls, one a layer
 * for each run of consecutive segments decoding one position, one a
 * segment a layer otherwise; and KV cache writes, likewise (a run's one
 * a layer where the backend has kv_store_seq). */
typedef struct nl_batch_call_stats {
    uint64_t attention;
    uint64_t kv_writes;
} nl_batch_call_stats;
nl_batch_call_stats nl_batch_calls(const nl_batch *b);

/* Host (vocab_size) logits of segment i, valid until the next call; NULL
 * with err set when it has none or the download failed. */
const float *nl_batch_logits(nl_batch *b, int i, nl_error *err);
/* Device (vocab_size) logits of segment i, or NULL. */
const float *nl_batch_logits_device(const nl_batch *b, int i);
/* A model without the head: the output hidden states of segment i of the
 * last call, host (T_i, d) rows, valid until the next call. */
const float *nl_batch_hidden(const nl_batch *b, int i);

/* The embedding of a token sequence (DESIGN.md section 7): the mean over
 * its positions of the final-normed hidden states, L2-normalised, into
 * out (hidden_dim floats). Runs in chunks of the batch's rows through a
 * temporary cache; T must be within max_seq_len. Needs a whole model. */
nl_status nl_batch_embed(nl_batch *b, const int32_t *tokens, int T, float *out, nl_error *err);

#endif
