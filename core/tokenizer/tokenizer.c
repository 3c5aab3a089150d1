/* Byte-level BPE tokenizer: the id tables, encoding (merges by rank, with
 * a bounded word cache) and decoding. The pre-tokenizer is in
 * tokenizer_split.c, learning in bpe_train.c, the file format in
 * tokenizer_file.c. */
#include "core/tokenizer/tokenizer.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "core/tokenizer/tokenizer_impl.h"

static const char *const special_names[3] = {"<|begin|>", "<|end|>", "<|pad|>"};

/* ------------------------------------------------------------------ */
/* id tables and the merge map                                         */
/* ------------------------------------------------------------------ */

uint64_t nl_tok_hash_bytes(const uint8_t *p, size_t n)
{
    const uint64_t m = 0xC6A4A7935BD1E995ull;
    uint64_t h = 0x243F6A8885A308D3ull ^ (n * m);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = (h ^ v) * m;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, p, n);
    h = (h ^ v) * m;
    h ^= h >> 32;
    h *= 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    return h;
}

static nl_status map_init(nl_tokenizer *t, size_t slots, nl_error *err)
{
    t->map_keys = malloc(slots * sizeof *t->map_keys);
    t->map_vals = malloc(slots * sizeof *t->map_vals);
    if (!t->map_keys || !t->map_vals)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for the merge map");
    memset(t->map_keys, 0xFF, slots * sizeof *t->map_keys);
    t->map_mask = slots - 1;
    t->map_n = 0;
    return NL_OK;
}

static void map_put(nl_tokenizer *t, uint64_t key, int32_t val)
{
    size_t i = nl_tok_hash_u64(key, t->map_mask);
    while (t->map_keys[i] != UINT64_MAX)
        i = (i + 1) & t->map_mask;
    t->map_keys[i] = key;
    t->map_vals[i] = val;
    t->map_n++;
}

static nl_status map_grow(nl_tokenizer *t, nl_error *err)
{
    uint64_t *keys = t->map_keys;
    int32_t *vals = t->map_vals;
    size_t old = t->map_mask + 1;
    t->map_keys = NULL;
    t->map_vals = NULL;
    nl_status st = map_init(t, old * 2, err);
    if (st != NL_OK) {
        free(t->map_keys);
        free(t->map_vals);
        t->map_keys = keys;
        t->map_vals = vals;
        t->map_mask = old - 1;
        return st;
    }
    for (size_t i = 0; i < old; i++)
        if (keys[i] != UINT64_MAX)
            map_put(t, keys[i], vals[i]);
    free(keys);
    free(vals);
    return NL_OK;
}

/* Room for one more id. */
static nl_status grow_ids(nl_tokenizer *t, nl_error *err)
{
    if (t->n_ids < t->cap_ids)
        return NL_OK;
    int32_t cap = t->cap_ids > INT32_MAX / 2 ? INT32_MAX : t->cap_ids * 2;
    size_t *off = realloc(t->tok_off, (size_t)cap * sizeof *off);
    if (off)
        t->tok_off = off;
    uint16_t *len = realloc(t->tok_len, (size_t)cap * sizeof *len);
    if (len)
        t->tok_len = len;
    int32_t *made = realloc(t->made_by, (size_t)cap * sizeof *made);
    if (made)
        t->made_by = made;
    uint8_t *sp = realloc(t->special, (size_t)cap);
    if (sp)
        t->special = sp;
    if (!off || !len || !made || !sp)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for %d ids", cap);
    t->cap_ids = cap;
    return NL_OK;
}

/* Room for one more merge. */
static nl_status grow_merges(nl_tokenizer *t, nl_error *err)
{
    if (t->n_merges < t->cap_merges)
        return NL_OK;
    int32_t cap = t->cap_merges > INT32_MAX / 4 ? INT32_MAX / 2 : t->cap_merges * 2;
    int32_t *merges = realloc(t->merges, (size_t)cap * 2 * sizeof *merges);
    if (merges)
        t->merges = merges;
    int32_t *mo = realloc(t->merge_out, (size_t)cap * sizeof *mo);
    if (mo)
        t->merge_out = mo;
    if (!merges || !mo)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for %d merges", cap);
    t->cap_merges = cap;
    return NL_OK;
}

