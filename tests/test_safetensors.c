/* Safetensors: a write/read round trip over several dtypes, a scalar, an
 * empty tensor and metadata; the byte layout the format prescribes; a
 * matrix of corrupt files each refused with a message naming the fault;
 * read-time checks; and an atomic write that fails half-way leaving the
 * old file as it was. */
#include <dirent.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/formats/safetensors.h"
#include "tests/check.h"

static char dir[4096];

static const char *str_or(const char *s)
{
    return s ? s : "";
}

static const char *tmp_path(const char *name)
{
    static char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return path;
}

static uint8_t *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static void spit(const char *path, const void *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(buf, 1, len, f) == len, "write %s", path);
    if (f)
        fclose(f);
}

/* ------------------------------------------------------------ round trip */

static float f32[3][4];
static int64_t i64[5];
static uint16_t bf16[2][3];
static uint8_t u8[7];
static double f64[2][2];
static float scalar = 3.25f;
static int32_t i32[2][1][3];

static nl_st_writer *sample_writer(void)
{
    nl_error err = {0};
    nl_st_writer *w = nl_st_writer_new();
    for (int i = 0; i < 12; i++)
        f32[i / 4][i % 4] = (float)i * 0.5f - 1.0f;
    for (int i = 0; i < 5; i++)
        i64[i] = (int64_t)1 << (10 * i);
    for (int i = 0; i < 6; i++)
        bf16[i / 3][i % 3] = (uint16_t)(0x3f80 + i);
    for (int i = 0; i < 7; i++)
        u8[i] = (uint8_t)(250 + i);
    for (int i = 0; i < 4; i++)
        f64[i / 2][i % 2] = 1.0 / (i + 3);
    for (int i = 0; i < 6; i++)
        i32[i / 3][0][i % 3] = -i;
    CHECK_OK(nl_st_writer_add(w, "layers.0.w", NL_DTYPE_F32, 2, (int64_t[]){3, 4}, f32, &err),
             &err);
    CHECK_OK(nl_st_writer_add(w, "ids", NL_DTYPE_I64, 1, (int64_t[]){5}, i64, &err), &err);
    CHECK_OK(nl_st_writer_add(w, "half", NL_DTYPE_BF16, 2, (int64_t[]){2, 3}, bf16, &err), &err);
    CHECK_OK(nl_st_writer_add(w, "bytes", NL_DTYPE_U8, 1, (int64_t[]){7}, u8, &err), &err);
    CHECK_OK(nl_st_writer_add(w, "f64", NL_DTYPE_F64, 2, (int64_t[]){2, 2}, f64, &err), &err);
    CHECK_OK(nl_st_writer_add(w, "scalar", NL_DTYPE_F32, 0, NULL, &scalar, &err), &err);
    CHECK_OK(nl_st_writer_add(w, "empty", NL_DTYPE_F32, 2, (int64_t[]){0, 4}, NULL, &err), &err);
    CHECK_OK(nl_st_writer_add(w, "i32", NL_DTYPE_I32, 3, (int64_t[]){2, 1, 3}, i32, &err), &err);
    CHECK_OK(nl_st_writer_set_meta(w, "format", "neurollm/1", &err), &err);
    CHECK_OK(nl_st_writer_set_meta(w, "step", "1", &err), &err);
    CHECK_OK(nl_st_writer_set_meta(w, "step", "42", &err), &err); /* replaces */
    CHECK_OK(nl_st_writer_set_meta(w, "config", "{\"hidden_dim\": 64}", &err), &err);
    return w;
}

static const struct {
    const char *name;
    const void *data;
    size_t nbytes;
} expect[] = {
    {"layers.0.w", f32, sizeof f32},
    {"ids", i64, sizeof i64},
    {"half", bf16, sizeof bf16},
    {"bytes", u8, sizeof u8},
    {"f64", f64, sizeof f64},
    {"scalar", &scalar, 4},
    {"empty", NULL, 0},
    {"i32", i32, sizeof i32},
};
#define NEXPECT (sizeof expect / sizeof expect[0])

