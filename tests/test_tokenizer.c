/* The BPE tokenizer: pre-tokenizer splits, merges learned from a corpus
 * derived by hand, encoding against a naive reference, round trips on
 * random and awkward bytes, incremental learning, the file format and a
 * matrix of corrupt files. */
#include "core/tokenizer/tokenizer.h"
#include "tests/check.h"

#include <stdint.h>
#include <unistd.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void)
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 33);
}

/* ---- helpers ---- */

/* The words of s joined by '|'. */
static void split_join(nl_tokenizer_split mode, const char *s, size_t len, char *out, size_t cap)
{
    size_t o = 0;
    for (size_t pos = 0; pos < len;) {
        size_t end = nl_tokenizer_split_next(mode, s, len, pos);
        if (pos && o + 1 < cap)
            out[o++] = '|';
        for (size_t i = pos; i < end && o + 1 < cap; i++)
            out[o++] = s[i];
        pos = end;
    }
    out[o] = '\0';
}

/* Reference encoder: every merge, in rank order, applied left to right to
 * each word. Slow and obviously right. */
static size_t ref_encode(const nl_tokenizer *t, const uint8_t *s, size_t len, int32_t *out)
{
    size_t n = 0;
    int32_t nm = nl_tokenizer_num_merges(t);
    for (size_t pos = 0; pos < len;) {
        size_t end = nl_tokenizer_split_next(nl_tokenizer_split_mode(t), s, len, pos),
               k = end - pos;
        int32_t *w = out + n;
        for (size_t i = 0; i < k; i++)
            w[i] = s[pos + i];
        for (int32_t r = 0; r < nm && k > 1; r++) {
            int32_t a, b, id = NL_TOKEN_FIRST_MERGE + r;
            nl_tokenizer_merge_pair(t, id, &a, &b);
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

/* encode, compare with the reference, decode, compare with the input */
static int round_trip(nl_tokenizer *t, const void *s, size_t len, const char *what)
{
    nl_error err = {0};
    int32_t *ids = NULL;
    size_t n = 0, dl = 0;
    char *back = NULL;
    int ok = 1;
    nl_status st = nl_tokenizer_encode(t, s, len, &ids, &n, &err);
    CHECK(st == NL_OK, "%s: encode: %s", what, err.msg);
    if (st != NL_OK)
        return 0;
    int32_t *ref = malloc((len ? len : 1) * sizeof *ref);
    size_t rn = ref_encode(t, s, len, ref);
    ok = rn == n && (n == 0 || memcmp(ref, ids, n * sizeof *ids) == 0);
    CHECK(ok, "%s: %zu ids, reference %zu (len %zu)", what, n, rn, len);
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= NL_TOKEN_BEGIN && ids[i] <= NL_TOKEN_PAD) {
            CHECK(0, "%s: special id %d emitted at %zu", what, ids[i], i);
            ok = 0;
            break;
        }
    st = nl_tokenizer_decode(t, ids, n, &back, &dl, &err);
    CHECK(st == NL_OK, "%s: decode: %s", what, err.msg);
    int same = st == NL_OK && dl == len && (len == 0 || memcmp(back, s, len) == 0);
    CHECK(same, "%s: round trip differs (len %zu -> %zu)", what, len, dl);
    free(ids);
    free(ref);
    free(back);
    return ok && same;
}

/* ---- pre-tokenization ---- */

static void test_split(void)
{
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"Hello world", "Hello| world"},
        {"I'm don't they'll we've you're she'd it's",
         "I|'m| don|'t| they|'ll| we|'ve| you|'re| she|'d| it|'s"},
        {"'s'll'x", "'s|'ll|'|x"},
        {"O'Neil's", "O|'|Neil|'s"},
        {"'hello", "'|hello"},
        {" 's", " '|s"},
        {"a  b", "a| | b"},
        {"a   \n\nb", "a|   \n|\n|b"},
        {"x  ", "x|  "},
        {"\t\tfoo", "\t|\t|foo"},
        {"abc123 456!!  ?", "abc|123| 456|!!| | ?"},
        {"2024\xe5\xb9\xb4", "2024|\xe5\xb9\xb4"},
        {"\xd0\x9f\xd1\x80\xd0\xb8 \xd0\xbc\xd0\xb8\xd1\x80",
         "\xd0\x9f\xd1\x80\xd0\xb8| \xd0\xbc\xd0\xb8\xd1\x80"},
        {"hi\xf0\x9f\x98\x80there, x", "hi\xf0\x9f\x98\x80there|,| x"},
        {"foo.bar(baz);", "foo|.|bar|(|baz|);"},
        {"  ", "  "},
        {" ", " "},
        {"\n", "\n"},
        {"a\r\nb", "a|\r|\n|b"},
        {"x \t y", "x| \t| y"},
    };
    char got[256];
    /* both class tables agree on ASCII and on these: the version 1 byte
     * classes (every byte >= 0x80 a letter) first */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        split_join(NL_TOKENIZER_SPLIT_BYTES, cases[i].in, strlen(cases[i].in), got, sizeof got);
        CHECK(strcmp(got, cases[i].want) == 0, "split '%s': got '%s' want '%s'", cases[i].in, got,
              cases[i].want);
        if (strstr(cases[i].in, "\xf0\x9f\x98\x80"))
            continue; /* an emoji is a letter only to the byte classes */
        split_join(NL_TOKENIZER_SPLIT_UNICODE, cases[i].in, strlen(cases[i].in), got, sizeof got);
        CHECK(strcmp(got, cases[i].want) == 0, "unicode split '%s': got '%s' want '%s'",
              cases[i].in, got, cases[i].want);
    }
    /* Unicode classes, as the `tokenizers` library's ByteLevel
     * pre-tokenizer cuts them (each checked with tokenizers 0.15.2) */
    static const struct {
        const char *in, *want;
    } uni[] = {
        {"don\u2019t won\u2019t it\u2019s",
         "don|\u2019|t| won|\u2019|t| it|\u2019|s"}, /* 11 words, not 3 */
        {"na\u00efve caf\u00e9", "na\u00efve| caf\u00e9"},
        {"a\u2014b", "a|\u2014|b"},
        {"x\u3000\u3000y", "x|\u3000|\u3000|y"},
        {"x \u3000y", "x| |\u3000|y"},
        {"x\u00a0y", "x|\u00a0|y"},
        {"\u00bd\u00b2 \u2460x", "\u00bd\u00b2| \u2460|x"},
        {"hi\U0001F600there, x", "hi|\U0001F600|there|,| x"},
        {"x\xc2\x85\xc2\x85y", "x|\xc2\x85|\xc2\x85|y"}, /* U+0085 */
        {"2024\u5e74", "2024|\u5e74"},
        {"\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
         "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8"},
        {"e\u0301t", "e|\u0301|t"},
        {"a\xff\xfe"
         "b \xc3",
         "a|\xff\xfe|b| \xc3"}, /* invalid UTF-8: class other */
        {"\xe3\x80 a", "\xe3\x80| a"},
    };
    for (size_t i = 0; i < sizeof uni / sizeof uni[0]; i++) {
        split_join(NL_TOKENIZER_SPLIT_UNICODE, uni[i].in, strlen(uni[i].in), got, sizeof got);
        CHECK(strcmp(got, uni[i].want) == 0, "unicode split case %zu '%s': got '%s' want '%s'", i,
              uni[i].in, got, uni[i].want);
    }
    /* NUL bytes are "other" bytes */
    const char nul[] = {'a', 0, 0, 'b', ' ', 0};
    for (int m = 0; m < 2; m++) {
        nl_tokenizer_split mode = m ? NL_TOKENIZER_SPLIT_BYTES : NL_TOKENIZER_SPLIT_UNICODE;
        size_t e1 = nl_tokenizer_split_next(mode, nul, sizeof nul, 0);
        size_t e2 = nl_tokenizer_split_next(mode, nul, sizeof nul, e1);
        size_t e3 = nl_tokenizer_split_next(mode, nul, sizeof nul, e2);
        size_t e4 = nl_tokenizer_split_next(mode, nul, sizeof nul, e3);
        CHECK(e1 == 1 && e2 == 3 && e3 == 4 && e4 == 6, "NUL split %zu %zu %zu %zu", e1, e2, e3,
              e4);
    }
}

