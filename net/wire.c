/* The wire codec: schema tables for every message type, a bounded msgpack
 * reader (two passes: a structural walk that enforces the limits, then a
 * typed decode against the schema), and the encoder (msgpack-c's packer
 * writing into a reusable buffer).
 *
 * Why a hand-checked reader and not msgpack-c's unpacker: msgpack_unpack
 * allocates what a container's header declares before reading its
 * elements (msgpack-c issue #1013: five bytes ask for a 96 GB allocation)
 * and has no nesting limit, so it would need a full bounded walk first
 * anyway; once that walk exists, decoding straight into the typed message
 * costs one more pass over at most 64 KiB and no zone allocations, and
 * nothing in the decoder then depends on a length it has not checked. */
#include "wire.h"

#include <math.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tensor frames are sent in host order, which must be little-endian"
#endif

/* ===================== the schema ===================== */

typedef enum fkind {
    FK_U32,
    FK_U64,
    FK_F64,
    FK_BOOL,
    FK_STR,
    FK_U32_LIST,
    FK_DIMS,
    FK_PARAMS
} fkind;
typedef enum charset { CS_UTF8, CS_PRINT, CS_WORD, CS_HEX, CS_Z85 } charset;

/* One header field. lo/hi bound the value (integers), the length
 * (strings) or the count (lists); flo/fhi bound a float. */
typedef struct field {
    const char *name;
    uint8_t kind, cs, nonfinite_ok;
    uint16_t off, count_off;
    uint64_t lo, hi;
    double flo, fhi;
} field;

/* the range is "lo, hi" (or U32_ANY, U64_ANY) */
#define F_U32(S, m, ...)                                                                           \
    {                                                                                              \
#m, FK_U32, 0, 0, offsetof(S, m), 0, __VA_ARGS__, 0, 0                                     \
    }
#define F_U64(S, m, ...)                                                                           \
    {                                                                                              \
#m, FK_U64, 0, 0, offsetof(S, m), 0, __VA_ARGS__, 0, 0                                     \
    }
#define F_F64(S, m, a, b)                                                                          \
    {                                                                                              \
#m, FK_F64, 0, 0, offsetof(S, m), 0, 0, 0, (a), (b)                                        \
    }
#define F_BOOL(S, m)                                                                               \
    {                                                                                              \
#m, FK_BOOL, 0, 0, offsetof(S, m), 0, 0, 1, 0, 0                                           \
    }
#define F_STR(S, m, cs, a, b)                                                                      \
    {                                                                                              \
#m, FK_STR, (cs), 0, offsetof(S, m), 0, (a), (b), 0, 0                                     \
    }
#define F_LIST(S, m, kind, cnt, a, b)                                                              \
    {                                                                                              \
#m, (kind), 0, 0, offsetof(S, m), offsetof(S, cnt), (a), (b), 0, 0                         \
    }
#define U64_ANY 0, UINT64_MAX
#define U32_ANY 0, UINT32_MAX

typedef struct tdesc {
    const char *name;
    const field *f;
    uint8_t nf;
    uint8_t min_frames, max_frames, min_dims, max_dims;
    uint16_t dtypes; /* bit per nl_dtype allowed in frames */
    nl_status (*check)(const nl_wire_msg *m, const struct tdesc *td, nl_error *err);
} tdesc;

#define DT(x) (1u << NL_DTYPE_##x)
#define DT_FLOAT (DT(F32) | DT(F16) | DT(BF16))
#define NF(a) (uint8_t)(sizeof(a) / sizeof(a[0]))

