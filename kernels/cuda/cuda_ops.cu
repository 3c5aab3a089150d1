/* The CUDA backend's hand-written forward kernels (all but attention,
 * which has its own file): embedding, RMSNorm, RoPE, softmax, SwiGLU,
 * gather/copy rows, the MoE combine, and the row scaling the GEMM needs
 * when K == 0. Each is the twin of the CPU backend's loop in
 * kernels/cpu/cpu_backend.c, computing the same per-element formula
 * (kernels/elem.h) in the same order where it can.
 *
 * Layout of the work:
 * - row kernels: a block walks whole rows (blockIdx.x, then every
 *   gridDim.x-th row), its threads stride along the row. The grid is
 *   capped at MAX_BLOCKS, so any row count up to 2^31 - 1 works.
 * - reductions along a row (RMSNorm's sum of squares, softmax's max and
 *   sum) are warp butterflies and then one warp over the per-warp partials
 *   in shared memory: a fixed order, so every run gives the same bits, and
 *   every thread gets the same result. Block sizes are multiples of 32.
 * - offsets are size_t: row * width never overflows.
 * No atomics, no dynamic shared memory, no allocation. */
#include "kernels/cuda/cuda_ops.h"

#include "kernels/backend.h"
#include "kernels/elem.h"

#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>

namespace
{

#include "kernels/cuda/cuda_reduce.cuh"

constexpr int ROPE_THREADS = 128;

unsigned row_blocks(int rows)
{
    return (unsigned)rows < MAX_BLOCKS ? (unsigned)rows : MAX_BLOCKS;
}

/* ---------------------------------------------------------------- kernels */

__global__ void embedding_kernel(float *out, const int32_t *tokens, const float *table, int N,
                                 int C)
{
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *src = table + (size_t)tokens[n] * C;
        float *dst = out + n * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            dst[c] = src[c];
    }
}

/* out = inp * rstd * w, rstd = 1 / sqrt(mean(inp^2) + eps); in place is
 * fine (every element is read before the row is written). */
__global__ void rmsnorm_kernel(float *out, float *rstd, const float *inp, const float *w, int N,
                               int C, float eps)
{
    __shared__ float red[WARP];
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float r = block_rmsnorm_row(out + n * C, inp + n * C, w, C, eps, red, blockDim.x);
        if (rstd && threadIdx.x == 0)
            rstd[n] = r;
    }
}

/* One thread per (row, pair i): the angle pos * base^(-2i/hd), its cos and
 * sin in double (as the CPU does), then the pair i of every head. */
__global__ void rope_kernel(float *x, const int32_t *pos, int N, int row, int col0, int heads,
                            int hd, float base)
{
    __shared__ double freq[NL_BACKEND_MAX_HEAD_DIM / 2];
    const int half = hd / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        freq[i] = nl_elem_rope_freq(i, hd, base);
    __syncthreads();
    const size_t total = (size_t)N * half;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
        const size_t n = e / half;
        const int i = (int)(e % half);
        double s, c;
        sincos((double)pos[n] * freq[i], &s, &c);
        const float cf = (float)c, sf = (float)s;
        float *p = x + n * row + col0 + 2 * i;
        for (int h = 0; h < heads; h++)
            nl_elem_rope_rotate(&p[(size_t)h * hd], &p[(size_t)h * hd + 1], cf, sf);
    }
}

/* Row softmax (block_softmax_row, cuda_reduce.cuh). */
__global__ void softmax_kernel(float *x, int N, int C)
{
    __shared__ float red[WARP];
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x)
        block_softmax_row(x + n * C, C, red, blockDim.x);
}

__global__ void swiglu_kernel(float *out, const float *gu, int N, int F)
{
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *g = gu + n * 2 * (size_t)F;
        const float *u = g + F;
        float *o = out + n * F;
        for (int j = threadIdx.x; j < F; j += blockDim.x)
            o[j] = nl_elem_swiglu(g[j], u[j]);
    }
}

__global__ void gather_kernel(float *out, const float *src, const int32_t *idx, int n, int C)
{
    for (size_t i = blockIdx.x; i < (size_t)n; i += gridDim.x) {
        const float *s = src + (size_t)idx[i] * C;
        float *d = out + i * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            d[c] = s[c];
    }
}

