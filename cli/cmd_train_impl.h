/* Private to cli/cmd_train*.c: local training's options and the helpers
 * that language-model training (cmd_train.c, which owns them and the
 * command line) and classifier training (cmd_train_classify.c) share. */
#ifndef NL_CLI_CMD_TRAIN_IMPL_H
#define NL_CLI_CMD_TRAIN_IMPL_H

#include <stdint.h>

#include "cli/train_report.h"
#include "core/data/data.h"
#include "core/formats/fileio.h"
#include "core/model/lora.h"
#include "core/train/train.h"

typedef struct train_opts {
    const char *model, *data, *log, *out, *resume, *ckpt_dir;
    nl_train_run r; /* the flags local and cluster training share */
    long long threads;
    const char *device;
    int tf32;              /* --tf32: the device's GEMMs may use TF32 */
    int bf16;              /* --precision bf16: GEMMs in bf16 */
    const char *objective; /* --objective: clm, mlm or classify; NULL: the config's */
    /* neuroctl finetune: LoRA adapters on the frozen model (rank 0: train it all) */
    long long lora_rank;
    double lora_alpha;
    int lora_targets;
    /* --groups R --outer-every H: DiLoCo across R replica groups in this
     * process (cmd_train_groups.c); 0: one trainer */
    long long groups, outer_every;
    double outer_lr, outer_mu;
} train_opts;

/* Metadata a run carries from its starting checkpoint into every one it writes. */
typedef struct carried_meta {
    char *tokenizer, *init_seed;
} carried_meta;

/* The run's locks (core/formats/fileio.h) on what it writes: --out, --log and the
 * checkpoint directory (taken when the run first needs it), held until it
 * ends, so that a second run given the same paths at the same time is
 * refused, with the first one's pid, instead of writing over it (the
 * "exists, give --force" check at the start cannot see a file that is not
 * written yet). --force replaces a file, never a live run's. */
typedef struct run_locks {
    nl_file_lock *dir, *out, *log;
} run_locks;

/* finetune: attach fresh adapters (A drawn from the run's seed) to m. */
nl_status nl_local_attach_lora(nl_lora **lo, nl_model *m, const train_opts *o, int rows,
                               nl_error *err);
/* finetune's output: the adapter file, with the base checkpoint's SHA-256. */
nl_status nl_local_save_adapter(const nl_lora *lo, const train_opts *o, nl_error *err);
/* Which objective a run trains (core/train/objective.h): --objective, else the
 * config's, checked against the model. */
nl_status nl_local_objective(const train_opts *o, const nl_config *c, int *obj, nl_error *err);
/* A checkpoint of step `step` in path (with the moments and the carried
 * metadata), written with SIGINT held off. */
nl_status nl_local_save(nl_model *m, nl_trainer *tr, const train_opts *o, const carried_meta *cm,
                        const char *path, int64_t step, nl_error *err);
/* The checkpoint path of step `step` in --checkpoint-dir. */
void nl_local_step_path(char *buf, size_t cap, const train_opts *o, int64_t step);
/* The checkpoint directory, made and locked (once). */
nl_status nl_local_ckpt_dir(const train_opts *o, run_locks *lk, nl_error *err);
/* The run's locks taken (--out, --log, and the checkpoint directory when
 * the run writes there); nl_local_unlock releases them. */
nl_status nl_local_lock(const train_opts *o, run_locks *lk, nl_error *err);
void nl_local_unlock(run_locks *lk);
/* A local step's progress record (local and classify training alike). */
nl_train_step nl_local_step_record(const train_opts *o, const nl_step_result *r, int64_t step,
                                   int64_t start, double lr, double tokens_per_s, double t_begin,
                                   const char *device);

/* Mean cross-entropy over --eval-batches held-out batches of the model
 * tr trains (over the targets that count; doc: packed rows' documents, or
 * NULL), into *loss; the buffers hold a batch (B, T). */
nl_status nl_local_eval_loss(nl_trainer *tr, const nl_dataset *ds, const train_opts *o, int obj,
                             const nl_config *c, int32_t *tokens, int32_t *targets, int32_t *doc,
                             double *loss, nl_error *err);

/* neuroctl train --groups R --outer-every H (cmd_train_groups.c): DiLoCo
 * across R replica groups in this process; returns the exit code. */
int nl_local_groups(const train_opts *o);

/* neuroctl train --objective classify (cmd_train_classify.c): the run;
 * returns the exit code. */
int nl_local_classify(const train_opts *o);

#endif
