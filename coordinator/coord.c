/* The coordinator: membership (join, heartbeats, death), sizing and
 * placement through core/sizing and core/planner, streaming each stage's
 * tensors, and the event loop, whose dispatch hands the jobs' messages to
 * coord_jobs.c. */
#include "coord_impl.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "base/log.h"
#include "core/checkpoint.h"
#include "core/fileio.h"
#include "core/sizing.h"

#define CHUNK_FLOATS (1u << 20) /* 4 MiB per LAYER_LOAD frame */
/* The ZAP domains of the nodes' and the clients' sockets */
#define COORD_NODE_DOMAIN "coord"
#define COORD_CLIENT_DOMAIN "coord-client"

void nl_coord_opts_init(nl_coord_opts *o)
{
    memset(o, 0, sizeof *o);
    o->min_nodes = 1;
    o->heartbeat_ms = 1000;
    o->node_timeout_ms = 5000;
    o->job_timeout_ms = 120000;
    o->gen_resumes = 2;
    o->train_resumes = 3;
    o->plan_rows = 512;
    o->replan_margin = 0.1;
    o->max_data_bytes = 1ull << 30;
}

/* ---------------------------------------------------------------- setup */

static nl_status load_model_source(nl_coord *c, nl_error *err)
{
    nl_config_init(&c->base);
    if (c->o.resume)
        return coord_use_manifest(c, c->o.resume, 0, err);
    if (c->o.model) {
        if (!(c->src = coord_source_new(1)))
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        nl_status st = nl_checkpoint_read_config(c->o.model, &c->cfg, &c->src_step, err);
        if (st == NL_OK)
            st = nl_st_open(&c->src->files[0], c->o.model, err);
        if (st == NL_OK)
            st = nl_checkpoint_meta(c->o.model, "tokenizer", &c->tok_text, err);
        if (st == NL_OK)
            st = nl_checkpoint_meta(c->o.model, "init_seed", &c->init_seed, err);
        snprintf(c->src_path, sizeof c->src_path, "%s", c->o.model);
        c->have_cfg = st == NL_OK;
        return st;
    }
    char seed[32];
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)c->o.seed);
    if (!(c->init_seed = strdup(seed)))
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if (c->o.config) {
        nl_status st = nl_config_load_yaml(&c->base, c->o.config, err);
        if (st != NL_OK)
            return st;
        if (c->base.hidden_dim > 0 && c->base.num_layers > 0) {
            c->cfg = c->base;
            c->have_cfg = 1;
            return nl_config_validate(&c->cfg, 1, err);
        }
    }
    nl_config_fill_derived(&c->base);
    return NL_OK; /* sized once nodes have joined */
}

/* The clients' endpoint when --client-listen is not given, derived from
 * --listen so that one endpoint is enough: tcp's port + 1 (* stays *: any
 * free port), an ipc:// or inproc:// name + "-client". */
static nl_status client_endpoint_default(char *out, size_t cap, const char *listen, nl_error *err)
{
    const char *colon = strrchr(listen, ':'), *port = colon ? colon + 1 : "";
    char *end = NULL;
    long p = strtol(port, &end, 10);
    int n = -1;
    if (strncmp(listen, "ipc://", 6) == 0 || strncmp(listen, "inproc://", 9) == 0)
        n = snprintf(out, cap, "%s-client", listen);
    else if (strncmp(listen, "tcp://", 6) == 0 && colon > listen + 5 &&
             (strcmp(port, "*") == 0 || strcmp(port, "0") == 0))
        n = snprintf(out, cap, "%s", listen);
    else if (strncmp(listen, "tcp://", 6) == 0 && colon > listen + 5 && end != port && !*end &&
             p > 0 && p < 65535)
        n = snprintf(out, cap, "%.*s:%ld", (int)(colon - listen), listen, p + 1);
    if (n < 0 || (size_t)n >= cap)
        return nl_error_set(err, NL_ERR_INVALID,
                            "--listen %s: cannot derive the clients' endpoint from it (port + 1); "
                            "give --client-listen",
                            listen);
    return NL_OK;
}

/* Both sockets' ZAP domains watch authorized_keys; each admits only its
 * roles' keys (a client key fails the handshake on the nodes' socket). */
static nl_status setup_domains(nl_coord *c, const char *path, nl_error *err)
{
    static const struct {
        const char *name;
        int roles;
    } doms[] = {{COORD_NODE_DOMAIN, NL_KEY_ROLE_NODE},
                {COORD_CLIENT_DOMAIN, NL_KEY_ROLE_CLIENT | NL_KEY_ROLE_ADMIN}};
    nl_auth *a = nl_net_auth(c->net);
    nl_status st = NL_OK;
    for (size_t i = 0; i < 2 && st == NL_OK; i++) {
        st = nl_auth_set_domain_roles(a, doms[i].name, doms[i].roles, err);
        if (st == NL_OK)
            st = c->o.plaintext ? nl_auth_allow_plaintext(a, doms[i].name, err)
                                : nl_auth_watch_file(a, doms[i].name, path, err);
    }
    return st;
}

/* A ROUTER bound to ep; its bound endpoint (the port chosen) into out. */
static nl_status bind_router(nl_coord *c, nl_sock **s, const char *name, const char *domain,
                             nl_sock_kind kind, const char *ep, char *out, size_t cap,
                             nl_error *err)
{
    nl_sock_opts so = {.type = ZMQ_ROUTER,
                       .keys = &c->keys,
                       .curve_server = true,
                       .zap_domain = domain,
                       .plaintext = c->o.plaintext,
                       .name = name,
                       .hwm = 1000,
                       .linger_ms = 0,
                       .kind = kind};
    nl_status st;
    if ((st = nl_sock_new(s, c->net, &so, err)) != NL_OK ||
        (st = nl_sock_bind(*s, ep, err)) != NL_OK)
        return nl_error_prefix(err, "--%s %s", kind == NL_SOCK_CONTROL ? "client-listen" : "listen",
                               ep);
    snprintf(out, cap, "%s", nl_sock_endpoint(*s));
    return NL_OK;
}

/* Write the one-line file STATE_DIR/name. */
static nl_status write_endpoint(nl_coord *c, const char *name, const char *ep, nl_error *err)
{
    char path[4096], line[300];
    snprintf(path, sizeof path, "%s/%s", c->o.state_dir, name);
    int n = snprintf(line, sizeof line, "%s\n", ep);
    return nl_file_write_atomic(path, line, (size_t)n, err);
}

