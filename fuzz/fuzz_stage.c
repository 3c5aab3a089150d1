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
 * Its seed corpus (fuzz/corpus/stage) is written by stage_corpus.c. */
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
#include "fuzz/stage_model.h"

#define MAX_RECORDS 64

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
