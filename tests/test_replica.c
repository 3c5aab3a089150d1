/* Unit tests of the replicas' communicator (kernels/comm.h) and of the
 * node's device list (nl_node_parse_devices):
 *  - the host all-reduce on 2 and 3 backends of NL_TEST_DEVICE gives every
 *    replica the same bits, those of the sum in replica order
 *    ((b0 + b1) + b2), also for a buffer larger than its host piece;
 *  - broadcast from a replica that is not the first;
 *  - refusals: no floats, a missing buffer, one backend twice, too many
 *    replicas, a root out of range, NCCL on a backend that is not CUDA, a
 *    stage given a communicator over another number of replicas;
 *  - AUTO on CUDA-named backends whose code holds no NCCL communicator
 *    falls back to the host; NCCL asked for says why not;
 *  - the CUDA module (where this build has one) loads with its NCCL
 *    dependency resolved, reports the communicator ABI, and refuses
 *    backends it did not make (or says it was built without NCCL); the
 *    NCCL collectives themselves need two GPUs (docs/cluster.md);
 *  - device lists: cuda:0,1 is two GPUs, cpu,cpu two CPUs; mixed kinds, a
 *    GPU twice, an empty item and a bare index first are refused by name. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/comm.h"
#include "kernels/comm_impl.h" /* the module's entry points, tested directly */
#include "node/node.h"
#include "node/stage.h"
#include "tests/check.h"

#define R 3

static nl_backend *be[R];

/* Fill replica r's buffer with values whose sums round (so the order of
 * summation shows), run the all-reduce on the first `reps` replicas and
 * compare every replica with the host's sum in replica order. */
static void allreduce(int reps, size_t n)
{
    nl_error err;
    nl_comm *c = NULL;
    CHECK_OK(nl_comm_new(&c, be, reps, NL_COMM_AUTO, &err), &err);
    if (!c)
        return;
    CHECK(strcmp(nl_comm_name(c), "host") == 0 && nl_comm_size(c) == reps, "%s of %d",
          nl_comm_name(c), nl_comm_size(c));
    float *host[R], *dev[R], *want = malloc(n * sizeof *want);
    for (int r = 0; r < reps; r++) {
        host[r] = malloc(n * sizeof(float));
        dev[r] = be[r]->alloc(be[r], n * sizeof(float));
        for (size_t i = 0; i < n; i++)
            host[r][i] =
                (float)((double)((i * 7919 + (size_t)r * 104729) % 1000003) / 3.0e3 - 1.0e2) *
                (r == 1 ? 1e-7f : 1.0f);
        be[r]->upload(be[r], dev[r], host[r], n * sizeof(float));
    }
    for (size_t i = 0; i < n; i++) {
        float acc = host[0][i];
        for (int r = 1; r < reps; r++)
            acc += host[r][i];
        want[i] = acc;
    }
    CHECK_OK(nl_comm_allreduce_sum(c, dev, n, &err), &err);
    for (int r = 0; r < reps; r++) {
        float *got = check_download(be[r], dev[r], n);
        CHECK(got && memcmp(got, want, n * sizeof *want) == 0,
              "%d replicas, %zu floats: replica %d differs from the sum in replica order", reps, n,
              r);
        free(got);
        be[r]->free(be[r], dev[r]);
        free(host[r]);
    }
    free(want);
    nl_comm_destroy(&c);
    nl_comm_destroy(&c); /* safe twice */
}

