/* Unit tests for the wire codec's training hops (net/wire.c,
 * net/hopdigest.c; docs/protocol.md): the objectives' hop frames round-
 * trip and bad ones are refused, the hop digests, and the wire precision
 * (FP32 or bf16 hidden states). test_wire.c holds the codec's other
 * round trips and bad-input cases. */
#include <math.h>
#include <msgpack.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/hopdigest.h"
#include "net/wire.h"
#include "tests/check.h"
#include "tests/wire_samples.h"

static bool frame_is(const nl_tensor *t, const int32_t *want, int ndim, int64_t n)
{
    return t && t->dtype == NL_DTYPE_I32 && t->ndim == ndim &&
           nl_shape_numel(t->shape, t->ndim) == n &&
           memcmp(t->data, want, (size_t)n * sizeof *want) == 0;
}

/* The objectives' extras on every training hop type round-trip; bad
 * extras are refused. */
static void test_train_hops(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    /* every combination round-trips, each array found by its bit */
    const nl_msg_type types[] = {NL_MSG_ACTIVATION, NL_MSG_EVAL, NL_MSG_COUNT};
    for (int ti = 0; ti < 3; ti++)
        for (unsigned x = 1; x <= NL_HOP_ALL; x++) {
            extras_sample(&m, types[ti], x);
            nl_status st = enc_msg(&m, &e, NULL, &err);
            if (st == NL_OK)
                st = nl_wire_decode(&d, e.parts, e.nparts, NULL, &err);
            CHECK(st == NL_OK && d.u.train_hop.extras == x &&
                      d.u.train_hop.loss_rows == m.u.train_hop.loss_rows &&
                      d.u.train_hop.epoch == 40 + x && d.u.hop.step == 250 &&
                      d.u.hop.microbatch == 3,
                  "%s extras %u: %s", nl_wire_type_name(types[ti]), x,
                  st == NL_OK ? "decoded wrong" : err.msg);
            if (st != NL_OK)
                continue;
            CHECK(!(x & NL_HOP_TARGETS) == !nl_wire_hop_frame(&d, NL_HOP_TARGETS) &&
                      (!(x & NL_HOP_TARGETS) ||
                       frame_is(nl_wire_hop_frame(&d, NL_HOP_TARGETS), hx_targets, 2, 10)),
                  "extras %u: the targets", x);
            CHECK(!(x & NL_HOP_DOCS) == !nl_wire_hop_frame(&d, NL_HOP_DOCS) &&
                      (!(x & NL_HOP_DOCS) ||
                       frame_is(nl_wire_hop_frame(&d, NL_HOP_DOCS), hx_docs, 2, 10)),
                  "extras %u: the documents", x);
            CHECK(!(x & NL_HOP_LABELS) == !nl_wire_hop_frame(&d, NL_HOP_LABELS) &&
                      (!(x & NL_HOP_LABELS) ||
                       frame_is(nl_wire_hop_frame(&d, NL_HOP_LABELS), hx_labels, 1, 2)),
                  "extras %u: the labels", x);
            CHECK(!(x & NL_HOP_LENGTHS) == !nl_wire_hop_frame(&d, NL_HOP_LENGTHS) &&
                      (!(x & NL_HOP_LENGTHS) ||
                       frame_is(nl_wire_hop_frame(&d, NL_HOP_LENGTHS), hx_lengths, 1, 2)),
                  "extras %u: the lengths", x);
        }
    /* the older form: no extras, frame 1 is the targets */
    extras_sample(&m, NL_MSG_ACTIVATION, 0);
    const int64_t sh[2] = {2, 5};
    nl_wire_frame_set(&m.frames[1], hx_targets, NL_DTYPE_I32, sh, 2);
    m.nframes = 2;
    nl_status st = enc_msg(&m, &e, NULL, &err);
    if (st == NL_OK)
        st = nl_wire_decode(&d, e.parts, e.nparts, NULL, &err);
    CHECK(st == NL_OK && frame_is(nl_wire_hop_frame(&d, NL_HOP_TARGETS), hx_targets, 2, 10) &&
              !nl_wire_hop_frame(&d, NL_HOP_DOCS),
          "ACTIVATION without extras: %s", st == NL_OK ? "frame 1 is not the targets" : err.msg);
    CHECK(!nl_wire_hop_frame(&m, NL_HOP_DOCS), "a hop without documents has them");
    /* refused: frames that do not match extras (the encoder checks as the decoder does) */
    struct {
        nl_msg_type type;
        unsigned extras;
        int nframes, ndim1;
        const char *want;
    } bad[] = {
        {NL_MSG_ACTIVATION, 16, 1, 0, "extras"},              /* a bit past the last */
        {NL_MSG_ACTIVATION, NL_HOP_DOCS, 1, 0, "missing"},    /* names a frame not sent */
        {NL_MSG_ACTIVATION, NL_HOP_TARGETS, 3, 2, "names 2"}, /* a frame more */
        {NL_MSG_ACTIVATION, NL_HOP_LABELS, 2, 2, "labels"},   /* labels of 2 dimensions */
        {NL_MSG_EVAL, 0, 3, 2, "names none"},                 /* older form, 3 frames */
        {NL_MSG_COUNT, 0, 2, 2, "names none"},                /* older COUNT with a frame 1 */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        extras_sample(&m, bad[i].type, 0);
        for (int f = 1; f < bad[i].nframes; f++)
            nl_wire_frame_set(&m.frames[f], hx_targets, NL_DTYPE_I32,
                              bad[i].ndim1 == 2 ? sh : sh + 1, bad[i].ndim1 == 2 ? 2 : 1);
        m.nframes = bad[i].nframes;
        m.u.train_hop.extras = bad[i].extras;
        st = enc_msg(&m, &e, NULL, &err);
        CHECK(st != NL_OK && strstr(err.msg, bad[i].want), "bad hop %zu accepted or wrong: %s", i,
              st == NL_OK ? "accepted" : err.msg);
    }
    /* LOSS of a classification's evaluation: the correct count */
    extras_sample(&m, NL_MSG_LOSS, 0);
    st = enc_msg(&m, &e, NULL, &err);
    if (st == NL_OK)
        st = nl_wire_decode(&d, e.parts, e.nparts, NULL, &err);
    CHECK(st == NL_OK && d.u.train_loss.correct == 29 && d.u.loss.rows == 37,
          "LOSS with correct: %s", st == NL_OK ? "decoded wrong" : err.msg);
    nl_wire_wbuf_free(&e.hdr);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
}

