/* What a training job's client is told, a leaf of the job's state machine
 * (coord_train.c), which decides when: JOB_STATUS messages with a JSON
 * report per event (docs/cluster.md, "Training"): the run's start, each
 * step, each checkpoint, the end; and the tail of a failure's message.
 * The log lines that go with them are here too. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_train_impl.h"
#include "core/train/objective.h"

static json_t *jnum(double x)
{
    return isfinite(x) ? json_real(x) : json_null();
}

void coord_train_report(nl_coord *c, cjob *j, int state, const char *msg, json_t *o)
{
    const ctrain *t = j->state;
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    const double progress = t->steps > 0 ? (double)t->step / (double)t->steps : 0.0;
    coord_status_to(c, j->rid, j->rid_len, j->id, state, progress > 1 ? 1 : progress, msg, text);
    free(text);
}

void coord_train_fail_note(const cjob *j, char *buf, size_t cap)
{
    const ctrain *t = j->state;
    if (!t)
        return;
    if (t->manifest[0])
        snprintf(buf, cap, "; last checkpoint: step %lld (%s)", (long long)t->manifest_step,
                 t->manifest);
    else
        snprintf(buf, cap, "; no checkpoint was written by this job (it began at step %lld)",
                 (long long)t->start);
}

void coord_train_report_start(nl_coord *c, cjob *j)
{
    const ctrain *t = j->state;
    const size_t n_all = t->lds ? t->lds->n : t->ds->n,
                 n_train = t->lds ? t->lds->n_train : t->ds->n_train;
    json_t *o = json_pack("{s:s,s:I,s:I,s:I,s:I,s:I,s:i,s:I,s:I,s:I,s:s}", "event", "start",
                          "start_step", (json_int_t)t->start, "steps", (json_int_t)t->steps,
                          "params", (json_int_t)nl_config_param_count(&c->cfg),
                          t->lds ? "examples" : "tokens", (json_int_t)n_train, "held_out",
                          (json_int_t)(n_all - n_train), "stages", t->stages, "batch",
                          (json_int_t)t->batch, "seq", (json_int_t)t->seq, "microbatches",
                          (json_int_t)t->micro, "objective", nl_objective_name(t->objective));
    if (o && t->lds)
        json_object_set_new(o, "classes", json_integer(t->lds->n_classes));
    if (o && t->pack)
        json_object_set_new(o, "pack_ends", json_integer((json_int_t)t->pack_ends));
    json_t *devices = json_array(); /* each stage's device, as its node's JOIN said */
    for (int s = 0; devices && s < t->stages; s++) {
        cnode *n = coord_stage_node(c, s);
        json_array_append_new(devices, n ? json_string(n->device) : json_null());
    }
    json_object_set_new(o, "devices", devices);
    if (!t->ft && t->start == 0 && c->weights_step > 0) {
        /* a new job on trained weights: it starts at step 0 from them, and
         * the client says where they came from */
        json_object_set_new(o, "weights_step", json_integer((json_int_t)c->weights_step));
        if (c->weights_job > 0)
            json_object_set_new(o, "weights_job", json_integer((json_int_t)c->weights_job));
        if (!c->stages_modified && c->src_path[0])
            json_object_set_new(o, "weights_checkpoint", json_string(c->src_path));
    }
    if (t->resumes > 0 && t->t_lost > 0) { /* the nodes' plan after a loss (not a re-plan at a
                                                checkpoint that follows one) */
        json_object_set_new(o, "resumes", json_integer(t->resumes));
        json_object_set_new(o, "plan", json_integer((json_int_t)c->epoch));
        json_object_set_new(o, "since_lost_s", jnum(nl_mono_s() - t->t_lost));
        NL_INFO("train job %llu: resumed at step %lld on plan %llu (%d stages), %.2f s after the "
                "loss (resume %d of %d)",
                (unsigned long long)j->id, (long long)t->start, (unsigned long long)c->epoch,
                t->stages, nl_mono_s() - t->t_lost, t->resumes, c->o.train_resumes);
    }
    coord_train_report(c, j, NL_JOB_RUNNING,
                       t->resumes > 0 && t->t_lost > 0 ? "resumed" : "starting", o);
    NL_INFO("train job %llu: %lld steps of %lld x %lld in %lld microbatches on %d stages, from "
            "step %lld%s",
            (unsigned long long)j->id, (long long)t->steps, (long long)t->batch, (long long)t->seq,
            (long long)t->micro, t->stages, (long long)t->start,
            t->moments ? " (resumed with the manifest's moments)" : "");
}

