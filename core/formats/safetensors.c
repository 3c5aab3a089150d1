/* Safetensors reader: header validation (a pure function over bytes),
 * read-only mapped files, checked tensor reads. The writer (atomic writes)
 * is in safetensors_write.c; the checks both use are in safetensors_impl.h. */
#include "core/formats/safetensors_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/formats/fileio.h"

/* The data and the 8-byte length are little-endian and copied as they
 * lie; a big-endian port would need byte swaps here. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors I/O assumes a little-endian machine"
#endif

struct nl_st_header {
    size_t count;
    nl_st_entry *entries; /* sorted by offset */
    size_t *by_name;      /* indices into entries, sorted by name */
    size_t meta_count;
    char **meta; /* key0, value0, key1, value1, ... */
};

struct nl_st_file {
    char *label; /* the path, or "<memory>" */
    const uint8_t *base;
    size_t size;
    bool mapped;
    bool owned;          /* base is malloc'd and freed on close */
    const uint8_t *data; /* the data section */
    uint64_t data_size;
    nl_st_header *hdr;
};

/* ------------------------------------------------------------- helpers */

/* "[4, 8]" */
static const char *fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (used < n)
        snprintf(buf + used, n - used, "]");
    return buf;
}

#define SHAPE_BUF 200 /* NL_MAX_DIMS numbers of up to 20 digits */

/* -------------------------------------------------------------- header */

static nl_status parse_offsets(const char *nm, json_t *v, uint64_t data_size, nl_st_entry *e,
                               nl_error *err)
{
    json_t *b = json_array_get(v, 0), *en = json_array_get(v, 1);
    if (!json_is_array(v) || json_array_size(v) != 2 || !json_is_integer(b) ||
        !json_is_integer(en) || json_integer_value(b) < 0 || json_integer_value(en) < 0)
        FAIL(NL_ERR_FORMAT, "tensor '%s': data_offsets is not a pair of non-negative integers", nm);
    uint64_t begin = (uint64_t)json_integer_value(b), end = (uint64_t)json_integer_value(en);
    if (end < begin)
        FAIL(NL_ERR_FORMAT,
             "tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] end before they begin", nm,
             begin, end);
    if (end > data_size)
        FAIL(NL_ERR_RANGE,
             "tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
             "] run past the end of the data section (%" PRIu64 " bytes)",
             nm, begin, end, data_size);
    e->offset = begin;
    e->nbytes = end - begin;
    return NL_OK;
}

static nl_status parse_shape(const char *nm, json_t *v, nl_st_entry *e, nl_error *err)
{
    if (!json_is_array(v))
        FAIL(NL_ERR_FORMAT, "tensor '%s': shape is not an array", nm);
    if (json_array_size(v) > NL_MAX_DIMS)
        FAIL(NL_ERR_LIMIT, "tensor '%s': shape has %zu dimensions, above the limit of %d", nm,
             json_array_size(v), NL_MAX_DIMS);
    e->ndim = (int)json_array_size(v);
    for (int i = 0; i < e->ndim; i++) {
        json_t *d = json_array_get(v, (size_t)i);
        if (!json_is_integer(d))
            FAIL(NL_ERR_FORMAT, "tensor '%s': shape[%d] is not an integer", nm, i);
        if (json_integer_value(d) < 0)
            FAIL(NL_ERR_FORMAT, "tensor '%s': shape[%d] is negative (%" JSON_INTEGER_FORMAT ")", nm,
                 i, json_integer_value(d));
        e->shape[i] = json_integer_value(d);
    }
    return NL_OK;
}

