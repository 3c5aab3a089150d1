/* Private to node/: the worker threads of a stage's data-parallel
 * replicas (node/stage_train.c). One lane per replica, each with its own
 * thread, runs that replica's jobs in the order they were pushed; jobs of
 * different lanes run at the same time. The owner (the node's thread)
 * takes finished jobs back in the global order they were pushed, so what
 * it does with their results (sends, sums) never depends on timing.
 *
 * A pool of 0 threads (inline) runs each job on the caller's thread inside
 * nl_workers_push: the replicas one after another, as before threads.
 *
 * Wake-ups: nl_workers_fd is the read end of a non-blocking pipe that gets
 * a byte whenever a job finishes, for the owner's poll loop.
 *
 * Ownership: the jobs belong to the caller; a job pushed stays untouched
 * by the caller until nl_workers_pop_done returns it, or the pool is
 * destroyed (queued jobs that had not started are dropped, never run; the
 * caller frees them). */
#ifndef NL_NODE_REPLICA_WORKERS_H
#define NL_NODE_REPLICA_WORKERS_H

#include <stdbool.h>

#include "base/status.h"

typedef struct nl_wjob {
    int lane;                  /* set by the caller before the push */
    struct nl_wjob *next_all;  /* private: the global FIFO */
    struct nl_wjob *next_lane; /* private: the lane's FIFO */
    bool done;                 /* private: under the pool's lock */
} nl_wjob;

/* Runs job j on its lane's thread (or the caller's, inline). */
typedef void (*nl_wjob_fn)(void *ctx, nl_wjob *j);

typedef struct nl_workers nl_workers;

/* lanes >= 1; threads: one per lane, or none (inline) when false. */
nl_status nl_workers_new(nl_workers **out, int lanes, bool threads, nl_wjob_fn run, void *ctx,
                         nl_error *err);
/* Stops the lanes: the jobs running finish, the queued ones are dropped;
 * joins the threads. Safe on NULL and twice. */
void nl_workers_destroy(nl_workers **w);

void nl_workers_push(nl_workers *w, nl_wjob *j);
/* The oldest job pushed and not yet popped, if it has finished (wait:
 * after waiting until it has); NULL when there is none, or (no wait) when
 * it is still queued or running. */
nl_wjob *nl_workers_pop_done(nl_workers *w, bool wait);
/* Wait until every job pushed has finished (they stay to be popped). */
void nl_workers_wait_all(nl_workers *w);
/* Jobs pushed and not yet popped. */
int nl_workers_pending(nl_workers *w);
/* Readable when a job has finished since the last nl_workers_clear_fd;
 * -1 inline. */
int nl_workers_fd(const nl_workers *w);
void nl_workers_clear_fd(nl_workers *w);
bool nl_workers_threaded(const nl_workers *w);

#endif
