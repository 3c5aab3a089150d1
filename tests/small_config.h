/* The small model the stage and node tests share (stage_harness.h,
 * stage_train_harness.h, node_harness.h, test_replica_threads.c). */
#ifndef NL_TEST_SMALL_CONFIG_H
#define NL_TEST_SMALL_CONFIG_H

#include "core/model/config.h"

/* The small model of the stage and node tests: `layers` layers of width
 * 32 (4 heads, 2 of keys and values), 4 experts of 48, a vocabulary of
 * 300 in chunks of 128 (capacity 384 rows: logits over the active 300
 * only), sequences up to 32. */
static inline void check_small_config(nl_config *c, int layers)
{
    nl_config_init(c);
    c->hidden_dim = 32;
    c->num_layers = layers;
    c->num_heads = 4;
    c->num_kv_heads = 2;
    c->ffn_dim = 48;
    c->num_experts = 4;
    c->vocab_size = 300;
    c->vocab_chunk = 128;
    c->max_seq_len = 32;
}

#endif
