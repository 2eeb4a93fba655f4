/* kvoffload.tiers.fs._slotfind: the read side of SlotIndex in C.
 *
 * Finder(table, tags, keys, lens, width) reads, without copying, the four buffers of a
 * kvoffload.tiers.fs.index.SlotIndex: the open-addressing table (int64 entries
 * ``tag << 32 | (slot + 1)``, 0 = empty, a power-of-two length), the byte tags beside it
 * (uint8 per table entry: byte_tag of the hash, 0 exactly where the entry is empty), the
 * fixed-width key bytes (``width`` bytes per slot) and the key lengths (uint8 per slot).
 * It holds buffer views on them for its lifetime, so none can be resized or freed under
 * it; the Python side keeps writing them (insert, remove) in place.
 *
 *   find(key) -> slot or -1            one key (bytes), same answer as SlotIndex's Python find
 *   split(keys) -> (slots, absent)     for a list or tuple of keys: the slots of the present
 *                                      ones and the absent keys, each in the order given
 *
 * Links(prev, next) holds views of the two int32 arrays of a doubly linked list over slots
 * (kvoffload.tiers.fs.order.SlotLRU; the sentinel is the last index):
 *
 *   move_to_end(finder, keys) -> absent   walks keys in reverse and moves each present one
 *                                         to the most recent end (before the sentinel); the
 *                                         absent keys come back in the order given
 *
 * Why C: the scheduler thread asks the disk tier about every key it looks up or touches.
 * The same probe walked in Python costs several hundred nanoseconds a key (int objects
 * for the hash, the mask, every table entry). Here a miss is one hash read (cached on
 * bytes objects) and, mostly, one cache line of the byte tags, which are an eighth of
 * the table's size and so stay in the CPU's caches far longer.
 *
 * The hash is PyObject_Hash, which is what Python's hash() returns: the Python side
 * inserts with hash(), so both agree. Single-threaded use under the GIL, like SlotIndex.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define TAG_MASK 0x7FFFFFFFu
#define SLOT_MASK 0xFFFFFFFFu

typedef struct {
    PyObject_HEAD
    Py_buffer table, tags, keys, lens;
    int held; /* how many of the four views are held (released in reverse) */
    const int64_t *tab;
    const unsigned char *tg;
    const unsigned char *kb;
    const unsigned char *ln;
    uint64_t mask;
    Py_ssize_t width;
    Py_ssize_t slots;
} Finder;

static void release(Finder *f) {
    if (f->held > 3) PyBuffer_Release(&f->lens);
    if (f->held > 2) PyBuffer_Release(&f->keys);
    if (f->held > 1) PyBuffer_Release(&f->tags);
    if (f->held > 0) PyBuffer_Release(&f->table);
    f->held = 0;
}

