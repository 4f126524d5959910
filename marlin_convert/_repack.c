/*
 * Fast path of marlin_convert.layout.gptq_to_marlin_weight: GPTQ words -> Marlin tile words in one pass, for 4-bit
 * and 8-bit codes.
 *
 * The numpy implementation (layout.py) needs several passes over the matrix plus transposes whose innermost loops
 * are 2 to 4 elements long; these loops read each source word once and write each output word once. They compute
 * exactly what layout.py's docstring derives (and tests/test_layout.py checks both against the loop references).
 *
 * 4-bit: output word (strip t, 64-column block G, lane column c, row pair rb, tile j) is built from byte rb of four
 *   source words:  a  = qweight[2t    ][64G + 16j + c]     (rows 16t + 2rb, +1 of column c)
 *                  b  = qweight[2t + 1][64G + 16j + c]     (rows 16t + 8 + 2rb, +1)
 *                  a8 = qweight[2t    ][64G + 16j + 8 + c] (the same rows, column c + 8)
 *                  b8 = qweight[2t + 1][64G + 16j + 8 + c]
 *   nibbles, low to high: lo(a) lo(b) lo(a8) lo(b8) hi(a) hi(b) hi(a8) hi(b8)
 *   at position  t * 2N + 128 G + 16 c + 4 rb + j  (lane = 4c + rb owns words 4 lane + j of the block).
 *
 * 8-bit: GPTQ word qweight[4t + w][col] holds rows 16t + 4w .. 16t + 4w + 3 of column col, one per byte, low first.
 *   Lane (c, rb) with r = 2 rb needs of tile j, at column col = 64G + 16j + 8h + c (h = 0: column c, h = 1: c + 8),
 *   the bytes (low to high) of rows r, r+8, r+1, r+9: table order (r, r+1, r+8, r+9) reordered by [0, 2, 1, 3].
 *   It finds them in word  t * 4N + 256 G + 8 (4c + rb) + 2j + h  (lane owns words 8 lane + 2j + h of the block).
 *   Write rb = 2 rb1 + rb0. Rows r, r+1 are bytes 2 rb0, 2 rb0 + 1 of  a = qweight[4t + rb1][col]  and rows r+8,
 *   r+9 the same bytes of  b = qweight[4t + 2 + rb1][col]. So one pair (a, b) feeds two output words, rb0 = 0 and 1:
 *     rb0 = 0:  a.byte0 | b.byte0 << 8 | a.byte1 << 16 | b.byte1 << 24
 *     rb0 = 1:  a.byte2 | b.byte2 << 8 | a.byte3 << 16 | b.byte3 << 24
 *   i.e. the bytes of a and b interleaved, low halves into one word and high halves into the other.
 *
 * Plain C99, no dependency beyond CPython; the GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

static void repack4(const uint32_t *src, uint32_t *dst, Py_ssize_t k, Py_ssize_t n) {
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

static void repack8(const uint32_t *src, uint32_t *dst, Py_ssize_t k, Py_ssize_t n) {
    for (Py_ssize_t t = 0; t < k / 16; t++) {
        const uint32_t *strip = src + (4 * t) * n;  /* rows 16t .. 16t+15: words 4t .. 4t+3 of each column */
        uint32_t *out = dst + t * 4 * n;
        for (Py_ssize_t block = 0; block < n / 64; block++) {
            const uint32_t *s = strip + 64 * block;
            uint32_t *o = out + 256 * block;
            for (int j = 0; j < 4; j++) {
                for (int h = 0; h < 2; h++) {
                    for (int c = 0; c < 8; c++) {
                        int col = 16 * j + 8 * h + c;
                        for (int rb1 = 0; rb1 < 2; rb1++) {
                            uint32_t a = s[rb1 * n + col], b = s[(2 + rb1) * n + col];
                            /* bytes 0, 1 of a and b -> rb0 = 0; bytes 2, 3 -> rb0 = 1 (see the header) */
                            uint32_t low_halves = (a & 0xFFu) | ((b & 0xFFu) << 8) | ((a & 0xFF00u) << 8) |
                                                  ((b & 0xFF00u) << 16);
                            uint32_t high_halves = ((a >> 16) & 0xFFu) | ((b >> 8) & 0xFF00u) |
                                                   ((a >> 8) & 0xFF0000u) | (b & 0xFF000000u);
                            int lane = 4 * c + 2 * rb1;
                            o[8 * lane + 2 * j + h] = low_halves;
                            o[8 * (lane + 1) + 2 * j + h] = high_halves;
                        }
                    }
                }
            }
        }
    }
}

/* Checks the buffers of a (qweight [k*bits/32, n], out [k/16, n*bits/2]) pair of int32 arrays and runs the repack
 * of that width on them with the GIL released. "y*" and "w*" accept only C-contiguous buffers (the buffer protocol
 * raises otherwise), so a size check is all that is left to do here. */
