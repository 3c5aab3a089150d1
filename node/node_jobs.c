/* The handlers of the node's messages, called by the event loop in node.c:
 * assignment and loading, inference and embedding jobs, and training (the
 * stage does the work; these send its results through the links to the
 * neighbours, node_links.c). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "core/formats/fileio.h"
#include "core/plan/planner.h"
#include "net/transport.h"
#include "node/node_impl.h"
#include "node/stage.h"

/* ===================== the stage's next replica ===================== */

void node_drop_ring(node *n)
{
    nl_sock_destroy(&n->ring);
    n->ring_ep[0] = n->ring_key[0] = '\0';
}

/* Connect the socket to the stage's next replica on first use (after
 * every stage answered LOAD_DONE, as the next stage's socket). */
static nl_status ensure_ring(node *n, nl_error *err)
{
    if (n->ring)
        return NL_OK;
    if (!n->ring_ep[0])
        return nl_error_set(err, NL_ERR_STATE, "this stage has no other replica");
    nl_status st = node_make_socket(n, &n->ring, ZMQ_DEALER, false, n->ring_key, "ring",
                                    NL_SOCK_BULK, 0, 0, err);
    if (st == NL_OK && (st = nl_sock_connect(n->ring, n->ring_ep, err)) != NL_OK)
        nl_sock_destroy(&n->ring);
    return st;
}

/* ===================== assignment and loading ===================== */

void node_handle_assign(node *n, const nl_msg_assign *a)
{
    nl_error e;
    if (a->node_id != n->node_id) {
        node_send_error(n, NL_ERR_INVALID, NL_MSG_ASSIGN,
                        "ASSIGN epoch %llu is for node %u; this is %u",
                        (unsigned long long)a->epoch, a->node_id, n->node_id);
        return;
    }
    node_drop_next(n); /* drops what was queued for the old next stage */
    node_drop_prev(n);
    node_drop_ring(n);
    n->links = 0;
    n->load_pending = false;
    n->next_ep[0] = n->next_key[0] = '\0';
    n->prev_rid_len = 0;
    node_wait_sent(n);
    nl_status st = nl_stage_assign(n->stage, a, &e);
    /* the data socket admits the previous stage, unless this node dials
     * it, a next stage that dials in (node_links.c) and the stage's
     * previous replica */
    const char *keys[3 + NL_REDUCE_MAX_REPLICAS];
    size_t nk = 0;
    node_fan_assign(n, a); /* and the previous stage's replicas, with another count */
    for (int k = 0; k < n->n_fan_prev; k++)
        keys[nk++] = n->fan_prev_key[k];
    if (a->prev_key[0] && !(a->links & NL_NODE_DIALS_PREV))
        keys[nk++] = a->prev_key;
    if (a->next_key[0] && (a->links & NL_LINK_NEXT_DIALS))
        keys[nk++] = a->next_key;
    if (a->ring_prev_key && a->ring_prev_key[0] && strcmp(a->ring_prev_key, a->prev_key) != 0)
        keys[nk++] = a->ring_prev_key;
    if (st == NL_OK)
        st = nl_sock_allow(n->data, nk ? keys : NULL, nk, &e);
    if (st != NL_OK) {
        nl_sock_allow(n->data, NULL, 0, NULL);
        node_send_error(n, st, NL_MSG_ASSIGN, "%s", e.msg);
        return;
    }
    snprintf(n->next_ep, sizeof n->next_ep, "%s", a->next_endpoint);
    snprintf(n->prev_ep, sizeof n->prev_ep, "%s", a->prev_endpoint);
    snprintf(n->next_key, sizeof n->next_key, "%s", a->next_key);
    node_links_assign(n, a);
    snprintf(n->ring_ep, sizeof n->ring_ep, "%s", a->ring_endpoint ? a->ring_endpoint : "");
    snprintf(n->ring_key, sizeof n->ring_key, "%s", a->ring_key ? a->ring_key : "");
    snprintf(n->prev_key, sizeof n->prev_key, "%s", a->prev_key);
    snprintf(n->ring_prev_key, sizeof n->ring_prev_key, "%s",
             a->ring_prev_key ? a->ring_prev_key : "");
    const nl_model *m = nl_stage_model(n->stage);
    NL_INFO("assigned epoch %llu: stage %u of %u, layers [%u, %u)%s%s, %zu parameters (%.1f MiB, "
            "%.1f MiB planned); prev %s, next %s",
            (unsigned long long)a->epoch, a->stage, a->num_stages, a->layer0, a->layer1,
            a->has_embed ? " + embedding" : "", a->has_head ? " + head" : "", m->n_params,
            (double)m->n_params * 4 / (1 << 20), (double)a->memory_planned / (1 << 20),
            a->prev_endpoint[0] ? a->prev_endpoint : "(coordinator)",
            a->next_endpoint[0] ? a->next_endpoint : "(coordinator)");
}

