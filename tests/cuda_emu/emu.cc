/* The runtime behind tests/cuda_emu/cuda_runtime.h: runs a kernel launch on
 * the CPU, one block after another, the block's threads as coroutines on
 * the calling OS thread (see the header for the model). A coroutine switch
 * is a few instructions on x86-64 (the assembly below) and swapcontext(3)
 * elsewhere; under AddressSanitizer every switch is announced to it
 * (__sanitizer_start/finish_switch_fiber). Why not swapcontext everywhere:
 * it changes the signal mask with a system call on every switch, and the
 * emulation switches millions of times: measured here, the test took 17 s
 * with it against 1.3 s, and over 5 minutes under ASan against 5 s. The
 * library that does this fast (Boost.Context) would bring 140 MB of
 * headers for one test; the switch below saves and restores only what the
 * x86-64 System V ABI asks a callee to keep. NL_EMU_UCONTEXT forces
 * swapcontext (to test that path on x86-64).
 *
 * Failures (a barrier that not every thread reaches, a shuffle whose lanes
 * are at different call sites, a bad configuration) abandon the launch:
 * the message goes to stderr and cudaGetLastError returns an error. */
#include "tests/cuda_emu/cuda_runtime.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

/* NL_EMU_UCONTEXT forces the portable switch (to test it on x86-64) */
#if defined(__x86_64__) && !defined(NL_EMU_UCONTEXT)
#define EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

/* the __shared__ section's bounds (weak: a program may have none) */
extern "C" char __start_nl_emu_shared[] __attribute__((weak));
extern "C" char __stop_nl_emu_shared[] __attribute__((weak));

