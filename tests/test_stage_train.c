/* Unit tests of node/stage_train: distributed training on stages in one
 * process, without sockets. Every message a stage sends goes through the
 * real wire codec (encoded, then decoded on delivery) into the queue of the
 * socket it would travel on; a test "coordinator" feeds the microbatches,
 * sums the gradient norms and decides each step as neurocoord does.
 * Deliveries from different sockets are interleaved at random, so hops of
 * the next step overtake the STEP of this one.
 *
 *  - parity: 3 stages with M = 4 microbatches (1F1B, counting pass), with
 *    M = 1, and with recompute, against nl_trainer_step_local on the whole
 *    model: every step's loss and the final weights agree within 1e-5;
 *  - evaluation through the pipeline equals the local held-out loss;
 *  - the guard: a NaN in one stage's gradient skips the step everywhere;
 *  - refusals: hops of a wrong shape, step or job, a GRADIENT out of
 *    order, a CKPT_REQ outside --checkpoint-root;
 *  - neighbours with other replica counts (ASSIGN prev_keys, next_keys):
 *    hops and gradients delivered in any order give the in-order run's
 *    losses and norms to the bit;
 *  - data-parallel replicas (nl_stage_new_replicas, 2 and 3 backends of
 *    NL_TEST_DEVICE per stage, host all-reduce): the same pipeline and
 *    batches give every step's loss and gradient norm within 1e-6 of the
 *    single-replica run (and the local one within 1e-5), with 1F1B, one
 *    microbatch (an idle replica), recompute and the NaN guard;
 *  - hop digests (net/hopdigest.h): every stage reports with its GRAD_NORM
 *    the digests of the step's hops it received and sent; the sender's
 *    and the receiver's agree on every hop, two runs give the same ones,
 *    stage 0's are those of what it was fed, and a hop whose bytes do not
 *    match its digest is refused (NL_ERR_INTEGRITY);
 *  - the lying stage of the test hook (NL_TEST_HOOKS builds): each kind
 *    changes what it sends on some microbatches (its digests there differ
 *    from the honest run's) while its neighbours still agree with it;
 *  - verification by recompute (node/stage_verify.h): every (stage,
 *    microbatch) of 17 honest steps redone on another backend from the
 *    stage's kept inputs and weights gives the digests it reported (204,
 *    none accused), and one per stage and step over the wire (VERIFY_REQ,
 *    VERIFY_CASE through the codec, a verifier stage without a model,
 *    VERIFY_RESULT); each kind of lie on stage 1 is accused there and an
 *    honest stage never. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/model/rng.h"
#include "core/train/train.h"
#include "net/hopdigest.h"
#include "net/wire.h"
#include "node/stage.h"
#include "node/stage_verify.h"
#include "tests/check.h"

#define SEED 99
#define NST 3
#define MAXQ 4096

#define MAXREP 3

static nl_backend *be, *rbe[MAXREP]; /* rbe[0] == be: the replicas' backends */
static nl_config cfg;
static char *cfg_json;

/* ---- a message bus: one FIFO per socket, messages stored encoded ---- */

typedef struct packet {
    uint8_t *hdr;
    size_t hlen;
    uint8_t *frame[NL_WIRE_MAX_FRAMES];
    size_t flen[NL_WIRE_MAX_FRAMES];
    int nframes;
} packet;

enum { Q_CTL, Q_DATA, Q_NEXT, Q_KINDS }; /* a stage's inputs: control, data, next */

typedef struct fifo {
    packet p[MAXQ];
    int head, len;
} fifo;

static fifo stage_q[NST][Q_KINDS], coord_q;
/* the test hook's lie (make_stages gives it to stage lie_stage) */
static nl_stage_lie test_lie;
static int lie_stage = -1;
/* the digests each stage reported with its last GRAD_NORM, [M][4][32] */
#define MAXM 4
static uint8_t dig_got[NST][MAXM * NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES];
static int dig_frames;
static nl_stage *stages[NST];
static int ctx_idx[NST];

static nl_rng rng;      /* the order of deliveries */
static nl_rng data_rng; /* the batches: the same for every run of parity() */

static void push(fifo *f, nl_wire_msg *m)
{
    nl_wire_wbuf wb = {0};
    nl_error err;
    CHECK_OK(nl_wire_encode(m, &wb, NULL, &err), &err);
    if (f->len == MAXQ) {
        CHECK(0, "queue full");
        nl_wire_wbuf_free(&wb);
        return;
    }
    packet *p = &f->p[(f->head + f->len++) % MAXQ];
    p->hdr = wb.data;
    p->hlen = wb.len;
    p->nframes = m->nframes;
    for (int i = 0; i < m->nframes; i++) {
        p->flen[i] = m->frames[i].len;
        p->frame[i] = malloc(p->flen[i] + 1);
        memcpy(p->frame[i], m->frames[i].t.data, p->flen[i]);
    }
}

/* Neighbours with other replica counts (fans_in_any_order): every stage
 * is told its neighbours are fans (ASSIGN prev_keys, next_keys), and the
 * data and next sockets deliver their hops in any order, as several
 * replicas of a neighbour would send them. */
static bool fans;

/* Pop the message at position i of the queue (0: its head) and decode it
 * into m (frames valid until packet_free). */
static int pop_at(fifo *f, int at, nl_wire_msg *m, packet *out)
{
    if (!f->len)
        return 0;
    *out = f->p[(f->head + at) % MAXQ];
    for (int k = at; k > 0; k--) /* the ones before it move up */
        f->p[(f->head + k) % MAXQ] = f->p[(f->head + k - 1) % MAXQ];
    f->head = (f->head + 1) % MAXQ;
    f->len--;
    nl_wire_part parts[NL_WIRE_MAX_FRAMES + 1] = {{out->hdr, out->hlen}};
    for (int i = 0; i < out->nframes; i++)
        parts[i + 1] = (nl_wire_part){out->frame[i], out->flen[i]};
    nl_error err;
    CHECK_OK(nl_wire_decode(m, parts, 1 + out->nframes, NULL, &err), &err);
    return 1;
}

static int pop(fifo *f, nl_wire_msg *m, packet *out)
{
    return pop_at(f, 0, m, out);
}

static void packet_free(packet *p)
{
    free(p->hdr);
    for (int i = 0; i < p->nframes; i++)
        free(p->frame[i]);
}

static nl_status bus_send(void *ctx, nl_stage_dest to, nl_wire_msg *m, nl_error *err)
{
    int s = *(int *)ctx;
    if (to == NL_STAGE_TO_COORD)
        push(&coord_q, m);
    else if (to == NL_STAGE_TO_NEXT && s + 1 < NST)
        push(&stage_q[s + 1][Q_DATA], m);
    else if (to == NL_STAGE_TO_PREV && s > 0)
        push(&stage_q[s - 1][Q_NEXT], m);
    else
        return nl_error_set(err, NL_ERR_STATE, "stage %d has no such neighbour", s);
    return NL_OK;
}

/* verification by recompute in digest_run (on rbe[1]): every (stage,
 * microbatch) of every step redone and compared with the stage's report */
static bool verify_on;
static int verified, mismatched[NST], mismatch_fwd[NST], mismatch_bwd[NST];
/* ... and one microbatch of each stage a step over the wire: VERIFY_REQ to
 * the stage, its VERIFY_CASE (through the codec) to a verifier stage
 * holding no model, whose VERIFY_RESULT must match the stage's report */
