/* Hugging Face import and export (core/hf.h): the tensor name and shape
 * mapping and the streaming conversion (the config.json mapping and the
 * RoPE permutation are core/hf_config.c). Sources are read with pread,
 * never mapped, so a conversion's memory is its largest tensor (twice for
 * q/k), not the model; the writer pulls each tensor through
 * nl_st_writer_add_fill. */
#include "hf.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chat_template.h"
#include "checkpoint.h"
#include "fileio.h"
#include "manifest.h"
#include "safetensors.h"
#include "tokenizer.h"

#define FAIL(st, ...) return nl_error_set(err, st, __VA_ARGS__)

/* ------------------------------------------------- tensor sources (pread) */

typedef struct src_file {
    char *path;
    int fd;
    uint64_t data_off; /* 8 + header length */
    nl_st_header *h;
} src_file;

typedef struct src_set {
    src_file *f;
    int n;
} src_set;

static void src_close(src_set *s)
{
    for (int i = 0; i < s->n; i++) {
        if (s->f[i].fd >= 0)
            close(s->f[i].fd);
        nl_st_header_destroy(&s->f[i].h);
        free(s->f[i].path);
    }
    free(s->f);
    s->f = NULL;
    s->n = 0;
}

static nl_status pread_all(int fd, void *buf, size_t n, uint64_t off, const char *path,
                           nl_error *err)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t r = pread(fd, p, n > (1u << 30) ? (1u << 30) : n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            FAIL(NL_ERR_IO, "%s: read: %s", path, strerror(errno));
        if (r == 0)
            FAIL(NL_ERR_IO, "%s: ends early (truncated while reading?)", path);
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return NL_OK;
}

/* Open `path` and parse its header (checked in full by the safetensors
 * parser); the data stays on disk. */
