/* neuroctl's connection to a coordinator: the flags that name it (or a
 * local cluster's directory) and the keys; the protocol itself is
 * net/client.h's. See remote.h. */
#include "cli/remote.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/formats/fileio.h"

void nl_remote_close(nl_remote *r)
{
    nl_sock_destroy(&r->s);
    nl_net_destroy(&r->net);
    nl_keys_wipe(&r->kp);
}

/* Read a one-line file (the endpoint a coordinator wrote). */
static nl_status read_line(const char *path, char *out, size_t cap, nl_error *err)
{
    char *buf = NULL;
    size_t n = 0;
    nl_status st = nl_file_read_all(path, 4096, &buf, &n, err);
    if (st != NL_OK)
        return st;
    while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' '))
        buf[--n] = '\0';
    if (n == 0 || n >= cap)
        st = nl_error_set(err, NL_ERR_FORMAT, "%s: expected one line", path);
    else
        memcpy(out, buf, n + 1);
    free(buf);
    return st;
}

/* Is the coordinator of the local cluster in dir (cluster up) alive? Its
 * pid file names it; cluster down removes the file. */
static int cluster_running(const char *dir)
{
    char p[4096], *buf = NULL;
    size_t n = 0;
    nl_error err = {0};
    snprintf(p, sizeof p, "%s/coord.pid", dir);
    if (nl_file_read_all(p, 64, &buf, &n, &err) != NL_OK)
        return 0;
    const long pid = strtol(buf, NULL, 10);
    free(buf);
    return pid > 1 && (kill((pid_t)pid, 0) == 0 || errno == EPERM);
}

nl_status nl_remote_open(nl_remote *r, const nl_flag *flags, int default_timeout_s, nl_error *err)
{
    memset(r, 0, sizeof *r);
    char ep[512], keyp[4096], coordp[4096], coord_key[NL_KEY_Z85_LEN + 1];
    const char *dir = nl_args_get(flags, "cluster");
    const char *e = nl_args_get(flags, "coordinator"), *k = nl_args_get(flags, "key"),
               *ck = nl_args_get(flags, "coordinator-key");
    const int plain = nl_args_get(flags, "plaintext") != NULL;
    long long t = default_timeout_s;
    if (nl_args_int(flags, "timeout", 1, 86400, &t))
        return nl_error_set(err, NL_ERR_INVALID, "--timeout: bad value");
    r->timeout_ms = (int)(t * 1000);
    nl_status st = NL_OK;
    if (dir) {
        char p[4096];
        if (!cluster_running(dir))
            return nl_error_set(err, NL_ERR_STATE,
                                "the cluster in %s is not running (neuroctl cluster up --dir %s)",
                                dir, dir);
        snprintf(p, sizeof p, "%s/coord/client_endpoint", dir);
        if ((st = read_line(p, ep, sizeof ep, err)) != NL_OK)
            return nl_error_prefix(err, "--cluster %s (is it up?)", dir);
        snprintf(keyp, sizeof keyp, "%s/client.key", dir);
        snprintf(coordp, sizeof coordp, "%s/coord/coordinator.pub", dir);
        e = ep;
        k = keyp;
        ck = coordp;
    }
    if (!e || (!plain && (!k || !ck)))
        return nl_error_set(err, NL_ERR_INVALID,
                            "give --coordinator, --key and --coordinator-key (or --cluster DIR)");
    if (!strstr(e, "://"))
        return nl_error_set(err, NL_ERR_INVALID,
                            "--coordinator %s: give a ZeroMQ endpoint, e.g. tcp://%s", e, e);
    if (!plain && ((st = nl_keys_load_secret(&r->kp, k, err)) != NL_OK ||
                   (st = nl_keys_load_public(coord_key, ck, err)) != NL_OK))
        return st;
    if (plain)
        fprintf(stderr, "warning: --plaintext: nothing is encrypted or authenticated\n");
    nl_net_opts no = nl_net_opts_default();
    const nl_client_opts co = {.endpoint = e,
                               .keys = &r->kp,
                               .server_key = coord_key,
                               .plaintext = plain,
                               .name = "client",
                               .timeout_ms = r->timeout_ms,
                               .watch_handshake = true};
    if ((st = nl_net_new(&r->net, &no, err)) != NL_OK)
        return nl_error_prefix(err, "coordinator %s", e);
    return nl_client_connect(&r->s, r->net, &co, err);
}

nl_status nl_remote_recv(nl_remote *r, nl_rx *rx, double deadline, nl_error *err)
{
    return nl_client_recv(r->s, rx, deadline, err);
}

nl_status nl_remote_status(nl_remote *r, json_t **out, nl_error *err)
{
    return nl_client_status(r->s, nl_mono_s() + r->timeout_ms / 1e3, out, err);
}

nl_status nl_remote_status_once(const nl_flag *flags, json_t **out, nl_error *err)
{
    nl_remote r = {0};
    *out = NULL;
    nl_status st = nl_remote_open(&r, flags, 60, err);
    if (st == NL_OK)
        st = nl_remote_status(&r, out, err);
    nl_remote_close(&r);
    return st;
}

nl_status nl_remote_submit(nl_remote *r, nl_job_kind kind, const nl_wire_param *ps, int np,
                           const int32_t *ids, int B, int T, nl_error *err)
{
    return nl_client_submit(r->s, kind, ps, np, ids, B, T, err);
}

nl_status nl_remote_cancel(nl_remote *r, uint64_t job_id, nl_error *err)
{
    return nl_client_send_ref(r->s, NL_MSG_JOB_CANCEL, job_id, err);
}

int nl_remote_refuse_node_flag(const char *arg)
{
    static const char *const node_flags[] = {"--device", "--tf32", "--threads"};
    for (size_t k = 0; k < sizeof node_flags / sizeof node_flags[0]; k++)
        if (strcmp(arg, node_flags[k]) == 0) {
            fprintf(stderr,
                    "%s: each node has its own %s (neuronode join %s, neuroctl cluster up %s)\n",
                    arg, arg, arg, arg);
            return 2;
        }
    return 0;
}
