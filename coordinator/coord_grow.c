/* Growth of the cluster's model (issue 16, DESIGN.md section 5): the
 * `grow` job kind (neuroctl tokenizer learn --cluster, neuroctl grow
 * --cluster) and the vocabulary growth a training job runs before it
 * starts (--learn-vocab, coord_train.c).
 *
 * Every growth follows one path: a worker (coord_work.c) reads the
 * source the stages hold (the last verified manifest, or the seed), writes
 * the grown model as a new manifest beside it (every shard rewritten with
 * the new config; the tables and their AdamW moments of the embedding and
 * head stages grown by whole vocab_chunks with nl_model_grow_vocab, every
 * other tensor copied unchanged), verifies it, and on the loop the
 * coordinator makes it the source and reloads the stages. A cluster that
 * starts from the seed has no files: its vocabulary grows by config alone
 * (new table rows come from the same per-chunk streams the nodes draw the
 * old ones from). Growth is refused while the stages hold weights trained
 * since the last checkpoint: a reload would lose them. */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "coord_impl.h"
#include "core/checkpoint.h"
#include "core/fileio.h"
#include "core/memory.h"
#include "core/tokenizer.h"

/* ---------------------------------------------------------------- the record */

static const char *kind_name(int kind)
{
    return kind == COORD_GROW_VOCAB ? "vocab" : kind == COORD_GROW_DEPTH ? "depth" : "width";
}

json_t *coord_growth_json(const coord_growth *g)
{
    return json_pack("{s:s,s:I,s:{s:I,s:i,s:i,s:i},s:{s:I,s:i,s:i,s:i},s:f}", "kind",
                     kind_name(g->kind), "step", (json_int_t)g->step, "from", "vocab_size",
                     (json_int_t)g->before.vocab_size, "num_layers", g->before.num_layers,
                     "hidden_dim", g->before.hidden_dim, "ffn_dim", g->before.ffn_dim, "to",
                     "vocab_size", (json_int_t)g->after.vocab_size, "num_layers",
                     g->after.num_layers, "hidden_dim", g->after.hidden_dim, "ffn_dim",
                     g->after.ffn_dim, "seconds", g->seconds);
}

void coord_growth_record(nl_coord *c, int kind, int64_t step, const nl_config *before,
                         const nl_config *after, double seconds)
{
    c->growths++;
    c->last_growth = (coord_growth){kind, step, *before, *after, seconds};
    NL_INFO("grew the model (%s) at step %lld: vocab %lld -> %lld, layers %d -> %d, width %d -> "
            "%d, in %.2f s",
            kind_name(kind), (long long)step, (long long)before->vocab_size,
            (long long)after->vocab_size, before->num_layers, after->num_layers,
            before->hidden_dim, after->hidden_dim, seconds);
}

/* ---------------------------------------------------------------- vocabulary, off the loop */

/* Rewrite every shard of the manifest at src into out_dir with the
 * vocabulary grown to `vocab` (the tables and their moments by
 * nl_model_grow_vocab, rows from `seed`'s streams) and tokenizer `tok`,
 * then write the manifest there (its path into out_path). */
static nl_status grow_manifest_vocab(const char *src, int64_t vocab, uint64_t seed,
                                     const char *tok, const char *out_dir, char *out_path,
                                     size_t cap, nl_error *err)
{
    nl_manifest *mf = NULL, out = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL;
    float *mom[2] = {NULL, NULL};
    nl_status st = nl_manifest_load(&mf, src, err);
    if (st == NL_OK)
        st = nl_manifest_verify(mf, err);
    if (st == NL_OK)
        st = nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = 1}, err);
    if (st == NL_OK)
        st = nl_file_mkdirs(out_dir, err);
    if (st != NL_OK)
        goto out;
    out = (nl_manifest){.step = mf->step,
                        .adam_steps = mf->adam_steps,
                        .cfg = mf->cfg,
                        .train_json = mf->train_json,
                        .tokenizer = (char *)tok,
                        .init_seed = mf->init_seed,
                        .n_shards = mf->n_shards,
                        .shards = calloc((size_t)mf->n_shards, sizeof *out.shards)};
    out.cfg.vocab_size = vocab;
    if (!out.shards) {
        st = nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
        goto out;
    }
    for (int i = 0; i < mf->n_shards && st == NL_OK; i++) {
        const nl_manifest_shard *sh = &mf->shards[i];
        nl_manifest_shard *o = &out.shards[i];
        const size_t n = (size_t)nl_stage_param_count(&mf->cfg, sh->l1 - sh->l0, sh->has_embed,
                                                      sh->has_head);
        char path[PATH_MAX], file[64];
        for (int k = 0; k < 2 && st == NL_OK; k++)
            if (!(mom[k] = be->alloc(be, n * sizeof(float))))
                st = nl_error_set(err, NL_ERR_NOMEM, "grow: no memory for stage %d's moments", i);
        if (st == NL_OK)
            st = nl_manifest_load_stage(&m, be, mf, sh->l0, sh->l1, sh->has_embed, sh->has_head,
                                        mom[0], mom[1], err);
        if (st == NL_OK)
            st = nl_model_grow_vocab(m, vocab, seed, mom, 2, err);
        snprintf(file, sizeof file, "stage-%d.safetensors", i);
        snprintf(path, sizeof path, "%s/%s", out_dir, file);
        const nl_ckpt_extra extra = {.m = mom[0],
                                     .v = mom[1],
                                     .adam_steps = mf->adam_steps,
                                     .train_json = mf->train_json,
                                     .tokenizer = tok,
                                     .init_seed = mf->init_seed};
        if (st == NL_OK)
            st = nl_checkpoint_save(m, path, mf->step, &extra, err);
        *o = (nl_manifest_shard){.stage = i,
                                 .l0 = sh->l0,
                                 .l1 = sh->l1,
                                 .has_embed = sh->has_embed,
                                 .has_head = sh->has_head,
                                 .file = strdup(file),
                                 .node = sh->node,
                                 .device = sh->device,
                                 .tf32 = sh->tf32};
        if (st == NL_OK && !o->file)
            st = nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
        if (st == NL_OK)
            st = nl_file_sha256(path, o->sha256, &o->bytes, err);
        for (int k = 0; k < 2; k++) {
            if (mom[k])
                be->free(be, mom[k]);
            mom[k] = NULL;
        }
        nl_model_destroy(&m);
    }
    snprintf(out_path, cap, "%s/%s", out_dir, NL_MANIFEST_FILE);
    if (st == NL_OK)
        st = nl_manifest_write(out_path, &out, err);
