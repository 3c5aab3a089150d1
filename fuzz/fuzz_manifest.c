/* Fuzz target for sharded-checkpoint manifests: the input as manifest
 * JSON. A manifest that parses must hold a valid plan, print back to JSON
 * (nl_manifest_to_json) and parse again to the same fields (the config
 * as parsed: the text may differ where a default filled an unset key).
 * A refusal must come with a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/manifest.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int same_str(const char *a, const char *b)
{
    return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

static void check_plan(const nl_manifest *m)
{
    if (m->n_shards < 1 || m->n_shards > NL_MANIFEST_MAX_SHARDS)
        abort();
    for (int i = 0; i < m->n_shards; i++) {
        const nl_manifest_shard *s = &m->shards[i];
        if (s->stage != i || s->l0 >= s->l1 || s->l0 != (i ? m->shards[i - 1].l1 : 0) ||
            s->has_embed != (i == 0) || s->has_head != (i == m->n_shards - 1) || !s->file ||
            !s->path || strchr(s->file, '/') || strlen(s->sha256) != 64)
            abort();
    }
    if (m->shards[m->n_shards - 1].l1 != m->cfg.num_layers)
        abort();
}

static void round_trip(const nl_manifest *m)
{
    nl_error err;
    nl_manifest *b = NULL;
    char *text = NULL;
    if (nl_manifest_to_json(m, &text, &err) != NL_OK)
        abort();
    if (nl_manifest_parse(&b, text, strlen(text), "d", &err) != NL_OK)
        abort();
    if (b->step != m->step || b->adam_steps != m->adam_steps || b->n_shards != m->n_shards ||
        memcmp(&b->cfg, &m->cfg, sizeof b->cfg) != 0 || !same_str(b->train_json, m->train_json) ||
        !same_str(b->tokenizer, m->tokenizer) || !same_str(b->init_seed, m->init_seed))
        abort();
    for (int i = 0; i < m->n_shards; i++) {
        const nl_manifest_shard *x = &m->shards[i], *y = &b->shards[i];
        if (x->l0 != y->l0 || x->l1 != y->l1 || x->bytes != y->bytes ||
            strcmp(x->file, y->file) != 0 || strcmp(x->sha256, y->sha256) != 0 ||
            !same_str(x->node, y->node))
            abort();
    }
    nl_manifest_destroy(&b);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    nl_manifest *m = NULL;
    nl_error err = {0};
    if (nl_manifest_parse(&m, (const char *)data, size, "d", &err) != NL_OK) {
        if (m || err.status == NL_OK || !err.msg[0])
            abort();
        return 0;
    }
    check_plan(m);
    round_trip(m);
    nl_manifest_destroy(&m);
    return 0;
}