/* One `"name": {"dtype", "shape", "data_offsets"}` entry. */
static nl_status parse_entry(const char *name, json_t *v, uint64_t data_size, nl_st_entry *e,
                             nl_error *err)
{
    static const char *const fields[] = {"dtype", "shape", "data_offsets"};
    char nm[96], shape[SHAPE_BUF];
    const char *key;
    json_t *f;
    nl_status st;
    show(nm, sizeof nm, name);
    if (name[0] == '\0')
        FAIL(NL_ERR_FORMAT, "a tensor has an empty name");
    if (strlen(name) > NL_ST_MAX_NAME)
        FAIL(NL_ERR_LIMIT, "tensor '%s': name is %zu bytes, above the limit of %d", nm,
             strlen(name), NL_ST_MAX_NAME);
    if (!json_is_object(v))
        FAIL(NL_ERR_FORMAT, "tensor '%s': entry is not an object", nm);
    json_object_foreach(v, key, f)
    {
        if (strcmp(key, fields[0]) && strcmp(key, fields[1]) && strcmp(key, fields[2])) {
            char k[96];
            show(k, sizeof k, key);
            FAIL(NL_ERR_FORMAT, "tensor '%s': unknown field '%s'", nm, k);
        }
    }
    for (int i = 0; i < 3; i++)
        if (!json_object_get(v, fields[i]))
            FAIL(NL_ERR_FORMAT, "tensor '%s': missing field '%s'", nm, fields[i]);
    json_t *dt = json_object_get(v, "dtype");
    if (!json_is_string(dt))
        FAIL(NL_ERR_FORMAT, "tensor '%s': dtype is not a string", nm);
    if (nl_dtype_parse(json_string_value(dt), &e->dtype) != 0) {
        char d[96];
        show(d, sizeof d, json_string_value(dt));
        FAIL(NL_ERR_DTYPE, "tensor '%s': unknown dtype '%s'", nm, d);
    }
    if ((st = parse_shape(nm, json_object_get(v, "shape"), e, err)) != NL_OK)
        return st;
    if ((st = parse_offsets(nm, json_object_get(v, "data_offsets"), data_size, e, err)) != NL_OK)
        return st;
    fmt_shape(shape, sizeof shape, e->ndim, e->shape);
    int64_t bytes = tensor_bytes(e->dtype, e->ndim, e->shape);
    if (bytes < 0)
        FAIL(NL_ERR_FORMAT, "tensor '%s': shape %s of %s is too large", nm, shape,
             nl_dtype_name(e->dtype));
    if ((uint64_t)bytes != e->nbytes)
        FAIL(NL_ERR_FORMAT,
             "tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
             "] do not match shape %s of %s (%" PRId64 " bytes)",
             nm, e->offset, e->offset + e->nbytes, shape, nl_dtype_name(e->dtype), bytes);
    if (!(e->name = strdup(name)))
        FAIL(NL_ERR_NOMEM, "out of memory");
    return NL_OK;
}

static nl_status parse_meta(nl_st_header *h, json_t *m, nl_error *err)
{
    const char *key;
    json_t *v;
    char k[96];
    if (!json_is_object(m))
        FAIL(NL_ERR_FORMAT, "__metadata__ is not an object");
    if (!(h->meta = calloc(2 * json_object_size(m) + 1, sizeof *h->meta)))
        FAIL(NL_ERR_NOMEM, "out of memory");
    json_object_foreach(m, key, v)
    {
        show(k, sizeof k, key);
        if (!json_is_string(v))
            FAIL(NL_ERR_FORMAT, "__metadata__ '%s': value is not a string", k);
        char **pair = h->meta + 2 * h->meta_count;
        pair[0] = strdup(key);
        pair[1] = strdup(json_string_value(v));
        h->meta_count++; /* counted first so destroy frees a half pair */
        if (!pair[0] || !pair[1])
            FAIL(NL_ERR_NOMEM, "out of memory");
    }
    return NL_OK;
}

static int cmp_offset(const void *a, const void *b)
{
    const nl_st_entry *x = a, *y = b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes)
        return x->nbytes < y->nbytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* qsort has no context argument: the entries being sorted by name. */
static _Thread_local const nl_st_entry *sort_entries;

static int cmp_name(const void *a, const void *b)
{
    return strcmp(sort_entries[*(const size_t *)a].name, sort_entries[*(const size_t *)b].name);
}

/* Sort into file order and refuse overlapping byte ranges (empty tensors
 * occupy no bytes and overlap nothing). */
