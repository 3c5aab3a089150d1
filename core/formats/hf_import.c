/* Hugging Face import (core/formats/hf.h): a MixtralForCausalLM, LlamaForCausalLM
 * or MistralForCausalLM directory (config.json, safetensors weights, one
 * file or sharded with model.safetensors.index.json) into one of our
 * checkpoints. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/formats/hf_impl.h"
#include "core/tokenizer/chat_template.h"

#define FAIL HF_FAIL

static int plain_name(const char *s)
{
    return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0 &&
           strlen(s) < 256;
}

/* Open the weights: model.safetensors.index.json (each shard it names,
 * each tensor in the shard it says), else model.safetensors. */
static nl_status open_hf_weights(hf_conv *c, const char *dir, nl_error *err)
{
    char *ipath = hf_join(dir, "model.safetensors.index.json"), *text = NULL;
    json_t *root = NULL;
    nl_status st = NL_OK;
    size_t len;
    struct stat sb;
    if (!ipath)
        FAIL(NL_ERR_NOMEM, "out of memory");
    if (stat(ipath, &sb) != 0) {
        char *single = hf_join(dir, "model.safetensors");
        st = single ? hf_src_add(&c->src, single, err) : NL_ERR_NOMEM;
        if (st == NL_ERR_NOTFOUND)
            nl_error_set(err, st,
                         "%s: neither model.safetensors nor model.safetensors.index.json "
                         "(only safetensors weights are read)",
                         dir);
        free(single);
        free(ipath);
        return st;
    }
    if ((st = nl_file_read_all(ipath, NL_HF_MAX_JSON, &text, &len, err)))
        goto out;
    json_error_t je;
    root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    json_t *map = root ? json_object_get(root, "weight_map") : NULL;
    if (!json_is_object(map)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: weight_map: missing or not an object", ipath);
        goto out;
    }
    const char *name;
    json_t *v;
    json_object_foreach(map, name, v)
    {
        const char *file = json_string_value(v);
        if (!file || !plain_name(file)) {
            st = nl_error_set(err, NL_ERR_FORMAT,
                              "%s: weight_map['%.80s']: not a plain file name in the directory",
                              ipath, name);
            goto out;
        }
        int fi = -1;
        for (int i = 0; i < c->src.n && fi < 0; i++)
            if (strcmp(strrchr(c->src.f[i].path, '/') + 1, file) == 0)
                fi = i;
        if (fi < 0) {
            char *p = hf_join(dir, file);
            st = p ? hf_src_add(&c->src, p, err) : NL_ERR_NOMEM;
            free(p);
            if (st) {
                nl_error_prefix(err, "shard listed in %s for '%.80s'", ipath, name);
                goto out;
            }
            fi = c->src.n - 1;
        }
        if (!nl_st_header_find(c->src.f[fi].h, name)) {
            st = nl_error_set(err, NL_ERR_NOTFOUND,
                              "%s: weight_map says %s holds tensor '%.80s'; it does not", ipath,
                              file, name);
            goto out;
        }
    }
out:
    json_decref(root);
    free(text);
    free(ipath);
    return st;
}

/* Every tensor of the source must be one the model uses: a bias or a
 * tensor past the config's sizes means the config lies or the model is
 * not one we represent. */
