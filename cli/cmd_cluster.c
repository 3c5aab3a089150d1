/* neuroctl cluster up|down: a local cluster on this machine, a coordinator
 * and N nodes as separate processes on loopback, with keys generated and
 * authorised automatically. State lives in one directory:
 *   DIR/client.key, client.pub      the client key (--cluster DIR uses it)
 *   DIR/node-I.key, node-I.pub      each node's key
 *   DIR/coord/                      the coordinator's state dir (keys,
 *                                   authorized_keys, endpoint: the
 *                                   nodes', client_endpoint: the clients')
 *   DIR/NAME.log, DIR/NAME.pid      each process's log and pid */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "core/formats/fileio.h"
#include "kernels/backend.h"
#include "net/keys.h"

/* GOMP_SPINCOUNT of the nodes: a few microseconds of spinning. libgomp's own
 * default (300000) keeps an idle stage's threads on the cores that the
 * working stage needs (bench/bench_cluster.sh, docs/BENCHMARKS.md). */
#define DEFAULT_SPIN 1000
#define STR_(x) #x
#define STR(x) STR_(x)

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A sibling binary: beside neuroctl (installed) or in the build tree. */
static int find_binary(const char *name, const char *subdir, char *out, size_t cap)
{
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return -1;
    self[n] = '\0';
    char *dir = dirname(self);
    snprintf(out, cap, "%s/%s", dir, name);
    if (access(out, X_OK) == 0)
        return 0;
    snprintf(out, cap, "%s/../%s/%s", dir, subdir, name);
    return access(out, X_OK) == 0 ? 0 : -1;
}

/* Start argv as a daemon (own session), output to log; write its pid.
 * spin: GOMP_SPINCOUNT for it, or NULL. */
static pid_t spawn(char *const argv[], const char *log, const char *pidfile, const char *spin)
{
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        setsid();
        if (spin)
            setenv("GOMP_SPINCOUNT", spin, 1);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        int nul = open("/dev/null", O_RDONLY);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        if (nul >= 0)
            dup2(nul, 0);
        execv(argv[0], argv);
        _exit(127);
    }
    char line[32];
    int len = snprintf(line, sizeof line, "%d\n", (int)pid);
    nl_error err = {0};
    if (nl_file_write_atomic(pidfile, line, (size_t)len, &err) != NL_OK)
        fprintf(stderr, "cluster: %s\n", err.msg);
    return pid;
}

static nl_status make_key(const char *dir, const char *name, char pub[NL_KEY_Z85_LEN + 1],
                          nl_error *err)
{
    nl_keypair kp;
    char prefix[4096];
    snprintf(prefix, sizeof prefix, "%s/%s", dir, name);
    nl_status st = nl_keys_generate(&kp, err);
    if (st == NL_OK)
        st = nl_keys_save(&kp, prefix, true, err);
    memcpy(pub, kp.public_z85, NL_KEY_Z85_LEN + 1);
    nl_keys_wipe(&kp);
    return st;
}

/* Is pid alive and running `what`? */
static int ours(pid_t pid, const char *what)
{
    char path[64], cmd[512] = {0};
    snprintf(path, sizeof path, "/proc/%d/cmdline", (int)pid);
    FILE *f = fopen(path, "rb");
    if (!f)
        return 0;
    size_t n = fread(cmd, 1, sizeof cmd - 1, f);
    fclose(f);
    return n > 0 && strstr(cmd, what) != NULL;
}

/* Wait up to ms for pid to stop running `what`; 1 if it did. */
static int gone_within(pid_t pid, const char *what, int ms)
{
    for (int t = 0; t < ms && kill(pid, 0) == 0 && ours(pid, what); t += 50)
        sleep_ms(50);
    return !(kill(pid, 0) == 0 && ours(pid, what));
}

/* Stop a cluster's processes; quiet: no summary line (after a failed up).
 * The coordinator goes first, with SIGUSR2: it asks every node that joined
 * it to leave (nodes started by hand too, which would otherwise wait for
 * it forever) and stops once they have; then whatever of this directory's
 * processes still runs gets SIGTERM (SIGKILL after 5 s). */
