/* A verifier's part of verification by recompute (stage_verify.h): the
 * cases a node is sent to redo (VERIFY_CASE), what it keeps between them,
 * and the thread they run on.
 *
 * What it keeps: the stage's layers and a trainer of one slot built on
 * the verifier's backend, and the weights loaded into them, for up to
 * VERIFY_KEEP stages it checks (the least recently used goes first). A
 * case uses a build kept for the same job, stage, layers, embedding and
 * head, microbatch shape and model config; its weights are loaded again
 * unless they are those the build holds: by the name the coordinator
 * gave them (VERIFY_CASE weights: 32 random bytes for each stage's
 * weights of a step), or, for a case that names none, by their BLAKE2b
 * digest (the cases of one step of one stage share them, a later step's
 * differ): a case is never redone on weights other than its own. A case
 * that comes without weights (the coordinator sent them with an earlier
 * case of the same stage and step) names them and is redone on the build
 * that holds those; with none, it is answered with want_weights, and the
 * coordinator sends it again with them.
 * A case of another job drops the builds of every other; so do a new
 * plan (ASSIGN) and the end of the node's own training job, through
 * nl_stage_verify_forget: at once when no case is under way, else on the
 * worker before its next case (never waiting for a case that runs at
 * the lowest priority).
 *
 * Where it runs: with a backend of its own (nl_stage_opts.verify_be, the
 * node's), on a worker thread (one lane of replica_workers.h) at the
 * lowest priority (nice 19), so the node's thread goes on serving its own
 * stage's hops and takes the answers back from nl_stage_verify_pop. The
 * recompute computes with the backend's threads (the node makes it one);
 * being the lowest priority it takes a core only when the node's stage
 * (and everything else on the machine) leaves it one: on a node of one
 * thread it runs in its stage's waits. Without one, on replica 0's
 * backend on the caller's thread, once the stage's lanes are idle (the
 * tests' way, and the CUDA node's for now). */
#include <pthread.h>
#include <sched.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/log.h"
#include "node/replica_workers.h"
#include "node/stage_impl.h"
#include "node/stage_train_impl.h"
#include "node/stage_verify_impl.h"

#define VERIFY_KEEP 4 /* stages' builds kept (a node checks the other stages of a pipeline) */

/* ===================== a case off the wire ===================== */

/* The case a VERIFY_CASE describes, checked against its config: cfg is
 * filled from config_json. Frames received need not be aligned for their
 * element type: all of them are copied into one buffer (c->weights, at
 * its start, owns it), each at an aligned offset, and the case points
 * there. */
