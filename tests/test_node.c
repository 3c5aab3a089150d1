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
 *    (a stranger's activation is dropped), initialised from the seed.
 * Joining again and the checkpoint root are in test_node_rejoin.c; the
 * harness (children, the fake coordinator) is node_harness.h. */
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
#include "core/model/forward.h"
#include "core/model/sampler.h"
#include "tests/node_harness.h"

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
    CHECK_OK(nl_kvcache_new(&kv, ref, 1, P + n, NL_KV_FP32, &err), &err);
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
    join_kv_budget = 1ULL << 20;
    peer *p = coord_accept(&c, kp.public_z85, 7, ep, sizeof ep);
    join_kv_budget = 64ULL << 20;
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
    /* it names the request that failed: the coordinator saving a step
     * tells a refused shard from a failed step (coord_train_ops.c) */
    CHECK(c.rx.msg.type == NL_MSG_JOB_STATUS && c.rx.msg.u.job_status.req_type == NL_MSG_CKPT_REQ,
          "a refused CKPT_REQ is reported as about %u", c.rx.msg.u.job_status.req_type);
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
        join_kv_budget = 16ULL << 20;
        p[i] = coord_accept(&c, kp[i].public_z85, (uint32_t)i + 1, ep[i], sizeof ep[i]);
        join_kv_budget = 64ULL << 20;
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
    if (!harness_begin("test_node"))
        return 1;
    if (be && cfg_json) {
        test_cli();
        test_late_and_refused();
        test_one_node();
        test_two_nodes();
    }
    return harness_end("test_node");
}
