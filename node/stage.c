/* One pipeline stage: the assigned model, its loading and the forward hop
 * (see stage.h); the generation sessions are stage_session.c's. */
#include "node/stage.h"
#include "node/stage_impl.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "core/model/memory.h"

/* ===================== life ===================== */

nl_status nl_stage_new_replicas(nl_stage **out, nl_backend *const *be, int n, nl_comm *comm,
                                const nl_stage_opts *o, nl_error *err)
{
    *out = NULL;
    if (n < 1 || n > NL_COMM_MAX)
        return nl_error_set(err, NL_ERR_INVALID, "stage: %d replicas (1 to %d)", n, NL_COMM_MAX);
    nl_stage *s = calloc(1, sizeof *s);
    if (!s)
        return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory");
    s->be = be[0];
    memcpy(s->rbe, be, (size_t)n * sizeof *be);
    s->n_rep = n;
    s->o = *o;
    if (s->o.send_wait_ms <= 0)
        s->o.send_wait_ms = 10000;
    if (comm && nl_comm_size(comm) != n) {
        free(s);
        return nl_error_set(err, NL_ERR_INVALID, "stage: a communicator of %d for %d replicas",
                            nl_comm_size(comm), n);
    }
    s->comm = comm;
    if (n > 1 && !comm) {
        nl_status st = nl_comm_new(&s->comm, be, n, NL_COMM_AUTO, err);
        if (st != NL_OK) {
            free(s);
            return nl_error_prefix(err, "stage: %d replicas", n);
        }
        s->own_comm = true;
    }
    *out = s;
    return NL_OK;
}

nl_status nl_stage_new(nl_stage **out, nl_backend *be, const nl_stage_opts *o, nl_error *err)
{
    return nl_stage_new_replicas(out, &be, 1, NULL, o, err);
}

/* Free the model and everything sized for it. The output must be idle. */
static void drop_model(nl_stage *s)
{
    stage_jobs_free_all(s); /* training jobs borrow the model */
    stage_embed_free_all(s);
    stage_batch_free(s);
    stage_sessions_clear(s);
    stage_adapter_free_all(s); /* after everyone who held one */
    for (int i = 0; i < 2; i++) {
        free(s->mom_h[i]);
        s->mom_h[i] = NULL;
    }
    s->have_moments = false;
    nl_runstate_destroy(&s->rs);
    s->rs_rows = 0;
    nl_model_destroy(&s->model);
    free(s->loaded);
    s->loaded = NULL;
    s->be->free(s->be, s->xin_d);
    s->xin_d = NULL;
    s->xin_cap = 0;
    free(s->tok_h);
    s->tok_h = NULL;
    s->tok_cap = 0;
    nl_host_stage_free(&s->out_stage);
    s->ready = false;
}

void nl_stage_destroy(nl_stage **sp)
{
    if (!sp || !*sp)
        return;
    nl_stage *s = *sp;
    if (!nl_txref_idle(&s->tx))
        NL_WARN("stage: freed while an output was still being sent");
    stage_verifier_free(s);
    drop_model(s);
    if (s->own_comm)
        nl_comm_destroy(&s->comm);
    free(s->win_h);
    free(s->wire_h);
    free(s->sess);
    free(s);
    *sp = NULL;
}

nl_status stage_check_device(nl_stage *s, nl_error *err)
{
    if (s->device_st == NL_OK) {
        nl_error e = {0};
        nl_status st = NL_OK;
        int r = 0;
        for (; r < s->n_rep && st == NL_OK; r++) /* every replica's; the first that failed */
            st = nl_backend_check(s->rbe[r], &e);
        if (st == NL_OK)
            return NL_OK;
        s->device_st = st;
        char rep[32] = ""; /* replicas may share a name (cpu,cpu) */
        if (s->n_rep > 1)
            snprintf(rep, sizeof rep, " (replica %d)", r - 1);
        snprintf(s->device_err, sizeof s->device_err, "device %.24s%s: %.440s", s->rbe[r - 1]->name,
                 rep, e.msg);
        NL_ERROR("%s (%s)", s->device_err, nl_status_str(st));
    }
    return nl_error_set(err, s->device_st, "%s", s->device_err);
}