void coord_train_report_step(nl_coord *c, cjob *j)
{
    ctrain *t = j->state;
    const nl_step_result *r = &t->r;
    /* JSON has no NaN or infinity: a non-finite value is null */
    json_t *o = json_pack(
        "{s:s,s:I,s:I,s:o,s:o,s:o,s:o,s:o,s:o,s:b}", "event", "step", "step", (json_int_t)t->step,
        "steps", (json_int_t)t->steps, "loss", jnum(r->loss), "ce_loss", jnum(r->ce_loss),
        "aux_loss", jnum(r->aux_loss), "lr", jnum(t->lr_now), "grad_norm", jnum(r->grad_norm),
        "tokens_per_s", jnum((double)t->batch * (double)t->seq / t->step_s), "skipped", r->skipped);
    if (o && t->has_eval)
        json_object_set_new(o, "eval_loss", jnum(t->eval_loss));
    if (o) { /* hops whose two ends report other digests; verification by recompute */
        json_object_set_new(o, "digest_mismatches", json_integer((json_int_t)t->dig_mismatches));
        json_object_set_new(o, "verify_sampled", json_integer((json_int_t)t->verify_sampled));
        json_object_set_new(o, "verified", json_integer((json_int_t)t->verify_done));
        json_object_set_new(o, "verify_mismatches", json_integer((json_int_t)t->verify_mismatches));
        json_object_set_new(o, "verify_skipped", json_integer((json_int_t)t->verify_skipped));
        json_object_set_new(o, "verify_convicted", json_integer((json_int_t)t->verify_convicted));
        json_object_set_new(o, "verify_outvoted", json_integer((json_int_t)t->verify_outvoted));
    }
    if (o && t->has_eval && t->lds)
        json_object_set_new(o, "eval_accuracy", jnum(t->eval_acc));
    char msg[64];
    snprintf(msg, sizeof msg, "step %lld of %lld", (long long)t->step, (long long)t->steps);
    coord_train_report(c, j, NL_JOB_RUNNING, msg, o);
    if (t->t_lost > 0) {
        NL_INFO("train job %llu: step %lld, the first after the resume, done %.2f s after the "
                "stage was lost at step %lld",
                (unsigned long long)j->id, (long long)t->step, nl_mono_s() - t->t_lost,
                (long long)t->lost_at);
        t->t_lost = 0;
    }
    if (r->skipped)
        NL_WARN("train job %llu: step %lld skipped: non-finite %s", (unsigned long long)j->id,
                (long long)t->step, isfinite(r->loss) ? "gradient" : "loss");
}

void coord_train_report_ckpt(nl_coord *c, cjob *j, int64_t step, const char *manifest)
{
    json_t *o = json_pack("{s:s,s:I,s:s}", "event", "checkpoint", "step", (json_int_t)step,
                          "manifest", manifest);
    coord_train_report(c, j, NL_JOB_RUNNING, "checkpoint", o);
}

void coord_train_report_end(nl_coord *c, cjob *j, int cancelled)
{
    const ctrain *t = j->state;
    const int kept = t->manifest[0] && t->manifest_step == t->step;
    const char *adapter = t->ft && t->ft->adapter[0] ? t->ft->adapter : NULL;
    json_t *o = json_pack("{s:s,s:I}", "event", cancelled ? "cancelled" : "done", "step",
                          (json_int_t)t->step);
    if (kept)
        json_object_set_new(o, "manifest", json_string(t->manifest));
    if (adapter)
        json_object_set_new(o, "adapter", json_string(adapter));
    if (t->verify_sampled > 0) /* the job's verification by recompute (SETTLE: all answered) */
        NL_INFO("%s job %llu: %lld (stage, microbatch)s drawn for verification, %lld answered, "
                "%lld found wrong, %lld skipped",
                j->ops->name, (unsigned long long)j->id, (long long)t->verify_sampled,
                (long long)t->verify_done, (long long)t->verify_mismatches,
                (long long)t->verify_skipped);
    char msg[8400] = "done";
    if (cancelled && adapter)
        snprintf(msg, sizeof msg, "cancelled at step %lld; kept the adapters in %s",
                 (long long)t->step, adapter);
    else if (cancelled && kept)
        snprintf(msg, sizeof msg, "cancelled at step %lld; kept %s (continue with --resume %s)",
                 (long long)t->step, t->manifest, t->manifest);
    else if (cancelled)
        snprintf(msg, sizeof msg, "cancelled at step %lld; no step of this job to keep",
                 (long long)t->step);
    if (cancelled)
        NL_INFO("%s job %llu: %s", j->ops->name, (unsigned long long)j->id, msg);
    else
        NL_INFO("%s job %llu: done at step %lld", j->ops->name, (unsigned long long)j->id,
                (long long)t->step);
    coord_train_report(c, j, cancelled ? NL_JOB_CANCELLED : NL_JOB_DONE, msg, o);
}

