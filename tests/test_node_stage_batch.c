/* Unit tests of node/stage's batched session hops (test_node_stage.c has
 * the rest; the harness is stage_harness.h):
 *  - batching: sessions' decode steps and a prompt's chunks run as one
 *    batch and each equals its lone forward; a prompt in chunks equals it
 *    at once; when the queue is due (every active session queued, or none
 *    of the others expected back within the wait); closed and evicted
 *    sessions' queued hops;
 *  - the tokens of a step: five sessions (greedy, seeded temperature, and
 *    one asking for log-probabilities) decoded together get each the ids
 *    it gets alone, and a step's device-sampled ids cost one host sync
 *    together (a step of five takes one more than a step of one: the
 *    log-probabilities session's logits), not one a session;
 *  - adapters: a session with a LoRA adapter file (under the stage's
 *    --checkpoint-root) generates what a local generation with the adapter
 *    attached does, its hops running alone in the same nl_stage_run_batch
 *    as the batch of an adapter-less session, whose ids stay the base's;
 *    a file outside the root or not there is refused by name;
 *  - what a peer may send out of the usual order: a session's second hop
 *    queued behind its first, which waits for room, runs after it and at
 *    its own position; a token outside the vocabulary is refused when it
 *    is queued, not in the batch where it would fail the other sessions'
 *    hops; an open refused (an adapter that is not there) leaves the
 *    other sessions, and one of the same id, open; a forward that could
 *    not run (the last output still being sent) leaves no hop queued. */
#include <time.h>
#include <unistd.h>

#include "core/model/lora.h"
#include "tests/stage_harness.h"

/* ---- batched session hops ---- */

/* A monotonic clock in seconds. */
static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}
static float *host_copy(const float *p, size_t n)
{
    float *c = malloc(n * sizeof *c);
    if (c && p)
        memcpy(c, p, n * sizeof *c);
    return c;
}

static nl_stage_result one_result(nl_stage *s, int want, nl_error *err)
{
    const nl_stage_result *r = NULL;
    int n = -1;
    nl_stage_result out = {0};
    CHECK_OK(nl_stage_run_batch(s, &r, &n, err), err);
    CHECK(n == want, "a batch gave %d results, expected %d", n, want);
    if (n >= 1)
        out = r[0];
    return out;
}

/* Two sessions queued on a stage with a prefill chunk of 4: a 10-token
 * prompt runs over three batches beside the other session's hops, which
 * come out at once; its output is the whole prompt's, as a lone forward
 * gives it; positions follow the queued hops; the last stage samples the
 * same token; a closed session's queued hop is dropped, an evicted one's
 * fails; the figures count hops and batches; the queue is due at once
 * when every active session has a hop in it, else after a short wait. */