static nl_status pool_reserve(nl_tokenizer *t, size_t extra, nl_error *err)
{
    if (t->pool_cap - t->pool_len >= extra)
        return NL_OK;
    size_t cap = t->pool_cap * 2 > t->pool_len + extra ? t->pool_cap * 2 : t->pool_len + extra;
    uint8_t *p = realloc(t->pool, cap);
    if (!p)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for %zu token bytes", cap);
    t->pool = p;
    t->pool_cap = cap;
    return NL_OK;
}

static void cache_clear(nl_tok_cache *c)
{
    if (c->slots)
        memset(c->slots, 0, (c->mask + 1) * sizeof *c->slots);
    c->n = c->bytes_len = c->ids_len = 0;
}

nl_status nl_tok_add_token(nl_tokenizer *t, const uint8_t *p, size_t n, int special, nl_error *err)
{
    nl_status st;
    if (t->n_ids >= NL_TOKENIZER_MAX_IDS)
        return nl_error_set(err, NL_ERR_LIMIT, "tokenizer: the id space (%d ids) is full",
                            NL_TOKENIZER_MAX_IDS);
    if ((st = grow_ids(t, err)) != NL_OK || (st = pool_reserve(t, n, err)) != NL_OK)
        return st;
    int32_t id = t->n_ids;
    memcpy(t->pool + t->pool_len, p, n);
    t->tok_off[id] = t->pool_len;
    t->tok_len[id] = (uint16_t)n;
    t->pool_len += n;
    t->made_by[id] = -1;
    t->special[id] = (uint8_t)(special != 0);
    if (!special && n == 1 && t->byte_id[p[0]] < 0)
        t->byte_id[p[0]] = id;
    t->n_ids++;
    return NL_OK;
}

nl_status nl_tok_add_merge_to(nl_tokenizer *t, int32_t a, int32_t b, int32_t out, nl_error *err)
{
    nl_status st;
    if ((st = grow_merges(t, err)) != NL_OK)
        return st;
    if ((t->map_n + 1) * 2 > t->map_mask + 1 && (st = map_grow(t, err)) != NL_OK)
        return st;
    if (t->cache.n)
        cache_clear(&t->cache); /* cached words may now encode differently */
    int32_t r = t->n_merges;
    t->merges[2 * (size_t)r] = a;
    t->merges[2 * (size_t)r + 1] = b;
    t->merge_out[r] = out;
    if (t->made_by[out] < 0)
        t->made_by[out] = r;
    map_put(t, nl_tok_pair_key(a, b), r);
    t->n_merges++;
    return NL_OK;
}

nl_status nl_tok_add_merge(nl_tokenizer *t, int32_t a, int32_t b, nl_error *err)
{
    size_t la = t->tok_len[a], lb = t->tok_len[b];
    uint8_t buf[2 * NL_TOKENIZER_MAX_TOKEN_BYTES];
    memcpy(buf, t->pool + t->tok_off[a], la); /* the pool may move */
    memcpy(buf + la, t->pool + t->tok_off[b], lb);
    nl_status st = nl_tok_add_token(t, buf, la + lb, 0, err);
    if (st == NL_OK && (st = nl_tok_add_merge_to(t, a, b, t->n_ids - 1, err)) != NL_OK) {
        t->n_ids--;
        t->pool_len -= la + lb;
    }
    return st;
}

void nl_tok_truncate(nl_tokenizer *t, int32_t n_ids)
{
    if (n_ids >= t->n_ids || n_ids < 0)
        return;
    t->pool_len = t->tok_off[n_ids];
    t->n_ids = n_ids;
    while (t->n_merges > 0 && t->merge_out[t->n_merges - 1] >= n_ids)
        t->n_merges--;
    for (int b = 0; b < 256; b++)
        if (t->byte_id[b] >= n_ids)
            t->byte_id[b] = -1;
    memset(t->map_keys, 0xFF, (t->map_mask + 1) * sizeof *t->map_keys);
    t->map_n = 0;
    for (int32_t r = 0; r < t->n_merges; r++)
        map_put(t, nl_tok_pair_key(t->merges[2 * (size_t)r], t->merges[2 * (size_t)r + 1]), r);
    cache_clear(&t->cache);
}

