/* neuroctl embed: one embedding per line of text (DESIGN.md section 7):
 * the mean over the valid positions of the final-normed states,
 * L2-normalised (core/model/embed.h). Lines are cut to --seq ids and run in
 * batches padded with id 0, the pads a document of their own, so an
 * encoder's embedding of a text does not depend on what it was batched
 * with. In this process (--model), or through a cluster (--cluster or
 * --coordinator: one embed job per batch, the last stage pools). */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "cli/remote.h"
#include "core/formats/checkpoint.h"
#include "core/formats/fileio.h"
#include "core/formats/safetensors.h"
#include "core/model/embed.h"
#include "core/model/forward.h"
#include "core/model/lora.h"
#include "core/tokenizer/tokenizer.h"

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
    const char *usage =
        "neuroctl embed --model MODEL --input TEXTS --out EMB.safetensors "
        "[--seq T] [--batch B] [--adapter A] [--threads N] [--device D]"
        "\n  on a cluster: neuroctl embed --cluster DIR (or --coordinator EP --key K "
        "--coordinator-key P) --input TEXTS --out EMB.safetensors [--seq T] "
        "[--batch B] (neuroctl embed --cluster x --help lists its flags)";
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
    int32_t *ids = NULL, *lengths = NULL, *doc = NULL, *run_ids = NULL, *run_len = NULL;
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
    /* every forward runs at least NL_BACKEND_FUSED_ROWS positions, a
     * small batch padded with rows of pads: below that the backends
     * compute y = x W^T with their decode kernel (the CPU's dot kernel),
     * whose bits differ from the kernel above, so a line's embedding
     * would depend on its batch where B T is small (--seq 8) */
    const int Bmin = (NL_BACKEND_FUSED_ROWS + T - 1) / T;
    const int Brun = Bmax > Bmin ? Bmax : Bmin;
    const char *adapter = nl_args_get(flags, "adapter");
    if (adapter && (nl_lora_check_base(adapter, model, &err) != NL_OK ||
                    nl_lora_load(&lo, m, adapter, Brun * T, &err) != NL_OK))
        goto out;
    if (encode_lines(text, len, tok, T, m->cfg.vocab_size, &ids, &lengths, &n, &err) != NL_OK ||
        nl_runstate_new(&rs, m, Brun * T, &err) != NL_OK) {
        nl_error_prefix(&err, "%s", in);
        goto out;
    }
    emb = malloc((size_t)n * d * sizeof *emb);
    states = malloc((size_t)Brun * T * d * sizeof *states);
    doc = malloc((size_t)Brun * T * sizeof *doc);
    run_ids = calloc((size_t)Brun * T, sizeof *run_ids);
    run_len = malloc((size_t)Brun * sizeof *run_len);
    if (!emb || !states || !doc || !run_ids || !run_len) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int b0 = 0; b0 < n; b0 += Bmax) {
        const int B = n - b0 < Bmax ? n - b0 : Bmax, Br = B > Bmin ? B : Bmin;
        memcpy(run_ids, ids + (size_t)b0 * T, (size_t)B * T * sizeof *run_ids);
        memset(run_ids + (size_t)B * T, 0, (size_t)(Br - B) * T * sizeof *run_ids);
        memcpy(run_len, lengths + b0, (size_t)B * sizeof *run_len);
        for (int b = B; b < Br; b++)
            run_len[b] = 1; /* a padding row: one pad, the rest their own */
        nl_embed_doc(doc, run_len, Br, T);
        /* a decoder's valid positions never see the pads that follow them */
        nl_forward_args a = {
            .B = Br, .T = T, .tokens = run_ids, .doc = m->cfg.causal ? NULL : doc, .states = 1};
        if (nl_forward(m, rs, &a, NULL, &err) != NL_OK)
            goto out;
        be->download(be, states, nl_runstate_output(rs, NULL), (size_t)B * T * d * sizeof *states);
        if (nl_cli_device_check(be, &err) != NL_OK)
            goto out;
        for (int b = 0; b < B; b++)
            nl_embed_pool(emb + (size_t)(b0 + b) * d, states + (size_t)b * T * d, lengths[b0 + b],
                          d);
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
    free(run_ids);
    free(run_len);
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

/* ---------------------------------------------------------------- on a cluster */

/* The cluster's tokenizer (bytes when its model has none), vocabulary,
 * context and width, from its status. */
static nl_status cluster_model(nl_remote *r, nl_tokenizer **tok, int64_t *vocab, int *max_seq,
                               int *d, nl_error *err)
{
    json_t *st = NULL;
    nl_status s = nl_remote_status(r, &st, err);
    if (s != NL_OK)
        return s;
    const json_t *cfg = json_object_get(st, "config"), *tk = json_object_get(st, "tokenizer");
    *vocab = json_integer_value(json_object_get(cfg, "vocab_size"));
    *max_seq = (int)json_integer_value(json_object_get(cfg, "max_seq_len"));
    *d = (int)json_integer_value(json_object_get(cfg, "hidden_dim"));
    if (*vocab < 1 || *max_seq < 1 || *d < 1)
        s = nl_error_set(err, NL_ERR_STATE, "the cluster has no model yet (its status names none)");
    else if (json_is_string(tk))
        s = nl_tokenizer_load_buffer(tok, json_string_value(tk), json_string_length(tk), err);
    else /* bytes, as `neuroctl embed --model` reads a model without a tokenizer */
        s = nl_tokenizer_new_bytes(tok, err);
    json_decref(st);
    return s;
}

/* Where an embed job's result goes: B vectors of d. */
typedef struct embed_out {
    int B, d;
    float *emb;
} embed_out;

static nl_status take_embeddings(void *ctx, const nl_wire_msg *m, nl_error *err)
{
    const embed_out *o = ctx;
    const nl_tensor *t = &m->frames[0].t;
    if (t->dtype != NL_DTYPE_F32 || t->ndim != 2 || t->shape[0] != o->B || t->shape[1] != o->d)
        return nl_error_set(err, NL_ERR_SHAPE, "result: not F32 [%d, %d] embeddings", o->B, o->d);
    memcpy(o->emb, t->data, (size_t)o->B * o->d * sizeof *o->emb);
    return NL_OK;
}

/* One embed job: B texts of T ids in, B vectors of d into emb (adapter:
 * an absolute path the cluster reads, or NULL). */
static nl_status embed_batch(nl_remote *r, const int32_t *ids, const int32_t *lengths, int B, int T,
                             int d, const char *adapter, float *emb, nl_error *err)
{
    char text[NL_EMBED_LENGTHS_MAX];
    nl_status st = nl_embed_format_lengths(text, sizeof text, lengths, B, err);
    if (st != NL_OK)
        return st;
    const nl_wire_param ps[2] = {
        {.key = "lengths", .kind = NL_WIRE_PARAM_STR, .s = text},
        {.key = "adapter", .kind = NL_WIRE_PARAM_STR, .s = (char *)adapter}};
    if ((st = nl_remote_submit(r, NL_JOB_EMBED, ps, adapter ? 2 : 1, ids, B, T, err)) != NL_OK)
        return st;
    embed_out o = {B, d, emb};
    return nl_client_await_result(r->s, nl_mono_s() + r->timeout_ms / 1e3, take_embeddings, &o,
                                  err);
}

int nl_cmd_remote_embed(int argc, char **argv)
{
    nl_flag flags[] = {
        {"input", 1, "text file: one text per line (through the cluster's tokenizer, else bytes)",
         NULL},
        {"out", 1, "output: 'embeddings' F32 [lines, hidden_dim], L2-normalised", NULL},
        {"seq", 1, "ids kept per line (default: the model's max_seq_len)", NULL},
        {"batch", 1, "lines per embed job (default 16)", NULL},
        {"adapter", 1,
         "LoRA adapter file under the cluster's --checkpoint-root, shared with the nodes (e.g. "
         "the one neuroctl finetune --cluster joined there)",
         NULL},
        NL_REMOTE_FLAGS,
        {0}};
    const char *usage = "neuroctl embed (--cluster DIR | --coordinator EP --key K "
                        "--coordinator-key P) --input TEXTS --out EMB.safetensors [--seq T] "
                        "[--batch B] [--adapter A]";
    for (int i = 1; i < argc; i++) {
        if (nl_remote_refuse_node_flag(argv[i]))
            return 2;
        if (strcmp(argv[i], "--model") == 0) {
            fprintf(stderr, "--model: a cluster embeds with its own model\n");
            return 2;
        }
    }
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    long long seq = 0, batch = 16;
    if ((rc = nl_cli_require("embed", usage, flags, "input", "out", (const char *)NULL)) ||
        (rc = nl_args_int(flags, "seq", 1, 1 << 20, &seq)) ||
        (rc = nl_args_int(flags, "batch", 1, 4096, &batch)) ||
        (rc = nl_cli_may_write(flags, "out", nl_args_get(flags, "out"))))
        return rc;
    const char *in = nl_args_get(flags, "input"), *out = nl_args_get(flags, "out"),
               *ad = nl_args_get(flags, "adapter");
    char *adapter = NULL; /* absolute: the coordinator and the nodes resolve it */
    if (ad && !(adapter = realpath(ad, NULL))) {
        fprintf(stderr, "--adapter: %s: %s\n", ad, strerror(errno));
        return 1;
    }
    nl_error err = {0};
    nl_remote r = {0};
    nl_tokenizer *tok = NULL;
    nl_st_writer *w = NULL;
    char *text = NULL;
    size_t len = 0;
    int32_t *ids = NULL, *lengths = NULL;
    float *emb = NULL;
    int64_t vocab = 0;
    int max_seq = 0, d = 0, n = 0;
    rc = 1;
    if (nl_file_read_all(in, EMBED_MAX_BYTES, &text, &len, &err) != NL_OK ||
        nl_remote_open(&r, flags, 60, &err) != NL_OK ||
        cluster_model(&r, &tok, &vocab, &max_seq, &d, &err) != NL_OK)
        goto out;
    const int T = (int)(seq > 0 && seq < max_seq ? seq : max_seq);
    if (encode_lines(text, len, tok, T, vocab, &ids, &lengths, &n, &err) != NL_OK) {
        nl_error_prefix(&err, "%s", in);
        goto out;
    }
    if (!(emb = malloc((size_t)n * d * sizeof *emb))) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int b0 = 0; b0 < n; b0 += (int)batch) {
        const int B = n - b0 < (int)batch ? n - b0 : (int)batch;
        if (embed_batch(&r, ids + (size_t)b0 * T, lengths + b0, B, T, d, adapter,
                        emb + (size_t)b0 * d, &err) != NL_OK)
            goto out;
    }
    const int64_t shape[2] = {n, d};
    if (!(w = nl_st_writer_new())) {
        nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (nl_st_writer_add(w, "embeddings", NL_DTYPE_F32, 2, shape, emb, &err) != NL_OK ||
        nl_st_writer_write(w, out, &err) != NL_OK)
        goto out;
    fprintf(stderr, "wrote %s: %d embeddings of %d (through the cluster)\n", out, n, d);
    rc = 0;
out:
    nl_st_writer_destroy(&w);
    nl_remote_close(&r);
    nl_tokenizer_destroy(&tok);
    free(text);
    free(ids);
    free(lengths);
    free(emb);
    free(adapter);
    if (rc)
        fprintf(stderr, "neuroctl embed: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}
