/* Per-element formulas shared by the CPU backend (compiled by gcc) and the
 * CUDA backend (compiled by nvcc): SiLU and its derivative, the SwiGLU
 * and GeGLU forward values and backward pairs, the RoPE angle (and YaRN's
 * scaled frequencies), the RoPE angle and rotation, the
 * online-softmax merge, the RMSNorm scale, the AdamW update of one
 * element, bf16 rounding, the sampling rule of a token and the top-k
 * choice of a mixture-of-experts router. Each
 * backend's loops and kernels call these, so the two compute the same
 * expressions in the same order (equal to about 1 ulp: nvcc fuses
 * multiply-adds where gcc, in C11 mode, does not, and the exponentials
 * differ; the sampling rule is equal bit for bit: it uses nl_expf on both
 * sides); tests/test_elem.c checks them against double-precision
 * references.
 *
 * Everything here is an inline function marked NL_HD: __host__ __device__
 * under nvcc, static inline under a C compiler. The exponential is
 * nl_elem_expf: the device's expf on a GPU, and on the host nl_expf below,
 * a branch-free polynomial that lets gcc vectorise the loops calling it
 * (glibc's expf does not vectorise without -ffast-math).
 *
 * The header includes no CUDA header and no project header. */
#ifndef NL_ELEM_H
#define NL_ELEM_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define NL_HD __host__ __device__ __forceinline__
#else
#define NL_HD static inline
#endif

/* ---------------------------------------------------------------- exp */

/* A product rounded on its own, never fused with an add into one FMA:
 * nvcc fuses a * b + c by default (-fmad=true), the host's ISO C does not,
 * so a formula that must give the host's float on a GPU (nl_expf, for the
 * sampling rule) writes its products with NL_MUL. __fmul_rn on a GPU (the
 * CUDA emulation's hides the product from g++'s contraction likewise). */
#ifdef __CUDA_ARCH__
#define NL_MUL(a, b) __fmul_rn((a), (b))
#else
#define NL_MUL(a, b) ((a) * (b))
#endif

/* exp(x) for the CPU's vectorised loops: range reduction by ln 2 in two
 * parts and a degree-6 polynomial (Cephes coefficients), within 2 ulp over
 * [-87.3, 88.3]; the same float on a GPU (no fused products, NL_MUL). Below -87.3 (where exp(x)
 * < 1.2e-38, the smallest normal float) it returns 0, so exp(-inf) = 0; above 88.3 it returns
 * exp(88.3) (about 2.2e38, not inf); NaN gives NaN. Branch-free (clamps and selects) so loops
 * calling it vectorise. */
NL_HD float nl_expf(float x)
{
    const float x0 = x;
    /* clamp by selects, round to nearest with the 1.5 * 2^23 shifter */
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23 */
    float t = NL_MUL(x, 1.44269504088896341f) + shifter;
    int32_t tb;
    memcpy(&tb, &t, sizeof tb);
    const int32_t n = tb - 0x4B400000; /* the bits of the shifter */
    const float fn = t - shifter;
    float r = x - NL_MUL(fn, 0.693359375f);
    r -= NL_MUL(fn, -2.12194440e-4f);
    float p = 1.9875691500e-4f;
    p = NL_MUL(p, r) + 1.3981999507e-3f;
    p = NL_MUL(p, r) + 8.3334519073e-3f;
    p = NL_MUL(p, r) + 4.1665795894e-2f;
    p = NL_MUL(p, r) + 1.6666665459e-1f;
    p = NL_MUL(p, r) + 5.0000001201e-1f;
    p = NL_MUL(NL_MUL(p, r), r) + r + 1.0f;
    /* unsigned: for a NaN input n is garbage, and a signed shift of it
     * would be undefined (the select below returns NaN anyway) */
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x0 < -87.3f ? 0.0f : p * scale;
}

/* The exponential every formula below uses: the device's expf (within 2
 * ulp, exact 0 and inf at the ends) on a GPU, nl_expf on the host. */
NL_HD float nl_elem_expf(float x)
{
#ifdef __CUDA_ARCH__
    return expf(x);
#else
    return nl_expf(x);
#endif
}

/* ---------------------------------------------------------------- SiLU, SwiGLU */

