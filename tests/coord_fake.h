/* The fakes of the coordinator's in-process tests (coord_fake.c), shared
 * by the test_coord*.c programs. */
#ifndef NL_TEST_COORD_FAKE_H
#define NL_TEST_COORD_FAKE_H

#include <stdint.h>

#include "coordinator/coord.h"
#include "net/keys.h"
#include "net/transport.h"

#define WAIT_S 10.0 /* for a message that must arrive */
#define HB_MS 50
#define TIMEOUT_MS                                                                                 \
    1500 /* a loaded 2-core machine stalls the test process (fakes and coordinator alike) for more \
            than half a second */

typedef struct fake {
    nl_sock *sock;
    char key[41];      /* what its JOIN calls its key (plaintext: any text) */
    char endpoint[64]; /* its (pretended) data endpoint */
    uint32_t id;       /* from ACCEPT */
    int beating;       /* sends heartbeats while the test pumps */
    double last_beat;
    uint64_t seq;
    uint64_t reduce_bytes; /* the all-reduce counters its heartbeats carry */
    double reduce_s;
} fake;

/* The coordinator under test (the test makes it), the context of every
 * socket, and the three nodes the heartbeats go out for. */
extern nl_coord *coord;
extern nl_net *net;
extern fake nodes[3];
/* The heartbeat period and timeout an ACCEPT must carry. */
extern int join_hb, join_to;

double now_s(void);
/* f takes the plan: its ASSIGN, then the coordinator's LOAD_DONE, answered
 * with its own for the ASSIGN's epoch. Returns 0 on time out. */
int fake_take_plan(fake *f);
/* nodes[0 .. count) take the plan; then the coordinator is ready. */
int fakes_take_plan(int count);
/* A fake node (with a data endpoint), or a fake client (endpoint ""): on
 * the coordinator's nodes' or clients' socket. */
void fake_open(fake *f, const char *key, const char *endpoint);
/* Send m from f (and free it). */
void fake_send(fake *f, nl_wire_msg *m);
/* The beating nodes[] that are due send a HEARTBEAT. */
void heartbeats(void);
/* Turn the coordinator's loop (and the fake nodes' heartbeats) until f
 * receives a message of type want into rx; other messages to f are
 * skipped. Returns 0 on time out. */
int pump_until(fake *f, nl_msg_type want, nl_rx *rx);
/* The same within seconds, and quiet when none comes. */
int pump_until_for(fake *f, nl_msg_type want, nl_rx *rx, double seconds);
/* Turn the loop until the coordinator's state begins with prefix. */
int pump_state(const char *prefix);
/* A pump that must succeed: counted as a check. */
#define CHECK_PUMP(call) check_pump((call), #call)
int check_pump(int ok, const char *what);
/* f JOINs with gflops and checks its ACCEPT (id, join_hb, join_to); it
 * then beats while the test pumps. */
void join(fake *f, double gflops);
/* The same within seconds: 1 when ACCEPTed, 0 (quietly) when not. */
int join_for(fake *f, double gflops, double seconds);
/* f's JOIN, sent (the answer is the caller's to read). */
void fake_send_join(fake *f, double gflops);
/* f's query of the cluster's status (JOB_QUERY of job 0), sent, and the
 * JOB_STATUS answer into rx: 1, or 0 when none came. */
int fake_query_status(fake *f, nl_rx *rx);
/* The status JSON the coordinator answers f's query with (malloc'd), or
 * NULL. */
char *fake_status_text(fake *f);
/* What a test's coordinator has besides the fakes' defaults. */
typedef struct coord_fake_setup {
    const char *tag;                 /* its state dir: /tmp/nl_test_<tag>_XXXXXX */
    int layers;                      /* the fakes' model's layers (0: 6) */
    const char *authorized_keys;     /* the text of its authorized_keys, written before it is
                                        made: a CURVE coordinator (NULL: plaintext) */
    void (*tweak)(nl_coord_opts *o); /* the test's own options (NULL: none) */
} coord_fake_setup;

/* A CURVE coordinator's public key (coord_fake_start_with). */
extern char coord_key[NL_KEY_Z85_LEN + 1];

/* The coordinator under test, made in a new temporary state dir (its path
 * into dir) with the fakes' model (d 64, 4 experts), seed 7, the fakes'
 * heartbeat and timeout and 2 nodes to wait for; s->tweak sets the test's
 * own options before it is made. Exits when it cannot be made. */
void coord_fake_start_with(const coord_fake_setup *s, char *dir, size_t cap);
/* coord_fake_start_with: 6 layers, plaintext, tweak (may be NULL). */
void coord_fake_start(const char *tag, char *dir, size_t cap, void (*tweak)(nl_coord_opts *o));
/* Destroy the coordinator (if any) and remove its state dir. */
void coord_fake_stop(const char *dir);
/* The parameters of a small training job (batch 2 x 8, seed 1, no
 * warm-up, evaluation or checkpoint before the end) of `steps` steps in
 * `micro` microbatches on data and ckpt (borrowed) into ps (room for 14
 * at least); returns how many. */
uint32_t coord_fake_train_params(nl_wire_param *ps, const char *data, const char *ckpt,
                                 int64_t steps, int64_t micro);
/* Adds the fakes' checks to the test's counts (before check_done). */
void coord_fake_add_counts(int *pass, int *fail);

#endif
