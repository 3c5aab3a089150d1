/* The coordinator's journal (issue 22 item 4): <state-dir>/journal.json
 * holds the training job that runs (its id, its client's parameters and
 * the last verified manifest) and the last job id given out, rewritten
 * atomically (write, fsync, rename: core/formats/fileio.h) when the job starts,
 * at each checkpoint and when it ends. A coordinator that starts with a
 * journal naming a running job makes that job again under the same id,
 * resuming from its manifest (the client's JOB_SUBMIT with "resume" set),
 * once the nodes have joined again; a client follows it again with
 * `neuroctl train --attach JOB`.
 *
 * The file:
 *   {"next_job": N, "train": {"id": J, "params": {KEY: VALUE, ...},
 *                             "manifest": PATH or null,
 *                             "from": {"path": PATH or null, "modified": B} or null,
 *                             "owner": KEY or null} or null}
 * "from" is the source the job started from when it resumed no manifest:
 * a job with no checkpoint yet is made again from its start only when
 * the restarted coordinator's source is that one (its --model or
 * --resume); weights an earlier job left on the stages ("modified", or
 * another path) are gone with the old coordinator, and the job is not
 * made again from other weights: it is dropped, and the log says why.
 * "owner" is the key that submitted the job: the job recovered is that
 * key's again (without it, only an admin may follow or cancel it).
 * A parameter's JSON type gives its wire kind (integer, real, boolean,
 * string). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "core/formats/fileio.h"

/* The largest job id read back: 2^53, the largest integer a client's
 * JSON (the dashboard's JavaScript) holds exactly. */
#define JOURNAL_MAX_ID ((json_int_t)1 << 53)

static void journal_path(const nl_coord *c, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/journal.json", c->o.state_dir);
}

static void journal_write(nl_coord *c, json_t *train)
{
    char path[4200];
    nl_error e = {0};
    journal_path(c, path, sizeof path);
    json_t *root = json_pack("{s:I,s:O}", "next_job", (json_int_t)c->next_job, "train",
                             train ? train : json_null());
    char *text = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (!text || nl_file_write_atomic(path, text, strlen(text), &e) != NL_OK)
        NL_WARN("journal %s: %s", path, text ? e.msg : "out of memory");
    free(text);
}

json_t *coord_journal_params(const nl_msg_job_submit *s)
{
    json_t *o = json_object();
    for (uint32_t i = 0; o && i < s->nparams; i++) {
        const nl_wire_param *p = &s->params[i];
        json_t *v = p->kind == NL_WIRE_PARAM_INT     ? json_integer((json_int_t)p->i)
                    : p->kind == NL_WIRE_PARAM_FLOAT ? json_real(p->f)
                    : p->kind == NL_WIRE_PARAM_BOOL  ? json_boolean(p->b)
                    : p->kind == NL_WIRE_PARAM_STR   ? json_string(p->s)
                                                     : NULL;
        if (v && strcmp(p->key, "resume") != 0)
            json_object_set_new(o, p->key, v);
        else
            json_decref(v);
    }
    return o;
}

json_t *coord_journal_from(const nl_coord *c)
{
    return json_pack("{s:o,s:b}", "path", c->src_path[0] ? json_string(c->src_path) : json_null(),
                     "modified", c->stages_modified);
}

void coord_journal_train(nl_coord *c, const cjob *j, const json_t *params, const json_t *from,
                         const char *manifest)
{
    json_t *t =
        json_pack("{s:I,s:O,s:o,s:O,s:o}", "id", (json_int_t)j->id, "params", (json_t *)params,
                  "manifest", manifest && manifest[0] ? json_string(manifest) : json_null(), "from",
                  from ? (json_t *)from : json_null(), "owner",
                  j->owner[0] ? json_string(j->owner) : json_null());
    journal_write(c, t);
    json_decref(t);
}

void coord_journal_clear(nl_coord *c)
{
    journal_write(c, NULL);
}

/* The journal's parameters as a JOB_SUBMIT (params point into o), with
 * "resume" set to the manifest when there is one. */
