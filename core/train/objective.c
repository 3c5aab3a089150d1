/* The training objectives (objective.h): their names, the check of one
 * against a model, and the batches of the token objectives. */
#include "core/train/objective.h"

#include <string.h>

#include "core/data/data.h"
#include "core/model/config.h"
#include "core/tokenizer/tokenizer.h"

static const char *const names[] = {"clm", "mlm", "classify"};

const char *nl_objective_name(int obj)
{
    return obj >= 0 && obj < (int)(sizeof names / sizeof names[0]) ? names[obj] : "?";
}

nl_status nl_objective_parse(const char *name, int *obj, nl_error *err)
{
    for (int i = 0; name && i < (int)(sizeof names / sizeof names[0]); i++)
        if (strcmp(name, names[i]) == 0) {
            *obj = i;
            return NL_OK;
        }
    return nl_error_set(err, NL_ERR_INVALID, "'%.40s' is not clm, mlm or classify",
                        name ? name : "");
}

nl_status nl_objective_check(const nl_config *cfg, int *obj, nl_error *err)
{
    if (*obj == NL_OBJ_MODEL)
        *obj = cfg->objective;
    if (*obj == NL_OBJ_MLM && cfg->vocab_size <= NL_CONFIG_MASK_ID)
        return nl_error_set(err, NL_ERR_INVALID,
                            "--objective mlm: the model's vocab_size %lld does not hold the mask "
                            "id %d (<|pad|>)",
                            (long long)cfg->vocab_size, NL_CONFIG_MASK_ID);
    if (*obj == NL_OBJ_CLASSIFY && cfg->num_classes <= 0)
        return nl_error_set(err, NL_ERR_INVALID,
                            "--objective classify: the model has no classifier (set num_classes "
                            "in its config)");
    return NL_OK;
}

nl_status nl_objective_check_pack(const nl_config *cfg, int obj, nl_error *err)
{
    if (obj == NL_OBJ_CLASSIFY)
        return nl_error_set(err, NL_ERR_INVALID,
                            "--pack: not with --objective classify (each example is a row of "
                            "its own)");
    if (cfg->vocab_size <= NL_TOKEN_END)
        return nl_error_set(err, NL_ERR_INVALID,
                            "--pack: the model's vocab_size %lld does not hold <|end|> (id %d), "
                            "which ends a document",
                            (long long)cfg->vocab_size, NL_TOKEN_END);
    return NL_OK;
}

/* doc ids of packed rows, counted from the <|end|> ids of each row; under
 * clm an <|end|>'s target is ignored. Returns the targets ignored. */
static int64_t pack_rows(const int32_t *tokens, int32_t *targets, int32_t *doc, int B, int T,
                         int obj)
{
    int64_t ignored = 0;
    for (int b = 0; b < B; b++) {
        int32_t d = 0;
        for (int t = 0; t < T; t++) {
            const size_t i = (size_t)b * T + (size_t)t;
            doc[i] = d;
            if (tokens[i] != NL_TOKEN_END)
                continue;
            d++;
            if (obj == NL_OBJ_CLM && targets[i] >= 0) {
                targets[i] = -1;
                ignored++;
            }
        }
    }
    return ignored;
}

nl_status nl_objective_batch(const nl_dataset *ds, int obj, const nl_config *cfg, int split,
                             uint64_t seed, uint64_t index, int B, int T, int32_t *tokens,
                             int32_t *targets, int32_t *doc, int64_t *valid, nl_error *err)
{
    nl_status st = nl_dataset_batch(ds, split, seed, index, B, T, tokens, targets, err);
    *valid = (int64_t)B * T;
    if (st == NL_OK && doc) /* before the mask rewrites ids */
        *valid -= pack_rows(tokens, targets, doc, B, T, obj);
    if (st == NL_OK && obj == NL_OBJ_MLM)
        *valid = (int64_t)nl_mlm_mask(tokens, targets, (size_t)B * T, cfg->mask_prob,
                                      cfg->vocab_size, seed + (uint64_t)split, index);
    return st;
}

int64_t nl_objective_loss_rows(int obj, int64_t valid, int64_t rows)
{
    return obj == NL_OBJ_CLM && valid == rows ? 0 : valid;
}
