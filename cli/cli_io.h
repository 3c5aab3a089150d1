/* File helpers and the generation clock shared by neuroctl's commands. */
#ifndef NL_CLI_IO_H
#define NL_CLI_IO_H

#include "core/safetensors.h"

/* Read an integer tensor `name` ([B, T], I32 or I64, 1..2^24 entries, each
 * fitting int32) from an open safetensors file into a malloc'd array. */
nl_status nl_cli_read_ids(nl_st_file *f, const char *path, const char *name, int32_t **out, int *B,
                          int *T, nl_error *err);

/* The same from a file path. */
nl_status nl_cli_read_ids_file(const char *path, const char *name, int32_t **out, int *B, int *T,
                               nl_error *err);

/* "1,2,3" -> a malloc'd array of ids (--prompt-tokens). Returns the count,
 * or -1 after printing the fault to stderr. */
int nl_cli_parse_ids(const char *s, int32_t **out);

/* Seconds on the monotonic clock. */
double nl_cli_now(void);

/* The pace of a generation, as its tokens come: nl_gen_clock_start when
 * the prompt is submitted, nl_gen_clock_tick per token; the report (on
 * stderr) gives the time to the first token (prefill) and the decode rate
 * after it:
 *   generate: 129 tokens: first after 12.3 ms, then 128 in 180.2 ms (710.3 tokens/s) */
typedef struct nl_gen_clock {
    double start, first, last;
    int count;
} nl_gen_clock;

void nl_gen_clock_start(nl_gen_clock *c);
void nl_gen_clock_tick(nl_gen_clock *c);
void nl_gen_clock_report(const nl_gen_clock *c);

#endif
