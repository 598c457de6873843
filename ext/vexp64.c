/* vexp64.c — calserve.vexp64: exp() over a float64 buffer in place, the same bits as glibc's exp.
 *
 * The sampler's draws (calserve/engine/sampler.py) weigh the vocabulary by exp(x / T - max) in
 * float64, and numpy vectorises float64 exp only on AVX-512 CPUs: elsewhere each element is a call
 * of libm's exp (~5 ns; 4 of the ~5 ms of a seeded B16 sampling step over 49,152 tokens on a 2-vCPU
 * AMD EPYC). This computes glibc's algorithm (2.28+, from Arm's optimized-routines: exp(x) =
 * 2^(k/128) * exp(r), a 128-entry table and a degree-5 polynomial) four elements at a time with
 * AVX2, with the multiply-adds fused exactly where glibc's FMA build (the one x86-64 glibc runs on
 * such CPUs) fuses them — the product InvLn2N * x into + Shift, both reductions of r, the
 * polynomial's and the final scale + scale * tmp — so each result is bitwise what that exp returns.
 * Elements outside its main path (|x| < 2^-54, |x| >= 512, inf, NaN) are computed by libm's exp
 * itself. Results are only used after calserve/engine/fastexp.py's start-up probe found them equal
 * to numpy's exp on the running machine (else numpy's exp is used); tests/engine_parts compare them
 * on millions of inputs. Without AVX2 + FMA every element is libm's exp (no gain, same bits).
 * The computation itself is in vexp64_core.h (shared with its C test); this file is the binding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "vexp64_core.h"

/* exp_inplace(buffer): every element of a writable, C-contiguous float64 buffer replaced by its exp;
 * returns True when the vector path ran (False: libm element by element). */
static PyObject *exp_inplace(PyObject *self, PyObject *arg) {
  (void)self;
  Py_buffer view;
  if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
  if (view.itemsize != 8 || !view.format || strcmp(view.format, "d") != 0) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_TypeError, "exp_inplace needs a float64 buffer");
    return NULL;
  }
  double *p = view.buf;
  const size_t n = (size_t)(view.len / 8);
  int vec = 0;
  Py_BEGIN_ALLOW_THREADS
  vec = vexp64_inplace(p, n);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  return PyBool_FromLong(vec);
}

static PyMethodDef methods[] = {
    {"exp_inplace", exp_inplace, METH_O, "exp of every element of a float64 buffer, in place (glibc's bits)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "calserve.vexp64", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_vexp64(void) { return PyModule_Create(&module); }
