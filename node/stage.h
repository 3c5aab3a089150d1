/* One pipeline stage of the neuronode daemon, without sockets: the model
 * of the layers it was assigned, their loading (streamed chunks or the
 * seed), the forward hop, and the generation sessions with their KV
 * caches (under a byte budget, least recently used evicted first) and,
 * on the last stage, their samplers.
 *
 * The daemon (node/node.c) feeds it decoded wire messages and sends what
 * it returns; every input is checked here and refused with a typed error
 * whose message names the job, session or tensor at fault.
 *
 * Ownership: nl_stage_new returns a stage freed with nl_stage_destroy(&s);
 * the backend is borrowed and must outlive it. The output of a forward
 * (nl_stage_out.data) belongs to the stage and stays valid until the next
 * forward or assignment: send it zero-copy with nl_txref_frame on
 * nl_stage_txref(s); the stage waits for that reference to be idle before
 * it overwrites or frees the buffer. */
#ifndef NL_NODE_STAGE_H
#define NL_NODE_STAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/model/model.h"
#include "kernels/comm.h"
#include "net/txref.h"
#include "net/wire.h"

typedef struct nl_stage nl_stage;

/* A test hook (test builds only: node/stage_train_lie.c): the stage
 * falsifies a fraction `rate` of its training outputs, drawn from seed. */
typedef enum nl_lie_kind {
    NL_LIE_NONE = 0,
    NL_LIE_BITFLIP,  /* one mantissa bit of a forward output */
    NL_LIE_NOISE,    /* uniform noise of 1e-3 on a forward output */
    NL_LIE_STALE,    /* the previous step's forward output */
    NL_LIE_SKIP,     /* its input instead of its output (skips its layers) */
    NL_LIE_BACKWARD, /* one bit of a gradient sent back; forwards honest */
    NL_LIE_VERIFIER, /* one bit of the digests it answers a VERIFY_CASE with; trains honestly */
    NL_LIE_MUTE      /* it trains honestly but never answers a VERIFY_REQ */
} nl_lie_kind;

typedef struct nl_stage_lie {
    nl_lie_kind kind;
    double rate; /* the fraction of outputs falsified, 0-1 */
    uint64_t seed;
    uint64_t from; /* the first training step it lies at (0: from the start) */
    bool generate; /* NL_TEST_LIE_GEN: it also lies in every generation hop it sends */
} nl_stage_lie;

/* The kind named s ("bitflip", "noise", "stale", "skip", "backward",
 * "verifier", "mute"), or -1. */
int nl_stage_lie_kind(const char *s);

typedef struct nl_stage_opts {
    uint64_t memory_bytes;   /* offered (--memory): weights + activations + KV budget */
    uint64_t kv_budget;      /* bytes for the KV caches of all sessions (--kv-budget) */
    int kv_cache;            /* their element type, an nl_kv_dtype (--kv-cache; 0: FP32) */
    int send_wait_ms;        /* longest wait for the last output to be sent; 0 = 10000 */
    const char *ckpt_root;   /* CKPT_REQ directories must lie under it; NULL: any absolute path */
    int64_t inject_nan_step; /* test hook: a NaN in the gradient of this 1-based step (0: never) */
    int inject_nan_stage;    /* ... on this stage only (-1: any) */
    int inject_nan_on;       /* ... and on every later step */
    int inject_no_compute;   /* test hook (NL_TEST_COMPUTE_GFLOPS): training hops skip the
                              * trainer's ops, their outputs and gradients zero (the stage
                              * sleeps for their time instead: a compute model) */
    double inject_compute_gflops; /* ... at this rate, when the work runs (stage_train_hops.c) */
    double inject_link_bytes_s;   /* test hook: the replicas' all-reduce is reported as having
                                   * run at this speed, bytes/s (stage_train_ring.c; 0: none) */
    nl_stage_lie lie;             /* test hook (test builds only): a stage that lies */
    int tf32;          /* the backend allows TF32 (--tf32): recorded in training shards */
    int batch_decode;  /* decode steps per batch; 0 = 32 */
    int prefill_chunk; /* prompt positions per batch; 0 = 64 */
    int batch_wait_ms; /* longest wait for the other active sessions; 0 = 20, < 0: none */
    /* data-parallel replicas (each computes on its own thread): */
    int train_async;     /* nl_stage_job_input returns once the work is dispatched; the
                          * results go out from nl_stage_train_poll (the daemon) */
    int replicas_inline; /* tests: the replicas run one after another on the caller's thread */
    /* the backend the cases this node redoes for others run on
     * (stage_verify.h), borrowed: on a worker thread at the lowest
     * priority; NULL: on replica 0's, on the caller's thread */
    nl_backend *verify_be;
} nl_stage_opts;