static void test_safe_split(void)
{
    nl_error err = {0};
    nl_tokenizer *t = NULL;
    const char *corpus = "the cat sat on the mat.\nthe dog's bone, the   cat's toy\n";
    CHECK_OK(nl_tokenizer_train(&t, corpus, strlen(corpus), 300, NULL, &err), &err);
    if (!t)
        return;
    /* ASCII, and pieces of UTF-8: ideographic space, no-break space,
     * a curly quote, a letter, and a lone continuation byte */
    static const char *alpha[] = {"t", "h",      "e",      " ",      " ",      "c",
                                  "'", "s",      "\n",     "\t",     ".",      ",",
                                  "d", "\u3000", "\u00a0", "\u2019", "\u00e9", "\x80"};
    const size_t n_alpha = sizeof alpha / sizeof alpha[0];
    char buf[1400];
    for (int iter = 0; iter < 400; iter++) {
        size_t len = 0, want = 1 + rnd() % 400;
        while (len < want) {
            const char *piece = alpha[rnd() % n_alpha];
            memcpy(buf + len, piece, strlen(piece));
            len += strlen(piece);
        }
        size_t max = rnd() % len,
               p = nl_tokenizer_safe_split(nl_tokenizer_split_mode(t), buf, len, max);
        if (p == 0)
            continue;
        CHECK(p <= max || (p == len && len <= max), "split %zu beyond %zu", p, max);
        int32_t *whole = NULL, *a = NULL, *b = NULL;
        size_t nw = 0, na = 0, nb = 0;
        CHECK_OK(nl_tokenizer_encode(t, buf, len, &whole, &nw, &err), &err);
        CHECK_OK(nl_tokenizer_encode(t, buf, p, &a, &na, &err), &err);
        CHECK_OK(nl_tokenizer_encode(t, buf + p, len - p, &b, &nb, &err), &err);
        int same = na + nb == nw && memcmp(whole, a, na * sizeof *a) == 0 &&
                   memcmp(whole + na, b, nb * sizeof *b) == 0;
        CHECK(same, "safe split at %zu of %zu changes the ids", p, len);
        free(whole);
        free(a);
        free(b);
    }
    const nl_tokenizer_split U = NL_TOKENIZER_SPLIT_UNICODE;
    CHECK(nl_tokenizer_safe_split(U, "aaaa", 4, 2) == 0, "no safe split in one word");
    CHECK(nl_tokenizer_safe_split(U, "ab cd", 5, 4) == 2, "split before the space");
    CHECK(nl_tokenizer_safe_split(U, "ab", 2, 5) == 2, "whole text fits");
    CHECK(nl_tokenizer_safe_split(U, "a\u3000 b", 6, 5) == 0, "not after an ideographic space");
    CHECK(nl_tokenizer_safe_split(U, "a\u00e9 b", 5, 4) == 3, "after a two-byte letter");
    nl_tokenizer_destroy(&t);
}

/* ---- training ---- */

/* Sennrich's example, one word per line: low x5, lower x2, newest x6,
 * widest x3 (the "\n" words are single bytes and have no pairs).
 *
 * Pair counts: l o 7, o w 7, w e 8, e r 2, n e 6, e w 6, e s 9, s t 9,
 * w i 3, i d 3, d e 3. Ties go to the smallest (a, b) in ids.
 *  259 = e s     9 (beats s t 9: 'e' < 's'); w e drops to 2, d e to 0
 *  260 = es t    9
 *  261 = l o     7 (beats o w 7)
 *  262 = lo w    7
 *  263 = e w     6 (ties n e 6 and w est 6; (101,119) is smallest)
 *  264 = n ew    6 (beats ew est 6: 110 < 263)
 *  265 = new est 6
 *  266 = d est   3 (ties w i, i d: (100,260) is smallest)
 *  267 = i dest  3
 *  268 = w idest 3
 *  269 = e r     2 (beats low e 2: 101 < 262)
 *  270 = low er  2
 * after which every word is one token and no pair is left. */
static const char sennrich[] = "low\nlow\nlow\nlow\nlow\nlower\nlower\nnewest\nnewest\nnewest\n"
                               "newest\nnewest\nnewest\nwidest\nwidest\nwidest\n";

