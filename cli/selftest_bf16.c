/* neuroctl selftest --precision bf16: the bf16 column of the checks'
 * tolerances. A bf16 target rounds every GEMM operand to 8 significant
 * bits (u = 2^-8 relative) and accumulates in FP32, against an FP32
 * reference; every other op but attention (below) stays FP32 and keeps
 * its FP32 tolerance.
 *
 * The bounds (and the margins, measured with the CPU's bf16 GEMMs,
 * `neuroctl selftest --device cpu --precision bf16`, whose rounding is the
 * CUDA backend's: nearest even on the operands, FP32 sums):
 *   - gemm: |C - C_ref| <= (2u + u^2) sum_k |A||B| plus the FP32 sum's
 *     error, so 2u = 7.8e-3 of the error measure (relative to |A||B|);
 *     1e-2.
 *   - grouped GEMMs (judged against max |ref|, where random operands
 *     cancel by about sqrt(K)): 2u sqrt(K) with K up to 256 is 0.125;
 *     5e-2 holds with the measured errors of about 1e-2.
 *   - a model's router probabilities, logits, aux loss: a chain of GEMMs
 *     through two layers, about 5e-3 measured, but where bf16 flips an
 *     expert choice at a near-tie of layer 0 (allowed: near-ties are taken
 *     at 5e-2 in bf16) the token's later router probabilities and its
 *     logits move by a whole expert's term: 0.036 and 0.069 measured
 *     (seeds 3 and 1); 1e-1. Greedy near-ties likewise at 5e-2.
 *   - one layer's forward and gradients, three training steps: 1e-1 of the
 *     scale for outputs and gradients (a flipped expert choice moves a
 *     token's output by its whole expert term); each step's loss 1e-2
 *     relative (DESIGN: bf16 losses within 1e-2 of FP32); the weights after
 *     three AdamW steps move by about lr sign(g) where |g| is small, so a
 *     flipped sign is 2 lr (6e-3) of a scale near 0.06: 2e-1.
 *   - attention: a bf16 CUDA backend runs it through cuDNN's flash
 *     attention (kernels/cuda/cuda_cudnn.cpp) with bf16 Q, K, V, O and P:
 *     the bounds of cli/selftest_cudnn.c, 2e-2 forward and 5e-2 backward
 *     (shapes cuDNN is not given keep the module's FP32 kernels, well
 *     inside them).
 *   - decode logits 2e-1, as TF32's: a decode token whose top-2 router
 *     probabilities are near-tied may take another expert (the H100 gave
 *     0.126, seed 1; the decode check cannot see routing).
 *   - greedy ids: reported, not judged (a near-tie in bf16 sends the two
 *     decodes apart for good); the decode logits judge the decode.
 * This table is the bf16 column; a check not in it keeps its tolerance. */
#include <string.h>

#include "cli/selftest.h"

static const struct {
    const char *check;
    double tol;
} bf16_tols[] = {
    {"gemm", 1e-2},
    {"attention_forward", 2e-2},
    {"attention_masked_forward", 2e-2},
    {"attention_backward", 5e-2},
    {"attention_masked_backward", 5e-2},
    {"gemm_grouped", 5e-2},
    {"gemm_grouped_wgrad", 5e-2},
    {"model_router_probs", 1e-1},
    {"model_logits", 1e-1},
    {"model_aux_loss", 5e-2},
    {"model_decode_logits", 2e-1},
    {"model_greedy_ids", NL_SELFTEST_DECODE + 1},
    {"near_tie", 5e-2},
    {"layer_forward", 1e-1},
    {"layer_backward_dx", 1e-1},
    {"layer_backward_grads", 1e-1},
    {"train_loss", 1e-2},
    {"train_weights", 2e-1},
};

double nl_selftest_bf16_tol(const nl_selftest *c, const char *check, double tol)
{
    if (!c->bf16)
        return tol;
    for (size_t i = 0; i < sizeof bf16_tols / sizeof bf16_tols[0]; i++)
        if (strcmp(bf16_tols[i].check, check) == 0)
            return bf16_tols[i].tol > tol ? bf16_tols[i].tol : tol;
    return tol;
}
