/* neurocoord's flags (coord_cli.h): one row a flag, then the checks that
 * join two flags. The defaults in the rows are nl_coord_opts_init's
 * (tests/test_coord_cli.c holds them together). */
#include "coordinator/coord_cli.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "base/log.h"
#include "core/plan/planner.h"
#include "net/wire.h"
#include "serve/http_flags.h"

#define USAGE                                                                                      \
    "neurocoord --listen ENDPOINT [--client-listen ENDPOINT] --state-dir DIR "                     \
    "[--model MODEL.safetensors | --config CFG.yaml | --resume MANIFEST] [--http HOST:PORT "       \
    "[--http-tokens FILE] [--http-adapter NAME=FILE,...]] [options]\n"                             \
    "Each connected node or client holds a descriptor: neurocoord raises its descriptor limit "    \
    "(RLIMIT_NOFILE) to the hard limit at start and logs how many nodes that admits (ulimit -Hn; " \
    "the node table holds 65536)."

#define MAX_FLAGS 48
#define TRAIN_ROWS 16 /* train_rows' at most */

/* Append rows (n of them) to t at *at. */
static void put_rows(nl_opt t[MAX_FLAGS], int *at, const nl_opt *rows, size_t n)
{
    memcpy(t + *at, rows, n * sizeof *rows);
    *at += (int)n;
}

/* The training jobs' rows of the table: verification, the plan's
 * replicas, the wire, growth and the jobs' files and limits. */
