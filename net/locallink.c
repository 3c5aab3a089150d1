/* A local link between two co-located stages (net/locallink.h). */
#define _GNU_SOURCE
#include "net/locallink.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"

#define TOKEN_BYTES 32
#define PREAMBLE_MAX (4 + 8 * NL_RX_MAX_PARTS)
#define INBUF 65536 /* read-ahead; a part at least this long is read in place */

struct nl_local_listener {
    int fd;
    char token[NL_LOCAL_TOKEN_HEX + 1];
};

typedef struct reader {
    uint8_t pre[PREAMBLE_MAX]; /* the record's count and lengths */
    size_t pre_have;
    int nparts; /* 0 until the count is read */
    uint64_t lens[NL_RX_MAX_PARTS];
    void *bufs[NL_RX_MAX_PARTS];
    int cur; /* the part being read, nparts when whole */
    uint64_t cur_have;
} reader;

struct nl_local {
    int fd;
    bool broken;
    char who[96];
    nl_wire_limits lim;
    uint64_t max_part, max_msg;
    nl_wire_wbuf wbuf;
    uint8_t *out; /* the outbox: out[out_off, out_len) waits */
    size_t out_len, out_off, out_cap;
    size_t out_max;      /* a send waits while more than this would wait */
    int send_timeout_ms; /* ... this long at most */
    uint8_t *in;         /* read-ahead: in[in_off, in_len) */
    size_t in_len, in_off;
    reader rd;
    nl_local_stats stats;
};

static socklen_t abstract_addr(struct sockaddr_un *a, const char *name)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    size_t n = strlen(name);
    if (n > sizeof a->sun_path - 1)
        n = sizeof a->sun_path - 1;
    memcpy(a->sun_path + 1, name, n); /* sun_path[0] = 0: the abstract namespace */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static bool same_uid(int fd)
{
    struct ucred cr;
    socklen_t len = sizeof cr;
    return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 && cr.uid == geteuid();
}

static void set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

nl_status nl_local_host(char *out, size_t size, nl_error *err)
{
    char boot[64] = "", ns[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f))
            boot[0] = '\0';
        fclose(f);
    }
    boot[strcspn(boot, "\n")] = '\0';
    ssize_t n = readlink("/proc/self/ns/net", ns, sizeof ns - 1);
    ns[n > 0 ? n : 0] = '\0';
    /* "net:[4026531992]": the number names the namespace */
    const char *num = strchr(ns, '[');
    size_t nlen = num ? strspn(num + 1, "0123456789") : 0;
    if (!boot[0] || !nlen)
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "local links: cannot read this host's boot id or network namespace");
    int w = snprintf(out, size, "%s/%u/%.*s", boot, (unsigned)geteuid(), (int)nlen, num + 1);
    if (w < 0 || (size_t)w >= size)
        return nl_error_set(err, NL_ERR_LIMIT, "local links: the host text is too long");
    return NL_OK;
}

nl_status nl_local_listen(nl_local_listener **out, char *name, char *token, nl_error *err)
{
    *out = NULL;
    if (sodium_init() < 0)
        return nl_error_set(err, NL_ERR_INTERNAL, "local links: libsodium did not start");
    uint8_t rnd[16], tok[TOKEN_BYTES];
    randombytes_buf(rnd, sizeof rnd);
    randombytes_buf(tok, sizeof tok);
    char hex[2 * sizeof rnd + 1];
    sodium_bin2hex(hex, sizeof hex, rnd, sizeof rnd);
    snprintf(name, NL_LOCAL_NAME_MAX, "neurollm-%s", hex);
    nl_local_listener *l = calloc(1, sizeof *l);
    if (!l)
        return nl_error_set(err, NL_ERR_NOMEM, "local links: out of memory");
    sodium_bin2hex(l->token, sizeof l->token, tok, sizeof tok);
    sodium_memzero(tok, sizeof tok);
    l->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_un a;
    socklen_t alen = abstract_addr(&a, name);
    if (l->fd < 0 || bind(l->fd, (struct sockaddr *)&a, alen) != 0 || listen(l->fd, 16) != 0) {
        int e = errno;
        nl_local_listener_close(&l);
        return nl_error_set(err, NL_ERR_IO, "local links: listening on @%s: %s", name, strerror(e));
    }
    memcpy(token, l->token, sizeof l->token);
    *out = l;
    return NL_OK;
}

