/* LoRA fine-tuning jobs on one pipeline stage (JOB_SUBMIT kind finetune,
 * docs/cluster.md "LoRA fine-tuning"), a kind of the stage's jobs
 * (stage_jobs.c): each job owns adapters for this stage's layers
 * (core/model/lora.h, drawn from the run's seed as local `neuroctl finetune`
 * draws them) and a training job's state of stage_train.c, which it runs
 * unchanged: the job's trainer is made with the adapters attached, so it
 * keeps moments for the adapters alone, takes their gradients' norm and
 * steps only them; the base weights are never written. Any objective runs
 * so (its frames ride the hops as in training); on the stage with a
 * classification head the adapters hold a copy of the head that trains
 * with them and goes into the shard.
 *
 * Several jobs may fine-tune at once on the same frozen weights. The
 * stage's model carries no adapters between messages: a message of job J
 * runs on J's own training state with J's adapters attached to the model
 * for its duration, so that inference and every other job see the base
 * alone.
 *
 * Also here: the adapters that inference applies (params.adapter of an
 * embed, forward or generate job), loaded from files under the node's
 * --checkpoint-root into a small cache shared by the jobs and sessions
 * that name the same file, and attached to the model for one forward at
 * a time. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/model/lora.h"
#include "net/trainparams.h"
#include "node/stage_impl.h"

#include <sys/stat.h>

/* A fine-tuning job's state (stage_job_ops.state). */
typedef struct stage_ft {
    struct stage_train *train; /* stage_train.c's state of the job, its own */
    nl_lora *lo;               /* its adapters (not attached between messages) */
} stage_ft;

static void ft_free(nl_stage *s, void *state)
{
    stage_ft *f = state;
    if (!f)
        return;
    if (s->model) /* the trainer goes with its adapters attached, as it was made */
        stage_adapter_attach(s, f->lo);
    stage_train_free(f->train);
    if (s->model)
        stage_adapter_attach(s, NULL);
    nl_lora_destroy(&f->lo); /* detached already: it frees its block */
    free(f);
}

/* The adapters the request asks for (rank, alpha, targets, seed), made on
 * the stage's model for microbatches of micro_batch x seq rows and drawn
 * from the seed; attached to the model on return. */
static nl_status make_adapters(nl_stage *s, const nl_trainparams *p, nl_lora **lo, nl_error *err)
{
    nl_status st = nl_lora_new(lo, s->model, (int)p->lora_rank, (float)p->lora_alpha, p->lora_bits,
                               (int)(p->micro_batch * p->seq), err);
    if (st == NL_OK && (st = nl_lora_init_random(*lo, (uint64_t)p->lora_seed, err)) != NL_OK)
        nl_lora_destroy(lo);
    return st;
}

/* JOB_SUBMIT kind finetune (stage_job_ops.begin). */
static nl_status ft_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id, void **state,
                          nl_error *err)
{
    nl_trainparams p;
    uint64_t other = 0;
    *state = NULL;
    nl_status st = stage_train_params(s, j, &p, job_id, err);
    const long long job = (long long)p.job;
    if (st != NL_OK)
        return st;
    if (nl_stage_train_running(s, &other))
        return nl_error_set(err, NL_ERR_STATE,
                            "finetune job %lld: training job %llu changes this stage's weights",
                            job, (unsigned long long)other);
    if (stage_job_find(s, p.job))
        return nl_error_set(err, NL_ERR_STATE, "finetune job %lld: already runs on this stage",
                            job);
    stage_ft *f = calloc(1, sizeof *f);
    if (!f)
        return nl_error_set(err, NL_ERR_NOMEM, "finetune job %lld: out of memory", job);
    if ((st = make_adapters(s, &p, &f->lo, err)) != NL_OK) {
        free(f);
        return nl_error_prefix(err, "finetune job %lld", job);
    }
    /* the training job's state, made with the adapters attached */
    stage_adapter_attach(s, f->lo);
    st = stage_train_make(s, &p, j, &f->train, err);
    stage_adapter_attach(s, NULL);
    if (st != NL_OK) {
        ft_free(s, f);
        return st;
    }
    *state = f;
    const int n = stage_job_count(s, NL_JOB_FINETUNE) + 1; /* with this one */
    NL_INFO("finetune job %lld: rank %d adapters on layers [%d, %d), %zu parameters train; the "
            "base is frozen (%d fine-tuning job%s on this stage)",
            job, f->lo->rank, s->model->l0, s->model->l1, f->lo->n_params, n, n == 1 ? "" : "s");
    return NL_OK;
}

static bool ft_holds(const void *state, const nl_wire_msg *m)
{
    (void)state;
    return stage_train_takes(m);
}

/* A message of the job, run with its adapters attached. */
static nl_status ft_input(nl_stage *s, void *state, const nl_wire_msg *m, nl_stage_send_fn send,
                          void *ctx, nl_error *err)
{
    stage_ft *f = state;
    stage_adapter_attach(s, f->lo);
    nl_status st = stage_train_input(s, f->train, m, send, ctx, err);
    stage_adapter_attach(s, NULL);
    return st;
}

const stage_job_ops nl_stage_lora_ops = {.kind = NL_JOB_FINETUNE,
                                         .name = "finetune",
                                         .status = "training",
                                         .begin = ft_begin,
                                         .holds = ft_holds,
                                         .input = ft_input,
                                         .free = ft_free};

/* ---------------------------------------------------------------- adapters for inference */

