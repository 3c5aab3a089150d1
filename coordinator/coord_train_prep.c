/* A training job's preparation, a leaf of the job's state machine
 * (coord_train.c), which decides what follows: the client's parameters
 * read and checked, its paths confined to the data and checkpoint roots,
 * then a worker verifies the manifest it resumes from, with --learn-vocab
 * learns the vocabulary and grows the model, and reads and tokenizes the
 * data, and reports to the state machine (the done it was given);
 * coord_train_prepared then puts what it made into the cluster and the
 * job. As the job begins, its training memory is held against the plan
 * (coord_train_memory). The job's state is freed here too. */
#include <dirent.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "coordinator/coord_train_impl.h"
#include "core/formats/fileio.h"
#include "core/tokenizer/tokenizer.h"
#include "core/train/objective.h"
#include "net/trainparams.h"

/* Read the run's parameters by their schema (net/trainparams.h, which
 * checks them and the rules across them); NL_OK, or why not in e. */
static nl_status read_params(ctrain *t, const nl_msg_job_submit *s, const char **resume,
                             nl_error *e)
{
    nl_trainparams p;
    nl_status st = nl_trainparams_parse(&p, s->params, s->nparams,
                                        t->ft ? NL_TRAINPARAMS_FINETUNE : NL_TRAINPARAMS_TRAIN, e);
    if (st != NL_OK)
        return st;
    t->steps = p.steps;
    t->batch = p.batch;
    t->seq = p.seq;
    t->micro = p.micro;
    t->seed = p.seed;
    t->warmup = p.warmup;
    t->eval_every = p.eval_every;
    t->eval_batches = p.eval_batches;
    t->ckpt_every = p.ckpt_every;
    t->lr = p.lr;
    t->min_lr = p.min_lr;
    t->holdout = p.holdout;
    t->recompute = p.recompute;
    t->final_ckpt = p.final_ckpt;
    t->seq_default = p.seq_default;
    t->learn_vocab = p.learn_vocab;
    t->objective = p.objective; /* NL_OBJ_MODEL: the model's */
    t->pack = p.pack;
    snprintf(t->data, sizeof t->data, "%s", p.data);
    snprintf(t->ckpt_dir, sizeof t->ckpt_dir, "%s", p.checkpoint_dir);
    *resume = p.resume;
    return NL_OK;
}

/* Preparing a job, off the loop: the manifest it resumes from verified
 * and opened, then its data read (and tokenized, with the tokenizer of
 * the model it trains). */
typedef struct prep_task {
    cwork w;
    char *resume;    /* a manifest (resolved under root), or NULL */
    char root[4096]; /* the checkpoint root its shards must lie under */
    char *data, *tok;
    int64_t vocab;
    double holdout;
    nl_status st;
    nl_error err;
    int resume_failed;
    cmanifest mf;
    nl_dataset *ds;
    nl_dataset_info info;
    int classify; /* the data is labelled examples (lds), split by seed */
    int pack;     /* packed rows: count the data's <|end|> ids (ends) */
    int64_t ends;
    uint64_t seed;
    nl_labelled *lds;
    int grow; /* --learn-vocab: v learns from the data and grows the model first */
    coord_grow_work v;
    double grow_s;
} prep_task;

static void prep_run(cwork *w)
{
    prep_task *p = (prep_task *)w;
    if (p->resume && (p->st = coord_manifest_open(&p->mf, p->resume, p->root, &p->err)) != NL_OK) {
        p->resume_failed = 1;
        return;
    }
    if (p->grow) { /* the data teaches the tokenizer first; it is then tokenized with it */
        const double t0 = nl_mono_s();
        if ((p->st = coord_grow_run(&p->v, &p->err)) != NL_OK) {
            nl_error_prefix(&p->err, "--learn-vocab");
            return;
        }
        p->grow_s = nl_mono_s() - t0;
    }
    const char *tok = p->resume ? p->mf.tok : p->grow ? p->v.new_tok : p->tok;
    const int64_t vocab = p->resume ? p->mf.cfg.vocab_size
                          : p->grow ? p->v.grown.vocab_size
                                    : p->vocab;
    if (p->classify) /* label<TAB>text lines (core/data/labelled.h), as local training reads them */
        p->st = nl_labelled_load(&p->lds, p->data, tok, vocab, p->holdout, p->seed, &p->err);
    else
        p->st = nl_dataset_load_model(&p->ds, p->data, tok, vocab, p->holdout,
                                      "the cluster's model", &p->info, &p->err);
    for (size_t i = 0; p->st == NL_OK && p->pack && p->ds && i < p->ds->n; i++)
        p->ends += p->ds->ids[i] == NL_TOKEN_END;
}

