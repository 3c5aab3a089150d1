/* Verification by recompute, the coordinator's part, a leaf of the
 * training job's state machine (coord_train.c) that decides nothing about
 * the job's course (docs/security.md, "Catching a node that computes
 * wrong").
 *
 * When a step's reports are in and before its STEP goes out, each (stage,
 * step) is drawn with probability --verify-rate from a keyed BLAKE2b of
 * (job, step, stage) under a key the coordinator made at its start
 * (randombytes) and never sends: no node can tell in advance which of its
 * outputs will be checked. Every microbatch of a drawn (stage, step) is
 * checked, so the rate is still the fraction of (step, microbatch, stage)
 * verified, and the stage's weights travel once for all of them. A drawn
 * stage (with replicas on other nodes: the replica that ran each
 * microbatch, which reported its digests; another replica of the stage is
 * a natural verifier) gets a VERIFY_REQ per microbatch on the same socket
 * just before the STEP, so it answers from the weights the step began with
 * and the inputs it kept; only the first asks for its weights (the others
 * are asked NL_VERIFY_NO_WEIGHTS), which the cases of that node and step share
 * (cwts), and which go to each verifier once: a later case names them by
 * a name, and a verifier that no longer holds them answers
 * want_weights and is sent them again. The inputs of
 * its VERIFY_CASE must have the digests it reported receiving, and the
 * case goes, with the model's config, to a verifier of the stage's device
 * class (a standby first, else the node of another stage), whose
 * VERIFY_RESULT is compared with the digests the stage reported with its
 * GRAD_NORM. A stage alone in its class is checked by a node of another:
 * its case carries what it sent (VERIFY_REQ outputs; the job asked its
 * stages to keep it) and the verifier compares tensors within a relative
 * tolerance, answering the stage's digests when they stand. A disagreement
 * is logged and counted (the step report's `verify_mismatches`, /metrics),
 * and the case (kept) goes to an arbiter, a third node of the class: two
 * of the three agreeing convict the stage's node or outvote the verifier
 * (`verify_convicted`, `verify_outvoted`). The node found wrong, a stage
 * or a verifier, is quarantined and its key banned (coord_quarantine): the
 * job goes on without it from its last checkpoint whose steps were all
 * verified clean, which this file tells (coord_train_verified_through:
 * a case found wrong, skipped, withheld, unresolved or dropped
 * unanswered marks its step, a case under way keeps its step unverified
 * until it is answered); at the job's end the cases under way are
 * awaited (coord_train_verify_settle). */
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_train_impl.h"
#include "coordinator/coord_train_verify_impl.h"
#include "core/train/objective.h"
#include "net/hopdigest.h"

#define VERIFY_STALE_S 600.0 /* a verification still open after this is dropped */

#ifdef NL_TEST_HOOKS
/* Test builds: NL_TEST_VERIFY_LAG=D holds each case until the reports of
 * D steps later are in before it goes to its verifier, so that a
 * conviction comes after the checkpoints of the steps since
 * (test_cluster_verify's rollback). */
static int64_t verify_lag(void)
{
    const char *s = getenv("NL_TEST_VERIFY_LAG");
    return s && atoll(s) > 0 ? atoll(s) : 0;
}
#else
static int64_t verify_lag(void)
{
    return 0;
}
#endif

int coord_train_verify_cross(nl_coord *c)
{
    for (int i = 0; c->o.verify_rate > 0 && i < c->n_nodes; i++)
        if (c->nodes[i].life == NODE_LIVE && verify_cross_for(c, &c->nodes[i]))
            return 1;
    return 0;
}

/* Whether (job, step, stage) is drawn, by the coordinator's secret. */
static int drawn(const nl_coord *c, uint64_t job, int64_t step, int stage)
{
    uint8_t in[24], out[8];
    uint64_t v[3] = {job, (uint64_t)step, (uint32_t)stage};
    for (int i = 0; i < 3; i++)
        for (int b = 0; b < 8; b++)
            in[i * 8 + b] = (uint8_t)(v[i] >> (8 * b));
    crypto_generichash(out, sizeof out, in, sizeof in, c->verify_key, sizeof c->verify_key);
    uint64_t u = 0;
    for (int b = 0; b < 8; b++)
        u |= (uint64_t)out[b] << (8 * b);
    return (double)(u >> 11) * 0x1.0p-53 < c->o.verify_rate;
}