static nl_status case_of(const nl_wire_msg *m, nl_config *cfg, nl_verify_case *c, nl_error *err)
{
    const nl_msg_verify_case *v = &m->u.verify_case;
    *c = (nl_verify_case){0};
    nl_status st = nl_config_from_json(cfg, v->config_json, err);
    if (st == NL_OK)
        st = nl_config_validate(cfg, 1, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "VERIFY_CASE config_json");
    const int64_t B = v->batch, T = v->seq, d = cfg->hidden_dim;
    if (v->layer1 > (uint32_t)cfg->num_layers || v->microbatch >= v->microbatches)
        return nl_error_set(err, NL_ERR_RANGE,
                            "VERIFY_CASE: layers [%u, %u) of %d, microbatch %u of %u", v->layer0,
                            v->layer1, cfg->num_layers, v->microbatch, v->microbatches);
    /* frame indices: 0 weights, 1 input, [dy], [counts], extras, [y], [dx] */
    const int fx = 1, fdy = v->has_head ? -1 : 2, fc = v->counts ? 2 + !v->has_head : -1;
    int fe[4], f = 2 + !v->has_head + v->counts;
    for (int i = 0; i < 4; i++)
        fe[i] = v->extras & (1u << i) ? f++ : -1;
    const int fy = v->outputs && !v->has_head ? f++ : -1,
              fdx = v->outputs && !v->has_embed ? f++ : -1;
    for (int i = 0; i < 2; i++) {
        const int fo = i ? fdx : fy;
        const nl_tensor *o = fo >= 0 ? &m->frames[fo].t : NULL;
        if (o && (o->shape[0] != B || o->shape[1] != T || o->shape[2] != d))
            return nl_error_set(
                err, NL_ERR_SHAPE, "VERIFY_CASE: the stage's %s is not [%lld, %lld, %lld]",
                i ? "GRADIENT" : "ACTIVATION", (long long)B, (long long)T, (long long)d);
    }
    const nl_tensor *x = &m->frames[fx].t;
    bool ok = x->shape[0] == B && x->shape[1] == T && (v->has_embed || x->shape[2] == d);
    if (fdy >= 0) {
        const nl_tensor *dy = &m->frames[fdy].t;
        ok = ok && dy->shape[0] == B && dy->shape[1] == T && dy->shape[2] == d;
    }
    if (fc >= 0)
        ok = ok && m->frames[fc].t.shape[0] == (int64_t)(v->layer1 - v->layer0) &&
             m->frames[fc].t.shape[1] == cfg->num_experts;
    for (int i = 0; i < 4; i++)
        ok = ok && (fe[i] < 0 || (m->frames[fe[i]].t.shape[0] == B &&
                                  (i >= 2 || m->frames[fe[i]].t.shape[1] == T)));
    if (!ok)
        return nl_error_set(err, NL_ERR_SHAPE,
                            "VERIFY_CASE: a frame does not fit microbatches of %lld x %lld with "
                            "hidden size %lld",
                            (long long)B, (long long)T, (long long)d);
    /* hidden states in bf16 (the wire's) are widened to FP32, exactly */
    size_t off[NL_WIRE_MAX_FRAMES], total = 0;
    const size_t hidden = (size_t)(B * T * d);
    bool bf16 = false;
    if (m->frames[0].t.shape[0] == 0 && !(v->weights && v->weights[0]))
        return nl_error_set(err, NL_ERR_PROTO,
                            "VERIFY_CASE: no weights, and no name of weights held");
    for (int i = 0; i < m->nframes; i++) {
        const bool w = m->frames[i].t.dtype == NL_DTYPE_BF16;
        bf16 |= w;
        off[i] = total;
        total += ((w ? hidden * sizeof(float) : m->frames[i].len) + 63) & ~(size_t)63;
    }
    uint8_t *buf = malloc(total ? total : 1);
    if (!buf)
        return nl_error_set(err, NL_ERR_NOMEM, "VERIFY_CASE: out of memory");
    for (int i = 0; i < m->nframes; i++) {
        if (m->frames[i].t.dtype == NL_DTYPE_BF16)
            nl_wire_frame_widen(&m->frames[i], (float *)(void *)(buf + off[i]), hidden);
        else if (m->frames[i].len > 0)
            memcpy(buf + off[i], m->frames[i].t.data, m->frames[i].len);
    }
#define AT(i, T) ((i) >= 0 ? (const T *)(const void *)(buf + off[(i)]) : NULL)
    *c = (nl_verify_case){.cfg = cfg,
                          .l0 = (int)v->layer0,
                          .l1 = (int)v->layer1,
                          .has_embed = v->has_embed,
                          .has_head = v->has_head,
                          .stage = v->stage,
                          .job = v->job_id,
                          .step = v->step,
                          .mb = v->microbatch,
                          .mbB = (int)B,
                          .T = (int)T,
                          .M = (int)v->microbatches,
                          .weights = (float *)(void *)buf,
                          .n_weights = (size_t)m->frames[0].t.shape[0],
                          .x = buf + off[fx],
                          .targets = AT(fe[0], int32_t),
                          .docs = AT(fe[1], int32_t),
                          .labels = AT(fe[2], int32_t),
                          .lengths = AT(fe[3], int32_t),
                          .loss_rows = v->loss_rows,
                          .dy = AT(fdy, float),
                          .counts = AT(fc, int64_t),
                          .y = AT(fy, float),
                          .dx = AT(fdx, float),
                          .bf16 = bf16};
#undef AT
    return NL_OK;
}

/* ===================== what a verifier keeps ===================== */

typedef struct kept_build {
    verify_redo r; /* r.m: in use */
    uint64_t job;
    uint32_t stage;
    int l0, l1, mbB, T;
    bool embed, head;
    char *cfg_json;
    uint8_t wdig[NL_HOP_DIGEST_BYTES]; /* the weights loaded: their name (or digest) */
    bool loaded;
    uint64_t used; /* the verifier's clock when last used */
} kept_build;