/* Two sockets (issue 15, finding 8): nodes on --listen, bulk-sized (their
 * RESULTs carry logits), and clients on --client-listen, control-sized,
 * so that a client key can make libzmq buffer at most a control message. */
static nl_status setup_sockets(nl_coord *c, nl_error *err)
{
    char path[4096], client_ep[256];
    bool created = false;
    nl_status st = nl_keys_ensure(c->o.state_dir, &c->keys, &created, err);
    if (st != NL_OK)
        return st;
    if (created)
        NL_INFO("created %s/coordinator.key and coordinator.pub", c->o.state_dir);
    snprintf(path, sizeof path, "%s/authorized_keys", c->o.state_dir);
    struct stat sb;
    if (stat(path, &sb) != 0) {
        const char *text = "# Z85 public keys of the nodes and clients allowed in, one per line, "
                           "each with its role (node, client or admin)\n";
        if ((st = nl_file_write_atomic(path, text, strlen(text), err)) != NL_OK)
            return st;
        NL_WARN("%s was absent: created it empty; no node or client can join until keys are "
                "added (then send SIGHUP)",
                path);
    }
    if (c->o.client_listen &&
        (size_t)snprintf(client_ep, sizeof client_ep, "%s", c->o.client_listen) >= sizeof client_ep)
        return nl_error_set(err, NL_ERR_INVALID, "--client-listen %.300s...: too long",
                            c->o.client_listen);
    if (!c->o.client_listen &&
        (st = client_endpoint_default(client_ep, sizeof client_ep, c->o.listen, err)) != NL_OK)
        return st;
    nl_net_opts no = nl_net_opts_default();
    if ((st = nl_net_new(&c->net, &no, err)) != NL_OK ||
        (st = setup_domains(c, path, err)) != NL_OK ||
        (st = bind_router(c, &c->ctl, "nodes", COORD_NODE_DOMAIN, NL_SOCK_BULK, c->o.listen,
                          c->endpoint, sizeof c->endpoint, err)) != NL_OK ||
        (st = bind_router(c, &c->cli, "clients", COORD_CLIENT_DOMAIN, NL_SOCK_CONTROL, client_ep,
                          c->client_endpoint, sizeof c->client_endpoint, err)) != NL_OK)
        return st;
    /* the clients' first: whoever waits for "endpoint" finds both */
    if ((st = write_endpoint(c, "client_endpoint", c->client_endpoint, err)) != NL_OK)
        return st;
    return write_endpoint(c, "endpoint", c->endpoint, err);
}

/* A root for clients' paths: the operator's, or <state_dir>/name (made
 * 0700), resolved with realpath into out. */
static nl_status setup_root(nl_coord *c, const char *given, const char *name, const char *flag,
                            char *out, size_t cap, nl_error *err)
{
    char path[4096], real[PATH_MAX];
    if (!given) {
        snprintf(path, sizeof path, "%s/%s", c->o.state_dir, name);
        if (mkdir(path, 0700) != 0 && errno != EEXIST)
            return nl_error_set(err, NL_ERR_IO, "%s: %s", path, strerror(errno));
        given = path;
    }
    if (!realpath(given, real))
        return nl_error_set(err, errno == ENOENT ? NL_ERR_NOTFOUND : NL_ERR_IO, "%s %s: %s", flag,
                            given, strerror(errno));
    if (strlen(real) >= cap)
        return nl_error_set(err, NL_ERR_INVALID, "%s %s: too long", flag, real);
    snprintf(out, cap, "%s", real);
    return NL_OK;
}

nl_status nl_coord_new(nl_coord **out, const nl_coord_opts *o, nl_error *err)
{
    *out = NULL;
    nl_coord *c = calloc(1, sizeof *c);
    if (!c)
        return nl_error_set(err, NL_ERR_NOMEM, "coordinator: out of memory");
    c->o = *o;
    nl_status st = load_model_source(c, err);
    if (st == NL_OK)
        st = setup_sockets(c, err);
    if (st == NL_OK)
        st = setup_root(c, o->data_root, "data", "--data-root", c->data_root, sizeof c->data_root,
                        err);
    if (st == NL_OK)
        st = setup_root(c, o->checkpoint_root, "checkpoints", "--checkpoint-root", c->ckpt_root,
                        sizeof c->ckpt_root, err);
    if (st == NL_OK)
        st = coord_work_init(c, err);
    if (st != NL_OK) {
        nl_coord_destroy(&c);
        return st;
    }
    coord_journal_recover(c); /* a training job that ran when it stopped goes on */
    coord_set_state(c, "waiting for nodes (at least %d)", o->min_nodes);
    NL_INFO("listening on %s (nodes) and %s (clients); public key %s", c->endpoint,
            c->client_endpoint, c->keys.public_z85);
    *out = c;
    return NL_OK;
}

void nl_coord_destroy(nl_coord **cp)
{
    if (!cp || !*cp)
        return;
    nl_coord *c = *cp;
    coord_work_shutdown(c);
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        coord_job_free(&c->jobs[i]);
    nl_plan_destroy(&c->plan);
    nl_sock_destroy(&c->ctl);
    nl_sock_destroy(&c->cli);
    nl_net_destroy(&c->net);
    coord_close_source(c);
    coord_reap_sources(c, 1); /* the sockets are gone: nothing points into them */
    coord_nodes_free(c);
    free(c->tok_text);
    free(c->init_seed);
    free(c->growth);
    nl_keys_wipe(&c->keys);
    free(c);
    *cp = NULL;
}

/* ---------------------------------------------------------------- membership */

/* A node is gone (dead or left): fail what it carried (a generation waits
 * to resume) and plan again. */
static void node_lost(nl_coord *c, cnode *n, int life, const char *why)
{
    const int stage = n->stage;
    char msg[512];
    if (stage >= 0 && c->plan) {
        const nl_plan_stage *s = &c->plan->stages[stage];
        snprintf(msg, sizeof msg, "node %u (stage %d, layers [%d, %d), %s) %s", n->id, stage, s->l0,
                 s->l1, n->endpoint, why);
    } else {
        snprintf(msg, sizeof msg, "node %u (standby, %s) %s", n->id, n->endpoint, why);
    }
    NL_WARN("%s", msg);
    coord_node_unlive(c, n, life);
    n->stage = -1;
    if (stage >= 0) {
        coord_jobs_stage_lost(c, msg);
        coord_drop_plan(c);
        coord_set_state(c, "re-planning: %s", msg);
    } else {
        c->replan_wanted = 1; /* a standby: the plan may still be the best */
    }
}

