/* The engine of neuroctl serve (cli/serve_engine.h): one process serves a
 * model over HTTP (serve/http.h).
 *
 * HTTP threads submit jobs; one engine thread owns the model and runs the
 * batched decoder (core/model/batch.h): each step decodes every admitted job
 * whose next token is ready as one batch, plus at most one prefill chunk
 * of a job still reading its prompt, so a new prompt never stalls the
 * others for more than one chunk. Each job samples on the device where
 * the backend can (--device cuda:N: only the ids come back), else from
 * the step's logits on the host. A job whose client went away is reaped
 * at the next step and its KV cache freed. The command (cli/cmd_serve.c)
 * loads the engine, starts it, and serves its backend over HTTP. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli_io.h"
#include "cli/serve_engine.h"
#include "core/formats/checkpoint.h"
#include "core/model/batch.h"
#include "core/model/lora.h"
#include "core/model/sampler.h"
#include "core/plan/planner.h"
#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/tokenizer.h"
#include "serve/http.h"

/* ---------------------------------------------------------------- jobs */

enum { JOB_QUEUED, JOB_PREFILL, JOB_DECODE, JOB_FINISHED };

typedef struct job {
    struct job *next;
    int state;
    int ended;       /* the HTTP side let go: reap */
    int32_t *prompt; /* (P) */
    int P, fed;
    int max_new;
    nl_kvcache *kv; /* from admission until finished */
    nl_sampler smp;
    int32_t *out;         /* (max_new) sampled ids */
    nl_http_logprob *lps; /* (max_new) their logprobs, when asked (logprobs >= 0) */
    int logprobs;
    int produced, consumed;
    int failed;
    char errmsg[NL_ERROR_MSG_MAX];
} job;

static void job_release_kv(serve_engine *e, job *j)
{
    if (j->kv) {
        e->kv_bytes -=
            nl_kvcache_bytes(&e->m->cfg, e->m->cfg.num_layers, 1, j->kv->cap, j->kv->dtype);
        nl_kvcache_destroy(&j->kv);
    }
}

static void job_finish(serve_engine *e, job *j)
{
    if (j->state == JOB_PREFILL || j->state == JOB_DECODE)
        e->active--;
    else if (j->state == JOB_QUEUED)
        e->queued--;
    j->state = JOB_FINISHED;
    job_release_kv(e, j);
    e->finished++;
}

static void job_free(job *j)
{
    nl_sampler_free(&j->smp);
    free(j->prompt);
    free(j->out);
    free(j->lps);
    free(j);
}

/* ---------------------------------------------------------------- serve_engine */

/* Under mu: drop the jobs nobody waits for; admit queued jobs while there
 * is room. */
static void reap_and_admit(serve_engine *e)
{
    for (job **pp = &e->jobs; *pp;) {
        job *j = *pp;
        if (j->ended) {
            if (j->state != JOB_FINISHED) {
                e->cancelled++;
                job_finish(e, j);
            }
            *pp = j->next;
            job_free(j);
            continue;
        }
        pp = &j->next;
    }
    for (job *j = e->jobs; j && e->active < e->max_batch; j = j->next) {
        if (j->state != JOB_QUEUED)
            continue;
        nl_error err = {0};
        e->queued--;
        e->active++;
        j->state = JOB_PREFILL;
        if (nl_kvcache_new(&j->kv, e->m, 1, j->P + j->max_new, e->kv_dtype, &err) != NL_OK) {
            j->failed = 1;
            snprintf(j->errmsg, sizeof j->errmsg, "%s", err.msg);
            job_finish(e, j);
            continue;
        }
        e->kv_bytes +=
            nl_kvcache_bytes(&e->m->cfg, e->m->cfg.num_layers, 1, j->kv->cap, j->kv->dtype);
    }
}

/* Under mu: this step's segments; returns how many. Every decoding job
 * gets a row; prompts being read share at most `chunk` rows, so a new
 * prompt delays the others by at most one chunk's worth of work. */
static int plan_step(serve_engine *e, nl_batch_seg *segs, job **who)
{
    int n = 0, budget = e->chunk;
    for (job *j = e->jobs; j && n < e->max_batch; j = j->next) {
        if (j->state == JOB_DECODE) {
            segs[n] = (nl_batch_seg){j->kv, &j->out[j->produced - 1], 1, 1};
            who[n++] = j;
        } else if (j->state == JOB_PREFILL && budget > 0) {
            int T = j->P - j->fed < budget ? j->P - j->fed : budget;
            segs[n] = (nl_batch_seg){j->kv, j->prompt + j->fed, T, j->fed + T == j->P};
            who[n++] = j;
            budget -= T;
        }
    }
    return n;
}

