/* Chat templates (core/tokenizer/chat_template.h): the default renders ChatML; the
 * Hugging Face families map to the strings their Jinja programs produce
 * for a system + user + assistant + user conversation; the JSON form
 * round-trips and refuses what is malformed, naming the field; a Hugging
 * Face directory's tokenizer_config.json is read and written back; the
 * end of an answer: a special token named in the assistant's turn end (of
 * an imported tokenizer), or our <|end|>, and no other id. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/check.h"

static const nl_chat_msg conv[] = {{NL_CHAT_SYSTEM, "Be brief.", 9},
                                   {NL_CHAT_USER, "Hi", 2},
                                   {NL_CHAT_ASSISTANT, "Hello!", 6},
                                   {NL_CHAT_USER, "Bye", 3}};

static void check_render(const nl_chat_template *t, const char *want, const char *label)
{
    char *out = NULL;
    size_t len = 0;
    nl_error err = {0};
    CHECK_OK(nl_chat_template_render(t, conv, 4, 1, &out, &len, &err), &err);
    CHECK(out && strcmp(out, want) == 0 && len == strlen(want), "%s: got [%s]", label,
          out ? out : "(null)");
    free(out);
}

static void check_family(const char *jinja, const char *family, const char *want)
{
    nl_chat_template *t = NULL;
    nl_error err = {0};
    CHECK_OK(nl_chat_template_from_hf(&t, jinja, "<s>", "</s>", &err), &err);
    if (!t)
        return;
    CHECK(strcmp(t->family, family) == 0 && t->source && strcmp(t->source, jinja) == 0,
          "%s: family %s", family, t->family);
    check_render(t, want, family);
    /* the JSON form round-trips */
    char *j = nl_chat_template_to_json(t);
    nl_chat_template *u = NULL;
    CHECK_OK(nl_chat_template_parse(&u, j, strlen(j), &err), &err);
    if (u)
        check_render(u, want, "round trip");
    nl_chat_template_destroy(&u);
    nl_chat_template_destroy(&u); /* NULL-safe */
    free(j);
    nl_chat_template_destroy(&t);
}

static void check_refused(const char *json, const char *needle)
{
    nl_chat_template *t = NULL;
    nl_error err = {0};
    nl_status st = nl_chat_template_parse(&t, json, strlen(json), &err);
    CHECK(st != NL_OK && !t && strstr(err.msg, needle), "refused naming %s: %s", needle, err.msg);
}

static void check_hf_dir(void)
{
    char dir[] = "/tmp/nl_chat_XXXXXX", path[64];
    if (!mkdtemp(dir))
        return;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"bos_token\": {\"content\": \"<|begin_of_text|>\"}, \"eos_token\": \"<|eot_id|>\", "
          "\"chat_template\": \"{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\\n\\n{{ m['content'] }}<|eot_id|>{% endfor %}\"}",
          f);
    fclose(f);
    char *json = NULL, family[16], warn[256];
    nl_error err = {0};
    CHECK_OK(nl_chat_template_read_hf(dir, &json, family, warn, &err), &err);
    CHECK(json && strcmp(family, "llama3") == 0 && !warn[0], "llama3 from a directory: %s", family);
    nl_chat_template *t = NULL;
    if (json && nl_chat_template_parse(&t, json, strlen(json), &err) == NL_OK)
        CHECK(strcmp(t->bos, "<|begin_of_text|>") == 0, "bos from bos_token: %s", t->bos);
    nl_chat_template_destroy(&t);
    /* written back into a fresh directory: the original string */
    unlink(path);
    int wrote = 0;
    CHECK_OK(nl_chat_template_write_hf(dir, json, &wrote, &err), &err);
    char *back = NULL, fam2[16], warn2[256];
    CHECK_OK(nl_chat_template_read_hf(dir, &back, fam2, warn2, &err), &err);
    CHECK(wrote && back && strcmp(fam2, "llama3") == 0, "written back: %d %s", wrote, fam2);
    free(back);
    free(json);
    /* an unknown family: the default, with a warning, the source kept */
    f = fopen(path, "w");
    fputs("{\"chat_template\": \"{{ messages }}\"}", f);
    fclose(f);
    CHECK_OK(nl_chat_template_read_hf(dir, &json, family, warn, &err), &err);
    CHECK(json && strcmp(family, "chatml") == 0 && strstr(warn, "{{ messages }}") &&
              strstr(json, "\"source\""),
          "unknown family: the default, warned: %s", warn);
    free(json);
    unlink(path);
    rmdir(dir);
}

/* Two system messages before a user turn, where a system message goes
 * inside the next user turn (Mistral): neither is dropped, the first is a
 * user turn of its own, as a system message that no user turn follows. */
static void check_two_systems(void)
{
    static const nl_chat_msg two[] = {
        {NL_CHAT_SYSTEM, "A", 1}, {NL_CHAT_SYSTEM, "B", 1}, {NL_CHAT_USER, "Hi", 2}};
    nl_chat_template *t = NULL;
    nl_error err = {0};
    char *out = NULL;
    size_t len = 0;
    CHECK_OK(nl_chat_template_from_hf(&t, "[INST]", "<s>", "</s>", &err), &err);
    if (t)
        CHECK_OK(nl_chat_template_render(t, two, 3, 1, &out, &len, &err), &err);
    const char *want = "<s>[INST] A\n\n [/INST][INST] B\n\nHi [/INST]";
    CHECK(out && strcmp(out, want) == 0, "two system messages (mistral): got [%s]",
          out ? out : "(null)");
    free(out);
    nl_chat_template_destroy(&t);
}

