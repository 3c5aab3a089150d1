/* File helpers, the device flags and the generation clock shared by
 * neuroctl's commands. */
#include "cli/cli_io.h"

#include "core/formats/fileio.h"

#include <errno.h>
#include <inttypes.h>
#include <libgen.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

/* Read an integer tensor `name` ([B, T], I32 or I64) from an open file. */
nl_status nl_cli_read_ids(nl_st_file *f, const char *path, const char *name, int32_t **out, int *B,
                          int *T, nl_error *err)
{
    const nl_st_entry *e = nl_st_find(f, name);
    if (!e)
        return nl_error_set(err, NL_ERR_NOTFOUND, "%s: no tensor '%s'", path, name);
    if (e->dtype != NL_DTYPE_I32 && e->dtype != NL_DTYPE_I64)
        return nl_error_set(err, NL_ERR_DTYPE, "%s: '%s' is %s, not I32 or I64", path, name,
                            nl_dtype_name(e->dtype));
    if (e->ndim != 2 || e->shape[0] < 1 || e->shape[1] < 1 || e->shape[0] * e->shape[1] > (1 << 24))
        return nl_error_set(err, NL_ERR_SHAPE, "%s: '%s' must be [B, T] with 1..2^24 entries", path,
                            name);
    const size_t n = (size_t)(e->shape[0] * e->shape[1]);
    int32_t *t = malloc(n * sizeof *t);
    if (!t)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
    const char *data = nl_st_tensor_data(f, e);
    for (size_t i = 0; i < n; i++) {
        int64_t v;
        if (e->dtype == NL_DTYPE_I32) {
            int32_t x;
            memcpy(&x, data + 4 * i, 4);
            v = x;
        } else {
            memcpy(&v, data + 8 * i, 8);
        }
        if (v < INT32_MIN || v > INT32_MAX) {
            free(t);
            return nl_error_set(err, NL_ERR_RANGE, "%s: '%s'[%zu] = %" PRId64 " is out of range",
                                path, name, i, v);
        }
        t[i] = (int32_t)v;
    }
    *out = t;
    *B = (int)e->shape[0];
    *T = (int)e->shape[1];
    return NL_OK;
}

nl_status nl_cli_read_ids_file(const char *path, const char *name, int32_t **out, int *B, int *T,
                               nl_error *err)
{
    nl_st_file *f = NULL;
    nl_status st = nl_st_open(&f, path, err);
    if (st == NL_OK)
        st = nl_cli_read_ids(f, path, name, out, B, T, err);
    nl_st_close(&f);
    return st;
}

/* "1,2,3" -> ids. Returns the count, or -1 after printing the fault. */
int nl_cli_parse_ids(const char *s, int32_t **out)
{
    int cap = 16, n = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    while (ids && *s) {
        char *end = NULL;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (errno || end == s || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "--prompt-tokens: '%s' is not a comma-separated list of ids\n", s);
            free(ids);
            return -1;
        }
        if (n == cap) {
            int32_t *t = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
            if (!t)
                break;
            ids = t;
        }
        ids[n++] = (int32_t)v;
        s = *end ? end + 1 : end;
    }
    if (!ids || n == 0) {
        fprintf(stderr, "--prompt-tokens: no ids given\n");
        free(ids);
        return -1;
    }
    *out = ids;
    return n;
}

void nl_gen_clock_start(nl_gen_clock *c)
{
    *c = (nl_gen_clock){.start = nl_mono_s()};
}

void nl_gen_clock_tick(nl_gen_clock *c)
{
    c->last = nl_mono_s();
    if (c->count++ == 0)
        c->first = c->last;
}

void nl_gen_clock_report(const nl_gen_clock *c)
{
    if (c->count < 1)
        return;
    const double rest = c->last - c->first;
    fprintf(stderr, "generate: %d tokens: first after %.1f ms", c->count,
            (c->first - c->start) * 1e3);
    if (c->count > 1)
        fprintf(stderr, ", then %d in %.1f ms (%.1f tokens/s)", c->count - 1, rest * 1e3,
                rest > 0 ? (c->count - 1) / rest : 0.0);
    fputc('\n', stderr);
}

/* ---------------------------------------------------------------- device */

