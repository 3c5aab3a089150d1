/* The wire schema: the field table of every message type, and the value,
 * frame and cross-field checks that encoding and decoding both apply. */
#include "net/wire_impl.h"

#include <math.h>
#include <string.h>

/* the range is "lo, hi" (or U32_ANY, U64_ANY) */
// clang-format off
#define F_U32(S, m, ...) {#m, NL_WK_U32, 0, 0, offsetof(S, m), 0, __VA_ARGS__, 0, 0, 0}
#define F_U64(S, m, ...) {#m, NL_WK_U64, 0, 0, offsetof(S, m), 0, __VA_ARGS__, 0, 0, 0}
#define F_F64(S, m, a, b) {#m, NL_WK_F64, 0, 0, offsetof(S, m), 0, 0, 0, (a), (b), 0}
#define F_BOOL(S, m) {#m, NL_WK_BOOL, 0, 0, offsetof(S, m), 0, 0, 1, 0, 0, 0}
#define F_STR(S, m, cs, a, b) {#m, NL_WK_STR, (cs), 0, offsetof(S, m), 0, (a), (b), 0, 0, 0}
#define F_LIST(S, m, kind, cnt, a, b) {#m, (kind), 0, 0, offsetof(S, m), offsetof(S, cnt), (a), (b), 0, 0, 0}
/* fields added to a type later: a peer that does not send them reads as 0 */
#define F_U32_OPT(S, m) {#m, NL_WK_U32, 0, 0, offsetof(S, m), 0, 0, UINT32_MAX, 0, 0, 1}
#define F_U64_OPT(S, m) {#m, NL_WK_U64, 0, 0, offsetof(S, m), 0, 0, UINT64_MAX, 0, 0, 1}
#define F_F64_OPT(S, m, a, b) {#m, NL_WK_F64, 0, 0, offsetof(S, m), 0, 0, 0, (a), (b), 1}
#define F_STR_OPT(S, m, cs, b) {#m, NL_WK_STR, (cs), 0, offsetof(S, m), 0, 0, (b), 0, 0, 1}
// clang-format on
#define U64_ANY 0, UINT64_MAX
#define U32_ANY 0, UINT32_MAX

#define DT(x) (1u << NL_DTYPE_##x)
#define DT_FLOAT (DT(F32) | DT(F16) | DT(BF16))
#define DT_HIDDEN (DT(F32) | DT(BF16)) /* hidden states and gradients: nl_wire_precision */
#define NF(a) (uint8_t)(sizeof(a) / sizeof(a[0]))

