/* kvoffload.policies._blocks: W-TinyLFU in C, with the same answers as the Python versions.
 *
 *   Sketch(bits, sample_size)
 *       The count-min sketch of kvoffload.policies.sketch (its Python ``FrequencySketch``
 *       has the contract): four rows of 2**bits saturating 4-bit counts (one byte each),
 *       the same key folding and row hashing, conservative update, every count halved
 *       after ``sample_size`` increments. ``increment(key)``, ``estimate(key)``, ``age()``,
 *       ``clear()``, ``counts()`` (the rows as bytes); ``width``, ``sample_size``.
 *       ``kvoffload.policies.sketch.FrequencySketch`` subclasses it where built.
 *   wtinylfu_touch(window, probation, protected, sketch, keys, protected_target)
 *   wtinylfu_evict(window, probation, protected, sketch, n, protected_keys, window_target,
 *                  main_share) -> keys | None
 *       kvoffload.policies.wtinylfu's paths over its three orders (the Python versions
 *       there have the contracts).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "_blocks.h"

#define M61 ((UINT64_C(1) << 61) - 1)
#define MAX_COUNT 15
#define ROWS 4

typedef struct {
    PyObject_HEAD
    uint8_t *table; /* ROWS * width counts */
    Py_ssize_t width, sample_size, additions;
    int shift;
} Sketch;

PyTypeObject SketchType;
static PyObject *m61; /* 2**61 - 1 as a Python int, for int keys */
static const uint64_t seeds[ROWS] = {UINT64_C(0x9E3779B97F4A7C15), UINT64_C(0xC2B2AE3D27D4EB4F),
                                     UINT64_C(0x165667B19E3779F9), UINT64_C(0xD6E8FEB86659FD93)};

static uint64_t reduce(unsigned __int128 x) { /* x mod 2**61 - 1 (2**61 is 1 there) */
    x = (x & M61) + (x >> 61);
    x = (x & M61) + (x >> 61);
    uint64_t r = (uint64_t)x;
    return r >= M61 ? r - M61 : r;
}

/* The key as a little-endian integer, mod 2**61 - 1, plus one (the Python ``_fold``); 0 with
 * an error set. */
static uint64_t fold(PyObject *key) {
    const unsigned char *p;
    Py_ssize_t len;
    if (PyBytes_Check(key)) {
        p = (const unsigned char *)PyBytes_AS_STRING(key);
        len = PyBytes_GET_SIZE(key);
    } else if (PyByteArray_Check(key)) {
        p = (const unsigned char *)PyByteArray_AS_STRING(key);
        len = PyByteArray_GET_SIZE(key);
    } else if (PyLong_Check(key)) {
        PyObject *rest = PyNumber_Remainder(key, m61);
        uint64_t v = rest == NULL ? 0 : PyLong_AsUnsignedLongLong(rest);
        Py_XDECREF(rest);
        return PyErr_Occurred() ? 0 : v + 1;
    } else {
        PyErr_Format(PyExc_TypeError, "FrequencySketch keys must be bytes or int, got %s", Py_TYPE(key)->tp_name);
        return 0;
    }
    uint64_t v = 0;
    for (Py_ssize_t start = (len - 1) / 8 * 8; start >= 0; start -= 8) { /* 64-bit words, the top first */
        Py_ssize_t end = start + 8 < len ? start + 8 : len;
        uint64_t word = 0;
        for (Py_ssize_t i = end - 1; i >= start; i--) word = (word << 8) | p[i];
        v = reduce(((unsigned __int128)v << 64) | word);
    }
    return v + 1;
}

static void slots_of(Sketch *sk, uint64_t value, Py_ssize_t *slots) {
    for (int row = 0; row < ROWS; row++) slots[row] = row * sk->width + (Py_ssize_t)((value * seeds[row]) >> sk->shift);
}

static void age(Sketch *sk) {
    for (Py_ssize_t i = 0; i < ROWS * sk->width; i++) sk->table[i] >>= 1;
    sk->additions /= 2;
}

/* The estimate of ``key`` (0..15) with its counters' slots in ``slots``, or -1 with an
 * error set. */
static int lowest(Sketch *sk, PyObject *key, Py_ssize_t *slots) {
    uint64_t value = fold(key);
    if (value == 0) return -1;
    slots_of(sk, value, slots);
    int low = MAX_COUNT;
    for (int row = 0; row < ROWS; row++)
        if (sk->table[slots[row]] < low) low = sk->table[slots[row]];
    return low;
}

static int estimate(Sketch *sk, PyObject *key) {
    Py_ssize_t slots[ROWS];
    return lowest(sk, key, slots);
}

static int increment(Sketch *sk, PyObject *key) {
    Py_ssize_t slots[ROWS];
    int low = lowest(sk, key, slots);
    if (low < 0) return -1;
    if (low < MAX_COUNT) /* conservative update: the counts at the minimum only */
        for (int row = 0; row < ROWS; row++)
            if (sk->table[slots[row]] == low) sk->table[slots[row]] = (uint8_t)(low + 1);
    if (++sk->additions >= sk->sample_size) age(sk);
    return 0;
}

