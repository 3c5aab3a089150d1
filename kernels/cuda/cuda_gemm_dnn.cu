/* The CUDA backend's expert GEMMs through cuDNN's MoE grouped matmul
 * (NL_CUDA_EXPERTS=cudnn; the private context: cuda_backend_impl.h):
 * gemm_grouped's bf16 calls of many rows (cuda_gemm.cu) offered to
 * cuda_cudnn_moe.cpp as cudnn_moe_desc.h describes them, with the
 * operands in bf16, and the host's record of each dispatch's total rows
 * that this needs. */
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cudnn_moe_desc.h"

extern "C" {
#include "base/log.h"
}

#include <string.h>

namespace nl_cu
{

/* ---------------------------------------------------------------- through cuDNN
 *
 * NL_CUDA_EXPERTS=cudnn (off by default; not yet run on a GPU): a bf16
 * gemm_grouped call of many rows, forward (trans_b, x W^T) or the
 * backward's dgrad (dY W), as one cuDNN MoE grouped matmul (cuda_cudnn.h)
 * that reads the offsets on the device: no host wait, one call per
 * projection. cuDNN sizes Token and Output by the dispatch's total rows,
 * offsets[groups], which the host knows without reading it: moe_route
 * wrote N k (route_note), kept until an upload, zero or free touches the
 * array. The activations are converted into the bf16 scratch (K columns
 * packed), the weights read from their bf16 copy; the Output is C itself
 * (FP32) where cuDNN builds that graph, else a bf16 scratch widened into C.
 * Anything else (offsets of unknown total, weights without a copy, a
 * layout cudnn_moe_desc.h does not give, cuDNN off, too old or refusing)
 * falls back to the module's path for the call, each reason logged once. */

void route_note(cuda_ctx *c, const int32_t *offsets, int groups, int64_t rows)
{
    if (c->experts_dnn)
        nl_moe_routes_note(&c->routes, offsets, groups, rows);
}

void route_forget(cuda_ctx *c, const void *p, size_t bytes)
{
    if (c->experts_dnn)
        nl_moe_routes_forget(&c->routes, p, bytes);
}

/* A call cuDNN does not take: counted, its reason logged the first time;
 * false (the caller's path runs). */
bool dnn_declined(cuda_ctx *c, const char *why)
{
    c->dnn_declined++;
    for (int i = 0; i < NL_CUDA_DNN_REASONS; i++) {
        if (c->dnn_said[i] && strcmp(c->dnn_said[i], why) == 0)
            return false;
        if (!c->dnn_said[i]) {
            c->dnn_said[i] = why; /* string constants only */
            nl_log_write(NL_LOG_WARN,
                         "%s: NL_CUDA_EXPERTS=cudnn: a grouped GEMM runs on the module's path: %s "
                         "(logged once)",
                         c->name, why);
            return false;
        }
    }
    return false;
}

bool aligned16(const void *p)
{
    return ((uintptr_t)p & (NL_MOE_ALIGN_BYTES - 1)) == 0;
}

/* The bf16 weights of every group as one operand (B's rows of ldb from B),
 * from their copy; NULL when no copy holds them. */
const uint16_t *dnn_weights(cuda_ctx *c, int trans_b, int N, int K, const float *B, int ldb,
                            size_t b_stride, int groups, const char **why)
{
    *why = "the experts' weights are not rows of one matrix";
    if (ldb < 1 || b_stride % (size_t)ldb != 0)
        return NULL;
    const size_t rows = (size_t)(groups - 1) * (b_stride / (size_t)ldb) + (trans_b ? N : K);
    *why = "the experts' weights span more than 2^31 rows";
    if (rows > INT32_MAX)
        return NULL;
    int rc = 0;
    const uint16_t *w =
        nl_cuda_bf16_weight_operand(&c->w, c->stream, B, (int)rows, trans_b ? K : N, ldb, &rc);
    launched_shape(c, rc, "gemm_grouped (cuDNN): convert the weights (%zu rows)", rows);
    *why = "the experts' weights have no bf16 copy";
    return w;
}

/* The call through cuDNN; false, nothing queued, when it falls back. */
bool dnn_grouped(cuda_ctx *c, int trans_b, int N, int K, const float *A, int lda, const float *B,
                 int ldb, size_t b_stride, float *C, int ldc, const int32_t *offsets, int groups)
{
    if (c->capturing) /* a graph built or a workspace grown drains the stream */
        return dnn_declined(c, "inside a CUDA graph capture");
    if (!c->cudnn)
        return dnn_declined(c, "cuDNN is not available (the log's cuDNN line says why)");
    const int64_t T = nl_moe_routes_total(&c->routes, offsets, groups);
    if (T == 0)
        return true;      /* an empty dispatch: no group has rows, C keeps its values */
    nl_moe_desc f32, b16; /* the Token packed: K columns */
    nl_moe_describe(&f32, trans_b, N, K, K, ldb, b_stride, ldc, groups, groups + 1, T, 4);
    if (f32.fallback)
        return dnn_declined(c, f32.fallback);
    nl_moe_describe(&b16, trans_b, N, K, K, ldb, b_stride, N, groups, groups + 1, T,
                    NL_MOE_BF16_BYTES);
    const size_t tok = ((size_t)T * K + 127) / 128 * 128; /* the bf16 Output after, aligned */
    if (tok > NL_CUDA_BF16_CONV_ELEMS)
        return dnn_declined(c, "more activations than the bf16 scratch holds");
    const bool b16_fits = tok + (size_t)T * N <= NL_CUDA_BF16_CONV_ELEMS;
    const char *why = NULL;
    const uint16_t *w = dnn_weights(c, trans_b, N, K, B, ldb, b_stride, groups, &why);
    if (!w)
        return dnn_declined(c, why);
    if (!aligned16(w) || !aligned16(offsets) || !aligned16(C) || !aligned16(c->conv))
        return dnn_declined(c, "an operand not 16-byte aligned");
    const int out = nl_cudnn_moe_plan(c->cudnn, &f32, b16.fallback || !b16_fits ? NULL : &b16);
    if (!out)
        return dnn_declined(c, "cuDNN declined (see its log line)");
    uint16_t *ob = c->conv + tok;
    launched_shape(c, nl_cuda_to_bf16_rows(c->stream, c->conv, K, A, lda, (int)T, K),
                   "gemm_grouped (cuDNN): convert %lld x %d (ld %d)", (long long)T, K, lda);
    if (c->sticky != NL_OK)
        return true; /* the slot has failed: nothing more to queue */
    if (!nl_cudnn_moe_run(c->cudnn, out == 4 ? &f32 : &b16, c->conv, w, offsets,
                          out == 4 ? (void *)C : (void *)ob))
        return dnn_declined(c, "cuDNN's execute failed (see its log line)");
    if (out != 4)
        launched_shape(c,
                       nl_cuda_unpack_bf16(c->stream, C, (int)T, ldc, ob, (int)T, N, 1, (int)T, N),
                       "gemm_grouped (cuDNN): widen the output (%lld x %d)", (long long)T, N);
    c->dnn_runs++;
    c->dnn_bf16_out += out != 4;
    return true;
}

} // namespace nl_cu
