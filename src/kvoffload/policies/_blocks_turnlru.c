/* kvoffload.policies._blocks: the turn-aware LRU's paths over its level orders (``queues``,
 * a tuple, the last one the final blocks'), its ghost order and its dicts key -> level it
 * was stored at (``births``) and key -> time of last use (``times``), both holding the
 * resident and the ghost keys; the contracts are kvoffload.policies.turnlru's Python
 * versions (turn_touch, turn_insert, turn_raise, turn_evict), which do the same. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_blocks.h"

/* ``key``'s status in one of ``queues`` (borrowed; its index in ``*at``), NULL when absent
 * (check PyErr_Occurred); a key not in ``births`` (resident and ghost keys) is absent at once. */
static Status *find(PyObject *queues, PyObject *births, PyObject *key, Py_ssize_t *at) {
    int known = PyDict_Contains(births, key);
    if (known <= 0) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(queues); i++) {
        Order *q = (Order *)PyTuple_GET_ITEM(queues, i);
        Status *s = (Status *)PyDict_GetItemWithError(q->table, key);
        if (s != NULL) {
            *at = i;
            return s;
        }
        if (PyErr_Occurred()) return NULL;
    }
    return NULL;
}

/* ``s`` (``key``'s, linked in ``src``) to the most recent end of ``dst``, keeping its links'
 * references; 0, or -1 with an error set (nothing moved). */
static int move_status(Order *dst, Order *src, Status *s, PyObject *key) {
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

static int check_queues(PyObject *queues) {
    if (!PyTuple_Check(queues) || PyTuple_GET_SIZE(queues) < 2) {
        PyErr_SetString(PyExc_TypeError, "queues must be a tuple of at least two orders");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(queues); i++)
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(queues, i), &OrderType)) {
            PyErr_SetString(PyExc_TypeError, "queues must hold orders");
            return -1;
        }
    return 0;
}

PyObject *turn_touch(PyObject *module, PyObject *args) {
    PyObject *queues, *births, *times, *reserved, *keys, *clock_obj;
    if (!PyArg_ParseTuple(args, "OO!O!O!OO:turn_touch", &queues, &PyDict_Type, &births, &PyDict_Type, &times,
                          &PyDict_Type, &reserved, &keys, &clock_obj))
        return NULL;
    if (check_queues(queues) < 0) return NULL;
    long clock = PyLong_AsLong(clock_obj);
    if (clock == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t finals = PyTuple_GET_SIZE(queues) - 1, depth = 0, level = 0;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    if (kf == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    PyObject *gap = Py_None, *deepest = NULL;
    Py_INCREF(gap);
    for (; depth < n; depth++) { /* the leading keys known (resident or ghost): the reuse depth */
        PyObject *key = PySequence_Fast_GET_ITEM(kf, depth);
        int known = PyDict_Contains(births, key);
        if (known < 0) goto fail;
        if (!known) break;
        deepest = key;
    }
    if (depth >= 2) {
        PyObject *b = PyDict_GetItemWithError(births, deepest), *t = b ? PyDict_GetItemWithError(times, deepest) : NULL;
        long born = b ? PyLong_AsLong(b) : -1, used = t ? PyLong_AsLong(t) : -1;
        if (PyErr_Occurred() || t == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, deepest);
            goto fail;
        }
        level = born + 1 < finals - 1 ? born + 1 : finals - 1;
        Py_SETREF(gap, PyLong_FromLong(clock - used));
        if (gap == NULL) goto fail;
    }
    /* walking backwards: resident keys moved, absent ones reserved (re-entered at the end) */
    PyObject *plain = Py_BuildValue("(nO)", level, Py_False), *last = Py_BuildValue("(nO)", level, Py_True);
    PyObject *final = n ? PySequence_Fast_GET_ITEM(kf, n - 1) : NULL;
    int rc = plain == NULL || last == NULL ? -1 : 0;
    for (Py_ssize_t i = n - 1; rc == 0 && i >= 0; i--) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        Py_ssize_t at = 0;
        Status *s = find(queues, births, key, &at);
        if (s == NULL) {
            int eq = PyErr_Occurred() ? -1 : key == final ? 1 : PyObject_RichCompareBool(key, final, Py_EQ);
            int held = eq < 0 ? -1 : PyDict_Contains(reserved, key);
            rc = held < 0 || (held && PyDict_DelItem(reserved, key) < 0) ||
                         PyDict_SetItem(reserved, key, eq ? last : plain) < 0
                     ? -1
                     : 0;
            continue;
        }
        Py_ssize_t to = at == finals ? 0 : at;
        if (to < level) to = level;
        if (move_status((Order *)PyTuple_GET_ITEM(queues, to), (Order *)PyTuple_GET_ITEM(queues, at), s, key) < 0 ||
            PyDict_SetItem(times, key, clock_obj) < 0)
            rc = -1;
    }
    Py_XDECREF(plain);
    Py_XDECREF(last);
    Py_DECREF(kf);
    if (rc < 0) {
        Py_DECREF(gap);
        return NULL;
    }
    return Py_BuildValue("(nN)", level, gap);
fail:
    Py_DECREF(kf);
    Py_XDECREF(gap);
    return NULL;
}

