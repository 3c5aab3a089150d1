/* net/client: the client side of the clients' endpoint against a real
 * coordinator (in-process, CURVE): connect and HELLO, the status query,
 * a refused submission answered with the coordinator's ERROR, a job's end
 * told as failed or cancelled, the wait for a job's one result ending
 * with its refusal; and a refused connection or an unknown
 * key told at once when the handshake is watched. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/log.h"
#include "coordinator/coord.h"
#include "net/client.h"
#include "tests/check.h"

static volatile sig_atomic_t coord_stop;

static void *coord_loop(void *c)
{
    nl_error err = {0};
    nl_coord_run(c, &coord_stop, &err);
    return NULL;
}

static nl_status take_never(void *ctx, const nl_wire_msg *m, nl_error *err)
{
    (void)m;
    (void)err;
    ++*(int *)ctx;
    return NL_OK;
}

static void test_job_failed(void)
{
    nl_rx rx;
    nl_error err = {0};
    nl_rx_init(&rx);
    rx.msg.type = NL_MSG_JOB_STATUS;
    rx.msg.u.job_status.job_id = 7;
    rx.msg.u.job_status.state = NL_JOB_RUNNING;
    CHECK(!nl_client_job_failed(&rx, &err), "a running job has not failed");
    rx.msg.u.job_status.state = NL_JOB_FAILED;
    CHECK(nl_client_job_failed(&rx, &err) && strcmp(err.msg, "job 7 failed") == 0, "no message: %s",
          err.msg);
    rx.msg.u.job_status.message = "a stage died";
    CHECK(nl_client_job_failed(&rx, &err) && strcmp(err.msg, "job 7 failed: a stage died") == 0 &&
              err.status == NL_ERR_STATE,
          "failed: %s", err.msg);
    /* refused for want of room (the key's --max-jobs-per-key): a limit,
     * which neurocoord --http answers 429 */
    rx.msg.u.job_status.job_id = 0;
    rx.msg.u.job_status.message = "too many jobs of this key at once: 32 (neurocoord "
                                  "--max-jobs-per-key); try again when one ends";
    CHECK(nl_client_job_failed(&rx, &err) && err.status == NL_ERR_LIMIT &&
              strstr(err.msg, "--max-jobs-per-key"),
          "refused for the key's jobs: %s %s", nl_status_str(err.status), err.msg);
    rx.msg.u.job_status.message = "generate: bad params";
    CHECK(nl_client_job_failed(&rx, &err) && err.status == NL_ERR_STATE &&
              strcmp(err.msg, "the coordinator refused the job: generate: bad params") == 0,
          "refused for its params (no id, not 'job 0'): %s %s", nl_status_str(err.status), err.msg);
    rx.msg.u.job_status.job_id = 7;
    rx.msg.u.job_status.state = NL_JOB_CANCELLED;
    rx.msg.u.job_status.message = "cancelled";
    CHECK(nl_client_job_failed(&rx, &err) && strcmp(err.msg, "job 7 was cancelled") == 0,
          "cancelled: %s", err.msg);
}