static void finder_dealloc(Finder *f) {
    release(f);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static int finder_init(Finder *f, PyObject *args, PyObject *kwds) {
    static char *names[] = {"table", "tags", "keys", "lens", "width", NULL};
    PyObject *table, *tags, *keys, *lens;
    Py_ssize_t width;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOn", names, &table, &tags, &keys, &lens, &width))
        return -1;
    release(f);
    if (PyObject_GetBuffer(table, &f->table, PyBUF_C_CONTIGUOUS) < 0) return -1;
    f->held = 1;
    if (PyObject_GetBuffer(tags, &f->tags, PyBUF_C_CONTIGUOUS) < 0) goto fail;
    f->held = 2;
    if (PyObject_GetBuffer(keys, &f->keys, PyBUF_C_CONTIGUOUS) < 0) goto fail;
    f->held = 3;
    if (PyObject_GetBuffer(lens, &f->lens, PyBUF_C_CONTIGUOUS) < 0) goto fail;
    f->held = 4;
    Py_ssize_t entries = f->table.len / 8;
    if (f->table.len % 8 || entries < 1 || (entries & (entries - 1))) {
        PyErr_Format(PyExc_ValueError, "table must hold a power of two of int64 entries, got %zd bytes",
                     f->table.len);
        goto fail;
    }
    if (f->tags.len != entries) {
        PyErr_Format(PyExc_ValueError, "tags must hold one byte per table entry (%zd), got %zd", entries,
                     f->tags.len);
        goto fail;
    }
    if (width < 1 || width > 255) {
        PyErr_Format(PyExc_ValueError, "width must be 1..255, got %zd", width);
        goto fail;
    }
    f->slots = f->lens.len;
    if (f->keys.len != f->slots * width) {
        PyErr_Format(PyExc_ValueError, "keys must hold %zd bytes (%zd slots of %zd), got %zd",
                     f->slots * width, f->slots, width, f->keys.len);
        goto fail;
    }
    f->tab = (const int64_t *)f->table.buf;
    f->tg = (const unsigned char *)f->tags.buf;
    f->kb = (const unsigned char *)f->keys.buf;
    f->ln = (const unsigned char *)f->lens.buf;
    f->mask = (uint64_t)(entries - 1);
    f->width = width;
    return 0;
fail:
    release(f);
    return -1;
}

/* slot of key, -1 if absent, -2 with an exception set */
static Py_ssize_t find_one(Finder *f, PyObject *key) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a key must be bytes, got %.100s", Py_TYPE(key)->tp_name);
        return -2;
    }
    if (!f->held) {
        PyErr_SetString(PyExc_ValueError, "Finder was not initialised");
        return -2;
    }
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1) return -2;
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    const char *data = PyBytes_AS_STRING(key);
    uint64_t i = (uint64_t)h & f->mask;
    uint64_t tag = (uint64_t)h & TAG_MASK;
    unsigned char byte_tag = (unsigned char)((uint64_t)h >> 56);
    if (byte_tag == 0) byte_tag = 1;
    const unsigned char *tg = f->tg;
    unsigned char t;
    while ((t = tg[i]) != 0) {
        if (t == byte_tag) {
            uint64_t entry = (uint64_t)f->tab[i];
            if ((entry >> 32) == tag) {
                Py_ssize_t slot = (Py_ssize_t)(entry & SLOT_MASK) - 1;
                if (slot >= 0 && slot < f->slots && f->ln[slot] == n &&
                    memcmp(f->kb + slot * f->width, data, (size_t)n) == 0)
                    return slot;
            }
        }
        i = (i + 1) & f->mask;
    }
    return -1;
}

static PyObject *finder_find(Finder *f, PyObject *key) {
    Py_ssize_t slot = find_one(f, key);
    if (slot == -2) return NULL;
    return PyLong_FromSsize_t(slot);
}

static PyObject *finder_split(Finder *f, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "split takes a list or tuple of keys");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *slots = PyList_New(0), *absent = PyList_New(0), *result = NULL;
    if (slots == NULL || absent == NULL) goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t slot = find_one(f, items[k]);
        if (slot == -2) goto done;
        if (slot >= 0) {
            PyObject *value = PyLong_FromSsize_t(slot);
            if (value == NULL) goto done;
            int bad = PyList_Append(slots, value);
            Py_DECREF(value);
            if (bad) goto done;
        } else if (PyList_Append(absent, items[k])) {
            goto done;
        }
    }
    result = PyTuple_Pack(2, slots, absent);
