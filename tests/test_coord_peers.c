/* Unit tests of the coordinator's peers, in-process (the fakes of
 * coord_fake.c against coordinators of the tests' own):
 *  - roles under CURVE: what a node's key, a client's and an admin's may
 *    send on which socket, and what a status shows each of them;
 *  - the jobs' owners: a job is its key's (and an admin's) alone, a key
 *    holds at most --max-jobs-per-key jobs, growing is an admin's;
 *  - the clients' endpoint derived from --listen, or refused;
 *  - a convicted key banned on every line that lists it.
 * The node table's indexes: test_coord_index.c; the cluster's story (join,
 * plan, jobs, death): test_coord.c. */
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
#include "coordinator/coord_impl.h"
#include "net/handshake.h"
#include "net/keys.h"
#include "net/transport.h"
#include "tests/check.h"
#include "tests/coord_fake.h"

/* ---------------------------------------------------------------- roles (CURVE) */

/* A CURVE client of the coordinator with key kp (and routing id rid, if
 * not NULL), on its nodes' socket or its clients' (client). */
static void curve_open(fake *f, const nl_keypair *kp, const char *server, const char *rid,
                       int on_clients)
{
    nl_error err = {0};
    memset(f, 0, sizeof *f);
    snprintf(f->key, sizeof f->key, "%s", kp->public_z85);
    nl_sock_opts o = {
        .type = ZMQ_DEALER, .keys = kp, .server_key = server, .name = "curve-fake", .linger_ms = 0};
    CHECK_OK(nl_sock_new(&f->sock, net, &o, &err), &err);
    if (rid)
        zmq_setsockopt(nl_sock_handle(f->sock), ZMQ_ROUTING_ID, rid, strlen(rid));
    CHECK_OK(
        nl_sock_connect(
            f->sock, on_clients ? nl_coord_client_endpoint(coord) : nl_coord_endpoint(coord), &err),
        &err);
}

/* f sends m; the coordinator must answer with an ERROR whose message
 * holds want. */
static void refused(fake *f, nl_wire_msg *m, const char *want, const char *what)
{
    nl_rx rx;
    nl_rx_init(&rx);
    fake_send(f, m);
    CHECK(pump_until(f, NL_MSG_ERROR, &rx) && strstr(rx.msg.u.error.message, want), "%s: %s", what,
          rx.msg.type == NL_MSG_ERROR ? rx.msg.u.error.message : "no ERROR");
    nl_rx_free(&rx);
}

/* Does a CURVE connection with key kp to endpoint ep fail its handshake
 * (ZAP refuses the key)? */
static int handshake_refused(const nl_keypair *kp, const char *server, const char *ep)
{
    nl_error err = {0};
    nl_sock *s = NULL;
    nl_handshake *hs = NULL;
    nl_sock_opts o = {
        .type = ZMQ_DEALER, .keys = kp, .server_key = server, .name = "curve-fake", .linger_ms = 0};
    nl_status st = nl_sock_new(&s, net, &o, &err);
    if (st == NL_OK && (st = nl_handshake_watch(&hs, net, s, &err)) == NL_OK &&
        (st = nl_sock_connect(s, ep, &err)) == NL_OK)
        st = nl_handshake_wait(hs, ep, 5000, &err);
    nl_handshake_destroy(&hs);
    nl_sock_destroy(&s);
    return st == NL_ERR_AUTH && strstr(err.msg, "refused this key");
}

/* Issue 15, finding 8: each socket admits its role's keys alone (ZAP): a
 * client key never reaches the nodes' bulk-sized socket, a node key never
 * the clients'; a key with both roles (no role word) that knocks at the
 * wrong one is told where to go. */
