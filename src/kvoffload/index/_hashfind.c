/* kvoffload.index._hashfind: the /query_by_hash hot path in C (optional; the index works
 * the same without it, in numpy).
 *
 *   parse_hashes(raw) -> bytearray | None
 *       ``raw``: the JSON text of one value (bytes-like). If it is an array of integers,
 *       each in [-2**63, 2**64), the uint64 values in native byte order (negatives as two's
 *       complement, as ``kvoffload.index.requests.hash_array`` does); ``None`` for anything
 *       else (null, a float, a string, an integer out of range, bad JSON): the caller then
 *       decodes the text the slow way, which names the problem.
 *
 *   find(keys, hashes, shift, out) -> found
 *       ``BlockTable._find`` of ``kvoffload.index.table``: ``keys`` is the table's key array
 *       (uint64, buckets x 8, C-contiguous), ``hashes`` the uint64 keys to find, ``out`` an
 *       intp array as long as ``hashes``, filled with each key's flat slot or -1. A key is
 *       looked for in bucket ``(h * M1) >> shift``, then ``(h * M2) >> shift``: the same
 *       buckets and constants as the numpy code. Returns how many were found.
 *
 * The GIL is held throughout (the table may change between calls, never during one).
 *
 * Why C: for a 2,048-block query msgspec spent about 100 us making 2,048 Python ints and
 * ``array('Q')`` another 50 us packing them (35 us here, from the raw text msgspec skips
 * over in 25 us), and the numpy probe, a dozen passes over temporaries, 110 us.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WAYS 8
static const uint64_t M1 = 0x9E3779B97F4A7C15ull;
static const uint64_t M2 = 0xC2B2AE3D27D4EB4Full;

static inline const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

/* One JSON integer at *pp; 0 on success (value in *out), -1 if not an integer in range. */
static int parse_one(const char **pp, const char *end, uint64_t *out) {
    const char *p = *pp;
    int negative = 0;
    if (p < end && *p == '-') {
        negative = 1;
        p++;
    }
    if (p >= end || *p < '0' || *p > '9') return -1;
    if (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9') return -1; /* no leading zeros in JSON */
    uint64_t value = 0;
    const char *start = p;
    /* 19 digits cannot overflow; a 20th is checked; a 21st always overflows */
    while (p < end && p - start < 19 && *p >= '0' && *p <= '9') value = value * 10 + (uint64_t)(*p++ - '0');
    if (p < end && *p >= '0' && *p <= '9') {
        uint64_t digit = (uint64_t)(*p++ - '0');
        if (value > (UINT64_MAX - digit) / 10) return -1; /* past 2**64 - 1 */
        value = value * 10 + digit;
        if (p < end && *p >= '0' && *p <= '9') return -1;
    }
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) return -1; /* a float */
    if (negative) {
        if (value > ((uint64_t)1 << 63)) return -1; /* below -2**63 */
        value = (uint64_t)0 - value;
    }
    *out = value;
    *pp = p;
    return 0;
}

