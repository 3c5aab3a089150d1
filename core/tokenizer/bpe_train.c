/* Learning BPE merges: count the corpus's words once, then keep the count
 * of every adjacent pair over the unique words (weighted by how often each
 * word occurs) up to date as merges are made, so the corpus is never
 * rescanned.
 *
 *  - pairs live in flat arrays indexed through an open-addressing map;
 *  - each pair has a linked list (in one shared pool) of the words that
 *    contain it, so a merge visits only those words;
 *  - a max-heap orders pairs by (count desc, a asc, b asc). Counts of
 *    existing pairs only fall after they are created (new pairs always
 *    involve the new id), so a heap entry's count is an upper bound: an
 *    entry whose count is stale is re-pushed with the current one when it
 *    reaches the top, and the first entry found current is the best pair
 *    with ties broken by the smallest (a, b). */
#include <stdlib.h>
#include <string.h>

#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_impl.h"

/* ------------------------------------------------------------------ */
/* corpus: word -> count                                               */
/* ------------------------------------------------------------------ */

typedef struct corpus_slot {
    uint64_t hash;
    size_t off, len;
    int64_t count; /* 0: empty slot */
} corpus_slot;

struct nl_bpe_corpus {
    nl_tokenizer_split split;
    corpus_slot *slots;
    size_t mask, n;
    uint8_t *bytes;
    size_t bytes_len, bytes_cap;
};

nl_status nl_bpe_corpus_new(nl_bpe_corpus **out, nl_tokenizer_split mode, nl_error *err)
{
    nl_bpe_corpus *c = calloc(1, sizeof *c);
    *out = NULL;
    if (!c || !(c->slots = calloc(1024, sizeof *c->slots))) {
        free(c);
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for a corpus");
    }
    c->mask = 1023;
    c->split = mode;
    *out = c;
    return NL_OK;
}

void nl_bpe_corpus_destroy(nl_bpe_corpus **cp)
{
    if (!cp || !*cp)
        return;
    free((*cp)->slots);
    free((*cp)->bytes);
    free(*cp);
    *cp = NULL;
}

size_t nl_bpe_corpus_unique_words(const nl_bpe_corpus *c)
{
    return c->n;
}

static nl_status corpus_grow(nl_bpe_corpus *c, nl_error *err)
{
    size_t cap = (c->mask + 1) * 2;
    corpus_slot *slots = calloc(cap, sizeof *slots);
    if (!slots)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for %zu words", c->n);
    for (size_t i = 0; i <= c->mask; i++) {
        if (!c->slots[i].count)
            continue;
        size_t j = (size_t)c->slots[i].hash & (cap - 1);
        while (slots[j].count)
            j = (j + 1) & (cap - 1);
        slots[j] = c->slots[i];
    }
    free(c->slots);
    c->slots = slots;
    c->mask = cap - 1;
    return NL_OK;
}

static nl_status corpus_add_word(nl_bpe_corpus *c, const uint8_t *w, size_t len, nl_error *err)
{
    uint64_t h = nl_tok_hash_bytes(w, len);
    size_t i = (size_t)h & c->mask;
    for (; c->slots[i].count; i = (i + 1) & c->mask) {
        corpus_slot *s = &c->slots[i];
        if (s->hash == h && s->len == len && memcmp(c->bytes + s->off, w, len) == 0) {
            s->count++;
            return NL_OK;
        }
    }
    if (c->bytes_cap - c->bytes_len < len) {
        size_t cap = c->bytes_cap ? c->bytes_cap * 2 : 1 << 16;
        while (cap - c->bytes_len < len)
            cap *= 2;
        uint8_t *b = realloc(c->bytes, cap);
        if (!b)
            return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for %zu word bytes",
                                cap);
        c->bytes = b;
        c->bytes_cap = cap;
    }
    memcpy(c->bytes + c->bytes_len, w, len);
    c->slots[i] = (corpus_slot){.hash = h, .off = c->bytes_len, .len = len, .count = 1};
    c->bytes_len += len;
    c->n++;
    if (c->n * 2 > c->mask + 1)
        return corpus_grow(c, err);
    return NL_OK;
}

