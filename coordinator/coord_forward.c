/* The forward job: a client's token ids go to the first stage, through
 * the pipeline, and the last stage's logits come back as one RESULT that
 * the coordinator relays to the client. It keeps no state of its own.
 * With params.adapter (a LoRA adapter file under --checkpoint-root) the
 * stages must take the adapter first: that job runs as coord_embed.c's
 * requests do (coord_forward_adapted_submit). */
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"

static void forward_submit(nl_coord *c, const nl_rx *rx)
{
    if (coord_param(&rx->msg.u.job_submit, "adapter")) {
        coord_forward_adapted_submit(c, rx);
        return;
    }
    int B = 0, T = 0;
    const char *bad = coord_check_tokens(c, rx, &B, &T);
    if (bad) {
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, bad, NULL);
        return;
    }
    cjob *j = coord_job_new(c, rx, &coord_forward_ops);
    if (!j)
        return;
    coord_status_to(c, j->rid, j->rid_len, j->id, NL_JOB_RUNNING, 0.0, "running", NULL);
    if (coord_send_tokens(c, j, 0, 0, rx->msg.frames[0].t.data, B, T) != NL_OK)
        coord_fail_unreachable_first(c, j);
}

/* The last stage's RESULT: to the client, and the job is done. */
static void forward_on_message(nl_coord *c, cjob *j, const nl_rx *rx)
{
    if (rx->msg.type != NL_MSG_RESULT || !coord_from_last_stage(c, rx) || j->epoch != c->epoch)
        return;
    if (rx->msg.nframes != 1 || rx->msg.frames[0].t.dtype != NL_DTYPE_F32) {
        coord_job_fail(c, j, "the last stage's RESULT is not one F32 frame of logits");
        return;
    }
    coord_finish_with_result(c, j, rx);
}

const cjob_ops coord_forward_ops = {
    .kind = NL_JOB_FORWARD,
    .name = "forward",
    .takes = COORD_TAKES(NL_MSG_RESULT) | COORD_TAKES(NL_MSG_JOB_STATUS),
    .submit = forward_submit,
    .on_message = forward_on_message,
};
