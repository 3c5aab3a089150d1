/* Verification by recompute, the node's part (see stage_verify.h): the
 * inputs a training stage keeps of the step under way, the case of one
 * microbatch made from them, and its redo on a verifier's backend. */
#include "node/stage_verify.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/model/model.h"
#include "core/train/train.h"
#include "node/stage_train_impl.h"
#include "node/stage_verify_impl.h"

/* ===================== what a stage keeps ===================== */

void stage_train_keep(stage_train *t, rjob *j)
{
    if (!t->kept || j->st != NL_OK || !j->x || j->step != t->begun || j->mb >= (uint32_t)t->M ||
        (j->kind != JOB_FORWARD && j->kind != JOB_BACKWARD))
        return;
    kept_mb *k = &t->kept[j->mb];
    if (j->kind == JOB_FORWARD) {
        free(k->x);
        stage_train_extra_free(&k->e);
        k->x = j->x; /* taken: the job no longer owns them */
        k->e = j->e;
        j->e = (hop_extra){0};
        k->fwd = true;
    } else {
        free(k->dy);
        k->dy = j->x;
        k->bwd = true;
    }
    j->x = NULL;
}

void stage_train_keep_out(stage_train *t, const rjob *j)
{
    const bool fwd = j->out_type == NL_MSG_ACTIVATION, bwd = j->out_type == NL_MSG_GRADIENT;
    if (!t->keep_out || !t->kept || !j->out || j->step != t->begun || j->mb >= (uint32_t)t->M ||
        !(fwd || bwd))
        return;
    float **slot = fwd ? &t->kept[j->mb].y : &t->kept[j->mb].dx;
    const size_t bytes = t->rows * t->d * sizeof(float);
    if (!*slot)
        *slot = malloc(bytes); /* freed as the next step begins */
    if (*slot)
        memcpy(*slot, j->out, bytes);
}

void stage_train_kept_free(stage_train *t)
{
    for (int i = 0; t->kept && i < t->M; i++) {
        kept_mb *k = &t->kept[i];
        free(k->x);
        free(k->dy);
        free(k->y);
        free(k->dx);
        stage_train_extra_free(&k->e);
        *k = (kept_mb){0};
    }
}

/* ===================== a case ===================== */

/* As nl_stage_verify_case; without `weights`, c carries none (n_weights
 * 0): the stage handed them over with an earlier case of the step. */
static nl_status verify_case(nl_stage *s, uint64_t job, uint64_t step, uint32_t mb, bool weights,
                             nl_verify_case *c, nl_error *err)
{
    const stage_job *e = stage_job_first(s, NL_JOB_TRAIN);
    stage_train *t = e ? e->state : NULL;
    *c = (nl_verify_case){0};
    if (!t || t->job != job)
        return nl_error_set(err, NL_ERR_STATE, "verify: no training job %llu on this stage",
                            (unsigned long long)job);
    uint32_t here = 0; /* this replica's number of the step's microbatch mb */
    if (t->begun != step || !t->finished || mb >= (uint32_t)t->Mg || t->H > 0)
        return nl_error_set(err, NL_ERR_STATE,
                            "verify: step %llu microbatch %u, but this stage %s step %llu of %d "
                            "microbatches%s",
                            (unsigned long long)step, mb,
                            t->finished ? "has finished" : "is still in",
                            (unsigned long long)t->begun, t->Mg,
                            t->H > 0 ? " (its replica group trains alone: DiLoCo)" : "");
    nl_status st = stage_train_mb_here(t, "verify", mb, &here, err);
    if (st != NL_OK)
        return st;
    const kept_mb *k = &t->kept[here];
    const nl_model *m = s->model;
    if (!k->fwd || (!m->has_head && !k->bwd))
        return nl_error_set(err, NL_ERR_STATE, "verify: microbatch %u's inputs are not kept", mb);
    if (weights && !(c->weights = malloc(m->n_params * sizeof(float))))
        return nl_error_set(err, NL_ERR_NOMEM, "verify: out of memory for the weights");
    if (weights)
        s->be->download(s->be, c->weights, m->params, m->n_params * sizeof(float));
    c->n_weights = weights ? m->n_params : 0;
    c->cfg = &m->cfg;
    c->l0 = m->l0;
    c->l1 = m->l1;
    c->has_embed = m->has_embed;
    c->has_head = m->has_head;
    c->stage = (uint32_t)s->stage_idx;
    c->job = job;
    c->step = step;
    c->mb = mb;
    c->mbB = t->mbB;
    c->T = t->T;
    c->M = t->Mg; /* the step's: its rows scale the loss (as the replica's trainer) */
    c->bf16 = s->wire == NL_WIRE_BF16;
    c->x = k->x;
    c->targets = k->e.targets;
    c->docs = k->e.docs;
    c->labels = k->e.labels;
    c->lengths = k->e.lengths;
    c->loss_rows = k->e.loss_rows;
    c->dy = m->has_head ? NULL : k->dy;
    c->counts = t->counts_ready ? t->counts : NULL;
    c->y = m->has_head ? NULL : k->y; /* NULL unless the job asked to keep them */
    c->dx = m->has_embed ? NULL : k->dx;
    return nl_backend_check(s->be, err);
}