/* Against the coordinator at ep (public key server). */
static void test_session(nl_net *net, const char *ep, const char *server, const nl_keypair *good,
                         const nl_keypair *stranger)
{
    nl_error err = {0};
    nl_sock *s = NULL;
    nl_client_opts o = {.endpoint = ep,
                        .keys = good,
                        .server_key = server,
                        .name = "client",
                        .timeout_ms = 60000,
                        .watch_handshake = true};
    CHECK_OK(nl_client_connect(&s, net, &o, &err), &err);
    if (!s)
        return;
    json_t *status = NULL;
    CHECK_OK(nl_client_status(s, nl_mono_s() + 60, &status, &err), &err);
    CHECK(json_is_object(status) && json_object_get(status, "nodes"), "the status has nodes");
    json_decref(status);

    /* no nodes: a generation is refused, and the ERROR comes back typed */
    const int32_t ids[3] = {1, 2, 3};
    const nl_wire_param ps[1] = {{.key = "max_new", .kind = NL_WIRE_PARAM_INT, .i = 2}};
    CHECK_OK(nl_client_submit(s, NL_JOB_GENERATE, ps, 1, ids, 1, 3, &err), &err);
    nl_rx rx;
    nl_rx_init(&rx);
    nl_status st = NL_OK;
    int ended = 0;
    const double by = nl_mono_s() + 60;
    while (!ended && (st = nl_client_recv(s, &rx, by, &err)) == NL_OK)
        ended = nl_client_job_failed(&rx, &err);
    CHECK(ended || (st != NL_OK && st != NL_ERR_TIMEOUT),
          "a job without nodes fails or is refused: %s (%s)", err.msg, nl_status_str(st));
    nl_rx_free(&rx);

    /* a forward without nodes: the wait for its result ends with the
     * refusal or the failure, before the deadline, and nothing is taken */
    int taken = 0;
    CHECK_OK(nl_client_submit(s, NL_JOB_FORWARD, NULL, 0, ids, 1, 3, &err), &err);
    const double t0 = nl_mono_s();
    st = nl_client_await_result(s, t0 + 60, take_never, &taken, &err);
    CHECK(st != NL_OK && st != NL_ERR_TIMEOUT && !taken, "forward without nodes: %s (%s)", err.msg,
          nl_status_str(st));
    nl_sock_destroy(&s);

    /* a key the coordinator does not know: told at once, as a key fault */
    o.keys = stranger;
    const double t1 = nl_mono_s();
    st = nl_client_connect(&s, net, &o, &err);
    CHECK(st == NL_ERR_AUTH && !s, "an unknown key: %s (%s)", err.msg, nl_status_str(st));
    CHECK(nl_mono_s() - t1 < 30, "told before the timeout");
}

static void test_refused(nl_net *net)
{
    nl_error err = {0};
    nl_sock *s = NULL;
    /* a port nothing listens on: bind one (a plain socket, closed at
     * once, not libzmq's, whose close is asynchronous), note it, close it */
    char ep[128] = "";
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &alen) == 0)
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", ntohs(a.sin_port));
    if (fd >= 0)
        close(fd);
    CHECK(ep[0], "a free port");
    nl_client_opts o = {.endpoint = ep,
                        .plaintext = true,
                        .name = "client",
                        .timeout_ms = 60000,
                        .watch_handshake = true};
    const double t0 = nl_mono_s();
    nl_status st = nl_client_connect(&s, net, &o, &err);
    CHECK(st == NL_ERR_IO && !s, "refused: %s (%s)", err.msg, nl_status_str(st));
    CHECK(nl_mono_s() - t0 < 30, "told before the timeout");
}

int main(void)
{
    nl_log_set_level(NL_LOG_ERROR);
    test_job_failed();
    char dir[] = "/tmp/nl_test_net_client_XXXXXX", path[256], server[NL_KEY_Z85_LEN + 1];
    nl_keypair good, stranger;
    nl_error err = {0};
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    CHECK_OK(nl_keys_generate(&good, &err), &err);
    CHECK_OK(nl_keys_generate(&stranger, &err), &err);
    snprintf(path, sizeof path, "%s/authorized_keys", dir);
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "%s client\n", good.public_z85);
        fclose(f);
    }
    nl_coord_opts o;
    nl_coord_opts_init(&o);
    o.listen = "tcp://127.0.0.1:*";
    o.state_dir = dir;
    nl_coord *c = NULL;
    nl_net *net = NULL;
    CHECK_OK(nl_coord_new(&c, &o, &err), &err);
    CHECK_OK(nl_net_new(&net, NULL, &err), &err);
    snprintf(path, sizeof path, "%s/coordinator.pub", dir);
    if (c && net && nl_keys_load_public(server, path, &err) == NL_OK) {
        pthread_t loop;
        coord_stop = 0;
        pthread_create(&loop, NULL, coord_loop, c);
        test_session(net, nl_coord_client_endpoint(c), server, &good, &stranger);
        coord_stop = 1;
        pthread_join(loop, NULL);
    }
    if (net)
        test_refused(net);
    nl_net_destroy(&net);
    nl_coord_destroy(&c);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return check_done("test_net_client");
}
