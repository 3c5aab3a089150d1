/* cpu-devsim's private parts (kernels/devsim.c: memory and the table;
 * kernels/devsim_graph.c: the op slots a captured step may queue, and the
 * recording and replay of such steps). */
#ifndef NL_DEVSIM_IMPL_H
#define NL_DEVSIM_IMPL_H

#include "kernels/backend.h"

#include <stdint.h>

#define NL_DEVSIM_TAG ((uintptr_t)1 << 62)

typedef struct nl_ds_graph nl_ds_graph;

typedef struct nl_ds_ctx {
    nl_backend *cpu;     /* the CPU backend this one wraps */
    nl_ds_graph *rec;    /* the step being recorded (graph_begin), or NULL */
    const char *refused; /* the first slot called while recording that cannot be */
} nl_ds_ctx;

/* Tag a host pointer from the CPU backend; untag a device pointer. NULL
 * stays NULL. */
static inline void *nl_ds_tag(const void *p)
{
    return p ? (void *)((uintptr_t)p ^ NL_DEVSIM_TAG) : NULL;
}
#define nl_ds_untag nl_ds_tag

static inline nl_backend *nl_ds_cpu(nl_backend *be)
{
    return ((nl_ds_ctx *)be->ctx)->cpu;
}

/* While a step is recorded: note that `slot` was called (graph_end then
 * fails, as a CUDA capture does on a call that waits for the device) and
 * return 1, so the caller drops the call. 0 otherwise. */
int nl_devsim_refused(nl_backend *be, const char *slot);

/* Fill the recordable op slots and the graph slots. */
void nl_devsim_fill_graph_slots(nl_backend *be);

#endif
