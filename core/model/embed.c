/* Embeddings: pooling and the lengths of a batch (embed.h). */
#include "core/model/embed.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

void nl_embed_pool(float *out, const float *states, int len, int d)
{
    double norm = 0.0;
    for (int c = 0; c < d; c++) {
        double s = 0.0;
        for (int t = 0; t < len; t++)
            s += states[(size_t)t * d + c];
        out[c] = (float)(s / len);
        norm += (double)out[c] * out[c];
    }
    const float inv = norm > 0.0 ? (float)(1.0 / sqrt(norm)) : 0.0f;
    for (int c = 0; c < d; c++)
        out[c] *= inv;
}

void nl_embed_doc(int32_t *doc, const int32_t *lengths, int B, int T)
{
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            doc[(size_t)b * T + t] = t >= lengths[b];
}

nl_status nl_embed_format_lengths(char *buf, size_t cap, const int32_t *lengths, int B,
                                  nl_error *err)
{
    size_t used = 0;
    if (cap > 0)
        buf[0] = '\0';
    for (int b = 0; b < B; b++) {
        int n = snprintf(buf + used, cap - used, "%s%d", b ? "," : "", (int)lengths[b]);
        if (n < 0 || (size_t)n >= cap - used)
            return nl_error_set(err, NL_ERR_LIMIT,
                                "the lengths of %d texts do not fit in %zu bytes: use a smaller "
                                "--batch",
                                B, cap);
        used += (size_t)n;
    }
    return NL_OK;
}

nl_status nl_embed_parse_lengths(const char *s, int B, int T, int32_t *lengths, nl_error *err)
{
    const char *p = s;
    for (int b = 0; b < B; b++) {
        char *end = NULL;
        errno = 0;
        long v = *p >= '0' && *p <= '9' ? strtol(p, &end, 10) : -1;
        if (v < 1 || v > T || errno || (*end != (b + 1 < B ? ',' : '\0')))
            return nl_error_set(err, NL_ERR_RANGE,
                                "params.lengths: entry %d is not an integer in 1..%d followed by "
                                "%s (%d texts)",
                                b + 1, T, b + 1 < B ? "','" : "the end", B);
        lengths[b] = (int32_t)v;
        p = end + (b + 1 < B);
    }
    return NL_OK;
}