nl_status nl_stage_device_status(const nl_stage *s, nl_error *err)
{
    return s->device_st == NL_OK ? NL_OK : nl_error_set(err, s->device_st, "%s", s->device_err);
}

nl_txref *nl_stage_txref(nl_stage *s)
{
    return &s->tx;
}

nl_node_state nl_stage_state(const nl_stage *s)
{
    if (s->ready)
        return NL_NODE_READY;
    return s->model && !s->assign_failed ? NL_NODE_LOADING : NL_NODE_IDLE;
}

uint64_t nl_stage_epoch(const nl_stage *s)
{
    return s->epoch;
}

const nl_model *nl_stage_model(const nl_stage *s)
{
    return s->assign_failed ? NULL : s->model;
}

int nl_stage_max_rows(const nl_stage *s)
{
    return s->max_rows;
}

/* ===================== assignment ===================== */

uint64_t nl_stage_plan_memory(const nl_stage *s)
{
    return s->o.memory_bytes > s->o.kv_budget ? s->o.memory_bytes - s->o.kv_budget : 0;
}

/* Rows one forward may take: what --memory leaves after the weights, the
 * KV budget and the runtime, at the memory model's cost per row; at least
 * one whole sequence. */
static int rows_limit(const nl_stage *s)
{
    const nl_model *m = s->model;
    const int probe = 1024;
    nl_mem_opts mo = {.micro_rows = probe, .precision = nl_mem_precision(s->be)};
    nl_mem_estimate e = nl_memory_estimate(&m->cfg, m->l1 - m->l0, m->has_embed, m->has_head, &mo);
    uint64_t per_row = (e.activations + e.workspace) / probe + 4 * (uint64_t)m->cfg.hidden_dim + 4;
    uint64_t fixed = e.weights + e.bf16_copies + e.runtime + s->o.kv_budget;
    uint64_t rows = s->o.memory_bytes > fixed ? (s->o.memory_bytes - fixed) / per_row : 0;
    if (rows < (uint64_t)m->cfg.max_seq_len) {
        NL_WARN("stage: --memory leaves room for %llu rows of activations; allowing one sequence "
                "of %d",
                (unsigned long long)rows, m->cfg.max_seq_len);
        rows = (uint64_t)m->cfg.max_seq_len;
    }
    return rows > (1u << 24) ? 1 << 24 : (int)rows;
}

nl_status stage_wait_output(nl_stage *s, const char *what, nl_error *err)
{
    nl_error e;
    if (nl_txref_wait(&s->tx, s->o.send_wait_ms, &e) != NL_OK)
        return nl_error_set(err, NL_ERR_TIMEOUT,
                            "%s: the previous output is still being sent after %d ms (is the "
                            "next stage or the coordinator reading?)",
                            what, s->o.send_wait_ms);
    return NL_OK;
}

static nl_status build_model(nl_stage *s, const nl_msg_assign *a, nl_error *err)
{
    nl_config cfg;
    nl_status st = nl_config_from_json(&cfg, a->config_json, err);
    if (st == NL_OK)
        st = nl_config_validate(&cfg, 1, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "ASSIGN config_json");
    if (a->layer1 > (uint32_t)cfg.num_layers)
        return nl_error_set(err, NL_ERR_RANGE, "ASSIGN: layers [%u, %u) exceed the model's %d",
                            a->layer0, a->layer1, cfg.num_layers);
    if (a->has_embed != (a->stage == 0) || a->has_head != (a->stage + 1 == a->num_stages))
        return nl_error_set(err, NL_ERR_RANGE,
                            "ASSIGN: stage %u of %u must hold the embedding iff first and the "
                            "head iff last",
                            a->stage, a->num_stages);
    uint64_t weights = 4 * (uint64_t)nl_stage_param_count(&cfg, (int)(a->layer1 - a->layer0),
                                                          a->has_embed, a->has_head);
    const uint64_t offer = nl_stage_plan_memory(s);
    if (weights > offer || a->memory_planned > offer)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "ASSIGN: layers [%u, %u) need %llu bytes of weights (%llu planned) "
                            "but this node offers %llu (--memory less --kv-budget)",
                            a->layer0, a->layer1, (unsigned long long)weights,
                            (unsigned long long)a->memory_planned, (unsigned long long)offer);
    st = nl_model_new(&s->model, s->be, &cfg, (int)a->layer0, (int)a->layer1, a->has_embed,
                      a->has_head, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "ASSIGN");
    s->loaded = calloc(3 * (size_t)s->model->n_table + 1, sizeof *s->loaded);
    if (!s->loaded)
        return nl_error_set(err, NL_ERR_NOMEM, "ASSIGN: out of memory");
    s->max_rows = rows_limit(s);
    return NL_OK;
}

