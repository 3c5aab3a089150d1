/* The seed corpus writer of fuzz_stage.c (fuzz/corpus/stage):
 * `stage_corpus DIR` runs real stages of the target's model and records
 * the messages they exchange as the target's inputs (generation, forward
 * and embedding jobs, training and fine-tuning steps, a replica ring,
 * verification cases, a reload). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "kernels/backend.h"
#include "net/wire.h"
#include "node/stage.h"
#include "node/stage_verify.h"

#include "fuzz/records.h"
#include "fuzz/stage_model.h"

typedef fuzz_out out;

/* Append m as a record (a batch run after it when `batch`). */
static void rec(out *o, int batch, nl_wire_msg *m)
{
    fuzz_rec(o, (uint8_t)batch, m);
}

static char *cfg_json;
static nl_backend *be;

static void die(const char *what, const nl_error *err)
{
    fprintf(stderr, "stage_corpus: %s: %s\n", what, err->msg);
    exit(1);
}

/* A loaded stage at pos (ring: as assign_of). */
static nl_stage *stage_at(int pos, int ring)
{
    nl_stage *s = NULL;
    nl_error err;
    nl_stage_opts o = {.memory_bytes = 64ull << 20, .kv_budget = 64 << 10, .send_wait_ms = 100};
    if (nl_stage_new(&s, be, &o, &err) != NL_OK)
        die("stage", &err);
    const nl_msg_assign a = assign_of(pos, 0, ring, cfg_json);
    nl_stage_loaded info;
    bool stale;
    if (nl_stage_assign(s, &a, &err) != NL_OK ||
        nl_stage_load_done(s, 1, 0, &info, &stale, &err) != NL_OK)
        die("assign", &err);
    return s;
}

/* ---- messages the stages send, kept to be recorded ---- */

#define KEPT 64
static struct kept {
    int stage; /* the sender's index in the pipeline */
    nl_stage_dest to;
    nl_wire_msg m;     /* decoded from parts: its own copy */
    nl_wire_wbuf head; /* the encoded header */
    uint8_t *frame[NL_WIRE_MAX_FRAMES];
} kept[KEPT];
static int nkept;

/* A copy of m, through the codec (the sender reuses its strings and
 * frames at its next call). */
static void keep(int stage, nl_stage_dest to, nl_wire_msg *m)
{
    if (nkept == KEPT) {
        fprintf(stderr, "stage_corpus: more than %d messages\n", KEPT);
        exit(1);
    }
    struct kept *k = &kept[nkept++];
    k->stage = stage;
    k->to = to;
    k->head = (nl_wire_wbuf){0};
    nl_error err;
    const nl_wire_limits lim = nl_wire_limits_default();
    if (nl_wire_encode(m, &k->head, &lim, &err) != NL_OK)
        die("encode what a stage sent", &err);
    nl_wire_part parts[1 + NL_WIRE_MAX_FRAMES];
    parts[0] = (nl_wire_part){k->head.data, k->head.len};
    for (int i = 0; i < m->nframes; i++) {
        k->frame[i] = malloc(m->frames[i].len ? m->frames[i].len : 1);
        memcpy(k->frame[i], m->frames[i].t.data, m->frames[i].len);
        parts[1 + i] = (nl_wire_part){k->frame[i], m->frames[i].len};
    }
    nl_wire_msg_init(&k->m);
    if (nl_wire_decode(&k->m, parts, 1 + m->nframes, &lim, &err) != NL_OK)
        die("decode what a stage sent", &err);
}

static void drop_kept(void)
{
    for (int i = 0; i < nkept; i++) {
        for (int f = 0; f < kept[i].m.nframes; f++)
            free(kept[i].frame[f]);
        nl_wire_msg_free(&kept[i].m);
        nl_wire_wbuf_free(&kept[i].head);
    }
    nkept = 0;
}

static int sender_ctx[3] = {0, 1, 2};

static nl_status keep_sent(void *ctx, nl_stage_dest to, nl_wire_msg *m, nl_error *err)
{
    (void)err;
    keep(*(int *)ctx, to, m);
    return NL_OK;
}

static nl_wire_param train_params[9];