static void publish_stats(serve_engine *e, double *last_pub, uint64_t *last_tokens)
{
    double t = nl_mono_s();
    int idle = e->tokens == *last_tokens && e->active == 0 && e->queued == 0 && e->tps == 0.0;
    if (t - *last_pub < (idle ? 10.0 : 1.0)) /* idle: a heartbeat, not a flood */
        return;
    e->tps = (double)(e->tokens - *last_tokens) / (t - *last_pub);
    *last_pub = t;
    *last_tokens = e->tokens;
    char ev[256];
    snprintf(ev, sizeof ev,
             "{\"tokens_per_s\":%.2f,\"active\":%d,\"queued\":%d,\"kv_cache_bytes\":%zu,"
             "\"tokens_generated\":%" PRIu64 ",\"step_ms\":%.3f}",
             e->tps, e->active, e->queued, e->kv_bytes, e->tokens, e->step_ms);
    nl_http_publish(e->http, "stats", ev);
}

/* Under model_mu, after a step: the next token of each segment that
 * asked for logits, into tok[i] (-1 for the others; on a failure -1 and
 * fail[i] set, with err): on the device where the backend samples and no
 * log-probabilities are asked for, all such segments in one call (only
 * their ids come back, with one wait), else from the host logits, whose
 * log-probabilities go into the job's next entry. */
static void engine_sample(serve_engine *e, const nl_batch_seg *segs, job **who, int n, int32_t *tok,
                          int *fail, nl_error *err)
{
    nl_backend *be = e->m->be;
    for (int i = 0; i < n; i++) {
        e->smp[i] = segs[i].want_logits && !who[i]->lps ? &who[i]->smp : NULL;
        e->lg[i] = e->smp[i] ? nl_batch_logits_device(e->batch, i) : NULL;
    }
    const int dev_fail = nl_sampler_next_batch(e->smp, e->lg, n, be, e->srows, tok, err) != NL_OK;
    for (int i = 0; i < n; i++) { /* tok[i]: -1 where not sampled above */
        job *j = who[i];
        fail[i] = e->smp[i] && nl_sampler_device(e->smp[i], be) && dev_fail;
        if (!segs[i].want_logits || (e->smp[i] && nl_sampler_device(e->smp[i], be)))
            continue;
        const float *lg = nl_batch_logits(e->batch, i, err);
        if (!lg) {
            fail[i] = 1;
            continue;
        }
        tok[i] = nl_sampler_sample(&j->smp, lg);
        if (j->lps) { /* the entry after the last one published */
            nl_http_logprob *lp = &j->lps[j->produced];
            lp->k = j->logprobs;
            nl_sampler_logprobs(lg, j->smp.vocab, tok[i], lp->k, &lp->logprob, lp->top_ids,
                                lp->top);
        }
    }
}

