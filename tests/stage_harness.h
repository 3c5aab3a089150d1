/* The harness of the node/stage unit tests (test_node_stage.c: loading,
 * the forward hop, sessions, the ring, the budget; test_node_stage_batch.c:
 * batched session hops and adapters): a small model's config, the
 * assignment and LAYER_LOAD messages that build a loaded stage, the frames
 * of a hop, and a local generation to compare with. Header-only, as
 * check.h is: its CHECKs count in the program that includes it. */
#ifndef NL_TEST_STAGE_HARNESS_H
#define NL_TEST_STAGE_HARNESS_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/model/forward.h"
#include "core/model/memory.h"
#include "core/model/rng.h"
#include "core/model/sampler.h"
#include "node/stage.h"
#include "tests/check.h"
#include "tests/small_config.h"

#define SEED 1234
#define CHUNK 100 /* elements per LAYER_LOAD chunk: tensors span many */

static nl_backend *be;
static nl_config cfg;
static char *cfg_json;

static inline nl_msg_assign mk_assign(uint64_t epoch, uint32_t stage, uint32_t nst, int l0, int l1)
{
    nl_msg_assign a = {.epoch = epoch,
                       .node_id = 1,
                       .stage = stage,
                       .num_stages = nst,
                       .layer0 = (uint32_t)l0,
                       .layer1 = (uint32_t)l1,
                       .has_embed = stage == 0,
                       .has_head = stage + 1 == nst,
                       .config_json = cfg_json,
                       .seed = SEED,
                       .prev_endpoint = "",
                       .prev_key = "",
                       .next_endpoint = "",
                       .next_key = ""};
    return a;
}

static int prefill_chunk;     /* the stages' (0: the default) */
static int kv_cache;          /* the stages' KV cache type, an nl_kv_dtype (0: FP32) */
static const char *ckpt_root; /* the stages' --checkpoint-root (NULL: none) */

static inline nl_stage *mk_stage(uint64_t memory, uint64_t kv_budget)
{
    nl_stage *s = NULL;
    nl_error err;
    nl_stage_opts o = {.memory_bytes = memory,
                       .kv_budget = kv_budget,
                       .send_wait_ms = 200,
                       .prefill_chunk = prefill_chunk,
                       .kv_cache = kv_cache,
                       .ckpt_root = ckpt_root};
    CHECK_OK(nl_stage_new(&s, be, &o, &err), &err);
    return s;
}

static inline nl_wire_frame f32_frame(const float *data, int64_t n)
{
    nl_wire_frame f;
    memset(&f, 0, sizeof f);
    f.t.dtype = NL_DTYPE_F32;
    f.t.ndim = 1;
    f.t.shape[0] = n;
    f.t.data = (void *)data;
    f.len = (size_t)n * sizeof(float);
    return f;
}

static inline nl_msg_layer_load mk_load(uint64_t epoch, const nl_param *p, uint64_t offset,
                                        uint32_t chunk, uint32_t chunks)
{
    nl_msg_layer_load l = {.epoch = epoch,
                           .name = p->name,
                           .ndim = p->ndim,
                           .offset = offset,
                           .chunk = chunk,
                           .chunks = chunks};
    l.shape[0] = p->shape[0];
    l.shape[1] = p->ndim == 2 ? p->shape[1] : 0;
    return l;
}

/* Stream every tensor of the stage from ref's values in CHUNK-element
 * chunks; the last chunk of tensor `hold` (-1: none) is left unsent. */
static inline nl_status stream(nl_stage *s, const nl_model *ref, uint64_t epoch, int hold,
                               nl_error *err)
{
    const nl_model *m = nl_stage_model(s);
    for (int i = 0; m && i < m->n_table; i++) {
        const nl_param *p = &m->table[i];
        const nl_param *rp = nl_model_find_param(ref, p->name);
        size_t numel = nl_param_numel(p);
        float *src = check_download(be, nl_model_param_data(ref, rp), numel);
        if (!src)
            return nl_error_set(err, NL_ERR_NOMEM, "host copy of %s", p->name);
        uint32_t chunks = (uint32_t)((numel + CHUNK - 1) / CHUNK);
        nl_status st = NL_OK;
        for (uint32_t c = 0; st == NL_OK && c < chunks; c++) {
            if (i == hold && c + 1 == chunks)
                break;
            size_t off = (size_t)c * CHUNK, n = numel - off < CHUNK ? numel - off : CHUNK;
            nl_msg_layer_load l = mk_load(epoch, p, off, c, chunks);
            nl_wire_frame f = f32_frame(src + off, (int64_t)n);
            bool stale = true;
            st = nl_stage_load_chunk(s, &l, &f, &stale, err);
            if (st == NL_OK && stale)
                st = nl_error_set(err, NL_ERR_INTERNAL, "chunk of %s taken as stale", p->name);
        }
        free(src);
        if (st != NL_OK)
            return st;
    }
    return NL_OK;
}

