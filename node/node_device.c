/* The node's device: the backend on --device (with the test hooks that
 * stand in for a failing device or a GPU's memory report), or one backend
 * per replica for a list of devices, the GEMM throughput it reports when it
 * joins, and the memory it offers. */
#include "node/node_impl.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "core/model/kvcache.h"
#include "core/model/memory.h"

#ifdef NL_TEST_HOOKS /* test builds only (-DNL_TEST_HOOKS=ON) */
/* Test hook (NL_TEST_DEVICE_FAIL=K): the backend's check slot fails from
 * its K-th call on, as a device's sticky asynchronous error would. One
 * node per process, so the state is the process's. */
static nl_status (*real_check)(nl_backend *be, nl_error *err);
static atomic_int checks_left; /* the replicas' threads call check too */

static nl_status failing_check(nl_backend *be, nl_error *err)
{
    if (atomic_fetch_sub(&checks_left, 1) > 1)
        return real_check ? real_check(be, err) : NL_OK;
    atomic_store(&checks_left, 0);
    return nl_error_set(err, NL_ERR_INTERNAL, "injected device error (NL_TEST_DEVICE_FAIL)");
}

/* Test hook (NL_TEST_DEVICE_MEM): a GPU's memory report. */
static size_t fake_free, fake_total;

static nl_status fake_mem_info(nl_backend *be, size_t *free_bytes, size_t *total_bytes,
                               nl_error *err)
{
    (void)be;
    (void)err;
    *free_bytes = fake_free;
    *total_bytes = fake_total;
    return NL_OK;
}
#endif

/* ---------------------------------------------------------------- the list */

/* The kind of a device name: 0 cpu, 1 cpu-devsim, 2 cuda. */
static int device_kind(const char *d)
{
    return strncmp(d, "cuda:", 5) == 0 ? 2 : strcmp(d, "cpu-devsim") == 0 ? 1 : 0;
}

nl_status nl_node_parse_devices(const char *list, char (*names)[NL_NODE_DEVICE_NAME_MAX], int *n,
                                nl_error *err)
{
    char item[NL_NODE_DEVICE_NAME_MAX], prev[NL_NODE_DEVICE_NAME_MAX] = "";
    int gpu[NL_NODE_MAX_REPLICAS]; /* each item's CUDA index, -1 for others */
    const char *p = list ? list : "";
    *n = 0;
    for (;;) {
        const size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof item - 5)
            return nl_error_set(err, NL_ERR_INVALID, "device %s: %s", list,
                                len ? "a device name is too long" : "an empty device name");
        if (*n == NL_NODE_MAX_REPLICAS)
            return nl_error_set(err, NL_ERR_INVALID, "device %s: more than %d devices", list,
                                NL_NODE_MAX_REPLICAS);
        /* "cuda:0,1": a bare index after a CUDA device is another one */
        if (*n > 0 && device_kind(prev) == 2 && strspn(p, "0123456789") == len)
            snprintf(item, sizeof item, "cuda:%.*s", (int)len, p);
        else
            snprintf(item, sizeof item, "%.*s", (int)len, p);
        nl_status st = nl_backend_parse_device(item, err);
        if (st != NL_OK)
            return *n ? nl_error_prefix(err, "device %s", list) : st;
        if (*n > 0 && device_kind(item) != device_kind(prev))
            return nl_error_set(err, NL_ERR_INVALID,
                                "device %s: %s and %s are not of one kind (the replicas of a node "
                                "are all cpu, all cpu-devsim or all CUDA)",
                                list, prev, item);
        gpu[*n] = device_kind(item) == 2 ? atoi(item + 5) : -1;
        for (int i = 0; gpu[*n] >= 0 && i < *n; i++)
            if (gpu[i] == gpu[*n])
                return nl_error_set(err, NL_ERR_INVALID,
                                    "device %s: cuda:%d twice (one replica per GPU)", list, gpu[i]);
        if (names)
            memcpy(names[*n], item, sizeof item);
        memcpy(prev, item, sizeof item);
        (*n)++;
        if (p[len] != ',')
            return NL_OK;
        p += len + 1;
    }
}

/* ---------------------------------------------------------------- the offer */

