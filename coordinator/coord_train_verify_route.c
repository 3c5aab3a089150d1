/* Where a case of verification by recompute goes (coord_train_verify.c
 * draws and judges): the verifier chosen for it, and what is sent to it.
 * A stage's weights travel once for the cases of one node and step: the
 * group's cwts holds them under a name of 32 random bytes, and a verifier
 * that was sent them gets later cases without them, naming them
 * (docs/protocol.md, VERIFY_CASE). A name, not a digest of their bytes:
 * hashing a stage's weights would hold the coordinator's loop, which the
 * pipeline waits on, for as long as copying them several times. */
#include <sodium.h>
#include <string.h>

#include "coordinator/coord_train_impl.h"
#include "coordinator/coord_train_verify_impl.h"
#include "net/hopdigest.h"

/* Whether two devices are of one class ("cpu", "cpu-devsim", "cuda"):
 * digests are compared exactly only on the same class. */
static int verify_same_class(const char *a, const char *b)
{
    const size_t n = strncmp(a, "cuda:", 5) == 0 ? 5 : strlen(a) + 1;
    return strncmp(a, b, n) == 0;
}

/* Whether a live node other than `of` (and also_not) may redo a case of
 * of's: of its device class, or (any) of any. */
int verify_may(const cnode *n, const cnode *of, uint32_t also_not, int any)
{
    return n && n->life == NODE_LIVE && !n->unreachable && n->id != of->id && n->id != also_not &&
           (any || verify_same_class(n->device, of->device));
}

/* Whether node of's cases go across device classes: no other node of
 * its class could redo them, and one of another could. */
int verify_cross_for(nl_coord *c, const cnode *of)
{
    int other = 0;
    for (int i = 0; i < c->n_nodes; i++) {
        const cnode *n = &c->nodes[i];
        if (verify_may(n, of, 0, 0))
            return 0;
        other |= verify_may(n, of, 0, 1);
    }
    return other;
}

void verify_wts_release(cwts **w)
{
    if (*w && --(*w)->refs == 0) {
        free((*w)->buf);
        free(*w);
    }
    *w = NULL;
}

/* The node that redoes a case of node `of`'s stage `stage`: a standby of
 * the same device class (any: of any class) first, else another replica
 * of that stage (it runs the same layers), else another stage's node (any
 * replica) of that class, taken in turn; NULL: none. */
cnode *verify_verifier_for(nl_coord *c, ctrain *t, int stage, const cnode *of, uint32_t also_not,
                           int any)
{
    const nl_plan *p = c->plan;
    const uint32_t next = t->ver->next;
    for (int i = 0; p && i < p->n_standby; i++) {
        cnode *n = coord_node_by_id(c, (uint32_t)p->standby[(i + next) % p->n_standby]);
        if (verify_may(n, of, also_not, any)) {
            t->ver->next++;
            return n;
        }
    }
    const int R = coord_stage_replicas(c, stage);
    for (int i = 0; i < R; i++) {
        cnode *n = coord_stage_replica(c, stage, (int)((i + next) % (uint32_t)R));
        if (verify_may(n, of, also_not, any)) {
            t->ver->next++;
            return n;
        }
    }
    for (int i = 0; i < t->stages; i++) {
        const int s = (int)((i + next) % (uint32_t)t->stages);
        for (int r = 0; s != stage && r < coord_stage_replicas(c, s); r++) {
            cnode *n =
                coord_stage_replica(c, s, (int)((r + next) % (uint32_t)coord_stage_replicas(c, s)));
            if (verify_may(n, of, also_not, any)) {
                t->ver->next++;
                return n;
            }
        }
    }
    return NULL;
}

/* v's group's weights from frame 0 of its case (the first of the group):
 * copied, and named (32 random bytes). 0, or -1 out of memory. */
