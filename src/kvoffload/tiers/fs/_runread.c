/* kvoffload.tiers.fs._runread: the payloads of a run of disk-tier slots read into host
 * rows and checked, without the GIL.
 *
 *   read_run(header_fd, data_fd, first, keys, blocks, digest, version, payload, offset, stride)
 *       -> (done, status, value)
 *
 * Slot ``first + i`` holds ``keys[i]`` (bytes): its header record (``header_fd``, at
 * ``(first + i) * 128``; the records of the run in one read) must be valid for that key,
 * ``digest`` (the namespace's 16 bytes), format ``version`` and ``payload`` bytes, then its
 * payload (``data_fd`` at ``offset + i * stride``) is read into ``blocks[i]`` (a list of
 * writable byte buffers holding ``payload`` bytes: the block's host rows, in order) with
 * ``preadv`` (short reads continued, ``EINTR`` retried), and its CRC32C, computed while the
 * bytes are still in the CPU cache, must be the record's. It stops at the first block that
 * does not check out. ``done``: the blocks read and checked before it stopped (all when
 * ``status`` is 0); ``status`` 1: block ``done``'s payload ended early, ``value`` the bytes
 * read; 2: its checksum is ``value``; 3: a read failed with errno ``value``; 4: its record
 * is not valid for it (the caller re-reads it to say why). Bad arguments raise
 * (``ValueError``, ``TypeError``) before anything is read.
 *
 *   crc32c(data, crc=0) -> int     the checksum above over one buffer, continuing ``crc``
 *
 * Why C: the disk tier's read threads run beside the engine's thread, which holds the GIL
 * while it prepares a step. Every GIL hand-back (after each ``preadv``, each checksum call)
 * can then wait for the engine's switch interval; here a run costs one, and its records
 * are checked without a Python object per block.
 *
 * CRC32C: kvoffload/_crc32c.h (SSE4.2 where the CPU has it, a byte table elsewhere).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#include "../../_crc32c.h"

static crc32c_fn crc_run = crc32c_bytes;

/* Reads ``want`` bytes at ``at`` into ``count`` buffers from ``iov`` (modified). Returns
 * the bytes read (fewer at end of file) or -errno. */
static long read_full(int fd, struct iovec *iov, int count, off_t at, size_t want) {
    size_t got = 0;
    while (got < want) {
        ssize_t n = preadv(fd, iov, count > IOV_MAX ? IOV_MAX : count, at + (off_t)got);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -(long)errno;
        }
        if (n == 0) break;
        got += (size_t)n;
        while (count && (size_t)n >= iov->iov_len) { /* drop the buffers filled, trim the next */
            n -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count && n) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return (long)got;
}

/* A header record (kvoffload.tiers.fs.format, little-endian): magic, version, key length,
 * payload length, payload CRC, flags, clock, namespace digest, key, padding; its own CRC
 * over the first RECORD_BODY bytes at RECORD_BODY. */
#define RECORD_BYTES 128
#define RECORD_BODY 124
#define DIGEST_BYTES 16
#define MAX_KEY 64

static uint32_t crc_of(const unsigned char *p, size_t n) { return ~crc_run(0xFFFFFFFFu, p, n); }

/* Whether ``raw`` is a valid record of ``key`` (``key_len`` bytes) in namespace ``digest``
 * for a payload of ``payload`` bytes; its payload CRC in ``*crc``. */
static int record_ok(const unsigned char *raw, const char *key, size_t key_len, const char *digest,
                     unsigned version, uint64_t payload, uint32_t *crc) {
    uint16_t ver, klen;
    uint64_t plen;
    uint32_t stored;
    if (memcmp(raw, "KVOB", 4) != 0) return 0;
    memcpy(&ver, raw + 4, 2);
    memcpy(&klen, raw + 6, 2);
    memcpy(&plen, raw + 8, 8);
    memcpy(crc, raw + 16, 4);
    memcpy(&stored, raw + RECORD_BODY, 4);
    return crc_of(raw, RECORD_BODY) == stored && ver == version && klen == key_len && plen == payload &&
           memcmp(raw + 32, digest, DIGEST_BYTES) == 0 && memcmp(raw + 32 + DIGEST_BYTES, key, key_len) == 0;
}