/* What one replica offers: --memory on host memory; on a device with its
 * own memory, what is free now (the backend's runtime already taken) less
 * the reserve, capped by --memory. */
static nl_status offer_memory(nl_backend *be, const nl_node_opts *o, uint64_t *offer, nl_error *err)
{
    const double MiB = 1 << 20;
    if (!be->mem_info) {
        if (!o->memory_bytes)
            return nl_error_set(err, NL_ERR_INVALID, "--memory SIZE is required on device %s",
                                be->name);
        if (o->has_reserve)
            NL_WARN("--reserve: device %s has no memory of its own; it offers --memory", be->name);
        *offer = o->memory_bytes;
        return NL_OK;
    }
    size_t free_b = 0, total_b = 0;
    nl_status st = be->mem_info(be, &free_b, &total_b, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "device %s: its free memory", be->name);
    uint64_t reserve = o->has_reserve ? o->reserve_bytes : (uint64_t)total_b / 20;
    if (!o->has_reserve && reserve < (256ULL << 20))
        reserve = 256ULL << 20;
    const uint64_t avail = free_b > reserve ? free_b - reserve : 0;
    NL_INFO("device %s: %.1f MiB free of %.1f MiB (its runtime holds %.1f MiB); reserve %.1f MiB",
            be->name, (double)free_b / MiB, (double)total_b / MiB, (double)be->runtime_bytes / MiB,
            (double)reserve / MiB);
    if (o->memory_bytes > avail)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "--memory %.1f MiB: device %s has %.1f MiB free of %.1f MiB, %.1f MiB "
                            "after the reserve of %.1f MiB (--reserve)",
                            (double)o->memory_bytes / MiB, be->name, (double)free_b / MiB,
                            (double)total_b / MiB, (double)avail / MiB, (double)reserve / MiB);
    if (avail == 0)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "device %s: %.1f MiB free, no more than the reserve of %.1f MiB: "
                            "nothing to offer (--reserve)",
                            be->name, (double)free_b / MiB, (double)reserve / MiB);
    *offer = o->memory_bytes ? o->memory_bytes : avail;
    return NL_OK;
}

/* ---------------------------------------------------------------- open */

/* The threads of CPU replica r of count: the replicas compute at the same
 * time, so they share --threads (or the machine's cores), the first ones
 * taking what does not divide; at least one each. */
static int cpu_share(const nl_node_opts *o, int r, int count)
{
    const int all = o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    const int share = all / count + (r < all % count);
    return share > 0 ? share : 1;
}

/* Open the backend of replica r of count, with the test hooks. */
static nl_status open_one(nl_node_device *n, const char *name, int r, int count,
                          const nl_node_opts *o, nl_error *err)
{
    nl_backend **be = &n->be[n->n];
    const int threads =
        count > 1 && strncmp(name, "cuda:", 5) != 0 ? cpu_share(o, r, count) : o->threads;
    nl_status st = nl_backend_new(
        be, name, &(nl_backend_opts){.threads = threads, .tf32 = o->tf32, .bf16 = o->bf16}, err);
    if (st != NL_OK)
        return st;
    n->n++;
#ifdef NL_TEST_HOOKS
    if (o->inject_device_fail > 0 && n->n == 1) { /* replica 0's: one hook per process */
        real_check = (*be)->check;
        atomic_store(&checks_left, o->inject_device_fail);
        (*be)->check = failing_check;
    }
    if (o->inject_no_train)
        (*be)->can_train = 0;
    if (o->inject_mem_total) {
        fake_free = (size_t)o->inject_mem_free;
        fake_total = (size_t)o->inject_mem_total;
        (*be)->mem_info = fake_mem_info;
    }
#endif
    return NL_OK;
}

/* The replicas' communicator, tried once at the start: an all-reduce of
 * WARM_FLOATS ones must give R on every replica. A communicator that cannot
 * work on these devices ends the node now rather than a training job
 * later, and what it allocates (NCCL's buffers and connections) is taken
 * before the free memory is measured. */
#define WARM_FLOATS ((size_t)1 << 20)