void nl_local_listener_close(nl_local_listener **lp)
{
    if (!lp || !*lp)
        return;
    if ((*lp)->fd >= 0)
        close((*lp)->fd);
    sodium_memzero((*lp)->token, sizeof(*lp)->token);
    free(*lp);
    *lp = NULL;
}

static nl_status make(nl_local **out, int fd, const nl_wire_limits *lim, uint64_t max_part,
                      uint64_t max_msg, const char *who, nl_error *err)
{
    nl_local *c = calloc(1, sizeof *c);
    uint8_t *in = malloc(INBUF);
    if (!c || !in) {
        free(c);
        free(in);
        close(fd);
        return nl_error_set(err, NL_ERR_NOMEM, "local link: out of memory");
    }
    c->fd = fd;
    c->in = in;
    c->lim = lim ? *lim : nl_wire_limits_default();
    c->max_part = max_part ? max_part : c->lim.max_frame_bytes; /* a bulk socket's */
    c->max_msg = max_msg ? max_msg : 2 * c->max_part;
    c->out_max = NL_LOCAL_OUTBOX_MAX;
    c->send_timeout_ms = NL_LOCAL_SEND_TIMEOUT_MS;
    snprintf(c->who, sizeof c->who, "%s", who ? who : "a peer");
    set_nonblock(fd);
    *out = c;
    return NL_OK;
}

/* Read exactly n bytes into p before the deadline. */
static bool read_full(int fd, void *p, size_t n, int64_t deadline)
{
    size_t have = 0;
    while (have < n) {
        ssize_t r = recv(fd, (uint8_t *)p + have, n - have, MSG_DONTWAIT);
        if (r > 0) {
            have += (size_t)r;
            continue;
        }
        if (r == 0 || (errno != EAGAIN && errno != EINTR))
            return false;
        int64_t left = deadline - nl_mono_ms();
        struct pollfd pf = {fd, POLLIN, 0};
        if (left <= 0 || poll(&pf, 1, (int)left) < 0)
            return false;
    }
    return true;
}

nl_status nl_local_accept(nl_local_listener *l, const nl_wire_limits *lim, uint64_t max_part,
                          uint64_t max_msg, const char *who, nl_local **out, nl_error *err)
{
    *out = NULL;
    const int64_t deadline = nl_mono_ms() + NL_LOCAL_ACCEPT_MS;
    int refused = 0;
    for (;;) {
        int fd = accept4(l->fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
                return nl_error_set(err, NL_ERR_IO, "local link from %s: accept: %s", who,
                                    strerror(errno));
            int64_t left = deadline - nl_mono_ms();
            struct pollfd pf = {l->fd, POLLIN, 0};
            if (left <= 0 || poll(&pf, 1, (int)left) <= 0)
                break;
            continue;
        }
        char tok[NL_LOCAL_TOKEN_HEX];
        if (same_uid(fd) && read_full(fd, tok, sizeof tok, deadline) &&
            sodium_memcmp(tok, l->token, sizeof tok) == 0)
            return make(out, fd, lim, max_part, max_msg, who, err);
        close(fd);
        refused++;
    }
    return refused ? nl_error_set(err, NL_ERR_AUTH,
                                  "local link from %s: %d connection(s) refused (another user, "
                                  "or not the token offered)",
                                  who, refused)
                   : nl_error_set(err, NL_ERR_TIMEOUT, "local link from %s: no connection in %d ms",
                                  who, NL_LOCAL_ACCEPT_MS);
}

