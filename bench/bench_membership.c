/* bench_membership: many lightweight simulated nodes against one
 * coordinator (issue 22, "toward internet scale"); run by hand.
 *
 *   bench_membership NEUROCOORD [NODES] [SECONDS] [--plaintext] [--vanish K]
 *                    [--per-proc P] [--timeout-ms T]
 *
 * Starts NEUROCOORD (a 64-layer config, --min-nodes NODES, heartbeats every
 * second, --node-timeout-ms T, default 5000) in a fresh state directory
 * whose authorized_keys admits NODES generated CURVE keys. The simulated
 * nodes are DEALER sockets (contexts of at most 900 sockets each) spread
 * over processes of at most P nodes (default 2500: a socket takes two
 * descriptors and a process may hold 20,000 here); they JOIN over
 * loopback together, then heartbeat every second. With --vanish K the
 * first K nodes, in a process of their own, are the fastest (100 GFLOP/s
 * against 10 to 16), so the plan is made over them.
 *
 * Reports: the time until every node was accepted; the coordinator's CPU
 * share and resident memory over SECONDS while they all heartbeat (from
 * /proc/PID/stat and status) and how many it declared dead meanwhile
 * (none, if it keeps up); the planner's time over them (the coordinator's
 * log: "planned over N nodes ... in S s") and the time from the last JOIN
 * to the plan. With --vanish K: the K fast nodes' process is SIGKILLed at
 * once; the time from the kill to the first and the K-th death declared
 * and to the new plan over the nodes left. The simulated nodes answer
 * nothing else: the plan's loads go unanswered. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "net/keys.h"
#include "net/transport.h"

#define PER_CTX 900
#define FAST_GFLOPS 100.0

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wall-clock seconds since midnight UTC, as the coordinator's log prints. */
static double day_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)(ts.tv_sec % 86400) + 1e-9 * (double)ts.tv_nsec;
}

/* utime + stime of pid, in seconds; resident KiB in *rss. */
static double cpu_of(pid_t pid, long *rss)
{
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    unsigned long ut = 0, st = 0;
    if (f && fgets(buf, sizeof buf, f)) {
        const char *p = strrchr(buf, ')');
        if (p)
            sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st);
    }
    if (f)
        fclose(f);
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    *rss = 0;
    if ((f = fopen(path, "r"))) {
        while (fgets(buf, sizeof buf, f))
            if (sscanf(buf, "VmRSS: %ld", rss) == 1)
                break;
        fclose(f);
    }
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* The 1-minute load average (other work on the machine skews every figure). */
static double load_avg(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f && fscanf(f, "%lf", &l) != 1)
        l = -1;
    if (f)
        fclose(f);
    return l;
}

/* ---------------------------------------------------------------- a group of nodes */

static volatile sig_atomic_t group_stop;

static void on_term(int sig)
{
    (void)sig;
    group_stop = 1;
}

typedef struct group {
    int lo, hi; /* its nodes */
    double gflops;
    pid_t pid;
    int report; /* the parent's end of its pipe */
} group;

/* Node gi's JOIN (its key, a data endpoint of its own). */
static void send_join(nl_sock *s, nl_wire_msg *m, const nl_keypair *kp, const group *g, int gi)
{
    char dep[64];
    nl_error e = {0};
    snprintf(dep, sizeof dep, "tcp://127.0.0.1:%d", 20000 + gi);
    nl_wire_msg_reset(m, NL_MSG_JOIN);
    m->u.join = (nl_msg_join){kp[gi].public_z85, "cpu", 1ull << 30, g->gflops + gi % 7, 1, dep, 0};
    nl_sock_send(s, NULL, 0, m, &e);
}

/* In a child: nodes [lo, hi) join, report "accepted seconds-of-day" on fd
 * once all are in (or after 600 s), then heartbeat every second until
 * SIGTERM. Returns the exit status. */
