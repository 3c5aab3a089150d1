/* net/locallink: the local link between co-located stages. Who may
 * connect (the token, the timeout), messages both ways with the codec's
 * samples, a message larger than the socket's buffer through the outbox,
 * records cut anywhere, the limits, a bad message in a good record, the
 * peer's close, and that every frame is released once; and the
 * LOCAL_LINK message of the handshake (its strings per op, the decoder's
 * checks). */
#define _GNU_SOURCE
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "net/locallink.h"
#include "net/transport.h"
#include "wire_samples.h"

static const uint64_t MAX_PART = 64ull << 20, MAX_MSG = 128ull << 20;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* A connected pair: a the listener's side (upstream), b the connector's. */
static bool pair(nl_local **a, nl_local **b)
{
    nl_error e;
    nl_local_listener *l = NULL;
    char name[NL_LOCAL_NAME_MAX], token[NL_LOCAL_TOKEN_HEX + 1];
    bool ok = nl_local_listen(&l, name, token, &e) == NL_OK &&
              nl_local_connect(name, token, NULL, MAX_PART, MAX_MSG, "b-peer", b, &e) == NL_OK &&
              nl_local_accept(l, NULL, MAX_PART, MAX_MSG, "a-peer", a, &e) == NL_OK;
    CHECK(ok, "pair: %s", e.msg);
    nl_local_listener_close(&l);
    return ok;
}

static int freed;
static void count_free(void *data, void *hint)
{
    (void)data;
    (void)hint;
    freed++;
}

/* Receive one message, flushing the sender meanwhile (up to 5 s). */
static nl_status recv_one(nl_local *from, nl_local *to, nl_rx *rx, nl_error *e)
{
    const double end = now_s() + 5;
    for (;;) {
        nl_status st = nl_local_recv(to, rx, e);
        if (st != NL_ERR_TIMEOUT || now_s() > end)
            return st;
        if (from && nl_local_pending(from))
            nl_local_flush(from, e);
        struct pollfd pf = {nl_local_fd(to), POLLIN, 0};
        poll(&pf, 1, 10);
    }
}

static void test_host(void)
{
    nl_error e;
    char h[NL_LOCAL_HOST_MAX], h2[NL_LOCAL_HOST_MAX];
    CHECK_OK(nl_local_host(h, sizeof h, &e), &e);
    CHECK_OK(nl_local_host(h2, sizeof h2, &e), &e);
    const char *s1 = strchr(h, '/'), *s2 = s1 ? strchr(s1 + 1, '/') : NULL;
    CHECK(s1 && s2 && s2[1] && !strchr(h, ' '), "host text %s: boot/uid/netns", h);
    CHECK(strcmp(h, h2) == 0, "one host, one text: %s %s", h, h2);
    CHECK(nl_local_host(h, 8, &e) == NL_ERR_LIMIT, "a short buffer is refused");
}

