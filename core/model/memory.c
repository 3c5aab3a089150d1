/* The memory model. Each term names the allocation it stands for. */
#include "core/model/memory.h"

#include "core/model/kvcache.h"
#include "core/model/layer.h"

int64_t nl_stage_param_count(const nl_config *c, int n_layers, int has_embed, int has_head)
{
    const int64_t d = c->hidden_dim, hd = nl_config_head_dim(c);
    const int64_t per_layer = 2 * d + (c->num_heads + 2LL * c->num_kv_heads) * hd * d +
                              d * c->num_heads * hd +
                              (nl_config_dense(c) ? 0 : (int64_t)c->num_experts * d) +
                              3LL * c->num_experts * c->ffn_dim * d;
    const int64_t table = nl_config_capacity(c) * d;
    const int64_t classifier = (int64_t)c->num_classes * d;
    return per_layer * n_layers + (has_embed ? table : 0) + (has_head ? table + d + classifier : 0);
}

/* Host-side routing arrays of one activation set (layer.c: probs_h,
 * choice, w, perm, slot, counts, offsets, frac). */
static uint64_t routing_host_bytes(const nl_config *c, uint64_t N)
{
    const uint64_t E = (uint64_t)c->num_experts, k = (uint64_t)c->top_k;
    return 4 * (N * E + 4 * N * k + 3 * E + 1);
}

int nl_mem_precision(const nl_backend *be)
{
    return !be || !be->bf16 ? NL_MEM_FP32 : be->host_memory ? NL_MEM_BF16 : NL_MEM_BF16_DEVICE;
}

static uint64_t max3(uint64_t a, uint64_t b, uint64_t c)
{
    const uint64_t m = a > b ? a : b;
    return m > c ? m : c;
}

/* The CPU backend's bf16 operand buffers (cpu_bf16.c: one for A, one for
 * B, grown to the largest converted operand): A is an activation of N rows
 * (the input of a projection; in training also the gradient of an output,
 * the head's logits among them), B only in a weight gradient (the input
 * of the projection). */
static uint64_t bf16_host_scratch(const nl_config *c, uint64_t N, int training, int has_head)
{
    const uint64_t d = (uint64_t)c->hidden_dim, hd = (uint64_t)nl_config_head_dim(c);
    const uint64_t q = (uint64_t)c->num_heads * hd, F = (uint64_t)c->ffn_dim;
    const uint64_t qkv = q + 2 * (uint64_t)c->num_kv_heads * hd;
    uint64_t wa = max3(d, q, F), wb = 0;
    if (training) {
        wa = max3(wa, qkv, 2 * F);
        if (has_head && (uint64_t)c->vocab_size > wa)
            wa = (uint64_t)c->vocab_size;
        wb = max3(d, q, F);
    }
    return 2 * N * (wa + wb);
}

int nl_mem_train_slots(int after, int M, int extra)
{
    long k = after <= 0 ? 1 : (long)after + 1 + (extra > 0 ? extra : 0);
    if (M > 0 && M < k)
        k = M;
    return k < 1 ? 1 : (int)k;
}

nl_mem_estimate nl_memory_estimate(const nl_config *c, int n_layers, int has_embed, int has_head,
                                   const nl_mem_opts *o)
{
    nl_mem_estimate e = {0};
    const uint64_t N = (uint64_t)(o->micro_rows > 0 ? o->micro_rows : 1);
    const uint64_t d = (uint64_t)c->hidden_dim, V = (uint64_t)c->vocab_size;
    const uint64_t L = (uint64_t)n_layers;
    const uint64_t P = (uint64_t)nl_stage_param_count(c, n_layers, has_embed, has_head);
    const uint64_t acts = nl_layer_acts_floats(c, (int)N) * 4; /* one training-layout set */
    e.weights = 4 * P;
    e.runtime = NL_MEM_RUNTIME_BYTES;
    if (!o->training) {
        /* forward.c: one inference set (x_in, h1, x_out shared; no rstd, lse) */
        const uint64_t inf_set = acts - 4 * N * (2 * d + 2 + (uint64_t)c->num_heads);
        e.activations = inf_set + 4 * N * (2 + 2 * d) + (has_head ? 4 * N * V : 0);
        e.workspace = routing_host_bytes(c, N) + 4 * N;
        if (o->kv_sessions > 0)
            e.kv_cache = nl_kvcache_bytes(c, (int)L, o->kv_sessions, o->kv_len,
                                          o->kv_bf16 ? NL_KV_BF16 : NL_KV_FP32);
    } else {
        const uint64_t slots = (uint64_t)(o->in_flight > 0 ? o->in_flight : 1);
        e.grads = 4 * P;
        e.moments = 8 * P;
        /* per slot: every layer's set with inputs aliased to the previous
         * output, or (recompute) only each layer's input plus the output */
        uint64_t per_slot =
            o->recompute ? 4 * N * d * (L + 1) : (L ? L * acts - (L - 1) * 4 * N * d : 4 * N * d);
        per_slot += 4 * N; /* tokens */
        if (has_head)
            per_slot += 4 * N * (d + 1 + V); /* xnf, rstdf, logits */
        e.activations = slots * per_slot;
        /* work set, backward scratch, ping-pong input gradients, positions,
         * targets, losses, route counts, host routing */
        e.workspace = acts + nl_layer_scratch_floats(c, (int)N) * 4 + 4 * N * (2 * d + 3) +
                      4 * N * 4 + routing_host_bytes(c, N) * (1 + (o->recompute ? 0 : slots * L));
    }
    if (o->precision != NL_MEM_FP32)
        e.bf16_copies = 2 * P;
    if (o->precision == NL_MEM_BF16)
        e.workspace += bf16_host_scratch(c, N, o->training, has_head);
    e.total = e.bf16_copies + e.weights + e.grads + e.moments + e.activations + e.kv_cache +
              e.workspace + e.runtime;
    return e;
}
