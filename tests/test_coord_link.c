/* The coordinator's measured link speeds (issue 30; coordinator/coord_link.c),
 * in-process against fake nodes: --replicas auto over two nodes
 *  - plans 1 stage x 2 replicas at the assumed 1 GB/s before any
 *    measurement, and says "assumed" in the plan's why;
 *  - ignores a heartbeat whose all-reduce counters give no believable link
 *    speed (too fast), and a counter that went back (a node that started
 *    again) rebases without a measurement;
 *  - keeps the median of a node's recent measurements (one outlier does
 *    not move it);
 *  - asks for a re-plan when the measurements leave the plan's link by
 *    more than --replan-margin: at 0.5 GB/s the plan stays (the status's
 *    why re-judged at the measured link, the best marked "best"); at
 *    20 kB/s it plans again at rest: no replicas, its why naming the link
 *    speed measured.
 * The numbers are the heartbeats' counters as the test writes them: no
 * timing is measured. */
#include <math.h>
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

static void link_opts(nl_coord_opts *o)
{
    o->replicas = 0; /* --replicas auto */
    o->plan_microbatches = 8;
}

static void start_coord(void)
{
    coord_fake_start("coord_link", tmpdir, sizeof tmpdir, link_opts);
}

/* f's counters move by bytes and seconds; the loop turns until the
 * coordinator has read a heartbeat that carries them. */
static int beat(fake *f, uint64_t bytes, double s)
{
    f->reduce_bytes += bytes;
    f->reduce_s += s;
    const uint64_t want = f->seq + 1;
    const double t0 = now_s();
    while (now_s() - t0 < WAIT_S) {
        nl_coord_step(coord, 5);
        heartbeats();
        const cnode *n = coord_node_by_id(coord, f->id);
        if (n && n->hb.seq >= want && n->hb.reduce_bytes == f->reduce_bytes)
            return 1;
    }
    fprintf(stderr, "node %u: no heartbeat read within %.0f s\n", f->id, WAIT_S);
    return 0;
}

static int stage_replicas(void)
{
    return coord->plan ? coord->plan->stages[0].n_replicas : 0;
}

int main(void)
{
    nl_log_set_level(getenv("NL_TEST_VERBOSE") ? NL_LOG_DEBUG : NL_LOG_WARN);
    nl_error err = {0};
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    start_coord();
    fake_open(&nodes[0], "linka", "tcp://127.0.0.1:1");
    fake_open(&nodes[1], "linkb", "tcp://127.0.0.1:2");
    /* slow nodes: compute outweighs a 1 GB/s all-reduce of the small model */
    join(&nodes[0], 0.1);
    join(&nodes[1], 0.1);
    if (!CHECK_PUMP(fakes_take_plan(2)))
        goto done;

    /* no measurement: 1 x 2 at the assumed speed, said so */
    printf("before: %s\n", coord->plan_why);
    CHECK(coord->plan->n_stages == 1 && stage_replicas() == 2, "before: %d x %d",
          coord->plan->n_stages, stage_replicas());
    CHECK(strstr(coord->plan_why, "1 x 2 ") && strstr(coord->plan_why, "GB/s assumed) (chosen)") &&
              !coord->plan_link_measured && coord->plan_link_bytes_s == COORD_LINK_ASSUMED,
          "why: %s", coord->plan_why);
    const cnode *a = coord_node_by_id(coord, nodes[0].id),
                *b = coord_node_by_id(coord, nodes[1].id);
    CHECK(a && b, "the nodes are known");
    if (!a || !b)
        goto done;

    /* an all-reduce of 1 PB in a millisecond is no link speed: ignored */
    CHECK_PUMP(beat(&nodes[0], 1000000000000000ull, 1e-3));
    CHECK(a->link_n == 0 && coord_link_bytes_s(a) == 0.0, "a garbage speed: %d kept", a->link_n);
    /* counters that went back: a node that started again, no measurement */
    nodes[0].reduce_bytes = 0;
    nodes[0].reduce_s = 0;
    CHECK_PUMP(beat(&nodes[0], 1000, 1.0));
    CHECK(a->link_n == 0, "a counter that went back: %d kept", a->link_n);

    /* 0.5 GB/s: past the margin, so judged again at rest; 1 x 2 is still
     * the best: the plan stays, and the why says so at the measured link */
    for (int i = 0; i < 2; i++)
        CHECK_PUMP(beat(&nodes[i], 500000000ull, 1.0));
    const double t0 = now_s();
    while (!strstr(coord->plan_why, "re-judged") && now_s() - t0 < WAIT_S) {
        nl_coord_step(coord, 5);
        heartbeats();
    }
    printf("stays: %s\n", coord->plan_why);
    CHECK(stage_replicas() == 2 && strstr(coord->plan_why, "(link 0.5 GB/s measured) (best)") &&
              strstr(coord->plan_why, "the plan stays 1 x 2") && !strstr(coord->plan_why, "chosen"),
          "why: %s", coord->plan_why);
    CHECK(coord->plan_link_bytes_s == 0.5e9 && coord->plan_link_measured, "judged at %g",
          coord->plan_link_bytes_s);

    /* five steps at 20 kB/s and one at 1 GB/s on each node: the median */
    for (int k = 0; k < 6; k++)
        for (int i = 0; i < 2; i++)
            CHECK_PUMP(k == 3 ? beat(&nodes[i], 1000000000ull, 1.0) : beat(&nodes[i], 20000, 1.0));
    CHECK(a->link_n == 7 && b->link_n == 7, "measurements %d %d", a->link_n, b->link_n);
    CHECK(fabs(coord_link_bytes_s(a) / 20e3 - 1) < 1e-6 &&
              fabs(coord_link_bytes_s(b) / 20e3 - 1) < 1e-6,
          "the medians %g %g B/s", coord_link_bytes_s(a), coord_link_bytes_s(b));

    /* the plan's link moved past the margin: at rest it plans again, now
     * at the measured speed, without replicas */
    if (!CHECK_PUMP(fakes_take_plan(2)))
        goto done;
    printf("after: %s\n", coord->plan_why);
    CHECK(coord->plan->n_stages == 2 && stage_replicas() == 1, "after: %d x %d",
          coord->plan->n_stages, stage_replicas());
    CHECK(strstr(coord->plan_why, "1 x 2 ") &&
              strstr(coord->plan_why, "(link 2e-05 GB/s measured)") &&
              strstr(coord->plan_why, "2 x 1 ") && strstr(coord->plan_why, "(chosen)"),
          "why: %s", coord->plan_why);
    CHECK(coord->plan_link_bytes_s == COORD_LINK_ASSUMED, "no replicas: %g",
          coord->plan_link_bytes_s);
done:
    nl_sock_destroy(&nodes[0].sock);
    nl_sock_destroy(&nodes[1].sock);
    coord_fake_stop(tmpdir);
    nl_net_destroy(&net);
    coord_fake_add_counts(&check_pass_count, &check_fail_count);
    return check_done("test_coord_link");
}
