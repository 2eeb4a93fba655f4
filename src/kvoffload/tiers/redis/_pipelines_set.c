/* A store batch: SET NX commands sent from the caller's buffers (payloads as they lie)
 * with vectored writes, each value's CRC32C filled into its header first, then the
 * one-line replies a SET NX gets read; a reply of another kind is left to the caller. */
#include "_pipelines.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define MAX_LINE (1 << 16)


/* Is buf[start:end] one of the replies a SET NX gets: a status, an error or a null? */
static int one_line(const char *line, size_t n) {
    if (n >= 1 && (line[0] == '+' || line[0] == '-')) return 1;
    return (n == 3 && memcmp(line, "$-1", 3) == 0) || (n == 1 && line[0] == '_');
}

/* Parse replies until ``count`` or one that is not a one-line reply; without the GIL. */
static void read_lines(Lines *l, int fd, double timeout) {
    size_t scan = l->pos;
    while (l->parsed < l->count) {
        char *at = l->len - scan >= 2 ? memmem(l->buf + scan, l->len - scan, "\r\n", 2) : NULL;
        if (at) {
            size_t end = (size_t)(at - l->buf);
            if (!one_line(l->buf + l->pos, end - l->pos)) return; /* for the caller to read */
            l->starts[l->parsed] = (Py_ssize_t)l->pos;
            l->ends[l->parsed++] = (Py_ssize_t)end;
            l->pos = scan = end + 2;
            continue;
        }
        scan = l->len ? l->len - 1 : 0; /* a CR may be the last byte in */
        if (scan < l->pos) scan = l->pos;
        if (l->len - l->pos > MAX_LINE) return; /* not a line a SET NX gets: the caller says so */
        if (l->len == l->cap) {
            char *grown = realloc(l->buf, l->cap * 2);
            if (!grown) {
                l->error = E_OS;
                l->err_no = ENOMEM;
                return;
            }
            l->buf = grown;
            l->cap *= 2;
        }
        ssize_t got = recv(fd, l->buf + l->len, l->cap - l->len, MSG_DONTWAIT);
        if (got > 0) {
            l->len += (size_t)got;
        } else if (got == 0) {
            l->error = E_CLOSED;
            return;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int ready = wait_for(fd, POLLIN, timeout);
            if (ready <= 0) {
                l->error = ready == 0 ? E_TIMEOUT : E_OS;
                l->err_no = errno;
                return;
            }
        } else if (errno != EINTR) {
            l->error = E_OS;
            l->err_no = errno;
            return;
        }
    }
}


/* The checksums' CRC32Cs, each written where it goes; without the GIL. */
static void fill_checksums(const Checksum *sums, Py_ssize_t count, Py_buffer *views) {
    for (Py_ssize_t i = 0; i < count; i++) {
        const Checksum *c = &sums[i];
        unsigned char *framing = views[c->index].buf;
        uint32_t state = crc_update(0xFFFFFFFFu, framing + views[c->index].len - c->key_len, (size_t)c->key_len);
        for (Py_ssize_t k = 1; k <= c->parts; k++)
            state = crc_update(state, views[c->index + k].buf, (size_t)views[c->index + k].len);
        state = ~state;
        unsigned char *at = framing + c->crc_at;
        at[0] = (unsigned char)(state >> 24), at[1] = (unsigned char)(state >> 16);
        at[2] = (unsigned char)(state >> 8), at[3] = (unsigned char)state;
    }
}

/* ``checksums`` as Checksum records, checked against the ``n`` views; NULL with an
 * exception if one does not fit. */
static Checksum *parse_checksums(PyObject *checksums, Py_buffer *views, Py_ssize_t n, Py_ssize_t *count) {
    *count = PyList_GET_SIZE(checksums);
    Checksum *sums = PyMem_Calloc((size_t)*count + 1, sizeof(Checksum));
    if (!sums) return (Checksum *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < *count; i++) {
        Checksum *c = &sums[i];
        PyObject *record = PyList_GET_ITEM(checksums, i);
        if (!PyTuple_Check(record)) {
            PyErr_Format(PyExc_TypeError, "checksum %zd: expected a tuple of 4 ints", i);
            goto bad;
        }
        if (!PyArg_ParseTuple(record, "nnnn", &c->index, &c->crc_at, &c->key_len, &c->parts)) goto bad;
        if (c->index < 0 || c->parts < 0 || c->index + c->parts >= n || c->key_len < 0 ||
            c->key_len > views[c->index].len || c->crc_at < 0 || c->crc_at + 4 > views[c->index].len) {
            PyErr_Format(PyExc_ValueError, "checksum %zd: (%zd, %zd, %zd, %zd) does not fit the buffers", i,
                         c->index, c->crc_at, c->key_len, c->parts);
            goto bad;
        }
        if (views[c->index].readonly) {
            PyErr_Format(PyExc_TypeError, "checksum %zd: buffer %zd is read-only", i, c->index);
            goto bad;
        }
    }
    return sums;
bad:
    PyMem_Free(sums);
    return NULL;
}

