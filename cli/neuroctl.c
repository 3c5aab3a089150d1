/* neuroctl: the client. It runs the local single-process tools and (with
 * --coordinator) submits jobs to a cluster. */
#include <stdio.h>
#include <string.h>

#include "base/args.h"
#include "cli/commands.h"
#include "nl_version.h" /* written at build time: cli/version.cmake */

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *help;
} commands[] = {
    {"init", nl_cmd_init, "write a freshly initialised model checkpoint"},
    {"forward", nl_cmd_forward, "logits and aux loss for a batch of tokens"},
    {"generate", nl_cmd_generate, "generate tokens from a prompt with the KV cache"},
    {"serve", nl_cmd_serve, "serve a model over HTTP: OpenAI-style API, metrics, dashboard"},
    {"grad", nl_cmd_grad, "loss and the gradient of every weight for one batch"},
    {"embed", nl_cmd_embed, "one L2-normalised embedding per line of text (mean-pooled states)"},
    {"train", nl_cmd_train, "train a model in this process, or on a cluster (--coordinator)"},
    {"finetune", nl_cmd_finetune,
     "train LoRA adapters on a frozen model (writes the adapter file)"},
    {"lora", nl_cmd_lora, "lora merge: fold an adapter into a full checkpoint"},
    {"grow", nl_cmd_grow, "grow a checkpoint's vocabulary, depth or width (function-preserving)"},
    {"export", nl_cmd_export, "join a sharded checkpoint, or write a Hugging Face directory"},
    {"import", nl_cmd_import, "convert a Hugging Face Mixtral directory into a checkpoint"},
    {"bench", nl_cmd_bench, "measure forward, decode, training and GEMM throughput"},
    {"status", nl_cmd_status, "show a cluster's nodes, plan and predicted stage times"},
    {"jobs", nl_cmd_jobs,
     "list a cluster's jobs (a training job no client follows: train --attach)"},
    {"cluster", nl_cmd_cluster, "start (up) or stop (down) a local cluster on this machine"},
    {"keygen", nl_cmd_keygen, "write a CURVE key pair: PREFIX.key (secret) and PREFIX.pub"},
    {"tokenizer", nl_cmd_tokenizer, "train, extend, encode and decode with a BPE tokenizer"},
    {"selftest", nl_cmd_selftest, "check a backend's every slot and a small model against the CPU"},
};

#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *f)
{
    fprintf(f, "usage: neuroctl COMMAND [options]   (neuroctl help COMMAND, or neuroctl COMMAND "
               "--help, for its flags)\n"
               "       neuroctl --version\n\n"
               "commands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++)
        fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].help);
}

static int find_command(const char *name)
{
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (strcmp(name, commands[i].name) == 0)
            return (int)i;
    return -1;
}

/* An unknown command, with the closest known one when one is close. */
static int unknown_command(const char *name)
{
    const char *near = NULL;
    int near_d = -1;
    for (size_t i = 0; i < N_COMMANDS; i++) {
        int d = nl_args_nearness(name, commands[i].name);
        if (d >= 0 && (near_d < 0 || d < near_d)) {
            near = commands[i].name;
            near_d = d;
        }
    }
    if (near)
        fprintf(stderr, "neuroctl: unknown command '%s': did you mean %s?\n\n", name, near);
    else
        fprintf(stderr, "neuroctl: unknown command '%s'\n\n", name);
    usage(stderr);
    return 2;
}

static void version(void)
{
    if (NL_VERSION_GIT[0])
        printf("neuroctl %s (git %s)\n", NL_VERSION, NL_VERSION_GIT);
    else
        printf("neuroctl %s\n", NL_VERSION);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        version();
        return 0;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        (strcmp(argv[1], "help") == 0 && argc == 2)) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "help") == 0) {
        /* help COMMAND: the command's own usage, as COMMAND --help prints it */
        int c = find_command(argv[2]);
        if (c < 0)
            return unknown_command(argv[2]);
        char *help_argv[] = {argv[2], "--help", NULL};
        return commands[c].run(2, help_argv);
    }
    /* forward, generate, train, finetune, embed, grow and tokenizer learn go to a cluster when
     * one is named */
    int remote = 0;
    for (int i = 2; i < argc; i++)
        remote |= strcmp(argv[i], "--coordinator") == 0 || strcmp(argv[i], "--cluster") == 0;
    if (remote && strcmp(argv[1], "forward") == 0)
        return nl_cmd_remote_forward(argc - 1, argv + 1);
    if (remote && strcmp(argv[1], "generate") == 0)
        return nl_cmd_remote_generate(argc - 1, argv + 1);
    if (remote && strcmp(argv[1], "train") == 0)
        return nl_cmd_remote_train(argc - 1, argv + 1);
    if (remote && strcmp(argv[1], "finetune") == 0)
        return nl_cmd_remote_finetune(argc - 1, argv + 1);
    if (remote && strcmp(argv[1], "embed") == 0)
        return nl_cmd_remote_embed(argc - 1, argv + 1);
    if (remote && strcmp(argv[1], "tokenizer") == 0 && argc > 2 && strcmp(argv[2], "learn") == 0)
        return nl_cmd_remote_tokenizer_learn(argc - 1, argv + 1);
    if (remote && strcmp(argv[1], "grow") == 0)
        return nl_cmd_remote_grow(argc - 1, argv + 1);
    int c = find_command(argv[1]);
    if (c < 0)
        return unknown_command(argv[1]);
    return commands[c].run(argc - 1, argv + 1);
}
