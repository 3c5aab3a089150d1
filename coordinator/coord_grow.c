/* Growth of the cluster's model (issue 16, DESIGN.md section 5): the
 * `grow` job kind (neuroctl tokenizer learn --cluster, neuroctl grow
 * --cluster), the growth a training job runs before it starts
 * (--learn-vocab, coord_train_prep.c) and `--grow auto` (depth as nodes
 * join: at rest here, at a training checkpoint in coord_train_ckpt.c).
 *
 * Every growth follows one path: on the loop, coord_grow_prepare copies
 * what it needs; a worker (coord_work.c) lets the tokenizer learn (for the
 * vocabulary) and writes the grown model as a new manifest beside the one
 * the stages hold (nl_manifest_grow, core/grow/grow.h: shards it leaves alone
 * reused, new moments zero, a history entry per grown dimension) and
 * verifies it; back on the loop coord_grow_install makes it the source and
 * reloads the stages on a new plan. A cluster that serves the seed has no
 * files: its vocabulary grows by config alone (the nodes draw the new table
 * rows from the same per-chunk streams as the old ones). Growth is refused
 * while the stages hold weights trained since the last checkpoint: a
 * reload would lose them. */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/grow/grow.h"
#include "core/model/memory.h"
#include "core/plan/sizing.h"
#include "core/tokenizer/tokenizer.h"

/* ---------------------------------------------------------------- the record */

static const char *kind_name(int kind)
{
    return kind == COORD_GROW_VOCAB ? "vocab" : kind == COORD_GROW_DEPTH ? "depth" : "width";
}

json_t *coord_growth_json(const coord_growth *g)
{
    return json_pack(
        "{s:s,s:I,s:{s:I,s:i,s:i,s:i},s:{s:I,s:i,s:i,s:i},s:f}", "kind", kind_name(g->kind), "step",
        (json_int_t)g->step, "from", "vocab_size", (json_int_t)g->before.vocab_size, "num_layers",
        g->before.num_layers, "hidden_dim", g->before.hidden_dim, "ffn_dim", g->before.ffn_dim,
        "to", "vocab_size", (json_int_t)g->after.vocab_size, "num_layers", g->after.num_layers,
        "hidden_dim", g->after.hidden_dim, "ffn_dim", g->after.ffn_dim, "seconds", g->seconds);
}

void coord_growth_record(nl_coord *c, int kind, int64_t step, const nl_config *before,
                         const nl_config *after, double seconds)
{
    c->growths++;
    c->last_growth = (coord_growth){kind, step, *before, *after, seconds};
    NL_INFO("grew the model (%s) at step %lld: vocab %lld -> %lld, layers %d -> %d, width %d -> "
            "%d, in %.2f s",
            kind_name(kind), (long long)step, (long long)before->vocab_size,
            (long long)after->vocab_size, before->num_layers, after->num_layers, before->hidden_dim,
            after->hidden_dim, seconds);
}

/* ---------------------------------------------------------------- off the loop */

