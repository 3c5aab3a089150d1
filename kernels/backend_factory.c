/* The backend factory: the one constructor, nl_backend_new, which parses
 * a device name and builds the CPU backend, the device simulator over it,
 * or a CUDA backend from the module it loads on demand (libnl_cuda.so).
 * It sits above the backends: it calls their constructors
 * (backend_impl.h), and none of them calls back into it. */
#include "kernels/backend.h"
#include "kernels/backend_impl.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* "cuda:N" -> N; -1 when device is not of that form. */
static int cuda_index(const char *device)
{
    if (strncmp(device, "cuda:", 5) != 0 || device[5] < '0' || device[5] > '9')
        return -1;
    char *end;
    errno = 0;
    long n = strtol(device + 5, &end, 10);
    if (*end || errno || n > 1024)
        return -1;
    return (int)n;
}

nl_status nl_backend_parse_device(const char *device, nl_error *err)
{
    if (!device || !*device)
        return nl_error_set(err, NL_ERR_INVALID, "device: empty (use cpu, cpu-devsim or cuda:N)");
    if (strcmp(device, "cpu") == 0 || strcmp(device, "cpu-devsim") == 0 || cuda_index(device) >= 0)
        return NL_OK;
    return nl_error_set(err, NL_ERR_INVALID, "device %s: unknown (use cpu, cpu-devsim or cuda:N)",
                        device);
}

/* The CUDA module: found next to the program (../lib or the same folder,
 * as the build tree and an install lay it out), at the build's own path,
 * or where NL_CUDA_LIB says; dlopen's search path last. */
static void *open_cuda_module(char *tried, size_t cap)
{
    char exe[PATH_MAX], path[PATH_MAX + 64];
    const char *env = getenv("NL_CUDA_LIB");
    const char *cands[5];
    int nc = 0;
    if (env && *env)
        cands[nc++] = env;
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    char dir[PATH_MAX] = "";
    if (len > 0) {
        exe[len] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            snprintf(dir, sizeof dir, "%s", exe);
        }
    }
    char c1[PATH_MAX + 64], c2[PATH_MAX + 64];
    if (*dir) {
        snprintf(c1, sizeof c1, "%s/../lib/libnl_cuda.so", dir);
        snprintf(c2, sizeof c2, "%s/libnl_cuda.so", dir);
        cands[nc++] = c1;
        cands[nc++] = c2;
    }
#ifdef NL_CUDA_MODULE_PATH
    cands[nc++] = NL_CUDA_MODULE_PATH;
#endif
    cands[nc++] = "libnl_cuda.so";
    tried[0] = '\0';
    int found = 0;
    for (int i = 0; i < nc; i++) {
        snprintf(path, sizeof path, "%s", cands[i]);
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h)
            return h;
        /* keep the failure of the first candidate that exists (it names a
         * missing cudart or cuBLAS), else the first failure */
        const char *why = dlerror();
        const int exists = strchr(path, '/') && access(path, F_OK) == 0;
        if (!tried[0] || (exists && !found)) {
            found |= exists;
            size_t n = strlen(why ? why : path);
            n = n < cap - 1 ? n : cap - 1;
            memcpy(tried, why ? why : path, n);
            tried[n] = '\0';
        }
    }
    return NULL;
}

static nl_status cuda_new(nl_backend **out, const char *device, int index, const nl_backend_opts *o,
                          nl_error *err)
{
    char why[512];
    void *h = open_cuda_module(why, sizeof why);
    if (!h)
        return nl_error_set(err, NL_ERR_UNSUPPORTED,
                            "%s: no CUDA backend in this build or install (libnl_cuda.so: %s); "
                            "build with the CUDA toolkit (NL_CUDA=ON) or use --device cpu",
                            device, why);
    nl_cuda_module_abi_fn abi = (nl_cuda_module_abi_fn)dlsym(h, "nl_cuda_module_abi");
    nl_cuda_backend_new_fn make = (nl_cuda_backend_new_fn)dlsym(h, "nl_cuda_backend_new");
    if (!abi || !make) {
        dlclose(h);
        return nl_error_set(err, NL_ERR_VERSION, "%s: libnl_cuda.so lacks its entry points",
                            device);
    }
    if (abi() != NL_BACKEND_ABI) {
        int a = abi();
        dlclose(h);
        return nl_error_set(err, NL_ERR_VERSION,
                            "%s: libnl_cuda.so was built for backend ABI %d, this program has %d",
                            device, a, NL_BACKEND_ABI);
    }
    /* the module stays loaded for the life of the process: unloading cudart
     * while the driver holds its threads is not safe */
    return make(out, index, o, err);
}

nl_status nl_backend_new(nl_backend **out, const char *device, const nl_backend_opts *o,
                         nl_error *err)
{
    *out = NULL;
    nl_backend_opts def = {0};
    if (!o)
        o = &def;
    nl_status st = nl_backend_parse_device(device, err);
    if (st != NL_OK)
        return st;
    if (o->threads < 0)
        return nl_error_set(err, NL_ERR_INVALID, "threads: %d is negative", o->threads);
    if (strcmp(device, "cpu") == 0)
        return nl_cpu_backend_new(out, o, err);
    if (strcmp(device, "cpu-devsim") == 0)
        return nl_devsim_backend_new(out, o, err);
    return cuda_new(out, device, cuda_index(device), o, err);
}
