/* Hugging Face import/export (core/formats/hf.c) in-process, on model directories
 * this test writes: the name mapping and the RoPE row permutation tensor by
 * tensor, sharded and single-file sources, BF16 conversion, tied
 * embeddings, import -> export -> import bit for bit, and a matrix of
 * corrupt inputs (missing shard, wrong shape, unknown dtype, lying or
 * unsupported config), each refused with a message naming the fault and no
 * output file left behind. The comparison with transformers itself is
 * tests/hf/check_hf.py. */
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/formats/hf.h"
#include "core/formats/safetensors.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/check.h"

#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

enum { V = 11, D = 12, H = 3, HD = 4, G = 1, F = 7, E = 3, L = 2 };

static char root[256];

typedef struct model_opts {
    int sharded, bf16, tied, bias, wrong_q, i32_norm, f8, drop_shard;
    int cfg_layers;    /* num_hidden_layers in config.json (0: L) */
    int cfg_hidden;    /* hidden_size in config.json (0: D) */
    const char *extra; /* more config keys, e.g. ", \"rope_scaling\": {...}" */
    const char *arch;  /* architectures[0] (NULL: MixtralForCausalLM) */
    const char *act;   /* hidden_act (NULL: silu) */
    int no_vocab;      /* leave vocab_size out */
    int dense;         /* Llama's and Mistral's MLP (mlp.*_proj) for expert 0, no router */
    int unknown;       /* one more tensor, of no model */
} model_opts;

