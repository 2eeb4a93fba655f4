/* kvoffload.tiers.redis._pipelines: what the extension's C files share (private).
 *
 *   _pipelines_crc.c    CRC32C
 *   _pipelines_io.c     socket I/O without the GIL: waits, vectored sends, errors as exceptions
 *   _pipelines_get.c    a load batch: GETs sent, the replies received into planned buffers and checked
 *   _pipelines_set.c    a store batch: SET NX sent from the caller's buffers, checksums, one-line replies
 *   _pipelines_queue.c  JobQueue and Completions: batches of one connection run back to back
 *   _pipelines.c        the module: the one-call batches, crc32c, the types
 *
 * A batch is prepared with the GIL (the caller's buffers held), run without it, its result
 * built with it, and released with it. */
#ifndef KVOFFLOAD_PIPELINES_H
#define KVOFFLOAD_PIPELINES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <sys/uio.h>

#if defined(__GNUC__) || defined(__clang__)
#define PRIVATE __attribute__((visibility("hidden")))
#else
#define PRIVATE
#endif

/* ---- CRC32C ---- */
PRIVATE extern uint32_t (*crc_update)(uint32_t, const unsigned char *, size_t);
PRIVATE void init_crc(void);

/* ---- socket I/O ---- */
enum { E_NONE, E_PROTOCOL, E_TIMEOUT, E_CLOSED, E_OS };
#define WINDOW 128 /* iovec entries per sendmsg / recvmsg */
PRIVATE int wait_for(int fd, short events, double timeout);
PRIVATE int send_all(int fd, double timeout, struct iovec *iov, Py_ssize_t n, int *err_no);
PRIVATE int raise_for(int error, int err_no, const char *message);

/* Called once a batch's request is sent, while its replies are on their way (may be NULL). */
typedef struct {
    void (*fn)(void *);
    void *arg;
} Sent;

/* ---- a load batch ---- */
typedef struct {
    Py_ssize_t start, head_end, end; /* offsets in the batch: region, payload, next item */
    Py_ssize_t lead;
    const unsigned char *expected, *key;
    Py_ssize_t key_len;
    unsigned char *region;  /* the received head region */
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
    Py_ssize_t n;                  /* bytes received */
    Py_ssize_t done;               /* items answered */
    int state;                     /* of item ``done`` */
    uint32_t crc;                  /* its running register over key and payload */
    Py_ssize_t crc_piece, crc_off; /* where its CRC has got to */
    Py_ssize_t stop;               /* where a reply not as planned starts, or -1 */
    int error, err_no;
    const char *message;
} Batch;

typedef struct {
    Batch b;
    Py_buffer request; /* held while request.obj is set */
    PyObject *items;   /* a copy of the plan (a tuple), kept alive: the items' bytes are read in place */
    Py_buffer *views;
    Py_ssize_t nviews, held;
    unsigned char *scratch;
} GetBatch;

PRIVATE int get_prepare(GetBatch *g, PyObject *request, PyObject *items);
PRIVATE int get_place(GetBatch *g, const unsigned char *data, Py_ssize_t len);
PRIVATE void get_run(GetBatch *g, int fd, double timeout, Sent sent);
PRIVATE int get_answered(const GetBatch *g);
PRIVATE PyObject *get_result(GetBatch *g);
PRIVATE void get_release(GetBatch *g);

/* ---- a store batch ---- */
typedef struct {
    char *buf;
    size_t cap, len, pos;   /* bytes [pos, len) are not parsed yet */
    Py_ssize_t *ends;       /* per reply parsed: where its line ends (its CRLF) */
    Py_ssize_t *starts;
    Py_ssize_t count, parsed;
    int error, err_no;
} Lines;

typedef struct {
    Py_ssize_t index, crc_at, key_len, parts;
} Checksum;

typedef struct {
    Py_buffer *views;
    Py_ssize_t n, held;
    struct iovec *iov;
    Checksum *sums;
    Py_ssize_t nsums;
    int summed; /* the checksums are filled in */
    Lines l;
} SetBatch;

PRIVATE int set_prepare(SetBatch *s, PyObject *buffers, Py_ssize_t count, PyObject *checksums);
PRIVATE int set_place(SetBatch *s, const unsigned char *data, Py_ssize_t len);
PRIVATE void set_checksums(SetBatch *s);
PRIVATE void set_run(SetBatch *s, int fd, double timeout, Sent sent);
PRIVATE int set_answered(const SetBatch *s);
PRIVATE PyObject *set_result(SetBatch *s);
PRIVATE void set_release(SetBatch *s);

/* ---- queued batches ---- */
PRIVATE extern PyTypeObject CompletionsType, JobQueueType;

#endif
