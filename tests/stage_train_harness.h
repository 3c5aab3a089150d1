/* The harness of the distributed training tests on stages in one process,
 * without sockets (test_stage_train.c: parity with local training, the
 * refusals, the orders of delivery, replicas, hop digests;
 * test_stage_verify.c: verification by recompute of whole pipelines). Every
 * message a stage sends goes through the real wire codec (encoded, then
 * decoded on delivery) into the queue of the socket it would travel on; a
 * test "coordinator" feeds the microbatches, sums the gradient norms and
 * decides each step as neurocoord does. Deliveries from different sockets
 * are interleaved at random, so hops of the next step overtake the STEP of
 * this one. digest_run redoes the steps it runs when verify_on is set: on
 * rbe[1] from each stage's kept case, and over the wire to a verifier stage.
 * Header-only, as check.h is: its CHECKs count in the program that includes
 * it. */
#ifndef NL_TEST_STAGE_TRAIN_HARNESS_H
#define NL_TEST_STAGE_TRAIN_HARNESS_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/model/rng.h"
#include "net/hopdigest.h"
#include "net/wire.h"
#include "node/stage.h"
#include "node/stage_verify.h"
#include "tests/check.h"
#include "tests/small_config.h"
#include "tests/wire_fifo.h"

#define SEED 99
#define NST 3

#define MAXREP 3

static nl_backend *be, *rbe[MAXREP]; /* rbe[0] == be: the replicas' backends */
static nl_config cfg;
static char *cfg_json;

/* ---- a message bus: one FIFO per socket, messages stored encoded ---- */

enum { Q_CTL, Q_DATA, Q_NEXT, Q_KINDS }; /* a stage's inputs: control, data, next */

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

static nl_rng order_rng; /* the order of deliveries */
static nl_rng data_rng;  /* the batches: the same for every run of parity() */

/* Neighbours with other replica counts (fans_in_any_order): every stage
 * is told its neighbours are fans (ASSIGN prev_keys, next_keys), and the
 * data and next sockets deliver their hops in any order, as several
 * replicas of a neighbour would send them. */
static bool fans;

/* The stage whose sends to the next stage fail, as to a node that died
 * (-1: none), and the checkpoint root make_stages gives the stages. */
static int next_gone = -1;
static const char *ckpt_root = "/nonexistent-root";

static inline nl_status bus_send(void *ctx, nl_stage_dest to, nl_wire_msg *m, nl_error *err)
{
    int s = *(int *)ctx;
    if (to == NL_STAGE_TO_NEXT && s == next_gone)
        return nl_error_set(err, NL_ERR_NOTFOUND, "cannot reach the next stage: peer is gone");
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
static inline int cross_answer(uint64_t job, uint64_t step, int s, uint32_t mb, double by,
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
    char hex[3][NL_HOP_DIGEST_HEX + 1];
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
static inline void verify_step(uint64_t job, uint64_t step, int M)
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

static inline void verify_wire(uint64_t job, uint64_t step, int M)
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
        char hex[3][NL_HOP_DIGEST_HEX + 1], want[2][NL_HOP_DIGEST_HEX + 1];
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
static inline void pump(int nst)
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
        int c = cand[nl_rng_below(&order_rng, (uint64_t)n)];
        packet p;
        nl_error err;
        fifo *f = &stage_q[c / Q_KINDS][c % Q_KINDS];
        const int at =
            fans && c % Q_KINDS != Q_CTL ? (int)nl_rng_below(&order_rng, (uint64_t)f->len) : 0;
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

static inline void make_stages(int nst, const int *bounds, int64_t inject_step, int inject_stage,
                               int replicas)
{
    nl_error err;
    for (int s = 0; s < nst; s++) {
        nl_stage_opts o = {.memory_bytes = 1ULL << 30,
                           .kv_budget = 1 << 20,
                           .send_wait_ms = 100,
                           .ckpt_root = ckpt_root,
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

static inline void free_stages(int nst)
{
    for (int s = 0; s < nst; s++)
        nl_stage_destroy(&stages[s]);
}

static inline void begin_job(int nst, uint64_t job, int mbB, int T, int M, int eval_hops,
                             bool recompute)
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
static inline void feed(uint64_t job, nl_msg_type type, uint64_t step, uint32_t mb, int32_t *tok,
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

static inline void read_reports(coord_step *cs, uint64_t step)
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

static inline void random_batch(int32_t *tok, int32_t *tgt, int n)
{
    for (int i = 0; i < n; i++) {
        tok[i] = (int32_t)nl_rng_below(&data_rng, (uint64_t)cfg.vocab_size);
        tgt[i] = (int32_t)nl_rng_below(&data_rng, (uint64_t)cfg.vocab_size);
    }
}

/* ---- hop digests ---- */

static inline const uint8_t *dig_at(const uint8_t *d, int mb, int kind)
{
    return d + ((size_t)mb * NL_DIGEST_KINDS + (size_t)kind) * NL_HOP_DIGEST_BYTES;
}

/* `steps` steps of a 3-stage job with M microbatches and the same batches
 * every run; out gets each step's digests [steps][NST][sizeof dig_got[0]];
 * the hops fed to stage 0 are digested here into fed [steps][M][32]. */
static inline void digest_run(int steps, int M, uint8_t *out, uint8_t *fed)
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

/* ---- the model and the backends ---- */

/* The model's config (cfg, cfg_json), the order of deliveries' seed, and
 * the backends of NL_TEST_DEVICE (be == rbe[0], rbe[1..]): 1 when all were
 * made. */
static inline int pipeline_begin(void)
{
    nl_error err;
    nl_rng_seed(&order_rng, 7, 0);
    check_small_config(&cfg, 3);
    CHECK_OK(nl_config_validate(&cfg, 1, &err), &err);
    cfg_json = nl_config_to_json(&cfg);
    CHECK_OK(check_backend_new(&be, 2, &err), &err);
    rbe[0] = be;
    for (int r = 1; r < MAXREP; r++)
        CHECK_OK(check_backend_new(&rbe[r], 2, &err), &err);
    return be && rbe[MAXREP - 1] && cfg_json;
}

static inline void pipeline_end(void)
{
    for (int r = MAXREP - 1; r >= 1; r--)
        nl_backend_destroy(&rbe[r]);
    nl_backend_destroy(&be);
    free(cfg_json);
}

#endif