static nl_status src_add(src_set *s, const char *path, nl_error *err)
{
    src_file *f = realloc(s->f, (size_t)(s->n + 1) * sizeof *f);
    if (!f)
        FAIL(NL_ERR_NOMEM, "out of memory");
    s->f = f;
    f = &s->f[s->n];
    memset(f, 0, sizeof *f);
    f->fd = -1;
    s->n++;
    if (!(f->path = strdup(path)))
        FAIL(NL_ERR_NOMEM, "out of memory");
    if ((f->fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        FAIL(errno == ENOENT ? NL_ERR_NOTFOUND : NL_ERR_IO, "%s: %s", path,
             errno == ENOENT ? "no such file" : strerror(errno));
    struct stat sb;
    uint8_t len8[8];
    nl_status st;
    if (fstat(f->fd, &sb) != 0 || !S_ISREG(sb.st_mode))
        FAIL(NL_ERR_IO, "%s: not a regular file", path);
    uint64_t size = (uint64_t)sb.st_size, n = 0;
    if (size < 8)
        FAIL(NL_ERR_FORMAT, "%s: %" PRIu64 " bytes is too short for a safetensors file", path,
             size);
    if ((st = pread_all(f->fd, len8, 8, 0, path, err)))
        return st;
    for (int i = 0; i < 8; i++)
        n |= (uint64_t)len8[i] << (8 * i);
    if (n > NL_ST_MAX_HEADER)
        FAIL(NL_ERR_LIMIT, "%s: header of %" PRIu64 " bytes is above the limit", path, n);
    if (8 + n > size)
        FAIL(NL_ERR_FORMAT, "%s: header length %" PRIu64 " runs past the end of the file", path, n);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf)
        FAIL(NL_ERR_NOMEM, "out of memory");
    if (!(st = pread_all(f->fd, buf, n, 8, path, err)) &&
        (st = nl_st_parse_header(buf, n, size - 8 - n, &f->h, err)))
        nl_error_prefix(err, "%s", path);
    free(buf);
    f->data_off = 8 + n;
    return st;
}

static const nl_st_entry *src_find(const src_set *s, const char *name, int *fi)
{
    for (int i = 0; i < s->n; i++) {
        const nl_st_entry *e = nl_st_header_find(s->f[i].h, name);
        if (e) {
            *fi = i;
            return e;
        }
    }
    return NULL;
}

static float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, u;
    if (e == 31)
        u = sign | 0x7f800000u | (m << 13);
    else if (e)
        u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m)
        u = sign;
    else { /* subnormal: normalise */
        e = 113;
        while (!(m & 1024)) {
            m <<= 1;
            e--;
        }
        u = sign | (e << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Read the first `rows` rows of tensor e as F32 into dst. A 2-byte source
 * is read into the upper half of dst and widened front to back in place
 * (element i's 4 bytes never reach an unread element's 2). */
static nl_status src_read(const src_set *s, int fi, const nl_st_entry *e, int64_t rows, float *dst,
                          uint64_t *bytes_in, nl_error *err)
{
    const src_file *f = &s->f[fi];
    int64_t cols = 1;
    for (int d = 1; d < e->ndim; d++)
        cols *= e->shape[d];
    size_t n = (size_t)(rows * cols), w = nl_dtype_size(e->dtype);
    uint8_t *raw = (uint8_t *)dst + (w == 2 ? 2 * n : 0);
    nl_status st = pread_all(f->fd, raw, n * w, f->data_off + e->offset, f->path, err);
    if (st)
        return st;
    *bytes_in += n * w;
    for (size_t i = 0; w == 2 && i < n; i++) {
        uint16_t h = (uint16_t)(raw[2 * i] | raw[2 * i + 1] << 8);
        dst[i] = e->dtype == NL_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
    return NL_OK;
}

/* ------------------------------------------------------- the name mapping */

/* One tensor to convert: our name and the Hugging Face one, the HF shape
 * [rows, cols] (cols = 0 for a vector), our rows (the capacity for the
 * tables), and where it is read from. */
typedef struct hf_job {
    char ours[96], hf[128];
    int64_t rows, cols, our_rows;
    int rope_heads;   /* q/k: heads whose rows are permuted */
    const char *dims; /* the config keys behind the shape */
    struct hf_conv *conv;
    int fi;
    const nl_st_entry *e;
} hf_job;

typedef struct hf_conv {
    const nl_config *cfg;
    int to_ours;
    src_set src;
    hf_job *jobs;
    int n_jobs;
    float *tmp; /* rows of a q/k tensor before the permutation */
    nl_hf_stats *stats;
} hf_conv;

static void job(hf_job *j, const char *ours, const char *hf, int64_t rows, int64_t cols,
                int64_t our_rows, int rope, const char *dims)
{
    snprintf(j->ours, sizeof j->ours, "%s", ours);
    snprintf(j->hf, sizeof j->hf, "%s", hf);
    j->rows = rows;
    j->cols = cols;
    j->our_rows = our_rows;
    j->rope_heads = rope;
    j->dims = dims;
}

/* Every tensor of the model, in our checkpoint's order. */
static nl_status build_jobs(hf_conv *c, nl_error *err)
{
    const nl_config *k = c->cfg;
    int64_t d = k->hidden_dim, hd = nl_config_head_dim(k), F = k->ffn_dim;
    int64_t V = k->vocab_size, C = nl_config_capacity(k);
    int n = 3 + k->num_layers * (7 + 3 * k->num_experts);
    if (!(c->jobs = calloc((size_t)n, sizeof *c->jobs)))
        FAIL(NL_ERR_NOMEM, "out of memory");
    hf_job *j = c->jobs;
    char a[96], b[128];
    job(j++, "tok_embeddings.weight", "model.embed_tokens.weight", V, d, C, 0,
        "[vocab_size, hidden_size]");
    for (int l = 0; l < k->num_layers; l++) {
        static const struct {
            const char *ours, *hf, *dims;
            int rows, cols; /* 0 d, 1 H hd, 2 G hd, 3 E, 4 vector */
            int rope;
        } t[] = {
            {"attention_norm", "input_layernorm", "[hidden_size]", 0, 4, 0},
            {"attention.wq", "self_attn.q_proj", "[num_attention_heads * head_dim, hidden_size]", 1,
             0, 1},
            {"attention.wk", "self_attn.k_proj", "[num_key_value_heads * head_dim, hidden_size]", 2,
             0, 2},
            {"attention.wv", "self_attn.v_proj", "[num_key_value_heads * head_dim, hidden_size]", 2,
             0, 0},
            {"attention.wo", "self_attn.o_proj", "[hidden_size, num_attention_heads * head_dim]", 0,
             1, 0},
            {"ffn_norm", "post_attention_layernorm", "[hidden_size]", 0, 4, 0},
            {"moe.router", "block_sparse_moe.gate", "[num_local_experts, hidden_size]", 3, 0, 0},
        };
        const size_t n_t = sizeof t / sizeof t[0] - (nl_config_dense(k) ? 1 : 0); /* no router */
        int64_t sz[5] = {d, k->num_heads * hd, k->num_kv_heads * hd, k->num_experts, 0};
        for (size_t i = 0; i < n_t; i++) {
            snprintf(a, sizeof a, "layers.%d.%s.weight", l, t[i].ours);
            snprintf(b, sizeof b, "model.layers.%d.%s.weight", l, t[i].hf);
            int rope = t[i].rope == 1 ? k->num_heads : t[i].rope == 2 ? k->num_kv_heads : 0;
            job(j++, a, b, sz[t[i].rows], sz[t[i].cols], sz[t[i].rows], rope, t[i].dims);
        }
        for (int e = 0; e < k->num_experts; e++) {
            static const char *ours[3] = {"w_gate", "w_up", "w_down"}, *hf[3] = {"w1", "w3", "w2"},
                              *mlp[3] = {"gate_proj", "up_proj", "down_proj"};
            for (int w = 0; w < 3; w++) {
                snprintf(a, sizeof a, "layers.%d.moe.experts.%d.%s.weight", l, e, ours[w]);
                if (nl_config_dense(k)) /* Llama's MLP is our expert 0 */
                    snprintf(b, sizeof b, "model.layers.%d.mlp.%s.weight", l, mlp[w]);
                else
                    snprintf(b, sizeof b, "model.layers.%d.block_sparse_moe.experts.%d.%s.weight",
                             l, e, hf[w]);
                job(j++, a, b, w == 2 ? d : F, w == 2 ? F : d, w == 2 ? d : F, 0,
                    w == 2 ? "[hidden_size, intermediate_size]"
                           : "[intermediate_size, hidden_size]");
            }
        }
    }
    job(j++, "norm.weight", "model.norm.weight", d, 0, d, 0, "[hidden_size]");
    job(j++, "lm_head.weight", "lm_head.weight", V, d, C, 0, "[vocab_size, hidden_size]");
    c->n_jobs = (int)(j - c->jobs);
    for (int i = 0; i < c->n_jobs; i++)
        c->jobs[i].conv = c;
    return NL_OK;
}

static const char *fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t o = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && o < n; i++)
        o += (size_t)snprintf(buf + o, n - o, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (o < n)
        snprintf(buf + o, n - o, "]");
    return buf;
}

/* Find a job's source tensor (its HF name on import, ours on export) and
 * check its dtype and shape (rows at least `rows`: our tables may have
 * spare capacity). */
static nl_status resolve(hf_conv *c, hf_job *j, const char *name, int64_t rows, int exact,
                         nl_error *err)
{
    j->e = src_find(&c->src, name, &j->fi);
    if (!j->e && c->to_ours)
        FAIL(NL_ERR_NOTFOUND,
             "tensor '%s' is missing (%s), though config.json asks for it (num_hidden_layers %d, "
             "num_local_experts %d)",
             name, c->src.n == 1 ? c->src.f[0].path : "in none of the weight files",
             c->cfg->num_layers, c->cfg->num_experts);
    if (!j->e)
        FAIL(NL_ERR_NOTFOUND, "tensor '%s' is missing (%s)", name,
             c->src.n == 1 ? c->src.f[0].path : "in none of the shards");
    const nl_st_entry *e = j->e;
    const char *path = c->src.f[j->fi].path;
    if (e->dtype != NL_DTYPE_F32 &&
        (!c->to_ours || (e->dtype != NL_DTYPE_BF16 && e->dtype != NL_DTYPE_F16)))
        FAIL(NL_ERR_DTYPE, "%s: tensor '%s': dtype %s is not one this reads (%s)", path, name,
             nl_dtype_name(e->dtype), c->to_ours ? "F32, BF16, F16" : "F32");
    int ndim = j->cols ? 2 : 1;
    int ok = e->ndim == ndim && (exact ? e->shape[0] == rows : e->shape[0] >= rows) &&
             (ndim == 1 || e->shape[1] == j->cols);
    if (!ok) {
        char got[128];
        FAIL(NL_ERR_SHAPE,
             "%s: tensor '%s': shape %s, but the config says [%" PRId64 "%s%.0" PRId64 "] %s", path,
             name, fmt_shape(got, sizeof got, e->ndim, e->shape), rows, ndim == 2 ? ", " : "",
             ndim == 2 ? j->cols : 0, j->dims);
    }
    return NL_OK;
}

/* The writer's fill: read the job's source rows as F32 and permute q/k. */
static nl_status fill(void *ctx, void *dst, uint64_t nbytes, nl_error *err)
{
    hf_job *j = ctx;
    hf_conv *c = j->conv;
    int64_t cols = j->cols ? j->cols : 1;
    int64_t rows = j->rows; /* both directions copy the HF rows (our spare capacity: zeros) */
    float *out = dst;
    nl_status st;
    if (j->rope_heads)
        out = c->tmp;
    if ((st = src_read(&c->src, j->fi, j->e, rows, out, &c->stats->bytes_in, err)))
        return st;
    if (j->rope_heads)
        nl_hf_rope_permute(dst, out, j->rope_heads, nl_config_head_dim(c->cfg), cols, c->to_ours);
    /* Our table rows past the vocabulary (capacity) start at zero. */
    uint64_t used = (uint64_t)(rows * cols) * sizeof(float);
    if (nbytes > used)
        memset((uint8_t *)dst + used, 0, nbytes - used);
    if (j->e->dtype != NL_DTYPE_F32) {
        if (!c->stats->converted++)
            snprintf(c->stats->converted_from, sizeof c->stats->converted_from, "%s",
                     nl_dtype_name(j->e->dtype));
    }
    c->stats->n_tensors++;
    c->stats->bytes_out += nbytes;
    return NL_OK;
}

/* Room for the largest q/k tensor before its permutation. */
static nl_status alloc_tmp(hf_conv *c, nl_error *err)
{
    size_t most = 0;
    for (int i = 0; i < c->n_jobs; i++)
        if (c->jobs[i].rope_heads && (size_t)(c->jobs[i].rows * c->jobs[i].cols) > most)
            most = (size_t)(c->jobs[i].rows * c->jobs[i].cols);
    if (most && !(c->tmp = malloc(most * sizeof(float))))
        FAIL(NL_ERR_NOMEM, "out of memory");
    return NL_OK;
}

static void conv_free(hf_conv *c)
{
    src_close(&c->src);
    free(c->jobs);
    free(c->tmp);
}

/* ----------------------------------------------------------------- import */

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int plain_name(const char *s)
{
    return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0 &&
           strlen(s) < 256;
}

/* Open the weights: model.safetensors.index.json (each shard it names,
 * each tensor in the shard it says), else model.safetensors. */
static nl_status open_hf_weights(hf_conv *c, const char *dir, nl_error *err)
{
    char *ipath = join(dir, "model.safetensors.index.json"), *text = NULL;
    json_t *root = NULL;
    nl_status st = NL_OK;
    size_t len;
    struct stat sb;
    if (!ipath)
        FAIL(NL_ERR_NOMEM, "out of memory");
    if (stat(ipath, &sb) != 0) {
        char *single = join(dir, "model.safetensors");
        st = single ? src_add(&c->src, single, err) : NL_ERR_NOMEM;
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
            char *p = join(dir, file);
            st = p ? src_add(&c->src, p, err) : NL_ERR_NOMEM;
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
            FAIL(NL_ERR_FORMAT,
                 "%s: tensor '%.80s' is not part of a MixtralForCausalLM of this config.json "
                 "(num_hidden_layers %d, num_local_experts %d)",
                 c->src.f[fi].path, name, c->cfg->num_layers, c->cfg->num_experts);
        }
    return NL_OK;
}

nl_status nl_hf_import(const char *dir, const char *out, nl_hf_stats *stats, nl_error *err)
{
    nl_hf_stats dummy;
    nl_config cfg;
    hf_conv c = {.cfg = &cfg, .to_ours = 1, .stats = stats ? stats : &dummy};
    memset(c.stats, 0, sizeof *c.stats);
    char *cpath = join(dir, "config.json"), *text = NULL, *cfg_json = NULL, *chat = NULL;
    nl_st_writer *w = NULL;
    int tied = 0;
    size_t len;
    nl_status st;
    if (!cpath)
        return nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    if ((st = nl_file_read_all(cpath, NL_HF_MAX_JSON, &text, &len, err)) ||
        (st = nl_hf_config_parse(&cfg, &tied, text, len, cpath, err)) ||
        (st = open_hf_weights(&c, dir, err)) || (st = build_jobs(&c, err)) ||
        (st = nl_chat_template_read_hf(dir, &chat, c.stats->chat_family, c.stats->chat_warning,
                                       err)))
        goto out;
    for (int i = 0; i < c.n_jobs; i++) {
        hf_job *j = &c.jobs[i];
        int from_embed = tied && strcmp(j->ours, "lm_head.weight") == 0;
        if ((st =
                 resolve(&c, j, from_embed ? "model.embed_tokens.weight" : j->hf, j->rows, 1, err)))
            goto out;
    }
    c.stats->tied = tied;
    c.stats->n_files = c.src.n;
    if ((st = check_unused(&c, tied, err)) || (st = alloc_tmp(&c, err)))
        goto out;
    if (!(w = nl_st_writer_new()) || !(cfg_json = nl_config_to_json(&cfg))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < c.n_jobs && !st; i++) {
        hf_job *j = &c.jobs[i];
        int64_t shape[2] = {j->our_rows, j->cols};
        st = nl_st_writer_add_fill(w, j->ours, NL_DTYPE_F32, j->cols ? 2 : 1, shape, fill, j, err);
    }
    if (!st && !(st = nl_st_writer_set_meta(w, "format", NL_CHECKPOINT_FORMAT, err)) &&
        !(st = nl_st_writer_set_meta(w, "config", cfg_json, err)) &&
        !(st = nl_st_writer_set_meta(w, "step", "0", err)) &&
        !(chat && (st = nl_st_writer_set_meta(w, "chat_template", chat, err))))
        st = nl_st_writer_write(w, out, err);
out:
    nl_st_writer_destroy(&w);
    conv_free(&c);
    free(chat);
    free(cfg_json);
    free(text);
    free(cpath);
    return st;
}

/* ----------------------------------------------------------------- export */

/* GPT-2's printable stand-ins for bytes (bytes_to_unicode), as UTF-8. */
static size_t byte_char(uint8_t b, char out[3])
{
    unsigned cp = b;
    if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174))) {
        unsigned n = 0; /* the rank of b among the bytes that are remapped */
        for (unsigned x = 0; x < b; x++)
            n += !((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174));
        cp = 256 + n;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xc0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 63));
    return 2;
}

