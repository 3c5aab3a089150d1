/* The inside of a pipeline stage, shared by node/stage.c (assignment,
 * loading, inference) and node/stage_train.c (training jobs). Private to
 * node/. */
#ifndef NL_NODE_STAGE_IMPL_H
#define NL_NODE_STAGE_IMPL_H

#include "../core/forward.h"
#include "../core/sampler.h"
#include "../kernels/comm.h"
#include "stage.h"

#define ENDED_MEMORY 256 /* ended session ids remembered per kind */

typedef struct session {
    uint64_t id;
    nl_kvcache *kv;
    size_t bytes;
    bool has_sampler;
    nl_sampler smp;
    uint64_t used; /* the stage's tick at the last use: LRU order */
    int limit;     /* tokens the last stage feeds back itself (0: none) */
    int produced;  /* tokens sampled so far (last stage) */
    /* its forwards on this stage: several positions (the prompt), and
     * decode steps of one */
    double prefill_s, step_s;
    int steps;
} session;

/* The last ENDED_MEMORY session ids of one kind of end (0 is never an id). */
typedef struct ended_ids {
    uint64_t id[ENDED_MEMORY];
    int n, at;
} ended_ids;

struct nl_stage {
    nl_backend *be; /* borrowed: replica 0's, which serves inference and holds the model */
    /* data-parallel replicas (stage_train.c): rbe[0] == be; each training
     * job copies the model onto rbe[1..n_rep-1] */
    nl_backend *rbe[NL_COMM_MAX]; /* borrowed */
    int n_rep;
    nl_comm *comm; /* over rbe, when n_rep > 1 */
    bool own_comm; /* ... made by the stage (else borrowed) */
    nl_stage_opts o;
    /* the device's asynchronous error, once seen: every later piece of
     * work is refused with it */
    nl_status device_st; /* NL_OK while healthy */
    char device_err[NL_ERROR_MSG_MAX];

    /* the assignment */
    uint64_t epoch;
    bool assigned;      /* an ASSIGN was received (epoch is meaningful) */
    bool assign_failed; /* ... and refused: loads of its epoch are dropped */
    int stage_idx, num_stages;
    char assign_err[NL_ERROR_MSG_MAX];
    uint64_t seed;
    nl_model *model;
    uint64_t *loaded; /* elements received per table entry: weights, then m, then v */
    bool ready;
    double t_assign;
    int max_rows;

    /* the forward */
    nl_runstate *rs;
    int rs_rows;
    nl_txref tx;    /* guards the output buffer while it is being sent */
    int32_t *tok_h; /* aligned copy of a token frame (host) */
    size_t tok_cap;
    float *xin_d; /* device copy of a hidden-state frame */
    size_t xin_cap;
    nl_host_stage out_stage; /* host view of the output (a copy off host memory) */

    /* optimizer moments that came with the weights (LAYER_LOAD of
     * optim.m.* and optim.v.*): host, n_params each, until a training job
     * takes them */
    float *mom_h[2];
    bool have_moments;

    /* the training job, if one runs (node/stage_train.c) */
    struct stage_train *train;

    /* sessions */
    session *sess;
    int n_sess, cap_sess;
    size_t kv_used;
    uint64_t tick;
    ended_ids evicted; /* to make room: their hops are errors that say so */
    ended_ids closed;  /* by JOB_CANCEL: their hops in flight are dropped */
};

/* Free the training job's state (stage_train.c); safe without one. */
void nl_stage_train_free(nl_stage *s);
/* Wait until the replicas' threads have finished what they were given,
 * before other work uses replica 0's backend (stage_train.c). */
void nl_stage_train_quiesce(nl_stage *s);

/* The backend's sticky asynchronous error (nl_backend_check), remembered
 * once seen: "device D: MESSAGE" in err, else NL_OK with err untouched.
 * Called after the work a message caused; before it, work is refused with
 * nl_stage_device_status (which does not ask the backend). */
nl_status nl_stage_check_device(nl_stage *s, nl_error *err);

#endif