__global__ void copy_rows_kernel(float *dst, int dst_stride, const float *src, int src_stride,
                                 int rows, int cols)
{
    for (size_t r = blockIdx.x; r < (size_t)rows; r += gridDim.x) {
        const float *s = src + r * src_stride;
        float *d = dst + r * dst_stride;
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            d[c] = s[c];
    }
}

/* Row n = b T + t of qkv into cache row b cap + pos[n], keys and values
 * (a captured step's cache write: the position is read here). */
__global__ void kv_store_kernel(float *kc, float *vc, const float *qkv, int stride, int k_col,
                                int v_col, const int32_t *pos, int rows, int T, int cap, int kv_dim)
{
    for (size_t n = blockIdx.x; n < (size_t)rows; n += gridDim.x) {
        const size_t dst = ((n / (size_t)T) * (size_t)cap + (size_t)pos[n]) * (size_t)kv_dim;
        const float *s = qkv + n * (size_t)stride;
        for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
            kc[dst + c] = s[k_col + c];
            vc[dst + c] = s[v_col + c];
        }
    }
}

/* The same into a bf16 cache, each value rounded to nearest even; with
 * pos NULL row n goes to position past + n % T (host-known positions). */
__global__ void kv_store_bf16_kernel(uint16_t *kc, uint16_t *vc, const float *qkv, int stride,
                                     int k_col, int v_col, const int32_t *pos, int past, int rows,
                                     int T, int cap, int kv_dim)
{
    for (size_t n = blockIdx.x; n < (size_t)rows; n += gridDim.x) {
        const size_t at = pos ? (size_t)pos[n] : (size_t)past + n % (size_t)T;
        const size_t dst = ((n / (size_t)T) * (size_t)cap + at) * (size_t)kv_dim;
        const float *s = qkv + n * (size_t)stride;
        for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
            kc[dst + c] = nl_elem_to_bf16(s[k_col + c]);
            vc[dst + c] = nl_elem_to_bf16(s[v_col + c]);
        }
    }
}

/* Row n = b T + t of qkv into row pos[n] of sequence b's own cache
 * (kseq[b], vseq[b]): floats, or bf16 bits rounded to nearest even. */
template <bool BF16>
__global__ void kv_store_seq_kernel(void *const *kseq, void *const *vseq, const float *qkv,
                                    int stride, int k_col, int v_col, const int32_t *pos, int rows,
                                    int T, int kv_dim)
{
    for (size_t n = blockIdx.x; n < (size_t)rows; n += gridDim.x) {
        const size_t b = n / (size_t)T, dst = (size_t)pos[n] * (size_t)kv_dim;
        const float *s = qkv + n * (size_t)stride;
        for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
            if (BF16) {
                static_cast<uint16_t *>(kseq[b])[dst + c] = nl_elem_to_bf16(s[k_col + c]);
                static_cast<uint16_t *>(vseq[b])[dst + c] = nl_elem_to_bf16(s[v_col + c]);
            } else {
                static_cast<float *>(kseq[b])[dst + c] = s[k_col + c];
                static_cast<float *>(vseq[b])[dst + c] = s[v_col + c];
            }
        }
    }
}

/* x[n, :] += w[n k + i] y[slot[n k + i], :] for i = 0 .. k-1, in that
 * order (the CPU's), each element kept in a register meanwhile. */
__global__ void moe_combine_kernel(float *x, const float *y, const int32_t *slot, const float *w,
                                   int N, int k, int C)
{
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        float *xr = x + n * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = xr[c];
            for (int i = 0; i < k; i++) { /* one fused multiply-add a term, as the fused
                                           * decode's down projection adds them */
                const size_t e = n * k + i;
                acc = fmaf(w[e], y[(size_t)slot[e] * C + c], acc);
            }
            xr[c] = acc;
        }
    }
}

__global__ void scale_rows_kernel(float *C, int ldc, int rows, int cols, float beta)
{
    for (size_t r = blockIdx.x; r < (size_t)rows; r += gridDim.x) {
        float *row = C + r * ldc;
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            row[c] = beta == 0.0f ? 0.0f : beta * row[c];
    }
}

int launched(void)
{
    return (int)cudaGetLastError();
}