static int run_group(const char *ep, const char *pub, const nl_keypair *kp, const group *g,
                     int plain, int fd)
{
    const int n = g->hi - g->lo, nctx = (n + PER_CTX - 1) / PER_CTX;
    nl_error e = {0};
    nl_net **net = calloc((size_t)nctx, sizeof *net);
    nl_sock **s = calloc((size_t)n, sizeof *s);
    uint32_t *id = calloc((size_t)n, sizeof *id);
    uint64_t *seq = calloc((size_t)n, sizeof *seq);
    char *joined = calloc((size_t)n, 1); /* accepted at least once */
    if (!net || !s || !id || !seq || !joined)
        return 1;
    for (int k = 0; k < nctx; k++) {
        nl_net_opts no = nl_net_opts_default();
        if (nl_net_new(&net[k], &no, &e) != NL_OK) {
            fprintf(stderr, "context %d: %s\n", k, e.msg);
            return 1;
        }
    }
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (int i = 0; i < n; i++) {
        const int gi = g->lo + i;
        nl_sock_opts o = {.type = ZMQ_DEALER,
                          .keys = &kp[gi],
                          .server_key = pub,
                          .plaintext = plain,
                          .name = "sim",
                          .linger_ms = 0,
                          .kind = NL_SOCK_CONTROL};
        if (nl_sock_new(&s[i], net[i / PER_CTX], &o, &e) != NL_OK ||
            nl_sock_connect(s[i], ep, &e) != NL_OK) {
            fprintf(stderr, "node %d: %s\n", gi, e.msg);
            return 1;
        }
        send_join(s[i], &m, kp, g, gi);
    }
    /* the ACCEPTs; the accepted heartbeat every second meanwhile */
    int accepted = 0, reported = 0;
    nl_rx rx;
    nl_rx_init(&rx);
    const double t0 = now_s();
    double beat = t0;
    while (!group_stop) {
        for (int i = 0; i < n; i++)
            while (nl_sock_recv(s[i], &rx, 0, &e) == NL_OK) { /* ASSIGN, LOAD_DONE...: dropped */
                if (rx.msg.type == NL_MSG_ACCEPT && !id[i]) {
                    id[i] = rx.msg.u.accept.node_id;
                    accepted += !joined[i];
                    joined[i] = 1;
                } else if (rx.msg.type == NL_MSG_ERROR && id[i] &&
                           rx.msg.u.error.req_type == NL_MSG_HEARTBEAT &&
                           rx.msg.u.error.code == NL_ERR_STATE) {
                    id[i] = 0; /* declared dead while it lived: join again, as neuronode does */
                    send_join(s[i], &m, kp, g, g->lo + i);
                }
                nl_rx_free(&rx);
            }
        if (!reported && (accepted == n || now_s() - t0 > 600)) {
            char line[64];
            const int len = snprintf(line, sizeof line, "%d %.3f\n", accepted, day_s());
            reported = write(fd, line, (size_t)len) == len;
            close(fd);
        }
        if (now_s() - beat >= 1.0) {
            beat += 1.0;
            if (now_s() - beat > 1.0) /* behind: no burst to catch up */
                beat = now_s();
            for (int i = 0; i < n; i++)
                if (id[i]) {
                    nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
                    m.u.heartbeat = (nl_msg_heartbeat){.node_id = id[i], .seq = ++seq[i]};
                    nl_sock_send(s[i], NULL, 0, &m, &e);
                }
        }
        /* joining: look often; then once a round is enough */
        const double left = beat + 1.0 - now_s();
        usleep(accepted < n ? 5000 : (useconds_t)(left > 0 ? left * 1e6 : 0));
    }
    nl_wire_msg_free(&m);
    for (int i = 0; i < n; i++)
        nl_sock_destroy(&s[i]);
    for (int k = 0; k < nctx; k++)
        nl_net_destroy(&net[k]);
    return 0;
}

/* Start group g in a child; 0 on failure. */
static int start_group(group *g, const char *ep, const char *pub, const nl_keypair *kp, int plain)
{
    int p[2];
    if (pipe(p) != 0)
        return 0;
    fflush(stdout);
    g->pid = fork();
    if (g->pid < 0)
        return 0;
    if (g->pid == 0) {
        close(p[0]);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_term;
        sigaction(SIGTERM, &sa, NULL);
        _exit(run_group(ep, pub, kp, g, plain, p[1]));
    }
    close(p[1]);
    g->report = p[0];
    return 1;
}

