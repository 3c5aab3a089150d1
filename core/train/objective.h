/* What a training run learns, one definition for every side that trains:
 * local training (cli/cmd_train.c), the coordinator (coordinator/
 * coord_train*.c) and, through the trainparams schema (net/trainparams.h),
 * the client's and the stages' requests.
 *
 *   clm       next token (the model's config's default)
 *   mlm       masked tokens (DESIGN section 6: mask_prob of the positions,
 *             80% the mask id, 10% a random id, 10% kept; only they count)
 *   classify  labelled examples (core/data/labelled.h) into the model's
 *             classifier (num_classes)
 *
 * A model's config names clm or mlm (core/model/config.h); classify is a run's
 * choice, never a config's. */
#ifndef NL_OBJECTIVE_H
#define NL_OBJECTIVE_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

typedef enum { NL_OBJ_CLM = 0, NL_OBJ_MLM = 1, NL_OBJ_CLASSIFY = 2 } nl_objective;

/* Not named: the run trains its model's config's objective. */
#define NL_OBJ_MODEL (-1)

struct nl_config;
struct nl_dataset;

/* "clm", "mlm", "classify"; "?" for anything else. */
const char *nl_objective_name(int obj);

/* The objective named `name` into *obj; NL_ERR_INVALID, "'NAME' is not
 * clm, mlm or classify", for any other name. */
nl_status nl_objective_parse(const char *name, int *obj, nl_error *err);

/* The objective a run on model `cfg` trains: *obj, or the config's when
 * it is NL_OBJ_MODEL (*obj becomes it); then whether the model can learn
 * it: mlm needs the mask id in the vocabulary, classify a classifier.
 * NL_ERR_INVALID with the message a user of --objective reads. */
nl_status nl_objective_check(const struct nl_config *cfg, int *obj, nl_error *err);

/* Packed rows (DESIGN 6, --pack): <|end|> (NL_TOKEN_END, core/tokenizer/tokenizer.h)
 * in the data ends a document; a row's positions after it are the next
 * document's. Whether a run of objective `obj` on model `cfg` may pack
 * rows: not classify (each example is a row of its own already), and the
 * model's vocabulary must hold <|end|>. NL_ERR_INVALID naming --pack. */
nl_status nl_objective_check_pack(const struct nl_config *cfg, int obj, nl_error *err);

/* Batch `index` of a split (0: training, 1: held out) of a token
 * objective (clm, mlm) drawn from ds with `seed`: next-token windows, and
 * for mlm the same tokens masked by the model's mask_prob with the other
 * targets ignored (the mask's seed is seed + split). *valid: the targets
 * that count. tokens and targets hold B x T.
 * doc (B x T, or NULL: one document per row) packs rows: doc[b T + t] is
 * the number of <|end|> ids before position t in row b (read before any
 * masking), so attention stays inside a document and positions restart
 * after each <|end|>; under clm an <|end|>'s target (the next document's
 * first id) is ignored, as no prediction crosses a document's end. */
nl_status nl_objective_batch(const struct nl_dataset *ds, int obj, const struct nl_config *cfg,
                             int split, uint64_t seed, uint64_t index, int B, int T,
                             int32_t *tokens, int32_t *targets, int32_t *doc, int64_t *valid,
                             nl_error *err);

/* The loss rows the last stage scales its gradient by for a batch of
 * `valid` predictions out of `rows` positions: 0 (every position) for clm
 * when every target counts, else valid. */
int64_t nl_objective_loss_rows(int obj, int64_t valid, int64_t rows);

#endif