static nl_status open_comm(nl_node_device *n, const nl_node_opts *o, nl_error *err)
{
    float *buf[NL_NODE_MAX_REPLICAS] = {0}, *host = malloc(WARM_FLOATS * sizeof *host);
    nl_status st = nl_comm_new(&n->comm, n->be, n->n, NL_COMM_AUTO, err);
    if (st != NL_OK) {
        free(host);
        return nl_error_prefix(err, "--device %s: the replicas' communicator", o->device);
    }
    if (!host)
        st = nl_error_set(err, NL_ERR_NOMEM, "out of memory");
    for (size_t i = 0; st == NL_OK && i < WARM_FLOATS; i++)
        host[i] = 1.0f;
    for (int r = 0; st == NL_OK && r < n->n; r++) {
        if (!(buf[r] = n->be[r]->alloc(n->be[r], WARM_FLOATS * sizeof(float))))
            st = nl_error_set(err, NL_ERR_NOMEM, "%s: out of memory", n->be[r]->name);
        else
            n->be[r]->upload(n->be[r], buf[r], host, WARM_FLOATS * sizeof(float));
    }
    if (st == NL_OK)
        st = nl_comm_allreduce_sum(n->comm, buf, WARM_FLOATS, err);
    for (int r = 0; st == NL_OK && r < n->n; r++) {
        n->be[r]->download(n->be[r], host, buf[r], WARM_FLOATS * sizeof(float));
        if ((st = nl_backend_check(n->be[r], err)) == NL_OK &&
            (host[0] != (float)n->n || host[WARM_FLOATS - 1] != (float)n->n))
            st = nl_error_set(err, NL_ERR_INTERNAL, "%s: the all-reduce of %d ones gave %g",
                              n->be[r]->name, n->n, (double)host[0]);
    }
    for (int r = 0; r < n->n; r++)
        if (buf[r])
            n->be[r]->free(n->be[r], buf[r]);
    free(host);
    if (st != NL_OK)
        return nl_error_prefix(err, "--device %s: the replicas' %s communicator", o->device,
                               nl_comm_name(n->comm));
    return NL_OK;
}

/* The node's GEMM throughput for the planner: PROBE_ROUNDS rounds of
 * PROBE_SECONDS each (after the backend's warm-up), and their median, so
 * that one round disturbed by a neighbour starting at the same time (two
 * identical nodes once measured 113 and 81 GFLOP/s with a single 0.3 s
 * round) does not decide the plan; *lo and *hi get the range seen. On the
 * CPU (threads > 0: the replica's compute threads) each round is timed by
 * the process's CPU time over those threads, not the wall clock: two
 * identical 1-thread nodes on a machine busy with other work once probed
 * 3x apart by the wall clock and were planned 2 + 6 layers; what the node
 * really gets of its cores shows in training and re-balances the plan
 * (docs/cluster.md, "Plans from what was measured"). */
#define PROBE_ROUNDS 5
#define PROBE_SECONDS 0.08

static double probe_median(nl_backend *be, int probe, int threads, double *lo, double *hi)
{
    double g[PROBE_ROUNDS];
    for (int i = 0; i < PROBE_ROUNDS; i++) {
        g[i] = threads > 0
                   ? nl_backend_gemm_gflops_cpu(be, probe, probe, probe, PROBE_SECONDS, threads)
                   : nl_backend_gemm_gflops(be, probe, probe, probe, PROBE_SECONDS);
        if (!(g[i] > 0))
            return 0.0;                                  /* it could not run: the caller says why */
        for (int k = i; k > 0 && g[k] < g[k - 1]; k--) { /* insertion sort */
            const double x = g[k];
            g[k] = g[k - 1];
            g[k - 1] = x;
        }
    }
    *lo = g[0];
    *hi = g[PROBE_ROUNDS - 1];
    return g[PROBE_ROUNDS / 2];
}