/* ---------------------------------------------------------------- the coordinator's log */

/* A log line's time (seconds of the day) if it holds needle, else -1. */
static double line_time(const char *line, const char *needle)
{
    int h, m;
    double s;
    if (!strstr(line, needle) || sscanf(line, "%d:%d:%lf", &h, &m, &s) != 3)
        return -1;
    return 3600.0 * h + 60.0 * m + s;
}

typedef struct logscan {
    int joins, deaths, plans;          /* lines of each, in all */
    double last_join, plan_after_join; /* the last JOIN; the first plan after it */
    int deaths_after;                  /* deaths after t_after */
    double first_death, last_death;    /* ... their times */
    double plan_after_death;           /* the last plan made after t_after */
    double planner_s, planner_cpu;     /* the last "planned over" line's seconds, CPU */
    int planner_nodes, planner_offered;
} logscan;

static void scan_log(const char *path, double t_after, logscan *ls)
{
    memset(ls, 0, sizeof *ls);
    ls->first_death = ls->last_death = ls->plan_after_death = ls->plan_after_join = -1;
    FILE *f = fopen(path, "r");
    char line[2048];
    while (f && fgets(line, sizeof line, f)) {
        double t;
        const char *p;
        if ((t = line_time(line, " joined: ")) >= 0) {
            ls->joins++;
            ls->last_join = t;
            ls->plan_after_join = -1;
        } else if ((t = line_time(line, "sent no heartbeat for")) >= 0 &&
                   !strstr(line, "state: ")) {
            ls->deaths++;
            if (t_after > 0 && t >= t_after) {
                if (!ls->deaths_after++)
                    ls->first_death = t;
                ls->last_death = t;
            }
        } else if ((t = line_time(line, "state: loading")) >= 0) {
            ls->plans++;
            if (ls->plan_after_join < 0)
                ls->plan_after_join = t;
            if (t_after > 0 && t >= t_after)
                ls->plan_after_death = t;
        } else if ((p = strstr(line, "planned over "))) {
            sscanf(p, "planned over %d live nodes (%d offered to the planner) in %lf s (%lf",
                   &ls->planner_nodes, &ls->planner_offered, &ls->planner_s, &ls->planner_cpu);
        }
    }
    if (f)
        fclose(f);
}

/* ---------------------------------------------------------------- main */

typedef struct args {
    const char *coord;
    int nodes, secs, plain, vanish, per_proc, timeout_ms;
} args;

static int parse_args(int argc, char **argv, args *a)
{
    *a = (args){.nodes = 1000, .secs = 10, .per_proc = 2500, .timeout_ms = 5000};
    int pos = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--plaintext") == 0)
            a->plain = 1;
        else if (strcmp(argv[i], "--vanish") == 0 && i + 1 < argc)
            a->vanish = atoi(argv[++i]);
        else if (strcmp(argv[i], "--per-proc") == 0 && i + 1 < argc)
            a->per_proc = atoi(argv[++i]);
        else if (strcmp(argv[i], "--timeout-ms") == 0 && i + 1 < argc)
            a->timeout_ms = atoi(argv[++i]);
        else if (argv[i][0] == '-')
            return 0;
        else if (pos == 0 && ++pos)
            a->coord = argv[i];
        else if (pos == 1 && ++pos)
            a->nodes = atoi(argv[i]);
        else if (pos == 2 && ++pos)
            a->secs = atoi(argv[i]);
        else
            return 0;
    }
    return a->coord && a->nodes > 0 && a->secs > 0 && a->per_proc > 0 && a->vanish >= 0 &&
           a->vanish < a->nodes && a->timeout_ms > 1000;
}

/* The state directory: keys (kp, NODES of them), authorized_keys and the
 * 64-layer config at cfg. */