/* Prepare the batch of ``buffers`` expecting ``count`` replies; 0, or -1 with an
 * exception (``set_release`` is due either way). With the GIL. */
int set_prepare(SetBatch *s, PyObject *buffers, Py_ssize_t count, PyObject *checksums) {
    memset(s, 0, sizeof *s);
    if (!PyList_Check(buffers) || (checksums && !PyList_Check(checksums))) {
        PyErr_SetString(PyExc_TypeError, "buffers and checksums must be lists");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(buffers);
    s->n = n;
    s->views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    s->iov = PyMem_Calloc((size_t)n + 1, sizeof(struct iovec));
    Lines *l = &s->l;
    l->count = count < 0 ? 0 : count;
    l->cap = 4096;
    l->buf = malloc(l->cap);
    l->starts = PyMem_Calloc((size_t)l->count + 1, sizeof(Py_ssize_t));
    l->ends = PyMem_Calloc((size_t)l->count + 1, sizeof(Py_ssize_t));
    if (!s->views || !s->iov || !l->buf || !l->starts || !l->ends) {
        PyErr_NoMemory();
        return -1;
    }
    for (; s->held < n; s->held++) {
        Py_ssize_t j = s->held;
        if (PyObject_GetBuffer(PyList_GET_ITEM(buffers, j), &s->views[j], PyBUF_C_CONTIGUOUS) < 0) return -1;
        s->iov[j].iov_base = s->views[j].buf;
        s->iov[j].iov_len = (size_t)s->views[j].len;
    }
    if (checksums && !(s->sums = parse_checksums(checksums, s->views, n, &s->nsums))) return -1;
    return 0;
}

/* ``data`` (bytes of the stream read already) as the first bytes of the replies. With the GIL. */
int set_place(SetBatch *s, const unsigned char *data, Py_ssize_t len) {
    Lines *l = &s->l;
    if ((size_t)len > l->cap) {
        char *grown = realloc(l->buf, (size_t)len * 2);
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        l->buf = grown;
        l->cap = (size_t)len * 2;
    }
    memcpy(l->buf, data, (size_t)len);
    l->len = (size_t)len;
    return 0;
}

/* Fill in the checksums (once); without the GIL. */
void set_checksums(SetBatch *s) {
    if (!s->summed) fill_checksums(s->sums, s->nsums, s->views);
    s->summed = 1;
}

/* Send (checksums first) and read the replies; without the GIL. */
void set_run(SetBatch *s, int fd, double timeout, Sent sent) {
    set_checksums(s);
    s->l.error = send_all(fd, timeout, s->iov, s->n, &s->l.err_no);
    if (s->l.error != E_NONE) return;
    if (sent.fn) sent.fn(sent.arg);
    read_lines(&s->l, fd, timeout);
}

/* Every reply read as a line, nothing more: the next batch may go. */
int set_answered(const SetBatch *s) {
    return s->l.error == E_NONE && s->l.parsed == s->l.count && s->l.pos == s->l.len;
}

/* ``(lines, unread)``, or NULL with the batch's exception. With the GIL. */
PyObject *set_result(SetBatch *s) {
    Lines *l = &s->l;
    if (raise_for(l->error, l->err_no, NULL)) return NULL;
    PyObject *lines = PyList_New(l->parsed);
    if (!lines) return NULL;
    for (Py_ssize_t i = 0; i < l->parsed; i++) {
        PyObject *line = PyBytes_FromStringAndSize(l->buf + l->starts[i], l->ends[i] - l->starts[i]);
        if (!line) {
            Py_DECREF(lines);
            return NULL;
        }
        PyList_SET_ITEM(lines, i, line);
    }
    return Py_BuildValue("(Ny#)", lines, l->buf + l->pos, (Py_ssize_t)(l->len - l->pos));
}

/* Give back what ``set_prepare`` took (also after it failed). With the GIL. */
void set_release(SetBatch *s) {
    for (Py_ssize_t j = 0; j < s->held; j++) PyBuffer_Release(&s->views[j]);
    PyMem_Free(s->sums);
    PyMem_Free(s->views);
    PyMem_Free(s->iov);
    PyMem_Free(s->l.starts);
    PyMem_Free(s->l.ends);
    free(s->l.buf);
    memset(s, 0, sizeof *s);
}
