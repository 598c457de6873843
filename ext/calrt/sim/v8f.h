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

/* acc + w * x per element with one rounding (the linear layers' fused multiply-add, matmul.c),
 * portably: fmaf() element by element (the tiles off x86; x86's use FMA instructions). A macro:
 * as a function taking v8f by value GCC notes an ABI change for callers without AVX. */
#define fma8(acc, w, x)                                                                    \
  __extension__({                                                                          \
    const v8f a_ = (acc), w_ = (w), x_ = (x);                                              \
    v8f r_;                                                                                \
    for (int i_ = 0; i_ < 8; i_++) r_[i_] = __builtin_fmaf(w_[i_], x_[i_], a_[i_]);       \
    r_;                                                                                    \
  })

/* ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) */
#define HSUM8(a) ((((a)[0] + (a)[4]) + ((a)[2] + (a)[6])) + (((a)[1] + (a)[5]) + ((a)[3] + (a)[7])))

typedef int v8i __attribute__((vector_size(32)));

/* HSUM8 of eight accumulators at once: s[i] = HSUM8(a[i]), each the same three levels of additions
 * on the same operands (so bitwise HSUM8's), done on whole vectors: 7 adds and 15 shuffles for the
 * eight sums where eight HSUM8s extract and add element by element. Level 1 pairs each accumulator's
 * halves (a0+a4, a1+a5, a2+a6, a3+a7), level 2 pairs those (p0+p2, p1+p3), level 3 adds the two. */
static inline __attribute__((always_inline)) v8f hsum8x8(const v8f a[8]) {
  const v8i LO = {0, 1, 2, 3, 8, 9, 10, 11}, HI = {4, 5, 6, 7, 12, 13, 14, 15};
  v8f t[4];
  for (int i = 0; i < 4; i++) /* [p(a[2i]) | p(a[2i+1])] */
    t[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], LO) + __builtin_shuffle(a[2 * i], a[2 * i + 1], HI);
  const v8i E = {0, 1, 8, 9, 4, 5, 12, 13}, O = {2, 3, 10, 11, 6, 7, 14, 15};
  /* [q0 r0 q2 r2 | q1 r1 q3 r3] for accumulators 0..3, then 4..7: q = p0 + p2, r = p1 + p3 */
  const v8f u = __builtin_shuffle(t[0], t[1], E) + __builtin_shuffle(t[0], t[1], O);
  const v8f v = __builtin_shuffle(t[2], t[3], E) + __builtin_shuffle(t[2], t[3], O);
  const v8i Q = {0, 2, 8, 10, 4, 6, 12, 14}, R = {1, 3, 9, 11, 5, 7, 13, 15};
  const v8f s = __builtin_shuffle(u, v, Q) + __builtin_shuffle(u, v, R); /* [s0 s2 s4 s6 | s1 s3 s5 s7] */
  return __builtin_shuffle(s, (v8i){0, 4, 1, 5, 2, 6, 3, 7});
}

#endif
