/* neuroctl grow: grow a checkpoint (one file) or a sharded checkpoint (a
 * manifest) in vocabulary, depth and width (DESIGN.md section 5,
 * core/grow/grow.h), recording each growth in its history. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "core/formats/checkpoint.h"
#include "core/formats/manifest.h"
#include "core/grow/grow.h"
#include "core/tokenizer/tokenizer.h"

static int fail(const nl_error *err)
{
    fprintf(stderr, "neuroctl grow: %s (%s)\n", err->msg, nl_status_str(err->status));
    return 1;
}

/* Every id of `old` has the same bytes in `new`. */
static int extends(const nl_tokenizer *old, const nl_tokenizer *new_tok, int32_t *bad)
{
    for (int32_t id = 0; id < nl_tokenizer_vocab_size(old); id++) {
        const uint8_t *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        if (nl_tokenizer_token_bytes(old, id, &a, &na) != NL_OK ||
            nl_tokenizer_token_bytes(new_tok, id, &b, &nb) != NL_OK || na != nb ||
            memcmp(a, b, na) != 0) {
            *bad = id;
            return 0;
        }
    }
    return 1;
}

/* The new tokenizer of --tokenizer, checked against the model's (old_text:
 * its file text, or NULL for none): *text gets its file text and
 * spec->vocab_size its size. */
static nl_status new_tokenizer(const char *path, const char *old_text, nl_grow_spec *spec,
                               char **text, nl_error *err)
{
    nl_tokenizer *old = NULL, *tok = NULL;
    size_t len = 0;
    int32_t bad = -1;
    nl_status st = nl_tokenizer_load(&tok, path, err);
    if (st == NL_OK && old_text)
        st = nl_tokenizer_load_buffer(&old, old_text, strlen(old_text), err);
    if (st == NL_OK && old && !extends(old, tok, &bad))
        st = nl_error_set(err, NL_ERR_INVALID,
                          "%s does not extend the model's tokenizer: id %d differs or is missing",
                          path, bad);
    if (st == NL_OK)
        st = nl_tokenizer_save_buffer(tok, text, &len, err);
    if (st == NL_OK)
        spec->vocab_size = nl_tokenizer_vocab_size(tok);
    nl_tokenizer_destroy(&old);
    nl_tokenizer_destroy(&tok);
    return st;
}

static void report(const nl_growth *g)
{
    char line[256];
    nl_growth_describe(g, line, sizeof line);
    printf("  %s\n", line);
}

