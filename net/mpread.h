/* A bounded msgpack reader used by the wire decoder.
 *
 * nl_mpr_next reads one item's head: scalars whole; for strings, binaries
 * and exts it checks that the body lies inside the buffer, points at it and
 * steps over it; containers report their entry count and are not entered
 * (the caller reads the entries next). nl_mpr_walk checks a whole buffer
 * holds exactly one well-formed map within the limits, and bounds the
 * memory a typed decode of it can need. Nothing here allocates. */
#ifndef NL_MPREAD_H
#define NL_MPREAD_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

#define NL_MPR_MAX_DEPTH 16 /* hard cap on nl_mpr_limits.max_depth */

typedef struct nl_mpr {
    const uint8_t *p, *start, *end;
} nl_mpr;

typedef enum nl_mpr_kind {
    NL_MPR_NIL,
    NL_MPR_BOOL,
    NL_MPR_UINT, /* non-negative integers, whatever their encoding */
    NL_MPR_NEG,  /* negative integers */
    NL_MPR_FLOAT,
    NL_MPR_STR,
    NL_MPR_BIN,
    NL_MPR_ARRAY,
    NL_MPR_MAP,
    NL_MPR_EXT
} nl_mpr_kind;

typedef struct nl_mpr_item {
    nl_mpr_kind k;
    uint64_t u;          /* UINT, BOOL */
    int64_t i;           /* NEG */
    double f;            /* FLOAT (float32 widened) */
    uint32_t n;          /* bytes (str, bin, ext) or entries (array, map) */
    const uint8_t *body; /* str, bin, ext */
} nl_mpr_item;

typedef struct nl_mpr_limits {
    uint32_t max_depth;                      /* containers nested, the root map counting 1 */
    uint32_t max_str;                        /* bytes of a str or bin */
    uint32_t max_array;                      /* entries of an array or map */
    size_t array_entry_cost, map_entry_cost; /* decode memory per entry */
} nl_mpr_limits;

void nl_mpr_init(nl_mpr *r, const void *data, size_t len);
/* NL_ERR_PROTO when the bytes end early or hold 0xc1. err may be NULL. */
nl_status nl_mpr_next(nl_mpr *r, nl_mpr_item *it, nl_error *err);
/* The buffer is one map and nothing else, within the limits (NL_ERR_LIMIT,
 * NL_ERR_PROTO). *need bounds the bytes a decode into an arena takes:
 * each string's length + 1, and each container's entries x their cost. */
nl_status nl_mpr_walk(const void *data, size_t len, const nl_mpr_limits *lim, size_t *need,
                      nl_error *err);
const char *nl_mpr_kind_name(nl_mpr_kind k);

#endif
