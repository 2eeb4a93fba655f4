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
 *   insert(keys, slots) -> None        SlotIndex.insert of each pair (keys not present,
 *                                      slots not in use: the caller's contract, as in Python)
 *   remove(slots) -> None              SlotIndex.remove of each slot (KeyError for one not in
 *                                      use; the slots before it are removed)
 *   keys_of(slots) -> keys             the key (bytes) held by each slot
 *
 * Links(prev, next) holds views of the two int32 arrays of a doubly linked list over slots
 * (kvoffload.tiers.fs.order.SlotLRU; the sentinel is the last index):
 *
 *   move_to_end(finder, keys) -> absent   walks keys in reverse and moves each present one
 *                                         to the most recent end (before the sentinel); the
 *                                         absent keys come back in the order given
 *   evict(state, n, protected) -> slots   the n least recent slots whose state (an int32
 *                                         array indexed by slot) is 0 and that are not in
 *                                         ``protected`` (a set of slots), unlinked; None,
 *                                         changing nothing, when fewer than n exist
 *
 * Why C: the scheduler thread asks the disk tier about every key it looks up or touches.
 * The same probe walked in Python costs several hundred nanoseconds a key (int objects
 * for the hash, the mask, every table entry). Here a miss is one hash read (cached on
 * bytes objects) and, mostly, one cache line of the byte tags, which are an eighth of
 * the table's size and so stay in the CPU's caches far longer.
 *
 * TieredLookup(table, finders, slow, hit, miss, pending): the tiered manager's lookup over
 * the CPU tier's block table (a dict: key -> status with an int ``ref``) and the finders of
 * the disk tiers below it:
 *
 *   lookup(key)    status in the table: ``pending`` if its ref < 0, else ``hit`` (counted);
 *                  absent from the table and from every finder: ``miss`` (counted); held
 *                  by a finder: ``slow(key)``, whatever it answers
 *   take_counts()  (hits, misses) counted since the last call
 *
 * Why C here too: the scheduler looks up every key of every request; a key no tier holds
 * then costs one dict probe and one index probe, without a Python frame.
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
    int64_t *tab;
    unsigned char *tg;
    unsigned char *kb;
    unsigned char *ln;
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
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE;
    if (PyObject_GetBuffer(table, &f->table, flags) < 0) return -1;
    f->held = 1;
    if (PyObject_GetBuffer(tags, &f->tags, flags) < 0) goto fail;
    f->held = 2;
    if (PyObject_GetBuffer(keys, &f->keys, flags) < 0) goto fail;
    f->held = 3;
    if (PyObject_GetBuffer(lens, &f->lens, flags) < 0) goto fail;
    f->held = 4;
    Py_ssize_t entries = f->table.len / 8;
    if (f->table.len % 8 || entries < 1 || (entries & (entries - 1))) {
        PyErr_Format(PyExc_ValueError, "table must hold a power of two of int64 entries, got %zd bytes",
                     f->table.len);
        goto fail;
    }
    if ((uintptr_t)f->table.buf % 8) { /* read as int64: a misaligned load is undefined */
        PyErr_SetString(PyExc_ValueError, "table must be aligned to 8 bytes");
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
    f->tab = (int64_t *)f->table.buf;
    f->tg = (unsigned char *)f->tags.buf;
    f->kb = (unsigned char *)f->keys.buf;
    f->ln = (unsigned char *)f->lens.buf;
    f->mask = (uint64_t)(entries - 1);
    f->width = width;
    return 0;
fail:
    release(f);
    return -1;
}

static unsigned char byte_tag_of(Py_hash_t h) {
    unsigned char t = (unsigned char)((uint64_t)h >> 56);
    return t ? t : 1;
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
    unsigned char byte_tag = byte_tag_of(h);
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

static int insert_one(Finder *f, PyObject *key, PyObject *slot_obj) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a key must be bytes, got %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    if (n < 1 || n > f->width) {
        PyErr_Format(PyExc_ValueError, "a key must be 1..%zd bytes, got %zd", f->width, n);
        return -1;
    }
    Py_ssize_t slot = PyNumber_AsSsize_t(slot_obj, PyExc_OverflowError);
    if (slot == -1 && PyErr_Occurred()) return -1;
    if (slot < 0 || slot >= f->slots) {
        PyErr_Format(PyExc_ValueError, "slot must be 0..%zd, got %zd", f->slots - 1, slot);
        return -1;
    }
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1) return -1;
    uint64_t i = (uint64_t)h & f->mask, probes = 0;
    while (f->tab[i] != 0) {
        if (++probes > f->mask) {
            PyErr_SetString(PyExc_RuntimeError, "the index table is full");
            return -1;
        }
        i = (i + 1) & f->mask;
    }
    memcpy(f->kb + slot * f->width, PyBytes_AS_STRING(key), (size_t)n);
    f->ln[slot] = (unsigned char)n;
    f->tab[i] = (int64_t)((((uint64_t)h & TAG_MASK) << 32) | (uint64_t)(slot + 1));
    f->tg[i] = byte_tag_of(h);
    return 0;
}

