/* The coordinator's node table: the slots of every node that joined, the
 * live ones' hash indexes (by routing id, node id and key), the expiry
 * list in order of the last heartbeat, a stage's nodes and replicas, and
 * a send to a node. Helpers of every layer of the coordinator, as
 * coord_base.c's are; they call no job code. */
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

/* ---------------------------------------------------------------- the node table
 *
 * Slots c->nodes[0, n_nodes) hold every node that joined (a slot that is
 * not live is reused). The live ones are found in three hash tables of
 * 2 n_nodes cells each (open addressing, linear probing, a cell holds a
 * slot or -1; removal shifts the cluster back, so no tombstones): by
 * routing id (every message), by node id (a stage's node) and by key (a
 * node that joins again). The cells are at least half empty, so a lookup
 * probes O(1) cells whatever the number of nodes. The hash is seeded at
 * random per coordinator: routing ids and keys come from the peers.
 *
 * Expiry: every heartbeat extends a node's life by the same timeout, so
 * the live nodes in order of last_seen are a list in which a heartbeat
 * moves its node to the end; the tick looks at the front only. A node a
 * send could not reach goes to the front, to be declared dead at once. */

enum { IDX_RID, IDX_ID, IDX_KEY };

static uint64_t hash_bytes(uint64_t seed, const void *p, size_t len)
{
    const uint8_t *b = p;
    uint64_t h = seed ^ 0xcbf29ce484222325ull; /* FNV-1a, then a 64-bit finaliser */
    for (size_t i = 0; i < len; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
}

/* The bytes a node is indexed by in table `kind`. */
static const void *node_key(const cnode *n, int kind, size_t *len)
{
    switch (kind) {
    case IDX_RID:
        *len = n->rid_len;
        return n->rid;
    case IDX_ID:
        *len = sizeof n->id;
        return &n->id;
    default:
        *len = strlen(n->key);
        return n->key;
    }
}

static int32_t *index_of(nl_coord *c, int kind)
{
    return kind == IDX_RID ? c->by_rid : kind == IDX_ID ? c->by_id : c->by_key;
}

/* The cell of table `kind` that holds the live node indexed by (key,
 * len), or the empty cell that ends its probe. */
static size_t index_probe(nl_coord *c, int kind, const void *key, size_t len)
{
    const int32_t *t = index_of(c, kind);
    const size_t mask = 2 * (size_t)c->n_nodes - 1;
    for (size_t i = hash_bytes(c->hash_seed, key, len) & mask;; i = (i + 1) & mask) {
        if (t[i] < 0)
            return i;
        size_t l;
        const void *k = node_key(&c->nodes[t[i]], kind, &l);
        if (l == len && memcmp(k, key, len) == 0)
            return i;
    }
}

static cnode *index_find(nl_coord *c, int kind, const void *key, size_t len)
{
    if (c->n_live == 0)
        return NULL;
    const int32_t s = index_of(c, kind)[index_probe(c, kind, key, len)];
    return s < 0 ? NULL : &c->nodes[s];
}

static void index_add(nl_coord *c, int kind, cnode *n)
{
    size_t len;
    const void *key = node_key(n, kind, &len);
    index_of(c, kind)[index_probe(c, kind, key, len)] = (int32_t)(n - c->nodes);
}

static void index_remove(nl_coord *c, int kind, cnode *n)
{
    int32_t *t = index_of(c, kind);
    const size_t mask = 2 * (size_t)c->n_nodes - 1;
    size_t len, i;
    const void *key = node_key(n, kind, &len);
    i = index_probe(c, kind, key, len);
    if (t[i] != (int32_t)(n - c->nodes))
        return; /* not there (a duplicate that coord_on_join refused) */
    /* backward shift: a later cell of the cluster moves into the hole when
     * its home is not within (hole, its cell] */
    for (size_t j = (i + 1) & mask; t[j] >= 0; j = (j + 1) & mask) {
        const void *k = node_key(&c->nodes[t[j]], kind, &len);
        const size_t home = hash_bytes(c->hash_seed, k, len) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t[i] = t[j];
            i = j;
        }
    }
    t[i] = -1;
}

cnode *coord_node_by_rid_raw(nl_coord *c, const uint8_t *rid, size_t rid_len)
{
    return index_find(c, IDX_RID, rid, rid_len);
}