void node_handle_layer_load(node *n, const nl_wire_msg *m)
{
    nl_error e;
    bool stale = false;
    const nl_msg_layer_load *l = &m->u.layer_load;
    nl_status st = nl_stage_load_chunk(n->stage, l, &m->frames[0], &stale, &e);
    if (st != NL_OK)
        node_send_error(n, st, NL_MSG_LAYER_LOAD, "%s", e.msg);
    else if (stale)
        NL_DEBUG("ignored LAYER_LOAD %s of epoch %llu (current %llu)", l->name,
                 (unsigned long long)l->epoch, (unsigned long long)nl_stage_epoch(n->stage));
}

void node_handle_load_done(node *n, const nl_msg_load_done *d)
{
    nl_error e;
    nl_stage_loaded info;
    bool stale = false;
    nl_status st = nl_stage_load_done(n->stage, d->epoch, d->tensors, &info, &stale, &e);
    if (st != NL_OK) {
        node_send_error(n, st, NL_MSG_LOAD_DONE, "%s", e.msg);
        return;
    }
    if (stale) {
        NL_INFO("ignored LOAD_DONE of epoch %llu (current %llu)", (unsigned long long)d->epoch,
                (unsigned long long)nl_stage_epoch(n->stage));
        return;
    }
    NL_INFO("loaded epoch %llu: %u tensors, %llu bytes in %.2f s%s", (unsigned long long)d->epoch,
            info.tensors, (unsigned long long)info.bytes, info.seconds,
            info.from_seed ? " (initialised from the seed)" : "");
    const nl_msg_load_done done = {d->epoch, n->node_id, info.tensors, info.bytes};
    if (node_hold_load_done(n, &done)) /* no work before the previous stage can reach us */
        return;
    nl_wire_msg_reset(&n->tx, NL_MSG_LOAD_DONE);
    n->tx.u.load_done = done;
    node_send_ctl(n, "LOAD_DONE");
}

/* ===================== jobs ===================== */

/* The token ring: the last stage sends the token it sampled straight to
 * the first stage, at the session's next position (the coordinator only
 * relays the token to the client). A stage that is also the first queues
 * it for its next batch. */
static void feed_first(node *n, const nl_msg_tensor_hop *hop, const nl_stage_out *out)
{
    nl_error e;
    const nl_msg_tensor_hop next = {hop->job_id, 0, 0, hop->session_id, (uint64_t)out->feed_pos,
                                    0.0};
    const nl_model *m = nl_stage_model(n->stage);
    if (m && m->has_embed) {
        const int64_t shape[2] = {1, 1};
        nl_wire_frame f = {0};
        nl_wire_frame_set(&f, &out->token, NL_DTYPE_I32, shape, 2);
        nl_status st = nl_stage_enqueue(n->stage, &next, &f, &e);
        if (st != NL_OK)
            node_fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION, "%s", e.msg);
        return;
    }
    nl_status st = n->next_ep[0] ? NL_OK : nl_error_set(&e, NL_ERR_STATE, "no first stage to feed");
    if (st == NL_OK) {
        const int64_t shape[2] = {1, 1};
        nl_wire_msg_reset(&n->tx, NL_MSG_ACTIVATION);
        n->tx.u.hop = next;
        nl_wire_frame_set(&n->tx.frames[0], &out->token, NL_DTYPE_I32, shape, 2); /* copied */
        n->tx.nframes = 1;
        st = node_send_next(n, &n->tx, &e);
    }
    if (st != NL_OK)
        node_fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION,
                      "job %llu session %llu: cannot feed the token to the first stage at %s: %s",
                      (unsigned long long)hop->job_id, (unsigned long long)hop->session_id,
                      n->next_ep, e.msg);
}

