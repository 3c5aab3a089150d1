/* The logging sink: timestamped, levelled lines on stderr. */
#include "base/log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

nl_log_level nl_log_threshold = NL_LOG_INFO;
static char log_name[32] = "neurollm";

void nl_log_set_name(const char *name)
{
    snprintf(log_name, sizeof log_name, "%s", name ? name : "");
}

void nl_log_set_level(nl_log_level level)
{
    nl_log_threshold = level;
}

int nl_log_parse_level(const char *s)
{
    static const char *const names[] = {"debug", "info", "warn", "error", "off"};
    for (int i = 0; i < 5; i++)
        if (s && strcmp(s, names[i]) == 0)
            return i;
    return -1;
}

void nl_log_write(nl_log_level level, const char *fmt, ...)
{
    static const char *const tags[] = {"DEBUG", "INFO", "WARN", "ERROR", "OFF"};
    struct timespec ts;
    struct tm tm;
    char line[1024];
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld %-5s [%s] ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000L,
                     tags[level <= NL_LOG_OFF ? level : NL_LOG_OFF], log_name);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line)
        vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}

/* The length of the valid UTF-8 sequence at s (n bytes left), 0 if none
 * (overlong forms, surrogates and code points past U+10FFFF are not
 * valid), and its code point in *cp. */
static size_t utf8_len(const unsigned char *s, size_t n, unsigned *cp)
{
    unsigned c = s[0], need, min;
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    if (c >= 0xc2 && c <= 0xdf)
        need = 1, min = 0x80, c &= 0x1f;
    else if (c >= 0xe0 && c <= 0xef)
        need = 2, min = 0x800, c &= 0x0f;
    else if (c >= 0xf0 && c <= 0xf4)
        need = 3, min = 0x10000, c &= 0x07;
    else
        return 0;
    if (n < need + 1)
        return 0;
    for (unsigned i = 1; i <= need; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        c = c << 6 | (s[i] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    *cp = c;
    return need + 1;
}

/* The escaped form of the character at s (n bytes left) into esc (at
 * least 5 bytes); returns its length and sets *used to the bytes read. */
static size_t escape_one(const unsigned char *s, size_t n, char *esc, size_t *used)
{
    static const char hex[] = "0123456789abcdef";
    unsigned cp = 0;
    size_t len = utf8_len(s, n, &cp);
    if (len == 0 || cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp < 0xa0)) {
        /* control characters and stray bytes: escaped, one byte at a time */
        const unsigned b = s[0];
        *used = 1;
        const char *named = b == '\n' ? "\\n" : b == '\r' ? "\\r" : b == '\t' ? "\\t" : NULL;
        if (named) {
            memcpy(esc, named, 2);
            return 2;
        }
        esc[0] = '\\', esc[1] = 'x', esc[2] = hex[b >> 4], esc[3] = hex[b & 15];
        return 4;
    }
    *used = len;
    if (cp == '\\') {
        esc[0] = esc[1] = '\\';
        return 2;
    }
    memcpy(esc, s, len);
    return len;
}

char *nl_log_escape_n(char *dst, size_t cap, const char *src, size_t n)
{
    const unsigned char *s = (const unsigned char *)src;
    char esc[8];
    size_t total = 0, used = 0;
    if (cap == 0)
        return dst;
    if (!src)
        s = (const unsigned char *)"(null)", n = 6;
    for (size_t i = 0; i < n; i += used)
        total += escape_one(s + i, n - i, esc, &used);
    /* all of it, or as much as leaves room for "..." */
    const bool cut = total + 1 > cap;
    const size_t room = cut ? (cap > 4 ? cap - 4 : 0) : total;
    size_t o = 0;
    for (size_t i = 0; i < n; i += used) {
        size_t k = escape_one(s + i, n - i, esc, &used);
        if (o + k > room)
            break;
        memcpy(dst + o, esc, k);
        o += k;
    }
    if (cut && o + 4 <= cap) {
        memcpy(dst + o, "...", 3);
        o += 3;
    }
    dst[o] = '\0';
    return dst;
}

char *nl_log_escape(char *dst, size_t cap, const char *src)
{
    return nl_log_escape_n(dst, cap, src, src ? strlen(src) : 6);
}