static void prep_free(cwork *w)
{
    prep_task *p = (prep_task *)w;
    free(p->resume);
    free(p->data);
    free(p->tok);
    coord_manifest_release(&p->mf);
    coord_grow_release(&p->v);
    nl_dataset_destroy(&p->ds);
    nl_labelled_destroy(&p->lds);
    free(p);
}

/* --learn-vocab: the grown model becomes the source and the stages reload
 * (the job begins once they have); the client is told. NULL, or why the
 * job fails. */
static const char *install_growth(nl_coord *c, cjob *j, prep_task *p, char *why, size_t cap)
{
    char refusal[700];
    if (coord_grow_refusal(c, refusal, sizeof refusal)) { /* it changed while the worker ran */
        snprintf(why, cap, "--learn-vocab: %s", refusal);
        return why;
    }
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE && &c->jobs[i] != j)
            coord_job_fail(c, &c->jobs[i], "the cluster reloads: its model grows");
    coord_grow_install(c, &p->v, p->grow_s);
    coord_train_report(c, j, NL_JOB_RUNNING, "vocabulary grown", coord_grow_event(c, &p->v));
    return NULL;
}

/* A resumed job reloads the cluster from its manifest (it begins once the
 * cluster is ready); a grown vocabulary is installed likewise. */
const char *coord_train_prepared(nl_coord *c, cjob *j, const tr_in *in, char *why, size_t cap)
{
    prep_task *p = in->task;
    ctrain *t = j->state;
    if (p->resume_failed) {
        snprintf(why, cap, "--resume: %s", p->err.msg);
        return why;
    }
    /* before a resume reloads the cluster */
    if (!t->ft && coord_train_diloco_refusal(c, t, p->resume != NULL, why, cap))
        return why;
    if (p->resume) {
        /* other jobs lose their stages to the reload */
        for (int i = 0; i < COORD_MAX_JOBS; i++)
            if (c->jobs[i].phase != JOB_FREE && &c->jobs[i] != j)
                coord_job_fail(c, &c->jobs[i], "the cluster reloads to resume a training job");
        coord_manifest_install(c, &p->mf, 1);
        char msg[700];
        snprintf(msg, sizeof msg, "verified %s; loading it onto the nodes", p->resume);
        coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg, NULL);
    }
    if (t->seq > c->cfg.max_seq_len && t->seq_default) {
        t->seq = c->cfg.max_seq_len; /* the client's default, not a typed --seq: fit it */
    } else if (t->seq > c->cfg.max_seq_len) {
        snprintf(why, cap, "--seq %lld: the model's max_seq_len is %d", (long long)t->seq,
                 c->cfg.max_seq_len);
        return why;
    }
    if (p->st != NL_OK) {
        snprintf(why, cap, "%s", p->err.msg);
        return why;
    }
    if (p->grow && install_growth(c, j, p, why, cap))
        return why;
    /* only a resume goes on with the source's steps, schedule and moments
     * (its own, the operator's or a growth's); any other job starts at
     * step 0 from the weights the stages hold */
    t->cont = p->resume != NULL || c->src_continues;
    nl_error e = {0};
    if (nl_objective_check(&c->cfg, &t->objective, &e) != NL_OK || /* the client's, checked */
        (t->pack && nl_objective_check_pack(&c->cfg, t->objective, &e) != NL_OK)) {
        snprintf(why, cap, "%s", e.msg);
        return why;
    }
    if (p->lds && t->eval_every > 0 && p->lds->n == p->lds->n_train) {
        snprintf(why, cap, "%s: holdout %g of %zu examples holds none out to evaluate", t->data,
                 t->holdout, p->lds->n);
        return why;
    }
    if (p->lds && p->lds->n_classes > c->cfg.num_classes) {
        snprintf(why, cap, "%s: %d classes, but the model's num_classes is %d", t->data,
                 p->lds->n_classes, c->cfg.num_classes);
        return why;
    }
    t->ds = p->ds;
    t->lds = p->lds;
    p->ds = NULL;
    p->lds = NULL;
    t->pack_ends = p->ends;
    if (p->info.tokenized)
        NL_INFO("train job %llu: tokenized %s: %zu bytes -> %zu tokens in %.1f s",
                (unsigned long long)j->id, t->data, p->info.text_bytes, t->ds->n, p->info.encode_s);
    const size_t n = (size_t)t->batch * (size_t)t->seq;
    if (!(t->tokens = malloc(n * sizeof *t->tokens)) ||
        !(t->targets = malloc(n * sizeof *t->targets)) ||
        ((t->lds || t->pack) && !(t->docs = malloc(n * sizeof *t->docs))) ||
        (t->lds && (!(t->labels = malloc((size_t)t->batch * sizeof *t->labels)) ||
                    !(t->lengths = malloc((size_t)t->batch * sizeof *t->lengths))))) {
        snprintf(why, cap, "out of memory");
        return why;
    }
    return NULL;
}

