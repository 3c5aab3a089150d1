/* Chat templates (chat_template.h): the default, the JSON form, the
 * families recognised in a Hugging Face Jinja template, and rendering. */
#include "core/tokenizer/chat_template.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/checkpoint.h"
#include "core/tokenizer/tokenizer.h"

static const char *role_names[NL_CHAT_ROLES] = {"system", "user", "assistant"};

int nl_chat_role_of(const char *name)
{
    if (strcmp(name, "developer") == 0)
        return NL_CHAT_SYSTEM;
    for (int r = 0; r < NL_CHAT_ROLES; r++)
        if (strcmp(name, role_names[r]) == 0)
            return r;
    return -1;
}

void nl_chat_template_destroy(nl_chat_template **tp)
{
    if (!tp || !*tp)
        return;
    nl_chat_template *t = *tp;
    free(t->family);
    free(t->bos);
    for (int r = 0; r < NL_CHAT_ROLES; r++) {
        free(t->prefix[r]);
        free(t->suffix[r]);
    }
    free(t->generation);
    free(t->source);
    free(t);
    *tp = NULL;
}

/* A template from its strings (each copied; prefix/suffix as role pairs). */
static nl_status make(nl_chat_template **out, const char *family, const char *bos,
                      const char *const ps[2 * NL_CHAT_ROLES], const char *gen, int sys_in_user,
                      const char *source, nl_error *err)
{
    nl_chat_template *t = calloc(1, sizeof *t);
    int oom = !t;
    if (t) {
        oom |= !(t->family = strdup(family)) || !(t->bos = strdup(bos)) ||
               !(t->generation = strdup(gen));
        for (int r = 0; r < NL_CHAT_ROLES; r++)
            oom |= !(t->prefix[r] = strdup(ps[2 * r])) || !(t->suffix[r] = strdup(ps[2 * r + 1]));
        if (source)
            oom |= !(t->source = strdup(source));
        t->system_in_user = sys_in_user;
    }
    if (oom) {
        nl_chat_template_destroy(&t);
        return nl_error_set(err, NL_ERR_NOMEM, "chat template: out of memory");
    }
    *out = t;
    return NL_OK;
}

static const char *const chatml[2 * NL_CHAT_ROLES] = {"<|im_start|>system\n",    "<|im_end|>\n",
                                                      "<|im_start|>user\n",      "<|im_end|>\n",
                                                      "<|im_start|>assistant\n", "<|im_end|>\n"};

nl_status nl_chat_template_default(nl_chat_template **out, nl_error *err)
{
    return make(out, "chatml", "", chatml, "<|im_start|>assistant\n", 0, NULL, err);
}

/* ---------------------------------------------------------------- JSON */

static int get_field(json_t *o, const char *where, const char *k, int required, const char **v,
                     nl_error *err)
{
    json_t *j = json_object_get(o, k);
    if (!j) {
        if (required)
            nl_error_set(err, NL_ERR_FORMAT, "chat template: %s%s: required", where, k);
        return required ? -1 : 0;
    }
    size_t max = strcmp(k, "source") == 0 ? NL_CHAT_MAX_SOURCE : NL_CHAT_MAX_FIELD;
    if (!json_is_string(j) || json_string_length(j) > max ||
        strlen(json_string_value(j)) != json_string_length(j)) {
        nl_error_set(err, NL_ERR_FORMAT,
                     "chat template: %s%s: expected a string of at most %zu bytes without NUL",
                     where, k, max);
        return -1;
    }
    *v = json_string_value(j);
    return 0;
}

static int only_keys(json_t *o, const char *where, const char *const *keys, int n, nl_error *err)
{
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v)
    {
        int ok = 0;
        for (int i = 0; i < n; i++)
            ok |= strcmp(k, keys[i]) == 0;
        if (!ok) {
            nl_error_set(err, NL_ERR_FORMAT, "chat template: %s%s: not a key of %s", where, k,
                         NL_CHAT_FORMAT);
            return -1;
        }
    }
    return 0;
}