static uint32_t seed = 1;
static float rnd(void)
{
    seed = seed * 1664525u + 1013904223u;
    return (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
}

static char *path_in(const char *dir, const char *name)
{
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

static void spit(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    fputs(text, f);
    fclose(f);
}

static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    if (!d)
        return -1;
    while ((e = readdir(d)))
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

/* A hand-written safetensors file with one tensor of a dtype our writer
 * would refuse (F8_E4M3). */
static void write_f8(const char *path)
{
    const char *h = "{\"model.norm.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[12],"
                    "\"data_offsets\":[0,12]}}";
    uint64_t n = strlen(h);
    FILE *f = fopen(path, "wb");
    for (int i = 0; i < 8; i++)
        fputc((int)((n >> (8 * i)) & 255), f);
    fputs(h, f);
    for (int i = 0; i < 12; i++)
        fputc(0x38, f);
    fclose(f);
}

/* model.safetensors.index.json for two shards: tensor i is in which[i]. */
static void write_index(const char *dir, char (*names)[96], const int *which, int nt)
{
    static char idx[65536];
    size_t k = (size_t)snprintf(idx, sizeof idx, "{\"metadata\": {}, \"weight_map\": {");
    for (int i = 0; i < nt; i++)
        k += (size_t)snprintf(idx + k, sizeof idx - k,
                              "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", i ? ", " : "",
                              names[i], which[i] + 1);
    snprintf(idx + k, sizeof idx - k, "}}");
    spit(path_in(dir, "model.safetensors.index.json"), idx);
}

/* Write a MixtralForCausalLM directory: config.json and the weights (F32
 * or BF16, one file or two shards with an index). Tensors are returned in
 * *pool (F32 values, as the reader should see them) by HF name order. */
static void write_model(const char *dir, const model_opts *o)
{
    nl_error err = {0};
    mkdir(dir, 0755);
    char cfg[2048];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"%s\"], \"model_type\": \"mixtral\", %s"
             "\"hidden_size\": %d, \"intermediate_size\": %d, \"num_hidden_layers\": %d, "
             "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"num_local_experts\": %d, "
             "\"num_experts_per_tok\": 2, \"max_position_embeddings\": 128, \"rope_theta\": "
             "1000000.0, \"rms_norm_eps\": 1e-05, \"hidden_act\": \"%s\", \"sliding_window\": "
             "null, \"tie_word_embeddings\": %s, \"torch_dtype\": \"float32\"%s}",
             o->arch ? o->arch : "MixtralForCausalLM", o->no_vocab ? "" : "\"vocab_size\": 11, ",
             o->cfg_hidden ? o->cfg_hidden : D, F, o->cfg_layers ? o->cfg_layers : L, H, G, E,
             o->act ? o->act : "silu", o->tied ? "true" : "false", o->extra ? o->extra : "");
    spit(path_in(dir, "config.json"), cfg);
    if (o->f8) {
        write_f8(path_in(dir, "model.safetensors"));
        return;
    }
    nl_st_writer *w[2] = {nl_st_writer_new(), nl_st_writer_new()};
    static float pool[1 << 16];
    static uint16_t half[1 << 16];
    size_t used = 0;
    char names[512][96];
    int nt = 0, which[512];
    struct {
        const char *part;
        int rows, cols;
    } per[] = {{"input_layernorm", D, 0},       {"self_attn.q_proj", H * HD, D},
               {"self_attn.k_proj", G * HD, D}, {"self_attn.v_proj", G * HD, D},
               {"self_attn.o_proj", D, H * HD}, {"post_attention_layernorm", D, 0},
               {"block_sparse_moe.gate", E, D}};
    for (int t = 0; t < 3 + L * (7 + 3 * E); t++) {
        char name[96];
        int rows, cols;
        if (t == 0 || t == 1 || t == 2) {
            const char *n3[3] = {"model.embed_tokens.weight", "model.norm.weight",
                                 "lm_head.weight"};
            snprintf(name, sizeof name, "%s", n3[t]);
            rows = t == 1 ? D : V;
            cols = t == 1 ? 0 : D;
            if (t == 2 && o->tied)
                continue;
        } else {
            int k = t - 3, l = k / (7 + 3 * E), r = k % (7 + 3 * E);
            if (r < 7) {
                snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, per[r].part);
                rows = per[r].rows;
                cols = per[r].cols;
                if (o->dense && r == 6)
                    continue; /* no router */
            } else if (o->dense) {
                static const char *mlp[3] = {"gate_proj", "down_proj", "up_proj"};
                int e = (r - 7) / 3, x = (r - 7) % 3;
                if (e > 0)
                    continue;
                snprintf(name, sizeof name, "model.layers.%d.mlp.%s.weight", l, mlp[x]);
                rows = x == 1 ? D : F;
                cols = x == 1 ? F : D;
            } else {
                int e = (r - 7) / 3, x = (r - 7) % 3;
                snprintf(name, sizeof name,
                         "model.layers.%d.block_sparse_moe.experts.%d.w%d.weight", l, e, x + 1);
                rows = x == 1 ? D : F;
                cols = x == 1 ? F : D;
            }
            if (r == 1 && o->wrong_q)
                rows--;
        }
        int64_t shape[2] = {rows, cols};
        size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
        for (size_t i = 0; i < n; i++) {
            pool[used + i] = rnd();
            if (o->bf16) { /* keep only what BF16 holds */
                uint32_t u;
                memcpy(&u, &pool[used + i], 4);
                half[used + i] = (uint16_t)(u >> 16);
                u &= 0xffff0000u;
                memcpy(&pool[used + i], &u, 4);
            }
        }
        int f = o->sharded ? nt % 2 : 0;
        nl_dtype dt = o->bf16 ? NL_DTYPE_BF16 : NL_DTYPE_F32;
        const void *data = o->bf16 ? (const void *)(half + used) : (const void *)(pool + used);
        if (o->i32_norm && strcmp(name, "model.norm.weight") == 0)
            dt = NL_DTYPE_I32;
        CHECK_OK(nl_st_writer_add(w[f], name, dt, cols ? 2 : 1, shape, data, &err), &err);
        snprintf(names[nt], sizeof names[nt], "%s", name);
        which[nt++] = f;
        used += n;
    }
    if (o->unknown) {
        int64_t s = D;
        CHECK_OK(nl_st_writer_add(w[0], "model.layers.0.self_attn.extra.weight", NL_DTYPE_F32, 1,
                                  &s, pool, &err),
                 &err);
    }
    if (o->bias) {
        int64_t s = D;
        CHECK_OK(nl_st_writer_add(w[0], "model.layers.0.self_attn.o_proj.bias", NL_DTYPE_F32, 1, &s,
                                  pool, &err),
                 &err);
    }
    if (!o->sharded) {
        CHECK_OK(nl_st_writer_write(w[0], path_in(dir, "model.safetensors"), &err), &err);
    } else {
        CHECK_OK(nl_st_writer_write(w[0], path_in(dir, "model-00001-of-00002.safetensors"), &err),
                 &err);
        if (!o->drop_shard)
            CHECK_OK(
                nl_st_writer_write(w[1], path_in(dir, "model-00002-of-00002.safetensors"), &err),
                &err);
        write_index(dir, names, which, nt);
    }
    nl_st_writer_destroy(&w[0]);
    nl_st_writer_destroy(&w[1]);
}

/* Read a tensor of an F32 safetensors file (n floats). */
static int read_f32(const char *path, const char *name, float *out, size_t n)
{
    nl_error err = {0};
    nl_st_file *f = NULL;
    int ok = 0;
    if (nl_st_open(&f, path, &err) == NL_OK) {
        const nl_st_entry *e = nl_st_find(f, name);
        if (e && e->dtype == NL_DTYPE_F32 && e->nbytes == n * 4) {
            memcpy(out, nl_st_tensor_data(f, e), n * 4);
            ok = 1;
        }
    }
    nl_st_close(&f);
    return ok;
}

/* Same tensor names, dtypes, shapes and bytes in both files. */
static int same_tensors(const char *a, const char *b)
{
    nl_error err = {0};
    nl_st_file *fa = NULL, *fb = NULL;
    int ok = nl_st_open(&fa, a, &err) == NL_OK && nl_st_open(&fb, b, &err) == NL_OK &&
             nl_st_count(fa) == nl_st_count(fb);
    for (size_t i = 0; ok && i < nl_st_count(fa); i++) {
        const nl_st_entry *ea = nl_st_entry_at(fa, i), *eb = nl_st_find(fb, ea->name);
        ok = eb && ea->dtype == eb->dtype && ea->nbytes == eb->nbytes && ea->ndim == eb->ndim &&
             !memcmp(ea->shape, eb->shape, sizeof ea->shape) &&
             !memcmp(nl_st_tensor_data(fa, ea), nl_st_tensor_data(fb, eb), ea->nbytes);
    }
    nl_st_close(&fa);
    nl_st_close(&fb);
    return ok;
}

