/* Sample messages of every type and encode/decode helpers shared by the
 * wire codec's test programs. */
#include "tests/wire_samples.h"

#include <stdlib.h>
#include <string.h>

const nl_msg_type all_types[] = {
    NL_MSG_HELLO,      NL_MSG_HELLO_ACK,  NL_MSG_ERROR,       NL_MSG_JOIN,
    NL_MSG_ACCEPT,     NL_MSG_HEARTBEAT,  NL_MSG_LEAVE,       NL_MSG_ASSIGN,
    NL_MSG_LAYER_LOAD, NL_MSG_LOAD_DONE,  NL_MSG_ACTIVATION,  NL_MSG_GRADIENT,
    NL_MSG_TOKEN,      NL_MSG_JOB_SUBMIT, NL_MSG_JOB_STATUS,  NL_MSG_JOB_CANCEL,
    NL_MSG_JOB_QUERY,  NL_MSG_GRAD_NORM,  NL_MSG_STEP,        NL_MSG_CKPT_REQ,
    NL_MSG_CKPT_DONE,  NL_MSG_RESULT,     NL_MSG_COUNT,       NL_MSG_EVAL,
    NL_MSG_LOSS,       NL_MSG_VERIFY_REQ, NL_MSG_VERIFY_CASE, NL_MSG_VERIFY_RESULT,
    NL_MSG_REDUCE,     NL_MSG_LOCAL_LINK,
};
const int wire_ntypes = (int)(sizeof all_types / sizeof all_types[0]);

float act[2 * 3 * 16];
int32_t toks_frame[2 * 5];
float chunk[64];
static const uint32_t token_ids[5] = {0, 1, 50256, 7, 4294967295u};
const nl_wire_param params[4] = {
    {.key = "seq_len", .kind = NL_WIRE_PARAM_INT, .i = -12},
    {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.75},
    {.key = "prompt", .kind = NL_WIRE_PARAM_STR, .s = "Once upon a time \xc3\xa9"},
    {.key = "greedy", .kind = NL_WIRE_PARAM_BOOL, .b = true},
};

void set_frame(nl_wire_frame *f, nl_dtype dt, void *data, int ndim, const int64_t *shape)
{
    memset(f, 0, sizeof *f);
    f->t.dtype = dt;
    f->t.ndim = ndim;
    f->t.data = data;
    for (int i = 0; i < ndim; i++)
        f->t.shape[i] = shape[i];
}

