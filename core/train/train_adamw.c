/* AdamW for the stage trainer (parameters created by growth count their
 * bias correction from their birth: docs/training.md), the learning-rate
 * schedule, and the decision a step takes from its loss and gradient norm.
 * Split from train.c, which owns the passes, behind train_impl.h. */
#include "core/train/train_impl.h"

#include "core/model/lora.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

nl_adamw_opts nl_adamw_defaults(void)
{
    nl_adamw_opts o = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
    return o;
}

double nl_lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_lr)
{
    if (warmup > 0 && step < warmup)
        return lr * (double)(step + 1) / (double)warmup;
    if (total - warmup <= 1)
        return lr;
    double progress = (double)(step - warmup) / (double)(total - warmup - 1);
    if (progress > 1.0)
        progress = 1.0;
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + cos(M_PI * progress));
}

/* The regions the model's growth history created in its parameters (only
 * those born after step 0: earlier ones count from step 1 like the rest),
 * and the scratch their update needs. */
nl_status nl_trainer_born_regions(nl_trainer *t, nl_error *err)
{
    const nl_model *m = t->m;
    for (int pass = 0; pass < 2; pass++) { /* count, then fill */
        t->n_born = 0;
        for (int i = 0; i < m->n_table; i++) {
            const nl_param *p = &m->table[i];
            const int64_t R = p->shape[0], C = p->ndim == 2 ? p->shape[1] : 1;
            for (int h = 0; h < m->n_growth; h++) {
                nl_grow_rect r[2];
                const int n =
                    m->growth[h].adam_steps > 0 ? nl_growth_regions(&m->growth[h], p->name, r) : 0;
                for (int k = 0; k < n; k++) {
                    if (r[k].r1 > R || r[k].c1 > C || r[k].r0 >= r[k].r1 || r[k].c0 >= r[k].c1)
                        continue; /* not this tensor's shape: history of another config */
                    if (pass)
                        t->born[t->n_born] = (born_region){i, r[k], m->growth[h].adam_steps};
                    t->n_born++;
                }
            }
        }
        if (pass || t->n_born == 0)
            break;
        if (!(t->born = calloc((size_t)t->n_born, sizeof *t->born)) ||
            !(t->born_buf = t->be->alloc(t->be, 4 * BORN_CHUNK * sizeof(float))))
            return nl_error_set(err, NL_ERR_NOMEM, "trainer: out of memory for growth regions");
    }
    return NL_OK;
}

static void born_bc(nl_adamw_opts o, int64_t t, int64_t born, float *bc1, float *bc2)
{
    const double k = (double)(t - born > 0 ? t - born : 1);
    *bc1 = (float)(1.0 - pow(o.beta1, k));
    *bc2 = (float)(1.0 - pow(o.beta2, k));
}

/* One AdamW step of parameter p whose regions b[0..n) (some may have the
 * global corrections by now) count from their birth. Band by band: the
 * regions' parts gathered, the whole band stepped with the global
 * corrections, the gathered copies with their own, then scattered back.
 * Each element's update is elementwise, so the old elements get exactly
 * the bits one call over the tensor gives. */
static void step_born(nl_trainer *t, const nl_param *p, const born_region *b, int n, float lr,
                      float grad_scale, nl_adamw_opts o, float wd, float bc1, float bc2)
{
    nl_backend *be = t->be;
    const int64_t R = p->shape[0], C = p->ndim == 2 ? p->shape[1] : 1;
    const int64_t band = (int64_t)BORN_CHUNK / C > 0 ? (int64_t)BORN_CHUNK / C : 1;
    float *base[4] = {t->m->params + p->offset, t->grads + p->offset, t->mom[0] + p->offset,
                      t->mom[1] + p->offset};
    float *buf[4];
    for (int j = 0; j < 4; j++)
        buf[j] = t->born_buf + (size_t)j * BORN_CHUNK;
    for (int64_t r = 0; r < R; r += band) {
        const int64_t r_end = r + band < R ? r + band : R;
        size_t off = 0;
        for (int i = 0; i < n; i++) { /* gather */
            const int64_t a = b[i].r.r0 > r ? b[i].r.r0 : r,
                          z = b[i].r.r1 < r_end ? b[i].r.r1 : r_end;
            const int64_t w = b[i].r.c1 - b[i].r.c0;
            if (a >= z)
                continue;
            for (int j = 0; j < 4; j++)
                be->copy_rows(be, buf[j] + off, (int)w, base[j] + a * C + b[i].r.c0, (int)C,
                              (int)(z - a), (int)w);
            off += (size_t)((z - a) * w);
        }
        be->adamw(be, base[0] + r * C, base[1] + r * C, base[2] + r * C, base[3] + r * C,
                  (size_t)((r_end - r) * C), lr, o.beta1, o.beta2, o.eps, wd, bc1, bc2, grad_scale);
        off = 0;
        for (int i = 0; i < n; i++) { /* the regions' own step, scattered back */
            const int64_t a = b[i].r.r0 > r ? b[i].r.r0 : r,
                          z = b[i].r.r1 < r_end ? b[i].r.r1 : r_end;
            const int64_t w = b[i].r.c1 - b[i].r.c0;
            if (a >= z)
                continue;
            float rb1, rb2;
            born_bc(o, t->adam_t, b[i].born, &rb1, &rb2);
            const size_t cnt = (size_t)((z - a) * w);
            be->adamw(be, buf[0] + off, buf[1] + off, buf[2] + off, buf[3] + off, cnt, lr, o.beta1,
                      o.beta2, o.eps, wd, rb1, rb2, grad_scale);
            for (int j = 0; j < 4; j++)
                if (j != 1) /* the gradient is read, not written */
                    be->copy_rows(be, base[j] + a * C + b[i].r.c0, (int)C, buf[j] + off, (int)w,
                                  (int)(z - a), (int)w);
            off += cnt;
        }
    }
}

