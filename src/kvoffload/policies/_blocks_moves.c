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
            move_key(t2, t1, key);
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
        if (order_insert(ghost > 0 ? t2 : t1, key, PySequence_Fast_GET_ITEM(sf, i)) < 0) goto fail;
    }
    Py_DECREF(kf);
    Py_DECREF(sf);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(kf);
    Py_XDECREF(sf);
    return NULL;
}

/* ``keys`` of ``src`` to ``ghosts``' most recent end, then the oldest ghosts past ``bound`` dropped. */
static int to_ghosts(Order *ghosts, Order *src, PyObject *keys, Py_ssize_t bound) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++)
        if (move_key(ghosts, src, PyList_GET_ITEM(keys, i)) < 0) return -1;
    while (ghosts->head != NULL && PyDict_GET_SIZE(ghosts->table) > bound)
        if (remove_key(ghosts, ghosts->head->key) < 0) return -1;
    return 0;
}

PyObject *Order_arc_evict(Order *t1, PyObject *args) {
    Order *t2, *b1, *b2;
    PyObject *protected, *from_t1 = NULL, *from_t2 = NULL, *out = NULL;
    Py_ssize_t n, capacity;
    double target;
    if (!PyArg_ParseTuple(args, "O!O!O!nOdn:arc_evict", &OrderType, &t2, &OrderType, &b1, &OrderType, &b2, &n,
                          &protected, &target, &capacity))
        return NULL;
    /* The paper takes from T1 while |T1| > p; each victim shrinks |T1| by one. */
    double excess = (double)PyDict_GET_SIZE(t1->table) - target;
    Py_ssize_t want = excess > 0 ? (Py_ssize_t)ceil(excess) : 0;
    from_t1 = evictable(t1, want < n ? want : n, protected);
    from_t2 = from_t1 ? evictable(t2, n - PyList_GET_SIZE(from_t1), protected) : NULL;
    if (from_t2 == NULL) goto done;
    if (PyList_GET_SIZE(from_t1) + PyList_GET_SIZE(from_t2) < n) { /* the other list makes up */
        Py_SETREF(from_t1, evictable(t1, n - PyList_GET_SIZE(from_t2), protected));
        if (from_t1 == NULL) goto done;
        if (PyList_GET_SIZE(from_t1) + PyList_GET_SIZE(from_t2) < n) {
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
    }
    if (to_ghosts(b1, t1, from_t1, capacity) == 0 && to_ghosts(b2, t2, from_t2, capacity) == 0)
        out = PySequence_Concat(from_t1, from_t2);
done:
    Py_XDECREF(from_t1);
    Py_XDECREF(from_t2);
    return out;
}
