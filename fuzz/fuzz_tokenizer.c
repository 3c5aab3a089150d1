/* Fuzz target for the tokenizer file reader, encoder, decoder and
 * learner. The input is a tokenizer file, optionally followed by a NUL
 * byte and text (a valid file never contains NUL). When the file loads:
 *  - saving it must give back exactly the same bytes;
 *  - the text must round-trip through encode/decode, and the ids must
 *    match a naive reference encoder;
 *  - learning a few merges from the text must keep every old id's bytes
 *    and still round-trip.
 * A broken oracle aborts: that is how the fuzzer reports it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void require(int ok)
{
    if (!ok)
        abort();
}

/* Every merge in rank order, left to right, per word. */
static size_t ref_encode(const nl_tokenizer *t, const uint8_t *s, size_t len, int32_t *out)
{
    size_t n = 0;
    int32_t nm = nl_tokenizer_num_merges(t);
    for (size_t pos = 0; pos < len;) {
        size_t end = nl_tokenizer_split_next(nl_tokenizer_split_mode(t), s, len, pos),
               k = end - pos;
        int32_t *w = out + n;
        for (size_t i = 0; i < k; i++)
            w[i] = nl_tokenizer_byte_id(t, s[pos + i]);
        for (int32_t r = 0; r < nm && k > 1; r++) {
            int32_t a = 0, b = 0, id = 0;
            require(nl_tokenizer_merge_at(t, r, &a, &b, &id) == NL_OK);
            size_t wr = 0;
            for (size_t rd = 0; rd < k;) {
                if (rd + 1 < k && w[rd] == a && w[rd + 1] == b) {
                    w[wr++] = id;
                    rd += 2;
                } else {
                    w[wr++] = w[rd++];
                }
            }
            k = wr;
        }
        n += k;
        pos = end;
    }
    return n;
}

static void round_trip(nl_tokenizer *t, const uint8_t *s, size_t len)
{
    nl_error err;
    int32_t *ids = NULL;
    char *back = NULL;
    size_t n = 0, bl = 0;
    require(nl_tokenizer_encode(t, s, len, &ids, &n, &err) == NL_OK);
    require(n <= len);
    for (size_t i = 0; i < n; i++)
        require(ids[i] >= 0 && ids[i] < nl_tokenizer_vocab_size(t) &&
                !nl_tokenizer_is_special(t, ids[i]));
    if ((uint64_t)len * (uint64_t)(nl_tokenizer_num_merges(t) + 1) < 400000) {
        int32_t *ref = malloc((len ? len : 1) * sizeof *ref);
        require(ref != NULL);
        require(ref_encode(t, s, len, ref) == n && (n == 0 || memcmp(ref, ids, n * 4) == 0));
        free(ref);
    }
    require(nl_tokenizer_decode(t, ids, n, &back, &bl, &err) == NL_OK);
    require(bl == len && (len == 0 || memcmp(back, s, len) == 0));
    free(ids);
    free(back);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    nl_error err;
    nl_tokenizer *t = NULL;
    const uint8_t *nul = memchr(data, 0, size);
    size_t k = nul ? (size_t)(nul - data) : size;
    const uint8_t *text = nul ? nul + 1 : data;
    size_t tlen = nul ? size - k - 1 : size;

    /* the whole input, NULs and all, must never crash the reader */
    if (nl_tokenizer_load_buffer(&t, data, size, &err) == NL_OK)
        nl_tokenizer_destroy(&t);
    if (nl_tokenizer_load_buffer(&t, data, k, &err) != NL_OK) {
        require(t == NULL && err.status != NL_OK && err.msg[0] != '\0');
        return 0;
    }
    char *saved = NULL;
    size_t sl = 0;
    require(nl_tokenizer_save_buffer(t, &saved, &sl, &err) == NL_OK);
    require(sl == k && memcmp(saved, data, k) == 0);
    free(saved);

    round_trip(t, text, tlen);

    /* learn a few merges from the text: old ids keep their bytes */
    int32_t old = nl_tokenizer_vocab_size(t);
    uint8_t *snap = NULL;
    size_t *offs = malloc(((size_t)old + 1) * sizeof *offs);
    size_t total = 0;
    require(offs != NULL);
    for (int32_t id = 0; id < old; id++) {
        const uint8_t *p;
        size_t l;
        require(nl_tokenizer_token_bytes(t, id, &p, &l) == NL_OK);
        offs[id] = total;
        total += l;
    }
    offs[old] = total;
    snap = malloc(total ? total : 1);
    require(snap != NULL);
    for (int32_t id = 0; id < old; id++) {
        const uint8_t *p;
        size_t l;
        nl_tokenizer_token_bytes(t, id, &p, &l);
        memcpy(snap + offs[id], p, l);
    }
    nl_tokenizer_train_opts o = nl_tokenizer_train_opts_default();
    o.min_count = 1;
    require(nl_tokenizer_learn(t, text, tlen, 16, &o, &err) == NL_OK);
    require(nl_tokenizer_vocab_size(t) >= old && nl_tokenizer_vocab_size(t) <= old + 16);
    for (int32_t id = 0; id < old; id++) {
        const uint8_t *p;
        size_t l;
        nl_tokenizer_token_bytes(t, id, &p, &l);
        require(l == offs[id + 1] - offs[id] && memcmp(p, snap + offs[id], l) == 0);
    }
    round_trip(t, text, tlen);
    free(snap);
    free(offs);
    nl_tokenizer_destroy(&t);
    return 0;
}