/* A token as GPT-2's vocab.json spells it (special ids: their names). */
static char *token_string(const nl_tokenizer *t, int32_t id)
{
    const uint8_t *p;
    size_t n;
    if (nl_tokenizer_token_bytes(t, id, &p, &n) != NL_OK)
        return NULL;
    char *s = malloc(2 * n + 1), *o = s;
    if (!s)
        return NULL;
    for (size_t i = 0; i < n; i++)
        o += nl_tokenizer_is_special(id) ? (*o = (char)p[i], 1) : byte_char(p[i], o);
    *o = '\0';
    return s;
}

/* vocab.json, merges.txt (GPT-2's byte-level BPE files) and our own
 * tokenizer file, written to `written` (paths added for cleanup). */
static nl_status write_vocab(const char *dir, const char *tok_text, char **written, int *n_written,
                             nl_error *err)
{
    nl_tokenizer *t = NULL;
    json_t *vocab = json_object();
    char *vj = NULL, *merges = NULL, *p = NULL;
    size_t cap = 64, len = 0;
    nl_status st = nl_tokenizer_load_buffer(&t, tok_text, strlen(tok_text), err);
    if (st) {
        nl_error_prefix(err, "the source's tokenizer");
        goto out;
    }
    merges = malloc(cap);
    if (!vocab || !merges)
        goto nomem;
    len = (size_t)snprintf(merges, cap, "#version: 0.2\n");
    for (int32_t id = 0; id < nl_tokenizer_vocab_size(t); id++) {
        char *s = token_string(t, id);
        if (!s || json_object_set_new(vocab, s, json_integer(id)) != 0) {
            free(s);
            goto nomem;
        }
        free(s);
        int32_t a, b;
        if (id < NL_TOKEN_FIRST_MERGE)
            continue;
        nl_tokenizer_merge_pair(t, id, &a, &b);
        char *sa = token_string(t, a), *sb = token_string(t, b);
        size_t need = sa && sb ? strlen(sa) + strlen(sb) + 3 : 0;
        char *m = need && len + need > cap ? realloc(merges, cap = 2 * (len + need)) : merges;
        if (m)
            merges = m;
        if (need && m)
            len += (size_t)snprintf(merges + len, cap - len, "%s %s\n", sa, sb);
        free(sa);
        free(sb);
        if (!need || !m)
            goto nomem;
    }
    if (!(vj = json_dumps(vocab, JSON_COMPACT | JSON_ENSURE_ASCII)))
        goto nomem;
    static const char *names[3] = {"vocab.json", "merges.txt", "neurollm-tokenizer.txt"};
    const char *bufs[3] = {vj, merges, tok_text};
    for (int i = 0; i < 3 && !st; i++) {
        if (!(p = join(dir, names[i])))
            goto nomem;
        if (!(st = nl_file_write_atomic(p, bufs[i], strlen(bufs[i]), err))) {
            written[(*n_written)++] = p;
            p = NULL;
        }
        free(p);
        p = NULL;
    }
    goto out;
nomem:
    st = nl_error_set(err, NL_ERR_NOMEM, "out of memory writing the vocabulary");
out:
    nl_tokenizer_destroy(&t);
    json_decref(vocab);
    free(vj);
    free(merges);
    return st;
}

