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
 * Ownership: a case's pointers are the stage's (valid until its next
 * message) except `weights`, which nl_stage_verify_case allocates and
 * nl_verify_case_free frees. */
#ifndef NL_NODE_STAGE_VERIFY_H
#define NL_NODE_STAGE_VERIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/config.h"
#include "../kernels/backend.h"
#include "../net/hopdigest.h"
#include "stage.h"

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
} nl_verify_case;

/* Describe microbatch mb of step `step` of training job `job` on stage s,
 * whose forward and backward are done and whose step is not applied yet
 * (between its GRAD_NORM and the STEP): NL_ERR_STATE otherwise. */
nl_status nl_stage_verify_case(nl_stage *s, uint64_t job, uint64_t step, uint32_t mb,
                               nl_verify_case *c, nl_error *err);
void nl_verify_case_free(nl_verify_case *c);

/* Redo c on be: fwd gets the digest of the ACTIVATION the stage sends on
 * (zero on the last stage), bwd that of the GRADIENT it sends back (zero
 * on the first). */
nl_status nl_verify_recompute(nl_backend *be, const nl_verify_case *c,
                              uint8_t fwd[NL_HOP_DIGEST_BYTES], uint8_t bwd[NL_HOP_DIGEST_BYTES],
                              nl_error *err);

/* A verifier's answer to a VERIFY_CASE (docs/protocol.md): the case
 * checked against its config, redone on the device of stage s (replica
 * 0's; the stage's own training lanes wait, idle, meanwhile), and out
 * made the VERIFY_RESULT (its digests in hex, owned by the caller). */
nl_status nl_verify_answer(nl_stage *s, const nl_wire_msg *m, nl_wire_msg *out,
                           char hex[2][NL_HOP_DIGEST_HEX + 1], nl_error *err);

#endif