static void *engine_main(void *arg)
{
    serve_engine *e = arg;
    nl_batch_seg *segs = calloc((size_t)e->max_batch, sizeof *segs);
    job **who = calloc((size_t)e->max_batch, sizeof *who);
    int32_t *tok = calloc((size_t)e->max_batch, sizeof *tok);
    int *fail = calloc((size_t)e->max_batch, sizeof *fail);
    e->smp = calloc((size_t)e->max_batch, sizeof *e->smp);
    e->lg = calloc((size_t)e->max_batch, sizeof *e->lg);
    e->srows = calloc((size_t)e->max_batch, sizeof *e->srows);
    double last_pub = nl_mono_s();
    uint64_t last_tokens = 0;
    pthread_mutex_lock(&e->mu);
    while (!e->stop && segs && who && tok && fail && e->smp && e->lg && e->srows) {
        reap_and_admit(e);
        publish_stats(e, &last_pub, &last_tokens);
        int n = plan_step(e, segs, who);
        if (n == 0) {
            struct timespec t;
            clock_gettime(CLOCK_REALTIME, &t);
            t.tv_sec += 1;
            pthread_cond_timedwait(&e->work, &e->mu, &t);
            continue;
        }
        pthread_mutex_unlock(&e->mu);
        nl_error err = {0};
        double t0 = nl_mono_s();
        pthread_mutex_lock(&e->model_mu);
        nl_status st = nl_batch_forward(e->batch, segs, n, &err);
        if (st == NL_OK)
            engine_sample(e, segs, who, n, tok, fail, &err);
        pthread_mutex_unlock(&e->model_mu);
        double ms = 1e3 * (nl_mono_s() - t0);
        int rows = 0;
        pthread_mutex_lock(&e->mu);
        for (int i = 0; i < n; i++) {
            job *j = who[i];
            rows += segs[i].T;
            if (st != NL_OK || fail[i]) {
                j->failed = 1;
                snprintf(j->errmsg, sizeof j->errmsg, "%s", err.msg);
                job_finish(e, j);
                continue;
            }
            if (j->state == JOB_PREFILL) {
                j->fed += segs[i].T;
                e->prompt_tokens += (uint64_t)segs[i].T;
                if (j->fed < j->P)
                    continue;
                j->state = JOB_DECODE;
            }
            j->out[j->produced++] = tok[i];
            e->tokens++;
            if (j->produced == j->max_new)
                job_finish(e, j);
        }
        e->steps++;
        e->rows += (uint64_t)rows;
        e->step_ms = e->steps == 1 ? ms : 0.9 * e->step_ms + 0.1 * ms;
        pthread_cond_broadcast(&e->out);
    }
    pthread_mutex_unlock(&e->mu);
    free(segs);
    free(who);
    free(tok);
    free(fail);
    free(e->smp);
    free(e->lg);
    free(e->srows);
    return NULL;
}

/* ---------------------------------------------------------------- backend */

/* The prompt as ids within the vocabulary (a malloc'd copy). */
static nl_status prompt_ids(serve_engine *e, const char *text, size_t len, const int32_t *ids,
                            int n, int32_t **out, int *P, nl_error *err)
{
    const int64_t V = e->m->cfg.vocab_size;
    *out = NULL;
    if (text) {
        size_t got = 0;
        pthread_mutex_lock(&e->tok_mu);
        nl_status st = nl_tokenizer_encode(e->tok, text, len, out, &got, err);
        pthread_mutex_unlock(&e->tok_mu);
        if (st != NL_OK)
            return nl_error_prefix(err, "prompt");
        n = (int)got;
    } else {
        if (!(*out = malloc((size_t)n * sizeof **out)))
            return nl_error_set(err, NL_ERR_NOMEM, "prompt: out of memory");
        memcpy(*out, ids, (size_t)n * sizeof **out);
    }
    *P = n;
    return nl_http_prompt_in_vocab(out, n, V, err);
}

static nl_status be_start(void *ctx, const nl_http_completion *rq, void **jobp, int *ptoks,
                          nl_error *err)
{
    serve_engine *e = ctx;
    const int ctxlen = e->m->cfg.max_seq_len;
    job *j = calloc(1, sizeof *j);
    nl_status st = NL_OK;
    if (!j)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if ((st = prompt_ids(e, rq->prompt_text, rq->prompt_len, rq->prompt_ids, rq->n_prompt_ids,
                         &j->prompt, &j->P, err)) != NL_OK)
        goto fail;
    if (j->P == 0) {
        st = nl_error_set(err, NL_ERR_INVALID, "prompt: no tokens");
        goto fail;
    }
    if (j->P >= ctxlen) {
        st = nl_error_set(err, NL_ERR_RANGE,
                          "prompt: %d tokens leave no room in the model's context of %d", j->P,
                          ctxlen);
        goto fail;
    }
    /* 0 (a chat that names no limit): to the context's end, within the
     * default's bound */
    const int left = ctxlen - j->P;
    const int max_new = rq->max_tokens > 0                ? rq->max_tokens
                        : left < NL_HTTP_CHAT_MAX_DEFAULT ? left
                                                          : NL_HTTP_CHAT_MAX_DEFAULT;
    if (rq->max_tokens > ctxlen - j->P) {
        st = nl_error_set(err, NL_ERR_RANGE,
                          "max_tokens: %d is more than the %d positions the context of %d "
                          "leaves after the prompt's %d tokens",
                          rq->max_tokens, ctxlen - j->P, ctxlen, j->P);
        goto fail;
    }
    j->max_new = max_new;
    j->logprobs = rq->logprobs;
    if (!(j->out = malloc((size_t)j->max_new * sizeof *j->out)) ||
        (rq->logprobs >= 0 && !(j->lps = calloc((size_t)j->max_new, sizeof *j->lps)))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if ((st = nl_sampler_init(&j->smp, (int)e->m->cfg.vocab_size, (float)rq->temperature,
                              (float)rq->top_p, rq->seed, err)) != NL_OK)
        goto fail;
    pthread_mutex_lock(&e->mu);
    j->state = JOB_QUEUED;
    e->queued++;
    job **pp = &e->jobs;
    while (*pp)
        pp = &(*pp)->next;
    *pp = j;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->mu);
    *ptoks = j->P;
    *jobp = j;
    return NL_OK;
fail:
    job_free(j);
    return st;
}

