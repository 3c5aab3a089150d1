/* Byte-level BPE tokenizer that keeps learning.
 *
 * Ids 0..255 are the raw bytes, 256..258 the special tokens <|begin|>,
 * <|end|> and <|pad|>, and every id from 259 on is a merge (a, b) whose
 * bytes are the bytes of a followed by the bytes of b. Merges are applied
 * by rank (the order they were learned). Text is first split into words in
 * the manner of GPT-2 over Unicode letter, number and space classes (see
 * nl_tokenizer_split_next and docs/tokenizer.md), so a merge never crosses
 * a word boundary.
 *
 * Any byte string round-trips: decode(encode(x)) == x. Encoding never
 * emits the special ids; decoding a special id yields its name unless
 * NL_TOKENIZER_DECODE_STRICT is given.
 *
 * Learning only appends: an id, once defined, never changes its bytes.
 *
 * Ownership: the caller owns the nl_tokenizer and frees it with
 * nl_tokenizer_destroy. Buffers returned through `out` parameters are
 * malloc'd and owned by the caller. Thread safety: const functions may run
 * concurrently; encode updates the tokenizer's word cache and learn
 * appends merges, so neither may run concurrently with anything else on
 * the same tokenizer. */
#ifndef NL_TOKENIZER_H
#define NL_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

enum {
    NL_TOKEN_BEGIN = 256, /* <|begin|> */
    NL_TOKEN_END = 257,   /* <|end|> */
    NL_TOKEN_PAD = 258,   /* <|pad|> */
    NL_TOKEN_FIRST_MERGE = 259,
};

/* Ids stay below 2^31 - 1 so that they fit an int32 with room for one
 * past the end. */
#define NL_TOKENIZER_MAX_IDS INT32_MAX
/* The longest token, in bytes. Training never proposes a longer merge and
 * loading refuses one; this bounds the memory a file can ask for. */
#define NL_TOKENIZER_MAX_TOKEN_BYTES 256
/* The largest tokenizer file nl_tokenizer_load reads. */
#define NL_TOKENIZER_MAX_FILE_BYTES ((size_t)1 << 30)
/* The words the encoder's cache keeps by default (0 disables it). */
#define NL_TOKENIZER_DEFAULT_CACHE 32768

typedef struct nl_tokenizer nl_tokenizer;

/* The classes the GPT-2 rule runs over: Unicode's (new tokenizers, and
 * Hugging Face's ByteLevel pre-tokenizer), or version 1 files' bytes
 * (every byte >= 0x80 a letter), kept for the models trained with them. */
typedef enum {
    NL_TOKENIZER_SPLIT_UNICODE = 0,
    NL_TOKENIZER_SPLIT_BYTES = 1,
} nl_tokenizer_split;

/* ---- life cycle ---- */

/* A tokenizer with no merges: 259 ids (bytes and specials). */
nl_status nl_tokenizer_new_bytes(nl_tokenizer **out, nl_error *err);
/* Building a tokenizer with another library's ids (an import; then
 * nl_tokenizer_is_native is 0): start with no ids, append every id in
 * order (its bytes, 1..NL_TOKENIZER_MAX_TOKEN_BYTES; a special one's are
 * its name), then the merges by rank: (a, b) makes out, whose bytes must
 * be a's then b's. Every byte needs a one-byte id (nl_tokenizer_byte_id
 * >= 0) before the tokenizer encodes. Errors name the id or merge. */
nl_status nl_tokenizer_new_empty(nl_tokenizer **out, nl_tokenizer_split split, nl_error *err);
nl_status nl_tokenizer_append_token(nl_tokenizer *t, const void *bytes, size_t n, int special,
                                    nl_error *err);
nl_status nl_tokenizer_append_merge(nl_tokenizer *t, int32_t a, int32_t b, int32_t out,
                                    nl_error *err);
/* After building: when the ids turn out to be exactly our layout (e.g.
 * a tokenizer we exported, read back), the tokenizer is native again. */
void nl_tokenizer_settle(nl_tokenizer *t);
/* The id of the one-byte token b (-1: none yet). */
int nl_tokenizer_byte_id(const nl_tokenizer *t, uint8_t b);
/* Free *t and set it to NULL; safe on NULL and twice. */
void nl_tokenizer_destroy(nl_tokenizer **t);

/* Number of ids defined: 259 + number of merges. */
int32_t nl_tokenizer_vocab_size(const nl_tokenizer *t);
int32_t nl_tokenizer_num_merges(const nl_tokenizer *t);
/* Whether id is a special token: 256..258 in a native tokenizer, the
 * added tokens of an imported one. Encoding never emits one. */
int nl_tokenizer_is_special(const nl_tokenizer *t, int32_t id);
/* 1 for our own id layout (bytes 0..255, specials 256..258, merge r is
 * id 259 + r); 0 for a tokenizer imported with another library's ids
 * (docs/tokenizer.md, "Imported tokenizers"). */
int nl_tokenizer_is_native(const nl_tokenizer *t);

/* The bytes of id (a special id gives its name). *ptr points into the
 * tokenizer and stays valid until it is destroyed (learning moves it:
 * fetch again after nl_tokenizer_learn). NL_ERR_RANGE for an unknown id. */
nl_status nl_tokenizer_token_bytes(const nl_tokenizer *t, int32_t id, const uint8_t **ptr,
                                   size_t *len);
/* The two ids merged into id (the first merge that makes it), e.g. to
 * initialise a new embedding row from its parts. NL_ERR_RANGE for an id
 * no merge makes. */
nl_status nl_tokenizer_merge_pair(const nl_tokenizer *t, int32_t id, int32_t *a, int32_t *b);
/* Merge number rank: (a, b) makes out. NL_ERR_RANGE past the last. */
nl_status nl_tokenizer_merge_at(const nl_tokenizer *t, int32_t rank, int32_t *a, int32_t *b,
                                int32_t *out);

