/* bench_wire: one hop between two processes over TCP loopback.
 *
 * Throughput: a sender process streams ACTIVATION messages (msgpack header
 * + one F32 frame of 1 MiB or 8 MiB, sent without copying) to a receiver
 * process that decodes and validates each; side by side with a bare libzmq
 * PUSH/PULL of the same payload bytes (also zero-copy), plaintext and
 * CURVE. Latency: round trips of a small message (our HEARTBEAT through
 * DEALER/ROUTER, or 64 bare bytes). Prints JSON on stdout.
 *
 * The machine may be shared, so every throughput variant runs --reps
 * times, interleaved (bare, ours, ... with the order of each pair
 * alternating between reps), and the median and the best are reported;
 * the ratios compare medians.
 *
 *   bench_wire [--mib N] [--reps N] [--lat N]
 *     --mib N   MiB streamed per throughput run (default 1024)
 *     --reps N  runs per variant (default 5)
 *     --lat N   round trips per latency run (default 5000) */
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "base/log.h"
#include "net/transport.h"

#define HWM 16
/* The clock starts when the first message arrives (as libzmq's local_thr
 * does): starting later would count messages that were already queued in
 * the high-water marks (up to 2 x HWM x 8 MiB) as if they had just come. */
#define WARM 1
#define LAT_WARM 200

typedef struct keys {
    nl_keypair server, client;
} keys;

typedef struct bcase {
    bool ours, curve;
    size_t bytes;
    int count;
} bcase;

static float *payload; /* 8 MiB, shared read-only by every send */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what)
{
    fprintf(stderr, "bench_wire: %s\n", what);
    exit(1);
}

/* ---- bare libzmq ---- */

static void *bare_socket(void *ctx, int type, bool curve, bool server, const keys *k)
{
    void *s = zmq_socket(ctx, type);
    int hwm = HWM, one = 1, linger = 0;
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    if (curve && server) {
        zmq_setsockopt(s, ZMQ_CURVE_SERVER, &one, sizeof one);
        zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, k->server.secret_z85, 41);
    } else if (curve) {
        zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, k->server.public_z85, 41);
        zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, k->client.public_z85, 41);
        zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, k->client.secret_z85, 41);
    }
    return s;
}

/* ---- ours ---- */

static nl_sock *our_socket(nl_net *net, int type, bool curve, bool server, const keys *k)
{
    nl_sock_opts o = {.type = type,
                      .keys = server ? &k->server : &k->client,
                      .curve_server = server,
                      .server_key = k->server.public_z85,
                      .plaintext = !curve,
                      .name = server ? "bench-server" : "bench-client",
                      .hwm = HWM,
                      .linger_ms = 0};
    nl_sock *s = NULL;
    nl_error err;
    if (nl_sock_new(&s, net, &o, &err) != NL_OK)
        die(err.msg);
    if (server && curve) {
        const char *allow[] = {k->client.public_z85};
        if (nl_sock_allow(s, allow, 1, &err) != NL_OK)
            die(err.msg);
    }
    return s;
}

static nl_net *our_net(void)
{
    nl_net *net = NULL;
    nl_error err;
    if (nl_net_new(&net, NULL, &err) != NL_OK)
        die(err.msg);
    return net;
}

static void activation(nl_wire_msg *m, nl_txref *ref, size_t bytes, uint64_t step)
{
    int64_t shape[2] = {(int64_t)(bytes / 4096), 1024};
    nl_wire_msg_reset(m, NL_MSG_ACTIVATION);
    m->u.hop = (nl_msg_tensor_hop){1, step, (uint32_t)(step % 8), 0, 0, 0.0};
    nl_txref_frame(&m->frames[0], ref, payload, NL_DTYPE_F32, shape, 2);
    m->nframes = 1;
}

/* ---- throughput: the child sends, the parent receives and times ---- */

