/* Internals of the coordinator shared by coord.c (membership, planning,
 * loading, the loop) and coord_jobs.c (jobs and status). */
#ifndef NL_COORD_IMPL_H
#define NL_COORD_IMPL_H

#include "coord.h"
#include "core/data.h"
#include "core/manifest.h"
#include "core/planner.h"
#include "core/safetensors.h"
#include "net/transport.h"

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

/* JOB_WAITING: a generation that lost a stage, waiting for the new plan */
typedef enum { JOB_FREE = 0, JOB_OPENING, JOB_RUNNING, JOB_WAITING } job_phase;

struct ctrain; /* a training job's state (coord_train.c) */

/* The mapped files of the weights' source. LAYER_LOAD chunks point into
 * them without a copy, so a replaced source is retired, and unmapped only
 * when libzmq has let go of every chunk (ref idle). */
typedef struct csource {
    nl_st_file **files;
    int n;
    nl_txref ref;
    struct csource *next; /* in the retired list */
} csource;

typedef struct cjob {
    int phase;
    uint64_t id;
    int kind; /* nl_job_kind */
    uint8_t rid[NL_ROUTING_ID_MAX];
    size_t rid_len;
    uint64_t epoch;
    double last_progress;
    /* generate: ids holds the prompt, then the tokens produced (capacity) */
    int32_t *ids;
    int prompt_len, max_new, produced, limit, acks, capacity;
    /* a resumed generation: the coordinator feeds each token (the first
     * `produced` from ids, replaying), `seen` of this session's so far */
    int resumes, coord_feeds, seen;
    double temperature, top_p;
    int64_t seed;
    /* train */
    struct ctrain *train;
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
    /* where the weights come from: a checkpoint, a manifest's shards, or
     * (none) the seed; the files stay mapped, layer chunks are sent from them */
    char src_path[4096];
    struct csource *src, *retired;
    int src_manifest; /* the source is a manifest: its shards carry the moments */
    int64_t src_step, src_adam;
    int resumable;   /* the stages hold a manifest's weights and moments, untouched */
    char *tok_text;  /* the model's tokenizer, or NULL */
    char *init_seed; /* the seed the weights were first drawn from (text), or NULL */
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
/* The live node a message came from (by its routing id), or NULL. */
cnode *coord_node_by_rid(nl_coord *c, const nl_rx *rx);
/* Drop the plan: the next tick plans and loads again from the source. */
void coord_reload(nl_coord *c);
void coord_set_state(nl_coord *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Send to a node; a node that cannot be reached is declared dead at the
 * next tick (its jobs fail, the cluster re-plans). */
nl_status coord_send_node(nl_coord *c, cnode *n, nl_wire_msg *m);
/* A node is gone: fail the jobs it carried and plan again. */
void coord_node_lost(nl_coord *c, cnode *n, int life, const char *why);

/* Replace the source by a verified manifest (the shards' hashes are
 * checked; a bad shard is refused by name) and, when reload is set, plan
 * and load again from it. */
nl_status coord_use_manifest(nl_coord *c, const char *path, int reload, nl_error *err);

/* coord_jobs.c */
cjob *coord_job_new(nl_coord *c, const nl_rx *rx, int kind);
void coord_job_free(cjob *j);
cjob *coord_job_find(nl_coord *c, uint64_t id);
/* A job parameter by key, or NULL. */
const nl_wire_param *coord_param(const nl_msg_job_submit *s, const char *key);
/* JOB_STATUS to a client, with an optional JSON report (a U8 frame). */
void coord_status_to(nl_coord *c, const uint8_t *rid, size_t rid_len, uint64_t job, int state,
                     double progress, const char *msg, const char *json);
void coord_on_submit(nl_coord *c, const nl_rx *rx);
void coord_on_query(nl_coord *c, const nl_rx *rx);
void coord_on_cancel(nl_coord *c, const nl_rx *rx);
void coord_on_result(nl_coord *c, const nl_rx *rx);
void coord_on_token(nl_coord *c, const nl_rx *rx);
void coord_on_node_status(nl_coord *c, const nl_rx *rx);
void coord_fail_jobs(nl_coord *c, const char *why);
/* A stage is lost: generations wait for the next plan (up to
 * gen_resumes times each), every other job fails. */
void coord_jobs_stage_lost(nl_coord *c, const char *why);
/* The plan is ready: reopen the waiting generations. */
void coord_resume_jobs(nl_coord *c);
/* No plan can be made: the waiting generations fail. */
void coord_fail_waiting(nl_coord *c, const char *why);
void coord_fail_job(nl_coord *c, cjob *j, const char *why);
void coord_check_jobs(nl_coord *c, double now);

/* coord_train.c */
void coord_train_submit(nl_coord *c, const nl_rx *rx);
void coord_train_on_ack(nl_coord *c, cjob *j, const nl_rx *rx);
void coord_train_on_grad_norm(nl_coord *c, const nl_rx *rx);
void coord_train_on_loss(nl_coord *c, const nl_rx *rx);
void coord_train_on_ckpt_done(nl_coord *c, const nl_rx *rx);
/* Once a second or so: a job waiting for the cluster to load starts. */
void coord_train_tick(nl_coord *c, cjob *j);
/* The failure text's tail: the last checkpoint, or that there is none. */
void coord_train_fail_note(const cjob *j, char *buf, size_t cap);
void coord_train_free(cjob *j);
/* A failed or cancelled training job that changed the stages' weights:
 * they reload from the source (the last manifest, or the checkpoint). */
void coord_train_abandon(nl_coord *c, cjob *j);
/* A stage loaded: a training job waiting for the cluster is making progress. */
void coord_train_touch(nl_coord *c);

#endif
