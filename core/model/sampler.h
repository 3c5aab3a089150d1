/* Next-token sampling from logits: greedy, temperature, and top-p
 * (nucleus), drawn from a seeded stream so a run repeats exactly. */
#ifndef NL_SAMPLER_H
#define NL_SAMPLER_H

#include <stdint.h>

#include "base/status.h"
#include "core/model/rng.h"
#include "kernels/backend.h"

typedef struct nl_sampler {
    float temperature; /* 0: greedy (argmax, ties to the lower id) */
    float top_p;       /* in (0, 1]; 1 keeps the whole distribution */
    nl_rng rng;
    int vocab;
    float *probs; /* (vocab) scratch: a top-p draw's weights */
} nl_sampler;

/* Check the settings (temperature >= 0 and finite, top_p in (0, 1]) and
 * allocate scratch for a vocabulary. */
nl_status nl_sampler_init(nl_sampler *s, int vocab, float temperature, float top_p, uint64_t seed,
                          nl_error *err);
void nl_sampler_free(nl_sampler *s);
/* Pick a token id from host logits (vocab): the rule of kernels/elem.h's
 * nl_elem_sample_row, greedy, temperature and top-p sampling (top-p below
 * 1 draws inside the nucleus: the most likely tokens down to the first
 * weight that brings their mass to top_p, a tie at that weight kept
 * whole). */
int32_t nl_sampler_sample(nl_sampler *s, const float *logits);
/* The same from one row of vocab logits in be's memory: sampling runs on
 * the backend through its sample_rows slot where it has one (only the id
 * comes back: no download of the logits), the same ids as
 * nl_sampler_sample; otherwise (no slot, a vocabulary over
 * NL_SAMPLE_MAX_VOCAB, NL_HOST_SAMPLING=1 in the environment) the logits are downloaded into host
 * (vocab floats; NULL only where nl_sampler_device says the backend samples) and sampled there. A
 * backend error is returned (and *id left unset). */
int nl_sampler_device(const nl_sampler *s, const nl_backend *be);
nl_status nl_sampler_next(nl_sampler *s, nl_backend *be, const float *logits, float *host,
                          int32_t *id, nl_error *err);
/* The next ids of n samplers at once (a batch's step): each smp[i] that
 * samples on the device (nl_sampler_device; NULL: one the caller samples
 * itself) from its row of logits[i] in be's memory, all of them in one
 * call of the backend's sample_rows, so the step waits once for their
 * ids, whatever their number. Each sampler draws from its own stream as
 * nl_sampler_next does, and its id is nl_sampler_next's. ids[i] gets the
 * id, or -1 for a sampler that did not sample here (the caller samples it
 * on the host); rows is the caller's scratch of n. A backend error is
 * returned (every id then -1). */
nl_status nl_sampler_next_batch(nl_sampler *const *smp, const float *const *logits, int n,
                                nl_backend *be, nl_sample_row *rows, int32_t *ids, nl_error *err);

/* The log-softmax of logits (vocab V, temperature 1) at `chosen` into
 * *chosen_lp, and the k most likely ids (descending, ties to the lower
 * id) with theirs into top_ids / top_lps (room for k). */
void nl_sampler_logprobs(const float *logits, int V, int32_t chosen, int k, float *chosen_lp,
                         int32_t *top_ids, float *top_lps);

#endif