static nl_status check_layout(nl_st_header *h, nl_error *err)
{
    const nl_st_entry *owner = NULL;
    uint64_t owner_end = 0;
    qsort(h->entries, h->count, sizeof *h->entries, cmp_offset);
    for (size_t i = 0; i < h->count; i++) {
        const nl_st_entry *e = &h->entries[i];
        if (e->nbytes == 0)
            continue;
        if (owner && e->offset < owner_end) {
            char a[96], b[96];
            show(a, sizeof a, owner->name);
            show(b, sizeof b, e->name);
            FAIL(NL_ERR_FORMAT,
                 "tensors '%s' [%" PRIu64 ", %" PRIu64 "] and '%s' [%" PRIu64 ", %" PRIu64
                 "] overlap",
                 a, owner->offset, owner_end, b, e->offset, e->offset + e->nbytes);
        }
        owner = e;
        owner_end = e->offset + e->nbytes;
    }
    for (size_t i = 0; i < h->count; i++)
        h->by_name[i] = i;
    sort_entries = h->entries;
    qsort(h->by_name, h->count, sizeof *h->by_name, cmp_name);
    return NL_OK;
}

void nl_st_header_destroy(nl_st_header **hp)
{
    if (!hp || !*hp)
        return;
    nl_st_header *h = *hp;
    for (size_t i = 0; i < h->count; i++)
        free((char *)h->entries[i].name);
    for (size_t i = 0; i < 2 * h->meta_count; i++)
        free(h->meta[i]);
    free(h->entries);
    free(h->by_name);
    free(h->meta);
    free(h);
    *hp = NULL;
}

nl_status nl_st_parse_header(const uint8_t *buf, size_t len, uint64_t data_size, nl_st_header **out,
                             nl_error *err)
{
    json_error_t je;
    json_t *root = NULL, *v;
    nl_st_header *h = NULL;
    nl_status st = NL_OK;
    const char *key;
    *out = NULL;
    if (len > NL_ST_MAX_HEADER)
        FAIL(NL_ERR_LIMIT, "header length %zu is above the limit of %llu bytes", len,
             NL_ST_MAX_HEADER);
    /* Duplicate names are refused by the JSON parser itself. */
    root = json_loadb((const char *)buf, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        FAIL(NL_ERR_FORMAT, "header is not valid JSON: line %d column %d: %s", je.line, je.column,
             je.text);
    if (!json_is_object(root)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "header is not a JSON object");
        goto out;
    }
    size_t n = json_object_size(root);
    if (!(h = calloc(1, sizeof *h)) || !(h->entries = calloc(n + 1, sizeof *h->entries)) ||
        !(h->by_name = calloc(n + 1, sizeof *h->by_name))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory for a header of %zu entries", n);
        goto out;
    }
    json_object_foreach(root, key, v)
    {
        if (strcmp(key, "__metadata__") == 0)
            st = parse_meta(h, v, err);
        else if ((st = parse_entry(key, v, data_size, &h->entries[h->count], err)) == NL_OK)
            h->count++;
        if (st != NL_OK)
            goto out;
    }
    if ((st = check_layout(h, err)) != NL_OK)
        goto out;
    *out = h;
    h = NULL;
out:
    nl_st_header_destroy(&h);
    json_decref(root);
    return st;
}

size_t nl_st_header_count(const nl_st_header *h)
{
    return h->count;
}

const nl_st_entry *nl_st_header_entry(const nl_st_header *h, size_t i)
{
    return i < h->count ? &h->entries[i] : NULL;
}