static nl_stage *verifier;
static int wire_verified, wire_mismatched[NST];
/* ... and (cross_on) that microbatch again as across device classes: the
 * case carries what the stage sent, and the verifier answers the digest
 * of those bytes when its own are within NL_VERIFY_CROSS_RTOL of them,
 * else of its own. On one device its own are the stage's: as sent, the
 * answer is the stage's report; with one element moved by 1e-6 of the
 * tensor's scale (within) it is the moved bytes' digest, not the report
 * (a stage cannot hand over other bytes than it sent); moved by 1e-3
 * (beyond) it is the verifier's own, the report again. */
static bool cross_on;
static int cross_checked, cross_wrong;
/* The stages' wire is bf16 (ASSIGN wire): the cases carry their hidden
 * states as BF16 frames, the bytes that crossed it (wire_bf16_cases). */
static bool wire_bf16;
static int wire_bf16_cases;
/* (wire_all) every microbatch of every stage over the wire, and the last
 * of each step once more with one weight changed (stale_checked): the
 * answer must not be the stage's report (the verifier keeps the weights
 * of the step's earlier cases, and must load the case's own) */
static bool wire_all;
static int stale_checked, stale_missed;

/* The stage's VERIFY_CASE of (s, mb) with its outputs, answered by the
 * verifier with the last output frame's element 0 moved by `by` times
 * the frame's largest magnitude: 1 if the answer is the stage's digests
 * (want; NULL: none at that end). */
static int cross_answer(uint64_t job, uint64_t step, int s, uint32_t mb, double by,
                        char want[2][NL_HOP_DIGEST_HEX + 1])
{
    nl_wire_msg m, out;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&out);
    nl_error err;
    nl_wire_msg_reset(&m, NL_MSG_VERIFY_REQ);
    m.u.verify_req = (nl_msg_verify_req){job, step, mb, 1};
    CHECK_OK(nl_stage_job_input(stages[s], &m, bus_send, &ctx_idx[s], &err), &err);
    packet p = {0};
    int ok = 0;
    if (!pop(&coord_q, &m, &p) || m.type != NL_MSG_VERIFY_CASE || !m.u.verify_case.outputs) {
        CHECK(0, "stage %d: no VERIFY_CASE with its outputs", s);
        goto done;
    }
    uint8_t *o = p.frame[p.nframes - 1]; /* the GRADIENT it sent, or on stage 0 its ACTIVATION */
    const size_t n = p.flen[p.nframes - 1] / sizeof(float);
    float v, x0, big = 0.0f;
    for (size_t i = 0; i < n; i++) {
        memcpy(&v, o + i * sizeof v, sizeof v);
        big = fabsf(v) > big ? fabsf(v) : big;
    }
    memcpy(&x0, o, sizeof x0);
    x0 += (float)(by * big);
    memcpy(o, &x0, sizeof x0);
    m.u.verify_case.config_json = cfg_json;
    char hex[2][NL_HOP_DIGEST_HEX + 1];
    nl_status st = nl_verify_answer(verifier, &m, &out, hex, &err);
    CHECK_OK(st, &err);
    ok = st == NL_OK &&
         (s == NST - 1 ? !out.u.verify_result.fwd[0]
                       : strcmp(out.u.verify_result.fwd, want[0]) == 0) &&
         (s == 0 ? !out.u.verify_result.bwd[0] : strcmp(out.u.verify_result.bwd, want[1]) == 0);
done:
    packet_free(&p);
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&out);
    return ok;
}

/* Redo every microbatch of every stage of the step that has just been
 * reported (the stages are between GRAD_NORM and STEP). */
static void verify_step(uint64_t job, uint64_t step, int M)
{
    for (int s = 0; s < NST; s++)
        for (int mb = 0; mb < M; mb++) {
            nl_verify_case c;
            nl_error err;
            uint8_t fwd[NL_HOP_DIGEST_BYTES], bwd[NL_HOP_DIGEST_BYTES];
            nl_status st = nl_stage_verify_case(stages[s], job, step, (uint32_t)mb, &c, &err);
            if (st == NL_OK)
                st = nl_verify_recompute(rbe[1], &c, fwd, bwd, NULL, &err);
            nl_verify_case_free(&c);
            CHECK_OK(st, &err);
            if (st != NL_OK)
                continue;
            const uint8_t *g = dig_got[s] + (size_t)mb * NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES;
            const int f = memcmp(fwd, g + NL_DIGEST_FWD_OUT * NL_HOP_DIGEST_BYTES, 32) != 0;
            const int b = memcmp(bwd, g + NL_DIGEST_BWD_OUT * NL_HOP_DIGEST_BYTES, 32) != 0;
            verified++;
            mismatched[s] += f || b;
            mismatch_fwd[s] += f;
            mismatch_bwd[s] += b;
        }
}

static void verify_wire(uint64_t job, uint64_t step, int M)
{
    nl_wire_msg m, out;
    nl_wire_msg_init(&m);
    nl_wire_msg_init(&out);
    for (int i = 0; i < NST * (wire_all ? M : 1); i++) {
        nl_error err;
        const int s = wire_all ? i / M : i;
        const uint32_t mb =
            wire_all ? (uint32_t)(i % M) : (uint32_t)((step + (uint64_t)s) % (uint64_t)M);
        nl_wire_msg_reset(&m, NL_MSG_VERIFY_REQ);
        m.u.verify_req = (nl_msg_verify_req){job, step, mb, 0};
        CHECK_OK(nl_stage_job_input(stages[s], &m, bus_send, &ctx_idx[s], &err), &err);
        packet p;
        if (!pop(&coord_q, &m, &p) || m.type != NL_MSG_VERIFY_CASE) {
            CHECK(0, "stage %d: no VERIFY_CASE", s);
            continue;
        }
        CHECK(m.u.verify_case.stage == (uint32_t)s && m.u.verify_case.microbatch == mb &&
                  m.u.verify_case.config_json[0] == '\0',
              "stage %d: VERIFY_CASE of stage %u microbatch %u", s, m.u.verify_case.stage,
              m.u.verify_case.microbatch);
        /* its hidden states (the input, or on stage 0 the GRADIENT received) */
        wire_bf16_cases += m.frames[s == 0 ? 2 : 1].t.dtype == NL_DTYPE_BF16;
        m.u.verify_case.config_json = cfg_json; /* the coordinator's part */
        char hex[2][NL_HOP_DIGEST_HEX + 1], want[2][NL_HOP_DIGEST_HEX + 1];
        nl_status st = nl_verify_answer(verifier, &m, &out, hex, &err);
        CHECK_OK(st, &err);
        if (st != NL_OK) {
            packet_free(&p);
            continue;
        }
        const uint8_t *g = dig_got[s] + (size_t)mb * NL_DIGEST_KINDS * NL_HOP_DIGEST_BYTES;
        nl_hop_digest_hex(want[0], g + NL_DIGEST_FWD_OUT * NL_HOP_DIGEST_BYTES);
        nl_hop_digest_hex(want[1], g + NL_DIGEST_BWD_OUT * NL_HOP_DIGEST_BYTES);
        const nl_msg_verify_result *r = &out.u.verify_result;
        const bool ok = (s == NST - 1 ? !r->fwd[0] : strcmp(r->fwd, want[0]) == 0) &&
                        (s == 0 ? !r->bwd[0] : strcmp(r->bwd, want[1]) == 0);
        wire_verified++;
        wire_mismatched[s] += !ok;
        if (wire_all && mb == (uint32_t)M - 1) { /* the same case on other weights */
            for (size_t k = 0; k + sizeof(float) <= p.flen[0]; k += sizeof(float)) {
                float w; /* every weight a little larger: m's frame 0 is these bytes */
                memcpy(&w, p.frame[0] + k, sizeof w);
                w *= 1.0f + 0x1p-6f;
                memcpy(p.frame[0] + k, &w, sizeof w);
            }
            st = nl_verify_answer(verifier, &m, &out, hex, &err);
            CHECK_OK(st, &err);
            stale_checked++;
            stale_missed += st != NL_OK || ((s == NST - 1 || strcmp(r->fwd, want[0]) == 0) &&
                                            (s == 0 || strcmp(r->bwd, want[1]) == 0));
        }
        packet_free(&p);
        if (cross_on) {
            cross_checked += 3;
            cross_wrong += !cross_answer(job, step, s, mb, 0.0, want) +
                           cross_answer(job, step, s, mb, 1e-6, want) +
                           !cross_answer(job, step, s, mb, 1e-3, want);
        }
    }
    nl_wire_msg_free(&m);
    nl_wire_msg_free(&out);
}