/* One checkpoint file: load, grow in memory with its moments, save. */
static int grow_model(const char *model, const char *out, const char *tok_path, nl_grow_spec spec,
                      long long seed)
{
    nl_error err = {0};
    nl_backend *be = NULL;
    nl_model *m = NULL;
    char *old_tok = NULL, *tok_text = NULL, *init_seed = NULL, *train = NULL;
    float *mom[2] = {NULL, NULL};
    int64_t step = 0, adam = 0;
    int rc = 1, first = 0;
    if (nl_backend_new(&be, "cpu", &(nl_backend_opts){.threads = 0}, &err) != NL_OK ||
        nl_checkpoint_load(&m, be, model, 0, -1, 1, 1, &step, &err) != NL_OK ||
        nl_checkpoint_meta(model, "tokenizer", &old_tok, &err) != NL_OK ||
        nl_checkpoint_init_seed(model, &init_seed, &err) != NL_OK)
        goto out;
    if (tok_path && new_tokenizer(tok_path, old_tok, &spec, &tok_text, &err) != NL_OK)
        goto out;
    for (int i = 0; i < 2; i++)
        if (!(mom[i] = be->alloc(be, m->n_params * sizeof(float)))) {
            nl_error_set(&err, NL_ERR_NOMEM, "out of memory");
            goto out;
        }
    nl_status st = nl_checkpoint_load_optim(m, model, mom[0], mom[1], &adam, &train, &err);
    if (st != NL_OK && st != NL_ERR_NOTFOUND)
        goto out;
    const int has_optim = st == NL_OK;
    if (seed < 0)
        seed = init_seed ? atoll(init_seed) : 0;
    first = m->n_growth;
    for (int k = NL_GROW_VOCAB; k <= NL_GROW_WIDTH; k++) {
        nl_growth g = {.step = step, .kind = k, .before = m->cfg, .adam_steps = adam};
        if (k == NL_GROW_VOCAB && spec.vocab_size)
            st = nl_model_grow_vocab(m, spec.vocab_size, (uint64_t)seed, mom, 2, &err);
        else if (k == NL_GROW_DEPTH && spec.n_layers)
            st = nl_model_grow_depth(m, spec.n_layers, (uint64_t)seed, mom, 2, &err);
        else if (k == NL_GROW_WIDTH && (spec.hidden_dim || spec.ffn_dim))
            st = nl_model_grow_width(m, spec.hidden_dim ? spec.hidden_dim : m->cfg.hidden_dim,
                                     spec.ffn_dim, (uint64_t)seed, mom, 2, &err);
        else
            continue;
        if (st != NL_OK)
            goto out;
        g.after = m->cfg;
        char *x = nl_config_to_json(&g.before), *y = nl_config_to_json(&g.after);
        const int changed = x && y && strcmp(x, y) != 0;
        free(x);
        free(y);
        if (changed && nl_model_add_growth(m, &g, &err) != NL_OK)
            goto out;
    }
    if (m->n_growth == first) {
        nl_error_set(&err, NL_ERR_INVALID, "nothing to grow: %s already has these sizes", model);
        goto out;
    }
    nl_ckpt_extra extra = {.m = has_optim ? mom[0] : NULL,
                           .v = has_optim ? mom[1] : NULL,
                           .adam_steps = adam,
                           .train_json = train,
                           .tokenizer = tok_text ? tok_text : old_tok,
                           .init_seed = init_seed};
    if (nl_checkpoint_save(m, out, step, &extra, &err) != NL_OK)
        goto out;
    printf("grew %s at step %" PRId64 "%s; wrote %s\n", model, step,
           has_optim ? " (optimizer state too)" : "", out);
    for (int i = first; i < m->n_growth; i++)
        report(&m->growth[i]);
    rc = 0;
out:
    for (int i = 0; i < 2; i++)
        if (mom[i])
            be->free(be, mom[i]);
    free(old_tok);
    free(tok_text);
    free(init_seed);
    free(train);
    nl_model_destroy(&m);
    nl_backend_destroy(&be);
    return rc ? fail(&err) : 0;
}

/* A sharded checkpoint: nl_manifest_grow writes the grown shards and
 * manifest into the directory `out`. */
static int grow_manifest(const char *manifest, const char *out, const char *tok_path,
                         nl_grow_spec spec, long long seed)
{
    nl_error err = {0};
    nl_manifest *m = NULL, *g = NULL;
    char *tok_text = NULL, *path = NULL;
    int rc = 1;
    if (nl_manifest_load(&m, manifest, &err) != NL_OK)
        goto out;
    if (tok_path && new_tokenizer(tok_path, m->tokenizer, &spec, &tok_text, &err) != NL_OK)
        goto out;
    spec.tokenizer = tok_text;
    if (nl_manifest_grow(manifest, &spec, seed < 0 ? UINT64_MAX : (uint64_t)seed, out, &path,
                         &err) != NL_OK ||
        nl_manifest_load(&g, path, &err) != NL_OK)
        goto out;
    printf("grew %s at step %" PRId64 "; wrote %s\n", manifest, g->step, path);
    for (int i = m->n_growth; i < g->n_growth; i++)
        report(&g->growth[i]);
    rc = 0;
out:
    free(tok_text);
    free(path);
    nl_manifest_destroy(&m);
    nl_manifest_destroy(&g);
    return rc ? fail(&err) : 0;
}

