/* test_vexp64.c — calserve.vexp64's exp (ext/vexp64_core.h) against this machine's libm exp,
 * bitwise (NaN as NaN): the sampler's range, the whole double range, every bit pattern, the table
 * index's rounding ties, the edges of its main path and every buffer length up to 9 (the 4-wide
 * loop and its tail). Run by `make asan-test` under ASan/UBSan and at -O3. Without AVX2 + FMA the
 * function is libm's exp itself, and the test says so. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../vexp64_core.h"

#define XORSHIFT_SEED 0x2545F4914F6CDD1DULL
#include "xorshift.h"

static long failures = 0;

static void check(const double *x, size_t n) {
  double *y = malloc(sizeof(double) * (n ? n : 1));
  if (!y) exit(2);
  memcpy(y, x, sizeof(double) * n);
  vexp64_inplace(y, n);
  for (size_t i = 0; i < n; i++) {
    const double want = exp(x[i]);
    if (memcmp(&want, &y[i], sizeof want) != 0 && !(want != want && y[i] != y[i]) && failures++ < 10)
      fprintf(stderr, "vexp64: exp(%a) = %a, libm %a\n", x[i], y[i], want);
  }
  free(y);
}

int main(void) {
  enum { N = 1 << 20 };
  double *x = malloc(sizeof(double) * N);
  if (!x) return 2;
  for (int round = 0; round < 6; round++) {
    for (size_t i = 0; i < N; i++) {
      switch (i % 6) {
      case 0: x[i] = -unit() * 60.0; break;                 /* the sampler's: x / T - max */
      case 1: x[i] = (unit() - 0.5) * 1600.0; break;         /* both sides of |x| = 512 */
      case 2: { uint64_t b = next(); memcpy(&x[i], &b, sizeof b); break; } /* every bit pattern */
      case 3: x[i] = ((double)((int64_t)(next() % 140000) - 70000) + 0.5) / (0x1.71547652b82fep0 * 128); break;
      case 4: x[i] = (unit() - 0.5) * 0x1p-50; break;        /* around |x| = 2^-54 */
      default: x[i] = -log1p(unit() * 1e6); break;
      }
    }
    check(x, N);
  }
  const double edges[] = {0.0, -0.0, INFINITY, -INFINITY, NAN, 5e-324, -5e-324, 0x1p-54, -0x1p-54,
                          0x1.fffffffffffffp-55, 512.0, -512.0, 0x1.fffffffffffffp8, 709.782712893384,
                          709.7827128933841, -708.3964185322641, -745.1332191019411, -745.1332191019412,
                          1e308, -1e308};
  check(edges, sizeof edges / sizeof edges[0]);
  for (size_t n = 0; n <= 9; n++) check(x + 3, n); /* the loop's tail, unaligned */
  free(x);
  double probe = -1.0;
  const int vec = vexp64_inplace(&probe, 1);
  if (failures) {
    fprintf(stderr, "vexp64: %ld mismatches\n", failures);
    return 1;
  }
  printf("vexp64: all bitwise equal to libm exp (%s)\n", vec ? "AVX2 path" : "no AVX2 + FMA here: libm itself");
  return 0;
}
