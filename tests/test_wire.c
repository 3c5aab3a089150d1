/* Unit tests for the wire codec (net/wire.c): every message type round-trips;
 * the malformed-message matrix (every type truncated at every offset, every
 * field given every wrong type, missing / duplicate / unknown keys, each
 * limit plus one, wrong shapes, dtypes, versions and types) is refused with
 * the right status; random mutations never crash. Headers are re-packed
 * with msgpack-c, an independent implementation, to build the bad cases.
 *
 *   test_wire                     run the tests
 *   test_wire --write-corpus DIR  write the fuzz seed corpus (fuzz/corpus/wire) */
#include <math.h>
#include <msgpack.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../net/wire.h"
#include "check.h"

static const nl_msg_type all_types[] = {
    NL_MSG_HELLO,      NL_MSG_HELLO_ACK,  NL_MSG_ERROR,     NL_MSG_JOIN,       NL_MSG_ACCEPT,
    NL_MSG_HEARTBEAT,  NL_MSG_LEAVE,      NL_MSG_ASSIGN,    NL_MSG_LAYER_LOAD, NL_MSG_LOAD_DONE,
    NL_MSG_ACTIVATION, NL_MSG_GRADIENT,   NL_MSG_TOKEN,     NL_MSG_JOB_SUBMIT, NL_MSG_JOB_STATUS,
    NL_MSG_JOB_CANCEL, NL_MSG_JOB_QUERY,  NL_MSG_GRAD_NORM, NL_MSG_STEP,       NL_MSG_CKPT_REQ,
    NL_MSG_CKPT_DONE,  NL_MSG_RESULT,
};
#define NTYPES (int)(sizeof all_types / sizeof all_types[0])

#define KEY_A "wRbKYzxIQTl+D?ZETf+ukt)!*]MF&1g3]Vtqp:Pb"
#define KEY_B "4MlA35H1MocC(vJi?ueF}kxI:5T?tGOf*cSUM7a5"

static float act[2 * 3 * 16];
static int32_t toks_frame[2 * 5];
static float chunk[64];
static const uint32_t token_ids[5] = {0, 1, 50256, 7, 4294967295u};
static const nl_wire_param params[4] = {
    {.key = "seq_len", .kind = NL_WIRE_PARAM_INT, .i = -12},
    {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.75},
    {.key = "prompt", .kind = NL_WIRE_PARAM_STR, .s = "Once upon a time \xc3\xa9"},
    {.key = "greedy", .kind = NL_WIRE_PARAM_BOOL, .b = true},
};

static void set_frame(nl_wire_frame *f, nl_dtype dt, void *data, int ndim, const int64_t *shape)
{
    memset(f, 0, sizeof *f);
    f->t.dtype = dt;
    f->t.ndim = ndim;
    f->t.data = data;
    for (int i = 0; i < ndim; i++)
        f->t.shape[i] = shape[i];
}

/* A valid message of each type, with distinctive values. */
static void sample(nl_wire_msg *m, nl_msg_type t)
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
        m->u.join = (nl_msg_join){KEY_A, "cuda:1", 8ull << 30, 1234.5, 16, "tcp://10.0.0.2:7001"};
        break;
    case NL_MSG_ACCEPT:
        m->u.accept = (nl_msg_accept){7, 1000, 10000};
        break;
    case NL_MSG_HEARTBEAT:
        m->u.heartbeat = (nl_msg_heartbeat){7, 123456789012ull, NL_NODE_BUSY, 0.5};
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
                                      .memory_planned = 3ull << 30};
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
    case NL_MSG_GRADIENT: {
        m->u.hop = (nl_msg_tensor_hop){11, 250, 3, 99, 17, 0.125};
        int64_t sh[3] = {2, 3, 16};
        set_frame(&m->frames[0], t == NL_MSG_GRADIENT ? NL_DTYPE_BF16 : NL_DTYPE_F32, act, 3, sh);
        m->nframes = 1;
        if (t == NL_MSG_ACTIVATION) { /* the targets ride along */
            int64_t tsh[2] = {2, 5};
            set_frame(&m->frames[1], NL_DTYPE_I32, toks_frame, 2, tsh);
            m->nframes = 2;
        }
        break;
    }
    case NL_MSG_TOKEN:
        m->u.token = (nl_msg_token){11, 99, 5, token_ids, true};
        break;
    case NL_MSG_JOB_SUBMIT: {
        m->u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, 4, params};
        int64_t sh[2] = {2, 5};
        set_frame(&m->frames[0], NL_DTYPE_I32, toks_frame, 2, sh);
        m->nframes = 1;
        break;
    }
    case NL_MSG_JOB_STATUS:
        m->u.job_status = (nl_msg_job_status){11, NL_JOB_RUNNING, 0.25, "step 250 of 1000"};
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
    case NL_MSG_GRAD_NORM:
        m->u.grad_norm = (nl_msg_grad_norm){11, 250, 2, 3.5e4};
        break;
    case NL_MSG_STEP:
        m->u.step = (nl_msg_step){11, 250, true, 0.5, 3e-4};
        break;
    case NL_MSG_CKPT_REQ:
        m->u.ckpt_req = (nl_msg_ckpt_req){11, 250, "ckpt/step-250"};
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

static bool seq(const char *a, const char *b)
{
    return strcmp(a ? a : "", b ? b : "") == 0;
}

/* Field-by-field equality, written out per type (not via the codec's
 * own schema tables, so a wrong table entry shows up here). */
