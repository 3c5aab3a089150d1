/* The parameters of a generation job, one schema for everyone who reads
 * them: the coordinator reading a client's JOB_SUBMIT generate, and a node
 * reading the coordinator's JOB_SUBMIT that opens a session on its stage.
 *
 *   key          type     range            default  in
 *   max_new      integer  1 .. 2^20        32       a client's request
 *   temperature  number   0 .. 1e6         0.8      both (0: greedy)
 *   top_p        number   (0, 1]           0.95     both
 *   seed         integer  >= 0             0        both
 *   session      integer  >= 1             required a session
 *   capacity     integer  1 .. 2^31 - 1    required a session
 *   limit        integer  0 .. 2^31 - 1    0        a session
 *   adapter      string   1 .. 4096 bytes  none     both (a LoRA adapter file)
 *   logprobs     integer  0 .. 21          0        both (0: none; 1 + k: each token's
 *                                                    log-probability and the top k ids')
 *
 * The coordinator resolves a request's adapter under its --checkpoint-root
 * and sends the session the resolved path; the node resolves it again
 * under its own. Read by net/params.h: a number may come as an integer or
 * a float (`temperature: 0` is 0); an integer must come as one. A value
 * of the wrong type or out of range is NL_ERR_RANGE and a missing
 * required key NL_ERR_PROTO, each with a message naming the key: never a
 * silent default. Keys of the other use, and unknown keys, are ignored. */
#ifndef NL_GENPARAMS_H
#define NL_GENPARAMS_H

#include <stdint.h>

#include "base/status.h"
#include "net/wire.h"

typedef enum { NL_GENPARAMS_REQUEST = 0, NL_GENPARAMS_SESSION } nl_genparams_use;

typedef struct nl_genparams {
    int max_new;
    double temperature, top_p;
    int64_t seed;
    uint64_t session;    /* the generation job's id */
    int capacity;        /* positions of the session's KV cache */
    int limit;           /* tokens the last stage feeds back itself (the token ring); 0: none */
    const char *adapter; /* a LoRA adapter file, or NULL (parsed: points into the params) */
    int logprobs;        /* 0: none; 1 + k: log-probabilities, the top k (k <= 20) */
} nl_genparams;

/* The session's wire params: these always, the adapter and logprobs when
 * set. */
#define NL_GENPARAMS_SESSION_KEYS 6
#define NL_GENPARAMS_SESSION_MAX 8

/* The defaults of the table above (session and capacity 0, no adapter). */
void nl_genparams_defaults(nl_genparams *p);

/* Read params[0..n) for `use` into p (defaults first). Keys are read in
 * the table's order, so p->session is set before a later key can fail. */
nl_status nl_genparams_parse(nl_genparams *p, const nl_wire_param *params, uint32_t n,
                             nl_genparams_use use, nl_error *err);

/* The session's parameters as wire params in out (room for
 * NL_GENPARAMS_SESSION_MAX; their keys are static strings, the adapter
 * p's); returns how many. */
uint32_t nl_genparams_session_wire(const nl_genparams *p, nl_wire_param *out);

#endif