/* A case taken, on its way through the worker. */
typedef struct vjob {
    nl_wjob w; /* first: the worker hands this back */
    nl_config cfg;
    char *cfg_json;
    nl_verify_case c; /* c.cfg is &cfg; c.weights owns the frames' copy */
    nl_msg_verify_case hdr;
    uint8_t named[NL_HOP_DIGEST_BYTES]; /* the weights' name the case gives (hdr.weights) */
    bool has_named;
    bool want; /* it came without weights, and none held are those it names */
    uint8_t fwd[NL_HOP_DIGEST_BYTES], bwd[NL_HOP_DIGEST_BYTES];
    double rel;
    nl_status st;
    nl_error err;
    struct vjob *prev, *next; /* the cases pushed and not popped (the node's thread's) */
} vjob;

typedef struct verifier {
    nl_backend *be; /* borrowed */
    nl_workers *w;
    bool niced; /* the worker thread has lowered its priority */
    kept_build kept[VERIFY_KEEP];
    uint64_t clock;
    atomic_uint_least64_t cases, builds, loads, held, wanted;
    atomic_bool forget; /* drop what is kept before the next case */
    vjob *out;          /* pushed, not popped */
} verifier;

static void kept_free(kept_build *k)
{
    verify_redo_free(&k->r);
    free(k->cfg_json);
    *k = (kept_build){0};
}

static bool kept_fits(const kept_build *k, const vjob *j)
{
    const nl_verify_case *c = &j->c;
    return k->r.m && k->job == c->job && k->stage == c->stage && k->l0 == c->l0 && k->l1 == c->l1 &&
           k->embed == c->has_embed && k->head == c->has_head && k->mbB == c->mbB && k->T == c->T &&
           strcmp(k->cfg_json, j->cfg_json) == 0;
}

/* The build for j's case: one kept (its weights loaded again unless
 * they are the case's), or a new one in the least recently used place.
 * A case without weights takes only a build that holds those it names:
 * none, and *out is NULL (j->want). */
static nl_status kept_for(verifier *v, vjob *j, kept_build **out, nl_error *err)
{
    const nl_verify_case *c = &j->c;
    const bool bare = c->n_weights == 0;
    uint8_t dig[NL_HOP_DIGEST_BYTES]; /* what the weights are known by */
    *out = NULL;
    if (j->has_named)
        memcpy(dig, j->named, sizeof dig);
    else /* a case that names none (not the coordinator's): their digest */
        crypto_generichash(dig, sizeof dig, (const uint8_t *)c->weights,
                           c->n_weights * sizeof(float), NULL, 0);
    kept_build *k = NULL, *lru = &v->kept[0];
    for (int i = 0; i < VERIFY_KEEP && !k; i++) {
        kept_build *e = &v->kept[i];
        if (e->r.m && e->job != c->job) /* another job's: never again */
            kept_free(e);
        if (kept_fits(e, j) && (!bare || (e->loaded && memcmp(e->wdig, dig, sizeof dig) == 0)))
            k = e;
        else if (!e->r.m || (lru->r.m && e->used < lru->used))
            lru = e;
    }
    if (!k && bare) { /* sent with an earlier case, and dropped since */
        j->want = true;
        atomic_fetch_add(&v->wanted, 1);
        return NL_OK;
    }
    if (!k) {
        k = lru;
        kept_free(k);
        k->r.be = v->be;
        nl_status st = verify_redo_make(&k->r, c, err);
        if (st == NL_OK && !(k->cfg_json = strdup(j->cfg_json)))
            st = nl_error_set(err, NL_ERR_NOMEM, "verify: out of memory");
        if (st != NL_OK) {
            kept_free(k);
            return st;
        }
        k->job = c->job;
        k->stage = c->stage;
        k->l0 = c->l0;
        k->l1 = c->l1;
        k->embed = c->has_embed;
        k->head = c->has_head;
        k->mbB = c->mbB;
        k->T = c->T;
        atomic_fetch_add(&v->builds, 1);
        NL_DEBUG("verify: built stage %u (layers [%d, %d)) of job %llu for its cases", c->stage,
                 c->l0, c->l1, (unsigned long long)c->job);
    }
    if (bare) {
        atomic_fetch_add(&v->held, 1);
    } else if (!k->loaded || memcmp(k->wdig, dig, sizeof dig) != 0) {
        verify_redo_load(&k->r, c);
        memcpy(k->wdig, dig, sizeof dig);
        k->loaded = true;
        atomic_fetch_add(&v->loads, 1);
    }
    k->used = ++v->clock;
    *out = k;
    return NL_OK;
}

/* ===================== the worker ===================== */

static void vjob_free(vjob *j)
{
    if (!j)
        return;
    nl_verify_case_free(&j->c);
    free(j->cfg_json);
    free(j);
}

