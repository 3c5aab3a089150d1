/* The stage's generation sessions (see stage.h): their store (a KV cache,
 * a sampler on the last stage, an adapter), opened and closed by id,
 * evicted least recently used first to fit --kv-budget, and the ids of
 * the sessions ended (evicted, closed) whose hops may still be in flight;
 * and the generate kind of the stage's jobs (stage_jobs.c), whose jobs
 * are these sessions. The forward of a session's hop is stage.c's, their
 * batches stage_batch.c's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "net/genparams.h"
#include "node/stage_impl.h"

static void session_free(nl_stage *s, session *se)
{
    nl_kvcache_destroy(&se->kv);
    if (se->has_sampler)
        nl_sampler_free(&se->smp);
    stage_adapter_put(s, se->lo);
    se->lo = NULL;
    s->kv_used -= se->bytes;
    se->bytes = 0;
}

void stage_sessions_clear(nl_stage *s)
{
    for (int i = 0; i < s->n_sess; i++) {
        stage_job_forget(s, s->sess[i].id);
        session_free(s, &s->sess[i]);
    }
    s->n_sess = 0;
    s->evicted = s->closed = (ended_ids){0};
}

session *stage_find_session(const nl_stage *s, uint64_t id)
{
    for (int i = 0; i < s->n_sess; i++)
        if (s->sess[i].id == id)
            return &s->sess[i];
    return NULL;
}

static void remove_session(nl_stage *s, session *se)
{
    stage_job_forget(s, se->id); /* the stage's jobs by id (stage_jobs.c) */
    session_free(s, se);
    *se = s->sess[--s->n_sess];
}

static void ended_add(ended_ids *e, uint64_t id)
{
    e->id[e->at] = id;
    e->at = (e->at + 1) % ENDED_MEMORY;
    if (e->n < ENDED_MEMORY)
        e->n++;
}

static bool ended_has(const ended_ids *e, uint64_t id)
{
    for (int i = 0; id && i < e->n; i++)
        if (e->id[i] == id)
            return true;
    return false;
}

static void ended_forget(ended_ids *e, uint64_t id)
{
    for (int i = 0; i < e->n; i++)
        if (e->id[i] == id)
            e->id[i] = 0; /* 0 is never a session id */
}

static void evict_lru(nl_stage *s, uint64_t for_id)
{
    session *lru = &s->sess[0];
    for (int i = 1; i < s->n_sess; i++)
        if (s->sess[i].used < lru->used)
            lru = &s->sess[i];
    NL_INFO("stage: evicted session %llu (%zu bytes of KV cache, %d positions) to make room for "
            "session %llu",
            (unsigned long long)lru->id, lru->bytes, lru->kv ? lru->kv->len : 0,
            (unsigned long long)for_id);
    ended_add(&s->evicted, lru->id);
    remove_session(s, lru);
}

void stage_sampled(session *se, int32_t token, nl_stage_out *o)
{
    o->kind = NL_STAGE_OUT_TOKEN;
    o->token = token;
    se->produced++;
    o->last = se->limit > 0 && se->produced >= se->limit;
    o->feed = se->limit > 0 && !o->last && se->kv->len < se->kv->cap;
    o->feed_pos = se->kv->len;
}

void stage_sample(session *se, const float *logits, nl_stage_out *o)
{
    const int32_t token = nl_sampler_sample(&se->smp, logits);
    o->lp_n = se->logprobs;
    if (o->lp_n > 0) {
        int32_t top[NL_WIRE_MAX_TOP];
        nl_sampler_logprobs(logits, se->smp.vocab, token, o->lp_n - 1, &o->lp[0], top, &o->lp[1]);
        for (int i = 0; i < o->lp_n - 1; i++)
            o->lp_ids[i] = (uint32_t)top[i];
    }
    stage_sampled(se, token, o);
}

nl_status nl_stage_parse_session(const nl_msg_job_submit *j, nl_stage_session_params *p,
                                 nl_error *err)
{
    nl_genparams g;
    *p = (nl_stage_session_params){0};
    if (j->kind != NL_JOB_GENERATE)
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "JOB_SUBMIT: a node opens generation sessions only (kind %u)", j->kind);
    /* the schema shared with the coordinator (net/genparams.h) */
    nl_status st = nl_genparams_parse(&g, j->params, j->nparams, NL_GENPARAMS_SESSION, err);
    *p = (nl_stage_session_params){.id = g.session,
                                   .capacity = g.capacity,
                                   .temperature = (float)g.temperature,
                                   .top_p = (float)g.top_p,
                                   .seed = (uint64_t)g.seed,
                                   .limit = g.limit,
                                   .adapter = g.adapter,
                                   .logprobs = g.logprobs};
    return st;
}

static nl_status grow_sessions(nl_stage *s, nl_error *err)
{
    if (s->n_sess < s->cap_sess)
        return NL_OK;
    int cap = s->cap_sess ? 2 * s->cap_sess : 8;
    session *n = realloc(s->sess, (size_t)cap * sizeof *n);
    if (!n)
        return nl_error_set(err, NL_ERR_NOMEM, "stage: out of memory for sessions");
    s->sess = n;
    s->cap_sess = cap;
    return NL_OK;
}

