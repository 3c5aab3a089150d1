/* The bf16 packing of the cuDNN attention path (cuda_cudnn.h): strided FP32
 * rows to packed bf16 rows and back, rounded to nearest even, and a fill of
 * the padding mask's sequence lengths. Row mapping: cudnn_sdpa_desc.h's
 * nl_sdpa_strided_row, which tests/test_cudnn_desc.c checks on the CPU. */
#include "kernels/cuda/cuda_cudnn.h"
#include "kernels/cuda/cudnn_sdpa_desc.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace
{

const int threads = 256;

__global__ void pack_kernel(uint16_t *dst, int dst_cap, int dst_stride, const float *src,
                            int src_cap, int src_stride, int rows, int width, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / width;
        const int c = (int)(i % width);
        const float x = src[nl_sdpa_strided_row(r, rows, src_cap, src_stride) + c];
        dst[nl_sdpa_strided_row(r, rows, dst_cap, dst_stride) + c] =
            __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
}

__global__ void unpack_kernel(float *dst, int dst_cap, int dst_stride, const uint16_t *src,
                              int src_cap, int src_stride, int rows, int width, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / width;
        const int c = (int)(i % width);
        const uint16_t x = src[nl_sdpa_strided_row(r, rows, src_cap, src_stride) + c];
        dst[nl_sdpa_strided_row(r, rows, dst_cap, dst_stride) + c] =
            __bfloat162float(__ushort_as_bfloat16(x));
    }
}

__global__ void fill_kernel(int32_t *dst, int n, int value)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        dst[i] = value;
}

int blocks_for(int64_t n)
{
    const int64_t b = (n + threads - 1) / threads;
    return (int)(b < 65535 * 8 ? b : 65535 * 8); /* grid-stride beyond */
}

} // namespace

extern "C" int nl_cuda_pack_bf16(void *stream, uint16_t *dst, int dst_cap, int dst_stride,
                                 const float *src, int src_cap, int src_stride, int nseq, int rows,
                                 int width)
{
    const int64_t n = (int64_t)nseq * rows * width;
    if (n <= 0)
        return 0;
    pack_kernel<<<blocks_for(n), threads, 0, (cudaStream_t)stream>>>(
        dst, dst_cap, dst_stride, src, src_cap, src_stride, rows, width, n);
    return (int)cudaGetLastError();
}

extern "C" int nl_cuda_unpack_bf16(void *stream, float *dst, int dst_cap, int dst_stride,
                                   const uint16_t *src, int src_cap, int src_stride, int nseq,
                                   int rows, int width)
{
    const int64_t n = (int64_t)nseq * rows * width;
    if (n <= 0)
        return 0;
    unpack_kernel<<<blocks_for(n), threads, 0, (cudaStream_t)stream>>>(
        dst, dst_cap, dst_stride, src, src_cap, src_stride, rows, width, n);
    return (int)cudaGetLastError();
}

extern "C" int nl_cuda_fill_i32(void *stream, int32_t *dst, int n, int value)
{
    if (n <= 0)
        return 0;
    fill_kernel<<<(n + threads - 1) / threads, threads, 0, (cudaStream_t)stream>>>(dst, n, value);
    return (int)cudaGetLastError();
}