static nl_msg_job_submit train_job(uint64_t job, int kind)
{
    train_params[0] = (nl_wire_param){.key = "job", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)job};
    train_params[1] = (nl_wire_param){.key = "micro_batch", .kind = NL_WIRE_PARAM_INT, .i = 1};
    train_params[2] = (nl_wire_param){.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 4};
    train_params[3] = (nl_wire_param){.key = "microbatches", .kind = NL_WIRE_PARAM_INT, .i = 2};
    train_params[4] = (nl_wire_param){.key = "eval_hops", .kind = NL_WIRE_PARAM_INT, .i = 1};
    if (kind == NL_JOB_FINETUNE) {
        train_params[5] = (nl_wire_param){.key = "lora_rank", .kind = NL_WIRE_PARAM_INT, .i = 2};
        train_params[6] =
            (nl_wire_param){.key = "lora_targets", .kind = NL_WIRE_PARAM_STR, .s = "wq,w_up"};
        train_params[7] =
            (nl_wire_param){.key = "lora_alpha", .kind = NL_WIRE_PARAM_FLOAT, .f = 4.0};
        train_params[8] = (nl_wire_param){.key = "lora_seed", .kind = NL_WIRE_PARAM_INT, .i = 3};
        return (nl_msg_job_submit){(uint32_t)kind, 9, train_params};
    }
    train_params[5] = (nl_wire_param){.key = "recompute", .kind = NL_WIRE_PARAM_BOOL, .b = true};
    train_params[6] =
        (nl_wire_param){.key = "verify_outputs", .kind = NL_WIRE_PARAM_BOOL, .b = true};
    return (nl_msg_job_submit){(uint32_t)kind, 7, train_params};
}

/* Give m to stage i of the pipeline, recording it in o[i]. */
static void give(nl_stage **st, out *o, int i, int batch, nl_wire_msg *m)
{
    rec(&o[i], batch, m);
    nl_error err;
    if (nl_stage_job_input(st[i], m, keep_sent, &sender_ctx[i], &err) != NL_OK)
        die(nl_wire_type_name(m->type), &err);
}

/* What each stage sent goes on to the other, until none is left (what
 * goes to the coordinator is dropped). */
static void pump(nl_stage **st, out *o)
{
    for (int k = 0; k < nkept; k++) {
        struct kept *c = &kept[k];
        if (c->to == NL_STAGE_TO_NEXT && c->stage == 0)
            give(st, o, 1, 0, &c->m);
        else if (c->to == NL_STAGE_TO_PREV && c->stage == 1)
            give(st, o, 0, 0, &c->m);
    }
    drop_kept();
}

/* The adapter a fine-tuning checkpoint wrote (ck/stage-<i>.safetensors,
 * under the fuzz target's root) used by a session and a forward job of
 * stage i of 2: tokens into the first, hidden states into the last. */
static void adapter_uses(out *o, int i)
{
    static const int32_t ids[3] = {4, 5, 6};
    static float hid[3 * HIDDEN];
    const char *path = i == 0 ? "ck/stage-0.safetensors" : "ck/stage-1.safetensors";
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_param ps[4] = {
        {.key = "session", .kind = NL_WIRE_PARAM_INT, .i = 12},
        {.key = "capacity", .kind = NL_WIRE_PARAM_INT, .i = 6},
        {.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.0},
        {.key = "adapter", .kind = NL_WIRE_PARAM_STR, .s = path},
    };
    for (int k = 0; k < 2; k++) {
        if (k == 1) { /* a forward job with the adapter */
            ps[0] = (nl_wire_param){.key = "job", .kind = NL_WIRE_PARAM_INT, .i = 13};
            ps[1] = (nl_wire_param){.key = "batch", .kind = NL_WIRE_PARAM_INT, .i = 1};
            ps[2] = (nl_wire_param){.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 3};
        }
        nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
        m.u.job_submit =
            (nl_msg_job_submit){k ? (uint32_t)NL_JOB_FORWARD : (uint32_t)NL_JOB_GENERATE, 4, ps};
        rec(o, 0, &m);
        nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
        m.u.hop = (nl_msg_tensor_hop){k ? 13u : 12u, 0, 0, k ? 0u : 12u, 0, 0.0};
        const int64_t sh[3] = {1, 3, HIDDEN};
        if (i == 0)
            nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, sh, 2);
        else
            nl_wire_frame_set(&m.frames[0], hid, NL_DTYPE_F32, sh, 3);
        m.nframes = 1;
        rec(o, 1, &m);
    }
    nl_wire_msg_free(&m);
}