static void child_send(const bcase *c, const char *ep, const keys *k, int done_fd)
{
    char b;
    int total = WARM + c->count;
    if (!c->ours) {
        void *ctx = zmq_ctx_new();
        void *s = bare_socket(ctx, ZMQ_PUSH, c->curve, false, k);
        zmq_connect(s, ep);
        for (int i = 0; i < total; i++) {
            zmq_msg_t m;
            zmq_msg_init_data(&m, payload, c->bytes, NULL, NULL);
            if (zmq_msg_send(&m, s, 0) < 0)
                die("bare send");
        }
        if (read(done_fd, &b, 1) != 1)
            die("pipe");
        zmq_close(s);
        zmq_ctx_term(ctx);
        return;
    }
    nl_net *net = our_net();
    nl_sock *s = our_socket(net, ZMQ_PUSH, c->curve, false, k);
    nl_error err;
    nl_wire_msg m;
    nl_txref ref = {0};
    nl_wire_msg_init(&m);
    if (nl_sock_connect(s, ep, &err) != NL_OK)
        die(err.msg);
    for (int i = 0; i < total; i++) {
        activation(&m, &ref, c->bytes, (uint64_t)i);
        if (nl_sock_send(s, NULL, 0, &m, &err) != NL_OK)
            die(err.msg);
    }
    if (read(done_fd, &b, 1) != 1)
        die("pipe");
    nl_sock_destroy(&s);
    nl_net_destroy(&net);
}

static double parent_recv(const bcase *c, const keys *k, int ep_fd, int done_fd)
{
    char ep[256];
    double t0 = 0, t1 = 0;
    int total = WARM + c->count;
    if (!c->ours) {
        void *ctx = zmq_ctx_new();
        void *s = bare_socket(ctx, ZMQ_PULL, c->curve, true, k);
        size_t len = sizeof ep;
        zmq_bind(s, "tcp://127.0.0.1:*");
        zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len);
        if (write(ep_fd, ep, sizeof ep) != (ssize_t)sizeof ep)
            die("pipe");
        zmq_msg_t m;
        zmq_msg_init(&m);
        for (int i = 0; i < total; i++) {
            if (i == WARM)
                t0 = now_s();
            if (zmq_msg_recv(&m, s, 0) < 0 || zmq_msg_size(&m) != c->bytes)
                die("bare recv");
        }
        t1 = now_s();
        zmq_msg_close(&m);
        zmq_close(s);
        zmq_ctx_term(ctx);
    } else {
        nl_net *net = our_net();
        nl_sock *s = our_socket(net, ZMQ_PULL, c->curve, true, k);
        nl_error err;
        nl_rx rx;
        nl_rx_init(&rx);
        if (nl_sock_bind(s, "tcp://127.0.0.1:*", &err) != NL_OK)
            die(err.msg);
        snprintf(ep, sizeof ep, "%s", nl_sock_endpoint(s));
        if (write(ep_fd, ep, sizeof ep) != (ssize_t)sizeof ep)
            die("pipe");
        for (int i = 0; i < total; i++) {
            if (i == WARM)
                t0 = now_s();
            if (nl_sock_recv(s, &rx, 30000, &err) != NL_OK)
                die(err.msg);
            if (rx.msg.type != NL_MSG_ACTIVATION || rx.msg.frames[0].len != c->bytes)
                die("wrong message");
        }
        t1 = now_s();
        nl_rx_free(&rx);
        nl_sock_destroy(&s);
        nl_net_destroy(&net);
    }
    if (write(done_fd, "x", 1) != 1)
        die("pipe");
    return (double)c->count * (double)c->bytes / (t1 - t0) / 1e9;
}

static double run_throughput(const bcase *c, const keys *k)
{
    int ep_pipe[2], done_pipe[2];
    if (pipe(ep_pipe) || pipe(done_pipe))
        die("pipe");
    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        char ep[256];
        if (read(ep_pipe[0], ep, sizeof ep) != (ssize_t)sizeof ep)
            _exit(1);
        child_send(c, ep, k, done_pipe[0]);
        _exit(0);
    }
    double gbps = parent_recv(c, k, ep_pipe[1], done_pipe[1]);
    int status;
    waitpid(pid, &status, 0);
    close(ep_pipe[0]);
    close(ep_pipe[1]);
    close(done_pipe[0]);
    close(done_pipe[1]);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        die("sender failed");
    return gbps;
}