/* Hop digests (net/hopdigest.h): a hop's digest set by its sender passes
 * the receiver's check after the round trip; a changed byte of a frame,
 * a changed field or the wrong receiving stage fails it with
 * NL_ERR_INTEGRITY; only the tensor's bytes count (not what lies past it
 * in the sender's buffer); a digest of the wrong length is refused by the
 * decoder, and GRAD_NORM's digests frame must be [M, 4, 32]. */
static void test_hop_digest(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    char hex[NL_HOP_DIGEST_HEX + 1];
    uint8_t sent[NL_HOP_DIGEST_BYTES], got[NL_HOP_DIGEST_BYTES];
    float buf[2 * 3 * 4 + 5]; /* the tensor, then bytes that are not part of it */
    for (int i = 0; i < 29; i++)
        buf[i] = 0.25f * (float)i;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    const nl_msg_type types[] = {NL_MSG_ACTIVATION, NL_MSG_GRADIENT, NL_MSG_COUNT, NL_MSG_EVAL};
    for (int ti = 0; ti < 4; ti++) {
        nl_wire_msg_reset(&m, types[ti]);
        m.u.hop = (nl_msg_tensor_hop){7, 3, 1, 0, 0, 0.5};
        const int64_t sh[3] = {2, 3, 4};
        nl_wire_frame_set(&m.frames[0], buf, NL_DTYPE_F32, sh, 3);
        m.nframes = 1;
        nl_hop_digest_set(&m, 2, hex, sent);
        nl_status st = enc_msg(&m, &e, NULL, &err);
        if (st == NL_OK)
            st = nl_wire_decode(&d, e.parts, e.nparts, NULL, &err);
        if (st == NL_OK)
            st = nl_hop_digest_check(&d, 2, got, &err);
        CHECK(st == NL_OK && memcmp(sent, got, sizeof got) == 0 &&
                  strlen(d.u.train_hop.digest) == 64,
              "%s: the digest does not survive the round trip: %s", nl_wire_type_name(types[ti]),
              err.msg);
        /* another receiving stage: another digest */
        st = nl_hop_digest_check(&d, 1, got, &err);
        CHECK(st == NL_ERR_INTEGRITY, "%s: the stage is not in the digest",
              nl_wire_type_name(types[ti]));
        /* bytes past the tensor do not count */
        buf[24] += 1.0f;
        CHECK(nl_hop_digest_check(&d, 2, got, &err) == NL_OK && memcmp(sent, got, sizeof got) == 0,
              "%s: the digest covers bytes past the tensor", nl_wire_type_name(types[ti]));
        /* one bit of the tensor as received */
        uint32_t u;
        memcpy(&u, &buf[5], 4);
        u ^= 1;
        memcpy(&buf[5], &u, 4);
        st = nl_hop_digest_check(&d, 2, got, &err);
        CHECK(st == NL_ERR_INTEGRITY && strstr(err.msg, "does not match"),
              "%s: a flipped bit passes the check (%s)", nl_wire_type_name(types[ti]),
              nl_status_str(st));
        u ^= 1;
        memcpy(&buf[5], &u, 4);
        /* a field */
        d.u.hop.step = 4;
        CHECK(nl_hop_digest_check(&d, 2, got, &err) == NL_ERR_INTEGRITY,
              "%s: the step is not in the digest", nl_wire_type_name(types[ti]));
        d.u.hop.step = 3;
        d.u.hop.microbatch = 0;
        CHECK(nl_hop_digest_check(&d, 2, got, &err) == NL_ERR_INTEGRITY,
              "%s: the microbatch is not in the digest", nl_wire_type_name(types[ti]));
    }
    /* the direction (the type) is in it: an ACTIVATION's digest on a GRADIENT fails */
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){7, 3, 1, 0, 0, 0.0};
    const int64_t sh[3] = {2, 3, 4};
    nl_wire_frame_set(&m.frames[0], buf, NL_DTYPE_F32, sh, 3);
    m.nframes = 1;
    nl_hop_digest_set(&m, 2, hex, sent);
    m.type = NL_MSG_GRADIENT;
    CHECK(nl_hop_digest_check(&m, 2, got, &err) == NL_ERR_INTEGRITY,
          "the direction is not in the digest");
    /* a digest that is not 64 hex digits */
    hex[10] = '\0';
    CHECK(enc_msg(&m, &e, NULL, &err) == NL_ERR_RANGE && strstr(err.msg, "digest"),
          "a 10-digit digest is encoded");
    /* a hop without one (an older peer) is taken and its digest recorded */
    m.u.train_hop.digest = NULL;
    CHECK(nl_hop_digest_check(&m, 2, got, &err) == NL_OK && !nl_hop_digest_none(got),
          "a hop without a digest is refused or not digested");
    /* GRAD_NORM's digests: [M, 4, 32] only */
    uint8_t digs[2 * 3 * 32] = {0};
    nl_wire_msg_reset(&m, NL_MSG_GRAD_NORM);
    m.u.grad_norm = (nl_msg_grad_norm){7, 3, 0, 1.0};
    const int64_t dsh[3] = {2, 3, 32};
    nl_wire_frame_set(&m.frames[0], digs, NL_DTYPE_U8, dsh, 3);
    m.nframes = 1;
    CHECK(enc_msg(&m, &e, NULL, &err) == NL_ERR_SHAPE, "GRAD_NORM with digests [2, 3, 32] encoded");
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_wbuf_free(&e.hdr);
}

