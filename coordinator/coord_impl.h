/* Internals of the coordinator, shared by its files: coord.c (setup and
 * the loop), coord_members.c (membership), coord_plan.c (planning and
 * loading), coord_jobs.c (the jobs' table and dispatch, cancel and the
 * status report), one file per job kind behind its operations table
 * (coord_forward.c, coord_generate.c, coord_embed.c, coord_grow.c,
 * coord_train.c and coord_finetune.c, whose own state is in
 * coord_train_impl.h), coord_base.c and coord_nodes.c (the helpers they
 * all use: the node table, sends, the weights' source), coord_work.c (the
 * workers) and coord_journal.c (the training job's journal). */
#ifndef NL_COORD_IMPL_H
#define NL_COORD_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "base/clock.h"
#include "coordinator/coord.h"
#include "core/formats/manifest.h"
#include "core/formats/safetensors.h"
#include "core/plan/planner.h"
#include "net/transport.h"

/* The node table grows (doubling) to at most this many slots; the lowest
 * slot of a dead or departed node is reused. A live node is found by its
 * routing id, node id or key through hash tables, and expiry looks at the
 * oldest heartbeat only (coord_nodes.c): a message costs
 * O(1) in the number of nodes. */
#define COORD_MAX_NODES 65536
#define COORD_MAX_JOBS 64
#define COORD_MAX_TOKENS (1 << 20) /* tokens in one forward request */

typedef enum { NODE_FREE = 0, NODE_LIVE, NODE_DEAD, NODE_LEFT } node_life;

struct csource;

/* Where a stage's streaming of its tensors is (coord_plan.c, coord_stream_loads). */
typedef struct cload {
    int active;
    uint64_t epoch;            /* the plan it loads */
    const struct csource *src; /* the source it reads */
    int file;                  /* the source file, */
    size_t entry;              /* the tensor in it, */
    uint32_t chunk;            /* the next chunk of it */
    uint32_t tensors;          /* sent whole */
    uint64_t bytes;
    double t0;
} cload;

/* Recent link measurements kept per node (coord_link.c). */
#define COORD_LINK_WINDOW 8
/* The link speed a node never measured is assumed to have, bytes/s. */
#define COORD_LINK_ASSUMED 1e9

typedef struct cnode {
    int life;
    uint32_t id;
    char key[NL_KEY_Z85_LEN + 1];
    uint8_t rid[NL_ROUTING_ID_MAX];
    size_t rid_len;
    char device[33];
    char endpoint[257];
    /* the data endpoint of the live node with this key that this one's
     * JOIN took over ("restarted"), when it differed: that one coming back
     * means two live processes share the key (coord_on_join) */
    char took_from[257];
    bool no_inbound;    /* JOIN.flags NO_INBOUND, or --probe-inbound found its data endpoint
                         * closed: it dials its previous stage (ASSIGN.links) */
    int probe_fd;       /* --probe-inbound: the connection to its data endpoint (0: none) */
    double probe_until; /* ... given up then (monotonic seconds) */
    uint64_t memory;
    double gflops;       /* its probe's (JOIN) */
    double seen_gflops;  /* as observed in a training job's stage times (0: not yet) */
    double plan_gflops;  /* the figure the current plan was made with */
    double pend_gflops;  /* a judgement's figure off by the margin, for the next to confirm */
    uint64_t pend_epoch; /* ... on that plan (0: none) */
    double load_sum;     /* heartbeats' busy fractions while it trains a stage ... */
    int load_n;          /* ... and how many, since the last checkpoint */
    uint32_t threads;
    double joined, last_seen; /* monotonic seconds */
    int stage;                /* index into the plan, -1: standby */
    int replica;              /* which of the stage's replicas (0: the one that writes its shard) */
    int loaded;               /* LOAD_DONE received for the current epoch */
    int unreachable;          /* a send failed: declared dead at the next tick */
    int32_t older, newer;     /* live: its neighbours in the list by last_seen (slots, -1) */
    cload ld;                 /* streaming its stage's tensors */
    nl_msg_heartbeat hb;      /* its last heartbeat: sessions, KV bytes, batch figures */
    uint64_t link_bytes0;     /* its heartbeat's all-reduce counters last seen (coord_link.c) */
    double link_s0;
    double link_win[COORD_LINK_WINDOW]; /* its last link speeds measured, bytes/s */
    int link_n, link_i;                 /* how many (at most the window), the next slot */
    /* as a verifier (coord_train_verify.c): cases answered, answers that
     * disagreed with the stage's report, seconds from a case's send to its
     * answer (summed), bytes of cases sent to it */
    uint64_t ver_cases, ver_mismatches, ver_bytes;
    double ver_s;
    char why[600];
} cnode;

/* The mapped files of the weights' source. LAYER_LOAD chunks point into
 * them without a copy, so a replaced source is retired, and unmapped only
 * when libzmq has let go of every chunk (ref idle). */
typedef struct cown {
    int l0, l1, embed, head;
} cown;
typedef struct csource {
    nl_st_file **files;
    int n;
    /* a manifest's: what the plan takes from each file (a growth may leave
     * a tensor in a reused shard that a new one now holds: the plan's
     * owner is served, as nl_manifest_load_stage reads it); NULL: all */
    cown *own;
    nl_txref ref;
    struct csource *next; /* in the retired list */
} csource;

