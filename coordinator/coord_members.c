/* The coordinator's membership: a node joins (its key, name and figures
 * checked), sends heartbeats, leaves or reports an error; a node that is
 * gone fails what it carried and the cluster plans again (coord.c's tick
 * declares the silent ones dead). */
#include "coordinator/coord_impl.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
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
#include "net/keys.h"

/* A node is gone (dead or left): fail what it carried (a generation waits
 * to resume) and plan again. */
void coord_node_lost(nl_coord *c, cnode *n, int life, const char *why)
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
    coord_probe_stop(c, n);
    coord_node_unlive(c, n, life);
    n->stage = -1;
    if (stage >= 0) {
        c->plan_held = 0; /* a job that kept it for a first loss gives it up */
        if (coord_jobs_stage_lost(c, msg) && !c->dismissing) {
            /* a training job saves the step under way from the
             * survivors first (coord_train.c, SALVAGE) */
            c->plan_held = 1;
            c->ready = 0;
            snprintf(c->held_why, sizeof c->held_why, "%s", msg);
            coord_set_state(c, "saving the step under way, then re-planning: %s", msg);
            return;
        }
        coord_drop_plan(c);
        if (c->dismissing) /* no plan follows (nl_coord_run) */
            coord_set_state(c, "going down: %s", msg);
        else
            coord_set_state(c, "re-planning: %s", msg);
    } else {
        c->replan_wanted |= COORD_REPLAN_LEFT;   /* a standby: the plan may still be the best */
        for (int i = 0; i < COORD_MAX_JOBS; i++) /* it may have been verifying */
            if (c->jobs[i].phase != JOB_FREE && c->jobs[i].ops->node_gone)
                c->jobs[i].ops->node_gone(c, &c->jobs[i]);
    }
}

void coord_release_plan(nl_coord *c)
{
    if (!c->plan_held)
        return;
    c->plan_held = 0;
    coord_drop_plan(c);
    coord_set_state(c, "re-planning: %s", c->held_why);
}

/* Whether the line [line, end) is one of key's (the key, then a blank,
 * the line's end or the file's). */
static int key_line(const char *line, const char *end, const char *key, size_t klen)
{
    return (size_t)(end - line) >= klen && memcmp(line, key, klen) == 0 &&
           (line + klen == end || line[klen] == ' ' || line[klen] == '\t' || line[klen] == '\n');
}

/* Comment out key's lines in <state-dir>/authorized_keys ("# banned:
 * WHY: " before each; a key may be listed on any number of lines) and
 * reload the allow-lists. */
static nl_status ban_key(nl_coord *c, const char *key, const char *why, nl_error *err)
{
    char path[4096], *text = NULL, *out = NULL, mark[320];
    size_t len = 0, n = 0, hits = 0;
    snprintf(path, sizeof path, "%s/authorized_keys", c->o.state_dir);
    nl_status st = nl_file_read_all(path, 16u << 20, &text, &len, err);
    if (st != NL_OK)
        return st;
    const size_t klen = strlen(key);
    const size_t ml = (size_t)snprintf(mark, sizeof mark, "# banned: %.300s: ", why);
    /* one line whatever WHY holds: a line break in it would end the
     * comment, and the rest of WHY would be a line of authorized_keys */
    for (size_t i = 0; i < ml; i++)
        if ((unsigned char)mark[i] < 0x20 || mark[i] == 0x7f)
            mark[i] = ' ';
    for (char *line = text, *end; line < text + len; line = end) {
        end = memchr(line, '\n', (size_t)(text + len - line));
        end = end ? end + 1 : text + len;
        hits += (size_t)key_line(line, end, key, klen);
    }
    if (!(out = malloc(len + hits * ml + 1))) {
        free(text);
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    }
    for (char *line = text, *end; line < text + len; line = end) {
        end = memchr(line, '\n', (size_t)(text + len - line));
        end = end ? end + 1 : text + len;
        if (key_line(line, end, key, klen)) {
            memcpy(out + n, mark, ml);
            n += ml;
        }
        memcpy(out + n, line, (size_t)(end - line));
        n += (size_t)(end - line);
    }
    if (hits)
        st = nl_file_write_atomic(path, out, n, err);
    free(text);
    free(out);
    if (st == NL_OK && hits)
        st = nl_auth_reload(nl_net_auth(c->net), err);
    return st;
}

