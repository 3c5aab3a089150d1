/* File helpers: atomic writes (temporary file, fsync, rename, fsync of the
 * directory) so that a crash never leaves a half-written checkpoint or
 * tokenizer under the final name, and bounded whole-file reads. */
#ifndef NL_FILEIO_H
#define NL_FILEIO_H

#include <stddef.h>

#include "../base/status.h"

typedef struct nl_atomic_file nl_atomic_file;

/* Start writing `path` through a temporary file beside it. */
nl_status nl_atomic_open(nl_atomic_file **out, const char *path, nl_error *err);
/* Append bytes. On failure the file is left for nl_atomic_abort. */
nl_status nl_atomic_write(nl_atomic_file *af, const void *buf, size_t n, nl_error *err);
/* fsync, rename over `path`, fsync the directory; frees *af and NULLs it
 * whether or not it succeeds (on failure the temporary file is removed). */
nl_status nl_atomic_commit(nl_atomic_file **af, nl_error *err);
/* Drop the temporary file; safe on NULL. */
void nl_atomic_abort(nl_atomic_file **af);

/* Create a directory and every missing parent (mkdir -p, mode 0755). */
nl_status nl_file_mkdirs(const char *path, nl_error *err);

/* Write a whole buffer atomically. */
nl_status nl_file_write_atomic(const char *path, const void *buf, size_t n, nl_error *err);

/* Read a whole file of at most max_bytes into a malloc'd buffer (with a
 * NUL byte after the end, not counted in *len). The caller frees *out. */
nl_status nl_file_read_all(const char *path, size_t max_bytes, char **out, size_t *len,
                           nl_error *err);

#endif
