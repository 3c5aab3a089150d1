/* Hugging Face interchange, the tokenizer (core/formats/hf.h): our byte-level BPE
 * tokenizer written as the files transformers loads (tokenizer.json for
 * AutoTokenizer, tokenizer_config.json, GPT-2's vocab.json and
 * merges.txt), and a byte-level BPE tokenizer.json (or vocab.json and
 * merges.txt) read back into ours with its ids where it has them.
 * docs/checkpoint-format.md, "Hugging Face", says what maps to what and
 * what is refused. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/formats/fileio.h"
#include "core/formats/hf_impl.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_impl.h"

#define FAIL HF_FAIL

/* What the version 1 byte classes are as an Oniguruma regex over text
 * (every character from U+0080 on is a letter): exported tokenizers that
 * split so (docs/tokenizer.md) cut text in transformers as they do here. */
static const char bytes_regex[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z\\x{80}-\\x{10FFFF}]+| ?[0-9]+"
    "| ?[^\\t\\n\\x0B\\f\\r A-Za-z0-9\\x{80}-\\x{10FFFF}]+"
    "|[\\t\\n\\x0B\\f\\r ]+(?![^\\t\\n\\x0B\\f\\r ])|[\\t\\n\\x0B\\f\\r ]+";

/* ------------------------------------------------- GPT-2's byte alphabet */

static int byte_printable(unsigned b)
{
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
}

/* GPT-2's printable stand-in for byte b (bytes_to_unicode): a code point. */
static unsigned byte_cp(uint8_t b)
{
    if (byte_printable(b))
        return b;
    unsigned n = 0; /* the rank of b among the bytes that are remapped */
    for (unsigned x = 0; x < b; x++)
        n += !byte_printable(x);
    return 256 + n;
}

/* The byte a stand-in code point means, or -1. */
static int cp_byte(unsigned cp)
{
    if (cp < 256)
        return byte_printable(cp) ? (int)cp : -1;
    unsigned n = cp - 256;
    for (unsigned x = 0; x < 256; x++)
        if (!byte_printable(x) && n-- == 0)
            return (int)x;
    return -1;
}

/* A token as GPT-2's vocab.json spells it (malloc'd; NULL: no memory). */
static char *token_string(const nl_tokenizer *t, int32_t id)
{
    const uint8_t *p;
    size_t n;
    if (nl_tokenizer_token_bytes(t, id, &p, &n) != NL_OK)
        return NULL;
    char *s = malloc(2 * n + 1), *o = s;
    if (!s)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        unsigned cp = byte_cp(p[i]);
        if (cp < 0x80) {
            *o++ = (char)cp;
        } else {
            *o++ = (char)(0xc0 | (cp >> 6));
            *o++ = (char)(0x80 | (cp & 63));
        }
    }
    *o = '\0';
    return s;
}

/* ------------------------------------------------------------- writing */

/* tokenizer_config.json: what AutoTokenizer reads besides tokenizer.json.
 * The one place its fields are made (a new field is added here). */
json_t *hf_tokenizer_config(const nl_tokenizer *t, const nl_config *cfg)
{
    json_t *c = json_object(), *dec = json_object();
    if (!c || !dec) {
        json_decref(c);
        json_decref(dec);
        return NULL;
    }
    json_object_set_new(c, "tokenizer_class", json_string("PreTrainedTokenizerFast"));
    json_object_set_new(c, "model_max_length", json_integer(cfg->max_seq_len));
    json_object_set_new(c, "clean_up_tokenization_spaces", json_false());
    for (int32_t id = 0; id < nl_tokenizer_vocab_size(t); id++) {
        const uint8_t *p;
        size_t n;
        char key[16];
        if (!nl_tokenizer_is_special(t, id) || nl_tokenizer_token_bytes(t, id, &p, &n) != NL_OK)
            continue;
        snprintf(key, sizeof key, "%d", id);
        json_object_set_new(dec, key,
                            json_pack("{s:s%,s:b,s:b,s:b,s:b,s:b}", "content", (const char *)p, n,
                                      "lstrip", 0, "normalized", 0, "rstrip", 0, "single_word", 0,
                                      "special", 1));
    }
    json_object_set_new(c, "added_tokens_decoder", dec);
    if (nl_tokenizer_is_native(t)) { /* our specials' roles are known */
        json_object_set_new(c, "bos_token", json_string("<|begin|>"));
        json_object_set_new(c, "eos_token", json_string("<|end|>"));
        json_object_set_new(c, "pad_token", json_string("<|pad|>"));
    }
    return c;
}