/* The source: a checkpoint, or a verified manifest's shards. */
/* The options of DESIGN section 6 that Mixtral's and Llama's layouts do
 * not have: refused by name (the dense FFN is Llama's). */
static nl_status hf_representable(const nl_config *c, const char *src, nl_error *err)
{
    const char *key = !c->causal                             ? "causal: false (an encoder)"
                      : c->ffn_act != NL_FFN_SWIGLU          ? "ffn_act: geglu"
                      : c->attention_window > 0              ? "attention_window"
                      : c->rope_scaling.type != NL_ROPE_NONE ? "rope_scaling"
                      : c->num_classes > 0                   ? "num_classes (a classifier head)"
                                                             : NULL;
    if (key)
        FAIL(NL_ERR_UNSUPPORTED,
             "%s: config %s has no place in the MixtralForCausalLM or LlamaForCausalLM layout", src,
             key);
    return NL_OK;
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
                st = src_add(&c->src, m->shards[i].path, err);
            if (!st && ((m->tokenizer && !(*tokenizer = strdup(m->tokenizer))) ||
                        (m->chat_template && !(*chat = strdup(m->chat_template)))))
                st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        }
        nl_manifest_destroy(&m);
        return st;
    }
    if ((st = src_add(&c->src, src, err)))
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
        st = nl_st_writer_add_fill(w, j->hf, NL_DTYPE_F32, j->cols ? 2 : 1, shape, fill, j, err);
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
        if (!(p = join(dir, name)))
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
        char *p = join(dir, "model.safetensors.index.json");
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
        (st = hf_representable(&cfg, src, err)) || (st = build_jobs(&c, err)))
        goto out;
    for (int i = 0; i < c.n_jobs && !st; i++)
        st = resolve(&c, &c.jobs[i], c.jobs[i].ours, c.jobs[i].our_rows, 1, err);
    if (st || (st = alloc_tmp(&c, err)))
        goto out;
    /* Room for every weight file, the index and four small files. */
    if (!(written = calloc((size_t)c.n_jobs + 8, sizeof *written)) ||
        !(cj = nl_hf_config_to_json(&cfg, tok != NULL))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    if ((st = check_out_dir(dir, force, &created, &n_before, err)) ||
        (st = write_weights(&c, dir, shard_bytes ? shard_bytes : NL_HF_SHARD_DEFAULT, written,
                            &n_written, err)) ||
        (tok && (st = write_vocab(dir, tok, written, &n_written, err))))
        goto out;
    c.stats->has_tokenizer = tok != NULL;
    char *p = join(dir, "config.json");
    if (!p)
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    else if ((st = nl_file_write_atomic(p, cj, strlen(cj), err)))
        free(p);
    else
        written[n_written++] = p;
    c.stats->vocab_size = cfg.vocab_size;
    if (!st && !(st = nl_chat_template_write_hf(dir, chat, &c.stats->chat_written, err)) &&
        c.stats->chat_written && !(written[n_written++] = join(dir, "tokenizer_config.json")))
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
    conv_free(&c);
    free(cj);
    free(tok);
    free(chat);
    return st;
}
