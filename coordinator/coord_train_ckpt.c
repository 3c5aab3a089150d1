/* A training job's checkpoints, a leaf of the job's state machine
 * (coord_train.c), which decides when: each stage's shard recorded as it
 * reports it; once every shard is in, a worker writes the manifest last
 * and verifies it (a fine-tuning job's: joins the adapters,
 * coord_finetune.c), and the manifest becomes the source the cluster
 * reloads from; at a checkpoint a worker may grow the model (--grow
 * auto). Each worker reports to the state machine (the done it was
 * given): what comes next is the machine's to decide. And whether the
 * early re-balance calls for a checkpoint now, and the source's weights
 * restored when a job ends early. And the job's list of checkpoints (its
 * base first), the newest all-verified one, and the rollback to it after
 * a conviction: a worker opens it, then it becomes the source. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord_train_impl.h"
#include "core/formats/checkpoint.h"
#include "core/grow/grow.h"
#include "core/tokenizer/chat_template.h"

/* Whether the shard at path was trained with TF32 allowed, as its node
 * recorded it in the shard's "train" metadata (no wire message carries a
 * node's --tf32). A shard that does not say, or cannot be read, leaves it
 * unknown; the manifest's hashes and the reload judge the file itself. */
static int shard_tf32(const char *path)
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

void coord_train_free_shards(nl_manifest_shard *sh, int n)
{
    for (int i = 0; sh && i < n; i++) {
        free(sh[i].file);
        free(sh[i].path);
        free(sh[i].node);
        free(sh[i].device);
    }
    free(sh);
}

void coord_train_ckpt_dir(const cjob *j, char *buf, size_t cap)
{
    const ctrain *t = j->state;
    if (t->ft)
        snprintf(buf, cap, "%s/lora-job%llu", t->ckpt_dir, (unsigned long long)j->id);
    else if (coord_train_salvaging(t)) /* beside a checkpoint of the same step, if any */
        snprintf(buf, cap, "%s/step-%06lld.resume%d", t->ckpt_dir, (long long)t->step,
                 t->resumes + 1);
    else if (t->rollbacks) /* the steps redone after a rollback: beside the first run's */
        snprintf(buf, cap, "%s/step-%06lld.redo%d", t->ckpt_dir, (long long)t->step, t->rollbacks);
    else
        snprintf(buf, cap, "%s/step-%06lld", t->ckpt_dir, (long long)t->step);
}

int coord_train_salvage_can(nl_coord *c, const ctrain *t)
{
    if (t->ft || c->dismissing || c->o.outer_every > 0 || t->step <= t->start ||
        (t->manifest[0] && t->manifest_step == t->step) ||
        t->verify_convicted + t->verify_outvoted != t->convictions_seen)
        return 0;
    for (int s = 0; s < t->stages; s++)
        if (coord_stage_first_live(c, s) < 0)
            return 0;
    return 1;
}

/* ---------------------------------------------------------------- the job's checkpoints */

int coord_train_ckpt_add(ctrain *t, int64_t step, const char *path, int manifest, int cont)
{
    const cckpt *last = t->n_ckpts ? &t->ckpts[t->n_ckpts - 1] : NULL;
    if (last && last->step == step && last->manifest == manifest &&
        (last->path && path ? strcmp(last->path, path) == 0 : last->path == path))
        return 0; /* the one it resumes from */
    if (t->n_ckpts == t->cap_ckpts) {
        const int cap = t->cap_ckpts ? 2 * t->cap_ckpts : 8;
        cckpt *p = realloc(t->ckpts, (size_t)cap * sizeof *p);
        if (!p)
            return -1;
        t->ckpts = p;
        t->cap_ckpts = cap;
    }
    char *copy = path ? strdup(path) : NULL;
    if (path && !copy)
        return -1;
    t->ckpts[t->n_ckpts++] = (cckpt){step, copy, manifest, cont};
    return 0;
}

int coord_train_ckpt_base(const nl_coord *c, ctrain *t)
{
    if (t->n_ckpts)
        return 0;
    /* a file, the seed (no path), or weights no file holds (manifest -1) */
    const int holds = !c->stages_modified && c->src_path[0];
    return coord_train_ckpt_add(t, t->start, holds ? c->src_path : NULL,
                                c->stages_modified ? -1 : c->src_manifest, t->moments);
}