/* A valid message of each type, with distinctive values. */
void sample(nl_wire_msg *m, nl_msg_type t)
{
    nl_wire_msg_reset(m, t);
    switch (t) {
    case NL_MSG_HELLO:
    case NL_MSG_HELLO_ACK:
        m->u.hello = (nl_msg_hello){NL_ROLE_NODE, "neurollm 0.1.0"};
        break;
    case NL_MSG_ERROR:
        m->u.error = (nl_msg_error){NL_ERR_SHAPE, NL_MSG_ACTIVATION, "shape [2, 3] \xe2\x9c\x93"};
        break;
    case NL_MSG_JOIN:
        m->u.join = (nl_msg_join){
            KEY_A, "cuda:1", 8ull << 30, 1234.5, 16, "tcp://10.0.0.2:7001", NL_JOIN_NO_INBOUND};
        break;
    case NL_MSG_ACCEPT:
        m->u.accept = (nl_msg_accept){7, 1000, 10000};
        break;
    case NL_MSG_HEARTBEAT:
        m->u.heartbeat =
            (nl_msg_heartbeat){7,   123456789012ull, NL_NODE_BUSY, 0.5, 3u << 20, 4, 900, 120, 1.25,
                               7.5, 3ull << 26,      0.5};
        break;
    case NL_MSG_LEAVE:
        m->u.leave = (nl_msg_leave){7, "shutting down"};
        break;
    case NL_MSG_ASSIGN:
        m->u.assign = (nl_msg_assign){.epoch = 3,
                                      .node_id = 7,
                                      .stage = 1,
                                      .num_stages = 3,
                                      .layer0 = 4,
                                      .layer1 = 9,
                                      .has_embed = false,
                                      .has_head = false,
                                      .config_json = "{\"hidden_dim\": 256, \"num_layers\": 12}",
                                      .seed = 42,
                                      .prev_endpoint = "tcp://10.0.0.1:7001",
                                      .prev_key = KEY_A,
                                      .next_endpoint = "tcp://10.0.0.3:7001",
                                      .next_key = KEY_B,
                                      .memory_planned = 3ull << 30,
                                      .links = NL_LINK_NEXT_DIALS};
        break;
    case NL_MSG_LAYER_LOAD: {
        m->u.layer_load = (nl_msg_layer_load){.epoch = 3,
                                              .name = "layers.4.attention.wq.weight",
                                              .ndim = 2,
                                              .shape = {256, 256},
                                              .offset = 1024,
                                              .chunk = 1,
                                              .chunks = 1024};
        int64_t sh[1] = {64};
        set_frame(&m->frames[0], NL_DTYPE_F32, chunk, 1, sh);
        m->nframes = 1;
        break;
    }
    case NL_MSG_LOAD_DONE:
        m->u.load_done = (nl_msg_load_done){3, 7, 58, 123456789};
        break;
    case NL_MSG_ACTIVATION:
    case NL_MSG_COUNT:
    case NL_MSG_EVAL:
    case NL_MSG_GRADIENT: {
        m->u.hop = (nl_msg_tensor_hop){11, 250, 3, 99, 17, 0.125};
        int64_t sh[3] = {2, 3, 16};
        set_frame(&m->frames[0], t == NL_MSG_GRADIENT ? NL_DTYPE_BF16 : NL_DTYPE_F32, act, 3, sh);
        m->nframes = 1;
        if (t != NL_MSG_COUNT) /* a hop's digest (net/hopdigest.h); COUNT's absent */
            m->u.train_hop.digest =
                "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
        if (t == NL_MSG_ACTIVATION || t == NL_MSG_EVAL) { /* the targets ride along */
            int64_t tsh[2] = {2, 5};
            set_frame(&m->frames[1], NL_DTYPE_I32, toks_frame, 2, tsh);
            m->nframes = 2;
        }
        break;
    }
    case NL_MSG_TOKEN:
        m->u.token = (nl_msg_token){11, 99, 5, token_ids, true, 0, NULL};
        break;
    case NL_MSG_JOB_SUBMIT: {
        m->u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, 4, params};
        int64_t sh[2] = {2, 5};
        set_frame(&m->frames[0], NL_DTYPE_I32, toks_frame, 2, sh);
        m->nframes = 1;
        break;
    }
    case NL_MSG_JOB_STATUS:
        /* a stage's failure names the message it could not run */
        m->u.job_status = (nl_msg_job_status){
            11, NL_JOB_FAILED, 0.25, "step 250: cannot reach the next stage", NL_MSG_ACTIVATION};
        break;
    case NL_MSG_JOB_CANCEL:
    case NL_MSG_JOB_QUERY:
        m->u.job_ref = (nl_msg_job_ref){11};
        break;
    case NL_MSG_RESULT: {
        m->u.hop = (nl_msg_tensor_hop){12, 0, 0, 0, 0, 4.25};
        int64_t sh[2] = {6, 16};
        set_frame(&m->frames[0], NL_DTYPE_F32, act, 2, sh);
        m->nframes = 1;
        break;
    }
    case NL_MSG_GRAD_NORM: { /* + the step's hop digests: 2 microbatches */
        static uint8_t digests[2 * NL_DIGEST_KINDS * 32];
        for (size_t i = 0; i < sizeof digests; i++)
            digests[i] = (uint8_t)(i * 7);
        m->u.grad_norm = (nl_msg_grad_norm){11, 250, 2, 3.5e4};
        int64_t sh[3] = {2, NL_DIGEST_KINDS, 32};
        set_frame(&m->frames[0], NL_DTYPE_U8, digests, 3, sh);
        m->nframes = 1;
        break;
    }
    case NL_MSG_STEP:
        m->u.step = (nl_msg_step){11, 250, true, 0.5, 3e-4};
        break;
    case NL_MSG_CKPT_REQ:
        m->u.ckpt_req = (nl_msg_ckpt_req){11, 250, "ckpt/step-250"};
        break;
    case NL_MSG_LOSS:
        m->u.loss = (nl_msg_loss){11, 250, true, 1234.5, 0.0625, 4096};
        break;
    case NL_MSG_VERIFY_REQ:
        m->u.verify_req = (nl_msg_verify_req){11, 250, 3, NL_VERIFY_NO_WEIGHTS};
        break;
    case NL_MSG_VERIFY_CASE: { /* a middle stage: weights, input, gradient, counts, targets */
        static int64_t counts[2 * 4];
        m->u.verify_case = (nl_msg_verify_case){
            11,
            250,
            3,
            1,
            4,
            6,
            false,
            false,
            2,
            5,
            4,
            1234,
            NL_HOP_TARGETS,
            true,
            "{\"hidden_dim\": 16}",
            0,
            "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"};
        const int64_t w[1] = {64}, x[3] = {2, 3, 16}, c[2] = {2, 4}, tg[2] = {2, 5};
        set_frame(&m->frames[0], NL_DTYPE_F32, chunk, 1, w);
        set_frame(&m->frames[1], NL_DTYPE_F32, act, 3, x);
        set_frame(&m->frames[2], NL_DTYPE_F32, act, 3, x);
        set_frame(&m->frames[3], NL_DTYPE_I64, counts, 2, c);
        set_frame(&m->frames[4], NL_DTYPE_I32, toks_frame, 2, tg);
        m->nframes = 5;
        break;
    }
    case NL_MSG_VERIFY_RESULT:
        m->u.verify_result = (nl_msg_verify_result){
            11,
            250,
            3,
            1,
            "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff",
            "",
            0,
            "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100"};
        break;
    case NL_MSG_REDUCE: {
        m->u.reduce = (nl_msg_reduce){11, 250, NL_REDUCE_COUNTS, NL_REDUCE_RESULT, 3, 1, 4, 64, 9};
        const int64_t n[1] = {64};
        set_frame(&m->frames[0], NL_DTYPE_F32, chunk, 1, n);
        m->nframes = 1;
        break;
    }
    case NL_MSG_LOCAL_LINK:
        m->u.local_link = (nl_msg_local_link){
            NL_LOCAL_OFFER, "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0/1000/4026531840",
            "neurollm-7f3a9c21e0b4d658", LOCAL_TOKEN, ""};
        break;
    case NL_MSG_CKPT_DONE:
        m->u.ckpt_done =
            (nl_msg_ckpt_done){11,
                               250,
                               2,
                               "ckpt/step-250/stage-2.safetensors",
                               "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                               987654321};
        break;
    default:
        break;
    }
}

