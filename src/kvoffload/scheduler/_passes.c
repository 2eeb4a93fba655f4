/* kvoffload.scheduler._passes: a decode step's passes over its running requests, in C.
 *
 * The contracts are those of kvoffload.scheduler.passes, whose Python functions give the
 * same answers (tests/scheduler/test_passes.py compares both):
 *
 *   tokens_after(ids, before, scheduled) -> list
 *       before[i] + scheduled.get(ids[i], 0) for each i.
 *   note_running(ids, computed, known, store_at) -> (list, float)
 *       known[ids[i]] = computed[i] for each i in order; the indices i (ascending) where
 *       computed[i] >= store_at[ids[i]] (an id missing from store_at never reaches), and
 *       the slack: the least store_at[ids[i]] - computed[i] (inf where none has a bound).
 *   advance_below(computed, at_pass, slack) -> bool
 *       whether computed[i] - at_pass[i] < slack for every i.
 *   append_blocks(ids, new_block_ids, requests) -> None
 *       for each i with new_block_ids[i] not None and ids[i] in requests: each group's
 *       list of that state's block_ids extended by the group's new ids (zip: the shorter
 *       of the two decides).
 *
 * Sequences go through PySequence_Fast (lists and tuples as they are); lengths must match
 * (ValueError). scheduled, known, store_at and requests must be dicts (TypeError). The GIL
 * is held throughout; an error raised midway leaves what was done before it done.
 *
 * Why C: in Python each is one C-level map or zip over a thousand ids, four of them per
 * ordinary decode step at about 60 us each (bench/bench_batch.py, 1,024 requests); here
 * each is one loop. The ids are vLLM's request id strings, scattered over the heap
 * between their requests' token lists: a probe reads the string's cached hash, a cache
 * miss per id once the engine's step has been through memory. tokens_after avoids it
 * where it can: while the dict's keys, in order, are the ids themselves (vLLM fills it
 * running requests first, in the order it lists them), each value is read from the dict's
 * entries as they come.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *str_block_ids; /* "block_ids" */

/* PySequence_Fast of two objects of the same length, or NULL with an error set. */
static int fast_pair(PyObject *a, PyObject *b, PyObject **fa, PyObject **fb, Py_ssize_t *n) {
    *fa = PySequence_Fast(a, "expected a sequence");
    if (*fa == NULL)
        return -1;
    *fb = PySequence_Fast(b, "expected a sequence");
    if (*fb == NULL) {
        Py_DECREF(*fa);
        return -1;
    }
    *n = PySequence_Fast_GET_SIZE(*fa);
    if (PySequence_Fast_GET_SIZE(*fb) != *n) {
        PyErr_Format(PyExc_ValueError, "lists of different lengths: [%zd, %zd]", *n,
                     PySequence_Fast_GET_SIZE(*fb));
        Py_DECREF(*fa);
        Py_DECREF(*fb);
        return -1;
    }
    return 0;
}

static int need_dict(PyObject *d, const char *what) {
    if (!PyDict_Check(d)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict, not %.100s", what, Py_TYPE(d)->tp_name);
        return -1;
    }
    return 0;
}

static PyObject *tokens_after(PyObject *self, PyObject *args) {
    PyObject *ids, *before, *scheduled, *fi, *fb, *out, *zero;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOO:tokens_after", &ids, &before, &scheduled))
        return NULL;
    if (need_dict(scheduled, "scheduled") < 0 || fast_pair(ids, before, &fi, &fb, &n) < 0)
        return NULL;
    out = PyList_New(n);
    zero = PyLong_FromLong(0);
    if (out == NULL || zero == NULL)
        goto fail;
    PyObject **id = PySequence_Fast_ITEMS(fi), **b = PySequence_Fast_ITEMS(fb);
    Py_ssize_t pos = 0;
    int aligned = 1; /* so far the dict's keys in order are the ids themselves */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key, *s = NULL;
        if (aligned && PyDict_Next(scheduled, &pos, &key, &s) && key == id[i]) {
            /* s: this id's value, read from the dict's entries in order, no hashing */
        } else {
            aligned = 0;
            s = PyDict_GetItemWithError(scheduled, id[i]); /* borrowed */
            if (s == NULL && PyErr_Occurred())
                goto fail;
        }
        PyObject *v = PyNumber_Add(b[i], s != NULL ? s : zero);
        if (v == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(zero);
    Py_DECREF(fi);
    Py_DECREF(fb);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(zero);
    Py_DECREF(fi);
    Py_DECREF(fb);
    return NULL;
}

/* a number as a double (exact for the token counts here, below 2**53); -1.0 with an error set */
static double as_double(PyObject *x) {
    return PyLong_CheckExact(x) ? PyLong_AsDouble(x) : PyFloat_AsDouble(x);
}

static PyObject *note_running(PyObject *self, PyObject *args) {
    PyObject *ids, *computed, *known, *store_at, *fi, *fc, *out;
    Py_ssize_t n;
    double slack = Py_HUGE_VAL;
    if (!PyArg_ParseTuple(args, "OOOO:note_running", &ids, &computed, &known, &store_at))
        return NULL;
    if (need_dict(known, "known") < 0 || need_dict(store_at, "store_at") < 0 ||
        fast_pair(ids, computed, &fi, &fc, &n) < 0)
        return NULL;
    out = PyList_New(0);
    if (out == NULL)
        goto fail;
    PyObject **id = PySequence_Fast_ITEMS(fi), **c = PySequence_Fast_ITEMS(fc);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyDict_SetItem(known, id[i], c[i]) < 0)
            goto fail;
        PyObject *bound = PyDict_GetItemWithError(store_at, id[i]); /* borrowed */
        if (bound == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        int reached = PyObject_RichCompareBool(c[i], bound, Py_GE);
        if (reached < 0)
            goto fail;
        double b = as_double(bound), now = as_double(c[i]);
        if ((b == -1.0 || now == -1.0) && PyErr_Occurred())
            goto fail;
        if (b - now < slack)
            slack = b - now;
        if (reached) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(out, index) < 0) {
                Py_XDECREF(index);
                goto fail;
            }
            Py_DECREF(index);
        }
    }
    Py_DECREF(fi);
    Py_DECREF(fc);
    return Py_BuildValue("(Nd)", out, slack);