int nl_cli_device_flags(const nl_flag *flags, const char **device, int *tf32, int *bf16)
{
    const char *p = nl_args_get(flags, "precision");
    nl_cli_device d = {.device = nl_args_get(flags, "device")};
    *tf32 = nl_args_get(flags, "tf32") != NULL;
    *bf16 = p && strcmp(p, "bf16") == 0;
    if (p && !*bf16 && strcmp(p, "fp32") != 0) {
        fprintf(stderr, "--precision %s: not fp32 or bf16\n", p);
        return 2;
    }
    int rc = nl_cli_device_opts(&d);
    *device = d.device;
    return rc;
}

int nl_cli_device_opts(nl_cli_device *d)
{
    nl_error err;
    if (!d->device)
        d->device = "cpu";
    if (nl_backend_parse_device(d->device, &err) != NL_OK) {
        fprintf(stderr, "--%s\n", err.msg);
        return 2;
    }
    return 0;
}

nl_status nl_cli_backend_new(nl_backend **be, const char *device, int threads, int tf32, int bf16,
                             int training, nl_error *err)
{
    nl_status st = nl_backend_new(
        be, device, &(nl_backend_opts){.threads = threads, .tf32 = tf32, .bf16 = bf16}, err);
    if (st != NL_OK)
        return st;
    if (training && !(*be)->can_train) {
        nl_backend_destroy(be);
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "%s: training on this device is not available yet (use --device cpu)",
                            device);
    }
    return NL_OK;
}

nl_status nl_cli_device_check(nl_backend *be, nl_error *err)
{
    nl_status st = nl_backend_check(be, err);
    return st == NL_OK ? st : nl_error_prefix(err, "device %s", be->name);
}

/* ---------------------------------------------------------------- usage checks */

int nl_cli_require(const char *cmd, const char *usage, const nl_flag *flags, ...)
{
    va_list ap;
    const char *name, *missing = NULL;
    va_start(ap, flags);
    while (!missing && (name = va_arg(ap, const char *)))
        if (!nl_args_get(flags, name))
            missing = name;
    va_end(ap);
    if (!missing)
        return 0;
    fprintf(stderr, "neuroctl %s: missing --%s\n\n", cmd, missing);
    nl_args_help(stderr, usage, flags);
    return 2;
}

int nl_cli_input_file(const char *flag, const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        fprintf(stderr, "--%s %s: %s\n", flag, path, strerror(errno));
        return 1;
    }
    if (S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "--%s %s: is a directory, not a file\n", flag, path);
        return 1;
    }
    if (!S_ISREG(sb.st_mode)) {
        fprintf(stderr, "--%s %s: not a regular file\n", flag, path);
        return 1;
    }
    return 0;
}

int nl_cli_can_write(const char *flag, const char *path, int is_dir)
{
    if (!path)
        return 0;
    char *copy = strdup(path);
    nl_error err = {0};
    nl_status st = copy ? nl_file_can_create(is_dir ? copy : dirname(copy), &err)
                        : nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
    free(copy);
    if (st == NL_OK)
        return 0;
    fprintf(stderr, "--%s %s: %s\n", flag, path, err.msg);
    return 1;
}

int nl_cli_may_write(const nl_flag *flags, const char *flag, const char *path)
{
    struct stat sb;
    if (!path)
        return 0;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) { /* never replaced, --force or not */
        fprintf(stderr, "--%s %s: is a directory (give the path of a file)\n", flag, path);
        return 1;
    }
    if (nl_args_get(flags, "force") || lstat(path, &sb) != 0)
        return 0;
    fprintf(stderr, "--%s %s: the file exists (give --force to replace it)\n", flag, path);
    return 1;
}

int nl_cli_not_input(const char *out_flag, const char *out, const char *in_flag, const char *in)
{
    struct stat so, si;
    if (!out || !in || stat(out, &so) != 0 || stat(in, &si) != 0 || so.st_dev != si.st_dev ||
        so.st_ino != si.st_ino)
        return 0;
    fprintf(stderr, "--%s %s: that is the --%s input; give another path\n", out_flag, out, in_flag);
    return 1;
}

nl_status nl_cli_lock(nl_file_lock **lk, const char *flag, const char *path, const char *suffix,
                      nl_error *err)
{
    char lp[4200], what[4200];
    if (!path)
        return NL_OK;
    snprintf(lp, sizeof lp, "%s%s", path, suffix);
    snprintf(what, sizeof what, "--%s %s", flag, path);
    return nl_file_lock_take(lk, lp, what, err);
}
