/* Private to the coordinator's verification by recompute: what
 * coord_train_verify.c (drawing, judging) and coord_train_verify_route.c
 * (where a case goes, what is sent) share. */
#ifndef NL_COORD_TRAIN_VERIFY_IMPL_H
#define NL_COORD_TRAIN_VERIFY_IMPL_H

#include "coordinator/coord_train_impl.h"
#include "net/hopdigest.h"

/* A drawn stage's weights at its step's start, handed over with the
 * first case of that node and step and shared by all of them (refs: the
 * cases); sent to each verifier once (to: those that have them). */
typedef struct cwts {
    int refs;
    uint8_t *buf; /* NULL until the first case brings them */
    nl_wire_frame fr;
    char hex[NL_HOP_DIGEST_HEX + 1]; /* their name (32 random bytes) */
    uint32_t to[4];
    int nto;
} cwts;

/* A verification under way. */
typedef struct cver {
    int64_t step;
    uint32_t mb;
    int stage;
    uint32_t node;     /* the stage's node */
    uint32_t verifier; /* 0: its case has not come yet */
    int held;          /* test builds: its case waits to go to the verifier (verify_lag) */
    int bare;          /* asked without weights (no_weights): its group's came with another */
    int asks;          /* want_weights answers (one is expected at most) */
    cwts *w;           /* its group's weights (a reference) */
    int cross;         /* no other node of the stage's device class: one of another compares
                          the tensors within a tolerance (node/stage_verify.h) */
    uint64_t epoch;
    double t0, sent;                      /* drawn; sent to its verifier */
    uint8_t want[2][NL_HOP_DIGEST_BYTES]; /* the ACTIVATION and GRADIENT the stage reported */
    uint8_t got[2][NL_HOP_DIGEST_BYTES];  /* ... and those it reported receiving */
    /* what its case must say of itself: the stage's row of the plan (its
     * layers [l0, l1), embedding, head) and the step's shape and loss rows,
     * as the coordinator sent them */
    uint32_t l0, l1, batch, seq, micro;
    bool embed, head;
    uint64_t loss_rows;
    /* arbitration: the first verifier found a mismatch, `verifier` is now
     * the arbiter; said: the first verifier's answer */
    uint32_t first;
    char said[2][NL_HOP_DIGEST_HEX + 1];
    /* the case, kept for an arbiter: its fields and its frames in buf
     * (frame 0, the weights, is w's) */
    nl_msg_verify_case hdr;
    nl_wire_frame fr[NL_WIRE_MAX_FRAMES];
    int nfr;
    uint8_t *buf;
} cver;

typedef struct cverify {
    cver *p;
    int n, cap;
    uint32_t next; /* the verifier to try first (round robin) */
} cverify;

/* Whether a live node other than `of` (and also_not) may redo a case of
 * of's: of its device class, or (any) of any. */
int verify_may(const cnode *n, const cnode *of, uint32_t also_not, int any);
/* Whether node of's cases go across device classes: no other node of its
 * class could redo them, and one of another could. */
int verify_cross_for(nl_coord *c, const cnode *of);
/* The node that redoes a case of node `of`'s stage `stage`: a standby of
 * the same device class (any: of any class) first, else another replica
 * of that stage, else another stage's node of that class, taken in turn;
 * NULL: none. */
cnode *verify_verifier_for(nl_coord *c, ctrain *t, int stage, const cnode *of, uint32_t also_not,
                           int any);
/* The verifier of v's case (of node from's stage): one its group's
 * weights went to, if it still may, else verify_verifier_for's. */
cnode *verify_verifier_of(nl_coord *c, ctrain *t, const cver *v, const cnode *from);
/* A group's weights from frame 0 of its first case: copied, and named.
 * 0, or -1 out of memory. */
int verify_wts_take(cwts *w, const nl_wire_frame *f);
/* Note that verifier `to` holds w (sent 1) or not (0). */
void verify_wts_mark(cwts *w, uint32_t to, int sent);
/* Drop a case's reference to its group's weights; *w NULL after. */
void verify_wts_release(cwts **w);
/* Keep a copy of a stage's case but for its weights (for an arbiter):
 * 0, or -1 out of memory. */
int verify_keep_case(cver *v, const nl_wire_msg *m, uint64_t bytes);
/* The kept case to node `to`, with the model's config and its weights'
 * name, and the weights unless `to` holds them: 0, or -1. */
int verify_send_case(nl_coord *c, cver *v, cnode *to);

#endif
