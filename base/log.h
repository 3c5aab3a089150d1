/* Logging: one macro that checks the level first, then prefixes the time,
 * the level and the process's name (e.g. "node-2"). Library code logs only
 * through this; it never prints on its own. Output goes to stderr. */
#ifndef NL_LOG_H
#define NL_LOG_H

#include <stddef.h>

typedef enum nl_log_level {
    NL_LOG_DEBUG = 0,
    NL_LOG_INFO,
    NL_LOG_WARN,
    NL_LOG_ERROR,
    NL_LOG_OFF
} nl_log_level;

/* The process-wide threshold; messages below it are not formatted. */
extern nl_log_level nl_log_threshold;

/* Set the name printed in every line ("coord", "node-1", ...). The string
 * is copied. */
void nl_log_set_name(const char *name);
void nl_log_set_level(nl_log_level level);
/* The level names in nl_log_level's order (a flag table's choices). */
#define NL_LOG_LEVELS "debug|info|warn|error|off"
/* Parse "debug", "info", "warn", "error", "off". Returns -1 if unknown. */
int nl_log_parse_level(const char *s);

void nl_log_write(nl_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Text from a peer made safe to log or to quote in a message: at most
 * n bytes of src (a NUL among them is escaped too) into dst (cap bytes, always
 * NUL-terminated), with backslash, control characters (C0, DEL, C1) and
 * newlines written as escapes (\\, \n, \r, \t, \xHH), bytes that are not
 * valid UTF-8 as \xHH, and valid UTF-8 kept. The result is valid UTF-8 on
 * one line; an escape is never cut, and a cut text ends with "...".
 * Returns dst. */
char *nl_log_escape_n(char *dst, size_t cap, const char *src, size_t n);
/* The same over a NUL-terminated string (NULL gives "(null)"). */
char *nl_log_escape(char *dst, size_t cap, const char *src);

#define NL_LOG(level, ...)                                                                         \
    do {                                                                                           \
        if ((level) >= nl_log_threshold)                                                           \
            nl_log_write((level), __VA_ARGS__);                                                    \
    } while (0)

#define NL_DEBUG(...) NL_LOG(NL_LOG_DEBUG, __VA_ARGS__)
#define NL_INFO(...) NL_LOG(NL_LOG_INFO, __VA_ARGS__)
#define NL_WARN(...) NL_LOG(NL_LOG_WARN, __VA_ARGS__)
#define NL_ERROR(...) NL_LOG(NL_LOG_ERROR, __VA_ARGS__)

#endif
