/* LoRA fine-tuning jobs on one pipeline stage (JOB_SUBMIT kind finetune,
 * docs/cluster.md "LoRA fine-tuning"): each job owns adapters for this
 * stage's layers (core/lora.h, drawn from the run's seed as local
 * `neuroctl finetune` draws them) and a training job's state of
 * stage_train.c, which it runs unchanged: the job's trainer is made with
 * the adapters attached, so it keeps moments for the adapters alone, takes
 * their gradients' norm and steps only them; the base weights are never
 * written. Any objective runs so (its frames ride the hops as in
 * training); on the stage with a classification head the adapters hold a
 * copy of the head that trains with them and goes into the shard.
 *
 * Several jobs may fine-tune at once on the same frozen weights. The
 * stage's model carries no adapters between messages: a message of job J
 * swaps J's training state into s->train and J's adapters onto the model,
 * runs it through stage_train.c, and swaps both out again, so that
 * inference and every other job see the base alone.
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

#include "../base/log.h"
#include "../core/lora.h"
#include "stage_impl.h"

#include <sys/stat.h>

struct stage_ft {
    uint64_t job;
    struct stage_train *train; /* stage_train.c's state of the job */
    nl_lora *lo;               /* its adapters (not attached between messages) */
};

static stage_ft *find(const nl_stage *s, uint64_t job)
{
    for (int i = 0; job && i < s->n_ft; i++)
        if (s->ft[i].job == job)
            return &s->ft[i];
    return NULL;
}

/* Job f's state and adapters in place of the stage's; swap_out undoes it. */
static struct stage_train *swap_in(nl_stage *s, stage_ft *f)
{
    struct stage_train *saved = s->train;
    s->train = f->train;
    nl_stage_adapter_attach(s, f->lo);
    return saved;
}

static void swap_out(nl_stage *s, stage_ft *f, struct stage_train *saved)
{
    f->train = s->train;
    s->train = saved;
    nl_stage_adapter_attach(s, NULL);
}

/* Free job i's state and adapters and drop it from the table. */
static void ft_drop(nl_stage *s, int i)
{
    stage_ft *f = &s->ft[i];
    if (s->model) {
        struct stage_train *saved = swap_in(s, f);
        nl_stage_train_free(s);
        swap_out(s, f, saved);
    }
    nl_lora_destroy(&f->lo); /* detached already: it frees its block */
    s->ft[i] = s->ft[--s->n_ft];
}

void nl_stage_lora_free_all(nl_stage *s)
{
    while (s->n_ft > 0)
        ft_drop(s, s->n_ft - 1);
    free(s->ft);
    s->ft = NULL;
    s->cap_ft = 0;
}

bool nl_stage_lora_holds(const nl_stage *s, uint64_t job)
{
    return find(s, job) != NULL;
}

bool nl_stage_lora_end(nl_stage *s, uint64_t job)
{
    for (int i = 0; i < s->n_ft; i++)
        if (s->ft[i].job == job) {
            ft_drop(s, i);
            return true;
        }
    return false;
}

/* A parameter of the request by key, or NULL. */
static const nl_wire_param *param(const nl_msg_job_submit *j, const char *key)
{
    for (uint32_t i = 0; i < j->nparams; i++)
        if (strcmp(j->params[i].key, key) == 0)
            return &j->params[i];
    return NULL;
}

/* An integer parameter within [lo, hi] (dflt when absent and not required). */
static nl_status int_of(const nl_msg_job_submit *j, const char *key, int required, int64_t lo,
                        int64_t hi, int64_t dflt, int64_t *v, nl_error *err)
{
    const nl_wire_param *p = param(j, key);
    *v = dflt;
    if (!p)
        return required ? nl_error_set(err, NL_ERR_PROTO, "finetune JOB_SUBMIT: no params.%s", key)
                        : NL_OK;
    if (p->kind != NL_WIRE_PARAM_INT || p->i < lo || p->i > hi)
        return nl_error_set(err, NL_ERR_RANGE,
                            "finetune JOB_SUBMIT params.%s: not an integer in [%lld, %lld]", key,
                            (long long)lo, (long long)hi);
    *v = p->i;
    return NL_OK;
}

