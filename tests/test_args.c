/* base/args: the flag table's parse, its typed getters, and the suggestion
 * for an unknown flag (issue 34: --max-tokens, --step and --port came with
 * none). */
#include "base/args.h"
#include "check.h"

static nl_flag *generate_flags(void)
{
    static nl_flag flags[] = {{"model", 1, "checkpoint (safetensors)", NULL},
                              {"prompt-tokens", 1, "prompt as comma-separated token ids", NULL},
                              {"max-new", 1, "tokens to generate (default 32)", NULL},
                              {"temperature", 1, "sampling temperature", NULL},
                              {"top-p", 1, "nucleus sampling mass", NULL},
                              {"seed", 1, "sampling seed", NULL},
                              {"warmup", 0, "run the prompt once first", NULL},
                              {0}};
    for (nl_flag *fl = flags; fl->name; fl++)
        fl->value = NULL;
    return flags;
}

static void test_suggest(void)
{
    const nl_flag *g = generate_flags();
    const char *s = nl_args_suggest(g, "max-tokens");
    CHECK(s && strcmp(s, "max-new") == 0, "max-tokens: %s", s ? s : "(none)");
    s = nl_args_suggest(g, "temprature");
    CHECK(s && strcmp(s, "temperature") == 0, "temprature: %s", s ? s : "(none)");
    s = nl_args_suggest(g, "top_p");
    CHECK(s && strcmp(s, "top-p") == 0, "top_p: %s", s ? s : "(none)");
    s = nl_args_suggest(g, "prompt");
    CHECK(s && strcmp(s, "prompt-tokens") == 0, "prompt: %s", s ? s : "(none)");
    /* the same first word alone is not enough: the help must name the rest */
    nl_flag batch[] = {{"max-batch", 1, "generations decoded together", NULL},
                       {"max-requests", 1, "concurrent /v1 requests before 429", NULL},
                       {0}};
    s = nl_args_suggest(batch, "max-tokens");
    CHECK(!s, "max-tokens on serve: %s", s);
    s = nl_args_suggest(g, "port");
    CHECK(!s, "port on generate: %s", s);
    s = nl_args_suggest(g, "frobnicate");
    CHECK(!s, "frobnicate: %s", s);

    nl_flag train[] = {{"steps", 1, "optimizer steps", NULL},
                       {"step-size", 1, "unused here", NULL},
                       {"seq", 1, "sequence length", NULL},
                       {0}};
    s = nl_args_suggest(train, "step");
    CHECK(s && strcmp(s, "steps") == 0, "step: %s", s ? s : "(none)");

    /* nothing close by spelling: the one flag whose help names the word */
    nl_flag serve[] = {{"model", 1, "checkpoint to serve", NULL},
                       {"http", 1, "HOST:PORT to listen on (port 0: any free port)", NULL},
                       {"spin", 1, "iterations an idle thread spins", NULL},
                       {0}};
    s = nl_args_suggest(serve, "port");
    CHECK(s && strcmp(s, "http") == 0, "port on serve: %s", s ? s : "(none)");
    nl_flag two[] = {{"a-x", 1, "a port", NULL}, {"b-y", 1, "another port", NULL}, {0}};
    CHECK(!nl_args_suggest(two, "port"), "two flags name port: no guess");

    CHECK(nl_args_nearness("steps", "steps") == 0, "same name");
    CHECK(nl_args_nearness("lr", "seq") < 0, "lr is not seq");
    CHECK(nl_args_nearness("trian", "train") == 1, "a swap is one edit");
    CHECK(nl_args_nearness("", "train") < 0, "empty");
}

static void test_parse(void)
{
    nl_flag *g = generate_flags();
    char *ok[] = {"generate", "--model", "m.st", "--warmup", "--max-new", "5", NULL};
    CHECK(nl_args_parse(6, ok, g, "u", NULL, 0, NULL) == 0, "parse");
    CHECK(strcmp(nl_args_get(g, "model"), "m.st") == 0, "model");
    CHECK(strcmp(nl_args_get(g, "warmup"), "1") == 0, "switch");
    long long n = 0;
    CHECK(nl_args_int(g, "max-new", 1, 10, &n) == 0 && n == 5, "max-new %lld", n);
    CHECK(nl_args_int(g, "max-new", 6, 10, &n) == 2, "out of range");

    g = generate_flags();
    char *bad[] = {"generate", "--max-tokens", "5", NULL};
    CHECK(nl_args_parse(3, bad, g, "u", NULL, 0, NULL) == 2, "unknown flag is a usage error");
    char *noval[] = {"generate", "--model", NULL};
    CHECK(nl_args_parse(2, noval, g, "u", NULL, 0, NULL) == 2, "a value is missing");
}

int main(void)
{
    test_suggest();
    test_parse();
    return check_done("test_args");
}
