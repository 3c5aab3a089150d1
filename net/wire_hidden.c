/* The wire's precision for hidden states and their gradients (wire.h,
 * DESIGN.md section 8): FP32 as computed, or bf16 rounded to nearest even
 * with the kernels' own rounding (kernels/elem.h), widened on receipt. */
#include <stdlib.h>
#include <string.h>

#include "kernels/elem.h"
#include "net/wire.h"

const char *nl_wire_precision_name(nl_wire_precision p)
{
    return p == NL_WIRE_FP32 ? "fp32" : p == NL_WIRE_BF16 ? "bf16" : NULL;
}

int nl_wire_precision_parse(const char *s, nl_wire_precision *p)
{
    if (s && strcmp(s, "fp32") == 0)
        *p = NL_WIRE_FP32;
    else if (s && strcmp(s, "bf16") == 0)
        *p = NL_WIRE_BF16;
    else
        return -1;
    return 0;
}

bool nl_wire_dtype_hidden(nl_dtype dt)
{
    return dt == NL_DTYPE_F32 || dt == NL_DTYPE_BF16;
}

nl_status nl_wire_frame_hidden(nl_wire_frame *f, nl_wire_precision p, const float *x,
                               const int64_t *shape, int ndim, uint16_t **buf, size_t *cap,
                               nl_error *err)
{
    if (p != NL_WIRE_BF16) {
        nl_wire_frame_set(f, x, NL_DTYPE_F32, shape, ndim);
        return NL_OK;
    }
    const size_t n = (size_t)nl_shape_numel(shape, ndim);
    if (n > *cap) {
        uint16_t *b = realloc(*buf, n * sizeof *b);
        if (!b)
            return nl_error_set(err, NL_ERR_NOMEM, "out of memory for %zu bf16 values", n);
        *buf = b;
        *cap = n;
    }
    uint16_t *b = *buf;
    for (size_t i = 0; i < n; i++)
        b[i] = nl_elem_to_bf16(x[i]);
    nl_wire_frame_set(f, b, NL_DTYPE_BF16, shape, ndim);
    return NL_OK;
}

void nl_wire_frame_widen(const nl_wire_frame *f, float *dst, size_t n)
{
    if (f->t.dtype != NL_DTYPE_BF16) {
        memcpy(dst, f->t.data, n * sizeof(float)); /* frames need not be aligned */
        return;
    }
    const unsigned char *src = f->t.data;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, sizeof h);
        dst[i] = nl_elem_from_bf16(h);
    }
}
