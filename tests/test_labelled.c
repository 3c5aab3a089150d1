/* Unit tests for labelled examples (core/data/labelled.c): the held-out split
 * is evaluated in order, each example exactly once (the last batch
 * partial, its other rows scored out), scoring skips those rows, and a
 * bad line is refused by number. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/data/labelled.h"
#include "tests/check.h"

/* A file of n examples "cK<TAB>example I", classes c0..c2. */
static void write_examples(const char *path, int n)
{
    FILE *f = fopen(path, "w");
    for (int i = 0; i < n; i++)
        fprintf(f, "c%d\texample %d\n", i % 3, i);
    fclose(f);
}

/* The example (index into ds) whose ids equal row b's first lengths[b]. */
static long find_example(const nl_labelled *ds, const int32_t *row, int len)
{
    for (size_t e = 0; e < ds->n; e++) {
        const size_t n = ds->start[e + 1] - ds->start[e];
        if ((int)n == len && memcmp(ds->ids + ds->start[e], row, n * sizeof *row) == 0)
            return (long)e;
    }
    return -1;
}

static void test_in_order(int n_examples, double holdout, int B)
{
    char path[] = "/tmp/test_labelled_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    write_examples(path, n_examples);
    nl_labelled *ds = NULL;
    nl_error err = {0};
    CHECK_OK(nl_labelled_load(&ds, path, NULL, 256, holdout, 7, &err), &err);
    unlink(path);
    if (!ds)
        return;
    const int T = 16;
    const size_t held = ds->n - ds->n_train, batches = nl_labelled_eval_batches(ds, B);
    CHECK(batches == (held + (size_t)B - 1) / (size_t)B, "%zu batches for %zu held out by %d",
          batches, held, B);
    int32_t *tokens = malloc((size_t)B * T * sizeof *tokens), *doc = malloc((size_t)B * T * 4);
    int32_t *lengths = malloc((size_t)B * 4), *labels = malloc((size_t)B * 4);
    int *seen = calloc(ds->n, sizeof *seen);
    float *probs = malloc((size_t)B * 3 * sizeof *probs);
    double ce = 0.0;
    int64_t right = 0, scored = 0;
    size_t counted = 0;
    for (size_t i = 0; i < batches; i++) {
        int count = -1;
        CHECK_OK(nl_labelled_eval_batch(ds, i, B, T, tokens, lengths, labels, doc, &count, &err),
                 &err);
        counted += (size_t)count;
        for (int b = 0; b < B; b++) {
            if (b >= count) { /* past the end: scored out, one pad */
                CHECK(labels[b] == -1 && lengths[b] == 1 && doc[b * T] == 0 && doc[b * T + 1] == 1,
                      "batch %zu row %d past the end: label %d length %d", i, b, labels[b],
                      lengths[b]);
                continue;
            }
            const long e = find_example(ds, tokens + b * T, lengths[b]);
            CHECK(e == (long)(ds->n_train + i * (size_t)B + (size_t)b),
                  "batch %zu row %d is example %ld, not the next in order", i, b, e);
            if (e >= 0) {
                seen[e]++;
                CHECK(labels[b] == ds->label[e], "row %d: label %d, example's %d", b, labels[b],
                      ds->label[e]);
            }
            for (int t = 0; t < T; t++)
                CHECK(doc[b * T + t] == (t >= lengths[b]), "row %d position %d: doc %d", b, t,
                      doc[b * T + t]);
        }
        /* probabilities that favour class 0: right where the label is 0 */
        for (int b = 0; b < B; b++) {
            probs[b * 3] = 0.5f;
            probs[b * 3 + 1] = probs[b * 3 + 2] = 0.25f;
        }
        nl_labelled_score(probs, labels, B, 3, &ce, &right, &scored);
    }
    CHECK(counted == held && (size_t)scored == held, "%zu counted, %lld scored, %zu held out",
          counted, (long long)scored, held);
    for (size_t e = 0; e < ds->n; e++)
        CHECK(seen[e] == (e >= ds->n_train), "example %zu seen %d times (%s)", e, seen[e],
              e >= ds->n_train ? "held out" : "training");
    int64_t zeros = 0;
    for (size_t e = ds->n_train; e < ds->n; e++)
        zeros += ds->label[e] == 0;
    CHECK(right == zeros, "%lld right, %lld held-out examples of class 0", (long long)right,
          (long long)zeros);
    CHECK(fabs(ce - (double)held * -log(0.5) * (double)zeros / (double)held -
               (double)(held - (size_t)zeros) * -log(0.25)) < 1e-9,
          "cross-entropy %g", ce);
    CHECK(nl_labelled_eval_batch(ds, batches, B, T, tokens, lengths, labels, doc, NULL, &err) ==
              NL_ERR_RANGE,
          "a batch past the last was made");
    free(tokens);
    free(doc);
    free(lengths);
    free(labels);
    free(seen);
    free(probs);
    nl_labelled_destroy(&ds);
}

static void test_bad_line(void)
{
    char path[] = "/tmp/test_labelled_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    FILE *f = fopen(path, "w");
    fprintf(f, "yes\tfine\n\nno label here\n");
    fclose(f);
    nl_labelled *ds = NULL;
    nl_error err = {0};
    nl_status st = nl_labelled_load(&ds, path, NULL, 256, 0.1, 1, &err);
    unlink(path);
    CHECK(st == NL_ERR_FORMAT && strstr(err.msg, ":3: expected label<TAB>text") && !ds,
          "a line without a tab: %s", err.msg);
    /* a NUL inside a label (fuzz_labelled found it read past the class
     * name it cut short) */
    strcpy(path, "/tmp/test_labelled_XXXXXX");
    fd = mkstemp(path);
    close(fd);
    f = fopen(path, "wb");
    static const char nul[] = "a\tx\nb\0c\ty\n";
    fwrite(nul, 1, sizeof nul - 1, f);
    fclose(f);
    st = nl_labelled_load(&ds, path, NULL, 256, 0.1, 1, &err);
    unlink(path);
    CHECK(st == NL_ERR_FORMAT && strstr(err.msg, ":2: the label holds a NUL byte") && !ds,
          "a label with a NUL byte: %s", err.msg);
}

int main(void)
{
    test_in_order(40, 0.25, 4); /* 10 held out: batches of 4, 4, 2 */
    test_in_order(41, 0.5, 7);  /* 20 held out: the last batch holds 6 of 7 */
    test_in_order(9, 0.34, 16); /* fewer held out than one batch */
    test_bad_line();
    return check_done("test_labelled");
}