static void test_batched(nl_model *ref)
{
    nl_error err;
    prefill_chunk = 4;
    nl_stage *s0 = loaded_stage(ref, 0, 2, 0, 2, 1 << 20);
    nl_stage *s1 = loaded_stage(ref, 1, 2, 2, cfg.num_layers, 1 << 20);
    prefill_chunk = 0;
    nl_stage *r0 = loaded_stage(ref, 0, 2, 0, 2, 1 << 20);
    nl_stage *r1 = loaded_stage(ref, 1, 2, 2, cfg.num_layers, 1 << 20);
    nl_stage_session_params sp = {.capacity = 16, .temperature = 0, .top_p = 1};
    for (uint64_t id = 1; id <= 2; id++) {
        sp.id = id;
        CHECK_OK(nl_stage_open_session(s0, &sp, &err), &err);
        CHECK_OK(nl_stage_open_session(s1, &sp, &err), &err);
        CHECK_OK(nl_stage_open_session(r0, &sp, &err), &err);
        CHECK_OK(nl_stage_open_session(r1, &sp, &err), &err);
    }
    int32_t pa[10] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3}, pb[2] = {27, 18};
    const size_t d = (size_t)cfg.hidden_dim;
    nl_msg_tensor_hop ha = {.job_id = 1, .session_id = 1}, hb = {.job_id = 2, .session_id = 2};
    nl_wire_frame fa = tok_frame(pa, 1, 10), fb = tok_frame(pb, 1, 1);
    CHECK_OK(nl_stage_enqueue(s0, &ha, &fa, &err), &err);
    CHECK_OK(nl_stage_enqueue(s0, &hb, &fb, &err), &err);
    CHECK(nl_stage_enqueue(s0, &hb, &fb, &err) == NL_ERR_RANGE && strstr(err.msg, "queued"),
          "a hop at a position its queued hop takes: %s", err.msg);
    nl_msg_tensor_hop hb2 = hb;
    hb2.pos_offset = 1;
    nl_wire_frame fb2 = tok_frame(pb + 1, 1, 1);
    CHECK_OK(nl_stage_enqueue(s0, &hb2, &fb2, &err), &err); /* behind its first */
    CHECK(nl_stage_queued(s0) == 3, "3 hops queued (%d)", nl_stage_queued(s0));
    /* references: each hop alone, unchunked */
    nl_stage_out o;
    float *want_a = NULL, *want_b[2] = {NULL, NULL};
    CHECK_OK(nl_stage_forward(r0, &ha, &fa, &o, &err), &err);
    want_a = host_copy(o.data, 10 * d); /* an output is host memory */
    /* (session 2's last arrival on r0 and its period there come from
     * these two: timed, for the wait's check below) */
    const double tb1_before = now_s();
    CHECK_OK(nl_stage_forward(r0, &hb, &fb, &o, &err), &err);
    want_b[0] = host_copy(o.data, d);
    const double tb2_before = now_s();
    CHECK_OK(nl_stage_forward(r0, &hb2, &fb2, &o, &err), &err);
    const double tb2_after = now_s();
    want_b[1] = host_copy(o.data, d);
    /* batch 1: 4 of A's positions and B's first hop; batch 2: 4 more and
     * B's second; batch 3: A's last 2, and A's output */
    for (int k = 0; k < 2; k++) {
        nl_stage_result r = one_result(s0, 1, &err);
        CHECK(r.st == NL_OK && r.session_id == 2 && r.pos_offset == (uint64_t)k &&
                  r.out.kind == NL_STAGE_OUT_HIDDEN && r.out.shape[1] == 1,
              "batch %d: B's hop %d (session %llu)", k + 1, k, (unsigned long long)r.session_id);
        if (r.out.data)
            CHECK(check_rel_err(r.out.data, want_b[k], d) < 1e-5, "B's hop %d as alone", k);
    }
    nl_stage_result ra = one_result(s0, 1, &err);
    CHECK(ra.st == NL_OK && ra.session_id == 1 && ra.out.shape[1] == 10 && ra.out.data,
          "batch 3: A's 10 positions");
    if (ra.out.data)
        CHECK(check_rel_err(ra.out.data, want_a, 10 * d) < 1e-5,
              "A's prompt in 3 chunks as in one (%.2g)",
              check_rel_err(ra.out.data, want_a, 10 * d));
    nl_stage_figures fg;
    nl_stage_get_figures(s0, &fg);
    CHECK(fg.hops == 3 && fg.batches == 3 && fg.rows == 12 && fg.compute_s > 0 &&
              fg.hop_s >= fg.compute_s,
          "figures: %llu hops, %llu batches, %llu rows", (unsigned long long)fg.hops,
          (unsigned long long)fg.batches, (unsigned long long)fg.rows);
    /* the last stage: A's hidden states in, the token a lone forward samples */
    nl_wire_frame h = out_frame(&ra.out);
    h.t.data = want_a;
    CHECK_OK(nl_stage_enqueue(s1, &ha, &h, &err), &err);
    nl_stage_result rt = one_result(s1, 0, &err); /* 4 of 10 */
    rt = one_result(s1, 0, &err);
    rt = one_result(s1, 1, &err);
    CHECK_OK(nl_stage_forward(r1, &ha, &h, &o, &err), &err);
    CHECK(rt.st == NL_OK && rt.out.kind == NL_STAGE_OUT_TOKEN && rt.out.token == o.token,
          "the last stage samples %d after chunks, %d at once", rt.out.token, o.token);
    /* when the queue is due: at once when every active session has a hop
     * queued, else after a short wait for the others */
    CHECK(nl_stage_batch_due(r0) == -1.0, "nothing queued on r0");
    int32_t t1 = 11, t2 = 12;
    nl_msg_tensor_hop n1 = {.job_id = 1, .session_id = 1, .pos_offset = 10},
                      n2 = {.job_id = 2, .session_id = 2, .pos_offset = 2};
    nl_wire_frame g1 = tok_frame(&t1, 1, 1), g2 = tok_frame(&t2, 1, 1);
    /* (session 2 is made late first: its period is the time between its
     * last two forwards, which a sanitizer build or a loaded machine makes
     * longer than the wait, and a session due back after the wait is not
     * waited for; 300 ms stays inside its 2 s of activity. The wait is
     * 20 ms from the enqueue: a machine that stalls this thread past it
     * makes the queue due at once, rightly) */
    usleep(300000);
    const double t0 = now_s();
    CHECK_OK(nl_stage_enqueue(r0, &n1, &g1, &err), &err);
    const double due = nl_stage_batch_due(r0), t1q = now_s(), waited = t1q - t0;
    /* session 2 is awaited while active (a hop within the last 2 s) and
     * late (its last arrival plus its period is past); a machine that
     * stalled this test for seconds since its last forward makes it
     * inactive, rightly not waited for. From this test's own clock: */
    const double period_max = tb2_after - tb1_before, margin = 0.05;
    const int surely_active =
                  t1q - tb2_before<2.0 - margin, surely_inactive = t0 - tb2_after> 2.0 + margin,
              surely_late = tb2_after + period_max < t0 - margin;
    if (waited >= 0.020)
        CHECK(due == 0.0, "one of two queued, the wait over after %g s: due in %g s", waited, due);
    else if (surely_active && surely_late)
        CHECK(due > 0.0 && due <= 0.020, "one of two active sessions queued: due in %g s", due);
    else if (surely_inactive)
        CHECK(due == 0.0, "session 2 idle for %.2f s (inactive): due in %g s", t0 - tb2_after, due);
    else /* at a threshold: either answer is right */
        CHECK(due >= 0.0 && due <= 0.020, "session 2 at a threshold: due in %g s", due);

    CHECK_OK(nl_stage_enqueue(r0, &n2, &g2, &err), &err);
    CHECK(nl_stage_batch_due(r0) == 0.0, "both queued: due now");
    nl_stage_result rr = one_result(r0, 2, &err);
    CHECK(rr.st == NL_OK, "the two ran together");
    /* a session not expected back before the wait runs out (its period on
     * the ring is longer) is not waited for: session 2 comes every 300 ms
     * (its smoothed period passes 20 ms after a few; 300 ms, not less, so
     * that a loaded machine's stall between its last hop and session 1's
     * does not bring it within the wait) */
    for (int k = 0; k < 5; k++) {
        if (k)
            usleep(300000);
        n2.pos_offset = 3 + (uint64_t)k;
        CHECK_OK(nl_stage_enqueue(r0, &n2, &g2, &err), &err);
        rr = one_result(r0, 1, &err);
        CHECK(rr.st == NL_OK, "session 2's hop %d", k);
    }
    n1.pos_offset = 11;
    CHECK_OK(nl_stage_enqueue(r0, &n1, &g1, &err), &err); /* session 2 ran just now */
    CHECK(nl_stage_batch_due(r0) == 0.0, "session 2 is due back in 300 ms: not waited for");
    rr = one_result(r0, 1, &err);
    CHECK(rr.st == NL_OK && rr.session_id == 1, "session 1 ran alone");
    /* closed while queued: dropped; evicted while queued: fails */
    h.t.shape[1] = 1;
    h.t.data = want_b[0];
    CHECK_OK(nl_stage_enqueue(s1, &hb, &h, &err), &err);
    nl_stage_close_session(s1, 2);
    CHECK(nl_stage_queued(s1) == 0, "a closed session's queued hop went with it");
    nl_stage_destroy(&s1);
    size_t one = nl_kvcache_bytes(&cfg, 2, 1, 16, NL_KV_FP32);
    nl_stage *se = loaded_stage(ref, 0, 2, 0, 2, one * 2);
    for (uint64_t id = 1; id <= 2; id++) {
        sp.id = id;
        CHECK_OK(nl_stage_open_session(se, &sp, &err), &err);
    }
    CHECK_OK(nl_stage_enqueue(se, &ha, &fa, &err), &err);
    sp.id = 3; /* evicts session 1, the least recently used */
    CHECK_OK(nl_stage_open_session(se, &sp, &err), &err);
    nl_stage_result rv = one_result(se, 1, &err);
    CHECK(rv.st == NL_ERR_NOTFOUND && rv.session_id == 1 && strstr(rv.msg, "evicted"),
          "an evicted session's queued hop: %s", rv.msg);
    CHECK(nl_stage_queued(se) == 0, "nothing left queued");
    free(want_a);
    free(want_b[0]);
    free(want_b[1]);
    nl_stage_destroy(&se);
    nl_stage_destroy(&s0);
    nl_stage_destroy(&r0);
    nl_stage_destroy(&r1);
}

