/* The adapter a cluster's job names (params.adapter of a generation, a
 * forward or an embedding job) against the model its stages hold: the
 * adapter file's base_sha256 and the model file's SHA-256, compared by a
 * worker (coord_work.c) as the local tools and neurocoord --http-adapter
 * compare them (nl_lora_check_bases), so that an adapter trained on
 * another checkpoint is refused naming both hashes rather than applied.
 * The model file is hashed once, by the first such job, and kept while
 * its size and modification time stay. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "core/model/lora.h"

typedef struct adapter_task {
    cwork w;
    char adapter[PATH_MAX], base[4096];
    char hex[65];           /* the base's SHA-256: known when the task began, or hashed by it */
    int hashed;             /* 1: by it */
    int64_t size, mtime_ns; /* the base's, when the task began */
    double t0;
    nl_status st;
    nl_error err;
} adapter_task;

static void check_run(cwork *w)
{
    adapter_task *a = (adapter_task *)w;
    const char *paths[1] = {a->adapter};
    const int known = a->hex[0] != 0;
    a->st = nl_lora_check_bases_hex(paths, 1, a->base, a->hex, &a->err);
    a->hashed = !known && a->hex[0] != 0;
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

static void check_done(nl_coord *c, cwork *w)
{
    adapter_task *a = (adapter_task *)w;
    int64_t size = 0, mtime = 0;
    const char *model = nl_coord_model_file(c);
    if (a->hashed && model && strcmp(model, a->base) == 0 && file_stamp(a->base, &size, &mtime) &&
        size == a->size && mtime == a->mtime_ns &&
        !(size == c->model_hex_size && mtime == c->model_hex_mtime_ns &&
          strcmp(c->model_hex, a->hex) == 0)) { /* kept for the next adapter (once) */
        memcpy(c->model_hex, a->hex, sizeof c->model_hex);
        c->model_hex_size = size;
        c->model_hex_mtime_ns = mtime;
        NL_INFO("adapters named by jobs are checked against %s (SHA-256 %.12s..., hashed in "
                "%.1f s)",
                a->base, a->hex, nl_mono_s() - a->t0);
    }
    cjob *j = coord_job_find(c, w->job_id);
    if (!j || !j->checking)
        return; /* it ended meanwhile */
    j->checking = 0;
    j->last_progress = nl_mono_s();
    if (a->st != NL_OK) {
        char why[sizeof a->err.msg + 32];
        snprintf(why, sizeof why, "params.adapter: %s", a->err.msg);
        coord_job_fail(c, j, why);
    } else if (c->ready && c->plan) {
        j->ops->ready(c, j);
    } /* else its ready runs when the plan is (coord_jobs_ready) */
}

int coord_adapter_check(nl_coord *c, cjob *j, const char *adapter)
{
    const char *model = nl_coord_model_file(c);
    if (!adapter || !adapter[0] || !model)
        return 0;
    adapter_task *a = calloc(1, sizeof *a);
    if (!a) {
        coord_job_fail(c, j, "out of memory");
        return 1;
    }
    a->w = (cwork){.run = check_run, .done = check_done, .free = check_free, .job_id = j->id};
    snprintf(a->adapter, sizeof a->adapter, "%s", adapter);
    snprintf(a->base, sizeof a->base, "%s", model);
    a->t0 = nl_mono_s();
    if (file_stamp(model, &a->size, &a->mtime_ns) && c->model_hex[0] &&
        a->size == c->model_hex_size && a->mtime_ns == c->model_hex_mtime_ns)
        memcpy(a->hex, c->model_hex, sizeof a->hex);
    j->phase = JOB_WAITING;
    j->checking = 1;
    nl_error e = {0};
    if (coord_work_start(c, &a->w, &e) != NL_OK) { /* a freed */
        coord_job_fail(c, j, e.msg);
        return 1;
    }
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0,
                    "checking the adapter against the model's checkpoint", NULL);
    return 1;
}
