/* Hugging Face checkpoints: import a MixtralForCausalLM model directory
 * (config.json and safetensors weights, one file or sharded with
 * model.safetensors.index.json) as one of our checkpoints, and export one
 * of ours (a checkpoint, or a training manifest and its shards) as such a
 * directory. docs/checkpoint-format.md, section "Hugging Face".
 *
 * Both directions stream tensor by tensor: a source tensor is read with
 * pread (never mapped whole), converted to F32, permuted where RoPE asks,
 * and written before the next is read, so a conversion holds at most its
 * largest tensor twice, never the model.
 *
 * Every input is untrusted: the config is checked key by key, every
 * tensor's presence, dtype and shape against the config before anything
 * is written, and a failure leaves no output file behind. */
#ifndef NL_HF_H
#define NL_HF_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "core/model/config.h"

/* Shard size an export starts a new file at (transformers' default). */
#define NL_HF_SHARD_DEFAULT 5000000000ull
/* config.json and model.safetensors.index.json are read whole up to this. */
#define NL_HF_MAX_JSON (64u << 20)

/* What a conversion did, for reports. */
typedef struct nl_hf_stats {
    int n_tensors;          /* tensors written */
    int n_files;            /* weight files read (import) or written (export) */
    uint64_t bytes_in;      /* tensor bytes read */
    uint64_t bytes_out;     /* tensor bytes written */
    int converted;          /* import: tensors converted from BF16 or F16 to F32 */
    char converted_from[8]; /* the dtype of the first of them */
    int tied;               /* import: lm_head copied from the tied embedding */
    int has_tokenizer;      /* the tokenizer was written (export) or read (import) */
    /* import: the tokenizer found, or why there is none; export: what a
     * reader should know ("" when nothing) */
    char tokenizer_note[512];
    int64_t vocab_size;     /* export: the model's ids (bytes only up to 259: no tokenizer) */
    int replaced;           /* export --force: files of the directory written over */
    int kept;               /* export --force: entries of the directory it did not write */
    char kept_names[200];   /* ... their names, ", "-separated, "..." when cut */
    char chat_family[16];   /* import: the chat template's family ("" none); export: "" */
    char chat_warning[256]; /* import: an unrecognised chat template (the default is used) */
    int chat_written;       /* export: tokenizer_config.json written for the chat template */
} nl_hf_stats;

/* The longest architecture name nl_hf_config_parse reports, with its NUL. */
#define NL_HF_ARCH_MAX 48

/* Parse a Hugging Face config.json (text of len bytes; `label` starts
 * messages) into *cfg: MixtralForCausalLM, and LlamaForCausalLM or
 * MistralForCausalLM as the dense FFN (num_experts 1, top_k 1).
 * Mistral's and Mixtral's sliding_window W (shorter than the context)
 * becomes attention_window W with every layer local (global_every 0);
 * hidden_act "swish" is silu. Refused (NL_ERR_UNSUPPORTED, naming the
 * key) is what the runtime cannot represent (rope_scaling, biases, an
 * activation other than silu, a head_dim other than hidden / heads).
 * vocab_chunk is set to vocab_size, so the tables hold exactly the
 * vocabulary. *tied gets tie_word_embeddings; arch (may be NULL) the
 * architecture's name as transformers spells it. Messages name the key. */
nl_status nl_hf_config_parse(nl_config *cfg, int *tied, const char *json, size_t len,
                             const char *label, char arch[NL_HF_ARCH_MAX], nl_error *err);

/* The attention window Mistral's sliding_window expresses: cfg's
 * attention_window when every layer is local (global_every 0), else 0. */
int nl_hf_window(const nl_config *cfg);
/* The architecture an export of cfg writes: MixtralForCausalLM (experts),
 * MistralForCausalLM (dense with a sliding window) or LlamaForCausalLM. */
const char *nl_hf_arch_of(const nl_config *cfg);

/* config.json for cfg's architecture and sizes (malloc'd, NULL when out
 * of memory). with_tokenizer sets bos/eos to our <|begin|> and <|end|>
 * ids, else null. */
char *nl_hf_config_to_json(const nl_config *cfg, int with_tokenizer);

/* The RoPE row permutation of q_proj / k_proj ([heads * head_dim, cols]):
 * Hugging Face rotates halves (dims i and i + hd/2 pair up), we rotate
 * adjacent pairs (2i, 2i + 1). to_ours: ours[h, 2i + j] = hf[h, j hd/2 + i];
 * else the inverse. Exact (rows move, values do not change). */
void nl_hf_rope_permute(float *dst, const float *src, int heads, int head_dim, int64_t cols,
                        int to_ours);

/* neuroctl import --hf DIR --out MODEL: write our checkpoint (step 0)
 * from the model in DIR, with its tokenizer when DIR has a byte-level BPE
 * one (tokenizer.json, or vocab.json and merges.txt) and without one when
 * it has none or another kind (stats->tokenizer_note says which). stats
 * may be NULL. */
nl_status nl_hf_import(const char *dir, const char *out, nl_hf_stats *stats, nl_error *err);

/* A Hugging Face tokenizer.json (text of len bytes; `label` starts
 * messages) for a model of vocab_size rows, as our tokenizer file's text
 * (*tok_text, malloc'd): a byte-level BPE keeps its ids, the rows it does
 * not define become <|unused_ID|> specials. Another kind (a Unigram,
 * SentencePiece's BPE, a normalizer, another pre-tokenizer) is not an
 * error: *tok_text stays NULL and note names what was found. A malformed
 * file is (NL_ERR_FORMAT, naming the entry). docs/checkpoint-format.md. */
nl_status nl_hf_tokenizer_parse(const char *json, size_t len, const char *label, int64_t vocab_size,
                                char **tok_text, char *note, size_t note_cap, nl_error *err);

/* neuroctl export --format hf: write DIR (created; must be empty or new,
 * or with force may hold files: those the export writes are replaced, the
 * others kept and counted in stats)
 * with config.json, model.safetensors or model-0000i-of-0000n.safetensors
 * plus model.safetensors.index.json (a new shard starts past shard_bytes),
 * and, when the source carries a tokenizer, tokenizer.json,
 * tokenizer_config.json, vocab.json, merges.txt and neurollm-tokenizer.txt. `src` is a checkpoint
 * (.safetensors), or a manifest (a .json file or the directory holding manifest.json), whose shards
 * are verified first. On failure the files written are removed (with force, also those it had
 * replaced). */
nl_status nl_hf_export(const char *src, const char *dir, uint64_t shard_bytes, int force,
                       nl_hf_stats *stats, nl_error *err);

#endif
