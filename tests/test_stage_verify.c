/* The verifier's side of verification by recompute (node/stage_verify.h):
 * the weights of a stage travel to a verifier once per drawn (stage, step),
 * and the cases after the first name them by their BLAKE2b digest.
 *
 * A middle stage's case (layers [1, 2), its input and the GRADIENT it
 * received, made up here) is redone by a verifier stage on a backend of
 * its own, as a node does; the coordinator names each stage's weights of a
 * step (here: their digest, any 32 bytes do):
 *  - with its weights: the digests nl_verify_recompute gives;
 *  - again without them, naming them: the same digests, redone on the
 *    weights held (no second load);
 *  - without them, naming weights it does not hold (another name, or
 *    after nl_stage_verify_forget): answered want_weights, no digests;
 *  - with other weights: those are loaded, and a case without weights
 *    that names the first is answered want_weights (a case is never
 *    redone on weights other than its own);
 *  - with weights and no name (not the coordinator's): known by their
 *    digest, loaded only when they differ;
 *  - without weights and naming none: refused.
 *
 * And on whole pipelines (stage_train_harness.h: 3 stages in one process,
 * every message through the wire codec):
 *  - verification by recompute: every (stage, microbatch) of 17 honest
 *    steps redone on another backend from the stage's kept inputs and
 *    weights gives the digests it reported (204, none accused), and one
 *    per stage and step over the wire (VERIFY_REQ, VERIFY_CASE through the
 *    codec, a verifier stage without a model, VERIFY_RESULT); each kind of
 *    lie on stage 1 (NL_TEST_HOOKS builds) is accused there and an honest
 *    stage never, on the FP32 wire and on the bf16 one;
 *  - what a verifier keeps: each stage built once for the job, its weights
 *    loaded once a step, never used for a case that brings other ones, and
 *    built again after nl_stage_verify_forget. */
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/model/model.h"
#include "core/model/rng.h"
#include "net/hopdigest.h"
#include "net/wire.h"
#include "node/stage.h"
#include "node/stage_verify.h"
#include "tests/check.h"
#include "tests/stage_train_harness.h"

enum { B = 2, T = 8, L0 = 1, L1 = 2 };

/* A VERIFY_CASE of stage 1 (layers [L0, L1)) into m: the weights w (n
 * floats; n 0: none), named by hex (NULL: none), input x and gradient dy
 * [B, T, d]. */
static void make_case(nl_wire_msg *m, const float *w, size_t n, const char *hex, const float *x,
                      const float *dy)
{
    static const float none = 0.0f;
    const int64_t ws[1] = {(int64_t)n}, xs[3] = {B, T, cfg.hidden_dim};
    nl_wire_msg_reset(m, NL_MSG_VERIFY_CASE);
    m->u.verify_case = (nl_msg_verify_case){.job_id = 5,
                                            .step = 3,
                                            .microbatch = 0,
                                            .stage = 1,
                                            .layer0 = L0,
                                            .layer1 = L1,
                                            .batch = B,
                                            .seq = T,
                                            .microbatches = 1,
                                            .config_json = cfg_json,
                                            .weights = hex ? hex : ""};
    nl_wire_frame_set(&m->frames[0], n ? w : &none, NL_DTYPE_F32, ws, 1);
    nl_wire_frame_set(&m->frames[1], x, NL_DTYPE_F32, xs, 3);
    nl_wire_frame_set(&m->frames[2], dy, NL_DTYPE_F32, xs, 3);
    m->nframes = 3;
    for (int f = 0; f < 3; f++) /* as received: the lengths known */
        m->frames[f].len = (size_t)(f ? B * T * cfg.hidden_dim : (int64_t)n) * sizeof(float);
}

static void digest_hex(char hex[NL_HOP_DIGEST_HEX + 1], const float *w, size_t n)
{
    uint8_t d[NL_HOP_DIGEST_BYTES];
    crypto_generichash(d, sizeof d, (const uint8_t *)w, n * sizeof *w, NULL, 0);
    nl_hop_digest_hex(hex, d);
}

