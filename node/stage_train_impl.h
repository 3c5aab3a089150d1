/* The inside of a training job on one stage, shared by node/stage_train.c
 * (the job's state and life, the messages it receives, the optimizer step
 * and the checkpoints), node/stage_train_make.c (the job's making) and
 * node/stage_train_hops.c (the replicas' jobs and the 1F1B schedule that
 * runs the hops). Private to those files; the design is told at the top
 * of stage_train.c. */
#ifndef NL_NODE_STAGE_TRAIN_IMPL_H
#define NL_NODE_STAGE_TRAIN_IMPL_H

#include <stdatomic.h>

#include "core/train/train.h"
#include "net/allreduce.h"
#include "net/hopdigest.h"
#include "node/replica_workers.h"
#include "node/stage_impl.h"

/* What a training hop carries besides its input (net/wire.h, NL_HOP_*),
 * each owned and NULL when it did not come: the targets (rows; not on a
 * COUNT), the document ids (rows), and classification's labels and
 * lengths (mbB); loss_rows, the step's predictions (0: every row). */
typedef struct hop_extra {
    int32_t *targets, *docs, *labels, *lengths;
    uint64_t loss_rows;
} hop_extra;

/* A forward-type hop waiting to run: its frames copied. */
typedef struct hop_in {
    nl_msg_type type; /* COUNT, ACTIVATION or EVAL */
    uint64_t step;
    uint32_t mb;
    double aux;
    void *x;      /* tokens (I32, rows) on the first stage, else hidden (F32, rows x d) */
    hop_extra e;  /* the rest of its frames */
    size_t bytes; /* of all its frames */
    uint8_t digest[NL_HOP_DIGEST_BYTES]; /* of the hop as it came (checked) */
} hop_in;

/* What the stage keeps of one microbatch of the step under way, for
 * verification by recompute (stage_verify.h): its inputs. */
typedef struct kept_mb {
    void *x;     /* the forward's input (tokens or hidden states), owned */
    hop_extra e; /* the frames that came with it */
    float *dy;   /* the GRADIENT received (host, rows x d), owned */
    /* what it sent, as sent (keep_out: for a verifier of another device
     * class): the ACTIVATION and the GRADIENT (host, rows x d), owned */
    float *y, *dx;
    bool fwd, bwd;
} kept_mb;

/* Bytes the queue of hops from the previous stage may hold (issue 15):
 * at least this, or a step's counting and training hops and 8 more. */
#define QUEUE_MIN_BYTES (64ull << 20)

/* One data-parallel replica of the stage. */
typedef struct replica {
    nl_backend *be; /* borrowed: the stage's rbe[r] */
    nl_model *m;    /* replica 0: the stage's model (borrowed); others: the job's copy (owned) */
    nl_trainer *tr;
    float *x_d; /* device staging of a hidden-state input or gradient frame */
} replica;

/* A replica's piece of work, run on its lane; the node's thread owns it
 * before the push and after the pop. */
typedef enum job_kind { JOB_BEGIN, JOB_COUNT, JOB_FORWARD, JOB_BACKWARD, JOB_STEP } job_kind;

typedef struct rjob {
    nl_wjob w; /* w.lane: the replica */
    job_kind kind;
    uint64_t step;
    uint32_t mb;
    int slot;
    double aux;      /* the hop's */
    void *x;         /* owned: tokens or hidden states of a hop, or a GRADIENT's dy (host) */
    hop_extra e;     /* owned: the hop's other frames (JOB_BEGIN: loss_rows only) */
    bool inject_nan; /* test hook: a NaN into this forward's gradient */
    bool last;       /* the step's last counting pass or backward */
    float lr, clip;  /* JOB_STEP */
    /* results */
    nl_msg_type out_type; /* what out holds to send (COUNT, ACTIVATION, GRADIENT), or 0 */
    float *out;           /* host, rows x d: kept for the job's next use */
    double ce, a;         /* a forward's cross-entropy sum and aux loss */
    nl_status st;
    nl_error err;
    struct rjob *all_next;  /* every job made */
    struct rjob *free_next; /* the ones not in use */
} rjob;