nl_status nl_stage_assign(nl_stage *s, const nl_msg_assign *a, nl_error *err)
{
    s->epoch = a->epoch;
    s->assigned = true;
    s->assign_failed = false;
    s->seed = a->seed;
    s->wire = (nl_wire_precision)a->wire; /* the schema checked it */
    s->stage_idx = (int)a->stage;
    s->num_stages = (int)a->num_stages;
    s->replica = (int)a->replica;
    s->replicas = a->replicas > 1 ? (int)a->replicas : 1;
    s->fan_prev = a->prev_keys && a->prev_keys[0];
    s->fan_next = a->next_keys && a->next_keys[0];
    s->t_assign = nl_mono_s();
    nl_status st = stage_wait_output(s, "ASSIGN", err);
    stage_verify_forget(s); /* a new plan: what the verifier kept is of the old one */
    if (st == NL_OK) {
        drop_model(s);
        st = build_model(s, a, err);
    }
    if (st != NL_OK) {
        /* a send still reading the old output keeps its buffers until the
         * next assignment or nl_stage_destroy; nothing runs on them */
        if (nl_txref_idle(&s->tx))
            drop_model(s);
        stage_sessions_clear(s);
        s->ready = false;
        s->assign_failed = true;
        snprintf(s->assign_err, sizeof s->assign_err, "%s", err ? err->msg : "refused");
    }
    return st;
}

/* ===================== the wire's precision ===================== */

const float *nl_stage_hidden_in(nl_stage *s, const nl_wire_frame *in, size_t n)
{
    if (in->t.dtype == NL_DTYPE_F32)
        return in->t.data; /* the backend's upload copies it, aligned or not */
    if (n > s->win_cap) {
        float *b = realloc(s->win_h, n * sizeof *b);
        if (!b)
            return NULL;
        s->win_h = b;
        s->win_cap = n;
    }
    nl_wire_frame_widen(in, s->win_h, n);
    return s->win_h;
}

nl_status nl_stage_hidden_out(nl_stage *s, nl_wire_frame *f, const float *x, const int64_t *shape,
                              int ndim, nl_error *err)
{
    return nl_wire_frame_hidden(f, s->wire, x, shape, ndim, &s->wire_h, &s->wire_cap, err);
}

double nl_stage_modelled_s(nl_stage *s)
{
    return (double)atomic_load(&s->modelled_us) / 1e6;
}

nl_wire_precision nl_stage_wire(const nl_stage *s)
{
    return s->wire;
}

/* ===================== loading ===================== */

