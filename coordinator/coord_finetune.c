/* The coordinator's LoRA fine-tuning job (JOB_SUBMIT kind finetune,
 * docs/cluster.md "LoRA fine-tuning"): a training job of coord_train.c
 * whose stages train adapters on their frozen weights, with any of the
 * training objectives (clm, mlm, classify: the same batches, hops and
 * evaluations). This file holds what differs: the adapters' parameters
 * (checked here, handed to every stage), and the end, where a worker
 * checks each stage's adapter shard against the hash it reported and
 * joins them into one adapter file with the tensors and metadata of a
 * local one (the last stage's shard carries classifier.weight when the
 * model has a head; format neurollm-lora/1, rank, alpha, targets, the
 * base's SHA-256). Several fine-tuning jobs may run at once on one
 * pipeline; none beside a training job. Everything else is the training
 * job's state machine (coord_train.c, which holds coord_finetune_ops
 * too), which tells a fine-tuning job by its state. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/coord_train_impl.h"
#include "core/model/lora.h"
#include "net/trainparams.h"

/* ---------------------------------------------------------------- submit */

/* The adapters' parameters by the training schema (net/trainparams.h);
 * the job's other parameters are read again by the preparation
 * (coord_train_prep.c). */
cft *coord_finetune_params(nl_coord *c, const nl_rx *rx)
{
    const nl_msg_job_submit *s = &rx->msg.u.job_submit;
    nl_trainparams p;
    nl_error e = {0};
    char why[600];
    if (nl_trainparams_parse(&p, s->params, s->nparams, NL_TRAINPARAMS_FINETUNE, &e) != NL_OK) {
        snprintf(why, sizeof why, "finetune: %s", e.msg);
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, why, NULL);
        return NULL;
    }
    cft *ft = calloc(1, sizeof *ft);
    if (!ft) {
        coord_status_to(c, rx->rid, rx->rid_len, 0, NL_JOB_FAILED, 0.0, "out of memory", NULL);
        return NULL;
    }
    ft->rank = p.lora_rank;
    ft->alpha = p.lora_alpha;
    snprintf(ft->targets, sizeof ft->targets, "%s", p.lora_targets);
    if (!c->src_manifest) /* a checkpoint file: its hash names the base in the adapter file */
        snprintf(ft->base, sizeof ft->base, "%s", c->src_path);
    return ft;
}

int coord_finetune_stage_params(const cft *ft, int64_t seed, nl_wire_param *ps)
{
    ps[0] = (nl_wire_param){.key = "lora_rank", .kind = NL_WIRE_PARAM_INT, .i = ft->rank};
    ps[1] = (nl_wire_param){.key = "lora_alpha", .kind = NL_WIRE_PARAM_FLOAT, .f = ft->alpha};
    ps[2] = (nl_wire_param){.key = "lora_targets", .kind = NL_WIRE_PARAM_STR, .s = ft->targets};
    /* A is drawn per tensor from (seed, name), as local fine-tuning draws it */
    ps[3] = (nl_wire_param){.key = "lora_seed", .kind = NL_WIRE_PARAM_INT, .i = seed};
    return COORD_FT_PARAMS;
}

/* ---------------------------------------------------------------- the adapter file */

typedef struct gather_task {
    cwork w;
    cft ft;
    int n;
    char (*path)[1200]; /* n shards */
    char (*sha)[65];    /* as each stage reported it */
    char out[1200];
    nl_status st;
    nl_error err;
} gather_task;