/* The answer ends at the special token its template's assistant turn
 * ends with, not at another special or at text spelling it. */
static void check_answer_end(void)
{
    nl_error err = {0};
    nl_tokenizer *tok = NULL;
    CHECK_OK(nl_tokenizer_new_empty(&tok, NL_TOKENIZER_SPLIT_BYTES, &err), &err);
    for (int b = 0; b < 256 && tok; b++) { /* ids 0..255: the bytes */
        const uint8_t c = (uint8_t)b;
        CHECK_OK(nl_tokenizer_append_token(tok, &c, 1, 0, &err), &err);
    }
    static const char *const specials[] = {"<|im_end|>", "</s>", "<|eot_id|>", "<|im_start|>"};
    for (int i = 0; i < 4 && tok; i++) /* ids 256..259 */
        CHECK_OK(nl_tokenizer_append_token(tok, specials[i], strlen(specials[i]), 1, &err), &err);
    char *chatml = nl_chat_turn_end(NULL); /* the default: ChatML */
    nl_chat_template *t = NULL;
    CHECK_OK(nl_chat_template_from_hf(&t, "{{ bos_token }}[INST]", "<s>", "</s>", &err), &err);
    char *json = t ? nl_chat_template_to_json(t) : NULL;
    char *mistral = nl_chat_turn_end(json);
    CHECK(chatml && strcmp(chatml, "<|im_end|>\n") == 0, "the default's turn end: %s", chatml);
    CHECK(mistral && strstr(mistral, "</s>"), "mistral's turn end: %s", mistral);
    if (tok && chatml && mistral) {
        CHECK(nl_chat_ends_answer(tok, chatml, 256) && !nl_chat_ends_answer(tok, chatml, 257) &&
                  !nl_chat_ends_answer(tok, chatml, 259) && !nl_chat_ends_answer(tok, chatml, '<'),
              "ChatML: <|im_end|> ends an answer, </s>, <|im_start|> and a byte do not");
        CHECK(nl_chat_ends_answer(tok, mistral, 257) && !nl_chat_ends_answer(tok, mistral, 256) &&
                  !nl_chat_ends_answer(tok, NULL, 257),
              "Mistral: </s> ends an answer, <|im_end|> does not; no turn end, none");
    }
    nl_tokenizer *ours = NULL;
    CHECK_OK(nl_tokenizer_new_bytes(&ours, &err), &err);
    CHECK(nl_chat_ends_answer(ours, chatml, NL_TOKEN_END) &&
              !nl_chat_ends_answer(ours, chatml, NL_TOKEN_BEGIN) &&
              !nl_chat_ends_answer(ours, chatml, 'a') && !nl_chat_ends_answer(NULL, chatml, 1),
          "ours: <|end|> ends an answer, <|begin|> and bytes do not");
    nl_tokenizer_destroy(&ours);
    nl_tokenizer_destroy(&tok);
    nl_chat_template_destroy(&t);
    free(json);
    free(chatml);
    free(mistral);
}

int main(void)
{
    nl_chat_template *t = NULL;
    nl_error err = {0};
    CHECK_OK(nl_chat_template_default(&t, &err), &err);
    if (t)
        check_render(t,
                     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                     "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                     "<|im_start|>assistant\n",
                     "default");
    nl_chat_template_destroy(&t);
    check_family("{% for m in messages %}<|im_start|>...", "chatml",
                 "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                 "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                 "<|im_start|>assistant\n");
    check_family("{{ bos_token }}{% ... %}<|start_header_id|>", "llama3",
                 "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n");
    check_family("{% ... %}<|user|>\n", "zephyr",
                 "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n"
                 "<|user|>\nBye</s>\n<|assistant|>\n");
    check_family(
        "{{ bos_token }}[INST] <<SYS>>\\n", "llama2",
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello!</s>[INST] Bye [/INST]");
    check_family("{{ bos_token }}[INST] {{ m }} [/INST]", "mistral",
                 "<s>[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Bye [/INST]");
    check_two_systems();
    t = NULL;
    CHECK(nl_chat_template_from_hf(&t, "{{ messages }}", NULL, NULL, &err) == NL_ERR_UNSUPPORTED &&
              !t,
          "an unknown family is NL_ERR_UNSUPPORTED");
    check_refused("{\"format\": \"neurollm-chat/2\", \"generation\": \"\"}", "format");
    check_refused("{\"format\": \"neurollm-chat/1\", \"generation\": \"\", \"extra\": 1}", "extra");
    check_refused("{\"format\": \"neurollm-chat/1\", \"generation\": \"\", \"roles\": {}}",
                  "roles.system");
    check_refused("{\"format\": \"neurollm-chat/1\", \"generation\": 3}", "generation");
    check_refused("[1]", "JSON object");
    CHECK(nl_chat_role_of("developer") == NL_CHAT_SYSTEM && nl_chat_role_of("tool") < 0,
          "roles by name");
    check_hf_dir();
    check_answer_end();
    return check_done("test_chat_template");
}
