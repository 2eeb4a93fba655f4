/* kvoffload.tiers.redis._pipelines: the shared tier worker's two hot batches
 * (kvoffload.tiers.redis.pipelines), each sent and answered on one release of the GIL
 * (optional: without it the same runs in Python, which takes the GIL back per socket call).
 *
 * Both take ``fd``, a connected stream socket, and ``timeout``, the seconds each wait on it
 * may take (< 0: no limit). Both raise ``TimeoutError``, ``ConnectionError`` (the peer
 * closed) or ``OSError``; after any exception the connection's state is unknown.
 *
 *   get_into(fd, timeout, request, buffered, items, turns=None) -> (results, unread[, passed])
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
 *   set_nx(fd, timeout, buffers, buffered, count, checksums=[], turns=None) -> (lines, unread[, passed])
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
 *   Turns(): the order of the batches of one connection that several threads drive
 *       (kvoffload.tiers.redis.lanes). Given as the last argument ``turns`` of either batch,
 *       the call takes a ticket, waits without the GIL for the batches before it (a store's
 *       CRC32Cs are filled in first), runs, and passes the turn on the moment its batch is
 *       answered in full; it then also returns ``passed``: ``False`` when it stopped early
 *       and kept the turn (the caller reads the rest and calls ``release()``). On any
 *       exception the call breaks the turns; a call whose turn never came because they
 *       broke raises ``TurnLost`` (nothing was sent). ``acquire()``/``release(broken)``
 *       take and end a turn from Python; ``broken``; ``behind``: calls that came while
 *       another had the turn.
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* ---- CRC32C (Castagnoli, reflected 0x82F63B78) ---------------------------------------- */

static uint32_t table[256];

static uint32_t crc_table(uint32_t state, const unsigned char *p, size_t n) {
    while (n--) state = table[(state ^ *p++) & 0xff] ^ (state >> 8);
    return state;
}

static uint32_t (*crc_update)(uint32_t, const unsigned char *, size_t) = crc_table;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define STREAM 2048 /* bytes per stream of a three-stream step */
/* shift[s][k][v]: the register (v << 8k) after s+1 streams of zeros, for joining streams */
static uint32_t shift[2][4][256];

__attribute__((target("sse4.2"))) static uint32_t zeros(uint32_t state, size_t n) {
    uint64_t s = state;
    for (size_t i = 0; i < n; i += 8) s = _mm_crc32_u64(s, 0);
    return (uint32_t)s;
}

