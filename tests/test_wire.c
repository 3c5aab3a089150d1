/* Unit tests for the wire codec (net/wire.c): every message type round-trips;
 * every type truncated at every offset, and every field given every wrong
 * type, missing / duplicate / unknown keys, is refused; random mutations
 * never crash. Headers are re-packed with msgpack-c, an independent
 * implementation, to build the bad cases. Limits, shapes, dtypes, ranges
 * and versions are in test_wire_limits.c; the training hops' frames,
 * digests and wire precision in test_wire_train.c.
 *
 *   test_wire                     run the tests
 *   test_wire --write-corpus DIR  write the fuzz seed corpus (fuzz/corpus/wire) */
#include <math.h>
#include <msgpack.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/hopdigest.h"
#include "net/mpread.h"
#include "net/wire.h"
#include "tests/check.h"
#include "tests/wire_samples.h"

/* ---- round trips ---- */

/* JOB_SUBMIT of every job kind round-trips, finetune's and embed's
 * parameters included (docs/protocol.md); a kind past the last is refused. */
static void test_job_kinds(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    const nl_wire_param ft[] = {
        {.key = "lora_rank", .kind = NL_WIRE_PARAM_INT, .i = 8},
        {.key = "lora_alpha", .kind = NL_WIRE_PARAM_FLOAT, .f = 16.0},
        {.key = "lora_targets", .kind = NL_WIRE_PARAM_STR, .s = (char *)"wq,wk,wv,wo"},
        {.key = "lengths", .kind = NL_WIRE_PARAM_STR, .s = (char *)"3,17,1"},
    };
    for (uint32_t kind = NL_JOB_FORWARD; kind <= NL_JOB_GROW + 1; kind++) {
        nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
        m.u.job_submit = (nl_msg_job_submit){kind, 4, (nl_wire_param *)ft};
        nl_status st = enc_msg(&m, &e, NULL, &err); /* the encoder checks the schema too */
        if (st == NL_OK)
            st = nl_wire_decode(&d, e.parts, e.nparts, NULL, &err);
        if (kind <= NL_JOB_GROW) {
            CHECK(st == NL_OK && d.u.job_submit.kind == kind && d.u.job_submit.nparams == 4 &&
                      strcmp(d.u.job_submit.params[2].s, "wq,wk,wv,wo") == 0 &&
                      strcmp(d.u.job_submit.params[3].s, "3,17,1") == 0,
                  "JOB_SUBMIT kind %u: %s", kind, st == NL_OK ? "decoded wrong" : err.msg);
        } else {
            CHECK(st != NL_OK && strstr(err.msg, "kind"), "JOB_SUBMIT kind %u accepted", kind);
        }
    }
    nl_wire_wbuf_free(&e.hdr);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
}

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

/* The heartbeat's fields added after the first four (kv_bytes ...) may
 * be absent: is the named one 0? */
static bool heartbeat_field_zero(const nl_msg_heartbeat *h, const char *key)
{
    return strcmp(key, "kv_bytes") == 0       ? h->kv_bytes == 0
           : strcmp(key, "sessions") == 0     ? h->sessions == 0
           : strcmp(key, "hops") == 0         ? h->hops == 0
           : strcmp(key, "batches") == 0      ? h->batches == 0
           : strcmp(key, "compute_s") == 0    ? h->compute_s == 0.0
           : strcmp(key, "hop_s") == 0        ? h->hop_s == 0.0
           : strcmp(key, "reduce_bytes") == 0 ? h->reduce_bytes == 0
           : strcmp(key, "reduce_s") == 0     ? h->reduce_s == 0.0
                                              : false;
}

/* Fields added to a type later: a peer that does not send them (an older
 * one) is read as sending 0. */