/* Deliver queued messages to the stages, from a randomly chosen non-empty
 * socket each time, until every stage queue is empty. */
static void pump(int nst)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (;;) {
        int cand[NST * Q_KINDS], n = 0;
        for (int s = 0; s < nst; s++)
            for (int k = 0; k < Q_KINDS; k++)
                if (stage_q[s][k].len)
                    cand[n++] = s * Q_KINDS + k;
        if (!n)
            break;
        int c = cand[nl_rng_below(&rng, (uint64_t)n)];
        packet p;
        nl_error err;
        fifo *f = &stage_q[c / Q_KINDS][c % Q_KINDS];
        const int at = fans && c % Q_KINDS != Q_CTL ? (int)nl_rng_below(&rng, (uint64_t)f->len) : 0;
        if (pop_at(f, at, &m, &p)) {
            CHECK_OK(
                nl_stage_job_input(stages[c / Q_KINDS], &m, bus_send, &ctx_idx[c / Q_KINDS], &err),
                &err);
            packet_free(&p);
        }
    }
    nl_wire_msg_free(&m);
}

/* ---- the stages ---- */

static void make_stages(int nst, const int *bounds, int64_t inject_step, int inject_stage,
                        int replicas)
{
    nl_error err;
    for (int s = 0; s < nst; s++) {
        nl_stage_opts o = {.memory_bytes = 1ULL << 30,
                           .kv_budget = 1 << 20,
                           .send_wait_ms = 100,
                           .ckpt_root = "/nonexistent-root",
                           .inject_nan_step = inject_step,
                           .inject_nan_stage = inject_stage,
                           .lie = s == lie_stage ? test_lie : (nl_stage_lie){0}};
        CHECK_OK(nl_stage_new_replicas(&stages[s], rbe, replicas, NULL, &o, &err), &err);
        nl_msg_assign a = {.epoch = 1,
                           .node_id = 1,
                           .stage = (uint32_t)s,
                           .num_stages = (uint32_t)nst,
                           .layer0 = (uint32_t)bounds[s],
                           .layer1 = (uint32_t)bounds[s + 1],
                           .has_embed = s == 0,
                           .has_head = s + 1 == nst,
                           .config_json = cfg_json,
                           .seed = SEED,
                           .prev_endpoint = "",
                           .prev_key = "",
                           .next_endpoint = "",
                           .next_key = "",
                           .wire = wire_bf16 ? NL_WIRE_BF16 : NL_WIRE_FP32,
                           .prev_keys = fans && s > 0 ? "fan" : NULL,
                           .next_keys = fans && s + 1 < nst ? "fan" : NULL};
        nl_stage_loaded info;
        bool stale;
        CHECK_OK(nl_stage_assign(stages[s], &a, &err), &err);
        CHECK_OK(nl_stage_load_done(stages[s], 1, 0, &info, &stale, &err), &err);
        ctx_idx[s] = s;
    }
}

static void free_stages(int nst)
{
    for (int s = 0; s < nst; s++)
        nl_stage_destroy(&stages[s]);
}

static void begin_job(int nst, uint64_t job, int mbB, int T, int M, int eval_hops, bool recompute)
{
    nl_wire_param ps[7] = {
        {.key = "job", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)job},
        {.key = "micro_batch", .kind = NL_WIRE_PARAM_INT, .i = mbB},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = T},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = M},
        {.key = "eval_hops", .kind = NL_WIRE_PARAM_INT, .i = eval_hops},
        {.key = "recompute", .kind = NL_WIRE_PARAM_BOOL, .b = recompute},
        {.key = "verify_outputs", .kind = NL_WIRE_PARAM_BOOL, .b = cross_on},
    };
    nl_msg_job_submit j = {NL_JOB_TRAIN, 7, ps};
    for (int s = 0; s < nst; s++) {
        uint64_t id = 0;
        nl_error err;
        CHECK_OK(nl_stage_job_begin(stages[s], &j, &id, NULL, &err), &err);
        CHECK(id == job, "job id %llu", (unsigned long long)id);
    }
}

/* Feed a hop of `type` (tokens of microbatch mb, and targets) to stage 0. */
static void feed(uint64_t job, nl_msg_type type, uint64_t step, uint32_t mb, int32_t *tok,
                 int32_t *tgt, int mbB, int T)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, type);
    m.u.hop = (nl_msg_tensor_hop){job, step, mb, 0, 0, 0.0};
    const int64_t sh[2] = {mbB, T};
    nl_wire_frame_set(&m.frames[0], tok, NL_DTYPE_I32, sh, 2);
    m.nframes = 1;
    if (tgt) {
        nl_wire_frame_set(&m.frames[1], tgt, NL_DTYPE_I32, sh, 2);
        m.nframes = 2;
    }
    push(&stage_q[0][Q_CTL], &m);
    nl_wire_msg_free(&m);
}

typedef struct coord_step {
    int norms, have_loss, have_eval;
    double sumsq, ce, aux, eval_ce;
} coord_step;

static void read_reports(coord_step *cs, uint64_t step)
{
    nl_wire_msg m;
    packet p;
    nl_wire_msg_init(&m);
    while (pop(&coord_q, &m, &p)) {
        if (m.type == NL_MSG_GRAD_NORM) {
            CHECK(m.u.grad_norm.step == step, "GRAD_NORM of step %llu",
                  (unsigned long long)m.u.grad_norm.step);
            cs->sumsq += m.u.grad_norm.sumsq;
            cs->norms++;
            if (m.nframes == 1 && m.u.grad_norm.stage < NST &&
                m.frames[0].len <= sizeof dig_got[0]) {
                memcpy(dig_got[m.u.grad_norm.stage], m.frames[0].t.data, m.frames[0].len);
                dig_frames++;
            }
        } else if (m.type == NL_MSG_LOSS && !m.u.loss.eval) {
            cs->ce = m.u.loss.ce_sum;
            cs->aux = m.u.loss.aux;
            cs->have_loss = 1;
        } else if (m.type == NL_MSG_LOSS) {
            cs->eval_ce = m.u.loss.ce_sum;
            cs->have_eval = 1;
        } else {
            CHECK(0, "unexpected %s to the coordinator", nl_wire_type_name(m.type));
        }
        packet_free(&p);
    }
    nl_wire_msg_free(&m);
}