static int cluster_down(const char *dir, int quiet)
{
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "cluster down: no cluster directory %s\n", dir);
        return 1;
    }
    pid_t pids[512];
    char files[512][640];
    int n = 0, n_nodes = 0; /* pids[0, n_nodes): nodes; then the coordinator */
    struct dirent *e;
    /* the nodes, then the coordinator */
    for (int pass = 0; pass < 2; pass++) {
        rewinddir(d);
        while ((e = readdir(d)) && n < 512) {
            size_t len = strlen(e->d_name);
            if (len < 5 || strcmp(e->d_name + len - 4, ".pid") != 0)
                continue;
            if ((strncmp(e->d_name, "coord", 5) == 0) != pass)
                continue;
            char path[600], *buf = NULL;
            size_t blen = 0;
            nl_error err = {0};
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            if (nl_file_read_all(path, 64, &buf, &blen, &err) != NL_OK)
                continue;
            pid_t pid = (pid_t)atoi(buf);
            free(buf);
            snprintf(files[n], sizeof files[n], "%s", path);
            pids[n++] = pid > 1 && ours(pid, pass ? "neurocoord" : "neuronode") ? pid : 0;
        }
        if (pass == 0)
            n_nodes = n;
    }
    closedir(d);
    int stopped = 0;
    for (int i = 0; i < n; i++)
        stopped += pids[i] > 0;
    for (int i = n_nodes; i < n;
         i++) /* its jobs end, its nodes leave, then it stops (within 18 s) */
        if (pids[i] > 0 && kill(pids[i], SIGUSR2) == 0 && gone_within(pids[i], "neurocoord", 30000))
            pids[i] = 0;
    for (int i = 0; i < n; i++) {
        if (pids[i] > 0 && kill(pids[i], SIGTERM) == 0 && !gone_within(pids[i], "neuro", 5000)) {
            fprintf(stderr, "cluster down: pid %d ignored SIGTERM; killing it\n", (int)pids[i]);
            kill(pids[i], SIGKILL);
        }
        unlink(files[i]);
    }
    /* a client that finds no endpoint says "not running" at once */
    char ep[4096];
    snprintf(ep, sizeof ep, "%s/coord/endpoint", dir);
    unlink(ep);
    snprintf(ep, sizeof ep, "%s/coord/client_endpoint", dir);
    unlink(ep);
    if (!quiet)
        printf("cluster down: stopped %d process(es) in %s\n", stopped, dir);
    return 0;
}

/* --device D[,D...]: node i (0-based) gets the i-th, the last repeated.
 * Returns 0, or prints the fault and returns 2. */
static int node_devices(const char *list, int nodes, char (*dev)[32])
{
    nl_error err;
    const char *p = list ? list : "cpu";
    int items = 0;
    for (;;) {
        size_t n = strcspn(p, ",");
        if (n == 0 || n >= sizeof dev[0] || items == nodes) {
            fprintf(stderr, "cluster up: --device %s: %s\n", list,
                    items == nodes ? "more devices than --nodes"
                    : n            ? "a device name is too long"
                                   : "an empty device name");
            return 2;
        }
        memcpy(dev[items], p, n);
        dev[items][n] = '\0';
        if (nl_backend_parse_device(dev[items], &err) != NL_OK) {
            fprintf(stderr, "cluster up: --%s\n", err.msg);
            return 2;
        }
        items++;
        if (p[n] != ',')
            break;
        p += n + 1;
    }
    for (int i = items; i < nodes; i++)
        memcpy(dev[i], dev[items - 1], sizeof dev[0]);
    return 0;
}

/* The last line of a log file into last (empty when unreadable). */
static void log_last_line(const char *path, char *last, size_t cap)
{
    char *buf = NULL;
    size_t len = 0;
    nl_error err = {0};
    last[0] = '\0';
    if (nl_file_read_all(path, 1 << 20, &buf, &len, &err) == NL_OK) {
        while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r'))
            len--;
        size_t at = len;
        while (at > 0 && buf[at - 1] != '\n')
            at--;
        snprintf(last, cap, "%.*s", (int)(len - at), buf + at);
    }
    free(buf);
}