/* sigmoid(x) = 1 / (1 + exp(-x)) */
NL_HD float nl_elem_sigmoid(float x)
{
    return 1.0f / (1.0f + nl_elem_expf(-x));
}

/* silu(x) = x sigmoid(x) = x / (1 + exp(-x)) */
NL_HD float nl_elem_silu(float x)
{
    return x / (1.0f + nl_elem_expf(-x));
}

/* silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x))) */
NL_HD float nl_elem_silu_grad(float x)
{
    const float sig = nl_elem_sigmoid(x);
    return sig * (1.0f + x * (1.0f - sig));
}

/* The SwiGLU value h = silu(g) u of one gate g and up projection u. */
NL_HD float nl_elem_swiglu(float g, float u)
{
    return g / (1.0f + nl_elem_expf(-g)) * u;
}

/* The SwiGLU backward pair for dh = dL/dh:
 *   dg = dh u silu'(g),  du = dh silu(g). */
NL_HD void nl_elem_swiglu_backward(float *dg, float *du, float g, float u, float dh)
{
    const float sig = nl_elem_sigmoid(g);
    const float silu = g * sig;
    *dg = dh * u * sig * (1.0f + g * (1.0f - sig));
    *du = dh * silu;
}

/* The GeGLU value h = gelu(g) u with the exact GELU, gelu(x) = x Phi(x) =
 * 0.5 x (1 + erf(x / sqrt 2)). */
NL_HD float nl_elem_geglu(float g, float u)
{
    return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)) * u;
}

/* The GeGLU backward pair: dg = dh u gelu'(g), du = dh gelu(g), where
 * gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi). */
NL_HD void nl_elem_geglu_backward(float *dg, float *du, float g, float u, float dh)
{
    const float cdf = 0.5f * (1.0f + erff(g * 0.70710678118654752f));
    const float pdf = expf(-0.5f * g * g) * 0.39894228040143268f;
    *dg = dh * u * (cdf + g * pdf);
    *du = dh * g * cdf;
}

/* ---------------------------------------------------------------- RoPE */

/* Frequency of pair i (0 <= i < hd/2) of a head of width hd, in double:
 * base^(-2i/hd). */
NL_HD double nl_elem_rope_freq(int i, int hd, float base)
{
    return pow((double)base, -2.0 * i / (double)hd);
}

/* Angle of pair i at position pos, in double: pos * base^(-2i/hd). Both
 * backends compute it (and its cos and sin) in double, then round to
 * float, so they agree to about an ulp even at long positions. */
NL_HD double nl_elem_rope_angle(int pos, int i, int hd, float base)
{
    return (double)pos * nl_elem_rope_freq(i, hd, base);
}

/* YaRN (DESIGN.md section 6): the scaled frequency of pair i, in double,
 * for factor s over an original context of L0 positions:
 *   r = L0 theta / (2 pi), gamma = clamp((r - beta_slow) / (beta_fast -
 *   beta_slow), 0, 1), theta' = (1 - gamma) theta / s + gamma theta. */
NL_HD double nl_elem_yarn_freq(int i, int hd, float base, double s, int L0, double beta_fast,
                               double beta_slow)
{
    const double theta = nl_elem_rope_freq(i, hd, base);
    const double r = (double)L0 * theta / (2.0 * 3.14159265358979323846);
    double gamma = (r - beta_slow) / (beta_fast - beta_slow);
    gamma = gamma < 0.0 ? 0.0 : gamma > 1.0 ? 1.0 : gamma;
    return (1.0 - gamma) * theta / s + gamma * theta;
}

/* YaRN's factor on cos and sin: 0.1 ln(s) + 1. */
NL_HD double nl_elem_yarn_mscale(double s)
{
    return 0.1 * log(s) + 1.0;
}

/* Rotate the pair (a, b) by the angle whose cosine and sine are c, s:
 *   (a, b) <- (a c - b s, a s + b c). */
NL_HD void nl_elem_rope_rotate(float *a, float *b, float c, float s)
{
    const float x = *a, y = *b;
    *a = x * c - y * s;
    *b = x * s + y * c;
}

/* ---------------------------------------------------------------- online softmax */