/* ---- the tokens of a step ---- */

enum { TS = 5, TSTEPS = 4 };

/* Session i + 1: greedy (0, 2), a seeded temperature (1, 3), and 4 at a
 * temperature with log-probabilities (sampled on the host). */
static nl_stage_session_params together_params(int i)
{
    nl_stage_session_params sp = {.id = (uint64_t)i + 1, .capacity = 16, .top_p = 1};
    sp.seed = 70 + (uint64_t)i;
    sp.temperature = i % 2 ? 0.9f : i == 4 ? 0.8f : 0.0f;
    sp.logprobs = i == 4 ? 3 : 0;
    return sp;
}

/* TSTEPS steps of the sessions in `which` (bit i: session i + 1) on a
 * fresh whole-model stage, all at once: a 3-token prompt, then each
 * sampled token fed back; ids[i][k] the tokens, syncs[k] the host syncs
 * of step k's nl_stage_run_batch. */
static void run_steps(const nl_model *ref, unsigned which, int32_t ids[TS][TSTEPS],
                      uint64_t syncs[TSTEPS])
{
    nl_error err;
    nl_stage *s = loaded_stage(ref, 0, 1, 0, cfg.num_layers, 1 << 20);
    int32_t prompt[TS][3];
    int want = 0;
    for (int i = 0; i < TS; i++) {
        if (!(which >> i & 1))
            continue;
        const nl_stage_session_params sp = together_params(i);
        CHECK_OK(nl_stage_open_session(s, &sp, &err), &err);
        prompt[i][0] = 1 + i, prompt[i][1] = 3 + 2 * i, prompt[i][2] = 7;
        want++;
    }
    for (int k = 0; s && k < TSTEPS; k++) {
        for (int i = 0; i < TS; i++) {
            if (!(which >> i & 1))
                continue;
            nl_msg_tensor_hop h = {.job_id = (uint64_t)i + 1, .session_id = (uint64_t)i + 1};
            h.pos_offset = k ? 2 + (uint64_t)k : 0;
            nl_wire_frame f = k ? tok_frame(&ids[i][k - 1], 1, 1) : tok_frame(prompt[i], 1, 3);
            CHECK_OK(nl_stage_enqueue(s, &h, &f, &err), &err);
        }
        const nl_stage_result *r = NULL;
        int n = -1;
        const uint64_t s0 = be->stats.host_syncs;
        CHECK_OK(nl_stage_run_batch(s, &r, &n, &err), &err);
        syncs[k] = be->stats.host_syncs - s0;
        CHECK(n == want, "step %d: %d results of %d sessions", k, n, want);
        for (int j = 0; j < n; j++) {
            const int i = (int)r[j].session_id - 1;
            CHECK(r[j].st == NL_OK && r[j].out.kind == NL_STAGE_OUT_TOKEN && i >= 0 && i < TS,
                  "step %d: session %llu: %s", k, (unsigned long long)r[j].session_id, r[j].msg);
            if (i < 0 || i >= TS)
                continue;
            ids[i][k] = r[j].out.token;
            CHECK(r[j].out.lp_n == (i == 4 ? 3 : 0), "session %d: %d log-probabilities", i + 1,
                  r[j].out.lp_n);
        }
    }
    nl_stage_destroy(&s);
}