#define ADAPTERS_KEPT 8 /* unreferenced files kept loaded */

typedef struct stage_adapter stage_adapter;

struct stage_adapter {
    char path[PATH_MAX]; /* resolved */
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
    nl_lora *lo;
    int refs;
    bool stale; /* the file changed since: freed with its last reference */
    uint64_t used;
};

void stage_adapter_attach(nl_stage *s, nl_lora *lo)
{
    nl_model *m = s->model;
    if (m->lora && m->lora->classifier) /* its trained head goes with it */
        m->classifier = m->lora->base_classifier;
    m->lora = lo;
    if (lo && lo->classifier)
        m->classifier = lo->classifier;
}

nl_status stage_adapter_use(nl_stage *s, nl_lora *lo, int rows, nl_error *err)
{
    nl_status st = lo ? nl_lora_reserve(lo, rows, err) : NL_OK;
    if (st == NL_OK)
        stage_adapter_attach(s, lo);
    return st;
}

static void adapter_drop(nl_stage *s, int i)
{
    nl_lora_destroy(&s->ad[i].lo); /* detached: it frees its block */
    s->ad[i] = s->ad[--s->n_ad];
}

/* Drop unreferenced stale entries, and the least recently used
 * unreferenced ones beyond ADAPTERS_KEPT. */
static void adapter_trim(nl_stage *s)
{
    for (int i = s->n_ad - 1; i >= 0; i--)
        if (!s->ad[i].refs && s->ad[i].stale)
            adapter_drop(s, i);
    for (;;) {
        int idle = 0, lru = -1;
        for (int i = 0; i < s->n_ad; i++)
            if (!s->ad[i].refs) {
                idle++;
                if (lru < 0 || s->ad[i].used < s->ad[lru].used)
                    lru = i;
            }
        if (idle <= ADAPTERS_KEPT)
            return;
        adapter_drop(s, lru);
    }
}

nl_status stage_adapter_get(nl_stage *s, const char *path, nl_lora **lo, nl_error *err)
{
    char root[PATH_MAX], real[PATH_MAX];
    struct stat sb;
    *lo = NULL;
    if (!s->o.ckpt_root || !realpath(s->o.ckpt_root, root))
        return nl_error_set(err, NL_ERR_AUTH,
                            "params.adapter: this node has no --checkpoint-root to read adapters "
                            "from");
    const size_t n = strlen(root);
    if (!realpath(path, real) || strncmp(real, root, n) != 0 ||
        (real[n] != '/' && !(n == 1 && root[0] == '/')) || stat(real, &sb) != 0 ||
        !S_ISREG(sb.st_mode))
        return nl_error_set(err, NL_ERR_AUTH,
                            "params.adapter: not a file under this node's --checkpoint-root %s",
                            root);
    for (int i = 0; i < s->n_ad; i++) {
        stage_adapter *a = &s->ad[i];
        if (a->stale || strcmp(a->path, real) != 0)
            continue;
        if (a->dev == sb.st_dev && a->ino == sb.st_ino && a->size == sb.st_size &&
            a->mtime.tv_sec == sb.st_mtim.tv_sec && a->mtime.tv_nsec == sb.st_mtim.tv_nsec) {
            a->refs++;
            a->used = ++s->tick;
            *lo = a->lo;
            return NL_OK;
        }
        a->stale = true; /* rewritten: those who hold it keep the old one */
    }
    adapter_trim(s);
    if (s->n_ad == s->cap_ad) {
        const int cap = s->cap_ad ? 2 * s->cap_ad : 4;
        stage_adapter *ad = realloc(s->ad, (size_t)cap * sizeof *ad);
        if (!ad)
            return nl_error_set(err, NL_ERR_NOMEM, "params.adapter: out of memory");
        s->ad = ad;
        s->cap_ad = cap;
    }
    nl_lora *l = NULL;
    stage_adapter_attach(s, NULL); /* nl_lora_load attaches to a bare model */
    nl_status st = nl_lora_load(&l, s->model, real, 1, err); /* scratch: as its users need */
    stage_adapter_attach(s, NULL);
    if (st != NL_OK)
        return nl_error_prefix(err, "params.adapter");
    stage_adapter *a = &s->ad[s->n_ad++];
    *a = (stage_adapter){.dev = sb.st_dev,
                         .ino = sb.st_ino,
                         .size = sb.st_size,
                         .mtime = sb.st_mtim,
                         .lo = l,
                         .refs = 1,
                         .used = ++s->tick};
    snprintf(a->path, sizeof a->path, "%s", real);
    NL_INFO("adapter %s: rank %d on layers [%d, %d) loaded (%d adapter file%s cached)", real,
            l->rank, s->model->l0, s->model->l1, s->n_ad, s->n_ad == 1 ? "" : "s");
    *lo = l;
    return NL_OK;
}

void stage_adapter_put(nl_stage *s, nl_lora *lo)
{
    for (int i = 0; lo && i < s->n_ad; i++)
        if (s->ad[i].lo == lo) {
            if (s->ad[i].refs > 0)
                s->ad[i].refs--;
            adapter_trim(s);
            return;
        }
}

void stage_adapter_free_all(nl_stage *s)
{
    if (s->model)
        stage_adapter_attach(s, NULL);
    while (s->n_ad > 0)
        adapter_drop(s, s->n_ad - 1);
    free(s->ad);
    s->ad = NULL;
    s->cap_ad = 0;
}
