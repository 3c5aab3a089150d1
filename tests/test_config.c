/* Config parsing: YAML defaults (DESIGN.md section 2), a matrix of bad
 * configs each refused with a message naming the key, file errors naming
 * path and line, and the JSON form's exact round trip. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/model/config.h"
#include "tests/check.h"

static nl_status parse(nl_config *c, const char *yaml, nl_error *err)
{
    return nl_config_parse_yaml(c, yaml, strlen(yaml), err);
}

static void test_defaults(void)
{
    nl_config c;
    nl_error err = {0};
    CHECK_OK(parse(&c, "hidden_dim: 512\nnum_layers: 4\n", &err), &err);
    CHECK(c.hidden_dim == 512 && c.num_layers == 4, "d %d L %d", c.hidden_dim, c.num_layers);
    CHECK(c.num_heads == 8, "H = d/64: %d", c.num_heads);
    CHECK(c.num_kv_heads == 2, "G = H/4: %d", c.num_kv_heads);
    CHECK(c.ffn_dim == 2048, "F = 4d: %d", c.ffn_dim);
    CHECK(c.num_experts == 8 && c.top_k == 2, "E %d top_k %d", c.num_experts, c.top_k);
    CHECK(c.max_seq_len == 2048, "max_seq_len %d", c.max_seq_len);
    CHECK(c.rope_base == 10000.0 && c.norm_eps == 1e-6 && c.aux_loss_coef == 0.01,
          "rope %g eps %g aux %g", c.rope_base, c.norm_eps, c.aux_loss_coef);
    CHECK(c.vocab_chunk == 32768 && c.vocab_size == NL_DEFAULT_VOCAB, "chunk %lld vocab %lld",
          (long long)c.vocab_chunk, (long long)c.vocab_size);
    CHECK(nl_config_capacity(&c) == 32768, "capacity %lld", (long long)nl_config_capacity(&c));

    /* G = max(1, H/4) */
    CHECK_OK(parse(&c, "hidden_dim: 128\nnum_layers: 1\n", &err), &err);
    CHECK(c.num_heads == 2 && c.num_kv_heads == 1, "H %d G %d", c.num_heads, c.num_kv_heads);

    /* A config to be sized by the coordinator: {} or only a few keys. */
    CHECK_OK(parse(&c, "{}", &err), &err);
    CHECK(c.hidden_dim == 0 && c.num_layers == 0 && c.num_heads == 0, "unsized");
    CHECK_OK(parse(&c, "# comment\ntop_k: 1\n", &err), &err);
    CHECK(c.top_k == 1 && c.num_experts == 8, "top_k %d", c.top_k);

    /* Every key given explicitly. */
    const char *full = "vocab_size: 50000\nvocab_chunk: 1024\nhidden_dim: 256\nnum_layers: 3\n"
                       "num_heads: 8\nnum_kv_heads: 4\nffn_dim: 640\nnum_experts: 4\ntop_k: 1\n"
                       "max_seq_len: 512\nrope_base: 500000.0\nnorm_eps: 1e-5\n"
                       "aux_loss_coef: 0\n";
    CHECK_OK(parse(&c, full, &err), &err);
    CHECK(c.vocab_size == 50000 && c.vocab_chunk == 1024 && c.hidden_dim == 256 &&
              c.num_layers == 3 && c.num_heads == 8 && c.num_kv_heads == 4 && c.ffn_dim == 640 &&
              c.num_experts == 4 && c.top_k == 1 && c.max_seq_len == 512 &&
              c.rope_base == 500000.0 && c.norm_eps == 1e-5 && c.aux_loss_coef == 0.0,
          "explicit keys");
    CHECK(nl_config_capacity(&c) == 50176, "capacity %lld", (long long)nl_config_capacity(&c));
}