/* A "# banned: WHY: KEY ..." line (ban_key's) into b: 1, or 0 when it is
 * not one. WHY may hold ": " itself, and the banned line may go on with a
 * comment that names another key ("KEY node # replaces: OTHER"): the key
 * is the first word after a ": " that is a whole public key (40 Z85
 * characters that decode). WHY is the coordinator's own text, which names
 * no key. */
static int parse_ban(const char *line, size_t len, cban *b)
{
    static const char tag[] = "# banned: ";
    const size_t tl = sizeof tag - 1;
    if (len < tl || memcmp(line, tag, tl) != 0)
        return 0;
    const char *key = NULL, *end = line + len;
    for (const char *p = line + tl; !key && p + 2 + NL_KEY_Z85_LEN <= end; p++) {
        const char *k = p + 2;
        if (p[0] != ':' || p[1] != ' ' ||
            (k + NL_KEY_Z85_LEN < end && k[NL_KEY_Z85_LEN] != ' ' && k[NL_KEY_Z85_LEN] != '\t'))
            continue;
        char z85[NL_KEY_Z85_LEN + 1];
        uint8_t raw[NL_KEY_BYTES];
        nl_error e = {0};
        memcpy(z85, k, NL_KEY_Z85_LEN);
        z85[NL_KEY_Z85_LEN] = '\0';
        if (nl_key_decode(raw, z85, &e) == NL_OK)
            key = k;
    }
    if (!key)
        return 0;
    memcpy(b->key, key, NL_KEY_Z85_LEN);
    b->key[NL_KEY_Z85_LEN] = '\0';
    const size_t wl = (size_t)(key - 2 - (line + tl));
    snprintf(b->why, sizeof b->why, "%.*s", (int)(wl < sizeof b->why ? wl : sizeof b->why - 1),
             line + tl);
    return 1;
}

void coord_bans_free(nl_coord *c)
{
    free(c->bans);
    c->bans = NULL;
    c->n_bans = 0;
}

nl_status coord_bans_read(nl_coord *c, nl_error *err)
{
    char path[4096], *text = NULL;
    size_t len = 0;
    if (c->o.plaintext)
        return NL_OK;
    snprintf(path, sizeof path, "%s/authorized_keys", c->o.state_dir);
    nl_status st = nl_file_read_all(path, 16u << 20, &text, &len, err);
    if (st != NL_OK)
        return st;
    int n = 0, cap = 0;
    cban *bans = NULL, b;
    for (char *line = text, *end; line < text + len; line = end) {
        end = memchr(line, '\n', (size_t)(text + len - line));
        end = end ? end + 1 : text + len;
        if (!parse_ban(line, (size_t)(end - line) - (end[-1] == '\n'), &b))
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 8;
            cban *p = realloc(bans, (size_t)cap * sizeof *p);
            if (!p) {
                st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
                break;
            }
            bans = p;
        }
        bans[n++] = b;
    }
    free(text);
    if (st != NL_OK) {
        free(bans);
        return st;
    }
    coord_bans_free(c);
    c->bans = bans;
    c->n_bans = n;
    return NL_OK;
}

void coord_quarantine(nl_coord *c, cnode *n, uint64_t job, const char *why)
{
    nl_error e = {0};
    if (c->observe) { /* /api/events: train_quarantine */
        json_t *o = json_pack("{s:s,s:I,s:s,s:s}", "event", "quarantine", "node", (json_int_t)n->id,
                              "key", n->key, "why", why);
        char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
        if (text)
            c->observe(c->observe_ctx, job, NL_JOB_RUNNING, "quarantined", text);
        free(text);
        json_decref(o);
    }
    NL_WARN("node %u (key %.40s): %s: quarantined, its key banned", n->id, n->key, why);
    if (!c->o.plaintext &&
        (ban_key(c, n->key, why, &e) != NL_OK || coord_bans_read(c, &e) != NL_OK))
        NL_ERROR("cannot ban node %u's key in %s/authorized_keys: %s", n->id, c->o.state_dir,
                 e.msg);
    c->quarantine = n->id;
    snprintf(c->quarantine_why, sizeof c->quarantine_why, "quarantined: %.300s", why);
    coord_generate_convicted(c, n, why); /* the generations it served are re-run */
}