nl_status nl_local_connect(const char *name, const char *token, const nl_wire_limits *lim,
                           uint64_t max_part, uint64_t max_msg, const char *who, nl_local **out,
                           nl_error *err)
{
    *out = NULL;
    if (!name || !name[0] || strlen(name) >= NL_LOCAL_NAME_MAX || !token ||
        strlen(token) != NL_LOCAL_TOKEN_HEX)
        return nl_error_set(err, NL_ERR_INVALID, "local link to %s: a bad name or token", who);
    /* non-blocking: a listener whose queue another user filled (any user
     * may connect to an abstract name) refuses at once with EAGAIN, and
     * the caller stays on ZeroMQ, instead of waiting */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_un a;
    socklen_t alen = abstract_addr(&a, name);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, alen) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return nl_error_set(err, NL_ERR_IO, "local link to %s at @%s: %s", who, name,
                            e == EAGAIN ? "its listener's queue is full" : strerror(e));
    }
    if (!same_uid(fd)) {
        close(fd);
        return nl_error_set(err, NL_ERR_AUTH,
                            "local link to %s at @%s: its listener is another user", who, name);
    }
    /* 64 bytes into an empty socket's buffer: all at once, or not at all */
    ssize_t w;
    do
        w = send(fd, token, NL_LOCAL_TOKEN_HEX, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (w < 0 && errno == EINTR);
    if (w != NL_LOCAL_TOKEN_HEX) {
        int e = errno;
        close(fd);
        return nl_error_set(err, NL_ERR_IO, "local link to %s: sending the token: %s", who,
                            w < 0 ? strerror(e) : "cut short");
    }
    return make(out, fd, lim, max_part, max_msg, who, err);
}

static void reader_reset(reader *r, bool free_bufs)
{
    for (int i = 0; i < r->nparts && free_bufs; i++)
        free(r->bufs[i]);
    memset(r, 0, sizeof *r);
}

void nl_local_close(nl_local **cp)
{
    if (!cp || !*cp)
        return;
    nl_local *c = *cp;
    if (c->fd >= 0)
        close(c->fd);
    reader_reset(&c->rd, true);
    nl_wire_wbuf_free(&c->wbuf);
    free(c->out);
    free(c->in);
    free(c);
    *cp = NULL;
}

int nl_local_fd(const nl_local *c)
{
    return c ? c->fd : -1;
}

nl_local_stats nl_local_get_stats(const nl_local *c)
{
    return c->stats;
}

static nl_status broken(nl_local *c, nl_status st, nl_error *err, const char *fmt, const char *what)
{
    if (!c->broken)
        NL_DEBUG("local link with %s: %s%s", c->who, fmt, what);
    c->broken = true;
    return nl_error_set(err, st, "local link with %s: %s%s", c->who, fmt, what);
}

/* Copy iov[] past its first skip bytes into the outbox. */
static bool outbox_add(nl_local *c, const struct iovec *iov, int n, size_t skip)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += iov[i].iov_len;
    if (c->out_off == c->out_len)
        c->out_off = c->out_len = 0;
    size_t need = c->out_len + (total - skip);
    if (need > c->out_cap && c->out_off > 0) { /* what was written leaves room at the front */
        memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
        c->out_len -= c->out_off;
        c->out_off = 0;
        need = c->out_len + (total - skip);
    }
    if (need > c->out_cap) {
        size_t cap = c->out_cap ? c->out_cap : 65536;
        while (cap < need)
            cap *= 2;
        uint8_t *p = realloc(c->out, cap);
        if (!p)
            return false;
        c->out = p;
        c->out_cap = cap;
    }
    for (int i = 0; i < n; i++) {
        size_t len = iov[i].iov_len;
        const uint8_t *p = iov[i].iov_base;
        if (skip >= len) {
            skip -= len;
            continue;
        }
        memcpy(c->out + c->out_len, p + skip, len - skip);
        c->out_len += len - skip;
        skip = 0;
    }
    return true;
}