nl_status nl_stage_new(nl_stage **out, nl_backend *be, const nl_stage_opts *o, nl_error *err);
/* A stage over n data-parallel replicas (a node with several devices):
 * be[0..n-1] borrowed, all able to hold the whole stage. Replica 0 holds
 * the model and serves loading, inference and checkpoints; a training job
 * copies the weights onto every other replica, gives microbatch i of each
 * step to replica i % n, all-reduces the gradients before their norm, and
 * applies the same AdamW on every replica, which so stay equal. comm is the
 * communicator over be (borrowed; it must outlive the stage), or NULL: the
 * stage makes its own (NL_COMM_AUTO: NCCL between GPUs, else through the
 * host) when n > 1. The memory check of a job is per replica (each needs
 * --memory). n = 1 is nl_stage_new. */
nl_status nl_stage_new_replicas(nl_stage **out, nl_backend *const *be, int n, nl_comm *comm,
                                const nl_stage_opts *o, nl_error *err);
void nl_stage_destroy(nl_stage **sp);

/* ---- assignment and loading ---- */

/* Drop the previous model and sessions and build the stage's (zeroed)
 * model from ASSIGN: config_json parsed and validated, layers [layer0,
 * layer1), embedding and head as flagged. Waits (send_wait_ms) for the
 * last output to be sent first. On failure the stage is left without a
 * model (state IDLE) and the chunks of this epoch are dropped. */
nl_status nl_stage_assign(nl_stage *s, const nl_msg_assign *a, nl_error *err);

/* One LAYER_LOAD chunk (frame: F32, 1-D). The name must be one of the
 * stage's tensors with exactly the message's shape, and the chunk must lie
 * inside it. A chunk of an older epoch is ignored: NL_OK with *stale set. */
nl_status nl_stage_load_chunk(nl_stage *s, const nl_msg_layer_load *l, const nl_wire_frame *f,
                              bool *stale, nl_error *err);

typedef struct nl_stage_loaded {
    uint32_t tensors; /* tensors in place (the stage's whole table) */
    uint64_t bytes;   /* parameter bytes */
    double seconds;   /* since the ASSIGN */
    bool from_seed;   /* initialised from ASSIGN's seed (tensors = 0 asked) */
} nl_stage_loaded;

/* LOAD_DONE {epoch, tensors}: tensors = 0 initialises every parameter from
 * ASSIGN's seed (nl_model_init_random); tensors > 0 requires every tensor
 * of the stage to be complete (the error names the first that is not) and
 * that count to be tensors. Success makes the stage READY. An older epoch
 * is ignored (*stale). */
nl_status nl_stage_load_done(nl_stage *s, uint64_t epoch, uint32_t tensors, nl_stage_loaded *info,
                             bool *stale, nl_error *err);

/* ---- generation sessions ---- */