nl_status nl_stage_verify_case(nl_stage *s, uint64_t job, uint64_t step, uint32_t mb,
                               nl_verify_case *c, nl_error *err)
{
    return verify_case(s, job, step, mb, true, c, err);
}

void nl_verify_case_free(nl_verify_case *c)
{
    if (!c)
        return;
    free(c->weights);
    c->weights = NULL;
}

/* ===================== the redo ===================== */

/* The digest of a hop the stage sends: as send_host in stage_train_hops.c
 * makes it (hidden states, then an ACTIVATION's frames that travel on). */
static void hop_digest(const nl_verify_case *c, nl_msg_type type, const float *x, size_t d,
                       uint8_t out[NL_HOP_DIGEST_BYTES])
{
    const int64_t xs[3] = {c->mbB, c->T, (int64_t)d};
    const bool grad = type == NL_MSG_GRADIENT;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, type);
    m.u.hop = (nl_msg_tensor_hop){c->job, c->step, c->mb, 0, 0, 0.0};
    uint16_t *h = NULL;
    size_t cap = 0;
    nl_error e;
    /* as it crosses the wire: FP32, or rounded to bf16 (as send_host) */
    if (nl_wire_frame_hidden(&m.frames[0], c->bf16 ? NL_WIRE_BF16 : NL_WIRE_FP32, x, xs, 3, &h,
                             &cap, &e) != NL_OK) {
        memset(out, 0xff, NL_HOP_DIGEST_BYTES); /* out of memory: no stage's digest */
        nl_wire_msg_free(&m);
        return;
    }
    m.nframes = 1;
    if (!grad)
        nl_wire_hop_set_extras(&m, c->mbB, c->T, c->targets, c->docs, c->labels, c->lengths);
    nl_hop_digest(out, &m, c->stage + (grad ? (uint32_t)-1 : 1u));
    nl_wire_msg_free(&m);
    free(h);
}

double nl_verify_cross_rtol(const nl_verify_case *c)
{
    return c->bf16 ? NL_VERIFY_CROSS_RTOL_BF16 : NL_VERIFY_CROSS_RTOL;
}

/* max |a - b| over max |b| (b the stage's tensor, n floats). */
static double rel_diff(const float *a, const float *b, size_t n)
{
    double diff = 0.0, scale = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - (double)b[i]), m = fabs((double)b[i]);
        diff = e > diff || e != e ? e : diff; /* a NaN stays */
        scale = m > scale ? m : scale;
    }
    return diff == 0.0 ? 0.0 : scale > 0.0 ? diff / scale : INFINITY;
}

/* The digest of the redo's tensor, or (across classes, c's own within the
 * tolerance) of the stage's; *rel: the larger difference so far. */
static void judge_out(const nl_verify_case *c, nl_msg_type type, const float *mine,
                      const float *theirs, size_t d, double *rel, uint8_t out[NL_HOP_DIGEST_BYTES])
{
    const size_t n = (size_t)c->mbB * (size_t)c->T * d;
    const double r = theirs ? rel_diff(mine, theirs, n) : 0.0;
    if (rel && (r > *rel || r != r))
        *rel = r;
    hop_digest(c, type, theirs && r <= nl_verify_cross_rtol(c) ? theirs : mine, d, out);
}

void verify_redo_free(verify_redo *r)
{
    nl_trainer_destroy(&r->tr);
    nl_model_destroy(&r->m);
    if (r->be && r->x_d)
        r->be->free(r->be, r->x_d);
    r->x_d = NULL;
    free(r->host);
    r->host = NULL;
}

nl_status verify_redo_make(verify_redo *r, const nl_verify_case *c, nl_error *err)
{
    const size_t rows = (size_t)c->mbB * (size_t)c->T, d = (size_t)c->cfg->hidden_dim;
    nl_status st = nl_model_new(&r->m, r->be, c->cfg, c->l0, c->l1, c->has_embed, c->has_head, err);
    if (st == NL_OK && r->m->n_params != c->n_weights)
        st = nl_error_set(err, NL_ERR_SHAPE,
                          "verify: the stage's layers [%d, %d) have %zu parameters, %zu came",
                          c->l0, c->l1, r->m->n_params, c->n_weights);
    if (st == NL_OK)
        st = nl_trainer_new(&r->tr, r->m, (int)rows, 1, 0, err);
    if (st == NL_OK && (!(r->x_d = r->be->alloc(r->be, rows * d * sizeof(float))) ||
                        !(r->host = malloc(rows * d * sizeof(float)))))
        st = nl_error_set(err, NL_ERR_NOMEM, "verify: out of memory");
    if (st != NL_OK)
        verify_redo_free(r);
    return st;
}