static void test_good(void)
{
    nl_error err = {0};
    nl_hf_stats s;
    char *src = strdup(path_in(root, "good")), *out = strdup(path_in(root, "good.safetensors"));
    seed = 5;
    write_model(src, &(model_opts){0});
    CHECK_OK(nl_hf_import(src, out, &s, &err), &err);
    CHECK(s.n_tensors == 3 + L * (7 + 3 * E) && s.n_files == 1 && !s.converted && !s.tied,
          "stats: %d tensors, %d files", s.n_tensors, s.n_files);
    /* q rows: ours[h, 2i + j] = hf[h, j hd/2 + i]; v is not permuted */
    float hq[H * HD * D], oq[H * HD * D], hv[G * HD * D], ov[G * HD * D];
    CHECK(read_f32(path_in(src, "model.safetensors"), "model.layers.1.self_attn.q_proj.weight", hq,
                   sizeof hq / 4),
          "read hf q");
    CHECK(read_f32(out, "layers.1.attention.wq.weight", oq, sizeof oq / 4), "read our wq");
    int perm_ok = 1;
    for (int h = 0; h < H; h++)
        for (int i = 0; i < HD / 2; i++)
            for (int j = 0; j < 2; j++)
                perm_ok &= !memcmp(oq + (h * HD + 2 * i + j) * D,
                                   hq + (h * HD + j * HD / 2 + i) * D, D * 4);
    CHECK(perm_ok, "wq rows are q_proj's rows in pair order");
    CHECK(read_f32(path_in(src, "model.safetensors"), "model.layers.0.self_attn.v_proj.weight", hv,
                   sizeof hv / 4) &&
              read_f32(out, "layers.0.attention.wv.weight", ov, sizeof ov / 4) &&
              !memcmp(hv, ov, sizeof hv),
          "wv is v_proj as it is");
    float hw[D * F], ow[D * F];
    CHECK(read_f32(path_in(src, "model.safetensors"),
                   "model.layers.1.block_sparse_moe.experts.2.w2.weight", hw, D * F) &&
              read_f32(out, "layers.1.moe.experts.2.w_down.weight", ow, D * F) &&
              !memcmp(hw, ow, sizeof hw),
          "w2 is w_down");
    nl_config cfg;
    char *cj = NULL;
    nl_st_file *f = NULL;
    CHECK_OK(nl_st_open(&f, out, &err), &err);
    if (f && nl_st_metadata(f, "config"))
        cj = strdup(nl_st_metadata(f, "config"));
    nl_st_close(&f);
    CHECK(cj && nl_config_from_json(&cfg, cj, &err) == NL_OK && cfg.vocab_size == V &&
              nl_config_capacity(&cfg) == V && cfg.rope_base == 1e6 && cfg.norm_eps == 1e-5 &&
              cfg.num_kv_heads == G && cfg.num_experts == E && cfg.max_seq_len == 128,
          "config metadata");
    free(cj);

    /* export: the HF tensors come back bit for bit; import again: ours do */
    char *exp = strdup(path_in(root, "good-export")), *again = strdup(path_in(root, "again.st"));
    CHECK_OK(nl_hf_export(out, exp, 0, 0, &s, &err), &err);
    CHECK(s.n_files == 1 && !s.has_tokenizer, "export stats");
    CHECK(same_tensors(path_in(src, "model.safetensors"), path_in(exp, "model.safetensors")),
          "export gives back the imported tensors exactly");
    CHECK_OK(nl_hf_import(exp, again, NULL, &err), &err);
    CHECK(same_tensors(out, again), "import -> export -> import is bit-identical");
    /* sharded export: 800 bytes per file at most (a tensor larger goes alone) */
    char *exp2 = strdup(path_in(root, "good-export-sharded")),
         *again2 = strdup(path_in(root, "again2.st"));
    CHECK_OK(nl_hf_export(out, exp2, 800, 0, &s, &err), &err);
    CHECK(s.n_files > 2, "sharded export: %d files", s.n_files);
    CHECK(access(path_in(exp2, "model.safetensors.index.json"), F_OK) == 0, "index written");
    CHECK_OK(nl_hf_import(exp2, again2, NULL, &err), &err);
    CHECK(same_tensors(out, again2), "sharded export imports back bit-identical");
    /* export refuses a non-empty directory and writes nothing there */
    int before = count_entries(exp);
    CHECK(nl_hf_export(out, exp, 0, 0, NULL, &err) == NL_ERR_STATE && strstr(err.msg, "not empty"),
          "non-empty: %s", err.msg);
    CHECK(count_entries(exp) == before, "nothing added");
    /* with force: the export's files are replaced, another file is kept and named */
    FILE *nf = fopen(path_in(exp, "notes.txt"), "w");
    CHECK(nf && fputs("mine\n", nf) >= 0 && fclose(nf) == 0, "notes.txt");
    CHECK_OK(nl_hf_export(out, exp, 0, 1, &s, &err), &err);
    CHECK(s.replaced == before && s.kept == 1 && strcmp(s.kept_names, "notes.txt") == 0,
          "force: replaced %d of %d, kept %d (%s)", s.replaced, before, s.kept, s.kept_names);
    CHECK(count_entries(exp) == before + 1 && access(path_in(exp, "notes.txt"), F_OK) == 0,
          "force keeps notes.txt");
    CHECK(s.vocab_size == V && !s.has_tokenizer, "vocab_size %lld", (long long)s.vocab_size);
    CHECK(same_tensors(path_in(src, "model.safetensors"), path_in(exp, "model.safetensors")),
          "force: the tensors written again");
    CHECK(nl_hf_export(path_in(root, "nope.safetensors"), path_in(root, "nope-dir"), 0, 0, NULL,
                       &err) == NL_ERR_NOTFOUND &&
              count_entries(path_in(root, "nope-dir")) < 0,
          "missing source: %s; no directory made", err.msg);
    /* an HF directory is not one of our checkpoints */
    CHECK(nl_hf_export(path_in(src, "model.safetensors"), path_in(root, "nope-dir"), 0, 0, NULL,
                       &err) == NL_ERR_FORMAT &&
              strstr(err.msg, "not a NeuroLLM checkpoint"),
          "foreign source: %s", err.msg);

    /* the same model sharded imports to the same checkpoint */
    char *sh = strdup(path_in(root, "sharded")), *sh_out = strdup(path_in(root, "sharded.st"));
    seed = 5;
    write_model(sh, &(model_opts){.sharded = 1});
    CHECK_OK(nl_hf_import(sh, sh_out, &s, &err), &err);
    CHECK(s.n_files == 2, "two shards read");
    CHECK(same_tensors(out, sh_out), "sharded source gives the same checkpoint");
    free(src), free(out), free(exp), free(again), free(exp2), free(again2), free(sh), free(sh_out);
}

