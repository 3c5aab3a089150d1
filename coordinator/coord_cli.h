/* neurocoord's command line: its flags as one table (parse, ranges,
 * defaults and --help: base/args.h's nl_opt) filling the coordinator's
 * options and its HTTP side's. In the library so that main.c stays the
 * process's signals, descriptors and the run. */
#ifndef NL_COORD_CLI_H
#define NL_COORD_CLI_H

#include "coordinator/coord.h"
#include "serve/http.h"

typedef struct nl_coord_cli {
    nl_coord_opts coord;
    nl_http_opts http;         /* http.addr NULL: no --http */
    const char *http_adapters; /* --http-adapter NAME=FILE[,...], or NULL */
    const char *replicas;      /* --replicas R|auto as given (coord.replicas: R, 0 auto) */
} nl_coord_cli;

/* Parse argv into cli (which borrows argv's strings) and apply
 * --log-level. Returns -1 to run; otherwise the exit code, the reason
 * printed: 0 after --help, 2 for a usage error. */
int nl_coord_cli_parse(nl_coord_cli *cli, int argc, char **argv);

#endif