static PyObject *finder_insert(Finder *f, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "insert takes 2 arguments (keys, slots), got %zd", nargs);
        return NULL;
    }
    if (!f->held) {
        PyErr_SetString(PyExc_ValueError, "Finder was not initialised");
        return NULL;
    }
    PyObject *keys = PySequence_Fast(args[0], "insert takes a sequence of keys");
    if (keys == NULL) return NULL;
    PyObject *slots = PySequence_Fast(args[1], "insert takes a sequence of slots");
    if (slots == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject *result = NULL;
    if (PySequence_Fast_GET_SIZE(slots) != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys for %zd slots", n, PySequence_Fast_GET_SIZE(slots));
        goto done;
    }
    PyObject **k = PySequence_Fast_ITEMS(keys), **s = PySequence_Fast_ITEMS(slots);
    for (Py_ssize_t j = 0; j < n; j++)
        if (insert_one(f, k[j], s[j]) < 0) goto done;
    result = Py_None;
    Py_INCREF(result);
done:
    Py_DECREF(keys);
    Py_DECREF(slots);
    return result;
}

static int remove_one(Finder *f, PyObject *slot_obj) {
    Py_ssize_t slot = PyNumber_AsSsize_t(slot_obj, PyExc_OverflowError);
    if (slot == -1 && PyErr_Occurred()) return -1;
    if (slot < 0 || slot >= f->slots || f->ln[slot] == 0) {
        PyErr_Format(PyExc_KeyError, "slot %zd is not in the index", slot);
        return -1;
    }
    PyObject *key = PyBytes_FromStringAndSize((const char *)f->kb + slot * f->width, f->ln[slot]);
    if (key == NULL) return -1;
    Py_hash_t h = PyObject_Hash(key);
    Py_DECREF(key);
    if (h == -1) return -1;
    uint64_t mask = f->mask, i = (uint64_t)h & mask, want = (uint64_t)(slot + 1);
    int64_t *tab = f->tab;
    unsigned char *tg = f->tg;
    while (((uint64_t)tab[i] & SLOT_MASK) != want) {
        if (!tab[i]) {
            PyErr_Format(PyExc_KeyError, "slot %zd is not in the index", slot);
            return -1;
        }
        i = (i + 1) & mask;
    }
    /* Backward-shift deletion, as SlotIndex.remove: pull later entries of the probe run
     * into the hole unless their home lies cyclically in (hole, their position]. */
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t entry = (uint64_t)tab[j];
        if (!entry) break;
        uint64_t home = (entry >> 32) & mask;
        if ((j > i && i < home && home <= j) || (j < i && (home > i || home <= j))) continue;
        tab[i] = (int64_t)entry;
        tg[i] = tg[j];
        i = j;
    }
    tab[i] = 0;
    tg[i] = 0;
    f->ln[slot] = 0;
    return 0;
}