cnode *coord_node_by_id(nl_coord *c, uint32_t id)
{
    return index_find(c, IDX_ID, &id, sizeof id);
}

cnode *coord_node_by_key(nl_coord *c, const char *key)
{
    return index_find(c, IDX_KEY, key, strlen(key));
}

cnode *coord_node_by_rid(nl_coord *c, const nl_rx *rx)
{
    cnode *n = coord_node_by_rid_raw(c, rx->rid, rx->rid_len);
    /* a connection that took over the routing id with another key is not the node */
    return n && (c->o.plaintext || strcmp(n->key, rx->peer) == 0) ? n : NULL;
}

cnode *coord_stage_node(nl_coord *c, int stage)
{
    if (!c->plan || stage < 0 || stage >= c->plan->n_stages || c->plan->stages[stage].node_id < 0)
        return NULL;
    return coord_node_by_id(c, (uint32_t)c->plan->stages[stage].node_id);
}

int coord_stage_replicas(const nl_coord *c, int stage)
{
    if (!c->plan || stage < 0 || stage >= c->plan->n_stages)
        return 0;
    const int r = c->plan->stages[stage].n_replicas;
    return r > 1 ? r : 1;
}

cnode *coord_stage_replica(nl_coord *c, int stage, int r)
{
    if (r == 0)
        return coord_stage_node(c, stage);
    if (r < 0 || r >= coord_stage_replicas(c, stage))
        return NULL;
    return coord_node_by_id(c, (uint32_t)c->plan->stages[stage].replicas[r]);
}

int coord_stage_first_live(nl_coord *c, int stage)
{
    for (int r = 0; r < coord_stage_replicas(c, stage); r++) {
        const cnode *n = coord_stage_replica(c, stage, r); /* a dead one is gone from the index */
        if (n && !n->unreachable)
            return r;
    }
    return -1;
}

cnode *coord_stage_unreached(nl_coord *c, int stage)
{
    for (int r = 0; r < coord_stage_replicas(c, stage); r++) {
        cnode *n = coord_stage_replica(c, stage, r);
        if (n && n->unreachable)
            return n;
    }
    return coord_stage_node(c, stage);
}

/* The free slots' min-heap. */
static void free_push(nl_coord *c, int32_t slot)
{
    int32_t *h = c->free_slots;
    int i = c->n_free++;
    for (; i > 0 && h[(i - 1) / 2] > slot; i = (i - 1) / 2)
        h[i] = h[(i - 1) / 2];
    h[i] = slot;
}

static int32_t free_pop(nl_coord *c)
{
    int32_t *h = c->free_slots;
    const int32_t top = h[0], last = h[--c->n_free];
    int i = 0;
    for (int k; (k = 2 * i + 1) < c->n_free; i = k) {
        if (k + 1 < c->n_free && h[k + 1] < h[k])
            k++;
        if (h[k] >= last)
            break;
        h[i] = h[k];
    }
    h[i] = last;
    return top;
}

/* Double the table (16 slots first) and rebuild the indexes; 0 when full
 * or out of memory (nothing changed then). */
static int grow_table(nl_coord *c)
{
    const int was = c->n_nodes, cap = was ? 2 * was : 16;
    if (cap > COORD_MAX_NODES)
        return 0;
    cnode *nodes = realloc(c->nodes, (size_t)cap * sizeof *nodes);
    if (nodes)
        c->nodes = nodes;
    int32_t *t[3], *fs = nodes ? realloc(c->free_slots, (size_t)cap * sizeof *fs) : NULL;
    if (fs)
        c->free_slots = fs;
    for (int k = 0; k < 3; k++)
        t[k] = fs ? malloc(2 * (size_t)cap * sizeof *t[k]) : NULL;
    if (!t[0] || !t[1] || !t[2]) {
        for (int k = 0; k < 3; k++)
            free(t[k]);
        return 0; /* the arrays grown stay, unused until the next try */
    }
    if (!c->hash_seed && getrandom(&c->hash_seed, sizeof c->hash_seed, 0) !=
                             (ssize_t)sizeof c->hash_seed) { /* the peers choose rids and keys */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        c->hash_seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30);
    }
    memset(nodes + was, 0, (size_t)(cap - was) * sizeof *nodes);
    free(c->by_rid);
    free(c->by_id);
    free(c->by_key);
    c->by_rid = t[0];
    c->by_id = t[1];
    c->by_key = t[2];
    c->n_nodes = cap;
    for (int k = 0; k < 3; k++)
        memset(t[k], 0xff, 2 * (size_t)cap * sizeof *t[k]); /* -1 */
    for (int i = 0; i < was; i++)
        if (nodes[i].life == NODE_LIVE)
            for (int k = 0; k < 3; k++)
                index_add(c, k, &nodes[i]);
    for (int i = was; i < cap; i++)
        free_push(c, i);
    return 1;
}

