/* Unit tests for the wire codec's limits and checks: each size limit plus
 * one (header, string, array, depth, dimensions, frames, frame bytes), shape
 * arithmetic without overflow, dtypes, value ranges, protocol versions and
 * message types are refused with the right status. */
#include <math.h>
#include <msgpack.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/wire.h"
#include "tests/check.h"
#include "tests/wire_samples.h"

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
    for (int c = 0; c < 12; c++) {
        sample(&m, c < 3            ? NL_MSG_ASSIGN
                   : c < 5          ? NL_MSG_JOIN
                   : c < 7          ? NL_MSG_HEARTBEAT
                   : c < 9 || c > 9 ? NL_MSG_ERROR
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
        case 10:
            m.u.error.message = "overlong \xc0\xaf slash";
            break;
        case 11:
            m.u.error.message = "surrogate \xed\xa0\x80 half";
            break;
        }
        nl_status st = nl_wire_encode(&m, &e.hdr, NULL, &err);
        CHECK(st == NL_ERR_RANGE, "case %d encoded: %s", c, nl_status_str(st));
    }
    /* every device a node may serve on is accepted */
    const char *devices[] = {"cpu", "cpu-devsim", "cuda:0", "cuda:12"};
    for (int i = 0; i < 4; i++) {
        sample(&m, NL_MSG_JOIN);
        m.u.join.device = devices[i];
        CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
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

int main(void)
{
    fill_data();
    test_limits();
    test_shapes_dtypes();
    test_ranges_versions();
    return check_done("test_wire_limits");
}
