/* The training job's parameter schema (trainparams.h): one table of keys,
 * read through net/params.h, and the rules across keys. */
#include "net/trainparams.h"

#include <stdio.h>
#include <string.h>

#include "core/model/lora.h"
#include "core/train/objective.h"
#include "core/train/train.h"
#include "net/params.h"

#define TR (1u << NL_TRAINPARAMS_TRAIN)
#define FT (1u << NL_TRAINPARAMS_FINETUNE)
#define REQ (TR | FT)
#define ST (1u << NL_TRAINPARAMS_STAGE)
#define SFT (1u << NL_TRAINPARAMS_STAGE_FT)
#define STG (ST | SFT)
#define I64 ((double)INT64_MAX)
#define I32 2147483647.0
#define F(f) NL_PARAM_FIELD(nl_trainparams, f)

static const nl_param_key keys[] = {
    {"job", NL_PT_INT, STG, STG, 1, I64, 0, F(job)},
    {"data", NL_PT_STR, REQ, REQ, 1, 4096, 0, F(data)},
    {"checkpoint_dir", NL_PT_STR, REQ, REQ, 1, 1000, 0, F(checkpoint_dir)},
    {"resume", NL_PT_STR, REQ, 0, 1, 4096, 0, F(resume)},
    {"steps", NL_PT_INT, REQ, REQ, 1, I32, 0, F(steps)},
    {"batch", NL_PT_INT, REQ, REQ, 1, 65536, 0, F(batch)},
    {"seq", NL_PT_INT, REQ | STG, REQ | STG, 1, 1 << 20, 0, F(seq)},
    {"microbatches", NL_PT_INT, REQ | STG, REQ | STG, 1, 65536, 0, F(micro)},
    {"micro_batch", NL_PT_INT, STG, STG, 1, 1 << 20, 0, F(micro_batch)},
    {"seed", NL_PT_INT, REQ, REQ, 0, I64, 0, F(seed)},
    {"warmup", NL_PT_INT, REQ, REQ, 0, I32, 0, F(warmup)},
    {"eval_every", NL_PT_INT, REQ, REQ, 0, I32, 0, F(eval_every)},
    {"eval_batches", NL_PT_INT, REQ, REQ, 1, 1 << 20, 0, F(eval_batches)},
    {"checkpoint_every", NL_PT_INT, REQ, REQ, 0, I32, 0, F(ckpt_every)},
    {"lr", NL_PT_NUM, REQ, REQ, 0, 10, 0, F(lr)},
    {"min_lr", NL_PT_NUM, REQ, REQ, 0, 10, 0, F(min_lr)},
    {"holdout", NL_PT_NUM, REQ, REQ, 0, 0.5, 0, F(holdout)},
    {"recompute", NL_PT_BOOL, REQ | STG, 0, 0, 1, 0, F(recompute)},
    {"final_checkpoint", NL_PT_BOOL, REQ, 0, 0, 1, 0, F(final_ckpt)},
    {"seq_default", NL_PT_BOOL, REQ, 0, 0, 1, 0, F(seq_default)},
    {"learn_vocab", NL_PT_INT, REQ, 0, 0, 1 << 24, 0, F(learn_vocab)},
    {"objective", NL_PT_OBJECTIVE, REQ, 0, 0, 0, 0, F(objective)},
    {"pack", NL_PT_BOOL, REQ, 0, 0, 1, 0, F(pack)},
    {"lora_rank", NL_PT_INT, FT | SFT, FT | SFT, 1, NL_LORA_MAX_RANK, 0, F(lora_rank)},
    {"lora_alpha", NL_PT_NUM, FT | SFT, FT | SFT, 0, NL_LORA_MAX_ALPHA, 1, F(lora_alpha)},
    {"lora_targets", NL_PT_STR, FT | SFT, FT | SFT, 1, 39, 0, F(lora_targets)},
    {"lora_seed", NL_PT_INT, SFT, SFT, 0, I64, 0, F(lora_seed)},
    {"start_step", NL_PT_INT, STG, 0, 0, (double)(INT64_MAX / 2), 0, F(start_step)},
    {"adam_steps", NL_PT_INT, STG, 0, 0, (double)(INT64_MAX / 2), 0, F(adam_steps)},
    {"moments", NL_PT_BOOL, STG, 0, 0, 1, 0, F(moments)},
    {"eval_hops", NL_PT_INT, STG, 0, 0, 1 << 30, 0, F(eval_hops)},
    {"verify_outputs", NL_PT_BOOL, STG, 0, 0, 1, 0, F(verify_outputs)},
    {"outer_every", NL_PT_INT, STG, 0, 0, I32, 0, F(outer_every)},
    {"outer_lr", NL_PT_NUM, STG, 0, 0, 10, 0, F(outer_lr)},
    {"outer_momentum", NL_PT_NUM, STG, 0, 0, 0.999, 0, F(outer_momentum)},
    {"in_flight_extra", NL_PT_INT, STG, 0, 0, 65536, 0, F(in_flight_extra)},
};

#define NKEYS (sizeof keys / sizeof keys[0])

_Static_assert(NKEYS <= NL_TRAINPARAMS_MAX_KEYS, "NL_TRAINPARAMS_MAX_KEYS");