nl_status node_device_open(nl_node_device *n, const nl_node_opts *o, nl_error *err)
{
    char names[NL_NODE_MAX_REPLICAS][NL_NODE_DEVICE_NAME_MAX];
    int count = 0;
    nl_status st = nl_node_parse_devices(o->device, names, &count, err);
    if (st != NL_OK)
        return st;
    for (int r = 0; r < count; r++)
        if ((st = open_one(n, names[r], r, count, o, err)) != NL_OK)
            return count > 1
                       ? nl_error_prefix(err, "--device %s: replica %d of %d", o->device, r, count)
                       : st;
    if (count > 1 && (st = open_comm(n, o, err)) != NL_OK)
        return st;
    nl_backend *be = n->be[0];
    n->threads = o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    double lo = 0, hi = 0;
    if (n->threads < 1)
        n->threads = 1;
    const int probe = be->gemm_probe > 0 ? be->gemm_probe : 512;
    /* the replicas compute at the same time (training): the node's
     * throughput is theirs together, replica 0's times their number */
    const int probe_threads = strncmp(be->name, "cuda:", 5) == 0 ? 0
                              : n->n > 1                         ? cpu_share(o, 0, n->n)
                                                                 : n->threads;
    n->gflops = probe_median(be, probe, probe_threads, &lo, &hi) * n->n;
    if (o->inject_gflops > 0 && n->gflops > 0)
        n->gflops = o->inject_gflops;
    nl_error e = {0};
    if (be->check && (st = be->check(be, &e)) != NL_OK)
        return nl_error_set(err, st, "device %s: the throughput probe failed: %s", be->name, e.msg);
    if (!(n->gflops > 0))
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "device %s: the throughput probe (%d^3) could not run (out of device "
                            "memory?)",
                            be->name, probe);
    /* each replica holds the whole stage: the smallest offer is the node's */
    for (int r = 0; r < n->n; r++) {
        uint64_t offer = 0;
        if ((st = offer_memory(n->be[r], o, &offer, err)) != NL_OK)
            return st;
        if (r == 0 || offer < n->memory)
            n->memory = offer;
    }
    /* the sessions' caches are kept within the offer: plans get the rest */
    n->kv_budget = o->has_kv_budget ? o->kv_budget : nl_mem_kv_budget_default(n->memory);
    if (n->kv_budget >= n->memory)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "--kv-budget %.1f MiB%s leaves nothing of the %.1f MiB device %s "
                            "offers for a stage's weights and activations: give a smaller "
                            "--kv-budget or more --memory%s",
                            (double)n->kv_budget / (1 << 20),
                            o->has_kv_budget ? "" : " (the default: a quarter)",
                            (double)n->memory / (1 << 20), be->name,
                            be->mem_info ? " (or a smaller --reserve)" : "");
    NL_INFO("device %s%s, %d threads: gemm %d^3 %.1f GFLOP/s (median of %d rounds%s, %.1f to "
            "%.1f); offering %.1f MiB (KV budget %.1f MiB of it, %s caches)",
            o->device,
            o->tf32   ? " (TF32 allowed)"
            : o->bf16 ? " (bf16 GEMMs)"
                      : "",
            n->threads, probe, n->gflops, PROBE_ROUNDS, probe_threads ? " of CPU time" : "", lo, hi,
            (double)n->memory / (1 << 20), (double)n->kv_budget / (1 << 20),
            nl_kv_dtype_name((nl_kv_dtype)o->kv_cache));
    /* verification's recomputes: one thread at the lowest priority (stage_verify_worker.c) */
    if (strncmp(be->name, "cuda:", 5) != 0 &&
        (st = nl_backend_new(&n->verify_be, names[0],
                             &(nl_backend_opts){.threads = 1, .tf32 = o->tf32, .bf16 = o->bf16},
                             err)) != NL_OK)
        return nl_error_prefix(err, "device %s: the verifier's backend", be->name);
    if (n->n > 1)
        NL_INFO("%d data-parallel replicas of the stage (%s to %s, %s all-reduce), each on "
                "its own thread%s: training shares each step's microbatches among them; "
                "inference runs on %s; the throughput reported is %s's times %d (the probe's "
                "range above is %s's) and the memory offered the smallest replica's (each holds "
                "the whole stage)",
                n->n, n->be[0]->name, n->be[n->n - 1]->name, nl_comm_name(n->comm),
                strncmp(n->be[0]->name, "cuda:", 5) != 0 ? " (sharing the threads)" : "",
                n->be[0]->name, n->be[0]->name, n->n, n->be[0]->name);
    return NL_OK;
}

void node_device_close(nl_node_device *n)
{
    nl_comm_destroy(&n->comm); /* before the backends it borrows */
    nl_backend_destroy(&n->verify_be);
    for (int r = 0; r < n->n; r++)
        nl_backend_destroy(&n->be[r]);
    n->n = 0;
}
