/* The replicas' all-reduce as a state machine over REDUCE messages: see
 * allreduce.h for the ring, the order of the sums and the checks. */
#include "net/allreduce.h"

#include <stdlib.h>
#include <string.h>

/* What a chunk has seen this step. */
enum { HAVE_SUM = 1, FINAL = 2 };

struct nl_allreduce {
    uint64_t job;
    uint32_t what;
    int r, R;
    size_t n, chunk;
    uint32_t chunks;
    uint64_t step;   /* the step staged or reduced (0: none yet) */
    bool begun;      /* buf is this replica's final sum of `step` */
    bool failed;     /* an error: everything is refused until a reset */
    float *buf;      /* borrowed from begin */
    float *in;       /* [n]: the SUM chunks received (staged before begin) */
    uint8_t *st;     /* [chunks] */
    uint32_t staged; /* SUM chunks received of `step` */
    uint32_t left;   /* chunks not yet final (begun) */
    nl_wire_msg tx;
};

nl_status nl_allreduce_new(nl_allreduce **out, uint64_t job, uint32_t what, int replica,
                           int replicas, size_t n, size_t chunk, nl_error *err)
{
    *out = NULL;
    if (replicas < 2 || replicas > NL_REDUCE_MAX_REPLICAS || replica < 0 || replica >= replicas)
        return nl_error_set(err, NL_ERR_INVALID, "all-reduce: replica %d of %d (2 to %d replicas)",
                            replica, replicas, NL_REDUCE_MAX_REPLICAS);
    if (!chunk)
        chunk = NL_ALLREDUCE_CHUNK;
    if (n < 1 || (n + chunk - 1) / chunk > UINT32_MAX)
        return nl_error_set(err, NL_ERR_INVALID, "all-reduce: %zu elements in chunks of %zu", n,
                            chunk);
    nl_allreduce *a = calloc(1, sizeof *a);
    if (!a)
        return nl_error_set(err, NL_ERR_NOMEM, "all-reduce: out of memory");
    *a = (nl_allreduce){.job = job,
                        .what = what,
                        .r = replica,
                        .R = replicas,
                        .n = n,
                        .chunk = chunk,
                        .chunks = (uint32_t)((n + chunk - 1) / chunk)};
    nl_wire_msg_init(&a->tx);
    a->in = malloc(n * sizeof *a->in);
    a->st = calloc(a->chunks, 1);
    if (!a->in || !a->st) {
        nl_allreduce_destroy(&a);
        return nl_error_set(err, NL_ERR_NOMEM, "all-reduce: out of memory for %zu elements", n);
    }
    *out = a;
    return NL_OK;
}

void nl_allreduce_destroy(nl_allreduce **pa)
{
    if (!pa || !*pa)
        return;
    nl_allreduce *a = *pa;
    nl_wire_msg_free(&a->tx);
    free(a->in);
    free(a->st);
    free(a);
    *pa = NULL;
}

void nl_allreduce_reset(nl_allreduce *a)
{
    memset(a->st, 0, a->chunks);
    a->step = 0;
    a->begun = a->failed = false;
    a->buf = NULL;
    a->staged = a->left = 0;
}

bool nl_allreduce_done(const nl_allreduce *a, uint64_t step)
{
    return a->begun && a->step == step && a->left == 0;
}

/* Elements of chunk c. */
static size_t chunk_len(const nl_allreduce *a, uint32_t c)
{
    const size_t off = (size_t)c * a->chunk;
    return a->n - off < a->chunk ? a->n - off : a->chunk;
}