/* The calling thread below the node's: the normal policy (a node started
 * under a real-time one, chrt, leaves it: nice does not apply there) at
 * nice 19 (Linux: a thread's own nice value). Failing, it keeps its
 * priority: a verifier then competes with its stage as a second thread. */
static void lowest_priority(void)
{
    int policy = SCHED_OTHER;
    struct sched_param sp = {0};
    if (pthread_getschedparam(pthread_self(), &policy, &sp) == 0 &&
        (policy == SCHED_FIFO || policy == SCHED_RR)) {
        sp.sched_priority = 0;
        if (pthread_setschedparam(pthread_self(), SCHED_OTHER, &sp) != 0)
            NL_WARN("verify: the worker thread keeps its real-time policy");
    }
    if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19) != 0)
        NL_WARN("verify: the worker thread keeps its priority (setpriority failed)");
}

/* Runs on the worker (or, inline, the caller's thread). */
static void run_case(void *ctx, nl_wjob *w)
{
    verifier *v = ctx;
    vjob *j = (vjob *)w;
    if (nl_workers_threaded(v->w) && !v->niced)
        lowest_priority();
    v->niced = true;
    if (atomic_exchange(&v->forget, false))
        for (int i = 0; i < VERIFY_KEEP; i++)
            kept_free(&v->kept[i]);
    kept_build *k = NULL;
    j->st = kept_for(v, j, &k, &j->err);
    if (j->st == NL_OK && k)
        j->st = verify_redo_run(&k->r, &j->c, j->fwd, j->bwd, &j->rel, &j->err);
    else if (j->st != NL_OK)
        nl_error_prefix(&j->err, "verify job %llu step %llu microbatch %u stage %u",
                        (unsigned long long)j->c.job, (unsigned long long)j->c.step, j->c.mb,
                        j->c.stage);
    if (k)
        atomic_fetch_add(&v->cases, 1);
}

static nl_status verifier_new(verifier **out, nl_backend *be, bool threaded, nl_error *err)
{
    verifier *v = calloc(1, sizeof *v);
    if (!v)
        return nl_error_set(err, NL_ERR_NOMEM, "verify: out of memory");
    v->be = be;
    nl_status st = nl_workers_new(&v->w, 1, threaded, run_case, v, err);
    if (st != NL_OK) {
        free(v);
        return st;
    }
    *out = v;
    return NL_OK;
}

void stage_verifier_free(nl_stage *s)
{
    verifier *v = s->verifier;
    if (!v)
        return;
    nl_workers_destroy(&v->w); /* the case running finishes, the queued are dropped */
    while (v->out) {
        vjob *j = v->out;
        v->out = j->next;
        vjob_free(j);
    }
    for (int i = 0; i < VERIFY_KEEP; i++)
        kept_free(&v->kept[i]);
    free(v);
    s->verifier = NULL;
}

void nl_stage_verify_forget(nl_stage *s)
{
    stage_verify_forget(s);
}

void stage_verify_forget(nl_stage *s)
{
    verifier *v = s->verifier;
    if (!v)
        return;
    if (nl_workers_pending(v->w) == 0) /* idle, and only this thread gives it cases */
        for (int i = 0; i < VERIFY_KEEP; i++)
            kept_free(&v->kept[i]);
    else /* a case under way: the worker drops them before its next one */
        atomic_store(&v->forget, true);
}

/* ===================== the stage's face ===================== */

nl_status nl_stage_verify_push(nl_stage *s, const nl_wire_msg *m, nl_error *err)
{
    nl_backend *own = s->o.verify_be;
    if (!s->verifier) {
        nl_status st = verifier_new(&s->verifier, own ? own : s->be, own != NULL, err);
        if (st != NL_OK)
            return st;
    }
    vjob *j = calloc(1, sizeof *j);
    if (!j)
        return nl_error_set(err, NL_ERR_NOMEM, "verify: out of memory");
    nl_status st = case_of(m, &j->cfg, &j->c, err);
    if (st == NL_OK && !(j->cfg_json = strdup(m->u.verify_case.config_json)))
        st = nl_error_set(err, NL_ERR_NOMEM, "verify: out of memory");
    if (st != NL_OK) {
        vjob_free(j);
        return st;
    }
    j->hdr = m->u.verify_case;
    j->hdr.config_json = NULL; /* the message's: gone after this */
    j->hdr.weights = NULL;
    const char *named = m->u.verify_case.weights;
    j->has_named = named && named[0];
    size_t got = 0;
    if (j->has_named &&
        (sodium_hex2bin(j->named, sizeof j->named, named, strlen(named), NULL, &got, NULL) != 0 ||
         got != sizeof j->named)) {
        vjob_free(j);
        return nl_error_set(err, NL_ERR_PROTO, "VERIFY_CASE: weights is not a name in hex");
    }
    if (!own) /* on replica 0's backend: the stage's own lanes leave it first */
        stage_train_quiesce(s);
    j->next = s->verifier->out;
    if (j->next)
        j->next->prev = j;
    s->verifier->out = j;
    nl_workers_push(s->verifier->w, &j->w);
    return NL_OK;
}