typedef struct nl_stage_session_params {
    uint64_t id;  /* the generation job's id */
    int capacity; /* positions, 1..max_seq_len */
    float temperature, top_p;
    uint64_t seed;
    int limit; /* 0..capacity tokens the last stage feeds back itself (the
                * token ring); 0: whoever opened the session feeds them */
    /* params.adapter (borrowed from the request), or NULL: a LoRA adapter
     * file under the node's --checkpoint-root that every forward of the
     * session applies; such a session's hops run alone, not in the batch */
    const char *adapter;
    int logprobs; /* 0: none; 1 + k: each token's log-probability and the top k ids' */
} nl_stage_session_params;

/* Read a JOB_SUBMIT {kind generate, params session, capacity, temperature,
 * top_p, seed, limit[, adapter]} by the schema the coordinator uses too
 * (net/genparams.h): session and capacity are required, temperature
 * defaults to 0.8, top_p to 0.95, seed and limit to 0; a value of the
 * wrong type or out of range is NL_ERR_RANGE naming its key; other keys
 * are ignored. p->id is set as soon as it is read (for the error reply). */
nl_status nl_stage_parse_session(const nl_msg_job_submit *j, nl_stage_session_params *p,
                                 nl_error *err);

/* Open a session: a KV cache for one sequence of p->capacity positions,
 * accounted against the budget (least recently used sessions are evicted
 * until it fits; one that cannot fit alone is refused with
 * NL_ERR_CAPACITY), and on the last stage a sampler. An open session of
 * the same id is replaced. Needs a READY stage. */
nl_status nl_stage_open_session(nl_stage *s, const nl_stage_session_params *p, nl_error *err);
/* Drop a session (JOB_CANCEL); its id is remembered as closed. Returns
 * false if it was not open. */
bool nl_stage_close_session(nl_stage *s, uint64_t id);

typedef struct nl_stage_session_info {
    int capacity, len; /* cache positions: capacity and filled */
    size_t bytes;      /* KV cache bytes charged to the budget */
    bool has_sampler;  /* the last stage's */
    double prefill_s;  /* seconds in forwards of several positions */
    int steps;         /* forwards of one position (decode steps) */
    double step_s;     /* ... and their seconds: compute, sampling included */
} nl_stage_session_info;

/* Is the session open? Fills info (may be NULL). */
bool nl_stage_session(const nl_stage *s, uint64_t id, nl_stage_session_info *info);
/* Was the session evicted to make room (and not opened again since)? */
bool nl_stage_session_evicted(const nl_stage *s, uint64_t id);
/* Was it closed (and not opened again since)? A hop of a closed session
 * was in flight when its job ended: stale, to be dropped. */
bool nl_stage_session_closed(const nl_stage *s, uint64_t id);
int nl_stage_session_count(const nl_stage *s);
/* What the plans may fill: the memory offered less the KV budget (the
 * node's JOIN reports it; an ASSIGN or a training job beyond it is
 * refused). */
uint64_t nl_stage_plan_memory(const nl_stage *s);
size_t nl_stage_kv_used(const nl_stage *s);

/* ---- the forward hop ---- */

typedef enum nl_stage_out_kind {
    NL_STAGE_OUT_HIDDEN = 0, /* hidden states for the next stage: F32 [B, T, d] */
    NL_STAGE_OUT_LOGITS,     /* last stage, no session: F32 [B, T, vocab_size] (embed: [B, d]) */
    NL_STAGE_OUT_TOKEN       /* last stage, a session: the sampled id */
} nl_stage_out_kind;

typedef struct nl_stage_out {
    nl_stage_out_kind kind;
    float *data; /* HIDDEN, LOGITS: host memory owned by the stage */
    int ndim;
    int64_t shape[3];
    double aux;    /* the hop's aux plus this stage's load-balancing loss */
    int32_t token; /* TOKEN */
    bool last;     /* TOKEN: the session's limit-th token */
    bool feed;     /* TOKEN: send it to the first stage as ACTIVATION {session,
                    * pos_offset feed_pos} (the session has a limit, this is
                    * not the last token, and the cache has room) */
    int64_t feed_pos;
    int B, T; /* the batch that ran */
    /* TOKEN of a session that asks for logprobs (lp_n = 1 + k, else 0):
     * lp[0] the token's log-probability, lp[1 + i] that of lp_ids[i], the
     * i-th most likely id (core/model/sampler.h, nl_sampler_logprobs) */
    int lp_n;
    float lp[1 + NL_WIRE_MAX_TOP];
    uint32_t lp_ids[NL_WIRE_MAX_TOP];
} nl_stage_out;

