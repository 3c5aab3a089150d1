/* The wire codec: the message model and pure encode/decode functions.
 *
 * Every message is a ZeroMQ multipart: one msgpack header, then zero or
 * more raw little-endian tensor frames. The header is a msgpack map whose
 * first two entries are "v" (protocol version) and "t" (message type); the
 * other keys are the type's fields (docs/protocol.md lists them all), plus
 * "tensors", one [dtype, [dims...]] descriptor per frame, for types that
 * carry frames.
 *
 * Decoding never trusts a length: a first bounded pass walks the header
 * bytes and enforces the limits (header size, nesting, string, array and
 * map lengths) before anything is allocated; a second pass decodes the
 * fields against the type's schema (type, range, duplicates, missing and
 * unknown keys) and checks every frame against its descriptor
 * (numel * dtype size == frame length, without overflow).
 *
 * Ownership of a decoded message:
 *  - strings, token lists and job parameters live in the message's own
 *    arena and stay valid until the next decode into the same message, or
 *    nl_wire_msg_free;
 *  - frames[i].t.data points into the caller's parts: it stays valid only
 *    while the caller keeps those bytes (for nl_rx, until the next receive
 *    or nl_rx_free).
 * For encoding, the caller fills the fields (strings may be NULL = "") and
 * the frames; the header is written into an nl_wire_wbuf; frames are not
 * copied by the codec. */
#ifndef NL_WIRE_H
#define NL_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "core/model/tensor.h"

#define NL_WIRE_VERSION 1u
#define NL_WIRE_MAX_FRAMES 16 /* hard cap; limits.max_frames may be lower */
#define NL_WIRE_MAX_DEPTH 16  /* hard cap on limits.max_depth */
#define NL_KEY_Z85_LEN 40     /* a CURVE public key in Z85 */

/* Message type codes. The numbers are part of the protocol: never reuse
 * one. HELLO and ERROR keep their layout in every protocol version so that
 * a peer can always say "wrong version". */
typedef enum nl_msg_type {
    NL_MSG_NONE = 0,
    NL_MSG_HELLO = 1,
    NL_MSG_HELLO_ACK = 2,
    NL_MSG_ERROR = 3,
    NL_MSG_JOIN = 10,
    NL_MSG_ACCEPT = 11,
    NL_MSG_HEARTBEAT = 12,
    NL_MSG_LEAVE = 13,
    NL_MSG_ASSIGN = 20,
    NL_MSG_LAYER_LOAD = 21,
    NL_MSG_LOAD_DONE = 22,
    NL_MSG_ACTIVATION = 30,
    NL_MSG_GRADIENT = 31,
    NL_MSG_TOKEN = 32,
    NL_MSG_RESULT = 33,
    NL_MSG_COUNT = 34, /* training: the forward-only expert-counting pass */
    NL_MSG_EVAL = 35,  /* training: a held-out forward (loss only) */
    NL_MSG_JOB_SUBMIT = 40,
    NL_MSG_JOB_STATUS = 41,
    NL_MSG_JOB_CANCEL = 42,
    NL_MSG_JOB_QUERY = 43,
    NL_MSG_GRAD_NORM = 50,
    NL_MSG_STEP = 51,
    NL_MSG_CKPT_REQ = 52,
    NL_MSG_CKPT_DONE = 53,
    NL_MSG_LOSS = 54,
    NL_MSG_VERIFY_REQ = 55,    /* verification by recompute: coord -> the stage checked */
    NL_MSG_VERIFY_CASE = 56,   /* its case: stage -> coord -> verifier */
    NL_MSG_VERIFY_RESULT = 57, /* the verifier's digests: verifier -> coord */
    NL_MSG_REDUCE = 58,        /* a stage's replicas: a chunk of their all-reduce */
    NL_MSG_LOCAL_LINK = 59,    /* neighbour stages on one host: the local link's handshake */
    NL_MSG_TYPE_MAX = 64       /* codes are below this */
} nl_msg_type;

typedef enum nl_role { NL_ROLE_COORDINATOR = 1, NL_ROLE_NODE = 2, NL_ROLE_CLIENT = 3 } nl_role;

typedef enum nl_node_state {
    NL_NODE_IDLE = 0,
    NL_NODE_LOADING,
    NL_NODE_READY,
    NL_NODE_BUSY,
    NL_NODE_DRAINING,
    NL_NODE_FAILED
} nl_node_state;

