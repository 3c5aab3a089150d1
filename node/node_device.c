/* The node's device: the backend on --device (with the test hooks that
 * stand in for a failing device or a GPU's memory report), the GEMM
 * throughput it reports when it joins, and the memory it offers. */
#include "node_impl.h"

#include <stdint.h>
#include <unistd.h>

#include "../base/log.h"

/* Test hook (NL_TEST_DEVICE_FAIL=K): the backend's check slot fails from
 * its K-th call on, as a device's sticky asynchronous error would. One
 * node per process, so the state is the process's. */
static nl_status (*real_check)(nl_backend *be, nl_error *err);
static int checks_left;

static nl_status failing_check(nl_backend *be, nl_error *err)
{
    if (checks_left > 0 && --checks_left > 0)
        return real_check ? real_check(be, err) : NL_OK;
    checks_left = 0;
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

/* What the node offers: --memory on host memory; on a device with its own
 * memory, what is free now (the backend's runtime already taken) less the
 * reserve, capped by --memory. */
static nl_status offer_memory(nl_node_device *n, const nl_node_opts *o, nl_error *err)
{
    const double MiB = 1 << 20;
    if (!n->be->mem_info) {
        if (!o->memory_bytes)
            return nl_error_set(err, NL_ERR_INVALID, "--memory SIZE is required on device %s",
                                o->device);
        if (o->has_reserve)
            NL_WARN("--reserve: device %s has no memory of its own; it offers --memory", o->device);
        n->memory = o->memory_bytes;
        return NL_OK;
    }
    size_t free_b = 0, total_b = 0;
    nl_status st = n->be->mem_info(n->be, &free_b, &total_b, err);
    if (st != NL_OK)
        return nl_error_prefix(err, "device %s: its free memory", o->device);
    uint64_t reserve = o->has_reserve ? o->reserve_bytes : (uint64_t)total_b / 20;
    if (!o->has_reserve && reserve < (256ULL << 20))
        reserve = 256ULL << 20;
    const uint64_t avail = free_b > reserve ? free_b - reserve : 0;
    NL_INFO("device %s: %.1f MiB free of %.1f MiB (its runtime holds %.1f MiB); reserve %.1f MiB",
            o->device, (double)free_b / MiB, (double)total_b / MiB,
            (double)n->be->runtime_bytes / MiB, (double)reserve / MiB);
    if (o->memory_bytes > avail)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "--memory %.1f MiB: device %s has %.1f MiB free of %.1f MiB, %.1f MiB "
                            "after the reserve of %.1f MiB (--reserve)",
                            (double)o->memory_bytes / MiB, o->device, (double)free_b / MiB,
                            (double)total_b / MiB, (double)avail / MiB, (double)reserve / MiB);
    if (avail == 0)
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "device %s: %.1f MiB free, no more than the reserve of %.1f MiB: "
                            "nothing to offer (--reserve)",
                            o->device, (double)free_b / MiB, (double)reserve / MiB);
    n->memory = o->memory_bytes ? o->memory_bytes : avail;
    return NL_OK;
}

nl_status nl_node_device_open(nl_node_device *n, const nl_node_opts *o, nl_error *err)
{
    nl_status st = nl_backend_new(&n->be, o->device,
                                  &(nl_backend_opts){.threads = o->threads, .tf32 = o->tf32}, err);
    if (st != NL_OK)
        return st;
    if (o->inject_device_fail > 0) {
        real_check = n->be->check;
        checks_left = o->inject_device_fail;
        n->be->check = failing_check;
    }
    if (o->inject_no_train)
        n->be->can_train = 0;
    if (o->inject_mem_total) {
        fake_free = (size_t)o->inject_mem_free;
        fake_total = (size_t)o->inject_mem_total;
        n->be->mem_info = fake_mem_info;
    }
    n->threads = o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n->threads < 1)
        n->threads = 1;
    const int probe = n->be->gemm_probe > 0 ? n->be->gemm_probe : 512;
    n->gflops = nl_backend_gemm_gflops(n->be, probe, probe, probe, 0.3);
    if (o->inject_gflops > 0 && n->gflops > 0)
        n->gflops = o->inject_gflops;
    nl_error e = {0};
    if (n->be->check && (st = n->be->check(n->be, &e)) != NL_OK)
        return nl_error_set(err, st, "device %s: the throughput probe failed: %s", o->device,
                            e.msg);
    if (!(n->gflops > 0))
        return nl_error_set(err, NL_ERR_CAPACITY,
                            "device %s: the throughput probe (%d^3) could not run (out of device "
                            "memory?)",
                            o->device, probe);
    if ((st = offer_memory(n, o, err)) != NL_OK)
        return st;
    if (o->kv_budget >= n->memory)
        NL_WARN("--kv-budget %llu leaves nothing of the %llu bytes offered for weights and "
                "activations",
                (unsigned long long)o->kv_budget, (unsigned long long)n->memory);
    NL_INFO("device %s%s, %d threads: gemm %d^3 %.1f GFLOP/s; offering %.1f MiB (KV budget "
            "%.1f MiB)",
            o->device, o->tf32 ? " (TF32 allowed)" : "", n->threads, probe, n->gflops,
            (double)n->memory / (1 << 20), (double)o->kv_budget / (1 << 20));
    return NL_OK;
}