void coord_train_verify_free(ctrain *t)
{
    if (t && t->ver) {
        for (int i = 0; i < t->ver->n; i++) {
            free(t->ver->p[i].buf);
            verify_wts_release(&t->ver->p[i].w);
        }
        free(t->ver->p);
        free(t->ver);
        t->ver = NULL;
    }
}

static cver *add(ctrain *t)
{
    cverify *v = t->ver;
    if (!v && !(v = t->ver = calloc(1, sizeof *v)))
        return NULL;
    if (v->n == v->cap) {
        int cap = v->cap ? 2 * v->cap : 16;
        cver *p = realloc(v->p, (size_t)cap * sizeof *p);
        if (!p)
            return NULL;
        v->p = p;
        v->cap = cap;
    }
    return &v->p[v->n++];
}

static void drop(ctrain *t, int i)
{
    free(t->ver->p[i].buf);
    verify_wts_release(&t->ver->p[i].w);
    t->ver->p[i] = t->ver->p[--t->ver->n];
}

/* A (stage, microbatch) of step `step` drawn and not verified clean: no
 * checkpoint from that step on is all-verified. */
static void taint(ctrain *t, int64_t step)
{
    if (step < t->verify_taint)
        t->verify_taint = step;
}

int64_t coord_train_verified_through(const nl_coord *c, const ctrain *t)
{
    if (c->o.verify_rate <= 0)
        return INT64_MAX;
    int64_t first = t->verify_taint; /* cases still pending keep their steps unverified */
    for (int i = 0; t->ver && i < t->ver->n; i++)
        first = t->ver->p[i].step < first ? t->ver->p[i].step : first;
    return first == INT64_MAX ? first : first - 1;
}

void coord_train_verify_resume(ctrain *t, int64_t step)
{
    for (int i = 0; t->ver && i < t->ver->n; i++)
        if (t->ver->p[i].step > step) /* of steps that are redone */
            drop(t, i--);
    if (t->verify_taint > step)
        t->verify_taint = INT64_MAX;
}

/* The node of a conviction: quarantined and banned (coord_members.c). */
static void convict(nl_coord *c, cjob *j, const cver *v, const char *how)
{
    char why[300];
    cnode *n = coord_node_by_id(c, v->node);
    snprintf(why, sizeof why,
             "convicted of computing wrong: train job %llu step %lld microbatch %u "
             "stage %d (%s)",
             (unsigned long long)j->id, (long long)v->step, v->mb, v->stage, how);
    if (n && n->life == NODE_LIVE)
        coord_quarantine(c, n, j->id, why);
}

/* A stage that did not hand over a case it was asked for: counted and
 * convicted. */
static void withheld(nl_coord *c, cjob *j, const cver *v)
{
    ctrain *t = j->state;
    t->verify_mismatches++;
    t->verify_convicted++;
    t->verify_guilty = v->node;
    NL_WARN("train job %llu: node %u (stage %d) did not hand over step %lld microbatch %u for "
            "verification",
            (unsigned long long)j->id, v->node, v->stage, (long long)v->step, v->mb);
    convict(c, j, v, "it withheld its case");
}

/* Test builds: the cases held (verify_lag) of steps up to `upto` go to
 * their verifiers. */
static void release(nl_coord *c, ctrain *t, int64_t upto)
{
    for (int i = 0; t->ver && i < t->ver->n; i++) {
        cver *v = &t->ver->p[i];
        if (!v->held || v->step > upto)
            continue;
        v->held = 0;
        cnode *to = coord_node_by_id(c, v->verifier);
        if (!to || to->life != NODE_LIVE || verify_send_case(c, v, to) != 0) {
            taint(t, v->step);
            drop(t, i--);
        }
    }
}