/* NL_JOB_FINETUNE: LoRA adapters trained through the frozen pipeline
 * (docs/cluster.md, "LoRA fine-tuning"); NL_JOB_EMBED: pooled embeddings
 * of token ids ("Embeddings") */
/* NL_JOB_GROW: a client asks the coordinator to grow the cluster's model
 * (coordinator/coord_grow.c); no node ever sees it. */
typedef enum nl_job_kind {
    NL_JOB_FORWARD = 0,
    NL_JOB_GENERATE,
    NL_JOB_TRAIN,
    NL_JOB_FINETUNE,
    NL_JOB_EMBED,
    NL_JOB_GROW
} nl_job_kind;

typedef enum nl_job_state {
    NL_JOB_QUEUED = 0,
    NL_JOB_RUNNING,
    NL_JOB_DONE,
    NL_JOB_FAILED,
    NL_JOB_CANCELLED
} nl_job_state;

/* ---- per-type fields (strings are NUL-terminated UTF-8) ---- */

typedef struct nl_msg_hello {
    uint32_t role;        /* nl_role */
    const char *software; /* e.g. "neurollm 0.1.0", <= 64 bytes */
} nl_msg_hello;           /* HELLO and HELLO_ACK */

typedef struct nl_msg_error {
    uint32_t code;       /* an nl_status value (1..999) */
    uint32_t req_type;   /* type of the request it answers, 0 if unknown */
    const char *message; /* <= 1024 bytes */
} nl_msg_error;

typedef struct nl_msg_join {
    const char *pubkey; /* the node's CURVE public key, Z85 */
    const char *device; /* "cpu" or "cuda:N" */
    uint64_t memory_bytes;
    double gemm_gflops;
    uint32_t threads;
    const char *data_endpoint; /* tcp://host:port (or ipc://) */
    uint32_t flags;            /* nl_join_flag bits (optional: 0) */
} nl_msg_join;

/* JOIN.flags. NO_INBOUND: nothing can connect to this node (behind NAT or
 * a firewall, `neuronode join --no-inbound`): its neighbours reach it over
 * connections it opens (ASSIGN.links). */
typedef enum nl_join_flag { NL_JOIN_NO_INBOUND = 1u << 0 } nl_join_flag;
#define NL_JOIN_FLAGS_ALL 1u

typedef struct nl_msg_accept {
    uint32_t node_id;
    uint32_t heartbeat_ms;
    uint32_t timeout_ms;
} nl_msg_accept;

typedef struct nl_msg_heartbeat {
    uint32_t node_id;
    uint64_t seq;
    uint32_t state; /* nl_node_state */
    double load;    /* 0 = idle; busy fraction, >= 0 */
    /* optional (0 when absent): the stage's sessions, and what its
     * batched session hops cost since the node started (counters) */
    uint64_t kv_bytes; /* KV cache bytes in use */
    uint32_t sessions; /* open sessions */
    uint64_t hops;     /* session hops finished */
    uint64_t batches;  /* batches run */
    double compute_s;  /* seconds computing them */
    double hop_s;      /* seconds from a hop's arrival to its output, summed */
    /* optional (0 when absent; counters since the node started): its
     * replicas' gradient all-reduces, as the planner's cost model counts
     * them (2 (R - 1) / R times the gradients' bytes each), and the
     * seconds from its last backward to their sum; their ratio is the link
     * speed the coordinator plans with (docs/cluster.md, "The link speed is
     * measured") */
    uint64_t reduce_bytes;
    double reduce_s;
} nl_msg_heartbeat;

typedef struct nl_msg_leave {
    uint32_t node_id;
    const char *reason;
} nl_msg_leave;

