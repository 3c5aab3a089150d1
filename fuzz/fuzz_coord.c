/* Fuzz target for the coordinator's dispatch (coordinator/, issue 15):
 * sequences of decoded messages from nodes and clients, with the roles the
 * fuzzer gives their keys, driving one coordinator in-process.
 *
 * Each input gets a fresh coordinator (plaintext, a tiny model from a
 * config, min_nodes 1) and three peers, plain DEALER sockets with routing
 * ids "p0", "p1", "p2" that are connected (so what the coordinator sends
 * them goes somewhere) and drained after every message. The input is a
 * sequence of records (at most 64):
 *   byte 0      bits 0-1: the sender (0..2; 3 is 0 again); bits 2-4: its
 *               roles (NL_KEY_ROLE_* bits); bit 5: turn the loop once
 *               after (nl_coord_step: timers, planning, workers)
 *   byte 1      the number of frames (0..3)
 *   u16 LE + n  the header, then each frame likewise
 * A record that does not decode is skipped, as the transport would. Each
 * part is copied into a heap block of exactly its size (ASan sees reads
 * past its end).
 *
 * Property: no crash, no sanitizer report, whatever the peers send.
 *
 * Built with -DNL_COORD_CORPUS_MAIN it is instead the seed corpus writer
 * (fuzz/corpus/coord): `coord_corpus DIR`. */
#define _XOPEN_SOURCE 700 /* nftw */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "net/transport.h"
#include "net/wire.h"

#include "fuzz/coord_state.h"
#include "fuzz/records.h"

#define PEERS 3
#define MAX_RECORDS 64

#ifndef NL_COORD_CORPUS_MAIN

static const char *const cfg_yaml =
    "hidden_dim: 16\nnum_layers: 2\nnum_heads: 2\nnum_kv_heads: 1\nffn_dim: 16\n"
    "num_experts: 2\nvocab_size: 64\nvocab_chunk: 64\nmax_seq_len: 32\n";

static char state_dir[256];
static nl_net *fake_net;

/* at exit: the state dir and what the coordinators wrote there */
static void remove_state_dir(void)
{
    coord_state_remove(state_dir);
}

/* Once: a state dir with the config and a data file in its data root,
 * removed at exit. */
