/* neuronode's command line (node/node.h, nl_node_cli): the flags of
 * `neuronode join`, their --help, the node's identity (--key or the state
 * dir's node.key) and the options nl_node_run takes. In the library so
 * that main.c stays the process's signals and nothing else. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/args.h"
#include "base/log.h"
#include "core/model/kvcache.h"
#include "kernels/backend.h"
#include "net/keys.h"
#include "node/node.h"
#include "node/stage.h"

#define USAGE                                                                                      \
    "neuronode join ENDPOINT --key NODE.key --coordinator-key COORD.pub [--device D] "             \
    "[--memory SIZE] [flags]"

static void help(FILE *f, const nl_opt *flags)
{
    nl_opts_help(f, USAGE, flags);
    fprintf(f,
            "\nJoins the coordinator at ENDPOINT (its --listen, e.g. tcp://host:7000; clients use\n"
            "its --client-listen) and serves the layers it assigns until SIGINT or SIGTERM,\n"
            "then sends LEAVE and exits 0. Sizes take K, M, G or T suffixes (powers of\n"
            "1024). Without --key, --state-dir/node.key is used\n"
            "(created on first start). On the CPU (cpu, cpu-devsim) --memory is required; a\n"
            "GPU (cuda:N) offers its free memory once the backend is up, less --reserve, and\n"
            "--memory, when given, caps that. A device that cannot be opened (no CUDA driver\n"
            "or device, no CUDA backend in this build) or that fails while serving ends the\n"
            "node with status 1 and the device's error. A device whose backend cannot\n"
            "train refuses training jobs; each fails with that reason.\n"
            "\n"
            "Several devices (--device cuda:0,1,... or cpu,cpu for tests) run the stage as\n"
            "data-parallel replicas in this process: each device holds a whole copy of the\n"
            "stage; a training step's microbatches are shared among them (microbatch i on\n"
            "replica i mod R), their gradients are summed (NCCL between GPUs, through the\n"
            "host otherwise) before the norm and AdamW, and every replica applies the same\n"
            "update. Inference runs on the first device. The node offers the smallest\n"
            "replica's memory (on the CPU, --memory is each replica's) and reports the first\n"
            "device's throughput. Every device is opened at the start: one that is missing\n"
            "ends the node (status 1) naming it. NCCL stays inside this process; stages on\n"
            "other machines are reached over ZeroMQ with CURVE only (docs/cluster.md).\n"
            "\n"
            "Checkpoint shards are written only under --checkpoint-root (resolved, links\n"
            "followed, so a link inside it cannot lead out), by default <state-dir>/checkpoints;\n"
            "a node with neither refuses checkpoint requests. Files are 0600, directories 0700.\n"
            "\n"
            "Behind NAT or a firewall (--no-inbound) the node still binds --listen but expects\n"
            "no one to connect: the coordinator has it dial its previous stage's data\n"
            "endpoint (CURVE, that stage's key pinned) and sends that stage's hops, and its\n"
            "gradients back, over that connection; the control connection is dialed by the\n"
            "node already. Two neighbouring stages that both accept no inbound connections\n"
            "both dial the coordinator's relay (neurocoord --relay-listen), on the host they\n"
            "dial for control, which passes their messages (docs/cluster.md).\n"
            "Exit status: 0 stopped, 1 failed, 2 usage error.\n");
#ifdef NL_TEST_HOOKS
    fprintf(f, "This is a test build: NL_TEST_INJECT_NAN_STEP=K (K+: from K on) and\n"
               "NL_TEST_INJECT_NAN_STAGE=S put a NaN into the gradient of step K on stage S.\n"
               "NL_TEST_LIE=KIND:Q[:SEED[:FROM]] makes the stage falsify a fraction Q of its\n"
               "training outputs from step FROM on (KIND: bitflip, noise, stale, skip, backward)\n"
               "or, KIND verifier, of its answers as a verifier (mute: it withholds its cases);\n"
               "NL_TEST_LIE_NODE=NAME:\n"
               "only on the node of that --name; NL_TEST_LIE_GEN=1: in its generation hops too\n"
               "(docs/security.md). NL_TEST_COMPUTE_GFLOPS=G makes each training hop's work\n"
               "sleep for its FLOPs' time at G GFLOP/s when it runs instead of computing (its\n"
               "outputs zero; bench/bench_replicas.sh). NL_TEST_LINK_BYTES_S=X reports the\n"
               "replicas' gradient all-reduce as run at X bytes/s (the link speed the\n"
               "coordinator's --replicas auto plans with; docs/cluster.md).\n"
               "NL_TEST_SLOW_MS=X and NL_TEST_SLOW_X=F make each training message take X ms\n"
               "more, or F times its work (CPU time spinning: a node slower than it said).\n"
               "NL_TEST_LOCAL_BREAK_AFTER=K ends the previous stage's local link after the K-th\n"
               "training hop taken on it, as a link that broke (docs/cluster.md).\n");
#endif
}

/* The node's identity: --key FILE, or <state-dir>/node.key (created when
 * absent), or with --plaintext and neither, a throwaway key for the JOIN. */