static void test_bf16_and_tied(void)
{
    nl_error err = {0};
    nl_hf_stats s;
    char *src = strdup(path_in(root, "bf16")), *out = strdup(path_in(root, "bf16.st"));
    seed = 9;
    write_model(src, &(model_opts){.bf16 = 1, .tied = 1});
    CHECK_OK(nl_hf_import(src, out, &s, &err), &err);
    CHECK(s.converted == 3 + L * (7 + 3 * E) && !strcmp(s.converted_from, "BF16") && s.tied,
          "converted %d from %s, tied %d", s.converted, s.converted_from, s.tied);
    /* widened exactly: regenerate the values the writer rounded */
    float e[V * D], h[V * D], norm[D];
    seed = 9;
    for (int i = 0; i < V * D; i++) {
        float x = rnd();
        uint32_t u;
        memcpy(&u, &x, 4);
        u &= 0xffff0000u;
        memcpy(&e[i], &u, 4);
    }
    CHECK(read_f32(out, "tok_embeddings.weight", h, V * D) && !memcmp(e, h, sizeof e),
          "BF16 embedding widened exactly");
    CHECK(read_f32(out, "lm_head.weight", h, V * D) && !memcmp(e, h, sizeof e),
          "tied: lm_head is a copy of the embedding");
    CHECK(read_f32(out, "norm.weight", norm, D), "norm read");
    free(src), free(out);
}

/* A source that must be refused: status, a word of the message, and no
 * file in the (empty) output directory. */
static void refuse(const char *name, model_opts o, nl_status want, const char *words)
{
    nl_error err = {0};
    char *src = strdup(path_in(root, name)), *odir = strdup(path_in(root, "out-empty"));
    mkdir(odir, 0755);
    seed = 3;
    write_model(src, &o);
    nl_status st = nl_hf_import(src, path_in(odir, "x.safetensors"), NULL, &err);
    CHECK(st == want && strstr(err.msg, words), "%s: got %s '%s', want %s with '%s'", name,
          nl_status_str(st), err.msg, nl_status_str(want), words);
    CHECK(count_entries(odir) == 0, "%s: nothing written", name);
    free(src), free(odir);
}

