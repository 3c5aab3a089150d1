/* Hugging Face export (core/formats/hf.h): one of our checkpoints, or a training
 * manifest and its shards, as a MixtralForCausalLM / LlamaForCausalLM
 * directory: config.json, the weights (sharded past a size), and the
 * tokenizer's files when the source carries one. */
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/formats/hf_impl.h"
#include "core/formats/manifest.h"
#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/tokenizer.h"

#define FAIL HF_FAIL

/* The options of DESIGN section 6 that Mixtral's, Llama's and Mistral's
 * layouts do not have: refused by name (the dense FFN is Llama's, a
 * window on every layer Mistral's sliding_window). */
static nl_status hf_representable(const nl_config *c, const char *src, nl_error *err)
{
    const char *key = !c->causal                    ? "causal: false (an encoder)"
                      : c->ffn_act != NL_FFN_SWIGLU ? "ffn_act: geglu"
                      : c->attention_window > 0 && !nl_hf_window(c)
                          ? "attention_window with global layers (global_every above 0)"
                      : c->rope_scaling.type != NL_ROPE_NONE ? "rope_scaling"
                      : c->num_classes > 0                   ? "num_classes (a classifier head)"
                                                             : NULL;
    if (key)
        FAIL(NL_ERR_UNSUPPORTED,
             "%s: config %s has no place in the MixtralForCausalLM, LlamaForCausalLM or "
             "MistralForCausalLM layout",
             src, key);
    return NL_OK;
}

/* The source: a checkpoint, or a verified manifest's shards. */
/* true when a path in written ends in /name */
static int listed(char *const *written, int n, const char *name)
{
    const size_t l = strlen(name);
    for (int i = 0; i < n; i++) {
        const size_t w = strlen(written[i]);
        if (w > l && written[i][w - l - 1] == '/' && strcmp(written[i] + w - l, name) == 0)
            return 1;
    }
    return 0;
}

static nl_status open_ours(hf_conv *c, const char *src, nl_config *cfg, char **tokenizer,
                           char **chat, nl_error *err)
{
    struct stat sb;
    size_t n = strlen(src);
    nl_status st;
    if ((stat(src, &sb) == 0 && S_ISDIR(sb.st_mode)) || (n > 5 && !strcmp(src + n - 5, ".json"))) {
        nl_manifest *m = NULL;
        if (!(st = nl_manifest_load(&m, src, err)) && !(st = nl_manifest_verify(m, err))) {
            *cfg = m->cfg;
            for (int i = 0; i < m->n_shards && !st; i++)
                if (!(st = nl_manifest_check_shard(m, i, err)))
                    st = hf_src_add(&c->src, m->shards[i].path, err);
            if (!st && ((m->tokenizer && !(*tokenizer = strdup(m->tokenizer))) ||
                        (m->chat_template && !(*chat = strdup(m->chat_template)))))
                st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        }
        nl_manifest_destroy(&m);
        return st;
    }
    if ((st = hf_src_add(&c->src, src, err)))
        return st;
    const nl_st_header *h = c->src.f[0].h;
    const char *fmt = nl_st_header_meta(h, "format"), *cj = nl_st_header_meta(h, "config");
    if (!fmt || strcmp(fmt, NL_CHECKPOINT_FORMAT) != 0 || !cj)
        FAIL(NL_ERR_FORMAT, "%s: not a NeuroLLM checkpoint (metadata format %s, config %s)", src,
             fmt ? "is not " NL_CHECKPOINT_FORMAT : "missing", cj ? "present" : "missing");
    if ((st = nl_config_from_json(cfg, cj, err)) || (st = nl_config_validate(cfg, 1, err)))
        return nl_error_prefix(err, "%s: config", src);
    const char *tok = nl_st_header_meta(h, "tokenizer"),
               *ch = nl_st_header_meta(h, "chat_template");
    if ((tok && !(*tokenizer = strdup(tok))) || (ch && !(*chat = strdup(ch))))
        FAIL(NL_ERR_NOMEM, "out of memory");
    return NL_OK;
}