int coord_train_verify_pending(const ctrain *t)
{
    return t->ver ? t->ver->n : 0;
}

int coord_train_verify_settle(nl_coord *c, cjob *j, int answered)
{
    ctrain *t = j->state;
    release(c, t, INT64_MAX);
    for (int i = 0; t->ver && i < t->ver->n; i++) {
        cver *v = &t->ver->p[i];
        const cnode *by = coord_node_by_id(c, v->verifier ? v->verifier : v->node);
        /* replica 0 writes the stage's checkpoint: another replica's case
         * has no answer after it on its connection, and is awaited */
        const int wrote = by && by->replica == 0;
        if (!v->verifier && answered && wrote) { /* its stage has sent its checkpoint since */
            withheld(c, j, v);
        } else if (by && by->life == NODE_LIVE && (v->verifier || (answered && !wrote))) {
            continue; /* its answer (or its case) is awaited */
        } else {
            NL_WARN("train job %llu: step %lld microbatch %u of stage %d is not verified: %s",
                    (unsigned long long)j->id, (long long)v->step, v->mb, v->stage,
                    v->verifier ? "its verifier is gone"
                                : "the job ended before its stage handed it over");
        }
        taint(t, v->step);
        drop(t, i--);
    }
    return coord_train_verify_pending(t);
}

/* Ask node n, which ran microbatch mb of stage s in `step`, for its case
 * (VERIFY_REQ), its weights shared through g (bare: handed over with an
 * earlier case of the group). -1: out of memory. */
static int ask_case(nl_coord *c, cjob *j, int s, int64_t step, int64_t mb, cnode *n, cwts *g,
                    int bare, uint64_t loss_rows, nl_wire_msg *m)
{
    ctrain *t = j->state;
    /* across classes only when the stages keep what they send */
    const int cross = t->verify_outputs && verify_cross_for(c, n);
    cver *v = add(t);
    if (!v)
        return -1;
    const uint8_t *d = t->dig + (((size_t)s * (size_t)t->micro + (size_t)mb) * NL_DIGEST_KINDS *
                                 NL_HOP_DIGEST_BYTES);
    const nl_plan_stage *row = &c->plan->stages[s];
    g->refs++;
    *v = (cver){.step = step,
                .mb = (uint32_t)mb,
                .stage = s,
                .node = n->id,
                .bare = bare,
                .w = g,
                .epoch = c->epoch,
                .t0 = nl_mono_s(),
                .cross = cross,
                .l0 = (uint32_t)row->l0,
                .l1 = (uint32_t)row->l1,
                .embed = row->has_embed != 0,
                .head = row->has_head != 0,
                .batch = (uint32_t)(t->batch / t->micro),
                .seq = (uint32_t)t->seq,
                .micro = (uint32_t)t->micro,
                .loss_rows = loss_rows};
    memcpy(v->want[0], d + NL_DIGEST_FWD_OUT * NL_HOP_DIGEST_BYTES, NL_HOP_DIGEST_BYTES);
    memcpy(v->want[1], d + NL_DIGEST_BWD_OUT * NL_HOP_DIGEST_BYTES, NL_HOP_DIGEST_BYTES);
    /* stage 0's input is what the coordinator sent it, not what it says */
    memcpy(v->got[0],
           s == 0 && t->sent ? t->sent + (size_t)mb * NL_HOP_DIGEST_BYTES
                             : d + NL_DIGEST_FWD_IN * NL_HOP_DIGEST_BYTES,
           NL_HOP_DIGEST_BYTES);
    memcpy(v->got[1], d + NL_DIGEST_BWD_IN * NL_HOP_DIGEST_BYTES, NL_HOP_DIGEST_BYTES);
    nl_wire_msg_reset(m, NL_MSG_VERIFY_REQ);
    m->u.verify_req =
        (nl_msg_verify_req){j->id, (uint64_t)step, (uint32_t)mb,
                            (cross ? NL_VERIFY_OUTPUTS : 0u) | (bare ? NL_VERIFY_NO_WEIGHTS : 0u)};
    t->verify_sampled++;
    if (coord_send_node(c, n, m) != NL_OK)
        drop(t, t->ver->n - 1); /* the node is lost: the machine hears of it */
    return 0;
}

