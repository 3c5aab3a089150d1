/* Flag parsing for neuroctl and the daemons: the untyped nl_flag table and
 * its getters, the typed nl_opt table (one row a flag: parse, range,
 * default and --help), and the suggestion for a mistyped flag. Both
 * tables go through one parse loop: an nl_opt row starts with its
 * nl_flag, so the loop walks either with the row's size as its stride. */
#include "base/args.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
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

/* Row i of a table of nl_flag or of nl_opt (stride: the row's size). */
static nl_flag *row(const nl_flag *first, size_t stride, size_t i)
{
    return (nl_flag *)((const char *)first + i * stride);
}

static const char *suggest_in(const nl_flag *flags, size_t stride, const char *given)
{
    const char *best = NULL;
    int best_d = -1;
    const nl_flag *fl;
    for (size_t k = 0; (fl = row(flags, stride, k))->name; k++) {
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
    for (size_t k = 0; (fl = row(flags, stride, k))->name; k++) {
        const char *rest = rest_after_shared_word(given, fl->name);
        if (rest && fl->help && names_word(fl->help, rest))
            return fl->name;
    }
    /* none close by spelling: the one flag whose help names it (port: --http) */
    for (size_t k = 0; (fl = row(flags, stride, k))->name; k++) {
        if (!fl->help || !names_word(fl->help, given))
            continue;
        if (best)
            return NULL; /* two: no guess */
        best = fl->name;
    }
    return best;
}

const char *nl_args_suggest(const nl_flag *flags, const char *given)
{
    return suggest_in(flags, sizeof *flags, given);
}

void nl_args_help(FILE *f, const char *usage, const nl_flag *flags)
{
    fprintf(f, "usage: %s\n", usage);
    for (const nl_flag *fl = flags; fl->name; fl++)
        fprintf(f, "  --%-18s %s\n", fl->name, fl->help);
}

/* The parse loop over either table: each flag's text into its row's
 * value. 0; 1 when --help is given (the caller prints it); 2 (said). */
static int parse_rows(int argc, char **argv, nl_flag *flags, size_t stride, const char **pos,
                      int max_pos, int *n_pos)
{
    int np = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)
            return 1;
        if (strncmp(a, "--", 2) != 0) {
            if (np >= max_pos) {
                fprintf(stderr, "%s: unexpected argument '%s'\n", argv[0], a);
                return 2;
            }
            pos[np++] = a;
            continue;
        }
        nl_flag *fl;
        for (size_t k = 0; (fl = row(flags, stride, k))->name; k++) {
            if (strcmp(fl->name, a + 2) == 0)
                break;
        }
        if (!fl->name) {
            const char *near = suggest_in(flags, stride, a + 2);
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

int nl_args_parse(int argc, char **argv, nl_flag *flags, const char *usage, const char **pos,
                  int max_pos, int *n_pos)
{
    int rc = parse_rows(argc, argv, flags, sizeof *flags, pos, max_pos, n_pos);
    if (rc == 1)
        nl_args_help(stdout, usage, flags);
    return rc;
}

const char *nl_args_get(const nl_flag *flags, const char *name)
{
    for (const nl_flag *fl = flags; fl->name; fl++)
        if (strcmp(fl->name, name) == 0)
            return fl->value;
    return NULL;
}

/* The value parsers, shared by the getters and the typed table: 0 and
 * *out set, or "--name: ..." printed and 2. */

/* A number as a user writes one in decimal: an optional sign, then a
 * digit or a point; no blank before it (strtod and strtoll skip one,
 * though none after it is taken) and no hexadecimal (strtod reads
 * "0x10", strtoll in base 10 does not). */
static int decimal_start(const char *v)
{
    const char *p = v + (*v == '-' || *v == '+');
    return (isdigit((unsigned char)*p) || *p == '.') &&
           !(p[0] == '0' && (p[1] == 'x' || p[1] == 'X'));
}

static int parse_ll(const char *name, const char *v, long long lo, long long hi, long long *out)
{
    char *end = NULL;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (!decimal_start(v) || errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "--%s: '%s' is not an integer in %lld..%lld\n", name, v, lo, hi);
        return 2;
    }
    *out = x;
    return 0;
}

static int parse_double(const char *name, const char *v, double lo, double hi, double *out)
{
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (!decimal_start(v) || errno || end == v || *end || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "--%s: '%s' is not a number in %g..%g%s\n", name, v, lo, hi,
                errno == ERANGE ? " (beyond what a double holds)" : "");
        return 2;
    }
    *out = x;
    return 0;
}

static int parse_size(const char *name, const char *v, uint64_t *out)
{
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    double mult = 1;
    if (end && *end) {
        switch (*end) {
        case 'k':
        case 'K':
            mult = 1024.0;
            break;
        case 'm':
        case 'M':
            mult = 1024.0 * 1024;
            break;
        case 'g':
        case 'G':
            mult = 1024.0 * 1024 * 1024;
            break;
        case 't':
        case 'T':
            mult = 1024.0 * 1024 * 1024 * 1024;
            break;
        default:
            mult = -1;
        }
        if (mult > 0 && end[1] && !(end[1] == 'B' && !end[2]) &&
            !(end[1] == 'i' && end[2] == 'B' && !end[3]))
            mult = -1;
    }
    if (!decimal_start(v) || errno || end == v || mult < 0 || !(x > 0) || x * mult > 1e18) {
        fprintf(stderr, "--%s: '%s' is not a size such as 512M or 8G\n", name, v);
        return 2;
    }
    *out = (uint64_t)(x * mult);
    return 0;
}

