/* neuroctl: the client. Local single-process tools for now. */
#include <stdio.h>
#include <string.h>

#include "commands.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: neuroctl COMMAND [options]\n");
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "keygen") == 0)
        return nl_cmd_keygen(argc - 1, argv + 1);
    fprintf(stderr, "neuroctl: unknown command '%s'\n", argv[1]);
    return 2;
}
