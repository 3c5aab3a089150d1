/* The logging sink: timestamped, levelled lines on stderr. */
#include "log.h"

#include <stdarg.h>
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
    int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld %-5s [%s] ", tm.tm_hour,
                     tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L,
                     tags[level <= NL_LOG_OFF ? level : NL_LOG_OFF], log_name);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line)
        vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}