static void test_round_trip(void)
{
    nl_error err = {0};
    nl_st_writer *w = sample_writer();
    const char *path = tmp_path("rt.safetensors");
    CHECK_OK(nl_st_writer_write(w, path, &err), &err);
    nl_st_writer_destroy(&w);
    nl_st_writer_destroy(&w); /* safe twice */
    CHECK(w == NULL, "destroy NULLs");

    /* The byte layout: length, JSON padded with spaces to 8, packed data. */
    size_t len;
    uint8_t *raw = slurp(path, &len);
    CHECK(raw != NULL && len > 8, "read back");
    if (!raw)
        return;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | raw[i];
    size_t data = 0;
    for (size_t i = 0; i < NEXPECT; i++)
        data += expect[i].nbytes;
    CHECK((8 + n) % 8 == 0, "data starts on 8 bytes: header %" PRIu64, n);
    CHECK(len == 8 + n + data, "file %zu = 8 + %" PRIu64 " + %zu", len, n, data);
    CHECK(raw[8] == '{', "JSON first");
    char *hjson = strndup((const char *)raw + 8, n);
    CHECK(strstr(hjson, "\"__metadata__\":{\"format\":\"neurollm/1\"") != NULL,
          "metadata first in the header");
    CHECK(strstr(hjson,
                 "\"layers.0.w\":{\"dtype\":\"F32\",\"shape\":[3,4],\"data_offsets\":[0,48]}") !=
              NULL,
          "first tensor entry");
    CHECK(strstr(hjson, "\"scalar\":{\"dtype\":\"F32\",\"shape\":[],") != NULL,
          "scalar has shape []");
    size_t pad = 0;
    while (pad < n && raw[8 + n - 1 - pad] == ' ')
        pad++;
    CHECK(pad < 8 && raw[8 + n - 1 - pad] == '}', "padded with %zu spaces", pad);
    CHECK(memcmp(raw + 8 + n, f32, sizeof f32) == 0, "data section starts with the first tensor");
    free(hjson);

    nl_st_file *f = NULL;
    CHECK_OK(nl_st_open(&f, path, &err), &err);
    if (!f) {
        free(raw);
        return;
    }
    CHECK(nl_st_count(f) == NEXPECT, "count %zu", nl_st_count(f));
    uint64_t off = 0;
    for (size_t i = 0; i < NEXPECT && i < nl_st_count(f); i++) {
        const nl_st_entry *e = nl_st_entry_at(f, i);
        CHECK(strcmp(e->name, expect[i].name) == 0, "order %zu: %s", i, e->name);
        CHECK(e->offset == off && e->nbytes == expect[i].nbytes, "%s at %" PRIu64, e->name,
              e->offset);
        CHECK(nl_st_find(f, expect[i].name) == e, "find %s", expect[i].name);
        if (expect[i].nbytes)
            CHECK(memcmp(nl_st_tensor_data(f, e), expect[i].data, expect[i].nbytes) == 0,
                  "data of %s", e->name);
        off += e->nbytes;
    }
    CHECK(nl_st_entry_at(f, NEXPECT) == NULL, "entry past the end");
    CHECK(nl_st_find(f, "nope") == NULL && nl_st_find(f, "") == NULL, "find missing");
    const nl_st_entry *s = nl_st_find(f, "scalar");
    CHECK(s && s->ndim == 0 && s->dtype == NL_DTYPE_F32, "scalar entry");
    const nl_st_entry *h = nl_st_find(f, "half");
    CHECK(h && h->dtype == NL_DTYPE_BF16 && h->ndim == 2 && h->shape[0] == 2 && h->shape[1] == 3,
          "bf16 entry");

    CHECK(strcmp(str_or(nl_st_metadata(f, "format")), "neurollm/1") == 0, "format");
    CHECK(strcmp(str_or(nl_st_metadata(f, "step")), "42") == 0, "step replaced");
    CHECK(strcmp(str_or(nl_st_metadata(f, "config")), "{\"hidden_dim\": 64}") == 0, "config");
    CHECK(nl_st_metadata(f, "missing") == NULL, "missing metadata");
    const char *k, *v;
    const nl_st_header *hd = nl_st_file_header(f);
    CHECK(nl_st_header_meta_count(hd) == 3, "3 metadata pairs");
    CHECK(nl_st_header_meta_at(hd, 2, &k, &v) == 0 && strcmp(k, "config") == 0, "pair 2");
    CHECK(nl_st_header_meta_at(hd, 3, &k, &v) == -1, "pair 3 out of range");

    /* Checked reads. */
    float got[3][4];
    int64_t got64[5];
    double gotd[2][2];
    float gots = 0;
    CHECK_OK(nl_st_read(f, "layers.0.w", NL_DTYPE_F32, 2, (int64_t[]){3, 4}, got, &err), &err);
    CHECK(memcmp(got, f32, sizeof got) == 0, "read f32");
    CHECK_OK(nl_st_read(f, "ids", NL_DTYPE_I64, 1, (int64_t[]){5}, got64, &err), &err);
    CHECK(memcmp(got64, i64, sizeof got64) == 0, "read i64");
    CHECK_OK(nl_st_read(f, "f64", NL_DTYPE_F64, 2, (int64_t[]){2, 2}, gotd, &err), &err);
    CHECK(memcmp(gotd, f64, sizeof gotd) == 0, "read f64");
    CHECK_OK(nl_st_read(f, "scalar", NL_DTYPE_F32, 0, NULL, &gots, &err), &err);
    CHECK(gots == 3.25f, "read scalar %g", gots);
    CHECK_OK(nl_st_read(f, "empty", NL_DTYPE_F32, 2, (int64_t[]){0, 4}, NULL, &err), &err);

    /* Row ranges. */
    float rows[2][4] = {{0}};
    CHECK_OK(nl_st_read_rows(f, "layers.0.w", NL_DTYPE_F32, 2, (int64_t[]){3, 4}, 1, 3, rows, &err),
             &err);
    CHECK(memcmp(rows, f32[1], sizeof rows) == 0, "rows [1, 3)");
    CHECK_OK(
        nl_st_read_rows(f, "layers.0.w", NL_DTYPE_F32, 2, (int64_t[]){-1, 4}, 2, 3, rows, &err),
        &err);
    CHECK(memcmp(rows, f32[2], sizeof f32[2]) == 0, "row 2, any row count");
    CHECK_OK(nl_st_read_rows(f, "layers.0.w", NL_DTYPE_F32, 2, (int64_t[]){3, 4}, 3, 3, rows, &err),
             &err);
    CHECK(nl_st_read_rows(f, "layers.0.w", NL_DTYPE_F32, 2, (int64_t[]){3, 4}, 2, 4, rows, &err) ==
              NL_ERR_RANGE,
          "rows past the end");
    CHECK(strstr(err.msg, "rows [2, 4) outside its 3 rows") != NULL, "msg: %s", err.msg);
    CHECK(nl_st_read_rows(f, "layers.0.w", NL_DTYPE_F32, 2, (int64_t[]){3, 4}, -1, 1, rows, &err) ==
              NL_ERR_RANGE,
          "negative row");
    CHECK(nl_st_read_rows(f, "layers.0.w", NL_DTYPE_F32, 2, (int64_t[]){-1, 2}, 0, 1, rows, &err) ==
              NL_ERR_SHAPE,
          "row shape");
    CHECK(strstr(err.msg, "has shape [3, 4], expected [-1, 2]") != NULL, "msg: %s", err.msg);
    CHECK(nl_st_read_rows(f, "scalar", NL_DTYPE_F32, 0, NULL, 0, 1, rows, &err) == NL_ERR_SHAPE,
          "scalar has no rows");

    /* Read-time refusals. */
    CHECK(nl_st_read(f, "nope", NL_DTYPE_F32, 1, (int64_t[]){1}, got, &err) == NL_ERR_NOTFOUND,
          "missing");
    CHECK(strstr(err.msg, "tensor 'nope' not found") && strstr(err.msg, path), "msg: %s", err.msg);
    CHECK(nl_st_read(f, "layers.0.w", NL_DTYPE_F32, 2, (int64_t[]){4, 3}, got, &err) ==
              NL_ERR_SHAPE,
          "wrong shape");
    CHECK(strstr(err.msg, "tensor 'layers.0.w' has shape [3, 4], expected [4, 3]"), "msg: %s",
          err.msg);
    CHECK(nl_st_read(f, "layers.0.w", NL_DTYPE_F32, 1, (int64_t[]){12}, got, &err) == NL_ERR_SHAPE,
          "wrong ndim");
    CHECK(nl_st_read(f, "scalar", NL_DTYPE_F32, 1, (int64_t[]){1}, got, &err) == NL_ERR_SHAPE,
          "scalar read as [1]");
    CHECK(strstr(err.msg, "has shape [], expected [1]"), "msg: %s", err.msg);
    CHECK(nl_st_read(f, "layers.0.w", NL_DTYPE_I32, 2, (int64_t[]){3, 4}, got, &err) ==
              NL_ERR_DTYPE,
          "wrong dtype");
    CHECK(strstr(err.msg, "tensor 'layers.0.w' is F32, expected I32"), "msg: %s", err.msg);
    nl_st_close(&f);
    nl_st_close(&f);
    CHECK(f == NULL, "close NULLs");

    /* The same image from memory. */
    CHECK_OK(nl_st_open_mem(&f, raw, len, &err), &err);
    CHECK(f && nl_st_count(f) == NEXPECT, "open_mem");
    nl_st_close(&f);
    free(raw);
}