static void cache_free(nl_tok_cache *c)
{
    free(c->slots);
    free(c->bytes);
    free(c->ids);
    memset(c, 0, sizeof *c);
}

nl_status nl_tokenizer_set_cache(nl_tokenizer *t, size_t max_words, nl_error *err)
{
    (void)err; /* the cache is allocated on first use */
    cache_free(&t->cache);
    t->cache.max_words = max_words > ((size_t)1 << 24) ? (size_t)1 << 24 : max_words;
    return NL_OK;
}

static nl_status cache_alloc(nl_tok_cache *c, nl_error *err)
{
    size_t slots = 16;
    while (slots < 2 * c->max_words)
        slots *= 2;
    c->slots = calloc(slots, sizeof *c->slots);
    c->bytes_cap = c->max_words * 16;
    c->ids_cap = c->max_words * 8;
    c->bytes = malloc(c->bytes_cap);
    c->ids = malloc(c->ids_cap * sizeof *c->ids);
    if (!c->slots || !c->bytes || !c->ids) {
        size_t max_words = c->max_words;
        cache_free(c);
        c->max_words = max_words;
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for a cache of %zu words",
                            max_words);
    }
    c->mask = slots - 1;
    return NL_OK;
}

nl_status nl_tok_new_empty(nl_tokenizer **out, nl_error *err)
{
    *out = NULL;
    nl_status st = NL_OK;
    nl_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory");
    t->cap_ids = 1024;
    t->cap_merges = 1024;
    t->merges = malloc((size_t)t->cap_merges * 2 * sizeof *t->merges);
    t->merge_out = malloc((size_t)t->cap_merges * sizeof *t->merge_out);
    t->tok_off = malloc((size_t)t->cap_ids * sizeof *t->tok_off);
    t->tok_len = malloc((size_t)t->cap_ids * sizeof *t->tok_len);
    t->made_by = malloc((size_t)t->cap_ids * sizeof *t->made_by);
    t->special = malloc((size_t)t->cap_ids);
    t->pool_cap = 4096;
    t->pool = malloc(t->pool_cap);
    if (!t->merges || !t->merge_out || !t->tok_off || !t->tok_len || !t->made_by || !t->special ||
        !t->pool) {
        st = nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory");
        goto fail;
    }
    for (int i = 0; i < 256; i++)
        t->byte_id[i] = -1;
    t->explicit_ids = 1;
    t->split = NL_TOKENIZER_SPLIT_UNICODE;
    if ((st = map_init(t, 1024, err)) != NL_OK ||
        (st = nl_tokenizer_set_cache(t, NL_TOKENIZER_DEFAULT_CACHE, err)) != NL_OK)
        goto fail;
    *out = t;
    return NL_OK;
fail:
    nl_tokenizer_destroy(&t);
    return st;
}

nl_status nl_tokenizer_new_bytes(nl_tokenizer **out, nl_error *err)
{
    nl_tokenizer *t = NULL;
    nl_status st = nl_tok_new_empty(&t, err);
    for (int i = 0; i < 256 && st == NL_OK; i++) {
        uint8_t b = (uint8_t)i;
        st = nl_tok_add_token(t, &b, 1, 0, err);
    }
    for (int i = 0; i < 3 && st == NL_OK; i++)
        st = nl_tok_add_token(t, (const uint8_t *)special_names[i], strlen(special_names[i]), 1,
                              err);
    if (st != NL_OK) {
        nl_tokenizer_destroy(&t);
        return st;
    }
    t->explicit_ids = 0;
    *out = t;
    return NL_OK;
}

nl_status nl_tokenizer_new_empty(nl_tokenizer **out, nl_tokenizer_split split, nl_error *err)
{
    nl_status st = nl_tok_new_empty(out, err);
    if (st == NL_OK)
        (*out)->split = split;
    return st;
}

nl_status nl_tokenizer_append_token(nl_tokenizer *t, const void *bytes, size_t n, int special,
                                    nl_error *err)
{
    if (n < 1 || n > NL_TOKENIZER_MAX_TOKEN_BYTES)
        return nl_error_set(err, NL_ERR_LIMIT, "tokenizer: id %d: %zu bytes (1..%d)", t->n_ids, n,
                            NL_TOKENIZER_MAX_TOKEN_BYTES);
    return nl_tok_add_token(t, bytes, n, special, err);
}

