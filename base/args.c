/* Flag parsing for neuroctl. */
#include "args.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void nl_args_help(FILE *f, const char *usage, const nl_flag *flags)
{
    fprintf(f, "usage: %s\n", usage);
    for (const nl_flag *fl = flags; fl->name; fl++)
        fprintf(f, "  --%-18s %s\n", fl->name, fl->help);
}

int nl_args_parse(int argc, char **argv, nl_flag *flags, const char *usage, const char **pos,
                  int max_pos, int *n_pos)
{
    int np = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            nl_args_help(stdout, usage, flags);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) {
            if (np >= max_pos) {
                fprintf(stderr, "%s: unexpected argument '%s'\n", argv[0], a);
                return 2;
            }
            pos[np++] = a;
            continue;
        }
        nl_flag *fl = flags;
        while (fl->name && strcmp(fl->name, a + 2) != 0)
            fl++;
        if (!fl->name) {
            fprintf(stderr, "%s: unknown flag '%s' (see --help)\n", argv[0], a);
            return 2;
        }
        if (!fl->takes_value) {
            fl->value = "1";
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "%s: %s needs a value\n", argv[0], a);
            return 2;
        }
        fl->value = argv[++i];
    }
    if (n_pos)
        *n_pos = np;
    return 0;
}

const char *nl_args_get(const nl_flag *flags, const char *name)
{
    for (const nl_flag *fl = flags; fl->name; fl++)
        if (strcmp(fl->name, name) == 0)
            return fl->value;
    return NULL;
}

int nl_args_int(const nl_flag *flags, const char *name, long long lo, long long hi, long long *out)
{
    const char *v = nl_args_get(flags, name);
    if (!v)
        return 0;
    char *end = NULL;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "--%s: '%s' is not an integer in %lld..%lld\n", name, v, lo, hi);
        return 2;
    }
    *out = x;
    return 0;
}

int nl_args_double(const nl_flag *flags, const char *name, double lo, double hi, double *out)
{
    const char *v = nl_args_get(flags, name);
    if (!v)
        return 0;
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "--%s: '%s' is not a number in %g..%g\n", name, v, lo, hi);
        return 2;
    }
    *out = x;
    return 0;
}

int nl_args_size(const nl_flag *flags, const char *name, uint64_t *out)
{
    const char *v = nl_args_get(flags, name);
    if (!v)
        return 0;
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    double mult = 1;
    if (end && *end) {
        switch (*end) {
        case 'k': case 'K': mult = 1024.0; break;
        case 'm': case 'M': mult = 1024.0 * 1024; break;
        case 'g': case 'G': mult = 1024.0 * 1024 * 1024; break;
        case 't': case 'T': mult = 1024.0 * 1024 * 1024 * 1024; break;
        default: mult = -1;
        }
        if (mult > 0 && end[1] && !(end[1] == 'B' && !end[2]) && !(end[1] == 'i' && end[2] == 'B' && !end[3]))
            mult = -1;
    }
    if (errno || end == v || mult < 0 || !(x > 0) || x * mult > 1e18) {
        fprintf(stderr, "--%s: '%s' is not a size such as 512M or 8G\n", name, v);
        return 2;
    }
    *out = (uint64_t)(x * mult);
    return 0;
}