/* A training step of the stage alone as 2 replicas on different nodes:
 * microbatch r on replica r, the counting pass's route counts and the
 * gradients summed round the ring (REDUCE), the step. Each replica's
 * inputs are recorded (ring-0, ring-1). */
static void ring_training(const char *dir)
{
    static out o[2];
    nl_stage *st[2] = {stage_at(0, 1), stage_at(0, 2)};
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    const uint64_t job = 6;
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = train_job(job, NL_JOB_TRAIN);
    m.u.job_submit.nparams = 5; /* no recompute, no outputs to verify */
    for (int i = 0; i < 2; i++) {
        o[i].len = 0;
        o[i].buf[o[i].len++] = (uint8_t)(64 | i << 7);
        uint64_t id;
        nl_error err;
        rec(&o[i], 0, &m);
        if (nl_stage_job_begin(st[i], &m.u.job_submit, &id, NULL, &err) != NL_OK)
            die("ring job", &err);
    }
    const int32_t tok[2][4] = {{1, 2, 3, 4}, {5, 6, 7, 8}},
                  tgt[2][4] = {{2, 3, 4, 5}, {6, 7, 8, 9}};
    const int64_t sh[2] = {1, 4};
    for (int h = 0; h < 3; h++) {
        for (int i = 0; i < 2; i++) {
            nl_wire_msg_reset(&m, h == 0 ? NL_MSG_COUNT : h == 1 ? NL_MSG_ACTIVATION : NL_MSG_STEP);
            if (h < 2) {
                m.u.hop = (nl_msg_tensor_hop){job, 1, (uint32_t)i, 0, 0, 0.0};
                nl_wire_frame_set(&m.frames[0], tok[i], NL_DTYPE_I32, sh, 2);
                nl_wire_frame_set(&m.frames[1], tgt[i], NL_DTYPE_I32, sh, 2);
                m.nframes = h == 0 ? 1 : 2;
            } else {
                m.u.step = (nl_msg_step){job, 1, true, 1.0, 1e-3};
            }
            give(st, o, i, 0, &m);
        }
        /* each replica's REDUCE goes to the other, until none is left */
        for (int k = 0; k < nkept; k++)
            if (kept[k].to == NL_STAGE_TO_RING)
                give(st, o, 1 - kept[k].stage, 0, &kept[k].m);
        drop_kept();
    }
    for (int i = 0; i < 2; i++)
        nl_stage_destroy(&st[i]);
    nl_wire_msg_free(&m);
    fuzz_save(dir, "ring-0", &o[0]);
    fuzz_save(dir, "ring-1", &o[1]);
}

/* A training (or fine-tuning) job's first step on two stages, each
 * recording what reaches it: the hops of 2 microbatches, an evaluation,
 * the gradients, a verification request, the step, a checkpoint. The
 * VERIFY_CASEs they send are recorded too, for a stage alone (cases). */
