/* The cpu-devsim backend itself: its table, tagged pointers that fault
 * when the host dereferences them, copies at offsets into an allocation,
 * the accounting, and ops that give the CPU backend's results bit for
 * bit (the simulator adds no arithmetic of its own). */
#include "kernels/backend.h"
#include "tests/check.h"

#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

static void test_table(nl_backend *ds, nl_backend *cpu)
{
    CHECK(strcmp(ds->name, "cpu-devsim") == 0, "name %s", ds->name);
    CHECK(ds->host_memory == 0 && ds->can_train == 1, "host_memory %d can_train %d",
          ds->host_memory, ds->can_train);
    CHECK(ds->gemm_probe == cpu->gemm_probe && ds->runtime_bytes == 0, "gemm_probe %d",
          ds->gemm_probe);
    CHECK(!ds->check && !ds->mem_info, "no check or mem_info slot");
    nl_error err = {0};
    CHECK(nl_backend_check(ds, &err) == NL_OK, "nl_backend_check without a slot");
    CHECK(ds->sync(ds, &err) == NL_OK, "sync");
}

/* A host read of device memory dies with a fault, in a child process. */
static void test_faults(nl_backend *ds)
{
    float *d = ds->alloc(ds, 64 * sizeof(float));
    CHECK(d && ((uintptr_t)d >> 62 & 1), "device pointer %p carries the tag", (void *)d);
    ds->free(ds, NULL);
    if (!d)
        return;
    for (int write = 0; write < 2; write++) {
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0) {
            /* the default action, not a sanitizer's report */
            signal(SIGSEGV, SIG_DFL);
            signal(SIGBUS, SIG_DFL);
            volatile float *v = d + 5;
            if (write)
                *v = 1.0f;
            else
                (void)*v;
            _exit(0);
        }
        int ws = 0;
        CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid, "fork");
        CHECK(WIFSIGNALED(ws) &&
                  (WTERMSIG(ws) == SIGSEGV || WTERMSIG(ws) == SIGBUS || WTERMSIG(ws) == SIGABRT),
              "a host %s of device memory faults (status %#x)", write ? "write" : "read", ws);
    }
    ds->free(ds, d);
}

/* Copies at offsets into one allocation (slices of a parameter block),
 * zero of a sub-range, and mem_stats from the CPU backend. */
static void test_memory(nl_backend *ds)
{
    enum { N = 1000 };
    size_t used0 = 0, used1 = 0, used2 = 0, peak = 0;
    ds->mem_stats(ds, &used0, NULL);
    float *d = ds->alloc(ds, N * sizeof(float));
    ds->mem_stats(ds, &used1, &peak);
    CHECK(used1 >= used0 + N * sizeof(float) && peak >= used1, "mem_stats %zu -> %zu (peak %zu)",
          used0, used1, peak);
    float h[N], back[N];
    for (int i = 0; i < N; i++)
        h[i] = (float)i;
    float *z = check_download(ds, d, N);
    int zero = z != NULL;
    for (int i = 0; z && i < N; i++)
        zero &= z[i] == 0.0f;
    CHECK(zero, "alloc is zero-filled");
    free(z);
    ds->upload(ds, d, h, sizeof h);
    ds->upload(ds, d + 100, h, 10 * sizeof(float)); /* an offset into the block */
    ds->zero(ds, d + 500, 20 * sizeof(float));
    ds->download(ds, back, d, sizeof back);
    int ok = 1;
    for (int i = 0; i < N; i++) {
        float want = i >= 100 && i < 110 ? (float)(i - 100) : i >= 500 && i < 520 ? 0.0f : (float)i;
        ok &= back[i] == want;
    }
    CHECK(ok, "upload, download and zero at offsets");
    float part[7];
    ds->download(ds, part, d + 700, sizeof part);
    CHECK(part[0] == 700.0f && part[6] == 706.0f, "download at an offset: %g %g", part[0], part[6]);
    ds->upload(ds, d, h, 0); /* empty copies touch nothing */
    ds->download(ds, back, d, 0);
    ds->free(ds, d);
    ds->mem_stats(ds, &used2, NULL);
    CHECK(used2 == used0, "free returns the bytes: %zu vs %zu", used2, used0);
}

/* A few ops on both backends: the same bits. */
static void test_ops(nl_backend *ds, nl_backend *cpu)
{
    enum { M = 9, N = 17, K = 33 };
    float A[M * K], B[N * K], C[M * N], R[M * N];
    for (int i = 0; i < M * K; i++)
        A[i] = (float)((i * 37) % 23) / 23.0f - 0.5f;
    for (int i = 0; i < N * K; i++)
        B[i] = (float)((i * 11) % 19) / 19.0f - 0.5f;
    float *dA = ds->alloc(ds, sizeof A), *dB = ds->alloc(ds, sizeof B),
          *dC = ds->alloc(ds, sizeof C);
    if (!dA || !dB || !dC)
        goto out;
    ds->upload(ds, dA, A, sizeof A);
    ds->upload(ds, dB, B, sizeof B);
    cpu->gemm(cpu, 0, 1, M, N, K, 1.0f, A, K, B, K, 0.0f, R, N);
    ds->gemm(ds, 0, 1, M, N, K, 1.0f, dA, K, dB, K, 0.0f, dC, N);
    ds->download(ds, C, dC, sizeof C);
    CHECK(memcmp(C, R, sizeof C) == 0, "gemm: devsim equals cpu");
    double s_cpu = cpu->sumsq(cpu, A + 3, 40), s_ds = ds->sumsq(ds, dA + 3, 40);
    CHECK(s_cpu == s_ds, "sumsq at an offset: %.17g vs %.17g", s_ds, s_cpu);
    /* rows 2..5 of A through gather_rows with device indices, and rmsnorm
     * with rstd NULL (an optional pointer stays NULL) */
    int32_t idx[4] = {2, 3, 4, 5};
    int32_t *di = ds->alloc(ds, sizeof idx);
    float *dout = ds->alloc(ds, 4 * K * sizeof(float));
    float got[4 * K], want[4 * K];
    if (di && dout) {
        ds->upload(ds, di, idx, sizeof idx);
        ds->gather_rows(ds, dout, dA, di, 4, K);
        ds->download(ds, got, dout, sizeof got);
        CHECK(memcmp(got, A + 2 * K, sizeof got) == 0, "gather_rows");
        ds->rmsnorm_forward(ds, dout, NULL, dA, dB, 4, K, 1e-5f);
        cpu->rmsnorm_forward(cpu, want, NULL, A, B, 4, K, 1e-5f);
        ds->download(ds, got, dout, sizeof got);
        CHECK(memcmp(got, want, sizeof got) == 0, "rmsnorm_forward with rstd NULL");
    }
    ds->free(ds, di);
    ds->free(ds, dout);
out:
    ds->free(ds, dA);
    ds->free(ds, dB);
    ds->free(ds, dC);
}

int main(void)
{
    nl_error err = {0};
    nl_backend *ds = NULL, *cpu = NULL;
    CHECK_OK(nl_backend_new(&ds, "cpu-devsim", &(nl_backend_opts){.threads = 2}, &err), &err);
    CHECK_OK(nl_backend_new(&cpu, "cpu", &(nl_backend_opts){.threads = 2}, &err), &err);
    if (ds && cpu) {
        test_table(ds, cpu);
        test_faults(ds);
        test_memory(ds);
        test_ops(ds, cpu);
    }
    nl_backend_destroy(&ds);
    nl_backend_destroy(&ds);
    nl_backend_destroy(&cpu);
    return check_done("test_devsim");
}