static bool same_msg(const nl_wire_msg *a, const nl_wire_msg *b)
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
               seq(p->join.data_endpoint, q->join.data_endpoint);
    case NL_MSG_ACCEPT:
        return memcmp(&p->accept, &q->accept, sizeof p->accept) == 0;
    case NL_MSG_HEARTBEAT:
        return p->heartbeat.node_id == q->heartbeat.node_id &&
               p->heartbeat.seq == q->heartbeat.seq && p->heartbeat.state == q->heartbeat.state &&
               p->heartbeat.load == q->heartbeat.load;
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
               x->memory_planned == y->memory_planned;
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
    case NL_MSG_RESULT:
    case NL_MSG_GRADIENT:
        return p->hop.job_id == q->hop.job_id && p->hop.step == q->hop.step &&
               p->hop.microbatch == q->hop.microbatch && p->hop.session_id == q->hop.session_id &&
               p->hop.pos_offset == q->hop.pos_offset && p->hop.aux == q->hop.aux;
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
               seq(p->job_status.message, q->job_status.message);
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

typedef struct enc {
    nl_wire_wbuf hdr;
    nl_wire_part parts[NL_WIRE_MAX_FRAMES + 2];
    int nparts;
} enc;

static nl_status enc_msg(nl_wire_msg *m, enc *e, const nl_wire_limits *lim, nl_error *err)
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
static nl_status dec_copy(nl_wire_msg *out, const void *h, size_t hlen, const nl_wire_part *frames,
                          int nf, const nl_wire_limits *lim, nl_error *err)
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

static nl_status dec_parts(nl_wire_msg *out, const enc *e, const nl_wire_limits *lim, nl_error *err)
{
    return dec_copy(out, e->parts[0].data, e->parts[0].len, e->parts + 1, e->nparts - 1, lim, err);
}

static void fill_data(void)
{
    for (size_t i = 0; i < sizeof act / sizeof act[0]; i++)
        act[i] = (float)i * 0.25f - 3.0f;
    for (size_t i = 0; i < sizeof toks_frame / sizeof toks_frame[0]; i++)
        toks_frame[i] = (int32_t)(i * 1000 + 1);
    for (size_t i = 0; i < sizeof chunk / sizeof chunk[0]; i++)
        chunk[i] = (float)i;
}

/* ---- round trips ---- */

static void test_round_trip(void)
{
    nl_wire_msg m, d, d2;
    enc e = {0}, e2 = {0};
    nl_error err;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    nl_wire_msg_init(&d2);
    for (int i = 0; i < NTYPES; i++) {
        nl_msg_type t = all_types[i];
        const char *name = nl_wire_type_name(t);
        sample(&m, t);
        CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
        CHECK_OK(nl_wire_decode(&d, e.parts, e.nparts, NULL, &err), &err);
        CHECK(d.version == NL_WIRE_VERSION, "%s: version %u", name, d.version);
        CHECK(same_msg(&m, &d), "%s: decoded message differs", name);
        /* decoded frames borrow the parts, not copies */
        for (int f = 0; f < d.nframes; f++)
            CHECK(d.frames[f].t.data == e.parts[f + 1].data, "%s: frame %d was copied", name, f);
        /* the decoded message re-encodes to the same bytes */
        CHECK_OK(enc_msg(&d, &e2, NULL, &err), &err);
        CHECK(e2.hdr.len == e.hdr.len && memcmp(e2.hdr.data, e.hdr.data, e.hdr.len) == 0,
              "%s: re-encoding differs", name);
        /* msgpack-c reads our header as a map starting with v and t */
        msgpack_unpacked u;
        msgpack_unpacked_init(&u);
        size_t off = 0;
        int rc = msgpack_unpack_next(&u, (const char *)e.hdr.data, e.hdr.len, &off);
        CHECK(rc == MSGPACK_UNPACK_SUCCESS && off == e.hdr.len, "%s: msgpack-c rc %d", name, rc);
        if (rc == MSGPACK_UNPACK_SUCCESS) {
            msgpack_object o = u.data;
            CHECK(o.type == MSGPACK_OBJECT_MAP && o.via.map.size >= 2, "%s: not a map", name);
            if (o.type == MSGPACK_OBJECT_MAP && o.via.map.size >= 2) {
                msgpack_object_kv *kv = o.via.map.ptr;
                CHECK(kv[0].key.via.str.size == 1 && kv[0].key.via.str.ptr[0] == 'v' &&
                          kv[0].val.via.u64 == NL_WIRE_VERSION,
                      "%s: first key is not v", name);
                CHECK(kv[1].key.via.str.size == 1 && kv[1].key.via.str.ptr[0] == 't' &&
                          kv[1].val.via.u64 == (uint64_t)t,
                      "%s: second key is not t", name);
            }
        }
        msgpack_unpacked_destroy(&u);
        uint32_t pv, pt;
        nl_wire_peek(e.hdr.data, e.hdr.len, &pv, &pt);
        CHECK(pv == NL_WIRE_VERSION && pt == (uint32_t)t, "%s: peek %u %u", name, pv, pt);
    }
    /* the arena is reused: decoding the same message again does not grow it */
    sample(&m, NL_MSG_ASSIGN);
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    CHECK_OK(nl_wire_decode(&d, e.parts, e.nparts, NULL, &err), &err);
    size_t cap = d.arena_cap;
    uint8_t *arena = d.arena;
    for (int k = 0; k < 100; k++)
        CHECK_OK(nl_wire_decode(&d, e.parts, e.nparts, NULL, &err), &err);
    CHECK(d.arena_cap == cap && d.arena == arena, "arena changed on re-decode");
    /* non-finite gradient norms are reportable; -inf is not */
    sample(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm.sumsq = INFINITY;
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    CHECK_OK(nl_wire_decode(&d, e.parts, e.nparts, NULL, &err), &err);
    CHECK(isinf(d.u.grad_norm.sumsq), "inf sumsq lost");
    m.u.grad_norm.sumsq = NAN;
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    m.u.grad_norm.sumsq = -INFINITY;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE, "-inf sumsq encoded");
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_msg_free(&d2);
    nl_wire_wbuf_free(&e.hdr);
    nl_wire_wbuf_free(&e2.hdr);
}

/* ---- truncation: every type, every offset ---- */