static void test_train_by_hand(void)
{
    static const int32_t want[][2] = {{101, 115}, {259, 116}, {108, 111}, {261, 119},
                                      {101, 119}, {110, 263}, {264, 260}, {100, 260},
                                      {105, 266}, {119, 267}, {101, 114}, {262, 269}};
    const int nwant = (int)(sizeof want / sizeof want[0]);
    nl_error err = {0};
    nl_tokenizer *t = NULL;
    CHECK_OK(nl_tokenizer_train(&t, sennrich, strlen(sennrich), 300, NULL, &err), &err);
    if (!t)
        return;
    CHECK(nl_tokenizer_num_merges(t) == nwant, "%d merges, want %d", nl_tokenizer_num_merges(t),
          nwant);
    for (int r = 0; r < nwant && r < nl_tokenizer_num_merges(t); r++) {
        int32_t a = -1, b = -1;
        nl_tokenizer_merge_pair(t, NL_TOKEN_FIRST_MERGE + r, &a, &b);
        CHECK(a == want[r][0] && b == want[r][1], "merge %d is %d %d, want %d %d",
              NL_TOKEN_FIRST_MERGE + r, a, b, want[r][0], want[r][1]);
    }
    const uint8_t *p = NULL;
    size_t len = 0;
    CHECK(nl_tokenizer_token_bytes(t, 270, &p, &len) == NL_OK && len == 5 &&
              memcmp(p, "lower", 5) == 0,
          "id 270 is 'lower'");
    CHECK(nl_tokenizer_token_bytes(t, 271, &p, &len) == NL_ERR_RANGE, "id 271 undefined");
    CHECK(nl_tokenizer_token_bytes(t, -1, &p, &len) == NL_ERR_RANGE, "id -1 undefined");
    int32_t a, b;
    CHECK(nl_tokenizer_merge_pair(t, 258, &a, &b) == NL_ERR_RANGE, "258 is no merge");
    /* "lowest" = low + est: merges by rank give 262 260 */
    int32_t *ids = NULL;
    size_t n = 0;
    CHECK_OK(nl_tokenizer_encode(t, "lowest", 6, &ids, &n, &err), &err);
    CHECK(n == 2 && ids[0] == 262 && ids[1] == 260, "lowest -> %zu ids", n);
    free(ids);
    nl_tokenizer_destroy(&t);

    /* asking for fewer merges stops early; 259 means none */
    CHECK_OK(nl_tokenizer_train(&t, sennrich, strlen(sennrich), 263, NULL, &err), &err);
    CHECK(t && nl_tokenizer_vocab_size(t) == 263, "vocab 263");
    nl_tokenizer_destroy(&t);
    CHECK_OK(nl_tokenizer_train(&t, sennrich, strlen(sennrich), 259, NULL, &err), &err);
    CHECK(t && nl_tokenizer_num_merges(t) == 0, "no merges");
    nl_tokenizer_destroy(&t);
    CHECK(nl_tokenizer_train(&t, sennrich, 10, 100, NULL, &err) == NL_ERR_INVALID && !t,
          "vocab 100 refused");
    /* min_count 3: merges stop before the two pairs of count 2 */
    nl_tokenizer_train_opts o = nl_tokenizer_train_opts_default();
    o.min_count = 3;
    CHECK_OK(nl_tokenizer_train(&t, sennrich, strlen(sennrich), 300, &o, &err), &err);
    CHECK(t && nl_tokenizer_num_merges(t) == 10, "min_count 3 gives 10 merges");
    nl_tokenizer_destroy(&t);
}

/* Naive trainer: recount every pair over every word occurrence before
 * each merge (dense counts, ids stay small here). Returns merges made. */
static int naive_train(const char *text, size_t len, int nmerges, int32_t (*out)[2])
{
    int32_t *sym = malloc(len * sizeof *sym);
    size_t *wend = malloc((len + 1) * sizeof *wend), nw = 0;
    int maxid = NL_TOKEN_FIRST_MERGE + nmerges;
    int64_t *cnt = malloc((size_t)maxid * maxid * sizeof *cnt);
    for (size_t i = 0; i < len; i++)
        sym[i] = (uint8_t)text[i];
    for (size_t pos = 0; pos < len;)
        pos = wend[nw++] = nl_tokenizer_split_next(NL_TOKENIZER_SPLIT_UNICODE, text, len, pos);
    int made = 0;
    for (; made < nmerges; made++) {
        memset(cnt, 0, (size_t)maxid * maxid * sizeof *cnt);
        for (size_t w = 0, start = 0; w < nw; start = wend[w++])
            for (size_t i = start; i + 1 < wend[w]; i++)
                cnt[(size_t)sym[i] * maxid + sym[i + 1]]++;
        int64_t best = 1; /* min_count 2 */
        int ba = -1, bb = -1;
        for (int a = 0; a < maxid; a++)
            for (int b = 0; b < maxid; b++)
                if (cnt[(size_t)a * maxid + b] > best) {
                    best = cnt[(size_t)a * maxid + b];
                    ba = a;
                    bb = b;
                }
        if (ba < 0)
            break;
        out[made][0] = ba;
        out[made][1] = bb;
        int32_t id = NL_TOKEN_FIRST_MERGE + made;
        size_t wr = 0, rd = 0;
        for (size_t w = 0; w < nw; w++) {
            size_t end = wend[w];
            while (rd < end) {
                if (rd + 1 < end && sym[rd] == ba && sym[rd + 1] == bb) {
                    sym[wr++] = id;
                    rd += 2;
                } else {
                    sym[wr++] = sym[rd++];
                }
            }
            wend[w] = wr;
        }
    }
    free(sym);
    free(wend);
    free(cnt);
    return made;
}

/* The incremental trainer against the naive one, in one run and in two
 * learning steps (which must give the same merges as one). */
static void test_train_vs_naive(void)
{
    enum { LEN = 30000, MERGES = 160 };
    static const char *syll[] = {"th", "e", "an", "in", "er", "s", "t", "o", "qu", "x", "a"};
    static const char *seps[] = {" ", " ", " ", "\n", ", ", ". ", "  ", "'s ", "1", "42 "};
    char *text = malloc(LEN + 16);
    size_t len = 0;
    while (len < LEN) {
        int k = 1 + (int)(rnd() % 4);
        for (int i = 0; i < k; i++) {
            const char *p = syll[rnd() % 11];
            memcpy(text + len, p, strlen(p));
            len += strlen(p);
        }
        const char *q = seps[rnd() % 10];
        memcpy(text + len, q, strlen(q));
        len += strlen(q);
    }
    int32_t(*want)[2] = malloc(MERGES * sizeof *want);
    int nwant = naive_train(text, len, MERGES, want);
    nl_error err = {0};
    nl_tokenizer *one = NULL, *two = NULL;
    CHECK_OK(nl_tokenizer_train(&one, text, len, NL_TOKEN_FIRST_MERGE + MERGES, NULL, &err), &err);
    CHECK_OK(nl_tokenizer_train(&two, text, len, NL_TOKEN_FIRST_MERGE + MERGES / 3, NULL, &err),
             &err);
    if (two)
        CHECK_OK(nl_tokenizer_learn(two, text, len, MERGES - MERGES / 3, NULL, &err), &err);
    CHECK(nwant == MERGES, "naive made %d merges", nwant);
    for (int k = 0; k < 2; k++) {
        nl_tokenizer *t = k ? two : one;
        if (!t)
            continue;
        CHECK(nl_tokenizer_num_merges(t) == nwant, "%s: %d merges, naive %d", k ? "two" : "one",
              nl_tokenizer_num_merges(t), nwant);
        for (int r = 0; r < nwant && r < nl_tokenizer_num_merges(t); r++) {
            int32_t a, b;
            nl_tokenizer_merge_pair(t, NL_TOKEN_FIRST_MERGE + r, &a, &b);
            if (a != want[r][0] || b != want[r][1]) {
                CHECK(0, "%s: merge %d is %d %d, naive %d %d", k ? "two" : "one", r, a, b,
                      want[r][0], want[r][1]);
                break;
            }
        }
    }
    nl_tokenizer_destroy(&one);
    nl_tokenizer_destroy(&two);
    free(want);
    free(text);
}

