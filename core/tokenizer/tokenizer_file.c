/* The tokenizer file: printable ASCII text, so that a checkpoint can carry
 * it as a metadata string.
 *
 *     neurollm-bpe 2\n
 *     split unicode\n  (or bytes: the pre-tokenizer's classes)
 *     merges N\n
 *     A B\n            N lines: merge rank r defines id 259 + r
 *
 * Version 1 has no split line and means split bytes (the classes every
 * tokenizer had before version 2); a tokenizer that splits by bytes is
 * still written as version 1, so such files round trip unchanged.
 *
 * A tokenizer imported with another library's ids (tokenizer.h,
 * nl_tokenizer_is_native) lists them instead of the merges alone:
 *
 *     neurollm-bpe 2\n
 *     split unicode\n
 *     ids N\n
 *     merges M\n
 *     HEX\n or * HEX\n  N lines: id i's bytes in lowercase hex (* special)
 *     A B C\n          M lines: merge rank r, (A, B) makes C
 * Numbers are decimal without sign or leading zeros, fields are separated
 * by exactly one space, every line ends with '\n' and nothing follows the
 * last merge. The reader accepts exactly what the writer produces, so
 * save(load(x)) == x for every file that loads. docs/tokenizer.md is the
 * full description. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/fileio.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_impl.h"

#define MAGIC "neurollm-bpe"
#define VERSION 2 /* the newest this reads; 1 is read too */

/* ---- writing ---- */

static char *put_u32(char *p, uint32_t v)
{
    char tmp[16];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *p++ = tmp[--n];
    return p;
}

/* The explicit form: every id's bytes, then merges with their results. */
static nl_status save_explicit(const nl_tokenizer *t, char **out, size_t *len, nl_error *err)
{
    size_t need = 96 + (size_t)t->n_merges * 33;
    for (int32_t id = 0; id < t->n_ids; id++)
        need += 2 * (size_t)t->tok_len[id] + 3;
    char *buf = malloc(need), *p = buf;
    static const char hex[] = "0123456789abcdef";
    if (!buf)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory saving %d ids", t->n_ids);
    p +=
        snprintf(buf, 96, "%s 2\nsplit %s\nids %d\nmerges %d\n", MAGIC,
                 t->split == NL_TOKENIZER_SPLIT_BYTES ? "bytes" : "unicode", t->n_ids, t->n_merges);
    for (int32_t id = 0; id < t->n_ids; id++) {
        if (t->special[id]) {
            *p++ = '*';
            *p++ = ' ';
        }
        for (size_t i = 0; i < t->tok_len[id]; i++) {
            uint8_t c = t->pool[t->tok_off[id] + i];
            *p++ = hex[c >> 4];
            *p++ = hex[c & 15];
        }
        *p++ = '\n';
    }
    for (int32_t r = 0; r < t->n_merges; r++) {
        p = put_u32(p, (uint32_t)t->merges[2 * (size_t)r]);
        *p++ = ' ';
        p = put_u32(p, (uint32_t)t->merges[2 * (size_t)r + 1]);
        *p++ = ' ';
        p = put_u32(p, (uint32_t)t->merge_out[r]);
        *p++ = '\n';
    }
    *p = '\0';
    *out = buf;
    *len = (size_t)(p - buf);
    return NL_OK;
}

nl_status nl_tokenizer_save_buffer(const nl_tokenizer *t, char **out, size_t *len, nl_error *err)
{
    *out = NULL;
    *len = 0;
    if (t->explicit_ids)
        return save_explicit(t, out, len, err);
    size_t nm = (size_t)nl_tokenizer_num_merges(t);
    /* two ids of at most 10 digits, a space and a newline per merge */
    char *buf = malloc(64 + nm * 22);
    if (!buf)
        return nl_error_set(err, NL_ERR_NOMEM, "tokenizer: out of memory saving %zu merges", nm);
    char *p = buf;
    if (t->split == NL_TOKENIZER_SPLIT_BYTES)
        p += snprintf(buf, 64, "%s 1\nmerges %zu\n", MAGIC, nm);
    else
        p += snprintf(buf, 64, "%s 2\nsplit unicode\nmerges %zu\n", MAGIC, nm);
    for (size_t r = 0; r < nm; r++) {
        p = put_u32(p, (uint32_t)t->merges[2 * r]);
        *p++ = ' ';
        p = put_u32(p, (uint32_t)t->merges[2 * r + 1]);
        *p++ = '\n';
    }
    *p = '\0';
    *out = buf;
    *len = (size_t)(p - buf);
    return NL_OK;
}

