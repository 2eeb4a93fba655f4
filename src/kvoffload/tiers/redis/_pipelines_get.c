/* A load batch: the GETs sent whole, then the replies received as planned, each value's
 * header and key into a scratch region and its payload by the kernel straight into the
 * caller's rows, checked as they come (header, key, namespace digest; CRC32C as the bytes
 * arrive). The first reply not as planned (a null, an error, another length) ends the batch
 * as soon as a byte differs; the bytes from it on are handed back (``unread``). */
#include "_pipelines.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

enum { HEAD, PAYLOAD }; /* the state of the item being received */
enum { GOOD = 1, BAD_CRC = 0, BAD_HEAD = -1 };
#define CRC_FIELD 8

/* 0: the first ``got`` bytes of item i's lead are as planned; 1: another reply starts at
 * the item's start (+ the previous value's CRLF); -1: not RESP. The previous value's CRLF
 * is judged once both its bytes are in, as the reply-by-reply reader (``RespStream``) does:
 * a connection closed after the first is a closed connection either way. */
static int surprised(Batch *b, Py_ssize_t i, Py_ssize_t got) {
    Item *it = &b->items[i];
    Py_ssize_t crlf = i ? 2 : 0;
    if (got < crlf) return 0;
    if (memcmp(it->region, it->expected, crlf) != 0) {
        b->error = E_PROTOCOL;
        b->message = "a bulk string not followed by CRLF";
        return -1;
    }
    if (memcmp(it->region + crlf, it->expected + crlf, got - crlf) != 0) {
        b->stop = it->start + crlf;
        return 1;
    }
    return 0;
}

/* CRC of item ``done``'s payload up to byte ``upto`` of the batch. */
static void crc_advance(Batch *b, Py_ssize_t upto) {
    while (b->crc_piece < b->npieces && b->piece_start[b->crc_piece] + b->crc_off < upto) {
        struct iovec *piece = &b->pieces[b->crc_piece];
        Py_ssize_t have = upto - b->piece_start[b->crc_piece];
        if (have > (Py_ssize_t)piece->iov_len) have = (Py_ssize_t)piece->iov_len;
        b->crc = crc_update(b->crc, (unsigned char *)piece->iov_base + b->crc_off, (size_t)(have - b->crc_off));
        b->crc_off = have;
        if (have == (Py_ssize_t)piece->iov_len) {
            b->crc_piece++;
            b->crc_off = 0;
        }
    }
}

/* Check what has arrived; 1 when the batch is over (answered, stopped or failed). */
static int check(Batch *b) {
    Py_ssize_t n = b->n;
    while (b->done < b->nitems) {
        Py_ssize_t i = b->done;
        Item *it = &b->items[i];
        if (b->state == HEAD) {
            Py_ssize_t head = it->head_end - it->start;
            if (n < it->head_end) {
                Py_ssize_t got = n - it->start < it->lead ? n - it->start : it->lead;
                return got > 0 && surprised(b, i, got) != 0;
            }
            Py_ssize_t at = it->lead + CRC_FIELD;
            if (memcmp(it->region, it->expected, at) == 0 &&
                memcmp(it->region + at + 4, it->expected + at + 4, head - at - 4) == 0) {
                const unsigned char *r = it->region + at;
                it->recorded = (uint32_t)r[0] << 24 | (uint32_t)r[1] << 16 | (uint32_t)r[2] << 8 | r[3];
                it->result = GOOD;
                b->crc = crc_update(0xFFFFFFFFu, it->key, (size_t)it->key_len);
            } else {
                if (surprised(b, i, it->lead) != 0) return 1;
                it->result = BAD_HEAD;
            }
            b->state = PAYLOAD;
            b->crc_piece = it->first_piece + 1;
            b->crc_off = 0;
        }
        if (it->result == GOOD) crc_advance(b, n < it->end ? n : it->end);
        if (n < it->end) return 0;
        if (it->result == GOOD && ~b->crc != it->recorded) it->result = BAD_CRC;
        b->state = HEAD;
        b->done++;
    }
    if (n < b->total) return 0;
    if (b->tail[0] != '\r' || b->tail[1] != '\n') {
        b->error = E_PROTOCOL;
        b->message = "a bulk string not followed by CRLF";
    }
    return 1;
}

/* Place bytes [0, len) as the batch's first bytes. */
static void place_bytes(Batch *b, const unsigned char *data, Py_ssize_t len) {
    for (Py_ssize_t k = 0; k < b->npieces && b->n < len; k++) {
        Py_ssize_t m = (Py_ssize_t)b->pieces[k].iov_len;
        if (m > len - b->n) m = len - b->n;
        memcpy(b->pieces[k].iov_base, data + b->n, (size_t)m);
        b->n += m;
    }
}