static void test_writer_errors(void)
{
    nl_error err = {0};
    nl_st_writer *w = nl_st_writer_new();
    float x[2] = {1, 2};
    CHECK_OK(nl_st_writer_add(w, "a", NL_DTYPE_F32, 1, (int64_t[]){2}, x, &err), &err);
    CHECK(nl_st_writer_add(w, "a", NL_DTYPE_F32, 1, (int64_t[]){2}, x, &err) == NL_ERR_INVALID &&
              strstr(err.msg, "added twice"),
          "duplicate: %s", err.msg);
    CHECK(nl_st_writer_add(w, "", NL_DTYPE_F32, 1, (int64_t[]){2}, x, &err) == NL_ERR_INVALID,
          "empty name");
    CHECK(nl_st_writer_add(w, "__metadata__", NL_DTYPE_F32, 1, (int64_t[]){2}, x, &err) ==
              NL_ERR_INVALID,
          "reserved name");
    CHECK(nl_st_writer_add(w, "bad\xff", NL_DTYPE_F32, 1, (int64_t[]){2}, x, &err) ==
              NL_ERR_INVALID,
          "non-UTF-8 name");
    char longname[300];
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    CHECK(nl_st_writer_add(w, longname, NL_DTYPE_F32, 1, (int64_t[]){2}, x, &err) == NL_ERR_INVALID,
          "long name");
    CHECK(nl_st_writer_add(w, "b", NL_DTYPE_F32, 1, (int64_t[]){-2}, x, &err) == NL_ERR_SHAPE,
          "negative dim");
    CHECK(nl_st_writer_add(w, "b", NL_DTYPE_F32, 9, (int64_t[9]){1}, x, &err) == NL_ERR_SHAPE,
          "9 dims");
    CHECK(nl_st_writer_add(w, "b", NL_DTYPE_COUNT, 1, (int64_t[]){2}, x, &err) == NL_ERR_DTYPE,
          "bad dtype");
    CHECK(nl_st_writer_add(w, "b", NL_DTYPE_F32, 1, (int64_t[]){2}, NULL, &err) == NL_ERR_INVALID,
          "no data");
    CHECK(nl_st_writer_add(w, "b", NL_DTYPE_F32, 2, (int64_t[]){INT64_MAX / 2, 4}, x, &err) ==
              NL_ERR_SHAPE,
          "overflow");
    CHECK(nl_st_writer_set_meta(w, "", "v", &err) == NL_ERR_INVALID, "empty meta key");
    CHECK(nl_st_writer_set_meta(w, "k", "\xc3", &err) == NL_ERR_INVALID, "non-UTF-8 value");
    /* The writer is still usable after refusals. */
    const char *path = tmp_path("one.safetensors");
    CHECK_OK(nl_st_writer_write(w, path, &err), &err);
    nl_st_file *f = NULL;
    CHECK_OK(nl_st_open(&f, path, &err), &err);
    CHECK(f && nl_st_count(f) == 1, "one tensor");
    nl_st_close(&f);
    CHECK(nl_st_writer_write(w, "/nonexistent-dir/x.safetensors", &err) == NL_ERR_IO &&
              strstr(err.msg, "/nonexistent-dir/x.safetensors"),
          "unwritable: %s", err.msg);
    nl_st_writer_destroy(&w);

    /* An empty file (no tensors, no metadata) is valid. */
    w = nl_st_writer_new();
    CHECK_OK(nl_st_writer_write(w, path, &err), &err);
    CHECK_OK(nl_st_open(&f, path, &err), &err);
    CHECK(f && nl_st_count(f) == 0, "empty file");
    nl_st_close(&f);
    nl_st_writer_destroy(&w);
}

