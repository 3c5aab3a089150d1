/* The growth history (core/grow/grow.h): its JSON form, kept in checkpoint
 * metadata ("growth") and manifests, and the regions of a parameter each
 * entry created, from which AdamW counts their bias correction. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/grow/grow.h"

const char *nl_grow_kind_name(nl_grow_kind k)
{
    switch (k) {
    case NL_GROW_VOCAB:
        return "vocab";
    case NL_GROW_DEPTH:
        return "depth";
    case NL_GROW_WIDTH:
        return "width";
    }
    return NULL;
}

int nl_growth_describe(const nl_growth *g, char *buf, size_t n)
{
    const nl_config *a = &g->before, *b = &g->after;
    const long long step = (long long)g->step;
    switch (g->kind) {
    case NL_GROW_VOCAB:
        return snprintf(buf, n, "vocab %lld -> %lld (table rows %lld -> %lld) at step %lld",
                        (long long)a->vocab_size, (long long)b->vocab_size,
                        (long long)nl_config_capacity(a), (long long)nl_config_capacity(b), step);
    case NL_GROW_DEPTH:
        return snprintf(buf, n, "depth %d -> %d layers at step %lld", a->num_layers, b->num_layers,
                        step);
    case NL_GROW_WIDTH:
        return snprintf(buf, n,
                        "width hidden_dim %d -> %d, heads %d/%d -> %d/%d, ffn_dim %d -> %d at "
                        "step %lld",
                        a->hidden_dim, b->hidden_dim, a->num_heads, a->num_kv_heads, b->num_heads,
                        b->num_kv_heads, a->ffn_dim, b->ffn_dim, step);
    }
    return snprintf(buf, n, "growth of an unknown kind at step %lld", step);
}

/* ---------------------------------------------------------------- JSON */

static json_t *config_json(const nl_config *c)
{
    char *text = nl_config_to_json(c);
    json_t *v = text ? json_loads(text, 0, NULL) : NULL;
    free(text);
    return v;
}

char *nl_growth_to_json(const nl_growth *h, int n)
{
    json_t *arr = json_array();
    char *out = NULL;
    for (int i = 0; arr && i < n; i++) {
        const char *kind = nl_grow_kind_name(h[i].kind);
        json_t *o = json_pack("{sIsIsssoso}", "step", (json_int_t)h[i].step, "adam_steps",
                              (json_int_t)h[i].adam_steps, "kind", kind ? kind : "?", "before",
                              config_json(&h[i].before), "after", config_json(&h[i].after));
        if (!o || json_array_append_new(arr, o) != 0)
            goto out;
    }
    if (arr)
        out = json_dumps(arr, JSON_COMPACT);
out:
    json_decref(arr);
    return out;
}

static nl_status entry_config(json_t *o, const char *key, int i, nl_config *c, nl_error *err)
{
    json_t *v = json_object_get(o, key);
    if (!v || !json_is_object(v))
        return nl_error_set(err, NL_ERR_FORMAT, "growth[%d].%s: %s", i, key,
                            v ? "expected an object" : "missing");
    char *text = json_dumps(v, JSON_COMPACT);
    if (!text)
        return nl_error_set(err, NL_ERR_NOMEM, "growth[%d].%s: out of memory", i, key);
    nl_status st = nl_config_from_json(c, text, err);
    free(text);
    if (st == NL_OK)
        st = nl_config_validate(c, 1, err);
    return st == NL_OK ? NL_OK : nl_error_prefix(err, "growth[%d].%s", i, key);
}

static nl_status entry_count(json_t *o, const char *key, int i, int64_t *out, nl_error *err)
{
    json_t *v = json_object_get(o, key);
    if (!v || !json_is_integer(v) || json_integer_value(v) < 0)
        return nl_error_set(err, NL_ERR_FORMAT, "growth[%d].%s: %s", i, key,
                            v ? "expected a count" : "missing");
    *out = json_integer_value(v);
    return NL_OK;
}

static int same_config(const nl_config *a, const nl_config *b)
{
    char *x = nl_config_to_json(a), *y = nl_config_to_json(b);
    int same = x && y && strcmp(x, y) == 0;
    free(x);
    free(y);
    return same;
}