/* ---------------------------------------------------------------- jobs
 *
 * A job is one cjob of some kind; what a kind does lives behind its
 * operations table (coord_forward.c, coord_generate.c, coord_train.c,
 * coord_finetune.c, coord_embed.c), and
 * its own state behind cjob.state. Calls go one way: the loop's dispatch
 * (coord.c) -> the jobs' dispatch (coord_jobs.c) -> a kind's operations ->
 * the helpers of coord_base.c, which call no job code but through the
 * table. */

/* JOB_WAITING: the job waits for a ready plan (a generation that lost a
 * stage, a training job whose cluster loads); its `ready` runs then. */
typedef enum { JOB_FREE = 0, JOB_RUNNING, JOB_WAITING } job_phase;

typedef struct cjob cjob;

/* A bit of cjob_ops.takes: the message type t (below NL_MSG_TYPE_MAX, 64). */
#define COORD_TAKES(t) (UINT64_C(1) << (t))

typedef struct cjob_ops {
    int kind; /* nl_job_kind */
    const char *name;
    /* The message types a job of this kind takes from its stages
     * (COORD_TAKES bits); any other naming the job is refused (an ERROR to
     * the node, e.g. a TOKEN naming a forward or training job). */
    uint64_t takes;
    /* A client's JOB_SUBMIT of this kind: check it, make the job
     * (coord_job_new) and start it, or answer the client's failure. */
    void (*submit)(nl_coord *c, const nl_rx *rx);
    /* A node's message about the job: its JOB_STATUS (not a failure),
     * TOKEN, RESULT, GRAD_NORM, LOSS or CKPT_DONE. */
    void (*on_message)(nl_coord *c, cjob *j, const nl_rx *rx);
    /* A stage of the plan is lost: 1 if the job waits for the next plan,
     * 2 if it also needs the plan's other nodes a while first (it calls
     * coord_release_plan when done), 0 (or NULL) if it fails. */
    int (*stage_lost)(nl_coord *c, cjob *j, const char *why);
    /* A node that held no stage (a standby) is gone: a job that waits for
     * its work (a training job's verifications) stops waiting. NULL:
     * nothing. */
    void (*node_gone)(nl_coord *c, cjob *j);
    /* Stage node n reports that its work for the job failed (why names
     * the node; req: the message it could not run, 0 where unknown): 1
     * if the job goes on regardless (a training job waits for the node's
     * death to be told from a live node's), 0 (or NULL): it fails. */
    int (*node_failed)(nl_coord *c, cjob *j, const cnode *n, uint32_t req, const char *why);
    /* The plan is ready: a waiting job goes on. */
    void (*ready)(nl_coord *c, cjob *j);
    /* The job ends before it is done (failed, cancelled): tell the stages
     * and undo what it changed. NULL: nothing to undo. */
    void (*abort)(nl_coord *c, cjob *j);
    /* A JOB_CANCEL from rx (the job's client or an admin): 1 if the job
     * winds down by itself (it answered rx and ends later, cancelled), 0
     * (or NULL): it ends now (abort, then freed). */
    int (*cancel)(nl_coord *c, cjob *j, const nl_rx *rx);
    /* The tail of its failure message, or NULL. */
    void (*fail_note)(const cjob *j, char *buf, size_t cap);
    /* Free the kind's state (NULL-safe on a job that has none). */
    void (*free)(cjob *j);
} cjob_ops;

struct cjob {
    int phase;
    uint64_t id;
    const cjob_ops *ops;
    uint8_t rid[NL_ROUTING_ID_MAX]; /* the connection that follows it (its reports go there) */
    size_t rid_len;
    /* the key that submitted it (Z85; "plain:<addr>" in plaintext; "" for a
     * job recovered from a journal that named none): only that key, or an
     * admin, may query, follow or cancel it (coord_job_mine) */
    char owner[NL_PEER_ID_MAX];
    uint64_t epoch; /* the plan it runs on */
    double last_progress;
    int working;  /* tasks of its own in a worker (coord_work.c): it cannot time out */
    int checking; /* its adapter's base is being compared (coord_adapter.c): it waits */
    const char *check_adapter; /* that adapter's path (in the kind's state) */
    void *state;               /* the kind's, owned by the job */
};

/* Node n was convicted of computing wrong (coord_quarantine): every
 * generation it served is re-run without it (coord_generate.c): a running
 * one replays its tokens on the next plan and withdraws those from the
 * first one the honest stages do not give again; a finished one of the
 * last GEN_DONE_KEPT, within GEN_DONE_WINDOW_S, is named in a warning and
 * a `generation_suspect` event. */
void coord_generate_convicted(nl_coord *c, const cnode *n, const char *why);
/* Free the record of finished generations. */
void coord_generate_done_free(nl_coord *c);
extern const cjob_ops coord_forward_ops, coord_generate_ops, coord_train_ops, coord_finetune_ops,
    coord_embed_ops, coord_grow_ops;