typedef struct nl_msg_assign {
    uint64_t epoch; /* placement generation; later ones replace earlier */
    uint32_t node_id;
    uint32_t stage, num_stages; /* stage < num_stages */
    uint32_t layer0, layer1;    /* layers [layer0, layer1) */
    bool has_embed, has_head;
    const char *config_json; /* the model config, <= 48 KiB */
    uint64_t seed;
    const char *prev_endpoint, *prev_key; /* both "" for none */
    const char *next_endpoint, *next_key;
    uint64_t memory_planned;
    uint32_t wire;  /* nl_wire_precision of the hops this stage sends (optional: 0) */
    uint32_t links; /* nl_link bits: which side opens each neighbour's connection (optional: 0) */
    uint32_t relay_port; /* with a RELAY link: the coordinator's relay, on the host the node
                          * dialed for control (optional: 0) */
    /* DESIGN section 8: replica `replica` of the stage's `replicas` (both
     * optional: 0 reads as one replica). Its prev and next are the same
     * replica of the neighbouring stages; ring_*: the stage's next replica
     * (its data endpoint and key, where REDUCE goes) and the key of the
     * one before it (admitted on this node's data socket). NULL or "": none. */
    uint32_t replica, replicas;
    const char *ring_endpoint, *ring_key, *ring_prev_key;
    /* A neighbour stage with another replica count than this one (DESIGN
     * section 8: microbatch i runs on replica i mod R_s of stage s): its
     * replicas in replica order, comma-separated (optional; NULL or "":
     * the one neighbour above, replica `replica` of it, or of a stage
     * with as many replicas). prev_keys: the previous stage's keys (its
     * hops of microbatch i come from replica i mod their number, whose
     * gradient goes back there; the data socket admits them all).
     * next_endpoints and next_keys: the next stage's (microbatch i goes to
     * replica i mod their number; an evaluation, inference and tokens to
     * replica 0). prev_key / next_key stay set (to one of them). Only with
     * links 0: a stage behind NAT takes a neighbour with as many replicas. */
    const char *prev_keys, *next_endpoints, *next_keys;
} nl_msg_assign;

/* The lists of nl_msg_assign: at most NL_REDUCE_MAX_REPLICAS items of
 * fewer than NL_WIRE_PEER_ITEM bytes. nl_wire_peer_list splits one into
 * items (NULL: count only): the count (0 for NULL or ""), or -1 for an
 * empty item, one too long, or more than max. */
#define NL_WIRE_PEER_ITEM 257
#define NL_WIRE_PEER_KEYS_MAX (16 * (NL_KEY_Z85_LEN + 1))
#define NL_WIRE_PEER_EPS_MAX (16 * NL_WIRE_PEER_ITEM)
int nl_wire_peer_list(const char *list, char items[][NL_WIRE_PEER_ITEM], int max);

/* ASSIGN.links: who opens the connection between two neighbours. By
 * default a stage connects to the next stage's data endpoint. Where the
 * next stage accepts no inbound connections (JOIN.flags NO_INBOUND), the
 * roles of the connection flip and nothing else does: the next stage
 * dials this stage's data endpoint, both keep their CURVE roles (the
 * receiver of activations is the server, pinned by its key; it admits the
 * sender's key only), and the messages go the same way as before.
 *  - DIAL_PREV: this stage dials the previous stage's data endpoint
 *    (prev_endpoint, CURVE server prev_key) and takes its hops from there;
 *  - NEXT_DIALS: the next stage dials this stage's data socket, which
 *    admits next_key as well, and takes this stage's hops from it.
 * Where neither neighbour accepts inbound connections, both dial the
 * coordinator's relay (relay_port, on the host the node dialed for
 * control; CURVE server with the coordinator's key), which passes the
 * messages between them:
 *  - RELAY_PREV: this stage dials the relay for its previous stage's hops
 *    (routing id: its public key and ":p");
 *  - RELAY_NEXT: this stage's next socket dials the relay instead of the
 *    next stage (routing id: its public key and ":n"). */
typedef enum nl_link {
    NL_LINK_DIAL_PREV = 1u << 0,
    NL_LINK_NEXT_DIALS = 1u << 1,
    NL_LINK_RELAY_PREV = 1u << 2,
    NL_LINK_RELAY_NEXT = 1u << 3
} nl_link;
#define NL_LINKS_ALL 15u

typedef struct nl_msg_layer_load { /* + one 1-D frame: a chunk of the tensor */
    uint64_t epoch;
    const char *name;
    int ndim; /* the full tensor's shape */
    int64_t shape[NL_MAX_DIMS];
    uint64_t offset; /* first element of this chunk in the full tensor */
    uint32_t chunk, chunks;
} nl_msg_layer_load;

typedef struct nl_msg_load_done {
    uint64_t epoch;
    uint32_t node_id;
    uint32_t tensors;
    uint64_t bytes;
} nl_msg_load_done;