static const field f_hello[] = {
    F_U32(nl_msg_hello, role, NL_ROLE_COORDINATOR, NL_ROLE_CLIENT),
    F_STR(nl_msg_hello, software, CS_PRINT, 0, 64),
};
static const field f_error[] = {
    F_U32(nl_msg_error, code, 1, 999),
    F_U32(nl_msg_error, req_type, 0, NL_MSG_TYPE_MAX - 1),
    F_STR(nl_msg_error, message, CS_UTF8, 0, 1024),
};
static const field f_join[] = {
    F_STR(nl_msg_join, pubkey, CS_Z85, NL_KEY_Z85_LEN, NL_KEY_Z85_LEN),
    F_STR(nl_msg_join, device, CS_WORD, 3, 32),
    F_U64(nl_msg_join, memory_bytes, 1, UINT64_MAX),
    F_F64(nl_msg_join, gemm_gflops, 0, 1e9),
    F_U32(nl_msg_join, threads, 1, 65536),
    F_STR(nl_msg_join, data_endpoint, CS_WORD, 7, 256),
};
static const field f_accept[] = {
    F_U32(nl_msg_accept, node_id, U32_ANY),
    F_U32(nl_msg_accept, heartbeat_ms, 10, 3600000),
    F_U32(nl_msg_accept, timeout_ms, 10, 86400000),
};
static const field f_heartbeat[] = {
    F_U32(nl_msg_heartbeat, node_id, U32_ANY),
    F_U64(nl_msg_heartbeat, seq, U64_ANY),
    F_U32(nl_msg_heartbeat, state, NL_NODE_IDLE, NL_NODE_FAILED),
    F_F64(nl_msg_heartbeat, load, 0, 1e6),
};
static const field f_leave[] = {
    F_U32(nl_msg_leave, node_id, U32_ANY),
    F_STR(nl_msg_leave, reason, CS_UTF8, 0, 1024),
};
static const field f_assign[] = {
    F_U64(nl_msg_assign, epoch, U64_ANY),
    F_U32(nl_msg_assign, node_id, U32_ANY),
    F_U32(nl_msg_assign, stage, 0, 4095),
    F_U32(nl_msg_assign, num_stages, 1, 4096),
    F_U32(nl_msg_assign, layer0, 0, 65536),
    F_U32(nl_msg_assign, layer1, 0, 65536),
    F_BOOL(nl_msg_assign, has_embed),
    F_BOOL(nl_msg_assign, has_head),
    F_STR(nl_msg_assign, config_json, CS_UTF8, 2, 49152),
    F_U64(nl_msg_assign, seed, U64_ANY),
    F_STR(nl_msg_assign, prev_endpoint, CS_WORD, 0, 256),
    F_STR(nl_msg_assign, prev_key, CS_Z85, 0, NL_KEY_Z85_LEN),
    F_STR(nl_msg_assign, next_endpoint, CS_WORD, 0, 256),
    F_STR(nl_msg_assign, next_key, CS_Z85, 0, NL_KEY_Z85_LEN),
    F_U64(nl_msg_assign, memory_planned, U64_ANY),
};
static const field f_layer_load[] = {
    F_U64(nl_msg_layer_load, epoch, U64_ANY),
    F_STR(nl_msg_layer_load, name, CS_WORD, 1, 256),
    F_LIST(nl_msg_layer_load, shape, FK_DIMS, ndim, 1, NL_MAX_DIMS),
    F_U64(nl_msg_layer_load, offset, 0, INT64_MAX),
    F_U32(nl_msg_layer_load, chunk, 0, UINT32_MAX - 1),
    F_U32(nl_msg_layer_load, chunks, 1, UINT32_MAX),
};
static const field f_load_done[] = {
    F_U64(nl_msg_load_done, epoch, U64_ANY),
    F_U32(nl_msg_load_done, node_id, U32_ANY),
    F_U32(nl_msg_load_done, tensors, U32_ANY),
    F_U64(nl_msg_load_done, bytes, U64_ANY),
};
static const field f_hop[] = {
    F_U64(nl_msg_tensor_hop, job_id, U64_ANY),
    F_U64(nl_msg_tensor_hop, step, U64_ANY),
    F_U32(nl_msg_tensor_hop, microbatch, U32_ANY),
    F_U64(nl_msg_tensor_hop, session_id, U64_ANY),
    F_U64(nl_msg_tensor_hop, pos_offset, 0, INT32_MAX),
};
static const field f_token[] = {
    F_U64(nl_msg_token, job_id, U64_ANY),
    F_U64(nl_msg_token, session_id, U64_ANY),
    F_LIST(nl_msg_token, tokens, FK_U32_LIST, ntokens, 0, 4096),
    F_BOOL(nl_msg_token, done),
};
static const field f_job_submit[] = {
    F_U32(nl_msg_job_submit, kind, NL_JOB_FORWARD, NL_JOB_TRAIN),
    F_LIST(nl_msg_job_submit, params, FK_PARAMS, nparams, 0, 64),
};
static const field f_job_status[] = {
    F_U64(nl_msg_job_status, job_id, U64_ANY),
    F_U32(nl_msg_job_status, state, NL_JOB_QUEUED, NL_JOB_CANCELLED),
    F_F64(nl_msg_job_status, progress, 0, 1),
    F_STR(nl_msg_job_status, message, CS_UTF8, 0, 1024),
};
static const field f_job_ref[] = {
    F_U64(nl_msg_job_ref, job_id, U64_ANY),
};
static const field f_grad_norm[] = {
    F_U64(nl_msg_grad_norm, job_id, U64_ANY),
    F_U64(nl_msg_grad_norm, step, U64_ANY),
    F_U32(nl_msg_grad_norm, stage, 0, 4095),
    /* inf/NaN are allowed: they report an overflow, and the step is skipped */
    {"sumsq", FK_F64, 0, 1, offsetof(nl_msg_grad_norm, sumsq), 0, 0, 0, 0, HUGE_VAL},
};
static const field f_step[] = {
    F_U64(nl_msg_step, job_id, U64_ANY), F_U64(nl_msg_step, step, U64_ANY),
    F_BOOL(nl_msg_step, apply),          F_F64(nl_msg_step, clip_scale, 0, 1),
    F_F64(nl_msg_step, lr, 0, 1000),
};
static const field f_ckpt_req[] = {
    F_U64(nl_msg_ckpt_req, job_id, U64_ANY),
    F_U64(nl_msg_ckpt_req, step, U64_ANY),
    F_STR(nl_msg_ckpt_req, dir, CS_PRINT, 1, 1024),
};
static const field f_ckpt_done[] = {
    F_U64(nl_msg_ckpt_done, job_id, U64_ANY),
    F_U64(nl_msg_ckpt_done, step, U64_ANY),
    F_U32(nl_msg_ckpt_done, stage, 0, 4095),
    F_STR(nl_msg_ckpt_done, path, CS_PRINT, 1, 1024),
    F_STR(nl_msg_ckpt_done, sha256, CS_HEX, 64, 64),
    F_U64(nl_msg_ckpt_done, bytes, U64_ANY),
};

static nl_status check_join(const nl_wire_msg *m, const tdesc *td, nl_error *err);
static nl_status check_accept(const nl_wire_msg *m, const tdesc *td, nl_error *err);
static nl_status check_assign(const nl_wire_msg *m, const tdesc *td, nl_error *err);
static nl_status check_layer_load(const nl_wire_msg *m, const tdesc *td, nl_error *err);
static nl_status check_job_submit(const nl_wire_msg *m, const tdesc *td, nl_error *err);
static nl_status check_activation(const nl_wire_msg *m, const tdesc *td, nl_error *err);

static const tdesc tdescs[NL_MSG_TYPE_MAX] = {
    [NL_MSG_HELLO] = {"HELLO", f_hello, NF(f_hello), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_HELLO_ACK] = {"HELLO_ACK", f_hello, NF(f_hello), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_ERROR] = {"ERROR", f_error, NF(f_error), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_JOIN] = {"JOIN", f_join, NF(f_join), 0, 0, 0, 0, 0, check_join},
    [NL_MSG_ACCEPT] = {"ACCEPT", f_accept, NF(f_accept), 0, 0, 0, 0, 0, check_accept},
    [NL_MSG_HEARTBEAT] = {"HEARTBEAT", f_heartbeat, NF(f_heartbeat), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_LEAVE] = {"LEAVE", f_leave, NF(f_leave), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_ASSIGN] = {"ASSIGN", f_assign, NF(f_assign), 0, 0, 0, 0, 0, check_assign},
    [NL_MSG_LAYER_LOAD] = {"LAYER_LOAD", f_layer_load, NF(f_layer_load), 1, 1, 1, 1,
                           DT_FLOAT | DT(F64) | DT(I32) | DT(I64), check_layer_load},
    [NL_MSG_LOAD_DONE] = {"LOAD_DONE", f_load_done, NF(f_load_done), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_ACTIVATION] = {"ACTIVATION", f_hop, NF(f_hop), 1, 2, 1, NL_MAX_DIMS, DT_FLOAT | DT(I32),
                           check_activation},
    [NL_MSG_GRADIENT] = {"GRADIENT", f_hop, NF(f_hop), 1, 1, 1, NL_MAX_DIMS, DT_FLOAT, NULL},
    [NL_MSG_TOKEN] = {"TOKEN", f_token, NF(f_token), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_JOB_SUBMIT] = {"JOB_SUBMIT", f_job_submit, NF(f_job_submit), 0, 4, 1, NL_MAX_DIMS,
                           DT(I32) | DT(I64) | DT(F32), check_job_submit},
    [NL_MSG_JOB_STATUS] = {"JOB_STATUS", f_job_status, NF(f_job_status), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_JOB_CANCEL] = {"JOB_CANCEL", f_job_ref, NF(f_job_ref), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_JOB_QUERY] = {"JOB_QUERY", f_job_ref, NF(f_job_ref), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_JOB_RESULT] = {"JOB_RESULT", f_job_ref, NF(f_job_ref), 1, 4, 1, NL_MAX_DIMS,
                           DT_FLOAT | DT(I32) | DT(I64), NULL},
    [NL_MSG_GRAD_NORM] = {"GRAD_NORM", f_grad_norm, NF(f_grad_norm), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_STEP] = {"STEP", f_step, NF(f_step), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_CKPT_REQ] = {"CKPT_REQ", f_ckpt_req, NF(f_ckpt_req), 0, 0, 0, 0, 0, NULL},
    [NL_MSG_CKPT_DONE] = {"CKPT_DONE", f_ckpt_done, NF(f_ckpt_done), 0, 0, 0, 0, 0, NULL},
};