static void test_refused(void)
{
    refuse("missing-shard", (model_opts){.sharded = 1, .drop_shard = 1}, NL_ERR_NOTFOUND,
           "model-00002-of-00002.safetensors: no such file");
    refuse("wrong-shape", (model_opts){.wrong_q = 1}, NL_ERR_SHAPE,
           "q_proj.weight': shape [11, 12], but the config says [12, 12] [num_attention_heads");
    refuse("unknown-dtype", (model_opts){.f8 = 1}, NL_ERR_DTYPE, "F8_E4M3");
    refuse("i32-dtype", (model_opts){.i32_norm = 1}, NL_ERR_DTYPE,
           "tensor 'model.norm.weight': dtype I32");
    refuse("lie-more-layers", (model_opts){.cfg_layers = 3}, NL_ERR_NOTFOUND,
           "'model.layers.2.input_layernorm.weight' is missing");
    refuse("lie-fewer-layers", (model_opts){.cfg_layers = 1}, NL_ERR_FORMAT,
           "'model.layers.1.input_layernorm.weight' is not part of a MixtralForCausalLM");
    refuse("lie-hidden", (model_opts){.cfg_hidden = 24}, NL_ERR_SHAPE, "[vocab_size, hidden_size]");
    refuse("no-vocab", (model_opts){.no_vocab = 1}, NL_ERR_FORMAT, "vocab_size: missing");
    refuse("bias", (model_opts){.bias = 1}, NL_ERR_UNSUPPORTED, "o_proj.bias': biases");
    /* Llama and Mistral are dense: a directory of Mixtral's expert tensors
     * under their name lacks the MLP's */
    refuse("llama", (model_opts){.arch = "LlamaForCausalLM"}, NL_ERR_NOTFOUND,
           "'model.layers.0.mlp.gate_proj.weight' is missing");
    refuse("mistral", (model_opts){.arch = "MistralForCausalLM"}, NL_ERR_NOTFOUND,
           "mlp.gate_proj.weight' is missing (");
    refuse("mistral-arch", (model_opts){.arch = "MistralForCausalLM"}, NL_ERR_NOTFOUND,
           "config.json asks for it (a MistralForCausalLM, num_hidden_layers 2)");
    /* an unknown tensor is named with the architecture actually read */
    refuse("mistral-unknown", (model_opts){.arch = "MistralForCausalLM", .dense = 1, .unknown = 1},
           NL_ERR_FORMAT,
           "'model.layers.0.self_attn.extra.weight' is not part of a MistralForCausalLM of this "
           "config.json (num_hidden_layers 2)");
    refuse("mixtral-unknown", (model_opts){.unknown = 1}, NL_ERR_FORMAT,
           "extra.weight' is not part of a MixtralForCausalLM of this config.json "
           "(num_hidden_layers 2, num_local_experts 3)");
    refuse("other-arch", (model_opts){.arch = "GPT2LMHeadModel"}, NL_ERR_UNSUPPORTED,
           "GPT2LMHeadModel is not supported");
    refuse("rope-scaling",
           (model_opts){.extra = ", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}"},
           NL_ERR_UNSUPPORTED, "rope_scaling: {\"type\":\"linear\",\"factor\":2.0}: RoPE scaling");
    refuse("gelu", (model_opts){.act = "gelu"}, NL_ERR_UNSUPPORTED, "hidden_act: only silu");
    refuse("relu", (model_opts){.act = "relu"}, NL_ERR_UNSUPPORTED,
           "hidden_act: only silu (or swish");
    refuse("head-dim", (model_opts){.extra = ", \"head_dim\": 8"}, NL_ERR_UNSUPPORTED, "head_dim");
    refuse("attention-bias", (model_opts){.extra = ", \"attention_bias\": true"},
           NL_ERR_UNSUPPORTED, "attention_bias: true: a bias");
    /* Mixtral's sliding_window is read (test_window); one as long as the
     * context is no window at all */
    nl_error err = {0};
    char *d = strdup(path_in(root, "window"));
    seed = 3;
    write_model(d, &(model_opts){0});
    spit(path_in(d, "config.json"),
         "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 11, \"hidden_size\": 12, "
         "\"intermediate_size\": 7, \"num_hidden_layers\": 2, \"num_attention_heads\": 3, "
         "\"num_key_value_heads\": 1, \"num_local_experts\": 3, \"max_position_embeddings\": 128, "
         "\"sliding_window\": 64}");
    CHECK_OK(nl_hf_import(d, path_in(root, "w.st"), NULL, &err), &err);
    spit(path_in(d, "config.json"),
         "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 11, \"hidden_size\": 12, "
         "\"intermediate_size\": 7, \"num_hidden_layers\": 2, \"num_attention_heads\": 3, "
         "\"num_key_value_heads\": 1, \"num_local_experts\": 3, \"max_position_embeddings\": 128, "
         "\"sliding_window\": 128}");
    CHECK_OK(nl_hf_import(d, path_in(root, "w.st"), NULL, &err), &err);
    spit(path_in(d, "config.json"),
         "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 11, \"hidden_size\": 12, "
         "\"intermediate_size\": 7, \"num_hidden_layers\": 2, \"num_attention_heads\": 3, "
         "\"num_key_value_heads\": 2, \"num_local_experts\": 3}");
    CHECK(nl_hf_import(d, path_in(root, "w2.st"), NULL, &err) == NL_ERR_INVALID &&
              strstr(err.msg, "num_kv_heads: 2 does not divide num_heads 3"),
          "kv heads: %s", err.msg);
    spit(path_in(d, "config.json"), "{\"model_type\": \"mixtral\", \"vocab_size\": 11, "
                                    "\"hidden_size\": 12, \"intermediate_size\": 7, "
                                    "\"num_hidden_layers\": 2, \"num_attention_heads\": 3}");
    unlink(path_in(d, "model.safetensors"));
    CHECK(nl_hf_import(d, path_in(root, "w3.st"), NULL, &err) == NL_ERR_NOTFOUND &&
              strstr(err.msg, "neither model.safetensors"),
          "no weights: %s", err.msg);
    free(d);
}

