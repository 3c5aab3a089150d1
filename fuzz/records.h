/* The records of the fuzz targets that feed wire messages (fuzz_coord.c,
 * fuzz_stage.c): each record is a flags byte (the target's), the number
 * of parts after the header, then the header and each frame as u16 LE
 * length + bytes. The reader copies each part into a heap block of
 * exactly its size (ASan sees reads past its end); the writer, in the
 * targets' seed corpus writers, encodes a message into such a record.
 * Header-only. */
#ifndef NL_FUZZ_RECORDS_H
#define NL_FUZZ_RECORDS_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/wire.h"

/* ---- reading ---- */

/* A u16 LE length, clamped to what is left after it. */
static inline size_t fuzz_take_u16(const uint8_t **p, size_t *left)
{
    if (*left < 2) {
        *left = 0;
        return 0;
    }
    size_t v = (size_t)(*p)[0] | (size_t)(*p)[1] << 8;
    *p += 2;
    *left -= 2;
    return v < *left ? v : *left;
}

/* n parts (the header and n - 1 frames), each in a block of its own:
 * parts[i] points into bufs[i], freed with fuzz_parts_free. */
static inline void fuzz_parts_read(const uint8_t **p, size_t *left, int n, nl_wire_part *parts,
                                   void **bufs)
{
    for (int i = 0; i < n; i++) {
        size_t len = fuzz_take_u16(p, left);
        bufs[i] = malloc(len ? len : 1);
        if (!bufs[i])
            abort();
        memcpy(bufs[i], *p, len);
        parts[i] = (nl_wire_part){bufs[i], len};
        *p += len;
        *left -= len;
    }
}

static inline void fuzz_parts_free(void **bufs, int n)
{
    for (int i = 0; i < n; i++)
        free(bufs[i]);
}

/* ---- writing (the seed corpus writers) ---- */

/* An input being written. */
typedef struct fuzz_out {
    uint8_t buf[1 << 18];
    size_t len;
} fuzz_out;

static inline void fuzz_put(fuzz_out *o, const void *p, size_t n)
{
    if (o->len + n > sizeof o->buf) {
        fprintf(stderr, "corpus: an input over %zu bytes\n", sizeof o->buf);
        exit(1);
    }
    memcpy(o->buf + o->len, p, n);
    o->len += n;
}

static inline void fuzz_put_u16(fuzz_out *o, size_t n)
{
    if (n > 0xffff) {
        fprintf(stderr, "corpus: a part of %zu bytes\n", n);
        exit(1);
    }
    const uint8_t b[2] = {(uint8_t)(n & 0xff), (uint8_t)(n >> 8)};
    fuzz_put(o, b, 2);
}

/* Append m as a record with this flags byte. */
static inline void fuzz_rec(fuzz_out *o, uint8_t flags, nl_wire_msg *m)
{
    nl_wire_wbuf w = {0};
    nl_error err;
    const nl_wire_limits lim = nl_wire_limits_default();
    if (nl_wire_encode(m, &w, &lim, &err) != NL_OK) {
        fprintf(stderr, "corpus: encode %s: %s\n", nl_wire_type_name(m->type), err.msg);
        exit(1);
    }
    const uint8_t head[2] = {flags, (uint8_t)m->nframes};
    fuzz_put(o, head, 2);
    fuzz_put_u16(o, w.len);
    fuzz_put(o, w.data, w.len);
    for (int i = 0; i < m->nframes; i++) {
        fuzz_put_u16(o, m->frames[i].len);
        fuzz_put(o, m->frames[i].t.data, m->frames[i].len);
    }
    nl_wire_wbuf_free(&w);
}

/* Write the input to dir/name. */
static inline void fuzz_save(const char *dir, const char *name, const fuzz_out *o)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(o->buf, 1, o->len, f) != o->len) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        exit(1);
    }
    fclose(f);
}

#endif
