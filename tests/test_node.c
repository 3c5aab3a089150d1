/* Integration tests of the neuronode daemon: the real binary
 * ($NL_BUILD_DIR/node/neuronode) against a fake coordinator in this
 * process (a CURVE ROUTER admitting the nodes' keys, on an ephemeral
 * port). Every wait is bounded, and every child is killed on the way out.
 *
 *  - the command line: --help, usage errors, an unreachable coordinator;
 *  - joining late (the node retries) and a refused JOIN (exit 1);
 *  - one node: hello, JOIN, ACCEPT, ASSIGN of the whole model from a
 *    checkpoint, LAYER_LOAD in small chunks, LOAD_DONE; a forward job
 *    (logits and aux as a local nl_forward); a generation session (the
 *    greedy ids of a local KV-cache generation); bad input answered with
 *    ERROR while the node stays up; heartbeats; SIGTERM gives LEAVE and
 *    exit status 0;
 *  - two nodes: stage 0 -> stage 1 over the data sockets with allow-lists
 *    (a stranger's activation is dropped), initialised from the seed. */
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

#include "../base/log.h"
#include "../core/checkpoint.h"
#include "../core/forward.h"
#include "../core/sampler.h"
#include "../net/transport.h"
#include "check.h"

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

static void kill_kids(void)
{
    for (int i = 0; i < MAX_KIDS; i++)
        if (kids[i] > 0) {
            kill(kids[i], SIGKILL);
            waitpid(kids[i], NULL, 0);
            kids[i] = 0;
        }
}

static void on_alarm(int sig)
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

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Start neuronode with argv (argv[0] ignored); stderr and stdout go to log. */
static pid_t spawn(const char *log, const char **argv)
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
static int reap(pid_t pid, int ms)
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

static bool file_has(const char *path, const char *needle)
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