nl_status nl_local_flush(nl_local *c, nl_error *err)
{
    if (c->broken)
        return nl_error_set(err, NL_ERR_IO, "local link with %s: broken", c->who);
    while (c->out_off < c->out_len) {
        ssize_t w =
            send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            c->out_off += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && errno == EAGAIN)
            return NL_OK;
        return broken(c, NL_ERR_IO, err, "sending: ", w < 0 ? strerror(errno) : "closed");
    }
    c->out_off = c->out_len = 0;
    return NL_OK;
}

size_t nl_local_pending(const nl_local *c)
{
    return c && !c->broken ? c->out_len - c->out_off : 0;
}

/* Flush, waiting for the socket, until the outbox has room for total more
 * bytes (or is empty), up to c->send_timeout_ms. */
static nl_status wait_room(nl_local *c, size_t total, nl_error *err)
{
    const int64_t deadline = nl_mono_ms() + c->send_timeout_ms;
    for (;;) {
        nl_status st = nl_local_flush(c, err);
        if (st != NL_OK)
            return st;
        const size_t pending = c->out_len - c->out_off;
        if (pending == 0 || pending + total <= c->out_max)
            return NL_OK;
        const int64_t left = deadline - nl_mono_ms();
        struct pollfd pf = {c->fd, POLLOUT, 0};
        if (left <= 0 || poll(&pf, 1, (int)left) < 0)
            return nl_error_set(
                err, NL_ERR_TIMEOUT,
                "local link with %s: sending: timed out (peer not reading? %zu bytes "
                "wait to go)",
                c->who, pending);
    }
}

void nl_local_set_outbox(nl_local *c, size_t max_bytes, int timeout_ms)
{
    c->out_max = max_bytes;
    c->send_timeout_ms = timeout_ms;
}

nl_status nl_local_send(nl_local *c, nl_wire_msg *m, nl_error *err)
{
    nl_status st = NL_OK;
    if (c->broken) {
        st = nl_error_set(err, NL_ERR_IO, "local link with %s: broken", c->who);
        goto out;
    }
    if ((st = nl_wire_encode(m, &c->wbuf, &c->lim, err)) != NL_OK)
        goto out;
    uint8_t pre[PREAMBLE_MAX];
    const uint32_t parts = 1 + (uint32_t)m->nframes;
    struct iovec iov[2 + NL_WIRE_MAX_FRAMES];
    int n = 0;
    pre[0] = (uint8_t)parts, pre[1] = (uint8_t)(parts >> 8), pre[2] = pre[3] = 0;
    for (uint32_t i = 0; i < parts; i++) {
        uint64_t len = i == 0 ? c->wbuf.len : m->frames[i - 1].len;
        for (int b = 0; b < 8; b++)
            pre[4 + 8 * i + b] = (uint8_t)(len >> (8 * b));
    }
    iov[n++] = (struct iovec){pre, 4 + 8 * (size_t)parts};
    iov[n++] = (struct iovec){c->wbuf.data, c->wbuf.len};
    size_t total = iov[0].iov_len + iov[1].iov_len;
    for (int i = 0; i < m->nframes; i++) {
        iov[n++] = (struct iovec){m->frames[i].t.data, m->frames[i].len};
        total += m->frames[i].len;
    }
    /* a peer that does not read: wait for room, as a ZeroMQ send at its
     * high-water mark does, then give up on this message */
    if (c->out_len - c->out_off > 0 && c->out_len - c->out_off + total > c->out_max &&
        (st = wait_room(c, total, err)) != NL_OK)
        goto out;
    size_t done = 0;
    if (c->out_off == c->out_len) { /* nothing waits: straight to the socket */
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w;
        do
            w = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        while (w < 0 && errno == EINTR);
        if (w < 0 && errno != EAGAIN) {
            st = broken(c, NL_ERR_IO, err, "sending: ", strerror(errno));
            goto out;
        }
        done = w > 0 ? (size_t)w : 0;
    }
    if (done < total) {
        if (!outbox_add(c, iov, n, done)) {
            st = broken(c, NL_ERR_NOMEM, err, "out of memory for the outbox", "");
            goto out;
        }
        c->stats.outbox_waits++;
    }
    c->stats.sent++;
    c->stats.bytes_out += total;
out:
    nl_wire_release_frames(m, 0); /* m keeps its fields and frame lengths, as after nl_sock_send */
    return st;
}