/* A drawn (stage, step): every microbatch of it asked for, from the
 * replica that ran it (microbatch i on replica i mod R), each replica's
 * weights once. */
static void ask_stage(nl_coord *c, cjob *j, int s, int64_t step, uint64_t loss_rows, nl_wire_msg *m)
{
    ctrain *t = j->state;
    const int R = coord_stage_replicas(c, s);
    cwts **g = calloc((size_t)(R > 0 ? R : 1), sizeof *g);
    for (int64_t mb = 0; g && R > 0 && mb < t->micro; mb++) {
        const int r = (int)(mb % R);
        cnode *n = coord_stage_replica(c, s, r);
        if (!n)
            continue;
        const int bare = g[r] != NULL;
        if (!g[r] && (g[r] = calloc(1, sizeof *g[r])))
            g[r]->refs = 1; /* this loop's */
        if (!g[r] || ask_case(c, j, s, step, mb, n, g[r], bare, loss_rows, m) != 0)
            break;
    }
    for (int r = 0; g && r < R; r++)
        verify_wts_release(&g[r]);
    free(g);
}

void coord_train_verify_sample(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    const int64_t step = t->step + 1;
    if (c->o.verify_rate <= 0 || t->ft || !t->dig || t->dig_stages != t->stages)
        return;
    release(c, t, step - verify_lag());
    for (int i = 0; t->ver && i < t->ver->n; i++) {
        cver *v = &t->ver->p[i];
        /* one never answered, or not handed over on a former plan (its
         * stage dropped the job), or whose verifier is gone: unverified */
        const cnode *by = v->verifier ? coord_node_by_id(c, v->verifier) : NULL;
        if ((v->epoch != c->epoch && (!by || by->life != NODE_LIVE)) ||
            nl_mono_s() - v->t0 > VERIFY_STALE_S) {
            taint(t, v->step);
            drop(t, i--);
        } else if (!v->verifier && v->step < step) {
            /* its stage answers a VERIFY_REQ at once, before the STEP, and
             * its GRAD_NORM of this step came after on the same connection:
             * a case still missing was withheld */
            withheld(c, j, v);
            taint(t, v->step);
            drop(t, i--);
        }
    }
    /* the loss rows the step's hops carried (coord_train_send_step) */
    const int64_t rows = nl_objective_loss_rows(t->objective, t->valid, t->batch * t->seq);
    const uint64_t loss_rows = rows > 0 ? (uint64_t)rows : 0;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (int s = 0; c->plan && s < t->stages && s < c->plan->n_stages; s++)
        if (drawn(c, j->id, step, s))
            ask_stage(c, j, s, step, loss_rows, &m);
    nl_wire_msg_free(&m);
}

/* Whether a case's inputs are those the stage reported receiving: the
 * digest of its ACTIVATION (the input and the frames that came with it)
 * and of its GRADIENT, as hops into that stage. Without this a stage could
 * hand over inputs made to fit a wrong output. */
static int inputs_match(const cver *v, const nl_wire_msg *m)
{
    const nl_msg_verify_case *k = &m->u.verify_case;
    uint8_t d[NL_HOP_DIGEST_BYTES];
    nl_wire_msg h;
    nl_wire_msg_init(&h);
    nl_wire_msg_reset(&h, NL_MSG_ACTIVATION);
    h.u.hop = (nl_msg_tensor_hop){k->job_id, k->step, k->microbatch, 0, 0, 0.0};
    const int first_extra = 2 + !k->has_head + k->counts;
    const int end_extra = first_extra + __builtin_popcount(k->extras); /* then the outputs */
    h.frames[0] = m->frames[1];
    h.nframes = 1;
    for (int f = first_extra; f < end_extra && f < m->nframes; f++)
        h.frames[h.nframes++] = m->frames[f];
    nl_hop_digest(d, &h, k->stage);
    int ok = memcmp(d, v->got[0], NL_HOP_DIGEST_BYTES) == 0;
    if (ok && !k->has_head) {
        nl_wire_msg_reset(&h, NL_MSG_GRADIENT);
        h.u.hop = (nl_msg_tensor_hop){k->job_id, k->step, k->microbatch, 0, 0, 0.0};
        h.frames[0] = m->frames[2];
        h.nframes = 1;
        nl_hop_digest(d, &h, k->stage);
        ok = memcmp(d, v->got[1], NL_HOP_DIGEST_BYTES) == 0;
    }
    nl_wire_msg_free(&h);
    return ok;
}

