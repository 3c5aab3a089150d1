/* Tests of the replicas' all-reduce over REDUCE messages (net/allreduce.h):
 * R reducers joined by in-memory links that keep each link's order (as a
 * ZeroMQ connection does), every message encoded and decoded by the wire
 * codec, the replicas beginning and the links delivering in an order drawn
 * from a seed. Every replica must end with the same bits as the in-process
 * communicator's host sum (kernels/comm.h) of the same buffers, whatever
 * the order of events; and bad messages are refused by name. */
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/comm.h"
#include "net/allreduce.h"
#include "net/wire.h"
#include "tests/check.h"

#define RMAX 6
#define QMAX 4096

/* An encoded message in flight: header and the frame's bytes. */
typedef struct packet {
    uint8_t *hdr, *frame;
    size_t hlen, flen;
} packet;

/* The link from replica r to r + 1 (mod R): a FIFO. */
typedef struct link {
    packet q[QMAX];
    int head, len;
} link;

typedef struct ring {
    int R;
    link links[RMAX];
    nl_allreduce *a[RMAX];
    int sender; /* the replica whose send callback runs */
} ring;

typedef struct send_ctx {
    ring *g;
    int r;
} send_ctx;

static nl_status ring_send(void *ctx, nl_wire_msg *m, nl_error *err)
{
    send_ctx *sc = ctx;
    link *l = &sc->g->links[sc->r];
    if (l->len == QMAX)
        return nl_error_set(err, NL_ERR_LIMIT, "test link full");
    nl_wire_wbuf wb = {0};
    nl_status st = nl_wire_encode(m, &wb, NULL, err);
    if (st != NL_OK)
        return st;
    packet *p = &l->q[(l->head + l->len++) % QMAX];
    p->hdr = wb.data;
    p->hlen = wb.len;
    p->flen = m->frames[0].len;
    p->frame = malloc(p->flen ? p->flen : 1);
    memcpy(p->frame, m->frames[0].t.data, p->flen); /* the reducer's bytes are valid only now */
    return NL_OK;
}

static void packet_free(packet *p)
{
    free(p->hdr);
    free(p->frame);
    *p = (packet){0};
}

/* The left fold ((b0 + b1) + b2) + ... through the host communicator over
 * R cpu backends: the in-process replicas' sum. */
static void comm_sum(float *out, float *const *in, int R, size_t n)
{
    nl_error err = {0};
    nl_backend *be[RMAX] = {NULL};
    float *d[RMAX];
    for (int r = 0; r < R; r++) {
        CHECK_OK(nl_backend_new(&be[r], "cpu", NULL, &err), &err);
        d[r] = be[r]->alloc(be[r], n * sizeof(float));
        be[r]->upload(be[r], d[r], in[r], n * sizeof(float));
    }
    nl_comm *c = NULL;
    CHECK_OK(nl_comm_new(&c, be, R, NL_COMM_HOST, &err), &err);
    CHECK_OK(nl_comm_allreduce_sum(c, d, n, &err), &err);
    be[R - 1]->download(be[R - 1], out, d[R - 1], n * sizeof(float));
    nl_comm_destroy(&c);
    for (int r = 0; r < R; r++) {
        be[r]->free(be[r], d[r]);
        nl_backend_destroy(&be[r]);
    }
}

/* Deliver the head of link l to replica (l + 1) mod R. */
static nl_status deliver(ring *g, int l, send_ctx *sc, bool *done, nl_error *err)
{
    link *k = &g->links[l];
    packet p = k->q[k->head];
    k->head = (k->head + 1) % QMAX;
    k->len--;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    const nl_wire_part parts[2] = {{p.hdr, p.hlen}, {p.frame, p.flen}};
    nl_status st = nl_wire_decode(&m, parts, 2, NULL, err);
    const int to = (l + 1) % g->R;
    if (st == NL_OK)
        st = nl_allreduce_input(g->a[to], &m, ring_send, &sc[to], done, err);
    nl_wire_msg_free(&m);
    packet_free(&p);
    return st;
}

