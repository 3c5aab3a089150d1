/* The coordinator: membership, sizing, placement, loading and jobs of one
 * cluster. The daemon (coordinator/main.c) owns one nl_coord and runs its
 * event loop until asked to stop.
 *
 * Ownership: nl_coord_new returns a coordinator the caller frees with
 * nl_coord_destroy(&c); it owns its sockets, the mapped checkpoint and
 * every job. */
#ifndef NL_COORD_H
#define NL_COORD_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"

typedef struct nl_coord nl_coord;

/* Most stages --replicas R0,R1,... names. */
#define NL_COORD_MAX_STAGE_LIST 64

typedef struct nl_coord_opts {
    const char *listen; /* the nodes' endpoint, e.g. tcp://0.0.0.0:7000 */
    /* The clients' endpoint (a socket for clients alone, control-sized:
     * issue 15, finding 8), or NULL for one derived from listen: tcp's
     * port + 1 (tcp://0.0.0.0:7001; port * stays *), ipc:// and inproc://
     * names + "-client". */
    const char *client_listen;
    const char *state_dir;    /* keys, authorized_keys, endpoint file */
    const char *model;        /* checkpoint to serve, or NULL */
    const char *resume;       /* a training manifest to serve and continue, or NULL */
    const char *config;       /* YAML config (sized, or to be sized), or NULL */
    uint64_t seed;            /* initialisation seed without a checkpoint */
    int min_nodes;            /* plan once this many nodes have joined */
    uint64_t min_memory;      /* ... and they offer this many bytes */
    int heartbeat_ms;         /* told to nodes */
    int node_timeout_ms;      /* a node silent this long is dead */
    int job_timeout_ms;       /* a job with no progress this long fails */
    int gen_resumes;          /* times a generation resumes after losing a stage (0: it fails) */
    int train_resumes;        /* times a training job resumes after losing a stage (0: it fails) */
    int plan_rows;            /* rows of one request the plan must fit */
    double replan_margin;     /* at rest, a join re-plans if the bottleneck gets better by this
                               * fraction (0.1: 10%; 1: never) */
    bool plaintext;           /* INSECURE: no CURVE */
    int grow_auto;            /* --grow auto: the model deepens as nodes join (coord_grow.c) */
    double verify_rate;       /* --verify-rate: the fraction of a training step's (stage,
                               * microbatch)s redone by another node (coord_train_verify.c) */
    int wire;                 /* --wire: nl_wire_precision of the stages' hops (told in ASSIGN) */
    const char *relay_listen; /* --relay-listen: the relay's endpoint (NULL: --listen's host,
                               * a free port), bound when two such neighbours need it */
    bool probe_inbound;       /* --probe-inbound: a joining node whose data endpoint does not
                               * answer a TCP connect is planned as --no-inbound (coord_probe.c) */
    int rebalance_after;      /* --rebalance-after: a training job judges the stages' observed
                               * speeds once after this many steps (0: only at checkpoints) */
    int replicas;             /* --replicas: every stage on this many nodes (DESIGN section 8;
                               * core/plan/planner.h nl_plan_layers_replicated); 1: none; 0 (auto):
                               * as many as give the most training tokens/s by the cost model
                               * (nl_plan_choose_stage_replicas, a count per stage) for steps
                               * of plan_microbatches; -1: stage_replicas */
    int stage_replicas[NL_COORD_MAX_STAGE_LIST]; /* --replicas R0,R1,...: stage s on
                                                  * stage_replicas[s] nodes
                                                  * (nl_plan_layers_staged) */
    int n_stage_replicas;                        /* how many; 0: none */
    int plan_microbatches; /* --plan-microbatches: a step's microbatches --replicas auto plans
                            * for (default 8) */
    int outer_every;       /* --outer-every: DiLoCo's H, each replica group's AdamW steps
                            * between the groups' outer steps (DESIGN section 8); 0: the
                            * replicas add up every step's gradients */
    double outer_lr;       /* --outer-lr, --outer-momentum: DiLoCo's outer Nesterov step */
    double outer_momentum;
    int in_flight_extra; /* --in-flight-extra: microbatches every stage but the last keeps in
                          * flight beyond 1F1B's (core/model/memory.h nl_mem_train_slots) */
    /* Where a training job's client-chosen paths may lead (data; resume
     * and checkpoint_dir): NULL for <state_dir>/data and
     * <state_dir>/checkpoints (created 0700). */
    const char *data_root, *checkpoint_root;
    uint64_t max_data_bytes; /* a training job's data file at most (default 1 GiB) */
    uint64_t max_data_total; /* the data files of the training jobs running, together (1 GiB) */
    int max_jobs_per_key;    /* jobs one client key may hold at once (default 32: half the table) */
} nl_coord_opts;