static void shape_str(char *buf, size_t n, const int64_t *shape, int ndim)
{
    size_t at = 0;
    at += (size_t)snprintf(buf + at, n - at, "[");
    for (int i = 0; i < ndim && at < n; i++)
        at += (size_t)snprintf(buf + at, n - at, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (at < n)
        snprintf(buf + at, n - at, "]");
}

/* Is a message of this epoch for the current assignment? Sets *stale for
 * an older one (or one whose ASSIGN was refused). */
static nl_status check_epoch(const nl_stage *s, const char *what, uint64_t epoch, bool *stale,
                             nl_error *err)
{
    *stale = false;
    if (s->assigned && epoch < s->epoch) {
        *stale = true;
        return NL_OK;
    }
    if (!s->assigned || epoch > s->epoch)
        return nl_error_set(err, NL_ERR_STATE, "%s for epoch %llu, but %s", what,
                            (unsigned long long)epoch,
                            s->assigned ? "this node holds an older assignment" : "no ASSIGN yet");
    return NL_OK;
}

nl_status nl_stage_load_chunk(nl_stage *s, const nl_msg_layer_load *l, const nl_wire_frame *f,
                              bool *stale, nl_error *err)
{
    char want[96], got[96];
    nl_status st = check_epoch(s, "LAYER_LOAD", l->epoch, stale, err);
    if (st != NL_OK || *stale)
        return st;
    if (s->assign_failed) {
        *stale = true; /* the refused ASSIGN was already answered */
        return NL_OK;
    }
    if (s->ready)
        return nl_error_set(err, NL_ERR_STATE, "LAYER_LOAD %s: epoch %llu is already loaded",
                            l->name, (unsigned long long)l->epoch);
    const nl_model *m = s->model;
    /* optim.m.<name> and optim.v.<name>: the moments of a resumed run */
    int which = strncmp(l->name, "optim.m.", 8) == 0   ? 1
                : strncmp(l->name, "optim.v.", 8) == 0 ? 2
                                                       : 0;
    const nl_param *p = nl_model_find_param(m, which ? l->name + 8 : l->name);
    if (!p)
        return nl_error_set(err, NL_ERR_NOTFOUND,
                            "LAYER_LOAD: '%s' is not a tensor of this stage (layers [%d, %d)%s%s)",
                            l->name, m->l0, m->l1, m->has_embed ? ", embedding" : "",
                            m->has_head ? ", head" : "");
    bool same = l->ndim == p->ndim;
    for (int i = 0; same && i < p->ndim; i++)
        same = l->shape[i] == p->shape[i];
    if (!same) {
        shape_str(want, sizeof want, p->shape, p->ndim);
        shape_str(got, sizeof got, l->shape, l->ndim);
        return nl_error_set(err, NL_ERR_SHAPE, "LAYER_LOAD %s: shape %s, but the stage's is %s",
                            l->name, got, want);
    }
    if (f->t.dtype != NL_DTYPE_F32 || f->t.ndim != 1)
        return nl_error_set(err, NL_ERR_DTYPE, "LAYER_LOAD %s: the chunk must be a 1-D F32 frame",
                            l->name);
    size_t idx = (size_t)(p - m->table) + (size_t)which * (size_t)m->n_table,
           numel = nl_param_numel(p);
    uint64_t n = (uint64_t)f->t.shape[0];
    if (l->offset > numel || n > numel - l->offset)
        return nl_error_set(err, NL_ERR_RANGE,
                            "LAYER_LOAD %s: chunk %u [%llu, +%llu) lies outside its %zu elements",
                            l->name, l->chunk, (unsigned long long)l->offset, (unsigned long long)n,
                            numel);
    if (n > numel - s->loaded[idx])
        return nl_error_set(err, NL_ERR_RANGE,
                            "LAYER_LOAD %s: chunk %u brings more elements than the tensor holds "
                            "(overlapping chunks?)",
                            l->name, l->chunk);
    if (which && !s->mom_h[which - 1] &&
        !(s->mom_h[which - 1] = calloc(m->n_params + 1, sizeof(float))))
        return nl_error_set(err, NL_ERR_NOMEM, "LAYER_LOAD %s: no memory for the moments", l->name);
    if (n && which)
        memcpy(s->mom_h[which - 1] + p->offset + l->offset, f->t.data, n * sizeof(float));
    else if (n)
        s->be->upload(s->be, nl_model_param_data(m, p) + l->offset, f->t.data, n * sizeof(float));
    s->loaded[idx] += n;
    return NL_OK;
}

nl_status nl_stage_load_done(nl_stage *s, uint64_t epoch, uint32_t tensors, nl_stage_loaded *info,
                             bool *stale, nl_error *err)
{
    memset(info, 0, sizeof *info);
    nl_status st = check_epoch(s, "LOAD_DONE", epoch, stale, err);
    if (st != NL_OK || *stale)
        return st;
    if (s->assign_failed)
        return nl_error_set(err, NL_ERR_STATE,
                            "LOAD_DONE: the ASSIGN of epoch %llu was refused: %s",
                            (unsigned long long)epoch, s->assign_err);
    if (s->ready)
        return nl_error_set(err, NL_ERR_STATE, "LOAD_DONE: epoch %llu is already loaded",
                            (unsigned long long)epoch);
    nl_model *m = s->model;
    if (tensors == 0) {
        st = nl_model_init_random(m, s->seed, err);
        if (st != NL_OK)
            return nl_error_prefix(err, "LOAD_DONE: init from seed %llu",
                                   (unsigned long long)s->seed);
        info->from_seed = true;
    } else {
        for (int i = 0; i < m->n_table; i++)
            if (s->loaded[i] != nl_param_numel(&m->table[i]))
                return nl_error_set(err, NL_ERR_NOTFOUND,
                                    "LOAD_DONE: tensor %s is incomplete: %llu of %zu elements "
                                    "received",
                                    m->table[i].name, (unsigned long long)s->loaded[i],
                                    nl_param_numel(&m->table[i]));
        /* the moments come for every tensor or for none */
        int moments = 0;
        for (int i = m->n_table; i < 3 * m->n_table; i++)
            moments += s->loaded[i] > 0;
        for (int i = m->n_table; moments && i < 3 * m->n_table; i++)
            if (s->loaded[i] != nl_param_numel(&m->table[i % m->n_table]))
                return nl_error_set(err, NL_ERR_NOTFOUND,
                                    "LOAD_DONE: optim.%c.%s is incomplete: %llu of %zu elements "
                                    "received",
                                    i < 2 * m->n_table ? 'm' : 'v', m->table[i % m->n_table].name,
                                    (unsigned long long)s->loaded[i],
                                    nl_param_numel(&m->table[i % m->n_table]));
        const uint32_t want = (uint32_t)m->n_table * (moments ? 3u : 1u);
        if (tensors != want)
            return nl_error_set(err, NL_ERR_PROTO,
                                "LOAD_DONE: says %u tensors, but the stage received %u", tensors,
                                want);
        s->have_moments = moments > 0;
    }
    if ((st = stage_check_device(s, err)) != NL_OK)
        return nl_error_prefix(err, "LOAD_DONE");
    s->ready = true;
    info->tensors = (uint32_t)m->n_table * (s->have_moments ? 3u : 1u);
    info->bytes = (uint64_t)m->n_params * sizeof(float);
    info->seconds = nl_mono_s() - s->t_assign;
    return NL_OK;
}

/* ===================== the forward hop ===================== */

/* Check frame 0 against the stage and the hop; sets *B, *T, *se. A
 * session's hop follows its cache and the `queued` positions of its hops
 * waiting for a batch. */
nl_status stage_check_hop(nl_stage *s, const nl_msg_tensor_hop *hop, const nl_wire_frame *in,
                          const char *who, int queued, int *B, int *T, session **se, nl_error *err)
{
    const nl_model *m = s->model;
    const nl_tensor *t = &in->t;
    *se = NULL;
    if (hop->step != 0 || hop->microbatch != 0)
        return nl_error_set(err, NL_ERR_INVALID,
                            "%s: a generation hop names no training step (step %llu, microbatch "
                            "%u): a training job's hops go to that job",
                            who, (unsigned long long)hop->step, hop->microbatch);
    if (m->has_embed && (t->dtype != NL_DTYPE_I32 || t->ndim != 2))
        return nl_error_set(err, NL_ERR_SHAPE, "%s: the first stage takes I32 token ids [B, T]",
                            who);
    if (!m->has_embed &&
        (!nl_wire_dtype_hidden(t->dtype) || t->ndim != 3 || t->shape[2] != m->cfg.hidden_dim))
        return nl_error_set(err, NL_ERR_SHAPE,
                            "%s: this stage takes F32 or BF16 hidden states [B, T, %d]", who,
                            m->cfg.hidden_dim);
    if (t->shape[0] < 1 || t->shape[1] < 1 || t->shape[0] > s->max_rows ||
        t->shape[1] > m->cfg.max_seq_len || t->shape[0] * t->shape[1] > s->max_rows)
        return nl_error_set(
            err, NL_ERR_CAPACITY, "%s: batch %lld x %lld is outside 1..%d positions and %d rows",
            who, (long long)t->shape[0], (long long)t->shape[1], m->cfg.max_seq_len, s->max_rows);
    *B = (int)t->shape[0];
    *T = (int)t->shape[1];
    if (m->has_embed) /* ids the embedding holds: one bad id must not fail a whole batch */
        for (int64_t i = 0; i < t->shape[0] * t->shape[1]; i++) {
            int32_t id;
            memcpy(&id, (const uint8_t *)t->data + i * (int64_t)sizeof id, sizeof id);
            if (id < 0 || id >= (int32_t)m->cfg.vocab_size)
                return nl_error_set(err, NL_ERR_RANGE,
                                    "%s: token %d (position %lld) is outside the vocabulary of %d",
                                    who, id, (long long)i, (int)m->cfg.vocab_size);
        }
    if (hop->session_id == 0) {
        if (hop->pos_offset != 0)
            return nl_error_set(err, NL_ERR_RANGE,
                                "%s: pos_offset %llu without a session (no cache)", who,
                                (unsigned long long)hop->pos_offset);
        return NL_OK;
    }
    *se = stage_find_session(s, hop->session_id);
    if (!*se)
        return nl_error_set(err, NL_ERR_NOTFOUND,
                            nl_stage_session_evicted(s, hop->session_id)
                                ? "%s: session %llu was evicted (KV budget full)"
                                : "%s: session %llu is not open on this stage",
                            who, (unsigned long long)hop->session_id);
    nl_kvcache *kv = (*se)->kv;
    if (*B != 1)
        return nl_error_set(err, NL_ERR_SHAPE, "%s: a session takes one sequence, not %d", who, *B);
    const int at = kv->len + queued;
    if (hop->pos_offset != (uint64_t)at)
        return nl_error_set(
            err, NL_ERR_RANGE, "%s: pos_offset %llu, but the session's cache holds %d positions%s",
            who, (unsigned long long)hop->pos_offset, at, queued ? " (with its queued hops)" : "");
    if (*T > kv->cap - at)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "%s: %d new positions overflow the session's cache (%d of %d used)",
                            who, *T, at, kv->cap);
    return NL_OK;
}