/* Send the request, then receive; without the GIL. */
static void receive(Batch *b, int fd, double timeout, const char *request, Py_ssize_t request_len, Sent sent) {
    struct iovec whole = {(void *)request, (size_t)request_len};
    b->error = send_all(fd, timeout, &whole, 1, &b->err_no);
    if (b->error != E_NONE) return;
    if (sent.fn) sent.fn(sent.arg);
    Py_ssize_t k = 0;
    while (k < b->npieces && b->n >= b->piece_start[k] + (Py_ssize_t)b->pieces[k].iov_len) k++;
    while (!(b->n && check(b)) && b->error == E_NONE) {
        if (b->n == b->total) break; /* check() saw it all (an empty first check aside) */
        struct iovec window[WINDOW];
        int count = 0;
        for (Py_ssize_t j = k; j < b->npieces && count < WINDOW; j++, count++) window[count] = b->pieces[j];
        Py_ssize_t off = b->n - b->piece_start[k];
        window[0].iov_base = (char *)window[0].iov_base + off;
        window[0].iov_len -= (size_t)off;
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = window;
        msg.msg_iovlen = (size_t)count;
        ssize_t got = recvmsg(fd, &msg, MSG_DONTWAIT);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int r = wait_for(fd, POLLIN, timeout);
                if (r == 0) b->error = E_TIMEOUT;
                else if (r < 0) b->error = E_OS, b->err_no = errno;
                continue;
            }
            b->error = E_OS;
            b->err_no = errno;
            break;
        }
        if (got == 0) {
            b->error = E_CLOSED;
            break;
        }
        b->n += got;
        while (k < b->npieces && b->n >= b->piece_start[k] + (Py_ssize_t)b->pieces[k].iov_len) k++;
    }
}

/* The bytes [from, n) of the batch. */
static PyObject *unread_bytes(Batch *b, Py_ssize_t from) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, b->n - from);
    if (!out) return NULL;
    char *dst = PyBytes_AS_STRING(out);
    for (Py_ssize_t k = 0; k < b->npieces; k++) {
        Py_ssize_t lo = b->piece_start[k], hi = lo + (Py_ssize_t)b->pieces[k].iov_len;
        if (hi > b->n) hi = b->n;
        if (lo < from) lo = from;
        if (lo >= hi) continue;
        memcpy(dst, (char *)b->pieces[k].iov_base + (lo - b->piece_start[k]), (size_t)(hi - lo));
        dst += hi - lo;
    }
    return out;
}

/* Plan the batch of ``items`` (see the module's get_into); 0, or -1 with an exception
 * (``get_release`` is due either way). With the GIL. */