static int progress_calls, progress_last;
static void on_progress(void *ctx, int32_t done, int32_t target)
{
    (void)ctx;
    CHECK(done == progress_last + 1 && target == 500, "progress %d/%d", done, target);
    progress_calls++;
    progress_last = done;
}

static void test_incremental(void)
{
    nl_error err = {0};
    nl_tokenizer *t = NULL;
    CHECK_OK(nl_tokenizer_train(&t, sennrich, strlen(sennrich), 300, NULL, &err), &err);
    if (!t)
        return;
    int32_t old = nl_tokenizer_vocab_size(t);
    /* "lowlow" is low low under the old merges: the first new merge must
     * be (262, 262), then the line ends join on. */
    const char *more = "lowlow\nlowlow\nlowlow\nlowlow\nlowlow\nnewest newest\n";
    CHECK_OK(nl_tokenizer_learn(t, more, strlen(more), 1, NULL, &err), &err);
    int32_t a = 0, b = 0;
    CHECK(nl_tokenizer_vocab_size(t) == old + 1, "one merge added");
    nl_tokenizer_merge_pair(t, old, &a, &b);
    CHECK(a == 262 && b == 262, "learned %d %d, want 262 262", a, b);
    nl_tokenizer_destroy(&t);

    /* a bigger run: every old id keeps its bytes, new ids follow */
    char *text = malloc(20000);
    static const char *words[] = {
        "alpha", "beta", "gamma", "delta", "\xd0\xbc\xd0\xb8\xd1\x80", "\xe6\x97\xa5\xe6\x9c\xac",
        "x1",    "42",   "!!",    "the"};
    size_t len = 0;
    while (len < 19000) {
        const char *w = words[rnd() % 10];
        text[len++] = rnd() % 5 ? ' ' : '\n';
        memcpy(text + len, w, strlen(w));
        len += strlen(w);
    }
    CHECK_OK(nl_tokenizer_train(&t, text, 9000, 280, NULL, &err), &err);
    if (!t) {
        free(text);
        return;
    }
    old = nl_tokenizer_vocab_size(t);
    char *saved = NULL;
    size_t saved_len = 0;
    CHECK_OK(nl_tokenizer_save_buffer(t, &saved, &saved_len, &err), &err);
    nl_tokenizer *before = NULL;
    CHECK_OK(nl_tokenizer_load_buffer(&before, saved, saved_len, &err), &err);
    round_trip(t, text, len, "before learning");
    progress_calls = progress_last = 0;
    nl_tokenizer_train_opts o = nl_tokenizer_train_opts_default();
    o.min_count = 1;
    o.progress = on_progress;
    /* learn from different text so new pairs exist */
    for (size_t i = 0; i < len; i++)
        if (text[i] == 'a')
            text[i] = 'o';
    CHECK_OK(nl_tokenizer_learn(t, text, len, 500, &o, &err), &err);
    int32_t now = nl_tokenizer_vocab_size(t);
    CHECK(now > old && now <= old + 500, "vocab %d -> %d", old, now);
    CHECK(progress_calls == now - old, "%d progress calls for %d merges", progress_calls,
          now - old);
    int same = 1;
    for (int32_t id = 0; id < old && before; id++) {
        const uint8_t *p1, *p2;
        size_t l1, l2;
        nl_tokenizer_token_bytes(before, id, &p1, &l1);
        nl_tokenizer_token_bytes(t, id, &p2, &l2);
        if (l1 != l2 || memcmp(p1, p2, l1) != 0)
            same = 0;
    }
    CHECK(same, "old ids keep their bytes");
    for (int32_t id = old; id < now; id++) {
        nl_tokenizer_merge_pair(t, id, &a, &b);
        if (!(a >= 0 && a < id && b >= 0 && b < id && !nl_tokenizer_is_special(t, a) &&
              !nl_tokenizer_is_special(t, b)))
            same = 0;
    }
    CHECK(same, "new merges refer to earlier ids only");
    round_trip(t, text, len, "after learning");
    /* the new text now encodes with some of the new ids */
    int32_t *ids = NULL;
    size_t n = 0, used_new = 0;
    CHECK_OK(nl_tokenizer_encode(t, text, len, &ids, &n, &err), &err);
    for (size_t i = 0; i < n; i++)
        used_new += ids[i] >= old;
    CHECK(used_new > 0, "new ids are used");
    free(ids);
    /* nothing left to learn: learning again from the same text adds the
     * remaining pairs only, and with 0 merges asked adds none */
    CHECK_OK(nl_tokenizer_learn(t, text, len, 0, NULL, &err), &err);
    CHECK(nl_tokenizer_vocab_size(t) == now, "0 merges adds none");
    CHECK(nl_tokenizer_learn(t, text, len, -1, NULL, &err) == NL_ERR_INVALID, "-1 refused");
    free(saved);
    free(text);
    nl_tokenizer_destroy(&before);
    nl_tokenizer_destroy(&t);
}

/* ---- round trips ---- */

