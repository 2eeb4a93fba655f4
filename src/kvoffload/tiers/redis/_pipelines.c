/* kvoffload.tiers.redis._pipelines, the module (its parts: _pipelines.h): the shared tier worker's two hot
 * batches (kvoffload.tiers.redis.pipelines), each sent and answered on one release of the GIL
 * (optional: without it the same runs in Python, which takes the GIL back per socket call).
 *
 * Both take ``fd``, a connected stream socket, and ``timeout``, the seconds each wait on it
 * may take (< 0: no limit). Both raise ``TimeoutError``, ``ConnectionError`` (the peer
 * closed) or ``OSError``; after any exception the connection's state is unknown.
 *
 *   get_into(fd, timeout, request, buffered, items) -> (results, unread)
 *       Sends ``request`` (the batch's GET commands) whole, then receives the replies:
 *       ``buffered`` (bytes of the stream already read) first. ``items``: per value
 *       ``(expected, lead, key, rows)``: ``expected`` the bytes planned before its payload
 *       (its lead ``[\r\n]$<length>\r\n``, the value's header with a zero CRC field at
 *       ``lead + 8``, its key), ``rows`` the writable buffers its payload fills, in order
 *       (the kernel writes it there). A last region takes the final CRLF.
 *       Per item answered, in order: ``True`` (all as planned, and the CRC32C of key and
 *       payload is the recorded one), ``False`` (CRC32C mismatch) or ``bytes`` (a value of
 *       the planned length whose head differs: its header and key, for the caller to say
 *       why). The first reply whose lead is not the planned one (a null, an error, another
 *       length) ends the batch as soon as a byte differs: ``unread`` holds the bytes
 *       received from its start on (the rest is still on the socket), ``results`` is
 *       shorter than ``items``. ``ValueError`` for bytes that are not RESP (a bulk string
 *       not followed by CRLF). Rows of items not answered ``True`` hold unspecified bytes.
 *
 *   set_nx(fd, timeout, buffers, buffered, count, checksums=[]) -> (lines, unread)
 *       Sends ``buffers`` (the batch's SET commands, payloads as they lie) in order with
 *       vectored writes, then reads up to ``count`` replies, ``buffered`` first. Each of
 *       ``checksums``, ``(index, crc_at, key_len, parts)``, is first filled in, on the same
 *       release of the GIL: the CRC32C of the last ``key_len`` bytes of ``buffers[index]``
 *       (a writable buffer: a value's framing, ending in its header and key) and of the
 *       ``parts`` buffers after it (its payload) goes there at ``crc_at``, big-endian. ``lines``
 *       holds each one-line reply a SET NX gets (a status ``+..``, an error ``-..``, a
 *       null ``$-1`` or ``_``) without its CRLF; it stops at the first reply of another
 *       kind (a RESP3 push, say) or past 64 KiB without a line end, and ``unread`` holds
 *       the bytes from there on (or after the last reply), for the caller to read.
 *
 *   JobQueue(completions), Completions(): the batches of one connection queued by any
 *       thread and run back to back by the one that serves it, without the GIL between
 *       them (kvoffload.tiers.redis.lanes; see _pipelines_queue.c).
 *
 *   crc32c(data, crc=0) -> int
 *       The CRC32C ``get_into`` checks with (SSE4.2 on x86-64 where the CPU has it, three
 *       streams at once; a table otherwise), continuing ``crc``; for tests.
 *
 * Why C: a busy Python thread (an engine's loop) holds the GIL, and each time a transfer
 * thread gave it up for a socket call it waited up to the switch interval to get it back.
 * With one spinning thread in the process, 64 KiB loads went from 0.37x (Python receive)
 * to 0.65x of redis-benchmark's GET; on a quiet machine both run at about its speed. The
 * stores' CRC32Cs are computed here for the same reason: in Python they held the GIL
 * (about 11 us per 256 KiB value); with a spinning thread, 256 KiB stores went from 0.79x
 * to 0.86x of redis-benchmark's SET.
 */
#include "_pipelines.h"

static PyObject *get_into(PyObject *self, PyObject *args) {
    int fd;
    double timeout;
    Py_buffer buffered;
    PyObject *request, *items, *result = NULL;
    if (!PyArg_ParseTuple(args, "idOy*O!", &fd, &timeout, &request, &buffered, &PyList_Type, &items)) return NULL;
    GetBatch g;
    if (get_prepare(&g, request, items) == 0 && get_place(&g, buffered.buf, buffered.len) == 0) {
        Sent none = {NULL, NULL};
        Py_BEGIN_ALLOW_THREADS
        get_run(&g, fd, timeout, none);
        Py_END_ALLOW_THREADS
        result = get_result(&g);
    }
    get_release(&g);
    PyBuffer_Release(&buffered);
    return result;
}

static PyObject *set_nx(PyObject *self, PyObject *args) {
    int fd;
    double timeout;
    Py_buffer buffered;
    PyObject *buffers, *checksums = NULL, *result = NULL;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "idO!y*n|O!", &fd, &timeout, &PyList_Type, &buffers, &buffered, &count, &PyList_Type,
                          &checksums))
        return NULL;
    SetBatch s;
    if (set_prepare(&s, buffers, count, checksums) == 0 && set_place(&s, buffered.buf, buffered.len) == 0) {
        Sent none = {NULL, NULL};
        Py_BEGIN_ALLOW_THREADS
        set_run(&s, fd, timeout, none);
        Py_END_ALLOW_THREADS
        result = set_result(&s);
    }
    set_release(&s);
    PyBuffer_Release(&buffered);
    return result;
}

static PyObject *crc32c(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &data, &crc)) return NULL;
    uint32_t state = ~(uint32_t)crc;
    Py_BEGIN_ALLOW_THREADS
    state = crc_update(state, data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(~state);
}

static PyMethodDef methods[] = {
    {"get_into", get_into, METH_VARARGS, "A batch of GETs; the replies received into the caller's buffers, checked."},
    {"set_nx", set_nx, METH_VARARGS, "A batch of SET NX sent from the caller's buffers; their one-line replies."},
    {"crc32c", crc32c, METH_VARARGS, "CRC32C of a buffer, continuing crc."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pipelines", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pipelines(void) {
    init_crc();
    if (PyType_Ready(&CompletionsType) < 0 || PyType_Ready(&JobQueueType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Completions", (PyObject *)&CompletionsType) < 0 ||
        PyModule_AddObjectRef(m, "JobQueue", (PyObject *)&JobQueueType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
