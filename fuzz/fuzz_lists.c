/* Fuzz target for the comma lists a node takes from others: an adapter
 * file's LoRA targets (nl_lora_parse_targets, "wq,wk,w_down": its metadata,
 * and neuroctl's --lora-targets) and an embedding batch's lengths
 * (nl_embed_parse_lengths, "3,17,1": a JOB_SUBMIT's params.lengths, read by
 * the coordinator and the first stage).
 *
 * Input: byte 0 bit 0 picks the parser; for the lengths, byte 1 is B - 1
 * (B in 1..64) and byte 2 is T - 1 (T in 1..256); the rest is the string
 * (a NUL-terminated heap copy of exactly its size, so ASan sees reads past
 * its end; an embedded NUL ends it early, as it would in C).
 *
 * Property: no crash; accepted targets are a non-empty set of NL_LORA_*
 * bits; accepted lengths are B integers in 1..T, which
 * nl_embed_format_lengths writes back as text that parses to the same
 * lengths. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/model/embed.h"
#include "core/model/lora.h"

static void targets(const char *s)
{
    int t = -1;
    nl_error err;
    if (nl_lora_parse_targets(s, &t, &err) != NL_OK)
        return;
    const int all = NL_LORA_WQ | NL_LORA_WK | NL_LORA_WV | NL_LORA_WO | NL_LORA_EXPERTS;
    if (t == 0 || (t & ~all))
        abort();
}

static void lengths(const char *s, int B, int T)
{
    int32_t got[64], again[64];
    char text[64 * 4 + 1];
    nl_error err;
    if (nl_embed_parse_lengths(s, B, T, got, &err) != NL_OK)
        return;
    for (int b = 0; b < B; b++)
        if (got[b] < 1 || got[b] > T)
            abort();
    if (nl_embed_format_lengths(text, sizeof text, got, B, &err) != NL_OK)
        abort();
    if (nl_embed_parse_lengths(text, B, T, again, &err) != NL_OK ||
        memcmp(got, again, (size_t)B * sizeof *got) != 0)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3)
        return 0;
    const int which = data[0] & 1, B = data[1] % 64 + 1, T = data[2] + 1;
    char *s = malloc(size - 3 + 1);
    if (!s)
        return 0;
    memcpy(s, data + 3, size - 3);
    s[size - 3] = '\0';
    if (which == 0)
        targets(s);
    else
        lengths(s, B, T);
    free(s);
    return 0;
}