/* Size of the encoder's word cache in words (0 disables it; at most
 * 2^24). It is allocated on the first encode: about 100 bytes per word. */
nl_status nl_tokenizer_set_cache(nl_tokenizer *t, size_t max_words, nl_error *err);

/* ---- encoding and decoding ---- */

/* Encode len bytes into a malloc'd array of *n ids. */
nl_status nl_tokenizer_encode(nl_tokenizer *t, const void *text, size_t len, int32_t **ids,
                              size_t *n, nl_error *err);
/* Encode into the caller's array of cap ids; cap >= len always suffices.
 * NL_ERR_LIMIT if the ids do not fit (nothing useful is left in ids). */
nl_status nl_tokenizer_encode_into(nl_tokenizer *t, const void *text, size_t len, int32_t *ids,
                                   size_t cap, size_t *n, nl_error *err);

enum { NL_TOKENIZER_DECODE_STRICT = 1 }; /* refuse special ids */

/* Decode n ids into a malloc'd buffer of *len bytes, followed by a NUL
 * that *len does not count. An unknown id is an NL_ERR_RANGE naming it and
 * its position. Special ids decode to their names. */
nl_status nl_tokenizer_decode(const nl_tokenizer *t, const int32_t *ids, size_t n, char **out,
                              size_t *len, nl_error *err);
/* The same with flags (NL_TOKENIZER_DECODE_STRICT). */
nl_status nl_tokenizer_decode_flags(const nl_tokenizer *t, const int32_t *ids, size_t n,
                                    unsigned flags, char **out, size_t *len, nl_error *err);

/* ---- pre-tokenization ---- */

nl_tokenizer_split nl_tokenizer_split_mode(const nl_tokenizer *t);
/* End (exclusive) of the word that starts at pos (len if pos >= len). */
size_t nl_tokenizer_split_next(nl_tokenizer_split mode, const void *text, size_t len, size_t pos);
/* The largest p <= max (0 < p) at which text may be cut so that encoding
 * text[0, p) and text[p, len) separately gives the same ids as encoding
 * the whole: an ASCII whitespace byte that follows a character that is
 * not whitespace, or len itself when len <= max. 0 when there is no such
 * place. */
size_t nl_tokenizer_safe_split(nl_tokenizer_split mode, const void *text, size_t len, size_t max);

/* ---- learning ---- */

/* Progress of training: done merges out of target (target may not be
 * reached when the corpus runs out of pairs). */
typedef void (*nl_tokenizer_progress_fn)(void *ctx, int32_t done, int32_t target);

typedef struct nl_tokenizer_train_opts {
    /* Stop when the most frequent pair occurs fewer than this many times
     * in the corpus (0 and 1 both mean: while any pair is left). */
    int64_t min_count;
    nl_tokenizer_progress_fn progress; /* may be NULL */
    void *progress_ctx;
} nl_tokenizer_train_opts;

/* Defaults: min_count 2, no progress. Passing NULL opts means these. */
nl_tokenizer_train_opts nl_tokenizer_train_opts_default(void);

/* Word counts of a corpus, fed in pieces (e.g. one file at a time). Each
 * piece is split into words on its own (by `mode`: the split of the
 * tokenizer it will teach); a word never spans two pieces. */
typedef struct nl_bpe_corpus nl_bpe_corpus;

nl_status nl_bpe_corpus_new(nl_bpe_corpus **out, nl_tokenizer_split mode, nl_error *err);
void nl_bpe_corpus_destroy(nl_bpe_corpus **c);
nl_status nl_bpe_corpus_add(nl_bpe_corpus *c, const void *text, size_t len, nl_error *err);
size_t nl_bpe_corpus_unique_words(const nl_bpe_corpus *c);

/* Add up to add_n merges learned from the corpus, which is first encoded
 * with the existing merges (NL_ERR_INVALID when the corpus was split
 * otherwise than t splits). New ids follow the existing ones; existing ids
 * keep their bytes. Fewer merges are added when the pairs run out (see
 * min_count) or the id space (NL_TOKENIZER_MAX_IDS) is full. */
nl_status nl_tokenizer_learn_corpus(nl_tokenizer *t, const nl_bpe_corpus *c, int32_t add_n,
                                    const nl_tokenizer_train_opts *opts, nl_error *err);
/* The same on one piece of text. */
nl_status nl_tokenizer_learn(nl_tokenizer *t, const void *text, size_t len, int32_t add_n,
                             const nl_tokenizer_train_opts *opts, nl_error *err);
/* A new tokenizer with up to vocab_size ids (>= 259) learned from text. */
nl_status nl_tokenizer_train(nl_tokenizer **out, const void *text, size_t len, int32_t vocab_size,
                             const nl_tokenizer_train_opts *opts, nl_error *err);

/* ---- files (format: docs/tokenizer.md, "neurollm-bpe 1") ---- */

/* The file's text into a malloc'd, NUL-terminated buffer of printable
 * ASCII (lines end with '\n'), e.g. to store in checkpoint metadata. */
nl_status nl_tokenizer_save_buffer(const nl_tokenizer *t, char **out, size_t *len, nl_error *err);
/* Write the file atomically (temporary file, fsync, rename). */
nl_status nl_tokenizer_save(const nl_tokenizer *t, const char *path, nl_error *err);
/* Parse and validate; errors name the line, byte offset and fault. */
nl_status nl_tokenizer_load_buffer(nl_tokenizer **out, const void *buf, size_t len, nl_error *err);
nl_status nl_tokenizer_load(nl_tokenizer **out, const char *path, nl_error *err);

#endif