static void random_batch(int32_t *tok, int32_t *tgt, int n)
{
    for (int i = 0; i < n; i++) {
        tok[i] = (int32_t)nl_rng_below(&data_rng, (uint64_t)cfg.vocab_size);
        tgt[i] = (int32_t)nl_rng_below(&data_rng, (uint64_t)cfg.vocab_size);
    }
}

/* Train `steps` steps of B x T in M microbatches on NST stages of
 * `replicas` replicas each and on the whole model in one process; compare.
 * inject: 1-based step with a NaN on stage 1 (0: none). The pipeline's
 * loss and gradient norm of each step go to losses[] and norms[] (NaN when
 * skipped; may be NULL). */
static void parity(int B, int T, int M, int steps, int64_t inject, bool recompute, int replicas,
                   double *losses, double *norms)
{
    nl_error err;
    const int bounds[NST + 1] = {0, 1, 2, 3};
    const int mbB = B / M, rows = mbB * T;
    const uint64_t job = 42;
    const float lr = 3e-3f;
    nl_rng_seed(&data_rng, 1234, 0);
    make_stages(NST, bounds, inject, 1, replicas);
    begin_job(NST, job, mbB, T, M, M, recompute);
    nl_model *whole = NULL;
    nl_trainer *tr = NULL;
    CHECK_OK(nl_model_new(&whole, be, &cfg, 0, cfg.num_layers, 1, 1, &err), &err);
    CHECK_OK(nl_model_init_random(whole, SEED, &err), &err);
    CHECK_OK(nl_trainer_new(&tr, whole, rows, 1, 0, &err), &err);
    int32_t *tok = malloc((size_t)B * T * sizeof *tok), *tgt = malloc((size_t)B * T * sizeof *tgt);
    double worst = 0.0;
    for (int step = 1; step <= steps && tr; step++) {
        random_batch(tok, tgt, B * T);
        nl_step_result r;
        if (step == inject)
            nl_trainer_inject_nan(tr);
        CHECK_OK(
            nl_trainer_step_local(tr, tok, tgt, B, T, M, lr, 1.0f, nl_adamw_defaults(), &r, &err),
            &err);
        for (int mb = 0; M > 1 && mb < M; mb++)
            feed(job, NL_MSG_COUNT, (uint64_t)step, (uint32_t)mb, tok + mb * rows, NULL, mbB, T);
        for (int mb = 0; mb < M; mb++)
            feed(job, NL_MSG_ACTIVATION, (uint64_t)step, (uint32_t)mb, tok + mb * rows,
                 tgt + mb * rows, mbB, T);
        pump(NST);
        coord_step cs = {0};
        read_reports(&cs, (uint64_t)step);
        CHECK(cs.norms == NST && cs.have_loss, "step %d: %d norms, loss %d", step, cs.norms,
              cs.have_loss);
        const double loss = cs.ce / ((double)B * T) + cfg.aux_loss_coef * cs.aux;
        const int skip = !isfinite(loss) || !isfinite(cs.sumsq);
        if (losses)
            losses[step - 1] = skip ? NAN : loss;
        if (norms)
            norms[step - 1] = skip ? NAN : sqrt(cs.sumsq);
        CHECK(skip == r.skipped, "step %d: skipped %d here, %d locally", step, skip, r.skipped);
        if (!skip) {
            const double rel = fabs(loss - r.loss) / fabs(r.loss);
            worst = rel > worst ? rel : worst;
            CHECK(rel < 1e-5, "step %d: loss %.9g vs local %.9g", step, loss, r.loss);
            CHECK(fabs(sqrt(cs.sumsq) - r.grad_norm) <= 1e-4 * r.grad_norm,
                  "step %d: grad norm %.9g vs %.9g", step, sqrt(cs.sumsq), r.grad_norm);
        }
        const double norm = sqrt(cs.sumsq), clip = 1.0 / (norm + 1e-6);
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_STEP);
        m.u.step =
            (nl_msg_step){job, (uint64_t)step, !skip, skip ? 0.0 : (clip < 1 ? clip : 1), lr};
        for (int s = 0; s < NST; s++)
            push(&stage_q[s][Q_CTL], &m);
        nl_wire_msg_free(&m);
        /* the next step's hops now race the STEP on the later stages */
    }
    pump(NST);
    /* an evaluation through the pipeline equals the local held-out loss */
    random_batch(tok, tgt, B * T);
    double local_ce = 0.0;
    nl_trainer_begin_step(tr, (int64_t)B * T);
    for (int mb = 0; mb < M; mb++)
        CHECK_OK(nl_trainer_forward(tr, 0, mbB, T, tok + mb * rows, NULL, tgt + mb * rows,
                                    &local_ce, NULL, &err),
                 &err);
    for (int mb = 0; mb < M; mb++)
        feed(job, NL_MSG_EVAL, (uint64_t)steps, (uint32_t)mb, tok + mb * rows, tgt + mb * rows, mbB,
             T);
    pump(NST);
    coord_step cs = {0};
    read_reports(&cs, (uint64_t)steps);
    CHECK(cs.have_eval && fabs(cs.eval_ce - local_ce) <= 1e-5 * local_ce,
          "eval ce %.9g vs local %.9g", cs.eval_ce, local_ce);
    /* the weights */
    double wrst = 0.0;
    for (int s = 0; s < NST; s++) {
        const nl_model *m = nl_stage_model(stages[s]);
        for (int i = 0; m && i < m->n_table; i++) {
            const nl_param *p = &m->table[i];
            const nl_param *q = nl_model_find_param(whole, p->name);
            const size_t n = nl_param_numel(p);
            float *got = check_download(be, nl_model_param_data(m, p), n);
            float *want = q ? check_download(be, nl_model_param_data(whole, q), n) : NULL;
            double e = got && want ? check_rel_err(got, want, n) : 1.0;
            free(got);
            free(want);
            wrst = e > wrst ? e : wrst;
            CHECK(e < 1e-5, "%s: relative error %g", p->name, e);
        }
    }
    printf("parity M=%d%s%s, %d replica%s: worst loss rel err %.2e, weights %.2e\n", M,
           inject ? " (NaN injected)" : "", recompute ? " (recompute)" : "", replicas,
           replicas == 1 ? "" : "s", worst, wrst);
    free(tok);
    free(tgt);
    nl_trainer_destroy(&tr);
    nl_model_destroy(&whole);
    free_stages(NST);
}

/* Issue 15, finding 9: a previous stage that floods hops. Hidden states
 * for a step past the next one are refused; for the next step, with an
 * evaluation of 2^30 hops allowed (the count bound is then no bound), the
 * queue stops at its byte bound (64 MiB) instead of exhausting memory. */
static void flood(void)
{
    nl_error err;
    const int bounds[NST + 1] = {0, 1, 2, 3};
    const uint64_t job = 7;
    make_stages(NST, bounds, 0, -1, 1);
    begin_job(NST, job, 2, 4, 2, 1 << 30, false);
    static float x[2 * 4 * 32];
    static int32_t tgt[8];
    const int64_t xs[3] = {2, 4, cfg.hidden_dim}, ts[2] = {2, 4};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){job, 3, 0, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], x, NL_DTYPE_F32, xs, 3);
    nl_wire_frame_set(&m.frames[1], tgt, NL_DTYPE_I32, ts, 2);
    m.frames[0].len = (size_t)(8 * cfg.hidden_dim) * sizeof(float);
    m.frames[1].len = sizeof tgt;
    m.nframes = 2;
    CHECK(cfg.hidden_dim <= 32, "hidden_dim %d", cfg.hidden_dim);
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_STATE &&
              strstr(err.msg, "ahead"),
          "a hop two steps ahead: %s", err.msg);
    m.u.hop.step = 2; /* the step after the next: may overtake a STEP, and waits */
    x[5] = NAN;
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_RANGE &&
              strstr(err.msg, "non-finite"),
          "a NaN in the hidden states: %s", err.msg);
    x[5] = 0.0f;
    nl_status st = NL_OK;
    int n = 0;
    while (n < 200000 &&
           (st = nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err)) == NL_OK)
        n++;
    CHECK(st == NL_ERR_LIMIT && strstr(err.msg, "bytes") && n > 1000 && n < 70000,
          "a flood of %d hops: %s", n, st == NL_OK ? "accepted" : err.msg);
    nl_wire_msg_free(&m);
    free_stages(NST);
}

