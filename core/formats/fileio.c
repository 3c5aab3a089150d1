/* Atomic file writes and bounded reads. */
#include "core/formats/fileio.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

struct nl_atomic_file {
    int fd;
    char *path;
    char *tmp;
};

nl_status nl_atomic_open_mode(nl_atomic_file **out, const char *path, unsigned mode, nl_error *err)
{
    *out = NULL;
    nl_atomic_file *af = calloc(1, sizeof *af);
    size_t n = strlen(path);
    if (!af)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
    af->fd = -1;
    af->path = strdup(path);
    af->tmp = malloc(n + 48);
    if (!af->path || !af->tmp) {
        free(af->path);
        free(af->tmp);
        free(af);
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
    }
    /* exclusively, never through a link: a name that is taken (a planted
     * symbolic link, a stale temporary) is passed over for the next one */
    int e = EEXIST;
    for (int k = 0; k < 64 && af->fd < 0 && e == EEXIST; k++) {
        snprintf(af->tmp, n + 48, "%s.tmp.%ld.%d", path, (long)getpid(), k);
        af->fd = open(af->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, (mode_t)mode);
        e = af->fd < 0 ? errno : 0;
    }
    if (af->fd < 0) {
        nl_status st = nl_error_set(err, NL_ERR_IO, "%s: cannot create: %s", path, strerror(e));
        free(af->path);
        free(af->tmp);
        free(af);
        return st;
    }
    *out = af;
    return NL_OK;
}

nl_status nl_atomic_open(nl_atomic_file **out, const char *path, nl_error *err)
{
    return nl_atomic_open_mode(out, path, 0600, err);
}

nl_status nl_atomic_write(nl_atomic_file *af, const void *buf, size_t n, nl_error *err)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(af->fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return nl_error_set(err, NL_ERR_IO, "%s: write failed: %s", af->tmp,
                                w < 0 ? strerror(errno) : "no progress");
        p += w;
        n -= (size_t)w;
    }
    return NL_OK;
}

nl_status nl_file_sync_parent(const char *path, nl_error *err)
{
    char *copy = strdup(path);
    if (!copy)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    const char *dir = dirname(copy);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    nl_status st = NL_OK;
    if (fd < 0 || fsync(fd) != 0)
        st = nl_error_set(err, NL_ERR_IO, "%s: cannot sync directory: %s", dir, strerror(errno));
    if (fd >= 0)
        close(fd);
    free(copy);
    return st;
}

/* fsync and close the temporary, then put it in place: renamed over
 * `path`, or (no_replace) linked there only if the name is free. */
static nl_status commit(nl_atomic_file **afp, bool no_replace, nl_error *err)
{
    nl_atomic_file *af = *afp;
    nl_status st = NL_OK;
    *afp = NULL;
    if (fsync(af->fd) != 0) {
        st = nl_error_set(err, NL_ERR_IO, "%s: fsync failed: %s", af->tmp, strerror(errno));
        goto fail;
    }
    if (close(af->fd) != 0) {
        af->fd = -1;
        st = nl_error_set(err, NL_ERR_IO, "%s: close failed: %s", af->tmp, strerror(errno));
        goto fail;
    }
    af->fd = -1;
    if (no_replace) {
        if (link(af->tmp, af->path) != 0) {
            st = errno == EEXIST ? nl_error_set(err, NL_ERR_STATE,
                                                "%s exists; refusing to replace it", af->path)
                                 : nl_error_set(err, NL_ERR_IO, "%s: cannot link into place: %s",
                                                af->path, strerror(errno));
            goto fail;
        }
        unlink(af->tmp);
    } else if (rename(af->tmp, af->path) != 0) {
        st = nl_error_set(err, NL_ERR_IO, "%s: cannot rename into place: %s", af->path,
                          strerror(errno));
        goto fail;
    }
    st = nl_file_sync_parent(af->path, err);
    goto done;
fail:
    if (af->fd >= 0)
        close(af->fd);
    unlink(af->tmp);
done:
    free(af->path);
    free(af->tmp);
    free(af);
    return st;
}

