/* A scripted stand-in for the coordinator's side of a training job, for
 * tests of `neuroctl train --coordinator` (tests/test_remote_train.sh)
 * that need no cluster. It binds a plaintext ROUTER at ENDPOINT, answers
 * HELLO, and on JOB_SUBMIT writes what it was sent to REPORT ("kind K",
 * "frames N", then "key=value" per parameter), then plays SCRIPT to the
 * client, one line at a time:
 *   job N                  the job id of the lines that follow (default 7)
 *   status STATE MESSAGE   a JOB_STATUS without a frame
 *   event STATE JSON       a JOB_STATUS whose U8 frame is JSON (message "")
 *   wait_cancel            wait (10 s at most) for a JOB_CANCEL
 *   sleep MS
 * STATE is queued, running, done, failed or cancelled. A JOB_CANCEL is
 * written to REPORT as "cancel N". It exits 0 when the script is played,
 * 1 on any fault or after 20 s without a submit.
 *
 * usage: fake_coord ENDPOINT SCRIPT REPORT */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "net/transport.h"

typedef struct fake {
    nl_sock *s;
    nl_rx rx;
    uint8_t rid[NL_ROUTING_ID_MAX];
    size_t rid_len;
    FILE *report;
    uint64_t cancelled; /* the last job id cancelled, 0 for none */
} fake;