out:
    for (int i = 0; out.shards && i < out.n_shards; i++)
        free(out.shards[i].file);
    free(out.shards);
    nl_backend_destroy(&be);
    nl_manifest_destroy(&mf);
    return st;
}

nl_status coord_vocab_grow_run(coord_vocab_grow *g, nl_error *err)
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
    g->grown = g->cfg;
    if (g->tok_after > g->grown.vocab_size)
        g->grown.vocab_size = g->tok_after;
    if ((st = nl_config_validate(&g->grown, 1, err)) != NL_OK)
        goto out;
    if (g->src) { /* the stages hold a manifest: write the grown one */
        char path[PATH_MAX];
        st = grow_manifest_vocab(g->src, g->grown.vocab_size, g->seed, g->new_tok, g->out_dir,
                                 path, sizeof path, err);
        if (st == NL_OK)
            st = coord_manifest_open(&g->mf, path, NULL, err); /* written here: ours */
        g->have_mf = st == NL_OK;
    }
out:
    nl_tokenizer_destroy(&t);
    free(text);
    free(saved);
    return st;
}

void coord_vocab_grow_release(coord_vocab_grow *g)
{
    free(g->tok);
    free(g->input);
    free(g->src);
    free(g->out_dir);
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
        snprintf(why, cap, "the stages hold weights trained since the last checkpoint; a growth "
                           "reloads them (train with a final checkpoint first)");
    else if (c->src && !c->src_manifest)
        snprintf(why, cap, "the cluster serves the checkpoint %s: growth needs a training "
                           "manifest (train on the cluster with a checkpoint, or start it with "
                           "--resume MANIFEST)",
                 c->src_path);
    else
        return NULL;
    return why;
}

nl_status coord_vocab_grow_prepare(nl_coord *c, coord_vocab_grow *g, const char *input,
                                   int64_t add, const char *out_dir, nl_error *err)
{
    memset(g, 0, sizeof *g);
    g->add = add;
    g->cfg = c->cfg;
    g->max_bytes = (size_t)c->o.max_data_bytes;
    g->seed = c->init_seed ? strtoull(c->init_seed, NULL, 10) : c->o.seed;
    int oom = !(g->input = strdup(input));
    if (c->tok_text)
        oom |= !(g->tok = strdup(c->tok_text));
    if (c->src_manifest) {
        oom |= !(g->src = strdup(c->src_path));
        oom |= !(g->out_dir = strdup(out_dir));
    }
    if (oom) {
        coord_vocab_grow_release(g);
        return nl_error_set(err, NL_ERR_NOMEM, "grow: out of memory");
    }
    return NL_OK;
}

void coord_vocab_grow_install(nl_coord *c, coord_vocab_grow *g, int64_t step, double seconds)
{
    const nl_config before = c->cfg;
    if (g->have_mf) {
        coord_manifest_install(c, &g->mf, 1);
        g->have_mf = 0;
    } else { /* the seed: the nodes draw the grown tables themselves */
        free(c->tok_text);
        c->tok_text = g->new_tok;
        g->new_tok = NULL;
        c->cfg = g->grown;
        coord_reload(c);
    }
    coord_growth_record(c, COORD_GROW_VOCAB, step, &before, &c->cfg, seconds);
}

