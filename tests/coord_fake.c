/* The fakes that the coordinator's in-process tests (the test_coord*.c
 * programs) script: nodes and clients as plain DEALER sockets on
 * loopback, heartbeats, and pumps that turn the coordinator's loop until a
 * message arrives. Its checks count apart from the test's own (check.h's
 * counters are per file): the test adds them with coord_fake_add_counts. */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord.h"
#include "net/handshake.h"
#include "net/keys.h"
#include "net/transport.h"
#include "tests/check.h"
#include "tests/coord_fake.h"

nl_coord *coord;
nl_net *net;
fake nodes[3];

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

char coord_key[NL_KEY_Z85_LEN + 1];

/* Write text to dir/name (a check). */
static void write_file(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL, "%s", path);
    if (!fp)
        exit(1);
    fputs(text, fp);
    fclose(fp);
}

void coord_fake_start_with(const coord_fake_setup *s, char *dir, size_t cap)
{
    char cfg[512], text[512];
    snprintf(dir, cap, "/tmp/nl_test_%s_XXXXXX", s->tag);
    CHECK(mkdtemp(dir) != NULL, "mkdtemp %s", dir);
    snprintf(text, sizeof text,
             "hidden_dim: 64\nnum_layers: %d\nnum_heads: 4\nnum_kv_heads: 2\nffn_dim: 64\n"
             "num_experts: 4\nvocab_size: 256\nvocab_chunk: 256\nmax_seq_len: 256\n",
             s->layers ? s->layers : 6);
    write_file(dir, "cfg.yaml", text);
    if (s->authorized_keys)
        write_file(dir, "authorized_keys", s->authorized_keys);
    snprintf(cfg, sizeof cfg, "%s/cfg.yaml", dir);
    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = "tcp://127.0.0.1:*";
    o.state_dir = dir;
    o.config = cfg;
    o.seed = 7;
    o.min_nodes = 2;
    o.heartbeat_ms = HB_MS;
    o.node_timeout_ms = TIMEOUT_MS;
    o.plaintext = !s->authorized_keys;
    if (s->tweak)
        s->tweak(&o);
    nl_error err = {0};
    CHECK_OK(nl_coord_new(&coord, &o, &err), &err);
    if (!coord)
        exit(1);
    if (s->authorized_keys) {
        char pub[512];
        snprintf(pub, sizeof pub, "%s/coordinator.pub", dir);
        const nl_status st = nl_keys_load_public(coord_key, pub, &err);
        CHECK(st == NL_OK, "%s: %s", nl_status_str(st), err.msg);
        if (st != NL_OK)
            exit(1);
    }
}

void coord_fake_start(const char *tag, char *dir, size_t cap, void (*tweak)(nl_coord_opts *o))
{
    coord_fake_start_with(&(coord_fake_setup){.tag = tag, .tweak = tweak}, dir, cap);
}

void coord_fake_stop(const char *dir)
{
    nl_coord_destroy(&coord);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

/* A fake node (with a data endpoint), or a fake client (endpoint ""): on
 * the coordinator's nodes' or clients' socket. */
void fake_open(fake *f, const char *key, const char *endpoint)
{
    nl_error err = {0};
    memset(f, 0, sizeof *f);
    /* a JOIN names a key of 40 characters (Z85) */
    snprintf(f->key, sizeof f->key, "%s0000000000000000000000000000000000000000", key);
    snprintf(f->endpoint, sizeof f->endpoint, "%s", endpoint);
    nl_sock_opts o = {.type = ZMQ_DEALER, .plaintext = true, .name = "fake", .linger_ms = 0};
    CHECK_OK(nl_sock_new(&f->sock, net, &o, &err), &err);
    CHECK_OK(nl_sock_connect(
                 f->sock, endpoint[0] ? nl_coord_endpoint(coord) : nl_coord_client_endpoint(coord),
                 &err),
             &err);
}

void fake_send(fake *f, nl_wire_msg *m)
{
    nl_error err = {0};
    CHECK_OK(nl_sock_send(f->sock, NULL, 0, m, &err), &err);
    nl_wire_msg_free(m);
}

void heartbeats(void)
{
    const double t = now_s();
    for (int i = 0; i < 3; i++) {
        fake *f = &nodes[i];
        if (!f->beating || (t - f->last_beat) * 1e3 < HB_MS)
            continue;
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
        m.u.heartbeat = (nl_msg_heartbeat){.node_id = f->id,
                                           .seq = ++f->seq,
                                           .reduce_bytes = f->reduce_bytes,
                                           .reduce_s = f->reduce_s};
        fake_send(f, &m);
        f->last_beat = t;
    }
}

/* Turn the coordinator's loop (and the fake nodes' heartbeats) until f
 * receives a message of type want into rx; other messages to f are
 * skipped. Returns 0 on time out. */
int pump_until(fake *f, nl_msg_type want, nl_rx *rx)
{
    if (pump_until_for(f, want, rx, WAIT_S))
        return 1;
    fprintf(stderr, "%s: no %s within %.0f s (coordinator: %s)\n", f->key, nl_wire_type_name(want),
            WAIT_S, nl_coord_state(coord));
    return 0;
}

int pump_until_for(fake *f, nl_msg_type want, nl_rx *rx, double seconds)
{
    const double t0 = now_s();
    while (now_s() - t0 < seconds) {
        nl_coord_step(coord, 5);
        heartbeats();
        nl_error err = {0};
        nl_rx_free(rx);
        nl_rx_init(rx);
        if (nl_sock_recv(f->sock, rx, 0, &err) != NL_OK)
            continue;
        if (rx->msg.type == want)
            return 1;
        NL_DEBUG("%s: skipped %s", f->key, nl_wire_type_name(rx->msg.type));
    }
    return 0;
}

/* Turn the loop until the coordinator's state begins with prefix. */
int pump_state(const char *prefix)
{
    const double t0 = now_s();
    while (now_s() - t0 < WAIT_S) {
        if (strncmp(nl_coord_state(coord), prefix, strlen(prefix)) == 0)
            return 1;
        nl_coord_step(coord, 5);
        heartbeats();
    }
    fprintf(stderr, "state '%s' is not '%s...'\n", nl_coord_state(coord), prefix);
    return 0;
}

int fake_take_plan(fake *f)
{
    nl_rx rx;
    nl_rx_init(&rx);
    uint64_t epoch = 0;
    int ok = pump_until(f, NL_MSG_ASSIGN, &rx);
    if (ok)
        epoch = rx.msg.u.assign.epoch;
    ok = ok && pump_until(f, NL_MSG_LOAD_DONE, &rx);
    if (ok) {
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_LOAD_DONE);
        m.u.load_done = (nl_msg_load_done){epoch, f->id, 0, 1000};
        fake_send(f, &m);
    }
    nl_rx_free(&rx);
    return ok;
}