const nl_st_entry *nl_st_header_find(const nl_st_header *h, const char *name)
{
    size_t lo = 0, hi = h->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const nl_st_entry *e = &h->entries[h->by_name[mid]];
        int c = strcmp(name, e->name);
        if (c == 0)
            return e;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

const char *nl_st_header_meta(const nl_st_header *h, const char *key)
{
    for (size_t i = 0; i < h->meta_count; i++)
        if (strcmp(h->meta[2 * i], key) == 0)
            return h->meta[2 * i + 1];
    return NULL;
}

size_t nl_st_header_meta_count(const nl_st_header *h)
{
    return h->meta_count;
}

int nl_st_header_meta_at(const nl_st_header *h, size_t i, const char **key, const char **value)
{
    if (i >= h->meta_count)
        return -1;
    *key = h->meta[2 * i];
    *value = h->meta[2 * i + 1];
    return 0;
}

/* --------------------------------------------------------------- files */

/* Check the 8-byte length against the image and parse the header. */
static nl_status open_image(nl_st_file *f, nl_error *err)
{
    if (f->size < 8)
        FAIL(NL_ERR_FORMAT, "file is %zu bytes, shorter than the 8-byte header length", f->size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | f->base[i];
    if (n > NL_ST_MAX_HEADER)
        FAIL(NL_ERR_LIMIT,
             "not a safetensors file: header length %" PRIu64 " is above the limit of %llu bytes",
             n, NL_ST_MAX_HEADER);
    if (n > f->size - 8)
        FAIL(NL_ERR_FORMAT,
             "not a safetensors file: header length %" PRIu64
             " runs past the end of the file (%zu bytes)",
             n, f->size);
    f->data = f->base + 8 + n;
    f->data_size = f->size - 8 - n;
    return nl_st_parse_header(f->base + 8, (size_t)n, f->data_size, &f->hdr, err);
}

void nl_st_close(nl_st_file **fp)
{
    if (!fp || !*fp)
        return;
    nl_st_file *f = *fp;
    nl_st_header_destroy(&f->hdr);
    if (f->mapped)
        munmap((void *)f->base, f->size);
    if (f->owned)
        free((void *)f->base);
    free(f->label);
    free(f);
    *fp = NULL;
}

static nl_st_file *file_new(const char *label)
{
    nl_st_file *f = calloc(1, sizeof *f);
    if (f && !(f->label = strdup(label))) {
        free(f);
        f = NULL;
    }
    return f;
}

nl_status nl_st_open_mem(nl_st_file **out, const void *buf, size_t len, nl_error *err)
{
    *out = NULL;
    nl_st_file *f = file_new("<memory>");
    if (!f)
        FAIL(NL_ERR_NOMEM, "out of memory");
    f->base = buf;
    f->size = len;
    nl_status st = open_image(f, err);
    if (st != NL_OK)
        nl_st_close(&f);
    *out = f;
    return st;
}

nl_status nl_st_open_owned(nl_st_file **out, void *buf, size_t len, const char *label,
                           nl_error *err)
{
    *out = NULL;
    nl_st_file *f = file_new(label);
    if (!f) {
        free(buf);
        FAIL(NL_ERR_NOMEM, "%s: out of memory", label);
    }
    f->base = buf;
    f->size = len;
    f->owned = true;
    nl_status st = open_image(f, err);
    if (st != NL_OK) {
        nl_st_close(&f);
        return nl_error_prefix(err, "%s", label);
    }
    *out = f;
    return NL_OK;
}

nl_status nl_st_open(nl_st_file **out, const char *path, nl_error *err)
{
    nl_status st = NL_OK;
    struct stat sb;
    *out = NULL;
    nl_st_file *f = file_new(path);
    if (!f)
        FAIL(NL_ERR_NOMEM, "%s: out of memory", path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        st = nl_error_set(err, errno == ENOENT ? NL_ERR_NOTFOUND : NL_ERR_IO, "cannot open: %s",
                          strerror(errno));
        goto fail;
    }
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = nl_error_set(err, NL_ERR_IO, "not a regular file");
        goto fail;
    }
    f->size = (size_t)sb.st_size;
    if (f->size >= 8) {
        void *p = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            st = nl_error_set(err, NL_ERR_IO, "cannot map %zu bytes: %s", f->size, strerror(errno));
            goto fail;
        }
        f->base = p;
        f->mapped = true;
    }
    if ((st = open_image(f, err)) != NL_OK)
        goto fail;
    close(fd);
    *out = f;
    return NL_OK;
fail:
    if (fd >= 0)
        close(fd);
    nl_st_close(&f);
    nl_error_prefix(err, "%s", path);
    return st;
}

