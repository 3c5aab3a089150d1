/* Fuzz target for labelled examples (core/data/labelled.h: `neuroctl train
 * --objective classify --data FILE`, a file of `label<TAB>text` lines a
 * user may have downloaded). The input is the file, read as bytes (ids
 * 0..255) with a quarter held out; the first byte of the input also picks
 * the batch shape (B 1..4, T 1..16).
 *
 * Property: no crash and no sanitizer report; a file that is taken gives
 * classes in strictly increasing order, every example a class below their
 * number and at least one id, each within the vocabulary; its batches
 * (training, held out, and the held-out split in order) hold ids of the
 * vocabulary, lengths within 1..T and labels of the classes, but for the
 * evaluation's rows past the end of the split: label -1 over one id. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/data/labelled.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_labelled: %s\n", what);
    abort();
}

/* rows from count on are the evaluation's rows past the end: label -1
 * over one pad id */
static void check_rows(const nl_labelled *ds, int B, int T, const int32_t *tokens,
                       const int32_t *lengths, const int32_t *labels, int count)
{
    for (int b = 0; b < B; b++) {
        if (lengths[b] < 1 || lengths[b] > T)
            fail("a length outside 1..T");
        if (b >= count ? labels[b] != -1 || lengths[b] != 1
                       : labels[b] < 0 || labels[b] >= ds->n_classes)
            fail("a label outside the classes, or a row past the end that is not one");
        for (int t = 0; t < T; t++)
            if (tokens[b * T + t] < 0 || tokens[b * T + t] > 255)
                fail("an id outside the vocabulary");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char path[64];
    if (!path[0]) {
        snprintf(path, sizeof path, "/tmp/nl_fuzz_labelled_XXXXXX");
        int fd = mkstemp(path); /* a name of our own; each input writes it anew */
        if (fd < 0)
            abort();
        close(fd);
    }
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0)
        abort();
    const int B = size ? 1 + data[0] % 4 : 1, T = size ? 1 + (data[0] >> 2) % 16 : 1;
    nl_labelled *ds = NULL;
    nl_error err = {0};
    const nl_status st = nl_labelled_load(&ds, path, NULL, 256, 0.25, 7, &err);
    unlink(path);
    if (st != NL_OK)
        return 0;
    for (int c = 1; c < ds->n_classes; c++)
        if (strcmp(ds->names[c - 1], ds->names[c]) >= 0)
            fail("classes not in strictly increasing order");
    if (ds->n_train > ds->n || ds->start[0] != 0)
        fail("the split or the first example's start");
    for (size_t i = 0; i < ds->n; i++) {
        if (ds->label[i] < 0 || ds->label[i] >= ds->n_classes)
            fail("an example's class");
        if (ds->start[i + 1] <= ds->start[i])
            fail("an example without ids");
        for (size_t k = ds->start[i]; k < ds->start[i + 1]; k++)
            if (ds->ids[k] < 0 || ds->ids[k] > 255)
                fail("an example's id");
    }
    int32_t tokens[4 * 16], lengths[4], labels[4], doc[4 * 16];
    for (int split = 0; split < 2; split++)
        for (uint64_t index = 0; index < 2; index++)
            if (nl_labelled_batch(ds, split, 3, index, B, T, tokens, lengths, labels, doc, &err) ==
                NL_OK)
                check_rows(ds, B, T, tokens, lengths, labels, B);
            else if ((split == 0 ? ds->n_train : ds->n - ds->n_train) > 0)
                fail("no batch from a split that has examples");
    const size_t batches = nl_labelled_eval_batches(ds, B);
    int seen = 0;
    for (size_t i = 0; i < batches; i++) {
        int count = 0;
        if (nl_labelled_eval_batch(ds, i, B, T, tokens, lengths, labels, doc, &count, &err) !=
            NL_OK)
            fail("an evaluation batch below their number");
        check_rows(ds, B, T, tokens, lengths, labels, count);
        seen += count;
    }
    if ((size_t)seen != ds->n - ds->n_train ||
        nl_labelled_eval_batch(ds, batches, B, T, tokens, lengths, labels, doc, NULL, &err) ==
            NL_OK)
        fail("the evaluation batches do not hold the held-out split once");
    nl_labelled_destroy(&ds);
    return 0;
}
