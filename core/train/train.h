/* Training one stage: forward passes that keep what the backward needs,
 * the backward pass of the stage's layers (and of the embedding and the
 * head where it holds them), gradient accumulation over microbatches,
 * global-norm clipping inputs, and AdamW with its moments.
 *
 * The same object serves a whole model in one process (neuroctl train)
 * and one pipeline stage: a stage takes the gradient of its output and
 * hands back the gradient of its input.
 *
 * The loss of a step is DESIGN.md section 2's over the whole batch:
 * mean cross-entropy over its B*T rows (those whose target is not
 * ignored, section 6) plus aux_loss_coef times the
 * summed load-balancing losses, whose assignment shares frac_e are the
 * batch's. With several microbatches those shares come from a counting
 * pass (nl_trainer_count_routes) so the result does not depend on how the
 * batch is split.
 *
 * Ownership: nl_trainer_new borrows the model (which must outlive it);
 * nl_trainer_destroy(&t) frees the trainer only. */
#ifndef NL_TRAIN_H
#define NL_TRAIN_H

#include <stdint.h>

#include "core/model/layer.h"
#include "core/model/model.h"

typedef struct nl_trainer nl_trainer;

typedef struct nl_adamw_opts {
    float beta1, beta2, eps, weight_decay;
} nl_adamw_opts;

/* DESIGN.md section 2: beta1 0.9, beta2 0.95, eps 1e-8, decay 0.1. */
nl_adamw_opts nl_adamw_defaults(void);

/* Learning rate at `step` (0-based) of `total`: linear warm-up over
 * `warmup` steps to lr, then cosine decay to min_lr at the last step. */
double nl_lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_lr);

/* max_rows: rows (B*T) of the largest microbatch; slots: microbatches in
 * flight at once (1 in one process, up to the stages downstream in 1F1B);
 * recompute: keep only each layer's input and recompute the rest in the
 * backward pass.
 * A model with adapters attached (m->lora: `neuroctl finetune`, a stage's
 * finetune job) has a frozen base: the trainer keeps no moments for it,
 * steps the adapters only, and its backward skips the base's weight
 * gradients (every matrix's dW = dY^T X: attention, router, experts, the
 * head's and the embedding's), computing only the input gradients and
 * the adapters' (and the trained classifier's); the base's slices of
 * nl_trainer_grads stay zero but for the RMSNorm gains, whose gradients
 * the norms' backward makes as it goes (O(N d)). */
nl_status nl_trainer_new(nl_trainer **out, nl_model *m, int max_rows, int slots, int recompute,
                         nl_error *err);
void nl_trainer_destroy(nl_trainer **t);

/* Start a step over a batch of batch_rows rows: zero the gradients (with
 * a frozen base, the adapters' and the RMSNorm gains': no other base
 * gradient is written) and the route counts. */
void nl_trainer_begin_step(nl_trainer *t, int64_t batch_rows);

/* The number of predictions the step's mean cross-entropy is over: the
 * batch's targets that are not ignored (targets below 0 are, DESIGN 6).
 * nl_trainer_begin_step sets it to batch_rows. */
void nl_trainer_set_loss_rows(nl_trainer *t, int64_t rows);

/* Packed rows (DESIGN 6): document ids (host, `rows` = B*T of the next
 * passes) for the following count_routes and forward calls, until set
 * again; NULL: one document per sequence. Attention stays inside a
 * document and positions restart at 0 for each; a forward keeps its
 * slot's documents for its backward. */
nl_status nl_trainer_set_docs(nl_trainer *t, const int32_t *doc, int rows, nl_error *err);

/* Classification (DESIGN 6; the last stage of a model with num_classes
 * K > 0): for the B sequences of T positions of the following forwards
 * (until set again; NULL labels: the language-model head again), their
 * classes labels[b] in [0, K) and valid lengths lengths[b] in [1, T]. The
 * head then pools the final-normed states over each sequence's valid
 * positions (their mean), applies classifier.weight and adds the
 * cross-entropy of the labels (one per sequence: set the loss rows to
 * the batch's sequences); targets may be NULL. Pad positions should be a
 * document of their own (nl_trainer_set_docs) where attention is
 * bidirectional. */
nl_status nl_trainer_set_labels(nl_trainer *t, const int32_t *labels, const int32_t *lengths, int B,
                                int T, nl_error *err);