/* Whether t's data (the file at real) fits beside the data every other
 * training or fine-tuning job holds in the coordinator's memory (each
 * reads its file whole and keeps its token ids: issue 31): their files'
 * sizes together at most --max-data-total. */
static int data_fits(const nl_coord *c, ctrain *t, const char *real)
{
    struct stat sb;
    t->data_bytes = stat(real, &sb) == 0 ? (uint64_t)sb.st_size : 0;
    uint64_t held = t->data_bytes;
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        const cjob *o = &c->jobs[i];
        if (o->phase != JOB_FREE && o->state && o->state != t &&
            (o->ops == &coord_train_ops || o->ops == &coord_finetune_ops))
            held += ((const ctrain *)o->state)->data_bytes;
    }
    return held <= c->o.max_data_total;
}

/* The job's client-chosen paths kept under the operator's roots (issue
 * 15): data under --data-root (a regular file of at most
 * --max-data-bytes), checkpoint_dir (made) and resume under
 * --checkpoint-root, each resolved with realpath (a link inside a root
 * that leads out is refused). t->data, t->ckpt_dir and *resume become the
 * resolved paths. NULL, or what is wrong (in why): nothing about files
 * outside the roots. */
static const char *confine_paths(nl_coord *c, ctrain *t, const char **resume, char *resume_real,
                                 size_t cap, char *why, size_t wcap)
{
    char real[PATH_MAX], joined[PATH_MAX];
    const char *bad =
        coord_confine_file(c->data_root, t->data, NULL, c->o.max_data_bytes, real, sizeof real);
    if (bad || strlen(real) >= sizeof t->data) {
        snprintf(why, wcap, "params.data: %s (the coordinator's --data-root)",
                 bad ? bad : "too long");
        return why;
    }
    snprintf(t->data, sizeof t->data, "%s", real);
    if (!data_fits(c, t, real)) {
        snprintf(why, wcap,
                 "params.data: with the data the training jobs running hold, it passes the "
                 "coordinator's --max-data-total; try again when one ends");
        return why;
    }
    if (*resume) {
        if ((bad = coord_confine_file(c->ckpt_root, *resume, "manifest.json", 64u << 20,
                                      resume_real, cap))) {
            snprintf(why, wcap, "params.resume: %s (the coordinator's --checkpoint-root)", bad);
            return why;
        }
        *resume = resume_real;
    }
    char *dir = NULL;
    nl_error e = {0};
    if ((bad = coord_join_path(c->ckpt_root, t->ckpt_dir, joined, sizeof joined)) ||
        nl_path_confine(c->ckpt_root, joined, &dir, &e) != NL_OK ||
        strlen(dir) >= sizeof t->ckpt_dir) {
        snprintf(why, wcap, "params.checkpoint_dir: %.400s (the coordinator's --checkpoint-root)",
                 bad                       ? bad
                 : dir                     ? "too long"
                 : e.status == NL_ERR_AUTH ? "leads outside the root (a symbolic link)"
                                           : e.msg);
        free(dir);
        return why;
    }
    snprintf(t->ckpt_dir, sizeof t->ckpt_dir, "%s", dir);
    free(dir);
    return NULL;
}