/* ---------------------------------------------------------------- the grow job */

typedef struct cgrow {
    coord_vocab_grow v;
    double t0, seconds;
    int phase; /* 0: the worker runs, 1: the cluster reloads */
    json_t *event;
} cgrow;

typedef struct grow_task {
    cwork w;
    coord_vocab_grow v;
    nl_status st;
    nl_error err;
} grow_task;

static void grow_task_run(cwork *w)
{
    grow_task *k = (grow_task *)w;
    k->st = coord_vocab_grow_run(&k->v, &k->err);
}

static void grow_task_free(cwork *w)
{
    grow_task *k = (grow_task *)w;
    coord_vocab_grow_release(&k->v);
    free(k);
}

static void grow_report(nl_coord *c, cjob *j, int state, const char *msg)
{
    const cgrow *g = j->state;
    char *text = g->event ? json_dumps(g->event, JSON_COMPACT) : NULL;
    coord_status_to(c, j->rid, j->rid_len, j->id, state, state == NL_JOB_DONE ? 1.0 : 0.5, msg,
                    text);
    free(text);
}

static void grow_task_done(nl_coord *c, cwork *w)
{
    grow_task *k = (grow_task *)w;
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
    g->seconds = coord_now() - g->t0;
    const int64_t step = c->src_manifest ? c->src_step : 0;
    coord_vocab_grow_install(c, &k->v, step, g->seconds);
    g->event = coord_growth_json(&c->last_growth);
    json_object_set_new(g->event, "event", json_string("grow"));
    json_object_set_new(g->event, "tokenizer_from", json_integer((json_int_t)k->v.tok_before));
    json_object_set_new(g->event, "tokenizer_to", json_integer((json_int_t)k->v.tok_after));
    if (c->src_manifest)
        json_object_set_new(g->event, "manifest", json_string(c->src_path));
    g->phase = 1;
    j->phase = JOB_WAITING;
    j->last_progress = coord_now();
    snprintf(why, sizeof why, "vocabulary %lld -> %lld; the stages reload",
             (long long)c->last_growth.before.vocab_size,
             (long long)c->last_growth.after.vocab_size);
    grow_report(c, j, NL_JOB_RUNNING, why);
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

/* params: "input" (a text file under --data-root) and "add" (ids to learn). */
static void grow_submit(nl_coord *c, const nl_rx *rx)
{
    const nl_msg_job_submit *s = &rx->msg.u.job_submit;
    char why[900], real[PATH_MAX], dir[PATH_MAX];
    nl_error e = {0};
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE &&
            (c->jobs[i].ops == &coord_train_ops || c->jobs[i].ops == &coord_grow_ops)) {
            snprintf(why, sizeof why, "job %llu (%s) runs; the model grows between jobs",
                     (unsigned long long)c->jobs[i].id, c->jobs[i].ops->name);
            coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, why, NULL);
            return;
        }
    cjob *j = coord_job_new(c, rx, &coord_grow_ops);
    if (!j)
        return;
    cgrow *g = j->state = calloc(1, sizeof *g);
    grow_task *k = calloc(1, sizeof *k);
    if (!g || !k) {
        free(k);
        coord_job_fail(c, j, "out of memory");
        return;
    }
    const nl_wire_param *in = coord_param(s, "input"), *add = coord_param(s, "add");
    const char *bad = NULL;
    if (!in || in->kind != NL_WIRE_PARAM_STR || !add || add->kind != NL_WIRE_PARAM_INT ||
        add->i < 1 || add->i > (1 << 24))
        bad = "grow: params.input (a text file) and params.add (1 to 2^24 ids) are required";
    else if ((bad = coord_confine_file(c->data_root, in->s, NULL, c->o.max_data_bytes, real,
                                       sizeof real))) {
        snprintf(why, sizeof why, "grow: params.input: %s (the coordinator's --data-root)", bad);
        bad = why;
    } else {
        bad = coord_grow_refusal(c, why, sizeof why);
    }
    if (bad) {
        free(k);
        coord_job_fail(c, j, bad);
        return;
    }
    /* the grown manifest goes beside the one the stages hold */
    const char *slash = strrchr(c->src_path, '/');
    snprintf(dir, sizeof dir, "%.*s-vocab-%lld", slash ? (int)(slash - c->src_path) : 0,
             c->src_path, (long long)(c->cfg.vocab_size + add->i));
    if (coord_vocab_grow_prepare(c, &k->v, real, add->i, dir, &e) != NL_OK) {
        free(k);
        coord_job_fail(c, j, e.msg);
        return;
    }
    k->w = (cwork){.run = grow_task_run,
                   .done = grow_task_done,
                   .free = grow_task_free,
                   .job_id = j->id};
    g->t0 = coord_now();
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, "learning", NULL);
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
