/* netdelay: delay and drop the packets of one netfilter queue, for the
 * chaos test where the kernel has no netem qdisc (tests/test_chaos.sh).
 *
 *   netdelay QUEUE DELAY_MS LOSS_PERCENT SEED
 *
 * An nftables rule sends packets to queue QUEUE (`queue num Q bypass`,
 * so they pass when nothing listens); this program holds each one for
 * DELAY_MS milliseconds and then accepts it, or drops it with
 * probability LOSS_PERCENT / 100 (a seeded generator: the same drops in
 * every run). Verdicts go out in arrival order, as a FIFO delay line
 * would let them out. Runs until SIGTERM or SIGINT, printing how many
 * packets it delayed and dropped. Test tool only: not installed. */
#include <arpa/inet.h> /* before the kernel's headers: glibc's in.h then wins */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <linux/netfilter.h> /* before libnetfilter_queue's header, which uses it */

#include <libnetfilter_queue/libnetfilter_queue.h>

#define HELD_MAX 65536 /* packets held at once; more are accepted at once */

typedef struct {
    uint32_t id;
    double due; /* monotonic seconds */
    int drop;
} held;

typedef struct {
    struct nfq_q_handle *qh;
    held *ring;
    size_t head, count;
    double delay;
    uint32_t loss_ppm;
    uint64_t rng;
    unsigned long seen, dropped, overflow, lost; /* lost: the kernel's (ENOBUFS) */
} line;

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
    (void)sig;
    stop = 1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint32_t next_u32(uint64_t *s) /* splitmix64, upper half */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (uint32_t)((z ^ (z >> 31)) >> 32);
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *arg)
{
    (void)msg;
    line *l = arg;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (!ph)
        return 0;
    const uint32_t id = ntohl(ph->packet_id);
    l->seen++;
    if (l->count == HELD_MAX) { /* full: let it through now rather than stall */
        l->overflow++;
        return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
    }
    held *h = &l->ring[(l->head + l->count++) % HELD_MAX];
    h->id = id;
    h->due = now_s() + l->delay;
    h->drop = next_u32(&l->rng) % 1000000u < l->loss_ppm;
    return 0;
}

/* Release every held packet that is due; the wait until the next, in ms
 * (-1: none held). */
static int release_due(line *l)
{
    const double t = now_s();
    while (l->count) {
        held *h = &l->ring[l->head];
        if (h->due > t)
            return (int)((h->due - t) * 1e3) + 1;
        l->dropped += (unsigned long)h->drop;
        nfq_set_verdict(l->qh, h->id, h->drop ? NF_DROP : NF_ACCEPT, 0, NULL);
        l->head = (l->head + 1) % HELD_MAX;
        l->count--;
    }
    return -1;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: netdelay QUEUE DELAY_MS LOSS_PERCENT SEED\n");
        return 2;
    }
    char *end;
    const long q = strtol(argv[1], &end, 10);
    const double delay_ms = strtod(argv[2], &end), loss = strtod(argv[3], &end);
    if (q < 0 || q > 65535 || !(delay_ms >= 0 && delay_ms <= 10000) ||
        !(loss >= 0 && loss <= 100)) {
        fprintf(stderr, "netdelay: QUEUE in [0, 65535], DELAY_MS in [0, 10000], LOSS_PERCENT in "
                        "[0, 100]\n");
        return 2;
    }
    line l = {.delay = delay_ms / 1e3,
              .loss_ppm = (uint32_t)(loss * 1e4),
              .rng = strtoull(argv[4], NULL, 10)};
    l.ring = calloc(HELD_MAX, sizeof *l.ring);
    struct nfq_handle *h = nfq_open();
    if (!l.ring || !h || nfq_bind_pf(h, AF_INET) < 0 ||
        !(l.qh = nfq_create_queue(h, (uint16_t)q, on_packet, &l)) ||
        nfq_set_mode(l.qh, NFQNL_COPY_META, 0) < 0) {
        fprintf(stderr, "netdelay: queue %ld: %s (needs root and nfnetlink_queue)\n", q,
                strerror(errno));
        return 1;
    }
    nfq_set_queue_maxlen(l.qh, HELD_MAX);
    /* a receive buffer for a burst of packets' messages: a full one makes
     * the kernel drop packets (ENOBUFS), which TCP times out and resends,
     * and the link then stalls for far longer than its delay */
    nfnl_rcvbufsiz(nfq_nfnlh(h), 8u << 20);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    const int fd = nfq_fd(h);
    char buf[4096] __attribute__((aligned));
    printf("netdelay: queue %ld, %.1f ms, %.2f%% loss\n", q, delay_ms, loss);
    fflush(stdout);
    while (!stop) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        const int wait = release_due(&l);
        if (poll(&p, 1, wait < 0 ? 200 : wait) <= 0)
            continue;
        for (;;) { /* every message queued, before the next release */
            const ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            if (n > 0)
                nfq_handle_packet(h, buf, (int)n);
            else if (n < 0 && errno == ENOBUFS) /* the kernel dropped some: TCP sends them again */
                l.lost++;
            else
                break;
        }
    }
    for (size_t i = 0; i < l.count; i++) /* let the held ones out now */
        l.ring[(l.head + i) % HELD_MAX].due = 0;
    release_due(&l);
    printf("netdelay: %lu packets, %lu dropped, %lu passed at once (full), %lu times the kernel "
           "dropped some (ENOBUFS)\n",
           l.seen, l.dropped, l.overflow, l.lost);
    nfq_destroy_queue(l.qh);
    nfq_close(h);
    free(l.ring);
    return 0;
}
