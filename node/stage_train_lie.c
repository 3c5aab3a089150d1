/* A test hook (test builds only, -DNL_TEST_HOOKS=ON; neuronode reads
 * NL_TEST_LIE, node_cli.c): a stage that computes wrong on a fraction of
 * its work, plausibly (finite values, the hop's digest made over what it
 * sends, so the wire's check passes), for the tests and the benchmark of
 * verification by recompute (docs/security.md, "Catching a node that
 * computes wrong"). Which outputs it falsifies is drawn from its seed, the
 * job, the step, the microbatch and the direction, so a run repeats.
 *
 *   bitflip   one low mantissa bit of one element of an output (forward or
 *             backward: every stage has one of them); with bf16 hops one
 *             of bf16's, which the wire's rounding keeps
 *   noise     every element of a forward output plus uniform noise of 1e-3
 *   stale     the previous step's forward output of the same microbatch
 *   skip      its input instead of its output (a stage of one layer skips
 *             that layer); the first stage, whose input is tokens, does not
 *   backward  one bit of a gradient it sends back; its forwards are honest
 *   verifier  it trains honestly, but as a verifier it answers a fraction
 *             of the cases it redoes with one bit of a digest flipped
 *   mute      it trains honestly but never hands over a case asked for
 *
 * NL_TEST_LIE_GEN=1 (with one of them) makes the stage lie in every
 * generation hop it sends too (nl_stage_gen_lie: each hidden value plus 1,
 * or the next token id), the generation a conviction re-runs.
 *
 * In a build without the hooks stage_train_lie does nothing. */
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "node/stage_train_impl.h"

int nl_stage_lie_kind(const char *s)
{
    static const char *const names[] = {"bitflip",  "noise",    "stale", "skip",
                                        "backward", "verifier", "mute"};
    for (int i = 0; s && i < 7; i++)
        if (strcmp(s, names[i]) == 0)
            return i + 1;
    return -1;
}

#ifdef NL_TEST_HOOKS

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Uniform in [0, 1) from the hook's seed and the output's coordinates. */
static double draw(uint64_t seed, uint64_t job, uint64_t step, uint32_t mb, int what)
{
    uint64_t h = mix(seed ^ mix(job ^ mix(step ^ mix(((uint64_t)mb << 8) | (uint64_t)what))));
    return (double)(h >> 11) * 0x1.0p-53;
}

/* A mantissa bit (the value stays finite) of one element, one the wire
 * keeps: with bf16 hops one of bf16's 7 (bits 16 to 22), else of 23. */
static void flip_bit(float *x, size_t n, uint64_t h, bool bf16)
{
    uint32_t u;
    size_t i = (size_t)(h % n);
    memcpy(&u, &x[i], sizeof u);
    u ^= 1u << (bf16 ? 16u + (unsigned)((h >> 32) % 7) : (unsigned)((h >> 32) % 23));
    memcpy(&x[i], &u, sizeof u);
}

static const char *const kind_name[] = {"",     "bitflip",  "noise",    "stale",
                                        "skip", "backward", "verifier", "mute"};