/* --learn-vocab: the growth the job's worker runs before it reads the
 * data (from the data itself); 0 and why when it cannot. */
static int prepare_growth(nl_coord *c, ctrain *t, prep_task *p, const char *resume, char *why,
                          size_t cap)
{
    nl_error e = {0};
    const size_t n = strlen(t->data);
    if (resume) {
        snprintf(why, cap,
                 "not with --resume (the vocabulary grows on the model the cluster "
                 "holds)");
        return 0;
    }
    if (n >= 4 && strcmp(t->data + n - 4, ".tok") == 0) {
        snprintf(why, cap, "%.512s holds token ids; the tokenizer learns from text", t->data);
        return 0;
    }
    if (coord_grow_refusal(c, why, cap))
        return 0;
    if (coord_grow_prepare(c, &p->v, t->data, t->learn_vocab, 0, 0, 0, &e) != NL_OK) {
        snprintf(why, cap, "%s", e.msg);
        return 0;
    }
    p->grow = 1;
    return 1;
}

const char *coord_train_diloco_refusal(const nl_coord *c, const ctrain *t, int resume, char *why,
                                       size_t cap)
{
    const int H = c->o.outer_every;
    if (H == 0)
        return NULL;
    if (resume) /* the outer momentum and the last sync's weights are not in the shards */
        snprintf(why, cap,
                 "--resume: not with --outer-every (DiLoCo's outer state is not "
                 "checkpointed)");
    else if (t->steps % H != 0)
        snprintf(why, cap, "--steps %lld: not a multiple of --outer-every %d", (long long)t->steps,
                 H);
    else if (t->ckpt_every % H != 0) /* a shard is written at an outer step only */
        snprintf(why, cap, "--checkpoint-every %lld: not a multiple of --outer-every %d",
                 (long long)t->ckpt_every, H);
    else
        return NULL;
    return why;
}

const char *coord_train_refusal(const nl_coord *c, int finetune, char *why, size_t cap)
{
    /* one training job at a time, and none beside fine-tuning (which
     * needs the weights frozen); fine-tuning jobs may run together */
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        const cjob *o = &c->jobs[i];
        const int kind = o->phase == JOB_FREE ? -1 : o->ops->kind;
        if ((kind != NL_JOB_TRAIN && kind != NL_JOB_FINETUNE) ||
            (finetune && kind == NL_JOB_FINETUNE))
            continue;
        snprintf(why, cap, "job %llu is %s already; %s", (unsigned long long)o->id,
                 kind == NL_JOB_TRAIN ? "training" : "fine-tuning",
                 finetune ? "fine-tuning needs the weights frozen" : "one at a time");
        return why;
    }
    return NULL;
}

/* The worker's task, made and started: NULL, or why the job fails. */
static const char *start_worker(nl_coord *c, cjob *j, prep_task *p, const nl_msg_job_submit *s,
                                const char *resume, tr_done done, char *why, size_t cap)
{
    ctrain *t = j->state;
    nl_error e = {0};
    p->w = (cwork){.run = prep_run, .done = done, .free = prep_free, .job_id = j->id};
    p->vocab = c->cfg.vocab_size;
    p->holdout = t->holdout;
    p->classify = t->objective == NL_OBJ_CLASSIFY;
    p->pack = t->pack;
    p->seed = (uint64_t)t->seed;
    int oom = 0;
    p->resume = coord_train_dup(resume, &oom);
    p->data = coord_train_dup(t->data, &oom);
    p->tok = coord_train_dup(resume ? NULL : c->tok_text, &oom);
    if (oom) {
        prep_free(&p->w);
        snprintf(why, cap, "out of memory");
        return why;
    }
    char refusal[700];
    if (t->learn_vocab > 0 && !prepare_growth(c, t, p, resume, refusal, sizeof refusal)) {
        prep_free(&p->w);
        snprintf(why, cap, "train: --learn-vocab: %s", refusal);
        return why;
    }
    if (!t->ft && (!(t->journal = coord_journal_params(s)) ||
                   (!resume && !(t->journal_from = coord_journal_from(c))))) {
        prep_free(&p->w);
        snprintf(why, cap, "out of memory");
        return why;
    }
    if (!t->ft) /* a fine-tuning job is not journaled: it ends with the coordinator */
        coord_journal_train(c, j, t->journal, t->journal_from, resume);
    if (coord_work_start(c, &p->w, &e) != NL_OK) {
        snprintf(why, cap, "%s", e.msg);
        return why;
    }
    return NULL;
}

