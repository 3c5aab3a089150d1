/* The neuronode event loop: one process, one pipeline stage.
 *
 * Sockets (docs/cluster.md): control, a DEALER to the coordinator (CURVE
 * client with the coordinator's key); data, a ROUTER bound at --listen
 * (CURVE server on a private ZAP domain admitting only the previous
 * stage's key from ASSIGN); next, a DEALER to the next stage's data
 * endpoint. The loop polls them with a timeout of at most half the
 * heartbeat period, sends HEARTBEAT on time, and dispatches every message
 * to the stage (node/stage.h). A bad message is answered with an ERROR and
 * never ends the loop; only the stop flag (SIGINT/SIGTERM) does, with a
 * LEAVE to the coordinator, or a failure of the device (an asynchronous
 * error the backend reports after a forward or a training step): the node
 * fails the job that met it, leaves, and nl_node_run returns the error.
 *
 * A coordinator that refuses a heartbeat as unknown (it restarted, or it
 * gave this node up) gets JOIN again, with the same key and data
 * endpoint, after 250 ms, then after pauses doubling to 8 s, until it
 * ACCEPTs; a training job this node ran ends, and the new ACCEPT's node id
 * and heartbeat period apply from then on.
 *
 * The device: --device names the backend (nl_backend_new). Its GEMM
 * throughput is probed at be->gemm_probe and sent with JOIN. A device with
 * its own memory (be->mem_info, a GPU) offers its free memory, measured
 * once the backend is up (so its runtime_bytes are already taken), less a
 * reserve, capped by --memory when given; a node on host memory offers
 * --memory.
 *
 * Several devices (--device cuda:0,1 or cpu,cpu) make the stage's
 * data-parallel replicas (stage.h, nl_stage_new_replicas): one backend and
 * one copy of the stage each. Every device is opened at the start (one that
 * is missing ends the node with its error), and the replicas' communicator
 * made and tried with one all-reduce; the node offers the smallest
 * replica's memory, since each holds the whole stage, and reports replica
 * 0's throughput and name ("cuda:0") in its JOIN. */
#ifndef NL_NODE_NODE_H
#define NL_NODE_NODE_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"
#include "net/keys.h"

/* Most devices (replicas) one node takes. */
#define NL_NODE_MAX_REPLICAS 16
#define NL_NODE_DEVICE_NAME_MAX 32

/* Split --device D[,D...] into its devices: each cpu, cpu-devsim or cuda:N,
 * where a bare N after a cuda device is cuda:N ("cuda:0,1" is cuda:0 and
 * cuda:1). All must be of one kind, and CUDA devices distinct (one replica
 * per GPU). NL_ERR_INVALID naming the item at fault otherwise. names may be
 * NULL (a check only). */
nl_status nl_node_parse_devices(const char *list, char (*names)[NL_NODE_DEVICE_NAME_MAX], int *n,
                                nl_error *err);