static int submit_from(json_t *params, const char *manifest, nl_wire_param *ps, int cap)
{
    int n = 0;
    const char *key;
    json_t *v;
    json_object_foreach(params, key, v)
    {
        if (n >= cap - 1)
            break;
        nl_wire_param *p = &ps[n];
        if (json_is_integer(v))
            *p = (nl_wire_param){.key = key, .kind = NL_WIRE_PARAM_INT, .i = json_integer_value(v)};
        else if (json_is_real(v))
            *p = (nl_wire_param){.key = key, .kind = NL_WIRE_PARAM_FLOAT, .f = json_real_value(v)};
        else if (json_is_boolean(v))
            *p = (nl_wire_param){.key = key, .kind = NL_WIRE_PARAM_BOOL, .b = json_is_true(v)};
        else if (json_is_string(v))
            *p = (nl_wire_param){.key = key, .kind = NL_WIRE_PARAM_STR, .s = json_string_value(v)};
        else
            continue;
        n++;
    }
    if (manifest)
        ps[n++] = (nl_wire_param){.key = "resume", .kind = NL_WIRE_PARAM_STR, .s = manifest};
    return n;
}

void coord_journal_recover(nl_coord *c)
{
    char path[4200];
    journal_path(c, path, sizeof path);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) {
        if (access(path, F_OK) == 0) /* there, but not a journal: say so, and start anew */
            NL_WARN("journal %s: %s (line %d): not read; a training job it named is not made "
                    "again (its checkpoints are still there to --resume from)",
                    path, je.text, je.line);
        return; /* none: nothing ran */
    }
    if (!json_is_object(root))
        NL_WARN("journal %s: not a JSON object: not read", path);
    /* the last id given out (0: none yet), so that the next is at most 2^53 */
    const json_t *nj = json_object_get(root, "next_job");
    if (json_is_integer(nj) && json_integer_value(nj) >= 0 &&
        json_integer_value(nj) < JOURNAL_MAX_ID)
        c->next_job = (uint64_t)json_integer_value(nj);
    else if (nj)
        NL_WARN("journal %s: \"next_job\" is not a count of ids in 0..2^53-1: job ids start "
                "again at %llu",
                path, (unsigned long long)c->next_job + 1);
    json_t *t = json_object_get(root, "train");
    json_t *params = json_object_get(t, "params"), *id = json_object_get(t, "id");
    if (json_is_integer(id) && json_integer_value(id) > JOURNAL_MAX_ID)
        id = NULL; /* not a job this coordinator gave out */
    const char *manifest = json_string_value(json_object_get(t, "manifest"));
    const char *owner = json_string_value(json_object_get(t, "owner"));
    /* no checkpoint yet: its start must be this coordinator's source */
    const json_t *from = json_object_get(t, "from");
    const char *from_path = json_string_value(json_object_get(from, "path"));
    if (!manifest && json_is_object(from) && json_is_integer(id) &&
        (json_is_true(json_object_get(from, "modified")) ||
         strcmp(from_path ? from_path : "", c->src_path) != 0)) {
        NL_WARN("journal %s: train job %llu was running, with no checkpoint yet, from weights "
                "this coordinator does not hold (%s%s; its source is %s): it is not made again "
                "from other weights; submit it again",
                path, (unsigned long long)json_integer_value(id),
                from_path ? from_path : "the seed",
                json_is_true(json_object_get(from, "modified")) ? ", trained further on the stages"
                                                                : "",
                c->src_path[0] ? c->src_path : "the seed");
        json_decref(root);
        coord_journal_clear(c);
        return;
    }
    if (t && !json_is_null(t) &&
        !(json_is_object(params) && json_is_integer(id) && json_integer_value(id) > 0))
        NL_WARN("journal %s: \"train\" is not a job (an id in 1..2^53 and its parameters): not "
                "made again",
                path);
    if (json_is_object(params) && json_is_integer(id) && json_integer_value(id) > 0) {
        nl_wire_param ps[64];
        nl_rx rx;
        nl_rx_init(&rx);
        rx.msg.type = NL_MSG_JOB_SUBMIT;
        rx.msg.u.job_submit = (nl_msg_job_submit){NL_JOB_TRAIN, 0, ps};
        rx.msg.u.job_submit.nparams = (uint32_t)submit_from(params, manifest, ps, 64);
        rx.rid_len = 0; /* no client until one attaches */
        snprintf(rx.peer, sizeof rx.peer, "%s", owner ? owner : ""); /* its key's again */
        const uint64_t next = c->next_job;
        c->next_job = (uint64_t)json_integer_value(id) - 1; /* the job keeps its id */
        NL_INFO("journal %s: train job %llu was running; it resumes from %s", path,
                (unsigned long long)json_integer_value(id),
                manifest ? manifest : "its start (no checkpoint yet)");
        coord_train_ops.submit(c, &rx);
        if (c->next_job < next)
            c->next_job = next;
    }
    json_decref(root);
}