/* ``key``'s reservation popped from ``reserved`` as (level, last), (0, 0) without one; 0, or -1
 * with an error set. */
static int take_reservation(PyObject *reserved, PyObject *key, Py_ssize_t *level, int *last) {
    PyObject *info = PyDict_GetItemWithError(reserved, key);
    *level = 0;
    *last = 0;
    if (info == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 2) {
        PyErr_Format(PyExc_TypeError, "a reservation must be a (level, last) tuple, got %R", info);
        return -1;
    }
    *level = PyNumber_AsSsize_t(PyTuple_GET_ITEM(info, 0), PyExc_OverflowError);
    *last = PyObject_IsTrue(PyTuple_GET_ITEM(info, 1));
    if ((*level == -1 && PyErr_Occurred()) || *last < 0) return -1;
    return PyDict_DelItem(reserved, key);
}

PyObject *turn_insert(PyObject *module, PyObject *args) {
    PyObject *queues, *ghost, *births, *times, *reserved, *keys, *statuses, *clock;
    Py_ssize_t finals;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!OOOn:turn_insert", &queues, &OrderType, &ghost, &PyDict_Type, &births,
                          &PyDict_Type, &times, &PyDict_Type, &reserved, &keys, &statuses, &clock, &finals))
        return NULL;
    if (check_queues(queues) < 0) return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    PyObject *sf = kf ? PySequence_Fast(statuses, "statuses must be a sequence") : NULL;
    int rc = sf == NULL ? -1 : 0;
    Py_ssize_t n = sf == NULL ? 0 : PySequence_Fast_GET_SIZE(kf);
    if (rc == 0 && PySequence_Fast_GET_SIZE(sf) != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd statuses", n, PySequence_Fast_GET_SIZE(sf));
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        Py_ssize_t at = 0, level = 0;
        int last = 0;
        if (take_reservation(reserved, key, &level, &last) < 0) {
            rc = -1;
            break;
        }
        if (level < 0 || level >= PyTuple_GET_SIZE(queues)) {
            PyErr_Format(PyExc_ValueError, "level %zd out of range", level);
            rc = -1;
            break;
        }
        int known = PyDict_Contains(births, key);
        Status *old = known > 0 ? find(queues, births, key, &at) : NULL;
        if (known < 0) rc = -1;
        else if (old != NULL) rc = remove_key((Order *)PyTuple_GET_ITEM(queues, at), key) < 0 ? -1 : 0;
        else if (PyErr_Occurred()) rc = -1;
        PyObject *born = rc == 0 ? PyLong_FromSsize_t(level) : NULL;
        if (rc == 0) rc = born == NULL ? -1 : PyDict_SetItem(births, key, born);
        Py_XDECREF(born);
        if (last && finals >= 0) level = finals;
        PyObject *status = PySequence_Fast_GET_ITEM(sf, i);
        Order *q = (Order *)PyTuple_GET_ITEM(queues, level);
        if (rc == 0 && !known && EXACT(status) && ((Status *)status)->owner == NULL) { /* new: no entry to replace */
            rc = PyDict_SetItem(q->table, key, status);
            if (rc == 0) link_tail(q, (Status *)status, key);
        } else if (rc == 0) {
            rc = order_insert(q, key, status);
        }
        if (rc == 0) rc = PyDict_SetItem(times, key, clock);
        if (rc == 0 && known && old == NULL) rc = remove_key((Order *)ghost, key) < 0 ? -1 : 0;
    }
    Py_XDECREF(kf);
    Py_XDECREF(sf);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