/* One all-reduce of R buffers of n floats in chunks of `chunk`, events in
 * the order the seed draws, `steps` steps in a row. */
static void run_case(int R, size_t n, size_t chunk, unsigned seed, int steps)
{
    nl_error err = {0};
    ring *g = calloc(1, sizeof *g);
    send_ctx sc[RMAX];
    float *buf[RMAX], *want = malloc(n * sizeof(float));
    g->R = R;
    for (int r = 0; r < R; r++) {
        CHECK_OK(nl_allreduce_new(&g->a[r], 77, NL_REDUCE_GRADS, r, R, n, chunk, &err), &err);
        sc[r] = (send_ctx){g, r};
        buf[r] = malloc(n * sizeof(float));
    }
    srand(seed);
    for (int step = 1; step <= steps; step++) {
        for (int r = 0; r < R; r++) /* values whose sums round differently in other orders */
            for (size_t i = 0; i < n; i++)
                buf[r][i] = (float)((rand() % 20001) - 10000) * (r % 2 ? 1e-3f : 1.37e3f) +
                            (float)step * 1e-7f;
        comm_sum(want, buf, R, n);
        bool begun[RMAX] = {false}, done[RMAX] = {false};
        int n_done = 0, guard = 0;
        while (n_done < R && guard++ < 1000000) {
            int pick = rand() % (2 * R);
            bool d = false;
            int who = -1;
            if (pick < R && !begun[pick]) {
                begun[pick] = true;
                who = pick;
                CHECK_OK(nl_allreduce_begin(g->a[pick], (uint64_t)step, buf[pick], ring_send,
                                            &sc[pick], &d, &err),
                         &err);
            } else if (pick >= R && g->links[pick - R].len > 0) {
                who = (pick - R + 1) % R;
                CHECK_OK(deliver(g, pick - R, sc, &d, &err), &err);
            }
            if (d && who >= 0 && !done[who]) {
                done[who] = true;
                n_done++;
            }
        }
        CHECK(n_done == R, "R=%d n=%zu chunk=%zu seed=%u step %d: %d of %d replicas done", R, n,
              chunk, seed, step, n_done, R);
        for (int l = 0; l < R; l++)
            CHECK(g->links[l].len == 0, "link %d is empty after the reduce", l);
        for (int r = 0; r < R; r++) {
            CHECK(nl_allreduce_done(g->a[r], (uint64_t)step), "replica %d: done", r);
            CHECK(memcmp(buf[r], want, n * sizeof(float)) == 0,
                  "R=%d n=%zu chunk=%zu seed=%u step %d: replica %d has the host sum's bits", R, n,
                  chunk, seed, step, r);
        }
    }
    for (int r = 0; r < R; r++) {
        nl_allreduce_destroy(&g->a[r]);
        nl_allreduce_destroy(&g->a[r]); /* twice: safe */
        free(buf[r]);
    }
    free(want);
    free(g);
}

/* A REDUCE for replica `to` with the given header and len elements. */
static nl_status feed(nl_allreduce *a, nl_msg_reduce h, size_t len, bool *done, nl_error *err)
{
    static float zeros[64];
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_REDUCE);
    m.u.reduce = h;
    const int64_t shape[1] = {(int64_t)len};
    nl_wire_frame_set(&m.frames[0], zeros, NL_DTYPE_F32, shape, 1);
    m.nframes = 1;
    nl_status st = nl_allreduce_input(a, &m, NULL, NULL, done, err);
    nl_wire_msg_free(&m);
    return st;
}

/* Messages a replica must refuse, each naming what is wrong; a reducer
 * that refused one refuses everything until it is reset. */
