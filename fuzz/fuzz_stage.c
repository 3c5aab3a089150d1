/* Fuzz target for a pipeline stage's messages (node/stage.h): what a
 * node's neighbours and its coordinator send it, dispatched to a loaded
 * stage as neuronode's loop does (node/node.c, node/node_jobs.c), in one
 * process and without sockets.
 *
 * Each input gets a fresh stage of a small model (3 layers of width 16, 2
 * experts, a vocabulary of 64) on the CPU, its weights drawn from a seed.
 * The input:
 *   byte 0      bits 0-1: where the stage sits (0: alone, layers [0, 3);
 *               1: first of 2, [0, 2); 2: last of 2, [2, 3); 3: middle of
 *               3, [1, 2)); bit 2: the bf16 wire; bit 3: bf16 KV caches;
 *               bit 4: prompts in chunks of 4 positions; bit 5: two
 *               replicas on this node (run one after the other); bit 6:
 *               one of the stage's 2 replicas on different nodes (the
 *               REDUCE ring), replica 0 or (bit 7) 1
 *   records     at most 64, each:
 *     byte 0    bit 0: run a batch of the queued session hops after it
 *     byte 1    the number of frames (0..16; taken modulo 17)
 *     u16 LE + n  the header, then each frame likewise
 * A record that does not decode is skipped, as the transport would. Each
 * part is copied into a heap block of exactly its size (ASan sees reads
 * past its end). At the end the queued hops run until none is left. As the
 * node would give them, a CKPT_REQ's directory and a job's params.adapter
 * are confined to a checkpoint root (a relative one is taken under it, so
 * that the corpus can name one).
 *
 * Properties: no crash, no sanitizer report, no leak; every output a hop
 * gives is of its kind's shape (hidden states [B, T, 16], logits over the
 * vocabulary, a token below it); a session's results come in the order of
 * its positions; every message the stage sends encodes within the wire's
 * default limits and decodes again.
 *
 * Built with -DNL_STAGE_CORPUS_MAIN it is instead the seed corpus writer
 * (fuzz/corpus/stage): `stage_corpus DIR` runs real stages and records the
 * messages they exchange (generation, forward jobs, training and
 * fine-tuning steps, verification cases, a reload). */
#define _XOPEN_SOURCE 700 /* nftw, mkdtemp */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "core/formats/fileio.h"
#include "core/model/config.h"
#include "core/model/kvcache.h"
#include "kernels/backend.h"
#include "net/wire.h"
#include "node/stage.h"
#include "node/stage_verify.h"

#include "fuzz/coord_state.h"
#include "fuzz/records.h"

#define LAYERS 3
#define HIDDEN 16
#define VOCAB 64
#define MAX_RECORDS 64
#define SEED 77

/* The small model: 3 layers of width 16 (2 heads, 1 of keys and values),
 * 2 experts of 16, a vocabulary of 64, sequences up to 16. */
static char *model_json(void)
{
    nl_config c;
    nl_config_init(&c);
    c.hidden_dim = HIDDEN;
    c.num_layers = LAYERS;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.ffn_dim = 16;
    c.num_experts = 2;
    c.vocab_size = VOCAB;
    c.vocab_chunk = VOCAB;
    c.max_seq_len = 16;
    nl_error err;
    if (nl_config_validate(&c, 1, &err) != NL_OK) {
        fprintf(stderr, "fuzz_stage: the model: %s\n", err.msg);
        abort();
    }
    return nl_config_to_json(&c);
}

/* Where each of the 4 positions sits: stage, stages, layers. */
static const int place[4][4] = {{0, 1, 0, 3}, {0, 2, 0, 2}, {1, 2, 2, 3}, {1, 3, 1, 2}};

/* The stage at pos; ring 1 + r: replica r of 2 on different nodes. */
static nl_msg_assign assign_of(int pos, int wire_bf16, int ring, const char *cfg)
{
    const int *p = place[pos & 3];
    return (nl_msg_assign){.epoch = 1,
                           .node_id = 1,
                           .stage = (uint32_t)p[0],
                           .num_stages = (uint32_t)p[1],
                           .layer0 = (uint32_t)p[2],
                           .layer1 = (uint32_t)p[3],
                           .has_embed = p[0] == 0,
                           .has_head = p[0] + 1 == p[1],
                           .config_json = cfg,
                           .seed = SEED,
                           .prev_endpoint = "",
                           .prev_key = "",
                           .next_endpoint = "",
                           .next_key = "",
                           .wire = wire_bf16 ? NL_WIRE_BF16 : NL_WIRE_FP32,
                           .replica = ring ? (uint32_t)(ring - 1) : 0,
                           .replicas = ring ? 2 : 0,
                           .ring_endpoint = ring ? "tcp://127.0.0.1:9" : NULL,
                           .ring_key = "",
                           .ring_prev_key = ""};
}

