/* Hugging Face interchange (core/formats/hf.h), the part both directions share:
 * tensor sources read with pread (never mapped, so a conversion's memory
 * is its largest tensor, twice for q/k, not the model), the name and
 * shape mapping between our checkpoint and a Mixtral/Llama one, and the
 * writer's fill that converts one tensor. The directions are
 * core/formats/hf_import.c and core/formats/hf_export.c; the config.json mapping and the
 * RoPE permutation core/formats/hf_config.c. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/formats/hf_impl.h"

#define FAIL HF_FAIL

/* ------------------------------------------------- tensor sources (pread) */

void hf_src_close(src_set *s)
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
nl_status hf_src_add(src_set *s, const char *path, nl_error *err)
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
nl_status hf_build_jobs(hf_conv *c, nl_error *err)
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
nl_status hf_resolve(hf_conv *c, hf_job *j, const char *name, int64_t rows, int exact,
                     nl_error *err)
{
    j->e = src_find(&c->src, name, &j->fi);
    if (!j->e && c->to_ours && nl_config_dense(c->cfg))
        FAIL(NL_ERR_NOTFOUND,
             "tensor '%s' is missing (%s), though config.json asks for it (a %s, "
             "num_hidden_layers %d)",
             name, c->src.n == 1 ? c->src.f[0].path : "in none of the weight files", c->arch,
             c->cfg->num_layers);
    if (!j->e && c->to_ours)
        FAIL(NL_ERR_NOTFOUND,
             "tensor '%s' is missing (%s), though config.json asks for it (a %s, "
             "num_hidden_layers %d, num_local_experts %d)",
             name, c->src.n == 1 ? c->src.f[0].path : "in none of the weight files", c->arch,
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
nl_status hf_fill(void *ctx, void *dst, uint64_t nbytes, nl_error *err)
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
nl_status hf_alloc_tmp(hf_conv *c, nl_error *err)
{
    size_t most = 0;
    for (int i = 0; i < c->n_jobs; i++)
        if (c->jobs[i].rope_heads && (size_t)(c->jobs[i].rows * c->jobs[i].cols) > most)
            most = (size_t)(c->jobs[i].rows * c->jobs[i].cols);
    if (most && !(c->tmp = malloc(most * sizeof(float))))
        FAIL(NL_ERR_NOMEM, "out of memory");
    return NL_OK;
}

void hf_conv_free(hf_conv *c)
{
    hf_src_close(&c->src);
    free(c->jobs);
    free(c->tmp);
}

char *hf_join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}