static const nl_wire_field f_hello[] = {
    F_U32(nl_msg_hello, role, NL_ROLE_COORDINATOR, NL_ROLE_CLIENT),
    F_STR(nl_msg_hello, software, NL_WCS_PRINT, 0, 64),
};
static const nl_wire_field f_error[] = {
    F_U32(nl_msg_error, code, 1, 999),
    F_U32(nl_msg_error, req_type, 0, NL_MSG_TYPE_MAX - 1),
    F_STR(nl_msg_error, message, NL_WCS_UTF8, 0, 1024),
};
static const nl_wire_field f_join[] = {
    F_STR(nl_msg_join, pubkey, NL_WCS_Z85, NL_KEY_Z85_LEN, NL_KEY_Z85_LEN),
    F_STR(nl_msg_join, device, NL_WCS_WORD, 3, 32),
    F_U64(nl_msg_join, memory_bytes, 1, UINT64_MAX),
    F_F64(nl_msg_join, gemm_gflops, 0, 1e9),
    F_U32(nl_msg_join, threads, 1, 65536),
    F_STR(nl_msg_join, data_endpoint, NL_WCS_WORD, 7, 256),
    F_U32_OPT(nl_msg_join, flags), /* nl_join_flag (check_join); absent: 0 */
};
static const nl_wire_field f_accept[] = {
    F_U32(nl_msg_accept, node_id, U32_ANY),
    F_U32(nl_msg_accept, heartbeat_ms, 10, 3600000),
    F_U32(nl_msg_accept, timeout_ms, 10, 86400000),
};
static const nl_wire_field f_heartbeat[] = {
    F_U32(nl_msg_heartbeat, node_id, U32_ANY),
    F_U64(nl_msg_heartbeat, seq, U64_ANY),
    F_U32(nl_msg_heartbeat, state, NL_NODE_IDLE, NL_NODE_FAILED),
    F_F64(nl_msg_heartbeat, load, 0, 1e6),
    F_U64_OPT(nl_msg_heartbeat, kv_bytes),
    F_U32_OPT(nl_msg_heartbeat, sessions),
    F_U64_OPT(nl_msg_heartbeat, hops),
    F_U64_OPT(nl_msg_heartbeat, batches),
    F_F64_OPT(nl_msg_heartbeat, compute_s, 0, 1e12),
    F_F64_OPT(nl_msg_heartbeat, hop_s, 0, 1e15),
    F_U64_OPT(nl_msg_heartbeat, reduce_bytes),
    F_F64_OPT(nl_msg_heartbeat, reduce_s, 0, 1e15),
};
static const nl_wire_field f_leave[] = {
    F_U32(nl_msg_leave, node_id, U32_ANY),
    F_STR(nl_msg_leave, reason, NL_WCS_UTF8, 0, 1024),
};
static const nl_wire_field f_assign[] = {
    F_U64(nl_msg_assign, epoch, U64_ANY),
    F_U32(nl_msg_assign, node_id, U32_ANY),
    F_U32(nl_msg_assign, stage, 0, 4095),
    F_U32(nl_msg_assign, num_stages, 1, 4096),
    F_U32(nl_msg_assign, layer0, 0, 65536),
    F_U32(nl_msg_assign, layer1, 0, 65536),
    F_BOOL(nl_msg_assign, has_embed),
    F_BOOL(nl_msg_assign, has_head),
    F_STR(nl_msg_assign, config_json, NL_WCS_UTF8, 2, 49152),
    F_U64(nl_msg_assign, seed, U64_ANY),
    F_STR(nl_msg_assign, prev_endpoint, NL_WCS_WORD, 0, 256),
    F_STR(nl_msg_assign, prev_key, NL_WCS_Z85, 0, NL_KEY_Z85_LEN),
    F_STR(nl_msg_assign, next_endpoint, NL_WCS_WORD, 0, 256),
    F_STR(nl_msg_assign, next_key, NL_WCS_Z85, 0, NL_KEY_Z85_LEN),
    F_U64(nl_msg_assign, memory_planned, U64_ANY),
    F_U32_OPT(nl_msg_assign, wire),       /* nl_wire_precision (check_assign); absent: FP32 */
    F_U32_OPT(nl_msg_assign, links),      /* nl_link (check_assign); absent: 0 */
    F_U32_OPT(nl_msg_assign, relay_port), /* with a RELAY link (check_assign); absent: 0 */
    /* a stage's replicas (check_assign); absent: one */
    F_U32_OPT(nl_msg_assign, replica),
    F_U32_OPT(nl_msg_assign, replicas),
    F_STR_OPT(nl_msg_assign, ring_endpoint, NL_WCS_WORD, 256),
    F_STR_OPT(nl_msg_assign, ring_key, NL_WCS_Z85, NL_KEY_Z85_LEN),
    F_STR_OPT(nl_msg_assign, ring_prev_key, NL_WCS_Z85, NL_KEY_Z85_LEN),
    /* neighbours with another replica count (nl_wire_check_assign); absent: none */
    F_STR_OPT(nl_msg_assign, prev_keys, NL_WCS_WORD, NL_WIRE_PEER_KEYS_MAX),
    F_STR_OPT(nl_msg_assign, next_endpoints, NL_WCS_WORD, NL_WIRE_PEER_EPS_MAX),
    F_STR_OPT(nl_msg_assign, next_keys, NL_WCS_WORD, NL_WIRE_PEER_KEYS_MAX),
};
static const nl_wire_field f_layer_load[] = {
    F_U64(nl_msg_layer_load, epoch, U64_ANY),
    F_STR(nl_msg_layer_load, name, NL_WCS_WORD, 1, 256),
    F_LIST(nl_msg_layer_load, shape, NL_WK_DIMS, ndim, 1, NL_MAX_DIMS),
    F_U64(nl_msg_layer_load, offset, 0, INT64_MAX),
    F_U32(nl_msg_layer_load, chunk, 0, UINT32_MAX - 1),
    F_U32(nl_msg_layer_load, chunks, 1, UINT32_MAX),
};
static const nl_wire_field f_load_done[] = {
    F_U64(nl_msg_load_done, epoch, U64_ANY),
    F_U32(nl_msg_load_done, node_id, U32_ANY),
    F_U32(nl_msg_load_done, tensors, U32_ANY),
    F_U64(nl_msg_load_done, bytes, U64_ANY),
};
#define HOP_FIELDS                                                                                 \
    F_U64(nl_msg_tensor_hop, job_id, U64_ANY), F_U64(nl_msg_tensor_hop, step, U64_ANY),            \
        F_U32(nl_msg_tensor_hop, microbatch, U32_ANY),                                             \
        F_U64(nl_msg_tensor_hop, session_id, U64_ANY),                                             \
        F_U64(nl_msg_tensor_hop, pos_offset, 0, INT32_MAX),                                        \
        F_F64(nl_msg_tensor_hop, aux, -1e30, 1e30)
static const nl_wire_field f_hop[] = {HOP_FIELDS};
/* a hop's digest (net/hopdigest.h): 64 lowercase hex digits, or absent
 * (an older peer); check_digest refuses other lengths */
#define F_DIGEST                                                                                   \
    {                                                                                              \
        "digest", NL_WK_STR, NL_WCS_HEX, 0, offsetof(nl_msg_train_hop, digest), 0, 0, 64, 0, 0, 1  \
    }
/* the training hops: the objectives' frames and loss rows, added later */
static const nl_wire_field f_train_hop[] = {
    HOP_FIELDS, F_U32_OPT(nl_msg_train_hop, extras), F_U64_OPT(nl_msg_train_hop, loss_rows),
    F_DIGEST,   F_U64_OPT(nl_msg_train_hop, epoch),
};
static const nl_wire_field f_grad_hop[] = {HOP_FIELDS, F_DIGEST,
                                           F_U64_OPT(nl_msg_train_hop, epoch)};