static inline uint32_t shifted(uint32_t (*t)[256], uint32_t x) {
    return t[0][x & 0xff] ^ t[1][(x >> 8) & 0xff] ^ t[2][(x >> 16) & 0xff] ^ t[3][x >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_sse(uint32_t state, const unsigned char *p, size_t n) {
    uint64_t c0 = state;
    while (n && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        n--;
    }
    /* The register update is linear, so three streams run at once (the instruction's
     * latency is three times its throughput) and are joined: the first two are moved past
     * the bytes after them (a table look-up per register byte) and XORed in. */
    while (n >= 3 * STREAM) {
        uint64_t c1 = 0, c2 = 0, a, b, c;
        for (size_t i = 0; i < STREAM; i += 8) {
            memcpy(&a, p + i, 8);
            memcpy(&b, p + STREAM + i, 8);
            memcpy(&c, p + 2 * STREAM + i, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, c);
        }
        c0 = shifted(shift[1], (uint32_t)c0) ^ shifted(shift[0], (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * STREAM;
        n -= 3 * STREAM;
    }
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        c0 = _mm_crc32_u64(c0, a);
    }
    while (n--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return (uint32_t)c0;
}

static void init_sse(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) return;
    for (int s = 0; s < 2; s++) {
        uint32_t basis[32];
        for (int bit = 0; bit < 32; bit++) basis[bit] = zeros(1u << bit, (size_t)(s + 1) * STREAM);
        for (int k = 0; k < 4; k++)
            for (int v = 0; v < 256; v++) {
                uint32_t x = 0;
                for (int bit = 0; bit < 8; bit++)
                    if (v >> bit & 1) x ^= basis[8 * k + bit];
                shift[s][k][v] = x;
            }
    }
    crc_update = crc_sse;
}
#else
static void init_sse(void) {}
#endif

static void init_crc(void) {
    for (uint32_t v = 0; v < 256; v++) {
        uint32_t x = v;
        for (int bit = 0; bit < 8; bit++) x = (x >> 1) ^ (0x82F63B78u & (0u - (x & 1)));
        table[v] = x;
    }
    init_sse();
}

/* ---- turns: batches of one connection run back to back, in the order they came --------- */

/* A ``Turns`` orders the batches of one connection driven by several threads: a batch takes
 * a ticket when it is called (with the GIL), waits for its turn without the GIL, runs, and
 * passes the turn on as soon as its last reply is in, still without the GIL, so the next
 * batch, already planned and waiting in C, is sent at once: no Python between them. A batch
 * that fails breaks the turns: every later one is refused unsent (``TurnLost``). */
typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned long long next, serving;
    unsigned long long behind; /* tickets taken while another batch had the turn */
    int broken;
} Turns;

static PyObject *TurnLost;
static PyTypeObject TurnsType;

static PyObject *turns_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Turns *t = (Turns *)type->tp_alloc(type, 0);
    if (!t) return NULL;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    return (PyObject *)t;
}

static void turns_dealloc(Turns *t) {
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static unsigned long long turn_take(Turns *t) {
    pthread_mutex_lock(&t->mu);
    unsigned long long ticket = t->next++;
    t->behind += ticket != t->serving;
    pthread_mutex_unlock(&t->mu);
    return ticket;
}

/* Wait for ``ticket``'s turn (without the GIL): 1, or 0 if the turns broke first (the
 * ticket is then spent: it is passed over). */
static int turn_wait(Turns *t, unsigned long long ticket) {
    pthread_mutex_lock(&t->mu);
    while (t->serving != ticket && !t->broken) pthread_cond_wait(&t->cv, &t->mu);
    int ok = !t->broken;
    pthread_mutex_unlock(&t->mu);
    return ok;
}

/* The holder's turn ends: the next ticket's begins (``broken``: no later batch may run). */
static void turn_pass(Turns *t, int broken) {
    pthread_mutex_lock(&t->mu);
    t->serving++;
    t->broken |= broken;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

static PyObject *turns_acquire(Turns *t, PyObject *unused) {
    unsigned long long ticket = turn_take(t);
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = turn_wait(t, ticket);
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_SetString(TurnLost, "an earlier batch on this connection failed: this one was not sent");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *turns_release(Turns *t, PyObject *args) {
    int broken = 0;
    if (!PyArg_ParseTuple(args, "|p", &broken)) return NULL;
    turn_pass(t, broken);
    Py_RETURN_NONE;
}

static PyObject *turns_broken(Turns *t, void *closure) {
    pthread_mutex_lock(&t->mu);
    int broken = t->broken;
    pthread_mutex_unlock(&t->mu);
    return PyBool_FromLong(broken);
}

static PyMethodDef turns_methods[] = {
    {"acquire", (PyCFunction)turns_acquire, METH_NOARGS,
     "Take a ticket and wait for its turn (without the GIL); TurnLost if the turns broke."},
    {"release", (PyCFunction)turns_release, METH_VARARGS,
     "release(broken=False): end the holder's turn; broken: refuse every later batch."},
    {NULL, NULL, 0, NULL},
};

static PyObject *turns_behind(Turns *t, void *closure) {
    pthread_mutex_lock(&t->mu);
    unsigned long long behind = t->behind;
    pthread_mutex_unlock(&t->mu);
    return PyLong_FromUnsignedLongLong(behind);
}

static PyGetSetDef turns_getset[] = {
    {"behind", (getter)turns_behind, NULL, "Batches that came while another had the turn (queued behind it).",
     NULL},
    {"broken", (getter)turns_broken, NULL, "Whether a batch failed: later ones are refused.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TurnsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.tiers.redis._pipelines.Turns",
    .tp_basicsize = sizeof(Turns),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The turns of the batches of one connection (see the module's comment).",
    .tp_new = turns_new,
    .tp_dealloc = (destructor)turns_dealloc,
    .tp_methods = turns_methods,
    .tp_getset = turns_getset,
};

/* The optional ``turns`` argument: NULL for None; -1 with an exception for another type. */
static int as_turns(PyObject *arg, Turns **out) {
    *out = NULL;
    if (arg == NULL || arg == Py_None) return 0;
    if (!PyObject_TypeCheck(arg, &TurnsType)) {
        PyErr_Format(PyExc_TypeError, "turns must be a Turns or None, got %.80s", Py_TYPE(arg)->tp_name);
        return -1;
    }
    *out = (Turns *)arg;
    return 0;
}

/* ---- the planned receive --------------------------------------------------------------- */

enum { HEAD, PAYLOAD }; /* the state of the item being received */
enum { GOOD = 1, BAD_CRC = 0, BAD_HEAD = -1 };
enum { E_NONE, E_PROTOCOL, E_TIMEOUT, E_CLOSED, E_OS };
#define WINDOW 128 /* iovec entries per recvmsg */
#define CRC_FIELD 8

typedef struct {
    Py_ssize_t start, head_end, end; /* offsets in the batch: region, payload, next item */
    Py_ssize_t lead;
    const unsigned char *expected, *key;
    Py_ssize_t key_len;
    unsigned char *region;    /* the received head region */
    Py_ssize_t first_piece; /* its region's piece; payload pieces follow */
    uint32_t recorded;
    int result;
} Item;

typedef struct {
    struct iovec *pieces;
    Py_ssize_t *piece_start; /* each piece's offset in the batch */
    Py_ssize_t npieces, total;
    Item *items;
    Py_ssize_t nitems;
    unsigned char tail[2];
    /* progress */
    Py_ssize_t n;       /* bytes received */
    Py_ssize_t done;    /* items answered */
    int state;          /* of item ``done`` */
    uint32_t crc;       /* its running register over key and payload */
    Py_ssize_t crc_piece, crc_off; /* where its CRC has got to */
    Py_ssize_t stop;    /* where a reply not as planned starts, or -1 */
    int error, err_no;
    const char *message;
} Batch;

/* 0: the first ``got`` bytes of item i's lead are as planned; 1: another reply starts at
 * the item's start (+ the previous value's CRLF); -1: not RESP. */
static int surprised(Batch *b, Py_ssize_t i, Py_ssize_t got) {
    Item *it = &b->items[i];
    Py_ssize_t crlf = got < (i ? 2 : 0) ? got : (i ? 2 : 0);
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
static void place(Batch *b, const unsigned char *data, Py_ssize_t len) {
    for (Py_ssize_t k = 0; k < b->npieces && b->n < len; k++) {
        Py_ssize_t m = (Py_ssize_t)b->pieces[k].iov_len;
        if (m > len - b->n) m = len - b->n;
        memcpy(b->pieces[k].iov_base, data + b->n, (size_t)m);
        b->n += m;
    }
}

static int wait_for(int fd, short events, double timeout) {
    int ms = timeout < 0 ? -1 : (timeout * 1000.0 > INT_MAX ? INT_MAX : (int)(timeout * 1000.0 + 0.999));
    struct pollfd p = {fd, events, 0};
    for (;;) {
        int r = poll(&p, 1, ms);
        if (r >= 0) return r;
        if (errno != EINTR) return -1;
    }
}

/* Send the buffers ``iov[0:n]`` whole (the array is consumed); E_NONE or why not. Without the GIL. */
static int send_all(int fd, double timeout, struct iovec *iov, Py_ssize_t n, int *err_no) {
    Py_ssize_t k = 0;
    while (k < n && iov[k].iov_len == 0) k++;
    while (k < n) {
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov + k;
        msg.msg_iovlen = (size_t)(n - k < WINDOW ? n - k : WINDOW);
        ssize_t r = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int ready = wait_for(fd, POLLOUT, timeout);
                if (ready > 0) continue;
                *err_no = errno;
                return ready == 0 ? E_TIMEOUT : E_OS;
            }
            *err_no = errno;
            return E_OS;
        }
        while (r > 0) {
            if ((size_t)r >= iov[k].iov_len) {
                r -= (ssize_t)iov[k].iov_len;
                k++;
            } else {
                iov[k].iov_base = (char *)iov[k].iov_base + r;
                iov[k].iov_len -= (size_t)r;
                r = 0;
            }
        }
        while (k < n && iov[k].iov_len == 0) k++;
    }
    return E_NONE;
}

/* Send the request, then receive; runs without the GIL. */
static void run(Batch *b, int fd, double timeout, const char *request, Py_ssize_t request_len) {
    struct iovec whole = {(void *)request, (size_t)request_len};
    b->error = send_all(fd, timeout, &whole, 1, &b->err_no);
    if (b->error != E_NONE) return;
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

/* Sets the exception for ``error`` (1), or returns 0 for E_NONE. With the GIL. */
static int raise_for(int error, int err_no, const char *message) {
    switch (error) {
    case E_PROTOCOL:
        PyErr_SetString(PyExc_ValueError, message);
        return 1;
    case E_TIMEOUT:
        PyErr_SetString(PyExc_TimeoutError, "timed out");
        return 1;
    case E_CLOSED:
        PyErr_SetString(PyExc_ConnectionError, "the server closed the connection");
        return 1;
    case E_OS:
        errno = err_no;
        PyErr_SetFromErrno(PyExc_OSError);
        return 1;
    }
    return 0;
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

static PyObject *get_into(PyObject *self, PyObject *args) {
    int fd;
    double timeout;
    Py_buffer request, buffered;
    PyObject *items, *turns_arg = NULL;
    Turns *turns;
    if (!PyArg_ParseTuple(args, "idy*y*O!|O", &fd, &timeout, &request, &buffered, &PyList_Type, &items, &turns_arg))
        return NULL;
    if (as_turns(turns_arg, &turns) < 0) {
        PyBuffer_Release(&request);
        PyBuffer_Release(&buffered);
        return NULL;
    }
    int turn = 1, passed = 0, held_turn = 0; /* held_turn: this call has the turn and must pass it on */
    unsigned long long ticket = 0;
    Py_ssize_t nitems = PyList_GET_SIZE(items), nviews = 0, regions = 0;
    PyObject *result = NULL;
    Py_buffer *views = NULL;
    Batch b;
    memset(&b, 0, sizeof b);
    b.stop = -1;
    unsigned char *scratch = NULL;

    /* plan: count pieces, check the items' shapes */
    for (Py_ssize_t i = 0; i < nitems; i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4 || !PyBytes_Check(PyTuple_GET_ITEM(item, 0)) ||
            !PyLong_Check(PyTuple_GET_ITEM(item, 1)) || !PyBytes_Check(PyTuple_GET_ITEM(item, 2)) ||
            !PyList_Check(PyTuple_GET_ITEM(item, 3))) {
            PyErr_Format(PyExc_TypeError, "item %zd: expected (bytes, int, bytes, list of buffers)", i);
            goto done;
        }
        nviews += PyList_GET_SIZE(PyTuple_GET_ITEM(item, 3));
        regions += PyBytes_GET_SIZE(PyTuple_GET_ITEM(item, 0));
    }
    b.items = PyMem_Calloc((size_t)nitems + 1, sizeof(Item));
    b.pieces = PyMem_Calloc((size_t)(nitems + nviews + 1), sizeof(struct iovec));
    b.piece_start = PyMem_Calloc((size_t)(nitems + nviews + 1), sizeof(Py_ssize_t));
    views = PyMem_Calloc((size_t)nviews + 1, sizeof(Py_buffer));
    scratch = PyMem_Malloc((size_t)regions + 1);
    if (!b.items || !b.pieces || !b.piece_start || !views || !scratch) {
        PyErr_NoMemory();
        goto done;
    }
    b.nitems = nitems;
    Py_ssize_t at = 0, held = 0;
    unsigned char *region = scratch;
    for (Py_ssize_t i = 0; i < nitems; i++) {
        PyObject *item = PyList_GET_ITEM(items, i), *expected = PyTuple_GET_ITEM(item, 0);
        PyObject *key = PyTuple_GET_ITEM(item, 2), *rows = PyTuple_GET_ITEM(item, 3);
        Item *it = &b.items[i];
        it->expected = (const unsigned char *)PyBytes_AS_STRING(expected);
        it->key = (const unsigned char *)PyBytes_AS_STRING(key);
        it->key_len = PyBytes_GET_SIZE(key);
        it->lead = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
        Py_ssize_t head = PyBytes_GET_SIZE(expected);
        if (it->lead < 0 || it->lead + CRC_FIELD + 4 > head) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "item %zd: lead %zd does not fit its %zd planned bytes", i, it->lead,
                             head);
            goto done;
        }
        it->region = region;
        it->start = at;
        it->first_piece = b.npieces;
        b.pieces[b.npieces].iov_base = region;
        b.pieces[b.npieces].iov_len = (size_t)head;
        b.piece_start[b.npieces++] = at;
        region += head;
        at += head;
        it->head_end = at;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(rows); j++) {
            Py_buffer *view = &views[held];
            if (PyObject_GetBuffer(PyList_GET_ITEM(rows, j), view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
            held++;
            if (!view->len) continue;
            b.pieces[b.npieces].iov_base = view->buf;
            b.pieces[b.npieces].iov_len = (size_t)view->len;
            b.piece_start[b.npieces++] = at;
            at += view->len;
        }
        it->end = at;
    }
    b.pieces[b.npieces].iov_base = b.tail;
    b.pieces[b.npieces].iov_len = 2;
    b.piece_start[b.npieces++] = at;
    b.total = at + 2;
    if (buffered.len > b.total) {
        PyErr_Format(PyExc_ValueError, "%zd bytes buffered for a batch of %zd", buffered.len, b.total);
        goto done;
    }

    if (turns) ticket = turn_take(turns);
    Py_BEGIN_ALLOW_THREADS
    place(&b, buffered.buf, buffered.len);
    if (turns) turn = turn_wait(turns, ticket);
    if (turn) run(&b, fd, timeout, request.buf, request.len);
    if (turns && turn && b.error == E_NONE && b.stop < 0) {
        turn_pass(turns, 0); /* answered in full: the next batch goes now */
        passed = 1;
    }
    Py_END_ALLOW_THREADS
    held_turn = turns && turn && !passed;

    if (!turn) {
        PyErr_SetString(TurnLost, "an earlier batch on this connection failed: this one was not sent");
        goto done;
    }
    if (raise_for(b.error, b.err_no, b.message)) goto done;
    PyObject *results = PyList_New(b.done);
    if (!results) goto done;
    for (Py_ssize_t i = 0; i < b.done; i++) {
        Item *it = &b.items[i];
        PyObject *r;
        if (it->result == BAD_HEAD)
            r = PyBytes_FromStringAndSize((char *)it->region + it->lead, it->head_end - it->start - it->lead);
        else
            r = Py_NewRef(it->result == GOOD ? Py_True : Py_False);
        if (!r) {
            Py_DECREF(results);
            goto done;
        }
        PyList_SET_ITEM(results, i, r);
    }
    PyObject *unread = b.stop >= 0 ? unread_bytes(&b, b.stop) : PyBytes_FromStringAndSize("", 0);
    if (!unread) {
        Py_DECREF(results);
        goto done;
    }
    result = turns ? Py_BuildValue("(NNO)", results, unread, passed ? Py_True : Py_False)
                   : Py_BuildValue("(NN)", results, unread);

done:
    if (held_turn && !result) turn_pass(turns, 1); /* failed on its turn: no later batch may run */
    if (views)
        for (Py_ssize_t j = 0; j < nviews; j++)
            if (views[j].obj) PyBuffer_Release(&views[j]);
    PyBuffer_Release(&request);
    PyBuffer_Release(&buffered);
    PyMem_Free(views);
    PyMem_Free(scratch);
    PyMem_Free(b.items);
    PyMem_Free(b.pieces);
    PyMem_Free(b.piece_start);
    return result;
}

/* ---- a store batch: vectored send, one-line replies ---------------------------------------- */

#define MAX_LINE (1 << 16)

typedef struct {
    char *buf;
    size_t cap, len, pos; /* bytes [pos, len) are not parsed yet */
    Py_ssize_t *ends;       /* per reply parsed: where its line ends (its CRLF) */
    Py_ssize_t *starts;
    Py_ssize_t count, parsed;
    int error, err_no;
} Lines;

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

typedef struct {
    Py_ssize_t index, crc_at, key_len, parts;
} Checksum;

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

static PyObject *set_nx(PyObject *self, PyObject *args) {
    int fd;
    double timeout;
    Py_buffer buffered;
    PyObject *buffers, *checksums = NULL, *result = NULL, *turns_arg = NULL;
    Py_ssize_t count, nsums = 0;
    Checksum *sums = NULL;
    Turns *turns;
    if (!PyArg_ParseTuple(args, "idO!y*n|O!O", &fd, &timeout, &PyList_Type, &buffers, &buffered, &count,
                          &PyList_Type, &checksums, &turns_arg))
        return NULL;
    if (as_turns(turns_arg, &turns) < 0) {
        PyBuffer_Release(&buffered);
        return NULL;
    }
    int turn = 1, passed = 0, held_turn = 0; /* held_turn: this call has the turn and must pass it on */
    unsigned long long ticket = 0;
    Py_ssize_t n = PyList_GET_SIZE(buffers), held = 0;
    Py_buffer *views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc((size_t)n + 1, sizeof(struct iovec));
    Lines l;
    memset(&l, 0, sizeof l);
    l.count = count < 0 ? 0 : count;
    l.cap = buffered.len > 4096 ? (size_t)buffered.len * 2 : 4096;
    l.buf = malloc(l.cap);
    l.starts = PyMem_Calloc((size_t)l.count + 1, sizeof(Py_ssize_t));
    l.ends = PyMem_Calloc((size_t)l.count + 1, sizeof(Py_ssize_t));
    if (!views || !iov || !l.buf || !l.starts || !l.ends) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(buffers, held), &views[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
        iov[held].iov_base = views[held].buf;
        iov[held].iov_len = (size_t)views[held].len;
    }
    if (checksums && !(sums = parse_checksums(checksums, views, n, &nsums))) goto done;
    memcpy(l.buf, buffered.buf, (size_t)buffered.len);
    l.len = (size_t)buffered.len;
    if (turns) ticket = turn_take(turns);
    Py_BEGIN_ALLOW_THREADS
    fill_checksums(sums, nsums, views); /* while the batch before it is still on the wire */
    if (turns) turn = turn_wait(turns, ticket);
    if (turn) {
        l.error = send_all(fd, timeout, iov, n, &l.err_no);
        if (l.error == E_NONE) read_lines(&l, fd, timeout);
        if (turns && l.error == E_NONE && l.parsed == l.count && l.pos == l.len) {
            turn_pass(turns, 0); /* answered in full, nothing more read: the next batch goes now */
            passed = 1;
        }
    }
    Py_END_ALLOW_THREADS
    held_turn = turns && turn && !passed;
    if (!turn) {
        PyErr_SetString(TurnLost, "an earlier batch on this connection failed: this one was not sent");
        goto done;
    }
    if (raise_for(l.error, l.err_no, NULL)) goto done;
    PyObject *lines = PyList_New(l.parsed);
    if (!lines) goto done;
    for (Py_ssize_t i = 0; i < l.parsed; i++) {
        PyObject *line = PyBytes_FromStringAndSize(l.buf + l.starts[i], l.ends[i] - l.starts[i]);
        if (!line) {
            Py_DECREF(lines);
            goto done;
        }
        PyList_SET_ITEM(lines, i, line);
    }
    result = turns ? Py_BuildValue("(Ny#O)", lines, l.buf + l.pos, (Py_ssize_t)(l.len - l.pos),
                                   passed ? Py_True : Py_False)
                   : Py_BuildValue("(Ny#)", lines, l.buf + l.pos, (Py_ssize_t)(l.len - l.pos));

done:
    if (held_turn && !result) turn_pass(turns, 1); /* failed on its turn: no later batch may run */
    for (Py_ssize_t j = 0; j < held; j++) PyBuffer_Release(&views[j]);
    PyBuffer_Release(&buffered);
    PyMem_Free(sums);
    PyMem_Free(views);
    PyMem_Free(iov);
    PyMem_Free(l.starts);
    PyMem_Free(l.ends);
    free(l.buf);
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
    if (PyType_Ready(&TurnsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    TurnLost = PyErr_NewExceptionWithDoc("kvoffload.tiers.redis._pipelines.TurnLost",
                                         "A batch refused unsent: an earlier one on its connection failed.",
                                         PyExc_ConnectionError, NULL);
    if (!TurnLost || PyModule_AddObjectRef(m, "TurnLost", TurnLost) < 0 ||
        PyModule_AddObjectRef(m, "Turns", (PyObject *)&TurnsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
