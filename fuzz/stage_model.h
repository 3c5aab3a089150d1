/* The stage the fuzz target fuzz_stage.c drives and its seed corpus
 * writer stage_corpus.c records: a small model and where a stage of it
 * sits in a pipeline. Header-only. */
#ifndef NL_FUZZ_STAGE_MODEL_H
#define NL_FUZZ_STAGE_MODEL_H

#include <stdio.h>
#include <stdlib.h>

#include "core/model/config.h"
#include "net/wire.h"

#define LAYERS 3
#define HIDDEN 16
#define VOCAB 64
#define SEED 77

/* The small model: 3 layers of width 16 (2 heads, 1 of keys and values),
 * 2 experts of 16, a vocabulary of 64, sequences up to 16. */
static inline char *model_json(void)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = HIDDEN;
    c.num_layers = LAYERS;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.ffn_dim = 16;
    c.num_experts = 2;
    c.vocab_size = VOCAB;
    c.vocab_chunk = VOCAB;
    c.max_seq_len = 16;
    nl_error err;
    if (nl_config_validate(&c, 1, &err) != NL_OK) {
        fprintf(stderr, "fuzz_stage: the model: %s\n", err.msg);
        abort();
    }
    return nl_config_to_json(&c);
}

/* Where each of the 4 positions sits: stage, stages, layers. */
static const int place[4][4] = {{0, 1, 0, 3}, {0, 2, 0, 2}, {1, 2, 2, 3}, {1, 3, 1, 2}};

/* The stage at pos; ring 1 + r: replica r of 2 on different nodes. */
static inline nl_msg_assign assign_of(int pos, int wire_bf16, int ring, const char *cfg)
{
    const int *p = place[pos & 3];
    return (nl_msg_assign){.epoch = 1,
                           .node_id = 1,
                           .stage = (uint32_t)p[0],
                           .num_stages = (uint32_t)p[1],
                           .layer0 = (uint32_t)p[2],
                           .layer1 = (uint32_t)p[3],
                           .has_embed = p[0] == 0,
                           .has_head = p[0] + 1 == p[1],
                           .config_json = cfg,
                           .seed = SEED,
                           .prev_endpoint = "",
                           .prev_key = "",
                           .next_endpoint = "",
                           .next_key = "",
                           .wire = wire_bf16 ? NL_WIRE_BF16 : NL_WIRE_FP32,
                           .replica = ring ? (uint32_t)(ring - 1) : 0,
                           .replicas = ring ? 2 : 0,
                           .ring_endpoint = ring ? "tcp://127.0.0.1:9" : NULL,
                           .ring_key = "",
                           .ring_prev_key = ""};
}

#endif
