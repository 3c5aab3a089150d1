/* Sharded checkpoints: the manifest that ties a pipeline's shard files
 * together (docs/checkpoint-format.md, "Sharded checkpoints").
 *
 * In distributed training each stage writes its shard with
 * nl_checkpoint_save: a partial checkpoint holding the stage's tensors
 * and their AdamW moments. The coordinator then writes, last, a manifest:
 * a JSON file with the step, the config, the plan (which stage holds which
 * layers, in which file) and the SHA-256 and size of every shard. A
 * manifest that exists names a complete set of shards; its hashes say
 * whether the files on disk are still the ones it names.
 *
 * From a verified manifest, nl_manifest_load_stage builds any stage (the
 * layer range need not match the shard boundaries), and
 * nl_manifest_export joins the shards into one ordinary checkpoint.
 *
 * Ownership: nl_manifest_parse and nl_manifest_load return a manifest the
 * caller frees with nl_manifest_destroy(&m); every string in it is owned
 * by it. nl_manifest_write only reads its argument. */
#ifndef NL_MANIFEST_H
#define NL_MANIFEST_H

#include <stddef.h>
#include <stdint.h>

#include "core/model/model.h"

#define NL_MANIFEST_FORMAT "neurollm-manifest/1"
#define NL_MANIFEST_MAX_SHARDS 4096
/* A manifest file is read whole; it holds the tokenizer text, so it is
 * allowed to be large. */
#define NL_MANIFEST_MAX_BYTES (64u << 20)
/* The name nl_manifest_load looks for inside a directory. */
#define NL_MANIFEST_FILE "manifest.json"

typedef struct nl_manifest_shard {
    int stage;  /* 0..n_shards-1, in order */
    int l0, l1; /* layers [l0, l1) */
    int has_embed, has_head;
    char *file;      /* as written: a plain file name (no '/' and not "." or ".."),
                        relative to the manifest's directory */
    char *path;      /* resolved: <manifest dir>/<file> (parse fills it; write ignores it) */
    char sha256[65]; /* lowercase hex */
    uint64_t bytes;
    char *node;   /* free text: who wrote it (e.g. "node 3 <key>"), may be NULL */
    char *device; /* where the stage trained (the node's --device, "cuda:0"), may be NULL */
    int tf32;     /* NL_MANIFEST_TF32_*: whether its GEMMs could use TF32 */
} nl_manifest_shard;

/* A shard's "tf32": absent (not known: zero, so a zeroed shard claims
 * nothing), false or true. */
enum { NL_MANIFEST_TF32_UNKNOWN = 0, NL_MANIFEST_TF32_OFF = 1, NL_MANIFEST_TF32_ON = 2 };

typedef struct nl_manifest {
    int64_t step, adam_steps;
    nl_config cfg;            /* parsed + validated (nl_config_from_json + nl_config_validate) */
    char *config_json;        /* as stored (parse fills it; write encodes cfg instead) */
    char *train_json;         /* the run's options (a JSON object, stored as a nested object in
                                 the manifest), or NULL */
    char *tokenizer;          /* tokenizer file text, or NULL */
    char *init_seed;          /* decimal text, or NULL */
    char *chat_template;      /* JSON text (core/tokenizer/chat_template.h), or NULL */
    struct nl_growth *growth; /* growth history (core/grow/grow.h), oldest first, or NULL */
    int n_growth;
    int n_shards;
    nl_manifest_shard *shards;
} nl_manifest;

/* Write atomically (nl_file_write_atomic) as JSON:
 *   {"format", "step", "adam_steps", "config": {...}, "train": {...}|absent,
 *    "tokenizer": str|absent, "init_seed": str|absent, "chat_template": str|absent,
 *    "growth": [...]|absent,
 *    "shards": [{"stage", "layers": [l0, l1], "embed", "head", "file",
 *                "sha256", "bytes", "node"|absent, "device"|absent, "tf32": bool|absent}]}
 * The config is encoded from m->cfg. The manifest is checked as
 * nl_manifest_parse would check it before anything is written, so a
 * manifest that is written also loads; every shard beside it must already
 * be on disk with the size and hash it names (NL_ERR_INTEGRITY,
 * NL_ERR_NOTFOUND otherwise), so a manifest only ever names verified
 * shards. An existing manifest is never replaced (NL_ERR_STATE). Mode
 * 0644. */
nl_status nl_manifest_write(const char *path, const nl_manifest *m, nl_error *err);

/* NL_ERR_STATE (a message naming both) when the manifest.json beside
 * `path` names `path` as one of its shards: a file that must not be
 * replaced. NL_OK otherwise (no manifest, or one that does not parse). */
nl_status nl_manifest_names(const char *path, nl_error *err);

/* The text nl_manifest_write writes (malloc'd into *out, ending with a
 * newline), after the same checks. */
nl_status nl_manifest_to_json(const nl_manifest *m, char **out, nl_error *err);