nl_status nl_growth_from_json(const char *json, nl_growth **out, int *n, nl_error *err)
{
    json_error_t je;
    nl_status st = NL_OK;
    nl_growth *h = NULL;
    *out = NULL;
    *n = 0;
    json_t *arr = json_loads(json, JSON_REJECT_DUPLICATES, &je);
    if (!arr || !json_is_array(arr)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "growth: %s", arr ? "expected an array" : je.text);
        goto out;
    }
    const size_t count = json_array_size(arr);
    if (count > NL_GROWTH_MAX) {
        st = nl_error_set(err, NL_ERR_RANGE, "growth: %zu entries (at most %d)", count,
                          NL_GROWTH_MAX);
        goto out;
    }
    if (count && !(h = calloc(count, sizeof *h))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "growth: out of memory");
        goto out;
    }
    for (int i = 0; i < (int)count && st == NL_OK; i++) {
        json_t *o = json_array_get(arr, (size_t)i), *k = json_object_get(o, "kind");
        if (!json_is_object(o)) {
            st = nl_error_set(err, NL_ERR_FORMAT, "growth[%d]: expected an object", i);
            break;
        }
        const char *kind = json_is_string(k) ? json_string_value(k) : "";
        h[i].kind = strcmp(kind, "vocab") == 0   ? NL_GROW_VOCAB
                    : strcmp(kind, "depth") == 0 ? NL_GROW_DEPTH
                    : strcmp(kind, "width") == 0 ? NL_GROW_WIDTH
                                                 : 0;
        if (!h[i].kind) {
            st = nl_error_set(err, NL_ERR_FORMAT,
                              "growth[%d].kind: expected \"vocab\", \"depth\" or \"width\"", i);
            break;
        }
        if ((st = entry_count(o, "step", i, &h[i].step, err)) ||
            (st = entry_count(o, "adam_steps", i, &h[i].adam_steps, err)) ||
            (st = entry_config(o, "before", i, &h[i].before, err)) ||
            (st = entry_config(o, "after", i, &h[i].after, err)))
            break;
        if (i > 0 && (h[i].step < h[i - 1].step || !same_config(&h[i - 1].after, &h[i].before)))
            st = nl_error_set(err, NL_ERR_FORMAT,
                              "growth[%d]: does not follow growth[%d] (an earlier step, or "
                              "'before' is not the previous 'after')",
                              i, i - 1);
    }
    if (st == NL_OK) {
        *out = h;
        *n = (int)count;
        h = NULL;
    }
out:
    free(h);
    json_decref(arr);
    return st;
}

/* ---------------------------------------------------------------- shapes, regions */

static int shape2(int64_t s[2], int64_t a, int64_t b)
{
    s[0] = a;
    s[1] = b;
    return 2;
}

static int shape1(int64_t s[2], int64_t a)
{
    s[0] = a;
    s[1] = 0;
    return 1;
}

int nl_config_param_shape(const nl_config *c, const char *name, int64_t s[2])
{
    const int64_t d = c->hidden_dim, hd = nl_config_head_dim(c), C = nl_config_capacity(c);
    const int64_t H = c->num_heads, G = c->num_kv_heads, F = c->ffn_dim;
    char rest[NL_PARAM_NAME_MAX], what[NL_PARAM_NAME_MAX];
    int l = -1, e = -1, used = 0;
    if (!strcmp(name, "tok_embeddings.weight") || !strcmp(name, "lm_head.weight"))
        return shape2(s, C, d);
    if (!strcmp(name, "norm.weight"))
        return shape1(s, d);
    if (!strcmp(name, "classifier.weight"))
        return c->num_classes > 0 ? shape2(s, c->num_classes, d) : 0;
    if (sscanf(name, "layers.%d.%n", &l, &used) != 1 || used == 0 || l < 0 || l >= c->num_layers ||
        strlen(name + used) >= sizeof rest)
        return 0;
    strcpy(rest, name + used);
    if (!strcmp(rest, "attention_norm.weight") || !strcmp(rest, "ffn_norm.weight"))
        return shape1(s, d);
    if (!strcmp(rest, "attention.wq.weight"))
        return shape2(s, H * hd, d);
    if (!strcmp(rest, "attention.wk.weight") || !strcmp(rest, "attention.wv.weight"))
        return shape2(s, G * hd, d);
    if (!strcmp(rest, "attention.wo.weight"))
        return shape2(s, d, H * hd);
    if (!strcmp(rest, "moe.router.weight"))
        return nl_config_dense(c) ? 0 : shape2(s, c->num_experts, d);
    used = 0;
    if (sscanf(rest, "moe.experts.%d.%n", &e, &used) != 1 || used == 0 || e < 0 ||
        e >= c->num_experts)
        return 0;
    strcpy(what, rest + used);
    if (!strcmp(what, "w_gate.weight") || !strcmp(what, "w_up.weight"))
        return shape2(s, F, d);
    if (!strcmp(what, "w_down.weight"))
        return shape2(s, d, F);
    return 0;
}

int nl_growth_regions(const nl_growth *g, const char *name, nl_grow_rect out[2])
{
    int64_t b[2], a[2];
    const int nb = nl_config_param_shape(&g->before, name, b);
    const int na = nl_config_param_shape(&g->after, name, a);
    if (!na)
        return 0;
    const int64_t Ra = a[0], Ca = na == 2 ? a[1] : 1; /* 1-D: a column */
    if (!nb) {
        out[0] = (nl_grow_rect){0, Ra, 0, Ca};
        return 1;
    }
    const int64_t Rb = b[0], Cb = nb == 2 ? b[1] : 1;
    int n = 0;
    if (Ra > Rb)
        out[n++] = (nl_grow_rect){Rb, Ra, 0, Ca};
    if (Ca > Cb)
        out[n++] = (nl_grow_rect){0, Rb < Ra ? Rb : Ra, Cb, Ca};
    return n;
}