static int load_identity(const char *key, const char *state_dir, bool plaintext, nl_keypair *kp)
{
    nl_error err;
    char path[1024];
    if (!key && state_dir) {
        if (mkdir(state_dir, 0700) != 0 && errno != EEXIST) {
            fprintf(stderr, "neuronode: --state-dir %s: %s\n", state_dir, strerror(errno));
            return 1;
        }
        if (nl_keys_check_trusted(state_dir, &err) != NL_OK) {
            fprintf(stderr, "neuronode: --state-dir: %s\n", err.msg);
            return 1;
        }
        snprintf(path, sizeof path, "%s/node.key", state_dir);
        struct stat sb;
        if (stat(path, &sb) != 0) {
            char prefix[1024];
            snprintf(prefix, sizeof prefix, "%s/node", state_dir);
            if (nl_keys_generate(kp, &err) != NL_OK ||
                nl_keys_save(kp, prefix, false, &err) != NL_OK) {
                fprintf(stderr, "neuronode: %s\n", err.msg);
                return 1;
            }
            NL_INFO("created the node key %s (public key in %s/node.pub)", path, state_dir);
            return 0;
        }
        key = path;
    }
    if (!key && plaintext)
        return nl_keys_generate(kp, &err) == NL_OK ? 0 : 1;
    if (!key) {
        fprintf(stderr, "neuronode: --key NODE.key is required (or --state-dir; see "
                        "`neuroctl keygen`)\n");
        return 2;
    }
    if (nl_keys_load_secret(kp, key, &err) != NL_OK) {
        fprintf(stderr, "neuronode: --key: %s\n", err.msg);
        return 1;
    }
    return 0;
}

#ifdef NL_TEST_HOOKS
/* Test hook NL_TEST_LIE=KIND:Q[:SEED[:FROM]]: the stage lies on a fraction
 * Q of its work from training step FROM on (node/stage_train_lie.c);
 * NL_TEST_LIE_NODE=NAME: only the node of that --name. 0, or 2 (usage) for a malformed value. */
static int read_lie(nl_node_opts *o)
{
    const char *lie = getenv("NL_TEST_LIE");
    if (!lie)
        return 0;
    char kind[16] = "";
    double q = 0;
    unsigned long long seed = 1, from = 0;
    int k = sscanf(lie, "%15[a-z]:%lf:%llu:%llu", kind, &q, &seed, &from);
    if (k < 2 || nl_stage_lie_kind(kind) < 0 || !(q >= 0 && q <= 1)) {
        fprintf(stderr,
                "neuronode: NL_TEST_LIE=%s: expected KIND:Q[:SEED[:FROM]], KIND one of "
                "bitflip, noise, stale, skip, backward, verifier, mute, Q in [0, 1]\n",
                lie);
        return 2;
    }
    const char *who = getenv("NL_TEST_LIE_NODE");
    if (!who || (o->name && strcmp(who, o->name) == 0)) {
        o->inject_lie_kind = nl_stage_lie_kind(kind);
        o->inject_lie_rate = q;
        o->inject_lie_seed = seed;
        o->inject_lie_from = from;
        const char *gen = getenv("NL_TEST_LIE_GEN");
        o->inject_lie_gen = gen && strcmp(gen, "1") == 0;
    }
    return 0;
}
#endif

#ifdef NL_TEST_HOOKS
/* The test hooks (test builds only: -DNL_TEST_HOOKS=ON; a production
 * neuronode reads none of these variables):
 * NL_TEST_INJECT_NAN_STEP=K puts a NaN into the gradient of step index
 * K (0-based, as neuroctl train's hook), "K+" into every step from K
 * on, on the stage NL_TEST_INJECT_NAN_STAGE (default: every stage); the
 * others below. Returns 0, or 2 (said). */
