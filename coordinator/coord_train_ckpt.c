/* The training job's checkpoints (coord_train.c runs the steps): once
 * every stage has written its shard, a worker writes the manifest last
 * and verifies it, and it becomes the source the cluster reloads from; at
 * a checkpoint a worker may grow the model (--grow auto). */
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "coord_impl.h"
#include "core/checkpoint.h"
#include "core/fileio.h"
#include "core/grow.h"
#include "core/train.h"

/* Whether the shard at path was trained with TF32 allowed, as its node
 * recorded it in the shard's "train" metadata (no wire message carries a
 * node's --tf32). A shard that does not say, or cannot be read, leaves it
 * unknown; the manifest's hashes and the reload judge the file itself. */
int coord_train_shard_tf32(const char *path)
{
    char *meta = NULL;
    nl_error e = {0};
    int tf32 = NL_MANIFEST_TF32_UNKNOWN;
    if (nl_checkpoint_meta(path, "train", &meta, &e) == NL_OK && meta) {
        json_t *o = json_loads(meta, 0, NULL), *v = json_object_get(o, "tf32");
        if (json_is_boolean(v))
            tf32 = json_is_true(v) ? NL_MANIFEST_TF32_ON : NL_MANIFEST_TF32_OFF;
        json_decref(o);
    }
    free(meta);
    return tf32;
}

/* Writing a checkpoint's manifest, off the loop: the shards' TF32 flags
 * read from their files, the manifest written last, then read back and
 * every shard's hash checked, to become the source the cluster reloads
 * from after a failure (so the checkpoint directory must be shared with
 * the nodes). The task owns copies of everything it writes. */
typedef struct ckpt_task {
    cwork w;
    nl_manifest mf; /* its strings and shards are the task's */
    char path[1100];
    char root[4096]; /* the checkpoint root its shards must lie under */
    nl_status st;
    nl_error err;
    cmanifest out;
} ckpt_task;

static void ckpt_run(cwork *w)
{
    ckpt_task *k = (ckpt_task *)w;
#ifdef NL_TEST_HOOKS
    /* test builds: NL_TEST_MANIFEST_DELAY_MS=T holds every manifest's
     * writing T ms (a stage lost meanwhile: test_cluster_resume) */
    const char *delay = getenv("NL_TEST_MANIFEST_DELAY_MS");
    if (delay && atoi(delay) > 0)
        usleep((useconds_t)atoi(delay) * 1000u);
#endif
    for (int i = 0; i < k->mf.n_shards; i++)
        k->mf.shards[i].tf32 = coord_train_shard_tf32(k->mf.shards[i].path);
    k->st = nl_manifest_write(k->path, &k->mf, &k->err);
    if (k->st == NL_OK)
        k->st = coord_manifest_open(&k->out, k->path, k->root, &k->err);
}

static void ckpt_free(cwork *w)
{
    ckpt_task *k = (ckpt_task *)w;
    coord_train_free_shards(k->mf.shards, k->mf.n_shards);
    free((char *)k->mf.config_json);
    free((char *)k->mf.train_json);
    free((char *)k->mf.tokenizer);
    free((char *)k->mf.init_seed);
    free(k->mf.growth);
    coord_manifest_release(&k->out);
    free(k);
}

/* --grow auto at a checkpoint (issue 16): the model deepens when the
 * nodes now hold more layers (coord_grow_auto_depth); a worker writes the
 * grown manifest, then the stages reload it on a new plan (joining nodes
 * take the new layers) and the job goes on from its step. */
static void grow_done(nl_coord *c, cwork *w)
{
    coord_grow_task *k = (coord_grow_task *)w;
    cjob *j = coord_job_find(c, w->job_id);
    ctrain *t = j ? j->state : NULL;
    if (!t || t->phase != TR_GROW)
        return;
    if (t->cancel) { /* the model stays as the checkpoint has it */
        coord_train_cancelled(c, j);
        return;
    }
    if (k->st != NL_OK) { /* the job goes on at the size it has */
        NL_WARN("train job %llu: --grow auto at step %lld: %s", (unsigned long long)j->id,
                (long long)t->step, k->err.msg);
        coord_train_start_step(c, j);
        return;
    }
    coord_grow_install(c, &k->g, coord_now() - k->t0);
    coord_train_report(c, j, NL_JOB_RUNNING, "the model grew", coord_grow_event(c, &k->g));
    coord_close_session(c, j);
    coord_train_wait_reload(c, j);
}