static void refusals(void)
{
    nl_error err;
    const int bounds[NST + 1] = {0, 1, 2, 3};
    const uint64_t job = 5;
    make_stages(NST, bounds, 0, -1, 1);
    begin_job(NST, job, 2, 4, 2, 0, false);
    int32_t tok[12] = {0}, tgt[12] = {0};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    const int64_t bad[2] = {3, 4}, ok[2] = {2, 4};
    /* wrong shape */
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){job, 1, 0, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], tok, NL_DTYPE_I32, bad, 2);
    nl_wire_frame_set(&m.frames[1], tgt, NL_DTYPE_I32, bad, 2);
    m.nframes = 2;
    m.frames[0].len = m.frames[1].len = 3 * 4 * sizeof(int32_t); /* tok and tgt are big enough */
    CHECK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_SHAPE,
          "wrong shape: %s", err.msg);
    /* another job */
    nl_wire_frame_set(&m.frames[0], tok, NL_DTYPE_I32, ok, 2);
    nl_wire_frame_set(&m.frames[1], tgt, NL_DTYPE_I32, ok, 2);
    m.frames[0].len = m.frames[1].len = 8 * sizeof(int32_t);
    m.u.hop.job_id = 6;
    CHECK(!nl_stage_job_holds(stages[0], &m) &&
              nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_STATE &&
              strstr(err.msg, "job 6"),
          "another job (stale): %s", err.msg);
    /* this job's hop from a former plan (epoch 0 of make_stages' 1 is an
     * unstamped hop, taken): not held, so the node drops it */
    m.u.hop.job_id = job;
    m.u.train_hop.epoch = 2;
    CHECK(!nl_stage_job_holds(stages[0], &m) &&
              nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_STATE &&
              strstr(err.msg, "epoch 2"),
          "a former plan's hop: %s", err.msg);
    m.u.train_hop.epoch = 1;
    CHECK(nl_stage_job_holds(stages[0], &m), "this plan's hop is held");
    m.u.train_hop.epoch = 0;
    /* microbatch out of range */
    m.u.hop.job_id = job;
    m.u.hop.step = 1;
    m.u.hop.microbatch = 2;
    CHECK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_RANGE,
          "microbatch 2 of 2: %s", err.msg);
    /* the counting pass of microbatch 1 before 0: refused */
    m.type = NL_MSG_COUNT;
    m.u.hop.microbatch = 1;
    CHECK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_STATE &&
              strstr(err.msg, "next is 0"),
          "out of order: %s", err.msg);
    m.type = NL_MSG_ACTIVATION;
    /* a GRADIENT before any forward */
    float g[2 * 4 * 32] = {0};
    const int64_t gs[3] = {2, 4, 32};
    nl_wire_msg_reset(&m, NL_MSG_GRADIENT);
    m.u.hop = (nl_msg_tensor_hop){job, 1, 0, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], g, NL_DTYPE_F32, gs, 3);
    m.frames[0].len = sizeof g;
    m.nframes = 1;
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_STATE,
          "early GRADIENT: %s", err.msg);
    /* a STEP before the gradients */
    nl_wire_msg_reset(&m, NL_MSG_STEP);
    m.u.step = (nl_msg_step){job, 1, true, 1.0, 1e-3};
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_STATE,
          "early STEP: %s", err.msg);
    /* checkpoints outside --checkpoint-root, or with .. */
    nl_wire_msg_reset(&m, NL_MSG_CKPT_REQ);
    m.u.ckpt_req = (nl_msg_ckpt_req){job, 0, "/tmp/elsewhere"};
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_AUTH &&
              strstr(err.msg, "checkpoint-root"),
          "outside the root: %s", err.msg);
    m.u.ckpt_req.dir = "/nonexistent-root/../etc";
    CHECK(nl_stage_job_input(stages[1], &m, bus_send, &ctx_idx[1], &err) == NL_ERR_INVALID,
          "dot-dot: %s", err.msg);
    /* moments asked for but none loaded */
    nl_wire_param ps[5] = {
        {.key = "job", .kind = NL_WIRE_PARAM_INT, .i = 9},
        {.key = "micro_batch", .kind = NL_WIRE_PARAM_INT, .i = 2},
        {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 4},
        {.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = 1},
        {.key = "moments", .kind = NL_WIRE_PARAM_BOOL, .b = true},
    };
    nl_msg_job_submit j = {NL_JOB_TRAIN, 5, ps};
    uint64_t id = 0;
    CHECK(nl_stage_job_begin(stages[0], &j, &id, NULL, &err) == NL_ERR_STATE && id == 9,
          "moments without any: %s", err.msg);
    ps[4].key = "seq";
    ps[4].kind = NL_WIRE_PARAM_INT;
    ps[4].i = cfg.max_seq_len + 1;
    j.nparams = 4;
    ps[2] = ps[4];
    CHECK(nl_stage_job_begin(stages[0], &j, &id, NULL, &err) == NL_ERR_RANGE, "seq past max: %s",
          err.msg);
    CHECK(nl_stage_job_end(stages[0], job) >= 0, "a refused begin dropped the running job");
    CHECK(nl_stage_job_end(stages[1], job) >= 0 && !nl_stage_train_running(stages[1], NULL),
          "end of the job");
    nl_wire_msg_free(&m);
    free_stages(NST);
    flood();
}

/* Hops and gradients from neighbours with other replica counts come in
 * any order: each stage runs them in microbatch order (a gradient before
 * its turn waits), so every step's loss and gradient norm are those of
 * the run in order, to the bit. */
static void fans_in_any_order(int B, int T, int M, int steps)
{
    double l0[8], n0[8], l1[8], n1[8];
    parity(B, T, M, steps, 0, false, 1, l0, n0);
    fans = true;
    parity(B, T, M, steps, 0, false, 1, l1, n1);
    fans = false;
    int same = 1;
    for (int k = 0; k < steps; k++)
        same &= l0[k] == l1[k] && n0[k] == n1[k];
    CHECK(same, "hops in any order changed a loss or norm");
    printf("hops and gradients in any order, M=%d: every step's loss the same bits\n", M);
}

/* The same pipeline and batches on 1 and on `replicas` replicas per stage:
 * every step's loss and gradient norm within 1e-6 (relative). */