static const tdesc *tdesc_of(uint32_t type)
{
    return type < NL_MSG_TYPE_MAX && tdescs[type].name ? &tdescs[type] : NULL;
}

const char *nl_wire_type_name(uint32_t type)
{
    const tdesc *td = tdesc_of(type);
    return td ? td->name : NULL;
}

/* ===================== messages, buffers, limits ===================== */

nl_wire_limits nl_wire_limits_default(void)
{
    nl_wire_limits l = {
        .max_header = 64 * 1024,
        .max_depth = 4,
        .max_str = 49152,
        .max_array = 4096,
        .max_frames = NL_WIRE_MAX_FRAMES,
        .max_dims = NL_MAX_DIMS,
        .max_frame_bytes = 1ull << 30,
    };
    return l;
}

/* Defaults for NULL; the hard caps (array sizes) can never be exceeded. */
static const nl_wire_limits *clamp_limits(const nl_wire_limits *in, nl_wire_limits *out)
{
    *out = in ? *in : nl_wire_limits_default();
    if (out->max_frames > NL_WIRE_MAX_FRAMES || out->max_frames < 0)
        out->max_frames = NL_WIRE_MAX_FRAMES;
    if (out->max_dims > NL_MAX_DIMS || out->max_dims < 0)
        out->max_dims = NL_MAX_DIMS;
    if (out->max_depth > NL_WIRE_MAX_DEPTH)
        out->max_depth = NL_WIRE_MAX_DEPTH;
    return out;
}

void nl_wire_msg_init(nl_wire_msg *m)
{
    memset(m, 0, sizeof *m);
}

void nl_wire_msg_reset(nl_wire_msg *m, nl_msg_type type)
{
    uint8_t *arena = m->arena;
    size_t cap = m->arena_cap;
    memset(m, 0, sizeof *m);
    m->arena = arena;
    m->arena_cap = cap;
    m->type = type;
    m->version = NL_WIRE_VERSION;
}

void nl_wire_msg_free(nl_wire_msg *m)
{
    if (!m)
        return;
    free(m->arena);
    memset(m, 0, sizeof *m);
}

void nl_wire_wbuf_free(nl_wire_wbuf *b)
{
    if (!b)
        return;
    free(b->data);
    memset(b, 0, sizeof *b);
}

