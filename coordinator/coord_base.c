/* The coordinator's helpers, used by the loop (coord.c), the jobs'
 * dispatch (coord_jobs.c) and every job kind: time, state, the weights'
 * source, and the jobs' sends and failures (the node table is
 * coord_nodes.c). They call
 * no job code but through a job's operations table (coord_impl.h). */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"
#include "core/grow/grow.h"

void coord_set_state(nl_coord *c, const char *fmt, ...)
{
    char buf[sizeof c->state];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (strcmp(buf, c->state) != 0) {
        memcpy(c->state, buf, sizeof buf);
        NL_INFO("state: %s", c->state);
    }
}

/* ---------------------------------------------------------------- the source */

static void free_source(csource *src)
{
    for (int i = 0; i < src->n; i++)
        nl_st_close(&src->files[i]);
    free(src->files);
    free(src->own);
    free(src);
}

int coord_source_owns(const csource *src, int file, const char *name)
{
    if (!src->own) /* one checkpoint: every tensor in it is the model's */
        return 1;
    const cown *o = &src->own[file];
    int l = -1, used = 0;
    if (strncmp(name, "optim.m.", 8) == 0 || strncmp(name, "optim.v.", 8) == 0)
        name += 8;
    if (strcmp(name, "tok_embeddings.weight") == 0)
        return o->embed;
    if (strcmp(name, "norm.weight") == 0 || strcmp(name, "lm_head.weight") == 0)
        return o->head;
    if (sscanf(name, "layers.%d.%n", &l, &used) == 1 && used > 0)
        return l >= o->l0 && l < o->l1;
    return 1;
}

void coord_reap_sources(nl_coord *c, int force)
{
    for (csource **p = &c->retired; *p;) {
        csource *r = *p;
        if (force || nl_txref_idle(&r->ref)) {
            *p = r->next;
            free_source(r);
        } else {
            p = &r->next;
        }
    }
}

void coord_close_source(nl_coord *c)
{
    if (c->src) {
        c->src->next = c->retired;
        c->retired = c->src;
        c->src = NULL;
    }
    coord_reap_sources(c, 0);
    c->src_manifest = 0;
    c->src_step = c->src_adam = 0;
    c->resumable = 0;
    c->src_continues = 0;
    c->src_job = 0;
    c->src_path[0] = '\0';
}

csource *coord_source_new(int n)
{
    csource *src = calloc(1, sizeof *src);
    if (src && !(src->files = calloc((size_t)n, sizeof *src->files))) {
        free(src);
        return NULL;
    }
    if (src)
        src->n = n;
    return src;
}

void coord_manifest_release(cmanifest *m)
{
    if (m->src)
        free_source(m->src);
    free(m->tok);
    free(m->seed);
    free(m->chat);
    free(m->growth);
    memset(m, 0, sizeof *m);
}