typedef struct stage_train {
    uint64_t job;
    replica rep[NL_COMM_MAX];
    int R;      /* replicas */
    int rslots; /* activation slots of each replica: ceil(slots / R) */
    int mbB, T, M, slots, eval_hops;
    size_t rows, d;
    int64_t applied;       /* optimizer steps applied (the step a hop needs is applied + 1) */
    uint64_t begun;        /* the step whose gradients are being accumulated (0: none) */
    int counted, fwd, bwd; /* this step's counting passes, forwards and backwards run */
    int finished;          /* this step's gradients are reported; waiting for STEP */
    double ce, aux;        /* the last stage: this step's cross-entropy sum and aux loss */
    int evals;             /* evaluation hops run (the last stage: and their loss sum) */
    double eval_ce;
    /* the last stage's evaluation of classification (labels came): the
     * rows scored and right, the class probabilities and the labels given
     * to the trainer of a microbatch (rows past the held-out split: 0) */
    bool eval_classify;
    int64_t eval_n, eval_right;
    float *probs;
    int32_t *given;
    /* the digests of this step's hops (net/hopdigest.h): [M][NL_DIGEST_KINDS][32],
     * zeroed when a step begins, sent with its GRAD_NORM */
    uint8_t *dig;
    char dig_hex[NL_HOP_DIGEST_HEX + 1]; /* the digest of the hop in tx */
    kept_mb *kept;                       /* [M]: this step's inputs, until the next step begins */
    bool keep_out;                       /* ... and its outputs (JOB_SUBMIT verify_outputs) */
    int64_t *counts;                     /* the step's route counts, once summed (verification) */
    size_t n_counts;
    float *lie_prev; /* test hook (stage_train_lie.c): the last step's outputs, and marks */
    hop_in *q;       /* FIFO ring of hops waiting to run */
    int qhead, qlen, qcap;
    size_t qbytes;       /* the hops' bytes in the queue */
    nl_host_stage stage; /* host view of an output to send */
    nl_wire_msg tx;
    /* the replicas' lanes (one replica: inline) */
    nl_workers *w;
    bool async;               /* results are taken back from nl_stage_train_poll */
    bool has_embed, has_head; /* the stage's model's, for the lanes */
    bool counts_ready;        /* this step's counting pass is summed and in use */
    rjob *jobs, *free_jobs;
    /* with a next stage of another replica count (nl_stage.fan_next): the
     * gradients that came before their turn, by this node's microbatch
     * (M of them, F32), each taken when the backwards before it are */
    float **gpend;
    /* one of the stage's replicas on other nodes (DESIGN section 8;
     * stage_train_ring.c): this node runs microbatches xr, xr + xR, ... of
     * a step's Mg, numbered 0 .. M-1 here (on the wire mb * xR + xr); the
     * reducers that add up the replicas' gradients and route counts; the
     * gradients' reduce under way, and a STEP that came meanwhile. Alone:
     * xR = 1, Mg = M, no reducers. */
    int xr, xR, Mg;
    nl_allreduce *red[NL_REDUCE_KINDS];
    float *red_buf[NL_REDUCE_KINDS];
    bool reducing, step_held;
    uint64_t ring_bytes; /* REDUCE frame bytes this replica sent (replica traffic) */
    double reduce_t0;    /* when this step's gradients went into the ring (monotonic s) */
    double reduce_s;     /* seconds from there to their sum, over the job's steps */
    int reduce_n;        /* steps summed so */
    /* DiLoCo (outer_every H > 0; DESIGN section 8): this replica is one
     * replica group's; its inner steps use its own gradients, and every H
     * steps the groups' deltas are added round the ring (the GRADS
     * reducer) and the outer step applied. anchor: the weights at the last
     * sync, outer_m: the outer momentum (host, n_params each, the same on
     * every replica); syncing: the deltas are being added (the next
     * step's hops and a CKPT_REQ wait, ckpt_held with its dir copied). */
    int H;
    float outer_lr, outer_mu; /* the outer step's (neurocoord --outer-lr, --outer-momentum) */
    float *anchor, *outer_m;
    bool applied_anchor, syncing, ckpt_held;
    nl_msg_ckpt_req held_ckpt;
    char *held_dir;
    bool no_compute; /* test hook (nl_stage_opts.inject_no_compute): the ops skipped */
    nl_msg_step held;
    atomic_int failed; /* a job failed: the lanes skip the rest */
    /* test hook (NL_TEST_COMPUTE_GFLOPS): a microbatch's forward through
     * this stage at the model's rate (seconds), and where the sleeps add up */
    double model_fwd_s;
    atomic_uint_least64_t *modelled_us;
    nl_status poison; /* ... and the error every later message gets */
    char poison_msg[NL_ERROR_MSG_MAX];
    /* the poison came after its job computed (a send or a report failed,
     * e.g. to a neighbour's node that died): the weights and moments are
     * whole, and a CKPT_REQ is still answered (stage_train.c on_ckpt) */
    bool poison_whole;
    /* the AdamW steps the trainers took if every STEP that applied ran:
     * their count at the start plus one a STEP (checked before a shard is
     * written from a poisoned stage) */
    int64_t adam_want;
} stage_train;

