/* neurocoord --http: the cluster's status as JSON (GET /api/status) and
 * its figures in Prometheus' text format (GET /metrics), from the last
 * status the poller took and the counters of the completions
 * (coord_http.c). */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/coord_http_impl.h"

/* ---------------------------------------------------------------- the model's name */

/* What is served now, from the last status (under mu): the file the
 * cluster started from, until a training job changes the weights; then
 * the job and step that made them ("m.safetensors@job-2-step-200"), so
 * that a name never stands for weights it no longer is. */
static void model_name_locked(const nl_coord_http *h, char *buf, size_t cap)
{
    json_t *w = h->status ? json_object_get(h->status, "weights") : NULL;
    const long long job = (long long)json_integer_value(json_object_get(w, "job")),
                    step = (long long)json_integer_value(json_object_get(w, "step"));
    if (job > 0)
        snprintf(buf, cap, "%.200s@job-%lld-step-%lld", h->name, job, step);
    else
        snprintf(buf, cap, "%s", h->name);
}

void coord_http_model_name(void *ctx, char *buf, size_t cap)
{
    nl_coord_http *h = ctx;
    pthread_mutex_lock(&h->mu);
    model_name_locked(h, buf, cap);
    pthread_mutex_unlock(&h->mu);
}

/* ---------------------------------------------------------------- status, metrics */

static int by_stage(const void *a, const void *b)
{
    json_t *x = *(json_t *const *)a, *y = *(json_t *const *)b;
    const json_int_t sx = json_integer_value(json_object_get(x, "stage")),
                     sy = json_integer_value(json_object_get(y, "stage"));
    const json_int_t ix = json_integer_value(json_object_get(x, "id")),
                     iy = json_integer_value(json_object_get(y, "id"));
    return sx != sy ? (sx > sy) - (sx < sy) : (ix > iy) - (ix < iy);
}

json_t *coord_http_pipeline(json_t *nodes)
{
    json_t *out = json_array(), *n;
    size_t i, k = 0, count = json_array_size(nodes);
    json_t **staged = count ? calloc(count, sizeof *staged) : NULL;
    if (!out || (count && !staged)) {
        free(staged);
        return out;
    }
    json_array_foreach(nodes, i, n)
    {
        if (json_is_integer(json_object_get(n, "stage")))
            staged[k++] = n;
    }
    if (k > 1)
        qsort(staged, k, sizeof *staged, by_stage);
    for (i = 0; i < k; i++) {
        n = staged[i];
        char name[32];
        snprintf(name, sizeof name, "node-%lld",
                 (long long)json_integer_value(json_object_get(n, "id")));
        /* busy: the share of its last heartbeat's period the node computed */
        const double load = json_number_value(json_object_get(n, "load"));
        json_t *p = json_object();
        json_object_set(p, "stage", json_object_get(n, "stage"));
        json_object_set_new(p, "node", json_string(name));
        json_object_set(p, "id", json_object_get(n, "id"));
        json_object_set(p, "device", json_object_get(n, "device"));
        json_object_set_new(p, "state", json_string(coord_http_node_state(n)));
        json_object_set(p, "layers", json_object_get(n, "layers"));
        json_object_set(p, "layers_text", json_object_get(n, "layers_text"));
        json_object_set_new(p, "busy", json_real(load < 0 ? 0.0 : load > 1 ? 1.0 : load));
        json_array_append_new(out, p);
    }
    free(staged);
    return out;
}

static json_t *jnum(double x)
{
    return isfinite(x) ? json_real(x) : json_null();
}

static json_t *curve_json(const loss_curve *c)
{
    json_t *a = json_array();
    for (int i = 0; a && i < c->n; i++)
        json_array_append_new(a, json_pack("[I,o]", (json_int_t)c->step[i], jnum(c->loss[i])));
    return a;
}

