/* Integration tests of the neuronode daemon, continued from test_node.c
 * (same harness, node_harness.h):
 *  - the checkpoint root: a node writes checkpoints only under
 *    --checkpoint-root, and refuses a directory outside it;
 *  - joining again: a coordinator that restarted refuses the node's
 *    heartbeats as an unknown node, and the node JOINs again with its key
 *    and data endpoint until it is ACCEPTed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/node_harness.h"

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

int main(void)
{
    if (!harness_begin("test_node_rejoin"))
        return 1;
    if (be && cfg_json) {
        test_rejoin();
        test_ckpt_root();
    }
    return harness_end("test_node_rejoin");
}
