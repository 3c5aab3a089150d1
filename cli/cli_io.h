/* File helpers shared by neuroctl's commands. */
#ifndef NL_CLI_IO_H
#define NL_CLI_IO_H

#include "core/safetensors.h"

/* Read an integer tensor `name` ([B, T], I32 or I64, 1..2^24 entries, each
 * fitting int32) from an open safetensors file into a malloc'd array. */
nl_status nl_cli_read_ids(nl_st_file *f, const char *path, const char *name, int32_t **out,
                          int *B, int *T, nl_error *err);

/* The same from a file path. */
nl_status nl_cli_read_ids_file(const char *path, const char *name, int32_t **out, int *B, int *T,
                               nl_error *err);

/* "1,2,3" -> a malloc'd array of ids (--prompt-tokens). Returns the count,
 * or -1 after printing the fault to stderr. */
int nl_cli_parse_ids(const char *s, int32_t **out);

#endif
