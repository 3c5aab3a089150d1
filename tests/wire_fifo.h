/* A queue of wire messages stored encoded, for the tests that run stages
 * in one process without sockets (stage_train_harness.h,
 * test_replica_threads.c): every message a stage sends goes through the
 * real codec (push encodes it, pop decodes it), as it would over a
 * socket. A queue holds WIRE_FIFO_MAX messages (a test may define it
 * first). Header-only, as check.h is: its CHECKs count in the program
 * that includes it. */
#ifndef NL_TEST_WIRE_FIFO_H
#define NL_TEST_WIRE_FIFO_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "net/wire.h"
#include "tests/check.h"

#ifndef WIRE_FIFO_MAX
#define WIRE_FIFO_MAX 4096
#endif

typedef struct packet {
    uint8_t *hdr;
    size_t hlen;
    uint8_t *frame[NL_WIRE_MAX_FRAMES];
    size_t flen[NL_WIRE_MAX_FRAMES];
    int nframes;
} packet;

typedef struct fifo {
    packet p[WIRE_FIFO_MAX];
    int head, len;
} fifo;

/* Encode m onto the queue's tail (m stays the caller's). */
static inline void push(fifo *f, nl_wire_msg *m)
{
    nl_wire_wbuf wb = {0};
    nl_error err;
    CHECK_OK(nl_wire_encode(m, &wb, NULL, &err), &err);
    if (f->len == WIRE_FIFO_MAX) {
        CHECK(0, "queue full");
        nl_wire_wbuf_free(&wb);
        return;
    }
    packet *p = &f->p[(f->head + f->len++) % WIRE_FIFO_MAX];
    p->hdr = wb.data;
    p->hlen = wb.len;
    p->nframes = m->nframes;
    for (int i = 0; i < m->nframes; i++) {
        p->flen[i] = m->frames[i].len;
        p->frame[i] = malloc(p->flen[i] + 1);
        memcpy(p->frame[i], m->frames[i].t.data, p->flen[i]);
    }
}

/* Pop the message at position i of the queue (0: its head) and decode it
 * into m (frames valid until packet_free). */
static inline int pop_at(fifo *f, int at, nl_wire_msg *m, packet *out)
{
    if (!f->len)
        return 0;
    *out = f->p[(f->head + at) % WIRE_FIFO_MAX];
    for (int k = at; k > 0; k--) /* the ones before it move up */
        f->p[(f->head + k) % WIRE_FIFO_MAX] = f->p[(f->head + k - 1) % WIRE_FIFO_MAX];
    f->head = (f->head + 1) % WIRE_FIFO_MAX;
    f->len--;
    nl_wire_part parts[NL_WIRE_MAX_FRAMES + 1] = {{out->hdr, out->hlen}};
    for (int i = 0; i < out->nframes; i++)
        parts[i + 1] = (nl_wire_part){out->frame[i], out->flen[i]};
    nl_error err;
    CHECK_OK(nl_wire_decode(m, parts, 1 + out->nframes, NULL, &err), &err);
    return 1;
}

static inline int pop(fifo *f, nl_wire_msg *m, packet *out)
{
    return pop_at(f, 0, m, out);
}

static inline void packet_free(packet *p)
{
    free(p->hdr);
    for (int i = 0; i < p->nframes; i++)
        free(p->frame[i]);
}

/* Drop every message the queue holds. */
static inline void fifo_clear(fifo *f)
{
    packet p;
    while (f->len) {
        p = f->p[f->head];
        f->head = (f->head + 1) % WIRE_FIFO_MAX;
        f->len--;
        packet_free(&p);
    }
}

#endif