nl_status nl_chat_template_parse(nl_chat_template **out, const char *json, size_t len,
                                 nl_error *err)
{
    static const char *const top[] = {"format",     "family",         "bos",   "roles",
                                      "generation", "system_in_user", "source"};
    static const char *const pair[] = {"prefix", "suffix"};
    json_error_t je;
    *out = NULL;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return nl_error_set(err, NL_ERR_FORMAT, "chat template: not a JSON object (%s)",
                            root ? "another type" : je.text);
    }
    const char *fmt = NULL, *family = "custom", *bos = "", *gen = "", *src = NULL;
    const char *ps[2 * NL_CHAT_ROLES];
    nl_status st = NL_ERR_FORMAT;
    json_t *roles = json_object_get(root, "roles"), *siu = json_object_get(root, "system_in_user");
    if (only_keys(root, "", top, 7, err) || get_field(root, "", "format", 1, &fmt, err) ||
        get_field(root, "", "family", 0, &family, err) ||
        get_field(root, "", "bos", 0, &bos, err) ||
        get_field(root, "", "generation", 1, &gen, err) ||
        get_field(root, "", "source", 0, &src, err))
        goto out;
    if (strcmp(fmt, NL_CHAT_FORMAT) != 0) {
        nl_error_set(err, NL_ERR_VERSION, "chat template: format '%.64s', expected %s", fmt,
                     NL_CHAT_FORMAT);
        st = NL_ERR_VERSION;
        goto out;
    }
    if (siu && !json_is_boolean(siu)) {
        nl_error_set(err, NL_ERR_FORMAT, "chat template: system_in_user: expected a boolean");
        goto out;
    }
    if (!json_is_object(roles) || only_keys(roles, "roles.", role_names, NL_CHAT_ROLES, err)) {
        if (!json_is_object(roles))
            nl_error_set(err, NL_ERR_FORMAT, "chat template: roles: expected an object");
        goto out;
    }
    for (int r = 0; r < NL_CHAT_ROLES; r++) {
        char where[48];
        snprintf(where, sizeof where, "roles.%s.", role_names[r]);
        json_t *o = json_object_get(roles, role_names[r]);
        if (!json_is_object(o)) {
            nl_error_set(err, NL_ERR_FORMAT, "chat template: roles.%s: expected an object",
                         role_names[r]);
            goto out;
        }
        if (only_keys(o, where, pair, 2, err) ||
            get_field(o, where, "prefix", 1, &ps[2 * r], err) ||
            get_field(o, where, "suffix", 1, &ps[2 * r + 1], err))
            goto out;
    }
    st = make(out, family, bos, ps, gen, siu && json_is_true(siu), src, err);
out:
    json_decref(root);
    return st;
}

char *nl_chat_template_to_json(const nl_chat_template *t)
{
    json_t *roles = json_object();
    for (int r = 0; roles && r < NL_CHAT_ROLES; r++)
        json_object_set_new(
            roles, role_names[r],
            json_pack("{s:s, s:s}", "prefix", t->prefix[r], "suffix", t->suffix[r]));
    json_t *j = json_pack("{s:s, s:s, s:s, s:o, s:s, s:b}", "format", NL_CHAT_FORMAT, "family",
                          t->family, "bos", t->bos, "roles", roles, "generation", t->generation,
                          "system_in_user", t->system_in_user);
    if (j && t->source)
        json_object_set_new(j, "source", json_string(t->source));
    char *s = j ? json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    return s;
}

/* ---------------------------------------------------------------- Hugging Face */

nl_status nl_chat_template_from_hf(nl_chat_template **out, const char *jinja, const char *bos,
                                   const char *eos, nl_error *err)
{
    *out = NULL;
    bos = bos ? bos : "<s>";
    eos = eos ? eos : "</s>";
    if (strlen(jinja) > NL_CHAT_MAX_SOURCE || strlen(bos) > 256 || strlen(eos) > 256)
        return nl_error_set(err, NL_ERR_LIMIT, "chat_template: over %d bytes", NL_CHAT_MAX_SOURCE);
    if (strstr(jinja, "<|im_start|>"))
        return make(out, "chatml", "", chatml, "<|im_start|>assistant\n", 0, jinja, err);
    if (strstr(jinja, "<|start_header_id|>")) {
        static const char *const l3[2 * NL_CHAT_ROLES] = {
            "<|start_header_id|>system<|end_header_id|>\n\n",    "<|eot_id|>",
            "<|start_header_id|>user<|end_header_id|>\n\n",      "<|eot_id|>",
            "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"};
        return make(out, "llama3", bos, l3, "<|start_header_id|>assistant<|end_header_id|>\n\n", 0,
                    jinja, err);
    }
    char eos_nl[300];
    snprintf(eos_nl, sizeof eos_nl, "%s\n", eos);
    if (strstr(jinja, "<|user|>")) {
        const char *const z[2 * NL_CHAT_ROLES] = {"<|system|>\n",    eos_nl, "<|user|>\n", eos_nl,
                                                  "<|assistant|>\n", eos_nl};
        return make(out, "zephyr", "", z, "<|assistant|>\n", 0, jinja, err);
    }
    if (strstr(jinja, "[INST]")) {
        /* the system message goes inside the first user turn: Llama-2
         * between <<SYS>> markers, Mistral before the user's text */
        const int l2 = strstr(jinja, "<<SYS>>") != NULL;
        const char *const inst[2 * NL_CHAT_ROLES] = {l2 ? "<<SYS>>\n" : "",
                                                     l2 ? "\n<</SYS>>\n\n" : "\n\n",
                                                     "[INST] ",
                                                     " [/INST]",
                                                     l2 ? " " : "",
                                                     eos};
        return make(out, l2 ? "llama2" : "mistral", bos, inst, "", 1, jinja, err);
    }
    return nl_error_set(err, NL_ERR_UNSUPPORTED,
                        "chat_template: not a family this importer knows (ChatML <|im_start|>, "
                        "Llama-3 <|start_header_id|>, Zephyr <|user|>, Llama-2/Mistral [INST])");
}

