/* Status names and the caller-owned error record. */
#include "base/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char *const status_names[NL_STATUS_COUNT] = {
    [NL_OK] = "NL_OK",
    [NL_ERR_NOMEM] = "NL_ERR_NOMEM",
    [NL_ERR_IO] = "NL_ERR_IO",
    [NL_ERR_PROTO] = "NL_ERR_PROTO",
    [NL_ERR_AUTH] = "NL_ERR_AUTH",
    [NL_ERR_SHAPE] = "NL_ERR_SHAPE",
    [NL_ERR_TIMEOUT] = "NL_ERR_TIMEOUT",
    [NL_ERR_INVALID] = "NL_ERR_INVALID",
    [NL_ERR_FORMAT] = "NL_ERR_FORMAT",
    [NL_ERR_DTYPE] = "NL_ERR_DTYPE",
    [NL_ERR_RANGE] = "NL_ERR_RANGE",
    [NL_ERR_NOTFOUND] = "NL_ERR_NOTFOUND",
    [NL_ERR_VERSION] = "NL_ERR_VERSION",
    [NL_ERR_LIMIT] = "NL_ERR_LIMIT",
    [NL_ERR_CAPACITY] = "NL_ERR_CAPACITY",
    [NL_ERR_STATE] = "NL_ERR_STATE",
    [NL_ERR_UNSUPPORTED] = "NL_ERR_UNSUPPORTED",
    [NL_ERR_INTERNAL] = "NL_ERR_INTERNAL",
    [NL_ERR_INTEGRITY] = "NL_ERR_INTEGRITY",
};

const char *nl_status_str(nl_status st)
{
    if ((int)st < 0 || st >= NL_STATUS_COUNT || !status_names[st])
        return "NL_ERR_UNKNOWN";
    return status_names[st];
}

nl_status nl_error_set(nl_error *err, nl_status st, const char *fmt, ...)
{
    if (!err)
        return st;
    err->status = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return st;
}

nl_status nl_error_prefix(nl_error *err, const char *fmt, ...)
{
    if (!err)
        return NL_OK;
    char head[NL_ERROR_MSG_MAX];
    char old[NL_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    size_t n = strnlen(head, sizeof head - 1);
    memcpy(err->msg, head, n);
    size_t room = sizeof err->msg - n;
    if (room > 2) {
        err->msg[n] = ':';
        err->msg[n + 1] = ' ';
        memcpy(err->msg + n + 2, old, room - 2);
    }
    err->msg[sizeof err->msg - 1] = '\0';
    return err->status;
}

void nl_error_clear(nl_error *err)
{
    if (!err)
        return;
    err->status = NL_OK;
    err->msg[0] = '\0';
}
