/* neurocoord --http: what happens on the cluster, as /api/events and as
 * the training job's card in /api/status. Each event carries the
 * wall-clock time it is recorded (nl_http_publish stamps it): a training
 * report when the coordinator's loop sends it (nl_coord_observe calls us
 * then), a join, a death or a new plan when the poller sees it in a
 * status (within POLL_MS). The dashboard shows these times, not the time
 * a browser happened to read the feed. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/coord_http_impl.h"

/* Real numbers in events: enough digits for a loss, not sixteen. */
#define EVENT_DIGITS 7

void coord_http_publish(nl_coord_http *h, const char *type, json_t *o)
{
    char *s = o ? json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(EVENT_DIGITS)) : NULL;
    json_decref(o);
    if (s && h->http)
        nl_http_publish(h->http, type, s);
    free(s);
}

const char *coord_http_node_state(json_t *n)
{
    const char *s = json_string_value(json_object_get(n, "state"));
    return s ? s : "?";
}

/* ---------------------------------------------------------------- status changes */

static void diff_nodes(nl_coord_http *h, json_t *nodes)
{
    json_t *n;
    size_t i;
    json_array_foreach(nodes, i, n)
    {
        int64_t id = json_integer_value(json_object_get(n, "id"));
        const char *state = coord_http_node_state(n);
        seen_node *s = NULL;
        for (int k = 0; k < h->nseen; k++)
            if (h->seen[k].id == id)
                s = &h->seen[k];
        if (!s && h->nseen < MAX_NODES) {
            s = &h->seen[h->nseen++];
            s->id = id;
            s->state[0] = '\0';
            char name[32];
            snprintf(name, sizeof name, "node-%lld", (long long)id);
            coord_http_publish(h, "join",
                               json_pack("{s:s,s:I,s:O,s:O}", "node", name, "id", (json_int_t)id,
                                         "device", json_object_get(n, "device"), "memory",
                                         json_object_get(n, "memory")));
        }
        if (s && strcmp(s->state, state) != 0) {
            const char *type = strcmp(state, "dead") == 0   ? "death"
                               : strcmp(state, "left") == 0 ? "leave"
                                                            : "node";
            if (s->state[0] || strcmp(type, "node") != 0)
                coord_http_publish(h, type,
                                   json_pack("{s:I,s:s,s:s}", "id", (json_int_t)id, "state", state,
                                             "was", s->state[0] ? s->state : "new"));
            snprintf(s->state, sizeof s->state, "%s", state);
        }
    }
}

void coord_http_diff(nl_coord_http *h, json_t *st)
{
    json_t *nodes = json_object_get(st, "nodes");
    diff_nodes(h, nodes);
    int64_t epoch = json_integer_value(json_object_get(st, "plan_epoch"));
    if (epoch != h->epoch) {
        /* the stages in pipeline order; during training, the step it came
         * at (the loss chart marks it) */
        json_t *o = json_pack("{s:I,s:o}", "epoch", (json_int_t)epoch, "stages",
                              coord_http_pipeline(nodes));
        pthread_mutex_lock(&h->mu);
        if (o && h->epoch >= 0 && h->train.job && strcmp(h->train.state, "running") == 0) {
            char what[64];
            snprintf(what, sizeof what, "plan %lld", (long long)epoch);
            coord_http_mark(&h->train, h->train.step, "replan", what);
            json_object_set_new(o, "job", json_integer((json_int_t)h->train.job));
            json_object_set_new(o, "step", json_integer((json_int_t)h->train.step));
        }
        pthread_mutex_unlock(&h->mu);
        coord_http_publish(h, "plan", o);
        h->epoch = epoch;
    }
    const char *cs = json_string_value(json_object_get(st, "state"));
    if (cs && strcmp(cs, h->state) != 0) {
        coord_http_publish(h, "cluster", json_pack("{s:s}", "state", cs));
        snprintf(h->state, sizeof h->state, "%s", cs);
    }
}

/* ---------------------------------------------------------------- training reports */

static void curve_add(loss_curve *c, int64_t step, double loss)
{
    if (c->stride < 1)
        c->stride = 1;
    if (c->offered++ % c->stride != 0)
        return;
    if (c->n == CURVE_POINTS) { /* thin out: keep every other point */
        for (int i = 0; i < CURVE_POINTS / 2; i++) {
            c->step[i] = c->step[2 * i];
            c->loss[i] = c->loss[2 * i];
        }
        c->n = CURVE_POINTS / 2;
        c->stride *= 2;
    }
    c->step[c->n] = step;
    c->loss[c->n++] = (float)loss;
}