static int make_dir(char *dir, int nodes, nl_keypair *kp, char *cfg, size_t cap)
{
    nl_error e = {0};
    char path[512];
    if (!mkdtemp(dir))
        return 0;
    snprintf(path, sizeof path, "%s/authorized_keys", dir);
    FILE *ak = fopen(path, "w");
    for (int i = 0; ak && i < nodes; i++) {
        if (nl_keys_generate(&kp[i], &e) != NL_OK)
            return 0;
        fprintf(ak, "%s\n", kp[i].public_z85);
    }
    if (!ak)
        return 0;
    fclose(ak);
    snprintf(cfg, cap, "%s/cfg.yaml", dir);
    FILE *cf = fopen(cfg, "w");
    if (!cf)
        return 0;
    fputs("hidden_dim: 256\nnum_layers: 64\nnum_heads: 4\nnum_kv_heads: 2\nffn_dim: 512\n"
          "num_experts: 4\nvocab_size: 1024\nvocab_chunk: 1024\nmax_seq_len: 256\n",
          cf);
    fclose(cf);
    return 1;
}

static pid_t start_coord(const args *a, const char *dir, const char *cfg, const char *log)
{
    char s_nodes[32], s_to[32];
    snprintf(s_nodes, sizeof s_nodes, "%d", a->nodes);
    snprintf(s_to, sizeof s_to, "%d", a->timeout_ms);
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        if (!freopen(log, "w", stderr))
            _exit(1);
        execl(a->coord, a->coord, "--listen", "tcp://127.0.0.1:*", "--state-dir", dir, "--config",
              cfg, "--min-nodes", s_nodes, "--heartbeat-ms", "1000", "--node-timeout-ms", s_to,
              a->plain ? "--plaintext" : NULL, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* Read each group's report: accepted nodes in all, and the latest time. */
static int collect_joins(group *g, int ng, double *t_done)
{
    int accepted = 0;
    *t_done = 0;
    for (int k = 0; k < ng; k++) {
        char line[64] = "";
        struct pollfd pfd = {g[k].report, POLLIN, 0};
        ssize_t r = poll(&pfd, 1, 700 * 1000) == 1 ? read(g[k].report, line, sizeof line - 1) : 0;
        int acc = 0;
        double t = 0;
        if (r > 0 && sscanf(line, "%d %lf", &acc, &t) == 2) {
            accepted += acc;
            *t_done = t > *t_done ? t : *t_done;
        }
        close(g[k].report);
    }
    return accepted;
}

static void stop_groups(group *g, int ng)
{
    for (int k = 0; k < ng; k++)
        if (g[k].pid > 0) {
            kill(g[k].pid, SIGTERM);
            waitpid(g[k].pid, NULL, 0);
            g[k].pid = 0;
        }
}

/* --vanish: kill the fast group at once; wait for its deaths and the new
 * plan; report from the log. */
static void vanish(const args *a, group *fast, const char *log)
{
    const double t_kill = day_s();
    kill(fast->pid, SIGKILL);
    waitpid(fast->pid, NULL, 0);
    fast->pid = 0;
    logscan ls;
    const double t0 = now_s();
    do {
        usleep(200000);
        scan_log(log, t_kill, &ls);
    } while ((ls.deaths_after < a->vanish || ls.plan_after_death < ls.last_death) &&
             now_s() - t0 < 3.0 * a->timeout_ms / 1e3 + 60);
    if (ls.plan_after_death < 0) {
        printf("vanish: %d nodes killed at once; %d declared dead; no plan was made after the "
               "kill (see the log)\n",
               a->vanish, ls.deaths_after);
        return;
    }
    printf("vanish: %d nodes killed at once; %d declared dead, the first %.2f s and the last "
           "%.2f s after the kill (--node-timeout-ms %d); the new plan %.2f s after the kill "
           "(%.3f s after the last death; planner %.3f s, %.3f s of CPU, over %d nodes)\n",
           a->vanish, ls.deaths_after, ls.first_death - t_kill, ls.last_death - t_kill,
           a->timeout_ms, ls.plan_after_death - t_kill, ls.plan_after_death - ls.last_death,
           ls.planner_s, ls.planner_cpu, ls.planner_nodes);
}

int main(int argc, char **argv)
{
    args a;
    if (!parse_args(argc, argv, &a)) {
        fprintf(stderr, "usage: bench_membership NEUROCOORD [NODES] [SECONDS] [--plaintext] "
                        "[--vanish K] [--per-proc P] [--timeout-ms T]\n");
        return 2;
    }
    nl_error e = {0};
    char dir[] = "/tmp/nl_bench_membership_XXXXXX", path[512], cfg[512], log[600];
    nl_keypair *kp = calloc((size_t)a.nodes, sizeof *kp);
    if (!kp || !make_dir(dir, a.nodes, kp, cfg, sizeof cfg))
        return 1;
    snprintf(log, sizeof log, "%s/coord.log", dir);
    const pid_t pid = start_coord(&a, dir, cfg, log);
    char ep[300] = "", pub[NL_KEY_Z85_LEN + 1] = "";
    snprintf(path, sizeof path, "%s/endpoint", dir);
    for (int i = 0; i < 100 && !ep[0]; i++) {
        FILE *f = fopen(path, "r");
        if (!f || !fgets(ep, sizeof ep, f))
            ep[0] = '\0';
        if (f)
            fclose(f);
        usleep(100000);
    }
    ep[strcspn(ep, "\n")] = '\0';
    snprintf(path, sizeof path, "%s/coordinator.pub", dir);
    if (!ep[0] || (!a.plain && nl_keys_load_public(pub, path, &e) != NL_OK)) {
        fprintf(stderr, "the coordinator did not start (see %s)\n", log);
        kill(pid, SIGTERM);
        return 1;
    }
    /* the groups: the fast ones first (--vanish), then P nodes a process */
    const int rest = a.nodes - a.vanish;
    const int ng = (a.vanish > 0) + (rest + a.per_proc - 1) / a.per_proc;
    group *g = calloc((size_t)ng, sizeof *g);
    if (!g)
        return 1;
    int k = 0;
    if (a.vanish > 0)
        g[k++] = (group){0, a.vanish, FAST_GFLOPS, 0, -1};
    for (int lo = a.vanish; lo < a.nodes; lo += a.per_proc, k++)
        g[k] = (group){lo, lo + a.per_proc < a.nodes ? lo + a.per_proc : a.nodes, 10.0, 0, -1};
    long rss;
    const double t0 = day_s(), cj0 = cpu_of(pid, &rss);
    for (k = 0; k < ng; k++)
        if (!start_group(&g[k], ep, pub, kp, a.plain)) {
            fprintf(stderr, "could not start group %d\n", k);
            stop_groups(g, k);
            kill(pid, SIGTERM);
            return 1;
        }
    double t_joined;
    const int accepted = collect_joins(g, ng, &t_joined);
    const double cj1 = cpu_of(pid, &rss);
    printf("%d nodes (%s, %d processes): %d accepted in %.2f s; the coordinator used %.2f s of "
           "CPU meanwhile; load average %.1f\n",
           a.nodes, a.plain ? "plaintext" : "CURVE", ng, accepted, t_joined - t0, cj1 - cj0,
           load_avg());
    /* all heartbeat every second: the coordinator's CPU and memory */
    logscan before, after;
    scan_log(log, 0, &before);
    long rss0 = 0, rss1 = 0;
    const double c0 = cpu_of(pid, &rss0), w0 = now_s();
    sleep((unsigned)a.secs);
    const double c1 = cpu_of(pid, &rss1), w1 = now_s();
    scan_log(log, 0, &after);
    printf("heartbeats: %d a second for %d s; the coordinator used %.1f%% of a core, resident "
           "%.1f MiB; %d nodes declared dead meanwhile\n",
           accepted, a.secs, 100.0 * (c1 - c0) / (w1 - w0), (double)rss1 / 1024,
           after.deaths - before.deaths);
    if (after.plan_after_join < 0)
        printf("plan: %d joins logged; no plan was made after the last join (see the log)\n",
               after.joins);
    else
        printf("plan: %d joins logged; the planner took %.3f s (%.3f s of CPU) over %d nodes (%d "
               "offered to it); the plan was made %.2f s after the last join\n",
               after.joins, after.planner_s, after.planner_cpu, after.planner_nodes,
               after.planner_offered, after.plan_after_join - after.last_join);
    if (a.vanish > 0)
        vanish(&a, &g[0], log);
    stop_groups(g, ng);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    printf("state directory (log, keys): %s\n", dir);
    free(g);
    free(kp);
    return accepted == a.nodes ? 0 : 1;
}