#ifndef NL_STAGE_CORPUS_MAIN

static char *cfg_json;
static nl_backend *be[2];
static char root[64]; /* the stages' --checkpoint-root */
static int verbose;   /* NL_FUZZ_VERBOSE: each call's outcome on stderr */

static void said(const char *what, nl_status st, const nl_error *err)
{
    if (verbose)
        fprintf(stderr, "  %s: %s\n", what, st == NL_OK ? "ok" : err->msg);
}

static void remove_root(void)
{
    coord_state_remove(root);
}

static void setup(void)
{
    verbose = getenv("NL_FUZZ_VERBOSE") != NULL;
    nl_log_set_level(verbose ? NL_LOG_DEBUG : NL_LOG_OFF);
    cfg_json = model_json();
    nl_error err;
    const nl_backend_opts bo = {.threads = 1};
    for (int i = 0; i < 2; i++)
        if (nl_backend_new(&be[i], "cpu", &bo, &err) != NL_OK) {
            fprintf(stderr, "fuzz_stage: backend: %s\n", err.msg);
            abort();
        }
    snprintf(root, sizeof root, "/tmp/nl_fuzz_stage_XXXXXX");
    if (!mkdtemp(root))
        abort();
    atexit(remove_root);
}

/* What the stage sends encodes within the default limits, and decodes. */
static void check_sendable(nl_wire_msg *m)
{
    const nl_wire_limits lim = nl_wire_limits_default();
    nl_wire_wbuf w = {0};
    nl_error err;
    if (nl_wire_encode(m, &w, &lim, &err) != NL_OK) {
        fprintf(stderr, "fuzz_stage: the stage sent a %s that does not encode: %s\n",
                nl_wire_type_name(m->type), err.msg);
        abort();
    }
    nl_wire_part parts[1 + NL_WIRE_MAX_FRAMES];
    parts[0] = (nl_wire_part){w.data, w.len};
    for (int i = 0; i < m->nframes; i++)
        parts[1 + i] = (nl_wire_part){m->frames[i].t.data, m->frames[i].len};
    nl_wire_msg back;
    nl_wire_msg_init(&back);
    if (nl_wire_decode(&back, parts, 1 + m->nframes, &lim, &err) != NL_OK) {
        fprintf(stderr, "fuzz_stage: the stage sent a %s that does not decode: %s\n",
                nl_wire_type_name(m->type), err.msg);
        abort();
    }
    nl_wire_msg_free(&back);
    nl_wire_wbuf_free(&w);
}

static nl_status sent(void *ctx, nl_stage_dest to, nl_wire_msg *m, nl_error *err)
{
    (void)ctx, (void)err;
    if (verbose)
        fprintf(stderr, "    sent %s to %d\n", nl_wire_type_name(m->type), (int)to);
    check_sendable(m);
    return NL_OK;
}

/* A hop's output is of its kind's shape. */
static void check_out(const nl_stage *s, const nl_stage_out *o)
{
    const nl_model *md = nl_stage_model(s);
    int ok = 1;
    if (o->kind == NL_STAGE_OUT_TOKEN)
        ok = o->token >= 0 && o->token < VOCAB;
    else if (o->kind == NL_STAGE_OUT_HIDDEN)
        ok = o->ndim == 3 && o->shape[0] == o->B && o->shape[1] == o->T &&
             o->shape[2] == md->cfg.hidden_dim && o->data;
    else if (o->kind == NL_STAGE_OUT_LOGITS)
        ok = o->ndim >= 2 && o->shape[0] == o->B && o->data &&
             (o->shape[o->ndim - 1] == md->cfg.vocab_size ||
              o->shape[o->ndim - 1] == md->cfg.hidden_dim);
    else
        ok = 0;
    if (!ok) {
        fprintf(stderr, "fuzz_stage: an output of kind %d, shape [%lld, %lld, %lld] (ndim %d)\n",
                (int)o->kind, (long long)o->shape[0], (long long)o->shape[1],
                (long long)o->shape[2], o->ndim);
        abort();
    }
}

/* A token the last stage sampled goes back to the first (the token ring):
 * queued here when this stage is the first too, as node_jobs.c does. */
static void feed_back(nl_stage *s, const nl_msg_tensor_hop *hop, const nl_stage_out *o)
{
    const nl_model *md = nl_stage_model(s);
    if (!o->feed || !md || !md->has_embed)
        return;
    const nl_msg_tensor_hop next = {hop->job_id, 0, 0, hop->session_id, (uint64_t)o->feed_pos, 0.0};
    const int64_t shape[2] = {1, 1};
    nl_wire_frame f = {0};
    nl_wire_frame_set(&f, &o->token, NL_DTYPE_I32, shape, 2);
    nl_error err;
    said("the token fed back", nl_stage_enqueue(s, &next, &f, &err), &err);
}