static void test_who_may_connect(void)
{
    nl_error e;
    nl_local_listener *l = NULL;
    nl_local *a = NULL, *b = NULL, *bad = NULL;
    char name[NL_LOCAL_NAME_MAX], token[NL_LOCAL_TOKEN_HEX + 1], wrong[NL_LOCAL_TOKEN_HEX + 1];
    CHECK_OK(nl_local_listen(&l, name, token, &e), &e);
    CHECK(strncmp(name, "neurollm-", 9) == 0 && strlen(name) == 9 + 32, "name %s", name);
    CHECK(strlen(token) == NL_LOCAL_TOKEN_HEX && strspn(token, "0123456789abcdef") == 64,
          "token %s", token);
    /* nobody came: a timeout after about NL_LOCAL_ACCEPT_MS */
    double t0 = now_s();
    CHECK(nl_local_accept(l, NULL, MAX_PART, MAX_MSG, "x", &a, &e) == NL_ERR_TIMEOUT, "%s", e.msg);
    CHECK(now_s() - t0 > 0.9 && now_s() - t0 < 5, "waited %.2f s", now_s() - t0);
    /* a wrong token is refused; the right one after it is taken */
    memcpy(wrong, token, sizeof wrong);
    wrong[0] = wrong[0] == 'a' ? 'b' : 'a';
    CHECK_OK(nl_local_connect(name, wrong, NULL, MAX_PART, MAX_MSG, "bad", &bad, &e), &e);
    CHECK_OK(nl_local_connect(name, token, NULL, MAX_PART, MAX_MSG, "b", &b, &e), &e);
    CHECK_OK(nl_local_accept(l, NULL, MAX_PART, MAX_MSG, "a", &a, &e), &e);
    /* the refused one was closed: its peer reads the end */
    nl_rx rx;
    nl_rx_init(&rx);
    CHECK(recv_one(NULL, bad, &rx, &e) == NL_ERR_IO, "refused connection closed: %s", e.msg);
    nl_local_close(&bad);
    /* only the wrong one: NL_ERR_AUTH */
    nl_local *a2 = NULL;
    CHECK_OK(nl_local_connect(name, wrong, NULL, MAX_PART, MAX_MSG, "bad", &bad, &e), &e);
    CHECK(nl_local_accept(l, NULL, MAX_PART, MAX_MSG, "a", &a2, &e) == NL_ERR_AUTH && !a2, "%s",
          e.msg);
    nl_local_close(&bad);
    /* a name nobody listens on, bad arguments */
    CHECK(nl_local_connect("neurollm-nobody-here", token, NULL, MAX_PART, MAX_MSG, "c", &bad, &e) ==
                  NL_ERR_IO &&
              !bad,
          "%s", e.msg);
    CHECK(nl_local_connect(name, "abc", NULL, MAX_PART, MAX_MSG, "c", &bad, &e) == NL_ERR_INVALID,
          "short token");
    /* anyone may connect to an abstract name: a queue filled by others
     * makes the next connect fail at once, not wait (the stage declines) */
    int others[64], no = 0;
    for (; no < 64; no++) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        memcpy(sa.sun_path + 1, name, strlen(name));
        others[no] = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (connect(others[no], (struct sockaddr *)&sa,
                    (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name))) != 0) {
            close(others[no]);
            break;
        }
    }
    CHECK(no > 0 && no < 64, "the queue filled after %d connections", no);
    t0 = now_s();
    CHECK(nl_local_connect(name, token, NULL, MAX_PART, MAX_MSG, "c", &bad, &e) == NL_ERR_IO &&
              strstr(e.msg, "queue is full"),
          "a full queue: %s", e.msg);
    CHECK(now_s() - t0 < 0.5, "refused at once: %.2f s", now_s() - t0);
    for (int i = 0; i < no; i++)
        close(others[i]);
    nl_local_listener_close(&l);
    /* the link works */
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    sample(&m, NL_MSG_HEARTBEAT);
    CHECK_OK(nl_local_send(b, &m, &e), &e);
    CHECK_OK(recv_one(b, a, &rx, &e), &e);
    CHECK(rx.msg.type == NL_MSG_HEARTBEAT && strcmp(rx.peer, "a") == 0, "type %d peer %s",
          rx.msg.type, rx.peer);
    nl_rx_free(&rx);
    nl_wire_msg_free(&m);
    nl_local_close(&a);
    nl_local_close(&b);
}

static void test_every_type(void)
{
    nl_error e;
    nl_local *a = NULL, *b = NULL;
    if (!pair(&a, &b))
        return;
    nl_rx rx;
    nl_rx_init(&rx);
    fill_data();
    for (int i = 0; i < NTYPES; i++) {
        nl_wire_msg m, want;
        nl_wire_msg_init(&m);
        nl_wire_msg_init(&want);
        sample(&m, all_types[i]);
        sample(&want, all_types[i]);
        nl_local *from = i % 2 ? a : b, *to = i % 2 ? b : a; /* both ways */
        CHECK_OK(nl_local_send(from, &m, &e), &e);
        nl_status st = recv_one(from, to, &rx, &e);
        CHECK(st == NL_OK, "%s: %s", nl_wire_type_name(all_types[i]), e.msg);
        if (st == NL_OK) {
            nl_wire_wbuf h = {0};
            nl_wire_encode(&want, &h, NULL, NULL); /* fills frame lengths */
            nl_wire_wbuf_free(&h);
            CHECK(same_msg(&rx.msg, &want), "%s round trip", nl_wire_type_name(all_types[i]));
        }
        nl_wire_msg_free(&m);
        nl_wire_msg_free(&want);
    }
    nl_rx_free(&rx);
    CHECK(nl_net_parts_open() == 0, "parts still open: %ld", nl_net_parts_open());
    nl_local_stats s = nl_local_get_stats(a);
    CHECK(s.sent + s.received == (uint64_t)NTYPES && s.bytes_in > 0, "stats %llu + %llu",
          (unsigned long long)s.sent, (unsigned long long)s.received);
    nl_local_close(&a);
    nl_local_close(&b);
}