/* Size the runstate and staging buffers for rows (grown, never shrunk). */
static nl_status ensure_buffers(nl_stage *s, int rows, nl_error *err)
{
    const nl_model *m = s->model;
    size_t d = (size_t)m->cfg.hidden_dim;
    if (rows > s->rs_rows) {
        nl_runstate_destroy(&s->rs);
        s->rs_rows = 0;
        nl_status st = nl_runstate_new(&s->rs, m, rows, err);
        if (st != NL_OK)
            return st;
        s->rs_rows = rows;
    }
    if (m->has_embed && (size_t)rows > s->tok_cap) {
        free(s->tok_h);
        s->tok_cap = 0;
        if (!(s->tok_h = malloc((size_t)rows * sizeof *s->tok_h)))
            return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory for %d tokens", rows);
        s->tok_cap = (size_t)rows;
    }
    if (!m->has_embed && (size_t)rows * d > s->xin_cap) {
        s->be->free(s->be, s->xin_d);
        s->xin_cap = 0;
        if (!(s->xin_d = s->be->alloc(s->be, (size_t)rows * d * sizeof(float))))
            return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory for %d input rows", rows);
        s->xin_cap = (size_t)rows * d;
    }
    return NL_OK;
}

/* Point out->data at the output in host memory (a copy where the backend's
 * memory is not the host's). */