static void broadcast(void)
{
    nl_error err;
    nl_comm *c = NULL;
    const size_t n = 1000;
    float *dev[R], src[1000];
    CHECK_OK(nl_comm_new(&c, be, R, NL_COMM_HOST, &err), &err);
    if (!c)
        return;
    for (size_t i = 0; i < n; i++)
        src[i] = (float)i * 0.25f - 3.0f;
    for (int r = 0; r < R; r++)
        dev[r] = be[r]->alloc(be[r], n * sizeof(float)); /* zeroed */
    be[1]->upload(be[1], dev[1], src, sizeof src);
    CHECK_OK(nl_comm_broadcast(c, dev, n, 1, &err), &err);
    for (int r = 0; r < R; r++) {
        float *got = check_download(be[r], dev[r], n);
        CHECK(got && memcmp(got, src, sizeof src) == 0, "broadcast from 1: replica %d differs", r);
        free(got);
    }
    /* refusals */
    CHECK(nl_comm_broadcast(c, dev, n, 3, &err) == NL_ERR_RANGE && strstr(err.msg, "root 3"),
          "root out of range: %s", err.msg);
    CHECK(nl_comm_allreduce_sum(c, dev, 0, &err) == NL_ERR_INVALID, "no floats: %s", err.msg);
    float *missing[R] = {dev[0], NULL, dev[2]};
    CHECK(nl_comm_allreduce_sum(c, missing, n, &err) == NL_ERR_INVALID &&
              strstr(err.msg, "replica 1"),
          "a missing buffer: %s", err.msg);
    for (int r = 0; r < R; r++)
        be[r]->free(be[r], dev[r]);
    nl_comm_destroy(&c);
}

static void refusals(void)
{
    nl_error err;
    nl_comm *c = NULL;
    nl_backend *twice[2] = {be[0], be[0]};
    CHECK(nl_comm_new(&c, twice, 2, NL_COMM_AUTO, &err) == NL_ERR_INVALID && !c &&
              strstr(err.msg, "share one backend"),
          "one backend twice: %s", err.msg);
    nl_backend *many[NL_COMM_MAX + 1] = {0};
    CHECK(nl_comm_new(&c, many, NL_COMM_MAX + 1, NL_COMM_AUTO, &err) == NL_ERR_INVALID,
          "too many replicas: %s", err.msg);
    CHECK(nl_comm_new(&c, be, 0, NL_COMM_AUTO, &err) == NL_ERR_INVALID, "no replicas: %s", err.msg);
    CHECK(nl_comm_new(&c, be, 2, NL_COMM_NCCL, &err) == NL_ERR_UNSUPPORTED && !c &&
              strstr(err.msg, "replica 0") && strstr(err.msg, be[0]->name) &&
              strstr(err.msg, "not a CUDA device"),
          "NCCL on %s: %s", be[0]->name, err.msg);
    /* one replica: the collectives are the identity */
    float *dev = be[0]->alloc(be[0], 4 * sizeof(float)), one[4] = {1, 2, 3, 4};
    be[0]->upload(be[0], dev, one, sizeof one);
    CHECK_OK(nl_comm_new(&c, be, 1, NL_COMM_AUTO, &err), &err);
    if (c)
        CHECK_OK(nl_comm_allreduce_sum(c, &dev, 4, &err), &err);
    float *got = check_download(be[0], dev, 4);
    CHECK(got && memcmp(got, one, sizeof one) == 0, "one replica changed its buffer");
    free(got);
    be[0]->free(be[0], dev);
    nl_comm_destroy(&c);
    /* a stage and its communicator agree on the replicas */
    nl_stage *st = NULL;
    nl_stage_opts so = {.memory_bytes = 1 << 30};
    CHECK_OK(nl_comm_new(&c, be, 3, NL_COMM_AUTO, &err), &err);
    CHECK(nl_stage_new_replicas(&st, be, 2, c, &so, &err) == NL_ERR_INVALID && !st &&
              strstr(err.msg, "communicator of 3 for 2"),
          "a communicator of 3 for 2 replicas: %s", err.msg);
    CHECK_OK(nl_stage_new_replicas(&st, be, 3, c, &so, &err), &err);
    nl_stage_destroy(&st); /* leaves the borrowed communicator (ASan would see) */
    CHECK(c && nl_comm_size(c) == 3, "the communicator after its stage");
    nl_comm_destroy(&c);
}

/* Backends named cuda:N whose code is this program's: no module, so no
 * NCCL communicator to find. */
