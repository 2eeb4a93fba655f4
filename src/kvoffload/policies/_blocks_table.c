/* kvoffload.policies._blocks: the CPU tier's batch paths over its table (a dict key ->
 * BlockStatus), each one C loop; see _blocks.c for the contracts. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_blocks.h"

static PyObject *get_slot(PyObject *s) {
    if (EXACT(s)) return PyLong_FromSsize_t(((Status *)s)->slot);
    return PyObject_GetAttrString(s, "slot");
}

/* table[key] as a borrowed status, NULL when absent (an error set only on failure). */
static PyObject *status_of(PyObject *table, PyObject *key) { return PyDict_GetItemWithError(table, key); }

static int parse(PyObject *args, const char *format, PyObject **table, PyObject **kf) {
    PyObject *keys;
    if (!PyArg_ParseTuple(args, format, &PyDict_Type, table, &keys)) return -1;
    *kf = PySequence_Fast(keys, "keys must be a sequence");
    return *kf == NULL ? -1 : 0;
}

PyObject *lookup_prefix(PyObject *module, PyObject *args) {
    PyObject *table, *kf;
    if (parse(args, "O!O:lookup_prefix", &table, &kf) < 0) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf), count = 0;
    int missed = 0;
    for (; count < n; count++) {
        PyObject *s = status_of(table, PySequence_Fast_GET_ITEM(kf, count));
        if (s == NULL) {
            missed = 1;
            break;
        }
        long r = get_ref(s);
        if (r < 0) break; /* in flight: pending (or an error) */
    }
    Py_DECREF(kf);
    if (PyErr_Occurred()) return NULL;
    return Py_BuildValue("(nO)", count, missed ? Py_True : Py_False);
}

PyObject *pin(PyObject *module, PyObject *args) {
    PyObject *table, *kf;
    if (parse(args, "O!O:pin", &table, &kf) < 0) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf), newly = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* all HITs, or nothing changes */
        PyObject *s = status_of(table, PySequence_Fast_GET_ITEM(kf, i));
        if (s == NULL || get_ref(s) < 0) {
            Py_DECREF(kf);
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
    }
    PyObject *slots = PyList_New(n);
    for (Py_ssize_t i = 0; slots != NULL && i < n; i++) {
        PyObject *s = status_of(table, PySequence_Fast_GET_ITEM(kf, i));
        long r = get_ref(s);
        PyObject *slot = r < 0 ? NULL : get_slot(s);
        if (slot == NULL || set_ref(s, r + 1) < 0) {
            Py_XDECREF(slot);
            Py_CLEAR(slots);
            break;
        }
        newly += r == 0;
        PyList_SET_ITEM(slots, i, slot);
    }
    Py_DECREF(kf);
    return slots == NULL ? NULL : Py_BuildValue("(Nn)", slots, newly);
}

PyObject *unpin(PyObject *module, PyObject *args) {
    PyObject *table, *kf;
    if (parse(args, "O!O:unpin", &table, &kf) < 0) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf), newly = 0, i;
    for (i = 0; i < n; i++) {
        PyObject *s = status_of(table, PySequence_Fast_GET_ITEM(kf, i));
        long r = s == NULL ? 0 : get_ref(s);
        if (r <= 0 || set_ref(s, r - 1) < 0) break;
        newly += r == 1;
    }
    if (i == n) {
        Py_DECREF(kf);
        return PyLong_FromSsize_t(newly);
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    while (--i >= 0) { /* all or nothing: give back the pins taken */
        PyObject *s = status_of(table, PySequence_Fast_GET_ITEM(kf, i));
        set_ref(s, get_ref(s) + 1);
    }
    PyErr_Restore(type, value, tb);
    Py_DECREF(kf);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

PyObject *complete(PyObject *module, PyObject *args) {
    PyObject *table, *kf;
    if (parse(args, "O!O:complete", &table, &kf) < 0) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    PyObject *done = PyList_New(0);
    for (Py_ssize_t i = 0; done != NULL && i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        PyObject *s = status_of(table, key);
        long r = s == NULL ? 0 : get_ref(s);
        if (PyErr_Occurred() || (r == -1 && (set_ref(s, 0) < 0 || PyList_Append(done, key) < 0)))
            Py_CLEAR(done);
    }
    Py_DECREF(kf);
    return done;
}

PyObject *reserve(PyObject *module, PyObject *args) {
    PyObject *table, *kf, *slots;
    if (!PyArg_ParseTuple(args, "O!OO:reserve", &PyDict_Type, &table, &kf, &slots)) return NULL;
    kf = PySequence_Fast(kf, "keys must be a sequence");
    PyObject *sf = kf ? PySequence_Fast(slots, "slots must be a sequence") : NULL;
    PyObject *out = NULL;
    if (sf == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    if (PySequence_Fast_GET_SIZE(sf) != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd slots", n, PySequence_Fast_GET_SIZE(sf));
        goto done;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Py_ssize_t slot = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(sf, i), PyExc_OverflowError);
        Status *s = slot == -1 && PyErr_Occurred() ? NULL : (Status *)StatusType.tp_alloc(&StatusType, 0);
        if (s == NULL) {
            Py_CLEAR(out);
            break;
        }
        s->slot = slot;
        s->ref = -1;
        PyList_SET_ITEM(out, i, (PyObject *)s);
        if (PyDict_SetItem(table, PySequence_Fast_GET_ITEM(kf, i), (PyObject *)s) < 0) Py_CLEAR(out);
    }
done:
    Py_XDECREF(kf);
    Py_XDECREF(sf);
    return out;
}

PyObject *absent(PyObject *module, PyObject *args) {
    PyObject *table, *kf;
    if (parse(args, "O!O:absent", &table, &kf) < 0) return NULL;
    PyObject *out = PyList_New(0), *seen = out ? PySet_New(NULL) : NULL;
    for (Py_ssize_t i = 0; seen != NULL && i < PySequence_Fast_GET_SIZE(kf); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        int held = PyDict_Contains(table, key), dup = held == 0 ? PySet_Contains(seen, key) : 0;
        if (held < 0 || dup < 0 || (!held && !dup && (PySet_Add(seen, key) < 0 || PyList_Append(out, key) < 0)))
            Py_CLEAR(seen);
    }
    Py_DECREF(kf);
    if (seen == NULL) Py_CLEAR(out);
    Py_XDECREF(seen);
    return out;
}

PyObject *release(PyObject *module, PyObject *args) {
    PyObject *table, *kf, *free;
    if (!PyArg_ParseTuple(args, "O!OO!:release", &PyDict_Type, &table, &kf, &PyList_Type, &free)) return NULL;
    kf = PySequence_Fast(kf, "keys must be a sequence");
    if (kf == NULL) return NULL;
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PySequence_Fast_GET_SIZE(kf); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        PyObject *s = status_of(table, key), *slot = NULL;
        if (s == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            rc = -1;
        } else if ((slot = get_slot(s)) == NULL || PyList_Append(free, slot) < 0 || PyDict_DelItem(table, key) < 0) {
            rc = -1;
        }
        Py_XDECREF(slot);
    }
    Py_DECREF(kf);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}
