/* Test helper: cut a checkpoint with optimizer state into stage shards and
 * write their manifest, as the stages and the coordinator of a distributed
 * run would (each shard with nl_checkpoint_save, the manifest last).
 *
 *   make_shards MODEL.safetensors OUTDIR B1,B2,...
 *
 * splits the layers at the boundaries B1 < B2 < ... into stage-<i>.safetensors
 * files and OUTDIR/manifest.json. Used by tests/test_cli_local.sh. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/checkpoint.h"
#include "core/formats/manifest.h"

#define MAX_STAGES 64

static int fail(const nl_error *err)
{
    fprintf(stderr, "make_shards: %s (%s)\n", err->msg, nl_status_str(err->status));
    return 1;
}

/* Stage i's shard: its tensors and moments, no tokenizer or seed.
 * *adam gets the source's optimizer step count. */
static nl_status write_shard(nl_backend *be, const char *src, nl_manifest_shard *s,
                             const char *train, int64_t *adam, nl_error *err)
{
    nl_model *m = NULL;
    float *mm = NULL, *vv = NULL;
    int64_t step = 0;
    nl_status st =
        nl_checkpoint_load(&m, be, src, s->l0, s->l1, s->has_embed, s->has_head, &step, err);
    if (st != NL_OK)
        return st;
    mm = be->alloc(be, m->n_params * sizeof(float) + 1);
    vv = be->alloc(be, m->n_params * sizeof(float) + 1);
    if (!mm || !vv)
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if (st == NL_OK)
        st = nl_checkpoint_load_optim(m, src, mm, vv, adam, NULL, err);
    nl_ckpt_extra extra = {.m = mm, .v = vv, .adam_steps = *adam, .train_json = train};
    if (st == NL_OK)
        st = nl_checkpoint_save(m, s->path, step, &extra, err);
    if (st == NL_OK)
        st = nl_file_sha256(s->path, s->sha256, &s->bytes, err);
    be->free(be, mm);
    be->free(be, vv);
    nl_model_destroy(&m);
    return st;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: make_shards MODEL.safetensors OUTDIR B1,B2,...\n");
        return 2;
    }
    const char *src = argv[1], *dir = argv[2];
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_manifest mf = {0};
    nl_manifest_shard sh[MAX_STAGES] = {{0}};
    char files[MAX_STAGES][32], paths[MAX_STAGES][512], manifest[512];
    int cuts[MAX_STAGES + 1], n = 1, rc = 1;
    char *train = NULL, *tok = NULL, *seed = NULL;
    cuts[0] = 0;
    for (const char *p = argv[3]; *p && n < MAX_STAGES; n++) {
        cuts[n] = (int)strtol(p, (char **)&p, 10);
        p += *p == ',';
    }
    if (nl_checkpoint_read_config(src, &mf.cfg, &mf.step, &err) != NL_OK ||
        nl_checkpoint_meta(src, "train", &train, &err) != NL_OK ||
        nl_checkpoint_meta(src, "tokenizer", &tok, &err) != NL_OK ||
        nl_checkpoint_meta(src, "init_seed", &seed, &err) != NL_OK ||
        nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = 1}, &err) != NL_OK)
        goto out;
    cuts[n] = mf.cfg.num_layers;
    mf.train_json = train;
    mf.tokenizer = tok;
    mf.init_seed = seed;
    mf.n_shards = n;
    mf.shards = sh;
    for (int i = 0; i < n; i++) {
        snprintf(files[i], sizeof files[i], "stage-%d.safetensors", i);
        snprintf(paths[i], sizeof paths[i], "%s/%s", dir, files[i]);
        sh[i] = (nl_manifest_shard){.stage = i,
                                    .l0 = cuts[i],
                                    .l1 = cuts[i + 1],
                                    .has_embed = i == 0,
                                    .has_head = i == n - 1,
                                    .file = files[i],
                                    .path = paths[i],
                                    .node = "make_shards"};
        if (write_shard(be, src, &sh[i], train, &mf.adam_steps, &err) != NL_OK)
            goto out;
    }
    snprintf(manifest, sizeof manifest, "%s/%s", dir, NL_MANIFEST_FILE);
    if (nl_manifest_write(manifest, &mf, &err) != NL_OK)
        goto out;
    printf("%s: %d shards\n", manifest, n);
    rc = 0;
out:
    free(train);
    free(tok);
    free(seed);
    nl_backend_destroy(&be);
    return rc ? fail(&err) : 0;
}
