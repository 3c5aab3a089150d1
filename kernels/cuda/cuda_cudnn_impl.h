/* Inside the cuDNN module only (C++17, built with the frontend): what its
 * two sources share of one backend's nl_cudnn. cuda_cudnn.cpp owns the
 * handle, its creation and destruction, and the attention graphs;
 * cuda_cudnn_moe.cpp the experts' grouped GEMM graphs (cuDNN's MoE grouped
 * matmul), made on first use and freed with the handle. One workspace
 * serves both, grown to the largest graph's need (the one stream orders
 * their use of it). */
#pragma once

#include "kernels/cuda/cuda_cudnn.h"

#include <cuda_runtime.h>
#include <cudnn.h>

#include <stddef.h>

struct nl_cudnn_moe; /* cuda_cudnn_moe.cpp's graphs */

struct nl_cudnn_shared {
    int device = 0;
    cudaStream_t stream = nullptr;
    cudnnHandle_t handle = nullptr;
    void *workspace = nullptr; /* every graph's, grown by nl_cudnn_grow */
    size_t workspace_bytes = 0;
    bool attn = false;           /* attention through cuDNN (else the experts only) */
    bool experts = false;        /* NL_CUDA_EXPERTS=cudnn in a bf16 backend */
    nl_cudnn_moe *moe = nullptr; /* the experts' graphs, NULL until the first call */
};

/* cuda_cudnn.cpp: the shared part of a handle */
nl_cudnn_shared *nl_cudnn_shared_of(nl_cudnn *cd);
/* Grow a device buffer to at least `need` bytes (zeroed); the stream is
 * drained first (queued work may still read the old one). False when out
 * of memory (then the buffer is gone: *p NULL, *have 0). */
bool nl_cudnn_grow(nl_cudnn_shared *s, void **p, size_t *have, size_t need);

/* cuda_cudnn_moe.cpp: free the experts' graphs (safe on NULL) */
void nl_cudnn_moe_free(nl_cudnn_moe *m);
