/* Internals of the coordinator shared by coord.c (membership, planning,
 * loading, the loop) and coord_jobs.c (jobs and status). */
#ifndef NL_COORD_IMPL_H
#define NL_COORD_IMPL_H

#include "core/planner.h"
#include "core/safetensors.h"
#include "net/transport.h"
#include "coord.h"

#define COORD_MAX_NODES 256
#define COORD_MAX_JOBS 64
#define COORD_MAX_TOKENS (1 << 20) /* tokens in one forward request */

typedef enum { NODE_FREE = 0, NODE_LIVE, NODE_DEAD, NODE_LEFT } node_life;

typedef struct cnode {
    int life;
    uint32_t id;
    char key[NL_KEY_Z85_LEN + 1];
    uint8_t rid[NL_ROUTING_ID_MAX];
    size_t rid_len;
    char device[33];
    char endpoint[257];
    uint64_t memory;
    double gflops;
    uint32_t threads;
    double joined, last_seen; /* monotonic seconds */
    int stage;                /* index into the plan, -1: standby */
    int loaded;               /* LOAD_DONE received for the current epoch */
    int unreachable;          /* a send failed: declared dead at the next tick */
    char why[600];
} cnode;

typedef enum { JOB_FREE = 0, JOB_OPENING, JOB_RUNNING } job_phase;

typedef struct cjob {
    int phase;
    uint64_t id;
    int kind; /* nl_job_kind */
    uint8_t rid[NL_ROUTING_ID_MAX];
    size_t rid_len;
    uint64_t epoch;
    double last_progress;
    /* generate */
    int32_t *prompt;
    int prompt_len, max_new, produced, limit, acks, capacity;
    double temperature, top_p;
    int64_t seed;
    int32_t fed; /* the id fed back to the first stage */
} cjob;

struct nl_coord {
    nl_coord_opts o;
    nl_net *net;
    nl_sock *ctl;
    nl_keypair keys;
    char endpoint[256];
    cnode nodes[COORD_MAX_NODES];
    uint32_t next_node_id;
    nl_config cfg, base;
    int have_cfg;
    nl_st_file *ckpt; /* mapped for the lifetime: layer chunks are sent from it */
    char *tok_text;   /* the checkpoint's tokenizer, or NULL */
    nl_plan *plan;
    int planned_once;
    uint64_t epoch;
    int ready;
    char state[512];
    double last_plan_try;
    cjob jobs[COORD_MAX_JOBS];
    uint64_t next_job;
};

double coord_now(void);
cnode *coord_stage_node(nl_coord *c, int stage);
void coord_set_state(nl_coord *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Send to a node; a node that cannot be reached is declared dead at the
 * next tick (its jobs fail, the cluster re-plans). */
nl_status coord_send_node(nl_coord *c, cnode *n, nl_wire_msg *m);
/* A node is gone: fail the jobs it carried and plan again. */
void coord_node_lost(nl_coord *c, cnode *n, int life, const char *why);

/* coord_jobs.c */
void coord_on_submit(nl_coord *c, const nl_rx *rx);
void coord_on_query(nl_coord *c, const nl_rx *rx);
void coord_on_cancel(nl_coord *c, const nl_rx *rx);
void coord_on_result(nl_coord *c, const nl_rx *rx);
void coord_on_token(nl_coord *c, const nl_rx *rx);
void coord_on_session_ack(nl_coord *c, const nl_rx *rx);
void coord_fail_jobs(nl_coord *c, const char *why);
void coord_fail_job(nl_coord *c, cjob *j, const char *why);
void coord_check_jobs(nl_coord *c, double now);

#endif