/* Five sessions together and each alone: the same ids; a decode step's
 * host syncs together are one session's plus the log-probabilities
 * session's download of the step's logits, and on the first decode step
 * the upload of the pointers to the five caches (on the code before
 * sample_rows, four more: a wait for each device-sampled session's id). */
static void test_sampled_together(nl_model *ref)
{
    int32_t together[TS][TSTEPS], alone[TS][TSTEPS];
    uint64_t sync_all[TSTEPS], sync_one[TS][TSTEPS];
    memset(together, 0xff, sizeof together);
    memset(alone, 0xfe, sizeof alone);
    run_steps(ref, (1u << TS) - 1, together, sync_all);
    for (int i = 0; i < TS; i++)
        run_steps(ref, 1u << i, alone, sync_one[i]);
    for (int i = 0; i < TS; i++)
        CHECK(memcmp(together[i], alone[i], sizeof alone[i]) == 0,
              "session %d: ids %d %d %d %d together, %d %d %d %d alone", i + 1, together[i][0],
              together[i][1], together[i][2], together[i][3], alone[i][0], alone[i][1], alone[i][2],
              alone[i][3]);
    for (int k = 1; k < TSTEPS; k++) { /* decode steps */
        /* the first decode step of the five also uploads the batch's
         * pointers to their caches (one attention call a layer) */
        const uint64_t more = k == 1 ? 2 : 1;
        CHECK(sync_all[k] == sync_one[0][k] + more && sync_one[4][k] == sync_one[0][k],
              "decode step %d: %llu host syncs for 5 sessions, %llu for one (%llu for the "
              "log-probabilities one): want %llu more",
              k, (unsigned long long)sync_all[k], (unsigned long long)sync_one[0][k],
              (unsigned long long)sync_one[4][k], (unsigned long long)more);
    }
}

