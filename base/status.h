/* Status codes and error messages shared by every module.
 *
 * Fallible functions return an nl_status and, when the caller passes an
 * nl_error, fill it with a message that names the file, field or peer at
 * fault. The error is owned by the caller (usually on its stack). */
#ifndef NL_STATUS_H
#define NL_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" { /* the CUDA module and C++ tests include this */
#endif

typedef enum nl_status {
    NL_OK = 0,
    NL_ERR_NOMEM,       /* allocation failed */
    NL_ERR_IO,          /* read, write, open, rename, fsync failed */
    NL_ERR_PROTO,       /* malformed or unexpected message on the wire */
    NL_ERR_AUTH,        /* peer not authorised, bad key */
    NL_ERR_SHAPE,       /* tensor shape does not match what is expected */
    NL_ERR_TIMEOUT,     /* a peer or operation did not answer in time */
    NL_ERR_INVALID,     /* bad argument, config value or command-line flag */
    NL_ERR_FORMAT,      /* malformed file (checkpoint, tokenizer, data) */
    NL_ERR_DTYPE,       /* unsupported or unexpected element type */
    NL_ERR_RANGE,       /* a value or offset outside its allowed range */
    NL_ERR_NOTFOUND,    /* a required tensor, key or file is missing */
    NL_ERR_VERSION,     /* format or protocol version not supported */
    NL_ERR_LIMIT,       /* a size limit was exceeded */
    NL_ERR_CAPACITY,    /* not enough memory or nodes for the work */
    NL_ERR_STATE,       /* operation not valid in the current state */
    NL_ERR_UNSUPPORTED, /* feature not available in this build */
    NL_ERR_INTERNAL,    /* programmer error caught at run time */
    NL_ERR_INTEGRITY,   /* a hash or checksum does not match */
    NL_STATUS_COUNT
} nl_status;

/* Short stable name of a status, e.g. "NL_ERR_SHAPE". Never NULL. */
const char *nl_status_str(nl_status st);

#define NL_ERROR_MSG_MAX 512

/* A caller-owned error record: the status and a message for the user. */
typedef struct nl_error {
    nl_status status;
    char msg[NL_ERROR_MSG_MAX];
} nl_error;

/* Fill err (which may be NULL) and return st. The message is formatted
 * with printf rules. Returns st so callers can write
 * `return nl_error_set(err, NL_ERR_IO, "open %s: %s", path, strerror(e));` */
nl_status nl_error_set(nl_error *err, nl_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prefix the message already in err with "context: ". Returns err->status
 * (NL_OK when err is NULL). */
nl_status nl_error_prefix(nl_error *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Reset err to NL_OK with an empty message. err may be NULL. */
void nl_error_clear(nl_error *err);

#ifdef __cplusplus
}
#endif

#endif