/* The online softmax (flash attention) keeps, per row, the running max m of
 * the scores seen so far and the running sum l = sum exp(s - m); an
 * accumulator weighted by exp(s - m) (attention's output row) goes with
 * them. Start with m = -INFINITY, l = 0. Finally lse = m + log(l).
 *
 * Step form (the CPU attention): given the max bmax of a new block of
 * scores, move m to max(m, bmax) and return the factor exp(m_old - m_new)
 * (0 while nothing was seen) by which l and the accumulator are scaled
 * before the block's terms exp(s - m_new) are added. If m stays -INFINITY
 * (every score so far is -inf) the caller must not form exp(s - m). */
NL_HD float nl_elem_online_max(float *m, float bmax)
{
    const float mold = *m;
    const float mnew = bmax > mold ? bmax : mold;
    *m = mnew;
    return mold == -INFINITY ? 0.0f : nl_elem_expf(mold - mnew);
}

/* Merge form (two partial states): fold a block whose own max is bm and
 * sum bl = sum exp(s - bm) into (m, l). Returns the factor for the running
 * accumulator, exp(m_old - m_new); *bscale (may be NULL) gets the factor
 * for the block's accumulator, exp(bm - m_new). A side that is still empty
 * (max -INFINITY) gets factor 0. */
NL_HD float nl_elem_online_merge(float *m, float *l, float bm, float bl, float *bscale)
{
    const float mold = *m;
    const float mnew = bm > mold ? bm : mold;
    const float corr = mold == -INFINITY ? 0.0f : nl_elem_expf(mold - mnew);
    const float bc = bm == -INFINITY ? 0.0f : nl_elem_expf(bm - mnew);
    *l = *l * corr + bl * bc;
    *m = mnew;
    if (bscale)
        *bscale = bc;
    return corr;
}

/* ---------------------------------------------------------------- RMSNorm */

/* 1 / sqrt(ss / C + eps) for the sum of squares ss of a row of width C
 * (an IEEE square root and division on both backends, not rsqrtf). */
NL_HD float nl_elem_rmsnorm_scale(float ss, int C, float eps)
{
    return 1.0f / sqrtf(ss / (float)C + eps);
}

/* ---------------------------------------------------------------- AdamW */

/* One AdamW step of one parameter p with moments m, v and raw gradient g
 * (see backend.h's adamw slot):
 *   g' = g grad_scale;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2
 *   p -= lr (m / bc1 / (sqrt(v / bc2) + eps) + wd p)
 * The decoupled decay uses p before this step's update. */
NL_HD void nl_elem_adamw(float *p, float *m, float *v, float g, float lr, float b1, float b2,
                         float eps, float wd, float bc1, float bc2, float grad_scale)
{
    const float gi = g * grad_scale;
    const float mi = b1 * *m + (1.0f - b1) * gi;
    const float vi = b2 * *v + (1.0f - b2) * gi * gi;
    *m = mi;
    *v = vi;
    *p -= lr * (mi / bc1 / (sqrtf(vi / bc2) + eps) + wd * *p);
}

/* ---------------------------------------------------------------- bf16 */

/* FP32 to bf16 bits by round-to-nearest-even: the top 16 bits after adding
 * 0x7fff plus the lowest kept bit. A value that rounds past the largest
 * finite bf16 becomes inf (as IEEE rounding does); inf stays inf; a NaN
 * stays a NaN of the same sign, made quiet (bit 6 of the bf16, the top
 * mantissa bit, set), since rounding could carry a signalling NaN's
 * payload into the exponent and make it inf. The same bits as the CPU's
 * _mm512_cvtneps_pbh and CUDA's __float2bfloat16_rn for every non-NaN. */