static void test_truncation(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    int refused = 0, total = 0;
    for (int i = 0; i < NTYPES; i++) {
        sample(&m, all_types[i]);
        CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
        for (size_t k = 0; k < e.hdr.len; k++) {
            nl_status st = dec_copy(&d, e.hdr.data, k, e.parts + 1, e.nparts - 1, NULL, &err);
            total++;
            refused += st != NL_OK;
            CHECK(st != NL_OK, "%s truncated to %zu of %zu bytes was accepted",
                  nl_wire_type_name(all_types[i]), k, e.hdr.len);
        }
        /* each frame one byte short and one byte long, or missing */
        for (int f = 0; f < m.nframes; f++) {
            nl_wire_part fr[NL_WIRE_MAX_FRAMES];
            memcpy(fr, e.parts + 1, sizeof(nl_wire_part) * (size_t)(e.nparts - 1));
            for (int delta = -1; delta <= 1; delta += 2) {
                fr[f].len = e.parts[f + 1].len + (size_t)(ptrdiff_t)delta;
                uint8_t big[4096];
                memset(big, 0, sizeof big);
                memcpy(big, e.parts[f + 1].data, e.parts[f + 1].len);
                fr[f].data = big;
                nl_status st = dec_copy(&d, e.hdr.data, e.hdr.len, fr, e.nparts - 1, NULL, &err);
                CHECK(st == NL_ERR_SHAPE, "%s frame %d %+d bytes: %s",
                      nl_wire_type_name(all_types[i]), f, delta, nl_status_str(st));
            }
            nl_status st = dec_copy(&d, e.hdr.data, e.hdr.len, e.parts + 1, f, NULL, &err);
            CHECK(st == NL_ERR_PROTO, "%s with %d of %d frames: %s",
                  nl_wire_type_name(all_types[i]), f, m.nframes, nl_status_str(st));
        }
    }
    CHECK(refused == total && total > 1000, "%d of %d truncations refused", refused, total);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_wbuf_free(&e.hdr);
}

/* ---- re-packing headers with msgpack-c ---- */

enum { W_NIL, W_BOOL, W_UINT, W_STR, W_FLOAT, W_ARRAY, W_MAP, W_NEG, W_COUNT };

static int obj_class(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        return W_NIL;
    case MSGPACK_OBJECT_BOOLEAN:
        return W_BOOL;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        return W_UINT;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return W_NEG;
    case MSGPACK_OBJECT_STR:
        return W_STR;
    case MSGPACK_OBJECT_ARRAY:
        return W_ARRAY;
    case MSGPACK_OBJECT_MAP:
        return W_MAP;
    default:
        return W_FLOAT;
    }
}

static void pack_wrong(msgpack_packer *pk, int w)
{
    switch (w) {
    case W_NIL:
        msgpack_pack_nil(pk);
        break;
    case W_BOOL:
        msgpack_pack_true(pk);
        break;
    case W_UINT:
        msgpack_pack_uint64(pk, 7);
        break;
    case W_STR:
        msgpack_pack_str_with_body(pk, "x", 1);
        break;
    case W_FLOAT:
        msgpack_pack_double(pk, 1.5);
        break;
    case W_ARRAY:
        msgpack_pack_array(pk, 1);
        msgpack_pack_uint64(pk, 1);
        break;
    case W_MAP:
        msgpack_pack_map(pk, 1);
        msgpack_pack_str_with_body(pk, "a", 1);
        msgpack_pack_uint64(pk, 1);
        break;
    default:
        msgpack_pack_int64(pk, -3);
        break;
    }
}

typedef struct edit {
    int replace, wrong; /* value of entry `replace` becomes wrong-kind `wrong` */
    int drop, dup;      /* entry dropped / written twice */
    bool extra;         /* an unknown key added */
} edit;

static void repack(msgpack_sbuffer *sb, const msgpack_object *map, edit ed)
{
    msgpack_packer pk;
    msgpack_sbuffer_clear(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    uint32_t n = map->via.map.size;
    msgpack_pack_map(&pk, n - (ed.drop >= 0) + (ed.dup >= 0) + ed.extra);
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object_kv *kv = &map->via.map.ptr[i];
        if ((int)i == ed.drop)
            continue;
        for (int rep = 0; rep < 1 + ((int)i == ed.dup); rep++) {
            msgpack_pack_object(&pk, kv->key);
            if ((int)i == ed.replace)
                pack_wrong(&pk, ed.wrong);
            else
                msgpack_pack_object(&pk, kv->val);
        }
    }
    if (ed.extra) {
        msgpack_pack_str_with_body(&pk, "surprise", 8);
        msgpack_pack_uint64(&pk, 1);
    }
}