static nl_status host_output(nl_stage *s, const float *dev, size_t n, nl_stage_out *out,
                             nl_error *err)
{
    const float *h = nl_backend_read_view(s->be, &s->out_stage, dev, n * sizeof(float), err);
    if (!h)
        return nl_error_prefix(err, "stage output");
    out->data = (float *)h;
    return NL_OK;
}

/* A session's next token from the logits row at dev (cols of them), into
 * o (stage_sample): on the device where the backend samples and no
 * log-probabilities are asked for (only the id comes back), else from a
 * host view of the row. */
static nl_status sample_row(nl_stage *s, session *se, const float *dev, int cols, nl_stage_out *o,
                            nl_error *err)
{
    if (se->logprobs == 0 && nl_sampler_device(&se->smp, s->be)) {
        int32_t token = 0;
        const nl_status st = nl_sampler_next(&se->smp, s->be, dev, NULL, &token, err);
        if (st == NL_OK) {
            o->lp_n = 0;
            stage_sampled(se, token, o);
        }
        return st;
    }
    nl_stage_out view = {0};
    const nl_status st = host_output(s, dev, (size_t)cols, &view, err);
    if (st == NL_OK)
        stage_sample(se, view.data, o);
    return st;
}

static nl_status run_hop(nl_stage *s, const nl_msg_tensor_hop *hop, const nl_wire_frame *in,
                         nl_stage_out *out, session **sep, nl_error *err)
{
    char who[80];
    int B = 0, T = 0;
    session *se = NULL;
    if (hop->session_id)
        snprintf(who, sizeof who, "job %llu session %llu", (unsigned long long)hop->job_id,
                 (unsigned long long)hop->session_id);
    else
        snprintf(who, sizeof who, "job %llu", (unsigned long long)hop->job_id);
    if (!s->ready)
        return nl_error_set(err, NL_ERR_STATE, "%s: this stage has no model loaded", who);
    nl_status st = stage_check_hop(s, hop, in, who, 0, &B, &T, &se, err);
    *sep = se;
    if (st == NL_OK)
        st = stage_wait_output(s, who, err);
    if (st == NL_OK)
        st = ensure_buffers(s, B * T, err);
    if (st != NL_OK)
        return st;
    nl_model *m = s->model;
    const size_t rows = (size_t)B * T, d = (size_t)m->cfg.hidden_dim;
    nl_forward_args a = {.B = B, .T = T, .kv = se ? se->kv : NULL, .last_only = se && m->has_head};
    /* an embedding job's hop (stage_embed.c): pads kept out of an
     * encoder's attention; the last stage pools the final-normed states */
    const stage_embed *em = se ? NULL : stage_embed_find(s, hop->job_id);
    if (em && (st = stage_embed_check(em, B, T, err)) != NL_OK)
        return st;
    const bool pool = em && stage_embed_pools(em);
    if (pool) {
        a.doc = m->cfg.causal ? NULL : stage_embed_doc(em);
        a.states = m->has_head;
    }
    if (m->has_embed) {
        memcpy(s->tok_h, in->t.data, rows * sizeof(int32_t)); /* frames need not be aligned */
        a.tokens = s->tok_h;
    } else {
        const float *x = nl_stage_hidden_in(s, in, rows * d);
        if (!x)
            return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory for %zu rows", who, rows);
        s->be->upload(s->be, s->xin_d, x, rows * d * sizeof(float));
        a.x_in = s->xin_d;
    }
    /* a session's decode step asks for no aux loss: reading it would be one
     * more wait for the device per token */
    float aux = 0.0f;
    /* an embed or forward job's adapters, if any, for this forward only */
    st = stage_adapter_use(s, em ? stage_embed_adapter(em) : NULL, B * T, err);
    if (st == NL_OK)
        st = nl_forward(m, s->rs, &a, se ? NULL : &aux, err);
    stage_adapter_attach(s, NULL);
    if (st != NL_OK)
        return nl_error_prefix(err, "%s", who);
    if (se)
        se->used = ++s->tick;
    out->B = B;
    out->T = T;
    out->aux = hop->aux + (double)aux;
    int cols = 0;
    const float *res = nl_runstate_output(s->rs, &cols);
    if (!m->has_head) {
        if (em)
            nl_stage_embed_end(s, hop->job_id); /* its hop has run here */
        out->kind = NL_STAGE_OUT_HIDDEN;
        out->ndim = 3;
        out->shape[0] = B, out->shape[1] = T, out->shape[2] = (int64_t)d;
        return host_output(s, res, rows * d, out, err);
    }
    if (pool) { /* the states, pooled, in place of logits; the request is used */
        st = host_output(s, res, rows * d, out, err);
        if (st == NL_OK)
            st = stage_embed_pool(s, em, out->data, out, err);
        nl_stage_embed_end(s, hop->job_id);
        return st;
    }
    if (!se) {
        if (em)
            nl_stage_embed_end(s, hop->job_id); /* a forward job's adapter: used */
        out->kind = NL_STAGE_OUT_LOGITS;
        out->ndim = 3;
        out->shape[0] = B, out->shape[1] = T, out->shape[2] = cols;
        return host_output(s, res, rows * (size_t)cols, out, err);
    }
    st = sample_row(s, se, res, cols, out, err); /* last_only: one row */
    if (st != NL_OK)
        return st;
    out->data = NULL;
    return NL_OK;
}

