/* The inside of a pipeline stage, shared by the stage's files: stage.c
 * (assignment, loading, the forward hop), stage_session.c (generation
 * sessions), stage_batch.c (their hops in batches), stage_jobs.c (the
 * jobs by id and their kinds), stage_train.c and stage_train_hops.c
 * (through stage_train_impl.h: training jobs), stage_lora.c (fine-tuning
 * jobs, adapters for inference) and stage_embed.c (embedding requests).
 * Private to node/. */
#ifndef NL_NODE_STAGE_IMPL_H
#define NL_NODE_STAGE_IMPL_H

#include <stdatomic.h>

#include "base/clock.h"
#include "core/model/batch.h"
#include "core/model/forward.h"
#include "core/model/sampler.h"
#include "kernels/comm.h"
#include "node/stage.h"

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
    int logprobs;  /* 0: none; 1 + k: log-probabilities with each token (the top k) */
    /* its forwards on this stage: several positions (the prompt), and
     * decode steps of one */
    double prefill_s, step_s;
    int steps;
    uint64_t picked; /* the batch (s->batch_seq) that last took one of its hops */
    double last_in;  /* when its last hop arrived here (0: none yet) */
    double period;   /* the time between its hops' arrivals here, smoothed (0: unknown) */
    /* its adapter (a reference of the stage's cache), or NULL; with one,
     * its hops run alone, not in the batch (stage_batch.c) */
    struct nl_lora *lo;
} session;

/* A session's hop waiting for a batch (node/stage_batch.c). The slots of
 * the queue keep their buffers when they are reused. */
typedef struct queued_hop {
    uint64_t job_id, session_id, pos;
    int T, done; /* positions, and those already run (chunked prefill) */
    double aux, t_in;
    bool gone; /* finished or failed: to be removed */
    void *in;  /* (T) I32 tokens on the first stage, else (T, d) F32; host */
    size_t in_cap;
    float *acc; /* (T, d): the hidden states of the chunks run so far */
    size_t acc_cap;
} queued_hop;

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
    atomic_uint_least64_t modelled_us; /* test hook: the compute model's sleeps, in all */
    /* the device's asynchronous error, once seen: every later piece of
     * work is refused with it */
    nl_status device_st; /* NL_OK while healthy */
    char device_err[NL_ERROR_MSG_MAX];

    /* the assignment */
    uint64_t epoch;
    bool assigned;      /* an ASSIGN was received (epoch is meaningful) */
    bool assign_failed; /* ... and refused: loads of its epoch are dropped */
    int stage_idx, num_stages;
    int replica, replicas; /* one of the stage's replicas on other nodes (1: alone) */
    /* a neighbour stage with another replica count (ASSIGN.prev_keys,
     * next_keys): its replicas' hops (fan_prev) or gradients (fan_next)
     * may come out of microbatch order; they wait for their turn */
    bool fan_prev, fan_next;
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
    /* the wire's precision (ASSIGN): what this stage sends its neighbours;
     * hops that came as bf16 are widened into win_h; wire_h holds the
     * bf16 copy of what is sent (the send copies it) */
    nl_wire_precision wire;
    float *win_h;
    size_t win_cap;
    uint16_t *wire_h;
    size_t wire_cap;

    /* optimizer moments that came with the weights (LAYER_LOAD of
     * optim.m.* and optim.v.*): host, n_params each, until a training job
     * takes them */
    float *mom_h[2];
    bool have_moments;

    /* the jobs by id, n_jobs of cap_jobs (node/stage_jobs.c): a training
     * job and fine-tuning jobs own their state there */
    struct stage_job *jobs;
    int n_jobs, cap_jobs;
    /* embedding requests waiting for their hop (node/stage_embed.c), and
     * the last stage's pooled output */
    struct stage_embed *emb;
    int n_emb;
    float *emb_out;
    size_t emb_out_cap;
    /* adapter files loaded for inference (stage_lora.c), shared by the
     * jobs and sessions that name them */
    struct stage_adapter *ad;
    int n_ad, cap_ad;

    /* the cases this node redoes for others' stages (stage_verify_worker.c), made
     * with the first VERIFY_CASE */
    struct verifier *verifier;

    /* sessions */
    session *sess;
    int n_sess, cap_sess;
    size_t kv_used;
    uint64_t tick;
    ended_ids evicted; /* to make room: their hops are errors that say so */
    ended_ids closed;  /* by JOB_CANCEL: their hops in flight are dropped */

    /* batched session hops (node/stage_batch.c) */
    nl_batch *batch;
    int batch_rows, batch_decode, prefill_chunk; /* rows per batch: decode rows + one chunk */
    uint64_t batch_seq;
    queued_hop *q;
    int n_q, cap_q;
    nl_stage_result *res; /* (cap_q) the last batch's results */
    int cap_res;
    nl_batch_seg *segs;  /* (batch_rows) */
    const float **seg_x; /* (batch_rows) their hidden-state inputs (a later stage) */
    int *seg_q;          /* (batch_rows) segment -> queue slot */
    /* (batch_rows each) the device sampling of a step's finished hops:
     * each segment's sampler (NULL: none on the device), its logits, the
     * sample_rows scratch, and its token (-1: sampled on the host) */
    nl_sampler **seg_smp;
    const float **seg_logits;
    nl_sample_row *seg_rows;
    int32_t *seg_tok;
    float *obuf; /* the last batch's hidden outputs (host), sent zero-copy */
    size_t obuf_cap;
    nl_stage_figures fig;
};