/* Has pid (named what, logging to log) exited? If so says how, with the
 * last line of its log, and returns 1. */
static int exited(pid_t pid, const char *what, const char *log)
{
    int status = 0;
    char last[1024];
    if (pid <= 0 || waitpid(pid, &status, WNOHANG) != pid)
        return 0;
    log_last_line(log, last, sizeof last);
    if (WIFEXITED(status))
        fprintf(stderr, "cluster up: %s exited with status %d: %s (log %s)\n", what,
                WEXITSTATUS(status), last, log);
    else
        fprintf(stderr, "cluster up: %s died of signal %d: %s (log %s)\n", what,
                WIFSIGNALED(status) ? WTERMSIG(status) : 0, last, log);
    return 1;
}

/* Has one of the nodes exited? Says which, how, and the last line of its log. */
static int node_exited(const char *dir, const pid_t *pids, int nodes)
{
    for (int i = 0; i < nodes; i++) {
        char path[4096], what[32];
        snprintf(path, sizeof path, "%s/node-%d.log", dir, i + 1);
        snprintf(what, sizeof what, "node-%d", i + 1);
        if (exited(pids[i], what, path))
            return 1;
    }
    return 0;
}

/* Wait up to ms for path to appear while the coordinator (pid) runs:
 * 0 when it appeared, -1 after saying why not (its exit, or the time). */
static int wait_coordinator(const char *path, pid_t pid, const char *log, int ms)
{
    for (int t = 0; t < ms; t += 20) {
        if (access(path, R_OK) == 0)
            return 0;
        if (exited(pid, "the coordinator", log))
            return -1;
        sleep_ms(20);
    }
    fprintf(stderr, "cluster up: the coordinator wrote no endpoint in %d s; see %s\n", ms / 1000,
            log);
    return -1;
}

/* What `cluster up` starts, from its flags (cluster_flags, then
 * up_options). */
typedef struct up_opts {
    long long nodes, threads, seed, timeout, node_timeout, spin, train_resumes;
    uint64_t memory, kv_budget; /* kv_budget: passed when given, else the node's default */
    const char *model, *config, *resume, *http, *device;
    bool tf32;
    bool no_local_link; /* the nodes' --no-local-link */
    int bf16;           /* --precision: 0 fp32, 1 bf16 */
    int kv_cache;       /* --kv-cache: an nl_kv_dtype */
    char devices[64][32];
} up_opts;

/* The checks of `cluster up` past its flag table: 0, or the exit status. */
static int up_options(const nl_opt *flags, up_opts *o)
{
    int rc;
    /* a node whose KV budget takes all it offers keeps nothing for a
     * stage's weights and activations, and refuses to start: say so here,
     * in the units typed, before any process starts */
    const char *mem_s = nl_opts_get(flags, "memory"), *kv_s = nl_opts_get(flags, "kv-budget");
    if (kv_s && o->kv_budget >= o->memory &&
        (mem_s || !o->device || strncmp(o->device, "cuda:", 5) != 0)) {
        fprintf(stderr,
                "cluster up: --kv-budget %s leaves nothing of --memory %s for a stage's weights "
                "and activations: give a smaller --kv-budget (default: a quarter of --memory, "
                "at most 256M) or more --memory\n",
                kv_s, mem_s ? mem_s : "1G (the default)");
        return 2;
    }
    if ((rc = node_devices(o->device, (int)o->nodes, o->devices)))
        return rc;
    if (!!o->model + !!o->config + !!o->resume > 1) {
        fprintf(stderr, "cluster up: --model, --config and --resume exclude each other\n");
        return 2;
    }
    if (o->threads == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        /* a fair share of the cores each */
        o->threads = cores / o->nodes > 0 ? cores / o->nodes : 1;
    }
    return 0;
}

/* The keys of the client and of each node in DIR, and the coordinator's
 * authorized_keys in cdir: 0, or 1 (said). */
