/* The harness of the neuronode integration tests (test_node.c,
 * test_node_rejoin.c): the real binary ($NL_BUILD_DIR/node/neuronode)
 * against a fake coordinator in the test's process (a CURVE ROUTER
 * admitting the nodes' keys, on an ephemeral port), the children it
 * spawns (every wait bounded, every child killed on the way out), and the
 * messages the fake coordinator sends and expects. Header-only, as
 * check.h is: its CHECKs count in the program that includes it. */
#ifndef NL_TEST_NODE_HARNESS_H
#define NL_TEST_NODE_HARNESS_H

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "core/formats/checkpoint.h"
#include "net/transport.h"
#include "tests/check.h"
#include "tests/small_config.h"

#define WAIT_MS 8000 /* for a message that must arrive (the node may run under ASan) */
#define WAIT_NO 500  /* for one that must not */
#define SEED 4242
#define MAX_KIDS 8

static char tmpdir[256];
static char node_bin[512];
static pid_t kids[MAX_KIDS];
static nl_backend *be;
static nl_config cfg;
static char *cfg_json;

/* ---------------------------------------------------------------- children */

static inline void kill_kids(void)
{
    for (int i = 0; i < MAX_KIDS; i++)
        if (kids[i] > 0) {
            kill(kids[i], SIGKILL);
            waitpid(kids[i], NULL, 0);
            kids[i] = 0;
        }
}

static inline void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "test_node: timed out\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
    }
    for (int i = 0; i < MAX_KIDS; i++)
        if (kids[i] > 0)
            kill(kids[i], SIGKILL);
    _exit(1);
}

static inline int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Start neuronode with argv (argv[0] ignored); stderr and stdout go to log. */
static inline pid_t spawn(const char *log, const char **argv)
{
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        argv[0] = node_bin;
        execv(node_bin, (char *const *)argv);
        _exit(127);
    }
    for (int i = 0; pid > 0 && i < MAX_KIDS; i++)
        if (kids[i] == 0) {
            kids[i] = pid;
            break;
        }
    return pid;
}

/* Wait for a child to exit; returns its exit status, or -1 (killed). */
static inline int reap(pid_t pid, int ms)
{
    int status = 0;
    int64_t end = mono_ms() + ms;
    pid_t r = 0;
    while ((r = waitpid(pid, &status, WNOHANG)) == 0 && mono_ms() < end)
        nanosleep(&(struct timespec){0, 20000000}, NULL);
    for (int i = 0; i < MAX_KIDS; i++)
        if (kids[i] == pid)
            kids[i] = 0;
    if (r == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static inline bool file_has(const char *path, const char *needle)
{
    char buf[65536];
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strstr(buf, needle) != NULL;
}

static inline void dump_log(const char *path)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "tail -n 30 '%s' >&2", path);
    if (system(cmd) != 0)
        fprintf(stderr, "(no log at %s)\n", path);
}

/* ---------------------------------------------------------------- the fake coordinator */

typedef struct peer {
    char key[NL_PEER_ID_MAX];
    uint8_t rid[NL_ROUTING_ID_MAX];
    size_t rid_len;
    int heartbeats;
    uint64_t hb_seq;
    uint32_t hb_state, hb_node;
    bool seq_ok; /* every heartbeat's seq grew */
} peer;

typedef struct coord {
    nl_net *net;
    nl_sock *sock;
    nl_keypair kp;
    char pub_path[320];
    nl_rx rx;
    peer peers[2];
    int npeers;
    peer *from; /* sender of the last message */
} coord;

/* Bind the fake coordinator at endpoint, admitting node_keys. Its identity
 * is kp, or a new one (written to <tmpdir>/coord.pub) when kp is NULL. */
static inline void coord_start(coord *c, const char *const *node_keys, int n, const char *endpoint,
                               const nl_keypair *kp)
{
    nl_error err;
    char prefix[280];
    memset(c, 0, sizeof *c);
    nl_rx_init(&c->rx);
    snprintf(prefix, sizeof prefix, "%s/coord", tmpdir);
    snprintf(c->pub_path, sizeof c->pub_path, "%s.pub", prefix);
    if (kp) {
        c->kp = *kp;
    } else {
        CHECK_OK(nl_keys_generate(&c->kp, &err), &err);
        CHECK_OK(nl_keys_save(&c->kp, prefix, true, &err), &err);
    }
    CHECK_OK(nl_net_new(&c->net, NULL, &err), &err);
    CHECK_OK(nl_auth_set_keys_z85(nl_net_auth(c->net), "coord", node_keys, (size_t)n, &err), &err);
    nl_sock_opts o = {.type = ZMQ_ROUTER,
                      .keys = &c->kp,
                      .curve_server = true,
                      .zap_domain = "coord",
                      .name = "fake-coord",
                      .linger_ms = 0};
    CHECK_OK(nl_sock_new(&c->sock, c->net, &o, &err), &err);
    if (c->sock)
        CHECK_OK(nl_sock_bind(c->sock, endpoint, &err), &err);
}

