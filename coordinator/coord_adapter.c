/* The adapter a cluster's job names (params.adapter of a generation, a
 * forward or an embedding job) against the model its stages hold: the
 * adapter file's base_sha256 and the model file's SHA-256, compared by a
 * worker (coord_work.c) as the local tools and neurocoord --http-adapter
 * compare them (nl_lora_check_bases), so that an adapter trained on
 * another checkpoint is refused naming both hashes rather than applied.
 * The model file is hashed once (by the first such job's task, or by
 * --http-adapter's check at start) and kept while its size and
 * modification time stay; jobs that come while it is being hashed wait
 * for that hash rather than read the file again. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "core/model/lora.h"

/* cjob.checking: its task runs, or it waits for the model's hash */
enum { CHECK_TASK = 1, CHECK_WAITS_HASH = 2 };

typedef struct adapter_task {
    cwork w;
    char adapter[PATH_MAX], base[4096];
    char hex[65];           /* the base's SHA-256: known when the task began, or hashed by it */
    int may_hash;           /* 1: begun without it (c->model_hashing is this task) */
    int64_t size, mtime_ns; /* the base's, when the task began */
    double t0;
    nl_status st;
    nl_error err;
} adapter_task;

static void check_run(cwork *w)
{
    adapter_task *a = (adapter_task *)w;
    const char *paths[1] = {a->adapter};
    a->st = nl_lora_check_bases_hex(paths, 1, a->base, a->hex, &a->err);
}

static void check_free(cwork *w)
{
    free(w);
}

/* The file's size and modification time (ns); 0 if it cannot be read. */
static int file_stamp(const char *path, int64_t *size, int64_t *mtime_ns)
{
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode))
        return 0;
    *size = (int64_t)sb.st_size;
    *mtime_ns = (int64_t)sb.st_mtim.tv_sec * 1000000000 + (int64_t)sb.st_mtim.tv_nsec;
    return 1;
}

/* The hash kept for the model file as it is now, into hex (65); 0: none. */
static int kept_hash(const nl_coord *c, const char *model, char *hex)
{
    int64_t size = 0, mtime = 0;
    if (!c->model_hex[0] || !file_stamp(model, &size, &mtime) || size != c->model_hex_size ||
        mtime != c->model_hex_mtime_ns)
        return 0;
    memcpy(hex, c->model_hex, sizeof c->model_hex);
    return 1;
}

/* Keep hex as the model file's hash, if the file is still what was
 * hashed (size, time); 1 if it was not kept already. */
static int keep_hash(nl_coord *c, const char *hex, int64_t size, int64_t mtime)
{
    int64_t now_size = 0, now_mtime = 0;
    const char *model = nl_coord_model_file(c);
    if (!model || !file_stamp(model, &now_size, &now_mtime) || now_size != size ||
        now_mtime != mtime)
        return 0;
    if (size == c->model_hex_size && mtime == c->model_hex_mtime_ns &&
        strcmp(c->model_hex, hex) == 0)
        return 0;
    memcpy(c->model_hex, hex, sizeof c->model_hex);
    c->model_hex_size = size;
    c->model_hex_mtime_ns = mtime;
    return 1;
}

void nl_coord_model_hashed(nl_coord *c, const char *hex)
{
    int64_t size = 0, mtime = 0;
    const char *model = nl_coord_model_file(c);
    if (model && hex && strlen(hex) == 64 && file_stamp(model, &size, &mtime))
        keep_hash(c, hex, size, mtime);
}

static void check_done(nl_coord *c, cwork *w);

/* Job j's check begins: a task with the hash kept, or the one that may
 * hash the file; else j waits for that one (CHECK_WAITS_HASH). */
static void launch(nl_coord *c, cjob *j)
{
    const char *model = nl_coord_model_file(c);
    if (!model) { /* the stages' weights are no file's any more: nothing to compare */
        j->checking = 0;
        if (c->ready && c->plan)
            j->ops->ready(c, j);
        return;
    }
    char hex[65] = "";
    const int known = kept_hash(c, model, hex);
    if (!known && c->model_hashing) {
        j->checking = CHECK_WAITS_HASH;
        return;
    }
    adapter_task *a = calloc(1, sizeof *a);
    if (!a) {
        coord_job_fail(c, j, "out of memory");
        return;
    }
    a->w = (cwork){.run = check_run, .done = check_done, .free = check_free, .job_id = j->id};
    snprintf(a->adapter, sizeof a->adapter, "%s", j->check_adapter);
    snprintf(a->base, sizeof a->base, "%s", model);
    memcpy(a->hex, hex, sizeof a->hex);
    a->may_hash = !known;
    a->t0 = nl_mono_s();
    file_stamp(model, &a->size, &a->mtime_ns);
    nl_error e = {0};
    j->checking = CHECK_TASK;
    if (coord_work_start(c, &a->w, &e) != NL_OK) { /* a freed */
        coord_job_fail(c, j, e.msg);
        return;
    }
    c->model_hashing |= a->may_hash;
}

static void check_done(nl_coord *c, cwork *w)
{
    adapter_task *a = (adapter_task *)w;
    if (a->may_hash)
        c->model_hashing = 0;
    if (a->may_hash && a->hex[0] && keep_hash(c, a->hex, a->size, a->mtime_ns))
        NL_INFO("adapters named by jobs are checked against %s (SHA-256 %.12s..., hashed in "
                "%.1f s)",
                a->base, a->hex, nl_mono_s() - a->t0);
    cjob *j = coord_job_find(c, w->job_id);
    if (j && j->checking == CHECK_TASK) {
        const char *model = nl_coord_model_file(c);
        j->last_progress = nl_mono_s();
        if (model && strcmp(model, a->base) != 0) { /* the stages' source changed: again */
            launch(c, j);
        } else if (model && a->st != NL_OK) {
            char why[sizeof a->err.msg + 32];
            snprintf(why, sizeof why, "params.adapter: %s", a->err.msg);
            coord_job_fail(c, j, why);
        } else { /* compared (or, with no model file now, nothing to compare) */
            j->checking = 0;
            if (c->ready && c->plan)
                j->ops->ready(c, j);
        } /* else its ready runs when the plan is (coord_jobs_ready) */
    }
    /* the jobs that waited for the hash: now with it (or one hashes) */
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE && c->jobs[i].checking == CHECK_WAITS_HASH)
            launch(c, &c->jobs[i]);
}

int coord_adapter_check(nl_coord *c, cjob *j, const char *adapter)
{
    if (!adapter || !adapter[0] || !nl_coord_model_file(c))
        return 0;
    j->phase = JOB_WAITING;
    j->check_adapter = adapter;
    j->checking = CHECK_TASK;
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0,
                    "checking the adapter against the model's checkpoint", NULL);
    launch(c, j);
    return 1;
}
