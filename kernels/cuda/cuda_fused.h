/* Private to kernels/cuda: the launchers of the CUDA backend's fused
 * decode kernels (cuda_fused.cu), called by the backend's slots
 * (cuda_slots.cu) and by tests/cuda_emu. Each queues its kernel on
 * `stream` (a cudaStream_t), allocates nothing, launches nothing for an
 * empty shape, and returns the cudaError_t of its launch
 * (cudaGetLastError) as an int, 0 on success; cudaErrorInvalidValue, with
 * nothing launched, for a shape outside the slot's contract. Shapes and
 * pointers are those of the slot of the same name in kernels/backend.h;
 * all pointers are device memory. This header includes no CUDA header. */
#ifndef NL_CUDA_FUSED_H
#define NL_CUDA_FUSED_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Each takes its weights in FP32 (router, experts) and, for bf16 != 0
 * (the bf16 backend's products: bf16 x bf16 summed in FP32, each
 * activation rounded to bf16 as read), optionally their bf16 copy
 * (router16, experts16: the same layout, read instead; NULL: the FP32
 * weights rounded as read, the same bits). */
/* One block per row: the RMSNorm (rmsnorm_forward's kernel and thread
 * count), the E router logits (warp per expert, lanes along d: gemm_rows'
 * dot), the softmax over them in shared memory (softmax_forward's passes
 * and thread count) and the top-k (moe_route's loop, one thread): each row
 * the bits of those separate slots. */
int nl_cuda_moe_norm_route(void *stream, float *xn, float *probs, int32_t *choice, float *w,
                           const float *x, const float *norm_w, const float *router,
                           const uint16_t *router16, int bf16, int N, int d, int E, int k,
                           float eps);
/* Warp per (row-choice, column j): the gate and up dot products of column
 * j of the chosen expert, lanes along d (gemm_grouped_rows' dot), then
 * SwiGLU. gu is not used. */
int nl_cuda_moe_gate_up(void *stream, float *hs, float *gu, const float *xn, const int32_t *choice,
                        const float *experts, const uint16_t *experts16, int bf16,
                        size_t expert_stride, int N, int k, int d, int F);
/* Warp per (row, column c): the k down-projection dots of column c, lanes
 * along F (gemm_grouped_rows' dot), added to x[n, c] weighted, one fused
 * multiply-add each in order of i (moe_combine's). ye is not used. */
int nl_cuda_moe_down_combine(void *stream, float *x, float *ye, const float *hs,
                             const int32_t *choice, const float *w, const float *experts,
                             const uint16_t *experts16, int bf16, size_t expert_stride, int N,
                             int k, int d, int F);

#ifdef __cplusplus
}
#endif

#endif