/* An activation of n floats, its frame released through count_free. */
static void big_activation(nl_wire_msg *m, float *data, int64_t n)
{
    sample(m, NL_MSG_ACTIVATION);
    const int64_t shape[3] = {1, n / 64, 64};
    set_frame(&m->frames[0], NL_DTYPE_F32, data, 3, shape);
    m->frames[0].free_fn = count_free;
    m->nframes = 1;
    m->u.train_hop.extras = 0;
}

static void test_large_and_ordered(void)
{
    nl_error e;
    nl_local *a = NULL, *b = NULL;
    if (!pair(&a, &b))
        return;
    const int64_t n = 4 << 20; /* 16 MiB: far over the socket's buffer */
    float *x = malloc((size_t)n * sizeof *x);
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(i % 9973) * 0.5f;
    freed = 0;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    /* three in a row: the second and third wait behind the first */
    for (int k = 0; k < 3; k++) {
        big_activation(&m, x, n);
        m.u.hop.microbatch = (uint32_t)k;
        CHECK_OK(nl_local_send(a, &m, &e), &e);
    }
    CHECK(freed == 3, "every frame released once, at the send: %d", freed);
    CHECK(nl_local_pending(a) > 0, "the outbox holds the rest");
    nl_rx rx;
    nl_rx_init(&rx);
    for (int k = 0; k < 3; k++) {
        nl_status st = recv_one(a, b, &rx, &e);
        CHECK(st == NL_OK, "big %d: %s", k, e.msg);
        if (st != NL_OK)
            break;
        CHECK(rx.msg.type == NL_MSG_ACTIVATION && rx.msg.u.hop.microbatch == (uint32_t)k,
              "in order: %u", rx.msg.u.hop.microbatch);
        CHECK(rx.msg.frames[0].len == (size_t)n * 4 &&
                  memcmp(rx.msg.frames[0].t.data, x, (size_t)n * 4) == 0,
              "the bytes of message %d", k);
    }
    CHECK(nl_local_pending(a) == 0, "outbox empty: %zu", nl_local_pending(a));
    CHECK(nl_local_get_stats(a).outbox_waits >= 1, "waited");
    /* a peer that does not read: with the outbox bounded at 1 MiB the
     * second big message waits 0.2 s for room, then is refused (released,
     * the link whole); once the peer reads, sends go again */
    nl_local_set_outbox(a, 1u << 20, 200);
    freed = 0;
    big_activation(&m, x, n);
    CHECK_OK(nl_local_send(a, &m, &e), &e);
    big_activation(&m, x, n);
    double t0 = now_s();
    nl_status full = nl_local_send(a, &m, &e);
    CHECK(full == NL_ERR_TIMEOUT && strstr(e.msg, "not reading") && !nl_local_broken(a),
          "a full outbox: %s %s", nl_status_str(full), e.msg);
    CHECK(now_s() - t0 >= 0.19 && now_s() - t0 < 3, "waited %.2f s", now_s() - t0);
    CHECK(freed == 2, "both released: %d", freed);
    CHECK(recv_one(a, b, &rx, &e) == NL_OK && rx.msg.frames[0].len == (size_t)n * 4,
          "the first arrives whole: %s", e.msg);
    big_activation(&m, x, n);
    CHECK_OK(nl_local_send(a, &m, &e), &e);
    CHECK(recv_one(a, b, &rx, &e) == NL_OK, "and the next: %s", e.msg);
    nl_rx_free(&rx);
    free(x);
    nl_wire_msg_free(&m);
    nl_local_close(&a);
    nl_local_close(&b);
}

/* The record of m as bytes. */
static size_t record(nl_wire_msg *m, uint8_t *out, size_t cap)
{
    nl_wire_wbuf h = {0};
    if (nl_wire_encode(m, &h, NULL, NULL) != NL_OK)
        return 0;
    const uint32_t parts = 1 + (uint32_t)m->nframes;
    size_t k = 0;
    memcpy(out, &parts, 4), k = 4;
    uint64_t len = h.len;
    memcpy(out + k, &len, 8), k += 8;
    for (int i = 0; i < m->nframes; i++)
        len = m->frames[i].len, memcpy(out + k, &len, 8), k += 8;
    memcpy(out + k, h.data, h.len), k += h.len;
    for (int i = 0; i < m->nframes && k + m->frames[i].len <= cap; i++)
        memcpy(out + k, m->frames[i].t.data, m->frames[i].len), k += m->frames[i].len;
    nl_wire_wbuf_free(&h);
    return k;
}