namespace
{

/* ---------------------------------------------------------------- contexts */

struct context {
#ifdef EMU_ASM_SWITCH
    void *sp;
#else
    ucontext_t uc;
#endif
    char *stack_lo; /* the stack, for ASan (the launcher's is looked up once) */
    size_t stack_size;
};

#ifdef EMU_ASM_SWITCH
/* nl_emu_switch(&from->sp, to->sp): save the callee-saved registers, MXCSR
 * and the x87 control word on this stack, store the stack pointer, load
 * the other one and restore what it saved. */
extern "C" void nl_emu_switch(void **save_sp, void *to_sp);
asm(R"(
    .pushsection .text
    .globl nl_emu_switch
    .type nl_emu_switch, @function
nl_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size nl_emu_switch, .-nl_emu_switch
    .popsection
)");
#endif

/* ---------------------------------------------------------------- state */

enum { RUN, AT_SYNC, AT_WARP, DONE };

struct thread {
    context ctx;
    int state;
    int line;   /* call site of the barrier it waits at */
    long nsync; /* __syncthreads passed */
    long nwarp; /* warp exchanges passed */
    uint3 idx;
};

struct warp {
    int lanes;           /* threads in this warp (the last may be partial) */
    int arrived;         /* lanes waiting at the current exchange */
    int runnable;        /* lanes in state RUN */
    uint64_t buf[2][32]; /* published values, by exchange parity */
};

constexpr size_t STACK_BYTES =
#ifdef EMU_ASAN
    512 * 1024;
#else
    128 * 1024;
#endif

std::vector<char *> stacks; /* one per thread slot, reused */
#if defined(EMU_ASAN) && defined(EMU_ASM_SWITCH)
/* per stack, the lowest stack pointer a coroutine switched away at since
 * the stack was last unpoisoned: ASan's poison (the redzones of frames
 * that never returned) lies above it */
std::vector<char *> stack_low;
#endif
std::vector<thread> th;
std::vector<warp> warps;
context main_ctx;
int nth, nwarps, cur = -1; /* cur: running thread, -1 the launcher */
int sync_arrived, ndone;
/* The block's schedule (see cuda_runtime.h): warps in `order` (pos[w]: the
 * place of warp w in it), the lanes of a warp upwards or downwards. */
std::vector<int> order, pos;
bool lanes_down;
uint64_t seed = 1, seed_set; /* NL_EMU_SEED or emu_set_seed; seed_set: read */
/* shared memory poison of a block, one byte repeated: NaN (0xff), a huge
 * finite 3.39e38 (0x7f), a negative -1.0e5 (0xc7); as ints all large */
const unsigned char POISON[] = {0xff, 0x7f, 0xc7};
constexpr uint64_t NONE_BITS = ~(uint64_t)0; /* a shuffle from a lane that is not there */
bool block_failed;
void (*body_fn)(void *);
void *body_arg;
cudaError_t last_error = cudaSuccess;
long launches;

context &ctx_of(int t)
{
    return t < 0 ? main_ctx : th[t].ctx;
}

void set_state(int t, int s)
{
    warp &w = warps[t / 32];
    w.runnable += (s == RUN) - (th[t].state == RUN);
    th[t].state = s;
}

/* Switch from thread `from` to thread `to` (-1: the launcher). A thread
 * that will never run again passes dying, so ASan drops its fake stack. */
void switch_to(int from, int to, bool dying)
{
    context &a = ctx_of(from), &b = ctx_of(to);
    cur = to;
    if (to >= 0)
        threadIdx = th[to].idx;
#ifdef EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(dying ? nullptr : &fake, b.stack_lo, b.stack_size);
#ifdef EMU_ASM_SWITCH
    if (from >= 0) { /* this frame, with its redzones, is above %rsp */
        char *sp;
        asm volatile("movq %%rsp, %0" : "=r"(sp));
        if (sp < stack_low[from])
            stack_low[from] = sp;
    }
#endif
#endif
#ifdef EMU_ASM_SWITCH
    nl_emu_switch(&a.sp, b.sp);
#else
    swapcontext(&a.uc, &b.uc);
#endif
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    (void)dying;
}

/* Give up on this block: report, and return to the launcher for good. */
__attribute__((format(printf, 1, 2))) void fail(const char *fmt, ...)
{
    if (!block_failed) {
        fprintf(stderr, "cuda_emu: block (%u,%u,%u) of (%u,%u,%u) x (%u,%u,%u): ", blockIdx.x,
                blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y,
                blockDim.z);
        va_list ap;
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
    }
    block_failed = true;
    switch_to(cur, -1, true);
    abort(); /* never resumed */
}

/* The next thread to run: the rest of the current warp (lanes after `from`,
 * wrapping), then the other warps in this block's order, or -1. */
/* The first runnable lane of warp w in the block's lane order, or -1. */
int first_lane(int w)
{
    const int n = warps[w].lanes;
    for (int i = 0; i < n; i++) {
        const int t = w * 32 + (lanes_down ? n - 1 - i : i);
        if (th[t].state == RUN)
            return t;
    }
    return -1;
}

int pick_next(int from)
{
    const int w0 = from / 32;
    if (warps[w0].runnable > 0) {
        const int n = warps[w0].lanes, lane = from % 32;
        for (int i = 1; i <= n; i++) {
            const int t = w0 * 32 + (lanes_down ? lane - i + n : lane + i) % n;
            if (th[t].state == RUN)
                return t;
        }
    }
    for (int k = 1; k < nwarps; k++) {
        const int w = order[(pos[w0] + k) % nwarps];
        if (warps[w].runnable > 0)
            return first_lane(w);
    }
    return -1;
}

uint64_t mix(uint64_t x) /* splitmix64's finaliser */
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* This block's schedule and poison, from the seed, the launch and the
 * block: warps forward, backward or in a random order (a quarter, a
 * quarter, a half of the blocks), lanes up or down, one of the POISON
 * bytes. Returns the poison byte. */
unsigned char plan_block(void)
{
    if (!seed_set) {
        const char *e = getenv("NL_EMU_SEED");
        if (e && *e)
            seed = strtoull(e, nullptr, 0);
        seed_set = 1;
    }
    uint64_t r =
        mix(seed ^ mix((uint64_t)launches ^ mix(((uint64_t)blockIdx.z << 42) ^
                                                ((uint64_t)blockIdx.y << 21) ^ blockIdx.x)));
    order.resize(nwarps);
    pos.resize(nwarps);
    const int kind = (int)(r & 3);
    for (int w = 0; w < nwarps; w++)
        order[w] = kind == 1 ? nwarps - 1 - w : w;
    for (int w = nwarps - 1; kind >= 2 && w > 0; w--) { /* Fisher-Yates */
        r = mix(r);
        std::swap(order[w], order[(int)(r % (uint64_t)(w + 1))]);
    }
    for (int w = 0; w < nwarps; w++)
        pos[order[w]] = w;
    r = mix(r);
    lanes_down = (r & 1) != 0;
    return POISON[(r >> 1) % sizeof POISON];
}

/* Describe where the threads are, for a deadlock report. */
void describe_stuck(char *out, size_t n)
{
    int sync = 0, wsh = 0, done = 0, sync_line = -1, warp_line = -1;
    for (int t = 0; t < nth; t++) {
        if (th[t].state == AT_SYNC)
            sync++, sync_line = th[t].line;
        else if (th[t].state == AT_WARP)
            wsh++, warp_line = th[t].line;
        else if (th[t].state == DONE)
            done++;
    }
    int k = snprintf(out, n, "of %d threads,", nth);
    if (sync)
        k += snprintf(out + k, n - (size_t)k, " %d wait at __syncthreads (line %d),", sync,
                      sync_line);
    if (wsh)
        k += snprintf(out + k, n - (size_t)k, " %d at a warp shuffle or sync (line %d),", wsh,
                      warp_line);
    snprintf(out + k, n - (size_t)k, " %d have returned", done);
}

/* The current thread is blocked or done: run another one. */
void yield_from_current(bool dying)
{
    const int me = cur;
    const int next = pick_next(me);
    if (next >= 0) {
        if (next != me)
            switch_to(me, next, dying);
        return;
    }
    if (ndone == nth) {
        switch_to(me, -1, true);
        abort(); /* a finished block is never resumed */
    }
    char what[256];
    describe_stuck(what, sizeof what);
    fail("deadlock: %s", what);
}

void thread_entry(void)
{
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    body_fn(body_arg);
    set_state(cur, DONE);
    ndone++;
    yield_from_current(true);
    abort();
}

char *stack_for(int t)
{
    while ((int)stacks.size() <= t) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        char *p = (char *)mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            perror("cuda_emu: mmap of a thread stack");
            abort();
        }
        mprotect(p, page, PROT_NONE); /* a guard page: overflow faults */
        stacks.push_back(p + page);
#if defined(EMU_ASAN) && defined(EMU_ASM_SWITCH)
        /* ASan clears an unmapped range's shadow; said here, not assumed */
        ASAN_UNPOISON_MEMORY_REGION(p + page, STACK_BYTES);
        stack_low.push_back(p + page + STACK_BYTES);
#endif
    }
    return stacks[t];
}