int nl_args_int(const nl_flag *flags, const char *name, long long lo, long long hi, long long *out)
{
    const char *v = nl_args_get(flags, name);
    return v ? parse_ll(name, v, lo, hi, out) : 0;
}

int nl_args_double(const nl_flag *flags, const char *name, double lo, double hi, double *out)
{
    const char *v = nl_args_get(flags, name);
    return v ? parse_double(name, v, lo, hi, out) : 0;
}

int nl_args_size(const nl_flag *flags, const char *name, uint64_t *out)
{
    const char *v = nl_args_get(flags, name);
    return v ? parse_size(name, v, out) : 0;
}

/* ---- the typed table ---- */

/* The index of v in choices ("a|b|c"), or -1. */
static int choice_index(const char *choices, const char *v)
{
    size_t n = strlen(v);
    int k = 0;
    for (const char *c = choices; *c; k++) {
        const char *bar = strchr(c, '|');
        size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && strncmp(c, v, n) == 0)
            return k;
        if (!bar)
            break;
        c = bar + 1;
    }
    return -1;
}

/* choices ("a|b|c") on stderr as "a, b or c". */
static void say_choices(const char *choices)
{
    for (const char *c = choices; *c; c++) {
        if (*c != '|')
            fputc(*c, stderr);
        else
            fputs(strchr(c + 1, '|') ? ", " : " or ", stderr);
    }
}

/* v (given, or the row's default) into the row's destination: 0, or 2
 * (said). */
static int store(const nl_opt *o, const char *v)
{
    const char *name = o->flag.name;
    long long x = 0;
    double d = 0;
    uint64_t u = 0;
    int rc = 0;
    switch (o->type) {
    case NL_OPT_TYPE_STR:
        if (o->to.s)
            *o->to.s = v;
        break;
    case NL_OPT_TYPE_SWITCH:
        if (o->to.b)
            *o->to.b = true;
        break;
    case NL_OPT_TYPE_INT:
    case NL_OPT_TYPE_LLONG:
    case NL_OPT_TYPE_U64:
        if ((rc = parse_ll(name, v, o->lo, o->hi, &x)) == 0 && o->to.i) {
            if (o->type == NL_OPT_TYPE_INT)
                *o->to.i = (int)x;
            else if (o->type == NL_OPT_TYPE_LLONG)
                *o->to.ll = x;
            else
                *o->to.u = (uint64_t)x;
        }
        break;
    case NL_OPT_TYPE_DOUBLE:
        if ((rc = parse_double(name, v, o->dlo, o->dhi, &d)) == 0 && o->to.d)
            *o->to.d = d;
        break;
    case NL_OPT_TYPE_SIZE:
        if ((rc = parse_size(name, v, &u)) == 0 && o->to.u)
            *o->to.u = u;
        break;
    case NL_OPT_TYPE_CHOICE: {
        int k = choice_index(o->choices, v);
        if (k < 0) { /* "--wire fp16: not fp32 or bf16" */
            fprintf(stderr, "--%s %s: not ", name, v);
            say_choices(o->choices);
            fputc('\n', stderr);
            rc = 2;
        } else if (o->to.i) {
            *o->to.i = k;
        }
        break;
    }
    }
    return rc;
}

int nl_opts_parse(int argc, char **argv, nl_opt *opts, const char *usage, const char **pos,
                  int max_pos, int *n_pos)
{
    for (nl_opt *o = opts; o->flag.name; o++) {
        o->flag.value = NULL;
        if (o->def && store(o, o->def) != 0) {
            fprintf(stderr, "%s: --%s: the default '%s' is malformed\n", argv[0], o->flag.name,
                    o->def);
            return 2;
        }
    }
    int rc = parse_rows(argc, argv, &opts->flag, sizeof *opts, pos, max_pos, n_pos);
    if (rc == 1)
        nl_opts_help(stdout, usage, opts);
    for (nl_opt *o = opts; rc == 0 && o->flag.name; o++)
        if (o->flag.value)
            rc = store(o, o->flag.value);
    return rc;
}

void nl_opts_help(FILE *f, const char *usage, const nl_opt *opts)
{
    fprintf(f, "usage: %s\n", usage);
    for (const nl_opt *o = opts; o->flag.name; o++) {
        fprintf(f, "  --%-18s %s", o->flag.name, o->flag.help);
        if (o->def)
            fprintf(f, " (default %s)", o->def);
        fputc('\n', f);
    }
}

const char *nl_opts_get(const nl_opt *opts, const char *name)
{
    for (const nl_opt *o = opts; o->flag.name; o++)
        if (strcmp(o->flag.name, name) == 0)
            return o->flag.value;
    return NULL;
}

int nl_opts_require(const char *prog, const char *usage, const nl_opt *opts, ...)
{
    va_list ap;
    const char *name, *missing = NULL;
    va_start(ap, opts);
    while (!missing && (name = va_arg(ap, const char *)))
        if (!nl_opts_get(opts, name))
            missing = name;
    va_end(ap);
    if (!missing)
        return 0;
    fprintf(stderr, "%s: missing --%s\n\n", prog, missing);
    nl_opts_help(stderr, usage, opts);
    return 2;
}
