/* Labelled examples for classification: parse `label<TAB>text` lines,
 * tokenize, sort the class names, split and draw batches (labelled.h). */
#include "core/data/labelled.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/data/data.h"
#include "core/formats/fileio.h"
#include "core/model/rng.h"
#include "core/tokenizer/tokenizer.h"

/* One parsed line before tokenizing. */
typedef struct line {
    const char *label, *text;
    size_t label_len, text_len;
} line;

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Split the file into lines (in place); blank lines are skipped. */
static nl_status parse_lines(char *text, size_t len, const char *path, line **out, size_t *n,
                             nl_error *err)
{
    size_t cap = 0, count = 0, lineno = 0;
    line *v = NULL;
    for (size_t i = 0; i < len;) {
        size_t e = i;
        while (e < len && text[e] != '\n')
            e++;
        lineno++;
        size_t end = e > i && text[e - 1] == '\r' ? e - 1 : e;
        if (end > i) {
            const char *tab = memchr(text + i, '\t', end - i);
            if (!tab || tab == text + i || tab + 1 == text + end) {
                free(v);
                return nl_error_set(err, NL_ERR_FORMAT,
                                    "%s:%zu: expected label<TAB>text with both non-empty", path,
                                    lineno);
            }
            /* a label is a C string from here on (class names): a NUL in it
             * would make two labels one */
            if (memchr(text + i, '\0', (size_t)(tab - (text + i)))) {
                free(v);
                return nl_error_set(err, NL_ERR_FORMAT, "%s:%zu: the label holds a NUL byte", path,
                                    lineno);
            }
            if (count == cap) {
                cap = cap ? 2 * cap : 256;
                line *nv = realloc(v, cap * sizeof *v);
                if (!nv) {
                    free(v);
                    return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
                }
                v = nv;
            }
            v[count].label = text + i;
            v[count].label_len = (size_t)(tab - (text + i));
            v[count].text = tab + 1;
            v[count].text_len = (size_t)(text + end - (tab + 1));
            count++;
        }
        i = e + 1;
    }
    if (count == 0) {
        free(v);
        return nl_error_set(err, NL_ERR_FORMAT, "%s: no labelled examples", path);
    }
    *out = v;
    *n = count;
    return NL_OK;
}

/* The sorted distinct labels of the lines. */
static nl_status class_names(nl_labelled *ds, const line *v, size_t n, const char *path,
                             nl_error *err)
{
    char **all = calloc(n, sizeof *all);
    if (!all)
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < n; i++)
        if (!(all[i] = strndup(v[i].label, v[i].label_len)))
            goto nomem;
    qsort(all, n, sizeof *all, cmp_str);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (k > 0 && strcmp(all[k - 1], all[i]) == 0) {
            free(all[i]);
            continue;
        }
        all[k++] = all[i];
    }
    if (k > NL_LABELLED_MAX_CLASSES) {
        for (size_t i = 0; i < k; i++)
            free(all[i]);
        free(all);
        return nl_error_set(err, NL_ERR_LIMIT, "%s: %zu classes, above %d", path, k,
                            NL_LABELLED_MAX_CLASSES);
    }
    ds->names = all;
    ds->n_classes = (int)k;
    return NL_OK;
nomem:
    for (size_t i = 0; i < n; i++)
        free(all[i]);
    free(all);
    return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
}

