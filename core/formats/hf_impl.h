/* Private to the Hugging Face module (core/formats/hf.h): what core/formats/hf.c (tensor
 * sources, the name mapping, the streaming fill), core/formats/hf_import.c and
 * core/formats/hf_export.c share. The module is cut along its two directions;
 * both use the same sources, job table and fill. */
#ifndef NL_HF_IMPL_H
#define NL_HF_IMPL_H

#include <jansson.h>
#include <stdint.h>

#include "core/formats/hf.h"
#include "core/formats/safetensors.h"

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

/* Open `path` and parse its header (checked in full by the safetensors
 * parser); the data stays on disk. The file is added to s even on failure
 * (hf_src_close frees it). */
nl_status hf_src_add(src_set *s, const char *path, nl_error *err);
void hf_src_close(src_set *s);

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
    char arch[NL_HF_ARCH_MAX]; /* the architecture read or written, for messages */
    int to_ours;
    src_set src;
    hf_job *jobs;
    int n_jobs;
    float *tmp; /* rows of a q/k tensor before the permutation */
    nl_hf_stats *stats;
} hf_conv;

/* Every tensor of the model, in our checkpoint's order. */
nl_status hf_build_jobs(hf_conv *c, nl_error *err);
/* Find j's source tensor `name` and check its dtype and shape (rows:
 * exactly, or at least when !exact). */
nl_status hf_resolve(hf_conv *c, hf_job *j, const char *name, int64_t rows, int exact,
                     nl_error *err);
/* The safetensors writer's fill for a job (ctx is the hf_job). */
nl_status hf_fill(void *ctx, void *dst, uint64_t nbytes, nl_error *err);
/* Room for the largest q/k tensor before its permutation. */
nl_status hf_alloc_tmp(hf_conv *c, nl_error *err);
void hf_conv_free(hf_conv *c);

/* dir/name, malloc'd (NULL when out of memory). */
char *hf_join(const char *dir, const char *name);

/* ------------------------------------------------------- the tokenizer */

struct nl_tokenizer;

/* Write the tokenizer (our file's text) as vocab.json, tokenizer.json,
 * tokenizer_config.json, merges.txt and neurollm-tokenizer.txt in dir
 * (paths appended to written). *native: whether its ids are our layout
 * (then bos/eos are our <|begin|> and <|end|>). note (empty on entry)
 * gets what a reader should know. core/formats/hf_tokenizer.c. */
nl_status hf_tokenizer_write(const char *dir, const char *tok_text, const nl_config *cfg,
                             int *native, char **written, int *n_written, char *note,
                             size_t note_cap, nl_error *err);
/* Read dir's tokenizer (tokenizer.json, else vocab.json and merges.txt)
 * for a model of vocab_size rows: *tok_text gets our file's text
 * (malloc'd), or stays NULL when there is none or it is a kind ours
 * cannot be (not an error: the weights import without it). note says
 * what was found either way. A malformed file is an error. */
nl_status hf_tokenizer_read(const char *dir, int64_t vocab_size, char **tok_text, char *note,
                            size_t note_cap, nl_error *err);
/* tokenizer_config.json's object: every field an export writes there is
 * made here (a new one, e.g. a chat template, is added here). */
json_t *hf_tokenizer_config(const struct nl_tokenizer *t, const nl_config *cfg);

#define HF_FAIL(st, ...) return nl_error_set(err, st, __VA_ARGS__)

#endif