void coord_on_join(nl_coord *c, const nl_rx *rx)
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
    if (old && old->took_from[0] && strcmp(old->took_from, j->data_endpoint) == 0 &&
        strcmp(old->endpoint, j->data_endpoint) != 0) {
        /* the node it took the key over from is alive: two processes run
         * with one key, each JOIN would take it from the other for ever */
        char msg[800];
        snprintf(msg, sizeof msg,
                 "key %.8s... is in use by live node %u (data %s), which joined with it after "
                 "this node (data %s): two nodes run with one key; stop one, or give each its "
                 "own (neuroctl keygen)",
                 j->pubkey, old->id, old->endpoint, j->data_endpoint);
        NL_WARN("JOIN refused: %s", msg);
        nl_sock_send_error(c->ctl, rx, NL_ERR_STATE, NL_MSG_JOIN, msg, &e);
        return;
    }
    char took[sizeof old->took_from] = "";
    if (old) {
        if (strcmp(old->endpoint, j->data_endpoint) != 0)
            snprintf(took, sizeof took, "%s", old->endpoint);
        coord_node_lost(c, old, NODE_LEFT, "joined again (restarted)");
    }
    if ((old = coord_node_by_rid_raw(c, rx->rid, rx->rid_len)))
        coord_node_lost(c, old, NODE_DEAD,
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
    snprintf(n->took_from, sizeof n->took_from, "%s", took);
    n->no_inbound = (j->flags & NL_JOIN_NO_INBOUND) != 0;
    n->memory = j->memory_bytes;
    n->gflops = j->gemm_gflops;
    n->threads = j->threads;
    n->joined = n->last_seen = nl_mono_s();
    coord_node_live(c, n);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_ACCEPT);
    m.u.accept =
        (nl_msg_accept){n->id, (uint32_t)c->o.heartbeat_ms, (uint32_t)c->o.node_timeout_ms};
    if (nl_sock_reply(c->ctl, rx, &m, &e) != NL_OK)
        NL_WARN("ACCEPT to node %u: %s", n->id, e.msg);
    nl_wire_msg_free(&m);
    NL_INFO("node %u joined: %s, %.1f GiB, %.1f GFLOP/s, %u threads, data %s%s, key %.8s...", n->id,
            n->device, (double)n->memory / (1 << 30), n->gflops, n->threads, n->endpoint,
            n->no_inbound ? " (no inbound: it dials its neighbours)" : "", n->key);
    coord_probe_start(c, n); /* --probe-inbound; the plans wait for it */
    c->last_plan_try = 0;
    c->replan_wanted |= COORD_REPLAN_JOINED;
}

int coord_dismiss_nodes(nl_coord *c, const char *why)
{
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    int sent = 0;
    for (int i = 0; i < c->n_nodes; i++) {
        cnode *n = &c->nodes[i];
        if (n->life != NODE_LIVE)
            continue;
        nl_wire_msg_reset(&m, NL_MSG_LEAVE);
        m.u.leave = (nl_msg_leave){n->id, why};
        sent += coord_send_node(c, n, &m) == NL_OK;
    }
    nl_wire_msg_free(&m);
    return sent;
}

void coord_on_leave(nl_coord *c, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid(c, rx);
    if (!n)
        return;
    char why[300], reason[256];
    snprintf(why, sizeof why, "left (%s)",
             nl_log_escape(reason, sizeof reason, rx->msg.u.leave.reason));
    coord_node_lost(c, n, NODE_LEFT, why);
}

void coord_on_heartbeat(nl_coord *c, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid(c, rx);
    nl_error e = {0};
    if (!n || n->id != rx->msg.u.heartbeat.node_id) {
        nl_sock_send_error(c->ctl, rx, NL_ERR_STATE, NL_MSG_HEARTBEAT, "unknown node: JOIN first",
                           &e);
        return;
    }
    coord_node_seen(c, n);
    n->hb = rx->msg.u.heartbeat;                               /* its figures, for the status */
    coord_link_heartbeat(c, n, &rx->msg.u.heartbeat);          /* its link speed */
    if (c->train_mem.training && n->stage >= 0 && n->loaded) { /* a stage's busy fraction */
        n->load_sum += rx->msg.u.heartbeat.load;
        n->load_n++;
    }
}

void coord_on_node_error(nl_coord *c, const nl_rx *rx)
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
        c->last_plan_try = nl_mono_s() + 5.0; /* do not spin on a broken load */
        return;
    }
    coord_fail_stage_jobs(c, why); /* the jobs it serves: those running on this plan */
}