static inline void coord_stop(coord *c)
{
    nl_rx_free(&c->rx);
    nl_sock_destroy(&c->sock);
    nl_net_destroy(&c->net);
}

static inline peer *peer_of(coord *c, const char *key)
{
    for (int i = 0; i < c->npeers; i++)
        if (strcmp(c->peers[i].key, key) == 0)
            return &c->peers[i];
    if (c->npeers == 2)
        return NULL;
    peer *p = &c->peers[c->npeers++];
    memset(p, 0, sizeof *p);
    snprintf(p->key, sizeof p->key, "%s", key);
    p->seq_ok = true;
    return p;
}

/* The next message other than HELLO (answered) and HEARTBEAT (counted),
 * from `who` (NULL: anyone). Returns its type, or 0 after ms. */
static inline nl_msg_type coord_next(coord *c, const peer *who, int ms)
{
    nl_error err;
    int64_t end = mono_ms() + ms;
    for (;;) {
        int64_t left = end - mono_ms();
        if (left <= 0)
            return NL_MSG_NONE;
        if (nl_sock_recv(c->sock, &c->rx, (int)left, &err) != NL_OK)
            continue;
        peer *p = peer_of(c, c->rx.peer);
        if (!p)
            continue;
        memcpy(p->rid, c->rx.rid, c->rx.rid_len);
        p->rid_len = c->rx.rid_len;
        const nl_wire_msg *m = &c->rx.msg;
        if (m->type == NL_MSG_HELLO) {
            /* a node that waited too long for the answer (a loaded machine)
             * has closed that socket and says HELLO again on a new one */
            nl_status st = nl_sock_answer_hello(c->sock, &c->rx, NL_ROLE_COORDINATOR, &err);
            CHECK(st == NL_OK || st == NL_ERR_NOTFOUND, "HELLO_ACK: %s", err.msg);
            continue;
        }
        if (m->type == NL_MSG_HEARTBEAT) {
            p->seq_ok &= m->u.heartbeat.seq > p->hb_seq;
            p->hb_seq = m->u.heartbeat.seq;
            p->hb_state = m->u.heartbeat.state;
            p->hb_node = m->u.heartbeat.node_id;
            p->heartbeats++;
            continue;
        }
        if (who && p != who) { /* the other node's: not what this wait is about */
            fprintf(stderr, "note: ignoring %s from another node\n", nl_wire_type_name(m->type));
            continue;
        }
        c->from = p;
        return m->type;
    }
}

static inline nl_status coord_send(coord *c, const peer *to, nl_wire_msg *m)
{
    nl_error err;
    nl_status st = nl_sock_send(c->sock, to->rid, to->rid_len, m, &err);
    CHECK(st == NL_OK, "send %s: %s", nl_wire_type_name(m->type), err.msg);
    return st;
}

/* The KV budget of the next node to JOIN (its --kv-budget; the default is
 * a quarter of its --memory 256M): its JOIN offers the plans the rest. */
static uint64_t join_kv_budget = 64ULL << 20;

/* Receive HELLO + JOIN from a new node and ACCEPT it. */
static inline peer *coord_accept(coord *c, const char *key, uint32_t node_id, char *endpoint,
                                 size_t n)
{
    nl_msg_type t = coord_next(c, NULL, WAIT_MS);
    CHECK(t == NL_MSG_JOIN, "expected JOIN, got %s", t ? nl_wire_type_name(t) : "nothing");
    if (t != NL_MSG_JOIN)
        return NULL;
    const nl_msg_join *j = &c->rx.msg.u.join;
    CHECK(strcmp(j->pubkey, key) == 0 && strcmp(c->rx.peer, key) == 0, "JOIN key %s", j->pubkey);
    CHECK(strcmp(j->device, check_device()) == 0 &&
              j->memory_bytes == (256ULL << 20) - join_kv_budget && j->threads == 1 &&
              j->gemm_gflops > 0,
          "JOIN fields: %s %llu (want 256M less a KV budget of %llu) %u %g", j->device,
          (unsigned long long)j->memory_bytes, (unsigned long long)join_kv_budget, j->threads,
          j->gemm_gflops);
    CHECK(strncmp(j->data_endpoint, "tcp://127.0.0.1:", 16) == 0 && !strchr(j->data_endpoint, '*'),
          "data endpoint %s", j->data_endpoint);
    snprintf(endpoint, n, "%s", j->data_endpoint);
    peer *p = c->from;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_ACCEPT;
    m.u.accept = (nl_msg_accept){node_id, 100, 2000};
    coord_send(c, p, &m);
    return p;
}

/* ---------------------------------------------------------------- messages */