static void *arena_take(nl_wire_msg *m, size_t n, size_t align)
{
    size_t at = (m->arena_used + align - 1) & ~(align - 1);
    if (at > m->arena_cap || n > m->arena_cap - at)
        return NULL;
    m->arena_used = at + n;
    return m->arena + at;
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

static bool charset_ok(charset cs, const char *s, size_t n)
{
    const uint8_t *u = (const uint8_t *)s;
    switch (cs) {
    case CS_UTF8:
        return utf8_ok(u, n);
    case CS_Z85:
        return n == 0 || nl_wire_z85_key_ok(s, n);
    default:
        break;
    }
    for (size_t i = 0; i < n; i++) {
        uint8_t c = u[i];
        bool ok = cs == CS_PRINT  ? (c >= 0x20 && c <= 0x7e)
                  : cs == CS_WORD ? (c >= 0x21 && c <= 0x7e)
                                  : ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
        if (!ok)
            return false;
    }
    return true;
}

static const char *charset_what(charset cs)
{
    static const char *const what[] = {"valid UTF-8", "printable ASCII",
                                       "printable ASCII without spaces", "lowercase hex digits",
                                       "a Z85 key"};
    return what[cs];
}

#define FVAL(base, f, T) (*(T const *)((const uint8_t *)(base) + (f)->off))

static nl_status check_field(const tdesc *td, const field *f, const void *base, nl_error *err)
{
    uint64_t u = 0;
    switch ((fkind)f->kind) {
    case FK_U32:
        u = FVAL(base, f, uint32_t);
        goto int_range;
    case FK_U64:
        u = FVAL(base, f, uint64_t);
    int_range:
        if (u < f->lo || u > f->hi)
            return nl_error_set(err, NL_ERR_RANGE, "%s.%s: %llu is outside [%llu, %llu]", td->name,
                                f->name, (unsigned long long)u, (unsigned long long)f->lo,
                                (unsigned long long)f->hi);
        return NL_OK;
    case FK_F64: {
        double d = FVAL(base, f, double);
        if (!isfinite(d) && f->nonfinite_ok && !(d < 0))
            return NL_OK;
        if (!isfinite(d) || d < f->flo || d > f->fhi)
            return nl_error_set(err, NL_ERR_RANGE, "%s.%s: %g is outside [%g, %g]", td->name,
                                f->name, d, f->flo, f->fhi);
        return NL_OK;
    }
    case FK_BOOL:
        return NL_OK;
    case FK_STR: {
        const char *s = FVAL(base, f, const char *);
        size_t n = s ? strlen(s) : 0;
        if (n < f->lo || n > f->hi)
            return nl_error_set(err, NL_ERR_RANGE,
                                "%s.%s: string of %zu bytes, allowed %llu to %llu", td->name,
                                f->name, n, (unsigned long long)f->lo, (unsigned long long)f->hi);
        if (!charset_ok((charset)f->cs, s ? s : "", n))
            return nl_error_set(err, NL_ERR_RANGE, "%s.%s: must be %s", td->name, f->name,
                                charset_what((charset)f->cs));
        return NL_OK;
    }
    case FK_U32_LIST:
    case FK_PARAMS:
        u = *(const uint32_t *)((const uint8_t *)base + f->count_off);
        goto count_range;
    case FK_DIMS: {
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
static nl_status check_frames(nl_wire_msg *m, const tdesc *td, const nl_wire_limits *lim,
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
        for (int d = 0; d < t->ndim; d++)
            if (t->shape[d] < 1)
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

static nl_status check_join(const nl_wire_msg *m, const tdesc *td, nl_error *err)
{
    const nl_msg_join *j = &m->u.join;
    const char *d = j->device;
    bool ok = strcmp(d, "cpu") == 0;
    if (!ok && strncmp(d, "cuda:", 5) == 0) {
        size_t n = strlen(d + 5);
        ok = n >= 1 && n <= 4 && strspn(d + 5, "0123456789") == n;
    }
    if (!ok)
        return nl_error_set(err, NL_ERR_RANGE, "%s.device: '%s' is not cpu or cuda:N", td->name, d);
    if (strncmp(j->data_endpoint, "tcp://", 6) != 0 && strncmp(j->data_endpoint, "ipc://", 6) != 0)
        return nl_error_set(err, NL_ERR_RANGE, "%s.data_endpoint: '%s' is not tcp:// or ipc://",
                            td->name, j->data_endpoint);
    return NL_OK;
}

static nl_status check_accept(const nl_wire_msg *m, const tdesc *td, nl_error *err)
{
    if (m->u.accept.timeout_ms < m->u.accept.heartbeat_ms)
        return nl_error_set(err, NL_ERR_RANGE, "%s: timeout_ms %u is below heartbeat_ms %u",
                            td->name, m->u.accept.timeout_ms, m->u.accept.heartbeat_ms);
    return NL_OK;
}

static nl_status check_assign(const nl_wire_msg *m, const tdesc *td, nl_error *err)
{
    const nl_msg_assign *a = &m->u.assign;
    if (a->stage >= a->num_stages)
        return nl_error_set(err, NL_ERR_RANGE, "%s: stage %u is not below num_stages %u", td->name,
                            a->stage, a->num_stages);
    if (a->layer0 > a->layer1)
        return nl_error_set(err, NL_ERR_RANGE, "%s: layer range [%u, %u) is reversed", td->name,
                            a->layer0, a->layer1);
    if (a->has_embed && a->stage != 0)
        return nl_error_set(err, NL_ERR_RANGE, "%s: has_embed on stage %u", td->name, a->stage);
    if (a->has_head && a->stage + 1 != a->num_stages)
        return nl_error_set(err, NL_ERR_RANGE, "%s: has_head on stage %u of %u", td->name, a->stage,
                            a->num_stages);
    if (!a->prev_endpoint[0] != !a->prev_key[0] || !a->next_endpoint[0] != !a->next_key[0])
        return nl_error_set(err, NL_ERR_RANGE,
                            "%s: a neighbour's endpoint and key must both be set or both empty",
                            td->name);
    return NL_OK;
}

static nl_status check_layer_load(const nl_wire_msg *m, const tdesc *td, nl_error *err)
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

static nl_status check_activation(const nl_wire_msg *m, const tdesc *td, nl_error *err)
{
    if (m->nframes == 2 && m->frames[1].t.dtype != NL_DTYPE_I32)
        return nl_error_set(err, NL_ERR_DTYPE, "%s: frame 1 (targets) must be I32", td->name);
    return NL_OK;
}

static bool param_key_ok(const char *k)
{
    size_t n = k ? strlen(k) : 0;
    return n >= 1 && n <= 64 && strspn(k, "abcdefghijklmnopqrstuvwxyz0123456789_.-") == n;
}

static nl_status check_job_submit(const nl_wire_msg *m, const tdesc *td, nl_error *err)
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
        size_t n = p->kind == NL_PARAM_STR && p->s ? strlen(p->s) : 0;
        if ((unsigned)p->kind > NL_PARAM_BOOL || (p->kind == NL_PARAM_FLOAT && !isfinite(p->f)) ||
            (p->kind == NL_PARAM_STR && (n > 4096 || !utf8_ok((const uint8_t *)p->s, n))))
            return nl_error_set(err, NL_ERR_RANGE, "%s.params.%s: bad value", td->name, p->key);
    }
    return NL_OK;
}

static nl_status check_msg(nl_wire_msg *m, const tdesc *td, const nl_wire_limits *lim,
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

/* ===================== the bounded reader ===================== */

typedef struct rd {
    const uint8_t *p, *start, *end;
} rd;

typedef enum itkind {
    IT_NIL,
    IT_BOOL,
    IT_UINT,
    IT_NEG,
    IT_FLOAT,
    IT_STR,
    IT_BIN,
    IT_ARRAY,
    IT_MAP,
    IT_EXT
} itkind;

typedef struct item {
    itkind k;
    uint64_t u; /* IT_UINT, IT_BOOL */
    int64_t i;  /* IT_NEG */
    double f;   /* IT_FLOAT */
    uint32_t n; /* length (str, bin, ext) or entries (array, map) */
    const uint8_t *body;
} item;

static const char *const itnames[] = {"nil",   "bool",   "unsigned integer", "negative integer",
                                      "float", "string", "binary",           "array",
                                      "map",   "ext"};

static bool rd_be(rd *r, int n, uint64_t *v)
{
    if (r->end - r->p < n)
        return false;
    uint64_t x = 0;
    for (int i = 0; i < n; i++)
        x = (x << 8) | r->p[i];
    r->p += n;
    *v = x;
    return true;
}

static nl_status truncated(const rd *r, nl_error *err)
{
    return nl_error_set(err, NL_ERR_PROTO, "header truncated or malformed at byte %td",
                        r->p - r->start);
}

/* Read one item's head; strings, binaries and exts are skipped over (their
 * body is checked to lie inside the buffer), containers are not entered. */
static nl_status rd_head(rd *r, item *it, nl_error *err)
{
    uint64_t v = 0;
    memset(it, 0, sizeof *it);
    if (r->p >= r->end)
        return truncated(r, err);
    uint8_t c = *r->p++;
    int lenbytes = 0;
    if (c <= 0x7f) {
        it->k = IT_UINT, it->u = c;
        return NL_OK;
    } else if (c >= 0xe0) {
        it->k = IT_NEG, it->i = (int8_t)c;
        return NL_OK;
    } else if ((c & 0xf0) == 0x80) {
        it->k = IT_MAP, it->n = c & 0x0f;
        return NL_OK;
    } else if ((c & 0xf0) == 0x90) {
        it->k = IT_ARRAY, it->n = c & 0x0f;
        return NL_OK;
    } else if ((c & 0xe0) == 0xa0) {
        it->k = IT_STR, v = c & 0x1f;
        goto body;
    }
    switch (c) {
    case 0xc0:
        it->k = IT_NIL;
        return NL_OK;
    case 0xc2:
    case 0xc3:
        it->k = IT_BOOL, it->u = c == 0xc3;
        return NL_OK;
    case 0xc4:
    case 0xc5:
    case 0xc6:
        it->k = IT_BIN, lenbytes = 1 << (c - 0xc4);
        break;
    case 0xc7:
    case 0xc8:
    case 0xc9:
        it->k = IT_EXT, lenbytes = 1 << (c - 0xc7);
        break;
    case 0xca: {
        if (!rd_be(r, 4, &v))
            return truncated(r, err);
        uint32_t bits = (uint32_t)v;
        float f;
        memcpy(&f, &bits, sizeof f);
        it->k = IT_FLOAT, it->f = f;
        return NL_OK;
    }
    case 0xcb:
        if (!rd_be(r, 8, &v))
            return truncated(r, err);
        memcpy(&it->f, &v, sizeof it->f);
        it->k = IT_FLOAT;
        return NL_OK;
    case 0xcc:
    case 0xcd:
    case 0xce:
    case 0xcf:
        if (!rd_be(r, 1 << (c - 0xcc), &v))
            return truncated(r, err);
        it->k = IT_UINT, it->u = v;
        return NL_OK;
    case 0xd0:
    case 0xd1:
    case 0xd2:
    case 0xd3: {
        int nb = 1 << (c - 0xd0);
        if (!rd_be(r, nb, &v))
            return truncated(r, err);
        /* sign-extend without shifting into the sign bit */
        int64_t s = nb == 8                        ? (int64_t)v
                    : (v & (1ull << (nb * 8 - 1))) ? (int64_t)(v - (1ull << (nb * 8)))
                                                   : (int64_t)v;
        if (s >= 0)
            it->k = IT_UINT, it->u = (uint64_t)s;
        else
            it->k = IT_NEG, it->i = s;
        return NL_OK;
    }
    case 0xd4:
    case 0xd5:
    case 0xd6:
    case 0xd7:
    case 0xd8:
        it->k = IT_EXT, v = (1u << (c - 0xd4)) + 1; /* fixext: type byte + data */
        goto body;
    case 0xd9:
    case 0xda:
    case 0xdb:
        it->k = IT_STR, lenbytes = 1 << (c - 0xd9);
        break;
    case 0xdc:
    case 0xdd:
        if (!rd_be(r, 2 << (c - 0xdc), &v))
            return truncated(r, err);
        it->k = IT_ARRAY;
        goto count;
    case 0xde:
    case 0xdf:
        if (!rd_be(r, 2 << (c - 0xde), &v))
            return truncated(r, err);
        it->k = IT_MAP;
        goto count;
    default: /* 0xc1 is never used */
        return nl_error_set(err, NL_ERR_PROTO, "header byte %td: 0x%02x is not msgpack",
                            r->p - 1 - r->start, c);
    }
    if (!rd_be(r, lenbytes, &v))
        return truncated(r, err);
    if (it->k == IT_EXT)
        v += 1; /* the ext type byte */
body:
    if (v > (uint64_t)(r->end - r->p))
        return truncated(r, err);
    it->n = (uint32_t)v;
    it->body = r->p;
    if (it->k == IT_EXT)
        it->body++, it->n--;
    r->p += v;
    return NL_OK;
count:
    it->n = (uint32_t)v;
    return NL_OK;
}

/* Pass 1: walk the whole header without recursion or allocation; enforce
 * the limits and bound the arena the typed pass can need. */
static nl_status walk(const uint8_t *p, size_t len, const nl_wire_limits *lim, size_t *need,
                      nl_error *err)
{
    rd r = {p, p, p + len};
    uint64_t left[NL_WIRE_MAX_DEPTH + 1];
    uint32_t maxd = lim->max_depth;
    int depth = 0;
    size_t total = 64;
    left[0] = 1;
    while (depth >= 0) {
        if (left[depth] == 0) {
            depth--;
            continue;
        }
        left[depth]--;
        item it;
        nl_status st = rd_head(&r, &it, err);
        if (st != NL_OK)
            return st;
        if (depth == 0 && it.k != IT_MAP)
            return nl_error_set(err, NL_ERR_PROTO, "header is a %s, not a map", itnames[it.k]);
        size_t add = 0;
        switch (it.k) {
        case IT_STR:
        case IT_BIN:
            if (it.n > lim->max_str)
                return nl_error_set(err, NL_ERR_LIMIT, "header byte %td: %u-byte %s, limit %u",
                                    it.body - r.start, it.n, itnames[it.k], lim->max_str);
            add = (size_t)it.n + 1;
            break;
        case IT_EXT:
            return nl_error_set(err, NL_ERR_PROTO, "header byte %td: ext types are not used",
                                r.p - r.start);
        case IT_ARRAY:
        case IT_MAP: {
            uint64_t entries = it.k == IT_MAP ? 2ull * it.n : it.n;
            if ((uint32_t)depth + 1 > maxd)
                return nl_error_set(err, NL_ERR_LIMIT, "header nests deeper than %u", maxd);
            if (it.n > lim->max_array)
                return nl_error_set(err, NL_ERR_LIMIT, "header: %s of %u entries, limit %u",
                                    itnames[it.k], it.n, lim->max_array);
            if (entries > (uint64_t)(r.end - r.p)) /* each entry takes >= 1 byte */
                return truncated(&r, err);
            left[++depth] = entries;
            add = (size_t)it.n * (it.k == IT_MAP ? sizeof(nl_wire_param) : 8) + 16;
            break;
        }
        default:
            break;
        }
        if (__builtin_add_overflow(total, add, &total))
            return nl_error_set(err, NL_ERR_LIMIT, "header too large");
    }
    if (r.p != r.end)
        return nl_error_set(err, NL_ERR_PROTO, "%td trailing bytes after the header", r.end - r.p);
    *need = total;
    return NL_OK;
}

void nl_wire_peek(const void *header, size_t len, uint32_t *version, uint32_t *type)
{
    rd r = {header, header, (const uint8_t *)header + len};
    item it;
    uint64_t vals[2] = {0, 0};
    *version = *type = 0;
    if (!header || rd_head(&r, &it, NULL) != NL_OK || it.k != IT_MAP || it.n < 2)
        return;
    for (int i = 0; i < 2; i++) {
        if (rd_head(&r, &it, NULL) != NL_OK || it.k != IT_STR || it.n != 1 ||
            it.body[0] != (i ? 't' : 'v'))
            return;
        if (rd_head(&r, &it, NULL) != NL_OK || it.k != IT_UINT || it.u > UINT32_MAX)
            return;
        vals[i] = it.u;
    }
    *version = (uint32_t)vals[0];
    *type = (uint32_t)vals[1];
}

/* ===================== pass 2: typed decode ===================== */

static nl_status want(const tdesc *td, const char *name, const item *it, itkind k, nl_error *err)
{
    if (it->k == k || (k == IT_FLOAT && (it->k == IT_UINT || it->k == IT_NEG)))
        return NL_OK;
    return nl_error_set(err, NL_ERR_PROTO, "%s.%s: expected %s, got %s", td->name, name, itnames[k],
                        itnames[it->k]);
}

static nl_status rd_uint(rd *r, const tdesc *td, const char *name, uint64_t max, uint64_t *out,
                         nl_error *err)
{
    item it;
    nl_status st = rd_head(r, &it, err);
    if (st == NL_OK && it.k == IT_NEG)
        return nl_error_set(err, NL_ERR_RANGE, "%s.%s: %lld is negative", td->name, name,
                            (long long)it.i);
    if (st == NL_OK)
        st = want(td, name, &it, IT_UINT, err);
    if (st == NL_OK && it.u > max)
        return nl_error_set(err, NL_ERR_RANGE, "%s.%s: %llu is too large", td->name, name,
                            (unsigned long long)it.u);
    if (st == NL_OK)
        *out = it.u;
    return st;
}

/* Copy a string item into the arena, NUL-terminated. */
static nl_status str_to_arena(nl_wire_msg *m, const tdesc *td, const char *name, const item *it,
                              const char **out, nl_error *err)
{
    if (memchr(it->body, 0, it->n))
        return nl_error_set(err, NL_ERR_PROTO, "%s.%s: string holds a NUL byte", td->name, name);
    char *s = arena_take(m, (size_t)it->n + 1, 1);
    if (!s)
        return nl_error_set(err, NL_ERR_INTERNAL, "%s.%s: decode arena exhausted", td->name, name);
    memcpy(s, it->body, it->n);
    s[it->n] = '\0';
    *out = s;
    return NL_OK;
}

static nl_status rd_str(rd *r, nl_wire_msg *m, const tdesc *td, const char *name, const char **out,
                        nl_error *err)
{
    item it;
    nl_status st = rd_head(r, &it, err);
    if (st == NL_OK)
        st = want(td, name, &it, IT_STR, err);
    if (st == NL_OK)
        st = str_to_arena(m, td, name, &it, out, err);
    return st;
}

static nl_status rd_container(rd *r, const tdesc *td, const char *name, itkind k, uint32_t *n,
                              nl_error *err)
{
    item it;
    nl_status st = rd_head(r, &it, err);
    if (st == NL_OK)
        st = want(td, name, &it, k, err);
    if (st == NL_OK)
        *n = it.n;
    return st;
}

static nl_status rd_dims(rd *r, const tdesc *td, const char *name, int maxd, int *ndim,
                         int64_t *shape, nl_error *err)
{
    uint32_t n;
    nl_status st = rd_container(r, td, name, IT_ARRAY, &n, err);
    if (st != NL_OK)
        return st;
    if (n > (uint32_t)maxd)
        return nl_error_set(err, NL_ERR_LIMIT, "%s.%s: %u dimensions, limit %d", td->name, name, n,
                            maxd);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t d;
        st = rd_uint(r, td, name, INT64_MAX, &d, err);
        if (st != NL_OK)
            return st;
        shape[i] = (int64_t)d;
    }
    *ndim = (int)n;
    return NL_OK;
}

static nl_status rd_param(rd *r, nl_wire_msg *m, const tdesc *td, nl_wire_param *p, nl_error *err)
{
    nl_status st = rd_str(r, m, td, "params", &p->key, err);
    item it;
    if (st == NL_OK)
        st = rd_head(r, &it, err);
    if (st != NL_OK)
        return st;
    switch (it.k) {
    case IT_UINT:
        if (it.u > INT64_MAX)
            return nl_error_set(err, NL_ERR_RANGE, "%s.params.%s: integer too large", td->name,
                                p->key);
        p->kind = NL_PARAM_INT, p->i = (int64_t)it.u;
        return NL_OK;
    case IT_NEG:
        p->kind = NL_PARAM_INT, p->i = it.i;
        return NL_OK;
    case IT_FLOAT:
        p->kind = NL_PARAM_FLOAT, p->f = it.f;
        return NL_OK;
    case IT_BOOL:
        p->kind = NL_PARAM_BOOL, p->b = it.u != 0;
        return NL_OK;
    case IT_STR:
        p->kind = NL_PARAM_STR;
        return str_to_arena(m, td, p->key, &it, &p->s, err);
    default:
        return nl_error_set(err, NL_ERR_PROTO, "%s.params.%s: a %s is not a parameter value",
                            td->name, p->key, itnames[it.k]);
    }
}

static nl_status rd_field(rd *r, nl_wire_msg *m, const tdesc *td, const field *f,
                          const nl_wire_limits *lim, nl_error *err)
{
    uint8_t *base = (uint8_t *)&m->u;
    void *dst = base + f->off;
    uint64_t u = 0;
    nl_status st = NL_OK;
    item it;
    switch ((fkind)f->kind) {
    case FK_U32:
        st = rd_uint(r, td, f->name, UINT32_MAX, &u, err);
        *(uint32_t *)dst = (uint32_t)u;
        return st;
    case FK_U64:
        return rd_uint(r, td, f->name, UINT64_MAX, (uint64_t *)dst, err);
    case FK_F64:
    case FK_BOOL:
        st = rd_head(r, &it, err);
        if (st == NL_OK)
            st = want(td, f->name, &it, f->kind == FK_BOOL ? IT_BOOL : IT_FLOAT, err);
        if (st != NL_OK)
            return st;
        if (f->kind == FK_BOOL)
            *(bool *)dst = it.u != 0;
        else
            *(double *)dst = it.k == IT_FLOAT  ? it.f
                             : it.k == IT_UINT ? (double)it.u
                                               : (double)it.i;
        return NL_OK;
    case FK_STR:
        return rd_str(r, m, td, f->name, (const char **)dst, err);
    case FK_DIMS:
        return rd_dims(r, td, f->name, lim->max_dims, (int *)(base + f->count_off), dst, err);
    case FK_U32_LIST:
    case FK_PARAMS: {
        uint32_t n;
        bool params = f->kind == FK_PARAMS;
        st = rd_container(r, td, f->name, params ? IT_MAP : IT_ARRAY, &n, err);
        if (st != NL_OK)
            return st;
        if (n > f->hi)
            return nl_error_set(err, NL_ERR_LIMIT, "%s.%s: %u entries, limit %llu", td->name,
                                f->name, n, (unsigned long long)f->hi);
        size_t esz = params ? sizeof(nl_wire_param) : sizeof(uint32_t);
        uint8_t *arr = arena_take(m, (size_t)n * esz + 1, 8);
        if (!arr)
            return nl_error_set(err, NL_ERR_INTERNAL, "%s.%s: decode arena exhausted", td->name,
                                f->name);
        memset(arr, 0, (size_t)n * esz);
        for (uint32_t i = 0; i < n && st == NL_OK; i++) {
            if (params) {
                st = rd_param(r, m, td, (nl_wire_param *)arr + i, err);
            } else {
                st = rd_uint(r, td, f->name, UINT32_MAX, &u, err);
                ((uint32_t *)arr)[i] = (uint32_t)u;
            }
        }
        *(void **)dst = arr;
        *(uint32_t *)(base + f->count_off) = n;
        return st;
    }
    }
    return nl_error_set(err, NL_ERR_INTERNAL, "bad schema");
}

static nl_status rd_tensors(rd *r, nl_wire_msg *m, const tdesc *td, const nl_wire_part *parts,
                            int nparts, const nl_wire_limits *lim, nl_error *err)
{
    uint32_t n;
    nl_status st = rd_container(r, td, "tensors", IT_ARRAY, &n, err);
    if (st != NL_OK)
        return st;
    if (n > (uint32_t)lim->max_frames || n > NL_WIRE_MAX_FRAMES)
        return nl_error_set(err, NL_ERR_LIMIT, "%s: %u tensors, limit %d", td->name, n,
                            lim->max_frames);
    if ((int)n != nparts - 1)
        return nl_error_set(err, NL_ERR_PROTO, "%s: header describes %u tensors but %d frames came",
                            td->name, n, nparts - 1);
    for (uint32_t i = 0; i < n; i++) {
        nl_wire_frame *fr = &m->frames[i];
        uint32_t two;
        const char *dt;
        st = rd_container(r, td, "tensors", IT_ARRAY, &two, err);
        if (st == NL_OK && two != 2)
            st = nl_error_set(err, NL_ERR_PROTO, "%s.tensors[%u]: expected [dtype, shape]",
                              td->name, i);
        if (st == NL_OK)
            st = rd_str(r, m, td, "tensors.dtype", &dt, err);
        if (st == NL_OK && nl_dtype_parse(dt, &fr->t.dtype) != 0)
            st = nl_error_set(err, NL_ERR_DTYPE, "%s.tensors[%u]: unknown dtype '%.16s'", td->name,
                              i, dt);
        if (st == NL_OK)
            st = rd_dims(r, td, "tensors.shape", lim->max_dims, &fr->t.ndim, fr->t.shape, err);
        if (st != NL_OK)
            return st;
        fr->t.data = (void *)parts[i + 1].data;
        fr->len = parts[i + 1].len;
    }
    m->nframes = (int)n;
    return NL_OK;
}

static nl_status decode_body(rd *r, nl_wire_msg *m, const tdesc *td, uint32_t npairs,
                             const nl_wire_part *parts, int nparts, const nl_wire_limits *lim,
                             nl_error *err)
{
    uint64_t seen = 0;
    bool has_tensors = td->max_frames > 0, seen_tensors = false;
    for (uint32_t k = 2; k < npairs; k++) {
        item key;
        nl_status st = rd_head(r, &key, err);
        if (st == NL_OK && key.k != IT_STR)
            st = nl_error_set(err, NL_ERR_PROTO, "%s: a key is a %s, not a string", td->name,
                              itnames[key.k]);
        if (st != NL_OK)
            return st;
        int fi = -1;
        for (int i = 0; i < td->nf; i++)
            if (strlen(td->f[i].name) == key.n && memcmp(td->f[i].name, key.body, key.n) == 0)
                fi = i;
        if (fi >= 0) {
            if (seen & (1ull << fi))
                return nl_error_set(err, NL_ERR_PROTO, "%s.%s: duplicate key", td->name,
                                    td->f[fi].name);
            seen |= 1ull << fi;
            st = rd_field(r, m, td, &td->f[fi], lim, err);
        } else if (has_tensors && key.n == 7 && memcmp(key.body, "tensors", 7) == 0) {
            if (seen_tensors)
                return nl_error_set(err, NL_ERR_PROTO, "%s.tensors: duplicate key", td->name);
            seen_tensors = true;
            st = rd_tensors(r, m, td, parts, nparts, lim, err);
        } else {
            return nl_error_set(err, NL_ERR_PROTO, "%s: unknown key '%.*s'", td->name,
                                key.n > 32 ? 32 : (int)key.n, (const char *)key.body);
        }
        if (st != NL_OK)
            return st;
    }
    for (int i = 0; i < td->nf; i++)
        if (!(seen & (1ull << i)))
            return nl_error_set(err, NL_ERR_PROTO, "%s: missing field '%s'", td->name,
                                td->f[i].name);
    if (has_tensors && !seen_tensors)
        return nl_error_set(err, NL_ERR_PROTO, "%s: missing field 'tensors'", td->name);
    if (!has_tensors && nparts > 1)
        return nl_error_set(err, NL_ERR_PROTO, "%s carries no frames but %d came", td->name,
                            nparts - 1);
    return check_msg(m, td, lim, true, err);
}

nl_status nl_wire_decode(nl_wire_msg *m, const nl_wire_part *parts, int nparts,
                         const nl_wire_limits *lim, nl_error *err)
{
    nl_wire_limits cl;
    lim = clamp_limits(lim, &cl);
    nl_wire_msg_reset(m, NL_MSG_NONE);
    m->version = 0;
    if (nparts < 1 || !parts[0].data)
        return nl_error_set(err, NL_ERR_PROTO, "message has no header");
    const uint8_t *h = parts[0].data;
    size_t hlen = parts[0].len;
    if (hlen > lim->max_header)
        return nl_error_set(err, NL_ERR_LIMIT, "header of %zu bytes, limit %zu", hlen,
                            lim->max_header);
    if (nparts - 1 > lim->max_frames || nparts - 1 > NL_WIRE_MAX_FRAMES)
        return nl_error_set(err, NL_ERR_LIMIT, "%d frames, limit %d", nparts - 1, lim->max_frames);
    for (int i = 1; i < nparts; i++)
        if (parts[i].len > lim->max_frame_bytes)
            return nl_error_set(err, NL_ERR_LIMIT, "frame %d: %zu bytes, limit %llu", i - 1,
                                parts[i].len, (unsigned long long)lim->max_frame_bytes);
    uint32_t v, t;
    nl_wire_peek(h, hlen, &v, &t);
    m->version = v;
    m->type = tdesc_of(t) ? (nl_msg_type)t : NL_MSG_NONE;
    if (v == 0)
        return nl_error_set(err, NL_ERR_PROTO,
                            "header does not start with the protocol version and type");
    /* ERROR keeps its layout in every version, so a peer on another
     * version can still tell us why it refused us */
    if (v != NL_WIRE_VERSION && t != NL_MSG_ERROR)
        return nl_error_set(err, NL_ERR_VERSION,
                            "peer speaks protocol version %u; this build speaks version %u", v,
                            NL_WIRE_VERSION);
    const tdesc *td = tdesc_of(t);
    if (!td)
        return nl_error_set(err, NL_ERR_PROTO, "unknown message type %u", t);
    size_t need = 0;
    nl_status st = walk(h, hlen, lim, &need, err);
    if (st != NL_OK)
        return st;
    if (need > m->arena_cap) {
        uint8_t *a = realloc(m->arena, need);
        if (!a)
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory for a %zu-byte header", hlen);
        m->arena = a;
        m->arena_cap = need;
    }
    rd r = {h, h, h + hlen};
    item map, skip;
    rd_head(&r, &map, NULL); /* the map, then "v" and "t": peek checked them */
    for (int i = 0; i < 4; i++)
        rd_head(&r, &skip, NULL);
    return decode_body(&r, m, td, map.n, parts, nparts, lim, err);
}

/* ===================== encode ===================== */

typedef struct wctx {
    nl_wire_wbuf *b;
    size_t limit;
    bool over, nomem;
} wctx;

static int wbuf_write(void *data, const char *buf, size_t len)
{
    wctx *w = data;
    nl_wire_wbuf *b = w->b;
    if (len > w->limit - b->len) {
        w->over = true;
        return -1;
    }
    if (b->len + len > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + len)
            cap *= 2;
        uint8_t *p = realloc(b->data, cap);
        if (!p) {
            w->nomem = true;
            return -1;
        }
        b->data = p;
        b->cap = cap;
    }
    memcpy(b->data + b->len, buf, len);
    b->len += len;
    return 0;
}

static void pack_cstr(msgpack_packer *pk, const char *s)
{
    size_t n = s ? strlen(s) : 0;
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s ? s : "", n);
}

static void pack_field(msgpack_packer *pk, const field *f, const void *base)
{
    const uint8_t *b = base;
    pack_cstr(pk, f->name);
    switch ((fkind)f->kind) {
    case FK_U32:
        msgpack_pack_uint64(pk, FVAL(b, f, uint32_t));
        break;
    case FK_U64:
        msgpack_pack_uint64(pk, FVAL(b, f, uint64_t));
        break;
    case FK_F64:
        msgpack_pack_double(pk, FVAL(b, f, double));
        break;
    case FK_BOOL:
        FVAL(b, f, bool) ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
        break;
    case FK_STR:
        pack_cstr(pk, FVAL(b, f, const char *));
        break;
    case FK_DIMS: {
        int nd = *(const int *)(b + f->count_off);
        msgpack_pack_array(pk, (size_t)nd);
        for (int i = 0; i < nd; i++)
            msgpack_pack_uint64(pk, (uint64_t)((const int64_t *)(b + f->off))[i]);
        break;
    }
    case FK_U32_LIST: {
        uint32_t n = *(const uint32_t *)(b + f->count_off);
        const uint32_t *v = FVAL(b, f, const uint32_t *);
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++)
            msgpack_pack_uint64(pk, v[i]);
        break;
    }
    case FK_PARAMS: {
        uint32_t n = *(const uint32_t *)(b + f->count_off);
        const nl_wire_param *p = FVAL(b, f, const nl_wire_param *);
        msgpack_pack_map(pk, n);
        for (uint32_t i = 0; i < n; i++) {
            pack_cstr(pk, p[i].key);
            if (p[i].kind == NL_PARAM_INT)
                msgpack_pack_int64(pk, p[i].i);
            else if (p[i].kind == NL_PARAM_FLOAT)
                msgpack_pack_double(pk, p[i].f);
            else if (p[i].kind == NL_PARAM_STR)
                pack_cstr(pk, p[i].s);
            else
                p[i].b ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
        }
        break;
    }
    }
}