static int write_keys(const char *dir, const char *cdir, long long nodes)
{
    nl_error err = {0};
    char pub[NL_KEY_Z85_LEN + 1], name[64], path[4096];
    char *auth = malloc((size_t)(nodes + 2) * 96 + 128);
    if (!auth) {
        fprintf(stderr, "cluster up: out of memory\n");
        return 1;
    }
    size_t alen = (size_t)sprintf(auth, "# written by neuroctl cluster up\n");
    if (make_key(dir, "client", pub, &err) != NL_OK)
        goto fail;
    alen += (size_t)sprintf(auth + alen, "%s admin  # client (the operator)\n", pub);
    for (long long i = 1; i <= nodes; i++) {
        snprintf(name, sizeof name, "node-%lld", i);
        if (make_key(dir, name, pub, &err) != NL_OK)
            goto fail;
        alen += (size_t)sprintf(auth + alen, "%s node  # %s\n", pub, name);
    }
    snprintf(path, sizeof path, "%s/authorized_keys", cdir);
    if (nl_file_write_atomic(path, auth, alen, &err) != NL_OK)
        goto fail;
    free(auth);
    return 0;
fail:
    free(auth);
    fprintf(stderr, "cluster up: %s\n", err.msg);
    return 1;
}

/* Starts the coordinator (coord_bin) on two free loopback ports (nodes,
 * clients) and reads the nodes' endpoint it writes into ep: its pid, or
 * -1 (said; the cluster is taken down). */
static pid_t start_coordinator(const nl_opt *flags, const up_opts *o, char *coord_bin,
                               const char *dir, char *cdir, char *ep, size_t ep_cap)
{
    char path[4096], log[4096], pidf[4096];
    /* it writes client_endpoint, then endpoint */
    snprintf(path, sizeof path, "%s/client_endpoint", cdir);
    unlink(path);
    snprintf(path, sizeof path, "%s/endpoint", cdir);
    unlink(path);
    char s_nodes[32], s_seed[32], s_nto[32], s_tr[32];
    snprintf(s_nodes, sizeof s_nodes, "%lld", o->nodes);
    snprintf(s_tr, sizeof s_tr, "%lld", o->train_resumes);
    snprintf(s_seed, sizeof s_seed, "%lld", o->seed);
    snprintf(s_nto, sizeof s_nto, "%lld", o->node_timeout);
    /* a local cluster runs as its user, who names the data and checkpoint
     * paths: they may lead wherever that user may (as the nodes' root) */
    char *cargv[64] = {coord_bin, /* 19 here, 2 + 2 below, 2 a flag passed on, NULL */
                       "--listen",
                       "tcp://127.0.0.1:*",
                       "--client-listen",
                       "tcp://127.0.0.1:*",
                       "--state-dir",
                       cdir,
                       "--min-nodes",
                       s_nodes,
                       "--seed",
                       s_seed,
                       "--node-timeout-ms",
                       s_nto,
                       "--data-root",
                       "/",
                       "--checkpoint-root",
                       "/",
                       "--train-resumes",
                       s_tr};
    int ca = 19;
    if (o->model) {
        cargv[ca++] = "--model";
        cargv[ca++] = (char *)o->model;
    } else if (o->config) {
        cargv[ca++] = "--config";
        cargv[ca++] = (char *)o->config;
    } else if (o->resume) {
        cargv[ca++] = "--resume";
        cargv[ca++] = (char *)o->resume;
    }
    if (o->http) { /* the coordinator writes its address to coord/http once it listens */
        cargv[ca++] = "--http";
        cargv[ca++] = (char *)o->http;
        snprintf(log, sizeof log, "%s/http", cdir);
        unlink(log);
    }
    /* passed on as given: neurocoord checks them */
    static const char *const passed[] = {
        "--verify-rate",       "--http-tokens",  "--http-adapter",    "--grow",
        "--heartbeat-ms",      "--wire",         "--rebalance-after", "--replicas",
        "--plan-microbatches", "--outer-every",  "--outer-lr",        "--outer-momentum",
        "--in-flight-extra",   "--replan-margin"};
    for (size_t k = 0; k < sizeof passed / sizeof *passed; k++)
        if (nl_opts_get(flags, passed[k] + 2)) {
            cargv[ca++] = (char *)passed[k];
            cargv[ca++] = (char *)nl_opts_get(flags, passed[k] + 2);
        }
    cargv[ca] = NULL;
    snprintf(log, sizeof log, "%s/coord.log", dir);
    snprintf(pidf, sizeof pidf, "%s/coord.pid", dir);
    const pid_t coord = spawn(cargv, log, pidf, NULL);
    if (coord < 0 || wait_coordinator(path, coord, log, 10000) != 0) {
        if (coord < 0)
            fprintf(stderr, "cluster up: cannot start %s\n", coord_bin);
        cluster_down(dir, 1);
        return -1;
    }
    FILE *f = fopen(path, "r");
    if (!f || !fgets(ep, (int)ep_cap, f)) {
        if (f)
            fclose(f);
        fprintf(stderr, "cluster up: cannot read %s\n", path);
        cluster_down(dir, 1);
        return -1;
    }
    fclose(f);
    ep[strcspn(ep, "\r\n")] = '\0';
    return coord;
}