nl_status stage_forward_adapted(nl_stage *s, session *se, const void *in, int T, float *hid,
                                nl_stage_out *o, nl_error *err)
{
    nl_model *m = s->model;
    const size_t d = (size_t)m->cfg.hidden_dim;
    nl_status st = ensure_buffers(s, T, err);
    if (st != NL_OK)
        return st;
    nl_forward_args a = {.B = 1, .T = T, .kv = se->kv, .last_only = m->has_head};
    if (m->has_embed) {
        memcpy(s->tok_h, in, (size_t)T * sizeof(int32_t));
        a.tokens = s->tok_h;
    } else {
        s->be->upload(s->be, s->xin_d, in, (size_t)T * d * sizeof(float));
        a.x_in = s->xin_d;
    }
    st = stage_adapter_use(s, se->lo, T, err);
    if (st == NL_OK)
        st = nl_forward(m, s->rs, &a, NULL, err);
    stage_adapter_attach(s, NULL);
    if (st != NL_OK)
        return st;
    se->used = ++s->tick;
    int cols = 0;
    const float *res = nl_runstate_output(s->rs, &cols);
    if (!m->has_head) {
        s->be->download(s->be, hid, res, (size_t)T * d * sizeof(float));
        return nl_backend_check(s->be, err);
    }
    if ((st = sample_row(s, se, res, cols, o, err)) != NL_OK) /* last_only: one row */
        return st;
    return NL_OK;
}

