/* A stage's batched session hops (see stage.h): the queue of hops that
 * arrived, and the batch that runs the decode steps of many sessions and
 * one chunk of prompts together through core/model/batch.c. Its own file
 * because stage.c holds loading and the single forward; this is the
 * scheduling that serves many generations at once. A session with an
 * adapter (params.adapter) is not batched: core/model/batch.c's padded GEMMs
 * apply no adapters, so each of its hops runs alone after the batch,
 * through the ordinary forward with the adapter attached for that call. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "node/stage.h"
#include "node/stage_impl.h"

#define DEFAULT_DECODE 32
#define DEFAULT_CHUNK 64
#define DEFAULT_WAIT_MS 20
#define ACTIVE_S 2.0 /* a session with a hop here this recently is coming back */

/* ===================== the engine ===================== */

/* The batch and the tables of its segments (ensure_engine's). */
static void free_engine(nl_stage *s)
{
    nl_batch_destroy(&s->batch);
    free(s->segs);
    free(s->seg_q);
    free(s->seg_x);
    free(s->seg_smp);
    free(s->seg_logits);
    free(s->seg_rows);
    free(s->seg_tok);
    s->segs = NULL;
    s->seg_q = NULL;
    s->seg_x = NULL;
    s->seg_smp = NULL;
    s->seg_logits = NULL;
    s->seg_rows = NULL;
    s->seg_tok = NULL;
}

void stage_batch_free(nl_stage *s)
{
    free_engine(s);
    for (int i = 0; i < s->cap_q; i++) {
        free(s->q[i].in);
        free(s->q[i].acc);
    }
    free(s->q);
    free(s->res);
    free(s->obuf);
    s->q = NULL;
    s->res = NULL;
    s->obuf = NULL;
    s->n_q = s->cap_q = s->cap_res = 0;
    s->obuf_cap = 0;
}

/* The batch and its tables, on the first hop after a model is loaded:
 * decode rows plus one prefill chunk, within the stage's row limit. */
static nl_status ensure_engine(nl_stage *s, nl_error *err)
{
    if (s->batch)
        return NL_OK;
    int dec = s->o.batch_decode > 0 ? s->o.batch_decode : DEFAULT_DECODE;
    int chunk = s->o.prefill_chunk > 0 ? s->o.prefill_chunk : DEFAULT_CHUNK;
    if (dec + chunk > s->max_rows) { /* a small --memory: keep both, smaller */
        dec = s->max_rows / 2 > 0 ? s->max_rows / 2 : 1;
        chunk = s->max_rows - dec > 0 ? s->max_rows - dec : 1;
    }
    s->batch_decode = dec;
    s->prefill_chunk = chunk;
    s->batch_rows = dec + chunk;
    nl_status st = nl_batch_new(&s->batch, s->model, s->batch_rows, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "stage: a batch of %d rows", s->batch_rows);
    s->segs = calloc((size_t)s->batch_rows, sizeof *s->segs);
    s->seg_q = calloc((size_t)s->batch_rows, sizeof *s->seg_q);
    s->seg_x = calloc((size_t)s->batch_rows, sizeof *s->seg_x);
    s->seg_smp = calloc((size_t)s->batch_rows, sizeof *s->seg_smp);
    s->seg_logits = calloc((size_t)s->batch_rows, sizeof *s->seg_logits);
    s->seg_rows = calloc((size_t)s->batch_rows, sizeof *s->seg_rows);
    s->seg_tok = calloc((size_t)s->batch_rows, sizeof *s->seg_tok);
    if (!s->segs || !s->seg_q || !s->seg_x || !s->seg_smp || !s->seg_logits || !s->seg_rows ||
        !s->seg_tok) {
        free_engine(s); /* none half made: the next hop tries again */
        return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory for the batch");
    }
    return NL_OK;
}

static nl_status grow_queue(nl_stage *s, nl_error *err)
{
    if (s->n_q < s->cap_q)
        return NL_OK;
    const int cap = s->cap_q ? 2 * s->cap_q : 16;
    queued_hop *q = realloc(s->q, (size_t)cap * sizeof *q);
    if (!q)
        return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory for queued hops");
    memset(q + s->cap_q, 0, (size_t)(cap - s->cap_q) * sizeof *q);
    s->q = q;
    s->cap_q = cap;
    return NL_OK;
}

