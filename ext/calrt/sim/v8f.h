/* The 8-float vector and the one horizontal sum of the kernels' reduction (matmul.c's linear
 * layers and kernels.c's attention share it: the bitwise batch invariance rests on both using the
 * same tree). v8f values only pass between static inline functions: no ABI is exposed. */
#ifndef CALRT_SIM_V8F_H
#define CALRT_SIM_V8F_H

#include <string.h>

#pragma GCC diagnostic ignored "-Wpsabi"

typedef float v8f __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f ld8(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) */
#define HSUM8(a) ((((a)[0] + (a)[4]) + ((a)[2] + (a)[6])) + (((a)[1] + (a)[5]) + ((a)[3] + (a)[7])))

#endif
