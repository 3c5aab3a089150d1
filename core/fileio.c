/* Atomic file writes and bounded reads. */
#include "fileio.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct nl_atomic_file {
    int fd;
    char *path;
    char *tmp;
};

nl_status nl_atomic_open(nl_atomic_file **out, const char *path, nl_error *err)
{
    *out = NULL;
    nl_atomic_file *af = calloc(1, sizeof *af);
    size_t n = strlen(path);
    if (!af)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
    af->path = strdup(path);
    af->tmp = malloc(n + 32);
    if (!af->path || !af->tmp) {
        free(af->path);
        free(af->tmp);
        free(af);
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
    }
    snprintf(af->tmp, n + 32, "%s.tmp.%ld", path, (long)getpid());
    af->fd = open(af->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (af->fd < 0) {
        nl_status st = nl_error_set(err, NL_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
        free(af->path);
        free(af->tmp);
        free(af);
        return st;
    }
    *out = af;
    return NL_OK;
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

static nl_status fsync_dir(const char *path, nl_error *err)
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

nl_status nl_atomic_commit(nl_atomic_file **afp, nl_error *err)
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
    if (rename(af->tmp, af->path) != 0) {
        st = nl_error_set(err, NL_ERR_IO, "%s: cannot rename into place: %s", af->path,
                          strerror(errno));
        goto fail;
    }
    st = fsync_dir(af->path, err);
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
    FILE *f = fopen(path, "rb");
    if (!f)
        return nl_error_set(err, NL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0) {
        st = nl_error_set(err, NL_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        goto out;
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
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            st = nl_error_set(err, NL_ERR_IO, "cannot create %s: %s", p, strerror(errno));
            break;
        }
        *s = c;
        if (c == '\0')
            break;
    }
    free(p);
    return st;
}
