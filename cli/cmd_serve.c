/* neuroctl serve: one process serves a model over HTTP (serve/http.h):
 * the command's flags, the process (OpenMP's spin, signals), and the HTTP
 * server in front of the engine (cli/serve_engine.c: the jobs, the batched
 * decoder's thread, what the HTTP threads ask of it), from start to stop. */
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/args.h"
#include "cli/cli_io.h"
#include "cli/commands.h"
#include "cli/serve_engine.h"
#include "serve/http.h"
#include "serve/http_flags.h"

/* libgomp reads GOMP_SPINCOUNT when it loads, before main: an idle
 * OpenMP thread spins 300000 iterations by default, which on a small
 * machine takes the cores the HTTP threads need to hand out tokens (p99
 * inter-token latency 10x worse on 2 cores). Unless the environment says
 * otherwise, run again with a short spin, as `cluster up` does for its
 * nodes. argv is main's argv + 1 (commands.h), so argv[-1] is the program. */
static void respawn_with_spin(int argc, char **argv, long long spin)
{
    if (getenv("GOMP_SPINCOUNT") || getenv("OMP_WAIT_POLICY") || spin < 0)
        return;
    char s[32];
    snprintf(s, sizeof s, "%lld", spin);
    setenv("GOMP_SPINCOUNT", s, 1);
    execv("/proc/self/exe", argv - 1); /* returns only on failure: go on as we are */
    (void)argc;
}

/* neuroctl serve's command line. */
typedef struct serve_args {
    const char *model, *adapter;
    nl_http_opts http;
    int max_batch, chunk, threads;
    long long spin;
    nl_cli_device dev;
} serve_args;

#define SERVE_USAGE                                                                                \
    "neuroctl serve --model MODEL [--adapter A] [--http HOST:PORT] [--http-tokens FILE] "          \
    "[--max-batch N] [--prefill-chunk N] [--max-requests N] [--http-timeout S] [--http-per-ip N] " \
    "[--http-deadline S] [--http-allow-host NAMES] [--threads N] [--spin N] [--device D] "         \
    "[--precision P] [--tf32] [--kv-cache fp32|bf16]"

/* The flags into a: 0 to run, -1 after --help, else the exit code (said). */
static int serve_flags(serve_args *a, int argc, char **argv)
{
    nl_http_opts *h = &a->http;
    *a = (serve_args){.http.addr = "127.0.0.1:8080"};
    nl_opt flags[] = {
        NL_OPT_STR("model", &a->model, "checkpoint (safetensors) to serve"),
        NL_OPT_STR("adapter", &a->adapter,
                   "LoRA adapter file (neuroctl finetune --out) merged into the served weights at "
                   "load; /v1/models names the model MODEL+ADAPTER"),
        NL_OPT_STR("http", &h->addr,
                   "HOST:PORT to listen on (default 127.0.0.1:8080; port 0: any free port)"),
        NL_HTTP_FLAG_ROWS(h),
        NL_OPT_INT("max-batch", &a->max_batch, 1, 256, "16", "generations decoded together"),
        NL_OPT_INT("prefill-chunk", &a->chunk, 1, 4096, "64",
                   "prompt positions per step while others decode"),
        NL_OPT_INT("max-requests", &h->max_requests, 1, 4096, "64",
                   "concurrent /v1 requests before 429"),
        NL_OPT_INT("http-timeout", &h->timeout_s, 1, 86400, "30",
                   "seconds a connection may sit idle, e.g. a slow client"),
        NL_OPT_INT("threads", &a->threads, 0, 1024, NULL, "worker threads (default: all cores)"),
        NL_OPT_LLONG("spin", &a->spin, 0, 100000000, NULL,
                     "iterations an idle OpenMP thread spins before it sleeps (GOMP_SPINCOUNT; "
                     "default 1000, or the environment's GOMP_SPINCOUNT or OMP_WAIT_POLICY)"),
        NL_CLI_DEVICE_OPT(&a->dev),
        NL_CLI_PRECISION_OPT(&a->dev),
        NL_CLI_TF32_OPT(&a->dev),
        NL_CLI_KV_CACHE_OPT(&a->dev),
        NL_OPT_END};
    a->spin = 1000;
    int rc = nl_opts_parse(argc, argv, flags, SERVE_USAGE, NULL, 0, NULL);
    if (rc)
        return rc == 1 ? -1 : rc;
    if (!a->model) {
        nl_opts_help(stderr, SERVE_USAGE, flags);
        return 2;
    }
    return nl_cli_device_opts(&a->dev);
}

/* The "start" event, built with jansson: the model's file name is the
 * operator's, any bytes. */
static void publish_start(serve_engine *e, const nl_backend *be)
{
    json_t *start = json_pack("{s:s,s:s,s:i}", "model", e->name, "device", be->name, "layers",
                              e->m->cfg.num_layers);
    char *ev = start ? json_dumps(start, JSON_COMPACT) : NULL;
    json_decref(start);
    if (ev)
        nl_http_publish(e->http, "start", ev);
    free(ev);
}

int nl_cmd_serve(int argc, char **argv)
{
    serve_args a;
    int rc = serve_flags(&a, argc, argv);
    if (rc)
        return rc < 0 ? 0 : rc;
    const char *model = a.model;
    nl_http_opts ho = a.http;
    long long spin = a.spin;
    respawn_with_spin(argc, argv, spin);
    nl_error err = {0};
    nl_backend *be = NULL;
    serve_engine e;
    nl_serve_engine_init(&e, a.max_batch, a.chunk, (nl_kv_dtype)a.dev.kv_cache);
    const char *slash = strrchr(model, '/'), *adapter = a.adapter;
    e.name = slash ? slash + 1 : model;
    char merged_name[512];
    if (adapter) { /* the weights served are the merged ones: the name says so */
        const char *as = strrchr(adapter, '/');
        snprintf(merged_name, sizeof merged_name, "%s+%s", e.name, as ? as + 1 : adapter);
        e.name = merged_name;
    }
    rc = 1;
    /* signals go to sigwait below, not to the server's threads */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (nl_serve_engine_load(&e, &be, model, adapter, a.dev.device, a.threads, a.dev.tf32,
                             a.dev.bf16, &err) ||
        nl_serve_engine_start(&e, &err) != NL_OK)
        goto out;
    nl_http_backend hb;
    nl_serve_engine_backend(&e, &hb);
    if (nl_http_start(&e.http, &ho, &hb, &err) != NL_OK)
        goto out;
    publish_start(&e, be);
    const char *colon = strrchr(ho.addr, ':');
    printf("neuroctl serve: %s on http://%.*s:%d/ (Ctrl-C stops)\n", e.name, (int)(colon - ho.addr),
           ho.addr, nl_http_port(e.http));
    fflush(stdout);
    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "neuroctl serve: stopping (signal %d)\n", sig);
    rc = 0;
out:
    nl_serve_engine_stop(&e);
    nl_http_stop(&e.http); /* waits for the connections, which end their jobs */
    nl_serve_engine_free(&e);
    nl_backend_destroy(&be);
    if (rc)
        fprintf(stderr, "neuroctl serve: %s (%s)\n", err.msg, nl_status_str(err.status));
    return rc;
}