static void train_rows(nl_opt t[MAX_FLAGS], int *at, nl_coord_cli *cli, int *grow)
{
    nl_coord_opts *o = &cli->coord;
    const nl_opt rows[] = {
        NL_OPT_DOUBLE("verify-rate", &o->verify_rate, 0.0, 1.0, "0.05",
                      "the fraction P of a training step's (stage, microbatch)s another node "
                      "redoes and compares by digest (a node of another device class: the "
                      "tensors, within 1e-4 relative): each (stage, step) is drawn with "
                      "probability P, from a secret the nodes never see, and all its "
                      "microbatches redone, its weights sent once; a "
                      "node found wrong is banned and the job rolls back to its last checkpoint "
                      "whose steps were all verified. With --replicas a case names the replica "
                      "that ran the microbatch and a standby or the stage's other replica redoes "
                      "it; with --wire bf16 its digests are of the bf16 bytes sent; off with "
                      "--outer-every (docs/security.md, \"Catching a node that computes "
                      "wrong\"; 0: none)"),
        NL_OPT_DOUBLE("replan-margin", &o->replan_margin, 0.0, 1.0, "0.1",
                      "when a node joins (or a standby leaves) and no job runs, plan again if the "
                      "bottleneck gets better by this fraction; the stages reload from the "
                      "checkpoint or manifest served (1: never)"),
        NL_OPT_INT("rebalance-after", &o->rebalance_after, 0, INT32_MAX, "3",
                   "a training job re-balances early: once this many steps are done and every "
                   "stage has sent 3 heartbeats, the stages' measured speeds are judged, and when "
                   "a plan by them beats the current one by --replan-margin the job writes a "
                   "checkpoint there and goes on from it on the new plan; a plan kept is judged "
                   "again this many steps later, 3 times at most (0: only at the job's "
                   "checkpoints)"),
        NL_OPT_STR(
            "replicas", &cli->replicas,
            "R|R0,R1,...|auto: every pipeline stage on R nodes, microbatch i on replica i "
            "mod R, "
            "their gradients added in replica order (docs/cluster.md, \"Replicas on "
            "different nodes\"; a job's microbatches a multiple of R); auto: the R with the "
            "most training tokens/s by the cost model, for steps of --plan-microbatches (a "
            "running job's own microbatches when it plans again), each plan's all-reduce "
            "at the slowest link speed its replicas measured in their last all-reduces "
            "(1 GB/s assumed for a node that has none; a measurement that moves the "
            "plan's link by --replan-margin re-plans at the next checkpoint or at rest); "
            "neuroctl status lists every R tried and the link speed used, measured or "
            "assumed, and auto also weighs plans that give a slow stage more replicas "
            "than the others (the depth-only plan's spare nodes to the stage where a step is "
            "fastest). "
            "R0,R1,...: a plan of that many stages, stage s on Rs nodes (the fastest "
            "first), microbatch i on replica i mod Rs of each; a job's microbatches a "
            "multiple of every Rs; no node of such a plan may be --no-inbound unless all "
            "counts are equal (default 1)"),
        NL_OPT_INT("plan-microbatches", &o->plan_microbatches, 1, 1 << 20, "8",
                   "the microbatches of a training step --replicas auto plans for"),
        NL_OPT_INT("outer-every", &o->outer_every, 0, INT32_MAX, "0",
                   "H: low-communication training across the replicas (DiLoCo, DESIGN section "
                   "8): replica r of every stage is one replica group, which takes H AdamW steps "
                   "on its own microbatches (its own gradients, norm and moments); then the "
                   "groups' deltas (weights at the last sync minus weights now) are averaged in "
                   "group order and applied by an outer Nesterov SGD step (--outer-lr, "
                   "--outer-momentum). Replica traffic is divided by H. Needs --replicas 2 or "
                   "more; a training job's steps and checkpoint interval must be multiples of H, "
                   "and --resume is refused (0: the replicas add up every step's gradients)"),
        NL_OPT_DOUBLE("outer-lr", &o->outer_lr, 0.0, 10.0, "0.7",
                      "DiLoCo's outer learning rate (--outer-every; 1 with --outer-momentum 0: "
                      "the groups' weights averaged)"),
        NL_OPT_DOUBLE("outer-momentum", &o->outer_momentum, 0.0, 0.999, "0.9",
                      "DiLoCo's outer Nesterov momentum (--outer-every)"),
        NL_OPT_INT("in-flight-extra", &o->in_flight_extra, 0, 65536, "0",
                   "E: in a training step every stage but the last keeps up to E more "
                   "microbatches in flight than 1F1B does (one per stage from it to the last; "
                   "never more than the step's microbatches), so the next microbatches' hops "
                   "leave while the earlier ones' gradients are on their way back: a slow "
                   "link's round trip is not waited out (bench/bench_wan.sh). Each costs a "
                   "microbatch's activations on those stages, which the plan's memory check "
                   "counts; the results are the same bits (0: 1F1B)"),
        NL_OPT_CHOICE("wire", &o->wire, "fp32|bf16", "fp32",
                      "fp32 or bf16: the precision of the hidden states and gradients the stages "
                      "send each other (bf16: rounded to nearest even when sent, widened when "
                      "received; half the bytes)"),
        NL_OPT_CHOICE("grow", grow, "off|auto", "off",
                      "auto: the model deepens as nodes join (issue 16): at rest, or during "
                      "training right after a checkpoint, when the nodes' memory holds more "
                      "layers by the sizing rule and its hysteresis, the coordinator appends "
                      "identity layers and the stages reload on a new plan; off: the model keeps "
                      "its size unless a client grows it"),
        NL_OPT_STR("data-root", &o->data_root,
                   "a training job's data must lie under this directory (default "
                   "<state-dir>/data)"),
        NL_OPT_STR("checkpoint-root", &o->checkpoint_root,
                   "a training job's checkpoint_dir and resume must lie under this directory "
                   "(default <state-dir>/checkpoints); share it with the nodes' "
                   "--checkpoint-root"),
        NL_OPT_SIZE("max-data-bytes", &o->max_data_bytes, "1G",
                    "a training job's data file at most"),
        NL_OPT_SIZE("max-data-total", &o->max_data_total, "1G",
                    "the data files of the training and fine-tuning jobs running, together, at "
                    "most (each job holds its data's token ids in the coordinator's memory, about "
                    "4 bytes a token): a job past it is refused"),
        NL_OPT_INT("max-jobs-per-key", &o->max_jobs_per_key, 1, 64, "32",
                   "jobs one client key may hold at once (the table holds 64; the HTTP side's "
                   "completions count as one key's)"),
    };
    _Static_assert(sizeof rows / sizeof rows[0] <= TRAIN_ROWS, "TRAIN_ROWS: room for the rows");
    put_rows(t, at, rows, sizeof rows / sizeof rows[0]);
}