/* The streaming writer: filled tensors come out as produced; a fill that
 * fails leaves no file. */
static int fills;
static nl_status fill_fn(void *ctx, void *dst, uint64_t n, nl_error *err)
{
    if (ctx == NULL)
        return nl_error_set(err, NL_ERR_IO, "source went away");
    memset(dst, *(int *)ctx, n);
    fills++;
    return NL_OK;
}

static void test_fill(void)
{
    nl_error err = {0};
    nl_st_writer *w = nl_st_writer_new();
    int a = 1, b = 2;
    int64_t s1 = 16, s2[2] = {3, 5};
    float zeros[16] = {0}; /* the writer keeps the pointer until it writes */
    char *p = strdup(path_in(root, "fill.st"));
    CHECK_OK(nl_st_writer_add_fill(w, "a", NL_DTYPE_F32, 1, &s1, fill_fn, &a, &err), &err);
    CHECK_OK(nl_st_writer_add(w, "plain", NL_DTYPE_F32, 1, &s1, zeros, &err), &err);
    CHECK_OK(nl_st_writer_add_fill(w, "b", NL_DTYPE_U8, 2, s2, fill_fn, &b, &err), &err);
    CHECK_OK(nl_st_writer_write(w, p, &err), &err);
    nl_st_file *f = NULL;
    CHECK_OK(nl_st_open(&f, p, &err), &err);
    const nl_st_entry *ea = f ? nl_st_find(f, "a") : NULL, *eb = f ? nl_st_find(f, "b") : NULL;
    CHECK(ea && eb && ((const uint8_t *)nl_st_tensor_data(f, ea))[63] == 1 &&
              ((const uint8_t *)nl_st_tensor_data(f, eb))[14] == 2 && fills == 2,
          "filled tensors hold what fill wrote");
    nl_st_close(&f);
    nl_st_writer_destroy(&w);
    unlink(p);
    w = nl_st_writer_new();
    CHECK_OK(nl_st_writer_add_fill(w, "a", NL_DTYPE_F32, 1, &s1, fill_fn, &a, &err), &err);
    CHECK_OK(nl_st_writer_add_fill(w, "b", NL_DTYPE_F32, 1, &s1, fill_fn, NULL, &err), &err);
    CHECK(nl_st_writer_write(w, p, &err) == NL_ERR_IO && strstr(err.msg, "source went away"),
          "fill error: %s", err.msg);
    CHECK(access(p, F_OK) != 0, "no file after a failed fill");
    nl_st_writer_destroy(&w);
    free(p);
}

static void test_rope(void)
{
    float src[2 * 6 * 3], mid[2 * 6 * 3], back[2 * 6 * 3];
    for (int i = 0; i < 36; i++)
        src[i] = (float)i;
    nl_hf_rope_permute(mid, src, 2, 6, 3, 1);
    /* head 1, pair 2 (i = 2), j = 1: ours row 6 + 5 = 11 is hf row 6 + 3 + 2 = 11;
     * ours row 6 + 1 (i = 0, j = 1) is hf row 6 + 3 = 9 */
    CHECK(mid[7 * 3] == src[9 * 3] && mid[11 * 3 + 2] == src[11 * 3 + 2] &&
              mid[2 * 3] == src[1 * 3],
          "to ours");
    nl_hf_rope_permute(back, mid, 2, 6, 3, 0);
    CHECK(!memcmp(back, src, sizeof src), "to hf inverts to ours");
}

/* config.json keys that map onto our config: swish is silu; Mistral's and
 * Mixtral's sliding_window is attention_window with every layer local,
 * Llama's is not read (transformers' Llama has none); the architecture
 * read is reported. Then a Mistral model with a window goes in and back
 * out unchanged. */
static nl_status parse_cfg(nl_config *c, char *arch, const char *arch_name, const char *more,
                           nl_error *err)
{
    char json[1024];
    int tied;
    snprintf(json, sizeof json,
             "{\"architectures\": [\"%s\"], \"vocab_size\": 11, \"hidden_size\": 12, "
             "\"intermediate_size\": 7, \"num_hidden_layers\": 2, \"num_attention_heads\": 3, "
             "\"num_key_value_heads\": 1, \"max_position_embeddings\": 128%s}",
             arch_name, more);
    return nl_hf_config_parse(c, &tied, json, strlen(json), "config.json", arch, err);
}