/* ---------------------------------------------------------------- rendering */

typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void put(sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void puts_(sbuf *b, const char *s)
{
    put(b, s, strlen(s));
}

/* A system message that no user turn took, as a user turn of its own. */
static void put_system_turn(sbuf *b, const nl_chat_template *t, const nl_chat_msg *sys)
{
    puts_(b, t->prefix[NL_CHAT_USER]);
    puts_(b, t->prefix[NL_CHAT_SYSTEM]);
    put(b, sys->content, sys->len);
    puts_(b, t->suffix[NL_CHAT_SYSTEM]);
    puts_(b, t->suffix[NL_CHAT_USER]);
}

nl_status nl_chat_template_render(const nl_chat_template *t, const nl_chat_msg *msgs, int n,
                                  int add_generation, char **out, size_t *len, nl_error *err)
{
    sbuf b = {0};
    const nl_chat_msg *sys = NULL; /* a system message waiting for its user turn */
    *out = NULL;
    puts_(&b, t->bos);
    for (int i = 0; i < n; i++) {
        const nl_chat_msg *m = &msgs[i];
        if ((unsigned)m->role >= NL_CHAT_ROLES) {
            free(b.p);
            return nl_error_set(err, NL_ERR_INVALID, "messages[%d]: unknown role", i);
        }
        if (m->role == NL_CHAT_SYSTEM && t->system_in_user) {
            if (sys) /* two before a user turn: the first is not dropped */
                put_system_turn(&b, t, sys);
            sys = m;
            continue;
        }
        puts_(&b, t->prefix[m->role]);
        if (sys && m->role == NL_CHAT_USER) {
            puts_(&b, t->prefix[NL_CHAT_SYSTEM]);
            put(&b, sys->content, sys->len);
            puts_(&b, t->suffix[NL_CHAT_SYSTEM]);
            sys = NULL;
        }
        put(&b, m->content, m->len);
        puts_(&b, t->suffix[m->role]);
    }
    if (sys) /* no user turn followed: the system text is a user turn of its own */
        put_system_turn(&b, t, sys);
    if (add_generation)
        puts_(&b, t->generation);
    put(&b, "", 0);
    if (b.oom) {
        free(b.p);
        return nl_error_set(err, NL_ERR_NOMEM, "chat template: out of memory");
    }
    *out = b.p;
    *len = b.n;
    return NL_OK;
}

nl_status nl_chat_template_check(const char *json, const char *label, nl_error *err)
{
    nl_chat_template *t = NULL;
    if (!json)
        return NL_OK;
    nl_status st = nl_chat_template_parse(&t, json, strlen(json), err);
    nl_chat_template_destroy(&t);
    return st == NL_OK ? NL_OK : nl_error_prefix(err, "%s", label);
}

nl_status nl_chat_template_of_checkpoint(const char *path, nl_chat_template **out, nl_error *err)
{
    char *text = NULL;
    *out = NULL;
    nl_status st = nl_checkpoint_meta(path, "chat_template", &text, err);
    if (st == NL_OK)
        st = text ? nl_chat_template_parse(out, text, strlen(text), err)
                  : nl_chat_template_default(out, err);
    if (st != NL_OK && text)
        nl_error_prefix(err, "%s: metadata 'chat_template'", path);
    free(text);
    return st;
}

/* ---------------------------------------------------------------- the end of an answer */

char *nl_chat_turn_end(const char *json)
{
    nl_chat_template *t = NULL;
    nl_error e;
    if (!json || nl_chat_template_parse(&t, json, strlen(json), &e) != NL_OK)
        nl_chat_template_default(&t, &e);
    char *end = t ? strdup(t->suffix[NL_CHAT_ASSISTANT]) : NULL;
    nl_chat_template_destroy(&t);
    return end;
}

int nl_chat_ends_answer(const nl_tokenizer *tok, const char *turn_end, int32_t id)
{
    const uint8_t *name = NULL;
    size_t n = 0;
    if (!tok || !nl_tokenizer_is_special(tok, id) ||
        nl_tokenizer_token_bytes(tok, id, &name, &n) != NL_OK || n == 0)
        return 0;
    if (nl_tokenizer_is_native(tok))
        return id == NL_TOKEN_END;
    if (!turn_end)
        return 0;
    for (const char *p = turn_end; (p = strchr(p, (char)name[0])) != NULL; p++)
        if (strncmp(p, (const char *)name, n) == 0)
            return 1;
    return 0;
}