static void roles_by_socket(const nl_keypair *node, const nl_keypair *ckey,
                            const nl_keypair *legacy, const char *server)
{
    CHECK(handshake_refused(ckey, server, nl_coord_endpoint(coord)),
          "a client key's handshake on the nodes' socket is not refused");
    CHECK(handshake_refused(node, server, nl_coord_client_endpoint(coord)),
          "a node key's handshake on the clients' socket is not refused");
    fake on_nodes, on_clients;
    curve_open(&on_nodes, legacy, server, NULL, 0);
    curve_open(&on_clients, legacy, server, NULL, 1);
    char want[400];
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    snprintf(want, sizeof want, "clients connect to %s", nl_coord_client_endpoint(coord));
    for (int i = 0; i < 7; i++) { /* no strikes: a ban (5) would drop the last unanswered */
        nl_wire_msg_reset(&m, NL_MSG_JOB_QUERY);
        m.u.job_ref.job_id = 0;
        refused(&on_nodes, &m, want, "a JOB_QUERY on the nodes' socket");
    }
    nl_wire_msg_reset(&m, NL_MSG_HELLO);
    m.u.hello = (nl_msg_hello){NL_ROLE_NODE, "test"};
    snprintf(want, sizeof want, "nodes connect to %s", nl_coord_endpoint(coord));
    refused(&on_clients, &m, want, "a node's HELLO on the clients' socket");
    nl_sock_destroy(&on_nodes.sock);
    nl_sock_destroy(&on_clients.sock);
}

/* Issue 15, findings 2 and 7, on a CURVE coordinator whose authorized_keys
 * gives each key a role: a client key cannot JOIN, report LOAD_DONE or
 * GRAD_NORM; a node key cannot submit; a client's status shows no node's
 * key or endpoint, an admin's does; and a connection that takes over a
 * node's routing id with another key is not that node (its HEARTBEAT is
 * refused). */
static void members_opts(nl_coord_opts *o)
{
    o->min_nodes = 5; /* no plan: membership, roles and keys only */
    o->node_timeout_ms = 60000;
}

static void test_roles(void)
{
    char dir[256], keys[1024];
    nl_keypair node, ckey, admin, other, legacy;
    nl_error err = {0};
    CHECK_OK(nl_keys_generate(&legacy, &err), &err);
    CHECK_OK(nl_keys_generate(&node, &err), &err);
    CHECK_OK(nl_keys_generate(&ckey, &err), &err);
    CHECK_OK(nl_keys_generate(&admin, &err), &err);
    CHECK_OK(nl_keys_generate(&other, &err), &err);
    snprintf(
        keys, sizeof keys, "%s node  # a node\n%s client\n%s admin # the operator\n%s node\n%s\n",
        node.public_z85, ckey.public_z85, admin.public_z85, other.public_z85, legacy.public_z85);
    coord_fake_start_with(
        &(coord_fake_setup){.tag = "coord_roles", .authorized_keys = keys, .tweak = members_opts},
        dir, sizeof dir);
    const char *server = coord_key;
    roles_by_socket(&node, &ckey, &legacy, server);
    fake n, cl, ad, spoof;
    curve_open(&n, &node, server, "nodeRID", 0);
    curve_open(&cl, &ckey, server, NULL, 1);
    curve_open(&ad, &admin, server, NULL, 1);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){ckey.public_z85, "cpu", UINT64_MAX, 1e6, 1, "tcp://10.0.0.1:1", 0};
    refused(&cl, &m, "not for a key of this role", "a client's JOIN");
    nl_wire_msg_reset(&m, NL_MSG_LOAD_DONE);
    m.u.load_done = (nl_msg_load_done){1, 1, 0, 0};
    refused(&cl, &m, "not for a key of this role", "a client's LOAD_DONE");
    nl_wire_msg_reset(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm = (nl_msg_grad_norm){1, 1, 0, 1.0};
    refused(&cl, &m, "not for a key of this role", "a client's GRAD_NORM");
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_FORWARD, 0, NULL};
    refused(&n, &m, "not for a key of this role", "a node's JOB_SUBMIT");
    /* the node joins */
    nl_rx rx;
    nl_rx_init(&rx);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){node.public_z85, "cpu", 1ull << 30, 1.0, 1, "tcp://10.9.8.7:4242", 0};
    fake_send(&n, &m);
    uint32_t id = 0;
    if (CHECK_PUMP(pump_until(&n, NL_MSG_ACCEPT, &rx)))
        id = rx.msg.u.accept.node_id;
    /* another node key names the joined node's key in its JOIN: refused,
     * and the node keeps its place (the status still has its endpoint) */
    fake imp;
    curve_open(&imp, &other, server, NULL, 0);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){node.public_z85, "cpu", 1ull << 30, 1.0, 1, "tcp://10.6.6.6:666", 0};
    refused(&imp, &m, "JOIN names a key other than the one this connection authenticated",
            "a JOIN naming another node's key");
    nl_sock_destroy(&imp.sock);
    char *ct = fake_status_text(&cl), *at = fake_status_text(&ad);
    CHECK(at && !strstr(at, "10.6.6.6"), "the impostor is in the status: %s", at ? at : "(none)");
    CHECK(ct && strstr(ct, "\"nodes\"") && !strstr(ct, node.public_z85) &&
              !strstr(ct, "10.9.8.7") && !strstr(ct, "\"endpoint\""),
          "a client's status shows nodes' keys or endpoints: %s", ct ? ct : "(none)");
    CHECK(at && strstr(at, node.public_z85) && strstr(at, "10.9.8.7"),
          "an admin's status lacks the nodes: %s", at ? at : "(none)");
    free(ct);
    free(at);
    /* another key takes over the node's routing id once it is gone */
    nl_sock_destroy(&n.sock);
    for (int i = 0; i < 60; i++)
        nl_coord_step(coord, 5);
    curve_open(&spoof, &other, server, "nodeRID", 0);
    nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
    m.u.heartbeat = (nl_msg_heartbeat){.node_id = id, .seq = 1};
    refused(&spoof, &m, "unknown node", "a HEARTBEAT under a node's routing id, another key");
    nl_rx_free(&rx);
    nl_sock_destroy(&spoof.sock);
    nl_sock_destroy(&cl.sock);
    nl_sock_destroy(&ad.sock);
    coord_fake_stop(dir);
}