/* A forward job with params.adapter (coord_embed.c): the stages take the
 * adapter before the ids; its ops are coord_forward_adapted_ops. */
extern const cjob_ops coord_forward_adapted_ops;
void coord_forward_adapted_submit(nl_coord *c, const nl_rx *rx);

/* A task for a worker (coord_work.c); a task's struct begins with it. */
typedef struct cwork cwork;
struct cwork {
    /* in the worker thread: touches only the task */
    void (*run)(cwork *w);
    /* on the loop, once run has returned; the job may be gone */
    void (*done)(nl_coord *c, cwork *w);
    /* frees the task (after done, or unfinished at shutdown) */
    void (*free)(cwork *w);
    uint64_t job_id; /* the job it works for, or 0 */
    /* the worker's */
    void *zmq;
    const char *endpoint;
    pthread_t thread;
    atomic_int finished;
    cwork *next;
};

/* One growth of the model (coord_grow.c), as status and events show it. */
enum { COORD_GROW_VOCAB = 1, COORD_GROW_DEPTH, COORD_GROW_WIDTH };
typedef struct coord_growth {
    int kind; /* COORD_GROW_* */
    int64_t step;
    nl_config before, after;
    double seconds;
} coord_growth;

struct nl_coord {
    nl_coord_opts o;
    nl_net *net;
    nl_sock *ctl;  /* the nodes' socket (--listen; bulk: RESULTs carry logits) */
    nl_sock *cli;  /* the clients' socket (--client-listen; control-sized) */
    nl_sock *from; /* the socket of the message being handled (NULL: by its type) */
    nl_keypair keys;
    uint8_t verify_key[32]; /* draws what --verify-rate checks: made at the start, never sent */
    uint32_t quarantine;    /* a node convicted of computing wrong: dropped at the next tick */
    char quarantine_why[400];
    struct cgen_done *gen_done; /* generations finished lately, by the nodes that served them
                                   (coord_generate.c; a conviction names them) */
    struct cban *bans;          /* the keys authorized_keys has banned (coord_bans_read) */
    int n_bans;
    char endpoint[256], client_endpoint[256];
    nl_coord_observer observe; /* nl_coord_observe, or NULL */
    void *observe_ctx;
    cnode *nodes;         /* n_nodes slots (NODE_FREE: never used) */
    int probes;           /* --probe-inbound: data endpoints being probed (coord_probe.c) */
    struct crelay *relay; /* between neighbours that both accept no inbound (coord_relay.c) */
    int n_nodes;
    int n_live;
    /* the live nodes' indexes (coord_nodes.c): by routing id, node id and
     * key, open addressing over 2 n_nodes cells holding slots (-1: empty) */
    int32_t *by_rid, *by_id, *by_key;
    uint64_t hash_seed;
    /* the live nodes from the oldest heartbeat to the newest (slots; an
     * unreachable one is put first), and the slots not live, a min-heap */
    int32_t oldest, newest;
    int32_t *free_slots;
    int n_free;
    uint32_t next_node_id;
    nl_config cfg, base;
    int have_cfg;
    /* where the weights come from: a checkpoint, a manifest's shards, or
     * (none) the seed; the files stay mapped, layer chunks are sent from them */
    char src_path[4096];
    struct csource *src, *retired;
    int src_manifest; /* the source is a manifest: its shards carry the moments */
    /* the model file's SHA-256 (nl_coord_model_file), once an adapter a
     * job named was checked against it (coord_adapter.c), and the file's
     * size and modification time then; "": not hashed yet */
    char model_hex[65];
    int64_t model_hex_size, model_hex_mtime_ns;
    int model_hashing; /* a check that may hash the file runs: others wait for its hash */
    int64_t src_step, src_adam;
    int resumable;   /* the stages hold a manifest's weights and moments, untouched */
    char *tok_text;  /* the model's tokenizer, or NULL */
    char *init_seed; /* the seed the weights were first drawn from (text), or NULL */
    char *chat_text; /* the model's chat template (JSON, core/tokenizer/chat_template.h), or NULL */
    struct nl_growth *growth; /* the model's growth history (core/grow/grow.h): the source's, */
    int n_growth;             /* then the growths since; manifests written carry it */
    nl_plan *plan;
    int plan_training;        /* the plan was made during a training job, for its microbatches */
    char plan_why[1024];      /* why the plan's stages have the replicas they have (status) */
    double plan_link_bytes_s; /* the link speed the plan's all-reduce was costed at, */
    int plan_link_measured;   /* ... and whether measured (coord_link.c) */
    int planned_once;
    /* a new training job continues the source's steps, schedule and moments
     * (the operator's neurocoord --resume, or a growth, made it the source
     * and no job has taken it since); otherwise a job without --resume
     * starts at step 0 from the weights the stages hold */
    int src_continues;
    /* the job that wrote the source's manifest, and the job and step of
     * the weights the stages hold (job 0: none of this coordinator's) */
    uint64_t src_job, weights_job;
    int64_t weights_step;
    int replan_wanted;   /* why a re-plan may pay since the plan was made: COORD_REPLAN_* bits */
    int replan_why;      /* replan_wanted's bits as the last coord_replan_gain saw them */
    int stages_modified; /* a training job changed the stages' weights since the source */
    uint64_t epoch;
    int ready;
    char state[512];
    double last_plan_try;
    int manifests_writing; /* training checkpoints' manifests a worker is writing: a re-plan
                              waits for them (a stage lost meanwhile resumes from that one) */
    nl_mem_opts train_mem; /* a training job's memory (training 0: none): plans hold it */
    /* a replica's node was lost and a training job saves the step under
     * way from the survivors before the cluster plans again: the plan
     * stays (not ready) until coord_release_plan */
    int plan_held;
    char held_why[512];
    int loads_active; /* stages whose tensors are still being streamed */
    int dismissing;   /* the cluster is going down (nl_coord_run): the nodes were asked to
                         leave, so no plan and no load for them */
    cjob jobs[COORD_MAX_JOBS];
    uint64_t next_job;
    /* the workers: a PULL socket on work_endpoint, and their tasks */
    void *work_pipe;
    char work_endpoint[64];
    cwork *works;
    int roles; /* the roles of the key whose message is being handled (NL_KEY_ROLE_*) */
    /* where clients' paths may lead: resolved --data-root, --checkpoint-root */
    char data_root[4096], ckpt_root[4096];
    /* tokens generate jobs produced since it started, for any client */
    uint64_t tokens_generated;
    int growths;              /* growths since it started (coord_grow.c) */
    coord_growth last_growth; /* the last of them */
    int growing;              /* a growth of --grow auto runs in a worker */
    uint64_t grow_sig;        /* the live nodes (and memory options) --grow auto last judged */
    nl_mem_opts grow_mem;     /* the training memory of the last job (--grow auto judges with it) */
    uint64_t client_drops;    /* messages to clients dropped (queue full, or gone) */
    double drop_logged;       /* when a drop was last logged */
};