static int read_test_hooks(nl_node_opts *o)
{
    const char *nan_step = getenv("NL_TEST_INJECT_NAN_STEP"),
               *nan_stage = getenv("NL_TEST_INJECT_NAN_STAGE");
    o->inject_nan_step = nan_step ? atoll(nan_step) + 1 : 0;
    o->inject_nan_on = nan_step && strchr(nan_step, '+') != NULL;
    o->inject_nan_stage = nan_stage ? atoi(nan_stage) : -1;
    if (read_lie(o) != 0)
        return 2;
    /* NL_TEST_DEVICE_FAIL=K makes the device's K-th check fail (the first
     * is after the throughput probe, the second after LOAD_DONE) */
    const char *dev_fail = getenv("NL_TEST_DEVICE_FAIL");
    o->inject_device_fail = dev_fail ? atoi(dev_fail) : 0;
    /* NL_TEST_GFLOPS=X reports X GFLOP/s instead of the probe's figure, so
     * a test's plan does not depend on a noisy measurement */
    const char *gflops = getenv("NL_TEST_GFLOPS");
    o->inject_gflops = gflops ? atof(gflops) : 0.0;
    /* NL_TEST_SLOW_MS=X makes each training message take X ms
     * more work (CPU time spinning, as the busy time is counted; the
     * coordinator's observed stage times re-balance the plan) */
    const char *slow = getenv("NL_TEST_SLOW_MS");
    o->inject_slow_ms = slow ? atof(slow) : 0.0;
    /* NL_TEST_SLOW_X=F: each training message takes F times the work it
     * did (as above; a fixed X ms is a small part of a message's work in a
     * sanitizer build, where the same F makes the same slower node) */
    const char *slow_x = getenv("NL_TEST_SLOW_X");
    o->inject_slow_x = slow_x ? atof(slow_x) : 0.0;
    /* NL_TEST_COMPUTE_GFLOPS=G: each training hop's work sleeps for the
     * time its FLOPs take at G GFLOP/s when it runs, instead of computing
     * (a compute model: nodes that share a machine's cores each get a
     * device of that speed) */
    const char *cg = getenv("NL_TEST_COMPUTE_GFLOPS");
    o->inject_compute_gflops = cg ? atof(cg) : 0.0;
    /* NL_TEST_LINK_BYTES_S=X: the node reports its replicas' gradient
     * all-reduce as having run at X bytes/s instead of the time it took
     * (the coordinator's --replicas auto plans with it; a test's choice
     * does not depend on how busy the machine is) */
    const char *link = getenv("NL_TEST_LINK_BYTES_S");
    o->inject_link_bytes_s = link ? atof(link) : 0.0;
    /* NL_TEST_SLOW_HOP_MS=X makes each batch of session hops
     * (generation) wait X ms first */
    const char *slow_hop = getenv("NL_TEST_SLOW_HOP_MS");
    o->inject_slow_hop_ms = slow_hop ? atof(slow_hop) : 0.0;
    /* NL_TEST_DEVICE_NO_TRAIN=1 makes the device one that cannot train */
    o->inject_no_train = getenv("NL_TEST_DEVICE_NO_TRAIN") != NULL;
    /* NL_TEST_LOCAL_BREAK_AFTER=K: after the K-th training hop it took
     * from the previous stage's local link, the node ends that link as
     * one that broke (the hops after it go on ZeroMQ) */
    const char *lk_break = getenv("NL_TEST_LOCAL_BREAK_AFTER");
    o->inject_local_break = lk_break ? (unsigned)atoi(lk_break) : 0;
    /* NL_TEST_DEVICE_MEM=FREE,TOTAL (MiB) gives the device a GPU's memory
     * report, so the offer's arithmetic runs without a GPU */
    const char *mem = getenv("NL_TEST_DEVICE_MEM");
    unsigned long long mfree = 0, mtotal = 0;
    if (mem && sscanf(mem, "%llu,%llu", &mfree, &mtotal) == 2) {
        o->inject_mem_free = mfree << 20;
        o->inject_mem_total = mtotal << 20;
    }
    return 0;
}
#endif

/* What the flags give besides nl_node_opts: the identity, the log level
 * and the values nl_node_opts holds in another unit. */