static void test_refusals(void)
{
    nl_error err = {0};
    nl_allreduce *a = NULL;
    bool done = false;
    CHECK(nl_allreduce_new(&a, 5, NL_REDUCE_COUNTS, 2, 1, 10, 4, &err) == NL_ERR_INVALID,
          "replica 2 of 1");
    CHECK(nl_allreduce_new(&a, 5, NL_REDUCE_COUNTS, 0, NL_REDUCE_MAX_REPLICAS + 1, 10, 4, &err) ==
              NL_ERR_INVALID,
          "too many replicas");
    CHECK(nl_allreduce_new(&a, 5, NL_REDUCE_COUNTS, 0, 2, 0, 4, &err) == NL_ERR_INVALID,
          "no elements");
    /* replica 1 of 3 over 10 elements in chunks of 4: takes from 0 */
    CHECK_OK(nl_allreduce_new(&a, 5, NL_REDUCE_COUNTS, 1, 3, 10, 4, &err), &err);
    const struct {
        nl_msg_reduce h;
        size_t len;
        nl_status st;
        const char *says;
    } bad[] = {
        {{6, 1, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 0, 3, 0, 0}, 4, NL_ERR_PROTO, "job 6"},
        {{5, 1, NL_REDUCE_GRADS, NL_REDUCE_SUM, 0, 0, 3, 0, 0}, 4, NL_ERR_PROTO, "kind 0"},
        {{5, 1, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 2, 0, 3, 0, 0}, 4, NL_ERR_PROTO, "from 0 only"},
        {{5, 1, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 2, 3, 8, 0}, 4, NL_ERR_SHAPE, "chunk 2 of 3"},
        {{5, 1, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 1, 3, 0, 0}, 4, NL_ERR_SHAPE, "at 0"},
        {{5, 1, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 0, 4, 0, 0}, 4, NL_ERR_SHAPE, "of 4"},
        {{5, 1, NL_REDUCE_COUNTS, NL_REDUCE_RESULT, 0, 0, 3, 0, 0},
         4,
         NL_ERR_PROTO,
         "before this replica's sum"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        nl_allreduce_reset(a);
        nl_status st = feed(a, bad[i].h, bad[i].len, &done, &err);
        CHECK(st == bad[i].st && strstr(err.msg, bad[i].says), "refusal %zu: %s (%s)", i, err.msg,
              nl_status_str(st));
        CHECK(feed(a, (nl_msg_reduce){5, 1, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 0, 3, 0, 0}, 4,
                   &done, &err) == NL_ERR_STATE,
              "refusal %zu: then everything is refused", i);
    }
    /* a chunk twice; a chunk of another step while this one is staged */
    nl_allreduce_reset(a);
    CHECK_OK(feed(a, (nl_msg_reduce){5, 3, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 0, 3, 0, 0}, 4,
                  &done, &err),
             &err);
    CHECK(feed(a, (nl_msg_reduce){5, 3, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 0, 3, 0, 0}, 4, &done,
               &err) == NL_ERR_PROTO &&
              strstr(err.msg, "came twice"),
          "a duplicate: %s", err.msg);
    nl_allreduce_reset(a);
    CHECK_OK(feed(a, (nl_msg_reduce){5, 3, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 0, 3, 0, 0}, 4,
                  &done, &err),
             &err);
    CHECK(feed(a, (nl_msg_reduce){5, 4, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 1, 3, 4, 0}, 4, &done,
               &err) == NL_ERR_PROTO &&
              strstr(err.msg, "step 4"),
          "another step: %s", err.msg);
    nl_allreduce_reset(a);
    float buf[10] = {0};
    CHECK_OK(feed(a, (nl_msg_reduce){5, 3, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 0, 2, 3, 8, 0}, 2,
                  &done, &err),
             &err);
    CHECK(nl_allreduce_begin(a, 4, buf, NULL, NULL, &done, &err) == NL_ERR_PROTO &&
              strstr(err.msg, "step 3"),
          "begin of another step than the staged: %s", err.msg);
    nl_allreduce_destroy(&a);
    /* the last replica never takes a RESULT, the first never a SUM */
    CHECK_OK(nl_allreduce_new(&a, 5, NL_REDUCE_COUNTS, 0, 2, 10, 4, &err), &err);
    CHECK(feed(a, (nl_msg_reduce){5, 1, NL_REDUCE_COUNTS, NL_REDUCE_SUM, 1, 0, 3, 0, 0}, 4, &done,
               &err) == NL_ERR_PROTO &&
              strstr(err.msg, "never takes it"),
          "a SUM to replica 0: %s", err.msg);
    nl_allreduce_destroy(&a);
    nl_allreduce_destroy(&a);
    printf("refusals: ok\n");
}

/* An ASSIGN that makes a node one of a stage's replicas round-trips, and
 * one whose ring does not match its replica count is refused. */
static void test_assign(void)
{
    static const char *ka = "wRbKYzxIQTl+D?ZETf+ukt)!*]MF&1g3]Vtqp:Pb",
                      *kb = "4MlA35H1MocC(vJi?ueF}kxI:5T?tGOf*cSUM7a5";
    nl_msg_assign a = {.epoch = 3,
                       .node_id = 7,
                       .stage = 1,
                       .num_stages = 2,
                       .layer0 = 4,
                       .layer1 = 8,
                       .has_head = true,
                       .config_json = "{}",
                       .prev_endpoint = "tcp://10.0.0.1:7001",
                       .prev_key = ka,
                       .next_endpoint = "",
                       .next_key = "",
                       .replica = 1,
                       .replicas = 2,
                       .ring_endpoint = "tcp://10.0.0.4:7001",
                       .ring_key = kb,
                       .ring_prev_key = ka};
    nl_error err = {0};
    nl_wire_msg m, d;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    nl_wire_wbuf wb = {0};
    for (int k = 0; k < 4; k++) {
        nl_msg_assign b = a;
        if (k == 1)
            b.replicas = 1; /* a ring for one replica */
        if (k == 2)
            b.ring_prev_key = ""; /* a ring without the key it admits */
        if (k == 3)
            b.replica = 2; /* replica 2 of 2 */
        nl_wire_msg_reset(&m, NL_MSG_ASSIGN);
        m.u.assign = b;
        nl_status st = nl_wire_encode(&m, &wb, NULL, &err);
        if (k > 0) {
            CHECK(st == NL_ERR_RANGE && strstr(err.msg, "replica"), "bad ASSIGN %d: %s", k,
                  err.msg);
            continue;
        }
        CHECK_OK(st, &err);
        const nl_wire_part part = {wb.data, wb.len};
        CHECK_OK(nl_wire_decode(&d, &part, 1, NULL, &err), &err);
        CHECK(d.u.assign.replica == 1 && d.u.assign.replicas == 2 &&
                  strcmp(d.u.assign.ring_endpoint, a.ring_endpoint) == 0 &&
                  strcmp(d.u.assign.ring_key, kb) == 0 && strcmp(d.u.assign.ring_prev_key, ka) == 0,
              "a replica's ASSIGN round-trips");
    }
    nl_wire_wbuf_free(&wb);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    printf("ASSIGN of a replica: ok\n");
}

int main(void)
{
    test_refusals();
    test_assign();
    const size_t ns[] = {1, 7, 1000, 1031};
    const size_t chunks[] = {1, 64, 1000, 0};
    unsigned seed = 1;
    for (int R = 2; R <= RMAX; R++)
        for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
            for (size_t k = 0; k < sizeof chunks / sizeof chunks[0]; k++) {
                if (ns[i] / (chunks[k] ? chunks[k] : NL_ALLREDUCE_CHUNK) > QMAX / 2)
                    continue;
                run_case(R, ns[i], chunks[k], seed++, 3);
            }
    printf("all-reduce: every replica has the host communicator's bits\n");
    return check_done("test_allreduce");
}