/* The pre-tokenizer: ByteLevel's own GPT-2 regex (Unicode classes), or
 * the byte classes as a Split before a ByteLevel that only maps bytes. */
static json_t *pre_tokenizer(const nl_tokenizer *t)
{
    if (nl_tokenizer_split_mode(t) == NL_TOKENIZER_SPLIT_UNICODE)
        return json_pack("{s:s,s:b,s:b,s:b}", "type", "ByteLevel", "add_prefix_space", 0,
                         "trim_offsets", 1, "use_regex", 1);
    return json_pack("{s:s,s:[{s:s,s:{s:s},s:s,s:b},{s:s,s:b,s:b,s:b}]}", "type", "Sequence",
                     "pretokenizers", "type", "Split", "pattern", "Regex", bytes_regex, "behavior",
                     "Isolated", "invert", 0, "type", "ByteLevel", "add_prefix_space", 0,
                     "trim_offsets", 1, "use_regex", 0);
}

/* The vocabulary (tokens by their byte-level spelling, specials by their
 * names), the merges ("A B") and the added tokens (the specials). A string two ids
 * share has no place in a vocabulary that maps each string to one id. */
static nl_status hf_tables(const nl_tokenizer *t, json_t *vocab, json_t *merges, json_t *added,
                           char *note, size_t note_cap, nl_error *err)
{
    for (int32_t id = 0; id < nl_tokenizer_vocab_size(t); id++) {
        const uint8_t *p;
        size_t n;
        nl_tokenizer_token_bytes(t, id, &p, &n);
        if (nl_tokenizer_is_special(t, id)) {
            if (json_array_append_new(added, json_pack("{s:i,s:s%,s:b,s:b,s:b,s:b,s:b}", "id", id,
                                                       "content", (const char *)p, n, "single_word",
                                                       0, "lstrip", 0, "rstrip", 0, "normalized", 0,
                                                       "special", 1)))
                FAIL(NL_ERR_NOMEM, "out of memory writing the vocabulary");
            continue;
        }
        char *s = token_string(t, id);
        if (!s)
            FAIL(NL_ERR_NOMEM, "out of memory writing the vocabulary");
        json_t *had = json_object_get(vocab, s);
        if (had) {
            nl_error_set(err, NL_ERR_UNSUPPORTED,
                         "tokenizer: ids %lld and %d are the same bytes ('%.60s' in GPT-2's "
                         "spelling); a Hugging Face vocabulary holds each string once",
                         (long long)json_integer_value(had), id, s);
            free(s);
            return NL_ERR_UNSUPPORTED;
        }
        int bad = json_object_set_new(vocab, s, json_integer(id));
        free(s);
        if (bad)
            FAIL(NL_ERR_NOMEM, "out of memory writing the vocabulary");
    }
    /* The specials go into the vocabulary too, under their names, or the
     * library gives them new ids past it (as GPT-2 has <|endoftext|>). A
     * special whose name is also a learned token's text cannot: there
     * transformers gives the name that token's id (said in the note, not
     * refused: the ids of encoding are unchanged). */
    size_t i, used = strlen(note);
    json_t *sp;
    json_array_foreach(added, i, sp)
    {
        const char *s = json_string_value(json_object_get(sp, "content"));
        json_t *clash = json_object_get(vocab, s);
        if (!clash && json_object_set(vocab, s, json_object_get(sp, "id")))
            FAIL(NL_ERR_NOMEM, "out of memory writing the vocabulary");
        if (clash && used + 200 < note_cap)
            used += (size_t)snprintf(
                note + used, note_cap - used,
                "%sspecial %s (id %lld) is also the text of token %lld, the id transformers "
                "gives the name",
                used ? "; " : "", s, (long long)json_integer_value(json_object_get(sp, "id")),
                (long long)json_integer_value(clash));
    }
    for (int32_t r = 0; r < nl_tokenizer_num_merges(t); r++) {
        int32_t a, b, c;
        nl_tokenizer_merge_at(t, r, &a, &b, &c);
        char *sa = token_string(t, a), *sb = token_string(t, b), *m = NULL;
        size_t need = sa && sb ? strlen(sa) + strlen(sb) + 2 : 0;
        if (need && (m = malloc(need)))
            snprintf(m, need, "%s %s", sa, sb);
        int bad = !m || json_array_append_new(merges, json_string(m));
        free(sa), free(sb), free(m);
        if (bad)
            FAIL(NL_ERR_NOMEM, "out of memory writing the merges");
    }
    return NL_OK;
}