int verify_wts_take(cwts *w, const nl_wire_frame *f)
{
    if (!(w->buf = malloc(f->len ? f->len : 1)))
        return -1;
    memcpy(w->buf, f->t.data, f->len);
    w->fr = *f;
    w->fr.t.data = w->buf;
    w->fr.free_fn = NULL; /* copied by the send */
    uint8_t d[NL_HOP_DIGEST_BYTES];
    randombytes_buf(d, sizeof d);
    nl_hop_digest_hex(w->hex, d);
    return 0;
}

/* Whether verifier `to` was sent w (and holds it, unless it says not). */
static int verify_wts_sent(const cwts *w, uint32_t to)
{
    for (int i = 0; i < w->nto; i++)
        if (w->to[i] == to)
            return 1;
    return 0;
}

void verify_wts_mark(cwts *w, uint32_t to, int sent)
{
    int k = 0;
    for (int i = 0; i < w->nto; i++) /* out, then (sent) in again last */
        if (w->to[i] != to)
            w->to[k++] = w->to[i];
    w->nto = k;
    if (!sent)
        return;
    if (w->nto == (int)(sizeof w->to / sizeof w->to[0])) /* the oldest goes */
        memmove(w->to, w->to + 1, (size_t)--w->nto * sizeof w->to[0]);
    w->to[w->nto++] = to;
}

/* The verifier of v's case: one its group's weights were sent to, if it
 * still may, else the next in turn (verifier_for). */
cnode *verify_verifier_of(nl_coord *c, ctrain *t, const cver *v, const cnode *from)
{
    for (int i = v->w->nto - 1; i >= 0; i--) {
        cnode *n = coord_node_by_id(c, v->w->to[i]);
        if (verify_may(n, from, 0, v->cross))
            return n;
    }
    return verify_verifier_for(c, t, v->stage, from, 0, v->cross);
}

/* Keep a copy of a stage's case (for an arbiter), but for its weights
 * (frame 0: its group's): 0, or -1 out of memory. */
int verify_keep_case(cver *v, const nl_wire_msg *m, uint64_t bytes)
{
    if (!(v->buf = malloc(bytes ? bytes : 1)))
        return -1;
    v->hdr = m->u.verify_case;
    v->hdr.config_json = NULL;
    v->hdr.weights = NULL;
    v->nfr = m->nframes;
    size_t off = 0;
    v->fr[0] = (nl_wire_frame){0};
    for (int f = 1; f < m->nframes; f++) {
        v->fr[f] = m->frames[f];
        memcpy(v->buf + off, m->frames[f].t.data, m->frames[f].len);
        v->fr[f].t.data = v->buf + off;
        v->fr[f].free_fn = NULL; /* copied by the send */
        off += m->frames[f].len;
    }
    return 0;
}

/* The kept case to node `to`, with the model's config and its weights'
 * name, and the weights unless `to` was sent them already: 0, or -1. */
int verify_send_case(nl_coord *c, cver *v, cnode *to)
{
    static const float none = 0.0f;
    static const int64_t zero[1] = {0};
    const int bare = verify_wts_sent(v->w, to->id);
    char *json = nl_config_to_json(&c->cfg);
    nl_wire_msg m;
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_VERIFY_CASE);
    m.u.verify_case = v->hdr;
    m.u.verify_case.config_json = json;
    m.u.verify_case.weights = v->w->hex;
    if (bare)
        nl_wire_frame_set(&m.frames[0], &none, NL_DTYPE_F32, zero, 1);
    else
        m.frames[0] = v->w->fr;
    uint64_t bytes = bare ? 0 : v->w->fr.len;
    for (int f = 1; f < v->nfr; f++) {
        m.frames[f] = v->fr[f];
        bytes += v->fr[f].len;
    }
    m.nframes = v->nfr;
    const int rc = json && coord_send_node(c, to, &m) == NL_OK ? 0 : -1;
    nl_wire_msg_free(&m);
    free(json);
    if (rc == 0) {
        verify_wts_mark(v->w, to->id, 1);
        v->sent = nl_mono_s();
        to->ver_bytes += bytes;
    }
    return rc;
}