static int state_code(const char *s)
{
    static const char *names[] = {"queued", "running", "done", "failed", "cancelled"};
    for (int i = 0; i < 5; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    return -1;
}

static void write_submit(fake *f)
{
    const nl_msg_job_submit *s = &f->rx.msg.u.job_submit;
    fprintf(f->report, "kind %u\nframes %d\n", s->kind, f->rx.msg.nframes);
    for (uint32_t i = 0; i < s->nparams; i++) {
        const nl_wire_param *p = &s->params[i];
        if (p->kind == NL_WIRE_PARAM_INT)
            fprintf(f->report, "%s=%" PRId64 "\n", p->key, p->i);
        else if (p->kind == NL_WIRE_PARAM_FLOAT)
            fprintf(f->report, "%s=%.9g\n", p->key, p->f);
        else if (p->kind == NL_WIRE_PARAM_STR)
            fprintf(f->report, "%s=%s\n", p->key, p->s);
        else
            fprintf(f->report, "%s=%s\n", p->key, p->b ? "true" : "false");
    }
    fflush(f->report);
}

/* Receive one message and handle HELLO and JOB_CANCEL; returns its type
 * (NL_MSG_NONE on a timeout), -1 on a fault. */
static int serve_one(fake *f, int timeout_ms)
{
    nl_error err = {0};
    nl_rx_free(&f->rx);
    nl_rx_init(&f->rx);
    nl_status st = nl_sock_recv(f->s, &f->rx, timeout_ms, &err);
    if (st == NL_ERR_TIMEOUT)
        return NL_MSG_NONE;
    if (st != NL_OK) {
        fprintf(stderr, "fake_coord: %s\n", err.msg);
        return -1;
    }
    if (f->rx.msg.type == NL_MSG_HELLO &&
        nl_sock_answer_hello(f->s, &f->rx, NL_ROLE_COORDINATOR, &err) != NL_OK) {
        fprintf(stderr, "fake_coord: hello: %s\n", err.msg);
        return -1;
    }
    if (f->rx.msg.type == NL_MSG_JOB_CANCEL) {
        f->cancelled = f->rx.msg.u.job_ref.job_id;
        fprintf(f->report, "cancel %" PRIu64 "\n", f->cancelled);
        fflush(f->report);
    }
    return (int)f->rx.msg.type;
}

static int send_status(fake *f, uint64_t job, int state, const char *message, const char *json)
{
    nl_wire_msg m;
    nl_error err = {0};
    nl_wire_msg_init(&m);
    nl_wire_msg_reset(&m, NL_MSG_JOB_STATUS);
    m.u.job_status = (nl_msg_job_status){job, (uint32_t)state, 0.0, message, 0};
    if (json) {
        const int64_t len = (int64_t)strlen(json);
        nl_wire_frame_set(&m.frames[0], json, NL_DTYPE_U8, &len, 1);
        m.nframes = 1;
    }
    nl_status st = nl_sock_send(f->s, f->rid, f->rid_len, &m, &err);
    nl_wire_msg_free(&m);
    if (st != NL_OK)
        fprintf(stderr, "fake_coord: send: %s\n", err.msg);
    return st == NL_OK ? 0 : -1;
}

static int play(fake *f, FILE *script)
{
    char line[1 << 16];
    uint64_t job = 7;
    while (fgets(line, sizeof line, script)) {
        line[strcspn(line, "\n")] = '\0';
        char *arg = strchr(line, ' ');
        if (arg)
            *arg++ = '\0';
        if (strcmp(line, "job") == 0 && arg) {
            job = strtoull(arg, NULL, 10);
        } else if ((strcmp(line, "status") == 0 || strcmp(line, "event") == 0) && arg) {
            char *rest = strchr(arg, ' ');
            if (rest)
                *rest++ = '\0';
            const int state = state_code(arg);
            const int is_event = line[0] == 'e';
            if (state < 0 || send_status(f, job, state, is_event ? "" : (rest ? rest : ""),
                                         is_event ? (rest ? rest : "{}") : NULL) != 0)
                return -1;
        } else if (strcmp(line, "wait_cancel") == 0) {
            for (int i = 0; i < 100 && !f->cancelled; i++)
                if (serve_one(f, 100) < 0)
                    return -1;
            if (!f->cancelled)
                return -1;
        } else if (strcmp(line, "sleep") == 0 && arg) {
            struct timespec ts = {atoi(arg) / 1000, (long)(atoi(arg) % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        } else if (line[0]) {
            fprintf(stderr, "fake_coord: bad script line '%s'\n", line);
            return -1;
        }
    }
    /* answer what is left (a late JOB_CANCEL) briefly before leaving */
    while (serve_one(f, 300) > 0) {
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: fake_coord ENDPOINT SCRIPT REPORT\n");
        return 2;
    }
    nl_error err = {0};
    nl_net *net = NULL;
    fake f = {0};
    nl_rx_init(&f.rx);
    FILE *script = fopen(argv[2], "r");
    f.report = fopen(argv[3], "w");
    nl_net_opts no = nl_net_opts_default();
    nl_sock_opts so = {.type = ZMQ_ROUTER, .plaintext = true, .name = "fake-coord"};
    int rc = 1;
    if (!script || !f.report) {
        fprintf(stderr, "fake_coord: cannot open %s or %s\n", argv[2], argv[3]);
        goto out;
    }
    if (nl_net_new(&net, &no, &err) != NL_OK || nl_sock_new(&f.s, net, &so, &err) != NL_OK ||
        nl_sock_bind(f.s, argv[1], &err) != NL_OK) {
        fprintf(stderr, "fake_coord: %s\n", err.msg);
        goto out;
    }
    for (int waited = 0; waited < 20000;) {
        const int t = serve_one(&f, 100);
        if (t < 0)
            goto out;
        if (t == NL_MSG_NONE)
            waited += 100;
        if (t != NL_MSG_JOB_SUBMIT)
            continue;
        memcpy(f.rid, f.rx.rid, f.rx.rid_len);
        f.rid_len = f.rx.rid_len;
        write_submit(&f);
        rc = play(&f, script) == 0 ? 0 : 1;
        break;
    }
out:
    nl_rx_free(&f.rx);
    nl_sock_destroy(&f.s);
    nl_net_destroy(&net);
    if (script)
        fclose(script);
    if (f.report)
        fclose(f.report);
    return rc;
}
