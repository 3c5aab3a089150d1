/* The wire codec: decoding in two passes (net/mpread.c walks the header
 * bytes and enforces the limits, then a typed decode against the schema of
 * net/wire_schema.c) and the encoder (msgpack-c's packer writing into a
 * reusable buffer).
 *
 * Why a hand-checked reader and not msgpack-c's unpacker: msgpack_unpack
 * allocates what a container's header declares before reading its
 * elements (msgpack-c issue #1013: five bytes ask for a 96 GB allocation)
 * and has no nesting limit, so it would need a full bounded walk first
 * anyway; once that walk exists, decoding straight into the typed message
 * costs one more pass over at most 64 KiB and no zone allocations, and
 * nothing in the decoder then depends on a length it has not checked. */
#include "net/wire.h"

#include "base/log.h"

#include <math.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "net/mpread.h"
#include "net/wire_impl.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tensor frames are sent in host order, which must be little-endian"
#endif

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

void nl_wire_frame_set(nl_wire_frame *f, const void *data, nl_dtype dtype, const int64_t *shape,
                       int ndim)
{
    memset(f, 0, sizeof *f);
    f->t.dtype = dtype;
    f->t.ndim = ndim;
    for (int i = 0; i < ndim && i < NL_MAX_DIMS; i++)
        f->t.shape[i] = shape[i];
    f->t.data = (void *)data;
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

const nl_tensor *nl_wire_hop_frame(const nl_wire_msg *m, unsigned what)
{
    if (m->type != NL_MSG_ACTIVATION && m->type != NL_MSG_COUNT && m->type != NL_MSG_EVAL)
        return NULL;
    const uint32_t x = m->u.train_hop.extras;
    if (x == 0) /* the older form: a frame 1 is the targets */
        return what == NL_HOP_TARGETS && m->nframes == 2 ? &m->frames[1].t : NULL;
    if (!(x & what))
        return NULL;
    int f = 1;
    for (unsigned bit = 1; bit < what; bit <<= 1)
        f += (x & bit) != 0;
    return f < m->nframes ? &m->frames[f].t : NULL;
}

void nl_wire_hop_set_extras(nl_wire_msg *m, int64_t B, int64_t T, const int32_t *targets,
                            const int32_t *docs, const int32_t *labels, const int32_t *lengths)
{
    const int32_t *arr[4] = {targets, docs, labels, lengths};
    const int64_t bt[2] = {B, T};
    m->u.train_hop.extras = 0;
    for (int bit = 0; bit < 4; bit++) {
        if (!arr[bit] || m->nframes >= NL_WIRE_MAX_FRAMES)
            continue;
        nl_wire_frame_set(&m->frames[m->nframes++], arr[bit], NL_DTYPE_I32, bt, bit < 2 ? 2 : 1);
        m->u.train_hop.extras |= 1u << bit;
    }
}

void nl_wire_msg_free(nl_wire_msg *m)
{
    if (!m)
        return;
    free(m->arena);
    memset(m, 0, sizeof *m);
}

void nl_wire_release_frames(nl_wire_msg *m, int from)
{
    const int n = m->nframes < NL_WIRE_MAX_FRAMES ? m->nframes : NL_WIRE_MAX_FRAMES;
    for (int i = from < 0 ? 0 : from; i < n; i++)
        if (m->frames[i].free_fn)
            m->frames[i].free_fn(m->frames[i].t.data, m->frames[i].hint);
}

size_t nl_wire_utf8_fit(const char *s, size_t max)
{
    size_t n = strlen(s);
    if (n <= max)
        return n;
    n = max;
    while (n > 0 && ((unsigned char)s[n] & 0xc0) == 0x80) /* s[n] continues a character */
        n--;
    return n;
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

void nl_wire_peek(const void *header, size_t len, uint32_t *version, uint32_t *type)
{
    nl_mpr r;
    nl_mpr_item it;
    uint64_t vals[2] = {0, 0};
    *version = *type = 0;
    nl_mpr_init(&r, header, len);
    if (!header || nl_mpr_next(&r, &it, NULL) != NL_OK || it.k != NL_MPR_MAP || it.n < 2)
        return;
    for (int i = 0; i < 2; i++) {
        if (nl_mpr_next(&r, &it, NULL) != NL_OK || it.k != NL_MPR_STR || it.n != 1 ||
            it.body[0] != (i ? 't' : 'v'))
            return;
        if (nl_mpr_next(&r, &it, NULL) != NL_OK || it.k != NL_MPR_UINT || it.u > UINT32_MAX)
            return;
        vals[i] = it.u;
    }
    *version = (uint32_t)vals[0];
    *type = (uint32_t)vals[1];
}

/* ===================== pass 2: typed decode ===================== */

static nl_status want(const nl_wire_tdesc *td, const char *name, const nl_mpr_item *it,
                      nl_mpr_kind k, nl_error *err)
{
    if (it->k == k || (k == NL_MPR_FLOAT && (it->k == NL_MPR_UINT || it->k == NL_MPR_NEG)))
        return NL_OK;
    return nl_error_set(err, NL_ERR_PROTO, "%s.%s: expected %s, got %s", td->name, name,
                        nl_mpr_kind_name(k), nl_mpr_kind_name(it->k));
}

static nl_status rd_uint(nl_mpr *r, const nl_wire_tdesc *td, const char *name, uint64_t max,
                         uint64_t *out, nl_error *err)
{
    nl_mpr_item it;
    nl_status st = nl_mpr_next(r, &it, err);
    if (st == NL_OK && it.k == NL_MPR_NEG)
        return nl_error_set(err, NL_ERR_RANGE, "%s.%s: %lld is negative", td->name, name,
                            (long long)it.i);
    if (st == NL_OK)
        st = want(td, name, &it, NL_MPR_UINT, err);
    if (st == NL_OK && it.u > max)
        return nl_error_set(err, NL_ERR_RANGE, "%s.%s: %llu is too large", td->name, name,
                            (unsigned long long)it.u);
    if (st == NL_OK)
        *out = it.u;
    return st;
}

/* Copy a string item into the arena, NUL-terminated. */
static nl_status str_to_arena(nl_wire_msg *m, const nl_wire_tdesc *td, const char *name,
                              const nl_mpr_item *it, const char **out, nl_error *err)
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

static nl_status rd_str(nl_mpr *r, nl_wire_msg *m, const nl_wire_tdesc *td, const char *name,
                        const char **out, nl_error *err)
{
    nl_mpr_item it;
    nl_status st = nl_mpr_next(r, &it, err);
    if (st == NL_OK)
        st = want(td, name, &it, NL_MPR_STR, err);
    if (st == NL_OK)
        st = str_to_arena(m, td, name, &it, out, err);
    return st;
}

static nl_status rd_container(nl_mpr *r, const nl_wire_tdesc *td, const char *name, nl_mpr_kind k,
                              uint32_t *n, nl_error *err)
{
    nl_mpr_item it;
    nl_status st = nl_mpr_next(r, &it, err);
    if (st == NL_OK)
        st = want(td, name, &it, k, err);
    if (st == NL_OK)
        *n = it.n;
    return st;
}

static nl_status rd_dims(nl_mpr *r, const nl_wire_tdesc *td, const char *name, int maxd, int *ndim,
                         int64_t *shape, nl_error *err)
{
    uint32_t n;
    nl_status st = rd_container(r, td, name, NL_MPR_ARRAY, &n, err);
    if (st != NL_OK)
        return st;
    if (n > (uint32_t)maxd)
        return nl_error_set(err, NL_ERR_LIMIT, "%s.%s: %u dimensions, limit %d", td->name, name, n,
                            maxd);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t d = 0; /* set by rd_uint on NL_OK; gcc -O3 cannot see it */
        st = rd_uint(r, td, name, INT64_MAX, &d, err);
        if (st != NL_OK)
            return st;
        shape[i] = (int64_t)d;
    }
    *ndim = (int)n;
    return NL_OK;
}

static nl_status rd_param(nl_mpr *r, nl_wire_msg *m, const nl_wire_tdesc *td, nl_wire_param *p,
                          nl_error *err)
{
    nl_status st = rd_str(r, m, td, "params", &p->key, err);
    nl_mpr_item it;
    if (st == NL_OK)
        st = nl_mpr_next(r, &it, err);
    if (st != NL_OK)
        return st;
    switch (it.k) {
    case NL_MPR_UINT:
        if (it.u > INT64_MAX)
            return nl_error_set(err, NL_ERR_RANGE, "%s.params.%s: integer too large", td->name,
                                p->key);
        p->kind = NL_WIRE_PARAM_INT, p->i = (int64_t)it.u;
        return NL_OK;
    case NL_MPR_NEG:
        p->kind = NL_WIRE_PARAM_INT, p->i = it.i;
        return NL_OK;
    case NL_MPR_FLOAT:
        p->kind = NL_WIRE_PARAM_FLOAT, p->f = it.f;
        return NL_OK;
    case NL_MPR_BOOL:
        p->kind = NL_WIRE_PARAM_BOOL, p->b = it.u != 0;
        return NL_OK;
    case NL_MPR_STR:
        p->kind = NL_WIRE_PARAM_STR;
        return str_to_arena(m, td, p->key, &it, &p->s, err);
    default:
        return nl_error_set(err, NL_ERR_PROTO, "%s.params.%s: a %s is not a parameter value",
                            td->name, p->key, nl_mpr_kind_name(it.k));
    }
}

static nl_status rd_field(nl_mpr *r, nl_wire_msg *m, const nl_wire_tdesc *td,
                          const nl_wire_field *f, const nl_wire_limits *lim, nl_error *err)
{
    uint8_t *base = (uint8_t *)&m->u;
    void *dst = base + f->off;
    uint64_t u = 0;
    nl_status st = NL_OK;
    nl_mpr_item it;
    switch ((nl_wire_kind)f->kind) {
    case NL_WK_U32:
        st = rd_uint(r, td, f->name, UINT32_MAX, &u, err);
        *(uint32_t *)dst = (uint32_t)u;
        return st;
    case NL_WK_U64:
        return rd_uint(r, td, f->name, UINT64_MAX, (uint64_t *)dst, err);
    case NL_WK_F64:
    case NL_WK_BOOL:
        st = nl_mpr_next(r, &it, err);
        if (st == NL_OK)
            st = want(td, f->name, &it, f->kind == NL_WK_BOOL ? NL_MPR_BOOL : NL_MPR_FLOAT, err);
        if (st != NL_OK)
            return st;
        if (f->kind == NL_WK_BOOL)
            *(bool *)dst = it.u != 0;
        else
            *(double *)dst = it.k == NL_MPR_FLOAT  ? it.f
                             : it.k == NL_MPR_UINT ? (double)it.u
                                                   : (double)it.i;
        return NL_OK;
    case NL_WK_STR:
        return rd_str(r, m, td, f->name, (const char **)dst, err);
    case NL_WK_DIMS:
        return rd_dims(r, td, f->name, lim->max_dims, (int *)(base + f->count_off), dst, err);
    case NL_WK_U32_LIST:
    case NL_WK_PARAMS: {
        uint32_t n;
        bool params = f->kind == NL_WK_PARAMS;
        st = rd_container(r, td, f->name, params ? NL_MPR_MAP : NL_MPR_ARRAY, &n, err);
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

static nl_status rd_tensors(nl_mpr *r, nl_wire_msg *m, const nl_wire_tdesc *td,
                            const nl_wire_part *parts, int nparts, const nl_wire_limits *lim,
                            nl_error *err)
{
    uint32_t n;
    nl_status st = rd_container(r, td, "tensors", NL_MPR_ARRAY, &n, err);
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
        st = rd_container(r, td, "tensors", NL_MPR_ARRAY, &two, err);
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

static nl_status decode_body(nl_mpr *r, nl_wire_msg *m, const nl_wire_tdesc *td, uint32_t npairs,
                             const nl_wire_part *parts, int nparts, const nl_wire_limits *lim,
                             nl_error *err)
{
    uint64_t seen = 0;
    bool has_tensors = td->max_frames > 0, seen_tensors = false;
    for (uint32_t k = 2; k < npairs; k++) {
        nl_mpr_item key;
        nl_status st = nl_mpr_next(r, &key, err);
        if (st == NL_OK && key.k != NL_MPR_STR)
            st = nl_error_set(err, NL_ERR_PROTO, "%s: a key is a %s, not a string", td->name,
                              nl_mpr_kind_name(key.k));
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
            /* the key is the peer's bytes: escaped, so the message (and
             * the ERROR that quotes it) is valid text on one line */
            char shown[160];
            nl_log_escape_n(shown, sizeof shown, (const char *)key.body, key.n > 32 ? 32 : key.n);
            return nl_error_set(err, NL_ERR_PROTO, "%s: unknown key '%s'", td->name, shown);
        }
        if (st != NL_OK)
            return st;
    }
    for (int i = 0; i < td->nf; i++)
        if (!(seen & (1ull << i)) && !td->f[i].optional)
            return nl_error_set(err, NL_ERR_PROTO, "%s: missing field '%s'", td->name,
                                td->f[i].name);
    /* a message without frames of a type whose frames are all optional
     * may omit the key (a TOKEN of an older peer, which had none) */
    if (has_tensors && !seen_tensors && (td->min_frames > 0 || nparts > 1))
        return nl_error_set(err, NL_ERR_PROTO, "%s: missing field 'tensors'", td->name);
    if (!has_tensors && nparts > 1)
        return nl_error_set(err, NL_ERR_PROTO, "%s carries no frames but %d came", td->name,
                            nparts - 1);
    return nl_wire_schema_check(m, td, lim, true, err);
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
    m->type = nl_wire_schema_of(t) ? (nl_msg_type)t : NL_MSG_NONE;
    if (v == 0)
        return nl_error_set(err, NL_ERR_PROTO,
                            "header does not start with the protocol version and type");
    /* ERROR keeps its layout in every version, so a peer on another
     * version can still tell us why it refused us */
    if (v != NL_WIRE_VERSION && t != NL_MSG_ERROR)
        return nl_error_set(err, NL_ERR_VERSION,
                            "peer speaks protocol version %u; this build speaks version %u", v,
                            NL_WIRE_VERSION);
    const nl_wire_tdesc *td = nl_wire_schema_of(t);
    if (!td)
        return nl_error_set(err, NL_ERR_PROTO, "unknown message type %u", t);
    size_t need = 0;
    nl_mpr_limits ml = {lim->max_depth, lim->max_str, lim->max_array, 8, sizeof(nl_wire_param)};
    nl_status st = nl_mpr_walk(h, hlen, &ml, &need, err);
    if (st != NL_OK)
        return st;
    if (need > m->arena_cap) {
        uint8_t *a = realloc(m->arena, need);
        if (!a)
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory for a %zu-byte header", hlen);
        m->arena = a;
        m->arena_cap = need;
    }
    nl_mpr r;
    nl_mpr_init(&r, h, hlen);
    nl_mpr_item map, skip;
    nl_mpr_next(&r, &map, NULL); /* the map, then "v" and "t": peek checked them */
    for (int i = 0; i < 4; i++)
        nl_mpr_next(&r, &skip, NULL);
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

static void pack_field(msgpack_packer *pk, const nl_wire_field *f, const void *base)
{
    const uint8_t *b = base;
    pack_cstr(pk, f->name);
    switch ((nl_wire_kind)f->kind) {
    case NL_WK_U32:
        msgpack_pack_uint64(pk, NL_WIRE_FVAL(b, f, uint32_t));
        break;
    case NL_WK_U64:
        msgpack_pack_uint64(pk, NL_WIRE_FVAL(b, f, uint64_t));
        break;
    case NL_WK_F64:
        msgpack_pack_double(pk, NL_WIRE_FVAL(b, f, double));
        break;
    case NL_WK_BOOL:
        NL_WIRE_FVAL(b, f, bool) ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
        break;
    case NL_WK_STR:
        pack_cstr(pk, NL_WIRE_FVAL(b, f, const char *));
        break;
    case NL_WK_DIMS: {
        int nd = *(const int *)(b + f->count_off);
        msgpack_pack_array(pk, (size_t)nd);
        for (int i = 0; i < nd; i++)
            msgpack_pack_uint64(pk, (uint64_t)((const int64_t *)(b + f->off))[i]);
        break;
    }
    case NL_WK_U32_LIST: {
        uint32_t n = *(const uint32_t *)(b + f->count_off);
        const uint32_t *v = NL_WIRE_FVAL(b, f, const uint32_t *);
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++)
            msgpack_pack_uint64(pk, v[i]);
        break;
    }
    case NL_WK_PARAMS: {
        uint32_t n = *(const uint32_t *)(b + f->count_off);
        const nl_wire_param *p = NL_WIRE_FVAL(b, f, const nl_wire_param *);
        msgpack_pack_map(pk, n);
        for (uint32_t i = 0; i < n; i++) {
            pack_cstr(pk, p[i].key);
            if (p[i].kind == NL_WIRE_PARAM_INT)
                msgpack_pack_int64(pk, p[i].i);
            else if (p[i].kind == NL_WIRE_PARAM_FLOAT)
                msgpack_pack_double(pk, p[i].f);
            else if (p[i].kind == NL_WIRE_PARAM_STR)
                pack_cstr(pk, p[i].s);
            else
                p[i].b ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
        }
        break;
    }
    }
}

/* A list field with a count but no array is a caller's mistake. */
static nl_status check_lists(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err)
{
    for (int i = 0; i < td->nf; i++) {
        const nl_wire_field *f = &td->f[i];
        if (f->kind != NL_WK_U32_LIST && f->kind != NL_WK_PARAMS)
            continue;
        uint32_t n = *(const uint32_t *)((const uint8_t *)&m->u + f->count_off);
        if (n && !NL_WIRE_FVAL(&m->u, f, const void *))
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
    const nl_wire_tdesc *td = nl_wire_schema_of(m->type);
    if (!td)
        return nl_error_set(err, NL_ERR_INVALID, "cannot encode unknown message type %u",
                            (unsigned)m->type);
    nl_status st = check_lists(m, td, err);
    if (st == NL_OK)
        st = nl_wire_schema_check(m, td, lim, false, err);
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
