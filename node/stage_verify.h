/* Verification by recompute, the node's part (docs/security.md, "Catching
 * a node that computes wrong"): what a stage keeps of the step under way
 * so that another node can redo one of its microbatches, and the redo.
 *
 * A stage in a training job keeps, until the coordinator's STEP, the
 * inputs of every microbatch of the step (the ACTIVATION's frames it
 * received, the GRADIENT it received), the step's route counts, and its
 * weights are still those the step began with: nl_stage_verify_case
 * describes microbatch mb from them. nl_verify_recompute builds the
 * stage's layers from those weights on another backend (a verifier's),
 * runs that microbatch's forward and backward as the stage's trainer
 * does, and returns the digests of the ACTIVATION and GRADIENT the stage
 * should have sent (net/hopdigest.h). On the same device class and
 * precision the digests are equal bit for bit for an honest stage.
 *
 * Across device classes (a GPU stage checked by a CPU node, or cpu by
 * cpu-devsim) they are not: the job then asks its stages to keep what
 * they send too (JOB_SUBMIT verify_outputs), the case carries the
 * stage's ACTIVATION and GRADIENT as sent (y, dx), and the verifier
 * compares its own with them: the largest elementwise difference over
 * the largest magnitude of the stage's tensor, at most
 * NL_VERIFY_CROSS_RTOL. Within it the verifier vouches for the stage's
 * bytes (it answers their digest, which the coordinator finds equal to
 * the stage's report when they are the bytes it sent); beyond it, it
 * answers the digest of its own, which differs.
 *
 * Ownership: a case's pointers are the stage's (valid until its next
 * message) except `weights`, which nl_stage_verify_case allocates and
 * nl_verify_case_free frees. */
#ifndef NL_NODE_STAGE_VERIFY_H
#define NL_NODE_STAGE_VERIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/model/config.h"
#include "kernels/backend.h"
#include "net/hopdigest.h"
#include "node/stage.h"

typedef struct nl_verify_case {
    const nl_config *cfg;
    int l0, l1; /* the stage's layers */
    bool has_embed, has_head;
    uint32_t stage; /* its index in the pipeline */
    uint64_t job, step;
    uint32_t mb;
    int mbB, T, M;
    float *weights; /* host copy of the stage's parameters at the step's start (owned) */
    size_t n_weights;
    const void *x; /* the input: I32 tokens [mbB, T] (first stage) or F32 [mbB, T, d] */
    const int32_t *targets, *docs, *labels, *lengths; /* as the ACTIVATION carried them */
    uint64_t loss_rows;
    const float *dy;       /* the GRADIENT received, F32 [mbB, T, d]; NULL on the last stage */
    const int64_t *counts; /* the step's route counts (layers x experts), or NULL (M == 1) */
    /* across device classes: what the stage sent, F32 [mbB, T, d] (its
     * ACTIVATION but on the last stage, its GRADIENT but on the first);
     * NULL: compared by digest, exactly */
    const float *y, *dx;
    /* --wire bf16: the hidden states crossed the wire rounded to bf16 (x,
     * dy, y and dx hold those values, widened), and the outputs' digests
     * are of their bf16 rounding, as the stage sent them */
    bool bf16;
} nl_verify_case;

/* The relative tolerance of a comparison across device classes: max |a -
 * b| over max |b| of each tensor (b the stage's). A CUDA stage equals a
 * CPU one within 1e-5 relative on logits (DESIGN section 7); a stage's
 * hidden states and gradients after a forward and a backward, within a
 * few 1e-6: 1e-4 leaves a margin and still finds a lie of 1e-3. */
#define NL_VERIFY_CROSS_RTOL 1e-4
/* ... with --wire bf16, where the stage's tensor came rounded to bf16:
 * one half-ulp of bf16 at the tensor's scale more (2^-8), as the
 * rounding alone moves an honest stage's value that far. */
#define NL_VERIFY_CROSS_RTOL_BF16 (NL_VERIFY_CROSS_RTOL + 0x1p-8)