nl_status nl_tokenizer_append_merge(nl_tokenizer *t, int32_t a, int32_t b, int32_t out,
                                    nl_error *err)
{
    int32_t ab[3] = {a, b, out};
    for (int k = 0; k < 3; k++) {
        if (ab[k] < 0 || ab[k] >= t->n_ids)
            return nl_error_set(err, NL_ERR_RANGE, "tokenizer: merge %d: id %d is not defined",
                                t->n_merges, ab[k]);
        if (t->special[ab[k]])
            return nl_error_set(err, NL_ERR_FORMAT, "tokenizer: merge %d uses special id %d",
                                t->n_merges, ab[k]);
    }
    size_t la = t->tok_len[a], lb = t->tok_len[b];
    if (t->tok_len[out] != la + lb ||
        memcmp(t->pool + t->tok_off[out], t->pool + t->tok_off[a], la) != 0 ||
        memcmp(t->pool + t->tok_off[out] + la, t->pool + t->tok_off[b], lb) != 0)
        return nl_error_set(err, NL_ERR_FORMAT,
                            "tokenizer: merge %d: id %d's bytes are not id %d's then id %d's",
                            t->n_merges, out, a, b);
    if (nl_tok_merge_rank(t, a, b) >= 0)
        return nl_error_set(err, NL_ERR_FORMAT, "tokenizer: merge %d: %d %d is merged already",
                            t->n_merges, a, b);
    return nl_tok_add_merge_to(t, a, b, out, err);
}

void nl_tokenizer_settle(nl_tokenizer *t)
{
    if (!t->explicit_ids || t->n_ids < NL_TOKEN_FIRST_MERGE ||
        t->n_merges != t->n_ids - NL_TOKEN_FIRST_MERGE)
        return;
    for (int32_t id = 0; id < NL_TOKEN_FIRST_MERGE; id++) {
        int special = id >= NL_TOKEN_BEGIN;
        const char *name = special ? special_names[id - NL_TOKEN_BEGIN] : NULL;
        if (t->special[id] != special ||
            (special ? t->tok_len[id] != strlen(name) ||
                           memcmp(t->pool + t->tok_off[id], name, t->tok_len[id]) != 0
                     : t->tok_len[id] != 1 || t->pool[t->tok_off[id]] != id))
            return;
    }
    for (int32_t r = 0; r < t->n_merges; r++)
        if (t->merge_out[r] != NL_TOKEN_FIRST_MERGE + r)
            return;
    t->explicit_ids = 0;
}

int nl_tokenizer_byte_id(const nl_tokenizer *t, uint8_t b)
{
    return t->byte_id[b];
}

void nl_tokenizer_destroy(nl_tokenizer **tp)
{
    if (!tp || !*tp)
        return;
    nl_tokenizer *t = *tp;
    free(t->merges);
    free(t->merge_out);
    free(t->made_by);
    free(t->special);
    free(t->tok_off);
    free(t->tok_len);
    free(t->pool);
    free(t->map_keys);
    free(t->map_vals);
    free(t->ws_sym);
    free(t->ws_rank);
    free(t->ws_prev);
    free(t->ws_next);
    free(t->ws_heap);
    cache_free(&t->cache);
    free(t);
    *tp = NULL;
}

int32_t nl_tokenizer_vocab_size(const nl_tokenizer *t)
{
    return t->n_ids;
}

int32_t nl_tokenizer_num_merges(const nl_tokenizer *t)
{
    return t->n_merges;
}

int nl_tokenizer_is_native(const nl_tokenizer *t)
{
    return !t->explicit_ids;
}

nl_tokenizer_split nl_tokenizer_split_mode(const nl_tokenizer *t)
{
    return t->split;
}

int nl_tokenizer_is_special(const nl_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_ids && t->special[id];
}

nl_status nl_tokenizer_token_bytes(const nl_tokenizer *t, int32_t id, const uint8_t **ptr,
                                   size_t *len)
{
    if (id < 0 || id >= t->n_ids)
        return NL_ERR_RANGE;
    *ptr = t->pool + t->tok_off[id];
    *len = t->tok_len[id];
    return NL_OK;
}