static void on_join(nl_coord *c, const nl_rx *rx)
{
    const nl_msg_join *j = &rx->msg.u.join;
    nl_error e = {0};
    if (!c->o.plaintext && strcmp(j->pubkey, rx->peer) != 0) {
        nl_sock_send_error(c->ctl, rx, NL_ERR_AUTH, NL_MSG_JOIN,
                           "JOIN names a key other than the one this connection authenticated", &e);
        return;
    }
    if (strlen(j->pubkey) > NL_KEY_Z85_LEN) { /* it is indexed whole */
        nl_sock_send_error(c->ctl, rx, NL_ERR_PROTO, NL_MSG_JOIN,
                           "JOIN: the key is longer than a Z85 key", &e);
        return;
    }
    /* the live nodes are unique by key and by routing id (coord_base.c's
     * indexes): the key's old node restarted; a routing id that another
     * connection took over no longer reaches its old node */
    cnode *old = coord_node_by_key(c, j->pubkey);
    if (old)
        node_lost(c, old, NODE_LEFT, "joined again (restarted)");
    if ((old = coord_node_by_rid_raw(c, rx->rid, rx->rid_len)))
        node_lost(c, old, NODE_DEAD,
                  "cannot be reached: another connection took over its routing id");
    cnode *n = coord_node_take(c); /* the table may grow: no cnode * is kept across */
    if (!n) {
        nl_sock_send_error(
            c->ctl, rx, NL_ERR_CAPACITY, NL_MSG_JOIN,
            c->n_live >= COORD_MAX_NODES ? "too many nodes" : "out of memory for another node", &e);
        return;
    }
    n->id = ++c->next_node_id;
    snprintf(n->key, sizeof n->key, "%s", j->pubkey);
    memcpy(n->rid, rx->rid, rx->rid_len);
    n->rid_len = rx->rid_len;
    snprintf(n->device, sizeof n->device, "%s", j->device);
    snprintf(n->endpoint, sizeof n->endpoint, "%s", j->data_endpoint);
    n->memory = j->memory_bytes;
    n->gflops = j->gemm_gflops;
    n->threads = j->threads;
    n->joined = n->last_seen = coord_now();
    coord_node_live(c, n);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_ACCEPT);
    m.u.accept =
        (nl_msg_accept){n->id, (uint32_t)c->o.heartbeat_ms, (uint32_t)c->o.node_timeout_ms};
    if (nl_sock_reply(c->ctl, rx, &m, &e) != NL_OK)
        NL_WARN("ACCEPT to node %u: %s", n->id, e.msg);
    nl_wire_msg_free(&m);
    NL_INFO("node %u joined: %s, %.1f GiB, %.1f GFLOP/s, %u threads, data %s, key %.8s...", n->id,
            n->device, (double)n->memory / (1 << 30), n->gflops, n->threads, n->endpoint, n->key);
    c->last_plan_try = 0;
    c->replan_wanted = 1;
}

static void on_leave(nl_coord *c, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid(c, rx);
    if (!n)
        return;
    char why[300], reason[256];
    snprintf(why, sizeof why, "left (%s)",
             nl_log_escape(reason, sizeof reason, rx->msg.u.leave.reason));
    node_lost(c, n, NODE_LEFT, why);
}

static void on_heartbeat(nl_coord *c, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid(c, rx);
    nl_error e = {0};
    if (!n || n->id != rx->msg.u.heartbeat.node_id) {
        nl_sock_send_error(c->ctl, rx, NL_ERR_STATE, NL_MSG_HEARTBEAT, "unknown node: JOIN first",
                           &e);
        return;
    }
    coord_node_seen(c, n);
    n->hb = rx->msg.u.heartbeat; /* its figures, for the status */
    if (c->train_mem.training && n->stage >= 0 && n->loaded) { /* a stage's busy fraction */
        n->load_sum += rx->msg.u.heartbeat.load;
        n->load_n++;
    }
}

static void on_node_error(nl_coord *c, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid(c, rx);
    const nl_msg_error *e = &rx->msg.u.error;
    char why[1600], who[320] = "";
    /* a node that cannot reach a neighbour names its endpoint: say whose
     * (the neighbours are the plan's stages: not a scan of every node) */
    for (int s = 0; c->plan && s < c->plan->n_stages && !who[0]; s++) {
        const cnode *o = coord_stage_node(c, s);
        const char *at = o && o != n && o->endpoint[0] ? strstr(e->message, o->endpoint) : NULL;
        const char end = at ? at[strlen(o->endpoint)] : '0';
        if (at && (end < '0' || end > '9')) /* not the prefix of a longer port */
            snprintf(who, sizeof who, " [%s is node %u, stage %d]", o->endpoint, o->id, o->stage);
    }
    char text[1200];
    snprintf(why, sizeof why, "node %u: %s (%s)%s", n ? n->id : 0,
             nl_log_escape(text, sizeof text, e->message), nl_status_str((nl_status)e->code), who);
    NL_WARN("%s", why);
    if (!n || n->stage < 0)
        return; /* not a stage: it carries no job */
    if (e->req_type == NL_MSG_LAYER_LOAD || e->req_type == NL_MSG_LOAD_DONE ||
        e->req_type == NL_MSG_ASSIGN) {
        coord_set_state(c, "loading failed: %s", why);
        coord_drop_plan(c);
        c->last_plan_try = coord_now() + 5.0; /* do not spin on a broken load */
        return;
    }
    coord_fail_stage_jobs(c, why); /* the jobs it serves: those running on this plan */
}

/* ---------------------------------------------------------------- planning */

static void send_assign(nl_coord *c, int stage, const char *cfg_json)
{
    const nl_plan_stage *s = &c->plan->stages[stage];
    /* the stages make a ring: the last stage sends the tokens it samples
     * straight to the first (a single stage feeds itself) */
    const int ns = c->plan->n_stages;
    cnode *n = coord_stage_node(c, stage),
          *prev = ns > 1 ? coord_stage_node(c, (stage + ns - 1) % ns) : NULL,
          *next = ns > 1 ? coord_stage_node(c, (stage + 1) % ns) : NULL;
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_ASSIGN);
    m.u.assign = (nl_msg_assign){.epoch = c->epoch,
                                 .node_id = n->id,
                                 .stage = (uint32_t)stage,
                                 .num_stages = (uint32_t)c->plan->n_stages,
                                 .layer0 = (uint32_t)s->l0,
                                 .layer1 = (uint32_t)s->l1,
                                 .has_embed = s->has_embed,
                                 .has_head = s->has_head,
                                 .config_json = cfg_json,
                                 .seed = c->o.seed,
                                 .prev_endpoint = prev ? prev->endpoint : "",
                                 .prev_key = prev ? prev->key : "",
                                 .next_endpoint = next ? next->endpoint : "",
                                 .next_key = next ? next->key : "",
                                 .memory_planned = s->bytes};
    coord_send_node(c, n, &m);
    nl_wire_msg_free(&m);
}