static PyObject *finder_remove(Finder *f, PyObject *slots_obj) {
    if (!f->held) {
        PyErr_SetString(PyExc_ValueError, "Finder was not initialised");
        return NULL;
    }
    PyObject *slots = PySequence_Fast(slots_obj, "remove takes a sequence of slots");
    if (slots == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    PyObject **s = PySequence_Fast_ITEMS(slots);
    for (Py_ssize_t j = 0; j < n; j++) {
        if (remove_one(f, s[j]) < 0) {
            Py_DECREF(slots);
            return NULL;
        }
    }
    Py_DECREF(slots);
    Py_RETURN_NONE;
}

static PyObject *finder_keys_of(Finder *f, PyObject *slots_obj) {
    if (!f->held) {
        PyErr_SetString(PyExc_ValueError, "Finder was not initialised");
        return NULL;
    }
    PyObject *slots = PySequence_Fast(slots_obj, "keys_of takes a sequence of slots");
    if (slots == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    PyObject **s = PySequence_Fast_ITEMS(slots);
    PyObject *keys = PyList_New(n);
    if (keys == NULL) goto fail;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t slot = PyNumber_AsSsize_t(s[j], PyExc_OverflowError);
        if (slot == -1 && PyErr_Occurred()) goto fail;
        if (slot < 0 || slot >= f->slots) {
            PyErr_Format(PyExc_ValueError, "slot must be 0..%zd, got %zd", f->slots - 1, slot);
            goto fail;
        }
        PyObject *key = PyBytes_FromStringAndSize((const char *)f->kb + slot * f->width, f->ln[slot]);
        if (key == NULL) goto fail;
        PyList_SET_ITEM(keys, j, key);
    }
    Py_DECREF(slots);
    return keys;
fail:
    Py_XDECREF(keys);
    Py_DECREF(slots);
    return NULL;
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
    {"insert", (PyCFunction)(void (*)(void))finder_insert, METH_FASTCALL,
     "insert(keys, slots): each key (not present) into its slot (not in use)."},
    {"remove", (PyCFunction)finder_remove, METH_O, "remove(slots): each slot (in use) out of the index."},
    {"keys_of", (PyCFunction)finder_keys_of, METH_O, "keys_of(slots) -> the key held by each slot."},
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
    if ((uintptr_t)l->prev.buf % 4 || (uintptr_t)l->next.buf % 4) {
        PyErr_SetString(PyExc_ValueError, "prev and next must be aligned to 4 bytes");
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

static PyObject *links_evict(Links *l, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "evict takes 3 arguments (state, n, protected), got %zd", nargs);
        return NULL;
    }
    if (!l->held) {
        PyErr_SetString(PyExc_ValueError, "Links was not initialised");
        return NULL;
    }
    Py_buffer state;
    if (PyObject_GetBuffer(args[0], &state, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *victims = NULL;
    if (state.len != l->sentinel * 4 || (uintptr_t)state.buf % 4) {
        PyErr_Format(PyExc_ValueError, "state must be an int32 array of %zd slots, aligned", l->sentinel);
        goto done;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred()) goto done;
    PyObject *protected = args[2];
    const int32_t *st = (const int32_t *)state.buf;
    int32_t *pv = l->pv, *nx = l->nx, s = (int32_t)l->sentinel;
    victims = PyList_New(0);
    if (victims == NULL || n <= 0) goto done;
    for (int32_t slot = nx[s]; slot != s; slot = nx[slot]) {
        if (st[slot] != 0) continue;
        PyObject *value = PyLong_FromLong(slot);
        if (value == NULL) goto fail;
        int taken = PySequence_Contains(protected, value);
        if (taken < 0 || (!taken && PyList_Append(victims, value) < 0)) {
            Py_DECREF(value);
            goto fail;
        }
        Py_DECREF(value);
        if (PyList_GET_SIZE(victims) == n) break;
    }
    if (PyList_GET_SIZE(victims) < n) {
        Py_DECREF(victims);
        victims = Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        int32_t x = (int32_t)PyLong_AsLong(PyList_GET_ITEM(victims, k));
        int32_t p = pv[x], q = nx[x];
        nx[p] = q;
        pv[q] = p;
    }
    goto done;
fail:
    Py_CLEAR(victims);
done:
    PyBuffer_Release(&state);
    return victims;
}

static PyMethodDef links_methods[] = {
    {"evict", (PyCFunction)(void (*)(void))links_evict, METH_FASTCALL,
     "evict(state, n, protected) -> the slots of n idle blocks, least recent first, unlinked; or None."},
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

typedef struct {
    PyObject_HEAD
    PyObject *table, *finders, *slow, *hit, *miss, *pending, *ref_name;
    Py_ssize_t hits, misses;
} TieredLookup;

static int tl_traverse(TieredLookup *t, visitproc visit, void *arg) {
    Py_VISIT(t->table);
    Py_VISIT(t->finders);
    Py_VISIT(t->slow);
    Py_VISIT(t->hit);
    Py_VISIT(t->miss);
    Py_VISIT(t->pending);
    return 0;
}

static int tl_clear(TieredLookup *t) {
    Py_CLEAR(t->table);
    Py_CLEAR(t->finders);
    Py_CLEAR(t->slow);
    Py_CLEAR(t->hit);
    Py_CLEAR(t->miss);
    Py_CLEAR(t->pending);
    Py_CLEAR(t->ref_name);
    return 0;
}

static void tl_dealloc(TieredLookup *t) {
    PyObject_GC_UnTrack(t);
    tl_clear(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int tl_init(TieredLookup *t, PyObject *args, PyObject *kwds) {
    static char *names[] = {"table", "finders", "slow", "hit", "miss", "pending", NULL};
    PyObject *table, *finders, *slow, *hit, *miss, *pending;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OOOO", names, &PyDict_Type, &table, &PyTuple_Type,
                                     &finders, &slow, &hit, &miss, &pending))
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(finders); i++) {
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(finders, i), &FinderType)) {
            PyErr_SetString(PyExc_TypeError, "finders must be a tuple of Finder objects");
            return -1;
        }
    }
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "slow must be callable");
        return -1;
    }
    PyObject *ref_name = PyUnicode_InternFromString("ref");
    if (ref_name == NULL) return -1;
    tl_clear(t);
    t->table = Py_NewRef(table);
    t->finders = Py_NewRef(finders);
    t->slow = Py_NewRef(slow);
    t->hit = Py_NewRef(hit);
    t->miss = Py_NewRef(miss);
    t->pending = Py_NewRef(pending);
    t->ref_name = ref_name;
    t->hits = t->misses = 0;
    return 0;
}