static int setup(void)
{
    snprintf(state_dir, sizeof state_dir, "/tmp/nl_fuzz_coord_XXXXXX");
    if (!mkdtemp(state_dir))
        return -1;
    atexit(remove_state_dir);
    if (coord_state_fill(state_dir, cfg_yaml) != 0)
        return -1;
    nl_log_set_level(getenv("NL_FUZZ_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_ERROR);
    nl_error err = {0};
    return nl_net_new(&fake_net, NULL, &err) == NL_OK ? 0 : -1;
}

static void drain(nl_sock **peers)
{
    for (int i = 0; i < PEERS; i++) {
        nl_rx rx;
        nl_rx_init(&rx);
        nl_error e = {0};
        while (nl_sock_recv(peers[i], &rx, 0, &e) != NL_ERR_TIMEOUT) {
            nl_rx_free(&rx);
            nl_rx_init(&rx);
        }
        nl_rx_free(&rx);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready = 0;
    if (!ready) {
        if (setup() != 0)
            abort();
        ready = 1;
    }
    char cfg[400];
    snprintf(cfg, sizeof cfg, "%s/cfg.yaml", state_dir);
    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = "tcp://127.0.0.1:*";
    o.state_dir = state_dir;
    o.config = cfg;
    o.plaintext = 1;
    o.min_nodes = 1;
    o.job_timeout_ms = 100000;
    o.node_timeout_ms = 100000;
    o.heartbeat_ms = 1000;
    nl_error err = {0};
    nl_coord *c = NULL;
    if (nl_coord_new(&c, &o, &err) != NL_OK)
        abort();
    nl_sock *peers[PEERS] = {0};
    for (int i = 0; i < PEERS; i++) {
        char rid[4] = {'p', (char)('0' + i), 0};
        nl_sock_opts so = {.type = ZMQ_DEALER, .plaintext = true, .name = "peer", .linger_ms = 0};
        if (nl_sock_new(&peers[i], fake_net, &so, &err) != NL_OK)
            abort();
        zmq_setsockopt(nl_sock_handle(peers[i]), ZMQ_ROUTING_ID, rid, 2);
        /* both sockets, one routing id: replies from either reach it */
        if (nl_sock_connect(peers[i], nl_coord_endpoint(c), &err) != NL_OK ||
            nl_sock_connect(peers[i], nl_coord_client_endpoint(c), &err) != NL_OK)
            abort();
        /* a HELLO through the socket: once answered, the coordinator knows it */
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_HELLO);
        m.u.hello = (nl_msg_hello){NL_ROLE_CLIENT, "fuzz"};
        nl_sock_send(peers[i], NULL, 0, &m, &err);
        nl_wire_msg_free(&m);
        nl_rx rx;
        nl_rx_init(&rx);
        for (int k = 0; k < 2000; k++) {
            nl_coord_step(c, 1);
            nl_error e = {0};
            if (nl_sock_recv(peers[i], &rx, 0, &e) == NL_OK)
                break;
        }
        nl_rx_free(&rx);
    }
    const nl_wire_limits lim = nl_wire_limits_default();
    const uint8_t *p = data;
    size_t left = size;
    for (int r = 0; r < MAX_RECORDS && left >= 2; r++) {
        const int who = p[0] & 3, roles = (p[0] >> 2) & 7, turn = (p[0] >> 5) & 1;
        int nparts = 1 + (p[1] & 3);
        p += 2;
        left -= 2;
        nl_wire_part parts[4];
        void *bufs[4] = {0};
        fuzz_parts_read(&p, &left, nparts, parts, bufs);
        nl_rx rx;
        nl_rx_init(&rx);
        const int sender = who == 3 ? 0 : who;
        rx.rid[0] = 'p';
        rx.rid[1] = (uint8_t)('0' + sender);
        rx.rid_len = 2;
        snprintf(rx.peer, sizeof rx.peer, "plain:p%d", sender);
        nl_error e = {0};
        if (nl_wire_decode(&rx.msg, parts, nparts, &lim, &e) == NL_OK)
            coord_dispatch(c, &rx, roles);
        nl_rx_free(&rx);
        fuzz_parts_free(bufs, nparts);
        if (turn)
            nl_coord_step(c, 0);
        drain(peers);
    }
    for (int i = 0; i < PEERS; i++)
        nl_sock_destroy(&peers[i]);
    nl_coord_destroy(&c);
    return 0;
}

#else /* the seed corpus writer */

#include <math.h>
#include <sys/stat.h>

typedef fuzz_out out;

/* Append one record: m from sender `who` with `roles`, turning the loop
 * after when `turn`. */
static void rec(out *o, int who, int roles, int turn, nl_wire_msg *m)
{
    fuzz_rec(o, (uint8_t)(who | roles << 2 | turn << 5), m);
    nl_wire_msg_free(m);
    nl_wire_msg_init(m);
}

#define N NL_KEY_ROLE_NODE
#define C NL_KEY_ROLE_CLIENT
#define A (NL_KEY_ROLE_ADMIN | NL_KEY_ROLE_CLIENT)

/* p0 joins, the loop plans one stage on it, it loads: ready. */
static void ready_cluster(out *o, nl_wire_msg *m)
{
    nl_wire_msg_reset(m, NL_MSG_JOIN);
    m->u.join = (nl_msg_join){"fuzzNode0000000000000000000000000000000A",
                              "cpu",
                              1ull << 30,
                              1.0,
                              1,
                              "tcp://127.0.0.1:1",
                              0};
    rec(o, 0, N, 1, m);
    nl_wire_msg_reset(m, NL_MSG_LOAD_DONE);
    m->u.load_done = (nl_msg_load_done){1, 1, 0, 100};
    rec(o, 0, N, 1, m);
}

static void submit_tokens(out *o, nl_wire_msg *m, int kind, const int32_t *ids, int T,
                          nl_wire_param *ps, uint32_t np)
{
    nl_wire_msg_reset(m, NL_MSG_JOB_SUBMIT);
    m->u.job_submit = (nl_msg_job_submit){(uint32_t)kind, np, ps};
    const int64_t shape[2] = {1, T};
    nl_wire_frame_set(&m->frames[0], ids, NL_DTYPE_I32, shape, 2);
    m->nframes = 1;
    rec(o, 2, C, 0, m);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: coord_corpus DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    mkdir(dir, 0755);
    static out o;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    const int32_t ids[3] = {1, 2, 3};
    const float logits[4] = {0.5f, 1, 2, 3};
    const int64_t lshape[3] = {1, 1, 4};

    /* a forward job, its RESULT, and a TOKEN naming it */
    o.len = 0;
    ready_cluster(&o, &m);
    submit_tokens(&o, &m, NL_JOB_FORWARD, ids, 3, NULL, 0);
    nl_wire_msg_reset(&m, NL_MSG_TOKEN);
    uint32_t tok = 5;
    m.u.token = (nl_msg_token){1, 1, 1, &tok, false, 0, NULL};
    rec(&o, 0, N, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_RESULT);
    m.u.hop = (nl_msg_tensor_hop){1, 0, 0, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], logits, NL_DTYPE_F32, lshape, 3);
    m.nframes = 1;
    rec(&o, 0, N, 1, &m);
    fuzz_save(dir, "forward", &o);

    /* a generation: the session acked (twice), tokens, one out of range */
    o.len = 0;
    ready_cluster(&o, &m);
    nl_wire_param gp[2] = {{.key = "max_new", .kind = NL_WIRE_PARAM_INT, .i = 3},
                           {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.0}};
    submit_tokens(&o, &m, NL_JOB_GENERATE, ids, 3, gp, 2);
    for (int k = 0; k < 2; k++) {
        nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
        m.u.job_status = (nl_msg_job_status){1, NL_JOB_RUNNING, 0.0, "open", 0};
        rec(&o, 0, N, 0, &m);
    }
    const uint32_t toks[3] = {7, 9, 1000};
    for (int k = 0; k < 3; k++) {
        nl_wire_msg_reset(&m, NL_MSG_TOKEN);
        m.u.token = (nl_msg_token){1, 1, 1, &toks[k], false, 0, NULL};
        rec(&o, 0, N, 1, &m);
    }
    fuzz_save(dir, "generate", &o);

    /* a training job: acked, reports (one NaN), a checkpoint report */
    o.len = 0;
    ready_cluster(&o, &m);
    nl_wire_param tp[] = {
        {.key = "steps", .kind = NL_WIRE_PARAM_INT, .i = 2},
        {.key = "batch", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 4},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "warmup", .kind = NL_WIRE_PARAM_INT, .i = 0},
        {.key = "eval_every", .kind = NL_WIRE_PARAM_INT, .i = 0},
        {.key = "eval_batches", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "checkpoint_every", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "lr", .kind = NL_WIRE_PARAM_FLOAT, .f = 1e-3},
        {.key = "min_lr", .kind = NL_WIRE_PARAM_FLOAT, .f = 1e-4},
        {.key = "holdout", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.0},
        {.key = "data", .kind = NL_WIRE_PARAM_STR, .s = "d.txt"},
        {.key = "checkpoint_dir", .kind = NL_WIRE_PARAM_STR, .s = "ck"},
    };
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_TRAIN, sizeof tp / sizeof tp[0], tp};
    rec(&o, 2, C, 1, &m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
    m.u.job_status = (nl_msg_job_status){1, NL_JOB_RUNNING, 0.0, "took it", 0};
    rec(&o, 0, N, 1, &m);
    nl_wire_msg_reset(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm = (nl_msg_grad_norm){1, 1, 0, 2.0};
    rec(&o, 0, N, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_LOSS);
    m.u.loss = (nl_msg_loss){1, 1, false, 10.0, 0.0, 4};
    rec(&o, 0, N, 1, &m);
    nl_wire_msg_reset(&m, NL_MSG_CKPT_DONE);
    m.u.ckpt_done =
        (nl_msg_ckpt_done){1,
                           1,
                           0,
                           "/tmp/x/stage-0.safetensors",
                           "0000000000000000000000000000000000000000000000000000000000000000",
                           10};
    rec(&o, 0, N, 1, &m);
    nl_wire_msg_reset(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm = (nl_msg_grad_norm){1, 2, 0, NAN};
    rec(&o, 0, N, 1, &m);
    fuzz_save(dir, "train", &o);

    /* roles crossed: a client JOINs and reports, a node submits and
     * queries, an admin queries and cancels, a node leaves and errs */
    o.len = 0;
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){"fuzzClient00000000000000000000000000000B",
                             "cpu",
                             UINT64_MAX,
                             1e9,
                             1,
                             "tcp://127.0.0.1:2",
                             0};
    rec(&o, 1, C, 1, &m);
    ready_cluster(&o, &m);
    nl_wire_msg_reset(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm = (nl_msg_grad_norm){1, 1, 0, 1.0};
    rec(&o, 1, C, 0, &m);
    submit_tokens(&o, &m, NL_JOB_FORWARD, ids, 3, NULL, 0);
    nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
    m.u.job_ref.job_id = 0;
    rec(&o, 0, N, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
    m.u.job_ref.job_id = 0;
    rec(&o, 1, A, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
    m.u.job_ref.job_id = 1;
    rec(&o, 1, A, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_ERROR);
    m.u.error = (nl_msg_error){NL_ERR_IO, NL_MSG_ACTIVATION, "bad\nline\x1b[0m"};
    rec(&o, 0, N, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
    m.u.job_status = (nl_msg_job_status){1, NL_JOB_FAILED, 0.0, "no\r\nway", 0};
    rec(&o, 0, N, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_LEAVE);
    m.u.leave = (nl_msg_leave){1, "bye\n"};
    rec(&o, 0, N, 1, &m);
    fuzz_save(dir, "roles", &o);
    return 0;
}

#endif
