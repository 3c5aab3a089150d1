/* Unit tests of the coordinator's node table (coordinator/coord_base.c's
 * indexes), in-process against the fakes of coord_fake.c: hundreds of
 * joins, deaths and rejoins; restarts; a routing id taken over; two live
 * processes with one key. Split from test_coord_peers.c (roles, owners,
 * endpoints, bans), which shares the fakes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord.h"
#include "coordinator/coord_impl.h"
#include "net/transport.h"
#include "tests/check.h"
#include "tests/coord_fake.h"

/* ---------------------------------------------------------------- the node index */

/* The node table's indexes (coordinator/coord_base.c), on a coordinator
 * of its own that never plans (--min-nodes out of reach):
 *  - IX nodes join (the table grows from 16 slots to 512), each with its
 *    own id; every node's heartbeat is taken under its id and refused
 *    under another node's (its routing id finds it and no other);
 *  - a third stop beating: they are declared dead after the timeout and
 *    not before, the others (beating) live; a dead node's heartbeat is
 *    refused;
 *  - the dead join again on the same connections: new ids, in the slots
 *    they left (the table lists IX nodes again, none dead);
 *  - a live node that joins again from a new connection (a restart) is
 *    its new id only;
 *  - a connection that takes over a gone node's routing id with another
 *    key joins, and its heartbeats are its own (the old node is dead). */
#define IX 300
#define IX_BEAT_MS 250
#define IX_TIMEOUT_MS 1500

static fake ix[IX];
static int ix_refused[IX];

static void ix_beat(fake *f, uint32_t id)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
    m.u.heartbeat = (nl_msg_heartbeat){.node_id = id, .seq = ++f->seq};
    fake_send(f, &m);
}

/* f as fake_open makes it (key, endpoint), its DEALER with routing id rid */
static void open_rid(fake *f, const char *key, const char *endpoint, const char *rid)
{
    nl_error err = {0};
    fake_open(f, key, endpoint);
    nl_sock_destroy(&f->sock);
    nl_sock_opts so = {.type = ZMQ_DEALER, .plaintext = true, .name = "fake", .linger_ms = 0};
    CHECK_OK(nl_sock_new(&f->sock, net, &so, &err), &err);
    zmq_setsockopt(nl_sock_handle(f->sock), ZMQ_ROUTING_ID, rid, strlen(rid));
    CHECK_OK(nl_sock_connect(f->sock, nl_coord_endpoint(coord), &err), &err);
}

/* Turn the loop for s seconds: the beating nodes beat every IX_BEAT_MS;
 * every ERROR a node gets is counted in ix_refused. */
static void ix_pump(double s)
{
    const double t0 = now_s();
    nl_rx rx;
    nl_rx_init(&rx);
    while (now_s() - t0 < s) {
        for (int k = 0; k < 50; k++)
            nl_coord_step(coord, 0);
        const double t = now_s();
        for (int i = 0; i < IX; i++) {
            fake *f = &ix[i];
            if (f->beating && (t - f->last_beat) * 1e3 >= IX_BEAT_MS) {
                ix_beat(f, f->id);
                f->last_beat = t;
            }
            nl_error err = {0};
            while (nl_sock_recv(f->sock, &rx, 0, &err) == NL_OK) {
                if (rx.msg.type == NL_MSG_ERROR && strstr(rx.msg.u.error.message, "unknown node"))
                    ix_refused[i]++;
                if (rx.msg.type == NL_MSG_ACCEPT && !f->id) { /* it beats from now on */
                    f->id = rx.msg.u.accept.node_id;
                    f->beating = 1;
                    f->last_beat = t;
                }
                nl_rx_free(&rx);
                nl_rx_init(&rx);
            }
        }
        usleep(1000);
    }
    nl_rx_free(&rx);
}

/* How many times needle occurs in the status JSON f is answered. */
static int status_count(fake *f, const char *needle)
{
    char *t = fake_status_text(f);
    int n = t ? 0 : -1;
    for (const char *p = t; p && (p = strstr(p, needle)); p++)
        n++;
    free(t);
    return n;
}

/* Nodes from, from + step, ... JOIN (again) and the loop turns until
 * each is ACCEPTed (beating from then on); returns how many were. */