typedef struct node_args {
    const char *key, *coord_key, *state_dir;
    bool tf32;
    int level, batch_wait_ms;
    double connect_s;
} node_args;

#define MAX_FLAGS 32

/* neuronode join's flags: one row a flag, into t. */
static void node_flags(nl_opt t[MAX_FLAGS], nl_node_opts *o, node_args *a)
{
    const nl_opt rows[] = {
        NL_OPT_STR("key", &a->key, "FILE: this node's secret key (neuroctl keygen)"),
        NL_OPT_STR("coordinator-key", &a->coord_key,
                   "FILE: the coordinator's public key (coordinator.pub)"),
        NL_OPT_SIZE("memory", &o->memory_bytes, NULL,
                    "SIZE: memory offered for weights, activations and caches (e.g. 8G); "
                    "required on the CPU; on a GPU it caps the device's free memory offered"),
        NL_OPT_STR("state-dir", &a->state_dir, "DIR: holds node.key when --key is not given"),
        NL_OPT_INT("threads", &o->threads, 0, 4096, NULL,
                   "N: compute threads (default: all cores); a CPU node redoes verification "
                   "cases on one more, at the lowest priority"),
        NL_OPT_STR("device", &o->device,
                   "D[,D...]: where the stage computes: cpu (default), cpu-devsim or cuda:N; "
                   "several (cuda:0,1 or cpu,cpu) make data-parallel replicas"),
        NL_OPT_SWITCH("tf32", &a->tf32, "GPU GEMMs may use TF32 tensor-core math (default: FP32)"),
        NL_OPT_CHOICE("precision", &o->bf16, "fp32|bf16", "fp32",
                      "P: GEMM precision, fp32 or bf16 (CPU with AVX512-BF16 or AMX, or a CUDA "
                      "GPU of compute capability 8.0 or newer; FP32 master weights, accumulation "
                      "and optimizer)"),
        NL_OPT_SIZE("reserve", &o->reserve_bytes, NULL,
                    "SIZE: a GPU's memory kept free, not offered (default: 256M or 5% of the "
                    "device, whichever is larger)"),
        NL_OPT_STR("listen", &o->listen, "ENDPOINT: data socket (default tcp://127.0.0.1:*)"),
        NL_OPT_SWITCH("no-inbound", &o->no_inbound,
                      "nothing can connect to this node (NAT, a firewall): it dials its previous "
                      "stage, which must accept inbound connections, instead of being dialed"),
        NL_OPT_SWITCH("no-local-link", &o->no_local_link,
                      "hops to and from a neighbour stage on this host stay on ZeroMQ (default: "
                      "a local socket read by the stages' own threads, docs/cluster.md)"),
        NL_OPT_SIZE("kv-budget", &o->kv_budget, NULL,
                    "SIZE: KV caches of generation sessions, kept within the memory offered "
                    "(default: a quarter of it, at most 256M; 0: no sessions); the plans get "
                    "the rest"),
        NL_OPT_CHOICE("kv-cache", &o->kv_cache, NL_KV_DTYPE_CHOICES, "fp32",
                      "T: element type of those caches, fp32 or bf16 (half the bytes: twice the "
                      "positions in --kv-budget, half read per decoded token; rounded to nearest "
                      "even when stored, attention sums in FP32)"),
        NL_OPT_INT("batch-decode", &o->batch_decode, 1, 1024, NULL,
                   "N: generation sessions' decode steps run together in one batch, at most "
                   "(default 32)"),
        NL_OPT_INT("prefill-chunk", &o->prefill_chunk, 1, 65536, NULL,
                   "N: prompt positions a batch takes, at most: a longer prompt is run in chunks "
                   "so it does not stall the others (default 64)"),
        NL_OPT_INT("batch-wait-ms", &a->batch_wait_ms, 0, 10000, NULL,
                   "MS: longest wait for the other active sessions' hops before a batch runs "
                   "(default 20; 0: run at once)"),
        NL_OPT_STR("name", &o->name, "NAME: shown in log lines (default node-<id>)"),
        NL_OPT_CHOICE("log-level", &a->level, NL_LOG_LEVELS, "info",
                      "debug, info, warn, error or off"),
        NL_OPT_DOUBLE("connect-timeout", &a->connect_s, 0.001, 86400, "30",
                      "SECONDS: keep trying the coordinator this long"),
        NL_OPT_STR("checkpoint-root", &o->ckpt_root,
                   "DIR: training checkpoint shards may only be written under it (default: "
                   "<state-dir>/checkpoints; without either, none are written)"),
        NL_OPT_SWITCH("plaintext", &o->plaintext,
                      "INSECURE: no CURVE encryption or authentication (debugging only)"),
        NL_OPT_END};
    _Static_assert(sizeof rows / sizeof rows[0] <= MAX_FLAGS, "MAX_FLAGS: room for the rows");
    memcpy(t, rows, sizeof rows);
}