static int grow_at_checkpoint(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    nl_error e = {0};
    const int depth = coord_grow_auto_depth(c);
    if (!depth)
        return 0;
    coord_grow_task *k = coord_grow_task_new(c, j->id, NULL, 0, depth, 0, 0, grow_done, &e);
    if (!k) {
        NL_WARN("train job %llu: --grow auto: %s", (unsigned long long)j->id, e.msg);
        return 0;
    }
    if (coord_work_start(c, &k->w, &e) != NL_OK) {
        NL_WARN("train job %llu: --grow auto: %s", (unsigned long long)j->id, e.msg);
        return 0;
    }
    t->phase = TR_GROW;
    return 1;
}

/* A stage was lost while this manifest was being written: every shard was
 * in, and re-planning waited for the worker (coord.c). The job resumes
 * from this checkpoint rather than the one before: less work is redone,
 * and the replay never meets the checkpoint's files, which a stage
 * refuses to overwrite. */
static void resumed_past(nl_coord *c, cjob *j, ckpt_task *k)
{
    ctrain *t = j->state;
    coord_manifest_install(c, &k->out, 0);
    c->stages_modified = 0;
    coord_journal_train(c, j->id, t->journal, k->path);
    snprintf(t->manifest, sizeof t->manifest, "%s", k->path);
    t->manifest_step = k->mf.step;
    NL_INFO("train job %llu: checkpoint of step %lld: %s (written while a stage was lost: the "
            "job resumes from it)",
            (unsigned long long)j->id, (long long)k->mf.step, k->path);
    json_t *o = json_pack("{s:s,s:I,s:s}", "event", "checkpoint", "step", (json_int_t)k->mf.step,
                          "manifest", k->path);
    coord_train_report(c, j, NL_JOB_RUNNING, "checkpoint", o);
}

/* The manifest is written and verified: it becomes the source; report it
 * and go on. A job that ended meanwhile leaves the source as it was (its
 * stages reload from there). */
static void ckpt_done(nl_coord *c, cwork *w)
{
    ckpt_task *k = (ckpt_task *)w;
    cjob *j = coord_job_find(c, w->job_id);
    ctrain *t = j ? j->state : NULL;
    c->manifests_writing--;
    if (t && t->phase == TR_LOADING && k->st == NL_OK && k->mf.step > c->src_step) {
        resumed_past(c, j, k);
        return;
    }
    if (!t || t->phase != TR_CKPT || t->step != k->mf.step)
        return;
    if (k->st != NL_OK) {
        coord_train_fail(c, j, "checkpoint of step %lld: %s", (long long)t->step, k->err.msg);
        return;
    }
    coord_manifest_install(c, &k->out, 0);
    c->stages_modified = 0; /* the source holds the stages' weights */
    coord_journal_train(c, j->id, t->journal, k->path);
    snprintf(t->manifest, sizeof t->manifest, "%s", k->path);
    t->manifest_step = t->step;
    NL_INFO("train job %llu: checkpoint of step %lld: %s", (unsigned long long)j->id,
            (long long)t->step, k->path);
    json_t *o = json_pack("{s:s,s:I,s:s}", "event", "checkpoint", "step", (json_int_t)t->step,
                          "manifest", k->path);
    coord_train_report(c, j, NL_JOB_RUNNING, "checkpoint", o);
    if (t->step < t->steps && !t->cancel)
        coord_observe_speeds(c); /* a stage slower or faster than planned asks for a re-plan */
    if (t->step == t->steps) {
        coord_train_finish(c, j);
    } else if (t->cancel) {
        coord_train_cancelled(c, j); /* the steps done are kept: the job ends */
    } else if (grow_at_checkpoint(c, j)) {
        /* --grow auto: the nodes hold a deeper model; a worker grows the
         * manifest, then the job goes on from it on a new plan */
    } else if (coord_replan_gain(c, "at the checkpoint")) {
        /* a node joined, or the stages' observed speeds call for another
         * split: the job goes on from this manifest on the new plan */
        json_t *r = json_pack("{s:s,s:I,s:s}", "event", "replan", "step", (json_int_t)t->step,
                              "manifest", k->path);
        coord_train_report(c, j, NL_JOB_RUNNING, "re-planning at the checkpoint", r);
        coord_close_session(c, j);
        coord_train_wait_reload(c, j);
        coord_reload(c);
    } else {
        coord_train_start_step(c, j);
    }
}