/* --listen ipc://<state dir>/c.sock: the clients' endpoint is derived from it. */
static char ep_listen[300];

static void endpoints_opts(nl_coord_opts *o)
{
    snprintf(ep_listen, sizeof ep_listen, "ipc://%s/c.sock", o->state_dir);
    o->listen = ep_listen;
    o->min_nodes = 5;
}

static void test_endpoints(void)
{
    char dir[256], want[320], path[400], line[400];
    coord_fake_start("coord_ep", dir, sizeof dir, endpoints_opts);
    snprintf(want, sizeof want, "%s-client", ep_listen);
    CHECK(strcmp(nl_coord_client_endpoint(coord), want) == 0, "clients' endpoint %s for %s",
          nl_coord_client_endpoint(coord), ep_listen);
    snprintf(path, sizeof path, "%s/client_endpoint", dir);
    FILE *f = fopen(path, "r");
    CHECK(f && fgets(line, sizeof line, f) && strncmp(line, want, strlen(want)) == 0,
          "%s does not name %s", path, want);
    if (f)
        fclose(f);
    nl_coord_destroy(&coord);
    /* the port after 65535 is no port: no clients' endpoint to derive */
    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = "tcp://127.0.0.1:65535";
    o.state_dir = dir;
    o.plaintext = 1;
    o.min_nodes = 5;
    nl_coord *c = NULL;
    nl_error err = {0};
    nl_status st = nl_coord_new(&c, &o, &err);
    CHECK(st == NL_ERR_INVALID && strstr(err.msg, "give --client-listen"),
          "--listen at port 65535: %s '%s'", nl_status_str(st), err.msg);
    nl_coord_destroy(&c);
    coord_fake_stop(dir);
}

/* ---------------------------------------------------------------- jobs' owners (CURVE) */

/* The next JOB_STATUS to f: its job, state and message (0: none). */
static int status_of(fake *f, uint64_t *job, uint32_t *state, char *msg, size_t cap)
{
    nl_rx rx;
    nl_rx_init(&rx);
    int ok = pump_until(f, NL_MSG_JOB_STATUS, &rx);
    if (ok) {
        *job = rx.msg.u.job_status.job_id;
        *state = rx.msg.u.job_status.state;
        snprintf(msg, cap, "%s", rx.msg.u.job_status.message);
    }
    nl_rx_free(&rx);
    return ok;
}

static void send_ref(fake *f, nl_msg_type type, uint64_t job)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, type);
    m.u.job_ref.job_id = job;
    fake_send(f, &m);
}

static void submit_generate(fake *f)
{
    static const int32_t prompt[3] = {4, 5, 6};
    const int64_t shape[2] = {1, 3};
    nl_wire_param ps[1] = {{.key = "max_new", .kind = NL_WIRE_PARAM_INT, .i = 4}};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, 1, ps};
    nl_wire_frame_set(&m.frames[0], prompt, NL_DTYPE_I32, shape, 2);
    m.nframes = 1;
    fake_send(f, &m);
}