static nl_http_next be_next(void *ctx, void *jp, int32_t *id, const char **text, size_t *len,
                            nl_http_logprob *lp, int timeout_ms, nl_error *err)
{
    serve_engine *e = ctx;
    job *j = jp;
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += timeout_ms / 1000;
    t.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&e->mu);
    while (j->consumed == j->produced && j->state != JOB_FINISHED && !e->stop)
        if (pthread_cond_timedwait(&e->out, &e->mu, &t) == ETIMEDOUT)
            break;
    nl_http_next r = NL_HTTP_WAIT;
    if (j->consumed < j->produced) {
        if (j->lps)
            *lp = j->lps[j->consumed];
        *id = j->out[j->consumed++];
        r = NL_HTTP_TOKEN;
    } else if (j->failed || e->stop) {
        nl_error_set(err, e->stop ? NL_ERR_STATE : NL_ERR_INTERNAL, "generation failed: %s",
                     e->stop ? "the server is stopping" : j->errmsg); /* 503, 500 */
        r = NL_HTTP_FAILED;
    } else if (j->state == JOB_FINISHED) {
        r = NL_HTTP_DONE;
    }
    pthread_mutex_unlock(&e->mu);
    *text = "";
    *len = 0;
    const uint8_t *p = NULL;
    size_t n = 0;
    if (r == NL_HTTP_TOKEN && nl_chat_ends_answer(e->tok, e->turn_end, *id))
        return NL_HTTP_END;
    if (r == NL_HTTP_TOKEN && !nl_tokenizer_is_special(e->tok, *id) &&
        nl_tokenizer_token_bytes(e->tok, *id, &p, &n) == NL_OK) {
        *text = (const char *)p;
        *len = n;
    }
    return r;
}

static char *be_chat_template(void *ctx, int model)
{
    serve_engine *e = ctx;
    (void)model;
    return e->chat_template ? strdup(e->chat_template) : NULL;
}

static size_t be_token_bytes(void *ctx, int32_t id, char *buf, size_t cap)
{
    serve_engine *e = ctx;
    const uint8_t *p = NULL;
    size_t n = 0;
    if (id < 0 || id >= e->m->cfg.vocab_size ||
        nl_tokenizer_token_bytes(e->tok, id, &p, &n) != NL_OK)
        return 0;
    n = n < cap ? n : cap;
    memcpy(buf, p, n);
    return n;
}

static void be_end(void *ctx, void *jp)
{
    serve_engine *e = ctx;
    job *j = jp;
    pthread_mutex_lock(&e->mu);
    j->ended = 1; /* the engine reaps it (and frees its cache) at its next step */
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->mu);
}

static nl_status be_embed(void *ctx, int model, const char *text, size_t len, const int32_t *ids,
                          int n, float **vec, int *dim, int *tokens, nl_error *err)
{
    (void)model; /* one model served (an adapter is merged into it) */
    serve_engine *e = ctx;
    int32_t *p = NULL;
    int P = 0;
    nl_status st = prompt_ids(e, text, len, ids, n, &p, &P, err);
    if (st != NL_OK)
        return st;
    const int d = e->m->cfg.hidden_dim;
    *vec = malloc((size_t)d * sizeof **vec);
    if (!*vec) {
        free(p);
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    }
    if (P < 1 || P > e->m->cfg.max_seq_len) {
        st = nl_error_set(err, NL_ERR_RANGE, "%d tokens, outside 1..%d (the model's context)", P,
                          e->m->cfg.max_seq_len);
    } else {
        pthread_mutex_lock(&e->model_mu);
        st = nl_batch_embed(e->batch, p, P, *vec, err);
        pthread_mutex_unlock(&e->model_mu);
    }
    free(p);
    if (st != NL_OK) {
        free(*vec);
        *vec = NULL;
        return st;
    }
    pthread_mutex_lock(&e->mu);
    e->embeddings++;
    pthread_mutex_unlock(&e->mu);
    *dim = d;
    *tokens = P;
    return NL_OK;
}