static const nl_wire_field f_token[] = {
    F_U64(nl_msg_token, job_id, U64_ANY),
    F_U64(nl_msg_token, session_id, U64_ANY),
    F_LIST(nl_msg_token, tokens, NL_WK_U32_LIST, ntokens, 0, 4096),
    F_BOOL(nl_msg_token, done),
    /* optional (added with logprobs): absent reads as no ids */
    {"top_ids", NL_WK_U32_LIST, 0, 0, offsetof(nl_msg_token, top_ids), offsetof(nl_msg_token, ntop),
     0, NL_WIRE_MAX_TOP, 0, 0, 1},
};
static const nl_wire_field f_job_submit[] = {
    F_U32(nl_msg_job_submit, kind, NL_JOB_FORWARD, NL_JOB_GROW),
    F_LIST(nl_msg_job_submit, params, NL_WK_PARAMS, nparams, 0, 64),
};
static const nl_wire_field f_job_status[] = {
    F_U64(nl_msg_job_status, job_id, U64_ANY),
    F_U32(nl_msg_job_status, state, NL_JOB_QUEUED, NL_JOB_CANCELLED),
    F_F64(nl_msg_job_status, progress, 0, 1),
    F_STR(nl_msg_job_status, message, NL_WCS_UTF8, 0, 1024),
    /* added with the salvage of a step (coord_train_ops.c): absent, 0 */
    {"req_type", NL_WK_U32, 0, 0, offsetof(nl_msg_job_status, req_type), 0, 0, NL_MSG_TYPE_MAX - 1,
     0, 0, 1},
};
static const nl_wire_field f_job_ref[] = {
    F_U64(nl_msg_job_ref, job_id, U64_ANY),
};
static const nl_wire_field f_grad_norm[] = {
    F_U64(nl_msg_grad_norm, job_id, U64_ANY),
    F_U64(nl_msg_grad_norm, step, U64_ANY),
    F_U32(nl_msg_grad_norm, stage, 0, 4095),
    /* inf/NaN are allowed: they report an overflow, and the step is skipped */
    {"sumsq", NL_WK_F64, 0, 1, offsetof(nl_msg_grad_norm, sumsq), 0, 0, 0, 0, HUGE_VAL, 0},
};
static const nl_wire_field f_step[] = {
    F_U64(nl_msg_step, job_id, U64_ANY), F_U64(nl_msg_step, step, U64_ANY),
    F_BOOL(nl_msg_step, apply),          F_F64(nl_msg_step, clip_scale, 0, 1),
    F_F64(nl_msg_step, lr, 0, 1000),
};
static const nl_wire_field f_loss[] = {
    F_U64(nl_msg_loss, job_id, U64_ANY),
    F_U64(nl_msg_loss, step, U64_ANY),
    F_BOOL(nl_msg_loss, eval),
    /* inf/NaN are allowed: a diverged loss is reported, and the step skipped */
    {"ce_sum", NL_WK_F64, 0, 1, offsetof(nl_msg_loss, ce_sum), 0, 0, 0, 0, HUGE_VAL, 0},
    {"aux", NL_WK_F64, 0, 1, offsetof(nl_msg_loss, aux), 0, 0, 0, 0, HUGE_VAL, 0},
    F_U64(nl_msg_loss, rows, U64_ANY),
    F_U64_OPT(nl_msg_train_loss, correct),
};
static const nl_wire_field f_ckpt_req[] = {
    F_U64(nl_msg_ckpt_req, job_id, U64_ANY),
    F_U64(nl_msg_ckpt_req, step, U64_ANY),
    F_STR(nl_msg_ckpt_req, dir, NL_WCS_PRINT, 1, 1024),
};
static const nl_wire_field f_ckpt_done[] = {
    F_U64(nl_msg_ckpt_done, job_id, U64_ANY),
    F_U64(nl_msg_ckpt_done, step, U64_ANY),
    F_U32(nl_msg_ckpt_done, stage, 0, 4095),
    F_STR(nl_msg_ckpt_done, path, NL_WCS_PRINT, 1, 1024),
    F_STR(nl_msg_ckpt_done, sha256, NL_WCS_HEX, 64, 64),
    F_U64(nl_msg_ckpt_done, bytes, U64_ANY),
};

static const nl_wire_field f_verify_req[] = {
    F_U64(nl_msg_verify_req, job_id, U64_ANY),
    F_U64(nl_msg_verify_req, step, U64_ANY),
    F_U32(nl_msg_verify_req, microbatch, U32_ANY),
    F_U32_OPT(nl_msg_verify_req, flags),
};
static const nl_wire_field f_verify_case[] = {
    F_U64(nl_msg_verify_case, job_id, U64_ANY),
    F_U64(nl_msg_verify_case, step, U64_ANY),
    F_U32(nl_msg_verify_case, microbatch, U32_ANY),
    F_U32(nl_msg_verify_case, stage, 0, 4095),
    F_U32(nl_msg_verify_case, layer0, 0, 65536),
    F_U32(nl_msg_verify_case, layer1, 0, 65536),
    F_BOOL(nl_msg_verify_case, has_embed),
    F_BOOL(nl_msg_verify_case, has_head),
    F_U32(nl_msg_verify_case, batch, 1, 1u << 20),
    F_U32(nl_msg_verify_case, seq, 1, 1u << 20),
    F_U32(nl_msg_verify_case, microbatches, 1, 1u << 20),
    F_U64(nl_msg_verify_case, loss_rows, U64_ANY),
    F_U32(nl_msg_verify_case, extras, 0, NL_HOP_ALL),
    F_BOOL(nl_msg_verify_case, counts),
    F_STR(nl_msg_verify_case, config_json, NL_WCS_UTF8, 0, 49152),
    F_U32_OPT(nl_msg_verify_case, outputs),
    F_STR_OPT(nl_msg_verify_case, weights, NL_WCS_HEX, 64),
};
static const nl_wire_field f_verify_result[] = {
    F_U64(nl_msg_verify_result, job_id, U64_ANY),
    F_U64(nl_msg_verify_result, step, U64_ANY),
    F_U32(nl_msg_verify_result, microbatch, U32_ANY),
    F_U32(nl_msg_verify_result, stage, 0, 4095),
    F_STR(nl_msg_verify_result, fwd, NL_WCS_HEX, 0, 64),
    F_STR(nl_msg_verify_result, bwd, NL_WCS_HEX, 0, 64),
    F_U32_OPT(nl_msg_verify_result, want_weights),
    F_STR_OPT(nl_msg_verify_result, weights, NL_WCS_HEX, 64),
};
static const nl_wire_field f_reduce[] = {
    F_U64(nl_msg_reduce, job_id, U64_ANY),
    F_U64(nl_msg_reduce, step, U64_ANY),
    F_U32(nl_msg_reduce, what, NL_REDUCE_GRADS, NL_REDUCE_KINDS - 1),
    F_U32(nl_msg_reduce, phase, NL_REDUCE_SUM, NL_REDUCE_RESULT),
    F_U32(nl_msg_reduce, sender, 0, NL_REDUCE_MAX_REPLICAS - 1),
    F_U32(nl_msg_reduce, chunk, U32_ANY),
    F_U32(nl_msg_reduce, chunks, 1, UINT32_MAX),
    F_U64(nl_msg_reduce, offset, U64_ANY),
    F_U64_OPT(nl_msg_reduce, epoch),
};
/* which of the strings an op carries: nl_wire_check_local_link (wire_assign.c) */
static const nl_wire_field f_local_link[] = {
    F_U32(nl_msg_local_link, op, NL_LOCAL_OFFER, NL_LOCAL_DECLINE),
    F_STR(nl_msg_local_link, host, NL_WCS_WORD, 0, 127),
    F_STR(nl_msg_local_link, name, NL_WCS_WORD, 0, 63),
    F_STR(nl_msg_local_link, token, NL_WCS_HEX, 0, 64),
    F_STR(nl_msg_local_link, reason, NL_WCS_UTF8, 0, 256),
};