nl_status nl_bpe_corpus_add(nl_bpe_corpus *c, const void *text, size_t len, nl_error *err)
{
    const uint8_t *s = text;
    for (size_t pos = 0; pos < len;) {
        size_t end = nl_tokenizer_split_next(c->split, s, len, pos);
        nl_status st = corpus_add_word(c, s + pos, end - pos, err);
        if (st != NL_OK)
            return st;
        pos = end;
    }
    return NL_OK;
}

/* ------------------------------------------------------------------ */
/* trainer state                                                       */
/* ------------------------------------------------------------------ */

typedef struct heap_entry {
    int64_t count;
    uint64_t key; /* a << 32 | b */
} heap_entry;

typedef struct trainer {
    nl_tokenizer *t;
    nl_error *err;
    int32_t step; /* merges made in this call, for the stamps */
    /* unique words of two or more symbols */
    size_t n_words;
    int64_t *w_count;
    size_t *w_off, *w_len; /* symbols in sym */
    int32_t *w_stamp;
    int32_t *sym;
    /* pairs */
    size_t n_pairs, cap_pairs;
    uint64_t *p_key;
    int64_t *p_count;
    int32_t *p_head, *p_stamp;
    uint64_t *pm_keys; /* map key -> pair index; UINT64_MAX empty */
    int32_t *pm_vals;
    size_t pm_mask;
    /* occurrence lists: word, next */
    int32_t *occ_word, *occ_next;
    size_t n_occ, cap_occ;
    heap_entry *heap;
    size_t heap_n, heap_cap;
    int32_t *touched; /* new pairs of this step */
    size_t n_touched, cap_touched;
} trainer;

static void trainer_free(trainer *tr)
{
    free(tr->w_count);
    free(tr->w_off);
    free(tr->w_len);
    free(tr->w_stamp);
    free(tr->sym);
    free(tr->p_key);
    free(tr->p_count);
    free(tr->p_head);
    free(tr->p_stamp);
    free(tr->pm_keys);
    free(tr->pm_vals);
    free(tr->occ_word);
    free(tr->occ_next);
    free(tr->heap);
    free(tr->touched);
}

static nl_status nomem(trainer *tr, const char *what)
{
    return nl_error_set(tr->err, NL_ERR_NOMEM, "tokenizer: out of memory for %s while learning",
                        what);
}

/* The capacity to grow cap to so that it holds need elements. */
static size_t grown(size_t cap, size_t need)
{
    size_t c = cap ? cap : 1024;
    while (c < need)
        c *= 2;
    return c;
}

/* realloc ptr to n elements in place; 0 on failure (ptr unchanged). Needs
 * a `void *tmp` in scope. */
#define RESIZE(ptr, n) ((tmp = realloc((ptr), (n) * sizeof *(ptr))) ? ((ptr) = tmp, 1) : 0)

static nl_status pm_rehash(trainer *tr, size_t slots)
{
    uint64_t *keys = malloc(slots * sizeof *keys);
    int32_t *vals = malloc(slots * sizeof *vals);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return nomem(tr, "the pair map");
    }
    memset(keys, 0xFF, slots * sizeof *keys);
    for (size_t p = 0; p < tr->n_pairs; p++) {
        size_t i = nl_tok_hash_u64(tr->p_key[p], slots - 1);
        while (keys[i] != UINT64_MAX)
            i = (i + 1) & (slots - 1);
        keys[i] = tr->p_key[p];
        vals[i] = (int32_t)p;
    }
    free(tr->pm_keys);
    free(tr->pm_vals);
    tr->pm_keys = keys;
    tr->pm_vals = vals;
    tr->pm_mask = slots - 1;
    return NL_OK;
}

/* Index of pair key, or -1. */
static int32_t pair_find(const trainer *tr, uint64_t key)
{
    for (size_t i = nl_tok_hash_u64(key, tr->pm_mask);; i = (i + 1) & tr->pm_mask) {
        if (tr->pm_keys[i] == key)
            return tr->pm_vals[i];
        if (tr->pm_keys[i] == UINT64_MAX)
            return -1;
    }
}