/* Starts the nodes (node_bin), joining the coordinator at ep: 0 with
 * their pids, or 1 (said; the cluster is taken down). */
static int start_nodes(const nl_opt *flags, const up_opts *o, char *node_bin, const char *dir,
                       const char *cdir, char *ep, pid_t *pids)
{
    char s_mem[32], s_thr[32], s_spin[32], s_kv[32], coord_pub[4096], key[4096], name[64];
    char log[4096], pidf[4096];
    /* the nodes share the machine: an idle stage's OpenMP threads sleep
     * soon, and leave the cores to the one that works */
    const bool env_spin = getenv("GOMP_SPINCOUNT") || getenv("OMP_WAIT_POLICY");
    snprintf(s_spin, sizeof s_spin, "%lld", o->spin);
    snprintf(s_mem, sizeof s_mem, "%llu", (unsigned long long)o->memory);
    snprintf(s_thr, sizeof s_thr, "%lld", o->threads);
    snprintf(s_kv, sizeof s_kv, "%llu", (unsigned long long)o->kv_budget);
    snprintf(coord_pub, sizeof coord_pub, "%s/coordinator.pub", cdir);
    for (long long i = 1; i <= o->nodes; i++) {
        snprintf(name, sizeof name, "node-%lld", i);
        snprintf(key, sizeof key, "%s/%s.key", dir, name);
        snprintf(log, sizeof log, "%s/%s.log", dir, name);
        snprintf(pidf, sizeof pidf, "%s/%s.pid", dir, name);
        char *dev = (char *)o->devices[i - 1];
        char *nargv[28] = {node_bin,  "join",      ep,    "--key",  key,  "--coordinator-key",
                           coord_pub, "--threads", s_thr, "--name", name, "--device",
                           dev};
        int na = 13;
        /* a GPU node offers its device's free memory unless --memory caps it */
        if (nl_opts_get(flags, "memory") || strncmp(dev, "cuda:", 5) != 0) {
            nargv[na++] = "--memory";
            nargv[na++] = s_mem;
        }
        if (nl_opts_get(flags, "kv-budget")) { /* 0 too: no generation sessions */
            nargv[na++] = "--kv-budget";
            nargv[na++] = s_kv;
        }
        if (o->tf32)
            nargv[na++] = "--tf32";
        if (o->no_local_link)
            nargv[na++] = "--no-local-link";
        if (o->bf16) {
            nargv[na++] = "--precision";
            nargv[na++] = "bf16";
        }
        if (o->kv_cache == NL_KV_BF16) {
            nargv[na++] = "--kv-cache";
            nargv[na++] = "bf16";
        }
        /* a local cluster runs as its user, who names the checkpoint
         * directory: the nodes may write wherever that user may */
        nargv[na++] = "--checkpoint-root";
        nargv[na++] = "/";
        nargv[na] = NULL;
        pids[i - 1] =
            spawn(nargv, log, pidf, env_spin && !nl_opts_get(flags, "spin") ? NULL : s_spin);
        if (pids[i - 1] < 0) {
            fprintf(stderr, "cluster up: cannot start %s\n", name);
            cluster_down(dir, 1);
            return 1;
        }
    }
    return 0;
}

/* Waits until the cluster has its plan: 0 (the state printed), or 1 (said;
 * a process that exited takes the cluster down, the timeout leaves it). */
