/* Fuzz target for a Hugging Face tokenizer.json (neuroctl import --hf):
 * the input as the file's text, for a model of 600 rows. A tokenizer that
 * is read must be a file our loader takes, and encode and decode the
 * input back to itself. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/hf.h"
#include "core/tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = NULL, note[512], *back = NULL;
    nl_error err;
    nl_tokenizer *t = NULL;
    int32_t *ids = NULL;
    size_t n = 0, bl = 0;
    if (nl_hf_tokenizer_parse((const char *)data, size, "tokenizer.json", 600, &text, note,
                              sizeof note, &err) != NL_OK ||
        !text)
        return 0;
    if (nl_tokenizer_load_buffer(&t, text, strlen(text), &err) != NL_OK ||
        nl_tokenizer_vocab_size(t) != 600)
        abort();
    if (nl_tokenizer_encode(t, data, size, &ids, &n, &err) != NL_OK ||
        nl_tokenizer_decode(t, ids, n, &back, &bl, &err) != NL_OK || bl != size ||
        (size && memcmp(back, data, size) != 0))
        abort();
    free(back);
    free(ids);
    nl_tokenizer_destroy(&t);
    free(text);
    return 0;
}
