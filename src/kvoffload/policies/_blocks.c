/* kvoffload.policies._blocks: the CPU tier's block states and its recency lists in C
 * (optional; ``kvoffload.policies.blocks`` does the same in Python without it).
 *
 *   BlockStatus(slot, ref=-1)
 *       A block's slot and state (-1 being written, 0 idle, n > 0 pinned), as the Python
 *       class; subclasses may be made (their ``ref`` is then read and written by name), and
 *       it carries the links of the one ``Order`` it may be in. An order given another
 *       kind of status (any object with ``ref``) links a proxy BlockStatus in its place
 *       (its ``table`` holds the proxy, whose ``ref`` is the object's, ``slot`` -1).
 *   Order()
 *       Keys in recency order, least recent first; ``table`` is its dict key -> status (a
 *       reader's view: change it through the methods only). ``insert_many(keys, statuses)``
 *       appends new keys (a key present keeps its place, its status replaced; a status may
 *       be in one order only); ``move_to_end_reversed(keys)`` moves the present ones,
 *       walking ``keys`` backwards, and returns the absent ones in ``keys``' order;
 *       ``evictable(limit, protected)`` up to ``limit`` keys, least recent first, that are
 *       idle and not in ``protected`` (changes nothing); ``pop_many(keys)``, ``remove(key)``
 *       (whether it was there), ``clear()``, ``keys()``, ``len()``; moves between orders
 *       (_blocks_moves.c): ``take_from(other, keys)``, ``trim(bound)``, and ARC's
 *       ``arc_touch(t2, b1, b2, keys, target, capacity)``, ``arc_insert(t2, b1, b2, keys,
 *       statuses)`` and ``arc_evict(t2, b1, b2, n, protected, target, capacity)``
 *       with this order as T1 (``kvoffload.policies.blocks`` has the contracts).
 *   lookup_prefix(table, keys) -> (hits, missed)   leading keys present and not in flight.
 *   pin(table, keys) -> (slots, newly_pinned) | None   None (nothing changed): not all HITs.
 *   unpin(table, keys) -> newly_idle | None           None (nothing changed): one not pinned.
 *   complete(table, keys) -> keys made idle (in flight before; each once, in order).
 *   reserve(table, keys, slots) -> statuses           new in-flight statuses, entered in table.
 *   absent(table, keys) -> keys                        not in table, each once, in order.
 *   release(table, keys, free)                         pop keys, their slots appended to free.
 *   s3fifo_insert, s3fifo_evict, bump: S3-FIFO's (_blocks_s3fifo.c; kvoffload.policies.s3fifo).
 *   turn_touch, turn_insert, turn_raise, turn_evict: the turn-aware LRU's (_blocks_turnlru.c;
 *   kvoffload.policies.turnlru has their Python versions).
 *   Sketch(bits, sample_size), wtinylfu_touch, wtinylfu_evict: W-TinyLFU's frequency sketch
 *   and paths (_blocks_wtinylfu.c; kvoffload.policies.sketch and .wtinylfu).
 *
 * Why C: a few Python operations per key on every step of a request (about half a replay's
 * time went to making, reading and writing status objects and OrderedDict moves).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "_blocks.h"




PyTypeObject OrderType;

/* -- Order: a doubly linked list through the statuses ------------------------------------- */

void link_tail(Order *o, Status *s, PyObject *key) {
    Py_INCREF(s);
    Py_INCREF(key);
    s->key = key;
    s->owner = (PyObject *)o;
    s->next = NULL;
    s->prev = o->tail;
    if (o->tail) o->tail->next = s; else o->head = s;
    o->tail = s;
}

void detach(Order *o, Status *s) { /* out of the list, links kept by the caller */
    if (s->prev) s->prev->next = s->next; else o->head = s->next;
    if (s->next) s->next->prev = s->prev; else o->tail = s->prev;
}

static void unlink_status(Order *o, Status *s) {
    detach(o, s);
    s->prev = s->next = NULL;
    s->owner = NULL;
    Py_CLEAR(s->key);
    Py_DECREF(s);
}

void to_tail(Order *o, Status *s) {
    if (o->tail == s) return;
    detach(o, s);
    s->next = NULL;
    s->prev = o->tail;
    o->tail->next = s;
    o->tail = s;
}

static PyObject *Order_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Order() takes no arguments");
        return NULL;
    }
    Order *o = (Order *)type->tp_alloc(type, 0);
    if (o == NULL) return NULL;
    o->table = PyDict_New();
    if (o->table == NULL) {
        Py_DECREF(o);
        return NULL;
    }
    return (PyObject *)o;
}

static void unlink_all(Order *o) {
    while (o->head) unlink_status(o, o->head);
}