static void test_wrong_types(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    int cases = 0;
    for (int i = 0; i < NTYPES; i++) {
        const char *tn = nl_wire_type_name(all_types[i]);
        sample(&m, all_types[i]);
        CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
        msgpack_unpacked u;
        msgpack_unpacked_init(&u);
        size_t off = 0;
        msgpack_unpack_next(&u, (const char *)e.hdr.data, e.hdr.len, &off);
        const msgpack_object *map = &u.data;
        /* the unchanged re-pack is accepted (the harness itself is sound) */
        repack(&sb, map, (edit){-1, 0, -1, -1, false});
        CHECK_OK(dec_copy(&d, sb.data, sb.size, e.parts + 1, e.nparts - 1, NULL, &err), &err);
        for (uint32_t k = 0; k < map->via.map.size; k++) {
            const msgpack_object_kv *kv = &map->via.map.ptr[k];
            char key[32];
            snprintf(key, sizeof key, "%.*s", (int)kv->key.via.str.size, kv->key.via.str.ptr);
            int cls = obj_class(&kv->val);
            for (int w = 0; w < W_COUNT; w++) {
                if (w == cls || (cls == W_FLOAT && (w == W_UINT || w == W_NEG)))
                    continue; /* same class, or an integer where a number is wanted */
                repack(&sb, map, (edit){(int)k, w, -1, -1, false});
                nl_status st =
                    dec_copy(&d, sb.data, sb.size, e.parts + 1, e.nparts - 1, NULL, &err);
                cases++;
                CHECK(st != NL_OK, "%s.%s given wrong kind %d was accepted", tn, key, w);
                if (k >= 2)
                    CHECK(strstr(err.msg, key) != NULL, "%s.%s kind %d: message '%s'", tn, key, w,
                          err.msg);
            }
            /* missing, and duplicated */
            repack(&sb, map, (edit){-1, 0, (int)k, -1, false});
            nl_status st = dec_copy(&d, sb.data, sb.size, e.parts + 1, e.nparts - 1, NULL, &err);
            CHECK(st != NL_OK, "%s without %s was accepted", tn, key);
            repack(&sb, map, (edit){-1, 0, -1, (int)k, false});
            st = dec_copy(&d, sb.data, sb.size, e.parts + 1, e.nparts - 1, NULL, &err);
            CHECK(st != NL_OK, "%s with %s twice was accepted", tn, key);
            cases += 2;
        }
        repack(&sb, map, (edit){-1, 0, -1, -1, true});
        nl_status st = dec_copy(&d, sb.data, sb.size, e.parts + 1, e.nparts - 1, NULL, &err);
        CHECK(st == NL_ERR_PROTO && strstr(err.msg, "surprise"), "%s with an unknown key: %s", tn,
              err.msg);
        msgpack_unpacked_destroy(&u);
    }
    CHECK(cases > 700, "only %d wrong-type cases", cases);
    msgpack_sbuffer_destroy(&sb);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_wbuf_free(&e.hdr);
}

/* ---- limits ---- */

/* A header {v, t, <key>: <raw msgpack value>} for hand-made cases. */
static void raw_header(msgpack_sbuffer *sb, uint32_t v, uint32_t t, int nextra)
{
    msgpack_packer pk;
    msgpack_sbuffer_clear(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 2 + (size_t)nextra);
    msgpack_pack_str_with_body(&pk, "v", 1);
    msgpack_pack_uint64(&pk, v);
    msgpack_pack_str_with_body(&pk, "t", 1);
    msgpack_pack_uint64(&pk, t);
}

static nl_status dec_sb(nl_wire_msg *d, const msgpack_sbuffer *sb, const nl_wire_limits *lim,
                        nl_error *err)
{
    return dec_copy(d, sb->data, sb->size, NULL, 0, lim, err);
}