/* ------------------------------------------------------- corrupt files */

/* A file: 8-byte length `n` (the JSON's length unless given), the JSON,
 * then `data` zero bytes. */
static void write_raw(const char *path, uint64_t n, const char *json, size_t data)
{
    size_t jl = strlen(json);
    size_t len = 8 + jl + data;
    uint8_t *buf = calloc(1, len);
    if (n == UINT64_MAX)
        n = jl;
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(n >> (8 * i));
    memcpy(buf + 8, json, jl);
    spit(path, buf, len);
    free(buf);
}

#define HDR UINT64_MAX /* the real header length */
#define T(name, body) "\"" name "\":{" body "}"

static const struct corrupt {
    uint64_t n;
    const char *json;
    size_t data;
    nl_status st;
    const char *want;
} corrupt[] = {
    {200000000, "{}", 0, NL_ERR_LIMIT, "header length 200000000 is above the limit"},
    {1000, "{}", 10, NL_ERR_FORMAT, "header length 1000 runs past the end of the file (20 bytes)"},
    {HDR, "", 0, NL_ERR_FORMAT, "header is not valid JSON"},
    {HDR, "{\"a\": ", 0, NL_ERR_FORMAT, "header is not valid JSON: line 1"},
    {HDR, "{\"a\":{}} x", 0, NL_ERR_FORMAT, "header is not valid JSON"},
    {HDR, "[1, 2]", 0, NL_ERR_FORMAT, "header is not a JSON object"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") "}", 4, NL_ERR_RANGE,
     "tensor 't': data_offsets [0, 8] run past the end of the data section (4 bytes)"},
    {HDR,
     "{" T("a", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") "," T(
         "b", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]") "}",
     12, NL_ERR_FORMAT, "tensors 'a' [0, 8] and 'b' [4, 12] overlap"},
    {HDR,
     "{" T("a", "\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]") "," T(
         "b", "\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]") "}",
     8, NL_ERR_FORMAT, "tensors 'a' [0, 8] and 'b' [2, 4] overlap"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]") "}", 8,
     NL_ERR_FORMAT, "tensor 't': data_offsets [8, 0] end before they begin"},
    {HDR, "{" T("t", "\"dtype\":\"F8_E4M3\",\"shape\":[2],\"data_offsets\":[0,2]") "}", 2,
     NL_ERR_DTYPE, "tensor 't': unknown dtype 'F8_E4M3'"},
    {HDR, "{" T("t", "\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,2]") "}", 2, NL_ERR_FORMAT,
     "tensor 't': dtype is not a string"},
    {HDR,
     "{" T("layers.0.attention.wq.weight",
           "\"dtype\":\"F32\",\"shape\":[4,8],\"data_offsets\":[0,100]") "}",
     128, NL_ERR_FORMAT,
     "tensor 'layers.0.attention.wq.weight': data_offsets [0, 100] do not match shape [4, 8] of "
     "F32 (128 bytes)"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,0]") "}", 0,
     NL_ERR_FORMAT, "tensor 't': shape[0] is negative (-2)"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]") "}",
     4, NL_ERR_LIMIT, "tensor 't': shape has 9 dimensions, above the limit of 8"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]") "}", 8,
     NL_ERR_FORMAT, "tensor 't': shape[0] is not an integer"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]") "}", 8, NL_ERR_FORMAT,
     "tensor 't': shape is not an array"},
    {HDR,
     "{" T("t", "\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,8]") "}",
     8, NL_ERR_FORMAT, "tensor 't': shape [4611686018427387904, 4] of F32 is too large"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]") "}", 8, NL_ERR_FORMAT,
     "tensor 't': data_offsets is not a pair of non-negative integers"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]") "}", 8,
     NL_ERR_FORMAT, "tensor 't': data_offsets is not a pair"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":[2]") "}", 8, NL_ERR_FORMAT,
     "tensor 't': missing field 'data_offsets'"},
    {HDR, "{" T("t", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1") "}", 8,
     NL_ERR_FORMAT, "tensor 't': unknown field 'x'"},
    {HDR, "{\"t\": 5}", 0, NL_ERR_FORMAT, "tensor 't': entry is not an object"},
    {HDR, "{" T("", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") "}", 8, NL_ERR_FORMAT,
     "a tensor has an empty name"},
    {HDR, "{\"a\\u0000b\":{}}", 0, NL_ERR_FORMAT, "header is not valid JSON"},
    {HDR,
     "{" T("t", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") "," T(
         "t", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") "}",
     8, NL_ERR_FORMAT, "duplicate"},
    {HDR, "{\"__metadata__\":{\"step\":5}}", 0, NL_ERR_FORMAT,
     "__metadata__ 'step': value is not a string"},
    {HDR, "{\"__metadata__\":[\"a\"]}", 0, NL_ERR_FORMAT, "__metadata__ is not an object"},
    {HDR, "{\"t\\u001b[31m\": 5}", 0, NL_ERR_FORMAT, "tensor 't?[31m': entry is not an object"},
};

