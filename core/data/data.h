/* Training data: a token stream split into a training part and a held-out
 * tail, and batches drawn from a seed so that two runs with the same
 * arguments see the same data in the same order, and a resumed run sees
 * what the uninterrupted one would have. */
#ifndef NL_DATA_H
#define NL_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

typedef struct nl_dataset {
    uint32_t *ids;
    size_t n;       /* tokens in all */
    size_t n_train; /* the first n_train are for training, the rest held out */
} nl_dataset;

/* Largest data file read: 4 GiB. */
#define NL_DATA_MAX_BYTES (4ULL << 30)

/* Load `path`: a `.tok` file is little-endian uint32 ids, anything else is
 * text whose bytes are the ids 0..255. Every id must be below vocab_size.
 * holdout in [0, 0.5] is the share of the stream kept for evaluation. */
nl_status nl_dataset_load(nl_dataset **out, const char *path, int64_t vocab_size, double holdout,
                          nl_error *err);
/* Take ownership of ids (malloc'd) as a dataset. */
nl_status nl_dataset_from_ids(nl_dataset **out, uint32_t *ids, size_t n, double holdout,
                              nl_error *err);
void nl_dataset_destroy(nl_dataset **ds);

/* What nl_dataset_load_model did, for the caller to report. */
typedef struct nl_dataset_info {
    int tokenized;     /* the text went through the tokenizer */
    size_t text_bytes; /* bytes read (tokenized) */
    double encode_s;   /* seconds spent encoding */
} nl_dataset_info;

/* Training data for a model whose checkpoint carries tokenizer text
 * tok_text (may be NULL): text goes through that tokenizer, a `.tok` file
 * or a model without a tokenizer reads ids directly (nl_dataset_load).
 * `model` names the model in errors; info may be NULL. */
nl_status nl_dataset_load_model(nl_dataset **out, const char *path, const char *tok_text,
                                int64_t vocab_size, double holdout, const char *model,
                                nl_dataset_info *info, nl_error *err);

/* Batch `index` of a split (0: training, 1: held out): B windows of T + 1
 * consecutive tokens at offsets drawn from (seed, split, index); tokens
 * get the first T of each window and targets the last T. Both are (B, T). */
nl_status nl_dataset_batch(const nl_dataset *ds, int split, uint64_t seed, uint64_t index, int B,
                           int T, int32_t *tokens, int32_t *targets, nl_error *err);

/* DESIGN section 6's masked-LM rule over n positions of tokens, in place:
 * each position is chosen with probability mask_prob; a chosen one keeps
 * its token as its target and becomes the mask id (NL_CONFIG_MASK_ID) 80%
 * of the time, a random id below vocab_size 10%, and stays 10%; every
 * other target is -1 (ignored). Draws from the stream (seed, index), so a
 * batch masks the same way in every run. Returns the chosen count. */
size_t nl_mlm_mask(int32_t *tokens, int32_t *targets, size_t n, double mask_prob,
                   int64_t vocab_size, uint64_t seed, uint64_t index);

#endif