nl_status nl_stage_open_session(nl_stage *s, const nl_stage_session_params *p, nl_error *err)
{
    unsigned long long id = (unsigned long long)p->id;
    if (!s->ready)
        return nl_error_set(err, NL_ERR_STATE, "session %llu: this stage has no model loaded", id);
    const nl_model *m = s->model;
    if (p->id == 0 || p->capacity < 1 || p->capacity > m->cfg.max_seq_len)
        return nl_error_set(err, NL_ERR_RANGE, "session %llu: capacity %d is outside 1..%d", id,
                            p->capacity, m->cfg.max_seq_len);
    if (p->limit < 0 || p->limit > p->capacity)
        return nl_error_set(err, NL_ERR_RANGE, "session %llu: limit %d is outside 0..%d", id,
                            p->limit, p->capacity);
    const nl_kv_dtype kt = (nl_kv_dtype)s->o.kv_cache;
    size_t bytes = nl_kvcache_bytes(&m->cfg, m->l1 - m->l0, 1, p->capacity, kt);
    if (bytes > s->o.kv_budget)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "session %llu: a KV cache of %d positions takes %zu bytes, more than "
                            "the whole budget of %llu (--kv-budget)",
                            id, p->capacity, bytes, (unsigned long long)s->o.kv_budget);
    /* what may refuse the open comes first, so that a refused one leaves
     * the sessions as they were: the adapter, the sampler, the table */
    session se = {.id = p->id,
                  .bytes = bytes,
                  .limit = p->limit,
                  .logprobs =
                      p->logprobs > 0 && p->logprobs <= 1 + NL_WIRE_MAX_TOP ? p->logprobs : 0};
    nl_status st = NL_OK;
    if (p->adapter && (st = stage_adapter_get(s, p->adapter, &se.lo, err)) != NL_OK)
        return nl_error_prefix(err, "session %llu", id);
    if (m->has_head) {
        st = nl_sampler_init(&se.smp, (int)m->cfg.vocab_size, p->temperature, p->top_p, p->seed,
                             err);
        se.has_sampler = st == NL_OK;
    }
    if (st == NL_OK)
        st = grow_sessions(s, err);
    if (st == NL_OK) {
        session *old = stage_find_session(s, p->id);
        if (old) {
            NL_INFO("stage: session %llu opened again: its old cache is dropped", id);
            remove_session(s, old);
        }
        stage_batch_drop_session(s, p->id); /* hops queued for an old one */
        while (s->n_sess > 0 && s->kv_used + bytes > s->o.kv_budget)
            evict_lru(s, p->id);
        st = nl_kvcache_new(&se.kv, m, 1, p->capacity, kt, err);
    }
    if (st != NL_OK) {
        nl_kvcache_destroy(&se.kv);
        if (se.has_sampler)
            nl_sampler_free(&se.smp);
        stage_adapter_put(s, se.lo);
        return nl_error_prefix(err, "session %llu", id);
    }
    se.used = ++s->tick;
    s->sess[s->n_sess++] = se;
    s->kv_used += bytes;
    ended_forget(&s->evicted, p->id);
    ended_forget(&s->closed, p->id);
    return NL_OK;
}

bool nl_stage_close_session(nl_stage *s, uint64_t id)
{
    session *se = stage_find_session(s, id);
    if (!se)
        return false;
    remove_session(s, se);
    stage_batch_drop_session(s, id);
    ended_add(&s->closed, id);
    return true;
}

bool nl_stage_session(const nl_stage *s, uint64_t id, nl_stage_session_info *info)
{
    const session *se = stage_find_session(s, id);
    if (se && info)
        *info = (nl_stage_session_info){se->kv->cap,   se->kv->len, se->bytes, se->has_sampler,
                                        se->prefill_s, se->steps,   se->step_s};
    return se != NULL;
}

bool nl_stage_session_evicted(const nl_stage *s, uint64_t id)
{
    return ended_has(&s->evicted, id);
}

bool nl_stage_session_closed(const nl_stage *s, uint64_t id)
{
    return ended_has(&s->closed, id);
}

int nl_stage_session_count(const nl_stage *s)
{
    return s->n_sess;
}

size_t nl_stage_kv_used(const nl_stage *s)
{
    return s->kv_used;
}

/* ---- the generate kind of the stage's jobs (stage_jobs.c) ---- */

static nl_status generate_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id,
                                void **state, nl_error *err)
{
    nl_stage_session_params p;
    *state = NULL;
    nl_status st = nl_stage_parse_session(j, &p, err);
    *job_id = p.id; /* 0 if the request named no session */
    if (st == NL_OK)
        st = nl_stage_open_session(s, &p, err);
    if (st == NL_OK)
        NL_INFO("session %llu open: %d positions, KV %zu of %llu bytes in use, %d sessions",
                (unsigned long long)p.id, p.capacity, nl_stage_kv_used(s),
                (unsigned long long)s->o.kv_budget, nl_stage_session_count(s));
    return st;
}

/* JOB_CANCEL of a generation: drop the session, saying what it cost here. */
static void generate_end(nl_stage *s, uint64_t job, void *state)
{
    nl_stage_session_info i;
    (void)state;
    if (!nl_stage_session(s, job, &i))
        return;
    nl_stage_close_session(s, job);
    NL_INFO("session %llu closed: %d positions; prefill %.2f ms, %d decode steps of %.3f ms each "
            "(this stage's compute)",
            (unsigned long long)job, i.len, i.prefill_s * 1e3, i.steps,
            i.steps ? i.step_s * 1e3 / i.steps : 0.0);
}

const stage_job_ops nl_stage_generate_ops = {.kind = NL_JOB_GENERATE,
                                             .name = "generate",
                                             .status = "session open",
                                             .begin = generate_begin,
                                             .end = generate_end};