/* tokenizer.json: the whole tokenizer as the `tokenizers` library reads it. */
static json_t *tokenizer_json(const nl_tokenizer *t, json_t *vocab, json_t *merges, json_t *added)
{
    json_t *model = json_pack("{s:s,s:n,s:n,s:n,s:n,s:b,s:b,s:O,s:O}", "type", "BPE", "dropout",
                              "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                              "fuse_unk", 0, "byte_fallback", 0, "vocab", vocab, "merges", merges);
    json_t *dec = json_pack("{s:s,s:b,s:b,s:b}", "type", "ByteLevel", "add_prefix_space", 1,
                            "trim_offsets", 1, "use_regex", 1);
    return json_pack("{s:s,s:n,s:n,s:O,s:n,s:o,s:n,s:o,s:o}", "version", "1.0", "truncation",
                     "padding", "added_tokens", added, "normalizer", "pre_tokenizer",
                     pre_tokenizer(t), "post_processor", "decoder", dec, "model", model);
}

static nl_status put(const char *dir, const char *name, const char *text, char **written,
                     int *n_written, nl_error *err)
{
    char *p = hf_join(dir, name);
    nl_status st = p ? nl_file_write_atomic(p, text, strlen(text), err)
                     : nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if (st == NL_OK)
        written[(*n_written)++] = p;
    else
        free(p);
    return st;
}

nl_status hf_tokenizer_write(const char *dir, const char *tok_text, const nl_config *cfg,
                             int *native, char **written, int *n_written, char *note,
                             size_t note_cap, nl_error *err)
{
    nl_tokenizer *t = NULL;
    json_t *vocab = json_object(), *merges = json_array(), *added = json_array(), *tj = NULL;
    json_t *tc = NULL;
    char *texts[4] = {NULL, NULL, NULL, NULL}, *mt = NULL;
    nl_status st = nl_tokenizer_load_buffer(&t, tok_text, strlen(tok_text), err);
    if (st) {
        nl_error_prefix(err, "the source's tokenizer");
        goto out;
    }
    *native = nl_tokenizer_is_native(t);
    if (!vocab || !merges || !added)
        goto nomem;
    if ((st = hf_tables(t, vocab, merges, added, note, note_cap, err)))
        goto out;
    size_t i, cap = 32, len = 0;
    json_t *m;
    json_array_foreach(merges, i, m) cap += json_string_length(m) + 1;
    if (!(mt = malloc(cap)))
        goto nomem;
    len = (size_t)snprintf(mt, cap, "#version: 0.2\n");
    json_array_foreach(merges, i, m) len +=
        (size_t)snprintf(mt + len, cap - len, "%s\n", json_string_value(m));
    if (!(tj = tokenizer_json(t, vocab, merges, added)) || !(tc = hf_tokenizer_config(t, cfg)) ||
        !(texts[0] = json_dumps(vocab, JSON_COMPACT | JSON_ENSURE_ASCII)) ||
        !(texts[1] = json_dumps(tj, JSON_INDENT(2) | JSON_ENSURE_ASCII)) ||
        !(texts[2] = json_dumps(tc, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_ENSURE_ASCII)))
        goto nomem;
    static const char *names[5] = {"vocab.json", "tokenizer.json", "tokenizer_config.json",
                                   "merges.txt", "neurollm-tokenizer.txt"};
    const char *bufs[5] = {texts[0], texts[1], texts[2], mt, tok_text};
    for (int k = 0; k < 5 && !st; k++)
        st = put(dir, names[k], bufs[k], written, n_written, err);
    goto out;
nomem:
    st = nl_error_set(err, NL_ERR_NOMEM, "out of memory writing the tokenizer");
out:
    nl_tokenizer_destroy(&t);
    json_decref(vocab);
    json_decref(merges);
    json_decref(added);
    json_decref(tj);
    json_decref(tc);
    for (int k = 0; k < 4; k++)
        free(texts[k]);
    free(mt);
    return st;
}

/* ------------------------------------------------------------- reading */

/* A vocabulary string in GPT-2's byte alphabet as bytes (*n of them, at
 * most NL_TOKENIZER_MAX_TOKEN_BYTES); 0 when a character is outside it. */
static int alphabet_bytes(const char *s, uint8_t *out, size_t *n)
{
    size_t len = strlen(s), i = 0;
    *n = 0;
    while (i < len) {
        unsigned cp;
        uint8_t c = (uint8_t)s[i];
        if (c < 0x80) {
            cp = c;
            i++;
        } else if ((c & 0xE0) == 0xC0 && i + 1 < len && ((uint8_t)s[i + 1] & 0xC0) == 0x80) {
            cp = (unsigned)(c & 0x1F) << 6 | ((uint8_t)s[i + 1] & 0x3F);
            i += 2;
        } else {
            return 0; /* the alphabet's code points are below U+0800 */
        }
        int b = cp_byte(cp);
        if (b < 0 || *n == NL_TOKENIZER_MAX_TOKEN_BYTES)
            return 0;
        out[(*n)++] = (uint8_t)b;
    }
    return *n > 0;
}

/* What an import reads: string -> id, merges, added tokens. */
typedef struct hf_tok_src {
    const char *label; /* the file, for messages */
    json_t *vocab;     /* object */
    json_t *merges;    /* array of "A B" or [A, B] */
    json_t *added;     /* array of {id, content} (may be NULL) */
    nl_tokenizer_split split;
} hf_tok_src;

/* A merge's two strings. */
static int merge_parts(json_t *m, char *a, char *b, size_t cap)
{
    const char *s = json_string_value(m), *sp;
    if (s && (sp = strchr(s, ' ')) && !strchr(sp + 1, ' ') && sp > s && sp[1] &&
        (size_t)(sp - s) < cap && strlen(sp + 1) < cap) {
        snprintf(a, cap, "%.*s", (int)(sp - s), s);
        snprintf(b, cap, "%s", sp + 1);
        return 1;
    }
    if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
        json_is_string(json_array_get(m, 1)) && json_string_length(json_array_get(m, 0)) < cap &&
        json_string_length(json_array_get(m, 1)) < cap) {
        snprintf(a, cap, "%s", json_string_value(json_array_get(m, 0)));
        snprintf(b, cap, "%s", json_string_value(json_array_get(m, 1)));
        return 1;
    }
    return 0;
}

