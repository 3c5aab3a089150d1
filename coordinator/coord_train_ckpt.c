/* A training job's checkpoints, a leaf of the job's state machine
 * (coord_train.c), which decides when: each stage's shard recorded as it
 * reports it; once every shard is in, a worker writes the manifest last
 * and verifies it (a fine-tuning job's: joins the adapters,
 * coord_finetune.c), and the manifest becomes the source the cluster
 * reloads from; at a checkpoint a worker may grow the model (--grow
 * auto). Each worker reports to the state machine (the done it was
 * given): what comes next is the machine's to decide. And whether the
 * early re-balance calls for a checkpoint now, and the source's weights
 * restored when a job ends early. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "coord_train_impl.h"
#include "core/checkpoint.h"
#include "core/grow.h"

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
    else
        snprintf(buf, cap, "%s/step-%06lld", t->ckpt_dir, (long long)t->step);
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
    coord_journal_train(c, j, t->journal, k->path);
    snprintf(t->manifest, sizeof t->manifest, "%s", k->path);
    t->manifest_step = k->mf.step;
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
    if (k->mf.growth) /* the model's growth history goes on (core/grow.h) */
        memcpy(k->mf.growth, c->growth, (size_t)c->n_growth * sizeof *c->growth);
    t->shards = fresh;
    snprintf(k->path, sizeof k->path, "%s/step-%06lld/manifest.json", t->ckpt_dir,
             (long long)t->step);
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
 * bit-identical. The new plan is judged again N steps later (the
 * measurement on a lopsided split is the least precise), at most
 * EARLY_MAX times a job. */
#define EARLY_MAX 3

int coord_train_early_ckpt(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    if (t->ft || t->early_n >= EARLY_MAX || c->o.rebalance_after <= 0 ||
        t->step < t->start + c->o.rebalance_after || t->step >= t->steps || t->cancel ||
        t->early_at == t->start + 1 || !coord_observe_ready(c))
        return 0;
    t->early_at = t->start + 1; /* judged on this plan */
    t->early_n++;
    coord_observe_speeds(c);
    if (!coord_replan_worth(c))
        return 0;
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