/* ACTIVATION: frame 0 is the hidden state (float, e.g. [B, T, d]) or, into
 * the first stage, token ids (I32 [B, T]); an optional frame 1 carries
 * I32 targets [B, T] along the pipeline to the last stage. GRADIENT: one
 * float frame, the gradient of the hidden state. COUNT and EVAL are the
 * training job's other forward passes and carry frames as ACTIVATION.
 * In a training job `step` is the 1-based step the hop belongs to.
 *
 * The training objectives (docs/protocol.md, "Training hops"): ACTIVATION,
 * COUNT and EVAL may say in `extras` (u.train_hop) which I32 frames follow frame 0, in
 * the order of the bits: targets [B, T], document ids [B, T] (packed rows,
 * classification's padding), labels [B] and valid lengths [B]
 * (classification); extras 0 is the older form, where a frame 1 is the
 * targets. `loss_rows` is the number of predictions the step's mean loss
 * is over (masked positions, or sequences); 0: every position. Both are
 * optional on the wire (absent: 0). */
enum {
    NL_HOP_TARGETS = 1u << 0,
    NL_HOP_DOCS = 1u << 1,
    NL_HOP_LABELS = 1u << 2,
    NL_HOP_LENGTHS = 1u << 3,
    NL_HOP_ALL = 15u
};
typedef struct nl_msg_tensor_hop { /* ACTIVATION, GRADIENT, RESULT, COUNT, EVAL */
    uint64_t job_id, step;
    uint32_t microbatch;
    uint64_t session_id;
    uint64_t pos_offset;
    double aux; /* load-balancing loss summed over the stages so far */
} nl_msg_tensor_hop;

/* ACTIVATION, COUNT and EVAL as a training job sends them: the hop (which
 * u.hop reads as well: it is the first member) and the objectives' fields.
 * Set them after nl_wire_msg_reset (assigning u.hop leaves them alone). */
typedef struct nl_msg_train_hop {
    nl_msg_tensor_hop hop;
    uint32_t extras;    /* NL_HOP_* frames after frame 0 */
    uint64_t loss_rows; /* the step's predictions, or 0 */
    /* the hop's digest (net/hopdigest.h): 64 lowercase hex digits, or
     * NULL / "" (an older peer). GRADIENT has it too (u.train_hop.digest),
     * but neither extras nor loss_rows. */
    const char *digest;
    /* the placement (ASSIGN epoch) the sender computes in; 0 (absent, an
     * older peer): taken as the receiver's own. A stage drops a hop of
     * another epoch: it was in flight when a re-plan restarted the job
     * (GRADIENT has it too). */
    uint64_t epoch;
} nl_msg_train_hop;

/* A generation's tokens. With logprobs asked for (params.logprobs), a
 * TOKEN of one token carries `top_ids` (0..20 ids, optional) and one F32
 * frame [1 + ntop]: the token's log-probability, then the top ids'. */
typedef struct nl_msg_token {
    uint64_t job_id, session_id;
    uint32_t ntokens; /* <= 4096 */
    const uint32_t *tokens;
    bool done;
    uint32_t ntop; /* <= NL_WIRE_MAX_TOP */
    const uint32_t *top_ids;
} nl_msg_token;
#define NL_WIRE_MAX_TOP 20

typedef enum nl_wire_param_kind {
    NL_WIRE_PARAM_INT = 0,
    NL_WIRE_PARAM_FLOAT,
    NL_WIRE_PARAM_STR,
    NL_WIRE_PARAM_BOOL
} nl_wire_param_kind;

typedef struct nl_wire_param {
    const char *key; /* [a-z0-9_.-], 1..64 bytes, unique */
    nl_wire_param_kind kind;
    int64_t i;
    double f;
    const char *s;
    bool b;
} nl_wire_param;

typedef struct nl_msg_job_submit { /* + 0..4 frames, e.g. I32 tokens */
    uint32_t kind;                 /* nl_job_kind */
    uint32_t nparams;              /* <= 64 */
    const nl_wire_param *params;
} nl_msg_job_submit;

typedef struct nl_msg_job_status {
    uint64_t job_id;
    uint32_t state;  /* nl_job_state */
    double progress; /* 0..1 */
    const char *message;
    /* a node's failure (FAILED): the message it could not run (an
     * nl_msg_type, e.g. CKPT_REQ), 0 where unknown; absent: 0 */
    uint32_t req_type;
} nl_msg_job_status;

