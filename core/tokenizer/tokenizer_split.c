/* The tokenizer's pre-tokenizer (core/tokenizer/tokenizer.h, "pre-tokenization"):
 * GPT-2's rule
 *
 *     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *
 * evaluated by hand (no regex engine) over one of two class tables:
 * Unicode's (letters, numbers and white space of the code points, from
 * libutf8proc; what Hugging Face's ByteLevel pre-tokenizer does), or the
 * byte classes of version 1 tokenizer files (every byte >= 0x80 a letter),
 * kept so that a model trained with such a file still sees its words cut
 * as they were. docs/tokenizer.md has the rules and examples. */
#include <utf8proc.h>

#include "core/tokenizer/tokenizer.h"

/* Classes: whitespace, letter, number, other. */
enum { CW = 0, CL = 1, CN = 2, CO = 3 };

/* ------------------------------------------------------------ the classes */

/* Version 1 byte classes: whitespace (tab, LF, VT, FF, CR, space), letters
 * (ASCII letters and every byte >= 0x80), digits, and other. */
#define ROW_OTHER CO, CO, CO, CO, CO, CO, CO, CO, CO, CO, CO, CO, CO, CO, CO, CO
#define ROW_LETTER CL, CL, CL, CL, CL, CL, CL, CL, CL, CL, CL, CL, CL, CL, CL, CL
static const uint8_t byte_class[256] = {
    CO,         CO,         CO,         CO,         CO, CO, CO, CO,
    CO,         CW,         CW,         CW,         CW, CW, CO, CO, /* 0x00 */
    ROW_OTHER,                                                      /* 0x10 */
    CW,         CO,         CO,         CO,         CO, CO, CO, CO,
    CO,         CO,         CO,         CO,         CO, CO, CO, CO, /* 0x20 */
    CN,         CN,         CN,         CN,         CN, CN, CN, CN,
    CN,         CN,         CO,         CO,         CO, CO, CO, CO, /* 0x30 */
    CO,         CL,         CL,         CL,         CL, CL, CL, CL,
    CL,         CL,         CL,         CL,         CL, CL, CL, CL, /* 0x40 */
    CL,         CL,         CL,         CL,         CL, CL, CL, CL,
    CL,         CL,         CL,         CO,         CO, CO, CO, CO, /* 0x50 */
    CO,         CL,         CL,         CL,         CL, CL, CL, CL,
    CL,         CL,         CL,         CL,         CL, CL, CL, CL, /* 0x60 */
    CL,         CL,         CL,         CL,         CL, CL, CL, CL,
    CL,         CL,         CL,         CO,         CO, CO, CO, CO, /* 0x70 */
    ROW_LETTER, ROW_LETTER, ROW_LETTER, ROW_LETTER,                 /* 0x80 */
    ROW_LETTER, ROW_LETTER, ROW_LETTER, ROW_LETTER,                 /* 0xC0 */
};

/* The class of the character at s[i] and its length in bytes. Unicode:
 * \p{L} is the categories L*, \p{N} N*, \s Oniguruma's white space (tab
 * to CR, U+0085 and the categories Zs, Zl, Zp), as in the `tokenizers`
 * library. A byte that starts no valid UTF-8 sequence is one character
 * of class other (Python text cannot hold it; it must go somewhere). */
static int char_class(nl_tokenizer_split mode, const uint8_t *s, size_t len, size_t i, size_t *n)
{
    *n = 1;
    if (mode == NL_TOKENIZER_SPLIT_BYTES || s[i] < 0x80)
        return byte_class[s[i]];
    utf8proc_int32_t cp;
    size_t avail = len - i > 4 ? 4 : len - i;
    utf8proc_ssize_t k = utf8proc_iterate(s + i, (utf8proc_ssize_t)avail, &cp);
    if (k <= 0)
        return CO;
    *n = (size_t)k;
    if (cp == 0x85)
        return CW;
    switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
        return CL;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
        return CN;
    case UTF8PROC_CATEGORY_ZS:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
        return CW;
    default:
        return CO;
    }
}

/* ---------------------------------------------------------------- words */

/* Length of a contraction ('s 't 're 've 'm 'll 'd) at s[i] == '\'', or 0. */
static size_t contraction_len(const uint8_t *s, size_t len, size_t i)
{
    if (i + 1 >= len)
        return 0;
    uint8_t d = s[i + 1];
    if (d == 's' || d == 't' || d == 'm' || d == 'd')
        return 2;
    if (i + 2 >= len)
        return 0;
    uint8_t e = s[i + 2];
    if ((d == 'r' && e == 'e') || (d == 'v' && e == 'e') || (d == 'l' && e == 'l'))
        return 3;
    return 0;
}

size_t nl_tokenizer_split_next(nl_tokenizer_split mode, const void *text, size_t len, size_t i)
{
    const uint8_t *s = text;
    size_t n, m;
    if (i >= len)
        return len;
    if (s[i] == '\'') {
        size_t k = contraction_len(s, len, i);
        if (k)
            return i + k;
    }
    int cls = char_class(mode, s, len, i, &n);
    size_t j = i + n;
    if (s[i] == ' ' && j < len) {
        int next = char_class(mode, s, len, j, &m);
        if (next != CW) { /* ` ?` then a run of the next character's class */
            cls = next;
            j += m;
        }
    }
    if (cls != CW) {
        while (j < len && char_class(mode, s, len, j, &m) == cls)
            j += m;
        return j;
    }
    /* a whitespace run; one followed by a non-space leaves its last
     * character to the next word (`\s+(?!\S)`), unless it is one
     * character long (`\s+`) */
    size_t last = i;
    while (j < len && char_class(mode, s, len, j, &m) == CW) {
        last = j;
        j += m;
    }
    return j < len && last > i ? last : j;
}

size_t nl_tokenizer_safe_split(nl_tokenizer_split mode, const void *text, size_t len, size_t max)
{
    const uint8_t *s = text;
    if (len <= max)
        return len;
    /* An ASCII whitespace byte after a character that is not whitespace:
     * no word runs across it and no rule looks behind it. The character
     * before is ASCII, or (Unicode) the one that ends at p - 1. */
    for (size_t p = max; p >= 1; p--) {
        if (byte_class[s[p]] != CW)
            continue;
        if (s[p - 1] < 0x80 || mode == NL_TOKENIZER_SPLIT_BYTES) {
            if (byte_class[s[p - 1]] != CW)
                return p;
            continue;
        }
        size_t start = p - 1, n;
        while (start > 0 && p - start < 4 && (s[start] & 0xC0) == 0x80)
            start--;
        /* only a whitespace character (valid UTF-8) ending at p is not
         * safe: invalid bytes are each a character of class other */
        if (!(char_class(mode, s, len, start, &n) == CW && start + n == p))
            return p;
    }
    return 0;
}
