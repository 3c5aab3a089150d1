/* Element types and tensor views shared by the model, checkpoints and the
 * wire. A tensor is a view: it never owns its data; the buffer or arena it
 * points into does. */
#ifndef NL_TENSOR_H
#define NL_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#define NL_MAX_DIMS 8

typedef enum nl_dtype {
    NL_DTYPE_F32 = 0,
    NL_DTYPE_F16,
    NL_DTYPE_BF16,
    NL_DTYPE_F64,
    NL_DTYPE_I8,
    NL_DTYPE_U8,
    NL_DTYPE_I16,
    NL_DTYPE_I32,
    NL_DTYPE_I64,
    NL_DTYPE_U32,
    NL_DTYPE_BOOL,
    NL_DTYPE_COUNT
} nl_dtype;

/* Bytes per element, 0 for an invalid dtype. */
size_t nl_dtype_size(nl_dtype dt);
/* Safetensors spelling ("F32", "I64", ...); NULL for an invalid dtype. */
const char *nl_dtype_name(nl_dtype dt);
/* Parse a safetensors dtype name. Returns 0 and sets *dt, or -1. */
int nl_dtype_parse(const char *name, nl_dtype *dt);

typedef struct nl_tensor {
    nl_dtype dtype;
    int ndim;
    int64_t shape[NL_MAX_DIMS];
    void *data; /* contiguous, row-major; not owned */
} nl_tensor;

/* Number of elements (1 for a scalar, ndim == 0). Returns -1 when a
 * dimension is negative or the product overflows int64. */
int64_t nl_shape_numel(const int64_t *shape, int ndim);

#endif