static char *be_status(void *ctx)
{
    serve_engine *e = ctx;
    const nl_config *c = &e->m->cfg;
    nl_backend *be = e->m->be;
    size_t used = 0, peak = 0, free_b = 0, total = 0;
    be->mem_stats(be, &used, &peak);
    nl_error err = {0};
    int have_total = be->mem_info && be->mem_info(be, &free_b, &total, &err) == NL_OK;
    char range[64]; /* one process holds every layer, the embedding and the head */
    nl_plan_range_str(range, sizeof range, 0, c->num_layers, 1, 1);
    /* built with jansson: the model's file name is the operator's, any bytes */
    pthread_mutex_lock(&e->mu);
    json_t *o = json_pack(
        "{s:s,s:{s:s,s:i,s:i,s:I,s:i,s:I},s:[{s:s,s:s,s:s,s:o,s:I,s:i,s:[i,i],s:s,s:f,s:f,s:I}],"
        "s:[{s:i,s:s,s:s,s:s,s:[i,i],s:s,s:n}],s:{s:i,s:i,s:I,s:s,s:i,s:i},s:I,s:f,s:n}",
        "mode", "single", "model", "name", e->name, "layers", c->num_layers, "hidden_dim",
        c->hidden_dim, "vocab_size", (json_int_t)c->vocab_size, "max_seq_len", c->max_seq_len,
        "params", (json_int_t)nl_config_param_count(c), "nodes", "name", "local", "state",
        "serving", "device", be->name, "memory_offered",
        have_total ? json_integer((json_int_t)total) : json_null(), "memory_used", (json_int_t)used,
        "stage", 0, "layers", 0, c->num_layers, "layers_text", range, "tokens_per_s", e->tps,
        "stage_ms", e->step_ms, "kv_bytes", (json_int_t)e->kv_bytes, "pipeline", "stage", 0, "node",
        "local", "device", be->name, "state", "serving", "layers", 0, c->num_layers, "layers_text",
        range, "busy", "sessions", "active", e->active, "queued", e->queued, "kv_cache_bytes",
        (json_int_t)e->kv_bytes, "kv_cache", nl_kv_dtype_name(e->kv_dtype), "max_batch",
        e->max_batch, "prefill_chunk", e->chunk, "tokens_generated", (json_int_t)e->tokens,
        "uptime_s", nl_mono_s() - e->t_start, "training");
    pthread_mutex_unlock(&e->mu);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

static char *be_metrics(void *ctx)
{
    serve_engine *e = ctx;
    nl_backend *be = e->m->be;
    size_t used = 0, peak = 0;
    be->mem_stats(be, &used, &peak);
    const size_t cap = 8192;
    char *s = malloc(cap);
    if (!s)
        return NULL;
    pthread_mutex_lock(&e->mu);
    const struct {
        const char *name, *type, *help;
        double v;
    } ms[] = {
        {"neurollm_tokens_generated_total", "counter", "Tokens sampled.", (double)e->tokens},
        {"neurollm_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
         (double)e->prompt_tokens},
        {"neurollm_batch_steps_total", "counter", "Batched forward steps.", (double)e->steps},
        {"neurollm_batch_rows_total", "counter",
         "Rows (decode tokens and prefill positions) over all steps.", (double)e->rows},
        {"neurollm_generations_finished_total", "counter",
         "Generations ended (done, stopped, failed or cancelled).", (double)e->finished},
        {"neurollm_generations_cancelled_total", "counter",
         "Generations whose client went away before the end.", (double)e->cancelled},
        {"neurollm_embeddings_total", "counter", "Embeddings computed.", (double)e->embeddings},
        {"neurollm_sessions_active", "gauge", "Generations admitted to the batch.", e->active},
        {"neurollm_queue_depth", "gauge", "Generations waiting for a batch slot.", e->queued},
        {"neurollm_kv_cache_bytes", "gauge", "Bytes held by KV caches.", (double)e->kv_bytes},
        {"neurollm_step_seconds", "gauge", "Moving average of one batched step's time.",
         e->step_ms / 1e3},
        {"neurollm_tokens_per_second", "gauge", "Tokens sampled over the last second.", e->tps},
        {"neurollm_device_memory_used_bytes", "gauge", "Bytes allocated on the device.",
         (double)used},
        {"neurollm_model_layers", "gauge", "Layers of the model served.", e->m->cfg.num_layers},
    };
    pthread_mutex_unlock(&e->mu);
    size_t n = 0;
    for (size_t i = 0; i < sizeof ms / sizeof ms[0] && n < cap; i++)
        n += (size_t)snprintf(s + n, cap - n, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", ms[i].name,
                              ms[i].help, ms[i].name, ms[i].type, ms[i].name, ms[i].v);
    return s;
}

/* ---------------------------------------------------------------- life */

void nl_serve_engine_init(serve_engine *e, int max_batch, int chunk, nl_kv_dtype kv_dtype)
{
    *e = (serve_engine){
        .max_batch = max_batch, .chunk = chunk, .kv_dtype = kv_dtype, .t_start = nl_mono_s()};
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->tok_mu, NULL);
    pthread_mutex_init(&e->model_mu, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->out, NULL);
}