int get_prepare(GetBatch *g, PyObject *request, PyObject *items) {
    Batch *b = &g->b;
    memset(g, 0, sizeof *g);
    b->stop = -1;
    if (!PyList_Check(items)) {
        PyErr_Format(PyExc_TypeError, "items must be a list, got %.80s", Py_TYPE(items)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(request, &g->request, PyBUF_SIMPLE) < 0) return -1;
    /* A copy of the plan: the batch reads its items' bytes in place without the GIL (and a
     * queued batch long after this call), while the caller's list may be changed meanwhile;
     * the copy's tuples keep each item's bytes alive. */
    if (!(g->items = PyList_AsTuple(items))) return -1;
    items = g->items;
    Py_ssize_t nitems = PyTuple_GET_SIZE(items), nviews = 0, regions = 0;
    for (Py_ssize_t i = 0; i < nitems; i++) {
        PyObject *item = PyTuple_GET_ITEM(items, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4 || !PyBytes_Check(PyTuple_GET_ITEM(item, 0)) ||
            !PyLong_Check(PyTuple_GET_ITEM(item, 1)) || !PyBytes_Check(PyTuple_GET_ITEM(item, 2)) ||
            !PyList_Check(PyTuple_GET_ITEM(item, 3))) {
            PyErr_Format(PyExc_TypeError, "item %zd: expected (bytes, int, bytes, list of buffers)", i);
            return -1;
        }
        nviews += PyList_GET_SIZE(PyTuple_GET_ITEM(item, 3));
        regions += PyBytes_GET_SIZE(PyTuple_GET_ITEM(item, 0));
    }
    b->items = PyMem_Calloc((size_t)nitems + 1, sizeof(Item));
    b->pieces = PyMem_Calloc((size_t)(nitems + nviews + 1), sizeof(struct iovec));
    b->piece_start = PyMem_Calloc((size_t)(nitems + nviews + 1), sizeof(Py_ssize_t));
    g->views = PyMem_Calloc((size_t)nviews + 1, sizeof(Py_buffer));
    g->scratch = PyMem_Malloc((size_t)regions + 1);
    g->nviews = nviews;
    if (!b->items || !b->pieces || !b->piece_start || !g->views || !g->scratch) {
        PyErr_NoMemory();
        return -1;
    }
    b->nitems = nitems;
    Py_ssize_t at = 0;
    unsigned char *region = g->scratch;
    for (Py_ssize_t i = 0; i < nitems; i++) {
        PyObject *item = PyTuple_GET_ITEM(items, i), *expected = PyTuple_GET_ITEM(item, 0);
        PyObject *key = PyTuple_GET_ITEM(item, 2), *rows = PyTuple_GET_ITEM(item, 3);
        Item *it = &b->items[i];
        it->expected = (const unsigned char *)PyBytes_AS_STRING(expected);
        it->key = (const unsigned char *)PyBytes_AS_STRING(key);
        it->key_len = PyBytes_GET_SIZE(key);
        it->lead = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
        Py_ssize_t head = PyBytes_GET_SIZE(expected);
        if (it->lead < 0 || it->lead + CRC_FIELD + 4 > head) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "item %zd: lead %zd does not fit its %zd planned bytes", i, it->lead,
                             head);
            return -1;
        }
        it->region = region;
        it->start = at;
        it->first_piece = b->npieces;
        b->pieces[b->npieces].iov_base = region;
        b->pieces[b->npieces].iov_len = (size_t)head;
        b->piece_start[b->npieces++] = at;
        region += head;
        at += head;
        it->head_end = at;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(rows); j++) {
            if (g->held == g->nviews) { /* a row list grew since they were counted: never past the views */
                PyErr_Format(PyExc_ValueError, "item %zd: its rows changed while the batch was planned", i);
                return -1;
            }
            Py_buffer *view = &g->views[g->held];
            if (PyObject_GetBuffer(PyList_GET_ITEM(rows, j), view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
                return -1;
            g->held++;
            if (!view->len) continue;
            b->pieces[b->npieces].iov_base = view->buf;
            b->pieces[b->npieces].iov_len = (size_t)view->len;
            b->piece_start[b->npieces++] = at;
            at += view->len;
        }
        it->end = at;
    }
    b->pieces[b->npieces].iov_base = b->tail;
    b->pieces[b->npieces].iov_len = 2;
    b->piece_start[b->npieces++] = at;
    b->total = at + 2;
    return 0;
}

/* ``data`` (bytes of the stream read already) as the batch's first bytes; -1 with an
 * exception if there are more than the batch takes. With the GIL. */
int get_place(GetBatch *g, const unsigned char *data, Py_ssize_t len) {
    if (len > g->b.total) {
        PyErr_Format(PyExc_ValueError, "%zd bytes buffered for a batch of %zd", len, g->b.total);
        return -1;
    }
    place_bytes(&g->b, data, len);
    return 0;
}

/* Send and receive; without the GIL. */
void get_run(GetBatch *g, int fd, double timeout, Sent sent) {
    receive(&g->b, fd, timeout, g->request.buf, g->request.len, sent);
}

/* Answered in full, as planned (per item checked or not): the next batch may go. */
int get_answered(const GetBatch *g) { return g->b.error == E_NONE && g->b.stop < 0; }

/* ``(results, unread)``, or NULL with the batch's exception. With the GIL. */
PyObject *get_result(GetBatch *g) {
    Batch *b = &g->b;
    if (raise_for(b->error, b->err_no, b->message)) return NULL;
    PyObject *results = PyList_New(b->done);
    if (!results) return NULL;
    for (Py_ssize_t i = 0; i < b->done; i++) {
        Item *it = &b->items[i];
        PyObject *r;
        if (it->result == BAD_HEAD)
            r = PyBytes_FromStringAndSize((char *)it->region + it->lead, it->head_end - it->start - it->lead);
        else
            r = Py_NewRef(it->result == GOOD ? Py_True : Py_False);
        if (!r) {
            Py_DECREF(results);
            return NULL;
        }
        PyList_SET_ITEM(results, i, r);
    }
    PyObject *unread = b->stop >= 0 ? unread_bytes(b, b->stop) : PyBytes_FromStringAndSize("", 0);
    if (!unread) {
        Py_DECREF(results);
        return NULL;
    }
    return Py_BuildValue("(NN)", results, unread);
}

/* Give back what ``get_prepare`` took (also after it failed). With the GIL. */
void get_release(GetBatch *g) {
    for (Py_ssize_t j = 0; j < g->held; j++) PyBuffer_Release(&g->views[j]);
    if (g->request.obj) PyBuffer_Release(&g->request);
    Py_CLEAR(g->items);
    PyMem_Free(g->views);
    PyMem_Free(g->scratch);
    PyMem_Free(g->b.items);
    PyMem_Free(g->b.pieces);
    PyMem_Free(g->b.piece_start);
    memset(g, 0, sizeof *g);
}