int coord_train_ckpt_is_source(const nl_coord *c, const cckpt *k)
{
    return k->path && c->src_manifest == k->manifest && strcmp(c->src_path, k->path) == 0;
}

const cckpt *coord_train_ckpt_verified(const nl_coord *c, const ctrain *t)
{
    const int64_t through = coord_train_verified_through(c, t);
    for (int i = t->n_ckpts - 1; i >= 0; i--)
        if (t->ckpts[i].step <= through)
            return &t->ckpts[i];
    return NULL;
}

void coord_train_ckpt_forget_after(ctrain *t, int64_t step)
{
    while (t->n_ckpts && t->ckpts[t->n_ckpts - 1].step > step)
        free(t->ckpts[--t->n_ckpts].path);
}

void coord_train_ckpts_free(ctrain *t)
{
    for (int i = 0; i < t->n_ckpts; i++)
        free(t->ckpts[i].path);
    free(t->ckpts);
    t->ckpts = NULL;
    t->n_ckpts = t->cap_ckpts = 0;
}

/* A rollback's checkpoint, opened off the loop as a source: a manifest
 * (every shard read whole and its hash checked, under the checkpoint
 * root), or the --model file the job began from (as neurocoord opens it
 * at its start). */
typedef struct restore_task {
    cwork w;
    char path[4096], root[4096];
    int manifest, cont;
    nl_status st;
    nl_error err;
    cmanifest out;
} restore_task;

static nl_status open_model(cmanifest *out, const char *path, nl_error *err)
{
    memset(out, 0, sizeof *out);
    nl_status st = (out->src = coord_source_new(1))
                       ? nl_checkpoint_read_config(path, &out->cfg, &out->step, err)
                       : nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if (st == NL_OK)
        st = nl_st_open(&out->src->files[0], path, err);
    if (st == NL_OK)
        st = nl_checkpoint_meta(path, "tokenizer", &out->tok, err);
    if (st == NL_OK)
        st = nl_checkpoint_meta(path, "init_seed", &out->seed, err);
    if (st == NL_OK)
        st = nl_checkpoint_meta(path, "chat_template", &out->chat, err);
    if (st == NL_OK)
        st = nl_chat_template_check(out->chat, "metadata 'chat_template'", err);
    if (st != NL_OK)
        coord_manifest_release(out);
    else
        snprintf(out->path, sizeof out->path, "%s", path);
    return st;
}

static void restore_run(cwork *w)
{
    restore_task *k = (restore_task *)w;
    k->st = k->manifest ? coord_manifest_open(&k->out, k->path, k->root, &k->err)
                        : open_model(&k->out, k->path, &k->err);
}

static void restore_free(cwork *w)
{
    restore_task *k = (restore_task *)w;
    coord_manifest_release(&k->out);
    free(k);
}

const char *coord_train_open_ckpt(nl_coord *c, cjob *j, const cckpt *ck, tr_done done, char *why,
                                  size_t cap)
{
    nl_error e = {0};
    restore_task *k = calloc(1, sizeof *k);
    if (!k) {
        snprintf(why, cap, "out of memory");
        return why;
    }
    k->w = (cwork){.run = restore_run, .done = done, .free = restore_free, .job_id = j->id};
    snprintf(k->path, sizeof k->path, "%s", ck->path);
    snprintf(k->root, sizeof k->root, "%s", c->ckpt_root);
    k->manifest = ck->manifest;
    k->cont = ck->cont;
    if (coord_work_start(c, &k->w, &e) != NL_OK) {
        snprintf(why, cap, "the rollback to %s: %s", ck->path, e.msg);
        return why;
    }
    c->manifests_writing++; /* no plan is made from the source it replaces */
    return NULL;
}

void coord_train_restore_result(nl_coord *c, cwork *w, tr_in *in)
{
    restore_task *k = (restore_task *)w;
    c->manifests_writing--;
    *in = (tr_in){
        .why = k->st == NL_OK ? NULL : k->err.msg, .step = k->out.step, .path = k->path, .task = k};
}

