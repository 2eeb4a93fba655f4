/* kvoffload.policies._blocks: S3-FIFO's insert and eviction over three orders (small S,
 * main M, ghost G; a ghost keeps the status it had) and a dict key -> use counter; the
 * contracts are kvoffload.policies.s3fifo's (its Python versions do the same). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_blocks.h"

/* freq[key] as a C long; -1 with an error set (a resident key always has one). */
static long freq_of(PyObject *freq, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(freq, key);
    if (v == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    return PyLong_AsLong(v);
}

static int set_freq(PyObject *freq, PyObject *key, long value) {
    PyObject *v = PyLong_FromLong(value);
    int rc = v == NULL ? -1 : PyDict_SetItem(freq, key, v);
    Py_XDECREF(v);
    return rc;
}

PyObject *bump(PyObject *module, PyObject *args) {
    PyObject *freq, *keys;
    long most;
    if (!PyArg_ParseTuple(args, "O!Ol:bump", &PyDict_Type, &freq, &keys, &most)) return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    if (kf == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(kf); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i), *v = PyDict_GetItemWithError(freq, key);
        long count = v == NULL ? most : PyLong_AsLong(v);
        if (PyErr_Occurred() || (count < most && set_freq(freq, key, count + 1) < 0)) {
            Py_DECREF(kf);
            return NULL;
        }
    }
    Py_DECREF(kf);
    Py_RETURN_NONE;
}

PyObject *s3fifo_insert(PyObject *module, PyObject *args) {
    Order *small, *main, *ghost;
    PyObject *freq, *keys, *statuses;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OO:s3fifo_insert", &OrderType, &small, &OrderType, &main, &OrderType,
                          &ghost, &PyDict_Type, &freq, &keys, &statuses))
        return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    PyObject *sf = kf ? PySequence_Fast(statuses, "statuses must be a sequence") : NULL;
    int rc = sf == NULL ? -1 : 0;
    Py_ssize_t n = sf == NULL ? 0 : PySequence_Fast_GET_SIZE(kf);
    if (sf != NULL && PySequence_Fast_GET_SIZE(sf) != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd statuses", n, PySequence_Fast_GET_SIZE(sf));
        rc = -1;
    }
    for (Py_ssize_t i = n - 1; rc == 0 && i >= 0; i--) { /* in reverse: a prefix's head leaves S last */
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        int was_ghost = remove_key(ghost, key); /* dropped from S too early: to M */
        rc = was_ghost < 0 ? -1 : order_insert(was_ghost ? main : small, key, PySequence_Fast_GET_ITEM(sf, i));
        if (rc == 0) rc = set_freq(freq, key, 0);
    }
    Py_XDECREF(kf);
    Py_XDECREF(sf);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

typedef struct {
    Order *small, *main;
    PyObject *freq, *protected;
    long promote_after;
    int failed;
} Queues;

/* The first idle key of ``o`` not protected: a borrowed status, or NULL (q->failed on error). */
static Status *first_evictable(Queues *q, Order *o) {
    for (Status *s = o->head; s != NULL; s = s->next) {
        long r = get_ref((PyObject *)s);
        int hit = r == 0 ? contains(q->protected, s->key) : 0;
        if (r == -2 || hit < 0) {
            q->failed = 1;
            return NULL;
        }
        if (r == 0 && !hit) return s;
    }
    return NULL;
}

/* The oldest evictable key of S that earned no promotion; promotes those that did. */
static Status *evict_small(Queues *q) {
    for (;;) {
        Status *s = first_evictable(q, q->small);
        if (s == NULL) return NULL;
        long count = freq_of(q->freq, s->key);
        if (count < 0) break;
        if (count < q->promote_after) return s;
        PyObject *key = s->key, *status = (PyObject *)s;
        Py_INCREF(key);
        Py_INCREF(status);
        int rc = remove_key(q->small, key) < 0 || order_insert(q->main, key, status) < 0 ? -1 : set_freq(q->freq, key, 0);
        Py_DECREF(key);
        Py_DECREF(status);
        if (rc < 0) break;
    }
    q->failed = 1;
    return NULL;
}