/* ---- stage_train.c ---- */

/* Free a queued hop's copies. */
void stage_train_hop_free(hop_in *h);
/* Free the arrays of e (and NULL them). */
void stage_train_extra_free(hop_extra *e);
/* A microbatch's number on the wire (the step's) from its number here. */
static inline uint32_t stage_train_mb_wire(const stage_train *t, uint32_t mb)
{
    return mb * (uint32_t)t->xR + (uint32_t)t->xr;
}

/* The slot of this step's window that keeps digest `kind` of microbatch mb
 * (this node's number; the window is the step's, [Mg]). */
static inline uint8_t *stage_train_dig(stage_train *t, uint32_t mb, int kind)
{
    return t->dig + ((size_t)stage_train_mb_wire(t, mb) * NL_DIGEST_KINDS + (size_t)kind) *
                        NL_HOP_DIGEST_BYTES;
}

/* Keep a finished forward's or backward's inputs of this step (taking
 * j->x and j->e), or free them (verification, stage_verify.h). */
void stage_train_keep(stage_train *t, rjob *j);
/* With keep_out, keep a copy of what a finished forward or backward of
 * this step sends (j->out, after the test hook's lie: as sent). */
void stage_train_keep_out(stage_train *t, const rjob *j);
/* Free what is kept of the step (a new one begins). */
void stage_train_kept_free(stage_train *t);
/* VERIFY_REQ: the case of the microbatch asked for, as a VERIFY_CASE to
 * the coordinator. */
nl_status stage_train_verify_req(nl_stage *s, stage_train *t, const nl_msg_verify_req *r,
                                 nl_stage_send_fn send, void *ctx, nl_error *err);

/* ---- stage_train_lie.c: a test hook (test builds only) ---- */

/* Falsify j's output to send as s->o.lie says (a no-op without it). */
void stage_train_lie(nl_stage *s, stage_train *t, rjob *j);
/* A stage that withholds its cases (NL_LIE_MUTE): VERIFY_REQ unanswered. */
bool stage_verify_mute(const nl_stage *s);
/* A verifier that lies (NL_LIE_VERIFIER): one bit of a digest of its
 * answer, on its fraction of the cases. */
void stage_verify_lie(const nl_stage *s, uint64_t job, uint64_t step, uint32_t mb, uint32_t stage,
                      uint8_t fwd[NL_HOP_DIGEST_BYTES], uint8_t bwd[NL_HOP_DIGEST_BYTES]);

/* ---- stage_train_hops.c: the replicas' jobs and the schedule ---- */

/* Take back what finished and dispatch what became runnable; without
 * train_async, until every job dispatched has been taken back. */
nl_status stage_train_advance(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                              nl_error *err);
/* Queue a job on its replica's lane (inline: run it now), then take back
 * what has finished. */
