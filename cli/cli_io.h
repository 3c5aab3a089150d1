/* File helpers, the device flags and the generation clock shared by
 * neuroctl's commands. */
#ifndef NL_CLI_IO_H
#define NL_CLI_IO_H

#include "base/args.h"
#include "base/clock.h"
#include "core/formats/fileio.h"
#include "core/formats/safetensors.h"
#include "core/model/kvcache.h"
#include "kernels/backend.h"

/* Read an integer tensor `name` ([B, T], I32 or I64, 1..2^24 entries, each
 * fitting int32) from an open safetensors file into a malloc'd array. */
nl_status nl_cli_read_ids(nl_st_file *f, const char *path, const char *name, int32_t **out, int *B,
                          int *T, nl_error *err);

/* The same from a file path. */
nl_status nl_cli_read_ids_file(const char *path, const char *name, int32_t **out, int *B, int *T,
                               nl_error *err);

/* "1,2,3" -> a malloc'd array of ids (--prompt-tokens). Returns the count,
 * or -1 after printing the fault to stderr. */
int nl_cli_parse_ids(const char *s, int32_t **out);

/* The flags that pick where a local command computes: --device D (cpu,
 * cpu-devsim or cuda:N; default cpu) and, where a GPU may run, --tf32. */
#define NL_CLI_DEVICE_HELP "D: where to compute: cpu (default), cpu-devsim or cuda:N"
#define NL_CLI_TF32_HELP "GPU GEMMs may use TF32 tensor-core math (default: FP32)"
#define NL_CLI_PRECISION_HELP                                                                      \
    "P: GEMM precision, fp32 or bf16 (CPU with AVX512-BF16 or AMX, or a CUDA GPU of compute "      \
    "capability 8.0 or newer; FP32 master weights, accumulation, norms, softmax, loss and "        \
    "optimizer)"
/* clang-format off */
#define NL_CLI_DEVICE_FLAG {"device", 1, NL_CLI_DEVICE_HELP, NULL}
#define NL_CLI_TF32_FLAG {"tf32", 0, NL_CLI_TF32_HELP, NULL}
#define NL_CLI_PRECISION_FLAG {"precision", 1, NL_CLI_PRECISION_HELP " (default fp32)", NULL}
/* clang-format on */

/* Read --device (and --tf32 and --precision when the table has them) into
 * *device, *tf32 and *bf16 (1 for --precision bf16). Returns 0, or prints
 * what is wrong with --device or --precision and returns 2 (usage error). */
int nl_cli_device_flags(const nl_flag *flags, const char **device, int *tf32, int *bf16);

/* The same three as rows of a typed table (base/args.h, nl_opt) filling
 * an nl_cli_device; after the parse, nl_cli_device_opts puts in the
 * default device and checks it (0, or 2 said). */
typedef struct nl_cli_device {
    const char *device; /* NULL: cpu */
    bool tf32;
    int bf16;     /* --precision: 0 fp32, 1 bf16 */
    int kv_cache; /* --kv-cache: an nl_kv_dtype */
} nl_cli_device;
#define NL_CLI_DEVICE_OPT(d) NL_OPT_STR("device", &(d)->device, NL_CLI_DEVICE_HELP)
#define NL_CLI_TF32_OPT(d) NL_OPT_SWITCH("tf32", &(d)->tf32, NL_CLI_TF32_HELP)
#define NL_CLI_PRECISION_OPT(d)                                                                    \
    NL_OPT_CHOICE("precision", &(d)->bf16, "fp32|bf16", "fp32", NL_CLI_PRECISION_HELP)
#define NL_CLI_KV_CACHE_HELP                                                                       \
    "T: element type of the decode KV cache, fp32 (default) or bf16 (half the bytes per "          \
    "decoded token; rounded to nearest even when stored, attention sums in FP32)"
#define NL_CLI_KV_CACHE_OPT(d)                                                                     \
    NL_OPT_CHOICE("kv-cache", &(d)->kv_cache, NL_KV_DTYPE_CHOICES, "fp32", NL_CLI_KV_CACHE_HELP)