/* Describe microbatch mb (the step's number, as on the wire: with the
 * stage's replicas on other nodes, one this replica ran) of step `step`
 * of training job `job` on stage s, whose forward and backward are done
 * and whose step is not applied yet (between its GRAD_NORM and the STEP):
 * NL_ERR_STATE otherwise. */
nl_status nl_stage_verify_case(nl_stage *s, uint64_t job, uint64_t step, uint32_t mb,
                               nl_verify_case *c, nl_error *err);
void nl_verify_case_free(nl_verify_case *c);

/* The relative tolerance of a comparison across device classes for c
 * (NL_VERIFY_CROSS_RTOL, or _BF16 with the bf16 wire). */
double nl_verify_cross_rtol(const nl_verify_case *c);

/* Redo c on be: fwd gets the digest of the ACTIVATION the stage sends on
 * (zero on the last stage), bwd that of the GRADIENT it sends back (zero
 * on the first); with c->y / c->dx, of the stage's own tensor when the
 * redo's is within NL_VERIFY_CROSS_RTOL of it, and *rel (NULL: unasked)
 * the larger relative difference (0 without them). */
nl_status nl_verify_recompute(nl_backend *be, const nl_verify_case *c,
                              uint8_t fwd[NL_HOP_DIGEST_BYTES], uint8_t bwd[NL_HOP_DIGEST_BYTES],
                              double *rel, nl_error *err);

/* ---- the verifier (node/stage_verify_worker.c) ----
 *
 * A node redoes the cases the coordinator sends it (VERIFY_CASE,
 * docs/protocol.md) on its stage's verifier. With nl_stage_opts.verify_be
 * (the node's), on that backend on a worker thread at the lowest priority
 * (nice 19), so its own stage keeps serving hops: push takes a case,
 * nl_stage_verify_fd wakes the node's loop when an answer is ready, pop
 * hands it back. Without one, on replica 0's backend on the caller's
 * thread (its training lanes wait, idle, meanwhile), inside push.
 *
 * It keeps what it built for a stage (the layers, a trainer, the weights
 * loaded) for the next cases of that stage: up to 4 stages of one job,
 * weights loaded again whenever a case's differ from those it holds (by
 * the name the coordinator gave them, else by their BLAKE2b digest); a
 * case that comes without weights names those it is to be redone on, and
 * is answered want_weights when none held are those (docs/protocol.md,
 * VERIFY_RESULT); all dropped by a case of another job,
 * a new plan (ASSIGN) and the end of the node's training job (nl_stage_verify_forget). */

/* Take a VERIFY_CASE (checked against its config and copied: m is the
 * caller's again on return); an error here is the case's refusal. */
nl_status nl_stage_verify_push(nl_stage *s, const nl_wire_msg *m, nl_error *err);
/* Readable when an answer may be ready (-1: no verifier thread). */
int nl_stage_verify_fd(const nl_stage *s);
/* The oldest case pushed, if redone (wait: once it is): 1 and *st NL_OK
 * with out its VERIFY_RESULT (its digests and the name of the case's
 * weights in hex, in the caller's hex), or *st and err why it could not
 * be redone; 0: none ready (or none pushed). */
int nl_stage_verify_pop(nl_stage *s, bool wait, nl_wire_msg *out,
                        char hex[3][NL_HOP_DIGEST_HEX + 1], nl_status *st, nl_error *err);
/* Drop what the verifier keeps: at once when no case is under way, else
 * before its next case (it does not wait). */
void nl_stage_verify_forget(nl_stage *s);

/* What the verifier did (the tests read it): cases taken, stages built,
 * weights loaded into a build, cases that came without weights redone on
 * those held, and such cases answered want_weights (none held). */
typedef struct nl_verify_stats {
    uint64_t cases, builds, loads, held, wanted;
} nl_verify_stats;
void nl_stage_verify_stats(const nl_stage *s, nl_verify_stats *out);

/* A case answered at once (push, then pop waiting): with no other case
 * under way. */
nl_status nl_verify_answer(nl_stage *s, const nl_wire_msg *m, nl_wire_msg *out,
                           char hex[3][NL_HOP_DIGEST_HEX + 1], nl_error *err);

#endif