void init_context(int t)
{
    context &c = th[t].ctx;
    c.stack_lo = stack_for(t);
    c.stack_size = STACK_BYTES;
#ifdef EMU_ASAN
    /* frames an abandoned or finished coroutine left poisoned: from where
     * it last switched away to the top (not the whole stack: unpoisoning
     * 512 KiB per thread and block was half of the emulation's time under
     * ASan, the shadow's pages released and faulted in again) */
#ifdef EMU_ASM_SWITCH
    char *end = c.stack_lo + c.stack_size;
    ASAN_UNPOISON_MEMORY_REGION(stack_low[t], (size_t)(end - stack_low[t]));
    stack_low[t] = end;
#else
    ASAN_UNPOISON_MEMORY_REGION(c.stack_lo, c.stack_size);
#endif
#endif
#ifdef EMU_ASM_SWITCH
    uintptr_t top = ((uintptr_t)c.stack_lo + c.stack_size) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;               /* thread_entry's return address: none */
    *--sp = (void *)&thread_entry; /* where nl_emu_switch returns to */
    for (int i = 0; i < 6; i++)
        *--sp = nullptr; /* rbp rbx r12 r13 r14 r15 */
    *--sp = nullptr;
    const uint32_t mxcsr = __builtin_ia32_stmxcsr();
    const uint16_t fcw = 0x037f;
    memcpy(sp, &mxcsr, 4);
    memcpy((char *)sp + 4, &fcw, 2);
    c.sp = sp;
#else
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = c.stack_lo;
    c.uc.uc_stack.ss_size = c.stack_size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, thread_entry, 0);
#endif
}

void run_block(void)
{
    const unsigned char poison = plan_block();
    char *lo = __start_nl_emu_shared, *hi = __stop_nl_emu_shared;
    if (lo && hi > lo)
        memset(lo, poison, (size_t)(hi - lo));
    sync_arrived = ndone = 0;
    for (int w = 0; w < nwarps; w++) {
        warps[w].lanes = min(32, nth - 32 * w);
        warps[w].arrived = 0;
        warps[w].runnable = warps[w].lanes;
    }
    for (int t = 0; t < nth; t++) {
        thread &x = th[t];
        x.state = RUN;
        x.line = -1;
        x.nsync = x.nwarp = 0;
        x.idx = {t % blockDim.x, t / blockDim.x % blockDim.y, t / (blockDim.x * blockDim.y)};
        init_context(t);
    }
    switch_to(-1, first_lane(order[0]), false);
}

} // namespace

/* ---------------------------------------------------------------- API */

cudaError_t cudaGetLastError(void)
{
    const cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    return last_error;
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorInvalidConfiguration:
        return "invalid configuration argument";
    case cudaErrorStreamCaptureUnsupported:
        return "operation not permitted when stream is capturing";
    default:
        return "unspecified launch failure";
    }
}

long emu_launch_count(void)
{
    return launches;
}