/* A generation hop's output o (n hidden values, or a token) falsified
 * when s->o.lie.generate says so (a test hook, node/stage_train_lie.c; a
 * no-op in a build without the hooks). */
void nl_stage_gen_lie(const nl_stage *s, nl_stage_out *o, size_t n);

/* Run ACTIVATION {job_id, session_id, pos_offset, aux} + frame 0 (I32
 * tokens [B, T] on the first stage, else F32 hidden states [B, T, d])
 * through the stage. session_id 0 is a forward job without a cache
 * (pos_offset 0); any other id must be an open session with B = 1 and
 * pos_offset equal to its cache length. Training hops (step or
 * microbatch != 0) are refused: they go to nl_stage_job_input. */
nl_status nl_stage_forward(nl_stage *s, const nl_msg_tensor_hop *hop, const nl_wire_frame *in,
                           nl_stage_out *out, nl_error *err);

/* ---- batched session hops (node/stage_batch.c) ----
 *
 * The daemon queues every hop of a session as it arrives and, when it has
 * read what is waiting on its sockets, runs one batch: the decode steps
 * (one position) of up to batch_decode sessions, each with its own cache
 * and position, plus at most prefill_chunk positions of prompts, so that
 * a new prompt delays the others by at most one chunk (core/model/batch.h: a
 * sequence's results do not depend on its batch). A prompt longer than
 * the chunk runs over several batches; its output (hidden states of every
 * position, or the sampled token) comes when its last chunk has run. */

/* Check a session's ACTIVATION hop as nl_stage_forward does (its
 * pos_offset follows the session's cache and the hops queued before it)
 * and queue a copy of frame 0. */
nl_status nl_stage_enqueue(nl_stage *s, const nl_msg_tensor_hop *hop, const nl_wire_frame *in,
                           nl_error *err);
int nl_stage_queued(const nl_stage *s);

/* One hop's outcome in a batch. */
typedef struct nl_stage_result {
    uint64_t job_id, session_id, pos_offset; /* the hop's */
    nl_status st;                            /* NL_OK: out is its output */
    char msg[NL_ERROR_MSG_MAX];              /* else why it failed */
    nl_stage_out out;                        /* as nl_stage_forward's */
} nl_stage_result;

/* Run one batch of the queued hops. *res (owned by the stage, n of them)
 * holds the hops that finished or failed; their outputs stay valid, under
 * nl_stage_txref, until the next batch, forward or assignment. A hop of a
 * closed session is dropped; one whose session was evicted fails. The
 * return is the device's error (every hop of the batch fails with it). */
nl_status nl_stage_run_batch(nl_stage *s, const nl_stage_result **res, int *n, nl_error *err);

/* When to run the queue: seconds from now (0: now; -1: nothing queued).
 * Now when every active session (one with a hop here in the last 2 s)
 * has a hop queued, or NL_BATCH_MIN_ROWS sessions have (16 rows: a
 * batch big enough to run at once), or none of the others is expected
 * back before the oldest queued hop has waited batch_wait_ms (a
 * session's next hop is expected one period of its ring after its last);
 * else when the last of those expected arrives, at most batch_wait_ms
 * after the oldest hop. A session still on another stage is waited for a
 * little, so that the sessions travel the ring in few, full batches
 * rather than in many small ones that each read all of the stage's
 * weights (a decode step is bound by reading them); one that cannot be
 * back in time is not. */
double nl_stage_batch_due(const nl_stage *s);

/* What the stage has done for sessions, and its replicas' all-reduces,
 * since it was made (heartbeats carry it: docs/protocol.md). */