nl_status coord_manifest_open(cmanifest *out, const char *path, const char *root, nl_error *err)
{
    nl_manifest *m = NULL;
    memset(out, 0, sizeof *out);
    nl_status st = nl_manifest_load(&m, path, err);
    /* a shard is a plain name beside the manifest; under a root it must
     * not be a link that leads out, nor anything but a regular file */
    for (int i = 0; st == NL_OK && root && i < m->n_shards; i++) {
        char real[PATH_MAX];
        const char *bad =
            coord_confine_file(root, m->shards[i].path, NULL, UINT64_MAX, real, sizeof real);
        if (bad)
            st = nl_error_set(err, NL_ERR_AUTH, "shard %s (stage %d): %s", m->shards[i].file, i,
                              bad);
    }
    if (st == NL_OK && (!(out->src = coord_source_new(m->n_shards)) ||
                        !(out->src->own = calloc((size_t)m->n_shards, sizeof *out->src->own))))
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    for (int i = 0; st == NL_OK && i < m->n_shards; i++) /* what the plan takes from each */
        out->src->own[i] =
            (cown){m->shards[i].l0, m->shards[i].l1, m->shards[i].has_embed, m->shards[i].has_head};
    /* each shard read whole, hashed, and served from that very copy: what
     * was verified is what the stages get (a file changed since cannot be) */
    if (st == NL_OK)
        st = nl_manifest_open_shards(m, out->src->files, err);
    if (st == NL_OK && ((m->tokenizer && !(out->tok = strdup(m->tokenizer))) ||
                        (m->init_seed && !(out->seed = strdup(m->init_seed))) ||
                        (m->chat_template && !(out->chat = strdup(m->chat_template)))))
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if (st == NL_OK && m->n_growth > 0) { /* its growth history goes on in later manifests */
        if (!(out->growth = malloc((size_t)m->n_growth * sizeof *out->growth)))
            st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        else
            memcpy(out->growth, m->growth, (size_t)m->n_growth * sizeof *out->growth);
        out->n_growth = st == NL_OK ? m->n_growth : 0;
    }
    if (st == NL_OK) {
        out->cfg = m->cfg;
        out->step = m->step;
        out->adam = m->adam_steps;
        snprintf(out->path, sizeof out->path, "%s", path);
    }
    nl_manifest_destroy(&m);
    if (st != NL_OK) {
        coord_manifest_release(out);
        return nl_error_prefix(err, "manifest %s", path);
    }
    return NL_OK;
}

void coord_manifest_install(nl_coord *c, cmanifest *m, int reload)
{
    coord_close_source(c);
    c->src = m->src;
    c->src_manifest = 1;
    c->src_step = m->step;
    c->src_adam = m->adam;
    snprintf(c->src_path, sizeof c->src_path, "%s", m->path);
    free(c->tok_text);
    free(c->init_seed);
    free(c->chat_text);
    free(c->growth);
    c->tok_text = m->tok;
    c->init_seed = m->seed;
    c->chat_text = m->chat;
    c->growth = m->growth;
    c->n_growth = m->n_growth;
    c->cfg = m->cfg;
    c->have_cfg = 1;
    NL_INFO("source: %s, step %lld, %d shards (verified)", m->path, (long long)m->step, c->src->n);
    memset(m, 0, sizeof *m);
    if (reload) {
        coord_drop_plan(c);
        coord_set_state(c, "reloading from %s", c->src_path);
    }
}

nl_status coord_use_manifest(nl_coord *c, const char *path, int reload, nl_error *err)
{
    cmanifest m;
    nl_status st = coord_manifest_open(&m, path, NULL, err); /* the operator's */
    if (st == NL_OK)
        coord_manifest_install(c, &m, reload);
    return st;
}

void coord_reload(nl_coord *c)
{
    if (!c->plan)
        return;
    coord_drop_plan(c);
    coord_set_state(c, "reloading from %s", c->src_path[0] ? c->src_path : "the seed");
}

void coord_drop_plan(nl_coord *c)
{
    nl_plan_destroy(&c->plan);
    c->ready = 0;
    c->epoch++;
    c->last_plan_try = 0;
    for (int i = 0; i < c->n_nodes; i++) {
        c->nodes[i].stage = -1;
        c->nodes[i].loaded = 0;
    }
}

/* ---------------------------------------------------------------- jobs */

nl_status coord_send_client(nl_coord *c, const uint8_t *rid, size_t rid_len, nl_wire_msg *m)
{
    nl_error e = {0};
    const int type = m->type;
    nl_status st = nl_sock_send_nowait(c->cli, rid, rid_len, m, &e);
    if (st == NL_OK)
        return st;
    c->client_drops++;
    const double now = nl_mono_s();
    if (now - c->drop_logged >= 1.0) {
        NL_WARN("%s to a client dropped (%s); %llu dropped so far: a client that does not read "
                "loses its replies, and stalls no one",
                nl_wire_type_name(type), e.msg, (unsigned long long)c->client_drops);
        c->drop_logged = now;
    }
    return st;
}