static bool added_later(nl_msg_type t, const nl_wire_msg *d, const char *key)
{
    if (strcmp(key, "digest") == 0 &&
        (t == NL_MSG_ACTIVATION || t == NL_MSG_COUNT || t == NL_MSG_EVAL || t == NL_MSG_GRADIENT))
        return !d->u.train_hop.digest || !d->u.train_hop.digest[0];
    if (strcmp(key, "epoch") == 0 &&
        (t == NL_MSG_ACTIVATION || t == NL_MSG_COUNT || t == NL_MSG_EVAL || t == NL_MSG_GRADIENT))
        return d->u.train_hop.epoch == 0;
    if (t == NL_MSG_ACTIVATION || t == NL_MSG_COUNT || t == NL_MSG_EVAL)
        return strcmp(key, "extras") == 0      ? d->u.train_hop.extras == 0
               : strcmp(key, "loss_rows") == 0 ? d->u.train_hop.loss_rows == 0
                                               : false;
    /* frames that are all optional: without any, "tensors" may be absent */
    if ((t == NL_MSG_TOKEN || t == NL_MSG_JOB_STATUS) && strcmp(key, "tensors") == 0)
        return d->nframes == 0;
    if (strcmp(key, "outputs") == 0) /* verification across device classes */
        return t == NL_MSG_VERIFY_CASE && d->u.verify_case.outputs == 0;
    if (strcmp(key, "flags") == 0 && t == NL_MSG_VERIFY_REQ)
        return d->u.verify_req.flags == 0;
    if (strcmp(key, "weights") == 0 && t == NL_MSG_VERIFY_CASE) /* a stage's: none named */
        return !d->u.verify_case.weights || !d->u.verify_case.weights[0];
    if (strcmp(key, "want_weights") == 0 && t == NL_MSG_VERIFY_RESULT)
        return d->u.verify_result.want_weights == 0;
    if (strcmp(key, "weights") == 0 && t == NL_MSG_VERIFY_RESULT) /* a case that named none */
        return !d->u.verify_result.weights || !d->u.verify_result.weights[0];
    if (t == NL_MSG_TOKEN) /* with logprobs: top ids and a frame; neither before */
        return strcmp(key, "top_ids") == 0 && d->u.token.ntop == 0;
    if (t == NL_MSG_REDUCE)
        return strcmp(key, "epoch") == 0 && d->u.reduce.epoch == 0;
    if (t == NL_MSG_ASSIGN && strncmp(key, "ring_", 5) == 0) { /* a stage's replicas */
        const nl_msg_assign *a = &d->u.assign;
        const char *v = strcmp(key, "ring_endpoint") == 0 ? a->ring_endpoint
                        : strcmp(key, "ring_key") == 0    ? a->ring_key
                                                          : a->ring_prev_key;
        return !v || !v[0];
    }
    if (t == NL_MSG_ASSIGN && (strcmp(key, "prev_keys") == 0 || strcmp(key, "next_keys") == 0 ||
                               strcmp(key, "next_endpoints") == 0)) {
        const nl_msg_assign *a = &d->u.assign; /* neighbours of another replica count */
        const char *v = key[0] == 'p'                        ? a->prev_keys
                        : strcmp(key, "next_endpoints") == 0 ? a->next_endpoints
                                                             : a->next_keys;
        return !v || !v[0];
    }
    if (t == NL_MSG_ASSIGN)
        return strcmp(key, "wire") == 0         ? d->u.assign.wire == NL_WIRE_FP32
               : strcmp(key, "links") == 0      ? d->u.assign.links == 0
               : strcmp(key, "relay_port") == 0 ? d->u.assign.relay_port == 0
               : strcmp(key, "replica") == 0
                   ? d->u.assign.replica == 0
                   : strcmp(key, "replicas") == 0 && d->u.assign.replicas == 0;
    if (t == NL_MSG_JOB_STATUS) /* the message a stage's failure answers */
        return strcmp(key, "req_type") == 0 && d->u.job_status.req_type == 0;
    if (t == NL_MSG_JOIN) /* nodes behind NAT: JOIN.flags */
        return strcmp(key, "flags") == 0 && d->u.join.flags == 0;
    return t == NL_MSG_LOSS && strcmp(key, "correct") == 0 && d->u.train_loss.correct == 0;
}