static void test_window(void)
{
    nl_error err = {0};
    nl_config c;
    char arch[NL_HF_ARCH_MAX];
    CHECK_OK(parse_cfg(&c, arch, "MistralForCausalLM", ", \"sliding_window\": 4", &err), &err);
    CHECK(c.attention_window == 4 && c.global_every == 0 && nl_config_layer_local(&c, 0) &&
              !strcmp(arch, "MistralForCausalLM") && nl_config_dense(&c),
          "mistral window 4: window %d, global_every %d, arch %s", c.attention_window,
          c.global_every, arch);
    CHECK_OK(parse_cfg(&c, arch, "MixtralForCausalLM", ", \"sliding_window\": 64", &err), &err);
    CHECK(c.attention_window == 64 && c.global_every == 0 && !strcmp(arch, "MixtralForCausalLM"),
          "mixtral window 64: %d", c.attention_window);
    CHECK_OK(parse_cfg(&c, arch, "LlamaForCausalLM", ", \"sliding_window\": 64", &err), &err);
    CHECK(c.attention_window == 0, "llama's sliding_window is not read: %d", c.attention_window);
    CHECK_OK(parse_cfg(&c, arch, "mistral", ", \"sliding_window\": 128", &err), &err);
    CHECK(c.attention_window == 0 && !strcmp(arch, "MistralForCausalLM"),
          "a window as long as the context: full attention (%d, %s)", c.attention_window, arch);
    CHECK_OK(parse_cfg(&c, arch, "MistralForCausalLM", ", \"sliding_window\": null", &err), &err);
    CHECK(c.attention_window == 0, "null: full attention");
    CHECK(parse_cfg(&c, arch, "MistralForCausalLM", ", \"sliding_window\": 0", &err) ==
                  NL_ERR_RANGE &&
              strstr(err.msg, "sliding_window: 0 is not a positive window"),
          "window 0: %s", err.msg);
    CHECK(parse_cfg(&c, arch, "MistralForCausalLM", ", \"sliding_window\": \"4\"", &err) ==
                  NL_ERR_FORMAT &&
              strstr(err.msg, "sliding_window: not an integer"),
          "window '4': %s", err.msg);
    CHECK_OK(parse_cfg(&c, arch, "MistralForCausalLM", ", \"hidden_act\": \"swish\"", &err), &err);
    CHECK(nl_hf_window(&c) == 0 && !strcmp(nl_hf_arch_of(&c), "LlamaForCausalLM"),
          "no window: exported as Llama");

    /* in and back out */
    char *d = strdup(path_in(root, "mistral")), *ours = strdup(path_in(root, "mistral.st"));
    char *back = strdup(path_in(root, "mistral-hf")), *again = strdup(path_in(root, "m2.st"));
    seed = 11;
    write_model(d, &(model_opts){.arch = "MistralForCausalLM", .dense = 1});
    spit(path_in(d, "config.json"),
         "{\"architectures\": [\"MistralForCausalLM\"], \"vocab_size\": 11, \"hidden_size\": 12, "
         "\"intermediate_size\": 7, \"num_hidden_layers\": 2, \"num_attention_heads\": 3, "
         "\"num_key_value_heads\": 1, \"max_position_embeddings\": 128, \"sliding_window\": 5, "
         "\"hidden_act\": \"swish\"}");
    CHECK_OK(nl_hf_import(d, ours, NULL, &err), &err);
    int64_t step;
    CHECK_OK(nl_checkpoint_read_config(ours, &c, &step, &err), &err);
    CHECK(c.attention_window == 5 && c.global_every == 0 && c.num_experts == 1,
          "imported: window %d, global_every %d", c.attention_window, c.global_every);
    CHECK_OK(nl_hf_export(ours, back, 0, 0, NULL, &err), &err);
    char *text = NULL;
    size_t len = 0;
    CHECK_OK(nl_file_read_all(path_in(back, "config.json"), 1 << 20, &text, &len, &err), &err);
    CHECK(text && strstr(text, "\"MistralForCausalLM\"") && strstr(text, "\"sliding_window\": 5") &&
              strstr(text, "\"model_type\": \"mistral\""),
          "exported config.json: %s", text ? text : "(none)");
    free(text);
    CHECK_OK(nl_hf_import(back, again, NULL, &err), &err);
    CHECK(same_tensors(ours, again), "Mistral in, out and in again: the same checkpoint");
    free(d), free(ours), free(back), free(again);
}

/* tokenizer.json: a byte-level BPE keeps its ids (a special first here),
 * other kinds are named and left out, malformed ones are refused naming
 * the entry. The alphabet: GPT-2's stand-ins, U+0100 + n for the bytes
 * that are not printable (space is U+0120, "Ġ"). */