/* Send what a hop gave: a token to the coordinator (and the first
 * stage), logits to the coordinator, hidden states to the next stage. */
static void send_output(node *n, const nl_msg_tensor_hop *hop, const nl_stage_out *o)
{
    nl_error e;
    nl_status st;
    const nl_stage_out out = *o;
    nl_txref *ref = nl_stage_txref(n->stage);
    if (out.kind == NL_STAGE_OUT_TOKEN) {
        if (out.feed) /* first: it is the next token's critical path */
            feed_first(n, hop, &out);
        uint32_t id = (uint32_t)out.token;
        nl_wire_msg_reset(&n->tx, NL_MSG_TOKEN);
        n->tx.u.token = (nl_msg_token){hop->job_id, hop->session_id, 1, &id, out.last, 0, NULL};
        if (out.lp_n > 0) { /* the token's log-probabilities: one F32 frame */
            const int64_t shape[1] = {out.lp_n};
            n->tx.u.token.ntop = (uint32_t)out.lp_n - 1;
            n->tx.u.token.top_ids = out.lp_ids;
            nl_wire_frame_set(&n->tx.frames[0], (void *)out.lp, NL_DTYPE_F32, shape, 1);
            n->tx.nframes = 1;
        }
        node_send_ctl(n, "TOKEN");
        return;
    }
    if (out.kind == NL_STAGE_OUT_LOGITS) {
        nl_wire_msg_reset(&n->tx, NL_MSG_RESULT);
        n->tx.u.hop = (nl_msg_tensor_hop){hop->job_id, 0, 0, 0, hop->pos_offset, out.aux};
        nl_txref_frame(&n->tx.frames[0], ref, out.data, NL_DTYPE_F32, out.shape, out.ndim);
        n->tx.nframes = 1;
        node_send_ctl(n, "RESULT");
        return;
    }
    if (!n->next_ep[0]) {
        node_fail_job(n, hop->job_id, NL_ERR_STATE, NL_MSG_ACTIVATION,
                      "job %llu: this stage has no next stage to send its hidden states to",
                      (unsigned long long)hop->job_id);
        return;
    }
    nl_wire_msg_reset(&n->tx, NL_MSG_ACTIVATION);
    n->tx.u.hop = (nl_msg_tensor_hop){hop->job_id, 0, 0, hop->session_id, hop->pos_offset, out.aux};
    if (nl_stage_wire(n->stage) == NL_WIRE_FP32) /* sent from the output buffer, not copied */
        nl_txref_frame(&n->tx.frames[0], ref, out.data, NL_DTYPE_F32, out.shape, out.ndim);
    else if ((st = nl_stage_hidden_out(n->stage, &n->tx.frames[0], out.data, out.shape, out.ndim,
                                       &e)) != NL_OK) {
        node_fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION, "job %llu: %s",
                      (unsigned long long)hop->job_id, e.msg);
        return;
    }
    n->tx.nframes = 1;
    st = node_send_next(n, &n->tx, &e);
    if (st != NL_OK)
        node_fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION, "job %llu: %s",
                      (unsigned long long)hop->job_id, e.msg);
}

void node_handle_activation(node *n, const nl_wire_msg *m)
{
    nl_error e;
    nl_stage_out out;
    const nl_msg_tensor_hop *hop = &m->u.hop;
    if (hop->session_id && nl_stage_session_closed(n->stage, hop->session_id)) {
        NL_DEBUG("dropped a hop of closed session %llu", (unsigned long long)hop->session_id);
        return; /* in flight when its job ended or was cancelled */
    }
    nl_status st;
    if (hop->session_id) { /* queued: run in the next batch (node_run_batch) */
        if ((st = nl_stage_enqueue(n->stage, hop, &m->frames[0], &e)) != NL_OK)
            node_fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION, "%s", e.msg);
        return;
    }
    node_wait_sent(n);
    int64_t t0 = nl_mono_ms();
    st = nl_stage_forward(n->stage, hop, &m->frames[0], &out, &e);
    n->busy_ms += (double)(nl_mono_ms() - t0);
    if (st != NL_OK) {
        node_fail_job(n, hop->job_id, st, NL_MSG_ACTIVATION, "%s", e.msg);
        return;
    }
    send_output(n, hop, &out);
}