static bool is_added_later(nl_msg_type t, const char *key)
{
    return ((t == NL_MSG_ACTIVATION || t == NL_MSG_COUNT || t == NL_MSG_EVAL) &&
            (strcmp(key, "extras") == 0 || strcmp(key, "loss_rows") == 0)) ||
           ((t == NL_MSG_ACTIVATION || t == NL_MSG_COUNT || t == NL_MSG_EVAL ||
             t == NL_MSG_GRADIENT) &&
            (strcmp(key, "digest") == 0 || strcmp(key, "epoch") == 0)) ||
           (t == NL_MSG_LOSS && strcmp(key, "correct") == 0) ||
           (t == NL_MSG_TOKEN && strcmp(key, "top_ids") == 0) ||
           ((t == NL_MSG_TOKEN || t == NL_MSG_JOB_STATUS) && strcmp(key, "tensors") == 0) ||
           (t == NL_MSG_ASSIGN &&
            (strcmp(key, "wire") == 0 || strcmp(key, "links") == 0 ||
             strcmp(key, "relay_port") == 0 || strcmp(key, "replica") == 0 ||
             strcmp(key, "replicas") == 0 || strncmp(key, "ring_", 5) == 0 ||
             strcmp(key, "prev_keys") == 0 || strcmp(key, "next_endpoints") == 0 ||
             strcmp(key, "next_keys") == 0)) ||
           (t == NL_MSG_JOIN && strcmp(key, "flags") == 0) ||
           (t == NL_MSG_JOB_STATUS && strcmp(key, "req_type") == 0) ||
           (t == NL_MSG_REDUCE && strcmp(key, "epoch") == 0) ||
           (t == NL_MSG_VERIFY_REQ && strcmp(key, "flags") == 0) ||
           (t == NL_MSG_VERIFY_CASE &&
            (strcmp(key, "outputs") == 0 || strcmp(key, "weights") == 0)) ||
           (t == NL_MSG_VERIFY_RESULT &&
            (strcmp(key, "want_weights") == 0 || strcmp(key, "weights") == 0));
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
            if (all_types[i] == NL_MSG_HEARTBEAT && k >= 6) /* added later: optional */
                CHECK(st == NL_OK && heartbeat_field_zero(&d.u.heartbeat, key),
                      "a HEARTBEAT without %s (an older node's) was not read as 0: %s", key,
                      st == NL_OK ? "not 0" : err.msg);
            else if (is_added_later(all_types[i], key))
                CHECK(st == NL_OK && added_later(all_types[i], &d, key),
                      "a %s without %s (an older peer's) was not read as 0: %s", tn, key,
                      st == NL_OK ? "not 0" : err.msg);
            else
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

/* ---- TOKEN with log-probabilities ---- */

/* A TOKEN with log-probabilities (issue 32): round-trips; a frame of the
 * wrong length, a value above 0 or NaN, ids without a frame and a frame
 * with several tokens are refused. */
static void test_token_logprobs(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    uint32_t tok[2] = {7, 8}, top[2] = {7, 3};
    float lp[3] = {-0.5f, -0.5f, -1.25f};
    struct {
        uint32_t ntok, ntop;
        int64_t len;
        float v0;
        int frame;
        const char *want; /* NULL: accepted */
    } cases[] = {{1, 2, 3, -0.5f, 1, NULL},
                 {1, 2, 2, -0.5f, 1, "log-probabilities"},
                 {1, 2, 3, 0.25f, 1, "not a finite"},
                 {1, 2, 3, NAN, 1, "not a finite"},
                 {1, 2, 0, -0.5f, 0, "top_ids"},
                 {2, 1, 2, -0.5f, 1, "2 tokens"},
                 {1, 0, 1, 0.0f, 1, NULL}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        nl_wire_msg_reset(&m, NL_MSG_TOKEN);
        m.u.token = (nl_msg_token){5, 5, cases[i].ntok, tok, false, cases[i].ntop, top};
        lp[0] = cases[i].v0;
        if (cases[i].frame) {
            nl_wire_frame_set(&m.frames[0], lp, NL_DTYPE_F32, &cases[i].len, 1);
            m.nframes = 1;
        }
        nl_status st = enc_msg(&m, &e, NULL, &err);
        if (st == NL_OK)
            st = nl_wire_decode(&d, e.parts, e.nparts, NULL, &err);
        if (!cases[i].want) {
            float got = 1.0f;
            if (st == NL_OK && d.nframes == 1)
                memcpy(&got, d.frames[0].t.data, sizeof got);
            CHECK(st == NL_OK && d.u.token.ntop == cases[i].ntop && d.nframes == 1 &&
                      got == cases[i].v0 && (cases[i].ntop == 0 || d.u.token.top_ids[1] == 3),
                  "TOKEN logprobs case %zu: %s", i, st == NL_OK ? "decoded wrong" : err.msg);
        } else {
            CHECK(st != NL_OK && strstr(err.msg, cases[i].want), "TOKEN case %zu refused: %s", i,
                  st == NL_OK ? "accepted" : err.msg);
        }
    }
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_wbuf_free(&e.hdr);
}

/* ---- fuzz corpus (the format of fuzz/fuzz_wire.c) ---- */

static void put_u32(FILE *f, uint32_t v)
{
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    fwrite(b, 1, 4, f);
}

/* One corpus file: m encoded, at DIR/NN-TYPE[-suffix]. */
static int write_one(const char *dir, nl_wire_msg *m, enc *e, const char *suffix)
{
    nl_error err;
    if (enc_msg(m, e, NULL, &err) != NL_OK) {
        fprintf(stderr, "encode: %s\n", err.msg);
        return 1;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%02d-%s%s%s", dir, m->type, nl_wire_type_name(m->type),
             suffix ? "-" : "", suffix ? suffix : "");
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        return 1;
    }
    fputc(e->nparts - 1, f);
    put_u32(f, (uint32_t)e->hdr.len);
    fwrite(e->hdr.data, 1, e->hdr.len, f);
    for (int k = 1; k < e->nparts; k++) {
        put_u32(f, (uint32_t)e->parts[k].len);
        fwrite(e->parts[k].data, 1, e->parts[k].len, f);
    }
    fclose(f);
    return 0;
}