/* Parse JSON text (untrusted: every field's type and range is checked;
 * unknown keys are ignored; a wrong format string is NL_ERR_VERSION;
 * errors name the field, e.g. "shards[1].sha256"). `dir` (NULL or "" for
 * the working directory) resolves the shard paths. Validates the plan:
 * shards in stage order, each of at least one layer, contiguous and
 * covering exactly [0, num_layers), the embedding on stage 0 only and the
 * head on the last stage only, stage i has stage == i, file names plain
 * and distinct. */
nl_status nl_manifest_parse(nl_manifest **out, const char *json, size_t len, const char *dir,
                            nl_error *err);

/* Read (at most NL_MANIFEST_MAX_BYTES) and parse the manifest at `path`;
 * shard paths resolve against its directory. A directory path means
 * <dir>/manifest.json. Messages start with the manifest's path. */
nl_status nl_manifest_load(nl_manifest **out, const char *path, nl_error *err);

void nl_manifest_destroy(nl_manifest **m);

/* SHA-256 of a regular file, streamed (never read whole), as lowercase
 * hex; *bytes (may be NULL) gets the number of bytes hashed. A missing
 * file is NL_ERR_NOTFOUND, other failures NL_ERR_IO. */
nl_status nl_file_sha256(const char *path, char hex[65], uint64_t *bytes, nl_error *err);

/* Check every shard against the manifest: its size, then its hash. A
 * mismatch is NL_ERR_INTEGRITY, a missing file NL_ERR_NOTFOUND, each with
 * a message naming the shard's file and stage, e.g.
 *   shard stage-1.safetensors (stage 1): sha256 mismatch: the manifest says
 *   ab12..., the file hashes to cd34...; refusing it */
nl_status nl_manifest_verify(const nl_manifest *m, nl_error *err);

/* Open shard i for serving: the file is read whole into memory, its size
 * and SHA-256 checked against the manifest on the very bytes read, and
 * that copy opened (nl_st_open_owned). What is served is what was
 * verified; a file truncated or rewritten afterwards changes nothing and
 * cannot fault. Errors as nl_manifest_verify. Memory: the shard's size,
 * until nl_st_close. */
struct nl_st_file;
nl_status nl_manifest_open_shard(const nl_manifest *m, int i, struct nl_st_file **out,
                                 nl_error *err);
/* Every shard into files[0..n_shards) (all or none: on failure the ones
 * opened are closed and every entry is NULL). */
nl_status nl_manifest_open_shards(const nl_manifest *m, struct nl_st_file **files, nl_error *err);

/* Shard i's own metadata against the manifest (its header only): its
 * config, apart from num_layers and vocab_size, which a growth changes
 * without rewriting every shard, and its step; NL_ERR_FORMAT naming the
 * shard where they differ (a shard of another step or model beside the
 * others). nl_manifest_load_stage checks the same on every shard it
 * reads; for callers that read the shards' tensors by name instead. */
nl_status nl_manifest_check_shard(const nl_manifest *m, int i, nl_error *err);

/* Build the stage [l0, l1) (with the embedding and/or head as asked) on
 * backend `be` from the shards of a verified manifest: every tensor from
 * whichever shard holds it (the "re-cut": the range need not match the
 * shard boundaries), checked for shape. l1 < 0 means "to the last
 * layer". Each shard read must agree with the manifest on its step and
 * on its config, apart from num_layers and vocab_size, which a growth
 * changes without rewriting the shards it leaves alone (NL_ERR_FORMAT
 * otherwise). The model gets the manifest's growth history. When
 * mom_m and mom_v are not NULL (both or neither: device buffers of the
 * new model's n_params floats, model layout) they are filled from
 * `optim.m.<name>` / `optim.v.<name>` (NL_ERR_NOTFOUND naming the tensor
 * if absent), and each shard's adam_steps must match the manifest's. */
nl_status nl_manifest_load_stage(nl_model **out, nl_backend *be, const nl_manifest *m, int l0,
                                 int l1, int has_embed, int has_head, float *mom_m, float *mom_v,
                                 nl_error *err);

/* Verify, then join every shard into one checkpoint at `out` (DESIGN
 * section 2 names, with the moments, adam_steps, train, tokenizer,
 * init_seed and step of the manifest): the whole model is built with
 * nl_manifest_load_stage on a CPU backend and written with
 * nl_checkpoint_save, so the file is what a one-process save of the same
 * weights writes. */
nl_status nl_manifest_export(const nl_manifest *m, const char *out, nl_error *err);

/* What an export wrote, for reports. */
typedef struct nl_manifest_export_stats {
    int n_tensors;   /* model tensors; each also has its two moments */
    size_t n_params; /* floats of the weights (each moment has as many) */
    uint64_t bytes;  /* size of the written file */
} nl_manifest_export_stats;

/* nl_manifest_export that also fills *stats (may be NULL). */
nl_status nl_manifest_export_ex(const nl_manifest *m, const char *out,
                                nl_manifest_export_stats *stats, nl_error *err);

#endif
