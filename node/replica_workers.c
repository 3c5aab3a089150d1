/* The worker threads of a stage's replicas (replica_workers.h): one lane
 * per replica, a FIFO per lane that its thread runs in order, one global
 * FIFO the owner pops in push order, and a pipe that wakes the owner. One
 * lock guards the lists and the done flags; a job's own fields are the
 * runner's between the pop from its lane and done, the owner's otherwise
 * (the lock orders the two). */
#include "node/replica_workers.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/comm.h" /* NL_COMM_MAX */

typedef struct lane {
    nl_wjob *head, *tail;
    pthread_cond_t wake; /* a job came, or stop */
    pthread_t thread;
    bool started;
    struct nl_workers *w;
} lane;

struct nl_workers {
    pthread_mutex_t lock;
    pthread_cond_t finished; /* a job is done */
    lane lanes[NL_COMM_MAX];
    int n;
    bool threads, stop;
    nl_wjob *head, *tail; /* every job pushed and not popped */
    int pending;
    int pipe_rd, pipe_wr;
    nl_wjob_fn run;
    void *ctx;
};

static void notify(nl_workers *w)
{
    const char b = 1;
    /* full pipe: the owner has a wake-up pending already */
    ssize_t r = write(w->pipe_wr, &b, 1);
    (void)r;
}

static void *lane_main(void *arg)
{
    lane *l = arg;
    nl_workers *w = l->w;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!l->head && !w->stop)
            pthread_cond_wait(&l->wake, &w->lock);
        if (w->stop)
            break;
        nl_wjob *j = l->head;
        l->head = j->next_lane;
        if (!l->head)
            l->tail = NULL;
        pthread_mutex_unlock(&w->lock);
        w->run(w->ctx, j);
        pthread_mutex_lock(&w->lock);
        j->done = true;
        pthread_cond_broadcast(&w->finished);
        notify(w);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

nl_status nl_workers_new(nl_workers **out, int lanes, bool threads, nl_wjob_fn run, void *ctx,
                         nl_error *err)
{
    *out = NULL;
    if (lanes < 1 || lanes > NL_COMM_MAX)
        return nl_error_set(err, NL_ERR_INVALID, "replica workers: %d lanes (1 to %d)", lanes,
                            NL_COMM_MAX);
    nl_workers *w = calloc(1, sizeof *w);
    if (!w)
        return nl_error_set(err, NL_ERR_NOMEM, "replica workers: out of memory");
    w->n = lanes;
    w->threads = threads;
    w->run = run;
    w->ctx = ctx;
    w->pipe_rd = w->pipe_wr = -1;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->finished, NULL);
    for (int i = 0; i < lanes; i++) {
        pthread_cond_init(&w->lanes[i].wake, NULL);
        w->lanes[i].w = w;
    }
    nl_status st = NL_OK;
    if (threads) {
        int fd[2];
        if (pipe(fd) != 0) {
            st = nl_error_set(err, NL_ERR_IO, "replica workers: pipe: %s", strerror(errno));
        } else {
            w->pipe_rd = fd[0];
            w->pipe_wr = fd[1];
            for (int i = 0; i < 2; i++) {
                fcntl(fd[i], F_SETFL, fcntl(fd[i], F_GETFL) | O_NONBLOCK);
                fcntl(fd[i], F_SETFD, FD_CLOEXEC);
            }
        }
        for (int i = 0; st == NL_OK && i < lanes; i++) {
            const int e = pthread_create(&w->lanes[i].thread, NULL, lane_main, &w->lanes[i]);
            if (e != 0)
                st = nl_error_set(err, NL_ERR_NOMEM, "replica workers: thread %d of %d: %s", i,
                                  lanes, strerror(e));
            else
                w->lanes[i].started = true;
        }
    }
    if (st != NL_OK) {
        nl_workers_destroy(&w);
        return st;
    }
    *out = w;
    return NL_OK;
}

void nl_workers_destroy(nl_workers **wp)
{
    nl_workers *w = wp ? *wp : NULL;
    if (!w)
        return;
    pthread_mutex_lock(&w->lock);
    w->stop = true;
    for (int i = 0; i < w->n; i++)
        pthread_cond_signal(&w->lanes[i].wake);
    pthread_mutex_unlock(&w->lock);
    for (int i = 0; i < w->n; i++) {
        if (w->lanes[i].started)
            pthread_join(w->lanes[i].thread, NULL);
        pthread_cond_destroy(&w->lanes[i].wake);
    }
    pthread_cond_destroy(&w->finished);
    pthread_mutex_destroy(&w->lock);
    if (w->pipe_rd >= 0)
        close(w->pipe_rd);
    if (w->pipe_wr >= 0)
        close(w->pipe_wr);
    free(w);
    *wp = NULL;
}

void nl_workers_push(nl_workers *w, nl_wjob *j)
{
    j->next_all = j->next_lane = NULL;
    j->done = false;
    pthread_mutex_lock(&w->lock);
    if (w->tail)
        w->tail->next_all = j;
    else
        w->head = j;
    w->tail = j;
    w->pending++;
    if (w->threads) {
        lane *l = &w->lanes[j->lane];
        if (l->tail)
            l->tail->next_lane = j;
        else
            l->head = j;
        l->tail = j;
        pthread_cond_signal(&l->wake);
    }
    pthread_mutex_unlock(&w->lock);
    if (!w->threads) { /* inline: one after another, on this thread */
        w->run(w->ctx, j);
        j->done = true;
    }
}

static nl_wjob *pop_head(nl_workers *w)
{
    nl_wjob *j = w->head;
    w->head = j->next_all;
    if (!w->head)
        w->tail = NULL;
    w->pending--;
    return j;
}

nl_wjob *nl_workers_pop_done(nl_workers *w, bool wait)
{
    nl_wjob *j = NULL;
    pthread_mutex_lock(&w->lock);
    while (wait && w->head && !w->head->done)
        pthread_cond_wait(&w->finished, &w->lock);
    if (w->head && w->head->done)
        j = pop_head(w);
    pthread_mutex_unlock(&w->lock);
    return j;
}

void nl_workers_wait_all(nl_workers *w)
{
    pthread_mutex_lock(&w->lock);
    for (;;) {
        bool all = true;
        for (nl_wjob *j = w->head; j && all; j = j->next_all)
            all = j->done;
        if (all)
            break;
        pthread_cond_wait(&w->finished, &w->lock);
    }
    pthread_mutex_unlock(&w->lock);
}

int nl_workers_pending(nl_workers *w)
{
    pthread_mutex_lock(&w->lock);
    const int n = w->pending;
    pthread_mutex_unlock(&w->lock);
    return n;
}

int nl_workers_fd(const nl_workers *w)
{
    return w->pipe_rd;
}

void nl_workers_clear_fd(nl_workers *w)
{
    char buf[256];
    if (w->pipe_rd >= 0)
        while (read(w->pipe_rd, buf, sizeof buf) > 0)
            ;
}

bool nl_workers_threaded(const nl_workers *w)
{
    return w->threads;
}