static int write_corpus(const char *dir)
{
    nl_wire_msg m;
    enc e = {0};
    int rc = 0;
    nl_wire_msg_init(&m);
    for (int i = 0; i < NTYPES && rc == 0; i++) {
        sample(&m, all_types[i]);
        rc = write_one(dir, &m, &e, NULL);
    }
    /* the objectives' hops: mlm's targets, classification's documents,
     * labels and lengths, a counting pass with documents, and the LOSS of
     * a classification's evaluation */
    static const struct {
        nl_msg_type type;
        unsigned extras;
        const char *suffix;
    } x[] = {{NL_MSG_ACTIVATION, NL_HOP_TARGETS, "mlm"},
             {NL_MSG_ACTIVATION, NL_HOP_DOCS | NL_HOP_LABELS | NL_HOP_LENGTHS, "classify"},
             {NL_MSG_COUNT, NL_HOP_DOCS, "docs"},
             {NL_MSG_EVAL, NL_HOP_DOCS | NL_HOP_LABELS | NL_HOP_LENGTHS, "classify"},
             {NL_MSG_LOSS, 0, "classify"}};
    for (size_t i = 0; i < sizeof x / sizeof x[0] && rc == 0; i++) {
        extras_sample(&m, x[i].type, x[i].extras);
        rc = write_one(dir, &m, &e, x[i].suffix);
    }
    nl_wire_msg_free(&m);
    nl_wire_wbuf_free(&e.hdr);
    return rc;
}

/* ---- the wire's precision (DESIGN.md section 8) ---- */

/* The reader refuses a str, bin or ext whose length runs past the buffer,
 * even by one byte (the truncation test above ends at a map's end check,
 * which would hide a reader that steps one byte past) */
static void test_reader_lengths(void)
{
    static const uint8_t cases[][8] = {
        {0xa3, 'a', 'b'},       /* fixstr 3, 2 bytes left */
        {0xd9, 0x03, 'a', 'b'}, /* str8 3 */
        {0xc4, 0x02, 0x01},     /* bin8 2 */
        {0xd5, 0x01, 0x02},     /* fixext2: type + 2 bytes, 1 left */
    };
    static const size_t lens[] = {3, 4, 3, 3};
    for (size_t c = 0; c < sizeof lens / sizeof lens[0]; c++) {
        nl_mpr r;
        nl_mpr_item it;
        nl_mpr_init(&r, cases[c], lens[c]);
        CHECK(nl_mpr_next(&r, &it, NULL) == NL_ERR_PROTO,
              "case %zu: a length one past the end read", c);
        nl_mpr_init(&r, cases[c], lens[c] + 1); /* with the byte there it reads */
        CHECK(nl_mpr_next(&r, &it, NULL) == NL_OK, "case %zu: the whole item refused", c);
    }
}

/* ASSIGN's neighbours of another replica count (prev_keys,
 * next_endpoints, next_keys): lists round-trip and split; an item that is
 * no key, an empty item, too many, as many keys as endpoints, the list
 * without its neighbour and a list with a NAT link are refused. */
