/* Safetensors files: the checkpoint format (docs/checkpoint-format.md).
 *
 * Layout: an 8-byte little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
 *    "__metadata__": {"key": "value", ...}}
 * then the data section; offsets are relative to its start. Files written
 * here load with the `safetensors` Python package and PyTorch.
 *
 * Every file is untrusted: the header is checked in full (types, dtypes,
 * shapes, sizes, offsets, overlaps, names, limits) before any tensor is
 * touched, and every error names the tensor and the fault. */
#ifndef NL_SAFETENSORS_H
#define NL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "core/model/tensor.h"

/* Limits: the header JSON (as in the reference implementation) and a
 * tensor name, in bytes. */
#define NL_ST_MAX_HEADER 100000000ull
#define NL_ST_MAX_NAME 256

/* One tensor of a file. Owned by the header it came from. */
typedef struct nl_st_entry {
    const char *name;
    nl_dtype dtype;
    int ndim; /* 0 for a scalar */
    int64_t shape[NL_MAX_DIMS];
    uint64_t offset; /* from the start of the data section */
    uint64_t nbytes;
} nl_st_entry;

/* ---- the header, a pure function over bytes ---- */

typedef struct nl_st_header nl_st_header;

/* Parse and check the `len` bytes of header JSON (the bytes after the
 * 8-byte length) against a data section of `data_size` bytes. On success
 * *out is a new header the caller destroys. Errors: NL_ERR_LIMIT (header,
 * name or ndim too big), NL_ERR_FORMAT (bad JSON, structure, shape/size
 * mismatch, overlap), NL_ERR_DTYPE (unknown dtype), NL_ERR_RANGE (offsets
 * past the data), NL_ERR_NOMEM. */
nl_status nl_st_parse_header(const uint8_t *buf, size_t len, uint64_t data_size, nl_st_header **out,
                             nl_error *err);
void nl_st_header_destroy(nl_st_header **h);

/* Tensors in file order (by data offset); find is by exact name, NULL if
 * absent. */
size_t nl_st_header_count(const nl_st_header *h);
const nl_st_entry *nl_st_header_entry(const nl_st_header *h, size_t i);
const nl_st_entry *nl_st_header_find(const nl_st_header *h, const char *name);
/* __metadata__: value of `key` or NULL; pairs by index (0 ok, -1 out of
 * range). Strings are owned by the header. */
const char *nl_st_header_meta(const nl_st_header *h, const char *key);
size_t nl_st_header_meta_count(const nl_st_header *h);
int nl_st_header_meta_at(const nl_st_header *h, size_t i, const char **key, const char **value);

/* ---- reading a file ---- */

typedef struct nl_st_file nl_st_file;

/* Map `path` read-only and check it. The mapping lives until close; the
 * file must not be truncated meanwhile (checkpoints are replaced by
 * rename, never rewritten in place). Messages start with the path. */
nl_status nl_st_open(nl_st_file **out, const char *path, nl_error *err);
/* The same over a whole file image in memory; `buf` is referenced, not
 * copied, and must outlive the file. */
nl_status nl_st_open_mem(nl_st_file **out, const void *buf, size_t len, nl_error *err);
/* The same over a malloc'd image the file takes: freed on close, and on
 * failure. `label` (copied) names it in messages, e.g. its path. Unlike a
 * mapping, a copy cannot change or fault (SIGBUS) when the file on disk
 * is truncated or rewritten after it was read. */
nl_status nl_st_open_owned(nl_st_file **out, void *buf, size_t len, const char *label,
                           nl_error *err);
void nl_st_close(nl_st_file **f);

const nl_st_header *nl_st_file_header(const nl_st_file *f);
size_t nl_st_count(const nl_st_file *f);
const nl_st_entry *nl_st_entry_at(const nl_st_file *f, size_t i);
const nl_st_entry *nl_st_find(const nl_st_file *f, const char *name);
const char *nl_st_metadata(const nl_st_file *f, const char *key);
/* The tensor's bytes inside the mapping (little-endian). Only as aligned
 * as the file makes it: files written here start the data section on 8
 * bytes, and a tensor follows the ones before it without padding. */
const void *nl_st_tensor_data(const nl_st_file *f, const nl_st_entry *e);

/* Copy tensor `name` into dst after checking that it exists
 * (NL_ERR_NOTFOUND), has `dtype` (NL_ERR_DTYPE) and exactly `shape`
 * (NL_ERR_SHAPE; the message shows both shapes). */
nl_status nl_st_read(const nl_st_file *f, const char *name, nl_dtype dtype, int ndim,
                     const int64_t *shape, void *dst, nl_error *err);
/* Copy rows [row0, row1) of the first dimension. shape[1..] must match;
 * shape[0] must match too unless it is -1 (any row count, e.g. a table
 * that has grown since). Out-of-range rows: NL_ERR_RANGE. */
nl_status nl_st_read_rows(const nl_st_file *f, const char *name, nl_dtype dtype, int ndim,
                          const int64_t *shape, int64_t row0, int64_t row1, void *dst,
                          nl_error *err);

/* ---- writing a file ---- */

typedef struct nl_st_writer nl_st_writer;

/* NULL when out of memory. */
nl_st_writer *nl_st_writer_new(void);
void nl_st_writer_destroy(nl_st_writer **w);
/* Add a tensor. Name, dtype and shape are copied and checked now (name
 * non-empty, unique, <= NL_ST_MAX_NAME, valid UTF-8, not "__metadata__");
 * `data` is referenced, not copied: it must stay valid until write. */
nl_status nl_st_writer_add(nl_st_writer *w, const char *name, nl_dtype dtype, int ndim,
                           const int64_t *shape, const void *data, nl_error *err);
/* Produce a tensor's `nbytes` bytes into dst (a buffer the writer owns
 * and reuses) when the file is written. */
typedef nl_status (*nl_st_fill_fn)(void *ctx, void *dst, uint64_t nbytes, nl_error *err);
/* Add a tensor whose bytes `fill(ctx, ...)` produces during write, one
 * tensor at a time into one buffer the size of the largest: a file larger
 * than memory streams out holding one tensor. A fill error aborts the
 * write (no file is left). */
nl_status nl_st_writer_add_fill(nl_st_writer *w, const char *name, nl_dtype dtype, int ndim,
                                const int64_t *shape, nl_st_fill_fn fill, void *ctx, nl_error *err);
/* Set a __metadata__ string (copied; replaces an earlier value). */
nl_status nl_st_writer_set_meta(nl_st_writer *w, const char *key, const char *value, nl_error *err);
/* Write atomically (temporary file, fsync, rename): tensors in the order
 * added, the header padded with spaces so the data starts on 8 bytes. On
 * failure an existing file at `path` is left as it was. */
nl_status nl_st_writer_write(const nl_st_writer *w, const char *path, nl_error *err);

#endif
