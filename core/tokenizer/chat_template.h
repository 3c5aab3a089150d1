/* Chat templates: how a conversation (system, user and assistant
 * messages) becomes the one prompt text a model reads.
 *
 * Hugging Face checkpoints carry a Jinja2 program for this; we store a
 * small declarative template of our own instead (docs/serving.md, "Chat
 * templates"): text before the conversation (BOS), a prefix and a suffix
 * per role, the text that asks the model to answer (the generation
 * prompt), and whether a system message goes inside the next user turn
 * (Llama-2, Mistral). Its JSON form is checkpoint metadata `chat_template`
 * and the manifest's `chat_template` key:
 *
 *   {"format": "neurollm-chat/1", "family": "chatml", "bos": "",
 *    "roles": {"system": {"prefix": "...", "suffix": "..."}, "user": {...},
 *              "assistant": {...}},
 *    "generation": "...", "system_in_user": false, "source": "..."}
 *
 * `source` (optional) is the Jinja string the template was made from,
 * kept so that an export writes it back. A model without one uses the
 * default (ChatML markers, no BOS).
 *
 * Ownership: a template is one allocation owned by its caller
 * (nl_chat_template_destroy, NULL-safe); strings returned through out
 * parameters are malloc'd and the caller's. All functions are pure and
 * thread-safe. */
#ifndef NL_CHAT_TEMPLATE_H
#define NL_CHAT_TEMPLATE_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

#define NL_CHAT_FORMAT "neurollm-chat/1"
#define NL_CHAT_MAX_FIELD 4096       /* bytes of one prefix, suffix, bos or generation */
#define NL_CHAT_MAX_SOURCE (1 << 16) /* bytes of the kept Jinja source */

typedef enum nl_chat_role {
    NL_CHAT_SYSTEM = 0,
    NL_CHAT_USER,
    NL_CHAT_ASSISTANT,
    NL_CHAT_ROLES
} nl_chat_role;

typedef struct nl_chat_template {
    char *family; /* a label: "chatml", "llama2", "mistral", "llama3", "zephyr" as
                     nl_chat_template_from_hf names them, "custom" when the JSON form
                     has none, else what that form says */
    char *bos;    /* text before the first message ("" for none) */
    char *prefix[NL_CHAT_ROLES], *suffix[NL_CHAT_ROLES];
    char *generation;   /* after the last message when the model is to answer */
    int system_in_user; /* a system message is rendered inside the next user turn */
    char *source;       /* the Jinja string it came from, or NULL */
} nl_chat_template;

typedef struct nl_chat_msg {
    nl_chat_role role;
    const char *content;
    size_t len;
} nl_chat_msg;

/* The role named `name` ("system", "developer" (as system), "user",
 * "assistant"), or -1. */
int nl_chat_role_of(const char *name);

/* The documented default: ChatML markers, no BOS. */
nl_status nl_chat_template_default(nl_chat_template **out, nl_error *err);

/* Parse and check the JSON form (every field a string of at most
 * NL_CHAT_MAX_FIELD bytes; unknown keys refused by name). */
nl_status nl_chat_template_parse(nl_chat_template **out, const char *json, size_t len,
                                 nl_error *err);

/* The JSON form (malloc'd text), or NULL when out of memory. */
char *nl_chat_template_to_json(const nl_chat_template *t);

/* The template of a Hugging Face `chat_template` (Jinja), recognised by
 * the markers of its family: ChatML `<|im_start|>`, Llama-3
 * `<|start_header_id|>`, Zephyr `<|user|>`, Llama-2 / Mistral `[INST]`.
 * bos and eos are tokenizer_config.json's `bos_token` and `eos_token`
 * (NULL: "<s>", "</s>"). The source is kept. An unrecognised template is
 * NL_ERR_UNSUPPORTED. */
nl_status nl_chat_template_from_hf(nl_chat_template **out, const char *jinja, const char *bos,
                                   const char *eos, nl_error *err);

/* Render msgs[0..n) (and the generation prompt when add_generation) into
 * *out (malloc'd, NUL-terminated, *len bytes). */
nl_status nl_chat_template_render(const nl_chat_template *t, const nl_chat_msg *msgs, int n,
                                  int add_generation, char **out, size_t *len, nl_error *err);

/* The template a checkpoint carries (metadata `chat_template`), or the
 * default when it has none; a malformed one is NL_ERR_FORMAT naming the
 * file. */
nl_status nl_chat_template_of_checkpoint(const char *path, nl_chat_template **out, nl_error *err);

/* Check a stored template's JSON text (NULL passes: none stored); the
 * message starts with `label`. */
nl_status nl_chat_template_check(const char *json, const char *label, nl_error *err);

void nl_chat_template_destroy(nl_chat_template **t);

/* ---- the end of an answer ---- */

struct nl_tokenizer;

/* The text that ends an assistant turn: the assistant suffix of the
 * template in JSON form (NULL, or one that does not parse: the
 * default's), malloc'd; NULL when out of memory. */
char *nl_chat_turn_end(const char *json);

/* Whether id, sampled, ends the model's answer (serving stops there, its
 * finish "stop"): a special token of tok whose name occurs in turn_end
 * (ChatML's <|im_end|>, Llama 3's <|eot_id|>, the eos_token that ends a
 * Llama 2, Mistral or Zephyr turn), or a native tokenizer's <|end|> (a
 * document's end in our training data). tok NULL: none does. */
int nl_chat_ends_answer(const struct nl_tokenizer *tok, const char *turn_end, int32_t id);

/* ---- Hugging Face directories (chat_template_hf.c) ---- */

/* The chat template of a Hugging Face model directory: its
 * tokenizer_config.json's `chat_template` (a string, or the entry named
 * "default" of a list) as our JSON form (*json, malloc'd), or *json = NULL
 * when there is none. family (room for 16) gets the family recognised.
 * An unrecognised template is not an error: *json is the default with
 * the source kept, and warn (room for 256) says so, naming the template's
 * start; warn is "" otherwise. A malformed tokenizer_config.json is
 * NL_ERR_FORMAT naming the file. */
nl_status nl_chat_template_read_hf(const char *dir, char **json, char *family, char *warn,
                                   nl_error *err);

/* Put the template's source (json: our JSON form, may be NULL) back as
 * `chat_template` in DIR/tokenizer_config.json, adding the key to the file
 * when an export wrote one, else writing a file with that key alone.
 * *wrote says whether the template was written (0 when there is no source). */
nl_status nl_chat_template_write_hf(const char *dir, const char *json, int *wrote, nl_error *err);

#endif