/* Does every parameter of the stage equal ref's of the same name? */
static inline bool params_equal(const nl_model *m, const nl_model *ref)
{
    for (int i = 0; i < m->n_table; i++) {
        const nl_param *p = &m->table[i];
        const nl_param *rp = nl_model_find_param(ref, p->name);
        if (!rp)
            return false;
        const size_t n = nl_param_numel(p);
        float *a = check_download(be, nl_model_param_data(m, p), n);
        float *b = check_download(be, nl_model_param_data(ref, rp), n);
        bool same = a && b && memcmp(a, b, n * sizeof(float)) == 0;
        free(a);
        free(b);
        if (!same)
            return false;
    }
    return true;
}

static inline nl_stage *loaded_stage(const nl_model *ref, uint32_t stage, uint32_t nst, int l0,
                                     int l1, uint64_t kv_budget)
{
    nl_error err;
    nl_stage *s = mk_stage(1ULL << 30, kv_budget);
    nl_msg_assign a = mk_assign(5, stage, nst, l0, l1);
    nl_stage_loaded info;
    bool stale;
    CHECK_OK(nl_stage_assign(s, &a, &err), &err);
    CHECK_OK(stream(s, ref, 5, -1, &err), &err);
    CHECK_OK(nl_stage_load_done(s, 5, (uint32_t)nl_stage_model(s)->n_table, &info, &stale, &err),
             &err);
    return s;
}

static inline nl_wire_frame tok_frame(int32_t *tok, int B, int T)
{
    nl_wire_frame f;
    memset(&f, 0, sizeof f);
    f.t.dtype = NL_DTYPE_I32;
    f.t.ndim = 2;
    f.t.shape[0] = B;
    f.t.shape[1] = T;
    f.t.data = tok;
    f.len = (size_t)B * T * 4;
    return f;
}

static inline nl_wire_frame out_frame(const nl_stage_out *o)
{
    nl_wire_frame f;
    memset(&f, 0, sizeof f);
    f.t.dtype = NL_DTYPE_F32;
    f.t.ndim = o->ndim;
    for (int i = 0; i < o->ndim; i++)
        f.t.shape[i] = o->shape[i];
    f.t.data = o->data;
    return f;
}

/* Greedy ids of a local KV-cache generation. */
static inline void local_generate(nl_model *ref, const int32_t *prompt, int P, int n, int32_t *ids)
{
    nl_error err;
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    nl_sampler smp;
    float *logits = malloc((size_t)cfg.vocab_size * sizeof *logits);
    CHECK_OK(nl_runstate_new(&rs, ref, P, &err), &err);
    CHECK_OK(nl_kvcache_new(&kv, ref, 1, P + n, NL_KV_FP32, &err), &err);
    CHECK_OK(nl_sampler_init(&smp, (int)cfg.vocab_size, 0.0f, 1.0f, 0, &err), &err);
    nl_forward_args a = {.B = 1, .T = P, .tokens = prompt, .kv = kv, .last_only = 1};
    int32_t next = 0;
    for (int i = 0; i < n && rs && kv; i++) {
        CHECK_OK(nl_forward(ref, rs, &a, NULL, &err), &err);
        be->download(be, logits, nl_runstate_output(rs, NULL),
                     (size_t)cfg.vocab_size * sizeof *logits);
        ids[i] = next = nl_sampler_sample(&smp, logits);
        a = (nl_forward_args){.B = 1, .T = 1, .tokens = &next, .kv = kv, .last_only = 1};
    }
    nl_sampler_free(&smp);
    free(logits);
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
}

/* The test model (3 layers, 4 experts, a vocabulary of 300 in chunks of
 * 128) on the test backend, its weights drawn from SEED: 0 on failure. */
static inline int stage_harness_start(const char *name, nl_model **ref)
{
    nl_error err;
    nl_log_set_name(name);
    nl_log_set_level(NL_LOG_WARN);
    check_small_config(&cfg, 3);
    CHECK_OK(nl_config_validate(&cfg, 1, &err), &err);
    cfg_json = nl_config_to_json(&cfg);
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    *ref = NULL;
    CHECK_OK(nl_model_new(ref, be, &cfg, 0, cfg.num_layers, 1, 1, &err), &err);
    CHECK_OK(nl_model_init_random(*ref, SEED, &err), &err);
    return *ref && cfg_json;
}

static inline int stage_harness_end(const char *name, nl_model **ref)
{
    nl_model_destroy(ref);
    nl_backend_destroy(&be);
    free(cfg_json);
    return check_done(name);
}

#endif
