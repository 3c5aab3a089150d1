/* Fuzz target for Hugging Face config.json (neuroctl import --hf): the
 * input as the file's text. A config that parses must survive our own
 * config.json writer: written and parsed again, it gives the same sizes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/hf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void round_trip(const nl_config *c)
{
    nl_config back;
    nl_error err;
    int tied2 = 0;
    char *json = nl_hf_config_to_json(c, 0);
    if (!json)
        abort();
    if (nl_hf_config_parse(&back, &tied2, json, strlen(json), "again", NULL, &err) != NL_OK)
        abort();
    if (back.hidden_dim != c->hidden_dim || back.num_layers != c->num_layers ||
        back.num_heads != c->num_heads || back.num_kv_heads != c->num_kv_heads ||
        back.ffn_dim != c->ffn_dim || back.num_experts != c->num_experts ||
        back.top_k != c->top_k || back.vocab_size != c->vocab_size ||
        back.max_seq_len != c->max_seq_len || back.rope_base != c->rope_base ||
        back.norm_eps != c->norm_eps)
        abort();
    free(json);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    nl_config c;
    nl_error err;
    int tied = 0;
    if (nl_hf_config_parse(&c, &tied, (const char *)data, size, "config.json", NULL, &err) == NL_OK)
        round_trip(&c);
    return 0;
}
