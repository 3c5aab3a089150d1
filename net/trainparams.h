/* The parameters of a training or fine-tuning job, one schema for
 * everyone who reads them: the client that writes a request (neuroctl
 * train and finetune, cli/cmd_remote_train.c, whose flags take these
 * ranges and defaults, as local training's do: cli/train_report.c), the
 * coordinator that reads it (coordinator/coord_train_prep.c,
 * coord_finetune.c), and a node that reads the coordinator's JOB_SUBMIT
 * for its stage (node/stage_train.c, stage_lora.c).
 *
 *   key               type       range           default       in
 *   job               integer    >= 1            required      a stage's
 *   data              string     1..4096 bytes   required      a request
 *   checkpoint_dir    string     1..1000 bytes   required      a request
 *   resume            string     1..4096 bytes   none          a train request
 *   steps             integer    1 .. 2^31 - 1   required      a request
 *   batch             integer    1 .. 65536      8             a request
 *   seq               integer    1 .. 2^20       256           both (a stage: <= max_seq_len)
 *   microbatches      integer    1 .. 65536      1             both
 *   micro_batch       integer    1 .. 2^20       required      a stage's
 *   seed              integer    >= 0            0             a request
 *   warmup            integer    0 .. 2^31 - 1   steps / 10    a request
 *   eval_every        integer    0 .. 2^31 - 1   0 (never)     a request
 *   eval_batches      integer    1 .. 2^20       4             a request
 *   checkpoint_every  integer    0 .. 2^31 - 1   0 (never)     a request
 *   lr                number     0 .. 10         3e-4          a request
 *   min_lr            number     0 .. 10         lr / 10       a request
 *   holdout           number     0 .. 0.5        0.1           a request
 *   recompute         boolean                    false         both
 *   final_checkpoint  boolean                    false         a request
 *   seq_default       boolean                    false         a request (seq is the client's
 *                                                              default: fit to max_seq_len)
 *   learn_vocab       integer    0 .. 2^24       0             a train request
 *   objective         clm|mlm|classify           the model's   a request (core/train/objective.h)
 *   pack              boolean                    false         a request (packed rows: <|end|>
 *                                                              ends a document,
 * core/train/objective.h) lora_rank         integer    1 .. 1024       8             fine-tuning
 *   lora_alpha        number     (0, 1e6]        16            fine-tuning
 *   lora_targets      string     1..39 bytes     wq,wk,wv,wo   fine-tuning (core/model/lora.h)
 *   lora_seed         integer    >= 0            required      a stage's fine-tuning
 *   start_step        integer    0 .. 2^62       0             a stage's
 *   adam_steps        integer    0 .. 2^62       0             a stage's
 *   moments           boolean                    false         a stage's training
 *   eval_hops         integer    0 .. 2^30       0             a stage's
 *   verify_outputs    boolean                    false         a stage's training: keep the
 *                                                              step's outputs (a verifier of
 *                                                              another device class compares them)
 *   outer_every       integer    0 .. 2^31-1     0             a stage's training: DiLoCo's H
 *                                                              (0: the replicas add up every
 *                                                              step's gradients; DESIGN section 8)
 *   outer_lr          number     0 .. 10         0.7           a stage's training: DiLoCo's
 *                                                              outer learning rate
 *   outer_momentum    number     0 .. 0.999      0.9           a stage's training: DiLoCo's
 *                                                              outer Nesterov momentum
 *   in_flight_extra   integer    0 .. 65536      0             a stage's: microbatches kept
 *                                                              in flight beyond 1F1B's
 *                                                              (core/model/memory.h)
 *
 * In a request every key with a default but the booleans, learn_vocab,
 * objective and resume is required: the client sends the defaults it
 * applied. Read by net/params.h (types, messages, NL_ERR_RANGE and
 * NL_ERR_PROTO as there), then the rules across keys below, each named
 * in the message. A train request's resume and learn_vocab are read in a
 * fine-tuning request too, to refuse them. */
#ifndef NL_TRAINPARAMS_H
#define NL_TRAINPARAMS_H

#include <stdint.h>

#include "base/status.h"
#include "net/wire.h"

typedef enum {
    NL_TRAINPARAMS_TRAIN = 0, /* a client's request, kind train */
    NL_TRAINPARAMS_FINETUNE,  /* a client's request, kind finetune */
    NL_TRAINPARAMS_STAGE,     /* the coordinator's to a stage, kind train */
    NL_TRAINPARAMS_STAGE_FT   /* the coordinator's to a stage, kind finetune */
} nl_trainparams_use;

/* A microbatch holds at most this many rows (sequences x positions). */
#define NL_TRAIN_MICRO_ROWS_MAX (1 << 24)

typedef struct nl_trainparams {
    /* the run, as a client asks for it (strings point into the params) */
    const char *data, *checkpoint_dir, *resume;
    int64_t steps, batch, seq, micro, seed, warmup, eval_every, eval_batches, ckpt_every;
    double lr, min_lr, holdout;
    int recompute, final_ckpt, seq_default;
    int64_t learn_vocab;
    int objective; /* nl_objective, or NL_OBJ_MODEL: the model's config's */
    int pack;      /* packed rows (nl_objective_batch's doc) */
    /* fine-tuning: the adapters */
    int64_t lora_rank;
    double lora_alpha;
    const char *lora_targets;
    int lora_bits; /* lora_targets parsed (core/model/lora.h NL_LORA_*) */
    int64_t lora_seed;
    /* a stage's job */
    uint64_t job;
    int64_t micro_batch, start_step, adam_steps, eval_hops, outer_every, in_flight_extra;
    double outer_lr, outer_momentum;
    int moments, verify_outputs;
} nl_trainparams;

/* The most keys one use writes. */
#define NL_TRAINPARAMS_MAX_KEYS 40

/* The defaults of the table above (warmup and min_lr -1: derived from
 * steps and lr; required keys 0 or NULL). */
void nl_trainparams_defaults(nl_trainparams *p);

/* Read params[0..n) for `use` into p (defaults first), then check the
 * rules across keys. */
nl_status nl_trainparams_parse(nl_trainparams *p, const nl_wire_param *params, uint32_t n,
                               nl_trainparams_use use, nl_error *err);

/* p's keys of `use` as wire params in out (room for
 * NL_TRAINPARAMS_MAX_KEYS): the required ones, the booleans, and the
 * others that differ from the defaults. Keys are static, strings p's. Returns how many. */
uint32_t nl_trainparams_wire(const nl_trainparams *p, nl_trainparams_use use, nl_wire_param *out);

/* The range of key (a string's: its length); NL_ERR_NOTFOUND for a key
 * not in the table. Bounds past 2^63 - 1 read as INT64_MAX's double. */
nl_status nl_trainparams_range(const char *key, double *lo, double *hi);

/* The batch rule, the same for a client's flags, a request and local
 * training: microbatches divides batch, a microbatch (batch /
 * microbatches sequences of seq) holds at most NL_TRAIN_MICRO_ROWS_MAX
 * rows, eval_batches x microbatches is at most 2^30, and evaluating
 * (eval_every > 0) needs held-out data (holdout > 0). `pre` names the
 * keys in the message: "--" (flags: --eval-every) or "params.". */
nl_status nl_trainparams_check_batch(const nl_trainparams *p, const char *pre, nl_error *err);

#endif