typedef struct nl_stage_figures {
    uint64_t hops;         /* session hops that finished here */
    uint64_t batches;      /* batches run */
    uint64_t rows;         /* positions computed in them */
    double compute_s;      /* seconds in batched forwards */
    double hop_s;          /* seconds from a hop's arrival to its output, summed over hops */
    uint64_t reduce_bytes; /* the replicas' gradient all-reduces: 2 (R - 1) / R of their bytes */
    double reduce_s;       /* ... and the seconds from the last backward to the sum */
} nl_stage_figures;
void nl_stage_get_figures(const nl_stage *s, nl_stage_figures *f);

/* The reference that guards the forward's output buffer. */
nl_txref *nl_stage_txref(nl_stage *s);

/* ---- the wire's precision (ASSIGN's wire; DESIGN.md section 8) ---- */

/* What this stage sends its neighbours: FP32 or bf16. */
nl_wire_precision nl_stage_wire(const nl_stage *s);

/* Test hook (NL_TEST_COMPUTE_GFLOPS): the seconds the compute model has
 * slept for training work on this stage, in all (the node counts them as
 * busy time). */
double nl_stage_modelled_s(nl_stage *s);
/* n hidden-state values of a frame (F32 or BF16: checked by the caller)
 * as FP32: the frame's bytes, or the stage's buffer that a bf16 frame was
 * widened into (valid until the next call). NULL: out of memory. */
const float *nl_stage_hidden_in(nl_stage *s, const nl_wire_frame *in, size_t n);
/* Describe FP32 hidden states x as frame f in the stage's wire precision
 * (a bf16 copy in the stage's buffer, valid until the next call; the send
 * copies it). */
nl_status nl_stage_hidden_out(nl_stage *s, nl_wire_frame *f, const float *x, const int64_t *shape,
                              int ndim, nl_error *err);

/* ---- embedding jobs (node/stage_embed.c) ---- */

/* JOB_SUBMIT {kind embed, params: job, batch, seq, lengths ("3,17,1": each
 * text's valid positions, core/model/embed.h)}: the next forward hop of the job
 * (B x T as given) keeps each text's pads out of an encoder's attention,
 * and on the last stage returns the pooled, L2-normalised final-normed
 * states, F32 [B, d], in place of logits. The request is used by that one
 * hop; nl_stage_embed_end forgets it before (false: no such request).
 * Optional params.adapter: a LoRA adapter file under the node's
 * --checkpoint-root; its tensors of this stage's layers apply to the hop. */
nl_status nl_stage_embed_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id,
                               nl_error *err);
bool nl_stage_embed_end(nl_stage *s, uint64_t job);

/* ---- training (node/stage_train.c) ---- */

/* Where a message a training job produced goes: the next stage (hops),
 * the previous stage (GRADIENT), or the coordinator (GRAD_NORM, LOSS,
 * CKPT_DONE). The callee sends it; frames without free_fn are copied. */
typedef enum nl_stage_dest {
    NL_STAGE_TO_NEXT,
    NL_STAGE_TO_PREV,
    NL_STAGE_TO_COORD,
    NL_STAGE_TO_RING /* the stage's next replica on another node (REDUCE) */
} nl_stage_dest;
typedef nl_status (*nl_stage_send_fn)(void *ctx, nl_stage_dest to, nl_wire_msg *m, nl_error *err);

/* ---- jobs (node/stage_jobs.c; training: stage_train.c, stage_lora.c) ---- */