static void test_limits(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    nl_wire_limits def = nl_wire_limits_default(), lim;

    /* header size: exactly the limit passes, one byte more fails */
    sample(&m, NL_MSG_ASSIGN);
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    lim = def;
    lim.max_header = e.hdr.len;
    CHECK_OK(dec_parts(&d, &e, &lim, &err), &err);
    lim.max_header = e.hdr.len - 1;
    CHECK(dec_parts(&d, &e, &lim, &err) == NL_ERR_LIMIT, "header over limit: %s", err.msg);
    CHECK(nl_wire_encode(&m, &e.hdr, &lim, &err) == NL_ERR_LIMIT, "encoder over header limit");
    /* the default 64 KiB: a 65 KiB header is refused before it is parsed */
    char *big = calloc(70000, 1);
    memset(big, 'a', 69999);
    raw_header(&sb, 1, NL_MSG_LEAVE, 1);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_str_with_body(&pk, "reason", 6);
    msgpack_pack_str_with_body(&pk, big, def.max_header + 1 - sb.size - 3); /* str16 */
    CHECK(sb.size == def.max_header + 1, "size %zu", sb.size);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_LIMIT, "64 KiB + 1: %s", err.msg);

    /* string length: max_str passes the walk, max_str + 1 does not */
    lim = def;
    lim.max_str = 20;
    for (int extra = 0; extra <= 1; extra++) {
        raw_header(&sb, 1, NL_MSG_LEAVE, 2);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_str_with_body(&pk, "node_id", 7);
        msgpack_pack_uint64(&pk, 1);
        msgpack_pack_str_with_body(&pk, "reason", 6);
        msgpack_pack_str_with_body(&pk, big, 20 + (size_t)extra);
        nl_status st = dec_sb(&d, &sb, &lim, &err);
        CHECK(extra ? st == NL_ERR_LIMIT : st == NL_OK, "str %d: %s", 20 + extra, err.msg);
    }
    /* a field's own limit: LEAVE.reason <= 1024 */
    sample(&m, NL_MSG_LEAVE);
    big[1025] = '\0';
    m.u.leave.reason = big + 1;
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    m.u.leave.reason = big;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE, "1025-byte reason encoded");
    raw_header(&sb, 1, NL_MSG_LEAVE, 2);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_str_with_body(&pk, "node_id", 7);
    msgpack_pack_uint64(&pk, 1);
    msgpack_pack_str_with_body(&pk, "reason", 6);
    msgpack_pack_str_with_body(&pk, big, 1025);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_RANGE, "1025-byte reason: %s", err.msg);

    /* array length: tokens, with the walk limit and the field limit (4096) */
    static uint32_t many[5000];
    for (int extra = 0; extra <= 1; extra++) {
        sample(&m, NL_MSG_TOKEN);
        m.u.token.tokens = many;
        m.u.token.ntokens = 4096 + (uint32_t)extra;
        nl_status st = nl_wire_encode(&m, &e.hdr, NULL, &err);
        CHECK(extra ? st == NL_ERR_LIMIT : st == NL_OK, "encode %d tokens: %s", 4096 + extra,
              err.msg);
        raw_header(&sb, 1, NL_MSG_TOKEN, 4);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_str_with_body(&pk, "job_id", 6);
        msgpack_pack_uint64(&pk, 1);
        msgpack_pack_str_with_body(&pk, "session_id", 10);
        msgpack_pack_uint64(&pk, 1);
        msgpack_pack_str_with_body(&pk, "done", 4);
        msgpack_pack_false(&pk);
        msgpack_pack_str_with_body(&pk, "tokens", 6);
        msgpack_pack_array(&pk, 4096 + (size_t)extra);
        for (int k = 0; k < 4096 + extra; k++)
            msgpack_pack_uint64(&pk, (uint64_t)k);
        st = dec_sb(&d, &sb, NULL, &err);
        CHECK(extra ? st == NL_ERR_LIMIT : st == NL_OK, "decode %d tokens: %s", 4096 + extra,
              err.msg);
        lim = def;
        lim.max_array = 100;
        st = dec_sb(&d, &sb, &lim, &err);
        CHECK(st == NL_ERR_LIMIT, "max_array 100: %s", nl_status_str(st));
    }
    /* an array header that claims more entries than bytes left */
    raw_header(&sb, 1, NL_MSG_TOKEN, 1);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_str_with_body(&pk, "tokens", 6);
    msgpack_pack_array(&pk, 3000);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_PROTO, "short array: %s", err.msg);
    /* msgpack-c issue #1013: five bytes claiming a huge array / map */
    const uint8_t huge_arr[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
    const uint8_t huge_map[] = {0xdf, 0xff, 0xff, 0xff, 0xff};
    nl_wire_msg fresh;
    nl_wire_msg_init(&fresh);
    CHECK(dec_copy(&fresh, huge_arr, 5, NULL, 0, NULL, &err) != NL_OK, "huge array accepted");
    CHECK(dec_copy(&fresh, huge_map, 5, NULL, 0, NULL, &err) != NL_OK, "huge map accepted");
    CHECK(fresh.arena_cap == 0, "arena grew to %zu for a 5-byte header", fresh.arena_cap);
    nl_wire_msg_free(&fresh);

    /* nesting: depth 4 reaches the schema (wrong type), depth 5 stops at the walk */
    for (int depth = 4; depth <= 5; depth++) {
        raw_header(&sb, 1, NL_MSG_TOKEN, 1);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_str_with_body(&pk, "tokens", 6);
        for (int k = 1; k < depth; k++)
            msgpack_pack_array(&pk, 1);
        msgpack_pack_uint64(&pk, 1);
        nl_status st = dec_sb(&d, &sb, NULL, &err);
        CHECK(st == (depth == 5 ? NL_ERR_LIMIT : NL_ERR_PROTO), "depth %d: %s", depth, err.msg);
    }
    /* deep nesting far past the cap does not recurse */
    raw_header(&sb, 1, NL_MSG_TOKEN, 1);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_str_with_body(&pk, "tokens", 6);
    for (int k = 0; k < 10000; k++)
        msgpack_pack_array(&pk, 1);
    msgpack_pack_nil(&pk);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_LIMIT, "10000 deep: %s", err.msg);

    /* dimensions: 8 pass, 9 fail */
    static float one[1];
    for (int nd = 8; nd <= 9; nd++) {
        sample(&m, NL_MSG_ACTIVATION);
        m.nframes = 1;
        m.frames[0].t.ndim = nd;
        m.frames[0].t.data = one;
        for (int k = 0; k < 8; k++)
            m.frames[0].t.shape[k] = 1;
        if (nd == 8) {
            CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
            CHECK_OK(dec_parts(&d, &e, NULL, &err), &err);
            continue;
        }
        CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_SHAPE, "9 dims encoded");
        /* hand-made: a 9-dim descriptor */
        m.frames[0].t.ndim = 8;
        CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
        uint8_t *h = malloc(e.hdr.len + 1);
        /* the shape array is the header's last item: 0x98 + eight 0x01 */
        memcpy(h, e.hdr.data, e.hdr.len);
        CHECK(h[e.hdr.len - 9] == 0x98, "shape layout 0x%02x", h[e.hdr.len - 9]);
        h[e.hdr.len - 9] = 0x99;
        h[e.hdr.len] = 0x01;
        nl_status st = dec_copy(&d, h, e.hdr.len + 1, e.parts + 1, 1, NULL, &err);
        CHECK(st == NL_ERR_LIMIT, "9 dims decoded: %s", err.msg);
        free(h);
    }

    /* frame count: the type's range, the limit, and the hard cap */
    sample(&m, NL_MSG_JOB_SUBMIT);
    for (int k = 1; k < 4; k++)
        m.frames[k] = m.frames[0];
    m.nframes = 4;
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    CHECK_OK(dec_parts(&d, &e, NULL, &err), &err);
    lim = def;
    lim.max_frames = 3;
    CHECK(dec_parts(&d, &e, &lim, &err) == NL_ERR_LIMIT, "4 frames, limit 3: %s", err.msg);
    m.frames[4] = m.frames[0];
    m.nframes = 5;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_PROTO, "5 JOB_SUBMIT frames encoded");
    nl_wire_part parts17[NL_WIRE_MAX_FRAMES + 2];
    for (int k = 0; k < NL_WIRE_MAX_FRAMES + 2; k++)
        parts17[k] = e.parts[k < 2 ? k : 1];
    CHECK(nl_wire_decode(&d, parts17, NL_WIRE_MAX_FRAMES + 2, NULL, &err) == NL_ERR_LIMIT,
          "17 frames: %s", err.msg);

    /* frame bytes: exactly the limit passes, one element more fails */
    static float fb[1025];
    lim = def;
    lim.max_frame_bytes = 4096;
    for (int extra = 0; extra <= 1; extra++) {
        sample(&m, NL_MSG_ACTIVATION);
        m.nframes = 1;
        m.frames[0].t.ndim = 1;
        m.frames[0].t.shape[0] = 1024 + extra;
        m.frames[0].t.data = fb;
        nl_status st = enc_msg(&m, &e, &lim, &err);
        CHECK(extra ? st == NL_ERR_LIMIT : st == NL_OK, "encode %d floats: %s", 1024 + extra,
              err.msg);
        CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
        st = dec_parts(&d, &e, &lim, &err);
        CHECK(extra ? st == NL_ERR_LIMIT : st == NL_OK, "decode %d floats: %s", 1024 + extra,
              err.msg);
    }
    free(big);
    msgpack_sbuffer_destroy(&sb);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_wbuf_free(&e.hdr);
}

