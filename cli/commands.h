/* neuroctl subcommands. Each takes the arguments after its own name
 * (argv[0] is the subcommand name) and returns the process exit code:
 * 0 success, 1 failure, 2 usage error. */
#ifndef NL_CLI_COMMANDS_H
#define NL_CLI_COMMANDS_H

int nl_cmd_init(int argc, char **argv);
int nl_cmd_forward(int argc, char **argv);
int nl_cmd_generate(int argc, char **argv);
int nl_cmd_serve(int argc, char **argv);
int nl_cmd_bench(int argc, char **argv);
int nl_cmd_grad(int argc, char **argv);
int nl_cmd_train(int argc, char **argv);
int nl_cmd_grow(int argc, char **argv);
int nl_cmd_export(int argc, char **argv);
int nl_cmd_keygen(int argc, char **argv);
int nl_cmd_tokenizer(int argc, char **argv);
int nl_cmd_status(int argc, char **argv);
int nl_cmd_jobs(int argc, char **argv);
int nl_cmd_cluster(int argc, char **argv);
int nl_cmd_selftest(int argc, char **argv);
int nl_cmd_import(int argc, char **argv);
int nl_cmd_embed(int argc, char **argv);
int nl_cmd_finetune(int argc, char **argv);
int nl_cmd_lora(int argc, char **argv);
/* export --format hf (cli/cmd_hf.c): src is a checkpoint or a manifest;
 * force: out may hold files (those the export writes are replaced). */
#include <stdint.h>
int nl_cli_export_hf(const char *src, const char *out, uint64_t shard_bytes, int force);
/* The same commands against a cluster (--coordinator or --cluster given). */
int nl_cmd_remote_forward(int argc, char **argv);
int nl_cmd_remote_generate(int argc, char **argv);
int nl_cmd_remote_train(int argc, char **argv);
int nl_cmd_remote_finetune(int argc, char **argv);
int nl_cmd_remote_embed(int argc, char **argv);
/* tokenizer learn on a cluster (cmd_grow_cluster.c); argv[0] is "tokenizer" */
int nl_cmd_remote_tokenizer_learn(int argc, char **argv);
/* grow on a cluster (cmd_grow_cluster.c) */
int nl_cmd_remote_grow(int argc, char **argv);

/* Poll a local cluster's status (cluster up's directory) until it is ready
 * (returns 0) or timeout_s pass (-1); state gets the last state seen, and
 * nodes (may be NULL) the number of nodes it listed (-1: no status). */
#include <stddef.h>
int nl_remote_wait_ready(const char *dir, int timeout_s, char *state, size_t cap, int *nodes);

#endif