int fakes_take_plan(int count)
{
    int ok = 1;
    for (int i = 0; i < count && ok; i++)
        ok = fake_take_plan(&nodes[i]);
    return ok && pump_state("ready");
}

int check_pump(int ok, const char *what)
{
    CHECK(ok, "%s", what);
    return ok;
}

int fake_query_status(fake *f, nl_rx *rx)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
    m.u.job_ref.job_id = 0;
    fake_send(f, &m);
    return pump_until(f, NL_MSG_JOB_STATUS, rx);
}

/* The status JSON the coordinator answers f's query with (malloc'd). */
char *fake_status_text(fake *f)
{
    nl_rx rx;
    nl_rx_init(&rx);
    char *text = NULL;
    if (fake_query_status(f, &rx) && rx.msg.nframes == 1) {
        const size_t n = (size_t)rx.msg.frames[0].t.shape[0];
        if ((text = malloc(n + 1))) {
            memcpy(text, rx.msg.frames[0].t.data, n);
            text[n] = '\0';
        }
    }
    nl_rx_free(&rx);
    return text;
}

/* ---------------------------------------------------------------- joins */

/* The heartbeat period and timeout an ACCEPT must carry. */
int join_hb = HB_MS, join_to = TIMEOUT_MS;

void join(fake *f, double gflops)
{
    if (!join_for(f, gflops, WAIT_S))
        fprintf(stderr, "%s: no ACCEPT within %.0f s (coordinator: %s)\n", f->key, WAIT_S,
                nl_coord_state(coord));
}

void fake_send_join(fake *f, double gflops)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    /* slow nodes: compute outweighs the hop, so the planner uses both */
    m.u.join = (nl_msg_join){f->key, "cpu", 1ull << 30, gflops, 1, f->endpoint, 0};
    fake_send(f, &m);
}

int join_for(fake *f, double gflops, double seconds)
{
    int ok = 0;
    nl_rx rx;
    nl_rx_init(&rx);
    fake_send_join(f, gflops);
    if (pump_until_for(f, NL_MSG_ACCEPT, &rx, seconds)) {
        ok = 1;
        f->id = rx.msg.u.accept.node_id;
        CHECK(f->id > 0 && rx.msg.u.accept.heartbeat_ms == (uint32_t)join_hb &&
                  rx.msg.u.accept.timeout_ms == (uint32_t)join_to,
              "ACCEPT %u %u %u", f->id, rx.msg.u.accept.heartbeat_ms, rx.msg.u.accept.timeout_ms);
        f->beating = 1;
    }
    nl_rx_free(&rx);
    return ok;
}

void coord_fake_add_counts(int *pass, int *fail)
{
    *pass += check_pass_count;
    *fail += check_fail_count;
}

uint32_t coord_fake_train_params(nl_wire_param *ps, const char *data, const char *ckpt,
                                 int64_t steps, int64_t micro)
{
    const nl_wire_param p[] = {
        {.key = "steps", .kind = NL_WIRE_PARAM_INT, .i = steps},
        {.key = "batch", .kind = NL_WIRE_PARAM_INT, .i = 2},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 8},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = micro},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "warmup", .kind = NL_WIRE_PARAM_INT, .i = 0},
        {.key = "eval_every", .kind = NL_WIRE_PARAM_INT, .i = 0},
        {.key = "eval_batches", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "checkpoint_every", .kind = NL_WIRE_PARAM_INT, .i = 0},
        {.key = "lr", .kind = NL_WIRE_PARAM_FLOAT, .f = 1e-3},
        {.key = "min_lr", .kind = NL_WIRE_PARAM_FLOAT, .f = 1e-4},
        {.key = "holdout", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.0},
        {.key = "data", .kind = NL_WIRE_PARAM_STR, .s = data},
        {.key = "checkpoint_dir", .kind = NL_WIRE_PARAM_STR, .s = ckpt},
    };
    memcpy(ps, p, sizeof p);
    return (uint32_t)(sizeof p / sizeof p[0]);
}