static int class_of(const nl_labelled *ds, const char *s, size_t len)
{
    int lo = 0, hi = ds->n_classes - 1;
    while (lo <= hi) {
        const int mid = (lo + hi) / 2;
        const int c = strncmp(ds->names[mid], s, len);
        const int r = c != 0 ? c : ds->names[mid][len] != '\0';
        if (r == 0)
            return mid;
        if (r < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -1;
}

/* Tokenize each line's text (bytes when tok is NULL) in the order of
 * `order`, filling ds->ids, start and label. */
static nl_status encode_all(nl_labelled *ds, nl_tokenizer *tok, const line *v, const size_t *order,
                            int64_t vocab, const char *path, nl_error *err)
{
    size_t cap = 0, used = 0;
    for (size_t i = 0; i < ds->n; i++)
        cap += v[i].text_len; /* BPE never makes more ids than bytes */
    if (!(ds->ids = malloc((cap + 1) * sizeof *ds->ids)))
        return nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
    for (size_t j = 0; j < ds->n; j++) {
        const line *l = &v[order[j]];
        ds->start[j] = used;
        ds->label[j] = class_of(ds, l->label, l->label_len);
        size_t got = 0;
        if (tok) {
            nl_status st = nl_tokenizer_encode_into(tok, l->text, l->text_len, ds->ids + used,
                                                    cap - used, &got, err);
            if (st != NL_OK)
                return nl_error_prefix(err, "%s", path);
        } else {
            for (size_t c = 0; c < l->text_len; c++)
                ds->ids[used + c] = (uint8_t)l->text[c];
            got = l->text_len;
        }
        for (size_t c = 0; c < got; c++)
            if (ds->ids[used + c] >= vocab)
                return nl_error_set(err, NL_ERR_RANGE, "%s: id %d is outside the vocabulary %lld",
                                    path, ds->ids[used + c], (long long)vocab);
        used += got;
    }
    ds->start[ds->n] = used;
    return NL_OK;
}

nl_status nl_labelled_load(nl_labelled **out, const char *path, const char *tok_text,
                           int64_t vocab_size, double holdout, uint64_t split_seed, nl_error *err)
{
    *out = NULL;
    if (!(holdout >= 0.0 && holdout <= 0.5))
        return nl_error_set(err, NL_ERR_INVALID, "holdout %g is outside [0, 0.5]", holdout);
    char *text = NULL;
    size_t len = 0, n = 0;
    line *v = NULL;
    size_t *order = NULL;
    nl_tokenizer *tok = NULL;
    nl_labelled *ds = calloc(1, sizeof *ds);
    nl_status st = ds ? NL_OK : nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if (st == NL_OK)
        st = nl_file_read_all(path, NL_DATA_MAX_BYTES, &text, &len, err);
    if (st == NL_OK)
        st = parse_lines(text, len, path, &v, &n, err);
    if (st == NL_OK)
        st = class_names(ds, v, n, path, err);
    if (st == NL_OK && tok_text)
        st = nl_tokenizer_load_buffer(&tok, tok_text, strlen(tok_text), err);
    if (st != NL_OK)
        goto out;
    ds->n = n;
    ds->start = calloc(n + 1, sizeof *ds->start);
    ds->label = calloc(n, sizeof *ds->label);
    order = malloc(n * sizeof *order);
    if (!ds->start || !ds->label || !order) {
        st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    /* the split: a Fisher-Yates shuffle by split_seed, then the tail held out */
    nl_rng r;
    nl_rng_seed(&r, split_seed, nl_rng_hash("labelled-split"));
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    for (size_t i = n; i > 1; i--) {
        const size_t j = (size_t)nl_rng_below(&r, i), t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
    ds->n_train = n - (size_t)((double)n * holdout);
    st = encode_all(ds, tok, v, order, vocab_size, path, err);
out:
    free(order);
    free(v);
    free(text);
    nl_tokenizer_destroy(&tok);
    if (st != NL_OK)
        nl_labelled_destroy(&ds);
    *out = ds;
    return st;
}

void nl_labelled_destroy(nl_labelled **dsp)
{
    if (!dsp || !*dsp)
        return;
    nl_labelled *ds = *dsp;
    for (int i = 0; ds->names && i < ds->n_classes; i++)
        free(ds->names[i]);
    free(ds->names);
    free(ds->ids);
    free(ds->start);
    free(ds->label);
    free(ds);
    *dsp = NULL;
}

/* Row b of a batch: example e cut to its first T ids and padded (doc 1
 * on the pads), its length and label. */
static void fill_row(const nl_labelled *ds, size_t e, int b, int T, int32_t *tokens,
                     int32_t *lengths, int32_t *labels, int32_t *doc)
{
    size_t n = ds->start[e + 1] - ds->start[e];
    n = n > (size_t)T ? (size_t)T : n;
    if (n == 0) { /* an example whose text made no ids: one pad */
        n = 1;
        tokens[(size_t)b * T] = 0;
    } else {
        memcpy(tokens + (size_t)b * T, ds->ids + ds->start[e], n * sizeof *tokens);
    }
    for (size_t t = n; t < (size_t)T; t++)
        tokens[(size_t)b * T + t] = 0;
    for (size_t t = 0; t < (size_t)T; t++)
        doc[(size_t)b * T + t] = t >= n;
    lengths[b] = (int32_t)n;
    labels[b] = ds->label[e];
}

nl_status nl_labelled_batch(const nl_labelled *ds, int split, uint64_t seed, uint64_t index, int B,
                            int T, int32_t *tokens, int32_t *lengths, int32_t *labels, int32_t *doc,
                            nl_error *err)
{
    const size_t first = split ? ds->n_train : 0, count = split ? ds->n - ds->n_train : ds->n_train;
    if (count == 0)
        return nl_error_set(err, NL_ERR_INVALID, "the %s split has no examples",
                            split ? "held-out" : "training");
    nl_rng r;
    nl_rng_seed(&r, seed ^ ((uint64_t)split << 63), index ^ nl_rng_hash("labelled-batch"));
    for (int b = 0; b < B; b++)
        fill_row(ds, first + (size_t)nl_rng_below(&r, count), b, T, tokens, lengths, labels, doc);
    return NL_OK;
}

size_t nl_labelled_eval_batches(const nl_labelled *ds, int B)
{
    const size_t held = ds->n - ds->n_train;
    return B > 0 ? (held + (size_t)B - 1) / (size_t)B : 0;
}

nl_status nl_labelled_eval_batch(const nl_labelled *ds, size_t index, int B, int T, int32_t *tokens,
                                 int32_t *lengths, int32_t *labels, int32_t *doc, int *count,
                                 nl_error *err)
{
    if (index >= nl_labelled_eval_batches(ds, B))
        return nl_error_set(err, NL_ERR_RANGE,
                            "held-out batch %zu of %zu (%zu examples in batches of %d)", index,
                            nl_labelled_eval_batches(ds, B), ds->n - ds->n_train, B);
    int k = 0;
    for (int b = 0; b < B; b++) {
        const size_t e = ds->n_train + index * (size_t)B + (size_t)b;
        if (e < ds->n) {
            fill_row(ds, e, b, T, tokens, lengths, labels, doc);
            k++;
            continue;
        }
        for (int t = 0; t < T; t++) { /* past the end: one pad, scored out */
            tokens[(size_t)b * T + t] = 0;
            doc[(size_t)b * T + t] = t >= 1;
        }
        lengths[b] = 1;
        labels[b] = -1;
    }
    if (count)
        *count = k;
    return NL_OK;
}

void nl_labelled_score(const float *probs, const int32_t *labels, int B, int K, double *ce,
                       int64_t *right, int64_t *n)
{
    for (int b = 0; b < B; b++) {
        if (labels[b] < 0 || labels[b] >= K)
            continue;
        const float *p = probs + (size_t)b * K;
        int best = 0;
        for (int k = 1; k < K; k++)
            best = p[k] > p[best] ? k : best;
        const double q = p[labels[b]];
        *ce -= log(q > 1e-30 ? q : 1e-30);
        *right += best == labels[b];
        *n += 1;
    }
}