static void test_corrupt(void)
{
    const char *path = tmp_path("bad.safetensors");
    for (size_t i = 0; i < sizeof corrupt / sizeof corrupt[0]; i++) {
        const struct corrupt *c = &corrupt[i];
        nl_st_file *f = NULL;
        nl_error err = {0};
        write_raw(path, c->n, c->json, c->data);
        nl_status st = nl_st_open(&f, path, &err);
        CHECK(st == c->st && f == NULL, "case %zu (%s): %s", i, c->json, nl_status_str(st));
        CHECK(strstr(err.msg, c->want) != NULL, "case %zu: '%s' not in: %s", i, c->want, err.msg);
        CHECK(strncmp(err.msg, path, strlen(path)) == 0, "case %zu names the file: %s", i, err.msg);
        nl_st_close(&f);
    }

    /* A name over the limit. */
    char json[512];
    char name[300];
    memset(name, 'n', 257);
    name[257] = '\0';
    snprintf(json, sizeof json, "{\"%s\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}",
             name);
    nl_st_header *h = NULL;
    nl_error err = {0};
    CHECK(nl_st_parse_header((const uint8_t *)json, strlen(json), 0, &h, &err) == NL_ERR_LIMIT,
          "long name: %s", err.msg);
    CHECK(strstr(err.msg, "name is 257 bytes, above the limit of 256"), "msg: %s", err.msg);
    name[256] = '\0'; /* 256 is allowed */
    snprintf(json, sizeof json, "{\"%s\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}",
             name);
    CHECK_OK(nl_st_parse_header((const uint8_t *)json, strlen(json), 0, &h, &err), &err);
    nl_st_header_destroy(&h);
    CHECK(nl_st_parse_header((const uint8_t *)"{}", NL_ST_MAX_HEADER + 1, 0, &h, &err) ==
              NL_ERR_LIMIT,
          "parse_header limit");

    /* Empty tensors overlap nothing; gaps between tensors are allowed. */
    const char *ok = "{" T("a", "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") "," T(
        "e",
        "\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]") "," T("b",
                                                                        "\"dtype\":\"I8\","
                                                                        "\"shape\":[1],\"data_"
                                                                        "offsets\":[12,13]") "}";
    CHECK_OK(nl_st_parse_header((const uint8_t *)ok, strlen(ok), 13, &h, &err), &err);
    CHECK(h && nl_st_header_count(h) == 3, "three entries");
    nl_st_header_destroy(&h);
    nl_st_header_destroy(&h);

    /* The header may be followed by the spaces the format pads with. */
    const char *padded = "{\"__metadata__\":{\"k\":\"v\"}}      ";
    CHECK_OK(nl_st_parse_header((const uint8_t *)padded, strlen(padded), 0, &h, &err), &err);
    CHECK(h && strcmp(str_or(nl_st_header_meta(h, "k")), "v") == 0, "metadata");
    nl_st_header_destroy(&h);

    nl_st_file *f = NULL;
    CHECK(nl_st_open(&f, tmp_path("missing.safetensors"), &err) == NL_ERR_NOTFOUND, "missing file");
    CHECK(strstr(err.msg, "missing.safetensors: cannot open"), "msg: %s", err.msg);
    CHECK(nl_st_open(&f, dir, &err) == NL_ERR_IO && strstr(err.msg, "not a regular file"),
          "directory: %s", err.msg);
}