/* Run one batch of the queued session hops and send what finished. */
void node_run_batch(node *n)
{
    nl_error e;
    const nl_stage_result *r = NULL;
    int k = 0;
    node_wait_sent(n);
    if (n->o->inject_slow_hop_ms > 0) {
        const long long ns = (long long)(n->o->inject_slow_hop_ms * 1e6);
        nanosleep(&(struct timespec){(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)}, NULL);
    }
    int64_t t0 = nl_mono_ms();
    nl_status st = nl_stage_run_batch(n->stage, &r, &k, &e);
    n->busy_ms += (double)(nl_mono_ms() - t0);
    for (int i = 0; i < k; i++) {
        const nl_msg_tensor_hop hop = {r[i].job_id,     0,           0, r[i].session_id,
                                       r[i].pos_offset, r[i].out.aux};
        if (r[i].st != NL_OK)
            node_fail_job(n, r[i].job_id, r[i].st, NL_MSG_ACTIVATION, "%s", r[i].msg);
        else
            send_output(n, &hop, &r[i].out);
    }
    if (st != NL_OK) /* the device: the loop stops, and the node leaves */
        NL_ERROR("a batch of sessions: %s", e.msg);
}

/* JOB_SUBMIT of any kind: the stage begins the job (node/stage_jobs.c). */
void node_handle_job_submit(node *n, const nl_msg_job_submit *j)
{
    nl_error e;
    uint64_t job = 0;
    const char *status = NULL;
    nl_status st = nl_stage_job_begin(n->stage, j, &job, &status, &e);
    if (st != NL_OK) { /* job is 0 if the request named none */
        node_fail_job(n, job, st, NL_MSG_JOB_SUBMIT, "%s", e.msg);
        return;
    }
    nl_wire_msg_reset(&n->tx, NL_MSG_JOB_STATUS);
    n->tx.u.job_status = (nl_msg_job_status){job, NL_JOB_RUNNING, 0.0, status, 0};
    node_send_ctl(n, "JOB_STATUS");
}

/* JOB_CANCEL of any kind (or a training job that ends with the node's
 * connection): the stage ends the job; a training job's time is logged. */
void node_end_job(node *n, uint64_t job)
{
    const int kind = nl_stage_job_end(n->stage, job);
    if (kind == NL_JOB_TRAIN || kind == NL_JOB_FINETUNE)
        node_train_summary(n, job);
}

/* ===================== training ===================== */

/* The process's CPU time over the node's compute threads, in ms, on a
 * CPU device; -1 on a GPU (its work is not the host's CPU time). */