/* Take up to n bytes for p from the read-ahead, or from the socket (in
 * place when n is large). Returns the bytes taken, 0 when none is there
 * now, -1 with *st set when the link is closed or broken. */
static ssize_t take(nl_local *c, uint8_t *p, size_t n, nl_status *st, nl_error *err)
{
    if (c->in_off == c->in_len) {
        c->in_off = c->in_len = 0;
        const bool direct = n >= INBUF;
        ssize_t r;
        do
            r = recv(c->fd, direct ? p : c->in, direct ? n : INBUF, MSG_DONTWAIT);
        while (r < 0 && errno == EINTR);
        if (r == 0) {
            *st = broken(c, NL_ERR_IO, err, "the peer closed it", "");
            return -1;
        }
        if (r < 0) {
            if (errno == EAGAIN)
                return 0;
            *st = broken(c, NL_ERR_IO, err, "receiving: ", strerror(errno));
            return -1;
        }
        c->stats.bytes_in += (uint64_t)r;
        if (direct)
            return r;
        c->in_len = (size_t)r;
    }
    size_t k = c->in_len - c->in_off < n ? c->in_len - c->in_off : n;
    memcpy(p, c->in + c->in_off, k);
    c->in_off += k;
    return (ssize_t)k;
}

static nl_status check_lengths(nl_local *c, nl_error *err)
{
    reader *r = &c->rd;
    uint64_t total = 0;
    char what[160];
    for (int i = 0; i < r->nparts; i++) {
        uint64_t len = 0;
        for (int b = 0; b < 8; b++)
            len |= (uint64_t)r->pre[4 + 8 * i + b] << (8 * b);
        const uint64_t max = i == 0 ? c->lim.max_header : c->max_part;
        if (len > max) {
            snprintf(what, sizeof what, "part %d of %llu bytes, limit %llu", i,
                     (unsigned long long)len, (unsigned long long)max);
            return broken(c, NL_ERR_LIMIT, err, what, "");
        }
        r->lens[i] = len;
        total += len;
    }
    if (total > c->max_msg) {
        snprintf(what, sizeof what, "a message of %llu bytes, limit %llu",
                 (unsigned long long)total, (unsigned long long)c->max_msg);
        return broken(c, NL_ERR_LIMIT, err, what, "");
    }
    for (int i = 0; i < r->nparts; i++)
        if (!(r->bufs[i] = malloc(r->lens[i] ? r->lens[i] : 1))) {
            r->nparts = i; /* free what was allocated */
            return broken(c, NL_ERR_NOMEM, err, "out of memory for a message", "");
        }
    return NL_OK;
}

bool nl_local_broken(const nl_local *c)
{
    return c->broken;
}

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int b = 0; b < 8; b++)
        v |= (uint64_t)p[b] << (8 * b);
    return v;
}

/* Whether the read-ahead holds the rest of the record being read (or a
 * count or length that nl_local_recv will refuse: it should say so now). */