static void test_tokenizer_json(void)
{
    static char json[65536];
    char *text = NULL, note[512];
    nl_error err = {0};
    /* ids: 0 the special, 1..256 the bytes in their stand-ins' order */
    size_t n = (size_t)snprintf(json, sizeof json,
                                "{\"added_tokens\": [{\"id\": 0, \"content\": \"<s>\"}], "
                                "\"model\": {\"type\": \"BPE\", \"vocab\": {\"<s>\": 0");
    int id = 1;
    for (unsigned cp = 0; cp < 0x144; cp++) {
        int printable = (cp >= 33 && cp <= 126) || (cp >= 161 && cp <= 172) ||
                        (cp >= 174 && cp <= 255) || cp >= 256;
        if (!printable)
            continue;
        if (cp == '"' || cp == '\\')
            n += (size_t)snprintf(json + n, sizeof json - n, ", \"\\%c\": %d", (char)cp, id++);
        else
            n += (size_t)snprintf(json + n, sizeof json - n, ", \"\\u%04x\": %d", cp, id++);
    }
    n += (size_t)snprintf(json + n, sizeof json - n,
                          ", \"ab\": 257, \"\\u0120ab\": 258}, \"merges\": [\"a b\", "
                          "\"\\u0120 ab\"%s]}, \"pre_tokenizer\": {\"type\": \"ByteLevel\", "
                          "\"add_prefix_space\": false}%s}",
                          "", "");
    CHECK(id == 257, "256 stand-ins: %d", id - 1);
    CHECK_OK(nl_hf_tokenizer_parse(json, n, "tokenizer.json", 300, &text, note, sizeof note, &err),
             &err);
    nl_tokenizer *t = NULL;
    CHECK_OK(text ? nl_tokenizer_load_buffer(&t, text, strlen(text), &err) : NL_ERR_INTERNAL, &err);
    if (t) {
        int32_t *ids = NULL;
        size_t k = 0;
        CHECK_OK(nl_tokenizer_encode(t, "ab ab", 5, &ids, &k, &err), &err);
        CHECK(k == 2 && ids[0] == 257 && ids[1] == 258, "encode with the library's ids");
        CHECK(nl_tokenizer_is_special(t, 0) && nl_tokenizer_is_special(t, 299) &&
                  !nl_tokenizer_is_native(t) && nl_tokenizer_vocab_size(t) == 300,
              "the special, the padded rows");
        free(ids);
        nl_tokenizer_destroy(&t);
    }
    free(text);
    CHECK(strstr(note, "byte-level BPE, 300 ids, 2 merges, Unicode classes"), "note: %s", note);
    /* rows fewer than the ids: refused */
    CHECK(nl_hf_tokenizer_parse(json, n, "tokenizer.json", 200, &text, note, sizeof note, &err) ==
                  NL_ERR_FORMAT &&
              strstr(err.msg, "an id past the model's rows"),
          "too few rows: %s", err.msg);
    static const struct {
        const char *from, *to, *want;
        nl_status st;
    } cases[] = {
        {"\"a b\"", "\"a q\"", "merges[0] 'a q': 'aq' is not in the vocabulary", NL_ERR_FORMAT},
        {"\"ab\": 257", "\"a b\": 257", "is not in GPT-2's byte alphabet", NL_ERR_UNSUPPORTED},
        {"\"type\": \"BPE\"", "\"type\": \"BPE\", \"byte_fallback\": true", "", NL_OK},
        {"\"type\": \"BPE\"", "\"type\": \"Unigram\"", "", NL_OK},
        {"\"add_prefix_space\": false", "\"add_prefix_space\": true", "", NL_OK},
        {"\"merges\": [", "\"merges\": 3, \"x\": [", "model.merges: not a list", NL_ERR_FORMAT},
    };
    static const char *notes[] = {"",
                                  "",
                                  "byte_fallback (SentencePiece's",
                                  "model Unigram",
                                  "pre_tokenizer ByteLevel other than GPT-2's",
                                  ""};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        static char bad[65536];
        const char *at = strstr(json, cases[i].from);
        size_t pre = (size_t)(at - json);
        int m = snprintf(bad, sizeof bad, "%.*s%s%s", (int)pre, json, cases[i].to,
                         at + strlen(cases[i].from));
        nl_status st = nl_hf_tokenizer_parse(bad, (size_t)m, "tokenizer.json", 300, &text, note,
                                             sizeof note, &err);
        CHECK(st == cases[i].st && (st != NL_OK || !text) &&
                  (st == NL_OK ? strstr(note, notes[i]) && strstr(note, "imported without")
                               : strstr(err.msg, cases[i].want) != NULL),
              "tokenizer.json case %zu: %s '%s' / note '%s'", i, nl_status_str(st), err.msg, note);
        free(text);
        text = NULL;
    }
    CHECK(nl_hf_tokenizer_parse("[1]", 3, "tokenizer.json", 300, &text, note, sizeof note, &err) ==
              NL_ERR_FORMAT,
          "not an object");
}

int main(void)
{
    snprintf(root, sizeof root, "%s/nl_test_hf.XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    test_rope();
    test_fill();
    test_good();
    test_bf16_and_tied();
    test_refused();
    test_window();
    test_tokenizer_json();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", root);
    return check_done("test_hf");
}