/* The sessions' results so far: each session's next position. A result
 * comes in the order of its session's positions (a later hop never runs
 * before an earlier one); forgotten when a job begins or ends (a session
 * opened again starts over). */
#define TRACKED 64
static struct {
    uint64_t id, next;
} order[TRACKED];
static int n_order;

static void check_order(uint64_t id, uint64_t pos, int T)
{
    int i = 0;
    while (i < n_order && order[i].id != id)
        i++;
    if (i < n_order && pos < order[i].next) {
        fprintf(stderr, "fuzz_stage: session %llu's result at %llu after one up to %llu\n",
                (unsigned long long)id, (unsigned long long)pos, (unsigned long long)order[i].next);
        abort();
    }
    if (i == n_order && n_order < TRACKED)
        order[n_order++].id = id;
    if (i < n_order)
        order[i].next = pos + (uint64_t)T;
}

static void run_batch(nl_stage *s)
{
    const nl_stage_result *r = NULL;
    int k = 0;
    nl_error err;
    said("a batch", nl_stage_run_batch(s, &r, &k, &err), &err);
    for (int i = 0; i < k; i++) {
        if (verbose)
            fprintf(stderr, "    session %llu: %s\n", (unsigned long long)r[i].session_id,
                    r[i].st == NL_OK ? "ok" : r[i].msg);
        if (r[i].st != NL_OK)
            continue;
        check_out(s, &r[i].out);
        check_order(r[i].session_id, r[i].pos_offset, r[i].out.T);
        const nl_msg_tensor_hop hop = {r[i].job_id, 0, 0, r[i].session_id, r[i].pos_offset, 0.0};
        feed_back(s, &hop, &r[i].out);
    }
}

/* A relative path under the root, else as it is (in out, of n bytes). */
static const char *under_root(const char *path, char *out, size_t n)
{
    if (!path || path[0] == '/')
        return path;
    snprintf(out, n, "%s/%s", root, path);
    return out;
}

/* A training message, as node_handle_train takes it (CKPT_REQ's
 * directory confined to the root first). */
static void train(nl_stage *s, const nl_wire_msg *m)
{
    if (!nl_stage_job_holds(s, m))
        return;
    nl_error err;
    if (m->type != NL_MSG_CKPT_REQ) {
        said(nl_wire_type_name(m->type), nl_stage_job_input(s, m, sent, NULL, &err), &err);
        return;
    }
    char *real = NULL, dir[4200];
    const char *d = under_root(m->u.ckpt_req.dir ? m->u.ckpt_req.dir : "", dir, sizeof dir);
    nl_status st = nl_path_confine(root, d, &real, &err);
    if (st == NL_OK) {
        nl_wire_msg req = *m;
        req.u.ckpt_req.dir = real;
        st = nl_stage_job_input(s, &req, sent, NULL, &err);
    }
    said("CKPT_REQ", st, &err);
    free(real);
}

static void activation(nl_stage *s, const nl_wire_msg *m)
{
    const nl_msg_tensor_hop *hop = &m->u.hop;
    nl_error err;
    if (hop->session_id && nl_stage_session_closed(s, hop->session_id))
        return;
    if (hop->session_id) {
        said("a session's hop queued", nl_stage_enqueue(s, hop, &m->frames[0], &err), &err);
        return;
    }
    nl_stage_out out;
    const nl_status st = nl_stage_forward(s, hop, &m->frames[0], &out, &err);
    said("a forward", st, &err);
    if (st == NL_OK)
        check_out(s, &out);
}

static void verify(nl_stage *s, const nl_wire_msg *m)
{
    nl_error err;
    const nl_status pushed = nl_stage_verify_push(s, m, &err);
    said("VERIFY_CASE", pushed, &err);
    if (pushed != NL_OK)
        return;
    nl_wire_msg out;
    nl_wire_msg_init(&out);
    char hex[3][NL_HOP_DIGEST_HEX + 1];
    nl_status st;
    while (nl_stage_verify_pop(s, true, &out, hex, &st, &err)) {
        said("its answer", st, &err);
        if (st == NL_OK)
            check_sendable(&out);
        nl_wire_msg_free(&out);
        nl_wire_msg_init(&out);
    }
    nl_wire_msg_free(&out);
}

/* JOB_SUBMIT, its params.adapter (a string) under the root. */
static void submit(nl_stage *s, const nl_msg_job_submit *j)
{
    nl_wire_param ps[64 /* the wire's most */];
    char path[4200];
    nl_msg_job_submit c = *j;
    if (j->nparams <= sizeof ps / sizeof ps[0]) {
        memcpy(ps, j->params, j->nparams * sizeof *ps);
        for (uint32_t i = 0; i < j->nparams; i++)
            if (ps[i].kind == NL_WIRE_PARAM_STR && ps[i].key && !strcmp(ps[i].key, "adapter"))
                ps[i].s = under_root(ps[i].s, path, sizeof path);
        c.params = ps;
    }
    nl_error err;
    uint64_t job;
    said("JOB_SUBMIT", nl_stage_job_begin(s, &c, &job, NULL, &err), &err);
}

