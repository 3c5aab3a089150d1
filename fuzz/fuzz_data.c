/* Fuzz target for training data files (core/data/data.h: `neuroctl train
 * --data FILE` and a coordinator's data root): a `.tok` file of
 * little-endian uint32 ids, or text read as bytes or through a model's
 * tokenizer.
 *
 * The input: byte 0 picks how the rest is read (bits 0-1: 0 a `.tok`
 * file, 1 text as bytes, 2 text through a small tokenizer, 3 a `.tok`
 * file for a model with that tokenizer, which reads its ids directly),
 * the vocabulary (bits 2-7: 1 + 8 * value, up to 505; the tokenizer's 259
 * ids need 262) and, with byte 1, the holdout (byte 1 / 256,
 * above 0.5 refused) and the batch shape (B 1..4, T 1..16). The rest is
 * the file.
 *
 * Property: no crash and no sanitizer report; a file that is taken gives
 * every id below the vocabulary, as many as the file holds (the bytes, or
 * a quarter of them), split as the holdout says; a `.tok` file of a length
 * that is not a multiple of 4, an id at or above the vocabulary or a
 * holdout above 0.5 is refused; every batch of a split with a window
 * holds T consecutive ids of that split and their successors, and a split
 * without one is refused; the masked-LM rule keeps each position's
 * target -1 or its original id and changes only chosen positions. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/data/data.h"
#include "core/model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* a byte-level tokenizer with three merges ("th", "the", " a"), as a
 * checkpoint carries one: 262 ids */
static const char tok_text[] = "neurollm-bpe 1\nmerges 3\n116 104\n259 101\n32 97\n";
#define TOK_IDS 262

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_data: %s\n", what);
    abort();
}

static char paths[2][64];

static void remove_files(void)
{
    for (int i = 0; i < 2; i++)
        if (paths[i][0])
            unlink(paths[i]);
}

/* a temporary file of our own with `suffix`, written anew by each input */
static const char *file_for(int tok)
{
    char *p = paths[tok];
    if (!p[0]) {
        snprintf(p, 64, "/tmp/nl_fuzz_data_XXXXXX%s", tok ? ".tok" : ".txt");
        int fd = mkstemps(p, 4);
        if (fd < 0)
            abort();
        close(fd);
        if (!paths[!tok][0])
            atexit(remove_files);
    }
    return p;
}

static void check_batches(const nl_dataset *ds, int B, int T)
{
    int32_t tokens[4 * 16], targets[4 * 16];
    nl_error err = {0};
    for (int split = 0; split < 2; split++) {
        const size_t lo = split ? ds->n_train : 0, hi = split ? ds->n : ds->n_train;
        for (uint64_t index = 0; index < 3; index++) {
            const nl_status st =
                nl_dataset_batch(ds, split, 11, index, B, T, tokens, targets, &err);
            if (hi - lo < (size_t)T + 1) {
                if (st == NL_OK)
                    fail("a batch from a split shorter than one window");
                continue;
            }
            if (st != NL_OK)
                fail("no batch from a split with a window");
            for (int b = 0; b < B; b++) {
                /* the window's offset: where its first id can be, within the split */
                int found = 0;
                for (size_t o = lo; o + (size_t)T < hi && !found; o++) {
                    int same = 1;
                    for (int t = 0; t < T && same; t++)
                        same = tokens[b * T + t] == (int32_t)ds->ids[o + t] &&
                               targets[b * T + t] == (int32_t)ds->ids[o + t + 1];
                    found = same;
                }
                if (!found)
                    fail("a batch row that is no window of its split");
            }
        }
    }
}

static void check_mask(const nl_dataset *ds, int64_t vocab)
{
    int32_t tokens[64], targets[64], orig[64];
    const size_t n = ds->n < 64 ? ds->n : 64;
    for (size_t i = 0; i < n; i++)
        tokens[i] = orig[i] = (int32_t)ds->ids[i];
    const size_t chosen = nl_mlm_mask(tokens, targets, n, 0.3, vocab, 5, 1);
    size_t seen = 0;
    for (size_t i = 0; i < n; i++) {
        if (targets[i] == -1) {
            if (tokens[i] != orig[i])
                fail("the mask changed a position it did not choose");
            continue;
        }
        seen++;
        if (targets[i] != orig[i])
            fail("a chosen position's target is not its id");
        if (tokens[i] != orig[i] && tokens[i] != NL_CONFIG_MASK_ID &&
            (tokens[i] < 0 || tokens[i] >= vocab))
            fail("a chosen position became an id outside the vocabulary");
    }
    if (seen != chosen)
        fail("the mask's count is not the positions it chose");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    const int mode = data[0] & 3;
    const int64_t vocab = 1 + 8 * (int64_t)(data[0] >> 2);
    const double holdout = data[1] / 256.0;
    const int B = 1 + data[1] % 4, T = 1 + (data[1] >> 2) % 16;
    const int tok_file = mode == 0 || mode == 3;
    const char *path = file_for(tok_file);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data + 2, 1, size - 2, f) != size - 2 || fclose(f) != 0)
        abort();
    const size_t len = size - 2;
    nl_dataset *ds = NULL;
    nl_dataset_info info;
    nl_error err = {0};
    const nl_status st = nl_dataset_load_model(&ds, path, mode >= 2 ? tok_text : NULL, vocab,
                                               holdout, "fuzz", &info, &err);
    const int tokenized = mode == 2;
    if (tokenized && vocab < TOK_IDS) { /* the tokenizer's ids do not fit */
        if (st == NL_OK)
            fail("a tokenizer larger than the vocabulary taken");
        return 0;
    }
    int over = 0; /* an id the file holds at or above the vocabulary */
    if (!tokenized)
        for (size_t i = 0; i + (tok_file ? 3 : 0) < len && !over; i += tok_file ? 4 : 1) {
            const uint8_t *p = data + 2 + i;
            const uint64_t v = tok_file ? (uint64_t)p[0] | (uint64_t)p[1] << 8 |
                                              (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24
                                        : p[0];
            over = v >= (uint64_t)vocab;
        }
    const int refused = holdout > 0.5 || (tok_file && len % 4 != 0) || over;
    if (refused != (st != NL_OK))
        fail(refused ? "a file taken that should be refused" : "a good file refused");
    if (st != NL_OK)
        return 0;
    if (info.tokenized != tokenized)
        fail("the tokenizer used, or not, against the file's kind");
    if (!tokenized && ds->n != (tok_file ? len / 4 : len))
        fail("not as many ids as the file holds");
    if (tokenized && (info.text_bytes != len || (len > 0) != (ds->n > 0) || ds->n > len))
        fail("tokenized text of another length");
    for (size_t i = 0; i < ds->n; i++)
        if (ds->ids[i] >= (uint64_t)vocab)
            fail("an id outside the vocabulary");
    /* the held-out tail: the holdout's share of the ids, rounded down */
    const size_t held = ds->n - ds->n_train;
    if (ds->n_train > ds->n || (double)held > (double)ds->n * holdout ||
        (double)held + 1.0 <= (double)ds->n * holdout)
        fail("the split is not the holdout's");
    check_batches(ds, B, T);
    check_mask(ds, vocab);
    nl_dataset_destroy(&ds);
    return 0;
}