/* ---- shapes, dtypes, ranges, versions ---- */

/* Encode a sample, let `mutate` break one descriptor by hand in the
 * msgpack object, and decode. */
static nl_status dec_tensor_desc(nl_wire_msg *d, nl_msg_type t, const char *dtype,
                                 const uint64_t *shape, int ndim, size_t frame_len, nl_error *err)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    nl_wire_msg m;
    enc e = {0};
    nl_wire_msg_init(&m);
    sample(&m, t);
    enc_msg(&m, &e, NULL, err);
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    msgpack_unpack_next(&u, (const char *)e.hdr.data, e.hdr.len, &off);
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    const msgpack_object *map = &u.data;
    msgpack_pack_map(&pk, map->via.map.size);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object_kv *kv = &map->via.map.ptr[i];
        msgpack_pack_object(&pk, kv->key);
        if (kv->key.via.str.size == 7 && memcmp(kv->key.via.str.ptr, "tensors", 7) == 0) {
            msgpack_pack_array(&pk, 1);
            msgpack_pack_array(&pk, 2);
            msgpack_pack_str_with_body(&pk, dtype, strlen(dtype));
            msgpack_pack_array(&pk, (size_t)ndim);
            for (int k = 0; k < ndim; k++)
                msgpack_pack_uint64(&pk, shape[k]);
        } else {
            msgpack_pack_object(&pk, kv->val);
        }
    }
    uint8_t *frame = calloc(frame_len ? frame_len : 1, 1);
    nl_wire_part fp = {frame, frame_len};
    nl_status st = dec_copy(d, sb.data, sb.size, &fp, 1, NULL, err);
    free(frame);
    msgpack_unpacked_destroy(&u);
    msgpack_sbuffer_destroy(&sb);
    nl_wire_msg_free(&m);
    nl_wire_wbuf_free(&e.hdr);
    return st;
}

static void test_shapes_dtypes(void)
{
    nl_wire_msg d, m;
    enc e = {0};
    nl_error err;
    nl_wire_msg_init(&d);
    nl_wire_msg_init(&m);
    const uint64_t s23[] = {2, 3};
    CHECK_OK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "F32", s23, 2, 24, &err), &err);
    CHECK_OK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "BF16", s23, 2, 12, &err), &err);
    CHECK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "F32", s23, 2, 20, &err) == NL_ERR_SHAPE,
          "24 vs 20 bytes: %s", err.msg);
    CHECK_OK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "I32", s23, 2, 24, &err), &err); /* tokens */
    CHECK(dec_tensor_desc(&d, NL_MSG_GRADIENT, "I32", s23, 2, 24, &err) == NL_ERR_DTYPE,
          "I32 gradient: %s", err.msg);
    CHECK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "I8", s23, 2, 6, &err) == NL_ERR_DTYPE,
          "I8 activation: %s", err.msg);
    CHECK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "Q4_0", s23, 2, 24, &err) == NL_ERR_DTYPE,
          "unknown dtype: %s", err.msg);
    const uint64_t s0[] = {2, 0};
    CHECK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "F32", s0, 2, 0, &err) == NL_ERR_SHAPE,
          "zero dim: %s", err.msg);
    CHECK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "F32", s23, 0, 4, &err) == NL_ERR_SHAPE,
          "scalar activation: %s", err.msg);
    /* numel * dtype size overflows: refused, no wrap-around (UBSan watches) */
    const uint64_t sover[] = {1ull << 40, 1ull << 40, 1ull << 40};
    CHECK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "F32", sover, 3, 4, &err) == NL_ERR_SHAPE,
          "numel overflow: %s", err.msg);
    const uint64_t sbyte[] = {1ull << 62};
    CHECK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "F32", sbyte, 1, 4, &err) != NL_OK,
          "bytes overflow: %s", err.msg);
    const uint64_t sneg[] = {(uint64_t)INT64_MAX + 1};
    CHECK(dec_tensor_desc(&d, NL_MSG_ACTIVATION, "F32", sneg, 1, 4, &err) == NL_ERR_RANGE,
          "dim above INT64_MAX: %s", err.msg);
    /* ACTIVATION's optional second frame holds I32 targets only */
    sample(&m, NL_MSG_ACTIVATION);
    m.frames[1].t.dtype = NL_DTYPE_F32;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_DTYPE, "F32 targets: %s", err.msg);
    m.frames[2] = m.frames[0];
    m.frames[1].t.dtype = NL_DTYPE_I32;
    m.nframes = 3;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_PROTO, "3 frames: %s", err.msg);
    /* LAYER_LOAD: a chunk running past the end of the tensor */
    sample(&m, NL_MSG_LAYER_LOAD);
    m.u.layer_load.offset = 256 * 256 - 63;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_SHAPE, "chunk past end: %s", err.msg);
    m.u.layer_load.offset = 256 * 256 - 64;
    CHECK_OK(nl_wire_encode(&m, &e.hdr, NULL, &err), &err);
    const uint64_t s2d[] = {8, 8};
    CHECK(dec_tensor_desc(&d, NL_MSG_LAYER_LOAD, "F32", s2d, 2, 256, &err) == NL_ERR_SHAPE,
          "2-D chunk: %s", err.msg);
    nl_wire_msg_free(&d);
    nl_wire_msg_free(&m);
    nl_wire_wbuf_free(&e.hdr);
}

static uint8_t *find_bytes(uint8_t *h, size_t n, const char *pat, size_t k)
{
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(h + i, pat, k) == 0)
            return h + i;
    return NULL;
}