typedef struct nl_node_opts {
    const char *coordinator;      /* control endpoint, e.g. tcp://host:7000 */
    const char *coordinator_key;  /* the coordinator's Z85 public key (unused with plaintext) */
    const nl_keypair *keys;       /* this node's identity */
    bool plaintext;               /* INSECURE: no CURVE on any socket */
    const char *device;           /* "cpu", "cpu-devsim" or "cuda:N"; a list makes replicas */
    int tf32;                     /* GPU GEMMs may use TF32 */
    int bf16;                     /* --precision bf16: GEMMs in bf16 (CPU or CUDA) */
    const char *listen;           /* data endpoint to bind; NULL = tcp://127.0.0.1:* */
    bool no_inbound;              /* nothing can connect to this node: it dials its neighbours
                                   * (JOIN.flags, ASSIGN.links) */
    bool no_local_link;           /* hops to co-located neighbours stay on ZeroMQ
                                   * (node_local.c) */
    const char *name;             /* log name; NULL = "node-<id>" once accepted */
    uint64_t memory_bytes;        /* offered to the coordinator; 0 on a GPU: its free memory */
    uint64_t reserve_bytes;       /* a GPU's memory kept free ... */
    bool has_reserve;             /* ... when set; else max(256 MiB, 5% of the device) */
    uint64_t kv_budget;           /* KV caches of all sessions, within the offer ... */
    bool has_kv_budget;           /* ... when set; else nl_mem_kv_budget_default(the offer) */
    int kv_cache;                 /* their element type, an nl_kv_dtype (--kv-cache) */
    int batch_decode;             /* session decode steps per batch; 0: the stage's default */
    int prefill_chunk;            /* prompt positions per batch; 0: the stage's default */
    int batch_wait_ms;            /* longest wait for the other sessions; 0: the stage's
                                   * default, < 0: none */
    int threads;                  /* backend threads; 0 = all cores */
    int connect_timeout_ms;       /* keep trying the coordinator this long */
    const char *ckpt_root;        /* checkpoint shards only under this directory (made and
                                   * resolved at the start; "/" admits any); NULL: none written */
    int64_t inject_nan_step;      /* test hook (NL_TEST_INJECT_NAN_STEP): 1-based step, 0 never */
    int inject_nan_stage;         /* ... on this stage only (-1 any) */
    int inject_nan_on;            /* ... and on every later step */
    int inject_lie_kind;          /* test hook (NL_TEST_LIE): the stage lies (stage.h, */
    double inject_lie_rate;       /* nl_lie_kind) on this fraction of its outputs, */
    uint64_t inject_lie_seed;     /* drawn from this seed */
    uint64_t inject_lie_from;     /* from this training step on */
    bool inject_lie_gen;          /* ... and in every generation hop (NL_TEST_LIE_GEN) */
    int inject_device_fail;       /* test hook (NL_TEST_DEVICE_FAIL): the device's K-th check
                                   * after the start fails, and every later one (0 never) */
    double inject_gflops;         /* test hook (NL_TEST_GFLOPS): reported throughput, if > 0 */
    double inject_slow_ms;        /* test hook (NL_TEST_SLOW_MS): each training message takes
                                   * this much longer here (a node slower than it said) */
    double inject_slow_x;         /* test hook (NL_TEST_SLOW_X): ... this many times its own
                                   * work (> 1; the same node slower in any build) */
    double inject_compute_gflops; /* test hook (NL_TEST_COMPUTE_GFLOPS): each training hop
                                   * sleeps for its FLOPs' time at this rate instead of
                                   * computing (bench/bench_replicas.sh; 0: none) */
    double inject_link_bytes_s;   /* test hook (NL_TEST_LINK_BYTES_S): the replicas' all-reduce
                                   * reports this link speed, bytes/s (0: as measured) */
    double inject_slow_hop_ms;    /* test hook (NL_TEST_SLOW_HOP_MS): each batch of session hops
                                   * waits this long first (a slow stage, so a test's session
                                   * is still open when another opens) */
    bool inject_no_train;         /* test hook (NL_TEST_DEVICE_NO_TRAIN): the device cannot train */
    unsigned inject_local_break;  /* test hook (NL_TEST_LOCAL_BREAK_AFTER=K): the K-th training
                                   * hop from the previous stage's local link ends that link,
                                   * as one that broke (0: none) */
    uint64_t inject_mem_free;     /* test hook (NL_TEST_DEVICE_MEM=FREE,TOTAL in MiB): the device */
    uint64_t inject_mem_total;    /* reports this memory, as a GPU would (0: no such hook) */
    volatile sig_atomic_t *stop;  /* set by the signal handler: LEAVE and return */
} nl_node_opts;

/* Join the coordinator and serve until *stop is set: returns NL_OK after
 * the LEAVE. A coordinator that cannot be reached in time, or that
 * refuses the JOIN, is an error (the message says which). */
nl_status nl_node_run(const nl_node_opts *o, nl_error *err);

/* neuronode's command line (node_cli.c): parses `neuronode join ENDPOINT
 * [flags]` into *o (its strings point into argv; o->keys = kp, read from
 * --key or the state dir; coord_key holds NL_KEY_Z85_LEN + 1 chars),
 * printing --help and usage errors. -1: run the node; else the process's
 * exit status (0 after --help, 2 for a usage error, 1 otherwise). o->stop
 * is left as it was. */
int nl_node_cli(int argc, char **argv, nl_node_opts *o, char *coord_key, nl_keypair *kp);

#endif