/* A valid file cut short at several offsets. */
static void test_truncated(void)
{
    nl_error err = {0};
    nl_st_writer *w = sample_writer();
    const char *path = tmp_path("full.safetensors");
    CHECK_OK(nl_st_writer_write(w, path, &err), &err);
    nl_st_writer_destroy(&w);
    size_t len;
    uint8_t *raw = slurp(path, &len);
    if (!raw)
        return;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | raw[i];
    static const struct {
        int where; /* 0: in the length, 1: in the header, 2: in the data */
        const char *want;
    } cuts[] = {
        {0, "shorter than the 8-byte header length"},
        {1, "runs past the end of the file"},
        {2, "run past the end of the data section"},
    };
    size_t at[][3] = {{0, 3, 7}, {8, 8 + n / 2, 8 + n - 1}, {8 + n + 1, 8 + n + 47, len - 1}};
    for (int c = 0; c < 3; c++)
        for (int k = 0; k < 3; k++) {
            nl_st_file *f = NULL;
            spit(tmp_path("cut.safetensors"), raw, at[c][k]);
            nl_status st = nl_st_open(&f, tmp_path("cut.safetensors"), &err);
            CHECK(st != NL_OK && f == NULL, "cut at %zu opened", at[c][k]);
            CHECK(strstr(err.msg, cuts[c].want) != NULL, "cut at %zu: '%s' not in: %s", at[c][k],
                  cuts[c].want, err.msg);
            CHECK(nl_st_open_mem(&f, raw, at[c][k], &err) == st, "mem cut at %zu", at[c][k]);
        }
    free(raw);
}

