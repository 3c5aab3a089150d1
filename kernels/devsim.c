/* placeholder replaced by the device simulator */
#include "backend_impl.h"
nl_status nl_devsim_backend_new(nl_backend **out, const nl_backend_opts *o, nl_error *err)
{
    (void)o;
    *out = NULL;
    return nl_error_set(err, NL_ERR_UNSUPPORTED, "cpu-devsim: not built yet");
}
