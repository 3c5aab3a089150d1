/* File helpers: atomic writes (temporary file, fsync, rename, fsync of the
 * directory) so that a crash never leaves a half-written checkpoint or
 * tokenizer under the final name, bounded whole-file reads, and paths
 * confined to a root directory.
 *
 * Safety: the temporary file is created exclusively and never through a
 * symbolic link (O_CREAT|O_EXCL|O_NOFOLLOW; a name already taken, by a
 * planted link or anything else, is skipped for the next one), with mode
 * 0600; directories are created 0700. The rename replaces a link at the
 * final name, never what it points to. */
#ifndef NL_FILEIO_H
#define NL_FILEIO_H

#include <stddef.h>

#include "base/status.h"

typedef struct nl_atomic_file nl_atomic_file;

/* Start writing `path` through a temporary file beside it, named
 * `<path>.tmp.<pid>.<k>` for the first k in 0..63 not taken. Mode 0600. */
nl_status nl_atomic_open(nl_atomic_file **out, const char *path, nl_error *err);
/* The same with another mode (e.g. 0644 for a public file), less umask. */
nl_status nl_atomic_open_mode(nl_atomic_file **out, const char *path, unsigned mode, nl_error *err);
/* Append bytes. On failure the file is left for nl_atomic_abort. */
nl_status nl_atomic_write(nl_atomic_file *af, const void *buf, size_t n, nl_error *err);
/* fsync, rename over `path`, fsync the directory; frees *af and NULLs it
 * whether or not it succeeds (on failure the temporary file is removed). */
nl_status nl_atomic_commit(nl_atomic_file **af, nl_error *err);
/* Drop the temporary file; safe on NULL. */
void nl_atomic_abort(nl_atomic_file **af);

/* fsync, then link into place only if `path` does not exist yet
 * (NL_ERR_STATE naming it if it does), fsync the directory; frees *af as
 * nl_atomic_commit does. For files that must never be replaced. */
nl_status nl_atomic_commit_new(nl_atomic_file **af, nl_error *err);

/* Create a directory and every missing parent (mkdir -p, mode 0700), and
 * fsync the parent of each directory it creates. */
nl_status nl_file_mkdirs(const char *path, nl_error *err);

/* Can files be made in directory `dir` (made later with nl_file_mkdirs if
 * missing)? Tried, not inferred from permission bits (root passes every
 * access() check, even on /proc or a read-only mount): a probe file is
 * created in `dir`, or in its nearest existing parent when `dir` does not
 * exist yet, and removed. NL_ERR_IO naming the directory and why when it
 * cannot; nothing is left behind either way. */
nl_status nl_file_can_create(const char *dir, nl_error *err);

/* fsync the directory that holds `path`. */
nl_status nl_file_sync_parent(const char *path, nl_error *err);

/* Confine `dir` to `root`: `root` is resolved with realpath (it must
 * exist); `dir` must be absolute, without "." or ".." components; the
 * part of it that exists is resolved with realpath (so a symbolic link
 * inside the root that leads outside is caught) and must lie under the
 * resolved root (root "/" admits every directory); the missing rest is
 * created (0700, one component at a time, never through a link) and the
 * whole resolved again. *out gets the resolved directory, malloc'd.
 * Errors: NL_ERR_INVALID (not absolute, "..", too long), NL_ERR_AUTH
 * (outside the root; the message names both), NL_ERR_IO, NL_ERR_NOTFOUND
 * (no root). */
nl_status nl_path_confine(const char *root, const char *dir, char **out, nl_error *err);

/* Write a whole buffer atomically. */
nl_status nl_file_write_atomic(const char *path, const void *buf, size_t n, nl_error *err);

/* Read a whole regular file of at most max_bytes into a malloc'd buffer
 * (with a NUL byte after the end, not counted in *len). The caller frees
 * *out. A FIFO, device or directory is refused (NL_ERR_IO) without
 * waiting: opening a FIFO would block until a writer came. */
nl_status nl_file_read_all(const char *path, size_t max_bytes, char **out, size_t *len,
                           nl_error *err);

/* A run's hold on a path it writes (a checkpoint directory, an output, a
 * log) for as long as it runs: flock(2) on a lock file, so that a second
 * run given the same path is refused while the first lives, and a run
 * that dies (even by SIGKILL) holds nothing. The lock file holds the
 * holder's pid, for the message. */
typedef struct nl_file_lock nl_file_lock;

/* Lock `lock_path` (created 0600 if missing, never through a link).
 * `what` names the thing locked for the user ("--out x.safetensors").
 * NL_ERR_STATE naming the other run's pid when another process holds it;
 * NL_ERR_IO when the lock file cannot be made. */
nl_status nl_file_lock_take(nl_file_lock **out, const char *lock_path, const char *what,
                            nl_error *err);
/* Remove the lock file (still holding the lock, so that no one locks a
 * removed file), unlock, free and NULL *lk. Safe on NULL. */
void nl_file_lock_release(nl_file_lock **lk);

#endif