/* Send chunk c of buf onward as `phase`. */
static nl_status send_chunk(nl_allreduce *a, uint32_t c, uint32_t phase, nl_allreduce_send_fn send,
                            void *ctx, nl_error *err)
{
    const size_t off = (size_t)c * a->chunk;
    const int64_t shape[1] = {(int64_t)chunk_len(a, c)};
    nl_wire_msg_reset(&a->tx, NL_MSG_REDUCE);
    a->tx.u.reduce = (nl_msg_reduce){a->job, a->step,   a->what,       phase, (uint32_t)a->r,
                                     c,      a->chunks, (uint64_t)off, 0};
    nl_wire_frame_set(&a->tx.frames[0], a->buf + off, NL_DTYPE_F32, shape, 1);
    a->tx.nframes = 1;
    nl_status st = send(ctx, &a->tx, err);
    return st == NL_OK ? st
                       : nl_error_prefix(err, "all-reduce of job %llu step %llu: replica %d to %d",
                                         (unsigned long long)a->job, (unsigned long long)a->step,
                                         a->r, (a->r + 1) % a->R);
}

/* A chunk is final here; the last replica's result goes round. */
static nl_status chunk_final(nl_allreduce *a, uint32_t c, nl_allreduce_send_fn send, void *ctx,
                             nl_error *err)
{
    a->st[c] |= FINAL;
    a->left--;
    /* the result travels R-1 -> 0 -> ... -> R-2 */
    if (a->r == a->R - 1 || a->r + 1 < a->R - 1)
        return send_chunk(a, c, NL_REDUCE_RESULT, send, ctx, err);
    return NL_OK;
}

/* The staged partial sum of chunk c meets this replica's own: in the
 * order (g0 + ... + g_{r-1}) + g_r, then on to the next replica. */
static nl_status add_chunk(nl_allreduce *a, uint32_t c, nl_allreduce_send_fn send, void *ctx,
                           nl_error *err)
{
    const size_t off = (size_t)c * a->chunk, len = chunk_len(a, c);
    float *x = a->buf + off;
    const float *p = a->in + off;
    for (size_t i = 0; i < len; i++)
        x[i] = p[i] + x[i];
    if (a->r == a->R - 1)
        return chunk_final(a, c, send, ctx, err);
    return send_chunk(a, c, NL_REDUCE_SUM, send, ctx, err);
}

nl_status nl_allreduce_begin(nl_allreduce *a, uint64_t step, float *buf, nl_allreduce_send_fn send,
                             void *ctx, bool *done, nl_error *err)
{
    *done = false;
    if (a->failed)
        return nl_error_set(err, NL_ERR_STATE, "all-reduce of job %llu: an earlier error",
                            (unsigned long long)a->job);
    if (a->begun && a->left > 0)
        return nl_error_set(
            err, NL_ERR_STATE, "all-reduce of job %llu: step %llu begins while step %llu reduces",
            (unsigned long long)a->job, (unsigned long long)step, (unsigned long long)a->step);
    if (a->begun) { /* the last step's reduce is done and nothing of this one came */
        memset(a->st, 0, a->chunks);
        a->staged = 0;
    }
    if (a->staged > 0 && a->step != step) {
        a->failed = true;
        return nl_error_set(err, NL_ERR_PROTO,
                            "all-reduce of job %llu: chunks of step %llu came, this replica "
                            "reduces step %llu",
                            (unsigned long long)a->job, (unsigned long long)a->step,
                            (unsigned long long)step);
    }
    if (a->staged == 0)
        memset(a->st, 0, a->chunks);
    a->step = step;
    a->buf = buf;
    a->begun = true;
    a->left = a->chunks;
    nl_status st = NL_OK;
    for (uint32_t c = 0; c < a->chunks && st == NL_OK; c++)
        if (a->r == 0)
            st = send_chunk(a, c, NL_REDUCE_SUM, send, ctx, err);
        else if (a->st[c] & HAVE_SUM)
            st = add_chunk(a, c, send, ctx, err);
    if (st != NL_OK)
        a->failed = true;
    *done = st == NL_OK && a->left == 0;
    return st;
}

/* The header of m against this reducer; a message of a new step after a
 * finished reduce starts that step's staging. */
