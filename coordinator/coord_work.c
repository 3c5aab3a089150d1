/* Slow work off the event loop (tokenizing a corpus, hashing a
 * checkpoint's shards, writing a manifest): each task runs in a thread of
 * its own and, when done, says so over an inproc pipe that the loop polls
 * beside its control socket (CZMQ's actor pattern), so heartbeats and
 * other clients are served meanwhile. The loop then joins the thread and
 * calls the task's `done`. A task's `run` touches nothing but the task. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "coordinator/coord_impl.h"

nl_status coord_work_init(nl_coord *c, nl_error *err)
{
    snprintf(c->work_endpoint, sizeof c->work_endpoint, "inproc://nl-coord-work-%p", (void *)c);
    c->work_pipe = zmq_socket(nl_net_zmq_context(c->net), ZMQ_PULL);
    if (!c->work_pipe || zmq_bind(c->work_pipe, c->work_endpoint) != 0)
        return nl_error_set(err, NL_ERR_IO, "coordinator: the workers' pipe %s: %s",
                            c->work_endpoint, zmq_strerror(zmq_errno()));
    return NL_OK;
}

static void *work_main(void *arg)
{
    cwork *w = arg;
    w->run(w);
    atomic_store(&w->finished, 1);
    /* wake the loop; were the wake lost, its tick finds the task finished */
    void *push = zmq_socket(w->zmq, ZMQ_PUSH);
    if (push && zmq_connect(push, w->endpoint) == 0)
        zmq_send(push, "", 0, ZMQ_DONTWAIT);
    if (push)
        zmq_close(push);
    return NULL;
}

nl_status coord_work_start(nl_coord *c, cwork *w, nl_error *err)
{
    w->zmq = nl_net_zmq_context(c->net);
    w->endpoint = c->work_endpoint;
    atomic_store(&w->finished, 0);
    int rc = pthread_create(&w->thread, NULL, work_main, w);
    if (rc != 0) {
        w->free(w);
        return nl_error_set(err, NL_ERR_NOMEM, "coordinator: cannot start a worker (%s)",
                            strerror(rc));
    }
    w->next = c->works;
    c->works = w;
    cjob *j = coord_job_find(c, w->job_id);
    if (j)
        j->working++;
    return NL_OK;
}

void coord_work_reap(nl_coord *c)
{
    char buf[1];
    while (c->work_pipe && zmq_recv(c->work_pipe, buf, sizeof buf, ZMQ_DONTWAIT) >= 0)
        ; /* wake-ups; the tasks' flags say which are done */
    for (cwork **p = &c->works; *p;) {
        cwork *w = *p;
        if (!atomic_load(&w->finished)) {
            p = &w->next;
            continue;
        }
        *p = w->next;
        pthread_join(w->thread, NULL);
        cjob *j = coord_job_find(c, w->job_id);
        if (j && j->working > 0)
            j->working--;
        w->done(c, w);
        w->free(w);
    }
}

void coord_work_shutdown(nl_coord *c)
{
    for (cwork *w = c->works, *next; w; w = next) {
        next = w->next;
        pthread_join(w->thread, NULL);
        w->free(w);
    }
    c->works = NULL;
    if (c->work_pipe) {
        int zero = 0;
        zmq_setsockopt(c->work_pipe, ZMQ_LINGER, &zero, sizeof zero);
        zmq_close(c->work_pipe);
        c->work_pipe = NULL;
    }
}