/* Whether a case says of itself what the coordinator asked of its stage:
 * the plan's layers, embedding and head, the step's microbatch shape,
 * microbatches and loss rows. NULL: it does; else what differs. A stage
 * that skipped a layer could otherwise hand over a case without it, which
 * a verifier would redo to the same wrong outputs. */
static const char *case_differs(const cver *v, const nl_wire_msg *m)
{
    const nl_msg_verify_case *k = &m->u.verify_case;
    if (k->layer0 != v->l0 || k->layer1 != v->l1)
        return "its case's layers are not those the plan gave its stage";
    if (k->has_embed != v->embed || k->has_head != v->head)
        return "its case's embedding or head is not the plan's";
    if (k->batch != v->batch || k->seq != v->seq || k->microbatches != v->micro)
        return "its case's batch, sequence or microbatches are not the step's";
    if (k->loss_rows != v->loss_rows)
        return "its case's loss rows are not the step's";
    if ((m->frames[0].t.shape[0] == 0) != (v->bare != 0))
        return v->bare ? "its case carries weights it was not asked for"
                       : "its case lacks the weights it was asked for";
    return NULL;
}

/* A stage's VERIFY_CASE: on to a verifier, with the model's config. */
static void on_case(nl_coord *c, cjob *j, const nl_rx *rx, const cnode *from)
{
    ctrain *t = j->state;
    const nl_msg_verify_case *k = &rx->msg.u.verify_case;
    for (int i = 0; t->ver && i < t->ver->n; i++) {
        cver *v = &t->ver->p[i];
        if (v->verifier || v->node != from->id || v->step != (int64_t)k->step ||
            v->mb != k->microbatch || v->stage != (int)k->stage)
            continue;
        const char *differs = case_differs(v, &rx->msg);
        if (differs || !inputs_match(v, &rx->msg)) { /* the plan or its own reports convict it */
            t->verify_mismatches++;
            t->verify_convicted++;
            t->verify_guilty = v->node;
            if (!differs)
                differs = "its case's inputs are not those it reported receiving";
            NL_WARN("train job %llu: node %u (stage %d) hands over a case of step %lld "
                    "microbatch %u that is not the one asked for: %s",
                    (unsigned long long)j->id, v->node, v->stage, (long long)v->step, v->mb,
                    differs);
            convict(c, j, v, differs);
            taint(t, v->step);
            drop(t, i);
            return;
        }
        /* the group's weights: with its first case (bare: an earlier one) */
        const int weights =
            v->bare ? v->w->buf != NULL : verify_wts_take(v->w, &rx->msg.frames[0]) == 0;
        /* a verifier hears on its control socket: a bigger case would
         * make its libzmq drop the connection */
        uint64_t bytes = weights ? v->w->fr.len : 0, part = bytes;
        for (int f = 1; f < rx->msg.nframes; f++) {
            bytes += rx->msg.frames[f].len;
            part = rx->msg.frames[f].len > part ? rx->msg.frames[f].len : part;
        }
        const int fits = part <= NL_SOCK_CONTROL_PART && bytes + 65536 <= NL_SOCK_CONTROL_MSG;
        cnode *to = weights && fits ? verify_verifier_of(c, t, v, from) : NULL;
        const int held = verify_lag() > 0;
        if (!to || verify_keep_case(v, &rx->msg, bytes) != 0 ||
            (!held && verify_send_case(c, v, to) != 0)) {
            NL_WARN("train job %llu: step %lld microbatch %u of stage %d is not verified: %s",
                    (unsigned long long)j->id, (long long)v->step, v->mb, v->stage,
                    !weights ? "its stage's weights did not come (or no memory for them)"
                    : !fits  ? "the stage's weights exceed what a verifier's control socket "
                               "takes (16 MiB a part)"
                    : !to    ? "no other node to redo it"
                             : "the send to the verifier failed");
            t->verify_skipped++;
            taint(t, v->step);
            drop(t, i);
        } else {
            v->verifier = to->id;
            v->held = held;
        }
        return;
    }
    NL_WARN("train job %llu: an unasked VERIFY_CASE from node %u (stage %u, step %llu) ignored",
            (unsigned long long)j->id, from->id, k->stage, (unsigned long long)k->step);
}