/* The id of vocabulary string s, or -1. */
static int64_t vocab_id(json_t *vocab, const char *s)
{
    json_t *v = json_object_get(vocab, s);
    return json_is_integer(v) ? (int64_t)json_integer_value(v) : -1;
}

/* Our tokenizer from src, ids 0..vocab_size-1: the vocabulary's and the
 * added tokens' where they are, "<|unused_ID|>" specials between and
 * after them (transformers' padded rows), then the merges. */
static nl_status build(const hf_tok_src *src, int64_t vocab_size, nl_tokenizer **out, nl_error *err)
{
    int64_t n = vocab_size;
    const char **strs = calloc((size_t)n, sizeof *strs); /* vocab string per id */
    const char **adds = calloc((size_t)n, sizeof *adds); /* added content per id */
    size_t *add_len = calloc((size_t)n, sizeof *add_len);
    nl_tokenizer *t = NULL;
    nl_status st = NL_OK;
    const char *key;
    json_t *v;
    size_t i;
    if (!strs || !adds || !add_len) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory reading the tokenizer");
        goto out;
    }
    json_object_foreach(src->vocab, key, v)
    {
        int64_t id = json_is_integer(v) ? (int64_t)json_integer_value(v) : -1;
        if (id < 0 || id >= n || strs[id]) {
            st = nl_error_set(err, NL_ERR_FORMAT,
                              "%s: vocab['%.60s']: %s (the model's vocab_size is %lld)", src->label,
                              key,
                              id < 0    ? "not an id"
                              : id >= n ? "an id past the model's rows"
                                        : "an id another string has",
                              (long long)n);
            goto out;
        }
        strs[id] = key;
    }
    json_array_foreach(src->added, i, v)
    {
        json_t *jid = json_object_get(v, "id"), *c = json_object_get(v, "content");
        int64_t id = json_is_integer(jid) ? (int64_t)json_integer_value(jid) : -1;
        if (id < 0 || id >= n || !json_is_string(c) || adds[id]) {
            st = nl_error_set(err, NL_ERR_FORMAT,
                              "%s: added_tokens[%zu]: %s (the model's vocab_size is %lld)",
                              src->label, i,
                              !json_is_string(c) ? "no content"
                              : id < 0           ? "no id"
                              : id >= n          ? "an id past the model's rows"
                                                 : "an id added twice",
                              (long long)n);
            goto out;
        }
        adds[id] = json_string_value(c);
        add_len[id] = json_string_length(c);
    }
    if ((st = nl_tokenizer_new_empty(&t, src->split, err)))
        goto out;
    for (int64_t id = 0; id < n && !st; id++) {
        uint8_t b[NL_TOKENIZER_MAX_TOKEN_BYTES];
        size_t bl;
        char unused[32];
        if (adds[id] && add_len[id] >= 1 && add_len[id] <= NL_TOKENIZER_MAX_TOKEN_BYTES) {
            st = nl_tokenizer_append_token(t, adds[id], add_len[id], 1, err);
        } else if (adds[id]) {
            st = nl_error_set(err, NL_ERR_UNSUPPORTED, "%s: added token %lld: %zu bytes (1..%d)",
                              src->label, (long long)id, add_len[id], NL_TOKENIZER_MAX_TOKEN_BYTES);
        } else if (strs[id] && alphabet_bytes(strs[id], b, &bl)) {
            st = nl_tokenizer_append_token(t, b, bl, 0, err);
        } else if (strs[id]) {
            st = nl_error_set(err, NL_ERR_UNSUPPORTED,
                              "%s: vocab['%.60s'] (id %lld) is not in GPT-2's byte alphabet, or is "
                              "longer than %d bytes: not a byte-level vocabulary",
                              src->label, strs[id], (long long)id, NL_TOKENIZER_MAX_TOKEN_BYTES);
        } else {
            snprintf(unused, sizeof unused, "<|unused_%lld|>", (long long)id);
            st = nl_tokenizer_append_token(t, unused, strlen(unused), 1, err);
        }
    }
    for (int b = 0; b < 256 && !st; b++)
        if (nl_tokenizer_byte_id(t, (uint8_t)b) < 0)
            st = nl_error_set(err, NL_ERR_UNSUPPORTED,
                              "%s: byte 0x%02x has no token: not a byte-level vocabulary",
                              src->label, b);
    json_array_foreach(src->merges, i, v)
    {
        char a[1200], b[1200], ab[2400];
        if (st)
            break;
        if (!merge_parts(v, a, b, sizeof a)) {
            st = nl_error_set(err, NL_ERR_FORMAT, "%s: merges[%zu]: not \"A B\" or [A, B]",
                              src->label, i);
            break;
        }
        snprintf(ab, sizeof ab, "%s%s", a, b);
        int64_t ia = vocab_id(src->vocab, a), ib = vocab_id(src->vocab, b),
                ic = vocab_id(src->vocab, ab);
        if (ia < 0 || ib < 0 || ic < 0)
            st = nl_error_set(err, NL_ERR_FORMAT,
                              "%s: merges[%zu] '%.40s %.40s': '%.80s' is not "
                              "in the vocabulary",
                              src->label, i, a, b,
                              ia < 0   ? a
                              : ib < 0 ? b
                                       : ab);
        else if ((st = nl_tokenizer_append_merge(t, (int32_t)ia, (int32_t)ib, (int32_t)ic, err)))
            nl_error_prefix(err, "%s: merges[%zu]", src->label, i);
    }
