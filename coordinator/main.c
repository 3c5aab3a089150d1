/* neurocoord: the coordinator daemon. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "base/args.h"
#include "base/log.h"
#include "coord.h"
#include "core/planner.h"
#include "coord_http.h"
#include "core/fileio.h"
#include "net/auth.h"
#include "net/wire.h"

static volatile sig_atomic_t stop_flag;

/* SIGINT, SIGTERM: stop (the nodes wait for a restart); SIGUSR2: take
 * the cluster down, the nodes with it (neuroctl cluster down). */
static void on_stop(int sig)
{
    stop_flag = sig == SIGUSR2 || stop_flag == NL_COORD_STOP_NODES ? NL_COORD_STOP_NODES : 1;
}

/* Every node holds one descriptor (its connection): raise the soft limit
 * to the hard one and say how many nodes that admits. */
static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    const rlim_t was = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (rl.rlim_cur != was && setrlimit(RLIMIT_NOFILE, &rl) != 0)
        rl.rlim_cur = was;
    const long long fds = rl.rlim_cur == RLIM_INFINITY ? 1 << 20 : (long long)rl.rlim_cur;
    const long long nodes = fds - 128 < 65536 ? fds - 128 : 65536;
    NL_INFO("descriptors: %lld (hard limit %lld): room for about %lld nodes and clients at once "
            "(a connection each; the node table holds 65536)",
            fds, rl.rlim_max == RLIM_INFINITY ? -1 : (long long)rl.rlim_max, nodes > 0 ? nodes : 0);
}

/* What /v1/models lists: the file served, or "cluster". */
static const char *model_name(const nl_coord_opts *o)
{
    const char *p = o->model ? o->model : o->resume;
    const char *slash = p ? strrchr(p, '/') : NULL;
    return p ? (slash && slash[1] ? slash + 1 : p) : "cluster";
}