/* The oldest evictable key of M with no use left; re-queues those with some. */
static Status *evict_main(Queues *q) {
    Py_ssize_t rounds = 3 * PyDict_GET_SIZE(q->main->table) + 1; /* counters are at most 3 */
    for (Py_ssize_t i = 0; i < rounds; i++) {
        Status *s = first_evictable(q, q->main);
        if (s == NULL) return NULL;
        long count = freq_of(q->freq, s->key);
        if (count == 0) return s;
        if (count < 0 || set_freq(q->freq, s->key, count - 1) < 0) {
            q->failed = 1;
            return NULL;
        }
        to_tail(q->main, s);
    }
    return NULL;
}

/* ``s`` out of ``o`` onto ``victims`` as (key, status, from S). */
static int take(PyObject *victims, Order *o, Status *s, int from_small) {
    PyObject *item = Py_BuildValue("(OOi)", s->key, (PyObject *)s, from_small);
    int rc = item == NULL || PyList_Append(victims, item) < 0 ? -1 : remove_key(o, PyTuple_GET_ITEM(item, 0));
    Py_XDECREF(item);
    return rc < 0 ? -1 : 0;
}

/* Chosen victims back at the old ends of their queues, in their old order. */
static void restore(Queues *q, PyObject *victims) {
    for (Py_ssize_t i = PyList_GET_SIZE(victims) - 1; i >= 0; i--) {
        PyObject *item = PyList_GET_ITEM(victims, i);
        Order *o = PyLong_AsLong(PyTuple_GET_ITEM(item, 2)) ? q->small : q->main;
        Status *s = (Status *)PyTuple_GET_ITEM(item, 1);
        if (order_insert(o, PyTuple_GET_ITEM(item, 0), (PyObject *)s) < 0) return;
        if (o->head != s) { /* from the recent end to the old end */
            detach(o, s);
            s->prev = NULL;
            s->next = o->head;
            o->head->prev = s;
            o->head = s;
        }
    }
}

PyObject *s3fifo_evict(PyObject *module, PyObject *args) {
    Queues q = {.failed = 0};
    Order *ghost;
    Py_ssize_t n, small_target, capacity;
    if (!PyArg_ParseTuple(args, "O!O!O!O!nOnln:s3fifo_evict", &OrderType, &q.small, &OrderType, &q.main, &OrderType,
                          &ghost, &PyDict_Type, &q.freq, &n, &q.protected, &small_target, &q.promote_after, &capacity))
        return NULL;
    PyObject *victims = PyList_New(0);
    while (victims != NULL && PyList_GET_SIZE(victims) < n) {
        Status *s = NULL;
        if (PyDict_GET_SIZE(q.small->table) > small_target || first_evictable(&q, q.main) == NULL) {
            s = q.failed ? NULL : evict_small(&q);
            if (s != NULL) {
                if (take(victims, q.small, s, 1) < 0) Py_CLEAR(victims);
                continue;
            }
        }
        int from_small = 0;
        if (!q.failed && (s = evict_main(&q)) == NULL && !q.failed) {
            s = evict_small(&q);
            from_small = 1;
        }
        if (q.failed || s == NULL) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            restore(&q, victims);
            PyErr_Restore(type, value, tb);
            Py_CLEAR(victims);
            if (q.failed) return NULL;
            Py_RETURN_NONE;
        }
        if (take(victims, from_small ? q.small : q.main, s, from_small) < 0) Py_CLEAR(victims);
    }
    PyObject *out = victims == NULL ? NULL : PyList_New(PyList_GET_SIZE(victims));
    for (Py_ssize_t i = 0; out != NULL && i < PyList_GET_SIZE(victims); i++) {
        PyObject *item = PyList_GET_ITEM(victims, i), *key = PyTuple_GET_ITEM(item, 0);
        Py_INCREF(key);
        PyList_SET_ITEM(out, i, key);
        if (PyDict_DelItem(q.freq, key) < 0 ||
            (PyLong_AsLong(PyTuple_GET_ITEM(item, 2)) && order_insert(ghost, key, PyTuple_GET_ITEM(item, 1)) < 0))
            Py_CLEAR(out);
    }
    while (out != NULL && PyDict_GET_SIZE(ghost->table) > capacity)
        if (remove_key(ghost, ghost->head->key) < 0) Py_CLEAR(out);
    Py_XDECREF(victims);
    return out;
}