static const struct bad {
    const char *yaml;
    const char *want[3]; /* substrings the message must hold */
} bad_yaml[] = {
    {"hidden_dim: 512\nnum_layers: 2\nnum_heads: 8\nnum_kv_heads: 3\n",
     {"line 4", "num_kv_heads", "does not divide"}},
    {"hidden_dim: 512\nnum_layers: 2\nnum_heads: 7\n", {"line 3", "num_heads", "does not divide"}},
    {"hidden_dim: 96\nnum_layers: 2\nnum_heads: 32\n", {"num_heads", "even"}},
    {"top_k: 9\n", {"line 1", "top_k", "num_experts"}},
    {"num_experts: 2\ntop_k: 3\n", {"top_k", "1..num_experts (2)"}},
    {"hidden_dim: 0\n", {"line 1", "hidden_dim", "at least 1"}},
    {"num_layers: -3\n", {"num_layers", "at least 1"}},
    {"ffn_dim: 0\n", {"ffn_dim", "at least 1"}},
    {"vocab_chunk: -1\n", {"vocab_chunk"}},
    {"num_experts: 0\n", {"num_experts"}},
    {"hidden_dim: 512\n", {"num_layers", "missing"}},
    {"hidden_dim: 100000\nnum_layers: 1\n", {"hidden_dim", "outside"}},
    /* Found by fuzz_config: 4 d overflowed an int before validation. */
    {"hidden_dim: 1474836483\nnum_layers: 1\n", {"line 1", "hidden_dim", "outside"}},
    {"hiden_dim: 512\n", {"line 1", "unknown key 'hiden_dim'"}},
    {"top_k: 2\n\nfoo: 1\n", {"line 3", "unknown key 'foo'"}},
    {"hidden_dim: abc\n", {"hidden_dim", "expected an integer", "'abc'"}},
    {"hidden_dim: 512.0\n", {"hidden_dim", "expected an integer"}},
    {"hidden_dim: 1e3\n", {"hidden_dim", "expected an integer"}},
    {"hidden_dim: 0x200\n", {"hidden_dim", "expected an integer"}},
    {"hidden_dim: 0512\n", {"hidden_dim", "expected an integer"}},
    {"hidden_dim: \"512\"\n", {"hidden_dim", "quoted"}},
    {"hidden_dim: !!int 512\n", {"hidden_dim", "tagged"}},
    {"hidden_dim:\n", {"hidden_dim", "expected an integer"}},
    {"hidden_dim: [1, 2]\n", {"hidden_dim", "sequence"}},
    {"hidden_dim:\n  - 1\n", {"line 2", "hidden_dim", "sequence"}},
    {"hidden_dim: {a: 1}\n", {"hidden_dim", "mapping"}},
    {"top_k: &x 2\nnum_experts: *x\n", {"line 2", "num_experts", "alias"}},
    {"hidden_dim: 99999999999\n", {"hidden_dim", "out of range"}},
    {"vocab_size: 999999999999999999999999\n", {"vocab_size", "out of range"}},
    {"vocab_size: 99999999999\n", {"vocab_size", "outside"}},
    {"norm_eps: 1e-400\n", {"norm_eps", "out of range"}},
    {"rope_base: 1e400\n", {"rope_base", "out of range"}},
    {"rope_base: .inf\n", {"rope_base", "expected a number"}},
    {"norm_eps: nan\n", {"norm_eps", "expected a number"}},
    {"norm_eps: 2\n", {"norm_eps", "(0, 1)"}},
    {"rope_base: 0.5\n", {"rope_base", "above 1"}},
    {"aux_loss_coef: -0.1\n", {"aux_loss_coef", ">= 0"}},
    {"top_k: 2\ntop_k: 2\n", {"line 2", "top_k", "duplicate key (first given on line 1)"}},
    {"top_k: 2\nhidden_dim: 5: 3\n", {"line 2", "YAML syntax error", "mapping values"}},
    /* a mis-indented line is named, not the key above it (issue 34, item 5) */
    {"hidden_dim: 32\nnum_layers: 2\n  num_heads: 2\n",
     {"line 3: num_layers", "'2 num_heads'", "line 3 is indented deeper than the key num_layers"}},
    {"  hidden_dim: 32\nnum_layers: 2\n", {"line 2: YAML syntax error", "indentation"}},
    {"hidden_dim: 32\n\tnum_layers: 2\n", {"line 2", "YAML syntax error"}},
    {"{top_k: 2\n", {"YAML syntax error"}},
    {"\"unterminated\n", {"YAML syntax error"}},
    {"- 1\n- 2\n", {"line 1", "must be a mapping", "sequence"}},
    {"hello\n", {"must be a mapping", "scalar"}},
    {"top_k: 2\n---\ntop_k: 1\n", {"line 2", "more than one YAML document"}},
    {"", {"empty"}},
    {"# only a comment\n", {"empty"}},
    {"? [a]\n: 1\n", {"expected a key name", "sequence"}},
};

