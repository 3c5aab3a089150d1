/* Private to node/: the node's device (node_device.c), used by the event
 * loop in node.c when it starts. */
#ifndef NL_NODE_IMPL_H
#define NL_NODE_IMPL_H

#include <stdint.h>

#include "../kernels/backend.h"
#include "node.h"

typedef struct nl_node_device {
    nl_backend *be; /* owned by the caller once set, even when the open failed after */
    double gflops;  /* GEMM throughput at the backend's probe size (or NL_TEST_GFLOPS) */
    int threads;    /* CPU threads: --threads, or the cores */
    uint64_t memory; /* offered: --memory, or a GPU's free memory less the reserve */
} nl_node_device;

/* Open o->device, measure it and size the offer; logs what it found. */
nl_status nl_node_device_open(nl_node_device *d, const nl_node_opts *o, nl_error *err);

#endif