/* Close every session (the model goes, or its assignment failed)
 * (stage_session.c). */
void stage_sessions_clear(nl_stage *s);
/* The queue and the batch engine (stage_batch.c): dropped with the model;
 * a session's queued hops go with it. */
void stage_batch_free(nl_stage *s);
void stage_batch_drop_session(nl_stage *s, uint64_t id);

/* stage.c's helpers that stage_batch.c uses */
nl_status stage_check_hop(nl_stage *s, const nl_msg_tensor_hop *hop, const nl_wire_frame *in,
                          const char *who, int queued, int *B, int *T, session **se, nl_error *err);
nl_status stage_wait_output(nl_stage *s, const char *what, nl_error *err);
session *stage_find_session(const nl_stage *s, uint64_t id);
/* The last stage's answer for a session: sample its token from host
 * logits into o (TOKEN, with the log-probabilities it asks for), count it,
 * and say whether it is the last and whether to feed it back. */
void stage_sample(session *se, const float *logits, nl_stage_out *o);
/* The same after the token was sampled elsewhere (on the device; no
 * log-probabilities then): o gets it, counted, last and feed set. */
void stage_sampled(session *se, int32_t token, nl_stage_out *o);

/* ---- the stage's jobs (stage_jobs.c) ---- */

/* A kind of job on the stage: how one begins, which messages it takes,
 * how it runs one, ends and is freed. */
typedef struct stage_job_ops {
    int kind; /* nl_job_kind */
    const char *name;
    const char *status; /* the JOB_STATUS text once begun ("training") */
    /* JOB_SUBMIT of the kind: check it and begin the job; *job_id as soon
     * as it is read; *state: the job's, owned by the table, or NULL for a
     * kind whose jobs live in a store of their own (sessions, embedding
     * requests). */
    nl_status (*begin)(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id, void **state,
                       nl_error *err);
    /* Does the job take m? NULL: no message comes through the table. */
    bool (*holds)(const void *state, const nl_wire_msg *m);
    /* A message the job holds: the stage runs what it can; what it
     * produces goes out through send. */
    nl_status (*input)(nl_stage *s, void *state, const nl_wire_msg *m, nl_stage_send_fn send,
                       void *ctx, nl_error *err);
    /* JOB_CANCEL: the job ends (out of the table already). NULL: nothing
     * but free. */
    void (*end)(nl_stage *s, uint64_t job, void *state);
    /* Free the state (NULL-safe); also when the model goes. */
    void (*free)(nl_stage *s, void *state);
} stage_job_ops;

typedef struct stage_job {
    uint64_t id;
    const stage_job_ops *ops;
    void *state;
} stage_job;

/* The kinds: generate (stage_session.c), embed and forward with an
 * adapter (stage_embed.c), whose jobs live in those files' stores; train
 * (stage_train.c) and LoRA fine-tuning (stage_lora.c), whose jobs own
 * their state here. */
extern const stage_job_ops nl_stage_generate_ops, nl_stage_embed_ops, nl_stage_forward_ops,
    nl_stage_train_ops, nl_stage_lora_ops;

stage_job *stage_job_find(const nl_stage *s, uint64_t id);
/* The first job of a kind, or NULL; how many there are. */
stage_job *stage_job_first(const nl_stage *s, int kind);
int stage_job_count(const nl_stage *s, int kind);
/* A store dropped job id by itself (a session evicted, an embedding
 * request used): its entry goes (a job with state of its own stays). */
void stage_job_forget(nl_stage *s, uint64_t id);
/* End and free every job of a kind without a word (a new training job
 * replaces the last). */
void stage_job_drop_kind(nl_stage *s, int kind);
/* Free every job (the model goes). */
void stage_jobs_free_all(nl_stage *s);

/* ---- training and fine-tuning jobs (stage_train*.c, stage_lora.c) ---- */
struct stage_train;
struct nl_trainparams;
/* A training job's JOB_SUBMIT read by its schema (net/trainparams.h, the
 * stage uses) and checked against the stage: a model loaded, seq within
 * its max_seq_len. *job_id as soon as it is read. */