void nl_trainer_step(nl_trainer *t, float lr, float grad_scale, nl_adamw_opts o)
{
    nl_model *m = t->m;
    t->adam_t++;
    const float bc1 = (float)(1.0 - pow(o.beta1, (double)t->adam_t));
    const float bc2 = (float)(1.0 - pow(o.beta2, (double)t->adam_t));
    if (m->lora) { /* the base is frozen: step the adapters only, no decay */
        const nl_lora *lo = m->lora;
        t->be->adamw(t->be, lo->params, lo->grads, lo->mom[0], lo->mom[1], lo->n_params, lr,
                     o.beta1, o.beta2, o.eps, 0.0f, bc1, bc2, grad_scale);
        return;
    }
    int b = 0; /* t->born is in parameter order */
    for (int i = 0; i < m->n_table; i++) {
        const nl_param *p = &m->table[i];
        const float wd = p->kind == NL_PARAM_NORM ? 0.0f : o.weight_decay;
        int n = 0, live = 0;
        while (b + n < t->n_born && t->born[b + n].param == i) {
            float rb1, rb2; /* a region whose corrections have caught up is like the rest */
            born_bc(o, t->adam_t, t->born[b + n].born, &rb1, &rb2);
            live |= rb1 != bc1 || rb2 != bc2;
            n++;
        }
        if (live)
            step_born(t, p, t->born + b, n, lr, grad_scale, o, wd, bc1, bc2);
        else
            t->be->adamw(t->be, m->params + p->offset, t->grads + p->offset, t->mom[0] + p->offset,
                         t->mom[1] + p->offset, nl_param_numel(p), lr, o.beta1, o.beta2, o.eps, wd,
                         bc1, bc2, grad_scale);
        b += n;
    }
}

float *nl_trainer_moment(const nl_trainer *t, int which)
{
    return t->mom[which ? 1 : 0];
}

int64_t nl_trainer_adam_steps(const nl_trainer *t)
{
    return t->adam_t;
}
void nl_trainer_set_adam_steps(nl_trainer *t, int64_t steps)
{
    t->adam_t = steps;
}

double nl_step_decide(nl_step_result *r, double ce_sum, double rows, double aux,
                      double aux_loss_coef, double grad_sumsq, double clip_norm)
{
    memset(r, 0, sizeof *r);
    r->ce_loss = ce_sum / rows;
    r->aux_loss = aux;
    r->loss = r->ce_loss + aux_loss_coef * aux;
    r->grad_norm = sqrt(grad_sumsq);
    r->skipped = !isfinite(r->loss) || !isfinite(grad_sumsq);
    return r->skipped ? 0.0 : nl_step_clip(r->grad_norm, clip_norm);
}

double nl_step_clip(double grad_norm, double clip_norm)
{
    /* as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), at most 1 */
    const double clip = clip_norm / (grad_norm + 1e-6);
    return clip < 1.0 ? clip : 1.0;
}

void nl_diloco_outer(float *w, float *anchor, float *m, const float *delta_sum, size_t n,
                     int groups, float lr, float mu)
{
    const float g = (float)groups;
    for (size_t i = 0; i < n; i++) {
        const float delta = delta_sum[i] / g;
        m[i] = mu * m[i] + delta;
        w[i] = anchor[i] - lr * (delta + mu * m[i]);
        anchor[i] = w[i];
    }
}