static json_t *marks_json(const train_card *t)
{
    json_t *a = json_array();
    for (int i = 0; a && i < t->n_marks; i++)
        json_array_append_new(a, json_pack("{s:I,s:s,s:s}", "step", (json_int_t)t->marks[i].step,
                                           "kind", t->marks[i].kind, "what", t->marks[i].what));
    return a;
}

/* The job card: the last training job, running or ended. Under mu. */
static json_t *train_json(const train_card *t, double now)
{
    if (!t->job)
        return json_null();
    const int running = strcmp(t->state, "running") == 0;
    json_t *o = json_pack(
        "{s:I,s:s,s:s,s:I,s:I,s:I,s:o,s:o,s:o,s:o,s:o,s:f,s:i,s:i}", "job", (json_int_t)t->job,
        "state", t->state, "started", t->started, "start_step", (json_int_t)t->start_step, "step",
        (json_int_t)t->step, "steps", (json_int_t)t->steps, "loss", jnum(t->loss), "eval_loss",
        jnum(t->eval_loss), "eval_step",
        t->eval_step > 0 ? json_integer(t->eval_step) : json_null(), "tokens_per_s", jnum(t->tps),
        "eta_s", jnum(coord_http_train_eta(t, now)), "elapsed_s",
        (running ? now : t->t_end) - t->t_start, "stages", t->stages, "resumes", t->resumes);
    if (o && !running)
        json_object_set_new(o, "message", json_string(t->message));
    if (o) {
        json_object_set_new(o, "curve", curve_json(&t->curve));
        json_object_set_new(o, "eval_curve", curve_json(&t->eval_curve));
        json_object_set_new(o, "marks", marks_json(t));
    }
    return o;
}

char *coord_http_status(void *ctx)
{
    nl_coord_http *h = ctx;
    char served[256];
    pthread_mutex_lock(&h->mu);
    model_name_locked(h, served, sizeof served);
    json_t *st = h->status ? json_deep_copy(h->status) : json_pack("{s:s}", "state", "unknown");
    const double tps = h->tps;
    json_t *train = train_json(&h->train, nl_mono_s());
    json_object_set_new(st, "sessions", json_pack("{s:i,s:i}", "active", h->active, "queued", 0));
    json_object_set_new(st, "tokens_generated", json_integer((json_int_t)h->coord_tokens));
    json_object_set_new(st, "http_tokens_generated", json_integer((json_int_t)h->tokens));
    pthread_mutex_unlock(&h->mu);
    json_t *cfg = json_object_get(st, "config"), *nodes = json_object_get(st, "nodes"), *n;
    json_object_set_new(st, "mode", json_string("cluster"));
    json_object_set_new(
        st, "model",
        json_pack("{s:s,s:s,s:O,s:O,s:O,s:O}", "name", served, "file", h->name, "layers",
                  cfg ? json_object_get(cfg, "num_layers") : json_null(), "hidden_dim",
                  cfg ? json_object_get(cfg, "hidden_dim") : json_null(), "vocab_size",
                  cfg ? json_object_get(cfg, "vocab_size") : json_null(), "max_seq_len",
                  cfg ? json_object_get(cfg, "max_seq_len") : json_null()));
    json_object_set_new(st, "training", train);
    json_object_set_new(st, "pipeline", coord_http_pipeline(json_object_get(st, "nodes")));
    size_t i;
    json_array_foreach(nodes, i, n)
    {
        char name[32];
        snprintf(name, sizeof name, "node-%lld",
                 (long long)json_integer_value(json_object_get(n, "id")));
        const int serving = strcmp(coord_http_node_state(n), "serving") == 0;
        json_t *planned = json_object_get(n, "memory_planned"),
               *pred = json_object_get(n, "predicted_s");
        json_object_set_new(n, "name", json_string(name));
        json_object_set(n, "memory_offered", json_object_get(n, "memory"));
        json_object_set_new(n, "memory_used",
                            planned ? json_integer(json_integer_value(planned)) : json_null());
        json_object_set_new(n, "tokens_per_s", serving ? json_real(tps) : json_null());
        json_object_set_new(n, "stage_ms",
                            pred ? json_real(json_number_value(pred) * 1e3) : json_null());
        /* the node's own figures (heartbeats): mean compute per batch, mean
         * time a session hop spends on the stage, and hops per batch */
        const double hops = (double)json_integer_value(json_object_get(n, "hops")),
                     batches = (double)json_integer_value(json_object_get(n, "batches"));
        json_object_set_new(
            n, "batch_ms",
            batches > 0
                ? json_real(json_number_value(json_object_get(n, "compute_s")) * 1e3 / batches)
                : json_null());
        json_object_set_new(
            n, "hop_ms",
            hops > 0 ? json_real(json_number_value(json_object_get(n, "hop_s")) * 1e3 / hops)
                     : json_null());
        json_object_set_new(n, "hops_per_batch",
                            batches > 0 ? json_real(hops / batches) : json_null());
    }
    char *s = json_dumps(st, JSON_COMPACT);
    json_decref(st);
    return s;
}