void emu_set_seed(uint64_t s)
{
    seed = s;
    seed_set = 1;
}

unsigned emu_lane(void)
{
    return (unsigned)cur % 32;
}

void emu_syncthreads(int line)
{
    thread &me = th[cur];
    me.nsync++;
    me.line = line;
    set_state(cur, AT_SYNC);
    if (++sync_arrived == nth) {
        for (int t = 0; t < nth; t++)
            if (th[t].line != line)
                fail("barrier divergence: __syncthreads at line %d and at line %d", line,
                     th[t].line);
        for (int t = 0; t < nth; t++)
            set_state(t, RUN);
        sync_arrived = 0;
        /* start the next phase from the block's first warp in its order */
        const int first = first_lane(order[0]);
        if (first != cur)
            switch_to(cur, first, false);
        return;
    }
    yield_from_current(false);
}

uint64_t emu_warp_exchange(unsigned mask, uint64_t mine, int src, int line)
{
    const int me = cur, lane = me % 32;
    warp &w = warps[me / 32];
    const unsigned all = w.lanes == 32 ? 0xffffffffu : (1u << w.lanes) - 1;
    if ((mask & all) != all)
        fail("a warp operation at line %d with mask %#x: only whole-warp masks are emulated", line,
             mask);
    thread &t = th[me];
    const int par = (int)(t.nwarp & 1);
    w.buf[par][lane] = mine;
    t.nwarp++;
    t.line = line;
    set_state(me, AT_WARP);
    if (++w.arrived == w.lanes) {
        const int base = me - lane;
        for (int l = 0; l < w.lanes; l++) {
            const thread &o = th[base + l];
            if (o.line != line || o.nwarp != t.nwarp)
                fail("warp divergence: lane %d at a warp operation at line %d, lane %d at "
                     "line %d",
                     lane, line, l, o.line);
        }
        for (int l = 0; l < w.lanes; l++)
            set_state(base + l, RUN);
        w.arrived = 0;
    }
    yield_from_current(false);
    /* a lane of a partial warp that does not exist: undefined on a GPU,
     * all ones here (NaN as a float) */
    return src >= w.lanes && src < 32 ? NONE_BITS : src >= 0 && src < 32 ? w.buf[par][src] : mine;
}

void emu_syncwarp(unsigned mask, int line)
{
    (void)emu_warp_exchange(mask, 0, 0, line);
}

unsigned emu_ballot(unsigned mask, int pred, int line)
{
    /* every lane publishes its predicate; lane l then reads them all from
     * the buffer of this exchange (the parity it used) */
    const int me = cur, lane = me % 32;
    warp &w = warps[me / 32];
    const int par = (int)(th[me].nwarp & 1);
    (void)emu_warp_exchange(mask, (uint64_t)pred, lane, line);
    unsigned r = 0;
    for (int l = 0; l < w.lanes; l++)
        r |= w.buf[par][l] ? 1u << l : 0u;
    return r;
}

void emu_run(dim3 grid, dim3 block, size_t shmem, void (*body)(void *), void *arg)
{
    launches++;
    const unsigned long long n = (unsigned long long)block.x * block.y * block.z;
    if (n == 0 || n > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
        fprintf(stderr, "cuda_emu: invalid launch configuration (%u,%u,%u) x (%u,%u,%u)\n", grid.x,
                grid.y, grid.z, block.x, block.y, block.z);
        last_error = cudaErrorInvalidConfiguration;
        return;
    }
    if (shmem != 0) {
        fprintf(stderr, "cuda_emu: dynamic shared memory is not emulated\n");
        last_error = cudaErrorInvalidConfiguration;
        return;
    }
#ifdef EMU_ASAN
    if (!main_ctx.stack_lo) { /* ASan must be told the launcher's stack too */
        pthread_attr_t a;
        void *lo = nullptr;
        size_t size = 0;
        if (pthread_getattr_np(pthread_self(), &a) == 0) {
            pthread_attr_getstack(&a, &lo, &size);
            pthread_attr_destroy(&a);
        }
        main_ctx.stack_lo = (char *)lo;
        main_ctx.stack_size = size;
    }
#endif
    gridDim = grid;
    blockDim = block;
    nth = (int)n;
    nwarps = (nth + 31) / 32;
    th.assign(nth, thread{});
    warps.assign(nwarps, warp{});
    body_fn = body;
    body_arg = arg;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = {x, y, z};
                block_failed = false;
                run_block();
                if (block_failed) {
                    last_error = cudaErrorLaunchFailure;
                    cur = -1;
                    return;
                }
            }
    cur = -1;
}