/* Index of pair key in *out, added with count 0 if new. */
static nl_status pair_get(trainer *tr, uint64_t key, int32_t *out)
{
    size_t i = nl_tok_hash_u64(key, tr->pm_mask);
    void *tmp;
    for (; tr->pm_keys[i] != UINT64_MAX; i = (i + 1) & tr->pm_mask)
        if (tr->pm_keys[i] == key) {
            *out = tr->pm_vals[i];
            return NL_OK;
        }
    if (tr->n_pairs >= INT32_MAX - 1)
        return nl_error_set(tr->err, NL_ERR_LIMIT, "tokenizer: more than 2^31 distinct pairs");
    if (tr->n_pairs == tr->cap_pairs) {
        size_t cap = grown(tr->cap_pairs, tr->n_pairs + 1);
        if (!RESIZE(tr->p_key, cap) || !RESIZE(tr->p_count, cap) || !RESIZE(tr->p_head, cap) ||
            !RESIZE(tr->p_stamp, cap))
            return nomem(tr, "pairs");
        tr->cap_pairs = cap;
    }
    int32_t p = (int32_t)tr->n_pairs++;
    tr->p_key[p] = key;
    tr->p_count[p] = 0;
    tr->p_head[p] = -1;
    tr->p_stamp[p] = 0;
    *out = p;
    if (tr->n_pairs * 2 > tr->pm_mask + 1)
        return pm_rehash(tr, (tr->pm_mask + 1) * 2);
    tr->pm_keys[i] = key;
    tr->pm_vals[i] = p;
    return NL_OK;
}

/* Record that word w contains pair p (once per word in a row). */
static nl_status occ_add(trainer *tr, int32_t p, int32_t w)
{
    int32_t h = tr->p_head[p];
    if (h >= 0 && tr->occ_word[h] == w)
        return NL_OK;
    void *tmp;
    if (tr->n_occ >= INT32_MAX)
        return nl_error_set(tr->err, NL_ERR_LIMIT,
                            "tokenizer: corpus too large for the pair index");
    if (tr->n_occ == tr->cap_occ) {
        size_t cap = grown(tr->cap_occ, tr->n_occ + 1);
        if (!RESIZE(tr->occ_word, cap) || !RESIZE(tr->occ_next, cap))
            return nomem(tr, "the pair index");
        tr->cap_occ = cap;
    }
    tr->occ_word[tr->n_occ] = w;
    tr->occ_next[tr->n_occ] = h;
    tr->p_head[p] = (int32_t)tr->n_occ++;
    return NL_OK;
}

/* ------------------------------------------------------------------ */
/* the heap                                                            */
/* ------------------------------------------------------------------ */

static inline int better(heap_entry x, heap_entry y)
{
    return x.count > y.count || (x.count == y.count && x.key < y.key);
}

static void sift_down(heap_entry *h, size_t n, size_t i)
{
    heap_entry v = h[i];
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && better(h[c + 1], h[c]))
            c++;
        if (!better(h[c], v))
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
}

static nl_status heap_push(trainer *tr, heap_entry e)
{
    void *tmp;
    if (tr->heap_n == tr->heap_cap) {
        size_t cap = grown(tr->heap_cap, tr->heap_n + 1);
        if (!RESIZE(tr->heap, cap))
            return nomem(tr, "the pair queue");
        tr->heap_cap = cap;
    }
    size_t i = tr->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!better(e, tr->heap[p]))
            break;
        tr->heap[i] = tr->heap[p];
        i = p;
    }
    tr->heap[i] = e;
    return NL_OK;
}

static void heap_pop(trainer *tr)
{
    tr->heap[0] = tr->heap[--tr->heap_n];
    if (tr->heap_n)
        sift_down(tr->heap, tr->heap_n, 0);
}

/* May (a, b) become a merge? Not when the token would be too long, or the
 * pair is already a merge (it cannot occur in text encoded with the
 * existing merges, but an explicit check costs little). */
