/* Command-line flags for neuroctl subcommands and the daemons: `--name value` and bare
 * `--switch` flags checked against a table, with typed getters that
 * refuse malformed numbers and name the flag.
 *
 * Two kinds of table: nl_flag (name, help, the text given: the caller
 * reads each flag with the getters) and nl_opt, a typed table in which
 * each row also names its destination, range and default, so that one
 * table is the parse, the range checks and the --help (nl_opts_parse). */
#ifndef NL_CLI_ARGS_H
#define NL_CLI_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct nl_flag {
    const char *name;  /* without the leading "--" */
    int takes_value;   /* 0: a switch */
    const char *help;  /* one line, shown by --help */
    const char *value; /* set by nl_args_parse: the value, or "1" for a switch */
} nl_flag;

/* Parse argv[1..] (argv[0] is the subcommand). Positional arguments are
 * collected into pos (up to max_pos). Returns 0, or prints the problem to
 * stderr and returns 2 (usage error; an unknown flag comes with the closest
 * known one, nl_args_suggest); returns 1 after printing help when --help
 * is given. */
int nl_args_parse(int argc, char **argv, nl_flag *flags, const char *usage, const char **pos,
                  int max_pos, int *n_pos);
void nl_args_help(FILE *f, const char *usage, const nl_flag *flags);

/* How far a mistyped name (a flag without its "--", a command) is from a
 * known one: the edit distance when the two are close enough to suggest
 * (a typo or two, a swap counted as one; one a prefix of the other), else
 * -1. */
int nl_args_nearness(const char *given, const char *known);
/* The known flag closest to given (without its "--"), or NULL when none is
 * close: by nl_args_nearness; else one of the same first word whose help
 * names the rest (max-tokens: --max-new, "tokens to generate"); else the
 * one flag whose help names given as a word (port: --http, "HOST:PORT").
 * The result points into flags. */
const char *nl_args_suggest(const nl_flag *flags, const char *given);

const char *nl_args_get(const nl_flag *flags, const char *name);
/* Each returns 0 and sets *out (left alone when the flag is absent), or
 * prints "--name: ..." and returns 2. */
int nl_args_int(const nl_flag *flags, const char *name, long long lo, long long hi, long long *out);
int nl_args_double(const nl_flag *flags, const char *name, double lo, double hi, double *out);
/* Sizes like 512M, 8G, 1024 (bytes). */
int nl_args_size(const nl_flag *flags, const char *name, uint64_t *out);

/* ---- the typed table ---- */

typedef enum nl_opt_type {
    NL_OPT_TYPE_STR,    /* const char *: the text given */
    NL_OPT_TYPE_SWITCH, /* bool: true when given (takes no value) */
    NL_OPT_TYPE_INT,    /* int in [lo, hi] */
    NL_OPT_TYPE_LLONG,  /* long long in [lo, hi] */
    NL_OPT_TYPE_U64,    /* uint64_t in [lo, hi] (lo >= 0) */
    NL_OPT_TYPE_DOUBLE, /* double in [dlo, dhi], finite */
    NL_OPT_TYPE_SIZE,   /* uint64_t bytes: 512M, 8G, 1024 (nl_args_size) */
    NL_OPT_TYPE_CHOICE, /* int: the index of the value in choices ("fp32|bf16") */
} nl_opt_type;

/* One row. flag is first so that the untyped machinery (the parse loop,
 * nl_args_suggest) walks an nl_opt table as it walks an nl_flag one;
 * flag.value is the text given (NULL when absent). The destination is
 * the caller's; a row with none (all NULL) is only recorded in
 * flag.value. def, when set, is put into the destination first, through
 * the same parser as a given value, and --help shows it: "(default DEF)". */
typedef struct nl_opt {
    nl_flag flag;
    nl_opt_type type;
    union {
        const char **s;
        bool *b;
        int *i;
        long long *ll;
        double *d;
        uint64_t *u;
    } to;
    long long lo, hi;    /* NL_OPT_TYPE_INT, _LLONG, _U64 */
    double dlo, dhi;     /* NL_OPT_TYPE_DOUBLE */
    const char *choices; /* NL_OPT_TYPE_CHOICE: "a|b|c" */
    const char *def;
} nl_opt;

/* The rows, one a flag: name (without "--"), destination, range, default
 * (a string as on the command line; NULL: none, the destination keeps
 * what it holds), help. */
/* clang-format off */
#define NL_OPT_STR(n, p, h) {.flag = {(n), 1, (h), NULL}, .type = NL_OPT_TYPE_STR, .to.s = (p)}
#define NL_OPT_SWITCH(n, p, h)                                                                     \
    {.flag = {(n), 0, (h), NULL}, .type = NL_OPT_TYPE_SWITCH, .to.b = (p)}
#define NL_OPT_INT(n, p, lo_, hi_, def_, h)                                                            \
    {.flag = {(n), 1, (h), NULL}, .type = NL_OPT_TYPE_INT, .to.i = (p), .lo = (lo_), .hi = (hi_),       \
     .def = (def_)}
#define NL_OPT_LLONG(n, p, lo_, hi_, def_, h)                                                          \
    {.flag = {(n), 1, (h), NULL}, .type = NL_OPT_TYPE_LLONG, .to.ll = (p), .lo = (lo_), .hi = (hi_),    \
     .def = (def_)}
#define NL_OPT_U64(n, p, lo_, hi_, def_, h)                                                            \
    {.flag = {(n), 1, (h), NULL}, .type = NL_OPT_TYPE_U64, .to.u = (p), .lo = (lo_), .hi = (hi_),       \
     .def = (def_)}
#define NL_OPT_DOUBLE(n, p, lo_, hi_, def_, h)                                                         \
    {.flag = {(n), 1, (h), NULL}, .type = NL_OPT_TYPE_DOUBLE, .to.d = (p), .dlo = (lo_), .dhi = (hi_),  \
     .def = (def_)}
#define NL_OPT_SIZE(n, p, def_, h)                                                                 \
    {.flag = {(n), 1, (h), NULL}, .type = NL_OPT_TYPE_SIZE, .to.u = (p), .def = (def_)}
#define NL_OPT_CHOICE(n, p, c, def_, h)                                                            \
    {.flag = {(n), 1, (h), NULL}, .type = NL_OPT_TYPE_CHOICE, .to.i = (p), .choices = (c),         \
     .def = (def_)}
#define NL_OPT_END {.flag = {NULL, 0, NULL, NULL}}
/* clang-format on */

/* nl_args_parse over a typed table: the defaults first, then each flag
 * given is checked against its type and range and stored. Returns 0; 1
 * after printing help for --help; 2 after printing the problem (an
 * unknown flag, a missing value, "--name: 'x' is not an integer in
 * lo..hi"). */
int nl_opts_parse(int argc, char **argv, nl_opt *opts, const char *usage, const char **pos,
                  int max_pos, int *n_pos);
/* usage, then a line per flag: its help and "(default DEF)". */
void nl_opts_help(FILE *f, const char *usage, const nl_opt *opts);
/* The text given for the flag, or NULL when it was not given. */
const char *nl_opts_get(const nl_opt *opts, const char *name);
/* Every flag of the NULL-terminated list (names without "--") was given:
 * 0; else "PROG: missing --NAME", a blank line and the help on stderr, 2. */
int nl_opts_require(const char *prog, const char *usage, const nl_opt *opts, ...);

#endif