/* JOB_SUBMIT of any kind a node runs, found in the stage's table of kinds;
 * the job joins the stage's jobs by id. *job_id is set as soon as it is
 * read (0: the request named none); *status (may be NULL) becomes the
 * JOB_STATUS text of a job begun ("training").
 *  - generate: a session (nl_stage_parse_session, nl_stage_open_session).
 *  - embed, forward with an adapter: a request for the next hop
 *    (nl_stage_embed_begin).
 *  - train {params: job, micro_batch, seq, microbatches, recompute,
 *    start_step (steps already applied), adam_steps, moments (take the
 *    optimizer moments that came with the weights), eval_hops (hops of
 *    one evaluation)}: make the job's trainer, replacing any earlier
 *    training job. The stage keeps the activations of min(stages from
 *    here to the last, microbatches) microbatches (1F1B); the memory
 *    model must fit --memory.
 *  - finetune: the same params plus lora_rank, lora_alpha, lora_targets
 *    ("wq,wk,wv,wo" and the experts' "w_gate,w_up,w_down") and lora_seed:
 *    a LoRA fine-tuning job (node/stage_lora.c) with adapters and a
 *    trainer of its own on the frozen weights; several may run at once,
 *    but none beside a training job.
 * Both training kinds' params are read by net/trainparams.h (its stage
 * uses). */
nl_status nl_stage_job_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id,
                             const char **status, nl_error *err);

/* JOB_CANCEL (or a training job's end): the job ends and is freed (a
 * session closed, a trainer freed). Returns its kind (nl_job_kind), or -1
 * when the stage has no such job. */
int nl_stage_job_end(nl_stage *s, uint64_t job);

/* A message of a training or fine-tuning job: COUNT, ACTIVATION (step >=
 * 1) and EVAL hops (checked, queued, run in order when their step and a
 * free activation slot allow), GRADIENT (the backward of the oldest
 * microbatch in flight), STEP (AdamW with the coordinator's learning rate
 * and clipping scale, or a skip) and CKPT_REQ (this stage's shard written
 * atomically to DIR/stage-<i>.safetensors, answered with CKPT_DONE and
 * its SHA-256). What the stage produces goes out through send before this
 * returns: hops on, gradients back, GRAD_NORM (and on the last stage
 * LOSS) when a step's gradients are all in. */
nl_status nl_stage_job_input(nl_stage *s, const nl_wire_msg *m, nl_stage_send_fn send, void *ctx,
                             nl_error *err);
/* Does one of the stage's jobs take the message (one nl_stage_job_input
 * takes)? One that none does was in flight when its job ended or was
 * cancelled: stale, to be dropped. */
bool nl_stage_job_holds(const nl_stage *s, const nl_wire_msg *m);
/* The job a training message is of. */
uint64_t nl_stage_job_of(const nl_wire_msg *m);

/* With train_async and several replicas: a descriptor that becomes
 * readable when a replica of the training job finished a piece of work,
 * for the daemon's poll (-1 when there is none: no job, one replica, or
 * not async). Then nl_stage_train_poll sends what finished in the order
 * nl_stage_job_input would have and runs what became runnable; its error
 * is the job's. */
int nl_stage_train_fd(const nl_stage *s);
nl_status nl_stage_train_poll(nl_stage *s, nl_stage_send_fn send, void *ctx, nl_error *err);

/* Whether a training job (not a fine-tuning one) runs, and its id. */
bool nl_stage_train_running(const nl_stage *s, uint64_t *job_id);

/* ---- state ---- */

/* The device's asynchronous error, once the stage has seen one after a
 * forward, a training message or a load: its status, and in err "device
 * cuda:0: ..."; NL_OK (err untouched) while the device is healthy. A
 * stage whose device failed refuses all further work with that error:
 * the daemon fails the job and leaves. */
nl_status nl_stage_device_status(const nl_stage *s, nl_error *err);

nl_node_state nl_stage_state(const nl_stage *s); /* IDLE, LOADING or READY */
uint64_t nl_stage_epoch(const nl_stage *s);
const nl_model *nl_stage_model(const nl_stage *s); /* NULL before an ASSIGN */
/* Most rows (B x T) one forward may take: from --memory minus the weights
 * and the KV budget, and at least one sequence of max_seq_len. */
int nl_stage_max_rows(const nl_stage *s);

#endif