/* f submits kind with params ps (no frame) and must be refused at once
 * with a message that holds want. */
static void submit_refused(fake *f, uint32_t kind, nl_wire_param *ps, uint32_t n, const char *want,
                           const char *what)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){kind, n, ps};
    fake_send(f, &m);
    uint64_t job = 1;
    uint32_t state = 0;
    char msg[700] = "";
    CHECK(status_of(f, &job, &state, msg, sizeof msg) && job == 0 && state == NL_JOB_FAILED &&
              strstr(msg, want),
          "%s: job %llu state %u: %s", what, (unsigned long long)job, state, msg);
}

/* One stage (a fake node) takes the plan: ASSIGN, LOAD_DONE both ways. */
static int one_stage(fake *n)
{
    return fake_take_plan(n) && pump_state("ready");
}

/* Issue 31, item 6: a job belongs to the key that submitted it. Another
 * client key that names its id is told "no such job" (query, cancel),
 * sees neither its id nor its kind in the status, and cannot take its
 * tokens; the same key from another connection follows it (attach); an
 * admin sees it without taking its reports, and cancels it (its follower
 * is told). A key holds at most --max-jobs-per-key jobs; a client cannot
 * grow the model, nor reload the cluster under other keys' jobs. */
static void ownership(const nl_keypair *node, const nl_keypair *alice, const nl_keypair *bob,
                      const nl_keypair *admin, const char *server)
{
    fake n, a, a2, b, ad;
    nl_rx rx;
    nl_rx_init(&rx);
    curve_open(&n, node, server, NULL, 0);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){node->public_z85, "cpu", 1ull << 30, 1.0, 1, "tcp://127.0.0.1:1", 0};
    fake_send(&n, &m);
    if (CHECK_PUMP(pump_until(&n, NL_MSG_ACCEPT, &rx)))
        n.id = rx.msg.u.accept.node_id;
    if (!CHECK_PUMP(one_stage(&n))) {
        nl_sock_destroy(&n.sock);
        nl_rx_free(&rx);
        return;
    }
    curve_open(&a, alice, server, NULL, 1);
    curve_open(&b, bob, server, NULL, 1);
    curve_open(&ad, admin, server, NULL, 1);
    uint64_t job = 0, got = 0;
    uint32_t state = 0;
    char msg[700];
    submit_generate(&a);
    CHECK(status_of(&a, &job, &state, msg, sizeof msg) && job > 0 && state == NL_JOB_RUNNING,
          "alice's generation: %s", msg);
    /* bob names alice's job */
    send_ref(&b, NL_MSG_JOB_QUERY, job);
    CHECK(status_of(&b, &got, &state, msg, sizeof msg) && state == NL_JOB_FAILED &&
              strcmp(msg, "no such job") == 0,
          "bob's query of alice's job: state %u: %s", state, msg);
    send_ref(&b, NL_MSG_JOB_CANCEL, job);
    CHECK(status_of(&b, &got, &state, msg, sizeof msg) && state == NL_JOB_FAILED &&
              strstr(msg, "no such job"),
          "bob's cancel of alice's job: state %u: %s", state, msg);
    char *bt = fake_status_text(&b), *at = fake_status_text(&a), idtext[80];
    snprintf(idtext, sizeof idtext, "\"jobs\":[{\"id\":%llu,", (unsigned long long)job);
    CHECK(bt && strstr(bt, "\"jobs\":[]") && strstr(bt, "\"jobs_of_others\":1"),
          "bob's status shows alice's job: %s", bt ? bt : "(none)");
    CHECK(at && strstr(at, idtext), "alice's status lacks her job: %s", at ? at : "(none)");
    free(bt);
    free(at);
    /* alice follows it from another connection; an admin looks at it */
    curve_open(&a2, alice, server, NULL, 1);
    send_ref(&a2, NL_MSG_JOB_QUERY, job);
    CHECK(status_of(&a2, &got, &state, msg, sizeof msg) && got == job && state == NL_JOB_RUNNING,
          "alice's attach: state %u: %s", state, msg);
    send_ref(&ad, NL_MSG_JOB_QUERY, job);
    CHECK(status_of(&ad, &got, &state, msg, sizeof msg) && got == job && state == NL_JOB_RUNNING,
          "the admin's query: state %u: %s", state, msg);
    /* the stage opens the session, then its token goes to alice's new
     * connection, not to bob or the admin */
    CHECK_PUMP(pump_until(&n, NL_MSG_JOB_SUBMIT, &rx));
    nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
    m.u.job_status = (nl_msg_job_status){job, NL_JOB_RUNNING, 0.0, "session open", 0};
    fake_send(&n, &m);
    CHECK_PUMP(pump_until(&n, NL_MSG_ACTIVATION, &rx));
    uint32_t tok = 9;
    nl_wire_msg_reset(&m, NL_MSG_TOKEN);
    m.u.token = (nl_msg_token){job, job, 1, &tok, false, 0, NULL};
    fake_send(&n, &m);
    CHECK(pump_until(&a2, NL_MSG_TOKEN, &rx) && rx.msg.u.token.job_id == job,
          "alice's follower got no token");
    nl_error err = {0};
    nl_rx_free(&rx);
    nl_rx_init(&rx);
    CHECK(nl_sock_recv(b.sock, &rx, 0, &err) == NL_ERR_TIMEOUT &&
              nl_sock_recv(ad.sock, &rx, 0, &err) == NL_ERR_TIMEOUT,
          "bob or the admin got a message of alice's job (%s)", nl_wire_type_name(rx.msg.type));
    /* limits by role: a client grows nothing, reloads nothing under alice's job */
    nl_wire_param grow[1] = {{.key = "layers", .kind = NL_WIRE_PARAM_INT, .i = 12}};
    submit_refused(&b, NL_JOB_GROW, grow, 1, "admin role", "bob's grow job");
    nl_wire_param resume[1] = {
        {.key = "resume", .kind = NL_WIRE_PARAM_STR, .s = "m/manifest.json"}};
    submit_refused(&b, NL_JOB_TRAIN, resume, 1, "would fail the 1 job(s) of other clients",
                   "bob's training job with resume");
    /* --max-jobs-per-key 2: alice's third is refused, naming the flag */
    submit_generate(&a);
    CHECK(status_of(&a, &got, &state, msg, sizeof msg) && state == NL_JOB_RUNNING && got != job,
          "alice's second generation: %s", msg);
    submit_generate(&a);
    CHECK(status_of(&a, &got, &state, msg, sizeof msg) && state == NL_JOB_FAILED &&
              strstr(msg, "--max-jobs-per-key"),
          "alice's third job: state %u: %s", state, msg);
    /* the admin cancels alice's first job: her follower is told */
    send_ref(&ad, NL_MSG_JOB_CANCEL, job);
    CHECK(status_of(&ad, &got, &state, msg, sizeof msg) && got == job && state == NL_JOB_CANCELLED,
          "the admin's cancel: state %u: %s", state, msg);
    CHECK(status_of(&a2, &got, &state, msg, sizeof msg) && got == job &&
              state == NL_JOB_CANCELLED && strstr(msg, "admin"),
          "alice's follower after the admin's cancel: state %u: %s", state, msg);
    nl_wire_msg_free(&m);
    nl_rx_free(&rx);
    nl_sock_destroy(&n.sock);
    nl_sock_destroy(&a.sock);
    nl_sock_destroy(&a2.sock);
    nl_sock_destroy(&b.sock);
    nl_sock_destroy(&ad.sock);
}