/* bf16 hops: rounded to nearest even when described, widened exactly when
 * read; ASSIGN's wire round-trips and a value past bf16 is refused; the
 * hidden-state hops take F32 or BF16 frames, not F16. */
static void test_wire_precision(void)
{
    nl_error err = {0};
    nl_wire_precision p = NL_WIRE_BF16;
    CHECK(nl_wire_precision_parse("fp32", &p) == 0 && p == NL_WIRE_FP32, "fp32 parse");
    CHECK(nl_wire_precision_parse("bf16", &p) == 0 && p == NL_WIRE_BF16, "bf16 parse");
    CHECK(nl_wire_precision_parse("fp16", &p) != 0 && nl_wire_precision_name(2) == NULL,
          "fp16 taken");
    /* 1 + 2^-8 is halfway between two bf16 values: to even (1); 1 + 3 * 2^-8
     * to the even one above (1 + 2^-6); -2.5 and 1e-3 are rounded too */
    const float x[6] = {1.0f, 1.0f + 0x1p-8f, 1.0f + 0x3p-8f, -2.5f, 1e-3f, 65504.0f};
    const float want[6] = {1.0f, 1.0f, 1.0f + 0x1p-6f, -2.5f, 0x1.06p-10f, 65536.0f};
    const int64_t shape[3] = {1, 2, 3};
    uint16_t *buf = NULL;
    size_t cap = 0;
    nl_wire_frame f;
    CHECK_OK(nl_wire_frame_hidden(&f, NL_WIRE_BF16, x, shape, 3, &buf, &cap, &err), &err);
    CHECK(f.t.dtype == NL_DTYPE_BF16 && f.t.data == buf && cap == 6, "bf16 frame");
    float back[6];
    nl_wire_frame_widen(&f, back, 6);
    for (int i = 0; i < 6; i++)
        CHECK(back[i] == want[i], "bf16 of %a: %a, not %a", (double)x[i], (double)back[i],
              (double)want[i]);
    CHECK_OK(nl_wire_frame_hidden(&f, NL_WIRE_FP32, x, shape, 3, &buf, &cap, &err), &err);
    CHECK(f.t.dtype == NL_DTYPE_F32 && f.t.data == x, "fp32 frame is not the data");
    nl_wire_frame_widen(&f, back, 6);
    CHECK(memcmp(back, x, sizeof x) == 0, "fp32 widened");
    free(buf);

    nl_wire_msg m, d;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    enc e = {0};
    sample(&m, NL_MSG_ASSIGN);
    m.u.assign.wire = NL_WIRE_BF16;
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    CHECK_OK(nl_wire_decode(&d, e.parts, e.nparts, NULL, &err), &err);
    CHECK(d.u.assign.wire == NL_WIRE_BF16, "ASSIGN wire %u", d.u.assign.wire);
    m.u.assign.wire = 2;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE && strstr(err.msg, "wire"),
          "ASSIGN wire 2: %s", err.msg);
    /* nodes behind NAT: ASSIGN.links and JOIN.flags know their bits, and
     * a link names a neighbour the stage has */
    m.u.assign.wire = NL_WIRE_FP32;
    m.u.assign.links = NL_LINK_DIAL_PREV | NL_LINK_NEXT_DIALS;
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    CHECK_OK(nl_wire_decode(&d, e.parts, e.nparts, NULL, &err), &err);
    CHECK(d.u.assign.links == 3, "ASSIGN links %u", d.u.assign.links);
    m.u.assign.links = NL_LINK_RELAY_PREV | NL_LINK_RELAY_NEXT;
    m.u.assign.relay_port = 7702;
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    CHECK_OK(nl_wire_decode(&d, e.parts, e.nparts, NULL, &err), &err);
    CHECK(d.u.assign.links == 12 && d.u.assign.relay_port == 7702, "ASSIGN links %u relay %u",
          d.u.assign.links, d.u.assign.relay_port);
    m.u.assign.relay_port = 0; /* a relay link needs its port */
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE && strstr(err.msg, "relay_port"),
          "ASSIGN relayed without a port: %s", err.msg);
    m.u.assign.links = NL_LINK_DIAL_PREV;
    m.u.assign.relay_port = 7702; /* a port without a relay link */
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE && strstr(err.msg, "relay_port"),
          "ASSIGN port without a relay: %s", err.msg);
    m.u.assign.links = NL_LINK_DIAL_PREV | NL_LINK_RELAY_PREV; /* two ways to one neighbour */
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE && strstr(err.msg, "two ways"),
          "ASSIGN two ways: %s", err.msg);
    m.u.assign.relay_port = 0;
    m.u.assign.links = 16;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE && strstr(err.msg, "links"),
          "ASSIGN links 16: %s", err.msg);
    m.u.assign.links = NL_LINK_DIAL_PREV;
    m.u.assign.prev_endpoint = m.u.assign.prev_key = "";
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE && strstr(err.msg, "links"),
          "ASSIGN DIAL_PREV without a previous stage: %s", err.msg);
    sample(&m, NL_MSG_JOIN);
    m.u.join.flags = 2;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_RANGE && strstr(err.msg, "flags"),
          "JOIN flags 2: %s", err.msg);
    sample(&m, NL_MSG_GRADIENT);
    m.frames[0].t.dtype = NL_DTYPE_F16;
    CHECK(nl_wire_encode(&m, &e.hdr, NULL, &err) == NL_ERR_DTYPE, "F16 GRADIENT: %s", err.msg);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_wbuf_free(&e.hdr);
}

int main(void)
{
    fill_data();
    test_train_hops();
    test_hop_digest();
    test_wire_precision();
    return check_done("test_wire_train");
}
