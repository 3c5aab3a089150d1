/* coordinator/coord_cli: neurocoord's flag table. Its defaults are
 * nl_coord_opts_init's, each flag reaches its option, the rules that
 * join two flags hold, and a bad value is a usage error that names it. */
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_cli.h"
#include "net/wire.h"
#include "tests/check.h"

static int parse(nl_coord_cli *cli, char **argv)
{
    int argc = 0;
    while (argv[argc])
        argc++;
    return nl_coord_cli_parse(cli, argc, argv);
}

static void test_defaults(void)
{
    nl_coord_cli cli;
    char *argv[] = {"neurocoord", "--listen", "tcp://127.0.0.1:*", "--state-dir", "/tmp/x", NULL};
    CHECK(parse(&cli, argv) == -1, "the minimal command line runs");
    nl_coord_opts want;
    nl_coord_opts_init(&want);
    want.listen = argv[2];
    want.state_dir = argv[4];
    nl_coord_opts *o = &cli.coord;
    CHECK(o->seed == want.seed && o->min_nodes == want.min_nodes &&
              o->min_memory == want.min_memory && o->heartbeat_ms == want.heartbeat_ms &&
              o->node_timeout_ms == want.node_timeout_ms &&
              o->job_timeout_ms == want.job_timeout_ms && o->gen_resumes == want.gen_resumes &&
              o->train_resumes == want.train_resumes && o->plan_rows == want.plan_rows,
          "the table's integer defaults are nl_coord_opts_init's");
    CHECK(o->replan_margin == want.replan_margin && o->verify_rate == want.verify_rate &&
              o->rebalance_after == want.rebalance_after &&
              o->max_data_bytes == want.max_data_bytes &&
              o->max_data_total == want.max_data_total &&
              o->max_jobs_per_key == want.max_jobs_per_key && o->wire == NL_WIRE_FP32 &&
              !o->grow_auto && !o->plaintext,
          "the other defaults");
    CHECK(!cli.http.addr && !cli.http_adapters && cli.http.per_ip == 32 &&
              cli.http.deadline_s == 600 && cli.http.max_requests == want.max_jobs_per_key,
          "the HTTP side's defaults");
}

static void test_values(void)
{
    nl_coord_cli cli;
    char *argv[] = {"neurocoord",
                    "--listen",
                    "tcp://127.0.0.1:*",
                    "--state-dir",
                    "/tmp/x",
                    "--seed",
                    "9",
                    "--min-memory",
                    "2G",
                    "--heartbeat-ms",
                    "50",
                    "--node-timeout-ms",
                    "200",
                    "--replan-margin",
                    "1",
                    "--wire",
                    "bf16",
                    "--grow",
                    "auto",
                    "--max-jobs-per-key",
                    "4",
                    "--http",
                    "127.0.0.1:0",
                    "--http-adapter",
                    "a=b",
                    "--plaintext",
                    "--log-level",
                    "warn",
                    NULL};
    CHECK(parse(&cli, argv) == -1, "parse");
    nl_coord_opts *o = &cli.coord;
    CHECK(o->seed == 9 && o->min_memory == 2ull << 30 && o->heartbeat_ms == 50 &&
              o->node_timeout_ms == 200 && o->replan_margin == 1.0,
          "numbers");
    CHECK(o->wire == NL_WIRE_BF16 && o->verify_rate == 0.05, "bf16 hops keep verification on");
    CHECK(o->grow_auto && o->plaintext && o->max_jobs_per_key == 4, "grow, plaintext, jobs");
    CHECK(cli.http.addr && strcmp(cli.http.addr, "127.0.0.1:0") == 0 && cli.http_adapters &&
              strcmp(cli.http_adapters, "a=b") == 0 && cli.http.max_requests == 4,
          "http");
    nl_log_set_level(NL_LOG_INFO);
}

static void test_refusals(void)
{
    nl_coord_cli cli;
    char *nolisten[] = {"neurocoord", "--state-dir", "/tmp/x", NULL};
    CHECK(parse(&cli, nolisten) == 2, "--listen is required");
    char *two[] = {"neurocoord", "--listen", "x",        "--state-dir", "y",
                   "--model",    "m",        "--config", "c",           NULL};
    CHECK(parse(&cli, two) == 2, "--model and --config");
    char *adapter[] = {"neurocoord", "--listen",       "x",   "--state-dir",
                       "y",          "--http-adapter", "a=b", NULL};
    CHECK(parse(&cli, adapter) == 2, "--http-adapter without --http");
    char *timeout[] = {
        "neurocoord", "--listen",          "x",    "--state-dir", "y", "--heartbeat-ms",
        "1000",       "--node-timeout-ms", "1000", NULL};
    CHECK(parse(&cli, timeout) == 2, "a node timeout within the heartbeat");
    char *range[] = {"neurocoord", "--listen",           "x",  "--state-dir",
                     "y",          "--max-jobs-per-key", "65", NULL};
    CHECK(parse(&cli, range) == 2, "--max-jobs-per-key past the table");
    char *wire[] = {"neurocoord", "--listen", "x", "--state-dir", "y", "--wire", "fp16", NULL};
    CHECK(parse(&cli, wire) == 2, "--wire fp16");
    char *help[] = {"neurocoord", "--help", NULL};
    CHECK(parse(&cli, help) == 0, "--help exits 0");
}

/* Verification by recompute stays on with replicas and the bf16 wire
 * (both verified); DiLoCo's replica groups turn it off. */
static void test_verify_rules(void)
{
    nl_coord_cli cli;
    nl_log_set_level(NL_LOG_ERROR);
    char *reps[] = {"neurocoord", "--listen", "x",      "--state-dir", "y",
                    "--replicas", "2",        "--wire", "bf16",        NULL};
    CHECK(parse(&cli, reps) == -1 && cli.coord.verify_rate == 0.05,
          "replicas and bf16 keep verification on");
    char *diloco[] = {"neurocoord", "--listen",      "x", "--state-dir", "y", "--replicas",
                      "2",          "--outer-every", "5", NULL};
    CHECK(parse(&cli, diloco) == -1 && cli.coord.verify_rate == 0, "DiLoCo turns verification off");
    nl_log_set_level(NL_LOG_INFO);
}

int main(void)
{
    test_defaults();
    test_values();
    test_verify_rules();
    test_refusals();
    return check_done("test_coord_cli");
}
