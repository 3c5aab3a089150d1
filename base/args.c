/* Flag parsing for neuroctl. */
#include "args.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Names longer than this are never typos of a flag: no suggestion. */
#define NAME_MAX_LEN 64

/* Edit distance of a and b (each at most NAME_MAX_LEN): insertions,
 * deletions, substitutions and swaps of neighbours (trian: train) each count
 * one. Three rows: the one before last for the swaps. */
static int edit_distance(const char *a, size_t na, const char *b, size_t nb)
{
    int rows[3][NAME_MAX_LEN + 1];
    int *prev2 = rows[0], *prev = rows[1], *cur = rows[2];
    for (size_t j = 0; j <= nb; j++)
        prev[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        cur[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int best = prev[j - 1] + (a[i - 1] != b[j - 1]);
            if (prev[j] + 1 < best)
                best = prev[j] + 1;
            if (cur[j - 1] + 1 < best)
                best = cur[j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
                prev2[j - 2] + 1 < best)
                best = prev2[j - 2] + 1;
            cur[j] = best;
        }
        int *t = prev2;
        prev2 = prev;
        prev = cur;
        cur = t;
    }
    return prev[nb];
}

int nl_args_nearness(const char *given, const char *known)
{
    size_t ng = strlen(given), nk = strlen(known);
    if (ng == 0 || nk == 0 || ng > NAME_MAX_LEN || nk > NAME_MAX_LEN)
        return -1;
    int d = edit_distance(given, ng, known, nk);
    size_t shorter = ng < nk ? ng : nk;
    /* a typo: one edit in a short name, one in three in a longer one */
    int typo = d <= (ng / 3 > 1 ? (int)(ng / 3) : 1);
    /* one a prefix of the other: step and steps, checkpoint and checkpoint-dir */
    int prefix = shorter >= 3 && strncmp(given, known, shorter) == 0;
    return typo || prefix ? d : -1;
}

/* Whether text holds word (letters and digits, any case) as a whole word. */
static int names_word(const char *text, const char *word)
{
    size_t n = strlen(word);
    for (const char *t = text; *t; t++) {
        if (t != text && isalnum((unsigned char)t[-1]))
            continue;
        if (strncasecmp(t, word, n) == 0 && !isalnum((unsigned char)t[n]))
            return 1;
    }
    return 0;
}

/* The part of name after its first word ("tokens" of "max-tokens") when
 * known has that first word too, else NULL. */
static const char *rest_after_shared_word(const char *name, const char *known)
{
    const char *dash = strchr(name, '-');
    size_t n = dash ? (size_t)(dash - name) : 0;
    if (n < 2 || !dash[1] || strncmp(name, known, n) != 0 || known[n] != '-')
        return NULL;
    return dash + 1;
}

const char *nl_args_suggest(const nl_flag *flags, const char *given)
{
    const char *best = NULL;
    int best_d = -1;
    for (const nl_flag *fl = flags; fl->name; fl++) {
        int d = nl_args_nearness(given, fl->name);
        if (d >= 0 && (best_d < 0 || d < best_d)) {
            best = fl->name;
            best_d = d;
        }
    }
    if (best || strlen(given) < 3)
        return best;
    /* the same first word, and the help names the rest: max-tokens and max-new
     * ("tokens to generate"), not serve's max-batch ("generations decoded") */
    for (const nl_flag *fl = flags; fl->name; fl++) {
        const char *rest = rest_after_shared_word(given, fl->name);
        if (rest && fl->help && names_word(fl->help, rest))
            return fl->name;
    }
    /* none close by spelling: the one flag whose help names it (port: --http) */
    for (const nl_flag *fl = flags; fl->name; fl++) {
        if (!fl->help || !names_word(fl->help, given))
            continue;
        if (best)
            return NULL; /* two: no guess */
        best = fl->name;
    }
    return best;
}

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
            const char *near = nl_args_suggest(flags, a + 2);
            if (near)
                fprintf(stderr, "%s: unknown flag '%s': did you mean --%s? (see --help)\n", argv[0],
                        a, near);
            else
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