static void replicas_agree(int B, int T, int M, int steps, int64_t inject, bool recompute,
                           int replicas)
{
    double l1[8], n1[8], lr[8], nr[8];
    parity(B, T, M, steps, inject, recompute, 1, l1, n1);
    parity(B, T, M, steps, inject, recompute, replicas, lr, nr);
    double worst = 0.0;
    for (int i = 0; i < steps; i++) {
        CHECK(isnan(l1[i]) == isnan(lr[i]), "step %d: skipped with 1 replica %d, with %d %d", i + 1,
              isnan(l1[i]), replicas, isnan(lr[i]));
        if (isnan(l1[i]) || isnan(lr[i]))
            continue;
        const double el = fabs(lr[i] - l1[i]) / fabs(l1[i]), en = fabs(nr[i] - n1[i]) / n1[i];
        worst = el > worst ? el : worst;
        worst = en > worst ? en : worst;
        CHECK(el <= 1e-6, "step %d, %d replicas: loss %.9g vs %.9g with one (%.2e)", i + 1,
              replicas, lr[i], l1[i], el);
        CHECK(en <= 1e-6, "step %d, %d replicas: gradient norm %.9g vs %.9g with one (%.2e)", i + 1,
              replicas, nr[i], n1[i], en);
    }
    printf("replicas M=%d%s%s: %d replicas against 1, worst relative difference %.2e\n", M,
           inject ? " (NaN injected)" : "", recompute ? " (recompute)" : "", replicas, worst);
}

/* ---- hop digests ---- */

static const uint8_t *dig_at(const uint8_t *d, int mb, int kind)
{
    return d + ((size_t)mb * NL_DIGEST_KINDS + (size_t)kind) * NL_HOP_DIGEST_BYTES;
}

/* `steps` steps of a 3-stage job with M microbatches and the same batches
 * every run; out gets each step's digests [steps][NST][sizeof dig_got[0]];
 * the hops fed to stage 0 are digested here into fed [steps][M][32]. */
static void digest_run(int steps, int M, uint8_t *out, uint8_t *fed)
{
    const int bounds[NST + 1] = {0, 1, 2, 3};
    const int mbB = 2, T = 8, rows = mbB * T, B = mbB * M;
    const uint64_t job = 77;
    nl_rng_seed(&data_rng, 4321, 0);
    make_stages(NST, bounds, 0, -1, 1);
    begin_job(NST, job, mbB, T, M, 0, false);
    int32_t *tok = malloc((size_t)B * T * sizeof *tok), *tgt = malloc((size_t)B * T * sizeof *tgt);
    for (int step = 1; step <= steps && tok && tgt; step++) {
        random_batch(tok, tgt, B * T);
        for (int mb = 0; mb < M; mb++)
            feed(job, NL_MSG_COUNT, (uint64_t)step, (uint32_t)mb, tok + mb * rows, NULL, mbB, T);
        for (int mb = 0; mb < M; mb++) {
            feed(job, NL_MSG_ACTIVATION, (uint64_t)step, (uint32_t)mb, tok + mb * rows,
                 tgt + mb * rows, mbB, T);
            nl_wire_msg m; /* the digest stage 0 must have recorded */
            nl_wire_msg_init(&m);
            nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
            m.u.hop = (nl_msg_tensor_hop){job, (uint64_t)step, (uint32_t)mb, 0, 0, 0.0};
            const int64_t sh[2] = {mbB, T};
            nl_wire_frame_set(&m.frames[0], tok + mb * rows, NL_DTYPE_I32, sh, 2);
            nl_wire_frame_set(&m.frames[1], tgt + mb * rows, NL_DTYPE_I32, sh, 2);
            m.nframes = 2;
            nl_hop_digest(fed + ((size_t)(step - 1) * M + mb) * NL_HOP_DIGEST_BYTES, &m, 0);
            nl_wire_msg_free(&m);
        }
        pump(NST);
        coord_step cs = {0};
        dig_frames = 0;
        read_reports(&cs, (uint64_t)step);
        CHECK(cs.norms == NST && dig_frames == NST, "step %d: %d norms, %d with digests", step,
              cs.norms, dig_frames);
        memcpy(out + (size_t)(step - 1) * sizeof dig_got, dig_got, sizeof dig_got);
        if (verify_on) {
            verify_step(job, (uint64_t)step, M);
            verify_wire(job, (uint64_t)step, M);
        }
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_STEP);
        m.u.step = (nl_msg_step){job, (uint64_t)step, true, 1.0, 3e-3};
        for (int s = 0; s < NST; s++)
            push(&stage_q[s][Q_CTL], &m);
        nl_wire_msg_free(&m);
    }
    pump(NST);
    free(tok);
    free(tgt);
    free_stages(NST);
}

/* The reports of one step agree: each hop's digest at its sender is the
 * one at its receiver, those that exist are set and the others zero;
 * stage 0's inputs are what was fed. */
static void digests_agree(const uint8_t *d, const uint8_t *fed, int M, int step)
{
    static const uint8_t zero[NL_HOP_DIGEST_BYTES];
    for (int mb = 0; mb < M; mb++) {
        for (int s = 0; s < NST; s++) {
            const uint8_t *g = d + (size_t)s * sizeof dig_got[0];
            const bool first = s == 0, last = s == NST - 1;
            CHECK(!nl_hop_digest_none(dig_at(g, mb, NL_DIGEST_FWD_IN)) &&
                      nl_hop_digest_none(dig_at(g, mb, NL_DIGEST_FWD_OUT)) == last &&
                      nl_hop_digest_none(dig_at(g, mb, NL_DIGEST_BWD_IN)) == last &&
                      nl_hop_digest_none(dig_at(g, mb, NL_DIGEST_BWD_OUT)) == first,
                  "step %d stage %d microbatch %d: digests missing or where no hop was", step, s,
                  mb);
            if (last)
                continue;
            const uint8_t *h = g + sizeof dig_got[0];
            CHECK(memcmp(dig_at(g, mb, NL_DIGEST_FWD_OUT), dig_at(h, mb, NL_DIGEST_FWD_IN), 32) ==
                          0 &&
                      memcmp(dig_at(h, mb, NL_DIGEST_BWD_OUT), dig_at(g, mb, NL_DIGEST_BWD_IN),
                             32) == 0,
                  "step %d microbatch %d: stages %d and %d report other digests of their hops",
                  step, mb, s, s + 1);
        }
        CHECK(memcmp(dig_at(d, mb, NL_DIGEST_FWD_IN), fed + (size_t)mb * 32, 32) == 0 &&
                  memcmp(zero, fed + (size_t)mb * 32, 32) != 0,
              "step %d microbatch %d: stage 0's input digest is not that of what it was fed", step,
              mb);
    }
}

