/* The sanitized build's checks in the kernels' unsanitized hot loops
 * (NL_HOT and nl_hot_rows, kernels/cpu/cpu_math.h). The GEMM's tile and
 * attention's tiles, forward and backward, run without ASan's
 * instrumentation, so each checks the rows it touches. Here each is called
 * with buffers of exactly the size it needs (no report, exit 0), then with
 * one buffer a row short (an output, the inputs; a bf16 cache, a session's
 * own cache, packed documents), which must end the process with ASan's
 * heap-buffer-overflow report, a READ or a WRITE, naming the function, as
 * the instrumented loops did. Each call runs in a child process.
 * Registered in the NL_SANITIZE build only (elsewhere nothing reports). */
#include "check.h"
#include "kernels/cpu/cpu_ops.h"

#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

/* which buffer a call gets a row short (NONE: every buffer exact) */
enum { NONE, C_OUT, Q, V, OUT, LSE, DOC, DOUT, DQ };

/* a buffer of n elements of `size` bytes, less `short_by` elements at the
 * end, filled with small values (floats) or small ids (int32, bf16 bits) */
static void *buf(size_t n, size_t size, size_t short_by)
{
    unsigned char *p = malloc((n - short_by) * size);
    if (!p)
        abort();
    for (size_t i = 0; i < n - short_by; i++) {
        const float f = (float)((i * 7) % 13) / 13.0f - 0.5f;
        if (size == sizeof(float))
            memcpy(p + i * size, &f, sizeof f);
        else {
            const uint16_t h = (uint16_t)(0x3f00 | (i % 64)); /* bf16 near 0.5 */
            memcpy(p + i * size, &h, sizeof h);
        }
    }
    return p;
}
#define FBUF(n, short_by) ((float *)buf((n), sizeof(float), (short_by)))