/* The checks and defaults past the table: 0, or the exit code (said). */
static int parse_opts(const nl_opt *flags, const node_args *a, nl_node_opts *o, char *coord_key,
                      nl_keypair *kp)
{
    /* checkpoint shards: under --checkpoint-root, else <state-dir>/checkpoints,
     * else nowhere (CKPT_REQ refused) */
    static char state_root[1100];
    if (!o->ckpt_root && a->state_dir) {
        snprintf(state_root, sizeof state_root, "%s/checkpoints", a->state_dir);
        o->ckpt_root = state_root;
    }
    o->inject_nan_stage = -1;
#ifdef NL_TEST_HOOKS
    if (read_test_hooks(o) != 0)
        return 2;
#endif
    o->tf32 = a->tf32;
    o->has_reserve = nl_opts_get(flags, "reserve") != NULL;
    o->has_kv_budget = nl_opts_get(flags, "kv-budget") != NULL;
    nl_error derr;
    int replicas = 0;
    if (nl_node_parse_devices(o->device, NULL, &replicas, &derr) != NL_OK) {
        fprintf(stderr, "neuronode: --%s\n", derr.msg);
        return 2;
    }
    /* a GPU measures what it offers; the CPU offers what it is told */
    const bool own_memory = strncmp(o->device, "cuda:", 5) == 0 || o->inject_mem_total;
    if (!own_memory && !nl_opts_get(flags, "memory")) {
        fprintf(stderr, "neuronode: --memory SIZE is required on --device %s (e.g. --memory 8G)\n",
                o->device);
        return 2;
    }
    nl_log_set_level((nl_log_level)a->level);
    o->batch_wait_ms = a->batch_wait_ms < 0 ? 0 : a->batch_wait_ms == 0 ? -1 : a->batch_wait_ms;
    o->connect_timeout_ms = (int)(a->connect_s * 1000);
    if (o->plaintext) {
        NL_WARN("INSECURE: --plaintext: no encryption and no authentication on any socket");
    } else {
        nl_error err;
        if (!a->coord_key) {
            fprintf(stderr, "neuronode: --coordinator-key COORD.pub is required (the "
                            "coordinator's <state-dir>/coordinator.pub)\n");
            return 2;
        }
        if (nl_keys_load_public(coord_key, a->coord_key, &err) != NL_OK) {
            fprintf(stderr, "neuronode: --coordinator-key: %s\n", err.msg);
            return 1;
        }
        o->coordinator_key = coord_key;
    }
    int rc = load_identity(a->key, a->state_dir, o->plaintext, kp);
    o->keys = kp;
    return rc;
}

int nl_node_cli(int argc, char **argv, nl_node_opts *o, char *coord_key, nl_keypair *kp)
{
    node_args a = {.batch_wait_ms = -1};
    o->listen = "tcp://127.0.0.1:*";
    o->device = "cpu";
    nl_opt flags[MAX_FLAGS];
    node_flags(flags, o, &a);
    const char *pos[2] = {NULL, NULL};
    int npos = 0;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            help(stdout, flags);
            return 0;
        }
    if (argc < 2 || strcmp(argv[1], "join") != 0) {
        fprintf(stderr, "usage: %s\n(see neuronode --help)\n", USAGE);
        return 2;
    }
    int rc = nl_opts_parse(argc - 1, argv + 1, flags, USAGE, pos, 1, &npos);
    if (rc)
        return rc == 1 ? 0 : 2;
    if (npos != 1) {
        fprintf(stderr, "neuronode join: the coordinator's ENDPOINT is required\n");
        return 2;
    }
    nl_log_set_name(o->name ? o->name : "node");
    o->coordinator = pos[0];
    return (rc = parse_opts(flags, &a, o, coord_key, kp)) != 0 ? rc : -1;
}
