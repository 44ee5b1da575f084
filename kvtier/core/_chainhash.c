/* The chain of block keys, prev = SHA-256(head || prev || frame_i), in one C loop.
 *
 * kvtier/core/keys.py computes the same thing in Python; this module only removes
 * the per-block interpreter and hashlib object costs (about 0.7 us a block here,
 * which is most of keying a 128 k-token prompt in 16-token blocks). The digest
 * is OpenSSL's SHA-256 (SHA-NI where the CPU has it), fetched once. Optional:
 * keys.py falls back to Python when this extension was not built, and the tests
 * check that both paths give the same bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>

#define KEY_BYTES 32

static const EVP_MD *sha256_md;

/* chain(prev: 32 bytes, head: bytes, frames: buffer, width: int) -> list[bytes]
 * frames holds n = len(frames) / width frames of `width` bytes each. */
static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer prev, head, frames;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "y*y*y*n", &prev, &head, &frames, &width))
        return NULL;
    PyObject *result = NULL;
    unsigned char *out = NULL;
    if (prev.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "the parent key must be %d bytes, got %zd", KEY_BYTES, prev.len);
        goto done;
    }
    if (width <= 0 || frames.len % width != 0) {
        PyErr_Format(PyExc_ValueError, "frames (%zd bytes) must be whole frames of width %zd", frames.len, width);
        goto done;
    }
    Py_ssize_t n = frames.len / width;
    out = PyMem_Malloc(n > 0 ? (size_t)n * KEY_BYTES : 1);
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS  /* the buffers stay held by this call */
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    const unsigned char *last = prev.buf;
    const unsigned char *frame = frames.buf;
    ok = ctx != NULL;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        unsigned char *key = out + i * KEY_BYTES;
        ok = EVP_DigestInit_ex(ctx, sha256_md, NULL)
             && EVP_DigestUpdate(ctx, head.buf, (size_t)head.len)
             && EVP_DigestUpdate(ctx, last, KEY_BYTES)
             && EVP_DigestUpdate(ctx, frame + i * width, (size_t)width)
             && EVP_DigestFinal_ex(ctx, key, NULL);
        last = key;
    }
    EVP_MD_CTX_free(ctx);
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
        goto done;
    }
    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)out + i * KEY_BYTES, KEY_BYTES);
        if (key == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, key);
    }
done:
    PyMem_Free(out);
    PyBuffer_Release(&prev);
    PyBuffer_Release(&head);
    PyBuffer_Release(&frames);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "prev = SHA-256(head || prev || frame) over equal-width frames; the keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chainhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chainhash(void) {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    /* fetched once: EVP_sha256() would look the implementation up on every init */
    sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
    sha256_md = EVP_sha256();
#endif
    if (sha256_md == NULL) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL has no SHA-256");
        return NULL;
    }
    return PyModule_Create(&module);
}