out:
    free(strs);
    free(adds);
    free(add_len);
    if (st)
        nl_tokenizer_destroy(&t);
    *out = t;
    return st;
}

/* The type of a tokenizer.json part ("none" when null or absent). */
static const char *part_type(json_t *root, const char *key)
{
    json_t *p = json_object_get(root, key);
    const char *s = json_string_value(json_object_get(p, "type"));
    return !p || json_is_null(p) ? "none" : s ? s : "?";
}

static int flag(json_t *o, const char *key, int def)
{
    json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : def;
}

/* The pre-tokenizer: ByteLevel with its GPT-2 regex (Unicode classes), or
 * our byte classes as a Split (what an export of such a tokenizer writes).
 * 0: neither. */
static int read_split(json_t *pre, nl_tokenizer_split *split)
{
    const char *type = json_string_value(json_object_get(pre, "type"));
    if (type && !strcmp(type, "ByteLevel") && flag(pre, "use_regex", 1) &&
        !flag(pre, "add_prefix_space", 1)) {
        *split = NL_TOKENIZER_SPLIT_UNICODE;
        return 1;
    }
    json_t *seq = json_object_get(pre, "pretokenizers"), *s0, *s1;
    if (!type || strcmp(type, "Sequence") || json_array_size(seq) != 2)
        return 0;
    s0 = json_array_get(seq, 0);
    s1 = json_array_get(seq, 1);
    const char *re = json_string_value(json_object_get(json_object_get(s0, "pattern"), "Regex"));
    const char *beh = json_string_value(json_object_get(s0, "behavior"));
    const char *t0 = json_string_value(json_object_get(s0, "type"));
    const char *t1 = json_string_value(json_object_get(s1, "type"));
    if (re && !strcmp(re, bytes_regex) && beh && !strcmp(beh, "Isolated") &&
        !flag(s0, "invert", 0) && t0 && !strcmp(t0, "Split") && t1 && !strcmp(t1, "ByteLevel") &&
        !flag(s1, "use_regex", 1) && !flag(s1, "add_prefix_space", 1)) {
        *split = NL_TOKENIZER_SPLIT_BYTES;
        return 1;
    }
    return 0;
}