/* A digest in hex as the verifier sent it, against the stage's. */
static int same(const char *hex, const uint8_t want[NL_HOP_DIGEST_BYTES])
{
    char w[NL_HOP_DIGEST_HEX + 1];
    if (nl_hop_digest_none(want))
        return !hex[0];
    nl_hop_digest_hex(w, want);
    return strcmp(hex, w) == 0;
}

/* A verifier's answer disagrees with the stage: the case goes to an
 * arbiter (a third node of the class), or, with none, stays unresolved. */
static int ask_arbiter(nl_coord *c, cjob *j, cver *v, const nl_msg_verify_result *r,
                       const cnode *from)
{
    ctrain *t = j->state;
    const cnode *stage = coord_node_by_id(c, v->node);
    cnode *to = stage ? verify_verifier_for(c, t, v->stage, stage, from->id, v->cross) : NULL;
    snprintf(v->said[0], sizeof v->said[0], "%s", r->fwd);
    snprintf(v->said[1], sizeof v->said[1], "%s", r->bwd);
    if (!to || verify_send_case(c, v, to) != 0) {
        NL_WARN("train job %llu: step %lld microbatch %u of stage %d stays unresolved: no third "
                "node to arbitrate between node %u and its verifier node %u",
                (unsigned long long)j->id, (long long)v->step, v->mb, v->stage, v->node, from->id);
        return -1;
    }
    v->first = from->id;
    v->verifier = to->id;
    return 0;
}

/* The arbiter's answer: two of the three agree. 1: the stage's outputs
 * stand (the verifier was outvoted), 0: not. */
static int judge(nl_coord *c, ctrain *t, cjob *j, const cver *v, const nl_msg_verify_result *r,
                 const cnode *from)
{
    const int with_stage = same(r->fwd, v->want[0]) && same(r->bwd, v->want[1]);
    /* across classes an answer is a verdict (the stage's digests: its
     * outputs stand), and two redos that both find it wrong agree */
    const int with_first =
        v->cross ? !with_stage : strcmp(r->fwd, v->said[0]) == 0 && strcmp(r->bwd, v->said[1]) == 0;
    if (with_first && !with_stage) {
        t->verify_convicted++;
        t->verify_guilty = v->node;
        NL_WARN("train job %llu: node %u (stage %d) computed step %lld microbatch %u wrong: its "
                "verifier node %u and the arbiter node %u agree",
                (unsigned long long)j->id, v->node, v->stage, (long long)v->step, v->mb, v->first,
                from->id);
        convict(c, j, v, "a verifier and an arbiter agree");
        return 0;
    }
    if (with_stage && !with_first) {
        t->verify_outvoted++;
        NL_WARN("train job %llu: verifier node %u was wrong about step %lld microbatch %u of "
                "stage %d: the arbiter node %u agrees with the stage's node %u",
                (unsigned long long)j->id, v->first, (long long)v->step, v->mb, v->stage, from->id,
                v->node);
        cnode *liar = coord_node_by_id(c, v->first);
        if (liar && liar->life == NODE_LIVE) {
            char why[300];
            snprintf(
                why, sizeof why,
                "convicted of verifying wrong: train job %llu step %lld microbatch %u stage %d "
                "(an arbiter agrees with the stage)",
                (unsigned long long)j->id, (long long)v->step, v->mb, v->stage);
            coord_quarantine(c, liar, j->id, why);
        }
        return 1;
    }
    NL_WARN("train job %llu: step %lld microbatch %u of stage %d unresolved: the stage's "
            "node %u, the verifier node %u and the arbiter node %u all disagree",
            (unsigned long long)j->id, (long long)v->step, v->mb, v->stage, v->node, v->first,
            from->id);
    return 0;
}

