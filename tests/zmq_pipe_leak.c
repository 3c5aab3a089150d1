/* The libzmq leak that tests/lsan.supp suppresses, shown without any of
 * the project's code: a DEALER closed right after a send, while the ROUTER
 * it is connected to streams two-part messages at it. libzmq 4.3.4
 * (Debian 12's libzmq5) loses the first part of the message it was
 * receiving when the close came (src/pipe.cpp, pipe_t::process_pipe_term,
 * the branch "delimiter_received": no rollback of the unfinished message
 * before the term ack), and with it the connection's 18160-byte receive
 * buffer and its metadata.
 *
 * Built in the sanitizer build only (-DNL_SANITIZE=ON) and run by hand:
 *   ASAN_OPTIONS=detect_leaks=1 build-asan/tests/zmq_pipe_leak [rounds]
 * With the bug LeakSanitizer reports blocks of 18160 bytes (dozens in 300
 * rounds); with a libzmq that has it fixed, none, and the suppression in
 * tests/lsan.supp can go. Not a CTest: it tests libzmq, not this project. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <zmq.h>

static atomic_int stop;

/* A ROUTER that answers each peer's first message with two-part messages
 * [header, 256 KiB] until that peer is gone. */
static void *server(void *r)
{
    static char big[256 << 10], hdr[100];
    char id[256], buf[16];
    while (!atomic_load(&stop)) {
        int n = zmq_recv(r, id, sizeof id, ZMQ_DONTWAIT);
        if (n < 0 || n > (int)sizeof id) {
            nanosleep(&(struct timespec){0, 100000}, NULL);
            continue;
        }
        if (zmq_recv(r, buf, sizeof buf, 0) < 0)
            continue;
        for (int k = 0; k < 20; k++) {
            if (zmq_send(r, id, (size_t)n, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
                break; /* ROUTER_MANDATORY: the peer is gone */
            zmq_send(r, hdr, sizeof hdr, ZMQ_SNDMORE);
            zmq_send(r, big, sizeof big, 0);
        }
    }
    return NULL;
}

int main(int argc, char **argv)
{
    const int rounds = argc > 1 ? atoi(argv[1]) : 300;
    int zero = 0, one = 1;
    char ep[64], b[128];
    size_t len = sizeof ep;
    void *ctx = zmq_ctx_new();
    void *r = zmq_socket(ctx, ZMQ_ROUTER);
    pthread_t t;
    zmq_setsockopt(r, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(r, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    if (zmq_bind(r, "tcp://127.0.0.1:*") != 0 ||
        zmq_getsockopt(r, ZMQ_LAST_ENDPOINT, ep, &len) != 0) {
        fprintf(stderr, "zmq_pipe_leak: bind: %s\n", zmq_strerror(zmq_errno()));
        return 1;
    }
    pthread_create(&t, NULL, server, r);
    for (int i = 0; i < rounds; i++) {
        void *d = zmq_socket(ctx, ZMQ_DEALER);
        zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
        zmq_connect(d, ep);
        zmq_send(d, "go", 2, 0);
        zmq_recv(d, b, sizeof b, 0); /* a header came: the stream is on */
        zmq_send(d, "x", 1, 0);      /* a send just before the close */
        zmq_close(d);
    }
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    zmq_close(r);
    zmq_ctx_term(ctx);
    printf("zmq_pipe_leak: %d rounds (any leak is reported below)\n", rounds);
    fflush(stdout);
    return 0;
}