void nl_coord_opts_init(nl_coord_opts *o);

nl_status nl_coord_new(nl_coord **out, const nl_coord_opts *o, nl_error *err);
void nl_coord_destroy(nl_coord **c);

/* Run until *stop becomes non-zero (set by a signal handler). SIGHUP
 * reloads authorized_keys (nl_auth_hup_install must have been called). */
nl_status nl_coord_run(nl_coord *c, volatile sig_atomic_t *stop, nl_error *err);
/* *stop set to this (neurocoord's SIGUSR2, neuroctl cluster down): before
 * returning, nl_coord_run sends every live node LEAVE (a node stops on
 * it instead of waiting to rejoin) and waits up to 10 s for their LEAVEs.
 * Any other value stops the coordinator alone: its nodes wait for it to
 * come back (a restart), as they do when it dies. */
#define NL_COORD_STOP_NODES 2

/* One turn of the event loop: wait up to timeout_ms for one message,
 * handle it, then the timers (deaths, job timeouts, planning). Tests drive
 * the coordinator with it. */
void nl_coord_step(nl_coord *c, int timeout_ms);

/* The endpoints it is bound to (the ports chosen): the nodes' (--listen)
 * and the clients' (--client-listen), and the one-line state of the
 * cluster ("ready: 2 stages, ..."). Owned by c. */
const char *nl_coord_endpoint(const nl_coord *c);
const char *nl_coord_client_endpoint(const nl_coord *c);
const char *nl_coord_state(const nl_coord *c);
/* The checkpoint file the stages' weights are (--model, untrained since),
 * or NULL (a manifest, the seed, or weights a training job changed):
 * what adapters are checked against (nl_lora_check_bases). */
const char *nl_coord_model_file(const nl_coord *c);
/* hex: the SHA-256 of nl_coord_model_file(c) as the caller hashed it
 * (neurocoord --http-adapter's check at start), kept for the adapters
 * that jobs name (coordinator/coord_adapter.c) while the file's size and
 * time stay. */
void nl_coord_model_hashed(nl_coord *c, const char *hex);
/* The jobs one client key may hold at once (--max-jobs-per-key, bounded
 * by the job table's size). */
int nl_coord_max_jobs_per_key(const nl_coord *c);

/* For an in-process client (coordinator/coord_http.c): admit its public
 * key (Z85) on the client socket besides authorized_keys, with the client
 * role (not admin), for the coordinator's life (a SIGHUP reload keeps it). */
nl_status nl_coord_admit_key(nl_coord *c, const char *z85, nl_error *err);

/* Called on the loop's thread with every JOB_STATUS the coordinator sends
 * a client and its JSON report (or NULL), e.g. a training step's loss. It
 * must not block; ctx must outlive c or the next nl_coord_observe. */
typedef void (*nl_coord_observer)(void *ctx, uint64_t job, int state, const char *msg,
                                  const char *json);
void nl_coord_observe(nl_coord *c, nl_coord_observer fn, void *ctx);

#endif