/* neurocoord's flags (main parses them once). */
static nl_flag flags[] = {
    {"listen", 1,
     "the nodes' endpoint, e.g. tcp://0.0.0.0:7000 (port * picks a free one); written to "
     "<state-dir>/endpoint",
     NULL},
    {"client-listen", 1,
     "the clients' endpoint (neuroctl, control-sized messages only; default: --listen's port "
     "+ 1, e.g. tcp://0.0.0.0:7001; * stays *); written to <state-dir>/client_endpoint",
     NULL},
    {"state-dir", 1, "keys, authorized_keys and the endpoint files live here", NULL},
    {"model", 1, "checkpoint to serve (safetensors)", NULL},
    {"config", 1, "model config (YAML); without hidden_dim/num_layers it is sized", NULL},
    {"resume", 1,
     "a training manifest (or its directory): serve its weights and let the next train job "
     "continue from its step",
     NULL},
    {"seed", 1, "initialisation seed when there is no checkpoint (default 0)", NULL},
    {"min-nodes", 1, "plan once this many nodes have joined (default 1)", NULL},
    {"min-memory", 1, "... and they offer at least this much memory (default 0)", NULL},
    {"heartbeat-ms", 1, "heartbeat period told to nodes (default 1000)", NULL},
    {"node-timeout-ms", 1, "a node silent this long is dead (default 5000)", NULL},
    {"job-timeout-ms", 1, "a job with no progress this long fails (default 120000)", NULL},
    {"gen-resumes", 1,
     "times a generation resumes on a new plan after losing a stage, replaying its tokens "
     "(default 2; 0: it fails)",
     NULL},
    {"train-resumes", 1,
     "times a training job goes on by itself after losing a stage: the nodes left re-plan, "
     "reload the last verified manifest and continue from its step (default 3; 0: it fails)",
     NULL},
    {"plan-rows", 1, "rows (tokens) of one request the plan must fit (default 512)", NULL},
    {"verify-rate", 1,
     "the fraction P of a training step's (stage, microbatch)s another node redoes and "
     "compares by digest, drawn from a secret the nodes never see (docs/security.md, "
     "\"Catching a node that computes wrong\"; default 0.05; 0: none)",
     NULL},
    {"replan-margin", 1,
     "when a node joins (or a standby leaves) and no job runs, plan again if the bottleneck "
     "gets better by this fraction; the stages reload from the checkpoint or manifest served "
     "(default 0.1; 1: never)",
     NULL},
    {"rebalance-after", 1,
     "a training job re-balances early: once this many steps are done and every stage has "
     "sent 3 heartbeats, the stages' measured speeds are judged, and when a plan by them "
     "beats the current one by --replan-margin the job writes a checkpoint there and goes on "
     "from it on the new plan (default 3; 0: only at the job's checkpoints)",
     NULL},
    {"replicas", 1,
     "R: every pipeline stage runs on R nodes (DESIGN section 8): microbatch i of a step on "
     "replica i mod R, the replicas' gradients added in replica order over their data "
     "sockets before the norm and AdamW; the nodes are grouped by speed, R to a group, and "
     "the groups planned as stages (nodes left over stay standby); replica 0 writes the "
     "stage's shard. A training job's microbatches must be a multiple of R; verification by "
     "recompute is off. auto: the R (1 to 16, dividing --plan-microbatches) whose plan gives "
     "the most training tokens/s by the cost model: the pipeline's fill, each stage's time "
     "over its replicas, the ring all-reduce of the largest stage's gradients at 1 GB/s "
     "(default 1: one node a stage)",
     NULL},
    {"plan-microbatches", 1,
     "the microbatches of a training step --replicas auto plans for (default 8)", NULL},
    {"wire", 1,
     "fp32 (default) or bf16: the precision of the hidden states and gradients the stages "
     "send each other (bf16: rounded to nearest even when sent, widened when received; half "
     "the bytes; verification by recompute is off with bf16)",
     NULL},
    {"grow", 1,
     "auto: the model deepens as nodes join (issue 16): at rest, or during training right "
     "after a checkpoint, when the nodes' memory holds more layers by the sizing rule and its "
     "hysteresis, the coordinator appends identity layers and the stages reload on a new "
     "plan; off (default): the model keeps its size unless a client grows it",
     NULL},
    {"data-root", 1,
     "a training job's data must lie under this directory (default <state-dir>/data)", NULL},
    {"checkpoint-root", 1,
     "a training job's checkpoint_dir and resume must lie under this directory (default "
     "<state-dir>/checkpoints); share it with the nodes' --checkpoint-root",
     NULL},
    {"max-data-bytes", 1, "a training job's data file at most (default 1G)", NULL},
    {"max-data-total", 1,
     "the data files of the training and fine-tuning jobs running, together, at most (each "
     "job holds its data's token ids in the coordinator's memory, about 4 bytes a token; "
     "default 1G): a job past it is refused",
     NULL},
    {"max-jobs-per-key", 1,
     "jobs one client key may hold at once (default 32; the table holds 64; the HTTP side's "
     "completions count as one key's)",
     NULL},
    {"http", 1,
     "also serve HTTP on HOST:PORT (port 0: any free port): the OpenAI-style API, "
     "/api/status, /api/events, /metrics and the dashboard (docs/serving.md)",
     NULL},
    {"http-tokens", 1, "file of bearer tokens for --http, one a line (required off loopback)",
     NULL},
    {"http-per-ip", 1, "connections one client address may hold at once (default 32)", NULL},
    {"http-deadline", 1,
     "seconds a non-streaming completion may take: then it is cancelled and answered 504 "
     "(default 600)",
     NULL},
    {"http-allow-host", 1,
     "NAME[,NAME...]: without tokens, Host names a request may carry besides localhost and "
     "IP addresses (others are refused 403: a web page cannot reach the API by DNS rebinding)",
     NULL},
    {"http-adapter", 1,
     "NAME=FILE[,NAME=FILE...]: --http also serves model NAME, the cluster's weights with "
     "the LoRA adapter FILE (under --checkpoint-root, shared with the nodes) applied by every "
     "stage; /v1/models lists it and a request's \"model\" selects it (docs/serving.md)",
     NULL},
    {"log-level", 1, "debug, info, warn or error (default info)", NULL},
    {"plaintext", 0, "INSECURE: no CURVE encryption or authentication", NULL},
    {0}};

