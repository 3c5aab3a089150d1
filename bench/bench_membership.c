/* bench_membership: many lightweight simulated nodes against one
 * coordinator (issue 22, "toward internet scale"); run by hand.
 *
 *   bench_membership NEUROCOORD [NODES] [SECONDS] [--plaintext]
 *
 * Starts NEUROCOORD (a 64-layer config, --min-nodes NODES, heartbeats every
 * second) in a fresh state directory whose authorized_keys admits NODES
 * generated CURVE keys; NODES DEALER sockets (spread over contexts of at
 * most 900 sockets each) JOIN over loopback and then heartbeat every second
 * for SECONDS. It reports how long the joins took, the coordinator's CPU
 * share and resident memory while they all heartbeat (from
 * /proc/PID/stat and status), and how long the coordinator took from the
 * last JOIN to its plan (its log's "state: loading" line). The simulated
 * nodes answer nothing else: the plan's loads go unanswered. */
#define _GNU_SOURCE
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

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
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

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench_membership NEUROCOORD [NODES] [SECONDS] [--plaintext]\n");
        return 2;
    }
    const int nodes = argc > 2 ? atoi(argv[2]) : 1000, secs = argc > 3 ? atoi(argv[3]) : 10;
    const int plain = argc > 4 && strcmp(argv[4], "--plaintext") == 0;
    nl_error e = {0};
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) { /* two descriptors a socket, and some */
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    char dir[] = "/tmp/nl_bench_membership_XXXXXX", path[512];
    if (!mkdtemp(dir))
        return 1;
    nl_keypair *kp = calloc((size_t)nodes, sizeof *kp);
    snprintf(path, sizeof path, "%s/authorized_keys", dir);
    FILE *ak = fopen(path, "w");
    for (int i = 0; kp && ak && i < nodes; i++) {
        if (nl_keys_generate(&kp[i], &e) != NL_OK)
            return 1;
        fprintf(ak, "%s\n", kp[i].public_z85);
    }
    if (!kp || !ak)
        return 1;
    fclose(ak);
    snprintf(path, sizeof path, "%s/cfg.yaml", dir);
    FILE *cf = fopen(path, "w");
    if (!cf)
        return 1;
    fputs("hidden_dim: 256\nnum_layers: 64\nnum_heads: 4\nnum_kv_heads: 2\nffn_dim: 512\n"
          "num_experts: 4\nvocab_size: 1024\nvocab_chunk: 1024\nmax_seq_len: 256\n",
          cf);
    fclose(cf);
    char s_nodes[32], log[600];
    snprintf(s_nodes, sizeof s_nodes, "%d", nodes);
    snprintf(log, sizeof log, "%s/coord.log", dir);
    const pid_t pid = fork();
    if (pid == 0) {
        if (!freopen(log, "w", stderr))
            _exit(1);
        execl(argv[1], argv[1], "--listen", "tcp://127.0.0.1:*", "--state-dir", dir, "--config",
              path, "--min-nodes", s_nodes, "--heartbeat-ms", "1000", "--node-timeout-ms", "10000",
              plain ? "--plaintext" : NULL, (char *)NULL);
        _exit(127);
    }
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
    if (!ep[0] || (!plain && nl_keys_load_public(pub, path, &e) != NL_OK)) {
        fprintf(stderr, "the coordinator did not start (see %s)\n", log);
        kill(pid, SIGTERM);
        return 1;
    }
    const int nctx = (nodes + PER_CTX - 1) / PER_CTX;
    nl_net **net = calloc((size_t)nctx, sizeof *net);
    nl_sock **s = calloc((size_t)nodes, sizeof *s);
    uint32_t *id = calloc((size_t)nodes, sizeof *id);
    uint64_t *seq = calloc((size_t)nodes, sizeof *seq);
    for (int k = 0; k < nctx; k++) {
        nl_net_opts no = nl_net_opts_default();
        if (nl_net_new(&net[k], &no, &e) != NL_OK) {
            fprintf(stderr, "context %d: %s\n", k, e.msg);
            return 1;
        }
    }
    /* JOIN, all of them, then collect the ACCEPTs */
    const double t0 = now_s();
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (int i = 0; i < nodes; i++) {
        char dep[64];
        nl_sock_opts o = {.type = ZMQ_DEALER,
                          .keys = &kp[i],
                          .server_key = pub,
                          .plaintext = plain,
                          .name = "sim",
                          .linger_ms = 0,
                          .kind = NL_SOCK_CONTROL};
        if (nl_sock_new(&s[i], net[i / PER_CTX], &o, &e) != NL_OK ||
            nl_sock_connect(s[i], ep, &e) != NL_OK) {
            fprintf(stderr, "node %d: %s\n", i, e.msg);
            return 1;
        }
        snprintf(dep, sizeof dep, "tcp://127.0.0.1:%d", 30000 + i);
        nl_wire_msg_reset(&m, NL_MSG_JOIN);
        m.u.join = (nl_msg_join){kp[i].public_z85, "cpu", 1ull << 30, 10.0 + i % 7, 1, dep};
        nl_sock_send(s[i], NULL, 0, &m, &e);
    }
    /* collect the ACCEPTs; the accepted heartbeat every second meanwhile */
    int accepted = 0;
    nl_rx rx;
    nl_rx_init(&rx);
    double beat = now_s();
    while (accepted < nodes && now_s() - t0 < 300) {
        for (int i = 0; i < nodes; i++)
            while (nl_sock_recv(s[i], &rx, 0, &e) == NL_OK) {
                if (rx.msg.type == NL_MSG_ACCEPT && !id[i]) {
                    id[i] = rx.msg.u.accept.node_id;
                    accepted++;
                }
                nl_rx_free(&rx);
            }
        if (now_s() - beat >= 1.0) {
            beat = now_s();
            for (int i = 0; i < nodes; i++)
                if (id[i]) {
                    nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
                    m.u.heartbeat = (nl_msg_heartbeat){.node_id = id[i], .seq = ++seq[i]};
                    nl_sock_send(s[i], NULL, 0, &m, &e);
                }
        }
        usleep(1000);
    }
    const double t_joined = now_s();
    printf("%d nodes (%s): %d accepted in %.2f s\n", nodes, plain ? "plaintext" : "CURVE", accepted,
           t_joined - t0);
    /* heartbeats every second for secs seconds; the coordinator's CPU meanwhile */
    long rss0 = 0, rss1 = 0;
    const double c0 = cpu_of(pid, &rss0), w0 = now_s();
    for (int r = 0; r < secs; r++) {
        const double tr = now_s();
        for (int i = 0; i < nodes; i++) {
            nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
            m.u.heartbeat = (nl_msg_heartbeat){.node_id = id[i], .seq = ++seq[i]};
            nl_sock_send(s[i], NULL, 0, &m, &e);
            while (nl_sock_recv(s[i], &rx, 0, &e) == NL_OK) /* ASSIGN, LAYER_LOAD...: drop */
                nl_rx_free(&rx);
        }
        const double left = 1.0 - (now_s() - tr);
        if (left > 0)
            usleep((useconds_t)(left * 1e6));
    }
    const double c1 = cpu_of(pid, &rss1), w1 = now_s();
    printf("heartbeats: %d a second for %d s; the coordinator used %.1f%% of a core, resident "
           "%.1f MiB\n",
           nodes, secs, 100.0 * (c1 - c0) / (w1 - w0), (double)rss1 / 1024);
    nl_wire_msg_free(&m);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    char cmd[3000];
    snprintf(cmd, sizeof cmd,
             "echo \"coordinator log: $(grep -c ' joined: ' %s) joins; plan made at $(grep -m1 "
             "'state: loading' %s | cut -c1-12) (last join at $(grep ' joined: ' %s | tail -1 | "
             "cut -c1-12))\"",
             log, log, log);
    fflush(stdout);
    if (system(cmd) != 0)
        fprintf(stderr, "could not read %s\n", log);
    for (int i = 0; i < nodes; i++)
        nl_sock_destroy(&s[i]);
    for (int k = 0; k < nctx; k++)
        nl_net_destroy(&net[k]);
    printf("state directory: %s\n", dir);
    return accepted == nodes ? 0 : 1;
}