/* A resumed job goes back to its checkpoint: the steps after it are redone. */
static void curve_cut(loss_curve *c, int64_t from)
{
    while (c->n > 0 && c->step[c->n - 1] > from)
        c->n--;
}

void coord_http_mark(train_card *t, int64_t step, const char *kind, const char *what)
{
    if (!t->job || strcmp(t->state, "running") != 0)
        return;
    if (t->n_marks == CARD_MARKS) {
        memmove(t->marks, t->marks + 1, (CARD_MARKS - 1) * sizeof t->marks[0]);
        t->n_marks--;
    }
    card_mark *m = &t->marks[t->n_marks++];
    m->step = step;
    snprintf(m->kind, sizeof m->kind, "%s", kind);
    snprintf(m->what, sizeof m->what, "%s", what);
}

double coord_http_train_eta(const train_card *t, double now)
{
    if (!t->job || strcmp(t->state, "running") != 0 || t->steps <= 0)
        return NAN;
    double per_step = NAN;
    if (t->t_first > 0 && t->step > t->first_step) /* the mean since the (re)start */
        per_step = (t->t_last - t->t_first) / (double)(t->step - t->first_step);
    else if (t->tps > 0 && t->batch > 0 && t->seq > 0) /* one step: its own time */
        per_step = (double)t->batch * (double)t->seq / t->tps;
    if (!isfinite(per_step))
        return NAN;
    const double left = (double)(t->steps - t->step) * per_step - (now - t->t_last);
    return left > 0 ? left : 0.0;
}

static double num_or_nan(json_t *v)
{
    return json_is_number(v) ? json_number_value(v) : NAN;
}

/* A job's start (or its resume after a lost node): a new card, or the
 * same card with the step rate measured again. Under mu. */
static void card_start(train_card *t, uint64_t job, json_t *o, double now)
{
    if (t->job != job) {
        memset(t, 0, sizeof *t);
        t->job = job;
        t->loss = t->eval_loss = t->tps = NAN;
        t->t_start = now;
        nl_http_time_now(t->started, sizeof t->started);
    }
    snprintf(t->state, sizeof t->state, "running");
    t->start_step = json_integer_value(json_object_get(o, "start_step"));
    curve_cut(&t->curve, t->start_step);
    curve_cut(&t->eval_curve, t->start_step);
    t->step = t->start_step;
    t->steps = json_integer_value(json_object_get(o, "steps"));
    t->batch = json_integer_value(json_object_get(o, "batch"));
    t->seq = json_integer_value(json_object_get(o, "seq"));
    t->stages = (int)json_integer_value(json_object_get(o, "stages"));
    const int resumes = (int)json_integer_value(json_object_get(o, "resumes"));
    if (resumes > t->resumes) /* a re-plan at a later checkpoint does not say it again */
        t->resumes = resumes;
    t->t_first = 0;
    t->t_last = now;
}

/* A step's report. Under mu. */
static void card_step(train_card *t, uint64_t job, int64_t step, json_t *o, double now)
{
    if (t->job != job) { /* a job followed from the middle (the HTTP side came later) */
        memset(t, 0, sizeof *t);
        t->job = job;
        t->eval_loss = NAN;
        t->t_start = now;
        nl_http_time_now(t->started, sizeof t->started);
        t->start_step = step - 1;
        snprintf(t->state, sizeof t->state, "running");
    }
    if (t->t_first == 0) {
        t->t_first = now;
        t->first_step = step;
    }
    t->t_last = now;
    t->step = step;
    if (json_integer_value(json_object_get(o, "steps")) > 0)
        t->steps = json_integer_value(json_object_get(o, "steps"));
    t->loss = num_or_nan(json_object_get(o, "loss"));
    t->tps = num_or_nan(json_object_get(o, "tokens_per_s"));
    t->dig_mismatches = json_integer_value(json_object_get(o, "digest_mismatches"));
    t->verified = json_integer_value(json_object_get(o, "verified"));
    t->verify_mismatches = json_integer_value(json_object_get(o, "verify_mismatches"));
    curve_add(&t->curve, step, t->loss);
    if (json_is_number(json_object_get(o, "eval_loss"))) {
        t->eval_loss = json_number_value(json_object_get(o, "eval_loss"));
        t->eval_step = step;
        curve_add(&t->eval_curve, step, t->eval_loss);
    }
}