/* ---- latency: the child pings and measures, the parent echoes ---- */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void child_ping(bool ours, bool curve, int iters, const char *ep, const keys *k, int res_fd)
{
    double *rtt = calloc((size_t)iters, sizeof *rtt), stats[4] = {0};
    int total = LAT_WARM + iters;
    if (!ours) {
        void *ctx = zmq_ctx_new();
        void *s = bare_socket(ctx, ZMQ_DEALER, curve, false, k);
        char buf[64] = {0};
        zmq_connect(s, ep);
        for (int i = 0; i < total; i++) {
            double t = now_s();
            zmq_send(s, buf, sizeof buf, 0);
            if (zmq_recv(s, buf, sizeof buf, 0) != (int)sizeof buf)
                die("bare pong");
            if (i >= LAT_WARM)
                rtt[i - LAT_WARM] = (now_s() - t) * 1e6;
        }
        zmq_close(s);
        zmq_ctx_term(ctx);
    } else {
        nl_net *net = our_net();
        nl_sock *s = our_socket(net, ZMQ_DEALER, curve, false, k);
        nl_error err;
        nl_rx rx;
        nl_wire_msg m;
        nl_rx_init(&rx);
        nl_wire_msg_init(&m);
        if (nl_sock_connect(s, ep, &err) != NL_OK)
            die(err.msg);
        for (int i = 0; i < total; i++) {
            double t = now_s();
            nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
            m.u.heartbeat = (nl_msg_heartbeat){
                .node_id = 1, .seq = (uint64_t)i, .state = NL_NODE_BUSY, .load = 0.5};
            if (nl_sock_send(s, NULL, 0, &m, &err) != NL_OK ||
                nl_sock_recv(s, &rx, 30000, &err) != NL_OK)
                die(err.msg);
            if (i >= LAT_WARM)
                rtt[i - LAT_WARM] = (now_s() - t) * 1e6;
        }
        nl_rx_free(&rx);
        nl_sock_destroy(&s);
        nl_net_destroy(&net);
    }
    qsort(rtt, (size_t)iters, sizeof *rtt, cmp_double);
    for (int i = 0; i < iters; i++)
        stats[0] += rtt[i] / iters;
    stats[1] = rtt[iters / 2];
    stats[2] = rtt[iters * 9 / 10];
    stats[3] = rtt[iters * 99 / 100];
    if (write(res_fd, stats, sizeof stats) != (ssize_t)sizeof stats)
        _exit(1);
    free(rtt);
}

static void parent_echo(bool ours, bool curve, int iters, const keys *k, int ep_fd)
{
    char ep[256];
    int total = LAT_WARM + iters;
    if (!ours) {
        void *ctx = zmq_ctx_new();
        void *s = bare_socket(ctx, ZMQ_ROUTER, curve, true, k);
        size_t len = sizeof ep;
        zmq_bind(s, "tcp://127.0.0.1:*");
        zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len);
        if (write(ep_fd, ep, sizeof ep) != (ssize_t)sizeof ep)
            die("pipe");
        for (int i = 0; i < total; i++) {
            char rid[256], buf[64];
            int n = zmq_recv(s, rid, sizeof rid, 0);
            if (n < 0 || zmq_recv(s, buf, sizeof buf, 0) < 0)
                die("bare echo");
            zmq_send(s, rid, (size_t)n, ZMQ_SNDMORE);
            zmq_send(s, buf, sizeof buf, 0);
        }
        zmq_close(s);
        zmq_ctx_term(ctx);
        return;
    }
    nl_net *net = our_net();
    nl_sock *s = our_socket(net, ZMQ_ROUTER, curve, true, k);
    nl_error err;
    nl_rx rx;
    nl_wire_msg m;
    nl_rx_init(&rx);
    nl_wire_msg_init(&m);
    if (nl_sock_bind(s, "tcp://127.0.0.1:*", &err) != NL_OK)
        die(err.msg);
    snprintf(ep, sizeof ep, "%s", nl_sock_endpoint(s));
    if (write(ep_fd, ep, sizeof ep) != (ssize_t)sizeof ep)
        die("pipe");
    for (int i = 0; i < total; i++) {
        if (nl_sock_recv(s, &rx, 30000, &err) != NL_OK)
            die(err.msg);
        nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
        m.u.heartbeat = rx.msg.u.heartbeat;
        if (nl_sock_reply(s, &rx, &m, &err) != NL_OK)
            die(err.msg);
    }
    nl_rx_free(&rx);
    nl_sock_destroy(&s);
    nl_net_destroy(&net);
}