/* dir/file into out; 0, or -1 when it does not fit. */
static int join_path(char *out, size_t cap, const char *dir, const char *file)
{
    const int n = snprintf(out, cap, "%s/%s", dir, file);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

/* The tokenizer alone changed (the tables hold its ids already): the
 * manifest's shards, linked into out_dir, under a new manifest that
 * carries the new tokenizer. */
static nl_status relink_tokenizer(const char *src, const char *tok, const char *out_dir,
                                  char *out_path, size_t cap, nl_error *err)
{
    nl_manifest *mf = NULL;
    char to[PATH_MAX];
    nl_status st = nl_manifest_load(&mf, src, err);
    if (st == NL_OK)
        st = nl_file_mkdirs(out_dir, err);
    for (int i = 0; st == NL_OK && i < mf->n_shards; i++) {
        if (join_path(to, sizeof to, out_dir, mf->shards[i].file) != 0)
            st = nl_error_set(err, NL_ERR_RANGE, "%s: the path is too long", out_dir);
        else if (link(mf->shards[i].path, to) != 0)
            st = nl_error_set(err, NL_ERR_IO, "%s: cannot link %s: %s", to, mf->shards[i].path,
                              strerror(errno));
    }
    if (st == NL_OK) {
        free(mf->tokenizer);
        mf->tokenizer = NULL;
        if (!(mf->tokenizer = strdup(tok)))
            st = nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
    }
    if (st == NL_OK && join_path(out_path, cap, out_dir, NL_MANIFEST_FILE) != 0)
        st = nl_error_set(err, NL_ERR_RANGE, "%s: the path is too long", out_dir);
    if (st == NL_OK)
        st = nl_manifest_write(out_path, mf, err);
    nl_manifest_destroy(&mf);
    return st;
}

/* The tokenizer learns g->add ids from g->input: g->new_tok, and the
 * vocabulary it needs. */
static nl_status learn(coord_grow_work *g, int64_t *vocab, nl_error *err)
{
    nl_tokenizer *t = NULL;
    char *text = NULL, *saved = NULL;
    size_t len = 0, saved_len = 0;
    nl_status st = g->tok ? nl_tokenizer_load_buffer(&t, g->tok, strlen(g->tok), err)
                          : nl_tokenizer_new_bytes(&t, err);
    if (st != NL_OK) {
        nl_error_prefix(err, "the cluster's tokenizer");
        goto out;
    }
    if ((st = nl_file_read_all(g->input, g->max_bytes, &text, &len, err)) != NL_OK)
        goto out;
    g->tok_before = nl_tokenizer_vocab_size(t);
    const nl_tokenizer_train_opts to = nl_tokenizer_train_opts_default();
    if ((st = nl_tokenizer_learn(t, text, len, (int32_t)g->add, &to, err)) != NL_OK)
        goto out;
    g->tok_after = nl_tokenizer_vocab_size(t);
    if ((st = nl_tokenizer_save_buffer(t, &saved, &saved_len, err)) != NL_OK)
        goto out;
    if (!(g->new_tok = malloc(saved_len + 1))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
        goto out;
    }
    memcpy(g->new_tok, saved, saved_len);
    g->new_tok[saved_len] = '\0';
    *vocab = g->tok_after > g->cfg.vocab_size ? g->tok_after : g->cfg.vocab_size;
out:
    nl_tokenizer_destroy(&t);
    free(text);
    free(saved);
    return st;
}

nl_status coord_grow_run(coord_grow_work *g, nl_error *err)
{
    nl_grow_spec spec = {.n_layers = g->layers, .hidden_dim = g->hidden_dim, .ffn_dim = g->ffn_dim};
    char dir[PATH_MAX], path[PATH_MAX], *grown = NULL;
    nl_status st = NL_OK;
    int64_t vocab = g->cfg.vocab_size;
    if (g->input && (st = learn(g, &vocab, err)) != NL_OK)
        return st;
    if (vocab != g->cfg.vocab_size) {
        spec.vocab_size = vocab;
        spec.tokenizer = g->new_tok;
    }
    g->grown = g->cfg;
    g->grown.vocab_size = vocab;
    if (g->layers)
        g->grown.num_layers = g->layers;
    if ((g->hidden_dim || g->ffn_dim) &&
        (st = nl_config_widen(&g->grown, g->hidden_dim ? g->hidden_dim : g->grown.hidden_dim,
                              g->ffn_dim, &g->grown, err)) != NL_OK)
        return st;
    if ((st = nl_config_validate(&g->grown, 1, err)) != NL_OK)
        return st;
    g->kind = spec.vocab_size   ? COORD_GROW_VOCAB
              : spec.n_layers   ? COORD_GROW_DEPTH
              : spec.hidden_dim ? COORD_GROW_WIDTH
              : spec.ffn_dim    ? COORD_GROW_WIDTH
                                : COORD_GROW_VOCAB; /* the tokenizer only */
    if (!g->src) /* the seed: the nodes draw the grown tables themselves */
        return NL_OK;
    /* beside the manifest the stages hold: <its dir>-<what>-<size> */
    const char *slash = strrchr(g->src, '/');
    snprintf(dir, sizeof dir, "%.*s-%s-%lld", slash ? (int)(slash - g->src) : 0, g->src,
             g->kind == COORD_GROW_VOCAB   ? "vocab"
             : g->kind == COORD_GROW_DEPTH ? "depth"
                                           : "width",
             (long long)(g->kind == COORD_GROW_VOCAB   ? g->grown.vocab_size
                         : g->kind == COORD_GROW_DEPTH ? g->grown.num_layers
                                                       : g->grown.hidden_dim));
    if (spec.vocab_size || spec.n_layers || spec.hidden_dim || spec.ffn_dim) {
        st = nl_manifest_grow(g->src, &spec, UINT64_MAX, dir, &grown, err);
        snprintf(path, sizeof path, "%s", grown ? grown : "");
        free(grown);
    } else if (g->new_tok) {
        st = relink_tokenizer(g->src, g->new_tok, dir, path, sizeof path, err);
    } else {
        return nl_error_set(err, NL_ERR_INVALID, "grow: nothing to grow");
    }
    if (st == NL_OK)
        st = coord_manifest_open(&g->mf, path, NULL, err); /* written here: ours */
    g->have_mf = st == NL_OK;
    return st;
}

void coord_grow_release(coord_grow_work *g)
{
    free(g->tok);
    free(g->input);
    free(g->src);
    free(g->new_tok);
    if (g->have_mf)
        coord_manifest_release(&g->mf);
    memset(g, 0, sizeof *g);
}

/* ---------------------------------------------------------------- on the loop */

const char *coord_grow_refusal(const nl_coord *c, char *why, size_t cap)
{
    if (!c->have_cfg)
        snprintf(why, cap, "the cluster has no model yet: %s", c->state);
    else if (c->stages_modified)
        snprintf(why, cap,
                 "the stages hold weights trained since the last checkpoint; a growth "
                 "reloads them (train with a final checkpoint first)");
    else if (c->src && !c->src_manifest)
        snprintf(why, cap,
                 "the cluster serves the checkpoint %.400s: growth needs a training "
                 "manifest (train on the cluster with a checkpoint, or start it with "
                 "--resume MANIFEST)",
                 c->src_path);
    else
        return NULL;
    return why;
}

nl_status coord_grow_prepare(nl_coord *c, coord_grow_work *g, const char *input, int64_t add,
                             int layers, int hidden_dim, int ffn_dim, nl_error *err)
{
    memset(g, 0, sizeof *g);
    g->add = add;
    g->layers = layers;
    g->hidden_dim = hidden_dim;
    g->ffn_dim = ffn_dim;
    g->cfg = c->cfg;
    g->max_bytes = (size_t)c->o.max_data_bytes;
    if (!c->src_manifest && (layers || hidden_dim || ffn_dim))
        return nl_error_set(err, NL_ERR_STATE,
                            "the cluster's model comes from the seed: depth and width grow a "
                            "training manifest (train on the cluster with a checkpoint first)");
    int oom = input && !(g->input = strdup(input));
    if (c->tok_text)
        oom |= !(g->tok = strdup(c->tok_text));
    if (c->src_manifest)
        oom |= !(g->src = strdup(c->src_path));
    if (oom) {
        coord_grow_release(g);
        return nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
    }
    return NL_OK;
}

void coord_grow_install(nl_coord *c, coord_grow_work *g, double seconds)
{
    const nl_config before = c->cfg;
    const int64_t step = c->src_manifest ? c->src_step : 0;
    if (g->have_mf) {
        coord_manifest_install(c, &g->mf, 1);
        g->have_mf = 0;
        /* the grown model goes on from its step: its new parameters' bias
         * correction counts from their birth (docs/training.md) */
        c->src_continues = 1;
    } else { /* the seed: the nodes draw the grown tables themselves */
        if (g->new_tok) {
            free(c->tok_text);
            c->tok_text = g->new_tok;
            g->new_tok = NULL;
        }
        c->cfg = g->grown;
        coord_reload(c);
        /* no manifest holds the history yet: the next one written will */
        nl_growth *h = before.vocab_size == c->cfg.vocab_size
                           ? NULL /* the tokenizer alone: nothing grew */
                           : realloc(c->growth, (size_t)(c->n_growth + 1) * sizeof *h);
        if (h) {
            h[c->n_growth++] = (nl_growth){.step = step,
                                           .kind = NL_GROW_VOCAB,
                                           .before = before,
                                           .after = c->cfg,
                                           .adam_steps = 0};
            c->growth = h;
        } else if (before.vocab_size != c->cfg.vocab_size) {
            NL_WARN("grow: out of memory for the growth history");
        }
    }
    coord_growth_record(c, g->kind, step, &before, &c->cfg, seconds);
}

json_t *coord_grow_event(const nl_coord *c, const coord_grow_work *g)
{
    json_t *o = coord_growth_json(&c->last_growth);
    if (!o)
        return NULL;
    json_object_set_new(o, "event", json_string("grow"));
    if (g->input) {
        json_object_set_new(o, "tokenizer_from", json_integer((json_int_t)g->tok_before));
        json_object_set_new(o, "tokenizer_to", json_integer((json_int_t)g->tok_after));
    }
    if (c->src_manifest)
        json_object_set_new(o, "manifest", json_string(c->src_path));
    return o;
}

/* ---------------------------------------------------------------- --grow auto */

/* The live nodes' count and memory, and the training memory judged
 * with: what a depth proposal depends on. */
static uint64_t node_signature(const nl_coord *c, const nl_mem_opts *mo, int *n)
{
    uint64_t h = 1469598103934665603ull;
    const uint64_t v[5] = {(uint64_t)mo->micro_rows, (uint64_t)mo->in_flight,
                           (uint64_t)mo->recompute, (uint64_t)mo->training,
                           (uint64_t)mo->in_flight_extra};
    *n = 0;
    for (int i = 0; i < c->n_nodes; i++)
        if (c->nodes[i].life == NODE_LIVE) {
            h = (h ^ c->nodes[i].memory) * 1099511628211ull;
            h = (h ^ c->nodes[i].id) * 1099511628211ull;
            (*n)++;
        }
    for (int i = 0; i < 5; i++)
        h = (h ^ v[i]) * 1099511628211ull;
    return h;
}

int coord_grow_auto_depth(nl_coord *c)
{
    int n = 0;
    nl_sizing_opts so;
    nl_sizing_opts_init(&so);
    if (c->train_mem.training) /* a job runs: the memory it trains with */
        c->grow_mem = c->train_mem;
    if (c->grow_mem.training) /* or the last job's */
        so.plan.mem = c->grow_mem;
    const uint64_t sig = node_signature(c, &so.plan.mem, &n);
    if (!c->o.grow_auto || !c->have_cfg || !c->src_manifest || sig == c->grow_sig || n == 0)
        return 0;
    c->grow_sig = sig; /* judged once per set of nodes */
    nl_plan_node *pn = malloc((size_t)n * sizeof *pn);
    if (!pn)
        return 0;
    n = 0;
    for (int i = 0; i < c->n_nodes; i++)
        if (c->nodes[i].life == NODE_LIVE) {
            const cnode *x = &c->nodes[i];
            const double g = x->seen_gflops > 0 ? x->seen_gflops : x->gflops;
            pn[n++] =
                (nl_plan_node){(int)x->id, x->memory, g > 0 ? g : 1.0, 0.0, coord_link_bytes_s(x)};
        }
    nl_sizing sz;
    nl_error e = {0};
    int depth = 0;
    if (nl_sizing_propose_depth(&sz, &c->cfg, pn, n > NL_PLAN_MAX_NODES ? NL_PLAN_MAX_NODES : n,
                                &so, &e) != NL_OK)
        NL_INFO("--grow auto: no depth fits the %d nodes: %s", n, e.msg);
    else if (sz.cfg.num_layers > c->cfg.num_layers &&
             nl_sizing_should_change(&c->cfg, &sz.cfg, so.factor))
        depth = sz.cfg.num_layers;
    else
        NL_INFO("--grow auto: %d nodes (%.1f MiB) propose %d layers for the model's %d: no "
                "growth (hysteresis %.2f)",
                n, (double)sz.total_bytes / (1 << 20), sz.cfg.num_layers, c->cfg.num_layers,
                so.factor);
    if (depth)
        NL_INFO("--grow auto: %d nodes (%.1f MiB) hold %d layers: the model grows from %d (%s)", n,
                (double)sz.total_bytes / (1 << 20), depth, c->cfg.num_layers, sz.report);
    free(pn);
    return depth;
}

/* ---------------------------------------------------------------- the growth task
 * One growth in a worker, for all three of its users: --grow auto at rest
 * (below), the grow job (below) and --grow auto at a training checkpoint
 * (coord_train_ckpt.c). */

static void grow_task_run(cwork *w)
{
    coord_grow_task *k = (coord_grow_task *)w;
    k->st = coord_grow_run(&k->g, &k->err);
}

static void grow_task_free(cwork *w)
{
    coord_grow_task *k = (coord_grow_task *)w;
    coord_grow_release(&k->g);
    free(k);
}

coord_grow_task *coord_grow_task_new(nl_coord *c, uint64_t job, const char *input, int64_t add,
                                     int layers, int hidden_dim, int ffn_dim,
                                     void (*done)(nl_coord *c, cwork *w), nl_error *err)
{
    coord_grow_task *k = calloc(1, sizeof *k);
    if (!k) {
        nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        return NULL;
    }
    if (coord_grow_prepare(c, &k->g, input, add, layers, hidden_dim, ffn_dim, err) != NL_OK) {
        free(k);
        return NULL;
    }
    k->w = (cwork){.run = grow_task_run, .done = done, .free = grow_task_free, .job_id = job};
    k->t0 = nl_mono_s();
    snprintf(k->src, sizeof k->src, "%s", c->src_path);
    return k;
}

/* ---------------------------------------------------------------- --grow auto at rest */

/* A growth at rest (no job): when it is done the cluster must still be
 * at rest, on the source it grew. */
static void rest_done(nl_coord *c, cwork *w)
{
    coord_grow_task *k = (coord_grow_task *)w;
    char why[700];
    int busy = 0;
    c->growing = 0;
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        busy |= c->jobs[i].phase != JOB_FREE;
    if (k->st != NL_OK) {
        NL_WARN("--grow auto: %s", k->err.msg);
        return;
    }
    if (busy || coord_grow_refusal(c, why, sizeof why) || strcmp(c->src_path, k->src) != 0) {
        NL_INFO("--grow auto: the cluster changed while the model grew; judged again later");
        c->grow_sig = 0;
        return;
    }
    coord_grow_install(c, &k->g, nl_mono_s() - k->t0);
    json_t *o = coord_grow_event(c, &k->g);
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (c->observe && text) /* /api/events: train_grow */
        c->observe(c->observe_ctx, 0, NL_JOB_RUNNING, "grown", text);
    free(text);
}

int coord_grow_tick(nl_coord *c)
{
    if (c->growing)
        return 1;
    if (c->train_mem.training) /* judged at rest with the memory the last job trained with */
        c->grow_mem = c->train_mem;
    if (!c->o.grow_auto || !c->ready || !c->plan)
        return 0;
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE)
            return 0; /* a training job judges at its checkpoints */
    char why[700];
    if (coord_grow_refusal(c, why, sizeof why))
        return 0;
    const int depth = coord_grow_auto_depth(c);
    if (!depth)
        return 0;
    nl_error e = {0};
    coord_grow_task *k = coord_grow_task_new(c, 0, NULL, 0, depth, 0, 0, rest_done, &e);
    if (!k) {
        NL_WARN("--grow auto: %s", e.msg);
        return 0;
    }
    if (coord_work_start(c, &k->w, &e) != NL_OK) {
        NL_WARN("--grow auto: %s", e.msg);
        return 0;
    }
    c->growing = 1;
    coord_set_state(c, "growing the model to %d layers", depth);
    return 1;
}