nl_status stage_train_params(nl_stage *s, const nl_msg_job_submit *j, struct nl_trainparams *p,
                             uint64_t *job_id, nl_error *err);
/* The state of a training job of parameters p (read from j, whose growth
 * history it reads), made on the stage's model; with adapters attached
 * to s->model its trainer steps them alone (stage_lora.c makes
 * fine-tuning jobs so). */
nl_status stage_train_make(nl_stage *s, const struct nl_trainparams *p, const nl_msg_job_submit *j,
                           struct stage_train **out, nl_error *err);
/* Free a training job's state (NULL-safe). */
void stage_train_free(struct stage_train *t);
/* A training message of job t (stage_train_takes says which). */
bool stage_train_takes(const nl_wire_msg *m);
nl_status stage_train_input(nl_stage *s, struct stage_train *t, const nl_wire_msg *m,
                            nl_stage_send_fn send, void *ctx, nl_error *err);

/* ---- adapters for inference (stage_lora.c) ---- */
/* The adapter file at path (a file under the node's --checkpoint-root)
 * loaded for this stage's layers; kept in a small cache by path and file
 * identity (device, inode, size, modification time), so that the jobs and
 * sessions naming one file share one copy. A reference: give it back with
 * stage_adapter_put. Never left attached to the model:
 * stage_adapter_use around a forward, then stage_adapter_attach
 * (s, NULL). */
nl_status stage_adapter_get(nl_stage *s, const char *path, struct nl_lora **lo, nl_error *err);
void stage_adapter_put(nl_stage *s, struct nl_lora *lo);
/* Attach lo (its adapters and its trained head, if any) to the stage's
 * model for the forwards that follow; NULL detaches (the base's head
 * back). */
void stage_adapter_attach(nl_stage *s, struct nl_lora *lo);
/* Attach lo (NULL: none) for a forward of rows rows, its scratch grown to
 * them first (the cache loads a file with scratch for one row). */
nl_status stage_adapter_use(nl_stage *s, struct nl_lora *lo, int rows, nl_error *err);
/* Free every cached adapter (the model goes; no references left). */
void stage_adapter_free_all(nl_stage *s);
/* A session's hop with an adapter, alone through the ordinary forward
 * (stage.c; core/model/batch.c applies no adapters): T positions of in (I32
 * tokens on the first stage, else (T, d) F32, host) at the end of the
 * session's cache. Not the last stage: the (T, d) hidden states into hid
 * (host); the last: o->token sampled, and o's kind, last, feed set. */
nl_status stage_forward_adapted(nl_stage *s, session *se, const void *in, int T, float *hid,
                                nl_stage_out *o, nl_error *err);
/* Wait until the replicas' threads have finished what they were given,
 * before other work uses replica 0's backend (stage_train.c). */
void stage_train_quiesce(nl_stage *s);
/* stage_verify_worker.c: free the verifier (what it keeps; the cases it was given
 * and did not answer are dropped). */
void stage_verifier_free(nl_stage *s);
/* stage_verify_worker.c: drop what the verifier keeps (nl_stage_verify_forget): a
 * new plan, the end of the node's training job. */
void stage_verify_forget(nl_stage *s);

/* The backend's sticky asynchronous error (nl_backend_check), remembered
 * once seen: "device D: MESSAGE" in err, else NL_OK with err untouched.
 * Called after the work a message caused; before it, work is refused with
 * nl_stage_device_status (which does not ask the backend). */
nl_status stage_check_device(nl_stage *s, nl_error *err);

/* ---- embedding jobs (stage_embed.c) ---- */
typedef struct stage_embed stage_embed;
/* The request of job, or NULL (a plain forward). */
const stage_embed *stage_embed_find(const nl_stage *s, uint64_t job);
/* Whether a hop of B x T fits the request. */
nl_status stage_embed_check(const stage_embed *r, int B, int T, nl_error *err);
/* Its pads' document ids (B, T), for an encoder's attention. */
const int32_t *stage_embed_doc(const stage_embed *r);
/* Its adapters (to attach for its forward only), or NULL. */
struct nl_lora *stage_embed_adapter(const stage_embed *r);
/* Whether the request pools (an embed job) or asks for the logits (a
 * forward job with an adapter, JOB_SUBMIT kind forward). */
bool stage_embed_pools(const stage_embed *r);
/* The last stage: pool the final-normed states (host, B x T x d) into
 * out as [B, d] vectors. */
nl_status stage_embed_pool(nl_stage *s, const stage_embed *r, const float *states,
                           nl_stage_out *out, nl_error *err);
/* Forget every request (the model goes). */
void stage_embed_free_all(nl_stage *s);

#endif
