/* A bounded msgpack reader: one item at a time from a byte buffer, every
 * length checked against the bytes left before it is used, and a
 * structural walk that enforces size and nesting limits without recursion
 * or allocation. It knows nothing of the wire schema (net/wire.c). */
#include "net/mpread.h"

#include <stdbool.h>
#include <string.h>

static const char *const kind_names[] = {"nil",   "bool",   "unsigned integer", "negative integer",
                                         "float", "string", "binary",           "array",
                                         "map",   "ext"};

const char *nl_mpr_kind_name(nl_mpr_kind k)
{
    return (unsigned)k <= NL_MPR_EXT ? kind_names[k] : "?";
}

void nl_mpr_init(nl_mpr *r, const void *data, size_t len)
{
    r->start = r->p = data;
    r->end = r->start + (data ? len : 0);
}

static bool rd_be(nl_mpr *r, int n, uint64_t *v)
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

static nl_status truncated(const nl_mpr *r, nl_error *err)
{
    return nl_error_set(err, NL_ERR_PROTO, "header truncated or malformed at byte %td",
                        r->p - r->start);
}

/* A number after its header byte c, which is 0xca..0xd3 (float 32/64,
 * uint 8..64, int 8..64); a non-negative int reads as NL_MPR_UINT. */
static nl_status read_number(nl_mpr *r, uint8_t c, nl_mpr_item *it, nl_error *err)
{
    uint64_t v = 0;
    if (c == 0xca) {
        if (!rd_be(r, 4, &v))
            return truncated(r, err);
        uint32_t bits = (uint32_t)v;
        float f;
        memcpy(&f, &bits, sizeof f);
        it->k = NL_MPR_FLOAT, it->f = f;
        return NL_OK;
    }
    if (c == 0xcb) {
        if (!rd_be(r, 8, &v))
            return truncated(r, err);
        memcpy(&it->f, &v, sizeof it->f);
        it->k = NL_MPR_FLOAT;
        return NL_OK;
    }
    if (c <= 0xcf) {
        if (!rd_be(r, 1 << (c - 0xcc), &v))
            return truncated(r, err);
        it->k = NL_MPR_UINT, it->u = v;
        return NL_OK;
    }
    int nb = 1 << (c - 0xd0);
    if (!rd_be(r, nb, &v))
        return truncated(r, err);
    /* sign-extend without shifting into the sign bit */
    int64_t s = nb == 8                        ? (int64_t)v
                : (v & (1ull << (nb * 8 - 1))) ? (int64_t)(v - (1ull << (nb * 8)))
                                               : (int64_t)v;
    if (s >= 0)
        it->k = NL_MPR_UINT, it->u = (uint64_t)s;
    else
        it->k = NL_MPR_NEG, it->i = s;
    return NL_OK;
}

/* Read one item's head; strings, binaries and exts are skipped over (their
 * body is checked to lie inside the buffer), containers are not entered. */