const char *coord_train_prepare(nl_coord *c, cjob *j, const nl_msg_job_submit *s, tr_done done,
                                char *why, size_t cap)
{
    ctrain *t = j->state;
    char refusal[700];
    prep_task *p = calloc(1, sizeof *p);
    if (!p) {
        snprintf(why, cap, "out of memory");
        return why;
    }
    nl_error e = {0};
    const char *resume = NULL, *bad = NULL;
    if (read_params(t, s, &resume, &e) != NL_OK) {
        free(p);
        snprintf(why, cap, "%s: %s", j->ops->name, e.msg);
        return why;
    }
    char resume_real[PATH_MAX];
    if ((bad = confine_paths(c, t, &resume, resume_real, sizeof resume_real, refusal,
                             sizeof refusal))) {
        free(p);
        snprintf(why, cap, "train: %s", bad);
        return why;
    }
    snprintf(p->root, sizeof p->root, "%s", c->ckpt_root);
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, "running", NULL);
    /* a job recovered from the journal (no client yet) waits for the nodes */
    if (!resume && !c->ready && j->rid_len > 0) {
        free(p);
        snprintf(why, cap, "the cluster is not ready: %s", c->state);
        return why;
    }
    /* the objective against the model it trains now (a resumed one's is
     * checked again once its manifest is installed) */
    if (!resume && (t->objective != NL_OBJ_MODEL || t->pack)) {
        int obj = t->objective;
        if (nl_objective_check(&c->cfg, &obj, &e) != NL_OK ||
            (t->pack && nl_objective_check_pack(&c->cfg, obj, &e) != NL_OK)) {
            free(p);
            snprintf(why, cap, "train: %s", e.msg);
            return why;
        }
    }
    return start_worker(c, j, p, s, resume, done, why, cap);
}

const char *coord_train_replicas_refusal(const nl_coord *c, const ctrain *t, char *why, size_t cap)
{
    for (int s = 0; c->plan && s < c->plan->n_stages; s++) { /* DESIGN section 8 */
        const int Rs = coord_stage_replicas(c, s);
        if (Rs > 1 && t->micro % Rs != 0) {
            snprintf(why, cap,
                     "%d replicas of stage %d: a step's microbatches must be a multiple "
                     "of them",
                     Rs, s);
            return why;
        }
    }
    if (coord_stage_replicas(c, 0) == 1 && c->o.outer_every > 0 && !t->ft) {
        snprintf(why, cap, "--outer-every needs replica groups, but the plan has none");
        return why;
    }
    return NULL;
}

/* The first step after the job's start (up to its last) whose checkpoint
 * its --checkpoint-dir already holds (step-N with a manifest), or -1; *redo
 * is the first .redoN suffix none of its dirs has. */
static long long ckpt_dir_clash(const ctrain *t, int *redo)
{
    DIR *d = opendir(t->ckpt_dir);
    *redo = 1;
    if (!d)
        return -1; /* made by the job */
    long long found = -1;
    for (struct dirent *e; (e = readdir(d));) {
        char *end = NULL, path[PATH_MAX + 300];
        if (strncmp(e->d_name, "step-", 5) != 0)
            continue;
        const long long s = strtoll(e->d_name + 5, &end, 10);
        int k = 0; /* the redo dirs there: a new one goes past them */
        if (end && sscanf(end, ".redo%d", &k) == 1 && k >= *redo && k < INT32_MAX)
            *redo = k + 1;
        snprintf(path, sizeof path, "%s/%s/manifest.json", t->ckpt_dir, e->d_name);
        struct stat sb;
        if (end && !*end && s > t->start && s <= t->steps && (found < 0 || s < found) &&
            stat(path, &sb) == 0)
            found = s;
    }
    closedir(d);
    return found;
}