/* ---------------------------------------------------------------- the grow job */

typedef struct cgrow {
    double t0;
    int phase; /* 0: the worker runs, 1: the cluster reloads */
    json_t *event;
} cgrow;

static void grow_report(nl_coord *c, cjob *j, int state, const char *msg)
{
    const cgrow *g = j->state;
    char *text = g->event ? json_dumps(g->event, JSON_COMPACT) : NULL;
    coord_status_to(c, j->rid, j->rid_len, j->id, state, state == NL_JOB_DONE ? 1.0 : 0.5, msg,
                    text);
    free(text);
}

static void grow_job_done(nl_coord *c, cwork *w)
{
    coord_grow_task *k = (coord_grow_task *)w;
    cjob *j = coord_job_find(c, w->job_id);
    cgrow *g = j ? j->state : NULL;
    char why[700];
    if (!g || g->phase != 0)
        return;
    if (k->st != NL_OK) {
        coord_job_fail(c, j, k->err.msg);
        return;
    }
    if (coord_grow_refusal(c, why, sizeof why)) { /* it changed while the worker ran */
        coord_job_fail(c, j, why);
        return;
    }
    /* other jobs lose their stages to the reload */
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE && &c->jobs[i] != j)
            coord_job_fail(c, &c->jobs[i], "the cluster reloads: its model grows");
    coord_grow_install(c, &k->g, nl_mono_s() - g->t0);
    g->event = coord_grow_event(c, &k->g);
    g->phase = 1;
    j->phase = JOB_WAITING;
    j->last_progress = nl_mono_s();
    grow_report(c, j, NL_JOB_RUNNING, "grown; the stages reload");
}