/* Append to a growing buffer; *s NULL once out of memory. */
static void put(char **s, size_t *n, size_t *cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void put(char **s, size_t *n, size_t *cap, const char *fmt, ...)
{
    for (int tries = 0; *s && tries < 2; tries++) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(*s + *n, *cap - *n, fmt, ap);
        va_end(ap);
        if (k >= 0 && (size_t)k < *cap - *n) {
            *n += (size_t)k;
            return;
        }
        size_t nc = *cap * 2 + (size_t)(k > 0 ? k : 0) + 1;
        char *p = realloc(*s, nc);
        if (!p) {
            free(*s);
            *s = NULL;
            return;
        }
        *s = p;
        *cap = nc;
    }
}

#define HELP(name, type, help)                                                                     \
    put(&s, &n, &cap, "# HELP " name " " help "\n# TYPE " name " " type "\n")

/* The figures nodes report in their heartbeats, one family each. */
static void node_figures(char **sp, size_t *np, size_t *capp, json_t *nodes)
{
    static const struct {
        const char *key, *name, *type, *help;
    } fig[] = {
        {"kv_bytes", "neurollm_node_kv_cache_bytes", "gauge", "Bytes of KV caches on a node."},
        {"sessions", "neurollm_node_sessions", "gauge", "Generation sessions open on a node."},
        {"hops", "neurollm_node_hops_total", "counter", "Session hops a node's stage finished."},
        {"batches", "neurollm_node_batches_total", "counter",
         "Batches of session hops a node's stage ran."},
        {"compute_s", "neurollm_node_compute_seconds_total", "counter",
         "Seconds a node's stage spent computing batches of session hops."},
        {"hop_s", "neurollm_node_hop_seconds_total", "counter",
         "Seconds session hops spent on a node's stage, from arrival to output, summed."},
        {"verify_cases", "neurollm_node_verify_cases_total", "counter",
         "Cases of verification by recompute a node answered as verifier or arbiter."},
        {"verify_mismatches", "neurollm_node_verify_mismatches_total", "counter",
         "A node's verification answers that disagreed with the stage it checked."},
        {"verify_s", "neurollm_node_verify_seconds_total", "counter",
         "Seconds from sending a node a verification case to its answer, summed."},
        {"verify_bytes", "neurollm_node_verify_bytes_total", "counter",
         "Bytes of verification cases sent to a node."},
    };
    char *s = *sp;
    size_t n = *np, cap = *capp;
    for (size_t k = 0; k < sizeof fig / sizeof fig[0]; k++) {
        json_t *o;
        size_t i;
        put(&s, &n, &cap, "# HELP %s %s\n# TYPE %s %s\n", fig[k].name, fig[k].help, fig[k].name,
            fig[k].type);
        json_array_foreach(nodes, i, o)
        {
            json_t *v = json_object_get(o, fig[k].key);
            put(&s, &n, &cap, "%s{node=\"node-%lld\"} %.17g\n", fig[k].name,
                (long long)json_integer_value(json_object_get(o, "id")),
                v ? json_number_value(v) : 0.0);
        }
    }
    *sp = s;
    *np = n;
    *capp = cap;
}

