/* The generation job's parameter schema (genparams.h): one table of keys,
 * read by the coordinator and by the node. */
#include "genparams.h"

#include <limits.h>
#include <string.h>

typedef enum { K_INT, K_NUM } key_type;

typedef struct key {
    const char *name;
    key_type type;
    unsigned uses;     /* bit (1 << nl_genparams_use) */
    unsigned required; /* ... in which it must be present */
    double lo, hi;
    int lo_open; /* the range excludes lo */
    size_t off;  /* the field in nl_genparams */
} key;

#define REQ (1u << NL_GENPARAMS_REQUEST)
#define SES (1u << NL_GENPARAMS_SESSION)

static const key keys[] = {
    {"session", K_INT, SES, SES, 1, (double)INT64_MAX, 0, offsetof(nl_genparams, session)},
    {"capacity", K_INT, SES, SES, 1, INT_MAX, 0, offsetof(nl_genparams, capacity)},
    {"limit", K_INT, SES, 0, 0, INT_MAX, 0, offsetof(nl_genparams, limit)},
    {"max_new", K_INT, REQ, 0, 1, 1 << 20, 0, offsetof(nl_genparams, max_new)},
    {"temperature", K_NUM, REQ | SES, 0, 0, 1e6, 0, offsetof(nl_genparams, temperature)},
    {"top_p", K_NUM, REQ | SES, 0, 0, 1, 1, offsetof(nl_genparams, top_p)},
    {"seed", K_INT, REQ | SES, 0, 0, (double)INT64_MAX, 0, offsetof(nl_genparams, seed)},
};

void nl_genparams_defaults(nl_genparams *p)
{
    *p = (nl_genparams){.max_new = 32, .temperature = 0.8, .top_p = 0.95};
}

static const nl_wire_param *find(const nl_wire_param *ps, uint32_t n, const char *name)
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

/* Store v into the field of k (its C type follows from the key). */
static void store(nl_genparams *p, const key *k, double d, int64_t i)
{
    char *f = (char *)p + k->off;
    if (k->type == K_NUM)
        memcpy(f, &d, sizeof d);
    else if (k->off == offsetof(nl_genparams, session))
        *(uint64_t *)(void *)f = (uint64_t)i;
    else if (k->off == offsetof(nl_genparams, seed))
        *(int64_t *)(void *)f = i;
    else
        *(int *)(void *)f = (int)i;
}

static nl_status read_key(nl_genparams *p, const key *k, const nl_wire_param *q, nl_error *err)
{
    double d = 0.0;
    if (q->kind == NL_WIRE_PARAM_INT)
        d = (double)q->i;
    else if (q->kind == NL_WIRE_PARAM_FLOAT && k->type == K_NUM)
        d = q->f;
    else
        return nl_error_set(err, NL_ERR_RANGE, "JOB_SUBMIT params.%s: %s, not %s", k->name,
                            kind_name(q->kind), k->type == K_INT ? "an integer" : "a number");
    const int below = k->lo_open ? !(d > k->lo) : !(d >= k->lo);
    if (below || !(d <= k->hi)) /* NaN fails both */
        return nl_error_set(err, NL_ERR_RANGE, "JOB_SUBMIT params.%s: %g is outside %c%g, %g]",
                            k->name, d, k->lo_open ? '(' : '[', k->lo, k->hi);
    store(p, k, d, q->kind == NL_WIRE_PARAM_INT ? q->i : 0);
    return NL_OK;
}

nl_status nl_genparams_parse(nl_genparams *p, const nl_wire_param *params, uint32_t n,
                             nl_genparams_use use, nl_error *err)
{
    const unsigned bit = 1u << use;
    nl_genparams_defaults(p);
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const key *k = &keys[i];
        if (!(k->uses & bit))
            continue;
        const nl_wire_param *q = find(params, n, k->name);
        if (!q && (k->required & bit))
            return nl_error_set(err, NL_ERR_PROTO, "JOB_SUBMIT: generate needs params.%s", k->name);
        nl_status st = q ? read_key(p, k, q, err) : NL_OK;
        if (st != NL_OK)
            return st;
    }
    return NL_OK;
}

void nl_genparams_session_wire(const nl_genparams *p, nl_wire_param *out)
{
    out[0] = (nl_wire_param){.key = "session", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)p->session};
    out[1] = (nl_wire_param){.key = "capacity", .kind = NL_WIRE_PARAM_INT, .i = p->capacity};
    out[2] =
        (nl_wire_param){.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = p->temperature};
    out[3] = (nl_wire_param){.key = "top_p", .kind = NL_WIRE_PARAM_FLOAT, .f = p->top_p};
    out[4] = (nl_wire_param){.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = p->seed};
    out[5] = (nl_wire_param){.key = "limit", .kind = NL_WIRE_PARAM_INT, .i = p->limit};
}