static void ownership_opts(nl_coord_opts *o)
{
    o->min_nodes = 1;
    o->node_timeout_ms = 60000; /* the fake node sends no heartbeats */
    o->job_timeout_ms = 60000;
    o->max_jobs_per_key = 2;
}

static void test_ownership(void)
{
    char dir[256], keys[1024];
    nl_keypair node, alice, bob, admin;
    nl_error err = {0};
    CHECK_OK(nl_keys_generate(&node, &err), &err);
    CHECK_OK(nl_keys_generate(&alice, &err), &err);
    CHECK_OK(nl_keys_generate(&bob, &err), &err);
    CHECK_OK(nl_keys_generate(&admin, &err), &err);
    snprintf(keys, sizeof keys, "%s node\n%s client\n%s client\n%s admin\n", node.public_z85,
             alice.public_z85, bob.public_z85, admin.public_z85);
    /* one stage of 2 layers: a single fake node takes the plan */
    coord_fake_start_with(
        &(coord_fake_setup){
            .tag = "coord_own", .layers = 2, .authorized_keys = keys, .tweak = ownership_opts},
        dir, sizeof dir);
    ownership(&node, &alice, &bob, &admin, coord_key);
    coord_fake_stop(dir);
}

/* A convicted node's key is banned on every line that lists it (a key may
 * be listed twice or more: its lines' roles add up), each line commented
 * out with the conviction's reason (coord_quarantine): eight lines of one
 * key and a reason of 300 bytes outgrew the buffer the rewrite was made in.
 * A line break in the reason stays in its comment (it would have begun a
 * line of its own, here one that authorizes another key as admin), and the
 * key recorded as banned is the line's own, not one its comment names. */
