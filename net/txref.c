/* Zero-copy send buffers (see txref.h). */
#include "net/txref.h"

#include <stdint.h>
#include <time.h>

#include "base/clock.h"

static void txref_release(void *data, void *hint)
{
    (void)data;
    atomic_fetch_sub(&((nl_txref *)hint)->pending, 1);
}

void nl_txref_frame(nl_wire_frame *f, nl_txref *ref, void *data, nl_dtype dtype,
                    const int64_t *shape, int ndim)
{
    nl_wire_frame_set(f, data, dtype, shape, ndim);
    f->free_fn = txref_release;
    f->hint = ref;
    atomic_fetch_add(&ref->pending, 1);
}

bool nl_txref_idle(nl_txref *ref)
{
    return atomic_load(&ref->pending) == 0;
}

nl_status nl_txref_wait(nl_txref *ref, int timeout_ms, nl_error *err)
{
    int64_t deadline = nl_mono_ms() + timeout_ms;
    while (!nl_txref_idle(ref)) {
        if (timeout_ms >= 0 && nl_mono_ms() >= deadline)
            return nl_error_set(err, NL_ERR_TIMEOUT, "send buffer still in use after %d ms",
                                timeout_ms);
        nanosleep(&(struct timespec){0, 50000}, NULL);
    }
    return NL_OK;
}