/* ---- adapters ---- */

/* The results of one batch on s: n_want of them, by session (ids 1, 2). */
static void batch_by_session(nl_stage *s, int n_want, nl_stage_result by[3], nl_error *err)
{
    const nl_stage_result *r = NULL;
    int n = -1;
    memset(by, 0, 3 * sizeof *by);
    CHECK_OK(nl_stage_run_batch(s, &r, &n, err), err);
    CHECK(n == n_want, "one nl_stage_run_batch gave %d results, expected %d", n, n_want);
    for (int i = 0; i < n; i++) {
        CHECK(r[i].st == NL_OK && r[i].session_id >= 1 && r[i].session_id <= 2,
              "result %d: session %llu: %s", i, (unsigned long long)r[i].session_id, r[i].msg);
        if (r[i].session_id >= 1 && r[i].session_id <= 2)
            by[r[i].session_id] = r[i];
    }
}

static void test_adapters(nl_model *ref)
{
    nl_error err;
    enum { P = 6, N = 7 };
    char dir[] = "/tmp/nl_stage_adapter_XXXXXX", path[64], outside[] = "/tmp/nl_ad_XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp");
        return;
    }
    snprintf(path, sizeof path, "%s/ad.safetensors", dir);
    /* an adapter on wq, wo and the experts' w_up, A and B random (B is
     * zero when drawn: it would change nothing) */
    nl_lora *lo = NULL;
    CHECK_OK(nl_lora_new(&lo, ref, 2, 4.0f, NL_LORA_WQ | NL_LORA_WO | NL_LORA_W_UP, P, &err), &err);
    if (!lo)
        return;
    float *h = malloc(lo->n_params * sizeof *h);
    nl_rng r;
    nl_rng_seed(&r, 77, 1);
    for (size_t i = 0; i < lo->n_params; i++)
        h[i] = (float)(0.3 * nl_rng_normal(&r));
    be->upload(be, lo->params, h, lo->n_params * sizeof *h);
    free(h);
    CHECK_OK(nl_lora_save(lo, path, NULL, &err), &err);
    int32_t prompt[P] = {7, 1, 99, 250, 3, 42}, want_ad[N], want_base[N], got[3][N];
    local_generate(ref, prompt, P, N, want_ad); /* with the adapter attached */
    nl_lora_destroy(&lo);
    local_generate(ref, prompt, P, N, want_base);
    CHECK(memcmp(want_ad, want_base, sizeof want_ad) != 0, "the adapter changes the ids");
    ckpt_root = dir;
    nl_stage *s0 = loaded_stage(ref, 0, 2, 0, 2, 1 << 20);
    nl_stage *s1 = loaded_stage(ref, 1, 2, 2, cfg.num_layers, 1 << 20);
    ckpt_root = NULL;
    /* session 1 with the adapter, 2 without; on both stages */
    nl_stage_session_params sp = {.capacity = P + N, .temperature = 0, .top_p = 1};
    for (uint64_t id = 1; id <= 2; id++) {
        sp.id = id;
        sp.adapter = id == 1 ? path : NULL;
        CHECK_OK(nl_stage_open_session(s0, &sp, &err), &err);
        CHECK_OK(nl_stage_open_session(s1, &sp, &err), &err);
    }
    int32_t cur[3] = {0, 0, 0};
    uint64_t pos = 0;
    for (int i = 0; i < N; i++) {
        nl_stage_result by[3];
        float *hid[3] = {NULL, NULL, NULL};
        const int T = i == 0 ? P : 1;
        for (uint64_t id = 1; id <= 2; id++) {
            nl_msg_tensor_hop hop = {.job_id = id, .session_id = id, .pos_offset = pos};
            nl_wire_frame f = tok_frame(i == 0 ? prompt : &cur[id], 1, T);
            CHECK_OK(nl_stage_enqueue(s0, &hop, &f, &err), &err);
        }
        batch_by_session(s0, 2, by, &err);   /* the batch (2) and the adapter's hop alone (1) */
        for (uint64_t id = 1; id <= 2; id++) /* outputs live until the next batch */
            hid[id] = host_copy(by[id].out.data, (size_t)T * cfg.hidden_dim);
        for (uint64_t id = 1; id <= 2; id++) {
            nl_msg_tensor_hop hop = {.job_id = id, .session_id = id, .pos_offset = pos};
            nl_wire_frame f = out_frame(&by[id].out);
            f.t.data = hid[id];
            CHECK_OK(nl_stage_enqueue(s1, &hop, &f, &err), &err);
        }
        batch_by_session(s1, 2, by, &err);
        for (uint64_t id = 1; id <= 2; id++) {
            CHECK(by[id].out.kind == NL_STAGE_OUT_TOKEN, "session %llu: a token",
                  (unsigned long long)id);
            got[id][i] = cur[id] = by[id].out.token;
            free(hid[id]);
        }
        pos += (uint64_t)T;
    }
    CHECK(memcmp(got[1], want_ad, sizeof want_ad) == 0,
          "the adapter's session: the ids of a local generation with it");
    CHECK(memcmp(got[2], want_base, sizeof want_base) == 0,
          "the session beside it: the base's ids");
    nl_stage_figures fg;
    nl_stage_get_figures(s0, &fg);
    CHECK(fg.hops == 2 * N && fg.batches == N && fg.rows == P + N - 1,
          "figures: %llu hops (both sessions), %llu batches and %llu rows (the base's alone)",
          (unsigned long long)fg.hops, (unsigned long long)fg.batches, (unsigned long long)fg.rows);
    /* refusals: a file outside the root, a file not there */
    CHECK(mkdtemp(outside) != NULL, "mkdtemp");
    char out_path[64];
    snprintf(out_path, sizeof out_path, "%s/ad.safetensors", outside);
    rename(path, out_path);
    sp.id = 3;
    sp.adapter = out_path;
    CHECK(nl_stage_open_session(s0, &sp, &err) == NL_ERR_AUTH &&
              strstr(err.msg, "--checkpoint-root"),
          "an adapter outside the root: %s", err.msg);
    sp.adapter = path;
    CHECK(nl_stage_open_session(s0, &sp, &err) == NL_ERR_AUTH && strstr(err.msg, "params.adapter"),
          "an adapter not there: %s", err.msg);
    /* a file that is not an adapter (a cluster whose weights are no
     * file's, a manifest's, leaves this to the stages: no coordinator
     * check reads it first) */
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL, "%s", path);
    if (fp) {
        fputs("plain text, not safetensors\n", fp);
        fclose(fp);
    }
    const nl_status nst = nl_stage_open_session(s0, &sp, &err);
    CHECK(nst != NL_OK && strstr(err.msg, "params.adapter") && !strstr(err.msg, "not a file"),
          "not an adapter file: %s (%s)", err.msg, nl_status_str(nst));
    remove(path);
    CHECK(!nl_stage_session(s0, 3, NULL), "no session opened by a refusal");
    nl_stage_destroy(&s0);
    nl_stage_destroy(&s1);
    remove(out_path);
    rmdir(outside);
    rmdir(dir);
}