int nl_cli_device_opts(nl_cli_device *d);

/* The backend of a local command: nl_backend_new(device, threads, tf32,
 * bf16), and for a command that trains (train, grad) a refusal, before any
 * work, of a device whose backend cannot train yet. */
nl_status nl_cli_backend_new(nl_backend **be, const char *device, int threads, int tf32, int bf16,
                             int training, nl_error *err);

/* After a download or a forward the caller acts on: the backend's sticky
 * asynchronous error, if any, named with the device (nl_backend_check). */
nl_status nl_cli_device_check(nl_backend *be, nl_error *err);

/* Usage checks that name the flag at fault. Each returns 0, or prints the
 * fault to stderr ("neuroctl CMD: ...") and returns the exit code. */

/* Every flag of the NULL-terminated list (names without "--") is given;
 * else "missing --NAME" and the usage, exit 2. */
int nl_cli_require(const char *cmd, const char *usage, const nl_flag *flags, ...);

/* --flag PATH names a readable regular file (not a directory); else the
 * flag, the path and what is wrong, exit 1. */
int nl_cli_input_file(const char *flag, const char *path);

/* --flag PATH may be written: it does not exist, or --force is given; else
 * "PATH exists (give --force to replace it)", exit 1. A directory is
 * refused even with --force ("is a directory"), before any work. */
int nl_cli_may_write(const nl_flag *flags, const char *flag, const char *path);
/* An output --out_flag OUT that is the same file as the input --in_flag IN
 * (both exist: one device and inode) would be overwritten by the command's
 * own result: "--OUT_FLAG OUT: that is the --IN_FLAG input", exit 1. */
int nl_cli_not_input(const char *out_flag, const char *out, const char *in_flag, const char *in);

/* --flag PATH can be written where it goes, tried before any work (a file
 * is made and removed there: see nl_file_can_create): in PATH itself when
 * is_dir, else in PATH's directory. Else the flag, the path and why,
 * exit 1. NULL passes. */
int nl_cli_can_write(const char *flag, const char *path, int is_dir);

/* Hold --flag PATH for the run (core/formats/fileio.h, nl_file_lock_take) by the
 * lock file PATH + suffix (".lock" beside a file, "/.neuroctl.lock" in a
 * directory): a second run given the same path is refused, naming this
 * one's pid. NULL path: nothing locked, NL_OK. */
nl_status nl_cli_lock(nl_file_lock **lk, const char *flag, const char *path, const char *suffix,
                      nl_error *err);

/* The --force switch of a command that writes files a user may care about. */
/* clang-format off */
#define NL_CLI_FORCE_FLAG {"force", 0, "replace an existing output file", NULL}
/* clang-format on */

/* The lines a local command's usage ends with: how to send it to a cluster
 * (forward, generate and train go there when --cluster or --coordinator is
 * given). */
#define NL_CLI_CLUSTER_USAGE(cmd)                                                                  \
    "\n  on a cluster: neuroctl " cmd " --cluster DIR (a local cluster: cluster up) or "           \
    "--coordinator tcp://HOST:PORT --key CLIENT.key --coordinator-key COORD.pub [--plaintext], "   \
    "with [--timeout S]; the model is the cluster's and --device, --tf32, --threads are the "      \
    "nodes' (neuroctl " cmd " --cluster x --help lists its flags)"

/* The pace of a generation, as its tokens come: nl_gen_clock_start when
 * the prompt is submitted, nl_gen_clock_tick per token; the report (on
 * stderr) gives the time to the first token (prefill) and the decode rate
 * after it:
 *   generate: 129 tokens: first after 12.3 ms, then 128 in 180.2 ms (710.3 tokens/s) */
typedef struct nl_gen_clock {
    double start, first, last;
    int count;
} nl_gen_clock;

void nl_gen_clock_start(nl_gen_clock *c);
void nl_gen_clock_tick(nl_gen_clock *c);
void nl_gen_clock_report(const nl_gen_clock *c);

#endif