static int eligible(const trainer *tr, uint64_t key)
{
    int32_t a = (int32_t)(key >> 32), b = (int32_t)(uint32_t)key;
    return (size_t)tr->t->tok_len[a] + tr->t->tok_len[b] <= NL_TOKENIZER_MAX_TOKEN_BYTES &&
           nl_tok_merge_rank(tr->t, a, b) < 0;
}

/* ------------------------------------------------------------------ */
/* setting up                                                          */
/* ------------------------------------------------------------------ */

/* Encode each unique word with the existing merges; keep those with at
 * least two symbols. */
static nl_status load_words(trainer *tr, const nl_bpe_corpus *c)
{
    size_t n = c->n ? c->n : 1;
    tr->w_count = malloc(n * sizeof *tr->w_count);
    tr->w_off = malloc(n * sizeof *tr->w_off);
    tr->w_len = malloc(n * sizeof *tr->w_len);
    tr->w_stamp = calloc(n, sizeof *tr->w_stamp);
    tr->sym = malloc((c->bytes_len ? c->bytes_len : 1) * sizeof *tr->sym);
    if (!tr->w_count || !tr->w_off || !tr->w_len || !tr->w_stamp || !tr->sym)
        return nomem(tr, "the words");
    if (c->n >= INT32_MAX)
        return nl_error_set(tr->err, NL_ERR_LIMIT, "tokenizer: more than 2^31 unique words");
    size_t used = 0;
    for (size_t i = 0; i <= c->mask; i++) {
        const corpus_slot *s = &c->slots[i];
        const int32_t *ids = NULL;
        size_t k = 0;
        if (s->count == 0 || s->len < 2)
            continue;
        nl_status st = nl_tok_encode_word(tr->t, c->bytes + s->off, s->len, &ids, &k, tr->err);
        if (st != NL_OK)
            return st;
        if (k < 2)
            continue;
        memcpy(tr->sym + used, ids, k * sizeof *ids);
        tr->w_count[tr->n_words] = s->count;
        tr->w_off[tr->n_words] = used;
        tr->w_len[tr->n_words] = k;
        tr->n_words++;
        used += k;
    }
    return NL_OK;
}

static nl_status count_pairs(trainer *tr)
{
    void *tmp;
    size_t slots = 1024;
    while (slots < 2 * tr->n_words && slots < ((size_t)1 << 30))
        slots *= 2;
    nl_status st = pm_rehash(tr, slots);
    for (size_t w = 0; w < tr->n_words && st == NL_OK; w++) {
        const int32_t *s = tr->sym + tr->w_off[w];
        for (size_t i = 0; i + 1 < tr->w_len[w] && st == NL_OK; i++) {
            int32_t p = -1;
            if ((st = pair_get(tr, nl_tok_pair_key(s[i], s[i + 1]), &p)) != NL_OK)
                break;
            tr->p_count[p] += tr->w_count[w];
            st = occ_add(tr, p, (int32_t)w);
        }
    }
    if (st != NL_OK)
        return st;
    tr->heap_cap = grown(0, tr->n_pairs + 1);
    if (!RESIZE(tr->heap, tr->heap_cap))
        return nomem(tr, "the pair queue");
    for (size_t p = 0; p < tr->n_pairs; p++)
        if (eligible(tr, tr->p_key[p]))
            tr->heap[tr->heap_n++] = (heap_entry){tr->p_count[p], tr->p_key[p]};
    for (size_t i = tr->heap_n / 2; i-- > 0;)
        sift_down(tr->heap, tr->heap_n, i);
    return NL_OK;
}

/* ------------------------------------------------------------------ */
/* merging                                                             */
/* ------------------------------------------------------------------ */

/* Change the count of an existing pair. */
static nl_status pair_sub(trainer *tr, int32_t a, int32_t b, int64_t d)
{
    int32_t p = pair_find(tr, nl_tok_pair_key(a, b));
    if (p < 0)
        return nl_error_set(tr->err, NL_ERR_INTERNAL, "tokenizer: pair %d %d vanished", a, b);
    tr->p_count[p] -= d;
    return NL_OK;
}