static void grow_ready(nl_coord *c, cjob *j)
{
    cgrow *g = j->state;
    if (g->phase != 1)
        return;
    grow_report(c, j, NL_JOB_DONE, "grown");
    coord_job_free(j);
}

static int grow_stage_lost(nl_coord *c, cjob *j, const char *why)
{
    (void)c;
    (void)why;
    return ((cgrow *)j->state)->phase == 1; /* reloading: wait for the next plan */
}

static void grow_free(cjob *j)
{
    cgrow *g = j->state;
    if (!g)
        return;
    json_decref(g->event);
    free(g);
    j->state = NULL;
}

/* An int parameter in [lo, hi], 0 when absent; -1 when out of range. */
static int64_t int_param(const nl_msg_job_submit *s, const char *key, int64_t lo, int64_t hi)
{
    const nl_wire_param *p = coord_param(s, key);
    if (!p)
        return 0;
    return p->kind == NL_WIRE_PARAM_INT && p->i >= lo && p->i <= hi ? p->i : -1;
}

/* params: "input" (a text file under --data-root) with "add" (ids to
 * learn); and/or "layers", "hidden_dim", "ffn_dim" (the sizes to grow to). */
static const char *read_grow(nl_coord *c, const nl_msg_job_submit *s, char *real, size_t cap,
                             int64_t v[4], char *why, size_t wcap)
{
    const nl_wire_param *in = coord_param(s, "input");
    v[0] = int_param(s, "add", 1, 1 << 24);
    v[1] = int_param(s, "layers", 1, 1 << 16);
    v[2] = int_param(s, "hidden_dim", 1, 1 << 20);
    v[3] = int_param(s, "ffn_dim", 1, 1 << 22);
    if (v[0] < 0 || v[1] < 0 || v[2] < 0 || v[3] < 0 || (!in) != (v[0] == 0) ||
        (in && in->kind != NL_WIRE_PARAM_STR) || !(in || v[1] || v[2] || v[3]))
        return "grow: params.input with params.add (1 to 2^24 ids), or params.layers, "
               "params.hidden_dim, params.ffn_dim (the sizes to grow to)";
    if (v[1] && v[1] <= c->cfg.num_layers) {
        snprintf(why, wcap, "grow: --layers %lld: the model has %d already", (long long)v[1],
                 c->cfg.num_layers);
        return why;
    }
    const char *bad =
        in ? coord_confine_file(c->data_root, in->s, NULL, c->o.max_data_bytes, real, cap) : NULL;
    if (bad) {
        snprintf(why, wcap, "grow: params.input: %s (the coordinator's --data-root)", bad);
        return why;
    }
    return coord_grow_refusal(c, why, wcap);
}