static void fallback(void)
{
    nl_error err;
    nl_comm *c = NULL;
    const char *names[2] = {be[0]->name, be[1]->name};
    be[0]->name = "cuda:6";
    be[1]->name = "cuda:7";
    CHECK_OK(nl_comm_new(&c, be, 2, NL_COMM_AUTO, &err), &err);
    CHECK(c && strcmp(nl_comm_name(c), "host") == 0, "AUTO without NCCL: %s",
          c ? nl_comm_name(c) : "none");
    nl_comm_destroy(&c);
    CHECK(nl_comm_new(&c, be, 2, NL_COMM_NCCL, &err) == NL_ERR_UNSUPPORTED && !c &&
              strstr(err.msg, "nccl: "),
          "NCCL without a module: %s", err.msg);
    be[0]->name = names[0];
    be[1]->name = names[1];
}

static void cuda_module(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/lib/libnl_cuda.so", check_build_dir());
    if (access(path, F_OK) != 0) {
        printf("skipped: no CUDA module in this build (%s)\n", path);
        return;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL); /* kept: unloading cudart is not safe */
    CHECK(h, "%s: %s", path, dlerror());
    if (!h)
        return;
    nl_cuda_comm_abi_fn abi = (nl_cuda_comm_abi_fn)dlsym(h, "nl_cuda_comm_abi");
    nl_cuda_comm_new_fn make = (nl_cuda_comm_new_fn)dlsym(h, "nl_cuda_comm_new");
    CHECK(abi && make && abi() == NL_COMM_ABI, "%s: communicator entry points", path);
    if (!abi || !make)
        return;
    nl_error err = {0};
    nl_comm *c = NULL;
    nl_status st = make(&c, be, 2, &err);
    CHECK(!c && ((st == NL_ERR_INVALID && strstr(err.msg, "replica 0") &&
                  strstr(err.msg, "not a backend of this CUDA module")) ||
                 (st == NL_ERR_UNSUPPORTED && strstr(err.msg, "without NCCL"))),
          "the module's communicator on %s: %s (%s)", be[0]->name, err.msg, nl_status_str(st));
    printf("the CUDA module's communicator on %s backends: %s\n", be[0]->name, err.msg);
}

static void device_lists(void)
{
    nl_error err;
    char names[NL_NODE_MAX_REPLICAS][NL_NODE_DEVICE_NAME_MAX];
    int n = 0;
    CHECK_OK(nl_node_parse_devices("cuda:0,1,cuda:3", names, &n, &err), &err);
    CHECK(n == 3 && strcmp(names[0], "cuda:0") == 0 && strcmp(names[1], "cuda:1") == 0 &&
              strcmp(names[2], "cuda:3") == 0,
          "cuda:0,1,cuda:3: %d devices", n);
    CHECK_OK(nl_node_parse_devices("cpu,cpu", names, &n, &err), &err);
    CHECK(n == 2 && strcmp(names[1], "cpu") == 0, "cpu,cpu: %d devices", n);
    CHECK_OK(nl_node_parse_devices("cpu-devsim", NULL, &n, &err), &err);
    CHECK(n == 1, "cpu-devsim: %d devices", n);
    static const struct {
        const char *list, *says;
    } bad[] = {
        {"cpu,cuda:0", "not of one kind"},
        {"cuda:0,0", "cuda:0 twice"},
        {"cuda:2,cuda:2", "cuda:2 twice"},
        {"cpu,", "empty device name"},
        {"1", "unknown"},
        {"cpu,cpu-devsim", "not of one kind"},
        {"cuda:0,gpu", "gpu: unknown"},
        {"", "empty"},
        {"cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu", "more than 16"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        nl_status st = nl_node_parse_devices(bad[i].list, names, &n, &err);
        CHECK(st == NL_ERR_INVALID && strstr(err.msg, bad[i].says), "'%s': %s (%s)", bad[i].list,
              err.msg, nl_status_str(st));
    }
}

int main(void)
{
    nl_error err;
    for (int r = 0; r < R; r++)
        CHECK_OK(check_backend_new(&be[r], 1, &err), &err);
    if (be[R - 1]) {
        allreduce(2, 1);
        allreduce(2, 1000);
        allreduce(3, 4097);
        allreduce(3, ((size_t)1 << 22) + 5); /* more than one host piece */
        broadcast();
        refusals();
        fallback();
        cuda_module();
    }
    device_lists();
    for (int r = 0; r < R; r++)
        nl_backend_destroy(&be[r]);
    return check_done("test_replica");
}
