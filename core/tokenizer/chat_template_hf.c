/* Chat templates to and from Hugging Face model directories
 * (chat_template.h): tokenizer_config.json's `chat_template`. Kept apart
 * from core/formats/hf.c (the weights and the tokenizer files), which calls these
 * two functions once each. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/formats/fileio.h"
#include "core/tokenizer/chat_template.h"

#define MAX_TOKENIZER_CONFIG (4u << 20)

/* A special token of tokenizer_config.json: a string, or {"content": s}. */
static const char *token_text(json_t *v)
{
    if (json_is_object(v))
        v = json_object_get(v, "content");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* `chat_template`: a string, or [{"name", "template"}] (the "default"). */
static const char *jinja_of(json_t *v)
{
    if (json_is_string(v))
        return json_string_value(v);
    size_t i;
    json_t *e;
    json_array_foreach(v, i, e)
    {
        const char *name = json_string_value(json_object_get(e, "name"));
        if (name && strcmp(name, "default") == 0)
            return json_string_value(json_object_get(e, "template"));
    }
    return NULL;
}

nl_status nl_chat_template_read_hf(const char *dir, char **json, char *family, char *warn,
                                   nl_error *err)
{
    char path[4096];
    char *text = NULL;
    size_t len = 0;
    json_t *root = NULL;
    nl_chat_template *t = NULL;
    struct stat sb;
    nl_status st = NL_OK;
    *json = NULL;
    family[0] = warn[0] = 0;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (stat(path, &sb) != 0)
        return NL_OK; /* no tokenizer config: no template */
    if ((st = nl_file_read_all(path, MAX_TOKENIZER_CONFIG, &text, &len, err)) != NL_OK)
        return st;
    json_error_t je;
    if (!(root = json_loadb(text, len, 0, &je)) || !json_is_object(root)) {
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: not a JSON object (%s)", path,
                          root ? "another type" : je.text);
        goto out;
    }
    json_t *ct = json_object_get(root, "chat_template");
    if (!ct || json_is_null(ct))
        goto out;
    const char *jinja = jinja_of(ct);
    if (!jinja) {
        st = nl_error_set(err, NL_ERR_FORMAT,
                          "%s: chat_template: expected a string or a list holding \"default\"",
                          path);
        goto out;
    }
    nl_error e2 = {0};
    st = nl_chat_template_from_hf(&t, jinja, token_text(json_object_get(root, "bos_token")),
                                  token_text(json_object_get(root, "eos_token")), &e2);
    if (st == NL_ERR_UNSUPPORTED) {
        snprintf(warn, 256,
                 "tokenizer_config.json: chat_template \"%.60s...\" is not a family this "
                 "importer knows: the default (ChatML) is used, the original kept for export",
                 jinja);
        for (char *c = warn; *c; c++)
            if (*c == '\n' || *c == '\r')
                *c = ' ';
        if ((st = nl_chat_template_default(&t, err)) == NL_OK && !(t->source = strdup(jinja)))
            st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    } else if (st != NL_OK) {
        *err = e2;
        nl_error_prefix(err, "%s", path);
    }
    if (st == NL_OK) {
        snprintf(family, 16, "%s", t->family);
        if (!(*json = nl_chat_template_to_json(t)))
            st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    }
out:
    nl_chat_template_destroy(&t);
    json_decref(root);
    free(text);
    return st;
}

nl_status nl_chat_template_write_hf(const char *dir, const char *json, int *wrote, nl_error *err)
{
    nl_chat_template *t = NULL;
    json_t *root = NULL;
    char *text = NULL, *out = NULL;
    size_t len = 0;
    char path[4096];
    struct stat sb;
    *wrote = 0;
    if (!json)
        return NL_OK;
    nl_status st = nl_chat_template_parse(&t, json, strlen(json), err);
    if (st != NL_OK || !t->source)
        goto out;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (stat(path, &sb) == 0) { /* written by this export: add the key */
        json_error_t je;
        if ((st = nl_file_read_all(path, MAX_TOKENIZER_CONFIG, &text, &len, err)) != NL_OK)
            goto out;
        if (!(root = json_loadb(text, len, 0, &je)) || !json_is_object(root)) {
            st = nl_error_set(err, NL_ERR_FORMAT, "%s: not a JSON object", path);
            goto out;
        }
    } else {
        root = json_object();
    }
    if (!root || json_object_set_new(root, "chat_template", json_string(t->source)) ||
        !(out = json_dumps(root, JSON_INDENT(2)))) {
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
        goto out;
    }
    st = nl_file_write_atomic(path, out, strlen(out), err);
    *wrote = st == NL_OK;
out:
    if (st != NL_OK)
        *wrote = 0;
    nl_chat_template_destroy(&t);
    json_decref(root);
    free(text);
    free(out);
    return st;
}