/* C (12 x 16) = A (12 x 8) B (8 x 16), two whole tiles */
static void run_gemm(nl_backend *be, int which)
{
    const int M = 12, N = 16, K = 8;
    float *A = FBUF((size_t)M * K, 0), *B = FBUF((size_t)K * N, 0);
    float *C = FBUF((size_t)M * N, which == C_OUT ? (size_t)N : 0);
    nl_cpu_gemm_chain(be, 0, 0, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
    free(A), free(B), free(C);
}

/* one sequence of 40 positions, 2 query heads on 1 kv head, hd 16; with
 * packed documents (doc: 4 of 10 positions) when which is DOC */
static const nl_attn_shape S40 = {.B = 1, .T = 40, .kv_cap = 40, .H = 2, .G = 1, .hd = 16};

static int32_t *docs(int which)
{
    int32_t *doc = buf((size_t)S40.T, sizeof(int32_t), which == DOC ? 1 : 0);
    for (int t = 0; t < S40.T - (which == DOC); t++)
        doc[t] = t / 10;
    return doc;
}

static void run_forward(nl_backend *be, int which)
{
    const nl_attn_shape s = S40;
    const size_t qn = (size_t)s.T * s.H * s.hd, kn = (size_t)s.kv_cap * s.G * s.hd;
    const size_t qrow = (size_t)s.H * s.hd, krow = (size_t)s.G * s.hd;
    float *q = FBUF(qn, which == Q ? qrow : 0), *k = FBUF(kn, 0);
    float *v = FBUF(kn, which == V ? krow : 0);
    float *out = FBUF(qn, which == OUT ? qrow : 0);
    float *lse = FBUF((size_t)s.H * s.T, which == LSE ? 1 : 0);
    int32_t *doc = docs(which);
    const nl_attn_mask mask = {.doc = doc};
    nl_cpu_attention_masked_forward(be, out, lse, q, (int)qrow, k, v, (int)krow, s, mask);
    free(q), free(k), free(v), free(out), free(lse), free(doc);
}

/* a bf16 cache (kv_bf16: k and v hold bf16 bits) */
static void run_forward_bf16(nl_backend *be, int which)
{
    nl_attn_shape s = S40;
    s.kv_bf16 = 1;
    const size_t qn = (size_t)s.T * s.H * s.hd, kn = (size_t)s.kv_cap * s.G * s.hd;
    const size_t krow = (size_t)s.G * s.hd;
    float *q = FBUF(qn, 0), *out = FBUF(qn, 0), *lse = FBUF((size_t)s.H * s.T, 0);
    uint16_t *k = buf(kn, sizeof(uint16_t), 0);
    uint16_t *v = buf(kn, sizeof(uint16_t), which == V ? krow : 0);
    nl_cpu_attention_forward(be, out, lse, q, s.H * s.hd, (const float *)k, (const float *)v,
                             (int)krow, s);
    free(q), free(out), free(lse), free(k), free(v);
}

/* a decode step of two sessions, each in a cache of its own (kseq, vseq)
 * holding 20 past positions and this one */
static void run_forward_sessions(nl_backend *be, int which)
{
    const nl_attn_shape base = {.B = 2, .T = 1, .past = 20, .kv_cap = 21, .H = 2, .G = 1, .hd = 16};
    nl_attn_shape s = base;
    const size_t qn = (size_t)s.B * s.H * s.hd, krow = (size_t)s.G * s.hd;
    const size_t kn = (size_t)s.kv_cap * krow;
    float *q = FBUF(qn, 0), *out = FBUF(qn, 0), *lse = FBUF((size_t)s.H * s.B, 0);
    float *k[2] = {FBUF(kn, 0), FBUF(kn, 0)};
    float *v[2] = {FBUF(kn, 0), FBUF(kn, which == V ? krow : 0)}; /* session 1's */
    const void *kseq[2] = {k[0], k[1]}, *vseq[2] = {v[0], v[1]};
    s.kseq = kseq;
    s.vseq = vseq;
    nl_cpu_attention_forward(be, out, lse, q, s.H * s.hd, k[0], v[0], (int)krow, s);
    free(q), free(out), free(lse), free(k[0]), free(k[1]), free(v[0]), free(v[1]);
}

static void run_backward(nl_backend *be, int which)
{
    const nl_attn_shape s = S40;
    const size_t qn = (size_t)s.T * s.H * s.hd, kn = (size_t)s.kv_cap * s.G * s.hd;
    const size_t qrow = (size_t)s.H * s.hd, krow = (size_t)s.G * s.hd;
    float *q = FBUF(qn, 0), *k = FBUF(kn, 0), *v = FBUF(kn, 0), *out = FBUF(qn, 0);
    float *lse = FBUF((size_t)s.H * s.T, 0);
    int32_t *doc = docs(NONE);
    const nl_attn_mask mask = {.doc = doc};
    nl_cpu_attention_masked_forward(be, out, lse, q, (int)qrow, k, v, (int)krow, s, mask);
    if (which == DOC) { /* the backward's own copy of the documents, a row short */
        free(doc);
        doc = docs(DOC);
    }
    /* the forward's outputs, copied into buffers of the size under test */
    float *o2 = FBUF(qn, which == OUT ? qrow : 0);
    memcpy(o2, out, (qn - (which == OUT ? qrow : 0)) * sizeof *o2);
    float *l2 = FBUF((size_t)s.H * s.T, which == LSE ? 1 : 0);
    memcpy(l2, lse, ((size_t)s.H * s.T - (which == LSE)) * sizeof *l2);
    float *dout = FBUF(qn, which == DOUT ? qrow : 0);
    float *dq = FBUF(qn, which == DQ ? qrow : 0);
    float *dk = FBUF(kn, 0), *dv = FBUF(kn, 0);
    const nl_attn_mask mask2 = {.doc = doc};
    nl_cpu_attention_masked_backward(be, dq, dk, dv, dout, q, (int)qrow, k, v, (int)krow, o2, l2, s,
                                     mask2);
    free(q), free(k), free(v), free(out), free(lse), free(doc), free(o2), free(l2), free(dout);
    free(dq), free(dk), free(dv);
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

/* r with every buffer exact must pass without a report; with buffer
 * `which` a row short it must end in ASan's report of a `kind` ("READ",
 * "WRITE") in function fn */
static void expect(const char *name, runner r, int which, const char *kind, const char *fn)
{
    static char err[1 << 16];
    const int status = in_child(r, which, err, sizeof err);
    if (which == NONE) {
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && !strstr(err, "ERROR"),
              "%s with exact buffers: status %d, stderr:\n%s", name, status, err);
        return;
    }
    char want[64];
    snprintf(want, sizeof want, "%s of size", kind);
    const int died = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(died, "%s (buffer %d a row short) was not stopped", name, which);
    CHECK(strstr(err, "heap-buffer-overflow") != NULL, "%s/%d: no ASan report:\n%s", name, which,
          err);
    CHECK(strstr(err, want) != NULL, "%s/%d: the report does not say %s:\n%s", name, which, want,
          err);
    CHECK(strstr(err, fn) != NULL, "%s/%d: the report does not name %s:\n%s", name, which, fn, err);
}

/* every call: exact first, then each buffer a row short in turn */
static const struct {
    const char *name;
    runner r;
    int which;
    const char *kind, *fn;
} cases[] = {
    {"gemm", run_gemm, NONE, NULL, NULL},
    {"gemm", run_gemm, C_OUT, "WRITE", "tile"},
    /* (its packed panels of A and B, checked too, are the GEMM's own) */
    {"attention_forward", run_forward, NONE, NULL, NULL},
    {"attention_forward", run_forward, Q, "READ", "attend_tile"},
    {"attention_forward", run_forward, V, "READ", "attend_tile"},
    {"attention_forward", run_forward, DOC, "READ", "attend_tile"},
    {"attention_forward", run_forward, OUT, "WRITE", "attend_tile"},
    {"attention_forward", run_forward, LSE, "WRITE", "attend_tile"},
    {"attention_forward bf16 cache", run_forward_bf16, NONE, NULL, NULL},
    {"attention_forward bf16 cache", run_forward_bf16, V, "READ", "attend_tile"},
    {"attention_forward sessions", run_forward_sessions, NONE, NULL, NULL},
    {"attention_forward sessions", run_forward_sessions, V, "READ", "attend_tile"},
    {"attention_backward", run_backward, NONE, NULL, NULL},
    {"attention_backward", run_backward, DOUT, "READ", "block_rows"},
    {"attention_backward", run_backward, OUT, "READ", "block_rows"},
    {"attention_backward", run_backward, LSE, "READ", "block_rows"},
    {"attention_backward", run_backward, DOC, "READ", "block_rows"},
    /* dq's rows are cleared first, by backward_task's memset (instrumented);
     * block_accumulate's rows are block_rows', checked there first */
    {"attention_backward", run_backward, DQ, "WRITE", "backward_task"},
};

int main(void)
{
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect(cases[i].name, cases[i].r, cases[i].which, cases[i].kind, cases[i].fn);
    return check_done("test_hot_checks");
}