static nl_status check_join(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_reduce(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_verify_req(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_verify_case(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_verify_result(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_accept(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_layer_load(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_job_submit(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_activation(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_token(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_digest(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
static nl_status check_grad_norm(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);

static const nl_wire_tdesc tdescs[NL_MSG_TYPE_MAX] = {
    [NL_MSG_HELLO] = {"HELLO", f_hello, NF(f_hello), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_HELLO_ACK] = {"HELLO_ACK", f_hello, NF(f_hello), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_ERROR] = {"ERROR", f_error, NF(f_error), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_JOIN] = {"JOIN", f_join, NF(f_join), 0, 0, 0, 0, 0, check_join},
    [NL_MSG_ACCEPT] = {"ACCEPT", f_accept, NF(f_accept), 0, 0, 0, 0, 0, check_accept},
    [NL_MSG_HEARTBEAT] = {"HEARTBEAT", f_heartbeat, NF(f_heartbeat), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_LEAVE] = {"LEAVE", f_leave, NF(f_leave), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_ASSIGN] = {"ASSIGN", f_assign, NF(f_assign), 0, 0, 0, 0, 0, nl_wire_check_assign},
    [NL_MSG_LAYER_LOAD] = {"LAYER_LOAD", f_layer_load, NF(f_layer_load), 1, 1, 1, 1,
                           DT_FLOAT | DT(F64) | DT(I32) | DT(I64), check_layer_load},
    [NL_MSG_LOAD_DONE] = {"LOAD_DONE", f_load_done, NF(f_load_done), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_ACTIVATION] = {"ACTIVATION", f_train_hop, NF(f_train_hop), 1, 5, 1, NL_MAX_DIMS,
                           DT_HIDDEN | DT(I32), check_activation},
    [NL_MSG_GRADIENT] = {"GRADIENT", f_grad_hop, NF(f_grad_hop), 1, 1, 1, NL_MAX_DIMS, DT_HIDDEN,
                         check_digest},
    /* the last stage's logits (F32 [B, T, V]) for a forward job, to the
     * coordinator and on to the client */
    [NL_MSG_RESULT] = {"RESULT", f_hop, NF(f_hop), 1, 1, 1, NL_MAX_DIMS, DT_FLOAT, NULL},
    /* a training step's counting pass and an evaluation: as ACTIVATION */
    [NL_MSG_COUNT] = {"COUNT", f_train_hop, NF(f_train_hop), 1, 5, 1, NL_MAX_DIMS,
                      DT_HIDDEN | DT(I32), check_activation},
    [NL_MSG_EVAL] = {"EVAL", f_train_hop, NF(f_train_hop), 1, 5, 1, NL_MAX_DIMS,
                     DT_HIDDEN | DT(I32), check_activation},
    /* + an optional F32 frame [1 + ntop]: log-probabilities (check_token) */
    [NL_MSG_TOKEN] = {"TOKEN", f_token, NF(f_token), 0, 1, 1, 1, DT(F32), check_token},
    [NL_MSG_JOB_SUBMIT] = {"JOB_SUBMIT", f_job_submit, NF(f_job_submit), 0, 4, 1, NL_MAX_DIMS,
                           DT(I32) | DT(I64) | DT(F32), check_job_submit},
    /* + an optional U8 frame: a JSON report (the cluster's status) */
    [NL_MSG_JOB_STATUS] = {"JOB_STATUS", f_job_status, NF(f_job_status), 0, 1, 1, 1, DT(U8), NULL},
    [NL_MSG_JOB_CANCEL] = {"JOB_CANCEL", f_job_ref, NF(f_job_ref), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_JOB_QUERY] = {"JOB_QUERY", f_job_ref, NF(f_job_ref), 0, 0, 0, 0, 0, NULL},
    /* + an optional U8 frame [M, 4, 32]: the step's hop digests */
    [NL_MSG_GRAD_NORM] = {"GRAD_NORM", f_grad_norm, NF(f_grad_norm), 0, 1, 3, 3, DT(U8),
                          check_grad_norm},
    [NL_MSG_STEP] = {"STEP", f_step, NF(f_step), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_CKPT_REQ] = {"CKPT_REQ", f_ckpt_req, NF(f_ckpt_req), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_CKPT_DONE] = {"CKPT_DONE", f_ckpt_done, NF(f_ckpt_done), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_LOSS] = {"LOSS", f_loss, NF(f_loss), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_VERIFY_REQ] = {"VERIFY_REQ", f_verify_req, NF(f_verify_req), 0, 0, 0, 0, 0,
                           check_verify_req},
    [NL_MSG_VERIFY_CASE] = {"VERIFY_CASE", f_verify_case, NF(f_verify_case), 2, 10, 1, 3,
                            DT(F32) | DT(BF16) | DT(I32) | DT(I64), check_verify_case},
    [NL_MSG_VERIFY_RESULT] = {"VERIFY_RESULT", f_verify_result, NF(f_verify_result), 0, 0, 0, 0, 0,
                              check_verify_result},
    /* + one F32 frame [n]: the chunk's elements */
    [NL_MSG_REDUCE] = {"REDUCE", f_reduce, NF(f_reduce), 1, 1, 1, 1, DT(F32), check_reduce},
    [NL_MSG_LOCAL_LINK] = {"LOCAL_LINK", f_local_link, NF(f_local_link), 0, 0, 0, 0, 0,
                           nl_wire_check_local_link},
};

const nl_wire_tdesc *nl_wire_schema_of(uint32_t type)
{
    return type < NL_MSG_TYPE_MAX && tdescs[type].name ? &tdescs[type] : NULL;
}

const char *nl_wire_type_name(uint32_t type)
{
    const nl_wire_tdesc *td = nl_wire_schema_of(type);
    return td ? td->name : NULL;
}

/* ===================== value checks (shared by both directions) ===================== */

static bool utf8_ok(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        uint32_t cp;
        size_t k;
        if (c < 0x80) {
            if (c == 0)
                return false;
            i++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            cp = c & 0x1f, k = 1;
        } else if ((c & 0xf0) == 0xe0) {
            cp = c & 0x0f, k = 2;
        } else if ((c & 0xf8) == 0xf0) {
            cp = c & 0x07, k = 3;
        } else {
            return false;
        }
        if (n - i <= k)
            return false;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80)
                return false;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        static const uint32_t min_cp[4] = {0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[k] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += k + 1;
    }
    return true;
}

static const char z85_chars[] =
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

bool nl_wire_z85_key_ok(const char *s, size_t len)
{
    if (!s || len != NL_KEY_Z85_LEN)
        return false;
    for (size_t i = 0; i < len; i++)
        if (s[i] == '\0' || !strchr(z85_chars, s[i]))
            return false;
    return true;
}

static bool charset_ok(nl_wire_charset cs, const char *s, size_t n)
{
    const uint8_t *u = (const uint8_t *)s;
    switch (cs) {
    case NL_WCS_UTF8:
        return utf8_ok(u, n);
    case NL_WCS_Z85:
        return n == 0 || nl_wire_z85_key_ok(s, n);
    default:
        break;
    }
    for (size_t i = 0; i < n; i++) {
        uint8_t c = u[i];
        bool ok = cs == NL_WCS_PRINT  ? (c >= 0x20 && c <= 0x7e)
                  : cs == NL_WCS_WORD ? (c >= 0x21 && c <= 0x7e)
                                      : ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
        if (!ok)
            return false;
    }
    return true;
}

static const char *charset_what(nl_wire_charset cs)
{
    static const char *const what[] = {"valid UTF-8", "printable ASCII",
                                       "printable ASCII without spaces", "lowercase hex digits",
                                       "a Z85 key"};
    return what[cs];
}

static nl_status check_field(const nl_wire_tdesc *td, const nl_wire_field *f, const void *base,
                             nl_error *err)
{
    uint64_t u = 0;
    switch ((nl_wire_kind)f->kind) {
    case NL_WK_U32:
        u = NL_WIRE_FVAL(base, f, uint32_t);
        goto int_range;
    case NL_WK_U64:
        u = NL_WIRE_FVAL(base, f, uint64_t);
    int_range:
        if (u < f->lo || u > f->hi)
            return nl_error_set(err, NL_ERR_RANGE, "%s.%s: %llu is outside [%llu, %llu]", td->name,
                                f->name, (unsigned long long)u, (unsigned long long)f->lo,
                                (unsigned long long)f->hi);
        return NL_OK;
    case NL_WK_F64: {
        double d = NL_WIRE_FVAL(base, f, double);
        if (!isfinite(d) && f->nonfinite_ok && !(d < 0))
            return NL_OK;
        if (!isfinite(d) || d < f->flo || d > f->fhi)
            return nl_error_set(err, NL_ERR_RANGE, "%s.%s: %g is outside [%g, %g]", td->name,
                                f->name, d, f->flo, f->fhi);
        return NL_OK;
    }
    case NL_WK_BOOL:
        return NL_OK;
    case NL_WK_STR: {
        const char *s = NL_WIRE_FVAL(base, f, const char *);
        size_t n = s ? strlen(s) : 0;
        if (n < f->lo || n > f->hi)
            return nl_error_set(err, NL_ERR_RANGE,
                                "%s.%s: string of %zu bytes, allowed %llu to %llu", td->name,
                                f->name, n, (unsigned long long)f->lo, (unsigned long long)f->hi);
        if (!charset_ok((nl_wire_charset)f->cs, s ? s : "", n))
            return nl_error_set(err, NL_ERR_RANGE, "%s.%s: must be %s", td->name, f->name,
                                charset_what((nl_wire_charset)f->cs));
        return NL_OK;
    }
    case NL_WK_U32_LIST:
    case NL_WK_PARAMS:
        u = *(const uint32_t *)((const uint8_t *)base + f->count_off);
        goto count_range;
    case NL_WK_DIMS: {
        int nd = *(const int *)((const uint8_t *)base + f->count_off);
        u = nd < 0 ? UINT64_MAX : (uint64_t)nd;
        const int64_t *sh = (const int64_t *)((const uint8_t *)base + f->off);
        for (int i = 0; i < nd && i < NL_MAX_DIMS; i++)
            if (sh[i] < 1)
                return nl_error_set(err, NL_ERR_SHAPE, "%s.%s: dimension %d is %lld, must be >= 1",
                                    td->name, f->name, i, (long long)sh[i]);
        goto count_range;
    }
    }
count_range:
    if (u < f->lo || u > f->hi)
        return nl_error_set(err, NL_ERR_LIMIT, "%s.%s: %llu entries, allowed %llu to %llu",
                            td->name, f->name, (unsigned long long)u, (unsigned long long)f->lo,
                            (unsigned long long)f->hi);
    return NL_OK;
}

/* Frame descriptors against the type and the limits; with `decoding`, the
 * bytes must match, otherwise len is computed. */
static nl_status check_frames(nl_wire_msg *m, const nl_wire_tdesc *td, const nl_wire_limits *lim,
                              bool decoding, nl_error *err)
{
    if (m->nframes < td->min_frames || m->nframes > td->max_frames)
        return nl_error_set(err, NL_ERR_PROTO, "%s: %d tensor frames, expected %d to %d", td->name,
                            m->nframes, td->min_frames, td->max_frames);
    if (m->nframes > lim->max_frames)
        return nl_error_set(err, NL_ERR_LIMIT, "%s: %d tensor frames, limit %d", td->name,
                            m->nframes, lim->max_frames);
    for (int i = 0; i < m->nframes; i++) {
        nl_wire_frame *fr = &m->frames[i];
        nl_tensor *t = &fr->t;
        if ((int)t->dtype < 0 || t->dtype >= NL_DTYPE_COUNT || !(td->dtypes & (1u << t->dtype)))
            return nl_error_set(err, NL_ERR_DTYPE, "%s: frame %d: dtype %s is not allowed here",
                                td->name, i,
                                nl_dtype_name(t->dtype) ? nl_dtype_name(t->dtype) : "?");
        int maxd = td->max_dims < lim->max_dims ? td->max_dims : lim->max_dims;
        if (t->ndim < td->min_dims || t->ndim > maxd)
            return nl_error_set(err, NL_ERR_SHAPE,
                                "%s: frame %d has %d dimensions, allowed %d to %d", td->name, i,
                                t->ndim, td->min_dims, maxd);
        /* one exception: a VERIFY_CASE's weights, F32 [0] when they came
         * with an earlier case (docs/protocol.md) */
        const bool may_be_empty = m->type == NL_MSG_VERIFY_CASE && i == 0 && t->ndim == 1;
        for (int d = 0; d < t->ndim; d++)
            if (t->shape[d] < 1 && !(may_be_empty && t->shape[d] == 0))
                return nl_error_set(err, NL_ERR_SHAPE, "%s: frame %d: dimension %d is %lld",
                                    td->name, i, d, (long long)t->shape[d]);
        int64_t numel = nl_shape_numel(t->shape, t->ndim);
        size_t es = nl_dtype_size(t->dtype);
        if (numel < 0 || (uint64_t)numel > SIZE_MAX / es)
            return nl_error_set(err, NL_ERR_SHAPE, "%s: frame %d: shape overflows", td->name, i);
        size_t bytes = (size_t)numel * es;
        if (bytes > lim->max_frame_bytes)
            return nl_error_set(err, NL_ERR_LIMIT, "%s: frame %d: %zu bytes, limit %llu", td->name,
                                i, bytes, (unsigned long long)lim->max_frame_bytes);
        if (decoding && fr->len != bytes)
            return nl_error_set(
                err, NL_ERR_SHAPE, "%s: frame %d holds %zu bytes; %s with %lld elements needs %zu",
                td->name, i, fr->len, nl_dtype_name(t->dtype), (long long)numel, bytes);
        if (!decoding) {
            if (!t->data && bytes)
                return nl_error_set(err, NL_ERR_INVALID, "%s: frame %d has no data", td->name, i);
            fr->len = bytes;
        }
    }
    return NL_OK;
}

static nl_status check_join(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const nl_msg_join *j = &m->u.join;
    const char *d = j->device;
    bool ok = strcmp(d, "cpu") == 0 || strcmp(d, "cpu-devsim") == 0;
    if (!ok && strncmp(d, "cuda:", 5) == 0) {
        size_t n = strlen(d + 5);
        ok = n >= 1 && n <= 4 && strspn(d + 5, "0123456789") == n;
    }
    if (!ok)
        return nl_error_set(err, NL_ERR_RANGE, "%s.device: '%s' is not cpu, cpu-devsim or cuda:N",
                            td->name, d);
    if (strncmp(j->data_endpoint, "tcp://", 6) != 0 && strncmp(j->data_endpoint, "ipc://", 6) != 0)
        return nl_error_set(err, NL_ERR_RANGE, "%s.data_endpoint: '%s' is not tcp:// or ipc://",
                            td->name, j->data_endpoint);
    if (j->flags & ~NL_JOIN_FLAGS_ALL)
        return nl_error_set(err, NL_ERR_RANGE, "%s.flags: 0x%x has unknown bits (known: 0x%x)",
                            td->name, j->flags, NL_JOIN_FLAGS_ALL);
    return NL_OK;
}

static nl_status check_accept(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    if (m->u.accept.timeout_ms < m->u.accept.heartbeat_ms)
        return nl_error_set(err, NL_ERR_RANGE, "%s: timeout_ms %u is below heartbeat_ms %u",
                            td->name, m->u.accept.timeout_ms, m->u.accept.heartbeat_ms);
    return NL_OK;
}

static nl_status check_layer_load(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const nl_msg_layer_load *l = &m->u.layer_load;
    if (l->chunk >= l->chunks)
        return nl_error_set(err, NL_ERR_RANGE, "%s: chunk %u is not below chunks %u", td->name,
                            l->chunk, l->chunks);
    int64_t total = nl_shape_numel(l->shape, l->ndim);
    int64_t n = m->frames[0].t.shape[0];
    if (total < 0 || l->offset > (uint64_t)total || (uint64_t)n > (uint64_t)total - l->offset)
        return nl_error_set(
            err, NL_ERR_SHAPE, "%s: chunk [%llu, +%lld) lies outside the tensor of %lld elements",
            td->name, (unsigned long long)l->offset, (long long)n, (long long)total);
    return NL_OK;
}

/* A hop's digest: 64 hex digits, or none. */
static nl_status check_digest(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const char *d = m->u.train_hop.digest;
    const size_t n = d ? strlen(d) : 0;
    if (n != 0 && n != 64)
        return nl_error_set(err, NL_ERR_RANGE, "%s.digest: %zu hex digits, must be 64 (or absent)",
                            td->name, n);
    return NL_OK;
}

/* REDUCE: a chunk of its all-reduce (the receiver checks the offset and
 * length against its buffer). */
static nl_status check_reduce(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const nl_msg_reduce *r = &m->u.reduce;
    if (r->chunk >= r->chunks)
        return nl_error_set(err, NL_ERR_RANGE, "%s: chunk %u of %u", td->name, r->chunk, r->chunks);
    return NL_OK;
}

/* GRAD_NORM's digests: [M, 4, 32]. */
static nl_status check_grad_norm(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const nl_tensor *t = m->nframes ? &m->frames[0].t : NULL;
    if (t && (t->shape[1] != NL_DIGEST_KINDS || t->shape[2] != 32))
        return nl_error_set(err, NL_ERR_SHAPE,
                            "%s: the digests frame must be U8 [microbatches, %d, 32]", td->name,
                            NL_DIGEST_KINDS);
    return NL_OK;
}

/* A training hop's frames after frame 0: as hop.extras names them (each
 * I32), or without extras (the older form) at most the targets. */
/* Log-probabilities ride on a TOKEN of one token: the frame holds 1 +
 * ntop of them, each finite and <= 0; top ids come only with the frame. */
static nl_status check_token(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const nl_msg_token *t = &m->u.token;
    if (m->nframes == 0) {
        if (t->ntop)
            return nl_error_set(err, NL_ERR_PROTO, "%s.top_ids: %u ids without log-probabilities",
                                td->name, t->ntop);
        return NL_OK;
    }
    const nl_tensor *f = &m->frames[0].t;
    if (t->ntokens != 1 || f->shape[0] != (int64_t)t->ntop + 1)
        return nl_error_set(err, NL_ERR_SHAPE,
                            "%s: log-probabilities [%lld] for %u tokens and %u top ids (want [%u] "
                            "for one token)",
                            td->name, (long long)f->shape[0], t->ntokens, t->ntop, t->ntop + 1);
    for (int64_t i = 0; f->data && i < f->shape[0]; i++) {
        float v; /* a frame's bytes need not be aligned */
        memcpy(&v, (const char *)f->data + i * (int64_t)sizeof v, sizeof v);
        if (!(v <= 0.0f) || !isfinite(v))
            return nl_error_set(err, NL_ERR_RANGE,
                                "%s: log-probability %lld is %g, not a finite number <= 0",
                                td->name, (long long)i, (double)v);
    }
    return NL_OK;
}

static nl_status check_activation(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    static const char *const what[] = {"targets", "document ids", "labels", "lengths"};
    const uint32_t x = m->u.train_hop.extras;
    nl_status st = check_digest(m, td, err);
    if (st != NL_OK)
        return st;
    if (x & ~(uint32_t)NL_HOP_ALL)
        return nl_error_set(err, NL_ERR_RANGE, "%s.extras: %u names frames that do not exist",
                            td->name, x);
    if (x == 0) {
        if (m->nframes > 2 || (m->type == NL_MSG_COUNT && m->nframes > 1))
            return nl_error_set(err, NL_ERR_PROTO,
                                "%s: %d tensor frames, but extras names none after frame 0",
                                td->name, m->nframes);
        if (m->nframes == 2 && m->frames[1].t.dtype != NL_DTYPE_I32)
            return nl_error_set(err, NL_ERR_DTYPE, "%s: frame 1 (targets) must be I32", td->name);
        return NL_OK;
    }
    int f = 1;
    for (int bit = 0; bit < 4; bit++) {
        if (!(x & (1u << bit)))
            continue;
        if (f >= m->nframes)
            return nl_error_set(err, NL_ERR_PROTO,
                                "%s: extras %u names %s, but frame %d is missing", td->name, x,
                                what[bit], f);
        const nl_tensor *t = &m->frames[f].t;
        const int want_dims = bit < 2 ? 2 : 1;
        if (t->dtype != NL_DTYPE_I32 || t->ndim != want_dims)
            return nl_error_set(err, NL_ERR_DTYPE,
                                "%s: frame %d (%s) must be I32 of %d dimension%s", td->name, f,
                                what[bit], want_dims, want_dims > 1 ? "s" : "");
        f++;
    }
    if (f != m->nframes)
        return nl_error_set(err, NL_ERR_PROTO, "%s: %d tensor frames, but extras %u names %d",
                            td->name, m->nframes, x, f);
    return NL_OK;
}

static nl_status check_verify_req(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const uint32_t f = m->u.verify_req.flags;
    if (f & ~(uint32_t)(NL_VERIFY_OUTPUTS | NL_VERIFY_NO_WEIGHTS))
        return nl_error_set(err, NL_ERR_RANGE, "%s: flags %u (bits 1 and 2 only)", td->name, f);
    return NL_OK;
}

/* VERIFY_CASE: the frames its fields name, in their order, each of its
 * dtype and rank (their sizes are the receiver's to check against the
 * config). */
static nl_status check_verify_case(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const nl_msg_verify_case *v = &m->u.verify_case;
    nl_dtype want[10];
    int rank[10], n = 0;
    if (v->outputs > 1)
        return nl_error_set(err, NL_ERR_RANGE, "%s: outputs %u (0 or 1)", td->name, v->outputs);
    if (v->weights && v->weights[0] && strlen(v->weights) != 64)
        return nl_error_set(err, NL_ERR_RANGE, "%s: weights is 64 hex digits or empty", td->name);
    if (v->layer0 > v->layer1 || (v->has_embed && v->stage != 0))
        return nl_error_set(err, NL_ERR_RANGE, "%s: layers [%u, %u) of stage %u%s", td->name,
                            v->layer0, v->layer1, v->stage,
                            v->has_embed ? " with the embedding" : "");
    /* hidden states as they crossed the wire: all F32, or all BF16 (--wire
     * bf16), as the frame of the first of them says */
    const int fh = v->has_embed ? (v->has_head ? -1 : 2) : 1;
    const nl_dtype h = fh >= 0 && fh < m->nframes && m->frames[fh].t.dtype == NL_DTYPE_BF16
                           ? NL_DTYPE_BF16
                           : NL_DTYPE_F32;
    want[n] = NL_DTYPE_F32, rank[n++] = 1; /* the weights */
    want[n] = v->has_embed ? NL_DTYPE_I32 : h, rank[n++] = v->has_embed ? 2 : 3;
    if (!v->has_head)
        want[n] = h, rank[n++] = 3; /* the GRADIENT received */
    if (v->counts)
        want[n] = NL_DTYPE_I64, rank[n++] = 2;
    for (int bit = 0; bit < 4; bit++)
        if (v->extras & (1u << bit))
            want[n] = NL_DTYPE_I32, rank[n++] = bit < 2 ? 2 : 1;
    if (v->outputs && !v->has_head)
        want[n] = h, rank[n++] = 3; /* the ACTIVATION it sent */
    if (v->outputs && !v->has_embed)
        want[n] = h, rank[n++] = 3; /* the GRADIENT it sent */
    if (m->nframes != n)
        return nl_error_set(err, NL_ERR_PROTO, "%s: %d tensor frames, its fields name %d", td->name,
                            m->nframes, n);
    for (int i = 0; i < n; i++)
        if (m->frames[i].t.dtype != want[i] || m->frames[i].t.ndim != rank[i])
            return nl_error_set(err, NL_ERR_DTYPE, "%s: frame %d must be %s of %d dimension%s",
                                td->name, i, nl_dtype_name(want[i]), rank[i],
                                rank[i] > 1 ? "s" : "");
    return NL_OK;
}

static nl_status check_verify_result(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const nl_msg_verify_result *v = &m->u.verify_result;
    const size_t f = v->fwd ? strlen(v->fwd) : 0, b = v->bwd ? strlen(v->bwd) : 0;
    if ((f != 0 && f != 64) || (b != 0 && b != 64))
        return nl_error_set(err, NL_ERR_RANGE, "%s: a digest is 64 hex digits or empty", td->name);
    if (v->want_weights > 1 || (v->want_weights && (f || b)))
        return nl_error_set(err, NL_ERR_RANGE, "%s: want_weights %u (0, or 1 with no digests)",
                            td->name, v->want_weights);
    return NL_OK;
}

static bool param_key_ok(const char *k)
{
    size_t n = k ? strlen(k) : 0;
    return n >= 1 && n <= 64 && strspn(k, "abcdefghijklmnopqrstuvwxyz0123456789_.-") == n;
}

static nl_status check_job_submit(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    const nl_msg_job_submit *j = &m->u.job_submit;
    for (uint32_t i = 0; i < j->nparams; i++) {
        const nl_wire_param *p = &j->params[i];
        if (!param_key_ok(p->key))
            return nl_error_set(err, NL_ERR_RANGE, "%s.params: key %u must be 1-64 of [a-z0-9_.-]",
                                td->name, i);
        for (uint32_t k = 0; k < i; k++)
            if (strcmp(j->params[k].key, p->key) == 0)
                return nl_error_set(err, NL_ERR_PROTO, "%s.params: duplicate key '%s'", td->name,
                                    p->key);
        size_t n = p->kind == NL_WIRE_PARAM_STR && p->s ? strlen(p->s) : 0;
        if ((unsigned)p->kind > NL_WIRE_PARAM_BOOL ||
            (p->kind == NL_WIRE_PARAM_FLOAT && !isfinite(p->f)) ||
            (p->kind == NL_WIRE_PARAM_STR && (n > 4096 || !utf8_ok((const uint8_t *)p->s, n))))
            return nl_error_set(err, NL_ERR_RANGE, "%s.params.%s: bad value", td->name, p->key);
    }
    return NL_OK;
}

nl_status nl_wire_schema_check(nl_wire_msg *m, const nl_wire_tdesc *td, const nl_wire_limits *lim,
                               bool decoding, nl_error *err)
{
    for (int i = 0; i < td->nf; i++) {
        nl_status st = check_field(td, &td->f[i], &m->u, err);
        if (st != NL_OK)
            return st;
    }
    nl_status st = check_frames(m, td, lim, decoding, err);
    if (st == NL_OK && td->check)
        st = td->check(m, td, err);
    return st;
}
