/* Fuzz target for chat templates (core/tokenizer/chat_template.h), which
 * come from files a user did not write: a checkpoint's metadata
 * `chat_template` (our JSON form), a Hugging Face `chat_template` (Jinja,
 * recognised by its family's markers) and a downloaded
 * tokenizer_config.json. The input's first byte picks which (its value
 * modulo 3: 0 the JSON form, 1 Jinja, 2 a tokenizer_config.json read from
 * a directory); the rest is the text.
 *
 * Property: no crash and no sanitizer report; a template that is taken
 * renders a conversation (with and without the generation prompt), and
 * its JSON form parses back into a template with the same fields, JSON
 * form and rendering (Jinja is taken as valid UTF-8 only, as it comes out
 * of a JSON file); one made from Jinja, or from a tokenizer_config.json
 * that is taken, has one of the families the import recognises (a JSON
 * form may name any: the family is a label there). */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/tokenizer/chat_template.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const nl_chat_msg conversation[] = {
    {NL_CHAT_SYSTEM, "Be brief.", 9},
    {NL_CHAT_USER, "Hi", 2},
    {NL_CHAT_ASSISTANT, "Hello!", 6},
    {NL_CHAT_USER, "Bye", 3},
};

/* the conversation rendered with the generation prompt (malloc'd), after
 * checking that it renders without one too */
static char *render(const nl_chat_template *t)
{
    char *out = NULL;
    size_t len = 0;
    nl_error err = {0};
    if (nl_chat_template_render(t, conversation, 4, 0, &out, &len, &err) != NL_OK ||
        strlen(out) != len) {
        fprintf(stderr, "fuzz_chat_template: a template taken does not render: %s\n", err.msg);
        abort();
    }
    free(out);
    if (nl_chat_template_render(t, conversation, 4, 1, &out, &len, &err) != NL_OK ||
        strlen(out) != len) {
        fprintf(stderr, "fuzz_chat_template: no generation prompt: %s\n", err.msg);
        abort();
    }
    return out;
}

static int same_str(const char *a, const char *b)
{
    return a && b ? strcmp(a, b) == 0 : a == b;
}

/* every field of t in u (the JSON form loses none) */
static int same(const nl_chat_template *t, const nl_chat_template *u)
{
    int eq = same_str(t->family, u->family) && same_str(t->bos, u->bos) &&
             same_str(t->generation, u->generation) && same_str(t->source, u->source) &&
             t->system_in_user == u->system_in_user;
    for (int r = 0; r < NL_CHAT_ROLES; r++)
        eq = eq && same_str(t->prefix[r], u->prefix[r]) && same_str(t->suffix[r], u->suffix[r]);
    return eq;
}

/* with known, the family must be one the import names (an unrecognised
 * template is the default, family "chatml", its source kept) */
static void check(const nl_chat_template *t, int known)
{
    static const char *const families[] = {"chatml", "llama2", "mistral", "llama3", "zephyr"};
    for (size_t i = 0; known && i < sizeof families / sizeof *families; i++)
        known = strcmp(t->family, families[i]) != 0;
    if (known) {
        fprintf(stderr, "fuzz_chat_template: family \"%.64s\"\n", t->family);
        abort();
    }
    char *json = nl_chat_template_to_json(t), *again = NULL, *r1 = render(t), *r2 = NULL;
    nl_chat_template *u = NULL;
    nl_error err = {0};
    if (!json || nl_chat_template_parse(&u, json, strlen(json), &err) != NL_OK ||
        !(again = nl_chat_template_to_json(u)) || strcmp(json, again) != 0 || !same(t, u) ||
        strcmp(r1, r2 = render(u)) != 0) {
        fprintf(stderr, "fuzz_chat_template: the JSON form does not come back: %s\n", err.msg);
        abort();
    }
    free(json), free(again), free(r1), free(r2);
    nl_chat_template_destroy(&u);
}

static char dir[64];

static void remove_dir(void)
{
    rmdir(dir);
}

/* the input as DIR/tokenizer_config.json, read as an import reads it */
static void read_dir(const char *text, size_t len)
{
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "/tmp/nl_fuzz_chat_XXXXXX");
        if (!mkdtemp(dir))
            abort();
        atexit(remove_dir);
    }
    char path[128];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(text, 1, len, f) != len || fclose(f) != 0)
        abort();
    char *json = NULL, family[16] = "", warn[256] = "";
    nl_error err = {0};
    if (nl_chat_template_read_hf(dir, &json, family, warn, &err) == NL_OK && json) {
        nl_chat_template *t = NULL;
        if (nl_chat_template_parse(&t, json, strlen(json), &err) != NL_OK) {
            fprintf(stderr, "fuzz_chat_template: read_hf gave a form that does not parse: %s\n",
                    err.msg);
            abort();
        }
        check(t, 1);
        nl_chat_template_destroy(&t);
    }
    free(json);
    unlink(path);
}

/* Jinja comes out of a JSON file (tokenizer_config.json), so it is valid
 * UTF-8, as the JSON form's strings must be */
static int utf8(const char *z)
{
    json_t *j = json_string(z);
    json_decref(j);
    return j != NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    const int mode = data[0] % 3;
    /* a heap copy of exactly the text's size (ASan sees reads past it),
     * and a NUL-terminated one for the Jinja form */
    const size_t n = size - 1;
    char *text = malloc(n ? n : 1), *z = malloc(n + 1);
    if (!text || !z)
        abort();
    memcpy(text, data + 1, n);
    memcpy(z, data + 1, n);
    z[n] = 0;
    nl_chat_template *t = NULL;
    nl_error err = {0};
    if (mode == 0 && nl_chat_template_parse(&t, text, n, &err) == NL_OK)
        check(t, 0);
    else if (mode == 1 && utf8(z) && nl_chat_template_from_hf(&t, z, NULL, NULL, &err) == NL_OK)
        check(t, 1);
    else if (mode == 2)
        read_dir(text, n);
    nl_chat_template_destroy(&t);
    free(text);
    free(z);
    return 0;
}