/* Handle one message from a key with these roles (NL_KEY_ROLE_* bits):
 * a message its roles do not allow is refused (an ERROR and a strike).
 * The loop calls it with the roles of authorized_keys; the fuzz target
 * (fuzz/fuzz_coord.c) with its own. */
void coord_dispatch(nl_coord *c, const nl_rx *rx, int roles);

/* ---------------------------------------------------------------- coord_base.c
 * Helpers of every layer; they call no job code but through cjob_ops. */

void coord_set_state(nl_coord *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The node table (coord_nodes.c). Every lookup of a live node is O(1) in the number of
 * nodes (hash tables); a slot is taken, made live and lost through these
 * alone, so that the indexes stay true. */

/* The live node of stage `stage` of the current plan, or NULL. */
cnode *coord_stage_node(nl_coord *c, int stage);
/* Replica r of a stage (DESIGN section 8; replica 0 is coord_stage_node),
 * NULL if there is none; how many replicas a stage has (1 without). */
cnode *coord_stage_replica(nl_coord *c, int stage, int r);
int coord_stage_replicas(const nl_coord *c, int stage);
/* ASSIGN replica r of a stage (coord_assign.c). Replica r of stages with
 * as many replicas are one pipeline (DESIGN section 8: microbatch i runs
 * on replica i mod R_s), so its prev and next are replica r of the stages
 * around it; a neighbour with another count is named whole (prev_keys,
 * next_endpoints, next_keys); the ring is the stage's own replicas, r to
 * r + 1. */
void coord_send_assign(nl_coord *c, int stage, int r, const char *cfg_json, int relay_port);
/* The first replica of a stage whose node lives and can be reached (the
 * one that writes the stage's checkpoint shard), or -1. */
int coord_stage_first_live(nl_coord *c, int stage);
/* The replica of a stage that a send could not reach (cnode.unreachable),
 * or replica 0. */
cnode *coord_stage_unreached(nl_coord *c, int stage);
/* The live node a message came from: by its routing id, and (CURVE) from
 * the key it joined with; or NULL. */
cnode *coord_node_by_rid(nl_coord *c, const nl_rx *rx);
/* The live node holding this routing id (whatever its key), with this
 * node id, or with this public key (Z85); or NULL. */
cnode *coord_node_by_rid_raw(nl_coord *c, const uint8_t *rid, size_t rid_len);
cnode *coord_node_by_id(nl_coord *c, uint32_t id);
cnode *coord_node_by_key(nl_coord *c, const char *key);
/* The lowest slot that holds no live node, zeroed (the table grows by
 * doubling up to COORD_MAX_NODES); NULL when full or out of memory. Any
 * cnode * taken before is then stale. The caller fills id, key and rid
 * (unique among the live: see coord_on_join) and calls coord_node_live. */
cnode *coord_node_take(nl_coord *c);
/* The taken node becomes live: indexed, its heartbeat the newest. */
void coord_node_live(nl_coord *c, cnode *n);
/* A live node is no longer (life: NODE_DEAD or NODE_LEFT): out of the
 * indexes, its slot free for the next join. */
void coord_node_unlive(nl_coord *c, cnode *n, int life);
/* A heartbeat: last_seen is now, the newest (an unreachable node stays
 * first, to be declared dead). */
void coord_node_seen(nl_coord *c, cnode *n);
/* The live node with the oldest heartbeat (or an unreachable one), the
 * first to expire; NULL when none is live. */
cnode *coord_node_oldest(nl_coord *c);
void coord_nodes_free(nl_coord *c);
/* Send to a node; a node that cannot be reached is declared dead at the
 * next tick (its jobs fail, the cluster re-plans). */
nl_status coord_send_node(nl_coord *c, cnode *n, nl_wire_msg *m);
/* Send to a client: never blocks (issue 15): a client whose queue is full
 * (it does not read) or that is gone loses the message; the drops are
 * counted and logged at most once a second. */
nl_status coord_send_client(nl_coord *c, const uint8_t *rid, size_t rid_len, nl_wire_msg *m);
/* JOB_STATUS to a client, with an optional JSON report (a U8 frame). */
void coord_status_to(nl_coord *c, const uint8_t *rid, size_t rid_len, uint64_t job, int state,
                     double progress, const char *msg, const char *json);

/* The source of the weights: a new one of n files (NULL: out of memory);
 * closing retires the current one. */
csource *coord_source_new(int n);
void coord_close_source(nl_coord *c);
/* Whether the source's file `file` is where the plan takes tensor `name`
 * (or its moments) from. */
int coord_source_owns(const csource *src, int file, const char *name);
/* Unmap the retired sources no send holds any more (all: force). */
void coord_reap_sources(nl_coord *c, int force);
/* Forget the plan: the next tick plans and loads again from the source. */
void coord_drop_plan(nl_coord *c);
/* Drop the plan (if any): the stages reload from the source. */
void coord_reload(nl_coord *c);
/* A verified manifest, opened as a source (coord_manifest_open touches
 * no coordinator state: a worker runs it). */
struct nl_growth;
typedef struct cmanifest {
    csource *src;
    char *tok, *seed;         /* its tokenizer and initialisation seed, or NULL */
    char *chat;               /* its chat template, or NULL */
    struct nl_growth *growth; /* its growth history (core/grow/grow.h), or NULL */
    int n_growth;
    nl_config cfg;
    int64_t step, adam;
    char path[4096];
} cmanifest;
/* Load a manifest and read every shard whole, checking its hash on the
 * bytes that are then served (a bad shard is refused by name). With a
 * root (resolved), every shard must be a regular file that resolves
 * under it (coord_confine_file); NULL: the operator's own path. */
nl_status coord_manifest_open(cmanifest *out, const char *path, const char *root, nl_error *err);
void coord_manifest_release(cmanifest *m);
/* Make it the source (takes what m holds) and, when reload is set, plan
 * and load again from it. */
void coord_manifest_install(nl_coord *c, cmanifest *m, int reload);
/* Both, on the loop (at start, before it serves anyone). */
nl_status coord_use_manifest(nl_coord *c, const char *path, int reload, nl_error *err);

/* A forward or embed job's answer: the last stage's RESULT (one frame)
 * goes to the client as it is, then DONE, and the job is freed. */
void coord_finish_with_result(nl_coord *c, cjob *j, const nl_rx *rx);
/* The job fails: its client is told why, its stages forget it. */
void coord_job_fail(nl_coord *c, cjob *j, const char *why);
/* A job parameter by key, or NULL. */
const nl_wire_param *coord_param(const nl_msg_job_submit *s, const char *key);
/* Token ids of a submission's frame 0: I32 [B, T] within the vocabulary;
 * NULL or what is wrong. */
const char *coord_check_tokens(const nl_coord *c, const nl_rx *rx, int *B, int *T);
/* Send ids (host, [B, T]) to the first stage as an ACTIVATION. */
nl_status coord_send_tokens(nl_coord *c, cjob *j, uint64_t session, uint64_t pos,
                            const int32_t *ids, int B, int T);
/* The job fails because the first stage cannot be reached. */
void coord_fail_unreachable_first(nl_coord *c, cjob *j);
/* Whether rx came from the current plan's last stage (TOKEN and RESULT
 * are taken from it alone). */
bool coord_from_last_stage(nl_coord *c, const nl_rx *rx);
/* Tell every stage of the job's plan to drop the job (JOB_CANCEL). */
void coord_close_session(nl_coord *c, cjob *j);

/* Client-chosen paths (issue 15): root is resolved (realpath). A path
 * relative to root, or absolute and lexically under it, without "." or
 * ".." components, joined into out; NULL, or what is wrong (a message
 * that names nothing outside the root). */
const char *coord_join_path(const char *root, const char *path, char *out, size_t cap);
/* The same, then resolved with realpath (still under root: a link that
 * leads out is refused) and checked: a regular file of at most max_bytes
 * (a directory holding dir_file, when dir_file is set, stands for that
 * file). out gets the resolved path. */
const char *coord_confine_file(const char *root, const char *path, const char *dir_file,
                               uint64_t max_bytes, char *out, size_t cap);
/* ---------------------------------------------------------------- coord_members.c
 * Membership; coord.c's dispatch hands it the nodes' messages. */

/* A node is gone (life: NODE_DEAD or NODE_LEFT): fail what it carried (a
 * generation waits to resume) and plan again. */
void coord_node_lost(nl_coord *c, cnode *n, int life, const char *why);
void coord_on_join(nl_coord *c, const nl_rx *rx);
/* ---------------------------------------------------------------- coord_probe.c
 * --probe-inbound: a joining node's data endpoint tried with a TCP connect;
 * a node it cannot reach is planned as one without inbound connections. */
void coord_probe_start(nl_coord *c, cnode *n);
void coord_probe_stop(nl_coord *c, cnode *n);
/* Finish the probes that answered or ran out; how many are still out. */
int coord_probe_tick(nl_coord *c);
/* ---------------------------------------------------------------- coord_relay.c
 * The relay between neighbouring stages that both accept no inbound
 * connections: the pairs of the current plan set (the relay started on
 * first need); returns its port for ASSIGN.relay_port, 0 if none is needed
 * or it could not start (logged). */
int coord_relay_plan(nl_coord *c);
void coord_relay_stop(nl_coord *c);
/* Node n computed wrong in job `job` (coord_train_verify.c): its key is
 * banned (its authorized_keys line commented out, so it stays banned
 * across a restart, and the allow-lists reloaded), /api/events says so
 * (train_quarantine), and the node is dropped at the next tick as a dead
 * one (the jobs it carried resume without it). */
void coord_quarantine(nl_coord *c, cnode *n, uint64_t job, const char *why);
/* A banned key, as <state-dir>/authorized_keys records it ("# banned:
 * WHY: KEY ..."): shown by neuroctl status, /api/status (the dashboard)
 * and /metrics. */
typedef struct cban {
    char key[NL_KEY_Z85_LEN + 1];
    char why[320];
} cban;
/* c->bans read again from authorized_keys (at the start, at SIGHUP and
 * after each ban); the file's other lines are the allow-lists'. */
nl_status coord_bans_read(nl_coord *c, nl_error *err);
void coord_bans_free(nl_coord *c);
void coord_on_leave(nl_coord *c, const nl_rx *rx);
void coord_on_heartbeat(nl_coord *c, const nl_rx *rx);
void coord_on_node_error(nl_coord *c, const nl_rx *rx);

/* ---------------------------------------------------------------- coord_plan.c
 * Planning and loading; coord.c's tick and dispatch drive it. */

/* Plan over the live nodes and assign the stages (or say why not). */
void coord_try_plan(nl_coord *c);
/* Send the loading stages their next chunks; how many are still active. */
int coord_stream_loads(nl_coord *c);
/* With no job running, a plan that beats the current one is loaded. */
void coord_replan_at_rest(nl_coord *c);
/* A stage reports it has loaded its tensors. */
void coord_on_load_done(nl_coord *c, const nl_rx *rx);

/* Whether every stage of the current plan holds mo's memory on its node
 * (training: the microbatches in flight capped by 1F1B); if not, why says
 * which stage and by how many bytes. */
int coord_plan_holds(const nl_coord *c, const nl_mem_opts *mo, char *why, size_t cap);
/* Whether the planner can place the model on the live nodes now (with
 * the training memory of a running training job); if not, why says so
 * (with the shortfall in bytes). */
int coord_plan_possible(nl_coord *c, char *why, size_t cap);
/* The plan's predicted seconds for one request of --plan-rows rows
 * (inference, at the nodes' throughputs now) on stage s, and on its
 * slowest stage: what status reports, whatever the plan was made for (a
 * plan made during a training job has its own bottleneck in that job's
 * microbatches, forward and backward: not a figure for serving). */
double coord_stage_request_s(nl_coord *c, int s);
double coord_plan_request_s(nl_coord *c);
/* Send LEAVE to every live node (the cluster is going down: a node that
 * gets it stops instead of waiting to rejoin); returns how many were sent. */
int coord_dismiss_nodes(nl_coord *c, const char *why);
/* ---- the nodes' measured link speeds (coord_link.c) ---- */
/* A heartbeat's all-reduce counters: one more measurement of n's link
 * (checked: a figure that is not a speed is ignored and logged); a plan
 * costed at a link the measurements have left asks for a re-plan. */
void coord_link_heartbeat(nl_coord *c, cnode *n, const nl_msg_heartbeat *hb);
/* n's link speed, bytes/s: the median of its recent measurements; 0:
 * none. */
double coord_link_bytes_s(const cnode *n);
/* ... or COORD_LINK_ASSUMED where none (n may be NULL); *measured (may be
 * NULL) says which. */
double coord_link_or_assumed(const cnode *n, int *measured);
/* The current plan's link: the slowest of its replicas' (assumed where
 * not measured; no replicas: the assumed speed): coord_plan.c, the
 * planner's nl_plan_link_bytes_s over the live nodes. */
double coord_link_plan_now(nl_coord *c, int *measured);
/* Why a re-plan is wanted (replan_wanted's bits). */
enum { COORD_REPLAN_JOINED = 1, COORD_REPLAN_LEFT = 2, COORD_REPLAN_SPEEDS = 4 };
/* Those bits as words for a user ("a node joined", "the stages' measured
 * speeds", ...); never NULL. */
const char *coord_replan_reason(int why);
/* A node joined, a standby left or a stage's speed moved since the plan
 * (replan_wanted, which it clears, keeping its bits in replan_why): 1 if
 * a plan over the live nodes now beats the current one's bottleneck by
 * --replan-margin and the stages' weights are in the source (the old and
 * new plans are logged); the caller then reloads. `when` names the
 * moment in the log ("at rest", "at the checkpoint"). */
int coord_replan_gain(nl_coord *c, const char *when);
/* The same judgement without its effects (nothing logged or cleared): 1
 * if replan_wanted and a plan now beats the current one by the margin. */
int coord_replan_worth(nl_coord *c);
/* At a training checkpoint: each stage's throughput as observed (its
 * nodes' busy fractions since the last checkpoint against the plan's
 * predicted stage times); a node whose figure moved by more than
 * --replan-margin in this judgement and, the same way, in the one before on
 * the same plan takes the mean of the two and asks for a re-plan
 * (replan_wanted), which plans with the observed figures. The
 * observations start again. */
void coord_observe_speeds(nl_coord *c);
/* Whether every stage of a plan of two or more has sent enough heartbeats
 * since the observations started for coord_observe_speeds to judge it. */
int coord_observe_ready(const nl_coord *c);
/* The observations start again (a plan is loaded: what the nodes did on
 * another plan says nothing of this one). */
void coord_observe_restart(nl_coord *c);

/* ---------------------------------------------------------------- coord_journal.c
 * The running training job, journaled in <state-dir>/journal.json. */

struct json_t;
/* A submission's parameters as JSON (without "resume"), or NULL. */
struct json_t *coord_journal_params(const nl_msg_job_submit *s);
/* The weights a job starts from, when it does not resume a manifest: the
 * coordinator's source now ({"path": c->src_path or null for the seed,
 * "modified": whether the stages hold weights past it}), or NULL. */
struct json_t *coord_journal_from(const nl_coord *c);
/* Job j trains with params, its last verified manifest `manifest`
 * (NULL: none yet), having started from `from` (coord_journal_from, or
 * NULL when it resumed a manifest); its key is kept with it. */
void coord_journal_train(nl_coord *c, const cjob *j, const struct json_t *params,
                         const struct json_t *from, const char *manifest);
/* No training job runs. */
void coord_journal_clear(nl_coord *c);
/* At start: a journaled training job is made again, resuming from its
 * manifest, under its id; job ids go on from the journal's. */
void coord_journal_recover(nl_coord *c);

/* ---------------------------------------------------------------- coord_adapter.c */

/* Job j (just made) names an adapter file (resolved under
 * --checkpoint-root): its base_sha256 is compared with the SHA-256 of the
 * model file the stages hold (nl_coord_model_file; none after a training
 * job, or for a manifest or the seed: nothing to compare) by a worker, off
 * the loop; the file is hashed once (a job that comes while it is being
 * hashed waits for that hash) and kept while its size and time stay. The
 * job waits meanwhile (JOB_WAITING, `checking`: it does not time out), then fails
 * naming both hashes, or goes on through its `ready` (at once, or when the
 * plan is ready). 1: so it goes (or has failed: j is gone); 0: nothing to
 * check, the caller goes on. */
int coord_adapter_check(nl_coord *c, cjob *j, const char *adapter);

/* ---------------------------------------------------------------- coord_work.c */

nl_status coord_work_init(nl_coord *c, nl_error *err);
/* Run task w in a worker thread (takes w: on failure it is freed). */
nl_status coord_work_start(nl_coord *c, cwork *w, nl_error *err);
/* On the loop: the finished tasks' done, then free. */
void coord_work_reap(nl_coord *c);
/* Wait for every task, freeing them unreported; close the pipe. */
void coord_work_shutdown(nl_coord *c);

/* ---------------------------------------------------------------- coord_grow.c
 * Growth of the model (DESIGN.md section 5). */

struct json_t;
/* A growth as JSON: kind, step, from and to (vocab_size, num_layers,
 * hidden_dim, ffn_dim), seconds. */
struct json_t *coord_growth_json(const coord_growth *g);
void coord_growth_record(nl_coord *c, int kind, int64_t step, const nl_config *before,
                         const nl_config *after, double seconds);
/* NULL when the model may grow now, else why not (into why): no model,
 * stages trained since the last checkpoint, a checkpoint file source. */
const char *coord_grow_refusal(const nl_coord *c, char *why, size_t cap);

/* One growth, prepared on the loop and run in a worker: the tokenizer
 * learns `add` ids from a text file (input; NULL: none) and the model's
 * vocab_size becomes max(vocab_size, the tokenizer's); the depth and width
 * grow to layers, hidden_dim, ffn_dim (0: unchanged). When the stages hold
 * a manifest, the grown one (nl_manifest_grow, core/grow/grow.h) is written
 * beside it, in <its directory>-<what>-<size>, and opened; from the seed
 * (vocabulary only) the nodes draw the grown tables. The work owns
 * everything in it. */
typedef struct coord_grow_work {
    /* in */
    char *tok;   /* the cluster's tokenizer text, or NULL (bytes) */
    char *input; /* the text file (resolved under --data-root), or NULL */
    int64_t add;
    int layers, hidden_dim, ffn_dim;
    size_t max_bytes;
    nl_config cfg; /* now */
    char *src;     /* the manifest the stages hold, or NULL (the seed) */
    /* out */
    int kind; /* COORD_GROW_*: the first dimension that grew */
    char *new_tok;
    int64_t tok_before, tok_after;
    nl_config grown;
    cmanifest mf; /* with src: the grown manifest, verified and opened */
    int have_mf;
} coord_grow_work;
/* On the loop: fill g from the cluster (copies); NL_ERR_STATE for depth or
 * width on a cluster that serves the seed. */
nl_status coord_grow_prepare(nl_coord *c, coord_grow_work *g, const char *input, int64_t add,
                             int layers, int hidden_dim, int ffn_dim, nl_error *err);
/* In a worker. */
nl_status coord_grow_run(coord_grow_work *g, nl_error *err);
/* On the loop, after a successful run: the grown model becomes the
 * source (the tokenizer and config too), the stages reload, the growth is
 * recorded at the source's step. */
void coord_grow_install(nl_coord *c, coord_grow_work *g, double seconds);
/* The growth just installed as a client's event ("event": "grow"). */
struct json_t *coord_grow_event(const nl_coord *c, const coord_grow_work *g);
void coord_grow_release(coord_grow_work *g);

/* A growth as a worker's task: the one task of --grow auto at rest, the
 * grow job and --grow auto at a training checkpoint. */
typedef struct coord_grow_task {
    cwork w;
    coord_grow_work g;
    nl_status st; /* the run's */
    nl_error err;
    double t0;      /* when it was made */
    char src[4096]; /* the source it grows (c->src_path then) */
} coord_grow_task;
/* On the loop: a growth prepared (coord_grow_prepare) as a task for job
 * (0: none) whose done is `done`, for coord_work_start; NULL and err (out
 * of memory, or why it cannot be prepared). */
coord_grow_task *coord_grow_task_new(nl_coord *c, uint64_t job, const char *input, int64_t add,
                                     int layers, int hidden_dim, int ffn_dim,
                                     void (*done)(nl_coord *c, cwork *w), nl_error *err);

/* --grow auto: when the live nodes (or the training memory) changed since
 * the last judgement, the depth nl_sizing_propose_depth proposes for them
 * (with the running job's training memory, else the last job's, else the
 * sizing defaults), if deeper than now and past the hysteresis
 * (nl_sizing_should_change); else 0. */
int coord_grow_auto_depth(nl_coord *c);
/* The loop's turn, at rest (ready, no job): 1 while a growth of --grow
 * auto runs in a worker (the caller then leaves the plan alone). */
int coord_grow_tick(nl_coord *c);

/* ---------------------------------------------------------------- coord_jobs.c
 * The jobs' table and dispatch, called by the loop (coord.c). */

/* The job table. coord_job_new: a free slot for a client's request, owned
 * by rx's key, or NULL (the client is answered: the table is full, or the
 * key holds --max-jobs-per-key jobs already). */
cjob *coord_job_new(nl_coord *c, const nl_rx *rx, const cjob_ops *ops);
/* Whether rx's key may see and touch job j: the key that submitted it, or
 * an admin (the roles of the message being handled, c->roles). */
bool coord_job_mine(const nl_coord *c, const cjob *j, const nl_rx *rx);
cjob *coord_job_find(nl_coord *c, uint64_t id);
/* Free the job's state and its slot (a job that is done). */
void coord_job_free(cjob *j);

void coord_on_submit(nl_coord *c, const nl_rx *rx);
/* A node's message about a job (JOB_STATUS, TOKEN, RESULT, GRAD_NORM,
 * LOSS, CKPT_DONE). */
void coord_on_job_message(nl_coord *c, const nl_rx *rx);
void coord_on_query(nl_coord *c, const nl_rx *rx);
void coord_on_cancel(nl_coord *c, const nl_rx *rx);
void coord_fail_jobs(nl_coord *c, const char *why);
/* A stage reports a failure it cannot name a job for (an ERROR): the jobs
 * it serves (running on the current plan) fail; waiting ones stay. */
void coord_fail_stage_jobs(nl_coord *c, const char *why);
/* A stage is lost: each job waits for the next plan or fails. 1 if a
 * job asks to keep the plan a while first (cjob_ops.stage_lost's 2). */
int coord_jobs_stage_lost(nl_coord *c, const char *why);
/* The plan a job kept after a loss (plan_held) is dropped now, and the
 * cluster plans again; nothing if none is kept. */
void coord_release_plan(nl_coord *c);
/* A stage loaded: the jobs waiting for the plan made progress. */
void coord_jobs_touch(nl_coord *c);
/* The plan is ready: the waiting jobs go on. */
void coord_jobs_ready(nl_coord *c);
/* No plan can be made: the waiting jobs fail. */
void coord_fail_waiting(nl_coord *c, const char *why);
/* Jobs with no progress for --job-timeout-ms fail. */
void coord_check_jobs(nl_coord *c, double now);

#endif