/* Does source tensor `name` belong to stage s? The optimizer moments
 * (optim.m.<name>, optim.v.<name>) go with their tensor when the source is
 * a manifest, so that training resumes; a checkpoint's stay here. */
static int stage_holds(const nl_coord *c, const nl_plan_stage *s, const char *name)
{
    int l = -1, used = 0;
    if (strncmp(name, "optim.m.", 8) == 0 || strncmp(name, "optim.v.", 8) == 0) {
        if (!c->src_manifest)
            return 0;
        name += 8;
    }
    if (strcmp(name, "tok_embeddings.weight") == 0)
        return s->has_embed;
    if (strcmp(name, "norm.weight") == 0 || strcmp(name, "lm_head.weight") == 0)
        return s->has_head;
    if (sscanf(name, "layers.%d.%n", &l, &used) == 1 && used > 0)
        return l >= s->l0 && l < s->l1;
    return 0; /* optimizer moments and anything else stay here */
}

/* Streaming a stage's tensors runs in steps on the loop (issue 22 item
 * 6): each turn sends chunks (LAYER_LOAD, 4 MiB, pointing into the mapped
 * source: no copy) to the stages that load, round-robin, while fewer than
 * LOAD_WINDOW chunks of the source wait in libzmq's queues. A big model
 * thus never fills a peer's queue (its high-water mark would make a send
 * wait up to the socket's send timeout), heartbeats and clients are served
 * between chunks, and the memory libzmq holds stays bounded. The cursor
 * (cnode.ld) restarts when the source changes and stops with its epoch. */
#define LOAD_WINDOW 64 /* chunks in flight, all stages together: 256 MiB */
#define LOAD_TURN 16   /* chunks one turn sends at most */

/* Send the stage's next chunk: 1 sent, 0 none left, -1 the send failed. */
static int send_next_chunk(nl_coord *c, cnode *n, nl_wire_msg *m)
{
    const nl_plan_stage *s = &c->plan->stages[n->stage];
    cload *ld = &n->ld;
    for (; c->src && ld->file < c->src->n; ld->file++, ld->entry = 0) {
        nl_st_file *f = c->src->files[ld->file];
        for (; ld->entry < nl_st_count(f); ld->entry++, ld->chunk = 0) {
            const nl_st_entry *e = nl_st_entry_at(f, ld->entry);
            if (!stage_holds(c, s, e->name) || e->dtype != NL_DTYPE_F32 ||
                !coord_source_owns(c->src, ld->file, e->name))
                continue;
            const uint64_t numel = e->nbytes / 4;
            uint32_t chunks = (uint32_t)((numel + CHUNK_FLOATS - 1) / CHUNK_FLOATS);
            chunks = chunks ? chunks : 1;
            if (ld->chunk >= chunks)
                continue;
            const char *data = nl_st_tensor_data(f, e);
            const uint64_t off = (uint64_t)ld->chunk * CHUNK_FLOATS;
            const int64_t cnt = (int64_t)(numel - off < CHUNK_FLOATS ? numel - off : CHUNK_FLOATS);
            nl_wire_msg_reset(m, NL_MSG_LAYER_LOAD);
            m->u.layer_load.epoch = c->epoch;
            m->u.layer_load.name = e->name;
            m->u.layer_load.ndim = e->ndim;
            memcpy(m->u.layer_load.shape, e->shape, sizeof e->shape);
            m->u.layer_load.offset = off;
            m->u.layer_load.chunk = ld->chunk;
            m->u.layer_load.chunks = chunks;
            nl_txref_frame(&m->frames[0], &c->src->ref, (void *)(data + off * 4), NL_DTYPE_F32,
                           &cnt, 1);
            m->nframes = 1;
            if (coord_send_node(c, n, m) != NL_OK)
                return -1;
            if (++ld->chunk == chunks) {
                ld->tensors++;
                ld->bytes += e->nbytes;
            }
            return 1;
        }
    }
    return 0;
}

/* Begin streaming stage s's tensors (none without a source: LOAD_DONE
 * {tensors 0} then tells the node to initialise from the seed). */
static void start_load(nl_coord *c, int stage)
{
    cnode *n = coord_stage_node(c, stage);
    if (n)
        n->ld = (cload){.active = 1, .epoch = c->epoch, .src = c->src, .t0 = coord_now()};
}

/* One turn of streaming; returns how many stages still load. */
static int stream_loads(nl_coord *c)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    int active = 0, sent = 0, progress = 1;
    while (progress && sent < LOAD_TURN) {
        progress = 0;
        active = 0;
        /* only a stage of the plan loads: not a scan of every node */
        for (int s = 0; c->plan && s < c->plan->n_stages && sent < LOAD_TURN; s++) {
            cnode *n = coord_stage_node(c, s);
            cload *ld = n ? &n->ld : NULL;
            if (!ld || !ld->active)
                continue;
            if (n->life != NODE_LIVE || n->stage < 0 || !c->plan || ld->epoch != c->epoch) {
                ld->active = 0; /* its plan is gone */
                continue;
            }
            if (ld->src != c->src) /* a new source: from the start */
                *ld = (cload){.active = 1, .epoch = c->epoch, .src = c->src, .t0 = ld->t0};
            active++;
            if (c->src && atomic_load(&c->src->ref.pending) >= LOAD_WINDOW)
                continue; /* libzmq holds enough: next turn */
            const int r = send_next_chunk(c, n, &m);
            if (r > 0) {
                sent++;
                progress = 1;
                continue;
            }
            ld->active = 0;
            active--;
            if (r < 0) /* declared dead at this tick */
                continue;
            nl_wire_msg_reset(&m, NL_MSG_LOAD_DONE);
            m.u.load_done = (nl_msg_load_done){c->epoch, n->id, ld->tensors, ld->bytes};
            coord_send_node(c, n, &m);
            if (c->src)
                NL_INFO("stage %d: sent %u tensors (%.1f MiB) to node %u in %.2f s", n->stage,
                        ld->tensors, (double)ld->bytes / (1 << 20), n->id, coord_now() - ld->t0);
        }
    }
    nl_wire_msg_free(&m);
    c->loads_active = active;
    return active;
}