nl_status nl_mpr_next(nl_mpr *r, nl_mpr_item *it, nl_error *err)
{
    uint64_t v = 0;
    memset(it, 0, sizeof *it);
    if (r->p >= r->end)
        return truncated(r, err);
    uint8_t c = *r->p++;
    int lenbytes = 0;
    if (c <= 0x7f) {
        it->k = NL_MPR_UINT, it->u = c;
        return NL_OK;
    } else if (c >= 0xe0) {
        it->k = NL_MPR_NEG, it->i = (int8_t)c;
        return NL_OK;
    } else if ((c & 0xf0) == 0x80) {
        it->k = NL_MPR_MAP, it->n = c & 0x0f;
        return NL_OK;
    } else if ((c & 0xf0) == 0x90) {
        it->k = NL_MPR_ARRAY, it->n = c & 0x0f;
        return NL_OK;
    } else if ((c & 0xe0) == 0xa0) {
        it->k = NL_MPR_STR, v = c & 0x1f;
        goto body;
    }
    switch (c) {
    case 0xc0:
        it->k = NL_MPR_NIL;
        return NL_OK;
    case 0xc2:
    case 0xc3:
        it->k = NL_MPR_BOOL, it->u = c == 0xc3;
        return NL_OK;
    case 0xc4:
    case 0xc5:
    case 0xc6:
        it->k = NL_MPR_BIN, lenbytes = 1 << (c - 0xc4);
        break;
    case 0xc7:
    case 0xc8:
    case 0xc9:
        it->k = NL_MPR_EXT, lenbytes = 1 << (c - 0xc7);
        break;
    case 0xca:
    case 0xcb:
    case 0xcc:
    case 0xcd:
    case 0xce:
    case 0xcf:
    case 0xd0:
    case 0xd1:
    case 0xd2:
    case 0xd3:
        return read_number(r, c, it, err);
    case 0xd4:
    case 0xd5:
    case 0xd6:
    case 0xd7:
    case 0xd8:
        it->k = NL_MPR_EXT, v = (1u << (c - 0xd4)) + 1; /* fixext: type byte + data */
        goto body;
    case 0xd9:
    case 0xda:
    case 0xdb:
        it->k = NL_MPR_STR, lenbytes = 1 << (c - 0xd9);
        break;
    case 0xdc:
    case 0xdd:
        if (!rd_be(r, 2 << (c - 0xdc), &v))
            return truncated(r, err);
        it->k = NL_MPR_ARRAY;
        goto count;
    case 0xde:
    case 0xdf:
        if (!rd_be(r, 2 << (c - 0xde), &v))
            return truncated(r, err);
        it->k = NL_MPR_MAP;
        goto count;
    default: /* 0xc1 is never used */
        return nl_error_set(err, NL_ERR_PROTO, "header byte %td: 0x%02x is not msgpack",
                            r->p - 1 - r->start, c);
    }
    if (!rd_be(r, lenbytes, &v))
        return truncated(r, err);
    if (it->k == NL_MPR_EXT)
        v += 1; /* the ext type byte */
body:
    if (v > (uint64_t)(r->end - r->p))
        return truncated(r, err);
    it->n = (uint32_t)v;
    it->body = r->p;
    if (it->k == NL_MPR_EXT)
        it->body++, it->n--;
    r->p += v;
    return NL_OK;
count:
    it->n = (uint32_t)v;
    return NL_OK;
}

nl_status nl_mpr_walk(const void *data, size_t len, const nl_mpr_limits *lim, size_t *need,
                      nl_error *err)
{
    nl_mpr r;
    uint64_t left[NL_MPR_MAX_DEPTH + 1];
    uint32_t maxd = lim->max_depth < NL_MPR_MAX_DEPTH ? lim->max_depth : NL_MPR_MAX_DEPTH;
    nl_mpr_init(&r, data, len);
    int depth = 0;
    size_t total = 64;
    left[0] = 1;
    while (depth >= 0) {
        if (left[depth] == 0) {
            depth--;
            continue;
        }
        left[depth]--;
        nl_mpr_item it;
        nl_status st = nl_mpr_next(&r, &it, err);
        if (st != NL_OK)
            return st;
        if (depth == 0 && it.k != NL_MPR_MAP)
            return nl_error_set(err, NL_ERR_PROTO, "header is a %s, not a map",
                                nl_mpr_kind_name(it.k));
        size_t add = 0;
        switch (it.k) {
        case NL_MPR_STR:
        case NL_MPR_BIN:
            if (it.n > lim->max_str)
                return nl_error_set(err, NL_ERR_LIMIT, "header byte %td: %u-byte %s, limit %u",
                                    it.body - r.start, it.n, nl_mpr_kind_name(it.k), lim->max_str);
            add = (size_t)it.n + 1;
            break;
        case NL_MPR_EXT:
            return nl_error_set(err, NL_ERR_PROTO, "header byte %td: ext types are not used",
                                r.p - r.start);
        case NL_MPR_ARRAY:
        case NL_MPR_MAP: {
            uint64_t entries = it.k == NL_MPR_MAP ? 2ull * it.n : it.n;
            if ((uint32_t)depth + 1 > maxd)
                return nl_error_set(err, NL_ERR_LIMIT, "header nests deeper than %u", maxd);
            if (it.n > lim->max_array)
                return nl_error_set(err, NL_ERR_LIMIT, "header: %s of %u entries, limit %u",
                                    nl_mpr_kind_name(it.k), it.n, lim->max_array);
            if (entries > (uint64_t)(r.end - r.p)) /* each entry takes >= 1 byte */
                return truncated(&r, err);
            left[++depth] = entries;
            add =
                (size_t)it.n * (it.k == NL_MPR_MAP ? lim->map_entry_cost : lim->array_entry_cost) +
                16;
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