PyObject *turn_raise(PyObject *module, PyObject *args) {
    PyObject *queues, *births, *times, *keys, *clock, *level_obj;
    if (!PyArg_ParseTuple(args, "OO!O!OOO:turn_raise", &queues, &PyDict_Type, &births, &PyDict_Type, &times, &keys,
                          &level_obj, &clock))
        return NULL;
    if (check_queues(queues) < 0) return NULL;
    Py_ssize_t level = PyNumber_AsSsize_t(level_obj, PyExc_OverflowError);
    if (level == -1 && PyErr_Occurred()) return NULL;
    if (level < 0 || level >= PyTuple_GET_SIZE(queues)) {
        PyErr_Format(PyExc_ValueError, "level %zd out of range", level);
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys), *key;
    if (it == NULL) return NULL;
    int rc = 0;
    while (rc == 0 && (key = PyIter_Next(it)) != NULL) {
        Py_ssize_t at = 0;
        Status *s = find(queues, births, key, &at);
        if (s != NULL && at < level)
            rc = move_status((Order *)PyTuple_GET_ITEM(queues, level), (Order *)PyTuple_GET_ITEM(queues, at), s, key) < 0 ||
                         PyDict_SetItem(times, key, clock) < 0 || PyDict_SetItem(births, key, level_obj) < 0
                     ? -1
                     : 0;
        else if (s == NULL && PyErr_Occurred())
            rc = -1;
        Py_DECREF(key);
    }
    Py_DECREF(it);
    if (rc < 0 || PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* The next status from ``s`` on (inclusive) that is idle and not in ``protected``; NULL at the
 * end (check PyErr_Occurred). */
static Status *next_idle(Status *s, PyObject *protected) {
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

static int time_of(PyObject *times, PyObject *key, double *out) {
    PyObject *v = PyDict_GetItemWithError(times, key);
    if (v == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    long t = PyLong_AsLong(v);
    *out = (double)t;
    return t == -1 && PyErr_Occurred() ? -1 : 0;
}

#define MAX_QUEUES 64

PyObject *turn_evict(PyObject *module, PyObject *args) {
    PyObject *queues, *ghost, *births, *times, *protected;
    Py_ssize_t n, ghost_limit;
    double step;
    if (!PyArg_ParseTuple(args, "OO!O!O!nOdn:turn_evict", &queues, &OrderType, &ghost, &PyDict_Type, &births,
                          &PyDict_Type, &times, &n, &protected, &step, &ghost_limit))
        return NULL;
    if (check_queues(queues) < 0) return NULL;
    Py_ssize_t nq = PyTuple_GET_SIZE(queues), finals = nq - 1;
    if (nq > MAX_QUEUES) {
        PyErr_Format(PyExc_ValueError, "at most %d queues", MAX_QUEUES);
        return NULL;
    }
    Status *heads[MAX_QUEUES];
    double uses[MAX_QUEUES];
    for (Py_ssize_t i = 0; i < nq; i++) {
        heads[i] = next_idle(((Order *)PyTuple_GET_ITEM(queues, i))->head, protected);
        if (PyErr_Occurred() || (heads[i] != NULL && i < finals && time_of(times, heads[i]->key, &uses[i]) < 0))
            return NULL;
    }
    Status **picked = PyMem_Malloc((n > 0 ? n : 1) * sizeof(Status *));
    Py_ssize_t *from = PyMem_Malloc((n > 0 ? n : 1) * sizeof(Py_ssize_t)), count = 0;
    PyObject *victims = NULL;
    if (picked == NULL || from == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    while (count < n) {
        Py_ssize_t pick = heads[finals] != NULL ? finals : -1;
        double best = 0.0;
        for (Py_ssize_t i = 0; pick != finals && i < finals; i++)
            if (heads[i] != NULL && (pick < 0 || uses[i] + (double)i * step < best)) {
                pick = i;
                best = uses[i] + (double)i * step;
            }
        if (pick < 0) {
            PyMem_Free(picked);
            PyMem_Free(from);
            Py_RETURN_NONE;
        }
        picked[count] = heads[pick];
        from[count++] = pick;
        heads[pick] = next_idle(heads[pick]->next, protected);
        if (PyErr_Occurred() || (heads[pick] != NULL && pick < finals && time_of(times, heads[pick]->key, &uses[pick]) < 0))
            goto fail;
    }
    victims = PyList_New(n);
    if (victims == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        Status *s = picked[i];
        PyObject *key = s->key;
        Py_INCREF(key);
        PyList_SET_ITEM(victims, i, key);
        Order *q = (Order *)PyTuple_GET_ITEM(queues, from[i]);
        if (from[i] != finals && ghost_limit > 0) {
            if (move_status((Order *)ghost, q, s, key) < 0) goto fail;
        } else if (remove_key(q, key) < 0 || PyDict_DelItem(births, key) < 0 || PyDict_DelItem(times, key) < 0) {
            goto fail;
        }
    }
    PyMem_Free(picked);
    PyMem_Free(from);
    picked = NULL;
    from = NULL;
    Order *g = (Order *)ghost;
    while (g->head != NULL && PyDict_GET_SIZE(g->table) > ghost_limit) {
        PyObject *key = g->head->key;
        Py_INCREF(key);
        int rc = remove_key(g, key) < 0 || PyDict_DelItem(births, key) < 0 || PyDict_DelItem(times, key) < 0;
        Py_DECREF(key);
        if (rc) goto fail;
    }
    return victims;
fail:
    PyMem_Free(picked);
    PyMem_Free(from);
    Py_XDECREF(victims);
    return NULL;
}