static void training(const char *dir, int kind, const char *name, out *cases)
{
    static out o[2];
    nl_stage *st[2] = {stage_at(1, 0), stage_at(2, 0)};
    o[0].len = o[1].len = 0;
    o[0].buf[o[0].len++] = 1;
    o[1].buf[o[1].len++] = 2;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    const uint64_t job = 5;
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = train_job(job, kind);
    for (int i = 0; i < 2; i++) {
        uint64_t id;
        nl_error err;
        rec(&o[i], 0, &m);
        if (nl_stage_job_begin(st[i], &m.u.job_submit, &id, NULL, &err) != NL_OK)
            die("job", &err);
    }
    const int32_t tok[2][4] = {{1, 2, 3, 4}, {5, 6, 7, 8}},
                  tgt[2][4] = {{2, 3, 4, 5}, {6, 7, 8, 9}};
    const int64_t sh[2] = {1, 4};
    /* the step's counting pass and its microbatches */
    for (int h = 0; h < 2; h++) {
        for (uint32_t mb = 0; mb < 2; mb++) {
            nl_wire_msg_reset(&m, h == 0 ? NL_MSG_COUNT : NL_MSG_ACTIVATION);
            m.u.hop = (nl_msg_tensor_hop){job, 1, mb, 0, 0, 0.0};
            nl_wire_frame_set(&m.frames[0], tok[mb], NL_DTYPE_I32, sh, 2);
            nl_wire_frame_set(&m.frames[1], tgt[mb], NL_DTYPE_I32, sh, 2);
            m.nframes = h == 0 ? 1 : 2;
            give(st, o, 0, 0, &m);
        }
        pump(st, o);
    }
    if (kind == NL_JOB_TRAIN) { /* between the gradients and the step */
        for (int i = 0; i < 2; i++) {
            nl_wire_msg_reset(&m, NL_MSG_VERIFY_REQ);
            m.u.verify_req = (nl_msg_verify_req){job, 1, (uint32_t)i, NL_VERIFY_OUTPUTS};
            give(st, o, i, 0, &m);
        }
        for (int k = 0; k < nkept; k++)
            if (kept[k].m.type == NL_MSG_VERIFY_CASE) {
                kept[k].m.u.verify_case.config_json = cfg_json; /* as the coordinator does */
                rec(cases, 0, &kept[k].m);
                rec(&o[kept[k].stage], 0, &kept[k].m);
            }
        drop_kept();
    }
    /* an evaluation (it waits for the step), the step, a checkpoint */
    nl_wire_msg_reset(&m, NL_MSG_EVAL);
    m.u.hop = (nl_msg_tensor_hop){job, 1, 0, 0, 0, 0.0};
    nl_wire_frame_set(&m.frames[0], tok[0], NL_DTYPE_I32, sh, 2);
    nl_wire_frame_set(&m.frames[1], tgt[0], NL_DTYPE_I32, sh, 2);
    m.nframes = 2;
    give(st, o, 0, 0, &m);
    for (int i = 0; i < 2; i++) {
        nl_wire_msg_reset(&m, NL_MSG_STEP);
        m.u.step = (nl_msg_step){job, 1, true, 1.0, 1e-3};
        give(st, o, i, 0, &m);
    }
    pump(st, o);
    for (int i = 0; i < 2; i++) {
        nl_wire_msg_reset(&m, NL_MSG_CKPT_REQ);
        m.u.ckpt_req = (nl_msg_ckpt_req){job, 1, "ck"};
        rec(&o[i], 0, &m); /* written under the fuzz target's root, not here */
    }
    nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
    m.u.job_ref.job_id = job;
    for (int i = 0; i < 2; i++) {
        rec(&o[i], 0, &m);
        nl_stage_destroy(&st[i]);
    }
    if (kind == NL_JOB_FINETUNE) /* the adapter written, in a session and a forward job */
        for (int i = 0; i < 2; i++)
            adapter_uses(&o[i], i);
    nl_wire_msg_free(&m);
    char fn[64];
    snprintf(fn, sizeof fn, "%s-first", name);
    fuzz_save(dir, fn, &o[0]);
    snprintf(fn, sizeof fn, "%s-last", name);
    fuzz_save(dir, fn, &o[1]);
}

static nl_wire_param gen_params[4];