/* Redo m on verifier v: its status, and in *r the VERIFY_RESULT (strings
 * copied into res). */
static nl_status answer(nl_stage *v, const nl_wire_msg *m, nl_msg_verify_result *r,
                        char res[2][NL_HOP_DIGEST_HEX + 1], nl_error *err)
{
    char hex[3][NL_HOP_DIGEST_HEX + 1];
    nl_wire_msg out;
    nl_wire_msg_init(&out);
    nl_status st = nl_verify_answer(v, m, &out, hex, err);
    *r = (nl_msg_verify_result){0};
    res[0][0] = res[1][0] = '\0';
    if (st == NL_OK) {
        *r = out.u.verify_result;
        snprintf(res[0], NL_HOP_DIGEST_HEX + 1, "%s", r->fwd ? r->fwd : "");
        snprintf(res[1], NL_HOP_DIGEST_HEX + 1, "%s", r->bwd ? r->bwd : "");
    }
    nl_wire_msg_free(&out);
    return st;
}

static void weights_by_digest(nl_backend *sbe, nl_backend *vbe)
{
    nl_error err;
    nl_model *model = NULL;
    nl_stage *v = NULL;
    const size_t d = (size_t)cfg.hidden_dim, rows = (size_t)B * T;
    CHECK_OK(nl_model_new(&model, sbe, &cfg, L0, L1, false, false, &err), &err);
    if (!model)
        return;
    const size_t n = model->n_params;
    float *w = malloc(n * sizeof *w), *w2 = malloc(n * sizeof *w2);
    float *x = malloc(rows * d * sizeof *x), *dy = malloc(rows * d * sizeof *dy);
    nl_rng rng;
    nl_rng_seed(&rng, 11, 0);
    for (size_t i = 0; w && w2 && i < n; i++) {
        w[i] = ((float)nl_rng_uniform(&rng) - 0.5f) * 0.1f;
        w2[i] = w[i] + (i % 97 == 0 ? 1e-3f : 0.0f);
    }
    for (size_t i = 0; x && dy && i < rows * d; i++) {
        x[i] = (float)nl_rng_uniform(&rng) - 0.5f;
        dy[i] = ((float)nl_rng_uniform(&rng) - 0.5f) * 1e-2f;
    }
    nl_stage_opts vo = {
        .memory_bytes = 1ULL << 30, .kv_budget = 1 << 20, .send_wait_ms = 100, .verify_be = vbe};
    CHECK_OK(nl_stage_new(&v, sbe, &vo, &err), &err);
    if (!w || !w2 || !x || !dy || !v)
        goto out;
    /* what the case should give: a redo of its own */
    uint8_t fwd[NL_HOP_DIGEST_BYTES], bwd[NL_HOP_DIGEST_BYTES];
    char want[2][NL_HOP_DIGEST_HEX + 1], hex[NL_HOP_DIGEST_HEX + 1], hex2[NL_HOP_DIGEST_HEX + 1];
    const nl_verify_case c = {.cfg = &cfg,
                              .l0 = L0,
                              .l1 = L1,
                              .stage = 1,
                              .job = 5,
                              .step = 3,
                              .mbB = B,
                              .T = T,
                              .M = 1,
                              .weights = w,
                              .n_weights = n,
                              .x = x,
                              .dy = dy};
    CHECK_OK(nl_verify_recompute(vbe, &c, fwd, bwd, NULL, &err), &err);
    nl_hop_digest_hex(want[0], fwd);
    nl_hop_digest_hex(want[1], bwd);
    digest_hex(hex, w, n);
    digest_hex(hex2, w2, n);

    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_msg_verify_result r;
    char got[2][NL_HOP_DIGEST_HEX + 1];
    nl_verify_stats vs;
    /* with its weights (and their digest) */
    make_case(&m, w, n, hex, x, dy);
    CHECK_OK(answer(v, &m, &r, got, &err), &err);
    CHECK(!r.want_weights && strcmp(got[0], want[0]) == 0 && strcmp(got[1], want[1]) == 0,
          "a case with its weights: not the redo's digests");
    /* without them, naming them: redone on those held */
    make_case(&m, NULL, 0, hex, x, dy);
    CHECK_OK(answer(v, &m, &r, got, &err), &err);
    nl_stage_verify_stats(v, &vs);
    CHECK(!r.want_weights && strcmp(got[0], want[0]) == 0 && strcmp(got[1], want[1]) == 0 &&
              vs.cases == 2 && vs.loads == 1 && vs.held == 1,
          "a case naming the weights held: want %d, %llu cases, %llu loads, %llu held",
          (int)r.want_weights, (unsigned long long)vs.cases, (unsigned long long)vs.loads,
          (unsigned long long)vs.held);
    /* naming weights it does not hold */
    make_case(&m, NULL, 0, hex2, x, dy);
    CHECK_OK(answer(v, &m, &r, got, &err), &err);
    CHECK(r.want_weights == 1 && !got[0][0] && !got[1][0],
          "a case naming weights not held was not answered want_weights");
    /* other weights: loaded; the first are no longer held */
    make_case(&m, w2, n, hex2, x, dy);
    CHECK_OK(answer(v, &m, &r, got, &err), &err);
    nl_stage_verify_stats(v, &vs);
    CHECK(!r.want_weights && strcmp(got[0], want[0]) != 0 && vs.loads == 2,
          "a case with other weights: redone on the first (%llu loads)",
          (unsigned long long)vs.loads);
    make_case(&m, NULL, 0, hex, x, dy);
    CHECK_OK(answer(v, &m, &r, got, &err), &err);
    CHECK(r.want_weights == 1, "a case naming weights replaced since was not answered "
                               "want_weights");
    /* forgotten (a new plan, the job's end): asked for again */
    make_case(&m, NULL, 0, hex2, x, dy);
    CHECK_OK(answer(v, &m, &r, got, &err), &err);
    CHECK(!r.want_weights, "a case naming the weights just loaded was answered want_weights");
    nl_stage_verify_forget(v);
    CHECK_OK(answer(v, &m, &r, got, &err), &err);
    nl_stage_verify_stats(v, &vs);
    CHECK(r.want_weights == 1 && vs.wanted == 3,
          "after forgetting: not answered want_weights (%llu asked)",
          (unsigned long long)vs.wanted);
    /* weights named by none: known by their digest */
    make_case(&m, w, n, NULL, x, dy);
    CHECK_OK(answer(v, &m, &r, got, &err), &err);
    CHECK_OK(answer(v, &m, &r, got, &err), &err);
    nl_stage_verify_stats(v, &vs);
    CHECK(!r.want_weights && strcmp(got[0], want[0]) == 0 && strcmp(got[1], want[1]) == 0 &&
              vs.loads == 3,
          "unnamed weights: not the redo's digests, or loaded %llu times (want 3)",
          (unsigned long long)vs.loads);
    make_case(&m, NULL, 0, NULL, x, dy);
    CHECK(answer(v, &m, &r, got, &err) == NL_ERR_PROTO, "a case with no weights, naming none, "
                                                        "was not refused");
    m.nframes = 0; /* the frames are this test's */
    nl_wire_msg_free(&m);
out:
    nl_stage_destroy(&v);
    nl_model_destroy(&model);
    free(w);
    free(w2);
    free(x);
    free(dy);
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
    nl_backend *sbe = NULL, *vbe = NULL;
    nl_log_set_name("test_stage_verify");
    nl_log_set_level(NL_LOG_ERROR);
    const int pipeline = pipeline_begin(); /* cfg, cfg_json, be and rbe[] */
    CHECK_OK(check_backend_new(&sbe, 1, &err), &err);
    CHECK_OK(check_backend_new(&vbe, 1, &err), &err);
    if (sbe && vbe && cfg_json)
        weights_by_digest(sbe, vbe);
    if (pipeline) {
        recompute();
        verifier_keeps();
    }
    nl_backend_destroy(&vbe);
    nl_backend_destroy(&sbe);
    pipeline_end();
    return check_done("test_stage_verify");
}