static void test_ranges_versions(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    /* each broken message is refused by the encoder and, sent raw, by the decoder */
    for (int c = 0; c < 10; c++) {
        sample(&m, c < 3   ? NL_MSG_ASSIGN
                   : c < 5 ? NL_MSG_JOIN
                   : c < 7 ? NL_MSG_HEARTBEAT
                   : c < 9 ? NL_MSG_ERROR
                           : NL_MSG_CKPT_DONE);
        switch (c) {
        case 0:
            m.u.assign.stage = 3;
            break; /* stage >= num_stages */
        case 1:
            m.u.assign.layer0 = 10;
            break; /* reversed range */
        case 2:
            m.u.assign.prev_key = "";
            break; /* endpoint without key */
        case 3:
            m.u.join.pubkey = "not a key";
            break;
        case 4:
            m.u.join.device = "tpu:0";
            break;
        case 5:
            m.u.heartbeat.load = NAN;
            break;
        case 6:
            m.u.heartbeat.state = 6;
            break;
        case 7:
            m.u.error.message = "bad \xff utf8";
            break;
        case 8:
            m.u.error.code = 0;
            break;
        case 9:
            m.u.ckpt_done.sha256 =
                "0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef";
            break;
        }
        nl_status st = nl_wire_encode(&m, &e.hdr, NULL, &err);
        CHECK(st == NL_ERR_RANGE, "case %d encoded: %s", c, nl_status_str(st));
    }
    /* the decoder applies the same checks: patch a valid header's bytes */
    sample(&m, NL_MSG_ASSIGN);
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    uint8_t *h = malloc(e.hdr.len);
    memcpy(h, e.hdr.data, e.hdr.len);
    uint8_t *at = find_bytes(h, e.hdr.len, "\xa5stage\x01", 7); /* stage: 1 */
    CHECK(at != NULL, "stage not found");
    if (at) {
        at[6] = 0x03; /* stage 3 of 3 */
        CHECK(dec_copy(&d, h, e.hdr.len, NULL, 0, NULL, &err) == NL_ERR_RANGE,
              "stage 3 of 3 decoded: %s", err.msg);
    }
    free(h);
    /* another protocol version: NL_ERR_VERSION naming both versions */
    sample(&m, NL_MSG_HEARTBEAT);
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    h = malloc(e.hdr.len);
    memcpy(h, e.hdr.data, e.hdr.len);
    CHECK(h[1] == 0xa1 && h[2] == 'v' && h[3] == 0x01, "layout");
    h[3] = 0x02;
    CHECK(dec_copy(&d, h, e.hdr.len, NULL, 0, NULL, &err) == NL_ERR_VERSION, "version 2: %s",
          err.msg);
    CHECK(strstr(err.msg, "version 2") && strstr(err.msg, "version 1"), "message: %s", err.msg);
    CHECK(d.version == 2 && d.type == NL_MSG_HEARTBEAT, "peeked %u %d", d.version, d.type);
    free(h);
    /* an ERROR from another version still reads (its layout is frozen) */
    sample(&m, NL_MSG_ERROR);
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    h = malloc(e.hdr.len);
    memcpy(h, e.hdr.data, e.hdr.len);
    h[3] = 0x07;
    CHECK_OK(dec_copy(&d, h, e.hdr.len, NULL, 0, NULL, &err), &err);
    CHECK(d.version == 7 && d.type == NL_MSG_ERROR, "error v7: %u %d", d.version, d.type);
    free(h);
    /* unknown type; header not a map; v not first; trailing bytes; ext */
    raw_header(&sb, 1, 9, 0);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_PROTO && strstr(err.msg, "unknown message type"),
          "type 9: %s", err.msg);
    raw_header(&sb, 1, 999999, 0);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_PROTO, "type 999999: %s", err.msg);
    msgpack_sbuffer_clear(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_uint64(&pk, 1);
    msgpack_pack_uint64(&pk, 12);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_PROTO, "array header: %s", err.msg);
    msgpack_sbuffer_clear(&sb);
    msgpack_pack_map(&pk, 2);
    msgpack_pack_str_with_body(&pk, "t", 1);
    msgpack_pack_uint64(&pk, NL_MSG_JOB_CANCEL);
    msgpack_pack_str_with_body(&pk, "v", 1);
    msgpack_pack_uint64(&pk, 1);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_PROTO, "t before v: %s", err.msg);
    sample(&m, NL_MSG_JOB_CANCEL);
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    h = malloc(e.hdr.len + 1);
    memcpy(h, e.hdr.data, e.hdr.len);
    h[e.hdr.len] = 0xc0;
    CHECK(dec_copy(&d, h, e.hdr.len + 1, NULL, 0, NULL, &err) == NL_ERR_PROTO, "trailing byte: %s",
          err.msg);
    free(h);
    raw_header(&sb, 1, NL_MSG_JOB_CANCEL, 1);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_str_with_body(&pk, "job_id", 6);
    msgpack_pack_ext_with_body(&pk, "abcd", 4, 5);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_PROTO, "ext value: %s", err.msg);
    /* a frame on a frameless type */
    uint8_t junk[4] = {0};
    nl_wire_part jp = {junk, 4};
    sample(&m, NL_MSG_JOB_CANCEL);
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    CHECK(dec_copy(&d, e.hdr.data, e.hdr.len, &jp, 1, NULL, &err) == NL_ERR_PROTO,
          "frame on JOB_CANCEL: %s", err.msg);
    /* a NUL inside a string */
    raw_header(&sb, 1, NL_MSG_LEAVE, 2);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_str_with_body(&pk, "node_id", 7);
    msgpack_pack_uint64(&pk, 1);
    msgpack_pack_str_with_body(&pk, "reason", 6);
    msgpack_pack_str_with_body(&pk, "a\0b", 3);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_PROTO, "NUL in string: %s", err.msg);
    /* params: duplicate keys, bad key, nested value */
    sample(&m, NL_MSG_JOB_SUBMIT);
    nl_wire_param dup[2] = {params[0], params[0]};
    m.u.job_submit.params = dup;
    m.u.job_submit.nparams = 2;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_PROTO, "dup params: %s", err.msg);
    dup[1].key = "Bad Key";
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE, "bad key: %s", err.msg);
    raw_header(&sb, 1, NL_MSG_JOB_SUBMIT, 3);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_str_with_body(&pk, "kind", 4);
    msgpack_pack_uint64(&pk, 0);
    msgpack_pack_str_with_body(&pk, "tensors", 7);
    msgpack_pack_array(&pk, 0);
    msgpack_pack_str_with_body(&pk, "params", 6);
    msgpack_pack_map(&pk, 1);
    msgpack_pack_str_with_body(&pk, "x", 1);
    msgpack_pack_array(&pk, 0);
    CHECK(dec_sb(&d, &sb, NULL, &err) == NL_ERR_PROTO, "array param: %s", err.msg);
    msgpack_sbuffer_destroy(&sb);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_wbuf_free(&e.hdr);
}