static void session(nl_wire_msg *m, uint64_t id, int capacity, int limit)
{
    gen_params[0] = (nl_wire_param){.key = "session", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)id};
    gen_params[1] = (nl_wire_param){.key = "capacity", .kind = NL_WIRE_PARAM_INT, .i = capacity};
    gen_params[2] = (nl_wire_param){.key = "limit", .kind = NL_WIRE_PARAM_INT, .i = limit};
    gen_params[3] = (nl_wire_param){.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = 0.7};
    nl_wire_msg_reset(m, NL_MSG_JOB_SUBMIT);
    m->u.job_submit = (nl_msg_job_submit){NL_JOB_GENERATE, 4, gen_params};
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: stage_corpus DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    mkdir(dir, 0755);
    nl_log_set_level(NL_LOG_ERROR);
    cfg_json = model_json();
    nl_error err;
    const nl_backend_opts bo = {.threads = 1};
    if (nl_backend_new(&be, "cpu", &bo, &err) != NL_OK)
        die("backend", &err);
    static out o;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    const int32_t ids[5] = {3, 1, 4, 1, 5};
    float hid[5 * HIDDEN];
    for (int i = 0; i < 5 * HIDDEN; i++)
        hid[i] = (float)((i * 7) % 11) / 11.0f - 0.5f;

    /* a stage alone: a session that feeds itself 3 tokens, and another
     * fed by hand, closed in the middle */
    o.len = 0;
    o.buf[o.len++] = 0;
    session(&m, 7, 12, 3);
    rec(&o, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){7, 0, 0, 7, 0, 0.0};
    int64_t sh[3] = {1, 5, HIDDEN};
    nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, sh, 2);
    m.nframes = 1;
    rec(&o, 1, &m);
    session(&m, 8, 8, 0);
    rec(&o, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){8, 0, 0, 8, 0, 0.0};
    sh[1] = 2;
    nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, sh, 2);
    m.nframes = 1;
    rec(&o, 1, &m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
    m.u.job_ref.job_id = 8;
    rec(&o, 0, &m);
    fuzz_save(dir, "generate-alone", &o);

    /* prompts in chunks of 4: session 1's prompt takes the chunk, session
     * 2's two hops wait, its second behind its first */
    o.len = 0;
    o.buf[o.len++] = 16;
    for (uint64_t id = 1; id <= 2; id++) {
        session(&m, id, 12, 0);
        rec(&o, 0, &m);
    }
    const struct {
        uint64_t id, pos;
        int T;
    } hops[3] = {{1, 0, 4}, {2, 0, 2}, {2, 2, 1}};
    for (int k = 0; k < 3; k++) {
        nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
        m.u.hop = (nl_msg_tensor_hop){hops[k].id, 0, 0, hops[k].id, hops[k].pos, 0.0};
        sh[0] = 1;
        sh[1] = hops[k].T;
        nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, sh, 2);
        m.nframes = 1;
        rec(&o, k == 2, &m);
    }
    fuzz_save(dir, "queued-behind", &o);

    /* a forward job on a stage alone: logits for 2 x 2 ids */
    o.len = 0;
    o.buf[o.len++] = 0;
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){2, 0, 0, 0, 0, 0.0};
    sh[0] = 2;
    sh[1] = 2;
    nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, sh, 2);
    m.nframes = 1;
    rec(&o, 0, &m);
    fuzz_save(dir, "forward-alone", &o);

    /* the last of two (bf16 KV caches, prompts in chunks of 4): a prompt
     * of 5 hidden states, then one more position; and a middle stage on
     * the bf16 wire, its hidden states in BF16 */
    for (int v = 0; v < 2; v++) {
        o.len = 0;
        o.buf[o.len++] = v == 0 ? (uint8_t)(2 | 8 | 16) : (uint8_t)(3 | 4);
        session(&m, 9, 10, 0);
        rec(&o, 0, &m);
        uint16_t hb[5 * HIDDEN];
        for (int i = 0; i < 5 * HIDDEN; i++) {
            uint32_t u;
            memcpy(&u, &hid[i], 4);
            hb[i] = (uint16_t)(u >> 16);
        }
        for (int k = 0; k < 2; k++) {
            nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
            m.u.hop = (nl_msg_tensor_hop){9, 0, 0, 9, k ? 5 : 0, 0.0};
            sh[0] = 1;
            sh[1] = k ? 1 : 5;
            sh[2] = HIDDEN;
            if (v == 0)
                nl_wire_frame_set(&m.frames[0], hid, NL_DTYPE_F32, sh, 3);
            else
                nl_wire_frame_set(&m.frames[0], hb, NL_DTYPE_BF16, sh, 3);
            m.nframes = 1;
            rec(&o, 1, &m);
        }
        fuzz_save(dir, v == 0 ? "generate-last" : "generate-middle-bf16", &o);
    }

    /* training and fine-tuning on two stages; the verification cases on
     * a stage alone (a verifier holding no job) */
    static out cases;
    cases.len = 0;
    cases.buf[cases.len++] = 0;
    training(dir, NL_JOB_TRAIN, "train", &cases);
    fuzz_save(dir, "verify-cases", &cases);
    training(dir, NL_JOB_FINETUNE, "finetune", &cases);

    /* an embedding job on a stage alone: 2 texts of 3 and 2 positions */
    o.len = 0;
    o.buf[o.len++] = 0;
    nl_wire_param ep[4] = {{.key = "job", .kind = NL_WIRE_PARAM_INT, .i = 4},
                           {.key = "batch", .kind = NL_WIRE_PARAM_INT, .i = 2},
                           {.key = "seq", .kind = NL_WIRE_PARAM_INT, .i = 3},
                           {.key = "lengths", .kind = NL_WIRE_PARAM_STR, .s = "3,2"}};
    nl_wire_msg_reset(&m, NL_MSG_JOB_SUBMIT);
    m.u.job_submit = (nl_msg_job_submit){NL_JOB_EMBED, 4, ep};
    rec(&o, 0, &m);
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){4, 0, 0, 0, 0, 0.0};
    sh[0] = 2;
    sh[1] = 3;
    const int32_t eids[6] = {1, 2, 3, 4, 5, 0};
    nl_wire_frame_set(&m.frames[0], eids, NL_DTYPE_I32, sh, 2);
    m.nframes = 1;
    rec(&o, 0, &m);
    fuzz_save(dir, "embed-alone", &o);

    ring_training(dir);

    /* a new plan: the stage alone again at epoch 2, one tensor loaded in
     * two chunks, the load done */
    o.len = 0;
    o.buf[o.len++] = 1;
    nl_wire_msg_reset(&m, NL_MSG_ASSIGN);
    m.u.assign = assign_of(0, 0, 0, cfg_json);
    m.u.assign.epoch = 2;
    rec(&o, 0, &m);
    nl_stage *alone = stage_at(0, 0); /* its tensors, the first in two chunks */
    const nl_model *md = nl_stage_model(alone);
    float *w = malloc(md->n_params * sizeof *w);
    be->download(be, w, md->params, md->n_params * sizeof *w);
    for (int t = 0; t < md->n_table; t++) {
        const nl_param *pa = &md->table[t];
        const uint64_t n = (uint64_t)pa->shape[0] * (uint64_t)(pa->ndim == 2 ? pa->shape[1] : 1);
        const uint32_t chunks = t == 0 ? 2 : 1;
        for (uint32_t c = 0; c < chunks; c++) {
            const uint64_t at = c ? n / 2 : 0, len = chunks == 1 ? n : c ? n - n / 2 : n / 2;
            nl_wire_msg_reset(&m, NL_MSG_LAYER_LOAD);
            m.u.layer_load = (nl_msg_layer_load){.epoch = 2,
                                                 .name = pa->name,
                                                 .ndim = pa->ndim,
                                                 .offset = at,
                                                 .chunk = c,
                                                 .chunks = chunks};
            memcpy(m.u.layer_load.shape, pa->shape, sizeof pa->shape);
            const int64_t cs[1] = {(int64_t)len};
            nl_wire_frame_set(&m.frames[0], w + pa->offset + at, NL_DTYPE_F32, cs, 1);
            m.nframes = 1;
            rec(&o, 0, &m);
        }
    }
    nl_wire_msg_reset(&m, NL_MSG_LOAD_DONE);
    m.u.load_done = (nl_msg_load_done){2, 1, (uint32_t)md->n_table, md->n_params * 4};
    rec(&o, 0, &m);
    free(w);
    nl_stage_destroy(&alone);
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){3, 0, 0, 0, 0, 0.0};
    sh[0] = 1;
    sh[1] = 3;
    nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, sh, 2);
    m.nframes = 1;
    rec(&o, 0, &m);
    fuzz_save(dir, "reload", &o);

    nl_wire_msg_free(&m);
    nl_backend_destroy(&be);
    free(cfg_json);
    return 0;
}
