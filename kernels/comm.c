/* The replicas' communicator (comm.h): argument checks, the choice of an
 * implementation, the host all-reduce and broadcast, and the lookup of the
 * NCCL one in the CUDA module that made the backends. */
#define _GNU_SOURCE /* dladdr: which module a backend's code lives in */
#include "kernels/comm.h"
#include "kernels/comm_impl.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- host */

/* Floats per piece: the host holds two pieces (the sum and one replica's
 * copy), 32 MiB at most, whatever the buffer's size. */
#define HOST_PIECE ((size_t)1 << 22)

typedef struct host_ctx {
    float *acc, *tmp; /* HOST_PIECE floats each, or fewer until a larger buffer comes */
    size_t cap;
} host_ctx;

static nl_status host_reserve(nl_comm *c, size_t n, nl_error *err)
{
    host_ctx *h = c->ctx;
    const size_t want = n < HOST_PIECE ? n : HOST_PIECE;
    if (want <= h->cap)
        return NL_OK;
    float *acc = malloc(want * sizeof *acc), *tmp = malloc(want * sizeof *tmp);
    if (!acc || !tmp) {
        free(acc);
        free(tmp);
        return nl_error_set(err, NL_ERR_NOMEM, "host all-reduce: out of memory for %zu floats",
                            2 * want);
    }
    free(h->acc);
    free(h->tmp);
    h->acc = acc;
    h->tmp = tmp;
    h->cap = want;
    return NL_OK;
}

/* Every replica's sticky device error, the first one named. */
static nl_status host_check(nl_comm *c, const char *op, nl_error *err)
{
    for (int r = 0; r < c->n; r++) {
        nl_error e = {0};
        nl_status st = nl_backend_check(c->be[r], &e);
        if (st != NL_OK)
            return nl_error_set(err, st, "host %s: replica %d (%s): %s", op, r, c->be[r]->name,
                                e.msg);
    }
    return NL_OK;
}

/* A host pointer to k floats of replica r at src: the memory itself on a
 * host-memory backend, else a copy in dst. */
static const float *host_read(nl_backend *be, float *dst, const float *src, size_t k)
{
    if (be->host_memory)
        return src;
    be->download(be, dst, src, k * sizeof(float));
    return dst;
}

static nl_status host_allreduce(nl_comm *c, float *const *buf, size_t n, nl_error *err)
{
    nl_status st = host_reserve(c, n, err);
    if (st != NL_OK)
        return st;
    host_ctx *h = c->ctx;
    for (size_t off = 0; off < n; off += h->cap) {
        const size_t k = n - off < h->cap ? n - off : h->cap;
        c->be[0]->download(c->be[0], h->acc, buf[0] + off, k * sizeof(float));
        /* the fixed order: acc = ((b0 + b1) + b2) + ... */
        for (int r = 1; r < c->n; r++) {
            const float *x = host_read(c->be[r], h->tmp, buf[r] + off, k);
            for (size_t i = 0; i < k; i++)
                h->acc[i] += x[i];
        }
        for (int r = 0; r < c->n; r++)
            c->be[r]->upload(c->be[r], buf[r] + off, h->acc, k * sizeof(float));
    }
    return host_check(c, "all-reduce", err);
}

static nl_status host_broadcast(nl_comm *c, float *const *buf, size_t n, int root, nl_error *err)
{
    nl_status st = host_reserve(c, n, err);
    if (st != NL_OK)
        return st;
    host_ctx *h = c->ctx;
    nl_backend *src = c->be[root];
    for (size_t off = 0; off < n; off += h->cap) {
        const size_t k = n - off < h->cap ? n - off : h->cap;
        const float *x = host_read(src, h->acc, buf[root] + off, k);
        for (int r = 0; r < c->n; r++)
            if (r != root)
                c->be[r]->upload(c->be[r], buf[r] + off, x, k * sizeof(float));
    }
    return host_check(c, "broadcast", err);
}

static void host_destroy(nl_comm *c)
{
    host_ctx *h = c->ctx;
    if (h) {
        free(h->acc);
        free(h->tmp);
        free(h);
    }
    free(c);
}

static nl_status host_new(nl_comm **out, nl_backend *const *be, int n, nl_error *err)
{
    nl_comm *c = calloc(1, sizeof *c);
    host_ctx *h = calloc(1, sizeof *h);
    if (!c || !h) {
        free(c);
        free(h);
        return nl_error_set(err, NL_ERR_NOMEM, "host communicator: out of memory");
    }
    c->name = "host";
    c->n = n;
    memcpy(c->be, be, (size_t)n * sizeof *be);
    c->ctx = h;
    c->allreduce_sum = host_allreduce;
    c->broadcast = host_broadcast;
    c->destroy = host_destroy;
    *out = c;
    return NL_OK;
}

/* ---------------------------------------------------------------- nccl */

static int is_cuda(const nl_backend *be)
{
    return strncmp(be->name, "cuda:", 5) == 0;
}

/* The NCCL communicator of the CUDA module the backends' code lives in
 * (dladdr on a slot of their table): the module stays loaded for the life
 * of the process (backend_factory.c), so its handle is found without
 * loading it again. */