static void test_cut_records_and_bad_input(void)
{
    nl_error e;
    nl_local *a = NULL, *b = NULL;
    nl_rx rx;
    nl_rx_init(&rx);
    uint8_t buf[8192];
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    fill_data();
    if (!pair(&a, &b))
        return;
    /* a record written a byte at a time: nothing until the last byte */
    sample(&m, NL_MSG_TOKEN);
    size_t len = record(&m, buf, sizeof buf);
    CHECK(len > 20, "record of %zu bytes", len);
    int early = 0;
    for (size_t i = 0; i < len; i++) {
        CHECK(write(nl_local_fd(b), buf + i, 1) == 1, "write");
        nl_status st = nl_local_recv(a, &rx, &e);
        if (i + 1 < len)
            early += st != NL_ERR_TIMEOUT;
        else
            CHECK(st == NL_OK && rx.msg.type == NL_MSG_TOKEN, "whole at the last byte: %s", e.msg);
    }
    CHECK(early == 0, "%d early answers", early);
    /* three records in one write: the first read takes all three ahead,
     * and nl_local_ready says the next two need no wait for the socket
     * (whose descriptor will not be readable again): the node's loop
     * would stall on them otherwise */
    size_t k3 = 0, len0 = 0;
    for (int i = 0; i < 3; i++) {
        sample(&m, i == 1 ? NL_MSG_ACTIVATION : NL_MSG_HEARTBEAT);
        k3 += record(&m, buf + k3, sizeof buf - k3);
        len0 = len0 ? len0 : k3;
    }
    CHECK(write(nl_local_fd(b), buf, k3) == (ssize_t)k3, "write");
    CHECK(!nl_local_ready(a), "nothing read ahead yet");
    for (int i = 0; i < 3; i++) {
        nl_status st3 = nl_local_recv(a, &rx, &e);
        CHECK(st3 == NL_OK && rx.msg.type == (i == 1 ? NL_MSG_ACTIVATION : NL_MSG_HEARTBEAT),
              "record %d of three: %s", i, e.msg);
        CHECK(nl_local_ready(a) == (i < 2), "after %d: ready %d", i, nl_local_ready(a));
    }
    /* half a record read ahead is not ready */
    CHECK(write(nl_local_fd(b), buf, 10) == 10, "write");
    CHECK(nl_local_recv(a, &rx, &e) == NL_ERR_TIMEOUT && !nl_local_ready(a), "half: %s", e.msg);
    CHECK(write(nl_local_fd(b), buf + 10, len0 - 10) == (ssize_t)(len0 - 10), "write");
    CHECK(nl_local_recv(a, &rx, &e) == NL_OK && rx.msg.type == NL_MSG_HEARTBEAT, "rest: %s", e.msg);
    /* a header the codec refuses, in a well-formed record, then a good
     * message: the first is reported, the link stays */
    uint8_t junk[4 + 8 + 5] = {1, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1};
    CHECK(write(nl_local_fd(b), junk, sizeof junk) == (ssize_t)sizeof junk, "write");
    sample(&m, NL_MSG_HEARTBEAT);
    CHECK_OK(nl_local_send(b, &m, &e), &e);
    nl_status st = recv_one(b, a, &rx, &e);
    CHECK(st != NL_OK && st != NL_ERR_TIMEOUT && st != NL_ERR_IO && !nl_local_broken(a),
          "bad header: %s %s", nl_status_str(st), e.msg);
    CHECK(strstr(e.msg, "a bad message") != NULL, "names it: %s", e.msg);
    CHECK(recv_one(b, a, &rx, &e) == NL_OK && rx.msg.type == NL_MSG_HEARTBEAT,
          "the next one comes: %s", e.msg);
    /* a part over the limit: refused before anything is allocated, and the
     * link is closed for good */
    uint8_t over[4 + 16] = {2, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    CHECK(write(nl_local_fd(b), over, sizeof over) == (ssize_t)sizeof over, "write");
    st = recv_one(b, a, &rx, &e);
    CHECK(st == NL_ERR_LIMIT && strstr(e.msg, "limit"), "huge part: %s %s", nl_status_str(st),
          e.msg);
    CHECK(nl_local_broken(a) && nl_local_recv(a, &rx, &e) == NL_ERR_IO, "broken after: %s", e.msg);
    nl_local_close(&a);
    nl_local_close(&b);
    /* too many parts */
    if (!pair(&a, &b))
        return;
    uint8_t many[4] = {200, 0, 0, 0};
    CHECK(write(nl_local_fd(b), many, 4) == 4, "write");
    st = recv_one(b, a, &rx, &e);
    CHECK(st == NL_ERR_LIMIT && strstr(e.msg, "200 parts"), "%s", e.msg);
    nl_local_close(&a);
    nl_local_close(&b);
    /* the peer closes: the reader and, soon, the writer say so; frames are
     * released on a broken link too */
    if (!pair(&a, &b))
        return;
    nl_local_close(&b);
    CHECK(recv_one(NULL, a, &rx, &e) == NL_ERR_IO && strstr(e.msg, "closed"), "%s", e.msg);
    float one[64];
    freed = 0;
    big_activation(&m, one, 64);
    CHECK(nl_local_send(a, &m, &e) == NL_ERR_IO, "send on a closed link: %s", e.msg);
    CHECK(freed == 1, "released: %d", freed);
    nl_local_close(&a);
    if (!pair(&a, &b))
        return;
    nl_local_close(&a);
    freed = 0;
    nl_status s1 = NL_OK;
    for (int i = 0; i < 3 && s1 == NL_OK; i++) { /* EPIPE on the first or a later write */
        big_activation(&m, one, 64);
        s1 = nl_local_send(b, &m, &e);
    }
    CHECK(s1 == NL_ERR_IO && freed >= 1, "writer sees the close: %s", e.msg);
    nl_local_close(&b);
    nl_rx_free(&rx);
    nl_wire_msg_free(&m);
    CHECK(nl_net_parts_open() == 0, "parts still open: %ld", nl_net_parts_open());
}

/* LOCAL_LINK: each op round-trips with the strings it carries; an OFFER
 * without its host, name or a 64-digit token, a string that only an
 * OFFER carries on another op, a reason on anything but a DECLINE, and an
 * op outside 1-4 are refused, by the encoder and (patched bytes) by the
 * decoder, naming the field. */
static void test_local_link(void)
{
    nl_wire_msg m, d;
    enc e = {0};
    nl_error err;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&d);
    char host128[129];
    memset(host128, 'h', 128);
    host128[128] = '\0';
    const char *const H = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0/1000/4026531840", *const N = "nl-1";
    struct {
        nl_msg_local_link l;
        const char *why; /* NULL: accepted */
    } cases[] = {
        {{NL_LOCAL_OFFER, H, N, LOCAL_TOKEN, ""}, NULL},
        {{NL_LOCAL_READY, "", N, "", ""}, NULL},
        {{NL_LOCAL_SWITCH, NULL, N, NULL, NULL}, NULL},
        {{NL_LOCAL_DECLINE, "", N, "", "no local link: --no-local-link \xe2\x9c\x93"}, NULL},
        {{NL_LOCAL_DECLINE, "", N, "", ""}, NULL},
        {{NL_LOCAL_OFFER, H, N, &LOCAL_TOKEN[1], ""}, "token: 63 hex digits, must be 64"},
        {{NL_LOCAL_OFFER, H, N, "", ""}, "token: an OFFER needs it"},
        {{NL_LOCAL_OFFER, "", N, LOCAL_TOKEN, ""}, "host: an OFFER needs it"},
        {{NL_LOCAL_OFFER, H, NULL, LOCAL_TOKEN, ""}, "name: an OFFER needs it"},
        {{NL_LOCAL_OFFER, H, "nl 1", LOCAL_TOKEN, ""}, "name: must be printable ASCII without"},
        {{NL_LOCAL_OFFER, host128, N, LOCAL_TOKEN, ""}, "host: string of 128 bytes"},
        {{NL_LOCAL_OFFER, H, N, "9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08",
          ""},
         "token: must be lowercase hex"},
        {{NL_LOCAL_OFFER, H, N, LOCAL_TOKEN, "why"}, "reason: set on an OFFER"},
        {{NL_LOCAL_SWITCH, "", "", "", ""}, "name: a SWITCH needs it"},
        {{NL_LOCAL_READY, NULL, NULL, NULL, NULL}, "name: a READY needs it"},
        {{NL_LOCAL_DECLINE, "", "", "", "busy"}, "name: a DECLINE needs it"},
        {{NL_LOCAL_READY, "", N, LOCAL_TOKEN, ""}, "token: set on a READY"},
        {{NL_LOCAL_DECLINE, H, N, "", "busy"}, "host: set on a DECLINE"},
        {{NL_LOCAL_READY, "", N, "", "why"}, "reason: set on a READY"},
        {{0, "", N, "", ""}, "op: 0 is outside [1, 4]"},
        {{5, "", N, "", ""}, "op: 5 is outside [1, 4]"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        nl_wire_msg_reset(&m, NL_MSG_LOCAL_LINK);
        m.u.local_link = cases[c].l;
        nl_status st = enc_msg(&m, &e, NULL, &err);
        if (!cases[c].why) {
            CHECK(st == NL_OK && (st = dec_parts(&d, &e, NULL, &err)) == NL_OK && same_msg(&m, &d),
                  "LOCAL_LINK case %zu round-trips: %s", c, st == NL_OK ? "differs" : err.msg);
        } else {
            CHECK(st != NL_OK && strstr(err.msg, cases[c].why), "LOCAL_LINK case %zu refused: %s",
                  c, st != NL_OK ? err.msg : "accepted");
        }
    }
    /* the decoder applies the same checks: an OFFER's op made SWITCH, 0, 5 */
    sample(&m, NL_MSG_LOCAL_LINK);
    CHECK_OK(enc_msg(&m, &e, NULL, &err), &err);
    uint8_t *h = malloc(e.hdr.len);
    memcpy(h, e.hdr.data, e.hdr.len);
    uint8_t *at = NULL;
    for (size_t i = 0; !at && i + 4 <= e.hdr.len; i++)
        if (memcmp(h + i, "\xa2op\x01", 4) == 0) /* op: 1 */
            at = h + i;
    CHECK(at != NULL, "LOCAL_LINK: op not found");
    static const struct {
        uint8_t op;
        const char *why;
    } patch[] = {{NL_LOCAL_SWITCH, "host: set on a SWITCH"}, {0, "op: 0"}, {5, "op: 5"}};
    for (size_t k = 0; at && k < sizeof patch / sizeof patch[0]; k++) {
        at[3] = patch[k].op;
        nl_status st = dec_copy(&d, h, e.hdr.len, NULL, 0, NULL, &err);
        CHECK(st != NL_OK && strstr(err.msg, patch[k].why), "LOCAL_LINK op %u decoded: %s",
              patch[k].op, st != NL_OK ? err.msg : "accepted");
    }
    free(h);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&d);
    nl_wire_wbuf_free(&e.hdr);
    printf("LOCAL_LINK: ok\n");
}