/* Add to the count of a pair that involves the new id, in word w. */
static nl_status pair_add_new(trainer *tr, int32_t a, int32_t b, int64_t d, int32_t w)
{
    int32_t p = -1;
    void *tmp;
    nl_status st = pair_get(tr, nl_tok_pair_key(a, b), &p);
    if (st != NL_OK)
        return st;
    tr->p_count[p] += d;
    if (tr->p_stamp[p] != tr->step) {
        tr->p_stamp[p] = tr->step;
        if (tr->n_touched == tr->cap_touched) {
            size_t cap = grown(tr->cap_touched, tr->n_touched + 1);
            if (!RESIZE(tr->touched, cap))
                return nomem(tr, "new pairs");
            tr->cap_touched = cap;
        }
        tr->touched[tr->n_touched++] = p;
    }
    return occ_add(tr, p, w);
}

/* Replace every (a, b) in word w, left to right, by c, and update the
 * counts of the pairs around each occurrence. */
static nl_status merge_word(trainer *tr, int32_t w, int32_t a, int32_t b, int32_t c)
{
    int32_t *s = tr->sym + tr->w_off[w];
    size_t n = tr->w_len[w], rd = 0, wr = 0;
    int64_t cnt = tr->w_count[w];
    nl_status st = NL_OK;
    while (rd < n && st == NL_OK) {
        if (rd + 1 < n && s[rd] == a && s[rd + 1] == b) {
            st = pair_sub(tr, a, b, cnt);
            if (st == NL_OK && wr > 0) {
                int32_t x = s[wr - 1];
                if ((st = pair_sub(tr, x, a, cnt)) == NL_OK)
                    st = pair_add_new(tr, x, c, cnt, w);
            }
            if (st == NL_OK && rd + 2 < n) {
                int32_t y = s[rd + 2];
                if ((st = pair_sub(tr, b, y, cnt)) == NL_OK)
                    st = pair_add_new(tr, c, y, cnt, w);
            }
            s[wr++] = c;
            rd += 2;
        } else {
            s[wr++] = s[rd++];
        }
    }
    tr->w_len[w] = wr;
    return st;
}

/* Make merge number tr->step: the pair p = (a, b) becomes a new id. */
static nl_status apply_merge(trainer *tr, int32_t p)
{
    int32_t a = (int32_t)(tr->p_key[p] >> 32), b = (int32_t)(uint32_t)tr->p_key[p];
    int32_t c = tr->t->n_ids;
    nl_status st = nl_tok_add_merge(tr->t, a, b, tr->err);
    tr->n_touched = 0;
    for (int32_t o = tr->p_head[p]; o >= 0 && st == NL_OK; o = tr->occ_next[o]) {
        int32_t w = tr->occ_word[o];
        if (tr->w_stamp[w] == tr->step)
            continue;
        tr->w_stamp[w] = tr->step;
        st = merge_word(tr, w, a, b, c);
    }
    if (st != NL_OK)
        return st;
    if (tr->p_count[p] != 0)
        return nl_error_set(tr->err, NL_ERR_INTERNAL,
                            "tokenizer: pair %d %d still counted %lld after its merge", a, b,
                            (long long)tr->p_count[p]);
    for (size_t i = 0; i < tr->n_touched && st == NL_OK; i++) {
        int32_t q = tr->touched[i];
        if (tr->p_count[q] > 0 && eligible(tr, tr->p_key[q]))
            st = heap_push(tr, (heap_entry){tr->p_count[q], tr->p_key[q]});
    }
    return st;
}

