/* Private to node/: the pieces of verification by recompute that the
 * stage's side (stage_verify.c) and the verifier (stage_verify_worker.c) share: a
 * redo, the stage's layers and a trainer of one slot built on a backend,
 * which a verifier keeps between the cases of one stage (stage_verify_worker.c) and
 * nl_verify_recompute makes for one case only. */
#ifndef NL_NODE_STAGE_VERIFY_IMPL_H
#define NL_NODE_STAGE_VERIFY_IMPL_H

#include "core/model/model.h"
#include "core/train/train.h"
#include "node/stage_verify.h"

typedef struct verify_redo {
    nl_backend *be; /* borrowed */
    nl_model *m;
    nl_trainer *tr;
    float *x_d, *host; /* [mbB * T, d]: an input on the device, an output on the host */
} verify_redo;

/* Build r->m and r->tr for c's layers and microbatch shape on r->be (the
 * weights are not loaded): NL_ERR_SHAPE when c's weights are not as many
 * as those layers' parameters. */
nl_status verify_redo_make(verify_redo *r, const nl_verify_case *c, nl_error *err);
/* c's weights into r's layers. */
void verify_redo_load(verify_redo *r, const nl_verify_case *c);
/* Redo c on r (built for its layers and shape, its weights loaded): as
 * nl_verify_recompute. */
nl_status verify_redo_run(verify_redo *r, const nl_verify_case *c, uint8_t fwd[NL_HOP_DIGEST_BYTES],
                          uint8_t bwd[NL_HOP_DIGEST_BYTES], double *rel, nl_error *err);
/* Free what r holds (not its backend); safe twice. */
void verify_redo_free(verify_redo *r);

#endif