void coord_train_finetuned(nl_coord *c, uint64_t job, const char *adapter, const char *why)
{
    cjob *j = coord_job_find(c, job);
    ctrain *t = j ? j->state : NULL;
    if (!t || !t->ft || t->phase != TR_CKPT)
        return; /* it ended meanwhile */
    if (why) {
        coord_train_fail(c, j, "the adapters of step %lld: %s", (long long)t->step, why);
        return;
    }
    snprintf(t->ft->adapter, sizeof t->ft->adapter, "%s", adapter);
    NL_INFO("finetune job %llu: adapters of step %lld in %s", (unsigned long long)j->id,
            (long long)t->step, adapter);
    if (t->cancel && t->step < t->steps)
        coord_train_cancelled(c, j);
    else
        coord_train_finish(c, j);
}

char *coord_train_dup(const char *s, int *oom)
{
    char *d = s ? strdup(s) : NULL;
    *oom |= s && !d;
    return d;
}

/* Every shard is in: a worker writes the manifest (ckpt_task). The job
 * hands it this checkpoint's shards and takes a fresh table. */
void coord_train_write_manifest(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    nl_error e = {0};
    ckpt_task *k = calloc(1, sizeof *k);
    nl_manifest_shard *fresh = calloc((size_t)t->stages, sizeof *fresh);
    if (!k || !fresh) {
        free(k);
        free(fresh);
        coord_train_fail(c, j, "out of memory");
        return;
    }
    json_t *tj = json_pack("{s:I,s:I,s:I,s:I,s:I,s:f,s:f,s:I}", "seed", (json_int_t)t->seed,
                           "steps", (json_int_t)t->steps, "batch", (json_int_t)t->batch, "seq",
                           (json_int_t)t->seq, "microbatches", (json_int_t)t->micro, "lr", t->lr,
                           "min_lr", t->min_lr, "warmup", (json_int_t)t->warmup);
    int oom = 0;
    k->w = (cwork){.run = ckpt_run, .done = ckpt_done, .free = ckpt_free, .job_id = j->id};
    k->mf = (nl_manifest){.step = t->step,
                          .adam_steps = t->adam, /* the stages step together */
                          .cfg = c->cfg,
                          .config_json = nl_config_to_json(&c->cfg),
                          .train_json = tj ? json_dumps(tj, JSON_COMPACT) : NULL,
                          .tokenizer = coord_train_dup(c->tok_text, &oom),
                          .init_seed = coord_train_dup(c->init_seed, &oom),
                          .growth =
                              c->n_growth ? malloc((size_t)c->n_growth * sizeof *c->growth) : NULL,
                          .n_growth = c->n_growth,
                          .n_shards = t->stages,
                          .shards = t->shards};
    json_decref(tj);
    oom |= c->n_growth && !k->mf.growth;
    if (k->mf.growth) /* the model's growth history goes on (core/grow.h) */
        memcpy(k->mf.growth, c->growth, (size_t)c->n_growth * sizeof *c->growth);
    t->shards = fresh;
    snprintf(k->path, sizeof k->path, "%s/step-%06lld/manifest.json", t->ckpt_dir,
             (long long)t->step);
    snprintf(k->root, sizeof k->root, "%s", c->ckpt_root);
    if (oom || !k->mf.config_json || !k->mf.train_json) {
        ckpt_free(&k->w);
        coord_train_fail(c, j, "checkpoint of step %lld: out of memory", (long long)t->step);
        return;
    }
    if (coord_work_start(c, &k->w, &e) != NL_OK) {
        coord_train_fail(c, j, "checkpoint of step %lld: %s", (long long)t->step, e.msg);
        return;
    }
    c->manifests_writing++;
    NL_INFO("train job %llu: checkpoint of step %lld: every shard is in; writing %s",
            (unsigned long long)j->id, (long long)t->step, k->path);
}