static nl_status nccl_new(nl_comm **out, nl_backend *const *be, int n, nl_error *err)
{
    Dl_info info[NL_COMM_MAX];
    for (int r = 0; r < n; r++) {
        if (!dladdr((void *)be[r]->destroy, &info[r]) || !info[r].dli_fname)
            return nl_error_set(err, NL_ERR_UNSUPPORTED,
                                "nccl: replica %d (%s): cannot find its CUDA module", r,
                                be[r]->name);
        if (r > 0 && strcmp(info[r].dli_fname, info[0].dli_fname) != 0)
            return nl_error_set(err, NL_ERR_INVALID,
                                "nccl: replicas 0 and %d come from different CUDA modules (%s, %s)",
                                r, info[0].dli_fname, info[r].dli_fname);
    }
    void *h = dlopen(info[0].dli_fname, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!h)
        return nl_error_set(err, NL_ERR_UNSUPPORTED, "nccl: %s is not loaded", info[0].dli_fname);
    nl_cuda_comm_abi_fn abi = (nl_cuda_comm_abi_fn)dlsym(h, "nl_cuda_comm_abi");
    nl_cuda_comm_new_fn make = (nl_cuda_comm_new_fn)dlsym(h, "nl_cuda_comm_new");
    dlclose(h); /* drops the reference RTLD_NOLOAD took; the factory's stays */
    if (!abi || !make)
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "nccl: %s has no communicator (an older build)", info[0].dli_fname);
    if (abi() != NL_COMM_ABI)
        return nl_error_set(err, NL_ERR_VERSION,
                            "nccl: %s was built for communicator ABI %d, this program has %d",
                            info[0].dli_fname, abi(), NL_COMM_ABI);
    return make(out, be, n, err);
}

/* ---------------------------------------------------------------- interface */

nl_status nl_comm_new(nl_comm **out, nl_backend *const *be, int n, nl_comm_kind kind, nl_error *err)
{
    *out = NULL;
    if (n < 1 || n > NL_COMM_MAX)
        return nl_error_set(err, NL_ERR_INVALID, "communicator: %d replicas (1 to %d)", n,
                            NL_COMM_MAX);
    int cuda = 0;
    for (int r = 0; r < n; r++) {
        if (!be[r])
            return nl_error_set(err, NL_ERR_INVALID, "communicator: replica %d has no backend", r);
        for (int q = 0; q < r; q++)
            if (be[q] == be[r])
                return nl_error_set(err, NL_ERR_INVALID,
                                    "communicator: replicas %d and %d share one backend (%s)", q, r,
                                    be[r]->name);
        cuda += is_cuda(be[r]);
    }
    if (kind == NL_COMM_NCCL && cuda < n) {
        for (int r = 0; r < n; r++)
            if (!is_cuda(be[r]))
                return nl_error_set(err, NL_ERR_UNSUPPORTED,
                                    "nccl: replica %d is on %s, not a CUDA device", r, be[r]->name);
    }
    if (kind == NL_COMM_NCCL || (kind == NL_COMM_AUTO && cuda == n)) {
        nl_status st = nccl_new(out, be, n, err);
        /* AUTO: a module without NCCL still has the host */
        if (st == NL_OK || kind == NL_COMM_NCCL || st != NL_ERR_UNSUPPORTED)
            return st;
    }
    return host_new(out, be, n, err);
}

void nl_comm_destroy(nl_comm **c)
{
    if (!c || !*c)
        return;
    (*c)->destroy(*c);
    *c = NULL;
}

int nl_comm_size(const nl_comm *c)
{
    return c->n;
}

const char *nl_comm_name(const nl_comm *c)
{
    return c->name;
}

static nl_status check_bufs(const nl_comm *c, const char *op, float *const *buf, size_t n,
                            nl_error *err)
{
    if (n == 0)
        return nl_error_set(err, NL_ERR_INVALID, "%s %s: no floats", c->name, op);
    for (int r = 0; r < c->n; r++)
        if (!buf[r])
            return nl_error_set(err, NL_ERR_INVALID, "%s %s: replica %d (%s) has no buffer",
                                c->name, op, r, c->be[r]->name);
    return NL_OK;
}

nl_status nl_comm_allreduce_sum(nl_comm *c, float *const *buf, size_t n, nl_error *err)
{
    nl_status st = check_bufs(c, "all-reduce", buf, n, err);
    if (st != NL_OK || c->n == 1)
        return st;
    return c->allreduce_sum(c, buf, n, err);
}

nl_status nl_comm_broadcast(nl_comm *c, float *const *buf, size_t n, int root, nl_error *err)
{
    nl_status st = check_bufs(c, "broadcast", buf, n, err);
    if (st != NL_OK)
        return st;
    if (root < 0 || root >= c->n)
        return nl_error_set(err, NL_ERR_RANGE, "%s broadcast: root %d of %d replicas", c->name,
                            root, c->n);
    if (c->n == 1)
        return NL_OK;
    st = c->broadcast(c, buf, n, root, err);
    /* a collective writes device memory by a way no slot sees (NCCL): any
     * bf16 copy of it is stale on the receivers (the host path's uploads
     * already said so; saying it twice costs nothing) */
    for (int r = 0; st == NL_OK && r < c->n; r++)
        if (r != root && c->be[r]->wrote)
            c->be[r]->wrote(c->be[r], buf[r], n * sizeof(float));
    return st;
}