static void test_round_trips(void)
{
    nl_error err = {0};
    nl_tokenizer *bytes = NULL, *t = NULL;
    CHECK_OK(nl_tokenizer_new_bytes(&bytes, &err), &err);
    CHECK(bytes && nl_tokenizer_vocab_size(bytes) == 259, "bytes vocab 259");
    /* a corpus from a small alphabet so merges get long, and long words
     * (over 64 bytes) take the heap path */
    size_t clen = 60000;
    char *corpus = malloc(clen);
    for (size_t i = 0; i < clen; i++) {
        uint32_t r = rnd() % 100;
        corpus[i] = r < 45 ? 'a' : r < 80 ? 'b' : r < 95 ? ' ' : (char)('c' + r % 3);
    }
    CHECK_OK(nl_tokenizer_train(&t, corpus, clen, 1200, NULL, &err), &err);
    if (!t || !bytes)
        goto out;
    CHECK(nl_tokenizer_vocab_size(t) > 1000, "vocab %d", nl_tokenizer_vocab_size(t));
    /* every token of at most 256 bytes */
    size_t longest = 0;
    for (int32_t id = 0; id < nl_tokenizer_vocab_size(t); id++) {
        const uint8_t *p;
        size_t l;
        nl_tokenizer_token_bytes(t, id, &p, &l);
        longest = l > longest ? l : longest;
    }
    CHECK(longest <= NL_TOKENIZER_MAX_TOKEN_BYTES, "longest token %zu", longest);

    uint8_t *buf = malloc(100001);
    int bad = 0;
    for (size_t len = 0; len < 700 && !bad; len += 1 + len / 8) {
        for (size_t i = 0; i < len; i++)
            buf[i] = (uint8_t)rnd();
        bad |= !round_trip(bytes, buf, len, "random bytes, bytes tokenizer");
        bad |= !round_trip(t, buf, len, "random bytes");
        for (size_t i = 0; i < len; i++)
            buf[i] = (uint8_t)corpus[rnd() % clen];
        bad |= !round_trip(t, buf, len, "corpus-like");
        size_t at = rnd() % (clen - len);
        bad |= !round_trip(t, corpus + at, len, "corpus slice");
    }
    /* long words: runs of a/b of 65..3000 bytes against the reference */
    for (int iter = 0; iter < 30 && !bad; iter++) {
        size_t len = 65 + rnd() % 3000;
        for (size_t i = 0; i < len; i++)
            buf[i] = rnd() % 3 ? 'a' : 'b';
        bad |= !round_trip(t, buf, len, "long word");
    }
    round_trip(t, "", 0, "empty");
    round_trip(t, "a", 1, "one byte");
    round_trip(t, "\xff", 1, "one high byte");
    memset(buf, 'a', 100000);
    round_trip(t, buf, 100000, "100 KB of 'a'");
    memset(buf, ' ', 100000);
    round_trip(t, buf, 100000, "100 KB of ' '");
    buf[50000] = 'x';
    round_trip(t, buf, 100000, "spaces around one x");
    const char mixed[] = "Hello, \xd0\xbc\xd0\xb8\xd1\x80! \xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96"
                         "\xe7\x95\x8c \xf0\x9f\x98\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd caf\xc3\xa9"
                         " na\xc3\xafve \xce\xb1\xce\xb2\xce\xb3 \xd7\xa9\xd7\x9c\xd7\x95\xd7\x9d";
    round_trip(t, mixed, sizeof mixed - 1, "mixed scripts");
    round_trip(bytes, mixed, sizeof mixed - 1, "mixed scripts, bytes tokenizer");
    const char invalid[] = "\xff\xfe\xc3(\xa0\xe2\x28\xa1\xf0\x28\x8c\xbc \xc0\xaf\xed\xa0\x80"
                           "\xf8\x88\x80\x80\x80";
    round_trip(t, invalid, sizeof invalid - 1, "invalid UTF-8");
    const char nuls[] = {0, 'a', 0, 0, 'b', ' ', 0, '\n', 0};
    round_trip(t, nuls, sizeof nuls, "NUL bytes");
    /* a bytes tokenizer gives the bytes back as ids */
    int32_t *ids = NULL;
    size_t n = 0;
    CHECK_OK(nl_tokenizer_encode(bytes, "a\xff\x00", 3, &ids, &n, &err), &err);
    CHECK(n == 3 && ids[0] == 'a' && ids[1] == 255 && ids[2] == 0, "byte ids");
    free(ids);
    /* a cache of four words, and none at all, give the same ids */
    for (size_t i = 0; i < 20000; i++)
        buf[i] = (uint8_t)corpus[rnd() % clen];
    CHECK_OK(nl_tokenizer_set_cache(t, 4, &err), &err);
    round_trip(t, buf, 20000, "tiny cache");
    CHECK_OK(nl_tokenizer_set_cache(t, 0, &err), &err);
    round_trip(t, buf, 20000, "no cache");
    free(buf);
out:
    free(corpus);
    nl_tokenizer_destroy(&bytes);
    nl_tokenizer_destroy(&t);
    nl_tokenizer_destroy(&t);
}

static void test_runs_training(void)
{
    /* one 100 KB word of 'a': merges double up to the 256-byte limit */
    nl_error err = {0};
    nl_tokenizer *t = NULL;
    char *buf = malloc(100000);
    memset(buf, 'a', 100000);
    CHECK_OK(nl_tokenizer_train(&t, buf, 100000, 1000, NULL, &err), &err);
    if (t) {
        CHECK(nl_tokenizer_num_merges(t) == 8, "%d merges, want 8 (2..256 bytes)",
              nl_tokenizer_num_merges(t));
        int32_t *ids = NULL;
        size_t n = 0;
        CHECK_OK(nl_tokenizer_encode(t, buf, 100000, &ids, &n, &err), &err);
        /* 390 tokens of 256 bytes, then 128 and 32 */
        CHECK(n == 392, "%zu ids", n);
        free(ids);
        round_trip(t, buf, 100000, "trained on its own run");
    }
    nl_tokenizer_destroy(&t);
    free(buf);
}

/* ---- decoding ---- */