bool seq(const char *a, const char *b)
{
    return strcmp(a ? a : "", b ? b : "") == 0;
}

/* Field-by-field equality, written out per type (not via the codec's
 * own schema tables, so a wrong table entry shows up here). */
bool same_msg(const nl_wire_msg *a, const nl_wire_msg *b)
{
    if (a->type != b->type || a->nframes != b->nframes)
        return false;
    for (int i = 0; i < a->nframes; i++) {
        const nl_wire_frame *x = &a->frames[i], *y = &b->frames[i];
        if (x->t.dtype != y->t.dtype || x->t.ndim != y->t.ndim || x->len != y->len ||
            memcmp(x->t.shape, y->t.shape, sizeof(int64_t) * (size_t)x->t.ndim) != 0 ||
            memcmp(x->t.data, y->t.data, x->len) != 0)
            return false;
    }
    const __typeof__(a->u) *p = &a->u, *q = &b->u;
    switch (a->type) {
    case NL_MSG_HELLO:
    case NL_MSG_HELLO_ACK:
        return p->hello.role == q->hello.role && seq(p->hello.software, q->hello.software);
    case NL_MSG_ERROR:
        return p->error.code == q->error.code && p->error.req_type == q->error.req_type &&
               seq(p->error.message, q->error.message);
    case NL_MSG_JOIN:
        return seq(p->join.pubkey, q->join.pubkey) && seq(p->join.device, q->join.device) &&
               p->join.memory_bytes == q->join.memory_bytes &&
               p->join.gemm_gflops == q->join.gemm_gflops && p->join.threads == q->join.threads &&
               seq(p->join.data_endpoint, q->join.data_endpoint) && p->join.flags == q->join.flags;
    case NL_MSG_ACCEPT:
        return memcmp(&p->accept, &q->accept, sizeof p->accept) == 0;
    case NL_MSG_HEARTBEAT:
        return p->heartbeat.node_id == q->heartbeat.node_id &&
               p->heartbeat.seq == q->heartbeat.seq && p->heartbeat.state == q->heartbeat.state &&
               p->heartbeat.load == q->heartbeat.load &&
               p->heartbeat.kv_bytes == q->heartbeat.kv_bytes &&
               p->heartbeat.sessions == q->heartbeat.sessions &&
               p->heartbeat.hops == q->heartbeat.hops &&
               p->heartbeat.batches == q->heartbeat.batches &&
               p->heartbeat.compute_s == q->heartbeat.compute_s &&
               p->heartbeat.hop_s == q->heartbeat.hop_s;
    case NL_MSG_LEAVE:
        return p->leave.node_id == q->leave.node_id && seq(p->leave.reason, q->leave.reason);
    case NL_MSG_ASSIGN: {
        const nl_msg_assign *x = &p->assign, *y = &q->assign;
        return x->epoch == y->epoch && x->node_id == y->node_id && x->stage == y->stage &&
               x->num_stages == y->num_stages && x->layer0 == y->layer0 && x->layer1 == y->layer1 &&
               x->has_embed == y->has_embed && x->has_head == y->has_head &&
               seq(x->config_json, y->config_json) && x->seed == y->seed &&
               seq(x->prev_endpoint, y->prev_endpoint) && seq(x->prev_key, y->prev_key) &&
               seq(x->next_endpoint, y->next_endpoint) && seq(x->next_key, y->next_key) &&
               x->memory_planned == y->memory_planned && x->links == y->links &&
               x->replica == y->replica && x->replicas == y->replicas &&
               seq(x->ring_endpoint, y->ring_endpoint) && seq(x->ring_key, y->ring_key) &&
               seq(x->ring_prev_key, y->ring_prev_key) && seq(x->prev_keys, y->prev_keys) &&
               seq(x->next_endpoints, y->next_endpoints) && seq(x->next_keys, y->next_keys);
    }
    case NL_MSG_LAYER_LOAD: {
        const nl_msg_layer_load *x = &p->layer_load, *y = &q->layer_load;
        return x->epoch == y->epoch && seq(x->name, y->name) && x->ndim == y->ndim &&
               memcmp(x->shape, y->shape, sizeof(int64_t) * (size_t)x->ndim) == 0 &&
               x->offset == y->offset && x->chunk == y->chunk && x->chunks == y->chunks;
    }
    case NL_MSG_LOAD_DONE:
        return memcmp(&p->load_done, &q->load_done, sizeof p->load_done) == 0;
    case NL_MSG_ACTIVATION:
    case NL_MSG_COUNT:
    case NL_MSG_EVAL:
    case NL_MSG_RESULT:
    case NL_MSG_GRADIENT:
        return p->hop.job_id == q->hop.job_id && p->hop.step == q->hop.step &&
               p->hop.microbatch == q->hop.microbatch && p->hop.session_id == q->hop.session_id &&
               p->hop.pos_offset == q->hop.pos_offset && p->hop.aux == q->hop.aux &&
               (a->type == NL_MSG_RESULT || seq(p->train_hop.digest, q->train_hop.digest));
    case NL_MSG_TOKEN:
        return p->token.job_id == q->token.job_id && p->token.session_id == q->token.session_id &&
               p->token.ntokens == q->token.ntokens && p->token.done == q->token.done &&
               memcmp(p->token.tokens, q->token.tokens, 4 * (size_t)p->token.ntokens) == 0;
    case NL_MSG_JOB_SUBMIT:
        if (p->job_submit.kind != q->job_submit.kind ||
            p->job_submit.nparams != q->job_submit.nparams)
            return false;
        for (uint32_t i = 0; i < p->job_submit.nparams; i++) {
            const nl_wire_param *x = &p->job_submit.params[i], *y = &q->job_submit.params[i];
            if (!seq(x->key, y->key) || x->kind != y->kind)
                return false;
            if ((x->kind == NL_WIRE_PARAM_INT && x->i != y->i) ||
                (x->kind == NL_WIRE_PARAM_FLOAT && x->f != y->f) ||
                (x->kind == NL_WIRE_PARAM_STR && !seq(x->s, y->s)) ||
                (x->kind == NL_WIRE_PARAM_BOOL && x->b != y->b))
                return false;
        }
        return true;
    case NL_MSG_JOB_STATUS:
        return p->job_status.job_id == q->job_status.job_id &&
               p->job_status.state == q->job_status.state &&
               p->job_status.progress == q->job_status.progress &&
               seq(p->job_status.message, q->job_status.message) &&
               p->job_status.req_type == q->job_status.req_type;
    case NL_MSG_JOB_CANCEL:
    case NL_MSG_JOB_QUERY:
        return p->job_ref.job_id == q->job_ref.job_id;
    case NL_MSG_GRAD_NORM:
        return p->grad_norm.job_id == q->grad_norm.job_id &&
               p->grad_norm.step == q->grad_norm.step && p->grad_norm.stage == q->grad_norm.stage &&
               p->grad_norm.sumsq == q->grad_norm.sumsq;
    case NL_MSG_STEP:
        return p->step.job_id == q->step.job_id && p->step.step == q->step.step &&
               p->step.apply == q->step.apply && p->step.clip_scale == q->step.clip_scale &&
               p->step.lr == q->step.lr;
    case NL_MSG_CKPT_REQ:
        return p->ckpt_req.job_id == q->ckpt_req.job_id && p->ckpt_req.step == q->ckpt_req.step &&
               seq(p->ckpt_req.dir, q->ckpt_req.dir);
    case NL_MSG_VERIFY_REQ:
        return memcmp(&p->verify_req, &q->verify_req, sizeof p->verify_req) == 0;
    case NL_MSG_VERIFY_CASE: {
        const nl_msg_verify_case *x = &p->verify_case, *y = &q->verify_case;
        return x->job_id == y->job_id && x->step == y->step && x->microbatch == y->microbatch &&
               x->stage == y->stage && x->layer0 == y->layer0 && x->layer1 == y->layer1 &&
               x->has_embed == y->has_embed && x->has_head == y->has_head && x->batch == y->batch &&
               x->seq == y->seq && x->microbatches == y->microbatches &&
               x->loss_rows == y->loss_rows && x->extras == y->extras && x->counts == y->counts &&
               seq(x->config_json, y->config_json) && x->outputs == y->outputs &&
               seq(x->weights, y->weights);
    }
    case NL_MSG_VERIFY_RESULT: {
        const nl_msg_verify_result *x = &p->verify_result, *y = &q->verify_result;
        return x->job_id == y->job_id && x->step == y->step && x->microbatch == y->microbatch &&
               x->stage == y->stage && seq(x->fwd, y->fwd) && seq(x->bwd, y->bwd) &&
               x->want_weights == y->want_weights && seq(x->weights, y->weights);
    }
    case NL_MSG_REDUCE:
        return memcmp(&p->reduce, &q->reduce, sizeof p->reduce) == 0;
    case NL_MSG_LOCAL_LINK: {
        const nl_msg_local_link *x = &p->local_link, *y = &q->local_link;
        return x->op == y->op && seq(x->host, y->host) && seq(x->name, y->name) &&
               seq(x->token, y->token) && seq(x->reason, y->reason);
    }
    case NL_MSG_LOSS:
        return p->loss.job_id == q->loss.job_id && p->loss.step == q->loss.step &&
               p->loss.eval == q->loss.eval && p->loss.ce_sum == q->loss.ce_sum &&
               p->loss.aux == q->loss.aux && p->loss.rows == q->loss.rows;
    case NL_MSG_CKPT_DONE:
        return p->ckpt_done.job_id == q->ckpt_done.job_id &&
               p->ckpt_done.step == q->ckpt_done.step && p->ckpt_done.stage == q->ckpt_done.stage &&
               seq(p->ckpt_done.path, q->ckpt_done.path) &&
               seq(p->ckpt_done.sha256, q->ckpt_done.sha256) &&
               p->ckpt_done.bytes == q->ckpt_done.bytes;
    default:
        return false;
    }
}