static int wait_ready(const up_opts *o, const char *dir, const char *cdir, pid_t coord,
                      const pid_t *pids)
{
    char state[512] = "", log[4096], path[4096];
    /* a node that cannot start (a device it cannot open) exits at once:
     * say so with its last words rather than wait for the timeout */
    const double deadline = nl_mono_s() + (double)o->timeout;
    int short_of = 0; /* polls in a row that found every node joined and too little memory */
    for (;;) {
        int nodes = -1;
        if (nl_remote_wait_ready(dir, 1, state, sizeof state, &nodes) == 0)
            break;
        snprintf(log, sizeof log, "%s/coord.log", dir);
        if (node_exited(dir, pids, (int)o->nodes) || exited(coord, "the coordinator", log)) {
            cluster_down(dir, 1);
            return 1;
        }
        /* every node it started joined and the plan still lacks memory:
         * no more will come, so say so now rather than at the timeout
         * (twice in a row: the state may predate the last join's plan) */
        short_of =
            nodes >= o->nodes && strncmp(state, "not enough capacity", 19) == 0 ? short_of + 1 : 0;
        if (short_of >= 2) {
            fprintf(stderr,
                    "cluster up: the %lld node(s) cannot hold the model: %s; give more --memory "
                    "or --nodes, or a smaller model (the cluster is taken down; logs in %s)\n",
                    o->nodes, state, dir);
            cluster_down(dir, 1);
            return 1;
        }
        if (nl_mono_s() >= deadline) {
            fprintf(stderr, "cluster up: not ready after %lld s: %s (logs in %s)\n", o->timeout,
                    state, dir);
            return 1;
        }
    }
    printf("cluster up: %s\n  use: neuroctl status --cluster %s\n", state, dir);
    if (o->http) {
        char url[512] = "";
        snprintf(path, sizeof path, "%s/http", cdir);
        for (int t = 0; t < 10000 && access(path, R_OK) != 0; t += 20)
            sleep_ms(20); /* the coordinator writes it once it listens */
        FILE *f = fopen(path, "r");
        if (f && fgets(url, sizeof url, f))
            printf("  http: %s", url);
        else
            printf("  http: not listening; see %s/coord.log\n", dir);
        if (f)
            fclose(f);
    }
    fflush(stdout);
    return 0;
}

static int cluster_up(const nl_opt *flags, up_opts *op, const char *dir)
{
    int rc = up_options(flags, op);
    if (rc)
        return rc;
    const up_opts o = *op;
    char coord_bin[4096], node_bin[4096], cdir[2048], path[4096], ep[600];
    if (find_binary("neurocoord", "coordinator", coord_bin, sizeof coord_bin) ||
        find_binary("neuronode", "node", node_bin, sizeof node_bin)) {
        fprintf(stderr, "cluster up: cannot find neurocoord and neuronode beside neuroctl\n");
        return 1;
    }
    snprintf(cdir, sizeof cdir, "%s/coord", dir);
    snprintf(path, sizeof path, "%s/coord.pid", dir);
    if (access(path, F_OK) == 0) {
        fprintf(stderr, "cluster up: %s exists: is a cluster already up? (cluster down first)\n",
                path);
        return 1;
    }
    if ((mkdir(dir, 0700) != 0 && errno != EEXIST) || (mkdir(cdir, 0700) != 0 && errno != EEXIST)) {
        fprintf(stderr, "cluster up: cannot create %s: %s\n", cdir, strerror(errno));
        return 1;
    }
    if (write_keys(dir, cdir, o.nodes))
        return 1;
    const pid_t coord = start_coordinator(flags, &o, coord_bin, dir, cdir, ep, sizeof ep);
    if (coord < 0)
        return 1;
    pid_t pids[64];
    if (start_nodes(flags, &o, node_bin, dir, cdir, ep, pids))
        return 1;
    fprintf(stderr,
            "cluster up: coordinator at %s, %lld node(s) with %lld thread(s) each (devices %s); "
            "waiting for the plan...\n",
            ep, o.nodes, o.threads, o.device ? o.device : "cpu");
    return wait_ready(&o, dir, cdir, coord, pids);
}