static void test_decode(void)
{
    nl_error err = {0};
    nl_tokenizer *t = NULL;
    CHECK_OK(nl_tokenizer_new_bytes(&t, &err), &err);
    if (!t)
        return;
    char *out = NULL;
    size_t len = 0;
    int32_t ids[] = {'h', NL_TOKEN_BEGIN, 'i', NL_TOKEN_END, NL_TOKEN_PAD};
    CHECK_OK(nl_tokenizer_decode(t, ids, 5, &out, &len, &err), &err);
    CHECK(out && len == strlen("h<|begin|>i<|end|><|pad|>") &&
              strcmp(out, "h<|begin|>i<|end|><|pad|>") == 0,
          "specials decode to names");
    free(out);
    nl_status st =
        nl_tokenizer_decode_flags(t, ids, 5, NL_TOKENIZER_DECODE_STRICT, &out, &len, &err);
    CHECK(st == NL_ERR_RANGE && strstr(err.msg, "special id 256") && strstr(err.msg, "position 1"),
          "strict decode: %s", err.msg);
    CHECK(out == NULL, "no output on error");
    int32_t bad[] = {'a', 'b', 259};
    st = nl_tokenizer_decode(t, bad, 3, &out, &len, &err);
    CHECK(st == NL_ERR_RANGE && strstr(err.msg, "id 259 at position 2"), "unknown id: %s", err.msg);
    int32_t neg[] = {-7};
    st = nl_tokenizer_decode(t, neg, 1, &out, &len, &err);
    CHECK(st == NL_ERR_RANGE && strstr(err.msg, "id -7"), "negative id: %s", err.msg);
    CHECK_OK(nl_tokenizer_decode(t, NULL, 0, &out, &len, &err), &err);
    CHECK(out && len == 0 && out[0] == '\0', "empty decode");
    free(out);
    int32_t small[2];
    size_t n = 0;
    st = nl_tokenizer_encode_into(t, "abc", 3, small, 2, &n, &err);
    CHECK(st == NL_ERR_LIMIT, "encode_into a short buffer: %s", nl_status_str(st));
    nl_tokenizer_destroy(&t);
    nl_tokenizer_destroy(&t);
}

/* ---- files ---- */

static void test_save_load(void)
{
    nl_error err = {0};
    nl_tokenizer *t = NULL, *u = NULL;
    CHECK_OK(nl_tokenizer_train(&t, sennrich, strlen(sennrich), 300, NULL, &err), &err);
    if (!t)
        return;
    char *a = NULL, *b = NULL;
    size_t al = 0, bl = 0;
    CHECK_OK(nl_tokenizer_save_buffer(t, &a, &al, &err), &err);
    const char *head = "neurollm-bpe 2\nsplit unicode\nmerges 12\n101 115\n259 116\n";
    CHECK(a && strncmp(a, head, strlen(head)) == 0 && a[al] == '\0', "file starts '%s'", head);
    for (size_t i = 0; a && i < al; i++)
        if (!(a[i] == '\n' || (a[i] >= 0x20 && a[i] < 0x7F))) {
            CHECK(0, "byte %zu not printable", i);
            break;
        }
    CHECK_OK(nl_tokenizer_load_buffer(&u, a, al, &err), &err);
    CHECK_OK(u ? nl_tokenizer_save_buffer(u, &b, &bl, &err) : NL_ERR_INTERNAL, &err);
    CHECK(b && al == bl && memcmp(a, b, al) == 0, "save(load(save)) identical");
    free(b);
    nl_tokenizer_destroy(&u);
    char path[512];
    snprintf(path, sizeof path, "%s/test_tokenizer.%d.bpe", check_build_dir(), (int)getpid());
    CHECK_OK(nl_tokenizer_save(t, path, &err), &err);
    CHECK_OK(nl_tokenizer_load(&u, path, &err), &err);
    CHECK(u && nl_tokenizer_vocab_size(u) == nl_tokenizer_vocab_size(t), "file round trip");
    for (int32_t id = 0; u && id < nl_tokenizer_vocab_size(t); id++) {
        const uint8_t *p1, *p2;
        size_t l1, l2;
        nl_tokenizer_token_bytes(t, id, &p1, &l1);
        nl_tokenizer_token_bytes(u, id, &p2, &l2);
        if (l1 != l2 || memcmp(p1, p2, l1) != 0) {
            CHECK(0, "id %d differs after load", id);
            break;
        }
    }
    nl_tokenizer_destroy(&u);
    unlink(path);
    nl_status st = nl_tokenizer_load(&u, path, &err);
    CHECK(st == NL_ERR_IO && strstr(err.msg, path) && !u, "missing file: %s", err.msg);
    /* a load error names the file */
    FILE *f = fopen(path, "wb");
    fputs("neurollm-bpe 1\nmerges 1\n97 9x\n", f);
    fclose(f);
    st = nl_tokenizer_load(&u, path, &err);
    CHECK(st == NL_ERR_FORMAT && strstr(err.msg, path) && strstr(err.msg, "line 3"), "%s", err.msg);
    unlink(path);

    /* every strict prefix is refused as truncated, naming its line */
    for (size_t cut = 0; a && cut < al; cut++) {
        st = nl_tokenizer_load_buffer(&u, a, cut, &err);
        size_t line = 1;
        for (size_t i = 0; i < cut; i++)
            line += a[i] == '\n';
        char want[32];
        snprintf(want, sizeof want, "line %zu,", line);
        int ok = st != NL_OK && !u && (cut == 0 || strstr(err.msg, "truncated")) &&
                 strstr(err.msg, want);
        CHECK(ok, "cut at %zu: %s: %s", cut, nl_status_str(st), err.msg);
        nl_tokenizer_destroy(&u);
        if (!ok)
            break;
    }
    free(a);
    nl_tokenizer_destroy(&t);
}

