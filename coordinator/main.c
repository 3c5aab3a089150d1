/* neurocoord: the coordinator daemon: its signals, its descriptor limit and
 * the run. The flags are coord_cli.c's. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "base/log.h"
#include "coordinator/coord.h"
#include "coordinator/coord_cli.h"
#include "coordinator/coord_http.h"
#include "core/formats/fileio.h"
#include "net/auth.h"
#include "net/transport.h"

static volatile sig_atomic_t stop_flag;

/* SIGINT, SIGTERM: stop (the nodes wait for a restart); SIGUSR2: take
 * the cluster down, the nodes with it (neuroctl cluster down). */
static void on_stop(int sig)
{
    stop_flag = sig == SIGUSR2 || stop_flag == NL_COORD_STOP_NODES ? NL_COORD_STOP_NODES : 1;
}

/* Every node holds one descriptor (its connection): raise the soft limit
 * to the hard one and say how many nodes that admits. */
static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    const rlim_t was = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (rl.rlim_cur != was && setrlimit(RLIMIT_NOFILE, &rl) != 0)
        rl.rlim_cur = was;
    const long long fds = rl.rlim_cur == RLIM_INFINITY ? 1 << 20 : (long long)rl.rlim_cur;
    const long long nodes = fds - 128 < 65536 ? fds - 128 : 65536;
    NL_INFO("descriptors: %lld (hard limit %lld): room for about %lld nodes and clients at once "
            "(a connection each; the node table holds 65536)",
            fds, rl.rlim_max == RLIM_INFINITY ? -1 : (long long)rl.rlim_max, nodes > 0 ? nodes : 0);
}

/* What /v1/models lists: the file served, or "cluster". */
static const char *model_name(const nl_coord_opts *o)
{
    const char *p = o->model ? o->model : o->resume;
    const char *slash = p ? strrchr(p, '/') : NULL;
    return p ? (slash && slash[1] ? slash + 1 : p) : "cluster";
}

int main(int argc, char **argv)
{
    nl_coord_cli cli;
    int rc = nl_coord_cli_parse(&cli, argc, argv);
    if (rc >= 0)
        return rc;
    nl_coord_opts o = cli.coord;
    nl_log_set_name("coord");
    raise_nofile();
    if (o.plaintext)
        NL_WARN("--plaintext: the nodes' and clients' sockets are neither encrypted nor "
                "authenticated");
    mkdir(o.state_dir, 0700);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR2, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    nl_error err = {0};
    nl_coord *c = NULL;
    nl_coord_http *web = NULL;
    const char *http = cli.http.addr;
    rc = 0;
    if (nl_auth_hup_install(&err) != NL_OK || nl_coord_new(&c, &o, &err) != NL_OK ||
        (http && nl_coord_http_start(&web, c, model_name(&o), cli.http_adapters, o.state_dir,
                                     o.plaintext, &cli.http, &err) != NL_OK))
        rc = 1;
    if (rc == 0 && web) { /* say where, and keep it in STATE_DIR/http for cluster up */
        const char *colon = strrchr(http, ':');
        char url[300], path[4096];
        int n = snprintf(url, sizeof url, "http://%.*s:%d/\n", (int)(colon ? colon - http : 0),
                         http, nl_coord_http_port(web));
        snprintf(path, sizeof path, "%s/http", o.state_dir);
        NL_INFO("HTTP on %.*s", n - 1, url);
        if (nl_file_write_atomic(path, url, (size_t)n, &err) != NL_OK)
            NL_WARN("%s", err.msg);
    }
    if (rc == 0 && nl_coord_run(c, &stop_flag, &err) != NL_OK)
        rc = 1;
    if (rc)
        NL_ERROR("%s (%s)", err.msg, nl_status_str(err.status));
    nl_coord_http_stop(&web);
    nl_coord_destroy(&c);
    nl_net_parts_check("neurocoord");
    return rc;
}