typedef struct nl_msg_job_ref { /* JOB_CANCEL, JOB_QUERY (0 = all jobs) */
    uint64_t job_id;
} nl_msg_job_ref;

/* GRAD_NORM + an optional U8 frame [M, 4, 32]: the digests of the step's
 * hops on this stage (NL_DIGEST_* order per microbatch; all zero: no such
 * hop), docs/protocol.md, "Hop digests". */
typedef struct nl_msg_grad_norm {
    uint64_t job_id, step;
    uint32_t stage;
    double sumsq; /* this stage's partial sum of squared gradients */
} nl_msg_grad_norm;

/* The four digests a stage keeps of each microbatch of a step. */
enum {
    NL_DIGEST_FWD_IN = 0, /* the ACTIVATION it received */
    NL_DIGEST_FWD_OUT,    /* the ACTIVATION it sent on */
    NL_DIGEST_BWD_IN,     /* the GRADIENT it received */
    NL_DIGEST_BWD_OUT,    /* the GRADIENT it sent back */
    NL_DIGEST_KINDS
};

typedef struct nl_msg_step {
    uint64_t job_id, step;
    bool apply;        /* false: skip this step (e.g. non-finite norm) */
    double clip_scale; /* multiply gradients by this, in [0, 1] */
    double lr;
} nl_msg_step;

typedef struct nl_msg_ckpt_req {
    uint64_t job_id, step;
    const char *dir;
} nl_msg_ckpt_req;

/* LOSS: the last stage's losses of one training step (eval false) or of
 * one evaluation (eval true), to the coordinator. */
typedef struct nl_msg_loss {
    uint64_t job_id, step;
    bool eval;
    double ce_sum; /* sum of the rows' cross-entropies (non-finite allowed) */
    double aux;    /* the whole model's load-balancing loss (training) */
    uint64_t rows; /* rows the sum is over */
} nl_msg_loss;

/* LOSS with the field added for classification (u.loss reads the rest):
 * of an evaluation, the rows whose most probable class is their label
 * (optional on the wire: absent, 0). */
typedef struct nl_msg_train_loss {
    nl_msg_loss loss;
    uint64_t correct;
} nl_msg_train_loss;

typedef struct nl_msg_ckpt_done {
    uint64_t job_id, step;
    uint32_t stage;
    const char *path;
    const char *sha256; /* 64 lowercase hex digits */
    uint64_t bytes;
} nl_msg_ckpt_done;

/* Verification by recompute (docs/security.md, "Catching a node that
 * computes wrong"). VERIFY_REQ asks a stage, between its GRAD_NORM and the
 * STEP, for microbatch `microbatch` of the step. */
typedef struct nl_msg_verify_req {
    uint64_t job_id, step;
    uint32_t microbatch;
    uint32_t flags; /* nl_verify_req_flag bits (absent: 0) */
} nl_msg_verify_req;
typedef enum nl_verify_req_flag {
    /* the case carries the stage's outputs too (a cross-class verifier) */
    NL_VERIFY_OUTPUTS = 1u,
    /* the stage handed its weights over with an earlier case of this
     * step: this one carries none (its frame 0 is F32 [0]) */
    NL_VERIFY_NO_WEIGHTS = 2u,
} nl_verify_req_flag;

/* VERIFY_CASE: what redoing it takes (node/stage_verify.h). Frames: 0 the
 * stage's weights at the step's start, F32 [n]; 1 its input (I32 tokens
 * [batch, seq] on the first stage, else F32 [batch, seq, d]); then, but on
 * the last stage, the GRADIENT it received, F32 [batch, seq, d]; then with
 * `counts` the step's route counts, I64 [layers, experts]; then the I32
 * frames `extras` names (NL_HOP_*), as the ACTIVATION carried them; then
 * with `outputs` what the stage sent, F32 [batch, seq, d]: its ACTIVATION
 * (but on the last stage) and its GRADIENT (but on the first), for a
 * verifier of another device class, which compares them with its own
 * within a relative tolerance (node/stage_verify.h). Its hidden states
 * (input, GRADIENT received, outputs) are in the wire's precision, the
 * bytes that crossed it: all F32, or all BF16 with --wire bf16 (the
 * verifier then rounds its own outputs to bf16 too).
 * config_json is empty from the stage; the coordinator fills it for the
 * verifier. Frame 0 is F32 [0] when the weights were handed over with an
 * earlier case of the step (VERIFY_REQ no_weights) or, to a verifier,
 * when that verifier was sent them already: `weights` (coordinator ->
 * verifier, 64 hex digits; empty from a stage) is the name the
 * coordinator gave those weights (32 random bytes), which a verifier
 * holding them finds them by. */