void coord_train_restore(nl_coord *c, cjob *j, const tr_in *in)
{
    ctrain *t = j->state;
    restore_task *k = in->task;
    coord_manifest_install(c, &k->out, c->plan != NULL); /* a plan made meanwhile: again */
    c->src_manifest = k->manifest;                       /* a --model file carries no moments */
    c->stages_modified = 1; /* they hold later weights until they reload */
    t->cont = k->cont;
    /* a restart of the coordinator resumes from here (a --model file:
     * the job begins again, at step 0) */
    coord_journal_train(c, j, t->journal, t->journal_from,
                        k->manifest && k->cont ? in->path : NULL);
    snprintf(t->manifest, sizeof t->manifest, "%s", k->manifest && k->cont ? in->path : "");
    t->manifest_step = k->cont ? in->step : 0;
    if (k->manifest && k->cont)
        c->src_job = j->id;
}

const char *coord_train_shard(nl_coord *c, cjob *j, const cnode *n, const nl_msg_ckpt_done *d,
                              char *why, size_t cap)
{
    ctrain *t = j->state;
    nl_manifest_shard *sh = &t->shards[d->stage];
    const nl_plan_stage *ps = &c->plan->stages[d->stage];
    char want[1200], node[128], dir[1100];
    /* the shard must be exactly where it was asked to be */
    coord_train_ckpt_dir(j, dir, sizeof dir);
    snprintf(want, sizeof want, "%s/stage-%u.safetensors", dir, d->stage);
    if (strcmp(d->path, want) != 0) {
        snprintf(why, cap, "stage %u wrote its shard to %s, not %s", d->stage, d->path, want);
        return why;
    }
    const char *file = strrchr(d->path, '/') + 1;
    free(sh->file);
    free(sh->path);
    free(sh->node);
    free(sh->device);
    snprintf(node, sizeof node, "node %u %s", n->id, n->key);
    *sh = (nl_manifest_shard){.stage = (int)d->stage,
                              .l0 = ps->l0,
                              .l1 = ps->l1,
                              .has_embed = ps->has_embed,
                              .has_head = ps->has_head,
                              .file = strdup(file),
                              .path = strdup(d->path),
                              .bytes = d->bytes,
                              .node = strdup(node),
                              .device = strdup(n->device), /* as its JOIN said */
                              .tf32 = shard_tf32(d->path)};
    snprintf(sh->sha256, sizeof sh->sha256, "%s", d->sha256);
    if (!sh->file || !sh->path || !sh->node || !sh->device) {
        snprintf(why, cap, "out of memory");
        return why;
    }
    return NULL;
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
        k->mf.shards[i].tf32 = shard_tf32(k->mf.shards[i].path);
    k->st = nl_manifest_write(k->path, &k->mf, &k->err);
#ifdef NL_TEST_HOOKS
    /* test builds: NL_TEST_COORD_EXIT_AFTER_MANIFEST=S stops the process
     * once step S's manifest is in place, before the loop journals it (a
     * coordinator that died in that window: test_cluster_resume) */
    const char *stop_at = getenv("NL_TEST_COORD_EXIT_AFTER_MANIFEST");
    if (stop_at && k->st == NL_OK && atoll(stop_at) == (long long)k->mf.step)
        _exit(70);
#endif
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
    free((char *)k->mf.chat_template);
    free(k->mf.growth);
    coord_manifest_release(&k->out);
    free(k);
}

void coord_train_manifest_result(nl_coord *c, cwork *w, tr_in *in)
{
    ckpt_task *k = (ckpt_task *)w;
    c->manifests_writing--;
    *in = (tr_in){
        .why = k->st == NL_OK ? NULL : k->err.msg, .step = k->mf.step, .path = k->path, .task = k};
}

/* TE_WRITTEN: the manifest becomes the source (the stages hold its
 * weights; reload 0) and the job's last checkpoint, journaled. */
