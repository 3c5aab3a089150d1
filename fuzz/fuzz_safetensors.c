/* Fuzz target for safetensors files: the input is a whole file image
 * (8-byte length, header, data), so the data size the header is checked
 * against comes from the input itself. A file that opens must then
 * answer every lookup and read without touching bytes outside it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Reads beyond this size are skipped to keep each run fast. */
#define MAX_READ (1u << 16)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    nl_st_file *f = NULL;
    nl_error err;
    static uint8_t dst[MAX_READ];
    /* The header alone, against the bytes after it as data. */
    if (size >= 8) {
        nl_st_header *h = NULL;
        size_t n = size - 8 < 4096 ? size - 8 : 4096;
        if (nl_st_parse_header(data + 8, n, size - 8 - n, &h, &err) == NL_OK)
            nl_st_header_destroy(&h);
    }
    if (nl_st_open_mem(&f, data, size, &err) != NL_OK)
        return 0;
    for (size_t i = 0; i < nl_st_count(f); i++) {
        const nl_st_entry *e = nl_st_entry_at(f, i);
        if (nl_st_find(f, e->name) != e)
            abort();
        if (e->nbytes > MAX_READ)
            continue;
        if (nl_st_read(f, e->name, e->dtype, e->ndim, e->shape, dst, &err) != NL_OK)
            abort();
        if (e->nbytes && memcmp(dst, nl_st_tensor_data(f, e), e->nbytes) != 0)
            abort();
        if (e->ndim > 0 && nl_st_read_rows(f, e->name, e->dtype, e->ndim, e->shape, 0, e->shape[0],
                                           dst, &err) != NL_OK)
            abort();
    }
    (void)nl_st_metadata(f, "format");
    nl_st_close(&f);
    return 0;
}
