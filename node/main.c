/* neuronode: the node daemon's process. `neuronode join ENDPOINT ...`
 * turns this process into one pipeline stage of the cluster whose
 * coordinator listens at ENDPOINT (see node/node.h); the command line is
 * node/node_cli.c, the daemon nl_node_run. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "net/keys.h"
#include "net/transport.h"
#include "node/node.h"

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

static int install_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal; /* no SA_RESTART: a wait returns and the loop sees the flag */
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0)
        return -1;
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

int main(int argc, char **argv)
{
    nl_node_opts o = {.stop = &stop_flag};
    char coord_key[NL_KEY_Z85_LEN + 1] = "";
    nl_keypair kp;
    memset(&kp, 0, sizeof kp);
    int rc = nl_node_cli(argc, argv, &o, coord_key, &kp);
    if (rc >= 0)
        return rc;
    if (install_signals() != 0) {
        fprintf(stderr, "neuronode: cannot install signal handlers\n");
        return 1;
    }
    nl_error err;
    nl_status st = nl_node_run(&o, &err);
    nl_keys_wipe(&kp);
    nl_net_parts_check("neuronode");
    if (st != NL_OK && !stop_flag) {
        fprintf(stderr, "neuronode: %s\n", err.msg);
        return 1;
    }
    return 0;
}
