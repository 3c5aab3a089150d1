/* The coordinator: its setup (sockets, domains, the model's source) and
 * the event loop, whose dispatch hands the nodes' messages to membership
 * (coord_members.c: join, heartbeats, death) and planning (coord_plan.c:
 * sizing and placement through core/plan/sizing and core/plan/planner, streaming
 * each stage's tensors), and the jobs' messages to coord_jobs.c. */
#include "coordinator/coord_impl.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "base/log.h"
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/plan/sizing.h"
#include "core/tokenizer/chat_template.h"

/* The ZAP domains of the nodes' and the clients' sockets */
#define COORD_NODE_DOMAIN "coord"
#define COORD_CLIENT_DOMAIN "coord-client"
#define DISMISS_WAIT_S 10.0  /* NL_COORD_STOP_NODES: how long the nodes' LEAVEs are awaited */
#define DOWN_JOBS_WAIT_S 8.0 /* and, before that, the training jobs' last checkpoints */

void nl_coord_opts_init(nl_coord_opts *o)
{
    memset(o, 0, sizeof *o);
    o->min_nodes = 1;
    o->heartbeat_ms = 1000;
    o->node_timeout_ms = 5000;
    o->job_timeout_ms = 120000;
    o->gen_resumes = 2;
    o->train_resumes = 3;
    o->verify_rate = 0.05; /* docs/security.md: within 5% of tokens/s */
    o->replicas = 1;
    o->plan_microbatches = 8;
    o->rebalance_after = 3;
    o->plan_rows = 512;
    o->replan_margin = 0.1;
    o->max_data_bytes = 1ull << 30;
    o->max_data_total = 1ull << 30;
    o->max_jobs_per_key = 32;
}

/* ---------------------------------------------------------------- setup */

static nl_status load_model_source(nl_coord *c, nl_error *err)
{
    nl_config_init(&c->base);
    if (c->o.resume) { /* the operator's resume: the first training job continues it */
        nl_status st = coord_use_manifest(c, c->o.resume, 0, err);
        c->src_continues = st == NL_OK;
        return st;
    }
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
        if (st == NL_OK)
            st = nl_checkpoint_meta(c->o.model, "chat_template", &c->chat_text, err);
        if (st == NL_OK)
            st = nl_chat_template_check(c->chat_text, "metadata 'chat_template'", err);
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
    randombytes_buf(c->verify_key, sizeof c->verify_key); /* libsodium is up: the keys are */
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
        (st = setup_domains(c, path, err)) != NL_OK || (st = coord_bans_read(c, err)) != NL_OK ||
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
    coord_relay_stop(c);
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
    free(c->chat_text);
    free(c->growth);
    nl_keys_wipe(&c->keys);
    sodium_memzero(c->verify_key, sizeof c->verify_key);
    coord_bans_free(c);
    coord_generate_done_free(c);
    free(c);
    *cp = NULL;
}

/* ---------------------------------------------------------------- loop */