static double busy_cpu_ms(const node *n)
{
    if (strncmp(n->dev.be[0]->name, "cuda:", 5) == 0)
        return -1.0;
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ((double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6) / (n->threads > 0 ? n->threads : 1);
}

/* Where the stage's training messages go (nl_stage_send_fn). */
static nl_status train_send_to(node *n, nl_stage_dest to, nl_wire_msg *m, nl_error *err);

/* Sends, timed: what hops cost the stage (bench/bench_pipeline.sh reads
 * the summary logged at the job's end). */
static nl_status train_send(void *ctx, nl_stage_dest to, nl_wire_msg *m, nl_error *err)
{
    node *n = ctx;
    const double t0 = nl_mono_ms_f();
    nl_status st = train_send_to(n, to, m, err);
    const double sent_ms = nl_mono_ms_f() - t0;
    if (nl_mono_ms() >= n->next_hb_ms) /* a long run of queued hops keeps the heartbeat */
        node_send_heartbeat(n);
    n->train_send_ms += sent_ms;
    n->train_hops++;
    for (int i = 0; i < m->nframes; i++)
        n->train_bytes += m->frames[i].len;
    return st;
}

static nl_status train_send_to(node *n, nl_stage_dest to, nl_wire_msg *m, nl_error *err)
{
    if (to == NL_STAGE_TO_COORD)
        return nl_sock_send(n->ctl, NULL, 0, m, err);
    nl_status st;
    if (to == NL_STAGE_TO_RING) {
        st = ensure_ring(n, err);
        if (st == NL_OK)
            st = nl_sock_send(n->ring, NULL, 0, m, err);
        return st == NL_OK
                   ? st
                   : nl_error_prefix(err, "cannot reach the next replica at %s", n->ring_ep);
    }
    if (to == NL_STAGE_TO_PREV && n->n_fan_prev > 0)
        return node_fan_send_prev(n, m, err);
    if (to == NL_STAGE_TO_PREV && node_local_send(n, false, m, &st, err)) /* the local link */
        return st == NL_OK
                   ? st
                   : nl_error_prefix(err, "cannot reach the previous stage at %s", n->prev_ep);
    if (to == NL_STAGE_TO_PREV) {
        if (n->links & NL_NODE_DIALS_PREV) /* back on the link this node dialed */
            st = n->prev_link ? nl_sock_send(n->prev_link, NULL, 0, m, err)
                              : nl_error_set(err, NL_ERR_STATE, "the link is down");
        else if (!n->prev_rid_len)
            return nl_error_set(err, NL_ERR_STATE, "no previous stage has sent to this one");
        else
            st = nl_sock_send(n->data, n->prev_rid, n->prev_rid_len, m, err);
        /* the coordinator names the node behind the endpoint */
        return st == NL_OK
                   ? st
                   : nl_error_prefix(err, "cannot reach the previous stage at %s", n->prev_ep);
    }
    return node_send_next(n, m, err);
}

/* CKPT_REQ.dir confined to the node's checkpoint root (resolved, links
 * followed, missing directories made 0700): *out is the real directory,
 * malloc'd. Without a root the node writes no checkpoints. */
static nl_status ckpt_dir(node *n, const char *dir, char **out, nl_error *err)
{
    *out = NULL;
    if (!n->ckpt_root)
        return nl_error_set(err, NL_ERR_AUTH,
                            "CKPT_REQ: this node has no --checkpoint-root (nor --state-dir): it "
                            "writes no checkpoints");
    nl_status st = nl_path_confine(n->ckpt_root, dir, out, err);
    return st == NL_OK ? st : nl_error_prefix(err, "CKPT_REQ under --checkpoint-root");
}

/* Test hook (NL_TEST_COMPUTE_GFLOPS): the time the evaluation hop m
 * takes at the hook's rate by the planner's cost model (core/plan/planner.h):
 * a forward of its rows through this stage's layers (and embedding or
 * head). Seconds; 0 for other messages. The training hops' time the stage
 * sleeps when their work runs (stage_train_hops.c), which a hop that
 * waits for its step does not yet. */
static double compute_model_s(node *n, const nl_wire_msg *m)
{
    const nl_model *md = nl_stage_model(n->stage);
    if (n->o->inject_compute_gflops <= 0 || !md || m->type != NL_MSG_EVAL || m->nframes < 1 ||
        m->frames[0].t.ndim < 2)
        return 0.0;
    const int rows = (int)(m->frames[0].t.shape[0] * m->frames[0].t.shape[1]),
              seq = (int)m->frames[0].t.shape[1];
    double fwd = (md->l1 - md->l0) * nl_plan_layer_flops(&md->cfg, rows, seq);
    fwd += md->has_head ? nl_plan_head_flops(&md->cfg, rows) : 0.0;
    fwd += md->has_embed ? nl_plan_embed_flops(&md->cfg, rows) : 0.0;
    return fwd / (n->o->inject_compute_gflops * 1e9);
}

/* A training message from any socket: the stage runs what it can. */
void node_handle_train(node *n, const nl_wire_msg *m)
{
    if (m->type == NL_MSG_CKPT_REQ) /* writing a shard takes a while: be heard first */
        node_send_heartbeat(n);
    nl_error e;
    const double a_ms = nl_mono_ms_f();
    const double cpu0 = busy_cpu_ms(n);
    if (!n->train_t0)
        n->train_t0 = nl_mono_ms();
    if (!nl_stage_job_holds(n->stage,
                            m)) { /* in flight when its job ended, or from a former plan */
        NL_DEBUG("dropped a %s of a job this stage does not train (or of a former plan)",
                 nl_wire_type_name(m->type));
        return;
    }
    const uint64_t job = nl_stage_job_of(m); /* a training or fine-tuning job */
    const double model_s = compute_model_s(n, m);
    if (model_s > 0) { /* the compute model's time before the hop's outputs, as busy time */
        const double whole = (double)(time_t)model_s;
        nanosleep(&(struct timespec){(time_t)whole, (long)((model_s - whole) * 1e9)}, NULL);
        n->busy_ms += model_s * 1e3;
    }
    char *real = NULL;
    nl_status st = NL_OK;
    if (m->type == NL_MSG_CKPT_REQ && (st = ckpt_dir(n, m->u.ckpt_req.dir, &real, &e)) == NL_OK) {
        nl_wire_msg req = *m; /* the stage writes into the real directory */
        req.u.ckpt_req.dir = real;
        st = nl_stage_job_input(n->stage, &req, train_send, n, &e);
    } else if (st == NL_OK) {
        st = nl_stage_job_input(n->stage, m, train_send, n, &e);
    }
    free(real);
    if ((n->o->inject_slow_ms > 0 || n->o->inject_slow_x > 1) && m->type != NL_MSG_CKPT_REQ) {
        /* test hook: this much more work (CPU time, as the busy time is
         * counted on the CPU; on a GPU, wall time) */
        const double work = cpu0 >= 0 ? busy_cpu_ms(n) - cpu0 : nl_mono_ms_f() - a_ms;
        const double more = n->o->inject_slow_ms +
                            (n->o->inject_slow_x > 1 ? (n->o->inject_slow_x - 1) * work : 0.0);
        const double until = busy_cpu_ms(n) + more, t0 = nl_mono_ms_f();
        while (cpu0 >= 0 ? busy_cpu_ms(n) < until : nl_mono_ms_f() - t0 < more)
            ;
    }
    const double ms = nl_mono_ms_f() - a_ms;
    /* the stage's busy time (heartbeats' load, which the coordinator
     * re-balances by): on the CPU, the CPU time its threads computed, so
     * that other processes on the cores do not make it look slower */
    /* the compute model's sleeps on the stage since the last message (on
     * its lanes they may end after the call: the next one counts them) */
    const double slept = nl_stage_modelled_s(n->stage); /* a new stage's count starts at 0 */
    const double model_ms = (slept >= n->modelled_s ? slept - n->modelled_s : slept) * 1e3;
    n->modelled_s = slept;
    if (m->type != NL_MSG_CKPT_REQ) /* writing a checkpoint is not the stage's pace */
        n->busy_ms += cpu0 >= 0 ? busy_cpu_ms(n) - cpu0 + model_ms : ms;
    n->train_busy_ms += ms;
    if (st != NL_OK)
        node_fail_job(n, job, st, m->type, "%s", e.msg);
}

/* How the ended job's time went on this node. */
void node_train_summary(node *n, uint64_t job)
{
    const double wall = n->train_t0 ? (double)(nl_mono_ms() - n->train_t0) : 0.0;
    const double compute = n->train_busy_ms - n->train_send_ms;
    NL_INFO("train job %llu ended: %.1f s, of which computing %.1f s (%.0f%%), sending %llu "
            "messages (%.1f MiB: %llu bytes of %s tensors) %.3f s (%.1f%%), waiting %.1f s "
            "(%.0f%%)",
            (unsigned long long)job, wall / 1e3, compute / 1e3,
            wall > 0 ? 100 * compute / wall : 0.0, (unsigned long long)n->train_hops,
            (double)n->train_bytes / (1 << 20), (unsigned long long)n->train_bytes,
            nl_wire_precision_name(nl_stage_wire(n->stage)), n->train_send_ms / 1e3,
            wall > 0 ? 100 * n->train_send_ms / wall : 0.0, (wall - n->train_busy_ms) / 1e3,
            wall > 0 ? 100 * (wall - n->train_busy_ms) / wall : 0.0);
    n->train_t0 = 0;
    n->train_busy_ms = n->train_send_ms = 0;
    n->train_hops = n->train_bytes = 0;
}

bool node_is_train_hop(const nl_wire_msg *m)
{
    return m->type == NL_MSG_COUNT || m->type == NL_MSG_EVAL ||
           (m->type == NL_MSG_ACTIVATION && m->u.hop.step != 0);
}

/* The training job's replicas finished some work: send what it made. */
void node_train_poll(node *n)
{
    nl_error e;
    uint64_t job = 0;
    nl_stage_train_running(n->stage, &job);
    nl_status st = nl_stage_train_poll(n->stage, train_send, n, &e);
    if (st != NL_OK)
        node_fail_job(n, job, st, NL_MSG_STEP, "%s", e.msg);
}