/* A write that fails half-way (file size limit) leaves the old file. */
static void test_atomic_failure(void)
{
    nl_error err = {0};
    const char *path = tmp_path("keep.safetensors");
    nl_st_writer *w = sample_writer();
    CHECK_OK(nl_st_writer_write(w, path, &err), &err);
    nl_st_writer_destroy(&w);
    size_t len0, len1;
    uint8_t *before = slurp(path, &len0);

    static float big[1 << 16];
    w = nl_st_writer_new();
    CHECK_OK(nl_st_writer_add(w, "big", NL_DTYPE_F32, 1, (int64_t[]){1 << 16}, big, &err), &err);
    struct rlimit old, small;
    getrlimit(RLIMIT_FSIZE, &old);
    small = old;
    small.rlim_cur = 16384;
    signal(SIGXFSZ, SIG_IGN);
    CHECK(setrlimit(RLIMIT_FSIZE, &small) == 0, "setrlimit");
    nl_status st = nl_st_writer_write(w, path, &err);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, SIG_DFL);
    nl_st_writer_destroy(&w);
    CHECK(st == NL_ERR_IO, "write past the size limit: %s %s", nl_status_str(st), err.msg);

    uint8_t *after = slurp(path, &len1);
    CHECK(before && after && len0 == len1 && memcmp(before, after, len0) == 0,
          "old file untouched (%zu -> %zu bytes)", len0, len1);
    free(before);
    free(after);
    DIR *d = opendir(dir);
    struct dirent *e;
    int leftovers = 0;
    while (d && (e = readdir(d)))
        leftovers += strstr(e->d_name, ".tmp.") != NULL;
    if (d)
        closedir(d);
    CHECK(leftovers == 0, "%d temporary files left", leftovers);
}

static void remove_dir(void)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.')
            unlink(tmp_path(e->d_name));
    if (d)
        closedir(d);
    rmdir(dir);
}

int main(void)
{
    snprintf(dir, sizeof dir, "%s/test_safetensors_XXXXXX", check_build_dir());
    if (!mkdtemp(dir)) {
        perror(dir);
        return 1;
    }
    test_round_trip();
    test_writer_errors();
    test_corrupt();
    test_truncated();
    test_atomic_failure();
    remove_dir();
    return check_done("test_safetensors");
}
