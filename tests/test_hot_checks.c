/* The sanitized build's checks in the kernels' unsanitized hot loops
 * (NL_HOT and nl_hot_rows, kernels/cpu/cpu_math.h). The GEMM's tile and
 * attention forward and backward run without ASan's instrumentation, so
 * each checks the rows it touches; here each is called once with buffers
 * of exactly the size it needs (no report, exit 0) and once with an
 * output, then an input, a row short, which must end the process with
 * ASan's heap-buffer-overflow report (a WRITE, a READ) naming the
 * function, as the instrumented loops did. Each call runs in a child process. Registered in the
 * NL_SANITIZE build only (elsewhere there is nothing to report). */
#include "check.h"
#include "kernels/cpu/cpu_ops.h"

#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

enum { SHORT_NONE, SHORT_OUT, SHORT_IN };

/* a buffer of n floats (less `short_by` at the end), filled with small values */
static float *buf(size_t n, size_t short_by)
{
    float *p = malloc((n - short_by) * sizeof *p);
    if (!p)
        abort();
    for (size_t i = 0; i < n - short_by; i++)
        p[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;
    return p;
}

/* C (12 x 16) = A (12 x 8) B (8 x 16), two whole tiles; C or B a row short */
static void run_gemm(nl_backend *be, int which)
{
    const int M = 12, N = 16, K = 8;
    float *A = buf((size_t)M * K, 0), *B = buf((size_t)K * N, 0);
    float *C = buf((size_t)M * N, which == SHORT_OUT ? (size_t)N : 0);
    nl_cpu_gemm_chain(be, 0, 0, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
    free(A), free(B), free(C);
}

/* one sequence of 40 positions, 2 query heads on 1 kv head, hd 16: the
 * output or the values a row short */
static nl_attn_shape attn_shape(void)
{
    const nl_attn_shape s = {.B = 1, .T = 40, .kv_cap = 40, .H = 2, .G = 1, .hd = 16};
    return s;
}

static void run_attention(nl_backend *be, int which)
{
    const nl_attn_shape s = attn_shape();
    const size_t qn = (size_t)s.T * s.H * s.hd, kn = (size_t)s.kv_cap * s.G * s.hd;
    float *q = buf(qn, 0), *k = buf(kn, 0);
    float *v = buf(kn, which == SHORT_IN ? (size_t)s.G * s.hd : 0);
    float *out = buf(qn, which == SHORT_OUT ? (size_t)s.H * s.hd : 0);
    float *lse = buf((size_t)s.H * s.T, 0);
    nl_cpu_attention_forward(be, out, lse, q, s.H * s.hd, k, v, s.G * s.hd, s);
    free(q), free(k), free(v), free(out), free(lse);
}

static void run_attention_backward(nl_backend *be, int which)
{
    const nl_attn_shape s = attn_shape();
    const size_t qn = (size_t)s.T * s.H * s.hd, kn = (size_t)s.kv_cap * s.G * s.hd;
    float *q = buf(qn, 0), *k = buf(kn, 0), *v = buf(kn, 0), *out = buf(qn, 0);
    float *lse = buf((size_t)s.H * s.T, 0);
    nl_cpu_attention_forward(be, out, lse, q, s.H * s.hd, k, v, s.G * s.hd, s);
    float *dout = buf(qn, which == SHORT_IN ? (size_t)s.H * s.hd : 0);
    float *dq = buf(qn, which == SHORT_OUT ? (size_t)s.H * s.hd : 0);
    float *dk = buf(kn, 0), *dv = buf(kn, 0);
    nl_cpu_attention_backward(be, dq, dk, dv, dout, q, s.H * s.hd, k, v, s.G * s.hd, out, lse, s);
    free(q), free(k), free(v), free(out), free(lse), free(dout), free(dq), free(dk), free(dv);
}

typedef void (*runner)(nl_backend *be, int which);

/* Run r(which) in a child on a one-thread CPU backend; returns its wait
 * status, its stderr in err (at most cap - 1 bytes). */
static int in_child(runner r, int which, char *err, size_t cap)
{
    int fd[2];
    if (pipe(fd) != 0)
        abort();
    fflush(NULL);
    const pid_t pid = fork();
    if (pid < 0)
        abort();
    if (pid == 0) {
        dup2(fd[1], 2);
        close(fd[0]), close(fd[1]);
        nl_backend *be = NULL;
        nl_error e = {0};
        nl_backend_opts o = {.threads = 1};
        if (nl_backend_new(&be, "cpu", &o, &e) != NL_OK) {
            fprintf(stderr, "backend: %s\n", e.msg);
            _exit(3);
        }
        r(be, which);
        nl_backend_destroy(&be);
        _exit(0);
    }
    close(fd[1]);
    size_t got = 0;
    for (;;) {
        const ssize_t n = read(fd[0], err + got, cap - 1 - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
        if (got == cap - 1) { /* keep draining, keep the head */
            char sink[4096];
            while (read(fd[0], sink, sizeof sink) > 0)
                ;
            break;
        }
    }
    err[got] = '\0';
    close(fd[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return status;
}

static void expect(const char *name, runner r, int which, const char *kernel)
{
    static char err[1 << 16];
    const int status = in_child(r, which, err, sizeof err);
    if (which == SHORT_NONE) {
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && !strstr(err, "ERROR"),
              "%s with exact buffers: status %d, stderr:\n%s", name, status, err);
        return;
    }
    const int died = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(died, "%s (%s a row short) was not stopped", name, which == SHORT_OUT ? "out" : "in");
    CHECK(strstr(err, "heap-buffer-overflow") != NULL, "%s: no ASan report:\n%s", name, err);
    CHECK(strstr(err, which == SHORT_OUT ? "WRITE of size" : "READ of size") != NULL,
          "%s: the report does not say %s:\n%s", name, which == SHORT_OUT ? "WRITE" : "READ", err);
    CHECK(strstr(err, kernel) != NULL, "%s: the report does not name %s:\n%s", name, kernel, err);
}

int main(void)
{
    expect("gemm", run_gemm, SHORT_NONE, NULL);
    expect("gemm", run_gemm, SHORT_OUT, "tile");
    expect("attention_forward", run_attention, SHORT_NONE, NULL);
    expect("attention_forward", run_attention, SHORT_OUT, "attend_tile");
    expect("attention_forward", run_attention, SHORT_IN, "attend_tile");
    expect("attention_backward", run_attention_backward, SHORT_NONE, NULL);
    /* dq's rows are cleared first (backward_task's memset, instrumented) */
    expect("attention_backward", run_attention_backward, SHORT_OUT, "backward_task");
    expect("attention_backward", run_attention_backward, SHORT_IN, "block_rows");
    return check_done("test_hot_checks");
}