/* ---- helpers: encode to parts, decode from exact-size heap copies ---- */

nl_status enc_msg(nl_wire_msg *m, enc *e, const nl_wire_limits *lim, nl_error *err)
{
    nl_status st = nl_wire_encode(m, &e->hdr, lim, err);
    if (st != NL_OK)
        return st;
    e->parts[0] = (nl_wire_part){e->hdr.data, e->hdr.len};
    for (int i = 0; i < m->nframes; i++)
        e->parts[i + 1] = (nl_wire_part){m->frames[i].t.data, m->frames[i].len};
    e->nparts = 1 + m->nframes;
    return NL_OK;
}

/* Decode from heap copies of exactly the given sizes, so any read past a
 * part's end is an ASan error. */
nl_status dec_copy(nl_wire_msg *out, const void *h, size_t hlen, const nl_wire_part *frames, int nf,
                   const nl_wire_limits *lim, nl_error *err)
{
    nl_wire_part parts[NL_WIRE_MAX_FRAMES + 4] = {{0}};
    void *bufs[NL_WIRE_MAX_FRAMES + 4] = {0};
    int n = 1 + nf;
    for (int i = 0; i < n; i++) {
        size_t len = i == 0 ? hlen : frames[i - 1].len;
        const void *src = i == 0 ? h : frames[i - 1].data;
        bufs[i] = malloc(len ? len : 1);
        if (len)
            memcpy(bufs[i], src, len);
        parts[i] = (nl_wire_part){bufs[i], len};
    }
    nl_status st = nl_wire_decode(out, parts, n, lim, err);
    for (int i = 0; i < n; i++)
        free(bufs[i]);
    /* frames now dangle: tests that keep them use enc parts directly */
    for (int i = 0; i < out->nframes; i++)
        out->frames[i].t.data = NULL;
    return st;
}