static void test_corrupt_matrix(void)
{
    static const struct {
        const char *text, *want;
        nl_status st;
    } cases[] = {
        {"", "empty file", NL_ERR_FORMAT},
        {"neurollm-bpf 1\nmerges 0\n", "line 1, offset 0: bad magic", NL_ERR_FORMAT},
        {"NEUROLLM-BPE 1\nmerges 0\n", "bad magic", NL_ERR_FORMAT},
        {"\x89PNG\r\n", "bad magic", NL_ERR_FORMAT},
        {"neurollm-bpe 2\nmerges 0\n",
         "line 2, offset 15: expected 'split unicode' or 'split bytes'", NL_ERR_FORMAT},
        {"neurollm-bpe 2\nsplit ascii\nmerges 0\n", "expected unicode or bytes after 'split'",
         NL_ERR_FORMAT},
        {"neurollm-bpe 2\nsplit unicode", "expected unicode or bytes", NL_ERR_FORMAT},
        {"neurollm-bpe 3\nmerges 0\n", "line 1, offset 13: version 3 is not supported",
         NL_ERR_VERSION},
        {"neurollm-bpe 0\nmerges 0\n", "version 0", NL_ERR_VERSION},
        {"neurollm-bpe 01\nmerges 0\n", "version has a leading zero", NL_ERR_FORMAT},
        {"neurollm-bpe 99999999999999\nmerges 0\n", "version 99999999999999 is out of range",
         NL_ERR_RANGE},
        {"neurollm-bpe  1\nmerges 0\n", "expected version", NL_ERR_FORMAT},
        {"neurollm-bpe 1\r\nmerges 0\n", "found byte 0x0d", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerge 0\n", "line 2, offset 20: expected 'merges COUNT'", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges -1\n", "line 2, offset 22: expected merge count", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 2147483647\n", "merge count 2147483647 is out of range",
         NL_ERR_RANGE},
        {"neurollm-bpe 1\nmerges 1x\n", "found 'x'", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 3\n97 98\n", "line 4, offset 30: file ends after 1 of 3 merges",
         NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n259 97\n",
         "line 3, offset 24: merge for id 259 refers to "
         "unknown id 259",
         NL_ERR_RANGE},
        {"neurollm-bpe 1\nmerges 2\n97 98\n97 260\n",
         "line 4, offset 30: merge for id 260 "
         "refers to unknown id 260",
         NL_ERR_RANGE},
        {"neurollm-bpe 1\nmerges 1\n256 97\n", "uses special id 256", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n97 258\n", "uses special id 258", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 2\n97 98\n97 98\n",
         "line 4, offset 30: duplicate merge 97 98 (already id 259, line 3)", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n-1 97\n", "expected first id (a decimal number), found '-'",
         NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n97 -98\n", "found '-'", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n99999999999999999999999999999 97\n",
         "first id 999999999999999999999999... is out of range", NL_ERR_RANGE},
        {"neurollm-bpe 1\nmerges 1\n97 2147483647\n", "second id 2147483647 is out of range",
         NL_ERR_RANGE},
        {"neurollm-bpe 1\nmerges 1\n97 098\n", "second id has a leading zero", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n97  98\n", "expected second id", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n97\t98\n",
         "expected one space between the ids, found byte "
         "0x09",
         NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n 97 98\n", "expected first id", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n97 98 \n", "expected end of line after the second id",
         NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n97 98\r\n", "found byte 0x0d", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n97 98\nx", "line 4, offset 30: trailing data", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 1\n97 98\n\n",
         "trailing data after the last merge (found end "
         "of line)",
         NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 0\n97 98\n", "trailing data", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 0\n\0", "found byte 0x00", NL_ERR_FORMAT},
        {"neurollm-bpe 1\nmerges 9\n97 97\n259 259\n260 260\n261 261\n262 262\n263 263\n"
         "264 264\n265 265\n266 266\n",
         "line 11, offset 86: merge for id 267 would be 512 bytes long (limit 256)", NL_ERR_LIMIT},
    };
    nl_error err = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        nl_tokenizer *t = NULL;
        size_t len = strlen(cases[i].text);
        if (i == sizeof cases / sizeof cases[0] - 2)
            len += 1; /* the case with a NUL after the header */
        nl_error_clear(&err);
        nl_status st = nl_tokenizer_load_buffer(&t, cases[i].text, len, &err);
        CHECK(st == cases[i].st && !t && strstr(err.msg, cases[i].want),
              "case %zu: got %s '%s', want %s '%s'", i, nl_status_str(st), err.msg,
              nl_status_str(cases[i].st), cases[i].want);
        nl_tokenizer_destroy(&t);
    }
    /* the same file minus its fault loads */
    nl_tokenizer *t = NULL;
    const char *good = "neurollm-bpe 1\nmerges 2\n97 98\n259 99\n";
    CHECK_OK(nl_tokenizer_load_buffer(&t, good, strlen(good), &err), &err);
    CHECK(t && nl_tokenizer_vocab_size(t) == 261, "good file loads");
    nl_tokenizer_destroy(&t);
}

/* Versions 1 and 2: each keeps its split, version 1 is written back as
 * version 1, and the two splits cut a curly quote differently. */
static void test_versions(void)
{
    nl_error err = {0};
    nl_tokenizer *t = NULL;
    const char *good = "neurollm-bpe 1\nmerges 2\n97 98\n259 99\n";
    CHECK_OK(nl_tokenizer_load_buffer(&t, good, strlen(good), &err), &err);
    /* version 1 keeps its byte classes, and is written back as it was */
    char *back = NULL;
    size_t bl = 0;
    CHECK(t && nl_tokenizer_split_mode(t) == NL_TOKENIZER_SPLIT_BYTES, "version 1 splits by bytes");
    CHECK_OK(t ? nl_tokenizer_save_buffer(t, &back, &bl, &err) : NL_ERR_INTERNAL, &err);
    CHECK(back && bl == strlen(good) && !memcmp(back, good, bl), "version 1 saved as version 1");
    free(back);
    nl_tokenizer_destroy(&t);
    const char *v2[2] = {"neurollm-bpe 2\nsplit unicode\nmerges 1\n97 98\n",
                         "neurollm-bpe 2\nsplit bytes\nmerges 1\n97 98\n"};
    for (int i = 0; i < 2; i++) {
        CHECK_OK(nl_tokenizer_load_buffer(&t, v2[i], strlen(v2[i]), &err), &err);
        CHECK(t && nl_tokenizer_split_mode(t) ==
                       (i ? NL_TOKENIZER_SPLIT_BYTES : NL_TOKENIZER_SPLIT_UNICODE),
              "version 2 split %d", i);
        nl_tokenizer_destroy(&t);
    }
    /* the same merges, the two splits: curly quotes differ */
    nl_tokenizer *u = NULL, *b = NULL;
    const char *v1 = "neurollm-bpe 1\nmerges 0\n",
               *un = "neurollm-bpe 2\nsplit unicode\nmerges 0\n";
    CHECK_OK(nl_tokenizer_load_buffer(&b, v1, strlen(v1), &err), &err);
    CHECK_OK(nl_tokenizer_load_buffer(&u, un, strlen(un), &err), &err);
    const char *text = "don\u2019t";
    CHECK_OK(nl_tokenizer_learn(u, text, strlen(text), 10,
                                &(nl_tokenizer_train_opts){.min_count = 1}, &err),
             &err);
    CHECK_OK(nl_tokenizer_learn(b, text, strlen(text), 10,
                                &(nl_tokenizer_train_opts){.min_count = 1}, &err),
             &err);
    int32_t *iu = NULL, *ib = NULL;
    size_t nu = 0, nb = 0;
    CHECK_OK(nl_tokenizer_encode(u, text, strlen(text), &iu, &nu, &err), &err);
    CHECK_OK(nl_tokenizer_encode(b, text, strlen(text), &ib, &nb, &err), &err);
    CHECK(nu == 3 && nb == 1, "don't with a curly quote: %zu ids (unicode, want 3), %zu (bytes, 1)",
          nu, nb);
    free(iu), free(ib);
    nl_bpe_corpus *c = NULL;
    CHECK_OK(nl_bpe_corpus_new(&c, NL_TOKENIZER_SPLIT_BYTES, &err), &err);
    CHECK(nl_tokenizer_learn_corpus(u, c, 1, NULL, &err) == NL_ERR_INVALID &&
              strstr(err.msg, "by byte classes"),
          "a corpus cut otherwise is refused: %s", err.msg);
    nl_bpe_corpus_destroy(&c);
    nl_tokenizer_destroy(&u);
    nl_tokenizer_destroy(&b);
}

