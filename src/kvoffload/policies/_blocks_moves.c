/* kvoffload.policies._blocks: Order methods that move keys between orders (ARC's lists and
 * its ghost lists); see _blocks.c and kvoffload.policies.blocks for the contracts. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>

#include "_blocks.h"

#define ORDER_CHECK(obj) PyObject_TypeCheck((obj), &OrderType)

/* ``key``'s status from ``src`` to the most recent end of ``dst``: 1 moved, 0 absent, -1 error. */
static int move_key(Order *dst, Order *src, PyObject *key) {
    Status *s = (Status *)PyDict_GetItemWithError(src->table, key);
    if (s == NULL) return PyErr_Occurred() ? -1 : 0;
    if (dst == src) {
        to_tail(dst, s);
        return 1;
    }
    Py_INCREF(s);
    int rc = remove_key(src, key) < 0 || PyDict_SetItem(dst->table, key, (PyObject *)s) < 0 ? -1 : 1;
    if (rc == 1) link_tail(dst, s, key);
    Py_DECREF(s);
    return rc;
}

PyObject *Order_take_from(Order *o, PyObject *args) {
    Order *other;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "O!O:take_from", &OrderType, &other, &keys)) return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    if (kf == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(kf); i++)
        if (move_key(o, other, PySequence_Fast_GET_ITEM(kf, i)) < 0) {
            Py_DECREF(kf);
            return NULL;
        }
    Py_DECREF(kf);
    Py_RETURN_NONE;
}

PyObject *Order_trim(Order *o, PyObject *bound_obj) {
    Py_ssize_t bound = PyNumber_AsSsize_t(bound_obj, PyExc_OverflowError);
    if (bound == -1 && PyErr_Occurred()) return NULL;
    while (o->head != NULL && PyDict_GET_SIZE(o->table) > bound)
        if (remove_key(o, o->head->key) < 0) return NULL;
    Py_RETURN_NONE;
}

PyObject *Order_arc_touch(Order *t1, PyObject *args) {
    Order *t2, *b1, *b2;
    PyObject *keys;
    double target, capacity;
    if (!PyArg_ParseTuple(args, "O!O!O!Odd:arc_touch", &OrderType, &t2, &OrderType, &b1, &OrderType, &b2, &keys,
                          &target, &capacity))
        return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    if (kf == NULL) return NULL;
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(kf) - 1; i >= 0; i--) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        Status *s = (Status *)PyDict_GetItemWithError(t1->table, key);
        long r = s == NULL ? 0 : get_ref((PyObject *)s);
        int in_b = 0;
        if (s != NULL && r >= 0) { /* a second access: to T2's most recent end */
            move_status(t2, t1, s, key);
        } else if (s != NULL && r == -1) {
            to_tail(t1, s);
        } else if (!PyErr_Occurred() && (s = (Status *)PyDict_GetItemWithError(t2->table, key)) != NULL) {
            to_tail(t2, s);
        } else if (!PyErr_Occurred() && (in_b = PyDict_Contains(b1->table, key)) == 0) {
            in_b = PyDict_Contains(b2->table, key) ? 2 : 0; /* (an error is caught below) */
        }
        if (PyErr_Occurred()) {
            Py_DECREF(kf);
            return NULL;
        }
        double n1 = (double)PyDict_GET_SIZE(b1->table), n2 = (double)PyDict_GET_SIZE(b2->table);
        if (in_b == 1) { /* a ghost hit in B1 grows T1's target, one in B2 shrinks it */
            double delta = n2 / n1 > 1.0 ? n2 / n1 : 1.0;
            target = target + delta < capacity ? target + delta : capacity;
        } else if (in_b == 2) {
            double delta = n1 / n2 > 1.0 ? n1 / n2 : 1.0;
            target = target - delta > 0.0 ? target - delta : 0.0;
        }
    }
    Py_DECREF(kf);
    return PyFloat_FromDouble(target);
}

