/* Private to core/train/train*.c: the trainer's state, shared by train.c (the
 * slots, the forward and the backward passes) and train_adamw.c (AdamW, the
 * learning-rate schedule and the step's decision). */
#ifndef NL_CORE_TRAIN_IMPL_H
#define NL_CORE_TRAIN_IMPL_H

#include "core/train/train.h"

#include "core/grow/grow.h"

typedef struct train_slot {
    int B, T;
    nl_layer_acts *acts; /* n_layers sets (no recompute) */
    float **x_in;        /* n_layers saved inputs (recompute) */
    float *x_final;      /* (N, d) stage output (owned only with recompute) */
    int32_t *tokens_d;   /* (N) */
    float *xnf, *rstdf;  /* head: (N, d), (N) */
    float *logits;       /* head: (N, V), the loss gradient after the forward */
    int32_t *doc_h;      /* (N) host: the documents of its packed rows */
    int has_doc;         /* doc_h holds this microbatch's documents */
    /* classification (num_classes > 0, nl_trainer_set_labels) */
    int classify;       /* this microbatch trains the classifier */
    int32_t *lengths_h; /* (B) host: valid positions of each sequence */
    float *pooled;      /* (B, d) mean of the valid final-normed states */
    float *clogits;     /* (B, K) class logits, then their gradient */
    int32_t *labels_d;  /* (B) */
} train_slot;

/* Part of parameter `param` that a growth created when `born` AdamW steps
 * had been taken (rows x columns of the tensor; a 1-D one is a column). */
typedef struct born_region {
    int param;
    nl_grow_rect r;
    int64_t born;
} born_region;

/* Floats of one band of a parameter stepped at a time around its regions. */
#define BORN_CHUNK ((size_t)1 << 20)

struct nl_trainer {
    nl_model *m;
    nl_backend *be;
    int max_rows, n_slots, recompute, n_layers;
    /* the base is frozen (adapters attached at nl_trainer_new): its weight
     * gradients are not computed (nl_trainer_keep_frozen_grads clears it) */
    int frozen;
    float *grads, *mom[2];
    int64_t adam_t, batch_rows;
    int64_t loss_rows; /* predictions the mean cross-entropy is over */
    int32_t *doc_h;    /* (N) host: documents for the next passes (nl_trainer_set_docs) */
    int has_doc;
    int32_t *doc_d;                /* (N) device: the documents of the pass running */
    int32_t *labels_h, *lengths_h; /* (max_rows) host: classification of the next forward */
    int has_labels;
    float *dpooled; /* (max_rows, d) */
    train_slot *slots;
    nl_layer_acts work; /* recompute and counting passes */
    nl_layer_grads_scratch sc;
    float *dbuf[2]; /* (N, d) ping-pong input gradients */
    const float *input_grad;
    int32_t *pos_h, *pos_d, *neg_pos_h;
    int32_t *targets_h, *targets_d;
    float *losses_d, *losses_h;
    int64_t *counts;      /* (n_layers, E) counting pass, host copy */
    float *global_frac;   /* (n_layers, E) host */
    int64_t *counts_d;    /* (n_layers, E) counting pass, accumulated on the device */
    float *global_frac_d; /* (n_layers, E) */
    double *aux_d;        /* (1) one forward's aux loss */
    int use_global;
    int inject_nan;
    /* AdamW after growth: the regions growth created, by parameter, each
     * with the AdamW step it was born at (docs/training.md) */
    born_region *born;
    int n_born;
    float *born_buf; /* 4 x BORN_CHUNK floats: a band's regions gathered */
};

/* The regions the model's growth history created in its parameters and
 * the scratch their update needs (train_adamw.c); nl_trainer_destroy frees
 * them. */
nl_status nl_trainer_born_regions(nl_trainer *t, nl_error *err);

#endif
