/* Private to core/formats/safetensors*.c: the checks the reader (safetensors.c)
 * and the writer (safetensors_write.c) share. */
#ifndef NL_CORE_SAFETENSORS_IMPL_H
#define NL_CORE_SAFETENSORS_IMPL_H

#include "core/formats/safetensors.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* A name made safe to print: at most 80 bytes, non-printable bytes as '?'. */
static inline void show(char *dst, size_t n, const char *s)
{
    size_t i = 0, max = n - 4 < 80 ? n - 4 : 80;
    for (; s[i] && i < max; i++)
        dst[i] = s[i] >= 0x20 && s[i] < 0x7f ? s[i] : '?';
    if (s[i]) {
        memcpy(dst + i, "...", 3);
        i += 3;
    }
    dst[i] = '\0';
}

/* Bytes of a tensor, or -1 when the product overflows int64. */
static inline int64_t tensor_bytes(nl_dtype dt, int ndim, const int64_t *shape)
{
    int64_t numel = nl_shape_numel(shape, ndim);
    int64_t size = (int64_t)nl_dtype_size(dt);
    if (numel < 0 || size == 0 || numel > INT64_MAX / size)
        return -1;
    return numel * size;
}

static inline bool utf8_ok(const char *s)
{
    json_t *j = json_string(s);
    json_decref(j);
    return j != NULL;
}

/* Return a typed error from a function with an `nl_error *err`. */
#define FAIL(st, ...) return nl_error_set(err, st, __VA_ARGS__)

#endif