/* Grow a buffer to at least n bytes (kept between uses). */
static int reserve(void **p, size_t *cap, size_t n)
{
    if (n <= *cap)
        return 1;
    void *q = realloc(*p, n);
    if (!q)
        return 0;
    *p = q;
    *cap = n;
    return 1;
}

/* ===================== the queue ===================== */

int nl_stage_queued(const nl_stage *s)
{
    return s->n_q;
}

/* Positions of a session's hops waiting in the queue. */
static int queued_rows(const nl_stage *s, uint64_t id)
{
    int n = 0;
    for (int i = 0; i < s->n_q; i++)
        if (s->q[i].session_id == id)
            n += s->q[i].T - s->q[i].done;
    return n;
}

/* Remove the slots marked gone, keeping the order of the others; the
 * removed slots keep their buffers for later hops. */
static void compact(nl_stage *s)
{
    int w = 0;
    for (int i = 0; i < s->n_q; i++) {
        if (s->q[i].gone)
            continue;
        if (w != i) {
            queued_hop t = s->q[w];
            s->q[w] = s->q[i];
            s->q[i] = t;
        }
        w++;
    }
    s->n_q = w;
}

void stage_batch_drop_session(nl_stage *s, uint64_t id)
{
    for (int i = 0; i < s->n_q; i++)
        if (s->q[i].session_id == id)
            s->q[i].gone = true;
    compact(s);
}

nl_status nl_stage_enqueue(nl_stage *s, const nl_msg_tensor_hop *hop, const nl_wire_frame *in,
                           nl_error *err)
{
    char who[80];
    int B = 0, T = 0;
    session *se = NULL;
    snprintf(who, sizeof who, "job %llu session %llu", (unsigned long long)hop->job_id,
             (unsigned long long)hop->session_id);
    nl_status st = nl_stage_device_status(s, err);
    if (st != NL_OK)
        return st;
    if (!s->ready)
        return nl_error_set(err, NL_ERR_STATE, "%s: this stage has no model loaded", who);
    if (!hop->session_id)
        return nl_error_set(err, NL_ERR_INVALID, "%s: only a session's hops are batched", who);
    st = stage_check_hop(s, hop, in, who, queued_rows(s, hop->session_id), &B, &T, &se, err);
    if (st == NL_OK)
        st = ensure_engine(s, err);
    if (st == NL_OK)
        st = grow_queue(s, err);
    if (st != NL_OK)
        return st;
    const nl_model *m = s->model;
    queued_hop *q = &s->q[s->n_q];
    const size_t bytes = m->has_embed ? (size_t)T * sizeof(int32_t)
                                      : (size_t)T * (size_t)m->cfg.hidden_dim * sizeof(float);
    if (!reserve(&q->in, &q->in_cap, bytes))
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory for %d queued positions", who, T);
    if (m->has_embed)
        memcpy(q->in, in->t.data, bytes); /* frames need not be aligned */
    else                                  /* F32, or bf16 widened */
        nl_wire_frame_widen(in, q->in, (size_t)T * (size_t)m->cfg.hidden_dim);
    q->job_id = hop->job_id;
    q->session_id = hop->session_id;
    q->pos = hop->pos_offset;
    q->T = T;
    q->done = 0;
    q->aux = hop->aux;
    q->t_in = nl_mono_s();
    q->gone = false;
    if (se->last_in > 0.0 && q->T == 1) { /* decode steps: the ring's period for this session */
        const double gap = q->t_in - se->last_in;
        se->period = se->period > 0.0 ? 0.75 * se->period + 0.25 * gap : gap;
    }
    se->last_in = q->t_in;
    s->n_q++;
    return NL_OK;
}

