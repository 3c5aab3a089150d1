/* Model checkpoints: the safetensors files of DESIGN.md section 2, with
 * the tensor names and `__metadata__` (format "neurollm/1", the config as
 * JSON, the step). Loading a stage checks that every tensor it holds is
 * present with the shape its config implies. */
#ifndef NL_CHECKPOINT_H
#define NL_CHECKPOINT_H

#include <stdint.h>

#include "core/model/model.h"

#define NL_CHECKPOINT_FORMAT "neurollm/1"

/* What a checkpoint may carry beside the weights (every field optional):
 * - the AdamW moments of every parameter (device pointers in the model's
 *   layout, both or neither) under `optim.m.<name>` and `optim.v.<name>`,
 *   with the number of AdamW steps and the run's options (JSON text);
 * - the tokenizer, as its file text in metadata `tokenizer`, so that the
 *   checkpoint alone turns text into tokens and back;
 * - the seed the weights were initialised from (`init_seed`), which
 *   vocabulary growth draws new rows from;
 * - the chat template (`chat_template`, JSON: core/tokenizer/chat_template.h).
 * The model's growth history (m->growth, core/grow/grow.h) is saved as metadata
 * `growth` whenever it has one, and nl_checkpoint_load reads it back. */
typedef struct nl_ckpt_extra {
    const float *m, *v;
    int64_t adam_steps;
    const char *train_json;
    const char *tokenizer;
    const char *init_seed;     /* decimal text, or NULL */
    const char *chat_template; /* JSON text (core/tokenizer/chat_template.h), or NULL */
} nl_ckpt_extra;

/* Write every parameter of the stage (and what `extra` carries; may be
 * NULL) to `path` atomically (mode 0600: it may hold optimizer state).
 * A file that the manifest.json beside it names as a shard is never
 * replaced (NL_ERR_STATE). */
nl_status nl_checkpoint_save(const nl_model *m, const char *path, int64_t step,
                             const nl_ckpt_extra *extra, nl_error *err);

/* A metadata string of a checkpoint ("tokenizer", "init_seed", "train"),
 * malloc'd into *out, or *out = NULL when the key is absent. */
nl_status nl_checkpoint_meta(const char *path, const char *key, char **out, nl_error *err);

/* An init_seed (a checkpoint's or a manifest's metadata): a decimal seed
 * of 64 bits, else NL_ERR_FORMAT "WHAT: expected a decimal seed of 64
 * bits". NULL (none) is fine. */
nl_status nl_checkpoint_seed_check(const char *s, const char *what, nl_error *err);

/* nl_checkpoint_meta of "init_seed", checked as above (*out NULL when the
 * checkpoint has none). */
nl_status nl_checkpoint_init_seed(const char *path, char **out, nl_error *err);

/* Read the optimizer state of a checkpoint into the moments (device, the
 * model's layout) of a model loaded from it. NL_ERR_NOTFOUND when the file
 * has none. *train_json (may be NULL) gets a malloc'd copy of the training
 * metadata, or NULL. */
nl_status nl_checkpoint_load_optim(const nl_model *m, const char *path, float *mom_m, float *mom_v,
                                   int64_t *adam_steps, char **train_json, nl_error *err);

/* Read and validate the metadata only: format, config, step. */
nl_status nl_checkpoint_read_config(const char *path, nl_config *cfg, int64_t *step, nl_error *err);

/* Build the stage [l0, l1) (with the embedding and/or head as asked) from
 * the checkpoint at `path`. l1 < 0 means "to the last layer". */
nl_status nl_checkpoint_load(nl_model **out, nl_backend *be, const char *path, int l0, int l1,
                             int has_embed, int has_head, int64_t *step, nl_error *err);

/* The tokenizer a checkpoint carries: *out is a new tokenizer, or NULL
 * when the checkpoint has none (a byte-level model). */
struct nl_tokenizer;
nl_status nl_checkpoint_tokenizer(const char *path, struct nl_tokenizer **out, nl_error *err);

/* ---- pieces for readers that assemble a model from several files
 * (core/formats/manifest.c) ---- */
struct nl_st_file;

/* Check the metadata of an open checkpoint: format, config (parsed and
 * validated, with a size, into *cfg), step (a count, into *step unless
 * NULL). When adam_steps is not NULL it gets the optimizer's step count,
 * or -1 when the file has no optimizer state. Messages start with path. */
nl_status nl_checkpoint_check_meta(const struct nl_st_file *f, const char *path, nl_config *cfg,
                                   int64_t *step, int64_t *adam_steps, nl_error *err);

/* Set m's growth history (core/grow/grow.h) from the file's metadata "growth"
 * (none: an empty history). NL_ERR_FORMAT names the entry at fault. */
nl_status nl_checkpoint_read_growth(const struct nl_st_file *f, nl_model *m, nl_error *err);

/* Copy tensors of m's table from the open file into host buffers laid out
 * like m->params: the weights into w, the AdamW moments `optim.m.<name>`
 * and `optim.v.<name>` into mm and vv (each of the three may be NULL).
 * pick (m->n_table flags, or NULL for every entry) selects the entries.
 * Each tensor must be present (NL_ERR_NOTFOUND), F32 (NL_ERR_DTYPE) and
 * of exactly the entry's shape (NL_ERR_SHAPE); messages name it. */
nl_status nl_checkpoint_read_tensors(const nl_model *m, const struct nl_st_file *f,
                                     const unsigned char *pick, float *w, float *mm, float *vv,
                                     nl_error *err);

#endif