nl_status nl_tokenizer_merge_pair(const nl_tokenizer *t, int32_t id, int32_t *a, int32_t *b)
{
    if (id < 0 || id >= t->n_ids || t->made_by[id] < 0)
        return NL_ERR_RANGE;
    *a = t->merges[2 * (size_t)t->made_by[id]];
    *b = t->merges[2 * (size_t)t->made_by[id] + 1];
    return NL_OK;
}

nl_status nl_tokenizer_merge_at(const nl_tokenizer *t, int32_t rank, int32_t *a, int32_t *b,
                                int32_t *out)
{
    if (rank < 0 || rank >= t->n_merges)
        return NL_ERR_RANGE;
    *a = t->merges[2 * (size_t)rank];
    *b = t->merges[2 * (size_t)rank + 1];
    *out = t->merge_out[rank];
    return NL_OK;
}

/* ------------------------------------------------------------------ */
/* encoding                                                            */
/* ------------------------------------------------------------------ */

static nl_status scratch_reserve(nl_tokenizer *t, size_t n, nl_error *err)
{
    if (n <= t->ws_cap)
        return NL_OK;
    size_t cap = t->ws_cap * 2 > n ? t->ws_cap * 2 : n;
    if (cap < 256)
        cap = 256;
    if (cap > SIZE_MAX / (3 * sizeof(uint64_t)))
        return nl_error_set(err, NL_ERR_LIMIT, "tokenizer: word of %zu bytes is too long", n);
    int32_t *sym = realloc(t->ws_sym, cap * sizeof *sym);
    if (sym)
        t->ws_sym = sym;
    int32_t *rank = realloc(t->ws_rank, cap * sizeof *rank);
    if (rank)
        t->ws_rank = rank;
    int32_t *prev = realloc(t->ws_prev, cap * sizeof *prev);
    if (prev)
        t->ws_prev = prev;
    int32_t *next = realloc(t->ws_next, cap * sizeof *next);
    if (next)
        t->ws_next = next;
    uint64_t *heap = realloc(t->ws_heap, 3 * cap * sizeof *heap);
    if (heap)
        t->ws_heap = heap;
    if (!sym || !rank || !prev || !next || !heap)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for a word of %zu bytes",
                            n);
    t->ws_cap = cap;
    return NL_OK;
}

static inline int32_t pair_rank(const nl_tokenizer *t, int32_t a, int32_t b)
{
    int32_t r = nl_tok_merge_rank(t, a, b);
    return r < 0 ? INT32_MAX : r;
}

/* Short words: keep the rank of every adjacent pair and merge the lowest
 * (leftmost on ties) until none is left. O(n^2) but n is small. */
static size_t encode_short(const nl_tokenizer *t, int32_t *sym, int32_t *rk, size_t n)
{
    for (size_t i = 0; i + 1 < n; i++)
        rk[i] = pair_rank(t, sym[i], sym[i + 1]);
    while (n > 1) {
        int32_t best = INT32_MAX;
        size_t bi = 0;
        for (size_t i = 0; i + 1 < n; i++)
            if (rk[i] < best) {
                best = rk[i];
                bi = i;
            }
        if (best == INT32_MAX)
            break;
        sym[bi] = t->merge_out[best];
        memmove(sym + bi + 1, sym + bi + 2, (n - bi - 2) * sizeof *sym);
        memmove(rk + bi, rk + bi + 1, (n - bi - 2) * sizeof *rk);
        n--;
        if (bi > 0)
            rk[bi - 1] = pair_rank(t, sym[bi - 1], sym[bi]);
        if (bi + 1 < n)
            rk[bi] = pair_rank(t, sym[bi], sym[bi + 1]);
    }
    return n;
}

/* Min-heap of (rank << 32 | position): the lowest rank first, leftmost on
 * ties, exactly the order in which merges apply. */
static void heap_push(uint64_t *h, size_t *n, uint64_t v)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v)
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n)
{
    uint64_t top = h[0], v = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m)
            break;
        if (c + 1 < m && h[c + 1] < h[c])
            c++;
        if (v <= h[c])
            break;
        h[i] = h[c];
        i = c;
    }
    if (m)
        h[i] = v;
    return top;
}