/* ---- random mutations: never crash; what decodes, re-encodes ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void test_mutations(void)
{
    nl_wire_msg m, d, d2;
    enc e = {0}, e2 = {0}, e3 = {0};
    nl_error err;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    nl_wire_msg_init(&d2);
    uint8_t buf[2048];
    int accepted = 0, roundtrip_ok = 0, iters = 30000;
    for (int it = 0; it < iters; it++) {
        sample(&m, all_types[rnd() % NTYPES]);
        enc_msg(&m, &e, NULL, &err);
        size_t n = e.hdr.len < sizeof buf ? e.hdr.len : sizeof buf;
        memcpy(buf, e.hdr.data, n);
        int edits = 1 + (int)(rnd() % 4);
        for (int k = 0; k < edits; k++) {
            size_t at = rnd() % n;
            switch (rnd() % 4) {
            case 0:
                buf[at] = (uint8_t)rnd();
                break;
            case 1:
                buf[at] ^= (uint8_t)(1u << (rnd() % 8));
                break;
            case 2:
                n = at + 1;
                break;
            default:
                buf[at] = (uint8_t[]){0x00, 0x7f, 0x80, 0xc1, 0xdc, 0xdd, 0xde, 0xdf,
                                      0xd9, 0xdb, 0xcf, 0xd3, 0xca, 0xcb, 0xff}[rnd() % 15];
            }
        }
        nl_status st = dec_copy(&d, buf, n, e.parts + 1, e.nparts - 1, NULL, &err);
        if (st != NL_OK)
            continue;
        accepted++;
        /* restore frame pointers (dec_copy freed its copies) to re-encode */
        for (int f = 0; f < d.nframes; f++)
            d.frames[f].t.data = (void *)e.parts[f + 1].data;
        if (enc_msg(&d, &e2, NULL, &err) == NL_OK && dec_parts(&d2, &e2, NULL, &err) == NL_OK) {
            for (int f = 0; f < d2.nframes; f++)
                d2.frames[f].t.data = (void *)e2.parts[f + 1].data;
            if (enc_msg(&d2, &e3, NULL, &err) == NL_OK && e3.hdr.len == e2.hdr.len &&
                memcmp(e3.hdr.data, e2.hdr.data, e2.hdr.len) == 0)
                roundtrip_ok++;
        }
    }
    CHECK(roundtrip_ok == accepted, "%d of %d accepted mutants round-trip", roundtrip_ok, accepted);
    CHECK(accepted < iters, "every mutant was accepted");
    /* pure noise */
    for (int it = 0; it < 20000; it++) {
        size_t n = rnd() % 64;
        for (size_t k = 0; k < n; k++)
            buf[k] = (uint8_t)rnd();
        if (n && rnd() % 2)
            buf[0] = 0x80 | (uint8_t)(rnd() % 16);
        nl_status st = dec_copy(&d, buf, n, NULL, 0, NULL, &err);
        CHECK(st != NL_OK || d.type != NL_MSG_NONE, "noise accepted as NONE");
    }
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_msg_free(&d2);
    nl_wire_wbuf_free(&e.hdr);
    nl_wire_wbuf_free(&e2.hdr);
    nl_wire_wbuf_free(&e3.hdr);
}

/* ---- fuzz corpus (the format of fuzz/fuzz_wire.c) ---- */

static void put_u32(FILE *f, uint32_t v)
{
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    fwrite(b, 1, 4, f);
}

static int write_corpus(const char *dir)
{
    nl_wire_msg m;
    enc e = {0};
    nl_error err;
    nl_wire_msg_init(&m);
    for (int i = 0; i < NTYPES; i++) {
        sample(&m, all_types[i]);
        if (enc_msg(&m, &e, NULL, &err) != NL_OK) {
            fprintf(stderr, "encode: %s\n", err.msg);
            return 1;
        }
        char path[4096];
        snprintf(path, sizeof path, "%s/%02d-%s", dir, all_types[i],
                 nl_wire_type_name(all_types[i]));
        FILE *f = fopen(path, "wb");
        if (!f) {
            perror(path);
            return 1;
        }
        fputc(e.nparts - 1, f);
        put_u32(f, (uint32_t)e.hdr.len);
        fwrite(e.hdr.data, 1, e.hdr.len, f);
        for (int k = 1; k < e.nparts; k++) {
            put_u32(f, (uint32_t)e.parts[k].len);
            fwrite(e.parts[k].data, 1, e.parts[k].len, f);
        }
        fclose(f);
    }
    nl_wire_msg_free(&m);
    nl_wire_wbuf_free(&e.hdr);
    return 0;
}

int main(int argc, char **argv)
{
    fill_data();
    if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0)
        return write_corpus(argv[2]);
    test_round_trip();
    test_truncation();
    test_wrong_types();
    test_limits();
    test_shapes_dtypes();
    test_ranges_versions();
    test_mutations();
    return check_done("test_wire");
}