static double hop_seconds(const nl_coord *c)
{
    /* one request's activations over loopback-class links, plus a fixed
     * per-message cost */
    return 1e-4 + (double)c->o.plan_rows * c->cfg.hidden_dim * 4 / 1e9;
}

/* Faster first, then more memory, then the lower id. */
static int faster_first(const void *a, const void *b)
{
    const nl_plan_node *x = a, *y = b;
    if (x->gflops != y->gflops)
        return x->gflops > y->gflops ? -1 : 1;
    if (x->memory_bytes != y->memory_bytes)
        return x->memory_bytes > y->memory_bytes ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The planner's time grows as N min(N, L) (core/planner.h), and a plan
 * has at most L stages: over many nodes it is offered the fastest
 * plan_offer() of them first, and all (at most NL_PLAN_MAX_NODES) only
 * when those cannot hold the model (plan_layers). */
static int plan_offer(const nl_coord *c)
{
    const int k = 4 * c->cfg.num_layers;
    return k < 64 ? 64 : k;
}

/* The live nodes as the planner sees them; returns how many, and their
 * memory in all. Beyond plan_offer() nodes they are sorted fastest first;
 * at most NL_PLAN_MAX_NODES of them are returned (the others stay
 * standbys). */
static int plan_nodes(const nl_coord *c, nl_plan_node *pn, uint64_t *total)
{
    int n = 0;
    *total = 0;
    for (int i = 0; i < c->n_nodes; i++)
        if (c->nodes[i].life == NODE_LIVE) {
            const double g =
                c->nodes[i].seen_gflops > 0 ? c->nodes[i].seen_gflops : c->nodes[i].gflops;
            pn[n] = (nl_plan_node){(int)c->nodes[i].id, c->nodes[i].memory, g > 0 ? g : 1.0, 0.0};
            *total += c->nodes[i].memory;
            n++;
        }
    if (n > plan_offer(c))
        qsort(pn, (size_t)n, sizeof *pn, faster_first);
    return n < NL_PLAN_MAX_NODES ? n : NL_PLAN_MAX_NODES;
}

/* nl_plan_layers over the fastest plan_offer() of pn[0, n) (sorted by
 * plan_nodes), then, if they cannot hold the model, over all n. */
static nl_status plan_layers(const nl_coord *c, nl_plan **out, const nl_plan_node *pn, int n,
                             const nl_plan_opts *po, nl_error *err)
{
    const int k = plan_offer(c);
    if (n > k && nl_plan_layers(out, &c->cfg, pn, k, po, err) == NL_OK)
        return NL_OK;
    return nl_plan_layers(out, &c->cfg, pn, n, po, err);
}

/* Plans are for inference memory, but while a training job runs for its
 * training memory (c->train_mem: weights, gradients, moments and the
 * microbatches in flight, core/memory.h). */
static nl_plan_opts plan_opts(const nl_coord *c)
{
    if (c->train_mem.training)
        return (nl_plan_opts){.mem = c->train_mem};
    return (nl_plan_opts){.mem = {.training = 0, .micro_rows = c->o.plan_rows, .in_flight = 1}};
}

int coord_plan_holds(const nl_coord *c, const nl_mem_opts *mo, char *why, size_t cap)
{
    const int S = c->plan ? c->plan->n_stages : 0;
    for (int s = 0; s < S; s++) {
        const nl_plan_stage *ps = &c->plan->stages[s];
        const cnode *n = coord_stage_node((nl_coord *)c, s);
        nl_mem_opts o = *mo;
        /* 1F1B: a stage keeps at most as many microbatches as there are
         * stages from it to the last (as the node counts them) */
        if (o.training && (o.in_flight <= 0 || o.in_flight > S - s))
            o.in_flight = S - s;
        const nl_mem_estimate me =
            nl_memory_estimate(&c->cfg, ps->l1 - ps->l0, ps->has_embed, ps->has_head, &o);
        if (n && me.total > n->memory) {
            snprintf(why, cap,
                     "stage %d (node %u, layers [%d, %d)) needs %llu bytes for training but the "
                     "node offers %llu: %llu bytes short",
                     s, n->id, ps->l0, ps->l1, (unsigned long long)me.total,
                     (unsigned long long)n->memory, (unsigned long long)(me.total - n->memory));
            return 0;
        }
    }
    return 1;
}

/* Log a plan, each stage and standby, as `what` (its epoch, or "old"). */
static void log_plan(const nl_coord *c, const nl_plan *plan, const char *what)
{
    for (int s = 0; s < plan->n_stages; s++)
        NL_INFO("plan %s: stage %d on node %d: layers [%d, %d)%s%s, %.1f MiB, %.2f ms", what, s,
                plan->stages[s].node_id, plan->stages[s].l0, plan->stages[s].l1,
                plan->stages[s].has_embed ? " +embed" : "",
                plan->stages[s].has_head ? " +head" : "", (double)plan->stages[s].bytes / (1 << 20),
                plan->stages[s].seconds * 1e3);
    for (int i = 0; i < plan->n_standby; i++)
        NL_INFO("plan %s: node %d is a standby", what, plan->standby[i]);
    (void)c;
}

/* The live nodes as the planner sees them, in a new array (NULL: out of
 * memory); *n how many, *total their memory. */
static nl_plan_node *plan_nodes_new(const nl_coord *c, int *n, uint64_t *total)
{
    nl_plan_node *pn = malloc((size_t)(c->n_nodes ? c->n_nodes : 1) * sizeof *pn);
    *n = pn ? plan_nodes(c, pn, total) : 0;
    for (int i = 0; i < *n; i++)
        pn[i].hop_seconds = hop_seconds(c);
    return pn;
}

static void plan_over(nl_coord *c, nl_plan_node *pn, int n, uint64_t total);

static void try_plan(nl_coord *c)
{
    int n = 0;
    uint64_t total = 0;
    nl_plan_node *pn = plan_nodes_new(c, &n, &total);
    if (!pn)
        coord_set_state(c, "planning: out of memory");
    else
        plan_over(c, pn, n, total);
    free(pn);
}

static void plan_over(nl_coord *c, nl_plan_node *pn, int n, uint64_t total)
{
    nl_error e = {0};
    c->last_plan_try = coord_now();
    /* the minimums gate the first plan; later plans use whoever is left */
    const int live = c->n_live;
    if (!c->planned_once && (live < c->o.min_nodes || total < c->o.min_memory)) {
        coord_set_state(c, "waiting for nodes: %d of %d joined, %.2f of %.2f GiB offered", live,
                        c->o.min_nodes, (double)total / (1 << 30),
                        (double)c->o.min_memory / (1 << 30));
        return;
    }
    nl_plan_opts po = plan_opts(c);
    if (!c->have_cfg) {
        nl_sizing_opts so;
        nl_sizing_opts_init(&so);
        so.plan = po;
        nl_sizing sz;
        if (nl_sizing_choose(&sz, &c->base, pn, n, &so, &e) != NL_OK) {
            coord_set_state(c, "not enough capacity to size a model: %s", e.msg);
            coord_fail_waiting(c, c->state);
            return;
        }
        c->cfg = sz.cfg;
        c->have_cfg = 1;
        NL_INFO("sized the model from %.2f GiB: d=%d L=%d H=%d G=%d F=%d (%s)",
                (double)total / (1 << 30), c->cfg.hidden_dim, c->cfg.num_layers, c->cfg.num_heads,
                c->cfg.num_kv_heads, c->cfg.ffn_dim, sz.report);
    }
    nl_plan *plan = NULL;
    struct timespec cpu0, cpu1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu0);
    const double t0 = coord_now();
    if (plan_layers(c, &plan, pn, n, &po, &e) != NL_OK) {
        coord_set_state(c, "not enough capacity: %s", e.msg);
        coord_fail_waiting(c, c->state);
        return;
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu1);
    NL_INFO("planned over %d live nodes (%d offered to the planner) in %.3f s (%.3f s of CPU)",
            c->n_live, n > plan_offer(c) ? plan_offer(c) : n, coord_now() - t0,
            (double)(cpu1.tv_sec - cpu0.tv_sec) + 1e-9 * (double)(cpu1.tv_nsec - cpu0.tv_nsec));
    c->plan = plan;
    c->planned_once = 1;
    c->replan_wanted = 0; /* this plan saw every node there is */
    c->epoch++;
    char *cfg_json = nl_config_to_json(&c->cfg), epoch[32];
    for (int s = 0; s < plan->n_stages; s++) {
        cnode *node = coord_stage_node(c, s);
        node->stage = s;
        node->loaded = 0;
    }
    snprintf(epoch, sizeof epoch, "%llu", (unsigned long long)c->epoch);
    log_plan(c, plan, epoch);
    for (int s = 0; s < plan->n_stages && cfg_json; s++)
        send_assign(c, s, cfg_json);
    for (int s = 0; s < plan->n_stages && cfg_json; s++)
        start_load(c, s);
    stream_loads(c);
    free(cfg_json);
    coord_set_state(c, "loading %d stages (plan %llu)", plan->n_stages,
                    (unsigned long long)c->epoch);
}