void coord_train_report_stopping(nl_coord *c, cjob *j, const nl_rx *rx, int64_t k, int first)
{
    const ctrain *t = j->state;
    char msg[200];
    snprintf(msg, sizeof msg, "stopping after step %lld: writing a checkpoint", (long long)k);
    const int own = j->rid_len == rx->rid_len && memcmp(j->rid, rx->rid, rx->rid_len) == 0;
    const int owner = j->owner[0] && strcmp(j->owner, rx->peer) == 0;
    if (first)
        NL_INFO("%s job %llu cancelled by %s at step %lld: %s", j->ops->name,
                (unsigned long long)j->id, owner ? "its client" : "an admin", (long long)t->step,
                msg);
    json_t *o = json_pack("{s:s,s:I}", "event", "stopping", "step", (json_int_t)k);
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    coord_status_to(c, rx->rid, rx->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg, text);
    if (!own) /* from another connection (an admin's): the one that follows it learns it too */
        coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, msg, text);
    free(text);
}

void coord_train_report_lost(nl_coord *c, cjob *j, const char *why)
{
    const ctrain *t = j->state;
    /* after a conviction, the checkpoint the job rolls back to (its source
     * from when the worker has opened it) */
    const cckpt *k = t->rolled && t->n_ckpts ? &t->ckpts[t->n_ckpts - 1] : NULL;
    /* else the job's own last checkpoint, or its start (the source may be
     * another job's manifest, whose steps are not this job's) */
    const int64_t from = k                                        ? k->step
                         : c->src_manifest && c->src_job == j->id ? c->src_step
                                                                  : t->start;
    const char *src = k && k->path ? k->path : c->src_path[0] ? c->src_path : "the seed";
    NL_WARN("train job %llu: %s at step %lld; resuming from step %lld (%s) on the nodes left "
            "(resume %d of %d)",
            (unsigned long long)j->id, why, (long long)t->lost_at, (long long)from, src, t->resumes,
            c->o.train_resumes);
    json_t *o = json_pack("{s:s,s:s,s:I,s:I,s:s,s:i,s:i}", "event", "node_lost", "why", why,
                          "lost_step", (json_int_t)t->lost_at, "resume_step", (json_int_t)from,
                          "source", src, "resume", t->resumes, "max_resumes", c->o.train_resumes);
    coord_train_report(c, j, NL_JOB_RUNNING, "node lost; resuming", o);
}

void coord_train_report_rollback(nl_coord *c, cjob *j, int64_t from, const cckpt *k)
{
    const ctrain *t = j->state;
    const char *to = k->path ? k->path : "the seed";
    json_t *later = json_array(); /* kept on disk, not resumed from: not all verified */
    for (int i = (int)(k - t->ckpts) + 1; later && i < t->n_ckpts; i++)
        json_array_append_new(later, json_string(t->ckpts[i].path));
    NL_WARN("train job %llu: a node was convicted of computing wrong at step %lld: rolling back "
            "to step %lld (%s), the last checkpoint whose steps were all verified; %zu later "
            "checkpoint(s) set aside",
            (unsigned long long)j->id, (long long)from, (long long)k->step, to,
            later ? json_array_size(later) : 0);
    json_t *o = json_pack("{s:s,s:I,s:I,s:s,s:o,s:I}", "event", "rollback", "from_step",
                          (json_int_t)from, "to_step", (json_int_t)k->step, "checkpoint", to,
                          "unverified", later ? later : json_array(), "verified_through",
                          (json_int_t)(t->verify_taint == INT64_MAX ? -1 : t->verify_taint - 1));
    coord_train_report(c, j, NL_JOB_RUNNING, "convicted node: rolling back", o);
}