/* Counting pass for one microbatch (forward only, nothing kept): add this
 * microbatch's expert assignments to the step's counts, which add up on
 * the device. Input as for nl_trainer_forward. After all microbatches,
 * nl_trainer_use_counts makes the following forwards use the batch's
 * shares (one download of the counts, one upload of the shares).
 * Routing never waits for the host: a forward's host synchronisations are
 * its input uploads (tokens or none, positions, targets), the aux loss's
 * one download when *aux is asked for and the losses' download; a
 * backward's are its position uploads; none depends on the layer count. */
nl_status nl_trainer_count_routes(nl_trainer *t, int B, int T, const int32_t *tokens,
                                  const float *x_in, nl_error *err);
/* counts NULL: this trainer's own counts, read from the device. Data-
 * parallel replicas of a stage, each counting its own microbatches, pass
 * the sum of theirs (n_layers x num_experts, from nl_trainer_route_counts). */
void nl_trainer_use_counts(nl_trainer *t, const int64_t *counts);
/* The step's route counts so far, read from the device into a host array
 * (n_layers x num_experts) owned by the trainer. */
int64_t *nl_trainer_route_counts(nl_trainer *t);
/* Output of the last counting pass (device, (B*T, d)) for the next stage. */
const float *nl_trainer_count_output(const nl_trainer *t);

/* Forward of one microbatch into slot `slot`. tokens (host) for a stage
 * with the embedding, else x_in (device (B*T, d)); targets (host) for a
 * stage with the head. Adds this microbatch's share to *ce_sum (sum of
 * row losses; NULL if not the last stage) and *aux (its part of the
 * batch's aux loss). */
nl_status nl_trainer_forward(nl_trainer *t, int slot, int B, int T, const int32_t *tokens,
                             const float *x_in, const int32_t *targets, double *ce_sum, double *aux,
                             nl_error *err);
/* Hidden states the forward of `slot` produced (device, (B*T, d)). */
const float *nl_trainer_output(const nl_trainer *t, int slot);

/* Backward of the microbatch in `slot`: dy is the gradient of the stage
 * output (device, (B*T, d)), or NULL for the stage with the head (which
 * starts from its loss). Accumulates parameter gradients. */
nl_status nl_trainer_backward(nl_trainer *t, int slot, const float *dy, nl_error *err);
/* Gradient of the stage input of the last backward (device, (B*T, d)). */
const float *nl_trainer_input_grad(const nl_trainer *t);

/* Sum of squares of this stage's accumulated gradients (non-finite if
 * any gradient is). */
double nl_trainer_grad_sumsq(const nl_trainer *t);

/* One AdamW step of every parameter with gradients scaled by grad_scale
 * (the clipping factor). Weight decay applies to matrices and tables,
 * not to norm gains. */
void nl_trainer_step(nl_trainer *t, float lr, float grad_scale, nl_adamw_opts o);

/* Optimizer state, for checkpoints: moments (device, n_params each; NULL
 * when the model had adapters attached at nl_trainer_new: then only
 * core/model/lora.h's block trains) and the number of AdamW steps taken. */
float *nl_trainer_moment(const nl_trainer *t, int which /* 0: m, 1: v */);
int64_t nl_trainer_adam_steps(const nl_trainer *t);
void nl_trainer_set_adam_steps(nl_trainer *t, int64_t steps);
/* Accumulated gradients (device, n_params, parameter layout; with a
 * frozen base, the RMSNorm gains' only). */
float *nl_trainer_grads(const nl_trainer *t);

/* What one optimizer step saw. */
typedef struct nl_step_result {
    double loss, ce_loss, aux_loss; /* loss = ce_loss + aux_loss_coef * aux_loss */
    double grad_norm;               /* before clipping */
    int skipped;                    /* non-finite loss or gradient: no update */
} nl_step_result;

/* The global-norm clip of every training step, local or on a cluster. */
#define NL_TRAIN_CLIP_NORM 1.0
/* A cluster training job skips a step whose gradient or loss is not
 * finite, as local training does, but fails once this many steps in a row
 * were skipped, naming the stage that reported it: a stage whose reports
 * are never finite would otherwise hold the job, skipping for ever. */
#define NL_TRAIN_MAX_SKIPS 3

/* The decision of one optimizer step from what its stages saw, one policy
 * for local and cluster training: the loss (ce_sum over `rows`
 * predictions, plus aux_loss_coef times aux), the gradient norm from its
 * sum of squares, the guard (a non-finite loss or gradient skips the step
 * on every stage) and the clipping factor, as
 * torch.nn.utils.clip_grad_norm_: min(1, clip_norm / (norm + 1e-6)).
 * Fills r; returns the factor the gradients are scaled by, 0 when the
 * step is skipped. */