const char *coord_train_take_plan(nl_coord *c, cjob *j, char *why, size_t cap)
{
    ctrain *t = j->state;
    free(t->got);
    free(t->took);
    coord_train_free_shards(t->shards, t->stages); /* a resumed job's, of its former plan */
    t->stages = c->plan->n_stages;
    t->got = calloc((size_t)t->stages, sizeof *t->got);
    t->took = calloc((size_t)t->stages, sizeof *t->took);
    t->shards = calloc((size_t)t->stages, sizeof *t->shards);
    if (!t->got || !t->took || !t->shards) {
        snprintf(why, cap, "out of memory");
        return why;
    }
    j->phase = JOB_RUNNING;
    j->epoch = c->epoch;
    /* the stages hold a manifest's weights and moments, which this job continues */
    if (c->resumable && !t->ft && t->cont) {
        t->start = t->step = c->src_step;
        t->moments = 1;
        t->adam = c->src_adam;
        snprintf(t->manifest, sizeof t->manifest, "%s", c->src_path);
        t->manifest_step = c->src_step;
    }
    coord_train_verify_resume(t, t->start); /* the steps after it are redone */
    t->rolled = 0;
    int redo = 1;
    const long long clash =
        !t->ft && !t->n_ckpts && t->start < t->steps ? ckpt_dir_clash(t, &redo) : -1;
    if (clash >= 0 && !t->recovered) { /* the job's first plan: nothing of it written yet */
        snprintf(why, cap,
                 "--checkpoint-dir %s holds the checkpoint of step %lld (step-%06lld), a step "
                 "this job would write again: give another --checkpoint-dir, or --resume from it",
                 t->ckpt_dir, clash, clash);
        return why;
    }
    if (clash >= 0) { /* this job's own, written before the coordinator stopped and journaled
                       * them: kept; the steps redone write beside them */
        t->rollbacks = redo;
        NL_WARN("train job %llu: --checkpoint-dir %s holds the checkpoint of step %lld, written "
                "after the step the journal names (%lld) before the coordinator stopped: it is "
                "kept, and the steps redone write theirs beside it (step-N.redo%d)",
                (unsigned long long)j->id, t->ckpt_dir, clash, (long long)t->start, redo);
    }
    if (!t->ft && coord_train_ckpt_base(c, t) != 0) {
        snprintf(why, cap, "out of memory");
        return why;
    }
    if (t->start >= t->steps) {
        snprintf(why, cap, "--steps %lld: the cluster's model is already at step %lld",
                 (long long)t->steps, (long long)t->start);
        return why;
    }
    return NULL;
}

int coord_train_memory(nl_coord *c, cjob *j, char *why, size_t cap)
{
    ctrain *t = j->state;
    char held[400], none[400];
    c->train_mem = (nl_mem_opts){.training = 1,
                                 .micro_rows = (int)(t->batch / t->micro * t->seq),
                                 .in_flight = (int)t->micro,
                                 .in_flight_extra = c->o.in_flight_extra,
                                 .recompute = t->recompute};
    if (coord_plan_holds(c, &c->train_mem, held, sizeof held))
        return 1;
    if (!coord_plan_possible(c, none, sizeof none)) {
        snprintf(why, cap, "training memory: %s; and no plan over the nodes holds it: %s", held,
                 none);
        return -1;
    }
    if (t->mem_replanned || c->stages_modified) {
        snprintf(why, cap, "training memory: %s%s", held,
                 c->stages_modified ? " (the stages hold weights trained since the last "
                                      "checkpoint, so the cluster does not plan again)"
                                    : "");
        return -1;
    }
    t->mem_replanned = 1;
    NL_INFO("train job %llu: %s; planning again for training memory", (unsigned long long)j->id,
            held);
    char msg[500];
    snprintf(msg, sizeof msg, "%s; planning again for training memory", held);
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg, NULL);
    return 0;
}

void coord_train_state_free(ctrain *t)
{
    if (!t)
        return;
    nl_dataset_destroy(&t->ds);
    nl_labelled_destroy(&t->lds);
    free(t->tokens);
    free(t->targets);
    free(t->docs);
    free(t->labels);
    free(t->lengths);
    free(t->got);
    free(t->took);
    free(t->dig);
    free(t->sent);
    coord_train_verify_free(t);
    coord_train_ckpts_free(t);
    coord_train_free_shards(t->shards, t->stages);
    json_decref(t->journal);
    json_decref(t->journal_from);
    free(t->ft);
    free(t);
}
