/* neuroctl embed: one embedding per line of text (DESIGN.md section 7):
 * the mean over the valid positions of the final-normed states,
 * L2-normalised. Lines are cut to --seq ids and run in batches padded with
 * id 0, the pads a document of their own, so an encoder's embedding of a
 * text does not depend on what it was batched with. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "cli_io.h"
#include "commands.h"
#include "core/checkpoint.h"
#include "core/fileio.h"
#include "core/forward.h"
#include "core/lora.h"
#include "core/safetensors.h"
#include "core/tokenizer.h"

/* Largest input file: 1 GiB of text. */
#define EMBED_MAX_BYTES (1u << 30)

/* Every line's ids (bytes when tok is NULL), cut to T: ids (n_lines, T)
 * padded with 0, lengths (n_lines, at least 1). */
static nl_status encode_lines(char *text, size_t len, nl_tokenizer *tok, int T, int64_t vocab,
                              int32_t **ids, int32_t **lengths, int *n_lines, nl_error *err)
{
    int n = 0, cap = 0;
    int32_t *v = NULL, *l = NULL, *buf = malloc(((size_t)len + 1) * sizeof *buf);
    nl_status st = buf ? NL_OK : nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    for (size_t i = 0; st == NL_OK && i < len;) {
        size_t e = i;
        while (e < len && text[e] != '\n')
            e++;
        size_t got = 0;
        if (tok) {
            st = nl_tokenizer_encode_into(tok, text + i, e - i, buf, len + 1, &got, err);
        } else {
            for (size_t c = i; c < e; c++)
                buf[got++] = (uint8_t)text[c];
        }
        if (st == NL_OK && n == cap) {
            cap = cap ? 2 * cap : 64;
            int32_t *nv = realloc(v, (size_t)cap * T * sizeof *v), *nl = NULL;
            if (nv)
                v = nv;
            if (nv && (nl = realloc(l, (size_t)cap * sizeof *l)))
                l = nl;
            if (!nv || !nl)
                st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        }
        if (st != NL_OK)
            break;
        got = got > (size_t)T ? (size_t)T : got;
        memset(v + (size_t)n * T, 0, (size_t)T * sizeof *v);
        for (size_t c = 0; c < got; c++) {
            if (buf[c] >= vocab) {
                st = nl_error_set(err, NL_ERR_RANGE, "line %d: id %d is outside the vocabulary",
                                  n + 1, buf[c]);
                break;
            }
            v[(size_t)n * T + c] = buf[c];
        }
        l[n++] = got > 0 ? (int32_t)got : 1; /* an empty line: one pad */
        i = e + 1;
    }
    free(buf);
    if (st == NL_OK && n == 0)
        st = nl_error_set(err, NL_ERR_FORMAT, "no lines to embed");
    if (st != NL_OK) {
        free(v);
        free(l);
        return st;
    }
    *ids = v;
    *lengths = l;
    *n_lines = n;
    return NL_OK;
}

/* Mean of the first len rows of states (T, d), L2-normalised, into out. */
static void pool(float *out, const float *states, int len, int d)
{
    double norm = 0.0;
    for (int c = 0; c < d; c++) {
        double s = 0.0;
        for (int t = 0; t < len; t++)
            s += states[(size_t)t * d + c];
        out[c] = (float)(s / len);
        norm += (double)out[c] * out[c];
    }
    const float inv = norm > 0.0 ? (float)(1.0 / sqrt(norm)) : 0.0f;
    for (int c = 0; c < d; c++)
        out[c] *= inv;
}