/* A verifier's (or an arbiter's) VERIFY_RESULT, against the stage's report. */
static void on_result(nl_coord *c, cjob *j, const nl_rx *rx, cnode *from)
{
    ctrain *t = j->state;
    const nl_msg_verify_result *r = &rx->msg.u.verify_result;
    for (int i = 0; t->ver && i < t->ver->n; i++) {
        cver *v = &t->ver->p[i];
        /* the case's own answer: after a rollback the same step, microbatch
         * and stage come again, with weights of another name, and an
         * answer to the case before may still be on its way */
        if (v->verifier != from->id || v->step != (int64_t)r->step || v->mb != r->microbatch ||
            v->stage != (int)r->stage || v->held ||
            (r->weights && r->weights[0] && strcmp(r->weights, v->w->hex) != 0))
            continue;
        if (r->want_weights) { /* it dropped them since: again, with them */
            verify_wts_mark(v->w, from->id, 0);
            if (v->asks++ == 0 && verify_send_case(c, v, from) == 0)
                return;
            NL_WARN("train job %llu: step %lld microbatch %u of stage %d is not verified: node "
                    "%u %s",
                    (unsigned long long)j->id, (long long)v->step, v->mb, v->stage, from->id,
                    v->asks > 1 ? "asks again for the weights it was sent"
                                : "could not be sent the weights it asks for");
            taint(t, v->step);
            drop(t, i);
            return;
        }
        const int fwd = same(r->fwd, v->want[0]), bwd = same(r->bwd, v->want[1]);
        from->ver_cases++;
        from->ver_s += nl_mono_s() - v->sent;
        from->ver_mismatches += !(fwd && bwd);
        if (v->first) { /* the arbiter's: clean only if it outvotes the verifier */
            if (!judge(c, t, j, v, r, from))
                taint(t, v->step);
            drop(t, i);
            return;
        }
        t->verify_done++;
        if (fwd && bwd) {
            NL_DEBUG("train job %llu: step %lld microbatch %u of stage %d verified by node %u",
                     (unsigned long long)j->id, (long long)v->step, v->mb, v->stage, from->id);
            drop(t, i);
            return;
        }
        t->verify_mismatches++;
        NL_WARN("train job %llu: step %lld microbatch %u of stage %d (node %u): node %u's "
                "recompute gives another %s%s%s",
                (unsigned long long)j->id, (long long)v->step, v->mb, v->stage, v->node, from->id,
                fwd ? "" : "ACTIVATION", fwd || bwd ? "" : " and ", bwd ? "" : "GRADIENT");
        if (ask_arbiter(c, j, v, r, from) != 0) {
            taint(t, v->step);
            drop(t, i);
        }
        return;
    }
    NL_INFO("train job %llu: node %u's answer about step %llu microbatch %u of stage %u is "
            "to no case awaited now (one of a step redone since, or dropped): ignored",
            (unsigned long long)j->id, from->id, (unsigned long long)r->step, r->microbatch,
            r->stage);
}

void coord_train_verify_msg(nl_coord *c, cjob *j, const nl_rx *rx)
{
    cnode *from = coord_node_by_rid(c, rx);
    ctrain *t = j->state;
    if (!from || !t)
        return;
    if (rx->msg.type == NL_MSG_VERIFY_CASE)
        on_case(c, j, rx, from);
    else if (rx->msg.type == NL_MSG_VERIFY_RESULT)
        on_result(c, j, rx, from);
}
