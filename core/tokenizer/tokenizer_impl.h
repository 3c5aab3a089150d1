/* Internals shared by core/tokenizer/tokenizer.c (tables, encoding, files) and
 * core/tokenizer/bpe_train.c (learning). Not part of the public interface. */
#ifndef NL_TOKENIZER_IMPL_H
#define NL_TOKENIZER_IMPL_H

#include <stdint.h>

#include "core/tokenizer/tokenizer.h"

/* Words longer than this are encoded without the cache. */
#define NL_TOK_CACHE_MAX_WORD 64

/* Encoder word cache: an open-addressing table over two arenas (word bytes
 * and ids). When an arena or the table fills it is emptied in one go, so
 * memory stays bounded. */
typedef struct nl_tok_cache_slot {
    uint64_t hash;
    uint32_t word_off;
    uint32_t ids_off;
    uint8_t word_len; /* 0: empty slot */
    uint8_t n_ids;
} nl_tok_cache_slot;

typedef struct nl_tok_cache {
    nl_tok_cache_slot *slots;
    size_t mask; /* slots - 1; 0 when the cache is off */
    size_t n, max_words;
    uint8_t *bytes;
    size_t bytes_len, bytes_cap;
    int32_t *ids;
    size_t ids_len, ids_cap;
} nl_tok_cache;

/* Ids and merges. A native tokenizer (explicit_ids 0) has ids 0..255 for
 * the bytes, 256..258 for the specials and 259 + r for merge r; one
 * imported from another library (explicit_ids 1) has its ids where that
 * library put them: byte_id says which id each byte is, merge_out which
 * id each merge makes (two merges may make the same id). */
struct nl_tokenizer {
    nl_tokenizer_split split; /* the pre-tokenizer's classes */
    int explicit_ids;
    int32_t n_ids, cap_ids;
    int32_t n_merges, cap_merges;
    int32_t *merges;    /* (a, b) for merge rank r at [2r], [2r + 1] */
    int32_t *merge_out; /* the id merge r makes */
    int32_t *made_by;   /* per id: the first merge that makes it, or -1 */
    uint8_t *special;   /* per id: 1 for a special token (never encoded) */
    int32_t byte_id[256];
    size_t *tok_off;   /* offset of each id's bytes in pool */
    uint16_t *tok_len; /* <= NL_TOKENIZER_MAX_TOKEN_BYTES */
    uint8_t *pool;
    size_t pool_len, pool_cap;
    /* merge map (a << 32 | b) -> rank; empty slots hold UINT64_MAX */
    uint64_t *map_keys;
    int32_t *map_vals;
    size_t map_mask, map_n;
    /* scratch for encoding one word */
    int32_t *ws_sym, *ws_rank, *ws_prev, *ws_next;
    uint64_t *ws_heap;
    size_t ws_cap;
    nl_tok_cache cache;
};

static inline uint64_t nl_tok_pair_key(int32_t a, int32_t b)
{
    return (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
}

static inline size_t nl_tok_hash_u64(uint64_t k, size_t mask)
{
    k ^= k >> 31;
    k *= 0x9E3779B97F4A7C15ull;
    return (size_t)(k >> 29) & mask;
}

/* Hash of a byte string (not cryptographic). */
uint64_t nl_tok_hash_bytes(const uint8_t *p, size_t n);

/* Rank of the merge (a, b), or -1. */
static inline int32_t nl_tok_merge_rank(const nl_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = nl_tok_pair_key(a, b);
    size_t i = nl_tok_hash_u64(key, t->map_mask);
    for (;;) {
        uint64_t k = t->map_keys[i];
        if (k == key)
            return t->map_vals[i];
        if (k == UINT64_MAX)
            return -1;
        i = (i + 1) & t->map_mask;
    }
}

/* Append merge (a, b) as id t->n_ids. The caller has checked that a and b
 * are defined, not special, not already merged, and that the result is at
 * most NL_TOKENIZER_MAX_TOKEN_BYTES long. */
nl_status nl_tok_add_merge(nl_tokenizer *t, int32_t a, int32_t b, nl_error *err);

/* A tokenizer with no ids at all (explicit_ids), to be filled in id order
 * by nl_tok_add_token and then nl_tok_add_merge_to (an import). */
nl_status nl_tok_new_empty(nl_tokenizer **out, nl_error *err);
/* Append id t->n_ids with n bytes (1..NL_TOKENIZER_MAX_TOKEN_BYTES; a
 * special token's are its name). The first one-byte non-special id of a
 * byte becomes that byte's id. */
nl_status nl_tok_add_token(nl_tokenizer *t, const uint8_t *p, size_t n, int special, nl_error *err);
/* Append merge rank t->n_merges: (a, b) makes the existing id out. The
 * caller has checked ids, bytes and that the pair is new. */
nl_status nl_tok_add_merge_to(nl_tokenizer *t, int32_t a, int32_t b, int32_t out, nl_error *err);

/* Drop the ids >= n_ids and the merges that make them, e.g. to undo a
 * failed learning step. */
void nl_tok_truncate(nl_tokenizer *t, int32_t n_ids);

/* Encode one word (len >= 1) without the cache. *ids points into the
 * tokenizer's scratch and is valid until the next call. */
nl_status nl_tok_encode_word(nl_tokenizer *t, const uint8_t *w, size_t len, const int32_t **ids,
                             size_t *n, nl_error *err);

#endif