static PyObject *run_repack(PyObject *args, int bits,
                            void (*repack)(const uint32_t *, uint32_t *, Py_ssize_t, Py_ssize_t)) {
    Py_buffer src, dst;
    Py_ssize_t k, n;
    if (!PyArg_ParseTuple(args, "y*w*nn", &src, &dst, &k, &n)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t bytes = k / 8 * n * bits;  /* k * n * bits / 8: both buffers hold every code once */
    if (k <= 0 || n <= 0 || k % 16 || n % 64) {
        PyErr_Format(PyExc_ValueError, "K = %zd must divide by 16 and N = %zd by 64", k, n);
    } else if (src.len != bytes || dst.len != bytes) {
        PyErr_Format(PyExc_ValueError, "buffer sizes %zd / %zd do not match K = %zd, N = %zd at %d bits", src.len,
                     dst.len, k, n, bits);
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

/*
 * Inverses (marlin_convert.verify rebuilds GPTQ from Marlin with them): read what repack4 / repack8 wrote and put
 * every byte back. 4-bit: the four output words of (strip t, block G, lane column c, tile j), rb = 0..3, hold byte
 * rb of lo0 / lo1 / hi0 / hi1 in their bytes 0 / 1 / 2 / 3; gather them, then split the nibbles:
 *   a = lo(lo0) | lo(hi0) << 4      b = hi(lo0) >> 4 | hi(hi0)     (the same with lo1 / hi1 for a8, b8)
 * 8-bit: the words of lanes (c, 2 rb1) and (c, 2 rb1 + 1) hold the interleaved bytes of a and b (see the header).
 */
static void unrepack4(const uint32_t *src, uint32_t *dst, Py_ssize_t k, Py_ssize_t n) {
    const uint32_t low = 0x0F0F0F0Fu, high = 0xF0F0F0F0u;
    for (Py_ssize_t t = 0; t < k / 16; t++) {
        uint32_t *upper = dst + (2 * t) * n;
        uint32_t *lower = upper + n;
        const uint32_t *in = src + t * 2 * n;
        for (Py_ssize_t block = 0; block < n / 64; block++) {
            uint32_t *u = upper + 64 * block, *l = lower + 64 * block;
            const uint32_t *o = in + 128 * block;
            for (int j = 0; j < 4; j++) {
                for (int c = 0; c < 8; c++) {
                    uint32_t lo0 = 0, lo1 = 0, hi0 = 0, hi1 = 0;
                    for (int rb = 0; rb < 4; rb++) {
                        uint32_t word = o[16 * c + 4 * rb + j];
                        int shift = 8 * rb;
                        lo0 |= (word & 0xFFu) << shift;
                        lo1 |= ((word >> 8) & 0xFFu) << shift;
                        hi0 |= ((word >> 16) & 0xFFu) << shift;
                        hi1 |= ((word >> 24) & 0xFFu) << shift;
                    }
                    u[16 * j + c] = (lo0 & low) | ((hi0 & low) << 4);
                    l[16 * j + c] = ((lo0 >> 4) & low) | (hi0 & high);
                    u[16 * j + 8 + c] = (lo1 & low) | ((hi1 & low) << 4);
                    l[16 * j + 8 + c] = ((lo1 >> 4) & low) | (hi1 & high);
                }
            }
        }
    }
}

static void unrepack8(const uint32_t *src, uint32_t *dst, Py_ssize_t k, Py_ssize_t n) {
    for (Py_ssize_t t = 0; t < k / 16; t++) {
        uint32_t *strip = dst + (4 * t) * n;
        const uint32_t *in = src + t * 4 * n;
        for (Py_ssize_t block = 0; block < n / 64; block++) {
            uint32_t *s = strip + 64 * block;
            const uint32_t *o = in + 256 * block;
            for (int j = 0; j < 4; j++) {
                for (int h = 0; h < 2; h++) {
                    for (int c = 0; c < 8; c++) {
                        int col = 16 * j + 8 * h + c;
                        for (int rb1 = 0; rb1 < 2; rb1++) {
                            int lane = 4 * c + 2 * rb1;
                            uint32_t low_halves = o[8 * lane + 2 * j + h], high_halves = o[8 * (lane + 1) + 2 * j + h];
                            s[rb1 * n + col] = (low_halves & 0xFFu) | ((low_halves >> 8) & 0xFF00u) |
                                               ((high_halves & 0xFFu) << 16) | ((high_halves & 0xFF0000u) << 8);
                            s[(2 + rb1) * n + col] = ((low_halves >> 8) & 0xFFu) | ((low_halves >> 16) & 0xFF00u) |
                                                     ((high_halves & 0xFF00u) << 8) | (high_halves & 0xFF000000u);
                        }
                    }
                }
            }
        }
    }
}

/* gptq_to_marlin(qweight_buffer, out_buffer, k, n): 4-bit, C-contiguous int32 buffers [k/8, n] and [k/16, 2n]. */
static PyObject *gptq_to_marlin(PyObject *self, PyObject *args) { return run_repack(args, 4, repack4); }

/* gptq8_to_marlin(qweight_buffer, out_buffer, k, n): 8-bit, C-contiguous int32 buffers [k/4, n] and [k/16, 4n]. */
static PyObject *gptq8_to_marlin(PyObject *self, PyObject *args) { return run_repack(args, 8, repack8); }

/* marlin_to_gptq(b_buffer, qweight_buffer, k, n): 4-bit inverse, C-contiguous int32 [k/16, 2n] and [k/8, n]. */
static PyObject *marlin_to_gptq(PyObject *self, PyObject *args) { return run_repack(args, 4, unrepack4); }

/* marlin8_to_gptq(b_buffer, qweight_buffer, k, n): 8-bit inverse, C-contiguous int32 [k/16, 4n] and [k/4, n]. */
static PyObject *marlin8_to_gptq(PyObject *self, PyObject *args) { return run_repack(args, 8, unrepack8); }

/*
 * scatter_rows(src, dst, perm, k, n, bits): GPTQ words whose row i holds original row perm[i] (the act-order order
 * of the Marlin tiles) -> GPTQ words in the original row order: code (i, col) of src goes to (perm[i], col) of dst.
 * src and dst int32 [k * bits / 32, n], perm int32 [k] a permutation of 0..k-1 (checked first: values in range,
 * each used once; ValueError otherwise, dst untouched). dst is overwritten.
 */
static int scatter(const uint32_t *src, uint32_t *dst, const int32_t *perm, Py_ssize_t k, Py_ssize_t n, int bits) {
    const int per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    unsigned char *seen = calloc((size_t)k, 1);
    if (seen == NULL) return -2;
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t row = perm[i];
        if (row < 0 || row >= k || seen[row]) {
            free(seen);
            return -1;
        }
        seen[row] = 1;
    }
    free(seen);
    for (Py_ssize_t i = 0; i < k * n / per_word; i++) dst[i] = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t row = perm[i];
        const uint32_t *s = src + (i / per_word) * n;
        uint32_t *d = dst + (row / per_word) * n;
        int from = bits * (int)(i % per_word), to = bits * (int)(row % per_word);
        for (Py_ssize_t col = 0; col < n; col++) {
            d[col] |= ((s[col] >> from) & mask) << to;
        }
    }
    return 0;
}

static PyObject *scatter_rows(PyObject *self, PyObject *args) {
    Py_buffer src, dst, perm;
    Py_ssize_t k, n;
    int bits;
    if (!PyArg_ParseTuple(args, "y*w*y*nni", &src, &dst, &perm, &k, &n, &bits)) return NULL;
    PyObject *result = NULL;
    if ((bits != 4 && bits != 8) || k <= 0 || n <= 0 || k % (32 / bits)) {
        PyErr_Format(PyExc_ValueError, "bits = %d must be 4 or 8 and K = %zd a multiple of %d", bits, k, 32 / bits);
    } else if (src.len != k * bits / 8 * n || dst.len != src.len || perm.len != k * 4) {
        PyErr_Format(PyExc_ValueError, "buffer sizes %zd / %zd / %zd do not match K = %zd, N = %zd", src.len,
                     dst.len, perm.len, k, n);
    } else if (!PyBuffer_IsContiguous(&src, 'C') || !PyBuffer_IsContiguous(&dst, 'C') ||
               !PyBuffer_IsContiguous(&perm, 'C')) {
        PyErr_SetString(PyExc_ValueError, "buffers must be C-contiguous");
    } else {
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = scatter((const uint32_t *)src.buf, (uint32_t *)dst.buf, (const int32_t *)perm.buf, k, n, bits);
        Py_END_ALLOW_THREADS
        if (status == -2) {
            PyErr_NoMemory();
        } else if (status) {
            PyErr_Format(PyExc_ValueError, "perm is not a permutation of 0..%zd", k - 1);
        } else {
            result = Py_None;
            Py_INCREF(result);
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&perm);
    return result;
}

static PyMethodDef methods[] = {
    {"gptq_to_marlin", gptq_to_marlin, METH_VARARGS, "Repack GPTQ 4-bit words into Marlin tile words."},
    {"gptq8_to_marlin", gptq8_to_marlin, METH_VARARGS, "Repack GPTQ 8-bit words into Marlin tile words."},
    {"marlin_to_gptq", marlin_to_gptq, METH_VARARGS, "Marlin tile words back into GPTQ 4-bit words."},
    {"marlin8_to_gptq", marlin8_to_gptq, METH_VARARGS, "Marlin tile words back into GPTQ 8-bit words."},
    {"scatter_rows", scatter_rows, METH_VARARGS, "Put the rows of GPTQ words back in their original order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_repack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__repack(void) { return PyModule_Create(&module); }
