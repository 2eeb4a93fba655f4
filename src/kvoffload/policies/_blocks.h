/* Shared by _blocks.c (the Order type, the module), _blocks_status.c (BlockStatus) and
 * _blocks_table.c (the manager's batch paths), _blocks_moves.c (moves between orders),
 * _blocks_s3fifo.c (S3-FIFO), _blocks_turnlru.c (the turn-aware LRU), _blocks_wtinylfu.c
 * (W-TinyLFU and its frequency sketch). */
#ifndef KVOFFLOAD_BLOCKS_H
#define KVOFFLOAD_BLOCKS_H
#include <Python.h>

typedef struct Status {
    PyObject_HEAD
    Py_ssize_t slot;
    long ref;
    PyObject *key;              /* strong while linked */
    struct Status *prev, *next; /* the order holds a reference to each linked status */
    PyObject *owner;            /* borrowed: the Order it is linked in, or NULL */
    PyObject *target;           /* a proxy's: the status object it stands for, else NULL */
    long birth, used;           /* the turn-aware LRU's: level stored at, time of last use */
} Status;

typedef struct {
    PyObject_HEAD
    PyObject *table; /* dict key -> Status */
    Status *head, *tail;
} Order;

extern PyTypeObject StatusType, OrderType;
#define EXACT(s) Py_IS_TYPE((PyObject *)(s), &StatusType)

/* The state of a status: its field, or the ``ref`` attribute of a subclass or of a proxy's
 * target; -2 with an error set. ``set_ref`` writes it the same way. */
long get_ref(PyObject *s);
int set_ref(PyObject *s, long r);
int status_type_ready(void); /* the type, ready; -1 with an error set */
/* A new BlockStatus standing for ``status`` (any object with ``ref``): what orders link
 * in its place. */
PyObject *proxy_for(PyObject *status);

/* The order's list (in _blocks.c): ``s`` (not linked) to the most recent end under ``key``;
 * a linked ``s`` to the most recent end; ``key``'s entry out of the order (1 removed, 0
 * absent, -1 error). */
void link_tail(Order *o, Status *s, PyObject *key);
void detach(Order *o, Status *s); /* out of the list, its links left for the caller */
void to_tail(Order *o, Status *s);
void to_head(Order *o, Status *s); /* a linked ``s`` to the least recent end */
/* ``s`` (``key``'s, linked in ``src``) to the most recent end of ``dst``, keeping its links'
 * references; 0, or -1 with an error set (nothing moved). */
int move_status(Order *dst, Order *src, Status *s, PyObject *key);
/* The next status from ``s`` on (inclusive) that is idle and not in ``protected``; NULL at the
 * end (check PyErr_Occurred). */
Status *next_idle(Status *s, PyObject *protected);
int remove_key(Order *o, PyObject *key);
/* ``key`` -> ``status`` entered as ``insert_many`` does (0, or -1 with an error set). */
int order_insert(Order *o, PyObject *key, PyObject *status);
/* ``key in collection`` (1, 0, or -1 with an error set). */
int contains(PyObject *collection, PyObject *key);
/* Up to ``limit`` keys of ``o``, least recent first, idle and not in ``protected`` (a new list). */
PyObject *evictable(Order *o, Py_ssize_t limit, PyObject *protected);

/* Order methods moving keys between orders (in _blocks_moves.c). */
PyObject *Order_take_from(Order *o, PyObject *args);
PyObject *Order_trim(Order *o, PyObject *bound);
PyObject *Order_arc_touch(Order *t1, PyObject *args);
PyObject *Order_arc_insert(Order *t1, PyObject *args);
PyObject *Order_arc_evict(Order *t1, PyObject *args);

/* S3-FIFO's paths (in _blocks_s3fifo.c), module functions. */
PyObject *s3fifo_insert(PyObject *module, PyObject *args);
PyObject *s3fifo_evict(PyObject *module, PyObject *args);
PyObject *bump(PyObject *module, PyObject *args);

/* The turn-aware LRU's paths (in _blocks_turnlru.c), module functions. */
PyObject *turn_touch(PyObject *module, PyObject *args);
PyObject *turn_insert(PyObject *module, PyObject *args);
PyObject *turn_raise(PyObject *module, PyObject *args);
PyObject *turn_evict(PyObject *module, PyObject *args);

/* W-TinyLFU's (in _blocks_wtinylfu.c): the Sketch type (made ready by ``sketch_type_ready``,
 * -1 with an error set) and module functions. */
extern PyTypeObject SketchType;
int sketch_type_ready(void);
PyObject *wtinylfu_touch(PyObject *module, PyObject *args);
PyObject *wtinylfu_evict(PyObject *module, PyObject *args);

PyObject *lookup_prefix(PyObject *module, PyObject *args);
PyObject *pin(PyObject *module, PyObject *args);
PyObject *unpin(PyObject *module, PyObject *args);
PyObject *complete(PyObject *module, PyObject *args);
PyObject *reserve(PyObject *module, PyObject *args);
PyObject *absent(PyObject *module, PyObject *args);
PyObject *release(PyObject *module, PyObject *args);
#endif