static void digests(void)
{
    enum { STEPS = 3, M = 4 };
    const size_t per = sizeof dig_got, fper = (size_t)M * NL_HOP_DIGEST_BYTES;
    uint8_t *a = calloc(STEPS, per), *b = calloc(STEPS, per), *fa = calloc(STEPS, fper),
            *fb = calloc(STEPS, fper);
    if (!a || !b || !fa || !fb) {
        CHECK(0, "out of memory");
        goto out;
    }
    lie_stage = -1;
    digest_run(STEPS, M, a, fa);
    digest_run(STEPS, M, b, fb);
    for (int st = 0; st < STEPS; st++)
        digests_agree(a + st * per, fa + st * fper, M, st + 1);
    CHECK(memcmp(a, b, STEPS * per) == 0, "two runs of the same steps report other digests");
    /* a hop whose bytes are not those its digest was made over */
    {
        const int bounds[NST + 1] = {0, 1, 2, 3};
        int32_t tok[16] = {0}, tgt[16] = {0};
        char hex[NL_HOP_DIGEST_HEX + 1];
        nl_error err;
        make_stages(NST, bounds, 0, -1, 1);
        begin_job(NST, 78, 2, 8, 1, 0, false);
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
        m.u.hop = (nl_msg_tensor_hop){78, 1, 0, 0, 0, 0.0};
        const int64_t sh[2] = {2, 8};
        nl_wire_frame_set(&m.frames[0], tok, NL_DTYPE_I32, sh, 2);
        nl_wire_frame_set(&m.frames[1], tgt, NL_DTYPE_I32, sh, 2);
        m.nframes = 2;
        nl_hop_digest_set(&m, 0, hex, NULL);
        tok[3] = 1;
        CHECK(nl_stage_job_input(stages[0], &m, bus_send, &ctx_idx[0], &err) == NL_ERR_INTEGRITY,
              "a hop that does not match its digest: %s", err.msg);
        nl_wire_msg_free(&m);
        free_stages(NST);
    }
#ifdef NL_TEST_HOOKS
    /* each lie on stage 1: what it sends differs on some microbatches,
     * its neighbours agree with it (the wire cannot tell: a recompute can) */
    static const char *const kinds[] = {"bitflip", "noise", "stale", "skip", "backward"};
    for (int k = 0; k < 5; k++) {
        test_lie = (nl_stage_lie){(nl_lie_kind)nl_stage_lie_kind(kinds[k]), 0.5, 3, 0, false};
        lie_stage = 1;
        digest_run(STEPS, M, b, fb);
        int fwd_diff = 0, bwd_diff = 0;
        for (int st = 0; st < STEPS; st++) {
            digests_agree(b + st * per, fb + st * fper, M, st + 1);
            const uint8_t *ha = a + st * per + sizeof dig_got[0],
                          *hb = b + st * per + sizeof dig_got[0];
            for (int mb = 0; mb < M; mb++) {
                fwd_diff += memcmp(dig_at(ha, mb, NL_DIGEST_FWD_OUT),
                                   dig_at(hb, mb, NL_DIGEST_FWD_OUT), 32) != 0;
                bwd_diff += memcmp(dig_at(ha, mb, NL_DIGEST_BWD_OUT),
                                   dig_at(hb, mb, NL_DIGEST_BWD_OUT), 32) != 0;
            }
        }
        const bool backward = test_lie.kind == NL_LIE_BACKWARD;
        /* step 1's forwards of a backward liar are honest */
        int fwd1 = 0;
        for (int mb = 0; mb < M; mb++)
            fwd1 += memcmp(dig_at(a + sizeof dig_got[0], mb, NL_DIGEST_FWD_OUT),
                           dig_at(b + sizeof dig_got[0], mb, NL_DIGEST_FWD_OUT), 32) != 0;
        CHECK((backward ? bwd_diff : fwd_diff) > 0 && (!backward || fwd1 == 0),
              "lie %s: %d forwards and %d backwards differ from the honest run (step 1's "
              "forwards: %d)",
              kinds[k], fwd_diff, bwd_diff, fwd1);
        printf("lie %s at q=0.5: %d of %d forwards and %d backwards of stage 1 differ\n", kinds[k],
               fwd_diff, STEPS * M, bwd_diff);
    }
    lie_stage = -1;
#endif
    printf("digests: %d steps of %d microbatches agree at both ends of every hop, run to run\n",
           STEPS, M);
out:
    free(a);
    free(b);
    free(fa);
    free(fb);
}

/* What a verifier keeps (node/stage_verify_worker.c): every microbatch of every
 * stage of STEPS steps over the wire to a verifier with a backend of its
 * own (its cases run on its worker thread), answered with the stage's
 * digests; it builds each stage once for the job and loads each stage's
 * weights once a step (its cases share them, the next step's are new),
 * once more for the case with its weights changed, whose answer is not the
 * report (the weights kept are never used for a case that brings other
 * ones), and the next step's first case loads its own again; after
 * nl_stage_verify_forget it builds again. */
static void verifier_keeps(void)
{
    enum { STEPS = 3, M = 4 };
    uint8_t *a = calloc(STEPS, sizeof dig_got), *fa = calloc(STEPS, (size_t)M * 32);
    nl_error err;
    nl_backend *vbe = NULL;
    CHECK_OK(check_backend_new(&vbe, 1, &err), &err);
    nl_stage_opts vo = {
        .memory_bytes = 1ULL << 30, .kv_budget = 1 << 20, .send_wait_ms = 100, .verify_be = vbe};
    if (vbe)
        CHECK_OK(nl_stage_new(&verifier, rbe[1], &vo, &err), &err);
    verify_on = wire_all = verifier != NULL;
    lie_stage = -1;
    verified = wire_verified = stale_checked = stale_missed = 0;
    memset(wire_mismatched, 0, sizeof wire_mismatched);
    if (verify_on && a && fa)
        digest_run(STEPS, M, a, fa);
    nl_verify_stats vs = {0};
    if (verifier)
        nl_stage_verify_stats(verifier, &vs);
    CHECK(wire_verified == STEPS * M * NST && !wire_mismatched[0] && !wire_mismatched[1] &&
              !wire_mismatched[2],
          "kept builds: %d verified, accused %d %d %d", wire_verified, wire_mismatched[0],
          wire_mismatched[1], wire_mismatched[2]);
    CHECK(stale_checked == STEPS * NST && !stale_missed,
          "a case with its weights changed answered as the stage's report %d times of %d",
          stale_missed, stale_checked);
    CHECK(vs.cases == (uint64_t)(STEPS * (M + 1) * NST) && vs.builds == NST &&
              vs.loads == (uint64_t)(2 * STEPS * NST),
          "the verifier redid %llu cases, built %llu stages, loaded weights %llu times (want "
          "%d, %d, %d)",
          (unsigned long long)vs.cases, (unsigned long long)vs.builds, (unsigned long long)vs.loads,
          STEPS * (M + 1) * NST, NST, 2 * STEPS * NST);
    printf("verifier: %llu cases on its own thread, %llu builds, %llu weight loads\n",
           (unsigned long long)vs.cases, (unsigned long long)vs.builds,
           (unsigned long long)vs.loads);
    /* what it keeps dropped (a new plan, the job's end): built again */
    if (verifier && a && fa) {
        nl_stage_verify_forget(verifier);
        digest_run(1, M, a, fa);
        nl_stage_verify_stats(verifier, &vs);
        CHECK(vs.builds == 2 * NST && !wire_mismatched[0] && !wire_mismatched[1] &&
                  !wire_mismatched[2],
              "after forgetting: %llu builds (want %d), accused %d %d %d",
              (unsigned long long)vs.builds, 2 * NST, wire_mismatched[0], wire_mismatched[1],
              wire_mismatched[2]);
    }
    verify_on = wire_all = false;
    nl_stage_destroy(&verifier);
    nl_backend_destroy(&vbe);
    free(a);
    free(fa);
}

/* Verification by recompute (stage_verify.h): every microbatch of every
 * stage redone on another backend from the stage's kept inputs and its
 * weights at the step's start gives the digests the stage reported, for
 * an honest pipeline (no stage ever accused: a digest over padding or
 * uninitialised bytes would differ); with a lying stage 1, exactly it is
 * accused (its neighbours compute honestly on what they got), in the
 * direction it lies. */