static void test_ban_lines(void)
{
    char dir[256], path[400], why[301], keys[1200];
    nl_keypair node, admin, evil;
    nl_error err = {0};
    CHECK_OK(nl_keys_generate(&node, &err), &err);
    CHECK_OK(nl_keys_generate(&admin, &err), &err);
    CHECK_OK(nl_keys_generate(&evil, &err), &err);
    size_t len = (size_t)snprintf(keys, sizeof keys, "%s admin\n", admin.public_z85);
    for (int i = 0; i < 8; i++)
        len += (size_t)snprintf(keys + len, sizeof keys - len, "%s node\n", node.public_z85);
    len += (size_t)snprintf(keys + len, sizeof keys - len, "%s node # replaces: %s\n",
                            node.public_z85, admin.public_z85);
    coord_fake_start_with(
        &(coord_fake_setup){.tag = "coord_ban", .authorized_keys = keys, .tweak = members_opts},
        dir, sizeof dir);
    fake n;
    nl_rx rx;
    nl_rx_init(&rx);
    curve_open(&n, &node, coord_key, NULL, 0);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){node.public_z85, "cpu", 1ull << 30, 1.0, 1, "tcp://10.9.8.7:1", 0};
    fake_send(&n, &m);
    cnode *cn = NULL;
    if (CHECK_PUMP(pump_until(&n, NL_MSG_ACCEPT, &rx)))
        cn = coord_node_by_id(coord, rx.msg.u.accept.node_id);
    CHECK(cn != NULL, "the joined node is in the table");
    memset(why, 'w', 300);
    snprintf(why + 250, sizeof why - 250, "\n%s admin", evil.public_z85);
    if (cn)
        coord_quarantine(coord, cn, 1, why);
    snprintf(path, sizeof path, "%s/authorized_keys", dir);
    int banned = 0, listed = 0, lines = 0, evil_lines = 0;
    char line[1024];
    FILE *fp = fopen(path, "r");
    if (fp) {
        while (fgets(line, sizeof line, fp)) {
            lines++;
            listed += strstr(line, node.public_z85) != NULL;
            banned +=
                strncmp(line, "# banned: www", 13) == 0 && strstr(line, node.public_z85) != NULL;
            evil_lines += strncmp(line, evil.public_z85, NL_KEY_Z85_LEN) == 0;
        }
        fclose(fp);
    }
    CHECK(listed == 9 && banned == 9, "the key's 9 lines: %d of %d commented out as banned", banned,
          listed);
    CHECK(lines == 10 && evil_lines == 0,
          "the file's 10 lines stay 10 (%d), none a line of the key in the reason (%d)", lines,
          evil_lines);
    int own = 0;
    for (int i = 0; i < coord->n_bans; i++)
        own += strcmp(coord->bans[i].key, node.public_z85) == 0 &&
               strchr(coord->bans[i].why, '\n') == NULL;
    CHECK(coord->n_bans == 9 && own == 9,
          "the bans read back: %d, %d of them the node's key with its reason on one line",
          coord->n_bans, own);
    nl_rx_free(&rx);
    nl_sock_destroy(&n.sock);
    coord_fake_stop(dir);
}

int main(void)
{
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_WARN);
    nl_error err = {0};
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    test_endpoints();
    test_roles();
    test_ownership();
    test_ban_lines();
    nl_net_destroy(&net);
    coord_fake_add_counts(&check_pass_count, &check_fail_count);
    return check_done("test_coord_peers");
}
