/* Labelled examples for classification (DESIGN.md section 6, neuroctl
 * train --objective classify): a text file of one example per line,
 * `label<TAB>text`. Classes are the distinct labels in sorted order, so a
 * file names the same classes in every run. The examples are split by a
 * fixed seed into a training part and a held-out tail, and batches are
 * drawn from (seed, split, index) as nl_dataset_batch draws windows.
 *
 * Ownership: nl_labelled_load returns a set the caller frees with
 * nl_labelled_destroy(&ds). */
#ifndef NL_LABELLED_H
#define NL_LABELLED_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

typedef struct nl_labelled {
    int32_t *ids;   /* every example's token ids, concatenated */
    size_t *start;  /* (n + 1) where each example's ids begin */
    int32_t *label; /* (n) class of each example */
    size_t n;       /* examples */
    size_t n_train; /* the first n_train (after the split's shuffle) train */
    char **names;   /* (n_classes) the class names, sorted */
    int n_classes;
} nl_labelled;

/* Most classes a file may name. */
#define NL_LABELLED_MAX_CLASSES 65536

/* Read path. Text goes through the tokenizer whose text is tok_text, or
 * is bytes (ids 0..255) when tok_text is NULL; every id must be below
 * vocab_size. Lines without a tab, with an empty label or an empty text,
 * or with a NUL byte in the label are errors naming the line; blank lines are skipped. holdout in
 * [0, 0.5] is the share held out; the examples are shuffled by split_seed
 * first. */
nl_status nl_labelled_load(nl_labelled **out, const char *path, const char *tok_text,
                           int64_t vocab_size, double holdout, uint64_t split_seed, nl_error *err);
void nl_labelled_destroy(nl_labelled **ds);

/* Batch `index` of a split (0: training, 1: held out): B examples drawn
 * from (seed, split, index), each cut to its first T ids (lengths[b] of
 * them, at least 1) and padded with id 0; doc[b T + t] is 0 on the
 * example and 1 on its padding (for nl_trainer_set_docs). Returns
 * NL_ERR_INVALID when the split is empty. */
nl_status nl_labelled_batch(const nl_labelled *ds, int split, uint64_t seed, uint64_t index, int B,
                            int T, int32_t *tokens, int32_t *lengths, int32_t *labels, int32_t *doc,
                            nl_error *err);

/* The held-out split in order, each example once (evaluation): batches of
 * B rows, the last one partial. nl_labelled_eval_batches is how many
 * there are (0 when nothing is held out). nl_labelled_eval_batch fills
 * batch `index` as nl_labelled_batch does, with examples n_train + index
 * B + b in order; rows past the split's end get label -1 (not an example:
 * score them out) over one pad id. *count (may be NULL): the examples in
 * the batch. Returns NL_ERR_RANGE when index is past the last batch. */
size_t nl_labelled_eval_batches(const nl_labelled *ds, int B);
nl_status nl_labelled_eval_batch(const nl_labelled *ds, size_t index, int B, int T, int32_t *tokens,
                                 int32_t *lengths, int32_t *labels, int32_t *doc, int *count,
                                 nl_error *err);

/* Score B rows of class probabilities (host, (B, K)) against labels:
 * rows whose label is below 0 are skipped; the others add -ln p[label]
 * to *ce, 1 to *n and, when the most probable class (the first of equal
 * ones) is the label, 1 to *right. Local and cluster evaluation share it. */
void nl_labelled_score(const float *probs, const int32_t *labels, int B, int K, double *ce,
                       int64_t *right, int64_t *n);

#endif