static PyObject *tl_lookup(TieredLookup *t, PyObject *key) {
    if (t->table == NULL) {
        PyErr_SetString(PyExc_ValueError, "TieredLookup was not initialised");
        return NULL;
    }
    PyObject *status = PyDict_GetItemWithError(t->table, key); /* borrowed */
    if (status == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_ssize_t n = PyTuple_GET_SIZE(t->finders);
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t slot = find_one((Finder *)PyTuple_GET_ITEM(t->finders, i), key);
            if (slot == -2) return NULL;
            if (slot >= 0) return PyObject_CallOneArg(t->slow, key);
        }
        t->misses++;
        return Py_NewRef(t->miss);
    }
    PyObject *ref = PyObject_GetAttr(status, t->ref_name);
    if (ref == NULL) return NULL;
    long r = PyLong_AsLong(ref);
    Py_DECREF(ref);
    if (r == -1 && PyErr_Occurred()) return NULL;
    if (r < 0) return Py_NewRef(t->pending);
    t->hits++;
    return Py_NewRef(t->hit);
}

static PyObject *tl_take_counts(TieredLookup *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *counts = Py_BuildValue("(nn)", t->hits, t->misses);
    if (counts != NULL) t->hits = t->misses = 0;
    return counts;
}

static PyMethodDef tl_methods[] = {
    {"lookup", (PyCFunction)tl_lookup, METH_O, "lookup(key) -> hit, miss, pending or slow(key)."},
    {"take_counts", (PyCFunction)tl_take_counts, METH_NOARGS, "take_counts() -> (hits, misses) since last."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TieredLookupType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.tiers.fs._slotfind.TieredLookup",
    .tp_basicsize = sizeof(TieredLookup),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "TieredLookup(table, finders, slow, hit, miss, pending): a tiered manager's lookup.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)tl_init,
    .tp_dealloc = (destructor)tl_dealloc,
    .tp_traverse = (traverseproc)tl_traverse,
    .tp_clear = (inquiry)tl_clear,
    .tp_free = PyObject_GC_Del,
    .tp_methods = tl_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_slotfind", .m_doc = NULL, .m_size = -1,
};

PyMODINIT_FUNC PyInit__slotfind(void) {
    if (PyType_Ready(&FinderType) < 0 || PyType_Ready(&LinksType) < 0 || PyType_Ready(&TieredLookupType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddType(m, &FinderType) < 0 || PyModule_AddType(m, &LinksType) < 0 ||
        PyModule_AddType(m, &TieredLookupType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