/* The adapters the request asks for (rank, alpha, targets, seed), made on
 * the stage's model for microbatches of mbB x T rows and drawn from the
 * seed; attached to the model on return. */
static nl_status make_adapters(nl_stage *s, const nl_msg_job_submit *j, nl_lora **lo, nl_error *err)
{
    int64_t rank = 0, seed = 0, mbB = 0, T = 0;
    int targets = 0;
    nl_status st;
    if ((st = int_of(j, "lora_rank", 1, 1, NL_LORA_MAX_RANK, 0, &rank, err)) != NL_OK ||
        (st = int_of(j, "lora_seed", 1, 0, INT64_MAX, 0, &seed, err)) != NL_OK ||
        (st = int_of(j, "micro_batch", 1, 1, 1 << 20, 0, &mbB, err)) != NL_OK ||
        (st = int_of(j, "seq", 1, 1, s->model->cfg.max_seq_len, 0, &T, err)) != NL_OK)
        return st;
    if (mbB * T > (1 << 24))
        return nl_error_set(err, NL_ERR_RANGE, "finetune: microbatch %lld x %lld is too big",
                            (long long)mbB, (long long)T);
    const nl_wire_param *a = param(j, "lora_alpha"), *tg = param(j, "lora_targets");
    const double alpha = !a                               ? -1.0
                         : a->kind == NL_WIRE_PARAM_FLOAT ? a->f
                         : a->kind == NL_WIRE_PARAM_INT   ? (double)a->i
                                                          : -1.0;
    if (!(alpha > 0.0 && alpha <= 1e6))
        return nl_error_set(err, NL_ERR_RANGE,
                            "finetune JOB_SUBMIT params.lora_alpha: not a number in (0, 1e6]");
    if (!tg || tg->kind != NL_WIRE_PARAM_STR)
        return nl_error_set(err, NL_ERR_PROTO, "finetune JOB_SUBMIT: no params.lora_targets");
    if ((st = nl_lora_parse_targets(tg->s, &targets, err)) != NL_OK)
        return nl_error_prefix(err, "finetune JOB_SUBMIT params.lora_targets");
    if ((st = nl_lora_new(lo, s->model, (int)rank, (float)alpha, targets, (int)(mbB * T), err)) !=
            NL_OK ||
        (st = nl_lora_init_random(*lo, (uint64_t)seed, err)) != NL_OK)
        nl_lora_destroy(lo);
    return st;
}

