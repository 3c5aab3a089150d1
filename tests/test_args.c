/* base/args: the flag table's parse, its typed getters, and the suggestion
 * for an unknown flag (issue 34: --max-tokens, --step and --port came with
 * none). */
#include <string.h>

#include "base/args.h"
#include "tests/check.h"

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
    /* numbers in decimal, as written: no blank before, no hexadecimal, for
     * integers, numbers and sizes alike */
    double x = 0;
    uint64_t sz = 0;
    struct {
        const char *v;
        int ok_int, ok_num, ok_size;
    } nums[] = {{"5", 1, 1, 1},   {"+5", 1, 1, 1},   {"0.5", 0, 1, 1},    {".5", 0, 1, 1},
                {"-1", 1, 1, 0},  {"1e3", 0, 1, 1},  {"8G", 0, 0, 1},     {" 5", 0, 0, 0},
                {"5 ", 0, 0, 0},  {"0x10", 0, 0, 0}, {"0X1p-1", 0, 0, 0}, {"-0x1", 0, 0, 0},
                {"inf", 0, 0, 0}, {"nan", 0, 0, 0},  {"", 0, 0, 0},       {"1e-320", 0, 0, 0}};
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        g[2].value = nums[i].v; /* max-new */
        CHECK((nl_args_int(g, "max-new", -10, 1000, &n) == 0) == nums[i].ok_int, "int '%s'",
              nums[i].v);
        CHECK((nl_args_double(g, "max-new", -10, 1e4, &x) == 0) == nums[i].ok_num, "number '%s'",
              nums[i].v);
        CHECK((nl_args_size(g, "max-new", &sz) == 0) == nums[i].ok_size, "size '%s'", nums[i].v);
    }

    g = generate_flags();
    char *bad[] = {"generate", "--max-tokens", "5", NULL};
    CHECK(nl_args_parse(3, bad, g, "u", NULL, 0, NULL) == 2, "unknown flag is a usage error");
    char *noval[] = {"generate", "--model", NULL};
    CHECK(nl_args_parse(2, noval, g, "u", NULL, 0, NULL) == 2, "a value is missing");
}

/* The typed table: defaults from the row, each type and range checked,
 * --help from the same rows, and an unknown flag suggested as before. */
struct gen_opts {
    const char *model;
    bool warmup;
    int max_new;
    long long seed;
    double top_p;
    uint64_t kv;
    int wire;
};

static void gen_table(nl_opt *t, struct gen_opts *o)
{
    *o = (struct gen_opts){.seed = 7, .wire = -1};
    nl_opt rows[] = {NL_OPT_STR("model", &o->model, "checkpoint (safetensors)"),
                     NL_OPT_SWITCH("warmup", &o->warmup, "run the prompt once first"),
                     NL_OPT_INT("max-new", &o->max_new, 1, 100, "32", "tokens to generate"),
                     NL_OPT_LLONG("seed", &o->seed, 0, INT64_MAX, NULL, "sampling seed"),
                     NL_OPT_DOUBLE("top-p", &o->top_p, 0.0, 1.0, "0.9", "nucleus sampling mass"),
                     NL_OPT_SIZE("kv-budget", &o->kv, "256M", "KV caches"),
                     NL_OPT_CHOICE("wire", &o->wire, "fp32|bf16", "fp32", "hidden states"),
                     NL_OPT_END};
    memcpy(t, rows, sizeof rows);
}

static void test_opts(void)
{
    nl_opt t[8];
    struct gen_opts o;
    gen_table(t, &o);
    char *none[] = {"generate", NULL};
    CHECK(nl_opts_parse(1, none, t, "u", NULL, 0, NULL) == 0, "no flags");
    CHECK(o.max_new == 32 && o.top_p == 0.9 && o.kv == 256ull << 20 && o.wire == 0,
          "defaults: %d %g %llu %d", o.max_new, o.top_p, (unsigned long long)o.kv, o.wire);
    CHECK(o.seed == 7 && !o.model && !o.warmup, "no default: the destination keeps its value");
    CHECK(!nl_opts_get(t, "max-new"), "a default is not a given value");

    gen_table(t, &o);
    const char *pos[1];
    int np = 0;
    char *ok[] = {"generate", "--model",    "m.st",    "--warmup", "--max-new",   "5",
                  "--seed",   "9000000000", "--top-p", "0.5",      "--kv-budget", "1G",
                  "--wire",   "bf16",       "x",       NULL};
    CHECK(nl_opts_parse(15, ok, t, "u", pos, 1, &np) == 0, "parse");
    CHECK(o.model && strcmp(o.model, "m.st") == 0 && o.warmup && o.max_new == 5, "str/switch/int");
    CHECK(o.seed == 9000000000LL && o.top_p == 0.5 && o.kv == 1ull << 30 && o.wire == 1,
          "llong/double/size/choice");
    CHECK(np == 1 && strcmp(pos[0], "x") == 0, "positional");
    CHECK(strcmp(nl_opts_get(t, "max-new"), "5") == 0, "the text given");

    char *range[] = {"generate", "--max-new", "101", NULL};
    gen_table(t, &o);
    CHECK(nl_opts_parse(3, range, t, "u", NULL, 0, NULL) == 2, "out of range");
    char *choice[] = {"generate", "--wire", "fp16", NULL};
    gen_table(t, &o);
    CHECK(nl_opts_parse(3, choice, t, "u", NULL, 0, NULL) == 2, "not a choice");
    char *nan[] = {"generate", "--top-p", "nan", NULL};
    gen_table(t, &o);
    CHECK(nl_opts_parse(3, nan, t, "u", NULL, 0, NULL) == 2, "nan");
    char *unknown[] = {"generate", "--max-tokens", "5", NULL};
    gen_table(t, &o);
    CHECK(nl_opts_parse(3, unknown, t, "u", NULL, 0, NULL) == 2, "unknown");

    /* --help: one line a row, the default from the row */
    char buf[2048] = "";
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    nl_opts_help(f, "generate [flags]", t);
    fclose(f);
    CHECK(strstr(buf, "usage: generate [flags]\n") != NULL, "usage");
    CHECK(strstr(buf, "--max-new            tokens to generate (default 32)\n") != NULL, "%s", buf);
    CHECK(strstr(buf, "--seed               sampling seed\n") != NULL, "no default shown");
}

int main(void)
{
    test_suggest();
    test_parse();
    test_opts();
    return check_done("test_args");
}
