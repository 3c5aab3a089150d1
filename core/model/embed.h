/* Embeddings (DESIGN.md section 7): the mean over a text's valid
 * positions of the final-normed states, L2-normalised. The one rule that
 * local `neuroctl embed`, a cluster's last stage and the coordinator all
 * apply: pooling, the padding's document ids, and the lengths' text form
 * a cluster's embedding job carries (JOB_SUBMIT params.lengths). */
#ifndef NL_EMBED_H
#define NL_EMBED_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

/* Bytes of params.lengths at most (the wire's limit on a string). */
#define NL_EMBED_LENGTHS_MAX 4096

/* out (d) = the mean of the first len rows of states (T, d), L2-normalised
 * (a zero mean stays zero). */
void nl_embed_pool(float *out, const float *states, int len, int d);

/* doc (B, T): 0 on each row's first lengths[b] positions, 1 on its pads
 * (a document of their own, so an encoder's valid positions never see them). */
void nl_embed_doc(int32_t *doc, const int32_t *lengths, int B, int T);

/* "3,17,1": lengths (B) as text into buf (cap bytes); NL_ERR_LIMIT when
 * it does not fit. */
nl_status nl_embed_format_lengths(char *buf, size_t cap, const int32_t *lengths, int B,
                                  nl_error *err);
/* The inverse, checked: exactly B integers in 1..T. */
nl_status nl_embed_parse_lengths(const char *s, int B, int T, int32_t *lengths, nl_error *err);

#endif