int nl_serve_engine_load(serve_engine *e, nl_backend **be, const char *model, const char *adapter,
                         const char *device, int threads, int tf32, int bf16, nl_error *err)
{
    nl_lora *lo = NULL;
    if (nl_checkpoint_tokenizer(model, &e->tok, err) != NL_OK ||
        nl_checkpoint_meta(model, "chat_template", &e->chat_template, err) != NL_OK ||
        nl_chat_template_check(e->chat_template, "metadata 'chat_template'", err) != NL_OK ||
        (!e->tok && nl_tokenizer_new_bytes(&e->tok, err) != NL_OK) ||
        nl_cli_backend_new(be, device, threads, tf32, bf16, 0, err) != NL_OK ||
        nl_checkpoint_load(&e->m, *be, model, 0, -1, 1, 1, NULL, err) != NL_OK)
        return 1;
    if (!(e->turn_end = nl_chat_turn_end(e->chat_template))) {
        nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        return 1;
    }
    /* the sessions' cache type, refused now rather than at each admission
     * where the backend cannot hold it */
    nl_kvcache *probe = NULL;
    if (nl_kvcache_new(&probe, e->m, 1, 1, e->kv_dtype, err) != NL_OK)
        return 1;
    nl_kvcache_destroy(&probe);
    /* the batched engine applies no adapters: the adapter is folded into
     * the weights once (W += alpha/r B A), as `neuroctl lora merge` does */
    if (adapter &&
        (nl_lora_check_base(adapter, model, err) != NL_OK ||
         nl_lora_load(&lo, e->m, adapter, 1, err) != NL_OK || nl_lora_merge(lo, err) != NL_OK)) {
        nl_error_prefix(err, "--adapter");
        nl_lora_destroy(&lo);
        return 1;
    }
    nl_lora_destroy(&lo);
    return nl_batch_new(&e->batch, e->m, e->max_batch + e->chunk, err) != NL_OK;
}

nl_status nl_serve_engine_start(serve_engine *e, nl_error *err)
{
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0)
        return nl_error_set(err, NL_ERR_INTERNAL, "cannot start the engine thread");
    e->started = 1;
    return NL_OK;
}

void nl_serve_engine_backend(serve_engine *e, nl_http_backend *hb)
{
    *hb = (nl_http_backend){.ctx = e,
                            .model_name = e->name,
                            .completion_start = be_start,
                            .completion_next = be_next,
                            .completion_end = be_end,
                            .embed = be_embed,
                            .chat_template = be_chat_template,
                            .token_bytes = be_token_bytes,
                            .status_json = be_status,
                            .metrics_text = be_metrics};
}

void nl_serve_engine_stop(serve_engine *e)
{
    if (!e->started)
        return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_broadcast(&e->work);
    pthread_cond_broadcast(&e->out);
    pthread_mutex_unlock(&e->mu);
}

void nl_serve_engine_free(serve_engine *e)
{
    if (e->started)
        pthread_join(e->thread, NULL);
    e->started = 0;
    while (e->jobs) {
        job *j = e->jobs;
        e->jobs = j->next;
        job_release_kv(e, j);
        job_free(j);
    }
    nl_batch_destroy(&e->batch);
    nl_model_destroy(&e->m);
    nl_tokenizer_destroy(&e->tok);
    free(e->chat_template);
    e->chat_template = NULL;
    free(e->turn_end);
    e->turn_end = NULL;
}