void coord_train_keep(nl_coord *c, cjob *j, const tr_in *in)
{
    ctrain *t = j->state;
    ckpt_task *k = in->task;
    coord_manifest_install(c, &k->out, 0);
    c->src_job = j->id;
    c->stages_modified = 0; /* the source holds the stages' weights */
    /* a resume of this job goes on from here */
    t->cont = 1;
    coord_journal_train(c, j, t->journal, t->journal_from, k->path);
    snprintf(t->manifest, sizeof t->manifest, "%s", k->path);
    t->manifest_step = k->mf.step;
    if (coord_train_ckpt_add(t, k->mf.step, k->path, 1, 1) != 0) /* a rollback may go to it */
        NL_WARN("train job %llu: out of memory: the checkpoint of step %lld is not one a "
                "rollback can go to",
                (unsigned long long)j->id, (long long)k->mf.step);
}

/* Every shard is in: a worker writes the manifest (ckpt_task). The job
 * hands it this checkpoint's shards and takes a fresh table. */
const char *coord_train_write_manifest(nl_coord *c, cjob *j, tr_done done, char *why, size_t cap)
{
    ctrain *t = j->state;
    nl_error e = {0};
    ckpt_task *k = calloc(1, sizeof *k);
    nl_manifest_shard *fresh = calloc((size_t)t->stages, sizeof *fresh);
    if (!k || !fresh) {
        free(k);
        free(fresh);
        snprintf(why, cap, "out of memory");
        return why;
    }
    json_t *tj = json_pack("{s:I,s:I,s:I,s:I,s:I,s:f,s:f,s:I}", "seed", (json_int_t)t->seed,
                           "steps", (json_int_t)t->steps, "batch", (json_int_t)t->batch, "seq",
                           (json_int_t)t->seq, "microbatches", (json_int_t)t->micro, "lr", t->lr,
                           "min_lr", t->min_lr, "warmup", (json_int_t)t->warmup);
    int oom = 0;
    k->w = (cwork){.run = ckpt_run, .done = done, .free = ckpt_free, .job_id = j->id};
    k->mf = (nl_manifest){.step = t->step,
                          .adam_steps = t->adam, /* the stages step together */
                          .cfg = c->cfg,
                          .config_json = nl_config_to_json(&c->cfg),
                          .train_json = tj ? json_dumps(tj, JSON_COMPACT) : NULL,
                          .tokenizer = coord_train_dup(c->tok_text, &oom),
                          .init_seed = coord_train_dup(c->init_seed, &oom),
                          .chat_template = coord_train_dup(c->chat_text, &oom),
                          .growth =
                              c->n_growth ? malloc((size_t)c->n_growth * sizeof *c->growth) : NULL,
                          .n_growth = c->n_growth,
                          .n_shards = t->stages,
                          .shards = t->shards};
    json_decref(tj);
    oom |= c->n_growth && !k->mf.growth;
    if (k->mf.growth) /* the model's growth history goes on (core/grow/grow.h) */
        memcpy(k->mf.growth, c->growth, (size_t)c->n_growth * sizeof *c->growth);
    t->shards = fresh;
    char dir[1100];
    coord_train_ckpt_dir(j, dir, sizeof dir);
    snprintf(k->path, sizeof k->path, "%.1080s/manifest.json", dir);
    snprintf(k->root, sizeof k->root, "%s", c->ckpt_root);
    if (oom || !k->mf.config_json || !k->mf.train_json) {
        ckpt_free(&k->w);
        snprintf(why, cap, "checkpoint of step %lld: out of memory", (long long)t->step);
        return why;
    }
    if (coord_work_start(c, &k->w, &e) != NL_OK) {
        snprintf(why, cap, "checkpoint of step %lld: %s", (long long)t->step, e.msg);
        return why;
    }
    c->manifests_writing++;
    NL_INFO("train job %llu: checkpoint of step %lld: every shard is in; writing %s",
            (unsigned long long)j->id, (long long)t->step, k->path);
    return NULL;
}