nl_status dec_parts(nl_wire_msg *out, const enc *e, const nl_wire_limits *lim, nl_error *err)
{
    return dec_copy(out, e->parts[0].data, e->parts[0].len, e->parts + 1, e->nparts - 1, lim, err);
}

void fill_data(void)
{
    for (size_t i = 0; i < sizeof act / sizeof act[0]; i++)
        act[i] = (float)i * 0.25f - 3.0f;
    for (size_t i = 0; i < sizeof toks_frame / sizeof toks_frame[0]; i++)
        toks_frame[i] = (int32_t)(i * 1000 + 1);
    for (size_t i = 0; i < sizeof chunk / sizeof chunk[0]; i++)
        chunk[i] = (float)i;
}

const int32_t hx_tokens[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
const int32_t hx_targets[10] = {-1, 2, -1, -1, 5, -1, 7, -1, -1, -1};
const int32_t hx_docs[10] = {0, 0, 0, 1, 1, 0, 0, 0, 0, 1};
const int32_t hx_labels[2] = {1, 0}, hx_lengths[2] = {3, 4};

/* A training hop with extras (NL_HOP_* bits) and loss rows: tokens [2, 5]
 * and the named arrays; LOSS with a correct count when type is LOSS. */
void extras_sample(nl_wire_msg *m, nl_msg_type type, unsigned extras)
{
    const int64_t sh[2] = {2, 5};
    nl_wire_msg_reset(m, type);
    if (type == NL_MSG_LOSS) {
        m->u.loss = (nl_msg_loss){11, 250, true, 3.5, 0.0, 37};
        m->u.train_loss.correct = 29;
        return;
    }
    m->u.hop = (nl_msg_tensor_hop){11, 250, 3, 0, 0, 0.0};
    nl_wire_frame_set(&m->frames[0], hx_tokens, NL_DTYPE_I32, sh, 2);
    m->nframes = 1;
    nl_wire_hop_set_extras(
        m, 2, 5, extras & NL_HOP_TARGETS ? hx_targets : NULL, extras & NL_HOP_DOCS ? hx_docs : NULL,
        extras & NL_HOP_LABELS ? hx_labels : NULL, extras & NL_HOP_LENGTHS ? hx_lengths : NULL);
    m->u.train_hop.loss_rows = extras & NL_HOP_LABELS ? 2 : 3;
    m->u.train_hop.epoch = 40 + extras;
}