char *coord_http_metrics(void *ctx)
{
    nl_coord_http *h = ctx;
    size_t n = 0, cap = 4096;
    char *s = malloc(cap);
    if (!s)
        return NULL;
    s[0] = '\0';
    static const char *const states[] = {"joined", "standby", "loading", "serving", "dead", "left"};
    pthread_mutex_lock(&h->mu);
    json_t *nodes = h->status ? json_object_get(h->status, "nodes") : NULL, *o;
    size_t i;
    HELP("neurollm_nodes", "gauge", "Nodes known to the coordinator, by state.");
    for (size_t k = 0; k < sizeof states / sizeof states[0]; k++) {
        int count = 0;
        json_array_foreach(nodes, i, o) count += strcmp(coord_http_node_state(o), states[k]) == 0;
        put(&s, &n, &cap, "neurollm_nodes{state=\"%s\"} %d\n", states[k], count);
    }
    HELP("neurollm_node_layers", "gauge", "Layers a node holds in the plan.");
    json_array_foreach(nodes, i, o)
    {
        json_t *l = json_object_get(o, "layers");
        long long id = (long long)json_integer_value(json_object_get(o, "id"));
        put(&s, &n, &cap, "neurollm_node_layers{node=\"node-%lld\"} %lld\n", id,
            l ? (long long)(json_integer_value(json_array_get(l, 1)) -
                            json_integer_value(json_array_get(l, 0)))
              : 0LL);
    }
    HELP("neurollm_node_memory_offered_bytes", "gauge", "Memory a node offered when it joined.");
    json_array_foreach(nodes, i, o)
        put(&s, &n, &cap, "neurollm_node_memory_offered_bytes{node=\"node-%lld\"} %lld\n",
            (long long)json_integer_value(json_object_get(o, "id")),
            (long long)json_integer_value(json_object_get(o, "memory")));
    HELP("neurollm_node_memory_planned_bytes", "gauge", "Memory the plan gives a node's stage.");
    json_array_foreach(nodes, i, o)
        put(&s, &n, &cap, "neurollm_node_memory_planned_bytes{node=\"node-%lld\"} %lld\n",
            (long long)json_integer_value(json_object_get(o, "id")),
            (long long)json_integer_value(json_object_get(o, "memory_planned")));
    HELP("neurollm_node_stage_predicted_seconds", "gauge",
         "The planner's time for one request row through a node's stage.");
    json_array_foreach(nodes, i, o)
        put(&s, &n, &cap, "neurollm_node_stage_predicted_seconds{node=\"node-%lld\"} %.9g\n",
            (long long)json_integer_value(json_object_get(o, "id")),
            json_number_value(json_object_get(o, "predicted_s")));
    node_figures(&s, &n, &cap, nodes);
    HELP("neurollm_banned_keys", "gauge",
         "Keys banned for computing wrong (authorized_keys' \"# banned:\" lines).");
    put(&s, &n, &cap, "neurollm_banned_keys %lld\n",
        (long long)json_integer_value(h->status ? json_object_get(h->status, "banned_keys")
                                                : NULL));
    json_t *bans = h->status ? json_object_get(h->status, "banned") : NULL;
    if (json_array_size(bans) > 0) { /* each key (Z85 needs no escaping in a label) */
        HELP("neurollm_banned_key", "gauge", "1 for each banned key.");
        json_array_foreach(bans, i, o) put(&s, &n, &cap, "neurollm_banned_key{key=\"%s\"} 1\n",
                                           json_string_value(json_object_get(o, "key")));
    }
    HELP("neurollm_plan_epoch", "gauge", "The placement generation.");
    put(&s, &n, &cap, "neurollm_plan_epoch %lld\n", (long long)h->epoch);
    HELP("neurollm_tokens_generated_total", "counter",
         "Tokens the cluster generated, for any client (HTTP or neuroctl generate).");
    put(&s, &n, &cap, "neurollm_tokens_generated_total %" PRIu64 "\n", h->coord_tokens);
    HELP("neurollm_http_tokens_total", "counter", "Tokens relayed to HTTP clients.");
    put(&s, &n, &cap, "neurollm_http_tokens_total %" PRIu64 "\n", h->tokens);
    HELP("neurollm_prompt_tokens_total", "counter", "Prompt tokens of HTTP completions.");
    put(&s, &n, &cap, "neurollm_prompt_tokens_total %" PRIu64 "\n", h->prompt_tokens);
    HELP("neurollm_generations_finished_total", "counter", "HTTP generations ended.");
    put(&s, &n, &cap, "neurollm_generations_finished_total %" PRIu64 "\n", h->finished);
    HELP("neurollm_generations_cancelled_total", "counter",
         "HTTP generations cancelled on every stage because their client went away.");
    put(&s, &n, &cap, "neurollm_generations_cancelled_total %" PRIu64 "\n", h->cancelled);
    HELP("neurollm_sessions_active", "gauge", "HTTP generations running on the cluster.");
    put(&s, &n, &cap, "neurollm_sessions_active %d\n", h->active);
    HELP("neurollm_tokens_per_second", "gauge",
         "Tokens the cluster generated over the last second, for any client.");
    put(&s, &n, &cap, "neurollm_tokens_per_second %.6g\n", h->tps);
    const train_card *t = &h->train;
    if (t->job) {
        HELP("neurollm_train_step", "gauge", "The training job's last step.");
        put(&s, &n, &cap, "neurollm_train_step %lld\n", (long long)t->step);
        HELP("neurollm_train_steps", "gauge", "The step the training job ends at.");
        put(&s, &n, &cap, "neurollm_train_steps %lld\n", (long long)t->steps);
        HELP("neurollm_train_running", "gauge", "1 while the training job runs, 0 after it.");
        put(&s, &n, &cap, "neurollm_train_running %d\n", strcmp(t->state, "running") == 0);
        if (!isnan(t->loss)) {
            HELP("neurollm_train_loss", "gauge", "The training loss of the last step.");
            put(&s, &n, &cap, "neurollm_train_loss %.9g\n", t->loss);
        }
        if (!isnan(t->tps)) {
            HELP("neurollm_train_tokens_per_second", "gauge", "Training tokens per second.");
            put(&s, &n, &cap, "neurollm_train_tokens_per_second %.6g\n", t->tps);
        }
        HELP("neurollm_train_digest_mismatches", "gauge",
             "The training job's hops whose sender and receiver report different digests.");
        put(&s, &n, &cap, "neurollm_train_digest_mismatches %lld\n", (long long)t->dig_mismatches);
        HELP("neurollm_train_verified", "gauge",
             "The training job's (stage, microbatch)s redone by a verifier (--verify-rate).");
        put(&s, &n, &cap, "neurollm_train_verified %lld\n", (long long)t->verified);
        HELP("neurollm_train_verify_mismatches", "gauge",
             "Of those, the ones whose recompute gave other digests than the stage sent.");
        put(&s, &n, &cap, "neurollm_train_verify_mismatches %lld\n",
            (long long)t->verify_mismatches);
        if (!isnan(t->eval_loss)) {
            HELP("neurollm_train_eval_loss", "gauge", "The last held-out loss.");
            put(&s, &n, &cap, "neurollm_train_eval_loss %.9g\n", t->eval_loss);
        }
    }
    pthread_mutex_unlock(&h->mu);
    return s;
}