int coord_train_rollback(nl_coord *c, cjob *j, tr_done done, char *why, size_t cap)
{
    ctrain *t = j->state;
    const cckpt *k = coord_train_ckpt_verified(c, t);
    const int seed = !c->src_path[0] && !c->src; /* the source is the seed still */
    if (!k || (!k->path && (k->manifest < 0 || !seed))) {
        snprintf(why, cap,
                 "a node was convicted of computing wrong, and %s: no rollback leaves its work "
                 "out",
                 k ? "the job began from weights that no file holds"
                   : "no checkpoint of the job has all its steps verified");
        return -1;
    }
    coord_train_report_rollback(c, j, t->lost_at, k);
    const int64_t step = k->step;
    t->rollbacks++;
    t->rolled = 1;
    coord_train_verify_resume(t, step);
    coord_train_ckpt_forget_after(t, step);
    k = &t->ckpts[t->n_ckpts - 1];
    if (!k->path || coord_train_ckpt_is_source(c, k))
        return 0;
    if (coord_train_open_ckpt(c, j, k, done, why, cap))
        return -1;
    t->restoring = 1;
    return 1;
}

/* ---------------------------------------------------------------- --grow auto */

int coord_train_grow(nl_coord *c, cjob *j, tr_done done)
{
    nl_error e = {0};
    const int depth = coord_grow_auto_depth(c);
    if (!depth)
        return 0;
    coord_grow_task *k = coord_grow_task_new(c, j->id, NULL, 0, depth, 0, 0, done, &e);
    if (!k) {
        NL_WARN("train job %llu: --grow auto: %s", (unsigned long long)j->id, e.msg);
        return 0;
    }
    if (coord_work_start(c, &k->w, &e) != NL_OK) {
        NL_WARN("train job %llu: --grow auto: %s", (unsigned long long)j->id, e.msg);
        return 0;
    }
    return 1;
}

/* The early re-balance (--rebalance-after N): once N steps are done on
 * the job's plan and every stage has sent enough heartbeats on it, the
 * stages' measured speeds are judged (coord_observe_speeds); when a plan by
 * them beats the current one by --replan-margin, the job writes a
 * checkpoint at this step, and WRITTEN re-plans from it as at any
 * checkpoint: the layers move with their moments, and the run stays
 * bit-identical. A plan that a judgement keeps is judged again N steps
 * later on fresh heartbeats (one judgement can fall on a burst of other
 * work on the machine), at most EARLY_MAX times a plan; the new plan of a
 * re-balance is judged the same way (the measurement on a lopsided split
 * is the least precise), at most EARLY_MAX re-balances a job. */
#define EARLY_MAX 3

int coord_train_early_ckpt(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    const int64_t every = c->o.rebalance_after;
    if (t->early_plan != t->start + 1) { /* a plan of its own: judged afresh */
        t->early_plan = t->start + 1;
        t->early_judged = 0;
    }
    if (t->ft || t->early_n >= EARLY_MAX || t->early_judged >= EARLY_MAX || every <= 0 ||
        t->step < t->start + every * (t->early_judged + 1) || t->step >= t->steps || t->cancel ||
        !coord_observe_ready(c) ||
        (c->o.outer_every > 0 && t->step % c->o.outer_every != 0)) /* DiLoCo: at an outer step */
        return 0;
    t->early_judged++;
    coord_observe_speeds(c);
    if (!coord_replan_worth(c)) {
        NL_INFO("train job %llu: after step %lld the stages' measured speeds keep the split "
                "(judgement %d of at most %d on this plan)",
                (unsigned long long)j->id, (long long)t->step, t->early_judged, EARLY_MAX);
        return 0;
    }
    t->early_n++;
    t->early_ckpt = 1;
    NL_INFO("train job %llu: the stages' measured speeds call for another split after step "
            "%lld: a checkpoint there, then the re-plan",
            (unsigned long long)j->id, (long long)t->step);
    return 1;
}

/* A failed or cancelled job ends: its stages end it and, when it changed
 * their weights (touched), reload them from the source (the last
 * manifest, or the checkpoint). */
void coord_train_unwind(nl_coord *c, cjob *j, int touched)
{
    const ctrain *t = j->state;
    coord_close_session(c, j);
    if (t && t->ft) /* the base is untouched: its stages just drop the adapters */
        return;
    memset(&c->train_mem, 0, sizeof c->train_mem); /* plans are for inference again */
    coord_journal_clear(c);
    if (touched && j->epoch == c->epoch) {
        NL_INFO("train job %llu ended early: the stages reload their weights from %s",
                (unsigned long long)j->id, c->src_path[0] ? c->src_path : "the seed");
        coord_reload(c);
    }
}
