/* Token streams for training and the seeded batch sampler. */
#include "core/data/data.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "core/formats/fileio.h"
#include "core/model/config.h"
#include "core/model/rng.h"
#include "core/tokenizer/tokenizer.h"

nl_status nl_dataset_from_ids(nl_dataset **out, uint32_t *ids, size_t n, double holdout,
                              nl_error *err)
{
    *out = NULL;
    if (!(holdout >= 0.0 && holdout <= 0.5)) {
        free(ids);
        return nl_error_set(err, NL_ERR_INVALID, "holdout: %g must be in [0, 0.5]", holdout);
    }
    nl_dataset *ds = calloc(1, sizeof *ds);
    if (!ds) {
        free(ids);
        return nl_error_set(err, NL_ERR_NOMEM, "dataset: out of memory");
    }
    ds->ids = ids;
    ds->n = n;
    ds->n_train = n - (size_t)((double)n * holdout);
    *out = ds;
    return NL_OK;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

nl_status nl_dataset_load(nl_dataset **out, const char *path, int64_t vocab_size, double holdout,
                          nl_error *err)
{
    *out = NULL;
    char *buf = NULL;
    size_t len = 0;
    nl_status st = nl_file_read_all(path, NL_DATA_MAX_BYTES, &buf, &len, err);
    if (st != NL_OK)
        return st;
    const int tok = ends_with(path, ".tok");
    if (tok && len % 4 != 0) {
        free(buf);
        return nl_error_set(err, NL_ERR_FORMAT, "%s: %zu bytes is not a whole number of uint32 ids",
                            path, len);
    }
    const size_t n = tok ? len / 4 : len;
    uint32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        free(buf);
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory for %zu tokens", path, n);
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        if (tok) {
            const unsigned char *p = (const unsigned char *)buf + 4 * i;
            v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        } else {
            v = (unsigned char)buf[i];
        }
        if ((int64_t)v >= vocab_size) {
            free(buf);
            free(ids);
            return nl_error_set(
                err, NL_ERR_RANGE,
                "%s: token %u at index %zu is outside the model's vocabulary of %lld", path, v, i,
                (long long)vocab_size);
        }
        ids[i] = v;
    }
    free(buf);
    return nl_dataset_from_ids(out, ids, n, holdout, err);
}

void nl_dataset_destroy(nl_dataset **dsp)
{
    if (!dsp || !*dsp)
        return;
    free((*dsp)->ids);
    free(*dsp);
    *dsp = NULL;
}

nl_status nl_dataset_batch(const nl_dataset *ds, int split, uint64_t seed, uint64_t index, int B,
                           int T, int32_t *tokens, int32_t *targets, nl_error *err)
{
    const size_t lo = split ? ds->n_train : 0, hi = split ? ds->n : ds->n_train;
    if (hi - lo < (size_t)T + 1)
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s data has %zu tokens, fewer than one window of %d + 1",
                            split ? "held-out" : "training", hi - lo, T);
    nl_rng r;
    nl_rng_seed(&r, seed, 0xDA7A0000ULL + (uint64_t)split * 0x100000000ULL + index);
    const uint64_t starts = hi - lo - (uint64_t)T; /* offsets 0 .. starts - 1 */
    for (int b = 0; b < B; b++) {
        size_t o = lo + (size_t)nl_rng_below(&r, starts);
        for (int t = 0; t < T; t++) {
            tokens[(size_t)b * T + t] = (int32_t)ds->ids[o + t];
            targets[(size_t)b * T + t] = (int32_t)ds->ids[o + t + 1];
        }
    }
    return NL_OK;
}

nl_status nl_dataset_load_model(nl_dataset **out, const char *path, const char *tok_text,
                                int64_t vocab_size, double holdout, const char *model,
                                nl_dataset_info *info, nl_error *err)
{
    nl_dataset_info scratch;
    if (!info)
        info = &scratch;
    memset(info, 0, sizeof *info);
    *out = NULL;
    if (!tok_text || ends_with(path, ".tok"))
        return nl_dataset_load(out, path, vocab_size, holdout, err);
    nl_tokenizer *tok = NULL;
    char *text = NULL;
    int32_t *ids = NULL;
    size_t len = 0, n = 0;
    nl_status st = nl_tokenizer_load_buffer(&tok, tok_text, strlen(tok_text), err);
    if (st != NL_OK) {
        nl_error_prefix(err, "%s: tokenizer", model);
        return st;
    }
    if (nl_tokenizer_vocab_size(tok) > vocab_size) {
        st = nl_error_set(err, NL_ERR_SHAPE,
                          "%s: tokenizer has %d ids but the model's vocabulary is %lld (grow it "
                          "with neuroctl grow)",
                          model, nl_tokenizer_vocab_size(tok), (long long)vocab_size);
        goto out;
    }
    if ((st = nl_file_read_all(path, NL_DATA_MAX_BYTES, &text, &len, err)) != NL_OK)
        goto out;
    double t0 = nl_mono_s();
    if ((st = nl_tokenizer_encode(tok, text, len, &ids, &n, err)) != NL_OK) {
        nl_error_prefix(err, "%s", path);
        goto out;
    }
    info->tokenized = 1;
    info->text_bytes = len;
    info->encode_s = nl_mono_s() - t0;
    /* ids are in [0, vocab) by construction; the dataset keeps uint32 */
    st = nl_dataset_from_ids(out, (uint32_t *)ids, n, holdout, err);
    ids = NULL;
out:
    free(ids);
    free(text);
    nl_tokenizer_destroy(&tok);
    return st;
}

/* ---------------------------------------------------------------- masked LM */

_Static_assert(NL_CONFIG_MASK_ID == NL_TOKEN_PAD, "the mask id is the reserved <|pad|>");

size_t nl_mlm_mask(int32_t *tokens, int32_t *targets, size_t n, double mask_prob,
                   int64_t vocab_size, uint64_t seed, uint64_t index)
{
    nl_rng r;
    size_t chosen = 0;
    nl_rng_seed(&r, seed ^ nl_rng_hash("mlm"), index);
    for (size_t i = 0; i < n; i++) {
        targets[i] = -1;
        if (nl_rng_uniform(&r) >= mask_prob)
            continue;
        chosen++;
        targets[i] = tokens[i];
        const double u = nl_rng_uniform(&r);
        if (u < 0.8)
            tokens[i] = NL_CONFIG_MASK_ID;
        else if (u < 0.9)
            tokens[i] = (int32_t)nl_rng_below(&r, (uint64_t)vocab_size);
    }
    return chosen;
}