static void tick(nl_coord *c)
{
    const double now = nl_mono_s();
    coord_reap_sources(c, 0);
    cnode *q = c->quarantine ? coord_node_by_id(c, c->quarantine) : NULL;
    c->quarantine = 0;
    if (q && q->life == NODE_LIVE) /* convicted (coord_quarantine) */
        coord_node_lost(c, q, NODE_DEAD, c->quarantine_why);
    /* the oldest heartbeat first (an unreachable node before it): O(1)
     * per turn and per death, not a scan of every node */
    for (cnode *n; (n = coord_node_oldest(c)) &&
                   (n->unreachable || (now - n->last_seen) * 1e3 > c->o.node_timeout_ms);) {
        char why[sizeof n->why];
        if (n->unreachable)
            memcpy(why, n->why, sizeof why);
        else
            snprintf(why, sizeof why, "sent no heartbeat for %.1f s: dead", now - n->last_seen);
        coord_node_lost(c, n, NODE_DEAD, why);
    }
    if (c->loads_active && !c->dismissing)
        coord_stream_loads(c);
    coord_check_jobs(c, now);
    /* going down: a node that leaves loses its stage, but a plan over the
     * others would stream weights to nodes that are leaving too (and one
     * that closes its socket with a message of them half received loses it
     * inside libzmq 4.3.4: tests/lsan.supp) */
    if (c->dismissing)
        return;
    if (c->probes > 0 && coord_probe_tick(c) > 0)
        return; /* no plan until the joining nodes' data endpoints are known (coord_probe.c) */
    if (!coord_grow_tick(c)) /* --grow auto may deepen the model first (coord_grow.c) */
        coord_replan_at_rest(c);
    if (!c->plan && now - c->last_plan_try > 0.5 && !c->manifests_writing)
        coord_try_plan(c);
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
        coord_on_join(c, rx);
        break;
    case NL_MSG_HEARTBEAT:
        coord_on_heartbeat(c, rx);
        break;
    case NL_MSG_LEAVE:
        coord_on_leave(c, rx);
        break;
    case NL_MSG_LOAD_DONE:
        coord_on_load_done(c, rx);
        break;
    case NL_MSG_ERROR:
        coord_on_node_error(c, rx);
        break;
    case NL_MSG_RESULT:
    case NL_MSG_TOKEN:
    case NL_MSG_JOB_STATUS:
    case NL_MSG_GRAD_NORM:
    case NL_MSG_LOSS:
    case NL_MSG_CKPT_DONE:
    case NL_MSG_VERIFY_CASE:
    case NL_MSG_VERIFY_RESULT:
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
const char *nl_coord_model_file(const nl_coord *c)
{
    return c->src_path[0] && !c->src_manifest && !c->stages_modified ? c->src_path : NULL;
}
int nl_coord_max_jobs_per_key(const nl_coord *c)
{
    const int k = c->o.max_jobs_per_key;
    return k > 0 && k < COORD_MAX_JOBS ? k : COORD_MAX_JOBS;
}

nl_status nl_coord_admit_key(nl_coord *c, const char *z85, nl_error *err)
{
    if (c->o.plaintext) /* no keys are checked */
        return NL_OK;
    /* a client, not an admin (issue 31): no nodes' keys or endpoints, only its own jobs */
    return nl_auth_pin_key(nl_net_auth(c->net), COORD_CLIENT_DOMAIN, z85, NL_KEY_ROLE_CLIENT, err);
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

/* The cluster goes down (NL_COORD_STOP_NODES): a training job stops as a
 * cancelled one does, its step under way kept in a checkpoint and its
 * client told, within DOWN_JOBS_WAIT_S; any other job, or one that has
 * not ended by then, fails saying why. So none is left in the journal to
 * come back, with no client, when the cluster is next brought up. */
static void end_jobs_for_down(nl_coord *c)
{
    uint64_t stopping[COORD_MAX_JOBS]; /* the jobs awaited: those that stop with a checkpoint */
    int n_stopping = 0;
    for (int i = 0; i < COORD_MAX_JOBS; i++) {
        cjob *j = &c->jobs[i];
        if (j->phase == JOB_FREE || !j->ops->cancel)
            continue;
        nl_rx rx; /* as if its own client asked: it is told on its connection */
        nl_rx_init(&rx);
        memcpy(rx.rid, j->rid, j->rid_len);
        rx.rid_len = j->rid_len;
        if (j->ops->cancel(c, j, &rx)) {
            NL_INFO("the cluster is going down: %s job %llu stops after the step under way, "
                    "with a checkpoint",
                    j->ops->name, (unsigned long long)j->id);
            stopping[n_stopping++] = j->id;
        }
        nl_rx_free(&rx);
    }
    const double until = nl_mono_s() + DOWN_JOBS_WAIT_S;
    for (int busy = n_stopping; busy && nl_mono_s() < until;) {
        nl_coord_step(c, 100);
        busy = 0; /* one not begun (a second fine-tuning job) is not awaited: it fails below */
        for (int k = 0; k < n_stopping; k++)
            busy += coord_job_find(c, stopping[k]) != NULL;
    }
    for (int k = 0; k < n_stopping; k++) {
        const cjob *j = coord_job_find(c, stopping[k]);
        if (j)
            NL_WARN("the cluster is going down: %s job %llu did not stop within %.0f s; it fails "
                    "without the checkpoint of its last step",
                    j->ops->name, (unsigned long long)j->id, DOWN_JOBS_WAIT_S);
    }
    coord_fail_jobs(c, "the cluster is going down (neuroctl cluster down)");
}

nl_status nl_coord_run(nl_coord *c, volatile sig_atomic_t *stop, nl_error *err)
{
    while (!*stop) {
        if (nl_auth_hup_take()) {
            nl_error e = {0};
            if (nl_auth_reload(nl_net_auth(c->net), &e) == NL_OK &&
                coord_bans_read(c, &e) == NL_OK) /* an operator may have lifted a ban */
                NL_INFO("SIGHUP: reloaded %s/authorized_keys", c->o.state_dir);
            else
                NL_ERROR("SIGHUP: %s", e.msg);
        }
        nl_coord_step(c, 100);
    }
    (void)err;
    if (*stop == NL_COORD_STOP_NODES) {
        /* the cluster goes down (neuroctl cluster down): every node that
         * joined, started by cluster up or by hand, is asked to leave, and
         * their LEAVEs are awaited (nodes that do not answer are left) */
        end_jobs_for_down(c);
        c->dismissing = 1;
        const int asked = coord_dismiss_nodes(c, "the cluster is going down");
        const double until = nl_mono_s() + DISMISS_WAIT_S;
        while (c->n_live > 0 && nl_mono_s() < until)
            nl_coord_step(c, 100);
        NL_INFO("stopping: asked %d node(s) to leave; %d left, %d did not answer", asked,
                asked - c->n_live, c->n_live);
        return NL_OK;
    }
    NL_INFO("stopping");
    return NL_OK;
}
