/* The wire schema, private to the wire module (wire.c reads and writes
 * bytes by its tables, wire_schema.c holds them): the fields of every
 * message type (name, kind, range, character set) and the checks both
 * directions apply. Adding a message type means a struct in wire.h and a
 * table in wire_schema.c. */
#ifndef NL_WIRE_IMPL_H
#define NL_WIRE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "net/wire.h"

/* What a field holds: scalars, a string, or a list (pointer + count). */
typedef enum nl_wire_kind {
    NL_WK_U32,
    NL_WK_U64,
    NL_WK_F64,
    NL_WK_BOOL,
    NL_WK_STR,
    NL_WK_U32_LIST, /* uint32_t *, count in a uint32_t */
    NL_WK_DIMS,     /* int64_t[NL_MAX_DIMS], count in an int */
    NL_WK_PARAMS    /* nl_wire_param *, count in a uint32_t */
} nl_wire_kind;

/* Characters a string field may hold. */
typedef enum nl_wire_charset {
    NL_WCS_UTF8,  /* valid UTF-8 */
    NL_WCS_PRINT, /* printable ASCII */
    NL_WCS_WORD,  /* printable ASCII without spaces */
    NL_WCS_HEX,   /* lowercase hex digits */
    NL_WCS_Z85    /* a 40-character Z85 key (or "" where the minimum length is 0) */
} nl_wire_charset;

/* One header field. lo/hi bound the value (integers), the length
 * (strings) or the count (lists); flo/fhi bound a float. */
typedef struct nl_wire_field {
    const char *name;
    uint8_t kind, cs, nonfinite_ok;
    uint16_t off, count_off;
    uint64_t lo, hi;
    double flo, fhi;
    uint8_t optional; /* may be absent (decodes as 0): a field added later */
} nl_wire_field;

typedef struct nl_wire_tdesc {
    const char *name;
    const nl_wire_field *f;
    uint8_t nf;
    uint8_t min_frames, max_frames, min_dims, max_dims;
    uint16_t dtypes; /* bit per nl_dtype allowed in frames */
    nl_status (*check)(const nl_wire_msg *m, const struct nl_wire_tdesc *td, nl_error *err);
} nl_wire_tdesc;

/* The value of field f in a message's union. */
#define NL_WIRE_FVAL(base, f, T) (*(T const *)((const uint8_t *)(base) + (f)->off))

/* The schema of a type code, NULL if unknown. */
const nl_wire_tdesc *nl_wire_schema_of(uint32_t type);
/* Every field's range and character set, the frames against the type and
 * the limits (decoding: lengths must match; encoding: lengths are set),
 * then the type's cross-field check. */
nl_status nl_wire_schema_check(nl_wire_msg *m, const nl_wire_tdesc *td, const nl_wire_limits *lim,
                               bool decoding, nl_error *err);

/* The cross-field checks of ASSIGN and LOCAL_LINK (wire_assign.c). */
nl_status nl_wire_check_assign(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);
nl_status nl_wire_check_local_link(const nl_wire_msg *m, const nl_wire_tdesc *td, nl_error *err);

#endif