double nl_stage_batch_due(const nl_stage *s)
{
    if (!s->n_q)
        return -1.0;
    const double now = nl_mono_s();
    const int wait_ms = s->o.batch_wait_ms ? s->o.batch_wait_ms : DEFAULT_WAIT_MS;
    if (wait_ms < 0)
        return 0.0;
    /* wait for an active session without a hop here only when its next
     * hop is expected before the wait runs out (its last arrival plus its
     * period on the ring): sessions spread over the ring in groups never
     * meet by waiting, and each wait would cost every hop of theirs the
     * whole batch_wait_ms (a 16-client ring of 3 stages fell into 75 ms
     * a token) */
    const double limit = s->q[0].t_in + wait_ms * 1e-3; /* q[0] is the oldest */
    double until = 0.0;
    int queued = 0, awaited = 0;
    for (int i = 0; i < s->n_sess; i++) {
        const session *se = &s->sess[i];
        if (se->last_in <= 0.0 || now - se->last_in > ACTIVE_S)
            continue;
        int here = 0;
        for (int k = 0; k < s->n_q && !here; k++)
            here = s->q[k].session_id == se->id;
        queued += here;
        double next = se->period > 0.0 ? se->last_in + se->period : limit;
        if (next < now) /* late: it may come any moment, as far as the wait allows */
            next = limit;
        if (!here && next <= limit) {
            awaited++;
            until = next > until ? next : until;
        }
    }
    if (!awaited || queued >= NL_BATCH_MIN_ROWS)
        return 0.0;
    const double due = (until < limit ? until : limit) - now;
    return due > 0.0 ? due : 0.0;
}

/* ===================== the batch ===================== */

/* Pick the batch: the oldest hop of each session, decode steps up to
 * batch_decode, prompt positions up to prefill_chunk. Hops whose session
 * is gone are answered (evicted) or dropped (closed). Returns the
 * segments; *nres counts the results written. */
static int pick(nl_stage *s, int *nres)
{
    const nl_model *m = s->model;
    const size_t d = (size_t)m->cfg.hidden_dim;
    int n = 0, decode = 0, budget = s->prefill_chunk;
    s->batch_seq++;
    for (int i = 0; i < s->n_q; i++) {
        queued_hop *q = &s->q[i];
        session *se = stage_find_session(s, q->session_id);
        if (!se) {
            q->gone = true;
            if (nl_stage_session_closed(s, q->session_id))
                continue; /* its job ended: nothing to say */
            nl_stage_result *r = &s->res[(*nres)++];
            *r = (nl_stage_result){q->job_id, q->session_id, q->pos, NL_ERR_NOTFOUND, "", {0}};
            snprintf(r->msg, sizeof r->msg, "job %llu session %llu: %s",
                     (unsigned long long)q->job_id, (unsigned long long)q->session_id,
                     nl_stage_session_evicted(s, q->session_id)
                         ? "the session was evicted (KV budget full)"
                         : "the session is no longer open on this stage");
            continue;
        }
        if (se->picked == s->batch_seq || se->lo)
            continue; /* its earlier hop runs first; an adapter's runs alone */
        /* the session's oldest hop: whether it runs now or waits for room,
         * none of its later ones runs in this batch */
        se->picked = s->batch_seq;
        int take = q->T - q->done;
        if (q->T == 1) {
            if (decode == s->batch_decode)
                continue;
            decode++;
        } else {
            if (budget == 0)
                continue;
            take = take < budget ? take : budget;
            budget -= take;
        }
        nl_batch_seg *g = &s->segs[n];
        *g = (nl_batch_seg){.kv = se->kv, .T = take};
        if (m->has_embed)
            g->tokens = (const int32_t *)q->in + q->done;
        else
            s->seg_x[n] = (const float *)q->in + (size_t)q->done * d;
        g->want_logits = m->has_head && q->done + take == q->T;
        s->seg_q[n++] = i;
    }
    return n;
}

/* The last stage's tokens of a finished batch that sample on the device
 * (no log-probabilities asked for): every such hop's session in one call
 * of the backend's sample_rows (core/model/sampler.h's
 * nl_sampler_next_batch), so the step waits once for all their ids, not
 * once a session. seg_tok[k]: segment k's token, or -1 where it samples
 * on the host (or finishes no hop). Each session draws from its own
 * stream, so its ids are those it gets alone. */
static nl_status sample_on_device(nl_stage *s, int n, nl_error *err)
{
    for (int k = 0; k < n; k++) {
        const queued_hop *q = &s->q[s->seg_q[k]];
        session *se = stage_find_session(s, q->session_id);
        const bool last = q->done + s->segs[k].T == q->T;
        s->seg_smp[k] = s->model->has_head && last && se && se->logprobs == 0 ? &se->smp : NULL;
        s->seg_logits[k] = s->seg_smp[k] ? nl_batch_logits_device(s->batch, k) : NULL;
    }
    return nl_sampler_next_batch(s->seg_smp, s->seg_logits, n, s->be, s->seg_rows, s->seg_tok, err);
}

