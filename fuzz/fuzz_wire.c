/* Fuzz target for the wire decoder (net/wire.c).
 *
 * Input layout (the seed corpus is written by `test_wire --write-corpus`):
 *   byte 0        bits 0-4: frame count (capped at NL_WIRE_MAX_FRAMES + 2);
 *                 bits 5-7: limits profile (0 = defaults, else tight)
 *   u32 LE + n    the header
 *   u32 LE + n    each frame (lengths are clamped to what is left)
 * Each part is copied into its own heap block of exactly its size, so any
 * read past a part's end is caught by ASan.
 *
 * Property: whatever decodes re-encodes, and that encoding decodes again
 * and re-encodes to the same bytes. A JOB_SUBMIT's params go through
 * every use of the job schemas (net/genparams.h, net/trainparams.h): a
 * training request or stage job they accept, written back by the schema,
 * is accepted again. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "net/genparams.h"
#include "net/trainparams.h"
#include "net/wire.h"

/* The job schemas over a JOB_SUBMIT's params. */
static void schemas(const nl_msg_job_submit *j)
{
    nl_genparams g;
    nl_trainparams t, u;
    nl_wire_param w[NL_TRAINPARAMS_MAX_KEYS];
    nl_error err;
    for (int use = NL_GENPARAMS_REQUEST; use <= NL_GENPARAMS_SESSION; use++)
        nl_genparams_parse(&g, j->params, j->nparams, (nl_genparams_use)use, &err);
    for (int use = NL_TRAINPARAMS_TRAIN; use <= NL_TRAINPARAMS_STAGE_FT; use++) {
        if (nl_trainparams_parse(&t, j->params, j->nparams, (nl_trainparams_use)use, &err) != NL_OK)
            continue;
        const uint32_t n = nl_trainparams_wire(&t, (nl_trainparams_use)use, w);
        if (nl_trainparams_parse(&u, w, n, (nl_trainparams_use)use, &err) != NL_OK)
            abort();
    }
}

static size_t take_u32(const uint8_t **p, size_t *left)
{
    if (*left < 4) {
        *left = 0;
        return 0;
    }
    size_t v =
        (size_t)(*p)[0] | (size_t)(*p)[1] << 8 | (size_t)(*p)[2] << 16 | (size_t)(*p)[3] << 24;
    *p += 4;
    *left -= 4;
    return v < *left ? v : *left;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static nl_wire_msg m, m2;
    static nl_wire_wbuf w1, w2;
    nl_wire_part parts[NL_WIRE_MAX_FRAMES + 3];
    void *bufs[NL_WIRE_MAX_FRAMES + 3];
    nl_error err;
    if (size < 1)
        return 0;
    int nf = data[0] & 0x1f;
    if (nf > NL_WIRE_MAX_FRAMES + 2)
        nf = NL_WIRE_MAX_FRAMES + 2;
    nl_wire_limits lim = nl_wire_limits_default();
    if (data[0] >> 5) {
        lim.max_header = 512;
        lim.max_depth = 3 + (data[0] >> 7);
        lim.max_str = 64;
        lim.max_array = 16;
        lim.max_frames = 2;
        lim.max_dims = 4;
        lim.max_frame_bytes = 4096;
    }
    const uint8_t *p = data + 1;
    size_t left = size - 1;
    int n = 0;
    for (; n < 1 + nf; n++) {
        size_t len = take_u32(&p, &left);
        bufs[n] = malloc(len ? len : 1);
        if (!bufs[n])
            break;
        memcpy(bufs[n], p, len);
        parts[n] = (nl_wire_part){bufs[n], len};
        p += len;
        left -= len;
    }
    uint32_t v, t;
    nl_wire_peek(parts[0].data, parts[0].len, &v, &t);
    if (n == 1 + nf && nl_wire_decode(&m, parts, n, &lim, &err) == NL_OK) {
        /* re-encoding may grow a header (float32 becomes float64): relax
         * only the header size for the round trip */
        nl_wire_limits rl = lim;
        rl.max_header = 2 * lim.max_header;
        if (nl_wire_encode(&m, &w1, &rl, &err) != NL_OK)
            abort();
        nl_wire_part p2[NL_WIRE_MAX_FRAMES + 1];
        p2[0] = (nl_wire_part){w1.data, w1.len};
        for (int i = 0; i < m.nframes; i++)
            p2[i + 1] = (nl_wire_part){m.frames[i].t.data, m.frames[i].len};
        if (nl_wire_decode(&m2, p2, 1 + m.nframes, &rl, &err) != NL_OK)
            abort();
        if (nl_wire_encode(&m2, &w2, &rl, &err) != NL_OK || w2.len != w1.len ||
            memcmp(w1.data, w2.data, w1.len) != 0)
            abort();
        if (m.type == NL_MSG_JOB_SUBMIT)
            schemas(&m.u.job_submit);
    }
    for (int i = 0; i < n; i++)
        free(bufs[i]);
    return 0;
}