PyObject *Order_arc_insert(Order *t1, PyObject *args) {
    Order *t2, *b1, *b2;
    PyObject *keys, *statuses;
    if (!PyArg_ParseTuple(args, "O!O!O!OO:arc_insert", &OrderType, &t2, &OrderType, &b1, &OrderType, &b2, &keys,
                          &statuses))
        return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    PyObject *sf = kf ? PySequence_Fast(statuses, "statuses must be a sequence") : NULL;
    if (sf == NULL) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    if (PySequence_Fast_GET_SIZE(sf) != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd statuses", n, PySequence_Fast_GET_SIZE(sf));
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        int present = PyDict_Contains(t1->table, key);
        if (present == 0) present = PyDict_Contains(t2->table, key);
        if (present > 0) PyErr_Format(PyExc_KeyError, "%R is resident already", key);
        if (present != 0) goto fail;
        int ghost = remove_key(b1, key); /* seen before: T2 */
        if (ghost == 0) ghost = remove_key(b2, key);
        if (ghost < 0) goto fail;
        PyObject *status = PySequence_Fast_GET_ITEM(sf, i);
        Order *dst = ghost > 0 ? t2 : t1;
        if (EXACT(status) && ((Status *)status)->owner == NULL) { /* absent from both: no entry to replace */
            if (PyDict_SetItem(dst->table, key, status) < 0) goto fail;
            link_tail(dst, (Status *)status, key);
        } else if (order_insert(dst, key, status) < 0) {
            goto fail;
        }
    }
    Py_DECREF(kf);
    Py_DECREF(sf);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(kf);
    Py_XDECREF(sf);
    return NULL;
}

/* Up to ``limit`` statuses of ``o`` into ``out``, least recent first, idle and not in
 * ``protected``: how many, or -1 with an error set. */
static Py_ssize_t collect(Order *o, Py_ssize_t limit, PyObject *protected, Status **out) {
    Py_ssize_t count = 0;
    for (Status *s = o->head; count < limit && (s = next_idle(s, protected)) != NULL; s = s->next) out[count++] = s;
    return PyErr_Occurred() ? -1 : count;
}

/* ``picked`` (statuses of ``src``) to ``ghosts``' most recent end, then the oldest ghosts past
 * ``bound`` dropped; a key is in one of ARC's four lists at most, so none is in ``ghosts``. */
static int to_ghosts(Order *ghosts, Order *src, Status **picked, Py_ssize_t count, Py_ssize_t bound) {
    for (Py_ssize_t i = 0; i < count; i++)
        if (move_status(ghosts, src, picked[i], picked[i]->key) < 0) return -1;
    while (ghosts->head != NULL && PyDict_GET_SIZE(ghosts->table) > bound)
        if (remove_key(ghosts, ghosts->head->key) < 0) return -1;
    return 0;
}

PyObject *Order_arc_evict(Order *t1, PyObject *args) {
    Order *t2, *b1, *b2;
    PyObject *protected, *out = NULL;
    Py_ssize_t n, capacity;
    double target;
    if (!PyArg_ParseTuple(args, "O!O!O!nOdn:arc_evict", &OrderType, &t2, &OrderType, &b1, &OrderType, &b2, &n,
                          &protected, &target, &capacity))
        return NULL;
    if (n < 0) n = 0;
    Status **from_t1 = PyMem_Malloc((size_t)(2 * n + 1) * sizeof(Status *)), **from_t2 = from_t1 + n;
    if (from_t1 == NULL) return PyErr_NoMemory();
    /* The paper takes from T1 while |T1| > p; each victim shrinks |T1| by one. */
    double excess = (double)PyDict_GET_SIZE(t1->table) - target;
    Py_ssize_t want = excess > 0 ? (Py_ssize_t)ceil(excess) : 0;
    Py_ssize_t n1 = collect(t1, want < n ? want : n, protected, from_t1);
    Py_ssize_t n2 = n1 < 0 ? -1 : collect(t2, n - n1, protected, from_t2);
    if (n2 >= 0 && n1 + n2 < n) /* the other list makes up */
        n1 = collect(t1, n - n2, protected, from_t1);
    if (n1 < 0 || n2 < 0) goto done;
    if (n1 + n2 < n) {
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *key = (i < n1 ? from_t1[i] : from_t2[i - n1])->key;
        Py_INCREF(key);
        PyList_SET_ITEM(out, i, key);
    }
    if (out != NULL && (to_ghosts(b1, t1, from_t1, n1, capacity) < 0 || to_ghosts(b2, t2, from_t2, n2, capacity) < 0))
        Py_CLEAR(out);
done:
    PyMem_Free(from_t1);
    return out;
}