/* The numeric flags into o; 0, or the exit code (the message printed). */
static int numbers(nl_coord_opts *o)
{
    long long seed = 0, min_nodes = 1, hb = 1000, nto = 5000, jto = 120000, rows = 512, resumes = 2,
              train_resumes = 3, jobs_per_key = 32, rebalance_after = 3, replicas = 1,
              plan_micro = 8;
    const char *rv = nl_args_get(flags, "replicas");
    const bool auto_r = rv && strcmp(rv, "auto") == 0;
    uint64_t min_mem = 0, max_data = 1ull << 30, max_total = 1ull << 30;
    double margin = 0.1;
    int rc;
    if ((rc = nl_args_int(flags, "seed", 0, INT64_MAX, &seed)) ||
        (rc = nl_args_int(flags, "min-nodes", 1, 65536, &min_nodes)) ||
        (rc = nl_args_int(flags, "heartbeat-ms", 10, 60000, &hb)) ||
        (rc = nl_args_int(flags, "node-timeout-ms", 20, 3600000, &nto)) ||
        (rc = nl_args_int(flags, "job-timeout-ms", 100, 86400000, &jto)) ||
        (rc = nl_args_int(flags, "gen-resumes", 0, 1000, &resumes)) ||
        (rc = nl_args_int(flags, "train-resumes", 0, 1000, &train_resumes)) ||
        (rc = nl_args_int(flags, "rebalance-after", 0, INT32_MAX, &rebalance_after)) ||
        (!auto_r && (rc = nl_args_int(flags, "replicas", 1, NL_PLAN_MAX_REPLICAS, &replicas))) ||
        (rc = nl_args_int(flags, "plan-microbatches", 1, 1 << 20, &plan_micro)) ||
        (rc = nl_args_int(flags, "plan-rows", 1, 1 << 20, &rows)) ||
        (rc = nl_args_int(flags, "max-jobs-per-key", 1, 64, &jobs_per_key)) ||
        (rc = nl_args_size(flags, "min-memory", &min_mem)) ||
        (rc = nl_args_size(flags, "max-data-bytes", &max_data)) ||
        (rc = nl_args_size(flags, "max-data-total", &max_total)) ||
        (rc = nl_args_double(flags, "replan-margin", 0.0, 1.0, &margin)) ||
        (rc = nl_args_double(flags, "verify-rate", 0.0, 1.0, &o->verify_rate)))
        return rc;
    if (nto <= hb) {
        fprintf(stderr, "--node-timeout-ms must exceed --heartbeat-ms\n");
        return 2;
    }
    o->seed = (uint64_t)seed;
    o->min_nodes = (int)min_nodes;
    o->min_memory = min_mem;
    o->max_data_bytes = max_data;
    o->max_data_total = max_total;
    o->heartbeat_ms = (int)hb;
    o->node_timeout_ms = (int)nto;
    o->job_timeout_ms = (int)jto;
    o->gen_resumes = (int)resumes;
    o->train_resumes = (int)train_resumes;
    o->plan_rows = (int)rows;
    o->max_jobs_per_key = (int)jobs_per_key;
    o->replan_margin = margin;
    o->rebalance_after = (int)rebalance_after;
    o->replicas = auto_r ? 0 : (int)replicas;
    o->plan_microbatches = (int)plan_micro;
    const char *wire = nl_args_get(flags, "wire");
    nl_wire_precision wp = NL_WIRE_FP32;
    if (wire && nl_wire_precision_parse(wire, &wp) != 0) {
        fprintf(stderr, "--wire: '%s' is not fp32 or bf16\n", wire);
        return 2;
    }
    o->wire = (int)wp;
    /* the verifier's digests are of FP32 tensors: with bf16 hops a stage's
     * reported digests are of other bytes, and honest nodes would be
     * convicted (docs/security.md) */
    if (o->wire != NL_WIRE_FP32 && o->verify_rate > 0) {
        fprintf(stderr, "neurocoord: --wire bf16: verification by recompute is off (not yet "
                        "available with bf16 hops; docs/security.md)\n");
        o->verify_rate = 0;
    }
    /* a verification case is kept by the replica that ran the microbatch,
     * which the coordinator does not ask yet */
    if (o->replicas != 1 && o->verify_rate > 0) {
        fprintf(stderr, "neurocoord: --replicas %s: verification by recompute is off (not yet "
                        "available with replicas)\n",
                rv);
        o->verify_rate = 0;
    }
    return 0;
}

/* The HTTP side's options (--http): its /v1 requests are jobs of one key,
 * so past --max-jobs-per-key they are answered 429. 0, or the exit code. */
static int http_opts(nl_http_opts *ho, const nl_coord_opts *o)
{
    long long per_ip = 32, deadline = 600;
    int rc;
    if ((rc = nl_args_int(flags, "http-per-ip", 1, 65536, &per_ip)) ||
        (rc = nl_args_int(flags, "http-deadline", 1, 86400 * 7, &deadline)))
        return rc;
    *ho = (nl_http_opts){.addr = nl_args_get(flags, "http"),
                         .tokens_path = nl_args_get(flags, "http-tokens"),
                         .max_requests = o->max_jobs_per_key,
                         .per_ip = (int)per_ip,
                         .deadline_s = (int)deadline,
                         .allow_hosts = nl_args_get(flags, "http-allow-host")};
    return 0;
}

