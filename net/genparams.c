/* The generation job's parameter schema (genparams.h): one table of keys,
 * read by the coordinator and by the node through net/params.h. */
#include "net/genparams.h"

#include <limits.h>

#include "net/params.h"

#define REQ (1u << NL_GENPARAMS_REQUEST)
#define SES (1u << NL_GENPARAMS_SESSION)
#define F(f) NL_PARAM_FIELD(nl_genparams, f)

static const nl_param_key keys[] = {
    {"session", NL_PT_INT, SES, SES, 1, (double)INT64_MAX, 0, F(session)},
    {"capacity", NL_PT_INT, SES, SES, 1, INT_MAX, 0, F(capacity)},
    {"limit", NL_PT_INT, SES, 0, 0, INT_MAX, 0, F(limit)},
    {"max_new", NL_PT_INT, REQ, 0, 1, 1 << 20, 0, F(max_new)},
    {"temperature", NL_PT_NUM, REQ | SES, 0, 0, 1e6, 0, F(temperature)},
    {"top_p", NL_PT_NUM, REQ | SES, 0, 0, 1, 1, F(top_p)},
    {"seed", NL_PT_INT, REQ | SES, 0, 0, (double)INT64_MAX, 0, F(seed)},
    {"adapter", NL_PT_STR, REQ | SES, 0, 1, 4096, 0, F(adapter)},
    {"logprobs", NL_PT_INT, REQ | SES, 0, 0, 21, 0, F(logprobs)},
};

void nl_genparams_defaults(nl_genparams *p)
{
    *p = (nl_genparams){.max_new = 32, .temperature = 0.8, .top_p = 0.95};
}

nl_status nl_genparams_parse(nl_genparams *p, const nl_wire_param *params, uint32_t n,
                             nl_genparams_use use, nl_error *err)
{
    nl_genparams_defaults(p);
    return nl_params_read(p, keys, sizeof keys / sizeof keys[0], use, params, n, "generate", err);
}

uint32_t nl_genparams_session_wire(const nl_genparams *p, nl_wire_param *out)
{
    out[0] = (nl_wire_param){.key = "session", .kind = NL_WIRE_PARAM_INT, .i = (int64_t)p->session};
    out[1] = (nl_wire_param){.key = "capacity", .kind = NL_WIRE_PARAM_INT, .i = p->capacity};
    out[2] =
        (nl_wire_param){.key = "temperature", .kind = NL_WIRE_PARAM_FLOAT, .f = p->temperature};
    out[3] = (nl_wire_param){.key = "top_p", .kind = NL_WIRE_PARAM_FLOAT, .f = p->top_p};
    out[4] = (nl_wire_param){.key = "seed", .kind = NL_WIRE_PARAM_INT, .i = p->seed};
    out[5] = (nl_wire_param){.key = "limit", .kind = NL_WIRE_PARAM_INT, .i = p->limit};
    uint32_t n = NL_GENPARAMS_SESSION_KEYS;
    if (p->adapter)
        out[n++] = (nl_wire_param){.key = "adapter", .kind = NL_WIRE_PARAM_STR, .s = p->adapter};
    if (p->logprobs)
        out[n++] = (nl_wire_param){.key = "logprobs", .kind = NL_WIRE_PARAM_INT, .i = p->logprobs};
    return n;
}