void stage_train_lie(nl_stage *s, stage_train *t, rjob *j)
{
    const nl_stage_lie *l = &s->o.lie;
    const bool fwd = j->out_type == NL_MSG_ACTIVATION, bwd = j->out_type == NL_MSG_GRADIENT;
    const size_t n = t->rows * t->d;
    if (l->kind == NL_LIE_NONE || l->kind >= NL_LIE_VERIFIER || !(fwd || bwd) ||
        j->mb >= (uint32_t)t->M)
        return;
    float *prev = NULL;
    if (l->kind == NL_LIE_STALE && fwd) { /* the honest output is kept for the next step */
        if (!t->lie_prev && !(t->lie_prev = calloc((size_t)t->M * n + t->M, sizeof(float))))
            return;
        prev = t->lie_prev + (size_t)j->mb * n;
    }
    /* a bit flip in whatever the stage sends (forward or backward); the
     * backward lie in gradients only; the others in forward outputs */
    const bool dir = l->kind == NL_LIE_BITFLIP || (l->kind == NL_LIE_BACKWARD) == bwd;
    const bool lies =
        dir && j->step >= l->from && draw(l->seed, t->job, j->step, j->mb, bwd) < l->rate;
    /* a stale output needs a step before it; a skip needs hidden states in */
    /* after the outputs, one mark per microbatch: an output is kept */
    const bool can = l->kind == NL_LIE_STALE ? prev && t->lie_prev[(size_t)t->M * n + j->mb] != 0.0f
                     : l->kind == NL_LIE_SKIP ? !t->has_embed
                                              : true;
    float *keep = NULL;
    if (prev && (keep = malloc(n * sizeof(float))))
        memcpy(keep, j->out, n * sizeof(float));
    if (lies && can) {
        const uint64_t h = mix(l->seed ^ mix(j->step * 131u + j->mb));
        switch (l->kind) {
        case NL_LIE_BITFLIP:
        case NL_LIE_BACKWARD:
            flip_bit(j->out, n, h, nl_stage_wire(s) == NL_WIRE_BF16);
            break;
        case NL_LIE_NOISE:
            for (size_t i = 0; i < n; i++)
                j->out[i] += 1e-3f * (float)((double)(mix(h + i) >> 11) * 0x1.0p-52 - 1.0);
            break;
        case NL_LIE_STALE:
            memcpy(j->out, prev, n * sizeof(float));
            break;
        case NL_LIE_SKIP:
            memcpy(j->out, j->x, n * sizeof(float));
            break;
        default:
            break;
        }
        NL_WARN("test hook: this stage lies (%s) in its %s of job %llu step %llu microbatch %u",
                kind_name[l->kind], bwd ? "GRADIENT" : "ACTIVATION", (unsigned long long)t->job,
                (unsigned long long)j->step, stage_train_mb_wire(t, j->mb));
    }
    if (keep) {
        memcpy(prev, keep, n * sizeof(float));
        t->lie_prev[(size_t)t->M * n + j->mb] = 1.0f;
        free(keep);
    }
}

bool stage_verify_mute(const nl_stage *s)
{
    if (s->o.lie.kind == NL_LIE_MUTE)
        NL_WARN("test hook: this stage withholds a case asked for verification");
    return s->o.lie.kind == NL_LIE_MUTE;
}

void stage_verify_lie(const nl_stage *s, uint64_t job, uint64_t step, uint32_t mb, uint32_t stage,
                      uint8_t fwd[NL_HOP_DIGEST_BYTES], uint8_t bwd[NL_HOP_DIGEST_BYTES])
{
    const nl_stage_lie *l = &s->o.lie;
    if (l->kind != NL_LIE_VERIFIER || draw(l->seed, job, step, mb, 2 + (int)stage) >= l->rate)
        return;
    uint8_t *d = nl_hop_digest_none(fwd) ? bwd : fwd;
    d[mix(l->seed ^ step) % NL_HOP_DIGEST_BYTES] ^= 1;
    NL_WARN("test hook: this node lies (verifier) about job %llu step %llu microbatch %u of "
            "stage %u",
            (unsigned long long)job, (unsigned long long)step, mb, stage);
}

void nl_stage_gen_lie(const nl_stage *s, nl_stage_out *o, size_t n)
{
    if (!s->o.lie.generate)
        return;
    if (o->kind == NL_STAGE_OUT_HIDDEN) /* far off: the next stages' tokens change */
        for (size_t i = 0; i < n; i++)
            o->data[i] += 1.0f;
    else if (o->kind == NL_STAGE_OUT_TOKEN)
        o->token = (o->token + 1) % (int32_t)s->model->cfg.vocab_size;
}

#else

void nl_stage_gen_lie(const nl_stage *s, nl_stage_out *o, size_t n)
{
    (void)s, (void)o, (void)n;
}

bool stage_verify_mute(const nl_stage *s)
{
    (void)s;
    return false;
}

void stage_train_lie(nl_stage *s, stage_train *t, rjob *j)
{
    (void)s;
    (void)t;
    (void)j;
}

void stage_verify_lie(const nl_stage *s, uint64_t job, uint64_t step, uint32_t mb, uint32_t stage,
                      uint8_t fwd[NL_HOP_DIGEST_BYTES], uint8_t bwd[NL_HOP_DIGEST_BYTES])
{
    (void)s, (void)job, (void)step, (void)mb, (void)stage, (void)fwd, (void)bwd;
}

#endif