void coord_status_to(nl_coord *c, const uint8_t *rid, size_t rid_len, uint64_t job, int state,
                     double progress, const char *msg, const char *json)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
    m.u.job_status = (nl_msg_job_status){job, (uint32_t)state, progress, msg, 0};
    if (json) {
        const int64_t len = (int64_t)strlen(json);
        nl_wire_frame_set(&m.frames[0], json, NL_DTYPE_U8, &len, 1);
        m.nframes = 1;
    }
    if (rid_len > 0) /* 0: a job recovered from the journal that no client follows yet */
        coord_send_client(c, rid, rid_len, &m);
    nl_wire_msg_free(&m);
    if (c->observe)
        c->observe(c->observe_ctx, job, state, msg, json);
}

void coord_close_session(nl_coord *c, cjob *j)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    for (int s = 0; c->plan && j->epoch == c->epoch && s < c->plan->n_stages; s++) {
        cnode *n = coord_stage_node(c, s);
        if (!n)
            continue;
        nl_wire_msg_reset(&m, NL_MSG_JOB_CANCEL);
        m.u.job_ref.job_id = j->id;
        coord_send_node(c, n, &m);
    }
    nl_wire_msg_free(&m);
}

void coord_job_fail(nl_coord *c, cjob *j, const char *why)
{
    char text[1024];
    snprintf(text, sizeof text, "%s", why);
    if (j->ops->fail_note)
        j->ops->fail_note(j, text + strlen(text), sizeof text - strlen(text));
    NL_WARN("job %llu failed: %s", (unsigned long long)j->id, text);
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_FAILED, 0.0, text, NULL);
    if (j->ops->abort)
        j->ops->abort(c, j);
    coord_job_free(j);
}

nl_status coord_send_tokens(nl_coord *c, cjob *j, uint64_t session, uint64_t pos,
                            const int32_t *ids, int B, int T)
{
    cnode *first = coord_stage_node(c, 0);
    if (!first)
        return NL_ERR_STATE;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_ACTIVATION);
    m.u.hop = (nl_msg_tensor_hop){j->id, 0, 0, session, pos, 0.0};
    const int64_t shape[2] = {B, T};
    nl_wire_frame_set(&m.frames[0], ids, NL_DTYPE_I32, shape, 2); /* copied by the send */
    m.nframes = 1;
    nl_status st = coord_send_node(c, first, &m);
    nl_wire_msg_free(&m);
    return st;
}

void coord_fail_unreachable_first(nl_coord *c, cjob *j)
{
    cnode *first = coord_stage_node(c, 0);
    char why[1000];
    snprintf(why, sizeof why, "node %u (stage 0, %s) %s", first ? first->id : 0,
             first ? first->endpoint : "?", first ? first->why : "is gone");
    coord_job_fail(c, j, why);
}

const nl_wire_param *coord_param(const nl_msg_job_submit *s, const char *key)
{
    for (uint32_t i = 0; i < s->nparams; i++)
        if (strcmp(s->params[i].key, key) == 0)
            return &s->params[i];
    return NULL;
}

const char *coord_check_tokens(const nl_coord *c, const nl_rx *rx, int *B, int *T)
{
    if (rx->msg.nframes != 1)
        return "a job needs one frame of token ids";
    const nl_tensor *t = &rx->msg.frames[0].t;
    if (t->dtype != NL_DTYPE_I32 || t->ndim != 2 || t->shape[0] < 1 || t->shape[1] < 1)
        return "token ids must be I32 [B, T]";
    if (t->shape[0] * t->shape[1] > COORD_MAX_TOKENS)
        return "too many tokens in one job";
    if (t->shape[1] > c->cfg.max_seq_len)
        return "more positions than max_seq_len";
    const int32_t *ids = t->data;
    for (int64_t i = 0; i < t->shape[0] * t->shape[1]; i++) {
        int32_t v;
        memcpy(&v, ids + i, sizeof v);
        if (v < 0 || v >= c->cfg.vocab_size)
            return "a token id is outside the model's vocabulary";
    }
    *B = (int)t->shape[0];
    *T = (int)t->shape[1];
    return NULL;
}