/* ---- what a peer may send out of the usual order ---- */

static void test_peer_orders(nl_model *ref)
{
    nl_error err;
    const size_t d = (size_t)cfg.hidden_dim;
    nl_stage_session_params sp = {.capacity = 16, .temperature = 0, .top_p = 1};
    /* a session's second hop waits for its first, which waits for room:
     * prompts in chunks of 4, session 1's prompt takes the chunk */
    prefill_chunk = 4;
    nl_stage *s0 = loaded_stage(ref, 0, 2, 0, 2, 1 << 20);
    prefill_chunk = 0;
    nl_stage *r0 = loaded_stage(ref, 0, 2, 0, 2, 1 << 20);
    for (uint64_t id = 1; id <= 2; id++) {
        sp.id = id;
        CHECK_OK(nl_stage_open_session(s0, &sp, &err), &err);
        CHECK_OK(nl_stage_open_session(r0, &sp, &err), &err);
    }
    int32_t pa[4] = {3, 1, 4, 1}, pb[3] = {27, 18, 7};
    nl_msg_tensor_hop ha = {.job_id = 1, .session_id = 1};
    nl_msg_tensor_hop hb1 = {.job_id = 2, .session_id = 2}, hb2 = hb1;
    hb2.pos_offset = 2;
    nl_wire_frame fa = tok_frame(pa, 1, 4), fb1 = tok_frame(pb, 1, 2),
                  fb2 = tok_frame(pb + 2, 1, 1);
    CHECK_OK(nl_stage_enqueue(s0, &ha, &fa, &err), &err);
    CHECK_OK(nl_stage_enqueue(s0, &hb1, &fb1, &err), &err);
    CHECK_OK(nl_stage_enqueue(s0, &hb2, &fb2, &err), &err);
    nl_stage_out o;
    float *want[2] = {NULL, NULL};
    CHECK_OK(nl_stage_forward(r0, &hb1, &fb1, &o, &err), &err);
    want[0] = host_copy(o.data, 2 * d);
    CHECK_OK(nl_stage_forward(r0, &hb2, &fb2, &o, &err), &err);
    want[1] = host_copy(o.data, d);
    int seen = 0;
    for (int b = 0; b < 4 && nl_stage_queued(s0); b++) {
        const nl_stage_result *r = NULL;
        int n = 0;
        CHECK_OK(nl_stage_run_batch(s0, &r, &n, &err), &err);
        for (int i = 0; i < n; i++) {
            if (r[i].session_id != 2)
                continue;
            const int k = r[i].pos_offset == 2;
            CHECK(r[i].st == NL_OK && k == seen, "session 2's hop at %llu came %s (%s)",
                  (unsigned long long)r[i].pos_offset, k == seen ? "in order" : "out of order",
                  r[i].msg);
            if (r[i].st == NL_OK && want[k] && r[i].out.data)
                CHECK(check_rel_err(r[i].out.data, want[k], (size_t)(k ? 1 : 2) * d) == 0.0,
                      "session 2's hop at %llu differs from its lone forward",
                      (unsigned long long)r[i].pos_offset);
            seen++;
        }
    }
    CHECK(seen == 2, "session 2's hops: %d results", seen);
    free(want[0]);
    free(want[1]);
    nl_stage_destroy(&r0);

    /* a token outside the vocabulary is refused when queued; the other
     * session's hop runs */
    int32_t good[2] = {3, 1}, bad[1] = {(int32_t)cfg.vocab_size + 5};
    nl_msg_tensor_hop h1 = {.job_id = 1, .session_id = 1, .pos_offset = 4};
    nl_msg_tensor_hop h2 = {.job_id = 2, .session_id = 2, .pos_offset = 3};
    nl_wire_frame f1 = tok_frame(good, 1, 2), f2 = tok_frame(bad, 1, 1);
    CHECK_OK(nl_stage_enqueue(s0, &h1, &f1, &err), &err);
    CHECK(nl_stage_enqueue(s0, &h2, &f2, &err) == NL_ERR_RANGE && strstr(err.msg, "vocabulary"),
          "a token outside the vocabulary was queued (%s)", err.msg);
    nl_stage_result one = one_result(s0, 1, &err);
    CHECK(one.st == NL_OK && one.session_id == 1, "session 1's hop beside the refused one: %s",
          one.msg);

    /* an open refused for its adapter leaves the sessions open: another
     * (the budget holds one more only by evicting), and one of its id */
    nl_stage_session_info inf;
    CHECK(nl_stage_session(s0, 1, &inf), "session 1 open");
    nl_stage_destroy(&s0);
    s0 = loaded_stage(ref, 0, 2, 0, 2, inf.bytes + inf.bytes / 2);
    sp.id = 1;
    CHECK_OK(nl_stage_open_session(s0, &sp, &err), &err);
    nl_stage_session_params sp2 = sp;
    sp2.adapter = "/nonexistent/adapter.safetensors";
    for (uint64_t id = 2; id >= 1; id--) {
        sp2.id = id;
        CHECK(nl_stage_open_session(s0, &sp2, &err) != NL_OK, "session %llu opened with no adapter",
              (unsigned long long)id);
        CHECK(nl_stage_session(s0, 1, NULL) && !nl_stage_session_evicted(s0, 1) &&
                  nl_stage_session_count(s0) == 1,
              "a refused open of session %llu: session 1 open %d, evicted %d, %d sessions",
              (unsigned long long)id, nl_stage_session(s0, 1, NULL),
              nl_stage_session_evicted(s0, 1), nl_stage_session_count(s0));
    }

    /* a forward that cannot run now (the last output is still being sent)
     * leaves nothing queued: the same hop runs once the send is done */
    nl_stage_destroy(&s0);
    s0 = loaded_stage(ref, 0, 2, 0, 2, 1 << 20);
    CHECK_OK(nl_stage_open_session(s0, &sp, &err), &err);
    nl_msg_tensor_hop h = {.job_id = 1, .session_id = 1};
    nl_wire_frame f = tok_frame(good, 1, 2);
    atomic_fetch_add(&nl_stage_txref(s0)->pending, 1);
    CHECK(nl_stage_forward(s0, &h, &f, &o, &err) != NL_OK,
          "a forward ran while the last output was being sent");
    CHECK(nl_stage_queued(s0) == 0, "the forward that did not run left %d hops queued",
          nl_stage_queued(s0));
    atomic_fetch_sub(&nl_stage_txref(s0)->pending, 1);
    CHECK_OK(nl_stage_forward(s0, &h, &f, &o, &err), &err);
    nl_stage_destroy(&s0);
}

int main(void)
{
    nl_model *ref = NULL;
    if (stage_harness_start("test_node_stage_batch", &ref)) {
        test_batched(ref);
        test_sampled_together(ref);
        test_adapters(ref);
        test_peer_orders(ref);
    }
    return stage_harness_end("test_node_stage_batch", &ref);
}
