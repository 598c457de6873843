/* topp.c — calserve.topp: the sampler's vocabulary truncations in place: the top-p (nucleus) cut of
 * a batch of sampling weights, min-p's zeroing, and the grammar masks on the logits.
 *
 * The sampler's top-p draw (calserve/engine/nucleus.py) finds each row's nucleus from a histogram of
 * its float64 weights over 1,025 probability buckets. In numpy that is a bucket array, a weighted
 * bincount, two comparisons and a multiply over the whole [rows, vocab] matrix: ~3.4 of the ~7 ms
 * of a top-p B16 draw over SmolLM2's 49,152 tokens. Here it is two passes over each row with the
 * same arithmetic in the same order (topp_core.h), so the same bits; the boundary bucket's few
 * tokens are still ranked in Python. Nothing here depends on CalRT.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "topp_core.h"

static int get(PyObject *o, Py_buffer *view, const char *fmt, int writable, const char *what) {
  int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(o, view, flags) < 0) return -1;
  const int want_int = fmt[0] == 'q';
  const int ok = view->itemsize == 8 && view->format &&
                 (want_int ? (strcmp(view->format, "q") == 0 || strcmp(view->format, "l") == 0)
                           : strcmp(view->format, "d") == 0);
  if (!ok) {
    PyBuffer_Release(view);
    PyErr_Format(PyExc_TypeError, "topp.cut: %s must be a C-contiguous %s buffer", what,
                 want_int ? "int64" : "float64");
    return -1;
  }
  return 0;
}

/* cut(e, z, top_p, before, counts, cols): e [m, v] float64 (in place), z and top_p [m] float64, out:
 * before [m] float64, counts [m] int64, cols (>= m * v int64: row r's boundary ids after those of
 * the rows before it). */
static PyObject *cut(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *oe, *oz, *op, *ob, *oc, *ocols;
  if (!PyArg_ParseTuple(args, "OOOOOO", &oe, &oz, &op, &ob, &oc, &ocols)) return NULL;
  Py_buffer e, z, p, b, c, cols;
  if (get(oe, &e, "d", 1, "e") < 0) return NULL;
  if (get(oz, &z, "d", 0, "z") < 0) goto fail_e;
  if (get(op, &p, "d", 0, "top_p") < 0) goto fail_z;
  if (get(ob, &b, "d", 1, "before") < 0) goto fail_p;
  if (get(oc, &c, "q", 1, "counts") < 0) goto fail_b;
  if (get(ocols, &cols, "q", 1, "cols") < 0) goto fail_c;
  const Py_ssize_t m = z.len / 8;
  if (m <= 0 || p.len / 8 != m || b.len / 8 != m || c.len / 8 != m || e.len / 8 % m != 0 ||
      cols.len < e.len) {
    PyErr_SetString(PyExc_ValueError, "topp.cut: shapes do not agree");
    goto fail_cols;
  }
  const size_t v = (size_t)(e.len / 8 / m);
  double *ew = e.buf, *bw = b.buf;
  const double *zw = z.buf, *pw = p.buf;
  int64_t *cw = c.buf, *colw = cols.buf;
  Py_BEGIN_ALLOW_THREADS
  size_t off = 0;
  for (Py_ssize_t r = 0; r < m; r++) {
    const size_t n = topp_cut_row(ew + (size_t)r * v, v, zw[r], pw[r], &bw[r], colw + off);
    cw[r] = (int64_t)n;
    off += n;
  }
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&cols);
  PyBuffer_Release(&c);
  PyBuffer_Release(&b);
  PyBuffer_Release(&p);
  PyBuffer_Release(&z);
  PyBuffer_Release(&e);
  Py_RETURN_NONE;
fail_cols:
  PyBuffer_Release(&cols);
fail_c:
  PyBuffer_Release(&c);
fail_b:
  PyBuffer_Release(&b);
fail_p:
  PyBuffer_Release(&p);
fail_z:
  PyBuffer_Release(&z);
fail_e:
  PyBuffer_Release(&e);
  return NULL;
}

/* drop_below(e, min_p): e [m, v] float64 (in place), min_p [m] float64: every weight below its row's
 * min_p set to +0.0 (min-p: the best token weighs exactly 1), what numpy.copyto(e, 0.0, where=e <
 * min_p[:, None]) does, in one pass and no mask. */