int nl_cmd_embed(int argc, char **argv)
{
    nl_flag flags[] = {
        {"model", 1, "checkpoint (safetensors)", NULL},
        {"input", 1, "text file: one text per line (through the model's tokenizer, else bytes)",
         NULL},
        {"out", 1, "output: 'embeddings' F32 [lines, hidden_dim], L2-normalised", NULL},
        {"seq", 1, "ids kept per line (default: the model's max_seq_len)", NULL},
        {"batch", 1, "lines per forward pass (default 16)", NULL},
        {"adapter", 1, "LoRA adapter file to apply (neuroctl finetune --out)", NULL},
        {"threads", 1, "worker threads (default: all cores)", NULL},
        NL_CLI_DEVICE_FLAG,
        {0}};
    const char *usage = "neuroctl embed --model MODEL --input TEXTS --out EMB.safetensors "
                        "[--seq T] [--batch B] [--adapter A] [--threads N] [--device D]";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *model = nl_args_get(flags, "model"), *in = nl_args_get(flags, "input"),
               *out = nl_args_get(flags, "out"), *device = NULL;
    long long threads = 0, seq = 0, batch = 16;
    int tf32 = 0, bf16 = 0, n = 0;
    if (!model || !in || !out) {
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if ((rc = nl_args_int(flags, "threads", 0, 1024, &threads)) ||
        (rc = nl_args_int(flags, "seq", 1, 1 << 20, &seq)) ||
        (rc = nl_args_int(flags, "batch", 1, 4096, &batch)) ||
        (rc = nl_cli_device_flags(flags, &device, &tf32, &bf16)))
        return rc;
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL;
    nl_runstate *rs = NULL;
    nl_lora *lo = NULL;
    nl_tokenizer *tok = NULL;
    nl_st_writer *w = NULL;
    char *text = NULL, *tok_text = NULL;
    size_t len = 0;
    int32_t *ids = NULL, *lengths = NULL, *doc = NULL;
    float *emb = NULL, *states = NULL;
    rc = 1;
    if (nl_cli_backend_new(&be, device, (int)threads, tf32, bf16, 0, &err) != NL_OK ||
        nl_checkpoint_load(&m, be, model, 0, -1, 1, 1, NULL, &err) != NL_OK ||
        nl_checkpoint_meta(model, "tokenizer", &tok_text, &err) != NL_OK ||
        (tok_text && nl_tokenizer_load_buffer(&tok, tok_text, strlen(tok_text), &err) != NL_OK) ||
        nl_file_read_all(in, EMBED_MAX_BYTES, &text, &len, &err) != NL_OK)
        goto out;
    const int T = (int)(seq > 0 && seq < m->cfg.max_seq_len ? seq : m->cfg.max_seq_len);
    const int d = m->cfg.hidden_dim, Bmax = (int)batch;
    const char *adapter = nl_args_get(flags, "adapter");
    if (adapter && nl_lora_load(&lo, m, adapter, Bmax * T, &err) != NL_OK)
        goto out;
    if (encode_lines(text, len, tok, T, m->cfg.vocab_size, &ids, &lengths, &n, &err) != NL_OK ||
        nl_runstate_new(&rs, m, Bmax * T, &err) != NL_OK) {
        nl_error_prefix(&err, "%s", in);
        goto out;
    }
    emb = malloc((size_t)n * d * sizeof *emb);
    states = malloc((size_t)Bmax * T * d * sizeof *states);
    doc = malloc((size_t)Bmax * T * sizeof *doc);
    if (!emb || !states || !doc) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int b0 = 0; b0 < n; b0 += Bmax) {
        const int B = n - b0 < Bmax ? n - b0 : Bmax;
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++)
                doc[(size_t)b * T + t] = t >= lengths[b0 + b];
        /* a decoder's valid positions never see the pads that follow them */
        nl_forward_args a = {.B = B,
                             .T = T,
                             .tokens = ids + (size_t)b0 * T,
                             .doc = m->cfg.causal ? NULL : doc,
                             .states = 1};
        if (nl_forward(m, rs, &a, NULL, &err) != NL_OK)
            goto out;
        be->download(be, states, nl_runstate_output(rs, NULL), (size_t)B * T * d * sizeof *states);
        if (nl_cli_device_check(be, &err) != NL_OK)
            goto out;
        for (int b = 0; b < B; b++)
            pool(emb + (size_t)(b0 + b) * d, states + (size_t)b * T * d, lengths[b0 + b], d);
    }
    const int64_t shape[2] = {n, d};
    if (!(w = nl_st_writer_new())) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (nl_st_writer_add(w, "embeddings", NL_DTYPE_F32, 2, shape, emb, &err) != NL_OK ||
        nl_st_writer_write(w, out, &err) != NL_OK)
        goto out;
    fprintf(stderr, "wrote %s: %d embeddings of %d\n", out, n, d);
    rc = 0;
out:
    nl_st_writer_destroy(&w);
    free(text);
    free(tok_text);
    free(ids);
    free(lengths);
    free(doc);
    free(emb);
    free(states);
    nl_tokenizer_destroy(&tok);
    nl_runstate_destroy(&rs);
    nl_lora_destroy(&lo);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    if (rc)
        fprintf(stderr, "neuroctl embed: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}