/* What of tokenizer.json our tokenizer cannot be: a message into why
 * (naming what was found), 0 when it can. */
static int unrepresentable(json_t *root, nl_tokenizer_split *split, char *why, size_t cap)
{
    json_t *model = json_object_get(root, "model");
    const char *mt = part_type(root, "model");
    json_t *pre = json_object_get(root, "pre_tokenizer");
    const char *cw = json_string_value(json_object_get(model, "continuing_subword_prefix"));
    const char *eow = json_string_value(json_object_get(model, "end_of_word_suffix"));
    json_t *drop = json_object_get(model, "dropout");
    if (strcmp(mt, "BPE") != 0)
        snprintf(why, cap,
                 "model %s (a SentencePiece Unigram, WordPiece or word-level model), "
                 "not byte-level BPE",
                 mt);
    else if (flag(model, "byte_fallback", 0))
        snprintf(why, cap,
                 "BPE with byte_fallback (SentencePiece's, as Llama 2, Mistral and "
                 "Mixtral have), not byte-level BPE");
    else if (strcmp(part_type(root, "normalizer"), "none") != 0)
        snprintf(why, cap, "normalizer %s", part_type(root, "normalizer"));
    else if (!read_split(pre, split))
        snprintf(why, cap,
                 "pre_tokenizer %s other than GPT-2's ByteLevel (with its regex, "
                 "add_prefix_space false)",
                 part_type(root, "pre_tokenizer"));
    else if (strcmp(part_type(root, "decoder"), "none") != 0 &&
             strcmp(part_type(root, "decoder"), "ByteLevel") != 0)
        snprintf(why, cap, "decoder %s", part_type(root, "decoder"));
    else if ((cw && *cw) || (eow && *eow))
        snprintf(why, cap, "a subword prefix or suffix");
    else if (drop && !json_is_null(drop) && json_number_value(drop) != 0.0)
        snprintf(why, cap, "BPE dropout");
    else if (flag(model, "ignore_merges", 0))
        snprintf(why, cap, "ignore_merges");
    else
        return 0;
    return 1;
}

