/*
 * bus._chaincore: the prompt key chain's inner loop, one XXH3-128 per chunk.
 *
 * bus/prompt_chain.py defines the chain (key[i] = H(key[i-1] || chunk[i]), H = XXH3-128
 * as its 16-byte big-endian digest) and is its only caller. In Python the loop costs a
 * slice, a concatenation, a hash call and an append per chunk: 8.7 us for the 34 chunks
 * of an 8k-token prompt, where XXH3 itself needs about 2 us. Here the chunk is copied
 * behind the previous key in one reused buffer and hashed, so the call costs the hashing
 * and one bytes object per key.
 *
 * xxhash.h is XXH3 0.8.3 as released (BSD 2-Clause, its own header carries the licence),
 * compiled inline: the same function the `xxhash` package wraps, which
 * tests/unit/test_prompt_chain.py checks key for key and the golden vectors pin.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define KEY_BYTES 16

PyDoc_STRVAR(chain_extend_doc,
"chain_extend(key, data, chunk_bytes, /)\n--\n\n"
"The keys of every full chunk of data in a chain whose last key is key (the root\n"
"before the first chunk): a list of 16-byte keys, none for a tail shorter than a chunk.\n"
"\n"
"Raises ValueError when key is not 16 bytes long or chunk_bytes < 1, TypeError when\n"
"key or data is not a bytes-like object.");

static PyObject *
chain_extend(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError,
                     "chain_extend() takes 3 arguments (key, data, chunk_bytes), %zd given",
                     nargs);
        return NULL;
    }
    Py_ssize_t chunk = PyLong_AsSsize_t(args[2]);
    if (chunk == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (chunk < 1) {
        PyErr_Format(PyExc_ValueError, "chunk_bytes must be >= 1, got %zd", chunk);
        return NULL;
    }
    Py_buffer key, data;
    if (PyObject_GetBuffer(args[0], &key, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (key.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "a chain key is %d bytes, got %zd", KEY_BYTES, key.len);
        PyBuffer_Release(&key);
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&key);
        return NULL;
    }
    Py_ssize_t n = data.len / chunk;
    PyObject *out = PyList_New(n);
    unsigned char *buf = NULL;
    if (out != NULL && n > 0) {
        if ((size_t)chunk > PY_SSIZE_T_MAX - KEY_BYTES
            || (buf = PyMem_Malloc((size_t)chunk + KEY_BYTES)) == NULL) {
            PyErr_NoMemory();
            Py_CLEAR(out);
        }
    }
    if (buf != NULL) {
        const unsigned char *p = data.buf;
        memcpy(buf, key.buf, KEY_BYTES);
        for (Py_ssize_t i = 0; i < n; i++) {
            XXH128_canonical_t digest;
            memcpy(buf + KEY_BYTES, p + i * chunk, (size_t)chunk);
            XXH128_canonicalFromHash(&digest, XXH3_128bits(buf, (size_t)chunk + KEY_BYTES));
            PyObject *k = PyBytes_FromStringAndSize((const char *)digest.digest, KEY_BYTES);
            if (k == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, k);
            memcpy(buf, digest.digest, KEY_BYTES);
        }
        PyMem_Free(buf);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    return out;
}

static PyMethodDef chaincore_methods[] = {
    {"chain_extend", (PyCFunction)(void (*)(void))chain_extend, METH_FASTCALL,
     chain_extend_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef chaincore_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "bus._chaincore",
    .m_doc = "The prompt key chain's inner loop (bus.prompt_chain is its interface).",
    .m_size = 0,
    .m_methods = chaincore_methods,
};

PyMODINIT_FUNC
PyInit__chaincore(void)
{
    return PyModuleDef_Init(&chaincore_module);
}