const nl_st_header *nl_st_file_header(const nl_st_file *f)
{
    return f->hdr;
}
size_t nl_st_count(const nl_st_file *f)
{
    return f->hdr->count;
}
const nl_st_entry *nl_st_entry_at(const nl_st_file *f, size_t i)
{
    return nl_st_header_entry(f->hdr, i);
}
const nl_st_entry *nl_st_find(const nl_st_file *f, const char *name)
{
    return nl_st_header_find(f->hdr, name);
}
const char *nl_st_metadata(const nl_st_file *f, const char *key)
{
    return nl_st_header_meta(f->hdr, key);
}
const void *nl_st_tensor_data(const nl_st_file *f, const nl_st_entry *e)
{
    return f->data + e->offset;
}

/* ------------------------------------------------------------- reading */

/* Find `name` and check its dtype and shape; dims from `first` on must be
 * equal, dim 0 too unless shape[0] is -1 and first is 1. */
static nl_status lookup(const nl_st_file *f, const char *name, nl_dtype dtype, int ndim,
                        const int64_t *shape, int first, const nl_st_entry **out, nl_error *err)
{
    char nm[96], have[SHAPE_BUF], want[SHAPE_BUF];
    show(nm, sizeof nm, name);
    const nl_st_entry *e = nl_st_find(f, name);
    if (!e)
        FAIL(NL_ERR_NOTFOUND, "%s: tensor '%s' not found", f->label, nm);
    if (e->dtype != dtype)
        FAIL(NL_ERR_DTYPE, "%s: tensor '%s' is %s, expected %s", f->label, nm,
             nl_dtype_name(e->dtype), nl_dtype_name(dtype) ? nl_dtype_name(dtype) : "?");
    bool ok = e->ndim == ndim && ndim >= first && ndim <= NL_MAX_DIMS;
    for (int i = 0; ok && i < ndim; i++)
        ok = e->shape[i] == shape[i] || (i == 0 && first == 1 && shape[0] == -1);
    if (!ok)
        FAIL(NL_ERR_SHAPE, "%s: tensor '%s' has shape %s, expected %s", f->label, nm,
             fmt_shape(have, sizeof have, e->ndim, e->shape),
             fmt_shape(want, sizeof want,
                       ndim < 0             ? 0
                       : ndim > NL_MAX_DIMS ? NL_MAX_DIMS
                                            : ndim,
                       shape));
    *out = e;
    return NL_OK;
}

nl_status nl_st_read(const nl_st_file *f, const char *name, nl_dtype dtype, int ndim,
                     const int64_t *shape, void *dst, nl_error *err)
{
    const nl_st_entry *e;
    nl_status st = lookup(f, name, dtype, ndim, shape, 0, &e, err);
    if (st == NL_OK && e->nbytes)
        memcpy(dst, f->data + e->offset, e->nbytes);
    return st;
}

nl_status nl_st_read_rows(const nl_st_file *f, const char *name, nl_dtype dtype, int ndim,
                          const int64_t *shape, int64_t row0, int64_t row1, void *dst,
                          nl_error *err)
{
    const nl_st_entry *e;
    nl_status st = lookup(f, name, dtype, ndim, shape, 1, &e, err);
    if (st != NL_OK)
        return st;
    if (row0 < 0 || row1 < row0 || row1 > e->shape[0]) {
        char nm[96];
        show(nm, sizeof nm, name);
        FAIL(NL_ERR_RANGE,
             "%s: tensor '%s': rows [%" PRId64 ", %" PRId64 ") outside its %" PRId64 " rows",
             f->label, nm, row0, row1, e->shape[0]);
    }
    if (row1 > row0) {
        uint64_t row_bytes = e->nbytes / (uint64_t)e->shape[0];
        memcpy(dst, f->data + e->offset + (uint64_t)row0 * row_bytes,
               (uint64_t)(row1 - row0) * row_bytes);
    }
    return NL_OK;
}