/* A list field with a count but no array is a caller's mistake. */
static nl_status check_lists(const nl_wire_msg *m, const tdesc *td, nl_error *err)
{
    for (int i = 0; i < td->nf; i++) {
        const field *f = &td->f[i];
        if (f->kind != FK_U32_LIST && f->kind != FK_PARAMS)
            continue;
        uint32_t n = *(const uint32_t *)((const uint8_t *)&m->u + f->count_off);
        if (n && !FVAL(&m->u, f, const void *))
            return nl_error_set(err, NL_ERR_INVALID, "%s.%s: %u entries but no array", td->name,
                                f->name, n);
    }
    return NL_OK;
}

nl_status nl_wire_encode(nl_wire_msg *m, nl_wire_wbuf *out, const nl_wire_limits *lim,
                         nl_error *err)
{
    nl_wire_limits cl;
    lim = clamp_limits(lim, &cl);
    const tdesc *td = tdesc_of(m->type);
    if (!td)
        return nl_error_set(err, NL_ERR_INVALID, "cannot encode unknown message type %u",
                            (unsigned)m->type);
    nl_status st = check_lists(m, td, err);
    if (st == NL_OK)
        st = check_msg(m, td, lim, false, err);
    if (st != NL_OK)
        return st;
    wctx w = {out, lim->max_header, false, false};
    msgpack_packer pk;
    msgpack_packer_init(&pk, &w, wbuf_write);
    out->len = 0;
    msgpack_pack_map(&pk, 2u + td->nf + (td->max_frames > 0));
    pack_cstr(&pk, "v");
    msgpack_pack_uint64(&pk, NL_WIRE_VERSION);
    pack_cstr(&pk, "t");
    msgpack_pack_uint64(&pk, m->type);
    for (int i = 0; i < td->nf; i++)
        pack_field(&pk, &td->f[i], &m->u);
    if (td->max_frames > 0) {
        pack_cstr(&pk, "tensors");
        msgpack_pack_array(&pk, (size_t)m->nframes);
        for (int i = 0; i < m->nframes; i++) {
            const nl_tensor *t = &m->frames[i].t;
            msgpack_pack_array(&pk, 2);
            pack_cstr(&pk, nl_dtype_name(t->dtype));
            msgpack_pack_array(&pk, (size_t)t->ndim);
            for (int d = 0; d < t->ndim; d++)
                msgpack_pack_uint64(&pk, (uint64_t)t->shape[d]);
        }
    }
    if (w.nomem)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory encoding the header", td->name);
    if (w.over)
        return nl_error_set(err, NL_ERR_LIMIT, "%s: header exceeds the %zu-byte limit", td->name,
                            lim->max_header);
    return NL_OK;
}