static nl_status check_unused(hf_conv *c, int tied, nl_error *err)
{
    for (int fi = 0; fi < c->src.n; fi++)
        for (size_t i = 0; i < nl_st_header_count(c->src.f[fi].h); i++) {
            const char *name = nl_st_header_entry(c->src.f[fi].h, i)->name;
            int used = tied && strcmp(name, "lm_head.weight") == 0;
            for (int j = 0; j < c->n_jobs && !used; j++)
                used = strcmp(c->jobs[j].hf, name) == 0;
            size_t n = strlen(name);
            if (used || (n > 9 && strcmp(name + n - 9, ".inv_freq") == 0))
                continue;
            if (n > 5 && strcmp(name + n - 5, ".bias") == 0)
                FAIL(NL_ERR_UNSUPPORTED, "%s: tensor '%.80s': biases are not supported",
                     c->src.f[fi].path, name);
            if (nl_config_dense(c->cfg))
                FAIL(NL_ERR_FORMAT,
                     "%s: tensor '%.80s' is not part of a %s of this config.json "
                     "(num_hidden_layers %d)",
                     c->src.f[fi].path, name, c->arch, c->cfg->num_layers);
            FAIL(NL_ERR_FORMAT,
                 "%s: tensor '%.80s' is not part of a %s of this config.json "
                 "(num_hidden_layers %d, num_local_experts %d)",
                 c->src.f[fi].path, name, c->arch, c->cfg->num_layers, c->cfg->num_experts);
        }
    return NL_OK;
}

nl_status nl_hf_import(const char *dir, const char *out, nl_hf_stats *stats, nl_error *err)
{
    nl_hf_stats dummy;
    nl_config cfg;
    hf_conv c = {.cfg = &cfg, .to_ours = 1, .stats = stats ? stats : &dummy};
    memset(c.stats, 0, sizeof *c.stats);
    char *cpath = hf_join(dir, "config.json"), *text = NULL, *cfg_json = NULL, *tok = NULL,
         *chat = NULL;
    nl_st_writer *w = NULL;
    int tied = 0;
    size_t len;
    nl_status st;
    if (!cpath)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if ((st = nl_file_read_all(cpath, NL_HF_MAX_JSON, &text, &len, err)) ||
        (st = nl_hf_config_parse(&cfg, &tied, text, len, cpath, c.arch, err)) ||
        (st = open_hf_weights(&c, dir, err)) || (st = hf_build_jobs(&c, err)) ||
        (st = nl_chat_template_read_hf(dir, &chat, c.stats->chat_family, c.stats->chat_warning,
                                       err)))
        goto out;
    for (int i = 0; i < c.n_jobs; i++) {
        hf_job *j = &c.jobs[i];
        int from_embed = tied && strcmp(j->ours, "lm_head.weight") == 0;
        if ((st = hf_resolve(&c, j, from_embed ? "model.embed_tokens.weight" : j->hf, j->rows, 1,
                             err)))
            goto out;
    }
    c.stats->tied = tied;
    c.stats->n_files = c.src.n;
    if ((st = check_unused(&c, tied, err)) || (st = hf_alloc_tmp(&c, err)) ||
        (st = hf_tokenizer_read(dir, cfg.vocab_size, &tok, c.stats->tokenizer_note,
                                sizeof c.stats->tokenizer_note, err)))
        goto out;
    if (!(w = nl_st_writer_new()) || !(cfg_json = nl_config_to_json(&cfg))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < c.n_jobs && !st; i++) {
        hf_job *j = &c.jobs[i];
        int64_t shape[2] = {j->our_rows, j->cols};
        st = nl_st_writer_add_fill(w, j->ours, NL_DTYPE_F32, j->cols ? 2 : 1, shape, hf_fill, j,
                                   err);
    }
    if (!st && tok && !(st = nl_st_writer_set_meta(w, "tokenizer", tok, err)))
        c.stats->has_tokenizer = 1;
    if (!st && !(st = nl_st_writer_set_meta(w, "format", NL_CHECKPOINT_FORMAT, err)) &&
        !(st = nl_st_writer_set_meta(w, "config", cfg_json, err)) &&
        !(st = nl_st_writer_set_meta(w, "step", "0", err)) &&
        !(chat && (st = nl_st_writer_set_meta(w, "chat_template", chat, err))))
        st = nl_st_writer_write(w, out, err);
out:
    nl_st_writer_destroy(&w);
    hf_conv_free(&c);
    free(chat);
    free(cfg_json);
    free(text);
    free(cpath);
    free(tok);
    return st;
}
