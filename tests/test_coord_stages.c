/* The coordinator with a replica count per stage (--replicas 2,1; DESIGN
 * section 8), in-process against three fake nodes:
 *  - the plan has stage 0 on two nodes and stage 1 on one; each ASSIGN
 *    names a neighbour stage with another count whole: stage 0's replicas
 *    the one node of stage 1 as next and previous (the token ring), the
 *    node of stage 1 both replicas of stage 0 as previous and next, keys
 *    and endpoints in replica order, links 0; status lists the counts;
 *  - with a node that accepts no inbound connections the plan is refused
 *    (neighbours with different counts link the default way only), and
 *    the coordinator says why. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord.h"
#include "coordinator/coord_impl.h"
#include "tests/check.h"
#include "tests/coord_fake.h"

static char tmpdir[256];

static void stages_opts(nl_coord_opts *o)
{
    o->min_nodes = 3;
    o->replicas = -1; /* --replicas 2,1 */
    o->stage_replicas[0] = 2;
    o->stage_replicas[1] = 1;
    o->n_stage_replicas = 2;
}

static void start_coord(void)
{
    coord_fake_start("coord_stages", tmpdir, sizeof tmpdir, stages_opts);
}

static void stop_coord(void)
{
    for (int i = 0; i < 3; i++)
        nl_sock_destroy(&nodes[i].sock);
    coord_fake_stop(tmpdir);
}

/* f JOINs with the given JOIN.flags (join() of coord_fake.c sends none). */
static void join_flags(fake *f, uint32_t flags)
{
    nl_wire_msg m;
    nl_rx rx;
    nl_rx_init(&rx);
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOIN);
    m.u.join = (nl_msg_join){f->key, "cpu", 1ull << 30, 1.0, 1, f->endpoint, flags};
    fake_send(f, &m);
    if (CHECK_PUMP(pump_until(f, NL_MSG_ACCEPT, &rx))) {
        f->id = rx.msg.u.accept.node_id;
        f->beating = 1;
    }
    nl_rx_free(&rx);
}

/* What one fake's ASSIGN said. */
typedef struct got {
    int ok;
    uint32_t stage, replica, replicas, links;
    char prev_key[64], next_key[64], prev_keys[256], next_keys[256], next_eps[256];
} got;

static void take_assign(fake *f, got *g)
{
    nl_rx rx;
    nl_rx_init(&rx);
    memset(g, 0, sizeof *g);
    if (CHECK_PUMP(pump_until(f, NL_MSG_ASSIGN, &rx))) {
        const nl_msg_assign *a = &rx.msg.u.assign;
        g->ok = 1;
        g->stage = a->stage;
        g->replica = a->replica;
        g->replicas = a->replicas;
        g->links = a->links;
        snprintf(g->prev_key, sizeof g->prev_key, "%s", a->prev_key);
        snprintf(g->next_key, sizeof g->next_key, "%s", a->next_key);
        snprintf(g->prev_keys, sizeof g->prev_keys, "%s", a->prev_keys ? a->prev_keys : "");
        snprintf(g->next_keys, sizeof g->next_keys, "%s", a->next_keys ? a->next_keys : "");
        snprintf(g->next_eps, sizeof g->next_eps, "%s", a->next_endpoints ? a->next_endpoints : "");
    }
    nl_rx_free(&rx);
}

static void test_assign(void)
{
    start_coord();
    fake_open(&nodes[0], "sa", "tcp://127.0.0.1:1");
    fake_open(&nodes[1], "sb", "tcp://127.0.0.1:2");
    fake_open(&nodes[2], "sc", "tcp://127.0.0.1:3");
    for (int i = 0; i < 3; i++)
        join_flags(&nodes[i], 0);
    got g[3];
    for (int i = 0; i < 3; i++)
        take_assign(&nodes[i], &g[i]);
    CHECK(coord->plan && coord->plan->n_stages == 2 && coord->plan->stages[0].n_replicas == 2 &&
              coord->plan->stages[1].n_replicas == 1,
          "the plan 2,1");
    /* the fakes by their place: stage 0 replicas 0 and 1, stage 1 */
    int r0 = -1, r1 = -1, last = -1;
    for (int i = 0; i < 3; i++) {
        if (!g[i].ok)
            continue;
        if (g[i].stage == 1)
            last = i;
        else if (g[i].replica == 0)
            r0 = i;
        else
            r1 = i;
    }
    if (r0 < 0 || r1 < 0 || last < 0) {
        CHECK(0, "places: %d %d %d", r0, r1, last);
        stop_coord();
        return;
    }
    char both_keys[128], both_eps[128];
    snprintf(both_keys, sizeof both_keys, "%s,%s", nodes[r0].key, nodes[r1].key);
    snprintf(both_eps, sizeof both_eps, "%s,%s", nodes[r0].endpoint, nodes[r1].endpoint);
    for (int k = 0; k < 2; k++) {
        const got *x = &g[k ? r1 : r0];
        CHECK(x->replicas == 2 && x->replica == (uint32_t)k && x->links == 0, "stage 0 replica %d",
              k);
        CHECK(strcmp(x->next_keys, nodes[last].key) == 0 &&
                  strcmp(x->next_eps, nodes[last].endpoint) == 0 &&
                  strcmp(x->prev_keys, nodes[last].key) == 0 &&
                  strcmp(x->next_key, nodes[last].key) == 0,
              "stage 0 replica %d: next %s at %s, prev %s", k, x->next_keys, x->next_eps,
              x->prev_keys);
    }
    const got *y = &g[last];
    CHECK(y->replicas <= 1 && y->links == 0 && strcmp(y->prev_keys, both_keys) == 0 &&
              strcmp(y->next_keys, both_keys) == 0 && strcmp(y->next_eps, both_eps) == 0 &&
              strcmp(y->prev_key, nodes[r0].key) == 0,
          "stage 1: prev %s, next %s at %s", y->prev_keys, y->next_keys, y->next_eps);
    stop_coord();
    printf("ASSIGNs of a plan 2,1: ok\n");
}

static void test_nat_refused(void)
{
    start_coord();
    fake_open(&nodes[0], "na", "tcp://127.0.0.1:1");
    fake_open(&nodes[1], "nb", "tcp://127.0.0.1:2");
    fake_open(&nodes[2], "nc", "tcp://127.0.0.1:3");
    join_flags(&nodes[0], 0);
    join_flags(&nodes[1], 0);
    join_flags(&nodes[2], NL_JOIN_NO_INBOUND);
    CHECK(CHECK_PUMP(pump_state("not enough capacity")) &&
              strstr(coord->state, "accepts no inbound connections") &&
              strstr(coord->state, "2 and 1 replicas"),
          "refused: %s", coord->state);
    CHECK(!coord->plan, "no plan");
    stop_coord();
    printf("a plan 2,1 with a node behind NAT: refused\n");
}

int main(void)
{
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_ERROR);
    nl_error err = {0};
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    test_assign();
    test_nat_refused();
    nl_net_destroy(&net);
    coord_fake_add_counts(&check_pass_count, &check_fail_count);
    return check_done("test_coord_stages");
}