/* Heartbeats a stage needs since the last checkpoint to be judged. */
#define OBSERVE_MIN_BEATS 3

void coord_observe_speeds(nl_coord *c)
{
    const int S = c->plan ? c->plan->n_stages : 0;
    double loads = 0, pred = 0;
    int ok = S > 1;
    for (int s = 0; s < S && ok; s++) {
        const cnode *n = coord_stage_node(c, s);
        ok = n && n->load_n >= OBSERVE_MIN_BEATS;
        loads += ok ? n->load_sum / n->load_n : 0;
        pred += c->plan->stages[s].seconds;
    }
    for (int s = 0; s < S && ok && loads > 0.05 * S && pred > 0; s++) {
        /* a stage's share of the busy time against its predicted share:
         * the plan's per-microbatch seconds rescaled to the observed ones */
        cnode *n = coord_stage_node(c, s);
        const double load = n->load_sum / n->load_n;
        const double was = n->seen_gflops > 0 ? n->seen_gflops : n->gflops;
        const double seen_s = load / loads * pred, pred_s = c->plan->stages[s].seconds;
        const double g = seen_s > 0 ? was * pred_s / seen_s : was;
        if (fabs(g / was - 1.0) > c->o.replan_margin) {
            NL_INFO("observed: node %u (stage %d) busy %.0f%% over %d heartbeats, %.2f ms per "
                    "microbatch against %.2f ms planned: %.1f GFLOP/s instead of %.1f",
                    n->id, s, 100 * load, n->load_n, seen_s * 1e3, pred_s * 1e3, g, was);
            n->seen_gflops = g;
            c->replan_wanted = 1;
        }
    }
    for (int i = 0; i < c->n_nodes; i++) {
        c->nodes[i].load_sum = 0;
        c->nodes[i].load_n = 0;
    }
}

int coord_plan_possible(nl_coord *c, char *why, size_t cap)
{
    uint64_t total = 0;
    nl_error e = {0};
    int n = 0;
    nl_plan_node *pn = plan_nodes_new(c, &n, &total);
    nl_plan_opts po = plan_opts(c);
    nl_plan *p = NULL;
    const nl_status st =
        pn ? plan_layers(c, &p, pn, n, &po, &e) : nl_error_set(&e, NL_ERR_NOMEM, "out of memory");
    nl_plan_destroy(&p);
    free(pn);
    if (st != NL_OK)
        snprintf(why, cap, "%s", e.msg);
    return st == NL_OK;
}