fail:
    Py_XDECREF(out);
    Py_DECREF(fi);
    Py_DECREF(fc);
    return NULL;
}

static PyObject *advance_below(PyObject *self, PyObject *args) {
    PyObject *computed, *at_pass, *fc, *fa;
    double slack;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOd:advance_below", &computed, &at_pass, &slack))
        return NULL;
    if (fast_pair(computed, at_pass, &fc, &fa, &n) < 0)
        return NULL;
    PyObject **c = PySequence_Fast_ITEMS(fc), **a = PySequence_Fast_ITEMS(fa);
    int below = 1;
    for (Py_ssize_t i = 0; i < n && below; i++) {
        int overflow_c = 0, overflow_a = 0;
        long long now = PyLong_CheckExact(c[i]) ? PyLong_AsLongLongAndOverflow(c[i], &overflow_c) : 0;
        long long then = PyLong_CheckExact(a[i]) ? PyLong_AsLongLongAndOverflow(a[i], &overflow_a) : 0;
        double advance;
        if (PyLong_CheckExact(c[i]) && PyLong_CheckExact(a[i]) && !overflow_c && !overflow_a &&
            now < (1LL << 53) && now > -(1LL << 53) && then < (1LL << 53) && then > -(1LL << 53)) {
            advance = (double)(now - then);
        } else {
            double x = as_double(c[i]), y = as_double(a[i]);
            if ((x == -1.0 || y == -1.0) && PyErr_Occurred()) {
                Py_DECREF(fc);
                Py_DECREF(fa);
                return NULL;
            }
            advance = x - y;
        }
        below = advance < slack;
    }
    Py_DECREF(fc);
    Py_DECREF(fa);
    return PyBool_FromLong(below);
}

/* each group's list in state.block_ids extended by new's (zip of the two) */
static int extend_groups(PyObject *state, PyObject *new) {
    PyObject *have = PyObject_GetAttr(state, str_block_ids);
    if (have == NULL)
        return -1;
    PyObject *fh = PySequence_Fast(have, "block_ids must be a sequence");
    Py_DECREF(have);
    if (fh == NULL)
        return -1;
    PyObject *fn = PySequence_Fast(new, "new block ids must be a sequence");
    if (fn == NULL) {
        Py_DECREF(fh);
        return -1;
    }
    Py_ssize_t groups = PySequence_Fast_GET_SIZE(fh);
    if (PySequence_Fast_GET_SIZE(fn) < groups)
        groups = PySequence_Fast_GET_SIZE(fn);
    int rc = 0;
    for (Py_ssize_t g = 0; g < groups && rc == 0; g++) {
        PyObject *r = PySequence_InPlaceConcat(PySequence_Fast_GET_ITEM(fh, g), PySequence_Fast_GET_ITEM(fn, g));
        if (r == NULL)
            rc = -1;
        Py_XDECREF(r);
    }
    Py_DECREF(fh);
    Py_DECREF(fn);
    return rc;
}

static PyObject *append_blocks(PyObject *self, PyObject *args) {
    PyObject *ids, *new_block_ids, *requests, *fi, *fn;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOO:append_blocks", &ids, &new_block_ids, &requests))
        return NULL;
    if (need_dict(requests, "requests") < 0 || fast_pair(ids, new_block_ids, &fi, &fn, &n) < 0)
        return NULL;
    PyObject **id = PySequence_Fast_ITEMS(fi), **new = PySequence_Fast_ITEMS(fn);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (new[i] == Py_None)
            continue;
        PyObject *state = PyDict_GetItemWithError(requests, id[i]); /* borrowed */
        if (state == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        Py_INCREF(state); /* (an attribute lookup may run Python code) */
        int rc = extend_groups(state, new[i]);
        Py_DECREF(state);
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(fi);
    Py_DECREF(fn);
    Py_RETURN_NONE;
fail:
    Py_DECREF(fi);
    Py_DECREF(fn);
    return NULL;
}

static PyMethodDef methods[] = {
    {"tokens_after", tokens_after, METH_VARARGS, "before[i] + scheduled.get(ids[i], 0) for each i."},
    {"note_running", note_running, METH_VARARGS,
     "known[ids[i]] = computed[i]; the indices where computed[i] >= store_at[ids[i]], the slack."},
    {"advance_below", advance_below, METH_VARARGS,
     "Whether computed[i] - at_pass[i] < slack for every i."},
    {"append_blocks", append_blocks, METH_VARARGS,
     "Each running request's new device blocks appended to its state's block_ids."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_passes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__passes(void) {
    str_block_ids = PyUnicode_InternFromString("block_ids");
    if (str_block_ids == NULL)
        return NULL;
    return PyModule_Create(&module);
}