static int ix_join(int from, int step)
{
    int want = 0, got = 0;
    for (int i = from; i < IX; i += step, want++) {
        ix[i].id = 0;
        ix[i].beating = 0;
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_JOIN);
        m.u.join = (nl_msg_join){ix[i].key, "cpu", 1ull << 30, 1.0, 1, ix[i].endpoint, 0};
        fake_send(&ix[i], &m);
    }
    for (const double t0 = now_s(); got < want && now_s() - t0 < WAIT_S;) {
        ix_pump(0.05);
        got = 0;
        for (int i = from; i < IX; i += step)
            got += ix[i].id > 0;
    }
    return got;
}

static int ix_refusals(int from, int step)
{
    int n = 0;
    for (int i = from; i < IX; i += step)
        n += ix_refused[i];
    return n;
}

static void index_opts(nl_coord_opts *o)
{
    o->min_nodes = 1 << 30; /* membership only */
    o->heartbeat_ms = IX_BEAT_MS;
    o->node_timeout_ms = IX_TIMEOUT_MS;
}

static void test_node_index(void)
{
    char dir[256];
    coord_fake_start("coord_index", dir, sizeof dir, index_opts);
    join_hb = IX_BEAT_MS;
    join_to = IX_TIMEOUT_MS;
    fake cl;
    fake_open(&cl, "ixclient", "");
    /* IX nodes join, each with its own id */
    uint32_t max_id = 0;
    for (int i = 0; i < IX; i++) {
        char key[16], ep[64];
        snprintf(key, sizeof key, "ix%04d", i);
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", 40000 + i);
        fake_open(&ix[i], key, ep);
    }
    const int accepted = ix_join(0, 1);
    for (int i = 0; i < IX; i++)
        max_id = ix[i].id > max_id ? ix[i].id : max_id;
    CHECK(accepted == IX && max_id == IX, "%d of %d joined, ids up to %u", accepted, IX, max_id);
    /* heartbeats under their own ids taken, under a neighbour's refused */
    for (int i = 0; i < IX; i++)
        ix_beat(&ix[i], ix[(i + 1) % IX].id);
    ix_pump(1.0);
    int once = 0;
    for (int i = 0; i < IX; i++)
        once += ix_refused[i] == 1;
    CHECK(once == IX, "%d of %d nodes had exactly their one wrong heartbeat refused", once, IX);
    CHECK(status_count(&cl, "\"state\":\"joined\"") == IX, "the status lists %d joined nodes",
          status_count(&cl, "\"state\":\"joined\""));
    /* a third stop: dead after the timeout, not before; the others live */
    memset(ix_refused, 0, sizeof ix_refused);
    for (int i = 0; i < IX; i += 3)
        ix[i].beating = 0;
    ix_pump(IX_TIMEOUT_MS * 1e-3 - 0.5);
    CHECK(status_count(&cl, "\"state\":\"dead\"") == 0, "%d nodes dead before the timeout",
          status_count(&cl, "\"state\":\"dead\""));
    ix_pump(1.0);
    CHECK(status_count(&cl, "\"state\":\"dead\"") == IX / 3, "%d of the %d silent nodes dead",
          status_count(&cl, "\"state\":\"dead\""), IX / 3);
    for (int i = 0; i < IX; i += 3)
        ix_beat(&ix[i], ix[i].id);
    ix_pump(0.3);
    CHECK(ix_refusals(0, 3) == IX / 3 && ix_refusals(1, 3) + ix_refusals(2, 3) == 0,
          "heartbeats refused: %d of the dead (%d sent), %d of the live", ix_refusals(0, 3), IX / 3,
          ix_refusals(1, 3) + ix_refusals(2, 3));
    /* the dead join again: new ids in the slots they left */
    memset(ix_refused, 0, sizeof ix_refused);
    int fresh = 0;
    ix_join(0, 3);
    for (int i = 0; i < IX; i += 3)
        fresh += ix[i].id > max_id;
    CHECK(fresh == IX / 3, "%d of %d joined again with new ids", fresh, IX / 3);
    ix_pump(0.6);
    CHECK(ix_refusals(0, 1) == 0, "%d heartbeats refused after the re-joins", ix_refusals(0, 1));
    CHECK(status_count(&cl, "\"id\":") == IX && status_count(&cl, "\"state\":\"dead\"") == 0,
          "after the re-joins the status lists %d nodes (%d dead), not %d",
          status_count(&cl, "\"id\":"), status_count(&cl, "\"state\":\"dead\""), IX);
    /* a live node restarts: a new connection, the same key */
    const uint32_t was = ix[1].id;
    nl_sock_destroy(&ix[1].sock);
    fake_open(&ix[1], "ix0001", "tcp://127.0.0.1:40001");
    ix_join(1, IX);
    ix_beat(&ix[1], was);
    ix_pump(0.5);
    CHECK(ix[1].id != was && ix_refused[1] == 1 && ix_refusals(0, 1) == 1,
          "restart: id %u (was %u), %d refusals of the old id, %d in all", ix[1].id, was,
          ix_refused[1], ix_refusals(0, 1));
    /* a gone node's routing id taken over by another key */
    fake a, b;
    open_rid(&a, "ixA", "tcp://127.0.0.1:49998", "ixRID");
    join(&a, 1.0);
    nl_sock_destroy(&a.sock);
    for (int i = 0; i < 60; i++)
        nl_coord_step(coord, 5);
    /* until the coordinator's ROUTER has dropped a's connection (on a
     * loaded machine, later than the turns above) it refuses b's, which
     * has the same routing id, and b's JOIN is lost with it: as a node
     * does when no ACCEPT comes, b connects and sends JOIN again, each
     * try on a new socket (no late ACCEPT of an earlier try read as this
     * one's) */
    const double t_b = now_s();
    open_rid(&b, "ixB", "tcp://127.0.0.1:49999", "ixRID");
    while (!join_for(&b, 1.0, 1.0) && now_s() - t_b < WAIT_S) {
        nl_sock_destroy(&b.sock);
        open_rid(&b, "ixB", "tcp://127.0.0.1:49999", "ixRID");
    }
    CHECK(a.id > 0 && b.id > 0 && b.id != a.id, "takeover: ids %u and %u", a.id, b.id);
    /* two live processes with one key: the second's JOIN takes it over (a
     * restart, as far as the coordinator can tell); the first, alive, JOINs
     * again from its own endpoint and is refused, naming the key's node,
     * where before each JOIN took the key from the other for ever */
    {
        fake d1, d2;
        nl_rx drx;
        fake_open(&d1, "ixDup", "tcp://127.0.0.1:49001");
        join(&d1, 1.0);
        fake_open(&d2, "ixDup", "tcp://127.0.0.1:49002");
        join(&d2, 1.0);
        CHECK(d1.id > 0 && d2.id > 0 && d2.id != d1.id, "one key twice: ids %u and %u", d1.id,
              d2.id);
        nl_rx_init(&drx);
        fake_send_join(&d1, 1.0);
        char want[64];
        snprintf(want, sizeof want, "in use by live node %u (data tcp://127.0.0.1:49002)", d2.id);
        CHECK(pump_until(&d1, NL_MSG_ERROR, &drx) && drx.msg.u.error.req_type == NL_MSG_JOIN &&
                  strstr(drx.msg.u.error.message, want) &&
                  strstr(drx.msg.u.error.message, "two nodes run with one key"),
              "the first of one key, back: refused naming node %u", d2.id);
        nl_rx_free(&drx);
        /* the second keeps the key: its heartbeats are taken */
        nl_rx_init(&drx);
        ix_beat(&d2, d2.id);
        CHECK(!pump_until_for(&d2, NL_MSG_ERROR, &drx, 0.5), "the key's node stays");
        nl_rx_free(&drx);
        nl_sock_destroy(&d1.sock);
        nl_sock_destroy(&d2.sock);
    }
    nl_rx rx;
    nl_rx_init(&rx);
    ix_beat(&b, b.id);
    ix_beat(&b, 0);
    CHECK(pump_until(&b, NL_MSG_ERROR, &rx) && rx.msg.u.error.req_type == NL_MSG_HEARTBEAT,
          "takeover: a heartbeat under no node's id is refused");
    nl_rx_free(&rx);
    nl_rx_init(&rx);
    nl_error e2 = {0};
    int more = 0;
    for (int i = 0; i < 20; i++) {
        nl_coord_step(coord, 5);
        if (nl_sock_recv(b.sock, &rx, 0, &e2) == NL_OK)
            more++;
        nl_rx_free(&rx);
        nl_rx_init(&rx);
    }
    CHECK(more == 0, "takeover: the new node's own heartbeat was refused");
    nl_rx_free(&rx);
    nl_sock_destroy(&b.sock);
    for (int i = 0; i < IX; i++)
        nl_sock_destroy(&ix[i].sock);
    nl_sock_destroy(&cl.sock);
    coord_fake_stop(dir);
    join_hb = HB_MS;
    join_to = TIMEOUT_MS;
}

int main(void)
{
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_WARN);
    nl_error err = {0};
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    test_node_index();
    nl_net_destroy(&net);
    coord_fake_add_counts(&check_pass_count, &check_fail_count);
    return check_done("test_coord_index");
}