#define CLUSTER_USAGE                                                                              \
    "neuroctl cluster up|down [--dir DIR] [--nodes N] [--model M | --config C | --resume "         \
    "MANIFEST] [--memory SIZE] [--threads N] [--spin N] [--kv-budget SIZE] [--device D[,D...]] "   \
    "[--tf32] [--no-local-link] [--precision fp32|bf16] [--kv-cache fp32|bf16] [--http HOST:PORT " \
    "[--http-tokens "                                                                              \
    "FILE] [--http-adapter "                                                                       \
    "NAME=FILE]] [--grow auto] [--wire fp32|bf16] [--in-flight-extra E] [--replan-margin F] "      \
    "[--replicas R|auto "                                                                          \
    "[--plan-microbatches M] "                                                                     \
    "[--outer-every H [--outer-lr X] [--outer-momentum M]]]"
#define MAX_FLAGS 40

/* The flags of `cluster up|down` into t, their values into o and *dir;
 * those neurocoord checks are passed on as given (no destination). */
static void cluster_flags(nl_opt t[MAX_FLAGS], up_opts *o, const char **dir)
{
    *o = (up_opts){.spin = DEFAULT_SPIN};
    const nl_opt rows[] = {
        NL_OPT_STR("dir", dir, "the cluster's directory (default .neurollm-cluster)"),
        NL_OPT_LLONG("nodes", &o->nodes, 1, 64, "3", "up: nodes to start"),
        NL_OPT_STR("model", &o->model, "up: checkpoint to serve"),
        NL_OPT_STR("config", &o->config, "up: model config (YAML) instead of a checkpoint"),
        NL_OPT_STR("resume", &o->resume,
                   "up: a training manifest (or its directory) to serve and train on from"),
        NL_OPT_LLONG("seed", &o->seed, 0, INT64_MAX, "0",
                     "up: initialisation seed without a checkpoint"),
        NL_OPT_SIZE("memory", &o->memory, "1G",
                    "up: memory each node offers (a cuda:N node offers its device's free memory "
                    "unless this is given)"),
        NL_OPT_STR("device", &o->device,
                   "up: D[,D...]: each node's device, cpu, cpu-devsim or cuda:N, in node order; "
                   "the last is repeated (default cpu)"),
        NL_OPT_SWITCH("tf32", &o->tf32, "up: the nodes' GPU GEMMs may use TF32 (default: FP32)"),
        NL_OPT_SWITCH("no-local-link", &o->no_local_link,
                      "up: the nodes' hops stay on ZeroMQ (neuronode --no-local-link; default: a "
                      "local socket between neighbour stages)"),
        NL_OPT_CHOICE("precision", &o->bf16, "fp32|bf16", NULL,
                      "up: P: the nodes' GEMM precision, fp32 (default) or bf16 (neuronode "
                      "--precision)"),
        NL_OPT_CHOICE("kv-cache", &o->kv_cache, NL_KV_DTYPE_CHOICES, NULL,
                      "up: T: the element type of the nodes' generation KV caches, fp32 "
                      "(default) or bf16 (neuronode --kv-cache)"),
        NL_OPT_LLONG("threads", &o->threads, 0, 1024, NULL,
                     "up: threads per node (default: the cores shared evenly)"),
        NL_OPT_SIZE("kv-budget", &o->kv_budget, NULL,
                    "up: memory of each node for generation sessions' KV caches, within "
                    "--memory (default: neuronode's, a quarter of it, at most 256M)"),
        NL_OPT_LLONG(
            "spin", &o->spin, 0, 100000000, NULL,
            "up: iterations a node's idle OpenMP thread spins before it sleeps "
            "(GOMP_SPINCOUNT; default " STR(DEFAULT_SPIN) ", or the environment's "
                                                          "GOMP_SPINCOUNT or OMP_WAIT_POLICY)"),
        NL_OPT_LLONG("node-timeout-ms", &o->node_timeout, 100, 3600000, "3000",
                     "up: a node silent this long is dead"),
        NL_OPT_STR("http", &o->http,
                   "up: the coordinator also serves HTTP on HOST:PORT (neurocoord --http; port 0: "
                   "a free one); the address is printed and kept in DIR/coord/http"),
        NL_OPT_STR("http-tokens", NULL,
                   "up: bearer tokens file for --http (neurocoord --http-tokens)"),
        NL_OPT_STR("http-adapter", NULL,
                   "up: NAME=FILE[,NAME=FILE...]: --http also serves each adapter as model NAME "
                   "(neurocoord --http-adapter)"),
        NL_OPT_LLONG("train-resumes", &o->train_resumes, 0, 1000, "3",
                     "up: times a training job goes on by itself after losing a stage "
                     "(neurocoord --train-resumes)"),
        NL_OPT_STR("grow", NULL,
                   "up: auto: the model deepens as nodes join (neurocoord --grow; default off)"),
        NL_OPT_STR("verify-rate", NULL,
                   "up: the fraction of a training step's (stage, microbatch)s another node "
                   "redoes (neurocoord --verify-rate; default 0.05)"),
        NL_OPT_STR("heartbeat-ms", NULL,
                   "up: the nodes' heartbeat period (neurocoord --heartbeat-ms; default 1000); a "
                   "training job's early re-balance waits for 3 of each stage's"),
        NL_OPT_STR("wire", NULL,
                   "up: fp32 (default) or bf16: the precision of the hidden states and gradients "
                   "between stages (neurocoord --wire)"),
        NL_OPT_STR("in-flight-extra", NULL,
                   "up: E more microbatches in flight on every stage but the last in a "
                   "training step than 1F1B keeps: a slow link's round trip is not waited out "
                   "(neurocoord --in-flight-extra; default 0)"),
        NL_OPT_STR("rebalance-after", NULL,
                   "up: a training job's early re-balance after this many steps (neurocoord "
                   "--rebalance-after; default 3; 0: only at the job's checkpoints)"),
        NL_OPT_STR("replan-margin", NULL,
                   "up: the fraction by which a plan over the nodes there are now must beat the "
                   "current one for a re-plan (neurocoord --replan-margin; default 0.1)"),
        NL_OPT_STR("replicas", NULL,
                   "up: every pipeline stage on this many nodes (R), a count per stage "
                   "(R0,R1,...), or auto (neurocoord --replicas; default 1)"),
        NL_OPT_STR("plan-microbatches", NULL,
                   "up: the step's microbatches --replicas auto plans for (neurocoord "
                   "--plan-microbatches)"),
        NL_OPT_STR("outer-every", NULL,
                   "up: DiLoCo across the replica groups, an outer step every H steps "
                   "(neurocoord --outer-every; default 0: every step's gradients added up)"),
        NL_OPT_STR("outer-lr", NULL,
                   "up: DiLoCo's outer learning rate (neurocoord --outer-lr; default 0.7)"),
        NL_OPT_STR("outer-momentum", NULL,
                   "up: DiLoCo's outer Nesterov momentum (neurocoord --outer-momentum; default "
                   "0.9)"),
        NL_OPT_LLONG("timeout", &o->timeout, 1, 3600, "120",
                     "up: seconds to wait for the cluster to be ready (it fails at once when "
                     "every node joined and they cannot hold the model)"),
        NL_OPT_END};
    _Static_assert(sizeof rows / sizeof rows[0] <= MAX_FLAGS, "MAX_FLAGS: room for the rows");
    memcpy(t, rows, sizeof rows);
}

int nl_cmd_cluster(int argc, char **argv)
{
    up_opts o;
    const char *dir = NULL;
    nl_opt flags[MAX_FLAGS];
    cluster_flags(flags, &o, &dir);
    const char *pos[1] = {NULL};
    int npos = 0;
    int rc = nl_opts_parse(argc, argv, flags, CLUSTER_USAGE, pos, 1, &npos);
    if (rc)
        return rc == 1 ? 0 : rc;
    if (!dir)
        dir = ".neurollm-cluster";
    if (npos == 1 && strcmp(pos[0], "up") == 0)
        return cluster_up(flags, &o, dir);
    if (npos == 1 && strcmp(pos[0], "down") == 0)
        return cluster_down(dir, 0);
    nl_opts_help(stderr, CLUSTER_USAGE, flags);
    return 2;
}