nl_status nl_tokenizer_save(const nl_tokenizer *t, const char *path, nl_error *err)
{
    char *buf = NULL;
    size_t len = 0;
    nl_status st = nl_tokenizer_save_buffer(t, &buf, &len, err);
    if (st == NL_OK)
        st = nl_file_write_atomic(path, buf, len, err);
    free(buf);
    return st;
}

/* ---- reading ---- */

typedef struct parser {
    const uint8_t *s;
    size_t len, pos, line;
    nl_error *err;
} parser;

/* Fail with "line L, offset O: message". */
__attribute__((format(printf, 3, 4))) static nl_status fail(const parser *ps, nl_status st,
                                                            const char *fmt, ...)
{
    char msg[NL_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return nl_error_set(ps->err, st, "tokenizer line %zu, offset %zu: %s", ps->line, ps->pos, msg);
}

/* What is at the cursor, for messages: "end of file (truncated)",
 * "'x'" or "byte 0x0a". */
static const char *found(const parser *ps, char *buf, size_t cap)
{
    if (ps->pos >= ps->len)
        return "end of file (truncated)";
    uint8_t c = ps->s[ps->pos];
    if (c == '\n')
        snprintf(buf, cap, "end of line");
    else if (c >= 0x21 && c <= 0x7E)
        snprintf(buf, cap, "'%c'", c);
    else
        snprintf(buf, cap, "byte 0x%02x", c);
    return buf;
}

static nl_status expect_byte(parser *ps, uint8_t c, const char *what)
{
    char fb[32];
    if (ps->pos >= ps->len || ps->s[ps->pos] != c)
        return fail(ps, NL_ERR_FORMAT, "expected %s, found %s", what, found(ps, fb, sizeof fb));
    ps->pos++;
    if (c == '\n')
        ps->line++;
    return NL_OK;
}

static int is_digit(uint8_t c)
{
    return c >= '0' && c <= '9';
}

/* A decimal number in [0, max]. */
static nl_status parse_num(parser *ps, int64_t max, const char *what, int64_t *out)
{
    char fb[32];
    if (ps->pos >= ps->len || !is_digit(ps->s[ps->pos]))
        return fail(ps, NL_ERR_FORMAT, "expected %s (a decimal number), found %s", what,
                    found(ps, fb, sizeof fb));
    size_t start = ps->pos;
    if (ps->s[start] == '0' && start + 1 < ps->len && is_digit(ps->s[start + 1]))
        return fail(ps, NL_ERR_FORMAT, "%s has a leading zero", what);
    int64_t v = 0;
    while (ps->pos < ps->len && is_digit(ps->s[ps->pos])) {
        if (v <= max)
            v = v * 10 + (ps->s[ps->pos] - '0');
        ps->pos++;
    }
    if (v > max) {
        size_t n = ps->pos - start;
        ps->pos = start;
        return fail(ps, NL_ERR_RANGE, "%s %.*s%s is out of range (at most %lld)", what,
                    (int)(n > 24 ? 24 : n), (const char *)ps->s + start, n > 24 ? "..." : "",
                    (long long)max);
    }
    *out = v;
    return NL_OK;
}

/* Version 2's "split unicode" or "split bytes" line. */
static nl_status parse_split(parser *ps, nl_tokenizer_split *split)
{
    static const char *const names[2] = {"unicode", "bytes"};
    nl_status st;
    const char *kw = "split ";
    for (size_t i = 0; kw[i]; i++)
        if ((st = expect_byte(ps, (uint8_t)kw[i], "'split unicode' or 'split bytes'")) != NL_OK)
            return st;
    for (int m = 0; m < 2; m++) {
        size_t n = strlen(names[m]), have = ps->len - ps->pos;
        if (have <= n && memcmp(ps->s + ps->pos, names[m], have) == 0)
            ps->pos = ps->len; /* cut inside the word: "end of file (truncated)" */
        if (ps->len - ps->pos > n && memcmp(ps->s + ps->pos, names[m], n) == 0 &&
            ps->s[ps->pos + n] == '\n') {
            ps->pos += n;
            *split = m == 0 ? NL_TOKENIZER_SPLIT_UNICODE : NL_TOKENIZER_SPLIT_BYTES;
            return expect_byte(ps, '\n', "end of line after the split");
        }
    }
    char fb[32];
    return fail(ps, NL_ERR_FORMAT, "expected unicode or bytes after 'split', found %s",
                found(ps, fb, sizeof fb));
}

static nl_status parse_header(parser *ps, int64_t *count, nl_tokenizer_split *split)
{
    size_t ml = strlen(MAGIC);
    size_t have = ps->len < ml ? ps->len : ml;
    int64_t version = 0;
    nl_status st;
    if (ps->len == 0)
        return fail(ps, NL_ERR_FORMAT, "empty file (expected '%s N')", MAGIC);
    if (memcmp(ps->s, MAGIC, have) != 0)
        return fail(ps, NL_ERR_FORMAT, "bad magic: not a tokenizer file (expected '%s N')", MAGIC);
    if (have < ml) {
        ps->pos = have;
        return fail(ps, NL_ERR_FORMAT, "file ends inside the magic '%s' (truncated)", MAGIC);
    }
    ps->pos = ml;
    if ((st = expect_byte(ps, ' ', "a space after the magic")) != NL_OK)
        return st;
    size_t vpos = ps->pos;
    if ((st = parse_num(ps, INT32_MAX, "version", &version)) != NL_OK)
        return st;
    if (version < 1 || version > VERSION) {
        ps->pos = vpos;
        return fail(ps, NL_ERR_VERSION, "version %lld is not supported (this build reads 1 and %d)",
                    (long long)version, VERSION);
    }
    if ((st = expect_byte(ps, '\n', "end of line after the version")) != NL_OK)
        return st;
    *split = NL_TOKENIZER_SPLIT_BYTES;
    if (version >= 2 && (st = parse_split(ps, split)) != NL_OK)
        return st;
    if (version >= 2 && ps->len - ps->pos >= 4 && memcmp(ps->s + ps->pos, "ids ", 4) == 0) {
        *count = -1;
        return NL_OK;
    }
    const char *kw = "merges ";
    for (size_t i = 0; kw[i]; i++)
        if ((st = expect_byte(ps, (uint8_t)kw[i], "'merges COUNT'")) != NL_OK)
            return st;
    if ((st = parse_num(ps, NL_TOKENIZER_MAX_IDS - NL_TOKEN_FIRST_MERGE, "merge count", count)) !=
        NL_OK)
        return st;
    return expect_byte(ps, '\n', "end of line after the merge count");
}

/* Check that merge (a, b) may define the next id. */
static nl_status check_merge(const parser *ps, const nl_tokenizer *t, int64_t a, int64_t b)
{
    int32_t id = t->n_ids;
    int64_t ab[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        if (ab[k] >= id)
            return fail(ps, NL_ERR_RANGE,
                        "merge for id %d refers to unknown id %lld (only 0..%d are defined "
                        "before it)",
                        id, (long long)ab[k], id - 1);
        if (nl_tokenizer_is_special(t, (int32_t)ab[k]))
            return fail(ps, NL_ERR_FORMAT, "merge for id %d uses special id %lld", id,
                        (long long)ab[k]);
    }
    int32_t r = nl_tok_merge_rank(t, (int32_t)a, (int32_t)b);
    if (r >= 0)
        return fail(ps, NL_ERR_FORMAT, "duplicate merge %lld %lld (already id %d, line %d)",
                    (long long)a, (long long)b, NL_TOKEN_FIRST_MERGE + r, r + 3);
    size_t n = (size_t)t->tok_len[a] + t->tok_len[b];
    if (n > NL_TOKENIZER_MAX_TOKEN_BYTES)
        return fail(ps, NL_ERR_LIMIT, "merge for id %d would be %zu bytes long (limit %d)", id, n,
                    NL_TOKENIZER_MAX_TOKEN_BYTES);
    return NL_OK;
}

static nl_status parse_merges(parser *ps, nl_tokenizer *t, int64_t count)
{
    nl_status st = NL_OK;
    for (int64_t r = 0; r < count; r++) {
        int64_t a = 0, b = 0;
        size_t start = ps->pos;
        if (ps->pos >= ps->len)
            return fail(ps, NL_ERR_FORMAT, "file ends after %lld of %lld merges (truncated)",
                        (long long)r, (long long)count);
        if ((st = parse_num(ps, NL_TOKENIZER_MAX_IDS - 1, "first id", &a)) != NL_OK ||
            (st = expect_byte(ps, ' ', "one space between the ids")) != NL_OK ||
            (st = parse_num(ps, NL_TOKENIZER_MAX_IDS - 1, "second id", &b)) != NL_OK)
            return st;
        if ((st = expect_byte(ps, '\n', "end of line after the second id")) != NL_OK)
            return st;
        /* the whole line is there: now check what it means, naming the
         * line and the offset where it starts */
        size_t end = ps->pos;
        ps->pos = start;
        ps->line--;
        if ((st = check_merge(ps, t, a, b)) != NL_OK)
            return st;
        ps->pos = end;
        ps->line++;
        if ((st = nl_tok_add_merge(t, (int32_t)a, (int32_t)b, ps->err)) != NL_OK)
            return st;
    }
    if (ps->pos != ps->len) {
        char fb[32];
        return fail(ps, NL_ERR_FORMAT, "trailing data after the last merge (found %s)",
                    found(ps, fb, sizeof fb));
    }
    return NL_OK;
}

/* One token line of the explicit form: hex bytes, "* " first for a
 * special one. */
static nl_status parse_token(parser *ps, nl_tokenizer *t)
{
    uint8_t bytes[NL_TOKENIZER_MAX_TOKEN_BYTES];
    size_t n = 0;
    int special = 0;
    char fb[32];
    nl_status st;
    if (ps->pos >= ps->len)
        return fail(ps, NL_ERR_FORMAT, "file ends after %d ids (truncated)", t->n_ids);
    if (ps->s[ps->pos] == '*') {
        ps->pos++;
        special = 1;
        if ((st = expect_byte(ps, ' ', "a space after '*'")) != NL_OK)
            return st;
    }
    for (;;) {
        int v[2];
        for (int k = 0; k < 2; k++) {
            uint8_t c = ps->pos < ps->len ? ps->s[ps->pos] : 0;
            v[k] = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
            if (v[k] < 0 && (k == 1 || n == 0 || c != '\n'))
                return fail(ps, NL_ERR_FORMAT, "id %d: expected %s, found %s", t->n_ids,
                            k ? "a second hex digit" : "a lowercase hex digit",
                            found(ps, fb, sizeof fb));
            if (v[k] < 0)
                break;
            ps->pos++;
        }
        if (v[0] < 0)
            break;
        if (n == NL_TOKENIZER_MAX_TOKEN_BYTES)
            return fail(ps, NL_ERR_LIMIT, "id %d is longer than %d bytes", t->n_ids,
                        NL_TOKENIZER_MAX_TOKEN_BYTES);
        bytes[n++] = (uint8_t)(v[0] << 4 | v[1]);
    }
    if (!special && n == 1 && t->byte_id[bytes[0]] >= 0)
        return fail(ps, NL_ERR_FORMAT, "id %d: byte 0x%02x is already id %d", t->n_ids, bytes[0],
                    t->byte_id[bytes[0]]);
    if ((st = expect_byte(ps, '\n', "end of line after the token")) != NL_OK)
        return st;
    return nl_tok_add_token(t, bytes, n, special, ps->err);
}

/* One merge line of the explicit form: A B C, C's bytes A's then B's. */
static nl_status parse_merge_to(parser *ps, nl_tokenizer *t)
{
    int64_t v[3];
    nl_status st;
    size_t start = ps->pos;
    static const char *const what[3] = {"first id", "second id", "result id"};
    if (ps->pos >= ps->len)
        return fail(ps, NL_ERR_FORMAT, "file ends after %d merges (truncated)", t->n_merges);
    for (int k = 0; k < 3; k++)
        if ((st = parse_num(ps, t->n_ids - 1, what[k], &v[k])) != NL_OK ||
            (st = expect_byte(ps, k < 2 ? ' ' : '\n', k < 2 ? "one space" : "end of line")) !=
                NL_OK)
            return st;
    size_t end = ps->pos;
    ps->pos = start;
    ps->line--;
    int32_t a = (int32_t)v[0], b = (int32_t)v[1], c = (int32_t)v[2];
    size_t la = t->tok_len[a], lb = t->tok_len[b];
    if (t->special[a] || t->special[b] || t->special[c])
        return fail(ps, NL_ERR_FORMAT, "merge %d uses a special id", t->n_merges);
    if (nl_tok_merge_rank(t, a, b) >= 0)
        return fail(ps, NL_ERR_FORMAT, "duplicate merge %d %d", a, b);
    if (t->tok_len[c] != la + lb || memcmp(t->pool + t->tok_off[c], t->pool + t->tok_off[a], la) ||
        memcmp(t->pool + t->tok_off[c] + la, t->pool + t->tok_off[b], lb))
        return fail(ps, NL_ERR_FORMAT, "merge %d: id %d's bytes are not id %d's then id %d's",
                    t->n_merges, c, a, b);
    ps->pos = end;
    ps->line++;
    return nl_tok_add_merge_to(t, a, b, c, ps->err);
}

/* The explicit form after its split line. */
static nl_status parse_explicit(parser *ps, nl_tokenizer *t)
{
    int64_t n_ids = 0, n_merges = 0;
    nl_status st;
    const char *kw[2] = {"ids ", "merges "};
    int64_t *v[2] = {&n_ids, &n_merges};
    for (int k = 0; k < 2; k++) {
        for (size_t i = 0; kw[k][i]; i++)
            if ((st = expect_byte(ps, (uint8_t)kw[k][i], k ? "'merges COUNT'" : "'ids COUNT'")) !=
                NL_OK)
                return st;
        if ((st = parse_num(ps, k ? INT32_MAX / 2 : NL_TOKENIZER_MAX_IDS,
                            k ? "merge count" : "id count", v[k])) != NL_OK ||
            (st = expect_byte(ps, '\n', "end of line after the count")) != NL_OK)
            return st;
    }
    for (int64_t i = 0; i < n_ids; i++)
        if ((st = parse_token(ps, t)) != NL_OK)
            return st;
    for (int b = 0; b < 256; b++)
        if (t->byte_id[b] < 0)
            return fail(ps, NL_ERR_FORMAT, "byte 0x%02x has no id", b);
    for (int64_t r = 0; r < n_merges; r++)
        if ((st = parse_merge_to(ps, t)) != NL_OK)
            return st;
    if (ps->pos != ps->len) {
        char fb[32];
        return fail(ps, NL_ERR_FORMAT, "trailing data after the last merge (found %s)",
                    found(ps, fb, sizeof fb));
    }
    return NL_OK;
}

nl_status nl_tokenizer_load_buffer(nl_tokenizer **out, const void *buf, size_t len, nl_error *err)
{
    *out = NULL;
    nl_tokenizer *t = NULL;
    parser ps = {.s = buf, .len = len, .pos = 0, .line = 1, .err = err};
    int64_t count = 0;
    nl_tokenizer_split split = NL_TOKENIZER_SPLIT_BYTES;
    nl_status st = parse_header(&ps, &count, &split);
    if (st != NL_OK)
        return st;
    if (count < 0) { /* "ids N" follows: the explicit form */
        if ((st = nl_tok_new_empty(&t, err)) != NL_OK)
            return st;
        t->split = split;
        if ((st = parse_explicit(&ps, t)) != NL_OK) {
            nl_tokenizer_destroy(&t);
            return st;
        }
        *out = t;
        return NL_OK;
    }
    if ((st = nl_tokenizer_new_bytes(&t, err)) != NL_OK)
        return st;
    t->split = split;
    if ((st = parse_merges(&ps, t, count)) != NL_OK) {
        nl_tokenizer_destroy(&t);
        return st;
    }
    *out = t;
    return NL_OK;
}

nl_status nl_tokenizer_load(nl_tokenizer **out, const char *path, nl_error *err)
{
    char *buf = NULL;
    size_t len = 0;
    *out = NULL;
    nl_status st = nl_file_read_all(path, NL_TOKENIZER_MAX_FILE_BYTES, &buf, &len, err);
    if (st != NL_OK)
        return st;
    st = nl_tokenizer_load_buffer(out, buf, len, err);
    if (st != NL_OK)
        nl_error_prefix(err, "%s", path);
    free(buf);
    return st;
}