static void push_pair(const nl_tokenizer *t, uint64_t *h, size_t *hn, const int32_t *sym, int32_t i,
                      int32_t j)
{
    int32_t r = nl_tok_merge_rank(t, sym[i], sym[j]);
    if (r >= 0)
        heap_push(h, hn, (uint64_t)(uint32_t)r << 32 | (uint32_t)i);
}

/* Long words: a linked list of symbols and a heap of candidate merges,
 * each checked against the current symbols when it comes out. */
static size_t encode_long(const nl_tokenizer *t, int32_t *sym, int32_t *prev, int32_t *next,
                          uint64_t *heap, size_t n)
{
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        prev[i] = (int32_t)i - 1;
        next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    for (size_t i = 0; i + 1 < n; i++)
        push_pair(t, heap, &hn, sym, (int32_t)i, (int32_t)i + 1);
    while (hn > 0) {
        uint64_t top = heap_pop(heap, &hn);
        int32_t r = (int32_t)(top >> 32), i = (int32_t)(uint32_t)top, j = next[i];
        if (sym[i] < 0 || j < 0 || sym[i] != t->merges[2 * (size_t)r] ||
            sym[j] != t->merges[2 * (size_t)r + 1])
            continue; /* stale */
        sym[i] = t->merge_out[r];
        sym[j] = -1;
        next[i] = next[j];
        if (next[j] >= 0)
            prev[next[j]] = i;
        if (prev[i] >= 0)
            push_pair(t, heap, &hn, sym, prev[i], i);
        if (next[i] >= 0)
            push_pair(t, heap, &hn, sym, i, next[i]);
    }
    size_t m = 0;
    for (int32_t i = 0; i >= 0; i = next[i])
        sym[m++] = sym[i];
    return m;
}

nl_status nl_tok_encode_word(nl_tokenizer *t, const uint8_t *w, size_t len, const int32_t **ids,
                             size_t *n, nl_error *err)
{
    if (len > INT32_MAX)
        return nl_error_set(err, NL_ERR_LIMIT, "tokenizer: word of %zu bytes is too long", len);
    nl_status st = scratch_reserve(t, len, err);
    if (st != NL_OK)
        return st;
    int32_t *sym = t->ws_sym;
    for (size_t i = 0; i < len; i++)
        sym[i] = t->byte_id[w[i]];
    if (t->n_merges == 0)
        *n = len;
    else if (len <= 64)
        *n = encode_short(t, sym, t->ws_rank, len);
    else
        *n = encode_long(t, sym, t->ws_prev, t->ws_next, t->ws_heap, len);
    *ids = sym;
    return NL_OK;
}

static const int32_t *cache_find(const nl_tok_cache *c, const uint8_t *w, size_t len, uint64_t h,
                                 size_t *n)
{
    for (size_t i = (size_t)h & c->mask;; i = (i + 1) & c->mask) {
        const nl_tok_cache_slot *s = &c->slots[i];
        if (s->word_len == 0)
            return NULL;
        if (s->hash == h && s->word_len == len && memcmp(c->bytes + s->word_off, w, len) == 0) {
            *n = s->n_ids;
            return c->ids + s->ids_off;
        }
    }
}

/* Insert a word known to be absent; empties the cache first when full. */
static void cache_put(nl_tok_cache *c, const uint8_t *w, size_t len, uint64_t h, const int32_t *ids,
                      size_t n)
{
    if (c->n >= c->max_words || c->bytes_cap - c->bytes_len < len || c->ids_cap - c->ids_len < n)
        cache_clear(c);
    size_t i = (size_t)h & c->mask;
    while (c->slots[i].word_len != 0)
        i = (i + 1) & c->mask;
    nl_tok_cache_slot *s = &c->slots[i];
    s->hash = h;
    s->word_off = (uint32_t)c->bytes_len;
    s->ids_off = (uint32_t)c->ids_len;
    s->word_len = (uint8_t)len;
    s->n_ids = (uint8_t)n;
    memcpy(c->bytes + c->bytes_len, w, len);
    memcpy(c->ids + c->ids_len, ids, n * sizeof *ids);
    c->bytes_len += len;
    c->ids_len += n;
    c->n++;
}

