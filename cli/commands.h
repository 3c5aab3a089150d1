/* neuroctl subcommands. Each takes the arguments after its own name
 * (argv[0] is the subcommand name) and returns the process exit code:
 * 0 success, 1 failure, 2 usage error. */
#ifndef NL_CLI_COMMANDS_H
#define NL_CLI_COMMANDS_H

int nl_cmd_init(int argc, char **argv);
int nl_cmd_forward(int argc, char **argv);
int nl_cmd_generate(int argc, char **argv);
int nl_cmd_bench(int argc, char **argv);
int nl_cmd_grad(int argc, char **argv);
int nl_cmd_train(int argc, char **argv);
int nl_cmd_grow(int argc, char **argv);
int nl_cmd_keygen(int argc, char **argv);
int nl_cmd_tokenizer(int argc, char **argv);

#endif