static PyObject *parse_hashes(PyObject *self, PyObject *arg) {
    Py_buffer raw;
    if (PyObject_GetBuffer(arg, &raw, PyBUF_SIMPLE) < 0) return NULL;
    const char *p = (const char *)raw.buf, *end = p + raw.len;
    /* grown by doubling as values parse: memory follows what parsed, not the body's size */
    Py_ssize_t capacity = 2048;
    PyObject *result = PyByteArray_FromStringAndSize(NULL, capacity * (Py_ssize_t)sizeof(uint64_t));
    if (result == NULL) {
        PyBuffer_Release(&raw);
        return NULL;
    }
    uint64_t *values = (uint64_t *)PyByteArray_AS_STRING(result);
    Py_ssize_t n = 0;
    int ok = 0, failed = 0;
    p = skip_ws(p, end);
    if (p < end && *p == '[') {
        p = skip_ws(p + 1, end);
        if (p < end && *p == ']') {
            ok = 1;
            p++;
        } else {
            while (1) {
                if (n == capacity) {
                    capacity *= 2;
                    if (PyByteArray_Resize(result, capacity * (Py_ssize_t)sizeof(uint64_t)) < 0) {
                        failed = 1;
                        break;
                    }
                    values = (uint64_t *)PyByteArray_AS_STRING(result);
                }
                if (parse_one(&p, end, &values[n]) < 0) break;
                n++;
                p = skip_ws(p, end);
                if (p < end && *p == ',') {
                    p = skip_ws(p + 1, end);
                    continue;
                }
                if (p < end && *p == ']') {
                    ok = 1;
                    p++;
                }
                break;
            }
        }
        if (ok && skip_ws(p, end) != end) ok = 0; /* text after the array */
    }
    PyBuffer_Release(&raw);
    if (failed) { /* out of memory: the error is set */
        Py_DECREF(result);
        return NULL;
    }
    if (!ok) {
        Py_DECREF(result);
        Py_RETURN_NONE;
    }
    if (PyByteArray_Resize(result, n * (Py_ssize_t)sizeof(uint64_t)) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

static PyObject *find(PyObject *self, PyObject *args) {
    PyObject *keys_obj, *hashes_obj, *out_obj;
    unsigned int shift;
    if (!PyArg_ParseTuple(args, "OOIO", &keys_obj, &hashes_obj, &shift, &out_obj)) return NULL;
    if (shift == 0 || shift > 63) {
        PyErr_Format(PyExc_ValueError, "shift must be in 1..63, got %u", shift);
        return NULL;
    }
    Py_buffer keys, hashes, out;
    if (PyObject_GetBuffer(keys_obj, &keys, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(hashes_obj, &hashes, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&hashes);
        PyBuffer_Release(&keys);
        return NULL;
    }
    Py_ssize_t n = hashes.len / (Py_ssize_t)sizeof(uint64_t);
    uint64_t buckets = (uint64_t)(keys.len / (Py_ssize_t)(WAYS * sizeof(uint64_t)));
    PyObject *result = NULL;
    if (keys.len % (Py_ssize_t)(WAYS * sizeof(uint64_t)) || hashes.len % (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "keys must be whole buckets of 8 uint64, hashes uint64");
    } else if (out.len != n * (Py_ssize_t)sizeof(Py_ssize_t)) {
        PyErr_Format(PyExc_ValueError, "out must hold %zd intp, it holds %zd bytes", n, out.len);
    } else if (buckets != (uint64_t)1 << (64 - shift)) { /* every bucket index must lie in the table */
        PyErr_Format(PyExc_ValueError, "%llu buckets do not match shift %u", (unsigned long long)buckets, shift);
    } else if ((uintptr_t)keys.buf % sizeof(uint64_t)) { /* the table's own array: aligned by numpy */
        PyErr_SetString(PyExc_ValueError, "keys must be aligned to 8 bytes");
    } else {
        const uint64_t *table = (const uint64_t *)keys.buf;
        /* hashes and out are the caller's: read and written with memcpy, aligned or not (a
         * misaligned load is undefined; on x86-64 this is the same one instruction) */
        const char *h = (const char *)hashes.buf;
        char *pos = (char *)out.buf;
        Py_ssize_t found = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t key;
            memcpy(&key, h + i * (Py_ssize_t)sizeof key, sizeof key);
            Py_ssize_t at = -1;
            uint64_t bucket = (key * M1) >> shift;
            const uint64_t *row = table + bucket * WAYS;
            for (int w = 0; w < WAYS; w++) {
                if (row[w] == key) {
                    at = (Py_ssize_t)(bucket * WAYS + w);
                    break;
                }
            }
            if (at < 0) {
                bucket = (key * M2) >> shift;
                row = table + bucket * WAYS;
                for (int w = 0; w < WAYS; w++) {
                    if (row[w] == key) {
                        at = (Py_ssize_t)(bucket * WAYS + w);
                        break;
                    }
                }
            }
            memcpy(pos + i * (Py_ssize_t)sizeof at, &at, sizeof at);
            found += at >= 0;
        }
        result = PyLong_FromSsize_t(found);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&hashes);
    PyBuffer_Release(&keys);
    return result;
}

static PyMethodDef methods[] = {
    {"parse_hashes", parse_hashes, METH_O, "A JSON array of 64-bit integers as uint64 bytes, or None."},
    {"find", find, METH_VARARGS, "BlockTable._find: each hash's flat slot or -1 into out; how many found."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hashfind", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hashfind(void) { return PyModule_Create(&module); }