int coord_replan_gain(nl_coord *c, const char *when)
{
    if (!c->replan_wanted || !c->plan || !c->have_cfg)
        return 0;
    c->replan_wanted = 0;
    uint64_t total = 0;
    nl_error e = {0};
    int n = 0;
    nl_plan_node *pn = plan_nodes_new(c, &n, &total);
    nl_plan_opts po = plan_opts(c);
    nl_plan *cand = NULL;
    int gain = 0;
    if (!pn || plan_layers(c, &cand, pn, n, &po, &e) != NL_OK) {
        NL_INFO("re-plan %s: no plan over the %d nodes: %s", when, n, pn ? e.msg : "out of memory");
        free(pn);
        return 0;
    }
    /* the current split's time by the same cost model (it may have been
     * made for inference) at the nodes' figures now (observed speeds may
     * have changed them): nl_plan_stage_seconds, the planner's formula */
    double was = 0;
    for (int s = 0; s < c->plan->n_stages; s++) {
        const nl_plan_stage *ps = &c->plan->stages[s];
        const nl_plan_node *nd = NULL;
        for (int i = 0; i < n && !nd; i++)
            if (pn[i].id == ps->node_id)
                nd = &pn[i];
        const double t =
            nd ? nl_plan_stage_seconds(&c->cfg, &po, nd, ps->l1 - ps->l0, s, c->plan->n_stages)
               : ps->seconds;
        if (t > was)
            was = t;
    }
    const double now = cand->bottleneck;
    if (!(now < was * (1.0 - c->o.replan_margin))) {
        NL_INFO("re-plan %s: the plan stays (bottleneck %.2f ms; %d nodes would give %.2f ms, "
                "not better by --replan-margin %.2f)",
                when, was * 1e3, n, now * 1e3, c->o.replan_margin);
    } else if (c->stages_modified) {
        NL_WARN("re-plan %s: %d nodes would give a bottleneck of %.2f ms instead of %.2f ms, "
                "but the stages hold weights trained since the last checkpoint; the plan stays",
                when, n, now * 1e3, was * 1e3);
    } else {
        NL_INFO("re-plan %s: bottleneck %.2f ms -> %.2f ms over %d nodes (--replan-margin "
                "%.2f); the stages reload from %s",
                when, was * 1e3, now * 1e3, n, c->o.replan_margin,
                c->src_path[0] ? c->src_path : "the seed");
        log_plan(c, c->plan, "old");
        log_plan(c, cand, "new");
        gain = 1;
    }
    nl_plan_destroy(&cand);
    free(pn);
    return gain;
}

/* A node joined or a standby left (replan_wanted) and the cluster is at
 * rest (ready, no job): plan again over the nodes there are now when the
 * planner predicts a bottleneck better by --replan-margin (hysteresis);
 * the stages then reload from the source (the checkpoint or the last
 * manifest). Not while the stages hold trained weights that no checkpoint
 * has: a reload would lose them. (During a training job the job asks at
 * its next checkpoint: coord_train.c.) */
static void replan_at_rest(nl_coord *c)
{
    if (!c->replan_wanted || !c->ready || !c->plan || !c->have_cfg)
        return;
    for (int i = 0; i < COORD_MAX_JOBS; i++)
        if (c->jobs[i].phase != JOB_FREE)
            return; /* at the end of the job */
    if (coord_replan_gain(c, "at rest"))
        coord_reload(c);
}

static void on_load_done(nl_coord *c, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid(c, rx);
    if (!n || rx->msg.u.load_done.epoch != c->epoch || n->stage < 0)
        return; /* a stale plan's answer */
    n->loaded = 1;
    coord_jobs_touch(c);
    NL_INFO("node %u loaded stage %d: %u tensors, %.1f MiB", n->id, n->stage,
            rx->msg.u.load_done.tensors, (double)rx->msg.u.load_done.bytes / (1 << 20));
    for (int s = 0; s < c->plan->n_stages; s++) {
        cnode *m = coord_stage_node(c, s);
        if (!m || !m->loaded)
            return;
    }
    c->ready = 1;
    c->stages_modified = 0;         /* they hold the source's weights */
    c->resumable = c->src_manifest; /* the stages hold the manifest's weights and moments */
    coord_set_state(c, "ready: %d stages, bottleneck %.2f ms per request (plan %llu)",
                    c->plan->n_stages, c->plan->bottleneck * 1e3, (unsigned long long)c->epoch);
    coord_jobs_ready(c);
}

/* ---------------------------------------------------------------- loop */

static void tick(nl_coord *c)
{
    const double now = coord_now();
    coord_reap_sources(c, 0);
    /* the oldest heartbeat first (an unreachable node before it): O(1)
     * per turn and per death, not a scan of every node */
    for (cnode *n; (n = coord_node_oldest(c)) &&
                   (n->unreachable || (now - n->last_seen) * 1e3 > c->o.node_timeout_ms);) {
        char why[sizeof n->why];
        if (n->unreachable)
            memcpy(why, n->why, sizeof why);
        else
            snprintf(why, sizeof why, "sent no heartbeat for %.1f s: dead", now - n->last_seen);
        node_lost(c, n, NODE_DEAD, why);
    }
    if (c->loads_active)
        stream_loads(c);
    coord_check_jobs(c, now);
    if (!coord_grow_tick(c)) /* --grow auto may deepen the model first (coord_grow.c) */
        replan_at_rest(c);
    if (!c->plan && now - c->last_plan_try > 0.5)
        try_plan(c);
}

/* The role a message type needs (NL_KEY_ROLE_* bits, any of them), 0 for
 * one every admitted peer may send. */
static int role_needed(int type)
{
    switch (type) {
    case NL_MSG_HELLO:
        return 0;
    case NL_MSG_JOB_SUBMIT:
    case NL_MSG_JOB_QUERY:
    case NL_MSG_JOB_CANCEL:
        return NL_KEY_ROLE_CLIENT | NL_KEY_ROLE_ADMIN;
    default: /* JOIN, HEARTBEAT, LEAVE, LOAD_DONE, ERROR and the jobs' reports */
        return NL_KEY_ROLE_NODE;
    }
}

/* Where an answer to rx goes: the socket it came in on; for the fuzz
 * target, which hands messages in directly, the socket of its type. */
static nl_sock *reply_sock(const nl_coord *c, const nl_rx *rx)
{
    if (c->from)
        return c->from;
    return role_needed(rx->msg.type) & NL_KEY_ROLE_NODE ? c->ctl : c->cli;
}