cnode *coord_node_take(nl_coord *c)
{
    if (c->n_free == 0 && !grow_table(c))
        return NULL;
    cnode *n = &c->nodes[free_pop(c)];
    memset(n, 0, sizeof *n);
    n->stage = -1;
    return n;
}

static void list_unlink(nl_coord *c, cnode *n)
{
    if (n->older >= 0)
        c->nodes[n->older].newer = n->newer;
    else
        c->oldest = n->newer;
    if (n->newer >= 0)
        c->nodes[n->newer].older = n->older;
    else
        c->newest = n->older;
    n->older = n->newer = -1;
}

static void list_append(nl_coord *c, cnode *n)
{
    const int32_t s = (int32_t)(n - c->nodes);
    n->older = c->newest;
    n->newer = -1;
    if (c->newest >= 0)
        c->nodes[c->newest].newer = s;
    else
        c->oldest = s;
    c->newest = s;
}

static void list_prepend(nl_coord *c, cnode *n)
{
    const int32_t s = (int32_t)(n - c->nodes);
    n->newer = c->oldest;
    n->older = -1;
    if (c->oldest >= 0)
        c->nodes[c->oldest].older = s;
    else
        c->newest = s;
    c->oldest = s;
}

void coord_node_live(nl_coord *c, cnode *n)
{
    if (c->n_live == 0)
        c->oldest = c->newest = -1;
    n->life = NODE_LIVE;
    for (int k = 0; k < 3; k++)
        index_add(c, k, n);
    list_append(c, n);
    c->n_live++;
}

void coord_node_unlive(nl_coord *c, cnode *n, int life)
{
    if (n->life != NODE_LIVE)
        return;
    for (int k = 0; k < 3; k++)
        index_remove(c, k, n);
    list_unlink(c, n);
    n->life = life;
    c->n_live--;
    free_push(c, (int32_t)(n - c->nodes));
}

void coord_node_seen(nl_coord *c, cnode *n)
{
    n->last_seen = nl_mono_s();
    if (n->unreachable || n->newer < 0)
        return; /* first, to be declared dead; or already the newest */
    list_unlink(c, n);
    list_append(c, n);
}

cnode *coord_node_oldest(nl_coord *c)
{
    return c->n_live > 0 && c->oldest >= 0 ? &c->nodes[c->oldest] : NULL;
}

void coord_nodes_free(nl_coord *c)
{
    for (int i = 0; c->probes > 0 && i < c->n_nodes; i++)
        coord_probe_stop(c, &c->nodes[i]);
    free(c->nodes);
    free(c->free_slots);
    free(c->by_rid);
    free(c->by_id);
    free(c->by_key);
    c->nodes = NULL;
    c->free_slots = c->by_rid = c->by_id = c->by_key = NULL;
    c->n_nodes = c->n_live = c->n_free = 0;
}

nl_status coord_send_node(nl_coord *c, cnode *n, nl_wire_msg *m)
{
    nl_error err = {0};
    const int type = m->type;
    nl_status st = nl_sock_send(c->ctl, n->rid, n->rid_len, m, &err);
    if (st != NL_OK && !n->unreachable) {
        /* a peer that is gone need not wait for its heartbeat timeout; the
         * next tick declares it dead (it goes first in the expiry list),
         * outside whatever loop sent this */
        n->unreachable = 1;
        snprintf(n->why, sizeof n->why, "cannot be reached (%s: %s)", nl_wire_type_name(type),
                 err.msg);
        if (n->life == NODE_LIVE) {
            list_unlink(c, n);
            list_prepend(c, n);
        }
    }
    return st;
}