static void recompute(void)
{
    enum { STEPS = 3, HONEST = 17, M = 4 }; /* 17 x 4 x 3 = 204 redone when honest */
    uint8_t *a = calloc(HONEST, sizeof dig_got), *fa = calloc(HONEST, (size_t)M * 32);
    nl_error err;
    nl_stage_opts vo = {.memory_bytes = 1ULL << 30, .kv_budget = 1 << 20, .send_wait_ms = 100};
    CHECK_OK(nl_stage_new(&verifier, rbe[1], &vo, &err), &err);
    verify_on = verifier != NULL;
    cross_on = verify_on; /* the honest run checks the tolerance too */
    lie_stage = -1;
    verified = wire_verified = cross_checked = cross_wrong = 0;
    memset(mismatched, 0, sizeof mismatched);
    memset(wire_mismatched, 0, sizeof wire_mismatched);
    if (a && fa)
        digest_run(HONEST, M, a, fa);
    CHECK(wire_verified == HONEST * NST && !wire_mismatched[0] && !wire_mismatched[1] &&
              !wire_mismatched[2],
          "honest over the wire: %d verified, accused %d %d %d", wire_verified, wire_mismatched[0],
          wire_mismatched[1], wire_mismatched[2]);
    CHECK(verified == HONEST * M * NST && !mismatched[0] && !mismatched[1] && !mismatched[2],
          "honest: %d redone, accused %d %d %d", verified, mismatched[0], mismatched[1],
          mismatched[2]);
    CHECK(cross_checked == 3 * HONEST * NST && !cross_wrong,
          "across device classes: %d of %d answers wrong", cross_wrong, cross_checked);
    cross_on = false;
    printf("recompute: %d honest (stage, microbatch) redone, none accused; %d answers across "
           "device classes as the tolerance says\n",
           verified, cross_checked);
#ifdef NL_TEST_HOOKS
    static const char *const kinds[] = {"bitflip", "noise", "stale", "skip", "backward"};
    for (int k = 0; k < 5 && a && fa; k++) {
        test_lie = (nl_stage_lie){(nl_lie_kind)nl_stage_lie_kind(kinds[k]), 0.5, 3, 0, false};
        lie_stage = 1;
        memset(mismatched, 0, sizeof mismatched);
        memset(mismatch_fwd, 0, sizeof mismatch_fwd);
        memset(mismatch_bwd, 0, sizeof mismatch_bwd);
        memset(wire_mismatched, 0, sizeof wire_mismatched);
        digest_run(STEPS, M, a, fa);
        CHECK(!wire_mismatched[0] && !wire_mismatched[2],
              "lie %s on stage 1: an honest stage accused over the wire (%d, %d)", kinds[k],
              wire_mismatched[0], wire_mismatched[2]);
        const bool backward = test_lie.kind == NL_LIE_BACKWARD;
        const bool both = test_lie.kind == NL_LIE_BITFLIP; /* lies in either direction */
        CHECK(mismatched[1] > 0 && !mismatched[0] && !mismatched[2] &&
                  (both || (backward ? mismatch_fwd[1] == 0 : mismatch_bwd[1] == 0)),
              "lie %s on stage 1: accused %d %d %d (stage 1: %d forwards, %d backwards)", kinds[k],
              mismatched[0], mismatched[1], mismatched[2], mismatch_fwd[1], mismatch_bwd[1]);
        printf("recompute: lie %s on stage 1 caught on %d of %d microbatches\n", kinds[k],
               mismatched[1], STEPS * M);
    }
    lie_stage = -1;
    /* the bf16 wire: the cases are the bf16 bytes sent, the verifier
     * rounds its outputs as the stage did: bit for bit when honest, and a
     * flip of a bit that the wire keeps is found */
    wire_bf16 = true;
    wire_bf16_cases = verified = wire_verified = 0;
    memset(mismatched, 0, sizeof mismatched);
    memset(wire_mismatched, 0, sizeof wire_mismatched);
    if (a && fa)
        digest_run(STEPS, M, a, fa);
    CHECK(wire_bf16_cases == STEPS * NST && wire_verified == STEPS * NST &&
              verified == STEPS * M * NST && !mismatched[0] && !mismatched[1] && !mismatched[2] &&
              !wire_mismatched[0] && !wire_mismatched[1] && !wire_mismatched[2],
          "bf16 wire, honest: %d of %d cases in bf16, accused %d %d %d (wire %d %d %d)",
          wire_bf16_cases, wire_verified, mismatched[0], mismatched[1], mismatched[2],
          wire_mismatched[0], wire_mismatched[1], wire_mismatched[2]);
    test_lie = (nl_stage_lie){NL_LIE_BITFLIP, 0.5, 3, 0, false};
    lie_stage = 1;
    memset(mismatched, 0, sizeof mismatched);
    memset(wire_mismatched, 0, sizeof wire_mismatched);
    if (a && fa)
        digest_run(STEPS, M, a, fa);
    CHECK(mismatched[1] > 0 && !mismatched[0] && !mismatched[2] && !wire_mismatched[0] &&
              !wire_mismatched[2],
          "bf16 wire, lie bitflip on stage 1: accused %d %d %d", mismatched[0], mismatched[1],
          mismatched[2]);
    printf("recompute on the bf16 wire: %d honest (stage, microbatch) redone, none accused; a "
           "bit flip on stage 1 caught on %d of %d microbatches\n",
           STEPS * M * NST, mismatched[1], STEPS * M);
    lie_stage = -1;
    wire_bf16 = false;
#endif
    verify_on = false;
    nl_stage_destroy(&verifier);
    free(a);
    free(fa);
}

int main(void)
{
    nl_error err;
    nl_log_set_name("test_stage_train");
    nl_log_set_level(NL_LOG_ERROR);
    nl_rng_seed(&rng, 7, 0);
    nl_config_init(&cfg);
    cfg.hidden_dim = 32;
    cfg.num_layers = 3;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    cfg.ffn_dim = 48;
    cfg.num_experts = 4;
    cfg.vocab_size = 300;
    cfg.vocab_chunk = 128;
    cfg.max_seq_len = 32;
    CHECK_OK(nl_config_validate(&cfg, 1, &err), &err);
    cfg_json = nl_config_to_json(&cfg);
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    rbe[0] = be;
    for (int r = 1; r < MAXREP; r++)
        CHECK_OK(check_backend_new(&rbe[r], 2, &err), &err);
    if (be && rbe[MAXREP - 1] && cfg_json) {
        parity(8, 8, 4, 5, 0, false, 1, NULL, NULL);
        parity(4, 8, 1, 3, 0, false, 1, NULL, NULL);
        parity(8, 8, 4, 3, 0, true, 1, NULL, NULL);  /* per-layer recompute on every stage */
        parity(8, 8, 4, 4, 2, false, 1, NULL, NULL); /* the guard */
        refusals();
        digests();
        recompute();
        verifier_keeps();
        fans_in_any_order(8, 8, 4, 5);
        replicas_agree(8, 8, 4, 5, 0, false, 2);
        replicas_agree(12, 8, 6, 4, 0, false, 3); /* uneven shares: 2, 2, 2 of 6; slots 3 of 3 */
        replicas_agree(8, 8, 4, 3, 0, true, 3);   /* 2, 1, 1 of 4 with recompute */
        replicas_agree(4, 8, 1, 3, 0, false, 2);  /* one microbatch: replica 1 idle */
        replicas_agree(8, 8, 4, 4, 2, false, 2);  /* the guard on a replica's gradients */
    }
    for (int r = MAXREP - 1; r >= 1; r--)
        nl_backend_destroy(&rbe[r]);
    nl_backend_destroy(&be);
    free(cfg_json);
    return check_done("test_stage_train");
}
