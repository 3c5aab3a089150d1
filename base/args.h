/* Command-line flags for neuroctl subcommands and the daemons: `--name value` and bare
 * `--switch` flags checked against a table, with typed getters that
 * refuse malformed numbers and name the flag. */
#ifndef NL_CLI_ARGS_H
#define NL_CLI_ARGS_H

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

#endif
