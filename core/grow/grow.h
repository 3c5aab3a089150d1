/* Growth of a model (DESIGN.md section 5): vocabulary, depth and width,
 * each function-preserving, in memory (a stage's parameters and AdamW
 * moments) and on a sharded checkpoint (a manifest and its shards); and
 * the growth history that checkpoints and manifests carry.
 *
 * Ownership: the history of a model (m->growth, m->n_growth) is owned by
 * the model; nl_growth_from_json returns an array the caller frees with
 * free(). nl_manifest_grow's *out_manifest_path is malloc'd. */
#ifndef NL_GROW_H
#define NL_GROW_H

#include <stdint.h>

#include "core/model/model.h"

typedef enum { NL_GROW_VOCAB = 1, NL_GROW_DEPTH, NL_GROW_WIDTH } nl_grow_kind;

/* One history entry (DESIGN 5). adam_steps: the AdamW steps taken when it
 * grew; the parameters it created count their bias correction from there
 * (docs/training.md, "AdamW after growth"). */
typedef struct nl_growth {
    int64_t step;
    nl_grow_kind kind;
    nl_config before, after;
    int64_t adam_steps;
} nl_growth;

/* What to grow to; 0 (NULL) = unchanged. tokenizer: the tokenizer file
 * text a vocabulary growth brings (stored in the grown manifest), or NULL
 * to keep the manifest's. */
typedef struct nl_grow_spec {
    int64_t vocab_size;
    int n_layers;
    int hidden_dim;
    int ffn_dim;
    const char *tokenizer;
} nl_grow_spec;

/* "vocab", "depth", "width"; NULL for another value. */
const char *nl_grow_kind_name(nl_grow_kind k);

/* ---- in memory ----
 * Each replaces the model's parameter block (and each of the n_moments
 * device buffers in `moments`, laid out like the parameters; may be NULL
 * when n_moments is 0): pointers into the old ones are stale. Old values
 * keep their place and bits (except the norm gains of a width growth, see
 * below); new moments are zero. None records history: the caller appends
 * an entry with nl_model_add_growth (nl_manifest_grow and `neuroctl grow`
 * do). */

/* Append layers L .. n_layers-1. A stage that holds the head (the last)
 * takes the new layers: [l0, l1) becomes [l0, n_layers); another stage
 * only learns the new num_layers. New layers are drawn as
 * nl_model_init_random would draw them for a model of n_layers layers,
 * except attention.wo and every expert's w_down, which are zero: each new
 * block is the identity, so logits are bit-identical. */
nl_status nl_model_grow_depth(nl_model *m, int n_layers, uint64_t seed, float **moments,
                              int n_moments, nl_error *err);

/* Widen d -> hidden_dim (head_dim fixed: whole new heads, kv heads in the
 * same ratio) and F -> ffn_dim (0: unchanged) by DESIGN 5: new entries
 * from the init streams of the grown model, except tok_embeddings' new
 * columns, wo's and w_down's new rows and columns, which are zero; norm
 * gains times sqrt(r) (new entries sqrt(r)), norm_eps times r, r = d/d'.
 * The norm gains' moments are rescaled with them (m / sqrt(r), v / r: the
 * gradient of a gain scales by 1/sqrt(r)). Logits are unchanged within
 * float rounding. */
nl_status nl_model_grow_width(nl_model *m, int hidden_dim, int ffn_dim, uint64_t seed,
                              float **moments, int n_moments, nl_error *err);

/* The config of a model widened to hidden_dim and ffn_dim (0: unchanged)
 * as nl_model_grow_width widens it (heads, kv heads, norm_eps), checked:
 * NL_ERR_INVALID names the value that cannot grow so. */
nl_status nl_config_widen(const nl_config *old, int hidden_dim, int ffn_dim, nl_config *out,
                          nl_error *err);

/* Append a copy of *g to the model's history. */
nl_status nl_model_add_growth(nl_model *m, const nl_growth *g, nl_error *err);
/* Replace the model's history with a copy of h[0..n). */
nl_status nl_model_set_growth(nl_model *m, const nl_growth *h, int n, nl_error *err);

/* ---- on a sharded checkpoint ----
 * Read the verified manifest at `manifest_path`, write into `out_dir`
 * (may be the same directory: a file a manifest names is never
 * overwritten) the grown shards and a new manifest at the same step whose
 * growth history gains one entry per changed dimension, in the order
 * vocab, depth, width. Depth: one new shard holds the new layers and the
 * head; the old shards are reused where unchanged (the old last shard then
 * keeps its layers only). Vocabulary past the capacity rewrites the shards
 * holding the tables; width rewrites every shard. Reused shards are hard
 * links (or copies) when out_dir is another directory. The manifest is
 * named manifest.json, or manifest-grow<N>.json (N: history length) when
 * out_dir already has one; new shards grow<N>-stage-<i>.safetensors. The
 * seed is the manifest's init_seed when `seed` is UINT64_MAX. The path of
 * the new manifest is malloc'd into *out_manifest_path (may be NULL). */
nl_status nl_manifest_grow(const char *manifest_path, const nl_grow_spec *spec, uint64_t seed,
                           const char *out_dir, char **out_manifest_path, nl_error *err);

/* ---- history ---- */

/* One line for logs and status (no newline), e.g.
 *   "depth 2 -> 4 layers at step 120"
 *   "width hidden_dim 64 -> 128, heads 2/1 -> 4/2, ffn_dim 128 -> 256 at step 120"
 *   "vocab 300 -> 400 (table rows 384 -> 512) at step 120"
 * Returns what snprintf returns. */
int nl_growth_describe(const nl_growth *g, char *buf, size_t n);

/* The history as a JSON array of {"step", "adam_steps", "kind", "before":
 * {config}, "after": {config}} (malloc'd). */
char *nl_growth_to_json(const nl_growth *h, int n);
/* Parse that array (untrusted; at most NL_GROWTH_MAX entries, each config
 * validated, each entry's after the next one's before). *out is malloc'd
 * (NULL when n is 0). */
#define NL_GROWTH_MAX 1024
nl_status nl_growth_from_json(const char *json, nl_growth **out, int *n, nl_error *err);

/* Shape of parameter `name` in a whole model of config c: its ndim (1 or
 * 2) with shape[] filled, or 0 when such a model has no such parameter. */
int nl_config_param_shape(const nl_config *c, const char *name, int64_t shape[2]);

/* The part of a parameter that entry g created, in its current
 * coordinates (growth only appends rows and columns, so an element keeps
 * its index): up to two rectangles rows [r0, r1) x columns [c0, c1)
 * (1-D parameters: columns [0, 1)). Returns how many. */
typedef struct nl_grow_rect {
    int64_t r0, r1, c0, c1;
} nl_grow_rect;
int nl_growth_regions(const nl_growth *g, const char *name, nl_grow_rect out[2]);

#endif