static inline void send_assign(coord *c, peer *p, uint64_t epoch, uint32_t node_id, uint32_t stage,
                               uint32_t nst, int l0, int l1, const char *prev_ep,
                               const char *prev_key, const char *next_ep, const char *next_key)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_ASSIGN;
    m.u.assign = (nl_msg_assign){.epoch = epoch,
                                 .node_id = node_id,
                                 .stage = stage,
                                 .num_stages = nst,
                                 .layer0 = (uint32_t)l0,
                                 .layer1 = (uint32_t)l1,
                                 .has_embed = stage == 0,
                                 .has_head = stage + 1 == nst,
                                 .config_json = cfg_json,
                                 .seed = SEED,
                                 .prev_endpoint = prev_ep,
                                 .prev_key = prev_key,
                                 .next_endpoint = next_ep,
                                 .next_key = next_key,
                                 .memory_planned = 1 << 20};
    coord_send(c, p, &m);
}

static inline void send_chunk(coord *c, peer *p, uint64_t epoch, const nl_param *par,
                              const float *data, uint64_t off, int64_t n, uint32_t chunk,
                              uint32_t chunks)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_LAYER_LOAD;
    m.u.layer_load = (nl_msg_layer_load){.epoch = epoch,
                                         .name = par->name,
                                         .ndim = par->ndim,
                                         .offset = off,
                                         .chunk = chunk,
                                         .chunks = chunks};
    m.u.layer_load.shape[0] = par->shape[0];
    m.u.layer_load.shape[1] = par->ndim == 2 ? par->shape[1] : 0;
    m.nframes = 1;
    m.frames[0].t.dtype = NL_DTYPE_F32;
    m.frames[0].t.ndim = 1;
    m.frames[0].t.shape[0] = n;
    m.frames[0].t.data = (void *)data;
    coord_send(c, p, &m);
}

static inline void send_tokens(coord *c, peer *p, uint64_t job, uint64_t session, uint64_t pos,
                               int32_t *tok, int B, int T, nl_dtype dtype)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_ACTIVATION;
    m.u.hop = (nl_msg_tensor_hop){job, 0, 0, session, pos, 0.0};
    m.nframes = 1;
    m.frames[0].t.dtype = dtype;
    m.frames[0].t.ndim = 2;
    m.frames[0].t.shape[0] = B;
    m.frames[0].t.shape[1] = T;
    m.frames[0].t.data = tok;
    coord_send(c, p, &m);
}

/* JOB_CANCEL {id}, GRAD_NORM, or LOAD_DONE {epoch 1, tensors id} (epoch
 * from the high 32 bits of id when set) */
static inline void send_simple(coord *c, peer *p, nl_msg_type type, uint64_t id)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = type;
    if (type == NL_MSG_LOAD_DONE)
        m.u.load_done =
            (nl_msg_load_done){.epoch = id >> 32 ? id >> 32 : 1, .tensors = (uint32_t)id};
    else
        m.u.job_ref.job_id = id;
    coord_send(c, p, &m);
}

/* Open session id; limit > 0 makes the last stage feed its tokens to the
 * first itself (the token ring). */
static inline void send_session(coord *c, peer *p, uint64_t id, int capacity, int limit)
{
    nl_wire_param ps[6] = {
        {.key = "session", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)id},
        {.key = "capacity", .kind = NL_WIRE_PARAM_INT, .i = capacity},
        {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.0},
        {.key = "top_p", .kind = NL_WIRE_PARAM_FLOAT, .f = 1.0},
        {.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = 3},
        {.key = "limit", .kind = NL_WIRE_PARAM_INT, .i = limit},
    };
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_JOB_SUBMIT;
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, 6, ps};
    coord_send(c, p, &m);
}

/* Expect LOAD_DONE from p with the stage's tensor count and bytes. */
static inline void expect_loaded(coord *c, peer *p, uint64_t epoch, uint32_t node_id,
                                 const nl_model *stage)
{
    nl_msg_type t = coord_next(c, p, WAIT_MS);
    CHECK(t == NL_MSG_LOAD_DONE, "expected LOAD_DONE, got %s",
          t ? nl_wire_type_name(t) : "nothing");
    if (t == NL_MSG_ERROR)
        fprintf(stderr, "  ERROR: %s\n", c->rx.msg.u.error.message);
    if (t != NL_MSG_LOAD_DONE)
        return;
    const nl_msg_load_done *d = &c->rx.msg.u.load_done;
    CHECK(d->epoch == epoch && d->node_id == node_id && d->tensors == (uint32_t)stage->n_table &&
              d->bytes == stage->n_params * 4,
          "LOAD_DONE %llu %u %u %llu", (unsigned long long)d->epoch, d->node_id, d->tensors,
          (unsigned long long)d->bytes);
}