static PyObject *read_run(PyObject *self, PyObject *args) {
    (void)self;
    int header_fd, data_fd;
    unsigned version;
    long long first, offset, stride, payload;
    PyObject *keys_arg, *blocks_arg;
    Py_buffer digest;
    if (!PyArg_ParseTuple(args, "iiLOOy*ILLL", &header_fd, &data_fd, &first, &keys_arg, &blocks_arg, &digest,
                          &version, &payload, &offset, &stride))
        return NULL;
    PyObject *result = NULL, *keys = NULL, *blocks = NULL, **lists = NULL;
    Py_buffer *views = NULL;
    struct iovec *iov = NULL;
    Py_ssize_t *ends = NULL, nviews = 0, nblocks = 0;
    unsigned char *records = NULL;
    const char **key_at = NULL;
    size_t *key_len = NULL;
    if (first < 0 || offset < 0 || stride < payload || payload <= 0 || digest.len != DIGEST_BYTES) {
        PyErr_Format(PyExc_ValueError, "bad run: first slot %lld, offset %lld, stride %lld, payload %lld, digest of %zd bytes",
                     first, offset, stride, payload, digest.len);
        goto done;
    }
    /* a tuple of its own: the keys' bytes are read without the GIL, while the caller's list may change */
    keys = PySequence_Tuple(keys_arg);
    blocks = keys ? PySequence_Fast(blocks_arg, "blocks must be a sequence of buffer lists") : NULL;
    if (blocks == NULL) goto done;
    nblocks = PySequence_Fast_GET_SIZE(blocks);
    if (PySequence_Fast_GET_SIZE(keys) != nblocks) {
        PyErr_Format(PyExc_ValueError, "%zd blocks but %zd keys", nblocks, PySequence_Fast_GET_SIZE(keys));
        goto done;
    }
    /* Every offset the run reads at, records and payloads, must be a file offset: computed
     * below in signed 64 bits, where an overflow is undefined. */
    if (first > LLONG_MAX / RECORD_BYTES - nblocks || offset > LLONG_MAX - payload ||
        (nblocks > 1 && stride > (LLONG_MAX - payload - offset) / (nblocks - 1))) {
        PyErr_Format(PyExc_ValueError, "bad run: %zd slots from slot %lld (offset %lld, stride %lld) end past the largest file offset",
                     nblocks, first, offset, stride);
        goto done;
    }
    size_t n = (size_t)nblocks + 1;
    lists = PyMem_Calloc(n, sizeof(PyObject *));
    ends = PyMem_Calloc(n, sizeof(Py_ssize_t));
    key_at = PyMem_Calloc(n, sizeof(char *));
    key_len = PyMem_Calloc(n, sizeof(size_t));
    records = PyMem_Malloc(n * RECORD_BYTES);
    if (!lists || !ends || !key_at || !key_len || !records) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < 1 || PyBytes_GET_SIZE(key) > MAX_KEY) {
            PyErr_Format(PyExc_ValueError, "key %zd must be 1..%d bytes, got %R", i, MAX_KEY, key);
            goto done;
        }
        key_at[i] = PyBytes_AS_STRING(key);
        key_len[i] = (size_t)PyBytes_GET_SIZE(key);
        lists[i] = PySequence_Fast(PySequence_Fast_GET_ITEM(blocks, i), "each block must be a list of buffers");
        if (lists[i] == NULL) goto done;
        total += PySequence_Fast_GET_SIZE(lists[i]);
    }
    views = PyMem_Calloc((size_t)total + 1, sizeof(Py_buffer));
    iov = PyMem_Calloc((size_t)total + 1, sizeof(struct iovec));
    if (views == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        Py_ssize_t count = PySequence_Fast_GET_SIZE(lists[i]), bytes = 0;
        for (Py_ssize_t j = 0; j < count; j++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(lists[i], j), &views[nviews], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
                goto done;
            bytes += views[nviews++].len;
        }
        if (bytes != payload) {
            PyErr_Format(PyExc_ValueError, "block %zd's buffers hold %zd bytes, the payload is %lld", i, bytes, payload);
            goto done;
        }
        ends[i] = nviews;
    }
    Py_ssize_t ok = 0;
    int status = 0;
    long long value = 0;
    const char *dig = digest.buf;
    Py_BEGIN_ALLOW_THREADS
    struct iovec whole = {records, (size_t)nblocks * RECORD_BYTES};
    long got = read_full(header_fd, &whole, 1, (off_t)(first * RECORD_BYTES), whole.iov_len);
    if (got < 0) {
        status = 3;
        value = -got;
    }
    for (Py_ssize_t start = 0; !status && ok < nblocks; ok++) {
        Py_ssize_t stop = ends[ok];
        uint32_t expected;
        if ((size_t)got < (size_t)(ok + 1) * RECORD_BYTES ||
            !record_ok(records + ok * RECORD_BYTES, key_at[ok], key_len[ok], dig, version, (uint64_t)payload, &expected)) {
            status = 4;
            break;
        }
        for (Py_ssize_t j = start; j < stop; j++) {
            iov[j].iov_base = views[j].buf;
            iov[j].iov_len = (size_t)views[j].len;
        }
        long read = read_full(data_fd, iov + start, (int)(stop - start), (off_t)(offset + ok * stride), (size_t)payload);
        if (read < 0) {
            status = 3;
            value = -read;
            break;
        }
        if (read != payload) {
            status = 1;
            value = read;
            break;
        }
        uint32_t c = 0xFFFFFFFFu;
        for (Py_ssize_t j = start; j < stop; j++) c = crc_run(c, views[j].buf, (size_t)views[j].len);
        if (~c != expected) {
            status = 2;
            value = (long long)(uint32_t)~c;
            break;
        }
        start = stop;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(niL)", ok, status, value);
done:
    for (Py_ssize_t j = 0; j < nviews; j++) PyBuffer_Release(&views[j]);
    if (lists != NULL)
        for (Py_ssize_t i = 0; i < nblocks; i++) Py_XDECREF(lists[i]);
    PyMem_Free(lists);
    PyMem_Free(views);
    PyMem_Free(iov);
    PyMem_Free(ends);
    PyMem_Free(key_at);
    PyMem_Free(key_len);
    PyMem_Free(records);
    Py_XDECREF(keys);
    Py_XDECREF(blocks);
    PyBuffer_Release(&digest);
    return result;
}

static PyObject *crc32c(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &data, &crc)) return NULL;
    uint32_t c = ~(uint32_t)crc;
    Py_BEGIN_ALLOW_THREADS
    c = crc_run(c, data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(~c);
}

static PyMethodDef methods[] = {
    {"read_run", read_run, METH_VARARGS, "Read a run of slots into buffers and check each record and CRC32C."},
    {"crc32c", crc32c, METH_VARARGS, "CRC32C of a buffer, continuing crc."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_runread", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__runread(void) {
    crc_run = crc32c_init();
    return PyModule_Create(&module);
}