static void run_latency(bool ours, bool curve, int iters, const keys *k, double stats[4])
{
    int ep_pipe[2], res_pipe[2];
    if (pipe(ep_pipe) || pipe(res_pipe))
        die("pipe");
    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        char ep[256];
        if (read(ep_pipe[0], ep, sizeof ep) != (ssize_t)sizeof ep)
            _exit(1);
        child_ping(ours, curve, iters, ep, k, res_pipe[1]);
        _exit(0);
    }
    parent_echo(ours, curve, iters, k, ep_pipe[1]);
    if (read(res_pipe[0], stats, 4 * sizeof(double)) != (ssize_t)(4 * sizeof(double)))
        die("latency results");
    int status;
    waitpid(pid, &status, 0);
    close(ep_pipe[0]);
    close(ep_pipe[1]);
    close(res_pipe[0]);
    close(res_pipe[1]);
}

/* ---- main ---- */

static double loadavg(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1)
            l = -1;
        fclose(f);
    }
    return l;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
    long mib = 1024;
    int lat = 5000, reps = 5;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--mib") == 0 && i + 1 < argc)
            mib = atol(argv[++i]);
        else if (strcmp(argv[i], "--lat") == 0 && i + 1 < argc)
            lat = atoi(argv[++i]);
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_wire [--mib N] [--reps N] [--lat N]\n");
            return 2;
        }
    }
    if (mib < 16 || lat < 10 || reps < 1 || reps > 100)
        die("--mib must be >= 16, --lat >= 10, --reps 1 to 100");
    nl_log_set_level(NL_LOG_ERROR); /* the plaintext runs would warn on every socket */
    signal(SIGPIPE, SIG_IGN);
    payload = malloc(8u << 20);
    for (size_t i = 0; i < (8u << 20) / 4; i++)
        payload[i] = (float)(i % 1000) * 0.001f;
    keys k;
    nl_error err;
    if (nl_keys_generate(&k.server, &err) != NL_OK || nl_keys_generate(&k.client, &err) != NL_OK)
        die(err.msg);

    const char *names[4] = {"bare_plain", "ours_plain", "bare_curve", "ours_curve"};
    printf("{\n  \"bench\": \"wire\",\n  \"transport\": \"tcp://127.0.0.1, two processes\",\n");
    printf("  \"cores\": %ld,\n  \"loadavg_at_start\": %.2f,\n", sysconf(_SC_NPROCESSORS_ONLN),
           loadavg());
    printf("  \"mib_per_run\": %ld,\n  \"reps\": %d,\n  \"throughput_GBps\": [\n", mib, reps);
    size_t sizes[2] = {1u << 20, 8u << 20};
    double *runs = calloc((size_t)reps * 4, sizeof *runs);
    for (int si = 0; si < 2; si++) {
        for (int r = 0; r < reps; r++)
            for (int j = 0; j < 4; j++) {
                /* alternate who goes first, so neither side always runs
                 * right after the CPU-heavy CURVE runs */
                int v = r % 2 ? j ^ 1 : j;
                bcase c = {.ours = v % 2 == 1,
                           .curve = v >= 2,
                           .bytes = sizes[si],
                           .count = (int)(mib * (1 << 20) / (long)sizes[si])};
                runs[v * reps + r] = run_throughput(&c, &k);
            }
        double med[4], best[4];
        for (int v = 0; v < 4; v++) {
            med[v] = median(runs + v * reps, reps);
            best[v] = runs[v * reps + reps - 1];
        }
        printf("    {\"message_bytes\": %zu,\n", sizes[si]);
        for (int v = 0; v < 4; v++)
            printf("     \"%s\": {\"median\": %.3f, \"best\": %.3f},\n", names[v], med[v], best[v]);
        printf("     \"ratio_plain\": %.3f, \"ratio_curve\": %.3f}%s\n", med[1] / med[0],
               med[3] / med[2], si ? "" : ",");
        fflush(stdout);
    }
    free(runs);
    printf("  ],\n  \"round_trip_us\": {\n");
    for (int v = 0; v < 4; v++) {
        double st[4];
        run_latency(v % 2 == 1, v >= 2, lat, &k, st);
        printf("    \"%s\": {\"mean\": %.1f, \"p50\": %.1f, \"p90\": %.1f, \"p99\": %.1f}%s\n",
               names[v], st[0], st[1], st[2], st[3], v == 3 ? "" : ",");
        fflush(stdout);
    }
    printf("  },\n  \"round_trips\": %d,\n  \"loadavg_at_end\": %.2f\n}\n", lat, loadavg());
    nl_keys_wipe(&k.server);
    nl_keys_wipe(&k.client);
    free(payload);
    return 0;
}