void coord_dispatch(nl_coord *c, const nl_rx *rx, int roles)
{
    nl_error e = {0};
    nl_sock *to = reply_sock(c, rx);
    const int need = role_needed(rx->msg.type);
    if (need && !(roles & need)) {
        char why[160];
        snprintf(why, sizeof why, "%s is not for a key of this role (authorized_keys: %s)",
                 nl_wire_type_name(rx->msg.type), need & NL_KEY_ROLE_NODE ? "node" : "client");
        if (rx->msg.type != NL_MSG_ERROR) /* never an ERROR in answer to an ERROR */
            nl_sock_send_error(to, rx, NL_ERR_AUTH, rx->msg.type, why, &e);
        if (!c->o.plaintext)
            nl_auth_strike(nl_net_auth(c->net), rx->peer, why);
        return;
    }
    c->roles = roles;
    switch (rx->msg.type) {
    case NL_MSG_HELLO:
        nl_sock_answer_hello(to, rx, NL_ROLE_COORDINATOR, &e);
        break;
    case NL_MSG_JOIN:
        on_join(c, rx);
        break;
    case NL_MSG_HEARTBEAT:
        on_heartbeat(c, rx);
        break;
    case NL_MSG_LEAVE:
        on_leave(c, rx);
        break;
    case NL_MSG_LOAD_DONE:
        on_load_done(c, rx);
        break;
    case NL_MSG_ERROR:
        on_node_error(c, rx);
        break;
    case NL_MSG_RESULT:
    case NL_MSG_TOKEN:
    case NL_MSG_JOB_STATUS:
    case NL_MSG_GRAD_NORM:
    case NL_MSG_LOSS:
    case NL_MSG_CKPT_DONE:
        coord_on_job_message(c, rx);
        break;
    case NL_MSG_JOB_SUBMIT:
        coord_on_submit(c, rx);
        break;
    case NL_MSG_JOB_QUERY:
        coord_on_query(c, rx);
        break;
    case NL_MSG_JOB_CANCEL:
        coord_on_cancel(c, rx);
        break;
    default:
        nl_sock_send_error(to, rx, NL_ERR_PROTO, rx->msg.type,
                           "the coordinator does not take this message", &e);
    }
    c->roles = 0;
}

/* The roles of the key a message came from on socket s, within the roles
 * that socket serves (plaintext: all of them); other: on the other socket
 * (what the key could do there). */
static int roles_of(nl_coord *c, nl_sock *s, const nl_rx *rx, int other)
{
    const int on_cli = (s == c->cli) != !!other;
    const int mask = on_cli ? NL_KEY_ROLE_CLIENT | NL_KEY_ROLE_ADMIN : NL_KEY_ROLE_NODE;
    if (c->o.plaintext)
        return mask;
    return nl_auth_roles(nl_net_auth(c->net), on_cli ? COORD_CLIENT_DOMAIN : COORD_NODE_DOMAIN,
                         rx->peer) &
           mask;
}

/* A message on socket s that belongs on the other one, from a key that
 * has the other socket's role too (a key without role words has every
 * role): say where to go, with no strike (a mistake of address, not of
 * trust). A HELLO by the role it speaks for, others by their type. A key
 * without the other role is left to coord_dispatch, which refuses it by
 * role. Returns 1 if answered. */
static int misdirected(nl_coord *c, nl_sock *s, const nl_rx *rx)
{
    const int type = rx->msg.type, on_cli = s == c->cli;
    const int other = on_cli ? NL_KEY_ROLE_NODE : NL_KEY_ROLE_CLIENT | NL_KEY_ROLE_ADMIN;
    const uint32_t said = type == NL_MSG_HELLO ? rx->msg.u.hello.role : 0;
    const int need = said == NL_ROLE_NODE     ? NL_KEY_ROLE_NODE
                     : said == NL_ROLE_CLIENT ? NL_KEY_ROLE_CLIENT | NL_KEY_ROLE_ADMIN
                                              : role_needed(type);
    if (type == NL_MSG_ERROR || !(need & other) || !(roles_of(c, s, rx, 1) & need & other))
        return 0;
    char why[700];
    snprintf(why, sizeof why,
             "%s: this is the coordinator's %s endpoint; %s connect to %s (neurocoord %s)",
             nl_wire_type_name(type), on_cli ? "client" : "node", on_cli ? "nodes" : "clients",
             on_cli ? c->endpoint : c->client_endpoint, on_cli ? "--listen" : "--client-listen");
    nl_error e = {0};
    nl_sock_send_error(s, rx, NL_ERR_AUTH, (uint32_t)type, why, &e);
    return 1;
}

const char *nl_coord_endpoint(const nl_coord *c)
{
    return c->endpoint;
}
const char *nl_coord_client_endpoint(const nl_coord *c)
{
    return c->client_endpoint;
}
const char *nl_coord_state(const nl_coord *c)
{
    return c->state;
}

nl_status nl_coord_admit_key(nl_coord *c, const char *z85, nl_error *err)
{
    if (c->o.plaintext) /* no keys are checked */
        return NL_OK;
    return nl_auth_pin_key(nl_net_auth(c->net), COORD_CLIENT_DOMAIN, z85, err);
}

void nl_coord_observe(nl_coord *c, nl_coord_observer fn, void *ctx)
{
    c->observe = fn;
    c->observe_ctx = ctx;
}

/* One message from socket s, if there is one. */
static void receive_from(nl_coord *c, nl_sock *s)
{
    nl_rx rx;
    nl_rx_init(&rx);
    nl_error e = {0};
    nl_status st = nl_sock_recv(s, &rx, 0, &e);
    c->from = s;
    if (st == NL_OK && !misdirected(c, s, &rx))
        coord_dispatch(c, &rx, roles_of(c, s, &rx, 0));
    else if (st != NL_OK && st != NL_ERR_TIMEOUT && st != NL_ERR_AUTH)
        NL_DEBUG("receive (%s): %s", s == c->cli ? "clients" : "nodes", e.msg);
    c->from = NULL;
    nl_rx_free(&rx);
}

void nl_coord_step(nl_coord *c, int timeout_ms)
{
    zmq_pollitem_t items[3] = {{nl_sock_handle(c->ctl), 0, ZMQ_POLLIN, 0},
                               {nl_sock_handle(c->cli), 0, ZMQ_POLLIN, 0},
                               {c->work_pipe, 0, ZMQ_POLLIN, 0}};
    if (c->loads_active && timeout_ms > 2) /* streaming: come back soon for the next chunks */
        timeout_ms = 2;
    if (zmq_poll(items, 3, timeout_ms) < 0 && zmq_errno() != EINTR)
        NL_DEBUG("poll: %s", zmq_strerror(zmq_errno()));
    coord_work_reap(c);
    if (items[0].revents & ZMQ_POLLIN)
        receive_from(c, c->ctl);
    if (items[1].revents & ZMQ_POLLIN)
        receive_from(c, c->cli);
    tick(c);
}

nl_status nl_coord_run(nl_coord *c, volatile sig_atomic_t *stop, nl_error *err)
{
    while (!*stop) {
        if (nl_auth_hup_take()) {
            nl_error e = {0};
            if (nl_auth_reload(nl_net_auth(c->net), &e) == NL_OK)
                NL_INFO("SIGHUP: reloaded %s/authorized_keys", c->o.state_dir);
            else
                NL_ERROR("SIGHUP: %s", e.msg);
        }
        nl_coord_step(c, 100);
    }
    (void)err;
    NL_INFO("stopping");
    return NL_OK;
}
