/* The job schemas' reader (params.h): one walk over a table of keys. */
#include "net/params.h"

#include <string.h>

#include "core/train/objective.h"

const nl_wire_param *nl_params_find(const nl_wire_param *ps, uint32_t n, const char *name)
{
    for (uint32_t i = 0; i < n; i++)
        if (ps[i].key && strcmp(ps[i].key, name) == 0)
            return &ps[i];
    return NULL;
}

static const char *kind_name(int kind)
{
    switch (kind) {
    case NL_WIRE_PARAM_INT:
        return "an integer";
    case NL_WIRE_PARAM_FLOAT:
        return "a float";
    case NL_WIRE_PARAM_STR:
        return "a string";
    case NL_WIRE_PARAM_BOOL:
        return "a boolean";
    default:
        return "of an unknown type";
    }
}

static const char *type_name(nl_param_type t)
{
    static const char *const names[] = {"an integer", "a number", "a boolean", "a string",
                                        "a string"};
    return names[t];
}

/* Does the wire kind fit the key's type? */
static int kind_fits(const nl_param_key *k, const nl_wire_param *q)
{
    switch (k->type) {
    case NL_PT_INT:
        return q->kind == NL_WIRE_PARAM_INT;
    case NL_PT_NUM:
        return q->kind == NL_WIRE_PARAM_INT || q->kind == NL_WIRE_PARAM_FLOAT;
    case NL_PT_BOOL:
        return q->kind == NL_WIRE_PARAM_BOOL ||
               (q->kind == NL_WIRE_PARAM_INT && (q->i == 0 || q->i == 1));
    default:
        return q->kind == NL_WIRE_PARAM_STR && q->s;
    }
}

/* The value of q as the range sees it (a string: its length). */
static double value_of(const nl_wire_param *q)
{
    switch (q->kind) {
    case NL_WIRE_PARAM_INT:
        return (double)q->i;
    case NL_WIRE_PARAM_FLOAT:
        return q->f;
    case NL_WIRE_PARAM_BOOL:
        return q->b;
    default:
        return (double)strlen(q->s);
    }
}

/* Store q into the field of k (its C type follows from the key's type and
 * the field's size). */
static void store(void *out, const nl_param_key *k, const nl_wire_param *q, int obj)
{
    char *f = (char *)out + k->off;
    const int64_t i = q->kind == NL_WIRE_PARAM_BOOL ? q->b : q->i;
    const double d = value_of(q);
    const int b = q->kind == NL_WIRE_PARAM_BOOL ? q->b : q->i != 0;
    if (k->type == NL_PT_NUM)
        memcpy(f, &d, sizeof d);
    else if (k->type == NL_PT_STR)
        memcpy(f, &q->s, sizeof q->s);
    else if (k->type == NL_PT_OBJECTIVE)
        memcpy(f, &obj, sizeof obj);
    else if (k->type == NL_PT_BOOL)
        memcpy(f, &b, sizeof b);
    else if (k->size == sizeof(int64_t))
        memcpy(f, &i, sizeof i); /* int64_t or uint64_t: the range keeps it >= 0 */
    else
        *(int *)(void *)f = (int)i;
}

static nl_status read_key(void *out, const nl_param_key *k, const nl_wire_param *q, nl_error *err)
{
    int obj = 0;
    if (!kind_fits(k, q))
        return nl_error_set(err, NL_ERR_RANGE, "JOB_SUBMIT params.%s: %s, not %s", k->name,
                            kind_name(q->kind), type_name(k->type));
    const double d = value_of(q);
    const int below = k->lo_open ? !(d > k->lo) : !(d >= k->lo);
    if (k->type == NL_PT_STR && (below || !(d <= k->hi)))
        return nl_error_set(err, NL_ERR_RANGE, "JOB_SUBMIT params.%s: %.0f bytes, not %g to %g",
                            k->name, d, k->lo, k->hi);
    if (k->type != NL_PT_OBJECTIVE && (below || !(d <= k->hi))) /* NaN fails both */
        return nl_error_set(err, NL_ERR_RANGE, "JOB_SUBMIT params.%s: %g is outside %c%g, %g]",
                            k->name, d, k->lo_open ? '(' : '[', k->lo, k->hi);
    if (k->type == NL_PT_OBJECTIVE && nl_objective_parse(q->s, &obj, err) != NL_OK) {
        nl_error_prefix(err, "JOB_SUBMIT params.%s", k->name);
        if (err)
            err->status = NL_ERR_RANGE; /* a value outside the key's set, as a number's */
        return NL_ERR_RANGE;
    }
    store(out, k, q, obj);
    return NL_OK;
}

nl_status nl_params_read(void *out, const nl_param_key *keys, size_t nkeys, unsigned use,
                         const nl_wire_param *ps, uint32_t n, const char *job, nl_error *err)
{
    const unsigned bit = 1u << use;
    for (size_t i = 0; i < nkeys; i++) {
        const nl_param_key *k = &keys[i];
        if (!(k->uses & bit))
            continue;
        const nl_wire_param *q = nl_params_find(ps, n, k->name);
        if (!q && (k->required & bit))
            return nl_error_set(err, NL_ERR_PROTO, "JOB_SUBMIT: %s needs params.%s", job, k->name);
        nl_status st = q ? read_key(out, k, q, err) : NL_OK;
        if (st != NL_OK)
            return st;
    }
    return NL_OK;
}

uint32_t nl_params_write(const void *in, const void *dflt, const nl_param_key *keys, size_t nkeys,
                         unsigned use, nl_wire_param *out)
{
    const unsigned bit = 1u << use;
    uint32_t n = 0;
    for (size_t i = 0; i < nkeys; i++) {
        const nl_param_key *k = &keys[i];
        const char *f = (const char *)in + k->off;
        const int is_default = memcmp(f, (const char *)dflt + k->off, k->size) == 0;
        if (!(k->uses & bit) || (!(k->required & bit) && k->type != NL_PT_BOOL && is_default))
            continue;
        nl_wire_param *w = &out[n++];
        *w = (nl_wire_param){.key = k->name};
        int64_t i64 = 0;
        int iv = 0;
        switch (k->type) {
        case NL_PT_NUM:
            w->kind = NL_WIRE_PARAM_FLOAT;
            memcpy(&w->f, f, sizeof w->f);
            break;
        case NL_PT_STR:
            w->kind = NL_WIRE_PARAM_STR;
            memcpy(&w->s, f, sizeof w->s);
            break;
        case NL_PT_OBJECTIVE:
            memcpy(&iv, f, sizeof iv);
            *w = (nl_wire_param){
                .key = k->name, .kind = NL_WIRE_PARAM_STR, .s = nl_objective_name(iv)};
            break;
        case NL_PT_BOOL:
            memcpy(&iv, f, sizeof iv);
            w->kind = NL_WIRE_PARAM_BOOL;
            w->b = iv != 0;
            break;
        default:
            if (k->size == sizeof i64) {
                memcpy(&i64, f, sizeof i64);
            } else {
                memcpy(&iv, f, sizeof iv);
                i64 = iv;
            }
            w->kind = NL_WIRE_PARAM_INT;
            w->i = i64;
        }
    }
    return n;
}