NL_HD uint16_t nl_elem_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bf16 bits to FP32 (exact). */
NL_HD float nl_elem_from_bf16(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---------------------------------------------------------------- sampling
 *
 * The next token from one row of logits l[0..V): greedy (temperature 0:
 * the largest logit, ties to the lower id, NaN never chosen, 0 when every
 * logit is NaN) or at temperature t with a uniform u in [0, 1): each
 * token's weight p_i = nl_expf((l_i - max) / t) (a float), summed in
 * double over chunks of NL_SAMPLE_CHUNK ids (each chunk in id order, the
 * chunks' sums then in chunk order: a GPU sums the chunks side by side to
 * the same bits); the token is the first id whose running sum exceeds
 * u * total, found by the chunks' running sum and then inside the chunk
 * (the chunk's last id of weight > 0 when rounding leaves the scan short;
 * the greedy id when u * total is never exceeded).
 *
 * Top-p (nucleus) sampling, top_p in (0, 1): the same draw over the
 * weights of at least tau only, where tau is the largest float whose
 * mass, M(tau) = the weights >= tau summed as the total is (chunk by
 * chunk, in id order), reaches top_p * total. So the nucleus is the most
 * likely tokens down to the first weight that brings their mass to top_p,
 * with every token of that weight (a tie at the edge is kept whole, not
 * cut by id). M falls as tau grows, so tau is found by bisection over the
 * bits of non-negative floats (their order is their bits' order): 31
 * evaluations of M, each a sum in a fixed order, so a GPU that evaluates
 * M with its chunks side by side finds the same tau and the same id (any
 * search that keeps M(lo) >= top_p * total > M(hi) until lo and hi are
 * adjacent ends at the same pair: CUDA evaluates 8 points inside (lo, hi)
 * a pass, 10 passes, or 4 above 131,072 ids, 14 passes). The
 * host, with the weights stored, guesses tau by a radix select and proves
 * it with two evaluations of M (nl_elem_sample_guess), bisecting only
 * where the proof fails: the same tau, about five passes over V weights.
 * No sort. top_p 0 or >= 1 keeps every token (tau 0: the bits of plain
 * temperature sampling).
 *
 * core/model/sampler.c and every backend's sample_rows slot use these
 * pieces, so a seeded generation gives the same ids wherever it samples.
 * nl_expf, not the device's expf: the same float on both sides. */
#define NL_SAMPLE_CHUNK 256

/* true when (v, i) beats the best so far (bv, bi) */
NL_HD int nl_elem_sample_better(float v, int i, float bv, int bi)
{
    return v > bv || (v == bv && i < bi);
}

/* a token's weight; 0 for a NaN logit (never sampled, as never greedy) */
NL_HD float nl_elem_sample_weight(float l, float lmax, float t)
{
    const float x = (l - lmax) / t;
    return x == x ? nl_expf(x) : 0.0f;
}

/* token i's weight: from w where the caller stored the weights (w[i] ==
 * nl_elem_sample_weight(l[i], lmax, t)), else computed */
NL_HD float nl_elem_sample_w(const float *l, const float *w, int i, float lmax, float t)
{
    return w ? w[i] : nl_elem_sample_weight(l[i], lmax, t);
}

/* the weights >= tau of ids [i0, i1) summed in id order (tau 0: all) */
NL_HD double nl_elem_sample_chunk(const float *l, const float *w, int i0, int i1, float lmax,
                                  float t, float tau)
{
    double s = 0.0;
    for (int i = i0; i < i1; i++) {
        const float p = nl_elem_sample_w(l, w, i, lmax, t);
        if (p >= tau)
            s += p;
    }
    return s;
}

/* inside the chunk [i0, i1) whose running sum reaches past target: acc is
 * the sum of the chunks before it. When rounding leaves the scan short,
 * the chunk's last id that can be drawn (weight > 0 and >= tau: never a
 * NaN logit's, never one outside the nucleus). */
NL_HD int nl_elem_sample_scan(const float *l, const float *w, int i0, int i1, float lmax, float t,
                              float tau, double acc, double target)
{
    int last = i1 - 1;
    for (int i = i0; i < i1; i++) {
        const float p = nl_elem_sample_w(l, w, i, lmax, t);
        if (p >= tau && p > 0.0f) {
            acc += p;
            last = i;
            if (acc > target)
                return i;
        }
    }
    return last;
}

NL_HD int nl_elem_sample_end(int i0, int V)
{
    return i0 + NL_SAMPLE_CHUNK < V ? i0 + NL_SAMPLE_CHUNK : V;
}

/* p where p >= tau, else +0, by a mask on p's bits: no branch, which a
 * pass over weights around tau would mispredict half the time */
NL_HD float nl_elem_sample_keep(float p, float tau)
{
    uint32_t b;
    memcpy(&b, &p, sizeof b);
    b &= 0u - (uint32_t)(p >= tau);
    memcpy(&p, &b, sizeof p);
    return p;
}

/* M(tau) over ids [0, V): the chunks' sums in chunk order. With stored
 * weights four chunks are summed side by side (each still in id order,
 * so the same bits), which the host's pipelines overlap. */
NL_HD double nl_elem_sample_mass(const float *l, const float *w, int V, float lmax, float t,
                                 float tau)
{
    double total = 0.0;
    int i0 = 0;
    if (w)
        for (; i0 + 4 * NL_SAMPLE_CHUNK <= V; i0 += 4 * NL_SAMPLE_CHUNK) {
            const float *a = w + i0, *b = a + NL_SAMPLE_CHUNK, *c = b + NL_SAMPLE_CHUNK,
                        *d = c + NL_SAMPLE_CHUNK;
            double sa = 0.0, sb = 0.0, sc = 0.0, sd = 0.0;
            for (int j = 0; j < NL_SAMPLE_CHUNK; j++) {
                sa += nl_elem_sample_keep(a[j], tau);
                sb += nl_elem_sample_keep(b[j], tau);
                sc += nl_elem_sample_keep(c[j], tau);
                sd += nl_elem_sample_keep(d[j], tau);
            }
            total += sa;
            total += sb;
            total += sc;
            total += sd;
        }
    for (; i0 < V; i0 += NL_SAMPLE_CHUNK)
        total += nl_elem_sample_chunk(l, w, i0, nl_elem_sample_end(i0, V), lmax, t, tau);
    return total;
}

/* whether top_p narrows the draw to a nucleus */
NL_HD int nl_elem_sample_nucleus(float top_p)
{
    return top_p > 0.0f && top_p < 1.0f;
}

/* the float whose bits are b (b below NL_SAMPLE_TAU_HI: non-negative and
 * finite) */
NL_HD float nl_elem_sample_tau(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}
#define NL_SAMPLE_TAU_HI 0x7F800000u /* +inf's bits: M(inf) = 0 (weights are finite) */

/* the nucleus threshold tau on one thread (see above); total is M(0).
 * The bisection keeps M(float(lo)) >= top_p * total > M(float(hi)). */
NL_HD float nl_elem_sample_threshold(const float *l, const float *w, int V, float lmax, float t,
                                     float top_p, double total)
{
    const double want = (double)top_p * total;
    uint32_t lo = 0, hi = NL_SAMPLE_TAU_HI;
    while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (nl_elem_sample_mass(l, w, V, lmax, t, nl_elem_sample_tau(mid)) >= want)
            lo = mid;
        else
            hi = mid;
    }
    return nl_elem_sample_tau(lo);
}

/* The host's shortcut to tau: a guess, then the proof. The guess is the
 * largest weight v whose weights >= v reach want when summed in any order,
 * found by a radix select on the weights' bits (non-negative floats order
 * as their bits): three passes over w, each summing the weights that share
 * the bits chosen so far into 2048 buckets by their next 11, 11 and 9
 * bits, from the top bucket down to the one whose mass reaches what is
 * still wanted. v is tau when M(v) >= want and M(next float above v) <
 * want, two passes of the rule's own sums (M only falls, so no larger
 * float reaches want). Returns v so proven, or -1 when rounding in the
 * guess's order put it elsewhere (the caller then bisects). Host only:
 * 16 KiB of buckets on the stack. */
NL_HD float nl_elem_sample_guess(const float *w, int V, double want)
{
    static const int shift[3] = {20, 9, 0}, width[3] = {11, 11, 9};
    double mass[2048];
    uint32_t prefix = 0; /* the bits chosen so far */
    double above = 0.0;  /* the weights above the chosen bits' */
    for (int lv = 0; lv < 3; lv++) {
        const int sh = shift[lv], nb = 1 << width[lv];
        for (int k = 0; k < nb; k++)
            mass[k] = 0.0;
        for (int i = 0; i < V; i++) { /* no branch: a weight of other bits adds +0 */
            uint32_t b;
            memcpy(&b, &w[i], sizeof b);
            const float p =
                nl_elem_sample_keep(w[i], b >> (sh + width[lv]) == prefix ? 0.0f : INFINITY);
            mass[b >> sh & (uint32_t)(nb - 1)] += p;
        }
        int k = nb - 1;
        while (k >= 0 && above + mass[k] < want)
            above += mass[k--];
        if (k < 0)
            return -1.0f;
        prefix = prefix << width[lv] | (uint32_t)k;
    }
    const float v = nl_elem_sample_tau(prefix);
    if (!(v > 0.0f) || prefix >= NL_SAMPLE_TAU_HI ||
        !(nl_elem_sample_mass(NULL, w, V, 0.0f, 1.0f, v) >= want) ||
        !(nl_elem_sample_mass(NULL, w, V, 0.0f, 1.0f, nextafterf(v, INFINITY)) < want))
        return -1.0f;
    return v;
}

/* w[i] = token i's weight, i in [0, V): one pass the host's compiler
 * vectorises (nl_expf is branch-free), before the sums that read them in
 * id order */
NL_HD void nl_elem_sample_weights(const float *l, float *w, int V, float lmax, float t)
{
#if defined(_OPENMP) && !defined(__CUDACC__)
#pragma omp simd
#endif
    for (int i = 0; i < V; i++)
        w[i] = nl_elem_sample_weight(l[i], lmax, t);
}

/* the greedy id of l[0..V) */
NL_HD int nl_elem_sample_argmax(const float *l, int V)
{
    float bv = -INFINITY;
    int bi = V;
    for (int i = 0; i < V; i++)
        if (nl_elem_sample_better(l[i], i, bv, bi))
            bv = l[i], bi = i;
    return bi < V ? bi : 0;
}

/* The whole rule on one thread (the host's): greedy when t == 0; top_p
 * in (0, 1) draws inside the nucleus. w: NULL, or room for V floats where
 * a draw stores the weights once, in one vectorised pass, for every sum
 * after it (without: each sum computes them again, scalar; the same id
 * either way), and a top-p draw guesses tau from them
 * (nl_elem_sample_guess: five passes where it holds, else the 31 of the
 * bisection over the stored weights). */
NL_HD int nl_elem_sample_row(const float *l, int V, float t, float top_p, double u, float *w)
{
    const int best = nl_elem_sample_argmax(l, V);
    if (!(t > 0.0f))
        return best;
    const float lmax = l[best];
    float tau = 0.0f;
    const float *ws = NULL;
    if (w) {
        nl_elem_sample_weights(l, w, V, lmax, t);
        ws = w;
    }
    if (nl_elem_sample_nucleus(top_p)) {
        const double total = nl_elem_sample_mass(l, ws, V, lmax, t, 0.0f);
        tau = w ? nl_elem_sample_guess(w, V, (double)top_p * total) : -1.0f;
        if (!(tau >= 0.0f))
            tau = nl_elem_sample_threshold(l, ws, V, lmax, t, top_p, total);
    }
    const double target = u * nl_elem_sample_mass(l, ws, V, lmax, t, tau);
    double acc = 0.0;
    for (int i0 = 0; i0 < V; i0 += NL_SAMPLE_CHUNK) {
        const int i1 = nl_elem_sample_end(i0, V);
        const double c = nl_elem_sample_chunk(l, ws, i0, i1, lmax, t, tau);
        if (acc + c > target)
            return nl_elem_sample_scan(l, ws, i0, i1, lmax, t, tau, acc, target);
        acc += c;
    }
    return best;
}

/* ---------------------------------------------------------------- top-k routing */

/* One token's routing: the k largest of the E router probabilities in
 * row, ties to the lower expert index, into choice[0..k), and their
 * weights renormalised to sum 1 into w[0..k). The rule of every routing
 * path (the CPU and CUDA backends' route slots and the layer's
 * host_routing mode), so each picks the same experts with the same
 * weights; 1 <= k <= E is the caller's to check. */
NL_HD void nl_elem_topk_row(int32_t *choice, float *w, const float *row, int E, int k)
{
    float sum = 0.0f;
    for (int i = 0; i < k; i++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < i; j++)
                taken |= choice[j] == e;
            if (!taken && (best < 0 || row[e] > row[best]))
                best = e;
        }
        choice[i] = best;
        sum += row[best];
    }
    for (int i = 0; i < k; i++)
        w[i] = row[choice[i]] / sum;
}

#endif