bool nl_local_ready(const nl_local *c)
{
    if (!c || c->broken)
        return false;
    const reader *r = &c->rd;
    const uint8_t *p = c->in + c->in_off;
    size_t avail = c->in_len - c->in_off;
    if (r->nparts > 0) {
        uint64_t rest = r->lens[r->cur] - r->cur_have;
        for (int i = r->cur + 1; i < r->nparts; i++)
            rest += r->lens[i];
        return avail >= rest;
    }
    uint8_t pre[PREAMBLE_MAX];
    size_t have = r->pre_have;
    memcpy(pre, r->pre, have);
    if (have < 4) {
        if (avail < 4 - have)
            return false;
        memcpy(pre + have, p, 4 - have);
        p += 4 - have, avail -= 4 - have, have = 4;
    }
    const uint32_t parts = pre[0] | pre[1] << 8 | (uint32_t)pre[2] << 16 | (uint32_t)pre[3] << 24;
    if (parts < 1 || parts > (uint32_t)c->lim.max_frames + 1 || parts > NL_RX_MAX_PARTS)
        return true;
    const size_t want = 4 + 8 * (size_t)parts;
    if (avail < want - have)
        return false;
    memcpy(pre + have, p, want - have);
    p += want - have, avail -= want - have;
    uint64_t total = 0;
    for (uint32_t i = 0; i < parts; i++) {
        const uint64_t len = le64(pre + 4 + 8 * i);
        if (len > (i == 0 ? c->lim.max_header : c->max_part))
            return true;
        total += len;
    }
    return total > c->max_msg || avail >= total;
}

nl_status nl_local_recv(nl_local *c, nl_rx *rx, nl_error *err)
{
    reader *r = &c->rd;
    nl_status st = NL_OK;
    if (c->broken)
        return nl_error_set(err, NL_ERR_IO, "local link with %s: broken", c->who);
    for (;;) {
        if (r->nparts == 0) { /* the part count, then the lengths */
            size_t want = r->pre_have < 4 ? 4 : 4 + 8 * (size_t)(r->pre[0] | r->pre[1] << 8);
            ssize_t k = take(c, r->pre + r->pre_have, want - r->pre_have, &st, err);
            if (k < 0)
                return st;
            if (k == 0)
                return nl_error_set(err, NL_ERR_TIMEOUT, "local link: no whole message yet");
            r->pre_have += (size_t)k;
            if (r->pre_have == 4) {
                uint32_t parts = r->pre[0] | r->pre[1] << 8 | (uint32_t)r->pre[2] << 16 |
                                 (uint32_t)r->pre[3] << 24;
                if (parts < 1 || parts > (uint32_t)c->lim.max_frames + 1 ||
                    parts > NL_RX_MAX_PARTS) {
                    char what[64];
                    snprintf(what, sizeof what, "a record of %u parts", parts);
                    return broken(c, NL_ERR_LIMIT, err, what, "");
                }
            } else if (r->pre_have == want) {
                r->nparts = r->pre[0] | r->pre[1] << 8;
                if ((st = check_lengths(c, err)) != NL_OK)
                    return st;
            }
            continue;
        }
        while (r->cur < r->nparts && r->cur_have == r->lens[r->cur]) {
            r->cur++;
            r->cur_have = 0;
        }
        if (r->cur == r->nparts)
            break;
        ssize_t k = take(c, (uint8_t *)r->bufs[r->cur] + r->cur_have,
                         (size_t)(r->lens[r->cur] - r->cur_have), &st, err);
        if (k < 0)
            return st;
        if (k == 0)
            return nl_error_set(err, NL_ERR_TIMEOUT, "local link: no whole message yet");
        r->cur_have += (uint64_t)k;
    }
    size_t lens[NL_RX_MAX_PARTS];
    for (int i = 0; i < r->nparts; i++)
        lens[i] = (size_t)r->lens[i];
    const int n = r->nparts;
    void *bufs[NL_RX_MAX_PARTS];
    memcpy(bufs, r->bufs, sizeof bufs);
    reader_reset(r, false); /* rx owns the buffers now */
    c->stats.received++;
    st = nl_rx_adopt(rx, bufs, lens, n, c->who, &c->lim, err);
    return st == NL_OK ? st : nl_error_prefix(err, "local link with %s: a bad message", c->who);
}