static void dump_log(const char *path)
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
static void coord_start(coord *c, const char *const *node_keys, int n, const char *endpoint,
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

static void coord_stop(coord *c)
{
    nl_rx_free(&c->rx);
    nl_sock_destroy(&c->sock);
    nl_net_destroy(&c->net);
}

static peer *peer_of(coord *c, const char *key)
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
static nl_msg_type coord_next(coord *c, const peer *who, int ms)
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

static nl_status coord_send(coord *c, const peer *to, nl_wire_msg *m)
{
    nl_error err;
    nl_status st = nl_sock_send(c->sock, to->rid, to->rid_len, m, &err);
    CHECK(st == NL_OK, "send %s: %s", nl_wire_type_name(m->type), err.msg);
    return st;
}

/* Receive HELLO + JOIN from a new node and ACCEPT it. */
static peer *coord_accept(coord *c, const char *key, uint32_t node_id, char *endpoint, size_t n)
{
    nl_msg_type t = coord_next(c, NULL, WAIT_MS);
    CHECK(t == NL_MSG_JOIN, "expected JOIN, got %s", t ? nl_wire_type_name(t) : "nothing");
    if (t != NL_MSG_JOIN)
        return NULL;
    const nl_msg_join *j = &c->rx.msg.u.join;
    CHECK(strcmp(j->pubkey, key) == 0 && strcmp(c->rx.peer, key) == 0, "JOIN key %s", j->pubkey);
    CHECK(strcmp(j->device, check_device()) == 0 && j->memory_bytes == (256ULL << 20) &&
              j->threads == 1 && j->gemm_gflops > 0,
          "JOIN fields: %s %llu %u %g", j->device, (unsigned long long)j->memory_bytes, j->threads,
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

static void send_assign(coord *c, peer *p, uint64_t epoch, uint32_t node_id, uint32_t stage,
                        uint32_t nst, int l0, int l1, const char *prev_ep, const char *prev_key,
                        const char *next_ep, const char *next_key)
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

static void send_chunk(coord *c, peer *p, uint64_t epoch, const nl_param *par, const float *data,
                       uint64_t off, int64_t n, uint32_t chunk, uint32_t chunks)
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

static void send_tokens(coord *c, peer *p, uint64_t job, uint64_t session, uint64_t pos,
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
static void send_simple(coord *c, peer *p, nl_msg_type type, uint64_t id)
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
static void send_session(coord *c, peer *p, uint64_t id, int capacity, int limit)
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
static void expect_loaded(coord *c, peer *p, uint64_t epoch, uint32_t node_id,
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
static void expect_error(coord *c, peer *p, nl_status code, nl_msg_type req, const char *needle)
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
static void expect_failed(coord *c, peer *p, uint64_t job, nl_status code, const char *needle)
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

static void local_logits(nl_model *ref, const int32_t *tok, int B, int T, float *logits, float *aux)
{
    nl_error err;
    nl_runstate *rs = NULL;
    CHECK_OK(nl_runstate_new(&rs, ref, B * T, &err), &err);
    nl_forward_args a = {.B = B, .T = T, .tokens = tok};
    if (rs && nl_forward(ref, rs, &a, aux, &err) == NL_OK)
        be->download(be, logits, nl_runstate_output(rs, NULL),
                     (size_t)B * T * (size_t)cfg.vocab_size * sizeof(float));
    nl_runstate_destroy(&rs);
}

static void local_generate(nl_model *ref, const int32_t *prompt, int P, int n, int32_t *ids)
{
    nl_error err;
    nl_runstate *rs = NULL;
    nl_kvcache *kv = NULL;
    nl_sampler smp;
    CHECK_OK(nl_runstate_new(&rs, ref, P, &err), &err);
    CHECK_OK(nl_kvcache_new(&kv, ref, 1, P + n, &err), &err);
    CHECK_OK(nl_sampler_init(&smp, (int)cfg.vocab_size, 0.0f, 1.0f, 3, &err), &err);
    nl_forward_args a = {.B = 1, .T = P, .tokens = prompt, .kv = kv, .last_only = 1};
    int32_t next = 0;
    float *logits = malloc((size_t)cfg.vocab_size * sizeof *logits);
    for (int i = 0; i < n && rs && kv && logits; i++) {
        CHECK_OK(nl_forward(ref, rs, &a, NULL, &err), &err);
        be->download(be, logits, nl_runstate_output(rs, NULL),
                     (size_t)cfg.vocab_size * sizeof *logits);
        ids[i] = next = nl_sampler_sample(&smp, logits);
        a = (nl_forward_args){.B = 1, .T = 1, .tokens = &next, .kv = kv, .last_only = 1};
    }
    free(logits);
    nl_sampler_free(&smp);
    nl_kvcache_destroy(&kv);
    nl_runstate_destroy(&rs);
}

/* A forward job through the cluster: tokens to `first`, RESULT from `last`. */
static void check_forward(coord *c, peer *first, peer *last, nl_model *ref, uint64_t job)
{
    enum { B = 2, T = 6 };
    int32_t tok[B * T];
    const size_t n = (size_t)B * T * (size_t)cfg.vocab_size;
    float *want = calloc(n, sizeof *want), aux = 0;
    for (int i = 0; i < B * T; i++)
        tok[i] = (int32_t)((i * 53 + (int)job) % cfg.vocab_size);
    local_logits(ref, tok, B, T, want, &aux);
    send_tokens(c, first, job, 0, 0, tok, B, T, NL_DTYPE_I32);
    nl_msg_type t = coord_next(c, last, WAIT_MS);
    CHECK(t == NL_MSG_RESULT, "job %llu: expected RESULT, got %s", (unsigned long long)job,
          t ? nl_wire_type_name(t) : "nothing");
    if (t == NL_MSG_ERROR)
        fprintf(stderr, "  ERROR: %s\n", c->rx.msg.u.error.message);
    if (t == NL_MSG_RESULT) {
        const nl_wire_msg *m = &c->rx.msg;
        const nl_tensor *r = &m->frames[0].t;
        CHECK(m->u.hop.job_id == job && m->u.hop.session_id == 0 && r->dtype == NL_DTYPE_F32 &&
                  r->ndim == 3 && r->shape[0] == B && r->shape[1] == T &&
                  r->shape[2] == cfg.vocab_size,
              "RESULT header or shape");
        if (r->ndim == 3 && r->shape[0] * r->shape[1] * r->shape[2] == (int64_t)n) {
            float *got = malloc(n * sizeof *got); /* frames need not be aligned */
            memcpy(got, r->data, n * sizeof *got);
            double diff = check_max_abs_diff(got, want, n);
            CHECK(diff <= 1e-6, "job %llu: logits differ from nl_forward by %g",
                  (unsigned long long)job, diff);
            free(got);
        }
        CHECK(fabs(m->u.hop.aux - (double)aux) <= 1e-6 * (1 + fabs((double)aux)),
              "aux %.9g vs %.9g", m->u.hop.aux, (double)aux);
    }
    free(want);
}

/* A greedy generation session through the cluster, against a local one.
 * Without ring this test feeds each token back to the first stage; with
 * it, the last stage does (limit N), and the test only sends the prompt
 * and reads N TOKENs, the last one done. Then JOB_CANCEL: a hop of the
 * closed session is dropped unanswered, one of a session never opened is
 * refused. */
static void check_generation(coord *c, peer **stages, int nst, nl_model *ref, uint64_t id,
                             bool ring)
{
    enum { P = 4, N = 6 };
    int32_t prompt[P] = {17, 4, 250, 99}, want[N], got[N] = {0};
    local_generate(ref, prompt, P, N, want);
    for (int s = 0; s < nst; s++) {
        send_session(c, stages[s], id, P + N, ring ? N : 0);
        nl_msg_type t = coord_next(c, stages[s], WAIT_MS);
        CHECK(t == NL_MSG_JOB_STATUS && c->rx.msg.u.job_status.job_id == id &&
                  c->rx.msg.u.job_status.state == NL_JOB_RUNNING &&
                  strcmp(c->rx.msg.u.job_status.message, "session open") == 0,
              "stage %d: session not opened (%s)", s, t ? nl_wire_type_name(t) : "nothing");
    }
    int32_t cur[P];
    memcpy(cur, prompt, sizeof prompt);
    uint64_t pos = 0;
    int T = P;
    int64_t t0 = mono_ms();
    for (int i = 0; i < N; i++) {
        if (!ring || i == 0)
            send_tokens(c, stages[0], id, id, pos, cur, 1, T, NL_DTYPE_I32);
        nl_msg_type t = coord_next(c, stages[nst - 1], WAIT_MS);
        const nl_msg_token *tk = &c->rx.msg.u.token;
        bool ok = t == NL_MSG_TOKEN && tk->job_id == id && tk->session_id == id &&
                  tk->ntokens == 1 && tk->done == (ring && i == N - 1);
        CHECK(ok, "step %d: expected TOKEN%s, got %s%s", i, ring && i == N - 1 ? " (done)" : "",
              t ? nl_wire_type_name(t) : "nothing",
              t == NL_MSG_ERROR ? c->rx.msg.u.error.message : "");
        if (!ok)
            return;
        got[i] = (int32_t)tk->tokens[0];
        pos += (uint64_t)T;
        T = 1;
        cur[0] = got[i];
    }
    printf("generation through %d node(s)%s: %.2f ms per token (d %d, %d layers, loopback)\n", nst,
           ring ? ", token ring" : "", (double)(mono_ms() - t0) / N, cfg.hidden_dim,
           cfg.num_layers);
    CHECK(memcmp(got, want, sizeof want) == 0, "generated ids differ: %d %d %d vs %d %d %d", got[0],
          got[1], got[2], want[0], want[1], want[2]);
    if (ring) { /* nothing after the limit */
        nl_msg_type t = coord_next(c, stages[nst - 1], WAIT_NO);
        CHECK(t == NL_MSG_NONE, "a token after the limit: %s", nl_wire_type_name(t));
    }
    /* JOB_CANCEL drops the session on every stage; a hop still in flight
     * is dropped; a session never opened is an error */
    for (int s = 0; s < nst; s++)
        send_simple(c, stages[s], NL_MSG_JOB_CANCEL, id);
    send_tokens(c, stages[0], id, id, pos, cur, 1, 1, NL_DTYPE_I32);
    nl_msg_type t = coord_next(c, stages[0], WAIT_NO);
    CHECK(t == NL_MSG_NONE, "a hop of a closed session was answered: %s", nl_wire_type_name(t));
    send_tokens(c, stages[0], id + 1000, id + 1000, 0, cur, 1, 1, NL_DTYPE_I32);
    expect_failed(c, stages[0], id + 1000, NL_ERR_NOTFOUND, "is not open");
}

/* Two ring sessions at once on a single stage: it feeds each its own
 * tokens (one queued token per session), so both run to their limit with
 * the local ids, in whatever order the TOKENs come. */
static void check_two_sessions(coord *c, peer *p, nl_model *ref)
{
    enum { P = 4, N = 8 };
    const uint64_t ids[2] = {61, 62};
    int32_t prompts[2][P] = {{17, 4, 250, 99}, {3, 141, 59, 26}}, want[2][N], got[2][N];
    int count[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        local_generate(ref, prompts[k], P, N, want[k]);
        send_session(c, p, ids[k], P + N, N);
        nl_msg_type t = coord_next(c, p, WAIT_MS);
        CHECK(t == NL_MSG_JOB_STATUS && c->rx.msg.u.job_status.state == NL_JOB_RUNNING,
              "session %llu not opened (%s)", (unsigned long long)ids[k],
              t ? nl_wire_type_name(t) : "nothing");
    }
    for (int k = 0; k < 2; k++) /* back to back: the second runs while the first is fed */
        send_tokens(c, p, ids[k], ids[k], 0, prompts[k], 1, P, NL_DTYPE_I32);
    for (int i = 0; i < 2 * N; i++) {
        nl_msg_type t = coord_next(c, p, WAIT_MS);
        const nl_msg_token *tk = &c->rx.msg.u.token;
        const int k = t == NL_MSG_TOKEN && tk->ntokens == 1 ? (tk->job_id == ids[0]   ? 0
                                                               : tk->job_id == ids[1] ? 1
                                                                                      : -1)
                                                            : -1;
        CHECK(k >= 0 && count[k] < N, "TOKEN %d of %d: got %s (counts %d, %d)", i + 1, 2 * N,
              t ? nl_wire_type_name(t) : "nothing", count[0], count[1]);
        if (k < 0 || count[k] >= N)
            return;
        got[k][count[k]++] = (int32_t)tk->tokens[0];
    }
    for (int k = 0; k < 2; k++)
        CHECK(memcmp(got[k], want[k], sizeof want[k]) == 0, "session %llu: ids differ from local",
              (unsigned long long)ids[k]);
}

/* SIGTERM: LEAVE {node_id}, then exit status 0. */
static void check_leave(coord *c, peer *p, pid_t pid, uint32_t node_id, const char *log)
{
    kill(pid, SIGTERM);
    nl_msg_type t = coord_next(c, p, WAIT_MS);
    CHECK(t == NL_MSG_LEAVE && c->rx.msg.u.leave.node_id == node_id, "expected LEAVE, got %s",
          t ? nl_wire_type_name(t) : "nothing");
    int rc = reap(pid, WAIT_MS);
    CHECK(rc == 0, "node exit status %d after SIGTERM", rc);
    if (rc != 0 || check_fail_count)
        dump_log(log);
}

/* ---------------------------------------------------------------- cases */

static void key_files(const char *name, nl_keypair *kp, char *key_path, size_t n)
{
    nl_error err;
    char prefix[280];
    snprintf(prefix, sizeof prefix, "%s/%s", tmpdir, name);
    CHECK_OK(nl_keys_generate(kp, &err), &err);
    CHECK_OK(nl_keys_save(kp, prefix, true, &err), &err);
    snprintf(key_path, n, "%s.key", prefix);
}

static void test_cli(void)
{
    char log[300];
    snprintf(log, sizeof log, "%s/cli.log", tmpdir);
    const char *help[] = {"", "--help", NULL};
    CHECK(reap(spawn(log, help), WAIT_MS) == 0 && file_has(log, "--kv-budget") &&
              file_has(log, "--connect-timeout") && file_has(log, "--plaintext"),
          "--help");
    /* no GPU usable here: the device's error, at once; with one, no coordinator */
    const char *cuda[] = {"",         "join",   "tcp://127.0.0.1:1", "--memory",          "1G",
                          "--device", "cuda:0", "--plaintext",       "--connect-timeout", "0.5",
                          NULL};
    CHECK(reap(spawn(log, cuda), WAIT_MS) == 1 &&
              (file_has(log, "cuda:0: no CUDA") || file_has(log, "no answer from the coordinator")),
          "--device cuda:0");
    const char *bogus[] = {"",         "join",  "tcp://127.0.0.1:1", "--memory", "1G",
                           "--device", "bogus", "--plaintext",       NULL};
    CHECK(reap(spawn(log, bogus), WAIT_MS) == 2 && file_has(log, "--device bogus: unknown"),
          "--device bogus");
    const char *nomem[] = {"", "join", "tcp://127.0.0.1:1", "--plaintext", NULL};
    CHECK(reap(spawn(log, nomem), WAIT_MS) == 2 && file_has(log, "--memory"), "no --memory");
    const char *badsize[] = {"",  "join", "tcp://127.0.0.1:1", "--memory", "8Q", "--plaintext",
                             NULL};
    CHECK(reap(spawn(log, badsize), WAIT_MS) == 2 && file_has(log, "8Q"), "--memory 8Q");
    const char *nokey[] = {"", "join", "tcp://127.0.0.1:1", "--memory", "1G", NULL};
    CHECK(reap(spawn(log, nokey), WAIT_MS) == 2 && file_has(log, "--coordinator-key"),
          "no --coordinator-key");
    const char *gone[] = {"",          "join", "tcp://127.0.0.1:9", "--memory", "1G", "--plaintext",
                          "--threads", "1",    "--connect-timeout", "0.5",      NULL};
    CHECK(reap(spawn(log, gone), WAIT_MS) == 1 && file_has(log, "no answer from the coordinator"),
          "unreachable coordinator");
}

/* The node starts before the coordinator, retries, and is refused. */
static void test_late_and_refused(void)
{
    char key[300], log[300], ep[256];
    nl_keypair kp;
    key_files("late", &kp, key, sizeof key);
    snprintf(log, sizeof log, "%s/late.log", tmpdir);
    coord c;
    const char *keys[] = {kp.public_z85};
    coord_start(&c, keys, 1, "tcp://127.0.0.1:*", NULL);
    snprintf(ep, sizeof ep, "%s", c.sock ? nl_sock_endpoint(c.sock) : "");
    nl_keypair ck = c.kp;
    coord_stop(&c); /* the port is free again: the node finds nobody there */
    const char *argv[] = {"",          "join",     ep,
                          "--key",     key,        "--coordinator-key",
                          c.pub_path,  "--memory", "256M",
                          "--threads", "1",        "--connect-timeout",
                          "20",        "--device", check_device(),
                          NULL};
    pid_t pid = spawn(log, argv);
    nanosleep(&(struct timespec){1, 500000000}, NULL);
    CHECK(waitpid(pid, NULL, WNOHANG) == 0, "the node gave up before its connect timeout");
    coord_start(&c, keys, 1, ep, &ck); /* the same identity, on the same port */
    nl_error err;
    nl_msg_type t = coord_next(&c, NULL, WAIT_MS);
    CHECK(t == NL_MSG_JOIN, "late coordinator: expected JOIN, got %s",
          t ? nl_wire_type_name(t) : "nothing");
    if (t == NL_MSG_JOIN) {
        CHECK_OK(nl_sock_send_error(c.sock, &c.rx, NL_ERR_CAPACITY, NL_MSG_JOIN,
                                    "no room for more nodes", &err),
                 &err);
        int rc = reap(pid, WAIT_MS);
        CHECK(rc == 1 && file_has(log, "no room for more nodes") &&
                  file_has(log, "not answering yet"),
              "refused JOIN: exit %d", rc);
    }
    reap(pid, 100);
    coord_stop(&c);
}

/* Begin training job `job` (one stage, one microbatch of 1 x 4). */
static void send_train(coord *c, peer *p, uint64_t job)
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

static void send_ckpt(coord *c, peer *p, uint64_t job, const char *dir)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    m.type = NL_MSG_CKPT_REQ;
    m.u.ckpt_req = (nl_msg_ckpt_req){job, 0, dir};
    coord_send(c, p, &m);
}

/* ASSIGN the whole model to p and stream ref's weights to it. */
static void load_whole(coord *c, peer *p, uint32_t node_id, nl_model *ref)
{
    send_assign(c, p, 1, node_id, 0, 1, 0, cfg.num_layers, "", "", "", "");
    for (int i = 0; i < ref->n_table; i++) {
        const nl_param *par = &ref->table[i];
        uint64_t numel = nl_param_numel(par);
        float *src = check_download(be, nl_model_param_data(ref, par), numel);
        if (src)
            send_chunk(c, p, 1, par, src, 0, (int64_t)numel, 0, 1);
        free(src);
    }
    send_simple(c, p, NL_MSG_LOAD_DONE, (uint64_t)ref->n_table);
    expect_loaded(c, p, 1, node_id, ref);
}

/* Checkpoint shards only under --checkpoint-root, resolved (issue 15,
 * findings 1 and 4): a link inside the root that leads out, and a
 * directory outside it, fail the job; one inside gets its shard (0600, in
 * directories made 0700). The node without a root (test_one_node's)
 * writes none. */
static void test_ckpt_root(void)
{
    nl_error err;
    char key[300], log[300], root[300], outside[300], dir[400], real[PATH_MAX];
    nl_keypair kp;
    key_files("rooted", &kp, key, sizeof key);
    snprintf(log, sizeof log, "%s/rooted.log", tmpdir);
    snprintf(root, sizeof root, "%s/ckroot", tmpdir);
    snprintf(outside, sizeof outside, "%s/outside", tmpdir);
    CHECK(mkdir(root, 0700) == 0 && mkdir(outside, 0700) == 0, "mkdir");
    snprintf(dir, sizeof dir, "%s/escape", root);
    CHECK(symlink(outside, dir) == 0, "symlink");
    nl_model *ref = NULL;
    CHECK_OK(nl_model_new(&ref, be, &cfg, 0, cfg.num_layers, 1, 1, &err), &err);
    if (!ref || nl_model_init_random(ref, 5, &err) != NL_OK)
        return;
    coord c;
    const char *keys[] = {kp.public_z85};
    coord_start(&c, keys, 1, "tcp://127.0.0.1:*", NULL);
    const char *argv[] = {"",          "join",     nl_sock_endpoint(c.sock),
                          "--key",     key,        "--coordinator-key",
                          c.pub_path,  "--memory", "256M",
                          "--threads", "1",        "--checkpoint-root",
                          root,        "--device", check_device(),
                          NULL};
    pid_t pid = spawn(log, argv);
    char data_ep[256];
    peer *p = coord_accept(&c, kp.public_z85, 4, data_ep, sizeof data_ep);
    if (p) {
        load_whole(&c, p, 4, ref);
        send_train(&c, p, 400);
        snprintf(dir, sizeof dir, "%s/escape/step-000000", root);
        send_ckpt(&c, p, 400, dir);
        expect_failed(&c, p, 400, NL_ERR_AUTH, "outside the root");
        snprintf(dir, sizeof dir, "%s/step-000000", outside);
        CHECK(access(dir, F_OK) != 0, "nothing made outside the root");
        send_ckpt(&c, p, 400, dir);
        expect_failed(&c, p, 400, NL_ERR_AUTH, "outside the root");
        snprintf(dir, sizeof dir, "%s/run/step-000000", root);
        send_ckpt(&c, p, 400, dir);
        nl_msg_type t = coord_next(&c, p, WAIT_MS);
        CHECK(t == NL_MSG_CKPT_DONE, "CKPT_DONE: %s %s", t ? nl_wire_type_name(t) : "nothing",
              t == NL_MSG_JOB_STATUS ? c.rx.msg.u.job_status.message : "");
        if (t == NL_MSG_CKPT_DONE && realpath(root, real)) {
            const char *path = c.rx.msg.u.ckpt_done.path;
            struct stat sb, db;
            CHECK(strncmp(path, real, strlen(real)) == 0 && stat(path, &sb) == 0 &&
                      (sb.st_mode & 0777) == 0600 && stat(dir, &db) == 0 &&
                      (db.st_mode & 0777) == 0700,
                  "shard %s (mode %o) in %s (mode %o)", path, (unsigned)(sb.st_mode & 0777), dir,
                  (unsigned)(db.st_mode & 0777));
        }
        send_simple(&c, p, NL_MSG_JOB_CANCEL, 400);
    }
    kill(pid, SIGTERM);
    CHECK(reap(pid, WAIT_MS) == 0, "the rooted node stops");
    if (check_fail_count)
        dump_log(log);
    coord_stop(&c);
    nl_model_destroy(&ref);
}

/* Receive on the fake coordinator's socket until a message of `type`
 * (answering HELLO, refusing HEARTBEAT as a restarted coordinator does);
 * returns its time, or 0 after ms. *refused counts the refusals. */
static int64_t wait_refusing(coord *c, nl_msg_type type, int ms, int *refused)
{
    nl_error err;
    int64_t end = mono_ms() + ms;
    while (mono_ms() < end) {
        if (nl_sock_recv(c->sock, &c->rx, 100, &err) != NL_OK)
            continue;
        const nl_msg_type t = c->rx.msg.type;
        if (t == NL_MSG_HELLO)
            nl_sock_answer_hello(c->sock, &c->rx, NL_ROLE_COORDINATOR, &err);
        else if (t == NL_MSG_HEARTBEAT && type != NL_MSG_HEARTBEAT) {
            nl_sock_send_error(c->sock, &c->rx, NL_ERR_STATE, NL_MSG_HEARTBEAT,
                               "unknown node: JOIN first", &err);
            (*refused)++;
        } else if (t == type) {
            return mono_ms();
        }
    }
    return 0;
}

/* The coordinator restarts (the same identity on the same port) and knows
 * nobody: it refuses the node's heartbeats as unknown, and the node joins
 * again with the same key and data endpoint, retrying with a growing pause
 * until it is accepted (issue 15, finding 7). */
static void test_rejoin(void)
{
    nl_error err;
    char key[300], log[300], ep[256], data_ep[256] = "";
    nl_keypair kp;
    key_files("rejoin", &kp, key, sizeof key);
    snprintf(log, sizeof log, "%s/rejoin.log", tmpdir);
    coord c;
    const char *keys[] = {kp.public_z85};
    coord_start(&c, keys, 1, "tcp://127.0.0.1:*", NULL);
    snprintf(ep, sizeof ep, "%s", c.sock ? nl_sock_endpoint(c.sock) : "");
    const char *argv[] = {
        "",         "join", ep,          "--key", key,        "--coordinator-key", c.pub_path,
        "--memory", "256M", "--threads", "1",     "--device", check_device(),      NULL};
    pid_t pid = spawn(log, argv);
    peer *p = coord_accept(&c, kp.public_z85, 7, data_ep, sizeof data_ep);
    int64_t end = mono_ms() + WAIT_MS;
    while (p && p->heartbeats < 2 && mono_ms() < end)
        coord_next(&c, NULL, 100);
    CHECK(p && p->heartbeats >= 2 && p->hb_node == 7, "heartbeats before the restart");
    nl_keypair ck = c.kp;
    coord_stop(&c);
    coord_start(&c, keys, 1, ep, &ck);
    int refused = 0;
    const int64_t t1 = wait_refusing(&c, NL_MSG_JOIN, WAIT_MS, &refused);
    CHECK(t1 > 0, "no JOIN after the restart (%d heartbeats refused)", refused);
    if (t1 > 0) {
        const nl_msg_join *j = &c.rx.msg.u.join;
        CHECK(strcmp(j->pubkey, kp.public_z85) == 0 && strcmp(c.rx.peer, kp.public_z85) == 0 &&
                  strcmp(j->data_endpoint, data_ep) == 0,
              "JOIN again: key %s, data endpoint %s (was %s)", j->pubkey, j->data_endpoint,
              data_ep);
        /* unanswered, it comes again after a pause */
        const int64_t t2 = wait_refusing(&c, NL_MSG_JOIN, WAIT_MS, &refused);
        CHECK(t2 > 0 && t2 - t1 >= 150, "the second JOIN: after %lld ms", (long long)(t2 - t1));
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        m.type = NL_MSG_ACCEPT;
        m.u.accept = (nl_msg_accept){9, 100, 2000};
        CHECK_OK(nl_sock_reply(c.sock, &c.rx, &m, &err), &err);
        const int64_t t3 = wait_refusing(&c, NL_MSG_HEARTBEAT, WAIT_MS, &refused);
        CHECK(t3 > 0 && c.rx.msg.u.heartbeat.node_id == 9, "a heartbeat as node 9 after ACCEPT");
    }
    kill(pid, SIGTERM);
    CHECK(reap(pid, WAIT_MS) == 0 && file_has(log, "joining again") &&
              file_has(log, "joined again as node 9"),
          "the node's log");
    if (check_fail_count)
        dump_log(log);
    coord_stop(&c);
}

static void test_one_node(void)
{
    nl_error err;
    char key[300], log[300], ep[256], ckpt[300];
    nl_keypair kp;
    key_files("one", &kp, key, sizeof key);
    snprintf(log, sizeof log, "%s/one.log", tmpdir);
    snprintf(ckpt, sizeof ckpt, "%s/model.safetensors", tmpdir);
    /* the checkpoint the coordinator streams, and the reference read back from it */
    nl_model *init = NULL, *ref = NULL;
    int64_t step = 0;
    CHECK_OK(nl_model_new(&init, be, &cfg, 0, cfg.num_layers, 1, 1, &err), &err);
    CHECK_OK(nl_model_init_random(init, 99, &err), &err);
    CHECK_OK(nl_checkpoint_save(init, ckpt, 0, NULL, &err), &err);
    nl_model_destroy(&init);
    CHECK_OK(nl_checkpoint_load(&ref, be, ckpt, 0, -1, 1, 1, &step, &err), &err);
    if (!ref)
        return;

    coord c;
    const char *keys[] = {kp.public_z85};
    coord_start(&c, keys, 1, "tcp://127.0.0.1:*", NULL);
    const char *dev = check_device();
    const char *argv[] = {"",          "join",     nl_sock_endpoint(c.sock),
                          "--key",     key,        "--coordinator-key",
                          c.pub_path,  "--memory", "256M",
                          "--threads", "1",        "--kv-budget",
                          "1M",        "--name",   "solo",
                          "--device",  dev,        NULL};
    pid_t pid = spawn(log, argv);
    peer *p = coord_accept(&c, kp.public_z85, 7, ep, sizeof ep);
    if (!p) {
        reap(pid, 0);
        dump_log(log);
        goto out;
    }
    send_assign(&c, p, 1, 7, 0, 1, 0, cfg.num_layers, "", "", "", "");
    /* stream the checkpoint in chunks of 1000 elements */
    for (int i = 0; i < ref->n_table; i++) {
        const nl_param *par = &ref->table[i];
        uint64_t numel = nl_param_numel(par);
        float *src = check_download(be, nl_model_param_data(ref, par), numel);
        if (!src)
            continue;
        uint32_t chunks = (uint32_t)((numel + 999) / 1000);
        for (uint32_t k = 0; k < chunks; k++) {
            uint64_t off = (uint64_t)k * 1000, n = numel - off < 1000 ? numel - off : 1000;
            send_chunk(&c, p, 1, par, src + off, off, (int64_t)n, k, chunks);
        }
        free(src);
    }
    /* a chunk of an older epoch is ignored, a foreign tensor refused */
    float junk[16] = {0};
    send_chunk(&c, p, 0, &ref->table[0], junk, 0, 16, 0, 1);
    nl_param foreign = ref->table[1];
    snprintf(foreign.name, sizeof foreign.name, "layers.9.ffn_norm.weight");
    send_chunk(&c, p, 1, &foreign, junk, 0, 16, 0, 1);
    expect_error(&c, p, NL_ERR_NOTFOUND, NL_MSG_LAYER_LOAD, "layers.9.ffn_norm.weight");
    send_simple(&c, p, NL_MSG_LOAD_DONE, (uint64_t)ref->n_table);
    expect_loaded(&c, p, 1, 7, ref);

    check_forward(&c, p, p, ref, 100);
    peer *stages[1] = {p};
    check_generation(&c, stages, 1, ref, 55, false);
    check_generation(&c, stages, 1, ref, 56, true); /* the stage feeds itself */
    check_two_sessions(&c, p, ref);

    /* bad input: a job's bad work fails that job (JOB_STATUS), anything
     * else is answered with an ERROR, and the node stays up */
    int32_t tok[4] = {1, 2, (int32_t)cfg.vocab_size, 3};
    send_tokens(&c, p, 101, 0, 0, tok, 1, 4, NL_DTYPE_I32);
    expect_failed(&c, p, 101, NL_ERR_RANGE, "job 101");
    send_tokens(&c, p, 102, 0, 0, tok, 2, 2, NL_DTYPE_F32);
    expect_failed(&c, p, 102, NL_ERR_SHAPE, "job 102");
    send_tokens(&c, p, 103, 8, 0, tok, 1, 2, NL_DTYPE_I32);
    expect_failed(&c, p, 103, NL_ERR_NOTFOUND, "session 8");
    send_session(&c, p, 9, cfg.max_seq_len + 1, 0);
    expect_failed(&c, p, 9, NL_ERR_RANGE, "capacity");
    send_simple(&c, p, NL_MSG_GRAD_NORM, 0);
    expect_error(&c, p, NL_ERR_UNSUPPORTED, NL_MSG_GRAD_NORM, "GRAD_NORM");
    const uint8_t garbage[] = {0x93, 0x01, 0x02};
    zmq_send(nl_sock_handle(c.sock), p->rid, p->rid_len, ZMQ_SNDMORE);
    zmq_send(nl_sock_handle(c.sock), garbage, sizeof garbage, 0);
    expect_error(&c, p, NL_ERR_PROTO, 0, "");
    check_forward(&c, p, p, ref, 104);

    /* heartbeats: every 100 ms, growing seq, READY, this node's id */
    int before = p->heartbeats;
    coord_next(&c, p, 600);
    CHECK(p->heartbeats - before >= 3 && p->seq_ok && p->hb_state == NL_NODE_READY &&
              p->hb_node == 7,
          "heartbeats: %d in 600 ms, state %u, node %u", p->heartbeats - before, p->hb_state,
          p->hb_node);
    CHECK(file_has(log, "[solo]") && file_has(log, "loaded epoch 1"), "log lines");
    /* a peer's free text reaches the log escaped: no forged line (issue 15, finding 10) */
    nl_wire_msg em;
    nl_wire_msg_init(&em);
    em.type = NL_MSG_ERROR;
    em.u.error = (nl_msg_error){NL_ERR_PROTO, NL_MSG_LOAD_DONE,
                                "evil\n00:00:00.000 ERROR [coord] forged\x1b[2J"};
    coord_send(&c, p, &em);
    coord_next(&c, p, 300);
    CHECK(file_has(log, "evil\\n00:00:00.000 ERROR [coord] forged\\x1b[2J") &&
              !file_has(log, "\n00:00:00.000 ERROR [coord] forged"),
          "the coordinator's ERROR text is logged escaped");
    /* no --checkpoint-root and no --state-dir: no checkpoint is written */
    char nodir[400];
    snprintf(nodir, sizeof nodir, "%s/noroot/step-000000", tmpdir);
    send_train(&c, p, 300);
    send_ckpt(&c, p, 300, nodir);
    expect_failed(&c, p, 300, NL_ERR_AUTH, "no --checkpoint-root");
    CHECK(access(nodir, F_OK) != 0, "a node without a root wrote %s", nodir);
    send_simple(&c, p, NL_MSG_JOB_CANCEL, 300);
    check_leave(&c, p, pid, 7, log);
out:
    coord_stop(&c);
    nl_model_destroy(&ref);
}

/* Two stages: 0 (embedding, layers [0, 2)) -> 1 (layer 2, head) over data. */
static void test_two_nodes(void)
{
    nl_error err;
    char key[2][300], log[2][300], ep[2][256];
    nl_keypair kp[2];
    pid_t pid[2];
    peer *p[2] = {NULL, NULL};
    key_files("n0", &kp[0], key[0], sizeof key[0]);
    key_files("n1", &kp[1], key[1], sizeof key[1]);
    nl_model *ref = NULL, *st0 = NULL, *st1 = NULL;
    CHECK_OK(nl_model_new(&ref, be, &cfg, 0, cfg.num_layers, 1, 1, &err), &err);
    CHECK_OK(nl_model_init_random(ref, SEED, &err), &err);
    CHECK_OK(nl_model_new(&st0, be, &cfg, 0, 2, 1, 0, &err), &err);
    CHECK_OK(nl_model_new(&st1, be, &cfg, 2, cfg.num_layers, 0, 1, &err), &err);
    coord c;
    const char *keys[] = {kp[0].public_z85, kp[1].public_z85};
    coord_start(&c, keys, 2, "tcp://127.0.0.1:*", NULL);
    for (int i = 0; i < 2; i++) {
        snprintf(log[i], sizeof log[i], "%s/two-%d.log", tmpdir, i);
        const char *argv[] = {"",          "join",     nl_sock_endpoint(c.sock),
                              "--key",     key[i],     "--coordinator-key",
                              c.pub_path,  "--memory", "256M",
                              "--threads", "1",        "--kv-budget",
                              "16M",       "--device", check_device(),
                              NULL};
        pid[i] = spawn(log[i], argv);
        p[i] = coord_accept(&c, kp[i].public_z85, (uint32_t)i + 1, ep[i], sizeof ep[i]);
    }
    if (!p[0] || !p[1] || !ref || !st0 || !st1)
        goto out;
    /* a ring: stage 1 (the last) feeds stage 0 */
    send_assign(&c, p[0], 1, 1, 0, 2, 0, 2, ep[1], kp[1].public_z85, ep[1], kp[1].public_z85);
    send_assign(&c, p[1], 1, 2, 1, 2, 2, cfg.num_layers, ep[0], kp[0].public_z85, ep[0],
                kp[0].public_z85);
    send_simple(&c, p[0], NL_MSG_LOAD_DONE, 0); /* initialise from the seed */
    expect_loaded(&c, p[0], 1, 1, st0);
    send_simple(&c, p[1], NL_MSG_LOAD_DONE, 0);
    expect_loaded(&c, p[1], 1, 2, st1);
    check_forward(&c, p[0], p[1], ref, 200);
    check_generation(&c, p, 2, ref, 77, false);
    check_generation(&c, p, 2, ref, 78, true);

    /* a stranger cannot feed stage 1: its activation is dropped unanswered */
    nl_keypair sk;
    CHECK_OK(nl_keys_generate(&sk, &err), &err);
    nl_sock_opts so = {.type = ZMQ_DEALER,
                       .keys = &sk,
                       .server_key = kp[1].public_z85,
                       .name = "stranger",
                       .linger_ms = 0};
    nl_sock *s = NULL;
    CHECK_OK(nl_sock_new(&s, c.net, &so, &err), &err);
    if (s) {
        CHECK_OK(nl_sock_connect(s, ep[1], &err), &err);
        static float hidden[3 * 32];
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        m.type = NL_MSG_ACTIVATION;
        m.u.hop = (nl_msg_tensor_hop){300, 0, 0, 0, 0, 0.0};
        m.nframes = 1;
        m.frames[0].t = (nl_tensor){NL_DTYPE_F32, 3, {1, 3, cfg.hidden_dim}, hidden};
        CHECK_OK(nl_sock_send(s, NULL, 0, &m, &err), &err);
        nl_msg_type t = coord_next(&c, p[1], WAIT_NO * 2);
        CHECK(t == NL_MSG_NONE, "a stranger's activation was served: %s", nl_wire_type_name(t));
        nl_sock_destroy(&s);
    }
    check_forward(&c, p[0], p[1], ref, 201);

    /* stage 1 re-assigned with the wrong prev_key: stage 0's handshake is
     * refused and reported; a correct ASSIGN heals it */
    send_assign(&c, p[1], 2, 2, 1, 2, 2, cfg.num_layers, ep[0], sk.public_z85, "", "");
    send_simple(&c, p[1], NL_MSG_LOAD_DONE, 2ULL << 32);
    expect_loaded(&c, p[1], 2, 2, st1);
    send_assign(&c, p[0], 2, 1, 0, 2, 0, 2, "", "", ep[1], kp[1].public_z85);
    send_simple(&c, p[0], NL_MSG_LOAD_DONE, 2ULL << 32);
    expect_loaded(&c, p[0], 2, 1, st0);
    int32_t tok[3] = {5, 6, 7};
    send_tokens(&c, p[0], 202, 0, 0, tok, 1, 3, NL_DTYPE_I32);
    expect_error(&c, p[0], NL_ERR_AUTH, NL_MSG_ASSIGN, "refused this node's handshake");
    send_assign(&c, p[1], 3, 2, 1, 2, 2, cfg.num_layers, ep[0], kp[0].public_z85, "", "");
    send_simple(&c, p[1], NL_MSG_LOAD_DONE, 3ULL << 32);
    expect_loaded(&c, p[1], 3, 2, st1);
    check_forward(&c, p[0], p[1], ref, 203);
    for (int i = 0; i < 2; i++)
        check_leave(&c, p[i], pid[i], (uint32_t)i + 1, log[i]);
out:
    for (int i = 0; i < 2; i++)
        if (!p[i] || !p[0] || !p[1]) {
            reap(pid[i], 0);
            dump_log(log[i]);
        }
    coord_stop(&c);
    nl_model_destroy(&st0);
    nl_model_destroy(&st1);
    nl_model_destroy(&ref);
}

int main(void)
{
    nl_error err;
    nl_log_set_name("test_node");
    nl_log_set_level(NL_LOG_WARN);
    snprintf(node_bin, sizeof node_bin, "%s/node/neuronode", check_build_dir());
    if (access(node_bin, X_OK) != 0) {
        fprintf(stderr, "test_node: %s is not built\n", node_bin);
        return 1;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/test_node.XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    signal(SIGALRM, on_alarm);
    alarm(240); /* a hang is a failure, not a stuck CI job */
    nl_config_init(&cfg);
    cfg.hidden_dim = 32;
    cfg.num_layers = 3;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    cfg.ffn_dim = 48;
    cfg.num_experts = 4;
    cfg.vocab_size = 300;
    cfg.vocab_chunk = 128;
    cfg.max_seq_len = 32;
    cfg_json = nl_config_to_json(&cfg);
    CHECK_OK(check_backend_new(&be, 1, &err), &err); /* as the nodes: same sums */
    if (be && cfg_json) {
        test_cli();
        test_late_and_refused();
        test_rejoin();
        test_ckpt_root();
        test_one_node();
        test_two_nodes();
    }
    kill_kids();
    nl_backend_destroy(&be);
    free(cfg_json);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (check_fail_count == 0 && !getenv("TEST_NODE_KEEP") && system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", tmpdir);
    return check_done("test_node");
}
