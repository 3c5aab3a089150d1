/* Tokenizer benchmark: training time for a vocabulary and encoding /
 * decoding throughput on one thread, printed as JSON. Run through
 * bench/bench_tokenizer.sh, which builds the text.
 *
 *   bench_tokenizer TEXT_FILE [VOCAB_SIZE] [REPEATS] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/formats/fileio.h"
#include "core/tokenizer/tokenizer.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int fail(const char *what, const nl_error *err)
{
    fprintf(stderr, "bench_tokenizer: %s: %s\n", what, err->msg);
    return 1;
}

/* Best of `repeats` encodes of the text in seconds; *n gets the id count. */
static double time_encode(nl_tokenizer *t, const char *text, size_t len, int32_t *ids, int repeats,
                          int fresh_cache, size_t *n, nl_error *err)
{
    double best = 1e30;
    for (int r = 0; r < repeats; r++) {
        if (fresh_cache)
            nl_tokenizer_set_cache(t, fresh_cache > 0 ? NL_TOKENIZER_DEFAULT_CACHE : 0, err);
        double t0 = now();
        if (nl_tokenizer_encode_into(t, text, len, ids, len, n, err) != NL_OK)
            return -1;
        double s = now() - t0;
        best = s < best ? s : best;
    }
    return best;
}

int main(int argc, char **argv)
{
    nl_error err = {0};
    char *text = NULL;
    size_t len = 0;
    if (argc < 2) {
        fprintf(stderr, "usage: bench_tokenizer TEXT_FILE [VOCAB_SIZE] [REPEATS]\n");
        return 2;
    }
    int vocab = argc > 2 ? atoi(argv[2]) : 8192;
    int repeats = argc > 3 ? atoi(argv[3]) : 3;
    if (nl_file_read_all(argv[1], (size_t)1 << 30, &text, &len, &err) != NL_OK)
        return fail("read", &err);

    /* training: word counting, then merges */
    nl_tokenizer *t = NULL;
    nl_bpe_corpus *c = NULL;
    double t0 = now();
    if (nl_bpe_corpus_new(&c, NL_TOKENIZER_SPLIT_UNICODE, &err) != NL_OK ||
        nl_bpe_corpus_add(c, text, len, &err) != NL_OK)
        return fail("count", &err);
    double t1 = now();
    if (nl_tokenizer_new_bytes(&t, &err) != NL_OK ||
        nl_tokenizer_learn_corpus(t, c, vocab - NL_TOKEN_FIRST_MERGE, NULL, &err) != NL_OK)
        return fail("train", &err);
    double t2 = now();
    size_t unique = nl_bpe_corpus_unique_words(c);
    nl_bpe_corpus_destroy(&c);

    /* encoding: a cold cache (emptied before each pass), a warm one, none */
    int32_t *ids = malloc(len * sizeof *ids);
    size_t n = 0;
    if (!ids)
        return 1;
    double cold = time_encode(t, text, len, ids, repeats, 1, &n, &err);
    nl_tokenizer_encode_into(t, text, len, ids, len, &n, &err);
    double warm = time_encode(t, text, len, ids, repeats, 0, &n, &err);
    double nocache = time_encode(t, text, len, ids, repeats, -1, &n, &err);
    if (cold < 0 || warm < 0 || nocache < 0)
        return fail("encode", &err);

    /* decoding */
    char *back = NULL;
    size_t bl = 0;
    double dec = 1e30;
    for (int r = 0; r < repeats; r++) {
        double d0 = now();
        if (nl_tokenizer_decode(t, ids, n, &back, &bl, &err) != NL_OK)
            return fail("decode", &err);
        double s = now() - d0;
        dec = s < dec ? s : dec;
        if (r + 1 < repeats)
            free(back);
    }
    int same = bl == len && memcmp(back, text, len) == 0;

    double mb = (double)len / 1e6;
    printf("{\n"
           "  \"bench\": \"tokenizer\",\n"
           "  \"text_bytes\": %zu,\n"
           "  \"unique_words\": %zu,\n"
           "  \"vocab_size\": %d,\n"
           "  \"train_count_s\": %.3f,\n"
           "  \"train_merges_s\": %.3f,\n"
           "  \"train_total_s\": %.3f,\n"
           "  \"ids\": %zu,\n"
           "  \"bytes_per_id\": %.3f,\n"
           "  \"encode_mb_s_cold_cache\": %.1f,\n"
           "  \"encode_mb_s_warm_cache\": %.1f,\n"
           "  \"encode_mb_s_no_cache\": %.1f,\n"
           "  \"decode_mb_s\": %.1f,\n"
           "  \"round_trip_ok\": %s,\n"
           "  \"threads\": 1\n"
           "}\n",
           len, unique, nl_tokenizer_vocab_size(t), t1 - t0, t2 - t1, t2 - t0, n,
           (double)len / (double)(n ? n : 1), mb / cold, mb / warm, mb / nocache, mb / dec,
           same ? "true" : "false");
    free(back);
    free(ids);
    free(text);
    nl_tokenizer_destroy(&t);
    return same ? 0 : 1;
}