bool coord_from_last_stage(nl_coord *c, const nl_rx *rx)
{
    const cnode *last = c->plan ? coord_stage_node(c, c->plan->n_stages - 1) : NULL;
    return last && last->rid_len == rx->rid_len && memcmp(last->rid, rx->rid, rx->rid_len) == 0;
}

/* ---------------------------------------------------------------- paths */

/* Whether path (absolute, already joined) lies lexically under root and
 * has no "." or ".." component. */
static bool lexically_under(const char *root, const char *path)
{
    const size_t rl = strlen(root);
    if (path[0] != '/')
        return false;
    if (strcmp(root, "/") != 0 &&
        (strncmp(path, root, rl) != 0 || (path[rl] != '\0' && path[rl] != '/')))
        return false;
    for (const char *p = path; *p;) {
        while (*p == '/')
            p++;
        const char *e = p;
        while (*e && *e != '/')
            e++;
        if ((e - p == 1 && p[0] == '.') || (e - p == 2 && p[0] == '.' && p[1] == '.'))
            return false;
        p = e;
    }
    return true;
}

const char *coord_join_path(const char *root, const char *path, char *out, size_t cap)
{
    int n = path[0] == '/' ? snprintf(out, cap, "%s", path)
                           : snprintf(out, cap, "%s%s%s", root,
                                      root[strlen(root) - 1] == '/' ? "" : "/", path);
    if (n < 0 || (size_t)n >= cap)
        return "the path is too long";
    if (!lexically_under(root, out))
        return "must lie under the root the operator configured, without '.' or '..' components";
    return NULL;
}

/* Whether a resolved path lies under the resolved root. */
static bool under(const char *root, const char *real)
{
    const size_t rl = strlen(root);
    return strcmp(root, "/") == 0 ||
           (strncmp(real, root, rl) == 0 && (real[rl] == '\0' || real[rl] == '/'));
}

const char *coord_confine_file(const char *root, const char *path, const char *dir_file,
                               uint64_t max_bytes, char *out, size_t cap)
{
    char joined[PATH_MAX], real[PATH_MAX];
    const char *bad = coord_join_path(root, path, joined, sizeof joined);
    if (bad)
        return bad;
    struct stat sb;
    for (int pass = 0; pass < 2; pass++) {
        /* no message says more than "not there" about what is behind a link */
        if (!realpath(joined, real))
            return errno == ENOENT ? "no such file under the root" : "cannot be resolved";
        if (!under(root, real))
            return "leads outside the root (a symbolic link)";
        if (stat(real, &sb) != 0)
            return "cannot be read";
        if (pass == 0 && S_ISDIR(sb.st_mode) && dir_file) {
            int n = snprintf(joined, sizeof joined, "%s/%s", real, dir_file);
            if (n < 0 || (size_t)n >= sizeof joined)
                return "the path is too long";
            continue;
        }
        break;
    }
    if (!S_ISREG(sb.st_mode))
        return "not a regular file (a FIFO, device or directory is refused)";
    if ((uint64_t)sb.st_size > max_bytes)
        return "larger than the coordinator accepts (--max-data-bytes)";
    if (strlen(real) >= cap)
        return "the path is too long";
    memcpy(out, real, strlen(real) + 1);
    return NULL;
}

void coord_finish_with_result(nl_coord *c, cjob *j, const nl_rx *rx)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_RESULT);
    m.u.hop = rx->msg.u.hop;
    m.frames[0] = rx->msg.frames[0];
    m.frames[0].free_fn = NULL; /* copied by the send */
    m.nframes = 1;
    coord_send_client(c, j->rid, j->rid_len, &m);
    nl_wire_msg_free(&m);
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_DONE, 1.0, "done", NULL);
    coord_job_free(j);
}
