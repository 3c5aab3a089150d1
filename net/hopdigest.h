/* The digest of a training hop (DESIGN.md section 8, "Digests";
 * docs/protocol.md, "Hop digests"): BLAKE2b-256 (libsodium's
 * crypto_generichash) over the hop's header fields and its tensor frames'
 * bytes as sent. The sender puts it in the hop's `digest` field, the
 * receiver recomputes it over what came and refuses a hop whose digest
 * differs (NL_ERR_INTEGRITY); both keep the digests of the step under
 * way and report them to the coordinator with the step's GRAD_NORM, which
 * compares each sender's account with its receiver's.
 *
 * What is hashed, in this order, integers little-endian:
 *   job_id u64, step u64, microbatch u32, stage u32 (the stage that
 *   receives the hop), direction u32 (the message type: 30 ACTIVATION
 *   forward, 31 GRADIENT backward, 34 COUNT, 35 EVAL), the number of
 *   frames u32, then for each frame its length in bytes u64 and its bytes
 *   (numel x element size: exactly the tensor, no padding).
 * Pure functions; no allocation. */
#ifndef NL_HOPDIGEST_H
#define NL_HOPDIGEST_H

#include <stdbool.h>
#include <stdint.h>

#include "net/wire.h"

#define NL_HOP_DIGEST_BYTES 32
#define NL_HOP_DIGEST_HEX 64 /* the wire's form: lowercase hex */

/* The digest of hop m (ACTIVATION, GRADIENT, COUNT or EVAL, its frames
 * set) as received by stage `stage`. */
void nl_hop_digest(uint8_t out[NL_HOP_DIGEST_BYTES], const nl_wire_msg *m, uint32_t stage);

/* Compute m's digest for the receiving stage, write its hex form into
 * hex (65 bytes, owned by the caller and alive until m is encoded) and
 * point m's digest field at it; out (may be NULL) gets the bytes. */
void nl_hop_digest_set(nl_wire_msg *m, uint32_t stage, char hex[NL_HOP_DIGEST_HEX + 1],
                       uint8_t out[NL_HOP_DIGEST_BYTES]);

/* The receiver's check: out gets the digest of what came; a hop that
 * carries a digest must carry exactly that one (NL_ERR_INTEGRITY names
 * the hop). A hop without one (an older peer) is taken, its digest
 * recorded all the same. */
nl_status nl_hop_digest_check(const nl_wire_msg *m, uint32_t stage,
                              uint8_t out[NL_HOP_DIGEST_BYTES], nl_error *err);

/* Lowercase hex of a digest (65 bytes with the NUL). */
void nl_hop_digest_hex(char out[NL_HOP_DIGEST_HEX + 1], const uint8_t d[NL_HOP_DIGEST_BYTES]);

/* Whether d is all zero (the digest of no hop: a slot not filled). */
bool nl_hop_digest_none(const uint8_t d[NL_HOP_DIGEST_BYTES]);

#endif
