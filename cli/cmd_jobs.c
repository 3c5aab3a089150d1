/* neuroctl jobs: the jobs a cluster's coordinator runs (from its status
 * JSON): id, kind, whether it runs or waits for the plan, and whether a
 * client follows it. A training job that no client follows (its client
 * ended, or the coordinator restarted and resumed it from its journal) is
 * followed again with `neuroctl train --attach JOB`. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

#include "cli/commands.h"
#include "cli/remote.h"

int nl_cmd_jobs(int argc, char **argv)
{
    nl_flag flags[] = {NL_REMOTE_FLAGS, {0}};
    const char *usage = "neuroctl jobs (--coordinator EP --key K --coordinator-key P | --cluster "
                        "DIR)";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    nl_error err = {0};
    json_t *st = NULL;
    if (nl_remote_status_once(flags, &st, &err) != NL_OK) {
        fprintf(stderr, "neuroctl jobs: %s (%s)\n", err.msg, nl_status_str(err.status));
        return 1;
    }
    const json_t *jobs = json_object_get(st, "jobs");
    printf("%-6s %-9s %-8s %s\n", "job", "kind", "state", "client");
    size_t i;
    json_t *j;
    json_array_foreach(jobs, i, j)
    {
        const char *kind = json_string_value(json_object_get(j, "kind"));
        const char *state = json_string_value(json_object_get(j, "state"));
        printf("%-6lld %-9.16s %-8.16s %s\n",
               (long long)json_integer_value(json_object_get(j, "id")), kind ? kind : "?",
               state ? state : "?",
               json_is_true(json_object_get(j, "followed")) ? "followed"
                                                            : "none (neuroctl train --attach JOB)");
    }
    if (!json_is_array(jobs) || json_array_size(jobs) == 0)
        printf("(no jobs)\n");
    json_decref(st);
    return 0;
}
