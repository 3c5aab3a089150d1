/* Safetensors writer: tensors (given, or filled at write time) and
 * metadata collected, then one atomic write with the header padded to a
 * multiple of 8. The reader is in safetensors.c. */
#include "core/formats/safetensors_impl.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/fileio.h"

typedef struct wtensor {
    char *name;
    nl_dtype dtype;
    int ndim;
    int64_t shape[NL_MAX_DIMS];
    const void *data;
    nl_st_fill_fn fill; /* when set, produces the bytes at write time */
    void *fill_ctx;
    uint64_t nbytes;
} wtensor;

struct nl_st_writer {
    wtensor *t;
    size_t n, cap;
    char **meta; /* key0, value0, ... */
    size_t meta_n, meta_cap;
};

nl_st_writer *nl_st_writer_new(void)
{
    return calloc(1, sizeof(nl_st_writer));
}

void nl_st_writer_destroy(nl_st_writer **wp)
{
    if (!wp || !*wp)
        return;
    nl_st_writer *w = *wp;
    for (size_t i = 0; i < w->n; i++)
        free(w->t[i].name);
    for (size_t i = 0; i < 2 * w->meta_n; i++)
        free(w->meta[i]);
    free(w->t);
    free(w->meta);
    free(w);
    *wp = NULL;
}

static nl_status add_tensor(nl_st_writer *w, const char *name, nl_dtype dtype, int ndim,
                            const int64_t *shape, const void *data, nl_st_fill_fn fill,
                            void *fill_ctx, nl_error *err)
{
    char nm[96];
    show(nm, sizeof nm, name);
    if (name[0] == '\0' || strlen(name) > NL_ST_MAX_NAME || !utf8_ok(name) ||
        strcmp(name, "__metadata__") == 0)
        FAIL(NL_ERR_INVALID, "tensor '%s': name must be 1..%d bytes of UTF-8, not __metadata__", nm,
             NL_ST_MAX_NAME);
    if (!nl_dtype_name(dtype))
        FAIL(NL_ERR_DTYPE, "tensor '%s': invalid dtype %d", nm, (int)dtype);
    if (ndim < 0 || ndim > NL_MAX_DIMS)
        FAIL(NL_ERR_SHAPE, "tensor '%s': %d dimensions is outside 0..%d", nm, ndim, NL_MAX_DIMS);
    int64_t bytes = tensor_bytes(dtype, ndim, shape);
    if (bytes < 0)
        FAIL(NL_ERR_SHAPE, "tensor '%s': negative dimension or too many elements", nm);
    if (bytes > 0 && !data && !fill)
        FAIL(NL_ERR_INVALID, "tensor '%s': no data", nm);
    for (size_t i = 0; i < w->n; i++)
        if (strcmp(w->t[i].name, name) == 0)
            FAIL(NL_ERR_INVALID, "tensor '%s': added twice", nm);
    if (w->n == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 64;
        wtensor *t = realloc(w->t, cap * sizeof *t);
        if (!t)
            FAIL(NL_ERR_NOMEM, "out of memory");
        w->t = t;
        w->cap = cap;
    }
    wtensor *t = &w->t[w->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name)))
        FAIL(NL_ERR_NOMEM, "out of memory");
    t->dtype = dtype;
    t->ndim = ndim;
    if (ndim > 0)
        memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    t->data = data;
    t->fill = fill;
    t->fill_ctx = fill_ctx;
    t->nbytes = (uint64_t)bytes;
    w->n++;
    return NL_OK;
}

nl_status nl_st_writer_add(nl_st_writer *w, const char *name, nl_dtype dtype, int ndim,
                           const int64_t *shape, const void *data, nl_error *err)
{
    return add_tensor(w, name, dtype, ndim, shape, data, NULL, NULL, err);
}

nl_status nl_st_writer_add_fill(nl_st_writer *w, const char *name, nl_dtype dtype, int ndim,
                                const int64_t *shape, nl_st_fill_fn fill, void *ctx, nl_error *err)
{
    if (!fill)
        return nl_error_set(err, NL_ERR_INVALID, "tensor: no fill function");
    return add_tensor(w, name, dtype, ndim, shape, NULL, fill, ctx, err);
}