/* The last stage's answer to a finished hop: its session's token sampled
 * on the device (sample_on_device), else from the batch's logits on the
 * host. */
static nl_status sample_token(nl_stage *s, session *se, int seg, nl_stage_out *o, nl_error *err)
{
    if (s->seg_tok[seg] >= 0) {
        o->lp_n = 0;
        stage_sampled(se, s->seg_tok[seg], o);
        return NL_OK;
    }
    const float *logits = nl_batch_logits(s->batch, seg, err);
    if (!logits)
        return err->status;
    stage_sample(se, logits, o);
    return NL_OK;
}

/* After the batch: hidden states into acc (a prompt's chunks) or obuf,
 * tokens sampled, results written for the hops that finished. */
static nl_status finish(nl_stage *s, int n, double t0, double t1, int *nres, nl_error *err)
{
    const nl_model *m = s->model;
    const size_t d = (size_t)m->cfg.hidden_dim;
    size_t need = 0, at = 0;
    for (int k = 0; k < n; k++) {
        const queued_hop *q = &s->q[s->seg_q[k]];
        if (!m->has_head && q->done + s->segs[k].T == q->T)
            need += (size_t)q->T * d;
    }
    if (!reserve((void **)&s->obuf, &s->obuf_cap, (need ? need : 1) * sizeof(float)))
        return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory for a batch's output");
    const nl_status sst = sample_on_device(s, n, err);
    if (sst != NL_OK) /* the caller fails every hop of the batch */
        return sst;
    for (int k = 0; k < n; k++) {
        queued_hop *q = &s->q[s->seg_q[k]];
        session *se = stage_find_session(s, q->session_id);
        const int take = s->segs[k].T;
        const bool last = q->done + take == q->T;
        se->used = ++s->tick;
        if (q->T == 1) { /* the batch's time, shared by its segments */
            se->steps++;
            se->step_s += (t1 - t0) / n;
        } else {
            se->prefill_s += (t1 - t0) / n;
        }
        if (!m->has_head) {
            const float *h = nl_batch_hidden(s->batch, k);
            if (!last || q->done > 0) { /* a prompt over several batches */
                if (!reserve((void **)&q->acc, &q->acc_cap, (size_t)q->T * d * sizeof(float)))
                    return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory for a prompt");
                memcpy(q->acc + (size_t)q->done * d, h, (size_t)take * d * sizeof(float));
                h = q->acc;
            }
            if (last)
                memcpy(s->obuf + at, h, (size_t)q->T * d * sizeof(float));
        }
        q->done += take;
        if (!last)
            continue;
        nl_stage_result *r = &s->res[(*nres)++];
        *r = (nl_stage_result){q->job_id, q->session_id, q->pos, NL_OK, "", {0}};
        r->out.B = 1;
        r->out.T = q->T;
        r->out.aux = q->aux; /* a decode hop adds no aux loss (as nl_stage_forward) */
        if (m->has_head) {
            const nl_status st = sample_token(s, se, k, &r->out, err);
            if (st != NL_OK) { /* the caller fails this hop and the rest */
                (*nres)--;
                return st;
            }
        } else {
            r->out.kind = NL_STAGE_OUT_HIDDEN;
            r->out.data = s->obuf + at;
            r->out.ndim = 3;
            r->out.shape[0] = 1, r->out.shape[1] = q->T, r->out.shape[2] = (int64_t)d;
            at += (size_t)q->T * d;
        }
        nl_stage_gen_lie(s, &r->out, (size_t)q->T * d); /* a test hook */
        q->gone = true;
        s->fig.hops++;
        s->fig.hop_s += t1 - q->t_in;
    }
    return NL_OK;
}

/* The oldest hop of each session with an adapter, each alone (after the
 * batch; stage.c's stage_forward_adapted): its hidden states in the
 * slot's acc (which, like obuf, stays until the next batch). */
