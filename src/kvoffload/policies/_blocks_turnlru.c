/* kvoffload.policies._blocks: the turn-aware LRU's paths over its level orders (``queues``,
 * a tuple, the last one the final blocks'), its ghost order and its index ``known``, a dict
 * key -> the status linked for it in a queue or the ghost order (resident and ghost keys);
 * each linked status carries the level the key was stored at (``birth``) and the time of its
 * last use (``used``). The contracts are kvoffload.policies.turnlru's Python versions
 * (turn_touch, turn_insert, turn_raise, turn_evict), which keep the same in a dict key ->
 * [birth, used] and give the same answers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_blocks.h"

/* The index of the queue ``s`` is linked in, or -1 (a ghost's, or not linked). */
static Py_ssize_t queue_of(PyObject *queues, Status *s) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(queues); i++)
        if (s->owner == PyTuple_GET_ITEM(queues, i)) return i;
    return -1;
}

/* ``key``'s status in one of ``queues`` (borrowed; its index in ``*at``), NULL when absent or a
 * ghost (check PyErr_Occurred). */
static Status *find(PyObject *queues, PyObject *known, PyObject *key, Py_ssize_t *at) {
    Status *s = (Status *)PyDict_GetItemWithError(known, key);
    if (s == NULL) return NULL;
    *at = queue_of(queues, s);
    return *at < 0 ? NULL : s;
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
    PyObject *queues, *known, *reserved, *keys;
    long clock;
    if (!PyArg_ParseTuple(args, "OO!O!Ol:turn_touch", &queues, &PyDict_Type, &known, &PyDict_Type, &reserved, &keys,
                          &clock))
        return NULL;
    if (check_queues(queues) < 0) return NULL;
    Py_ssize_t finals = PyTuple_GET_SIZE(queues) - 1, depth = 0, level = 0;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence");
    if (kf == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    PyObject *gap = Py_None;
    Status *deepest = NULL;
    Py_INCREF(gap);
    for (; depth < n; depth++) { /* the leading keys known (resident or ghost): the reuse depth */
        Status *s = (Status *)PyDict_GetItemWithError(known, PySequence_Fast_GET_ITEM(kf, depth));
        if (s == NULL) break;
        deepest = s;
    }
    if (PyErr_Occurred()) goto fail;
    if (depth >= 2) {
        level = deepest->birth + 1 < finals - 1 ? deepest->birth + 1 : finals - 1;
        Py_SETREF(gap, PyLong_FromLong(clock - deepest->used));
        if (gap == NULL) goto fail;
    }
    /* walking backwards: resident keys moved, absent ones reserved (re-entered at the end) */
    PyObject *plain = Py_BuildValue("(nO)", level, Py_False), *last = Py_BuildValue("(nO)", level, Py_True);
    PyObject *final = n ? PySequence_Fast_GET_ITEM(kf, n - 1) : NULL;
    int rc = plain == NULL || last == NULL ? -1 : 0;
    for (Py_ssize_t i = n - 1; rc == 0 && i >= 0; i--) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        Py_ssize_t at = 0;
        Status *s = find(queues, known, key, &at);
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
        rc = move_status((Order *)PyTuple_GET_ITEM(queues, to), (Order *)PyTuple_GET_ITEM(queues, at), s, key);
        s->used = clock;
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
    PyObject *queues, *ghost, *known, *reserved, *keys, *statuses;
    long clock;
    Py_ssize_t finals;
    if (!PyArg_ParseTuple(args, "OO!O!O!OOln:turn_insert", &queues, &OrderType, &ghost, &PyDict_Type, &known,
                          &PyDict_Type, &reserved, &keys, &statuses, &clock, &finals))
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
        Py_ssize_t level = 0;
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
        Status *old = (Status *)PyDict_GetItemWithError(known, key);
        if (old != NULL) { /* resident (stored again) or a ghost: out of its order first */
            Py_ssize_t at = queue_of(queues, old);
            rc = remove_key(at >= 0 ? (Order *)PyTuple_GET_ITEM(queues, at) : (Order *)ghost, key) < 0 ? -1 : 0;
        } else if (PyErr_Occurred()) {
            rc = -1;
        }
        PyObject *status = PySequence_Fast_GET_ITEM(sf, i);
        Order *q = (Order *)PyTuple_GET_ITEM(queues, last && finals >= 0 ? finals : level);
        Status *linked = NULL;
        if (rc == 0 && old == NULL && EXACT(status) && ((Status *)status)->owner == NULL) { /* nothing to replace */
            rc = PyDict_SetItem(q->table, key, status);
            if (rc == 0) link_tail(q, (Status *)status, key);
            linked = (Status *)status;
        } else if (rc == 0 && order_insert(q, key, status) == 0) {
            linked = (Status *)PyDict_GetItemWithError(q->table, key); /* a proxy, maybe */
        }
        if (rc < 0 || linked == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            rc = -1;
            break;
        }
        linked->birth = (long)level;
        linked->used = clock;
        rc = PyDict_SetItem(known, key, (PyObject *)linked);
    }
    Py_XDECREF(kf);
    Py_XDECREF(sf);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

PyObject *turn_raise(PyObject *module, PyObject *args) {
    PyObject *queues, *known, *keys;
    long clock;
    Py_ssize_t level;
    if (!PyArg_ParseTuple(args, "OO!Onl:turn_raise", &queues, &PyDict_Type, &known, &keys, &level, &clock))
        return NULL;
    if (check_queues(queues) < 0) return NULL;
    if (level < 0 || level >= PyTuple_GET_SIZE(queues)) {
        PyErr_Format(PyExc_ValueError, "level %zd out of range", level);
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys), *key;
    if (it == NULL) return NULL;
    int rc = 0;
    while (rc == 0 && (key = PyIter_Next(it)) != NULL) {
        Py_ssize_t at = 0;
        Status *s = find(queues, known, key, &at);
        if (s != NULL && at < level) {
            rc = move_status((Order *)PyTuple_GET_ITEM(queues, level), (Order *)PyTuple_GET_ITEM(queues, at), s, key);
            s->birth = (long)level;
            s->used = clock;
        } else if (s == NULL && PyErr_Occurred()) {
            rc = -1;
        }
        Py_DECREF(key);
    }
    Py_DECREF(it);
    if (rc < 0 || PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

#define MAX_QUEUES 64

PyObject *turn_evict(PyObject *module, PyObject *args) {
    PyObject *queues, *ghost, *known, *protected;
    Py_ssize_t n, ghost_limit;
    double step;
    if (!PyArg_ParseTuple(args, "OO!O!nOdn:turn_evict", &queues, &OrderType, &ghost, &PyDict_Type, &known, &n,
                          &protected, &step, &ghost_limit))
        return NULL;
    if (check_queues(queues) < 0) return NULL;
    Py_ssize_t nq = PyTuple_GET_SIZE(queues), finals = nq - 1;
    if (nq > MAX_QUEUES) {
        PyErr_Format(PyExc_ValueError, "at most %d queues", MAX_QUEUES);
        return NULL;
    }
    Status *heads[MAX_QUEUES];
    for (Py_ssize_t i = 0; i < nq; i++) {
        heads[i] = next_idle(((Order *)PyTuple_GET_ITEM(queues, i))->head, protected);
        if (PyErr_Occurred()) return NULL;
    }
    Status **picked = PyMem_Malloc((n > 0 ? n : 1) * sizeof(Status *));
    Py_ssize_t *from = PyMem_Malloc((n > 0 ? n : 1) * sizeof(Py_ssize_t)), count = 0;
    PyObject *victims = NULL;
    if (picked == NULL || from == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    while (count < n) { /* the final queue's first, then the lowest time + level x step */
        Py_ssize_t pick = heads[finals] != NULL ? finals : -1;
        double best = 0.0;
        for (Py_ssize_t i = 0; pick != finals && i < finals; i++)
            if (heads[i] != NULL && (pick < 0 || (double)heads[i]->used + (double)i * step < best)) {
                pick = i;
                best = (double)heads[i]->used + (double)i * step;
            }
        if (pick < 0) {
            PyMem_Free(picked);
            PyMem_Free(from);
            Py_RETURN_NONE;
        }
        picked[count] = heads[pick];
        from[count++] = pick;
        heads[pick] = next_idle(heads[pick]->next, protected);
        if (PyErr_Occurred()) goto fail;
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
        } else if (PyDict_DelItem(known, key) < 0 || remove_key(q, key) < 0) {
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
        int rc = PyDict_DelItem(known, key) < 0 || remove_key(g, key) < 0;
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