static void test_bad_yaml(void)
{
    for (size_t i = 0; i < sizeof bad_yaml / sizeof bad_yaml[0]; i++) {
        const struct bad *b = &bad_yaml[i];
        nl_config c;
        nl_error err = {0};
        nl_status st = parse(&c, b->yaml, &err);
        CHECK(st == NL_ERR_INVALID, "case %zu (%s): status %s", i, b->yaml, nl_status_str(st));
        for (int k = 0; k < 3 && b->want[k]; k++)
            CHECK(strstr(err.msg, b->want[k]) != NULL, "case %zu (%s): '%s' not in: %s", i, b->yaml,
                  b->want[k], err.msg);
    }
    /* NUL bytes and non-ASCII in a key are shown safely. */
    nl_config c;
    nl_error err = {0};
    static const char nul_key[] = "\"a\\0\\x1b\": 1\n";
    CHECK(nl_config_parse_yaml(&c, nul_key, sizeof nul_key - 1, &err) == NL_ERR_INVALID, "nul");
    CHECK(strstr(err.msg, "unknown key 'a?\?'") != NULL, "nul key shown: %s", err.msg);
    /* Over the 1 MiB limit. */
    size_t big = (1u << 20) + 1;
    char *text = malloc(big);
    memset(text, ' ', big);
    CHECK(nl_config_parse_yaml(&c, text, big, &err) == NL_ERR_LIMIT, "limit: %s", err.msg);
    free(text);
}

static void test_files(void)
{
    char path[4096];
    nl_config c;
    nl_error err = {0};
    snprintf(path, sizeof path, "%s/test_config_%ld.yaml", check_build_dir(), (long)getpid());
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "create %s", path);
    if (!f)
        return;
    fputs("# a model\nhidden_dim: 256\nnum_layers: 2\nnum_heads: 4\n", f);
    fclose(f);
    CHECK_OK(nl_config_load_yaml(&c, path, &err), &err);
    CHECK(c.hidden_dim == 256 && c.num_heads == 4 && c.num_kv_heads == 1, "loaded");

    char want[4200];
    f = fopen(path, "w");
    fputs("hidden_dim: 256\nnum_layers: 2\n\nnum_kv_heads: 3\n", f);
    fclose(f);
    CHECK(nl_config_load_yaml(&c, path, &err) == NL_ERR_INVALID, "bad file");
    snprintf(want, sizeof want, "%s:4: num_kv_heads: 3 ", path);
    CHECK(strncmp(err.msg, want, strlen(want)) == 0, "want '%s...', got: %s", want, err.msg);

    f = fopen(path, "w");
    fputs("hidden_dim: 256\nnum_layers: two\n", f);
    fclose(f);
    CHECK(nl_config_load_yaml(&c, path, &err) == NL_ERR_INVALID, "bad type");
    snprintf(want, sizeof want, "%s:2: num_layers: expected an integer", path);
    CHECK(strncmp(err.msg, want, strlen(want)) == 0, "want '%s...', got: %s", want, err.msg);
    unlink(path);

    CHECK(nl_config_load_yaml(&c, path, &err) == NL_ERR_IO, "missing file");
    CHECK(strstr(err.msg, path) != NULL, "names the path: %s", err.msg);
}

static int config_equal(const nl_config *a, const nl_config *b)
{
    return a->vocab_size == b->vocab_size && a->vocab_chunk == b->vocab_chunk &&
           a->hidden_dim == b->hidden_dim && a->num_layers == b->num_layers &&
           a->num_heads == b->num_heads && a->num_kv_heads == b->num_kv_heads &&
           a->ffn_dim == b->ffn_dim && a->num_experts == b->num_experts && a->top_k == b->top_k &&
           a->max_seq_len == b->max_seq_len && a->rope_base == b->rope_base &&
           a->norm_eps == b->norm_eps && a->aux_loss_coef == b->aux_loss_coef &&
           a->causal == b->causal && a->ffn_act == b->ffn_act &&
           a->attention_window == b->attention_window && a->global_every == b->global_every &&
           memcmp(&a->rope_scaling, &b->rope_scaling, sizeof a->rope_scaling) == 0 &&
           a->objective == b->objective && a->mask_prob == b->mask_prob &&
           a->num_classes == b->num_classes;
}