double nl_step_decide(nl_step_result *r, double ce_sum, double rows, double aux,
                      double aux_loss_coef, double grad_sumsq, double clip_norm);

/* The clipping factor of a gradient of norm grad_norm, as nl_step_decide
 * takes it: min(1, clip_norm / (grad_norm + 1e-6)). DiLoCo's replica
 * groups each take it of their own norm (the coordinator's STEP to each,
 * neuroctl train --groups). */
double nl_step_clip(double grad_norm, double clip_norm);

/* DiLoCo's outer step (DESIGN section 8): the outer learning rate and
 * Nesterov momentum by default (neurocoord --outer-lr, --outer-momentum). */
#define NL_DILOCO_OUTER_LR 0.7
#define NL_DILOCO_OUTER_MOMENTUM 0.9

/* The outer step over n parameters (host): delta_sum holds the replica
 * groups' deltas (weights at the last sync minus weights now) added in
 * group order; with delta = delta_sum / groups,
 *   m = mu m + delta;  w = anchor - lr (delta + mu m);  anchor = w
 * (lr 1, mu 0: the groups' weights averaged). Every element in float, in
 * this order, so every group computes the same bits. w may alias
 * delta_sum. */
void nl_diloco_outer(float *w, float *anchor, float *m, const float *delta_sum, size_t n,
                     int groups, float lr, float mu);

/* One whole training step of a whole model in this process over a batch of
 * B sequences of T tokens (host, (B, T)) split into M microbatches: the
 * counting pass when M > 1, forward and backward of each microbatch,
 * then nl_step_decide (clipping at clip_norm, NL_TRAIN_CLIP_NORM as the
 * cluster does) and AdamW at lr, unless the loss or a gradient is not
 * finite, in which case the weights stay as they were. */
nl_status nl_trainer_step_local(nl_trainer *t, const int32_t *tokens, const int32_t *targets, int B,
                                int T, int M, float lr, float clip_norm, nl_adamw_opts o,
                                nl_step_result *res, nl_error *err);
/* nl_trainer_step_local over packed rows: doc (host, (B, T), or NULL: one
 * document per sequence) as nl_trainer_set_docs takes them, each
 * microbatch's for its counting pass, forward and backward. Leaves no
 * documents set. */
nl_status nl_trainer_step_packed(nl_trainer *t, const int32_t *tokens, const int32_t *targets,
                                 const int32_t *doc, int B, int T, int M, float lr, float clip_norm,
                                 nl_adamw_opts o, nl_step_result *res, nl_error *err);

/* The gradients of nl_trainer_step_packed without its decision and
 * update: the step begun over B x T rows, the counting pass when M > 1,
 * forward and backward of each microbatch. *ce: the sum of the row
 * losses, *aux: the aux loss, *valid: the predictions the mean is over
 * (targets not ignored), for nl_step_decide. Lets one process decide
 * from several trainers' sums before it steps each (DiLoCo's replica
 * groups, neuroctl train --groups). */
nl_status nl_trainer_grads_packed(nl_trainer *t, const int32_t *tokens, const int32_t *targets,
                                  const int32_t *doc, int B, int T, int M, double *ce, double *aux,
                                  int64_t *valid, nl_error *err);

/* nl_trainer_step_local for classification (DESIGN 6): B sequences of T
 * ids (host, (B, T)) with their valid lengths and labels (B) and the
 * documents (B, T) that keep padding apart (0 on the text, 1 on the pads,
 * as nl_labelled_batch makes them); the loss is the mean over the B
 * labels. Leaves no labels or documents set. */
nl_status nl_trainer_step_classify(nl_trainer *t, const int32_t *tokens, const int32_t *lengths,
                                   const int32_t *labels, const int32_t *doc, int B, int T, int M,
                                   float lr, float clip_norm, nl_adamw_opts o, nl_step_result *res,
                                   nl_error *err);

/* The class probabilities (host, (B, num_classes)) of the last
 * classification forward in `slot`, recovered from the loss gradient
 * the forward left in place of the logits (the labels of that forward
 * must still be set). */
nl_status nl_trainer_class_probs(const nl_trainer *t, int slot, float *probs, nl_error *err);

/* Test hook: when set, the next backward writes NaN into the gradient of
 * its first parameter (to exercise the non-finite guard). */
void nl_trainer_inject_nan(nl_trainer *t);
/* Test hook: a trainer with a frozen base computes the base's weight
 * gradients anyway, as before they were skipped (the adapters' results are
 * the same bit for bit; tests compare the two). */
void nl_trainer_keep_frozen_grads(nl_trainer *t);

#endif