/* ---------------------------------------------------------------- sampling */

constexpr int SAMPLE_THREADS = 256;
/* the chunk sums a block keeps (32 KiB of shared memory): K thresholds'
 * sums of up to 4096 / K chunks each */
constexpr int SAMPLE_SUMS = 4096;
static_assert(4 * (NL_SAMPLE_MAX_VOCAB / NL_SAMPLE_CHUNK) <= SAMPLE_SUMS,
              "K = 4 holds the largest vocabulary's chunks");

/* The rows of one launch, passed by value as the kernel's argument (1.5
 * KiB, within the 4 KiB every GPU takes): nothing is uploaded for them. */
struct sample_launch {
    nl_sample_row r[NL_CUDA_SAMPLE_LAUNCH_ROWS];
};

/* M(tau[j]) (elem.h's nl_elem_sample_mass) of a row for the nt <= K
 * thresholds tau[0 .. nt), in one pass over its weights: chunk c's nt
 * sums by one thread, each in id order (a weight below a threshold adds
 * nothing to its sum, as the rule skips it), into sums[j cap + c]; then
 * thread j sums threshold j's chunks in chunk order into m[j]: each the
 * host's bits. Every thread calls it; it ends with a barrier. */
template <int K>
__device__ void sample_masses(double *sums, double *m, const float *l, const float *w, int V,
                              float lmax, float t, const float *tau, int nt)
{
    constexpr int cap = SAMPLE_SUMS / K;
    const int chunks = (V + NL_SAMPLE_CHUNK - 1) / NL_SAMPLE_CHUNK;
    float tv[K];
#pragma unroll
    for (int j = 0; j < K; j++)
        tv[j] = j < nt ? tau[j] : INFINITY; /* never reached: weights are finite */
    for (int c = threadIdx.x; c < chunks; c += SAMPLE_THREADS) {
        const int i0 = c * NL_SAMPLE_CHUNK, i1 = nl_elem_sample_end(i0, V);
        double acc[K];
#pragma unroll
        for (int j = 0; j < K; j++)
            acc[j] = 0.0;
        for (int i = i0; i < i1; i++) {
            const float p = nl_elem_sample_w(l, w, i, lmax, t);
#pragma unroll
            for (int j = 0; j < K; j++)
                if (p >= tv[j])
                    acc[j] += p;
        }
#pragma unroll
        for (int j = 0; j < K; j++)
            if (j < nt)
                sums[j * cap + c] = acc[j];
    }
    __syncthreads();
    if ((int)threadIdx.x < nt) {
        double total = 0.0;
        for (int c = 0; c < chunks; c++)
            total += sums[threadIdx.x * cap + c];
        m[threadIdx.x] = total;
    }
    __syncthreads();
}

/* One block a row: elem.h's nl_elem_sample_row with its parallel parts
 * side by side. The greedy id by a tree over (value, id) pairs: "better"
 * is a total order, so any tree finds the sequential loop's id; each
 * chunk's sum by one thread in id order, the chunks' running sum and the
 * scan inside the chosen chunk by thread 0, in the host's order: the same
 * id, bit for bit. A top-p row's threshold tau is the largest float (by
 * its bits) whose mass M reaches top_p * total, M falling as tau grows:
 * the host's bisection keeps lo and hi with M(lo) >= want > M(hi) until
 * they are adjacent; here each pass evaluates M at K points spread inside
 * (lo, hi), all in one pass over the weights, and keeps the two around
 * the edge, so (lo, hi) shrinks (K + 1)-fold a pass (10 passes for K = 8,
 * up to 512 chunks, 14 for K = 4 above, where bisection takes 31) and ends at the same adjacent
 * pair: the same tau. Weights stored once in ws (V floats a block; NULL: computed again each pass,
 * the same bits). A block reads its own row only, so a row's id does not depend on the others of
 * its launch. */