/* The best pair with at least min_count occurrences, or -1. */
static int32_t best_pair(trainer *tr, int64_t min_count, nl_status *st)
{
    *st = NL_OK;
    while (tr->heap_n > 0) {
        heap_entry top = tr->heap[0];
        int32_t p = pair_find(tr, top.key);
        heap_pop(tr);
        if (p < 0) {
            *st = nl_error_set(tr->err, NL_ERR_INTERNAL, "tokenizer: queued pair vanished");
            return -1;
        }
        int64_t cur = tr->p_count[p];
        if (cur == top.count) {
            if (cur >= min_count)
                return p;
            return -1;
        }
        if (cur > 0 && (*st = heap_push(tr, (heap_entry){cur, top.key})) != NL_OK)
            return -1;
    }
    return -1;
}

nl_tokenizer_train_opts nl_tokenizer_train_opts_default(void)
{
    return (nl_tokenizer_train_opts){.min_count = 2, .progress = NULL, .progress_ctx = NULL};
}

nl_status nl_tokenizer_learn_corpus(nl_tokenizer *t, const nl_bpe_corpus *c, int32_t add_n,
                                    const nl_tokenizer_train_opts *opts, nl_error *err)
{
    nl_tokenizer_train_opts o = opts ? *opts : nl_tokenizer_train_opts_default();
    trainer tr = {.t = t, .err = err};
    int32_t old_ids = t->n_ids;
    nl_status st = NL_OK;
    if (add_n < 0)
        return nl_error_set(err, NL_ERR_INVALID, "tokenizer: cannot add %d merges", add_n);
    if (c->split != t->split)
        return nl_error_set(err, NL_ERR_INVALID,
                            "tokenizer: the corpus was cut into words by %s classes, the "
                            "tokenizer cuts by %s ones",
                            c->split == NL_TOKENIZER_SPLIT_BYTES ? "byte" : "Unicode",
                            t->split == NL_TOKENIZER_SPLIT_BYTES ? "byte" : "Unicode");
    if (add_n > NL_TOKENIZER_MAX_IDS - t->n_ids)
        add_n = NL_TOKENIZER_MAX_IDS - t->n_ids;
    if (o.min_count < 1)
        o.min_count = 1;
    if (add_n == 0)
        return NL_OK;
    if ((st = load_words(&tr, c)) != NL_OK || (st = count_pairs(&tr)) != NL_OK)
        goto out;
    for (int32_t done = 0; done < add_n;) {
        int32_t p = best_pair(&tr, o.min_count, &st);
        if (p < 0)
            break;
        tr.step = done + 1;
        if ((st = apply_merge(&tr, p)) != NL_OK)
            break;
        done++;
        if (o.progress)
            o.progress(o.progress_ctx, done, add_n);
    }
out:
    trainer_free(&tr);
    if (st != NL_OK)
        nl_tok_truncate(t, old_ids);
    return st;
}

nl_status nl_tokenizer_learn(nl_tokenizer *t, const void *text, size_t len, int32_t add_n,
                             const nl_tokenizer_train_opts *opts, nl_error *err)
{
    nl_bpe_corpus *c = NULL;
    nl_status st = nl_bpe_corpus_new(&c, t->split, err);
    if (st == NL_OK)
        st = nl_bpe_corpus_add(c, text, len, err);
    if (st == NL_OK)
        st = nl_tokenizer_learn_corpus(t, c, add_n, opts, err);
    nl_bpe_corpus_destroy(&c);
    return st;
}

nl_status nl_tokenizer_train(nl_tokenizer **out, const void *text, size_t len, int32_t vocab_size,
                             const nl_tokenizer_train_opts *opts, nl_error *err)
{
    *out = NULL;
    if (vocab_size < NL_TOKEN_FIRST_MERGE)
        return nl_error_set(err, NL_ERR_INVALID,
                            "tokenizer: vocab_size %d is below %d (256 bytes and 3 specials)",
                            vocab_size, NL_TOKEN_FIRST_MERGE);
    nl_tokenizer *t = NULL;
    nl_status st = nl_tokenizer_new_bytes(&t, err);
    if (st == NL_OK)
        st = nl_tokenizer_learn(t, text, len, vocab_size - NL_TOKEN_FIRST_MERGE, opts, err);
    if (st != NL_OK) {
        nl_tokenizer_destroy(&t);
        return st;
    }
    *out = t;
    return NL_OK;
}