static void grow_submit(nl_coord *c, const nl_rx *rx)
{
    char why[900], real[PATH_MAX];
    int64_t v[4];
    nl_error e = {0};
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE &&
            (c->jobs[i].ops == &coord_train_ops || c->jobs[i].ops == &coord_grow_ops)) {
            snprintf(why, sizeof why, "job %llu (%s) runs; the model grows between jobs",
                     (unsigned long long)c->jobs[i].id, c->jobs[i].ops->name);
            coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, why, NULL);
            return;
        }
    if (c->growing) {
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0,
                        "the model grows already (--grow auto)", NULL);
        return;
    }
    cjob *j = coord_job_new(c, rx, &coord_grow_ops);
    if (!j)
        return;
    cgrow *g = j->state = calloc(1, sizeof *g);
    coord_grow_task *k = NULL;
    const char *bad =
        !g ? "out of memory"
           : read_grow(c, &rx->msg.u.job_submit, real, sizeof real, v, why, sizeof why);
    if (!bad && !(k = coord_grow_task_new(c, j->id, v[0] ? real : NULL, v[0], (int)v[1], (int)v[2],
                                          (int)v[3], grow_job_done, &e)))
        bad = e.msg;
    if (bad) {
        coord_job_fail(c, j, bad);
        return;
    }
    g->t0 = k->t0;
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, "growing", NULL);
    if (coord_work_start(c, &k->w, &e) != NL_OK)
        coord_job_fail(c, j, e.msg);
}

const cjob_ops coord_grow_ops = {
    .kind = NL_JOB_GROW,
    .name = "grow",
    .submit = grow_submit,
    .stage_lost = grow_stage_lost,
    .ready = grow_ready,
    .free = grow_free,
};