static PyObject *drop_below(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *oe, *op;
  if (!PyArg_ParseTuple(args, "OO", &oe, &op)) return NULL;
  Py_buffer e, p;
  if (get(oe, &e, "d", 1, "e") < 0) return NULL;
  if (get(op, &p, "d", 0, "min_p") < 0) {
    PyBuffer_Release(&e);
    return NULL;
  }
  const Py_ssize_t m = p.len / 8;
  if (m <= 0 || e.len / 8 % m != 0) {
    PyBuffer_Release(&p);
    PyBuffer_Release(&e);
    PyErr_SetString(PyExc_ValueError, "topp.drop_below: shapes do not agree");
    return NULL;
  }
  const size_t v = (size_t)(e.len / 8 / m);
  double *ew = e.buf;
  const double *pw = p.buf;
  Py_BEGIN_ALLOW_THREADS
  for (Py_ssize_t r = 0; r < m; r++) topp_drop_row(ew + (size_t)r * v, v, pw[r]);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&p);
  PyBuffer_Release(&e);
  Py_RETURN_NONE;
}

/* apply_mask(x, rows, words): x [n, v] float32 (in place), rows [k] int64 (rows of x), words [k, nw]
 * int32: row rows[j]'s tokens outside mask j set to -inf, what numpy.copyto(x[rows[j]], -inf,
 * where=unpackbits(words[j], bitorder="little")[:v] == 0) does, without the [k, v] bit array. */
static PyObject *apply_mask(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ox, *orows, *ow;
  if (!PyArg_ParseTuple(args, "OOO", &ox, &orows, &ow)) return NULL;
  Py_buffer x, rows, w;
  if (PyObject_GetBuffer(ox, &x, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
  if (get(orows, &rows, "q", 0, "rows") < 0) {
    PyBuffer_Release(&x);
    return NULL;
  }
  if (PyObject_GetBuffer(ow, &w, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) < 0) {
    PyBuffer_Release(&rows);
    PyBuffer_Release(&x);
    return NULL;
  }
  PyObject *res = NULL;
  if (x.itemsize != 4 || !x.format || strcmp(x.format, "f") != 0 || x.ndim != 2 || w.itemsize != 4 ||
      !w.format || !(strcmp(w.format, "i") == 0 || strcmp(w.format, "I") == 0) || w.ndim != 2) {
    PyErr_SetString(PyExc_TypeError, "topp.apply_mask needs float32 x [n, v] and int32 words [k, nw]");
    goto done;
  }
  const Py_ssize_t n = x.shape[0], v = x.shape[1], k = rows.len / 8, nw = w.shape[1];
  if (w.shape[0] != k) {
    PyErr_SetString(PyExc_ValueError, "topp.apply_mask: one mask per row");
    goto done;
  }
  const int64_t *rw = rows.buf;
  for (Py_ssize_t j = 0; j < k; j++)
    if (rw[j] < 0 || rw[j] >= n) {
      PyErr_SetString(PyExc_IndexError, "topp.apply_mask: row out of range");
      goto done;
    }
  uint32_t *xb = x.buf;
  const uint32_t *wb = w.buf;
  Py_BEGIN_ALLOW_THREADS
  for (Py_ssize_t j = 0; j < k; j++)
    topp_mask_row(xb + (size_t)rw[j] * (size_t)v, (size_t)v, wb + (size_t)j * (size_t)nw, (size_t)nw);
  Py_END_ALLOW_THREADS
  res = Py_None;
  Py_INCREF(res);
done:
  PyBuffer_Release(&w);
  PyBuffer_Release(&rows);
  PyBuffer_Release(&x);
  return res;
}

static PyMethodDef methods[] = {
    {"cut", cut, METH_VARARGS, "the top-p cut of each row of a float64 weight matrix, in place"},
    {"drop_below", drop_below, METH_VARARGS, "min-p: weights below their row's min_p set to 0, in place"},
    {"apply_mask", apply_mask, METH_VARARGS, "grammar masks: tokens outside each row's bitmask set to -inf, in place"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "calserve.topp", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_topp(void) { return PyModule_Create(&module); }