static void test_assign_peers(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    char items[NL_REDUCE_MAX_REPLICAS][NL_WIRE_PEER_ITEM];
    CHECK(nl_wire_peer_list(KEY_A "," KEY_B, items, 16) == 2 && strcmp(items[0], KEY_A) == 0 &&
              strcmp(items[1], KEY_B) == 0,
          "two keys split");
    CHECK(nl_wire_peer_list("", items, 16) == 0 && nl_wire_peer_list(NULL, NULL, 16) == 0, "none");
    CHECK(nl_wire_peer_list("a,,b", NULL, 16) == -1 && nl_wire_peer_list("a,", NULL, 16) == -1 &&
              nl_wire_peer_list("a,b,c", NULL, 2) == -1,
          "an empty item, or too many");
    struct {
        const char *prev_keys, *next_eps, *next_keys;
        uint32_t links;
        const char *why; /* NULL: accepted */
    } cases[] = {
        {KEY_A "," KEY_B, "tcp://h:1,tcp://h:2", KEY_B "," KEY_A, 0, NULL},
        {KEY_A, "", "", 0, NULL},
        {"", "tcp://h:1", KEY_B, 0, NULL},
        {KEY_A ",nokey", "", "", 0, "prev_keys: item 1 is not a Z85 key"},
        {KEY_A ",", "", "", 0, "prev_keys: not a list"},
        {"", "tcp://h:1,tcp://h:2", KEY_B, 0, "1 next_keys for 2 next_endpoints"},
        {"", "tcp://h:1", KEY_B, NL_LINK_NEXT_DIALS, "another replica count"},
        {KEY_A, "", "", NL_LINK_DIAL_PREV, "another replica count"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        sample(&m, NL_MSG_ASSIGN);
        m.u.assign.links = cases[c].links;
        m.u.assign.prev_keys = cases[c].prev_keys;
        m.u.assign.next_endpoints = cases[c].next_eps;
        m.u.assign.next_keys = cases[c].next_keys;
        nl_status st = enc_msg(&m, &e, NULL, &err);
        if (!cases[c].why) {
            CHECK(st == NL_OK && (st = dec_parts(&d, &e, NULL, &err)) == NL_OK && same_msg(&m, &d),
                  "case %zu round-trips: %s", c, err.msg);
        } else {
            CHECK(st != NL_OK && strstr(err.msg, cases[c].why), "case %zu refused: %s", c,
                  st != NL_OK ? err.msg : "accepted");
        }
    }
    /* 17 replicas are more than a stage has */
    char many[17 * (NL_KEY_Z85_LEN + 1)] = "";
    for (int k = 0; k < 17; k++)
        snprintf(many + strlen(many), sizeof many - strlen(many), "%s%s", k ? "," : "", KEY_A);
    sample(&m, NL_MSG_ASSIGN);
    m.u.assign.links = 0;
    m.u.assign.prev_keys = many;
    CHECK(enc_msg(&m, &e, NULL, &err) != NL_OK, "17 keys accepted");
    /* a list without its neighbour */
    sample(&m, NL_MSG_ASSIGN);
    m.u.assign.links = 0;
    m.u.assign.prev_endpoint = m.u.assign.prev_key = "";
    m.u.assign.prev_keys = KEY_A;
    CHECK(enc_msg(&m, &e, NULL, &err) != NL_OK && strstr(err.msg, "need the neighbour"),
          "prev_keys without prev_key: %s", err.msg);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_wbuf_free(&e.hdr);
    printf("ASSIGN's neighbours of another replica count: ok\n");
}

/* nl_wire_utf8_fit: the longest prefix within max bytes that ends between
 * characters, for 1- to 4-byte characters. */
static void test_utf8_fit(void)
{
    CHECK(nl_wire_utf8_fit("", 0) == 0 && nl_wire_utf8_fit("abc", 3) == 3, "whole texts");
    CHECK(nl_wire_utf8_fit("abcdef", 4) == 4, "ASCII cut at the limit");
    const char *s = "a\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80z"; /* a, é, €, 😀, z: 1+2+3+4+1 */
    const size_t want[12] = {0, 1, 1, 3, 3, 3, 6, 6, 6, 6, 10, 11};
    for (size_t max = 0; max < 12; max++)
        CHECK(nl_wire_utf8_fit(s, max) == want[max], "max %zu: %zu, want %zu", max,
              nl_wire_utf8_fit(s, max), want[max]);
}

int main(int argc, char **argv)
{
    fill_data();
    if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0)
        return write_corpus(argv[2]);
    test_round_trip();
    test_job_kinds();
    test_truncation();
    test_reader_lengths();
    test_wrong_types();
    test_mutations();
    test_token_logprobs();
    test_assign_peers();
    test_utf8_fit();
    return check_done("test_wire");
}