nl_status nl_st_writer_set_meta(nl_st_writer *w, const char *key, const char *value, nl_error *err)
{
    char k[96];
    show(k, sizeof k, key);
    if (key[0] == '\0' || !utf8_ok(key) || !utf8_ok(value))
        FAIL(NL_ERR_INVALID, "__metadata__ '%s': key and value must be UTF-8, key non-empty", k);
    char *v = strdup(value);
    if (!v)
        FAIL(NL_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < w->meta_n; i++)
        if (strcmp(w->meta[2 * i], key) == 0) {
            free(w->meta[2 * i + 1]);
            w->meta[2 * i + 1] = v;
            return NL_OK;
        }
    if (w->meta_n == w->meta_cap) {
        size_t cap = w->meta_cap ? 2 * w->meta_cap : 8;
        char **m = realloc(w->meta, 2 * cap * sizeof *m);
        if (!m) {
            free(v);
            FAIL(NL_ERR_NOMEM, "out of memory");
        }
        w->meta = m;
        w->meta_cap = cap;
    }
    if (!(w->meta[2 * w->meta_n] = strdup(key))) {
        free(v);
        FAIL(NL_ERR_NOMEM, "out of memory");
    }
    w->meta[2 * w->meta_n + 1] = v;
    w->meta_n++;
    return NL_OK;
}

/* The header JSON: __metadata__ first, then tensors in the order added,
 * packed one after another. Returns a malloc'd string or NULL. */
static char *header_json(const nl_st_writer *w)
{
    json_t *root = json_object(), *m = json_object();
    char *s = NULL;
    uint64_t off = 0;
    bool ok = root && m;
    for (size_t i = 0; ok && i < w->meta_n; i++)
        ok = json_object_set_new(m, w->meta[2 * i], json_string(w->meta[2 * i + 1])) == 0;
    if (ok && w->meta_n)
        ok = json_object_set(root, "__metadata__", m) == 0;
    for (size_t i = 0; ok && i < w->n; i++) {
        const wtensor *t = &w->t[i];
        json_t *e = json_object(), *shape = json_array(), *offs = json_array();
        ok = e && shape && offs &&
             json_object_set_new(e, "dtype", json_string(nl_dtype_name(t->dtype))) == 0;
        for (int d = 0; ok && d < t->ndim; d++)
            ok = json_array_append_new(shape, json_integer(t->shape[d])) == 0;
        ok = ok && json_array_append_new(offs, json_integer((json_int_t)off)) == 0 &&
             json_array_append_new(offs, json_integer((json_int_t)(off + t->nbytes))) == 0;
        ok = ok && json_object_set(e, "shape", shape) == 0 &&
             json_object_set(e, "data_offsets", offs) == 0 &&
             json_object_set(root, t->name, e) == 0;
        json_decref(shape);
        json_decref(offs);
        json_decref(e);
        off += t->nbytes;
    }
    if (ok)
        s = json_dumps(root, JSON_COMPACT);
    json_decref(m);
    json_decref(root);
    return s;
}

nl_status nl_st_writer_write(const nl_st_writer *w, const char *path, nl_error *err)
{
    nl_atomic_file *af = NULL;
    nl_status st = NL_OK;
    uint8_t *head = NULL, *scratch = NULL;
    char *json = header_json(w);
    if (!json) {
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory building the header", path);
        goto out;
    }
    /* Pad with spaces so that 8 + n, the start of the data, is a multiple
     * of 8. */
    size_t len = strlen(json), n = (len + 7) & ~(size_t)7;
    if (n > NL_ST_MAX_HEADER) {
        st = nl_error_set(err, NL_ERR_LIMIT, "%s: header of %zu bytes is above the limit", path, n);
        goto out;
    }
    if (!(head = malloc(8 + n))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    for (int i = 0; i < 8; i++)
        head[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(head + 8, json, len);
    memset(head + 8 + len, ' ', n - len);
    if ((st = nl_atomic_open(&af, path, err)) != NL_OK)
        goto out;
    st = nl_atomic_write(af, head, 8 + n, err);
    /* Filled tensors share one buffer the size of the largest of them. */
    uint64_t most = 0;
    for (size_t i = 0; i < w->n; i++)
        if (w->t[i].fill && w->t[i].nbytes > most)
            most = w->t[i].nbytes;
    if (st == NL_OK && most && (most > SIZE_MAX || !(scratch = malloc((size_t)most))))
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory for a %" PRIu64 "-byte tensor",
                          path, most);
    for (size_t i = 0; st == NL_OK && i < w->n; i++) {
        const wtensor *t = &w->t[i];
        if (!t->nbytes)
            continue;
        if (t->fill && (st = t->fill(t->fill_ctx, scratch, t->nbytes, err)) != NL_OK)
            break;
        st = nl_atomic_write(af, t->fill ? scratch : t->data, t->nbytes, err);
    }
    if (st == NL_OK)
        st = nl_atomic_commit(&af, err);
out:
    nl_atomic_abort(&af);
    free(scratch);
    free(head);
    free(json);
    return st;
}