void verify_redo_load(verify_redo *r, const nl_verify_case *c)
{
    r->be->upload(r->be, r->m->params, c->weights, c->n_weights * sizeof(float));
}

nl_status verify_redo_run(verify_redo *r, const nl_verify_case *c, uint8_t fwd[NL_HOP_DIGEST_BYTES],
                          uint8_t bwd[NL_HOP_DIGEST_BYTES], double *rel, nl_error *err)
{
    nl_backend *be = r->be;
    const size_t rows = (size_t)c->mbB * (size_t)c->T, d = (size_t)c->cfg->hidden_dim;
    memset(fwd, 0, NL_HOP_DIGEST_BYTES);
    memset(bwd, 0, NL_HOP_DIGEST_BYTES);
    if (rel)
        *rel = 0.0;
    /* as the stage's step: the batch's rows, its loss rows and its shares
     * (a trainer kept from an earlier case starts afresh here: begin_step
     * clears its gradients, counts and shares, set_docs and set_labels
     * replace the last case's) */
    nl_trainer_begin_step(r->tr, (int64_t)c->M * (int64_t)rows);
    if (c->loss_rows > 0)
        nl_trainer_set_loss_rows(r->tr, (int64_t)c->loss_rows);
    if (c->counts)
        nl_trainer_use_counts(r->tr, c->counts);
    const float *x = NULL;
    if (!c->has_embed) {
        be->upload(be, r->x_d, c->x, rows * d * sizeof(float));
        x = r->x_d;
    }
    double ce = 0.0, aux = 0.0;
    nl_status st = nl_trainer_set_docs(r->tr, c->docs, (int)rows, err);
    if (st == NL_OK && c->has_head)
        st = nl_trainer_set_labels(r->tr, c->labels, c->lengths, c->mbB, c->T, err);
    if (st == NL_OK)
        st = nl_trainer_forward(r->tr, 0, c->mbB, c->T, c->has_embed ? c->x : NULL, x,
                                c->has_head ? c->targets : NULL, &ce, &aux, err);
    if (st == NL_OK && !c->has_head) {
        be->download(be, r->host, nl_trainer_output(r->tr, 0), rows * d * sizeof(float));
        judge_out(c, NL_MSG_ACTIVATION, r->host, c->y, d, rel, fwd);
    }
    if (st == NL_OK && !c->has_head) /* the gradient the stage received */
        be->upload(be, r->x_d, c->dy, rows * d * sizeof(float));
    if (st == NL_OK)
        st = nl_trainer_backward(r->tr, 0, c->has_head ? NULL : r->x_d, err);
    if (st == NL_OK && !c->has_embed) {
        be->download(be, r->host, nl_trainer_input_grad(r->tr), rows * d * sizeof(float));
        judge_out(c, NL_MSG_GRADIENT, r->host, c->dx, d, rel, bwd);
    }
    if (st == NL_OK)
        st = nl_backend_check(be, err);
    if (st != NL_OK)
        nl_error_prefix(err, "verify job %llu step %llu microbatch %u stage %u",
                        (unsigned long long)c->job, (unsigned long long)c->step, c->mb, c->stage);
    return st;
}

nl_status nl_verify_recompute(nl_backend *be, const nl_verify_case *c,
                              uint8_t fwd[NL_HOP_DIGEST_BYTES], uint8_t bwd[NL_HOP_DIGEST_BYTES],
                              double *rel, nl_error *err)
{
    verify_redo r = {.be = be};
    nl_status st = verify_redo_make(&r, c, err);
    if (st == NL_OK) {
        verify_redo_load(&r, c);
        st = verify_redo_run(&r, c, fwd, bwd, rel, err);
    } else {
        memset(fwd, 0, NL_HOP_DIGEST_BYTES);
        memset(bwd, 0, NL_HOP_DIGEST_BYTES);
        nl_error_prefix(err, "verify job %llu step %llu microbatch %u stage %u",
                        (unsigned long long)c->job, (unsigned long long)c->step, c->mb, c->stage);
    }
    verify_redo_free(&r);
    return st;
}

/* ===================== on the wire ===================== */

/* Frame f of hidden states x [mbB, T, d] in the wire's precision wp (bf16:
 * rounded into *h, the caller's to free), unless st is an error already. */