template <int K>
__global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_kernel(int32_t *ids, const sample_launch rows, int V, float *ws)
{
    __shared__ float bv[SAMPLE_THREADS];
    __shared__ int bi[SAMPLE_THREADS];
    __shared__ double sums[SAMPLE_SUMS];
    __shared__ double m[K];
    __shared__ float tau_at[K];
    __shared__ uint32_t cand[K], bounds[2]; /* the points, and lo and hi */
    __shared__ int ncand;
    __shared__ double want;
    const float *l = rows.r[blockIdx.x].logits;
    const float t = rows.r[blockIdx.x].temperature, top_p = rows.r[blockIdx.x].top_p;
    const double u = rows.r[blockIdx.x].u;
    int32_t *out = ids + blockIdx.x;
    const int tid = threadIdx.x;
    float v = -INFINITY;
    int vi = V;
    for (int i = tid; i < V; i += SAMPLE_THREADS)
        if (nl_elem_sample_better(l[i], i, v, vi))
            v = l[i], vi = i;
    bv[tid] = v;
    bi[tid] = vi;
    __syncthreads();
    for (int h = SAMPLE_THREADS / 2; h > 0; h >>= 1) {
        if (tid < h && nl_elem_sample_better(bv[tid + h], bi[tid + h], bv[tid], bi[tid])) {
            bv[tid] = bv[tid + h];
            bi[tid] = bi[tid + h];
        }
        __syncthreads();
    }
    const int best = bi[0] < V ? bi[0] : 0;
    if (!(t > 0.0f)) {
        if (tid == 0)
            *out = best;
        return;
    }
    const float lmax = l[best];
    float *w = nullptr;
    if (tid == 0)
        tau_at[0] = 0.0f;
    if (nl_elem_sample_nucleus(top_p)) {
        if (ws) {
            w = ws + (size_t)blockIdx.x * V;
            for (int i = tid; i < V; i += SAMPLE_THREADS)
                w[i] = nl_elem_sample_weight(l[i], lmax, t);
        }
        __syncthreads();
        sample_masses<K>(sums, m, l, w, V, lmax, t, tau_at, 1);
        if (tid == 0) {
            want = (double)top_p * m[0];
            bounds[0] = 0;
            bounds[1] = NL_SAMPLE_TAU_HI;
        }
        __syncthreads();
        while (bounds[1] - bounds[0] > 1) { /* uniform: every thread reads after a barrier */
            if (tid == 0) {
                const uint32_t lo = bounds[0], d = bounds[1] - lo;
                const int n = d - 1 < (uint32_t)K ? (int)(d - 1) : K;
                for (int j = 0; j < n; j++) { /* strictly inside, increasing */
                    cand[j] = lo + (uint32_t)((uint64_t)(j + 1) * d / (uint64_t)(n + 1));
                    tau_at[j] = nl_elem_sample_tau(cand[j]);
                }
                ncand = n;
            }
            __syncthreads();
            sample_masses<K>(sums, m, l, w, V, lmax, t, tau_at, ncand);
            if (tid == 0) {
                int j = ncand - 1; /* the last point still reaching want */
                while (j >= 0 && !(m[j] >= want))
                    j--;
                if (j >= 0)
                    bounds[0] = cand[j];
                if (j + 1 < ncand)
                    bounds[1] = cand[j + 1];
            }
            __syncthreads();
        }
        if (tid == 0)
            tau_at[0] = nl_elem_sample_tau(bounds[0]);
    }
    __syncthreads();
    const float tau = tau_at[0];
    sample_masses<K>(sums, m, l, w, V, lmax, t, tau_at, 1);
    if (tid != 0)
        return;
    const int chunks = (V + NL_SAMPLE_CHUNK - 1) / NL_SAMPLE_CHUNK;
    const double target = u * m[0];
    double acc = 0.0;
    int id = best;
    for (int c = 0; c < chunks; c++) {
        if (acc + sums[c] > target) {
            const int i0 = c * NL_SAMPLE_CHUNK;
            id =
                nl_elem_sample_scan(l, w, i0, nl_elem_sample_end(i0, V), lmax, t, tau, acc, target);
            break;
        }
        acc += sums[c];
    }
    *out = id;
}

} // namespace

/* ---------------------------------------------------------------- launchers */

extern "C" int nl_cuda_embedding_forward(void *stream, float *out, const int32_t *tokens,
                                         const float *table, int N, int C)
{
    if (N <= 0 || C <= 0)
        return 0;
    embedding_kernel<<<row_blocks(N), row_threads(C, 256), 0, (cudaStream_t)stream>>>(out, tokens,
                                                                                      table, N, C);
    return launched();
}

