/* xoshiro256** with splitmix64 seeding (public-domain algorithms by
 * Blackman and Vigna, written from their description). */
#include "core/model/rng.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

void nl_rng_seed(nl_rng *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed ^ (stream * 0xD1B54A32D192ED03ULL);
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
    r->has_spare = 0;
    r->spare = 0.0;
}

uint64_t nl_rng_hash(const char *s)
{
    uint64_t h = 0xCBF29CE484222325ULL;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001B3ULL;
    }
    return h;
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t nl_rng_u64(nl_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double nl_rng_uniform(nl_rng *r)
{
    return (double)(nl_rng_u64(r) >> 11) * 0x1.0p-53;
}

double nl_rng_normal(nl_rng *r)
{
    if (r->has_spare) {
        r->has_spare = 0;
        return r->spare;
    }
    double u1, u2;
    do
        u1 = nl_rng_uniform(r);
    while (u1 <= 0.0);
    u2 = nl_rng_uniform(r);
    double rad = sqrt(-2.0 * log(u1));
    r->spare = rad * sin(2.0 * M_PI * u2);
    r->has_spare = 1;
    return rad * cos(2.0 * M_PI * u2);
}

uint64_t nl_rng_below(nl_rng *r, uint64_t n)
{
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do
        x = nl_rng_u64(r);
    while (x >= limit);
    return x % n;
}
