/* dtype table and shape arithmetic. */
#include "core/model/tensor.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} dtypes[NL_DTYPE_COUNT] = {
    [NL_DTYPE_F32] = {"F32", 4}, [NL_DTYPE_F16] = {"F16", 2},   [NL_DTYPE_BF16] = {"BF16", 2},
    [NL_DTYPE_F64] = {"F64", 8}, [NL_DTYPE_I8] = {"I8", 1},     [NL_DTYPE_U8] = {"U8", 1},
    [NL_DTYPE_I16] = {"I16", 2}, [NL_DTYPE_I32] = {"I32", 4},   [NL_DTYPE_I64] = {"I64", 8},
    [NL_DTYPE_U32] = {"U32", 4}, [NL_DTYPE_BOOL] = {"BOOL", 1},
};

size_t nl_dtype_size(nl_dtype dt)
{
    return (int)dt >= 0 && dt < NL_DTYPE_COUNT ? dtypes[dt].size : 0;
}

const char *nl_dtype_name(nl_dtype dt)
{
    return (int)dt >= 0 && dt < NL_DTYPE_COUNT ? dtypes[dt].name : NULL;
}

int nl_dtype_parse(const char *name, nl_dtype *dt)
{
    for (int i = 0; i < NL_DTYPE_COUNT; i++)
        if (name && strcmp(name, dtypes[i].name) == 0) {
            *dt = (nl_dtype)i;
            return 0;
        }
    return -1;
}

int64_t nl_shape_numel(const int64_t *shape, int ndim)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return -1;
        if (shape[i] != 0 && n > INT64_MAX / shape[i])
            return -1;
        n *= shape[i];
    }
    return n;
}