/* Load dir/name as JSON (NULL root with NL_OK: the file is absent). */
static nl_status load_json(const char *dir, const char *name, char **path, json_t **root,
                           nl_error *err)
{
    struct stat sb;
    char *text = NULL;
    size_t len;
    json_error_t je;
    *root = NULL;
    if (!(*path = hf_join(dir, name)))
        FAIL(NL_ERR_NOMEM, "out of memory");
    if (stat(*path, &sb) != 0)
        return NL_OK;
    nl_status st = nl_file_read_all(*path, NL_HF_MAX_JSON, &text, &len, err);
    if (st)
        return st;
    *root = json_loadb(text, len, 0, &je);
    free(text);
    if (!*root || !json_is_object(*root))
        FAIL(NL_ERR_FORMAT, "%s: not a JSON object (line %d: %s)", *path, je.line,
             *root ? "top level" : je.text);
    return NL_OK;
}

/* merges.txt's lines (after "#version"), as a JSON array of "A B". */
static nl_status read_merges_txt(const char *path, json_t **out, nl_error *err)
{
    char *text = NULL;
    size_t len;
    nl_status st = nl_file_read_all(path, NL_HF_MAX_JSON, &text, &len, err);
    if (st)
        return st;
    json_t *arr = json_array();
    size_t line = 0;
    for (char *p = text, *e; arr && p < text + len; p = e + 1) {
        e = memchr(p, '\n', (size_t)(text + len - p));
        if (!e)
            e = text + len;
        *e = '\0';
        if (e > p && e[-1] == '\r')
            e[-1] = '\0';
        if ((line++ == 0 && !strncmp(p, "#version", 8)) || !*p)
            continue;
        json_array_append_new(arr, json_string(p));
    }
    free(text);
    if (!arr)
        FAIL(NL_ERR_NOMEM, "out of memory");
    *out = arr;
    return NL_OK;
}

