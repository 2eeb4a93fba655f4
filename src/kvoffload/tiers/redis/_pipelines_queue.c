/* ``JobQueue``: the batches of one connection, queued by any thread and run back to back by
 * the one thread that serves the queue, in the order they came, without the GIL between
 * them: a batch answered in full is recorded as done (``collect()`` hands it to Python
 * later) and the next one queued goes out at once. A store's CRC32Cs are filled in while
 * the batch before it is answered. ``Completions``: a count of finished jobs a thread can
 * wait on without the GIL, bumped by the queues it is given to (and by Python).
 *
 *   JobQueue(completions)
 *     push_get(token, request, items) / push_set(token, buffers, count, checksums):
 *         queue a batch (as the module's get_into / set_nx take it); its buffers are held
 *         until it is collected or handed back.
 *     serve(fd, timeout) -> None | (token, result, error): runs queued batches on ``fd``,
 *         waiting for more while none is queued, until the queue is closed and empty (None)
 *         or a batch was not answered in full: it comes back with its ``(results, unread)``
 *         (a reply not as planned: the rest is the caller's to read) or its exception
 *         ``error``; the batches queued behind it were not sent.
 *     wait_job() -> bool: waits for a queued batch (False: closed and empty).
 *     collect() -> [(token, (results, unread))]: the batches answered in full, in order.
 *     drain() -> [token]: the queued batches, unsent, taken out.
 *     close(): serve() returns once the queue is empty. behind: batches queued while
 *     another was queued or on the wire.
 */
#include "_pipelines.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>

/* ---- Completions ---- */

#define MAX_TIMEOUT 1e9 /* seconds (about 31 years): a longer wait has no deadline */

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned long long count;
} Completions;