static void Order_dealloc(Order *o) {
    unlink_all(o);
    Py_CLEAR(o->table);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static Py_ssize_t Order_len(Order *o) { return PyDict_GET_SIZE(o->table); }

int order_insert(Order *o, PyObject *key, PyObject *status) {
    if (!PyObject_TypeCheck(status, &StatusType)) { /* another status type: a proxy stands in */
        PyObject *proxy = proxy_for(status);
        int rc = proxy == NULL ? -1 : order_insert(o, key, proxy);
        Py_XDECREF(proxy);
        return rc;
    }
    Status *s = (Status *)status;
    if (s->owner != NULL) {
        PyErr_Format(PyExc_ValueError, "%R is in an order already", status);
        return -1;
    }
    Status *old = (Status *)PyDict_GetItemWithError(o->table, key);
    if (old == NULL && PyErr_Occurred()) return -1;
    Py_XINCREF(old);
    if (PyDict_SetItem(o->table, key, status) < 0) {
        Py_XDECREF(old);
        return -1;
    }
    link_tail(o, s, key);
    if (old != NULL) { /* the new status takes the old one's place */
        detach(o, s);
        s->prev = old->prev;
        s->next = old->next;
        if (s->prev) s->prev->next = s; else o->head = s;
        if (s->next) s->next->prev = s; else o->tail = s;
        old->prev = old->next = (Status *)NULL;
        old->owner = NULL;
        Py_CLEAR(old->key);
        Py_DECREF(old); /* the order's reference */
        Py_DECREF(old);
    }
    return 0;
}

static PyObject *Order_insert_many(Order *o, PyObject *args) {
    PyObject *keys, *statuses;
    if (!PyArg_ParseTuple(args, "OO:insert_many", &keys, &statuses)) return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    PyObject *sf = kf ? PySequence_Fast(statuses, "statuses must be a sequence") : NULL;
    int rc = sf == NULL ? -1 : 0;
    Py_ssize_t n = sf == NULL ? 0 : PySequence_Fast_GET_SIZE(kf);
    if (sf != NULL && PySequence_Fast_GET_SIZE(sf) != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd statuses", n, PySequence_Fast_GET_SIZE(sf));
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++)
        rc = order_insert(o, PySequence_Fast_GET_ITEM(kf, i), PySequence_Fast_GET_ITEM(sf, i));
    Py_XDECREF(kf);
    Py_XDECREF(sf);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Order_move_to_end_reversed(Order *o, PyObject *keys) {
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    if (kf == NULL) return NULL;
    PyObject *absent = PyList_New(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    for (Py_ssize_t i = n - 1; absent != NULL && i >= 0; i--) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        Status *s = (Status *)PyDict_GetItemWithError(o->table, key);
        if (s != NULL) to_tail(o, s);
        else if (PyErr_Occurred() || PyList_Append(absent, key) < 0) Py_CLEAR(absent);
    }
    Py_DECREF(kf);
    if (absent != NULL && PyList_Reverse(absent) < 0) Py_CLEAR(absent);
    return absent;
}

int contains(PyObject *collection, PyObject *key) {
    if (PyAnySet_Check(collection)) return PySet_Contains(collection, key);
    if (PyDict_Check(collection)) return PyDict_Contains(collection, key);
    return PySequence_Contains(collection, key);
}

static PyObject *Order_evictable(Order *o, PyObject *args) {
    Py_ssize_t limit;
    PyObject *protected;
    if (!PyArg_ParseTuple(args, "nO:evictable", &limit, &protected)) return NULL;
    return evictable(o, limit, protected);
}

PyObject *evictable(Order *o, Py_ssize_t limit, PyObject *protected) {
    PyObject *found = PyList_New(0);
    for (Status *s = o->head; found != NULL && s != NULL && PyList_GET_SIZE(found) < limit; s = s->next) {
        long r = get_ref((PyObject *)s);
        int hit = r == 0 ? contains(protected, s->key) : 0;
        if (r == -2 || hit < 0) Py_CLEAR(found);
        else if (r == 0 && !hit && PyList_Append(found, s->key) < 0) Py_CLEAR(found);
    }
    return found;
}

/* ``s`` (``key``'s, linked in ``src``) to the most recent end of ``dst``, keeping its links'
 * references; 0, or -1 with an error set (nothing moved). */
int move_status(Order *dst, Order *src, Status *s, PyObject *key) {
    if (dst == src) {
        to_tail(dst, s);
        return 0;
    }
    if (PyDict_SetItem(dst->table, key, (PyObject *)s) < 0) return -1;
    if (PyDict_DelItem(src->table, key) < 0) {
        (void)PyDict_DelItem(dst->table, key);
        return -1;
    }
    detach(src, s);
    s->owner = (PyObject *)dst;
    s->next = NULL;
    s->prev = dst->tail;
    if (dst->tail) dst->tail->next = s; else dst->head = s;
    dst->tail = s;
    return 0;
}

/* The next status from ``s`` on (inclusive) that is idle and not in ``protected``; NULL at the
 * end (check PyErr_Occurred). */
Status *next_idle(Status *s, PyObject *protected) {
    for (; s != NULL; s = s->next) {
        long r = get_ref((PyObject *)s);
        if (r == -2) return NULL;
        if (r != 0) continue;
        int hit = contains(protected, s->key);
        if (hit < 0) return NULL;
        if (!hit) return s;
    }
    return NULL;
}

void to_head(Order *o, Status *s) {
    if (o->head == s) return;
    detach(o, s);
    s->prev = NULL;
    s->next = o->head;
    o->head->prev = s;
    o->head = s;
}

int remove_key(Order *o, PyObject *key) {
    Status *s = (Status *)PyDict_GetItemWithError(o->table, key);
    if (s == NULL) return PyErr_Occurred() ? -1 : 0;
    if (s->owner == (PyObject *)o) unlink_status(o, s);
    return PyDict_DelItem(o->table, key) < 0 ? -1 : 1;
}

static PyObject *Order_pop_many(Order *o, PyObject *keys) {
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    if (kf == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(kf); i++)
        if (remove_key(o, PySequence_Fast_GET_ITEM(kf, i)) < 0) {
            Py_DECREF(kf);
            return NULL;
        }
    Py_DECREF(kf);
    Py_RETURN_NONE;
}

static PyObject *Order_remove(Order *o, PyObject *key) {
    int rc = remove_key(o, key);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyObject *Order_clear(Order *o, PyObject *unused) {
    unlink_all(o);
    PyDict_Clear(o->table);
    Py_RETURN_NONE;
}

static PyObject *Order_keys(Order *o, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (Status *s = o->head; out != NULL && s != NULL; s = s->next)
        if (PyList_Append(out, s->key) < 0) Py_CLEAR(out);
    return out;
}

static PyMethodDef Order_methods[] = {
    {"insert_many", (PyCFunction)Order_insert_many, METH_VARARGS, NULL},
    {"move_to_end_reversed", (PyCFunction)Order_move_to_end_reversed, METH_O, NULL},
    {"evictable", (PyCFunction)Order_evictable, METH_VARARGS, NULL},
    {"pop_many", (PyCFunction)Order_pop_many, METH_O, NULL},
    {"remove", (PyCFunction)Order_remove, METH_O, NULL},
    {"take_from", (PyCFunction)Order_take_from, METH_VARARGS, NULL},
    {"trim", (PyCFunction)Order_trim, METH_O, NULL},
    {"arc_touch", (PyCFunction)Order_arc_touch, METH_VARARGS, NULL},
    {"arc_insert", (PyCFunction)Order_arc_insert, METH_VARARGS, NULL},
    {"arc_evict", (PyCFunction)Order_arc_evict, METH_VARARGS, NULL},
    {"clear", (PyCFunction)Order_clear, METH_NOARGS, NULL},
    {"keys", (PyCFunction)Order_keys, METH_NOARGS, NULL},
    {NULL},
};

static PyMemberDef Order_members[] = {{"table", T_OBJECT, offsetof(Order, table), READONLY, NULL}, {NULL}};

static PySequenceMethods Order_as_sequence = {.sq_length = (lenfunc)Order_len};

/* -- the manager's batch paths over its table (dict key -> BlockStatus) ----------------------- */

static PyMethodDef module_methods[] = {
    {"lookup_prefix", lookup_prefix, METH_VARARGS, NULL},
    {"pin", pin, METH_VARARGS, NULL},
    {"unpin", unpin, METH_VARARGS, NULL},
    {"complete", complete, METH_VARARGS, NULL},
    {"reserve", reserve, METH_VARARGS, NULL},
    {"absent", absent, METH_VARARGS, NULL},
    {"release", release, METH_VARARGS, NULL},
    {"s3fifo_insert", s3fifo_insert, METH_VARARGS, NULL},
    {"s3fifo_evict", s3fifo_evict, METH_VARARGS, NULL},
    {"bump", bump, METH_VARARGS, NULL},
    {"turn_touch", turn_touch, METH_VARARGS, NULL},
    {"turn_insert", turn_insert, METH_VARARGS, NULL},
    {"turn_raise", turn_raise, METH_VARARGS, NULL},
    {"turn_evict", turn_evict, METH_VARARGS, NULL},
    {"wtinylfu_touch", wtinylfu_touch, METH_VARARGS, NULL},
    {"wtinylfu_evict", wtinylfu_evict, METH_VARARGS, NULL},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blocks", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__blocks(void) {
    OrderType = (PyTypeObject){
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.policies._blocks.Order",
        .tp_basicsize = sizeof(Order),
        .tp_flags = Py_TPFLAGS_DEFAULT,
        .tp_new = Order_new,
        .tp_dealloc = (destructor)Order_dealloc,
        .tp_methods = Order_methods,
        .tp_members = Order_members,
        .tp_as_sequence = &Order_as_sequence,
    };
    if (status_type_ready() < 0 || sketch_type_ready() < 0 || PyType_Ready(&OrderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "BlockStatus", (PyObject *)&StatusType) < 0 ||
        PyModule_AddObjectRef(m, "Order", (PyObject *)&OrderType) < 0 ||
        PyModule_AddObjectRef(m, "Sketch", (PyObject *)&SketchType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