typedef struct nl_msg_verify_case {
    uint64_t job_id, step;
    uint32_t microbatch, stage;
    uint32_t layer0, layer1;
    bool has_embed, has_head;
    uint32_t batch, seq, microbatches; /* the microbatch's rows and the step's microbatches */
    uint64_t loss_rows;
    uint32_t extras;
    bool counts;
    const char *config_json;
    uint32_t outputs;    /* 0 or 1 (absent: 0) */
    const char *weights; /* the weights' name in hex, or "" (absent: "") */
} nl_msg_verify_case;

/* VERIFY_RESULT: the digests of the ACTIVATION and GRADIENT the stage
 * should have sent (64 hex digits, or "" where it sends none); or, with
 * want_weights 1 (absent: 0), none: the case came without weights and the
 * verifier does not hold those it names (send it again with them).
 * weights: the name the case gave its weights (absent: ""), so that the
 * answer to a case of a step since redone (a rollback) is not taken for
 * the answer to the case of the same step, microbatch and stage now. */
typedef struct nl_msg_verify_result {
    uint64_t job_id, step;
    uint32_t microbatch, stage;
    const char *fwd, *bwd;
    uint32_t want_weights;
    const char *weights;
} nl_msg_verify_result;

/* REDUCE + one F32 frame [n]: a chunk of a stage's replicas' all-reduce
 * (net/allreduce.h), replica `sender` to the next replica of the ring.
 * Phase 0 (NL_REDUCE_SUM): the sum of replicas 0..sender of elements
 * [offset, offset + n); phase 1 (NL_REDUCE_RESULT): the sum of them all. */
typedef struct nl_msg_reduce {
    uint64_t job_id, step;
    uint32_t what;          /* NL_REDUCE_GRADS or NL_REDUCE_COUNTS */
    uint32_t phase;         /* NL_REDUCE_SUM or NL_REDUCE_RESULT */
    uint32_t sender;        /* its replica index, below NL_REDUCE_MAX_REPLICAS */
    uint32_t chunk, chunks; /* chunk < chunks */
    uint64_t offset;        /* of the chunk's first element */
    uint64_t epoch;         /* the sender's placement (as a training hop's; 0: absent) */
} nl_msg_reduce;
enum { NL_REDUCE_SUM = 0, NL_REDUCE_RESULT = 1 };
/* What a REDUCE adds up: the step's gradients (and the last stage's
 * losses), or its counting pass's route counts. */
enum { NL_REDUCE_GRADS = 0, NL_REDUCE_COUNTS = 1, NL_REDUCE_KINDS };
#define NL_REDUCE_MAX_REPLICAS 16

/* LOCAL_LINK (docs/protocol.md, "Local links"): two neighbour stages on
 * one host move their hops from ZeroMQ to a local link (net/locallink.h).
 * The upstream stage OFFERs (its host, the abstract name it listens on,
 * a token); the downstream stage connects, sends the token and answers
 * READY (or DECLINE with a reason); the upstream stage takes the
 * connection and says SWITCH, the downstream stage SWITCH back. SWITCH is
 * the last message a side sends on ZeroMQ to that neighbour: what it sends
 * after comes on the local link, and each side reads the local link only
 * after the other's SWITCH, so nothing is reordered. */
typedef enum nl_local_op {
    NL_LOCAL_OFFER = 1,   /* upstream -> downstream: host, name, token */
    NL_LOCAL_READY = 2,   /* downstream -> upstream: connected, token sent */
    NL_LOCAL_SWITCH = 3,  /* each way */
    NL_LOCAL_DECLINE = 4, /* either way: stay on ZeroMQ; reason */
} nl_local_op;
/* Every op carries the offer's name: an answer about another offer (one
 * a new ASSIGN replaced, still in flight) is ignored. host and token are
 * set in an OFFER and "" in the other ops; reason in a DECLINE only (""
 * otherwise). host and name are printable ASCII without spaces. */