nl_status nl_atomic_commit(nl_atomic_file **afp, nl_error *err)
{
    return commit(afp, false, err);
}

nl_status nl_atomic_commit_new(nl_atomic_file **afp, nl_error *err)
{
    return commit(afp, true, err);
}

void nl_atomic_abort(nl_atomic_file **afp)
{
    if (!afp || !*afp)
        return;
    nl_atomic_file *af = *afp;
    if (af->fd >= 0)
        close(af->fd);
    unlink(af->tmp);
    free(af->path);
    free(af->tmp);
    free(af);
    *afp = NULL;
}

nl_status nl_file_write_atomic(const char *path, const void *buf, size_t n, nl_error *err)
{
    nl_atomic_file *af = NULL;
    nl_status st = nl_atomic_open(&af, path, err);
    if (st != NL_OK)
        return st;
    st = nl_atomic_write(af, buf, n, err);
    if (st != NL_OK) {
        nl_atomic_abort(&af);
        return st;
    }
    return nl_atomic_commit(&af, err);
}

nl_status nl_file_read_all(const char *path, size_t max_bytes, char **out, size_t *len,
                           nl_error *err)
{
    *out = NULL;
    *len = 0;
    nl_status st = NL_OK;
    char *buf = NULL;
    /* O_NONBLOCK: opening a FIFO for reading would wait for a writer for
     * ever; it is refused below, as is anything but a regular file */
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return nl_error_set(err, NL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    FILE *f = NULL;
    if (fstat(fd, &sb) != 0)
        st = nl_error_set(err, NL_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st = nl_error_set(err, NL_ERR_IO, "%s: not a regular file", path);
    if (st != NL_OK) {
        close(fd);
        return st;
    }
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0 || !(f = fdopen(fd, "rb"))) {
        st = nl_error_set(err, NL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        close(fd);
        return st;
    }
    if ((unsigned long long)sb.st_size > max_bytes) {
        st = nl_error_set(err, NL_ERR_LIMIT, "%s: %lld bytes is above the limit of %zu", path,
                          (long long)sb.st_size, max_bytes);
        goto out;
    }
    size_t n = (size_t)sb.st_size;
    buf = malloc(n + 1);
    if (!buf) {
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory for %zu bytes", path, n);
        goto out;
    }
    if (n && fread(buf, 1, n, f) != n) {
        st = nl_error_set(err, NL_ERR_IO, "%s: short read", path);
        goto out;
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    buf = NULL;
out:
    free(buf);
    fclose(f);
    return st;
}

nl_status nl_file_mkdirs(const char *path, nl_error *err)
{
    char *p = strdup(path);
    if (!p)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    nl_status st = NL_OK;
    for (char *s = p + 1;; s++) {
        const char c = *s;
        if (c != '/' && c != '\0')
            continue;
        *s = '\0';
        if (mkdir(p, 0700) == 0)
            st = nl_file_sync_parent(p, err); /* the new entry survives a crash */
        else if (errno != EEXIST)
            st = nl_error_set(err, NL_ERR_IO, "cannot create %s: %s", p, strerror(errno));
        *s = c;
        if (c == '\0' || st != NL_OK)
            break;
    }
    free(p);
    return st;
}

nl_status nl_file_can_create(const char *dir, nl_error *err)
{
    char p[PATH_MAX];
    struct stat sb;
    if (snprintf(p, sizeof p, "%s", dir[0] ? dir : ".") >= (int)sizeof p)
        return nl_error_set(err, NL_ERR_INVALID, "%.200s...: the path is too long", dir);
    while (stat(p, &sb) != 0) { /* the nearest existing parent */
        char *slash = strrchr(p, '/');
        if (!slash)
            snprintf(p, sizeof p, ".");
        else if (slash == p)
            p[1] = '\0';
        else
            *slash = '\0';
    }
    if (!S_ISDIR(sb.st_mode))
        return nl_error_set(err, NL_ERR_IO, "cannot write in %s: it is not a directory", p);
    char probe[PATH_MAX + 64];
    for (int k = 0; k < 64; k++) {
        snprintf(probe, sizeof probe, "%s/.nl-probe.%ld.%d", p, (long)getpid(), k);
        int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0600);
        if (fd >= 0) {
            close(fd);
            unlink(probe);
            return NL_OK;
        }
        if (errno != EEXIST) {
            /* /proc and /sys answer "no such file" to a new name */
            const char *why =
                errno == ENOENT ? "the file system takes no new files there" : strerror(errno);
            return nl_error_set(err, NL_ERR_IO, "cannot write in %s: %s", p, why);
        }
    }
    return nl_error_set(err, NL_ERR_IO, "cannot write in %s: 64 probe names are taken", p);
}

/* ------------------------------------------------------------ confinement */

/* p lies under the resolved root r (or is r). */
static bool under(const char *p, const char *r)
{
    size_t n = strlen(r);
    if (n == 1 && r[0] == '/')
        return true;
    return strncmp(p, r, n) == 0 && (p[n] == '/' || p[n] == '\0');
}

/* Absolute, no "." or ".." component, shorter than PATH_MAX. */
static nl_status check_dir_text(const char *dir, nl_error *err)
{
    if (dir[0] != '/' || strlen(dir) >= PATH_MAX)
        return nl_error_set(err, NL_ERR_INVALID, "'%.200s' is not an absolute path", dir);
    for (const char *p = dir; *p; p++) {
        if (*p != '.' || p[-1] != '/')
            continue;
        size_t k = p[1] == '.' ? 2 : 1;
        if (p[k] == '/' || p[k] == '\0')
            return nl_error_set(err, NL_ERR_INVALID, "'%.200s' has a '%.*s' component", dir, (int)k,
                                "..");
    }
    return NL_OK;
}

/* Create the components of `rest` ("a/b/c") one by one under the real
 * directory `base` (PATH_MAX bytes, extended in place), never through a
 * link. */
static nl_status make_rest(char *base, char *rest, nl_error *err)
{
    nl_status st = NL_OK;
    int fd = open(base, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return nl_error_set(err, NL_ERR_IO, "%s: %s", base, strerror(errno));
    for (char *save = NULL, *c = strtok_r(rest, "/", &save); c; c = strtok_r(NULL, "/", &save)) {
        bool made = mkdirat(fd, c, 0700) == 0;
        if (!made && errno != EEXIST) {
            st = nl_error_set(err, NL_ERR_IO, "cannot create %s/%s: %s", base, c, strerror(errno));
            break;
        }
        if (made && fsync(fd) != 0) {
            st = nl_error_set(err, NL_ERR_IO, "%s: cannot sync: %s", base, strerror(errno));
            break;
        }
        int next = openat(fd, c, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (next < 0) {
            st = nl_error_set(err, NL_ERR_IO, "%s/%s: %s", base, c,
                              errno == ELOOP ? "a symbolic link" : strerror(errno));
            break;
        }
        close(fd);
        fd = next;
        size_t n = strlen(base);
        snprintf(base + n, PATH_MAX - n, "%s%s", n > 1 ? "/" : "", c);
    }
    close(fd);
    return st;
}

/* A directory that leads outside the root: named as asked, never where it
 * resolves (a link's target is not the asker's to learn: issue 31). */
static nl_status refuse_outside(const char *dir, nl_error *err)
{
    return nl_error_set(err, NL_ERR_AUTH, "'%.200s' is outside the root", dir);
}

nl_status nl_path_confine(const char *root, const char *dir, char **out, nl_error *err)
{
    char rroot[PATH_MAX], real[PATH_MAX], *p = NULL;
    *out = NULL;
    if (!root || !realpath(root, rroot))
        return nl_error_set(err, root && errno != ENOENT ? NL_ERR_IO : NL_ERR_NOTFOUND,
                            "root %s: %s", root ? root : "(none)",
                            root ? strerror(errno) : "no root directory");
    nl_status st = check_dir_text(dir, err);
    if (st != NL_OK)
        return st;
    if (!(p = strdup(dir)))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    /* the deepest part that exists, resolved */
    struct stat sb;
    while (stat(p, &sb) != 0) {
        char *slash = strrchr(p, '/');
        if (slash == p) { /* only "/" is left */
            p[1] = '\0';
            break;
        }
        *slash = '\0';
    }
    /* p is the existing prefix of dir; the rest is to be made */
    const char *rest = dir + strlen(p);
    while (*rest == '/')
        rest++;
    if (!realpath(p, real)) {
        st = nl_error_set(err, NL_ERR_IO, "%s: %s", p, strerror(errno));
        goto out;
    }
    if (!under(real, rroot)) {
        st = refuse_outside(dir, err);
        goto out;
    }
    if (*rest) {
        char *tail = strdup(rest);
        if (!tail) {
            st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
            goto out;
        }
        st = make_rest(real, tail, err);
        free(tail);
        if (st != NL_OK)
            goto out;
    }
    /* once more, whole: a link swapped in meanwhile is caught here */
    if (!realpath(dir, real) || stat(real, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        st = nl_error_set(err, NL_ERR_IO, "'%.200s' is not a directory", dir);
        goto out;
    }
    if (!under(real, rroot)) {
        st = refuse_outside(dir, err);
        goto out;
    }
    if (!(*out = strdup(real)))
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
out:
    free(p);
    return st;
}

/* ------------------------------------------------------------ run locks */

struct nl_file_lock {
    int fd;
    char *path;
};

/* Another process holds the lock on fd: say who. */
static nl_status lock_busy(int fd, const char *lock_path, const char *what, nl_error *err)
{
    char buf[24] = "";
    const ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    const long pid = n > 0 ? strtol(buf, NULL, 10) : 0;
    if (pid > 0)
        return nl_error_set(err, NL_ERR_STATE,
                            "%s: another run (pid %ld) is writing there (it holds %s); wait for "
                            "it to end, or choose another path",
                            what, pid, lock_path);
    return nl_error_set(err, NL_ERR_STATE,
                        "%s: another run is writing there (it holds %s); wait for it to end, or "
                        "choose another path",
                        what, lock_path);
}

nl_status nl_file_lock_take(nl_file_lock **out, const char *lock_path, const char *what,
                            nl_error *err)
{
    *out = NULL;
    /* the holder before us removes the file before it unlocks: a lock
     * taken on a removed file is dropped and the name opened again */
    for (int tries = 0; tries < 16; tries++) {
        int fd = open(lock_path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0)
            return nl_error_set(err, NL_ERR_IO, "%s: cannot make the lock file %s: %s", what,
                                lock_path, strerror(errno));
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            const int e = errno;
            nl_status st = e == EWOULDBLOCK ? lock_busy(fd, lock_path, what, err)
                                            : nl_error_set(err, NL_ERR_IO, "%s: cannot lock %s: %s",
                                                           what, lock_path, strerror(e));
            close(fd);
            return st;
        }
        struct stat held, named;
        if (fstat(fd, &held) == 0 && stat(lock_path, &named) == 0 && held.st_dev == named.st_dev &&
            held.st_ino == named.st_ino) {
            char pid[24];
            const int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
            nl_file_lock *lk = calloc(1, sizeof *lk);
            if (!lk || !(lk->path = strdup(lock_path)) || ftruncate(fd, 0) != 0 ||
                pwrite(fd, pid, (size_t)n, 0) != n) {
                const int e = errno;
                if (lk)
                    free(lk->path);
                free(lk);
                unlink(lock_path);
                close(fd);
                return nl_error_set(err, NL_ERR_IO, "%s: cannot write the lock file %s: %s", what,
                                    lock_path, strerror(e));
            }
            lk->fd = fd;
            *out = lk;
            return NL_OK;
        }
        close(fd);
    }
    return nl_error_set(err, NL_ERR_STATE, "%s: the lock file %s keeps being replaced", what,
                        lock_path);
}

void nl_file_lock_release(nl_file_lock **lk)
{
    if (!lk || !*lk)
        return;
    unlink((*lk)->path);
    close((*lk)->fd);
    free((*lk)->path);
    free(*lk);
    *lk = NULL;
}