static nl_status check_msg(nl_allreduce *a, const nl_msg_reduce *h, size_t len, nl_error *err)
{
    const int prev = (a->r + a->R - 1) % a->R;
    if (h->job_id != a->job || h->what != a->what)
        return nl_error_set(
            err, NL_ERR_PROTO, "REDUCE of job %llu (kind %u) to a reducer of job %llu (kind %u)",
            (unsigned long long)h->job_id, h->what, (unsigned long long)a->job, a->what);
    if (h->sender != (uint32_t)prev)
        return nl_error_set(err, NL_ERR_PROTO,
                            "REDUCE from replica %u: replica %d takes them from %d only", h->sender,
                            a->r, prev);
    const bool can = h->phase == NL_REDUCE_SUM ? a->r >= 1 : a->r <= a->R - 2;
    if (!can)
        return nl_error_set(err, NL_ERR_PROTO, "REDUCE phase %u: replica %d of %d never takes it",
                            h->phase, a->r, a->R);
    if (h->chunks != a->chunks || h->chunk >= a->chunks ||
        h->offset != (uint64_t)h->chunk * a->chunk || len != chunk_len(a, h->chunk))
        return nl_error_set(err, NL_ERR_SHAPE,
                            "REDUCE chunk %u of %u at %llu with %zu elements: this replica "
                            "reduces %zu elements in %u chunks of %zu",
                            h->chunk, h->chunks, (unsigned long long)h->offset, len, a->n,
                            a->chunks, a->chunk);
    if (h->step != a->step) {
        const bool idle = a->begun ? a->left == 0 : a->staged == 0;
        if (!idle)
            return nl_error_set(err, NL_ERR_PROTO,
                                "REDUCE of step %llu while this replica reduces step %llu",
                                (unsigned long long)h->step, (unsigned long long)a->step);
        memset(a->st, 0, a->chunks);
        a->step = h->step;
        a->begun = false;
        a->buf = NULL;
        a->staged = a->left = 0;
    }
    if (h->phase == NL_REDUCE_RESULT && !a->begun)
        return nl_error_set(err, NL_ERR_PROTO,
                            "REDUCE result of chunk %u before this replica's sum went out",
                            h->chunk);
    const uint8_t seen = h->phase == NL_REDUCE_SUM ? HAVE_SUM : FINAL;
    if (a->st[h->chunk] & seen)
        return nl_error_set(err, NL_ERR_PROTO, "REDUCE phase %u of chunk %u came twice", h->phase,
                            h->chunk);
    return NL_OK;
}

nl_status nl_allreduce_input(nl_allreduce *a, const nl_wire_msg *m, nl_allreduce_send_fn send,
                             void *ctx, bool *done, nl_error *err)
{
    *done = false;
    if (a->failed)
        return nl_error_set(err, NL_ERR_STATE, "all-reduce of job %llu: an earlier error",
                            (unsigned long long)a->job);
    if (m->type != NL_MSG_REDUCE || m->nframes != 1 || m->frames[0].t.dtype != NL_DTYPE_F32)
        return nl_error_set(err, NL_ERR_PROTO, "all-reduce: not a REDUCE with one F32 frame");
    const nl_msg_reduce *h = &m->u.reduce;
    const nl_tensor *t = &m->frames[0].t;
    const size_t len = t->ndim == 1 && t->shape[0] > 0 ? (size_t)t->shape[0] : 0;
    nl_status st = check_msg(a, h, len, err);
    if (st != NL_OK) {
        a->failed = true;
        return st;
    }
    const size_t off = (size_t)h->offset;
    if (h->phase == NL_REDUCE_SUM) {
        memcpy(a->in + off, t->data, len * sizeof(float)); /* the frame may be unaligned */
        a->st[h->chunk] |= HAVE_SUM;
        a->staged++;
        if (a->begun)
            st = add_chunk(a, h->chunk, send, ctx, err);
    } else {
        memcpy(a->buf + off, t->data, len * sizeof(float));
        st = chunk_final(a, h->chunk, send, ctx, err);
    }
    if (st != NL_OK)
        a->failed = true;
    *done = st == NL_OK && a->begun && a->left == 0;
    return st;
}