/* The job's end: done, cancelled or failed (with its message). Under mu. */
static void card_end(train_card *t, const char *state, const char *msg, json_t *o, double now)
{
    snprintf(t->state, sizeof t->state, "%s", state);
    snprintf(t->message, sizeof t->message, "%s", msg ? msg : state);
    if (json_is_integer(json_object_get(o, "step")))
        t->step = json_integer_value(json_object_get(o, "step"));
    t->t_end = now;
}

static const char *str_or(json_t *o, const char *key, const char *dflt)
{
    const char *s = json_string_value(json_object_get(o, key));
    return s ? s : dflt;
}

/* A growth, a lost stage or a rollback, marked on the curve. Under mu. */
static void mark_report(train_card *t, const char *ev, json_t *o)
{
    char what[192];
    if (strcmp(ev, "grow") == 0) {
        snprintf(what, sizeof what, "the model grew (%s)", str_or(o, "kind", "?"));
        coord_http_mark(t, json_integer_value(json_object_get(o, "step")), "grow", what);
        return;
    }
    if (strcmp(ev, "rollback") == 0) {
        snprintf(what, sizeof what, "a node was convicted: rolled back to step %lld",
                 (long long)json_integer_value(json_object_get(o, "to_step")));
        coord_http_mark(t, json_integer_value(json_object_get(o, "from_step")), "rollback", what);
        return;
    }
    snprintf(what, sizeof what, "a stage was lost (%s); resumed from step %lld",
             str_or(o, "why", "?"),
             (long long)json_integer_value(json_object_get(o, "resume_step")));
    coord_http_mark(t, json_integer_value(json_object_get(o, "lost_step")), "lost", what);
}

void coord_http_on_report(void *ctx, uint64_t job, int state, const char *msg, const char *json)
{
    nl_coord_http *h = ctx;
    json_t *o = json ? json_loads(json, 0, NULL) : NULL;
    const char *ev = json_string_value(json_object_get(o, "event"));
    const double now = nl_mono_s();
    if (!ev) { /* a failed training job says why in its message alone */
        pthread_mutex_lock(&h->mu);
        const int ours = h->train.job == job && job != 0 && state == NL_JOB_FAILED &&
                         strcmp(h->train.state, "running") == 0;
        if (ours)
            card_end(&h->train, "failed", msg, NULL, now);
        pthread_mutex_unlock(&h->mu);
        if (ours)
            coord_http_publish(
                h, "train_failed",
                json_pack("{s:I,s:s}", "job", (json_int_t)job, "message", msg ? msg : "failed"));
        json_decref(o);
        return;
    }
    const int64_t step = json_integer_value(json_object_get(o, "step"));
    pthread_mutex_lock(&h->mu);
    if (strcmp(ev, "start") == 0)
        card_start(&h->train, job, o, now);
    else if (strcmp(ev, "step") == 0)
        card_step(&h->train, job, step, o, now);
    else if (h->train.job == job && (strcmp(ev, "done") == 0 || strcmp(ev, "cancelled") == 0))
        card_end(&h->train, ev, msg, o, now);
    else if (strcmp(ev, "grow") == 0 || strcmp(ev, "node_lost") == 0 || strcmp(ev, "rollback") == 0)
        mark_report(&h->train, ev, o);
    pthread_mutex_unlock(&h->mu);
    if (strcmp(ev, "step") == 0) {
        json_t *loss = json_object_get(o, "loss"), *eval = json_object_get(o, "eval_loss");
        /* a small model steps hundreds of times a second: a step event at
         * most every STEP_EVENT_S (and at an evaluation, and the last
         * step) keeps the feed's history for what else happens */
        const int last = step >= json_integer_value(json_object_get(o, "steps"));
        if (now - h->step_published >= STEP_EVENT_S || json_is_number(eval) || last) {
            h->step_published = now;
            coord_http_publish(h, "train_step",
                               json_pack("{s:I,s:I,s:O?,s:O,s:O?}", "job", (json_int_t)job, "step",
                                         (json_int_t)step, "steps", json_object_get(o, "steps"),
                                         "loss", loss ? loss : json_null(), "tokens_per_s",
                                         json_object_get(o, "tokens_per_s")));
        }
        if (json_is_number(eval))
            coord_http_publish(h, "eval",
                               json_pack("{s:I,s:I,s:O}", "job", (json_int_t)job, "step",
                                         (json_int_t)step, "loss", eval));
    } else {
        char type[64]; /* a training job's, but a generation's own (generation_suspect) */
        snprintf(type, sizeof type, "%s%s", strncmp(ev, "generation_", 11) ? "train_" : "", ev);
        json_object_set_new(o, "job", json_integer((json_int_t)job));
        coord_http_publish(h, type, json_incref(o));
    }
    json_decref(o);
}