static void bump(Completions *c) {
    pthread_mutex_lock(&c->mu);
    c->count++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static PyObject *completions_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Completions *c = (Completions *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    return (PyObject *)c;
}

static void completions_dealloc(Completions *c) {
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *completions_bump(Completions *c, PyObject *unused) {
    bump(c);
    Py_RETURN_NONE;
}

/* wait(seen, timeout=None) -> bool: whether the count moved past ``seen`` within ``timeout``. */
static PyObject *completions_wait(Completions *c, PyObject *args) {
    unsigned long long seen;
    PyObject *timeout_arg = Py_None;
    if (!PyArg_ParseTuple(args, "K|O", &seen, &timeout_arg)) return NULL;
    double timeout = -1;
    if (timeout_arg != Py_None && !((timeout = PyFloat_AsDouble(timeout_arg)) >= 0)) { /* NaN too */
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "timeout must be >= 0, got %R", timeout_arg);
        return NULL;
    }
    /* A deadline past what a timespec holds (infinity too) is no deadline: converting it
     * would be undefined, and pthread_cond_timedwait refuses the result at once, holding the
     * mutex, so the loop below spun and a bump() could not get in. */
    if (timeout > MAX_TIMEOUT) timeout = -1;
    int moved;
    Py_BEGIN_ALLOW_THREADS
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    if (timeout >= 0) {
        double whole = (double)until.tv_sec + until.tv_nsec / 1e9 + timeout;
        until.tv_sec = (time_t)whole;
        until.tv_nsec = (long)((whole - (double)until.tv_sec) * 1e9);
    }
    pthread_mutex_lock(&c->mu);
    int rc = 0;
    while (c->count == seen && rc != ETIMEDOUT)
        rc = timeout < 0 ? pthread_cond_wait(&c->cv, &c->mu) : pthread_cond_timedwait(&c->cv, &c->mu, &until);
    moved = c->count != seen;
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(moved);
}

static PyObject *completions_count(Completions *c, void *closure) {
    pthread_mutex_lock(&c->mu);
    unsigned long long count = c->count;
    pthread_mutex_unlock(&c->mu);
    return PyLong_FromUnsignedLongLong(count);
}

static PyMethodDef completions_methods[] = {
    {"bump", (PyCFunction)completions_bump, METH_NOARGS, "Count one more finished job; wake the waiters."},
    {"wait", (PyCFunction)completions_wait, METH_VARARGS,
     "wait(seen, timeout=None): until the count is no longer seen (without the GIL); whether it moved."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef completions_getset[] = {
    {"count", (getter)completions_count, NULL, "Jobs finished so far.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject CompletionsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.tiers.redis._pipelines.Completions",
    .tp_basicsize = sizeof(Completions),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A count of finished jobs to wait on without the GIL (see the module's comment).",
    .tp_new = completions_new,
    .tp_dealloc = (destructor)completions_dealloc,
    .tp_methods = completions_methods,
    .tp_getset = completions_getset,
};

/* ---- JobQueue ---- */

enum { GET, SET };

typedef struct Job {
    struct Job *next;
    int kind;
    PyObject *token;
    GetBatch get;
    SetBatch set;
} Job;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    Job *head, *tail;           /* queued, unsent */
    Job *done_head, *done_tail; /* answered in full, not collected */
    Job *summing;               /* the queued store whose CRC32Cs the serving thread fills in */
    int running, closed;
    unsigned long long behind;
    Completions *completions;
} JobQueue;

static void job_free(Job *job) { /* with the GIL */
    get_release(&job->get);
    set_release(&job->set);
    Py_XDECREF(job->token);
    PyMem_Free(job);
}

static void free_list(Job *job) {
    while (job) {
        Job *next = job->next;
        job_free(job);
        job = next;
    }
}

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *completions;
    if (!PyArg_ParseTuple(args, "O!", &CompletionsType, &completions)) return NULL;
    JobQueue *q = (JobQueue *)type->tp_alloc(type, 0);
    if (!q) return NULL;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->completions = (Completions *)Py_NewRef(completions);
    return (PyObject *)q;
}

static void queue_dealloc(JobQueue *q) { /* no thread serves it: it would hold a reference */
    free_list(q->head);
    free_list(q->done_head);
    Py_XDECREF(q->completions);
    pthread_cond_destroy(&q->cv);
    pthread_mutex_destroy(&q->mu);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyObject *enqueue(JobQueue *q, Job *job) {
    pthread_mutex_lock(&q->mu);
    if (q->closed) {
        pthread_mutex_unlock(&q->mu);
        job_free(job);
        PyErr_SetString(PyExc_RuntimeError, "push() after close()");
        return NULL;
    }
    q->behind += q->running || q->head;
    if (q->tail) q->tail->next = job;
    else q->head = job;
    q->tail = job;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

static PyObject *queue_push_get(JobQueue *q, PyObject *args) {
    PyObject *token, *request, *items;
    if (!PyArg_ParseTuple(args, "OOO", &token, &request, &items)) return NULL;
    Job *job = PyMem_Calloc(1, sizeof(Job));
    if (!job) return PyErr_NoMemory();
    job->kind = GET;
    job->token = Py_NewRef(token);
    if (get_prepare(&job->get, request, items) < 0) {
        job_free(job);
        return NULL;
    }
    return enqueue(q, job);
}

static PyObject *queue_push_set(JobQueue *q, PyObject *args) {
    PyObject *token, *buffers, *checksums;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "OOnO", &token, &buffers, &count, &checksums)) return NULL;
    Job *job = PyMem_Calloc(1, sizeof(Job));
    if (!job) return PyErr_NoMemory();
    job->kind = SET;
    job->token = Py_NewRef(token);
    if (set_prepare(&job->set, buffers, count, checksums) < 0) {
        job_free(job);
        return NULL;
    }
    return enqueue(q, job);
}

/* Once a batch is sent: fill in the next queued store's CRC32Cs while the replies come. The
 * job stays queued meanwhile, marked: drain() (any thread) waits for it before taking the
 * queue out, so it never frees a job being read here. */
static void sum_next(void *arg) {
    JobQueue *q = arg;
    pthread_mutex_lock(&q->mu);
    Job *next = q->head && q->head->kind == SET ? q->head : NULL;
    q->summing = next;
    pthread_mutex_unlock(&q->mu);
    if (!next) return;
    set_checksums(&next->set);
    pthread_mutex_lock(&q->mu);
    q->summing = NULL;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

static PyObject *queue_serve(JobQueue *q, PyObject *args) {
    int fd;
    double timeout;
    if (!PyArg_ParseTuple(args, "id", &fd, &timeout)) return NULL;
    Job *job = NULL;
    Sent sent = {sum_next, q};
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->head && !q->closed) pthread_cond_wait(&q->cv, &q->mu);
        if (!q->head) break; /* closed and empty */
        job = q->head;
        q->head = job->next;
        if (!q->head) q->tail = NULL;
        job->next = NULL;
        q->running = 1;
        pthread_mutex_unlock(&q->mu);
        int answered;
        if (job->kind == GET) {
            get_run(&job->get, fd, timeout, sent);
            answered = get_answered(&job->get);
        } else {
            set_run(&job->set, fd, timeout, sent);
            answered = set_answered(&job->set);
        }
        pthread_mutex_lock(&q->mu);
        q->running = 0;
        if (!answered) break; /* for the caller: the connection is mid-batch or failed */
        if (q->done_tail) q->done_tail->next = job;
        else q->done_head = job;
        q->done_tail = job;
        job = NULL;
        bump(q->completions);
    }
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    if (!job) Py_RETURN_NONE;
    PyObject *result = job->kind == GET ? get_result(&job->get) : set_result(&job->set), *out;
    if (result) {
        out = Py_BuildValue("(ONO)", job->token, result, Py_None);
    } else {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        out = Py_BuildValue("(OOO)", job->token, Py_None, value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    job_free(job);
    return out;
}

static PyObject *queue_wait_job(JobQueue *q, PyObject *unused) {
    int queued;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->mu);
    while (!q->head && !q->closed) pthread_cond_wait(&q->cv, &q->mu);
    queued = q->head != NULL;
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(queued);
}

static PyObject *queue_collect(JobQueue *q, PyObject *unused) {
    pthread_mutex_lock(&q->mu);
    Job *job = q->done_head;
    q->done_head = q->done_tail = NULL;
    pthread_mutex_unlock(&q->mu);
    PyObject *out = PyList_New(0);
    while (job) {
        Job *next = job->next;
        if (out) {
            PyObject *result = job->kind == GET ? get_result(&job->get) : set_result(&job->set);
            PyObject *pair = result ? Py_BuildValue("(ON)", job->token, result) : NULL;
            if (!pair || PyList_Append(out, pair) < 0) Py_CLEAR(out); /* out of memory: the rest dropped */
            Py_XDECREF(pair);
        }
        job_free(job);
        job = next;
    }
    return out;
}

static PyObject *queue_drain(JobQueue *q, PyObject *unused) {
    Job *job;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->mu);
    while (q->summing) pthread_cond_wait(&q->cv, &q->mu);
    job = q->head;
    q->head = q->tail = NULL;
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(0);
    while (job) {
        Job *next = job->next;
        if (out && PyList_Append(out, job->token) < 0) Py_CLEAR(out);
        job_free(job);
        job = next;
    }
    return out;
}

static PyObject *queue_close(JobQueue *q, PyObject *unused) {
    pthread_mutex_lock(&q->mu);
    q->closed = 1;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

static PyObject *queue_behind(JobQueue *q, void *closure) {
    pthread_mutex_lock(&q->mu);
    unsigned long long behind = q->behind;
    pthread_mutex_unlock(&q->mu);
    return PyLong_FromUnsignedLongLong(behind);
}

static PyMethodDef queue_methods[] = {
    {"push_get", (PyCFunction)queue_push_get, METH_VARARGS, "push_get(token, request, items): queue a load batch."},
    {"push_set", (PyCFunction)queue_push_set, METH_VARARGS,
     "push_set(token, buffers, count, checksums): queue a store batch."},
    {"serve", (PyCFunction)queue_serve, METH_VARARGS,
     "serve(fd, timeout): run the queued batches back to back until closed (None) or one not answered in full."},
    {"wait_job", (PyCFunction)queue_wait_job, METH_NOARGS, "Wait for a queued batch; False when closed and empty."},
    {"collect", (PyCFunction)queue_collect, METH_NOARGS, "The batches answered in full: [(token, result)]."},
    {"drain", (PyCFunction)queue_drain, METH_NOARGS, "Take the queued batches out, unsent: their tokens."},
    {"close", (PyCFunction)queue_close, METH_NOARGS, "No more pushes; serve() returns once the queue is empty."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef queue_getset[] = {
    {"behind", (getter)queue_behind, NULL, "Batches queued while another was queued or on the wire.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject JobQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.tiers.redis._pipelines.JobQueue",
    .tp_basicsize = sizeof(JobQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The batches of one connection, run back to back (see the module's comment).",
    .tp_new = queue_new,
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_methods = queue_methods,
    .tp_getset = queue_getset,
};