int main(int argc, char **argv)
{
    const char *usage = "neurocoord --listen ENDPOINT [--client-listen ENDPOINT] --state-dir DIR "
                        "[--model MODEL.safetensors | "
                        "--config CFG.yaml | --resume MANIFEST] [--http HOST:PORT "
                        "[--http-tokens FILE] [--http-adapter NAME=FILE,...]] [options]\n"
                        "Each connected node or client holds a descriptor: neurocoord raises its "
                        "descriptor limit (RLIMIT_NOFILE) to the hard limit at start and logs how "
                        "many nodes that admits (ulimit -Hn; the node table holds 65536).";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    if (nl_args_get(flags, "http-adapter") && !nl_args_get(flags, "http")) {
        fprintf(stderr, "--http-adapter: only with --http\n");
        return 2;
    }
    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = nl_args_get(flags, "listen");
    o.client_listen = nl_args_get(flags, "client-listen");
    o.state_dir = nl_args_get(flags, "state-dir");
    o.model = nl_args_get(flags, "model");
    o.config = nl_args_get(flags, "config");
    o.resume = nl_args_get(flags, "resume");
    o.plaintext = nl_args_get(flags, "plaintext") != NULL;
    o.data_root = nl_args_get(flags, "data-root");
    o.checkpoint_root = nl_args_get(flags, "checkpoint-root");
    if (!o.listen || !o.state_dir || (!!o.model + !!o.config + !!o.resume > 1)) {
        if (!o.listen || !o.state_dir)
            fprintf(stderr, "neurocoord: missing --%s\n\n", !o.listen ? "listen" : "state-dir");
        else
            fprintf(stderr, "neurocoord: give at most one of --model, --config and --resume\n\n");
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if ((rc = numbers(&o)) != 0)
        return rc;
    const char *lvl = nl_args_get(flags, "log-level");
    if (lvl) {
        int l = nl_log_parse_level(lvl);
        if (l < 0) {
            fprintf(stderr, "--log-level: '%s' is not debug, info, warn or error\n", lvl);
            return 2;
        }
        nl_log_set_level((nl_log_level)l);
    }
    const char *grow = nl_args_get(flags, "grow");
    if (grow && strcmp(grow, "auto") != 0 && strcmp(grow, "off") != 0) {
        fprintf(stderr, "--grow: '%s' is not auto or off\n", grow);
        return 2;
    }
    o.grow_auto = grow && strcmp(grow, "auto") == 0;
    nl_log_set_name("coord");
    raise_nofile();
    if (o.plaintext)
        NL_WARN("--plaintext: the nodes' and clients' sockets are neither encrypted nor "
                "authenticated");
    mkdir(o.state_dir, 0700);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR2, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    nl_error err = {0};
    nl_coord *c = NULL;
    nl_coord_http *web = NULL;
    const char *http = nl_args_get(flags, "http");
    nl_http_opts ho;
    if (http && (rc = http_opts(&ho, &o)) != 0)
        return rc;
    rc = 0;
    if (nl_auth_hup_install(&err) != NL_OK || nl_coord_new(&c, &o, &err) != NL_OK ||
        (http && nl_coord_http_start(&web, c, model_name(&o), nl_args_get(flags, "http-adapter"),
                                     o.state_dir, o.plaintext, &ho, &err) != NL_OK))
        rc = 1;
    if (rc == 0 && web) { /* say where, and keep it in STATE_DIR/http for cluster up */
        const char *colon = strrchr(http, ':');
        char url[300], path[4096];
        int n = snprintf(url, sizeof url, "http://%.*s:%d/\n", (int)(colon ? colon - http : 0),
                         http, nl_coord_http_port(web));
        snprintf(path, sizeof path, "%s/http", o.state_dir);
        NL_INFO("HTTP on %.*s", n - 1, url);
        if (nl_file_write_atomic(path, url, (size_t)n, &err) != NL_OK)
            NL_WARN("%s", err.msg);
    }
    if (rc == 0 && nl_coord_run(c, &stop_flag, &err) != NL_OK)
        rc = 1;
    if (rc)
        NL_ERROR("%s (%s)", err.msg, nl_status_str(err.status));
    nl_coord_http_stop(&web);
    nl_coord_destroy(&c);
    return rc;
}