/* Expect an ERROR about req_type whose message holds `needle`. */
static inline void expect_error(coord *c, peer *p, nl_status code, nl_msg_type req,
                                const char *needle)
{
    nl_msg_type t = coord_next(c, p, WAIT_MS);
    CHECK(t == NL_MSG_ERROR, "expected ERROR about %s, got %s", nl_wire_type_name(req),
          t ? nl_wire_type_name(t) : "nothing");
    if (t != NL_MSG_ERROR)
        return;
    const nl_msg_error *e = &c->rx.msg.u.error;
    CHECK(e->code == (uint32_t)code && e->req_type == (uint32_t)req && strstr(e->message, needle),
          "ERROR %u about %u: %s (wanted %s, '%s')", e->code, e->req_type, e->message,
          nl_status_str(code), needle);
}

/* Expect JOB_STATUS {job, failed} whose message holds `needle` and names
 * the status: a failure of one job's work, which fails that job only. */
static inline void expect_failed(coord *c, peer *p, uint64_t job, nl_status code,
                                 const char *needle)
{
    nl_msg_type t = coord_next(c, p, WAIT_MS);
    CHECK(t == NL_MSG_JOB_STATUS, "expected JOB_STATUS failed of job %llu, got %s",
          (unsigned long long)job, t ? nl_wire_type_name(t) : "nothing");
    if (t == NL_MSG_ERROR)
        fprintf(stderr, "  ERROR: %s\n", c->rx.msg.u.error.message);
    if (t != NL_MSG_JOB_STATUS)
        return;
    const nl_msg_job_status *s = &c->rx.msg.u.job_status;
    CHECK(s->job_id == job && s->state == NL_JOB_FAILED && strstr(s->message, needle) &&
              strstr(s->message, nl_status_str(code)),
          "JOB_STATUS %llu state %u: %s (wanted job %llu failed, %s, '%s')",
          (unsigned long long)s->job_id, s->state, s->message, (unsigned long long)job,
          nl_status_str(code), needle);
}

/* ---------------------------------------------------------------- local references */

static inline void key_files(const char *name, nl_keypair *kp, char *key_path, size_t n)
{
    nl_error err;
    char prefix[280];
    snprintf(prefix, sizeof prefix, "%s/%s", tmpdir, name);
    CHECK_OK(nl_keys_generate(kp, &err), &err);
    CHECK_OK(nl_keys_save(kp, prefix, true, &err), &err);
    snprintf(key_path, n, "%s.key", prefix);
}

/* Begin training job `job` (one stage, one microbatch of 1 x 4). */
static inline void send_train(coord *c, peer *p, uint64_t job)
{
    nl_wire_param ps[4] = {
        {.key = "job", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)job},
        {.key = "micro_batch", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 4},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = 1},
    };
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_JOB_SUBMIT;
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_TRAIN, 4, ps};
    coord_send(c, p, &m);
    nl_msg_type t = coord_next(c, p, WAIT_MS);
    CHECK(t == NL_MSG_JOB_STATUS && c->rx.msg.u.job_status.state == NL_JOB_RUNNING,
          "train job %llu: %s %s", (unsigned long long)job, t ? nl_wire_type_name(t) : "nothing",
          t == NL_MSG_JOB_STATUS ? c->rx.msg.u.job_status.message : "");
}

static inline void send_ckpt(coord *c, peer *p, uint64_t job, const char *dir)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_CKPT_REQ;
    m.u.ckpt_req = (nl_msg_ckpt_req){job, 0, dir};
    coord_send(c, p, &m);
}

/* ---------------------------------------------------------------- setup */

/* The model every case uses, a temporary directory, the alarm: false if
 * the node is not built or the directory cannot be made. */
static inline bool harness_begin(const char *name)
{
    nl_error err;
    nl_log_set_name(name);
    nl_log_set_level(NL_LOG_WARN);
    snprintf(node_bin, sizeof node_bin, "%s/node/neuronode", check_build_dir());
    if (access(node_bin, X_OK) != 0) {
        fprintf(stderr, "%s: %s is not built\n", name, node_bin);
        return false;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/%s.XXXXXX", name);
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return false;
    }
    signal(SIGALRM, on_alarm);
    alarm(240); /* a hang is a failure, not a stuck CI job */
    check_small_config(&cfg, 3);
    cfg_json = nl_config_to_json(&cfg);
    CHECK_OK(check_backend_new(&be, 1, &err), &err); /* as the nodes: same sums */
    return true;
}

/* Kill what is left, free, remove the directory (kept on a failure or
 * with TEST_NODE_KEEP); the exit code. */
static inline int harness_end(const char *name)
{
    kill_kids();
    nl_backend_destroy(&be);
    free(cfg_json);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (check_fail_count == 0 && !getenv("TEST_NODE_KEEP") && system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", tmpdir);
    return check_done(name);
}

#endif