/* A session's hop alone: through the batch path that the daemon uses,
 * so that a session computes the same way in both. */
static nl_status forward_session(nl_stage *s, const nl_msg_tensor_hop *hop, const nl_wire_frame *in,
                                 nl_stage_out *out, nl_error *err)
{
    if (s->n_q)
        return nl_error_set(
            err, NL_ERR_STATE, "job %llu session %llu: %d hops are queued: run them first",
            (unsigned long long)hop->job_id, (unsigned long long)hop->session_id, s->n_q);
    nl_status st = nl_stage_enqueue(s, hop, in, err);
    while (st == NL_OK && s->n_q) {
        const nl_stage_result *r = NULL;
        int n = 0;
        if ((st = nl_stage_run_batch(s, &r, &n, err)) != NL_OK) {
            /* (the last output not yet sent, the device): the hop is not
             * left queued, where it would refuse every later forward */
            stage_batch_drop_session(s, hop->session_id);
            break;
        }
        if (n == 1) { /* the last chunk has run */
            *out = r->out;
            return r->st == NL_OK ? NL_OK : nl_error_set(err, r->st, "%s", r->msg);
        }
    }
    return st == NL_OK ? nl_error_set(err, NL_ERR_INTERNAL, "session %llu: its hop gave no result",
                                      (unsigned long long)hop->session_id)
                       : st;
}

nl_status nl_stage_forward(nl_stage *s, const nl_msg_tensor_hop *hop, const nl_wire_frame *in,
                           nl_stage_out *out, nl_error *err)
{
    session *se = NULL;
    memset(out, 0, sizeof *out);
    const double t0 = nl_mono_s();
    stage_train_quiesce(s); /* a training job's threads leave replica 0's backend */
    nl_status st = nl_stage_device_status(s, err);
    if (st == NL_OK && hop->session_id && hop->step == 0 && hop->microbatch == 0)
        return forward_session(s, hop, in, out, err);
    if (st == NL_OK)
        st = run_hop(s, hop, in, out, &se, err);
    /* the device's error comes first: it also explains a failed forward */
    nl_status dst = stage_check_device(s, err);
    if (dst != NL_OK) {
        memset(out, 0, sizeof *out);
        return dst;
    }
    if (st == NL_OK && se) { /* the session's account of its compute */
        const double dt = nl_mono_s() - t0;
        if (out->T == 1) {
            se->steps++;
            se->step_s += dt;
        } else {
            se->prefill_s += dt;
        }
    }
    return st;
}