/* DIR for an export: made when missing (*created), else it must be empty,
 * or with force hold anything (*n_before: its entries, for the report). */
static nl_status check_out_dir(const char *dir, int force, int *created, int *n_before,
                               nl_error *err)
{
    DIR *d = opendir(dir);
    *n_before = 0;
    if (!d && errno == ENOENT) {
        *created = 1;
        return nl_file_mkdirs(dir, err);
    }
    if (!d)
        FAIL(NL_ERR_IO, "%s: %s", dir, strerror(errno));
    struct dirent *e;
    while ((e = readdir(d)))
        *n_before += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    if (*n_before && !force)
        FAIL(NL_ERR_STATE,
             "%s: not empty; export into a new or empty directory, or give --force to replace "
             "the files an export writes there (others are kept)",
             dir);
    return NL_OK;
}

/* After an export into a directory that held n_before entries: the ones
 * it did not write were kept (counted and named in stats), the rest
 * replaced. */
static void count_kept(const char *dir, char **written, int n_written, int n_before,
                       nl_hf_stats *stats)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    size_t used = 0, cap = sizeof stats->kept_names;
    int full = 0;
    while (d && (e = readdir(d))) {
        int ours = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
        for (int i = 0; i < n_written && !ours; i++) {
            const char *slash = strrchr(written[i], '/');
            ours = !strcmp(slash ? slash + 1 : written[i], e->d_name);
        }
        if (ours)
            continue;
        stats->kept++;
        if (full)
            continue;
        size_t need = strlen(e->d_name) + (used ? 2 : 0);
        if (used + need + 6 < cap) { /* room left for ", ..." */
            used += (size_t)snprintf(stats->kept_names + used, cap - used, "%s%s", used ? ", " : "",
                                     e->d_name);
        } else {
            strcpy(stats->kept_names + used, used ? ", ..." : "...");
            full = 1;
        }
    }
    if (d)
        closedir(d);
    stats->replaced = n_before - stats->kept;
}

/* One weight file of an export: jobs [j0, j1). */
static nl_status write_shard(hf_conv *c, int j0, int j1, const char *path, nl_error *err)
{
    nl_st_writer *w = nl_st_writer_new();
    nl_status st = w ? nl_st_writer_set_meta(w, "format", "pt", err)
                     : nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    for (int i = j0; i < j1 && !st; i++) {
        hf_job *j = &c->jobs[i];
        int64_t shape[2] = {j->rows, j->cols};
        st = nl_st_writer_add_fill(w, j->hf, NL_DTYPE_F32, j->cols ? 2 : 1, shape, hf_fill, j, err);
    }
    if (!st)
        st = nl_st_writer_write(w, path, err);
    nl_st_writer_destroy(&w);
    return st;
}

/* The weight files, cut where a file would pass shard_bytes, and the index
 * when there is more than one. */
static nl_status write_weights(hf_conv *c, const char *dir, uint64_t shard_bytes, char **written,
                               int *n_written, nl_error *err)
{
    int *start = malloc((size_t)(c->n_jobs + 1) * sizeof *start), n = 0;
    json_t *map = json_object();
    nl_status st = NL_OK;
    uint64_t acc = 0, total = 0;
    if (!start || !map) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < c->n_jobs; i++) {
        uint64_t b = (uint64_t)(c->jobs[i].rows * (c->jobs[i].cols ? c->jobs[i].cols : 1)) * 4;
        if (i == 0 || (acc && acc + b > shard_bytes)) {
            start[n++] = i;
            acc = 0;
        }
        acc += b;
        total += b;
    }
    start[n] = c->n_jobs;
    for (int s = 0; s < n && !st; s++) {
        char name[64], *p;
        if (n == 1)
            snprintf(name, sizeof name, "model.safetensors");
        else
            snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, n);
        if (!(p = hf_join(dir, name)))
            st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        else if ((st = write_shard(c, start[s], start[s + 1], p, err)))
            free(p);
        else
            written[(*n_written)++] = p;
        for (int i = start[s]; i < start[s + 1] && !st; i++)
            json_object_set_new(map, c->jobs[i].hf, json_string(name));
    }
    c->stats->n_files = n;
    if (!st && n > 1) {
        json_t *root = json_pack("{s:{s:I},s:O}", "metadata", "total_size", (json_int_t)total,
                                 "weight_map", map);
        char *text = root ? json_dumps(root, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
        char *p = hf_join(dir, "model.safetensors.index.json");
        if (!text || !p)
            st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        else if (!(st = nl_file_write_atomic(p, text, strlen(text), err)))
            written[(*n_written)++] = p, p = NULL;
        free(p);
        free(text);
        json_decref(root);
    }
out:
    json_decref(map);
    free(start);
    return st;
}