/* node.c's on_control and on_data, for what reaches the stage. */
static void dispatch(nl_stage *s, const nl_wire_msg *m)
{
    nl_error err;
    bool stale;
    nl_stage_loaded info;
    switch (m->type) {
    case NL_MSG_ASSIGN:
        said("ASSIGN", nl_stage_assign(s, &m->u.assign, &err), &err);
        break;
    case NL_MSG_LAYER_LOAD:
        said("LAYER_LOAD", nl_stage_load_chunk(s, &m->u.layer_load, &m->frames[0], &stale, &err),
             &err);
        break;
    case NL_MSG_LOAD_DONE:
        said("LOAD_DONE",
             nl_stage_load_done(s, m->u.load_done.epoch, m->u.load_done.tensors, &info, &stale,
                                &err),
             &err);
        break;
    case NL_MSG_ACTIVATION:
    case NL_MSG_COUNT:
    case NL_MSG_EVAL:
        if (m->type != NL_MSG_ACTIVATION || m->u.hop.step != 0)
            train(s, m);
        else
            activation(s, m);
        break;
    case NL_MSG_GRADIENT:
    case NL_MSG_STEP:
    case NL_MSG_CKPT_REQ:
    case NL_MSG_VERIFY_REQ:
    case NL_MSG_REDUCE:
        train(s, m);
        break;
    case NL_MSG_VERIFY_CASE:
        verify(s, m);
        break;
    case NL_MSG_JOB_SUBMIT:
        n_order = 0;
        submit(s, &m->u.job_submit);
        break;
    case NL_MSG_JOB_CANCEL:
        n_order = 0;
        nl_stage_job_end(s, m->u.job_ref.job_id);
        break;
    default:
        break;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready = 0;
    if (!ready) {
        setup();
        ready = 1;
    }
    if (size < 1)
        return 0;
    const int how = data[0];
    nl_stage_opts o = {.memory_bytes = 64ull << 20,
                       .kv_budget = 64 << 10,
                       .kv_cache = how & 8 ? NL_KV_BF16 : NL_KV_FP32,
                       .send_wait_ms = 100,
                       .ckpt_root = root,
                       .prefill_chunk = how & 16 ? 4 : 0,
                       .batch_wait_ms = -1,
                       .replicas_inline = 1};
    nl_stage *s = NULL;
    nl_error err;
    if (nl_stage_new_replicas(&s, be, how & 32 ? 2 : 1, NULL, &o, &err) != NL_OK) {
        fprintf(stderr, "fuzz_stage: the stage: %s\n", err.msg);
        abort();
    }
    const nl_msg_assign a =
        assign_of(how & 3, how & 4, how & 64 ? 1 + (how >> 7 & 1) : 0, cfg_json);
    nl_stage_loaded info;
    bool stale;
    if (nl_stage_assign(s, &a, &err) != NL_OK ||
        nl_stage_load_done(s, 1, 0, &info, &stale, &err) != NL_OK) {
        fprintf(stderr, "fuzz_stage: the stage's assignment: %s\n", err.msg);
        abort();
    }
    n_order = 0;
    const nl_wire_limits lim = nl_wire_limits_default();
    const uint8_t *p = data + 1;
    size_t left = size - 1;
    for (int r = 0; r < MAX_RECORDS && left >= 2; r++) {
        const int batch = p[0] & 1;
        const int nparts = 1 + p[1] % (NL_WIRE_MAX_FRAMES + 1);
        p += 2;
        left -= 2;
        nl_wire_part parts[1 + NL_WIRE_MAX_FRAMES];
        void *bufs[1 + NL_WIRE_MAX_FRAMES] = {0};
        fuzz_parts_read(&p, &left, nparts, parts, bufs);
        nl_wire_msg m;
        nl_wire_msg_init(&m);
        if (nl_wire_decode(&m, parts, nparts, &lim, &err) == NL_OK)
            dispatch(s, &m);
        nl_wire_msg_free(&m);
        fuzz_parts_free(bufs, nparts);
        if (batch)
            run_batch(s);
    }
    for (int i = 0; i < 64 && nl_stage_queued(s) > 0; i++)
        run_batch(s);
    nl_stage_destroy(&s);
    /* what the checkpoints wrote: none for the next input */
    coord_state_remove(root);
    if (mkdir(root, 0700) != 0)
        abort();
    return 0;
}

#else /* the seed corpus writer */

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

#endif