static void test_json(void)
{
    nl_config a, b;
    nl_error err = {0};
    CHECK_OK(parse(&a, "hidden_dim: 768\nnum_layers: 12\nvocab_size: 50257\n", &err), &err);
    /* Doubles that print badly with fewer than 17 digits. */
    a.rope_base = 10000.0 / 3.0;
    a.norm_eps = 0.1 + 0.2 - 0.3 + 1e-7;
    a.aux_loss_coef = 1.0 / 7.0;
    char *json = nl_config_to_json(&a);
    CHECK(json != NULL, "to_json");
    if (!json)
        return;
    CHECK(strstr(json, "\"hidden_dim\":768") != NULL, "json: %s", json);
    CHECK_OK(nl_config_from_json(&b, json, &err), &err);
    CHECK(config_equal(&a, &b), "round trip of %s", json);
    free(json);

    /* An unsized config round-trips too (0 = still to be sized). */
    nl_config_init(&a);
    nl_config_fill_derived(&a);
    json = nl_config_to_json(&a);
    CHECK_OK(nl_config_from_json(&b, json, &err), &err);
    CHECK(config_equal(&a, &b), "unsized round trip of %s", json);
    free(json);

    static const struct {
        const char *json;
        nl_status st;
        const char *want;
    } bad[] = {
        {"{\"hidden_dim\": ", NL_ERR_FORMAT, "config JSON: line 1"},
        {"[1, 2]", NL_ERR_FORMAT, "not an object"},
        {"{\"hidden\": 1}", NL_ERR_INVALID, "unknown key 'hidden'"},
        {"{\"hidden_dim\": 1.5}", NL_ERR_INVALID, "hidden_dim: expected an integer"},
        {"{\"hidden_dim\": \"512\"}", NL_ERR_INVALID, "hidden_dim: expected an integer"},
        {"{\"norm_eps\": \"x\"}", NL_ERR_INVALID, "norm_eps: expected a number"},
        {"{\"top_k\": 2, \"top_k\": 2}", NL_ERR_FORMAT, "duplicate"},
        {"{\"hidden_dim\": 4294967808}", NL_ERR_INVALID, "hidden_dim: 4294967808 is out of range"},
        {"{\"num_heads\": -4}", NL_ERR_INVALID, "num_heads: -4 must not be negative"},
        {"{\"hidden_dim\": 64, \"num_layers\": 1, \"num_heads\": 3}", NL_ERR_INVALID,
         "num_heads: 3 does not divide"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        nl_status st = nl_config_from_json(&b, bad[i].json, &err);
        CHECK(st == bad[i].st, "json case %zu: %s", i, nl_status_str(st));
        CHECK(strstr(err.msg, bad[i].want) != NULL, "json case %zu: '%s' not in: %s", i,
              bad[i].want, err.msg);
    }
}

/* The DESIGN section 6 keys: YAML (rope_scaling nested), defaults kept
 * out of the JSON, round trips, and errors that name the key. */
static void test_variants(void)
{
    nl_config a, b;
    nl_error err = {0};
    CHECK_OK(parse(&a, "hidden_dim: 64\nnum_layers: 2\n", &err), &err);
    CHECK(a.causal == 1 && a.ffn_act == NL_FFN_SWIGLU && a.attention_window == 0 &&
              a.global_every == 1 && a.rope_scaling.type == NL_ROPE_NONE,
          "section 6 defaults");
    char *json = nl_config_to_json(&a);
    CHECK(json && !strstr(json, "causal") && !strstr(json, "ffn_act") &&
              !strstr(json, "rope_scaling") && !strstr(json, "window"),
          "defaults stay out of the JSON: %s", json ? json : "(null)");
    free(json);
    const char *y = "hidden_dim: 64\nnum_layers: 3\ncausal: false\nffn_act: geglu\n"
                    "num_experts: 1\ntop_k: 1\nattention_window: 128\nglobal_every: 3\n"
                    "rope_scaling:\n  type: yarn\n  factor: 4\n  original_max_seq_len: 512\n"
                    "vocab_size: 300\nobjective: mlm\nmask_prob: 0.15\nnum_classes: 4\n";
    /* global_every 0: every layer local (Mistral's sliding window) */
    CHECK_OK(
        parse(&a, "hidden_dim: 64\nnum_layers: 3\nattention_window: 8\nglobal_every: 0\n", &err),
        &err);
    CHECK(a.global_every == 0 && nl_config_layer_local(&a, 0) && nl_config_layer_local(&a, 2),
          "global_every 0 makes layer 0 local too");
    json = nl_config_to_json(&a);
    CHECK(json && strstr(json, "\"global_every\":0"), "global_every 0 in the JSON: %s",
          json ? json : "(null)");
    CHECK_OK(nl_config_from_json(&b, json, &err), &err);
    CHECK(b.global_every == 0, "global_every 0 reads back");
    free(json);
    CHECK_OK(parse(&a, y, &err), &err);
    CHECK(a.causal == 0 && a.ffn_act == NL_FFN_GEGLU && a.num_experts == 1 &&
              a.attention_window == 128 && a.global_every == 3 &&
              a.rope_scaling.type == NL_ROPE_YARN && a.rope_scaling.factor == 4.0 &&
              a.rope_scaling.original_max_seq_len == 512 && a.rope_scaling.beta_fast == 32.0 &&
              a.rope_scaling.beta_slow == 1.0 && a.objective == NL_OBJ_MLM && a.mask_prob == 0.15 &&
              a.num_classes == 4,
          "section 6 keys from YAML");
    CHECK(nl_config_dense(&a) && !nl_config_layer_local(&a, 0) && nl_config_layer_local(&a, 1) &&
              !nl_config_layer_local(&a, 3),
          "dense, and layer l global when l %% 3 == 0");
    json = nl_config_to_json(&a);
    CHECK(json && strstr(json, "\"causal\":false") && strstr(json, "\"ffn_act\":\"geglu\"") &&
              strstr(json, "\"type\":\"yarn\""),
          "section 6 JSON: %s", json ? json : "(null)");
    if (json) {
        CHECK_OK(nl_config_from_json(&b, json, &err), &err);
        CHECK(config_equal(&a, &b), "round trip of %s", json);
    }
    free(json);

    /* 0 written out where it is the default that turns a variant off:
     * the model above, unchanged */
    CHECK_OK(parse(&a, "attention_window: 0\nnum_classes: 0\nglobal_every: 0\n", &err), &err);
    CHECK(a.attention_window == 0 && a.num_classes == 0 && a.global_every == 0,
          "attention_window, num_classes and global_every 0: %d %d %d", a.attention_window,
          a.num_classes, a.global_every);
    static const struct {
        const char *yaml, *want;
    } bad[] = {
        {"attention_window: -1\n", "attention_window: -1 must be 0 or more"},
        {"num_classes: -2\n", "num_classes: -2 must be 0 or more"},
        {"causal: 0\n", "causal: expected true or false"},
        {"ffn_act: relu\n", "ffn_act: expected swiglu or geglu"},
        {"rope_scaling: yarn\n", "rope_scaling: expected a mapping"},
        {"rope_scaling:\n  type: ntk\n", "rope_scaling.type: expected yarn"},
        {"rope_scaling:\n  kind: yarn\n", "unknown key 'rope_scaling.kind'"},
        {"rope_scaling:\n  type: yarn\n  factor: 4\n", "original_max_seq_len 0"},
        /* found by fuzz_config: yarn's fields with type none, lost in the JSON */
        {"rope_scaling:\n  type: none\n  factor: 4\n", "apply to type yarn only"},
        {"rope_scaling:\n  beta_slow: 2\n", "apply to type yarn only"},
        {"rope_scaling:\n  type: yarn\n  factor: 0.5\n  original_max_seq_len: 8\n", "factor 0.5"},
        {"num_experts: 1\ntop_k: 2\n", "top_k: 2 must be in 1..num_experts"},
        {"global_every: -1\n", "global_every: -1 must be 0 or more"},
        {"factor: 4\n", "unknown key 'factor'"},
        {"objective: mlm\n", "objective: mlm needs vocab_size above the mask id 258"},
        {"objective: rtd\n", "objective: expected clm or mlm"},
        {"mask_prob: 1.5\n", "mask_prob: 1.5 must be in (0, 1]"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        nl_status st = parse(&a, bad[i].yaml, &err);
        CHECK(st == NL_ERR_INVALID, "variant case %zu: %s", i, nl_status_str(st));
        CHECK(strstr(err.msg, bad[i].want) != NULL, "variant case %zu: '%s' not in: %s", i,
              bad[i].want, err.msg);
    }
    static const char *const bad_json[] = {"{\"causal\": 1}", "{\"ffn_act\": 2}",
                                           "{\"rope_scaling\": [1]}",
                                           "{\"rope_scaling\": {\"type\": \"yarn\", \"x\": 1}}"};
    for (size_t i = 0; i < sizeof bad_json / sizeof bad_json[0]; i++)
        CHECK(nl_config_from_json(&b, bad_json[i], &err) == NL_ERR_INVALID, "json variant %zu: %s",
              i, err.msg);
}

/* nl_config_validate itself refuses a non-finite rope_base (a YAML or JSON
 * number cannot spell one; a config built in code can) */
static void test_validate_nonfinite(void)
{
    nl_config c;
    nl_error err = {0};
    CHECK_OK(parse(&c, "hidden_dim: 64\nnum_layers: 2\n", &err), &err);
    c.rope_base = INFINITY;
    CHECK(nl_config_validate(&c, 1, &err) != NL_OK, "rope_base inf is refused");
    CHECK(strstr(err.msg, "rope_base") != NULL, "the error names rope_base: %s", err.msg);
}

int main(void)
{
    test_defaults();
    test_bad_yaml();
    test_files();
    test_json();
    test_variants();
    test_validate_nonfinite();
    return check_done("test_config");
}
