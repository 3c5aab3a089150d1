/* Private to neuroctl serve (cli/cmd_serve.c): the engine that serves one
 * model (cli/serve_engine.c). HTTP threads submit jobs through the
 * nl_http_backend it fills; one engine thread owns the model and runs the
 * batched decoder; the command loads it, starts its thread, and stops and
 * frees it. */
#ifndef NL_CLI_SERVE_ENGINE_H
#define NL_CLI_SERVE_ENGINE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "core/model/batch.h"
#include "core/model/sampler.h"
#include "core/tokenizer/tokenizer.h"
#include "serve/http.h"

typedef struct serve_engine {
    nl_model *m;
    nl_batch *batch;
    nl_tokenizer *tok;
    char *chat_template;      /* the checkpoint's, JSON (core/tokenizer/chat_template.h) */
    char *turn_end;           /* its assistant suffix: a special token in it ends an answer */
    pthread_mutex_t tok_mu;   /* the encoder keeps a cache */
    pthread_mutex_t model_mu; /* the batch's activations: engine steps, embeddings */
    int max_batch, chunk;
    nl_kv_dtype kv_dtype; /* the sessions' caches (--kv-cache) */
    const char *name;
    pthread_mutex_t mu;
    pthread_cond_t work, out;
    struct job *jobs; /* arrival order */
    pthread_t thread;
    int started; /* the thread runs */
    int stop;
    nl_http *http;
    /* (max_batch each, the engine thread's) a step's device sampling */
    nl_sampler **smp;
    const float **lg;
    nl_sample_row *srows;
    /* figures (under mu) */
    uint64_t tokens, prompt_tokens, steps, rows, cancelled, finished, embeddings;
    int active, queued;
    size_t kv_bytes;
    double step_ms, tps, t_start;
} serve_engine;

/* e with no model yet: its batch of max_batch generations and prompts of
 * chunk positions a step, sessions' caches of kv_dtype, its locks. */
void nl_serve_engine_init(serve_engine *e, int max_batch, int chunk, nl_kv_dtype kv_dtype);
/* e's tokenizer, chat template and model on a new backend (*be),
 * the adapter merged into the weights, and its batch: 0, or 1 when one
 * fails (err says why; what was made nl_serve_engine_free frees, and the
 * caller the backend). */
int nl_serve_engine_load(serve_engine *e, nl_backend **be, const char *model, const char *adapter,
                         const char *device, int threads, int tf32, int bf16, nl_error *err);
/* Start e's engine thread (after nl_serve_engine_load). */
nl_status nl_serve_engine_start(serve_engine *e, nl_error *err);
/* The HTTP server's backend: e's jobs, embeddings, status and metrics,
 * under e->name. */
void nl_serve_engine_backend(serve_engine *e, nl_http_backend *hb);
/* Tell e's thread (if it runs) to stop, and the jobs' waiters that the
 * server is stopping. */
void nl_serve_engine_stop(serve_engine *e);
/* After nl_serve_engine_stop and nl_http_stop (whose connections end
 * their jobs): join the thread, free the jobs left, the batch, the model,
 * the tokenizer and the chat template (not the backend). */
void nl_serve_engine_free(serve_engine *e);

#endif