void nl_trainparams_defaults(nl_trainparams *p)
{
    *p = (nl_trainparams){.batch = 8,
                          .seq = 256,
                          .micro = 1,
                          .warmup = -1,
                          .eval_batches = 4,
                          .lr = 3e-4,
                          .min_lr = -1,
                          .holdout = 0.1,
                          .objective = NL_OBJ_MODEL,
                          .lora_rank = 8,
                          .lora_alpha = 16.0,
                          .lora_targets = "wq,wk,wv,wo",
                          .outer_lr = NL_DILOCO_OUTER_LR,
                          .outer_momentum = NL_DILOCO_OUTER_MOMENTUM};
}

/* A key as `pre` names it: "--eval-every" or "params.eval_every". */
static const char *name(char *buf, size_t cap, const char *pre, const char *key)
{
    snprintf(buf, cap, "%s%s", pre, key);
    for (char *c = buf; pre[0] == '-' && *c; c++)
        if (*c == '_')
            *c = '-';
    return buf;
}

nl_status nl_trainparams_check_batch(const nl_trainparams *p, const char *pre, nl_error *err)
{
    char a[40], b[40], c[40];
    if (p->batch % p->micro != 0)
        return nl_error_set(err, NL_ERR_RANGE, "%s: %lld does not divide %s %lld",
                            name(a, sizeof a, pre, "microbatches"), (long long)p->micro,
                            name(b, sizeof b, pre, "batch"), (long long)p->batch);
    if ((p->batch / p->micro) * p->seq > NL_TRAIN_MICRO_ROWS_MAX)
        return nl_error_set(
            err, NL_ERR_RANGE, "%s / %s x %s: a microbatch of %lld x %lld is more than 2^24 rows",
            name(a, sizeof a, pre, "batch"), name(b, sizeof b, pre, "microbatches"),
            name(c, sizeof c, pre, "seq"), (long long)(p->batch / p->micro), (long long)p->seq);
    if (p->eval_batches * p->micro > (1 << 30))
        return nl_error_set(err, NL_ERR_RANGE, "%s x %s: more than 2^30",
                            name(a, sizeof a, pre, "eval_batches"),
                            name(b, sizeof b, pre, "microbatches"));
    if (p->eval_every > 0 && p->holdout <= 0.0)
        return nl_error_set(err, NL_ERR_RANGE, "%s needs held-out data (%s > 0)",
                            name(a, sizeof a, pre, "eval_every"),
                            name(b, sizeof b, pre, "holdout"));
    return NL_OK;
}

/* The rules across a request's keys. */
static nl_status check_request(nl_trainparams *p, int ft, nl_error *err)
{
    nl_status st = nl_trainparams_check_batch(p, "params.", err);
    if (st != NL_OK)
        return nl_error_prefix(err, "JOB_SUBMIT");
    if (p->objective == NL_OBJ_CLASSIFY && p->learn_vocab > 0)
        return nl_error_set(err, NL_ERR_RANGE,
                            "JOB_SUBMIT params.learn_vocab: not with objective classify (the "
                            "vocabulary learns from text)");
    if (p->objective == NL_OBJ_CLASSIFY && p->pack)
        return nl_error_set(err, NL_ERR_RANGE,
                            "JOB_SUBMIT params.pack: not with objective classify (each example "
                            "is a row of its own)");
    if (ft && p->resume)
        return nl_error_set(err, NL_ERR_RANGE,
                            "JOB_SUBMIT params.resume: a fine-tuning job starts its adapters "
                            "afresh");
    if (ft && p->learn_vocab > 0)
        return nl_error_set(err, NL_ERR_RANGE,
                            "JOB_SUBMIT params.learn_vocab: a fine-tuning job keeps the base as "
                            "it is");
    return NL_OK;
}

nl_status nl_trainparams_parse(nl_trainparams *p, const nl_wire_param *params, uint32_t n,
                               nl_trainparams_use use, nl_error *err)
{
    const int ft = use == NL_TRAINPARAMS_FINETUNE || use == NL_TRAINPARAMS_STAGE_FT;
    const int stage = use == NL_TRAINPARAMS_STAGE || use == NL_TRAINPARAMS_STAGE_FT;
    nl_trainparams_defaults(p);
    nl_status st = nl_params_read(p, keys, NKEYS, use, params, n, ft ? "finetune" : "train", err);
    if (st == NL_OK && ft && nl_lora_parse_targets(p->lora_targets, &p->lora_bits, err) != NL_OK)
        st = nl_error_prefix(err, "JOB_SUBMIT params.lora_targets");
    if (st != NL_OK || !stage)
        return st != NL_OK ? st : check_request(p, ft, err);
    if (p->micro_batch * p->seq > NL_TRAIN_MICRO_ROWS_MAX)
        return nl_error_set(err, NL_ERR_RANGE,
                            "JOB_SUBMIT params.micro_batch: a microbatch of %lld x %lld is more "
                            "than 2^24 rows",
                            (long long)p->micro_batch, (long long)p->seq);
    if (ft && p->moments)
        return nl_error_set(err, NL_ERR_INVALID,
                            "JOB_SUBMIT params.moments: a fine-tuning job's adapters start fresh "
                            "(no moments)");
    return NL_OK;
}

uint32_t nl_trainparams_wire(const nl_trainparams *p, nl_trainparams_use use, nl_wire_param *out)
{
    nl_trainparams d;
    nl_trainparams_defaults(&d);
    return nl_params_write(p, &d, keys, NKEYS, use, out);
}

nl_status nl_trainparams_range(const char *key, double *lo, double *hi)
{
    for (size_t i = 0; i < NKEYS; i++)
        if (strcmp(keys[i].name, key) == 0) {
            *lo = keys[i].lo;
            *hi = keys[i].hi;
            return NL_OK;
        }
    return NL_ERR_NOTFOUND;
}
