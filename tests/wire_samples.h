/* Sample messages of every type and encode/decode helpers shared by the
 * wire codec's test programs (test_wire, test_wire_limits). */
#ifndef NL_TEST_WIRE_SAMPLES_H
#define NL_TEST_WIRE_SAMPLES_H

#include <stdbool.h>
#include <stdint.h>

#include "net/wire.h"

extern const nl_msg_type all_types[];
extern const int wire_ntypes;
#define NTYPES wire_ntypes

#define KEY_A "wRbKYzxIQTl+D?ZETf+ukt)!*]MF&1g3]Vtqp:Pb"
#define KEY_B "4MlA35H1MocC(vJi?ueF}kxI:5T?tGOf*cSUM7a5"
/* a local link's token (LOCAL_LINK OFFER): 64 lowercase hex digits */
#define LOCAL_TOKEN "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

/* frame payloads the samples point into (fill_data sets them) */
extern float act[2 * 3 * 16];
extern int32_t toks_frame[2 * 5];
extern float chunk[64];
extern const nl_wire_param params[4]; /* JOB_SUBMIT sample parameters */

void fill_data(void);
void set_frame(nl_wire_frame *f, nl_dtype dt, void *data, int ndim, const int64_t *shape);
/* A valid message of type t with every field set. */
void sample(nl_wire_msg *m, nl_msg_type t);
bool seq(const char *a, const char *b);
bool same_msg(const nl_wire_msg *a, const nl_wire_msg *b);
/* A training hop with extras (NL_HOP_* bits) and loss rows: tokens [2, 5]
 * and the named arrays hx_*; LOSS with a correct count when type is LOSS. */
extern const int32_t hx_tokens[10], hx_targets[10], hx_docs[10], hx_labels[2], hx_lengths[2];
void extras_sample(nl_wire_msg *m, nl_msg_type type, unsigned extras);

typedef struct enc {
    nl_wire_wbuf hdr;
    nl_wire_part parts[NL_WIRE_MAX_FRAMES + 2];
    int nparts;
} enc;

nl_status enc_msg(nl_wire_msg *m, enc *e, const nl_wire_limits *lim, nl_error *err);
/* Decode from heap copies of exactly the given sizes, so any read past a
 * part's end is an ASan error; frames of out dangle afterwards. */
nl_status dec_copy(nl_wire_msg *out, const void *h, size_t hlen, const nl_wire_part *frames, int nf,
                   const nl_wire_limits *lim, nl_error *err);
nl_status dec_parts(nl_wire_msg *out, const enc *e, const nl_wire_limits *lim, nl_error *err);

#endif
