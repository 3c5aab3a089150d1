/* The memory model: the bytes one stage needs, by part, for inference or
 * for training. It mirrors what core/model/forward.c, core/train/train.c and
 * core/model/layer.c allocate, so the coordinator can size and place a model
 * that fits, and it adds a fixed runtime overhead (libraries, threads)
 * measured on the CPU backend. */
#ifndef NL_MEMORY_H
#define NL_MEMORY_H

#include <stdint.h>

#include "core/model/config.h"
#include "kernels/backend.h"

/* GEMM precision of the stage (nl_mem_opts.precision). bf16 keeps a bf16
 * copy of every weight (2 bytes each) next to the FP32 masters; the CPU
 * backend also keeps the operands it converts (two buffers grown to the
 * largest activation operands); a GPU's conversion scratch and cuBLASLt
 * workspace are fixed, made with the backend and counted in its
 * runtime_bytes, which a GPU node's offer already leaves out. */
enum {
    NL_MEM_FP32 = 0,
    NL_MEM_BF16 = 1,        /* bf16 on host memory (the CPU backend) */
    NL_MEM_BF16_DEVICE = 2, /* bf16 on a device with its own fixed scratch (CUDA) */
};

typedef struct nl_mem_opts {
    int training;        /* 0: inference (weights, activations, KV caches) */
    int micro_rows;      /* rows (sequences x positions) of one microbatch or forward */
    int in_flight;       /* microbatches whose activations are kept (nl_mem_train_slots); the
                          * planner reads it as the microbatches of a step, the cap */
    int in_flight_extra; /* training: microbatches every stage but the last keeps in flight
                          * beyond 1F1B's (neurocoord --in-flight-extra; the planner's) */
    int recompute;       /* keep only layer inputs; recompute in the backward pass */
    int kv_sessions;     /* inference: generation sessions with a KV cache */
    int kv_len;          /* positions per session's cache */
    int kv_bf16;         /* 1: the caches keep bf16 (2 bytes an element; --kv-cache), 0: FP32 */
    int precision;       /* NL_MEM_FP32 (0), NL_MEM_BF16 or NL_MEM_BF16_DEVICE */
} nl_mem_opts;

typedef struct nl_mem_estimate {
    uint64_t weights;     /* parameters, F32 */
    uint64_t grads;       /* accumulated gradients */
    uint64_t moments;     /* AdamW m and v */
    uint64_t activations; /* saved for the backward, or the forward's working set */
    uint64_t kv_cache;    /* generation caches */
    uint64_t workspace;   /* backward scratch, head buffers, host-side routing, the CPU's
                           * bf16 operands */
    uint64_t bf16_copies; /* bf16 copies of the weights (2 bytes each; bf16 only) */
    uint64_t runtime;     /* process overhead (code, libraries, thread stacks) */
    uint64_t total;
} nl_mem_estimate;

/* Fixed overhead of a process on the CPU backend (measured; see
 * docs/memory-model.md). */
#define NL_MEM_RUNTIME_BYTES (32ULL << 20)

/* A node's KV budget (its generation sessions' caches) when --kv-budget is
 * not given: a quarter of the memory it offers, at most 256 MiB. The
 * budget is kept within the offer: plans get the rest (neuronode's JOIN). */
#define NL_MEM_KV_BUDGET_CAP (256ULL << 20)
static inline uint64_t nl_mem_kv_budget_default(uint64_t offer)
{
    return offer / 4 < NL_MEM_KV_BUDGET_CAP ? offer / 4 : NL_MEM_KV_BUDGET_CAP;
}

/* Parameters of a stage holding n_layers layers and, as flagged, the
 * embedding table and the final norm with the head. */
int64_t nl_stage_param_count(const nl_config *cfg, int n_layers, int has_embed, int has_head);

/* The precision term a backend needs: NL_MEM_FP32 unless be->bf16, then
 * NL_MEM_BF16 on host memory, NL_MEM_BF16_DEVICE on a device. */
int nl_mem_precision(const nl_backend *be);

/* The microbatches a training stage keeps in flight, its activation
 * slots: 1F1B keeps one for each stage from it to the last (after + 1,
 * `after` the stages after it), and `extra` more on every stage but the
 * last, whose forward is followed by its backward at once (neurocoord
 * --in-flight-extra: the next microbatches' hops leave while the earlier
 * ones' gradients are on their way back, so a link's round trip is not
 * waited out); at most M, a step's microbatches (M <= 0: no cap), and at
 * least 1. The node, the coordinator's memory check and the planner all
 * count with this. */
int nl_mem_train_slots(int after, int M, int extra);

nl_mem_estimate nl_memory_estimate(const nl_config *cfg, int n_layers, int has_embed, int has_head,
                                   const nl_mem_opts *o);

#endif