static int Sketch_init(Sketch *sk, PyObject *args, PyObject *kwds) {
    static char *names[] = {"bits", "sample_size", NULL};
    int bits;
    Py_ssize_t sample_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "in:Sketch", names, &bits, &sample_size)) return -1;
    if (bits < 1 || bits > 40 || sample_size < 1) {
        PyErr_Format(PyExc_ValueError, "Sketch needs 1 <= bits <= 40 and sample_size >= 1, got %d, %zd", bits,
                     sample_size);
        return -1;
    }
    uint8_t *table = PyMem_Calloc((size_t)ROWS << bits, 1);
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(sk->table);
    sk->table = table;
    sk->width = (Py_ssize_t)1 << bits;
    sk->shift = 64 - bits;
    sk->sample_size = sample_size;
    sk->additions = 0;
    return 0;
}

static void Sketch_dealloc(Sketch *sk) {
    PyMem_Free(sk->table);
    Py_TYPE(sk)->tp_free((PyObject *)sk);
}

static int ready(Sketch *sk) {
    if (sk->table != NULL) return 0;
    PyErr_SetString(PyExc_ValueError, "Sketch was not initialised");
    return -1;
}

static PyObject *Sketch_increment(Sketch *sk, PyObject *key) {
    if (ready(sk) < 0 || increment(sk, key) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Sketch_estimate(Sketch *sk, PyObject *key) {
    int low = ready(sk) < 0 ? -1 : estimate(sk, key);
    return low < 0 ? NULL : PyLong_FromLong(low);
}

static PyObject *Sketch_age(Sketch *sk, PyObject *unused) {
    if (ready(sk) < 0) return NULL;
    age(sk);
    Py_RETURN_NONE;
}

static PyObject *Sketch_clear(Sketch *sk, PyObject *unused) {
    if (ready(sk) < 0) return NULL;
    memset(sk->table, 0, (size_t)(ROWS * sk->width));
    sk->additions = 0;
    Py_RETURN_NONE;
}

static PyObject *Sketch_counts(Sketch *sk, PyObject *unused) {
    if (ready(sk) < 0) return NULL;
    return PyBytes_FromStringAndSize((const char *)sk->table, ROWS * sk->width);
}

static PyMethodDef Sketch_methods[] = {
    {"increment", (PyCFunction)Sketch_increment, METH_O, "Count one use of key; ages every sample_size uses."},
    {"estimate", (PyCFunction)Sketch_estimate, METH_O, "The recent use count of key (an upper bound, at most 15)."},
    {"age", (PyCFunction)Sketch_age, METH_NOARGS, "Halve every count (and the uses since the last aging)."},
    {"clear", (PyCFunction)Sketch_clear, METH_NOARGS, "Forget every count."},
    {"counts", (PyCFunction)Sketch_counts, METH_NOARGS, "The counts, row after row, as bytes."},
    {NULL},
};

static PyMemberDef Sketch_members[] = {
    {"width", T_PYSSIZET, offsetof(Sketch, width), READONLY, "counts per row"},
    {"sample_size", T_PYSSIZET, offsetof(Sketch, sample_size), READONLY, "increments between agings"},
    {NULL},
};

int sketch_type_ready(void) {
    SketchType = (PyTypeObject){
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.policies._blocks.Sketch",
        .tp_basicsize = sizeof(Sketch),
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
        .tp_doc = "A count-min sketch of recent uses with periodic halving (kvoffload.policies.sketch).",
        .tp_new = PyType_GenericNew,
        .tp_init = (initproc)Sketch_init,
        .tp_dealloc = (destructor)Sketch_dealloc,
        .tp_methods = Sketch_methods,
        .tp_members = Sketch_members,
    };
    m61 = PyLong_FromUnsignedLongLong(M61);
    return m61 == NULL ? -1 : PyType_Ready(&SketchType);
}

/* -- W-TinyLFU's paths ------------------------------------------------------------------------ */

static Sketch *as_sketch(PyObject *obj) {
    if (PyObject_TypeCheck(obj, &SketchType) && ready((Sketch *)obj) == 0) return (Sketch *)obj;
    if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "sketch must be a native Sketch, got %R", obj);
    return NULL;
}

PyObject *wtinylfu_touch(PyObject *module, PyObject *args) {
    Order *window, *probation, *protected;
    PyObject *sketch_obj, *keys;
    Py_ssize_t protected_target;
    if (!PyArg_ParseTuple(args, "O!O!O!OOn:wtinylfu_touch", &OrderType, &window, &OrderType, &probation, &OrderType,
                          &protected, &sketch_obj, &keys, &protected_target))
        return NULL;
    Sketch *sk = as_sketch(sketch_obj);
    PyObject *kf = sk == NULL ? NULL : PySequence_Fast(keys, "keys must be a sequence");
    if (kf == NULL) return NULL;
    int rc = 0;
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(kf) - 1; rc == 0 && i >= 0; i--) {
        PyObject *key = PySequence_Fast_GET_ITEM(kf, i);
        Status *s;
        if (increment(sk, key) < 0) {
            rc = -1;
        } else if ((s = (Status *)PyDict_GetItemWithError(window->table, key)) != NULL) {
            to_tail(window, s);
        } else if (!PyErr_Occurred() && (s = (Status *)PyDict_GetItemWithError(protected->table, key)) != NULL) {
            to_tail(protected, s);
        } else if (!PyErr_Occurred() && (s = (Status *)PyDict_GetItemWithError(probation->table, key)) != NULL) {
            /* a use in probation: protected; protected's overflow back to probation */
            rc = move_status(protected, probation, s, key);
            if (rc == 0 && PyDict_GET_SIZE(protected->table) > protected_target)
                rc = move_status(probation, protected, protected->head, protected->head->key);
        }
        if (PyErr_Occurred()) rc = -1;
    }
    Py_DECREF(kf);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* ``s`` out of ``o`` (segment ``seg``: 0 window, 1 probation, 2 protected) onto ``victims`` as
 * (key, status, seg); 0, or -1 with an error set. */
static int take(PyObject *victims, Order *o, Status *s, int seg) {
    PyObject *item = Py_BuildValue("(OOi)", s->key, (PyObject *)s, seg);
    int rc = item == NULL || PyList_Append(victims, item) < 0 ? -1 : remove_key(o, PyTuple_GET_ITEM(item, 0));
    Py_XDECREF(item);
    return rc < 0 ? -1 : 0;
}

PyObject *wtinylfu_evict(PyObject *module, PyObject *args) {
    Order *segs[3], *window, *probation, *protected;
    PyObject *sketch_obj, *protected_keys;
    Py_ssize_t n, window_target, main_share;
    if (!PyArg_ParseTuple(args, "O!O!O!OnOnn:wtinylfu_evict", &OrderType, &window, &OrderType, &probation,
                          &OrderType, &protected, &sketch_obj, &n, &protected_keys, &window_target, &main_share))
        return NULL;
    Sketch *sk = as_sketch(sketch_obj);
    if (sk == NULL) return NULL;
    segs[0] = window;
    segs[1] = probation;
    segs[2] = protected;
    PyObject *victims = PyList_New(0);
    while (victims != NULL && PyList_GET_SIZE(victims) < n) {
        Status *candidate = NULL, *main_victim;
        Order *segment = probation;
        if (PyDict_GET_SIZE(window->table) > window_target) candidate = next_idle(window->head, protected_keys);
        if (PyErr_Occurred()) goto fail;
        if (candidate != NULL &&
            PyDict_GET_SIZE(probation->table) + PyDict_GET_SIZE(protected->table) < main_share) {
            /* the main area has room (the cache is filling up): no duel */
            if (move_status(probation, window, candidate, candidate->key) < 0) goto fail;
            continue;
        }
        main_victim = next_idle(probation->head, protected_keys);
        if (main_victim == NULL && !PyErr_Occurred()) {
            segment = protected;
            main_victim = next_idle(protected->head, protected_keys);
        }
        if (PyErr_Occurred()) goto fail;
        if (candidate != NULL && main_victim != NULL) {
            int ours = estimate(sk, candidate->key), theirs = ours < 0 ? -1 : estimate(sk, main_victim->key);
            if (theirs < 0) goto fail;
            if (ours > theirs) { /* the candidate wins: the main area's victim goes */
                if (take(victims, segment, main_victim, segment == probation ? 1 : 2) < 0 ||
                    move_status(probation, window, candidate, candidate->key) < 0)
                    goto fail;
            } else if (take(victims, window, candidate, 0) < 0) {
                goto fail;
            }
        } else if (main_victim != NULL) {
            if (take(victims, segment, main_victim, segment == probation ? 1 : 2) < 0) goto fail;
        } else {
            if (candidate == NULL) candidate = next_idle(window->head, protected_keys);
            if (PyErr_Occurred()) goto fail;
            if (candidate == NULL) { /* too few: the victims back at the old ends, in order */
                for (Py_ssize_t i = PyList_GET_SIZE(victims) - 1; i >= 0; i--) {
                    PyObject *item = PyList_GET_ITEM(victims, i);
                    Order *o = segs[PyLong_AsLong(PyTuple_GET_ITEM(item, 2))];
                    Status *s = (Status *)PyTuple_GET_ITEM(item, 1);
                    if (order_insert(o, PyTuple_GET_ITEM(item, 0), (PyObject *)s) < 0) goto fail;
                    to_head(o, s);
                }
                Py_DECREF(victims);
                Py_RETURN_NONE;
            }
            if (take(victims, window, candidate, 0) < 0) goto fail;
        }
    }
    if (victims == NULL) return NULL;
    PyObject *out = PyList_New(PyList_GET_SIZE(victims));
    for (Py_ssize_t i = 0; out != NULL && i < PyList_GET_SIZE(victims); i++) {
        PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(victims, i), 0);
        Py_INCREF(key);
        PyList_SET_ITEM(out, i, key);
    }
    Py_DECREF(victims);
    return out;
fail:
    Py_XDECREF(victims);
    return NULL;
}