done:
    Py_XDECREF(slots);
    Py_XDECREF(absent);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef finder_methods[] = {
    {"find", (PyCFunction)finder_find, METH_O, "find(key) -> slot, or -1 if absent."},
    {"split", (PyCFunction)finder_split, METH_O,
     "split(keys) -> (slots of the present keys, absent keys), each in the order given."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FinderType;

typedef struct {
    PyObject_HEAD
    Py_buffer prev, next;
    int held;
    int32_t *pv, *nx;
    Py_ssize_t sentinel;
} Links;

static void links_release(Links *l) {
    if (l->held > 1) PyBuffer_Release(&l->next);
    if (l->held > 0) PyBuffer_Release(&l->prev);
    l->held = 0;
}

static void links_dealloc(Links *l) {
    links_release(l);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static int links_init(Links *l, PyObject *args, PyObject *kwds) {
    static char *names[] = {"prev", "next", NULL};
    PyObject *prev, *next;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", names, &prev, &next)) return -1;
    links_release(l);
    if (PyObject_GetBuffer(prev, &l->prev, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    l->held = 1;
    if (PyObject_GetBuffer(next, &l->next, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto fail;
    l->held = 2;
    if (l->prev.len != l->next.len || l->prev.len % 4 || l->prev.len < 4) {
        PyErr_Format(PyExc_ValueError, "prev and next must be int32 arrays of one length, got %zd and %zd bytes",
                     l->prev.len, l->next.len);
        goto fail;
    }
    l->pv = (int32_t *)l->prev.buf;
    l->nx = (int32_t *)l->next.buf;
    l->sentinel = l->prev.len / 4 - 1;
    return 0;
fail:
    links_release(l);
    return -1;
}

static PyObject *links_move_to_end(Links *l, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "move_to_end takes 2 arguments (finder, keys), got %zd", nargs);
        return NULL;
    }
    if (!PyObject_TypeCheck(args[0], &FinderType)) {
        PyErr_SetString(PyExc_TypeError, "move_to_end: the first argument must be a Finder");
        return NULL;
    }
    if (!l->held) {
        PyErr_SetString(PyExc_ValueError, "Links was not initialised");
        return NULL;
    }
    Finder *f = (Finder *)args[0];
    if (f->slots > l->sentinel) {
        PyErr_Format(PyExc_ValueError, "the finder has %zd slots, the links %zd", f->slots, l->sentinel);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "move_to_end takes a list or tuple of keys");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *absent = PyList_New(0);
    if (absent == NULL) goto fail;
    int32_t *pv = l->pv, *nx = l->nx;
    int32_t s = (int32_t)l->sentinel;
    for (Py_ssize_t k = n - 1; k >= 0; k--) {
        Py_ssize_t slot = find_one(f, items[k]);
        if (slot == -2) goto fail;
        if (slot < 0) {
            if (PyList_Append(absent, items[k])) goto fail;
            continue;
        }
        int32_t x = (int32_t)slot, p = pv[x], q = nx[x];
        nx[p] = q; /* unlink */
        pv[q] = p;
        int32_t last = pv[s]; /* append before the sentinel */
        nx[last] = x;
        pv[x] = last;
        nx[x] = s;
        pv[s] = x;
    }
    if (PyList_Reverse(absent)) goto fail; /* collected walking backwards */
    Py_DECREF(seq);
    return absent;
fail:
    Py_XDECREF(absent);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef links_methods[] = {
    {"move_to_end", (PyCFunction)(void (*)(void))links_move_to_end, METH_FASTCALL,
     "move_to_end(finder, keys) -> absent keys: the present ones, walked in reverse, to the end."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LinksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.tiers.fs._slotfind.Links",
    .tp_basicsize = sizeof(Links),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Links(prev, next): moves in SlotLRU's int32 doubly linked list.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)links_init,
    .tp_dealloc = (destructor)links_dealloc,
    .tp_methods = links_methods,
};

static PyTypeObject FinderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.tiers.fs._slotfind.Finder",
    .tp_basicsize = sizeof(Finder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Finder(table, tags, keys, lens, width): SlotIndex lookups over its buffers.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)finder_init,
    .tp_dealloc = (destructor)finder_dealloc,
    .tp_methods = finder_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_slotfind", .m_doc = NULL, .m_size = -1,
};

PyMODINIT_FUNC PyInit__slotfind(void) {
    if (PyType_Ready(&FinderType) < 0 || PyType_Ready(&LinksType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddType(m, &FinderType) < 0 || PyModule_AddType(m, &LinksType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