int nl_stage_verify_fd(const nl_stage *s)
{
    return s->verifier ? nl_workers_fd(s->verifier->w) : -1;
}

/* The answer of j, a case redone, as a VERIFY_RESULT in out. */
static void answer(nl_stage *s, vjob *j, nl_wire_msg *out, char hex[3][NL_HOP_DIGEST_HEX + 1])
{
    const nl_msg_verify_case *v = &j->hdr;
    const double tol = nl_verify_cross_rtol(&j->c);
    /* the name the case gave its weights, echoed: which case this answers */
    if (j->has_named)
        nl_hop_digest_hex(hex[2], j->named);
    else
        hex[2][0] = 0;
    if (j->want) { /* no digests: the case again, with its weights */
        nl_wire_msg_reset(out, NL_MSG_VERIFY_RESULT);
        out->u.verify_result =
            (nl_msg_verify_result){v->job_id, v->step, v->microbatch, v->stage, "", "", 1, hex[2]};
        return;
    }
    if (v->outputs)
        NL_INFO("verify job %llu step %llu microbatch %u stage %u across device classes: the "
                "largest relative difference is %.3g (tolerance %.0e): %s",
                (unsigned long long)v->job_id, (unsigned long long)v->step, v->microbatch, v->stage,
                j->rel, tol, j->rel <= tol ? "the stage's outputs stand" : "the stage is wrong");
    stage_verify_lie(s, v->job_id, v->step, v->microbatch, v->stage, j->fwd, j->bwd); /* hook */
    nl_hop_digest_hex(hex[0], j->fwd);
    nl_hop_digest_hex(hex[1], j->bwd);
    nl_wire_msg_reset(out, NL_MSG_VERIFY_RESULT);
    out->u.verify_result = (nl_msg_verify_result){v->job_id,
                                                  v->step,
                                                  v->microbatch,
                                                  v->stage,
                                                  v->has_head ? "" : hex[0],
                                                  v->has_embed ? "" : hex[1],
                                                  0,
                                                  hex[2]};
}

int nl_stage_verify_pop(nl_stage *s, bool wait, nl_wire_msg *out,
                        char hex[3][NL_HOP_DIGEST_HEX + 1], nl_status *st, nl_error *err)
{
    verifier *v = s->verifier;
    if (!v)
        return 0;
    if (!wait)
        nl_workers_clear_fd(v->w);
    vjob *j = (vjob *)nl_workers_pop_done(v->w, wait);
    if (!j)
        return 0;
    if (j->prev)
        j->prev->next = j->next;
    else
        v->out = j->next;
    if (j->next)
        j->next->prev = j->prev;
    *st = j->st;
    if (j->st == NL_OK)
        answer(s, j, out, hex);
    else
        *err = j->err;
    vjob_free(j);
    return 1;
}

void nl_stage_verify_stats(const nl_stage *s, nl_verify_stats *out)
{
    const verifier *v = s->verifier;
    *out = (nl_verify_stats){0};
    if (!v)
        return;
    out->cases = atomic_load(&v->cases);
    out->builds = atomic_load(&v->builds);
    out->loads = atomic_load(&v->loads);
    out->held = atomic_load(&v->held);
    out->wanted = atomic_load(&v->wanted);
}

nl_status nl_verify_answer(nl_stage *s, const nl_wire_msg *m, nl_wire_msg *out,
                           char hex[3][NL_HOP_DIGEST_HEX + 1], nl_error *err)
{
    nl_status st = nl_stage_verify_push(s, m, err);
    if (st == NL_OK && !nl_stage_verify_pop(s, true, out, hex, &st, err))
        st = nl_error_set(err, NL_ERR_STATE, "verify: the case has no answer");
    return st;
}