static void gather_run(cwork *w)
{
    gather_task *g = (gather_task *)w;
    nl_st_file **f = calloc((size_t)g->n, sizeof *f);
    nl_st_writer *wr = nl_st_writer_new();
    char hex[65], num[64];
    uint64_t bytes = 0;
    nl_status st = f && wr ? NL_OK : nl_error_set(&g->err, NL_ERR_NOMEM, "out of memory");
    for (int i = 0; st == NL_OK && i < g->n; i++) {
        /* the bytes joined are the bytes the stage vouched for */
        if ((st = nl_file_sha256(g->path[i], hex, &bytes, &g->err)) != NL_OK ||
            (st = nl_st_open(&f[i], g->path[i], &g->err)) != NL_OK)
            break;
        const char *fmt = nl_st_metadata(f[i], "format");
        if (strcmp(hex, g->sha[i]) != 0 || !fmt || strcmp(fmt, "neurollm-lora/1") != 0) {
            st = nl_error_set(
                &g->err, strcmp(hex, g->sha[i]) != 0 ? NL_ERR_INTEGRITY : NL_ERR_FORMAT, "%s: %s",
                g->path[i],
                strcmp(hex, g->sha[i]) != 0 ? "its SHA-256 is not the one its stage reported"
                                            : "not an adapter shard (format neurollm-lora/1)");
            break;
        }
        for (size_t k = 0; st == NL_OK && k < nl_st_count(f[i]); k++) {
            const nl_st_entry *e = nl_st_entry_at(f[i], k);
            st = nl_st_writer_add(wr, e->name, e->dtype, e->ndim, e->shape,
                                  nl_st_tensor_data(f[i], e), &g->err);
        }
    }
    if (st == NL_OK)
        st = nl_st_writer_set_meta(wr, "format", "neurollm-lora/1", &g->err);
    snprintf(num, sizeof num, "%lld", (long long)g->ft.rank);
    if (st == NL_OK)
        st = nl_st_writer_set_meta(wr, "rank", num, &g->err);
    snprintf(num, sizeof num, "%.9g", (double)(float)g->ft.alpha); /* as the stages hold it */
    if (st == NL_OK)
        st = nl_st_writer_set_meta(wr, "alpha", num, &g->err);
    if (st == NL_OK)
        st = nl_st_writer_set_meta(wr, "targets", g->ft.targets, &g->err);
    if (st == NL_OK && g->ft.base[0] && nl_file_sha256(g->ft.base, hex, &bytes, &g->err) == NL_OK)
        st = nl_st_writer_set_meta(wr, "base_sha256", hex, &g->err);
    if (st == NL_OK)
        st = nl_st_writer_write(wr, g->out, &g->err);
    nl_st_writer_destroy(&wr);
    for (int i = 0; f && i < g->n; i++)
        nl_st_close(&f[i]);
    free(f);
    g->st = st;
}

void coord_finetune_result(cwork *w, tr_in *in)
{
    gather_task *g = (gather_task *)w;
    *in = (tr_in){.why = g->st == NL_OK ? NULL : g->err.msg, .path = g->out};
}

static void gather_free(cwork *w)
{
    gather_task *g = (gather_task *)w;
    free(g->path);
    free(g->sha);
    free(g);
}

nl_status coord_finetune_gather(nl_coord *c, uint64_t job, const cft *ft,
                                const nl_manifest_shard *sh, int n, const char *dir, tr_done done,
                                nl_error *err)
{
    gather_task *g = calloc(1, sizeof *g);
    if (g) {
        g->path = calloc((size_t)n, sizeof *g->path);
        g->sha = calloc((size_t)n, sizeof *g->sha);
    }
    if (!g || !g->path || !g->sha) {
        if (g)
            gather_free(&g->w);
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    }
    g->w = (cwork){.run = gather_run, .done = done, .free = gather_free, .job_id = job};
    g->ft = *ft;
    g->n = n;
    for (int i = 0; i < n; i++) {
        snprintf(g->path[i], sizeof g->path[i], "%s", sh[i].path);
        snprintf(g->sha[i], sizeof g->sha[i], "%s", sh[i].sha256);
    }
    snprintf(g->out, sizeof g->out, "%s/adapter.safetensors", dir);
    return coord_work_start(c, &g->w, err);
}
