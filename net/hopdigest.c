/* Hop digests: BLAKE2b-256 over a training hop's fields and frames (see
 * hopdigest.h for exactly what is hashed). */
#include "net/hopdigest.h"

#include <sodium.h>
#include <string.h>

static void put_u32(crypto_generichash_state *h, uint32_t v)
{
    uint8_t b[4];
    for (int i = 0; i < 4; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    crypto_generichash_update(h, b, sizeof b);
}

static void put_u64(crypto_generichash_state *h, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    crypto_generichash_update(h, b, sizeof b);
}

void nl_hop_digest(uint8_t out[NL_HOP_DIGEST_BYTES], const nl_wire_msg *m, uint32_t stage)
{
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, NL_HOP_DIGEST_BYTES);
    put_u64(&h, m->u.hop.job_id);
    put_u64(&h, m->u.hop.step);
    put_u32(&h, m->u.hop.microbatch);
    put_u32(&h, stage);
    put_u32(&h, (uint32_t)m->type);
    put_u32(&h, (uint32_t)m->nframes);
    for (int i = 0; i < m->nframes; i++) {
        const nl_tensor *t = &m->frames[i].t;
        /* the tensor's bytes, from its dtype and shape: a received frame's
         * length was checked against them, a sent one is set from them */
        const uint64_t n = (uint64_t)nl_shape_numel(t->shape, t->ndim) * nl_dtype_size(t->dtype);
        put_u64(&h, n);
        if (n)
            crypto_generichash_update(&h, t->data, (unsigned long long)n);
    }
    crypto_generichash_final(&h, out, NL_HOP_DIGEST_BYTES);
}

void nl_hop_digest_hex(char out[NL_HOP_DIGEST_HEX + 1], const uint8_t d[NL_HOP_DIGEST_BYTES])
{
    sodium_bin2hex(out, NL_HOP_DIGEST_HEX + 1, d, NL_HOP_DIGEST_BYTES);
}

bool nl_hop_digest_none(const uint8_t d[NL_HOP_DIGEST_BYTES])
{
    uint8_t acc = 0;
    for (int i = 0; i < NL_HOP_DIGEST_BYTES; i++)
        acc |= d[i];
    return acc == 0;
}

void nl_hop_digest_set(nl_wire_msg *m, uint32_t stage, char hex[NL_HOP_DIGEST_HEX + 1],
                       uint8_t out[NL_HOP_DIGEST_BYTES])
{
    uint8_t d[NL_HOP_DIGEST_BYTES];
    nl_hop_digest(d, m, stage);
    nl_hop_digest_hex(hex, d);
    m->u.train_hop.digest = hex;
    if (out)
        memcpy(out, d, sizeof d);
}

nl_status nl_hop_digest_check(const nl_wire_msg *m, uint32_t stage,
                              uint8_t out[NL_HOP_DIGEST_BYTES], nl_error *err)
{
    char hex[NL_HOP_DIGEST_HEX + 1];
    nl_hop_digest(out, m, stage);
    const char *said = m->u.train_hop.digest;
    if (!said || !said[0])
        return NL_OK;
    nl_hop_digest_hex(hex, out);
    if (strlen(said) != NL_HOP_DIGEST_HEX || sodium_memcmp(hex, said, NL_HOP_DIGEST_HEX) != 0)
        return nl_error_set(err, NL_ERR_INTEGRITY,
                            "%s of job %llu step %llu microbatch %u: its digest %.16s... does not "
                            "match its bytes (%.16s...): corrupted or altered on the way",
                            nl_wire_type_name(m->type), (unsigned long long)m->u.hop.job_id,
                            (unsigned long long)m->u.hop.step, m->u.hop.microbatch, said, hex);
    return NL_OK;
}