static void run_adapted(nl_stage *s, int *nres)
{
    const nl_model *m = s->model;
    const size_t d = (size_t)m->cfg.hidden_dim;
    for (int i = 0; i < s->n_q; i++) {
        queued_hop *q = &s->q[i];
        session *se = q->gone ? NULL : stage_find_session(s, q->session_id);
        if (!se || !se->lo || se->picked == s->batch_seq)
            continue;
        se->picked = s->batch_seq;
        nl_error e = {0};
        nl_stage_result *r = &s->res[(*nres)++];
        *r = (nl_stage_result){q->job_id, q->session_id, q->pos, NL_OK, "", {0}};
        r->out.B = 1;
        r->out.T = q->T;
        r->out.aux = q->aux;
        const double t0 = nl_mono_s();
        nl_status st = NL_OK;
        if (!m->has_head &&
            !reserve((void **)&q->acc, &q->acc_cap, (size_t)q->T * d * sizeof(float)))
            st = nl_error_set(&e, NL_ERR_NOMEM, "out of memory for %d positions", q->T);
        if (st == NL_OK)
            st = stage_forward_adapted(s, se, q->in, q->T, q->acc, &r->out, &e);
        const double t1 = nl_mono_s();
        if (st != NL_OK) {
            r->st = st;
            snprintf(r->msg, sizeof r->msg, "job %llu session %llu: %.400s",
                     (unsigned long long)q->job_id, (unsigned long long)q->session_id, e.msg);
        } else if (!m->has_head) {
            r->out.kind = NL_STAGE_OUT_HIDDEN;
            r->out.data = q->acc;
            r->out.ndim = 3;
            r->out.shape[0] = 1, r->out.shape[1] = q->T, r->out.shape[2] = (int64_t)d;
        }
        if (q->T == 1) {
            se->steps++;
            se->step_s += t1 - t0;
        } else {
            se->prefill_s += t1 - t0;
        }
        q->gone = true;
        s->fig.hops++;
        s->fig.hop_s += t1 - q->t_in;
        s->fig.compute_s += t1 - t0;
    }
}

nl_status nl_stage_run_batch(nl_stage *s, const nl_stage_result **res, int *nres, nl_error *err)
{
    *res = s->res;
    *nres = 0;
    if (!s->n_q)
        return NL_OK;
    nl_status st = nl_stage_device_status(s, err);
    if (st == NL_OK)
        st = stage_wait_output(s, "a batch of sessions", err);
    if (st != NL_OK)
        return st;
    if (s->cap_res < s->n_q) { /* a result per hop at most; not grown while the
                                * caller reads them (enqueue does not touch it) */
        nl_stage_result *r = realloc(s->res, (size_t)s->cap_q * sizeof *r);
        if (!r)
            return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory for results");
        s->res = r;
        s->cap_res = s->cap_q;
    }
    *res = s->res;
    nl_error e = {0};
    const double t0 = nl_mono_s();
    const int n = pick(s, nres);
    int rows = 0;
    for (int k = 0; k < n; k++)
        rows += s->segs[k].T;
    if (n > 0)
        st = nl_batch_forward_hidden(s->batch, s->segs, s->seg_x, n, &e);
    const double t1 = nl_mono_s();
    if (n > 0 && st == NL_OK)
        st = finish(s, n, t0, t1, nres, &e);
    if (st != NL_OK) { /* every hop of the batch fails with it */
        for (int k = 0; k < n; k++) {
            queued_hop *q = &s->q[s->seg_q[k]];
            if (q->gone)
                continue;
            nl_stage_result *r = &s->res[(*nres)++];
            *r = (nl_stage_result){q->job_id, q->session_id, q->pos, st, "", {0}};
            snprintf(r->msg, sizeof r->msg, "job %llu session %llu: %.400s",
                     (unsigned long long)q->job_id, (unsigned long long)q->session_id, e.msg);
            q->gone = true;
        }
    }
    if (n > 0) {
        s->fig.batches++;
        s->fig.rows += (uint64_t)rows;
        s->fig.compute_s += t1 - t0;
    }
    if (st == NL_OK)
        run_adapted(s, nres);
    compact(s);
    nl_status dst = stage_check_device(s, err);
    return dst != NL_OK ? dst : NL_OK;
}

void nl_stage_get_figures(const nl_stage *s, nl_stage_figures *f)
{
    *f = s->fig;
}