static nl_status hidden_frame(nl_wire_frame *f, nl_wire_precision wp, const float *x,
                              const int64_t xs[3], uint16_t **h, nl_status st, nl_error *err)
{
    size_t cap = 0;
    return st != NL_OK ? st : nl_wire_frame_hidden(f, wp, x, xs, 3, h, &cap, err);
}

nl_status stage_train_verify_req(nl_stage *s, stage_train *t, const nl_msg_verify_req *r,
                                 nl_stage_send_fn send, void *ctx, nl_error *err)
{
    nl_verify_case c;
    if (stage_verify_mute(s)) /* a test hook: a stage that withholds its cases */
        return NL_OK;
    const bool outputs = r->flags & NL_VERIFY_OUTPUTS;
    nl_status st = verify_case(s, r->job_id, r->step, r->microbatch,
                               !(r->flags & NL_VERIFY_NO_WEIGHTS), &c, err);
    if (st == NL_OK && outputs && ((!c.has_head && !c.y) || (!c.has_embed && !c.dx)))
        st = nl_error_set(err, NL_ERR_STATE,
                          "verify: microbatch %u's outputs are not kept (the job did not ask "
                          "for verify_outputs)",
                          r->microbatch);
    if (st != NL_OK) {
        nl_verify_case_free(&c);
        return st;
    }
    /* the hidden states as they crossed the wire (bf16: rounded, which
     * is exact for the inputs, widened from bf16 when they came) */
    uint16_t *h[4] = {NULL, NULL, NULL, NULL};
    int nh = 0;
    const size_t d = (size_t)c.cfg->hidden_dim;
    const int64_t ws[1] = {(int64_t)c.n_weights}, ts[2] = {c.mbB, c.T},
                  xs[3] = {c.mbB, c.T, (int64_t)d}, cs[2] = {c.l1 - c.l0, c.cfg->num_experts},
                  bs[1] = {c.mbB};
    nl_wire_msg *m = &t->tx;
    nl_wire_msg_reset(m, NL_MSG_VERIFY_CASE);
    const uint32_t extras = (c.targets ? NL_HOP_TARGETS : 0u) | (c.docs ? NL_HOP_DOCS : 0u) |
                            (c.labels ? NL_HOP_LABELS : 0u) | (c.lengths ? NL_HOP_LENGTHS : 0u);
    m->u.verify_case = (nl_msg_verify_case){c.job,
                                            c.step,
                                            c.mb,
                                            c.stage,
                                            (uint32_t)c.l0,
                                            (uint32_t)c.l1,
                                            c.has_embed,
                                            c.has_head,
                                            (uint32_t)c.mbB,
                                            (uint32_t)c.T,
                                            (uint32_t)c.M,
                                            c.loss_rows,
                                            extras,
                                            c.counts != NULL,
                                            "",
                                            outputs ? 1u : 0u,
                                            ""};
    const nl_wire_precision wp = c.bf16 ? NL_WIRE_BF16 : NL_WIRE_FP32;
    int f = 0;
    static const float none = 0.0f; /* no_weights: F32 [0] */
    nl_wire_frame_set(&m->frames[f++], c.weights ? c.weights : &none, NL_DTYPE_F32, ws,
                      1); /* copied by the send */
    if (c.has_embed)
        nl_wire_frame_set(&m->frames[f++], c.x, NL_DTYPE_I32, ts, 2);
    else
        st = hidden_frame(&m->frames[f++], wp, c.x, xs, &h[nh++], st, err);
    if (!c.has_head)
        st = hidden_frame(&m->frames[f++], wp, c.dy, xs, &h[nh++], st, err);
    if (c.counts)
        nl_wire_frame_set(&m->frames[f++], c.counts, NL_DTYPE_I64, cs, 2);
    const int32_t *ex[4] = {c.targets, c.docs, c.labels, c.lengths};
    for (int i = 0; i < 4; i++)
        if (ex[i])
            nl_wire_frame_set(&m->frames[f++], ex[i], NL_DTYPE_I32, i < 2 ? ts : bs, i < 2 ? 2 : 1);
    if (outputs && !c.has_head) /* across device classes: what it sent */
        st = hidden_frame(&m->frames[f++], wp, c.y, xs, &h[nh++], st, err);
    if (outputs && !c.has_embed)
        st = hidden_frame(&m->frames[f++], wp, c.dx, xs, &h[nh++], st, err);
    m->nframes = f;
    if (st == NL_OK)
        st = send(ctx, NL_STAGE_TO_COORD, m, err);
    for (int i = 0; i < nh; i++)
        free(h[i]);
    nl_verify_case_free(&c);
    return st;
}