typedef struct nl_msg_local_link {
    uint32_t op;        /* nl_local_op */
    const char *host;   /* "<boot id>/<uid>/<network namespace>", 1-127 bytes */
    const char *name;   /* the abstract socket's name, 1-63 bytes */
    const char *token;  /* 64 lowercase hex chars */
    const char *reason; /* why, UTF-8, 0-256 bytes */
} nl_msg_local_link;

/* One tensor frame. t.data/len are the bytes on the wire (len == numel *
 * dtype size). On send, free_fn (if set) is called exactly once when the
 * transport no longer needs the bytes, whatever the outcome: the bytes are
 * then sent without copying. Without free_fn the transport copies them. */
typedef struct nl_wire_frame {
    nl_tensor t;
    size_t len;
    void (*free_fn)(void *data, void *hint);
    void *hint;
} nl_wire_frame;

typedef struct nl_wire_msg {
    uint32_t version; /* decode: the version read; encode: ignored */
    nl_msg_type type;
    union {
        nl_msg_hello hello;
        nl_msg_error error;
        nl_msg_join join;
        nl_msg_accept accept;
        nl_msg_heartbeat heartbeat;
        nl_msg_leave leave;
        nl_msg_assign assign;
        nl_msg_layer_load layer_load;
        nl_msg_load_done load_done;
        nl_msg_tensor_hop hop;
        nl_msg_token token;
        nl_msg_job_submit job_submit;
        nl_msg_job_status job_status;
        nl_msg_job_ref job_ref;
        nl_msg_grad_norm grad_norm;
        nl_msg_step step;
        nl_msg_ckpt_req ckpt_req;
        nl_msg_ckpt_done ckpt_done;
        nl_msg_loss loss;
        nl_msg_train_hop train_hop;   /* ACTIVATION, COUNT, EVAL */
        nl_msg_train_loss train_loss; /* LOSS */
        nl_msg_verify_req verify_req;
        nl_msg_verify_case verify_case;
        nl_msg_verify_result verify_result;
        nl_msg_reduce reduce;
        nl_msg_local_link local_link;
    } u;
    int nframes;
    nl_wire_frame frames[NL_WIRE_MAX_FRAMES];
    /* private: the decode arena, reused across decodes */
    uint8_t *arena;
    size_t arena_cap, arena_used;
} nl_wire_msg;

/* Limits the decoder enforces before it allocates or trusts anything. */
typedef struct nl_wire_limits {
    size_t max_header;        /* header bytes (default 64 KiB) */
    uint32_t max_depth;       /* container nesting; the schema needs 4 */
    uint32_t max_str;         /* bytes of any one string (default 48 KiB) */
    uint32_t max_array;       /* entries of any one array or map (4096) */
    int max_frames;           /* <= NL_WIRE_MAX_FRAMES (16) */
    int max_dims;             /* <= NL_MAX_DIMS (8) */
    uint64_t max_frame_bytes; /* bytes of one frame (default 1 GiB) */
} nl_wire_limits;

nl_wire_limits nl_wire_limits_default(void);

/* A raw part (header or frame) as received. */
typedef struct nl_wire_part {
    const void *data;
    size_t len;
} nl_wire_part;

/* A growable output buffer for encoded headers, reused across encodes. */
typedef struct nl_wire_wbuf {
    uint8_t *data;
    size_t len, cap;
} nl_wire_wbuf;

void nl_wire_wbuf_free(nl_wire_wbuf *b);

/* Zero a message (no arena). */
/* Describe a frame: a tensor of `dtype` and `shape` at data. Without a
 * release callback (free_fn left NULL) the send copies the bytes; set
 * free_fn (or use nl_txref_frame) to send without copying. */
void nl_wire_frame_set(nl_wire_frame *f, const void *data, nl_dtype dtype, const int64_t *shape,
                       int ndim);

/* The precision of the hidden states and their gradients between stages
 * (DESIGN.md section 8, docs/protocol.md "Wire precision"): FP32, or bf16,
 * rounded to nearest even when sent and widened (exactly) when received;
 * the receiving stage computes in its own precision. The dtype travels in
 * each frame's descriptor, so a receiver takes either. */
typedef enum nl_wire_precision { NL_WIRE_FP32 = 0, NL_WIRE_BF16 = 1 } nl_wire_precision;

