/* Private to node/: the node's device (node_device.c), used by the event
 * loop in node.c when it starts. */
#ifndef NL_NODE_IMPL_H
#define NL_NODE_IMPL_H

#include <stdint.h>

#include "../kernels/backend.h"
#include "../kernels/comm.h"
#include "node.h"

typedef struct nl_node_device {
    /* one backend per replica (--device D[,D...]), owned by the caller once
     * set, even when the open failed after: nl_node_device_close */
    nl_backend *be[NL_NODE_MAX_REPLICAS];
    int n;           /* replicas opened */
    nl_comm *comm;   /* over be when n > 1, made and checked before the memory is measured */
    double gflops;   /* GEMM throughput of replica 0 at its probe size (or NL_TEST_GFLOPS) */
    int threads;     /* CPU threads: --threads, or the cores */
    uint64_t memory; /* offered: the smallest replica's (--memory, or free less the reserve) */
} nl_node_device;

/* Open every device of o->device, measure replica 0 and size the offer;
 * logs what it found. */
nl_status nl_node_device_open(nl_node_device *d, const nl_node_opts *o, nl_error *err);
/* Free the backends; safe on a zeroed or closed device. */
void nl_node_device_close(nl_node_device *d);

#endif