/* The table for cli (its rows point into it) into t. */
static void coord_flags(nl_opt t[MAX_FLAGS], nl_coord_cli *cli, int *level, int *grow)
{
    nl_coord_opts *o = &cli->coord;
    nl_http_opts *h = &cli->http;
    int at = 0;
    const nl_opt first[] = {
        NL_OPT_STR("listen", &o->listen,
                   "the nodes' endpoint, e.g. tcp://0.0.0.0:7000 (port * picks a free one); "
                   "written to <state-dir>/endpoint"),
        NL_OPT_STR("client-listen", &o->client_listen,
                   "the clients' endpoint (neuroctl, control-sized messages only; default: "
                   "--listen's port + 1, e.g. tcp://0.0.0.0:7001; * stays *); written to "
                   "<state-dir>/client_endpoint"),
        NL_OPT_STR("state-dir", &o->state_dir,
                   "keys, authorized_keys and the endpoint files live here"),
        NL_OPT_STR("model", &o->model, "checkpoint to serve (safetensors)"),
        NL_OPT_STR("config", &o->config,
                   "model config (YAML); without hidden_dim/num_layers it is sized"),
        NL_OPT_STR("resume", &o->resume,
                   "a training manifest (or its directory): serve its weights and let the next "
                   "train job continue from its step"),
        NL_OPT_U64("seed", &o->seed, 0, INT64_MAX, "0",
                   "initialisation seed when there is no checkpoint"),
        NL_OPT_INT("min-nodes", &o->min_nodes, 1, 65536, "1",
                   "plan once this many nodes have joined"),
        NL_OPT_SIZE("min-memory", &o->min_memory, NULL,
                    "... and they offer at least this much memory (default 0)"),
        NL_OPT_INT("heartbeat-ms", &o->heartbeat_ms, 10, 60000, "1000",
                   "heartbeat period told to nodes"),
        NL_OPT_INT("node-timeout-ms", &o->node_timeout_ms, 20, 3600000, "5000",
                   "a node silent this long is dead"),
        NL_OPT_INT("job-timeout-ms", &o->job_timeout_ms, 100, 86400000, "120000",
                   "a job with no progress this long fails"),
        NL_OPT_INT("gen-resumes", &o->gen_resumes, 0, 1000, "2",
                   "times a generation resumes on a new plan after losing a stage, replaying its "
                   "tokens, or after a node that served it is convicted of computing wrong (its "
                   "tokens from the first the new stages do not give again withdrawn; "
                   "docs/security.md) (0: it fails)"),
        NL_OPT_INT("train-resumes", &o->train_resumes, 0, 1000, "3",
                   "times a training job goes on by itself after losing a stage: the nodes left "
                   "re-plan, reload the last verified manifest and continue from its step (0: it "
                   "fails)"),
        NL_OPT_INT("plan-rows", &o->plan_rows, 1, 1 << 20, "512",
                   "rows (tokens) of one request the plan must fit"),
    };
    put_rows(t, &at, first, sizeof first / sizeof first[0]);
    train_rows(t, &at, cli, grow);
    const nl_opt last[] = {
        NL_OPT_STR("http", &h->addr,
                   "also serve HTTP on HOST:PORT (port 0: any free port): the OpenAI-style API, "
                   "/api/status, /api/events, /metrics and the dashboard (docs/serving.md)"),
        NL_HTTP_FLAG_ROWS(h),
        NL_OPT_STR("http-adapter", &cli->http_adapters,
                   "NAME=FILE[,NAME=FILE...]: --http also serves model NAME, the cluster's "
                   "weights with the LoRA adapter FILE (under --checkpoint-root, shared with the "
                   "nodes) applied by every stage; /v1/models lists it and a request's \"model\" "
                   "selects it; one trained on another checkpoint than --model is refused at "
                   "start (docs/serving.md)"),
        NL_OPT_CHOICE("log-level", level, NL_LOG_LEVELS, "info", "debug, info, warn, error or off"),
        NL_OPT_SWITCH("probe-inbound", &o->probe_inbound,
                      "try each joining node's data endpoint with a TCP connect (2 s): one that "
                      "does not answer is planned as a node behind NAT (neuronode join "
                      "--no-inbound): it dials its previous stage"),
        NL_OPT_STR("relay-listen", &o->relay_listen,
                   "ENDPOINT: where the relay between two neighbouring stages that both accept "
                   "no inbound connections listens, bound on first need (default: --listen's "
                   "host, a free port; the nodes dial it on the host they dial for --listen)"),
        NL_OPT_SWITCH("plaintext", &o->plaintext,
                      "INSECURE: no CURVE encryption or authentication"),
        NL_OPT_END};
    _Static_assert(sizeof first / sizeof first[0] + TRAIN_ROWS + sizeof last / sizeof last[0] <=
                       MAX_FLAGS,
                   "MAX_FLAGS: room for the rows");
    put_rows(t, &at, last, sizeof last / sizeof last[0]);
}