int nl_cmd_grow(int argc, char **argv)
{
    nl_flag flags[] = {
        {"model", 1, "checkpoint to grow (weights, and optimizer state if it has one)", NULL},
        {"manifest", 1, "sharded checkpoint to grow (its directory or manifest file)", NULL},
        {"out", 1,
         "grown checkpoint to write (with --manifest: the directory to write into, new or "
         "without the files it writes; never replaced)",
         NULL},
        {"vocab-size", 1, "new active vocabulary", NULL},
        {"tokenizer", 1, "new tokenizer (must extend the model's): its size is the vocabulary",
         NULL},
        {"layers", 1, "new number of layers (appended identity blocks)", NULL},
        {"hidden-dim", 1, "new width d (whole heads of the same head dim)", NULL},
        {"ffn-dim", 1, "new expert hidden size F", NULL},
        {"seed", 1, "seed for the new parameters (default: the checkpoint's init_seed, else 0)",
         NULL},
        NL_CLI_FORCE_FLAG,
        {0}};
    const char *usage =
        "neuroctl grow (--model MODEL --out GROWN [--force] | --manifest DIR --out DIR2) "
        "[--vocab-size N | --tokenizer TOK] [--layers N] [--hidden-dim D] [--ffn-dim F] "
        "[--seed S]\n"
        "       neuroctl grow (--cluster DIR | --coordinator EP ...) [--layers N] [--hidden-dim D "
        "[--ffn-dim F]]: the cluster's model (docs/cluster.md, \"Growth\")";
    int rc = nl_args_parse(argc, argv, flags, usage, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? 0 : rc;
    const char *model = nl_args_get(flags, "model"), *manifest = nl_args_get(flags, "manifest");
    const char *out = nl_args_get(flags, "out"), *tok_path = nl_args_get(flags, "tokenizer");
    long long vocab = 0, layers = 0, d = 0, f = 0, seed = -1;
    if ((rc = nl_cli_require("grow", usage, flags, "out", (const char *)NULL)))
        return rc;
    if (!model == !manifest) {
        fprintf(stderr, "neuroctl grow: give one of --model and --manifest\n\n");
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    if (manifest && nl_args_get(flags, "force")) {
        /* the shards a grown set writes may be named as the source's: never replaced */
        fprintf(stderr, "neuroctl grow: --force goes with --model; with --manifest, --out is a "
                        "directory whose files are never replaced: give a new or empty one\n");
        return 2;
    }
    if (nl_args_get(flags, "vocab-size") && tok_path) {
        fprintf(stderr, "neuroctl grow: give --vocab-size or --tokenizer, not both\n");
        return 2;
    }
    if ((rc = nl_args_int(flags, "vocab-size", 1, NL_CONFIG_MAX_VOCAB, &vocab)) ||
        (rc = nl_args_int(flags, "layers", 1, NL_CONFIG_MAX_LAYERS, &layers)) ||
        (rc = nl_args_int(flags, "hidden-dim", 1, NL_CONFIG_MAX_DIM, &d)) ||
        (rc = nl_args_int(flags, "ffn-dim", 1, NL_CONFIG_MAX_DIM, &f)) ||
        (rc = nl_args_int(flags, "seed", 0, INT64_MAX, &seed)))
        return rc;
    if (!vocab && !tok_path && !layers && !d && !f) {
        fprintf(stderr, "neuroctl grow: say what grows: --vocab-size or --tokenizer, --layers, "
                        "--hidden-dim, --ffn-dim\n\n");
        nl_args_help(stderr, usage, flags);
        return 2;
    }
    nl_grow_spec spec = {
        .vocab_size = vocab, .n_layers = (int)layers, .hidden_dim = (int)d, .ffn_dim = (int)f};
    if (manifest)
        return grow_manifest(manifest, out, tok_path, spec, seed);
    if ((rc = nl_cli_may_write(flags, "out", out)))
        return rc;
    return grow_model(model, out, tok_path, spec, seed);
}