nl_status nl_tokenizer_encode_into(nl_tokenizer *t, const void *text, size_t len, int32_t *out,
                                   size_t cap, size_t *n_out, nl_error *err)
{
    const uint8_t *s = text;
    nl_tok_cache *c = &t->cache;
    size_t n = 0;
    *n_out = 0;
    if (c->max_words && !c->slots && len > 0) {
        nl_status st = cache_alloc(c, err);
        if (st != NL_OK)
            return st;
    }
    for (size_t pos = 0; pos < len;) {
        size_t end = nl_tokenizer_split_next(t->split, s, len, pos), wl = end - pos, k = 0;
        const int32_t *ids = NULL;
        int32_t one = t->byte_id[s[pos]];
        if (wl == 1) {
            ids = &one;
            k = 1;
        } else if (c->mask && wl <= NL_TOK_CACHE_MAX_WORD) {
            uint64_t h = nl_tok_hash_bytes(s + pos, wl);
            ids = cache_find(c, s + pos, wl, h, &k);
            if (!ids) {
                nl_status st = nl_tok_encode_word(t, s + pos, wl, &ids, &k, err);
                if (st != NL_OK)
                    return st;
                cache_put(c, s + pos, wl, h, ids, k);
            }
        } else {
            nl_status st = nl_tok_encode_word(t, s + pos, wl, &ids, &k, err);
            if (st != NL_OK)
                return st;
        }
        if (cap - n < k)
            return nl_error_set(err, NL_ERR_LIMIT,
                                "tokenizer: %zu ids do not fit an output of %zu ids", n + k, cap);
        memcpy(out + n, ids, k * sizeof *ids);
        n += k;
        pos = end;
    }
    *n_out = n;
    return NL_OK;
}

nl_status nl_tokenizer_encode(nl_tokenizer *t, const void *text, size_t len, int32_t **ids,
                              size_t *n, nl_error *err)
{
    *ids = NULL;
    *n = 0;
    if (len > SIZE_MAX / sizeof(int32_t))
        return nl_error_set(err, NL_ERR_LIMIT, "tokenizer: input of %zu bytes is too large", len);
    int32_t *buf = malloc((len ? len : 1) * sizeof *buf);
    if (!buf)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for %zu ids", len);
    nl_status st = nl_tokenizer_encode_into(t, text, len, buf, len, n, err);
    if (st != NL_OK) {
        free(buf);
        *n = 0;
        return st;
    }
    int32_t *shrunk = realloc(buf, (*n ? *n : 1) * sizeof *buf);
    *ids = shrunk ? shrunk : buf;
    return NL_OK;
}

/* ------------------------------------------------------------------ */
/* decoding                                                            */
/* ------------------------------------------------------------------ */

nl_status nl_tokenizer_decode_flags(const nl_tokenizer *t, const int32_t *ids, size_t n,
                                    unsigned flags, char **out, size_t *len, nl_error *err)
{
    *out = NULL;
    *len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids)
            return nl_error_set(err, NL_ERR_RANGE,
                                "tokenizer: id %d at position %zu is not in the vocabulary "
                                "(ids 0..%d)",
                                id, i, t->n_ids - 1);
        if ((flags & NL_TOKENIZER_DECODE_STRICT) && t->special[id])
            return nl_error_set(err, NL_ERR_RANGE,
                                "tokenizer: special id %d (%.*s) at position %zu is refused", id,
                                (int)t->tok_len[id], (const char *)t->pool + t->tok_off[id], i);
        total += t->tok_len[id];
    }
    char *buf = malloc(total + 1);
    if (!buf)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory for %zu bytes", total);
    char *p = buf;
    for (size_t i = 0; i < n; i++) {
        memcpy(p, t->pool + t->tok_off[ids[i]], t->tok_len[ids[i]]);
        p += t->tok_len[ids[i]];
    }
    *p = '\0';
    *out = buf;
    *len = total;
    return NL_OK;
}

nl_status nl_tokenizer_decode(const nl_tokenizer *t, const int32_t *ids, size_t n, char **out,
                              size_t *len, nl_error *err)
{
    return nl_tokenizer_decode_flags(t, ids, n, 0, out, len, err);
}