/* --replicas: "auto" (o->replicas 0), R (o->replicas R), or a count per
 * stage "R0,R1,..." (o->replicas -1, o->stage_replicas). -1 if it is
 * none of them. */
static int parse_replicas(const char *text, nl_coord_opts *o)
{
    if (strcmp(text, "auto") == 0) {
        o->replicas = 0;
        return 0;
    }
    int n = 0;
    for (const char *p = text;;) {
        char *end = NULL;
        errno = 0;
        const long r = strtol(p, &end, 10);
        if (!isdigit((unsigned char)*p) || errno || !(*end == '\0' || *end == ',') || r < 1 ||
            r > NL_PLAN_MAX_REPLICAS || n == NL_COORD_MAX_STAGE_LIST)
            return -1;
        o->stage_replicas[n++] = (int)r;
        if (*end == '\0')
            break;
        p = end + 1;
    }
    if (n == 1 && !strchr(text, ',')) { /* R: every stage */
        o->replicas = o->stage_replicas[0];
        return 0;
    }
    o->replicas = -1;
    o->n_stage_replicas = n;
    return 0;
}

/* The rules that join two flags: 0, or 2 (said; with help for a missing one). */
static int check(nl_coord_cli *cli, const nl_opt *t)
{
    nl_coord_opts *o = &cli->coord;
    int rc = nl_opts_require("neurocoord", USAGE, t, "listen", "state-dir", (const char *)NULL);
    if (rc)
        return rc;
    if (!!o->model + !!o->config + !!o->resume > 1) {
        fprintf(stderr, "neurocoord: give at most one of --model, --config and --resume\n\n");
        nl_opts_help(stderr, USAGE, t);
        return 2;
    }
    if (cli->http_adapters && !cli->http.addr) {
        fprintf(stderr, "--http-adapter: only with --http\n");
        return 2;
    }
    if (o->node_timeout_ms <= o->heartbeat_ms) {
        fprintf(stderr, "--node-timeout-ms must exceed --heartbeat-ms\n");
        return 2;
    }
    if (cli->replicas && parse_replicas(cli->replicas, o) != 0) {
        fprintf(stderr,
                "--replicas: '%s' is not auto, a whole number from 1 to %d, nor a list of 1 to "
                "%d of them, one a stage (2,1)\n",
                cli->replicas, NL_PLAN_MAX_REPLICAS, NL_COORD_MAX_STAGE_LIST);
        return 2;
    }
    if (o->outer_every > 0 && o->n_stage_replicas > 0) {
        fprintf(stderr,
                "--outer-every %d: DiLoCo's replica groups need as many replicas on "
                "every stage (--replicas R or auto), not a count per stage\n",
                o->outer_every);
        return 2;
    }
    /* DiLoCo's replica groups train apart between outer steps: a case's
     * weights and loss scale are its group's, which the coordinator does
     * not check yet (docs/security.md) */
    if (o->outer_every > 0 && o->verify_rate > 0) {
        fprintf(stderr,
                "neurocoord: --outer-every %d: verification by recompute is off (not yet "
                "available with DiLoCo)\n",
                o->outer_every);
        o->verify_rate = 0;
    }
    if (o->outer_every > 0 && o->replicas == 1) {
        fprintf(stderr,
                "--outer-every %d: DiLoCo needs replica groups (--replicas 2 or more, or "
                "auto)\n",
                o->outer_every);
        return 2;
    }
    /* the HTTP side's /v1 requests are jobs of one key: past
     * --max-jobs-per-key they are answered 429 (and so is a request
     * whose n choices, each a job, would pass it: nl_http_backend's
     * max_jobs) */
    cli->http.max_requests = o->max_jobs_per_key;
    return 0;
}

int nl_coord_cli_parse(nl_coord_cli *cli, int argc, char **argv)
{
    memset(cli, 0, sizeof *cli);
    nl_coord_opts_init(&cli->coord);
    int level = NL_LOG_INFO, grow = 0;
    nl_opt t[MAX_FLAGS];
    coord_flags(t, cli, &level, &grow);
    int rc = nl_opts_parse(argc, argv, t, USAGE, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    if ((rc = check(cli, t)) != 0)
        return rc;
    cli->coord.grow_auto = grow;
    nl_log_set_level((nl_log_level)level);
    return -1;
}
