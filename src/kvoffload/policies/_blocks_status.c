/* kvoffload.policies._blocks: the BlockStatus type (see _blocks.c for the contracts). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "_blocks.h"

PyTypeObject StatusType;
static PyObject *ref_name, *slot_name;

/* The object whose ``ref`` attribute holds the state, or NULL where the field does. */
static PyObject *holder(PyObject *s) {
    if (!EXACT(s)) return s;
    return ((Status *)s)->target;
}

long get_ref(PyObject *s) {
    PyObject *obj = holder(s);
    if (obj == NULL) return ((Status *)s)->ref;
    PyObject *value = PyObject_GetAttr(obj, ref_name);
    if (value == NULL) return -2;
    long r = PyLong_AsLong(value);
    Py_DECREF(value);
    return (r == -1 && PyErr_Occurred()) ? -2 : r;
}

int set_ref(PyObject *s, long r) {
    PyObject *obj = holder(s);
    if (obj == NULL) {
        ((Status *)s)->ref = r;
        return 0;
    }
    PyObject *value = PyLong_FromLong(r);
    if (value == NULL) return -1;
    int rc = PyObject_SetAttr(obj, ref_name, value);
    Py_DECREF(value);
    return rc;
}

PyObject *proxy_for(PyObject *status) {
    Status *p = (Status *)StatusType.tp_alloc(&StatusType, 0);
    if (p == NULL) return NULL;
    p->slot = p->ref = -1;
    Py_INCREF(status);
    p->target = status;
    return (PyObject *)p;
}

static int Status_init(Status *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"slot", "ref", NULL};
    PyObject *slot, *ref = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:BlockStatus", names, &slot, &ref)) return -1;
    if (EXACT(self)) {
        Py_ssize_t s = PyNumber_AsSsize_t(slot, PyExc_OverflowError);
        long r = ref == NULL ? -1 : PyLong_AsLong(ref);
        if (PyErr_Occurred()) return -1;
        self->slot = s;
        self->ref = r;
        return 0;
    }
    self->ref = -1;
    if (PyObject_SetAttr((PyObject *)self, slot_name, slot) < 0) return -1;
    if (ref == NULL) return set_ref((PyObject *)self, -1);
    return PyObject_SetAttr((PyObject *)self, ref_name, ref);
}

static void Status_dealloc(Status *self) {
    Py_CLEAR(self->key);
    Py_CLEAR(self->target);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Status_repr(PyObject *self) {
    long r = get_ref(self);
    if (r == -2 && PyErr_Occurred()) return NULL;
    return PyUnicode_FromFormat("BlockStatus(slot=%zd, ref=%ld)", ((Status *)self)->slot, r);
}

static PyObject *Status_is_ready(PyObject *self, void *closure) {
    long r = get_ref(self);
    if (r == -2 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(r >= 0);
}

static PyObject *Status_get_ref(PyObject *self, void *closure) {
    long r = get_ref(self);
    return r == -2 && PyErr_Occurred() ? NULL : PyLong_FromLong(r);
}

static int Status_set_ref(PyObject *self, PyObject *value, void *closure) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete ref");
        return -1;
    }
    long r = PyLong_AsLong(value);
    return r == -1 && PyErr_Occurred() ? -1 : set_ref(self, r);
}

static PyMemberDef Status_members[] = {
    {"slot", T_PYSSIZET, offsetof(Status, slot), 0, "the block's slot in its tier (-1 for a proxy)"},
    {NULL},
};

static PyGetSetDef Status_getset[] = {
    {"ref", Status_get_ref, Status_set_ref, "-1 being written, 0 idle, n > 0 pinned n times", NULL},
    {"is_ready", Status_is_ready, NULL, "ref >= 0", NULL},
    {NULL},
};

int status_type_ready(void) {
    StatusType = (PyTypeObject){
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.policies._blocks.BlockStatus",
        .tp_basicsize = sizeof(Status),
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
        .tp_doc = "A block's slot in its tier and its state: -1 being written, 0 idle, n>0 pinned.",
        .tp_new = PyType_GenericNew,
        .tp_init = (initproc)Status_init,
        .tp_dealloc = (destructor)Status_dealloc,
        .tp_repr = Status_repr,
        .tp_members = Status_members,
        .tp_getset = Status_getset,
    };
    ref_name = PyUnicode_InternFromString("ref");
    slot_name = PyUnicode_InternFromString("slot");
    if (ref_name == NULL || slot_name == NULL) return -1;
    return PyType_Ready(&StatusType);
}
