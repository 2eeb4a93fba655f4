/* kvoffload.transfer._rowcopy: many host-memory byte ranges copied in one call.
 *
 * copy_runs(dst, src, dst_offsets, src_offsets, lengths, count, stream) -> None
 *   For i < count: copy lengths[i] bytes from src + src_offsets[i] to dst + dst_offsets[i].
 *   stream (bool): write ranges of STREAM_MIN bytes and more with streaming stores.
 *   dst and src are addresses (ints); the three arrays are addresses of int64 arrays of
 *   ``count`` entries. Ranges must not overlap one another or themselves; the caller
 *   (kvoffload.transfer.row_plan) guarantees that and that every range lies inside memory
 *   it holds. Runs without the GIL.
 *
 * Why not numpy: a copy between rows scattered on both sides is one numpy call per row,
 * and plain stores make the CPU read every destination line before writing it (a third of
 * the memory traffic of a copy). With ``stream`` on x86-64, a range of at least STREAM_MIN
 * bytes is written with non-temporal (streaming) stores, which skip that read; the
 * destination then does not stay in cache: right for a store into the host pool (read
 * again much later, if ever), wrong for a load into KV the engine reads next. Otherwise,
 * and for small ranges, memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

#define STREAM_MIN 4096

#if HAVE_STREAM
static void stream_copy(char *dst, const char *src, size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst & 15); /* bytes until dst is 16-byte aligned */
    if (head) {
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
    }
    size_t body = n & ~(size_t)63;
    for (size_t k = 0; k < body; k += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + k));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + k + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + k + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + k + 48));
        _mm_stream_si128((__m128i *)(dst + k), a);
        _mm_stream_si128((__m128i *)(dst + k + 16), b);
        _mm_stream_si128((__m128i *)(dst + k + 32), c);
        _mm_stream_si128((__m128i *)(dst + k + 48), d);
    }
    if (n > body) memcpy(dst + body, src + body, n - body);
}
#endif

static void copy_all(char *dst, const char *src, const int64_t *dst_off, const int64_t *src_off,
                     const int64_t *len, Py_ssize_t count, int stream) {
#if HAVE_STREAM
    int streamed = 0;
#else
    (void)stream;
#endif
    for (Py_ssize_t i = 0; i < count; i++) {
        size_t n = (size_t)len[i];
#if HAVE_STREAM
        if (stream && n >= STREAM_MIN) {
            stream_copy(dst + dst_off[i], src + src_off[i], n);
            streamed = 1;
            continue;
        }
#endif
        memcpy(dst + dst_off[i], src + src_off[i], n);
    }
#if HAVE_STREAM
    if (streamed) _mm_sfence(); /* streaming stores are weakly ordered: publish them */
#endif
}

static PyObject *copy_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "copy_runs takes 7 arguments, got %zd", nargs);
        return NULL;
    }
    void *ptr[5];
    for (int i = 0; i < 5; i++) {
        ptr[i] = PyLong_AsVoidPtr(args[i]);
        if (ptr[i] == NULL && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[5]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "copy_runs: count must be >= 0, got %zd", count);
        return NULL;
    }
    int stream = PyObject_IsTrue(args[6]);
    if (stream < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    copy_all((char *)ptr[0], (const char *)ptr[1], (const int64_t *)ptr[2], (const int64_t *)ptr[3],
             (const int64_t *)ptr[4], count, stream);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_runs", (PyCFunction)(void (*)(void))copy_runs, METH_FASTCALL,
     "copy_runs(dst, src, dst_offsets, src_offsets, lengths, count, stream): copy byte ranges."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", HAVE_STREAM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
