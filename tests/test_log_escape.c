/* base/log: nl_log_escape, which makes a peer's free text safe to log and
 * to quote; and the wire decoder's "unknown key" error, which quotes the
 * peer's raw key bytes and must stay valid one-line text (issue 15,
 * finding 10). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "net/wire.h"
#include "tests/check.h"

/* Valid UTF-8, no control character (C0, DEL, C1). */
static int clean_text(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p, need = c < 0x80                 ? 0
                                : c >= 0xc2 && c <= 0xdf ? 1
                                : c >= 0xe0 && c <= 0xef ? 2
                                : c >= 0xf0 && c <= 0xf4 ? 3
                                                         : 9;
        if (need == 9 || c < 0x20 || c == 0x7f || (c == 0xc2 && p[1] >= 0x80 && p[1] < 0xa0))
            return 0;
        for (unsigned i = 1; i <= need; i++)
            if ((p[i] & 0xc0) != 0x80)
                return 0;
        p += need + 1;
    }
    return 1;
}

static void expect(const char *in, size_t n, size_t cap, const char *want)
{
    char out[256];
    nl_log_escape_n(out, cap, in, n);
    CHECK(strcmp(out, want) == 0 && clean_text(out) && strlen(out) < cap,
          "escape of %zu bytes (cap %zu): got '%s', want '%s'", n, cap, out, want);
}

static void test_escape(void)
{
    char out[64];
    expect("plain text", 10, 64, "plain text");
    expect("two\nlines\r\tand", 14, 64, "two\\nlines\\r\\tand");
    expect("\x1b[31mred\x1b[0m", 12, 64, "\\x1b[31mred\\x1b[0m");
    expect("back\\slash", 10, 64, "back\\\\slash");
    expect("nul\0byte", 8, 64, "nul\\x00byte");
    expect("del\x7f", 4, 64, "del\\x7f");
    expect("caf\xc3\xa9 \xe2\x82\xac", 9, 64, "caf\xc3\xa9 \xe2\x82\xac"); /* UTF-8 kept */
    expect("c1 \xc2\x85 next line", 15, 64, "c1 \\xc2\\x85 next line");    /* NEL */
    expect("bad \xff\xfe", 6, 64, "bad \\xff\\xfe");
    expect("cut \xe2\x82", 6, 64, "cut \\xe2\\x82");            /* a truncated sequence */
    expect("overlong \xc0\xaf", 11, 64, "overlong \\xc0\\xaf"); /* "/" overlong */
    expect("surrogate \xed\xa0\x80", 13, 64, "surrogate \\xed\\xa0\\x80");
    /* cut to fit, never inside an escape or a character, marked "..." */
    expect("abcdefghij", 10, 8, "abcd...");
    expect("abcdefg", 7, 8, "abcdefg");
    expect("\n\n\n\n\n", 5, 8, "\\n\\n...");
    expect("\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac", 9, 8, "\xe2\x82\xac...");
    expect("x", 1, 1, "");
    CHECK(strcmp(nl_log_escape(out, sizeof out, NULL), "(null)") == 0, "NULL");
    CHECK(strcmp(nl_log_escape(out, sizeof out, "a\nb"), "a\\nb") == 0, "nl_log_escape");
    /* every byte value, alone: clean output */
    for (int b = 0; b < 256; b++) {
        char in = (char)b;
        nl_log_escape_n(out, sizeof out, &in, 1);
        CHECK(clean_text(out) && out[0], "byte %02x: '%s'", b, out);
    }
}

/* A HEARTBEAT whose header gains one more key, `key` (n bytes) = nil. */
static void test_unknown_key(const char *key, size_t n)
{
    nl_wire_msg m;
    nl_wire_wbuf wb = {0};
    nl_error err = {0};
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_HEARTBEAT);
    m.u.heartbeat.node_id = 1;
    m.u.heartbeat.seq = 1;
    CHECK_OK(nl_wire_encode(&m, &wb, NULL, &err), &err);
    uint8_t buf[512];
    CHECK(wb.len + n + 2 < sizeof buf && wb.len > 0 && (wb.data[0] & 0xf0) == 0x80 &&
              (wb.data[0] & 0x0f) < 15 && n < 32,
          "a fixmap header");
    if (wb.len + n + 2 >= sizeof buf || n >= 32)
        return;
    memcpy(buf, wb.data, wb.len);
    buf[0]++; /* one more pair */
    size_t len = wb.len;
    buf[len++] = (uint8_t)(0xa0 | n); /* fixstr: msgpack does not check UTF-8 */
    memcpy(buf + len, key, n);
    len += n;
    buf[len++] = 0xc0; /* nil */
    nl_wire_part part = {buf, len};
    nl_status st = nl_wire_decode(&m, &part, 1, NULL, &err);
    CHECK(st == NL_ERR_PROTO && strstr(err.msg, "unknown key") && clean_text(err.msg),
          "unknown key: %s '%s'", nl_status_str(st), err.msg);
    /* the text an ERROR reply carries must encode (the encoder wants UTF-8) */
    nl_wire_msg e;
    nl_wire_msg_init(&e);
    nl_wire_msg_reset(&e, NL_MSG_ERROR);
    e.u.error.code = NL_ERR_PROTO;
    e.u.error.req_type = NL_MSG_HEARTBEAT;
    e.u.error.message = err.msg;
    nl_error err2 = {0};
    CHECK_OK(nl_wire_encode(&e, &wb, NULL, &err2), &err2);
    nl_wire_msg_free(&e);
    nl_wire_msg_free(&m);
    nl_wire_wbuf_free(&wb);
}

int main(void)
{
    test_escape();
    test_unknown_key("evil\n12:00:00.000 ERROR [coord] forged", 31);
    test_unknown_key("\xff\xfe\x1b[2J\0x", 7);
    return check_done("test_log_escape");
}