extern "C" int nl_cuda_rmsnorm_forward(void *stream, float *out, float *rstd, const float *inp,
                                       const float *w, int N, int C, float eps)
{
    if (N <= 0 || C <= 0)
        return 0;
    rmsnorm_kernel<<<row_blocks(N), rmsnorm_threads(C), 0, (cudaStream_t)stream>>>(out, rstd, inp,
                                                                                   w, N, C, eps);
    return launched();
}

extern "C" int nl_cuda_rope_forward(void *stream, float *x, const int32_t *pos, int N, int row,
                                    int col0, int heads, int hd, float base)
{
    if (hd > NL_BACKEND_MAX_HEAD_DIM || row < 0 || col0 < 0 || heads < 0)
        return (int)cudaErrorInvalidValue;
    const int half = hd / 2;
    if (N <= 0 || half <= 0 || heads == 0)
        return 0;
    const size_t total = (size_t)N * half;
    const size_t want = (total + ROPE_THREADS - 1) / ROPE_THREADS;
    const unsigned blocks = want < MAX_BLOCKS ? (unsigned)want : MAX_BLOCKS;
    rope_kernel<<<blocks, ROPE_THREADS, 0, (cudaStream_t)stream>>>(x, pos, N, row, col0, heads, hd,
                                                                   base);
    return launched();
}

extern "C" int nl_cuda_softmax_forward(void *stream, float *x, int N, int C)
{
    if (N <= 0 || C <= 0)
        return 0;
    softmax_kernel<<<row_blocks(N), softmax_threads(C), 0, (cudaStream_t)stream>>>(x, N, C);
    return launched();
}

extern "C" int nl_cuda_sample_rows(void *stream, int32_t *ids, const nl_sample_row *rows, int n,
                                   int V, float *w, size_t w_bytes)
{
    if (n < 0 || V < 1 || V > NL_SAMPLE_MAX_VOCAB)
        return (int)cudaErrorInvalidValue;
    for (int i = 0; i < n; i++)
        if (!(rows[i].temperature >= 0.0f) || !(rows[i].top_p >= 0.0f && rows[i].top_p <= 1.0f) ||
            !(rows[i].u >= 0.0 && rows[i].u < 1.0))
            return (int)cudaErrorInvalidValue;
    for (int i0 = 0; i0 < n; i0 += NL_CUDA_SAMPLE_LAUNCH_ROWS) {
        const int m = n - i0 < NL_CUDA_SAMPLE_LAUNCH_ROWS ? n - i0 : NL_CUDA_SAMPLE_LAUNCH_ROWS;
        sample_launch b = {};
        for (int i = 0; i < m; i++)
            b.r[i] = rows[i0 + i];
        /* the launch's weights where they fit (the launches run in stream
         * order, so each may reuse them) */
        float *ws = w && (size_t)m * (size_t)V * sizeof(float) <= w_bytes ? w : nullptr;
        /* eight points a pass where their sums fit (up to 512 chunks), else four */
        if ((V + NL_SAMPLE_CHUNK - 1) / NL_SAMPLE_CHUNK <= SAMPLE_SUMS / 8)
            sample_kernel<8><<<m, SAMPLE_THREADS, 0, (cudaStream_t)stream>>>(ids + i0, b, V, ws);
        else
            sample_kernel<4><<<m, SAMPLE_THREADS, 0, (cudaStream_t)stream>>>(ids + i0, b, V, ws);
        const int e = launched();
        if (e != 0)
            return e;
    }
    return 0;
}

extern "C" int nl_cuda_swiglu_forward(void *stream, float *out, const float *gu, int N, int F)
{
    if (N <= 0 || F <= 0)
        return 0;
    swiglu_kernel<<<row_blocks(N), row_threads(F, 256), 0, (cudaStream_t)stream>>>(out, gu, N, F);
    return launched();
}

extern "C" int nl_cuda_gather_rows(void *stream, float *out, const float *src, const int32_t *idx,
                                   int n, int C)
{
    if (n <= 0 || C <= 0)
        return 0;
    gather_kernel<<<row_blocks(n), row_threads(C, 256), 0, (cudaStream_t)stream>>>(out, src, idx, n,
                                                                                   C);
    return launched();
}