/* The explicit form (ids where another library put them): loads, saves
 * back byte for byte, encodes with its merges' result ids, and refuses
 * what does not add up. */
static void test_explicit(void)
{
    nl_error err = {0};
    char *f = malloc(4096), *back = NULL;
    size_t n = (size_t)snprintf(f, 4096, "neurollm-bpe 2\nsplit unicode\nids 261\nmerges 3\n");
    for (int b = 255; b >= 0; b--) /* bytes in reverse: byte b is id 255 - b */
        n += (size_t)snprintf(f + n, 4096 - n, "%02x\n", b);
    n += (size_t)snprintf(f + n, 4096 - n, "* 3c7c656e647c3e\n6162\n616263\n6263\n616263\n");
    /* a = 158, b = 157, c = 156; ab 257, abc 258 (and 260), bc 259 */
    n += (size_t)snprintf(f + n, 4096 - n, "158 157 257\n257 156 258\n158 259 260\n");
    nl_tokenizer *t = NULL;
    CHECK_OK(nl_tokenizer_load_buffer(&t, f, n, &err), &err);
    if (!t) {
        free(f);
        return;
    }
    CHECK(!nl_tokenizer_is_native(t) && nl_tokenizer_vocab_size(t) == 261 &&
              nl_tokenizer_num_merges(t) == 3 && nl_tokenizer_is_special(t, 256) &&
              !nl_tokenizer_is_special(t, 0) && nl_tokenizer_byte_id(t, 'a') == 158,
          "explicit tokenizer shape");
    size_t bl = 0;
    CHECK_OK(nl_tokenizer_save_buffer(t, &back, &bl, &err), &err);
    CHECK(back && bl == n && !memcmp(back, f, n), "explicit: save(load(x)) == x");
    free(back);
    int32_t *ids = NULL;
    size_t k = 0;
    CHECK_OK(nl_tokenizer_encode(t, "abc abd", 7, &ids, &k, &err), &err);
    CHECK(k == 4 && ids[0] == 258 && ids[1] == 255 - ' ' && ids[2] == 257 && ids[3] == 155,
          "explicit encode: %zu ids", k);
    char *text = NULL;
    CHECK_OK(nl_tokenizer_decode(t, ids, k, &text, &bl, &err), &err);
    CHECK(text && bl == 7 && !memcmp(text, "abc abd", 7), "explicit decode");
    free(text);
    free(ids);
    int32_t a, b, out;
    CHECK(nl_tokenizer_merge_pair(t, 258, &a, &b) == NL_OK && a == 257 && b == 156,
          "the first merge that makes 258");
    CHECK(nl_tokenizer_merge_at(t, 2, &a, &b, &out) == NL_OK && out == 260, "merge 2 makes 260");
    /* learning appends ids after the explicit ones */
    CHECK_OK(nl_tokenizer_learn(t, "xyxy xyxy", 9, 1, NULL, &err), &err);
    CHECK(nl_tokenizer_vocab_size(t) == 262, "learned id 261");
    nl_tokenizer_destroy(&t);
    static const struct {
        const char *tail, *want;
    } bad[] = {
        {"158 157 258\n", "merge 0: id 258's bytes are not id 158's then id 157's"},
        {"158 157 256\n", "uses a special id"},
        {"158 157 261\n", "result id 261 is out of range"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t m = (size_t)snprintf(f, 4096, "neurollm-bpe 2\nsplit unicode\nids 261\nmerges 1\n");
        for (int c = 255; c >= 0; c--)
            m += (size_t)snprintf(f + m, 4096 - m, "%02x\n", c);
        m += (size_t)snprintf(f + m, 4096 - m, "* 3c7c656e647c3e\n6162\n616263\n6263\n616263\n%s",
                              bad[i].tail);
        nl_status st = nl_tokenizer_load_buffer(&t, f, m, &err);
        CHECK(st != NL_OK && !t && strstr(err.msg, bad[i].want), "explicit bad %zu: %s", i,
              err.msg);
    }
    /* a byte with no id */
    size_t m = (size_t)snprintf(f, 4096, "neurollm-bpe 2\nsplit unicode\nids 1\nmerges 0\n41\n");
    CHECK(nl_tokenizer_load_buffer(&t, f, m, &err) == NL_ERR_FORMAT &&
              strstr(err.msg, "byte 0x00 has no id"),
          "missing byte: %s", err.msg);
    free(f);
}

/* An imported id holds 1..NL_TOKENIZER_MAX_TOKEN_BYTES bytes: the longest
 * is taken, one byte more refused with the limit named. */
static void test_token_length_bound(void)
{
    nl_error err = {0};
    nl_tokenizer *t = NULL;
    CHECK_OK(nl_tokenizer_new_empty(&t, NL_TOKENIZER_SPLIT_UNICODE, &err), &err);
    if (!t)
        return;
    char buf[NL_TOKENIZER_MAX_TOKEN_BYTES + 1];
    memset(buf, 'a', sizeof buf);
    CHECK_OK(nl_tokenizer_append_token(t, buf, NL_TOKENIZER_MAX_TOKEN_BYTES, 0, &err), &err);
    CHECK(nl_tokenizer_append_token(t, buf, sizeof buf, 0, &err) == NL_ERR_LIMIT,
          "a token of %zu bytes is refused", sizeof buf);
    CHECK(nl_tokenizer_append_token(t, buf, 0, 0, &err) == NL_ERR_LIMIT,
          "an empty token is refused");
    nl_tokenizer_destroy(&t);
}

int main(void)
{
    test_split();
    test_token_length_bound();
    test_safe_split();
    test_train_by_hand();
    test_train_vs_naive();
    test_incremental();
    test_round_trips();
    test_runs_training();
    test_decode();
    test_save_load();
    test_corrupt_matrix();
    test_versions();
    test_explicit();
    return check_done("test_tokenizer");
}
