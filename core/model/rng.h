/* Deterministic random numbers: xoshiro256** seeded through splitmix64,
 * with named streams so that any tensor (or row block of a table) can be
 * initialised on its own and still equal a whole-model init. */
#ifndef NL_RNG_H
#define NL_RNG_H

#include <stdint.h>

typedef struct nl_rng {
    uint64_t s[4];
    int has_spare; /* Box-Muller gives normals in pairs */
    double spare;
} nl_rng;

/* Seed a stream from (seed, stream). Equal inputs give equal sequences. */
void nl_rng_seed(nl_rng *r, uint64_t seed, uint64_t stream);
/* Stream id of a string (FNV-1a 64), for per-tensor streams. */
uint64_t nl_rng_hash(const char *s);
uint64_t nl_rng_u64(nl_rng *r);
/* Uniform in [0, 1) with 53 bits. */
double nl_rng_uniform(nl_rng *r);
/* Standard normal. */
double nl_rng_normal(nl_rng *r);
/* Uniform integer in [0, n), n > 0, without modulo bias. */
uint64_t nl_rng_below(nl_rng *r, uint64_t n);

#endif