/* "fp32" or "bf16" (NULL for another value). */
const char *nl_wire_precision_name(nl_wire_precision p);
/* "fp32" or "bf16" into *p: 0, else -1. */
int nl_wire_precision_parse(const char *s, nl_wire_precision *p);

/* Describe the FP32 hidden states at x (numel of shape) as frame f in
 * precision p: FP32 points at x; BF16 rounds them into *buf (grown to
 * numel uint16, *cap elements; the caller keeps and frees it) and points
 * there. Neither sets a release callback: the send copies the bytes.
 * NL_ERR_NOMEM when *buf cannot grow. */
nl_status nl_wire_frame_hidden(nl_wire_frame *f, nl_wire_precision p, const float *x,
                               const int64_t *shape, int ndim, uint16_t **buf, size_t *cap,
                               nl_error *err);
/* Copy n hidden-state values of frame f (F32 or BF16, numel n: the caller
 * checked the shape) into dst as FP32, widening bf16 exactly. */
void nl_wire_frame_widen(const nl_wire_frame *f, float *dst, size_t n);
/* Whether a frame's dtype may carry hidden states or their gradients
 * (F32 or BF16). */
bool nl_wire_dtype_hidden(nl_dtype dt);

/* The frame of a decoded (or filled) ACTIVATION, COUNT or EVAL that
 * holds `what` (one NL_HOP_* bit), or NULL when it has none. */
const nl_tensor *nl_wire_hop_frame(const nl_wire_msg *m, unsigned what);
/* Fill the frames after frame 0 of a training hop: each array that is not
 * NULL (targets and docs [B, T], labels and lengths [B]) becomes an I32
 * frame in NL_HOP_* order, and u.train_hop.extras says which came. m->nframes must
 * be 1 (frame 0 set). */
void nl_wire_hop_set_extras(nl_wire_msg *m, int64_t B, int64_t T, const int32_t *targets,
                            const int32_t *docs, const int32_t *labels, const int32_t *lengths);

void nl_wire_msg_init(nl_wire_msg *m);
/* Zero the fields and frames and set the type; keeps the arena. */
void nl_wire_msg_reset(nl_wire_msg *m, nl_msg_type type);
/* Free the arena; the message is then as after nl_wire_msg_init. */
void nl_wire_msg_free(nl_wire_msg *m);
/* Hand frames [from, nframes) back to their owners (each free_fn that is
 * set, once): what a transport does with the frames it did not send. The
 * message keeps its fields and frame lengths. */
void nl_wire_release_frames(nl_wire_msg *m, int from);
/* The length of s's longest prefix of at most max bytes that ends on a
 * UTF-8 character boundary: how much of a text fits a field of max bytes. */
size_t nl_wire_utf8_fit(const char *s, size_t max);

/* Name of a message type ("ACTIVATION"), or NULL for an unknown code. */
const char *nl_wire_type_name(uint32_t type);

/* Encode m's header into out (replacing its contents). Checks m against
 * the same schema the decoder enforces, and sets every frame's len from its
 * dtype and shape. lim may be NULL (defaults). m is not otherwise changed
 * except frames[i].len. */
nl_status nl_wire_encode(nl_wire_msg *m, nl_wire_wbuf *out, const nl_wire_limits *lim,
                         nl_error *err);

/* Decode parts[0] (the header) and parts[1..nparts-1] (the frames) into m.
 * An ERROR decodes whatever its version (its layout is frozen; check
 * m->version); any other type from another version is NL_ERR_VERSION.
 * On failure m->type holds the type code if it could be read (else
 * NL_MSG_NONE) and m->version the version; the error says which field or
 * limit is at fault: NL_ERR_VERSION (another protocol version),
 * NL_ERR_LIMIT, NL_ERR_PROTO (malformed, wrong type, unknown message or
 * key), NL_ERR_RANGE, NL_ERR_SHAPE, NL_ERR_DTYPE, NL_ERR_NOMEM. */
nl_status nl_wire_decode(nl_wire_msg *m, const nl_wire_part *parts, int nparts,
                         const nl_wire_limits *lim, nl_error *err);

/* Read only the version and type of a header (both 0 if unreadable). */
void nl_wire_peek(const void *header, size_t len, uint32_t *version, uint32_t *type);

/* Z85 public key syntax: exactly 40 characters of the Z85 alphabet. */
bool nl_wire_z85_key_ok(const char *s, size_t len);

#endif