nl_status stage_train_dispatch(nl_stage *s, stage_train *t, rjob *j, nl_stage_send_fn send,
                               void *ctx, nl_error *err);
/* A job to fill (from the free list, or a new one). */
rjob *stage_train_job_get(stage_train *t, job_kind kind, int lane, nl_error *err);
void stage_train_job_put(stage_train *t, rjob *j);
/* The replica that runs microbatch mb, and its activation slot there. */
int stage_train_replica_of(const stage_train *t, uint32_t mb);
int stage_train_slot_of(const stage_train *t, uint32_t mb);
/* Runs on the replica's lane (replica_workers.h). */
void stage_train_run_job(void *ctx, nl_wjob *w);
/* Test hook (NL_TEST_COMPUTE_GFLOPS): set t's no_compute and the compute
 * model's time of a microbatch's forward (stage_train_hops.c). */
void stage_train_model_init(nl_stage *s, stage_train *t);
/* Take back the finished jobs in order (wait: every job dispatched, once
 * finished). The first error ends the job on this stage (poison). */
nl_status stage_train_take_done(nl_stage *s, stage_train *t, bool wait, nl_stage_send_fn send,
                                void *ctx, nl_error *err);

/* The step's gradients are final and added up (across the replicas, if
 * any): this stage's share of the norm and, on the last stage, the losses
 * to the coordinator (by replica 0); the stage waits for STEP. */
nl_status stage_train_report(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                             nl_error *err);
/* The step's route counts, summed here (n per layer and expert), are the
 * batch's: every replica uses them. */
void stage_train_use_counts(nl_stage *s, stage_train *t, const int64_t *sum, size_t n);

/* ---- stage_train_ring.c: the stage's replicas on other nodes ---- */

/* From the stage's ASSIGN: xr, xR, Mg and M of a step of `micro`
 * microbatches, and the reducers; DiLoCo's H and outer step from p. */
nl_status stage_train_ring_new(nl_stage *s, stage_train *t, int64_t micro,
                               const struct nl_trainparams *p, nl_error *err);
void stage_train_ring_free(stage_train *t);
/* A hop's microbatch on the wire into this node's number (*mb), or an
 * error if another replica runs it. */
nl_status stage_train_mb_here(const stage_train *t, const char *what, uint32_t wire, uint32_t *mb,
                              nl_error *err);
/* Begin adding up the step's gradients (and the last stage's losses)
 * across the replicas; when that is done (now, or on a later REDUCE), the
 * step is reported. */
nl_status stage_train_reduce_grads(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                                   nl_error *err);
/* Begin adding up the step's route counts (sum, n) across the replicas;
 * when done they are used (stage_train_use_counts). */
nl_status stage_train_reduce_counts(nl_stage *s, stage_train *t, const int64_t *sum, size_t n,
                                    nl_stage_send_fn send, void *ctx, nl_error *err);
/* DiLoCo: before the job's first AdamW step, keep the weights as those
 * of the last sync (a no-op once kept). */
nl_status stage_train_outer_anchor(nl_stage *s, stage_train *t, nl_stage_send_fn send, void *ctx,
                                   nl_error *err);
/* DiLoCo: step `step`'s AdamW is dispatched; on a multiple of H begin
 * adding up the groups' deltas (t->syncing until the outer step is
 * applied, now or on a later REDUCE). */
nl_status stage_train_outer(nl_stage *s, stage_train *t, uint64_t step, nl_stage_send_fn send,
                            void *ctx, nl_error *err);
/* DiLoCo: a CKPT_REQ r that comes while the outer step is added up waits
 * for it (*held; its dir copied into t->held_ckpt, given again once the
 * outer step is applied); another while one waits is an error. */
nl_status stage_train_outer_hold(stage_train *t, const nl_msg_ckpt_req *r, bool *held,
                                 nl_error *err);
/* A REDUCE from the previous replica. */
nl_status stage_train_ring_input(nl_stage *s, stage_train *t, const nl_wire_msg *m,
                                 nl_stage_send_fn send, void *ctx, nl_error *err);

#endif
