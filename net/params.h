/* The reader the job schemas share (net/genparams.h, net/trainparams.h):
 * a schema is one table of keys (name, type, range, which uses read it,
 * which need it, the field it fills), and a JOB_SUBMIT's parameters are
 * read by walking it. Each schema's header shows its table as text.
 *
 * Types: an integer must come as one (a boolean key also takes 0 or 1); a
 * number may come as an integer or a float; a string's range is its
 * length in bytes; an objective is a string of core/train/objective.h, stored as
 * its nl_objective. A value of the wrong type or out of range is
 * NL_ERR_RANGE, and a missing required key NL_ERR_PROTO, each with a
 * message that names the key ("JOB_SUBMIT params.seq: ..."): never a
 * silent default. Keys of the other uses, and unknown keys, are ignored. */
#ifndef NL_PARAMS_H
#define NL_PARAMS_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "net/wire.h"

typedef enum { NL_PT_INT, NL_PT_NUM, NL_PT_BOOL, NL_PT_STR, NL_PT_OBJECTIVE } nl_param_type;

typedef struct nl_param_key {
    const char *name;
    nl_param_type type;
    unsigned uses;     /* bit (1 << use) of the schema's uses that read it */
    unsigned required; /* ... in which it must be present */
    double lo, hi;     /* the range; of a string, its length */
    int lo_open;       /* the range excludes lo */
    size_t off, size;  /* the field: int, int64_t, uint64_t, double, const char * */
} nl_param_key;

/* off and size of field f of struct type T, for a table row. */
#define NL_PARAM_FIELD(T, f) offsetof(T, f), sizeof(((T *)0)->f)

/* The parameter named `name` in ps[0..n), or NULL. */
const nl_wire_param *nl_params_find(const nl_wire_param *ps, uint32_t n, const char *name);

/* Read ps[0..n) into the struct at out for `use`, key by key in the
 * table's order (a field keeps what it held when its key is absent: set
 * the defaults first). `job` names the job kind in the message for a
 * missing key ("JOB_SUBMIT: train needs params.steps"). Strings point
 * into ps. */
nl_status nl_params_read(void *out, const nl_param_key *keys, size_t nkeys, unsigned use,
                         const nl_wire_param *ps, uint32_t n, const char *job, nl_error *err);

/* The keys of `use` from the struct at in as wire params into out (room
 * for nkeys): the required keys, every boolean (it says what it is either
 * way), and the others whose value differs from the struct at dflt (a
 * string: set; an objective: named). Keys and
 * strings point into the tables and the structs. Returns how many. */
uint32_t nl_params_write(const void *in, const void *dflt, const nl_param_key *keys, size_t nkeys,
                         unsigned use, nl_wire_param *out);

#endif
