/* Zero-copy send buffers: nl_txref counts the sends still holding a
 * buffer. nl_txref_frame points a frame at data and takes a reference that
 * the transport drops when libzmq has finished with the bytes; reuse the
 * buffer only when nl_txref_wait says it is idle. Its own header so that
 * code which fills frames (the node's stage) needs no socket headers. */
#ifndef NL_TXREF_H
#define NL_TXREF_H

#include <stdatomic.h>
#include <stdbool.h>

#include "base/status.h"
#include "net/wire.h"

typedef struct nl_txref {
    atomic_int pending;
} nl_txref;

void nl_txref_frame(nl_wire_frame *f, nl_txref *ref, void *data, nl_dtype dtype,
                    const int64_t *shape, int ndim);
bool nl_txref_idle(nl_txref *ref);
nl_status nl_txref_wait(nl_txref *ref, int timeout_ms, nl_error *err);

#endif
