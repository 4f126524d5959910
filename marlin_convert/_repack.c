/*
 * Fast path of marlin_convert.layout.gptq_to_marlin_weight: GPTQ 4-bit words -> Marlin tile words in one pass.
 *
 * The numpy implementation (layout.py) needs three passes over the matrix plus two transposes whose innermost
 * loops are 2 to 4 elements long; this loop reads each source word once and writes each output word once.
 * It computes exactly what layout.py's docstring derives (and tests/test_layout.py checks both against the
 * loop-based reference):
 *
 *   output word (strip t, 64-column block G, lane column c, row pair rb, tile j) is built from byte rb of four
 *   source words:  a  = qweight[2t    ][64G + 16j + c]     (rows 16t + 2rb, +1 of column c)
 *                  b  = qweight[2t + 1][64G + 16j + c]     (rows 16t + 8 + 2rb, +1)
 *                  a8 = qweight[2t    ][64G + 16j + 8 + c] (the same rows, column c + 8)
 *                  b8 = qweight[2t + 1][64G + 16j + 8 + c]
 *   nibbles, low to high: lo(a) lo(b) lo(a8) lo(b8) hi(a) hi(b) hi(a8) hi(b8)
 *   at position  t * 2N + 128 G + 16 c + 4 rb + j  (lane = 4c + rb owns words 4 lane + j of the block).
 *
 * Plain C99, no dependency beyond CPython; the GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static void repack(const uint32_t *src, uint32_t *dst, Py_ssize_t k, Py_ssize_t n) {
    const uint32_t low = 0x0F0F0F0Fu, high = 0xF0F0F0F0u;
    for (Py_ssize_t t = 0; t < k / 16; t++) {
        const uint32_t *upper = src + (2 * t) * n;  /* rows 16t .. 16t+7 */
        const uint32_t *lower = upper + n;          /* rows 16t+8 .. 16t+15 */
        uint32_t *out = dst + t * 2 * n;
        for (Py_ssize_t block = 0; block < n / 64; block++) {
            const uint32_t *u = upper + 64 * block, *l = lower + 64 * block;
            uint32_t *o = out + 128 * block;
            for (int j = 0; j < 4; j++) {
                for (int c = 0; c < 8; c++) {
                    uint32_t a = u[16 * j + c], b = l[16 * j + c];
                    uint32_t a8 = u[16 * j + 8 + c], b8 = l[16 * j + 8 + c];
                    /* byte rb of lo0: lo(a) | lo(b) << 4 ; of hi0: hi(a) | hi(b) << 4 (same for column c + 8) */
                    uint32_t lo0 = (a & low) | ((b & low) << 4), hi0 = ((a >> 4) & low) | (b & high);
                    uint32_t lo1 = (a8 & low) | ((b8 & low) << 4), hi1 = ((a8 >> 4) & low) | (b8 & high);
                    for (int rb = 0; rb < 4; rb++) {
                        int shift = 8 * rb;
                        o[16 * c + 4 * rb + j] = ((lo0 >> shift) & 0xFFu) | (((lo1 >> shift) & 0xFFu) << 8) |
                                                 (((hi0 >> shift) & 0xFFu) << 16) | (((hi1 >> shift) & 0xFFu) << 24);
                    }
                }
            }
        }
    }
}

/* gptq_to_marlin(qweight_buffer, out_buffer, k, n): both C-contiguous int32 buffers, [k/8, n] and [k/16, 2n]. */
static PyObject *gptq_to_marlin(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t k, n;
    if (!PyArg_ParseTuple(args, "y*w*nn", &src, &dst, &k, &n)) return NULL;
    PyObject *result = NULL;
    if (k <= 0 || n <= 0 || k % 16 || n % 64) {
        PyErr_Format(PyExc_ValueError, "K = %zd must divide by 16 and N = %zd by 64", k, n);
    } else if (src.len != k / 8 * n * 4 || dst.len != k / 16 * 2 * n * 4) {
        PyErr_Format(PyExc_ValueError, "buffer sizes %zd / %zd do not match K = %zd, N = %zd", src.len, dst.len, k, n);
    } else if (!PyBuffer_IsContiguous(&src, 'C') || !PyBuffer_IsContiguous(&dst, 'C')) {
        PyErr_SetString(PyExc_ValueError, "buffers must be C-contiguous");
    } else {
        Py_BEGIN_ALLOW_THREADS
        repack((const uint32_t *)src.buf, (uint32_t *)dst.buf, k, n);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"gptq_to_marlin", gptq_to_marlin, METH_VARARGS, "Repack GPTQ 4-bit words into Marlin tile words."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_repack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__repack(void) { return PyModule_Create(&module); }