nl_status nl_stage_lora_begin(nl_stage *s, const nl_msg_job_submit *j, uint64_t *job_id,
                              nl_error *err)
{
    int64_t job = 0;
    nl_status st = int_of(j, "job", 1, 1, INT64_MAX, 0, &job, err);
    *job_id = (uint64_t)job;
    if (st != NL_OK)
        return st;
    if (!s->ready)
        return nl_error_set(err, NL_ERR_STATE, "finetune job %lld: this stage has no model loaded",
                            (long long)job);
    uint64_t other = 0;
    if (nl_stage_train_running(s, &other))
        return nl_error_set(err, NL_ERR_STATE,
                            "finetune job %lld: training job %llu changes this stage's weights",
                            (long long)job, (unsigned long long)other);
    if (s->n_rep > 1) /* the adapters would need the replicas' all-reduce: not built */
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "finetune job %lld: fine-tuning on %d data-parallel replicas is not "
                            "available (run the node on one device)",
                            (long long)job, s->n_rep);
    if (find(s, (uint64_t)job))
        return nl_error_set(err, NL_ERR_STATE, "finetune job %lld: already runs on this stage",
                            (long long)job);
    const nl_wire_param *mo = param(j, "moments");
    if (mo && mo->kind == NL_WIRE_PARAM_BOOL && mo->b)
        return nl_error_set(err, NL_ERR_INVALID,
                            "finetune job %lld: adapters start fresh (no moments)", (long long)job);
    if (s->n_ft == s->cap_ft) {
        const int cap = s->cap_ft ? 2 * s->cap_ft : 4;
        stage_ft *ft = realloc(s->ft, (size_t)cap * sizeof *ft);
        if (!ft)
            return nl_error_set(err, NL_ERR_NOMEM, "finetune job %lld: out of memory",
                                (long long)job);
        s->ft = ft;
        s->cap_ft = cap;
    }
    stage_ft f = {.job = (uint64_t)job};
    if ((st = make_adapters(s, j, &f.lo, err)) != NL_OK)
        return nl_error_prefix(err, "finetune job %lld", (long long)job);
    /* the training job's state, made with the adapters attached */
    struct stage_train *saved = swap_in(s, &f);
    s->train = NULL;
    uint64_t id = 0;
    st = nl_stage_train_make(s, j, &id, err);
    swap_out(s, &f, saved);
    if (st != NL_OK) {
        nl_lora_destroy(&f.lo);
        return st;
    }
    s->ft[s->n_ft++] = f;
    NL_INFO("finetune job %llu: rank %d adapters on layers [%d, %d), %zu parameters train; the "
            "base is frozen (%d fine-tuning job%s on this stage)",
            (unsigned long long)job, f.lo->rank, s->model->l0, s->model->l1, f.lo->n_params,
            s->n_ft, s->n_ft == 1 ? "" : "s");
    return NL_OK;
}

nl_status nl_stage_lora_input(nl_stage *s, uint64_t job, const nl_wire_msg *m,
                              nl_stage_send_fn send, void *ctx, nl_error *err)
{
    stage_ft *f = find(s, job);
    if (!f || !s->model)
        return nl_error_set(err, NL_ERR_STATE, "%s: job %llu is not fine-tuning on this stage",
                            nl_wire_type_name(m->type), (unsigned long long)job);
    struct stage_train *saved = swap_in(s, f);
    nl_status st = nl_stage_train_input(s, m, send, ctx, err);
    swap_out(s, f, saved);
    return st;
}

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

void nl_stage_adapter_attach(nl_stage *s, nl_lora *lo)
{
    nl_model *m = s->model;
    if (m->lora && m->lora->classifier) /* its trained head goes with it */
        m->classifier = m->lora->base_classifier;
    m->lora = lo;
    if (lo && lo->classifier)
        m->classifier = lo->classifier;
}

nl_status nl_stage_adapter_use(nl_stage *s, nl_lora *lo, int rows, nl_error *err)
{
    nl_status st = lo ? nl_lora_reserve(lo, rows, err) : NL_OK;
    if (st == NL_OK)
        nl_stage_adapter_attach(s, lo);
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

nl_status nl_stage_adapter_get(nl_stage *s, const char *path, nl_lora **lo, nl_error *err)
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
    nl_stage_adapter_attach(s, NULL); /* nl_lora_load attaches to a bare model */
    nl_status st = nl_lora_load(&l, s->model, real, 1, err); /* scratch: as its users need */
    nl_stage_adapter_attach(s, NULL);
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

void nl_stage_adapter_put(nl_stage *s, nl_lora *lo)
{
    for (int i = 0; lo && i < s->n_ad; i++)
        if (s->ad[i].lo == lo) {
            if (s->ad[i].refs > 0)
                s->ad[i].refs--;
            adapter_trim(s);
            return;
        }
}

void nl_stage_adapter_free_all(nl_stage *s)
{
    if (s->model)
        nl_stage_adapter_attach(s, NULL);
    while (s->n_ad > 0)
        adapter_drop(s, s->n_ad - 1);
    free(s->ad);
    s->ad = NULL;
    s->cap_ad = 0;
}