extern "C" int nl_cuda_copy_rows(void *stream, float *dst, int dst_stride, const float *src,
                                 int src_stride, int rows, int cols)
{
    if (rows <= 0 || cols <= 0)
        return 0;
    if (dst_stride < 0 || src_stride < 0)
        return (int)cudaErrorInvalidValue;
    copy_rows_kernel<<<row_blocks(rows), row_threads(cols, 256), 0, (cudaStream_t)stream>>>(
        dst, dst_stride, src, src_stride, rows, cols);
    return launched();
}

extern "C" int nl_cuda_kv_store(void *stream, float *kc, float *vc, const float *qkv, int stride,
                                int k_col, int v_col, const int32_t *pos, int B, int T, int cap,
                                int kv_dim)
{
    if (B <= 0 || T <= 0 || kv_dim <= 0)
        return 0;
    if (stride < 0 || k_col < 0 || v_col < 0 || cap < 1 || (long long)B * T > INT_MAX)
        return (int)cudaErrorInvalidValue;
    kv_store_kernel<<<row_blocks(B * T), row_threads(kv_dim, 256), 0, (cudaStream_t)stream>>>(
        kc, vc, qkv, stride, k_col, v_col, pos, B * T, T, cap, kv_dim);
    return launched();
}

extern "C" int nl_cuda_kv_store_bf16(void *stream, uint16_t *kc, uint16_t *vc, const float *qkv,
                                     int stride, int k_col, int v_col, const int32_t *pos, int past,
                                     int B, int T, int cap, int kv_dim)
{
    if (B <= 0 || T <= 0 || kv_dim <= 0)
        return 0;
    if (stride < 0 || k_col < 0 || v_col < 0 || cap < 1 || past < 0 || (pos && past != 0) ||
        (!pos && (long long)past + T > cap) || (long long)B * T > INT_MAX)
        return (int)cudaErrorInvalidValue;
    kv_store_bf16_kernel<<<row_blocks(B * T), row_threads(kv_dim, 256), 0, (cudaStream_t)stream>>>(
        kc, vc, qkv, stride, k_col, v_col, pos, past, B * T, T, cap, kv_dim);
    return launched();
}

extern "C" int nl_cuda_kv_store_seq(void *stream, void *const *kseq, void *const *vseq, int bf16,
                                    const float *qkv, int stride, int k_col, int v_col,
                                    const int32_t *pos, int B, int T, int kv_dim)
{
    if (B <= 0 || T <= 0 || kv_dim <= 0)
        return 0;
    if (!kseq || !vseq || !pos || stride < 0 || k_col < 0 || v_col < 0 ||
        (long long)B * T > INT_MAX)
        return (int)cudaErrorInvalidValue;
    const unsigned blocks = row_blocks(B * T), threads = row_threads(kv_dim, 256);
    cudaStream_t st = (cudaStream_t)stream;
    if (bf16)
        kv_store_seq_kernel<true><<<blocks, threads, 0, st>>>(kseq, vseq, qkv, stride, k_col, v_col,
                                                              pos, B * T, T, kv_dim);
    else
        kv_store_seq_kernel<false><<<blocks, threads, 0, st>>>(kseq, vseq, qkv, stride, k_col,
                                                               v_col, pos, B * T, T, kv_dim);
    return launched();
}

extern "C" int nl_cuda_moe_combine(void *stream, float *x, const float *y, const int32_t *slot,
                                   const float *w, int N, int k, int C)
{
    if (N <= 0 || k <= 0 || C <= 0)
        return 0;
    moe_combine_kernel<<<row_blocks(N), row_threads(C, 256), 0, (cudaStream_t)stream>>>(x, y, slot,
                                                                                        w, N, k, C);
    return launched();
}

extern "C" int nl_cuda_scale_rows(void *stream, float *C, int ldc, int rows, int cols, float beta)
{
    if (rows <= 0 || cols <= 0)
        return 0;
    if (ldc < 0)
        return (int)cudaErrorInvalidValue;
    scale_rows_kernel<<<row_blocks(rows), row_threads(cols, 256), 0, (cudaStream_t)stream>>>(
        C, ldc, rows, cols, beta);
    return launched();
}