/* --write-corpus DIR: fuzz/fuzz_locallink.c's seeds, the bytes a peer
 * writes: records of sample messages, alone and in a row, one cut short,
 * one whose header the codec refuses, and records over the limits. */
static int write_corpus(const char *dir)
{
    static uint8_t buf[65536];
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    fill_data();
    char path[4096];
    const nl_msg_type one[] = {NL_MSG_HEARTBEAT, NL_MSG_ACTIVATION, NL_MSG_LOCAL_LINK};
    for (int i = 0; i < 3; i++) { /* one record each, then all three in a row */
        sample(&m, one[i]);
        size_t len = record(&m, buf, sizeof buf);
        snprintf(path, sizeof path, "%s/%s", dir, nl_wire_type_name(one[i]));
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0)
            return 1;
    }
    size_t k = 0;
    for (int i = 0; i < 3; i++) {
        sample(&m, one[i]);
        k += record(&m, buf + k, sizeof buf - k);
    }
    snprintf(path, sizeof path, "%s/three-in-a-row", dir);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(buf, 1, k, f) != k || fclose(f) != 0)
        return 1;
    sample(&m, NL_MSG_ACTIVATION); /* cut in its frame */
    k = record(&m, buf, sizeof buf);
    const uint8_t junk[] = {1, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1};
    const uint8_t over[] = {2, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    const uint8_t many[] = {200, 0, 0, 0};
    const struct {
        const char *name;
        const void *p;
        size_t len;
    } raw[] = {{"cut-short", buf, k - 7},
               {"bad-header", junk, sizeof junk},
               {"part-over-limit", over, sizeof over},
               {"too-many-parts", many, sizeof many}};
    for (size_t i = 0; i < sizeof raw / sizeof raw[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, raw[i].name);
        f = fopen(path, "wb");
        if (!f || fwrite(raw[i].p, 1, raw[i].len, f) != raw[i].len || fclose(f) != 0)
            return 1;
    }
    nl_wire_msg_free(&m);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0)
        return write_corpus(argv[2]);
    test_local_link();
    test_host();
    test_who_may_connect();
    test_every_type();
    test_large_and_ordered();
    test_cut_records_and_bad_input();
    return check_done("test_locallink");
}