/* src into our file's text, and the note saying what it was. */
static nl_status finish(const hf_tok_src *src, int64_t vocab_size, const char *what,
                        char **tok_text, char *note, size_t note_cap, nl_error *err)
{
    nl_tokenizer *t = NULL;
    size_t len;
    nl_status st;
    if (!json_is_object(src->vocab) || !json_is_array(src->merges) ||
        (src->added && !json_is_array(src->added)))
        FAIL(NL_ERR_FORMAT, "%s: %s", src->label,
             !json_is_object(src->vocab)   ? "model.vocab: not an object"
             : !json_is_array(src->merges) ? "model.merges: not a list"
                                           : "added_tokens: not a list");
    if ((st = build(src, vocab_size, &t, err)))
        return st;
    nl_tokenizer_settle(t);
    if (!(st = nl_tokenizer_save_buffer(t, tok_text, &len, err)))
        snprintf(note, note_cap, "%s: byte-level BPE, %d ids, %d merges, %s classes%s", what,
                 nl_tokenizer_vocab_size(t), nl_tokenizer_num_merges(t),
                 src->split == NL_TOKENIZER_SPLIT_UNICODE ? "Unicode" : "byte",
                 nl_tokenizer_is_native(t) ? " (our own id layout)" : "");
    nl_tokenizer_destroy(&t);
    return st;
}

nl_status nl_hf_tokenizer_parse(const char *json, size_t len, const char *label, int64_t vocab_size,
                                char **tok_text, char *note, size_t note_cap, nl_error *err)
{
    json_error_t je;
    char why[400];
    hf_tok_src src = {.label = label, .split = NL_TOKENIZER_SPLIT_UNICODE};
    *tok_text = NULL;
    note[0] = '\0';
    if (vocab_size < 1 || vocab_size > NL_TOKENIZER_MAX_IDS)
        FAIL(NL_ERR_RANGE, "%s: a model of %lld rows", label, (long long)vocab_size);
    json_t *root = json_loadb(json, len, 0, &je);
    nl_status st = NL_OK;
    if (!root || !json_is_object(root)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: not a JSON object (line %d: %s)", label, je.line,
                          root ? "top level" : je.text);
    } else if (unrepresentable(root, &src.split, why, sizeof why)) {
        snprintf(note, note_cap,
                 "tokenizer.json: %s: our byte-level BPE cannot represent it; imported without a "
                 "tokenizer (give token ids)",
                 why);
    } else {
        json_t *model = json_object_get(root, "model");
        src.vocab = json_object_get(model, "vocab");
        src.merges = json_object_get(model, "merges");
        src.added = json_object_get(root, "added_tokens");
        st = finish(&src, vocab_size, "tokenizer.json", tok_text, note, note_cap, err);
    }
    json_decref(root);
    return st;
}

nl_status hf_tokenizer_read(const char *dir, int64_t vocab_size, char **tok_text, char *note,
                            size_t note_cap, nl_error *err)
{
    char *tpath = hf_join(dir, "tokenizer.json"), *vpath = NULL, *mpath = NULL, *text = NULL;
    json_t *vroot = NULL, *merges = NULL;
    size_t len;
    struct stat sb;
    nl_status st = NL_OK;
    *tok_text = NULL;
    note[0] = '\0';
    if (!tpath) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    } else if (stat(tpath, &sb) == 0) {
        if (!(st = nl_file_read_all(tpath, NL_HF_MAX_JSON, &text, &len, err)))
            st = nl_hf_tokenizer_parse(text, len, tpath, vocab_size, tok_text, note, note_cap, err);
    } else if (!(st = load_json(dir, "vocab.json", &vpath, &vroot, err))) {
        if (!(mpath = hf_join(dir, "merges.txt"))) {
            st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        } else if (!vroot || stat(mpath, &sb) != 0) {
            snprintf(note, note_cap,
                     "neither tokenizer.json nor vocab.json and merges.txt: imported without a "
                     "tokenizer (give token ids)");
        } else if (!(st = read_merges_txt(mpath, &merges, err))) {
            hf_tok_src src = {vpath, vroot, merges, NULL, NL_TOKENIZER_SPLIT_UNICODE};
            st = finish(&src, vocab_size, "vocab.json and merges.txt", tok_text, note, note_cap,
                        err);
        }
    }
    json_decref(vroot);
    json_decref(merges);
    free(text);
    free(tpath);
    free(vpath);
    free(mpath);
    return st;
}