nl_status nl_hf_export(const char *src, const char *dir, uint64_t shard_bytes, int force,
                       nl_hf_stats *stats, nl_error *err)
{
    nl_hf_stats dummy;
    nl_config cfg;
    hf_conv c = {.cfg = &cfg, .to_ours = 0, .stats = stats ? stats : &dummy};
    memset(c.stats, 0, sizeof *c.stats);
    char *tok = NULL, *cj = NULL, **written = NULL, *chat = NULL;
    int n_written = 0, created = 0, n_before = 0;
    nl_status st;
    if ((st = open_ours(&c, src, &cfg, &tok, &chat, err)) ||
        (st = hf_representable(&cfg, src, err)))
        goto out;
    snprintf(c.arch, sizeof c.arch, "%s", nl_hf_arch_of(&cfg));
    if ((st = hf_build_jobs(&c, err)))
        goto out;
    for (int i = 0; i < c.n_jobs && !st; i++)
        st = hf_resolve(&c, &c.jobs[i], c.jobs[i].ours, c.jobs[i].our_rows, 1, err);
    if (st || (st = hf_alloc_tmp(&c, err)))
        goto out;
    /* Room for every weight file, the index and six small files. */
    if (!(written = calloc((size_t)c.n_jobs + 8, sizeof *written))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    int native = 0;
    if ((st = check_out_dir(dir, force, &created, &n_before, err)) ||
        (st = write_weights(&c, dir, shard_bytes ? shard_bytes : NL_HF_SHARD_DEFAULT, written,
                            &n_written, err)) ||
        (tok &&
         (st = hf_tokenizer_write(dir, tok, &cfg, &native, written, &n_written,
                                  c.stats->tokenizer_note, sizeof c.stats->tokenizer_note, err))))
        goto out;
    /* bos/eos: our <|begin|> and <|end|>, where the ids are ours */
    if (!(cj = nl_hf_config_to_json(&cfg, tok != NULL && native))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    c.stats->has_tokenizer = tok != NULL;
    char *p = hf_join(dir, "config.json");
    if (!p)
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    else if ((st = nl_file_write_atomic(p, cj, strlen(cj), err)))
        free(p);
    else
        written[n_written++] = p;
    c.stats->vocab_size = cfg.vocab_size;
    /* the chat template into tokenizer_config.json (the tokenizer's, when
     * it wrote one: then the file is already in written) */
    if (!st && !(st = nl_chat_template_write_hf(dir, chat, &c.stats->chat_written, err)) &&
        c.stats->chat_written && !listed(written, n_written, "tokenizer_config.json") &&
        !(written[n_written++] = hf_join(dir, "tokenizer_config.json")))
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if (!st && n_before)
        count_kept(dir, written, n_written, n_before, c.stats);
out:
    for (int i = 0; i < n_written; i++) {
        if (st)
            unlink(written[i]);
        free(written[i]);
    }
    if (st && created)
        rmdir(dir);
    free(written);
    hf_conv_free(&c);
    free(cj);
    free(tok);
    free(chat);
    return st;
}
